"""Time to AdamW-HSDP's loss, projected on paper for a GPU cluster: steps to the loss (from the CPU
quality study) × (compute per step + R link time per step), every assumption printed.

    .venv/bin/python scripts/project_time_to_loss.py --steps-ratio FlexDeMo=1.10 DeMo=1.3 DiLoCo=1.6 ...
    .venv/bin/python scripts/project_time_to_loss.py --links 1gbit 10gbit 100gbit --flavor 8B --replicate 2 --shard 8
    # issue 39: the iso-loss steps ratios of a convergence study (scripts/convergence.py), M = 2 and 8
    .venv/bin/python scripts/project_time_to_loss.py --steps-ratio-from /tmp/study39 --study-replicas 2 --study-flavor cpu_tiny
    .venv/bin/python scripts/project_time_to_loss.py --steps-ratio-from /tmp/study39 --study-replicas 8 --study-flavor cpu_tiny

The model, per optimizer O and link rate L (per node, shared by the node's ``--shard`` ranks):

    step time(O, L)    = forward/backward + O's optimizer step + O's R time on the wire per step
    time to loss(O, L) = steps ratio(O) × AdamW's steps × step time(O, L)
    printed:             time to loss(O, L) ÷ time to loss(AdamW-HSDP, L)

- **steps ratio**: the steps O needs to reach AdamW-HSDP's final loss ÷ the steps AdamW-HSDP took
  (``--steps-ratio NAME=R``, one per optimizer besides AdamW; an optimizer that reaches it earlier has
  R < 1), or ``--steps-ratio-from DIR``: ``scripts/convergence.py``'s iso-loss steps ratio (held-out
  loss of the global model; the mean over the study's seeds) at ``--study-replicas`` M and
  ``--study-flavor`` (``--study-steps`` where the study holds several lengths); an optimizer that
  never reached AdamW-HSDP's loss there has none (give ``--steps-ratio`` or leave it out); a
  ``--steps-ratio`` wins over the study's. It is measured on CPU models of 0.06–0.24 M parameters
  and carried over to the target model unchanged: the strongest assumption here.
- **forward/backward** (with FSDP's intra-node traffic, on NVLink): ``--tokens-per-rank`` ÷
  ``--tps-per-gpu``. Default 5,762 tokens/s per H100: torchtitan's docs/performance.md, Table 1
  (Llama 3.1 8B, 8 H100, FSDP, bf16, local batch 2 × seq 8192, selective activation checkpointing,
  no torch.compile; 33–39 % MFU); default 8,192 tokens per rank: ``train_configs/llama3_8b_*.toml``
  (local batch 1 × seq 8192).
- **optimizer step**: per optimizer, the H100 measurements of docs/benchmarks.md §5 (1.498 B
  parameters in one process), scaled by this mesh's parameters per rank; ``--opt-step-ms NAME=MS``
  replaces one (at the target's size).
- **R time**: ``scripts/comm_report.py``'s byte formulas and time model (bandwidth term only, ring
  algorithms, no latency, no overlap with compute; periodic syncs averaged over their period).

A bad argument: one line, exit status 2.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import param_shapes, parse_overrides, table  # noqa: E402
from scripts.comm_report import human_seconds, parse_link, report  # noqa: E402

# torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100, FSDP, local batch 2, seq 8192, no compile.
TORCHTITAN_8B_TPS_PER_GPU = 5762.0
# train_configs/llama3_8b_*.toml: local batch 1 × seq 8192.
TOKENS_PER_RANK = 8192

# docs/benchmarks.md §5, one H100, the 1B flavor (1,498,482,688 parameters) in one process: the
# optimizer step in ms and where each figure comes from.
STEP_PARAMS = 1_498_482_688
OPT_STEP_MS = {
    "AdamW": (17.2, "§5: torch AdamW(fused=True), one replica"),
    "DiLoCo": (17.2 * 0.96, "§5: 0.96 × fused AdamW, a non-sync step (its outer step every Kx steps is a few "
               "elementwise passes: not counted)"),
    "LocalAdam": (17.2 * 0.97, "§5: 0.97 × fused AdamW, one replica"),
    "DES-LOC": (17.2 * 1.22, "§5: 1.22 × fused AdamW, one replica"),
    "Dion": (149.7, "§5: Dion with one replica (its R traffic counted separately below)"),
    "DeMo": (157.0, "§5: DeMo's GPU time per step in the profile of two replicas (before the decode rework, "
             "so an upper bound)"),
    "FlexDeMo": (157.0 * 341.9 / 314.0, "§5: DeMo's profiled GPU time × FlexDeMo ÷ DeMo step time (341.9 / 314.0 ms)"),
    "SparseLoCo": (17.2, "not measured on a GPU: taken as fused AdamW's (its inner step is AdamW; its outer "
                   "step every H steps is not counted)"),
}


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def _pairs(items: list[str], flag: str, names: list[str], problems: list[str]) -> dict[str, float]:
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or name not in names or not number > 0 or not math.isfinite(number):
            problems.append(f"{flag} {item!r}: allowed is NAME=NUMBER with NUMBER > 0 and NAME one of {', '.join(names)}")
            continue
        out[name] = number
    return out


def forward_backward_s(tokens_per_rank: int = TOKENS_PER_RANK, tps_per_gpu: float = TORCHTITAN_8B_TPS_PER_GPU) -> float:
    """Forward/backward per step and rank (FSDP's intra-node traffic included): tokens per rank ÷
    tokens/s per GPU; by default the 8B on H100 of torchtitan's Table 1 at the 8B configs' batch."""
    return tokens_per_rank / tps_per_gpu


def optimizer_step_s(name: str, params_per_rank: float, opt_step_ms: dict[str, float]) -> float:
    """``name``'s optimizer step per rank: given (``--opt-step-ms``, at the target's size), else §5's at
    1.5 B scaled to the rank's parameters."""
    if name in opt_step_ms:
        return opt_step_ms[name] / 1e3
    return OPT_STEP_MS[name][0] / 1e3 * params_per_rank / STEP_PARAMS


def step_times(flavor: str, replicate: int, shard: int, optimizers: list[str], overrides: dict, link_bps: float,
               tokens_per_rank: int = TOKENS_PER_RANK, tps_per_gpu: float = TORCHTITAN_8B_TPS_PER_GPU,
               opt_step_ms: dict[str, float] | None = None) -> dict[str, dict]:
    """{optimizer: {"compute_s": forward/backward + its optimizer step, "r_s": its R time per step
    (mean), "r_sync_s": its largest step's}} on the link ``link_bps`` per node, the model above."""
    per_rank = sum(math.prod(s) for _, s in param_shapes(flavor)) / shard
    fwd_bwd = forward_backward_s(tokens_per_rank, tps_per_gpu)
    rows = {r["optimizer"]: r for r in report(flavor, replicate, shard, optimizers, overrides, link_bps=link_bps,
                                               ranks_per_link=shard)}
    return {n: {"compute_s": fwd_bwd + optimizer_step_s(n, per_rank, opt_step_ms or {}),
                "r_s": rows[n]["R_seconds_step"], "r_sync_s": rows[n]["R_seconds_sync"]} for n in optimizers if n in rows}


def adamw_link_to_compute(link: str = "10gbit", flavor: str = "8B", replicate: int = 2, shard: int = 8) -> float:
    """AdamW-HSDP's R time per step ÷ its compute per step in this model (8B on 2 × 8 H100 at 10 Gbit/s
    per node: the ratio ``scripts/bench_netns.py --match-8b-ratio`` reproduces on a CPU model)."""
    adamw = step_times(flavor, replicate, shard, ["AdamW"], {}, parse_link(link))["AdamW"]
    return adamw["r_s"] / adamw["compute_s"]


def study_ratios(study: Path, replicas: int, flavor: str, steps: int | None) -> tuple[dict, str]:
    """({optimizer: its mean iso-loss steps ratio, None where a seed never reached AdamW-HSDP's loss},
    where they come from) from a convergence study. Not one group there: ``ValueError``, one line."""
    from scripts.convergence import compare, groups, load_results, select

    store = study / "convergence.json"
    if not store.exists():
        raise ValueError(f"--steps-ratio-from {study}: no convergence.json there")
    results = load_results(store)
    found = groups(select(results, [replicas], [flavor], steps and [steps]))
    if len(found) != 1:
        have = "; ".join(f"M={m} {f} {n} steps" for m, f, n, _ in groups(results)) or "none"
        raise ValueError(f"--steps-ratio-from {study}: {len(found)} groups at M={replicas} {flavor}"
                         + (f" {steps} steps" if steps else "") + f" (the study has: {have}); "
                         + ("give --study-steps" if found else "allowed is one of those"))
    (group, runs), = found.items()
    compared = compare(runs, results)
    seeds = sorted({s for c in compared for s in c.seeds})
    where = (f"{store}: M = {replicas}, {flavor}, {group[2]} steps × {group[3]} tokens, seeds "
             f"{', '.join(map(str, seeds))} (the mean of the seeds' iso-loss step ÷ AdamW-HSDP's own)")
    return {c.name: c.ratio() for c in compared if c.name != "AdamW"}, where


def main(argv=None) -> int:
    p = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="8B")
    p.add_argument("--replicate", type=int, default=2, help="|R|: nodes")
    p.add_argument("--shard", type=int, default=8, help="|S|: GPUs per node (they share the node's link)")
    p.add_argument("--links", nargs="+", default=["1gbit", "10gbit", "100gbit"], help="link rate per node")
    p.add_argument("--optimizers", nargs="+", help="default: AdamW, FlexDeMo, DeMo, DiLoCo, SparseLoCo, Dion, "
                   "DES-LOC; with --steps-ratio-from, the study's optimizers that reached AdamW-HSDP's loss")
    p.add_argument("--steps-ratio", nargs="*", default=[], metavar="NAME=R",
                   help="steps to AdamW-HSDP's loss ÷ AdamW-HSDP's steps, from the quality study (every optimizer but AdamW)")
    p.add_argument("--steps-ratio-from", metavar="DIR", help="a convergence study's out folder: its iso-loss steps ratios")
    p.add_argument("--study-replicas", type=int, default=2, help="--steps-ratio-from: the study's M")
    p.add_argument("--study-flavor", default="cpu_tiny", help="--steps-ratio-from: the study's flavor")
    p.add_argument("--study-steps", type=int, help="--steps-ratio-from: the study's training steps (where it has several)")
    p.add_argument("--tps-per-gpu", type=float, default=TORCHTITAN_8B_TPS_PER_GPU,
                   help="forward/backward throughput per GPU (tokens/s)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK, help="tokens per rank per step (local batch × seq)")
    p.add_argument("--opt-step-ms", nargs="*", default=[], metavar="NAME=MS", help="an optimizer step at the target size")
    p.add_argument("--adamw-steps", type=int, default=1000, help="AdamW-HSDP's steps to its loss (only the hours use it)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE", help="family options, as comm_report.py")
    a = p.parse_args(argv)
    problems = []
    studied, study_source = {}, None
    if a.steps_ratio_from:
        try:
            studied, study_source = study_ratios(Path(a.steps_ratio_from), a.study_replicas, a.study_flavor, a.study_steps)
        except ValueError as error:
            print(f"project_time_to_loss.py: {error}", file=sys.stderr)
            return 2
    default = ["AdamW", "FlexDeMo", "DeMo", "DiLoCo", "SparseLoCo", "Dion", "DES-LOC"]
    unreached = sorted(n for n, r in studied.items() if r is None)
    if a.optimizers is None and a.steps_ratio_from:
        hand = [item.partition("=")[0] for item in a.steps_ratio]
        a.optimizers = ["AdamW", *dict.fromkeys([n for n, r in studied.items() if r is not None] + hand)]
    a.optimizers = a.optimizers or default
    if "AdamW" not in a.optimizers:
        problems.append("--optimizers: AdamW must be among them (the baseline)")
    ratios = {n: r for n, r in studied.items() if r is not None and n in a.optimizers}
    ratios.update(_pairs(a.steps_ratio, "--steps-ratio", a.optimizers, problems))
    missing = [n for n in a.optimizers if n != "AdamW" and n not in ratios]
    if missing:
        never = [n for n in missing if n in unreached]
        problems.append(f"--steps-ratio: no ratio for {', '.join(missing)} (give NAME=R for each optimizer but AdamW"
                        + (f"; {', '.join(never)} never reached AdamW-HSDP's loss in {a.steps_ratio_from}: give a "
                           "ratio by hand or leave it out of --optimizers" if never else "") + ")")
    step_ms = {n: ms for n, (ms, _) in OPT_STEP_MS.items()}
    given_ms = _pairs(a.opt_step_ms, "--opt-step-ms", a.optimizers, problems)
    unknown = [n for n in a.optimizers if n not in step_ms and n not in given_ms]
    if unknown:
        problems.append(f"--opt-step-ms: no GPU step time known for {', '.join(unknown)} (give NAME=MS)")
    links = []
    for link in a.links:
        try:
            links.append((link, parse_link(link)))
        except ValueError as error:
            problems.append(str(error))
    for flag, value in (("--replicate", a.replicate), ("--shard", a.shard), ("--tokens-per-rank", a.tokens_per_rank),
                        ("--adamw-steps", a.adamw_steps)):
        if value < 1:
            problems.append(f"{flag} {value}: allowed is an integer >= 1")
    if not a.tps_per_gpu > 0:
        problems.append(f"--tps-per-gpu {a.tps_per_gpu}: allowed is a number > 0")
    if problems:
        for line in problems:
            print(f"project_time_to_loss.py: {line}", file=sys.stderr)
        return 2
    hand_given = {item.partition("=")[0] for item in a.steps_ratio}
    ratios["AdamW"] = 1.0
    params = sum(math.prod(s) for _, s in param_shapes(a.flavor))
    per_rank = params / a.shard
    fwd_bwd = forward_backward_s(a.tokens_per_rank, a.tps_per_gpu)
    opt_s = {n: optimizer_step_s(n, per_rank, given_ms) for n in a.optimizers}

    print(f"Projection: llama3 {a.flavor} ({params / 1e9:.2f} B parameters), |R| = {a.replicate} nodes × |S| = {a.shard} "
          f"GPUs, one link per node shared by its {a.shard} ranks.\nAssumptions (each a number this script does not measure):")
    print(f"- forward/backward per step: {a.tokens_per_rank} tokens per rank ÷ {a.tps_per_gpu:,.0f} tokens/s per GPU = "
          f"{fwd_bwd:.3f} s (FSDP's intra-node traffic included; the same for every optimizer)")
    print(f"- optimizer step per rank ({per_rank / 1e9:.3f} B parameters per rank; docs/benchmarks.md §5 at "
          f"{STEP_PARAMS / 1e9:.3f} B scaled by {per_rank / STEP_PARAMS:.3f}):")
    for n in a.optimizers:
        source = "given (--opt-step-ms)" if n in given_ms else OPT_STEP_MS[n][1]
        print(f"    {n}: {opt_s[n] * 1e3:.1f} ms  ({source})")
    print("- steps to AdamW-HSDP's loss ÷ AdamW-HSDP's (from the CPU quality study, carried over unchanged): "
          + ", ".join(f"{n} {ratios[n]:.3g}" + (" (given)" if study_source and n in hand_given else "") for n in a.optimizers))
    if study_source:
        print(f"  from {study_source}" + (f"; never reached AdamW-HSDP's loss there: {', '.join(unreached)}" if unreached else ""))
    print("- R time per step: scripts/comm_report.py's bytes and time model (bandwidth only, ring algorithms, no "
          "latency, no overlap of the link with compute; periodic syncs averaged over their period)")
    from torchtitan.config.job_config import Comm

    timeout = Comm().train_timeout_seconds
    print(f"- R time/sync: the largest step's transfer; \"> timeout\": longer than torchtitan's default [comm] "
          f"train_timeout_seconds ({timeout} s), which would end the run unless raised")
    overrides = parse_overrides(a.set)
    for link, bps in links:
        times = step_times(a.flavor, a.replicate, a.shard, a.optimizers, overrides, bps, a.tokens_per_rank,
                           a.tps_per_gpu, given_ms)
        step = {n: t["compute_s"] + t["r_s"] for n, t in times.items()}
        base = ratios["AdamW"] * step["AdamW"]
        out = []
        for n in a.optimizers:
            if n not in step:
                continue
            to_loss = ratios[n] * step[n]
            burst = times[n]["r_sync_s"]
            out.append([n, f"{ratios[n]:.3g}", f"{times[n]['compute_s']:.3f}", human_seconds(times[n]["r_s"]),
                        human_seconds(burst) + (" (> timeout)" if burst > timeout else ""), f"{step[n]:.3f}",
                        f"{to_loss * a.adamw_steps / 3600:.2f}", f"{to_loss / base:.3f}"])
        print(f"\n{link} per node ({bps / a.shard / 1e9:.3g} Gbit/s per rank):")
        print(table(["optimizer", "steps ÷ AdamW's", "compute s/step", "R time/step (mean)", "R time/sync", "step s",
                     f"hours to loss ({a.adamw_steps} AdamW steps)", "time to loss ÷ AdamW-HSDP"], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
