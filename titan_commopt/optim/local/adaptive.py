"""DES-LOC and MT-DAO (also Local Adam and DiLoCo): local adaptive optimizers with desynced state
syncs, as one engine. Papers: DES-LOC (Algorithms 1/2); MT-DAO ("Multi-timescale Distributed Adaptive
Optimizers with Local Updates", Algorithms 1–3). Every replica steps on its own gradient ``g`` (no
gradient all-reduce over R); each state is averaged over R on its own period:

    g   ← clip(g, ρ)                                   # optional: coordinate-wise, or by the replica's norm
    u_j ← β1_j·u_j + (1−β1_j)·g          j = 1..N      # N first momenta, u_j synced every K_j
    v   ← β2·v + (1−β2)·g²                             # second moment, synced every Kv
    Δ   ← [(1−Σω_j)·g + Σω_j·û_j] / (√v̂ + ε)           # quasi-hyperbolic combination
    x   ← x·(1−η·λ) − η·Δ                              # decoupled weight decay λ
    every Kx steps: x ← OuterOpt(mean_R(x))             # averaging, or Nesterov on x_anchor − mean_R(x)

Base optimizers (``base``): ``adam`` as above (``bias_correction``: û_j = u_j/(1−β1_j^n), v̂ likewise;
one replica is then torch's Adam/AdamW); ``adopt`` (ADOPT, Taniguchi et al. 2024: ĝ = g / max(√v_prev,
ε), clipped to ±(n−1)^¼, enters the momenta, Δ = (1−Σω)·ĝ + Σω_j·u_j, v updated last, step 1 only
seeds v = g²; ADOPT's order, not MT-DAO Algorithm 2's); ``sgdm`` (MT-DAO Algorithm 3: Δ = (1−Σω)·g +
Σω_j·u_j, no v). DES-LOC is N = 1, ω = 1. MT-DAO's switch (appendix B.2, ``switch_at`` = k): updates
n ≤ k run the plain base optimizer on u_0 with ``[optimizer] beta1``, ω = 1; later ones the configured
β1_j, ω_j, u_0 carried across (bias corrections count the weight each EMA has gathered). The Nesterov
outer step (DiLoCo), anchor a = x at the last sync, momentum b: Δ = a − mean_R(x); b ← μ·b + Δ;
x ← a − η_out·(Δ + μ·b); a ← x.

Schedule: after update n (1-based) a state with period K is due when ``n % K == 0`` (0 = never);
everything due at one step goes in one fused all-reduce. Streaming sync (``fragments`` F,
``sync_delay`` τ; Streaming DiLoCo, Douillard et al. 2025): fragment f of a state with period K is
due when ``(n − ⌊f·K/F⌋) % K == 0``, so the bytes per period are unchanged and the per-step peak is
~1/F of them; fragments are balanced by size, or strided by block as the paper's
(``fragment_layout``). With τ > 0 the all-reduce runs during the next τ steps and merges keeping
their local progress, t ← t̃ + (t − t at issue) with t̃ = mean_R(t at issue), the outer step's for x
(τ below the smallest period > 0), or with ``merge = "lerp"`` as Streaming DiLoCo merges (its §2.3,
Algorithm 2), t ← α·t + (1 − α)·t̃, α = ``merge_alpha``. A checkpoint first merges what is in flight.
F = 1, τ = 0 (the papers' blocking schedule) are the options' defaults; DiLoCo's preset streams
(docs/benchmarks.md §8.6 measures it on the yardstick, §2 on a shaped link).

Overlapped outer steps (``merge``; Kale, Douillard, Donchev 2025, "Eager Updates For Overlapped
Communication and Computation in DiLoCo", arXiv 2502.12996). The sync of a state issued at update n
stays in flight over the whole next period and is applied at its next sync, update n + K, where the
next one is issued: period p+1's inner steps hide period p's all-reduce. On the wire a parameter
sends its pseudo-gradient Δ_m = a_m − x_m (a_m its replica's anchor, x after the last outer step it
applied; with ``outer = "average"`` too, as outer SGD at lr 1: x ← a − Δ̃), a state (u_j, v) its
value. At update n on replica m, with Δ̄(t−1) the mean that arrived and Δ_m(t−1) what m sent then:

    delayed:  Δ̃ = Δ̄(t−1)                              # their Algorithm 2, the naive 1-outer-step delay
    eager:    Δ̃ = Δ̄(t−1) + (Δ_m(t) − Δ_m(t−1))/M      # their Algorithm 3, = (1/M)·(Δ_m(t) + Σ_{m'≠m} Δ_m'(t−1))
    x ← OuterOpt(a_m, Δ̃); a_m ← x                       # a state: t ← Δ̃ on its values (v kept >= 0)

then Δ_m(t) is sent. Before the first sync the means and shares are zero (a sync of nothing at update
0). Eager replicas differ slightly (each applied its own fresh share), also in their anchors and
outer momenta; delayed ones apply the same mean and agree right after a sync of every fragment. The
mean in flight and (eager) the share sent are state (``inflight_<key>``, ``sent_<key>``, key ``x`` or
the state's): a checkpoint completes the all-reduce and keeps its mean without applying it, so a
resumed run continues exactly as the run that saved (and as one that never checkpointed). Bytes are
the blocking schedule's, as with fragments and τ. ``sync.py`` holds the schedule and every way a
sync lands.

Quantized outer wire (``outer_wire_dtype`` = ``"fp8"`` / ``"fp4"``; Streaming DiLoCo's FP4 wire, Douillard
et al. 2025, arXiv 2501.18512, §2.4). A parameter sync sends each replica's unreduced pseudo-gradient
Δ_m = a − x_m (a the anchor, x at the last sync; a replica's own anchor under the eager merge) instead
of x, coded by ``compress/minifloat.py``: blocks of 256 values of a tensor's local shard, one float32
absmax scale s each, FP8 = E4M3 (torch's float8_e4m3fn of Δ·448/s) or FP4 = E3M0 (0 or ±s·2^k,
k = −6…0, the nearest in value). The codes are all-gathered over R (an all-reduce cannot sum them),
and every replica decodes every share and averages in FP32, in replica order (the same bits on every
replica):

    mean_R x = a − (1/M)·Σ_m decode(Q(Δ_m))            # blocking, streaming (at issue), lerp
    Δ̄ = (1/M)·Σ_m decode(Q(Δ_m))                       # delayed / eager: the mean in flight

then the merge and the outer step as above (averaging is outer SGD at lr 1 from the anchor, which it
then keeps; with one replica nothing is sent and nothing quantized). The moments u_j, v keep
``transfer_dtype``'s all-reduce.

State, on the local FSDP2/TP shard and per replica (checkpoints keep each replica's): ``exp_avg``,
``exp_avg_<j>`` (u_j, :func:`moment_key`), ``exp_avg_sq`` (v, none for sgdm), ``outer_anchor`` and
``outer_buf`` (Nesterov with Kx > 0), ``step`` (one shared CPU scalar tensor: no host read per step).
Parameters differ across replicas between Kx syncs (``params_replica_local``: Kx ≠ 1).

Bytes per rank and step (:func:`local_r_bytes`): d·(1/Kx + Σ_j 1/K_j + 1/Kv) × the transfer dtype's
bytes, d the local shard's elements, all-reduce (sent = received); fragments and τ move syncs in
time, not their bytes. With the quantized outer wire x's term is an all-gather of
Σ_p ⌈d_p/256⌉·(256·b/8 + 4)/Kx bytes sent (b = 8 or 4 bits a code, a float32 scale a block; d_p a
tensor's local elements), W − 1 times that received: 8.125 or 4.125 bits a value, 3.94× or 7.76× fewer
than fp32 for large tensors. The norm clip adds one float over S and T.

The local step (``update.py``, or its Triton twin ``update_triton.py`` where ``[commopt] kernels``
picks Triton; plain Adam stays on torch's fused AdamW kernel) runs the multi-tensor updates of
``optim/updates.py`` over chunks of parameters (``steps.py``). Unset ``lr``, ``beta*``, ``eps``,
``weight_decay`` (negative, or an empty list) take ``[optimizer]``'s; ``lr`` unset is ``[optimizer] lr ×
lr_scale``, resolved once by the registry. ``check`` holds every cross-field rule; ``resolve_periods``
is the one value derived from the table (``"auto"`` periods made numbers).
"""

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Replicate

from titan_commopt import comm
from titan_commopt.compress.minifloat import MiniFloatWire
from titan_commopt.kernels import use_triton
from titan_commopt.options import ConfigError, option, resolve_auto_period
from titan_commopt.topology import R, S, T, Topology

from .. import updates
from ..base import CommOptimizer
from ..base import named_params as params_by_name
from ..common import LR_SCALE_HELP, BaseHParams, local
from ..family import Bytes, Family, PeriodicSyncs, Resolved, ShardShape
from ..muon.engine import MuonMatrices
from ..muon.layout import muon_shard_bytes
from ..muon.options import MuonOptions, is_muon_matrix, muon_problems, routed_groups
from .global_model import anchors_swapped_in, replica_mean_swapped_in
from .steps import LocalSteps, column_chunks, chunk_limit, trainable
from .update import fused_local_update, gradient_clip, local_update
from .sync import (OVERLAPPED_MERGES, DueStates, OverlapEntry, Params, Periods, SyncSchedule, numbered_blocks,
                   pseudo_gradient_mean, sync_in_place, sync_overlapped, sync_streaming)

__all__ = ["Config", "PRESETS", "LocalAdaptive", "FAMILY", "check", "resolve_periods", "sync_schedule", "fragment_count",
           "local_r_bytes", "local_s_bytes", "moment_key"]

SECTION = "commopt.local"


@dataclass
class _Own:
    """``[commopt.local]``'s keys besides the Muon step's (``base = "muon"``)."""

    base: Literal["adam", "adopt", "sgdm", "muon"] = option(
        "adam", "Local base optimizer. muon: Muon on the hidden matrices (the muon_* keys; M is u_0, synced every "
        "Ku[0]; no second moment), Adam on the parameters routed around them (embed_names, head_names, norms, "
        "biases: β1 = beta1's one entry, v synced every Kv).")
    beta1: list[float] = option(
        [], "β1_j of the N first momenta; [] = one momentum per Ku entry with [optimizer] beta1 "
        "(e.g. [0.9, 0.999] for two momenta).", kind=list,
    )
    Ku: list[Union[int, str]] = option(
        [32], "Sync period K_j of each first momentum (integer >= 1, 0 = never, or \"auto\" = "
        "power of two nearest its half-life ln0.5/lnβ1_j). One entry per momentum.", kind=list,
    )
    omega: list[float] = option(
        [1.0], "Quasi-hyperbolic weights ω_j of the momenta (Σω <= 1; the current gradient gets "
        "1 − Σω). One entry per momentum.", kind=list,
    )
    beta2: float = option(-1.0, "Second-moment decay β2; negative = [optimizer] beta2.", lt=1.0)
    Kv: Union[int, str] = option(
        32, "Sync period of the second moment (0 = never; \"auto\" = from β2's half-life).",
        ge=0, auto=True, kind=int,
    )
    Kx: Union[int, str] = option(
        32, "Parameter sync period (0 = never; \"auto\" = from the half-life of the fastest state, "
        "min over β1_j and β2).", ge=0, auto=True, kind=int,
    )
    outer: Literal["average", "nesterov"] = option(
        "average", "Outer optimizer at a Kx sync: average (x = mean_R x) or nesterov (Nesterov "
        "momentum on the pseudo-gradient x_anchor − mean_R x, DiLoCo).",
    )
    outer_lr: float = option(0.7, "Outer (Nesterov) learning rate.", gt=0.0)
    outer_momentum: float = option(0.9, "Outer (Nesterov) momentum.", ge=0.0, lt=1.0)
    clip: Literal["none", "coordinate", "norm"] = option(
        "none", "A second gradient clip inside the optimizer, after [training] max_norm: "
        "coordinate-wise to ±clip_threshold (DES-LOC's algorithm) or by this replica's own gradient "
        "norm.",
    )
    clip_threshold: float = option(1.0, "Clipping radius ρ.", gt=0.0)
    lr: float = option(
        -1.0, "Initial learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and over "
        "the preset's lr_scale) when set.",
    )
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)
    eps: float = option(-1.0, "ε of the denominator; negative = [optimizer] eps.")
    weight_decay: float = option(-1.0, "Decoupled weight decay λ; negative = [optimizer] weight_decay.")
    bias_correction: bool = option(True, "Adam's bias correction of u_j and v (base = adam only).")
    adopt_clip: bool = option(True, "ADOPT's clip of the normalized gradient to ±(step−1)^¼.")
    switch_at: Union[int, str] = option(
        0, "MT-DAO's switch (appendix B.2): the first switch_at updates run the plain base optimizer (one "
        "momentum with [optimizer] beta1, ω = 1), later ones the configured beta1/omega; the momentum is "
        "carried across. 0 = no switch; \"warmup\" = [lr_scheduler] warmup_steps.",
        ge=0, auto="warmup", kind=int,
    )
    transfer_dtype: Literal["fp32", "bf16", "native"] = option(
        "fp32", "dtype of synced states on the wire (native = the state's own dtype).",
    )
    outer_wire_dtype: Literal["same", "fp8", "fp4"] = option(
        "same", "What a parameter sync puts on the wire. same: x itself (Δ for merge = delayed / eager) in "
        "transfer_dtype, all-reduced. fp8 / fp4: each replica's pseudo-gradient Δ = x_anchor − x, block-scaled "
        "FP8 (E4M3) or FP4 (E3M0: ±2^e·scale or 0, Streaming DiLoCo's, Douillard et al. 2025 §2.4), one float32 "
        "absmax scale per 256 values of a tensor; the codes are all-gathered and every replica's share decoded and "
        "averaged in FP32: mean_R x = x_anchor − mean_R Δ (4.125 / 8.125 bits a value sent, the W − 1 others' "
        "received). The moments (u_j, v) keep transfer_dtype. Averaging then keeps an anchor too (x at the last "
        "sync).",
    )
    fragments: Union[int, str] = option(
        1, "Streaming sync: parameters (with their states) split into this many fragments F; each is synced once "
        "per period at its own offset (fragment f of a state with period K when (step − ⌊f·K/F⌋) % K == 0). "
        "1 = everything at once. \"auto\" = Streaming DiLoCo's 3 blocks a fragment (Douillard et al. 2025, "
        "§2.2, Fig. 6): ⌈L/3⌉ for a model of L numbered blocks (layers.<k>.), at least 2 where L ≥ 2 (11 for "
        "llama3 8B's 32 layers, 2 for our CPU flavors' 2–4).", ge=1, auto=True, kind=int,
    )
    fragment_layout: Literal["size", "strided"] = option(
        "size", "How parameters are split into fragments: size = greedy by size, balanced in elements; strided = "
        "Streaming DiLoCo's strided fragments (Douillard et al. 2025, §2.2: fragment p holds blocks p, p + F, …): "
        "the block k of a parameter (the first integer in its name, layers.<k>.) in fragment k mod F, the "
        "parameters outside a block (embeddings, final norm, output) round-robin in their order.",
    )
    sync_delay: int = option(
        0, "Streaming sync: steps τ a fragment's all-reduce stays in flight (overlapped with the "
        "next τ steps) before it is merged, keeping the local progress of those steps: "
        "x ← mean_R(x at issue) + (x − x at issue), the same for u and v. 0 = blocking; must be "
        "below the smallest period > 0.", ge=0,
    )
    merge: Literal["additive", "lerp", "delayed", "eager"] = option(
        "additive", "How an R sync lands. additive: blocking with sync_delay = 0, else Streaming DiLoCo's overlap "
        "merged keeping the local progress (sync_delay above). lerp: Streaming DiLoCo's merge (Douillard et al. "
        "2025, §2.3) after sync_delay steps (0: at once), t ← α·t + (1 − α)·t̃, t̃ the synced value (the outer "
        "step's for x), α = merge_alpha. delayed / eager (Kale, Douillard, Donchev 2025, "
        "arXiv 2502.12996): each sync stays in flight over the whole next period and is applied at the next "
        "sync of that state, on pseudo-gradients Δ = anchor − x (values for u, v); delayed applies the mean "
        "that arrived, Δ̄(t−1) (their naive one-outer-step delay, Algorithm 2), eager that mean with this "
        "replica's stale share replaced by its fresh one, Δ̄(t−1) + (Δ_m(t) − Δ_m(t−1))/M (their eager "
        "update, Algorithm 3). delayed and eager need sync_delay = 0 and keep two more copies of what is "
        "synced (the mean in flight, the share sent).",
    )
    merge_alpha: float = option(
        0.0, "α of merge = \"lerp\": the weight the local value keeps at the merge (Streaming DiLoCo's α; torchft's "
        "fragment_update_alpha, MaxText's communication_overlapping_alpha). 0 = take the synced value (the local "
        "steps since the issue dropped), 0.5 = a uniform average, 1 = never synced.", ge=0.0, le=1.0,
    )


@dataclass
class Config(MuonOptions, _Own):
    """``[commopt.local]``: the DES-LOC / MT-DAO engine (also LocalAdam, DiLoCo and MuLoCo presets)."""


# Presets are the authors' published settings; lr_scale (the study's best lr ÷ AdamW-HSDP's best,
# docs/benchmarks.md §8; 1 where they coincide) is the one value our study sets: the lr is always tuned.
PRESETS: dict[str, dict[str, Any]] = {
    # DES-LOC-Adam: parameters synced most often, states at multiples of Kx, the paper's periods (Kx = 32,
    # Ku = 3Kx, Kv = 6Kx: 2× less than Local Adam's 3/K per step at the same Kx), its coordinate clip, no
    # weight decay. Adam's β are [optimizer]'s (torchtitan's 0.9, 0.95: SmolLM2's, which DES-LOC's
    # billion-scale runs adopt).
    "DES-LOC": {
        "base": "adam", "weight_decay": 0.0,
        "Kx": 32, "Ku": [96], "Kv": 192, "clip": "coordinate", "lr_scale": 0.7,
    },
    # DES-LOC-ADOPT, the DES-LOC paper's main setting: ADOPT with its defaults β2 = 0.9999, ε = 1e-6, the
    # same β1 = 0.95 and no weight decay; the paper's periods Kx = 32, Ku = 3Kx, Kv = 6Kx (its β's
    # half-lives are the long ones those periods were chosen for).
    "DES-LOC-ADOPT": {
        "base": "adopt", "beta1": [0.95], "beta2": 0.9999, "eps": 1e-6, "weight_decay": 0.0,
        "Kx": 32, "Ku": [96], "Kv": 192, "clip": "coordinate", "lr_scale": 0.333,
    },
    # MT-DAO as the paper runs it: N = 1 quasi-hyperbolic slow momentum on ADOPT (ε = 1e-6, ADOPT's),
    # K = 32 for all, the base optimizer until the end of warm-up. Its norm clip at rho = 1 (paper,
    # Table 2) is the training loop's: [training] max_norm = 1.
    "MT-DAO": {
        "base": "adopt", "beta1": [0.999], "omega": [0.95], "beta2": 0.9999, "eps": 1e-6,
        "Kx": 32, "Ku": [32], "Kv": 32, "switch_at": "warmup",
    },
    # MT-DAO with half-life periods: each state synced about once per half-life of its β,
    # τ(β) = ln 0.5 / ln β: τ(0.999) = 693 for u, τ(0.9999) = 6931 for v; x stays at 32.
    "MT-DAO-halflife": {
        "base": "adopt", "beta1": [0.999], "omega": [0.95], "beta2": 0.9999, "eps": 1e-6,
        "Kx": 32, "Ku": [693], "Kv": 6931, "switch_at": "warmup",
    },
    # Local Adam: everything synced together.
    "LocalAdam": {"base": "adam", "Kx": 32, "Ku": [32], "Kv": 32},
    # DiLoCo: states never synced (persistent local state), Nesterov outer step every Kx with the paper's
    # outer lr 0.7 and momentum 0.9 (the Config defaults); its inner lr a quarter of AdamW-HSDP's (the study).
    # Its sync streamed as its authors' Streaming DiLoCo does it: strided fragments of 3 blocks, each in
    # flight for one inner step and then taken as it lands (τ = 1, α = 0), the link hidden behind that step.
    "DiLoCo": {"base": "adam", "Kx": 32, "Ku": [0], "Kv": 0, "outer": "nesterov", "outer_lr": 0.7,
               "outer_momentum": 0.9, "lr_scale": 0.25,
               "fragments": "auto", "fragment_layout": "strided", "sync_delay": 1, "merge": "lerp", "merge_alpha": 0.0},
    # MuLoCo: DiLoCo with Muon as the inner optimizer, as its authors ran it for the worker count nearest two
    # sites (K = 1: outer lr 0.7, momentum 0.6, H = 30), their Muon (μ 0.9, undamped, no Nesterov, MuLoCo's
    # Newton–Schulz in bf16, √(fan_out/fan_in)) and their AdamW of the routed parameters (β 0.9, 0.99, at the
    # Muon lr).
    "MuLoCo": {"base": "muon", "Kx": 30, "Ku": [0], "Kv": 0, "outer": "nesterov", "outer_lr": 0.7,
               "outer_momentum": 0.6, "beta1": [0.9], "beta2": 0.99, "muon_momentum": 0.9,
               "muon_momentum_form": "undamped", "muon_nesterov": False, "muon_coefficients": "muloco",
               "muon_dtype": "bf16", "muon_lr_rule": "spectral_norm", "scalar_lr_scale": 1.0, "lr_scale": 1.0},
}


# Where each preset's values come from (docs/options.md prints it beside the preset).
PRESET_SOURCES: dict[str, str] = {
    "DES-LOC": "DES-LOC (Iacob et al.): appendix B.2 (no weight decay), Algorithm 1 (coordinate clip), §5.3 / "
    "Fig. 5 (Ku = 3Kx, Kv = 6Kx at Kx = 32: the 2× reduction over Local Adam; our reading, the extracted "
    "figure lost the numbers); Adam's β1, β2 from [optimizer] (torchtitan's 0.9, 0.95 are SmolLM2's, whose "
    "hyper-parameters DES-LOC §4.1 adopts for its billion-scale model and B.2.1 finds β2 to agree with). "
    "lr_scale: our study's (docs/benchmarks.md §8). Alternatives, from our small-model studies (0.2 M "
    "parameters, 300–500 steps, docs/benchmarks.md §4): Kx = 16, Ku = [48], Kv = 96 with lr_scale = 0.7 "
    "(+6.0 % of AdamW-HSDP's training loss at 500 steps where Kx = 32 was +12.6 %); MT-DAO appendix E.2 "
    "Table 3's DES-LOC-ADAM β, beta1 = [0.95], beta2 = 0.99; for a link slower than the compute, from our study "
    "(docs/benchmarks.md §2, §8.6: cpu_tiny, two seeds): fragments = 4, fragment_layout = \"size\", sync_delay = 8, "
    "merge = \"lerp\", merge_alpha = 0 (1.09× of the floor at 10 Mbit/s and 1.12× where the bytes just fit, where "
    "blocking was 1.53× and 2.13×; −9.2 % held-out loss; sync_delay = 7: 1.14×, 1.16×, −0.3 %)",
    "DES-LOC-ADOPT": "DES-LOC §4.1 (ADOPT with its default β2 = 0.9999 is the main optimizer), B.2.1 (β1 = 0.95 "
    "for all experiments; also MT-DAO appendix E.2 Table 3, DES-LOC-ADOPT), B.2 (no weight decay), §5.3 / "
    "Fig. 5 periods Kx = 32, Ku = 3Kx, Kv = 6Kx; ε = 1e-6 is ADOPT's default (Taniguchi et al. 2024). "
    "Alternative: MT-DAO Table 3's half-life periods for it, Ku = 32, Kv = 6931",
    "MT-DAO": "MT-DAO §4.1 (ADOPT, β2 = 0.9999, N = 1, K = Kx = K1 = Kv = 32), appendix E.2 Table 3, "
    "\"MT-DAO-ADOPT (Unified)\" (β1 = 0.999, ω = 0.95), appendix B.2 (switch from the base optimizer at the "
    "end of warm-up); ε = 1e-6 is ADOPT's default (Taniguchi et al. 2024)",
    "MT-DAO-halflife": "MT-DAO appendix E.2 Table 3, \"MT-DAO-ADOPT (Half-Life)\": ω = 0.95, β1 = 0.999, "
    "β2 = 0.9999, Kx = 32, Ku = 693, Kv = 6931 (the half-lives of β1 and β2)",
    "LocalAdam": "Local Adam baseline of DES-LOC §4.1 and MT-DAO §4.1: every state synced together, K = 32 "
    "(MT-DAO appendix E.2 Table 3, \"Unified\")",
    "DiLoCo": "DiLoCo (Douillard et al. 2023), its experimental setup: Nesterov outer step, outer lr 0.7, outer "
    "momentum 0.9; states never synced (persistent local states, DES-LOC §4.1 baseline (iii)); Kx = 32, the "
    "Local Adam period of DES-LOC §4.1 and MT-DAO appendix E.2 Table 3 (the DiLoCo paper's own H = 500 is "
    "longer than our CPU runs). lr_scale: our study's (docs/benchmarks.md §8: at cpu_tiny, 20 tokens per "
    "parameter, its best inner lr was 0.25× AdamW-HSDP's, the lowest tried (the optimum may lie lower); at "
    "cpu_micro 0.5×). The sync streamed as the same authors' Streaming DiLoCo (Douillard et al. 2025, arXiv "
    "2501.18512): strided fragments (§2.2, Figs. 6a, 7) of 3 blocks (§2.2, Fig. 6: fragments = \"auto\"; its \"at least 2 fragments where the model has 2 "
    "blocks or more\" is ours, not the paper's, so that our 2-block CPU flavors stream as we measured them), τ = 1 (its main "
    "runs, §2.3; < 0.2 % loss up to τ = 10 in Fig. 8), α = 0 (torchft 0.2.0's fragment_update_alpha and MaxText's "
    "communication_overlapping_alpha default; Fig. 8 runs α = 0 and 0.5); on our yardstick it costs the seed noise "
    "(docs/benchmarks.md §8.6). Its other changes stay options: the FP4 wire (outer_wire_dtype = \"fp4\"), its "
    "outer lr 0.4 (§3.2). Alternatives: blocking DiLoCo as the 2023 paper runs it, fragments = 1, "
    "sync_delay = 0, merge = \"additive\"; for a link slower than the compute, from our study (docs/benchmarks.md "
    "§2, §8.6: cpu_tiny, two seeds): fragments = 4, fragment_layout = \"size\", sync_delay = 8 (a fragment in "
    "flight all the period, the next issued as the last one merges: 1.06× of the floor at 10 Mbit/s and 1.16× "
    "where the bytes just fit, where the preset is 1.51× and 2.00×; −2.8 % held-out loss against it; "
    "sync_delay = 7: 1.09×, 1.25×, −3.8 %); from our small-model study (0.2 M parameters, 500 steps, "
    "docs/benchmarks.md §8H.1): outer_momentum = 0.5 (+13 % of AdamW-HSDP's training loss where 0.9 was +33 %)",
    "MuLoCo": "MuLoCo (Thérien et al. 2025, arXiv 2505.23725) at K = 1, the worker count of their tables nearest "
    "our two sites (the other is K = 16): bentherien/muloco-1 33cc333 muloco-1.md L67-69 (outer lr 0.7, outer "
    "momentum 0.6, H = 30 = Kx; also muloco/pytorch/muloco.py L270-272) with DiLoCo's never-synced states "
    "(Ku = [0], Kv = 0). Muon and the routed AdamW as their torchtitan runs configure them "
    "(facebookresearch/MuLoCo 475bbf4, torchtitan/config/diloco/2x_4gpu_muloco.py L12-15: μ = 0.9, Nesterov "
    "off, spectral_norm; L2-3: β = 0.9, 0.99; L28-31: every lr factor 1, AdamW at the Muon lr; the Newton–Schulz "
    "of experiments/dion_optimizer/muon.py L714-720, bf16, undamped momentum L623-624). Warm-up 500 steps "
    "(jobs/muloco_paper/diloco_muloco_no-compression_h100.py L329): [lr_scheduler] warmup_steps, set in "
    "train_configs/llama3_8b_muloco.toml. Weight decay: [optimizer]'s (theirs is rescaled with the run's length, "
    "same file L331). lr_scale = 1, measured (docs/benchmarks.md §8.5: MuLoCo's best lr at cpu_micro = AdamW-HSDP's, 0.054); at 0.027 it lands in "
    "the authors' K = 1 Muon range 0.016–0.063 (muloco-1.md L66); their Muon ÷ AdamW at 3.1 B K = 16, 0.015625 ÷ "
    "0.000691 ≈ 22.6 (same file L280, L285), belongs to a 3 B model's AdamW lr. Alternatives: K = 16's outer "
    "lr 1.0 and momentum 0.9 (L280); MuLoCo1's μ = 0.95 (muloco.py L273); their 3-D experts flattened to one "
    "matrix (flatten = True, 2x_4gpu_muloco.py L16) where ours orthogonalizes each expert",
}




# ---- the table's values, [optimizer]'s where it leaves one unset ------------------------------------
def _betas1(cfg: Config, hparams: BaseHParams) -> tuple[float, ...]:
    """β1_j of each first momentum: the table's, or [optimizer] beta1 for every Ku entry."""
    return tuple(float(b) for b in (list(cfg.beta1) or [hparams.beta1] * len(cfg.Ku)))


def _beta2(cfg: Config, hparams: BaseHParams) -> float:
    return float(hparams.beta2 if cfg.beta2 < 0 else cfg.beta2)


def _table_or(value: float, fallback: float) -> float:
    """The table's value; a negative one (unset) takes [optimizer]'s ``fallback``."""
    return fallback if value < 0 else value


def _decays(cfg: Config, hparams: BaseHParams) -> tuple[list[tuple[float, str]], tuple[float, str]]:
    """Each β1_j and β2 with the setting it comes from, as the user writes it (the table's, or
    [optimizer]'s for what the table leaves unset)."""
    if cfg.beta1:
        betas1 = [(float(b), f"[{SECTION}] beta1[{j}] = {b!r}") for j, b in enumerate(cfg.beta1)]
    else:
        betas1 = [(float(hparams.beta1), f"[optimizer] beta1 = {hparams.beta1!r}")] * len(cfg.Ku)
    beta2 = (float(cfg.beta2), f"[{SECTION}] beta2 = {cfg.beta2!r}") if cfg.beta2 >= 0 else \
        (float(hparams.beta2), f"[optimizer] beta2 = {hparams.beta2!r}")
    return betas1, beta2


def _period(key: str, period: Any, decay: tuple[float, str], of: str) -> int:
    """``period`` as a number: "auto" → from ``decay``'s half-life (``of``: whose decay it is). A
    decay without one is refused naming the key the user wrote and the setting the decay comes from."""
    try:
        return resolve_auto_period(period, decay[0])
    except ConfigError:
        raise ConfigError(
            f'[{SECTION}] {key} = "auto": the power of two nearest the half-life of {of}, {decay[1]}, which only a '
            f'decay in (0, 1) has; allowed is an integer >= 0 (0 = never), or "auto" with that decay in (0, 1)'
        ) from None


def resolve_periods(cfg: Config, hparams: BaseHParams) -> Periods:
    """The sync periods, each ``"auto"`` the power of two nearest its state's half-life (Kx: of the
    fastest state); Kv = 0 without a second moment (sgdm). The one value derived from the table, read
    by ``check``, the optimizer, ``state_shape`` and the byte formula. Raises ``ConfigError`` (one line
    naming the period's key and the decay's setting) when an "auto" period has no decay in (0, 1)."""
    betas1, beta2 = _decays(cfg, hparams)
    has_v = cfg.base != "sgdm"
    ku = tuple(_period(f"Ku[{j}]", k, b, f"first momentum u{j}'s decay") for j, (k, b) in enumerate(zip(cfg.Ku, betas1)))
    kv = _period("Kv", cfg.Kv, beta2, "the second moment's decay") if has_v else 0
    fastest = min(betas1 + ([beta2] if has_v else []), key=lambda decay: decay[0])
    kx = _period("Kx", cfg.Kx, fastest, "the fastest state's decay")
    return Periods(Kx=kx, Ku=ku, Kv=kv)


def check(cfg: Config, hparams: BaseHParams) -> list[str]:
    """The family's cross-field rules (list lengths, Σω, periods, sync_delay, merge, the Muon base's one
    momentum), no collectives: the first problem found, as one line. Each value's kind has passed the
    generic validator."""
    ku, om = list(cfg.Ku), list(cfg.omega)
    n = len(ku)
    if n == 0:
        return [f"[{SECTION}] Ku = []: allowed is one period per first momentum (N >= 1)"]
    if cfg.base == "muon":
        if n != 1 or list(cfg.omega) != [1.0]:
            return [f"[{SECTION}] Ku = {ku!r}, omega = {om!r}: allowed with base = \"muon\" is one momentum (one Ku "
                    "entry, omega = [1.0]): Muon's M, and the routed parameters' Adam u_0"]
        if cfg.switch_at != 0:
            return [f"[{SECTION}] switch_at = {cfg.switch_at!r}: allowed with base = \"muon\" is 0 (MT-DAO's switch "
                    "changes the momenta of an adaptive base)"]
        problems = muon_problems(cfg, SECTION)
        if problems:
            return problems
    b1 = list(cfg.beta1) or [hparams.beta1] * n
    for key, values, allowed, ok in (
        ("beta1", b1, "numbers in [0, 1)", lambda v: 0.0 <= v < 1.0),
        ("omega", om, "numbers in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    ):
        if len(values) != n:
            return [f"[{SECTION}] {key} = {values!r}: allowed is a list of {n} entries, one per Ku entry (Ku = {ku!r})"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v) for v in values):
            return [f"[{SECTION}] {key} = {values!r}: allowed is {allowed}"]
    if sum(om) > 1.0 + 1e-12:
        return [f"[{SECTION}] omega = {om!r}: allowed is weights with sum <= 1"]
    beta2 = _beta2(cfg, hparams)
    if not 0.0 <= beta2 < 1.0:
        return [f"[{SECTION}] beta2 = {beta2!r}: allowed is a number in [0, 1)"]
    for j, k in enumerate(ku):  # Kv and Kx are single values: the generic validator checked them
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            return [f"[{SECTION}] Ku[{j}] = {k!r}: allowed is an integer >= 0 (0 = never) or \"auto\""]
    try:
        periods = resolve_periods(cfg, hparams)
    except ConfigError as error:
        return [str(error)]
    if cfg.merge in OVERLAPPED_MERGES and cfg.sync_delay:
        return [
            f"[{SECTION}] merge = {cfg.merge!r} with sync_delay = {cfg.sync_delay!r}: allowed is sync_delay = 0 with "
            f"merge = \"delayed\" or \"eager\" (their sync stays in flight for a whole period by itself), or merge = "
            "\"additive\" for a sync_delay"
        ]
    if cfg.outer_wire_dtype != "same" and periods.Kx == 0:
        return [f"[{SECTION}] outer_wire_dtype = {cfg.outer_wire_dtype!r} with Kx = 0: outer_wire_dtype is read only "
                "by a parameter sync; set Kx > 0, or leave outer_wire_dtype unset"]
    if cfg.merge != "lerp" and cfg.merge_alpha != 0.0:
        return [f"[{SECTION}] merge_alpha = {cfg.merge_alpha!r} with merge = {cfg.merge!r}: merge_alpha is read only by "
                "merge = \"lerp\"; set merge = \"lerp\", or leave merge_alpha unset"]
    positive = [(k, key) for key, k in [("Kx", periods.Kx), ("Kv", periods.Kv)] +
                [(f"Ku[{j}]", k) for j, k in enumerate(periods.Ku)] if k > 0]
    smallest, key = min(positive, key=lambda period: period[0], default=(0, ""))
    if positive and cfg.sync_delay >= smallest:
        written = cfg.Ku[int(key[3:-1])] if key.startswith("Ku[") else getattr(cfg, key)
        shown = f'"auto" ({smallest})' if written == "auto" else str(smallest)
        return [
            f"[{SECTION}] sync_delay = {cfg.sync_delay!r}: allowed is an integer >= 0 below the smallest period > 0, "
            f"[{SECTION}] {key} = {shown}: a fragment must have merged before it is due again"
        ]
    return []


def local_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """R payload per rank per step: (d·(1/Kx + Σ_j 1/K_j) + d_v/Kv)·bytes, all-reduce (sent =
    received); d = the local shard's elements, d_v those of the parameters that keep a second moment
    (all of them, but none with sgdm and only those routed to Adam with muon), bytes = the transfer
    dtype's (the parameter's for ``native``); a period of 0 (never) adds nothing. Fragments and
    ``sync_delay`` move syncs in time, not their bytes.

    With ``outer_wire_dtype`` fp8 / fp4 the parameters' term d/Kx·bytes becomes an all-gather of
    (Σ_p ⌈d_p/256⌉·(256·b/8 + 4))/Kx bytes sent, W − 1 times that received (d_p a tensor's local
    elements, b = 8 or 4 bits a code, 4 bytes of float32 scale a block: ``MiniFloatWire.nbytes``)."""
    if replicate_size <= 1:
        return Bytes()
    cfg = resolved.options
    periods = resolve_periods(cfg, resolved.hparams)
    inv = lambda k: 1.0 / k if k > 0 else 0.0  # noqa: E731
    dtype = cfg.transfer_dtype
    size = lambda s: s.numel * (s.itemsize if dtype == "native" else comm.DTYPES[dtype].itemsize)  # noqa: E731
    same = cfg.outer_wire_dtype == "same"  # x in the states' all-reduce
    total = sum(size(s) for s in shards) * ((inv(periods.Kx) if same else 0.0) + sum(inv(k) for k in periods.Ku))
    total += sum(size(s) for s in shards if _has_second_moment(cfg, s.fqn, s.shape)) * inv(periods.Kv)
    if same:
        return Bytes(total, total)
    x = MiniFloatWire(cfg.outer_wire_dtype).nbytes(s.numel for s in shards) * inv(periods.Kx)
    return Bytes(total + x, total + (replicate_size - 1) * x)


def local_s_bytes(shards: Sequence[ShardShape], resolved: Resolved, role: str = "S") -> Bytes:
    """S (or T) payload per rank per step of the family's own collectives that are priced: the Muon
    step's exchanges with ``base = "muon"`` (``muon/layout.muon_shard_bytes``), none otherwise."""
    if resolved.options.base != "muon":
        return Bytes()
    return muon_shard_bytes(shards, resolved.options, role)


def _has_second_moment(cfg: Config, fqn: str, shape: Sequence[int]) -> bool:
    """Whether a parameter keeps v: every one but with sgdm, and with muon the ones routed to Adam."""
    if cfg.base == "muon":
        return not is_muon_matrix(fqn, tuple(shape), cfg)
    return cfg.base != "sgdm"


def periodic(resolved: Resolved) -> Optional[PeriodicSyncs]:
    """Every state synced on a period > 0 (x, v, each u_j); a step where a subset of them is due
    sends what a run syncing exactly that subset every step sends. With fragments a real step sends a
    part of that (an upper bound)."""
    options = resolved.options
    p = resolve_periods(options, resolved.hparams)  # "auto" made numbers; Kv = 0 without v
    states = [(key, k) for key, k in [("Kx", p.Kx), ("Kv", p.Kv)] + [(("Ku", j), k) for j, k in enumerate(p.Ku)]
              if k > 0]  # none: nothing is ever synced

    def due_alone(subset: tuple[int, ...]) -> Config:
        on = {states[i][0] for i in subset}
        return dataclasses.replace(options, Kx=int("Kx" in on), Kv=int("Kv" in on), sync_delay=0, merge="additive",
                                   merge_alpha=0.0, Ku=[int(("Ku", j) in on) for j in range(len(p.Ku))])

    schedule_kind = {"Kx": "x", "Kv": "v", **{("Ku", j): f"u{j}" for j in range(len(p.Ku))}}  # SyncSchedule's names
    return PeriodicSyncs(tuple(k for _, k in states), due_alone, exact=options.fragments == 1,
                         states=tuple(schedule_kind[key] for key, _ in states))


BLOCKS_PER_FRAGMENT = 3  # Streaming DiLoCo's fragment size at every scale (Douillard et al. 2025, §2.2, Fig. 6)


def fragment_count(fragments: Union[int, str], names: Sequence[str]) -> int:
    """``fragments`` as a number: ``"auto"`` → ⌈L / 3⌉ for the L numbered blocks among ``names``, at least 2
    where L ≥ 2 (a model of 2–5 blocks still streams), 1 without blocks; a number as it is. From the names
    alone, hence the same on every replica."""
    if fragments != "auto":
        return int(fragments)
    blocks = len(numbered_blocks(names))
    return max(min(2, blocks), math.ceil(blocks / BLOCKS_PER_FRAGMENT), 1)


def sync_schedule(cfg: Config, periods: Periods, names: Sequence[str], sizes: Sequence[int]) -> SyncSchedule:
    """Which fragment of which state is due after which update, for the parameters ``names`` (in the
    optimizer's order) of ``sizes`` local elements: split by size or strided by block (``fragment_layout``)."""
    return SyncSchedule(periods, sizes, fragment_count(cfg.fragments, names),
                        names if cfg.fragment_layout == "strided" else None)


def settings(resolved: Resolved) -> dict[str, Any]:
    """The options behind the bytes: the resolved periods, the wire dtype, the fragments (and an
    overlapped merge, which moves the bytes in time only)."""
    o, p = resolved.options, resolve_periods(resolved.options, resolved.hparams)
    return {"Kx": p.Kx, "Ku": list(p.Ku), "Kv": p.Kv, "transfer_dtype": o.transfer_dtype,
            **({"outer_wire_dtype": o.outer_wire_dtype} if o.outer_wire_dtype != "same" else {}),
            **({"fragments": o.fragments} if o.fragments != 1 else {}),
            **({"fragment_layout": o.fragment_layout} if o.fragments != 1 and o.fragment_layout != "size" else {}),
            **({"merge": o.merge} if o.merge != "additive" else {})}


def moment_key(j: int) -> str:
    """The state key of first momentum j; j = 0 keeps torch Adam's name, so an AdamW checkpoint's
    first moment maps onto it."""
    return "exp_avg" if j == 0 else f"exp_avg_{j}"


def _replication(p: torch.Tensor, topology: Topology) -> int:
    """How many ranks of this replica's S×T group hold the same local values of ``p`` (after
    :func:`replica_grad`, its gradient is laid out like it): the product of the mesh dims the
    DTensor is ``Replicate`` on — e.g. a norm weight under TP — or all of S×T for a plain tensor."""
    if not isinstance(p, DTensor):
        return topology.shard_size * topology.tp_size
    return math.prod(
        p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)
    )




class LocalAdaptive(LocalSteps, CommOptimizer):
    """One engine for DES-LOC (N = 1, ω = 1), MT-DAO (N momenta, quasi-hyperbolic), Local Adam
    (Ku = Kv = Kx) and DiLoCo (Ku = Kv = 0, Nesterov outer). See the module docstring for the math.

    ``betas1``/``omegas``/``beta2``/``eps``/``weight_decay``/``lr`` are per param group (from the
    table, [optimizer]'s where unset); the periods, base algorithm, clipping and outer optimizer are
    global (syncs are fused over all parameters, and the norm clip is over the whole replica gradient).
    Public state besides torch's: ``periods`` (resolved), ``schedule`` (which fragment of which state
    is due when), ``switch_at`` (MT-DAO's switch as an update count).
    """

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional["comm.CommLedger"] = None) -> None:
        cfg, hp = options.options, options.hparams
        defaults = dict(
            lr=hp.lr, betas1=_betas1(cfg, hp), omegas=tuple(float(w) for w in cfg.omega), beta2=_beta2(cfg, hp),
            eps=_table_or(cfg.eps, hp.eps), weight_decay=_table_or(cfg.weight_decay, hp.weight_decay),
        )
        params = trainable(named_params)
        if cfg.base == "muon":  # the hidden matrices step by Muon, the rest by Adam (optim/routing.py)
            params = routed_groups(params, cfg, options.name, lr=hp.lr, muon={}, adamw={})
        super().__init__(params, topology, options, defaults, ledger=ledger)
        self.periods = resolve_periods(cfg, hp)
        # Global, not per group: read with the checkpointed step counter, a resume switches at the same
        # update; param_groups saved before the switch existed still load.
        self.switch_at = hp.warmup_steps if cfg.switch_at == "warmup" else int(cfg.switch_at)
        self._base_beta1 = float(hp.beta1)  # u_0's β before the switch
        self._corrects_switch = cfg.base == "adam" and cfg.bias_correction
        adaptive_base = "adam" if cfg.base == "muon" else cfg.base  # what the parameters routed around Muon run
        self._local_update = local_update(adaptive_base, adopt_clip=cfg.adopt_clip, bias_correction=cfg.bias_correction)
        self._base = adaptive_base
        self._has_v = cfg.base != "sgdm"
        self.muon = MuonMatrices(self.param_groups, topology, cfg) if cfg.base == "muon" else None
        self._clip = gradient_clip(cfg.clip, cfg.clip_threshold)
        self._clip_by_norm = cfg.clip == "norm"
        self._clip_threshold = cfg.clip_threshold
        nesterov = cfg.outer == "nesterov"
        self._nesterov = nesterov
        # One replica syncs nothing, unless the outer step runs (DiLoCo with one worker is not Adam).
        self._syncs = topology.replicated or nesterov
        self._replicate = topology.replicate if topology.replicated else None
        self._wire_dtype = None if cfg.transfer_dtype == "native" else comm.DTYPES[cfg.transfer_dtype]
        self._outer_wire = None if cfg.outer_wire_dtype == "same" else MiniFloatWire(cfg.outer_wire_dtype)
        self._sync_delay = cfg.sync_delay
        self._merge = cfg.merge
        self._alpha = cfg.merge_alpha if cfg.merge == "lerp" else None
        self._overlapped = cfg.merge in OVERLAPPED_MERGES
        # An overlapped merge applies pseudo-gradients from an anchor, and a quantized outer wire sends
        # them, so averaging keeps one too (outer SGD at lr 1); the Nesterov outer step always has one.
        self._anchored = (nesterov or self._overlapped or self._outer_wire is not None) and self.periods.Kx > 0
        self._outer = (partial(updates.nesterov_outer_, lr=cfg.outer_lr, momentum=cfg.outer_momentum) if nesterov
                       else _anchor_follows if self._anchored else None)
        self._outer_delta = (
            partial(_nesterov_outer_delta, lr=cfg.outer_lr, momentum=cfg.outer_momentum) if nesterov
            else _average_outer_delta
        )
        self.start_step_counter()
        # Eager state: DCP's _init_optim_state would otherwise run a dummy zero-grad step (lr 0) on
        # an empty state, advancing the step counter (the sync schedule) and seeding ADOPT's v with 0.
        self._params: list[tuple[dict, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group)
                    self._params.append((group, p))
        names = [name for _, name, p in params_by_name(self.param_groups) if p.requires_grad]
        self.schedule = sync_schedule(cfg, self.periods, names, [p.numel() for _, p in self._params])
        # [commopt] kernels, decided once: the fused Triton update (update_triton.py) for every local step
        # but plain Adam's, which torch's fused AdamW kernel already makes in one pass.
        self._fused_update = (
            fused_local_update(cfg.base, adopt_clip=cfg.adopt_clip, bias_correction=cfg.bias_correction,
                               clip=cfg.clip, clip_threshold=cfg.clip_threshold)
            if cfg.base != "muon" and use_triton(options.kernels, {local(p).device for _, p in self._params})
            else None  # muon: Newton–Schulz is matmuls (torch's), its Adam parameters plain Adam (torch's fused)
        )
        if self._fused_update is not None:
            from .update_triton import takes  # Triton is imported only where it runs

            self._fused_takes = takes

    # ---- hooks the torchtitan plug-in reads (titan/common/container.py, replica_state.py) ---------------
    @property
    def params_replica_local(self) -> bool:
        """Parameters differ across replicas between Kx syncs: checkpoints keep them per replica."""
        return self.periods.Kx != 1

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters now: before the first step (the adapter
        broadcasts replica 0's parameters), or right after a step at which every fragment's x was
        averaged with no delay (``merge = "lerp"`` too when α = 0), or applied after a whole period's
        delay (``merge = "delayed"``: every replica applies the same mean). With several fragments at
        different offsets, a ``sync_delay`` (local progress is kept at a merge) or ``merge = "eager"``
        (each replica applies its own fresh share), that never happens after the first step. Read from
        the clock, which a resume sets back."""
        exact = self._merge in ("additive", "delayed") or (self._merge == "lerp" and self._alpha == 0.0)
        return self._clock == 0 or (self._sync_delay == 0 and exact and self.schedule.all_x_due(self._clock))

    def steps_to_next_sync(self) -> Optional[int]:
        """Steps until the next R sync of any state (x, u_j or v); ``None`` when one period is 1
        (a sync every step) or all are 0 (never), or with one replica."""
        return None if not self.topology.replicated else self.schedule.steps_to_next(self._clock)

    @contextmanager
    def global_params(self, *, ledger: Optional["comm.CommLedger"] = None) -> Iterator[None]:
        """The global model (``CommOptimizer.global_params``): with an anchor (the Nesterov outer step,
        an overlapped merge, or averaging on a quantized outer wire), the anchor (x after the last outer
        step that landed), averaged over R for ``merge = "eager"`` (each replica's anchor holds its own
        fresh share; one all-reduce);
        else the parameters themselves where the replicas hold the same ones (one replica, or right
        after a sync of every fragment's x), and mean_R(x) anywhere else: what a sync now would make.
        Averages are in ``transfer_dtype``, one all-reduce recorded on ``ledger`` (default:
        ``self.ledger``)."""
        params = [p for _, p in self._params]
        ledger = ledger if ledger is not None else self.ledger
        if self._anchored and self._syncs:  # (averaging on one replica syncs nothing: x is the model)
            anchors = [self.state[p]["outer_anchor"] for p in params]
            if self._merge == "eager" and self._replicate is not None:
                with replica_mean_swapped_in(params, self._replicate, wire_dtype=self._wire_dtype, ledger=ledger,
                                             sources=anchors):
                    yield
            else:
                with anchors_swapped_in(params, anchors):
                    yield
        elif self._replicate is None or self.replicas_in_sync():
            yield
        else:
            with replica_mean_swapped_in(params, self._replicate, wire_dtype=self._wire_dtype, ledger=ledger):
                yield

    # ---- state -----------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
            state["step"] = self._step_t
            for key in self._row_states(group):
                state[key] = zeros()
            if self._anchored:
                # x at the last sync: the outer step's pseudo-gradient is anchor − mean_R(x)
                state["outer_anchor"] = p.detach().clone()
            if self._nesterov and self.periods.Kx > 0:
                state["outer_buf"] = zeros()
            if self._overlapped:  # zeros: the sync of nothing at update 0 (sync.sync_overlapped)
                for key in self._overlap_keys(group):
                    state[f"inflight_{key}"] = zeros()
                    if self._merge == "eager":
                        state[f"sent_{key}"] = zeros()
        return state

    def _overlap_keys(self, group: dict) -> list[str]:
        """The synced tensors of a parameter (x, and of its row's states u_j, v those with a period > 0)
        under an overlapped merge."""
        period = {moment_key(j): k for j, k in enumerate(self.periods.Ku)} | {"exp_avg_sq": self.periods.Kv}
        return (["x"] if self.periods.Kx > 0 else []) + [key for key in self._row_states(group) if period[key] > 0]

    # ---- step ------------------------------------------------------------------------------------
    def _clip_scale(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
        """min(1, ρ/‖g‖) with ‖g‖ the replica's whole-model gradient norm (shards summed over S, T),
        as a 0-dim float64 tensor on the gradients' device: no host synchronization. Each tensor's
        norm is taken in its own precision (float32 at least), their squares summed in float64."""
        device = grads[0].device if grads else comm.control_device(self.topology.shard)
        sq = torch.zeros((), dtype=torch.float64, device=device)  # on the grads' device (NCCL)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g, p in zip(grads, params):
            groups.setdefault((g.dtype, _replication(p, self.topology)), []).append(g)
        for (dtype, rep), gs in groups.items():
            norms = torch._foreach_norm(gs, 2, dtype=torch.promote_types(dtype, torch.float32))
            sq += torch.stack(norms).double().square().sum() / rep
        comm.all_reduce(sq, S, self.topology.shard, op="sum", ledger=self.ledger)
        comm.all_reduce(sq, T, self.topology.tp, op="sum", ledger=self.ledger)
        return (self._clip_threshold / (sq.sqrt() + 1e-12)).clamp(max=1.0)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, work = self.begin_local_step(closure, self._row_states)
        if work is None:
            return loss
        n = work.n
        scale = self._clip_scale([g for _, g in work.grads], [p for p, _ in work.grads]) if self._clip_by_norm else None
        matrices = []
        for group, rows in work.groups:
            if group.get("algorithm") == "muon":  # after the clip, Muon's step (muon/engine.py) below
                stepping = [p for p in group["params"] if p.grad is not None]
                gs = [row[1] for row in rows]
                gs = self._clip(gs, scale) if self._clip is not None else gs
                matrices += [(group, p, g, row[2]) for p, g, row in zip(stepping, gs, rows)]
                continue
            hp, corrections = self._hparams(group, n)
            fused = self._fused_update is not None and not (
                self._base == "adam" and updates.is_plain_adam(len(hp["betas1"]), hp["omegas"], corrections)
            ) and self._fused_takes(rows)  # float64 stays on torch
            # the fused kernel makes no temporaries: one launch for the whole group, its clip folded in
            limit = math.inf if fused else chunk_limit(rows[0][0].device)
            nm = len(hp["betas1"])
            for cols in column_chunks(rows, limit):
                xs, gs, moments, vs = cols[0], cols[1], cols[2 : 2 + nm], cols[-1] if self._has_v else None
                if fused:
                    self._fused_update(xs, gs, moments, vs, group, hp, n, corrections, scale)
                    continue
                if self._clip is not None:
                    gs = self._clip(gs, scale)
                self._local_update(xs, gs, moments, vs, group, hp, n, corrections)
        if self.muon is not None:
            self.muon.step(matrices, self.runtime, self.ledger)
        self._sync(work.clock)
        return loss

    def _row_states(self, group: dict) -> list[str]:
        """The states of a row, after x and g: the first momenta u_j, then v (none for sgdm, none for
        Muon's matrices: their one momentum u_0 is Muon's M)."""
        if group.get("algorithm") == "muon":
            return [moment_key(0)]
        return [moment_key(j) for j in range(len(group["betas1"]))] + (["exp_avg_sq"] if self._has_v else [])

    def _hparams(self, group: dict, n: int) -> tuple[dict, Optional[list[float]]]:
        """This update's lr, betas1, omegas, weight_decay of ``group`` and the first momenta's bias
        corrections (``None``: 1 − β1_j^n): MT-DAO's switch decides which momenta step with which β."""
        betas1, omegas, corrections = group["betas1"], group["omegas"], None
        k = self.switch_at
        if n <= k:  # before MT-DAO's switch: the plain base optimizer on u_0 (the other u_j stay 0)
            betas1, omegas = (self._base_beta1,), (1.0,)
        elif k > 0 and self._corrects_switch:
            # The weight each EMA has gathered: u_0 was built with the base β for k updates, then β1_0
            # (1 − β^k·β1_0^(n−k)); u_j (j ≥ 1) started at zero at the switch (1 − β1_j^(n−k)).
            carried = [self._base_beta1**k] + [1.0] * (len(betas1) - 1)
            corrections = [1 - c * b ** (n - k) for c, b in zip(carried, betas1)]
        return dict(lr=group["lr"], betas1=betas1, omegas=omegas, weight_decay=group["weight_decay"]), corrections

    # ---- the R syncs (sync.py) ------------------------------------------------------------------
    def _sync(self, n: int) -> None:
        """Average every (state, fragment) due after step ``n`` (the clock) in one fused all-reduce: now
        (``sync_delay`` = 0) or merged after step ``n + sync_delay``; merge what is due now. With an
        overlapped ``merge``: land what is due, apply it and issue this step's (``sync_overlapped``)."""
        due = self.schedule.due(n) if self._syncs else {}
        if self._overlapped:
            # What was issued a period ago lands first (its means into the inflight_ states), then this
            # step's sync applies it and issues its own, which lands by the next sync of any of its states.
            self.runtime.advance(n)
            if due:
                kinds = dict(self.periods.kinds())
                self.runtime.start(
                    sync_overlapped(self._overlap_entries(due), self._reduce, self._merge,
                                    self.topology.replicate_size, self._outer_delta),
                    due=n + min(kinds[kind] for kind in due), record=("overlapped", n))
            return
        if due:
            states = self._due_states(due)
            if self._sync_delay or self._alpha is not None:  # lerp at τ = 0: lands by advance(n) below
                self.runtime.start(sync_streaming(states, self._reduce, self._outer, self._alpha),
                                   due=n + self._sync_delay, record=("streaming", n))
            else:
                self.runtime.run(sync_in_place(states, self._reduce, self._outer))
        self.runtime.advance(n)

    def _fail_sync(self, record: tuple[str, int]) -> None:
        """Live fault tolerance: the sync issued after update n (``record``: how it lands, n) will not
        land, its quorum having ended first (the rule: ``titan/common/replica_group.py``). Of each of its
        fragments:

        - a parameter with an anchor returns to it, its last global copy (the local steps since are lost,
          as torchft's Streaming DiLoCo loses them); its outer state (anchor, momentum) stays as it was;
        - ``sync_delay`` (streaming): a state (u_j, v), and a parameter without an anchor (averaging on an
          exact wire), keeps its local values: it has no global copy (the local steps since its last sync
          changed that mean), and its next sync averages it;
        - an overlapped merge (``delayed`` / ``eager``): the parameters' mean in flight and share sent
          become zero, the sync of nothing an overlapped merge starts from (the next outer step runs on
          zero: with Nesterov momentum it moves the anchor by the momentum alone, alike on every
          replica); a state's mean in flight stays this replica's own value sent, as if every replica
          had sent it.

        Every replica decides alike from the same record, so the global state (anchors, outer momenta)
        stays the same on all of them."""
        how, n = record
        due = self.schedule.due(n)
        if how == "overlapped":
            for e in self._overlap_entries(due):
                if e.anchor is not None:
                    e.live.copy_(e.anchor)
                    e.inflight.zero_()
                    if e.sent is not None:
                        e.sent.zero_()
            return
        states = self._due_states(due)
        for i, anchor, _ in states.outer:
            states.tensors[i].copy_(anchor)

    def _due_states(self, due: dict[str, set[int]]) -> DueStates:
        out = DueStates()
        for (group, p), f in zip(self._params, self.schedule.fragment_of):
            state = self.state[p]
            for j in range(len(group["betas1"])):
                if f in due.get(f"u{j}", ()):
                    out.tensors.append(local(state[moment_key(j)]))
            if f in due.get("v", ()) and "exp_avg_sq" in state:
                out.second_moments.append(len(out.tensors))
                out.tensors.append(local(state["exp_avg_sq"]))
            if f in due.get("x", ()):
                if self._outer is not None:
                    buf = local(state["outer_buf"]) if "outer_buf" in state else None
                    out.outer.append((len(out.tensors), local(state["outer_anchor"]), buf))
                out.tensors.append(local(p))
        return out

    def _overlap_entries(self, due: dict[str, set[int]]) -> list[OverlapEntry]:
        """The due tensors of an overlapped sync, in the fused buffer's order (u_j, v, x per parameter)."""
        out: list[OverlapEntry] = []
        eager = self._merge == "eager"
        for (group, p), f in zip(self._params, self.schedule.fragment_of):
            state = self.state[p]
            keyed = [(moment_key(j), f"u{j}") for j in range(len(group["betas1"]))] + [("exp_avg_sq", "v"), ("x", "x")]
            for key, kind in keyed:
                if f not in due.get(kind, ()) or (key != "x" and key not in state):  # Muon's matrices: no v
                    continue
                x = key == "x"
                out.append(OverlapEntry(
                    live=local(p) if x else local(state[key]), inflight=local(state[f"inflight_{key}"]),
                    sent=local(state[f"sent_{key}"]) if eager else None,
                    anchor=local(state["outer_anchor"]) if x else None,
                    buf=local(state["outer_buf"]) if x and "outer_buf" in state else None,
                    second_moment=key == "exp_avg_sq"))
        return out

    def _reduce(self, tensors: list[torch.Tensor], params: Params) -> "comm.Pending[None]":
        """The R mean of a sync's tensors: one fused all-reduce in ``transfer_dtype``; with a quantized
        outer wire the parameters' pseudo-gradients go apart, all-gathered as FP8/FP4 codes
        (``sync.pseudo_gradient_mean``), beside the states' all-reduce. One replica sends nothing."""
        if self._outer_wire is None or self._replicate is None or not params:
            return comm.all_reduce_fused(tensors, R, self._replicate, op="mean", dtype=self._wire_dtype,
                                         ledger=self.ledger, async_op=True)
        states = comm.all_reduce_fused([t for i, t in enumerate(tensors) if i not in params], R, self._replicate,
                                       op="mean", dtype=self._wire_dtype, ledger=self.ledger, async_op=True)
        xs = pseudo_gradient_mean([tensors[i] for i in params], list(params.values()), self._outer_wire,
                                  self._replicate, self.ledger)

        def both() -> None:
            states.wait()
            xs.wait()

        return comm.Pending(None, both, None, parts=(states, xs))


def _nesterov_outer_delta(x: torch.Tensor, anchor: torch.Tensor, buf: Optional[torch.Tensor], delta: torch.Tensor, *,
                          lr: float, momentum: float) -> None:
    """DiLoCo's outer step on a pseudo-gradient built from means of pseudo-gradients (``delta``, used
    up); x takes the new anchor."""
    updates.nesterov_step_(anchor, delta, buf, lr=lr, momentum=momentum)
    x.copy_(anchor)


def _anchor_follows(x: torch.Tensor, anchor: torch.Tensor, buf: Optional[torch.Tensor]) -> None:
    """``outer = "average"`` with an anchor (a quantized outer wire): x = mean_R(x) already; the anchor,
    from which the next sync's pseudo-gradient is taken, moves to it."""
    anchor.copy_(x)


def _average_outer_delta(x: torch.Tensor, anchor: torch.Tensor, buf: Optional[torch.Tensor],
                         delta: torch.Tensor) -> None:
    """``outer = "average"`` as an outer step on a pseudo-gradient: SGD at lr 1, x ← a − Δ̃ (with the
    blocking merge's Δ̄ = a − mean_R(x) and equal anchors, x ← mean_R(x))."""
    x.copy_(anchor).sub_(delta)
    anchor.copy_(x)


# ---- the family ------------------------------------------------------------------------------------
def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the base (which moments, what they mean), the number of
    first momenta, the Nesterov outer state (Kx > 0), per-replica parameters (Kx != 1), with
    ``base = "muon"`` the routing (which parameters keep a second moment), an overlapped merge's
    state, and whether blocking averaging keeps an anchor (``outer_wire_dtype``)."""
    cfg, periods = resolved.options, resolve_periods(resolved.options, resolved.hparams)
    return {
        "base": cfg.base,
        "Ku (number of first momenta)": len(periods.Ku),
        "outer": cfg.outer if periods.Kx > 0 else "none (Kx = 0)",
        "Kx": 1 if periods.Kx == 1 else "not 1 (parameters kept per replica)",
        **({"embed_names": cfg.embed_names, "head_names": cfg.head_names} if cfg.base == "muon" else {}),
        # the mean in flight and the share sent are state (the additive merge keeps none: left out, so
        # checkpoints written before the option existed still resume)
        **({"merge": cfg.merge} if cfg.merge in OVERLAPPED_MERGES else {}),
        # blocking averaging keeps an anchor only for a quantized outer wire (the Nesterov outer step and the
        # overlapped merges keep one anyway), so there "same" is recorded too: a checkpoint without the
        # anchor is not resumed with one expected (fp8 ↔ fp4 is refused as well: one key, strict)
        **({"outer_wire_dtype": cfg.outer_wire_dtype}
           if cfg.outer == "average" and cfg.merge not in OVERLAPPED_MERGES and periods.Kx > 0 else {}),
    }


FAMILY = Family(
    key="local",
    options=Config,
    presets=PRESETS,
    build=LocalAdaptive,
    r_bytes=local_r_bytes,
    check=check,
    state_shape=state_shape,
    periodic=periodic,
    settings=settings,
    preset_sources=PRESET_SOURCES,
    s_bytes=local_s_bytes,
    local_steps=True,
    summary="parameters every Kx, first moments every K_j, second moment every Kv steps (DES-LOC, MT-DAO, "
    "Local Adam, DiLoCo; MuLoCo with a Muon base)",
)
