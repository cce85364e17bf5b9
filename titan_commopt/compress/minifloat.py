"""The outer wire of the dense local-step families: FP8 (E4M3) or FP4 (E3M0) codes with a block scale.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, §2.4) sends each replica's unreduced
pseudo-gradient Δ in 4 bits, E3M0 (1 sign bit, 3 exponent bits, no mantissa), and accumulates the
replicas' values in FP32. This module is that wire's encoding, one block at a time:

- **Blocks.** Every tensor's flat local values are cut into blocks of :data:`BLOCK` (256) elements,
  the last one padded with zeros, never shared with another tensor (so a tensor's codes do not depend
  on what it is sent with: fragments and fused syncs give the same bits). Each block has one scale,
  its absolute maximum ``s``, sent as float32 (exact: the largest value of every block decodes
  exactly). Why blocks: E3M0 spans only 64× below its scale, so one scale per tensor would let one
  outlier flush the tensor's small values to 0; a block confines that to its 256 values. Why 256: 4
  bytes per 256 values add 1/8 bit per value, fp4 is then 4.125 bits a value (7.76× fewer than fp32)
  and fp8 8.125 (3.94×); 128 would cost 4.25 bits (7.5×), a bfloat16 scale would save 1/16 bit.
- **fp4 = E3M0.** A code is ``sign << 3 | e``, e in 0..7: e = 0 is 0, e ≥ 1 is ±s·2^(e−7), so a
  block holds 0 and ±s·{2^−6, …, 2^−1, 1}: seven magnitudes, the smallest 1/64 of the largest. A value
  goes to the nearest of them *in value* (linear, as a cast rounds, not in log space: between 2^k and
  2^(k+1) the midpoint is 1.5·2^k, not √2·2^k; ties go up), and below s·2^−7 (midway to the smallest)
  to 0. Deterministic, so biased like any round-to-nearest (no stochastic rounding: every replica and a
  simulation get the same bits).
- **fp8 = E4M3.** ``torch.float8_e4m3fn`` of v·448/s (448: its largest finite value; the cast rounds
  to nearest, ties to even), decoded as code·s/448: a relative error of at most 2^−4 (half a step of
  3 mantissa bits) where |v|·448/s ≥ 2^−6 (E4M3's normal range), an absolute one of at most
  s·2^−10/448 below it (half its subnormal step).

On the wire a payload is every block's codes (fp4 two to a byte, ``packing.pack_bits``; fp8 one byte)
followed by every block's float32 scale: ``nbytes`` bytes, a function of the tensors' sizes alone.
A block with a non-finite value decodes to NaN throughout (its scale is NaN): the mean it enters is
non-finite, as an fp32 all-reduce's would be (the training container skips steps with non-finite
gradients before the optimizer sees them). Everything is tensor code on the values' device, a
chunk of :data:`_ROWS` blocks at a time: no loop over values and no host synchronization.
"""

import functools
import math
from typing import Iterable, Literal, Optional, Sequence

import torch

from .packing import from_bytes, pack_bits, to_bytes, unpack_bits

__all__ = ["BLOCK", "OUTER_WIRES", "MiniFloatWire"]

BLOCK = 256  # values per scale
_ROWS = 1 << 14  # blocks coded at once (4 Mi values): bounds encode's and decode's temporaries
OUTER_WIRES = ("fp8", "fp4")
_E3M0_BIAS = 7  # e = 7 is the block's maximum, 2^0·s
_E4M3_MAX = 448.0  # torch.float8_e4m3fn's largest finite value


class MiniFloatWire:
    """Blocks of :data:`BLOCK` values as ``fmt`` codes ("fp8": E4M3, "fp4": E3M0) with a float32
    absmax scale each (the module docstring)."""

    def __init__(self, fmt: Literal["fp8", "fp4"]):
        if fmt not in OUTER_WIRES:
            raise ValueError(f"fmt = {fmt!r}: allowed is one of {OUTER_WIRES}")
        self.fmt, self.bits = fmt, 8 if fmt == "fp8" else 4

    # ---- sizes: the one byte formula (the family's r_bytes and the ledger read it) -------------------
    @staticmethod
    def blocks(n: int) -> int:
        """Blocks of a tensor of ``n`` values."""
        return -(-n // BLOCK)

    def nbytes(self, numels: Iterable[int]) -> int:
        """Payload bytes of tensors of these sizes: per block BLOCK·bits/8 bytes of codes + 4 of scale."""
        return sum(self.blocks(n) for n in numels) * (BLOCK * self.bits // 8 + 4)

    # ---- the layout: tensors ↔ (G, BLOCK) float32 blocks ------------------------------------------
    def to_blocks(self, values: Iterable[torch.Tensor], numels: Sequence[int]) -> torch.Tensor:
        """``values`` (tensors of ``numels`` elements, any dtype, made one at a time: a generator of
        temporaries keeps one alive) → float32 ``(G, BLOCK)``, each tensor zero-padded to whole blocks."""
        counts = [self.blocks(n) for n in numels]
        out = None
        offset = 0
        for v, n, count in zip(values, numels, counts):
            if out is None:
                out = torch.zeros(sum(counts) * BLOCK, dtype=torch.float32, device=v.device)
            out[offset : offset + n].copy_(v.reshape(-1))
            offset += count * BLOCK
        if out is None:
            out = torch.zeros(0, dtype=torch.float32)
        return out.view(-1, BLOCK)

    def from_blocks(self, blocks: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
        """Inverse of :meth:`to_blocks`: each tensor's flat values, views into ``blocks``."""
        flat, out, offset = blocks.reshape(-1), [], 0
        for n in numels:
            out.append(flat[offset : offset + n])
            offset += self.blocks(n) * BLOCK
        return out

    # ---- codes --------------------------------------------------------------------------------------
    def quantize(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(G, BLOCK)`` → (uint8 codes ``(G, BLOCK)``, float32 scales ``(G,)``)."""
        amax = blocks.abs().amax(-1) if blocks.numel() else blocks.new_zeros(blocks.shape[0])
        # NaN for a block with a non-finite value (amax of an Inf is Inf, of a NaN NaN): decodes to NaN
        scale = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.nan))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # 0 and NaN: codes 0
        if self.fmt == "fp8":
            scaled = (blocks / safe * _E4M3_MAX).clamp_(-_E4M3_MAX, _E4M3_MAX).nan_to_num_(0.0)
            return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale
        r = (blocks.abs() / safe).nan_to_num_(0.0)  # in [0, 1]
        mantissa, exponent = torch.frexp(r)  # r = m·2^e, m in [0.5, 1): between 2^(e−1) and 2^e
        k = exponent - 1 + (mantissa >= 0.75).to(exponent.dtype)  # nearest power of two in value
        field = torch.where(r >= 2.0 ** -(_E3M0_BIAS), (k + _E3M0_BIAS).clamp_(min=1), torch.zeros_like(k))
        return (field | ((blocks < 0) & (field > 0)).to(field.dtype) << 3).to(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`quantize` up to its rounding: float32 ``(G, BLOCK)`` (fp4 codes may be any
        integer dtype, fp8 ones are uint8)."""
        if self.fmt == "fp8":
            return codes.view(torch.float8_e4m3fn).float() * (scale / _E4M3_MAX).unsqueeze(-1)
        return _e3m0_table(codes.device)[codes.long()] * scale.unsqueeze(-1)

    # ---- the payload: coded :data:`_ROWS` blocks at a time (the temporaries stay a few MB) -------------
    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """float32 ``(G, BLOCK)`` → the uint8 payload: every block's codes, then every scale."""
        g, row = blocks.shape[0], BLOCK * self.bits // 8
        out = torch.empty(g * (row + 4), dtype=torch.uint8, device=blocks.device)
        codes_out, scales_out = out[: g * row].view(g, row), out[g * row :]
        for start in range(0, g, _ROWS):
            codes, scale = self.quantize(blocks[start : start + _ROWS])
            codes_out[start : start + len(codes)] = codes if self.bits == 8 else pack_bits(codes, 4)
            scales_out[4 * start : 4 * (start + len(codes))] = to_bytes(scale, torch.float32)
        return out

    def decode(self, payload: torch.Tensor, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A payload of :meth:`encode` → float32 ``(G, BLOCK)``, a new tensor; or added to ``into``
        (returned), so a sum of shares needs no decoded copy of each."""
        row = BLOCK * self.bits // 8
        g = payload.numel() // (row + 4)
        codes, scales = payload[: g * row].view(g, row), from_bytes(payload[g * row :], torch.float32)
        out = torch.empty(g, BLOCK, dtype=torch.float32, device=payload.device) if into is None else into
        for start in range(0, g, _ROWS):
            rows = codes[start : start + _ROWS]
            values = self.dequantize(rows if self.bits == 8 else unpack_bits(rows, BLOCK, 4),
                                     scales[start : start + len(rows)])
            if into is None:
                out[start : start + len(rows)] = values
            else:
                out[start : start + len(rows)] += values
        return out


_E3M0 = [0.0] + [2.0 ** (e - _E3M0_BIAS) for e in range(1, 8)]


@functools.lru_cache(maxsize=16)
def _e3m0_table(device: torch.device) -> torch.Tensor:
    """The 16 E3M0 values relative to the scale: codes 0..7 positive (0 = zero), 8..15 their negatives."""
    return torch.tensor(_E3M0 + [-v for v in _E3M0], dtype=torch.float32, device=device)
