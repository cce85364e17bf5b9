"""The ``[commopt]`` TOML section: a JobConfig extension for ``--job.custom_config_module``.

``[commopt]`` holds options common to every family; each family's own options live in a sub-table
named after the family key of the registry (``[commopt.demo]``, ``[commopt.local]``,
``[commopt.dion]``), whose dataclass is the family's ``options``. On the command line:
``--commopt.demo.chunk 32``. :func:`user_set_keys` tells which keys the user set (TOML or command
line), so that a preset fills only the others.

No ``from __future__ import annotations`` here: torchtitan merges config classes by reading each
field's type as a class.
"""

import sys
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional

from titan_commopt.optim import FAMILIES
from titan_commopt.options import ConfigError, option


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
        "stop the run on every rank (one line naming the first that differs, exit status 1) if one "
        "differs (only at steps where the optimizer keeps replicas equal). 0 = off.", ge=0,
    )
    max_consecutive_skips: int = option(
        10, "Stop the run (one line, exit status 1) once this many optimizer steps in a row were skipped "
        "for a NaN/Inf gradient (on_nonfinite = \"skip\"): training cannot recover by itself. 0 = never "
        "stop.", ge=0,
    )


def _family_fields() -> list[tuple[str, type, Any]]:
    return [(key, family.options, field(default_factory=family.options)) for key, family in FAMILIES.items()]


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


# ---- which keys did the user set? ----------------------------------------------------------------
def config_file_of(argv: list[str]) -> Optional[str]:
    """The ``--job.config_file`` named on the command line (either spelling, ``=`` or a separate word)."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def read_config_file(path: Optional[str]) -> dict:
    """The TOML named by ``--job.config_file`` (``{}`` when none is named), or one line saying why not."""
    if path is None:
        return {}
    import os

    import tomli

    where = f"[job] config_file = {path!r}"
    if not path:
        raise ConfigError(f"{where}: allowed is the path of a TOML file")
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file")
    if os.path.isdir(path):
        raise ConfigError(f"{where}: is a directory, not a TOML file")
    try:
        with open(path, "rb") as handle:
            return tomli.load(handle)
    except tomli.TOMLDecodeError as error:
        raise ConfigError(f"{where}: not valid TOML ({error})") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where}: not valid TOML (not UTF-8 text: {error.reason})") from error
    except OSError as error:
        raise ConfigError(f"{where}: cannot be read ({error.strerror or error})") from error


def user_set_keys(argv: list[str], toml: Optional[dict] = None) -> dict[str, set[str]]:
    """``{family: keys}`` the user set in ``[commopt.<family>]`` of the TOML or with
    ``--commopt.<family>.<key>`` (also ``--commopt.<family>.no-<key>`` / ``no_<key>`` for a false
    boolean, dashes for underscores). A preset fills every other key."""
    toml = read_config_file(config_file_of(argv)) if toml is None else toml
    tables = toml.get("commopt", {})
    out = {family: set(tables.get(family, {})) for family in FAMILIES}
    for arg in argv:
        parts = arg.partition("=")[0].split(".")
        if len(parts) != 3 or parts[0] != "--commopt" or parts[1] not in out:
            continue
        key = parts[2]
        for negation in ("no-", "no_"):
            if key.startswith(negation) and key[len(negation):].replace("-", "_") in _option_names(parts[1]):
                key = key[len(negation):]
        out[parts[1]].add(key.replace("-", "_"))
    return out


def _option_names(family: str) -> set[str]:
    return {f.name for f in fields(FAMILIES[family].options)}


def given_options(job_config: Any, family: str, argv: list[str], toml: Optional[dict] = None) -> dict[str, Any]:
    """The values of the keys the user set in ``[commopt.<family>]`` (as parsed by torchtitan)."""
    table = family_config(job_config, family)
    return {key: getattr(table, key) for key in sorted(user_set_keys(argv, toml)[family]) if hasattr(table, key)}
