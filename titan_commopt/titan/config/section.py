"""The ``[commopt]`` TOML section: a JobConfig extension for ``--job.custom_config_module``.

``[commopt]`` holds options common to every family; each family's own options live in a sub-table
named after the family key of the registry (``[commopt.demo]``, ``[commopt.local]``,
``[commopt.dion]``), whose dataclass is the family's ``options``. On the command line:
``--commopt.demo.chunk 32``. Which keys the user set is ``titan/config/sources.py``'s business.

No ``from __future__ import annotations`` here: torchtitan merges config classes by reading each
field's type as a class.
"""

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal

from titan_commopt.optim import FAMILIES
from titan_commopt.options import option


@dataclass
class CommonOptions:
    """Options shared by all families (the ``[commopt]`` table itself)."""

    hsdp_estimates: bool = option(
        True, "Record FSDP2's own collectives (S all-gather/reduce-scatter, HSDP's R all-reduce) as "
        "estimated bytes from parameter sizes."
    )
    on_nonfinite: Literal["skip", "stop", "off"] = option(
        "skip", "A NaN/Inf gradient on any rank: every rank skips that optimizer step (skip), the job "
        "stops with an error (stop), or nothing is checked (off).",
    )
    check_replicas_every: int = option(
        0, "Every N optimizer steps, compare a fingerprint of every parameter across replicas (R) and "
        "stop the run on every rank (one line naming the first that differs, exit status 1) if one "
        "differs (only at steps where the optimizer keeps replicas equal). 0 = off.", ge=0,
    )
    kernels: Literal["auto", "torch", "triton"] = option(
        "auto", "Which implementation runs the optimizers' per-element and per-chunk math: fused Triton "
        "kernels (triton) or torch's eager operators (torch, the reference). auto: Triton where the "
        "parameters are on a CUDA/ROCm device and Triton is installed, torch elsewhere.",
    )
    ft_start_wait_s: float = option(
        120.0, "Under [fault_tolerance]: a job's first step waits up to this many seconds for all of its "
        "group_size replica groups to join the quorum, so that it starts with all of them (a group that "
        "starts later joins then and heals from the others). 0 = start with whoever is there.", ge=0,
    )
    ft_stall_timeout_s: float = option(
        60.0, "Under [fault_tolerance]: a replica group whose step (forward, backward, optimizer, commit; "
        "not the wait for a quorum, not the first step) takes longer than this many seconds is stalled: "
        "every rank of it exits (one line, status 1), so that the lighthouse drops it and the other groups "
        "go on (torchft never drops a group that still heartbeats). Keep it below the quorum timeout "
        "(TORCHFT_QUORUM_TIMEOUT_SEC, 120 s here). 0 = never.", ge=0,
    )
    clip_scope: Literal["auto", "replicas", "replica"] = option(
        "auto", "The gradient norm [training] max_norm clips by, for an optimizer of ours. replicas: "
        "sqrt(mean over the replicas of |g_r|^2), every replica scaled alike (one 8-byte all-reduce over the "
        "world every step, which also agrees each step's NaN/Inf skip). replica: each replica by its own "
        "gradient's norm, as every worker of Templar's SparseLoCo and of torchtitan's fault-tolerant DiLoCo "
        "clips (no R collective in the step: a NaN/Inf step is skipped by that replica alone, keeping the sync "
        "schedule, and a stop it decides is agreed at the next R sync); only for the optimizers whose replicas "
        "step alone between syncs. auto: replica for those (DiLoCo, LocalAdam, DES-LOC, MT-DAO, MuLoCo, "
        "SparseLoCo), replicas for the others.",
    )
    max_consecutive_skips: int = option(
        10, "Stop the run (one line, exit status 1) once this many optimizer steps in a row were skipped "
        "for a NaN/Inf gradient (on_nonfinite = \"skip\"): training cannot recover by itself. 0 = never "
        "stop.", ge=0,
    )


def _family_fields() -> list[tuple[str, type, Any]]:
    return [(key, family.options, field(default_factory=family.options)) for key, family in FAMILIES.items()]


CommOpt = make_dataclass(
    "CommOpt",
    [(f.name, f.type, f) for f in fields(CommonOptions)] + _family_fields(),
    bases=(CommonOptions,),
)
CommOpt.__doc__ = "The [commopt] section: common options plus one sub-table per optimizer family."


@dataclass
class JobConfig:
    commopt: CommOpt = field(default_factory=CommOpt)  # type: ignore[valid-type]


MODULE = "titan_commopt.titan.config"  # what --job.custom_config_module names (this package exports JobConfig)


def commopt_of(job_config: Any) -> Any:
    section = getattr(job_config, "commopt", None)
    if section is None:
        raise RuntimeError(
            f"the job config has no [commopt] section: pass --job.custom_config_module {MODULE}"
        )
    return section


def family_config(job_config: Any, family: str) -> Any:
    return getattr(commopt_of(job_config), family)
