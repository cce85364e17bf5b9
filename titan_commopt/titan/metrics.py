"""Bytes on the wire in TensorBoard and on the console, next to the loss.

Each log step adds to the scalars torchtitan writes (same run, same ``tb/`` folder):

- ``comm/R_sent_bytes``, ``comm/R_recv_bytes``, ``comm/S_bytes``: per step, averaged over the steps
  since the previous log step (periodic syncs make single steps spiky);
- ``comm/*_total``: cumulative since the start of the run;
- ``comm/R_seconds``: time spent in our own R collectives per step;
- ``comm/R_ratio_vs_adamw_hsdp``: cumulative R bytes sent / what AdamW over HSDP would have sent
  (the all-reduce of each rank's fp32 gradient shard every step); absent with one replica.

``R`` and ``S`` include FSDP2/HSDP's own collectives as estimates from parameter sizes;
``comm/R_estimated_sent_bytes`` shows the estimated part separately. ``commopt/skipped_steps`` counts
optimizer steps skipped by every rank together because some rank had a non-finite gradient (the
TensorBoard files are flushed at each log step that follows a skip, so a run the skips then stop
keeps them). The run's resolved optimizer options are written once as the text entry
``commopt/resolved_options``.

The console line ends with ``next R sync at step N`` for optimizers that sync R only every K steps
(``CommOptimizer.steps_to_next_sync``), so that the ``0B`` of the steps in between is expected.
"""

import json
from typing import Any, Optional

from titan_commopt import comm


def _per_step(now: dict[str, float], before: dict[str, float], steps: int, key: str) -> float:
    return (now.get(key, 0.0) - before.get(key, 0.0)) / max(steps, 1)


def comm_scalars(ledger: comm.CommLedger, since: dict[str, float], steps: int, adamw_r_bytes: int) -> dict[str, float]:
    """The ``comm/*`` scalars from the ledger's totals now vs at the previous log (``since``)."""
    totals = dict(ledger.totals)

    def both(prefix: str, what: str) -> tuple[float, float]:
        measured, estimated = f"{prefix}_{what}", f"{prefix}_est_{what}"
        return (
            _per_step(totals, since, steps, measured) + _per_step(totals, since, steps, estimated),
            totals.get(measured, 0.0) + totals.get(estimated, 0.0),
        )

    r_sent, r_sent_total = both("R", "sent")
    r_recv, r_recv_total = both("R", "recv")
    s_sent, s_sent_total = both("S", "sent")
    out = {
        "comm/R_sent_bytes": r_sent,
        "comm/R_recv_bytes": r_recv,
        "comm/R_estimated_sent_bytes": _per_step(totals, since, steps, "R_est_sent"),
        "comm/S_bytes": s_sent,
        "comm/R_sent_bytes_total": r_sent_total,
        "comm/R_recv_bytes_total": r_recv_total,
        "comm/S_bytes_total": s_sent_total,
        "comm/R_seconds": _per_step(totals, since, steps, "R_seconds"),
    }
    if adamw_r_bytes > 0 and ledger.steps > 0:
        out["comm/R_ratio_vs_adamw_hsdp"] = r_sent_total / (adamw_r_bytes * ledger.steps)
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1000.0
    return f"{n:.2f}GB"


def _tensorboard_writers(metric_logger: Any) -> list[Any]:
    """The SummaryWriters behind torchtitan's metric logger (a container of loggers, or one)."""
    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    return [lg.writer for lg in loggers if hasattr(lg, "writer")]


def build_metrics_processor(job_config: Any, parallel_dims: Any, model_args: Any = None, tag: Optional[str] = None) -> Any:
    """``build_metrics_processor_fn``: torchtitan's MetricsProcessor plus the ``comm/*`` scalars."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools.logging import logger

    class CommMetricsProcessor(MetricsProcessor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._since: dict[str, float] = {}
            self._steps_at_last_log = 0
            self._skips_at_last_log = 0
            self._options_written = False

        def _write_options(self, step: int) -> None:
            """The run's resolved optimizer options, once, as a TensorBoard text entry."""
            self._options_written = True
            resolved = getattr(self.optimizers, "resolved", None)
            if resolved is None:
                return
            text = "```\n" + json.dumps(resolved.record(), indent=1, sort_keys=True) + "\n```"
            for writer in _tensorboard_writers(self.logger):
                writer.add_text("commopt/resolved_options", text, step)

        def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):  # type: ignore[override]
            container = self.optimizers
            if not self._options_written:
                self._write_options(step)
            ledger = comm.get_ledger()
            steps = ledger.steps - self._steps_at_last_log
            scalars = comm_scalars(
                ledger, self._since, steps, getattr(container, "adamw_reference_r_bytes", 0)
            )
            skipped = int(getattr(container, "skipped_steps", 0))
            scalars["commopt/skipped_steps"] = float(skipped)
            self._since, self._steps_at_last_log = dict(ledger.totals), ledger.steps
            super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **scalars})
            if skipped != self._skips_at_last_log:
                self._skips_at_last_log = skipped
                for writer in _tensorboard_writers(self.logger):
                    writer.flush()
            ratio = scalars.get("comm/R_ratio_vs_adamw_hsdp")
            to_sync = getattr(container, "steps_to_next_sync", lambda: None)()
            logger.info(
                f"step: {step:2}  loss: {global_avg_loss:8.5f}  "
                f"R sent: {human_bytes(scalars['comm/R_sent_bytes'])}/step  "
                f"R recv: {human_bytes(scalars['comm/R_recv_bytes'])}/step  "
                f"S: {human_bytes(scalars['comm/S_bytes'])}/step  "
                f"R total: {human_bytes(scalars['comm/R_sent_bytes_total'])}"
                + (f"  R vs AdamW-HSDP: {ratio:.4f}x" if ratio is not None else "")
                + (f"  next R sync at step {step + to_sync}" if to_sync else "")
            )

    return CommMetricsProcessor(job_config, parallel_dims, tag)
