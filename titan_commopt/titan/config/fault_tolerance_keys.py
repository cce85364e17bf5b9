"""torchtitan's ``[fault_tolerance]`` keys as titan_commopt reads them, and their checks (made before
any process group exists; the runtime is ``common/replica_group_training.py`` and ``common/replica_group.py``).

Each launch waits for the lighthouse to accept a connection, at most :data:`LIGHTHOUSE_WAIT_S` seconds
(``TITAN_COMMOPT_LIGHTHOUSE_WAIT_S`` changes it, e.g. where a scheduler starts the lighthouse together
with the groups and may start it later, or in a test that expects no lighthouse); torchft's Manager then
connects to it within the same time."""

import importlib.util
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlparse

from .checkpoint import TOML, Spelling

__all__ = [
    "FtSettings", "LIGHTHOUSE_ENV", "LIGHTHOUSE_WAIT_ENV", "QUORUM_TIMEOUT_ENV", "KILL_ENV", "problems",
    "evaluation_problems", "lighthouse_address", "lighthouse_wait_seconds", "quorum_timeout_s",
    "kill_point", "wait_for_lighthouse",
]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # read by torchft's Manager (group rank 0): http://host:port
QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"  # torchft's own override of the quorum wait, seconds
QUORUM_TIMEOUT_S = 120.0  # the quorum wait without it
# A failure rehearsal: "<step>:quorum" or "<step>:collective" makes every rank of this launch SIGKILL
# itself at that step, before its quorum or before its first R collective (a peer is then inside it);
# "<step>:heal" while it applies a heal that brings it to train step <step> or later (the peer's state
# fetched, none of it loaded: its peers are then in the quorum with it); "<step>:stall" makes it hang
# before that step's first R collective instead (alive, heartbeating: what the stall timeout is for).
KILL_ENV = "TITAN_COMMOPT_FT_KILL"
_FAULTS = ("quorum", "collective", "heal", "stall")
LIGHTHOUSE_WAIT_S = 30.0  # how long a launch waits for the lighthouse to accept a connection
LIGHTHOUSE_WAIT_ENV = "TITAN_COMMOPT_LIGHTHOUSE_WAIT_S"  # seconds, instead of LIGHTHOUSE_WAIT_S


@dataclass(frozen=True)
class FtSettings:
    """torchtitan's ``[fault_tolerance]`` section, as both lines spell it."""

    enable: bool = False
    replica_id: int = 0
    group_size: int = 0
    min_replica_size: int = 1
    process_group: str = "gloo"
    process_group_timeout_ms: int = 10000
    semi_sync_method: Optional[str] = None

    @classmethod
    def of(cls, section: Any) -> "FtSettings":
        if section is None:
            return cls()
        return cls(**{k: getattr(section, k) for k in cls.__dataclass_fields__ if hasattr(section, k)})

    def checkpoint_folder(self, folder: str) -> str:
        """The checkpoint folder of this replica group under the run's ``folder`` (itself with fault
        tolerance off): the quorum's replica index changes with membership, the folder does not."""
        return os.path.join(folder, f"replica_{self.replica_id}") if self.enable else folder


def problems(ft: FtSettings, *, dp_replicate: int, lighthouse: Optional[str], spelling: Spelling = TOML) -> list[str]:
    """What makes a fault-tolerant run impossible, one line each (none when FT is off).
    ``lighthouse``: ``$TORCHFT_LIGHTHOUSE`` (None: unset); ``spelling``: how the lines name the keys
    (a TOML's ``[fault_tolerance] group_size = 0``, 0.3's ``--fault_tolerance.group_size 0``)."""
    if not ft.enable:
        return []

    def setting(key: str, value: Any, section: str = "fault_tolerance") -> str:
        return spelling.setting(section, key, value)

    enabled = setting("enable", True)
    out = []
    if importlib.util.find_spec("torchft") is None:
        out.append(f"{enabled}: torchft is not installed in this environment "
                   "(bash scripts/setup.sh installs it; or pip install torchft==0.2.0)")
    if ft.group_size < 1:
        out.append(f"{setting('group_size', ft.group_size)}: with {enabled} it is the number of "
                   "replica groups (each launched on its own), at least 1")
    elif not 0 <= ft.replica_id < ft.group_size:
        out.append(f"{setting('replica_id', ft.replica_id)}: must be in 0..{ft.group_size - 1} "
                   f"({setting('group_size', ft.group_size)})")
    if not 1 <= ft.min_replica_size <= max(ft.group_size, 1):
        out.append(f"{setting('min_replica_size', ft.min_replica_size)}: must be in 1..group_size "
                   f"({ft.group_size})")
    if ft.process_group not in ("gloo", "nccl"):
        out.append(f"{setting('process_group', ft.process_group)}: allowed are 'gloo' and 'nccl'")
    if ft.process_group_timeout_ms <= 0:
        out.append(f"{setting('process_group_timeout_ms', ft.process_group_timeout_ms)}: must be > 0")
    if dp_replicate > 1:
        out.append(f"{setting('data_parallel_replicate_degree', dp_replicate, 'parallelism')}: with {enabled} "
                   "the replicas are the replica groups (group_size), each launched on its own; set it to 1")
    if ft.semi_sync_method:
        out.append(f"{setting('semi_sync_method', ft.semi_sync_method)}: torchft's own DiLoCo/LocalSGD "
                   f"wrap torchtitan's trainer, not titan_commopt's; use {setting('name', 'DiLoCo', 'optimizer')} "
                   "(or another local-step family) and leave semi_sync_method unset")
    if _wait_seconds(os.environ.get(LIGHTHOUSE_WAIT_ENV)) is None:
        out.append(f"{LIGHTHOUSE_WAIT_ENV} = {os.environ[LIGHTHOUSE_WAIT_ENV]!r}: the seconds a launch waits for "
                   f"the lighthouse; allowed is a finite number > 0 (unset: {LIGHTHOUSE_WAIT_S:.0f})")
    if _wait_seconds(os.environ.get(QUORUM_TIMEOUT_ENV), QUORUM_TIMEOUT_S) is None:
        out.append(f"{QUORUM_TIMEOUT_ENV} = {os.environ[QUORUM_TIMEOUT_ENV]!r}: the seconds a step waits for its "
                   f"quorum (torchft's); allowed is a finite number > 0 (unset: {QUORUM_TIMEOUT_S:.0f})")
    try:
        kill_point()
    except ValueError as error:
        out.append(str(error))
    if lighthouse is not None:
        address = lighthouse_address(lighthouse)
        if address is None:
            out.append(f"{enabled}: {LIGHTHOUSE_ENV} = {lighthouse!r}: not an address; "
                       "expected http://<host>:<port> of the torchft_lighthouse")
    else:
        out.append(f"{enabled}: {LIGHTHOUSE_ENV} is not set: every replica group "
                   "needs the lighthouse's address, e.g. TORCHFT_LIGHTHOUSE=http://<head node>:29510 "
                   "(start it with: torchft_lighthouse --min_replicas 1 --bind [::]:29510)")
    return out


def evaluation_problems(ft: FtSettings, resolved: Any, validating: bool, spelling: Spelling = TOML) -> list[str]:
    """Validation of a family whose global model is a mean over R, refused under fault tolerance: an
    evaluation follows a step's commit, and no R collective may (a replica group that did not commit
    would not issue it). Such are parameters averaged every Kx > 1 steps without an anchor (the mean of
    the groups' parameters between syncs) and an eager merge (``merge = "eager"``: each group's anchor
    holds its own fresh share, the global model is their mean)."""
    if not ft.enable or not validating or resolved is None:
        return []
    options = resolved.options
    eager = getattr(options, "merge", None) == "eager"
    if not eager and (getattr(options, "outer", None) != "average" or getattr(options, "Kx", 1) == 1):
        return []
    validation = "validator" if spelling.cli else "validation"
    if eager:
        what = "the mean of the replica groups' anchors (an eager merge applies each group's own fresh share)"
        instead = f"set {spelling.setting(f'commopt.{resolved.family.key}', 'merge', 'delayed')}"
    else:
        what = "the mean of the replica groups' parameters"
        instead = "train a family with an anchor (DiLoCo, SparseLoCo) or a per-step one"
    return [f"{spelling.setting(validation, 'enable', True)} with {spelling.setting('optimizer', 'name', resolved.name)} "
            f"under {spelling.setting('fault_tolerance', 'enable', True)}: its global model between syncs is {what}, "
            "an R collective after the step's commit, which fault tolerance does not allow; set "
            f"{spelling.setting(validation, 'enable', False)}, or {instead}"]


def lighthouse_address(url: str) -> Optional[tuple[str, int]]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    try:
        port = parsed.port
    except ValueError:
        return None
    if not parsed.hostname or port is None:
        return None
    return parsed.hostname, port


def _wait_seconds(text: Optional[str], unset: float = LIGHTHOUSE_WAIT_S) -> Optional[float]:
    if text is None or text == "":
        return unset
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def lighthouse_wait_seconds() -> float:
    """How long a launch waits for the lighthouse: ``$TITAN_COMMOPT_LIGHTHOUSE_WAIT_S``, else
    :data:`LIGHTHOUSE_WAIT_S` (a bad value is refused before, by :func:`problems`)."""
    return _wait_seconds(os.environ.get(LIGHTHOUSE_WAIT_ENV)) or LIGHTHOUSE_WAIT_S


def quorum_timeout_s() -> float:
    """How long a quorum is waited for: ``$TORCHFT_QUORUM_TIMEOUT_SEC`` (torchft's own), else
    :data:`QUORUM_TIMEOUT_S` (a bad value is refused before, by :func:`problems`)."""
    return _wait_seconds(os.environ.get(QUORUM_TIMEOUT_ENV), QUORUM_TIMEOUT_S) or QUORUM_TIMEOUT_S


def kill_point() -> Optional[tuple[int, str]]:
    """``$TITAN_COMMOPT_FT_KILL`` as (step, where), None unset; ``ValueError`` (its one line) when malformed."""
    text = os.environ.get(KILL_ENV, "")
    if not text:
        return None
    step, _, where = text.partition(":")
    if not step.isdigit() or where not in _FAULTS:
        raise ValueError(f"{KILL_ENV} = {text!r}: a failure rehearsal; allowed is <step>:quorum, <step>:collective, "
                         "<step>:heal or <step>:stall (step an integer >= 0)")
    return int(step), where


def wait_for_lighthouse(url: str, seconds: Optional[float] = None,
                        waiting: Callable[[float], None] = lambda seconds: None) -> Optional[str]:
    """``None`` once the lighthouse at ``url`` accepts a TCP connection, else (after ``seconds``,
    default :func:`lighthouse_wait_seconds`) the one line that says so. A lighthouse started a little
    after the groups is waited for: ``waiting(seconds)`` is called once if the first try fails."""
    seconds = lighthouse_wait_seconds() if seconds is None else seconds
    address = lighthouse_address(url)
    if address is None:
        return f"{LIGHTHOUSE_ENV} = {url!r}: not an address; expected http://<host>:<port>"
    deadline = time.monotonic() + seconds
    error: Exception = TimeoutError()
    first = True
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(address, timeout=min(2.0, seconds)):
                return None
        except OSError as e:
            error = e
            if first:
                waiting(seconds)
                first = False
            time.sleep(0.5)
    return (f"{LIGHTHOUSE_ENV} = {url}: no torchft lighthouse answered there within {seconds:.0f} s "
            f"({type(error).__name__}: {error}); start it first (torchft_lighthouse --min_replicas 1 "
            f"--bind [::]:{address[1]}) or fix the address")
