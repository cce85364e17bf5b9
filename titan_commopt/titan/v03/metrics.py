"""torchtitan 0.3's ``MetricsProcessor`` plus our scalars: ``comm/*`` and ``commopt/*`` in TensorBoard
(and any other logger torchtitan has on), next to the loss; what they mean is the 0.2.2 adapter's
``adapter/metrics.py``. The Trainer hands the processor its optimizers (``metrics_processor.optimizers``):
when they are ours (``v03/container.py``) each log step adds ``container.metrics()`` and prints the
bytes on the console. The config module uses it; with ``--override.imports`` add
``titan_commopt.titan.v03.overrides.comm_metrics``.
"""

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from ..adapter.container import CommOptimizersContainer
from ..adapter.metrics import human_bytes

__all__ = ["CommMetricsProcessor"]


class CommMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        container = getattr(self, "optimizers", None)
        if not isinstance(container, CommOptimizersContainer):
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        scalars = container.metrics()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **scalars})
        to_sync = container.steps_to_next_sync()
        logger.info(
            f"step: {step:2}  R sent: {human_bytes(scalars['comm/R_sent_bytes'])}/step  "
            f"S: {human_bytes(scalars['comm/S_bytes'])}/step  "
            f"R total: {human_bytes(scalars['comm/R_sent_bytes_total'])}"
            + (f"  next R sync at step {step + to_sync}" if to_sync else "")
        )
