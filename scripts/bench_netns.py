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
- the ledger's R bytes over the same window (``comm/R_sent_bytes_total``), summed over a node's ranks;
- with two rates or more, each slower rate's floor, max(compute step, the busier direction's link bytes
  per step ÷ the rate), the compute step being the same optimizer's mean on the fastest rate of the
  run, and the mean step ÷ that floor, also for each of ``--repeats`` runs (their spread).

**Time to AdamW-HSDP's loss** (``--to-loss``, issue 39): each optimizer trains (its own ``--schedule``
length, default ``--steps``) with the global model evaluated on held-out text (torchtitan's
``[validation]``: the held-out twin of ``--dataset``, ``--eval-steps`` batches every ``--eval-every``
steps, as ``scripts/convergence.py`` does) until the first evaluation whose held-out loss is at most
the target, or the end of its schedule, or ``--budget`` training seconds; then both nodes are
stopped. The target: ``study`` — AdamW-HSDP's final held-out loss in a convergence study
(``--targets-from DIR``: its run at M = 2, this flavor, AdamW's schedule, these tokens per step and
seed; each optimizer then trains at its best lr there, with the study's 5 % warm-up); ``auto`` —
AdamW-HSDP's own final held-out loss in the same round (it runs first, its whole schedule); or a
number. **Time is training time**: the wall clock between node A's console lines of step 1 and of
the step reached, less every evaluation in between (each one the time from a step's line to its
``validate step:`` line: torchtitan evaluates right after the step is logged; start-up and step 1
left out, alike for every optimizer), interpolated linearly between the evaluation before the
crossing and the first at or below the target. Each round gives each optimizer's time ÷ AdamW-HSDP's
of the same round (``--repeats``: rounds interleave the optimizers); every run prints the box's
1-minute load average at its start and end (a run beside other work is to be repeated).
``--plot-loss`` draws the held-out loss against those training seconds, per rate. The link bytes
per step include the evaluations' few scalar all-reduces.

**The link rate of an 8B cluster** (``--match-8b-ratio [LINK]``, default 10gbit, instead of
``--rates``): ``scripts/project_time_to_loss.py``'s AdamW-HSDP R time per step ÷ its compute per step
for llama3 8B on 2 × 8 H100 at LINK per node (≈ 18 at 10 Gbit/s) is the target ratio. AdamW-HSDP
runs steps ``--warmup``+1 … ``--calibrate-steps`` over the unshaped veth (its step = the compute),
then over a trial rate (with ``--delay``) that would send the bytes it measured in target ×
compute; link time = shaped step − compute, taken to scale as 1/rate: the next rate is solved from
it and measured again to confirm (``--calibrate-tries`` at most, until within 15 %). Both ratios,
every trial and the rate kept are printed; the runs that follow (``--to-loss``, or the window
table) use that rate.

The study's run (issue 39: 2 × 2 processes and 16 × 128 tokens per step as the convergence study at
M = 2, every optimizer on the study's schedule, so that it reaches the target at the study's
iso-loss step or not at all; ``--schedule NAME=STEPS`` gives one a longer one, and with it another lr
schedule; 2 rounds, on a quiet box):

    sudo nice -n 19 .venv/bin/python scripts/bench_netns.py --match-8b-ratio 10gbit --to-loss study \
        --targets-from /tmp/study39 --optimizers AdamW DeMo DiLoCo SparseLoCo --flavor cpu_micro --nproc-per-node 2 \
        --batch 4 --dataset commopt_world --steps 615 --repeats 2 --out /tmp/ttl39 --json /tmp/ttl39/ttl.json \
        --plot-loss /tmp/ttl39/loss.png

Exits 0 with "SKIP: ..." when it cannot run (not root, no ``ip``/``tc``, namespaces not permitted).
"""

import argparse
import atexit
import ipaddress
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import (  # noqa: E402
    CONFIG, ROOT, Timeline, cli_overrides, eval_steps_for, human, parse_overrides, read_scalars, table, torchrun_cmd,
    train_env, validation_flags,
)
from scripts.comm_report import parse_link  # noqa: E402
from scripts.convergence import (  # noqa: E402
    EVALUATIONS_PER_RUN, STUDY_ADAMW_LR, adamw_by_seed, best_lrs, final_heldout, group_of, groups, iso_loss_step,
    load_results, nearest_divisor,
)
from titan_commopt.corpora import HELD_OUT  # noqa: E402

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


def shape(rate: str, delay: str, queue: str = "400ms", burst: str = "256kbit") -> str:
    """Shape both ends of the link; returns what was applied. ``queue``: tbf's ``latency``, the
    longest a packet waits in the link's FIFO queue (deeper: tail drops later, queueing delay longer);
    ``burst``: tbf's bucket, the bytes that pass at the veth's speed after the link was idle."""
    applied = f"tbf rate {rate} queue {queue} burst {burst}"
    netem = False
    for ns, dev in zip(NS, VETH):
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        netem = bool(delay) and sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                                   delay, "limit", "100000", check=False).returncode == 0
        parent = ["parent", "1:1", "handle", "10:"] if netem else ["root", "handle", "10:"]
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate, "burst", burst, "latency", queue)
    if netem:
        return f"netem delay {delay} + {applied}"
    return applied + (" (no netem in this kernel: no added delay)" if delay else "")


def tx_bytes() -> list[int]:
    out = []
    for ns, dev in zip(NS, VETH):
        info = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)[0]
        out.append(int(info["stats64"]["tx"]["bytes"]))
    return out


def unshape() -> str:
    """No qdisc on either end: the link as fast as the veth (the compute baseline of a calibration)."""
    for ns, dev in zip(NS, VETH):
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    return "unshaped (veth, no tc)"


def tc_rate(bits_per_s: float) -> str:
    """A rate as tc reads it (kbit: whole numbers are fine enough)."""
    return f"{max(1, round(bits_per_s / 1e3))}kbit"


class ConsoleSampler(threading.Thread):
    """Follows node A's console log (:class:`Timeline`): reads the veth tx counters when given steps'
    lines first appear and, with a ``target``, sets :attr:`reached` at the first evaluation whose
    held-out loss is at most it, :attr:`over_budget` once the training seconds pass ``budget``.

    torchtitan prints ``step: N  loss: ...`` once step N has finished (``log_freq = 1``) and
    ``validate step: N  loss: ...`` after the evaluation that follows it, straight into the log (no
    torchrun tee in between); sampling at the lines of the window's first and last step leaves
    start-up and shutdown traffic out.
    """

    def __init__(self, log: Path, steps: set[int], follow: bool = False, target: float | None = None,
                 budget: float | None = None) -> None:
        super().__init__(daemon=True)
        self.log, self.wanted, self.samples, self.follow = log, set(steps), {}, follow
        self.timeline = Timeline()
        self.target, self.budget = target, budget
        self.lock = threading.Lock()  # the timeline grows in this thread; the caller reads it
        self.done, self.reached, self.over_budget = threading.Event(), threading.Event(), threading.Event()

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
        with self.lock:
            seen = self.timeline.add(line, arrival=time.time())
        if seen is None:
            return
        kind, step = seen
        if kind == "step" and step in self.wanted:
            self.samples[step] = tx_bytes()
            self.wanted.discard(step)
        if kind == "step" and self.budget is not None and self.training_seconds(step) > self.budget:
            self.samples.setdefault(step, tx_bytes())  # the link bytes up to here
            self.over_budget.set()
        if kind == "validate" and self.target is not None and not self.reached.is_set():
            if self.timeline.eval_losses[step] <= self.target:
                self.samples.setdefault(step, tx_bytes())
                self.reached.set()

    def training_seconds(self, upto: int) -> float:
        with self.lock:
            return self.timeline.training_seconds(upto)


def schedule_of(name: str, args) -> int:
    """Training steps (the lr schedule's length) of ``name``: its ``--schedule`` entry, else ``--steps``."""
    return args.schedule.get(name, args.steps)


def train_args(name: str, args, overrides: dict) -> list[str]:
    train = [
        "--model.flavor", args.flavor, "--training.steps", str(schedule_of(name, args)),
        "--metrics.log_freq", str(args.log_freq),
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", str(args.nproc_per_node),
        "--optimizer.name", name, *cli_overrides(name, overrides),
    ]
    warmup = args.lr_warmup
    if args.lr_warmup_frac is not None:  # as scripts/convergence.py: a fraction of each run's own schedule
        warmup = max(1, int(schedule_of(name, args) * args.lr_warmup_frac))
    for flag, value in (("--training.dataset", args.dataset), ("--optimizer.lr", args.lrs.get(name, args.lr)),
                        ("--lr_scheduler.warmup_steps", warmup), ("--debug.seed", args.seed)):
        if value is not None:
            train += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.to_loss is not None:
        train += validation_flags(args.dataset, args.eval_every, args.eval_steps, args.batch, args.seq_len)
    else:  # the window measures training: an evaluation of a global model that needs an average (DES-LOC,
        # MT-DAO) would put its bytes on the link counters though not in any step's time
        train += ["--validation.enable", "false"]
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
    ``--warmup``+1 … ``--steps``. ``--to-loss`` mode (``args.to_loss`` set): until an evaluation's
    held-out loss reaches ``target`` (None: train the whole schedule; the target is then this run's own
    final held-out loss, as for AdamW-HSDP with ``--to-loss auto``) or ``budget`` training seconds pass."""
    shutil.rmtree(dump, ignore_errors=True)
    to_loss = args.to_loss is not None
    steps = schedule_of(name, args)
    port = 29400 + (abs(hash((name, time.time()))) % 1000)
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", f"{TAG}{port}"]
    train = train_args(name, args, overrides)
    logs = [dump.parent / f"{dump.name}_node{i}.log" for i in range(2)]
    sampler = ConsoleSampler(logs[0], {1, steps} if to_loss else {args.warmup, args.steps}, follow=to_loss,
                             target=target, budget=budget)
    load_before = os.getloadavg()[0]
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
            if sampler.over_budget.is_set():
                stopped = "budget"
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(name, args.timeout)
            time.sleep(0.2)
    finally:
        stop(procs)
        sampler.done.set()
        sampler.join()
    load = [load_before, os.getloadavg()[0]]
    rcs = [p.returncode for p in procs]
    if any(rcs) and stopped is None:
        raise RuntimeError(f"{name}: torchrun exit codes {rcs}; logs in {dump.parent}")
    if to_loss:
        return {**time_to_loss(name, sampler, target, stopped, steps), "lr": args.lrs.get(name, args.lr),
                "load_average": load}
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
        "load_average": load,
    }


def time_to_loss(name: str, sampler: ConsoleSampler, target: float | None, stopped: str | None, steps: int) -> dict:
    """The ``--to-loss`` result of one run, from node A's console lines. Times are training seconds
    (:meth:`Timeline.training_seconds`: from step 1's line, the evaluations left out); the time to the
    loss is interpolated linearly in those seconds between the evaluation before the crossing and the
    first one at or below the target (``iso_loss_step``, as the study's steps)."""
    timeline = sampler.timeline
    if 1 not in timeline.steps:
        raise RuntimeError(f"{name}: no console line for step 1")
    last = max(timeline.steps)
    if stopped is None and last != steps:
        raise RuntimeError(f"{name}: the run ended at step {last} of {steps}")
    evaluated = sorted(k for k in timeline.eval_losses if k in timeline.steps)
    losses = [timeline.eval_losses[k] for k in evaluated]
    if target is None:  # this run sets the target: its own final held-out loss
        if not evaluated or evaluated[-1] != steps:
            raise RuntimeError(f"{name}: step {steps} was not evaluated (--eval-every must divide it)")
        target = losses[-1]
    curve = [[timeline.training_seconds(k), loss, k] for k, loss in zip(evaluated, losses)]
    scored = crossing(curve, target)
    upto = scored["reached_at_step"] or last
    sampled = sorted(k for k in sampler.samples if 1 < k <= upto)
    link = ([(b - a) / (sampled[-1] - 1) for a, b in zip(sampler.samples[1], sampler.samples[sampled[-1]])]
            if sampled and 1 in sampler.samples else [math.nan, math.nan])
    train_s = timeline.training_seconds(last)
    return {
        **scored, "schedule": steps, "steps_run": last, "stopped": stopped or "schedule end",
        "train_s": train_s, "eval_s": timeline.eval_seconds(), "step_s": train_s / max(1, last - 1),
        "best_heldout": min(losses) if losses else math.nan, "link_bytes_per_step": link, "curve": curve,
    }


def floor_ratio(step_s: float, compute_s: float, link_bytes_per_step: list[float], rate: str) -> tuple[float, float]:
    """The physical floor of a step on this link and the step's ratio to it: no overlap can make the
    mean step shorter than the larger of its compute (the same optimizer's step on the fastest link of
    the run) and the time its busier direction's bytes need at ``rate``."""
    floor = max(compute_s, max(link_bytes_per_step) * 8 / parse_link(rate))
    return floor, step_s / floor


def crossing(curve: list, target: float) -> dict:
    """Where a held-out curve (``[training s, loss, step]`` per evaluation) first reaches ``target``:
    the evaluation, and the step and training seconds interpolated before it (None: never)."""
    seconds, losses, steps = (list(v) for v in zip(*curve)) if curve else ([], [], [])
    return {"target": target, "reached_at_step": next((k for k, loss in zip(steps, losses) if loss <= target), None),
            "iso_loss_step": iso_loss_step(steps, losses, target), "time_to_loss_s": iso_loss_step(seconds, losses, target)}


def missed_study_target(adamw: dict) -> bool:
    """AdamW-HSDP trained its whole schedule (the study's) here and its final evaluation stayed above
    the study's final loss: the same run on another process layout, whose last digits may differ."""
    return adamw["time_to_loss_s"] is None and bool(adamw["curve"]) and adamw["curve"][-1][2] == adamw["schedule"]


# ---- the link rate at which AdamW-HSDP's link time ÷ compute time is the 8B cluster's -------------------
CONSOLE_DECIMALS = 4  # of the held-out loss in torchtitan 0.2.2's "validate step: N  loss: X.XXXX" line
CALIBRATION_TOLERANCE = 0.15  # a measured ratio this close to the target confirms the rate


def solve_rate(measure, target_ratio: float, tries: int = 3, tolerance: float = CALIBRATION_TOLERANCE) -> dict:
    """Find the tc rate at which AdamW-HSDP's measured link time ÷ compute time is ``target_ratio``.

    ``measure(bits_per_s or None)`` runs AdamW-HSDP over the link at that rate (None: unshaped) and
    returns its mean step seconds and the link bytes per step. Compute = the unshaped step; link time
    = a shaped step − compute. The first trial rate sends the measured bytes in ``target_ratio`` ×
    compute; each next one scales the last by its ratio ÷ the target (link time ~ 1/rate for fixed
    bytes), until a solved rate is confirmed within ``tolerance`` of the target or ``tries`` (≥ 2)
    trials ran. The rate kept is the trial nearest the target, with its measured (achieved) ratio."""
    base = measure(None)
    compute = base["step_s"]
    bits = 8 * max(base["link_bytes_per_step"])
    rate = bits / (target_ratio * compute)
    trials = []
    for _ in range(max(2, tries)):
        shaped = measure(rate)
        link = shaped["step_s"] - compute
        trials.append({"rate_bps": rate, "step_s": shaped["step_s"], "link_s": link, "ratio": link / compute,
                       "load_average": shaped.get("load_average")})
        if len(trials) > 1 and abs(link / compute / target_ratio - 1) <= tolerance:
            break  # a solved rate, confirmed
        # a shaped step no slower than the compute (noise, or a rate far too fast): a 4x slower link next
        rate = rate / 4 if link <= 0 else rate * (link / compute) / target_ratio
    kept = min(trials, key=lambda t: abs(math.log(max(t["ratio"], 1e-9) / target_ratio)))
    return {"target_ratio": target_ratio, "compute_s": compute, "link_bytes_per_step": base["link_bytes_per_step"],
            "compute_load_average": base.get("load_average"), "trials": trials, "rate_bps": kept["rate_bps"],
            "achieved_ratio": kept["ratio"], "within_tolerance": abs(kept["ratio"] / target_ratio - 1) <= tolerance}


def calibrate(addrs, args, overrides: dict, out: Path) -> dict:
    """:func:`solve_rate` on this box: AdamW-HSDP in window mode (steps ``--warmup``+1 …
    ``--calibrate-steps``), unshaped then at each trial rate (with ``--delay``)."""
    from scripts.project_time_to_loss import adamw_link_to_compute

    target = adamw_link_to_compute(args.match_8b_ratio)
    window = argparse.Namespace(**{**vars(args), "to_loss": None, "steps": args.calibrate_steps, "schedule": {}})

    def measure(bits_per_s: float | None) -> dict:
        applied = unshape() if bits_per_s is None else shape(tc_rate(bits_per_s), args.delay, args.queue, args.burst)
        r = run_pair("AdamW", addrs, window, out / f"calibrate_{'unshaped' if bits_per_s is None else tc_rate(bits_per_s)}",
                     overrides)
        print(f"  calibration, AdamW-HSDP over {applied}: {r['step_s']:.3f} s/step, link A→B "
              f"{human(r['link_bytes_per_step'][0])}/step, load average {r['load_average'][0]:.1f} → "
              f"{r['load_average'][1]:.1f}", file=sys.stderr, flush=True)
        return r

    print(f"\n## calibration: the link rate at which AdamW-HSDP's measured link time ÷ compute time is the 8B "
          f"2 × 8 H100 ratio at {args.match_8b_ratio} per node (scripts/project_time_to_loss.py: {target:.2f})",
          flush=True)
    found = solve_rate(measure, target, args.calibrate_tries)
    rows = [["unshaped (compute)", f"{found['compute_s']:.3f}", "–", "–"]]
    rows += [[tc_rate(t["rate_bps"]), f"{t['step_s']:.3f}", f"{t['link_s']:.3f}", f"{t['ratio']:.2f}"]
             for t in found["trials"]]
    print(table(["AdamW-HSDP's link", "step s (mean)", "link s = step − compute", "link ÷ compute"], rows))
    print(f"target ratio {target:.2f} (8B, 2 × 8 H100, {args.match_8b_ratio} per node, computed); achieved "
          f"{found['achieved_ratio']:.2f} (measured) at {tc_rate(found['rate_bps'])}"
          + ("" if found["within_tolerance"] else f" — not within {CALIBRATION_TOLERANCE:.0%} after "
             f"{len(found['trials'])} trials"), flush=True)
    return {**found, "link": args.match_8b_ratio, "rate": tc_rate(found["rate_bps"])}


def study_target(study: dict, flavor: str, steps: int, tokens_per_step: int, seed: int) -> tuple[float, dict, dict]:
    """(AdamW-HSDP's final held-out loss, each optimizer's best lr, AdamW-HSDP's run) from a
    convergence study at M = 2 (the two nodes), this flavor, steps, tokens per step and seed. Not
    there: ``ValueError``, one line."""
    group = (2, flavor, steps, tokens_per_step)
    runs = [r for r in study.values() if group_of(r) == group]
    adamw = adamw_by_seed(study, group).get(seed)
    target = final_heldout(adamw) if adamw else None
    if target is None:
        have = "; ".join(f"M={m} {f} {n} steps {t} tokens/step" for m, f, n, t in groups(study)) or "none"
        raise ValueError(f"--targets-from: no AdamW-HSDP run with a final held-out loss at M=2 {flavor} {steps} steps "
                         f"{tokens_per_step} tokens/step seed {seed} (the study has: {have})")
    return target, best_lrs(runs), adamw


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
    """Held-out loss against the training seconds since step 1 (evaluations left out; log scale), one
    panel per rate (every round: the first drawn solid, the others faint), the target as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        runs = {key.split("/", 1)[1]: rounds for key, rounds in results.items() if key.split("/", 1)[0] == rate}
        for i, (name, rounds) in enumerate(runs.items()):
            color = "k" if name == "AdamW" else f"C{i}"
            for j, r in enumerate(rounds):
                if r is None or not r["curve"]:
                    continue
                xs, ys, _ = zip(*r["curve"])
                ax.plot(xs, ys, color=color, lw=1.3 if j == 0 else 0.7, alpha=1.0 if j == 0 else 0.4, marker=".",
                        ms=3, ls="--" if name == "AdamW" else "-", label=name if j == 0 else None)
        targets = [r["target"] for rounds in runs.values() for r in rounds if r is not None]
        if targets:
            ax.axhline(statistics.fmean(targets), color="k", lw=0.8, ls=":", label="target: AdamW-HSDP's final held-out loss")
            ax.set_ylim(min(targets) - 0.15, min(targets) + 1.2)
        ax.set_xscale("log")  # compressors reach in a tenth of AdamW-HSDP's time or less: one scale shows both
        ax.set_xlabel("training seconds since step 1 (evaluations left out; log scale)")
        ax.set_ylabel("held-out loss of the global model")
        ax.set_title(f"{rate}", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
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
        times, ratios, reached, loads = [], [], [], []
        for j, r in enumerate(rounds):
            if r is None:
                times.append("failed")
                continue
            t = r["time_to_loss_s"]
            reached.append(f"{r['iso_loss_step']:.0f} ({r['reached_at_step']})" if t is not None
                           else f"– ({r['stopped']} at {r['steps_run']}, best {r['best_heldout']:.4f})")
            times.append(f"{t:.1f}" if t is not None else f"> {r['train_s']:.0f}")
            loads.append(f"{r['load_average'][0]:.1f}–{r['load_average'][1]:.1f}")
            b = base[j] if j < len(base) else None
            if t is not None and b is not None and b["time_to_loss_s"]:
                ratios.append(t / b["time_to_loss_s"])
        ok = [r for r in rounds if r is not None]
        spread = (f"{statistics.fmean(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1
                  else f"{ratios[0]:.2f}" if ratios else "–")
        rows.append([name, "–" if not ok else "the config's" if ok[0]["lr"] is None else f"{ok[0]['lr']:g}", str(ok[0]["schedule"]) if ok else "–",
                     f"{ok[0]['target']:.4f}" if ok else "–", ", ".join(reached), ", ".join(times),
                     ", ".join(f"{x:.2f}" for x in ratios) or "–", spread,
                     f"{statistics.fmean(r['step_s'] for r in ok):.3f}" if ok else "–",
                     f"{statistics.fmean(r['eval_s'] for r in ok):.1f}" if ok else "–",
                     human(statistics.fmean(r["link_bytes_per_step"][0] for r in ok)) if ok else "–", ", ".join(loads)])
    return table(["optimizer", "lr", "schedule (steps)", "target held-out loss",
                  "reached at step: interpolated (first evaluation at or below), per round",
                  "training s to loss (per round)", "÷ AdamW-HSDP (per round)", "÷ AdamW-HSDP, mean (range)",
                  "training s/step", "evaluation s", "link A→B /step", "load average, start–end (per round)"], rows)


def add_floors(results: dict, rates: list[str]) -> None:
    """Window mode: on each rate slower than the run's fastest, each optimizer's ``floor_s``, its fastest
    run's ``floor_ratio`` and every run's (``floor_ratio_runs``), the compute being its step on the fastest."""
    fastest = max(rates, key=parse_link)
    for rate in rates:
        if parse_link(rate) >= parse_link(fastest):
            continue
        for key, r in results.items():
            at, name = key.split("/", 1)
            compute = results.get(f"{fastest}/{name}")
            if at != rate or compute is None:
                continue
            r["floor_s"], r["floor_ratio"] = floor_ratio(r["step_s"], compute["step_s"], r["link_bytes_per_step"], rate)
            r["floor_ratio_runs"] = [floor_ratio(s, compute["step_s"], r["link_bytes_per_step"], rate)[1]
                                     for s in r["step_s_runs"]]


def window_table(results: dict, rate: str, rates: list[str], names: list[str]) -> str:
    """Window mode's table at one rate: each optimizer's fastest run, the spread of its runs, and
    (:func:`add_floors`, where the run also measured a faster rate) its step ÷ the floor."""
    base = results.get(f"{rate}/AdamW")
    rows = []
    for name in names:
        r = results.get(f"{rate}/{name}")
        if r is None:
            continue
        speedup = f"{base['step_s'] / r['step_s']:.1f}x" if base else "-"
        runs, spread = r["step_s_runs"], r.get("floor_ratio_runs")
        over_floor = (f"{r['floor_s']:.3f} s: {r['floor_ratio']:.2f}x ({min(spread):.2f}-{max(spread):.2f})"
                      if spread else "-")
        rows.append([name, f"{r['step_s']:.3f}", f"{min(runs):.3f}-{max(runs):.3f} ({len(runs)})",
                     f"{r['step_s_median']:.3f}", f"{r['tokens_per_s']:.0f}", speedup, over_floor,
                     human(r["link_bytes_per_step"][0]), human(r["link_bytes_per_step"][1]),
                     human(r["ledger_r_node_per_step"]), f"{r['loss']:.3f}"])
    return table(["optimizer", "step s (mean)", "runs' means", "step s (median)", "tokens/s", "speed-up vs AdamW-HSDP",
                  f"floor, step ÷ floor (runs) vs {max(rates, key=parse_link)}", "link A→B /step", "link B→A /step",
                  "ledger R sent /step /node", "final loss"], rows)


def parse_schedule(items: list[str], names: list[str]) -> dict[str, int]:
    out = {}
    for item in items or []:
        name, eq, steps = item.partition("=")
        if not eq or name not in names or not steps.isdigit() or int(steps) < 1:
            raise SystemExit(f"--schedule {item!r}: allowed is NAME=STEPS with NAME one of the optimizers run "
                             f"({', '.join(names)}) and STEPS an integer >= 1")
        out[name] = int(steps)
    return out


def config_default(section: str, key: str):
    """A value of ``train_configs/debug_cpu.toml``, the config every run starts from."""
    import tomllib

    return tomllib.loads(CONFIG.read_text())[section][key]


def prepare_to_loss(a, names: list[str]) -> float | None:
    """Checks and completes the ``--to-loss`` arguments (the dataset, the seed, the evaluation, a
    study's target and best lrs); returns the fixed target (None: ``auto``). Bad input: one line, exit 2."""
    a.dataset = a.dataset or config_default("training", "dataset")
    a.seed = a.seed if a.seed is not None else config_default("debug", "seed")
    if a.dataset not in HELD_OUT:
        raise SystemExit(f"--dataset {a.dataset!r}: --to-loss scores held-out text; allowed is a corpus with a held-out "
                         f"twin ({', '.join(HELD_OUT)})")
    if a.budget_x is not None and a.to_loss not in ("auto", "study"):
        raise SystemExit("--budget-x: allowed with --to-loss auto or study (a multiple of AdamW-HSDP's time in the round)")
    if "AdamW" not in names:
        raise SystemExit("--to-loss: AdamW must be among --optimizers (its time is the denominator)")
    adamw_steps = schedule_of("AdamW", a)
    tokens_per_step = a.batch * a.seq_len * 2 * a.nproc_per_node
    a.eval_every = a.eval_every or nearest_divisor(adamw_steps, adamw_steps / EVALUATIONS_PER_RUN)
    if adamw_steps % a.eval_every:
        raise SystemExit(f"--eval-every {a.eval_every} does not divide AdamW's schedule ({adamw_steps} steps): its final "
                         f"held-out loss is the last step's; allowed is a divisor, e.g. "
                         f"{nearest_divisor(adamw_steps, a.eval_every)}")
    a.eval_steps = a.eval_steps or eval_steps_for(tokens_per_step)
    if (a.targets_from is not None) != (a.to_loss == "study"):
        raise SystemExit("--targets-from: allowed together with --to-loss study (and --to-loss study needs it)")
    if a.to_loss == "auto":
        return None
    if a.to_loss == "study":
        study = load_results(Path(a.targets_from) / "convergence.json")
        try:
            target, lrs, adamw = study_target(study, a.flavor, adamw_steps, tokens_per_step, a.seed)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if adamw["dataset"] != a.dataset:
            raise SystemExit(f"--dataset {a.dataset}: the study's AdamW-HSDP trained on {adamw['dataset']}")
        # the console prints held-out losses to 4 decimals (torchtitan's "validate step:" line), the study
        # kept TensorBoard's float: compared with the printed ones, the target is rounded the same way
        target = round(target, CONSOLE_DECIMALS)
        a.lrs = {**{n: lr for n, lr in lrs.items() if n in names}, **a.lrs}
        a.lr = STUDY_ADAMW_LR if a.lr is None else a.lr  # an optimizer the study lacks: the study's default lr
        if a.lr_warmup is None and a.lr_warmup_frac is None:
            a.lr_warmup_frac = 0.05  # scripts/convergence.py's warm-up
        print(f"# target {target:.4f}: AdamW-HSDP's final held-out loss in {a.targets_from} (lr {adamw['lr']:g}, seed "
              f"{a.seed}, {adamw_steps} steps); lrs (the study's best; --lr where it has no run): "
              + ", ".join(f"{n} {a.lrs.get(n, a.lr):g}" for n in names), file=sys.stderr, flush=True)
        return target
    try:
        return float(a.to_loss)
    except ValueError:
        raise SystemExit(f"--to-loss {a.to_loss!r}: allowed is 'auto', 'study' or a loss (a number)") from None


def main(argv=None) -> int:
    from titan_commopt.optim import available_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", help="tc rates of the link (default 100mbit 1gbit)")
    p.add_argument("--delay", default="5ms", help="one-way netem delay per end (if the kernel has netem)")
    p.add_argument("--queue", default="400ms", help="tbf latency: the longest a packet waits in each end's FIFO "
                   "queue. A bulk transfer fills it, and every small collective crossing the link meanwhile "
                   "(torchtitan's token count, the clip's norm) waits behind it (docs/benchmarks.md §2)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node = |S|")
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--steps", type=int, default=36, help="last step of the measured window (--to-loss: the "
                   "training steps, i.e. the lr schedule's length, of an optimizer without a --schedule entry)")
    p.add_argument("--warmup", type=int, default=4, help="steps before the measured window")
    p.add_argument("--burst", default="256kbit",
                   help="tbf burst: what passes at the veth's speed after the link was idle (256kbit = 32 KB: at low "
                   "rates a small sync fits in it and is not shaped; give about two packets, 24kbit, there)")
    p.add_argument("--log-freq", type=int, default=1,
                   help="window mode: [metrics] log_freq. Every log step sends torchtitan's loss all-reduces across "
                   "R; 1 times every step, 10 is what a user logs. --warmup and --steps must be multiples of it "
                   "(the step time of a log step is the mean over its interval)")
    p.add_argument("--batch", type=int, default=4, help="sequences per process")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dataset", help="[training] dataset (default: the config's)")
    p.add_argument("--lr", type=float, help="[optimizer] lr of every optimizer (default: the config's; the presets scale it)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--lr-warmup", type=int, help="[lr_scheduler] warmup_steps (default: the config's)")
    warm.add_argument("--lr-warmup-frac", type=float,
                      help="[lr_scheduler] warmup_steps as this fraction of each run's training steps "
                      "(scripts/convergence.py's: 0.05; --to-loss study: the default)")
    p.add_argument("--seed", type=int, help="[debug] seed (default: the config's)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all optimizers; window mode keeps each one's fastest run (noise on shared "
                   "machines), --to-loss mode reports every round")
    p.add_argument("--to-loss", help="'auto' (AdamW-HSDP's final held-out loss in the same round), 'study' (in "
                   "--targets-from's study) or a loss: train each optimizer until an evaluation reaches it")
    p.add_argument("--targets-from", metavar="DIR", help="--to-loss study: a scripts/convergence.py study's out folder "
                   "(AdamW-HSDP at M = 2, this flavor, AdamW's schedule, these tokens per step and seed; its best lrs)")
    p.add_argument("--eval-every", type=int, help="--to-loss: steps between evaluations (default: AdamW's schedule "
                   "÷ 40, dividing it)")
    p.add_argument("--eval-steps", type=int, help="--to-loss: batches per evaluation (default: ~64k held-out tokens)")
    p.add_argument("--schedule", nargs="*", default=[], metavar="NAME=STEPS",
                   help="--to-loss: training steps (lr schedule) of one optimizer, e.g. DiLoCo=4000")
    p.add_argument("--budget", type=float, help="--to-loss: training seconds after step 1 before a run is stopped")
    p.add_argument("--budget-x", type=float, help="--to-loss auto or study: the budget of each run, this multiple of "
                   "AdamW-HSDP's time to its loss in the same round (with --budget: the smaller)")
    p.add_argument("--match-8b-ratio", nargs="?", const="10gbit", metavar="LINK",
                   help="instead of --rates: the rate at which AdamW-HSDP's measured link time ÷ compute time equals "
                   "the 8B 2 x 8 H100 ratio at LINK per node (default 10gbit; scripts/project_time_to_loss.py)")
    p.add_argument("--calibrate-steps", type=int, default=20, help="--match-8b-ratio: last step of each measured window")
    p.add_argument("--calibrate-tries", type=int, default=3, help="--match-8b-ratio: shaped trials at most")
    p.add_argument("--subnet", default="10.213.77.0/24", help="private /24 living only in the namespaces")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default="outputs/bench_netns")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--png", help="write a bar chart of mean step time per optimizer and rate")
    p.add_argument("--plot-loss", help="--to-loss: write the held-out loss vs training seconds plot here")
    a = p.parse_args(argv)
    if a.log_freq < 1 or (a.log_freq > 1 and (a.to_loss is not None or a.match_8b_ratio
                                                 or a.warmup % a.log_freq or a.steps % a.log_freq)):
        p.error(f"--log-freq {a.log_freq}: allowed is 1, or (window mode, without --to-loss and --match-8b-ratio) "
                f"a number dividing --warmup ({a.warmup}) and --steps ({a.steps})")
    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    if "AdamW" in names:
        names = ["AdamW"] + [n for n in names if n != "AdamW"]
    a.schedule = parse_schedule(a.schedule, names)
    a.lrs = {}
    if a.match_8b_ratio and a.rates:
        raise SystemExit("--match-8b-ratio: the rate is found, not given; allowed without --rates")
    if a.match_8b_ratio:
        try:
            parse_link(a.match_8b_ratio)
        except ValueError as error:  # comm_report's words name its own flag
            raise SystemExit(str(error).replace("--link", "--match-8b-ratio", 1)) from None
        if a.calibrate_steps <= a.warmup:
            raise SystemExit(f"--calibrate-steps {a.calibrate_steps}: allowed is more than --warmup ({a.warmup})")
    rates = a.rates or ["100mbit", "1gbit"]
    fixed_target = prepare_to_loss(a, names) if a.to_loss is not None else None
    why = cannot_run()
    if why:
        print(f"SKIP: bench_netns cannot run here: {why}")
        return 0
    overrides = parse_overrides(a.set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    addrs = setup(a.subnet)
    results, calibration = {}, None

    def save() -> None:  # after every run too: an interrupted --to-loss study keeps the runs it finished
        if a.json:
            Path(a.json).write_text(json.dumps({"calibration": calibration, "target": fixed_target, "runs": results},
                                               indent=1))
    try:
        if a.match_8b_ratio:
            calibration = calibrate(addrs, a, overrides, out)
            save()
            rates = [calibration["rate"]]
        for rate in rates:
            applied = shape(rate, a.delay, a.queue, a.burst)
            what = (f"until an evaluation's held-out loss ({a.eval_steps} batches every {a.eval_every} steps) reaches "
                    f"{'AdamW-HSDP' + chr(39) + 's final one' if fixed_target is None else f'{fixed_target:.4f}'}, "
                    f"{a.repeats} round(s)" if a.to_loss is not None else
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
                    sets_target = a.to_loss == "auto" and name == "AdamW"
                    try:
                        r = run_pair(name, addrs, a, out / f"{rate}_{name}_{round_}", overrides,
                                     target=None if sets_target else target, budget=None if sets_target else budget)
                    except (RuntimeError, KeyError, subprocess.TimeoutExpired) as error:
                        print(f"# {name} @ {rate} failed: {error}", file=sys.stderr, flush=True)
                        if a.to_loss is not None:
                            results.setdefault(f"{rate}/{name}", []).append(None)
                        continue
                    load = f"load average {r['load_average'][0]:.1f} → {r['load_average'][1]:.1f}"
                    if a.to_loss is not None:
                        if a.to_loss == "study" and name == "AdamW" and missed_study_target(r):
                            print(f"# AdamW-HSDP @ {rate}, round {round_}: its final held-out loss here, "
                                  f"{r['curve'][-1][1]:.4f}, misses the study's {r['target']:.4f}: this round's "
                                  f"target is its own final loss", file=sys.stderr, flush=True)
                            r = {**r, **crossing(r["curve"], r["curve"][-1][1]), "study_target": r["target"]}
                            sets_target = True
                        if sets_target:
                            target = r["target"]
                        if name == "AdamW" and a.budget_x and r["time_to_loss_s"]:
                            budget = min(x for x in (a.budget, a.budget_x * r["time_to_loss_s"]) if x)
                        results.setdefault(f"{rate}/{name}", []).append(r)
                        save()
                        t = r["time_to_loss_s"]
                        print(f"  {name}, round {round_}: " + (
                            f"held-out {r['target']:.4f} at step {r['iso_loss_step']:.0f} after {t:.1f} training s"
                            if t is not None else f"not reached ({r['stopped']} after {r['steps_run']} steps, "
                            f"{r['train_s']:.0f} training s; best {r['best_heldout']:.4f})")
                            + f" (evaluations {r['eval_s']:.1f} s; {load})", file=sys.stderr, flush=True)
                        continue
                    print(f"  {name}: {r['step_s']:.3f} s/step ({load})", file=sys.stderr, flush=True)
                    kept = results.get(f"{rate}/{name}")
                    runs = (kept["step_s_runs"] if kept else []) + [r["step_s"]]
                    results[f"{rate}/{name}"] = {**(r if kept is None or r["step_s"] < kept["step_s"] else kept),
                                                 "step_s_runs": runs}
            if a.to_loss is not None:
                rate_results = {key.split("/", 1)[1]: v for key, v in results.items() if key.split("/", 1)[0] == rate}
                print(to_loss_table(rate_results, names), flush=True)
        if a.to_loss is None:  # after every rate: the floor needs the fastest rate's step
            add_floors(results, rates)
            for rate in rates:
                print(f"\n## {rate}: window steps {a.warmup + 1}-{a.steps}, fastest of {a.repeats} run(s)\n"
                      + window_table(results, rate, rates, names), flush=True)
    finally:
        teardown()
    save()
    title = f"two nodes over a tc-shaped link: {a.flavor}, |R|=2 x |S|={a.nproc_per_node}, batch {a.batch} x seq {a.seq_len}"
    if a.to_loss is not None:
        if a.plot_loss and results:
            plot_loss(results, rates, a.plot_loss, title)
        return 0
    if a.png and results:
        plot(results, rates, a.png, f"{title}, steps {a.warmup + 1}-{a.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
