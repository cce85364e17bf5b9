"""A torchtitan 0.3 user's first hour (issue 35): every value typed is the value used, every mistake
one line (exit status 2), stock configs on a CPU box, one copy of the log.

Skipped unless torchtitan 0.3 is installed (CI's second-line run, ``-m both_lines``). Most checks
parse or build configs in-process; the launches are 2-process runs of 2 steps, through
``python -m titan_commopt.run`` (the documented 0.3 launch: one copy of the log).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.titan_utils import ONLY_ON_03, TT03_CONFIGS

pytestmark = ONLY_ON_03

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE = "titan_commopt.titan.tt03.overrides"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return os.environ.get("TITAN_COMMOPT_CACHE") or str(tmp_path_factory.mktemp("cache"))


def parse(*args: str, config: str = "cpu_debugmodel"):
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", TT03_CONFIGS, "--config", config, *args])


def launch(cache: str, dump: Path, *args: str, nproc: int = 2, module: str = TT03_CONFIGS,
           config: str = "cpu_debugmodel") -> subprocess.CompletedProcess:
    """``python -m titan_commopt.run`` (torchrun that shows one copy of the log) of torchtitan 0.3's
    ``torchtitan.train``; the finished process, not checked."""
    cmd = [sys.executable, "-m", "titan_commopt.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(dump / "rank_logs"), "-m", "torchtitan.train", "--module", module, "--config", config,
           "--dump_folder", str(dump), "--debug.seed", "0", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TITAN_COMMOPT_CACHE": cache}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def r_bytes_per_step(chunk: int) -> float:
    """FlexDeMo's R bytes per step on llama3 debugmodel, 2 replicas, float32 (scripts/comm_report.py)."""
    from scripts import comm_report

    (row,) = comm_report.report("debugmodel", 2, 1, ["FlexDeMo"], {"demo": {"chunk": chunk}}, param_dtype="float32")
    return row["R_sent"]


# ---- 1. a value typed is the value used, even at the family's default ---------------------------
@pytest.mark.parametrize("typed", [["--optimizer.commopt.demo.chunk", "64"], ["--optimizer.commopt.demo.chunk=64"]])
def test_typed_value_at_the_family_default_wins_over_the_preset(typed):
    from titan_commopt.titan.tt03.container import resolve_config

    default = resolve_config(parse().optimizer)
    assert default.options.chunk == 32 and "chunk" in default.preset_keys()  # FlexDeMo's preset
    resolved = resolve_config(parse(*typed).optimizer)
    assert resolved.options.chunk == 64 and "chunk" in resolved.user_set
    assert "  chunk = 64 (set)" in resolved.describe().splitlines()
    assert resolved.options.topk == default.options.topk  # what was not typed: still the preset


def test_typed_boolean_flag_at_the_family_default_wins():
    from titan_commopt.titan.tt03.container import resolve_config

    preset = resolve_config(parse().optimizer).options.sign_before_sync  # FlexDeMo's preset: True
    flag = "--optimizer.commopt.demo.no-sign-before-sync" if preset else "--optimizer.commopt.demo.sign-before-sync"
    resolved = resolve_config(parse(flag).optimizer)
    assert resolved.options.sign_before_sync is (not preset) and "sign_before_sync" in resolved.user_set


def test_override_key_at_the_family_default_wins_over_the_preset():
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.container import resolve_config
    from titan_commopt.titan.tt03.overrides import commopt

    resolved = resolve_config(commopt(default_adamw(), name="FlexDeMo", chunk=64))
    assert resolved.options.chunk == 64 and resolved.user_set == {"chunk"}
    assert resolve_config(commopt(default_adamw(), name="FlexDeMo")).options.chunk == 32


# the Muon names (issue 41): a key each preset sets, typed at its family's default, on both 0.3 routes
MUON_NAMES = [("Muon", "muon", "muon_momentum", "0.95", 0.95), ("MuLoCo", "local", "outer_momentum", "0.9", 0.9),
              ("MuLoCo-2bit", "sparseloco", "outer_momentum", "0.0", 0.0)]


@pytest.mark.parametrize("name, table, key, typed, value", MUON_NAMES, ids=[n[0] for n in MUON_NAMES])
def test_muon_names_typed_value_at_the_family_default_wins_in_the_config_module_and_the_override(
        name, table, key, typed, value):
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.container import resolve_config
    from titan_commopt.titan.tt03.overrides import commopt

    preset = resolve_config(parse("--optimizer.name", name).optimizer)
    assert getattr(preset.options, key) != value and key in preset.preset_keys()
    module = resolve_config(parse("--optimizer.name", name, f"--optimizer.commopt.{table}.{key}", typed).optimizer)
    overridden = resolve_config(commopt(default_adamw(), name=name, **{key: value}))
    for resolved in (module, overridden):
        assert resolved.name == name and getattr(resolved.options, key) == value and key in resolved.user_set
        others = set(resolved.family.presets[name]) - {key}
        assert all(getattr(resolved.options, k) == resolved.family.presets[name][k] for k in others)


@pytest.fixture(scope="module")
def typed_chunk_run(tmp_path_factory, cache):
    dump = tmp_path_factory.mktemp("typed_chunk")
    return launch(cache, dump, "--training.steps", "2", "--optimizer.commopt.demo.chunk", "64")


def test_typed_chunk_is_trained_and_printed_once(typed_chunk_run):
    """The run sends chunk 64's bytes (not the preset's 32), and says so once, at start."""
    proc = typed_chunk_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert r_bytes_per_step(64) != r_bytes_per_step(32)
    sent = [line for line in out.splitlines() if "step:  2" in line and "R sent:" in line]
    assert len(sent) == 1, out[-6000:]  # one copy of the log
    expected = f"R sent: {r_bytes_per_step(64) / 1000:.2f}KB/step"
    assert expected in sent[0], (expected, sent[0])
    assert out.count("titan_commopt optimizer, resolved once for this run:") == 1
    assert out.count("  chunk = 64 (set)") == 1


# ---- 2. the same checks on every route: one line, exit status 2 ----------------------------------
def one_line(capsys, call) -> str:
    """``call()`` stops with exit status 2 and one ``titan_commopt:`` line on stderr: that line."""
    with pytest.raises(SystemExit) as stop:
        call()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("titan_commopt:")]
    assert stop.value.code == 2 and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("args, expected", [
    (["--optimizer.lr", "-0.001"], "--optimizer.lr = -0.001: allowed is a finite number >= 0"),
    (["--optimizer.beta2", "1.5"], "--optimizer.beta2 = 1.5: allowed is a number >= 0 and < 1"),
    (["--optimizer.commopt.demo.sign_before_sync", "false"],
     "--optimizer.commopt.demo.sign_before_sync false: a switch"),
    (["--metrics.enable-tensorboard", "true"], "--metrics.no-enable-tensorboard (false)"),
    (["--optimizer.commopt.local.outer", "adam"], "--optimizer.commopt.local.outer = 'adam': allowed is one of 'average'"),
    (["--optimizer.commopt.local.outer=adam"], "--optimizer.commopt.local.outer = 'adam': allowed is one of"),
])
def test_bad_command_line_value_is_one_line(capsys, args, expected):
    assert expected in one_line(capsys, lambda: parse(*args))


def test_override_negative_lr_is_one_line(capsys):
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.overrides import commopt

    line = one_line(capsys, lambda: commopt(default_adamw(), name="FlexDeMo", lr=-0.001))
    assert f"override {OVERRIDE}.commopt: lr = -0.001: allowed is a finite number >= 0" in line


@pytest.mark.parametrize("args, expected", [
    (["--optimizer.name", "MuLoCo", "--optimizer.commopt.local.muon_ns_steps", "7"],
     "[commopt.local] muon_ns_steps = 7: allowed is 5"),
    (["--optimizer.name", "Muon", "--optimizer.commopt.muon.muon_momentum", "1.0"], "muon_momentum = 1.0"),
    (["--optimizer.name", "MuLoCo-2bit", "--optimizer.commopt.sparseloco.muon_lr_rule", "spectral"],
     "--optimizer.commopt.sparseloco.muon_lr_rule = 'spectral': allowed is one of 'spectral_norm', 'original'"),
])
def test_muon_names_bad_command_line_value_is_one_line(capsys, args, expected):
    assert expected in one_line(capsys, lambda: parse(*args))


@pytest.mark.parametrize("options, expected", [
    ({"name": "MuLoCo", "muon_ns_steps": 7}, "muon_ns_steps = 7"),
    ({"name": "Muon", "muon_dtype": "fp16"}, "muon_dtype = 'fp16'"),
    ({"name": "MuLoCo-2bit", "muon_momentm": 0.9}, "muon_momentm"),
])
def test_muon_names_bad_override_is_one_line(capsys, options, expected):
    from torchtitan.components.optimizer import default_adamw

    from titan_commopt.titan.tt03.overrides import commopt

    assert expected in one_line(capsys, lambda: commopt(default_adamw(), **options))


def test_unknown_config_name_lists_only_config_functions(capsys):
    line = one_line(capsys, lambda: parse(config="cpu_debugmodle"))
    assert "'cpu_debugmodle'" in line and "cpu_debugmodel, cpu_debugmodel_adamw" in line
    assert "apply_cpu_fixes" not in line and "commopt_optimizer" not in line


@pytest.mark.parametrize("helper", ["apply_cpu_fixes", "commopt_optimizer", "with_comm_metrics", "stock"])
def test_a_helper_named_as_config_is_one_line(capsys, helper):
    line = one_line(capsys, lambda: parse(config=helper))
    assert f"--config '{helper}': a helper of titan_commopt.titan.tt03.configs, not a config function" in line
    assert "cpu_debugmodel, cpu_debugmodel_adamw" in line


@pytest.mark.parametrize("args, world_size, expected", [
    ([], 3, "data_parallel_replicate_degree = 2: must divide WORLD_SIZE = 3"),
    (["--parallelism.spmd_backend", "spmd_types"], 2, "spmd_backend = 'spmd_types' with WORLD_SIZE = 2"),
    (["--hf_assets_path", "./tests/assets/tokenizer"], 2, "hf_assets_path = './tests/assets/tokenizer': no such directory"),
    (["--dataloader.dataset_path", "/nonexistent/c4"], 2, "dataloader.dataset_path = '/nonexistent/c4': "),
    (["--override.imports", f"{OVERRIDE}.comopt"], 2, f"--override.imports: override.imports target '{OVERRIDE}.comopt'"),
])
def test_whole_config_problem_is_one_line_before_the_process_group(capsys, monkeypatch, args, world_size, expected):
    import torch.distributed as dist

    from titan_commopt.titan.tt03.preflight import preflight

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    config = parse(*args)
    assert expected in one_line(capsys, lambda: preflight(config))
    assert not dist.is_initialized()


def test_a_damaged_tokenizer_file_is_one_line_before_the_process_group(capsys, monkeypatch, tmp_path):
    """The config module's Trainer reads the tokenizer's files before torchtitan builds it (after the
    process group): a damaged tokenizer.json is one line naming it."""
    import torch.distributed as dist

    from titan_commopt.titan.tt03.preflight import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "tokenizer.json").write_text("{not json")
    line = one_line(capsys, lambda: preflight(parse("--hf_assets_path", str(tmp_path))))
    assert f"hf_assets_path = '{tmp_path}': {tmp_path / 'tokenizer.json'} cannot be read by HuggingFace tokenizers" in line
    assert not dist.is_initialized()


def test_override_refusal_comes_before_the_process_group(capsys):
    from titan_commopt.titan.tt03.preflight import preflight

    config = parse("--override.imports", f"{OVERRIDE}.commopt=" + json.dumps({"name": "FlexDeMo", "lr": -1}),
                   config="cpu_debugmodel_adamw")
    assert "lr = -1: allowed is a finite number >= 0" in one_line(capsys, lambda: preflight(config))


def test_valid_config_passes_the_preflight(monkeypatch):
    from titan_commopt.titan.tt03.preflight import config_problems, override_problems

    config = parse("--override.imports", f"{OVERRIDE}.commopt=" + json.dumps({"name": "DiLoCo", "Kx": 4}),
                   f"{OVERRIDE}.comm_metrics", config="cpu_debugmodel_adamw")
    assert override_problems(config) == [] and config_problems(config, 2) == []
    assert type(config.optimizer).__name__ == "Config" and config.optimizer.param_groups  # the copy took the override


def test_toml_spmd_types_is_refused_not_changed():
    from titan_commopt.options import ConfigError
    from titan_commopt.train import check_config

    toml = str(ROOT / "train_configs" / "debug_cpu.toml")
    with pytest.raises(ConfigError, match=r"spmd_backend = 'spmd_types' with WORLD_SIZE = 2"):
        check_config(["--job.config_file", toml, "--parallelism.spmd_backend", "spmd_types"], 2)
    assert check_config(["--job.config_file", toml, "--parallelism.spmd_backend", "spmd_types"], 1) \
        .trainer_config.parallelism.spmd_backend == "spmd_types"


def test_refusal_through_the_launcher_is_one_line_exit_2(tmp_path, cache):
    """A misspelled override target on 2 processes: the launcher's exit status is 2 and its console
    one line, no traceback, no torchrun failure summary."""
    proc = launch(cache, tmp_path, "--override.imports", f"{OVERRIDE}.comopt")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    assert len([line for line in out.splitlines() if f"'{OVERRIDE}.comopt'" in line]) == 1, out[-4000:]


# ---- 3. a stock config on a CPU box, as README's one-liner (smaller: seq 128 x batch 2, 2 steps) ----
STOCK_ONE_LINER = [  # README.md, "torchtitan 0.3", 3. (the override's JSON adds chunk 64 here)
    "--parallelism.data_parallel_replicate_degree", "2", "--training.steps", "2",
    "--override.imports", f"{OVERRIDE}.commopt=" + json.dumps({"name": "FlexDeMo", "chunk": 64}), f"{OVERRIDE}.comm_metrics",
]


def test_stock_config_trains_on_cpu_with_the_override_as_typed(tmp_path, cache):
    """torchtitan's own ``llama3_debugmodel`` through our config module (CPU fixes before the Trainer,
    the bundled tokenizer and corpus for the ./tests/assets paths this machine lacks) with our
    override: it trains, with the override's chunk 64 (its bytes per step), not the preset's 32."""
    proc = launch(cache, tmp_path, *STOCK_ONE_LINER, "--training.seq_len", "128", "--training.local_batch_size", "2",
                  config="llama3_debugmodel")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"[Override] {OVERRIDE}.commopt" in out
    sent = [line for line in out.splitlines() if "step:  2" in line and "R sent:" in line]
    assert len(sent) == 1 and f"R sent: {r_bytes_per_step(64) / 1000:.2f}KB/step" in sent[0], out[-6000:]
    assert out.count("  chunk = 64 (set)") == 1


# ---- 4. one readable copy of the log ----------------------------------------------------------------
@pytest.mark.parametrize("noise", ["\x1b[", "set_vital", "Peak flops undefined", "lspci", "DTensor random operators",
                                   "CUDA graph capture", "initial_load_model_only"])
def test_the_log_has_no_colour_codes_or_known_cpu_noise(typed_chunk_run, noise):
    out = typed_chunk_run.stdout + typed_chunk_run.stderr
    assert typed_chunk_run.returncode == 0 and noise not in out, out[-4000:]


def test_tensorboard_is_on_and_its_folder_printed(typed_chunk_run, tmp_path_factory):
    out = typed_chunk_run.stdout + typed_chunk_run.stderr
    assert out.count("TensorBoard logging enabled. Logs will be saved at") == 1, out[-4000:]


# ---- 5. --help shows the values the run would use ---------------------------------------------------
def test_help_shows_the_preset_values(capsys):
    from torchtitan.config.manager import ConfigManager

    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", TT03_CONFIGS, "--config", "cpu_debugmodel", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    chunk = out[out.index("--optimizer.commopt.demo.chunk INT"):][:300]
    assert "(default: 32)" in chunk, chunk  # FlexDeMo's preset, not the family's 64


def test_another_name_of_the_family_takes_its_own_preset():
    """The FlexDeMo preset written in for --help is not taken as set: --optimizer.name DeMo runs with
    DeMo's preset and the family's defaults, as a TOML naming DeMo does."""
    from titan_commopt.optim import resolve
    from titan_commopt.titan.tt03.container import resolve_config

    resolved = resolve_config(parse("--optimizer.name", "DeMo").optimizer)
    assert resolved.user_set == frozenset() and resolved.options == resolve("DeMo").options


# ---- 4. the 8B config functions train what the 8B TOMLs train ------------------------------------
EIGHT_B = ("llama3_8b_flexdemo", "llama3_8b_diloco", "llama3_8b_dion", "llama3_8b_des_loc", "llama3_8b_mt_dao",
           "llama3_8b_muon", "llama3_8b_muloco", "llama3_8b_muloco_2bit")


@pytest.mark.parametrize("function", EIGHT_B)
def test_8b_config_function_is_its_toml(function):
    """``--config llama3_8b_<x>`` and ``train_configs/llama3_8b_<x>.toml``: the same optimizer, ``[optimizer]``
    values, warm-up, keys of the family's table and mesh (a value changed in one of them only fails here)."""
    import tomli

    from titan_commopt.titan.tt03 import configs
    from titan_commopt.titan.tt03.container import resolve_config

    assert set(EIGHT_B) == {n for n in configs.CONFIG_FUNCTIONS if n.startswith("llama3_8b_")}
    toml = tomli.loads((ROOT / "train_configs" / f"{function}.toml").read_text())
    cfg = getattr(configs, function)()
    resolved = resolve_config(cfg.optimizer)
    assert resolved.name == toml["optimizer"]["name"]
    for key in ("lr", "weight_decay", "eps"):
        assert getattr(cfg.optimizer, key) == toml["optimizer"][key], key
    assert cfg.lr_scheduler.warmup_steps == toml["lr_scheduler"]["warmup_steps"]
    table = toml["commopt"][resolved.family.key]
    assert table and all(getattr(resolved.options, k) == v for k, v in table.items()), table
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree"):
        assert getattr(cfg.parallelism, key) == toml["parallelism"][key], key
