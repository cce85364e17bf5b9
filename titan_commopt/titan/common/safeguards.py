"""What the container checks around each optimizer step (the ``[commopt]`` common options).

- A NaN/Inf gradient on any rank: every rank skips the step together (``on_nonfinite = "skip"``), or
  the run stops (``"stop"``); ``max_consecutive_skips`` skipped steps in a row stop it too. Where each
  replica clips by its own norm (``[commopt] clip_scope``: the local-step families), the decision is the
  replica's alone (its ranks agree by its norm): it skips its own update, and a stop it decides waits
  for the next agreement (:meth:`StepGuard.agree_on_stop`, the container's: at the next R sync).
- Every ``check_replicas_every`` optimizer steps the replicas' parameters are compared by fingerprint
  (only at steps where the optimizer keeps replicas equal); a difference stops the run. The same
  check runs before every evaluation of the global model (:func:`stop_if_replicas_differ`).

Every decision is agreed over all ranks (control collectives over the world, on the run's ledger),
so that every rank stops alike, rank 0 printing one line (``titan/platform/stop.py``, exit status 1).
"""

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Optional

import torch
import torch.distributed as dist

from titan_commopt import comm
from . import replica_state
from titan_commopt.topology import Topology

from ..platform.stop import TRAINING_STOPPED, stop_run

__all__ = ["Safeguards", "StepGuard", "stop_if_replicas_differ"]


@dataclass(frozen=True)
class Safeguards:
    """The options (``[commopt]`` common options)."""

    on_nonfinite: Literal["skip", "stop", "off"] = "skip"
    check_replicas_every: int = 0  # 0 = never
    max_consecutive_skips: int = 10  # this many skipped steps in a row stop the run; 0 = never

    @classmethod
    def of(cls, commopt: Any) -> "Safeguards":
        """The safeguards a ``[commopt]`` section (``CommonOptions``) asks for."""
        return cls(on_nonfinite=commopt.on_nonfinite, check_replicas_every=commopt.check_replicas_every,
                   max_consecutive_skips=commopt.max_consecutive_skips)


class StepGuard:
    """The safeguards at work: decides each step's skip, counts skips, runs the drift check."""

    def __init__(self, safeguards: Safeguards, ledger: comm.CommLedger) -> None:
        self.safeguards = safeguards
        self.ledger = ledger
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._checks_nonfinite = safeguards.on_nonfinite != "off"
        self._stops_on_nonfinite = safeguards.on_nonfinite == "stop"
        self.pending_stop: Optional[str] = None  # a replica's own stop, until agree_on_stop

    def skip_step(self, vote: Optional[bool], grads: Iterable[Optional[torch.Tensor]], step: int,
                  replica: Optional[int] = None) -> bool:
        """Whether optimizer step ``step`` (1-based) is skipped: by every rank, ``vote`` the non-finite
        decision the clip's all-reduce agreed (``None``: not decided, one vote now); or, given
        ``replica`` (its index), by that replica's ranks alone, ``vote`` its own decision: a stop is
        then kept in :attr:`pending_stop` until :meth:`agree_on_stop`."""
        if not self._checks_nonfinite:
            return False
        nonfinite = replica_state.any_nonfinite(grads, ledger=self.ledger) if vote is None else vote
        if not nonfinite:
            self.consecutive_skips = 0
            return False
        self.skipped_steps += 1
        self.consecutive_skips += 1
        where, by = ("on at least one rank", "on some rank") if replica is None else (f"on replica {replica}", "there")
        skipped = "" if replica is None else f" by replica {replica}"
        stop = None
        limit = self.safeguards.max_consecutive_skips
        if self._stops_on_nonfinite:
            stop = (f"non-finite gradient at optimizer step {step} {where} ([commopt] on_nonfinite = \"stop\"); "
                    "resume from the last checkpoint once the cause (learning rate, data) is fixed")
        elif limit and self.consecutive_skips >= limit:
            stop = (f"the last {self.consecutive_skips} optimizer steps (up to step {step}) were all skipped"
                    f"{skipped}: every one had a NaN/Inf gradient {by}, so training cannot recover by itself "
                    f"([commopt] max_consecutive_skips = {limit}). Check [optimizer] lr and the data, then "
                    "resume from the last checkpoint (max_consecutive_skips = 0 keeps skipping)")
        if stop is not None:
            if replica is None:
                stop_run(stop, TRAINING_STOPPED)
            self.pending_stop = self.pending_stop or stop
        return True

    def agree_on_stop(self, when: str) -> None:
        """The replicas' own stops (:attr:`pending_stop`) agreed over all ranks: one 4-byte all-reduce;
        if any replica decided one, every rank stops alike, rank 0 printing the first replica's line and
        ``when`` the run stopped ("before optimizer step 32")."""
        stop_if_any_rank_found(self.pending_stop, self.ledger, f"stopped {when}")

    def due_for_drift_check(self, steps_taken: int) -> bool:
        every = self.safeguards.check_replicas_every
        return bool(every) and steps_taken % every == 0

    def check_replicas(self, named_params: list[tuple[str, Any]], topology: Topology, steps_taken: int,
                       valid: Optional[Callable[[], bool]] = None) -> None:
        """The replicas' parameters compared by fingerprint. Only the ranks of a shard whose
        replicas differ see it, so the decision is agreed over all ranks (one flag all-reduce):
        every rank stops alike, rank 0 printing the first rank's finding (one line, exit status 1).
        ``valid()``: whether the gathered fingerprints can be trusted (under fault tolerance not when
        a peer failed during the gather: that step is undone anyway)."""
        stop_if_replicas_differ(named_params, topology, self.ledger, f"at optimizer step {steps_taken}", valid)


def stop_if_replicas_differ(named_params: list[tuple[str, Any]], topology: Topology, ledger: comm.CommLedger,
                            when: str, valid: Optional[Callable[[], bool]] = None) -> None:
    """The drift check (:meth:`StepGuard.check_replicas`; also the evaluation's, before the global
    model is evaluated): ``when`` says where the run stopped (``"at optimizer step 8"``); the bytes go
    on ``ledger``."""
    try:
        replica_state.check_replicas(named_params, topology, ledger=ledger)
        found = None
    except replica_state.ReplicaDriftError as error:
        found = str(error) if valid is None or valid() else None
    stop_if_any_rank_found(found, ledger, f"stopped {when}: resume from the last checkpoint (each replica's own "
                           "state), and look for what writes parameters outside the optimizer")


def stop_if_any_rank_found(found: Optional[str], ledger: comm.CommLedger, then: str) -> None:
    """A finding some ranks made (``found``: this rank's line, or None) agreed over all ranks (one 4-byte
    all-reduce; the lines gathered only when there is one): every rank stops alike, rank 0 printing
    the first rank's line followed by ``then``."""
    if replica_state.any_rank(found is not None, ledger=ledger):
        findings = comm.all_gather_object(found, "world", dist.group.WORLD)  # the run stops here
        first = next(text for text in findings if text)
        stop_run(f"{first}; {then}", TRAINING_STOPPED)
