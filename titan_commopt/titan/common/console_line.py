"""The console line of a log step, for both lines: the loss and the bytes on the wire, one line."""

from typing import Optional

__all__ = ["human_bytes", "step_line"]


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
