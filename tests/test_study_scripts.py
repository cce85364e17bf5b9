"""The yardstick of issue 39 and its tools: ``scripts/convergence.py`` (held-out loss of the global model,
the iso-loss step, runs at several M, flavors and lengths in one results file, the gap against N),
``scripts/bench_netns.py --to-loss`` / ``--match-8b-ratio`` (training time apart from evaluation
time, the link-rate calibration), ``scripts/project_time_to_loss.py --steps-ratio-from``.

The arithmetic runs on synthetic curves and console lines; one real 4-step study at M = 2 and one real
time-to-loss run of AdamW-HSDP (root only) check that the pieces meet torchtitan's output.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import bench_netns, convergence
from scripts import project_time_to_loss as project
from scripts._bench_common import ROOT, Timeline, parameter_count

Setting = convergence.Setting


def setting(replicas=2, flavor="cpu_tiny", steps=100, global_batch=16, shards=None) -> Setting:
    return Setting(replicas, shards or convergence.default_shards(replicas), flavor, steps, global_batch,
                   "commopt_world", eval_every=10, eval_steps=4)


def run(name, seed, where: Setting, heldout, lr=0.027, r_per_step=1000.0, training=None) -> dict:
    """A results-file record: held-out evaluations at steps 0, 10, ..., the training curve flat at ``training``."""
    steps = list(range(1, where.training_steps + 1))
    evals = [1] + list(range(where.eval_every, where.training_steps + 1, where.eval_every))
    return {
        "name": name, "lr": lr, "seed": seed, "replicas": where.replicas, "shards": where.shards,
        "flavor": where.flavor, "training_steps": where.training_steps, "tokens_per_step": where.tokens_per_step,
        "global_batch": where.global_batch, "dataset": where.dataset, "set": {}, "eval_every": where.eval_every,
        "eval_steps": where.eval_steps, "folder": convergence.run_folder(name, lr, seed, where),
        "steps": steps, "loss": [training or heldout[-1]] * len(steps), "r_bytes": [r_per_step * s for s in steps],
        "heldout": {"steps": evals, "loss": list(heldout), "r_bytes": [r_per_step * s for s in evals]},
        "seconds": 10.0, "train_seconds": 8.0, "eval_seconds": 1.0,
    }


def results_of(*runs: dict) -> dict:
    return {convergence.run_key(r["name"], r["lr"], r["seed"], Setting(
        r["replicas"], r["shards"], r["flavor"], r["training_steps"], r["global_batch"], r["dataset"],
        r["eval_every"], r["eval_steps"])): r for r in runs}


# ---- the study's coordinates ----------------------------------------------------------------------------
def test_the_key_keeps_every_coordinate_apart(tmp_path):
    runs = [run("AdamW", 42, setting(m, f, n), [5.0] + [4.0] * (n // 10))
            for m in (2, 8) for f in ("cpu_micro", "cpu_tiny") for n in (100, 200)]
    results = results_of(*runs)
    assert len(results) == 8  # one name, lr and seed: the mesh, flavor and length tell them apart
    assert len({r["folder"] for r in runs}) == 8  # and so do their TensorBoard folders
    store = tmp_path / "convergence.json"
    store.write_text(json.dumps(results))
    found = convergence.groups(convergence.load_results(store))
    assert list(found) == [(m, f, n, 2048) for m in (2, 8) for f in ("cpu_micro", "cpu_tiny") for n in (100, 200)]
    wider = setting(2, "cpu_tiny", 100, global_batch=32)  # another batch is another key, too
    assert convergence.run_key("AdamW", 0.027, 42, wider) not in results


def test_a_results_file_of_the_old_yardstick_reads_as_2x2_cpu_tiny_training_loss_only(tmp_path):
    old = {"name": "AdamW", "lr": 0.027, "seed": 42, "steps": [1, 2, 3], "loss": [3.0, 2.0, 1.0], "r_bytes": [1, 2, 3],
           "seconds": 5.0}
    (tmp_path / "convergence.json").write_text(json.dumps({"AdamW|0.027|42": old}))
    (key, r), = convergence.load_results(tmp_path / "convergence.json").items()
    assert key == "AdamW|0.027|42|M2xS2|cpu_tiny|3steps|2048tok"
    assert convergence.group_of(r) == (2, "cpu_tiny", 3, 2048) and r["folder"] == "AdamW_lr0.027_seed42"
    assert convergence.final_heldout(r) is None and convergence.score(r) == 1.0  # lr chosen by training loss


def test_the_global_batch_is_fixed_and_each_process_reads_its_part():
    assert setting(2).local_batch == 4 and setting(2).processes == 4  # 2 x 2
    assert setting(8).local_batch == 2 and setting(8).processes == 8  # 8 x 1
    assert setting(2).tokens_per_step == setting(8).tokens_per_step == 2048
    with pytest.raises(convergence.UsageError, match=r"--global-batch 16 is not a multiple of M·S = 3 × 2 = 6"):
        convergence.local_batch(16, 3, 2)


@pytest.mark.parametrize("args, expected", [
    (["--replicas", "3", "--shards", "2"], "--global-batch 16 is not a multiple of M·S = 3 × 2 = 6 processes"),
    (["--steps", "100", "--eval-every", "30"], "--eval-every 30 does not divide --steps 100"),
    (["--tokens-per-param", "0"], "--tokens-per-param 0.0: allowed is a number > 0"),
    (["--dataset", "commopt_world_heldout"], "--dataset 'commopt_world_heldout': the study scores held-out text"),
    (["--flavor", "cpu_huge"], "--flavor 'cpu_huge': allowed is one of"),
    (["--steps", "100", "200"], "allowed is one length per invocation"),
    (["--steps", "10", "--tokens-per-param", "20"], "not allowed with argument --steps"),
])
def test_convergence_refuses_a_study_it_cannot_run_in_one_line(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as stop:
        convergence.main([*args, "--optimizers", "AdamW", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_steps_from_tokens_per_parameter_end_on_an_evaluation():
    assert parameter_count("cpu_tiny") == 237_888 and parameter_count("cpu_micro") == 63_096  # torchtitan 0.2.2
    tiny, how = convergence.plan(2, None, "cpu_tiny", steps=None, tokens_per_param=20, global_batch=16,
                                 dataset="commopt_world", eval_every=None, eval_steps=None)
    # 2323 = 23 x 101 has no divisor near 2323 / 40: the steps move to a multiple of the period instead
    assert (tiny.training_steps, tiny.eval_every, tiny.eval_steps) == (2320, 58, 32)
    assert "20 tokens/parameter × 237,888 parameters ÷ 2,048 tokens/step = 2323.1 steps → 2320" in how
    micro, how = convergence.plan(8, None, "cpu_micro", steps=None, tokens_per_param=20, global_batch=16,
                                dataset="commopt_world", eval_every=None, eval_steps=None)
    assert (micro.training_steps, micro.eval_every, micro.shards, micro.local_batch) == (615, 15, 1, 2)
    assert "= 616.2 steps → 615" in how
    given, _ = convergence.plan(2, None, "cpu_tiny", steps=500, tokens_per_param=None, global_batch=16,
                                dataset="commopt_world", eval_every=None, eval_steps=None)
    assert given.training_steps == 500 and 500 % given.eval_every == 0 and given.eval_every == 10


# ---- the numbers --------------------------------------------------------------------------------------
def test_the_iso_loss_step_is_linear_between_evaluations_and_none_if_never_reached():
    steps, losses = [1, 10, 20, 30], [6.0, 4.0, 2.0, 2.5]
    assert convergence.iso_loss_step(steps, losses, 3.0) == pytest.approx(15.0)  # halfway from 4.0 to 2.0
    assert convergence.iso_loss_step(steps, losses, 2.0) == 20.0  # at an evaluation exactly
    assert convergence.iso_loss_step(steps, losses, 7.0) == 1.0  # the first evaluation is already below
    assert convergence.iso_loss_step(steps, losses, 1.9) is None
    # the first crossing counts, not a later rise back above
    assert convergence.iso_loss_step([1, 10, 20, 30], [6.0, 2.0, 5.0, 1.0], 3.0) == pytest.approx(1 + 9 * 3 / 4)


def test_each_optimizer_is_scored_against_adamw_hsdp_of_its_own_seed_and_group():
    where = setting(2, "cpu_micro", 40)
    results = results_of(
        # AdamW-HSDP: seed 42 ends at 2.0, first reached at step 30 (its own iso-loss step); seed 43 ends at 2.2
        run("AdamW", 42, where, [6.0, 4.0, 3.0, 2.0, 2.0], r_per_step=1000.0),
        run("AdamW", 43, where, [6.0, 4.0, 3.0, 2.4, 2.2], r_per_step=1000.0),
        run("AdamW", 42, where, [6.0, 5.0, 4.0, 3.0, 3.0], lr=0.1),  # a worse lr: not the target
        run("DeMo", 42, where, [6.0, 5.0, 3.0, 2.5, 1.9], r_per_step=10.0),  # reaches 2.0 at 30 + 10 × 0.5/0.6
        run("DeMo", 43, where, [6.0, 5.0, 4.0, 3.0, 2.2], r_per_step=10.0),  # reaches 2.2 at its last step
        run("DiLoCo", 42, where, [6.0, 5.0, 4.0, 3.0, 2.5]),  # never reaches 2.0
        run("AdamW", 42, setting(8, "cpu_micro", 40), [6.0, 1.0, 1.0, 1.0, 1.0]),  # another M: not the target
    )
    (group, runs), = convergence.groups(convergence.select(results, [2])).items()
    scored = {c.name: c for c in convergence.compare(runs, results)}
    adamw, demo, diloco = scored["AdamW"], scored["DeMo"], scored["DiLoCo"]
    assert adamw.lr == 0.027 and adamw.heldout == adamw.target == {42: 2.0, 43: 2.2}
    assert adamw.iso == adamw.adamw_iso == {42: 30.0, 43: 40.0} and adamw.ratio() == 1.0
    assert demo.target == {42: 2.0, 43: 2.2} and demo.iso == {42: pytest.approx(115 / 3), 43: 40.0}
    assert demo.ratios() == {42: pytest.approx(115 / 90), 43: 1.0} and demo.ratio() == pytest.approx((115 / 90 + 1) / 2)
    assert demo.gaps() == {42: pytest.approx(-0.05), 43: 0.0}
    assert demo.gap() == pytest.approx((1.9 + 2.2) / (2.0 + 2.2) - 1)
    assert demo.adamw_r_bytes / demo.r_bytes == pytest.approx(100.0)
    assert diloco.iso == {42: None} and diloco.ratio() is None and diloco.gap() == pytest.approx(0.25)
    table = convergence.final_table(list(scored.values()))
    assert "| DeMo | 0.027 | 42: 1.9000, 43: 2.2000 | 2.0500 ± 0.1500 | -2.4 % (42: -5.0, 43: +0.0) | " \
           "42: 38, 43: 40 | 42: 30, 43: 40 | 1.139 (42: 1.278, 43: 1.000) |" in table, table
    assert "| DiLoCo | 0.027 | 42: 2.5000 | 2.5000 | +25.0 % | 42: – | 42: 30 | – |" in table, table
    assert "100.0×" in table


def test_targets_of_another_length_come_from_that_length():
    short, long = setting(2, "cpu_micro", 20), setting(2, "cpu_micro", 40)
    results = results_of(run("AdamW", 42, short, [6.0, 4.0, 3.0]),
                         run("AdamW", 42, long, [6.0, 4.0, 3.0, 2.0, 1.5]),
                         run("DeMo", 42, long, [6.0, 5.0, 4.0, 2.0, 1.8]))
    runs = convergence.groups(results)[long.group]
    demo = {c.name: c for c in convergence.compare(runs, results, target_steps=20)}["DeMo"]
    assert demo.target == {42: 3.0} and demo.iso == {42: pytest.approx(25.0)} and demo.adamw_iso == {42: 20.0}


def test_the_gap_against_n_table_and_plot(tmp_path):
    runs = []
    for m, gaps in ((2, {"cpu_micro": 0.10, "cpu_tiny": 0.05}), (8, {"cpu_micro": 0.20, "cpu_tiny": 0.08})):
        for flavor, gap in gaps.items():
            where = setting(m, flavor, 40)
            for seed, wobble in ((42, 0.0), (43, 0.02)):
                runs.append(run("AdamW", seed, where, [6.0, 4.0, 3.0, 2.0, 2.0]))
                runs.append(run("DiLoCo", seed, where, [6.0, 5.0, 4.0, 3.0, 2.0 * (1 + gap + wobble)]))
    results = results_of(*runs)
    order, gaps = convergence.gap_vs_n(results, results)
    assert order == [(2, "cpu_micro", 40, 2048), (2, "cpu_tiny", 40, 2048), (8, "cpu_micro", 40, 2048),
                     (8, "cpu_tiny", 40, 2048)]
    assert gaps[("DiLoCo", order[3])] == (pytest.approx(0.09), pytest.approx(0.01), 2)
    table = convergence.gap_table(order, gaps)
    assert "| final held-out gap to AdamW-HSDP | M=2, cpu_micro (63k), 1.3 tok/param | M=2, cpu_tiny (238k), 0.344 tok/param |" in table
    assert "| DiLoCo | +11.0 % ± 1.0 | +6.0 % ± 1.0 | +21.0 % ± 1.0 | +9.0 % ± 1.0 |" in table, table
    png = convergence.plot_gap_vs_n(order, gaps, tmp_path / "gap.png")
    assert png.stat().st_size > 10_000
    runs = convergence.groups(results)[order[3]]
    paths = convergence.plot_group(order[3], runs, convergence.compare(runs, results), tmp_path)
    assert [p.name for p in paths] == ["heldout_vs_step_M8_cpu_tiny_40steps.png", "heldout_vs_r_bytes_M8_cpu_tiny_40steps.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_the_best_lr_is_chosen_by_the_final_held_out_loss():
    where = setting(2, "cpu_micro", 40)
    results = results_of(run("DeMo", 42, where, [6.0, 5.0, 4.0, 3.0, 2.0], lr=0.01, training=1.0),
                         run("DeMo", 42, where, [6.0, 5.0, 4.0, 3.0, 2.5], lr=0.03, training=0.5))
    assert convergence.best_lrs(list(results.values())) == {"DeMo": 0.01}


def test_report_filters_by_m_flavor_and_steps(tmp_path, capsys):
    results = results_of(*[run("AdamW", 42, setting(m, f, 40), [6.0, 4.0, 3.0, 2.0, 2.0])
                           for m in (2, 8) for f in ("cpu_micro", "cpu_tiny")])
    (tmp_path / "convergence.json").write_text(json.dumps(results))
    assert convergence.main(["--report", "--out", str(tmp_path), "--replicas", "8", "--flavor", "cpu_tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("### M = ") == 1 and "### M = 8 replicas × S = 1, cpu_tiny (237,888 parameters), 40 steps" in out
    assert (tmp_path / "heldout_vs_step_M8_cpu_tiny_40steps.png").exists()
    assert not (tmp_path / "heldout_vs_step_M2_cpu_tiny_40steps.png").exists()
    assert convergence.main(["--report", "--out", str(tmp_path), "--steps", "99"]) == 1


def test_a_study_runs_each_point_once_and_m8_can_take_m2_s_best_lrs(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_run(name, lr, seed, where, out, overrides, label=None):  # no training: what would run, and a curve
        launched.append((name, lr, seed, where.replicas, where.shards, where.flavor, where.training_steps))
        return run(name, seed, where, [6.0, 4.0, 3.0, 2.0, 2.0 + (lr != 0.027)], lr=lr)

    monkeypatch.setattr(convergence, "run_one", fake_run)
    monkeypatch.setattr(convergence, "plot_group", lambda *args: [])  # drawn in the tests above
    monkeypatch.setattr(convergence, "plot_gap_vs_n", lambda *args: None)
    study = ["--out", str(tmp_path), "--steps", "40", "--eval-every", "10", "--optimizers", "AdamW", "DeMo"]
    assert convergence.main([*study, "--replicas", "2", "--flavor", "cpu_micro", "cpu_tiny", "--lr-grid", "1", "3"]) == 0
    assert len(launched) == 8 and {p[3:5] for p in launched} == {(2, 2)}
    assert convergence.main([*study, "--replicas", "2", "--flavor", "cpu_micro", "cpu_tiny", "--lr-grid", "1", "3"]) == 0
    assert len(launched) == 8  # every point already in convergence.json
    assert convergence.main([*study, "--replicas", "8", "--flavor", "cpu_micro", "--best-of", str(tmp_path),
                             "--best-of-replicas", "2", "--seeds", "42", "43"]) == 0
    assert launched[8:] == [(n, 0.027, s, 8, 1, "cpu_micro", 40) for n in ("AdamW", "DeMo") for s in (42, 43)]
    out = capsys.readouterr().out
    assert "### M = 8 replicas × S = 1, cpu_micro (63,096 parameters), 40 steps" in out
    assert "| final held-out gap to AdamW-HSDP | M=2, cpu_micro (63k), 1.3 tok/param | M=2, cpu_tiny " in out  # all of it
    assert len(json.loads((tmp_path / "convergence.json").read_text())) == 12


def test_a_labelled_variant_is_stored_and_scored_apart_and_takes_its_own_best_lr(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_run(name, lr, seed, where, out, overrides, label=None):
        launched.append((name, label, lr, seed, overrides))
        good = 0.054 if label else 0.027  # the variant's best lr is not the preset's
        return {**run(convergence.labelled(name, label), seed, where, [6.0, 4.0, 3.0, 2.0, 2.0 + (lr != good)], lr=lr),
                "optimizer": name}

    monkeypatch.setattr(convergence, "run_one", fake_run)
    monkeypatch.setattr(convergence, "plot_group", lambda *args: [])
    monkeypatch.setattr(convergence, "plot_gap_vs_n", lambda *args: None)
    study = ["--out", str(tmp_path), "--steps", "40", "--eval-every", "10", "--replicas", "2", "--flavor", "cpu_micro"]
    grid = ["--lr-grid", "1", "2"]
    assert convergence.main([*study, "--optimizers", "AdamW", "DiLoCo", *grid]) == 0
    eager = ["--set", "local.merge=eager", "local.sync_delay=0"]  # the DiLoCo preset streams (sync_delay 1)
    assert convergence.main([*study, "--optimizers", "DiLoCo", *grid, "--label", "eager", *eager]) == 0
    assert launched[4:] == [("DiLoCo", "eager", lr, 42, {"local": {"merge": "eager", "sync_delay": 0}})
                            for lr in (0.027, 0.054)]
    stored = json.loads((tmp_path / "convergence.json").read_text())
    assert sorted({r["name"] for r in stored.values()}) == ["AdamW", "DiLoCo", "DiLoCo eager"] and len(stored) == 6
    assert {r["optimizer"] for r in stored.values() if r["name"] == "DiLoCo eager"} == {"DiLoCo"}
    out = capsys.readouterr().out
    assert "| DiLoCo eager | 0.054 * | 1 |" in out and "| DiLoCo | 0.027 * | 1 |" in out
    # the variant's second seed runs at the variant's best lr, not the preset's
    assert convergence.main([*study, "--optimizers", "DiLoCo", "--label", "eager", "--best-of", str(tmp_path),
                             "--seeds", "43"]) == 0
    assert launched[-1][:4] == ("DiLoCo", "eager", 0.054, 43)


def test_two_writers_of_one_results_file_keep_each_other_s_runs(tmp_path):
    store = tmp_path / "convergence.json"
    first, second = results_of(run("AdamW", 42, setting(), [6.0, 2.0])), results_of(run("DeMo", 42, setting(), [6.0, 3.0]))
    convergence.record_run(store, *next(iter(first.items())))  # a study that loaded the file before this run was in
    held = convergence.record_run(store, *next(iter(second.items())))
    assert set(held) == set(first) | set(second) == set(json.loads(store.read_text()))


def test_report_includes_other_folders_and_refuses_what_it_cannot_do(tmp_path, capsys):
    base, variants = tmp_path / "base", tmp_path / "variants"
    for folder, runs in ((base, [run("AdamW", 42, setting(steps=40), [6.0, 4.0, 3.0, 2.0, 2.0])]),
                         (variants, [run("DiLoCo eager", 42, setting(steps=40), [6.0, 4.0, 3.0, 2.5, 2.2])])):
        folder.mkdir()
        (folder / "convergence.json").write_text(json.dumps(results_of(*runs)))
    assert convergence.main(["--report", "--out", str(variants), "--include", str(base)]) == 0
    out = capsys.readouterr().out
    assert "| DiLoCo eager | 0.027 | 42: 2.2000 | 2.2000 | +10.0 % |" in out
    for args, expected in ((["--out", str(variants), "--include", str(base)], "--include: only with --report"),
                           (["--report", "--out", str(variants), "--include", str(tmp_path)], "no convergence.json there"),
                           (["--out", str(variants), "--label", "a|b"], "--label 'a|b': allowed is a non-empty text")):
        with pytest.raises(SystemExit) as exit_:
            convergence.main(args)
        assert exit_.value.code == 2 and expected in capsys.readouterr().err


# ---- training time apart from evaluation time ---------------------------------------------------------
CONSOLE = """\
[rank0]:[titan] 2026-11-29 02:44:37,777 - root - INFO - step:  1  loss:  7.42988  grad_norm:  0.3451
[rank0]:[titan] 2026-11-29 02:44:37,777 - root - INFO - step:  1  loss:  7.42988  R sent: 0B/step
[rank0]:[titan] 2026-11-29 02:44:38,277 - root - INFO - validate step:  1  loss:  7.3853  memory:  0.00GiB(0.00%)
[rank0]:[titan] 2026-11-29 02:44:38,477 - root - INFO - step:  2  loss:  7.37086  grad_norm:  0.3518
[rank0]:[titan] 2026-11-29 02:44:39,477 - root - INFO - validate step:  2  loss:  7.3436  memory:  0.00GiB(0.00%)
[rank0]:[titan] 2026-11-29 02:44:39,777 - root - INFO - step:  3  loss:  7.38204  grad_norm:  0.3384
[rank0]:[titan] 2026-11-29 02:44:40,077 - root - INFO - step:  4  loss:  7.41387  grad_norm:  0.3279
[rank0]:[titan] 2026-11-29 02:44:42,077 - root - INFO - validate step:  4  loss:  7.3096  memory:  0.00GiB(0.00%)
"""


def test_the_timeline_leaves_the_evaluations_out_of_the_training_time():
    timeline = Timeline.of(CONSOLE)
    assert sorted(timeline.steps) == [1, 2, 3, 4] and timeline.losses[1] == 7.42988  # not the validate line's
    assert timeline.eval_losses == {1: 7.3853, 2: 7.3436, 4: 7.3096}
    assert timeline.eval_seconds() == pytest.approx(0.5 + 1.0 + 2.0)
    # step 1's line to step 4's: 2.3 s, of which the evaluations after steps 1 and 2 took 1.5
    assert timeline.training_seconds(4) == pytest.approx(0.8)
    assert timeline.training_seconds(2) == pytest.approx(0.2)
    assert timeline.training_seconds(1) == 0.0


def test_time_to_loss_is_interpolated_in_training_seconds():
    sampler = bench_netns.ConsoleSampler(Path("/nonexistent"), set())
    for line in CONSOLE.splitlines():
        sampler.timeline.add(line)
    sampler.samples = {1: [0, 0], 4: [3000, 300]}
    auto = bench_netns.time_to_loss("AdamW", sampler, None, None, 4)  # the run sets its own target
    assert auto["target"] == 7.3096 and auto["reached_at_step"] == 4 and auto["iso_loss_step"] == 4.0
    assert auto["time_to_loss_s"] == pytest.approx(0.8) and auto["train_s"] == pytest.approx(0.8)
    assert auto["link_bytes_per_step"] == [1000.0, 100.0] and auto["eval_s"] == pytest.approx(3.5)
    # 7.33 lies 0.6 of the way from step 2's 7.3436 to step 4's 7.3096: 0.2 + 0.6 × (0.8 − 0.2) training s
    between = bench_netns.time_to_loss("DeMo", sampler, 7.3232, "reached", 4)
    assert between["reached_at_step"] == 4 and between["iso_loss_step"] == pytest.approx(3.2)
    assert between["time_to_loss_s"] == pytest.approx(0.56)
    never = bench_netns.time_to_loss("DiLoCo", sampler, 7.0, None, 4)
    assert never["reached_at_step"] is None and never["time_to_loss_s"] is None and never["best_heldout"] == 7.3096
    # AdamW-HSDP missing a study's target by its last digits (its whole schedule run) sets the round's own
    assert bench_netns.missed_study_target(never)
    assert not bench_netns.missed_study_target({**never, "curve": never["curve"][:2]})  # stopped before the end
    assert not bench_netns.missed_study_target(auto)
    own = bench_netns.crossing(never["curve"], never["curve"][-1][1])
    assert own == {"target": 7.3096, "reached_at_step": 4, "iso_loss_step": 4.0, "time_to_loss_s": pytest.approx(0.8)}


# ---- the link rate of the 8B cluster --------------------------------------------------------------------
def link_model(compute: float, latency: float, nbytes: float, noise=None):
    """AdamW-HSDP on a synthetic link: step = compute + latency + bytes / rate (None: unshaped)."""
    calls = []

    def measure(rate):
        calls.append(rate)
        link = 0.0 if rate is None else latency + 8 * nbytes / rate
        if noise:
            link = noise(len(calls), link)
        return {"step_s": compute + link, "link_bytes_per_step": [nbytes, nbytes * 0.9]}

    return measure, calls


def test_the_calibration_solves_the_rate_and_confirms_it():
    measure, calls = link_model(compute=0.2, latency=0.3, nbytes=1e6)
    found = bench_netns.solve_rate(measure, 18.0, tries=3)
    first = 8e6 / (18.0 * 0.2)  # the measured bytes in 18 × compute
    assert calls[0] is None and calls[1] == pytest.approx(first)
    # the latency makes the first trial 0.3 s slow (ratio 19.5): the solved rate corrects it, and confirms
    assert found["trials"][0]["ratio"] == pytest.approx(19.5)
    assert len(found["trials"]) == 2 and found["within_tolerance"]
    assert found["achieved_ratio"] == pytest.approx(found["trials"][-1]["ratio"]) == pytest.approx(18.0, rel=0.15)
    assert found["rate_bps"] == calls[-1] and found["compute_s"] == 0.2


def test_the_calibration_keeps_the_trial_nearest_the_target_and_slows_a_link_that_measured_no_cost():
    # a noisy box: the first shaped step was no slower than the compute
    measure, calls = link_model(0.2, 0.0, 1e6, noise=lambda call, link: -0.01 if call == 2 else link * 2.0)
    found = bench_netns.solve_rate(measure, 18.0, tries=3, tolerance=0.01)
    assert calls[2] == pytest.approx(calls[1] / 4) and len(found["trials"]) == 3
    assert not found["within_tolerance"] or abs(found["achieved_ratio"] / 18 - 1) <= 0.01
    best = min(found["trials"][1:], key=lambda t: abs(math.log(t["ratio"] / 18)))
    assert found["rate_bps"] == best["rate_bps"]


def test_the_8b_ratio_is_the_projection_s():
    times = project.step_times("8B", 2, 8, ["AdamW"], {}, 1e10)["AdamW"]
    assert project.adamw_link_to_compute("10gbit") == pytest.approx(times["r_s"] / times["compute_s"])
    assert 15 < project.adamw_link_to_compute("10gbit") < 21  # issue 39: ~18
    assert project.adamw_link_to_compute("1gbit") == pytest.approx(10 * project.adamw_link_to_compute("10gbit"))


# ---- a study's numbers carried into the time-to-loss tools ----------------------------------------------
def study(tmp_path) -> Path:
    where = setting(2, "cpu_micro", 40)
    results = results_of(run("AdamW", 42, where, [6.0, 4.0, 3.0, 1.99996, 1.99996]),
                         run("AdamW", 42, where, [6.0, 4.0, 3.0, 2.5, 2.5], lr=0.09),
                         run("DeMo", 42, where, [6.0, 5.0, 3.0, 2.5, 1.9], lr=0.01),
                         run("DiLoCo", 42, where, [6.0, 5.0, 4.0, 3.0, 2.5]))
    (tmp_path / "convergence.json").write_text(json.dumps(results))
    return tmp_path


def test_the_time_to_loss_target_and_lrs_come_from_the_study(tmp_path):
    results = convergence.load_results(study(tmp_path) / "convergence.json")
    target, lrs, adamw = bench_netns.study_target(results, "cpu_micro", 40, 2048, 42)
    assert target == 1.99996 and adamw["lr"] == 0.027 and lrs == {"AdamW": 0.027, "DeMo": 0.01, "DiLoCo": 0.027}
    with pytest.raises(ValueError, match="no AdamW-HSDP run .* M=2 cpu_micro 40 steps 2048 tokens/step seed 43 "
                                         r"\(the study has: M=2 cpu_micro 40 steps 2048 tokens/step\)"):
        bench_netns.study_target(results, "cpu_micro", 40, 2048, 43)


@pytest.mark.parametrize("args, expected", [
    (["--to-loss", "study"], "--targets-from: allowed together with --to-loss study"),
    (["--to-loss", "auto", "--eval-every", "3"], "--eval-every 3 does not divide AdamW's schedule (40 steps)"),
    (["--to-loss", "auto", "--dataset", "commopt_world_heldout"], "--to-loss scores held-out text"),
    (["--to-loss", "soon"], "--to-loss 'soon': allowed is 'auto', 'study' or a loss"),
    (["--match-8b-ratio", "--rates", "1gbit"], "--match-8b-ratio: the rate is found, not given"),
    (["--match-8b-ratio", "fast"], "--match-8b-ratio 'fast': allowed is a rate > 0"),
])
def test_bench_netns_refuses_a_to_loss_run_it_cannot_do_in_one_line(capsys, args, expected):
    with pytest.raises(SystemExit) as stop:
        bench_netns.main(["--optimizers", "AdamW", "DeMo", "--steps", "40", "--flavor", "cpu_micro",
                          "--nproc-per-node", "2", *args])
    assert expected in str(stop.value.code) and "\n" not in str(stop.value.code), stop.value.code


def test_bench_netns_takes_the_study_s_target_lrs_and_warm_up(tmp_path, capsys):
    a = bench_netns.argparse.Namespace(
        dataset="commopt_world", seed=None, budget_x=None, to_loss="study", targets_from=str(study(tmp_path)),
        schedule={}, steps=40, batch=4, seq_len=128, nproc_per_node=2, eval_every=None, eval_steps=None,
        flavor="cpu_micro", lrs={}, lr=None, lr_warmup=None, lr_warmup_frac=None, log_freq=1)
    # 1.99996 as the console prints it (4 decimals): a run whose console line reads 2.0000 reaches it
    assert bench_netns.prepare_to_loss(a, ["AdamW", "DeMo", "SparseLoCo"]) == 2.0
    assert a.lrs == {"AdamW": 0.027, "DeMo": 0.01} and a.seed == 42 and a.lr_warmup_frac == 0.05
    assert a.lr == convergence.STUDY_ADAMW_LR  # SparseLoCo, which the study lacks: the study's default lr
    assert (a.eval_every, a.eval_steps) == (1, 32)  # 40 steps / 40 evaluations; 64k tokens at 2048 a step
    args = bench_netns.train_args("DeMo", a, {})
    assert args[args.index("--optimizer.lr") + 1] == "0.01" and args[args.index("--lr_scheduler.warmup_steps") + 1] == "2"
    assert args[args.index("--validation.dataset") + 1] == "commopt_world_heldout"
    assert "target 2.0000: AdamW-HSDP's final held-out loss" in capsys.readouterr().err


def test_project_time_to_loss_reads_the_study_s_iso_loss_ratios(tmp_path, capsys):
    folder = study(tmp_path)
    assert project.main(["--steps-ratio-from", str(folder), "--study-flavor", "cpu_micro", "--links", "10gbit"]) == 0
    out = capsys.readouterr().out
    # DeMo reaches AdamW-HSDP's 1.99996 at step 38.3 (between 30: 2.5 and 40: 1.9), AdamW-HSDP its own at 30
    assert "AdamW 1, DeMo 1.28" in out and "never reached AdamW-HSDP's loss there: DiLoCo" in out
    assert "| DeMo | 1.28 |" in out and "| DiLoCo |" not in out
    assert project.main(["--steps-ratio-from", str(folder), "--study-flavor", "cpu_micro", "--links", "10gbit",
                         "--steps-ratio", "DiLoCo=2", "DeMo=1.1"]) == 0
    out = capsys.readouterr().out
    assert "DeMo 1.1 (given), DiLoCo 2 (given)" in out and "| DiLoCo | 2 |" in out
    assert project.main(["--steps-ratio-from", str(folder), "--study-flavor", "cpu_micro",
                         "--optimizers", "AdamW", "DiLoCo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DiLoCo never reached AdamW-HSDP's loss in" in err[0]
    assert project.main(["--steps-ratio-from", str(folder), "--study-replicas", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0 groups at M=8 cpu_tiny (the study has: M=2 cpu_micro 40 steps)" in err[0]


# ---- real runs ---------------------------------------------------------------------------------------------
def test_convergence_runs_with_held_out_evaluation(tmp_path):
    """4 steps of AdamW-HSDP and DeMo at M = 2 (2 × 2 processes) on cpu_micro, evaluated every step."""
    proc = subprocess.run(
        [sys.executable, "scripts/convergence.py", "--steps", "4", "--flavor", "cpu_micro", "--optimizers", "AdamW",
         "DeMo", "--eval-steps", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = json.loads((tmp_path / "convergence.json").read_text())
    assert sorted(results) == ["AdamW|0.027|42|M2xS2|cpu_micro|4steps|2048tok", "DeMo|0.027|42|M2xS2|cpu_micro|4steps|2048tok"]
    for r in results.values():
        assert r["heldout"]["steps"] == [1, 2, 3, 4] and all(0 < v < 10 for v in r["heldout"]["loss"])
        assert r["steps"] == [1, 2, 3, 4] and 0 < r["train_seconds"] < r["seconds"] and r["eval_seconds"] > 0
    adamw = results["AdamW|0.027|42|M2xS2|cpu_micro|4steps|2048tok"]
    assert adamw["heldout"]["loss"][-1] < adamw["heldout"]["loss"][0]  # it learns
    assert adamw["heldout"]["r_bytes"][-1] == adamw["r_bytes"][-1] > 0
    assert "| AdamW | 0.027 | 42: " in proc.stdout and "| DeMo | 0.027 | 42: " in proc.stdout
    assert (tmp_path / "heldout_vs_step_M2_cpu_micro_4steps.png").stat().st_size > 10_000
    assert (tmp_path / "heldout_vs_r_bytes_M2_cpu_micro_4steps.png").exists() and (tmp_path / "gap_vs_n.png").exists()


def test_bench_netns_times_adamw_to_its_own_held_out_loss(tmp_path):
    """AdamW-HSDP over a shaped link (2 nodes × 1 process, cpu_micro, 4 steps, evaluated at 1, 2, 4):
    it reaches its own final held-out loss at an evaluation, in training seconds."""
    proc = subprocess.run(
        [sys.executable, "scripts/bench_netns.py", "--rates", "1gbit", "--optimizers", "AdamW", "--flavor", "cpu_micro",
         "--nproc-per-node", "1", "--dataset", "commopt_world", "--to-loss", "auto", "--steps", "4", "--eval-every", "2",
         "--eval-steps", "1", "--timeout", "300", "--out", str(tmp_path), "--json", str(tmp_path / "r.json"),
         "--plot-loss", str(tmp_path / "loss.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    if proc.stdout.startswith("SKIP:"):
        pytest.skip(proc.stdout.strip())
    (r,), = json.loads((tmp_path / "r.json").read_text())["runs"].values()
    assert [k for _, _, k in r["curve"]] == [1, 2, 4] and r["target"] == r["curve"][-1][1]
    assert r["reached_at_step"] in (1, 2, 4) and 0 <= r["time_to_loss_s"] <= r["train_s"]
    assert r["eval_s"] > 0 and len(r["load_average"]) == 2 and r["link_bytes_per_step"][0] > 0
    assert "| AdamW | the config's | 4 |" in proc.stdout and (tmp_path / "loss.png").stat().st_size > 10_000


def test_the_window_table_puts_each_step_over_its_floor():
    """A step's floor is the larger of its compute (the same optimizer on the fastest link) and its busier
    direction's bytes ÷ the rate; the ratio is given for the fastest run and the spread of every run."""
    # 125,000 bytes per step at 10 Mbit/s need 0.1 s of link: the floor, above the 0.06 s of compute
    floor, ratio = bench_netns.floor_ratio(0.15, 0.06, [125_000.0, 1_000.0], "10mbit")
    assert floor == pytest.approx(0.1) and ratio == pytest.approx(1.5)
    assert bench_netns.floor_ratio(0.09, 0.06, [100.0, 125_000.0], "1gbit") == (0.06, pytest.approx(1.5))  # compute-bound

    def run(step_s, runs, link):
        return {"step_s": step_s, "step_s_runs": runs, "step_s_median": step_s, "tokens_per_s": 1.0,
                "link_bytes_per_step": link, "ledger_r_node_per_step": 0.0, "loss": 1.0}
    def measured(rates):
        results = {"10gbit/DiLoCo": run(0.06, [0.06, 0.07], [125_000.0, 125_000.0]),
                   "10mbit/DiLoCo": run(0.12, [0.12, 0.13, 0.15], [125_000.0, 125_000.0])}
        bench_netns.add_floors(results, rates)
        return results
    results = measured(["10mbit", "10gbit"])
    text = bench_netns.window_table(results, "10mbit", ["10mbit", "10gbit"], ["AdamW", "DiLoCo"])
    assert "0.100 s: 1.20x (1.20-1.50)" in text and "0.120-0.150 (3)" in text
    assert results["10mbit/DiLoCo"]["floor_ratio"] == pytest.approx(1.2)
    # the fastest rate is its own compute: no floor there, nor for a run with one rate only
    assert "1.20x" not in bench_netns.window_table(results, "10gbit", ["10mbit", "10gbit"], ["DiLoCo"])
    assert "x (" not in bench_netns.window_table(measured(["10mbit"]), "10mbit", ["10mbit"], ["DiLoCo"])
