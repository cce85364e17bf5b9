"""The container's part of a checkpoint, per replica (optimizers that own R).

All optimizer state is saved under ``replica<r>/`` keys, one copy per replica (``replica_state.py``),
with the container's counters, the comm ledger's totals (so that ``comm/*_total`` continues across a
resume) and the resolved optimizer options (``RESOLVED_KEY``, read back by the resume check,
``config/resume.py``; the keys are named in ``config/checkpoint.py``); parameters too when the optimizer says they diverge between syncs
(``CommOptimizer.params_replica_local``). torchtitan loads the model's flattened weights *after* the
optimizer's state, so replica-local parameters wait in :class:`PendingParams` until the next
``zero_grad()``, the first thing a training step does.
"""

import json
from typing import Any, Iterable, Optional

import torch

from ..config.checkpoint import LEDGER_KEY, RESOLVED_KEY
from . import replica_state
from titan_commopt.comm import CommLedger

__all__ = ["PendingParams", "save_replica", "load_replica", "save_ledger", "load_ledger"]

_PARAM = "param."
COUNTERS = ("skipped_steps", "steps_taken")  # the container's own counters, saved as they are


class PendingParams:
    """Replica-local parameters loaded from a checkpoint, put back once torchtitan has loaded the
    model's (replica 0's) weights."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def hold(self, values: dict[str, torch.Tensor]) -> None:
        self._values = values

    @torch.no_grad()
    def restore(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, p in named_params:
            if name in self._values:
                p.data.copy_(self._values[name])
        self._values = {}


def save_ledger(flat: dict[str, Any], ledger: Optional[CommLedger]) -> dict[str, Any]:
    """``flat`` with the ledger's entry (none for ``ledger=None``: a load from a checkpoint written
    before the totals were saved, which must not ask for the entry)."""
    return flat if ledger is None else {**flat, LEDGER_KEY: json.dumps(ledger.state_dict(), sort_keys=True)}


def load_ledger(state: dict[str, Any], ledger: CommLedger) -> dict[str, Any]:
    """``state`` less the ledger's entry, which ``ledger`` takes (where the checkpoint has one)."""
    rest = dict(state)
    saved = rest.pop(LEDGER_KEY, None)
    if saved is not None:
        ledger.load_state_dict(json.loads(saved))
    return rest


def save_replica(
    flat: dict[str, Any], replica: int, *, counters: dict[str, int], resolved_record: dict[str, Any],
    ledger: Optional[CommLedger], params: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
) -> dict[str, Any]:
    """``flat`` (the optimizers' state) with the container's parts added, all under ``replica<r>/``."""
    out = dict(flat)
    if params is not None:
        # A copy: on resume DCP loads into these tensors, and torchtitan then loads the model's
        # (replica 0's) weights into the parameters themselves.
        out.update({_PARAM + n: p.detach().clone() for n, p in params})
    out.update(counters)
    out[RESOLVED_KEY] = json.dumps(resolved_record, sort_keys=True)
    return replica_state.add_replica_prefix(save_ledger(out, ledger), replica)


def load_replica(
    state_dict: dict[str, Any], replica: int, ledger: CommLedger, pending: PendingParams
) -> tuple[dict[str, Any], dict[str, int]]:
    """``(optimizer state, counters)`` of this replica; its parameters go to ``pending``, its ledger
    totals to ``ledger``."""
    mine = load_ledger(replica_state.take_replica(state_dict, replica), ledger)
    counters = {key: int(mine.pop(key, 0)) for key in COUNTERS}
    mine.pop(RESOLVED_KEY, None)  # a record of the run that saved it, not optimizer state
    pending.hold({k[len(_PARAM):]: mine.pop(k) for k in list(mine) if k.startswith(_PARAM)})
    return mine, counters
