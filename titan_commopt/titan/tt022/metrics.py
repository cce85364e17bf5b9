"""torchtitan 0.2.2's ``build_metrics_processor_fn`` of our TrainSpec: its ``MetricsProcessor`` with
the ``comm/*`` and ``commopt/*`` scalars next to the loss (``common/metrics.py``)."""

from typing import Any, Optional

from torchtitan.components.metrics import MetricsProcessor

from ..common.metrics import CommMetrics

__all__ = ["CommMetricsProcessor", "build_metrics_processor"]


class CommMetricsProcessor(CommMetrics, MetricsProcessor):
    def __init__(self, job_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(job_config, *args, **kwargs)
        self._start_comm_log(job_config.training.steps)


def build_metrics_processor(job_config: Any, parallel_dims: Any, model_args: Any = None, tag: Optional[str] = None) -> Any:
    """``build_metrics_processor_fn``: torchtitan's MetricsProcessor plus the ``comm/*`` scalars."""
    return CommMetricsProcessor(job_config, parallel_dims, tag)
