"""What our optimizer container is made of, built in one order on both torchtitan lines.

0.2.2 builds the container in its TrainSpec's ``build_optimizers_fn`` (``tt022/build.py``), 0.3 in the
container's own constructor (``tt03/container.py``); both hand over the run's Topology and settings
and call :func:`container_arguments`, which

1. refuses a resume that cannot work (``config/resume.py``), before anything is built or loaded;
2. builds torchtitan's own optimizers for AdamW/Adam (R synced by HSDP), else one optimizer of ours
   per model part on the run's Topology and ledger (the resolved options logged once, by rank 0);
3. prices FSDP2's own collectives (``optim/traffic.py``) and what AdamW over HSDP would send over R;

and then :func:`route_clipping`, which hands torchtitan's clip of a container that owns R to it
(``clipping.py``).
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from titan_commopt.comm import CommLedger
from titan_commopt.optim import Resolved
from titan_commopt.topology import Topology

from ..config.checkpoint import CheckpointSettings
from ..config.resume import check_resume, ledger_saved
from . import clipping
from .container import CommOptimizersContainer
from .optimizers import build_per_part, byte_estimates
from .safeguards import Safeguards

__all__ = ["FsdpBytes", "container_arguments", "route_clipping"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FsdpBytes:
    """What FSDP2 sends, as its byte estimates need it: the bytes of a parameter element it
    all-gathers and of a gradient element it reduces, and its all-gathers per step (2: before
    forward and again before backward; 1 when it keeps the parameters after forward)."""

    param_bytes: int
    reduce_bytes: int
    gathers: int


def container_arguments(
    model_parts: list[nn.Module], *, name: str, resolved: Optional[Resolved], topology: Topology, commopt: Any,
    checkpoint: Optional[CheckpointSettings], dp_degree: Optional[int], fsdp_bytes: FsdpBytes,
    stock_optimizers: Callable[[], list[torch.optim.Optimizer]], ledger: CommLedger,
) -> dict[str, Any]:
    """The keyword arguments of ``CommOptimizersContainer`` for this run (see the module docstring).
    ``commopt``: the ``[commopt]`` section; ``checkpoint``: the run's checkpoint settings (None: no
    run's checkpoint to check, e.g. a container built outside a Trainer); ``dp_degree``: dp_replicate ×
    dp_shard; ``stock_optimizers``: torchtitan's own AdamW/Adam, built when ``resolved`` is None."""
    if checkpoint is not None:
        replicas = topology.replicate_size
        if topology.quorum is not None:  # a replica group's own checkpoint: its replica alone, and its data
            replicas, dp_degree = 1, None  # ranks' loader states, keyed by their rank among every group's
        check_resume(checkpoint, resolved, replicas, dp_degree)
    if resolved is None:
        optimizers = stock_optimizers()
    else:
        if _global_rank() == 0:  # the same on every rank: printed once, also under plain torchrun
            logger.info("titan_commopt optimizer, resolved once for this run:\n%s", resolved.describe())
        optimizers = build_per_part(model_parts, topology, resolved, ledger)
    traffic, adamw_reference = byte_estimates(
        model_parts, topology, enabled=commopt.hsdp_estimates, param_bytes=fsdp_bytes.param_bytes,
        reduce_bytes=fsdp_bytes.reduce_bytes, gathers=fsdp_bytes.gathers, hsdp_r_sync=resolved is None,
    )
    return dict(
        model_parts=model_parts, optimizers=optimizers, name=name, resolved=resolved, topology=topology,
        ledger=ledger, fsdp_traffic=traffic, adamw_reference_r_bytes=adamw_reference,
        safeguards=Safeguards.of(commopt),
        clip_scope=clip_scope_of(commopt.clip_scope, resolved),
        ledger_in_checkpoint=True if checkpoint is None else ledger_saved(checkpoint),
    )


def clip_scope_of(scope: str, resolved: Optional[Resolved]) -> str:
    """``[commopt] clip_scope`` as the run's container takes it: ``"auto"`` is ``"replica"`` for a family
    whose replicas step alone between syncs (``Family.local_steps``), ``"replicas"`` for the others."""
    if scope != "auto":
        return scope
    return "replica" if resolved is not None and resolved.family.local_steps else "replicas"


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def route_clipping(container: CommOptimizersContainer) -> None:
    """torchtitan's clip of ``container``'s parameters goes to ``container`` when it owns R."""
    if container.owns_replicate_sync:
        clipping.install()
        clipping.register(container)
