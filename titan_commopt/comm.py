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
- all-to-all: sent what this rank sends to the *other* ranks, received what it gets from them (its
  block to itself is a local copy);
- broadcast of n bytes: the source sends n, every other rank receives n.

A group of one (``None`` or size 1) is a no-op and records nothing. ``op="mean"`` is the backend's
AVG where it has one (NCCL, and RCCL, which registers as "nccl"); gloo has none, so there it is a
SUM followed by a division.

Overlap: every collective takes ``async_op=True`` and then returns a :class:`Pending` at once;
``Pending.wait()`` blocks until the collective has completed and returns its result (the mean
division, the copy back into fused tensors: whatever the synchronous form would have done). Inside
:func:`deferred` an asynchronous collective is issued but not yet launched on the wire: it is launched
by ``Pending.launch()`` (the overlap runtime's ``launch``, at the next step's start) or by its first
wait or drop, so that what the caller sends in between (torchtitan's log collectives) is not queued
behind it on a slow link. Bytes are counted when a collective is issued, in the step that issues it.
Seconds are counted from its launch until it completes, on the clock of its tensors' device: on
CPU the host clock; on a GPU a pair of timing events around it, read by ``CommLedger.end_step`` only
once the device has passed them (``Event.query``), so timing adds no host synchronization; such
seconds land in the step that is being closed when they become readable.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "CommRecord",
    "CommLedger",
    "Pending",
    "get_ledger",
    "scalars",
    "eval_scalars",
    "all_reduce",
    "all_reduce_fused",
    "all_gather",
    "all_gather_mean",
    "all_gather_object",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "group_rank",
    "group_size",
    "group_ranks",
    "record_estimate",
    "managed_group",
    "deferred",
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


TIME_OP = "time"  # a record that carries only the seconds of a collective counted earlier


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
        self._device_timers: list[tuple[str, Any, Any]] = []  # (role, start event, end event)

    def record(
        self, role: str, op: str, sent: int, recv: int, seconds: float = 0.0, estimated: bool = False
    ) -> None:
        self.records.append(CommRecord(role, op, int(sent), int(recv), float(seconds), estimated))

    def add_time(self, role: str, seconds: float) -> None:
        """Seconds a collective took, counted apart from its bytes (it may complete in a later step)."""
        self.records.append(CommRecord(role, TIME_OP, 0, 0, float(seconds)))

    def add_device_timer(self, role: str, start: Any, end: Any) -> None:
        """A collective timed by two device events: counted once the device has passed ``end``."""
        self._device_timers.append((role, start, end))

    def _read_device_timers(self) -> None:
        waiting = []
        for role, start, end in self._device_timers:
            if end.query():  # non-blocking: never waits for the device
                self.add_time(role, start.elapsed_time(end) / 1e3)
            else:
                waiting.append((role, start, end))
        self._device_timers = waiting

    @staticmethod
    def summarize(records: Iterable[CommRecord]) -> dict[str, float]:
        """``{"R_sent": ..., "R_recv": ..., "R_seconds": ..., "R_est_sent": ...}`` etc.

        Measured (our own collectives) and estimated (FSDP2's, from parameter sizes) are kept
        apart: ``<role>_sent`` counts only measured bytes, ``<role>_est_sent`` only estimates.
        """
        out: dict[str, float] = defaultdict(float)
        for r in records:
            prefix = f"{r.role}_est" if r.estimated else r.role
            if r.op != TIME_OP:
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
        self._read_device_timers()
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
        """The cumulative totals and step count: saved with a checkpoint, so that ``comm/*_total``
        continues across a resume."""
        return {"totals": dict(self.totals), "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.totals = defaultdict(float, dict(state["totals"]))  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[arg-type]


def scalars(ledger: CommLedger, since: dict[str, float], steps: int, adamw_r_sent: float = 0.0) -> dict[str, float]:
    """The ``comm/*`` scalars of ``ledger`` (the one place their names are made from
    :meth:`CommLedger.summarize`'s keys). Per step: averaged over the ``steps`` closed since the
    totals were ``since``; ``*_total``: cumulative. Each role adds the measured and the estimated
    (FSDP2's) bytes it sent, ``comm/R_estimated_sent_bytes`` shows R's estimated part. Roles: R, S,
    T (the tensor-parallel groups) and world (control collectives over every rank: the clip's
    norm, the non-finite vote, the drift check's flag). ``comm/R_ratio_vs_adamw_hsdp``: cumulative R bytes
    sent / ``adamw_r_sent`` per closed step (absent when that is 0)."""
    totals = ledger.totals

    def per_step(key: str) -> float:
        return (totals.get(key, 0.0) - since.get(key, 0.0)) / max(steps, 1)

    def sent(role: str, what: str = "sent") -> tuple[float, float]:
        keys = (f"{role}_{what}", f"{role}_est_{what}")
        return sum(per_step(k) for k in keys), sum(totals.get(k, 0.0) for k in keys)

    r_sent, r_sent_total = sent("R")
    r_recv, r_recv_total = sent("R", "recv")
    s_sent, s_sent_total = sent("S")
    t_sent, t_sent_total = sent("T")
    world_sent, world_sent_total = sent("world")
    out = {
        "comm/R_sent_bytes": r_sent,
        "comm/R_recv_bytes": r_recv,
        "comm/R_estimated_sent_bytes": per_step("R_est_sent"),
        "comm/S_bytes": s_sent,
        "comm/T_bytes": t_sent,
        "comm/world_bytes": world_sent,
        "comm/R_sent_bytes_total": r_sent_total,
        "comm/R_recv_bytes_total": r_recv_total,
        "comm/S_bytes_total": s_sent_total,
        "comm/T_bytes_total": t_sent_total,
        "comm/world_bytes_total": world_sent_total,
        "comm/R_seconds": per_step("R_seconds"),
    }
    if adamw_r_sent > 0 and ledger.steps > 0:
        out["comm/R_ratio_vs_adamw_hsdp"] = r_sent_total / (adamw_r_sent * ledger.steps)
    return out


def eval_scalars(ledger: CommLedger) -> dict[str, float]:
    """The ``comm/eval_*`` scalars of an evaluation ledger (the bytes evaluations sent, apart from
    training's ``comm/*``: the mean over R a local-step family's global model takes, and the check that
    the replicas hold one model): cumulative, since the run's process started (not checkpointed)."""
    totals = ledger.totals
    return {
        "comm/eval_R_sent_bytes_total": totals.get("R_sent", 0.0),
        "comm/eval_R_recv_bytes_total": totals.get("R_recv", 0.0),
        "comm/eval_world_bytes_total": totals.get("world_sent", 0.0),
    }


_LEDGER = CommLedger()


def get_ledger() -> CommLedger:
    """The process-wide ledger: the default of every collective given no ``ledger`` (standalone use;
    a training run passes its own, ``titan/tt022/run_context.py`` or the 0.3 container)."""
    return _LEDGER


def _active(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's index inside ``group`` (0 in a group of one or ``None``). A query, no traffic."""
    return dist.get_rank(group) if _active(group) else 0


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """How many processes ``group`` has (1 for ``None``). A query, no traffic."""
    return 1 if group is None else dist.get_world_size(group)


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``'s members, in group order. A query, no traffic."""
    return dist.get_process_group_ranks(group)


def has_avg(group: dist.ProcessGroup) -> bool:
    """Whether the group's backend reduces with AVG itself (NCCL/RCCL); gloo does not."""
    return dist.get_backend(group) == "nccl"


T = TypeVar("T")
_UNSET: Any = object()
_DROPPING = threading.local()  # set while Pending.drop waits: see managed_group
_DEFERRING = threading.local()  # .into: the list a deferred() scope collects its collectives in


class Pending(Generic[T]):
    """A collective in flight. ``wait()`` blocks until it has completed, then returns its result
    (a second ``wait()`` returns the same result without waiting). ``drop()`` waits for it without
    taking its result. ``parts``: the collectives a composite one (a fused all-reduce, two at once)
    waits for in its ``finish``, which ``drop()`` reaches without running ``finish``. ``launcher``:
    set for a collective issued inside :func:`deferred`, not yet on the wire (:meth:`launch`)."""

    def __init__(self, work: Any, finish: Callable[[], T], timer: Optional["_Timer"],
                 parts: Sequence["Pending[Any]"] = (),
                 launcher: Optional[Callable[[], tuple[Any, "_Timer"]]] = None) -> None:
        self._work, self._finish, self._timer, self._parts = work, finish, timer, tuple(parts)
        self._launcher = launcher
        self._result = _UNSET

    @classmethod
    def ready(cls, result: T) -> "Pending[T]":
        """A collective that needed no communication (a group of one)."""
        return cls(None, lambda: result, None)

    @property
    def launched(self) -> bool:
        """Whether the collective is on the wire (always, outside :func:`deferred`)."""
        return self._launcher is None

    def launch(self) -> None:
        """Put a collective issued inside :func:`deferred` on the wire now (its clock starts here);
        nothing for one already launched."""
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            self._work, self._timer = launcher()

    def wait(self) -> T:
        if self._result is _UNSET:
            self.launch()
            if self._work is not None:
                self._work.wait()
            if self._timer is not None:
                self._timer.stop()
            self._result = self._finish()
        return self._result

    def drop(self) -> None:
        """Wait for the collective to complete and leave its result unread: nothing is written into
        the tensors it was issued for, and an error (a peer lost; a process group a quorum has since
        rebuilt) is neither raised nor reported to a fault-tolerant run's Manager, whose next step it
        would otherwise fail. A sync that can no longer be applied is dropped this way (``overlap.py``)."""
        if self._result is not _UNSET:
            return
        self._result = None
        for part in self._parts:
            part.drop()
        self.launch()  # every rank drops it at the same point: on the wire, as it would have been anyway
        work = self._work
        if work is None:
            return
        _DROPPING.on = True  # managed_group's wait then reports nothing to the Manager
        try:
            work.wait()
        except Exception:  # noqa: BLE001 (a dropped collective's failure is not this step's)
            pass
        finally:
            _DROPPING.on = False


class _Timer:
    """The seconds of one collective on its tensors' device clock (see the module docstring)."""

    def __init__(self, ledger: CommLedger, role: str, device: torch.device) -> None:
        self.ledger, self.role = ledger, role
        self.start_event = None
        if device.type == "cuda":  # CUDA, and ROCm/HIP builds, which call their devices "cuda" too
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.start_event is None:
            self.ledger.add_time(self.role, time.perf_counter() - self.t0)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # after work.wait(): the current stream has waited for the collective
        self.ledger.add_device_timer(self.role, self.start_event, end)


def _issue(
    ledger: Optional[CommLedger], role: str, op: str, sent: int, recv: int, device: torch.device,
    launch: Callable[[bool], Any], finish: Callable[[], T], async_op: bool,
) -> "T | Pending[T]":
    """Count the bytes, start the clock, launch the collective; wait now unless ``async_op``; inside
    :func:`deferred`, an asynchronous one is counted now and launched later (clock included)."""
    target = ledger or _LEDGER
    target.record(role, op, sent, recv)
    into = getattr(_DEFERRING, "into", None)
    if async_op and into is not None:
        pending = Pending(None, finish, None, launcher=lambda: (launch(True), _Timer(target, role, device)))
        into.append(pending)
        return pending
    timer = _Timer(target, role, device)
    pending = Pending(launch(async_op), finish, timer)  # a synchronous launch returns no work
    return pending if async_op else pending.wait()


@contextmanager
def deferred(into: list["Pending[Any]"]) -> Iterator[None]:
    """Within: every asynchronous collective is counted when issued and appended to ``into`` without
    being launched (``Pending.launch``, or its first wait or drop, launches it). The caller launches
    them in the order they were issued, at the same point on every rank, as a process group requires.
    A synchronous collective inside is launched at once, as always."""
    outer, _DEFERRING.into = getattr(_DEFERRING, "into", None), into
    try:
        yield
    finally:
        _DEFERRING.into = outer


def _finished(result: T, async_op: bool) -> "T | Pending[T]":
    return Pending.ready(result) if async_op else result


def all_reduce(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    op: str = "sum",
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "torch.Tensor | Pending[torch.Tensor]":
    """In-place all-reduce of ``tensor`` over ``group``; ``op`` in sum/mean/max/min."""
    if not _active(group):
        return _finished(tensor, async_op)
    divide = op == "mean" and not has_avg(group)
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM if divide else dist.ReduceOp.AVG,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]
    w = dist.get_world_size(group)

    def finish() -> torch.Tensor:
        return tensor.div_(w) if divide else tensor

    n = nbytes(tensor)
    return _issue(
        ledger, role, f"all_reduce_{op}", n, n, tensor.device,
        lambda a: dist.all_reduce(tensor, reduce_op, group=group, async_op=a), finish, async_op,
    )


def all_reduce_fused(
    tensors: Sequence[torch.Tensor],
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    op: str = "mean",
    dtype: Optional[torch.dtype] = None,
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "None | Pending[None]":
    """All-reduce several tensors as one flat buffer (one collective), results written back in place
    (with ``async_op``, when the returned :class:`Pending` is waited for).

    ``dtype`` is the transfer dtype (e.g. bf16); the reduction result is cast back to each
    tensor's own dtype. Tensors may have different dtypes and shapes.
    """
    if not _active(group) or not tensors:
        return _finished(None, async_op)
    wire_dtype = dtype or tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(wire_dtype) for t in tensors])
    reduced = all_reduce(flat, role, group, op=op, ledger=ledger, async_op=True)

    def finish() -> None:
        reduced.wait()
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    if not async_op:
        return finish()
    return Pending(None, finish, None, parts=(reduced,))


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every rank) for all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "torch.Tensor | Pending[torch.Tensor]":
    """Gather equal-shaped tensors from every rank of ``group``: returns ``[W, *tensor.shape]``.

    A group of one returns ``tensor.unsqueeze(0)`` (no copy of data is sent anywhere).
    """
    if not _active(group):
        return _finished(tensor.unsqueeze(0), async_op)
    w = dist.get_world_size(group)
    out = torch.empty((w, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    n = nbytes(tensor)
    src = tensor.contiguous()
    return _issue(
        ledger, role, "all_gather", n, (w - 1) * n, tensor.device,
        lambda a: _all_gather_single(out.view(-1), src.view(-1), group=group, async_op=a), lambda: out,
        async_op,
    )


def all_gather_mean(
    payload: torch.Tensor,
    decode: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "torch.Tensor | Pending[torch.Tensor]":
    """The mean over ``group`` of what each rank's encoded ``payload`` decodes to, for a wire an
    all-reduce cannot sum (FP4 codes): the payloads are all-gathered (one collective: ``payload``'s
    bytes sent, W − 1 times them received), then every rank's is decoded and summed in float32 in
    rank order and divided by W, so every rank holds the same bits: ``decode(payload, None)`` returns
    the first share's values (a float32 tensor), ``decode(payload, total)`` adds the next one's into
    ``total``. Memory: the W payloads and the sum. A group of one returns ``decode(payload, None)``."""
    gathered = all_gather(payload, role, group, ledger=ledger, async_op=True)

    def finish() -> torch.Tensor:
        shares = gathered.wait()
        total = decode(shares[0], None)
        for share in shares[1:]:
            decode(share, total)
        return total.div_(shares.shape[0])

    if not async_op:
        return finish()
    return Pending(None, finish, None, parts=(gathered,))


def reduce_scatter(
    tensor: torch.Tensor,
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "torch.Tensor | Pending[torch.Tensor]":
    """Sum ``tensor`` (shape ``[W, *chunk]``) over ``group`` and return this rank's ``chunk``: row i of
    the sum lands on the rank with index i. The inverse of :func:`all_gather` (``[W, *chunk]`` from
    ``chunk``); together they move what an all-reduce of ``tensor`` moves. A group of one returns
    ``tensor[0]``. gloo has it too (torch >= 2.13), so every backend runs the same collective.
    """
    if not _active(group):
        return _finished(tensor[0], async_op)
    w = dist.get_world_size(group)
    if tensor.shape[0] != w:
        raise ValueError(f"reduce_scatter: leading dim {tensor.shape[0]} != group size {w}")
    out = torch.empty(tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    c = nbytes(out)
    src = tensor.reshape(-1)  # the concatenated form: gloo takes no stacked input
    return _issue(
        ledger, role, "reduce_scatter", (w - 1) * c, (w - 1) * c, tensor.device,
        lambda a: dist.reduce_scatter_single(out.view(-1), src, dist.ReduceOp.SUM, group=group, async_op=a),
        lambda: out, async_op,
    )


def all_to_all(
    tensor: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    role: str,
    group: Optional[dist.ProcessGroup],
    *,
    ledger: Optional[CommLedger] = None,
    async_op: bool = False,
) -> "torch.Tensor | Pending[torch.Tensor]":
    """Personalized exchange over ``group``: the flat ``tensor`` is cut into blocks of
    ``send_counts[i]`` elements, block i going to the rank with index i; the result is the blocks
    received, ``recv_counts[i]`` elements from rank i, concatenated in rank order (uneven counts
    allowed, zeros too). A group of one returns ``tensor`` itself (its one block is its own)."""
    if not _active(group):
        return _finished(tensor, async_op)
    w, me = dist.get_world_size(group), dist.get_rank(group)
    if len(send_counts) != w or len(recv_counts) != w:
        raise ValueError(f"all_to_all: {len(send_counts)} send and {len(recv_counts)} receive counts for {w} ranks")
    out = torch.empty(sum(recv_counts), dtype=tensor.dtype, device=tensor.device)
    src = tensor.reshape(-1)
    size = tensor.element_size()
    sent = (sum(send_counts) - send_counts[me]) * size
    recv = (sum(recv_counts) - recv_counts[me]) * size
    return _issue(
        ledger, role, "all_to_all", sent, recv, tensor.device,
        lambda a: dist.all_to_all_single(out, src, list(recv_counts), list(send_counts), group=group, async_op=a),
        lambda: out, async_op,
    )


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
    return _issue(
        ledger, role, "broadcast", n if is_src else 0, 0 if is_src else n, tensor.device,
        lambda a: dist.broadcast(tensor, group_src=src_group_rank, group=group, async_op=a), lambda: tensor, False,
    )


def managed_group(
    manager: Any, name: str, before: Callable[[], None] = lambda: None, waiting: Callable[[bool], None] = lambda _: None,
) -> dist.ProcessGroup:
    """R under fault tolerance: a c10d group over torchft ``manager``'s process group, which the
    Manager rebuilds at every quorum change, whose size is the quorum's (``num_participants``).

    Every collective this module issues runs over it unchanged, and none raises when a peer dies:
    the error goes to the Manager (``manager.errored()``, so the step will not commit), later
    collectives of the step send nothing, and each one's result is then what it would be had every
    peer sent this replica's own payload: a valid payload (indices in range, finite values), so the
    step runs to its end and is undone there. torchft's own wrapper manages only ``allreduce``; this
    one also maps the two single-tensor collectives torch 2.13 calls: ``all_gather_single`` onto the
    Manager's coalesced all-gather, and ``reduce_scatter_single`` onto an all-to-all summed on
    arrival (torchft's gloo group has no reduce-scatter). Its rank is 0 on every replica (a
    one-rank c10d group): the replica index is the quorum's (``Topology.quorum``). Called once per
    process, at the same point on every rank of the group (it creates a c10d group). ``before()`` runs
    before each collective is issued, ``waiting(True)``/``waiting(False)`` around the wait for one."""
    from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions
    from torchft.manager import _ManagedWork
    from torchft.process_group import ManagedProcessGroup

    class Finishing(dist._Work):
        """Waits for the Manager's work; then ``done()``, or ``failed()`` if anything errored."""

        def __init__(self, work: Any, done: Callable[[], None], failed: Callable[[], None]) -> None:
            super().__init__()
            self._work, self._done, self._failed, self._finished = work, done, failed, False

        def wait(self, timeout: Any = None) -> bool:
            if getattr(_DROPPING, "on", False):  # Pending.drop: the work is waited for, nothing reported
                self._drop()
                return True
            if not self._finished:
                waiting(True)
                try:
                    ok = self._work is not None and self._work.wait() is not False
                finally:
                    waiting(False)
                (self._done if ok and manager.errored() is None else self._failed)()
                self._finished = True
            return True

        def _drop(self) -> None:
            """``Pending.drop``: wait for torchft's own work (its ``_ManagedWork`` would report an
            error to the Manager), errors ignored; neither ``done()`` nor ``failed()`` runs."""
            if not self._finished:
                self._finished = True
                raw = getattr(self._work, "_work", None)
                if raw is not None:
                    try:
                        raw.wait()
                    except Exception:  # noqa: BLE001 (the process group may be gone)
                        pass

    def issue(launch: Callable[[], Any], done: Callable[[], None], failed: Callable[[], None], value: Any) -> Any:
        before()
        work = None
        if manager.errored() is None:
            try:
                work = _ManagedWork(manager, launch(), value)
            except Exception as error:  # noqa: BLE001 (a collective that cannot start: a dead peer)
                manager.report_error(error)
        return Finishing(work, done, failed)

    class ManagedReplicate(ManagedProcessGroup):
        def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            (tensor,) = tensors
            op = opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
            own = tensor.clone()
            w = manager.num_participants()

            def failed() -> None:
                tensor.copy_(own * w if op == dist.ReduceOp.SUM else own)

            before()
            if manager.errored() is not None:
                return Finishing(None, lambda: None, failed)
            return Finishing(manager.allreduce(tensor, reduce_op=op), lambda: None, failed)

        def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
            def failed() -> None:
                output.view(-1, input.numel()).copy_(input.reshape(1, -1))

            return issue(lambda: manager._pg.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()),
                         lambda: None, failed, output)

        def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
            w, received, src = manager.num_participants(), torch.empty_like(input), input.contiguous()
            rank = manager.participating_rank() or 0

            def done() -> None:
                output.copy_(received.view(w, -1).sum(0).view_as(output))

            def failed() -> None:
                output.copy_(src.view(w, -1)[rank].view_as(output) * w)

            return issue(lambda: manager._pg.alltoall_base(received, src, [], [], AllToAllOptions()), done, failed, output)

    return ManagedReplicate(manager).register(name)


def record_estimate(
    role: str, op: str, sent: int, recv: int, *, ledger: Optional[CommLedger] = None
) -> None:
    """Record a collective that someone else (FSDP2) issues, estimated from tensor sizes."""
    (ledger or _LEDGER).record(role, op, sent, recv, 0.0, estimated=True)


def control_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a small control tensor (a flag, a fingerprint) must live for ``group``'s backend: the
    current GPU for NCCL/RCCL, which takes no CPU tensors; the CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ceil_log2(n: int) -> int:
    """Bits needed for an index in ``range(n)`` (at least 1)."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1
