"""torchtitan 0.3's ``MetricsProcessor`` with the ``comm/*`` and ``commopt/*`` scalars next to the loss
(``common/metrics.py``): in TensorBoard (and any other logger torchtitan has on) and on the console.
The Trainer hands the processor its optimizers (``metrics_processor.optimizers``); when they are ours
(``container.py``) each log step adds ``container.metrics()``. The config module uses it; with
``--override.imports`` add ``titan_commopt.titan.tt03.overrides.comm_metrics``.
"""

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from ..common.metrics import CommMetrics

__all__ = ["CommMetricsProcessor"]


class CommMetricsProcessor(CommMetrics, MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_comm_log(((kwargs.get("config_dict") or {}).get("training") or {}).get("steps"))
