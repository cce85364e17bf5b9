"""Replica-local state: per-replica checkpoint keys, non-finite step agreement, drift checks.

Optimizers that own the R sync keep state that differs between replicas (decoupled momenta,
parameters between syncs, error feedback). A checkpoint therefore stores that state once *per
replica*, under keys prefixed ``replica<r>/``; each replica loads its own back. Everything keyed
this way is a DTensor over the S (and T) mesh or a plain value, so DCP still reshards it when S
changes. Resuming with a different number of replicas is refused before loading (there is no
right way to invent or drop a replica's momenta): ``config/resume.py``.

Parameters of optimizers whose replicas legitimately diverge between syncs (local-adaptive
families: ``params_replica_local = True`` on the optimizer) are saved per replica too and restored
after the model's own (replica-0) copy has been loaded.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from titan_commopt import comm
from titan_commopt.optim.common import local
from titan_commopt.topology import R, S, T, Topology

from ..config.checkpoint import replica_prefix

__all__ = [
    "add_replica_prefix",
    "take_replica",
    "fingerprint",
    "check_replicas",
    "ReplicaDriftError",
    "any_rank",
    "any_nonfinite",
    "any_nonfinite_in_replica",
]

def add_replica_prefix(state: dict[str, Any], replica: int) -> dict[str, Any]:
    prefix = replica_prefix(replica)
    return {prefix + k: v for k, v in state.items()}


def take_replica(state: dict[str, Any], replica: int) -> dict[str, Any]:
    prefix = replica_prefix(replica)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


# ---- drift -----------------------------------------------------------------------------------
class ReplicaDriftError(RuntimeError):
    pass


def fingerprint(t: torch.Tensor) -> int:
    """An exact, cheap fingerprint of a tensor's bytes (wrap-around sum of its 32-bit words and of
    the words times their position), so that any bit flip changes it."""
    data = local(t).detach().contiguous().reshape(-1)
    words = data.view(torch.uint8)
    pad = (-words.numel()) % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    ints = words.view(torch.int32).to(torch.int64)
    position = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device)
    mask = (1 << 61) - 1
    return int(((ints.sum() & mask) * 1_000_003 + ((ints * position).sum() & mask)) & mask)


def check_replicas(
    named_tensors: Iterable[tuple[str, torch.Tensor]], topology: Topology, what: str = "parameter", *,
    ledger: Optional[comm.CommLedger] = None,
) -> None:
    """All replicas must hold bit-identical tensors: gather fingerprints over R and compare.

    Raises :class:`ReplicaDriftError` naming the first tensor that differs and the replicas' values.
    One all-gather of 8 bytes per tensor.
    """
    if topology.replicate_size == 1:
        return
    named = list(named_tensors)
    if not named:
        return
    device = local(named[0][1]).device  # collectives run on the tensors' device (NCCL: the GPU)
    prints = torch.tensor([fingerprint(t) for _, t in named], dtype=torch.int64, device=device)
    gathered = comm.all_gather(prints, R, topology.replicate, ledger=ledger)
    for i, (name, _) in enumerate(named):
        column = gathered[:, i]
        if not bool((column == column[0]).all()):
            raise ReplicaDriftError(
                f"replicas disagree on {what} {name!r} (shard {topology.shard_rank}): fingerprints by "
                f"replica {column.tolist()}; replicas must hold identical values here"
            )


# ---- non-finite gradients ---------------------------------------------------------------------
def any_nonfinite(
    grads: Iterable[Optional[torch.Tensor]], group: Optional[dist.ProcessGroup] = None, *,
    ledger: Optional[comm.CommLedger] = None,
) -> bool:
    """Whether any rank of ``group`` (default: all ranks) has a NaN/Inf gradient: one 4-byte
    all-reduce(max), so that every rank takes the same decision."""
    return _any_rank(_nonfinite_flag(grads, group), group, ledger)


def any_nonfinite_in_replica(
    grads: Iterable[Optional[torch.Tensor]], topology: Topology, *, ledger: Optional[comm.CommLedger] = None
) -> bool:
    """Whether any rank of this replica (its S × T ranks) has a NaN/Inf gradient: a 4-byte all-reduce(max)
    over S and over T, none over R (the replica's own decision: every rank of it takes the same)."""
    flag = _nonfinite_flag(grads, topology.shard)
    for role in (S, T):
        comm.all_reduce(flag, role, topology.group(role), op="max", ledger=ledger)
    return bool(flag.item() > 0)


def _nonfinite_flag(grads: Iterable[Optional[torch.Tensor]], group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    present = [local(g) for g in grads if g is not None]
    device = present[0].device if present else comm.control_device(group)  # NCCL takes no CPU tensors
    # One flag computed on the device (no host sync per tensor), then one all-reduce and one .item().
    flag = torch.zeros(1, device=device)
    for g in present:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(flag.dtype).reshape(1))
    return flag


def any_rank(
    value: bool, group: Optional[dist.ProcessGroup] = None, *, ledger: Optional[comm.CommLedger] = None
) -> bool:
    """Whether ``value`` is true on any rank of ``group`` (default: all ranks): one 4-byte
    all-reduce(max), so that every rank takes the same decision."""
    return _any_rank(torch.full((1,), float(value), device=comm.control_device(group)), group, ledger)


def _any_rank(flag: torch.Tensor, group: Optional[dist.ProcessGroup], ledger: Optional[comm.CommLedger]) -> bool:
    if dist.is_available() and dist.is_initialized():
        comm.all_reduce(flag, "world", group or dist.group.WORLD, op="max", ledger=ledger)
    return bool(flag.item() > 0)
