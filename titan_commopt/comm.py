"""Every collective titan_commopt issues goes through this module, and is counted.

The ledger records ``(role, op, bytes sent, bytes received, seconds, estimated)`` per collective;
``CommLedger.end_step`` closes a step and folds it into cumulative totals.

Byte convention: *payload per rank*, the unit the papers' formulas use (DeMo's "MB/step/GPU",
DES-LOC's "d elements per sync"):

- all-reduce of an n-byte buffer: sent n, received n (a ring moves 2(W-1)/W·n each way; the
  payload is what the algorithm chose to send, independent of the collective's implementation);
- all-gather of an n-byte local buffer over W ranks: sent n, received (W-1)·n;
- reduce-scatter of a W·c-byte buffer over W ranks (c bytes end up on each rank): sent (W-1)·c
  (its contributions to the other ranks' chunks), received (W-1)·c (theirs to its own chunk);
- broadcast of n bytes: the source sends n, every other rank receives n.

A group of one (``None`` or size 1) is a no-op and records nothing. gloo has no AVG reduction,
so ``op="mean"`` is a SUM followed by a division, on every backend (same numbers everywhere).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CommRecord",
    "CommLedger",
    "get_ledger",
    "use_ledger",
    "all_reduce",
    "all_reduce_fused",
    "all_gather",
    "all_gather_object",
    "reduce_scatter",
    "broadcast",
    "group_rank",
    "record_estimate",
    "nbytes",
    "DTYPES",
]

# Transfer dtypes by config name.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class CommRecord:
    role: str
    op: str
    sent: int
    recv: int
    seconds: float
    estimated: bool = False


class CommLedger:
    """Per-step and cumulative byte/time counts, keyed by group role (``R``, ``S``, ``T``)."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []  # current (open) step
        self.totals: dict[str, float] = defaultdict(float)  # cumulative, see ``summarize`` keys
        self.steps = 0
        self.last_step: dict[str, float] = {}

    def record(
        self, role: str, op: str, sent: int, recv: int, seconds: float = 0.0, estimated: bool = False
    ) -> None:
        self.records.append(CommRecord(role, op, int(sent), int(recv), float(seconds), estimated))

    @staticmethod
    def summarize(records: Iterable[CommRecord]) -> dict[str, float]:
        """``{"R_sent": ..., "R_recv": ..., "R_seconds": ..., "R_est_sent": ...}`` etc.

        Measured (our own collectives) and estimated (FSDP2's, from parameter sizes) are kept
        apart: ``<role>_sent`` counts only measured bytes, ``<role>_est_sent`` only estimates.
        """
        out: dict[str, float] = defaultdict(float)
        for r in records:
            prefix = f"{r.role}_est" if r.estimated else r.role
            out[f"{prefix}_sent"] += r.sent
            out[f"{prefix}_recv"] += r.recv
            out[f"{prefix}_calls"] += 1
            if not r.estimated:
                out[f"{r.role}_seconds"] += r.seconds
        return dict(out)

    def current(self) -> dict[str, float]:
        return self.summarize(self.records)

    def end_step(self) -> dict[str, float]:
        """Close the current step: return its summary and add it to the totals."""
        summary = self.current()
        for k, v in summary.items():
            self.totals[k] += v
        self.steps += 1
        self.last_step = summary
        self.records = []
        return summary

    def reset(self) -> None:
        self.records = []
        self.totals = defaultdict(float)
        self.steps = 0
        self.last_step = {}

    def state_dict(self) -> dict[str, object]:
        return {"totals": dict(self.totals), "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.totals = defaultdict(float, dict(state["totals"]))  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[arg-type]


_LEDGER = CommLedger()


def get_ledger() -> CommLedger:
    """The process-wide ledger: optimizers and the TensorBoard hook share it."""
    return _LEDGER


@contextmanager
def use_ledger(ledger: CommLedger) -> Iterator[CommLedger]:
    """Send the records of everything inside the block to ``ledger`` instead of the process-wide one
    (set-up and checkpoint traffic that is not a training step's)."""
    global _LEDGER
    previous, _LEDGER = _LEDGER, ledger
    try:
        yield ledger
    finally:
        _LEDGER = previous


def _active(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's index inside ``group`` (0 in a group of one or ``None``). A query, no traffic."""
    return dist.get_rank(group) if _active(group) else 0


def _timed(ledger: Optional[CommLedger], role: str, op: str, sent: int, recv: int, fn):
    start = time.perf_counter()
    result = fn()
    (ledger or _LEDGER).record(role, op, sent, recv, time.perf_counter() - start)
    return result


def all_reduce(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    op: str = "sum",
    ledger: Optional[CommLedger] = None,
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; ``op`` in sum/mean/max/min."""
    if not _active(group):
        return tensor
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]
    n = nbytes(tensor)
    _timed(ledger, role, f"all_reduce_{op}", n, n, lambda: dist.all_reduce(tensor, reduce_op, group=group))
    if op == "mean":
        tensor.div_(dist.get_world_size(group))
    return tensor


def all_reduce_fused(
    tensors: Sequence[torch.Tensor],
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    op: str = "mean",
    dtype: Optional[torch.dtype] = None,
    ledger: Optional[CommLedger] = None,
) -> None:
    """All-reduce several tensors as one flat buffer (one collective), results written back in place.

    ``dtype`` is the transfer dtype (e.g. bf16); the reduction result is cast back to each
    tensor's own dtype. Tensors may have different dtypes and shapes.
    """
    if not _active(group) or not tensors:
        return
    wire_dtype = dtype or tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(wire_dtype) for t in tensors])
    all_reduce(flat, role, group, op=op, ledger=ledger)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def all_gather(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
) -> torch.Tensor:
    """Gather equal-shaped tensors from every rank of ``group``: returns ``[W, *tensor.shape]``.

    A group of one returns ``tensor.unsqueeze(0)`` (no copy of data is sent anywhere).
    """
    if not _active(group):
        return tensor.unsqueeze(0)
    w = dist.get_world_size(group)
    out = torch.empty((w, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    n = nbytes(tensor)
    src = tensor.contiguous()
    _timed(
        ledger, role, "all_gather", n, (w - 1) * n,
        lambda: dist.all_gather(list(out.unbind(0)), src, group=group),
    )
    return out


def reduce_scatter(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
) -> torch.Tensor:
    """Sum ``tensor`` (shape ``[W, *chunk]``) over ``group`` and return this rank's ``chunk``: row i of
    the sum lands on the rank with index i. The inverse of :func:`all_gather` (``[W, *chunk]`` from
    ``chunk``); together they move what an all-reduce of ``tensor`` moves. A group of one returns
    ``tensor[0]``. gloo has it too (torch >= 2.13), so every backend runs the same collective.
    """
    if not _active(group):
        return tensor[0]
    w = dist.get_world_size(group)
    if tensor.shape[0] != w:
        raise ValueError(f"reduce_scatter: leading dim {tensor.shape[0]} != group size {w}")
    out = torch.empty(tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    c = nbytes(out)
    src = tensor.reshape(-1)  # the concatenated form: gloo takes no stacked input
    _timed(
        ledger, role, "reduce_scatter", (w - 1) * c, (w - 1) * c,
        lambda: dist.reduce_scatter_single(out.view(-1), src, dist.ReduceOp.SUM, group=group),
    )
    return out


def all_gather_object(obj: object, role: str, group: Optional[dist.ProcessGroup]) -> list[object]:
    """Gather a small picklable object (config checks, fingerprints). Not counted in bytes:
    it is control traffic of a few bytes, sent outside the training step."""
    if not _active(group):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(
    tensor: torch.Tensor,
    src_group_rank: int,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
) -> torch.Tensor:
    """In-place broadcast from the rank with index ``src_group_rank`` inside ``group``."""
    if not _active(group):
        return tensor
    n = nbytes(tensor)
    is_src = dist.get_rank(group) == src_group_rank
    _timed(
        ledger, role, "broadcast", n if is_src else 0, 0 if is_src else n,
        lambda: dist.broadcast(tensor, group_src=src_group_rank, group=group),
    )
    return tensor


def record_estimate(
    role: str, op: str, sent: int, recv: int, *, ledger: Optional[CommLedger] = None
) -> None:
    """Record a collective that someone else (FSDP2) issues, estimated from tensor sizes."""
    (ledger or _LEDGER).record(role, op, sent, recv, 0.0, estimated=True)


def ceil_log2(n: int) -> int:
    """Bits needed for an index in ``range(n)`` (at least 1)."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1
