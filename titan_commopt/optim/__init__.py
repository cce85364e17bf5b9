"""The registry: ``[optimizer] name`` → a family value (``optim/family.py``) and one resolved config.

A new family is one module (or package) exposing ``FAMILY`` and one line in :data:`FAMILY_MODULES`;
a family defined outside this package is registered with ``register(FAMILY)``.
"""

import dataclasses
import difflib
import importlib
from typing import Any, Mapping, Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.options import ConfigError, check_keys, problems
from titan_commopt.topology import R, Topology

from .base import CommOptimizer
from .common import BaseHParams, NamedParams
from .common import local as local_tensor  # optim.local is the local-step families' package
from .family import Bytes, Family, Resolved, ShardShape

__all__ = [
    "FAMILIES", "FAMILY_MODULES", "register", "unregister", "NATIVE_NAMES", "family_of", "available_names",
    "resolve", "build_optimizer", "make", "broadcast_parameters", "owns_replicate_sync", "Family", "Resolved",
    "ShardShape", "Bytes", "CommOptimizer", "BaseHParams",
]

# The built-in families, in the order the docs and the [commopt] table list them: each names a module
# (or package) of optim/ whose FAMILY is registered at import. A new family is one line here.
FAMILY_MODULES = (
    "demo",
    "local.adaptive",
    "dion",
    "local.sparseloco",
    "muon",
)

FAMILIES: dict[str, Family] = {}  # key → family, every registered one

NATIVE_NAMES = ("AdamW", "Adam")  # torchtitan's own optimizers: HSDP syncs R for them


def register(family: Family) -> Family:
    """Add ``family`` to the registry: its ``[commopt.<key>]`` table and optimizer names are then
    everywhere a built-in family's are. Register before ``titan_commopt.titan`` is imported: the
    torchtitan config classes are made from the registry once, at import. A key or an optimizer name
    that is taken already is a ValueError."""
    if family.key in FAMILIES:
        raise ValueError(f"family key {family.key!r} is registered already")
    taken = sorted(set(family.presets) & set(available_names()))
    if taken:
        raise ValueError(f"family {family.key!r}: optimizer names {taken} are registered already")
    FAMILIES[family.key] = family
    return family


def unregister(key: str) -> Family:
    """Remove the family of ``key`` from the registry (a test's family, once the test is done)."""
    return FAMILIES.pop(key)


def owns_replicate_sync(name: str) -> bool:
    """Whether optimizer ``name`` syncs the replicas itself (every name but torchtitan's own)."""
    return name not in NATIVE_NAMES


def _names() -> dict[str, Family]:
    return {name: family for family in FAMILIES.values() for name in family.presets}


def available_names() -> list[str]:
    """Every registered optimizer name, plus torchtitan's own baselines."""
    return list(NATIVE_NAMES) + sorted(_names())


def family_of(name: str) -> Family:
    family = _names().get(name)
    if family is None:
        allowed = available_names()
        by_lower = {n.lower(): n for n in allowed}  # case-insensitive, as check_keys' did-you-mean
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
        hint = f"did you mean {by_lower[close[0]]!r}? " if close else ""
        raise ConfigError(f"[optimizer] name = {name!r}: {hint}allowed is one of {', '.join(allowed)}")
    return family


def resolve(
    name: str, given: Optional[Mapping[str, Any]] = None, hparams: Optional[BaseHParams] = None,
    *, kernels: str = "auto",
) -> Resolved:
    """The options ``name`` trains with: the family defaults, the preset of ``name`` on the keys the
    user did not set, the user's ``given`` keys; validated once (every problem, one line each).

    The effective learning rate is decided here, once: the family's ``lr`` when >= 0, else
    ``hparams.lr × lr_scale`` (the preset's recommended multiplier unless the user set one). It is
    stored as the returned ``hparams.lr``, which every builder reads, so no scale is applied twice.
    ``kernels`` is ``[commopt] kernels`` (see :func:`titan_commopt.kernels.use_triton`)."""
    family = family_of(name)
    given = dict(given or {})
    hparams = hparams if hparams is not None else BaseHParams()
    unknown = check_keys(given, family.options, family.section)
    if unknown:
        raise ConfigError("\n".join(unknown))
    options = dataclasses.replace(family.options(), **{**family.presets[name], **given})
    found = problems(options, family.section)
    if not found:  # cross-field rules assume each value is of the right kind
        found = family.check(options, hparams)
    if found:
        raise ConfigError("\n".join(found))
    lr = options.lr if options.lr >= 0 else hparams.lr * options.lr_scale
    return Resolved(
        name, family, options, dataclasses.replace(hparams, lr=lr), frozenset(given), hparams.lr, kernels
    )


def build_optimizer(
    named_params: NamedParams, topology: Topology, resolved: Resolved, *, ledger: "comm.CommLedger | None" = None
) -> CommOptimizer:
    optimizer = resolved.family.build(named_params, topology, resolved, ledger=ledger)
    if not isinstance(optimizer, CommOptimizer):
        raise TypeError(f"family {resolved.family.key!r} built a {type(optimizer).__name__}, not a CommOptimizer")
    return optimizer


def make(
    name: str, named_params: Any, topology: Optional[Topology] = None, hparams: Optional[BaseHParams] = None,
    *, ledger: "comm.CommLedger | None" = None, kernels: str = "auto", **options: Any,
) -> CommOptimizer:
    """Optimizer ``name`` outside torchtitan, as with ``torch.optim``: ``named_params`` as from
    ``model.named_parameters()``, ``options`` the ``[commopt.<family>]`` keys you set (the preset
    fills the rest), ``hparams`` the ``[optimizer]`` values, ``ledger`` where its bytes are recorded
    (default: ``comm.get_ledger()``), ``kernels`` as ``[commopt] kernels``."""
    resolved = resolve(name, options, hparams, kernels=kernels)
    return build_optimizer(list(named_params), topology or Topology.single(), resolved, ledger=ledger)


@torch.no_grad()
def broadcast_parameters(
    params: list[nn.Parameter], topology: Topology, ledger: "comm.CommLedger | None" = None
) -> None:
    """Make every replica start from replica 0's parameters (one R broadcast per tensor).

    Optimizers that own the R sync shard parameters over S only, so each replica initializes its
    own copy; nothing else guarantees the copies agree.
    """
    for p in params:
        comm.broadcast(local_tensor(p.data), 0, R, topology.replicate, ledger=ledger)


for _module in FAMILY_MODULES:  # the built-in families, registered once all above is defined
    register(importlib.import_module(f".{_module}", __name__).FAMILY)
del _module
