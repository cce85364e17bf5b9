"""The local-adaptive family's R syncs: which states are due after which update, and how a sync lands.

:class:`SyncSchedule` answers "what is due after update ``n``" from the periods and the fragments
alone (the same on every replica and after a resume). :func:`sync_in_place`, :func:`sync_streaming`
and :func:`sync_overlapped` are the ways a step's due states are averaged over R, written as tasks
for the optimizer's :class:`~titan_commopt.overlap.Runtime`: in place and blocking (``sync_delay``
= 0), or on a snapshot whose all-reduce stays in flight for ``sync_delay`` steps and is then merged
keeping the local progress of those steps (Streaming DiLoCo's overlap with an additive merge), or
in flight for a whole period and applied at the next sync of the same state, naively delayed or
eagerly (Kale, Douillard, Donchev 2025, "Eager Updates For Overlapped Communication and Computation
in DiLoCo", arXiv 2502.12996: ``merge`` = ``"delayed"`` / ``"eager"``). The math is in
``adaptive.py``'s module docstring. A sync's mean is the optimizer's ``Reduce``: an all-reduce, or with a
quantized outer wire (``outer_wire_dtype``) :func:`pseudo_gradient_mean` for the parameters, whose
pseudo-gradients go on the wire as FP8/FP4 codes.
"""

import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.compress.minifloat import MiniFloatWire
from titan_commopt.overlap import Task
from titan_commopt.topology import R

__all__ = ["Periods", "SyncSchedule", "DueStates", "OverlapEntry", "offsets", "partition", "sync_in_place",
           "sync_streaming", "sync_overlapped", "eager_pseudo_gradient", "OVERLAPPED_MERGES", "strided_partition",
           "block_index", "pseudo_gradient_mean"]

# Which of a sync's tensors are parameters, by index: each with its anchor where the tensor holds x (its
# pseudo-gradient is anchor − x), None where it holds the pseudo-gradient Δ itself (an overlapped merge's
# wire value). A parameter without an anchor (averaging on the states' wire) is synced as a state.
Params = dict[int, Optional[torch.Tensor]]
# One step's due tensors (and which are parameters) → their R mean, written back in place when the
# returned Pending is waited for.
Reduce = Callable[[list[torch.Tensor], Params], "comm.Pending[None]"]
# The outer step on one parameter: (x holding mean_R(x), its anchor, its outer momentum or None).
OuterStep = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], None]
# The outer step on one parameter from a pseudo-gradient: (x, its anchor, its outer momentum or None, Δ).
OuterDeltaStep = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor], None]

# The merges whose sync stays in flight for a whole period (Kale et al. 2025): "delayed" applies the mean
# that arrived (their Algorithm 2, the naive one-outer-step delay), "eager" that mean with this replica's
# stale share replaced by its fresh one (their Algorithm 3).
OVERLAPPED_MERGES = ("delayed", "eager")


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


_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def block_index(name: str) -> Optional[int]:
    """The block a parameter belongs to: the first integer component of its name (``layers.3.attention.
    wq.weight`` → 3; torch's ``ModuleList`` / ``ModuleDict`` of numbered blocks), ``None`` outside one."""
    found = _BLOCK.search(name)
    return int(found.group(1)) if found else None


def numbered_blocks(names: Sequence[str]) -> list[int]:
    """The distinct block numbers (:func:`block_index`) among ``names``, in order."""
    return sorted({k for k in map(block_index, names) if k is not None})


def strided_partition(names: Sequence[str], fragments: int) -> list[int]:
    """Fragment of each parameter, strided as Streaming DiLoCo's fragments (Douillard et al. 2025, §2.2,
    Fig. 2: fragment p holds the blocks p, p + F, p + 2F, …, which it finds slightly better than
    consecutive ones): the i-th block (:func:`block_index`, in the order of their numbers: a model's
    ``layers.<i>.``, or ``0, 2`` of an ``nn.Sequential`` with an activation between) in fragment i mod F;
    parameters outside a numbered block (embeddings, final norm, output) round-robin over the fragments
    in their order. Deterministic from the names alone, hence the same on every replica."""
    blocks = {k: i for i, k in enumerate(numbered_blocks(names))}
    out, loose = [], 0
    for name in names:
        k = block_index(name)
        if k is None:
            out.append(loose % fragments)
            loose += 1
        else:
            out.append(blocks[k] % fragments)
    return out


class SyncSchedule:
    """Fragment f of a state with period K is due after update n when ``(n − ⌊f·K/F⌋) % K == 0``.

    ``sizes``: the elements of each parameter (in the optimizer's order); they are split into at most
    ``fragments`` fragments (at most one per parameter): balanced by size (:func:`partition`), or, given
    the parameters' ``names``, strided by block (:func:`strided_partition`)."""

    def __init__(self, periods: Periods, sizes: Sequence[int], fragments: int,
                 names: Optional[Sequence[str]] = None) -> None:
        self.periods = periods
        fragments = max(1, min(fragments, len(sizes)))
        fragment_of = partition(sizes, fragments) if names is None else strided_partition(names, fragments)
        used = sorted(set(fragment_of))  # a layout can leave a fragment empty (fewer blocks than F): not one
        self.fragments = max(1, len(used))
        self.fragment_of = [used.index(f) for f in fragment_of]
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

    def due_steps(self, last: int) -> list[int]:
        """The updates n <= ``last`` after which something is due (those where :meth:`due` is not
        empty), in order, without asking every update."""
        return sorted({n for _, period, offs in self._offsets for off in set(offs)
                       for n in range(off or period, last + 1, period)})

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
    the second moments are, and each parameter's outer state (anchor, momentum or None) when the outer
    step runs."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    second_moments: list[int] = field(default_factory=list)
    outer: list[tuple[int, torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=list)

    def params(self) -> Params:
        """The parameters among ``tensors`` that have an anchor (:data:`Params`: each holds x)."""
        return {i: anchor for i, anchor, _ in self.outer}


def _outer_steps(means: list[torch.Tensor], due: DueStates, outer: Optional[OuterStep]) -> None:
    if outer is not None:
        for i, anchor, buf in due.outer:
            outer(means[i], anchor, buf)


def sync_in_place(due: DueStates, reduce: Reduce, outer: Optional[OuterStep]) -> Task:
    """t = mean_R(t) in place, then the outer step on the parameters (``sync_delay`` = 0)."""
    yield reduce(due.tensors, due.params())
    _outer_steps(due.tensors, due, outer)


def sync_streaming(due: DueStates, reduce: Reduce, outer: Optional[OuterStep], alpha: Optional[float] = None) -> Task:
    """The all-reduce of a snapshot, issued now; when resumed (``sync_delay`` steps later), with
    t̃ = mean_R(t at issue) (the outer step applied to it for parameters):

    - ``alpha`` None (``merge = "additive"``): t ← t̃ + (t − t at issue), the local progress kept;
    - ``alpha`` = α (``merge = "lerp"``, Streaming DiLoCo's merge, Douillard et al. 2025 §2.3):
      t ← α·t + (1 − α)·t̃ (α = 0: the local progress since the issue dropped, the global fragment taken)."""
    snapshots = [t.clone() for t in due.tensors]  # the price of the overlap: one copy of what is sent
    pending = reduce(snapshots, due.params())
    try:
        yield None  # parked: the collective overlaps the next steps
    except GeneratorExit:  # dropped (a load, a sync that failed): its collective still has to complete
        pending.drop()
        raise
    if alpha is not None:
        yield pending  # snapshots := mean_R(snapshots)
        _outer_steps(snapshots, due, outer)
        # lerp(t, t̃, 1 − α) = α·t + (1 − α)·t̃; torch's lerp returns t̃ itself at weight 1 (α = 0)
        torch._foreach_lerp_(due.tensors, snapshots, 1.0 - alpha)
        return
    # Before the wait: the all-reduce writes the mean into the snapshots only when waited for.
    torch._foreach_sub_(due.tensors, snapshots)  # the local progress since the issue
    yield pending  # snapshots := mean_R(snapshots)
    _outer_steps(snapshots, due, outer)
    torch._foreach_add_(due.tensors, snapshots)
    for i in due.second_moments:
        due.tensors[i].clamp_min_(0)  # v − v_issue + mean_R(v_issue) can dip below 0 when β2^τ is small


@dataclass
class OverlapEntry:
    """One due tensor of an overlapped sync (:func:`sync_overlapped`). ``live``: the local tensor (x,
    u_j or v); ``inflight``: what this replica sent at the last sync of it, replaced in place by the
    replicas' mean once that all-reduce lands; ``sent``: this replica's own share of it (``None`` for
    the delayed merge, which does not read it); ``anchor`` (and ``buf``, the Nesterov momentum, or
    ``None`` for averaging): set for a parameter, whose wire value is its pseudo-gradient Δ = anchor − x
    (a state's is its value); ``second_moment``: v, kept >= 0."""

    live: torch.Tensor
    inflight: torch.Tensor
    sent: Optional[torch.Tensor]
    anchor: Optional[torch.Tensor] = None
    buf: Optional[torch.Tensor] = None
    second_moment: bool = False


def eager_pseudo_gradient(mean: torch.Tensor, sent: torch.Tensor, fresh: torch.Tensor, replicas: int) -> torch.Tensor:
    """Kale et al.'s eager outer gradient of replica m (their Algorithm 3), a new tensor:
    Δ̃_m(t) = Δ̄(t−1) + (Δ_m(t) − Δ_m(t−1))/M, i.e. (1/M)·(Δ_m(t) + Σ_{m'≠m} Δ_m'(t−1)): the mean that
    arrived with this replica's own stale share replaced by its fresh one. ``mean`` = Δ̄(t−1), ``sent`` =
    Δ_m(t−1), ``fresh`` = Δ_m(t), ``replicas`` = M."""
    return fresh.sub(sent).div_(replicas).add_(mean)


def sync_overlapped(entries: Sequence[OverlapEntry], reduce: Reduce, merge: str, replicas: int,
                    outer: OuterDeltaStep) -> Task:
    """One period's sync when it overlaps the whole next period (``merge`` in
    :data:`OVERLAPPED_MERGES`): for each due tensor, its fresh wire value w (Δ_m(t) = anchor − x for a
    parameter, the value for a state) is taken first; then the sync issued one period ago, landed
    in ``inflight`` (zeros before the first: a sync of nothing at update 0), is applied:

    - ``delayed``: Δ̃ = Δ̄(t−1), the mean that arrived;
    - ``eager``: Δ̃ = :func:`eager_pseudo_gradient` (Δ̄(t−1), Δ_m(t−1), Δ_m(t), M);

    a parameter by the outer step on Δ̃ from its anchor (``outer``), a state set to Δ̃ (its own fresh
    value in place of its stale share of the stale mean; v kept >= 0). Then w goes into ``sent`` and
    ``inflight`` and one fused all-reduce of every ``inflight`` is issued; the task parks there and
    lands (the mean written into ``inflight``) when the runtime completes it, by the next sync of
    these tensors or a checkpoint, which then holds the mean as state, not as a sync in flight."""
    for e in entries:
        fresh = e.anchor - e.live if e.anchor is not None else e.live.clone()  # w: Δ_m(t), or the state
        if merge == "eager":
            delta = eager_pseudo_gradient(e.inflight, e.sent, fresh, replicas)
        else:
            delta = e.inflight  # used up by the outer step: overwritten by w below anyway
        if e.anchor is not None:
            outer(e.live, e.anchor, e.buf, delta)
        else:
            e.live.copy_(delta)
            if e.second_moment:
                e.live.clamp_min_(0)  # a mean of values >= 0 plus a difference of them can round below 0
        if e.sent is not None:
            e.sent.copy_(fresh)
        e.inflight.copy_(fresh)
    yield reduce([e.inflight for e in entries], {i: None for i, e in enumerate(entries) if e.anchor is not None})


def pseudo_gradient_mean(tensors: Sequence[torch.Tensor], anchors: Sequence[Optional[torch.Tensor]],
                         wire: MiniFloatWire, group: Optional["torch.distributed.ProcessGroup"],
                         ledger: Optional["comm.CommLedger"]) -> "comm.Pending[None]":
    """mean_R of parameters on the outer wire (``outer_wire_dtype``, Streaming DiLoCo's FP4 wire, Douillard
    et al. 2025 §2.4): each replica's pseudo-gradient Δ_m (anchor − x where ``anchors[i]`` is set, else the
    tensor itself, which holds Δ) is encoded now by ``wire`` (a block-scaled FP8/FP4 payload), the
    payloads are all-gathered over R (an all-reduce cannot sum FP4 codes), and every replica's is decoded
    and averaged in float32 (``comm.all_gather_mean``); once waited for, a tensor holding x becomes
    anchor − mean_R Δ (= mean_R x on an exact wire), one holding Δ the mean. Memory: one float32 copy of
    the tensors while encoding; the replicas' payloads and the float32 mean at the end."""
    numels = [t.numel() for t in tensors]
    blocks = wire.to_blocks(((a - t) if a is not None else t for t, a in zip(tensors, anchors)), numels)
    mean = comm.all_gather_mean(wire.encode(blocks), wire.decode, R, group, ledger=ledger, async_op=True)
    del blocks  # encoded: only the payload is kept until the wait

    def finish() -> None:
        for t, a, m in zip(tensors, anchors, wire.from_blocks(mean.wait(), numels)):
            t.copy_(m.view_as(t) if a is None else a - m.view_as(t))

    return comm.Pending(None, finish, None, parts=(mean,))
