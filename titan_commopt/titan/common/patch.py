"""Replacing a torchtitan function that torchtitan looks up on its module at every call, once.

Where torchtitan gives no hook, it calls a module-level function we must see: 0.2.2 and 0.3 clip
through ``torchtitan.distributed.utils.clip_grad_norm_`` (``clipping.py``); 0.3's parallelize
functions shard through ``torchtitan.distributed.fsdp.fully_shard`` (``tt03/fsdp.py``).
:func:`wrap_once` puts a wrapper in its place, marked so that a second install (a second import, a
second run in one process) wraps nothing twice."""

import functools
from types import ModuleType
from typing import Any, Callable

__all__ = ["wrap_once"]

_MARK = "_titan_commopt"


def wrap_once(module: ModuleType, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """``module.name`` = ``make(original)`` (with the original's name and docstring), unless it is
    ours already. Returns whether it wrapped."""
    original = getattr(module, name)
    if getattr(original, _MARK, False):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(module, name, wrapper)
    return True
