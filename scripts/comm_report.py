"""Per-rank bytes per step of every registered optimizer on a model flavor and mesh, no GPU needed.

    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8
    .venv/bin/python scripts/comm_report.py --flavor 300M --replicate 2 --shard 1 --png out.png
    .venv/bin/python scripts/comm_report.py --flavor cpu_tiny --replicate 2 --shard 2 --set local.Kx=2

The model is torchtitan's llama3 ``Transformer`` built on the meta device. R bytes come from each
family's analytic ``r_bytes_per_step`` on rank 0's FSDP2 shard shapes (dim 0 split over ``--shard``;
for Dion also rank 0's slice of R, which it averages over R after a reduce-scatter over S)
— the formula the ledger is tested against; S bytes are the FSDP2 estimate the training container
records (all-gather of the parameters in forward and backward + gradient reduce-scatter). AdamW-HSDP
= the fp32 all-reduce of the local gradient shard over R; AdamW-DDP = the same for the full
gradient (|S| = 1), the unit the DeMo/Dion papers report. The S column is FSDP2's own traffic
only: Dion's distributed orthogonalization adds S collectives of its own (in the ledger, not here).
"""

import argparse
import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import BASELINES, family_config, human, param_shapes, parse_overrides, shard_shape, table  # noqa: E402


def fsdp_s_bytes(numel_local: int, shards: int, param_bytes: int = 4, reduce_bytes: int = 4, gathers: int = 2) -> dict:
    """Same model as ``titan_commopt.titan.optimizers.estimate_fsdp_traffic``."""
    if shards <= 1:
        return {"sent": 0, "recv": 0}
    return {
        "sent": gathers * numel_local * param_bytes + (shards - 1) * numel_local * reduce_bytes,
        "recv": gathers * (shards - 1) * numel_local * param_bytes + (shards - 1) * numel_local * reduce_bytes,
    }


def r_bytes(name: str, shapes, replicate: int, shard: int, overrides: dict) -> dict:
    """Analytic R payload per rank per step of optimizer ``name`` on rank 0's shards."""
    local = [(n, shard_shape(s, shard)) for n, s in shapes]
    numel = sum(_numel(s) for _, s in local)
    if name in BASELINES:
        b = numel * 4 if replicate > 1 else 0
        return {"sent": b, "recv": b}
    from titan_commopt.optim import family_module

    family, cfg = family_config(name, overrides)
    fn = family_module(family).r_bytes_per_step
    # Families whose decisions depend on the full shape (Dion's rank) take (fqn, local, global), and
    # Dion's R slice also rank 0's place among the row shards: (fqn, local, global, (0, |S|)).
    doc = inspect.getdoc(fn) or ""
    if "global_shape" in doc:
        extra = ((0, shard),) if "row_split" in doc else ()
        local = [(n, shard_shape(s, shard), s, *extra) for n, s in shapes]
    out = fn(local, cfg, replicate)
    return {"sent": float(out["sent"]), "recv": float(out["recv"])}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def report(flavor: str, replicate: int, shard: int, names=None, overrides=None) -> list[dict]:
    from titan_commopt.optim import available_names

    overrides = overrides or {}
    shapes = param_shapes(flavor)
    total = sum(_numel(s) for _, s in shapes)
    local = sum(_numel(shard_shape(s, shard)) for _, s in shapes)
    hsdp = local * 4 if replicate > 1 else 0
    ddp = total * 4 if replicate > 1 else 0
    s = fsdp_s_bytes(local, shard)
    rows = []
    for name in names or available_names():
        try:
            r = r_bytes(name, shapes, replicate, shard, overrides)
        except Exception as error:  # a family that cannot price this shape: say so, keep the rest
            print(f"# {name}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        rows.append({
            "optimizer": name, "R_sent": r["sent"], "R_recv": r["recv"], "S_sent": s["sent"], "S_recv": s["recv"],
            "vs_adamw_hsdp": hsdp / r["sent"] if r["sent"] else float("inf"),
            "vs_adamw_ddp": ddp / r["sent"] if r["sent"] else float("inf"),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    return table(
        ["optimizer", "R sent/step/rank", "R recv/step/rank", "S sent/step/rank (FSDP2)", "AdamW-HSDP ÷ this", "AdamW-DDP ÷ this"],
        [[r["optimizer"], human(r["R_sent"]), human(r["R_recv"]), human(r["S_sent"]),
          f"{r['vs_adamw_hsdp']:.1f}x", f"{r['vs_adamw_ddp']:.1f}x"] for r in rows],
    )


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["optimizer"] for r in rows], [r["R_sent"] / 2**20 for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("R MiB sent per step per rank (log)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor: debugmodel, 8B, 70B, ... or cpu_tiny, cpu_small, 100M, 300M")
    p.add_argument("--replicate", type=int, default=2, help="|R| (dp_replicate degree)")
    p.add_argument("--shard", type=int, default=1, help="|S| (FSDP degree)")
    p.add_argument("--optimizers", nargs="*", help="names (default: every registered one)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE", help="family options, e.g. demo.chunk=32 local.Kx=64")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--png", help="write a bar chart of R bytes")
    a = p.parse_args(argv)
    rows = report(a.flavor, a.replicate, a.shard, a.optimizers, parse_overrides(a.set))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        n = sum(_numel(s) for _, s in param_shapes(a.flavor))
        print(f"flavor {a.flavor} ({n / 1e6:.1f}M params), mesh |R|={a.replicate} x |S|={a.shard}, per rank per step\n")
        print(format_rows(rows))
    if a.png:
        plot(rows, f"{a.flavor}, |R|={a.replicate} x |S|={a.shard}", a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
