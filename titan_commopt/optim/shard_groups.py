"""The shard groups of a sharded matrix, and fused sums over them.

A matrix sharded over several mesh dims is reduced over each of their process groups in turn;
``Groups`` lists them as ``(role, process group)`` pairs (role ``S`` or ``T``, for the ledger), in
mesh-dim order. Many matrices share the same groups, so their reductions are bucketed: one fused
collective per group and bucket, through ``titan_commopt.comm``.
"""

from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from titan_commopt import comm
from titan_commopt.topology import T, Topology

from .common import mesh_dim_role

__all__ = ["Groups", "buckets", "group_key", "sum_over", "mesh_dim_group", "sharding_groups"]

Groups = list[tuple[str, Any]]  # (role, process group) pairs to reduce over, in mesh-dim order


def mesh_dim_group(mesh: Any, dim: int, topology: Topology) -> tuple[str, Any]:
    """``(role, process group)`` of one mesh dim of a parameter's mesh: the Topology's S or T group
    (the roles' single source of truth) when it holds the same ranks, else the mesh dim's own."""
    role = mesh_dim_role(mesh, dim)  # by the mesh dim's name, as ShardShape.of (the byte formulas')
    candidate = topology.tp if role == T else topology.shard
    own = mesh.get_group(dim)
    if candidate is not None and comm.group_ranks(candidate) == comm.group_ranks(own):
        return role, candidate
    return role, own


def sharding_groups(p: torch.Tensor, topology: Topology) -> Groups:
    """The groups whose ranks hold the other pieces of ``p`` (its mesh dims of size > 1 that shard
    it, in mesh-dim order); a sum over them of every piece's sums is the whole tensor's. Empty for a
    plain tensor, or one replicated on every mesh dim."""
    if not isinstance(p, DTensor):
        return []
    mesh = p.device_mesh
    return [mesh_dim_group(mesh, i, topology) for i, pl in enumerate(p.placements)
            if mesh.size(i) > 1 and not (pl.is_replicate() or pl.is_partial())]  # Shard, _StridedShard


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
