"""The torchtitan 0.3 ``Trainer`` whose ``__init__`` is running, found from inside it.

torchtitan 0.3 builds the model and the optimizer container inside ``Trainer.__init__`` and hands
neither the Trainer nor its config to what it calls there: ``fully_shard`` gets a module and a mesh
(``fsdp.py`` must know whether our optimizer syncs R, which the Trainer's optimizer config says),
the container its own config and the model parts (``container.py`` must check a resume against the
Trainer's checkpoint settings and data-parallel degree). No hook of 0.3 runs there with the
Trainer, and a Trainer subclass of ours cannot be relied on: ``--override.imports`` puts our
optimizer into a stock config, whose Trainer is torchtitan's own and imports us only inside its
``__init__``. :func:`trainer_being_built` therefore walks the call stack up to that ``__init__``.
(Live fault tolerance needs no walk: only our Trainer runs it, and it hands the container its
replica group in the optimizer config, ``replica_group_trainer.py``.)

Likewise, what the user typed on 0.3's command line (so that a typed value wins over a preset even
where it equals the family default) is known only to torchtitan's ``ConfigManager.parse_args``,
which hands tyro the arguments and gets the finished config back: our config's ``__post_init__``
runs inside that call, and :func:`command_line_being_parsed` reads the arguments from its frame.
These two are the only places the plug-in walks the call stack.

A Trainer may say how its user writes settings (:func:`spelling_of`): our TOML runner's does
(``tt03_toml/runner.py``), so that a refused resume names the TOML's keys; torchtitan's own is run
from 0.3's command line. :func:`overridden` is the config as the run will build it (its
``--override.imports`` applied to a copy), which the checks before the process group and the live
fault tolerance both read.
"""

import copy
import logging
import sys
from types import CodeType, FrameType
from typing import Any, Iterator, Optional

from ..config.checkpoint import CLI, Spelling

__all__ = ["trainer_being_built", "command_line_being_parsed", "looking_up_a_config", "spelling_of", "overridden"]


def _callers() -> Iterator[FrameType]:
    """The frames on the call stack, innermost first (from this module's own, which none of the walks
    below looks for)."""
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _running(code: CodeType) -> Optional[FrameType]:
    """The innermost frame on the call stack that runs ``code`` (a function's ``__code__``), or None."""
    return next((frame for frame in _callers() if frame.f_code is code), None)


def trainer_being_built() -> Optional[Any]:
    """The ``torchtitan.trainer.Trainer`` (or a subclass) whose ``__init__`` is on the call stack, or
    None (called outside a Trainer's construction)."""
    from torchtitan.trainer import Trainer

    for frame in _callers():
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and frame.f_code.co_name == "__init__":
            return candidate
    return None


def command_line_being_parsed() -> Optional[list[str]]:
    """The arguments torchtitan's ``ConfigManager.parse_args`` is parsing (its ``args``: the command
    line, or the list a caller handed it), when called from inside that parse; else None."""
    from torchtitan.config.manager import ConfigManager

    frame = _running(ConfigManager.parse_args.__code__)
    args = frame.f_locals.get("args") if frame is not None else None
    return list(args) if args is not None else None


def looking_up_a_config() -> bool:
    """Whether torchtitan's ``ConfigManager._load_config`` is on the call stack: it looks the
    ``--config`` name up on the config module (``getattr``) and calls what it finds with no argument."""
    from torchtitan.config.manager import ConfigManager

    return _running(ConfigManager._load_config.__code__) is not None


def spelling_of(trainer: Any) -> Spelling:
    """How the user of ``trainer`` writes settings (``settings_spelling``; default: 0.3's command line)."""
    return getattr(trainer, "settings_spelling", CLI)


def overridden(config: Any) -> tuple[Any, list[str]]:
    """``config`` with its ``--override.imports`` applied (to a copy; ``config`` itself when there are
    none), and the line of the first override that fails."""
    from torchtitan.config.override import apply_overrides

    if not config.override.imports:
        return config, []
    trial = copy.deepcopy(config)
    logging.disable(logging.INFO)  # the real application logs its [Override] lines
    try:
        apply_overrides(trial.override, trial)
    except (ValueError, ImportError, TypeError) as error:
        return config, [f"--override.imports: {error}"]
    finally:
        logging.disable(logging.NOTSET)
    return trial, []
