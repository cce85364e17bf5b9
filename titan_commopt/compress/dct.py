"""DCT-II chunking of a tensor's local shard (DeMo eq. 3) and per-chunk top-k (eq. 4).

A tensor is viewed as 2-D ``(d0, rest)`` when it has two or more dims (a matrix: separable 2-D DCT per
``c0 × c1`` chunk) and as 1-D otherwise (``c`` per chunk). Each chunk size is the largest divisor of
its dim that is ≤ ``s``, so chunks tile the shard exactly; a prime dim larger than ``s`` gets chunk 1.

Layouts. A matrix shard ``(d0, d1)`` is ``(n0, c0, n1, c1)`` in *block* layout (a view of the shard
itself) and ``(n0, n1, c0, c1)`` in *chunk-major* layout, where every chunk is one contiguous run of
``L = c0·c1`` values: coefficients live chunk-major (so top-k is a per-row operation), parameters in
block layout. :class:`Chunker` transforms ``G`` same-shape shards at once with two matrix products
each way and no transposing copy: forward ``X B₁ᵀ`` (one GEMM over all rows), then ``B₀ (·)`` per
block row (a batched GEMM) gives block layout, read chunk-major through a permuted view; inverse
``C B₁`` then ``B₀ᵀ (·)`` per chunk, both on chunk-major data.
"""

import functools
import logging
import math
from typing import Optional, Sequence

import torch

__all__ = ["chunk_size", "dct_basis", "Chunker", "topk_per_chunk", "scatter_chunks", "accumulate_chunks_"]

logger = logging.getLogger(__name__)

BASIS_CACHE_SIZE = 32  # (size, device, dtype) triples kept; a model has a handful of chunk sizes


def chunk_size(dim: int, s: int) -> int:
    """Largest divisor of ``dim`` that is ≤ ``s`` (``dim`` itself when ``dim ≤ s``)."""
    if dim <= s:
        return max(dim, 1)
    for c in range(s, 0, -1):
        if dim % c == 0:
            return c
    return 1  # unreachable: 1 divides everything


@functools.lru_cache(maxsize=BASIS_CACHE_SIZE)
def _basis(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b.to(device=device, dtype=dtype)  # computed in float64 once, then rounded to the working dtype


def dct_basis(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``B`` (``B @ x`` = coefficients, ``Bᵀ @ c`` = inverse) in ``dtype`` on
    ``device``, from a bounded LRU cache keyed by (size, device, dtype)."""
    return _basis(n, torch.device(device), dtype)


class Chunker:
    """Chunk + DCT of one local shape (``encode``/``decode`` one tensor; ``forward``/``inverse``
    ``G`` of them at once, see the module docstring). ``chunks``: the chunk size along each of the
    two (or one) dims instead of the largest divisors ≤ ``s`` (each must divide its dim), e.g. a
    whole tensor's grid applied to a shard that it tiles."""

    def __init__(self, shape: torch.Size | tuple[int, ...], s: int, device=None, dtype=torch.float32,
                 chunks: Optional[Sequence[int]] = None):
        self.shape = tuple(shape)
        numel = math.prod(self.shape)
        self.numel = numel
        if len(self.shape) >= 2:
            self.dims = (self.shape[0], numel // max(self.shape[0], 1))
        else:
            self.dims = (numel,)
        self.chunks = tuple(chunk_size(d, s) for d in self.dims) if chunks is None else tuple(chunks)
        if len(self.chunks) != len(self.dims) or any(c < 1 or d % c for d, c in zip(self.dims, self.chunks)):
            raise ValueError(f"chunks {self.chunks} do not tile dims {self.dims} of shape {self.shape}")
        self.counts = tuple(d // c for d, c in zip(self.dims, self.chunks))  # chunks along each dim
        self.L = math.prod(self.chunks)
        self.n_chunks = numel // max(self.L, 1)
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        self.bases = [dct_basis(c, self.device, dtype) for c in self.chunks]
        self.bases_t = [b.T.contiguous() for b in self.bases]
        for d, c in zip(self.dims, self.chunks):
            if chunks is None and d > s and c == 1:
                logger.warning("dim %d of shape %s has no divisor <= %d: chunk 1, top-k keeps everything "
                               "along it", d, self.shape, s)

    # ---- layouts -----------------------------------------------------------------------------------
    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(..., *shape)``, contiguous) as ``(..., n0, c0, n1, c1)`` (a vector: ``(..., n, c)``)."""
        lead = x.shape[: x.dim() - len(self.shape)]
        if len(self.dims) == 1:
            return x.view(*lead, self.counts[0], self.chunks[0])
        (n0, n1), (c0, c1) = self.counts, self.chunks
        return x.view(*lead, n0, c0, n1, c1)

    def chunk_major_to_blocks(self, v: torch.Tensor) -> torch.Tensor:
        """``(G, n_chunks, L)`` chunk-major values as a ``(G, n0, c0, n1, c1)`` block-layout view."""
        if len(self.dims) == 1:
            return v.view(v.shape[0], self.counts[0], self.chunks[0])
        (n0, n1), (c0, c1) = self.counts, self.chunks
        return v.view(v.shape[0], n0, n1, c0, c1).permute(0, 1, 3, 2, 4)

    def blocks_to_chunk_major(self, b: torch.Tensor) -> torch.Tensor:
        """``(G, n0, c0, n1, c1)`` block layout as a ``(G, n0, n1, c0, c1)`` view (reshape it to
        ``(G·n_chunks, L)`` only after a copy)."""
        if len(self.dims) == 1:
            return b
        return b.permute(0, 1, 3, 2, 4)

    # ---- batched transforms ------------------------------------------------------------------------
    def forward(self, xs: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None,
                tmp: Optional[torch.Tensor] = None) -> torch.Tensor:
        """DCT of every shard in ``xs`` (each ``shape``, contiguous, ``dtype``): ``(G, ...)`` coefficients
        in *block* layout (view them chunk-major with :meth:`blocks_to_chunk_major`). ``out`` and
        ``tmp``: optional flat scratch of at least ``G·numel`` elements."""
        G, n = len(xs), self.numel
        out = _scratch(out, G * n, self.dtype, self.device)
        if len(self.dims) == 1:
            (c,) = self.chunks
            for i, x in enumerate(xs):
                torch.mm(x.reshape(-1, c), self.bases_t[0], out=out[i * n: (i + 1) * n].view(-1, c))
            return out.view(G, self.counts[0], c)
        (n0, n1), (c0, c1) = self.counts, self.chunks
        tmp = _scratch(tmp, G * n, self.dtype, self.device)
        for i, x in enumerate(xs):  # rows times B₁ᵀ: every c1-run of the shard, one GEMM per shard
            torch.mm(x.reshape(-1, c1), self.bases_t[1], out=tmp[i * n: (i + 1) * n].view(-1, c1))
        rows = tmp.view(G * n0, c0, n1 * c1)
        torch.bmm(self.bases[0].expand(G * n0, c0, c0), rows, out=out.view(G * n0, c0, n1 * c1))  # B₀ per block row
        return out.view(G, n0, c0, n1, c1)

    def inverse(self, coeffs: torch.Tensor, out: Optional[torch.Tensor] = None,
                tmp: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Inverse DCT of chunk-major ``coeffs`` (``(G·n_chunks, L)``, contiguous): the values, chunk-major
        ``(G·n_chunks, L)`` (see :meth:`chunk_major_to_blocks`)."""
        total = coeffs.numel()
        out = _scratch(out, total, self.dtype, self.device)
        if len(self.dims) == 1:
            (c,) = self.chunks
            return torch.mm(coeffs.view(-1, c), self.bases[0], out=out.view(-1, c)).view(-1, self.L)
        c0, c1 = self.chunks
        tmp = _scratch(tmp, total, self.dtype, self.device)
        torch.mm(coeffs.view(-1, c1), self.bases[1], out=tmp.view(-1, c1))  # C B₁
        chunks = total // self.L
        torch.bmm(self.bases_t[0].expand(chunks, c0, c0), tmp.view(chunks, c0, c1), out=out.view(chunks, c0, c1))
        return out.view(chunks, self.L)

    # ---- one tensor ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(n_chunks, L)`` coefficients of one shard."""
        b = self.forward([x.to(self.dtype).contiguous()])
        return self.blocks_to_chunk_major(b).reshape(self.n_chunks, self.L)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The shard (``shape``) whose coefficients are ``coeffs`` (``(n_chunks, L)``)."""
        v = self.inverse(coeffs.to(self.dtype).contiguous().view(-1, self.L))
        return self.chunk_major_to_blocks(v.view(1, -1)).reshape(self.shape)


def _scratch(buf: Optional[torch.Tensor], n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if buf is None:
        return torch.empty(n, dtype=dtype, device=device)
    return buf.view(-1)[:n]


def topk_per_chunk(coeffs: torch.Tensor, k: int,
                   work: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude coefficients of every chunk: ``(values, indices)``, each ``(n_chunks, k)``
    (in no particular order). ``work``: optional scratch of at least ``coeffs.numel()`` elements for
    the magnitudes.

    On CPU, long chunks are pruned first (torch's CPU top-k costs a few ns per element it scans):
    each chunk's ``L`` entries are cut into ``L/b`` strided blocks of ``b`` (entries ``j, j + L/b, ...``),
    the ``k`` blocks with the largest maxima are kept and the top-k is taken among their ``k·b``
    entries. Exact: an entry outside those blocks is at most its block's maximum, which is at most
    each of the ``k`` kept maxima, so it cannot beat the k-th largest kept entry (ties aside, which
    any top-k resolves arbitrarily)."""
    rows, L = coeffs.shape
    k = min(k, L)
    mag = torch.abs(coeffs, out=work.view(-1)[: coeffs.numel()].view_as(coeffs)) if work is not None else coeffs.abs()
    b = _prune_block(L, k) if coeffs.device.type == "cpu" else 1
    if b == 1:
        idx = mag.topk(k, dim=-1, sorted=False).indices
    else:
        nb = L // b
        strided = mag.view(rows, b, nb)  # [r, t, j] = entry t·nb + j: block j is column j
        blocks = strided.amax(1).topk(k, dim=-1, sorted=False).indices  # (rows, k)
        candidates = strided.gather(2, blocks.unsqueeze(1).expand(rows, b, k)).view(rows, b * k)
        pos = candidates.topk(k, dim=-1, sorted=False).indices  # t·k + s: row t of kept block s
        idx = (pos // k) * nb + blocks.gather(1, pos % k)
    return coeffs.gather(-1, idx), idx


def _prune_block(L: int, k: int) -> int:
    """Block size of :func:`topk_per_chunk`'s pruning: about ``L/(8k)`` (k·b = L/8 candidates, the
    fastest on CPU in measurements of L = 1024 and 4096), a divisor of ``L``; 1 (no pruning) below 4."""
    for b in range(L // (8 * max(k, 1)), 3, -1):
        if L % b == 0:
            return b
    return 1


def scatter_chunks(values: torch.Tensor, idx: torch.Tensor, L: int) -> torch.Tensor:
    """Dense ``(n_chunks, L)`` coefficients holding ``values`` at ``idx``, zeros elsewhere."""
    out = values.new_zeros(values.shape[0], L)
    return out.scatter_(-1, idx, values)


def accumulate_chunks_(dense: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dense[r, idx[w, r, j]] += values[w, r, j]`` for every source ``w`` (a replica), row ``r`` and
    ``j``; the indices of one ``[w, r, :]`` must be distinct (one replica's top-k of a chunk).

    Where several sources chose one coefficient they are summed in ``w`` order, the same bits on every
    device and every run: one ``scatter_add_`` per source, each touching distinct elements, so CUDA's
    atomics never meet on an element within a call and the calls run in stream order. (A single
    ``scatter_add_`` over all sources would let atomics add in a varying order on CUDA; ``index_put_``
    with ``accumulate`` sorts instead: deterministic, but slower on a GPU than these W calls.)"""
    for w in range(idx.shape[0]):
        dense.scatter_add_(-1, idx[w], values[w])
    return dense
