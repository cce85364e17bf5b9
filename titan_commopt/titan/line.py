"""Which torchtitan line is installed: ``"0.2"`` (0.2.2) or ``"0.3"`` (0.3.x).

Read from the installed distribution's metadata, without importing torchtitan (an unsupported
torchtitan may not even import). Anything else, torchtitan missing included, stops the process with
one line naming the installed and the supported versions, exit status 2
(:func:`require_supported_line`): ``titan_commopt.titan`` calls it first thing, so a user's own
entry point that imports us gets the line too, never a traceback.
"""

import os
import sys
from importlib import metadata
from typing import Optional

__all__ = ["SUPPORTED", "installed_version", "line_of", "unsupported_message", "require_supported_line"]

SUPPORTED = {"0.2": "0.2.2", "0.3": "0.3.x"}  # line → the versions of it we support


def installed_version() -> Optional[str]:
    """torchtitan's installed version, ``None`` when it is not installed."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def line_of(version: Optional[str]) -> Optional[str]:
    """The supported line ``version`` belongs to, ``None`` when it belongs to none."""
    if version is None:
        return None
    release = version.split("+")[0]
    if release == "0.2.2":
        return "0.2"
    if release.startswith("0.3.") and release.split(".")[2].isdigit():
        return "0.3"
    return None


def unsupported_message(version: Optional[str]) -> str:
    installed = "torchtitan is not installed" if version is None else f"torchtitan {version} is installed"
    supported = " or ".join(SUPPORTED.values())
    return f"titan_commopt: {installed}; supported: torchtitan {supported} (see the README's install section)"


def require_supported_line() -> str:
    """The installed line; else one line on stderr (rank 0 only under torchrun) and exit status 2."""
    version = installed_version()
    line = line_of(version)
    if line is None:
        if os.environ.get("RANK", "0") == "0":
            print(unsupported_message(version), file=sys.stderr, flush=True)
        raise SystemExit(2)
    return line
