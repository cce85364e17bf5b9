"""The resume check on torchtitan 0.3 (``titan/config/resume.py``, run by the 0.3 container before any
optimizer is built): 0.3's checkpoint layout is the one the check reads, and a resume that cannot
work is refused with one line, exit status 2.

One short run (Dion, 2 replicas, our config module) writes a real 0.3 checkpoint; the check is
called on it directly with the settings each way of launching makes (config module + command line,
``@override``, our TOML), and one launch shows the refusal end to end. That a resume with the same
settings resumes exactly is ``test_titan03.py``'s ``test_resume_is_exact``.
"""

import os
import subprocess
from pathlib import Path

import pytest

from tests.titan_utils import ONLY_ON_03, TT03_CONFIGS, launch_03

pytestmark = ONLY_ON_03

ROOT = Path(__file__).resolve().parents[1]
MODULE = TT03_CONFIGS
RUN = ["--optimizer.name", "Dion", "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
RANK = 8  # Dion's rank in the saved run: it shapes the state (P and R per matrix)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return os.environ.get("TITAN_COMMOPT_CACHE") or str(tmp_path_factory.mktemp("cache"))


def _launch(cache: str, dump: Path, *args: str) -> subprocess.CompletedProcess:
    return launch_03(cache, dump, 2, *RUN, *args)


@pytest.fixture(scope="module")
def dump(tmp_path_factory, cache):
    """A 0.3 run's dump folder: Dion (rank 8), R = 2, checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("saved")
    proc = _launch(cache, out, "--optimizer.commopt.dion.rank", str(RANK))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def _config(dump: Path, *args: str):
    """The ``Trainer.Config`` our config module and 0.3's command line make (no process group)."""
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(
        ["--module", MODULE, "--config", "cpu_debugmodel", "--dump_folder", str(dump), *RUN, *args])


def _problem(config, replicas: int = 2, dp_degree: int = 2, spelling=None):
    from titan_commopt.titan.config.checkpoint import CLI
    from titan_commopt.titan.config.resume import resume_problem
    from titan_commopt.titan.tt03.container import checkpoint_settings, resolve_config

    settings = checkpoint_settings(config, config.optimizer.name, spelling or CLI)
    return resume_problem(settings, resolve_config(config.optimizer), replicas, dp_degree)


def test_a_load_step_naming_no_checkpoint_is_refused_before_the_process_group(tmp_path, capsys, monkeypatch):
    """Our config module's Trainer checks ``--checkpoint.load_step`` before torchtitan's ``__init__``
    starts the process group: one line, exit status 2, in the command line's spelling."""
    import torch.distributed as dist

    from titan_commopt.titan.tt03.preflight import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "checkpoint" / "step-1" / ".metadata").parent.mkdir(parents=True)
    with pytest.raises(SystemExit) as stop:
        preflight(_config(tmp_path, "--checkpoint.load_step", "5"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("titan_commopt:")]
    assert stop.value.code == 2 and not dist.is_initialized()
    assert lines == [f"titan_commopt: --checkpoint.load_step 5: {tmp_path / 'checkpoint'} has no step-5; complete "
                     "checkpoints: none (--checkpoint.load_step -1: the newest)"], lines


def test_the_checkpoint_is_laid_out_as_the_check_reads_it(dump):
    from titan_commopt.titan.config.resume import checkpoint_to_load, read_metadata, read_record, saved_replicas
    from titan_commopt.titan.tt03.container import checkpoint_settings

    config = _config(dump)
    step2 = dump / "checkpoint" / "step-2"
    assert checkpoint_to_load(checkpoint_settings(config, "Dion")) == str(step2)
    metadata = read_metadata(str(step2))
    keys = metadata.state_dict_metadata
    assert saved_replicas(keys) == 2
    for state in ("lr_scheduler", "train_state", "dataloader"):
        assert any(k.startswith(state + ".") for k in keys), state
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(keys)
    record = read_record(str(step2), metadata)
    assert record["optimizer"] == "Dion" and record["state_shape"]["rank"] == RANK


def test_the_same_settings_pass(dump):
    assert _problem(_config(dump, "--optimizer.commopt.dion.rank", str(RANK))) is None


def test_another_dion_rank_is_refused_naming_it(dump):
    config = _config(dump, "--optimizer.commopt.dion.rank", "16")
    problem = _problem(config)
    assert problem is not None and "\n" not in problem
    step2 = dump / "checkpoint" / "step-2"
    assert problem.startswith(f"cannot resume --optimizer.name Dion from {step2}: --optimizer.commopt.dion.rank 8 "
                              "in the checkpoint, 16 in this run"), problem
    assert problem.endswith("resume with --optimizer.commopt.dion.rank 8, or load only the model: "
                            "--checkpoint.exclude_from_loading optimizer"), problem
    # the way back it names works
    assert _problem(_config(dump, "--optimizer.commopt.dion.rank", "16",
                            "--checkpoint.exclude_from_loading", "optimizer")) is None


@pytest.mark.parametrize("args, replicas, expected", [
    ([], 1, "it holds optimizer state for 2 replicas and this run has 1"),
    (["--optimizer.name", "AdamW"], 2, "it holds the per-replica state of 'Dion' for 2 replicas"),
    (["--optimizer.name", "DES-LOC"], 2, "it holds the state of 'Dion' (--optimizer.commopt.dion.*), another family"),
    (["--checkpoint.load_step", "3"], 2, "--checkpoint.load_step 3: "),
])
def test_what_else_does_not_fit_is_refused(dump, args, replicas, expected):
    problem = _problem(_config(dump, "--optimizer.commopt.dion.rank", str(RANK), *args), replicas=replicas)
    assert problem is not None and expected in problem and "\n" not in problem, problem


def test_the_override_and_the_toml_are_checked_alike(dump):
    """The settings an ``@override`` run and our TOML runner hand the check (the TOML runner's
    refusals name the TOML's keys)."""
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.building import spelling_of
    from titan_commopt.titan.tt03.overrides import commopt
    from titan_commopt.titan.tt03_toml.runner import TomlTrainer
    from titan_commopt.train import check_config

    config = _config(dump)
    config.optimizer = commopt(default_adamw(), name="Dion", rank=16)
    assert "--optimizer.commopt.dion.rank 8 in the checkpoint, 16" in _problem(config)

    toml = check_config(["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"),
                         "--job.dump_folder", str(dump), "--checkpoint.enable", "true", "--optimizer.name", "Dion",
                         "--commopt.dion.rank", "16"], 2)
    problem = _problem(toml.trainer_config, spelling=spelling_of(TomlTrainer))  # the TOML runner's Trainer
    assert "cannot resume [optimizer] name = 'Dion'" in problem, problem
    assert "[commopt.dion] rank = 8 in the checkpoint, 16 in this run" in problem, problem


def test_a_refused_resume_is_one_line_exit_2(dump, cache, tmp_path):
    """Through 0.3's own entry point under torchrun: rank 0 prints the line once, the workers exit
    with status 2 (torchrun's failure summary quotes the line), nothing is loaded, no traceback
    through our code."""
    import shutil

    shutil.copytree(dump / "checkpoint", tmp_path / "checkpoint")
    proc = _launch(cache, tmp_path, "--optimizer.commopt.dion.rank", "16")
    out = proc.stdout + proc.stderr
    printed = [line for line in out.splitlines() if line.startswith("titan_commopt: cannot resume")]
    assert len(printed) == 1, out[-4000:]
    assert "--optimizer.commopt.dion.rank 8 in the checkpoint, 16 in this run" in printed[0]
    assert proc.returncode != 0 and "exitcode  : 2" in out, out[-4000:]
    assert "Loading the checkpoint" not in out  # refused before torchtitan loads anything
    assert "titan_commopt/titan" not in out
