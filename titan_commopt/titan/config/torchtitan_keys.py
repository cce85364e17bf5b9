"""The torchtitan settings our runs depend on, checked before any process group exists.

torchtitan 0.2.2 checks few values up front: ``[optimizer] lr = nan`` trains to the end with every
step skipped, ``seq_len = 0`` or an unknown flavor dies in a traceback (``KeyError: '9B'``), a
replicate degree that does not divide the world size is a bare ``AssertionError`` on every rank,
and a ``textfile`` dataset that is empty hangs. :func:`torchtitan_problems` returns one line per
bad value (key, value, what is allowed), including a tokenizer directory or dataset file that does
not exist; ``titan/config/validate.py`` reports them together with the
``[commopt]`` problems. The ranges follow what torchtitan or ``torch.optim`` would otherwise
refuse later (``0 <= beta < 1``, ``eps >= 0``, ...), or what makes a run meaningless (a NaN).

``world_size`` is torchrun's ``WORLD_SIZE`` (set in every worker before any process group, and
computed by ``python -m titan_commopt.run`` from ``--nnodes`` × ``--nproc_per_node``); without it the
checks that need it are skipped.
"""

import math
import os
from typing import Any, Callable, Optional

from .resume import TORCHTITAN_STATES

__all__ = [
    "torchtitan_problems", "world_size_from_env", "data_parallel_degree", "SpecProblems", "optimizer_value_problems",
    "mesh_problems", "spmd_backend_problems",
]

def world_size_from_env() -> Optional[int]:
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_STATES = ("model", *TORCHTITAN_STATES)  # torchtitan's checkpoint states

# (section, key, test, what is allowed); each test sees the value only.
_RULES: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("optimizer", "lr", lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("optimizer", "beta1", lambda v: _number(v) and 0 <= v < 1, "a number >= 0 and < 1"),
    ("optimizer", "beta2", lambda v: _number(v) and 0 <= v < 1, "a number >= 0 and < 1"),
    ("optimizer", "eps", lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("optimizer", "weight_decay", lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("lr_scheduler", "warmup_steps", lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    ("lr_scheduler", "total_steps", lambda v: v is None or (_integer(v) and v >= 1), "an integer >= 1 (or unset)"),
    ("lr_scheduler", "decay_ratio", lambda v: v is None or (_number(v) and 0 <= v <= 1), "a number >= 0 and <= 1 (or unset)"),
    ("lr_scheduler", "min_lr_factor", lambda v: _number(v) and 0 <= v <= 1, "a number >= 0 and <= 1"),
    ("training", "local_batch_size", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("training", "global_batch_size", lambda v: _integer(v) and (v == -1 or v >= 1),
     "-1 (local batch × data-parallel degree) or an integer >= 1"),
    ("training", "seq_len", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("training", "steps", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("training", "max_norm", lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("training", "gc_freq", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("metrics", "log_freq", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("checkpoint", "interval", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("checkpoint", "keep_latest_k", lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    ("checkpoint", "exclude_from_loading", lambda v: all(x in _STATES for x in v),
     "a list of: " + ", ".join(_STATES)),
    ("checkpoint", "load_step", lambda v: _integer(v) and v >= -1, "-1 (the newest checkpoint) or an integer >= 0"),
    ("comm", "init_timeout_seconds", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("comm", "train_timeout_seconds", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "data_parallel_replicate_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "data_parallel_shard_degree", lambda v: _integer(v) and (v == -1 or v >= 1),
     "-1 (the rest of the world) or an integer >= 1"),
    ("parallelism", "context_parallel_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "tensor_parallel_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "pipeline_parallel_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "expert_parallel_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("parallelism", "expert_tensor_parallel_degree", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
)

_VALIDATION_RULES = (
    ("validation", "local_batch_size", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("validation", "seq_len", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("validation", "freq", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("validation", "steps", lambda v: _integer(v) and v >= 1,
     "an integer >= 1 (batches per evaluation; -1, the whole held-out set, is refused: the ranks' shards of it end "
     "at different batches, which torchtitan warns may hang the evaluation)"),
)


def optimizer_value_problems(values: dict[str, Any], name_of: Callable[[str], str]) -> list[str]:
    """One line per bad ``[optimizer]`` value among ``values`` (``lr``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay``: the rules the TOML routes check), each key named as the route spells it
    (``name_of(key)``, e.g. ``--optimizer.lr``)."""
    return [f"{name_of(key)} = {values[key]!r}: allowed is {allowed}"
            for section, key, ok, allowed in _RULES if section == "optimizer" and key in values and not ok(values[key])]


def _rule_problems(job_config: Any, rules) -> list[str]:
    out = []
    for section, key, ok, allowed in rules:
        value = getattr(getattr(job_config, section), key)
        if not ok(value):
            out.append(f"[{section}] {key} = {value!r}: allowed is {allowed}")
    return out


# ---- the mesh --------------------------------------------------------------------------------------
_DEGREES = (
    ("data_parallel_replicate_degree", "dp_replicate"),
    ("context_parallel_degree", "cp"),
    ("tensor_parallel_degree", "tp"),
    ("pipeline_parallel_degree", "pp"),
)


def data_parallel_degree(parallelism: Any, world_size: Optional[int]) -> Optional[int]:
    """dp_replicate × dp_shard, with ``data_parallel_shard_degree = -1`` resolved as torchtitan's
    ParallelDims does (world size // the other degrees); None when that needs an unknown world size."""
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        if world_size is None:
            return None
        rest = math.prod(getattr(parallelism, key) for key, _ in _DEGREES)
        shard = world_size // rest
    return parallelism.data_parallel_replicate_degree * shard


def mesh_problems(parallelism: Any, world_size: Optional[int]) -> list[str]:
    """The mesh's degrees against the number of processes (none checked when ``world_size`` is None)."""
    if world_size is None:
        return []
    degrees = {key: getattr(parallelism, key) for key, _ in _DEGREES}
    shard = parallelism.data_parallel_shard_degree
    rest = math.prod(degrees.values())
    named = " × ".join(
        f"{key} = {value}" for key, value in degrees.items() if value != 1 or key == "data_parallel_replicate_degree"
    )
    if shard == -1:
        if world_size % rest or rest > world_size:
            return [
                f"[parallelism] {named}: must divide WORLD_SIZE = {world_size} (the number of processes "
                f"torchrun starts: nnodes × nproc_per_node); data_parallel_shard_degree = -1 takes the rest"
            ]
        return []
    if rest * shard != world_size:
        return [
            f"[parallelism] {named} × data_parallel_shard_degree = {shard} = {rest * shard} processes, but "
            f"WORLD_SIZE = {world_size} (torchrun's nnodes × nproc_per_node): the product must equal it "
            f"(data_parallel_shard_degree = -1 takes the rest)"
        ]
    return []


# torchtitan 0.3's default backend, which torch 2.13's fully_shard does not run with more than one
# process (it fails inside FSDP, after the process group exists). 0.2.2 has no such setting.
_BROKEN_BACKEND = "spmd_types"


def spmd_backend_problems(parallelism: Any, world_size: Optional[int]) -> list[str]:
    """``[parallelism] spmd_backend = "spmd_types"`` (torchtitan 0.3) with more than one process."""
    backend = getattr(parallelism, "spmd_backend", None)
    if backend != _BROKEN_BACKEND or world_size is None or world_size <= 1:
        return []
    return [
        f"[parallelism] spmd_backend = {backend!r} with WORLD_SIZE = {world_size}: torch 2.13's fully_shard fails "
        f"with it on more than one process; allowed is 'partial_dtensor' (FSDP2 and TP on DTensors, as torchtitan "
        f"0.2.2) or 'full_dtensor'"
    ]


def _batch_problems(training: Any, dp: Optional[int]) -> list[str]:
    if dp is None or training.global_batch_size == -1:
        return []
    step = training.local_batch_size * dp
    if training.global_batch_size % step:
        return [
            f"[training] global_batch_size = {training.global_batch_size}: allowed is a multiple of "
            f"local_batch_size × data-parallel degree = {training.local_batch_size} × {dp} = {step} (or -1)"
        ]
    return []


# ---- the output folder -----------------------------------------------------------------------------
def _folder_problems(job: Any) -> list[str]:
    """``[job] dump_folder`` (logs, checkpoints, TensorBoard under it): a directory, or one that can
    be created (its nearest existing parent is a writable directory)."""
    path = os.path.abspath(os.path.expanduser(job.dump_folder or "."))
    where = f"[job] dump_folder = {job.dump_folder!r}"
    allowed = "allowed is a directory, or a path where one can be created"
    if os.path.exists(path):
        return [] if os.path.isdir(path) else [f"{where}: is a file; {allowed}"]
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"{where}: {parent} is a file; {allowed}"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"{where}: {parent} is not writable; {allowed}"]
    return []


# ---- all of it -------------------------------------------------------------------------------------
SpecProblems = Callable[[Any, int], list[str]]  # (job config, documents every rank needs) -> lines


def torchtitan_problems(job_config: Any, world_size: Optional[int], spec_problems: SpecProblems) -> list[str]:
    """Every bad torchtitan setting a titan_commopt run depends on, one line each. ``spec_problems``:
    the installed line's checks of the model, tokenizer and data it names."""
    rules = [r for r in _RULES if r[0] != "checkpoint" or job_config.checkpoint.enable]
    if job_config.validation.enable:
        rules += _VALIDATION_RULES
    out = _rule_problems(job_config, rules) + _folder_problems(job_config.job)
    bad = {line.split("]")[0].lstrip("[") for line in out}  # sections with a bad value already
    parallelism, training = job_config.parallelism, job_config.training
    dp = None
    if "parallelism" not in bad:
        mesh = mesh_problems(parallelism, world_size)
        out += spmd_backend_problems(parallelism, world_size)
        out += mesh
        dp = None if mesh else data_parallel_degree(parallelism, world_size)
    if "training" not in bad:
        out += _batch_problems(training, dp)
    lines_needed = dp or (1 if "parallelism" in bad else parallelism.data_parallel_replicate_degree)
    return out + spec_problems(job_config, lines_needed)
