"""torchtitan's token count of a training step, counted within the replica for optimizers that own R.

Before every step's forward, torchtitan (0.2.2 ``dist_utils.dist_sum``, 0.3 ``dist_sum_tensor``, both
looked up on ``torchtitan.distributed.utils`` at every call) all-reduces the step's count of valid
labels over its ``batch`` mesh, R × S, and divides the loss by it. For an optimizer that owns R that
all-reduce is one of the step's two crossings of the slow link that carry no optimizer bytes (the
other: the clip's norm, ``clipping.py``), and on a link busy with a sync in flight it waits in the
link's queue behind it (docs/benchmarks.md §2: 186 ms for 8 bytes behind a 2.3 MB stream at 10 Mbit/s).

Inside :func:`per_replica` the count is summed over this replica's ranks of the batch mesh only and
multiplied by |R|: the count torchtitan would have found whenever the replicas count alike (the
fixed-length sequences of a packed corpus), and otherwise each replica's loss normalized by its own
batch, as torchtitan's own fault-tolerant DiLoCo normalizes it (its batch mesh is one replica
group's). The gradient stays ``1/|R|`` of the replica's mean gradient, as ``Topology.grad_scale``
reads it. Only where the replica's part of the batch mesh is its
S mesh (no context parallel: torchtitan's batch mesh leaves cp out, S takes it in); elsewhere, and
for every other call (the evaluation's count, the loss logs), torchtitan's own reduction runs.

Module-level state, as for the clip (``clipping.py``): torchtitan's seam is a module function.
:func:`per_replica` sets it for the duration of one training step (``ReplicaGroupSteps.train_step``).
"""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from titan_commopt.topology import Topology

from .patch import wrap_once

__all__ = ["install", "per_replica", "replica_count_applies"]

_NAMES = ("dist_sum", "dist_sum_tensor")  # 0.2.2 has the first only; 0.3 counts with the second
_active: Optional[tuple[Any, Topology]] = None  # (the batch mesh, the run's R/S/T) inside per_replica


def install() -> None:
    """Wrap torchtitan's sum reductions (once); outside :func:`per_replica` they are unchanged."""
    from torchtitan.distributed import utils as dist_utils

    for name in _NAMES:
        if hasattr(dist_utils, name):
            wrap_once(dist_utils, name, _routed)


def replica_count_applies(batch_mesh: Any, topology: Optional[Topology]) -> bool:
    """Whether the batch mesh is R × S (without fault tolerance: under it the batch mesh is one
    replica group's already): then this replica's part of it is its S."""
    if batch_mesh is None or topology is None or topology.replicate is None or topology.quorum is not None:
        return False
    return batch_mesh.size() == topology.replicate_size * topology.shard_size


@contextmanager
def per_replica(batch_mesh: Any, topology: Optional[Topology]) -> Iterator[None]:
    """Within: a sum over ``batch_mesh`` is ``|R| ×`` the sum over this replica's S (see the module
    doc). A no-op where :func:`replica_count_applies` says no."""
    global _active
    if not replica_count_applies(batch_mesh, topology):
        yield
        return
    install()
    outer, _active = _active, (batch_mesh, topology)
    try:
        yield
    finally:
        _active = outer


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_sum(x: Any, mesh: Any = None, extra_pg: Any = None) -> Any:
        if _active is None or extra_pg is not None or mesh is not _active[0]:  # _active[0] is never None
            return original(x, mesh, extra_pg)
        topology = _active[1]
        return original(x, topology.shard, None) * topology.replicate_size  # no S: x itself

    return reduce_sum
