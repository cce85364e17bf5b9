"""DCT-II chunking of a tensor's local shard (DeMo eq. 3) and per-chunk top-k (eq. 4).

A tensor is viewed as 2-D ``(d0, rest)`` when it has two or more dims (a matrix: separable 2-D DCT per
``c0 × c1`` chunk) and as 1-D otherwise (``c`` per chunk). Each chunk size is the largest divisor of
its dim that is ≤ ``s``, so chunks tile the shard exactly; a prime dim larger than ``s`` gets chunk 1.
"""

import functools
import logging
import math

import torch

__all__ = ["chunk_size", "dct_basis", "Chunker", "topk_per_chunk", "scatter_chunks"]

logger = logging.getLogger(__name__)


def chunk_size(dim: int, s: int) -> int:
    """Largest divisor of ``dim`` that is ≤ ``s`` (``dim`` itself when ``dim ≤ s``)."""
    if dim <= s:
        return max(dim, 1)
    for c in range(s, 0, -1):
        if dim % c == 0:
            return c
    return 1  # unreachable: 1 divides everything


@functools.lru_cache(maxsize=None)
def _basis_cpu(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b


_DEVICE_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def dct_basis(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``B`` (``B @ x`` = coefficients, ``Bᵀ @ c`` = inverse), built once per size."""
    key = (n, torch.device(device), dtype)
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _basis_cpu(n).to(device=device, dtype=dtype)
    return _DEVICE_CACHE[key]


class Chunker:
    """Chunk + DCT of one local shape: ``encode(x) -> (n_chunks, L)`` coefficients, ``decode`` inverts."""

    def __init__(self, shape: torch.Size | tuple[int, ...], s: int, device=None, dtype=torch.float32):
        self.shape = tuple(shape)
        numel = math.prod(self.shape)
        if len(self.shape) >= 2:
            self.dims = (self.shape[0], numel // max(self.shape[0], 1))
        else:
            self.dims = (numel,)
        self.chunks = tuple(chunk_size(d, s) for d in self.dims)
        self.L = math.prod(self.chunks)
        self.n_chunks = numel // max(self.L, 1)
        self.bases = [dct_basis(c, device or "cpu", dtype) for c in self.chunks]
        for d, c in zip(self.dims, self.chunks):
            if d > s and c == 1:
                logger.warning("dim %d of shape %s has no divisor <= %d: chunk 1, top-k keeps everything "
                               "along it", d, self.shape, s)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.dims) == 1:
            (c,) = self.chunks
            return x.reshape(-1, c) @ self.bases[0].T  # rows are chunks: C = x Bᵀ
        (d0, d1), (c0, c1) = self.dims, self.chunks
        x = x.reshape(d0 // c0, c0, d1 // c1, c1).permute(0, 2, 1, 3)
        b0, b1 = self.bases
        return (b0 @ x @ b1.T).reshape(-1, self.L)  # separable 2-D DCT: B₀ X B₁ᵀ per chunk

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        if len(self.dims) == 1:
            return (coeffs @ self.bases[0]).reshape(self.shape)
        (d0, d1), (c0, c1) = self.dims, self.chunks
        b0, b1 = self.bases
        x = b0.T @ coeffs.reshape(d0 // c0, d1 // c1, c0, c1) @ b1  # inverse: B₀ᵀ C B₁
        return x.permute(0, 2, 1, 3).reshape(self.shape)


def topk_per_chunk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude coefficients of every chunk: ``(values, indices)``, each ``(n_chunks, k)``."""
    idx = coeffs.abs().topk(min(k, coeffs.shape[-1]), dim=-1, sorted=False).indices
    return coeffs.gather(-1, idx), idx


def scatter_chunks(values: torch.Tensor, idx: torch.Tensor, L: int) -> torch.Tensor:
    """Dense ``(n_chunks, L)`` coefficients holding ``values`` at ``idx``, zeros elsewhere."""
    out = values.new_zeros(values.shape[0], L)
    return out.scatter_(-1, idx, values)
