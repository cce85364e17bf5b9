"""torchtitan → titan_commopt: meshes to Topology, parameters to optimizers, FSDP2 bytes estimated.

- :func:`parallelize` wraps a model's stock ``parallelize_fn``. For optimizers that own the
  replicate (R) sync it hides ``dp_replicate`` from it, so FSDP2 shards over ``fsdp`` only and
  HSDP's gradient all-reduce over R never happens (TORCHTITAN_NOTES.md §9: this, not
  ``set_requires_all_reduce(False)``, is what works). On CPU it makes FSDP2 reduce with SUM (gloo).
- :func:`build_optimizers` is the TrainSpec's ``build_optimizers_fn``. ``AdamW``/``Adam`` are
  torchtitan's own optimizers, untouched (the baseline); any other name comes from the registry in
  ``titan_commopt.optim`` with the options of its ``[commopt.<family>]`` table.
- :class:`CommOptimizersContainer` closes the comm ledger's step after every optimizer step and adds
  FSDP2's own collectives as labelled estimates, so every run has R and S figures.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import apply_preset, broadcast_parameters, build_optimizer, family_module, family_of
from titan_commopt.optim.common import BaseHParams
from titan_commopt.options import ConfigError, problems as option_problems
from titan_commopt.topology import R, S, Topology

from . import config
from .checkpoint import check_resume
from .cpu import force_sum_reduction, on_cpu

NATIVE_OPTIMIZERS = ("AdamW", "Adam")  # torchtitan's own; HSDP syncs R for them


def owns_replicate_sync(optimizer_name: str) -> bool:
    return optimizer_name not in NATIVE_OPTIMIZERS


class _ReplicateHidden:
    """A view of ``ParallelDims`` in which ``dp_replicate`` does not exist, for ``parallelize_fn``."""

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)

    @property
    def dp_replicate(self) -> int:
        return 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return False


def wrap_parallelize(stock: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        dims = parallel_dims
        if owns_replicate_sync(job_config.optimizer.name) and parallel_dims.dp_replicate_enabled:
            dims = _ReplicateHidden(parallel_dims)
        model = stock(model, dims, job_config)
        if on_cpu():
            force_sum_reduction(model)
        return model

    return parallelize


def topology_of(parallel_dims: Any) -> Topology:
    """The one place a torchtitan run's meshes become R/S/T (see ``Topology.from_parallel_dims``)."""
    return Topology.from_parallel_dims(parallel_dims, sums_over_replicas=True)


# ---- FSDP2's own traffic, estimated from parameter sizes ----------------------------------------
@dataclass(frozen=True)
class FsdpTraffic:
    """Per-rank payload per step of the collectives FSDP2/HSDP issue themselves (estimates)."""

    s_all_gather_sent: int = 0  # forward (+ backward re-gather) of the local parameter shards
    s_all_gather_recv: int = 0
    s_reduce_scatter: int = 0  # gradient reduce-scatter: (S-1)/S of the full gradient each way
    r_all_reduce: int = 0  # HSDP/DDP gradient all-reduce of the local shard over R (native only)

    def record(self, ledger: comm.CommLedger) -> None:
        if self.s_all_gather_sent:
            comm.record_estimate(S, "fsdp_all_gather", self.s_all_gather_sent, self.s_all_gather_recv, ledger=ledger)
        if self.s_reduce_scatter:
            comm.record_estimate(S, "fsdp_reduce_scatter", self.s_reduce_scatter, self.s_reduce_scatter, ledger=ledger)
        if self.r_all_reduce:
            comm.record_estimate(R, "hsdp_all_reduce", self.r_all_reduce, self.r_all_reduce, ledger=ledger)


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def local_parameter_numel(model_parts: list[nn.Module]) -> int:
    return sum(_local_numel(p) for m in model_parts for p in m.parameters() if p.requires_grad)


def adamw_hsdp_r_bytes(model_parts: list[nn.Module], replicate_size: int, reduce_bytes: int = 4) -> int:
    """R payload per rank per step of AdamW over HSDP/DDP: the all-reduce of the local fp32
    gradient shard (what ``comm/R_ratio_vs_adamw_hsdp`` divides by)."""
    return local_parameter_numel(model_parts) * reduce_bytes if replicate_size > 1 else 0


def estimate_fsdp_traffic(
    model_parts: list[nn.Module], topology: Topology, job_config: Any, native_r_sync: bool
) -> FsdpTraffic:
    numel = local_parameter_numel(model_parts)
    shards = topology.shard_size
    training = job_config.training
    param_bytes = torch.empty((), dtype=getattr(torch, training.mixed_precision_param)).element_size()
    reduce_bytes = torch.empty((), dtype=getattr(torch, training.mixed_precision_reduce)).element_size()
    gathers = 1 if job_config.parallelism.fsdp_reshard_after_forward == "never" else 2
    traffic = FsdpTraffic()
    if shards > 1:
        traffic = FsdpTraffic(
            s_all_gather_sent=gathers * numel * param_bytes,
            s_all_gather_recv=gathers * (shards - 1) * numel * param_bytes,
            s_reduce_scatter=(shards - 1) * numel * reduce_bytes,
        )
    if native_r_sync and topology.replicate_size > 1:
        traffic = dataclasses.replace(traffic, r_all_reduce=numel * reduce_bytes)
    return traffic


# ---- the container ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Safeguards:
    """What the container checks around each optimizer step (``[commopt]`` common options)."""

    on_nonfinite: str = "skip"  # "skip" | "stop" | "off"
    check_replicas_every: int = 0  # 0 = never


@functools.cache
def _container_cls() -> type:
    from torchtitan.components.optimizer import OptimizersContainer

    from titan_commopt import state as replica_state

    class _CommOptimizersContainer(OptimizersContainer):
        """torchtitan's container around our optimizers.

        Per ``step()``: a non-finite gradient on any rank makes every rank skip the step together
        (or stop); the optimizers step; FSDP2's estimated traffic is recorded and the ledger's step
        closed; every ``check_replicas_every`` steps the replicas' parameters are compared.

        Checkpoints (optimizers that own R): all optimizer state is saved under ``replica<r>/``
        keys, one copy per replica (``titan_commopt.state``); parameters too when the optimizer says
        they diverge between syncs (``params_replica_local``). torchtitan loads the model's flattened
        weights *after* the optimizer's state, so replica-local parameters are put back at the next
        ``zero_grad()``, the first thing a training step does.
        """

        def __init__(
            self,
            model_parts: list[nn.Module],
            optimizers: list[torch.optim.Optimizer],
            *,
            name: str,
            topology: Topology,
            fsdp_traffic: Optional[FsdpTraffic],
            adamw_reference_r_bytes: int,
            safeguards: Safeguards = Safeguards(),
        ) -> None:
            self.model_parts = model_parts
            self.optimizers = optimizers
            self.name = name
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
            return owns_replicate_sync(self.name)

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
            if every and self.steps_taken % every == 0 and self._replicas_should_agree():
                replica_state.check_replicas(self._named_params(), self.topology)

        def _replicas_should_agree(self) -> bool:
            return all(getattr(o, "replicas_in_sync", lambda: True)() for o in self.optimizers)

        def zero_grad(self, *args: Any, **kwargs: Any) -> None:
            if self._pending_params:
                self._restore_params()
            super().zero_grad(*args, **kwargs)

        # ---- checkpoints ----
        def _params_replica_local(self) -> bool:
            return any(getattr(o, "params_replica_local", False) for o in self.optimizers)

        def state_dict(self) -> dict[str, Any]:
            with comm.use_ledger(comm.CommLedger()):  # a lazy-state init may communicate
                flat = super().state_dict()
            if not self.owns_replicate_sync:
                return flat
            if self._params_replica_local():
                # A copy: on resume DCP loads into these tensors, and torchtitan then loads the
                # model's (replica 0's) weights into the parameters themselves.
                flat.update({f"param.{n}": p.detach().clone() for n, p in self._named_params()})
            flat["skipped_steps"] = self.skipped_steps
            flat["steps_taken"] = self.steps_taken
            return replica_state.add_replica_prefix(flat, self.topology.replica_index)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if not self.owns_replicate_sync:
                with comm.use_ledger(comm.CommLedger()):
                    super().load_state_dict(state_dict)
                return
            mine = replica_state.take_replica(state_dict, self.topology.replica_index)
            self.skipped_steps = int(mine.pop("skipped_steps", 0))
            self.steps_taken = int(mine.pop("steps_taken", 0))
            self._pending_params = {k[len("param."):]: mine.pop(k) for k in list(mine) if k.startswith("param.")}
            with comm.use_ledger(comm.CommLedger()):
                super().load_state_dict(mine)

        @torch.no_grad()
        def _restore_params(self) -> None:
            for name, p in self._named_params():
                if name in self._pending_params:
                    p.data.copy_(self._pending_params[name])
            self._pending_params = {}

    return _CommOptimizersContainer


def hparams_of(optimizer_config: Any) -> BaseHParams:
    return BaseHParams(
        lr=optimizer_config.lr,
        beta1=optimizer_config.beta1,
        beta2=optimizer_config.beta2,
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
    )


# Settings of torchtitan that the optimizers owning R have not been built or tested for: refused
# rather than silently wrong. (key path, the value that is refused, why)
_UNSUPPORTED_WITH_OWN_R_SYNC = (
    ("optimizer.early_step_in_backward", True, "the optimizer must step once per step, after backward"),
    ("parallelism.pipeline_parallel_degree", lambda v: v > 1, "pipeline parallelism is not supported yet"),
    ("parallelism.expert_parallel_degree", lambda v: v > 1, "expert parallelism is not supported yet"),
    ("training.enable_cpu_offload", True, "FSDP CPU offload is not supported yet"),
    ("fault_tolerance.enable", True, "torchft replicas would bypass the optimizer's own R sync"),
)


def _lookup(job_config: Any, path: str) -> Any:
    value = job_config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def validate_commopt(job_config: Any) -> None:
    """Check ``[optimizer] name``, every ``[commopt]`` value, the chosen family's cross-field rules
    and combinations with torchtitan settings. Raises ``ConfigError``, one line per problem; touches
    no process group."""
    name = job_config.optimizer.name
    section = config.commopt_of(job_config)
    problems = option_problems(section, "commopt")
    if owns_replicate_sync(name):
        family = family_of(name)  # unknown names fail here, listing what exists
        for path, refused, why in _UNSUPPORTED_WITH_OWN_R_SYNC:
            value = _lookup(job_config, path)
            if (refused(value) if callable(refused) else value == refused):
                section_name, key = path.rsplit(".", 1)
                problems.append(f"[{section_name}] {key} = {value!r} with [optimizer] name = {name!r}: {why}")
        check = getattr(family_module(family), "check", None)
        if check is not None and not problems:
            try:
                check(apply_preset(name, config.family_config(job_config, family)), hparams_of(job_config.optimizer))
            except ConfigError as error:
                problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: Any, ft_manager: Any = None
) -> Any:
    """``build_optimizers_fn`` of our TrainSpecs."""
    job_config = config.current()
    name = optimizer_config.name
    topology = topology_of(parallel_dims)
    native = not owns_replicate_sync(name)
    check_resume(job_config, not native, topology.replicate_size)
    if native:
        from torchtitan.components.optimizer import build_optimizers as stock_build

        optimizers = list(stock_build(model_parts, optimizer_config, parallel_dims, ft_manager))
    else:
        validate_commopt(job_config)
        family = family_of(name)
        setup = comm.CommLedger()  # the initial broadcast is not a training step's traffic
        optimizers = []
        for model in model_parts:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            broadcast_parameters([p for _, p in named], topology, ledger=setup)
            optimizers.append(
                build_optimizer(
                    name, named, topology, hparams_of(optimizer_config), config.family_config(job_config, family)
                )
            )
    commopt = config.commopt_of(job_config)
    traffic = (
        estimate_fsdp_traffic(model_parts, topology, job_config, native_r_sync=native)
        if commopt.hsdp_estimates
        else None
    )
    return _container_cls()(
        model_parts,
        optimizers,
        name=name,
        topology=topology,
        fsdp_traffic=traffic,
        adamw_reference_r_bytes=adamw_hsdp_r_bytes(model_parts, topology.replicate_size),
        safeguards=Safeguards(
            on_nonfinite=commopt.on_nonfinite, check_replicas_every=commopt.check_replicas_every
        ),
    )
