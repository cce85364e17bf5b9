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

Cost (DeMo replicator, SGD base, |R| > 1). The DCT is orthonormal and linear, so the momentum is kept
as its coefficients: eq. 2 becomes ``m_dct ← β·m_dct + DCT(g)``, top-k reads ``m_dct`` and eq. 8
subtracts ``λ·`` the selected coefficients in place. A step is one forward transform (of the gradient)
and one inverse (of the aggregate: the ``W·k`` coefficients per chunk scattered into a dense chunk,
then two matrix products; a sparse inverse was measured slower on CPU). Shards of one local shape are
batched: one transform, one top-k, one packing per shape group, written straight into the fused send
buffer. The step reads no tensor value on the host (per-parameter step counts are Python ints).

``overlap``: step t's all-gather is left in flight at the end of ``step()`` and its update applied at
the start of step t+1's (after that step's forward/backward, which it overlaps), so parameters are
one update behind the momenta: a different algorithm (in a toy 2-replica regression it ended ~30 %
higher in loss after 400 steps), off by default; the all-gather it hides is under 1 % of a CPU step
here. An update is applied with the learning rate and weight decay of the step that computed it.
``flush()`` applies a pending update now; ``state_dict()`` flushes first, so a checkpoint holds no
update in flight and a resumed run equals the run that saved it (the run that saves applies that
update one step early, as the resumed run does). The last step's update waits for a ``flush()``.
"""

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.compress.dct import Chunker
from titan_commopt.compress.replicators import KINDS, DeMoReplicator, Replicator, make_replicator, period_of
from titan_commopt.options import ConfigError, option
from titan_commopt.topology import R, Topology

from . import kernels
from .base import CommOptimizer, named_params
from .common import LR_SCALE_HELP, BaseHParams, NamedParams, local, replica_grad
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
    overlap: bool = option(
        False, "All-gather step t's payload during step t+1's forward/backward and apply its update at the "
        "start of step t+1 (one step stale; off: applied within step t).")
    lr: float = option(
        -1.0, "Initial learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and over "
        "the preset's lr_scale) when set.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)


# lr_scale: the quality study's best lr ÷ AdamW-HSDP's best (docs/benchmarks.md §4).
PRESETS: dict[str, dict[str, Any]] = {
    # the Config defaults are DeMo's (s = 64, k = 32, beta = 0.999, sign after aggregation)
    "DeMo": {"lr_scale": 0.333},
    # The FlexDeMo paper's experiments: chunk 32, sign before sync (ternary), fp32 transfer; k = 16 →
    # rate 1/64. (DeToNATION 0.5.2's code defaults differ: chunk 64, top-k 32, sign after aggregation —
    # the DeMo preset's values, or chunk = 64, topk = 32, sign_before_sync = false here.)
    "FlexDeMo": {"chunk": 32, "topk": 16, "sign_before_sync": True, "transfer_dtype": "fp32", "lr_scale": 0.577},
}

# Where each preset's values come from (docs/options.md prints it beside the preset).
PRESET_SOURCES: dict[str, str] = {
    "DeMo": "DeMo (Peng, Quesnelle, Kingma 2024), its experiments and reference code: chunk 64, top-k 32, "
    "β = 0.999, sign of the aggregate",
    "FlexDeMo": "DeToNATION/FlexDeMo paper, Experiments, \"Overall Setup\" (ablations in its appendix B): "
    "chunk size 32, fp32 transfer, only the sign synced; top-k varied for the compression rate (16: 1/64 of "
    "a 32×32 chunk). Alternative: the DeToNATION 0.5.2 code defaults, chunk 64, top-k 32, sign after "
    "aggregation (set chunk = 64, topk = 32, sign_before_sync = false)",
}


def check(cfg: Config, hparams: BaseHParams | None = None) -> list[str]:
    """Cross-field rules of ``[commopt.demo]``, one line per problem."""
    if cfg.replicator == "demo" and cfg.topk > cfg.chunk**2:
        return [f"[commopt.demo] topk = {cfg.topk}: allowed is at most chunk^2 = {cfg.chunk**2} (chunk = {cfg.chunk})"]
    return []


class DeMo(CommOptimizer):
    """DeMo / FlexDeMo on one replica's shards. ``params``: (named) parameters or param groups;
    a parameter's name seeds the random replicator's shared indices.

    With the DeMo replicator, the SGD base and |R| > 1 the momentum lives in the DCT coefficient
    domain: ``state["momentum"]`` holds the chunk-major ``(n_chunks, L)`` coefficients, rows of one
    buffer per group of same-shape shards. The transform is orthonormal and linear, so
    ``m_dct ← β·m_dct + DCT(g)`` is ``DCT(m)`` of eq. 2, top-k reads ``m_dct`` directly and eq. 8's
    subtraction is ``m_dct[sel] −= λ·m_dct[sel]``: one forward transform of the gradient and one
    inverse of the aggregate per step, batched over each shape group. :meth:`state_dict` writes it
    in the parameter domain, under the same key (torch's DCP rebuilds a flattened optimizer state
    from the keys of the live state: they must be the checkpoint's)."""

    params_replica_local = False  # every replica applies the same aggregated Q: parameters agree

    def __init__(self, params, topology: Topology, cfg: Config, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        problems = check(cfg)
        if problems:
            raise ConfigError("\n".join(problems))
        defaults = dict(lr=lr, weight_decay=weight_decay, beta=cfg.beta, lam=cfg.momentum_subtraction,
                        betas=betas, eps=eps)
        super().__init__(params, topology, None, defaults)
        self.cfg = cfg
        self._names = {id(p): name for _, name, p in named_params(self.param_groups)}
        self._replicators: dict[int, Replicator] = {}
        # per parameter, also in state["step"] (a CPU tensor, as torch's optimizers keep it, for the
        # checkpoint): read from a Python int, never from a tensor
        self._steps: dict[int, int] = {}
        self._plan: Optional[_Plan] = None
        self._chunkers64: dict[tuple, Chunker] = {}
        self._pending: Optional[_Update] = None  # gathered (or in flight), not yet applied

    @property
    def coefficient_domain(self) -> bool:
        """Whether the momentum is kept in the DCT coefficient domain (see the class docstring)."""
        return self.cfg.replicator == "demo" and self.cfg.base == "sgd" and self.topology.replicate_size > 1

    def _replicator(self, p: torch.Tensor, x: torch.Tensor) -> Replicator:
        key = id(p)
        if key not in self._replicators:
            self._replicators[key] = make_replicator(self.cfg, x.shape, self._names[key], device=x.device)
        return self._replicators[key]

    def steps_to_next_sync(self) -> Optional[int]:
        """The diloco replicator sends every ``period`` steps; every other replicator every step."""
        if self.cfg.replicator != "diloco" or self.topology.replicate_size == 1:
            return None
        period = period_of(self.cfg)
        if period == 1:
            return None
        t = max(self._steps.values(), default=0)  # Python ints: no host read of a tensor
        return period - t % period

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(float(self._steps.get(id(p), 0)))
            zeros = lambda: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if self.cfg.base == "adamw":
                state["exp_avg"], state["exp_avg_sq"] = zeros(), zeros()
            elif not self.coefficient_domain:
                state["momentum"] = zeros()
        return state

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        return replica_grad(p, self.topology).float()

    def _adam_direction(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> torch.Tensor:
        # decoupled AdamW: moments stay local, the replicator sees the bias-corrected update
        state, (b1, b2) = self._init_state(p), group["betas"]
        return kernels.adam_direction_(g, local(state["exp_avg"]), local(state["exp_avg_sq"]), beta1=b1,
                                       beta2=b2, eps=group["eps"], step=self._steps[id(p)])

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
        self.flush()  # overlap: the update gathered during the previous step, before anything else
        active = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        steps = [self._init_state(p)["step"] for p, _ in active]
        for p, _ in active:
            self._steps[id(p)] = self._steps.get(id(p), 0) + 1
        if steps:
            torch._foreach_add_(steps, 1.0)
        if self.topology.replicate_size == 1:  # nobody to sync with: the base optimizer on each shard
            for p, group in active:
                g = self._grad(p)
                if self.cfg.base == "sgd":
                    x = kernels.heavy_ball_(local(self._init_state(p)["momentum"]), g, group["beta"])  # eq. 2
                else:
                    x = self._adam_direction(p, group, g)
                if x.numel():
                    self._apply(p, self._phi(x), group["lr"], group["weight_decay"])
            return loss
        plan = self._plan_for(active)
        update = plan.extract_and_send(self)
        if update is not None:
            self._pending = update
            if not self.cfg.overlap:
                self.flush()
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the aggregated update still pending (with ``overlap``: the one gathered at the end of
        the last step; waits for its all-gather). A no-op without one."""
        update, self._pending = self._pending, None
        if update is not None:
            update.apply(self)

    def _apply(self, p: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
               blocks: Optional[Chunker] = None) -> None:
        """Eq. 7 on ``p``'s shard with ``update`` = φ(Q); ``blocks``: ``update`` is in that chunker's
        block layout (a view), and so is the shard it is applied to."""
        x = local(p)
        if blocks is not None:
            if x.is_contiguous():
                x = blocks.blocks(x)
            else:
                update = update.reshape(x.shape)
        kernels.descend_(x, update.to(x.dtype), lr, weight_decay)  # eq. 7

    def _plan_for(self, active: list[tuple[torch.Tensor, dict]]) -> "_Plan":
        key = tuple(id(p) for p, _ in active)
        if self._plan is None or self._plan.key != key:
            self._plan = _Plan(self, active, key)
        return self._plan

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, with every parameter's ``step`` and — in the coefficient domain —
        the momentum written back to the parameter domain as ``momentum`` (a float64 tensor like the
        parameter: a DTensor on FSDP2/TP). So the checkpoint's layout is the one every other path
        uses: DCP still reshards it when |S| changes (coefficients depend on the local shard's
        chunking; the parameter domain does not), checkpoints written before the coefficient domain
        (float32 ``momentum``) load by conversion, and float64 makes the round trip exact: the
        float32 coefficients come back bit for bit, except those below 2^-32 of their chunk's largest,
        which come back as zero (exact zeros, as eq. 8 leaves with λ = 1, stay zero). The price: the
        momentum takes 8 bytes per element in the checkpoint and, while it is written, in memory. A
        pending update (``overlap``) is applied first: see :meth:`flush`."""
        self.flush()
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for index, st in sd["state"].items():
            p, st = params[index], dict(st)
            st["step"] = torch.tensor(float(self._steps.get(id(p), 0)))  # not the live tensor: steps add to it
            if self.coefficient_domain and "momentum" in st:
                st["momentum"] = self._to_parameter_domain(p, st["momentum"])
            state[index] = st
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`: ``momentum`` goes back to the coefficient domain where this
        optimizer keeps it there (float32 ``momentum`` of older checkpoints too), ``step`` to the
        per-parameter counters. A pending update of the run before is dropped."""
        if self._pending is not None:
            self._pending.wait()  # the collective must complete; its update belongs to the old state
            self._pending = None
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]  # indices or FQNs (DCP)
        by_key = dict(zip(saved, params))  # torch's own matching: position over the groups
        state = {}
        for key, st in state_dict["state"].items():
            p, st = by_key[key], dict(st)
            if "step" in st:
                self._steps[id(p)] = int(float(st["step"]))
            if self.coefficient_domain and "momentum" in st:
                st["momentum"] = self._to_coefficient_domain(p, st["momentum"])
            state[key] = st
        super().load_state_dict({**state_dict, "state": state})
        self._plan = None  # the next step re-batches the loaded momenta

    def _chunker64(self, p: torch.Tensor) -> Chunker:
        x = local(p)
        key = (tuple(x.shape), x.device)
        if key not in self._chunkers64:  # checkpoint conversions only
            self._chunkers64[key] = Chunker(x.shape, self.cfg.chunk, device=x.device, dtype=torch.float64)
        return self._chunkers64[key]

    def _to_parameter_domain(self, p: torch.Tensor, m_dct: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(p, dtype=torch.float64, memory_format=torch.contiguous_format)
        if m_dct.numel():
            c = self._chunker64(p)
            local(out).copy_(c.decode(m_dct.reshape(c.n_chunks, c.L)))
        return out

    def _to_coefficient_domain(self, p: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
        m = local(momentum)
        if not m.numel():
            return torch.zeros(0, device=m.device)
        c = self._chunker64(p).encode(m.double())
        # float64 round trip error <= ~1e-12 of a chunk's largest coefficient: what lies below
        # 2^-32 of it was zero (eq. 8 with λ = 1 zeroes the selected coefficients) or is far below
        # the float32 noise of the chunk's own transform
        c.masked_fill_(c.abs() < c.abs().amax(-1, keepdim=True) * 2.0**-32, 0.0)
        return c.float()


class _Update:
    """One step's all-gather (maybe in flight) and what to do with it: per DeMo group its members
    with the step's (lr, weight decay), per flat-replicator parameter its segment."""

    def __init__(self, gathered: "comm.Pending[torch.Tensor]", plan: "_Plan", groups: list, flats: list):
        self.gathered, self.plan, self.groups, self.flats = gathered, plan, groups, flats

    def wait(self) -> torch.Tensor:
        return self.gathered.wait()

    def apply(self, opt: DeMo) -> None:
        payloads = self.wait()  # [W, bytes]
        self.plan.apply(opt, payloads, self)


class _Group:
    """Same-shape shards of the DeMo replicator, transformed, selected and packed as one batch."""

    def __init__(self, members: list, rep: DeMoReplicator, coefficient_domain: bool, device):
        self.members, self.rep = members, rep  # members: [(p, param group)]
        self.G = len(members)
        self.rows = self.G * rep.chunker.n_chunks
        self.numel = self.G * rep.chunker.numel
        self.momentum = (torch.zeros(self.rows, rep.chunker.L, device=device) if coefficient_domain else None)
        self.value_offset = self.index_offset = 0


class _Plan:
    """The per-step work of one set of parameters with gradients: DeMo shards grouped by (local shape,
    device, β, λ) — each group one transform, one top-k, one packing —, the fused send buffer's layout
    (every group's values first, then every group's indices: float values stay aligned, and each
    shard's segment sizes are exactly its ``payload_bytes``), and scratch for the largest group."""

    def __init__(self, opt: DeMo, active: list, key: tuple):
        self.key = key
        cfg = opt.cfg
        self.demo = cfg.replicator == "demo"
        self.groups: list[_Group] = []
        self.flats: list = []
        self.empty = [p for p, _ in active if local(p).numel() == 0]
        for p in self.empty:
            opt._init_state(p)
            if opt.coefficient_domain:
                opt.state[p]["momentum"] = torch.zeros(0, device=local(p).device)
        live = [(p, group) for p, group in active if local(p).numel()]
        if not self.demo:
            for p, group in live:
                opt._init_state(p)
                self.flats.append((p, group, opt._replicator(p, local(p))))
            return
        buckets: dict[tuple, list] = {}
        for p, group in live:
            x = local(p)
            buckets.setdefault((tuple(x.shape), x.device, group["beta"], group["lam"]), []).append((p, group))
        for (shape, device, _, _), members in buckets.items():
            per = max(1, GROUP_NUMEL // max(1, math.prod(shape)))
            for start in range(0, len(members), per):
                part = members[start: start + per]
                rep = opt._replicator(part[0][0], local(part[0][0]))
                self.groups.append(_Group(part, rep, opt.coefficient_domain, device))
        offset = 0
        for grp in self.groups:
            grp.value_offset, offset = offset, offset + grp.G * grp.rep.value_bytes
        for grp in self.groups:
            grp.index_offset, offset = offset, offset + grp.G * grp.rep.index_bytes
        self.send_bytes = offset
        devices = {grp.momentum.device if grp.momentum is not None else local(grp.members[0][0]).device
                   for grp in self.groups}
        biggest = max((grp.numel for grp in self.groups), default=0)
        self.scratch = {d: [torch.empty(biggest, device=d) for _ in range(3)] for d in devices}
        for grp in self.groups:
            for i, (p, _) in enumerate(grp.members):
                state = opt._init_state(p)
                if grp.momentum is not None:
                    rows = grp.momentum[i * grp.rep.chunker.n_chunks: (i + 1) * grp.rep.chunker.n_chunks]
                    old = state.get("momentum")
                    if old is not None and old.numel():
                        rows.copy_(old.reshape(rows.shape))
                    state["momentum"] = rows  # a view: the state is the group buffer's rows (coefficients)

    def _scratch(self, grp: _Group) -> list[torch.Tensor]:
        return self.scratch[grp.momentum.device if grp.momentum is not None else local(grp.members[0][0]).device]

    # ---- send -------------------------------------------------------------------------------------
    def extract_and_send(self, opt: DeMo) -> Optional[_Update]:
        if self.demo:
            return self._extract_demo(opt)
        return self._extract_flat(opt)

    def _extract_demo(self, opt: DeMo) -> Optional[_Update]:
        if not self.groups:
            return None
        send = torch.empty(self.send_bytes, dtype=torch.uint8, device=local(self.groups[0].members[0][0]).device)
        groups = []
        for grp in self.groups:
            rep, ch = grp.rep, grp.rep.chunker
            tmp, out, work = self._scratch(grp)
            if grp.momentum is not None:  # DeMo-SGD: eq. 2 in the coefficient domain
                xs = [opt._grad(p) for p, _ in grp.members]
                coeffs = ch.blocks_to_chunk_major(ch.forward(xs, out=out, tmp=tmp))
                beta, lam = grp.members[0][1]["beta"], grp.members[0][1]["lam"]
                m = grp.momentum
                torch.add(coeffs, m.view(coeffs.shape), alpha=beta, out=m.view(coeffs.shape))  # β·m + DCT(g)
                vals, idx = rep.select(m, work=tmp)
                if lam:
                    m.scatter_add_(-1, idx, vals * -lam)  # eq. 8 (indices are distinct within a chunk)
            else:  # decoupled AdamW: the transform of this step's Adam direction
                xs = [opt._adam_direction(p, group, opt._grad(p)) for p, group in grp.members]
                coeffs = ch.blocks_to_chunk_major(ch.forward(xs, out=out, tmp=tmp))
                dense = work[: grp.numel].view(coeffs.shape)
                dense.copy_(coeffs)
                vals, idx = rep.select(dense.view(grp.rows, ch.L), work=tmp)
            rep.write(vals, idx, send[grp.value_offset: grp.value_offset + grp.G * rep.value_bytes].view(grp.G, -1),
                      send[grp.index_offset: grp.index_offset + grp.G * rep.index_bytes].view(grp.G, -1))
            groups.append([(p, group["lr"], group["weight_decay"]) for p, group in grp.members])
        gathered = comm.all_gather(send, R, opt.topology.replicate, async_op=True)  # the only R traffic
        return _Update(gathered, self, groups, [])

    def _extract_flat(self, opt: DeMo) -> Optional[_Update]:
        sizes = [rep.payload_bytes(opt._steps[id(p)]) for p, _, rep in self.flats]  # shapes and step only
        if not sum(sizes):
            send = None
        else:
            send = torch.empty(sum(sizes), dtype=torch.uint8, device=local(self.flats[0][0]).device)
        flats, offset = [], 0
        for (p, group, rep), n in zip(self.flats, sizes):
            g, t = opt._grad(p), opt._steps[id(p)]
            if opt.cfg.base == "sgd":
                x = kernels.heavy_ball_(local(opt.state[p]["momentum"]), g, group["beta"])  # eq. 2, x is m itself
            else:
                x = opt._adam_direction(p, group, g)
            if not n:
                continue
            q, _ = rep.extract(x, t, out=send[offset: offset + n])
            if opt.cfg.base == "sgd":
                x.sub_(q, alpha=group["lam"])  # eq. 8
            flats.append((p, rep, t, offset, n, group["lr"], group["weight_decay"]))
            offset += n
        if send is None:
            return None
        gathered = comm.all_gather(send, R, opt.topology.replicate, async_op=True)  # the only R traffic
        return _Update(gathered, self, [], flats)

    # ---- receive ------------------------------------------------------------------------------------
    def apply(self, opt: DeMo, payloads: torch.Tensor, update: _Update) -> None:
        W = payloads.shape[0]
        for grp, members in zip(self.groups, update.groups):
            rep, ch = grp.rep, grp.rep.chunker
            tmp, out, work = self._scratch(grp)
            values = payloads[:, grp.value_offset: grp.value_offset + grp.G * rep.value_bytes].view(W, grp.G, -1)
            indices = payloads[:, grp.index_offset: grp.index_offset + grp.G * rep.index_bytes].view(W, grp.G, -1)
            dense = rep.mean_coefficients(values, indices, out=work)  # eq. 6, chunk-major
            Q = ch.inverse(dense, out=out, tmp=tmp)  # (rows, L) chunk-major, parameter domain
            if opt.cfg.rule == "sign":
                Q.sign_()
            blocks = ch.chunk_major_to_blocks(Q.view(grp.G, -1))
            batched: dict[tuple, tuple[list, list]] = {}  # (lr, wd) -> shards and updates, block layout
            for i, (p, lr, wd) in enumerate(members):
                u, x = blocks[i], local(p)
                if opt.cfg.rule == "muon":
                    opt._apply(p, opt._phi(u.reshape(ch.shape)), lr, wd)
                elif x.is_contiguous() and x.dtype == u.dtype:
                    xs, us = batched.setdefault((lr, wd), ([], []))
                    xs.append(ch.blocks(x))
                    us.append(u)
                else:
                    opt._apply(p, u, lr, wd, blocks=ch)
            for (lr, wd), (xs, us) in batched.items():  # kernels.descend_ on every shard, one call each
                if wd != 0:
                    torch._foreach_mul_(xs, 1 - lr * wd)
                torch._foreach_add_(xs, us, alpha=-lr)
        for p, rep, t, offset, n, lr, wd in update.flats:
            Q = rep.aggregate(payloads[:, offset: offset + n], t)
            opt._apply(p, opt._phi(Q), lr, wd)


GROUP_NUMEL = 1 << 24  # elements per DeMo batch at most: bounds the three scratch buffers (64 MiB each)


# ---- the family ------------------------------------------------------------------------------------
def build(named_params: NamedParams, topology: Topology, resolved: Resolved, *, ledger=None) -> DeMo:
    cfg, hp = resolved.options, resolved.hparams
    opt = DeMo(named_params, topology, cfg, lr=hp.lr, weight_decay=hp.weight_decay, betas=(hp.beta1, hp.beta2),
               eps=hp.eps)
    if ledger is not None:
        opt.ledger = ledger
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
    preset_sources=PRESET_SOURCES,
    summary="top-k DCT coefficients of the decoupled momentum (DeMo), or a DeToNATION replicator (FlexDeMo)",
)
