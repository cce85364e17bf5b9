"""Time to AdamW-HSDP's loss, projected on paper for a GPU cluster: steps to the loss (from the CPU
quality study) × (compute per step + R link time per step), every assumption printed.

    .venv/bin/python scripts/project_time_to_loss.py --steps-ratio FlexDeMo=1.10 DeMo=1.3 DiLoCo=1.6 ...
    .venv/bin/python scripts/project_time_to_loss.py --links 1gbit 10gbit 100gbit --flavor 8B --replicate 2 --shard 8

The model, per optimizer O and link rate L (per node, shared by the node's ``--shard`` ranks):

    step time(O, L)    = forward/backward + O's optimizer step + O's R time on the wire per step
    time to loss(O, L) = steps ratio(O) × AdamW's steps × step time(O, L)
    printed:             time to loss(O, L) ÷ time to loss(AdamW-HSDP, L)

- **steps ratio**: the steps O needs to reach AdamW-HSDP's final loss ÷ the steps AdamW-HSDP took
  (``--steps-ratio NAME=R``, one per optimizer besides AdamW: from ``scripts/convergence.py``'s
  "reaches AdamW's loss at step" column; an optimizer that reaches it earlier has R < 1). It is
  measured on a 0.2 M-parameter CPU model and carried over to the target model unchanged: the
  strongest assumption here.
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


def main(argv=None) -> int:
    p = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="8B")
    p.add_argument("--replicate", type=int, default=2, help="|R|: nodes")
    p.add_argument("--shard", type=int, default=8, help="|S|: GPUs per node (they share the node's link)")
    p.add_argument("--links", nargs="+", default=["1gbit", "10gbit", "100gbit"], help="link rate per node")
    p.add_argument("--optimizers", nargs="+", default=["AdamW", "FlexDeMo", "DeMo", "DiLoCo", "SparseLoCo", "Dion", "DES-LOC"])
    p.add_argument("--steps-ratio", nargs="*", default=[], metavar="NAME=R",
                   help="steps to AdamW-HSDP's loss ÷ AdamW-HSDP's steps, from the quality study (every optimizer but AdamW)")
    p.add_argument("--tps-per-gpu", type=float, default=TORCHTITAN_8B_TPS_PER_GPU,
                   help="forward/backward throughput per GPU (tokens/s)")
    p.add_argument("--tokens-per-rank", type=int, default=8192, help="tokens per rank per step (local batch × seq)")
    p.add_argument("--opt-step-ms", nargs="*", default=[], metavar="NAME=MS", help="an optimizer step at the target size")
    p.add_argument("--adamw-steps", type=int, default=1000, help="AdamW-HSDP's steps to its loss (only the hours use it)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE", help="family options, as comm_report.py")
    a = p.parse_args(argv)
    problems = []
    if "AdamW" not in a.optimizers:
        problems.append("--optimizers: AdamW must be among them (the baseline)")
    ratios = _pairs(a.steps_ratio, "--steps-ratio", a.optimizers, problems)
    missing = [n for n in a.optimizers if n != "AdamW" and n not in ratios]
    if missing:
        problems.append(f"--steps-ratio: no ratio for {', '.join(missing)} (give NAME=R for each optimizer but AdamW)")
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
    ratios["AdamW"] = 1.0
    params = sum(math.prod(s) for _, s in param_shapes(a.flavor))
    per_rank = params / a.shard
    fwd_bwd = a.tokens_per_rank / a.tps_per_gpu
    opt_s = {n: given_ms[n] / 1e3 if n in given_ms else step_ms[n] / 1e3 * per_rank / STEP_PARAMS for n in a.optimizers}

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
          + ", ".join(f"{n} {ratios[n]:.3g}" for n in a.optimizers))
    print("- R time per step: scripts/comm_report.py's bytes and time model (bandwidth only, ring algorithms, no "
          "latency, no overlap of the link with compute; periodic syncs averaged over their period)")
    from torchtitan.config.job_config import Comm

    timeout = Comm().train_timeout_seconds
    print(f"- R time/sync: the largest step's transfer; \"> timeout\": longer than torchtitan's default [comm] "
          f"train_timeout_seconds ({timeout} s), which would end the run unless raised")
    overrides = parse_overrides(a.set)
    for link, bps in links:
        rows = {r["optimizer"]: r for r in report(a.flavor, a.replicate, a.shard, a.optimizers, overrides,
                                                   link_bps=bps, ranks_per_link=a.shard)}
        step = {n: fwd_bwd + opt_s[n] + rows[n]["R_seconds_step"] for n in a.optimizers if n in rows}
        base = ratios["AdamW"] * step["AdamW"]
        out = []
        for n in a.optimizers:
            if n not in step:
                continue
            to_loss = ratios[n] * step[n]
            burst = rows[n]["R_seconds_sync"]
            out.append([n, f"{ratios[n]:.3g}", f"{fwd_bwd + opt_s[n]:.3f}", human_seconds(rows[n]["R_seconds_step"]),
                        human_seconds(burst) + (" (> timeout)" if burst > timeout else ""), f"{step[n]:.3f}", f"{to_loss * a.adamw_steps / 3600:.2f}", f"{to_loss / base:.3f}"])
        print(f"\n{link} per node ({bps / a.shard / 1e9:.3g} Gbit/s per rank):")
        print(table(["optimizer", "steps ÷ AdamW's", "compute s/step", "R time/step (mean)", "R time/sync", "step s",
                     f"hours to loss ({a.adamw_steps} AdamW steps)", "time to loss ÷ AdamW-HSDP"], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
