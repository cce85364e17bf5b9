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

from ..common.container import CommOptimizersContainer
from ..tt022.metrics import CommLogState

__all__ = ["CommMetricsProcessor"]


class CommMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._comm_log = CommLogState()
        self._last_step = ((kwargs.get("config_dict") or {}).get("training") or {}).get("steps")

    def should_log(self, step: int) -> bool:
        # The last step is a log step whatever log_freq (as on 0.2.2, adapter/metrics.py); every
        # rank decides alike: the same config everywhere.
        return super().should_log(step) or step == self._last_step

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        container = getattr(self, "optimizers", None)
        if not isinstance(container, CommOptimizersContainer):
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        scalars = container.metrics()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **scalars})
        logger.info(self._comm_log.log(self.logger, step, global_avg_loss, container, scalars))
