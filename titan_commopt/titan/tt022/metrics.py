"""Bytes on the wire in TensorBoard and on the console, next to the loss.

Each log step adds to the scalars torchtitan writes (same run, same ``tb/`` folder) what the
optimizer container returns (``CommOptimizersContainer.metrics``):

- ``comm/R_sent_bytes``, ``comm/R_recv_bytes``, ``comm/S_bytes``, ``comm/T_bytes``,
  ``comm/world_bytes``: per step, averaged over the steps since the previous log step (periodic
  syncs make single steps spiky); ``world`` is the control traffic over every rank (the clip's
  norm all-reduce, the non-finite vote, the drift check);
- ``comm/*_total``: cumulative since the start of the run, a resumed run included (the ledger's
  totals are saved with the optimizer's checkpoint state and restored with it);
- ``comm/R_seconds``: time spent in our own R collectives per step;
- ``comm/R_ratio_vs_adamw_hsdp``: cumulative R bytes sent / what AdamW over HSDP would have sent
  (the all-reduce of each rank's fp32 gradient shard every step); absent with one replica.

``R`` and ``S`` include FSDP2/HSDP's own collectives as estimates from parameter sizes;
``comm/R_estimated_sent_bytes`` shows the estimated part separately (the names are made in one
place: ``comm.scalars``). ``commopt/skipped_steps`` counts optimizer steps skipped by every rank
together because some rank had a non-finite gradient (the TensorBoard files are flushed at each log
step that follows a skip, so a run the skips then stop keeps them); ``commopt/<name>``: an
optimizer's own scalars (``CommOptimizer.metrics``). The run's resolved optimizer options are
written once as the text entry ``commopt/resolved_options``.

The last step of a run (``[training] steps``) is always a log step, whatever ``[metrics] log_freq``:
a run shorter than ``log_freq`` still shows its final loss and totals.

The console line ends with ``next R sync at step N`` for optimizers that sync R only every K steps
(``CommOptimizer.steps_to_next_sync``), so that the ``0B`` of the steps in between is expected.
"""

import json
from typing import Any, Optional

from ..common.console_line import step_line
from ..common.container import CommOptimizersContainer


def _tensorboard_writers(metric_logger: Any) -> list[Any]:
    """The SummaryWriters behind torchtitan's metric logger (a container of loggers, or one)."""
    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    return [lg.writer for lg in loggers if hasattr(lg, "writer")]


class CommLogState:
    """What a metrics processor of either torchtitan line adds at each log step of a run with our
    container: the resolved options once as text, a flush after a skip, the console line."""

    def __init__(self) -> None:
        self._skips_at_last_log = 0.0
        self._options_written = False

    def log(self, metric_logger: Any, step: int, loss: float, container: CommOptimizersContainer,
            scalars: dict[str, float]) -> str:
        """Called after the processor logged ``scalars``; returns the console line."""
        writers = _tensorboard_writers(metric_logger)
        if not self._options_written:
            self._options_written = True
            if container.resolved is not None:
                text = "```\n" + json.dumps(container.resolved.record(), indent=1, sort_keys=True) + "\n```"
                for writer in writers:
                    writer.add_text("commopt/resolved_options", text, step)
        skipped = scalars["commopt/skipped_steps"]
        if skipped != self._skips_at_last_log:
            self._skips_at_last_log = skipped
            for writer in writers:
                writer.flush()
        return step_line(step, loss, scalars, container.steps_to_next_sync())


def build_metrics_processor(job_config: Any, parallel_dims: Any, model_args: Any = None, tag: Optional[str] = None) -> Any:
    """``build_metrics_processor_fn``: torchtitan's MetricsProcessor plus the ``comm/*`` scalars."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools.logging import logger

    class CommMetricsProcessor(MetricsProcessor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._comm_log = CommLogState()

        def should_log(self, step: int) -> bool:
            # Every rank decides alike (the loss is all-reduced on a log step): the same config everywhere.
            return super().should_log(step) or step == self.job_config.training.steps

        def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):  # type: ignore[override]
            container = self.optimizers
            if not isinstance(container, CommOptimizersContainer):  # a stock spec's: nothing of ours
                return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
            scalars = container.metrics()
            super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **scalars})
            logger.info(self._comm_log.log(self.logger, step, global_avg_loss, container, scalars))

    return CommMetricsProcessor(job_config, parallel_dims, tag)
