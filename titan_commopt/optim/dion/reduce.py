"""Dion's R reduction: ``R = E_DP[Σ_i B_iᵀ P_i]`` (and, transposed, the same for P), hierarchical
where the rows are sharded, written as a task of ``titan_commopt.overlap`` (it yields while its R
mean is in flight, so the optimizer computes the next shape batch meanwhile).

A compressed matrix whose rows are sharded goes hierarchically: a reduce-scatter over each of its
row groups leaves this rank the ``row_split`` slice of the sum (ceil(n_loc/k) rows, zero-padded),
only that slice's real rows join the one fused R all-reduce, and all-gathers over the row groups
(in reverse order) rebuild the averaged R everywhere. The split runs over *all* row groups (S,
and T where TP shards the rows too, e.g. FSDP over a column-wise TP layer): only then is the R
payload ``(m_loc + ceil(n_loc/k))·r ≈ (m + n)·r/k`` below the gradient shard ``m·n/k`` for every
layout that compresses — an S-only split would still send ``n/|S|`` rows against a shard of
``m·n/(|S|·|T|)`` — and on each (fast) row group the reduce-scatter + all-gather pair moves what
the all-reduce it replaces moved.
"""

from typing import Any, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.overlap import Runtime, Task
from titan_commopt.topology import R

from .layout import Layout, r_slice
from ..shard_groups import buckets, sum_over

__all__ = ["reduce_r", "reduce_r_now"]


def _scatter_level(
    buffers: list[torch.Tensor], role: str, group: Any, ledger: Optional[comm.CommLedger]
) -> list[torch.Tensor]:
    """One fused reduce-scatter over ``group`` for all the flat ``buffers``: each keeps this rank's
    1/W block, summed over the group."""
    w = comm.group_size(group)
    sizes = [b.numel() // w for b in buffers]
    flat = torch.cat([b.view(w, k) for b, k in zip(buffers, sizes)], dim=1)
    return list(comm.reduce_scatter(flat, role, group, ledger=ledger).split(sizes))


def _gather_level(
    buffers: list[torch.Tensor], role: str, group: Any, ledger: Optional[comm.CommLedger]
) -> list[torch.Tensor]:
    """The inverse of :func:`_scatter_level`: one fused all-gather, each buffer becomes the W ranks'
    blocks in rank order."""
    sizes = [b.numel() for b in buffers]
    gathered = comm.all_gather(torch.cat(buffers), role, group, ledger=ledger)
    return [g.reshape(-1) for g in gathered.split(sizes, dim=1)]


def _padded(Rm: torch.Tensor, count: int) -> torch.Tensor:
    """``Rm`` flat, zero-padded to ``count`` equal slices of ceil(n_loc/count) rows."""
    n_loc, r = Rm.shape
    buf = Rm.new_zeros(-(-n_loc // count) * count * r)
    buf[: n_loc * r] = Rm.reshape(-1)
    return buf


def reduce_r(
    Rs: Sequence[torch.Tensor], lays: Sequence[Layout], replicate: Any, syncs_r: bool,
    ledger: Optional[comm.CommLedger],
) -> Task:
    """In place: R = Σ_i B_iᵀ P_i over the row groups, then, for compressed matrices, its mean over
    R (hierarchically where the rows are sharded: module docstring). A task: the row-group sums and
    reduce-scatters run at once, the one fused R mean is issued async and yielded, the all-gathers
    run when it is back."""
    split = [syncs_r and lay.compressed and bool(lay.rows) for lay in lays]
    plain = [i for i, sp in enumerate(split) if not sp]
    sum_over([Rs[i] for i in plain], [lays[i].rows for i in plain], ledger=ledger)
    scattered, mine = [], {}
    for groups, members in buckets([lay.rows if sp else [] for lay, sp in zip(lays, split)]):
        bufs = [_padded(Rs[i], lays[i].row_split[1]) for i in members]
        for role, group in groups:
            bufs = _scatter_level(bufs, role, group, ledger)
        scattered.append((groups, members, bufs))
        for i, buf in zip(members, bufs):
            mine[i] = buf[: r_slice(Rs[i].shape[0], lays[i].row_split)[1] * Rs[i].shape[1]]
    # E_DP[R̂]: whole R of the unsplit compressed matrices, this rank's slice of the others: one collective.
    means = [mine.get(i, Rs[i]) for i, lay in enumerate(lays) if lay.compressed]
    yield comm.all_reduce_fused([t for t in means if t.numel()], R, replicate, op="mean", ledger=ledger,
                                async_op=True)
    for groups, members, bufs in scattered:
        for role, group in reversed(groups):
            bufs = _gather_level(bufs, role, group, ledger)
        for i, buf in zip(members, bufs):
            Rs[i].copy_(buf[: Rs[i].numel()].view_as(Rs[i]))


def reduce_r_now(
    Rs: Sequence[torch.Tensor], lays: Sequence[Layout], replicate: Any, syncs_r: bool,
    ledger: Optional[comm.CommLedger],
) -> None:
    """:func:`reduce_r`, complete on return."""
    Runtime().run(reduce_r(Rs, lays, replicate, syncs_r, ledger))
