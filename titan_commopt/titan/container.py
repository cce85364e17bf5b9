"""torchtitan's ``OptimizersContainer`` around our optimizers: safeguards, bytes, per-replica checkpoints.

Per ``step()``: a non-finite gradient on any rank makes every rank skip the step together (or stop);
the optimizers step; FSDP2's estimated traffic is recorded and the comm ledger's step closed; every
``check_replicas_every`` steps the replicas' parameters are compared.

Checkpoints (optimizers that own R): all optimizer state is saved under ``replica<r>/`` keys, one
copy per replica (``titan_commopt.state``), with the resolved optimizer options; parameters too
when the optimizer says they diverge between syncs (``CommOptimizer.params_replica_local``).
torchtitan loads the model's flattened weights *after* the optimizer's state, so replica-local
parameters are put back at the next ``zero_grad()``, the first thing a training step does.
"""

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from titan_commopt import comm
from titan_commopt import state as replica_state
from titan_commopt.optim import CommOptimizer, Resolved
from titan_commopt.optim.common import local
from titan_commopt.optim.traffic import FsdpTraffic
from titan_commopt.topology import Topology

from .stop import TRAINING_STOPPED, stop_run

__all__ = ["Safeguards", "container_cls", "RESOLVED_KEY"]

RESOLVED_KEY = "commopt_resolved"  # the resolved options (JSON) in the optimizer's checkpoint state


@dataclass(frozen=True)
class Safeguards:
    """What the container checks around each optimizer step (``[commopt]`` common options)."""

    on_nonfinite: str = "skip"  # "skip" | "stop" | "off"
    check_replicas_every: int = 0  # 0 = never
    max_consecutive_skips: int = 10  # this many skipped steps in a row stop the run; 0 = never


# Param-group entries that are not hyper-parameters of this run: torch's, and the learning rate,
# which torchtitan's LR scheduler (restored from the same checkpoint) owns.
_NOT_HYPERPARAMETERS = ("params", "param_names", "lr", "initial_lr")


@functools.cache
def container_cls() -> type:
    """The container class (made on first use: torchtitan is imported only then)."""
    from torchtitan.components.optimizer import OptimizersContainer

    class CommOptimizersContainer(OptimizersContainer):
        """See the module docstring. ``resolved`` is ``None`` for torchtitan's own AdamW/Adam."""

        def __init__(
            self,
            model_parts: list[nn.Module],
            optimizers: list[torch.optim.Optimizer],
            *,
            name: str,
            resolved: Optional[Resolved],
            topology: Topology,
            fsdp_traffic: Optional[FsdpTraffic],
            adamw_reference_r_bytes: float,
            safeguards: Safeguards = Safeguards(),
        ) -> None:
            if resolved is not None and not all(isinstance(o, CommOptimizer) for o in optimizers):
                raise TypeError("optimizers that own the replicate sync must be CommOptimizers")
            self.model_parts = model_parts
            self.optimizers = optimizers
            self.name = name
            self.resolved = resolved
            self.topology = topology
            self.fsdp_traffic = fsdp_traffic
            self.adamw_reference_r_bytes = adamw_reference_r_bytes
            self.safeguards = safeguards
            self.ledger = comm.get_ledger()
            self.skipped_steps = 0
            self.consecutive_skips = 0
            self.steps_taken = 0
            self._pending_params: dict[str, torch.Tensor] = {}
            self._nonfinite: Optional[bool] = None  # decided by clip_grad_norm_ for the coming step
            self._param_ids = {id(p) for _, p in self._named_params()}
            self._validate_length(len(model_parts))
            all_params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
            # Optimizer.__init__ gives the container hooks; lr lives in the wrapped optimizers.
            torch.optim.Optimizer.__init__(self, all_params, {"lr": optimizers[0].defaults.get("lr", 0.0)})

        @property
        def owns_replicate_sync(self) -> bool:
            return self.resolved is not None

        def _named_params(self) -> list[tuple[str, nn.Parameter]]:
            return [(n, p) for m in self.model_parts for n, p in m.named_parameters() if p.requires_grad]

        # ---- one training step: clip (called by torchtitan first), then step --------------------
        def owns(self, params: list[torch.Tensor]) -> bool:
            """Whether ``params`` are this container's (the parameters torchtitan clips)."""
            with_grad = [p for p in params if p.grad is not None]
            return bool(with_grad) and all(id(p) in self._param_ids for p in with_grad)

        @torch.no_grad()
        def clip_grad_norm_(
            self, parameters: Iterable[torch.Tensor], max_norm: float, foreach: Optional[bool] = None
        ) -> torch.Tensor:
            """``[training] max_norm`` for optimizers that own R (module docstring): returns ``N``,
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
            # Mean over the world of every rank's replica norm² = mean over replicas (each replica has
            # the same number of ranks); one all-reduce, NaN/Inf anywhere makes it non-finite.
            sq = norm.detach().to(torch.float64).square().reshape(1)
            world = 1
            if dist.is_available() and dist.is_initialized():
                comm.all_reduce(sq, "world", dist.group.WORLD, op="sum")
                world = dist.get_world_size()
            mean_sq = float(sq.item()) / world
            total = self.topology.grad_scale * math.sqrt(mean_sq) if math.isfinite(mean_sq) else float("nan")
            self._nonfinite = not math.isfinite(total)
            total_norm = torch.tensor(total, dtype=torch.float32, device=device)
            if not self._nonfinite:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
            return total_norm

        def step(self, *args: Any, **kwargs: Any) -> None:
            guard = self.safeguards.on_nonfinite
            nonfinite, self._nonfinite = self._nonfinite, None
            if guard == "off":
                nonfinite = False
            elif nonfinite is None:  # not decided by clip_grad_norm_ (torchtitan's AdamW, tests)
                nonfinite = replica_state.any_nonfinite(p.grad for _, p in self._named_params())
            if nonfinite:
                self.skipped_steps += 1
                self.consecutive_skips += 1
                if guard == "stop":
                    stop_run(
                        f"non-finite gradient at optimizer step {self.steps_taken + 1} on at least one rank "
                        "([commopt] on_nonfinite = \"stop\"); resume from the last checkpoint once the cause "
                        "(learning rate, data) is fixed",
                        TRAINING_STOPPED,
                    )
                limit = self.safeguards.max_consecutive_skips
                if limit and self.consecutive_skips >= limit:
                    stop_run(
                        f"the last {self.consecutive_skips} optimizer steps (up to step {self.steps_taken + 1}) "
                        "were all skipped: every one had a NaN/Inf gradient on some rank, so training cannot "
                        f"recover by itself ([commopt] max_consecutive_skips = {limit}). Check [optimizer] lr "
                        "and the data, then resume from the last checkpoint (max_consecutive_skips = 0 keeps "
                        "skipping)",
                        TRAINING_STOPPED,
                    )
            else:
                self.consecutive_skips = 0
                for optimizer in self.optimizers:
                    optimizer.step(*args, **kwargs)
            self.steps_taken += 1
            if self.fsdp_traffic is not None:
                self.fsdp_traffic.record(self.ledger)
            every = self.safeguards.check_replicas_every
            if every and self.steps_taken % every == 0 and self._replicas_in_sync():
                self._check_replicas()
            self.ledger.end_step()  # after the drift check: its bytes belong to this step

        def _check_replicas(self) -> None:
            """The replicas' parameters compared by fingerprint. Only the ranks of a shard whose
            replicas differ see it, so the decision is agreed over all ranks (one flag all-reduce):
            every rank stops alike, rank 0 printing the first rank's finding (one line, exit status 1)."""
            try:
                replica_state.check_replicas(self._named_params(), self.topology)
                found = None
            except replica_state.ReplicaDriftError as error:
                found = str(error)
            if replica_state.any_rank(found is not None):
                findings = comm.all_gather_object(found, "world", dist.group.WORLD)  # the run stops here
                first = next(text for text in findings if text)
                stop_run(f"{first}; stopped at optimizer step {self.steps_taken}: resume from the last "
                         "checkpoint (each replica's own state), and look for what writes parameters outside "
                         "the optimizer", TRAINING_STOPPED)

        def steps_to_next_sync(self) -> Optional[int]:
            """Optimizer steps until the next R sync of a periodic optimizer (1 = the next step);
            ``None`` when it syncs every step or is torchtitan's own."""
            if not self.owns_replicate_sync:
                return None
            found = [n for o in self.optimizers if (n := o.steps_to_next_sync()) is not None]
            return min(found) if found else None

        def flush(self) -> None:
            """Land and apply every R sync still in flight (DeMo ``overlap``, streaming
            ``sync_delay``): the end of training leaves no update behind."""
            if self.owns_replicate_sync:
                with comm.use_ledger(self.ledger):
                    for o in self.optimizers:
                        o.flush()

        def _replicas_in_sync(self) -> bool:
            return not self.owns_replicate_sync or all(o.replicas_in_sync() for o in self.optimizers)

        def zero_grad(self, *args: Any, **kwargs: Any) -> None:
            if self._pending_params:
                self._restore_params()
            super().zero_grad(*args, **kwargs)

        # ---- checkpoints ----
        def state_dict(self) -> dict[str, Any]:
            with comm.use_ledger(comm.CommLedger()):  # a lazy-state init may communicate
                flat = super().state_dict()
            if not self.owns_replicate_sync:
                return flat
            if any(o.params_replica_local for o in self.optimizers):
                # A copy: on resume DCP loads into these tensors, and torchtitan then loads the
                # model's (replica 0's) weights into the parameters themselves.
                flat.update({f"param.{n}": p.detach().clone() for n, p in self._named_params()})
            flat["skipped_steps"] = self.skipped_steps
            flat["steps_taken"] = self.steps_taken
            record = {**self.resolved.record(), "replicas": self.topology.replicate_size}
            flat[RESOLVED_KEY] = json.dumps(record, sort_keys=True)
            return replica_state.add_replica_prefix(flat, self.topology.replica_index)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if not self.owns_replicate_sync:
                with comm.use_ledger(comm.CommLedger()):
                    super().load_state_dict(state_dict)
                return
            mine = replica_state.take_replica(state_dict, self.topology.replica_index)
            self.skipped_steps = int(mine.pop("skipped_steps", 0))
            self.steps_taken = int(mine.pop("steps_taken", 0))
            mine.pop(RESOLVED_KEY, None)  # a record of the run that saved it, not optimizer state
            self._pending_params = {k[len("param."):]: mine.pop(k) for k in list(mine) if k.startswith("param.")}
            # torch restores the saved param groups' hyper-parameters; this run's own values win
            # (titan/checkpoint.py allowed them to change and logged it), except the learning rate.
            ours = [[self._hyperparameters(g) for g in o.param_groups] for o in self.optimizers]
            with comm.use_ledger(comm.CommLedger()):
                super().load_state_dict(mine)
            for optimizer, groups in zip(self.optimizers, ours):
                for group, values in zip(optimizer.param_groups, groups):
                    group.update(values)

        @staticmethod
        def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}

        @torch.no_grad()
        def _restore_params(self) -> None:
            for name, p in self._named_params():
                if name in self._pending_params:
                    p.data.copy_(self._pending_params[name])
            self._pending_params = {}

    return CommOptimizersContainer
