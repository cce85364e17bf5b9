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

On a GPU (``--device cuda``; e.g. ``--flavors 1B --device cuda``) each replica puts its model on
``cuda:rank % device_count``. With fewer GPUs than replicas the replicas share a GPU and talk over
gloo with CUDA tensors (NCCL refuses two ranks on one device): the link is then host memory and the
processes take turns on the GPU, so the ratios, not the times, carry over. A step is timed between
two ``torch.cuda.synchronize()`` (the benchmark's, not the optimizer's). Two more columns: the host
synchronizations the step itself makes (one extra step under ``torch.cuda.set_sync_debug_mode``;
rank 0's main thread, so gloo's own copies to the host do not count, as NCCL makes none) and the
peak memory allocated from building the model to the end of the steps.

Two columns say how much of a step is the link: the R bytes each replica sends per step and the
time its R collectives took from issue to completion (the ledger's ``R_seconds``: host clock on CPU,
device events on a GPU), both medians over the timed steps. On gloo loopback that time is the
benchmark's host link, not the optimizer's computation.

With ``--shard`` S > 1 every replica is S processes and the model is FSDP2-sharded over them
(``fully_shard`` of each transformer block and of the model, on a ``(dp_replicate, fsdp)`` mesh of
``--replicas`` × S; the optimizers get ``Topology.from_mesh``, as in training): each rank steps its
shards, and a family that works on whole matrices does its S-group exchange, e.g. Muon's owner ranks
(each orthogonalizes about 1/S of the matrices, gathered whole over the shard group, and sends the
pieces back). The fused AdamW steps its DTensor shards without a collective. Another column then
gives the S bytes each rank sends per step.
"""

import argparse
import gc
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scripts._bench_common import build_model, human, param_shapes, parse_overrides, resolved_of, table  # noqa: E402


def _model(flavor: str, device: torch.device, mesh=None):
    """The model with random gradients; with a ``mesh`` (``--shard`` > 1) FSDP2-sharded over its
    ``fsdp`` dim as torchtitan shards it (each block, then the rest), each gradient a DTensor like its
    parameter."""
    torch.manual_seed(0)
    with device:
        model = build_model(flavor)
    with torch.no_grad():
        model.init_weights()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    for p in model.parameters():
        p.grad = _random_like(p) * 1e-3
    return model


def _random_like(p: torch.Tensor) -> torch.Tensor:
    """Gaussian noise shaped and placed as ``p`` (a DTensor: noise on its local shard)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return torch.randn_like(p)
    return DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _build(name: str, model, overrides: dict, ledger, mesh=None):
    from titan_commopt.optim import BaseHParams, build_optimizer
    from titan_commopt.topology import Topology

    hp = BaseHParams(lr=1e-3)
    if name in ADAMW:
        return torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                 weight_decay=hp.weight_decay, **ADAMW[name])
    if mesh is not None:
        topology = Topology.from_mesh(mesh)
    else:
        topology = Topology(replicate=dist.group.WORLD) if dist.get_world_size() > 1 else Topology.single()
    return build_optimizer(list(model.named_parameters()), topology, resolved_of(name, overrides, hp), ledger=ledger)


# torch AdamW by [optimizer] implementation; "AdamW" (fused, torchtitan's default) is the reference
ADAMW = {"AdamW": dict(fused=True), "AdamW-foreach": dict(foreach=True), "AdamW-for-loop": dict(foreach=False)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Free the last optimizer's model and state before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _host_syncs(opt) -> list[str]:
    """Where one ``opt.step()`` synchronizes the host with the GPU: ``file:line`` of each occurrence."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _profile(opt, device: torch.device, rows: int) -> str:
    """torch.profiler's table of two steps, the ops with the most self time on the step's device first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            opt.step()
            _synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def time_steps(name: str, flavor: str, repeats: int, overrides: dict, device: torch.device,
               profile_rows: int = 0, mesh=None) -> dict:
    from titan_commopt import comm

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = _model(flavor, device, mesh)
    ledger = comm.CommLedger()
    opt = _build(name, model, overrides, ledger, mesh)
    times, sent, link, shard_sent, syncs = [], [], [], [], None
    for i in range(repeats + 1):  # step 0: state allocation, plan building
        dist.barrier()
        _synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        _synchronize(device)
        times.append(time.perf_counter() - t0)
        step = ledger.end_step()
        sent.append(step.get("R_sent", 0.0))
        link.append(step.get("R_seconds", 0.0))
        shard_sent.append(step.get("S_sent", 0.0))
    if device.type == "cuda":
        syncs = _host_syncs(opt)
        _synchronize(device)
    if profile_rows:  # every rank steps (the collectives need all); rank 0 prints
        table = _profile(opt, device, profile_rows)
        if dist.get_rank() == 0:
            print(f"# profile of {name} on {flavor}, two steps\n{table}", file=sys.stderr)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del opt, model
    _release(device)
    return {"t": statistics.median(times[1:]), "syncs": syncs, "peak": peak,
            "sent": statistics.median(sent[1:]), "link": statistics.median(link[1:]),
            "shard_sent": statistics.median(shard_sent[1:])}


def _worker(rank: int, world: int, port: int, out: str, flavors, names, repeats, overrides, threads,
            device_type: str, profile_rows: int, shard: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    backend = "gloo"
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    mesh = None
    if shard > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("dp_replicate", "fsdp"))
    try:
        rows = []
        for flavor in flavors:
            n_params = sum(math.prod(shape) for _, shape in param_shapes(flavor))
            ref = time_steps("AdamW", flavor, repeats, overrides, device, mesh=mesh)
            for name in names:
                try:
                    r = ref if name == "AdamW" else time_steps(name, flavor, repeats, overrides, device, profile_rows,
                                                               mesh)
                except Exception as error:  # keep the rest of the table (every rank fails alike)
                    if rank == 0:
                        print(f"# {flavor} {name}: {type(error).__name__}: {error}", file=sys.stderr)
                    _release(device)
                    continue
                t = r["t"]
                rows.append([f"{flavor} ({n_params / 1e6:.1f}M)", name, t, t / ref["t"], n_params, r["syncs"], r["peak"],
                             r["sent"], r["link"], r["shard_sent"]])
                if rank == 0:
                    extra = "" if r["syncs"] is None else (
                        f" | {len(r['syncs'])} host syncs {sorted(set(r['syncs']))} | peak {r['peak'] / 2**30:.1f} GiB")
                    print(f"{rows[-1][0]} | {name} | {t * 1e3:.1f} ms | {t / ref['t']:.2f}{extra}",
                          file=sys.stderr, flush=True)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def run(flavors: list[str], names: list[str] | None, repeats: int, overrides: dict, replicas: int = 2,
        threads: int = 1, device: str = "cpu", profile_rows: int = 0, shard: int = 1) -> list[list]:
    from titan_commopt.optim import available_names

    names = names or [*ADAMW, *(n for n in available_names() if n not in ("Adam", "AdamW"))]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        world = replicas * shard
        mp.start_processes(_worker, args=(world, port, out, flavors, names, repeats, overrides, threads, device, profile_rows,
                                          shard), nprocs=world, start_method="spawn")
        return torch.load(out, weights_only=False)


def summarize(runs: list[list[list]], shard: bool = False) -> list[list[str]]:
    """One row per (model, optimizer) over several runs: the median step time and ratio to AdamW
    (each run's ratio is taken within that run), the ratio's range over the runs, ns per parameter,
    the R bytes and time, the S bytes (``shard``: with ``--shard`` > 1); on a GPU also the step's host
    synchronizations and the peak memory (first run)."""
    by_key: dict[tuple, list] = {}
    for rows in runs:
        for model, name, t, ratio, n_params, syncs, peak, sent, link, shard_sent in rows:
            by_key.setdefault((model, name), []).append((t, ratio, n_params, syncs, peak, sent, link, shard_sent))
    out = []
    for (model, name), cells in by_key.items():
        ts, ratios = [c[0] for c in cells], [c[1] for c in cells]
        t = statistics.median(ts)
        link = statistics.median(c[6] for c in cells)
        row = [model, name, f"{t * 1e3:.1f}", f"{statistics.median(ratios):.2f}",
               f"{min(ratios):.2f}–{max(ratios):.2f}", f"{t * 1e9 / cells[0][2]:.1f}", human(cells[0][5]),
               f"{link * 1e3:.1f}"]
        if shard:
            row.append(human(statistics.median(c[7] for c in cells)))
        syncs, peak = cells[0][3], cells[0][4]
        if syncs is not None:
            row += [str(len(syncs)), f"{peak / 2**30:.1f}"]
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", nargs="+", default=["cpu_small", "100M"])
    p.add_argument("--optimizers", nargs="*")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--replicas", type=int, default=2, help="replicas in the R group (gloo, loopback), each --shard processes")
    p.add_argument("--shard", type=int, default=1, help="processes per replica, FSDP2-sharded over them (S group)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: replica r on cuda:r %% device_count (NCCL with a GPU each, else gloo)")
    p.add_argument("--runs", type=int, default=1, help="independent runs (fresh processes); the table "
                   "gives medians over them and the range of the ratio to AdamW")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after the timed steps, print torch.profiler's top ROWS ops of two more steps (rank 0)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: allowed only where torch sees a CUDA (or ROCm) device; here it sees none")
    if a.replicas < 1 or a.shard < 1:
        p.error(f"--replicas {a.replicas} --shard {a.shard}: allowed are integers >= 1")
    runs = [run(a.flavors, a.optimizers, a.repeats, parse_overrides(a.set), a.replicas, a.threads, a.device, a.profile,
                a.shard) for _ in range(a.runs)]
    layout = f"|R| = {a.replicas}" + (f" × |S| = {a.shard} (FSDP2)" if a.shard > 1 else "")
    print(f"{layout} processes, {a.threads} torch thread(s) each; median of {a.repeats} steps "
          f"per run, {a.runs} run(s)\n")
    headers = ["model", "optimizer", "step ms (median)", "÷ torch AdamW (fused)", "÷ AdamW, range over runs",
               "ns / parameter", "R sent / step", "ms in R collectives (summed)"]
    if a.shard > 1:
        headers.append("S sent / step")
    if a.device == "cuda":
        headers += ["host syncs / step", "peak GiB"]
    print(table(headers, summarize(runs, shard=a.shard > 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
