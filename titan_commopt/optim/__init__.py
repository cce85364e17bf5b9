"""Optimizer registry: ``[optimizer] name`` → family module + preset.

Each family module (``demo``, ``local_adaptive``, ``dion``) exposes:

- ``Config``: its options dataclass (the ``[commopt.<family>]`` TOML table, fields made with
  ``titan_commopt.options.option``);
- ``PRESETS``: ``{name: {option: value}}`` — the names it registers and what each preset sets;
- ``build(name, named_params, topology, hparams, cfg) -> torch.optim.Optimizer``;
- ``r_bytes_per_step(named_shapes, cfg, replicate_size) -> dict`` — the analytic R payload per
  rank per step (``{"sent": bytes, "recv": bytes}``, averaged over a sync period where periodic),
  the formula the ledger is tested against and the comm report prints;
- optionally ``check(cfg, hparams)``: cross-field rules of its options (raises ``ConfigError``),
  run by the config validation before any process group exists.

A preset supplies defaults: a key the user set to a value other than the family default wins.
"""

import dataclasses
import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.options import ConfigError
from titan_commopt.topology import R, Topology

from .common import BaseHParams, NamedParams, local

__all__ = ["FAMILIES", "family_module", "family_of", "available_names", "apply_preset", "build_optimizer", "broadcast_parameters"]

# family key (also the [commopt.<key>] table name) → module
FAMILIES: dict[str, str] = {
    "demo": "titan_commopt.optim.demo",
    "local": "titan_commopt.optim.local_adaptive",
    "dion": "titan_commopt.optim.dion",
}


def family_module(family: str) -> ModuleType:
    return importlib.import_module(FAMILIES[family])


def _names() -> dict[str, str]:
    return {name: family for family in FAMILIES for name in family_module(family).PRESETS}


def available_names() -> list[str]:
    """Every registered optimizer name, plus torchtitan's own baselines."""
    return ["AdamW", "Adam"] + sorted(_names())


def family_of(name: str) -> str:
    names = _names()
    if name not in names:
        raise ConfigError(
            f"[optimizer] name = {name!r}: allowed is one of {', '.join(available_names())}"
        )
    return names[name]


def apply_preset(name: str, cfg: Any) -> Any:
    """Fill in the preset of ``name`` wherever ``cfg`` still holds the family default."""
    module = family_module(family_of(name))
    defaults = module.Config()
    changes = {
        key: value
        for key, value in module.PRESETS[name].items()
        if getattr(cfg, key) == getattr(defaults, key)
    }
    return dataclasses.replace(cfg, **changes)


def build_optimizer(
    name: str, named_params: NamedParams, topology: Topology, hparams: BaseHParams, family_cfg: Any
) -> torch.optim.Optimizer:
    module = family_module(family_of(name))
    return module.build(name, named_params, topology, hparams, apply_preset(name, family_cfg))


@torch.no_grad()
def broadcast_parameters(
    params: list[nn.Parameter], topology: Topology, ledger: "comm.CommLedger | None" = None
) -> None:
    """Make every replica start from replica 0's parameters (one R broadcast per tensor).

    Optimizers that own the R sync shard parameters over S only, so each replica initializes its
    own copy; nothing else guarantees the copies agree.
    """
    for p in params:
        comm.broadcast(local(p.data), 0, R, topology.replicate, ledger=ledger)
