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

Dtypes: ``--param-dtype`` is torchtitan's ``[training] mixed_precision_param`` (the dtype FSDP2
all-gathers parameters in: the S column), ``--reduce-dtype`` its ``mixed_precision_reduce`` (the
gradient reduce-scatter on S and AdamW-HSDP's all-reduce on R); both default to torchtitan's defaults
(bfloat16, float32), as in ``train_configs/llama3_8b_*.toml``. (``train_configs/debug_cpu.toml``
trains in float32: pass ``--param-dtype float32`` to compare with it.) The optimizers' own R traffic
does not depend on them (they hold the fp32 parameter shards).

A bad argument (unknown flavor or optimizer, a malformed or invalid ``--set``, a degree < 1) prints
one line and exits with status 2.
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import flavor_names, human, param_shapes, parse_overrides, resolved_of, table  # noqa: E402


def _shards(shapes, shard: int) -> list:
    """Rank 0's FSDP2 shards (dim 0 split over ``shard`` ranks) of every parameter."""
    from titan_commopt.optim import ShardShape

    return [ShardShape.fsdp(n, s, shard) for n, s in shapes]


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def r_bytes(name: str, shapes, replicate: int, shard: int, overrides: dict, reduce_dtype: str = "float32"):
    """Analytic R payload per rank per step of optimizer ``name`` on rank 0's shards."""
    from titan_commopt.optim import owns_replicate_sync
    from titan_commopt.optim.traffic import adamw_hsdp_r_bytes

    shards = _shards(shapes, shard)
    if not owns_replicate_sync(name):
        return adamw_hsdp_r_bytes(shards, replicate, _itemsize(reduce_dtype))
    resolved = resolved_of(name, overrides)
    return resolved.family.r_bytes(shards, resolved, replicate)


def report(flavor: str, replicate: int, shard: int, names=None, overrides=None,
           param_dtype: str = "bfloat16", reduce_dtype: str = "float32") -> list[dict]:
    """One row per optimizer. A bad option in ``overrides`` raises ConfigError (a user's mistake);
    a family that cannot price this shape is left out with a note on stderr."""
    from titan_commopt.optim import available_names
    from titan_commopt.optim.traffic import adamw_hsdp_r_bytes, fsdp_traffic
    from titan_commopt.options import ConfigError

    overrides = overrides or {}
    shapes = param_shapes(flavor)
    shards = _shards(shapes, shard)
    reduce_bytes = _itemsize(reduce_dtype)
    hsdp = adamw_hsdp_r_bytes(shards, replicate, reduce_bytes).sent
    ddp = adamw_hsdp_r_bytes(_shards(shapes, 1), replicate, reduce_bytes).sent
    s = fsdp_traffic(shards, shard, replicate, param_bytes=_itemsize(param_dtype), reduce_bytes=reduce_bytes).s_bytes
    rows = []
    for name in names or available_names():
        try:
            r = r_bytes(name, shapes, replicate, shard, overrides, reduce_dtype)
        except ConfigError:
            raise
        except Exception as error:  # a family that cannot price this shape: say so, keep the rest
            print(f"# {name}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        rows.append({
            "optimizer": name, "R_sent": r.sent, "R_recv": r.recv, "S_sent": s.sent, "S_recv": s.recv,
            "vs_adamw_hsdp": hsdp / r.sent if r.sent else float("inf"),
            "vs_adamw_ddp": ddp / r.sent if r.sent else float("inf"),
        })
    return rows


def _dtype_choices(key: str) -> tuple[str, ...]:
    """The values torchtitan's ``[training] <key>`` allows (its Literal annotation)."""
    import typing

    from torchtitan.config.job_config import Training

    return typing.get_args(Training.__dataclass_fields__[key].type)


def check_args(a) -> list[str]:
    """Every bad argument, one line each (what was given, what is allowed)."""
    from titan_commopt.optim import FAMILIES, available_names, family_of, resolve
    from titan_commopt.options import ConfigError

    out = []
    flavors = flavor_names()
    if a.flavor not in flavors:
        out.append(f"--flavor {a.flavor!r}: allowed is one of {', '.join(flavors)}")
    for flag, value in (("--replicate", a.replicate), ("--shard", a.shard)):
        if value < 1:
            out.append(f"{flag} {value}: allowed is an integer >= 1")
    names = available_names()
    for name in a.optimizers or []:
        if name not in names:
            out.append(f"--optimizers {name!r}: allowed is one of {', '.join(names)}")
    try:
        overrides = parse_overrides(a.set)
    except ConfigError as error:
        return out + [str(error)]
    chosen = [n for n in (a.optimizers or names) if n in names]
    for key, given in overrides.items():  # each family's options, as the first chosen name of it resolves them
        family = FAMILIES[key]
        name = next((n for n in chosen if n not in ("AdamW", "Adam") and family_of(n) is family), next(iter(family.presets)))
        try:
            resolve(name, given)
        except ConfigError as error:
            out += [f"--set: {line}" for line in str(error).splitlines()]
    return out


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


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv=None) -> int:
    p = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor: debugmodel, 8B, 70B, ... or cpu_tiny, cpu_small, 100M, 300M")
    p.add_argument("--replicate", type=int, default=2, help="|R| (dp_replicate degree), >= 1")
    p.add_argument("--shard", type=int, default=1, help="|S| (FSDP degree), >= 1")
    p.add_argument("--optimizers", nargs="*", help="names (default: every registered one)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE", help="family options, e.g. demo.chunk=32 local.Kx=64")
    p.add_argument("--param-dtype", default="bfloat16", choices=_dtype_choices("mixed_precision_param"),
                   help="[training] mixed_precision_param: FSDP2's all-gather dtype (S column); "
                   "default torchtitan's, bfloat16")
    p.add_argument("--reduce-dtype", default="float32", choices=_dtype_choices("mixed_precision_reduce"),
                   help="[training] mixed_precision_reduce: gradient reduce dtype (S column, AdamW-HSDP's R); "
                   "default torchtitan's, float32")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--png", help="write a bar chart of R bytes")
    a = p.parse_args(argv)
    problems = check_args(a)
    if problems:
        for line in problems:
            print(f"comm_report.py: {line}", file=sys.stderr)
        return 2
    rows = report(a.flavor, a.replicate, a.shard, a.optimizers, parse_overrides(a.set), a.param_dtype, a.reduce_dtype)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        n = sum(math.prod(s) for _, s in param_shapes(a.flavor))
        print(f"flavor {a.flavor} ({n / 1e6:.1f}M params), mesh |R|={a.replicate} x |S|={a.shard}, "
              f"params all-gathered in {a.param_dtype}, gradients reduced in {a.reduce_dtype}, per rank per step\n")
        print(format_rows(rows))
    if a.png:
        plot(rows, f"{a.flavor}, |R|={a.replicate} x |S|={a.shard}", a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
