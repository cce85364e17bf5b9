"""torchtitan 0.3's validator on the global model (``titan_commopt/titan/tt03/validate.py``).

- one real run through our config module (DiLoCo, llama3 debugmodel, 2 replicas x 2 FSDP shards, an
  outer step every 3 steps, an evaluation after steps 1, 2 and 4) against the same run without
  evaluations: the same training losses, ``validation_metrics/loss`` at those steps in TensorBoard with
  the evaluations' own bytes, torchtitan's ``validate step:`` line, and the same loss after steps 1 and
  2 (DiLoCo's anchor, unchanged until the first outer step: the same model on the same batches);
- the three ways our validator comes in (config module, TOML runner, ``@override``) and its settings'
  checks, without a launch.
"""

import os
from pathlib import Path

import pytest

from tests.titan_utils import CONFIG, ONLY_ON_03, launch_03

pytestmark = ONLY_ON_03

DILOCO = ["--optimizer.name", "DiLoCo", "--optimizer.commopt.local.Kx", "3", "--training.steps", "4",
          "--metrics.log_freq", "1", "--optimizer.commopt.local.fragments", "1"]  # the preset's τ = 1, one fragment
EVALUATED_AT = [1, 2, 4]  # after step 1 and every freq = 2 steps


def _scalars(dump: Path) -> dict:
    """{tag: [(step, value), ...]} in step order."""
    from tests.titan_utils import read_scalars

    return {tag: sorted(values) for tag, values in read_scalars(dump).items()}


def _values(tb: dict, tag: str) -> list[float]:
    return [v for _, v in tb[tag]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = os.environ.get("TITAN_COMMOPT_CACHE") or str(tmp_path_factory.mktemp("cache"))
    out = []
    for label, flags in (("with", ["--validator.freq", "2"]), ("without", ["--validator.no-enable"])):
        dump = tmp_path_factory.mktemp(label)
        proc = launch_03(cache, dump, 4, *DILOCO, *flags)
        assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])
        out.append((proc, _scalars(dump)))
    return out


def test_evaluating_the_global_model_leaves_training_as_it_was(runs):
    (_, tb), (_, tb_without) = runs
    assert tb["loss_metrics/global_avg_loss"] == tb_without["loss_metrics/global_avg_loss"]
    assert len(tb["loss_metrics/global_avg_loss"]) == 4 and "validation_metrics/loss" not in tb_without


def test_validation_loss_at_the_expected_steps_on_the_same_held_out_batches(runs):
    (proc, tb), (_, tb_without) = runs
    steps, values = zip(*tb["validation_metrics/loss"])
    assert list(steps) == EVALUATED_AT
    assert values[0] == values[1] and values[2] < values[1]  # one anchor before the outer step of step 3
    for step, value in zip(EVALUATED_AT, values):
        assert f"validate step: {step:2}  loss: {value:7.4f}" in proc.stdout + proc.stderr
    eval_bytes = _values(tb, "comm/eval_R_sent_bytes_total")
    assert eval_bytes[0] > 0 and eval_bytes == [eval_bytes[0] * (i + 1) for i in range(3)]
    assert _values(tb, "comm/R_sent_bytes_total")[-1] == _values(tb_without, "comm/R_sent_bytes_total")[-1]


# ---- how it comes in, and its checks (no launch) ---------------------------------------------------
def test_every_route_builds_our_validator():
    from torchtitan.components.validate import Validator

    from titan_commopt.corpora import VERSIONS
    from titan_commopt.titan.tt03 import configs, overrides
    from titan_commopt.titan.tt03.validate import GlobalModelValidator
    from titan_commopt.train import check_config

    cpu = configs.cpu_debugmodel()
    assert isinstance(cpu.validator, GlobalModelValidator.Config) and cpu.validator.enable
    assert cpu.validator.dataloader.dataset_path.endswith(f"json_dataset_commopt_tiny_heldout_v{VERSIONS['commopt_tiny_heldout']}")
    assert isinstance(configs.llama3_8b_diloco().validator, GlobalModelValidator.Config)
    toml = check_config(["--job.config_file", str(CONFIG)]).trainer_config.validator
    assert isinstance(toml, GlobalModelValidator.Config) and (toml.enable, toml.freq, toml.steps) == (True, 20, 4)
    assert toml.dataloader.dataset == "commopt_tiny_heldout"
    stock = Validator.Config(enable=True, freq=7, steps=3)
    derived = overrides.global_model_validation(stock)
    assert isinstance(derived, GlobalModelValidator.Config) and (derived.freq, derived.steps) == (7, 3)


@pytest.mark.parametrize("kwargs, line", [
    (dict(steps=-1), "--validator.steps -1: allowed is an integer >= 1"),
    (dict(steps=4, freq=0), "--validator.freq 0: allowed is an integer >= 1"),
])
def test_bad_validator_settings_are_one_line(kwargs, line):
    from titan_commopt.titan.platform.stop import RunStopped
    from titan_commopt.titan.tt03.validate import GlobalModelValidator

    with pytest.raises(RunStopped) as info:
        GlobalModelValidator.Config(enable=True, **kwargs)
    assert info.value.message.startswith(line) and "\n" not in info.value.message and info.value.status == 2
    GlobalModelValidator.Config(enable=False, **kwargs)  # off: not checked


def test_the_toml_runner_takes_validation_batches_of_trainings_shape_only():
    from titan_commopt.options import ConfigError
    from titan_commopt.train import check_config

    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), "--validation.seq_len", "64"])
    assert str(info.value) == ("[validation] seq_len = 64: torchtitan 0.3's validator reads batches of [training] "
                               "seq_len = 128; allowed is 128 (or [validation] enable = false)")


def test_fault_tolerance_refuses_validation_that_needs_the_mean_over_replicas(monkeypatch):
    from torchtitan.config.manager import ConfigManager

    from titan_commopt.titan.tt03.preflight import fault_tolerance_problems
    from tests.titan_utils import TT03_CONFIGS

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    flags = ["--parallelism.data_parallel_replicate_degree", "1", "--fault_tolerance.enable",
             "--fault_tolerance.group_size", "2"]

    def parse(*args: str):
        return ConfigManager().parse_args(["--module", TT03_CONFIGS, "--config", "cpu_debugmodel", *flags, *args])

    (line,) = fault_tolerance_problems(parse("--optimizer.name", "DES-LOC"))
    assert line.startswith("--validator.enable with --optimizer.name DES-LOC under --fault_tolerance.enable: its "
                           "global model between syncs is the mean"), line
    assert line.endswith("set --validator.no-enable, or train a family with an anchor (DiLoCo, SparseLoCo) or a "
                         "per-step one")
    assert fault_tolerance_problems(parse("--optimizer.name", "DES-LOC", "--validator.no-enable")) == []
    assert fault_tolerance_problems(parse("--optimizer.name", "DiLoCo")) == []


def test_a_validator_on_the_training_data_is_one_warning():
    from titan_commopt.titan.tt03 import configs
    from titan_commopt.titan.tt03.validate import validating_on_training_text

    cfg = configs.cpu_debugmodel()
    assert validating_on_training_text(cfg) == []  # the held-out twin
    cfg.validator.dataloader.dataset_path = cfg.dataloader.dataset_path
    (line,) = validating_on_training_text(cfg)
    assert line.startswith("--validator.dataloader.dataset c4_test is the training dataset (dataset_path ")
