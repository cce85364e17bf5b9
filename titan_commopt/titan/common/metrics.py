"""Bytes on the wire in TensorBoard and on the console, next to the loss: our metrics processor on
either torchtitan line (``tt022/metrics.py``, ``tt03/metrics.py``) is torchtitan's own with
:class:`CommMetrics` before it.

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

An evaluation (``[validation]``, ``validation.py``) adds to torchtitan's ``validation_metrics/*`` the
bytes evaluations have sent since the run's process started, kept out of the training totals:
``comm/eval_R_sent_bytes_total``, ``comm/eval_R_recv_bytes_total`` (a local-step family's mean over R,
the replica check's fingerprints) and ``comm/eval_world_bytes_total`` (the check's flag).

The last step of a run (``[training] steps``) is always a log step, whatever ``[metrics] log_freq``:
a run shorter than ``log_freq`` still shows its final loss and totals.

The console line ends with ``next R sync at step N`` for optimizers that sync R only every K steps
(``CommOptimizer.steps_to_next_sync``), so that the ``0B`` of the steps in between is expected.
"""

import json
from typing import Any, Optional

from torchtitan.tools.logging import logger

from .container import CommOptimizersContainer

__all__ = ["CommMetrics", "human_bytes", "step_line"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1000.0
    return f"{n:.2f}GB"


def step_line(step: int, loss: float, scalars: dict[str, float], steps_to_next_sync: Optional[int]) -> str:
    """``scalars``: the container's ``metrics()``; ``steps_to_next_sync``: its
    ``steps_to_next_sync()`` (periodic optimizers: why the steps in between show ``0B``)."""
    ratio = scalars.get("comm/R_ratio_vs_adamw_hsdp")
    return (
        f"step: {step:2}  loss: {loss:8.5f}  "
        f"R sent: {human_bytes(scalars['comm/R_sent_bytes'])}/step  "
        f"R recv: {human_bytes(scalars['comm/R_recv_bytes'])}/step  "
        f"S: {human_bytes(scalars['comm/S_bytes'])}/step  "
        f"R total: {human_bytes(scalars['comm/R_sent_bytes_total'])}"
        + (f"  R vs AdamW-HSDP: {ratio:.4f}x" if ratio is not None else "")
        + (f"  next R sync at step {step + steps_to_next_sync}" if steps_to_next_sync else "")
    )


def _tensorboard_writers(metric_logger: Any) -> list[Any]:
    """The SummaryWriters behind torchtitan's metric logger (a container of loggers, or one)."""
    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    return [lg.writer for lg in loggers if hasattr(lg, "writer")]


class CommMetrics:
    """Put before torchtitan's ``MetricsProcessor`` (either line) in a processor's bases: each log
    step of a run with our container adds its ``metrics()`` to what torchtitan logs, writes the
    resolved options once as text, flushes TensorBoard after a skipped step and prints the console
    line; the last step is always a log step. The processor calls :meth:`_start_comm_log` in its
    ``__init__`` with the run's last step."""

    def _start_comm_log(self, last_step: Optional[int]) -> None:
        self._last_step = last_step
        self._skips_at_last_log = 0.0
        self._options_written = False

    def should_log(self, step: int) -> bool:
        # Every rank decides alike (the loss is all-reduced on a log step): the same config everywhere.
        return super().should_log(step) or step == self._last_step  # type: ignore[misc]

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Optional[dict[str, Any]] = None) -> None:
        container = getattr(self, "optimizers", None)
        if not isinstance(container, CommOptimizersContainer):  # torchtitan's own container: nothing of ours
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)  # type: ignore[misc]
        if not container.committed:
            # Under fault tolerance a step that did not commit is trained again: logged once, when it
            # commits. Decided here, not in should_log: 0.3 asks that before the step is taken.
            return
        scalars = container.metrics()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **scalars})  # type: ignore[misc]
        self._write_extras(step, container, scalars)
        logger.info(step_line(step, global_avg_loss, scalars, container.steps_to_next_sync()))

    def log_validation(self, loss: float, step: int, extra_metrics: Optional[dict[str, Any]] = None) -> None:
        """torchtitan's ``validation_metrics/*`` and its ``validate step:`` console line, with the
        bytes evaluations sent so far (``comm/eval_*``, apart from training's ``comm/*``)."""
        container = getattr(self, "optimizers", None)
        if isinstance(container, CommOptimizersContainer):
            extra_metrics = {**(extra_metrics or {}), **container.eval_metrics()}
        super().log_validation(loss, step, extra_metrics)  # type: ignore[misc]

    def _write_extras(self, step: int, container: CommOptimizersContainer, scalars: dict[str, float]) -> None:
        writers = _tensorboard_writers(self.logger)  # type: ignore[attr-defined]
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
