"""Muon's step at a GPU cluster's size, on paper: the Newton–Schulz flops of one step, their time on
one GPU, against the forward/backward of the step and AdamW's memory-bound step.

    .venv/bin/python scripts/muon_step_projection.py                  # llama3 8B, 8 GPUs per shard group
    .venv/bin/python scripts/muon_step_projection.py --flavor 1B --shard 1 --tflops 700 989

The model (every number it takes is printed with the result):

- **matrices**: the parameters of torchtitan's llama3 ``--flavor`` that Muon routes to its matrix step
  (``optim/muon/options.py``'s routing: the hidden 2-D matrices; embeddings, head and norms go to
  AdamW), each orthogonalized whole once per step: Muon's, and MuLoCo's and MuLoCo-2bit's inner step.
- **flops**: ``orthogonalize.newton_schulz_flops`` (the matmuls of each Newton–Schulz iteration:
  4m²n + 2m³ for m ≤ n) × the iterations of the Muon preset's schedule (5: MuLoCo's five triples;
  ``--set muon.muon_coefficients=keller muon.muon_ns_steps=N`` for another).
- **owners**: FSDP2 shards every matrix over the ``--shard`` ranks of a replica (Shard(0)); the
  matrices of one shape form a batch and item j of a batch is orthogonalized by rank (base + j) mod S
  (``optim/muon/layout.py``'s rule, taken from ``plan_batch``): a step waits for the busiest rank.
  Every replica does the same work (the replicas hold the same matrices).
- **time**: the busiest rank's flops ÷ a dense bfloat16 matmul throughput per GPU (``--tflops``; the
  Newton–Schulz iterations run in ``muon_dtype`` = bf16). Default: 989 TFLOP/s, the H100 SXM's dense
  bf16 peak, and 700, an assumption for what large batched GEMMs reach (about 70 % of peak).
- **forward/backward**: 6 · N · tokens per rank (the matmuls of a dense transformer; attention's
  score flops left out), and its time at ``--tps-per-gpu`` tokens/s (default: what torchtitan
  measured at 8B on H100s, ``project_time_to_loss.py``'s ``TORCHTITAN_8B_TPS_PER_GPU``; tokens per
  rank as there: local batch 1 × seq 8192).
- **AdamW's step**: memory bound: per parameter shard, fused AdamW reads the float32 parameter,
  gradient and both moments and writes the parameter and the moments back (7 × 4 bytes), at
  ``--hbm`` bytes/s (H100 SXM: 3.35 TB/s); and, as measured, ``project_time_to_loss.py``'s §5 H100
  figure scaled to the rank's parameters.

What it leaves out: Muon's elementwise work (momentum, the bf16 cast, the update: passes over the
matrices like AdamW's), its S-group exchange of the matrices' pieces (``scripts/comm_report.py``
prices it), and any overlap of the step with the link.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import param_shapes, parse_overrides, resolved_of, table  # noqa: E402
from scripts.project_time_to_loss import TORCHTITAN_8B_TPS_PER_GPU, optimizer_step_s  # noqa: E402

H100_BF16_DENSE_PEAK = 989e12  # flop/s, H100 SXM, dense (no 2:4 sparsity)
H100_BF16_ACHIEVABLE = 700e12  # flop/s, an assumption: large batched bf16 GEMMs at ~70 % of the peak
H100_HBM = 3.35e12  # bytes/s, H100 SXM HBM3
ADAMW_BYTES_PER_PARAM = 7 * 4  # fused AdamW: reads p, g, m, v and writes p, m, v, all float32


def muon_plan(flavor: str, overrides: dict | None = None) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """The (fqn, shape) of the parameters of ``flavor`` that the Muon preset (with ``overrides``,
    ``{"muon": {option: value}}``) routes to its matrix step, in parameter order, and its
    Newton–Schulz iterations per step."""
    from titan_commopt.optim.muon.options import is_muon_matrix
    from titan_commopt.optim.orthogonalize import ns_schedule

    cfg = resolved_of("Muon", overrides or {}).options
    matrices = [(fqn, shape) for fqn, shape in param_shapes(flavor) if is_muon_matrix(fqn, shape, cfg)]
    return matrices, len(ns_schedule(cfg.muon_coefficients, cfg.muon_ns_steps))


def _fsdp_pieces(shape: tuple[int, ...], shard: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offset, shape) of each rank's piece of a parameter FSDP2 shards on dim 0 over ``shard`` ranks:
    torch's own shard arithmetic (uneven where ``shard`` does not divide the dim)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    pieces = []
    for q in range(shard):
        piece, offset = _compute_local_shape_and_global_offset(shape, (shard,), [q], [Shard(0)])
        pieces.append((tuple(int(o) for o in offset), tuple(int(s) for s in piece)))
    return pieces


def rank_flops(matrices: list[tuple[str, tuple[int, ...]]], shard: int, iterations: int) -> list[int]:
    """The Newton–Schulz flops of one step on each of the ``shard`` ranks of a replica, FSDP2
    sharding every parameter on dim 0. A 2-D matrix is cut: the matrices of one shape form a batch
    (in order of first appearance) and ``layout.plan_batch`` says which rank owns each. A 3-D stack
    is split along its stack dim only: every rank orthogonalizes the slices it holds."""
    import torch

    from titan_commopt.optim.muon.layout import Cut, plan_batch
    from titan_commopt.optim.orthogonalize import newton_schulz_flops

    batches: dict[tuple[int, ...], int] = {}
    for _, shape in matrices:
        batches[shape] = batches.get(shape, 0) + 1
    per_rank = [0] * shard
    base = 0
    for shape, k in batches.items():
        matrix = newton_schulz_flops(shape[-2], shape[-1], iterations)
        pieces = _fsdp_pieces(shape, shard)
        if len(shape) == 3 or shard == 1:
            for coord, (_, piece) in enumerate(pieces):
                per_rank[coord] += k * math.prod(piece[:-2]) * matrix
            continue
        for coord in range(shard):
            cut = Cut(shape, [("S", None)], (shard,), (coord,), tuple(pieces))
            per_rank[coord] += len(plan_batch(cut, k, base, torch.device("cpu")).owned) * matrix
        base += k
    return per_rank


def projection(flavor: str = "8B", shard: int = 8, tokens_per_rank: int = 8192,
               tflops: tuple[float, ...] = (H100_BF16_ACHIEVABLE / 1e12, H100_BF16_DENSE_PEAK / 1e12),
               hbm: float = H100_HBM, tps_per_gpu: float = TORCHTITAN_8B_TPS_PER_GPU,
               overrides: dict | None = None) -> dict:
    """Every number of the projection (flops, seconds, bytes), for the printout and the tests."""
    from titan_commopt.optim.orthogonalize import newton_schulz_flops

    matrices, iterations = muon_plan(flavor, overrides)
    params = sum(math.prod(s) for _, s in param_shapes(flavor))
    shapes: dict[tuple[int, ...], int] = {}
    for _, shape in matrices:
        shapes[shape] = shapes.get(shape, 0) + 1
    per_rank = rank_flops(matrices, shard, iterations)
    fwd_bwd = 6 * params * tokens_per_rank
    per_rank_params = params / shard
    return {
        "flavor": flavor, "shard": shard, "iterations": iterations, "params": params,
        "matrix_params": sum(math.prod(s) for _, s in matrices),
        "shapes": [(shape, k, math.prod(shape[:-2]) * newton_schulz_flops(shape[-2], shape[-1], iterations))
                   for shape, k in shapes.items()],
        "total_flops": sum(per_rank), "rank_flops": per_rank, "busiest_flops": max(per_rank),
        "ns_seconds": {t: max(per_rank) / (t * 1e12) for t in tflops},
        "tokens_per_rank": tokens_per_rank, "fwd_bwd_flops": fwd_bwd,
        "tps_per_gpu": tps_per_gpu, "fwd_bwd_seconds": tokens_per_rank / tps_per_gpu,
        "adamw_bytes": ADAMW_BYTES_PER_PARAM * per_rank_params, "hbm": hbm,
        "adamw_seconds": ADAMW_BYTES_PER_PARAM * per_rank_params / hbm,
        "adamw_measured_seconds": optimizer_step_s("AdamW", per_rank_params, {}),
    }


def _t(flops: float) -> str:
    return f"{flops / 1e12:,.1f} TFLOP"


def report(p: dict) -> str:
    lines = [f"Muon's step at llama3 {p['flavor']} ({p['params'] / 1e9:.3f} B parameters, "
             f"{p['matrix_params'] / 1e9:.3f} B in the matrices Muon orthogonalizes), |S| = {p['shard']} ranks per "
             f"replica, {p['iterations']} Newton–Schulz iterations of 4m²n + 2m³ flops (m ≤ n):", ""]
    rows = []
    for shape, k, flops in p["shapes"]:
        m, n = sorted(shape[-2:])
        rows.append([" × ".join(map(str, shape)), k, f"{m} × {n}", f"{flops / 1e12:.3f}", f"{k * flops / 1e12:,.1f}"])
    lines.append(table(["shape", "matrices", "m × n (m ≤ n)", "TFLOP per matrix per step", "TFLOP per step"], rows))
    busiest, total = p["busiest_flops"], p["total_flops"]
    lines += ["", f"- all matrices: {_t(total)} per step and replica; the busiest of the {p['shard']} owner ranks: "
              f"{_t(busiest)} ({busiest / total:.4f} of it; the least busy {_t(min(p['rank_flops']))})"]
    for tf, s in p["ns_seconds"].items():
        lines.append(f"- on one GPU at {tf:g} TFLOP/s bf16: {s * 1e3:.1f} ms per step "
                     f"(all of it on one rank, no shard group: {s * total / busiest * 1e3:.0f} ms)")
    fb, fbs = p["fwd_bwd_flops"], p["fwd_bwd_seconds"]
    lines += [f"- forward/backward per rank: 6 · N · {p['tokens_per_rank']} tokens = {_t(fb)}; the busiest rank's "
              f"Newton–Schulz is {busiest / fb:.3f} of it",
              f"- forward/backward time at {p['tps_per_gpu']:,.0f} tokens/s per GPU: "
              f"{fbs:.3f} s; Newton–Schulz ÷ that: "
              + ", ".join(f"{s / fbs:.3f} at {tf:g} TFLOP/s" for tf, s in p["ns_seconds"].items()),
              f"- AdamW's step per rank, memory bound: {ADAMW_BYTES_PER_PARAM} B × {p['params'] / p['shard'] / 1e9:.3f} B "
              f"parameters = {p['adamw_bytes'] / 1e9:.1f} GB ÷ {p['hbm'] / 1e12:g} TB/s = {p['adamw_seconds'] * 1e3:.1f} ms; "
              f"as measured on one H100 (docs/benchmarks.md §5, scaled to the rank's parameters): "
              f"{p['adamw_measured_seconds'] * 1e3:.1f} ms",
              "- Newton–Schulz ÷ AdamW's step: "
              + ", ".join(f"{s / p['adamw_seconds']:.1f}× (bandwidth bound) / {s / p['adamw_measured_seconds']:.1f}× "
                          f"(measured) at {tf:g} TFLOP/s" for tf, s in p["ns_seconds"].items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="8B")
    p.add_argument("--shard", type=int, default=8, help="|S|: ranks per replica that share out the matrices")
    p.add_argument("--tokens-per-rank", type=int, default=8192, help="local batch × seq len")
    p.add_argument("--tflops", type=float, nargs="+", default=[H100_BF16_ACHIEVABLE / 1e12, H100_BF16_DENSE_PEAK / 1e12],
                   help="bf16 dense matmul throughput per GPU, TFLOP/s (one line each)")
    p.add_argument("--hbm", type=float, default=H100_HBM, help="memory bandwidth per GPU, bytes/s")
    p.add_argument("--tps-per-gpu", type=float, default=TORCHTITAN_8B_TPS_PER_GPU,
                   help="forward/backward tokens/s per GPU (default: torchtitan's 8B on H100)")
    p.add_argument("--set", nargs="*", default=[], metavar="muon.OPTION=VALUE",
                   help="Muon's options (routing, Newton–Schulz schedule)")
    a = p.parse_args(argv)
    for flag, value in (("--shard", a.shard), ("--tokens-per-rank", a.tokens_per_rank)):
        if value < 1:
            p.error(f"{flag} {value}: allowed is an integer >= 1")
    if not all(t > 0 for t in a.tflops) or not a.hbm > 0 or not a.tps_per_gpu > 0:
        p.error("--tflops, --hbm, --tps-per-gpu: allowed are numbers > 0")
    print(report(projection(a.flavor, a.shard, a.tokens_per_rank, tuple(a.tflops), a.hbm, a.tps_per_gpu,
                            parse_overrides(a.set))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
