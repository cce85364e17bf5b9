"""Per-rank bytes per step of every registered optimizer on a model flavor and mesh, no GPU needed.

    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8
    .venv/bin/python scripts/comm_report.py --flavor 300M --replicate 2 --shard 1 --png out.png
    .venv/bin/python scripts/comm_report.py --flavor cpu_tiny --replicate 2 --shard 2 --set local.Kx=2
    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8 --link 100gbit
    .venv/bin/python scripts/comm_report.py --flavor 8B --replicate 2 --shard 8 --link 1gbit --step-seconds projected --set local.merge=eager local.sync_delay=0

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
latency, no protocol overhead): the link's busy time, whether compute hides it or not (that is
``--step-seconds``), with the ring algorithms over a full-duplex link of RATE per rank and
direction::

    time = wire bytes per rank × 8 × ranks_per_link / RATE
    all-reduce of n bytes (ledger: n sent, n received):          wire = 2·(W − 1)/W · n
    all-gather of n bytes (ledger: n sent, (W − 1)·n received):  wire = (W − 1) · n

with W = ``--replicate`` (at W = 2 both are n). Which collective a row uses is read from the
ledger's convention (received = sent: an all-reduce; otherwise an all-gather; a row with both, the
local family's moments all-reduced beside its FP8/FP4 parameter wire all-gathered, is timed as an
all-gather, which at W > 2 over-states its moments' time by W/2). The R collectives of
the ranks of one node run at the same time: RATE is what each rank has to itself (one NIC per GPU);
where ``--ranks-per-link`` ranks share one link, each gets RATE / that number.

Overlap: ``--step-seconds T`` (with ``--link``; T the compute seconds of one training step on your
hardware, or ``projected``: ``scripts/project_time_to_loss.py``'s 8B forward/backward on H100, 1.42 s)
adds what of each sync hides behind compute. A sync may stay in flight over the next k steps'
compute, its window k·T, before a step waits for it: k = 0 for a blocking sync (AdamW/Adam:
torchtitan's HSDP all-reduce, which FSDP2 overlaps partly with backward, priced as not hidden, the
conservative bound; Dion; Muon; the local families and SparseLoCo with ``sync_delay`` 0 and merge
additive or lerp), k = ``sync_delay`` τ, k = the period with ``merge`` delayed or eager (the
smallest period of the states synced together), k = 1 with DeMo/FlexDeMo's ``overlap``. With
``fragments`` F each fragment's sync is priced on its own (1/F of the bytes, its own offset in the
period), as the family's schedule issues it. Per sync the exposed time is max(0, wire − window);
the predicted mean step is max(T + exposed per cycle ÷ cycle steps, link busy time per step), the
floor max(T, link busy time per step), and the table prints mean step ÷ floor (``predict_step``
holds the formula; ``hiding_window`` the windows, read from the resolved options: the presets and
``--set``). A cycle is the lcm of the periods, modeled over at most its first 1,000,000 updates
(or ``--steps``).

A bad argument (unknown flavor or optimizer, a malformed or invalid ``--set``, a degree,
``--ranks-per-link`` or ``--steps`` < 1, a malformed ``--link``, a ``--step-seconds`` not > 0 or
without ``--link``) prints one line and exits with status 2.
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

from scripts._bench_common import (  # noqa: E402
    flavor_names, human, options_of, param_shapes, parse_overrides, resolved_of, table,
)


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


PROJECTED = "projected"


def step_seconds(text: str, flavor: str) -> float:
    """``--step-seconds``: a number of seconds > 0, or ``projected``: the 8B's forward/backward per
    step of ``scripts/project_time_to_loss.py`` (8192 tokens per rank ÷ torchtitan's 5,762 tokens/s
    per H100, the optimizer step left out). ValueError otherwise."""
    if text == PROJECTED:
        if flavor != "8B":
            raise ValueError(f"--step-seconds {PROJECTED}: only with --flavor 8B (it is torchtitan's Llama 3.1 8B "
                             f"throughput on H100); give the seconds of one step for --flavor {flavor}")
        from scripts.project_time_to_loss import forward_backward_s

        return forward_backward_s()
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"--step-seconds {text!r}: allowed is the compute seconds of one training step, a number > 0 "
                         f"(e.g. 1.5), or {PROJECTED} (--flavor 8B)")
    return seconds


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


# --- overlap with compute: what a sync can hide behind, what it cannot --------------------------

# The steps the model walks through at most (one cycle of the sync pattern, lcm of the periods, is
# usually far shorter; MT-DAO-halflife's is 153,701,856 updates).
MODELED_STEPS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Sync:
    """One kind of R sync in an optimizer's cycle: its seconds on the wire, the steps of compute after
    its issue that it may stay in flight over before a step waits for it (its window), and how many
    such syncs one cycle holds."""

    wire_s: float
    window_steps: int
    per_cycle: int = 1


def predict_step(step_s: float, cycle_steps: int, syncs) -> dict:
    """The mean training step of an optimizer whose R syncs hide behind compute as far as their
    windows allow, and its ratio to the floor no schedule can beat.

    ``step_s`` T is the compute of one step (forward/backward and optimizer step); one cycle of
    ``cycle_steps`` P steps holds the ``syncs`` (:class:`Sync`: wire seconds w, window k steps, c per
    cycle). Per sync and per cycle:

        window       = k·T
        exposed      = max(0, w − k·T)                       the wait the sync adds to the step that needs it
        link         = Σ c·w ÷ P                             the link's busy seconds per step
        mean step    = max(T + Σ c·exposed ÷ P, link)
        floor        = max(T, link)                          compute or the link, whichever is slower
        mean ÷ floor = mean step ÷ floor

    A sync whose wire time exceeds its window stalls the step that needs it by the difference; a
    sync issued once more before the previous one landed (``merge`` delayed/eager with w > H·T:
    the next sync is due after H steps) first waits for that one, so the link never idles and the
    step is the link's: T + (w − H·T)/H = w/H = link, mean ÷ floor = 1. A blocking sync (k = 0)
    adds its whole w, so mean ÷ floor > 1 even where the link is the floor. The max with ``link``
    covers syncs whose windows overlap each other (fragments issued closer than τ steps apart,
    states with different periods under delayed/eager): each is priced here as if it had the link
    to itself, so between the two bounds the prediction is optimistic. Latency and protocol
    overhead are not modeled (bandwidth term only)."""
    windows = [s.window_steps * step_s for s in syncs]
    exposed = [max(0.0, s.wire_s - window) for s, window in zip(syncs, windows)]
    exposed_per_step = sum(s.per_cycle * e for s, e in zip(syncs, exposed)) / cycle_steps
    link = sum(s.per_cycle * s.wire_s for s in syncs) / cycle_steps
    mean_step = max(step_s + exposed_per_step, link)
    floor = max(step_s, link)
    return {"window_s": windows, "exposed_s": exposed, "exposed_s_step": exposed_per_step, "link_s_step": link,
            "mean_step_s": mean_step, "floor_s": floor, "ratio": mean_step / floor}


def hiding_window(resolved, due_periods: tuple[int, ...]) -> int:
    """Steps of compute an R sync issued after an update stays in flight over before a step waits for
    it (docs/options.md's semantics, as each family's step issues and lands it):

    - ``sync_delay`` τ (local family, SparseLoCo): τ; 0 with merge additive or lerp is blocking;
    - ``merge`` delayed / eager: applied at the next sync, so the smallest period of the states
      synced together (``due_periods``; SparseLoCo's H);
    - DeMo/FlexDeMo's ``overlap``: 1 (the all-gather of step t runs through step t+1's forward and
      backward; its optimizer step, inside T, is not taken off);
    - 0 for the rest: Dion, Muon, and torchtitan's AdamW/Adam (``resolved`` None). torch's FSDP2
      issues HSDP's R all-reduce per module group on its own stream during backward, so part of it
      hides behind the backward of the groups before; how much depends on the layer timings, which
      this report does not know, so it is priced as blocking (the conservative bound)."""
    if resolved is None:
        return 0
    from titan_commopt.optim.local.sync import OVERLAPPED_MERGES

    options = resolved.options
    if getattr(options, "merge", None) in OVERLAPPED_MERGES:
        return min(due_periods)
    if getattr(options, "overlap", False):
        return 1
    return getattr(options, "sync_delay", 0)


def sync_cycle(resolved, shards, replicate: int, mean, horizon: int | None = None) -> tuple[int, list]:
    """(steps modeled, [(R payload of one sync (Bytes), its window in steps, how many)]): one cycle of
    the optimizer's sync pattern (lcm of its periods; 1 for an optimizer that sends alike on every
    step, ``mean`` then), cut at ``horizon`` updates and at ``MODELED_STEPS``. The local family's
    steps are its own schedule's (``sync_schedule``): the (state, fragment) pairs due after each
    update go in one all-reduce, each priced by the family's byte formula on that fragment's shards."""
    from titan_commopt.optim import Bytes

    periodic = resolved.family.periodic(resolved) if resolved is not None else None
    if periodic is None:
        return 1, [(mean, hiding_window(resolved, (1,)), 1)]
    if not periodic.periods:
        return 1, []
    steps = min(math.lcm(*periodic.periods), horizon or MODELED_STEPS, MODELED_STEPS)
    alone = lambda i: dataclasses.replace(resolved, options=periodic.due_alone((i,)))  # noqa: E731
    if not periodic.states:  # no schedule to ask (SparseLoCo's H, DeMo's diloco replicator): each state on its own
        return steps, [(resolved.family.r_bytes(shards, alone(i), replicate), hiding_window(resolved, (period,)),
                        steps // period) for i, period in enumerate(periodic.periods) if steps >= period]
    from titan_commopt.optim.local.adaptive import resolve_periods, sync_schedule

    schedule = sync_schedule(resolved.options, resolve_periods(resolved.options, resolved.hparams),
                             [s.fqn for s in shards], [s.numel for s in shards])
    parts = [[s for s, f in zip(shards, schedule.fragment_of) if f == fragment]
             for fragment in range(schedule.fragments)]
    payload = {kind: [resolved.family.r_bytes(part, alone(i), replicate) for part in parts]
               for i, kind in enumerate(periodic.states)}
    period_of = dict(zip(periodic.states, periodic.periods))
    counts: dict[tuple, int] = {}
    for n in schedule.due_steps(steps):
        due = schedule.due(n)
        sent = sum(payload[kind][f].sent for kind, fragments in due.items() for f in sorted(fragments))
        recv = sum(payload[kind][f].recv for kind, fragments in due.items() for f in sorted(fragments))
        key = (sent, recv, hiding_window(resolved, tuple(period_of[kind] for kind in due)))
        counts[key] = counts.get(key, 0) + 1
    return steps, [(Bytes(sent, recv), window, count) for (sent, recv, window), count in counts.items()]


def overlap_of(resolved, shards, replicate: int, mean, step_s: float, link_bps: float, ranks_per_link: int = 1,
               horizon: int | None = None) -> dict:
    """A row's overlap model (:func:`predict_step` on :func:`sync_cycle`'s syncs on the link), with its
    largest sync's wire, window and exposed time."""
    steps, cycle = sync_cycle(resolved, shards, replicate, mean, horizon)
    syncs = [Sync(wire_seconds(b.sent, b.recv, replicate, link_bps, ranks_per_link), window, count)
             for b, window, count in cycle]
    model = predict_step(step_s, steps, syncs)
    out = {"step_s": step_s, "cycle_steps": steps, "syncs_per_cycle": sum(s.per_cycle for s in syncs),
           **{key: model[key] for key in ("exposed_s_step", "link_s_step", "mean_step_s", "floor_s", "ratio")},
           "sync_wire_s": 0.0, "sync_window_steps": 0, "sync_window_s": 0.0, "sync_exposed_s": 0.0}
    if syncs:  # the largest sync (the longest on the wire; of equals, the least hidden)
        i = max(range(len(syncs)), key=lambda i: (syncs[i].wire_s, -syncs[i].window_steps))
        out |= {"sync_wire_s": syncs[i].wire_s, "sync_window_steps": syncs[i].window_steps,
                "sync_window_s": model["window_s"][i], "sync_exposed_s": model["exposed_s"][i]}
    return out


def report(flavor: str, replicate: int, shard: int, names=None, overrides=None,
           param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
           link_bps: float | None = None, ranks_per_link: int = 1, horizon: int | None = None,
           step_s: float | None = None) -> list[dict]:
    """One row per optimizer; with ``link_bps`` its R time on the wire, with ``step_s`` too its overlap
    model (``row["overlap"]``: :func:`overlap_of`). A bad option in ``overrides`` raises ConfigError
    (a user's mistake); a family that cannot price this shape is left out with a note on stderr."""
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
            if step_s:
                row["overlap"] = overlap_of(resolved, shards, replicate, r, step_s, link_bps, ranks_per_link, horizon)
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
    if a.step_seconds is not None:
        try:
            step_seconds(a.step_seconds, a.flavor)
        except ValueError as error:
            out.append(str(error))
        if a.link is None:
            out.append(f"--step-seconds {a.step_seconds}: needs --link RATE (the model sets the wire time against the "
                       "compute)")
    names = available_names()
    for name in a.optimizers or []:
        if name not in names:
            out.append(f"--optimizers {name!r}: allowed is one of {', '.join(names)}")
    try:
        overrides = parse_overrides(a.set)
    except ConfigError as error:
        return out + [str(error)]
    chosen = [n for n in (a.optimizers or names) if n in names]
    for key, given in overrides.items():
        if key == "commopt":
            continue
        if key in FAMILIES:  # a family's options, as the first chosen name of it resolves them
            family = FAMILIES[key]
            name = next((n for n in chosen if n not in ("AdamW", "Adam") and family_of(n) is family),
                        next(iter(family.presets)))
            options = given
        else:  # one optimizer's own, over its family's
            name, options = key, options_of(key, overrides)
        try:
            resolve(name, options)
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


def _steps_text(steps: int) -> str:
    return "1 step" if steps == 1 else f"{steps:,} steps"


def format_overlap(rows: list[dict]) -> str:
    def row(r: dict) -> list[str]:
        o = r["overlap"]
        every = "every step" if o["cycle_steps"] == 1 and o["syncs_per_cycle"] == 1 else \
            f"{o['syncs_per_cycle']:,} per {_steps_text(o['cycle_steps'])}"
        return [r["optimizer"], every,
                human_seconds(o["sync_wire_s"]),
                f"{o['sync_window_steps']:,} × T = {human_seconds(o['sync_window_s'])}",
                human_seconds(o["sync_exposed_s"]), human_seconds(o["exposed_s_step"]), human_seconds(o["link_s_step"]),
                f"{o['floor_s']:.3g} s", f"{o['mean_step_s']:.3g} s", f"{o['ratio']:.3f}"]

    return table(["optimizer", "R syncs", "largest sync: wire", "its window", "its exposed time",
                  "exposed/step (mean)", "link/step (mean)", "floor", "mean step", "mean step ÷ floor"],
                 [row(r) for r in rows])


def overlap_formula(step_s: float, given: str) -> str:
    """The overlap model, as the output states it: :func:`predict_step`'s formula (its docstring's
    indented block) and the windows of :func:`hiding_window`."""
    formula = [line.strip() for line in predict_step.__doc__.splitlines() if line.startswith(" " * 8)]
    source = "" if given != PROJECTED else (
        " (projected: scripts/project_time_to_loss.py's 8B forward/backward, 8192 tokens per rank ÷ 5,762 tokens/s "
        "per H100; optimizer step not included)")
    return "\n".join([
        f"Overlap with compute, T = {step_s:.3g} s of compute per step{source}. A sync stays in flight over the "
        "next k steps' compute (its window) before a step waits for it:",
        "  k = 0: blocking (AdamW/Adam: HSDP's all-reduce priced as not hidden by backward; Dion; Muon; "
        "sync_delay 0 with merge additive/lerp)",
        "  k = sync_delay τ; k = the period with merge delayed/eager (the smallest of the states synced together); "
        "k = 1 with DeMo's overlap;",
        "  fragments: each fragment's sync on its own. Per sync, over one cycle of P steps (c syncs of wire time w):",
        *(f"    {line}" for line in formula)])


def link_formula(link: str, replicate: int, ranks_per_link: int) -> str:
    """The time model, as the output states it."""
    from torchtitan.config.job_config import Comm

    share = f" × {ranks_per_link} ranks per link" if ranks_per_link > 1 else ""
    return (
        f"R time on a {link} link (bandwidth term only: no latency, no protocol overhead; the time on the wire, "
        f"before any overlap with compute: --step-seconds), ring algorithms, W = |R| = {replicate}:\n"
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
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE",
                   help="family options, e.g. demo.chunk=32 local.Kx=64; an optimizer's name for it alone, e.g. DiLoCo.Kx=64")
    p.add_argument("--param-dtype", default="bfloat16", choices=_dtype_choices("mixed_precision_param"),
                   help="[training] mixed_precision_param: FSDP2's all-gather dtype (S column); "
                   "default torchtitan's, bfloat16")
    p.add_argument("--reduce-dtype", default="float32", choices=_dtype_choices("mixed_precision_reduce"),
                   help="[training] mixed_precision_reduce: gradient reduce dtype (S column, AdamW-HSDP's R); "
                   "default torchtitan's, float32")
    p.add_argument("--link", help="link rate per rank in bits per second, e.g. 10mbit, 1gbit, 100gbit, 400gbit: "
                   "adds each optimizer's R time on the wire per step and per sync")
    p.add_argument("--step-seconds", metavar="T", help="compute seconds of one training step on your hardware "
                   f"(or {PROJECTED}: the 8B's forward/backward on H100): with --link, what of each sync hides "
                   "behind compute and the predicted mean step")
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
    step_s = step_seconds(a.step_seconds, a.flavor) if a.step_seconds is not None else None
    rows = report(a.flavor, a.replicate, a.shard, a.optimizers, parse_overrides(a.set), a.param_dtype, a.reduce_dtype,
                  link_bps, a.ranks_per_link, a.steps, step_s)
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
        if step_s:
            print("\n" + overlap_formula(step_s, a.step_seconds) + "\n")
            print(format_overlap(rows))
    if a.png:
        plot(rows, f"{a.flavor}, |R|={a.replicate} x |S|={a.shard}", a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
