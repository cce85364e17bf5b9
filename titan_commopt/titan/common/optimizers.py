"""Building our optimizers from a torchtitan run's model parts, for both lines.

- :func:`build_per_part`: every replica starts from replica 0's parameters (one R broadcast, not a
  training step's traffic), then one optimizer per model part on the run's Topology and ledger;
- :func:`byte_estimates`: FSDP2's own collectives as estimates from parameter sizes
  (``optim/traffic.py``; ``None`` when ``[commopt] hsdp_estimates`` is off) and what AdamW over HSDP
  would send over R per step (the reference of ``comm/R_ratio_vs_adamw_hsdp``);
"""

from typing import Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import CommOptimizer, Resolved, ShardShape, broadcast_parameters, build_optimizer
from titan_commopt.optim.traffic import FsdpTraffic, adamw_hsdp_r_bytes, fsdp_traffic
from titan_commopt.topology import Topology

__all__ = ["shard_shapes", "build_per_part", "byte_estimates", "itemsize"]


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
        if topology.quorum is None:  # under fault tolerance the first quorum heals every group from one
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
