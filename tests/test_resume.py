"""Checkpoint/resume through torchtitan's DCP checkpointing on a 2x2 HSDP mesh (4 CPU processes).

Each optimizer: one uninterrupted 8-step run saving at step 4; the same command resumes from a copy
of the step-4 checkpoint in a fresh dump folder. Steps 5..8 must give exactly the same losses, and the
same cumulative bytes (the comm ledger's totals travel with the checkpoint). The uninterrupted runs of
FlexDeMo, Dion, MuLoCo and MuLoCo-2bit are ``tests/test_titan_optimizers.py``'s HSDP launches (one launch
per session).
"""

import shutil

import pytest

from tests.titan_utils import ADAMW_HSDP, RESUMABLE, RESUMED, hsdp_args, hsdp_run, losses, run_train, shared_run

# One preset per family plus the baseline (each costs two 4-process runs); the local-adaptive family's
# is DES-LOC with periods short enough to sync within the run, streaming, a fragment in flight, and
# DiLoCo with eager outer steps, a whole period's sync in flight.
# FlexDeMo, Dion, MuLoCo and MuLoCo-2bit run with test_titan_optimizers.py's HSDP arguments (its launch is the
# first run).
CASES = {
    "AdamW": [],
    "FlexDeMo": None,
    "Dion": None,
    # per-replica Muon momenta, anchors, outer momenta (and MuLoCo-2bit's error feedback), a sync at step 4
    "MuLoCo": None,
    "MuLoCo-2bit": None,
    # streaming sync with a fragment in flight at the step-4 checkpoint (merged before saving), on the FP4
    # outer wire: averaging then keeps an anchor per replica, the pseudo-gradients' codes are all-gathered
    "DES-LOC streaming fp4": ["--commopt.local.Kx", "4", "--commopt.local.Ku", "4", "--commopt.local.Kv", "4",
                              "--commopt.local.fragments", "2", "--commopt.local.sync_delay", "1",
                              "--commopt.local.outer_wire_dtype", "fp4"],
    # eager overlapped outer steps: step 3's sync in flight at the step-4 checkpoint (its mean saved, not
    # applied), applied at step 6 from the loaded state: losses 7 and 8 see it
    "DiLoCo eager": ["--commopt.local.Kx", "3", "--commopt.local.merge", "eager", "--commopt.local.sync_delay", "0"],
}


def _saved_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _args(name, extra):
    if name == "AdamW":
        return ADAMW_HSDP  # also test_titan_integration.py's run through our container (one launch)
    if name in RESUMED:
        return hsdp_args(name)
    return [*RESUMABLE, "--optimizer.name", name.split()[0], *extra]


def _resume_pair(tmp_path, tmp_path_factory, args):
    """The uninterrupted run (launched once per session) and the same command resumed from its step-4
    checkpoint, copied into ``tmp_path``."""
    dump, _, first = shared_run(tmp_path_factory, 4, *args)
    if "AdamW" not in args:  # each replica's state records the resolved options it was trained with
        keys = _saved_keys(dump / "checkpoint" / "step-4")
        assert {f"optimizer.replica{r}/commopt_resolved" for r in (0, 1)} <= keys
    shutil.copytree(dump / "checkpoint" / "step-4", tmp_path / "out" / "checkpoint" / "step-4")
    _, second = run_train(tmp_path, 4, *args)
    return first, second


# Dion on both lines: its first run is test_titan_optimizers.py's HSDP launch, also both_lines (FlexDeMo's
# resume on 0.3 is test_titan03.py's test_resume_is_exact).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.both_lines) if n == "Dion" else n for n in CASES])
def test_resume_equals_uninterrupted(tmp_path, tmp_path_factory, name):
    first, second = _resume_pair(tmp_path, tmp_path_factory, _args(name, CASES[name]))
    uninterrupted, resumed = losses(first), losses(second)
    assert len(uninterrupted) == 8 and len(resumed) == 4
    assert resumed == uninterrupted[4:]
    # comm/R_sent_bytes_total continues from the checkpoint's total instead of restarting at zero
    total = "comm/R_sent_bytes_total"
    assert sorted(second[total]) == sorted(first[total])[4:]
    assert sorted(first[total])[3][1] > 0


def test_resume_with_other_replica_count_fails_clearly(tmp_path, tmp_path_factory):
    """A refused resume: one line, printed once (rank 0), exit status 2 on every rank, no traceback.
    The checkpoint: step 4 of the Dion HSDP run (2 replicas x 2 shards); resumed on 2 processes with 1
    replica, the dataloader state (per data-parallel rank) left out so that the replicas are what differs."""
    dump, _, _ = hsdp_run(tmp_path_factory, "Dion")
    shutil.copytree(dump / "checkpoint" / "step-4", tmp_path / "out" / "checkpoint" / "step-4")
    one = ["--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4", "--model.flavor", "cpu_tiny",
           "--optimizer.name", "Dion", "--optimizer.lr", "0.02", "--parallelism.data_parallel_replicate_degree", "1",
           "--checkpoint.exclude_from_loading", "dataloader"]
    proc, _ = run_train(tmp_path, 2, *one, check=False, all_ranks=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "titan_commopt: cannot resume" in line]
    printed = [line for line in lines if line.startswith("[rank")]
    assert len(printed) == 1 and printed[0].startswith("[rank0]:"), lines
    assert "holds optimizer state for 2 replicas and this run has 1" in printed[0]
    assert "failed (exitcode: 2)" in out  # torchrun's summary of the first worker to exit
    # ... which shows the line too (the workers' error files), instead of "To enable traceback see"
    assert any(line.strip().startswith("traceback : titan_commopt: cannot resume") for line in lines), out[-3000:]
    assert "titan_commopt/titan" not in out  # no traceback through our code


# ---- resume checks on small hand-made checkpoints (no processes) -------------------------------
def _job(dump, name, load_step=-1, exclude=(), initial_load_path=None):
    from types import SimpleNamespace

    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(dump)),
        checkpoint=SimpleNamespace(
            enable=True, folder="checkpoint", load_step=load_step, exclude_from_loading=list(exclude),
            initial_load_path=initial_load_path,
        ),
        optimizer=SimpleNamespace(name=name),
    )


def _save(dump, step, name, replicas=2, dp=2, drop=(), **options):
    """A checkpoint as our container writes it: per-replica state and the resolved record."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from titan_commopt.optim import resolve

    record = json.dumps({**resolve(name, options).record(), "replicas": replicas}, sort_keys=True)
    state = {}
    for r in range(replicas):
        state[f"optimizer.replica{r}/commopt_resolved"] = record
        state[f"optimizer.replica{r}/state.w.exp_avg"] = torch.arange(1000.0)
    state["model.w"] = torch.ones(1000)
    # what torchtitan saves besides (its dataloader: one entry per data-parallel rank)
    state.update({"lr_scheduler.last_epoch": torch.tensor(step), "train_state.step": torch.tensor(step),
                  "dataloader.world_size": torch.tensor(dp)})
    state.update({f"dataloader.dp_rank_{r}": torch.zeros(4) for r in range(dp)})
    for name_ in drop:
        state = {k: v for k, v in state.items() if not k.startswith(name_ + ".")}
    path = dump / "checkpoint" / f"step-{step}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


REFUSED = [
    # (saved name, saved options, resumed name, resumed options, what the line must name)
    ("FlexDeMo", {}, "DES-LOC", {}, "it holds the state of 'FlexDeMo' ([commopt.demo]), another family"),
    ("FlexDeMo", {}, "DeMo", {"base": "adamw"}, "[commopt.demo] base = sgd in the checkpoint, adamw in this run"),
    ("Dion", {"rank": 8}, "Dion", {"rank": 16}, "[commopt.dion] rank = 8 in the checkpoint, 16 in this run"),
    ("Dion", {}, "Dion", {"scalar_optimizer": "lion"},
     "[commopt.dion] scalar_optimizer = adamw in the checkpoint, lion"),
    ("DES-LOC", {}, "DES-LOC", {"Ku": [96, 192], "beta1": [0.9, 0.99], "omega": [0.5, 0.5]},
     "[commopt.local] Ku (number of first momenta) = 1 in the checkpoint, 2 in this run"),
    ("DES-LOC", {}, "DiLoCo", {}, "[commopt.local] outer = average in the checkpoint, nesterov in this run"),
    ("DES-LOC", {}, "MT-DAO", {}, "[commopt.local] base = adam in the checkpoint, adopt in this run"),
    ("LocalAdam", {}, "LocalAdam", {"Kx": 1, "Ku": [1], "Kv": 1},
     "[commopt.local] Kx = not 1 (parameters kept per replica) in the checkpoint, 1 in this run"),
    ("LocalAdam", {}, "LocalAdam", {"outer_wire_dtype": "fp4"},  # averaging keeps an anchor for the FP4 wire
     "[commopt.local] outer_wire_dtype = same in the checkpoint, fp4 in this run"),
]


@pytest.mark.parametrize("saved_name,saved_options,name,options,expected", REFUSED)
def test_resume_with_state_shaping_change_is_refused_naming_it(
    tmp_path, saved_name, saved_options, name, options, expected
):
    from titan_commopt.optim import resolve
    from titan_commopt.titan.config.resume import resume_problem

    path = _save(tmp_path, 2, saved_name, **saved_options)
    problem = resume_problem(_job(tmp_path, name), resolve(name, options), 2)
    assert problem is not None and "\n" not in problem
    assert expected in problem, problem
    assert str(path) in problem and 'exclude_from_loading = ["optimizer"]' in problem
    # the escape hatch it names works: the optimizer is not loaded, nothing to fit
    assert resume_problem(_job(tmp_path, name, exclude=["optimizer"]), resolve(name, options), 2) is None


def test_resume_with_options_that_do_not_shape_state_is_allowed_and_logged(tmp_path, caplog):
    from titan_commopt.optim import BaseHParams, resolve
    from titan_commopt.titan.config.resume import resume_problem

    _save(tmp_path, 2, "DES-LOC", lr_scale=1.0)  # lr_scale pinned: the lrs below are the [optimizer] ones
    resolved = resolve("DES-LOC", {"Kx": 64, "Ku": [128], "lr_scale": 1.0}, BaseHParams(lr=1e-2))
    with caplog.at_level("INFO"):
        assert resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2) is None
    from titan_commopt.optim.local.adaptive import PRESETS

    preset = PRESETS["DES-LOC"]
    assert f"[commopt.local] Ku {preset['Ku']} -> [128], Kx {preset['Kx']} -> 64" in caplog.text
    assert "lr / lr_scale) = 0.01 in this run, 0.0008" in caplog.text  # the scheduler keeps the saved lr
    _save(tmp_path, 4, "FlexDeMo")
    with caplog.at_level("INFO"):
        assert resume_problem(_job(tmp_path, "DeMo"), resolve("DeMo"), 2) is None
    assert "resuming 'FlexDeMo' state as 'DeMo'" in caplog.text and "chunk 32 -> 64" in caplog.text


def test_damaged_or_incomplete_checkpoints_are_named(tmp_path, caplog):
    from titan_commopt.optim import resolve
    from titan_commopt.titan.config.resume import checkpoint_to_load, resume_problem

    resolved = resolve("DES-LOC")
    step2 = _save(tmp_path, 2, "DES-LOC")
    step4 = _save(tmp_path, 4, "DES-LOC")
    (step4 / ".metadata").unlink()  # a save that did not finish: DCP writes .metadata last
    with caplog.at_level("INFO"):
        assert checkpoint_to_load(_job(tmp_path, "DES-LOC")) == str(step2)
    assert "skipping checkpoint folder(s) step-4: no .metadata" in caplog.text
    assert "step-4 has no .metadata" in resume_problem(_job(tmp_path, "DES-LOC", load_step=4), resolved, 2)

    data = next(step2.glob("*.distcp"))
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    problem = resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2)
    assert f"{data} is truncated: {size // 2} bytes" in problem and "\n" not in problem
    data.unlink()
    assert f"{data} is missing" in resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2)
    (step2 / ".metadata").write_bytes(b"\x80\x04garbage")
    problem = resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2)
    assert f"{step2 / '.metadata'} is not a readable DCP metadata file" in problem
    (step2 / ".metadata").write_bytes(b"")
    assert f"{step2 / '.metadata'} is empty or truncated" in resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2)


# Replicas x tensor parallelism: per-replica state and DES-LOC's replica-local parameters (no sync
# within 8 steps at its preset's Kx = 32) are TP-sharded DTensors. (FlexDeMo resumed the same way when
# tried; one family keeps the suite short.)
TP = ["--parallelism.tensor_parallel_degree", "2"]


def test_resume_equals_uninterrupted_with_tp(tmp_path, tmp_path_factory):
    first, second = _resume_pair(tmp_path, tmp_path_factory, _args("DES-LOC", TP))
    uninterrupted, resumed = losses(first), losses(second)
    assert len(uninterrupted) == 8 and len(resumed) == 4
    assert resumed == uninterrupted[4:]


def test_what_torchtitan_would_fail_on_inside_dcp_is_named(tmp_path):
    """A load_step with no folder, a model-only (last step) checkpoint, dataloader state for another
    data-parallel degree: one line each, with the way back (the escape hatch it names works)."""
    from titan_commopt.optim import resolve
    from titan_commopt.titan.config.resume import resume_problem

    resolved = resolve("DES-LOC")
    missing = tmp_path / "checkpoint"
    assert resume_problem(_job(tmp_path, "DES-LOC", load_step=6), resolved, 2) == (
        f"[checkpoint] load_step = 6: {missing} does not exist; complete checkpoints: none (load_step = -1: the newest)"
    )
    assert resume_problem(_job(tmp_path, "DES-LOC", load_step=6, initial_load_path="/x"), resolved, 2) is None
    _save(tmp_path, 2, "DES-LOC")
    assert resume_problem(_job(tmp_path, "DES-LOC", load_step=6), resolved, 2) == (
        f"[checkpoint] load_step = 6: {missing} has no step-6; complete checkpoints: step-2 (load_step = -1: the newest)"
    )
    assert resume_problem(_job(tmp_path, "DES-LOC", load_step=2), resolved, 2, dp_degree=2) is None

    last = _save(tmp_path, 4, "DES-LOC", drop=("optimizer", "lr_scheduler", "dataloader", "train_state"))
    problem = resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2, dp_degree=2)
    assert problem.startswith(f"cannot resume from {last}: it holds no optimizer, lr_scheduler, dataloader, "
                              "train_state state (only the model") and "\n" not in problem
    assert "last_save_model_only = true" in problem and "load_step" in problem
    hatch = ["optimizer", "lr_scheduler", "dataloader", "train_state"]
    assert 'exclude_from_loading = ["optimizer", "lr_scheduler", "dataloader", "train_state"]' in problem
    assert resume_problem(_job(tmp_path, "DES-LOC", exclude=hatch), resolved, 2, dp_degree=2) is None
    assert resume_problem(_job(tmp_path, "DES-LOC", load_step=2), resolved, 2, dp_degree=2) is None

    (last / ".metadata").unlink()
    problem = resume_problem(_job(tmp_path, "DES-LOC"), resolved, 2, dp_degree=4)
    assert "dataloader state is for a data-parallel degree" in problem and "of 2 and this run has 4" in problem
    assert resume_problem(_job(tmp_path, "DES-LOC", exclude=["dataloader"]), resolved, 2, dp_degree=4) is None


def _launch(tmp_path, nproc, *args):
    """``python -m titan_commopt.run`` as a user runs it: every rank's console, as the user sees it."""
    import os
    import subprocess
    import sys

    from tests.titan_utils import CONFIG, ROOT

    cmd = [sys.executable, "-m", "titan_commopt.run", f"--nproc_per_node={nproc}", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "-m", "titan_commopt.train", "--job.config_file", str(CONFIG),
           "--job.dump_folder", str(tmp_path / "out"), "--model.flavor", "cpu_tiny", "--metrics.log_freq", "1",
           "--parallelism.data_parallel_replicate_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
           "--optimizer.name", "FlexDeMo", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TITAN_COMMOPT_TRACEBACK", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _last_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_refused_resumes_end_the_launchers_output_and_the_shard_degree_may_change(tmp_path, tmp_path_factory):
    """Through titan_commopt.run: a refused resume is the last line, once, exit status 2, no
    traceback (torchrun's failure summary replaced); 2 replicas × 2 shards → 2 × 1 resumes once the
    dataloader state (per data-parallel rank, not reshardable) is left out. The checkpoints: the
    FlexDeMo HSDP run's (2 replicas x 2 shards, 8 steps: step-4, and step-8 model-only as the last step)."""
    dump, _, _ = hsdp_run(tmp_path_factory, "FlexDeMo")
    checkpoint = tmp_path / "out" / "checkpoint"
    shutil.copytree(dump / "checkpoint", checkpoint)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step-4", "step-8"]

    def refused(*args: str) -> str:
        proc = _launch(tmp_path, 2, "--training.steps", "9", *args)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out[-3000:]
        line = _last_line(proc)
        assert line.startswith("titan_commopt: ") and out.count(line) == 1, out[-3000:]
        assert "Traceback" not in out and "ChildFailedError" not in out
        return line

    # the last step's checkpoint is model-only (torchtitan's default): named, not a DCP missing-key traceback
    # (every other refusal's line is checked without a launch, by resume_problem, above)
    assert "step-8: it holds no optimizer, lr_scheduler, dataloader, train_state state" in refused()
    shutil.rmtree(checkpoint / "step-8")
    assert "dataloader state is for a data-parallel degree" in refused()
    proc = _launch(tmp_path, 2, "--training.steps", "5", "--checkpoint.exclude_from_loading", "dataloader")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Training starts at step 5" in proc.stdout + proc.stderr
