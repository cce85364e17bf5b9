"""Our 0.2.2 TOML on torchtitan 0.3 (``titan/tt03_toml/toml_config.py``, ``titan/tt03_toml/runner.py``): every
shipped TOML becomes a valid 0.3 ``Trainer.Config`` without a process group, command-line overrides
work as on 0.2.2, a key with no 0.3 counterpart is one line and exit status 2, and the README's
quickstart TOML trains on two processes."""

from importlib import metadata
from pathlib import Path

import pytest
import tomli

from tests.titan_utils import CONFIG, FSDP_TWO, ROOT, losses, shared_run


def _torchtitan_line() -> str:
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return "none"


pytestmark = [
    pytest.mark.skipif(
        not _torchtitan_line().startswith("0.3."),
        reason=f"needs torchtitan 0.3 (installed: {_torchtitan_line()}); run it in the 0.3 venv",
    ),
    pytest.mark.both_lines,  # CI's second-line run (-m both_lines) is where it runs when 0.2.2 is the default
]

CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))


def _check(*args, world_size=None):
    from titan_commopt.train import check_config

    return check_config(list(args), world_size)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_toml_converts(path):
    from torchtitan.trainer import Trainer

    toml = tomli.loads(path.read_text())
    args = ["--job.config_file", str(path)]
    if not Path(toml["model"]["hf_assets_path"]).exists() and toml["model"]["hf_assets_path"] != "bundled":
        args += ["--model.hf_assets_path", "bundled"]  # the 8B configs name a tokenizer users download
    run = _check(*args)
    cfg = run.trainer_config
    assert isinstance(cfg, Trainer.Config) and run.warnings == []
    training, parallelism = toml["training"], toml["parallelism"]
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (
        training["steps"], training["seq_len"], training["local_batch_size"])
    assert (cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree) == (
        parallelism["data_parallel_replicate_degree"], parallelism["data_parallel_shard_degree"])
    assert cfg.model_spec.flavor == toml["model"]["flavor"]
    assert cfg.dump_folder == toml["job"]["dump_folder"]
    assert cfg.metrics.enable_tensorboard == toml["metrics"]["enable_tensorboard"]
    assert cfg.checkpoint.enable == toml["checkpoint"]["enable"]
    assert cfg.lr_scheduler.warmup_steps == toml["lr_scheduler"]["warmup_steps"]
    assert (cfg.activation_checkpoint is None) == (toml["activation_checkpoint"]["mode"] == "none")
    assert getattr(cfg.optimizer, "name", None) == toml["optimizer"]["name"]
    # a key the TOML leaves out means its 0.2.2 default, not 0.3 debugmodel's
    if "decay_ratio" not in toml["lr_scheduler"]:
        assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.parallelism.spmd_backend == "partial_dtensor"  # DTensors as on 0.2.2, not 0.3's spmd_types


def test_overrides_as_on_022():
    run = _check("--job.config_file", str(CONFIG), "--training.steps", "3", "--checkpoint.enable", "true",
                 "--training.steps=7", "--metrics.no-enable_tensorboard", "--optimizer.name", "DeMo",
                 "--commopt.demo.chunk", "32")
    cfg = run.trainer_config
    assert cfg.training.steps == 7  # the last occurrence wins
    assert cfg.checkpoint.enable and not cfg.metrics.enable_tensorboard
    assert cfg.optimizer.name == "DeMo" and cfg.optimizer.commopt.demo.chunk == 32
    assert run.resolved.options.chunk == 32


def test_a_key_set_at_its_default_beats_the_preset_in_the_container(tmp_path):
    """FlexDeMo's preset signs before the sync; a TOML that says false at the family default keeps
    false in the optimizer 0.3 builds, as on 0.2.2."""
    from titan_commopt.titan.tt03.container import resolve_config

    config = tmp_path / "my.toml"
    config.write_text(CONFIG.read_text() + "\n[commopt.demo]\nsign_before_sync = false\n")
    run = _check("--job.config_file", str(config), "--optimizer.name", "FlexDeMo")
    assert run.resolved.options.sign_before_sync is False
    assert resolve_config(run.trainer_config.optimizer).options == run.resolved.options


GONE = {  # where the key is set → (arguments after the config file, the key the line names)
    "toml": ([], "[checkpoint] enable_ft_dataloader_checkpoints"),
    "command line": (["--parallelism.expert_tensor_parallel_degree", "2"], "[parallelism] expert_tensor_parallel_degree"),
    # a value with no counterpart: 0.2.2's default layer-wise selective AC ("2")
    "value": (["--activation_checkpoint.mode", "selective"], "[activation_checkpoint] selective_ac_option = '2'"),
}


@pytest.mark.parametrize("where", list(GONE))
def test_key_without_counterpart_is_one_line_exit_2(tmp_path, capsys, where):
    from titan_commopt.train import main

    config = CONFIG
    if where == "toml":
        config = tmp_path / "bad.toml"
        config.write_text(CONFIG.read_text().replace("[checkpoint]\n", "[checkpoint]\nenable_ft_dataloader_checkpoints = false\n"))
    extra, key = GONE[where]
    with pytest.raises(SystemExit) as info:
        main(["--job.config_file", str(config), *extra])
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "titan_commopt: bad config" in line]
    assert len(lines) == 1 and "no torchtitan 0.3 counterpart" in lines[0] and key in lines[0]


def test_quickstart_toml_trains_on_two_processes(tmp_path_factory):
    """The launch of test_titan_integration.py's test_fsdp_two_processes_trains (8 steps; one launch for both)."""
    _, proc, tb = shared_run(tmp_path_factory, 2, *FSDP_TWO)
    values = losses(tb)
    assert len(values) == 8 and values[-1] < values[0]
    assert "loss:" in proc.stdout
    assert any(tag.startswith("comm/") for tag in tb)  # the ledger's bytes reach TensorBoard
