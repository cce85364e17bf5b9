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
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt import state as replica_state
from titan_commopt.optim import CommOptimizer, Resolved
from titan_commopt.optim.traffic import FsdpTraffic
from titan_commopt.topology import Topology

__all__ = ["Safeguards", "container_cls", "RESOLVED_KEY"]

RESOLVED_KEY = "commopt_resolved"  # the resolved options (JSON) in the optimizer's checkpoint state


@dataclass(frozen=True)
class Safeguards:
    """What the container checks around each optimizer step (``[commopt]`` common options)."""

    on_nonfinite: str = "skip"  # "skip" | "stop" | "off"
    check_replicas_every: int = 0  # 0 = never


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
            self.steps_taken = 0
            self._pending_params: dict[str, torch.Tensor] = {}
            self._validate_length(len(model_parts))
            all_params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
            # Optimizer.__init__ gives the container hooks; lr lives in the wrapped optimizers.
            torch.optim.Optimizer.__init__(self, all_params, {"lr": optimizers[0].defaults.get("lr", 0.0)})

        @property
        def owns_replicate_sync(self) -> bool:
            return self.resolved is not None

        def _named_params(self) -> list[tuple[str, nn.Parameter]]:
            return [(n, p) for m in self.model_parts for n, p in m.named_parameters() if p.requires_grad]

        def step(self, *args: Any, **kwargs: Any) -> None:
            guard = self.safeguards.on_nonfinite
            if guard != "off" and replica_state.any_nonfinite(p.grad for _, p in self._named_params()):
                self.skipped_steps += 1
                if guard == "stop":
                    raise FloatingPointError(
                        f"non-finite gradient at optimizer step {self.steps_taken + 1} on at least one rank "
                        "([commopt] on_nonfinite = \"stop\")"
                    )
            else:
                for optimizer in self.optimizers:
                    optimizer.step(*args, **kwargs)
            self.steps_taken += 1
            if self.fsdp_traffic is not None:
                self.fsdp_traffic.record(self.ledger)
            self.ledger.end_step()
            every = self.safeguards.check_replicas_every
            if every and self.steps_taken % every == 0 and self._replicas_in_sync():
                replica_state.check_replicas(self._named_params(), self.topology)

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
            flat[RESOLVED_KEY] = json.dumps(self.resolved.record(), sort_keys=True)
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
            with comm.use_ledger(comm.CommLedger()):
                super().load_state_dict(mine)

        @torch.no_grad()
        def _restore_params(self) -> None:
            for name, p in self._named_params():
                if name in self._pending_params:
                    p.data.copy_(self._pending_params[name])
            self._pending_params = {}

    return CommOptimizersContainer
