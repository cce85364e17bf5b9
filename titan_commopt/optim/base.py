"""The base class of every titan_commopt optimizer: what the torchtitan adapter asks of one.

An optimizer that owns the replicate (R) sync keeps state that differs between replicas, and may
let the parameters themselves differ between syncs. The adapter needs two answers from it:

- ``params_replica_local``: do the parameters differ across replicas between syncs? Then a
  checkpoint keeps every replica's own parameters (not only replica 0's model weights). Every
  subclass must say so explicitly: a family that forgets it would be checkpointed wrongly with no
  error, so leaving it out fails at class creation.
- ``replicas_in_sync()``: do all replicas hold bit-identical parameters *now*? The drift check runs
  only then. Default: always (the family syncs parameters, or their updates, every step).
- ``steps_to_next_sync()``: for a family that syncs R only every K steps, how many optimizer steps
  until the next sync (1 = the next one), shown on the console. Default ``None``: every step.
- ``flush()``: finish whatever R sync is still in flight after ``step()`` (DeMo's overlapped
  update, a streaming fragment) and apply it now; called at the end of training (and by a family's
  own ``state_dict``). Default: complete every task parked on ``self.runtime``.
- ``metrics()``: the optimizer's own scalars for the log (``{name: value}``, names without a
  prefix: the container adds ``commopt/``). Default: none.
- ``snapshot()`` / ``restore(snapshot)``: undo a step, bit for bit (live fault tolerance undoes every
  step that does not commit). A :class:`Snapshot` is the raw state as ``step()`` finds it, in the
  family's own domain (DeMo's DCT coefficients stay coefficients): every tensor of ``self.state``
  copied, the param groups, and the attributes the family names in ``step_attributes`` (its step
  counters, flags, DeMo's plan). No conversion, no re-plan; memory is one copy of the state. The
  parameters are not in it: they are the model's (the container copies them). ``state_dict()`` stays
  what crosses processes and disks (checkpoints, a heal from a peer: ``heal_state()``). A sync parked
  on ``self.runtime`` across steps is kept by its record; a restore fails it.
- ``fail_syncs(epoch)`` / ``_fail_sync(record)``: live fault tolerance's rule for a sync in flight
  across steps (``titan/common/replica_group.py``): one that was issued in another quorum fails, and
  the family undoes what it began (``_fail_sync``: its fragment back to its global copy, its outer
  state as it was). Only the families that keep syncs in flight across steps define ``_fail_sync``.
- ``global_params(ledger=...)``: a context manager inside which every parameter's local shard holds
  the *global model*, the model a user keeps (what an evaluation on held-out text measures), and on
  exit each replica's own values are back bit for bit (copies of what was overwritten, not a
  recomputation), so evaluating changes no step after it. Default: nothing to swap, for a family
  whose replicas hold equal parameters after every step. A local-step family swaps in its anchor
  (x after the last outer step that landed) or, having none, the mean over R of the parameters:
  what a sync now would make, one all-reduce recorded on ``ledger`` (an evaluation's bytes, kept
  apart from training's). The shared swap is ``optim/local/global_model.py``.

Every optimizer is constructed one way: ``Optimizer(named_params, topology, options, *, ledger=None)``
with ``options`` the run's :class:`~titan_commopt.optim.family.Resolved` value (the family's
options dataclass, ``[optimizer]``'s hyper-parameters with the effective lr) — checked before, by
the registry (``Family.check``), never again here. ``ledger`` receives the bytes of every
collective the optimizer issues (default: ``comm``'s process-wide ledger, for use outside a run).
Overlap of communication with compute goes through ``self.runtime`` (``titan_commopt.overlap``).

Parameters are passed as torch's named parameters (``(fqn, param)`` pairs, also inside param-group
dicts), so every family finds a parameter's name in ``group["param_names"]`` the same way.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from titan_commopt import comm
from titan_commopt.overlap import Runtime
from titan_commopt.topology import Topology

from .common import local

__all__ = ["CommOptimizer", "Snapshot", "named_params"]

_NO_QUORUM = object()  # an epoch no sync was issued in: fail_syncs(_NO_QUORUM) fails every one


@dataclass(frozen=True)
class _InPlace:
    """A tensor, dict or list as ``step()`` finds it (``kept``) and its contents before the step:
    restored into the same object, so a view stays a view (Dion's stacked momenta, DeMo's plan rows)
    and whatever holds a reference to it (a plan holds each parameter's state dict) sees it restored."""

    kept: Any
    contents: Any


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` as a snapshot keeps it: tensors cloned (their local shard: a DTensor's is a view),
    dicts and lists entry by entry, tuples item by item; anything else (numbers, strings, an object
    ``step()`` replaces but never changes, such as DeMo's plan) is kept as it is. ``memo``: what was
    copied already, by ``id`` (a tensor shared by several entries, as the local families' one step
    tensor, is copied once); the parameters are entered in it as themselves, never copied."""
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, torch.Tensor):
        out: Any = _InPlace(value, local(value).detach().clone())
    elif isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = _InPlace(value, {k: _copy(v, memo) for k, v in items})
    elif type(value) is tuple:
        items = tuple(_copy(v, memo) for v in value)
        out = value if all(a is b for a, b in zip(items, value)) else items  # (lr, betas): nothing to copy
    else:
        return value
    memo[key] = out
    return out


def _put_back(saved: Any, memo: dict[int, Any]) -> Any:
    """Inverse of :func:`_copy`: the object ``step()`` found, with its contents of then."""
    key = id(saved)
    if key in memo:
        return memo[key]
    if isinstance(saved, _InPlace):
        kept = saved.kept
        memo[key] = kept
        if isinstance(kept, torch.Tensor):
            local(kept).copy_(saved.contents)
        else:
            contents = {k: _put_back(v, memo) for k, v in saved.contents.items()}
            if isinstance(kept, dict):  # entries step() added go, entries it replaced come back
                kept.clear()
                kept.update(contents)
            else:
                kept[:] = contents.values()
        return kept
    if type(saved) is tuple:
        items = tuple(_put_back(v, memo) for v in saved)
        memo[key] = out = saved if all(a is b for a, b in zip(items, saved)) else items
        return out
    return saved


class Snapshot:
    """What ``step()`` may change of one optimizer, copied raw (:meth:`take`), and put back in place
    (:meth:`restore`): the attributes ``names`` of ``optimizer``, by default torch's ``state`` (every
    parameter's state dict and its tensors, in whatever domain and dtype the optimizer keeps them) and
    ``param_groups`` (their hyper-parameters; the parameters' values are not copied). Any
    ``torch.optim.Optimizer`` (torchtitan's own AdamW/Adam too); a :class:`CommOptimizer` adds its
    ``step_attributes``. A restore puts back the objects the snapshot found, with their contents of
    then: what the step added goes, what it replaced comes back, tensors are written in place."""

    def __init__(self, attributes: dict[str, Any]) -> None:
        self._attributes = attributes
        self.in_flight: list = []  # a CommOptimizer's syncs in flight when it was taken (Runtime.records)

    @classmethod
    @torch.no_grad()
    def take(cls, optimizer: torch.optim.Optimizer, names: tuple[str, ...] = ("state", "param_groups")) -> "Snapshot":
        memo: dict[int, Any] = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        return cls({name: _copy(getattr(optimizer, name), memo) for name in names})

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        memo: dict[int, Any] = {}
        for name, saved in self._attributes.items():
            setattr(optimizer, name, _put_back(saved, memo))


class CommOptimizer(torch.optim.Optimizer):
    params_replica_local: bool  # required of every subclass (class attribute or property)
    # What step() changes outside self.state and the param groups: kept by snapshot() (the rules of
    # Snapshot: a tensor, dict or list is restored in place, anything else is kept as the object it is).
    step_attributes: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not hasattr(cls, "params_replica_local"):
            raise TypeError(
                f"{cls.__name__} must define params_replica_local (True when its parameters differ "
                "across replicas between syncs, so checkpoints keep each replica's copy)"
            )

    def __init__(self, named_params: Any, topology: Topology, options: Any, defaults: dict[str, Any], *,
                 ledger: "Optional[comm.CommLedger]" = None) -> None:
        super().__init__(named_params, defaults)
        self.topology = topology
        self.options = options  # the run's Resolved value
        self.ledger = ledger if ledger is not None else comm.get_ledger()
        self.runtime = Runtime()
        # What state_dict() first does with the syncs in flight (_settle_for_save): lands them; live fault
        # tolerance turns it off (landing them would be an R collective after a step's commit): it fails them
        self.lands_on_save = True
        self._reading_for_heal = False

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters now (when the drift check may run)."""
        return True

    def steps_to_next_sync(self) -> Optional[int]:
        """Optimizer steps until the next R sync of a periodic family (1 = the next step); ``None``
        when it syncs every step (or never)."""
        return None

    @torch.no_grad()  # landing a sync writes parameters and states in place
    def flush(self) -> None:
        """Land every R sync still in flight and apply it now (end of training)."""
        self.runtime.drain()

    def metrics(self) -> dict[str, float]:
        """This optimizer's own scalars for the log (names without a prefix)."""
        return {}

    def snapshot(self) -> Snapshot:
        """The raw state before a step, for :meth:`restore` (the module docstring). A sync parked on
        :attr:`runtime` across steps (DeMo's ``overlap``, the streaming ``sync_delay``, an overlapped
        ``merge``) is a suspended generator, which is not copied: its record is kept (``Runtime.records``)."""
        snapshot = Snapshot.take(self, ("state", "param_groups", *self.step_attributes))
        snapshot.in_flight = self.runtime.records()
        return snapshot

    @torch.no_grad()
    def restore(self, snapshot: Snapshot) -> None:
        """Put the state of :meth:`snapshot` back, bit for bit; a sync the undone step parked on
        :attr:`runtime` is dropped with it, and every sync that was in flight when the snapshot was
        taken fails (:meth:`fail_syncs`'s rule: a step that does not commit ends its quorum)."""
        self.runtime.abandon()
        snapshot.restore(self)
        for _, _, record in snapshot.in_flight:
            self._fail_sync(record)

    @torch.no_grad()  # the failed fragments' parameters are written in place
    def fail_syncs(self, epoch: Any) -> int:
        """Live fault tolerance's rule for a sync in flight across steps, this optimizer's side (the
        rule: ``titan/common/replica_group.py``): every sync parked on :attr:`runtime` that was not
        issued in ``epoch`` (the quorum now), and every one a heal adopted, fails: its collective is
        dropped (``Runtime.fail``) and what it began is undone (:meth:`_fail_sync`). How many failed."""
        records = self.runtime.fail(epoch)
        for record in records:
            self._fail_sync(record)
        return len(records)

    def _fail_sync(self, record: Any) -> None:
        """Undo the sync of ``record`` (what the family passed to ``Runtime.start``), which will not
        land: the family's own rule (its docstring). Only families that keep a sync in flight across
        steps have one."""
        raise NotImplementedError(f"{type(self).__name__} keeps no R sync in flight across steps")

    def _settle_for_save(self) -> None:
        """What a family's ``state_dict()`` first does with its syncs in flight across steps: lands them
        (:attr:`lands_on_save`, the default: a checkpoint then holds none, and a run resumed from it goes
        on as the run that saved); under live fault tolerance, where landing them would be an R
        collective after a step's commit, fails them (:meth:`fail_syncs`: every group checkpoints after
        the same step and fails the same ones, so the groups stay equal, and a job resumed from disk has
        none in flight; the container lands them inside the step before a checkpoint, so there are none
        left to fail); leaves them as they are while a heal reads the state (:meth:`heal_state`)."""
        if self._reading_for_heal:
            return
        if self.lands_on_save:
            self.flush()
        else:
            self.fail_syncs(_NO_QUORUM)

    def heal_state(self) -> dict[str, Any]:
        """What a healing group takes from this one: :meth:`state_dict` (the checkpoint's form: it
        crosses processes) and the records of the syncs in flight (``Runtime.records``), which stay in
        flight here (read on torchft's quorum thread while this group waits for the quorum, which then
        fails them: :meth:`fail_syncs`)."""
        self._reading_for_heal = True
        try:
            return {"state": self.state_dict(), "in_flight": self.runtime.records()}
        finally:
            self._reading_for_heal = False

    def load_heal_state(self, saved: dict[str, Any]) -> None:
        """Inverse of :meth:`heal_state`: the peer's state, and its syncs in flight adopted by their
        records (``Runtime.adopt``): they fail at the quorum (their collectives are not here)."""
        self.load_state_dict(saved["state"])
        self.runtime.adopt(saved["in_flight"])

    @contextmanager
    def global_params(self, *, ledger: "Optional[comm.CommLedger]" = None) -> Iterator[None]:
        """Inside: the global model in every parameter's local shard; after: each replica's own
        parameters, bit for bit. ``ledger`` records what the swap sends (default: ``self.ledger``).
        Here: nothing to swap (the replicas' parameters are equal after every step)."""
        yield


def named_params(param_groups: list[dict]) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """``(group, fqn, param)`` over all param groups. A parameter passed without a name is called
    ``param<i>``, ``i`` its position over all groups, so names (and what is seeded by them) differ."""
    index = 0
    for group in param_groups:
        names = group.get("param_names") or [f"param{index + i}" for i in range(len(group["params"]))]
        index += len(group["params"])
        yield from ((group, name, p) for name, p in zip(names, group["params"]))
