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
- :meth:`Runtime.drain` completes every parked task now (before a checkpoint, at the end of training);
  :meth:`Runtime.abandon` waits for their collectives and drops the tasks (their results belong to
  a state that a load replaces).

Every rank drives the same tasks in the same order, so the collectives on each process group are
issued in the same order on every rank, as a process group requires. The runtime issues nothing
itself: every collective is ``comm``'s, and is counted there.
"""

from collections import deque
from dataclasses import dataclass
from typing import Any, Generator, Optional, Sequence, Union

from titan_commopt.comm import Pending

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
    task: Task
    yielded: Yielded


class Runtime:
    """Drives the tasks of one optimizer (see the module docstring)."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []

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
    def start(self, task: Task, due: int) -> None:
        """Run ``task`` to its first yield and park it until ``advance(n)`` with ``n >= due``."""
        running, yielded = _resume(task, None)
        if running:
            self._parked.append(_Parked(due, task, yielded))

    def advance(self, now: int) -> None:
        """Complete every parked task due at ``now`` or earlier, in the order they were started."""
        due = [entry for entry in self._parked if entry.due <= now]
        if due:
            self._parked = [entry for entry in self._parked if entry.due > now]
            for entry in due:
                self._finish(entry)

    def drain(self) -> None:
        """Complete every parked task now, in the order they were started."""
        parked, self._parked = self._parked, []
        for entry in parked:
            self._finish(entry)

    def abandon(self) -> None:
        """Wait for the collectives of every parked task and drop the tasks unfinished."""
        parked, self._parked = self._parked, []
        for entry in parked:
            _wait(entry.yielded)
            entry.task.close()

    @property
    def in_flight(self) -> int:
        """How many tasks are parked."""
        return len(self._parked)

    def next_due(self) -> Optional[int]:
        """The smallest due count of the parked tasks (``None`` when none is parked)."""
        return min((entry.due for entry in self._parked), default=None)

    @staticmethod
    def _finish(entry: _Parked) -> None:
        running, yielded = _resume(entry.task, _wait(entry.yielded))
        while running:
            running, yielded = _resume(entry.task, _wait(yielded))
