"""What the user wrote: the TOML file named by ``--job.config_file`` (read once per run) and the
``[commopt.<family>]`` keys set in it or on the command line, so that a preset fills only the others."""

from dataclasses import fields
from typing import Any, Optional

from titan_commopt.optim import FAMILIES
from titan_commopt.options import ConfigError

from .section import family_config

__all__ = ["config_file_of", "read_config_file", "user_set_keys", "typed_family_keys", "given_options"]


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
    for family, keys in typed_family_keys(argv, "--commopt").items():
        out[family] |= keys
    return out


def typed_family_keys(argv: list[str], prefix: str) -> dict[str, set[str]]:
    """``{family: keys}`` typed on the command line ``argv`` as ``<prefix>.<family>.<key>`` (``=`` or a
    separate word; ``no-<key>`` / ``no_<key>`` for a false boolean; dashes for underscores, as tyro
    accepts both): ``--commopt`` on 0.2.2 and our TOML, ``--optimizer.commopt`` on 0.3's command line."""
    out: dict[str, set[str]] = {family: set() for family in FAMILIES}
    for arg in argv:
        flag = arg.partition("=")[0]
        if not flag.startswith(prefix + "."):
            continue
        parts = flag[len(prefix) + 1:].replace("-", "_").split(".")
        if len(parts) != 2 or parts[0] not in out:
            continue
        family, key = parts
        if key.startswith("no_") and key[3:] in _option_names(family):
            key = key[3:]
        out[family].add(key)
    return out


def _option_names(family: str) -> set[str]:
    return {f.name for f in fields(FAMILIES[family].options)}


def given_options(job_config: Any, family: str, user_keys: dict[str, set[str]]) -> dict[str, Any]:
    """The values of the keys the user set in ``[commopt.<family>]`` (as parsed by torchtitan);
    ``user_keys``: :func:`user_set_keys`."""
    table = family_config(job_config, family)
    return {key: getattr(table, key) for key in sorted(user_keys[family]) if hasattr(table, key)}
