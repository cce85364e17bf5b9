"""Two "nodes" on one box joined by a slow link: step time, tokens/s and bytes on the wire of
AdamW-HSDP vs every registered optimizer, in one script run.

    sudo .venv/bin/python scripts/bench_netns.py --rates 100mbit 1gbit --steps 20
    sudo .venv/bin/python scripts/bench_netns.py --rates 100mbit --nproc-per-node 2 --optimizers AdamW DeMo

Layout: two network namespaces joined by a veth pair with addresses from a private /24
(``--subnet``, default 10.213.77.0/24) that exists only inside these namespaces; both ends shaped
with ``tc`` (tbf at the given rate; a netem delay of ``--delay`` where the kernel has netem). One
``torchrun --nnodes 2`` per namespace, c10d rendezvous on node A's address, gloo bound to the veth
(``GLOO_SOCKET_IFNAME``). The mesh is ``|R| = 2`` (one replica per node: R crosses the link) x
``|S| = --nproc-per-node`` (FSDP inside a node: loopback, unshaped). Traffic never leaves the
namespaces; they are deleted on exit, also on failure or Ctrl-C.

Every number is taken over the measured window, steps ``--warmup``+1 … ``--steps`` (start-up,
rendezvous, the initial parameter broadcast and the first steps are left out):

- step time: mean and median of torchtitan's ``time_metrics/end_to_end(s)``; the speed-up uses the
  mean, which for the periodic optimizers (DES-LOC, LocalAdam, MT-DAO, DiLoCo) includes the sync
  steps that fall in the window (the default window, steps 5–36, holds exactly one Kx = 32 period);
- tokens/s of the whole job from the mean step time;
- bytes that crossed the link: tx counters of both veth ends read when node A's console prints the
  line of step ``--warmup`` and of step ``--steps``, divided by the window's steps;
- the ledger's R bytes over the same window (``comm/R_sent_bytes_total``), summed over a node's ranks.

**Time to a loss** (``--to-loss``): each optimizer trains (its own ``--schedule`` length, default
``--steps``) until the trailing mean of its last ``--loss-window`` logged losses first reaches a
target, or its ``--budget`` of wall-clock seconds ends; then both nodes are stopped. ``--to-loss
auto``: the target is AdamW-HSDP's own final loss in the same round (the trailing mean at its last
step, as ``scripts/convergence.py``'s final loss: the mean of the last 10 % of a 500-step run), so
AdamW (run first in each round) reaches it by definition and every other optimizer of the round is
measured against it; a number sets the target instead. The time to the loss is the wall clock
between node A's console lines of step 1 and of the step where the trailing mean first reaches the
target (start-up, rendezvous and the first step left out, alike for every optimizer), and each
round gives each optimizer's time ÷ AdamW-HSDP's of the same round (``--repeats``: the spread over
rounds). ``--plot-loss`` draws the trailing-mean loss against that wall clock, per rate.

Exits 0 with "SKIP: ..." when it cannot run (not root, no ``ip``/``tc``, namespaces not permitted).
"""

import argparse
import atexit
import ipaddress
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import ROOT, cli_overrides, human, parse_overrides, read_scalars, table, torchrun_cmd, train_env  # noqa: E402

TAG = f"tcb{os.getpid() % 100000}"
NS = (f"{TAG}a", f"{TAG}b")
VETH = (f"{TAG}va", f"{TAG}vb")


def sh(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def cannot_run() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (iproute2)"
    probe = f"{TAG}p"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def teardown() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def setup(subnet: str) -> tuple[str, str]:
    net = ipaddress.ip_network(subnet)
    if not net.is_private or net.prefixlen != 24:
        raise SystemExit(f"--subnet must be a private /24, got {subnet}")
    hosts = list(net.hosts())
    addrs = (str(hosts[0]), str(hosts[1]))
    atexit.register(teardown)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: sys.exit(130))
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", VETH[0], "netns", NS[0], "type", "veth", "peer", "name", VETH[1], "netns", NS[1])
    for ns, dev, addr in zip(NS, VETH, addrs):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
    return addrs


def shape(rate: str, delay: str) -> str:
    """Shape both ends of the link; returns what was applied."""
    applied = f"tbf rate {rate}"
    for ns, dev in zip(NS, VETH):
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        netem = delay and sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay,
                             "limit", "100000", check=False).returncode == 0
        parent = ["parent", "1:1", "handle", "10:"] if netem else ["root", "handle", "10:"]
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate, "burst", "256kbit", "latency", "400ms")
        if netem:
            applied = f"netem delay {delay} + tbf rate {rate}"
        elif delay:
            applied = f"tbf rate {rate} (no netem in this kernel: no added delay)"
    return applied


def tx_bytes() -> list[int]:
    out = []
    for ns, dev in zip(NS, VETH):
        info = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)[0]
        out.append(int(info["stats64"]["tx"]["bytes"]))
    return out


class StepCounterSampler(threading.Thread):
    """Reads the veth tx counters when node A's console log first shows given steps, and the wall
    clock and loss of every step line.

    torchtitan prints ``step: N  loss: ...`` once step N has finished (``log_freq = 1``), straight into
    the log (no torchrun tee in between); sampling at the lines of the window's first and last step
    leaves start-up and shutdown traffic out. With a ``target``, :attr:`reached` is set (and the tx
    counters sampled) at the first step where the mean of the last ``window`` losses is at most it.
    """

    STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+|nan|inf)")

    def __init__(self, log: Path, steps: set[int], follow: bool = False, target: float | None = None,
                 window: int = 50) -> None:
        super().__init__(daemon=True)
        self.log, self.wanted, self.samples, self.follow = log, set(steps), {}, follow
        self.times: dict[int, float] = {}
        self.losses: dict[int, float] = {}
        self.target, self.window = target, window
        self.crossed: int | None = None
        self.done, self.reached = threading.Event(), threading.Event()

    def run(self) -> None:
        pos, tail = 0, ""
        while True:
            stop = self.done.is_set()  # read once more after done: the lines of a run that just ended
            try:
                with open(self.log, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except FileNotFoundError:
                chunk = ""
            lines = (tail + chunk).split("\n")
            tail = lines.pop()
            for line in lines:
                self._line(line)
            if stop or not (self.wanted or self.follow):
                return
            time.sleep(0.005)

    def _line(self, line: str) -> None:
        m = self.STEP.search(line)
        if not m:
            return
        step = int(m.group(1))
        self.times.setdefault(step, time.monotonic())
        self.losses.setdefault(step, float(m.group(2)))
        if step in self.wanted:
            self.samples[step] = tx_bytes()
            self.wanted.discard(step)
        if self.target is not None and self.crossed is None and step >= self.window:
            recent = [self.losses.get(k, math.inf) for k in range(step - self.window + 1, step + 1)]
            if statistics.fmean(recent) <= self.target:
                self.crossed = step
                self.samples.setdefault(step, tx_bytes())
                self.reached.set()


def trailing_means(losses: dict[int, float], window: int) -> dict[int, float]:
    """{step: mean of the losses of the last ``window`` steps up to it}, from step ``window`` on."""
    steps = sorted(losses)
    return {s: statistics.fmean(losses[k] for k in steps[i - window + 1:i + 1])
            for i, s in enumerate(steps) if i + 1 >= window}


def first_at_most(means: dict[int, float], target: float) -> int | None:
    return next((s for s in sorted(means) if means[s] <= target), None)


def schedule_of(name: str, args) -> int:
    """Training steps (the lr schedule's length) of ``name``: its ``--schedule`` entry, else ``--steps``."""
    return args.schedule.get(name, args.steps)


def train_args(name: str, args, overrides: dict) -> list[str]:
    train = [
        "--model.flavor", args.flavor, "--training.steps", str(schedule_of(name, args)), "--metrics.log_freq", "1",
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", str(args.nproc_per_node),
        "--optimizer.name", name, *cli_overrides(name, overrides),
    ]
    warmup = args.lr_warmup
    if args.lr_warmup_frac is not None:  # as scripts/convergence.py: a fraction of each run's own schedule
        warmup = max(1, int(schedule_of(name, args) * args.lr_warmup_frac))
    for flag, value in (("--training.dataset", args.dataset), ("--optimizer.lr", args.lr),
                        ("--lr_scheduler.warmup_steps", warmup), ("--debug.seed", args.seed)):
        if value is not None:
            train += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return train


def stop(procs: list[subprocess.Popen]) -> None:
    """End both nodes' torchrun and its workers (each node its own process group)."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.1)


def run_pair(name: str, addrs, args, dump: Path, overrides: dict, target: float | None = None,
             budget: float | None = None) -> dict:
    """One run of ``name`` across the two nodes. Window mode: step time and bytes over steps
    ``--warmup``+1 … ``--steps``. ``--to-loss`` mode (``args.to_loss`` set): until the trailing mean
    loss reaches ``target`` (None: train the whole schedule; the target is then this run's own final
    trailing mean, as for AdamW-HSDP with ``--to-loss auto``) or the budget ends."""
    shutil.rmtree(dump, ignore_errors=True)
    to_loss = args.to_loss is not None
    steps = schedule_of(name, args)
    port = 29400 + (abs(hash((name, time.time()))) % 1000)
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", f"{TAG}{port}"]
    train = train_args(name, args, overrides)
    logs = [dump.parent / f"{dump.name}_node{i}.log" for i in range(2)]
    sampler = StepCounterSampler(logs[0], {1, steps} if to_loss else {args.warmup, args.steps}, follow=to_loss,
                                 target=target, window=args.loss_window)
    sampler.start()
    procs = []
    for i, (ns, dev) in enumerate(zip(NS, VETH)):
        env = {**train_env(args.threads), "GLOO_SOCKET_IFNAME": dev, "MASTER_ADDR": addrs[0]}
        cmd = ["ip", "netns", "exec", ns, "env", *[f"{k}={v}" for k, v in env.items() if k in (
            "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH")],
               # node A's address is no hostname of this box: tell torchrun which agent hosts the store
               *torchrun_cmd(args.nproc_per_node, dump / f"node{i}", *train,
                             # the agents' 0.1 s default poll costs ~15% of a core each: slower here
                             rdzv=[*rdzv, "--local-addr", addrs[i], "--monitor-interval", "1",
                                   "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120"], tee=False)]
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    stopped = None  # why the run was ended before its schedule: "reached" | "budget"
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if sampler.reached.is_set():
                stopped = "reached"
                break
            if to_loss and budget and 1 in sampler.times and time.monotonic() - sampler.times[1] > budget:
                stopped = "budget"
                sampler.samples.setdefault(max(sampler.times), tx_bytes())  # the link bytes up to here
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(name, args.timeout)
            time.sleep(0.2)
    finally:
        stop(procs)
        sampler.done.set()
        sampler.join()
    rcs = [p.returncode for p in procs]
    if any(rcs) and stopped is None:
        raise RuntimeError(f"{name}: torchrun exit codes {rcs}; logs in {dump.parent}")
    if to_loss:
        return time_to_loss(name, sampler, target, stopped, steps, args)
    if set(sampler.samples) != {args.warmup, args.steps}:
        raise RuntimeError(f"{name}: no console line for steps {sorted(sampler.wanted)} in {logs[0]}")
    scalars = {}
    for i in range(2):
        if (dump / f"node{i}" / "tb").exists():
            scalars = read_scalars(dump / f"node{i}")
    window = args.steps - args.warmup
    times = [v for k, v in scalars["time_metrics/end_to_end(s)"] if k > args.warmup]
    mean = statistics.fmean(times)
    r_total = dict(scalars["comm/R_sent_bytes_total"])
    first, end = sampler.samples[args.warmup], sampler.samples[args.steps]
    return {
        "step_s": mean,
        "step_s_median": statistics.median(times),
        "tokens_per_s": args.batch * args.seq_len * 2 * args.nproc_per_node / mean,
        "link_bytes_per_step": [(b - a) / window for a, b in zip(first, end)],
        "ledger_r_node_per_step": (r_total[args.steps] - r_total[args.warmup]) / window * args.nproc_per_node,
        "loss": scalars["loss_metrics/global_avg_loss"][-1][1],
    }


def time_to_loss(name: str, sampler: StepCounterSampler, target: float | None, stopped: str | None, steps: int,
                 args) -> dict:
    """The ``--to-loss`` result of one run, from node A's console lines (wall clock from step 1's line)."""
    if 1 not in sampler.times:
        raise RuntimeError(f"{name}: no console line for step 1")
    last = max(sampler.times)
    if stopped is None and last != steps:
        raise RuntimeError(f"{name}: the run ended at step {last} of {steps}")
    means = trailing_means(sampler.losses, args.loss_window)
    if target is None:  # this run sets the target: its own final trailing mean
        if last not in means:
            raise RuntimeError(f"{name}: {last} steps are fewer than --loss-window {args.loss_window}")
        target = means[last]
    crossed = first_at_most(means, target)
    t0 = sampler.times[1]
    sampled = sorted(k for k in sampler.samples if k > 1)
    link = ([(b - a) / (sampled[-1] - 1) for a, b in zip(sampler.samples[1], sampler.samples[sampled[-1]])]
            if sampled and 1 in sampler.samples else [math.nan, math.nan])
    return {
        "target": target, "schedule": steps, "steps_run": last, "stopped": stopped or "schedule end",
        "reached_at_step": crossed, "time_to_loss_s": None if crossed is None else sampler.times[crossed] - t0,
        "wall_s": sampler.times[last] - t0, "step_s": (sampler.times[last] - t0) / max(1, last - 1),
        "best_trailing_loss": min(means.values()) if means else math.nan, "link_bytes_per_step": link,
        "curve": [[sampler.times[k] - t0, means[k]] for k in sorted(means)],
    }


def plot(results: dict, rates: list[str], path: str, title: str) -> None:
    """Mean step time per optimizer, one bar group per link rate (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(key.split("/", 1)[1] for key in results))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    width = 0.8 / max(len(rates), 1)
    for j, rate in enumerate(rates):
        xs = [i + j * width for i, n in enumerate(names) if f"{rate}/{n}" in results]
        ys = [results[f"{rate}/{n}"]["step_s"] for n in names if f"{rate}/{n}" in results]
        ax.bar(xs, ys, width, label=rate)
    ax.set_xticks([i + width * (len(rates) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("mean step time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss(results: dict, rates: list[str], path: str, title: str) -> None:
    """Trailing-mean loss against the wall clock since step 1, one panel per rate (every round: the
    first drawn solid, the others faint), AdamW-HSDP's target as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        runs = {key.split("/", 1)[1]: rounds for key, rounds in results.items() if key.split("/", 1)[0] == rate}
        for i, (name, rounds) in enumerate(runs.items()):
            color = f"C{i}"
            for j, r in enumerate(rounds):
                if r is None or not r["curve"]:
                    continue
                xs, ys = zip(*r["curve"])
                ax.plot(xs, ys, color=color, lw=1.3 if j == 0 else 0.7, alpha=1.0 if j == 0 else 0.4,
                        ls="--" if name == "AdamW" else "-", label=name if j == 0 else None)
        targets = [r["target"] for rounds in runs.values() for r in rounds if r is not None]
        if targets:
            ax.axhline(statistics.fmean(targets), color="k", lw=0.8, ls=":", label="AdamW-HSDP's final loss")
            ax.set_ylim(min(targets) - 0.15, min(targets) + 1.2)
        ax.set_xlabel("wall clock since step 1 (s)")
        ax.set_ylabel("training loss (trailing mean)")
        ax.set_title(f"{rate}", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_loss_table(rate_results: dict[str, list], names: list[str]) -> str:
    """Per optimizer: each round's time to the target and ÷ AdamW-HSDP's of the same round."""
    base = rate_results.get("AdamW", [])
    rows = []
    for name in names:
        rounds = rate_results.get(name)
        if not rounds:
            continue
        times, ratios, reached = [], [], []
        for j, r in enumerate(rounds):
            if r is None:
                times.append("failed")
                continue
            t = r["time_to_loss_s"]
            reached.append(f"{r['reached_at_step']}" if t is not None else f"– ({r['stopped']} at {r['steps_run']})")
            times.append(f"{t:.0f}" if t is not None else f"> {r['wall_s']:.0f}")
            b = base[j] if j < len(base) else None
            if t is not None and b is not None and b["time_to_loss_s"]:
                ratios.append(t / b["time_to_loss_s"])
        ok = [r for r in rounds if r is not None]
        spread = (f"{statistics.fmean(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1
                  else f"{ratios[0]:.2f}" if ratios else "–")
        rows.append([name, str(ok[0]["schedule"]) if ok else "–", f"{ok[0]['target']:.4f}" if ok else "–",
                     ", ".join(reached), ", ".join(times), ", ".join(f"{x:.2f}" for x in ratios) or "–", spread,
                     f"{statistics.fmean(r['step_s'] for r in ok):.3f}" if ok else "–",
                     human(statistics.fmean(r["link_bytes_per_step"][0] for r in ok)) if ok else "–"])
    return table(["optimizer", "schedule (steps)", "target loss", "reached at step (per round)",
                  "time to loss s (per round)", "÷ AdamW-HSDP (per round)", "÷ AdamW-HSDP, mean (range)",
                  "mean step s", "link A→B /step"], rows)


def parse_schedule(items: list[str], names: list[str]) -> dict[str, int]:
    out = {}
    for item in items or []:
        name, eq, steps = item.partition("=")
        if not eq or name not in names or not steps.isdigit() or int(steps) < 1:
            raise SystemExit(f"--schedule {item!r}: allowed is NAME=STEPS with NAME one of the optimizers run "
                             f"({', '.join(names)}) and STEPS an integer >= 1")
        out[name] = int(steps)
    return out


def main(argv=None) -> int:
    from titan_commopt.optim import available_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="tc rates of the link")
    p.add_argument("--delay", default="5ms", help="one-way netem delay per end (if the kernel has netem)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node = |S|")
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--steps", type=int, default=36, help="last step of the measured window (--to-loss: the "
                   "training steps, i.e. the lr schedule's length, of an optimizer without a --schedule entry)")
    p.add_argument("--warmup", type=int, default=4, help="steps before the measured window")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dataset", help="[training] dataset (default: the config's)")
    p.add_argument("--lr", type=float, help="[optimizer] lr of every optimizer (default: the config's; the presets scale it)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--lr-warmup", type=int, help="[lr_scheduler] warmup_steps (default: the config's)")
    warm.add_argument("--lr-warmup-frac", type=float,
                      help="[lr_scheduler] warmup_steps as this fraction of each run's training steps "
                      "(scripts/convergence.py's: 0.05)")
    p.add_argument("--seed", type=int, help="[debug] seed (default: the config's)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all optimizers; window mode keeps each one's fastest run (noise on shared "
                   "machines), --to-loss mode reports every round")
    p.add_argument("--to-loss", help="'auto' (AdamW-HSDP's final loss in the same round) or a loss: time each "
                   "optimizer until its trailing-mean loss reaches it")
    p.add_argument("--loss-window", type=int, default=50, help="--to-loss: steps in the trailing mean")
    p.add_argument("--schedule", nargs="*", default=[], metavar="NAME=STEPS",
                   help="--to-loss: training steps (lr schedule) of one optimizer, e.g. DiLoCo=2000")
    p.add_argument("--budget", type=float, help="--to-loss: wall-clock seconds after step 1 before a run is stopped")
    p.add_argument("--budget-x", type=float, help="--to-loss auto: the budget of each run, this multiple of "
                   "AdamW-HSDP's time to its loss in the same round (with --budget: the smaller)")
    p.add_argument("--subnet", default="10.213.77.0/24", help="private /24 living only in the namespaces")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default="outputs/bench_netns")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--png", help="write a bar chart of mean step time per optimizer and rate")
    p.add_argument("--plot-loss", help="--to-loss: write the loss-vs-wall-clock plot here")
    a = p.parse_args(argv)
    why = cannot_run()
    if why:
        print(f"SKIP: bench_netns cannot run here: {why}")
        return 0
    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    if "AdamW" in names:
        names = ["AdamW"] + [n for n in names if n != "AdamW"]
    a.schedule = parse_schedule(a.schedule, names)
    fixed_target = None
    if a.to_loss is not None:
        if a.budget_x is not None and a.to_loss != "auto":
            raise SystemExit("--budget-x: allowed only with --to-loss auto (a multiple of AdamW-HSDP's time)")
        if a.to_loss == "auto":
            if "AdamW" not in names:
                raise SystemExit("--to-loss auto: AdamW must be among --optimizers (its final loss is the target)")
        else:
            try:
                fixed_target = float(a.to_loss)
            except ValueError:
                raise SystemExit(f"--to-loss {a.to_loss!r}: allowed is 'auto' or a loss (a number)") from None
    overrides = parse_overrides(a.set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    addrs = setup(a.subnet)
    results = {}
    try:
        for rate in a.rates:
            applied = shape(rate, a.delay)
            what = (f"until the trailing mean of {a.loss_window} losses reaches "
                    f"{'AdamW-HSDP' + chr(39) + 's final one' if fixed_target is None else fixed_target}, {a.repeats} round(s)"
                    if a.to_loss is not None else
                    f"window: steps {a.warmup + 1}-{a.steps}, fastest of {a.repeats} run(s) each")
            print(f"\n## link: {applied}; {a.flavor}, |R|=2 nodes x |S|={a.nproc_per_node}, "
                  f"batch {a.batch} x seq {a.seq_len} per rank, {what}", flush=True)
            for round_ in range(a.repeats):  # rounds interleave the optimizers
                target, budget = fixed_target, a.budget
                for name in names:
                    if a.to_loss == "auto" and name != "AdamW" and target is None:
                        print(f"# {name} @ {rate}, round {round_}: skipped (no AdamW-HSDP target this round)",
                              file=sys.stderr, flush=True)
                        results.setdefault(f"{rate}/{name}", []).append(None)
                        continue
                    try:
                        r = run_pair(name, addrs, a, out / f"{rate}_{name}_{round_}", overrides,
                                     target=None if a.to_loss == "auto" and name == "AdamW" else target,
                                     budget=None if a.to_loss == "auto" and name == "AdamW" else budget)
                    except (RuntimeError, KeyError, subprocess.TimeoutExpired) as error:
                        print(f"# {name} @ {rate} failed: {error}", file=sys.stderr, flush=True)
                        if a.to_loss is not None:
                            results.setdefault(f"{rate}/{name}", []).append(None)
                        continue
                    if a.to_loss is not None:
                        if name == "AdamW" and a.to_loss == "auto":
                            target = r["target"]
                            if a.budget_x and r["time_to_loss_s"]:
                                budget = min(x for x in (a.budget, a.budget_x * r["time_to_loss_s"]) if x)
                        results.setdefault(f"{rate}/{name}", []).append(r)
                        t = r["time_to_loss_s"]
                        print(f"  {name}, round {round_}: " + (f"loss {r['target']:.4f} at step {r['reached_at_step']} "
                              f"after {t:.1f} s" if t is not None else f"not reached ({r['stopped']} after "
                              f"{r['steps_run']} steps, {r['wall_s']:.0f} s; best {r['best_trailing_loss']:.4f})"),
                              file=sys.stderr, flush=True)
                        continue
                    print(f"  {name}: {r['step_s']:.3f} s/step", file=sys.stderr, flush=True)
                    kept = results.get(f"{rate}/{name}")
                    if kept is None or r["step_s"] < kept["step_s"]:
                        results[f"{rate}/{name}"] = r
            if a.to_loss is not None:
                rate_results = {key.split("/", 1)[1]: v for key, v in results.items() if key.split("/", 1)[0] == rate}
                print(to_loss_table(rate_results, names), flush=True)
                continue
            base = results.get(f"{rate}/AdamW")
            rows = []
            for name in names:
                r = results.get(f"{rate}/{name}")
                if r is None:
                    continue
                speedup = f"{base['step_s'] / r['step_s']:.1f}x" if base else "-"
                rows.append([name, f"{r['step_s']:.3f}", f"{r['step_s_median']:.3f}", f"{r['tokens_per_s']:.0f}", speedup,
                             human(r["link_bytes_per_step"][0]), human(r["link_bytes_per_step"][1]),
                             human(r["ledger_r_node_per_step"]), f"{r['loss']:.3f}"])
            print(table(["optimizer", "step s (mean)", "step s (median)", "tokens/s", "speed-up vs AdamW-HSDP",
                         "link A→B /step", "link B→A /step", "ledger R sent /step /node", "final loss"], rows), flush=True)
    finally:
        teardown()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    title = f"two nodes over a tc-shaped link: {a.flavor}, |R|=2 x |S|={a.nproc_per_node}, batch {a.batch} x seq {a.seq_len}"
    if a.to_loss is not None:
        if a.plot_loss and results:
            plot_loss(results, a.rates, a.plot_loss, title)
        return 0
    if a.png and results:
        plot(results, a.rates, a.png, f"{title}, steps {a.warmup + 1}-{a.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
