"""Optimizer step time of every registered optimizer vs torch AdamW, on CPU, |R| real replicas.

    .venv/bin/python scripts/step_overhead.py --flavors debugmodel 100M --repeats 7 --runs 3

The model is torchtitan's llama3 ``Transformer`` (real weights, random gradients). The optimizers
run on ``--replicas`` processes (default 2, gloo on loopback, one thread each) forming the R group,
so every family does its real per-step work: DeMo/FlexDeMo their DCT, top-k, packing, all-gather and
decoding (with one replica DeMo is plain SGD-momentum and would time nothing of that), Dion its
P/R averages and orthogonalization, the local-adaptive family its local step (their periodic syncs
are priced by ``comm_report.py``; a median over ``--repeats`` steps shorter than a period leaves
them out). The reference, ``AdamW``, is what torchtitan builds: ``torch.optim.AdamW(fused=True)``
(``[optimizer] implementation = "fused"``, torchtitan's default; torch has a fused CPU kernel), without
any collective. ``AdamW-foreach`` and ``AdamW-for-loop`` (torch's own default on CPU) are the other two
implementations, for comparison: on CPU the fused kernel is about 3x faster than either. Times are
rank 0's medians over ``--repeats`` steps after one warm-up step, each step started together on
every rank (barrier); with ``--runs`` N the whole measurement is
repeated in fresh processes and the table gives the medians over the runs and the range of each
optimizer's ratio to AdamW (taken within each run: on a shared machine the ratio is steadier than a
time).
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scripts._bench_common import flavor_args, parse_overrides, resolved_of, table  # noqa: E402


def _model(flavor: str):
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(0)
    model = Transformer(flavor_args(flavor))
    with torch.no_grad():
        model.init_weights()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _build(name: str, model, overrides: dict):
    from titan_commopt.optim import BaseHParams, build_optimizer
    from titan_commopt.topology import Topology

    hp = BaseHParams(lr=1e-3)
    if name in ADAMW:
        return torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                 weight_decay=hp.weight_decay, **ADAMW[name])
    topology = Topology(replicate=dist.group.WORLD) if dist.get_world_size() > 1 else Topology.single()
    return build_optimizer(list(model.named_parameters()), topology, resolved_of(name, overrides, hp))


# torch AdamW by [optimizer] implementation; "AdamW" (fused, torchtitan's default) is the reference
ADAMW = {"AdamW": dict(fused=True), "AdamW-foreach": dict(foreach=True), "AdamW-for-loop": dict(foreach=False)}


def time_steps(name: str, flavor: str, repeats: int, overrides: dict) -> float:
    from titan_commopt import comm

    model = _model(flavor)
    opt = _build(name, model, overrides)
    times = []
    with comm.use_ledger(comm.CommLedger()):
        for i in range(repeats + 1):  # step 0: state allocation, plan building
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _worker(rank: int, world: int, port: int, out: str, flavors, names, repeats, overrides, threads) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = []
        for flavor in flavors:
            n_params = sum(p.numel() for p in _model(flavor).parameters())
            ref = time_steps("AdamW", flavor, repeats, overrides)
            for name in names:
                try:
                    t = ref if name == "AdamW" else time_steps(name, flavor, repeats, overrides)
                except Exception as error:  # keep the rest of the table (every rank fails alike)
                    if rank == 0:
                        print(f"# {flavor} {name}: {type(error).__name__}: {error}", file=sys.stderr)
                    continue
                rows.append([f"{flavor} ({n_params / 1e6:.1f}M)", name, t, t / ref, n_params])
                if rank == 0:
                    print(f"{rows[-1][0]} | {name} | {t * 1e3:.1f} ms | {t / ref:.2f}", file=sys.stderr, flush=True)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def run(flavors: list[str], names: list[str] | None, repeats: int, overrides: dict, replicas: int = 2,
        threads: int = 1) -> list[list]:
    from titan_commopt.optim import available_names

    names = names or [*ADAMW, *(n for n in available_names() if n not in ("Adam", "AdamW"))]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(replicas, port, out, flavors, names, repeats, overrides, threads),
                           nprocs=replicas, start_method="spawn")
        return torch.load(out, weights_only=False)


def summarize(runs: list[list[list]]) -> list[list[str]]:
    """One row per (model, optimizer) over several runs: the median step time and ratio to AdamW
    (each run's ratio is taken within that run), the ratio's range over the runs, ns per parameter."""
    by_key: dict[tuple, list] = {}
    for rows in runs:
        for model, name, t, ratio, n_params in rows:
            by_key.setdefault((model, name), []).append((t, ratio, n_params))
    out = []
    for (model, name), cells in by_key.items():
        ts, ratios = [c[0] for c in cells], [c[1] for c in cells]
        t = statistics.median(ts)
        out.append([model, name, f"{t * 1e3:.1f}", f"{statistics.median(ratios):.2f}",
                    f"{min(ratios):.2f}–{max(ratios):.2f}", f"{t * 1e9 / cells[0][2]:.1f}"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", nargs="+", default=["cpu_small", "100M"])
    p.add_argument("--optimizers", nargs="*")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--replicas", type=int, default=2, help="processes in the R group (gloo, loopback)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--runs", type=int, default=1, help="independent runs (fresh processes); the table "
                   "gives medians over them and the range of the ratio to AdamW")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    a = p.parse_args(argv)
    runs = [run(a.flavors, a.optimizers, a.repeats, parse_overrides(a.set), a.replicas, a.threads)
            for _ in range(a.runs)]
    print(f"|R| = {a.replicas} processes, {a.threads} torch thread(s) each; median of {a.repeats} steps "
          f"per run, {a.runs} run(s)\n")
    print(table(["model", "optimizer", "step ms (median)", "÷ torch AdamW (fused)", "÷ AdamW, range over runs",
                 "ns / parameter"], summarize(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
