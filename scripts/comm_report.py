"""Per-rank bytes per step of every registered optimizer on a model flavor and mesh, no GPU needed.

    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8
    .venv/bin/python scripts/comm_report.py --flavor 300M --replicate 2 --shard 1 --png out.png
    .venv/bin/python scripts/comm_report.py --flavor cpu_tiny --replicate 2 --shard 2 --set local.Kx=2

The model is torchtitan's llama3 ``Transformer`` built on the meta device. R bytes come from each
family's byte formula (``titan_commopt.optim.traffic``, the one the ledger is tested against) on
rank 0's FSDP2 shards (``ShardShape.fsdp``: dim 0 split over ``--shard``); S bytes are the FSDP2
estimate the training container records (all-gather of the parameters in forward and backward + gradient reduce-scatter). AdamW-HSDP
= the fp32 all-reduce of the local gradient shard over R; AdamW-DDP = the same for the full
gradient (|S| = 1), the unit the DeMo/Dion papers report. The S column is FSDP2's own traffic
only: Dion's distributed orthogonalization adds S collectives of its own (in the ledger, not here).
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import human, param_shapes, parse_overrides, resolved_of, table  # noqa: E402


def _shards(shapes, shard: int) -> list:
    """Rank 0's FSDP2 shards (dim 0 split over ``shard`` ranks) of every parameter."""
    from titan_commopt.optim import ShardShape

    return [ShardShape.fsdp(n, s, shard) for n, s in shapes]


def r_bytes(name: str, shapes, replicate: int, shard: int, overrides: dict):
    """Analytic R payload per rank per step of optimizer ``name`` on rank 0's shards."""
    from titan_commopt.optim import owns_replicate_sync
    from titan_commopt.optim.traffic import adamw_hsdp_r_bytes

    shards = _shards(shapes, shard)
    if not owns_replicate_sync(name):
        return adamw_hsdp_r_bytes(shards, replicate)
    resolved = resolved_of(name, overrides)
    return resolved.family.r_bytes(shards, resolved, replicate)


def report(flavor: str, replicate: int, shard: int, names=None, overrides=None) -> list[dict]:
    from titan_commopt.optim import available_names
    from titan_commopt.optim.traffic import adamw_hsdp_r_bytes, fsdp_traffic

    overrides = overrides or {}
    shapes = param_shapes(flavor)
    shards = _shards(shapes, shard)
    hsdp = adamw_hsdp_r_bytes(shards, replicate).sent
    ddp = adamw_hsdp_r_bytes(_shards(shapes, 1), replicate).sent
    s = fsdp_traffic(shards, shard, replicate).s_bytes
    rows = []
    for name in names or available_names():
        try:
            r = r_bytes(name, shapes, replicate, shard, overrides)
        except Exception as error:  # a family that cannot price this shape: say so, keep the rest
            print(f"# {name}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        rows.append({
            "optimizer": name, "R_sent": r.sent, "R_recv": r.recv, "S_sent": s.sent, "S_recv": s.recv,
            "vs_adamw_hsdp": hsdp / r.sent if r.sent else float("inf"),
            "vs_adamw_ddp": ddp / r.sent if r.sent else float("inf"),
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
        n = sum(math.prod(s) for _, s in param_shapes(a.flavor))
        print(f"flavor {a.flavor} ({n / 1e6:.1f}M params), mesh |R|={a.replicate} x |S|={a.shard}, per rank per step\n")
        print(format_rows(rows))
    if a.png:
        plot(rows, f"{a.flavor}, |R|={a.replicate} x |S|={a.shard}", a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
