"""Stopping a run on purpose: one line for the user, printed once, and an exit status.

A resume we refuse (``titan/checkpoint.py``) or a run that cannot go on (``[commopt]
max_consecutive_skips`` in ``titan/container.py``) is decided alike on every rank. Each rank raises
:class:`RunStopped`; only global rank 0 prints the message, as one line on stderr. It is a
``SystemExit``: torchtitan's ``main`` and torch.distributed.elastic's ``@record`` let it through
without a traceback, so the worker exits with ``status`` and the line above is the whole story.
"""

import os
import sys
from typing import NoReturn

__all__ = ["RunStopped", "stop_run", "RESUME_REFUSED", "TRAINING_STOPPED"]

RESUME_REFUSED = 2  # the checkpoint does not fit this run's settings: nothing was trained
TRAINING_STOPPED = 1  # training went on until a safeguard stopped it


class RunStopped(SystemExit):
    """``SystemExit(status)`` carrying the one-line ``message`` rank 0 printed."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(status)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def stop_run(message: str, status: int) -> NoReturn:
    """Print ``message`` once (global rank 0) and raise :class:`RunStopped` on this rank.
    Call it on every rank alike (the decision must be the same everywhere)."""
    if _global_rank() == 0:
        print(f"titan_commopt: {message}", file=sys.stderr, flush=True)
    raise RunStopped(message, status)
