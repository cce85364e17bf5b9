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

Per run: median step time after ``--warmup`` steps (torchtitan's ``time_metrics/end_to_end(s)``),
tokens/s of the whole job, bytes that crossed the link (tx counters of both veth ends, whole run
incl. rendezvous and the initial parameter broadcast, divided by steps) next to the ledger's R bytes
per step summed over a node's ranks. Exits 0 with "SKIP: ..." when it cannot run (not root, no
``ip``/``tc``, namespaces not permitted).
"""

import argparse
import atexit
import ipaddress
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
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
    before = tx_bytes()
    procs = []
    for i, (ns, dev) in enumerate(zip(NS, VETH)):
        env = {**train_env(args.threads), "GLOO_SOCKET_IFNAME": dev, "MASTER_ADDR": addrs[0]}
        cmd = ["ip", "netns", "exec", ns, "env", *[f"{k}={v}" for k, v in env.items() if k in (
            "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH")],
               # node A's address is no hostname of this box: tell torchrun which agent hosts the store
               *torchrun_cmd(args.nproc_per_node, dump / f"node{i}", *train,
                             rdzv=[*rdzv, "--local-addr", addrs[i],
                                   "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120"])]
        log = open(dump.parent / f"{dump.name}_node{i}.log", "w") if dump.parent.exists() else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        rcs = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    after = tx_bytes()
    if any(rcs):
        raise RuntimeError(f"{name}: torchrun exit codes {rcs}; logs in {dump.parent}")
    scalars = {}
    for i in range(2):
        if (dump / f"node{i}" / "tb").exists():
            scalars = read_scalars(dump / f"node{i}")
    times = [v for k, v in scalars["time_metrics/end_to_end(s)"] if k > args.warmup]
    step = statistics.median(times)
    world = 2 * args.nproc_per_node
    r_ledger = scalars["comm/R_sent_bytes_total"][-1][1] / args.steps
    return {
        "step_s": step,
        "tokens_per_s": args.batch * args.seq_len * world / step,
        "link_bytes_per_step": [(a - b) / args.steps for a, b in zip(after, before)],
        "ledger_r_node_per_step": r_ledger * args.nproc_per_node,
        "loss": scalars["loss_metrics/global_avg_loss"][-1][1],
    }


def main(argv=None) -> int:
    from titan_commopt.optim import available_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="tc rates of the link")
    p.add_argument("--delay", default="5ms", help="one-way netem delay per end (if the kernel has netem)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node = |S|")
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--subnet", default="10.213.77.0/24", help="private /24 living only in the namespaces")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default="outputs/bench_netns")
    p.add_argument("--json", help="also write the results here")
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
                  f"batch {a.batch} x seq {a.seq_len} per rank, {a.steps} steps", flush=True)
            rows, base = [], None
            for name in names:
                try:
                    r = run_pair(name, addrs, a, out / f"{rate}_{name}", overrides)
                except (RuntimeError, KeyError, subprocess.TimeoutExpired) as error:
                    print(f"# {name} @ {rate} failed: {error}", file=sys.stderr, flush=True)
                    continue
                results[f"{rate}/{name}"] = r
                base = base or (r if name == "AdamW" else None)
                speedup = f"{base['step_s'] / r['step_s']:.1f}x" if base else "-"
                rows.append([name, f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", speedup,
                             human(r["link_bytes_per_step"][0]), human(r["link_bytes_per_step"][1]),
                             human(r["ledger_r_node_per_step"]), f"{r['loss']:.3f}"])
                print(f"  {name}: {r['step_s']:.3f} s/step", file=sys.stderr, flush=True)
            print(table(["optimizer", "step s (median)", "tokens/s", "speed-up vs AdamW-HSDP",
                         "link A→B /step", "link B→A /step", "ledger R sent /step /node", "final loss"], rows), flush=True)
    finally:
        teardown()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
