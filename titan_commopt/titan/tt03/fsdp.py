"""torchtitan 0.3's ``fully_shard`` calls, seen by us: R left to our optimizers, SUM on gloo.

torchtitan 0.3's parallelize functions call ``torchtitan.distributed.fsdp.fully_shard`` (a module
global, also for DDP- and TP-only runs). :func:`install` wraps it, once, at import of
``titan_commopt.titan``, which every way of launching does before the model is parallelized (the
config module is imported before the Trainer exists; an ``--override.imports`` module in
``Trainer.__init__`` before the model is built). The wrapper:

- leaves R to the optimizer when the Trainer being built (``building.py``) has our optimizer config
  and it syncs R (``CommOptimizers.Config.syncs_replicate``): FSDP2 shards over the dims after
  ``dp_replicate`` only, so HSDP's gradient all-reduce over R never happens (as 0.2.2's parallelize
  wrapper does; ``set_requires_all_reduce(False)`` leaves every ``p.grad`` None). The R mesh it took
  off is kept (:func:`replicate_mesh`): the container builds its Topology from it and the
  parameters' meshes;
- on a machine without an accelerator makes every FSDP2 module reduce with SUM (gloo has no
  AVG/PREMUL_SUM; torchtitan's gradient divide factor is already 1);
- keeps the mixed-precision policy and ``reshard_after_forward`` for the byte estimates;
- makes torchtitan's closing ``Applied HSDP to the model`` true: with R left to the optimizer it
  reads ``Applied FSDP to the model (R: left to the optimizer)`` (torchtitan words it from the mesh
  it was given, before the wrapper took ``dp_replicate`` off).

What it saw is module-level state (:data:`seen`): the container is built from the model parts
alone, after the model was sharded, and needs the R mesh, the dtypes and the resharding.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch.distributed.device_mesh import DeviceMesh

from ..common.patch import wrap_once
from ..platform.cpu import force_sum_reduction, on_cpu
from .building import trainer_being_built

__all__ = ["install", "replicate_mesh", "seen"]

_REPLICATE = "dp_replicate"


@dataclass
class Seen:
    """What the wrapped ``fully_shard`` saw in this process (the last call wins; one model per run)."""

    leave_replicate: bool = False  # the Trainer's optimizer syncs R: FSDP2 was asked to leave it
    replicate: Optional[DeviceMesh] = None  # the R mesh taken off FSDP's mesh
    replicate_hidden: bool = False
    param_dtype: Any = None
    reduce_dtype: Any = None
    reshard_after_forward: Any = True
    calls: int = 0


seen = Seen()


def _replicate_left_to_optimizer() -> bool:
    """Whether the Trainer being built has an optimizer config that syncs R itself."""
    trainer = trainer_being_built()
    return trainer is not None and bool(getattr(trainer.config.optimizer, "syncs_replicate", False))


def replicate_mesh() -> Optional[DeviceMesh]:
    return seen.replicate


def _without_replicate(mesh: DeviceMesh, kwargs: dict[str, Any]) -> DeviceMesh:
    names = tuple(mesh.mesh_dim_names or ())
    if _REPLICATE not in names or kwargs.get("dp_mesh_dims") is not None:
        # full_dtensor: the parameters are already DTensors on a mesh with dp_replicate, and DTensor
        # reduces their gradients over it whatever FSDP is told (measured: each replica's gradient
        # came out summed over R); left as it is, the container refuses the run with one line.
        return mesh
    seen.replicate = mesh[_REPLICATE]
    seen.replicate_hidden = True
    rest = tuple(n for n in names if n != _REPLICATE)
    return mesh[rest[0]] if len(rest) == 1 else mesh[rest]


class _ShardingLogTruthful(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if seen.replicate_hidden and record.msg == "Applied HSDP to the model":
            record.msg = "Applied FSDP to the model (R: left to the optimizer)"
        return True


def install() -> None:
    """Wrap ``torchtitan.distributed.fsdp.fully_shard`` (once)."""
    from torchtitan.distributed import fsdp

    if wrap_once(fsdp, "fully_shard", _seen_by_us):
        fsdp.logger.addFilter(_ShardingLogTruthful())


def _seen_by_us(original: Callable[..., Any]) -> Callable[..., Any]:
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        mesh = kwargs.get("mesh")
        seen.leave_replicate = _replicate_left_to_optimizer()
        if seen.leave_replicate and mesh is not None:
            kwargs["mesh"] = _without_replicate(mesh, kwargs)
        policy = kwargs.get("mp_policy")
        if policy is not None:
            seen.param_dtype, seen.reduce_dtype = policy.param_dtype, policy.reduce_dtype
        seen.reshard_after_forward = kwargs.get("reshard_after_forward", True)
        seen.calls += 1
        out = original(module, *args, **kwargs)
        if on_cpu():
            for m in out if isinstance(out, list) else [out]:
                force_sum_reduction(m)
        return out

    return fully_shard
