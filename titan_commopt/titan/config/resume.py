"""Before a resume: is the checkpoint torchtitan is about to load intact, and does it fit this run?

torchtitan's CheckpointManager loads ``<dump_folder>/<checkpoint.folder>/step-N``: the newest folder
holding a ``.metadata`` file, or ``[checkpoint] load_step``. DCP writes ``.metadata`` last, after
every rank has written (and fsynced) its ``.distcp`` files, through a temporary file and a rename:
a folder without it is a save that did not finish (a rank died while saving) and is skipped, with a
log line. :func:`check_resume` runs in ``build_optimizers`` before anything is built, on every rank
alike, reading only the ``.metadata`` file, the sizes of the data files and one small item of them:

0. ``[checkpoint] load_step``, when given (>= 0), names a complete step folder of a run that
   checkpoints (torchtitan would raise ``FileNotFoundError``, start afresh when the checkpoint folder
   does not exist, or ignore it with checkpointing off): :func:`load_step_problem`, which the config
   checks also run before any process group exists;
1. the checkpoint is intact: ``.metadata`` unpickles, every data file it names exists and is as long
   as the metadata says (a truncated or missing file is named, instead of DCP's ``EOFError``);
   and it holds what torchtitan loads after step 0 (optimizer, LR scheduler, dataloader, train state,
   less ``exclude_from_loading``: the last step's checkpoint is model-only by default), the
   dataloader's for this run's data-parallel degree (torchtitan cannot reshard it; DCP would fail on
   a missing key or torchtitan on an assertion);
2. it fits the run's replicas: optimizers that own R save per replica (``optimizer.replica<r>/``
   keys, ``config/checkpoint.py``); another replica count, or another kind of optimizer (ours vs
   torchtitan's AdamW/Adam), is refused;
3. it fits the run's optimizer: each replica's state records the resolved options
   (``optimizer.replica<r>/commopt_resolved``, JSON of ``Resolved.record()``); another family, or
   another value of an option that shapes the state (``Family.state_shape``: DeMo's base, Dion's
   rank, DES-LOC's number of momenta, ...), is refused naming the key and both values. Every other
   option may change; a log line lists what changed.

A refusal is one line from rank 0 and exit status 2 on every rank (``titan/platform/stop.py``); the way back
it names is the same run settings, another checkpoint, or ``[checkpoint] exclude_from_loading =
["optimizer"]`` (load only the model).

Both torchtitan lines lay checkpoints out alike; what differs (where the settings are, how the user
writes them) is ``checkpoint.py``: each function takes a ``CheckpointSettings`` or
a 0.2.2-shaped job config (``[job] dump_folder``, ``[checkpoint]``, ``[optimizer] name``). On 0.2.2
the check runs where the container is built (``common/build.py``), both before the optimizers are built and before torchtitan loads anything. Not detected: bytes changed inside a data file of the right
length (DCP keeps no checksums), e.g. a step folder saved a second time (after resuming from an
earlier ``load_step``) whose save was cut short: its old ``.metadata`` stays until DCP replaces it.
"""

import json
import logging
import os
import pickle
import re
from typing import Any, Optional

from ..platform.stop import RESUME_REFUSED, stop_run
from .checkpoint import LEDGER_KEY, REPLICA_KEY, RESOLVED_KEY, CheckpointSettings, Spelling, replica_prefix

__all__ = [
    "check_resume", "checkpoint_to_load", "load_step_problem", "initial_load_problem", "saved_replicas", "read_metadata", "read_record",
    "ledger_saved", "CheckpointDamaged",
]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")
_DATALOADER_KEY = re.compile(r"^dataloader\.dp_rank_(\d+)$")
TORCHTITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")  # loaded with the model after step 0


def _model_only(spelling: Spelling) -> str:
    return f'load only the model: {spelling.setting("checkpoint", "exclude_from_loading", ["optimizer"])}'


def _settings(run: Any) -> CheckpointSettings:
    return run if isinstance(run, CheckpointSettings) else CheckpointSettings.of_job_config(run)


class CheckpointDamaged(Exception):
    """A file of a checkpoint cannot be what its ``.metadata`` says: the message names it."""


def _folders(run: CheckpointSettings) -> tuple[dict[int, str], dict[int, str]]:
    """``(complete, incomplete)``: ``{step: path}`` of the step folders with / without ``.metadata``."""
    folder = os.path.join(run.dump_folder, run.folder)
    complete: dict[int, str] = {}
    incomplete: dict[int, str] = {}
    if not os.path.isdir(folder):
        return complete, incomplete
    for name in os.listdir(folder):
        m = _STEP.fullmatch(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path):
            (complete if os.path.isfile(os.path.join(path, ".metadata")) else incomplete)[int(m.group(1))] = path
    return complete, incomplete


def checkpoint_to_load(run: Any) -> Optional[str]:
    """The step folder torchtitan will load (its own rule), or None. Logs the newer folders it
    skips because their save did not finish. ``run``: a ``CheckpointSettings`` or a job config."""
    run = _settings(run)
    if not run.enable:
        return None
    complete, incomplete = _folders(run)
    wanted = run.load_step
    if wanted >= 0:
        return complete.get(wanted)
    step = max(complete, default=-1)
    newer = sorted(s for s in incomplete if s > step)
    if newer:
        logger.warning(
            "titan_commopt: skipping checkpoint folder(s) %s: no .metadata, their save did not finish "
            "(a rank stopped while saving); %s",
            ", ".join(os.path.basename(incomplete[s]) for s in newer),
            f"resuming from step-{step}" if step >= 0 else "no complete checkpoint: starting from scratch",
        )
    return complete.get(step)


# ---- reading a DCP checkpoint without loading it ----------------------------------------------
def read_metadata(path: str) -> Any:
    """The checkpoint's DCP ``Metadata``; ``CheckpointDamaged`` naming the file when it is unreadable,
    and when a data file it names is missing or shorter than the metadata says."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = os.path.join(path, ".metadata")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except EOFError:
        raise CheckpointDamaged(f"{meta_file} is empty or truncated") from None
    except (pickle.UnpicklingError, AttributeError, ImportError, ValueError, TypeError) as error:
        raise CheckpointDamaged(
            f"{meta_file} is not a readable DCP metadata file ({type(error).__name__}: {error})"
        ) from None
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for relative, end in sorted(need.items()):
        data_file = os.path.join(path, relative)
        if not os.path.isfile(data_file):
            raise CheckpointDamaged(f"{data_file} is missing (listed in {meta_file})")
        size = os.path.getsize(data_file)
        if size < end:
            raise CheckpointDamaged(
                f"{data_file} is truncated: {size} bytes, {meta_file} places data up to byte {end}"
            )
    return metadata


def saved_replicas(keys: Any) -> Optional[int]:
    """Replica count of the optimizer state among a checkpoint's keys (0: torchtitan's own
    optimizer; None: no optimizer state at all)."""
    indices = {int(m.group(1)) for k in keys if (m := REPLICA_KEY.match(k))}
    if not indices:
        return 0 if any(k.startswith("optimizer.") for k in keys) else None
    return max(indices) + 1


def read_record(path: str, metadata: Any) -> Optional[dict[str, Any]]:
    """Replica 0's ``commopt_resolved`` record (the run's resolved options, JSON) read from its
    ``.distcp`` file through DCP without a process group; None when the checkpoint has none."""
    key = f"optimizer.{replica_prefix(0)}{RESOLVED_KEY}"
    if key not in metadata.state_dict_metadata:
        return None
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    where = next(
        (os.path.join(path, info.relative_path) for index, info in (metadata.storage_data or {}).items()
         if index.fqn == key),
        path,
    )
    out: dict[str, Any] = {key: ""}
    try:
        dcp_load(out, storage_reader=FileSystemReader(path), no_dist=True)
        return json.loads(out[key])
    except Exception as error:  # noqa: BLE001 - any failure here is a damaged file, named below
        raise CheckpointDamaged(f"{where}: the record {key!r} cannot be read ({type(error).__name__})") from None


# ---- the comparison ---------------------------------------------------------------------------
def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _changes(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    return [f"{k} {_show(saved[k])} -> {_show(ours[k])}" for k in sorted(ours) if k in saved and saved[k] != ours[k]]


def _unloadable(path: str, keys: Any, excluded: tuple[str, ...], dp_degree: Optional[int],
                spelling: Spelling) -> Optional[str]:
    """What torchtitan would fail on inside DCP's load (a raw traceback on every rank), or None:
    a state it loads that the checkpoint lacks (the last step's checkpoint is model-only by default,
    ``[checkpoint] last_save_model_only``), or dataloader state saved for another data-parallel degree
    (torchtitan cannot reshard it)."""
    m = _STEP.fullmatch(os.path.basename(path))
    if m is None or int(m.group(1)) == 0:  # torchtitan loads only the model from step 0
        return None
    keys = list(keys)
    missing = [c for c in TORCHTITAN_STATES if c not in excluded and not any(k.startswith(c + ".") for k in keys)]
    if missing:
        later = [c for c in [*excluded, *missing] if c != "model"]
        return (
            f"cannot resume from {path}: it holds no {', '.join(missing)} state (only the model: torchtitan saves "
            f"the last step model-only, {spelling.setting('checkpoint', 'last_save_model_only', True)}). Resume from "
            f"an earlier checkpoint ({spelling.key('checkpoint', 'load_step')}), start from its weights at step 1 "
            f"with {spelling.setting('checkpoint', 'exclude_from_loading', later)}, or start afresh in another "
            "dump_folder"
        )
    ranks = {int(m.group(1)) for k in keys if (m := _DATALOADER_KEY.match(k))}
    if dp_degree is not None and "dataloader" not in excluded and ranks and max(ranks) + 1 != dp_degree:
        return (
            f"cannot resume from {path}: its dataloader state is for a data-parallel degree "
            f"(data_parallel_replicate_degree × data_parallel_shard_degree) of {max(ranks) + 1} and this run has "
            f"{dp_degree}, which torchtitan cannot reshard: resume with the same degrees, or "
            f"read the data from its start with {spelling.setting('checkpoint', 'exclude_from_loading', ['dataloader'])}"
        )
    return None


def resume_problem(run: Any, resolved: Any, replicas: int, dp_degree: Optional[int] = None) -> Optional[str]:
    """What keeps this run from resuming the checkpoint torchtitan would load (one line), or None.
    ``run``: a ``CheckpointSettings`` or a job config; ``dp_degree``: this run's data-parallel degree
    (dp_replicate × dp_shard), None: not checked."""
    run = _settings(run)
    spelling = run.spelling
    problem = load_step_problem(run)
    if problem is not None:
        return problem
    path = checkpoint_to_load(run)
    if path is None:
        return None
    try:
        metadata = read_metadata(path)
        problem = _unloadable(path, metadata.state_dict_metadata, run.exclude_from_loading, dp_degree, spelling)
        if problem:
            return problem
        optimizer_excluded = "optimizer" in run.exclude_from_loading
        saved = None if optimizer_excluded else saved_replicas(metadata.state_dict_metadata)
        record = read_record(path, metadata) if saved else None
    except CheckpointDamaged as damaged:
        return (
            f"cannot resume from {path}: {damaged}. Resume from an earlier checkpoint ("
            f"{spelling.key('checkpoint', 'load_step')}, or delete {os.path.basename(path)}), or start afresh in "
            "another dump_folder"
        )
    if saved is None:  # model-only checkpoint, or the optimizer is not loaded: nothing of ours to fit
        return None
    model_only = _model_only(spelling)
    prefix = f"cannot resume {spelling.setting('optimizer', 'name', run.optimizer_name)} from {path}"
    if resolved is not None and saved == 0:
        return f"{prefix}: it holds the state of torchtitan's own optimizer (AdamW/Adam); {model_only}"
    if resolved is None and saved > 0:
        holder = f"{record['optimizer']!r} " if record else "a titan_commopt optimizer "
        return f"{prefix}: it holds the per-replica state of {holder}for {saved} replicas; {model_only}"
    if resolved is None:
        return None
    if saved != replicas:
        return (
            f"{prefix}: it holds optimizer state for {saved} replicas and this run has {replicas}. Replica-local "
            "state (momenta, parameters between syncs) has no sound mapping onto another set of replicas: resume "
            "with the same data_parallel_replicate_degree (the shard degree may change when the dataloader state is "
            f"not loaded, {spelling.setting('checkpoint', 'exclude_from_loading', ['dataloader'], short=True)}: DCP "
            f"reshards the rest), or {model_only}"
        )
    if record is None:  # saved before records existed: the replica count is all we can check
        return None
    if record.get("family") != resolved.family.key:
        saved_table = spelling.table(f"commopt.{record.get('family')}")
        return (
            f"{prefix}: it holds the state of {record.get('optimizer')!r} ({saved_table}), "
            f"another family than this run's ({spelling.table(resolved.family.section)}) with other state: resume with "
            f"{spelling.setting('optimizer', 'name', record.get('optimizer'))}, or {model_only}"
        )
    ours_shape = json.loads(json.dumps(dict(resolved.family.state_shape(resolved))))
    saved_shape = record.get("state_shape") or {}
    for key in ours_shape:
        if key in saved_shape and saved_shape[key] != ours_shape[key]:
            section, saved_value = resolved.family.section, _show(saved_shape[key])
            return (
                f"{prefix}: {spelling.shown(section, key, saved_value)} in the checkpoint, "
                f"{_show(ours_shape[key])} in this run, and it shapes the optimizer state: resume with "
                f"{spelling.shown(section, key, saved_value, short=True)}, or {model_only}"
            )
    _log_allowed_changes(path, record, resolved)
    return None


def _log_allowed_changes(path: str, record: dict[str, Any], resolved: Any) -> None:
    ours = json.loads(json.dumps(resolved.record()))
    saved_hparams = dict(record.get("hparams", {}))
    ours_hparams = dict(ours["hparams"])
    saved_lr, ours_lr = saved_hparams.pop("lr", None), ours_hparams.pop("lr", None)
    options = _changes(record.get("options", {}), ours["options"])
    hparams = _changes(saved_hparams, ours_hparams)
    parts = []
    if options:
        parts.append(f"[{resolved.family.section}] " + ", ".join(options))
    if hparams:
        parts.append("[optimizer] " + ", ".join(hparams))
    if parts or record.get("optimizer") != resolved.name:
        logger.info(
            "titan_commopt: resuming %r state as %r from %s; changed options that do not shape the optimizer "
            "state apply from here: %s",
            record.get("optimizer"), resolved.name, path, "; ".join(parts) or "none but the name",
        )
    if saved_lr is not None and ours_lr is not None and saved_lr != ours_lr:
        logger.warning(
            "titan_commopt: effective lr ([optimizer] lr, or the family's lr / lr_scale) = %r in this run, %r in "
            "%s: torchtitan restores the LR scheduler "
            "from the checkpoint, and with it the checkpoint's base lr", ours_lr, saved_lr, path,
        )


def load_step_problem(run: Any) -> Optional[str]:
    """The one line that refuses ``[checkpoint] load_step`` (given: >= 0) when it names no complete
    step folder torchtitan would load, or None. Reads only the folder listing. ``run``: a
    ``CheckpointSettings`` or a job config."""
    run = _settings(run)
    spelling, wanted = run.spelling, run.load_step
    if wanted < 0:
        return None
    load_step = spelling.setting("checkpoint", "load_step", wanted)
    newest = spelling.setting("checkpoint", "load_step", -1, short=True)
    if not run.enable:
        return (f"{load_step} with {spelling.setting('checkpoint', 'enable', False)}: nothing is loaded; allowed is "
                f"{spelling.setting('checkpoint', 'enable', True)} to resume from it, or {newest} (the default)")
    if checkpoint_to_load(run) is not None:
        return None
    complete, incomplete = _folders(run)
    listing = f"complete checkpoints: {', '.join(f'step-{s}' for s in sorted(complete)) or 'none'}"
    if wanted in incomplete:
        return (
            f"{load_step}: {incomplete[wanted]} has no .metadata, its save did not "
            f"finish (a rank stopped while saving); {listing}"
        )
    folder = os.path.join(run.dump_folder, run.folder)
    # torchtitan: a missing folder means a first run, which loads initial_load_path if given
    if os.path.isdir(folder) or not run.initial_load_path:
        where = f"{folder} has no step-{wanted}" if os.path.isdir(folder) else f"{folder} does not exist"
        return f"{load_step}: {where}; {listing} ({newest}: the newest)"
    return None


def initial_load_problem(run: Any) -> Optional[str]:
    """The one line that refuses ``[checkpoint] initial_load_path`` when torchtitan will load it (a run
    that checkpoints, whose checkpoint folder does not exist yet) and it is no directory (torchtitan's
    ``ValueError`` traceback), or None; a remote one (``gs://...``) is not looked at. ``run``: a
    ``CheckpointSettings`` or a job config."""
    run = _settings(run)
    path = (run.initial_load_path or "").strip()
    folder = os.path.join(run.dump_folder, run.folder)
    if not run.enable or not path or "://" in path or os.path.isdir(folder) or os.path.isdir(path):
        return None
    return (f"{run.spelling.setting('checkpoint', 'initial_load_path', path)}: "
            f"{'not a directory' if os.path.exists(path) else 'no such directory'}; allowed is a checkpoint "
            f"directory, which torchtitan loads on a first run ({folder} does not exist yet)")


def check_resume(run: Any, resolved: Any, replicas: int, dp_degree: Optional[int] = None) -> None:
    """Refuse (one line, exit status 2) a resume that cannot work; see the module docstring. ``run``:
    a ``CheckpointSettings`` or a job config."""
    problem = resume_problem(run, resolved, replicas, dp_degree)
    if problem is not None:
        stop_run(problem, RESUME_REFUSED)


def ledger_saved(run: Any) -> bool:
    """Whether the optimizer state this run loads holds the comm ledger's totals (checkpoints
    written before they were saved do not: the ``comm/*_total`` scalars then count from the resume).
    True when no optimizer state is loaded. ``run``: a ``CheckpointSettings`` or a job config."""
    run = _settings(run)
    path = checkpoint_to_load(run)
    if path is None or "optimizer" in run.exclude_from_loading:
        return True
    keys = [k for k in read_metadata(path).state_dict_metadata if k.startswith("optimizer.")]
    if not keys or any(k.endswith("/" + LEDGER_KEY) or k == f"optimizer.{LEDGER_KEY}" for k in keys):
        return True
    logger.info("titan_commopt: %s predates the saved comm ledger totals: comm/*_total count from this resume", path)
    return False
