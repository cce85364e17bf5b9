"""torchtitan 0.3 through the plug-in (``titan_commopt/titan/tt03``), on CPU with gloo.

Skipped unless torchtitan 0.3 is installed: the normal suite runs on 0.2.2. Run with the 0.3 venv:
``PYTHONPATH=. OMP_NUM_THREADS=1 /path/to/venv03/bin/python -m pytest -q tests/test_titan03.py``.
One torchrun launch per fixture; the assertions read TensorBoard's event files and the console.
Five launches: the config-module run (FlexDeMo on HSDP 2x2) is the first half of the resume pair,
the override run is FlexDeMo's R2 x TP2 run, and MuLoCo on HSDP 2x2 runs the Muon step through the
config module, its R and S bytes the comm report's, resumed from step 2 exactly (a fifth launch). The resumed run also prints every optimizer step
(``tests/titan03_step_probe.py``, an override that changes nothing). The other families on HSDP 2x2
and R2 x TP2, and AdamW through our container against torchtitan's own, run on this line too, in
``tests/test_titan_optimizers.py`` and ``tests/test_titan_integration.py`` (marked ``both_lines``).
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_commopt.titan.line import installed_version, line_of
from tests.titan_utils import ONLY_ON_03, TT03_CONFIGS, launch_03

if line_of(installed_version()) == "0.3":
    from tests import titan03_step_probe as STEP_PROBE

pytestmark = ONLY_ON_03

ROOT = Path(__file__).resolve().parents[1]
MODULE = TT03_CONFIGS
OVERRIDE = "titan_commopt.titan.tt03.overrides"
MESHES = {  # name: (processes, flags)
    "hsdp_2x2": (4, []),
    "r2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
}
FAMILY_STEPS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return os.environ.get("TITAN_COMMOPT_CACHE") or str(tmp_path_factory.mktemp("cache"))


def train(cache, dump: Path, nproc: int, *args: str, config: str = "cpu_debugmodel", check: bool = True):
    proc = launch_03(cache, dump, nproc, "--metrics.enable_tensorboard", *args, config=config)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def scalars(dump: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for run in sorted((dump / "tb").glob("*")):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: [v for _, v in sorted(values)] for tag, values in out.items()}


def losses(tb: dict) -> list[float]:
    return tb["loss_metrics/global_avg_loss"]


# ---- the config module: FlexDeMo on HSDP 2x2 (each replica its own state), checkpoints -----------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    dump = tmp_path_factory.mktemp("trained")
    proc = train(cache, dump, MESHES["hsdp_2x2"][0], "--checkpoint.enable", "--checkpoint.interval", "2")
    return dump, scalars(dump), proc


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, cache, trained):
    dump = tmp_path_factory.mktemp("resumed")
    shutil.copytree(trained[0] / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    proc = train(cache, dump, MESHES["hsdp_2x2"][0], "--checkpoint.enable", "--checkpoint.interval", "2",
                 "--override.imports", f"{STEP_PROBE.__name__}.show_steps")
    return dump, scalars(dump), proc


def test_config_module_trains(trained):
    values = losses(trained[1])
    assert len(values) == 4 and all(math.isfinite(v) for v in values) and values[-1] < values[0]


@pytest.mark.parametrize("tag", ["comm/R_sent_bytes_total", "comm/world_bytes_total", "comm/R_ratio_vs_adamw_hsdp"])
def test_comm_scalars_reach_tensorboard(trained, tag):
    values = trained[1][tag]
    assert len(values) == 4 and values[-1] > 0
    if tag == "comm/R_ratio_vs_adamw_hsdp":  # FlexDeMo sends far less over R than AdamW-HSDP
        assert values[-1] < 0.5


def test_resolved_options_printed_once_under_plain_torchrun(trained):
    """4 processes, every rank's output: the resolved options once (rank 0), not once per rank."""
    log = trained[2].stdout + trained[2].stderr
    assert log.count("titan_commopt optimizer, resolved once for this run:") == 1


def test_no_step_skipped(trained):
    assert trained[1]["commopt/skipped_steps"] == [0.0] * 4


@pytest.mark.parametrize("tag", ["loss_metrics/global_avg_loss", "grad_norm", "comm/R_sent_bytes_total",
                                 "comm/world_bytes_total"])
def test_resume_is_exact(trained, resumed, tag):
    """Steps 3-4 after loading step 2 equal the uninterrupted run: each replica's optimizer state,
    the counters and the ledger's totals come back, and the load's state initialisation counts no bytes."""
    assert "Loading the checkpoint" in resumed[2].stdout + resumed[2].stderr
    assert resumed[1][tag] == trained[1][tag][2:]


def test_load_runs_no_init_step(resumed):
    """torchtitan's ``init_optim_state`` steps an optimizer whose state is empty (zero gradients, lr 0)
    before the load reads it; FlexDeMo's state exists from construction, so the resumed run's optimizer
    steps are its two training steps on each of the 4 ranks, none with lr 0: nothing sent, nothing
    counted, no step count advanced before step 3."""
    # matched in the whole output, not per line: other ranks' log lines may interleave with a probe line
    steps = re.findall(re.escape(STEP_PROBE.STEP_LINE) + r" (\w+) lr \[([^\]]*)\]", resumed[2].stdout + resumed[2].stderr)
    assert len(steps) == 4 * 2 and all(name == "DeMo" and float(lr.split(",")[0]) > 0 for name, lr in steps), steps


# ---- the @override route on torchtitan's own optimizer config (FlexDeMo's R2 x TP2 run) ----------
@pytest.fixture(scope="module")
def overridden(tmp_path_factory, cache):
    dump = tmp_path_factory.mktemp("override")
    spec = json.dumps({"name": "FlexDeMo", "topk": 16, "lr": 1e-3})
    nproc, flags = MESHES["r2_tp2"]
    proc = train(cache, dump, nproc, "--override.imports", f"{OVERRIDE}.commopt={spec}", f"{OVERRIDE}.comm_metrics",
                 "--training.steps", str(FAMILY_STEPS), *flags, config="cpu_debugmodel_adamw")
    return scalars(dump), proc.stdout + proc.stderr


def test_override_puts_our_optimizer_into_a_stock_config(overridden):
    tb, log = overridden
    assert f"[Override] {OVERRIDE}.commopt" in log
    assert_trained_a_few_steps(tb)
    assert 0 < tb["comm/R_ratio_vs_adamw_hsdp"][-1] < 0.5


def assert_trained_a_few_steps(tb: dict) -> None:
    values = losses(tb)
    assert len(values) == FAMILY_STEPS and all(math.isfinite(v) for v in values) and values[-1] < values[0], values
    assert tb["comm/R_sent_bytes_total"][-1] > 0  # the optimizer synced R itself
    assert tb["commopt/skipped_steps"][-1] == 0


# ---- MuLoCo through the config module: the Muon step on 0.3, its bytes the comm report's -------------
MULOCO_STEPS = 4  # two outer steps (Kx = 2)


MULOCO = ["--optimizer.name", "MuLoCo", "--optimizer.commopt.local.Kx", "2", "--training.steps", str(MULOCO_STEPS),
          "--validator.freq", "2", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def muloco(tmp_path_factory, cache):
    dump = tmp_path_factory.mktemp("muloco")
    proc = train(cache, dump, MESHES["hsdp_2x2"][0], *MULOCO)
    return scalars(dump), proc.stdout + proc.stderr, dump


@pytest.fixture(scope="module")
def muloco_resumed(tmp_path_factory, cache, muloco):
    dump = tmp_path_factory.mktemp("muloco_resumed")
    shutil.copytree(muloco[2] / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    proc = train(cache, dump, MESHES["hsdp_2x2"][0], *MULOCO)
    return scalars(dump), proc.stdout + proc.stderr


def test_muloco_trains_through_the_config_module_with_the_comm_reports_bytes(muloco):
    """HSDP 2 x 2: R (the parameters every Kx) and S (FSDP2's traffic plus the Muon step's whole-matrix
    exchange) per step as ``scripts/comm_report.py`` prices them for this model; the global model (the
    anchor) evaluated."""
    from scripts import comm_report

    tb, log, _ = muloco
    values = losses(tb)
    assert len(values) == MULOCO_STEPS and all(math.isfinite(v) for v in values) and values[-1] < values[0], values
    (row,) = comm_report.report("debugmodel", 2, 2, ["MuLoCo"], {"local": {"Kx": 2}}, param_dtype="float32")
    assert tb["comm/R_sent_bytes_total"][-1] / MULOCO_STEPS == pytest.approx(row["R_sent"], rel=1e-6)
    assert tb["comm/S_bytes_total"][-1] / MULOCO_STEPS == pytest.approx(row["S_sent"], rel=1e-6)
    assert row["S_sent"] > comm_report.report("debugmodel", 2, 2, ["DiLoCo"], {"local": {"Kx": 2}},
                                              param_dtype="float32")[0]["S_sent"]  # the Muon exchange is in it
    assert tb["commopt/skipped_steps"][-1] == 0 and len(tb["validation_metrics/loss"]) >= 2, sorted(tb)
    # what it trained with, printed once: the typed period, the preset's Muon base
    assert log.count("  Kx = 2 (set)") == 1 and log.count("  base = 'muon' (preset)") == 1, log[-4000:]


@pytest.mark.parametrize("tag", ["loss_metrics/global_avg_loss", "grad_norm", "comm/R_sent_bytes_total",
                                 "comm/S_bytes_total"])
def test_muloco_resume_is_exact(muloco, muloco_resumed, tag):
    """Steps 3-4 after loading step 2 (an outer step) equal the uninterrupted run's: each replica's
    parameters, Muon momenta, Adam moments, anchor and outer momentum come back, with the ledger."""
    assert "Loading the checkpoint" in muloco_resumed[1]
    assert muloco_resumed[0][tag] == muloco[0][tag][2:]


# ---- bad input, help, unsupported torchtitan: no process group --------------------------------
def _parse(capsys, *args):
    from torchtitan.config.manager import ConfigManager

    with pytest.raises(SystemExit) as stop:
        ConfigManager().parse_args(["--module", MODULE, "--config", "cpu_debugmodel", *args])
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


def test_help_lists_the_typed_options(capsys):
    code, out, _ = _parse(capsys, "--help")
    assert code == 0
    assert "--optimizer.commopt.demo.topk" in out and "--optimizer.commopt.local.Kx" in out


@pytest.mark.parametrize("args, expected", [
    (["--optimizer.commopt.demo.topk", "0"], "[commopt.demo] topk"),
    (["--optimizer.name", "FlexDemo"], "did you mean 'FlexDeMo'"),
    (["--optimizer.commopt.on_nonfinite", "skip", "--optimizer.commopt.max_consecutive_skips", "-1"],
     "max_consecutive_skips"),
    (["--optimizer.name", "DiLoCo", "--optimizer.commopt.local.outer_wire_dtype", "fp2"],
     "outer_wire_dtype = 'fp2': allowed is one of 'same', 'fp8', 'fp4'"),
])
def test_bad_cli_value_is_one_line_exit_2(capsys, args, expected):
    code, _, err = _parse(capsys, *args)
    lines = [line for line in err.splitlines() if line.startswith("titan_commopt:")]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


@pytest.mark.parametrize("kwargs, expected", [
    ({"name": "FlexDemo"}, "did you mean 'FlexDeMo'"),
    ({"name": "FlexDeMo", "topkk": 3}, "topkk"),
    ({"name": "FlexDeMo", "topk": -1}, "topk"),
])
def test_bad_override_is_one_line_exit_2(capsys, kwargs, expected):
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.overrides import commopt

    with pytest.raises(SystemExit) as stop:
        commopt(default_adamw(), **kwargs)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("titan_commopt:")]
    assert stop.value.code == 2 and len(lines) == 1 and expected in lines[0], err


def test_the_earlier_paths_forward_with_one_line_naming_the_new_one():
    """``--module titan_commopt.titan.v03.configs`` and ``--override.imports titan_commopt.titan.v03.overrides.*``
    (earlier releases' paths) give the same config functions and overrides, after one line each."""
    code = (
        "import titan_commopt.titan.v03.configs as old, titan_commopt.titan.tt03.configs as new\n"
        "assert old.cpu_debugmodel is new.cpu_debugmodel and old.__all__ == new.__all__\n"
        "import titan_commopt.titan.v03.overrides as old_overrides\n"
        "from torchtitan.components.optimizer import default_adamw\n"
        "from torchtitan.config.override import _REGISTRY\n"
        "assert {'titan_commopt.titan.v03.overrides.commopt', 'titan_commopt.titan.v03.overrides.comm_metrics'} <= set(_REGISTRY)\n"
        "config = old_overrides.commopt(default_adamw(), name='Dion', rank=16)\n"
        "print(type(config).__qualname__, config.name, config.commopt.dion.rank)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["CommOptimizers.Config", "Dion", "16"]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("titan_commopt:")]
    assert lines == [
        "titan_commopt: --module titan_commopt.titan.v03.configs is deprecated and will be removed: use "
        "--module titan_commopt.titan.tt03.configs (the same names)",
        "titan_commopt: titan_commopt.titan.v03.overrides is deprecated and will be removed: use "
        "titan_commopt.titan.tt03.overrides (the same names)",
    ], proc.stderr


@pytest.mark.parametrize("version", ["0.4.0", "0.2.1", None])
def test_unsupported_torchtitan_is_one_line_exit_2(version):
    patch = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name != 'torchtitan': return real(name)\n"
        f"    installed = {version!r}\n"
        "    if installed is None: raise m.PackageNotFoundError(name)\n"
        "    return installed\n"
        "m.version = version\n"
        "import titan_commopt.titan\n"
    )
    proc = subprocess.run([sys.executable, "-c", patch], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "0.2.2 or 0.3.x" in lines[0] and (version or "not installed") in lines[0], proc.stderr
