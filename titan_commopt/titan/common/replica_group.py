"""One replica group in torchft's job: its Manager, the quorum, the commit, the heal.

Live fault tolerance is turned on by torchtitan's own ``[fault_tolerance]`` keys (on 0.3 the same
fields of its torchft experiment's config, ``--fault_tolerance.*``) with ``TORCHFT_LIGHTHOUSE`` naming
torchft's lighthouse. Each replica group is its own launch (FSDP/TP inside it, its own
``MASTER_PORT``); R is the replica groups, joined by torchft's Manager. The Trainers' side (the
settings, the start, the retried step, the data, the token count) is ``replica_group_training.py``,
which makes a :class:`ReplicaGroupFT` per process; the optimizer container runs each step against it.

Per training step, sync quorum (``use_async_quorum=False``):

1. ``begin_step`` (the container's ``zero_grad``, before the forward): the lighthouse's quorum. W and
   this group's replica index are the quorum's (``Topology.quorum``); a group behind the quorum's
   step is healed here, before it computes a gradient, from a healthy peer (over HTTP): what each
   registered key carries (:meth:`ReplicaGroupFT.register_state`: the container's parameters,
   optimizer state, counters and ledger totals; the trainer's step, LR schedule and token count).
   The job's first quorum is asked again until every one of the ``group_size`` groups is in it
   (bounded by ``[commopt] ft_start_wait_s``), so that a run that never fails trains alike whatever
   order its groups started in.
2. The optimizer step runs; every R collective goes over the Manager's process group
   (``comm.managed_group``), and a peer that dies during one is an error the Manager records, not
   an exception.
3. ``commit`` (the Manager's ``should_commit``): if any group member saw an error, or fewer than
   ``min_replica_size`` groups took part, the step is undone (the container puts back what it
   saved before the step) and the same batches are trained again with the next quorum. Nothing of
   the optimizer's state changes unless the step commits.

No R collective is issued after ``commit`` (a group that did not commit heals at the next quorum
and would not issue it).

A sync that stays in flight across steps (DeMo's ``overlap``, a streaming fragment's ``sync_delay``,
an overlapped ``merge = "delayed"`` / ``"eager"``, SparseLoCo's too) is a transaction of its own,
torchft's rule for Streaming DiLoCo: from the quorum it is issued in to the commit of the step that
merges it. It merges only if every step in between committed in that same quorum; otherwise it fails
and the family undoes what it began (``CommOptimizer._fail_sync``: the fragment back to its last
global copy, its anchor; its outer state as it was), alike on every group. The rule, in two places
that make one:

- :meth:`ReplicaGroupFT.begin_step`: a quorum whose id (torchft's) differs from the one a sync was
  issued in fails it (a group lost or joined, or one whose step did not commit: torchft then starts a
  new quorum). Its collective ran on a process group the quorum has rebuilt: it is dropped, its
  errors not reported (``comm.Pending.drop``). A group that heals takes its peer's records of the
  syncs in flight (``CommOptimizer.heal_state``), not their collectives, and fails them the same way,
  so it rejoins exactly as its peers go on.
- a step that does not commit (``container.py``): its snapshot puts the state back as the step found
  it, and every sync that was then in flight fails (``CommOptimizer.restore``); a sync the undone
  step issued is dropped with it.

A committed step is never lost: only the failed fragment goes back to its anchor; the other
fragments, the counters and the data keep every committed step. A quorum that does not change
costs nothing: the syncs in flight land when due, as without fault tolerance (the same bits).

Per-replica state on a heal (momenta, error feedback, local parameters and their inner optimizer
state) is the peer's copy, as torchft's own DiLoCo does: docs/fault_tolerance.md argues the choice.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from titan_commopt import comm

from ..config.fault_tolerance_keys import (
    KILL_ENV, LIGHTHOUSE_ENV, QUORUM_TIMEOUT_ENV, FtSettings, kill_point, lighthouse_wait_seconds, quorum_timeout_s,
)

__all__ = ["ReplicaGroupFT", "Quorum", "StallWatchdog", "clone_tree", "average_gradients_over_quorum"]

logger = logging.getLogger(__name__)

_START_POLL_S = 0.5


def clone_tree(value: Any) -> Any:
    """``value`` (dicts, lists, tuples of tensors and scalars) with every tensor cloned (detached)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return value


class Quorum:
    """``Topology.quorum``: W and this group's index in the Manager's current quorum. Before the
    first quorum, W is the configured number of groups (what byte estimates price)."""

    def __init__(self, manager: Any, groups: int) -> None:
        self._manager = manager
        self.groups = groups  # [fault_tolerance] group_size: how many groups the data is split over
        self.started = False

    def size(self) -> int:
        return self._manager.num_participants() if self.started else self.groups

    def rank(self) -> int:
        if not self.started:
            return 0
        rank = self._manager.participating_rank()
        return 0 if rank is None else rank


class ReplicaGroupFT:
    """One replica group's side of live fault tolerance (module docstring). Made once per process,
    after the group's own process group exists, before the optimizer (whose R is :attr:`replicate`)."""

    def __init__(self, settings: FtSettings, *, manager: Any = None, replicate: Any = None,
                 stall_timeout_s: float = 0.0, start_wait_s: float = 0.0) -> None:
        """``manager``/``replicate``: given by tests (a stand-in Manager); else made here.
        ``stall_timeout_s``, ``start_wait_s``: ``[commopt] ft_stall_timeout_s`` (:class:`StallWatchdog`),
        ``ft_start_wait_s`` (:meth:`_wait_for_every_group`)."""
        self.settings = settings
        self.start_wait_s = start_wait_s
        self._watchdog = StallWatchdog(stall_timeout_s, settings.replica_id) if stall_timeout_s > 0 else None
        if manager is None:
            manager, replicate = _make_manager(settings, self)
        self.manager = manager
        self.replicate = replicate
        self.quorum = Quorum(manager, settings.group_size)
        self._kill = kill_point()
        self.uncommitted_steps = 0
        self.committed_here = 0  # steps this process committed (a heal's steps not counted)
        self.heals = 0
        self.last_heal_seconds = 0.0
        self._in_step = False
        self.failed_syncs = 0  # syncs in flight across steps that failed (the rule in the module docstring)
        self._optimizers: list[Any] = []  # the CommOptimizers whose syncs in flight follow the quorum
        self._quorum_seen: Optional[tuple[int, int]] = None
        self._started = False  # the first quorum was asked
        self._resume_step = 0

    @property
    def replica_id(self) -> int:
        return self.settings.replica_id

    # ---- state a heal carries ----
    def register_state(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """``save()`` is called on the healthy peer (on torchft's quorum thread while the peer's main
        thread waits in :meth:`begin_step`); it must return copies, as the peer trains on while the
        healing group reads them. ``load`` runs on the healing group's main thread."""

        def load_unless_killed(state: Any) -> None:
            self._maybe_die("heal")
            load(state)

        self.manager.register_state_dict_fn(key, load_unless_killed, save)

    def resume_at(self, committed_steps: int) -> None:
        """A checkpoint on disk was loaded at ``committed_steps``: the Manager starts counting from there
        (else every group restarted from its own checkpoint would heal from one of them at step 0)."""
        self._resume_step = committed_steps

    def track_syncs(self, optimizers: list[Any]) -> None:
        """The optimizers (``CommOptimizer``) whose syncs in flight across steps follow the quorum."""
        self._optimizers = list(optimizers)

    def quorum_id(self) -> Any:
        """torchft's id of the current quorum (the Manager's ``_quorum_id``, torchft 0.2.0: a new one at
        every change of membership and after a step some group did not commit; the same on every group)."""
        if not hasattr(self.manager, "_quorum_id"):
            raise RuntimeError("fault tolerance: this torchft's Manager has no _quorum_id (torchft 0.2.0's), which "
                               "a sync in flight across steps needs; pin torchft==0.2.0")
        return self.manager._quorum_id

    def syncs_failed(self, count: int, why: str) -> None:
        """``count`` syncs in flight failed (``why``): one line, and the metric."""
        if count:
            self.failed_syncs += count
            logger.warning("fault tolerance: %d R sync(s) in flight failed (%s): each dropped alike on every group "
                           "(a local-step fragment back to its last global copy, its outer state unchanged; DeMo's "
                           "overlapped update not applied)", count, why)

    # ---- one step ----
    def begin_step(self) -> bool:
        """The quorum of the coming step (and a heal, where this group is behind), then the rule for the
        syncs in flight (module docstring). Idempotent within a step: whether it took a quorum now."""
        if self._in_step:
            return False
        manager = self.manager
        self._maybe_die("quorum")
        if self._watchdog is not None:
            self._watchdog.pause()  # waiting for the others is not this group's stall
        if self._resume_step and manager.current_step() < self._resume_step:
            manager.load_state_dict({"step": self._resume_step, "batches_committed": manager.batches_committed()})
        start = time.perf_counter()
        step_before = manager.current_step()
        self._start_quorum()
        if not self.quorum.started and manager.current_step() == 0:
            self._wait_for_every_group()
        self.quorum.started = True
        self._in_step = True
        if self._optimizers:  # before the watchdog: a dropped collective may wait for a peer that is gone
            self._settle_syncs_in_flight()
        if self._watchdog is not None and self.committed_here:  # not this process's first step
            self._watchdog.arm()
        healed = manager.current_step() != step_before
        if healed:
            self.heals += 1
            self.last_heal_seconds = time.perf_counter() - start
            logger.info("fault tolerance: replica group %d healed from a peer at step %d in %.2f s",
                        self.replica_id, manager.current_step(), self.last_heal_seconds)
        seen = (manager.num_participants(), self.quorum.rank())
        if seen != self._quorum_seen:
            logger.info("fault tolerance: quorum of %d replica group(s), replica group %d is replica %d "
                        "(step %d)", seen[0], self.replica_id, seen[1], manager.current_step())
            self._quorum_seen = seen
        return True

    def _settle_syncs_in_flight(self) -> None:
        """The quorum's side of the rule: a sync issued in another quorum (or adopted by a heal) fails;
        the ones issued from now on belong to this quorum."""
        if any(o.runtime.in_flight for o in self._optimizers):
            epoch = self.quorum_id()
        else:
            epoch = getattr(self.manager, "_quorum_id", None)
        failed = 0
        for optimizer in self._optimizers:
            failed += optimizer.fail_syncs(epoch)
            optimizer.runtime.epoch = epoch
        self.syncs_failed(failed, f"the quorum changed before they merged, step {self.manager.current_step() + 1}")

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as error:  # noqa: BLE001 (torchft raises its own types, and timeouts)
            from ..platform.stop import TRAINING_STOPPED, stop_run

            stop_run(f"fault tolerance: replica group {self.replica_id} got no quorum from the lighthouse at "
                     f"{os.environ.get(LIGHTHOUSE_ENV)} within {quorum_timeout_s():g} s ({QUORUM_TIMEOUT_ENV}; a "
                     "quorum needs the lighthouse's --min_replicas groups, and more than half of those that "
                     f"heartbeat): {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                     TRAINING_STOPPED)

    def _wait_for_every_group(self) -> None:
        """A job's first step waits (up to ``start_wait_s``) for every one of its ``group_size`` groups,
        so that it starts with all of them rather than with whichever started first (which would train
        alone until the others join and heal from it). The polls are counted, not timed: every rank of
        the group asks for the same number of quorums (each one agreed by the whole group)."""
        groups, polls = self.settings.group_size, int(self.start_wait_s / _START_POLL_S)
        if self.manager.num_participants() >= groups or polls == 0:
            return
        logger.info("fault tolerance: waiting up to %.0f s for all %d replica groups to start (%d in the quorum)",
                    self.start_wait_s, groups, self.manager.num_participants())
        for _ in range(polls):
            time.sleep(_START_POLL_S)
            self._start_quorum()
            if self.manager.num_participants() >= groups or self.manager.current_step() != 0:
                return  # all here, or this group joined (and healed from) a job that has trained
        logger.warning("fault tolerance: %d of %d replica groups started within %.0f s; training with them, "
                       "the others join (and heal) when they start", self.manager.num_participants(), groups,
                       self.start_wait_s)

    def before_collective(self) -> None:
        """Called before every R collective (``comm.managed_group``)."""
        self._maybe_die("collective")
        self._maybe_die("stall")

    def waiting_for_peers(self, waiting: bool) -> None:
        """Called around the wait for an R collective (``comm.managed_group``)."""
        if self._watchdog is not None:
            (self._watchdog.hold if waiting else self._watchdog.release)()

    def _maybe_die(self, where: str) -> None:
        if self._kill is None or self._kill[1] != where:
            return
        step = self.manager.current_step() + 1  # the step about to be trained (a heal has set it already)
        if step < self._kill[0] if where == "heal" else step != self._kill[0]:
            return
        logger.warning("fault tolerance: %s=%s: this process %s now", KILL_ENV, os.environ[KILL_ENV],
                       "hangs" if where == "stall" else "kills itself")
        for handler in logging.getLogger().handlers:
            handler.flush()
        if where == "stall":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    def errored(self) -> bool:
        return self.manager.errored() is not None

    def commit(self) -> bool:
        """Whether the step just taken stands (the Manager's agreement within this group)."""
        self._in_step = False
        committed = bool(self.manager.should_commit())
        if self._watchdog is not None:
            self._watchdog.pause()
        self.committed_here += committed
        if not committed:
            self.uncommitted_steps += 1
            logger.warning("fault tolerance: step %d not committed (a peer failed or too few groups); "
                           "undone, and trained again with the next quorum", self.manager.current_step() + 1)
        return committed

    def metrics(self) -> dict[str, float]:
        return {"commopt/ft_replica_groups": float(self.quorum.size()),
                "commopt/ft_uncommitted_steps": float(self.uncommitted_steps),
                "commopt/ft_heals": float(self.heals),
                "commopt/ft_failed_syncs": float(self.failed_syncs)}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class StallWatchdog:
    """Drops a replica group that is alive but stalled: torchft's lighthouse never drops a group that
    still heartbeats, and with two groups the other cannot form a quorum without it, so a group whose
    step runs past the timeout ends itself (every rank: each has a watchdog) with one line, exit
    status 1; the lighthouse then drops it and the others go on; a relaunch heals. Armed from the
    quorum to the commit of every step but the first (compilation, warm-up)."""

    def __init__(self, seconds: float, replica_id: int) -> None:
        self.seconds, self.replica_id = seconds, replica_id
        self._deadline: Optional[float] = None
        self._held_since: Optional[float] = None
        self._thread: Optional[threading.Thread] = None

    def arm(self) -> None:
        self._held_since = None
        self._deadline = time.monotonic() + self.seconds
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="commopt-ft-watchdog", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        self._deadline = None

    def hold(self) -> None:
        """Waiting for the peers in an R collective (bounded by the process group's timeout): not counted."""
        if self._deadline is not None:
            self._held_since = time.monotonic()

    def release(self) -> None:
        held, self._held_since = self._held_since, None
        if held is not None and self._deadline is not None:
            self._deadline += time.monotonic() - held

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            deadline = self._deadline
            if deadline is not None and self._held_since is None and time.monotonic() > deadline:
                logger.error("fault tolerance: replica group %d stalled: a step ran past [commopt] "
                             "ft_stall_timeout_s = %g s; this group leaves, the others go on, relaunch it to rejoin",
                             self.replica_id, self.seconds)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(1)


# torchft's loggers: its modules', and the two that log an empty INFO record per quorum and per commit
# (structured fields for its OpenTelemetry export, when TORCHFT_USE_OTEL is set)
_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits")


class _NoFlightRecorder(logging.Filter):
    """torchft warns at every quorum change that it cannot reset NCCL's flight recorder: on gloo
    there is none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def _make_manager(settings: FtSettings, ft: "ReplicaGroupFT") -> tuple[Any, Any]:
    """torchft's Manager for this process (sync quorum) and R over its process group. torchft logs
    every quorum and commit at INFO (its Rust side through ``RUST_LOG``): warnings only, unless the
    user set either; our own lines say what changed (a quorum, a heal, a step undone)."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in _TORCHFT_LOGGERS:
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    if settings.process_group == "gloo":
        logging.getLogger("torchft.manager").addFilter(_NoFlightRecorder())
    import torchft

    timeout = timedelta(milliseconds=settings.process_group_timeout_ms)
    if settings.process_group == "nccl":
        pg = torchft.ProcessGroupNCCL(timeout=timeout)
    else:
        pg = torchft.ProcessGroupGloo(timeout=timeout)
    manager = torchft.Manager(
        pg=pg, min_replica_size=settings.min_replica_size, load_state_dict=None, state_dict=None,
        use_async_quorum=False,  # heal before the forward; a raw all-gather would carry un-healed payloads
        replica_id=f"titan_commopt_{settings.replica_id}",
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        timeout=max(timeout, timedelta(seconds=30)),  # the heal's transfer and should_commit's agreement
        quorum_timeout=timedelta(seconds=quorum_timeout_s()),
        connect_timeout=timedelta(seconds=lighthouse_wait_seconds()),
    )
    return manager, comm.managed_group(manager, "commopt_R", ft.before_collective, ft.waiting_for_peers)


def average_gradients_over_quorum(model_parts: list[Any], ft: ReplicaGroupFT) -> None:
    """torchtitan's own AdamW/Adam under fault tolerance, torchtitan's way (HSDP): every FSDP module's
    reduce-scattered gradient is then averaged over the quorum's groups."""
    from torch.distributed.fsdp import FSDPModule

    def hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=ft.replicate, op=dist.ReduceOp.AVG)

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(hook)
