"""A killed rank: the job exits non-zero within a bounded time, and the same command restarts from
the last checkpoint. (torchrun --max-restarts N makes that restart automatic: see README.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.titan_utils import CONFIG, ROOT


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _launch(dump: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "localhost:0", "--monitor-interval", "0.5", *extra,
        "-m", "titan_commopt.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        "--model.flavor", "cpu_tiny", "--parallelism.data_parallel_replicate_degree", "2",
        "--optimizer.name", "Dion", "--training.steps", "30", "--checkpoint.enable",
        "--checkpoint.interval", "10", "--metrics.log_freq", "10", "--comm.train_timeout_seconds", "30",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_one_worker_after_checkpoint(proc: subprocess.Popen, dump: Path, step: int = 10) -> None:
    deadline = time.monotonic() + 240
    while not (dump / "checkpoint" / f"step-{step}" / ".metadata").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)


def test_killed_rank_exits_nonzero_in_bounded_time_and_restart_continues(tmp_path):
    dump = tmp_path / "out"
    proc = _launch(dump)
    _kill_one_worker_after_checkpoint(proc, dump)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 60, "the job took too long to notice the lost rank"
    assert "SIGKILL" in out  # torchrun's failure summary names what happened to the rank

    # The same command again picks up the last complete checkpoint and finishes the run.
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*") if (p / ".metadata").exists())
    proc = _launch(dump)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert f"Training starts at step {saved[-1] + 1}" in out
    assert "Training completed" in out
