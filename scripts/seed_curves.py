"""Every seed's loss curve of a few runs of ``scripts/convergence.py`` studies, side by side: where
the seeds part, and when each one crosses given loss levels.

    .venv/bin/python scripts/seed_curves.py AdamW=/tmp/study/base:AdamW "FlexDeMo k16=/tmp/study/base:FlexDeMo" \
        "FlexDeMo k32=/tmp/study/flex_k32:FlexDeMo" --levels 1.6 1.4 1.2 --png docs/img/seeds.png

Each ``LABEL=DIR:NAME`` is the optimizer NAME of the study in DIR (its ``convergence.json``) at its best
lr there, every seed; where a study holds runs at several M, flavors or lengths, ``--replicas``,
``--flavor`` and ``--steps`` pick one. Prints, per run and seed: the final loss (mean of the last 10 % of steps), the
first step at which the trailing mean of ``--window`` losses reaches each level, and the mean
``grad_norm`` of the last 20 % of steps (from the run's TensorBoard log, where it is still there).
Draws the trailing mean against the step, one colour per label, one line per seed.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import read_scalars, table  # noqa: E402
from scripts.convergence import best_runs, final_loss, groups, load_results, select  # noqa: E402


def trailing(xs: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


def late_grad_norm(study: Path, run: dict) -> str:
    dump = study / "runs" / run["folder"]
    try:
        norms = [v for _, v in read_scalars(dump)["grad_norm"]]
    except (KeyError, FileNotFoundError, OSError):
        return "-"
    return f"{statistics.fmean(norms[-max(1, len(norms) // 5):]):.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=DIR:NAME")
    p.add_argument("--levels", nargs="*", type=float, default=[1.6, 1.4, 1.2])
    p.add_argument("--window", type=int, default=25, help="steps in the trailing mean")
    p.add_argument("--png")
    p.add_argument("--replicas", type=int, help="the runs at this M")
    p.add_argument("--flavor", help="the runs of this flavor")
    p.add_argument("--steps", type=int, help="the runs of this many training steps")
    a = p.parse_args(argv)
    series = []
    for item in a.runs:
        label, eq, where = item.partition("=")
        folder, colon, name = where.rpartition(":")
        if not eq or not colon:
            p.error(f"{item!r}: allowed is LABEL=DIR:NAME")
        study = Path(folder)
        chosen = select(load_results(study / "convergence.json"), a.replicas and [a.replicas], a.flavor and [a.flavor],
                        a.steps and [a.steps], [name])
        found = groups(chosen)
        if len(found) != 1:
            where = "; ".join(f"M={m} {f} {s} steps" for m, f, s, _ in found)
            p.error(f"{item!r}: {len(found)} groups of {name} runs in {study / 'convergence.json'}"
                    + (f" ({where}): pick one with --replicas/--flavor/--steps" if found else ""))
        runs = best_runs(next(iter(found.values())))[name]
        series.append((label, study, sorted(runs, key=lambda r: r["seed"])))
    rows = []
    for label, study, runs in series:
        for r in runs:
            smooth = trailing(r["loss"], a.window)
            crossings = [next((r["steps"][i] for i, x in enumerate(smooth) if x <= level), None) for level in a.levels]
            rows.append([label, r["seed"], f"{final_loss(r):.4f}", *[str(c) if c else "-" for c in crossings],
                         late_grad_norm(study, r)])
    print(table(["run", "seed", "final loss", *[f"step at {lv:g}" for lv in a.levels], "grad_norm, last 20 %"], rows))
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (label, _, runs) in enumerate(series):
            for j, r in enumerate(runs):
                ax.plot(r["steps"], trailing(r["loss"], a.window), color=f"C{i}", lw=1.0,
                        ls=["-", "--", ":", "-."][j % 4], label=f"{label}, seed {r['seed']}")
        top = min(min(trailing(r["loss"], a.window)[len(r["loss"]) // 10:]) for _, _, runs in series for r in runs)
        ax.set_ylim(top - 0.05, top + 1.0)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (trailing mean of {a.window})")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        plt.close(fig)
        print(f"\nplot: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
