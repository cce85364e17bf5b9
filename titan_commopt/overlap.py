"""One overlap mechanism for every family: a step's communication written as a generator task.

A *task* is a generator that does its work in order and ``yield``\\ s where it needs the result of a
collective it has issued asynchronously (a :class:`~titan_commopt.comm.Pending`, or a list of them):
the :class:`Runtime` that drives it waits for the collective and sends the result back into the
generator (a list of results for a list). A task may also ``yield None``: it gives way there without
waiting for anything, and is resumed from that point when the runtime drives it next.

Which work hides behind which collective is then decided by the runtime, in one place, in three ways:

- :meth:`Runtime.run` drives several tasks round-robin, all in this step: each runs until its first
  yield (so every task's first collective is issued before any is waited for), then the first is
  resumed once its collective completes, runs to its next yield, goes to the back of the queue, and so
  on. Per-batch work of one step overlaps the previous batch's collectives this way (Dion's shape
  batches).
- :meth:`Runtime.start` runs one task to its first yield now and parks it with a *due* count (the
  family's own step clock); :meth:`Runtime.advance` completes, in start order, every parked task whose
  due count has been reached. A collective issued at the end of step t then overlaps the next steps'
  forward and backward (DeMo's ``overlap``: due at t + 1; the local-adaptive family's ``sync_delay``:
  due at t + τ).
- With :attr:`Runtime.defers_launch` set (the torchtitan container sets it), :meth:`Runtime.start`
  issues a task's collectives inside ``comm.deferred``: counted in this step, launched on the wire by
  :meth:`Runtime.launch` (the container calls it from ``zero_grad``, the next step's first act) or
  by whatever completes the task first. torchtitan all-reduces the loss after the optimizer step on a
  log step; launched at once, a fragment issued in that step would be ahead of it on the link, and
  the step would wait for the fragment's bytes. Nothing else changes: what is sent is packed when
  the task starts.
- :meth:`Runtime.drain` completes every parked task now (before a checkpoint, at the end of training);
  :meth:`Runtime.abandon` drops them: waits for their collectives without reading their results
  (``Pending.drop``) and closes the tasks (their results belong to a state that a load replaces).

Under live fault tolerance a parked task is one side of a transaction (``titan/common/replica_group.py``):
it is started in an *epoch* (:attr:`Runtime.epoch`, the quorum its collective was issued in) with a
*record*, what its optimizer needs to undo it without the task (``CommOptimizer.fail_syncs``);
:meth:`Runtime.fail` drops the tasks of every other epoch and returns their records; :meth:`Runtime.records`
and :meth:`Runtime.adopt` carry them to a group that heals (which has the records, not the collectives).

Every rank drives the same tasks in the same order, so the collectives on each process group are
issued in the same order on every rank, as a process group requires. The runtime issues nothing
itself: every collective is ``comm``'s, and is counted there.
"""

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generator, Optional, Sequence, Union

from titan_commopt.comm import Pending, deferred

__all__ = ["Task", "Runtime"]

Yielded = Union[None, Pending, Sequence[Pending]]
Task = Generator[Yielded, Any, None]


def _wait(yielded: Yielded) -> Any:
    if yielded is None:
        return None
    if isinstance(yielded, Pending):
        return yielded.wait()
    return [p.wait() for p in yielded]


def _resume(task: Task, value: Any) -> tuple[bool, Yielded]:
    """Run ``task`` to its next yield: ``(still running, what it yielded)``."""
    try:
        return True, task.send(value)
    except StopIteration:
        return False, None


@dataclass
class _Parked:
    due: int
    task: Optional[Task]  # None: adopted from a peer's heal, no collective here (it can only fail)
    yielded: Yielded
    record: Any = None
    epoch: Any = None


def _drop(entry: _Parked) -> None:
    """Wait for ``entry``'s collectives without their results and close its task."""
    yielded = entry.yielded
    for pending in (yielded if isinstance(yielded, (list, tuple)) else [yielded]):
        if isinstance(pending, Pending):
            pending.drop()
    if entry.task is not None:
        entry.task.close()


class Runtime:
    """Drives the tasks of one optimizer (see the module docstring)."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []
        # The quorum a task started now belongs to (live fault tolerance sets it at every quorum); None without.
        self.epoch: Any = None
        # Whether start() leaves its collectives for launch() (module docstring); off where nothing would call it.
        self.defers_launch = False
        self._unlaunched: list[Pending] = []

    # ---- this step ---------------------------------------------------------------------------
    def run(self, *tasks: Task) -> None:
        """Drive ``tasks`` round-robin to completion now."""
        queue: deque[tuple[Task, Yielded]] = deque()
        for task in tasks:
            running, yielded = _resume(task, None)
            if running:
                queue.append((task, yielded))
        while queue:
            task, yielded = queue.popleft()
            running, yielded = _resume(task, _wait(yielded))
            if running:
                queue.append((task, yielded))

    # ---- across steps ------------------------------------------------------------------------
    def start(self, task: Task, due: int, record: Any = None, *, within_step: bool = False) -> None:
        """Run ``task`` to its first yield and park it until ``advance(n)`` with ``n >= due``, in the
        current :attr:`epoch`; ``record``: what undoes it without the task (module docstring). With
        :attr:`defers_launch`, its collectives wait for :meth:`launch`, unless ``within_step`` (a task
        the step itself completes, whose collective hides behind the rest of that step)."""
        with deferred(self._unlaunched) if self.defers_launch and not within_step else nullcontext():
            running, yielded = _resume(task, None)
        if running:
            self._parked.append(_Parked(due, task, yielded, record, self.epoch))

    def launch(self) -> None:
        """Put the collectives that :meth:`start` deferred on the wire, in the order they were issued."""
        unlaunched, self._unlaunched = self._unlaunched, []
        for pending in unlaunched:
            pending.launch()

    @property
    def unlaunched(self) -> int:
        """How many collectives :meth:`start` deferred are not on the wire yet."""
        return sum(not pending.launched for pending in self._unlaunched)

    def advance(self, now: int) -> None:
        """Complete every parked task due at ``now`` or earlier, in the order they were started (a
        deferred collective of one of them launched by its wait; one started in this step stays
        unlaunched: every rank does the same, so each process group still sees one order)."""
        due = [entry for entry in self._parked if entry.due <= now]
        if due:
            self._parked = [entry for entry in self._parked if entry.due > now]
            for entry in due:
                self._finish(entry)

    def drain(self) -> None:
        """Complete every parked task now, in the order they were started."""
        self.launch()
        parked, self._parked = self._parked, []
        for entry in parked:
            self._finish(entry)

    def abandon(self) -> None:
        """Drop every parked task unfinished: its collectives waited for, their results not read."""
        self.launch()
        parked, self._parked = self._parked, []
        for entry in parked:
            _drop(entry)

    def fail(self, epoch: Any) -> list[Any]:
        """Drop every parked task started in another epoch than ``epoch`` (and every adopted one), as
        :meth:`abandon` does; their records, in start order."""
        self.launch()
        failed = [entry for entry in self._parked if entry.task is None or entry.epoch != epoch]
        self._parked = [entry for entry in self._parked if not (entry.task is None or entry.epoch != epoch)]
        for entry in failed:
            _drop(entry)
        return [entry.record for entry in failed]

    def records(self) -> list[tuple[Any, int, Any]]:
        """``(epoch, due, record)`` of every parked task, in start order (what a heal carries)."""
        return [(entry.epoch, entry.due, entry.record) for entry in self._parked]

    def adopt(self, records: Sequence[tuple[Any, int, Any]]) -> None:
        """Park a peer's tasks by their records (:meth:`records`), without their collectives: a healed
        group knows what its peer had in flight, and :meth:`fail` drops them whatever the epoch."""
        self._parked += [_Parked(due, None, None, record, epoch) for epoch, due, record in records]

    @property
    def in_flight(self) -> int:
        """How many tasks are parked."""
        return len(self._parked)

    def next_due(self) -> Optional[int]:
        """The smallest due count of the parked tasks (``None`` when none is parked)."""
        return min((entry.due for entry in self._parked), default=None)

    @staticmethod
    def _finish(entry: _Parked) -> None:
        if entry.task is None:  # adopted: nothing here to complete (Runtime.fail drops it first)
            return
        running, yielded = _resume(entry.task, _wait(entry.yielded))
        while running:
            running, yielded = _resume(entry.task, _wait(yielded))
