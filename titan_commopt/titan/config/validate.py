"""One pass over a job config: ``[optimizer]`` + ``[commopt]`` → the run's resolved optimizer.

:func:`resolve_options` is the one way a name and a ``[commopt]`` section become a
:class:`~titan_commopt.optim.Resolved` value (``None`` for torchtitan's own AdamW/Adam), on every
route of both torchtitan lines: it checks ``[optimizer] name``, every ``[commopt]`` value and the
chosen family's cross-field rules, and lists every problem together (each one line). What the
routes differ in is handed to it: which family keys the user gave (the preset fills the others),
the hyper-parameters, and the problems found elsewhere.

:func:`resolve_job` is the TOML route's (0.2.2, and our TOML on 0.3): it adds the torchtitan values
every run depends on (``torchtitan_keys.py``: learning rate, betas, batch sizes, mesh against the
world size, the model, tokenizer and dataset the line knows, ...) and the torchtitan settings our
optimizers refuse. :class:`CheckedJob` is its result with the keys the user set and the warnings;
nothing touches a process group, so ``titan_commopt.train`` makes it before torchtitan starts.

:func:`run_warnings` names what a valid config does that the user probably did not mean, one line
each: a ``[commopt.<family>]`` table the chosen optimizer does not read, MT-DAO's switch at the
end of a warm-up in a run too short for it, and a ``[validation]`` that reads the training text.
"""

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional

from titan_commopt.corpora import HELD_OUT
from titan_commopt.optim import FAMILIES, BaseHParams, Family, Resolved, family_of, owns_replicate_sync, resolve
from titan_commopt.options import ConfigError, problems as option_problems

from .checkpoint import CheckpointSettings
from .parse import ParsedJob
from .resume import initial_load_problem, load_step_problem
from .section import commopt_of
from .sources import given_options, user_set_keys
from .fault_tolerance_keys import LIGHTHOUSE_ENV, FtSettings, evaluation_problems, problems as ft_problems
from .torchtitan_keys import SpecProblems, torchtitan_problems, world_size_from_env

__all__ = [
    "resolve_options", "resolve_job", "hparams_of", "CheckedJob", "run_warnings", "unread_tables", "short_run_switch",
    "validating_on_training_text", "SWITCH_MIN_STEPS", "checkpoint_to_load_problems", "clip_scope_problems",
]

# MT-DAO's switch at the end of warm-up (``[commopt.local] switch_at = "warmup"``) is recommended only
# for runs at least this long: the MT-DAO paper switches after a 2048-step warm-up (appendix B.2),
# when the gradient direction changes slowly; after a short warm-up the momentum carried into the
# slow β1 = 0.999 misleads training for hundreds of steps (docs/benchmarks.md §4).
SWITCH_MIN_STEPS = 2048


def hparams_of(optimizer_config: Any, warmup_steps: int) -> BaseHParams:
    """``[optimizer]``'s generic knobs (0.2.2's ``[optimizer]``, or our 0.3 container's config), and
    the LR scheduler's warm-up steps (MT-DAO's switch at the end of warm-up reads them)."""
    return BaseHParams(
        lr=optimizer_config.lr,
        beta1=optimizer_config.beta1,
        beta2=optimizer_config.beta2,
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
        warmup_steps=int(warmup_steps),
    )


def resolve_options(
    name: str, section: Any, hparams: BaseHParams, given: Callable[[Family], dict[str, Any]], *,
    found: Iterable[str] = (), refused_with_ours: Iterable[str] = (),
) -> Optional[Resolved]:
    """Optimizer ``name`` with the ``[commopt]`` ``section``, resolved (``None`` for torchtitan's own
    AdamW/Adam), or ``ConfigError`` listing every problem: ``found`` (found elsewhere, listed first),
    the section's values (every table as given; the chosen family's is checked as resolved),
    ``refused_with_ours`` (settings refused with an optimizer of ours), and the family's own rules.
    ``given(family)``: the family keys the user gave, which the name's preset does not replace."""
    found = list(found) + clip_scope_problems(getattr(section, "clip_scope", "auto"), name)
    commopt = option_problems(section, "commopt")
    if not owns_replicate_sync(name):
        found += commopt
        if found:
            raise ConfigError("\n".join(found))
        return None
    try:
        family = family_of(name)
    except ConfigError as error:  # an unknown name: listed with what exists
        raise ConfigError("\n".join([str(error)] + found + commopt)) from None
    found += [line for line in commopt if not line.startswith(f"[{family.section}]")]
    found += refused_with_ours
    resolved = None
    try:
        resolved = resolve(name, given(family), hparams, kernels=section.kernels)
    except ConfigError as error:
        found.append(str(error))
    if found:
        raise ConfigError("\n".join(found))
    return resolved


def clip_scope_problems(scope: str, name: str) -> list[str]:
    """``[commopt] clip_scope = "replica"`` for an optimizer whose replicas do not step alone: one line."""
    if scope != "replica" or (owns_replicate_sync(name) and family_of(name).local_steps):
        return []
    alone = ", ".join(sorted(n for f in FAMILIES.values() if f.local_steps for n in f.presets))
    return [f"[commopt] clip_scope = \"replica\" with [optimizer] name = {name!r}: allowed only for the optimizers "
            f"whose replicas step alone between syncs ({alone}); the others average every step, so every "
            "replica is clipped alike: \"replicas\" or \"auto\""]


# Settings of torchtitan that the optimizers owning R have not been built or tested for: refused
# rather than silently wrong. (key path, the value that is refused, why)
_UNSUPPORTED_WITH_OWN_R_SYNC = (
    ("optimizer.early_step_in_backward", True, "the optimizer must step once per step, after backward"),
    ("parallelism.pipeline_parallel_degree", lambda v: v > 1, "pipeline parallelism is not supported yet"),
    ("parallelism.expert_parallel_degree", lambda v: v > 1, "expert parallelism is not supported yet"),
    ("training.enable_cpu_offload", True, "FSDP CPU offload is not supported yet"),
)


def _lookup(job_config: Any, path: str) -> Any:
    value = job_config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _unsupported(job_config: Any, name: str) -> list[str]:
    out = []
    for path, refused, why in _UNSUPPORTED_WITH_OWN_R_SYNC:
        value = _lookup(job_config, path)
        if refused(value) if callable(refused) else value == refused:
            section, key = path.rsplit(".", 1)
            out.append(f"[{section}] {key} = {value!r} with [optimizer] name = {name!r}: {why}")
    return out


def resolve_job(
    job_config: Any, user_keys: dict[str, set[str]], world_size: Optional[int], spec_problems: SpecProblems,
    ft: FtSettings,
) -> Optional[Resolved]:
    """The run's resolved optimizer (``None`` for torchtitan's own), or ``ConfigError`` listing
    every problem. ``user_keys``: the ``[commopt]`` keys the user set (``sources.user_set_keys``);
    ``world_size`` (None: torchrun's ``WORLD_SIZE``, when set) is checked against the mesh;
    ``spec_problems``: the installed line's checks of the model, tokenizer and data; ``ft``: the
    job's ``[fault_tolerance]`` section."""
    world_size = world_size_from_env() if world_size is None else world_size
    name = job_config.optimizer.name
    ft_lines = ft_problems(ft, dp_replicate=job_config.parallelism.data_parallel_replicate_degree,
                           lighthouse=os.environ.get(LIGHTHOUSE_ENV))
    resolved = resolve_options(
        name, commopt_of(job_config), hparams_of(job_config.optimizer, job_config.lr_scheduler.warmup_steps),
        lambda family: given_options(job_config, family.key, user_keys),
        found=torchtitan_problems(job_config, world_size, spec_problems) + ft_lines
        + checkpoint_to_load_problems(CheckpointSettings.of_job_config(job_config), ft),
        refused_with_ours=_unsupported(job_config, name),
    )
    # need the resolved options: checked once they are valid
    evaluating = evaluation_problems(ft, resolved, job_config.validation.enable)
    if evaluating:
        raise ConfigError("\n".join(evaluating))
    return resolved


def checkpoint_to_load_problems(checkpoint: CheckpointSettings, ft: FtSettings) -> list[str]:
    """``[checkpoint] load_step`` naming no complete checkpoint of this run (of this replica group's
    folder under fault tolerance), an ``initial_load_path`` a first run would load that is no
    directory: the resume check's lines, before any process group exists."""
    group = replace(checkpoint, folder=ft.checkpoint_folder(checkpoint.folder))
    return [p for p in (load_step_problem(group), initial_load_problem(group)) if p is not None]


@dataclass
class CheckedJob:
    """A command line and its TOML, parsed once and checked (:meth:`of`): the job config, the
    ``[commopt.<family>]`` keys the user set, the resolved optimizer (None: torchtitan's AdamW/Adam),
    the warnings (one line each: valid, but probably not meant) and the ``[fault_tolerance]`` settings
    (read here once: the checks and 0.2.2's Trainer use them). Each torchtitan line's run adds what it
    builds from it."""

    job_config: Any
    user_keys: dict[str, set[str]]
    resolved: Optional[Resolved]
    warnings: list[str]
    ft_settings: FtSettings

    @classmethod
    def of(cls, parsed: ParsedJob, world_size: Optional[int], spec_problems: SpecProblems) -> Any:
        """``ConfigError`` lists every problem; see :func:`resolve_job`."""
        user_keys = user_set_keys(parsed.args, parsed.toml)
        ft = FtSettings.of(getattr(parsed.job_config, "fault_tolerance", None))
        resolved = resolve_job(parsed.job_config, user_keys, world_size, spec_problems, ft)
        return cls(parsed.job_config, user_keys, resolved, run_warnings(parsed.job_config, user_keys, resolved), ft)


def unread_tables(name: str, user_keys: dict[str, set[str]]) -> list[str]:
    """One line per ``[commopt.<family>]`` table with keys the user set that optimizer ``name`` does
    not read (every such table for torchtitan's own AdamW/Adam). Its values are still checked."""
    reads = family_of(name).key if owns_replicate_sync(name) else None
    what_it_reads = f"[commopt.{reads}]" if reads else "no [commopt.<family>] table (torchtitan's own optimizer)"
    out = []
    for key, family in FAMILIES.items():
        keys = sorted(user_keys.get(key, ()))
        if key == reads or not keys:
            continue
        readers = ", ".join(sorted(family.presets))
        out.append(
            f"[commopt.{key}] {', '.join(keys)}: set, but [optimizer] name = {name!r} reads {what_it_reads}; "
            f"ignored ([commopt.{key}] is read by {readers})"
        )
    return out


def short_run_switch(job_config: Any, resolved: Optional[Resolved]) -> list[str]:
    """One line when MT-DAO's switch at the end of warm-up falls inside a run shorter than
    :data:`SWITCH_MIN_STEPS`."""
    if resolved is None or getattr(resolved.options, "switch_at", 0) != "warmup":
        return []
    steps, warmup = job_config.training.steps, resolved.hparams.warmup_steps
    if not 0 < warmup < steps < SWITCH_MIN_STEPS:
        return []  # no warm-up (no switch), a switch the run never reaches, or a run long enough
    section = resolved.family.section
    origin = "as set" if "switch_at" in resolved.user_set else f"from the {resolved.name} preset"
    return [
        f"[{section}] switch_at = 'warmup' ({origin}) with [training] steps = {steps}: the switch at the end "
        f"of warm-up (step {warmup}) is meant for runs of at least {SWITCH_MIN_STEPS} steps (after a short "
        f"warm-up the carried momentum misleads training for hundreds of steps); set [{section}] switch_at = 0 "
        f"(--{section}.switch_at 0)"
    ]


def validating_on_training_text(job_config: Any) -> list[str]:
    """One line when ``[validation]`` reads the training corpus itself: its loss is not a held-out loss."""
    training, validation = job_config.training, job_config.validation
    if not validation.enable or (validation.dataset.lower(), validation.dataset_path) != (
            training.dataset.lower(), training.dataset_path):
        return []
    heldout = HELD_OUT.get(training.dataset.lower())
    instead = f"; its held-out twin is {heldout!r}" if heldout else ""
    return [f"[validation] dataset = {validation.dataset!r} is the [training] dataset: the validation loss is then "
            f"measured on text the model trains on, not held-out text{instead}"]


def run_warnings(job_config: Any, user_keys: dict[str, set[str]], resolved: Optional[Resolved]) -> list[str]:
    """What a valid config does that is probably not meant, one line each (:func:`resolve_job` has
    passed, so ``[optimizer] name`` is known)."""
    return (unread_tables(job_config.optimizer.name, user_keys) + short_run_switch(job_config, resolved)
            + validating_on_training_text(job_config))
