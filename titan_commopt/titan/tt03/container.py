"""torchtitan 0.3's ``OptimizersContainer`` for our optimizers: a ``Configurable`` whose ``Config``
names the optimizer and carries the ``[commopt]`` options as typed fields.

``CommOptimizers.Config`` adds to torchtitan's optimizer config ``name`` (any registered
titan_commopt optimizer, or torchtitan's ``AdamW``/``Adam``), the generic hyper-parameters of the
``[optimizer]`` section of the 0.2.2 TOML (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``,
and ``warmup_steps`` for MT-DAO's switch) and ``commopt``: the ``[commopt]`` section's dataclass
(``config/section.py``), one typed sub-table per family. torchtitan's CLI parses them
(``--optimizer.name DiLoCo --optimizer.commopt.local.Kx 8``) and ``--help`` lists them.

The config checks itself as it is made (:func:`refuse_bad_options`: the family's preset fills every
key neither typed nor set to another value than the family default; bad values: one line each,
exit status 2, before any process group exists), and says whether our optimizer syncs R (``syncs_replicate``), which the
``fully_shard`` wrapper reads from the Trainer being built (``fsdp.py``). ``build(model_parts=...)``
then resolves it and builds the container as 0.2.2 does (``common/build.py``): one optimizer per
model part on the run's Topology (the parameters' meshes + the R mesh FSDP was kept off,
``common/mesh.py``), on this container's comm ledger, after the resume check against the
checkpoint settings of the Trainer being built (``building.py``). Everything else — clipping for
optimizers that own R, skipping non-finite steps, the drift check, the metrics, each replica's
checkpoint state and the ledger's totals — is the container both lines share
(``common/container.py``): the methods torchtitan 0.3 calls have the same names and meaning.
"""

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch
import tyro
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from titan_commopt import comm
from titan_commopt.optim import BaseHParams, Family, Resolved, family_of, owns_replicate_sync
from titan_commopt.options import ConfigError

from ..common.build import FsdpBytes, container_arguments, route_clipping
from ..common.container import CommOptimizersContainer
from ..common.mesh import ParameterMeshes, topology_of
from ..common.optimizers import itemsize
from ..config.checkpoint import CLI, CheckpointSettings, Spelling
from ..config.section import CommOpt
from ..config.sources import typed_family_keys
from ..config.torchtitan_keys import optimizer_value_problems
from ..config.validate import hparams_of, resolve_options
from ..platform.stop import stop_run
from . import fsdp
from .building import command_line_being_parsed, spelling_of, trainer_being_built

__all__ = ["CommOptimizers", "resolve_config", "refuse", "refuse_bad_options", "checkpoint_settings", "show_preset"]

BAD_INPUT = 2


def refuse(error: ConfigError) -> None:
    """Bad input: its line(s) once, exit status 2 on every rank."""
    stop_run(str(error), BAD_INPUT)


def _given(family: Family, config: "CommOptimizers.Config") -> dict[str, Any]:
    """The family options the user set: those typed (on the command line or in the override's
    JSON: ``config.typed``, whatever their value), those listed in ``set_keys``, and those a config
    function set to a value other than the family's default; the preset fills the rest."""
    table, defaults = getattr(config.commopt, family.key), family.options()
    shown = family.presets.get(config.shown_preset, {})  # written in by the config function, not set
    prefix = family.key + "."
    chosen = {k[len(prefix):] for k in config.typed if k.startswith(prefix)} | set(config.set_keys)
    return {f.name: getattr(table, f.name) for f in fields(table)
            if f.name in chosen or getattr(table, f.name) != shown.get(f.name, getattr(defaults, f.name))}


def show_preset(config: "CommOptimizers.Config") -> "CommOptimizers.Config":
    """``config`` with its optimizer's preset written into its family's table where that holds the
    family default, so that ``--help`` shows the values the run would use. They still count as not
    set (``shown_preset``): another name of the family (``--optimizer.name DeMo``) takes its own. A key
    in ``set_keys`` keeps its value (set on purpose to the family default, as MT-DAO's 8B ``switch_at = 0``)."""
    if owns_replicate_sync(config.name):
        family = family_of(config.name)
        table, defaults = getattr(config.commopt, family.key), family.options()
        preset = {k: v for k, v in family.presets[config.name].items()
                  if getattr(table, k) == getattr(defaults, k) and k not in config.set_keys}
        setattr(config.commopt, family.key, replace(table, **preset))
        config.shown_preset = config.name
    return config


def typed_on_command_line() -> list[str]:
    """``<family>.<key>`` of every ``--optimizer.commopt.<family>.<key>`` on the command line
    torchtitan is parsing (none outside that parse)."""
    args = command_line_being_parsed()
    if args is None:
        return []
    return sorted(f"{family}.{key}" for family, keys in typed_family_keys(args, "--optimizer.commopt").items()
                  for key in keys)


def checkpoint_settings(trainer_config: Any, optimizer_name: str, spelling: Spelling = CLI) -> Optional[CheckpointSettings]:
    """What the resume check reads of a 0.3 ``Trainer.Config``; None for a checkpointer other than
    torchtitan's DCP one (another layout)."""
    from torchtitan.components.checkpointer import CheckpointManager

    if not isinstance(trainer_config.checkpoint, CheckpointManager.Config):
        return None
    return CheckpointSettings.of_trainer_config(trainer_config, optimizer_name, spelling)


def resolve_config(config: "CommOptimizers.Config") -> Optional[Resolved]:
    """The resolved optimizer of ``config`` (``None`` for torchtitan's AdamW/Adam); ``ConfigError``
    lists every problem."""
    return resolve_options(config.name, config.commopt, hparams_of(config, config.warmup_steps),
                           lambda family: _given(family, config), found=optimizer_problems(config))


def optimizer_problems(config: "CommOptimizers.Config") -> list[str]:
    """The ``[optimizer]`` values of ``config`` that the TOML routes refuse too (a negative lr, ...),
    named by their command-line flags."""
    values = {key: getattr(config, key) for key in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    return optimizer_value_problems(values, lambda key: f"--optimizer.{key}")


def refuse_bad_options(config: "CommOptimizers.Config") -> None:
    """Bad options of ``config``: one line each, exit status 2 (:func:`refuse`). Called by the config
    itself as it is made (``__post_init__``, as torchtitan's own ``Trainer.Config`` checks itself):
    tyro makes it from the command line before any process group exists, and nothing of ours runs
    between that parse and torchtitan's ``Trainer``, which starts the process group first thing.
    Resolving is pure; the container resolves the config again to build."""
    try:
        resolve_config(config)
    except ConfigError as error:
        refuse(error)


class CommOptimizers(CommOptimizersContainer):
    """See the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: str = "FlexDeMo"
        """The optimizer: a titan_commopt name (FlexDeMo, DeMo, DES-LOC, MT-DAO, DiLoCo, LocalAdam, Dion,
        SparseLoCo, ...) or torchtitan's AdamW/Adam (HSDP syncs R for those)."""
        # [optimizer]'s knobs, with BaseHParams' defaults (one place for them)
        lr: float = BaseHParams.lr
        """Learning rate (a family's own lr, when >= 0, wins; else lr x its lr_scale)."""
        beta1: float = BaseHParams.beta1
        beta2: float = BaseHParams.beta2
        eps: float = BaseHParams.eps
        weight_decay: float = BaseHParams.weight_decay
        warmup_steps: int = BaseHParams.warmup_steps
        """The LR scheduler's warm-up steps (MT-DAO's switch at the end of warm-up reads it)."""
        commopt: CommOpt = field(default_factory=CommOpt)  # type: ignore[valid-type]
        """The [commopt] options: common ones plus one table per family (--optimizer.commopt.demo.topk 16)."""
        set_keys: list[str] = field(default_factory=list)
        """Family option keys the preset must not replace, besides those typed (a config function's
        keys set on purpose to the family default; a TOML's [commopt.<family>] keys)."""
        shown_preset: tyro.conf.Suppress[str] = ""
        """The optimizer whose preset a config function wrote into ``commopt`` for ``--help`` (not a
        flag; :func:`show_preset`): values equal to it count as not set."""
        typed: tyro.conf.Suppress[list[str]] = field(default_factory=list)
        """``<family>.<key>`` of each option the user typed (not a flag): read from the command line as
        it is parsed, or the override's JSON keys. A typed value is used even where it equals the family
        default; the preset fills only what was not typed."""
        _replica_group: tyro.conf.Suppress[Optional[Any]] = None
        """The live fault tolerance of the Trainer that builds this container (not a flag; its name keeps
        it out of the logged config): ``ReplicaGroupTraining``, set by ``ReplicaGroupTrainer`` before
        torchtitan's ``__init__``; an override that makes the config anew from this one keeps it."""

        @property
        def syncs_replicate(self) -> bool:
            """Whether the optimizer syncs R itself (FSDP2 then shards without dp_replicate: ``fsdp.py``)."""
            return owns_replicate_sync(self.name)

        def __post_init__(self) -> None:
            self.typed = sorted(set(self.typed) | set(typed_on_command_line()))
            refuse_bad_options(self)

    def __init__(self, config: "CommOptimizers.Config", *, model_parts: list[nn.Module]) -> None:
        try:
            resolved = resolve_config(config)
        except ConfigError as error:
            refuse(error)
        first = next((p for m in model_parts for p in m.parameters() if p.requires_grad), None)
        param_mesh = getattr(first, "device_mesh", None)
        owns_r = resolved is not None
        self._check_replicate(param_mesh, owns_r)
        trainer = trainer_being_built()
        self._check_fault_tolerance(trainer)
        ft = config._replica_group.group if config._replica_group is not None else None
        # AdamW/Adam: R is HSDP's dp_replicate on the parameters' mesh (its all-reduce is estimated).
        topology = topology_of(ParameterMeshes(param_mesh, fsdp.replicate_mesh() if owns_r else None), ft)
        seen = fsdp.seen
        super().__init__(**container_arguments(
            model_parts, name=config.name, resolved=resolved, topology=topology, commopt=config.commopt,
            checkpoint=None if trainer is None else checkpoint_settings(trainer.config, config.name, spelling_of(trainer)),
            dp_degree=None if trainer is None else trainer.parallel_dims.dp_replicate * trainer.parallel_dims.dp_shard,
            fsdp_bytes=FsdpBytes(
                param_bytes=itemsize(seen.param_dtype or torch.float32),
                reduce_bytes=itemsize(seen.reduce_dtype or torch.float32),
                gathers=1 if seen.reshard_after_forward is False else 2,
            ),
            stock_optimizers=lambda: self._stock_optimizers(config, model_parts), ledger=comm.CommLedger(),
        ))
        route_clipping(self)
        if ft is not None:
            self.attach_fault_tolerance(ft)

    @staticmethod
    def _check_fault_tolerance(trainer: Any) -> None:
        """torchtitan's own torchft Trainer (``FaultTolerantTrainer``) averages the gradients over the
        replica groups and brackets only its own container's step with the quorum: not ours."""
        manager = getattr(trainer, "ft_manager", None)
        if manager is not None and getattr(manager, "enabled", False):
            refuse(ConfigError(
                "fault_tolerance.enable under torchtitan's torchft Trainer (FaultTolerantTrainer) with a titan_commopt "
                "optimizer: that Trainer averages the gradients over the replica groups and commits only its own "
                "container's steps; run it with our config module (--module titan_commopt.titan.tt03.configs "
                "--config cpu_debugmodel or another, --fault_tolerance.* as there) or our TOML ([fault_tolerance])"))

    @staticmethod
    def _check_replicate(param_mesh: Any, owns_r: bool) -> None:
        """R must be synced once: by FSDP for AdamW/Adam, by our optimizer otherwise."""
        names = tuple(getattr(param_mesh, "mesh_dim_names", None) or ())
        hsdp_syncs_r = "dp_replicate" in names and param_mesh["dp_replicate"].size() > 1 and \
            not fsdp.seen.replicate_hidden
        if owns_r and hsdp_syncs_r and fsdp.seen.calls and fsdp.seen.leave_replicate:
            refuse(ConfigError(
                "parallelism.spmd_backend = 'full_dtensor' with data_parallel_replicate_degree > 1: the parameters "
                "carry dp_replicate in their mesh, so DTensor syncs R before our optimizer does; use "
                "'partial_dtensor' (or data_parallel_replicate_degree = 1)"))
        if owns_r and hsdp_syncs_r:
            refuse(ConfigError(
                "optimizer: the model was sharded with FSDP's own R (dp_replicate) sync, which our optimizer does "
                "itself: shard it inside a torchtitan Trainer whose optimizer config is ours (CommOptimizers.Config: "
                "a config function, or --override.imports), with titan_commopt.titan imported before"))
        if not owns_r and fsdp.seen.replicate_hidden and fsdp.replicate_mesh() is not None \
                and fsdp.replicate_mesh().size() > 1:
            refuse(ConfigError(
                "optimizer: torchtitan's AdamW/Adam needs FSDP's R sync, but the model was sharded for an "
                "optimizer that syncs R itself: one optimizer config per run"))

    @staticmethod
    def _stock_optimizers(config: "CommOptimizers.Config", model_parts: list[nn.Module]) -> list[torch.optim.Optimizer]:
        """torchtitan's own AdamW/Adam, as its container builds them."""
        groups_config = config.param_groups or [ParamGroupConfig(
            pattern=r".*", optimizer_name=config.name,
            optimizer_kwargs={"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
                              "weight_decay": config.weight_decay},
        )]
        impl = OptimizersContainer._build_impl_kwargs(config)
        out = []
        for model in model_parts:
            groups, _ = OptimizersContainer._build_param_groups(model, groups_config, impl)
            for name, param_groups in groups.items():
                out.append(OptimizersContainer._resolve_optimizer_factory(name)(param_groups))
        return out

    def init_cache_state_dict(self) -> None:
        """TorchFT's hook (torchtitan 0.3 calls it on every container): nothing to cache."""
