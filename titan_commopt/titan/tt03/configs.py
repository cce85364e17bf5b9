"""Our config module for torchtitan 0.3: ``--module titan_commopt.titan.tt03.configs --config <name>``.

Config functions (each returns a ``CommOptTrainer.Config``: torchtitan's ``Trainer.Config`` whose
Trainer checks the whole config before it starts the process group, ``preflight.py``; every field
stays a command-line flag, the optimizer's options included: ``--optimizer.name DiLoCo
--optimizer.commopt.local.Kx 8``; ``--help`` lists them):

- ``cpu_debugmodel``: llama3 ``debugmodel`` for a CPU box, FlexDeMo, the bundled corpus and a
  tokenizer trained on it (built at first use into the cache, no internet: ``assets.py``), every
  CPU fix applied (``cpu.py``), 2 replicas (× the rest of the processes as FSDP shards),
  seq 256 × batch 4, 4 steps, ``comm/*`` in the metrics, TensorBoard on (``<dump_folder>/tb``), the
  global model's held-out loss after step 1 and every 20 steps (4 batches per rank, the bundled
  corpus's held-out twin: ``validate.py``)::

      python -m titan_commopt.run --standalone --nproc_per_node=2 -m torchtitan.train \\
          --module titan_commopt.titan.tt03.configs --config cpu_debugmodel

- ``cpu_debugmodel_adamw``: the same with torchtitan's own optimizer config and container (AdamW,
  HSDP syncs R): the baseline, and a stock config for ``--override.imports``;
- ``llama3_8b_flexdemo``, ``llama3_8b_diloco``, ``llama3_8b_dion``, ``llama3_8b_des_loc``,
  ``llama3_8b_mt_dao``, ``llama3_8b_muon``, ``llama3_8b_muloco``, ``llama3_8b_muloco_2bit``: llama3 8B
  on GPUs, as ``train_configs/llama3_8b_*.toml``
  (2 replicas × 8-way FSDP, seq 8192, bf16 parameters, fp32 reduce, ``hf_assets_path =
  ./assets/hf/Llama-3.1-8B``, dataset c4; ``--validator.enable`` evaluates the global model on
  c4's validation split).

- any config function of torchtitan's models by its name (``--config llama3_debugmodel``):
  :func:`stock`, the CPU fixes and, where the stock asset paths are missing, the bundled tokenizer
  and corpus (its optimizer is torchtitan's: add ours with ``--override.imports``).

An unknown ``--config`` name is one line listing the config functions of this module (``__dir__``
gives only those: torchtitan lists ``dir(module)``), exit status 2.

For a config module of your own: :func:`commopt_optimizer` (our optimizer's config, to assign to
``cfg.optimizer``) and :func:`apply_cpu_fixes` (a config made to run on CPU/gloo; a no-op where an
accelerator exists).
"""

import dataclasses
import functools
import sys
from typing import Any, Optional

from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import config_registry as _llama3  # not as names: --config <name> looks names up here
from torchtitan.trainer import Trainer

from titan_commopt.options import ConfigError

from ..common.data import CORPUS_NAME, HELD_OUT
from ..config.section import CommOpt
from ..platform.console import quiet_known_noise
from .assets import dataset_dir, tokenizer_dir
from .building import command_line_being_parsed, looking_up_a_config
from .container import CommOptimizers, refuse, show_preset
from .cpu import apply_cpu_fixes
from .metrics import CommMetricsProcessor
from .preflight import CommOptTrainer, choice_problems, ours, switch_problems
from .validate import GlobalModelValidator, with_global_model_validation

quiet_known_noise()  # torchtitan's CPU and offline-tokenizer warnings (``platform/console.py``)

__all__ = [
    "commopt_optimizer", "apply_cpu_fixes", "with_comm_metrics", "cpu_debugmodel", "cpu_debugmodel_adamw", "llama3_8b_flexdemo",
    "llama3_8b_diloco", "llama3_8b_dion", "llama3_8b_des_loc", "llama3_8b_mt_dao", "llama3_8b_muon", "llama3_8b_muloco",
    "llama3_8b_muloco_2bit", "stock",
]


def commopt_optimizer(
    name: str = "FlexDeMo", commopt: Optional[Any] = None, *, lr: float = 8e-4, beta1: float = 0.9,
    beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1, warmup_steps: int = 0,
    implementation: str = "for-loop", set_keys: tuple[str, ...] = (),
) -> CommOptimizers.Config:
    """Optimizer ``name`` (ours, or torchtitan's AdamW/Adam) with ``commopt`` (a ``CommOpt``: the
    ``[commopt]`` options; default: every family's defaults, the name's preset on top) and the
    ``[optimizer]`` hyper-parameters. The preset fills the family's keys left at their default,
    except those typed on the command line and ``set_keys`` (keys set on purpose to the default,
    e.g. a TOML's ``[commopt.<family>]`` keys). Bad values: one line each, exit status 2."""
    return CommOptimizers.Config(
        name=name, commopt=commopt if commopt is not None else CommOpt(), lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps, implementation=implementation,
        set_keys=list(set_keys),
    )


def with_comm_metrics(cfg: Trainer.Config) -> Trainer.Config:
    """``cfg`` with our metrics processor (``comm/*`` and ``commopt/*`` scalars), its settings kept."""
    fields = {f.name: getattr(cfg.metrics, f.name) for f in dataclasses.fields(cfg.metrics) if f.init}
    cfg.metrics = CommMetricsProcessor.Config(**fields)
    return cfg


def _cpu(name: Optional[str]) -> Trainer.Config:
    """``name``: our container with that optimizer; ``None``: torchtitan's own config and container."""
    cfg = _llama3.llama3_debugmodel()
    cfg.hf_assets_path = str(tokenizer_dir())
    cfg.dataloader.dataset_path = str(dataset_dir())
    cfg.training.seq_len = 256
    cfg.training.local_batch_size = 4
    cfg.training.steps = 4
    if name is not None:
        cfg.optimizer = show_preset(commopt_optimizer(name, warmup_steps=cfg.lr_scheduler.warmup_steps))
    # the global model's loss on the bundled corpus's held-out twin (never trained on), as the CPU TOMLs
    cfg.validator = GlobalModelValidator.Config(
        enable=True, freq=20, steps=4,
        dataloader=HuggingFaceTextDataLoader.Config(dataset_path=str(dataset_dir(HELD_OUT[CORPUS_NAME]))))
    cfg.metrics.enable_tensorboard = True  # under <dump_folder>/tb (torchtitan logs the folder at start)
    cfg.parallelism.data_parallel_replicate_degree = 2  # R = 2: the optimizer syncs it (2 procs: DDP-like, 4: HSDP 2x2)
    return _checked(apply_cpu_fixes(with_comm_metrics(cfg)))


def cpu_debugmodel() -> Trainer.Config:
    return _cpu("FlexDeMo")


def cpu_debugmodel_adamw() -> Trainer.Config:
    return _cpu(None)


def _llama3_8b(name: str, lr: float = 1e-4, *, weight_decay: float = 0.1, warmup_steps: int = 200,
               **tables: dict[str, Any]) -> Trainer.Config:
    """llama3 8B with optimizer ``name``; ``tables``: the keys of ``[commopt.<family>]`` set as the 8B TOML
    sets them, each kept even where it equals the family default (a TOML's keys are: ``set_keys``)."""
    cfg = _llama3.llama3_8b()
    cfg.lr_scheduler.warmup_steps = warmup_steps
    cfg.training.max_norm = 1.0
    cfg.training.mixed_precision_param = "bfloat16"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.parallelism.data_parallel_replicate_degree = 2
    cfg.parallelism.data_parallel_shard_degree = 8
    cfg.parallelism.spmd_backend = "partial_dtensor"  # spmd_types: fully_shard refuses it on torch 2.13
    cfg.checkpoint.enable = True
    cfg.debug.seed = 42
    cfg.dump_folder = f"./outputs/llama3_8b_{name}"
    set_keys = tuple(key for table in tables.values() for key in table)
    cfg.optimizer = show_preset(commopt_optimizer(name, _options(**tables), lr=lr, weight_decay=weight_decay,
                                                  warmup_steps=warmup_steps, implementation="foreach",
                                                  set_keys=set_keys))
    return _checked(with_global_model_validation(with_comm_metrics(cfg)))  # --validator.enable: the global model


def _checked(cfg: Trainer.Config) -> CommOptTrainer.Config:
    """``cfg`` as a config whose Trainer runs our pre-flight checks (``preflight.py``), after the
    command line being parsed is checked for what tyro would refuse without naming the key, or in a box
    of several lines (a value given a switch, a value outside a ``Literal``'s). Colour
    codes only where the output is a terminal (``python -m titan_commopt.run`` sends it to files)."""
    if not sys.stdout.isatty():
        cfg.metrics.disable_color_printing = True
    args = command_line_being_parsed()
    problems = [] if args is None else switch_problems(cfg, args) + choice_problems(cfg, args)
    if problems:
        refuse(ConfigError("\n".join(problems)))
    return ours(cfg)


def _options(**tables: dict[str, Any]) -> Any:
    commopt = CommOpt()
    for key, values in tables.items():
        setattr(commopt, key, dataclasses.replace(getattr(commopt, key), **values))
    return commopt


def llama3_8b_flexdemo() -> Trainer.Config:
    return _llama3_8b("FlexDeMo", demo={"lr": 1e-4})


def llama3_8b_diloco() -> Trainer.Config:
    return _llama3_8b("DiLoCo", local={"lr": 3e-4}, lr=3e-4)


def llama3_8b_dion() -> Trainer.Config:
    return _llama3_8b("Dion", dion={"lr": 1e-2}, lr=1e-2)


def llama3_8b_des_loc() -> Trainer.Config:
    return _llama3_8b("DES-LOC", local={"lr": 3e-4}, lr=3e-4)


def llama3_8b_mt_dao() -> Trainer.Config:
    return _llama3_8b("MT-DAO", local={"lr": 3e-4, "switch_at": 0}, lr=3e-4)


# The Muon names as train_configs/llama3_8b_{muon,muloco,muloco_2bit}.toml: the Muon lr 1e-2 in the family's
# table (the routed AdamW parameters at it too), MuLoCo's weight decay 0.01 and warm-up of 500 steps.
def llama3_8b_muon() -> Trainer.Config:
    return _llama3_8b("Muon", muon={"lr": 1e-2}, lr=3e-4, weight_decay=0.01, warmup_steps=500)


def llama3_8b_muloco() -> Trainer.Config:
    return _llama3_8b("MuLoCo", local={"lr": 1e-2}, lr=3e-4, weight_decay=0.01, warmup_steps=500)


def llama3_8b_muloco_2bit() -> Trainer.Config:
    return _llama3_8b("MuLoCo-2bit", sparseloco={"lr": 1e-2}, lr=3e-4, weight_decay=0.01, warmup_steps=500)


# ---- torchtitan's stock configs, made to run here; the names torchtitan may list ------------------
def stock(name: str) -> Trainer.Config:
    """torchtitan's own config function ``name`` (any model's ``config_registry``, e.g.
    ``llama3_debugmodel``), with the CPU fixes applied (a no-op where an accelerator exists) and,
    where the stock tokenizer or dataset path does not exist on this machine (``./tests/assets/*``
    ship only in torchtitan's source tree), the bundled tokenizer and corpus (``assets.py``); its
    optimizer stays torchtitan's: add ours with ``--override.imports``. Our pre-flight checks run
    before its Trainer starts the process group. On the command line: ``--config <name>`` on this
    module."""
    import os

    function = _stock_function(name)
    if function is None:
        raise ConfigError(f"--config {name!r}: no such config function in {__name__} or in torchtitan's models "
                          f"({', '.join(_stock_modules())}); {_ALLOWED}")
    cfg = function()
    if not os.path.exists(cfg.hf_assets_path):
        cfg.hf_assets_path = str(tokenizer_dir())
    dataloader = cfg.dataloader
    if getattr(dataloader, "dataset", None) == "c4_test" and not os.path.exists(dataloader.dataset_path or _C4_TEST):
        dataloader.dataset_path = str(dataset_dir())  # the bundled corpus, in c4_test's JSON layout
    return _checked(apply_cpu_fixes(cfg))


_C4_TEST = "tests/assets/c4_test"  # where torchtitan's c4_test reads by default (its source tree)
CONFIG_FUNCTIONS = tuple(n for n in __all__ if n.startswith(("cpu_", "llama3_8b_")))  # --config names of ours
_ALLOWED = f"allowed is one of {', '.join(CONFIG_FUNCTIONS)}, or a stock one such as llama3_debugmodel"


def _stock_modules() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models)


def _stock_function(name: str) -> Optional[Any]:
    """torchtitan's config function ``name`` from the first model whose ``config_registry`` has it."""
    import importlib

    if name.startswith("_"):
        return None
    for model in _stock_modules():
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        function = getattr(registry, name, None)
        if callable(function) and getattr(function, "__module__", None) == registry.__name__:
            return function
    return None


def __getattr__(name: str) -> Any:
    """``--config <stock name>``: :func:`stock`'s config of it; an unknown ``--config`` name: one line,
    exit status 2 (only when torchtitan's ConfigManager looks the name up)."""
    if name.startswith("__") or not looking_up_a_config():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _stock_function(name) is None:
        try:
            stock(name)
        except ConfigError as error:
            refuse(error)
    return lambda: stock(name)


def _helper(function: Any) -> Any:
    """``function``, a helper of this module rather than a config function: torchtitan's ConfigManager
    (``_load_config``) finds it by name on ``--config <its name>`` and calls it with no argument, which
    is one line, exit status 2, instead of a ``TypeError`` or a config of the wrong kind. Called by
    anyone else, it is ``function`` itself."""

    @functools.wraps(function)
    def called(*args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and looking_up_a_config():
            refuse(ConfigError(f"--config {function.__name__!r}: a helper of {__name__}, not a config function; "
                               f"{_ALLOWED}"))
        return function(*args, **kwargs)

    return called


commopt_optimizer, apply_cpu_fixes, with_comm_metrics, stock = (
    _helper(f) for f in (commopt_optimizer, apply_cpu_fixes, with_comm_metrics, stock))


def __dir__() -> list[str]:
    """The config functions (torchtitan lists what ``dir`` gives when a ``--config`` is not found)."""
    return list(CONFIG_FUNCTIONS)
