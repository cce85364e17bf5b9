"""Wire packing: indices in ``ceil(log2(L))`` bits, ternary {−1, 0, +1} in 2 bits, floats as raw bytes.

Everything becomes ``uint8`` so one all-gather carries every parameter's payload; sizes are a
function of shapes and options only, so the receiver knows where each segment starts.
:class:`ValueCodec` and :class:`IndexCodec` are the two wire formats the replicators use, built on
the bit-level functions below.
"""

import math

import torch

from titan_commopt.comm import ceil_log2

__all__ = ["bits_bytes", "pack_bits", "unpack_bits", "pack_ternary", "unpack_ternary", "float_bytes",
           "to_bytes", "from_bytes", "WIRE_DTYPES", "ValueCodec", "IndexCodec"]

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bits_bytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` fields of ``bits`` bits each, packed back to back."""
    return math.ceil(n * bits / 8)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2**bits → ``uint8`` bytes (little-endian bit order)."""
    v = values.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, device=v.device)
    flat = ((v.unsqueeze(-1) >> shifts) & 1).reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = 1 << torch.arange(8, device=v.device)
    return (flat.reshape(-1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` fields as int64."""
    shifts = torch.arange(8, device=data.device)
    flat = ((data.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(-1)[: n * bits]
    weights = 1 << torch.arange(bits, device=data.device)
    return (flat.reshape(n, bits) * weights).sum(-1)


def pack_ternary(values: torch.Tensor) -> torch.Tensor:
    """Values in {−1, 0, +1} → 2 bits each (code = value + 1)."""
    return pack_bits(values.reshape(-1).round().to(torch.int64) + 1, 2)


def unpack_ternary(data: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (unpack_bits(data, n, 2) - 1).to(dtype)


def float_bytes(n: int, dtype: torch.dtype) -> int:
    return n * torch.empty((), dtype=dtype).element_size()


def to_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype`` and reinterpreted as raw ``uint8`` (exact for the cast values)."""
    return t.reshape(-1).to(dtype, copy=True).view(torch.uint8)  # a copy: the caller edits t next


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    data = data.contiguous()
    if data.storage_offset() % torch.empty((), dtype=dtype).element_size():
        data = data.clone()  # a segment of the fused buffer may start at an odd byte
    return data.view(dtype)


class ValueCodec:
    """Selected values on the wire: with ``sign`` only their signs are sent — ternary in 2 bits each
    when ``pack``, else as ``wire_dtype`` floats — and without ``sign`` the values in ``wire_dtype``."""

    def __init__(self, sign: bool, wire_dtype: torch.dtype, pack: bool):
        self.sign, self.wire_dtype = sign, wire_dtype
        self.ternary = sign and pack

    def nbytes(self, n: int) -> int:
        return bits_bytes(n, 2) if self.ternary else float_bytes(n, self.wire_dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        v = values.sign() if self.sign else values
        return pack_ternary(v) if self.ternary else to_bytes(v, self.wire_dtype)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` values of ``data`` (exactly ``nbytes(n)`` bytes) as float32."""
        return unpack_ternary(data, n) if self.ternary else from_bytes(data, self.wire_dtype).float()


class IndexCodec:
    """Indices in ``range(bound)``: ``ceil(log2(bound))`` bits each when ``pack``, else int64 (the
    DeMo reference's format)."""

    def __init__(self, bound: int, pack: bool):
        self.bits, self.pack = ceil_log2(bound), pack

    def nbytes(self, n: int) -> int:
        return bits_bytes(n, self.bits) if self.pack else 8 * n

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        return pack_bits(idx, self.bits) if self.pack else to_bytes(idx, torch.int64)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return unpack_bits(data, n, self.bits) if self.pack else from_bytes(data, torch.int64)
