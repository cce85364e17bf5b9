"""Per-rank bytes per step of every registered optimizer on a model flavor and mesh, no GPU needed.

    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8
    .venv/bin/python scripts/comm_report.py --flavor 300M --replicate 2 --shard 1 --png out.png
    .venv/bin/python scripts/comm_report.py --flavor cpu_tiny --replicate 2 --shard 2 --set local.Kx=2
    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8 --link 100gbit

The model is torchtitan's llama3 ``Transformer`` built on the meta device. R bytes come from each
family's byte formula (``Family.r_bytes``, the one the ledger is tested against) on
rank 0's FSDP2 shards (``ShardShape.fsdp``: dim 0 split over ``--shard``); S bytes are the FSDP2
estimate the training container records (all-gather of the parameters in forward and backward + gradient reduce-scatter). AdamW-HSDP
= the fp32 all-reduce of the local gradient shard over R; AdamW-DDP = the same for the full
gradient (|S| = 1), the unit the DeMo/Dion papers report. The S column is FSDP2's own traffic plus
a family's priced S sums (``Family.s_bytes``: SparseLoCo's quantizer statistics, the Muon step's
gathers and scatters of whole matrices in Muon, MuLoCo and MuLoCo-2bit); Dion's distributed
orthogonalization adds S collectives of its own (in the ledger, not here).

Dtypes: ``--param-dtype`` is torchtitan's ``[training] mixed_precision_param`` (the dtype FSDP2
all-gathers parameters in: the S column), ``--reduce-dtype`` its ``mixed_precision_reduce`` (the
gradient reduce-scatter on S and AdamW-HSDP's all-reduce on R); both default to torchtitan's defaults
(bfloat16, float32), as in ``train_configs/llama3_8b_*.toml``. (``train_configs/debug_cpu.toml``
trains in float32: pass ``--param-dtype float32`` to compare with it.) The optimizers' own R traffic
does not depend on them (they hold the fp32 parameter shards).

Burst: the periodic optimizers send nothing on most steps and whole state shards on a sync, so the
per-step mean hides what one sync moves (what meets a collective timeout). ``R sent/sync`` is the R
payload per rank of the largest step: after update n the states whose period divides n are due
together, so the largest step is every state with a period > 0 at once, first after update
lcm(periods) (the ``largest after update`` column; for the local-adaptive family x, each u_j and
v; for DeMo's ``diloco`` replicator the whole shard every period). ``--steps N`` limits it to the
first N updates (MT-DAO-halflife's coprime 32, 693, 6931 coincide only after 153,701,856). It is
the family's own per-step byte formula asked of a run that syncs exactly those states every step
(their periods set to 1, the others to 0: ``periodic_states``). With ``[commopt.local] fragments`` F
> 1 the states are synced in fragments at spread offsets and the real largest step is smaller: the
column shows ``≤`` that bound. An optimizer that sends on every step (AdamW, DeMo's other
replicators, Dion) has burst = mean (``striding``: within one element per shard).

Settings: beside each row the resolved values that decide its bytes (preset, ``--set``, and
``"auto"`` periods made numbers), e.g. chunk/topk/sign/dtype for DeMo, Kx/Ku/Kv/dtype for the
local family, rank/rank_fraction/compress for Dion.

``--link RATE`` (decimal bits per second: 10mbit, 100mbit, 1gbit, 100gbit, 400gbit) adds each
optimizer's R time on the wire, per step (mean) and per sync (burst), bandwidth term only (no
latency, no overlap with compute, no protocol overhead), with the ring algorithms over a full-duplex
link of RATE per rank and direction::

    time = wire bytes per rank × 8 × ranks_per_link / RATE
    all-reduce of n bytes (ledger: n sent, n received):          wire = 2·(W − 1)/W · n
    all-gather of n bytes (ledger: n sent, (W − 1)·n received):  wire = (W − 1) · n

with W = ``--replicate`` (at W = 2 both are n). Which collective a row uses is read from the
ledger's convention (received = sent: an all-reduce; otherwise an all-gather; a row with both, the
local family's moments all-reduced beside its FP8/FP4 parameter wire all-gathered, is timed as an
all-gather, which at W > 2 over-states its moments' time by W/2). The R collectives of
the ranks of one node run at the same time: RATE is what each rank has to itself (one NIC per GPU);
where ``--ranks-per-link`` ranks share one link, each gets RATE / that number.

A bad argument (unknown flavor or optimizer, a malformed or invalid ``--set``, a degree,
``--ranks-per-link`` or ``--steps`` < 1, a malformed ``--link``) prints one line and exits with
status 2.
"""

import argparse
import dataclasses
import itertools
import json
import math
import re
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


def _r_bytes(name: str, shards, replicate: int, overrides: dict, reduce_dtype: str, horizon: int | None = None):
    """(mean R payload per rank per step, R payload of the largest step within ``horizon`` updates
    (None: ever), the update where that step first comes (1: every step sends alike; 0: nothing is
    ever synced), whether that payload is exact (else an upper bound), the Resolved or None for
    torchtitan's own optimizers)."""
    from titan_commopt.optim import owns_replicate_sync
    from titan_commopt.optim.traffic import adamw_hsdp_r_bytes

    if not owns_replicate_sync(name):
        mean = adamw_hsdp_r_bytes(shards, replicate, _itemsize(reduce_dtype))
        return mean, mean, 1, True, None
    resolved = resolved_of(name, overrides)
    mean = resolved.family.r_bytes(shards, resolved, replicate)
    burst, at, exact = largest_step(resolved, shards, replicate, horizon)
    return mean, (mean if burst is None else burst), at, exact, resolved


def largest_step(resolved, shards, replicate: int, horizon: int | None = None):
    """(R payload of the largest step within the first ``horizon`` updates (None: ever), the first
    update where it comes, whether that payload is exact (else an upper bound)); ``(None, 1, True)``
    for an optimizer that sends alike on every step, ``(0 bytes, 0, True)`` where nothing periodic is
    due within the horizon. The states due after update n are those whose period divides n, so
    every step's set of due states is a subset first due together at the lcm of its periods: the
    largest step is the largest such subset's payload (every state, at lcm(all periods), when
    ``horizon`` is None)."""
    from titan_commopt.optim import Bytes

    periodic = resolved.family.periodic(resolved)
    if periodic is None:
        return None, 1, True
    best, at = Bytes(), 0
    for size in range(len(periodic.periods), 0, -1):
        for subset in itertools.combinations(range(len(periodic.periods)), size):
            first = math.lcm(*(periodic.periods[i] for i in subset))
            if horizon is not None and first > horizon:
                continue
            alone = dataclasses.replace(resolved, options=periodic.due_alone(subset))
            payload = resolved.family.r_bytes(shards, alone, replicate)
            if payload.sent > best.sent or (payload.sent == best.sent and first < at):
                best, at = payload, first
    return best, at, periodic.exact or best.sent == 0


def settings(resolved, reduce_dtype: str) -> dict:
    """The resolved values behind a row's bytes (the family's ``settings``; torchtitan's own
    optimizers: the gradient all-reduce's dtype)."""
    if resolved is None:
        return {"gradient_all_reduce": reduce_dtype}
    return dict(resolved.family.settings(resolved))


LINK_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_link(text: str) -> float:
    """``"100gbit"`` → 1e11 bits per second (decimal units, as tc writes them). ValueError otherwise."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([a-z]+)", text.strip().lower())
    if not match or match.group(2) not in LINK_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--link {text!r}: allowed is a rate > 0 in bits per second such as 10mbit, 100mbit, "
                         f"1gbit, 100gbit, 400gbit (units: {', '.join(LINK_UNITS)})")
    return float(match.group(1)) * LINK_UNITS[match.group(2)]


def wire_bytes(sent: float, recv: float, replicate: int) -> float:
    """Bytes one rank moves each way under the ring algorithms, from the ledger's payload convention:
    received = sent is an all-reduce of n = sent (2·(W − 1)/W · n each way; at W = 2 an all-gather
    too, whose (W − 1)·n is the same n), otherwise an all-gather ((W − 1)·n = received)."""
    if recv == sent:
        return 2 * (replicate - 1) / replicate * sent
    return recv


def wire_seconds(sent: float, recv: float, replicate: int, link_bps: float, ranks_per_link: int = 1) -> float:
    """Seconds on the wire: wire bytes × 8 × ranks sharing the link / the link's bits per second."""
    return wire_bytes(sent, recv, replicate) * 8 * ranks_per_link / link_bps


def report(flavor: str, replicate: int, shard: int, names=None, overrides=None,
           param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
           link_bps: float | None = None, ranks_per_link: int = 1, horizon: int | None = None) -> list[dict]:
    """One row per optimizer. A bad option in ``overrides`` raises ConfigError (a user's mistake);
    a family that cannot price this shape is left out with a note on stderr."""
    from titan_commopt.optim import Bytes, available_names
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
            r, burst, burst_at, exact, resolved = _r_bytes(name, shards, replicate, overrides, reduce_dtype, horizon)
        except ConfigError:
            raise
        except Exception as error:  # a family that cannot price this shape: say so, keep the rest
            print(f"# {name}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        own_s = resolved.family.s_bytes(shards, resolved) if resolved and resolved.family.s_bytes else Bytes()
        row = {
            "optimizer": name, "settings": settings(resolved, reduce_dtype),
            "R_sent": r.sent, "R_recv": r.recv, "R_sent_sync": burst.sent, "R_recv_sync": burst.recv,
            "sync_at_update": burst_at,
            "sync_is_upper_bound": not exact,
            "S_sent": s.sent + own_s.sent, "S_recv": s.recv + own_s.recv,
            "vs_adamw_hsdp": hsdp / r.sent if r.sent else float("inf"),
            "vs_adamw_ddp": ddp / r.sent if r.sent else float("inf"),
        }
        if link_bps:
            row["R_seconds_step"] = wire_seconds(r.sent, r.recv, replicate, link_bps, ranks_per_link)
            row["R_seconds_sync"] = wire_seconds(burst.sent, burst.recv, replicate, link_bps, ranks_per_link)
        rows.append(row)
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
    for flag, value in (("--replicate", a.replicate), ("--shard", a.shard), ("--ranks-per-link", a.ranks_per_link)):
        if value < 1:
            out.append(f"{flag} {value}: allowed is an integer >= 1")
    if a.steps is not None and a.steps < 1:
        out.append(f"--steps {a.steps}: allowed is an integer >= 1 (or leave it out: the largest step ever)")
    if a.link is not None:
        try:
            parse_link(a.link)
        except ValueError as error:
            out.append(str(error))
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


def _settings_text(values: dict) -> str:
    return " ".join(f"{k}={str(v).replace(' ', '')}" for k, v in values.items())


def _sync_text(row: dict) -> str:
    return ("≤ " if row["sync_is_upper_bound"] else "") + human(row["R_sent_sync"])


def _due_text(row: dict) -> str:
    return {0: "never", 1: "every step"}.get(row["sync_at_update"], f"{row['sync_at_update']:,}")


def format_rows(rows: list[dict]) -> str:
    return table(
        ["optimizer", "settings behind the bytes", "R sent/step/rank (mean)", "R recv/step/rank",
         "R sent/sync/rank (burst)", "largest after update", "S sent/step/rank (FSDP2 + own)", "AdamW-HSDP ÷ this",
         "AdamW-DDP ÷ this"],
        [[r["optimizer"], _settings_text(r["settings"]), human(r["R_sent"]), human(r["R_recv"]), _sync_text(r),
          _due_text(r), human(r["S_sent"]), f"{r['vs_adamw_hsdp']:.1f}x", f"{r['vs_adamw_ddp']:.1f}x"] for r in rows],
    )


def human_seconds(t: float) -> str:
    if t == 0:
        return "0 s"
    if t < 1:
        return f"{t * 1e3:.3g} ms"
    if t < 120:
        return f"{t:.3g} s"
    return f"{t / 60:.3g} min"


def format_link(rows: list[dict], replicate: int) -> str:
    return table(
        ["optimizer", "R wire bytes/step/rank (mean)", "R time/step (mean)", "R wire bytes/sync/rank (burst)",
         "R time/sync (burst)"],
        [[r["optimizer"], human(wire_bytes(r["R_sent"], r["R_recv"], replicate)), human_seconds(r["R_seconds_step"]),
          ("≤ " if r["sync_is_upper_bound"] else "") + human(wire_bytes(r["R_sent_sync"], r["R_recv_sync"], replicate)),
          ("≤ " if r["sync_is_upper_bound"] else "") + human_seconds(r["R_seconds_sync"])] for r in rows],
    )


def link_formula(link: str, replicate: int, ranks_per_link: int) -> str:
    """The time model, as the output states it."""
    from torchtitan.config.job_config import Comm

    share = f" × {ranks_per_link} ranks per link" if ranks_per_link > 1 else ""
    return (
        f"R time on a {link} link (bandwidth term only: no latency, no overlap with compute, no protocol "
        f"overhead), ring algorithms, W = |R| = {replicate}:\n"
        f"  time = wire bytes per rank × 8{share} / {link}\n"
        f"  all-reduce of n bytes (sent = received = n): wire = 2·(W−1)/W·n; "
        f"all-gather (n sent, (W−1)·n received): wire = (W−1)·n\n"
        f"  torchtitan's default [comm] train_timeout_seconds is {Comm().train_timeout_seconds} s: a sync "
        f"that takes longer ends the run"
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
    p.add_argument("--link", help="link rate per rank in bits per second, e.g. 10mbit, 1gbit, 100gbit, 400gbit: "
                   "adds each optimizer's R time on the wire per step and per sync")
    p.add_argument("--ranks-per-link", type=int, default=1,
                   help="ranks whose R traffic shares one link of --link's rate (default 1: one NIC per GPU)")
    p.add_argument("--steps", type=int, help="burst: the largest step within the first STEPS updates "
                   "(default: ever, when every periodic state is due at once)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--png", help="write a bar chart of R bytes")
    a = p.parse_args(argv)
    problems = check_args(a)
    if problems:
        for line in problems:
            print(f"comm_report.py: {line}", file=sys.stderr)
        return 2
    link_bps = parse_link(a.link) if a.link else None
    rows = report(a.flavor, a.replicate, a.shard, a.optimizers, parse_overrides(a.set), a.param_dtype, a.reduce_dtype,
                  link_bps, a.ranks_per_link, a.steps)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        n = sum(math.prod(s) for _, s in param_shapes(a.flavor))
        print(f"flavor {a.flavor} ({n / 1e6:.1f}M params), mesh |R|={a.replicate} x |S|={a.shard}, "
              f"params all-gathered in {a.param_dtype}, gradients reduced in {a.reduce_dtype}, per rank; "
              f"burst = R payload of the largest step{f' within {a.steps} updates' if a.steps else ''}\n")
        print(format_rows(rows))
        if link_bps:
            print("\n" + link_formula(a.link, a.replicate, a.ranks_per_link) + "\n")
            print(format_link(rows, a.replicate))
    if a.png:
        plot(rows, f"{a.flavor}, |R|={a.replicate} x |S|={a.shard}", a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
