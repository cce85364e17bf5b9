"""Wire packing: indices in ``ceil(log2(L))`` bits, ternary {−1, 0, +1} in 2 bits, floats as raw bytes
(the ``packed`` wire), or a DeMo selection in the ``compact`` wire: Elias–Fano positions and 1-bit signs.

Everything becomes ``uint8`` so one all-gather carries every parameter's payload; sizes are a
function of shapes and options only, so the receiver knows where each segment starts.
:class:`ValueCodec` and :class:`IndexCodec` are the ``packed`` wire formats the replicators use,
:class:`CompactCodec` the ``compact`` one of DeMo's replicator, all built on the bit-level functions
below.
"""

import functools
import math
from typing import Optional

import torch

from titan_commopt.comm import ceil_log2

__all__ = ["bits_bytes", "pack_bits", "unpack_bits", "pack_ternary", "unpack_ternary", "float_bytes",
           "to_bytes", "from_bytes", "WIRE_DTYPES", "ValueCodec", "IndexCodec",
           "ef_low_bits", "EliasFano", "subset_bits", "CompactCodec"]

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
    """Rows of raw bytes (the last dim) → rows of ``dtype`` values; copies only when ``data`` cannot
    be reinterpreted in place: a segment of the fused buffer may start at any byte, and its rows
    are as far apart as the buffer's, any number of bytes (a row count of one still has that
    stride, which ``is_contiguous`` ignores but a reinterpreting view does not)."""
    if not _viewable(data, torch.empty((), dtype=dtype).element_size()):
        data = data.clone(memory_format=torch.contiguous_format)
    return data.view(dtype)


def _viewable(data: torch.Tensor, size: int) -> bool:
    """Whether ``data.view(<dtype of size bytes>)`` is legal: unit stride in the last dim, the
    start and every other stride a multiple of ``size``."""
    if data.dim() == 0 or data.numel() == 0:
        return data.is_contiguous()
    return (data.stride(-1) == 1 and data.storage_offset() % size == 0
            and all(stride % size == 0 for stride in data.stride()[:-1]))


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


# ---- the compact wire: Elias–Fano positions, 1-bit signs ---------------------------------------------
def ef_low_bits(L: int, k: int) -> int:
    """Low bits per position of :class:`EliasFano` for ``k`` of ``range(L)``: the ``l`` minimizing
    ``k·l + k + ((L − 1) >> l)`` (Elias 1974, Fano 1971 take ``l = floor(log2(L/k))``, which ties
    with it on the chunk sizes measured); ties go to the larger ``l`` (a shorter bitmap)."""
    return min(range(ceil_log2(L) + 1), key=lambda l: (k * l + k + ((L - 1) >> l), -l))


class EliasFano:
    """``k`` non-decreasing positions in ``range(L)`` per row in a fixed ``bits`` bits: ``l`` low bits
    of each (``k·l`` bits), then the high parts ``h_i = s_i >> l``, ``0 ≤ h_i ≤ H = (L − 1) >> l``,
    through ``u_i = h_i + i`` — strictly increasing even where positions repeat, so ``{u_i}`` is a
    ``k``-subset of ``range(k + H)``. That subset is written either as Elias–Fano's unary bitmap
    (``k + H`` bits, bit ``u_i`` set) or, where it is shorter, as its rank in the combinatorial number
    system, ``Σ_i C(u_i, i + 1) < C(k + H, k)``, in ``ceil(log2 C(k + H, k))`` bits (at most 62: one
    int64; ``l`` is then chosen smaller, down to what fits). For ``k = 16`` of 1024: ``l = 4``, 119 bits
    (7.44 per position; the bitmap form 127, the exact bound ``log2 C(1024, 16)`` 115.6); 32 of 4096:
    ``l = 7``, 284 bits (8.88; bound 266.2) — see :func:`subset_bits`.

    :meth:`encode` gives the fields — ``low`` ``(rows, k)`` and ``high``: the rank ``(rows,)`` or the
    bitmap ``(rows, k + H)`` — that a caller packs, each kind back to back over many rows
    (:func:`pack_bits` with ``l``, ``high_field_bits`` bits per field)."""

    RANK_BITS = 62  # a rank and every partial sum of it fit an int64

    def __init__(self, L: int, k: int):
        self.L, self.k = L, k
        l = ef_low_bits(L, k)
        best = (k * l + k + ((L - 1) >> l), l, False)  # (bits, l, ranked)
        for l in range(ceil_log2(L) + 1):
            rank_bits = (math.comb(k + ((L - 1) >> l), k) - 1).bit_length()
            if rank_bits <= self.RANK_BITS and k * l + rank_bits < best[0]:
                best = (k * l + rank_bits, l, True)
        self.bits, self.l, self.ranked = best
        self.H = (L - 1) >> self.l
        self.high_bits = self.bits - k * self.l
        # the high part as fields: one rank of high_bits bits, or k + H one-bit fields
        self.high_fields, self.high_field_bits = (1, self.high_bits) if self.ranked else (k + self.H, 1)

    def binomials(self, device: torch.device) -> torch.Tensor:
        """The ranked code's table of binomials ``C(u, j)`` (``(k + 1, k + H)`` int64) on ``device``."""
        return _binomial_table(self.k + self.H, self.k, self.RANK_BITS, torch.device(device))

    def encode(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, k)`` non-decreasing positions → ``(low, high)`` (int64 ``(rows, k)``, and int64
        ``(rows, 1)`` rank or ``uint8`` ``(rows, k + H)`` bitmap)."""
        rows, k, l, device = positions.shape[0], self.k, self.l, positions.device
        low = positions & ((1 << l) - 1)
        unary = (positions >> l) + torch.arange(k, device=device)  # u_i = h_i + i, strictly increasing
        if self.ranked:
            table = self.binomials(device)
            high = table[torch.arange(1, k + 1, device=device), unary].sum(-1, keepdim=True)  # Σ C(u_i, i + 1)
        else:
            high = torch.zeros(rows, k + self.H, dtype=torch.uint8, device=device)
            high.scatter_(1, unary, 1)
        return low, high

    def decode(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode` (``high`` as int64 fields): ``(rows, k)`` int64 positions."""
        rows, k, device = low.shape[0], self.k, low.device
        if self.ranked:
            # unranking, largest first: u_i is the largest u with C(u, i + 1) ≤ what is left of the
            # rank (a batched search over every row; k steps, none of them per row or per bit)
            table = self.binomials(device)
            rank = high.reshape(rows).clone()
            unary = torch.empty(rows, k, dtype=torch.int64, device=device)
            for i in range(k - 1, -1, -1):
                u = torch.searchsorted(table[i + 1], rank, right=True) - 1
                unary[:, i] = u
                rank -= table[i + 1][u]
        else:
            # the i-th set bit is where the running count of set bits first reaches i + 1: exactly k
            # per row, so a batched search gives them as a (rows, k) tensor, with no host read of a count
            count = high.to(torch.int32).cumsum(1, dtype=torch.int32)
            want = torch.arange(1, k + 1, device=device, dtype=torch.int32).expand(rows, k).contiguous()
            unary = torch.searchsorted(count, want)
        return ((unary - torch.arange(k, device=device)) << self.l) | low


@functools.lru_cache(maxsize=16)
def _binomial_table(n: int, k: int, cap_bits: int, device: torch.device) -> torch.Tensor:
    """``(k + 1, n)`` int64: row ``j`` holds ``C(u, j)`` for every ``u < n`` (non-decreasing in ``u``),
    capped at ``2**cap_bits`` (above every rank, so the cap changes no search)."""
    table = [[min(math.comb(u, j), 2**cap_bits) for u in range(n)] for j in range(k + 1)]
    return torch.tensor(table, dtype=torch.int64, device=device)


def subset_bits(L: int, k: int) -> float:
    """``log2 C(L, k)``: the fewest bits that tell one ``k``-subset of ``range(L)`` from the others."""
    return math.log2(math.comb(L, k))


def _pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` that also takes 0-bit fields (no bytes)."""
    if bits == 0 or values.shape[-1] == 0:
        return torch.zeros(*values.shape[:-1], 0, dtype=torch.uint8, device=values.device)
    return pack_bits(values, bits)


def _unpack_fields(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits == 0 or n == 0:
        return torch.zeros(*data.shape[:-1], n, dtype=torch.int64, device=data.device)
    return unpack_bits(data, n, bits)


class CompactCodec:
    """The ``compact`` wire of a DeMo selection: ``k`` of the ``L`` coefficients of every chunk, as
    :class:`EliasFano` coded positions and, with ``sign``, one bit per value; without ``sign`` the
    values in ``wire_dtype``. A shard of ``chunks`` chunks takes ``value_bytes(chunks)`` +
    ``index_bytes(chunks)`` bytes, a function of ``(L, k, chunks)`` only (headerless all-gather). The
    index bytes are the shard's low bits (``l`` each, back to back), then its high parts (a rank or
    a bitmap per chunk, back to back), each run padded once to whole bytes.

    Pairs are sent in position order (Elias–Fano needs sorted positions); a replica's pairs of one
    chunk are distinct positions, so the receiver's sum over replicas is unchanged by the order.

    With ``sign``, 1 bit cannot say 0, and top-k selects a zero coefficient when a chunk has fewer
    than ``k`` non-zeros. A zero is sent as a repeat of the position before it (the non-zeros come
    first, in position order, then ``k − c`` copies of the last one); Elias–Fano codes repeats as
    they are. A chunk with no non-zero at all (``c = 0``): every position 0 and, for ``k ≥ 2``, the
    sign bit of the (repeated) second pair set — a combination no chunk with ``c ≥ 1`` writes, since
    a repeat's sign bit is otherwise 0; for ``k = 1`` one more bit per chunk says whether the value
    is non-zero. So zeros decode as 0 and the size stays fixed; what is lost is only where a zero
    was selected, which matters to ``mean_selected`` alone: the DeMo replicator keeps the packed
    encoding there (``replicators.DeMoReplicator``)."""

    def __init__(self, L: int, k: int, sign: bool, wire_dtype: torch.dtype):
        self.L, self.k, self.sign, self.wire_dtype = L, k, sign, wire_dtype
        self.positions = EliasFano(L, k)
        self.value_bits = k + (k == 1) if sign else 0  # per chunk, with sign: signs (+ the k = 1 flag)
        self.floats = ValueCodec(False, wire_dtype, True)

    def value_bytes(self, chunks: int) -> int:
        return bits_bytes(chunks, self.value_bits) if self.sign else float_bytes(chunks * self.k, self.wire_dtype)

    def low_bytes(self, chunks: int) -> int:
        """Bytes of the Elias–Fano low-bit run of ``chunks`` chunks (where the high run starts)."""
        return bits_bytes(chunks * self.k, self.positions.l)

    def index_bytes(self, chunks: int) -> int:
        ef = self.positions
        return self.low_bytes(chunks) + bits_bytes(chunks * ef.high_fields, ef.high_field_bits)

    def encode_into(self, values: torch.Tensor, idx: torch.Tensor, value_out: torch.Tensor,
                    index_out: torch.Tensor) -> None:
        """``G`` shards' selections (``(G·chunks, k)`` values and distinct positions, any order) into
        ``value_out`` ``(G, value_bytes(chunks))`` and ``index_out`` ``(G, index_bytes(chunks))``."""
        G, (rows, k) = value_out.shape[0], idx.shape
        if not self.sign:
            positions, order = idx.sort(-1)
            self.floats.encode_into(values.gather(-1, order).view(G, -1), value_out)
        else:
            nonzero = values != 0
            # non-zeros first, in position order, then the zeros
            positions, order = (idx + self.L * (~nonzero)).sort(-1)
            positions = positions.clamp_max_(self.L - 1)  # the zeros' sort keys; replaced just below
            nonzero = nonzero.gather(-1, order)
            count = nonzero.sum(-1, keepdim=True)
            last = positions.gather(-1, (count - 1).clamp_min(0)) * (count > 0)  # 0 when no non-zero
            positions = torch.where(nonzero, positions, last)
            signs = (values.gather(-1, order) < 0) & nonzero
            if k >= 2:
                signs[:, 1] |= count[:, 0] == 0  # the all-zero chunk's mark
            else:
                signs = torch.cat([signs, nonzero], 1)  # k = 1: (sign, non-zero)
            value_out.copy_(_pack_fields(signs.view(G, -1), 1))
        ef, split = self.positions, self.low_bytes(rows // G)
        low, high = ef.encode(positions)
        index_out[:, :split].copy_(_pack_fields(low.view(G, -1), ef.l))
        index_out[:, split:].copy_(_pack_fields(high.view(G, -1), ef.high_field_bits))

    def decode(self, value_data: torch.Tensor, index_data: torch.Tensor,
               chunks: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(..., value_bytes)`` and ``(..., index_bytes)`` rows → ``(values float32, positions int64,
        sent)``, each ``(..., chunks, k)``; ``sent``: which pairs are selections (``None``: all are;
        with ``sign`` the non-zeros, see the class docstring)."""
        lead, k, ef = value_data.shape[:-1], self.k, self.positions
        rows, split = math.prod(lead) * chunks, self.low_bytes(chunks)
        low = _unpack_fields(index_data[..., :split], chunks * k, ef.l).reshape(rows, k)
        high = _unpack_fields(index_data[..., split:], chunks * ef.high_fields, ef.high_field_bits)
        positions = ef.decode(low, high.reshape(rows, ef.high_fields)).view(*lead, chunks, k)
        if not self.sign:
            values = from_bytes(value_data, self.wire_dtype).float().view(*lead, chunks, k)
            return values, positions, None
        flags = _unpack_fields(value_data, chunks * self.value_bits, 1).view(*lead, chunks, self.value_bits).bool()
        negative = flags[..., :k]
        if k >= 2:
            repeat = positions[..., 1:] == positions[..., :-1]
            first_zero = repeat[..., :1] & negative[..., 1:2]
            sent = ~torch.cat([first_zero, repeat], -1)
        else:
            sent = flags[..., 1:]
        values = (1.0 - 2.0 * negative.float()) * sent
        return values, positions, sent
