"""Run ``titan_commopt.train`` under torchrun on CPU and read back what it logged; the launches the
torchtitan tests share (one launch per session serves several files), and the optimizer names they
launch, derived from the registry."""

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_commopt.titan.line import installed_version, line_of

ROOT = Path(__file__).resolve().parents[1]

# The marks of a file that tests the torchtitan 0.3 line: skipped on 0.2.2, run by CI's second-line
# run (-m both_lines), where 0.2.2 is the default line.
ONLY_ON_03 = [
    pytest.mark.skipif(
        line_of(installed_version()) != "0.3",
        reason=f"torchtitan 0.3 is not installed (found {installed_version()}); this file tests the 0.3 line",
    ),
    pytest.mark.both_lines,
]
TT03_CONFIGS = "titan_commopt.titan.tt03.configs"  # our 0.3 config module


def launch_03(cache: str, dump: Path, nproc: int, *args: str, config: str = "cpu_debugmodel") -> subprocess.CompletedProcess:
    """torchtitan 0.3's ``torchtitan.train`` with our config module on ``nproc`` CPU processes (seed 0,
    one thread each, the bundled assets cached in ``cache``); the finished process, not checked."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "torchtitan.train", "--module", TT03_CONFIGS, "--config", config, "--dump_folder", str(dump),
           "--debug.seed", "0", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TITAN_COMMOPT_CACHE": cache}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
LINE = line_of(installed_version())  # the installed torchtitan line: "0.2" or "0.3"
# Rank 0's console once tensor parallelism is applied. 0.3 logs no line of its own for it (its llama3
# parallelize applies TP exactly when the mesh has tp > 1): its mesh line stands in.
TP_APPLIED = re.compile({"0.2": r"Applied Tensor Parallelism",
                         "0.3": r"Building device mesh with parallelism: .*\btp=([2-9]|\d\d)"}[LINE])


def run_train(tmp_path, nproc: int, *overrides: str, timeout: int = 600, check: bool = True, all_ranks: bool = False):
    """Launch a short run; returns (completed process, {tag: [(step, value), ...]} from TensorBoard).
    The output is rank 0's unless ``all_ranks``."""
    dump = Path(tmp_path) / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        *([] if all_ranks else ["--local-ranks-filter", "0"]), "--role", "rank", "--tee", "3",
        "--log-dir", str(Path(tmp_path) / "rank_logs"),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
        "-m", "titan_commopt.train", "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"training failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
            + ("" if all_ranks else other_ranks_stderr(Path(tmp_path) / "rank_logs"))
        )
    return proc, read_scalars(dump)


_SHARED_RUNS: dict = {}


def shared_run(tmp_path_factory, nproc: int, *overrides: str):
    """:func:`run_train`'s result for these arguments, launched once per test session (the first test
    that asks launches it): tests that check different things of one run share its launch. Returns
    (dump folder, completed process, scalars); the dump folder is read-only to the tests."""
    key = (nproc, overrides)
    if key not in _SHARED_RUNS:
        tmp = tmp_path_factory.mktemp("shared_run")
        _SHARED_RUNS[key] = (tmp / "out", *run_train(tmp, nproc, *overrides))
    return _SHARED_RUNS[key]


def assert_ledger_is_the_comm_report(tb: dict, name: str, steps: int, overrides=None) -> None:
    """The R and S bytes per step a 2 x 2 HSDP run of cpu_tiny logged (``tb``, from :func:`run_train`)
    equal ``scripts/comm_report.py``'s formulas for that mesh (float32 parameters, as debug_cpu.toml; the
    model's shapes as the installed torchtitan line builds them)."""
    import pytest

    from scripts import comm_report

    (row,) = comm_report.report("cpu_tiny", 2, 2, [name], overrides, param_dtype="float32")
    r_total = tb["comm/R_sent_bytes_total"][-1]
    assert r_total[0] == steps and r_total[1] > 0
    assert r_total[1] / steps == pytest.approx(row["R_sent"], rel=1e-6)
    assert tb["comm/R_recv_bytes_total"][-1][1] / steps == pytest.approx(row["R_recv"], rel=1e-6)
    s_per_step = tb["comm/S_bytes_total"][-1][1] / steps
    if name == "Dion":  # + its own S collectives (distributed orthogonalization): ledger-only, not priced
        assert s_per_step > row["S_sent"]
    else:
        assert s_per_step == pytest.approx(row["S_sent"], rel=1e-6)


def other_ranks_stderr(log_dir: Path, chars: int = 3000) -> str:
    """The end of every rank's but rank 0's stderr (torchrun's ``--log-dir`` files): the console
    shows rank 0 alone, and a failure on another rank is otherwise invisible."""
    out = []
    for path in sorted(log_dir.glob("**/stderr.log")):
        if path.parent.name != "0":
            out.append(f"\n--- {path.relative_to(log_dir)} ---\n{path.read_text(errors='replace')[-chars:]}")
    return "".join(out)


def read_scalars(dump: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for run in sorted(glob.glob(str(dump / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def read_texts(dump: Path) -> dict:
    """TensorBoard text entries: {tag: [text, ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for run in sorted(glob.glob(str(Path(dump) / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            out.setdefault(tag, []).extend(e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag))
    return out


def losses(scalars: dict) -> list[float]:
    return [v for _, v in sorted(scalars["loss_metrics/global_avg_loss"])]


LOSS_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+R sent:")


def readme_toml() -> str:
    """The README's example TOML (its first ```toml block)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```toml\n") + len("```toml\n")
    return text[start: text.index("```", start)]


def job_and_resolved(*args, **kwargs):
    """``check_config``'s run, as its parsed job config and resolved optimizer."""
    from titan_commopt.train import check_config

    run = check_config(*args, **kwargs)
    return run.job_config, run.resolved


# ---- the optimizer names the torchtitan tests launch -------------------------------------------------
# Every registered name runs through torchtitan on a 2x2 HSDP mesh and on 2 replicas x TP 2 (4 CPU
# processes each; a launch costs ~15 s of CI), except where said here: a name whose code path another
# name of its family and base step already runs on both meshes (COVERED_BY: they differ in numbers
# only, which the equivalence tests check), and names run on one mesh only (ONLY_ON). A new family's
# names need no entry. On torchtitan 0.3 (CI's -m both_lines run) one name per family runs on each
# mesh: what differs between the lines is the plug-in, which every name of a family goes through alike.
COVERED_BY = {"DES-LOC-ADOPT": "MT-DAO", "MT-DAO-halflife": "MT-DAO"}
# MuLoCo and MuLoCo-2bit: their families' R paths run on both meshes by other names, and the Muon step
# on both by Muon; on HSDP, the layout of the users they are for, their bytes are held to the formulas.
ONLY_ON = {"DES-LOC": "hsdp", "LocalAdam": "tp", "DiLoCo": "tp", "MuLoCo": "hsdp", "MuLoCo-2bit": "hsdp"}


def _launched_names() -> list[str]:
    from titan_commopt.optim import available_names, owns_replicate_sync

    return [n for n in available_names() if owns_replicate_sync(n) and n not in COVERED_BY]


HSDP_NAMES = [n for n in _launched_names() if ONLY_ON.get(n, "hsdp") == "hsdp"]
TP_NAMES = [n for n in _launched_names() if ONLY_ON.get(n, "tp") == "tp"]


def _one_per_family() -> set[str]:
    from titan_commopt.optim import family_of

    first: dict[str, str] = {}
    for name in HSDP_NAMES:
        if name in TP_NAMES:
            first.setdefault(family_of(name).key, name)
    return set(first.values())


BOTH_LINES_NAMES = _one_per_family()  # (FlexDeMo on 0.3: test_titan03.py)

# ---- the HSDP launch of each name (tests/test_titan_optimizers.py; resumed by tests/test_resume.py) ----
HSDP_STEPS = 8
LR = {"Dion": "0.02", "DeMo": "0.003", "FlexDeMo": "0.003"}  # [optimizer] lr (default 0.003)
# Sync periods short enough that every kind of sync happens within HSDP_STEPS (a multiple of every
# period, so the R bytes per step equal the comm report's period average).
EXTRA = {
    "DES-LOC": {"local": {"Kx": 2, "Ku": [4], "Kv": 8}},
    "MT-DAO": {"local": {"Kx": 4, "Ku": [4], "Kv": 4}},
    "SparseLoCo": {"sparseloco": {"H": 4}},
    "MuLoCo": {"local": {"Kx": 4}},
    "MuLoCo-2bit": {"sparseloco": {"H": 4}},
}
# tests/test_resume.py resumes these names' HSDP runs from their step-4 checkpoint instead of launching
# uninterrupted runs of its own (saving a checkpoint sends nothing over R or S, so the HSDP checks hold
# on it unchanged).
RESUMED = {"FlexDeMo", "Dion", "MuLoCo", "MuLoCo-2bit"}


def hsdp_args(name: str) -> list[str]:
    """The HSDP run's arguments for ``name`` (4 processes, 2 replicas x 2 shards)."""
    from scripts._bench_common import cli_overrides

    return ["--training.steps", str(HSDP_STEPS), "--parallelism.data_parallel_replicate_degree", "2",
            "--model.flavor", "cpu_tiny", "--optimizer.name", name, "--optimizer.lr", LR.get(name, "0.003"),
            *cli_overrides(name, EXTRA.get(name, {})),  # no replica check: its fingerprints are R bytes too
            *(["--checkpoint.enable", "--checkpoint.interval", "4"] if name in RESUMED else [])]


def hsdp_run(tmp_path_factory, name: str):
    """(dump folder, process, scalars) of ``name``'s HSDP run, launched once per session."""
    return shared_run(tmp_path_factory, 4, *hsdp_args(name))


# ---- other shared launches ---------------------------------------------------------------------------
# 8 steps with a checkpoint at step 4 on 2 x 2 HSDP: tests/test_resume.py's uninterrupted runs.
RESUMABLE = ["--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
             "--parallelism.data_parallel_replicate_degree", "2", "--model.flavor", "cpu_tiny"]
# AdamW's: resumed by tests/test_resume.py, compared with torchtitan's stock spec by
# tests/test_titan_integration.py.
ADAMW_HSDP = [*RESUMABLE, "--optimizer.name", "AdamW"]
# The debug TOML as it is on 2 processes (FSDP, one replica): tests/test_titan_integration.py, and on 0.3
# tests/test_titan03_toml.py's quickstart run.
FSDP_TWO = ["--training.steps", "8", "--model.flavor", "cpu_tiny"]
