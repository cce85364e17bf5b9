"""The torchtitan 0.3 paths of earlier releases, kept working: ``--module titan_commopt.titan.v03.configs``
and ``--override.imports titan_commopt.titan.v03.overrides.*`` forward to ``titan_commopt.titan.tt03``
after one line on stderr naming the new path."""

import os
import sys

__all__ = ["announce_moved"]


def announce_moved(old: str, new: str) -> None:
    """One line on stderr (global rank 0 only: every rank imports the module) naming ``new``."""
    if os.environ.get("RANK", "0") == "0":
        print(f"titan_commopt: {old} is deprecated and will be removed: use {new} (the same names)",
              file=sys.stderr, flush=True)
