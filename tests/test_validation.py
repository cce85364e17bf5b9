"""``[validation]``: the held-out loss of the global model (``titan/common/validation.py``).

- its settings, checked before any process group: one line each, exit status 2, or one warning line;
- one real torchtitan 0.2.2 run of DiLoCo (cpu_tiny, 2 replicas x 2 FSDP shards, an outer step every 4
  steps, an evaluation after steps 1, 3 and 6) against the same run without evaluations: the same
  training losses, ``validation_metrics/loss`` at those steps in TensorBoard with the evaluations'
  own bytes, torchtitan's ``validate step:`` line, and the same loss after steps 1 and 3 (the global
  model is DiLoCo's anchor, unchanged until the first outer step: the same model on the same held-out
  batches). The 0.3 line's run: ``tests/test_titan03_validation.py``.
"""

import pytest

from titan_commopt.options import ConfigError
from titan_commopt.train import check_config
from tests.titan_utils import CONFIG, LINE, losses, shared_run

ON_022 = pytest.mark.skipif(LINE != "0.2", reason="torchtitan 0.2.2's run (0.3's: test_titan03_validation.py)")


@pytest.mark.both_lines
@pytest.mark.parametrize("args, line", [
    (["--validation.steps", "-1"], "[validation] steps = -1: allowed is an integer >= 1"),
    (["--validation.freq", "0"], "[validation] freq = 0: allowed is an integer >= 1"),
    (["--validation.dataset", "held_out"], "[validation] dataset = 'held_out': allowed is one of"),
])
def test_bad_validation_settings_are_one_line_each(args, line):
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), *args])
    assert str(info.value).startswith(line) and len(str(info.value).splitlines()) == 1, str(info.value)


@pytest.mark.both_lines
def test_validating_on_the_training_corpus_is_one_warning():
    run = check_config(["--job.config_file", str(CONFIG), "--validation.dataset", "commopt_tiny"])
    assert run.warnings == [
        "[validation] dataset = 'commopt_tiny' is the [training] dataset: the validation loss is then measured on "
        "text the model trains on, not held-out text; its held-out twin is 'commopt_tiny_heldout'"]
    assert check_config(["--job.config_file", str(CONFIG)]).warnings == []  # the held-out twin: no warning


@pytest.mark.both_lines
@pytest.mark.parametrize("name, refused", [("DES-LOC", True), ("DiLoCo", False), ("FlexDeMo", False)])
def test_fault_tolerance_refuses_an_evaluation_that_needs_the_mean_over_replicas(monkeypatch, name, refused):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    args = ["--job.config_file", str(CONFIG), "--optimizer.name", name, "--fault_tolerance.enable",
            "--fault_tolerance.group_size", "2"]
    if not refused:
        assert check_config(args).job_config.validation.enable
        return
    with pytest.raises(ConfigError) as info:
        check_config(args)
    assert str(info.value) == (
        "[validation] enable = true with [optimizer] name = 'DES-LOC' under [fault_tolerance] enable = true: its "
        "global model between syncs is the mean of the replica groups' parameters, an R collective after the step's "
        "commit, which fault tolerance does not allow; set [validation] enable = false, or train a family with an "
        "anchor (DiLoCo, SparseLoCo) or a per-step one")
    check_config([*args, "--validation.enable", "false"])


# ---- one real run, with and without evaluations -----------------------------------------------------
DILOCO = ["--model.flavor", "cpu_tiny", "--parallelism.data_parallel_replicate_degree", "2",
          "--optimizer.name", "DiLoCo", "--commopt.local.Kx", "4", "--training.steps", "8",
          "--commopt.local.fragments", "1"]  # the preset's sync in flight one step (τ = 1), all parameters at once
EVALUATED_AT = [1, 3, 6]  # torchtitan validates after step 1 and every freq steps


@pytest.fixture(scope="module")
def diloco_runs(tmp_path_factory):
    with_eval = shared_run(tmp_path_factory, 4, *DILOCO, "--validation.freq", "3")
    without = shared_run(tmp_path_factory, 4, *DILOCO, "--validation.enable", "false")
    return with_eval, without


@ON_022
def test_evaluating_the_global_model_leaves_training_as_it_was(diloco_runs):
    (_, proc, tb), (_, _, tb_without) = diloco_runs
    assert losses(tb) == losses(tb_without) and len(losses(tb)) == 8
    assert "validation_metrics/loss" not in tb_without


@ON_022
def test_validation_loss_at_the_expected_steps_on_the_same_held_out_batches(diloco_runs):
    (_, proc, tb), _ = diloco_runs
    steps, values = zip(*sorted(tb["validation_metrics/loss"]))
    assert list(steps) == EVALUATED_AT
    # steps 1 and 3 precede the first outer step (issued after step 4, merged after 5): one anchor, the same
    # held-out batches
    assert values[0] == values[1] and values[2] < values[1]
    for step, value in zip(steps, values):
        assert f"validate step: {step:2}  loss: {value:7.4f}" in proc.stdout
    # the evaluations' bytes apart from training's: the check's fingerprints (DiLoCo's anchor needs no R)
    eval_bytes = [v for _, v in sorted(tb["comm/eval_R_sent_bytes_total"])]
    assert eval_bytes[0] > 0 and eval_bytes == [eval_bytes[0] * (i + 1) for i in range(3)]
    r_total = dict(tb["comm/R_sent_bytes_total"])
    assert r_total[8] == dict(diloco_runs[1][2]["comm/R_sent_bytes_total"])[8]
