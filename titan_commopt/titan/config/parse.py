"""Command line + TOML → torchtitan's JobConfig, with every input mistake reported as one line.

torchtitan 0.2.2's ``ConfigManager`` answers a mistake in its input with a traceback (a missing or
malformed TOML file, an unknown section or key: ``ValueError: Invalid field names ...``) or with a
boxed tyro message (an unknown option, a bad value), and takes a TOML value of the wrong type as
it is (``mixed_precision_param = "bf16"`` surfaces much later as ``AttributeError: module 'torch'
has no attribute 'bf16'``). :func:`parse_job` checks its input first and raises
:class:`~titan_commopt.options.ConfigError` with one line per problem, each naming the key (or
file), the value and what is allowed:

- the config file: it exists, is a file, is TOML;
- every section and key of the TOML and every ``--section.key`` of the command line exists in the
  JobConfig (torchtitan's plus ``[commopt]``), else a did-you-mean;
- every TOML value (outside ``[commopt]``, which :mod:`titan_commopt.options` checks) and every
  command-line value has its field's type (``Literal`` choices included).

Booleans on the command line: tyro wants ``--section.key`` / ``--section.no-key``;
:func:`normalize_argv` also accepts ``--section.key true|false`` (and ``=true|false``), the form
``docs/options.md`` documents, for torchtitan's booleans and ours alike, by rewriting it to the
flag form before parsing; any other word after a boolean (``--commopt.demo.sign_before_sync
flase``) is reported with its key, not left to tyro (which calls it an unrecognized option).

``ConfigManager`` also needs our ``custom_config_module`` / ``custom_import`` (added by
:func:`plugin_args` when neither the command line nor the TOML names them).
"""

import difflib
import io
import re
import types
import typing
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import Field, dataclass, fields, is_dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Union

from titan_commopt.options import ConfigError

from .section import MODULE
from .sources import config_file_of, read_config_file

__all__ = [
    "CONFIG_MODULE", "CUSTOM_IMPORT", "ParsedJob", "parse_job", "plugin_args", "read_config_file", "normalize_argv",
    "config_class", "toml_problems", "cli_problems", "parse_with", "field_of", "type_matches", "type_text",
]

CONFIG_MODULE = MODULE
CUSTOM_IMPORT = "titan_commopt.titan"
OWN_SECTION = "commopt"  # validated by titan_commopt.options (bounds, choices, cross-field rules)

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _has_flag(argv: list[str], names: tuple[str, ...]) -> bool:
    return any(arg.partition("=")[0] in names for arg in argv)


def plugin_args(argv: list[str], toml: Mapping[str, Any]) -> list[str]:
    """``argv`` plus our config module and custom import unless the command line or TOML names them."""
    extra = []
    job, experimental = toml.get("job", {}), toml.get("experimental", {})
    job = job if isinstance(job, Mapping) else {}
    experimental = experimental if isinstance(experimental, Mapping) else {}
    if not _has_flag(argv, ("--job.custom_config_module", "--job.custom-config-module")) and not job.get(
        "custom_config_module"
    ):
        extra += ["--job.custom_config_module", CONFIG_MODULE]
    if not _has_flag(argv, ("--experimental.custom_import", "--experimental.custom-import")) and not experimental.get(
        "custom_import"
    ):
        extra += ["--experimental.custom_import", CUSTOM_IMPORT]
    return list(argv) + extra


def config_class(argv: list[str], toml: Mapping[str, Any]) -> type:
    """torchtitan's JobConfig merged with the ``custom_config_module`` that ``argv``/``toml`` name."""
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager()._maybe_add_custom_config(argv, dict(toml))
    except Exception as error:
        module = _cli_value(argv, "job.custom_config_module") or (toml.get("job") or {}).get("custom_config_module")
        raise ConfigError(
            f"[job] custom_config_module = {module!r}: cannot import it ({type(error).__name__}: {error})"
        ) from error


# ---- field types ---------------------------------------------------------------------------------
def _fields(cls: type) -> dict[str, Field]:
    return {f.name: f for f in fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and is_dataclass(tp)


def _arms(tp: Any) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def type_matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a JobConfig field's annotation."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return True
    if origin in (Union, types.UnionType):
        return any(type_matches(value, arm) for arm in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, list) and (not args or all(type_matches(v, args[0]) for v in value))
    if tp in (list, tuple):
        return isinstance(value, list)
    if origin is dict or tp is dict:
        return isinstance(value, Mapping)
    return True  # a type this check does not know: leave it to torchtitan


def type_text(tp: Any) -> str:
    """What a field of type ``tp`` allows, in words."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [arm for arm in typing.get_args(tp) if arm is not type(None)]  # None: TOML cannot say it
        if set(arms) == {float, int}:
            return "a number"
        return " or ".join(type_text(arm) for arm in arms)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        inner = {str: "strings", int: "integers", float: "numbers"}.get(args[0], "values") if args else "values"
        return f"a list of {inner}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(text: str, tp: Any) -> bool:
    """Whether tyro can read the command-line word ``text`` as a ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_convert(text, arm) for arm in typing.get_args(tp))
    if origin is Literal:
        return text in {str(c) for c in typing.get_args(tp)}
    if tp is type(None):
        return text == "None"
    if tp is int:
        try:
            int(text)
            return True
        except ValueError:
            return False
    if tp is float:
        try:
            float(text)
            return True
        except ValueError:
            return False
    return True  # str, lists (several words), anything else: tyro decides


def _takes_words(tp: Any) -> bool:
    """Whether a field reads several command-line words (a list, possibly in a union)."""
    return any(typing.get_origin(arm) in (list, tuple) or arm in (list, tuple) for arm in _arms(tp))


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, f in _fields(cls).items():
        if _is_section(f.type):
            out += _all_keys(f.type, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _did_you_mean(word: str, candidates: list[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else ""


# ---- the TOML ------------------------------------------------------------------------------------
def toml_problems(toml: Mapping[str, Any], cls: type) -> list[str]:
    """Unknown sections/keys (with a did-you-mean) and values of the wrong type, one line each."""
    known = _fields(cls)
    out: list[str] = []
    for section, table in toml.items():
        f = known.get(section)
        if f is None or not _is_section(f.type):
            close = _did_you_mean(section, [n for n, g in known.items() if _is_section(g.type)])
            hint = f"; did you mean [{close}]?" if close else ""
            out.append(f"[{section}]: unknown section{hint} (known: {', '.join(sorted(known))})")
        elif not isinstance(table, Mapping):
            out.append(f"[{section}] = {table!r}: allowed is a table ([{section}] with keys below it)")
        else:
            out += _table_problems(table, f.type, section)
    return out


def _table_problems(table: Mapping[str, Any], cls: type, section: str) -> list[str]:
    known = _fields(cls)
    out: list[str] = []
    for key, value in table.items():
        f = known.get(key)
        if f is None:
            close = _did_you_mean(key, list(known))
            hint = f"; did you mean {close!r}?" if close else ""
            out.append(f"[{section}] unknown key {key!r}{hint} (known: {', '.join(sorted(known))})")
        elif _is_section(f.type):
            if isinstance(value, Mapping):
                out += _table_problems(value, f.type, f"{section}.{key}")
            else:
                out.append(f"[{section}] {key} = {value!r}: allowed is a table ([{section}.{key}])")
        elif section.split(".")[0] != OWN_SECTION and not type_matches(value, f.type):
            out.append(f"[{section}] {key} = {value!r}: allowed is {type_text(f.type)}")
    return out


# ---- the command line ----------------------------------------------------------------------------
def field_of(cls: type, dotted: str) -> tuple[Optional[str], Optional[Field], bool]:
    """``dotted`` (``training.steps``, dashes allowed, ``no-`` before a boolean) → (canonical dotted
    name, its field, negated), or (None, None, False) when no such option exists."""
    parts = dotted.split(".")
    names = []
    for i, part in enumerate(parts):
        known = _fields(cls)
        name = part.replace("-", "_")
        last = i == len(parts) - 1
        negated = False
        if name not in known and last and name.startswith("no_") and name[3:] in known:
            name, negated = name[3:], True
        f = known.get(name)
        if f is None:
            return None, None, False
        names.append(name)
        if last:
            if _is_section(f.type) or (negated and f.type is not bool):
                return None, None, False
            return ".".join(names), f, negated
        if not _is_section(f.type):
            return None, None, False
        cls = f.type
    return None, None, False


def _cli_value(argv: list[str], dotted: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key.startswith("--") and key[2:].replace("-", "_") == dotted:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def normalize_argv(argv: list[str], cls: type) -> list[str]:
    """``--section.key true|false`` / ``--section.key=true|false`` for a boolean key → tyro's
    ``--section.key`` / ``--section.no-key``; every other word as it is."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        dotted, f, negated = field_of(cls, key[2:]) if key.startswith("--") else (None, None, False)
        if f is not None and f.type is bool and not negated:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in _TRUE + _FALSE:
                eq, value = "=", argv[i + 1]
                i += 1
            if eq and value.lower() in _TRUE + _FALSE:
                section, _, name = key[2:].rpartition(".")
                arg = key if value.lower() in _TRUE else f"--{section}.no-{name}"
        out.append(arg)
        i += 1
    return out


def cli_problems(argv: list[str], cls: type) -> list[str]:
    """Unknown options (with a did-you-mean) and values tyro could not read, one line each.
    ``argv`` is already normalized (:func:`normalize_argv`)."""
    out: list[str] = []
    keys = _all_keys(cls)
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg in ("--", "--help"):
            continue
        key, eq, value = arg.partition("=")
        dotted, f, negated = field_of(cls, key[2:])
        if f is None:
            close = _did_you_mean(key[2:].replace("-", "_"), keys)
            hint = f"; did you mean --{close}?" if close else ""
            out.append(f"command line: unknown option {key!r}{hint}")
            continue
        section, _, name = dotted.rpartition(".")
        if f.type is bool:
            # normalize_argv took every true/false; a word left after a boolean is a bad value
            # (tyro would call it an unrecognized option, without the key)
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            elif not eq:
                continue
            allowed = f"allowed is true or false (--{dotted} true|false, or the flags --{dotted} / --{section}.no-{name})"
            if negated:
                given = arg if eq else f"{key} {value}"
                out.append(f"[{section}] {name} (from {given}): {key} is a flag, it takes no value; {allowed}")
            else:
                out.append(f"[{section}] {name} = {value!r} (from {key}): {allowed}")
            continue
        if _takes_words(f.type):
            continue  # tyro reads the words; [commopt] lists are checked after parsing
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                out.append(f"[{section}] {name} (from {key}): needs a value, {type_text(f.type)}")
                continue
            value = argv[i + 1]
        if not _convert(value, f.type):
            out.append(f"[{section}] {name} = {value!r} (from {key}): allowed is {type_text(f.type)}")
    return out


# ---- tyro's own messages -------------------------------------------------------------------------
_BOX_SIDES = re.compile(r"[│╭╮╰╯]")
_RULE = re.compile(r"^[-─\s]*[-─]{3,}[-─\s]*$")
_TITLE = re.compile(r"^[A-Z][a-z]+( [a-z]+){0,3}$")  # "Value error", "Unrecognized options", ...


def _squash(text: str) -> str:
    """tyro's error (a box on a terminal, dashed rules otherwise) → its message, one line: the
    first section between rules that is not the title (the helptext after it is dropped)."""
    sections: list[list[str]] = [[]]
    for raw in text.splitlines():
        if raw.lstrip().startswith(("╭", "╰")):  # a border, possibly holding the title
            title = _BOX_SIDES.sub(" ", raw).replace("─", " ").strip()
            sections += [[title], []] if title else [[]]
            continue
        line = _BOX_SIDES.sub(" ", raw).strip()
        if _RULE.match(line):
            sections.append([])
        elif line:
            sections[-1].append(line)
    for section in sections:
        message = " ".join(section)
        if message and not _TITLE.match(message):
            return message
    return "tyro could not parse the command line"


# ---- the whole parse -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedJob:
    """A command line parsed: torchtitan's JobConfig, the argument list it was parsed from (with our
    config module and custom import added, booleans normalized) and the TOML file as read (once)."""

    job_config: Any
    args: list[str]
    toml: dict


def parse_job(argv: list[str]) -> ParsedJob:
    """Parse ``argv`` into torchtitan 0.2.2's JobConfig. Raises :class:`ConfigError` listing every
    input problem found before parsing."""
    return parse_with(argv, config_class, _torchtitan_parse, plugin_args)


def parse_with(
    argv: list[str],
    schema: Callable[[list[str], dict], type],
    parse: Callable[[type, list[str], dict], Any],
    add_args: Callable[[list[str], dict], list[str]] = lambda argv, toml: list(argv),
    more_problems: Callable[[dict, list[str], type], list[str]] = lambda toml, args, cls: [],
) -> ParsedJob:
    """The parse, whatever reads the arguments: the TOML read once, ``add_args`` (our plug-in's
    arguments), ``schema`` (the config class of the installed torchtitan), booleans normalized,
    every problem of the TOML and the command line listed (plus ``more_problems``), then
    ``parse(cls, args, toml)`` (tyro's own failures become one line)."""
    toml = read_config_file(config_file_of(argv))
    args = add_args(argv, toml)
    cls = schema(args, toml)
    args = normalize_argv(args, cls)
    found = more_problems(toml, args, cls) + toml_problems(toml, cls) + cli_problems(args, cls)
    if found:
        raise ConfigError("\n".join(found))
    captured = io.StringIO()
    try:
        with redirect_stderr(captured), redirect_stdout(captured):
            job_config = parse(cls, args, toml)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help: show what tyro printed
            print(captured.getvalue(), end="")
            raise
        raise ConfigError(f"command line: {_squash(captured.getvalue())}") from None
    except ConfigError:
        raise
    except Exception as error:  # torchtitan's own checks: keep their first line
        first = (str(error).strip().splitlines() or [""])[0]
        raise ConfigError(f"torchtitan refused the config: {type(error).__name__}: {first}") from error
    import sys

    sys.stderr.write(captured.getvalue())  # torchtitan's warnings, if any (minus the filtered noise)
    return ParsedJob(job_config, args, toml)


def _torchtitan_parse(cls: type, args: list[str], toml: dict) -> Any:
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(args)
