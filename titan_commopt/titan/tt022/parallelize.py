"""torchtitan 0.2.2's parallelize wrapper: R is left to the optimizers that sync it themselves.

For optimizers that own the replicate (R) sync, :func:`wrap_parallelize` hides ``dp_replicate`` from
the model's stock ``parallelize_fn``, so FSDP2 shards over ``fsdp`` only and HSDP's gradient
all-reduce over R never happens (hiding the dim is what works in torchtitan 0.2.2;
``set_requires_all_reduce(False)`` is not enough: the replicate dim stays in every parameter's
mesh). On CPU it makes FSDP2 reduce with SUM (gloo has no AVG).
"""

from typing import Any, Callable

from torch import nn

from titan_commopt.optim import owns_replicate_sync

from ..platform.cpu import force_sum_reduction, on_cpu

__all__ = ["wrap_parallelize"]


class _ReplicateHidden:
    """A view of ``ParallelDims`` in which ``dp_replicate`` does not exist, for ``parallelize_fn``."""

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)

    @property
    def dp_replicate(self) -> int:
        return 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return False


def wrap_parallelize(stock: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        dims = parallel_dims
        if owns_replicate_sync(job_config.optimizer.name) and parallel_dims.dp_replicate_enabled:
            dims = _ReplicateHidden(parallel_dims)
        model = stock(model, dims, job_config)
        if on_cpu():
            force_sum_reduction(model)
        return model

    return parallelize
