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

Exits 0 with "SKIP: ..." when it cannot run (not root, no ``ip``/``tc``, namespaces not permitted).
"""

import argparse
import atexit
import ipaddress
import json
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
    """Reads the veth tx counters when node A's console log first shows given steps.

    torchtitan prints ``step: N  loss: ...`` once step N has finished (``log_freq = 1``), straight into
    the log (no torchrun tee in between); sampling at the lines of the window's first and last step
    leaves start-up and shutdown traffic out.
    """

    STEP = re.compile(r"step:\s*(\d+)\s")

    def __init__(self, log: Path, steps: set[int]) -> None:
        super().__init__(daemon=True)
        self.log, self.wanted, self.samples = log, set(steps), {}
        self.done = threading.Event()

    def run(self) -> None:
        pos, tail = 0, ""
        while not self.done.is_set() and self.wanted:
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
                m = self.STEP.search(line)
                if m and int(m.group(1)) in self.wanted:
                    self.samples[int(m.group(1))] = tx_bytes()
                    self.wanted.discard(int(m.group(1)))
            time.sleep(0.005)


def run_pair(name: str, addrs, args, dump: Path, overrides: dict) -> dict:
    shutil.rmtree(dump, ignore_errors=True)
    port = 29400 + (abs(hash((name, time.time()))) % 1000)
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", f"{TAG}{port}"]
    train = [
        "--model.flavor", args.flavor, "--training.steps", str(args.steps), "--metrics.log_freq", "1",
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", str(args.nproc_per_node),
        "--optimizer.name", name, *cli_overrides(name, overrides),
    ]
    logs = [dump.parent / f"{dump.name}_node{i}.log" for i in range(2)]
    sampler = StepCounterSampler(logs[0], {args.warmup, args.steps})
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
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        rcs = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sampler.done.set()
        sampler.join()
    if any(rcs):
        raise RuntimeError(f"{name}: torchrun exit codes {rcs}; logs in {dump.parent}")
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


def main(argv=None) -> int:
    from titan_commopt.optim import available_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="tc rates of the link")
    p.add_argument("--delay", default="5ms", help="one-way netem delay per end (if the kernel has netem)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node = |S|")
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--steps", type=int, default=36, help="last step of the measured window")
    p.add_argument("--warmup", type=int, default=4, help="steps before the measured window")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all optimizers; each keeps its fastest run (noise on shared machines)")
    p.add_argument("--subnet", default="10.213.77.0/24", help="private /24 living only in the namespaces")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default="outputs/bench_netns")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--png", help="write a bar chart of mean step time per optimizer and rate")
    a = p.parse_args(argv)
    why = cannot_run()
    if why:
        print(f"SKIP: bench_netns cannot run here: {why}")
        return 0
    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    if "AdamW" in names:
        names = ["AdamW"] + [n for n in names if n != "AdamW"]
    overrides = parse_overrides(a.set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    addrs = setup(a.subnet)
    results = {}
    try:
        for rate in a.rates:
            applied = shape(rate, a.delay)
            print(f"\n## link: {applied}; {a.flavor}, |R|=2 nodes x |S|={a.nproc_per_node}, "
                  f"batch {a.batch} x seq {a.seq_len} per rank, window: steps {a.warmup + 1}-{a.steps}, "
                  f"fastest of {a.repeats} run(s) each", flush=True)
            for round_ in range(a.repeats):  # rounds interleave the optimizers; the fastest run of each is kept
                for name in names:
                    try:
                        r = run_pair(name, addrs, a, out / f"{rate}_{name}_{round_}", overrides)
                    except (RuntimeError, KeyError, subprocess.TimeoutExpired) as error:
                        print(f"# {name} @ {rate} failed: {error}", file=sys.stderr, flush=True)
                        continue
                    print(f"  {name}: {r['step_s']:.3f} s/step", file=sys.stderr, flush=True)
                    kept = results.get(f"{rate}/{name}")
                    if kept is None or r["step_s"] < kept["step_s"]:
                        results[f"{rate}/{name}"] = r
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
    if a.png and results:
        plot(results, a.rates, a.png, f"two nodes over a tc-shaped link: {a.flavor}, |R|=2 x |S|={a.nproc_per_node}, "
             f"batch {a.batch} x seq {a.seq_len}, steps {a.warmup + 1}-{a.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
