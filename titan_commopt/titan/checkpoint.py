"""Before a resume: does the checkpoint torchtitan is about to load fit this run's replicas?

torchtitan's CheckpointManager loads ``<dump_folder>/<checkpoint.folder>/step-N`` (the latest, or
``checkpoint.load_step``). Optimizers that own R save their state under ``optimizer.replica<r>/``
keys (``titan_commopt.state``); a run with another number of replicas, or another kind of
optimizer, cannot take that state over. This check reads only the checkpoint's metadata file, on
every rank alike, and fails with a clear message before DCP would fail with a missing-key error.
"""

import os
import re
from typing import Any, Optional

_REPLICA_KEY = re.compile(r"^optimizer\.replica(\d+)/")


def checkpoint_to_load(job_config: Any) -> Optional[str]:
    ckpt = job_config.checkpoint
    if not ckpt.enable:
        return None
    folder = os.path.join(job_config.job.dump_folder, ckpt.folder)
    if not os.path.isdir(folder):
        return None
    steps = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    step = ckpt.load_step if ckpt.load_step > 0 else max(steps, default=-1)
    return os.path.join(folder, f"step-{step}") if step in steps else None


def saved_replicas(path: str) -> Optional[int]:
    """Replica count of the optimizer state in a DCP checkpoint; None when it has none of ours."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    indices = {int(m.group(1)) for k in keys if (m := _REPLICA_KEY.match(k))}
    has_optimizer = any(k.startswith("optimizer.") for k in keys)
    if not indices:
        return 0 if has_optimizer else None
    return max(indices) + 1


def check_resume(job_config: Any, owns_replicate_sync: bool, replicas: int) -> None:
    path = checkpoint_to_load(job_config)
    if path is None or "optimizer" in job_config.checkpoint.exclude_from_loading:
        return
    saved = saved_replicas(path)
    if saved is None:  # model-only checkpoint: nothing replica-local to restore
        return
    name = job_config.optimizer.name
    if owns_replicate_sync and saved == 0:
        problem = "it holds the state of torchtitan's own optimizer (AdamW/Adam)"
    elif not owns_replicate_sync and saved > 0:
        problem = f"it holds the per-replica state of a titan_commopt optimizer for {saved} replicas"
    elif owns_replicate_sync and saved != replicas:
        problem = f"it holds optimizer state for {saved} replicas and this run has {replicas}"
    else:
        return
    raise RuntimeError(
        f"cannot resume [optimizer] name = {name!r} from {path}: {problem}. Replica-local state "
        "(momenta, parameters between syncs) has no sound mapping onto a different set of replicas; "
        "resume with the same optimizer and data_parallel_replicate_degree (the shard degree may "
        "change: DCP reshards), or load only the model: [checkpoint] exclude_from_loading = [\"optimizer\"]."
    )


__all__ = ["check_resume", "checkpoint_to_load", "saved_replicas"]
