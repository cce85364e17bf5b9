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

from titan_commopt.optim import owns_replicate_sync

from ..tt022 import tokenizer as data
from .resume import TORCHTITAN_STATES

__all__ = ["torchtitan_problems", "world_size_from_env", "data_parallel_degree", "SpecProblems"]

COMMOPT_SPEC = "llama3_commopt"  # the TrainSpec whose build_optimizers_fn builds our optimizers


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
    ("validation", "steps", lambda v: _integer(v) and (v == -1 or v >= 1), "-1 (the whole set) or an integer >= 1"),
)


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


def _mesh_problems(parallelism: Any, world_size: Optional[int]) -> list[str]:
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


# ---- the model -------------------------------------------------------------------------------------
def _model_problems(job_config: Any) -> tuple[list[str], Any]:
    """Unknown model name or flavor, or an optimizer of ours on a spec that cannot build it.
    Returns (problems, the TrainSpec or None)."""
    from torchtitan.protocols import train_spec as registry

    model, name = job_config.model, job_config.optimizer.name
    try:
        spec = registry.get_train_spec(model.name)
    except ValueError:
        from torchtitan.models import _supported_models

        known = sorted(set(registry._extra_train_specs) | set(_supported_models))
        return [f"[model] name = {model.name!r}: allowed is one of {', '.join(known)}"], None
    except Exception:  # a torchtitan model that does not import here: leave it to torchtitan
        return [], None
    out = []
    if owns_replicate_sync(name) and model.name != COMMOPT_SPEC:
        out.append(
            f"[model] name = {model.name!r} with [optimizer] name = {name!r}: allowed is {COMMOPT_SPEC!r} "
            f"(the TrainSpec that builds titan_commopt optimizers; {model.name!r} knows only AdamW and Adam)"
        )
    flavors = getattr(spec, "model_args", None) or {}
    if flavors and model.flavor not in flavors:
        out.append(f"[model] flavor = {model.flavor!r}: allowed is one of {', '.join(flavors)} (model {model.name!r})")
    return out, spec


# ---- the tokenizer ---------------------------------------------------------------------------------
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # what the loaders read


_HF_FILES = tuple(f for f in _TOKENIZER_FILES if f != "tokenizer.model")  # what torchtitan's build_hf_tokenizer reads


def _tokenizer_problems(model: Any, spec: Any) -> list[str]:
    """Our specs' tokenizer (``titan/adapter/data.py: build_tokenizer``): ``bundled``, a SentencePiece
    ``.model`` file, or a directory holding one of the files torchtitan's loader reads; torchtitan's
    own specs (``build_hf_tokenizer``): a directory holding one of those files."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    builder = getattr(spec, "build_tokenizer_fn", None) if spec is not None else None
    if builder is build_hf_tokenizer:
        path = model.hf_assets_path or ""
        where = f"[model] hf_assets_path = {path!r}"
        allowed = f"allowed is a directory with {', '.join(_HF_FILES[:-1])} or {_HF_FILES[-1]} (model {model.name!r})"
        if not os.path.isdir(path):
            return [f"{where}: {'not a directory' if os.path.exists(path) else 'no such directory'}; {allowed}"]
        if not any(os.path.isfile(os.path.join(path, f)) for f in _HF_FILES):
            return [f"{where}: holds no tokenizer; {allowed}"]
        return []
    if builder is not data.build_tokenizer:
        return []
    path = (model.hf_assets_path or "").strip()
    if path in ("", "bundled") or (os.path.isfile(path) and path.endswith(".model")):
        return []
    allowed = ('allowed is "bundled" (the offline tokenizer), a directory with tokenizer.json (HuggingFace) '
               "or tokenizer.model (SentencePiece), or a SentencePiece .model file")
    where = f"[model] hf_assets_path = {model.hf_assets_path!r}"
    if not os.path.exists(path):
        return [f"{where}: no such file or directory; {allowed}"]
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return [f"{where}: holds no tokenizer ({', '.join(_TOKENIZER_FILES)}); {allowed}"]
    return []


# ---- the data --------------------------------------------------------------------------------------
def _nonblank_lines(path: str, at_least: int) -> int:
    """How many non-blank lines ``path`` has, counting no further than ``at_least``."""
    count = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                count += 1
                if count >= at_least:
                    break
    return count


_LOCAL_DATASETS = ("c4_test",)  # torchtitan datasets whose default path is a local directory


def _dataset_problems(section: str, dataset: str, dataset_path: Optional[str], dp: int) -> list[str]:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    name = dataset.lower()  # torchtitan lowers the name too
    if name not in DATASETS:
        return [f"[{section}] dataset = {dataset!r}: allowed is one of {', '.join(sorted(DATASETS))}"]
    if name not in (*data.BUNDLED, data.TEXTFILE_NAME):
        # torchtitan's own datasets: its loaders decide, except for a local path that does not exist
        # (c4_test reads ./tests/assets/c4_test; a dataset_path given as a filesystem path)
        path = dataset_path or DATASETS[name].path
        local = name in _LOCAL_DATASETS or os.path.isabs(path) or path.startswith(("./", "../", "~"))
        if local and not os.path.exists(os.path.expanduser(path)):
            key = "dataset_path" if dataset_path else "dataset"
            shown = dataset_path if dataset_path else dataset
            return [
                f"[{section}] {key} = {shown!r}: {os.path.abspath(os.path.expanduser(path))} does not exist "
                f"(torchtitan's {name!r} reads it); allowed is an existing dataset directory, or dataset = "
                f"\"textfile\" with dataset_path = a UTF-8 text file"
            ]
        return []
    if name == data.TEXTFILE_NAME and not dataset_path:
        return [f"[{section}] dataset = {dataset!r} needs dataset_path = a UTF-8 text file, one document per line"]
    if not dataset_path:
        return []
    where = f"[{section}] dataset_path = {dataset_path!r}"
    if not os.path.isfile(dataset_path):
        why = "is a directory" if os.path.isdir(dataset_path) else "no such file"
        return [f"{where}: {why}; allowed is a UTF-8 text file, one document per line"]
    try:
        found = _nonblank_lines(dataset_path, dp)
    except UnicodeDecodeError:
        return [f"{where}: not UTF-8 text; allowed is a UTF-8 text file, one document per line"]
    except OSError as error:
        return [f"{where}: cannot be read ({error.strerror or error})"]
    if found == 0:
        return [f"{where}: has no text (empty or only blank lines); allowed is a file with one document per line"]
    if found < dp:
        return [
            f"{where}: has {found} non-blank line(s) but the data-parallel degree is {dp}: every data-parallel "
            f"rank needs at least one document (one per line)"
        ]
    return []


def _uses_text_datasets(spec: Any) -> bool:
    if spec is None:
        return False
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    return getattr(spec, "build_dataloader_fn", None) is build_text_dataloader


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
def _spec_problems(job_config: Any, lines_needed: int) -> list[str]:
    """torchtitan 0.2.2's model, tokenizer and dataset checks (its TrainSpec registry)."""
    models, spec = _model_problems(job_config)
    out = models + _tokenizer_problems(job_config.model, spec)
    if _uses_text_datasets(spec):
        out += text_dataset_problems(job_config, lines_needed)
    return out


def text_dataset_problems(job_config: Any, lines_needed: int) -> list[str]:
    """``[training]``'s dataset, and ``[validation]``'s when enabled (both torchtitan lines)."""
    training = job_config.training
    out = _dataset_problems("training", training.dataset, training.dataset_path, lines_needed)
    if job_config.validation.enable:
        validation = job_config.validation
        out += _dataset_problems("validation", validation.dataset, validation.dataset_path, lines_needed)
    return out


SpecProblems = Callable[[Any, int], list[str]]  # (job config, documents every rank needs) -> lines


def torchtitan_problems(
    job_config: Any, world_size: Optional[int] = None, spec_problems: Optional[SpecProblems] = None
) -> list[str]:
    """Every bad torchtitan setting a titan_commopt run depends on, one line each. ``spec_problems``:
    the checks of the model, tokenizer and data that depend on the installed torchtitan (default:
    0.2.2's)."""
    rules = [r for r in _RULES if r[0] != "checkpoint" or job_config.checkpoint.enable]
    if job_config.validation.enable:
        rules += _VALIDATION_RULES
    out = _rule_problems(job_config, rules) + _folder_problems(job_config.job)
    bad = {line.split("]")[0].lstrip("[") for line in out}  # sections with a bad value already
    parallelism, training = job_config.parallelism, job_config.training
    dp = None
    if "parallelism" not in bad:
        mesh = _mesh_problems(parallelism, world_size)
        out += mesh
        dp = None if mesh else data_parallel_degree(parallelism, world_size)
    if "training" not in bad:
        out += _batch_problems(training, dp)
    lines_needed = dp or (1 if "parallelism" in bad else parallelism.data_parallel_replicate_degree)
    return out + (spec_problems or _spec_problems)(job_config, lines_needed)
