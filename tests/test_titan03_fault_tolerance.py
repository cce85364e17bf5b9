"""Live fault tolerance on torchtitan 0.3 (``titan/tt03/replica_group_trainer.py``), on both 0.3 routes: our
TOML (``[fault_tolerance]``, as on 0.2.2) and the config module (torchtitan's torchft experiment's
``--fault_tolerance.*``).

Skipped unless torchtitan 0.3 is installed (CI's second-line run, ``-m both_lines``). The config checks
and the pieces 0.3 needs of its own run in-process; two live runs, each torchft's lighthouse and two
replica groups of one process: FlexDeMo from our TOML, and torchtitan's own AdamW from the config
module (the baseline: torchtitan's optimizer in our container, FSDP's gradient all-reduce over the
quorum). The lighthouse asks for both groups (``--min_replicas 2``), so both train every step together.
Killed and healed groups are tested on 0.2.2 (``tests/test_fault_tolerance_live.py``); the runtime is the
same code (``titan/common/replica_group_training.py``, ``titan/common/replica_group.py``).
"""

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.titan_utils import CONFIG, ONLY_ON_03, ROOT, TT03_CONFIGS

pytestmark = ONLY_ON_03

LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")
FINGERPRINT = re.compile(r"fault tolerance: replica group (\d+), rank (\d+): parameters at step (\d+): fingerprint (\w+)")
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")
PREFIX = "titan_commopt:"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The bundled tokenizer and corpus, built here once (not by both groups of a run at once)."""
    from titan_commopt.titan.tt03.assets import dataset_dir, tokenizer_dir

    path = os.environ.get("TITAN_COMMOPT_CACHE") or str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TITAN_COMMOPT_CACHE", path)
        tokenizer_dir(), dataset_dir()
    return path


def parse(*args: str, config: str = "cpu_debugmodel"):
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", TT03_CONFIGS, "--config", config, *args])


def refusal(capsys, call) -> list[str]:
    """``call()`` stops with exit status 2 before any process group: its ``titan_commopt:`` lines."""
    import torch.distributed as dist

    with pytest.raises(SystemExit) as stop:
        call()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and not dist.is_initialized(), err
    return [line for line in err.splitlines() if line.startswith(PREFIX)]


# ---- how a 0.3 user spells it ---------------------------------------------------------------------------
def test_toml_fault_tolerance_keys_become_torchtitans_torchft_config(tmp_path, monkeypatch):
    from torchtitan.experiments.torchft.manager import TorchFTManager

    from titan_commopt.train import check_config

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    config = tmp_path / "ft.toml"
    config.write_text(CONFIG.read_text() + "\n[fault_tolerance]\nenable = true\nreplica_id = 1\ngroup_size = 3\n")
    ft = check_config(["--job.config_file", str(config), "--fault_tolerance.min_replica_size", "2",
                       "--optimizer.name", "FlexDeMo"], 2).trainer_config.fault_tolerance
    assert isinstance(ft, TorchFTManager.Config)
    assert (ft.enable, ft.replica_id, ft.group_size, ft.min_replica_size, ft.process_group) == (True, 1, 3, 2, "gloo")
    assert check_config(["--job.config_file", str(CONFIG)], 2).trainer_config.fault_tolerance.enable is False


def test_config_module_takes_torchtitans_torchft_flags():
    from torchtitan.experiments.torchft.manager import TorchFTManager

    ft = parse("--fault_tolerance.enable", "--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2",
               "--fault_tolerance.process_group_timeout_ms", "20000").fault_tolerance
    assert isinstance(ft, TorchFTManager.Config)
    assert (ft.enable, ft.replica_id, ft.group_size, ft.process_group_timeout_ms) == (True, 1, 2, 20000)
    assert parse().fault_tolerance.enable is False


def test_the_commopt_ft_keys_reach_the_runtime_from_flags_and_overrides():
    """``[commopt] ft_*`` (the stall timeout, the start wait) as the run builds its optimizer: typed,
    or in an override's JSON (applied by torchtitan only after the Manager starts); torchtitan's own
    optimizer config: the defaults."""
    import json

    from titan_commopt.titan.config.section import CommOpt
    from titan_commopt.titan.tt03.replica_group_trainer import commopt_section

    assert commopt_section(parse("--optimizer.commopt.ft_stall_timeout_s", "5")).ft_stall_timeout_s == 5
    stock = parse(config="cpu_debugmodel_adamw")
    assert commopt_section(stock).ft_stall_timeout_s == CommOpt().ft_stall_timeout_s
    override = json.dumps({"name": "FlexDeMo", "ft_start_wait_s": 7})
    overridden = parse("--override.imports", f"titan_commopt.titan.tt03.overrides.commopt={override}",
                       config="cpu_debugmodel_adamw")
    assert commopt_section(overridden).ft_start_wait_s == 7


# ---- bad input: one line each, exit status 2, before any process group -------------------------------
TOML_BAD = [  # arguments after the TOML, with TORCHFT_LIGHTHOUSE unset → the start of each line expected
    (["--fault_tolerance.enable"], ["[fault_tolerance] group_size = 0: with [fault_tolerance] enable = true",
                                    "[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE is not set"]),
    (["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2",
      "--parallelism.data_parallel_replicate_degree", "2"],
     ["[fault_tolerance] replica_id = 2: must be in 0..1",
      "[parallelism] data_parallel_replicate_degree = 2: with [fault_tolerance] enable = true",
      "[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE is not set"]),
]


@pytest.mark.parametrize("args, expected", TOML_BAD, ids=["unset", "mesh"])
def test_bad_toml_fault_tolerance_is_one_line_each(capsys, monkeypatch, args, expected):
    from titan_commopt.train import main

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    lines = refusal(capsys, lambda: main(["--job.config_file", str(CONFIG), *args]))
    assert len(lines) == len(expected), lines
    for start in expected:
        assert sum(f"bad config: {start}" in line for line in lines) == 1, (start, lines)


def test_toml_eager_merge_with_an_evaluation_is_refused(capsys, monkeypatch):
    """A sync in flight across steps runs under fault tolerance (a transaction of its own); an eager
    merge's global model, the mean of the groups' anchors, cannot be evaluated there."""
    from titan_commopt.train import main

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    (line,) = refusal(capsys, lambda: main([
        "--job.config_file", str(CONFIG), "--optimizer.name", "DiLoCo", "--commopt.local.merge", "eager",
        "--commopt.local.sync_delay", "0", "--validation.enable", "true", "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]))
    assert ("[validation] enable = true with [optimizer] name = 'DiLoCo' under [fault_tolerance] enable = true: its "
            "global model between syncs is the mean of the replica groups' anchors") in line


CLI_BAD = [  # config module arguments → the start of each line expected (in 0.3's command-line spelling)
    ([], ["--fault_tolerance.group_size 0: with --fault_tolerance.enable",
          "--parallelism.data_parallel_replicate_degree 2: with --fault_tolerance.enable",
          "--fault_tolerance.enable: TORCHFT_LIGHTHOUSE is not set"]),
    (["--parallelism.data_parallel_replicate_degree", "1", "--fault_tolerance.group_size", "2",
      "--fault_tolerance.semi_sync_method", "diloco"],
     ["--fault_tolerance.semi_sync_method diloco: torchft's own DiLoCo/LocalSGD", "use --optimizer.name DiLoCo",
      "--fault_tolerance.enable: TORCHFT_LIGHTHOUSE is not set"]),
]


@pytest.mark.parametrize("args, expected", CLI_BAD, ids=["unset", "semi_sync"])
def test_bad_fault_tolerance_flags_are_one_line_each_before_the_process_group(capsys, monkeypatch, args, expected):
    from titan_commopt.titan.tt03.preflight import preflight

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse("--fault_tolerance.enable", *args)
    lines = refusal(capsys, lambda: preflight(config))
    expected_lines = [e for e in expected if e.startswith("--")]
    assert len(lines) == len(expected_lines), lines
    for piece in expected:
        assert sum(piece in line for line in lines) == 1, (piece, lines)


def test_optimizer_that_cannot_commit_with_the_quorum_is_refused(monkeypatch):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from titan_commopt.titan.tt03.preflight import fault_tolerance_problems

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    flags = ("--parallelism.data_parallel_replicate_degree", "1", "--fault_tolerance.enable",
             "--fault_tolerance.group_size", "2")
    assert fault_tolerance_problems(parse(*flags, "--optimizer.name", "DeMo", "--optimizer.commopt.demo.overlap")) == []
    eager = parse(*flags, "--optimizer.name", "DiLoCo", "--optimizer.commopt.local.merge", "eager",
                  "--optimizer.commopt.local.sync_delay", "0")
    (line,) = fault_tolerance_problems(eager)
    assert line.startswith("--validator.enable with --optimizer.name DiLoCo under --fault_tolerance.enable: its global "
                           "model between syncs is the mean of the replica groups' anchors"), line
    assert line.endswith("set --validator.no-enable, or set --optimizer.commopt.local.merge delayed"), line
    muon = parse(*flags, config="cpu_debugmodel_adamw")
    muon.optimizer = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="DistMuon")])
    (line,) = fault_tolerance_problems(muon)
    assert line.startswith("--fault_tolerance.enable with the optimizer config OptimizersContainer.Config (DistMuon)")
    assert fault_tolerance_problems(parse(*flags, config="cpu_debugmodel_adamw")) == []  # AdamW: in our container
    assert fault_tolerance_problems(parse(*flags)) == []


def test_our_optimizer_under_torchtitans_own_torchft_trainer_is_refused(capsys):
    """torchtitan's ``FaultTolerantTrainer`` averages gradients over the groups and brackets only its
    own container's step: our container, built there, stops with one line."""
    from titan_commopt.titan.tt03.container import CommOptimizers

    trainer = SimpleNamespace(ft_manager=SimpleNamespace(enabled=True))
    (line,) = refusal(capsys, lambda: CommOptimizers._check_fault_tolerance(trainer))
    assert "torchtitan's torchft Trainer (FaultTolerantTrainer)" in line
    CommOptimizers._check_fault_tolerance(SimpleNamespace(ft_manager=SimpleNamespace(enabled=False)))


# ---- what 0.3 needs of its own ----------------------------------------------------------------------------
def test_group_shard_builds_the_groups_part_of_the_data():
    """0.3's Trainer builds its dataloader with the group's own data-parallel degree and rank: the
    config :func:`group_shard` makes builds group 1 of 3's part instead (torchtitan's rule)."""
    from torchtitan.config import Configurable

    from titan_commopt.titan.common.replica_group_training import ReplicaGroupTraining
    from titan_commopt.titan.config.fault_tolerance_keys import FtSettings
    from titan_commopt.titan.tt03.replica_group_trainer import group_shard

    class Loader(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            path: str = ""

        def __init__(self, config, *, dp_world_size, dp_rank, seq_len):
            self.config, self.shard, self.seq_len = config, (dp_world_size, dp_rank), seq_len

    ft = ReplicaGroupTraining(FtSettings(enable=True, replica_id=1, group_size=3), commopt=None)
    shard = group_shard(Loader.Config(path="corpus"), ft)
    assert isinstance(shard, Loader.Config) and shard.path == "corpus"
    built = shard.build(dp_world_size=2, dp_rank=1, seq_len=8)
    assert isinstance(built, Loader) and built.shard == (6, 3) and built.seq_len == 8
    assert built.config.path == "corpus"


def test_torchtitans_own_adamw_runs_in_our_container_under_fault_tolerance():
    from titan_commopt.titan.tt03.container import CommOptimizers
    from titan_commopt.titan.tt03.replica_group_trainer import committing_optimizer

    stock = parse(config="cpu_debugmodel_adamw").optimizer
    ours = committing_optimizer(stock)
    assert isinstance(ours, CommOptimizers.Config) and ours.name == "AdamW" and not ours.syncs_replicate
    assert ours.param_groups == stock.param_groups and ours.implementation == stock.implementation
    flexdemo = parse().optimizer
    assert committing_optimizer(flexdemo) is flexdemo


def test_a_step_that_did_not_commit_is_not_logged():
    """0.3 asks ``should_log`` before the step: the step is dropped from the log once it is known not
    to have committed (its retry, which commits, is logged)."""
    from titan_commopt.titan.common.metrics import CommMetrics
    from titan_commopt.titan.common.container import CommOptimizersContainer

    logged = []

    class Processor:
        def should_log(self, step):
            return True

        def log(self, step, *args, **kwargs):
            logged.append(step)

    class Metrics(CommMetrics, Processor):
        pass

    metrics = Metrics()
    metrics._start_comm_log(10)
    metrics.optimizers = CommOptimizersContainer.__new__(CommOptimizersContainer)
    metrics.optimizers.committed = False
    assert metrics.should_log(3)  # asked before the step: it may commit
    metrics.log(3, 1.0, 1.0, 1.0)
    assert logged == []


def test_the_container_is_handed_the_groups_fault_tolerance_in_its_config():
    """No walk up the call stack: the Trainer puts its fault tolerance into the optimizer config
    (``carrying``), which the container is built from; an override that makes ours of another
    optimizer config (``derive``) keeps it; it stays out of the logged config."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config.override import derive

    from titan_commopt.titan.tt03.container import CommOptimizers
    from titan_commopt.titan.tt03.overrides import commopt
    from titan_commopt.titan.tt03.replica_group_trainer import carrying, committing_optimizer

    ft = object()
    ours = carrying(committing_optimizer(parse(config="cpu_debugmodel_adamw").optimizer), ft)
    assert isinstance(ours, CommOptimizers.Config) and ours._replica_group is ft
    assert "_replica_group" not in ours.to_dict()
    assert commopt(ours, name="FlexDeMo")._replica_group is ft
    muon = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="DistMuon")])
    carried = carrying(muon, ft)
    assert isinstance(carried, OptimizersContainer.Config) and type(carried).__qualname__ == "OptimizersContainer.Config"
    assert carried.param_groups == muon.param_groups and "_replica_group" not in carried.to_dict()
    assert derive(carried, CommOptimizers.Config, name="FlexDeMo")._replica_group is ft


# ---- live: a lighthouse and two replica groups ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_groups(cache: str, tmp: Path, group_args) -> list[str]:
    """torchft's lighthouse (waiting for both groups) and one launch per replica group
    (``group_args(k)``: its arguments after ``python -m titan_commopt.run ... -m``); each group's
    console once all finished (every one must exit 0)."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", "2", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
         "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TITAN_COMMOPT_CACHE": cache,
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    groups = []
    try:
        for k in range(2):
            log = open(tmp / f"group{k}.log", "w")
            cmd = [sys.executable, "-m", "titan_commopt.run", "--standalone", "--nproc_per_node=1",
                   "--log-dir", str(tmp / f"rank_logs{k}"), "-m", *group_args(k)]
            groups.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        deadline = time.monotonic() + 600
        codes = [g.wait(timeout=max(deadline - time.monotonic(), 1)) for g in groups]
    finally:
        for proc in [*groups, lighthouse]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outs = [(tmp / f"group{k}.log").read_text() for k in range(2)]
    assert codes == [0, 0], "\n".join(f"--- group {k} (exit {c}) ---\n{o[-5000:]}" for k, (c, o) in enumerate(zip(codes, outs)))
    return outs


def fingerprints(outs: list[str]) -> list[tuple[str, ...]]:
    return [tuple(m.groups()) for out in outs for m in FINGERPRINT.finditer(out)]


def steps(out: str) -> list[tuple[int, float, float]]:
    return [(int(s), float(loss), float(norm)) for s, loss, norm in STEP_LINE.findall(out)]


def group_losses(dump: Path, k: int) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = glob.glob(str(dump / "tb" / "*" / f"replica_{k}"))  # each group's own TensorBoard folder
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss_metrics/global_avg_loss")]


TOML_STEPS = 4


def test_toml_flexdemo_two_groups_train_in_step(tmp_path, cache):
    """Our TOML on 0.3 with ``[fault_tolerance]`` as on 0.2.2: FlexDeMo over two replica groups. Both
    finish with the same parameters; each read its own part of the data, logged every step once in
    its own TensorBoard folder and checkpointed into its own folder."""
    def toml_group(k: int) -> list[str]:
        return ["titan_commopt.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path / f"out{k}"),
                "--optimizer.name", "FlexDeMo", "--training.steps", str(TOML_STEPS), "--metrics.log_freq", "1",
                "--metrics.disable_color_printing", "--checkpoint.enable", "true", "--checkpoint.interval", str(TOML_STEPS),
                "--commopt.check_replicas_every", "2",
                "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(k), "--fault_tolerance.group_size", "2"]

    outs = run_groups(cache, tmp_path, toml_group)
    prints = fingerprints(outs)
    assert [p[:3] for p in prints] == [("0", "0", str(TOML_STEPS)), ("1", "0", str(TOML_STEPS))], prints
    assert prints[0][3] == prints[1][3], prints
    for k, out in enumerate(outs):
        assert f"quorum of 2 replica group(s), replica group {k} is replica {k} (step 0)" in out, out[-4000:]
        assert "not committed" not in out, out[-4000:]
        assert (tmp_path / f"out{k}" / "checkpoint" / f"replica_{k}" / f"step-{TOML_STEPS}" / ".metadata").exists()
    losses = [group_losses(tmp_path / f"out{k}", k) for k in range(2)]
    assert [[s for s, _ in ls] for ls in losses] == [list(range(1, TOML_STEPS + 1))] * 2, losses
    assert losses[0][0][1] != losses[1][0][1]  # the same weights at step 1, another part of the data


def test_config_module_adamw_baseline_two_groups(tmp_path, cache):
    """The config module with torchtitan's own AdamW (``cpu_debugmodel_adamw``) and torchtitan's torchft
    flags: every step's gradient is averaged over the quorum (the same grad_norm in both groups), and
    both finish with the same parameters."""
    def module_group(k: int) -> list[str]:
        return ["torchtitan.train", "--module", TT03_CONFIGS, "--config", "cpu_debugmodel_adamw",
                "--dump_folder", str(tmp_path / f"out{k}"), "--training.steps", "3", "--training.seq_len", "128",
                "--training.local_batch_size", "2", "--metrics.log_freq", "1",
                "--parallelism.data_parallel_replicate_degree", "1",
                "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(k), "--fault_tolerance.group_size", "2"]

    outs = run_groups(cache, tmp_path, module_group)
    prints = fingerprints(outs)
    assert len(prints) == 2 and prints[0][3] == prints[1][3] and {p[2] for p in prints} == {"3"}, prints
    logged = [steps(out) for out in outs]
    assert [s for s, _, _ in logged[0]] == [1, 2, 3] == [s for s, _, _ in logged[1]], logged
    assert [n for _, _, n in logged[0]] == [n for _, _, n in logged[1]], logged  # the quorum's mean gradient
