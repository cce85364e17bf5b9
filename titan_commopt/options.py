"""Declarative options with one validator for all of them.

Each optimizer family declares its ``[commopt.<family>]`` options as a dataclass whose fields are
made with :func:`option`, carrying their allowed values in the field metadata; a field with a fixed
set of values is annotated ``Literal[...]`` (as torchtitan's own config is), and the annotation is
where its choices are read from (:func:`field_meta`). :func:`validate`
checks any such dataclass (recursively) and reports every bad value as one line naming the key,
the value and what is allowed. Unknown keys get a did-you-mean (:func:`check_keys`).

Modules that define option dataclasses must not use ``from __future__ import annotations``:
torchtitan's config manager reads ``dataclasses.Field.type`` as a real class to merge sections.
"""

import difflib
import math
from dataclasses import Field, field, fields, is_dataclass
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence, get_args, get_origin

__all__ = ["ConfigError", "option", "field_meta", "validate", "check_keys", "resolve_auto_period"]


class ConfigError(ValueError):
    """A bad ``[commopt]`` value: the message has one line per problem."""


def option(
    default: Any,
    help: str,
    *,
    choices: Optional[Sequence[Any]] = None,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
    auto: "bool | str" = False,
    kind: Optional[type] = None,
) -> Any:
    """A dataclass field with validation metadata.

    ``kind`` defaults to ``type(default)`` (``float`` also accepts ints); ``auto=True`` additionally
    accepts the string ``"auto"`` (periods resolved from a half-life), ``auto="<word>"`` that word
    (e.g. ``"warmup"``: a step count taken from another section).
    """
    meta = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "auto": auto,
        "kind": kind or type(default),
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def field_meta(f: Field) -> Mapping[str, Any]:
    """``f``'s validation metadata, with the choices of a ``Literal[...]`` annotation."""
    meta = f.metadata
    if get_origin(f.type) is Literal and meta.get("choices") is None:
        choices = get_args(f.type)
        meta = {**meta, "choices": choices, "kind": type(choices[0])}
    return meta


def allowed_text(meta: "Mapping[str, Any] | Field") -> str:
    if isinstance(meta, Field):
        meta = field_meta(meta)
    parts = []
    kind = meta["kind"]
    if meta["choices"] is not None:
        parts.append("one of " + ", ".join(repr(c) for c in meta["choices"]))
    else:
        name = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list"}.get(
            kind, getattr(kind, "__name__", str(kind))
        )
        bounds = []
        if meta["gt"] is not None:
            bounds.append(f"> {meta['gt']:g}")
        if meta["ge"] is not None:
            bounds.append(f">= {meta['ge']:g}")
        if meta["lt"] is not None:
            bounds.append(f"< {meta['lt']:g}")
        if meta["le"] is not None:
            bounds.append(f"<= {meta['le']:g}")
        parts.append(name + (" " + " and ".join(bounds) if bounds else ""))
    if meta["auto"]:
        parts.append(f'or "{_word(meta)}"')
    return " ".join(parts)


def _word(meta: Mapping[str, Any]) -> str:
    """The one string an ``auto`` option accepts besides its kind."""
    return "auto" if meta["auto"] is True else meta["auto"]


def _check_value(value: Any, meta: Mapping[str, Any]) -> bool:
    if meta["auto"] and value == _word(meta):
        return True
    kind = meta["kind"]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is bool:
        ok = isinstance(value, bool)
    elif kind is list:
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, kind)
    if not ok:
        return False
    if meta["choices"] is not None:
        if kind is list:
            return all(v in meta["choices"] for v in value)
        return value in meta["choices"]
    if kind in (int, float):
        if meta["ge"] is not None and not value >= meta["ge"]:
            return False
        if meta["gt"] is not None and not value > meta["gt"]:
            return False
        if meta["le"] is not None and not value <= meta["le"]:
            return False
        if meta["lt"] is not None and not value < meta["lt"]:
            return False
    return True


def problems(obj: Any, section: str) -> list[str]:
    """Every bad value of an options dataclass (recursing into nested ones), one line each."""
    out: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{section}.{f.name}"
        if is_dataclass(value):
            out.extend(problems(value, key))
            continue
        if "kind" not in f.metadata:
            continue
        meta = field_meta(f)
        if not _check_value(value, meta):
            out.append(f"[{section}] {f.name} = {value!r}: allowed is {allowed_text(meta)}")
    return out


def validate(obj: Any, section: str) -> None:
    """Raise :class:`ConfigError` listing every bad value (one line each) of ``obj``."""
    errors = problems(obj, section)
    if errors:
        raise ConfigError("\n".join(errors))


def check_keys(given: Mapping[str, Any], cls: type, section: str) -> list[str]:
    """Unknown keys of a TOML table against dataclass ``cls``, with a did-you-mean, recursively."""
    known = {f.name: f for f in fields(cls)}
    out: list[str] = []
    for key, value in given.items():
        if key not in known:
            by_lower = {k.lower(): k for k in known}
            close = difflib.get_close_matches(key.lower(), list(by_lower), n=1)
            hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
            out.append(
                f"[{section}] unknown key {key!r}{hint} (known: {', '.join(sorted(known))})"
            )
            continue
        sub = known[key].type
        if is_dataclass(sub) and isinstance(value, Mapping):
            out.extend(check_keys(value, sub, f"{section}.{key}"))
    return out


def resolve_auto_period(period: Any, beta: float) -> int:
    """``"auto"`` → the power of two nearest to the half-life ln 0.5 / ln β (DES-LOC §3)."""
    if period != "auto":
        return int(period)
    if not 0.0 < beta < 1.0:
        raise ConfigError(f'period "auto" needs a decay beta in (0, 1), got {beta!r}')
    half_life = math.log(0.5) / math.log(beta)
    exponent = round(math.log2(max(half_life, 1.0)))
    return int(2**exponent)


def iter_option_fields(cls: type) -> Iterable[Any]:
    return (f for f in fields(cls) if "kind" in f.metadata)
