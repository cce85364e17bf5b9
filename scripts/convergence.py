"""Loss vs step and vs R bytes for AdamW-HSDP and every registered optimizer, same model, data,
steps and seeds, on 4 CPU processes (|R| = 2 replicas x |S| = 2 FSDP shards), with a learning-rate
sweep and several seeds: the quality study behind each preset's recommended learning rate.

    # the shipped defaults (each preset's recommended lr) on the study corpus, one seed
    .venv/bin/python scripts/convergence.py --steps 300 --optimizers AdamW FlexDeMo DES-LOC Dion
    # a sweep: each optimizer at 1/3, 1 and 3 x its lr, then a second seed at the best one
    .venv/bin/python scripts/convergence.py --steps 500 --lr-grid 0.333 1 3 --out /tmp/study
    .venv/bin/python scripts/convergence.py --steps 500 --best-of /tmp/study --seeds 43 --out /tmp/study
    .venv/bin/python scripts/convergence.py --steps 4 --flavor cpu_tiny --optimizers AdamW DeMo   # smoke

Each run is ``titan_commopt.train`` with ``train_configs/debug_cpu.toml``, ``--training.dataset``
(default ``commopt_world``: the bundled corpus whose loss still falls after 500 steps; the
quickstart's ``commopt_tiny`` flattens early), ``--optimizer.name`` and ``--optimizer.lr`` changed
and nothing else; family options via ``--set``. An optimizer's lr is ``--lr`` (default 0.027, AdamW-HSDP's
best in the study), or its ``--base-lr NAME=LR``, times each ``--lr-grid`` factor; the
preset's ``lr_scale`` then applies inside the run as in any training (the table shows the
``--optimizer.lr`` passed). Results accumulate in ``<out>/convergence.json`` (a run already there
is not repeated), so a sweep can grow over several invocations.

Reads ``loss_metrics/global_avg_loss`` and ``comm/R_sent_bytes_total`` from each run's TensorBoard
log; the final loss is the mean of the last 10% of logged steps (to damp batch noise); with several
seeds a cell shows mean ± half the range. Writes ``loss_vs_step.png`` and ``loss_vs_r_bytes.png``
(each optimizer at its best lr, first seed) and prints the tables.
"""

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import cli_overrides, human, parse_overrides, read_scalars, run_train, table  # noqa: E402



# AdamW-HSDP's best [optimizer] lr in the quality study (docs/benchmarks.md §4: cpu_tiny, commopt_world,
# 2 x 2, 500 steps). Each preset's lr_scale is relative to it, so running every optimizer at this lr
# runs each at its recommended one.
STUDY_ADAMW_LR = 0.027


def run_key(name: str, lr: float, seed: int) -> str:
    return f"{name}|{lr:.6g}|{seed}"


def run_one(name, lr, seed, steps, flavor, dataset, out: Path, overrides, log_freq=1) -> dict | None:
    dump = out / "runs" / f"{name}_lr{lr:.6g}_seed{seed}"
    # A run not yet in convergence.json never finished (killed, machine restart): its partial
    # TensorBoard log would be read together with this run's, every early step twice.
    shutil.rmtree(dump / "tb", ignore_errors=True)
    t0 = time.time()
    try:
        run_train(
            dump, 4, "--model.flavor", flavor, "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
            "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
            "--training.dataset", dataset, "--optimizer.name", name, "--optimizer.lr", f"{lr:.6g}",
            "--lr_scheduler.warmup_steps", str(max(1, steps // 20)), "--debug.seed", str(seed),
            *cli_overrides(name, overrides),
        )
    except RuntimeError as error:
        print(f"# {name} lr {lr:g} seed {seed} failed: {str(error)[-1500:]}", file=sys.stderr)
        return None
    s = read_scalars(dump)
    loss = s["loss_metrics/global_avg_loss"]
    r_total = dict(s.get("comm/R_sent_bytes_total", []))
    result = {
        "name": name, "lr": lr, "seed": seed, "steps": [k for k, _ in loss], "loss": [v for _, v in loss],
        "r_bytes": [r_total.get(k, float("nan")) for k, _ in loss], "seconds": time.time() - t0,
    }
    print(f"{name} lr {lr:g} seed {seed}: final loss {final_loss(result):.4f} in {result['seconds']:.0f} s",
          file=sys.stderr, flush=True)
    return result


def final_window(run: dict) -> int:
    """Steps in a run's final loss: the last 10 %."""
    return max(1, len(run["loss"]) // 10)


def final_loss(run: dict) -> float:
    tail = final_window(run)
    return sum(run["loss"][-tail:]) / tail


def step_reaching(run: dict, target: float, window: int) -> int | None:
    """The first step at which the mean of the last ``window`` logged losses is at most ``target``."""
    losses = run["loss"]
    total = sum(losses[:window - 1])
    for i in range(window - 1, len(losses)):
        total += losses[i]
        if total / window <= target:
            return run["steps"][i]
        total -= losses[i - window + 1]
    return None


def adamw_targets(results: dict) -> dict | None:
    """AdamW-HSDP at its best lr: ``loss`` {seed: final loss}, ``window`` (its final-loss window) and
    ``steps`` {seed: the step its trailing mean first reaches its own final loss}; None without AdamW."""
    adamw = best_runs(results).get("AdamW")
    if not adamw:
        return None
    window = final_window(adamw[0])
    return {"loss": {r["seed"]: final_loss(r) for r in adamw}, "window": window,
            "steps": {r["seed"]: step_reaching(r, final_loss(r), window) for r in adamw}}


def cells(results: dict) -> dict:
    """{(name, lr): [final loss per seed]}, in the order first run."""
    out: dict = {}
    for r in results.values():
        out.setdefault((r["name"], r["lr"]), []).append(final_loss(r))
    return out


def best_lrs(results: dict) -> dict:
    """{name: the lr with the lowest mean final loss}."""
    best: dict = {}
    for (name, lr), losses in cells(results).items():
        mean = statistics.fmean(losses)
        if name not in best or mean < best[name][1]:
            best[name] = (lr, mean)
    return {name: lr for name, (lr, _) in best.items()}


def best_runs(results: dict) -> dict:
    """{name: [its runs (one per seed) at its best lr]}."""
    best = best_lrs(results)
    out: dict = {name: [] for name in best}  # in the order of first run, as the tables
    for r in results.values():
        if best[r["name"]] == r["lr"]:
            out[r["name"]].append(r)
    return out


def _mean_spread(losses: list[float]) -> str:
    mean = statistics.fmean(losses)
    return f"{mean:.4f}" if len(losses) == 1 else f"{mean:.4f} ± {(max(losses) - min(losses)) / 2:.4f} (n={len(losses)})"


def sweep_table(results: dict) -> str:
    best = best_lrs(results)
    rows = [[name, f"{lr:g}" + (" *" if best.get(name) == lr else ""), _mean_spread(losses)]
            for (name, lr), losses in sorted(cells(results).items())]
    return table(["optimizer", "--optimizer.lr (* best)", "final loss (mean last 10%)"], rows)


def final_table(results: dict, targets: dict | None = None) -> str:
    """Each optimizer at its best lr, against AdamW-HSDP at its best; with ``targets`` (AdamW-HSDP's
    final loss per seed and its window, ``--targets-from``: e.g. a 500-step study's, for longer runs)
    also the step at which each seed's trailing mean first reaches its seed's target (its own final
    loss for AdamW-HSDP), and the mean of those steps ÷ AdamW-HSDP's."""
    at_best = best_runs(results)
    targets = targets or adamw_targets(results)
    adamw = at_best.get("AdamW")
    base = statistics.fmean(final_loss(r) for r in adamw) if adamw else None
    base_bytes = adamw[0]["r_bytes"][-1] if adamw else None  # the same at every lr and seed
    rows = []
    for name, runs in at_best.items():
        losses = [final_loss(r) for r in runs]
        gap = f"{100 * (statistics.fmean(losses) - base) / base:+.1f}%" if base else "-"
        sent = runs[0]["r_bytes"][-1]
        fewer = f"{base_bytes / sent:.0f}x" if base_bytes and sent > 0 and name != "AdamW" else "-"
        wall = statistics.fmean(r["seconds"] for r in runs)
        row = [name, f"{runs[0]['lr']:g}", _mean_spread(losses), gap, human(sent), fewer, f"{wall:.0f}"]
        if targets:
            row += _reaching(runs, targets)
        rows.append(row)
    heads = ["optimizer", "best --optimizer.lr", "final loss", "vs AdamW-HSDP best", "R sent total (rank 0)",
             "fewer R bytes", "wall s"]
    if targets:
        heads += ["reaches AdamW-HSDP's loss at step (per seed)", "steps ÷ AdamW-HSDP's"]
    return table(heads, rows)


def _reaching(runs: list[dict], targets: dict) -> list[str]:
    """[the step each seed first reaches its seed's AdamW-HSDP loss ("-": never), the mean over seeds of
    that step ÷ AdamW-HSDP's own step of the same seed ("-" where a seed never reaches it)]."""
    mean_loss = statistics.fmean(targets["loss"].values())
    mean_step = statistics.fmean(targets["steps"].values())
    steps, ratios = [], []
    for r in runs:
        reached = step_reaching(r, targets["loss"].get(r["seed"], mean_loss), targets["window"])
        steps.append(f"{r['seed']}: {reached if reached is not None else '-'}")
        if reached is not None:
            ratios.append(reached / targets["steps"].get(r["seed"], mean_step))
    return [", ".join(steps), "-" if len(ratios) < len(runs) else f"{statistics.fmean(ratios):.3f}"]


def plot(results: dict, out: Path, title: str) -> list[Path]:
    import matplotlib

    shown = {name: runs[0] for name, runs in best_runs(results).items()}  # first seed at the best lr

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, fname, logx in (("steps", "step", "loss_vs_step.png", False),
                                     ("r_bytes", "R bytes sent per rank (cumulative; 0 drawn at 1)",
                                      "loss_vs_r_bytes.png", True)):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in shown.items():
            xs = [max(x, 1.0) for x in r[key]] if logx else r[key]
            ax.plot(xs, r["loss"], label=f"{name} (lr {r['lr']:g})", lw=1.2, ls="--" if name == "AdamW" else "-")
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
    p.add_argument("--flavor", default="cpu_tiny", help="model flavor (the study: cpu_tiny)")
    p.add_argument("--dataset", default="commopt_world", help="[training] dataset (a bundled corpus)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--lr", type=float, default=STUDY_ADAMW_LR,
                   help="[optimizer] lr of every optimizer (default: AdamW-HSDP's best in the study; the presets scale it)")
    p.add_argument("--base-lr", nargs="*", default=[], metavar="NAME=LR", help="another lr for one optimizer")
    p.add_argument("--lr-grid", nargs="*", type=float, default=[1.0], help="factors of each optimizer's lr to run")
    p.add_argument("--best-of", help="a study's out folder: run each optimizer at its best lr there (no grid)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--seeds", nargs="*", type=int, default=[42], help="[debug] seed of each run (model init)")
    p.add_argument("--out", default="outputs/convergence")
    p.add_argument("--report", action="store_true", help="run nothing: tables and plots of <out>/convergence.json")
    p.add_argument("--targets-from", help="another study's out folder whose AdamW-HSDP final losses (per seed) are "
                   "the targets of the 'reaches AdamW-HSDP's loss' column (default: this study's)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    base = {name: a.lr for name in names}
    for item in a.base_lr:
        name, _, value = item.partition("=")
        if name not in base:
            p.error(f"--base-lr {item}: {name!r} is not among the optimizers run ({', '.join(names)})")
        base[name] = float(value)
    store = out / "convergence.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    if a.report:
        lrs: dict = {}
        if a.optimizers:
            results = {k: r for k, r in results.items() if r["name"] in a.optimizers}
    elif a.best_of:
        found = best_lrs(json.loads((Path(a.best_of) / "convergence.json").read_text()))
        lrs = {name: [found[name]] for name in names if name in found}
    else:  # 6 significant digits: the lr passed on the command line, and the run's key
        lrs = {name: [float(f"{base[name] * f:.6g}") for f in a.lr_grid] for name in names}
    overrides = parse_overrides(a.set)
    for name, grid in lrs.items():
        for lr in grid:
            for seed in a.seeds:
                key = run_key(name, lr, seed)
                if key in results:
                    continue
                run = run_one(name, lr, seed, a.steps, a.flavor, a.dataset, out, overrides)
                if run is not None:
                    results[key] = run
                    store.write_text(json.dumps(results))  # after every run: a long sweep can be resumed
    if not results:
        print("no run finished", file=sys.stderr)
        return 1
    paths = plot(results, out, f"{a.flavor}, {a.dataset}, 2 replicas x 2 shards, {a.steps} steps")
    print(sweep_table(results))
    print()
    targets = adamw_targets(json.loads((Path(a.targets_from) / "convergence.json").read_text())) if a.targets_from else None
    print(final_table(results, targets))
    print("\nplots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
