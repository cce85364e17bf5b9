"""torchtitan 0.3's Trainer as one replica group of a fault-tolerant run (what both lines run alike:
``common/replica_group_training.py``).

A 0.3 user turns it on as torchtitan 0.3's own torchft experiment spells it: the Trainer config's
``fault_tolerance`` field is torchtitan's ``TorchFTManager.Config``
(``torchtitan.experiments.torchft``), so on our config module's command line::

    TORCHFT_LIGHTHOUSE=http://<head node>:29510 python -m titan_commopt.run --nproc_per_node=2 \\
        -m torchtitan.train --module titan_commopt.titan.tt03.configs --config cpu_debugmodel \\
        --parallelism.data_parallel_replicate_degree 1 \\
        --fault_tolerance.enable --fault_tolerance.replica_id 0 --fault_tolerance.group_size 2

(``process_group``, ``process_group_timeout_ms``, ``min_replica_size`` as torchtitan documents them;
``semi_sync_method`` is refused: torchft's DiLoCo/LocalSGD wrap torchtitan's optimizer, ours own R),
and from our TOML on 0.3 with the TOML's ``[fault_tolerance]`` keys, as on 0.2.2. Each replica
group is its own launch; R is the replica groups, joined by torchft's Manager.

:class:`ReplicaGroupTrainer` is torchtitan 0.3's Trainer with that field (the Trainer of our
config functions, ``preflight.CommOptTrainer``, and of our TOML runner derive from it). With
``fault_tolerance.enable`` it reads the settings once into a ``ReplicaGroupTraining``, which runs the
group's start, steps, data and end as on 0.2.2 (``ReplicaGroupSteps``), and wires into the config
what 0.3 builds from it:

- the group's own checkpoint folder and its part of the data (:func:`group_shard`);
- the optimizer container: ours, handed the group's fault tolerance in its config
  (``CommOptimizers.Config._replica_group``, :func:`carrying`; kept when an ``--override.imports``
  makes ours of the config); torchtitan's own AdamW/Adam runs inside it (:func:`committing_optimizer`), its step
  applied only once the quorum commits, with FSDP's gradient all-reduce over the quorum: torchtitan's
  own way;
- our metrics processor (``metrics.py``), which logs a step once, when it commits, and writes each
  group's TensorBoard under ``replica_<id>``.

The config's checks (before any process group) are the TOML route's (``config/validate.py``) or
the config module's (``preflight.py``), worded for each.
"""

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import tyro
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive
from torchtitan.trainer import Trainer

from ..platform.console import quiet_known_noise

quiet_known_noise()  # before torchft's first import, which reads RUST_LOG once
from torchtitan.experiments.torchft.manager import TorchFTManager  # noqa: E402

from titan_commopt.options import ConfigError  # noqa: E402

from ..common.replica_group_training import ReplicaGroupSteps, ReplicaGroupTraining  # noqa: E402
from ..config.fault_tolerance_keys import FtSettings  # noqa: E402
from ..config.section import CommOpt  # noqa: E402
from .building import overridden  # noqa: E402
from .container import CommOptimizers, refuse  # noqa: E402
from .metrics import CommMetricsProcessor  # noqa: E402

__all__ = [
    "ReplicaGroupTrainer", "with_fault_tolerance", "commopt_section", "group_shard", "committing_optimizer",
    "carrying", "uncommitting_optimizer", "STOCK_NAMES",
]

STOCK_NAMES = ("AdamW", "Adam")  # torchtitan's own optimizers our container runs under fault tolerance


class ReplicaGroupTrainer(ReplicaGroupSteps, Trainer):
    """torchtitan 0.3's Trainer, one replica group of a fault-tolerant run when its config's
    ``fault_tolerance.enable`` is set (module docstring); torchtitan's own Trainer otherwise."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: TorchFTManager.Config = field(default_factory=TorchFTManager.Config)
        """torchft: one replica group of a fault-tolerant run (torchtitan's torchft experiment's keys)."""

    def __init__(self, config: Any) -> None:
        ft = self.fault_tolerance = ReplicaGroupTraining.of(
            FtSettings.of(getattr(config, "fault_tolerance", None)), lambda: commopt_section(config))
        if ft is not None:
            config.checkpoint.folder = ft.checkpoint_folder(config.checkpoint.folder)
            config.dataloader = group_shard(config.dataloader, ft)
            config.optimizer = carrying(committing_optimizer(config.optimizer) or config.optimizer, ft)
            if type(config.metrics) is MetricsProcessor.Config:  # a step is logged once, when it commits
                config.metrics = derive(config.metrics, CommMetricsProcessor.Config)
            if isinstance(config.metrics, CommMetricsProcessor.Config):
                config.metrics._replica_id = ft.replica_id
        super().__init__(config)
        if ft is not None and getattr(self.optimizers, "ft", None) is None:
            # torchtitan's own container: a config preflight.py did not check (our TOML's route)
            refuse(ConfigError(uncommitting_optimizer(self.config.optimizer)))


def commopt_section(config: Any) -> CommOpt:
    """The ``[commopt]`` options of ``config``'s optimizer (its ``ft_*`` keys), as the run will build
    it (``--override.imports`` applied, on a copy: torchtitan applies them after the process group
    exists); the defaults for torchtitan's own optimizer config."""
    optimizer = config.optimizer
    if config.override.imports:
        optimizer = overridden(config)[0].optimizer
    commopt = getattr(optimizer, "commopt", None)
    return commopt if isinstance(commopt, CommOpt) else CommOpt()


def with_fault_tolerance(cfg: Trainer.Config) -> ReplicaGroupTrainer.Config:
    """``cfg``'s fields in a :class:`ReplicaGroupTrainer.Config` (fault tolerance off until set)."""
    if isinstance(cfg, ReplicaGroupTrainer.Config):
        return cfg
    return ReplicaGroupTrainer.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init})


def group_shard(dataloader: Any, ft: ReplicaGroupTraining) -> Any:
    """``dataloader`` (a dataloader config) whose ``build`` reads replica group ``ft.replica_id``'s
    part of the data (``ReplicaGroupTraining.data_shard``). 0.3's Trainer builds the dataloader with
    its own mesh's data-parallel degree and rank, which under fault tolerance span one group."""
    base = type(dataloader)

    @dataclass(kw_only=True, slots=True)
    class GroupShard(base):  # type: ignore[valid-type, misc]
        def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
            dp_world_size, dp_rank = ft.data_shard(dp_world_size, dp_rank)
            return base.build(self, dp_world_size=dp_world_size, dp_rank=dp_rank, **kwargs)

    GroupShard.__name__ = GroupShard.__qualname__ = base.__qualname__  # what the config log shows
    return GroupShard(**{f.name: getattr(dataloader, f.name) for f in fields(dataloader) if f.init})


def carrying(optimizer: Any, ft: ReplicaGroupTraining) -> Any:
    """``optimizer`` (an optimizer config) handing ``ft`` to the container built from it: ours holds it
    in its ``_replica_group`` field. Another kind is refused (``preflight.py``) unless an
    ``--override.imports`` makes ours of it after the process group exists, whose ``derive`` copies the
    fields it shares with the config it replaces: such a config becomes one of a subclass that has the
    field."""
    if not isinstance(optimizer, CommOptimizers.Config):
        base = type(optimizer)

        @dataclass(kw_only=True, slots=True)
        class Carrying(base):  # type: ignore[valid-type, misc]
            _replica_group: tyro.conf.Suppress[Optional[Any]] = None

        Carrying.__name__ = Carrying.__qualname__ = base.__qualname__  # what the config log shows
        optimizer = Carrying(**{f.name: getattr(optimizer, f.name) for f in fields(optimizer) if f.init})
    optimizer._replica_group = ft
    return optimizer


def uncommitting_optimizer(optimizer: Any) -> str:
    """The line that refuses ``optimizer`` (a config :func:`committing_optimizer` has no answer for)."""
    kind = type(optimizer).__qualname__
    names = sorted({g.optimizer_name for g in getattr(optimizer, "param_groups", None) or []}) or [kind]
    return (f"--fault_tolerance.enable with the optimizer config {kind} ({', '.join(names)}): under fault "
            f"tolerance each step is applied only once the quorum commits, which titan_commopt's container does; "
            f"allowed is one of ours (--optimizer.name on a config of titan_commopt.titan.tt03.configs, or "
            f"--override.imports titan_commopt.titan.tt03.overrides.commopt) or torchtitan's "
            f"{' or '.join(STOCK_NAMES)}")


def committing_optimizer(optimizer: Any) -> Optional[CommOptimizers.Config]:
    """The optimizer config of a fault-tolerant run: ours as it is; torchtitan's own
    ``OptimizersContainer.Config`` of AdamW or Adam (one optimizer for every param group) as ours
    with the same param groups (torchtitan's optimizers in our container, which applies a step only
    once the quorum commits); ``None`` for anything else (``preflight.py`` refuses it)."""
    if isinstance(optimizer, CommOptimizers.Config):
        return optimizer
    if type(optimizer) is not OptimizersContainer.Config:
        return None
    names = {group.optimizer_name for group in optimizer.param_groups} or {"AdamW"}
    if len(names) != 1 or not names <= set(STOCK_NAMES):
        return None
    return CommOptimizers.Config(
        name=names.pop(), param_groups=list(optimizer.param_groups), implementation=optimizer.implementation,
        optimizer_factory_kwargs_by_name=dict(optimizer.optimizer_factory_kwargs_by_name),
    )
