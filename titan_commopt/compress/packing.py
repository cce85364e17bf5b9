"""Wire packing: indices in ``ceil(log2(L))`` bits, ternary {−1, 0, +1} in 2 bits, floats as raw bytes.

Everything becomes ``uint8`` so one all-gather carries every parameter's payload; sizes are a
function of shapes and options only, so the receiver knows where each segment starts.
"""

import math

import torch

__all__ = ["bits_bytes", "pack_bits", "unpack_bits", "pack_ternary", "unpack_ternary", "float_bytes",
           "to_bytes", "from_bytes", "WIRE_DTYPES"]

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
