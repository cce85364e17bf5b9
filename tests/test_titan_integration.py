"""torchtitan's Trainer through the plug-in, on CPU with gloo, in real multi-process runs."""

import subprocess
import sys

import pytest

from tests.titan_utils import (
    ADAMW_HSDP, CONFIG, FSDP_TWO, LOSS_LINE, ROOT, assert_ledger_is_the_comm_report, losses, run_train, shared_run,
)


@pytest.mark.both_lines
def test_hsdp_adamw_equals_stock_spec(tmp_path, tmp_path_factory):
    """AdamW through llama3_commopt (our optimizer builder, parallelize wrapper, metrics) gives the
    same losses as torchtitan's stock llama3 spec on a 2x2 HSDP mesh. Ours is test_resume.py's
    uninterrupted AdamW run (8 steps, a checkpoint at step 4; one launch for both files)."""
    _, ours, ours_tb = shared_run(tmp_path_factory, 4, *ADAMW_HSDP)
    _, ref_tb = run_train(tmp_path / "ref", 4, *ADAMW_HSDP, "--model.name", "llama3_reference")
    assert len(losses(ours_tb)) == 8
    assert losses(ours_tb) == losses(ref_tb)  # bit for bit (float32 as TensorBoard stores it)
    assert losses(ours_tb)[-1] < losses(ours_tb)[0]
    # The comm scalars exist and AdamW-HSDP's R figure is the fp32 gradient shard per step.
    r_sent = [v for _, v in ours_tb["comm/R_sent_bytes"]]
    assert r_sent and all(v == r_sent[0] > 0 for v in r_sent)
    assert [v for _, v in ours_tb["comm/R_ratio_vs_adamw_hsdp"]] == [1.0] * 8
    assert ours_tb["comm/R_sent_bytes_total"][-1][1] == pytest.approx(8 * r_sent[0])
    assert ours_tb["comm/S_bytes"][-1][1] > 0
    assert_ledger_is_the_comm_report(ours_tb, "AdamW", 8)
    # The console shows R bytes next to the loss.
    assert len(LOSS_LINE.findall(ours.stdout)) == 8


@pytest.mark.both_lines
def test_fsdp_two_processes_trains(tmp_path_factory):
    _, proc, tb = shared_run(tmp_path_factory, 2, *FSDP_TWO)
    values = losses(tb)
    assert len(values) == 8 and values[-1] < values[0] - 0.5
    assert "R_ratio" not in " ".join(tb)  # one replica: nothing to compare on R
    assert [v for _, v in tb["comm/R_sent_bytes"]] == [0.0] * 8


def _train_cli(*args, config=CONFIG):
    return subprocess.run(
        [sys.executable, "-m", "titan_commopt.train", "--job.config_file", str(config), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.both_lines
def test_unknown_optimizer_name_fails_before_any_collective():
    # No torchrun, no RANK/MASTER_ADDR: if anything tried to init a process group it would hang or fail differently.
    proc = _train_cli("--optimizer.name", "Adamm")
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if "[optimizer] name" in l]
    assert len(lines) == 1
    assert "'Adamm'" in lines[0] and "AdamW" in lines[0]


@pytest.mark.both_lines
def test_unknown_commopt_key_did_you_mean(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.read_text() + "\nhsdp_estimate = false\n")
    proc = _train_cli(config=bad)
    assert proc.returncode == 2
    assert "unknown key 'hsdp_estimate'; did you mean 'hsdp_estimates'?" in proc.stderr
