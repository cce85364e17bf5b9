"""Orthogonalization: Newton–Schulz (Muon's: the Muon step of ``optim/muon/``, DeMo's ``rule = "muon"``)
and the row-distributed orthonormalization of Dion's P (CholeskyQR2, falling back to Householder QR of
the gathered rows).

Newton–Schulz (:func:`orthogonalize_stack`) works on whole matrices, one or a stack of them: the
owner-gathered matrices of ``optim/muon/`` (``layout.py`` brings each matrix whole to one rank of its
shard groups). Its iterations are matmuls (torch's, no kernel of ours: a GEMM is what a GPU does
best): per iteration X Xᵀ (2m²n flops), A² (2m³) and B X (2m²n), 4m²n + 2m³ flops with m <= n
after the transpose of a tall matrix (:func:`newton_schulz_flops`).

A row-distributed ``P`` (m×r) is held as row blocks ``P_i`` on the ranks of its row ``Groups``
(see ``shard_groups``); the result keeps that layout. Nothing here ever gathers more than m×r:

- CholeskyQR2: ``L Lᵀ = Σ_i P_iᵀ P_i`` (an r×r Gram, all-reduce-summed over the row groups), then
  ``P ← P L⁻ᵀ``, twice (the second pass repairs the first's loss of orthogonality). Fast and
  communication-light, accurate while cond(P) ≲ u^(−1/2) for the unit roundoff u: first tried in
  P's dtype (float32 at least), retried in float64 where that is not enough.
- QR: the rows are all-gathered, every rank factors the same m×r matrix and keeps its own rows of Q.
  Used for ``method = "qr"``, and wherever CholeskyQR2 gives up (on every rank alike: the Grams
  are identical after the all-reduce).

GPU fitness: same-shape P's are stacked and orthonormalized together (batched Gram, Cholesky and
triangular solve: a handful of kernels per shape, not per matrix), whether a P failed is kept on the
device as a flag, and the flags of all P's are read with ONE host synchronization per call; only a
call where some P failed synchronizes again for its fallback.

The result equals the Q factor of P up to column signs, which Dion's update ``P Qᵀ`` with
``Q = colnorm(Bᵀ P)`` does not see.
"""

import math
from typing import Callable, Optional, Sequence

import torch

from titan_commopt import comm

from .shard_groups import Groups, sum_over

__all__ = [
    "NS_COEFFICIENTS", "ns_schedule", "newton_schulz_flops", "orthogonalize_stack", "newton_schulz", "orthogonalize", "orthonormalizer",
    "Orthonormalizer", "cholesky_qr2", "gathered_qr",
]

Ledger = Optional[comm.CommLedger]  # where the collectives are counted (None: comm's process-wide ledger)


# (a, b, c) of each iteration X ← a·X + (b·A + c·A²)·X, A = X Xᵀ: Keller Jordan's one triple (repeated:
# torch.optim.Muon's, slope 3.4445 at 0), MuLoCo's five (one per iteration, as dion's Muon it builds on).
NS_COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "keller": ((3.4445, -4.7750, 2.0315),),
    "muloco": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
}


def ns_schedule(coefficients: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of every iteration: a fixed triple repeated ``steps`` times, or a schedule of
    its own (MuLoCo's five triples, whatever ``steps``)."""
    triples = NS_COEFFICIENTS[coefficients]
    return triples * steps if len(triples) == 1 else triples


def newton_schulz_flops(rows: int, cols: int, iterations: int) -> int:
    """The matmul flops (a multiply-add counted as 2) of :func:`orthogonalize_stack` on one
    ``rows × cols`` matrix: per iteration, with m = min(rows, cols) and n = max(rows, cols) (a tall
    matrix is transposed first), A = X Xᵀ (2m²n), b·A + c·A² (2m³) and a·X + B X (2m²n). The
    elementwise work (the Frobenius norm, the scalings in ``addmm``: O(mn) per iteration) is left out:
    it is below 1/m of the products."""
    m, n = min(rows, cols), max(rows, cols)
    return iterations * (4 * m * m * n + 2 * m**3)


def orthogonalize_stack(
    x: torch.Tensor, schedule: Sequence[tuple[float, float, float]], *, eps: float = 1e-7
) -> torch.Tensor:
    """Newton–Schulz of ``x`` (one m×n matrix, or a ``[k, m, n]`` stack: each matrix on its own), a new
    tensor in ``x``'s dtype (cast first for bfloat16): U f(S) Vᵀ for x = U S Vᵀ, f pushing the
    singular values towards 1 (not onto it: into about [0.7, 1.2] with Keller's triple).

    torch.optim.Muon's operations in its order: a tall matrix is transposed (X Xᵀ is then the
    smaller Gram), X / max(‖X‖_F, ε) (the spectral norm is then at most 1), each iteration
    ``B = addmm(A, A, A, beta=b, alpha=c)``, ``X = addmm(X, B, X, beta=a)``; a stack runs the batched
    products (``baddbmm``), which give each matrix the same bits as its own ``addmm`` (held by
    ``tests/test_muon.py``)."""
    X = x
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # σ_max ≤ ‖X‖_F ≤ 1: the iteration converges
    product = torch.addmm if X.dim() == 2 else torch.baddbmm
    for a, b, c in schedule:
        A = X @ X.mT
        B = product(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        X = product(X, B, X, beta=a)  # a·X + (b·A + c·A²)·X
    return X.mT if tall else X


def newton_schulz(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """DeMo's ``rule = "muon"``: Keller Jordan's Newton–Schulz of ``x`` viewed as ``(d0, rest)`` (a
    vector as one row), in ``x``'s dtype, scaled by Muon's ``sqrt(max(1, rows/cols))``."""
    X = x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)
    rows, cols = X.shape
    X = orthogonalize_stack(X, ns_schedule("keller", steps))
    return (X * max(1.0, rows / cols) ** 0.5).reshape(x.shape)  # Muon's shape scale


def _batches(Ps: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``Ps`` with the same (local) shape, dtype and device, in first-appearance order:
    one stacked computation each. Only the compute is batched this way; collectives run in index
    order (see :func:`_cqr2`), so a batch that differs between ranks (uneven shards) is harmless."""
    found: dict[tuple, list[int]] = {}
    for i, P in enumerate(Ps):
        found.setdefault((tuple(P.shape), P.dtype, P.device), []).append(i)
    return list(found.values())


def _cqr2(
    stacks: Sequence[torch.Tensor], index: Sequence[Sequence[int]], rows: Sequence[Groups], dtype: torch.dtype,
    ledger: Ledger,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Batched CholeskyQR2 in ``dtype`` of the stacked P's ``stacks[s]`` (``[k, m, r]``; entry ``j``
    is matrix ``index[s][j]``, whose row groups are ``rows[index[s][j]]``). No host synchronization:
    returns the orthonormalized stacks and, per stack, a ``[k]`` boolean tensor that is true where
    the result is not to be used (a Cholesky failed, or P is too ill-conditioned for ``dtype``).

    The Grams of each pass are all-reduce-summed over the row groups in one fused collective per
    group bucket, in matrix-index order (``sum_over``): the same on every rank whatever the batches.
    A failed entry goes on with L = I (finite junk, discarded), so nothing branches on it.
    """
    limit = 0.1 / math.sqrt(torch.finfo(dtype).eps)  # CholeskyQR2 is accurate for cond(P) ≲ u^(-1/2)
    n = sum(len(ix) for ix in index)
    outs = [P.to(dtype) for P in stacks]
    fails: list[torch.Tensor] = []
    for first in (True, False):
        grams = [P.mT @ P for P in outs]  # [k, r, r] per stack
        views: list[Optional[torch.Tensor]] = [None] * n
        for gram, ix in zip(grams, index):
            for j, i in enumerate(ix):
                views[i] = gram[j]
        sum_over(views, rows, ledger=ledger)  # type: ignore[arg-type]  # r×r per matrix over the row shards, in place
        for s, gram in enumerate(grams):
            L, info = torch.linalg.cholesky_ex(gram)
            bad = info != 0
            if first:
                d = L.diagonal(dim1=-2, dim2=-1)
                # diag(L)'s spread is a lower bound of cond(P): a cheap, rank-consistent test
                # (written so that a NaN fails it).
                bad = bad | ~(d.amin(-1) * limit > d.amax(-1))
                fails.append(bad)
            else:
                fails[s] = fails[s] | bad
            eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
            L = torch.where(bad[:, None, None], eye, L)
            outs[s] = torch.linalg.solve_triangular(L.mT, outs[s], upper=True, left=False)  # P L⁻ᵀ
    return outs, fails


def _split(values: list, sizes: Sequence[int]) -> list[list]:
    out, start = [], 0
    for k in sizes:
        out.append(values[start : start + k])
        start += k
    return out


def _cqr2_list(
    Ps: Sequence[torch.Tensor], rows: Sequence[Groups], dtype: torch.dtype, ledger: Ledger
) -> list[Optional[torch.Tensor]]:
    """CholeskyQR2 in ``dtype`` of a list of P's, stacked by shape; None where it failed. One host
    synchronization (reading the failure flags of all of them)."""
    index = _batches(Ps)
    results, fails = _cqr2([torch.stack([Ps[i] for i in ix]) for ix in index], index, rows, dtype, ledger)
    out: list[Optional[torch.Tensor]] = [None] * len(Ps)
    flags = _split(torch.cat(fails).tolist(), [len(ix) for ix in index])  # the host synchronization
    for ix, res, fl in zip(index, results, flags):
        for j, (i, f) in enumerate(zip(ix, fl)):
            if not f:
                out[i] = res[j].to(Ps[i].dtype)
    return out


def cholesky_qr2(
    Ps: Sequence[torch.Tensor], rows: Sequence[Groups], *, ledger: Ledger = None
) -> list[Optional[torch.Tensor]]:
    """CholeskyQR2 of row-distributed P's (``rows[i]``: the row groups of ``Ps[i]``, [] = unsharded).

    First in P's own dtype (float32 at least); the ones too ill-conditioned for it are retried in
    float64 (the Gram squares cond(P)). An entry is None where even that fails — on every rank
    alike, since the Gram is identical on all ranks after the all-reduce. Same-shape P's are
    computed stacked (batched Gram, Cholesky and triangular solve); one host synchronization reads
    the outcome of all of them (one more for a float64 retry).
    """
    Ps, rows = list(Ps), list(rows)
    if not Ps:
        return []
    dtype = torch.promote_types(Ps[0].dtype, torch.float32)  # no Cholesky in bf16/fp16
    out = _cqr2_list(Ps, rows, dtype, ledger)
    retry = [i for i, o in enumerate(out) if o is None]
    if retry and dtype != torch.float64:
        for i, o in zip(retry, _cqr2_list([Ps[i] for i in retry], [rows[i] for i in retry], torch.float64, ledger)):
            out[i] = o
    return out


def _qr_stacks(
    stacks: Sequence[torch.Tensor], index: Sequence[Sequence[int]], rows: Sequence[Groups], ledger: Ledger
) -> tuple[list[torch.Tensor], int]:
    """``method = "qr"``: the QR of every P's gathered rows (``index``/``rows`` as for :func:`_cqr2`),
    in matrix-index order; P's dtype out, no fallback."""
    where = {i: (s, j) for s, ix in enumerate(index) for j, i in enumerate(ix)}
    outs = [torch.empty_like(P) for P in stacks]
    for i in sorted(where):
        s, j = where[i]
        outs[s][j] = gathered_qr(stacks[s][j], rows[i], ledger=ledger)
    return outs, 0


def _cholesky_qr_stacks(
    stacks: Sequence[torch.Tensor], index: Sequence[Sequence[int]], rows: Sequence[Groups], ledger: Ledger
) -> tuple[list[torch.Tensor], int]:
    """``method = "cholesky_qr"``: CholeskyQR2 in P's dtype (float32 at least) for all of them, then
    ONE host synchronization reads which entries failed. Only where some did (rare) they are retried
    in float64 and, where that fails too, replaced by the QR of the gathered rows; both steps
    synchronize again, on every rank alike (the flags come from the all-reduced Grams). Also returns
    how many entries needed that fallback (read from the flags already on the host)."""
    if not stacks:
        return [], 0
    where = {i: (s, j) for s, ix in enumerate(index) for j, i in enumerate(ix)}
    dtype = torch.promote_types(stacks[0].dtype, torch.float32)  # no Cholesky in bf16/fp16
    outs, fails = _cqr2(stacks, index, rows, dtype, ledger)
    flags = _split(torch.cat(fails).tolist(), [len(ix) for ix in index])  # the one host synchronization
    failed = sorted(i for ix, fl in zip(index, flags) for i, f in zip(ix, fl) if f)
    outs = [o.to(P.dtype) for o, P in zip(outs, stacks)]
    if failed:
        Ps = [stacks[where[i][0]][where[i][1]] for i in failed]
        retry: list[Optional[torch.Tensor]] = [None] * len(failed)
        if dtype != torch.float64:
            retry = _cqr2_list(Ps, [rows[i] for i in failed], torch.float64, ledger)
        for i, P, o in zip(failed, Ps, retry):
            s, j = where[i]
            outs[s][j] = o if o is not None else gathered_qr(P, rows[i], ledger=ledger)
    return outs, len(failed)


_METHODS = {"cholesky_qr": _cholesky_qr_stacks, "qr": _qr_stacks}

# (stacks, rows, ledger) -> (new stacks, how many P's needed the fallback): see orthonormalizer()
Orthonormalizer = Callable[[Sequence[torch.Tensor], Sequence[Groups], Ledger], tuple[list[torch.Tensor], int]]


def orthonormalizer(method: str) -> Orthonormalizer:
    """The orthonormalization of stacked, row-distributed P's that ``method`` names, chosen once.

    The returned function takes ``stacks`` (``[k, m, r]`` each; all entries of stack ``s`` share the
    row groups ``rows[s]``; every rank passes the same stacks in the same order) and the ledger of
    its collectives, and returns new stacks (P's layout and dtype) with orthonormal columns, and the
    number of entries that needed the fallback (0 for ``qr``). ``cholesky_qr`` synchronizes with the
    host once (the failure flags of all entries), more only where some P needs the fallback."""
    stacked = _METHODS[method]

    def orthonormalize(
        stacks: Sequence[torch.Tensor], rows: Sequence[Groups], ledger: Ledger
    ) -> tuple[list[torch.Tensor], int]:
        index, start = [], 0
        for P in stacks:
            index.append(list(range(start, start + P.shape[0])))
            start += P.shape[0]
        per_matrix = [g for P, g in zip(stacks, rows) for _ in range(P.shape[0])]
        return stacked(stacks, index, per_matrix, ledger)

    return orthonormalize


def _gather_rows(P: torch.Tensor, rows: Groups, ledger: Ledger) -> tuple[torch.Tensor, int]:
    """All rows of P over the row groups (m×r; shards may be uneven), and where ours start."""
    block, start = P, 0
    for role, group in rows:
        count = torch.tensor([block.shape[0]], dtype=torch.int64, device=block.device)
        counts = comm.all_gather(count, role, group, ledger=ledger)[:, 0]
        padded = torch.zeros(int(counts.max()), block.shape[1], dtype=block.dtype, device=block.device)
        padded[: block.shape[0]] = block  # all_gather takes equal shapes
        gathered = comm.all_gather(padded, role, group, ledger=ledger)
        start += int(counts[: comm.group_rank(group)].sum())
        block = torch.cat([gathered[i, : int(c)] for i, c in enumerate(counts.tolist())])
    return block, start


def gathered_qr(P: torch.Tensor, rows: Groups, *, ledger: Ledger = None) -> torch.Tensor:
    """This rank's rows of the Householder-QR factor Q of the row-distributed P (gathered, m×r)."""
    if not rows:
        return torch.linalg.qr(P).Q
    full, start = _gather_rows(P, rows, ledger)
    return torch.linalg.qr(full).Q[start : start + P.shape[0]].contiguous()


def orthogonalize(
    Ps: Sequence[torch.Tensor], rows: Sequence[Groups], method: str = "cholesky_qr", *, ledger: Ledger = None
) -> list[torch.Tensor]:
    """Orthonormal columns spanning each row-distributed P (new tensors, P's layout and dtype).

    ``method``: ``"cholesky_qr"`` (CholeskyQR2, QR where it gives up) or ``"qr"`` (QR always).
    Same-shape P's are computed stacked; see :func:`orthonormalizer` for the host
    synchronizations.
    """
    Ps, rows = list(Ps), list(rows)
    index = _batches(Ps)
    outs, _ = _METHODS[method]([torch.stack([Ps[i] for i in ix]) for ix in index], index, rows, ledger)
    result: list[Optional[torch.Tensor]] = [None] * len(Ps)
    for ix, out in zip(index, outs):
        for j, i in enumerate(ix):
            result[i] = out[j]
    return result  # type: ignore[return-value]
