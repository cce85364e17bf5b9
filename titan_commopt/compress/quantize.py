"""Statistical k-bit quantization of selected values (SparseLoCo's 2-bit values) and its wire format.

The quantizer of the SparseLoCo reference code (Templar's ``QuantizationCompressor``): per tensor of
selected values ``v`` (here: per row of the input),

    shift = mean(v);  c = v − shift;  σ = ‖c‖ / √(n − 1)   (unbiased; 0 when n <= 1)
    scale = range·σ / bins   (1 when that is 0 or not finite)
    code  = clamp(round(c / scale + bins/2), 0, bins − 1)
    level[b] = mean of the c whose code is b (0 for an empty bin);   v̂ = level[code] + shift

The statistics come from sums (:meth:`StatisticalQuantizer.moments`: n, Σv, Σv²; then
:meth:`~StatisticalQuantizer.bin_sums`: Σc and the count of every bin), accumulated in float64, so a
tensor split over ranks gets the statistics of the whole tensor by summing its pieces' sums (the
caller's all-reduce between the two steps), with the same bits whatever the split in all but
pathological cases; σ² = (Σv² − n·shift²)/(n − 1) from them. Codes, levels and dequantized values
are float32 as in the reference, whose float32 sums these match to round-off.

On the wire a row is its codes in log₂(bins) bits each (``packing.pack_bits``) and its ``bins``
dequantization values ``level + shift`` as float32 (the reference sends ``shift`` and ``level``
apart; their sum is what every receiver computes, so sending the sum gives the same bits in
``bins`` floats instead of ``bins + 1``). Everything is row-wise tensor code: no loop over values.
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

    @staticmethod
    def moments(values: torch.Tensor) -> torch.Tensor:
        """``values`` ``(G, n)`` → float64 ``(G, 3)``: n, Σv, Σv² of every row (sums of pieces add up)."""
        v = values.double()
        return torch.stack([torch.full_like(v[:, 0], v.shape[-1]) if v.shape[-1] else v.new_zeros(v.shape[0]),
                            v.sum(-1), (v * v).sum(-1)], -1)

    def scale_of(self, moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`moments` (of whole rows) → ``(shift, scale)``, float32 ``(G, 1)`` each."""
        n, total, squares = moments.unbind(-1)
        mean = total / n.clamp_min(1)
        var = torch.where(n > 1, (squares - total * mean).clamp_min(0) / (n - 1).clamp_min(1), torch.zeros_like(n))
        shift, sigma = mean.float().unsqueeze(-1), var.sqrt().float().unsqueeze(-1)
        scale = self.range * sigma / self.bins
        return shift, torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)

    def codes(self, values: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """int64 codes ``(G, n)`` of ``values`` under ``(shift, scale)`` (:meth:`scale_of`)."""
        return ((values.float() - shift) / scale + self.bins // 2).round_().clamp_(0, self.bins - 1).long()

    def bin_sums(self, values: torch.Tensor, codes: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """float64 ``(G, 2·bins)``: Σc of every bin, then its count (sums of pieces add up)."""
        c = (values.float() - shift).double()
        out = torch.zeros(values.shape[0], 2 * self.bins, dtype=torch.float64, device=values.device)
        out[:, : self.bins].scatter_add_(-1, codes, c)
        out[:, self.bins:].scatter_add_(-1, codes, torch.ones_like(c))
        return out

    def levels(self, bin_sums: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """:meth:`bin_sums` (of whole rows) → the ``bins`` dequantized values ``level + shift``, float32."""
        sums, counts = bin_sums[:, : self.bins], bin_sums[:, self.bins:]
        lookup = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums)).float()
        return lookup + shift

    def norms(self, bin_sums: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """‖v̂‖ of every whole row from its bins (``Σ_b count_b · level_b²``), float32 ``(G,)``."""
        return (bin_sums[:, self.bins:] * levels.double().square()).sum(-1).sqrt().float()

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` ``(G, n)`` → ``(codes int64 (G, n), levels float32 (G, bins))``, each row's
        statistics its own; the dequantized values are ``levels.gather(-1, codes)``
        (:meth:`dequantize`). No host synchronization."""
        shift, scale = self.scale_of(self.moments(values))
        codes = self.codes(values, shift, scale)
        return codes, self.levels(self.bin_sums(values, codes, shift), shift)

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
