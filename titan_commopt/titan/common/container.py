"""torchtitan's ``OptimizersContainer`` around our optimizers: one training step's rules, bytes and scalars.

Per ``step()``: the safeguards decide whether every rank skips it, or where each replica clips by its
own norm (``[commopt] clip_scope``) whether this replica does (``safeguards.py``; a skipped step keeps a
local-step family's sync schedule: ``skip_update``); the
optimizers step (under fault tolerance as a transaction around the Manager's commit:
``replica_group.py``); FSDP2's estimated traffic is recorded and the run's comm ledger's step closed,
after the replicas' drift check (its bytes belong to the step). For optimizers that own R the
container also takes over torchtitan's gradient clipping (``clipping.py``) and saves its state per
replica (``replica_checkpoint.py``). :meth:`CommOptimizersContainer.metrics` gives the scalars the
metrics processor logs (``metrics.py``). An evaluation runs inside
:meth:`CommOptimizersContainer.global_model` (``validation.py``): the model a user keeps, its bytes on
a ledger of their own.
"""

import math
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.optimizer import OptimizersContainer

from titan_commopt import comm
from titan_commopt.optim import CommOptimizer, Resolved
from titan_commopt.optim.common import local
from titan_commopt.optim.traffic import FsdpTraffic
from titan_commopt.topology import R, Topology

from . import replica_checkpoint, replica_state
from .replica_group import ReplicaGroupFT, clone_tree
from .safeguards import Safeguards, StepGuard, stop_if_replicas_differ

__all__ = ["CommOptimizersContainer", "Safeguards"]

# Param-group entries that are not hyper-parameters of this run: torch's, and the learning rate,
# which torchtitan's LR scheduler (restored from the same checkpoint) owns.
_NOT_HYPERPARAMETERS = ("params", "param_names", "lr", "initial_lr")


class CommOptimizersContainer(OptimizersContainer):
    """See the module docstring. ``resolved`` is ``None`` for torchtitan's own AdamW/Adam;
    ``ledger``: the run's comm ledger, the one its optimizers record on."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        *,
        name: str,
        resolved: Optional[Resolved],
        topology: Topology,
        ledger: comm.CommLedger,
        fsdp_traffic: Optional[FsdpTraffic],
        adamw_reference_r_bytes: float,
        safeguards: Safeguards = Safeguards(),
        ledger_in_checkpoint: bool = True,
        clip_scope: str = "replicas",
    ) -> None:
        if resolved is not None and not all(isinstance(o, CommOptimizer) for o in optimizers):
            raise TypeError("optimizers that own the replicate sync must be CommOptimizers")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.name = name
        self.resolved = resolved
        self.topology = topology
        self.ledger = ledger
        self.fsdp_traffic = fsdp_traffic
        self.adamw_reference_r_bytes = adamw_reference_r_bytes
        self.guard = StepGuard(safeguards, ledger)
        self.steps_taken = 0
        # False while the checkpoint this run resumes from predates the saved ledger totals: its
        # load must not ask for them (DCP refuses a missing key); every save after it has them.
        self._ledger_in_checkpoint = ledger_in_checkpoint
        self._pending_params = replica_checkpoint.PendingParams()
        self._nonfinite_vote: Optional[bool] = None  # agreed by clip_grad_norm_ for the coming step
        self._logged = (dict(ledger.totals), ledger.steps)  # the ledger at the previous metrics()
        self._param_ids = {id(p) for _, p in self._named_params()}
        self.ft: Optional[ReplicaGroupFT] = None  # live fault tolerance: attach_fault_tolerance
        self.eval_ledger = comm.CommLedger()  # what evaluations send (global_model): not training's bytes
        self.committed = True  # whether the last step() stands (always, without fault tolerance)
        # Under fault tolerance: whether a checkpoint is written after the step being taken, asked once its
        # quorum (and any heal) is done; the group's trainer sets it (replica_group_training.py)
        self.checkpoint_follows: Callable[[], bool] = lambda: False
        # [commopt] clip_scope (build.clip_scope_of): "replica" clips each replica by its own gradient's
        # norm, and without fault tolerance skips a NaN/Inf step on that replica alone (skip_update)
        self.clips_per_replica = clip_scope == "replica"
        if self.clips_per_replica and not all(hasattr(o, "skip_update") for o in optimizers):
            raise ValueError("clip_scope = \"replica\" needs optimizers that step alone (the local-step families)")
        if hasattr(OptimizersContainer, "_validate_length"):  # torchtitan 0.2.2's check (0.3 has none)
            self._validate_length(len(model_parts))
        # A sync started in a step goes on the wire at the next zero_grad (overlap.py: after torchtitan's log
        # collectives); fault tolerance turns it off (a collective belongs to the step whose quorum issued it)
        for optimizer in self._ours():
            optimizer.runtime.defers_launch = True
        all_params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
        # Optimizer.__init__ gives the container hooks; lr lives in the wrapped optimizers.
        torch.optim.Optimizer.__init__(self, all_params, {"lr": optimizers[0].defaults.get("lr", 0.0)})

    @property
    def owns_replicate_sync(self) -> bool:
        return self.resolved is not None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps every rank skipped for a NaN/Inf gradient, since the run began."""
        return self.guard.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        return self.guard.consecutive_skips

    def _ours(self) -> list[CommOptimizer]:
        return [o for o in self.optimizers if isinstance(o, CommOptimizer)]

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for m in self.model_parts for n, p in m.named_parameters() if p.requires_grad]

    # ---- one training step: clip (called by torchtitan first), then step ------------------------
    def owns(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` are this container's (the parameters torchtitan clips)."""
        with_grad = [p for p in params if p.grad is not None]
        return bool(with_grad) and all(id(p) in self._param_ids for p in with_grad)

    @torch.no_grad()
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, foreach: Optional[bool] = None
    ) -> torch.Tensor:
        """``[training] max_norm`` for optimizers that own R (``clipping.py``): returns ``N``,
        which torchtitan logs as ``grad_norm``. Also decides this step's non-finite skip."""
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        device = local(grads[0]).device if grads else comm.control_device()  # NCCL: no CPU tensors
        # This replica's ‖p.grad‖ over its S/T shards (DTensor reduces them, as torchtitan's clip).
        norm = torch.zeros((), device=device)
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, 2.0, False, foreach)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        sq = norm.detach().to(torch.float64).square().reshape(1)
        if self.clips_per_replica:
            # ‖g_r‖ itself, as each worker of Templar's SparseLoCo and of torchtitan's fault-tolerant DiLoCo
            # clips: no R collective (under fault tolerance the skip is still agreed over the quorum below).
            mean_sq = float(sq.item())
        else:
            # Mean over the world of every rank's replica norm² = mean over replicas (each replica has
            # the same number of ranks); one all-reduce, NaN/Inf anywhere makes it non-finite.
            world = 1
            if dist.is_available() and dist.is_initialized():
                comm.all_reduce(sq, "world", dist.group.WORLD, op="sum", ledger=self.ledger)
                world = dist.get_world_size()
            if self.ft is not None:  # the world is one replica group: the mean over the quorum's groups too
                comm.all_reduce(sq, R, self.topology.replicate, op="mean", ledger=self.ledger)
            mean_sq = float(sq.item()) / world
        total = self.topology.grad_scale * math.sqrt(mean_sq) if math.isfinite(mean_sq) else float("nan")
        self._nonfinite_vote = not math.isfinite(total)
        if self.clips_per_replica and self.ft is not None:  # a step commits on every group or none
            self._nonfinite_vote = self._any_replica(self._nonfinite_vote)
        total_norm = torch.tensor(total, dtype=torch.float32, device=device)
        if not self._nonfinite_vote:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
        return total_norm

    def step(self, *args: Any, **kwargs: Any) -> None:
        ft = self.ft
        if ft is not None:
            ft.begin_step()  # where zero_grad did not
            if not self.owns_replicate_sync:  # HSDP's R sync ran in backward: commit, then step
                self._step_after_commit(*args, **kwargs)
                return
            saved = self._transaction_state()
        vote, self._nonfinite_vote = self._nonfinite_vote, None
        grads = [p.grad for _, p in self._named_params()]
        if ft is not None and vote is None:  # one decision over every group of the quorum
            vote = self._any_replica(replica_state.any_nonfinite(grads, ledger=self.ledger))
        alone = self._skips_alone()
        if alone:
            if vote is None:  # no clip ran: this replica's own decision
                vote = replica_state.any_nonfinite_in_replica(grads, self.topology, ledger=self.ledger)
            if self.steps_to_next_sync() in (None, 1):  # this step syncs R anyway: the replicas' stops agreed
                self.guard.agree_on_stop(f"before optimizer step {self.steps_taken + 1}, at an R sync")
        replica = self.topology.replica_index if alone else None
        if not self.guard.skip_step(vote, grads, self.steps_taken + 1, replica=replica):
            for optimizer in self.optimizers:
                optimizer.step(*args, **kwargs)
        else:  # a family that syncs on a schedule keeps it: its clock moves and the syncs due run
            for optimizer in self.optimizers:
                if hasattr(optimizer, "skip_update"):
                    optimizer.skip_update()
        self.steps_taken += 1
        if ft is not None and self.checkpoint_follows():
            # The checkpoint after this step would fail the syncs in flight (landing them after the commit
            # would be an R collective outside a step): they land now, inside this step's transaction, as a
            # checkpoint lands them without fault tolerance, and the groups lose no local progress to it.
            for optimizer in self.optimizers:
                optimizer.flush()
        if self.fsdp_traffic is not None:
            self.fsdp_traffic.record(self.ledger)
        if self.guard.due_for_drift_check(self.steps_taken) and self.replicas_in_sync():
            self.guard.check_replicas(self._named_params(), self.topology, self.steps_taken,
                                      valid=(lambda: not ft.errored()) if ft is not None else None)
        if ft is not None:  # no R collective after this point: a group that does not commit heals next
            self.committed = ft.commit()
            if not self.committed:
                self._restore(saved)
        self.ledger.end_step()  # after the drift check: its bytes belong to this step

    def _step_after_commit(self, *args: Any, **kwargs: Any) -> None:
        """torchtitan's own AdamW/Adam under fault tolerance: FSDP's all-reduce hook averaged the
        gradients over the quorum during backward; the optimizers step only if that committed."""
        assert self.ft is not None
        self.committed = self.ft.commit()
        if self.committed:
            grads = (p.grad for _, p in self._named_params())
            if not self.guard.skip_step(self._nonfinite_vote, grads, self.steps_taken + 1):
                for optimizer in self.optimizers:
                    optimizer.step(*args, **kwargs)
            self.steps_taken += 1
        self._nonfinite_vote = None
        if self.fsdp_traffic is not None:
            self.fsdp_traffic.record(self.ledger)
        self.ledger.end_step()

    def _skips_alone(self) -> bool:
        """Whether a NaN/Inf step is this replica's own decision (:attr:`clips_per_replica`, several
        replicas, no fault tolerance: under it every step is agreed over the quorum to commit)."""
        return self.clips_per_replica and self.ft is None and self.topology.replicate_size > 1

    def _any_replica(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any group of the quorum (one 4-byte all-reduce over R)."""
        value = torch.full((1,), float(flag), device=comm.control_device())
        comm.all_reduce(value, R, self.topology.replicate, op="max", ledger=self.ledger)
        return bool(value.item() > 0)

    # ---- fault tolerance: the state a step may change, and what a heal carries ----
    def attach_fault_tolerance(self, ft: ReplicaGroupFT) -> None:
        """Make every step a transaction around ``ft``'s commit, and let a healing group fetch this
        container's state (parameters, optimizer state, counters, ledger totals) from a peer."""
        self.ft = ft
        ft.register_state("commopt_optimizer", self._heal_state, self._load_heal_state)
        ours = self._ours()
        for optimizer in ours:  # a save fails the syncs in flight: landing them would be an R collective
            optimizer.lands_on_save = False  # after a commit (CommOptimizer._settle_for_save)
            optimizer.runtime.defers_launch = False  # a sync goes on the wire in its step's quorum
        ft.track_syncs(ours)  # a sync in flight across steps follows the quorum (replica_group.py)
        if self.steps_taken:  # resumed from a checkpoint on disk
            ft.resume_at(self.steps_taken)

    def _transaction_state(self) -> dict[str, Any]:
        """Copies of everything ``step()`` may change (the ledger aside: the bytes of a step that does
        not commit were sent all the same), each optimizer's raw (``CommOptimizer.snapshot``: no
        conversion, so an undone step is undone bit for bit, at the price of one copy)."""
        return {**self._params_and_counters(), "optimizers": [o.snapshot() for o in self.optimizers]}

    @torch.no_grad()
    def _restore(self, state: dict[str, Any]) -> None:
        """The step did not commit: everything as it found it, and every sync then in flight fails
        (``CommOptimizer.restore``; the rule: ``replica_group.py``), after the parameters are back."""
        self._load_params_and_counters(state)
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.restore(saved)
        assert self.ft is not None
        self.ft.syncs_failed(sum(len(getattr(saved, "in_flight", ())) for saved in state["optimizers"]),
                             f"step {self.ft.manager.current_step() + 1} did not commit")

    def _heal_state(self) -> dict[str, Any]:
        """What a healing group loads from this one: it crosses processes (torchft sends it over
        HTTP), so each optimizer's is its ``state_dict()``, the checkpoint's form, with the records of
        its syncs in flight (``CommOptimizer.heal_state``: nothing lands here)."""
        return {**self._params_and_counters(), "ledger": self.ledger.state_dict(), "optimizers": clone_tree(
            [o.heal_state() if isinstance(o, CommOptimizer) else o.state_dict() for o in self.optimizers])}

    @torch.no_grad()
    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self._load_params_and_counters(state)
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            if isinstance(optimizer, CommOptimizer):
                optimizer.load_heal_state(saved)
            else:
                optimizer.load_state_dict(saved)
        self.ledger.load_state_dict(state["ledger"])
        self._logged = (dict(self.ledger.totals), self.ledger.steps)
        self._set_clocks()

    def _set_clocks(self) -> None:
        """After a load: a family that syncs on a schedule counts the steps taken, skipped ones included
        (``LocalSteps.set_clock``); its checkpoint holds its updates, this container the steps."""
        for optimizer in self.optimizers:
            if hasattr(optimizer, "set_clock"):
                optimizer.set_clock(self.steps_taken)

    def _params_and_counters(self) -> dict[str, Any]:
        """Copies of the parameters (this rank's shards) and the container's counters: what a step
        and a heal change besides the optimizers."""
        return clone_tree({
            "params": {n: local(p.data) for n, p in self._named_params()},
            "counters": {"steps_taken": self.steps_taken, "skipped_steps": self.guard.skipped_steps,
                         "consecutive_skips": self.guard.consecutive_skips},
        })

    def _load_params_and_counters(self, state: dict[str, Any]) -> None:
        for name, p in self._named_params():
            local(p.data).copy_(state["params"][name])
        counters = state["counters"]
        self.steps_taken = counters["steps_taken"]
        self.guard.skipped_steps = counters["skipped_steps"]
        self.guard.consecutive_skips = counters["consecutive_skips"]

    def steps_to_next_sync(self) -> Optional[int]:
        """Optimizer steps until the next R sync of a periodic optimizer (1 = the next step);
        ``None`` when it syncs every step or is torchtitan's own."""
        if not self.owns_replicate_sync:
            return None
        found = [n for o in self.optimizers if (n := o.steps_to_next_sync()) is not None]
        return min(found) if found else None

    def replicas_in_sync(self) -> bool:
        """Whether the replicas' parameters must be equal now (always, for HSDP's AdamW/Adam)."""
        return not self.owns_replicate_sync or all(o.replicas_in_sync() for o in self.optimizers)

    def flush(self) -> None:
        """Land and apply every R sync still in flight (DeMo ``overlap``, streaming
        ``sync_delay``): the end of training leaves no update behind."""
        if self.owns_replicate_sync:
            for o in self.optimizers:
                o.flush()
            if self._skips_alone():  # a replica's stop not agreed at a sync yet: the run ends with it
                self.guard.agree_on_stop(f"at the end of training, after optimizer step {self.steps_taken}")

    def metrics(self) -> dict[str, float]:
        """The scalars of the steps since the previous call (a log step): the ledger's ``comm/*``
        (``comm.scalars``), ``commopt/skipped_steps``, and each optimizer's own ``metrics()`` under
        ``commopt/``."""
        since, steps_before = self._logged
        out = comm.scalars(self.ledger, since, self.ledger.steps - steps_before, self.adamw_reference_r_bytes)
        self._logged = (dict(self.ledger.totals), self.ledger.steps)
        out["commopt/skipped_steps"] = float(self.skipped_steps)
        if self.ft is not None:
            out.update(self.ft.metrics())
        for optimizer in self._ours():
            out.update({f"commopt/{k}": float(v) for k, v in optimizer.metrics().items()})
        return out

    # ---- evaluation: the global model ----
    @contextmanager
    def global_model(self) -> Iterator[None]:
        """Inside: every parameter holds the global model, the model a user keeps (for our
        optimizers their ``global_params``: the anchor, the mean over R or the parameters themselves;
        for torchtitan's AdamW/Adam, whose R sync keeps the replicas equal, the parameters), checked
        equal on every replica by fingerprint (a difference stops the run with one line, as the drift
        check does); after: each replica's own parameters, bit for bit. Its collectives are recorded on
        :attr:`eval_ledger`. Under live fault tolerance it issues no R collective (none may follow a
        step's commit: ``fault_tolerance.py``): the check is left to the drift check inside the steps,
        and a family that would need the mean over R is refused with validation on
        (``config/fault_tolerance_keys.py``)."""
        with ExitStack() as stack:
            _reshard(self.model_parts)  # a module still unsharded would not all-gather the swapped shards
            stack.callback(_reshard, self.model_parts)  # runs after every optimizer's restore
            if self.owns_replicate_sync:
                for optimizer in self.optimizers:
                    stack.enter_context(optimizer.global_params(ledger=self.eval_ledger))
            if self.ft is None:
                stop_if_replicas_differ(self._named_params(), self.topology, self.eval_ledger,
                                        f"before evaluating the global model after optimizer step {self.steps_taken}")
            self.eval_ledger.end_step()
            yield

    def eval_metrics(self) -> dict[str, float]:
        """The bytes evaluations sent so far (``comm.eval_scalars``): logged with each evaluation."""
        return comm.eval_scalars(self.eval_ledger)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for optimizer in self._ours():  # the syncs the last step started, behind its log collectives
            optimizer.runtime.launch()
        if self._pending_params:
            self._pending_params.restore(self._named_params())
        if self.ft is not None:  # before the forward: a healing group computes on the healed parameters
            self.ft.begin_step()
        super().zero_grad(*args, **kwargs)

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        # Every family makes its state at construction, so torch DCP's / torchtitan 0.3's lr = 0
        # init step (run only on an empty state) never steps ours: nothing to set aside here.
        if self.ft is not None and self.owns_replicate_sync:  # each optimizer's state_dict fails them
            self.ft.syncs_failed(sum(o.runtime.in_flight for o in self.optimizers),
                                 "a checkpoint is written: landing them would be an R collective after the commit")
        flat = super().state_dict()
        ledger = self.ledger if self._ledger_in_checkpoint else None
        if not self.owns_replicate_sync:
            return replica_checkpoint.save_ledger(flat, ledger)
        return replica_checkpoint.save_replica(
            flat, self._checkpoint_replica(),
            counters={"skipped_steps": self.skipped_steps, "steps_taken": self.steps_taken},
            resolved_record={**self.resolved.record(), "replicas": self._checkpoint_replicas()},
            ledger=ledger,
            params=self._named_params() if any(o.params_replica_local for o in self.optimizers) else None,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.owns_replicate_sync:
            rest = replica_checkpoint.load_ledger(state_dict, self.ledger)
            super().load_state_dict(rest)
        else:
            mine, counters = replica_checkpoint.load_replica(
                state_dict, self._checkpoint_replica(), self.ledger, self._pending_params
            )
            self.guard.skipped_steps = counters["skipped_steps"]
            self.steps_taken = counters["steps_taken"]
            # torch restores the saved param groups' hyper-parameters; this run's own values win
            # (titan/config/resume.py allowed them to change and logged it), except the learning rate.
            ours = [[self._hyperparameters(g) for g in o.param_groups] for o in self.optimizers]
            super().load_state_dict(mine)
            for optimizer, groups in zip(self.optimizers, ours):
                for group, values in zip(optimizer.param_groups, groups):
                    group.update(values)
            self._set_clocks()
        self._ledger_in_checkpoint = True
        self._logged = (dict(self.ledger.totals), self.ledger.steps)  # per-step scalars from the checkpoint on

    def _checkpoint_replica(self) -> int:
        """The replica a checkpoint's state belongs to. Under fault tolerance each group writes its
        own folder holding its own state alone, as replica 0 of one (the quorum's index changes with
        membership): a group's checkpoint reads like a one-replica run's."""
        return 0 if self.ft is not None else self.topology.replica_index

    def _checkpoint_replicas(self) -> int:
        return 1 if self.ft is not None else self.topology.replicate_size

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def _reshard(model_parts: list[nn.Module]) -> None:
    """Every FSDP2 module of ``model_parts`` back to its shards. A module FSDP2 keeps unsharded
    after a forward (torchtitan's last layers) would otherwise carry the values of the evaluation's
    swap into the next training forward: FSDP2 all-gathers only what is sharded."""
    for model in model_parts:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
