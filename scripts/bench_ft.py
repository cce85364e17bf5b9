"""What live fault tolerance costs on this box: torchft's lighthouse and 2 replica groups x 2 processes.

    nice -n 19 .venv/bin/python scripts/bench_ft.py --repeats 3
    nice -n 19 .venv/bin/python scripts/bench_ft.py --configs train_configs/diloco_cpu.toml \\
        --runs kill-quorum kill-collective --heartbeat-ms 5000 1000 -- --commopt.local.Kx 8

Every run is real training (``python -m titan_commopt.run ... -m titan_commopt.train``, one launch per
replica group, each with its own ``MASTER_PORT``) of a ``--configs`` file at ``--metrics.log_freq 1``;
every number is read from the rank-0 console lines' timestamps (millisecond clock of the logger) and
the launch times this script takes. A step line is printed only for a step that committed. Runs
(``--runs``):

- ``plain``: the same mesh without fault tolerance, one launch of 4 processes
  (``data_parallel_replicate_degree 2`` x ``data_parallel_shard_degree 2``).
- ``ft``: the lighthouse (``--min_replicas 2``, so both groups start together) and 2 launches of 2
  processes (``--fault_tolerance.group_size 2``, ``min_replica_size 2``). With ``plain``, the
  per-step cost of the quorum: mean step time over steps ``--warmup``+1 .. ``--steps`` (the wall
  clock between the console lines of those two steps over their distance), minus ``plain``'s.
- ``kill-quorum`` / ``kill-collective``: the lighthouse (``--min_replicas 1``); replica group 1 is
  launched with ``TITAN_COMMOPT_FT_KILL=<--kill-step>:quorum|collective`` (every rank of it SIGKILLs
  itself at that step, before its quorum, i.e. between steps, or before its first R collective,
  while group 0 is inside it). Measured: the survivor's **stall**, from the line of the last step
  committed before the kill (``--kill-step`` - 1) to the line of the first one committed after it
  (``--kill-step``), beside its median step before the kill. As soon as group 1's launcher has
  exited, group 1 is launched again (no kill): its **heal** time (its "healed from a peer at step N
  in X s" line: the quorum call that fetched the peer's state), its **rejoin** time (from the
  relaunch to its first committed step's line: Python and torchtitan start-up, the model build, the
  quorum, the heal), and the survivor's step during which the group rejoined (its step after the
  survivor's quorum line "quorum of 2"). Both groups are then stopped (``--after`` steps of the
  relaunched group later).
- ``kill-launcher``: the same, but once group 0 has logged step ``--kill-step`` - 1 only group 1's
  launcher (``python -m titan_commopt.run``) is SIGKILLed, not its workers: they must leave by themselves
  (``titan/platform/launcher_death.py``). Measured besides: how long after the kill the workers are
  gone (**orphans gone**, as this script sees it: it polls every 0.2 s at the lowest priority), and
  from the kill to the survivor's first step committed in a quorum without group 1 (**kill to next
  commit**: what the survivors lose); the stall is the gap between that step's line and the one
  before it (a step or two may commit between the kill and the orphans' exit).
- ``stall``: group 1 stays alive but stops (SIGSTOP to its processes) once group 0 has logged step
  ``--kill-step`` - 1; the survivor's longest gap between two committed steps after that (bounded by
  ``[fault_tolerance] process_group_timeout_ms``, ``--pg-timeout-ms``, and the lighthouse's heartbeat
  timeout), then group 1 is killed.

``--heartbeat-ms`` (the lighthouse's ``--heartbeat_timeout_ms``; several values: each kill/stall run
once per value) and ``--pg-timeout-ms`` (several values: each ``stall`` run once per value) are what the
stall depends on. ``--repeats`` runs the whole set again, interleaved (the box is shared: a repeat
sees the same load across runs); the tables give the median and the range over the repeats.
Anything after ``--`` goes to every training launch (e.g. ``--commopt.local.Kx 8`` for a local-step
family: its collective-kill step must be a sync step, a multiple of Kx).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import ROOT, table, train_env  # noqa: E402

RUNS = ("plain", "ft", "kill-quorum", "kill-collective", "kill-launcher", "stall")
KILL_ENV = "TITAN_COMMOPT_FT_KILL"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
LIGHTHOUSE_START_S = 120  # it imports torch before it listens: tens of seconds on a loaded box

_STAMP = r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - "
STEP_LINE = re.compile(_STAMP + r".* - INFO - step:\s*(\d+)\s+loss:")
HEAL_LINE = re.compile(_STAMP + r".*healed from a peer at step (\d+) in ([\d.]+) s")
QUORUM_LINE = re.compile(_STAMP + r".*fault tolerance: quorum of (\d+) replica group\(s\).*\(step (\d+)\)")
KILL_LINE = re.compile(_STAMP + r".*" + KILL_ENV + r"=.*kills itself now")
UNCOMMITTED_LINE = re.compile(_STAMP + r".*fault tolerance: step (\d+) not committed")


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class Log:
    """What one launch's rank-0 console said: committed steps (step -> time of its line), heals, quorums."""

    steps: dict[int, float] = field(default_factory=dict)
    heals: list[tuple[float, int, float]] = field(default_factory=list)  # (time, step, seconds)
    quorums: list[tuple[float, int, int]] = field(default_factory=list)  # (time, groups, step)
    kills: list[float] = field(default_factory=list)
    uncommitted: list[tuple[float, int]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> "Log":
        log = cls()
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            if m := STEP_LINE.search(line):
                log.steps.setdefault(int(m.group(2)), _seconds(m.group(1)))
            elif m := HEAL_LINE.search(line):
                log.heals.append((_seconds(m.group(1)), int(m.group(2)), float(m.group(3))))
            elif m := QUORUM_LINE.search(line):
                log.quorums.append((_seconds(m.group(1)), int(m.group(2)), int(m.group(3))))
            elif m := KILL_LINE.search(line):
                log.kills.append(_seconds(m.group(1)))
            elif m := UNCOMMITTED_LINE.search(line):
                log.uncommitted.append((_seconds(m.group(1)), int(m.group(2))))
        return log

    def mean_step(self, first: int, last: int) -> Optional[float]:
        """Mean seconds per step over steps ``first``+1 .. ``last`` (None if either line is missing)."""
        if first not in self.steps or last not in self.steps or last <= first:
            return None
        return (self.steps[last] - self.steps[first]) / (last - first)

    def median_step(self, first: int, last: int) -> Optional[float]:
        """Median seconds between consecutive step lines over steps ``first``+1 .. ``last`` (less
        sensitive than the mean to another user's burst on a shared machine)."""
        window = [gap for step, _, gap in self.gaps() if first < step <= last]
        return statistics.median(window) if window else None

    def gaps(self) -> list[tuple[int, float, float]]:
        """(step, time of its line, seconds since the previous committed step's line), in step order."""
        order = sorted(self.steps.items())
        return [(s, t, t - order[i - 1][1]) for i, (s, t) in enumerate(order) if i and s == order[i - 1][0] + 1]


# ---- processes (only those this script started, by id) ----
def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun's workers run in their own sessions: not its group)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for kid in parents.get(todo.pop(), []):
            out.append(kid)
            todo.append(kid)
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(proc: Optional[subprocess.Popen], grace: float = 10.0) -> None:
    """Stop a launch: SIGTERM to the launcher (torchrun passes it on), then SIGKILL to whatever of it is left."""
    if proc is None or proc.poll() is not None:
        return
    tree = _children(proc.pid)
    _signal_all(tree, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_all([proc.pid, *tree], signal.SIGKILL)
    proc.wait()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Lighthouse:
    def __init__(self, port: int, min_replicas: int, heartbeat_ms: int, join_ms: int, log: Path) -> None:
        if not _port_free(port):
            raise RuntimeError(f"--lighthouse-port {port} is taken (another lighthouse? pick a free port)")
        self.url = f"http://127.0.0.1:{port}"
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--quorum_tick_ms", "100",
             "--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(heartbeat_ms),
             "--bind", f"127.0.0.1:{port}"], stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + LIGHTHOUSE_START_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"torchft_lighthouse did not listen on 127.0.0.1:{port} within {LIGHTHOUSE_START_S} s "
                           f"(see {log})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._out.close()


@dataclass
class Launch:
    proc: subprocess.Popen
    log: Path
    started: float  # time.time() at launch

    def read(self) -> Log:
        return Log.read(self.log)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._live: list[Launch] = []

    def launch(self, name: str, config: Path, nproc: int, port: int, steps: int, *extra: str,
               env: Optional[dict] = None) -> Launch:
        if not _port_free(port):
            raise RuntimeError(f"MASTER_PORT {port} is taken (--port-base {self.args.port_base}: pick free ports)")
        log = self.out / f"{name}.log"
        cmd = [sys.executable, "-m", "titan_commopt.run", f"--nproc_per_node={nproc}", "--master_port", str(port),
               "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "titan_commopt.train",
               "--job.config_file", str(config), "--job.dump_folder", str(self.out / name),
               "--metrics.disable_color_printing", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
               "--training.steps", str(steps), *extra, *self.args.train_args]
        with open(log, "w") as f:
            f.write("# " + " ".join(cmd) + "\n")
            f.flush()
            launch = Launch(subprocess.Popen(cmd, cwd=ROOT, env={**train_env(), **(env or {})}, stdout=f,
                                             stderr=subprocess.STDOUT), log, time.time())
        self._live.append(launch)
        return launch

    def group(self, name: str, config: Path, replica: int, port: int, steps: int, lighthouse: Lighthouse,
              min_groups: int, env: Optional[dict] = None, pg_timeout_ms: Optional[int] = None) -> Launch:
        extra = ["--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
                 "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica),
                 "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", str(min_groups)]
        if pg_timeout_ms is not None:
            extra += ["--fault_tolerance.process_group_timeout_ms", str(pg_timeout_ms)]
        return self.launch(name, config, 2, port, steps, *extra, env={"TORCHFT_LIGHTHOUSE": lighthouse.url, **(env or {})})

    def wait_until(self, what: str, ready: Callable[[], bool], launches: list[Launch]) -> None:
        """Poll until ``ready()``; a launch among ``launches`` that exits first, or the timeout, raises."""
        deadline = time.monotonic() + self.args.timeout
        while not ready():
            for launch in launches:
                if launch.proc.poll() is not None and not ready():
                    raise RuntimeError(f"{launch.log.name} exited (rc={launch.proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {self.args.timeout} s")
            time.sleep(0.2)

    def finish(self, *launches: Launch) -> None:
        deadline = time.monotonic() + self.args.timeout
        for launch in launches:
            try:
                launch.proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{launch.log.name} did not finish within {self.args.timeout} s")
            if launch.proc.returncode != 0:
                raise RuntimeError(f"{launch.log.name} failed (rc={launch.proc.returncode})")

    def stop_all(self) -> None:
        for launch in self._live:
            stop(launch.proc)
        self._live = []

    # ---- the runs ----
    def plain(self, tag: str, config: Path) -> dict:
        a = self.args
        launch = self.launch(tag, config, 4, a.port_base + 10, a.steps,
                             "--parallelism.data_parallel_replicate_degree", "2",
                             "--parallelism.data_parallel_shard_degree", "2")
        self.finish(launch)
        log = launch.read()
        mean = log.mean_step(a.warmup, a.steps)
        if mean is None:
            raise RuntimeError(f"{launch.log.name}: no step lines {a.warmup} and {a.steps}")
        return {"step_s": mean, "step_median_s": log.median_step(a.warmup, a.steps)}

    def ft(self, tag: str, config: Path) -> dict:
        a = self.args
        lighthouse = Lighthouse(a.lighthouse_port, 2, a.heartbeat_ms[0], a.join_ms, self.out / f"{tag}-lighthouse.log")
        try:
            groups = [self.group(f"{tag}-g{k}", config, k, a.port_base + k, a.steps, lighthouse, 2) for k in (0, 1)]
            self.finish(*groups)
        finally:
            self.stop_all()
            lighthouse.close()
        logs = [g.read() for g in groups]
        means = [log.mean_step(a.warmup, a.steps) for log in logs]
        if None in means:
            raise RuntimeError(f"{tag}: no step lines {a.warmup} and {a.steps} in a group's log")
        return {"step_s": statistics.mean(means), "step_s_by_group": means,
                "step_median_s": statistics.mean(log.median_step(a.warmup, a.steps) for log in logs)}

    def kill(self, tag: str, config: Path, where: str, heartbeat_ms: int) -> dict:
        a = self.args
        k = a.kill_step
        lighthouse = Lighthouse(a.lighthouse_port, 1, heartbeat_ms, a.join_ms, self.out / f"{tag}-lighthouse.log")
        try:
            survivor = self.group(f"{tag}-g0", config, 0, a.port_base, a.long_steps, lighthouse, 1)
            victim = self.group(f"{tag}-g1", config, 1, a.port_base + 1, a.long_steps, lighthouse, 1,
                                env=None if where == "launcher" else {KILL_ENV: f"{k}:{where}"})
            killed_at = orphans_s = None
            if where == "launcher":
                self.wait_until(f"group 0's step {k - 1}", lambda: k - 1 in survivor.read().steps, [survivor, victim])
                workers = _children(victim.proc.pid)
                killed_at = time.time()
                victim.proc.kill()
                victim.proc.wait()
                self.wait_until("group 1's workers leaving with their launcher",
                                lambda: not any(_alive(pid) for pid in workers), [survivor])
                orphans_s = time.time() - killed_at
            else:
                self.wait_until("the killed group's exit", lambda: victim.proc.poll() is not None, [survivor])
            again = self.group(f"{tag}-g1-again", config, 1, a.port_base + 2, a.long_steps, lighthouse, 1)

            def rejoined() -> bool:
                steps = again.read().steps
                return len(steps) > a.after

            self.wait_until(f"{a.after + 1} committed steps of the relaunched group", rejoined, [survivor, again])
        finally:
            self.stop_all()
            lighthouse.close()
        s, v, r = survivor.read(), victim.read(), again.read()
        if where != "launcher" and not v.kills:
            raise RuntimeError(f"{victim.log.name}: group 1 exited without the {KILL_ENV} kill (see the log)")
        joined = [q for q in s.quorums if q[1] == 2 and q[2] < k - 1]
        if not joined:
            raise RuntimeError(f"{survivor.log.name}: group 1 joined group 0 only after step {k - 1}: "
                               "raise --kill-step (the groups started too far apart)")
        went_on = None
        if killed_at is not None:  # the survivor's first step committed in a quorum without group 1
            alone = [t for t, groups, _ in s.quorums if groups == 1 and t > killed_at]
            if not alone:
                raise RuntimeError(f"{survivor.log.name}: group 0 never trained without group 1 after its launcher's kill")
            k = min((step for step, t in s.steps.items() if t > alone[0]), default=k)
            went_on = s.steps[k] - killed_at if k in s.steps else None
        if k - 1 not in s.steps or k not in s.steps:
            raise RuntimeError(f"{survivor.log.name}: no line of step {k - 1} or {k}")
        if not r.heals:
            raise RuntimeError(f"{again.log.name}: the relaunched group trained without healing from group 0")
        before = [gap for step, _, gap in s.gaps() if joined[0][2] + 2 <= step < k]
        rejoin_quorum = [q for q in s.quorums if q[1] == 2 and q[0] > again.started and q[2] >= k]
        rejoin_step = rejoin_quorum[0][2] + 1 if rejoin_quorum else None
        first = min(r.steps.items(), key=lambda kv: kv[0])
        return {
            "stall_s": s.steps[k] - s.steps[k - 1],
            "step_before_s": statistics.median(before) if before else None,
            "uncommitted": sum(t < again.started for t, _ in s.uncommitted),  # not the stop at the end
            "heal_s": r.heals[0][2],
            "healed_at_step": r.heals[0][1],
            "rejoin_s": first[1] - again.started,
            "survivor_rejoin_step_s": (s.steps[rejoin_step] - s.steps[rejoin_step - 1]
                                       if rejoin_step and {rejoin_step, rejoin_step - 1} <= s.steps.keys() else None),
            **({"orphans_gone_s": orphans_s, "kill_to_commit_s": went_on} if where == "launcher" else {}),
        }

    def stall(self, tag: str, config: Path, heartbeat_ms: int, pg_timeout_ms: int) -> dict:
        a = self.args
        k = a.kill_step
        lighthouse = Lighthouse(a.lighthouse_port, 1, heartbeat_ms, a.join_ms, self.out / f"{tag}-lighthouse.log")
        try:
            survivor = self.group(f"{tag}-g0", config, 0, a.port_base, a.long_steps, lighthouse, 1, pg_timeout_ms=pg_timeout_ms)
            victim = self.group(f"{tag}-g1", config, 1, a.port_base + 1, a.long_steps, lighthouse, 1, pg_timeout_ms=pg_timeout_ms)
            self.wait_until(f"group 0's step {k - 1}", lambda: k - 1 in survivor.read().steps, [survivor, victim])
            stopped_at = time.time()
            _signal_all(_children(victim.proc.pid), signal.SIGSTOP)

            def went_on() -> bool:
                log = survivor.read()
                alone = [t for t, groups, _ in log.quorums if groups == 1 and t > stopped_at]
                return bool(alone) and sum(t > alone[0] for t in log.steps.values()) >= a.after

            self.wait_until(f"{a.after} steps of group 0 alone after group 1 stopped", went_on, [survivor])
        finally:
            self.stop_all()
            lighthouse.close()
        s = survivor.read()
        joined = [q for q in s.quorums if q[1] == 2 and q[0] < stopped_at]
        if not joined:
            raise RuntimeError(f"{survivor.log.name}: group 1 had not joined when it was stopped: raise --kill-step")
        after = [gap for step, t, gap in s.gaps() if t > stopped_at]
        before = [gap for step, t, gap in s.gaps() if joined[0][2] + 2 <= step and t <= stopped_at]
        return {"stall_s": max(after), "step_before_s": statistics.median(before) if before else None,
                "uncommitted": len(s.uncommitted)}


# ---- the report ----
def _spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def report(results: list[dict]) -> str:
    out = []
    cost_rows = []
    for label in dict.fromkeys(r["config"] for r in results):
        plain = [r for r in results if r["config"] == label and r["run"] == "plain" and "error" not in r]
        ft = [r for r in results if r["config"] == label and r["run"] == "ft" and "error" not in r]
        if not plain and not ft:
            continue
        diffs = [f["step_s"] - p["step_s"] for p, f in zip(sorted(plain, key=lambda r: r["repeat"]),
                                                            sorted(ft, key=lambda r: r["repeat"]))]
        ratios = [f["step_s"] / p["step_s"] for p, f in zip(sorted(plain, key=lambda r: r["repeat"]),
                                                            sorted(ft, key=lambda r: r["repeat"]))]
        medians = [f["step_median_s"] - p["step_median_s"] for p, f in zip(sorted(plain, key=lambda r: r["repeat"]),
                                                                            sorted(ft, key=lambda r: r["repeat"]))
                   if "step_median_s" in p and "step_median_s" in f]
        cost_rows.append([label, _spread([r["step_s"] for r in plain], 1e3, 1), _spread([r["step_s"] for r in ft], 1e3, 1),
                          _spread(diffs, 1e3, 1), _spread(ratios, 1.0, 3),
                          _spread([r.get("step_median_s") for r in plain], 1e3, 1),
                          _spread([r.get("step_median_s") for r in ft], 1e3, 1), _spread(medians, 1e3, 1),
                          f"{len(plain)}/{len(ft)}"])
    if cost_rows:
        out.append("Per-step cost of the quorum (ms; median [min–max] over repeats; FT − plain and FT / plain "
                   "paired by repeat; mean: over the window, median: of the window's steps)\n")
        out.append(table(["config", "plain mean (1 launch, 4 proc)", "FT mean (2 groups x 2 proc)", "FT − plain",
                          "FT / plain", "plain median", "FT median", "FT − plain (medians)", "runs ok"], cost_rows))
    kill_rows = []
    for key in dict.fromkeys((r["config"], r["run"], r.get("heartbeat_ms"), r.get("pg_timeout_ms"))
                             for r in results if r["run"] in ("kill-quorum", "kill-collective", "kill-launcher", "stall")):
        rs = [r for r in results if (r["config"], r["run"], r.get("heartbeat_ms"), r.get("pg_timeout_ms")) == key]
        ok = [r for r in rs if "error" not in r]
        col = lambda name, digits=2: _spread([r.get(name) for r in ok], 1.0, digits)  # noqa: E731
        kill_rows.append([key[0], key[1], key[2], key[3] if key[3] is not None else "–", col("stall_s"),
                          col("step_before_s", 3), col("uncommitted", 0), col("orphans_gone_s", 3),
                          col("kill_to_commit_s"), col("heal_s"), col("rejoin_s", 1),
                          col("survivor_rejoin_step_s"), f"{len(ok)}/{len(rs)}"])
    if kill_rows:
        out.append("\nA lost replica group (seconds; median [min–max] over repeats)\n")
        out.append(table(["config", "run", "heartbeat ms", "pg timeout ms", "survivor's stall", "its step before",
                          "steps undone", "orphans gone", "kill to next commit", "heal", "relaunch to rejoin",
                          "survivor's step at rejoin", "runs ok"], kill_rows))
    loads = [r["load_1min"] for r in results if "load_1min" in r]
    if loads:
        out.append(f"\nload average (1 min) at the start of the runs: {min(loads):.1f}–{max(loads):.1f} "
                   f"on {os.cpu_count()} cores")
    failed = [r for r in results if "error" in r]
    for r in failed:
        out.append(f"\nfailed: {r['config']} {r['run']} repeat {r['repeat']}: {r['error']}")
    return "\n".join(out)


def _config_label(path: Path) -> str:
    with open(path, "rb") as f:
        return tomllib.load(f).get("optimizer", {}).get("name", path.stem)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["train_configs/flexdemo_cpu.toml"], help="train_configs files")
    p.add_argument("--runs", nargs="+", default=["plain", "ft", "kill-quorum", "kill-collective"], metavar="RUN",
                   help=f"any of {', '.join(RUNS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="plain/ft: steps of a run (the last of the window)")
    p.add_argument("--warmup", type=int, default=10, help="plain/ft: steps before the window")
    p.add_argument("--kill-step", type=int, default=64, help="kill/stall: the step at which group 1 dies or stops")
    p.add_argument("--after", type=int, default=5, help="kill: committed steps of the relaunched group before the end")
    p.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000], help="lighthouse --heartbeat_timeout_ms")
    p.add_argument("--join-ms", type=int, default=5000, help="lighthouse --join_timeout_ms")
    p.add_argument("--pg-timeout-ms", type=int, nargs="+", default=[10000],
                   help="stall: [fault_tolerance] process_group_timeout_ms")
    p.add_argument("--lighthouse-port", type=int, default=29540)
    p.add_argument("--port-base", type=int, default=29660, help="MASTER_PORTs: this .. this + 10")
    p.add_argument("--timeout", type=int, default=600, help="seconds a run may take")
    p.add_argument("--out", default="outputs/bench_ft", help="logs of every launch")
    p.add_argument("--json", help="also write every run's numbers here")
    args = p.parse_args(argv)
    args.train_args = train_args
    problems = []
    for run in args.runs:
        if run not in RUNS:
            problems.append(f"--runs {run!r}: allowed are {', '.join(RUNS)}")
    for name in ("repeats", "steps", "kill_step", "after", "timeout", "join_ms"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed is an integer >= 1")
    if not 0 <= args.warmup < args.steps:
        problems.append(f"--warmup {args.warmup}: allowed is 0 .. --steps - 1 ({args.steps - 1})")
    if args.kill_step < 3:
        problems.append(f"--kill-step {args.kill_step}: allowed is an integer >= 3 (both groups must have joined)")
    for name in ("heartbeat_ms", "pg_timeout_ms"):
        for value in getattr(args, name):
            if value < 1:
                problems.append(f"--{name.replace('_', '-')} {value}: allowed are integers >= 1")
    for config in args.configs:
        if not (ROOT / config).is_file() and not Path(config).is_file():
            problems.append(f"--configs {config!r}: no such file")
    if any(r != "plain" for r in args.runs) and not LIGHTHOUSE.exists():
        problems.append(f"{LIGHTHOUSE}: torchft's lighthouse is not installed in this environment (bash scripts/setup.sh)")
    if problems:
        print(problems[0], file=sys.stderr)
        raise SystemExit(2)
    args.long_steps = 100000  # kill/stall runs are stopped by this script
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    results: list[dict] = []
    configs = [(ROOT / c if (ROOT / c).is_file() else Path(c)) for c in args.configs]
    plan: list[tuple[str, dict]] = []
    for run in args.runs:
        if run in ("plain", "ft"):
            plan.append((run, {}))
        elif run == "stall":
            plan += [(run, {"heartbeat_ms": h, "pg_timeout_ms": t}) for h in args.heartbeat_ms for t in args.pg_timeout_ms]
        else:
            plan += [(run, {"heartbeat_ms": h}) for h in args.heartbeat_ms]
    for repeat in range(args.repeats):
        for config in configs:
            label = _config_label(config)
            for run, knobs in plan:
                tag = "-".join([label, run, *(f"{v}" for v in knobs.values()), f"r{repeat}"])
                print(f"# {tag} ...", file=sys.stderr, flush=True)
                row = {"config": label, "run": run, "repeat": repeat, **knobs, "load_1min": os.getloadavg()[0]}
                started = time.monotonic()
                try:
                    if run == "plain":
                        row.update(bench.plain(tag, config))
                    elif run == "ft":
                        row.update(bench.ft(tag, config))
                    elif run == "stall":
                        row.update(bench.stall(tag, config, knobs["heartbeat_ms"], knobs["pg_timeout_ms"]))
                    else:
                        row.update(bench.kill(tag, config, run.removeprefix("kill-"), knobs["heartbeat_ms"]))
                except (RuntimeError, OSError) as error:
                    row["error"] = str(error)
                finally:
                    bench.stop_all()
                row["wall_s"] = time.monotonic() - started
                print(f"#   {json.dumps(row)}", file=sys.stderr, flush=True)
                results.append(row)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
