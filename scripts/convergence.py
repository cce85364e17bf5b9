"""Loss vs step and vs R bytes for AdamW-HSDP and every registered optimizer, same model, data,
steps and seed, on 4 CPU processes (|R| = 2 replicas x |S| = 2 FSDP shards).

    .venv/bin/python scripts/convergence.py --out docs/img --steps 300
    .venv/bin/python scripts/convergence.py --steps 4 --flavor cpu_tiny --optimizers AdamW DeMo

Each run is ``titan_commopt.train`` with ``train_configs/debug_cpu.toml`` (cpu_small, the bundled
corpus, seed 42), ``--optimizer.name`` changed and nothing else; family options via ``--set``, another seed via
``--seed`` (a second seed of the same optimizer measures the run-to-run noise).
Reads ``loss_metrics/global_avg_loss`` and ``comm/R_sent_bytes_total`` from each run's TensorBoard
log, writes ``loss_vs_step.png``, ``loss_vs_r_bytes.png`` and prints the final-loss table (mean of
the last 10% of logged steps, to damp batch noise).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import cli_overrides, human, parse_overrides, read_scalars, run_train, table  # noqa: E402


def run_all(names, steps, flavor, out: Path, overrides, lr=None, log_freq=1, seed=42) -> dict:
    results = {}
    for name in names:
        dump = out / "runs" / name
        extra = ["--lr_scheduler.warmup_steps", str(max(1, steps // 20)), "--debug.seed", str(seed)]
        if lr is not None:
            extra += ["--optimizer.lr", str(lr)]
        t0 = time.time()
        try:
            run_train(
                dump, 4, "--model.flavor", flavor, "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
                "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                "--optimizer.name", name, *extra, *cli_overrides(name, overrides),
            )
        except RuntimeError as error:
            print(f"# {name} failed: {str(error)[-1500:]}", file=sys.stderr)
            continue
        s = read_scalars(dump)
        loss = s["loss_metrics/global_avg_loss"]
        r_total = dict(s.get("comm/R_sent_bytes_total", []))
        results[name] = {
            "steps": [k for k, _ in loss], "loss": [v for _, v in loss],
            "r_bytes": [r_total.get(k, float("nan")) for k, _ in loss], "seconds": time.time() - t0,
        }
        print(f"{name}: final loss {loss[-1][1]:.4f} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return results


def final_table(results: dict) -> str:
    rows = []
    base = results.get("AdamW")
    for name, r in results.items():
        tail = max(1, len(r["loss"]) // 10)
        final = sum(r["loss"][-tail:]) / tail
        delta = f"{final - sum(base['loss'][-tail:]) / tail:+.4f}" if base else "-"  # AdamW not in this run
        rows.append([name, f"{final:.4f}", delta, human(r["r_bytes"][-1]), f"{r['seconds']:.0f}"])
    return table(["optimizer", "final loss (mean last 10%)", "− AdamW-HSDP", "R sent total (rank 0)", "wall s"], rows)


def plot(results: dict, out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, fname, logx in (("steps", "step", "loss_vs_step.png", False),
                                     ("r_bytes", "R bytes sent per rank (cumulative; 0 drawn at 1)",
                                      "loss_vs_r_bytes.png", True)):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in results.items():
            xs = [max(x, 1.0) for x in r[key]] if logx else r[key]
            ax.plot(xs, r["loss"], label=name, lw=1.2, ls="--" if name == "AdamW" else "-")
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss")
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    return paths


def main(argv=None) -> int:
    from titan_commopt.optim import available_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--lr", type=float, help="override [optimizer] lr for every run (default: the config's)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--seed", type=int, default=42, help="[debug] seed (model initialization; the data order is fixed)")
    p.add_argument("--out", default="outputs/convergence")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    results = run_all(names, a.steps, a.flavor, out, parse_overrides(a.set), a.lr, seed=a.seed)
    if not results:
        print("no run finished", file=sys.stderr)
        return 1
    (out / "convergence.json").write_text(json.dumps(results))
    lr = f", lr {a.lr:g}" if a.lr is not None else ""
    paths = plot(results, out, f"{a.flavor}, 2 replicas x 2 shards, {a.steps} steps, seed {a.seed}{lr}")
    print(final_table(results))
    print("\nplots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
