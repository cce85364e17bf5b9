"""``build_optimizers_fn`` of our TrainSpecs: torchtitan's meshes and parameters → our optimizers.

``AdamW``/``Adam`` are torchtitan's own optimizers, untouched (the baseline, R synced by HSDP); any
other name was resolved once with the run (``run_context.py``: ``[optimizer]`` +
``[commopt.<family>]`` + the name's preset), is logged, and built by its family on the Topology of
this run's meshes, recording on the run's ledger. The container (``container.py``) closes the
ledger's step after every optimizer step, adds FSDP2's own collectives as labelled estimates
(``optim/traffic.py``) and, for optimizers that own R, takes over torchtitan's gradient clipping
(``clipping.py``). A resume is checked against the checkpoint before anything is built
(``titan/config/resume.py``).
"""

import logging
from typing import Any, Optional

from torch import nn


from ..config.resume import check_resume, ledger_saved
from ..config.section import commopt_of
from ..common.mesh import topology_of
from ..common.optimizers import build_per_part, byte_estimates, itemsize
from ..common import clipping
from ..common.container import CommOptimizersContainer, Safeguards
from .run_context import CommoptRun

__all__ = ["build_optimizers", "topology_of"]

logger = logging.getLogger(__name__)


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: Any, ft_manager: Any = None, *,
    run: Optional[CommoptRun] = None,
) -> CommOptimizersContainer:
    """``build_optimizers_fn`` of our TrainSpecs; ``run`` is bound in by our Trainer (``spec.bind_run``),
    else made here from the command line (run_context.py)."""
    run = CommoptRun.from_command_line() if run is None else run
    job_config, resolved = run.job_config, run.resolved
    name = optimizer_config.name
    run.topology = topology = topology_of(parallel_dims)
    check_resume(job_config, resolved, topology.replicate_size, parallel_dims.dp_replicate * parallel_dims.dp_shard)
    if resolved is None:
        from torchtitan.components.optimizer import build_optimizers as stock_build

        optimizers = list(stock_build(model_parts, optimizer_config, parallel_dims, ft_manager))
    else:
        logger.info("titan_commopt optimizer, resolved once for this run:\n%s", resolved.describe())
        optimizers = build_per_part(model_parts, topology, resolved, run.ledger)
    commopt = commopt_of(job_config)
    training = job_config.training
    reduce_bytes = itemsize(training.mixed_precision_reduce)
    traffic, adamw_reference = byte_estimates(
        model_parts, topology, enabled=commopt.hsdp_estimates,
        param_bytes=itemsize(training.mixed_precision_param), reduce_bytes=reduce_bytes,
        gathers=1 if job_config.parallelism.fsdp_reshard_after_forward == "never" else 2,
        hsdp_r_sync=resolved is None,
    )
    container = CommOptimizersContainer(
        model_parts,
        optimizers,
        name=name,
        resolved=resolved,
        topology=topology,
        ledger=run.ledger,
        fsdp_traffic=traffic,
        adamw_reference_r_bytes=adamw_reference,
        safeguards=Safeguards.of(commopt),
        ledger_in_checkpoint=ledger_saved(job_config),
    )
    if resolved is not None:
        clipping.install()
        clipping.register(container)
    return container
