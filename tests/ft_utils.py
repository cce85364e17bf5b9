"""Live fault-tolerance runs for the tests (torchtitan 0.2.2): torchft's lighthouse and replica
groups, each group its own ``python -m titan_commopt.run --nproc_per_node=N ... -m titan_commopt.train``
launch (or plain ``torchrun``'s) with ``TORCHFT_LIGHTHOUSE`` and the ``--fault_tolerance.*`` keys, in a
session of its own; a whole group killed (its launcher and its workers: torchrun starts each worker in
a session of its own, so a signal to the launcher's process group misses them), or its launcher
alone, and launched again; and what the groups logged, parsed (per-rank losses; the ``fault
tolerance: ...`` lines of quorums, undone steps, heals and the final fingerprints).

Every wait has a deadline that ends it with the logs' tails, and :class:`FtJob` kills everything it
started when it closes, also when a test fails. Ports are the system's free ones (bound to port 0 and
read back).

A relaunched group needs many seconds to start (imports, process groups; 15-60 s on a loaded 2-core
box), while a lone survivor trains a step of cpu_tiny in a tenth of that: a survivor sized to outlast
the slowest start would train hundreds of steps after the heal. :meth:`FtJob.hold_back` keeps the
survivor from training meanwhile instead, as if its steps were long: its workers but rank 0 are
stopped (SIGSTOP), in turns shorter than every timeout a waiting rank 0 is under, and rank 0, whose
torchft Manager heartbeats the lighthouse, waits for them in the group's next collective or Manager
barrier. Nothing of the survivor is changed but its pace."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn, Optional

from titan_commopt.titan.config.fault_tolerance_keys import KILL_ENV  # "<step>:quorum|collective|heal|stall"

from tests.titan_utils import CONFIG, LOSS_LINE, ROOT

LIGHTHOUSE_BIN = Path(sys.executable).with_name("torchft_lighthouse")
HEARTBEAT_TIMEOUT_MS = 5000  # torchft's default: how long a dead group stalls its peers' next quorum
JOIN_TIMEOUT_MS = 5000  # how long a quorum waits for a heartbeating group that did not ask yet
START_S = 300  # deadline of a launch's start-up (imports, process groups) on a loaded 2-core box
RUN_S = 600  # deadline of a whole run
# hold_back's turns: stopped at most HOLD_S at a time, below the shortest wait a rank 0 may then be in
# (torchft's should_commit barrier: 30 s; the group's collectives: torchtitan's 100 s; the quorum: 120 s)
HOLD_S, RUN_BETWEEN_S = 20.0, 0.2

_RANK = re.compile(r"^\[rank(\d+)\]:(.*)$")
_QUORUM = re.compile(r"fault tolerance: quorum of (\d+) replica group\(s\), replica group (\d+) is replica (\d+) "
                     r"\(step (\d+)\)")
_NOT_COMMITTED = re.compile(r"fault tolerance: step (\d+) not committed")
_HEALED = re.compile(r"fault tolerance: replica group (\d+) healed from a peer at step (\d+) in ([0-9.]+) s")
_FINGERPRINT = re.compile(r"fault tolerance: replica group (\d+), rank (\d+): parameters at step (\d+): "
                          r"fingerprint ([0-9a-f]+)")
_ANCHORS = re.compile(r"fault tolerance: replica group (\d+), rank (\d+): anchors at step (\d+): "
                      r"fingerprint ([0-9a-f]+)")
_SYNCS_FAILED = re.compile(r"fault tolerance: (\d+) R sync\(s\) in flight failed \((.*?)\): ")
_KILLED = re.compile(r"fault tolerance: " + KILL_ENV + r"=\S+: this process kills itself now")
_R_SENT = re.compile(r"step:\s*(\d+)\s+loss:.*R sent:\s*(\S+)/step")
_LISTENING = re.compile(r"Lighthouse listening on: http://\S+:(\d+)")


def free_port() -> int:
    """A port no one listens on now (bound to port 0 and read back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _local_rank(pid: int) -> Optional[int]:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one that exited but was not reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def processes_naming(text: str) -> list[int]:
    """Every live process whose command line contains ``text`` (a job's folder: what it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child of a fork only calls it
_PR_SET_PDEATHSIG = 1


def _dies_with_this_process() -> None:
    """``preexec_fn`` of every process started here: SIGKILLed should the test process die without
    cleaning up (a CI timeout's SIGKILL), so that no lighthouse or launcher outlives it (Linux)."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its session and every process below it (listed first: once the launcher is
    gone its workers are no longer its children)."""
    below = _descendants(proc.pid)
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: proc.kill(),
                 *(lambda pid=pid: os.kill(pid, signal.SIGKILL) for pid in below)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class GroupLog:
    """What one launch of a replica group logged, by global rank within the group."""

    losses: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # in order, retries included
    r_sent: dict[int, dict[int, str]] = field(default_factory=dict)  # the R bytes each step sent, as logged
    quorums: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # (W, replica index, step)
    not_committed: dict[int, list[int]] = field(default_factory=dict)
    heals: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # (step healed to, seconds)
    fingerprints: dict[int, tuple[int, str]] = field(default_factory=dict)  # (last step, fingerprint)
    anchors: dict[int, tuple[int, str]] = field(default_factory=dict)  # (last step, the anchors' fingerprint)
    syncs_failed: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # (how many, why)
    killed: set = field(default_factory=set)  # ranks that killed themselves (KILL_ENV)

    @classmethod
    def parse(cls, text: str, unprefixed: Optional[int] = None) -> "GroupLog":
        """``text``: a launch's console, each worker's line prefixed with its rank (``[rank1]:``);
        ``unprefixed``: the rank of lines without one (a worker started without torchrun)."""
        log = cls()
        for line in text.splitlines():
            m = _RANK.match(line)
            if m:
                rank, rest = int(m.group(1)), m.group(2)
            elif unprefixed is not None:
                rank, rest = unprefixed, line
            else:
                continue
            if found := LOSS_LINE.search(rest):
                log.losses.setdefault(rank, []).append((int(found.group(1)), float(found.group(2))))
                sent = _R_SENT.search(rest)
                log.r_sent.setdefault(rank, {})[int(sent.group(1))] = sent.group(2)
            elif found := _QUORUM.search(rest):
                w, _, index, step = map(int, found.groups())
                log.quorums.setdefault(rank, []).append((w, index, step))
            elif found := _NOT_COMMITTED.search(rest):
                log.not_committed.setdefault(rank, []).append(int(found.group(1)))
            elif found := _HEALED.search(rest):
                log.heals.setdefault(rank, []).append((int(found.group(2)), float(found.group(3))))
            elif found := _FINGERPRINT.search(rest):
                log.fingerprints[int(found.group(2))] = (int(found.group(3)), found.group(4))
            elif found := _ANCHORS.search(rest):
                log.anchors[int(found.group(2))] = (int(found.group(3)), found.group(4))
            elif found := _SYNCS_FAILED.search(rest):
                log.syncs_failed.setdefault(rank, []).append((int(found.group(1)), found.group(2)))
            elif _KILLED.search(rest):
                log.killed.add(rank)
        return log

    def loss_by_step(self, rank: int = 0, upto: Optional[int] = None) -> dict[int, float]:
        """Step -> loss of ``rank`` (a step trained again after it did not commit logs its loss
        twice: both must be the same, as the step starts from the same parameters and batches)."""
        out: dict[int, float] = {}
        for step, loss in self.losses.get(rank, []):
            if upto is not None and step > upto:
                continue
            assert out.setdefault(step, loss) == loss, f"rank {rank}: step {step} logged {out[step]} and {loss}"
        return out


class Group:
    """One launch of replica group ``replica_id`` in a session of its own: ``python -m titan_commopt.run``
    (torchrun with the config checked first), plain ``torchrun`` (``via="torchrun"``), or for a
    one-process group of a job made with ``launcher=False`` its worker alone, with the variables torchrun
    would give it (a launcher's start-up costs as much as its one worker's; the launcher's part is what
    the failure runs test)."""

    def __init__(self, job: "FtJob", replica_id: int, label: str, env: dict[str, str], via: str = "run") -> None:
        self.job, self.replica_id, self.label = job, replica_id, label
        self.log_path = job.workdir / f"{label}.log"
        train = [
            "-m", "titan_commopt.train", "--job.config_file", str(job.config),
            "--job.dump_folder", str(job.workdir / f"out{replica_id}"), "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--metrics.enable_tensorboard", "false",
            "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica_id),
            "--fault_tolerance.group_size", str(job.groups), *job.args,
        ]
        full_env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
        full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHFT_LIGHTHOUSE": job.url})
        if job.launcher:
            launcher = {"run": "titan_commopt.run", "torchrun": "torch.distributed.run"}[via]
            args = [sys.executable, "-m", launcher, f"--nproc_per_node={job.nproc}",
                    "--master_port", str(free_port()), "--tee", "3",
                    "--log-dir", str(job.workdir / f"{label}_ranks"), *train]
            # plain torchrun prefixes a worker's lines with its local rank unless told otherwise
            full_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
        else:
            args = [sys.executable, *train]
            full_env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        full_env.update(env)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_dies_with_this_process)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log(self) -> GroupLog:
        return GroupLog.parse(self.text(), unprefixed=None if self.job.launcher else 0)

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.label} (replica group {self.replica_id}, rc={self.proc.poll()}) ---\n{self.text()[-chars:]}"

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        """The launch's exit status; its whole tree killed (and the job's logs shown) past ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.job.fail(f"{self.label} still running after {timeout:.0f} s")

    def kill(self) -> None:
        _kill_tree(self.proc)

    def kill_launcher(self) -> list[int]:
        """SIGKILL this launch's launcher alone (its workers are left to themselves); returns the
        workers' pids, taken before."""
        assert self.job.launcher, "a group launched without a launcher has none to kill"
        workers = list(self.workers().values())
        assert workers, f"{self.label}: no worker to leave behind"
        self.proc.kill()
        self.proc.wait()
        return workers

    def workers(self) -> dict[int, int]:
        """Local rank -> pid of this launch's workers."""
        found = {}
        for pid in _descendants(self.proc.pid):
            rank = _local_rank(pid)
            if rank is not None and pid != self.proc.pid:
                found.setdefault(rank, pid)
        return found


class FtJob:
    """A fault-tolerant job on this machine: a lighthouse and ``groups`` replica groups of ``nproc``
    processes, all training ``config`` with ``args`` (``launcher``: see :class:`Group`). A context
    manager: leaving it kills whatever is still running."""

    def __init__(self, workdir: Path, args: list[str], *, groups: int = 2, nproc: int = 2,
                 config: Path = CONFIG, launcher: bool = True, min_replicas: int = 1) -> None:
        """``min_replicas``: the lighthouse's (a quorum needs that many groups: with all of them, the
        others wait for a lost group's relaunch instead of training on)."""
        assert launcher or nproc == 1, "a group of several processes is launched by torchrun"
        self.workdir, self.args, self.groups, self.nproc, self.config = Path(workdir), list(args), groups, nproc, config
        self.launcher, self.min_replicas = launcher, min_replicas
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.url = ""  # the lighthouse's, once started
        self.lighthouse: Optional[subprocess.Popen] = None
        self.launches: list[Group] = []

    def __enter__(self) -> "FtJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for group in self.launches:
            if group.running():
                group.kill()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            _kill_tree(self.lighthouse)

    def fail(self, why: str) -> NoReturn:
        tails = "\n".join(g.tail() for g in self.launches)
        self.close()
        raise AssertionError(f"{why}\n{tails}")

    # ---- starting ----
    def start(self, env: Optional[dict[int, dict[str, str]]] = None, via: Optional[dict[int, str]] = None) -> list[Group]:
        """The lighthouse and every group (``env``: extra variables per replica id; ``via``: a replica
        id's launcher, "run" unless named), started together (the groups wait for the lighthouse);
        returns the launches by replica id once the lighthouse accepts connections."""
        log = self.workdir / "lighthouse.log"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            self.lighthouse = subprocess.Popen(
                [str(LIGHTHOUSE_BIN), "--min_replicas", str(self.min_replicas), "--quorum_tick_ms", "100",
                 "--join_timeout_ms", str(JOIN_TIMEOUT_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
                 "--bind", f"127.0.0.1:{port}"],
                env={**os.environ, "RUST_LOG": "info"}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_dies_with_this_process)
        groups = [self.launch(k, env=(env or {}).get(k), via=(via or {}).get(k, "run")) for k in range(self.groups)]
        self.until(lambda: _LISTENING.search(log.read_text(errors="replace")) is not None and accepts(port),
                   f"the lighthouse listening on 127.0.0.1:{port} ({log})", START_S, [])
        return groups

    def launch(self, replica_id: int, env: Optional[dict[str, str]] = None, label: Optional[str] = None,
               via: str = "run") -> Group:
        """Launch replica group ``replica_id`` (again: ``label`` names its log; ``via``: see :class:`Group`)."""
        label = label or f"group{replica_id}"
        group = Group(self, replica_id, label, env or {}, via)
        self.launches.append(group)
        return group

    # ---- waiting ----
    def until(self, condition: Callable[[], bool], what: str, timeout: float, watched: list[Group]) -> None:
        """Poll ``condition`` until it holds; fails (killing everything) past ``timeout`` or when a
        watched launch exits first."""
        deadline = time.monotonic() + timeout
        while not condition():
            ended = [g for g in watched if not g.running()]
            if ended and not condition():
                self.fail(f"waiting for {what}: {', '.join(g.label for g in ended)} ended first")
            if self.lighthouse is not None and self.lighthouse.poll() is not None:
                self.fail(f"waiting for {what}: the lighthouse ended (rc={self.lighthouse.returncode}):\n"
                          + (self.workdir / "lighthouse.log").read_text(errors="replace")[-2000:])
            if time.monotonic() > deadline:
                self.fail(f"waiting for {what}: not after {timeout:.0f} s")
            time.sleep(0.2)

    def hold_back(self, group: Group, until: Callable[[], bool], what: str, timeout: float = START_S) -> int:
        """Keep ``group`` from training until ``until()`` holds (module docstring): its workers but
        local rank 0 stopped in turns of at most :data:`HOLD_S`. Returns the number of turns."""
        workers = group.workers()
        others = [pid for rank, pid in workers.items() if rank != 0]
        assert 0 in workers and others, f"{group.label}: hold_back needs a rank 0 and another rank, found {workers}"
        deadline, turns = time.monotonic() + timeout, 0
        try:
            while not until():
                if not group.running():
                    self.fail(f"{group.label} ended while held back, waiting for {what}")
                if time.monotonic() > deadline:
                    self.fail(f"{group.label} held back for {timeout:.0f} s: still waiting for {what}")
                _signal(others, signal.SIGSTOP)
                turns += 1
                turn_end = time.monotonic() + HOLD_S
                while time.monotonic() < turn_end and not until():
                    time.sleep(0.2)
                _signal(others, signal.SIGCONT)
                time.sleep(RUN_BETWEEN_S)
        finally:
            _signal(others, signal.SIGCONT)
        return turns

    def finish(self, groups: list[Group], timeout: float = RUN_S) -> list[GroupLog]:
        """Wait for ``groups`` to end; each must have exited with status 0. Their logs, parsed."""
        deadline = time.monotonic() + timeout
        for group in groups:
            rc = group.wait(max(deadline - time.monotonic(), 1))
            if rc != 0:
                self.fail(f"{group.label} exited with status {rc}")
        return [g.log() for g in groups]
