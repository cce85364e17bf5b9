"""Statistical k-bit quantization of selected values (SparseLoCo's 2-bit values) and its wire format.

The quantizer of the SparseLoCo reference code (Templar's ``QuantizationCompressor``): per tensor of
selected values ``v`` (here: per row of the input),

    shift = mean(v);  c = v − shift;  σ = ‖c‖ / √(n − 1)   (unbiased; 0 when n <= 1)
    scale = range·σ / bins   (1 when that is 0 or not finite)
    code  = clamp(round(c / scale + bins/2), 0, bins − 1)
    level[b] = mean of the c whose code is b (0 for an empty bin);   v̂ = level[code] + shift

in float32. On the wire a row is its codes in log₂(bins) bits each (``packing.pack_bits``) and its
``bins`` dequantization values ``level + shift`` as float32 (the reference sends ``shift`` and
``level`` apart; their sum is what every receiver computes, so sending the sum gives the same bits
in ``bins`` floats instead of ``bins + 1``). Everything is row-wise tensor code: no loop over values.
"""

import math

import torch

from .packing import bits_bytes, from_bytes, pack_bits, to_bytes, unpack_bits

__all__ = ["StatisticalQuantizer"]


class StatisticalQuantizer:
    """``bins`` levels (a power of two, 2 … 256) spread over ±``range_in_sigmas``/2 standard
    deviations of each row around its mean (the reference's ``range_in_sigmas``)."""

    def __init__(self, bins: int, range_in_sigmas: float):
        if bins < 2 or bins > 256 or bins & (bins - 1):
            raise ValueError(f"bins = {bins}: allowed is a power of two in [2, 256]")
        self.bins, self.bits, self.range = bins, int(math.log2(bins)), float(range_in_sigmas)

    def nbytes(self, n: int) -> int:
        """Bytes of one row of ``n`` values: the codes, then ``bins`` float32 levels."""
        return bits_bytes(n, self.bits) + 4 * self.bins

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` ``(G, n)`` → ``(codes int64 (G, n), levels float32 (G, bins))``; the dequantized
        values are ``levels.gather(-1, codes)`` (:meth:`dequantize`). No host synchronization."""
        v = values.float()
        n = v.shape[-1]
        shift = v.mean(-1, keepdim=True)
        c = v - shift
        sigma = c.norm(dim=-1, keepdim=True) / math.sqrt(n - 1) if n > 1 else torch.zeros_like(shift)
        scale = self.range * sigma / self.bins
        scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
        codes = (c / scale + self.bins // 2).round_().clamp_(0, self.bins - 1).long()
        sums = torch.zeros(v.shape[0], self.bins, device=v.device).scatter_add_(-1, codes, c)
        counts = torch.zeros_like(sums).scatter_add_(-1, codes, torch.ones_like(c))
        lookup = torch.where(counts > 0, sums / counts, torch.zeros_like(sums))
        return codes, lookup + shift

    @staticmethod
    def dequantize(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        return levels.gather(-1, codes)

    def encode_into(self, codes: torch.Tensor, levels: torch.Tensor, out: torch.Tensor) -> None:
        """Write rows (``(G, n)`` codes, ``(G, bins)`` levels) into ``out`` ``(G, nbytes(n))``."""
        split = bits_bytes(codes.shape[-1], self.bits)
        out[..., :split].copy_(pack_bits(codes, self.bits))
        out[..., split:].copy_(to_bytes(levels.float(), torch.float32))

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """Rows of ``nbytes(n)`` bytes (any leading dims) → the dequantized float32 values ``(..., n)``."""
        split = bits_bytes(n, self.bits)
        codes = unpack_bits(data[..., :split], n, self.bits)
        levels = from_bytes(data[..., split:], torch.float32)
        return levels.gather(-1, codes)
