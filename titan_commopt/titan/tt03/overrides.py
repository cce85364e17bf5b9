"""torchtitan 0.3 ``@override``s: our optimizers (and our metrics) in any stock or user config.

    --override.imports 'titan_commopt.titan.tt03.overrides.commopt={"name": "FlexDeMo", "topk": 16}'

:func:`commopt` replaces the run's ``OptimizersContainer.Config`` by ours (``container.py``).
Its keyword arguments: ``name``; the ``[optimizer]`` hyper-parameters ``lr``, ``beta1``, ``beta2``,
``eps``, ``weight_decay`` (default: the replaced config's first param group's values),
``warmup_steps``; any option of the named optimizer's family (``[commopt.<family>]``, e.g. ``topk``)
or of ``[commopt]`` itself (e.g. ``on_nonfinite``). A family option given here is used as given,
even where it equals the family's default; the name's preset fills only the others. A bad name, key
or value: one line, exit status 2. Overrides are applied after the command line is parsed, so
options go in the JSON, not in ``--optimizer.*`` flags.

:func:`comm_metrics` swaps the metrics processor for ours, which adds ``comm/*`` and ``commopt/*``
to TensorBoard: ``--override.imports titan_commopt.titan.tt03.overrides.commopt
titan_commopt.titan.tt03.overrides.comm_metrics``. :func:`global_model_validation` swaps the
validator for ours (``validate.py``), which evaluates the global model of our optimizers (a
local-step family's replicas hold other parameters between syncs) with the run's validator settings.

On a CPU box torchtitan's stock configs also need the CPU fixes before the Trainer exists (an
override runs too late for them): name the stock config through our config module there
(``--module titan_commopt.titan.tt03.configs --config llama3_debugmodel``: ``configs.py``), whose
Trainer also tries the overrides on a copy of the config before the process group
(``preflight.py``).
"""

import dataclasses
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.validate import Validator
from torchtitan.config.override import derive, override

from titan_commopt.optim import family_of, owns_replicate_sync
from titan_commopt.options import ConfigError, check_keys

from ..config.section import CommOpt, CommonOptions
from ..platform.console import quiet_known_noise
from ..config.torchtitan_keys import optimizer_value_problems
from .container import CommOptimizers, refuse
from .metrics import CommMetricsProcessor
from .validate import GlobalModelValidator

__all__ = ["commopt", "comm_metrics", "global_model_validation"]

quiet_known_noise()  # torchtitan's CPU and offline-tokenizer warnings (``platform/console.py``)

_NAME = f"{__name__}.commopt"
_HPARAMS = ("lr", "beta1", "beta2", "eps", "weight_decay", "warmup_steps")
_COMMON = tuple(f.name for f in dataclasses.fields(CommonOptions))


def _stock_hparams(cfg: Any) -> dict[str, Any]:
    """The hyper-parameters of the config being replaced (its first param group)."""
    groups = getattr(cfg, "param_groups", None) or []
    kwargs = dict(groups[0].optimizer_kwargs) if groups else {}
    out = {k: kwargs[k] for k in ("lr", "eps", "weight_decay") if k in kwargs}
    if "betas" in kwargs:
        out["beta1"], out["beta2"] = (float(b) for b in kwargs["betas"])
    return out


@override(target=OptimizersContainer.Config, description="a titan_commopt optimizer, options as keyword arguments")
def commopt(cfg: Any, name: str = "FlexDeMo", **options: Any) -> CommOptimizers.Config:
    hparams = {**_stock_hparams(cfg), **{k: options.pop(k) for k in _HPARAMS if k in options}}
    common = {k: options.pop(k) for k in _COMMON if k in options}
    section = CommOpt(**common)
    typed: list[str] = []
    try:
        bad = optimizer_value_problems(hparams, lambda key: f"override {_NAME}: {key}")
        if bad:
            raise ConfigError("\n".join(bad))
        if options:
            if not owns_replicate_sync(name):
                raise ConfigError(f"override {name}: options {', '.join(sorted(options))}: torchtitan's "
                                  f"{name} takes none (allowed: {', '.join(_HPARAMS)})")
            family = family_of(name)
            unknown = check_keys(options, family.options, family.section)
            if unknown:
                raise ConfigError("\n".join(unknown))
            setattr(section, family.key, dataclasses.replace(getattr(section, family.key), **options))
            typed = sorted(f"{family.key}.{key}" for key in options)  # used as typed, even at the family default
        elif owns_replicate_sync(name):
            family_of(name)
    except ConfigError as error:
        refuse(error)
    return derive(cfg, CommOptimizers.Config, name=name, commopt=section, typed=typed, set_keys=[], shown_preset="",
                  **hparams,
                  implementation="for-loop" if cfg.implementation.startswith("fused") else cfg.implementation)


@override(target=MetricsProcessor.Config, description="comm/* and commopt/* scalars next to the loss")
def comm_metrics(cfg: Any) -> CommMetricsProcessor.Config:
    return derive(cfg, CommMetricsProcessor.Config)


@override(target=Validator.Config, description="the validator evaluates the global model")
def global_model_validation(cfg: Any) -> GlobalModelValidator.Config:
    return derive(cfg, GlobalModelValidator.Config)
