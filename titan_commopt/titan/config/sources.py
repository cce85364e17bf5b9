"""What the user wrote: the TOML file named by ``--job.config_file`` (read once per run) and the
``[commopt.<family>]`` keys set in it or on the command line, so that a preset fills only the others."""

from dataclasses import fields
from typing import Any, Optional

from titan_commopt.optim import FAMILIES
from titan_commopt.options import ConfigError

from .section import family_config

__all__ = ["config_file_of", "read_config_file", "user_set_keys", "given_options"]


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


def user_set_keys(argv: list[str], toml: dict) -> dict[str, set[str]]:
    """``{family: keys}`` the user set in ``[commopt.<family>]`` of the TOML or with
    ``--commopt.<family>.<key>`` (also ``--commopt.<family>.no-<key>`` / ``no_<key>`` for a false
    boolean, dashes for underscores). A preset fills every other key."""
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


def given_options(job_config: Any, family: str, user_keys: dict[str, set[str]]) -> dict[str, Any]:
    """The values of the keys the user set in ``[commopt.<family>]`` (as parsed by torchtitan);
    ``user_keys``: :func:`user_set_keys`."""
    table = family_config(job_config, family)
    return {key: getattr(table, key) for key in sorted(user_keys[family]) if hasattr(table, key)}
