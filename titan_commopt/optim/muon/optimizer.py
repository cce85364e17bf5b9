"""Muon on HSDP (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"): the
data-parallel baseline of MuLoCo (Thérien et al. 2025, arXiv 2505.23725), ``[commopt.muon]``.

Every step, on every replica: the gradient averaged over R as AdamW-HSDP averages it (one fused
float32 all-reduce of the local gradient shards), then the hidden matrices step by Muon
(``engine.py``: momentum, Newton–Schulz of each whole matrix on its owner rank, the update) and the
parameters routed around them (embeddings, output head, norms, biases: ``optim/routing.py``) by
AdamW (torch's fused kernel) at ``lr × scalar_lr_scale``. The replicas apply the same update to the
same parameters: they stay equal (``params_replica_local = False``).

State per parameter: ``momentum_buffer`` (M, torch.optim.Muon's name) of a matrix, ``exp_avg`` and
``exp_avg_sq`` of an AdamW parameter, ``step`` (one shared CPU scalar tensor, ``local/steps.py``).
One setting is ``torch.optim.Muon`` on whole 2-D parameters (and torch's fused AdamW on the rest):
``muon_momentum_form = "lerp"``, ``muon_nesterov = true``, ``muon_coefficients = "keller"``,
``muon_lr_rule = "original"`` (``tests/test_muon.py`` holds it bit for bit).

Bytes per rank and step: R, the gradient's float32 all-reduce, 4·d (``traffic.adamw_hsdp_r_bytes``,
AdamW-HSDP's own); S and T, each cut matrix's pieces to its owner and back in ``muon_dtype``
(:func:`muon_s_bytes`, ``layout.exchange_bytes``). Host synchronizations: none per step.
"""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.options import option
from titan_commopt.topology import R, Topology

from .. import updates
from ..base import CommOptimizer
from ..common import LR_SCALE_HELP, BaseHParams
from ..family import Bytes, Family, Resolved, ShardShape
from ..local.steps import LocalSteps, chunk_limit, column_chunks, trainable
from ..traffic import adamw_hsdp_r_bytes
from .engine import MuonMatrices
from .layout import muon_shard_bytes
from .options import MuonOptions, muon_problems, routed_groups

__all__ = ["Config", "PRESETS", "PRESET_SOURCES", "Muon", "FAMILY", "check", "muon_r_bytes", "muon_s_bytes"]

SECTION = "commopt.muon"


@dataclass
class _Own:
    """``[commopt.muon]``'s keys besides the Muon step's."""

    lr: float = option(
        -1.0, "Initial learning rate (of the matrices); negative = [optimizer] lr × lr_scale. Wins over lr_scale "
        "(and over the preset's lr_scale) when set.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)
    weight_decay: float = option(-1.0, "Decoupled weight decay λ of the matrices; negative = [optimizer] weight_decay.")
    scalar_beta1: float = option(-1.0, "AdamW β1 of the routed parameters; negative = [optimizer] beta1.", lt=1.0)
    scalar_beta2: float = option(-1.0, "AdamW β2 of the routed parameters; negative = [optimizer] beta2.", lt=1.0)
    scalar_eps: float = option(-1.0, "AdamW ε of the routed parameters; negative = [optimizer] eps.")
    scalar_weight_decay: float = option(
        -1.0, "AdamW weight decay of the routed parameters; negative = the matrices' (weight_decay).")


@dataclass
class Config(MuonOptions, _Own):
    """``[commopt.muon]``."""


# The preset is MuLoCo's data-parallel Muon as its authors ran it; lr_scale is the one value a study sets.
PRESETS: dict[str, dict[str, Any]] = {
    "Muon": {"muon_momentum": 0.9, "muon_momentum_form": "undamped", "muon_nesterov": False,
             "muon_coefficients": "muloco", "muon_dtype": "bf16", "muon_lr_rule": "spectral_norm",
             "scalar_lr_scale": 1.0, "scalar_beta1": 0.9, "scalar_beta2": 0.99, "lr_scale": 1.0},
}

PRESET_SOURCES: dict[str, str] = {
    "Muon": "MuLoCo's data-parallel Muon baseline (Thérien et al. 2025, arXiv 2505.23725; facebookresearch/MuLoCo "
    "475bbf4): torchtitan/config/ddp/muon.py L12-15 (μ = 0.9, Nesterov off, spectral_norm lr √(fan_out/fan_in)), "
    "L2-3 (the routed AdamW's β = 0.9, 0.99), L28-31 (every lr factor 1: AdamW at the Muon lr); "
    "jobs/muloco_paper/ddp_baselines_h100.py L52-58 (nesterov=False, the Triton Newton–Schulz: "
    "experiments/dion_optimizer/muon.py L714-720's five triples, bf16, undamped momentum L623-624). Weight decay: "
    "[optimizer]'s (the authors rescale it with the run's length, jobs/.../diloco_muloco_no-compression_h100.py "
    "L331). lr_scale = 1, measured (docs/benchmarks.md §8.5: at cpu_micro, 20 tokens per parameter, Muon's best lr "
    "equals AdamW-HSDP's, 0.054, bracketed by worse ones); at the study's AdamW lr (0.027, scripts/convergence.py) "
    "it lands in the authors' Muon range (0.016–0.063, bentherien/muloco-1 muloco-1.md L66); their 3.1 B ratio "
    "Muon ÷ AdamW, 0.015625 ÷ 0.000691 ≈ 22.6 (diloco_muloco_no-compression_h100.py L280, L285), belongs to a "
    "3 B model's AdamW lr. torch.optim.Muon instead: muon_momentum_form = \"lerp\", muon_nesterov = true, "
    "muon_coefficients = \"keller\", muon_lr_rule = \"original\", muon_momentum = 0.95",
}


def _or(value: float, fallback: float) -> float:
    return fallback if value < 0 else value


def check(cfg: Config, hparams: BaseHParams) -> list[str]:
    """Cross-field rules of ``[commopt.muon]``, one line per problem."""
    problems = muon_problems(cfg, SECTION)
    for key, fallback in (("scalar_beta1", hparams.beta1), ("scalar_beta2", hparams.beta2)):
        value = _or(getattr(cfg, key), fallback)
        if not 0.0 <= value < 1.0:
            problems.append(f"[{SECTION}] {key} = {getattr(cfg, key)!r}: allowed is a number in [0, 1) "
                            f"(negative: [optimizer]'s, {fallback!r} here, which is not)")
    return problems[:1]


def muon_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """The gradient's float32 all-reduce over R every step: AdamW-HSDP's bytes (sent = received = 4·d)."""
    return adamw_hsdp_r_bytes(shards, replicate_size, 4)


def muon_s_bytes(shards: Sequence[ShardShape], resolved: Resolved, role: str = "S") -> Bytes:
    """The S (or T) payload per rank per step: the Muon step's exchanges (``layout.muon_shard_bytes``)."""
    return muon_shard_bytes(shards, resolved.options, role)


class Muon(LocalSteps, CommOptimizer):
    """Muon on the hidden matrices and AdamW on the rest, the gradient averaged over R every step
    (the module docstring). Param groups: ``algorithm`` (``muon`` / ``adamw``), ``lr``,
    ``weight_decay``, and for AdamW ``betas``, ``eps``."""

    params_replica_local = False  # every replica applies the same update: parameters agree

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional["comm.CommLedger"] = None) -> None:
        cfg, hp = options.options, options.hparams
        wd = _or(cfg.weight_decay, hp.weight_decay)
        adamw = dict(betas=(_or(cfg.scalar_beta1, hp.beta1), _or(cfg.scalar_beta2, hp.beta2)),
                     eps=_or(cfg.scalar_eps, hp.eps), weight_decay=_or(cfg.scalar_weight_decay, wd))
        groups = routed_groups(trainable(named_params), cfg, "Muon", lr=hp.lr, muon=dict(weight_decay=wd), adamw=adamw)
        super().__init__(groups, topology, options, dict(lr=hp.lr, weight_decay=wd), ledger=ledger)
        self.start_step_counter()
        self.muon = MuonMatrices(self.param_groups, topology, cfg)
        for group in self.param_groups:  # eager state: no init step of DCP / torchtitan ever runs ours
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        state["step"] = self._step_t
        for key in self._row_states(group):
            state.setdefault(key, zeros())

    @staticmethod
    def _row_states(group: dict) -> list[str]:
        return ["momentum_buffer"] if group["algorithm"] == "muon" else ["exp_avg", "exp_avg_sq"]

    def steps_to_next_sync(self) -> Optional[int]:
        return None

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, work = self.begin_local_step(closure, self._row_states)
        if work is None:
            return loss
        # G = mean_R(g): one fused float32 all-reduce, as AdamW-HSDP's, into this step's rows
        comm.all_reduce_fused([row[1] for _, rows in work.groups for row in rows], R, self.topology.replicate,
                              op="mean", dtype=torch.float32, ledger=self.ledger)
        matrices = []
        for group, rows in work.groups:
            if group["algorithm"] == "muon":
                continue
            b1, b2 = group["betas"]
            for xs, gs, ms, vs in column_chunks(rows, chunk_limit(rows[0][0].device)):
                updates.adamw_multi_(xs, gs, ms, vs, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                     weight_decay=group["weight_decay"], step=work.n, fused=True)
        rows_of = {id(group): rows for group, rows in work.groups}
        for group in self.param_groups:
            if group["algorithm"] == "muon" and id(group) in rows_of:
                stepping = [p for p in group["params"] if p.grad is not None]
                matrices += [(group, p, row[1], row[2]) for p, row in zip(stepping, rows_of[id(group)])]
        self.muon.step(matrices, self.runtime, self.ledger)
        return loss


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """The routing decides which parameters hold a momentum and which AdamW's moments."""
    cfg = resolved.options
    return {"embed_names": cfg.embed_names, "head_names": cfg.head_names}


def settings(resolved: Resolved) -> dict[str, Any]:
    """What decides the bytes: the gradient's all-reduce (R), the exchange dtype (S, T)."""
    return {"gradient_all_reduce": "float32", "muon_dtype": resolved.options.muon_dtype}


FAMILY = Family(
    key="muon",
    options=Config,
    presets=PRESETS,
    build=Muon,
    r_bytes=muon_r_bytes,
    check=check,
    state_shape=state_shape,
    settings=settings,
    preset_sources=PRESET_SOURCES,
    s_bytes=muon_s_bytes,
    summary="the gradient averaged over R every step (AdamW-HSDP's bytes); Muon (Newton–Schulz of each whole "
    "matrix on its owner rank of S/T) on the hidden matrices, AdamW on the rest",
)
