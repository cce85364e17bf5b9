"""The Muon step's options, written once: the same keys in every table that runs it ([commopt.muon],
[commopt.local] with ``base = "muon"``, [commopt.sparseloco] with ``inner = "muon"``), their
cross-field rules, the learning-rate factor of each matrix, and the param groups the routing makes.

Where the references differ, the default is MuLoCo's code (facebookresearch/MuLoCo, whose Muon is
microsoft/dion's): undamped momentum, no Nesterov, its five Newton–Schulz triples in bfloat16,
lr·√(fan_out/fan_in). The other readings are options: torch.optim.Muon's (lerp momentum, Nesterov,
Keller Jordan's triple, √max(1, m/n) or 0.2·√max(m, n)). Differences taken, not offered, each below
bfloat16's rounding (2⁻⁸): the Frobenius norm is clamped at ``muon_eps`` (torch's ``norm.clamp(eps)``)
where MuLoCo divides by ``norm + eps`` (a relative ε/ν for a matrix of norm ν); each iteration runs
torch's fused ``addmm`` whichever the coefficients (MuLoCo's code: separate products and sums); the
update η·r·O is added in the parameter's dtype (MuLoCo's code multiplies O by η·r in bfloat16 first).
A 3-D parameter is a stack of matrices, each orthogonalized alone (MuLoCo's configs flatten it to one
matrix, ``flatten = True``).
"""

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch

from titan_commopt.options import option

from ..routing import EMBED_NAMES, HEAD_NAMES, named_pairs, route

__all__ = ["MuonOptions", "muon_problems", "lr_ratio", "routed_groups", "is_muon_matrix", "MATRIX_NDIMS", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # muon_dtype
MATRIX_NDIMS = (2, 3)  # a matrix, or a stack of them (MoE experts: each [m, n] slice on its own)


@dataclass
class MuonOptions:
    """The Muon step of the hidden matrices, and the routing of the rest to AdamW."""

    muon_momentum: float = option(0.95, "Muon's momentum decay μ.", ge=0.0, lt=1.0)
    muon_momentum_form: Literal["undamped", "lerp"] = option(
        "undamped", "M ← μ·M + G (undamped: MuLoCo's and Keller Jordan's code, torch.optim.Muon's docstring) or "
        "M ← μ·M + (1 − μ)·G (lerp: torch.optim.Muon's code).")
    muon_nesterov: bool = option(
        False, "Orthogonalize the Nesterov look-ahead instead of M: G + μ·M (undamped) or G.lerp(M, μ) (lerp, "
        "torch's).")
    muon_coefficients: Literal["muloco", "keller"] = option(
        "muloco", "Newton–Schulz (a, b, c): MuLoCo's five triples, one per iteration (muloco), or Keller Jordan's "
        "(3.4445, −4.7750, 2.0315) every iteration (keller, torch.optim.Muon's).")
    muon_ns_steps: int = option(
        5, "Newton–Schulz iterations (keller; muloco's schedule is its five triples: 5 only).", ge=1, le=99)
    muon_dtype: Literal["bf16", "fp32"] = option(
        "bf16", "Precision of the Newton–Schulz iterations and of what the matrices' shard groups exchange for "
        "them (bf16: MuLoCo's and torch's).")
    muon_eps: float = option(1e-7, "The Frobenius norm Newton–Schulz divides by is at least this.", gt=0.0)
    muon_lr_rule: Literal["spectral_norm", "original", "match_rms_adamw"] = option(
        "spectral_norm", "lr of an m×n matrix (m = rows = fan_out): lr·√(m/n) (spectral_norm: MuLoCo's), "
        "lr·√max(1, m/n) (original: Keller Jordan's, torch.optim.Muon's default) or lr·0.2·√max(m, n) "
        "(match_rms_adamw: Moonshot's, torch's option).")
    embed_names: str = option(EMBED_NAMES, "Comma-separated module names routed as embeddings (to AdamW).")
    head_names: str = option(HEAD_NAMES, "Comma-separated module names routed as the output head (to AdamW).")
    scalar_lr_scale: float = option(
        1.0, "lr of the parameters routed to AdamW (embeddings, head, norms, biases) = the effective lr × this "
        "(MuLoCo's code: 1, AdamW at the Muon lr).", gt=0.0)


def muon_problems(cfg: Any, section: str) -> list[str]:
    """The Muon options' cross-field rules, one line each."""
    if cfg.muon_coefficients == "muloco" and cfg.muon_ns_steps != 5:
        return [f"[{section}] muon_ns_steps = {cfg.muon_ns_steps}: allowed is 5 with muon_coefficients = "
                "\"muloco\" (its five triples, one per iteration); other counts with \"keller\""]
    return []


def lr_ratio(rule: str, m: int, n: int) -> float:
    """The factor of the lr of an m×n matrix (m rows = fan_out, n columns = fan_in)."""
    if rule == "spectral_norm":
        return math.sqrt(m / n)  # RMS operator norm 1 (MuLoCo; Bernstein's "modular norm")
    if rule == "original":
        return math.sqrt(max(1, m / n))  # Keller Jordan's, torch's adjust_lr_fn=None
    return 0.2 * math.sqrt(max(m, n))  # the update's RMS as AdamW's (Moonshot), torch's "match_rms_adamw"


def is_muon_matrix(fqn: str, shape: tuple[int, ...], cfg: Any) -> bool:
    """Whether a parameter gets the Muon step (the shared routing's hidden matrix, 2-D or a stack)."""
    return route(fqn, len(shape), cfg.embed_names, cfg.head_names, MATRIX_NDIMS) == "matrix"


def routed_groups(named_params: Iterable[Any], cfg: Any, family: str, *, lr: float, muon: dict, adamw: dict) -> list[dict]:
    """The param groups of a family with a Muon step, from ``(fqn, param)`` pairs (or param-group dicts
    carrying only them): the hidden matrices (``algorithm = "muon"``, at ``lr``, with the settings
    ``muon``), then the rest (``algorithm = "adamw"``, at ``lr × scalar_lr_scale``, with ``adamw``).
    Empty groups are left out."""
    matrices, rest = [], []
    for fqn, p in named_pairs(named_params, family):
        (matrices if is_muon_matrix(fqn, tuple(p.shape), cfg) else rest).append((fqn, p))
    groups = [dict(params=matrices, algorithm="muon", lr=lr, **muon),
              dict(params=rest, algorithm="adamw", lr=lr * cfg.scalar_lr_scale, **adamw)]
    return [g for g in groups if g["params"]]
