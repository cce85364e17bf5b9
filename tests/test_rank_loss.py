"""A rank lost while a checkpoint is being saved: the job exits non-zero within a bounded time, the
unfinished step folder is skipped and the previous checkpoint resumes; torchrun ``--max-restarts``
does that restart by itself when its rendezvous store is not shared across restarts
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see ``titan_commopt/titan/platform/elastic.py``; ``python -m
titan_commopt.run`` sets it).

The kill comes from ``tests/save_crash_hook/sitecustomize.py``: rank 1 SIGKILLs itself when DCP
hands it step 4's data to write, so step-4 never gets its ``.metadata``.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.titan_utils import CONFIG, ROOT

HOOK = Path(__file__).resolve().parent / "save_crash_hook"


def _launch(dump: Path, *extra: str, kill_save: str = "", env: dict = {},
            launcher: str = "torch.distributed.run") -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", launcher, "--nproc_per_node=2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "localhost:0", "--monitor-interval", "0.5", *extra,
        "-m", "titan_commopt.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        "--model.flavor", "cpu_tiny", "--parallelism.data_parallel_replicate_degree", "2",
        "--optimizer.name", "Dion", "--training.steps", "6", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--metrics.log_freq", "2", "--comm.train_timeout_seconds", "30",
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        full_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if kill_save:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH", "")]))
        full_env["TITAN_COMMOPT_TEST_KILL_SAVE"] = kill_save
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _complete(dump: Path) -> list[int]:
    folders = (dump / "checkpoint").glob("step-*")
    return sorted(int(p.name.split("-")[1]) for p in folders if (p / ".metadata").exists())


def test_rank_killed_while_saving_exits_and_the_previous_checkpoint_resumes(tmp_path):
    dump = tmp_path / "out"
    proc = _launch(dump, kill_save="step-4:1:0")
    out, _ = proc.communicate(timeout=300)
    exited = time.time()
    assert proc.returncode != 0
    killed_at = float((dump / "checkpoint" / "step-4.killed").read_text())
    assert exited - killed_at < 60, "the job took too long to notice the lost rank"
    assert "SIGKILL" in out  # torchrun's failure summary names what happened to the rank
    assert (dump / "checkpoint" / "step-4").is_dir() and _complete(dump) == [2]

    # The same command again skips the unfinished step-4 (with a line) and resumes from step 2.
    proc = _launch(dump)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "skipping checkpoint folder(s) step-4: no .metadata" in out
    assert "Training starts at step 3" in out and "Training completed" in out
    assert _complete(dump) == [2, 4, 6]


def test_torchrun_max_restarts_resumes_by_itself(tmp_path):
    """Through titan_commopt.run, which sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun's
    restarts (plain torchrun needs it exported: the same variable, read by the same torchrun code)."""
    dump = tmp_path / "out"
    start = time.monotonic()
    proc = _launch(dump, "--max-restarts", "1", kill_save="step-4:1:0", launcher="titan_commopt.run")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert time.monotonic() - start < 300
    assert out.count("Training starts at step 1\n") >= 1 and "Training starts at step 3" in out
    assert "skipping checkpoint folder(s) step-4" in out and "Training completed" in out
    assert "reuses the rendezvous store" not in out
    assert _complete(dump) == [2, 4, 6]


def test_restart_with_shared_rendezvous_store_warns(monkeypatch, capsys):
    from titan_commopt.titan.platform.elastic import FIX, warn_if_restart_would_hang

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not warn_if_restart_would_hang()  # the first attempt: nothing stale in the store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert warn_if_restart_would_hang()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and FIX in err and "pytorch/pytorch#135712" in err
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what FIX makes torchrun pass
    assert not warn_if_restart_would_hang()


def test_the_launcher_sets_the_fresh_store_for_restarts(monkeypatch):
    from torch.distributed.run import parse_args

    from titan_commopt.run import FRESH_STORE, fresh_store_per_restart
    from titan_commopt.titan.platform.elastic import FIX

    assert "=".join(FRESH_STORE) == FIX
    monkeypatch.delenv(FRESH_STORE[0], raising=False)
    assert not fresh_store_per_restart(parse_args(["--nproc_per_node=2", "x.py"]))
    assert FRESH_STORE[0] not in os.environ
    assert fresh_store_per_restart(parse_args(["--nproc_per_node=2", "--max-restarts", "2", "x.py"]))
    assert os.environ[FRESH_STORE[0]] == "1"
    monkeypatch.setenv(FRESH_STORE[0], "0")  # the user's own choice stays
    assert not fresh_store_per_restart(parse_args(["--max-restarts", "2", "x.py"]))
