"""Orthogonalization: Newton–Schulz (Muon's, for DeMo's ``rule = "muon"``) and the row-distributed
orthonormalization of Dion's P (CholeskyQR2, falling back to Householder QR of the gathered rows).

A row-distributed ``P`` (m×r) is held as row blocks ``P_i`` on the ranks of its row ``Groups``
(see ``shard_groups``); the result keeps that layout. Nothing here ever gathers more than m×r:

- CholeskyQR2: ``L Lᵀ = Σ_i P_iᵀ P_i`` (an r×r Gram, all-reduce-summed over the row groups), then
  ``P ← P L⁻ᵀ``, twice (the second pass repairs the first's loss of orthogonality). Fast and
  communication-light, accurate while cond(P) ≲ u^(−1/2) for the unit roundoff u: first tried in
  P's dtype (float32 at least), retried in float64 where that is not enough.
- QR: the rows are all-gathered, every rank factors the same m×r matrix and keeps its own rows of Q.
  Used for ``method = "qr"``, and wherever CholeskyQR2 gives up (on every rank alike: the Grams
  are identical after the all-reduce).

The result equals the Q factor of P up to column signs, which Dion's update ``P Qᵀ`` with
``Q = colnorm(Bᵀ P)`` does not see.
"""

import math
from typing import Optional, Sequence

import torch

from titan_commopt import comm

from .shard_groups import Groups, sum_over

__all__ = ["newton_schulz", "orthogonalize", "cholesky_qr2", "gathered_qr"]


def newton_schulz(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton–Schulz orthogonalization of ``x`` viewed as ``(d0, rest)`` (a vector as
    one row), scaled by Muon's ``sqrt(max(1, rows/cols))``. Approximate by design: it returns
    U f(S) Vᵀ for ``x = U S Vᵀ``, f pushing the singular values into about [0.7, 1.2] rather than onto
    1 (Muon's coefficients trade accuracy for speed); the tiniest ones stay small."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)
    rows, cols = X.shape
    X = X.T if rows > cols else X  # iterate on the wide side: X Xᵀ is the smaller Gram
    X = X / (X.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1, so the iteration converges
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X  # X ← p(X Xᵀ) X with p(s) = a + b·s + c·s²
    X = X.T if rows > cols else X
    return (X * max(1.0, rows / cols) ** 0.5).reshape(x.shape)  # Muon's shape scale


def _cqr2(Ps: list[torch.Tensor], rows: list[Groups], dtype: torch.dtype) -> list[Optional[torch.Tensor]]:
    """CholeskyQR2 of every P in ``dtype``, the Grams of each pass summed in one fused collective per
    group bucket; None where a Cholesky fails or P is too ill-conditioned for ``dtype``."""
    out: list[Optional[torch.Tensor]] = [P.to(dtype) for P in Ps]
    limit = 0.1 / math.sqrt(torch.finfo(dtype).eps)  # CholeskyQR2 is accurate for cond(P) ≲ u^(-1/2)
    todo = list(range(len(Ps)))
    for first in (True, False):
        grams = [out[i].T @ out[i] for i in todo]  # type: ignore[union-attr]
        sum_over(grams, [rows[i] for i in todo])  # r×r per matrix over the row shards
        keep = []
        for i, gram in zip(todo, grams):
            L, info = torch.linalg.cholesky_ex(gram)
            d = L.diagonal()
            # diag(L)'s spread is a lower bound of cond(P): a cheap, rank-consistent test.
            if int(info) != 0 or (first and not bool(d.min() * limit > d.max())):
                out[i] = None
                continue
            out[i] = torch.linalg.solve_triangular(L.T, out[i], upper=True, left=False)  # P L⁻ᵀ
            keep.append(i)
        todo = keep
    return [None if o is None else o.to(P.dtype) for o, P in zip(out, Ps)]


def cholesky_qr2(Ps: Sequence[torch.Tensor], rows: Sequence[Groups]) -> list[Optional[torch.Tensor]]:
    """CholeskyQR2 of row-distributed P's (``rows[i]``: the row groups of ``Ps[i]``, [] = unsharded).

    First in P's own dtype (float32 at least); the ones too ill-conditioned for it are retried in
    float64 (the Gram squares cond(P)). An entry is None where even that fails — on every rank
    alike, since the Gram is identical on all ranks after the all-reduce.
    """
    Ps, rows = list(Ps), list(rows)
    if not Ps:
        return []
    dtype = torch.promote_types(Ps[0].dtype, torch.float32)  # no Cholesky in bf16/fp16
    out = _cqr2(Ps, rows, dtype)
    retry = [i for i, o in enumerate(out) if o is None]
    if retry and dtype != torch.float64:
        for i, o in zip(retry, _cqr2([Ps[i] for i in retry], [rows[i] for i in retry], torch.float64)):
            out[i] = o
    return out


def _gather_rows(P: torch.Tensor, rows: Groups) -> tuple[torch.Tensor, int]:
    """All rows of P over the row groups (m×r; shards may be uneven), and where ours start."""
    block, start = P, 0
    for role, group in rows:
        count = torch.tensor([block.shape[0]], dtype=torch.int64, device=block.device)
        counts = comm.all_gather(count, role, group)[:, 0]
        padded = torch.zeros(int(counts.max()), block.shape[1], dtype=block.dtype, device=block.device)
        padded[: block.shape[0]] = block  # all_gather takes equal shapes
        gathered = comm.all_gather(padded, role, group)
        start += int(counts[: comm.group_rank(group)].sum())
        block = torch.cat([gathered[i, : int(c)] for i, c in enumerate(counts.tolist())])
    return block, start


def gathered_qr(P: torch.Tensor, rows: Groups) -> torch.Tensor:
    """This rank's rows of the Householder-QR factor Q of the row-distributed P (gathered, m×r)."""
    if not rows:
        return torch.linalg.qr(P).Q
    full, start = _gather_rows(P, rows)
    return torch.linalg.qr(full).Q[start : start + P.shape[0]].contiguous()


def orthogonalize(
    Ps: Sequence[torch.Tensor], rows: Sequence[Groups], method: str = "cholesky_qr"
) -> list[torch.Tensor]:
    """Orthonormal columns spanning each row-distributed P (new tensors, P's layout and dtype).

    ``method``: ``"cholesky_qr"`` (CholeskyQR2, QR where it gives up) or ``"qr"`` (QR always).
    """
    out = cholesky_qr2(Ps, rows) if method == "cholesky_qr" else [None] * len(Ps)
    return [o if o is not None else gathered_qr(P, r) for o, P, r in zip(out, Ps, rows)]
