"""Stopping a run on purpose: one line for the user, printed once, and an exit status.

A resume we refuse (``titan/config/resume.py``) or a run that cannot go on (``[commopt]
max_consecutive_skips`` in ``common/safeguards.py``) is decided alike on every rank. Each rank raises
:class:`RunStopped`; only global rank 0 prints the message, as one line on stderr. It is a
``SystemExit``: torchtitan's ``main`` and torch.distributed.elastic's ``@record`` let it through
without a traceback, so the worker exits with ``status`` and the line above is the whole story.

Under torchrun every rank also records the line in its elastic error file (:func:`record_for_launcher`;
the pre-flight check of ``titan_commopt.train`` does the same): torchrun's failure summary shows it
in its ``traceback :`` fields, and ``python -m titan_commopt.run`` prints it instead of that summary,
last on the console, and exits with the worker's status (rank 0 then leaves the printing to it).
"""

import json
import os
import sys
import time
from typing import Any, NoReturn, Optional

from titan_commopt.launch_env import LAUNCHER_ENV

__all__ = [
    "RunStopped", "stop_run", "RESUME_REFUSED", "TRAINING_STOPPED", "LAUNCHER_ENV", "record_for_launcher",
    "recorded_stop",
]

RESUME_REFUSED = 2  # the checkpoint does not fit this run's settings: nothing was trained
TRAINING_STOPPED = 1  # training went on until a safeguard stopped it
_MARK = "titan_commopt_status"  # in the error file's extraInfo: the line is ours, the worker exits with it


class RunStopped(SystemExit):
    """``SystemExit(status)`` carrying the one-line ``message`` rank 0 printed."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(status)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message


def record_for_launcher(text: str, status: int) -> bool:
    """Write ``text`` (our lines) to torchrun's error file for this worker (``TORCHELASTIC_ERROR_FILE``):
    torchrun's failure summary shows it, ``titan_commopt.run`` prints it. Returns whether it did
    (there is no error file outside torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as handle:
            extra = {"py_callstack": text, "timestamp": str(int(time.time())), _MARK: status}
            json.dump({"message": {"message": text, "extraInfo": extra}}, handle)
        return True
    except OSError:
        return False


def recorded_stop(failure: Any) -> Optional[tuple[str, int]]:
    """``(lines, exit status)`` a failed worker recorded with :func:`record_for_launcher`, or None
    (``failure``: torchrun's ``ProcessFailure``)."""
    message = failure.message
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    text = message.get("message")
    if extra.get(_MARK) is None or not isinstance(text, str) or failure.exitcode != extra.get(_MARK):
        return None
    return text, failure.exitcode


def announce(text: str, status: int) -> None:
    """Print ``text`` once: on global rank 0, unless ``titan_commopt.run`` prints it from the error file."""
    recorded = record_for_launcher(text, status)
    if _global_rank() == 0 and not (os.environ.get(LAUNCHER_ENV) and recorded):
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def stop_run(message: str, status: int) -> NoReturn:
    """Print ``message`` once (see :func:`announce`; each of its lines prefixed, as one problem per
    line) and raise :class:`RunStopped` on this rank. Call it on every rank alike (the decision must
    be the same everywhere)."""
    announce("\n".join(f"titan_commopt: {line}" for line in message.splitlines() or [""]), status)
    raise RunStopped(message, status)
