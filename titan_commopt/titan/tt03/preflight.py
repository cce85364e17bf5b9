"""The checks of a torchtitan 0.3 run that need its whole config, before any process group exists.

torchtitan 0.3 parses the command line into the config the config function returned
(``ConfigManager.parse_args``), calls ``config.build()``, and the ``Trainer`` it builds starts the
process group first thing; it checks little before that (a mesh that does not fit the processes is
a bare ``AssertionError`` after it, ``spmd_types`` on two processes fails deep inside FSDP, a
missing tokenizer is a ``FileNotFoundError``, a misspelled override target a ``ValueError``, and
``@override``\\ s run only after the process group exists). Our config functions therefore return a
:class:`CommOptTrainer.Config`: the same fields, built into :class:`CommOptTrainer`, which runs
:func:`preflight` before torchtitan's ``Trainer.__init__``:

- the ``--override.imports`` entries, applied to a copy of the config: an unknown target, or an
  override that refuses its options (ours: one line each), stops here;
- the mesh against ``WORLD_SIZE``, ``parallelism.spmd_backend``, the tokenizer directory and the
  datasets, worded as on the TOML routes (``config/torchtitan_keys.py``, ``common/data.py``);
- ``--fault_tolerance.*`` (``replica_group_trainer.py``): the checks of ``config/fault_tolerance_keys.py`` in the
  command line's spelling, and an optimizer config our container cannot commit with the quorum;
- ``--validator.*`` (``validate.py``): ``freq`` and ``steps`` below 1; a validator that reads the
  training dataset is one warning line.

Every problem is one line, exit status 2 (``stop_run``: once, by rank 0 or by
``python -m titan_commopt.run``). A stock config run with ``--module llama3`` builds torchtitan's own
Trainer: there our override's checks run when torchtitan applies it, after the process group.
"""

import os
import sys
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional

from torchtitan.trainer import Trainer

from titan_commopt.options import ConfigError

from ..common.data import dataset_problems
from ..config.checkpoint import CLI
from ..config.fault_tolerance_keys import LIGHTHOUSE_ENV, FtSettings, evaluation_problems, problems as ft_problems
from ..config.tokenizer_files import first_damaged, huggingface_files
from ..config.torchtitan_keys import data_parallel_degree, mesh_problems, spmd_backend_problems, world_size_from_env
from ..config.validate import checkpoint_to_load_problems
from .building import overridden
from .container import checkpoint_settings, refuse, resolve_config
from .replica_group_trainer import ReplicaGroupTrainer, committing_optimizer, uncommitting_optimizer
from .validate import validating_on_training_text, validator_problems

__all__ = [
    "CommOptTrainer", "ours", "preflight", "config_problems", "override_problems",
    "fault_tolerance_problems", "switch_problems", "choice_problems",
]


class CommOptTrainer(ReplicaGroupTrainer):
    """torchtitan 0.3's Trainer, with :func:`preflight` before it starts the process group (and live
    fault tolerance under ``--fault_tolerance.enable``: ``replica_group_trainer.py``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ReplicaGroupTrainer.Config):
        """``Trainer.Config`` (the same fields and command line, and torchtitan's torchft
        experiment's ``fault_tolerance``), built into :class:`CommOptTrainer`."""

    def __init__(self, config: "CommOptTrainer.Config") -> None:
        preflight(config)
        super().__init__(config)


def ours(cfg: Trainer.Config) -> CommOptTrainer.Config:
    """``cfg``'s fields in a :class:`CommOptTrainer.Config`."""
    if isinstance(cfg, CommOptTrainer.Config):
        return cfg
    return CommOptTrainer.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init})


def preflight(config: Any) -> None:
    """Every problem of ``config`` found without a process group: one line each, exit status 2."""
    as_run, problems = overridden(config)
    settings = FtSettings.of(getattr(as_run, "fault_tolerance", None))
    problems += config_problems(config, world_size_from_env(), settings) + fault_tolerance_problems(as_run, settings)
    if problems:
        refuse(ConfigError("\n".join(problems)))
    if os.environ.get("RANK", "0") == "0":  # once per run
        for line in validating_on_training_text(config):
            print(f"titan_commopt: warning: {line}", file=sys.stderr, flush=True)


def override_problems(config: Any) -> list[str]:
    """The ``--override.imports`` entries applied to a copy of ``config``: the line of the first that
    fails (an override of ours that refuses its options stops the run with its own lines)."""
    return overridden(config)[1]


def fault_tolerance_problems(config: Any, settings: Optional[FtSettings] = None) -> list[str]:
    """``--fault_tolerance.*`` of ``config`` (overrides applied; ``settings``: its ``fault_tolerance``,
    read from it unless given): torchtitan's torchft keys that cannot work, the lighthouse's address,
    the mesh, and an optimizer that cannot run under fault tolerance (a container that cannot commit
    with the quorum, or an evaluation that would need an R collective after a commit)."""
    settings = settings or FtSettings.of(getattr(config, "fault_tolerance", None))
    out = ft_problems(settings, dp_replicate=config.parallelism.data_parallel_replicate_degree,
                      lighthouse=os.environ.get(LIGHTHOUSE_ENV), spelling=CLI)
    if not settings.enable:
        return out
    optimizer = committing_optimizer(config.optimizer)
    if optimizer is None:
        return out + [uncommitting_optimizer(config.optimizer)]
    try:
        resolved = resolve_config(optimizer)
    except ConfigError:  # bad options: refused where the optimizer config is made
        return out
    validating = getattr(config.validator, "enable", False)
    return out + evaluation_problems(settings, resolved, validating, spelling=CLI)


def config_problems(config: Any, world_size: Any, ft: FtSettings = FtSettings()) -> list[str]:
    """The mesh against ``world_size`` (None: not checked), the SPMD backend, the tokenizer, the
    datasets and the checkpoint to load (``--checkpoint.load_step``, ``--checkpoint.initial_load_path``;
    ``ft``: the run's fault tolerance, whose groups each have a folder) of a 0.3 ``Trainer.Config``."""
    out = mesh_problems(config.parallelism, world_size) + spmd_backend_problems(config.parallelism, world_size)
    out += _tokenizer_problems(config)
    checkpoint = checkpoint_settings(config, getattr(config.optimizer, "name", ""))
    if checkpoint is not None:
        out += checkpoint_to_load_problems(checkpoint, ft)
    dp = data_parallel_degree(config.parallelism, world_size) or 1
    out += _data_problems("dataloader", config.dataloader, dp)
    if getattr(config.validator, "enable", False):
        out += validator_problems(config.validator) + _data_problems("validator.dataloader", config.validator.dataloader, dp)
    return out


def _tokenizer_problems(config: Any) -> list[str]:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not isinstance(config.tokenizer, HuggingFaceTokenizer.Config):
        return []  # another tokenizer reads what it reads
    path = config.hf_assets_path
    where = f"hf_assets_path = {path!r}"
    allowed = "allowed is a directory with tokenizer.json (HuggingFace)"
    if not os.path.isdir(path):
        return [f"{where}: {'not a directory' if os.path.exists(path) else 'no such directory'}; {allowed}"]
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return [f"{where}: holds no tokenizer.json; {allowed}"]
    problem = first_damaged(path, huggingface_files(path, chat_template=True))
    return [f"{where}: {problem}; {allowed}"] if problem else []


def _data_problems(section: str, dataloader: Any, dp: int) -> list[str]:
    dataset = getattr(dataloader, "dataset", None)
    if not dataset:
        return []  # a dataloader of another kind
    return [line.replace(f"[{section}] ", f"{section}.", 1)
            for line in dataset_problems(section, dataset, getattr(dataloader, "dataset_path", None), dp)]


def switch_problems(config: Any, args: list[str]) -> list[str]:
    """A boolean field given a value on the command line (``--metrics.enable_tensorboard false``):
    torchtitan 0.3's command line spells booleans as switches, and tyro's own error names no key."""
    out = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or not (eq or (i + 1 < len(args) and not args[i + 1].startswith("--"))):
            continue
        path = flag[2:].replace("-", "_").split(".")
        if not _is_switch(config, path):
            continue
        value = value if eq else args[i + 1]
        *parents, key = path
        key = key[3:] if key.startswith("no_") and not hasattr(_walk(config, parents), key) else key
        dotted = ".".join([*parents, key]).replace("_", "-")
        negated = ".".join([*parents, "no-" + key]).replace("_", "-")
        out.append(f"{arg if eq else flag + ' ' + value}: a switch on torchtitan 0.3's command line, which takes no "
                   f"value: --{dotted} (true) or --{negated} (false); underscores work too")
    return out


def choice_problems(config: Any, args: list[str]) -> list[str]:
    """A field of a fixed set of values (a ``Literal``, as ``--optimizer.commopt.local.outer``) given
    another on the command line: tyro's own error is a box of several lines."""
    out = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--"):
            continue
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                continue
            value = args[i + 1]
        choices = _choices(config, flag[2:].replace("-", "_").split("."))
        if choices and value not in [str(c) for c in choices]:
            out.append(f"{flag} = {value!r}: allowed is one of {', '.join(repr(c) for c in choices)}")
    return out


def _choices(config: Any, path: list[str]) -> tuple:
    """The values a ``Literal`` field at ``path`` of ``config`` allows; empty for any other field."""
    *parents, key = path
    parent = _walk(config, parents)
    if parent is None or not is_dataclass(parent):
        return ()
    try:
        hint = typing.get_type_hints(type(parent)).get(key)
    except (NameError, TypeError):  # an annotation that does not resolve here: tyro will say what it says
        return ()
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


def _walk(config: Any, path: list[str]) -> Any:
    for part in path:
        config = getattr(config, part, None)
    return config


def _is_switch(config: Any, path: list[str]) -> bool:
    *parents, key = path
    parent = _walk(config, parents)
    if parent is None:
        return False
    if key.startswith("no_") and not hasattr(parent, key):
        key = key[3:]
    return isinstance(getattr(parent, key, None), bool)
