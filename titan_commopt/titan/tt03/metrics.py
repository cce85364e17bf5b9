"""torchtitan 0.3's ``MetricsProcessor`` with the ``comm/*`` and ``commopt/*`` scalars next to the loss
(``common/metrics.py``): in TensorBoard (and any other logger torchtitan has on) and on the console.
The Trainer hands the processor its optimizers (``metrics_processor.optimizers``); when they are ours
(``container.py``) each log step adds ``container.metrics()``. Under fault tolerance each replica
group writes TensorBoard under ``<dump_folder>/tb/<time>/replica_<id>`` (as 0.2.2 and torchtitan's
torchft Trainer do; the Trainer sets ``Config._replica_id``). The config module uses it; with
``--override.imports`` add ``titan_commopt.titan.tt03.overrides.comm_metrics``.
"""

from dataclasses import dataclass
from typing import Any, Optional

import tyro
from torchtitan.components.metrics import MetricsProcessor

from ..common.metrics import CommMetrics

__all__ = ["CommMetricsProcessor"]


class CommMetricsProcessor(CommMetrics, MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        _replica_id: tyro.conf.Suppress[Optional[int]] = None
        """The replica group of a fault-tolerant run (not a flag; set by ``ReplicaGroupTrainer``): its
        TensorBoard goes in a folder of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        replica_id = kwargs["config"]._replica_id
        if replica_id is not None:  # one replica group of a fault-tolerant run: its own folder, as on 0.2.2
            kwargs.setdefault("ft_enable", True)
            kwargs.setdefault("ft_replica_id", replica_id)
        super().__init__(*args, **kwargs)
        self._start_comm_log(((kwargs.get("config_dict") or {}).get("training") or {}).get("steps"))
