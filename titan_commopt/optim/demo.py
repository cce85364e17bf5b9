"""DeMo (Peng, Quesnelle, Kingma 2024, "Decoupled Momentum Optimization") and FlexDeMo/DeToNATION
("DeToNATION: Decoupled Torch Network-Aware Training on Interlinked Online Nodes").

Per parameter, on the local FSDP2 shard (S is reduce-scattered by FSDP2 as usual), on every replica:

    m ← β·m + g                       # eq. 2, fp32, never synchronized (DeMo-SGD base)
    q, wire ← Replicator.extract(m)   # DeMo: DCT-II chunks + top-k; Random / Striding / DiLoCo / Full
    m ← m − λ·q                       # eq. 8 (λ = 1: original DeMo)
    Q ← mean over R of the replicas' q   # eq. 5–6: one all-gather of every parameter's packed bytes
    p ← p·(1 − η·wd) − η·φ(Q)         # eq. 7; φ = sign | identity | Muon (Newton–Schulz on the shard)

The Decoupled-AdamW base keeps AdamW's two moments local and lets the replicator act on the AdamW
update ``m̂/(√v̂+ε)`` instead of ``m`` (no momentum subtraction: the moments are AdamW's own).

Only R carries traffic: rank j of one replica exchanges with rank j of the others, one fused
all-gather per step (``comm.all_gather`` of a ``uint8`` buffer; sizes known from shapes, so no
header). With |R| = 1 nothing is extracted: it is the base optimizer on FSDP (``φ(m)``). With |S| = 1
it is DDP-style DeMo. A rank never gathers a parameter. Every replica decodes the same bytes in the
same order, so parameters stay bit-identical across replicas while momenta differ (per-replica
state: checkpoints keep it per replica).

Shapes: a tensor with ≥ 2 dims is chunked as the matrix ``(d0, prod(rest))`` of its local shard, a
vector 1-D (see ``compress/dct.py``). The byte formula is ``traffic.demo_r_bytes``.

Tensor parallelism (T) and FSDP (S) only change which local shard a rank works on: the gradient is
first brought to the parameter's placements (``common.replica_grad``: a ``Partial`` norm-weight
gradient is summed over T, a ``Replicate`` embedding gradient sliced), and everything above —
chunking, top-k, the replicators' indices, the sign — acts on that shard. A parameter replicated
over T is processed identically on every T rank (same gradient, same bytes), so its copies stay
equal. ``rule = "muon"`` orthogonalizes each local shard on its own: Muon proper only where the
parameter is whole (|S| = |T| = 1), a per-shard Newton–Schulz otherwise.
"""

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.compress.replicators import KINDS, Replicator, make_replicator, rate_of
from titan_commopt.options import ConfigError, option
from titan_commopt.topology import R, Topology

from . import kernels
from .base import CommOptimizer, named_params
from .common import BaseHParams, NamedParams, local, replica_grad
from .family import Family, Resolved
from .orthogonalize import newton_schulz
from .traffic import demo_r_bytes

__all__ = ["Config", "PRESETS", "DeMo", "FAMILY", "build", "check", "newton_schulz"]

logger = logging.getLogger(__name__)


@dataclass
class Config:
    """``[commopt.demo]``."""

    replicator: str = option("demo", "What R carries: DCT top-k (demo), random, striding, diloco, full.",
                             choices=KINDS)
    chunk: int = option(64, "DCT chunk size s per dim (largest divisor of the dim <= s is used).", ge=1)
    topk: int = option(32, "DeMo replicator: coefficients kept per chunk (of s*s for matrices).", ge=1)
    compression_rate: float = option(
        0.0, "Fraction of entries sent by random/striding (per step) and diloco (1/period); 0 = topk/chunk^2.",
        ge=0.0, le=1.0)
    beta: float = option(0.999, "Momentum decay beta of DeMo-SGD (eq. 2, 'compression decay').", ge=0.0, lt=1.0)
    momentum_subtraction: float = option(1.0, "lambda: m <- m - lambda*q after extraction (1 = DeMo).",
                                         ge=0.0, le=1.0)
    base: str = option("sgd", "Base optimizer: DeMo-SGD (sgd) or Decoupled AdamW (adamw).", choices=("sgd", "adamw"))
    rule: str = option("sign", "phi applied to the aggregated update: sign, identity or muon.",
                       choices=("sign", "identity", "muon"))
    sign_before_sync: bool = option(False, "Send sign(values) (ternary wire) instead of the values.")
    transfer_dtype: str = option("bf16", "Wire dtype of non-ternary values.", choices=("fp32", "bf16", "fp16"))
    pack: bool = option(True, "Packed wire: indices in ceil(log2(L)) bits, ternary in 2 bits (off: int64 indices).")
    aggregate: str = option("mean", "Average over all replicas (paper) or over those that selected (reference).",
                            choices=("mean", "mean_selected"))
    ns_steps: int = option(5, "Newton-Schulz iterations of rule = muon.", ge=1)
    seed: int = option(0, "Seed of the random replicator's shared indices.", ge=0)


PRESETS: dict[str, dict[str, Any]] = {
    "DeMo": {},  # the Config defaults are DeMo's (s = 64, k = 32, beta = 0.999, sign after aggregation)
    # DeToNATION's defaults: chunk 32, sign before sync (ternary), fp32 transfer; k = 16 → rate 1/64
    "FlexDeMo": {"chunk": 32, "topk": 16, "sign_before_sync": True, "transfer_dtype": "fp32"},
}


def check(cfg: Config, hparams: BaseHParams | None = None) -> list[str]:
    """Cross-field rules of ``[commopt.demo]``, one line per problem."""
    if cfg.replicator == "demo" and cfg.topk > cfg.chunk**2:
        return [f"[commopt.demo] topk = {cfg.topk}: allowed is at most chunk^2 = {cfg.chunk**2} (chunk = {cfg.chunk})"]
    return []


class DeMo(CommOptimizer):
    """DeMo / FlexDeMo on one replica's shards. ``params``: (named) parameters or param groups;
    a parameter's name seeds the random replicator's shared indices."""

    params_replica_local = False  # every replica applies the same aggregated Q: parameters agree

    def __init__(self, params, topology: Topology, cfg: Config, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        problems = check(cfg)
        if problems:
            raise ConfigError("\n".join(problems))
        defaults = dict(lr=lr, weight_decay=weight_decay, beta=cfg.beta, lam=cfg.momentum_subtraction,
                        betas=betas, eps=eps)
        super().__init__(params, defaults)
        self.topology, self.cfg = topology, cfg
        self._names = {id(p): name for _, name, p in named_params(self.param_groups)}
        self._replicators: dict[int, Replicator] = {}

    def _replicator(self, p: torch.Tensor, x: torch.Tensor) -> Replicator:
        key = id(p)
        if key not in self._replicators:
            self._replicators[key] = make_replicator(self.cfg, x.shape, self._names[key], device=x.device)
        return self._replicators[key]

    def steps_to_next_sync(self) -> Optional[int]:
        """The diloco replicator sends every ``period`` steps; every other replicator every step."""
        if self.cfg.replicator != "diloco" or self.topology.replicate_size == 1:
            return None
        period = max(1, round(1 / rate_of(self.cfg)))  # as make_replicator
        if period == 1:
            return None
        t = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)
        return period - t % period

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            zeros = lambda: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if self.cfg.base == "sgd":
                state["momentum"] = zeros()
            else:
                state["exp_avg"], state["exp_avg_sq"] = zeros(), zeros()
        return state

    def _phi(self, u: torch.Tensor) -> torch.Tensor:
        if self.cfg.rule == "sign":
            return u.sign()
        if self.cfg.rule == "muon":  # on the local shard: Muon proper only where |S| = |T| = 1
            return newton_schulz(u, self.cfg.ns_steps)
        return u

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        W = self.topology.replicate_size
        pending = []  # (p, group, replicator, step, payload)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                t = int(state["step"].item())
                g = replica_grad(p, self.topology).float()
                if self.cfg.base == "sgd":
                    x = kernels.heavy_ball_(local(state["momentum"]), g, group["beta"])  # eq. 2, x is m itself
                else:
                    # decoupled AdamW: moments stay local, the replicator sees the bias-corrected update
                    b1, b2 = group["betas"]
                    x = kernels.adam_direction_(g, local(state["exp_avg"]), local(state["exp_avg_sq"]),
                                                beta1=b1, beta2=b2, eps=group["eps"], step=t)
                if x.numel() == 0:
                    continue
                if W == 1:  # nobody to sync with: the base optimizer on this shard
                    self._apply(p, group, x)
                    continue
                rep = self._replicator(p, x)
                q, payload = rep.extract(x, t)
                if q is not None and self.cfg.base == "sgd":
                    x.sub_(q, alpha=group["lam"])  # eq. 8
                pending.append((p, group, rep, t, payload))
        sizes = [0 if pl is None else pl.numel() for *_, pl in pending]
        if sum(sizes):
            buf = torch.cat([pl for *_, pl in pending if pl is not None])
            gathered = comm.all_gather(buf, R, self.topology.replicate)  # [W, bytes], the only R traffic
            offset = 0
            for (p, group, rep, t, _), n in zip(pending, sizes):
                if n:
                    Q = rep.aggregate(gathered[:, offset: offset + n], t)
                    self._apply(p, group, Q)
                offset += n
        return loss

    def _apply(self, p: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        x = local(p)
        kernels.descend_(x, self._phi(update).to(x.dtype), group["lr"], group["weight_decay"])  # eq. 7


# ---- the family ------------------------------------------------------------------------------------
def build(named_params: NamedParams, topology: Topology, resolved: Resolved) -> DeMo:
    cfg, hp = resolved.options, resolved.hparams
    opt = DeMo(named_params, topology, cfg, lr=hp.lr, weight_decay=hp.weight_decay, betas=(hp.beta1, hp.beta2),
               eps=hp.eps)
    logger.info("%s: %s", resolved.name, topology.describe())  # the options are logged once, resolved
    return opt


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the base (DeMo-SGD's momentum vs AdamW's two moments)."""
    return {"base": resolved.options.base}


FAMILY = Family(
    key="demo",
    options=Config,
    presets=PRESETS,
    build=build,
    r_bytes=demo_r_bytes,
    check=check,
    state_shape=state_shape,
    summary="top-k DCT coefficients of the decoupled momentum (DeMo), or a DeToNATION replicator (FlexDeMo)",
)
