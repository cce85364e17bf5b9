"""The local-adaptive family's R syncs: which states are due after which update, and how a sync lands.

:class:`SyncSchedule` answers "what is due after update ``n``" from the periods and the fragments
alone (the same on every replica and after a resume). :func:`sync_in_place` and
:func:`sync_streaming` are the two ways a step's due states are averaged over R, written as tasks
for the optimizer's :class:`~titan_commopt.overlap.Runtime`: in place and blocking (``sync_delay``
= 0), or on a snapshot whose all-reduce stays in flight for ``sync_delay`` steps and is then merged
keeping the local progress of those steps (Streaming DiLoCo). The math is in
``adaptive.py``'s module docstring.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.overlap import Task

__all__ = ["Periods", "SyncSchedule", "DueStates", "offsets", "partition", "sync_in_place", "sync_streaming"]

# One step's due tensors → their R mean, written back in place when the returned Pending is waited for.
Reduce = Callable[[list[torch.Tensor]], "comm.Pending[None]"]
# The outer step on one parameter: (x holding mean_R(x), its anchor, its outer momentum).
OuterStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Periods:
    """Sync period of each state after update counts are resolved (``"auto"`` → a number); 0 = never."""

    Kx: int
    Ku: tuple[int, ...]  # one per first momentum u_j
    Kv: int  # 0 where the base optimizer has no second moment (sgdm)

    def positive(self) -> list[int]:
        return [k for k in (self.Kx, self.Kv, *self.Ku) if k > 0]

    def kinds(self) -> list[tuple[str, int]]:
        """(state kind, period) in the fused buffer's order: ``u<j>``, ``v``, ``x``."""
        return [(f"u{j}", k) for j, k in enumerate(self.Ku)] + [("v", self.Kv), ("x", self.Kx)]


def offsets(period: int, fragments: int) -> list[int]:
    """Step offset of each fragment within a period: spread evenly, fragment 0 at 0 (so one
    fragment is the papers' schedule: due when ``step % period == 0``)."""
    return [f * period // fragments for f in range(fragments)]


def partition(sizes: Sequence[int], fragments: int) -> list[int]:
    """Fragment of each parameter: greedy by size (largest first onto the lightest fragment, ties to
    the lower index), so fragments are balanced in elements. Deterministic from the sizes alone,
    hence the same on every replica."""
    load = [0] * fragments
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (load[f], f))
        out[i] = f
        load[f] += sizes[i]
    return out


class SyncSchedule:
    """Fragment f of a state with period K is due after update n when ``(n − ⌊f·K/F⌋) % K == 0``.

    ``sizes``: the elements of each parameter (in the optimizer's order); they are split into at most
    ``fragments`` fragments (at most one per parameter)."""

    def __init__(self, periods: Periods, sizes: Sequence[int], fragments: int) -> None:
        self.periods = periods
        self.fragments = max(1, min(fragments, len(sizes)))
        self.fragment_of = partition(sizes, self.fragments)
        self._offsets = [(kind, period, offsets(period, self.fragments)) for kind, period in periods.kinds()
                         if period > 0]

    def due(self, n: int) -> dict[str, set[int]]:
        """The fragments of each state kind due after update ``n`` (kinds with none left out)."""
        due: dict[str, set[int]] = {}
        for kind, period, offs in self._offsets:
            frags = {f for f, off in enumerate(offs) if (n - off) % period == 0}
            if frags:
                due[kind] = frags
        return due

    def steps_to_next(self, n: int) -> Optional[int]:
        """Updates after ``n`` until the next sync of any state; ``None`` when one period is 1 (a
        sync every step) or all are 0 (never)."""
        periods = self.periods.positive()
        if not periods or min(periods) == 1:
            return None
        return min((off - n - 1) % period + 1 for _, period, offs in self._offsets for off in offs)

    def all_x_due(self, n: int) -> bool:
        """Whether every fragment's parameters are synced after update ``n``."""
        kx = self.periods.Kx
        return kx > 0 and all((n - off) % kx == 0 for off in offsets(kx, self.fragments))


@dataclass
class DueStates:
    """One step's due states in the fused buffer's order: the live local tensors (x, u_j, v), where
    the second moments are, and each parameter's outer state (anchor, momentum) when the outer step
    runs."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    second_moments: list[int] = field(default_factory=list)
    outer: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _outer_steps(means: list[torch.Tensor], due: DueStates, outer: Optional[OuterStep]) -> None:
    if outer is not None:
        for i, anchor, buf in due.outer:
            outer(means[i], anchor, buf)


def sync_in_place(due: DueStates, reduce: Reduce, outer: Optional[OuterStep]) -> Task:
    """t = mean_R(t) in place, then the outer step on the parameters (``sync_delay`` = 0)."""
    yield reduce(due.tensors)
    _outer_steps(due.tensors, due, outer)


def sync_streaming(due: DueStates, reduce: Reduce, outer: Optional[OuterStep]) -> Task:
    """The all-reduce of a snapshot, issued now; when resumed (``sync_delay`` steps later):
    t ← mean_R(t at issue) + (t − t at issue), the outer step applied to the snapshot's mean first."""
    snapshots = [t.clone() for t in due.tensors]  # the price of the overlap: one copy of what is sent
    pending = reduce(snapshots)
    try:
        yield None  # parked: the collective overlaps the next steps
    except GeneratorExit:  # dropped by a load: its collective still has to complete
        pending.wait()
        raise
    # Before the wait: the all-reduce writes the mean into the snapshots only when waited for.
    torch._foreach_sub_(due.tensors, snapshots)  # the local progress since the issue
    yield pending  # snapshots := mean_R(snapshots)
    _outer_steps(snapshots, due, outer)
    torch._foreach_add_(due.tensors, snapshots)
    for i in due.second_moments:
        due.tensors[i].clamp_min_(0)  # v − v_issue + mean_R(v_issue) can dip below 0 when β2^τ is small
