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

Every optimizer is constructed one way: ``Optimizer(named_params, topology, options, *, ledger=None)``
with ``options`` the run's :class:`~titan_commopt.optim.family.Resolved` value (the family's
options dataclass, ``[optimizer]``'s hyper-parameters with the effective lr) — checked before, by
the registry (``Family.check``), never again here. ``ledger`` receives the bytes of every
collective the optimizer issues (default: ``comm``'s process-wide ledger, for use outside a run).
Overlap of communication with compute goes through ``self.runtime`` (``titan_commopt.overlap``).

Parameters are passed as torch's named parameters (``(fqn, param)`` pairs, also inside param-group
dicts), so every family finds a parameter's name in ``group["param_names"]`` the same way.
"""

from typing import Any, Iterator, Optional

import torch

from titan_commopt import comm
from titan_commopt.overlap import Runtime
from titan_commopt.topology import Topology

__all__ = ["CommOptimizer", "LocalSteps", "named_params"]


class CommOptimizer(torch.optim.Optimizer):
    params_replica_local: bool  # required of every subclass (class attribute or property)

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


def named_params(param_groups: list[dict]) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """``(group, fqn, param)`` over all param groups. A parameter passed without a name is called
    ``param<i>``, ``i`` its position over all groups, so names (and what is seeded by them) differ."""
    index = 0
    for group in param_groups:
        names = group.get("param_names") or [f"param{index + i}" for i in range(len(group["params"]))]
        index += len(group["params"])
        yield from ((group, name, p) for name, p in zip(names, group["params"]))


class LocalSteps:
    """What the families whose replicas step locally and sync R every few steps share (the
    local-adaptive family, SparseLoCo), mixed in before :class:`CommOptimizer`:

    - one step counter for every parameter: ``self._n`` (a Python int, no host read) and
      ``self._step_t``, the CPU scalar tensor every ``state["step"]`` is, so checkpoints carry it;
    - ``metrics()``: the syncs in flight on ``runtime`` and the steps to the next sync;
    - ``state_dict()`` lands every sync in flight first (waiting for its collective): a checkpoint
      holds no half-done sync, and the run that saved continues from the same state as a run resumed
      from it (a streaming sync then lands up to ``sync_delay`` − 1 steps early, at the checkpoint's
      step: the one thing a checkpoint changes in the trajectory); ``load_state_dict()`` drops the
      syncs in flight (the state they belong to is replaced) and reads the counter back once.
    """

    _n: int
    _step_t: torch.Tensor

    def metrics(self) -> dict[str, float]:
        out = {"syncs_in_flight": float(self.runtime.in_flight)}
        steps = self.steps_to_next_sync()
        if steps is not None:
            out["steps_to_next_sync"] = float(steps)
        return out

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.runtime.abandon()
        super().load_state_dict(state_dict)
        # a checkpoint of per-parameter counters: their largest, then one shared tensor again
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self._n = int(max(float(t) for t in steps)) if steps else 0
        self._step_t = torch.tensor(float(self._n))
        for s in self.state.values():
            if "step" in s:
                s["step"] = self._step_t
