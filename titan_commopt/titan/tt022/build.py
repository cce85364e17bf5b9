"""``build_optimizers_fn`` of our TrainSpecs: torchtitan 0.2.2's meshes and parameters → our container.

``AdamW``/``Adam`` are torchtitan's own optimizers, untouched (the baseline, R synced by HSDP); any
other name was resolved once with the run (``run_context.py``: ``[optimizer]`` +
``[commopt.<family>]`` + the name's preset) and is built by its family on the Topology of this run's
meshes, recording on the run's ledger. What the container is made of, and in which order, is both
lines' (``common/build.py``); this line hands it the job config's settings.
"""

from typing import Any, Optional

from torch import nn

from ..common.build import FsdpBytes, container_arguments, route_clipping
from ..common.container import CommOptimizersContainer
from ..common.mesh import topology_of
from ..common.optimizers import itemsize
from ..config.checkpoint import CheckpointSettings
from ..config.section import commopt_of
from .run_context import CommoptRun

__all__ = ["build_optimizers"]


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: Any, ft_manager: Any = None, *,
    run: Optional[CommoptRun] = None,
) -> CommOptimizersContainer:
    """``build_optimizers_fn`` of our TrainSpecs; ``run`` is bound in by our Trainer (``spec.bind_run``),
    else made here from the command line (``run_context.py``)."""
    run = CommoptRun.from_command_line() if run is None else run
    job_config = run.job_config
    group = run.fault_tolerance.group if run.fault_tolerance is not None else None
    run.topology = topology_of(parallel_dims, group)
    training = job_config.training

    def stock_optimizers() -> list[Any]:
        from torchtitan.components.optimizer import build_optimizers as stock_build

        return list(stock_build(model_parts, optimizer_config, parallel_dims, ft_manager))

    container = CommOptimizersContainer(**container_arguments(
        model_parts, name=optimizer_config.name, resolved=run.resolved, topology=run.topology,
        commopt=commopt_of(job_config), checkpoint=CheckpointSettings.of_job_config(job_config),
        dp_degree=parallel_dims.dp_replicate * parallel_dims.dp_shard,
        fsdp_bytes=FsdpBytes(
            param_bytes=itemsize(training.mixed_precision_param), reduce_bytes=itemsize(training.mixed_precision_reduce),
            gathers=1 if job_config.parallelism.fsdp_reshard_after_forward == "never" else 2,
        ),
        stock_optimizers=stock_optimizers, ledger=run.ledger,
    ))
    route_clipping(container)
    if group is not None:
        container.attach_fault_tolerance(group)
    return container
