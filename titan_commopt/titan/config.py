"""The ``[commopt]`` TOML section: a JobConfig extension for ``--job.custom_config_module``.

``[commopt]`` holds options common to every family; each family's own options live in a sub-table
named after the family key of the registry (``[commopt.demo]``, ``[commopt.local]``,
``[commopt.dion]``), whose dataclass is the family module's ``Config``. On the command line:
``--commopt.demo.chunk 32``.

No ``from __future__ import annotations`` here: torchtitan merges config classes by reading each
field's type as a class.
"""

import importlib
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional

from titan_commopt.optim import FAMILIES
from titan_commopt.options import option


@dataclass
class CommonOptions:
    """Options shared by all families (the ``[commopt]`` table itself)."""

    hsdp_estimates: bool = option(
        True, "Record FSDP2's own collectives (S all-gather/reduce-scatter, HSDP's R all-reduce) as "
        "estimated bytes from parameter sizes."
    )
    on_nonfinite: str = option(
        "skip", "A NaN/Inf gradient on any rank: every rank skips that optimizer step (skip), the job "
        "stops with an error (stop), or nothing is checked (off).", choices=("skip", "stop", "off"),
    )
    check_replicas_every: int = option(
        0, "Every N optimizer steps, compare a fingerprint of every parameter across replicas (R) and "
        "fail naming the first that differs (only at steps where the optimizer keeps replicas equal). "
        "0 = off.", ge=0,
    )


def _family_fields() -> list[tuple[str, type, Any]]:
    out = []
    for family, module_name in FAMILIES.items():
        cls = importlib.import_module(module_name).Config
        out.append((family, cls, field(default_factory=cls)))
    return out


CommOpt = make_dataclass(
    "CommOpt",
    [(f.name, f.type, f) for f in fields(CommonOptions)] + _family_fields(),
    bases=(CommonOptions,),
)
CommOpt.__doc__ = "The [commopt] section: common options plus one sub-table per optimizer family."


@dataclass
class JobConfig:
    commopt: CommOpt = field(default_factory=CommOpt)  # type: ignore[valid-type]


MODULE = __name__  # what --job.custom_config_module must name

_current: Optional[Any] = None


def set_current(job_config: Any) -> None:
    """Remember the parsed job config: torchtitan's ``build_optimizers_fn`` is not given it."""
    global _current
    _current = job_config


def current(argv: Optional[list[str]] = None) -> Any:
    """The job config of this run: the one ``titan_commopt.train`` parsed, else re-parsed from
    ``sys.argv`` (when launched through ``torchtitan.train`` with our custom import)."""
    if _current is not None:
        return _current
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(sys.argv[1:] if argv is None else argv))


def commopt_of(job_config: Any) -> Any:
    section = getattr(job_config, "commopt", None)
    if section is None:
        raise RuntimeError(
            f"the job config has no [commopt] section: pass --job.custom_config_module {MODULE}"
        )
    return section


def family_config(job_config: Any, family: str) -> Any:
    return getattr(commopt_of(job_config), family)
