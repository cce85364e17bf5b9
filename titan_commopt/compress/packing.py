"""Wire packing: indices in ``ceil(log2(L))`` bits, ternary {−1, 0, +1} in 2 bits, floats as raw bytes.

Everything becomes ``uint8`` so one all-gather carries every parameter's payload; sizes are a
function of shapes and options only, so the receiver knows where each segment starts.
:class:`ValueCodec` and :class:`IndexCodec` are the two wire formats the replicators use, built on
the bit-level functions below.
"""

import functools
import math

import torch

from titan_commopt.comm import ceil_log2

__all__ = ["bits_bytes", "pack_bits", "unpack_bits", "pack_ternary", "unpack_ternary", "float_bytes",
           "to_bytes", "from_bytes", "WIRE_DTYPES", "ValueCodec", "IndexCodec"]

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bits_bytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` fields of ``bits`` bits each, packed back to back."""
    return math.ceil(n * bits / 8)


@functools.lru_cache(maxsize=None)
def _bit_layout(bits: int) -> tuple[int, int, tuple[tuple[int, int, int, int, int], ...]]:
    """How ``f`` fields of ``bits`` bits fill ``nb`` whole bytes (``f·bits = 8·nb``, the shortest such
    run): one ``(byte, field, field_shift, width, byte_shift)`` per piece of a field inside a byte."""
    g = math.gcd(bits, 8)
    f, nb = 8 // g, bits // g
    pieces = []
    for byte in range(nb):
        for field in range(f):
            lo, hi = max(8 * byte, field * bits), min(8 * byte + 8, (field + 1) * bits)
            if lo < hi:
                pieces.append((byte, field, lo - field * bits, hi - lo, lo - 8 * byte))
    return f, nb, tuple(pieces)


def _word_dtype(bits: int) -> torch.dtype:
    return torch.int32 if bits <= 30 else torch.int64


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2**bits → ``uint8`` bytes, little-endian bit order (field ``j`` holds
    bits ``[j·bits, (j+1)·bits)`` of the stream, bit 0 = the least significant bit of byte 0).

    The fields of the last dim of ``values`` are packed row by row (each row padded with zero bits to
    whole bytes: ``(..., bits_bytes(n, bits))``); a 1-D input gives the flat stream. Shifts on whole
    words: ``f`` fields make ``nb`` bytes exactly (``f·bits = 8·nb``), and each output byte is the OR
    of the few field pieces that land in it, so nothing is expanded per bit.
    """
    f, nb, pieces = _bit_layout(bits)
    *lead, n = values.shape
    m = -(-n // f)  # units of f fields
    v = values.reshape(-1, n).to(_word_dtype(bits))
    if m * f != n:
        v = torch.nn.functional.pad(v, (0, m * f - n))
    v = v.view(-1, m, f)
    if nb == 1:  # bits divides 8: the f fields of a byte shifted into place (disjoint bits: sum = OR)
        shifts = torch.arange(0, 8, bits, device=v.device, dtype=v.dtype)
        packed = (v << shifts).sum(-1, dtype=v.dtype).to(torch.uint8)
        return packed[:, : bits_bytes(n, bits)].reshape(*lead, -1)
    out = [None] * nb
    for byte, field, shift, width, to in pieces:
        piece = v[..., field]
        if shift:
            piece = piece >> shift
        if shift + width < bits:
            piece = piece & ((1 << width) - 1)
        if to:
            piece = piece << to
        out[byte] = piece if out[byte] is None else out[byte] | piece
    packed = torch.stack(out, -1).to(torch.uint8)  # every byte < 256 by construction
    return packed.view(v.shape[0], m * nb)[:, : bits_bytes(n, bits)].reshape(*lead, -1)


def unpack_bits(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` fields of every row of ``data`` (a 1-D stream or
    ``(..., bits_bytes(n, bits))`` rows), as int64 ``(..., n)``."""
    f, nb, pieces = _bit_layout(bits)
    *lead, size = data.shape
    m = -(-n // f)
    if nb == 1:  # bits divides 8: every byte's f fields from one lookup
        fields = _byte_fields(bits, data.device)[data.reshape(-1, size)[:, :m].to(torch.int64)]
        return fields.view(-1, m * f)[:, :n].reshape(*lead, n)
    d = data.reshape(-1, size)[:, : m * nb].to(_word_dtype(bits))
    if d.shape[1] < m * nb:
        d = torch.nn.functional.pad(d, (0, m * nb - d.shape[1]))
    d = d.view(-1, m, nb)
    out = [None] * f
    for byte, field, shift, width, to in pieces:
        piece = d[..., byte]
        if to:
            piece = piece >> to
        if to + width < 8:
            piece = piece & ((1 << width) - 1)
        if shift:
            piece = piece << shift
        out[field] = piece if out[field] is None else out[field] | piece
    fields = torch.stack(out, -1).view(d.shape[0], m * f)[:, :n]
    return fields.to(torch.int64).reshape(*lead, n)


@functools.lru_cache(maxsize=16)
def _byte_fields(bits: int, device: torch.device) -> torch.Tensor:
    """``(256, 8 // bits)`` int64: the fields of every byte value, lowest bits first."""
    byte = torch.arange(256, dtype=torch.int64).unsqueeze(-1)
    return ((byte >> torch.arange(0, 8, bits)) & ((1 << bits) - 1)).to(device)


@functools.lru_cache(maxsize=16)
def _ternary_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(256, 4)``: the four ternary values {−1, 0, +1} of every byte (code − 1)."""
    return (_byte_fields(2, torch.device("cpu")) - 1).to(device=device, dtype=dtype)


def pack_ternary(values: torch.Tensor) -> torch.Tensor:
    """Values in {−1, 0, +1} → 2 bits each (code = value + 1), row by row like :func:`pack_bits`."""
    return pack_bits(values.round().to(torch.int32) + 1, 2)


def unpack_ternary(data: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_ternary` (row by row): one table lookup per byte."""
    *lead, size = data.shape
    m = -(-n // 4)
    values = _ternary_table(data.device, dtype)[data.reshape(-1, size)[:, :m].to(torch.int64)]
    return values.view(-1, m * 4)[:, :n].reshape(*lead, n)


def float_bytes(n: int, dtype: torch.dtype) -> int:
    return n * torch.empty((), dtype=dtype).element_size()


def to_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype`` and reinterpreted as raw ``uint8`` (exact for the cast values); the last
    dim's values of every row become that row's bytes (a 1-D input: one flat run)."""
    t = t.to(dtype, copy=True)  # a copy: the caller edits t next
    return t.reshape(-1).view(torch.uint8).view(*t.shape[:-1], -1) if t.dim() else t.reshape(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of raw bytes (the last dim) → rows of ``dtype`` values; copies only when ``data`` is not
    a contiguous run at a multiple of the element size (a segment of the fused buffer may be)."""
    size = torch.empty((), dtype=dtype).element_size()
    if not data.is_contiguous() or data.storage_offset() % size:
        data = data.clone(memory_format=torch.contiguous_format)
    return data.view(dtype)


def _aligned(out: torch.Tensor, dtype: torch.dtype) -> bool:
    size = torch.empty((), dtype=dtype).element_size()
    return out.is_contiguous() and out.storage_offset() % size == 0 and out.shape[-1] % size == 0


class ValueCodec:
    """Selected values on the wire: with ``sign`` only their signs are sent — ternary in 2 bits each
    when ``pack``, else as ``wire_dtype`` floats — and without ``sign`` the values in ``wire_dtype``.
    Every method works row by row on the last dim (``n`` values ↔ ``nbytes(n)`` bytes per row)."""

    def __init__(self, sign: bool, wire_dtype: torch.dtype, pack: bool):
        self.sign, self.wire_dtype = sign, wire_dtype
        self.ternary = sign and pack

    def nbytes(self, n: int) -> int:
        return bits_bytes(n, 2) if self.ternary else float_bytes(n, self.wire_dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        v = values.sign() if self.sign else values
        return pack_ternary(v) if self.ternary else to_bytes(v, self.wire_dtype)

    def encode_into(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`encode` written into ``out`` (``uint8``, ``(..., nbytes(n))``, e.g. a slice of the
        fused send buffer): floats are cast straight into it where it is aligned for ``wire_dtype``."""
        if not self.ternary and _aligned(out, self.wire_dtype):
            out.view(self.wire_dtype).copy_(values.sign() if self.sign else values)
        else:
            out.copy_(self.encode(values))

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` values of every row of ``data`` (exactly ``nbytes(n)`` bytes each) as float32."""
        return unpack_ternary(data, n) if self.ternary else from_bytes(data, self.wire_dtype).float()


class IndexCodec:
    """Indices in ``range(bound)``: ``ceil(log2(bound))`` bits each when ``pack``, else int64 (the
    DeMo reference's format). Row by row on the last dim, as :class:`ValueCodec`."""

    def __init__(self, bound: int, pack: bool):
        self.bits, self.pack = ceil_log2(bound), pack

    def nbytes(self, n: int) -> int:
        return bits_bytes(n, self.bits) if self.pack else 8 * n

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        return pack_bits(idx, self.bits) if self.pack else to_bytes(idx, torch.int64)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return unpack_bits(data, n, self.bits) if self.pack else from_bytes(data, torch.int64)
