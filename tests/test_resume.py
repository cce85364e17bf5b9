"""Checkpoint/resume through torchtitan's DCP checkpointing on a 2x2 HSDP mesh (4 CPU processes).

Each optimizer: one uninterrupted 8-step run saving at step 4; the step-8 checkpoint is removed and
the same command resumes from step 4. Steps 5..8 must give exactly the same losses.
"""

import shutil

import pytest

from tests.titan_utils import losses, run_train

STEPS = ["--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
         "--parallelism.data_parallel_replicate_degree", "2", "--model.flavor", "cpu_tiny"]

# One preset per family plus the baseline (each costs two 4-process runs).
CASES = {
    "AdamW": [],
    "FlexDeMo": [],
    "DES-LOC": [],
    "Dion": ["--optimizer.lr", "0.02"],
    # streaming sync with a fragment in flight at the step-4 checkpoint (merged before saving)
    "DES-LOC streaming": ["--commopt.local.Kx", "4", "--commopt.local.Ku", "4", "--commopt.local.Kv", "4",
                          "--commopt.local.fragments", "2", "--commopt.local.sync_delay", "1"],
}


def _saved_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _resume_pair(tmp_path, name, extra):
    name = name.split()[0]
    _, first = run_train(tmp_path, 4, *STEPS, "--optimizer.name", name, *extra)
    if name != "AdamW":  # each replica's state records the resolved options it was trained with
        keys = _saved_keys(tmp_path / "out" / "checkpoint" / "step-4")
        assert {f"optimizer.replica{r}/commopt_resolved" for r in (0, 1)} <= keys
    shutil.rmtree(tmp_path / "out" / "checkpoint" / "step-8")
    shutil.rmtree(tmp_path / "out" / "tb")
    _, second = run_train(tmp_path, 4, *STEPS, "--optimizer.name", name, *extra)
    return losses(first), losses(second)


@pytest.mark.parametrize("name", list(CASES))
def test_resume_equals_uninterrupted(tmp_path, name):
    uninterrupted, resumed = _resume_pair(tmp_path, name, CASES[name])
    assert len(uninterrupted) == 8 and len(resumed) == 4
    assert resumed == uninterrupted[4:]


def test_resume_with_other_replica_count_fails_clearly(tmp_path):
    run_train(tmp_path, 4, *STEPS, "--optimizer.name", "Dion", "--training.steps", "5")
    shutil.rmtree(tmp_path / "out" / "checkpoint" / "step-5")  # model-only (last step): keep step 4
    proc, _ = run_train(
        tmp_path, 4, *STEPS, "--optimizer.name", "Dion", "--parallelism.data_parallel_replicate_degree", "1",
        check=False,
    )
    assert proc.returncode != 0
    assert "holds optimizer state for 2 replicas and this run has 1" in proc.stdout + proc.stderr
