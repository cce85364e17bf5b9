"""The shard groups of a sharded matrix, and fused sums over them.

A matrix sharded over several mesh dims is reduced over each of their process groups in turn;
``Groups`` lists them as ``(role, process group)`` pairs (role ``S`` or ``T``, for the ledger), in
mesh-dim order. Many matrices share the same groups, so their reductions are bucketed: one fused
collective per group and bucket, through ``titan_commopt.comm``.
"""

from typing import Any, Optional, Sequence

import torch

from titan_commopt import comm

__all__ = ["Groups", "buckets", "group_key", "sum_over"]

Groups = list[tuple[str, Any]]  # (role, process group) pairs to reduce over, in mesh-dim order


def group_key(groups: Groups) -> tuple:
    """A hashable identity of ``groups`` (the same process groups in the same order, same key)."""
    return tuple((role, id(group)) for role, group in groups)


def buckets(groups_of: Sequence[Groups]) -> list[tuple[Groups, list[int]]]:
    """Indices of the entries sharing the same non-empty groups, bucket by bucket: one fused
    collective per bucket (every rank holds the same matrices in the same order, so buckets and
    their order agree across the ranks of a group)."""
    found: dict[tuple, tuple[Groups, list[int]]] = {}
    for i, groups in enumerate(groups_of):
        if groups:
            found.setdefault(group_key(groups), (groups, []))[1].append(i)
    return list(found.values())


def sum_over(
    tensors: Sequence[torch.Tensor], groups_of: Sequence[Groups], *, ledger: Optional[comm.CommLedger] = None
) -> None:
    """In-place all-reduce-sum of each tensor over its groups: one fused collective per group for
    all tensors that share the same groups, counted in ``ledger``."""
    for groups, members in buckets(groups_of):
        for role, group in groups:
            comm.all_reduce_fused([tensors[i] for i in members], role, group, op="sum", ledger=ledger)
