"""Pieces every optimizer family shares: hyper-parameters from torchtitan's ``[optimizer]``,
local views of DTensor shards, and the gradient each family steps on (:func:`replica_grad`). The
contract of a family lives in ``family.py``."""

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from titan_commopt import comm
from titan_commopt.topology import S, T, Topology

__all__ = ["BaseHParams", "local", "replica_grad", "NamedParams", "LR_SCALE_HELP"]

NamedParams = list[tuple[str, nn.Parameter]]

# Every family's lr_scale option means the same (one resolution, optim/__init__.resolve).
LR_SCALE_HELP = (
    "Multiplier of [optimizer] lr when the family's lr is not set (negative); presets carry the recommended "
    "value (the quality study's, in the preset table below). A value you set wins over the preset's."
)


@dataclass(frozen=True)
class BaseHParams:
    """The generic knobs of torchtitan's ``[optimizer]`` section (same names), and its
    ``[lr_scheduler] warmup_steps``. In a :class:`~titan_commopt.optim.Resolved` value ``lr`` is the
    effective initial learning rate (the family's ``lr``, or this ``lr`` × the family's ``lr_scale``)."""

    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (a view: in-place ops write through), or ``t``."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def mesh_dim_role(mesh, dim: int, topology: Optional[Topology] = None) -> str:
    """T for the tensor-parallel mesh dim of a parameter's mesh: named ``tp``, or (given a topology)
    holding the ranks of its T group; S otherwise (R is never part of a parameter's mesh: the
    optimizer syncs it itself)."""
    names = mesh.mesh_dim_names or ()
    if dim < len(names) and names[dim] == "tp":
        return T
    if topology is not None and topology.tp is not None and dist.get_process_group_ranks(
        topology.tp
    ) == dist.get_process_group_ranks(mesh.get_group(dim)):
        return T
    return S


def _redistribute_counted(grad, p, topology: Topology, ledger: Optional["comm.CommLedger"]):
    """``grad.redistribute`` to ``p``'s placements one mesh dim at a time, each change recorded in
    the ledger with the payload convention of ``comm`` (the collective is DTensor's own)."""
    mesh = p.device_mesh
    current = list(grad.placements)
    for dim, want in enumerate(p.placements):
        have = current[dim]
        if have == want:
            continue
        current[dim] = want
        before = comm.nbytes(grad.to_local())
        start = time.perf_counter()
        grad = grad.redistribute(mesh, tuple(current))
        after = comm.nbytes(grad.to_local())
        w = mesh.size(dim)
        if have.is_partial() and want.is_replicate():
            sent, recv = before, before  # all-reduce
        elif have.is_partial():
            sent = recv = (w - 1) * after  # reduce-scatter
        elif have.is_replicate():
            sent = recv = 0  # Replicate -> Shard (or Partial): a local slice
        elif want.is_replicate():
            sent, recv = before, (w - 1) * before  # all-gather
        else:
            sent, recv = before, after  # reshard between dims (all-to-all)
        if w > 1 and (sent or recv):
            (ledger or comm.get_ledger()).record(
                mesh_dim_role(mesh, dim, topology), "grad_redistribute", sent, recv, time.perf_counter() - start
            )
    return grad


def replica_grad(
    p: torch.Tensor, topology: Topology, *, copy: bool = False, ledger: Optional["comm.CommLedger"] = None
) -> torch.Tensor:
    """The local tensor of this replica's mean gradient ``g`` of ``p``, laid out like ``local(p)``.

    Under tensor parallelism (and without FSDP2, which redistributes gradients itself) a DTensor
    gradient may carry other placements than its parameter: ``Partial`` over ``tp`` for a
    replicated parameter fed by sequence-parallel activations (norm weights), ``Replicate`` for a
    row-sharded embedding. It is redistributed to the parameter's placements first (S/T traffic,
    recorded in the ledger), so that its local tensor matches ``local(p)`` element for element;
    then ``topology.replica_grad`` applies the gradient scale (``topology.py``).

    ``copy``: never return ``p.grad``'s own storage (for callers that modify the result in place,
    e.g. a fused R mean, while ``p.grad`` must stay what backward produced).
    """
    grad = p.grad
    if grad is None:
        raise ValueError("replica_grad: the parameter has no gradient")
    placements = getattr(p, "placements", None)
    if placements is not None and getattr(grad, "placements", placements) != placements:
        grad = _redistribute_counted(grad, p, topology, ledger)
    raw = local(grad)
    wait = getattr(raw, "wait", None)  # an AsyncCollectiveTensor from DTensor's functional collectives
    if callable(wait):
        raw = wait()
    g = topology.replica_grad(raw)
    return g.clone() if copy and g is raw else g
