"""One replica group of a fault-tolerant run, as both torchtitan lines' Trainers train it.

:class:`ReplicaGroupTraining` owns live fault tolerance for a Trainer of either line: the
``[fault_tolerance]`` settings (read once, by the line's Trainer), the group's own checkpoint folder
(``<folder>/replica_<id>``) and data shard, the Manager (:meth:`ReplicaGroupTraining.start`, right
after the group's process group exists: ``replica_group.ReplicaGroupFT``), the step trained again
until it commits (:meth:`ReplicaGroupTraining.train_step`) on the same batches
(:class:`ReplayBatches`), the token count, the LR schedule that moves only on a commit, what a heal
carries of the trainer (its step, token count, LR schedule; its data shard skipped to the quorum's
step), whether torchtitan writes a checkpoint after the step being taken (the container then lands its
syncs in flight inside that step: ``checkpoint_follows``) and the fingerprints at the end.
:class:`ReplicaGroupSteps` is the Trainer methods that route
to it, written once: each line's Trainer puts it before torchtitan's in its bases, makes the
:class:`ReplicaGroupTraining` from its config and hands it what only the line knows how to wire (the
checkpoint folder and data shard into its config, ``tt022/trainer.py``; on 0.3 also the optimizer
config that builds the container, ``tt03/replica_group_trainer.py``). The optimizer container is
handed the group (``container.attach_fault_tolerance``); nothing finds it on the call stack.

The token count (``ntokens_seen``) counts each committed step's tokens once, as the line's
torchtitan counts them (0.2.2 as a batch is read, 0.3 at the forward, after context-parallel
sharding): the batches a step is trained again on pass through torchtitan's counting again, and a
step that does not commit leaves the count as its quorum left it (a heal during it sets the count).
"""

import functools
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Optional

import torch.distributed as dist

from titan_commopt.topology import Topology

from ..config.fault_tolerance_keys import LIGHTHOUSE_ENV, FtSettings
from . import token_count
from .replica_group import ReplicaGroupFT, average_gradients_over_quorum, clone_tree

__all__ = ["ReplicaGroupTraining", "ReplicaGroupSteps", "ReplayBatches"]

logger = logging.getLogger(__name__)


class ReplayBatches:
    """A replica group's data under fault tolerance, read below torchtitan's ``batch_generator``: a
    step that did not commit is trained again on the same batches; after a heal the group's own data
    shard is skipped forward to the quorum's step (what it would have read had it not been lost), so
    no shard is read twice or out of order."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._taken: list[Any] = []  # this step's batches, kept until it commits
        self._replay: list[Any] = []
        self._drawn = 0  # batches read from the shard so far
        self._skip = 0  # batches to drop before the next one (after a heal)

    def __iter__(self) -> "ReplayBatches":
        return self

    def __next__(self) -> Any:
        if self._replay:
            batch = self._replay.pop(0)
        else:
            while self._skip:
                next(self._source)
                self._drawn += 1
                self._skip -= 1
            batch = next(self._source)
            self._drawn += 1
        self._taken.append(batch)
        return batch

    def committed(self) -> None:
        self._taken = []

    def rewind(self) -> None:
        """The step did not commit: its batches come again, in order."""
        self._replay = self._taken + self._replay
        self._taken = []

    def skip_to(self, batches_before: int) -> None:
        """A heal moved this group to a later step: the next batch is the shard's ``batches_before``-th
        (what the group would read at that step had it never been lost); pending replays are dropped."""
        self._replay, self._taken = [], []
        self._skip = max(batches_before - self._drawn, 0)


class ReplicaGroupTraining:
    """See the module docstring. Made by a line's Trainer before torchtitan's ``__init__`` (:meth:`of`);
    ``commopt``: the run's ``[commopt]`` section (its ``ft_*`` keys)."""

    def __init__(self, settings: FtSettings, commopt: Any) -> None:
        self.settings = settings
        self._commopt = commopt
        self.group: Optional[ReplicaGroupFT] = None  # the Manager's side, once started
        self._trainer: Any = None  # the Trainer, from its first step on
        self._batches: Optional[ReplayBatches] = None
        self._tokens_at_quorum = 0  # ntokens_seen as the current step's quorum left it

    @classmethod
    def of(cls, settings: FtSettings, commopt: Callable[[], Any]) -> Optional["ReplicaGroupTraining"]:
        """The fault tolerance of a run with ``settings`` (None when it is off); ``commopt()`` gives the
        ``[commopt]`` section (asked only when it is on)."""
        return cls(settings, commopt()) if settings.enable else None

    @property
    def replica_id(self) -> int:
        return self.settings.replica_id

    # ---- before torchtitan's Trainer builds anything: what the line wires into its config ----
    def checkpoint_folder(self, folder: str) -> str:
        """The group's own checkpoint folder under the run's ``folder`` (``FtSettings.checkpoint_folder``)."""
        return self.settings.checkpoint_folder(folder)

    def data_shard(self, dp_world_size: int, dp_rank: int) -> tuple[int, int]:
        """The data shard of a rank of this group, given its data-parallel degree and rank within the
        group: the groups split the data as replicas of one mesh would (torchtitan's own rule for its
        fault-tolerant trainer)."""
        return dp_world_size * self.settings.group_size, dp_world_size * self.replica_id + dp_rank

    # ---- the group's process group exists ----
    def start(self) -> ReplicaGroupFT:
        """torchft's Manager and R for this process: after its replica group's process group, before
        anything is built on R. A worker whose launcher dies from here on dies with it
        (``platform/launcher_death.py``); a lighthouse that does not answer is one line, exit status 2,
        on every rank."""
        from ..config.fault_tolerance_keys import wait_for_lighthouse
        from ..platform.launcher_death import die_with_launcher
        from ..platform.stop import RESUME_REFUSED, stop_run

        die_with_launcher()  # before the Manager heartbeats: an orphan would hold the job
        url = os.environ.get(LIGHTHOUSE_ENV, "")
        problem = wait_for_lighthouse(url, waiting=lambda seconds: logger.info(
            "fault tolerance: replica group %d waits up to %.0f s for the torchft lighthouse at %s",
            self.replica_id, seconds, url))
        if problem is not None:
            stop_run(f"fault tolerance: {problem}", RESUME_REFUSED)
        self.group = ReplicaGroupFT(self.settings, stall_timeout_s=self._commopt.ft_stall_timeout_s,
                                    start_wait_s=self._commopt.ft_start_wait_s)
        return self.group

    # ---- training ----
    def replayable(self, data_iterable: Iterable[Any]) -> ReplayBatches:
        """What torchtitan's ``batch_generator`` reads (the dataloader, replayable)."""
        self._batches = ReplayBatches(iter(data_iterable))
        return self._batches

    def train_step(self, trainer: Any, data_iterator: Iterator[Any], train_step: Callable[[Iterator[Any]], Any]) -> None:
        """torchtitan's ``train_step`` (``train_step(data_iterator)``), trained again until it commits."""
        if self._trainer is None:
            self._attach(trainer)
        assert self._batches is not None, "the data is read through ReplicaGroupSteps.batch_generator"
        while True:
            self._tokens_at_quorum = trainer.ntokens_seen  # a heal in the quorum below sets it (_load)
            train_step(data_iterator)
            if trainer.optimizers.committed:
                self._batches.committed()
                return
            trainer.ntokens_seen = self._tokens_at_quorum
            self._batches.rewind()

    def _attach(self, trainer: Any) -> None:
        """At the first step of this process (after a checkpoint on disk was loaded, before the first
        quorum): the LR schedule moves only on a commit, a heal carries the trainer's state, and
        torchtitan's own AdamW/Adam averages its gradients over the quorum (HSDP's way)."""
        group = self.group
        assert group is not None and trainer.optimizers.ft is group, "the container runs its steps against this group"
        self._trainer = trainer
        schedulers = trainer.lr_schedulers
        step_schedule = schedulers.step
        schedulers.step = lambda *a, **k: step_schedule(*a, **k) if trainer.optimizers.committed else None
        group.register_state("commopt_trainer", self._save, self._load)
        trainer.optimizers.checkpoint_follows = lambda: _checkpoint_follows(trainer)
        group.resume_at(trainer.step - 1)
        if not trainer.optimizers.owns_replicate_sync:
            average_gradients_over_quorum(trainer.model_parts, group)

    def _batches_per_step(self) -> int:
        # 0.3 reads a batch per pipeline microbatch; 0.2.2 has no such attribute (one batch per accumulation step)
        trainer = self._trainer
        return trainer.gradient_accumulation_steps * getattr(trainer, "num_pipeline_parallel_microbatches", 1)

    def _save(self) -> dict[str, Any]:
        trainer = self._trainer
        return clone_tree({"step": trainer.step, "ntokens_seen": trainer.ntokens_seen,
                           "lr_schedulers": trainer.lr_schedulers.state_dict()})

    def _load(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        trainer.step = state["step"]
        trainer.ntokens_seen = self._tokens_at_quorum = state["ntokens_seen"]
        trainer.lr_schedulers.load_state_dict(state["lr_schedulers"])
        if self._batches is not None:
            self._batches.skip_to((trainer.step - 1) * self._batches_per_step())

    # ---- the end ----
    def finish(self, trainer: Any) -> None:
        """One line per rank: the fingerprint of its parameter shards (equal on the same rank of every
        group when the replicas are in sync); and, for an optimizer that keeps anchors (the global
        model of DiLoCo, SparseLoCo, an overlapped merge: equal on every group but an eager merge's
        even where the parameters are not, e.g. with streaming fragments), theirs."""
        from .replica_state import fingerprint

        mask = (1 << 61) - 1
        value = 0
        for part in trainer.model_parts:
            for _, p in part.named_parameters():
                value = (value * 1_000_003 + fingerprint(p)) & mask
        logger.info("fault tolerance: replica group %d, rank %d: parameters at step %d: fingerprint %x",
                    self.replica_id, dist.get_rank(), trainer.step, value)
        anchors = [state["outer_anchor"] for optimizer in getattr(trainer.optimizers, "optimizers", [])
                   for group in optimizer.param_groups for p in group["params"]
                   if "outer_anchor" in (state := optimizer.state.get(p, {}))]
        if anchors:
            value = 0
            for anchor in anchors:
                value = (value * 1_000_003 + fingerprint(anchor)) & mask
            logger.info("fault tolerance: replica group %d, rank %d: anchors at step %d: fingerprint %x",
                        self.replica_id, dist.get_rank(), trainer.step, value)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()


def _checkpoint_follows(trainer: Any) -> bool:
    """Whether torchtitan's train loop writes a checkpoint after the step being taken: its checkpointer's
    own rule (``CheckpointManager._should_save``, both lines, called as their loops call ``save``)."""
    should_save = getattr(trainer.checkpointer, "_should_save", None)
    return bool(should_save is not None and should_save(trainer.step, last_step=not trainer.should_continue_training()))


class ReplicaGroupSteps:
    """The Trainer methods a fault-tolerant run routes through :class:`ReplicaGroupTraining`, for
    both lines: put it before torchtitan's Trainer in a Trainer's bases, and set
    :attr:`fault_tolerance` before torchtitan's ``__init__`` runs (None: torchtitan's own behaviour)."""

    fault_tolerance: Optional[ReplicaGroupTraining] = None

    def init_distributed(self) -> Any:
        parallel_dims = super().init_distributed()  # type: ignore[misc]
        if self.fault_tolerance is not None:
            self.fault_tolerance.start()
        return parallel_dims

    def batch_generator(self, data_iterable: Iterable[Any]) -> Iterator[Any]:
        if self.fault_tolerance is not None:
            data_iterable = self.fault_tolerance.replayable(data_iterable)
        return super().batch_generator(data_iterable)  # type: ignore[misc]

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        if self.fault_tolerance is None:
            with token_count.per_replica(*self._token_count_scope):
                super().train_step(data_iterator)  # type: ignore[misc]
        else:
            self.fault_tolerance.train_step(self, data_iterator, super().train_step)  # type: ignore[misc]

    @functools.cached_property
    def _token_count_scope(self) -> tuple[Any, Optional[Topology]]:
        """The batch mesh and R/S/T for ``token_count.per_replica``, decided (and logged) at the first
        step, once the container and the meshes exist: an optimizer that owns R counts the step's tokens
        within the replica (``(None, None)``: torchtitan's count over R × S)."""
        container = self.optimizers  # type: ignore[attr-defined]
        parallel_dims = self.parallel_dims  # type: ignore[attr-defined]
        if not getattr(container, "owns_replicate_sync", False) or not parallel_dims.dp_enabled:
            return None, None
        batch, topology = parallel_dims.get_mesh("batch"), container.topology
        logger.info("token count of each step: %s", "within the replica (|R| × its S's count: no R collective "
                    "before the forward)" if token_count.replica_count_applies(batch, topology)
                    else "torchtitan's, over the batch mesh")
        return batch, topology

    def close(self) -> None:
        if self.fault_tolerance is not None and self.fault_tolerance.group is not None:
            self.fault_tolerance.finish(self)
        super().close()  # type: ignore[misc]
        if self.fault_tolerance is not None:
            self.fault_tolerance.shutdown()
