"""Building our optimizers from a torchtitan run's model parts, for both lines.

- :func:`build_per_part`: every replica starts from replica 0's parameters (one R broadcast, not a
  training step's traffic), then one optimizer per model part on the run's Topology and ledger;
- :func:`byte_estimates`: FSDP2's own collectives as estimates from parameter sizes
  (``optim/traffic.py``; ``None`` when ``[commopt] hsdp_estimates`` is off) and what AdamW over HSDP
  would send over R per step (the reference of ``comm/R_ratio_vs_adamw_hsdp``);
- :func:`leave_together`: the end of a successful training, every rank at once.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import CommOptimizer, Resolved, ShardShape, broadcast_parameters, build_optimizer
from titan_commopt.optim.traffic import FsdpTraffic, adamw_hsdp_r_bytes, fsdp_traffic
from titan_commopt.topology import Topology

__all__ = ["shard_shapes", "build_per_part", "byte_estimates", "itemsize", "leave_together"]


def shard_shapes(model_parts: list[nn.Module]) -> list[ShardShape]:
    """This rank's trainable parameter shards: what every byte formula reads."""
    return [ShardShape.of(n, p) for m in model_parts for n, p in m.named_parameters() if p.requires_grad]


def itemsize(dtype: "torch.dtype | str") -> int:
    return torch.empty((), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()


def build_per_part(
    model_parts: list[nn.Module], topology: Topology, resolved: Resolved, ledger: comm.CommLedger
) -> list[CommOptimizer]:
    setup = comm.CommLedger()  # the initial broadcast is not a training step's traffic
    optimizers = []
    for model in model_parts:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        broadcast_parameters([p for _, p in named], topology, ledger=setup)
        optimizers.append(build_optimizer(named, topology, resolved, ledger=ledger))
    return optimizers


def byte_estimates(
    model_parts: list[nn.Module], topology: Topology, *, enabled: bool, param_bytes: int, reduce_bytes: int,
    gathers: int, hsdp_r_sync: bool,
) -> tuple[Optional[FsdpTraffic], float]:
    """``(FSDP2's estimated traffic or None, AdamW-HSDP's R bytes sent per step)``."""
    shards = shard_shapes(model_parts)
    traffic = None
    if enabled:
        traffic = fsdp_traffic(
            shards, topology.shard_size, topology.replicate_size, param_bytes=param_bytes,
            reduce_bytes=reduce_bytes, gathers=gathers, hsdp_r_sync=hsdp_r_sync,
        )
    return traffic, adamw_hsdp_r_bytes(shards, topology.replicate_size, reduce_bytes).sent


def leave_together(optimizers: object) -> None:
    """After the last step: land our optimizers' R syncs still in flight (an overlapped update, a
    streaming fragment; torchtitan's own containers have no ``flush``), then a barrier.

    torchtitan's rank 0 sleeps 2 s after training "for other ranks to complete" while the others go
    on to tear their process groups down; a gloo rank has been seen to abort (SIGABRT) during that
    teardown (twice in one CI run of ~100 launches, under load). All ranks leave training together
    instead (only on success: after an error a peer may never arrive). The abort was seen again after
    this barrier, in the interpreter's teardown: see ``train.exit_after_success``."""
    flush = getattr(optimizers, "flush", None)
    if flush is not None:
        flush()
    if dist.is_initialized():
        # NCCL's barrier wants its device named (else a warning on every rank)
        on_nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_nccl else None)
