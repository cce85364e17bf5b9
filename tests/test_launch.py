"""``python -m titan_commopt.run`` (torchrun that checks the config first): a bad config ends with
our lines last on the console and exit status 2, whether the launcher finds the problem (before
any worker starts) or the workers do (an elastic world size); a good config trains as torchrun would
(the README's TOML, which names neither custom_config_module nor custom_import); the console shows
rank 0's lines alone unless torchrun's console options are given, and a failure of another rank
still reaches it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.titan_utils import CONFIG, LOSS_LINE, ROOT, read_scalars, readme_toml

PREFIX = "titan_commopt: bad config: "


def _launch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TITAN_COMMOPT_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "titan_commopt.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.both_lines
def test_launcher_refuses_a_bad_config_before_any_worker():
    proc = _launch("--nproc_per_node=2", "--standalone", "-m", "titan_commopt.train", "--job.config_file", str(CONFIG),
                   "--optimizer.lr", "nan", "--parallelism.data_parallel_replicate_degree", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lr = PREFIX + "[optimizer] lr = nan: allowed is a finite number >= 0"
    mesh = PREFIX + "[parallelism] data_parallel_replicate_degree = 3: must divide WORLD_SIZE = 2"
    assert out.count(lr) == 1 and out.count(mesh) == 1
    assert _last_line(proc).startswith(mesh)
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_launcher_reports_a_problem_only_the_workers_see(tmp_path):
    # An elastic node count: the world size is known only after the rendezvous, in the workers.
    proc = _launch("--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "localhost:0", "--nproc_per_node=1", "-m", "titan_commopt.train",
                   "--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path),
                   "--parallelism.data_parallel_replicate_degree", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    line = PREFIX + "[parallelism] data_parallel_replicate_degree = 3: must divide WORLD_SIZE = 1"
    assert out.count(line) == 1  # the worker recorded it, the launcher printed it
    assert _last_line(proc).startswith(line)
    assert "Traceback" not in out and "ChildFailedError" not in out


@pytest.mark.both_lines
def test_readme_toml_trains_as_written(tmp_path):
    """The README's command as written: one copy of the log (rank 0's), and the last step logged
    although it is not a multiple of log_freq (console and TensorBoard)."""
    config = tmp_path / "my.toml"
    config.write_text(readme_toml())
    proc = _launch("--nproc_per_node=2", "--standalone",
                   "-m", "titan_commopt.train", "--job.config_file", str(config), "--job.dump_folder", str(tmp_path / "out"),
                   "--training.steps", "6", "--metrics.log_freq", "10", "--metrics.disable_color_printing")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [int(step) for step, _ in LOSS_LINE.findall(proc.stdout)] == [1, 6]  # once each (the last step always): rank 0 alone
    assert all(line.startswith("[rank0]:") for line in proc.stdout.splitlines() if LOSS_LINE.search(line))
    assert "FlexDeMo" in proc.stdout and "R vs AdamW-HSDP" in proc.stdout
    scalars = read_scalars(tmp_path / "out")  # TensorBoard on, as the README says
    assert [step for step, _ in scalars["loss_metrics/global_avg_loss"]] == [1, 6]
    totals = dict(scalars["comm/R_sent_bytes_total"])
    assert totals[6] > totals[1] > 0
    # a quiet console: no Python warning, no torchtitan WARNING (6 steps: the example's whole warm-up)
    import re

    noisy = [line for line in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"Warning\b|warnings\.warn| - WARNING - ", line)]
    assert not noisy, noisy


def test_known_cpu_noise_is_filtered_and_nothing_else():
    """titan/platform/console.py: the exact torchtitan/torch messages of a CPU quickstart, and their neighbours."""
    import logging
    import re

    from titan_commopt.titan.platform.console import NOISE_WARNINGS, OFFLINE_LOG_LINES, _DropKnownNoise

    drop = _DropKnownNoise()

    def kept(message: str) -> bool:
        return drop.filter(logging.LogRecord("root", logging.WARNING, __file__, 1, message, None, None))

    for noise in (
        "HF assets path bundled does not exist!",
        "HF assets path  does not exist!",
        "model.safetensors.index.json not found at hf_assets_path: bundled/model.safetensors.index.json.  Defaulting ...",
        "Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use device_name",
        "Peak flops undefined for: cpu, fallback to A100",
        "Peak FLOPS used for computing MFU: 3.120e+14",
        "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
    ):
        assert not kept(noise), noise
    for signal in (
        "HF assets path ./assets/hf/Llama-3.1-8B does not exist!",  # a user's real path
        "model.safetensors.index.json not found at hf_assets_path: ./assets/hf/x/model.safetensors.index.json",
        "Dataset commopt_tiny is being re-looped",
        "step:  1  loss:  7.51985",
    ):
        assert kept(signal), signal
    for message in (
        "DTensor random operators may not have complete support on cpu device mesh",
        "DTensor manual_seed() may not have complete support on cpu device mesh",
        "In CPU autocast, but the target dtype is not supported. Disabling autocast.\nCPU Autocast only supports ...",
        "'set_vital' is deprecated, please do not call",
        "Set timeout is now only supported for either nccl or gloo.",
    ):
        assert any(re.match(pattern, message) for pattern in NOISE_WARNINGS), message

    # With an accelerator only the offline tokenizer's lines go; the machine's stay.
    on_gpu = _DropKnownNoise(OFFLINE_LOG_LINES)
    record = lambda message: logging.LogRecord("root", logging.WARNING, __file__, 1, message, None, None)  # noqa: E731
    assert not on_gpu.filter(record("HF assets path bundled does not exist!"))
    assert not on_gpu.filter(record("model.safetensors.index.json not found at hf_assets_path: bundled/x"))
    assert on_gpu.filter(record("Error running lspci: [Errno 2] No such file or directory: 'lspci'"))
    assert on_gpu.filter(record("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"))


def test_a_worker_records_its_lines_for_torchruns_summary(tmp_path, monkeypatch, capsys):
    """Under plain torchrun the agent's failure summary shows the worker's error file: our lines;
    titan_commopt.run prints them instead, with the worker's status, whichever rank failed first."""
    import pytest
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_commopt.options import ConfigError
    from titan_commopt.run import recorded_stop
    from titan_commopt.titan.platform.stop import RunStopped, stop_run
    from titan_commopt.train import report_config_error

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")  # not rank 0: records, does not print
    monkeypatch.delenv("TITAN_COMMOPT_LAUNCHER", raising=False)
    with pytest.raises(SystemExit) as info:
        report_config_error(ConfigError("[training] seq_len = 0: allowed is an integer >= 1"))
    assert info.value.code == 2 and capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    line = PREFIX + "[training] seq_len = 0: allowed is an integer >= 1"
    assert line in ChildFailedError("titan_commopt.train", {0: failure}).format_msg()
    # rank 0 stopped by torchrun's SIGTERM (no error file) at the same second: still our line
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file=str(tmp_path / "none.json"))
    killed.timestamp = failure.timestamp - 1
    assert recorded_stop(ChildFailedError("titan_commopt.train", {0: killed, 1: failure})) == (line, 2)

    # A run stopped on purpose after the process group exists (a refused resume, a safeguard)
    for status in (2, 1):
        with pytest.raises(RunStopped) as info:
            stop_run("cannot resume [optimizer] name = 'DES-LOC' from x: ...", status)
        assert info.value.code == status and capsys.readouterr().err == ""  # rank 1 prints nothing
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=status, error_file=str(error_file))
        stopped = "titan_commopt: cannot resume [optimizer] name = 'DES-LOC' from x: ..."
        assert stopped in ChildFailedError("titan_commopt.train", {0: failure}).format_msg()
        assert recorded_stop(ChildFailedError("titan_commopt.train", {0: failure})) == (stopped, status)
    # rank 0 prints the line, unless titan_commopt.run will (it set TITAN_COMMOPT_LAUNCHER)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunStopped):
        stop_run("stopped", 1)
    assert capsys.readouterr().err == "titan_commopt: stopped\n"
    monkeypatch.setenv("TITAN_COMMOPT_LAUNCHER", "1")
    with pytest.raises(RunStopped):
        stop_run("stopped", 1)
    assert capsys.readouterr().err == ""
    # any other failure of a worker is torchrun's to report
    error_file.write_text('{"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "1"}}}')
    other = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert recorded_stop(ChildFailedError("titan_commopt.train", {0: other})) is None


@pytest.mark.both_lines
def test_traceback_only_when_asked(monkeypatch, capsys):
    import pytest

    from titan_commopt.options import ConfigError
    from titan_commopt.train import report_config_error

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("TITAN_COMMOPT_LAUNCHER", raising=False)
    for asked in ("", "1"):
        monkeypatch.setenv("TITAN_COMMOPT_TRACEBACK", asked)
        try:
            raise ConfigError("[optimizer] lr = nan: allowed is a finite number >= 0")
        except ConfigError as error:
            with pytest.raises(SystemExit):
                report_config_error(error)
        err = capsys.readouterr().err
        assert ("Traceback" in err) == bool(asked)
        assert err.strip().splitlines()[-1] == PREFIX + "[optimizer] lr = nan: allowed is a finite number >= 0"


@pytest.mark.both_lines
def test_a_finished_run_exits_zero_with_its_output_flushed(tmp_path):
    # exit_after_success skips the interpreter's teardown (os._exit): what the run printed to a
    # pipe (block-buffered) and the records a logging handler still holds must come out all the same.
    code = (
        "import logging, logging.handlers, sys\n"
        "held = logging.handlers.MemoryHandler(100, logging.CRITICAL, logging.FileHandler(sys.argv[1]))\n"
        "logging.getLogger('t').addHandler(held)\n"
        "logging.getLogger('t').warning('logged last')\n"
        "sys.stdout.write('printed, not flushed\\n')\n"
        "sys.stderr.write('to stderr\\n')\n"
        "from titan_commopt.train import exit_after_success\n"
        "exit_after_success()\n"
        "print('never')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    log = tmp_path / "log.txt"
    proc = subprocess.run([sys.executable, "-c", code, str(log)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["logged last"]
    assert proc.stdout.splitlines() == ["printed, not flushed"]
    assert proc.stderr.splitlines() == ["to stderr"]


WORKER = """
import os, sys
rank = os.environ["RANK"]
print(f"line from rank {rank}", flush=True)
if rank == "1" and "fail" in sys.argv:
    raise RuntimeError("boom on rank 1")
"""


def test_console_shows_rank_zero_and_a_failure_of_another_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = _launch("--nproc_per_node=2", "--standalone", str(script), "fail", timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["[rank0]:line from rank 0"]
    # rank 1's stdout stays in its file; its failure, with the end of its stderr, reaches the console
    assert "line from rank 1" not in proc.stdout + proc.stderr
    named = [line for line in proc.stderr.splitlines() if line.startswith("titan_commopt: rank 1 failed (exit code 1)")]
    assert len(named) == 1 and named[0].split(": ")[-1].startswith("/")
    assert proc.stderr.count("RuntimeError: boom on rank 1") == 1
    assert proc.stderr.index(named[0]) < proc.stderr.index("Root Cause")  # torchrun's summary stays last

    # The documented opt-out: torchrun's own --tee 3 shows every rank, each line prefixed with its rank.
    proc = _launch("--nproc_per_node=2", "--standalone", "--tee", "3", str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.splitlines()) == ["[rank0]:line from rank 0", "[rank1]:line from rank 1"]


def test_console_options_of_the_user_are_kept(tmp_path, monkeypatch):
    """Any spelling of torchrun's console options, or its PET_* variable, leaves the console as set."""
    from torch.distributed.run import parse_args

    from titan_commopt.run import RANK_PREFIX, console_of_rank_zero

    monkeypatch.setenv(RANK_PREFIX[0], "")
    monkeypatch.delenv(RANK_PREFIX[0])  # torchrun reads it: set by the launcher, undone after the test
    for given in (["--local-ranks-filter", "1"], ["--local_ranks_filter=0,1"], ["--tee", "3"], ["-t", "1"],
                  ["--redirects", "3"], ["-r", "2"]):
        args = parse_args(["--nproc_per_node=2", *given, "x.py"])
        before = vars(args).copy()
        assert console_of_rank_zero(args) is None and vars(args) == before, given
    monkeypatch.setenv("PET_TEE", "1")
    assert console_of_rank_zero(parse_args(["--nproc_per_node=2", "x.py"])) is None
    monkeypatch.delenv("PET_TEE")

    args = parse_args(["--nproc_per_node=2", "--log_dir", str(tmp_path), "x.py"])  # only where the files go
    logs = console_of_rank_zero(args)
    assert (args.local_ranks_filter, args.tee, args.log_dir) == ("0", "3", str(tmp_path)) and logs.root == tmp_path
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launcher makes torchrun's log directory
    args = parse_args(["--nproc_per_node=2", "x.py"])
    assert console_of_rank_zero(args) is not None and Path(args.log_dir).parent == tmp_path
    assert os.environ[RANK_PREFIX[0]] == "[rank${rank}]:"


def test_a_hidden_failure_names_its_file_and_shows_its_end_once(tmp_path):
    """The tail of the failed rank's stderr of the latest attempt, unless torchrun's summary shows its traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_commopt.run import STDERR_LINES_SHOWN, RankLogs, hidden_failures

    (tmp_path / "earlier_run" / "attempt_0" / "1").mkdir(parents=True)  # another launch's, same --log-dir
    (tmp_path / "earlier_run" / "attempt_0" / "1" / "stderr.log").write_text("not this launch\n")
    logs = RankLogs(tmp_path)
    for attempt in (0, 1):
        folder = tmp_path / "run_x" / f"attempt_{attempt}"
        for local_rank in (0, 1):
            (folder / str(local_rank)).mkdir(parents=True)
            lines = [f"attempt {attempt} line {i}" for i in range(STDERR_LINES_SHOWN + 5)]
            (folder / str(local_rank) / "stderr.log").write_text("\n".join(lines) + "\n")
    error_file = tmp_path / "run_x" / "attempt_1" / "1" / "error.json"
    rank0 = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(tmp_path / "none.json"))
    rank1 = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(error_file))
    text = hidden_failures(ChildFailedError("x", {0: rank0, 1: rank1}), logs)
    lines = text.splitlines()
    assert lines[0] == (f"titan_commopt: rank 1 failed (exit code 1); its stderr, not on the console: "
                        f"{error_file.with_name('stderr.log')} (last {STDERR_LINES_SHOWN} lines):")
    assert lines[1:] == [f"attempt 1 line {i}" for i in range(5, STDERR_LINES_SHOWN + 5)]  # rank 0 is on the console
    error_file.write_text('{"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "1", '
                          '"py_callstack": "Traceback ..."}}}')
    rank1 = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(error_file))
    assert hidden_failures(ChildFailedError("x", {1: rank1}), logs) == lines[0].split(" (last")[0]


def test_a_config_warning_is_printed_once_by_the_launcher(tmp_path):
    # [commopt.demo] with torchtitan's AdamW: a table the optimizer does not read (valid, probably not meant)
    proc = _launch("--nproc_per_node=2", "--standalone", "--tee", "3", "-m", "titan_commopt.train",
                   "--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path),
                   "--parallelism.data_parallel_replicate_degree", "2", "--commopt.demo.chunk", "32",
                   "--training.steps", "1", "--metrics.disable_color_printing")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "titan_commopt: warning: [commopt.demo]" in line]
    assert len(warnings) == 1, warnings  # every rank on the console (--tee 3): still one copy
    assert "chunk" in warnings[0] and "AdamW" in warnings[0]


# ---- a fault-tolerant worker dies with its launcher (titan/platform/launcher_death.py) ----
# The module is loaded from its file, without titan_commopt.titan's package import (torchtitan): a
# process of a second.
_DIE_WITH_LAUNCHER = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("launcher_death", {str(ROOT / "titan_commopt/titan/platform/launcher_death.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("armed" if module.die_with_launcher() else "not armed", flush=True)
"""
_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1] + "import time; time.sleep(600)"], start_new_session=True)
print(worker.pid, flush=True)  # torchrun starts its workers in sessions of their own, as here
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "TITAN_COMMOPT_LAUNCHER")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_a_worker_started_by_an_agent_dies_with_its_launcher():
    """A launcher SIGKILLed alone: its worker (in a session of its own) is killed by the kernel, not
    left running under init."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _DIE_WITH_LAUNCHER], cwd=ROOT,
                                env=_env(TORCHELASTIC_RUN_ID="test"), stdout=subprocess.PIPE, text=True)
    lines = [launcher.stdout.readline().strip() for _ in range(2)]  # the worker's pid, and "armed"
    worker = int(next(line for line in lines if line.isdigit()))
    try:
        assert "armed" in lines, lines
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "the worker outlived its launcher"
    finally:
        for pid in (worker, launcher.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_a_worker_whose_launcher_is_gone_already_leaves_and_others_are_left_alone():
    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _DIE_WITH_LAUNCHER], cwd=ROOT, env=_env(**env),
                              capture_output=True, text=True, timeout=120)

    orphan = run(TORCHELASTIC_RUN_ID="test", TITAN_COMMOPT_LAUNCHER="1")  # its parent is not launcher 1
    assert orphan.returncode == 1 and "the launcher (pid 1) is gone" in orphan.stderr, orphan
    alone = run()  # not started by torch's elastic agent: nothing to die with
    assert alone.returncode == 0 and alone.stdout.strip() == "not armed", alone


@pytest.mark.both_lines
def test_torchtitans_own_config_module_on_a_cpu_is_one_line_naming_ours():
    """0.3's ``-m torchtitan.train --module llama3`` (with our override) on a machine without an
    accelerator: torchtitan's Trainer would stop in ``torch.cuda.set_device`` before any code of ours
    runs; the launcher says so before any worker, naming our config module (on 0.2.2 ``--module`` is
    not torchtitan's: the launcher leaves the command line to torchrun)."""
    from titan_commopt.titan.platform.cpu import accelerator_available, stock_module_problem
    from tests.titan_utils import LINE

    argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
            "titan_commopt.titan.tt03.overrides.commopt"]
    if LINE != "0.3" or accelerator_available():
        assert stock_module_problem(argv) is None
        return
    assert stock_module_problem(["--module", "titan_commopt.titan.tt03.configs", "--config", "llama3_debugmodel"]) is None
    proc = _launch("--nproc_per_node=1", "--standalone", "-m", "torchtitan.train", *argv)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert _last_line(proc) == (
        PREFIX + "--module llama3 on a machine without an accelerator: torchtitan's own config module and Trainer assume "
        "CUDA (torch.cuda.set_device fails before any titan_commopt code runs, an --override.imports of ours included); "
        "allowed is our config module, which applies the CPU fixes to torchtitan's configs by name: "
        "--module titan_commopt.titan.tt03.configs --config llama3_debugmodel")
    assert "Traceback" not in proc.stdout + proc.stderr and "Starting job" not in proc.stdout + proc.stderr
