"""DeMo (Peng, Quesnelle, Kingma 2024, "Decoupled Momentum Optimization") and FlexDeMo/DeToNATION
("DeToNATION: Decoupled Torch Network-Aware Training on Interlinked Online Nodes").

Per parameter, on the local FSDP2/TP shard (S is reduce-scattered by FSDP2 as usual), on every replica:

    m ← β·m + g                       # eq. 2, fp32, never synchronized (DeMo-SGD base)
    q, wire ← Replicator.extract(m)   # DeMo: DCT-II chunks + top-k; Random / Striding / DiLoCo / Full
    m ← m − λ·q                       # eq. 8 (λ = 1: original DeMo)
    Q ← mean over R of the replicas' q   # eq. 5–6: one all-gather of every parameter's packed bytes
    p ← p·(1 − η·wd) − η·φ(Q)         # eq. 7; φ = sign | identity | Muon (Newton–Schulz on the shard)

The Decoupled-AdamW base keeps AdamW's two moments local and lets the replicator act on the AdamW
update ``m̂/(√v̂+ε)`` instead of ``m`` (no momentum subtraction: the moments are AdamW's own). With the
DCT replicator and the SGD base the momentum is kept as its DCT coefficients (the DCT is orthonormal
and linear): eq. 2 becomes ``m_dct ← β·m_dct + DCT(g)`` and eq. 8 subtracts in place, so a step is one
forward transform and one inverse. A tensor with ≥ 2 dims is chunked as the matrix ``(d0, prod(rest))``
of its local shard, a vector 1-D (``compress/dct.py``); ``rule = "muon"`` orthogonalizes each local
shard (Muon proper where the parameter is whole).

Only R carries traffic: rank j of one replica exchanges with rank j of the others, one fused
all-gather per step. Every replica decodes the same bytes in the same order, so parameters stay
bit-identical across replicas while the momenta differ. With |R| = 1 nothing is extracted: the base
optimizer on FSDP (``φ(m)``). TP and FSDP only change which shard a rank works on
(``common.replica_grad`` lays the gradient out as its parameter); a parameter replicated over T is
processed identically on every T rank.

State (per replica; checkpoints keep each replica's): ``step`` and, by base, ``momentum`` (m; in the
DCT domain its chunk-major coefficients, saved in the parameter domain) or AdamW's ``exp_avg`` and
``exp_avg_sq``, all float32.

Bytes per rank and step (:func:`demo_r_bytes`): every shard's packed payload (values and indices,
the replicator's wire), averaged over the replicator's period; received = (W − 1) × sent.

The step (``plan.py``): shards of one local shape are batched, one transform, one top-k and one
packing per group, written straight into the send buffer; no tensor value is read on the host.
Where ``[commopt] kernels`` runs Triton (:func:`fused_of`) the DCT replicator's send and receive
sides are ``plan_triton.py``'s kernels, its wire ``compress/packing_triton.py``'s where the
registers allow (else the codecs). ``overlap``: step t's exchange stays parked at its all-gather
until the start of step t+1's, so parameters are one update behind the momenta (a different
algorithm, off in both presets, the papers' blocking step: docs/benchmarks.md §8.6);
``state_dict()`` lands it first, so a checkpoint holds no update in flight.
"""

import dataclasses
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.compress.dct import Chunker
from titan_commopt.compress.replicators import KINDS, WIRES, Replicator, make_replicator, period_of, rate_of
from titan_commopt.kernels import use_triton
from titan_commopt.options import option
from titan_commopt.overlap import Task
from titan_commopt.topology import R, Topology

from .. import updates
from ..base import CommOptimizer
from ..base import named_params as named_params_of
from ..common import LR_SCALE_HELP, BaseHParams, local, replica_grad
from .plan import Fused, Phi, Plan, Rules, descend_shard
from ..family import Bytes, Family, PeriodicSyncs, Resolved, ShardShape
from ..orthogonalize import newton_schulz

__all__ = ["Config", "PRESETS", "PRESET_SOURCES", "DeMo", "FAMILY", "check", "demo_r_bytes", "state_shape"]

logger = logging.getLogger(__name__)


@dataclass
class Config:
    """``[commopt.demo]``."""

    replicator: Literal[KINDS] = option("demo", "What R carries: DCT top-k (demo), random, striding, diloco, full.")
    chunk: int = option(64, "DCT chunk size s per dim (largest divisor of the dim <= s is used).", ge=1)
    topk: int = option(32, "DeMo replicator: coefficients kept per chunk (of s*s for matrices).", ge=1)
    compression_rate: float = option(
        0.0, "Fraction of entries sent by random/striding (per step) and diloco (1/period); 0 = topk/chunk^2.",
        ge=0.0, le=1.0)
    beta: float = option(0.999, "Momentum decay beta of DeMo-SGD (eq. 2, 'compression decay').", ge=0.0, lt=1.0)
    momentum_subtraction: float = option(1.0, "lambda: m <- m - lambda*q after extraction (1 = DeMo).",
                                         ge=0.0, le=1.0)
    base: Literal["sgd", "adamw"] = option("sgd", "Base optimizer: DeMo-SGD (sgd) or Decoupled AdamW (adamw).")
    rule: Literal["sign", "identity", "muon"] = option("sign", "phi applied to the aggregated update: sign, "
                                                       "identity or muon.")
    sign_before_sync: bool = option(False, "Send sign(values) (ternary wire) instead of the values.")
    transfer_dtype: Literal["fp32", "bf16", "fp16"] = option("bf16", "Wire dtype of non-ternary values.")
    pack: bool = option(True, "Packed wire: indices in ceil(log2(L)) bits, ternary in 2 bits (off: int64 indices).")
    wire: Literal[WIRES] = option(
        "compact", "DeMo replicator's encoding with pack = true: compact (each chunk's k indices Elias-Fano coded, "
        "7.4 bits each for 16 of 32x32, 8.9 for 32 of 64x64; with sign_before_sync 1 bit per value) or packed "
        "(indices in ceil(log2(L)) bits, ternary in 2 bits). The same update either way (with aggregate = "
        "mean_selected and sign_before_sync, which must send where a zero was selected, packed is used).")
    aggregate: Literal["mean", "mean_selected"] = option(
        "mean", "Average over all replicas (paper) or over those that selected (reference).")
    ns_steps: int = option(5, "Newton-Schulz iterations of rule = muon.", ge=1)
    seed: int = option(0, "Seed of the random replicator's shared indices.", ge=0)
    overlap: bool = option(
        False, "All-gather step t's payload during step t+1's forward/backward and apply its update at the "
        "start of step t+1 (one step stale; off: applied within step t).")
    dct_precision: Literal["ieee", "tf32"] = option(
        "ieee", "Products of the DCT in the Triton kernels ([commopt] kernels = triton): ieee keeps them in fp32 "
        "(within round-off of the torch path), tf32 runs them on TF32 tensor cores (about 1e-3 relative error "
        "in the transform). The torch path always multiplies in fp32.")
    lr: float = option(
        -1.0, "Initial learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and over "
        "the preset's lr_scale) when set.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)


# Presets are the authors' published settings; lr_scale (the study's best lr ÷ AdamW-HSDP's best,
# docs/benchmarks.md §8) is the one value our study sets: the lr is always tuned.
PRESETS: dict[str, dict[str, Any]] = {
    # The Config defaults are DeMo's: chunk 64, top-k 32 of each 64×64 chunk, β 0.999, sign of the aggregate.
    # lr_scale 0.289: at cpu_tiny (20 tokens per parameter, held-out loss) its best lr was half AdamW-HSDP's.
    "DeMo": {"chunk": 64, "topk": 32, "beta": 0.999, "sign_before_sync": False, "lr_scale": 0.289},
    # The FlexDeMo paper's experiments: chunk 32, sign before sync (ternary), fp32 transfer; k = 32 →
    # rate 1/32, its best rate for OLMo2 (ahead of 1/16). (DeToNATION 0.5.2's code defaults differ: chunk
    # 64, top-k 32, sign after aggregation — chunk = 64, sign_before_sync = false here.)
    "FlexDeMo": {"chunk": 32, "topk": 32, "sign_before_sync": True, "transfer_dtype": "fp32", "lr_scale": 0.577},
}

# Where each preset's values come from (docs/options.md prints it beside the preset).
PRESET_SOURCES: dict[str, str] = {
    "DeMo": "DeMo (Peng, Quesnelle, Kingma 2024), §4 (one chunk size for every main experiment; the β ablation, "
    "larger values best) and its reference code bloc97/DeMo demo.py @cab4606 (compression_chunk = 64, "
    "compression_topk = 32, compression_decay = 0.999, sign-SGD on the decoded aggregate): top-k 32 of 4096 per chunk, 158× fewer R bytes than AdamW-HSDP at 8B 2×8. lr_scale: our "
    "study's (docs/benchmarks.md §8: at cpu_tiny, 20 tokens per parameter, its best lr was 0.5× AdamW-HSDP's; "
    "at cpu_micro 1×). Alternative, from our small-model study (0.2 M parameters, 500 steps): "
    "topk = 128 (43× fewer bytes) ended within 1 % of AdamW-HSDP's training loss where top-k 32 was +18 %; "
    "overlap = true (ours, not the paper's: each step's all-gather behind the next step's forward and backward, "
    "its update one step late) cost +0.13 % held-out loss at cpu_tiny over two seeds (+2.9 % at cpu_micro) and "
    "hides the exchange (docs/benchmarks.md §8.6, §2)",
    "FlexDeMo": "DeToNATION/FlexDeMo paper, Experiments, \"Overall Setup\" (ablations in its appendix B): "
    "chunk size 32, fp32 transfer, only the sign synced; top-k 32 = compression rate 1/32, its best for OLMo2 "
    "1B (Figs. 3–4, ahead of 1/16; also its 64-node run). lr_scale: our study's (docs/benchmarks.md §8). "
    "Alternatives: topk = 16 (1.8× fewer R bytes); the DeToNATION 0.5.2 code defaults, chunk 64, top-k 32, "
    "sign after aggregation (set chunk = 64, sign_before_sync = false). overlap stays false (the paper's blocking "
    "step): on the yardstick it cost +4.2 % and +3.6 % held-out loss (docs/benchmarks.md §8.6, cpu_tiny, two seeds)",
}


def check(cfg: Config, hparams: BaseHParams | None = None) -> list[str]:
    """Cross-field rules of ``[commopt.demo]``, one line per problem."""
    if cfg.replicator == "demo" and cfg.topk > cfg.chunk**2:
        return [f"[commopt.demo] topk = {cfg.topk}: allowed is at most chunk^2 = {cfg.chunk**2} (chunk = {cfg.chunk})"]
    return []


def demo_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """DeMo/FlexDeMo: one all-gather of every shard's packed payload (averaged over the
    replicator's period), so received = (W − 1) × sent."""
    if replicate_size <= 1:
        return Bytes()
    sent = 0.0
    for s in shards:
        if s.numel == 0:
            continue
        rep = make_replicator(resolved.options, s.local, s.fqn)
        sent += sum(rep.payload_bytes(t) for t in range(1, rep.period + 1)) / rep.period
    return Bytes(sent, (replicate_size - 1) * sent)


def periodic(resolved: Resolved) -> Optional[PeriodicSyncs]:
    """The DiLoCo replicator sends the whole shard once per period; every other replicator sends
    alike on every step."""
    options = resolved.options
    if options.replicator == "diloco" and period_of(options) > 1:
        return PeriodicSyncs((period_of(options),), lambda subset: dataclasses.replace(options, compression_rate=1.0))
    return None


def settings(resolved: Resolved) -> dict[str, Any]:
    """The options behind the bytes: the replicator and what sizes its payload, the wire."""
    o = resolved.options
    what: dict[str, Any] = {"replicator": o.replicator}
    if o.replicator == "demo":
        what |= {"chunk": o.chunk, "topk": o.topk}
    elif o.replicator != "full":
        what["rate"] = rate_of(o)
        if o.replicator in ("striding", "diloco"):
            what["period"] = period_of(o)
    what["sign_before_sync"] = o.sign_before_sync
    if not o.sign_before_sync:  # a ternary wire has no value dtype
        what["transfer_dtype"] = o.transfer_dtype
    return what | {"pack": o.pack, **({"wire": o.wire} if o.pack and o.replicator == "demo" else {})}


# ---- the base step and φ, chosen by the options once -------------------------------------------------
def momentum_direction(state: dict, group: dict, g: torch.Tensor, step: int) -> torch.Tensor:
    """DeMo-SGD: m ← β·m + g (eq. 2), in place; the replicator extracts from m itself."""
    return updates.heavy_ball_(local(state["momentum"]), g, group["beta"])


def adam_direction(state: dict, group: dict, g: torch.Tensor, step: int) -> torch.Tensor:
    """Decoupled AdamW: the moments stay local, the replicator sees the bias-corrected m̂/(√v̂+ε)."""
    b1, b2 = group["betas"]
    return updates.adam_direction_(g, local(state["exp_avg"]), local(state["exp_avg_sq"]), beta1=b1, beta2=b2,
                                   eps=group["eps"], step=step)


BASES = {  # base → (its direction, its state's keys, whether eq. 8 subtracts from the direction)
    "sgd": (momentum_direction, ("momentum",), True),
    "adamw": (adam_direction, ("exp_avg", "exp_avg_sq"), False),  # the moments are AdamW's own
}


def _same(u: torch.Tensor) -> torch.Tensor:
    return u


def phi_of(cfg: Config) -> Phi:
    """φ of ``rule``: sign and identity are elementwise; Muon orthogonalizes each local shard on its
    own (Muon proper only where |S| = |T| = 1)."""
    if cfg.rule == "sign":
        return Phi(torch.sign, torch.Tensor.sign_)
    if cfg.rule == "muon":
        return Phi(partial(newton_schulz, steps=cfg.ns_steps))
    return Phi(_same, _same)


def fused_of(cfg: Config, kernels: str, devices: set) -> Optional[Fused]:
    """The DCT replicator's Triton kernels where ``[commopt] kernels`` runs Triton on ``devices`` (a
    ``ConfigError`` where it asks for Triton and Triton cannot run, whatever the replicator); the
    other replicators stay on torch."""
    if not use_triton(kernels, devices) or cfg.replicator != "demo":
        return None
    from . import plan_triton  # only where Triton runs: its kernels are made on import

    return Fused(plan_triton, sign={"sign": True, "identity": False}.get(cfg.rule), precision=cfg.dct_precision)


def _replica_grad32(p: torch.Tensor, topology: Topology, ledger: comm.CommLedger) -> torch.Tensor:
    return replica_grad(p, topology, ledger=ledger).float()


# ---- the optimizer -----------------------------------------------------------------------------------
class DeMo(CommOptimizer):
    """DeMo / FlexDeMo on one replica's shards. ``named_params``: named parameters or param groups of
    them; a parameter's name seeds the random replicator's shared indices.

    With the DeMo replicator, the SGD base and |R| > 1 the momentum lives in the DCT coefficient
    domain (:attr:`coefficient_domain`): ``state["momentum"]`` holds the chunk-major ``(n_chunks, L)``
    coefficients, rows of one buffer per group of same-shape shards. The transform is orthonormal and
    linear, so ``m_dct ← β·m_dct + DCT(g)`` is ``DCT(m)`` of eq. 2, top-k reads ``m_dct`` directly and
    eq. 8's subtraction is ``m_dct[sel] −= λ·m_dct[sel]``: one forward transform of the gradient and
    one inverse of the aggregate per step, batched over each shape group. :meth:`state_dict` writes it
    in the parameter domain, under the same key (torch's DCP rebuilds a flattened optimizer state
    from the keys of the live state: they must be the checkpoint's). An undone step (live fault
    tolerance) is put back from :meth:`snapshot`, coefficients as they are: no conversion.

    The state is made whole at construction (and after a load), as the first step would make it:
    DCP's ``_init_optim_state`` and torchtitan 0.3's ``init_optim_state`` step an optimizer with an
    empty state once (zero gradients, lr 0) before a checkpoint is written or read, which for DeMo
    would be a real exchange over R and one step more on every count."""

    params_replica_local = False  # every replica applies the same aggregated Q: parameters agree
    # the step counts and the plan (a step with another set of gradients replaces it; its rows are
    # the coefficient domain's momenta, restored in place with the state)
    step_attributes = ("_steps", "_clock", "_plan")

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional[comm.CommLedger] = None):
        cfg, hp = options.options, options.hparams
        defaults = dict(lr=hp.lr, weight_decay=hp.weight_decay, beta=cfg.beta, lam=cfg.momentum_subtraction,
                        betas=(hp.beta1, hp.beta2), eps=hp.eps)
        super().__init__(named_params, topology, options, defaults, ledger=ledger)
        direction, self._state_keys, subtract = BASES[cfg.base]
        self._rules = Rules(direction, subtract, phi_of(cfg))
        self.overlap = cfg.overlap
        self.coefficient_domain = cfg.replicator == "demo" and cfg.base == "sgd" and topology.replicated
        self._demo = cfg.replicator == "demo"
        diloco = cfg.replicator == "diloco" and topology.replicated
        self._sync_period = period_of(cfg) if diloco and period_of(cfg) > 1 else None
        self._new_replicator = partial(make_replicator, cfg)
        self._chunk = cfg.chunk
        self._names = {id(p): name for _, name, p in named_params_of(self.param_groups)}
        self._replicators: dict[int, Replicator] = {}
        # per parameter, also in state["step"] (a CPU tensor, as torch's optimizers keep it, for the
        # checkpoint): read from a Python int, never from a tensor
        self._steps: dict[int, int] = {}
        self._clock = 0  # step() calls: the runtime's due counts (overlap: an update is due one step later)
        self._plan: Optional[Plan] = None
        self._chunkers64: dict[tuple, Chunker] = {}
        devices = {local(p).device for group in self.param_groups for p in group["params"]}
        self.fused = fused_of(cfg, options.kernels, devices)  # decided once: Triton kernels or torch
        self._init_all_state()  # eager state: no init step of DCP / torchtitan (see the class docstring)
        logger.info("%s: %s", options.name, topology.describe())  # the options are logged once, resolved

    def replicator(self, p: torch.Tensor) -> Replicator:
        """The replicator of ``p``'s local shard (made on first use)."""
        key = id(p)
        if key not in self._replicators:
            x = local(p)
            self._replicators[key] = self._new_replicator(x.shape, self._names[key], device=x.device)
        return self._replicators[key]

    def steps_to_next_sync(self) -> Optional[int]:
        """The diloco replicator sends every ``period`` steps; every other replicator every step."""
        if self._sync_period is None:
            return None
        t = max(self._steps.values(), default=0)  # Python ints: no host read of a tensor
        return self._sync_period - t % self._sync_period

    def metrics(self) -> dict[str, float]:
        """``updates_in_flight`` with ``overlap``: aggregated updates gathered but not applied yet (1
        after a step that sent, 0 after one that did not)."""
        return {"updates_in_flight": float(self.runtime.in_flight)} if self.overlap else {}

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(float(self._steps.get(id(p), 0)))
            # the coefficient domain's momentum is made by the plan: rows of its shape group's buffer
            keys = () if self.coefficient_domain else self._state_keys
            for key in keys:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    def _init_all_state(self) -> None:
        """Every trainable parameter's state as a first step finds it: the step count, the base's
        zeros and, over R, the plan of all of them (the coefficient domain's momentum rows, into
        which a loaded momentum is copied). A state already there is kept. The param groups are read
        now: a load replaces them, and the plan keeps each shard's group (its lr, as the scheduler sets it)."""
        trainable = [(p, group) for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p, _ in trainable:
            self._init_state(p)
        if self.topology.replicated:
            self._plan_for(trainable)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._clock += 1
        self.runtime.advance(self._clock)  # overlap: the update of the step before, before anything else
        active = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        steps = [self._init_state(p)["step"] for p, _ in active]
        for p, _ in active:
            self._steps[id(p)] = self._steps.get(id(p), 0) + 1
        if steps:
            torch._foreach_add_(steps, 1.0)
        grad = partial(_replica_grad32, topology=self.topology, ledger=self.ledger)
        if not self.topology.replicated:  # nobody to sync with: the base optimizer on each shard
            for p, group in active:
                x = self._rules.direction(self.state[p], group, grad(p), self._steps[id(p)])
                if x.numel():
                    descend_shard(p, self._rules.phi.shard(x), group["lr"], group["weight_decay"])
            return loss
        task = self._exchange(self._plan_for(active), grad)
        if self.overlap:
            self.runtime.start(task, due=self._clock + 1, record=self._clock)
        else:
            self.runtime.run(task)
        return loss

    def _exchange(self, plan: Plan, grad) -> Task:
        """One step's R exchange, a task of :attr:`runtime`: the base step, extraction and packing
        (eq. 2, 8), the all-gather of every replica's bytes (eq. 5), the mean and eq. 7. It runs to
        the all-gather at once (the step counts it reads are this step's)."""
        send, sent = plan.pack(self._rules, grad, self._steps)
        if send is None:
            return
        payloads = yield comm.all_gather(send, R, self.topology.replicate, async_op=True,
                                         ledger=self.ledger)  # the only R traffic
        plan.apply(payloads, sent, self._rules.phi)

    def _fail_sync(self, record: Any) -> None:
        """``overlap`` under live fault tolerance: the aggregated update of step ``record`` will not land
        (its quorum ended before it did). Nothing to undo: it had not touched the parameters, and every
        replica drops it alike, so they stay equal; the share of each replica's momentum it carried
        left the momentum at the exchange (eq. 8) and is lost with it, as a lost all-gather's would be."""

    def _plan_for(self, active: list[tuple[torch.Tensor, dict]]) -> Plan:
        if self._plan is None or self._plan.key != Plan.key_of(active):
            plan = Plan(active, self.state, self.replicator, self.coefficient_domain, self._demo, self.fused)
            if self._plan is not None:
                self._plan.hand_over(plan)
            self._plan = plan
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
        pending update (``overlap``) is applied first (see :meth:`flush`; under live fault tolerance it is
        dropped instead: ``CommOptimizer._settle_for_save``)."""
        self._settle_for_save()
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
        self.runtime.abandon()  # its collective completes; its update belongs to the state this load replaces
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
        self._plan = None  # re-batch the loaded momenta: the state is the new plan's rows, as after construction
        self._init_all_state()

    def _chunker64(self, p: torch.Tensor) -> Chunker:
        x = local(p)
        key = (tuple(x.shape), x.device)
        if key not in self._chunkers64:  # checkpoint conversions only
            self._chunkers64[key] = Chunker(x.shape, self._chunk, device=x.device, dtype=torch.float64)
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


# ---- the family ------------------------------------------------------------------------------------
def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the base (DeMo-SGD's momentum vs AdamW's two moments)."""
    return {"base": resolved.options.base}


FAMILY = Family(
    key="demo",
    options=Config,
    presets=PRESETS,
    build=DeMo,
    r_bytes=demo_r_bytes,
    check=check,
    state_shape=state_shape,
    periodic=periodic,
    settings=settings,
    preset_sources=PRESET_SOURCES,
    summary="top-k DCT coefficients of the decoupled momentum (DeMo), or a DeToNATION replicator (FlexDeMo)",
)
