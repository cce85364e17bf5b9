"""The quality yardstick: every optimizer against AdamW-HSDP on the same model, tokens and seeds, scored
by the **global model's loss on held-out text** (torchtitan's ``[validation]`` on the held-out twin of
the training corpus), at M replicas × S FSDP shards on CPU processes, with a learning-rate sweep.

The study of issue 39 (cpu_micro and cpu_tiny at 20 tokens per parameter, M = 2 and 8, two seeds; one
``--out`` accumulates everything; run it under ``nice -n 19``, one study at a time on a 2-core box):

    C="nice -n 19 .venv/bin/python scripts/convergence.py --out /tmp/study39 --tokens-per-param 20"
    # 1. the lr sweep at M = 2 (each optimizer at 1/3, 1, 3 x its lr), seed 42, both flavors
    $C --replicas 2 --flavor cpu_micro cpu_tiny --optimizers AdamW DeMo DiLoCo SparseLoCo --lr-grid 0.333 1 3
    # 2. the second seed at each one's best lr, then M = 8 at M = 2's best lrs, both seeds
    $C --replicas 2 --flavor cpu_micro cpu_tiny --optimizers AdamW DeMo DiLoCo SparseLoCo --best-of /tmp/study39 --seeds 43
    $C --replicas 8 --flavor cpu_micro cpu_tiny --optimizers AdamW DeMo DiLoCo SparseLoCo \\
        --best-of /tmp/study39 --best-of-replicas 2 --seeds 42 43
    # the other families where time allows: the same lines with --optimizers FlexDeMo DES-LOC MT-DAO LocalAdam Dion
    # 3. tables and plots from the JSON alone (a filter narrows them)
    .venv/bin/python scripts/convergence.py --report --out /tmp/study39
    .venv/bin/python scripts/convergence.py --report --out /tmp/study39 --replicas 8 --flavor cpu_tiny

    .venv/bin/python scripts/convergence.py --steps 4 --flavor cpu_micro --optimizers AdamW DeMo --eval-steps 2   # smoke

**A run** is ``titan_commopt.train`` with ``train_configs/debug_cpu.toml`` on ``M·S`` processes
(``--replicas M --shards S``; S defaults to 4 ÷ M, at least 1: 2 × 2 at M = 2, 8 × 1 at M = 8), changing
only: the flavor, the steps, ``--training.dataset`` (default ``commopt_world``), the mesh, the local
batch, ``--optimizer.name`` / ``lr``, the warm-up (5 % of the steps), the seed, the validation flags
and family options (``--set``). **The global batch is fixed** (``--global-batch``, default 16
sequences × 128 tokens = 2048 tokens per step): each process reads ``global ÷ (M·S)`` sequences, so
every M trains on as many tokens per step and AdamW-HSDP at M = 2 and M = 8 is one algorithm (on other
documents per step: torchtitan splits the corpus by data-parallel rank; at 200 steps of cpu_tiny its
held-out losses were 1.4444 at 2 × 2 and 1.4477 at 8 × 1).
``--tokens-per-param T`` sets the steps to T × parameters ÷ tokens per step (the flavor's parameters
on the installed torchtitan line), rounded to a multiple of the evaluation period.

**Evaluation**: every ``--eval-every F`` steps (default: the steps ÷ 40, a divisor of the steps: torchtitan
evaluates at step 1 and where ``step % F == 0``, and the final held-out loss must be the last
step's), ``--eval-steps`` batches of the training's local batch on every rank (default: ~64k held-out
tokens per evaluation, 32 steps at 2048 tokens). For a local-step family the evaluated model is the
synchronized one where ``[validation]`` evaluates it (issue 39, item 1).

**Per run** ``<out>/convergence.json`` keeps the held-out curve (``validation_metrics/loss``), the
training curve (``loss_metrics/global_avg_loss``), rank 0's cumulative R bytes
(``comm/R_sent_bytes_total``) at both, the wall seconds (and, from the console lines, the training and
the evaluation seconds apart), and the coordinates: name, lr, seed, M, S, flavor, steps, tokens per
step. A run whose coordinates are already there is not repeated, so a study grows over invocations;
each run is added under a file lock (two studies may share one ``--out``). **Variants**: ``--set``
is not a coordinate, so a variant gets ``--label`` (``--label eager --set local.merge=eager
local.sync_delay=0``: stored, tabled and plotted as ``DiLoCo eager``, its own best lr, ``--best-of`` with the same label takes it);
``--report --include DIR ...`` shows other folders' runs beside ``--out``'s (the baselines).

**The numbers**, per (M, flavor, steps) and optimizer at its best lr (lowest mean final held-out loss):
the final held-out loss; AdamW-HSDP's of the same seed as the target; the **iso-loss step**, the first
step at which the held-out curve reaches that target (linear between evaluations; "–" if never), and
its ratio to AdamW-HSDP's own (where AdamW-HSDP's curve first reaches its own final loss: at most its
last step); the training loss (mean of the last 10 % of steps); R bytes and how many times fewer than
AdamW-HSDP's. With several seeds: mean ± half the range, and each seed. Then the cross table **gap vs
N** (final held-out gap to AdamW-HSDP per family, by M and flavor) and the plots: held-out loss vs step
and vs cumulative R bytes per (M, flavor, steps), gap vs N (``gap_vs_n.png``).

``--targets-from DIR`` adds another study's AdamW-HSDP runs to the targets (``--target-steps N``: the
targets of runs N steps long, e.g. the step at which a 2000-step run reaches a 500-step run's loss).
"""

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import (  # noqa: E402
    Timeline, cli_overrides, eval_steps_for, human, parameter_count, parse_overrides, read_scalars, run_train, table,
    validation_flags,
)

# AdamW-HSDP's best [optimizer] lr in the quality study (docs/benchmarks.md §4: cpu_tiny, commopt_world,
# 2 x 2, 500 steps). Each preset's lr_scale is relative to it, so running every optimizer at this lr
# runs each at its recommended one.
STUDY_ADAMW_LR = 0.027
SEQ_LEN = 128
GLOBAL_BATCH = 16
EVALUATIONS_PER_RUN = 40


class UsageError(ValueError):
    """A command line that cannot be run: one line for the user."""


@dataclass(frozen=True)
class Setting:
    """Where a run trains: the mesh, the model, the length, the tokens, and how it is evaluated."""

    replicas: int
    shards: int
    flavor: str
    training_steps: int
    global_batch: int
    dataset: str
    eval_every: int
    eval_steps: int
    seq_len: int = SEQ_LEN

    @property
    def processes(self) -> int:
        return self.replicas * self.shards

    @property
    def local_batch(self) -> int:
        return local_batch(self.global_batch, self.replicas, self.shards)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def group(self) -> tuple:
        return (self.replicas, self.flavor, self.training_steps, self.tokens_per_step)


def local_batch(global_batch: int, replicas: int, shards: int) -> int:
    processes = replicas * shards
    if global_batch % processes:
        raise UsageError(f"--global-batch {global_batch} is not a multiple of M·S = {replicas} × {shards} = {processes} "
                         f"processes: allowed is a global batch every process reads an equal part of")
    return global_batch // processes


def default_shards(replicas: int) -> int:
    """At least 4 processes where M < 4 (2 × 2 at M = 2), else M × 1."""
    return max(1, 4 // replicas)


def nearest_divisor(n: int, wanted: float) -> int:
    """The divisor of ``n`` nearest ``wanted`` by ratio (the evaluation period of a fixed length)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(math.log(d / max(wanted, 1e-9))))


def plan(replicas: int, shards: int | None, flavor: str, *, steps: int | None, tokens_per_param: float | None,
         global_batch: int, dataset: str, eval_every: int | None, eval_steps: int | None) -> tuple[Setting, str]:
    """The setting of one (M, flavor) point of a study and a line saying how its steps and evaluation
    period were found. Bad input: :class:`UsageError`."""
    from titan_commopt.corpora import HELD_OUT

    if dataset not in HELD_OUT:
        raise UsageError(f"--dataset {dataset!r}: the study scores held-out text; allowed is a corpus with a held-out "
                         f"twin ({', '.join(HELD_OUT)})")
    for flag, value in (("--replicas", replicas), ("--shards", shards), ("--global-batch", global_batch),
                        ("--eval-every", eval_every), ("--eval-steps", eval_steps), ("--steps", steps)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: allowed is an integer >= 1")
    shards = shards or default_shards(replicas)
    local_batch(global_batch, replicas, shards)
    tokens_per_step = global_batch * SEQ_LEN
    if tokens_per_param is not None:
        if not tokens_per_param > 0:
            raise UsageError(f"--tokens-per-param {tokens_per_param}: allowed is a number > 0")
        parameters = parameter_count(flavor)
        exact = tokens_per_param * parameters / tokens_per_step
        every = eval_every or max(1, round(exact / EVALUATIONS_PER_RUN))
        steps = every * max(1, round(exact / every))
        how = (f"{flavor}: {tokens_per_param:g} tokens/parameter × {parameters:,} parameters ÷ {tokens_per_step:,} "
               f"tokens/step = {exact:.1f} steps → {steps} (a multiple of the evaluation period {every}, so the last "
               f"step is evaluated)")
    else:
        if eval_every is not None and steps % eval_every:
            raise UsageError(f"--eval-every {eval_every} does not divide --steps {steps}: torchtitan evaluates where "
                             f"step % {eval_every} == 0 and the final held-out loss is the last step's; allowed is a "
                             f"divisor, e.g. {nearest_divisor(steps, eval_every)}")
        every = eval_every or nearest_divisor(steps, steps / EVALUATIONS_PER_RUN)
        how = f"{flavor}: {steps} steps, evaluated at step 1 and every {every} steps"
    setting = Setting(replicas, shards, flavor, steps, global_batch, dataset, every,
                      eval_steps or eval_steps_for(tokens_per_step))
    return setting, how + f" ({setting.eval_steps} batches of {setting.local_batch} × {SEQ_LEN} per process)"


# ---- the results file --------------------------------------------------------------------------------
def run_key(name: str, lr: float, seed: int, setting: Setting) -> str:
    return (f"{name}|{lr:.6g}|{seed}|M{setting.replicas}xS{setting.shards}|{setting.flavor}|"
            f"{setting.training_steps}steps|{setting.tokens_per_step}tok")


def run_folder(name: str, lr: float, seed: int, setting: Setting) -> str:
    return (f"{name}_lr{lr:.6g}_seed{seed}_M{setting.replicas}xS{setting.shards}_{setting.flavor}_"
            f"{setting.training_steps}steps_{setting.tokens_per_step}tok")


def group_of(run: dict) -> tuple:
    return (run["replicas"], run["flavor"], run["training_steps"], run["tokens_per_step"])


def record_run(store: Path, key: str, run: dict) -> dict:
    """Add one run to ``store`` and return everything it holds: read, add and write under an exclusive
    lock, so that two studies writing one results file (or a study beside a ``--report``) keep each
    other's runs instead of the last writer's copy winning."""
    import fcntl

    with open(store.with_name(store.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = {**load_results(store), key: run}
        tmp = store.with_name(store.name + ".tmp")
        tmp.write_text(json.dumps(results))
        tmp.replace(store)  # a reader never sees half a file
    return results


def load_results(store: Path) -> dict:
    """``convergence.json``; runs written before runs had coordinates (2 × 2 on cpu_tiny, 4 × 128 tokens
    per process: 2048 per step, training loss only) get those and a key that says so."""
    if not store.exists():
        return {}
    out = {}
    for key, run in json.loads(store.read_text()).items():
        if "replicas" not in run:
            run = {**run, "replicas": 2, "shards": 2, "flavor": "cpu_tiny", "training_steps": run["steps"][-1],
                   "tokens_per_step": 2048, "heldout": None,
                   "folder": f"{run['name']}_lr{run['lr']:.6g}_seed{run['seed']}"}
            key = f"{key}|M2xS2|cpu_tiny|{run['training_steps']}steps|2048tok"
        out[key] = run
    return out


def labelled(name: str, label: str | None) -> str:
    """The name a run is stored, keyed, tabled and plotted under: the optimizer's, with ``--label``
    appended (``DiLoCo eager``), so that variants of one optimizer (``--set``) share a results file."""
    return f"{name} {label}" if label else name


def run_one(name: str, lr: float, seed: int, setting: Setting, out: Path, overrides: dict,
            label: str | None = None) -> dict | None:
    shown = labelled(name, label)
    folder = run_folder(shown.replace(" ", "-"), lr, seed, setting)
    dump = out / "runs" / folder
    # A run not yet in convergence.json never finished (killed, machine restart): its partial
    # TensorBoard log would be read together with this run's, every early step twice.
    shutil.rmtree(dump / "tb", ignore_errors=True)
    t0 = time.time()
    steps = setting.training_steps
    try:
        proc = run_train(
            dump, setting.processes, "--model.flavor", setting.flavor, "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--parallelism.data_parallel_replicate_degree", str(setting.replicas),
            "--parallelism.data_parallel_shard_degree", str(setting.shards),
            "--training.local_batch_size", str(setting.local_batch), "--training.seq_len", str(setting.seq_len),
            "--training.dataset", setting.dataset, "--optimizer.name", name, "--optimizer.lr", f"{lr:.6g}",
            "--lr_scheduler.warmup_steps", str(max(1, steps // 20)), "--debug.seed", str(seed),
            *validation_flags(setting.dataset, setting.eval_every, setting.eval_steps, setting.local_batch,
                              setting.seq_len),
            *cli_overrides(name, overrides),
        )
    except RuntimeError as error:
        print(f"# {name} lr {lr:g} seed {seed} {describe(setting)} failed: {str(error)[-1500:]}", file=sys.stderr)
        return None
    seconds = time.time() - t0
    s = read_scalars(dump)
    loss = s["loss_metrics/global_avg_loss"]
    r_total = dict(s.get("comm/R_sent_bytes_total", []))
    heldout = s.get("validation_metrics/loss", [])
    console = Timeline.of(getattr(proc, "stdout", "") or "")
    timed = bool(console.steps) and max(console.steps) == steps
    result = {
        "name": shown, "optimizer": name, "lr": lr, "seed": seed, "replicas": setting.replicas,
        "shards": setting.shards, "flavor": setting.flavor, "training_steps": steps,
        "tokens_per_step": setting.tokens_per_step,
        "global_batch": setting.global_batch, "dataset": setting.dataset, "set": overrides,
        "eval_every": setting.eval_every, "eval_steps": setting.eval_steps, "folder": folder,
        "steps": [k for k, _ in loss], "loss": [v for _, v in loss],
        "r_bytes": [r_total.get(k, float("nan")) for k, _ in loss],
        "heldout": {"steps": [k for k, _ in heldout], "loss": [v for _, v in heldout],
                    "r_bytes": [r_total.get(k, float("nan")) for k, _ in heldout]},
        "seconds": seconds,
        # from the console lines: training (step 1 and the evaluations left out) and evaluation apart
        "train_seconds": console.training_seconds(steps) if timed else None,
        "eval_seconds": console.eval_seconds() if timed else None,
    }
    final = final_heldout(result)
    print(f"{shown} lr {lr:g} seed {seed} {describe(setting)}: held-out {final if final is None else f'{final:.4f}'}, "
          f"training loss {final_loss(result):.4f} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return result


def describe(setting: Setting) -> str:
    return f"M={setting.replicas}x{setting.shards} {setting.flavor} {setting.training_steps} steps"


# ---- the numbers ---------------------------------------------------------------------------------------
def final_window(run: dict) -> int:
    """Steps in a run's final training loss: the last 10 %."""
    return max(1, len(run["loss"]) // 10)


def final_loss(run: dict) -> float:
    """The training loss: the mean of the last 10 % of logged steps (damps batch noise)."""
    tail = final_window(run)
    return sum(run["loss"][-tail:]) / tail


def final_heldout(run: dict) -> float | None:
    """The held-out loss of the last step (None: the last step was not evaluated, or no curve)."""
    curve = run.get("heldout")
    if not curve or not curve["steps"] or curve["steps"][-1] != run["training_steps"]:
        return None
    return curve["loss"][-1]


def score(run: dict) -> float:
    """What a learning rate is chosen by: the final held-out loss (the training loss for runs without one)."""
    heldout = final_heldout(run)
    return final_loss(run) if heldout is None else heldout


def iso_loss_step(steps: list[int], losses: list[float], target: float) -> float | None:
    """The first step at which the curve reaches ``target``: linear between the two evaluations around
    the crossing (the first evaluation itself where it already is at or below), None if never."""
    for i, (step, loss) in enumerate(zip(steps, losses)):
        if loss <= target:
            if i == 0:
                return float(step)
            before, above = steps[i - 1], losses[i - 1]
            return before + (above - target) / (above - loss) * (step - before)
    return None


def own_iso_step(run: dict) -> float | None:
    """Where a run's held-out curve first reaches its own final loss (AdamW-HSDP's denominator)."""
    final = final_heldout(run)
    return None if final is None else iso_loss_step(run["heldout"]["steps"], run["heldout"]["loss"], final)


def groups(results: dict) -> dict[tuple, list[dict]]:
    """{(M, flavor, steps, tokens per step): runs}, ordered by M, the flavor's size, the steps."""
    out: dict = {}
    for run in results.values():
        out.setdefault(group_of(run), []).append(run)
    sizes = {flavor: parameter_count(flavor) for flavor in {g[1] for g in out}}
    return {g: out[g] for g in sorted(out, key=lambda g: (g[0], sizes[g[1]], g[2], g[3]))}


def cells(runs: list[dict]) -> dict:
    """{(name, lr): [runs, one per seed]}, in the order first run."""
    out: dict = {}
    for r in runs:
        out.setdefault((r["name"], r["lr"]), []).append(r)
    return out


def best_lrs(runs: list[dict]) -> dict:
    """{name: the lr with the lowest mean score} among the runs of one group."""
    best: dict = {}
    for (name, lr), rs in cells(runs).items():
        mean = statistics.fmean(score(r) for r in rs)
        if name not in best or mean < best[name][1]:
            best[name] = (lr, mean)
    return {name: lr for name, (lr, _) in best.items()}


def best_runs(runs: list[dict]) -> dict:
    """{name: [its runs (one per seed, by seed) at its best lr]} among the runs of one group."""
    best = best_lrs(runs)
    out: dict = {name: [] for name in best}
    for r in runs:
        if best[r["name"]] == r["lr"]:
            out[r["name"]].append(r)
    return {name: sorted(rs, key=lambda r: r["seed"]) for name, rs in out.items()}


def adamw_by_seed(pool: dict, group: tuple) -> dict[int, dict]:
    """AdamW-HSDP's runs of ``group`` at its best lr there, by seed."""
    runs = [r for r in pool.values() if group_of(r) == group]
    return {r["seed"]: r for r in best_runs(runs).get("AdamW", [])}


@dataclass
class Compared:
    """One optimizer at its best lr in one group, against AdamW-HSDP seed by seed."""

    name: str
    lr: float
    runs: list[dict]
    heldout: dict  # seed -> final held-out loss (None: not evaluated at the last step)
    target: dict  # seed -> AdamW-HSDP's final held-out loss (None: no AdamW-HSDP run of that seed)
    iso: dict  # seed -> iso-loss step (None: not reached, or no target)
    adamw_iso: dict  # seed -> AdamW-HSDP's own iso-loss step
    training: dict  # seed -> training loss, last 10 %
    r_bytes: float
    adamw_r_bytes: float | None

    @property
    def seeds(self) -> list[int]:
        return [r["seed"] for r in self.runs]

    def gaps(self) -> dict:
        """seed -> final held-out loss ÷ AdamW-HSDP's − 1, where both exist."""
        return {s: self.heldout[s] / self.target[s] - 1 for s in self.seeds
                if self.heldout[s] is not None and self.target[s]}

    def gap(self) -> float | None:
        """Mean final held-out loss ÷ AdamW-HSDP's mean over the same seeds − 1 (every seed needed)."""
        gaps = self.gaps()
        if len(gaps) < len(self.runs):
            return None
        return statistics.fmean(self.heldout[s] for s in gaps) / statistics.fmean(self.target[s] for s in gaps) - 1

    def ratios(self) -> dict:
        """seed -> iso-loss step ÷ AdamW-HSDP's own, where reached."""
        return {s: self.iso[s] / self.adamw_iso[s] for s in self.seeds if self.iso[s] is not None and self.adamw_iso[s]}

    def ratio(self) -> float | None:
        """The mean over seeds of the iso-loss steps ratio; None unless every seed reached the target."""
        ratios = self.ratios()
        return statistics.fmean(ratios.values()) if ratios and len(ratios) == len(self.runs) else None


def compare(runs: list[dict], pool: dict, target_steps: int | None = None) -> list[Compared]:
    """Each optimizer of one group's ``runs`` at its best lr, against AdamW-HSDP of the same M, flavor,
    tokens per step and seed in ``pool`` (this study's runs and ``--targets-from``'s), of the same
    steps or ``target_steps``."""
    if not runs:
        return []
    replicas, flavor, steps, tokens = group_of(runs[0])
    adamw = adamw_by_seed(pool, (replicas, flavor, target_steps or steps, tokens))
    adamw_bytes = next((r["r_bytes"][-1] for r in adamw.values()), None)
    out = []
    for name, rs in best_runs(runs).items():
        target = {r["seed"]: final_heldout(adamw[r["seed"]]) if r["seed"] in adamw else None for r in rs}
        iso = {r["seed"]: (iso_loss_step(r["heldout"]["steps"], r["heldout"]["loss"], target[r["seed"]])
                           if target[r["seed"]] is not None and r.get("heldout") else None) for r in rs}
        out.append(Compared(
            name=name, lr=rs[0]["lr"], runs=rs, heldout={r["seed"]: final_heldout(r) for r in rs}, target=target,
            iso=iso, adamw_iso={r["seed"]: own_iso_step(adamw[r["seed"]]) if r["seed"] in adamw else None for r in rs},
            training={r["seed"]: final_loss(r) for r in rs}, r_bytes=rs[0]["r_bytes"][-1], adamw_r_bytes=adamw_bytes,
        ))
    return out


# ---- tables ----------------------------------------------------------------------------------------------
def _spread(values: list[float], digits: int = 4) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def _per_seed(values: dict, fmt) -> str:
    return ", ".join(f"{seed}: {'–' if v is None else fmt(v)}" for seed, v in values.items())


def group_title(group: tuple, runs: list[dict]) -> str:
    replicas, flavor, steps, tokens = group
    parameters = parameter_count(flavor)
    shards = sorted({r["shards"] for r in runs})
    return (f"M = {replicas} replicas × S = {'/'.join(map(str, shards))}, {flavor} ({parameters:,} parameters), "
            f"{steps} steps × {tokens:,} tokens = {steps * tokens / parameters:.1f} tokens/parameter")


def sweep_table(runs: list[dict]) -> str:
    best = best_lrs(runs)
    rows = []
    for (name, lr), rs in sorted(cells(runs).items()):
        heldout = [h for h in map(final_heldout, rs) if h is not None]
        rows.append([name, f"{lr:g}" + (" *" if best.get(name) == lr else ""), len(rs),
                     _spread(heldout) if heldout else "–", _spread([final_loss(r) for r in rs])])
    return table(["optimizer", "--optimizer.lr (* best)", "seeds", "final held-out loss", "training loss (last 10 %)"],
                 rows)


def final_table(compared: list[Compared]) -> str:
    rows = []
    for c in compared:
        heldout = [h for h in c.heldout.values() if h is not None]
        gap, ratio, gaps = c.gap(), c.ratio(), c.gaps()
        fewer = (f"{c.adamw_r_bytes / c.r_bytes:.1f}×" if c.name != "AdamW" and c.adamw_r_bytes and c.r_bytes > 0
                 else "–")
        wall = statistics.fmean(r["seconds"] for r in c.runs)
        timed = [r for r in c.runs if r.get("train_seconds") and r["training_steps"] > 1]
        pace = (f"{statistics.fmean(r['train_seconds'] / (r['training_steps'] - 1) for r in timed):.3f} · "
                f"{100 * statistics.fmean(r['eval_seconds'] / r['seconds'] for r in timed):.0f} %" if timed else "–")
        rows.append([
            c.name, f"{c.lr:g}", _per_seed(c.heldout, lambda v: f"{v:.4f}"), _spread(heldout) if heldout else "–",
            ("–" if gap is None else f"{100 * gap:+.1f} %")
            + (f" ({_per_seed(gaps, lambda v: f'{100 * v:+.1f}')})" if gaps and (len(c.runs) > 1 or gap is None) else ""),
            _per_seed(c.iso, lambda v: f"{v:.0f}"), _per_seed(c.adamw_iso, lambda v: f"{v:.0f}"),
            "–" if ratio is None else f"{ratio:.3f}" + (
                f" ({_per_seed(c.ratios(), lambda v: f'{v:.3f}')})" if len(c.runs) > 1 else ""),
            _spread(list(c.training.values())), human(c.r_bytes), fewer, f"{wall:.0f}", pace,
        ])
    return table(["optimizer", "best lr", "final held-out loss (per seed)", "mean ± half-range",
                  "vs AdamW-HSDP (per seed)", "iso-loss step (per seed)", "AdamW-HSDP's own", "÷ AdamW-HSDP's",
                  "training loss (last 10 %)", "R sent (rank 0)", "fewer R bytes than AdamW-HSDP", "wall s",
                  "training s/step · evaluation share of wall"], rows)


def gap_vs_n(results: dict, pool: dict, target_steps: int | None = None) -> tuple[list[tuple], dict]:
    """The cross table's data: the groups in order and {(name, group): (mean gap, half-range of the
    per-seed gaps, seeds)} where every seed has a gap."""
    order, gaps = [], {}
    for group, runs in groups(results).items():
        order.append(group)
        for c in compare(runs, pool, target_steps):
            gap = c.gap()
            if gap is not None:
                per_seed = list(c.gaps().values())
                gaps[(c.name, group)] = (gap, (max(per_seed) - min(per_seed)) / 2, len(per_seed))
    return order, gaps


def gap_table(order: list[tuple], gaps: dict) -> str:
    names = list(dict.fromkeys(name for name, _ in gaps))
    heads = [f"M={m}, {flavor} ({parameter_count(flavor) / 1e3:.0f}k), {steps * tokens / parameter_count(flavor):.3g} tok/param"
             for m, flavor, steps, tokens in order]
    rows = []
    for name in names:
        row = [name]
        for group in order:
            cell = gaps.get((name, group))
            row.append("–" if cell is None else f"{100 * cell[0]:+.1f} %" + (f" ± {100 * cell[1]:.1f}" if cell[2] > 1 else ""))
        rows.append(row)
    return table(["final held-out gap to AdamW-HSDP", *heads], rows)


# ---- plots -----------------------------------------------------------------------------------------------
def _mean_curve(runs: list[dict], key: str) -> tuple[list, list, list, list] | None:
    """x (from the first seed), the mean, min and max held-out loss over seeds at the same evaluations."""
    curves = [r["heldout"] for r in runs if r.get("heldout") and r["heldout"]["steps"]]
    if not curves:
        return None
    steps = curves[0]["steps"]
    curves = [c for c in curves if c["steps"] == steps]
    losses = list(zip(*(c["loss"] for c in curves)))
    return (curves[0][key], [statistics.fmean(v) for v in losses], [min(v) for v in losses], [max(v) for v in losses])


def plot_group(group: tuple, runs: list[dict], compared: list[Compared], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replicas, flavor, steps, _ = group
    tag = f"M{replicas}_{flavor}_{steps}steps"
    targets = [t for c in compared if c.name == "AdamW" for t in c.target.values() if t is not None]
    by_step = {c.name: _mean_curve(c.runs, "steps") for c in compared}
    # the first tenth of a run falls from ~7: both plots take their scale from the rest
    settled = [m for curve in by_step.values() if curve for x, m in zip(curve[0], curve[1]) if x >= steps / 10]
    lowest = [min(curve[2]) for curve in by_step.values() if curve]
    paths = []
    for key, xlabel, fname, logx in (
            ("steps", "step", f"heldout_vs_step_{tag}.png", False),
            ("r_bytes", "R bytes sent by rank 0 (cumulative, log; evaluations before the first R byte left out)",
             f"heldout_vs_r_bytes_{tag}.png", True)):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, c in enumerate(compared):
            curve = _mean_curve(c.runs, key)
            if curve is None:
                continue
            keep = [j for j, x in enumerate(curve[0]) if not logx or x > 0]
            xs, mean, low, high = ([v[j] for j in keep] for v in curve)
            adamw = c.name == "AdamW"
            color = "k" if adamw else f"C{i}"
            label = f"{c.name} (lr {c.lr:g}" + (f", mean of {len(c.runs)} seeds, band: their range)" if len(c.runs) > 1
                                                 else ")")
            ax.plot(xs, mean, color=color, lw=1.4, ls="--" if adamw else "-", marker=".", ms=3, label=label)
            if len(c.runs) > 1:
                ax.fill_between(xs, low, high, color=color, alpha=0.15, lw=0)
        if targets:
            ax.axhline(statistics.fmean(targets), color="k", lw=0.7, ls=":", label="AdamW-HSDP's final held-out loss")
        if settled:
            span = max(settled) - min(lowest)
            ax.set_ylim(min(lowest) - 0.05 * span, max(settled) + 0.05 * span)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("held-out loss of the global model")
        ax.set_title(group_title(group, runs), fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    return paths


def plot_gap_vs_n(order: list[tuple], gaps: dict, path: Path) -> Path | None:
    """x: parameters (log), y: final held-out gap, one line per family and M (and tokens per
    parameter, where the study has several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict = {}
    for (name, group), (gap, half, _) in gaps.items():
        if name == "AdamW":
            continue
        replicas, flavor, steps, tokens = group
        parameters = parameter_count(flavor)
        density = float(f"{steps * tokens / parameters:.2g}")  # 2320 and 615 steps both read 20 tokens/parameter
        lines.setdefault((name, replicas, density), []).append((parameters, 100 * gap, 100 * half))
    if not lines:
        return None
    densities = {k[2] for k in lines}
    names = list(dict.fromkeys(k[0] for k in lines))
    # M by line and marker (a point that no other flavor joins is told apart by its marker alone)
    styles = {m: s for m, s in zip(sorted({k[1] for k in lines}), [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")] * 4)}
    fig, ax = plt.subplots(figsize=(7, 5))
    for (name, replicas, density), points in lines.items():
        points.sort()
        xs, ys, errs = zip(*points)
        label = f"{name}, M = {replicas}" + (f", {density:g} tok/param" if len(densities) > 1 else "")
        line, marker = styles[replicas]
        ax.errorbar(xs, ys, yerr=errs, color=f"C{names.index(name)}", ls=line, marker=marker, ms=5, capsize=3,
                    label=label)
    sizes = [x for points in lines.values() for x, _, _ in points]
    ax.set_xlim(min(sizes) / 1.5, max(sizes) * 1.5)
    ax.axhline(0, color="k", lw=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (log)")
    ax.set_ylabel("final held-out loss vs AdamW-HSDP (%)")
    ax.set_title("gap to AdamW-HSDP against model size (bars: half the seeds' range)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def select(results: dict, replicas=None, flavors=None, steps=None, names=None) -> dict:
    return {k: r for k, r in results.items()
            if (not replicas or r["replicas"] in replicas) and (not flavors or r["flavor"] in flavors)
            and (not steps or r["training_steps"] in steps) and (not names or r["name"] in names)}


def report_groups(results: dict, pool: dict, out: Path, target_steps: int | None = None) -> list[Path]:
    """Prints each group's tables and writes its plots; returns their paths."""
    paths = []
    for group, runs in groups(results).items():
        compared = compare(runs, pool, target_steps)
        print(f"\n### {group_title(group, runs)}\n")
        print(sweep_table(runs))
        print()
        print(final_table(compared))
        paths += plot_group(group, runs, compared, out)
    return paths


def report_gaps(results: dict, pool: dict, out: Path, target_steps: int | None = None) -> list[Path]:
    """Prints the gap-vs-N table of ``results`` and writes its plot."""
    order, gaps = gap_vs_n(results, pool, target_steps)
    print("\n### Gap vs N: final held-out loss vs AdamW-HSDP's (mean over seeds ± half the per-seed range)\n")
    print(gap_table(order, gaps))
    path = plot_gap_vs_n(order, gaps, out / "gap_vs_n.png")
    return [path] if path else []


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv=None) -> int:
    from titan_commopt.optim import available_names
    from titan_commopt.options import ConfigError

    from scripts._bench_common import flavor_names

    p = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", nargs="+", type=int, help="training steps (default 300); --report: a filter")
    length.add_argument("--tokens-per-param", type=float, help="steps = this × the flavor's parameters ÷ tokens per step")
    p.add_argument("--flavor", nargs="+", help="model flavors (default cpu_tiny); --report: a filter")
    p.add_argument("--replicas", nargs="+", type=int, help="M, replicas (default 2); --report: a filter")
    p.add_argument("--shards", type=int, help="S, FSDP shards per replica (default: 2 at M = 2, 1 from M = 4 on)")
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                   help=f"sequences of {SEQ_LEN} tokens per step over all processes (each reads global ÷ M·S)")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (default: the steps ÷ 40, dividing them)")
    p.add_argument("--eval-steps", type=int, help="batches per evaluation (default: ~64k held-out tokens)")
    p.add_argument("--dataset", default="commopt_world", help="[training] dataset (a bundled corpus with a held-out twin)")
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer; --report: a filter")
    p.add_argument("--lr", type=float, default=STUDY_ADAMW_LR,
                   help="[optimizer] lr of every optimizer (default: AdamW-HSDP's best in the study; the presets scale it)")
    p.add_argument("--base-lr", nargs="*", default=[], metavar="NAME=LR", help="another lr for one optimizer")
    p.add_argument("--lr-grid", nargs="*", type=float, default=[1.0], help="factors of each optimizer's lr to run")
    p.add_argument("--best-of", help="a study's out folder: run each optimizer at its best lr there (same flavor, "
                   "steps and tokens per step; no grid)")
    p.add_argument("--best-of-replicas", type=int, help="--best-of: take the best lrs of runs at this M (default: the run's)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    p.add_argument("--label", help="appended to each optimizer's name in the results (e.g. eager for "
                   "--set local.merge=eager local.sync_delay=0): a variant is stored, scored and plotted apart from the preset's runs")
    p.add_argument("--include", nargs="*", default=[], metavar="DIR",
                   help="--report: other studies' out folders whose runs are shown too (e.g. the baselines)")
    p.add_argument("--seeds", nargs="*", type=int, default=[42], help="[debug] seed of each run (model init)")
    p.add_argument("--out", default="outputs/convergence")
    p.add_argument("--report", action="store_true", help="run nothing: tables and plots of <out>/convergence.json")
    p.add_argument("--targets-from", help="another study's out folder whose AdamW-HSDP runs are targets too")
    p.add_argument("--target-steps", type=int, help="score against AdamW-HSDP's runs of this many steps "
                   "(same M, flavor, tokens per step; default: the run's own)")
    a = p.parse_args(argv)
    out = Path(a.out)
    store = out / "convergence.json"
    results = load_results(store)
    if a.label is not None and (not a.label.strip() or "|" in a.label):
        p.error(f"--label {a.label!r}: allowed is a non-empty text without '|'")
    if a.include and not a.report:
        p.error("--include: only with --report (a study writes its own out folder)")
    for folder in a.include:
        if not (Path(folder) / "convergence.json").exists():
            p.error(f"--include {folder}: no convergence.json there")
        results = {**load_results(Path(folder) / "convergence.json"), **results}
    pool = {**(load_results(Path(a.targets_from) / "convergence.json") if a.targets_from else {}), **results}
    if a.report:
        if a.tokens_per_param is not None:
            p.error("--tokens-per-param: --report filters by --steps")
        shown = select(results, a.replicas, a.flavor, a.steps, a.optimizers)
        if not shown:
            print(f"no run in {store} matches", file=sys.stderr)
            return 1
        paths = report_groups(shown, pool, out, a.target_steps) + report_gaps(shown, pool, out, a.target_steps)
        print("\nplots: " + ", ".join(map(str, paths)))
        return 0

    names = a.optimizers or [n for n in available_names() if n != "Adam"]
    unknown = [n for n in names if n not in available_names()]
    if unknown:
        p.error(f"--optimizers {unknown[0]!r}: allowed is one of {', '.join(available_names())}")
    flavors = a.flavor or ["cpu_tiny"]
    bad = [f for f in flavors if f not in flavor_names()]
    if bad:
        p.error(f"--flavor {bad[0]!r}: allowed is one of {', '.join(flavor_names())}")
    if a.steps and len(a.steps) > 1:
        p.error(f"--steps {' '.join(map(str, a.steps))}: allowed is one length per invocation (several only with --report)")
    base = {name: a.lr for name in names}
    for item in a.base_lr:
        name, _, value = item.partition("=")
        if name not in base:
            p.error(f"--base-lr {item}: {name!r} is not among the optimizers run ({', '.join(names)})")
        base[name] = float(value)
    try:
        overrides = parse_overrides(a.set)
        settings = []
        for replicas in a.replicas or [2]:
            for flavor in flavors:
                setting, how = plan(replicas, a.shards, flavor, steps=(a.steps or [300])[0] if a.tokens_per_param is None
                                    else None, tokens_per_param=a.tokens_per_param, global_batch=a.global_batch,
                                    dataset=a.dataset, eval_every=a.eval_every, eval_steps=a.eval_steps)
                settings.append(setting)
                print(f"# M = {replicas} × {setting.shards}: {how}", file=sys.stderr, flush=True)
    except (UsageError, ConfigError) as error:
        p.error(str(error))
    best_of = load_results(Path(a.best_of) / "convergence.json") if a.best_of else None
    out.mkdir(parents=True, exist_ok=True)
    for setting in settings:
        if best_of is not None:
            group = (a.best_of_replicas or setting.replicas, *setting.group[1:])
            found = best_lrs([r for r in best_of.values() if group_of(r) == group])
            found = {n: found[labelled(n, a.label)] for n in names if labelled(n, a.label) in found}
            missing = [labelled(n, a.label) for n in names if n not in found]
            if missing:
                print(f"# --best-of {a.best_of}: no runs of {', '.join(missing)} at M = {group[0]}, {group[1]}, "
                      f"{group[2]} steps, {group[3]} tokens/step: skipped", file=sys.stderr, flush=True)
            lrs = {name: [found[name]] for name in names if name in found}
        else:  # 6 significant digits: the lr passed on the command line, and the run's key
            lrs = {name: [float(f"{base[name] * f:.6g}") for f in a.lr_grid] for name in names}
        for name, grid in lrs.items():
            for lr in grid:
                for seed in a.seeds:
                    key = run_key(labelled(name, a.label), lr, seed, setting)
                    if key in results:
                        continue
                    run = run_one(name, lr, seed, setting, out, overrides, a.label)
                    if run is not None:  # written after every run: a long study can be resumed
                        results = record_run(store, key, run)
    pool = {**pool, **results}
    shown = {k: r for k, r in results.items() if group_of(r) in {s.group for s in settings}}
    if not shown:
        print("no run finished", file=sys.stderr)
        return 1
    # this invocation's groups, then the gap against N over everything the study holds so far
    paths = report_groups(shown, pool, out, a.target_steps) + report_gaps(results, pool, out, a.target_steps)
    print("\nplots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
