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
from typing import Any, Iterator, Optional

import torch

from titan_commopt import comm
from titan_commopt.overlap import Runtime
from titan_commopt.topology import Topology

__all__ = ["CommOptimizer", "named_params"]


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
