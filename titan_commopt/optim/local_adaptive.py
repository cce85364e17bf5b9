"""DES-LOC and MT-DAO: local adaptive optimizers with desynced state syncs, as one engine.

Papers: DES-LOC (Algorithms 1/2) and MT-DAO ("Multi-timescale Distributed Adaptive Optimizers with
Local Updates", Algorithms 1-3). Every replica (R) steps on its own gradient ``g`` (no gradient
all-reduce over R); each state is averaged over R on its own period:

    g   ← clip(g, ρ)                                   # coordinate-wise or global-norm clip
    u_j ← β1_j·u_j + (1−β1_j)·g          j = 1..N      # N first momenta, u_j synced every K_j
    v   ← β2·v + (1−β2)·g²                             # second moment, synced every Kv
    Δ   ← [(1−Σω_j)·g + Σω_j·û_j] / (√v̂ + ε)           # quasi-hyperbolic combination
    x   ← x·(1−η·λ) − η·Δ                              # decoupled weight decay λ
    every Kx steps: x ← OuterOpt(mean_R(x))             # averaging, or Nesterov on x_anchor − mean_R(x)

after update number ``n`` (1-based, the optimizer's step counter) a state with period ``K`` is
averaged when ``n % K == 0``; every state due at ``n`` (all parameters, all kinds) goes in ONE fused
all-reduce over R. Period 0 = never sync (Ku = Kv = 0 is FedAvg/DiLoCo with persistent local states).

Streaming sync (``fragments`` F, ``sync_delay`` τ; after Streaming DiLoCo, Douillard et al. 2025,
"Streaming DiLoCo with overlapping communication"). The parameters, with all their states, are split
into F fragments balanced by size (greedy, largest first; the same on every replica). Fragment f of
a state with period K is due after update n when ``(n − ⌊f·K/F⌋) % K == 0``: the fragments' syncs
are spread over the period, each fragment still synced once per period, so the bytes per period and
the byte formula are unchanged while the per-step peak is ~1/F of it. Everything due at one step is
still one fused all-reduce. With τ = 0 it blocks and averages in place (F = 1, τ = 0 is exactly the
schedule above). With τ > 0 the all-reduce is issued async on a snapshot of what it sends and runs
during the next τ steps (their forward, backward and optimizer work); after update n + τ it merges
keeping the local progress of those τ steps: t ← mean_R(t at issue) + (t − t at issue) for t = x,
u_j, v (v clamped at 0); for the Nesterov outer step the step is applied to the snapshot's mean (the
anchor moves to it) and the local progress added on top. Replicas then differ by their local
progress, so parameters are never all identical after the first step (``replicas_in_sync``).
Memory: the snapshots of what is in flight (a fragment's tensors due at a step, for up to τ steps)
plus the wire buffer — the price of the overlap. τ must be below the smallest period > 0 (a
fragment merges before it is due again). A checkpoint (``state_dict``) first merges what is in
flight (``flush``), so the run that saved and a run resumed from it continue identically (those
fragments merge early, at the checkpoint's step).
Defaults F = 1, τ = 0 (the papers' blocking schedule), by measurement (``scripts/bench_netns.py``,
two emulated nodes, LocalAdam): on cpu_small over 10 Mbit/s streaming removed only 5–10 % of the mean
step time (F = 8, τ = 4 and F = 32, τ = 16; the link needs more time than the steps compute); on
debugmodel over 300 Mbit/s, F = 8, τ = 4 brought the mean step from 1.29× to 1.16× of its own at
10 Gbit/s (once R had a process group of its own, ``topology._own_r_group``), while its loss after
300 steps (``scripts/convergence.py``, seed 42) was +4.5 % for LocalAdam and −1.1 % for DES-LOC
against blocking: not a gain that makes a delayed-merge algorithm the default.

Host synchronizations: none per step in the optimizer itself. The step counter is a Python int
(every parameter's ``state["step"]`` is one shared CPU scalar tensor holding it, for checkpoints),
and the norm clip's scale min(1, ρ/‖g‖) stays a device tensor (multiplying by 1.0 is exact). The
local update runs the multi-tensor kernels (``kernels.*_multi_``) over chunks of parameters: bit for
bit the single-tensor kernels on CPU; the chunk bounds the temporaries (and, on CPU, keeps the data
of one chunk in cache across its operations). Where ``[commopt] kernels`` picks Triton (by default on
a CUDA/ROCm device; decided once at construction) every local step but plain Adam's runs one fused
kernel per param group and dtype instead (``titan_commopt.fused.adopt``: the clip folded in, each
tensor read and written once); plain Adam (one momentum, ω = 1) stays on torch's fused AdamW kernel,
which is one pass already and bit for bit torchtitan's AdamW.

DES-LOC is N = 1, ω = 1 (plain Adam locally); MT-DAO the general case. Base algorithms:

- ``adam``: as above; ``bias_correction`` divides u_j by 1−β1_j^n and v by 1−β2^n (the papers'
  "local bias correction"), which makes one replica exactly torch's Adam/AdamW.
- ``adopt`` (ADOPT, Taniguchi et al. 2024): the gradient is normalized by the *previous* second
  moment before it enters the momenta, ĝ = g / max(√v_prev, ε) (clipped to ±(n−1)^¼ when
  ``adopt_clip``), then Δ = (1−Σω)·ĝ + Σω_j·u_j needs no division, and v is updated last. The first
  step only initializes v = g² (no parameter update). MT-DAO's Algorithm 2 text updates v before
  normalizing; we follow ADOPT's order, which is what makes ADOPT converge for any β2. No bias
  correction (ADOPT has none).
- ``sgdm``: Δ = (1−Σω)·g + Σω_j·u_j with the EMA momenta above (MT-DAO Algorithm 3), no second
  moment, no bias correction. With ω = 1 this is torch's ``SGD(momentum=β, dampening=0)`` at
  lr η·(1−β) (torch's buffer is u/(1−β)).

Where hyper-parameters come from: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` of this
table win when set (≥ 0 / a non-empty list); a negative value / empty list takes torchtitan's
``[optimizer]`` value (``hparams``). An unset ``lr`` is ``[optimizer] lr × lr_scale``, computed once by
the registry's ``resolve`` into ``Resolved.hparams.lr``, which is what the optimizer reads (so the scale
is never applied twice). ``lr`` is only the initial value of ``param_groups[i]["lr"]``: the LR
scheduler owns it afterwards and every step reads it from there.

Sharding: all state lives on the local FSDP2/TP shard (``local(p)``); state tensors shaped like a
parameter are DTensors with its placement (DCP), the step counter is a plain scalar tensor in
``state`` (checkpointable; one tensor shared by all parameters). They are *per replica* state: between syncs u, v, x differ
across replicas, so checkpoints must keep each replica's copy. The global-norm clip sums squared
local norms over S and T (1 float each; each tensor's norm in its own precision, float32 at least,
squares summed in float64); nothing else leaves the replica except the R syncs.
Gradient scale: ``topology.replica_grad`` (topology.py). The adapter reads two hooks:
``params_replica_local`` (parameters differ across replicas between syncs: Kx ≠ 1) and
``replicas_in_sync()`` (true right after a Kx sync of every fragment with no delay: when its drift
check may run).

Outer optimizer ``nesterov`` (DiLoCo): with ``a`` = x at the previous sync (``outer_anchor``) and
``b`` = ``outer_buf``: Δ = a − mean_R(x); b ← μ·b + Δ; x ← a − η_out·(Δ + μ·b); a ← x. With one
replica it still runs (DiLoCo with one worker is not plain Adam).

Presets (``PRESETS``, their sources in ``PRESET_SOURCES``): ``DES-LOC`` (Adam with [optimizer]'s β, no
weight decay, Kx=16, Ku=48=3Kx, Kv=96=6Kx, coordinate clip, 0.7 × the lr), ``DES-LOC-ADOPT`` (ADOPT,
β1=0.95, β2=0.9999, ε=1e-6, Kx=32, Ku=96, Kv=192), ``MT-DAO`` (ADOPT, β1=0.999, ω=0.95, β2=0.9999,
ε=1e-6, K=32 for all, switch at the end of warm-up), ``MT-DAO-halflife`` (the same with Ku=693,
Kv=6931), ``LocalAdam`` (Kx=Ku=Kv=32), ``DiLoCo`` (Kx=32, Ku=Kv=0, Nesterov outer lr 0.7, μ 0.9).

MT-DAO's switch (``switch_at`` = k; MT-DAO appendix B.2, "a simple switch from a base optimizer (e.g.
ADOPT) to its multi-timescale variant at the end of the warmup period"): updates n ≤ k run the plain
base optimizer — one momentum u_0 with ``[optimizer] beta1``, ω = 1 (Adam/ADOPT/SGDM as torch has
them) — and updates n > k the configured β1_j, ω_j. u_0 is carried across the switch (u_j, j ≥ 1,
start at zero there); with Adam's bias correction each u_j is divided by the weight it has gathered
(1 − β^k·β1_0^(n−k) for u_0). The syncs keep their schedule. Decided by the step counter alone, so the
same on every replica and after a resume.

Clipping: under torchtitan, ``[training] max_norm`` has already clipped every replica's gradient
by the replicas' common norm (``titan/adapter/container.py``) when ``step()`` runs. ``clip`` is a second,
optional clip inside the optimizer: ``coordinate`` is DES-LOC's algorithm (its preset keeps it: the
paper's analysis bounds state changes by the per-coordinate radius ρ); ``norm`` clips by this
replica's own norm (MT-DAO's paper clips per worker; its ρ = 1 is the training loop's max_norm, so
the preset leaves ``clip = "none"``).

Where things are: ``check`` (called by the registry's ``resolve``, nowhere else) holds every
cross-field rule (list lengths, Σω, periods, ``sync_delay``) without any collective; ``resolve_periods``
is the one value derived from the table (``"auto"`` → a number), read by ``check``, the optimizer,
``state_shape`` and the byte formula ``local_r_bytes``; the sync schedule and the two ways a sync
lands (in place, or streamed and merged) are in ``local_sync.py``, run as tasks on the optimizer's
``runtime`` (``titan_commopt.overlap``); the outer step is ``kernels.nesterov_outer_``. The fused sync
concatenates every due state into one buffer (up to 3× the local parameter shard at a step where x,
u and v are all due): that is the price of one collective per step.
"""

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Replicate

from titan_commopt import comm
from titan_commopt.fused import use_triton
from titan_commopt.options import ConfigError, option, resolve_auto_period
from titan_commopt.topology import R, S, T, Topology

from . import kernels
from .base import CommOptimizer, LocalSteps
from .common import LR_SCALE_HELP, BaseHParams, local, replica_grad
from .family import Bytes, Family, Resolved, ShardShape
from .local_sync import DueStates, Periods, SyncSchedule, sync_in_place, sync_streaming

__all__ = ["Config", "PRESETS", "LocalAdaptive", "FAMILY", "check", "resolve_periods", "local_r_bytes", "moment_key"]

SECTION = "commopt.local"


@dataclass
class Config:
    """``[commopt.local]``: the DES-LOC / MT-DAO engine (also LocalAdam and DiLoCo presets)."""

    base: Literal["adam", "adopt", "sgdm"] = option("adam", "Local base optimizer.")
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
    fragments: int = option(
        1, "Streaming sync: parameters (with their states) split into this many fragments, balanced "
        "by size; each is synced once per period at its own offset (fragment f of a state with "
        "period K when (step − ⌊f·K/F⌋) % K == 0). 1 = everything at once.", ge=1,
    )
    sync_delay: int = option(
        0, "Streaming sync: steps τ a fragment's all-reduce stays in flight (overlapped with the "
        "next τ steps) before it is merged, keeping the local progress of those steps: "
        "x ← mean_R(x at issue) + (x − x at issue), the same for u and v. 0 = blocking; must be "
        "below the smallest period > 0.", ge=0,
    )


# lr_scale: the quality study's best lr ÷ AdamW-HSDP's best (docs/benchmarks.md §4); 1 where they
# coincide (LocalAdam, DiLoCo, MT-DAO and MT-DAO-halflife: the default).
PRESETS: dict[str, dict[str, Any]] = {
    # DES-LOC-Adam: parameters synced most often, states at multiples of Kx (Ku = 3Kx, Kv = 6Kx: 2×
    # less than Local Adam's 3/K per step at the same Kx), the paper's coordinate clip, no weight decay.
    # Adam's β are [optimizer]'s (torchtitan's 0.9, 0.95: SmolLM2's, which DES-LOC's billion-scale runs
    # adopt). Their half-lives (6.6 and 13.5 steps) are about half of MT-DAO Table 3's β (0.95, 0.99)
    # for which Kx = 32 was chosen, so by the paper's rule (periods in proportion to half-lives) the
    # periods are halved: Kx = 16, 9/96 of a model per step, Local Adam's K = 32 budget, ~11× fewer
    # bytes than AdamW-HSDP. With 0.7 × AdamW-HSDP's lr this was the periods study's best at 300 and
    # 500 steps, 3 seeds (docs/benchmarks.md §4: +1.7 % and +6.0 %, against +3.9 % and +12.6 % at
    # Kx = 32). Alternatives: Kx = 32, Ku = [96], Kv = 192 with lr_scale 1; MT-DAO Table 3's β:
    # beta1 = [0.95], beta2 = 0.99.
    "DES-LOC": {
        "base": "adam", "weight_decay": 0.0,
        "Kx": 16, "Ku": [48], "Kv": 96, "clip": "coordinate", "lr_scale": 0.7,
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
    # DiLoCo-style: states never synced (persistent local state), Nesterov outer step every Kx. Outer
    # momentum 0.5, not the paper's 0.9: a short run has few outer steps (15 in 500 at Kx = 32), and the
    # momentum's amplification of the pseudo-gradient (up to 0.7/(1 − 0.9) = 7× with 0.9) cost most of
    # DiLoCo's gap in our study (docs/benchmarks.md §8).
    "DiLoCo": {"base": "adam", "Kx": 32, "Ku": [0], "Kv": 0, "outer": "nesterov", "outer_momentum": 0.5},
}


# Where each preset's values come from (docs/options.md prints it beside the preset).
PRESET_SOURCES: dict[str, str] = {
    "DES-LOC": "DES-LOC (Iacob et al.): appendix B.2 (no weight decay), Algorithm 1 (coordinate clip), §5.3 / "
    "Fig. 5 (Ku = 3Kx, Kv = 6Kx: the 2× reduction over Local Adam at Kx = 32; our reading, the extracted "
    "figure lost the numbers); Adam's β1, β2 from [optimizer] (torchtitan's 0.9, 0.95 are SmolLM2's, whose "
    "hyper-parameters DES-LOC §4.1 adopts for its billion-scale model and B.2.1 finds β2 to agree with), "
    "chosen over MT-DAO appendix E.2 Table 3's DES-LOC-ADAM β1 = 0.95, β2 = 0.99 by our quality study "
    "(docs/benchmarks.md §4: 9–10 % lower loss at 500 steps); Kx = 16 by the paper's rule of periods in "
    "proportion to the states' half-lives (§2, §5.2: those β have about half Table 3's half-lives) and "
    "lr_scale 0.7, both the best of our periods study (docs/benchmarks.md §4, 3 seeds: +1.7 % of "
    "AdamW-HSDP's loss at 300 steps and +6.0 % at 500, where Kx = 32 at lr_scale 1 was +3.9 % and "
    "+12.6 %). Alternatives: Kx = 32, Ku = [96], Kv = 192 with lr_scale = 1.0; the Table 3 β, "
    "beta1 = [0.95], beta2 = 0.99",
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
    "DiLoCo": "DiLoCo (Douillard et al. 2023): Nesterov outer step, outer lr 0.7; states never synced (FedAvg "
    "with persistent local states, DES-LOC §4.1 baseline (iii)); outer momentum 0.5 instead of its 0.9 by our "
    "study (docs/benchmarks.md §8, 500 steps, 3 seeds): +13 % of AdamW-HSDP's loss, where 0.9 was +33 % (0.7: "
    "+18 %, 0 with outer lr 1: +17 %, seed 42). Alternative: outer_momentum = 0.9 (the paper's)",
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


def resolve_periods(cfg: Config, hparams: BaseHParams) -> Periods:
    """The sync periods, each ``"auto"`` the power of two nearest its state's half-life (Kx: of the
    fastest state); Kv = 0 without a second moment (sgdm). The one value derived from the table, read
    by ``check``, the optimizer, ``state_shape`` and the byte formula. Raises ``ConfigError`` when an
    "auto" period has no decay in (0, 1)."""
    betas1, beta2 = _betas1(cfg, hparams), _beta2(cfg, hparams)
    has_v = cfg.base != "sgdm"
    ku = tuple(resolve_auto_period(k, b) for k, b in zip(cfg.Ku, betas1))
    kv = resolve_auto_period(cfg.Kv, beta2)
    kx = resolve_auto_period(cfg.Kx, min(betas1 + ((beta2,) if has_v else ())))
    return Periods(Kx=kx, Ku=ku, Kv=kv if has_v else 0)


def check(cfg: Config, hparams: BaseHParams) -> list[str]:
    """The family's cross-field rules (list lengths, Σω, periods, sync_delay), no collectives: the
    first problem found, as one line. Each value's kind has passed the generic validator."""
    ku, om = list(cfg.Ku), list(cfg.omega)
    n = len(ku)
    if n == 0:
        return [f"[{SECTION}] Ku = []: allowed is one period per first momentum (N >= 1)"]
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
        positive = resolve_periods(cfg, hparams).positive()
    except ConfigError as error:
        return [str(error)]
    if positive and cfg.sync_delay >= min(positive):
        return [
            f"[{SECTION}] sync_delay = {cfg.sync_delay!r}: allowed is an integer >= 0 below the smallest "
            f"period > 0 ({min(positive)}): a fragment must have merged before it is due again"
        ]
    return []


def local_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """R payload per rank per step: d·(1/Kx + Σ_j 1/K_j + 1/Kv)·bytes, all-reduce (sent =
    received); d = the local shard's elements, bytes = the transfer dtype's (the parameter's for
    ``native``); a period of 0 (never) adds nothing. Fragments and ``sync_delay`` move syncs in time,
    not their bytes."""
    if replicate_size <= 1:
        return Bytes()
    periods = resolve_periods(resolved.options, resolved.hparams)
    inv = lambda k: 1.0 / k if k > 0 else 0.0  # noqa: E731
    per_element = inv(periods.Kx) + sum(inv(k) for k in periods.Ku) + inv(periods.Kv)
    dtype = resolved.options.transfer_dtype
    total = sum(s.numel * (s.itemsize if dtype == "native" else comm.DTYPES[dtype].itemsize) for s in shards)
    return Bytes(total * per_element, total * per_element)


# ---- the local step's pieces, chosen once from the table ---------------------------------------------
LocalUpdate = Callable[..., None]  # (xs, gs, moments, vs, group, hp, n, corrections) → None


def _local_update(cfg: Config) -> LocalUpdate:
    """The base optimizer's multi-tensor update; ``hp`` = lr, betas1, omegas, weight_decay of this
    update, ``corrections`` the first momenta's bias corrections after MT-DAO's switch."""
    if cfg.base == "sgdm":
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            kernels.sgdm_multi_(xs, gs, moments, **hp)
    elif cfg.base == "adopt":
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            kernels.adopt_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                 clip=cfg.adopt_clip)
    else:
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            kernels.qh_adamw_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                    bias_correction=cfg.bias_correction, corrections1=corrections, fused=True)
    return update


def _fused_local_update(cfg: Config) -> Callable[..., None]:
    """:func:`_local_update` with the optimizer's clip, as one Triton kernel (``fused/adopt.py``);
    ``scale`` is the norm clip's min(1, ρ/‖g‖)."""
    from titan_commopt.fused.adopt import local_adaptive_  # Triton is imported only where it runs

    def update(xs, gs, moments, vs, group, hp, n, corrections, scale):
        local_adaptive_(xs, gs, moments, vs, base=cfg.base, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                        bias_correction=cfg.bias_correction, corrections1=corrections, adopt_clip=cfg.adopt_clip,
                        clip=cfg.clip, clip_threshold=cfg.clip_threshold, clip_scale=scale)
    return update


GradientClip = Callable[[list[torch.Tensor], Optional[torch.Tensor]], list[torch.Tensor]]


def _gradient_clip(cfg: Config) -> Optional[GradientClip]:
    """The optimizer's own clip of a chunk's gradients (new tensors; ``p.grad`` is never written),
    given the replica's norm scale min(1, ρ/‖g‖) for ``norm``; ``None`` for no clip."""
    rho = cfg.clip_threshold
    if cfg.clip == "coordinate":
        return lambda gs, scale: [g.clamp(-rho, rho) for g in gs]
    if cfg.clip == "norm":
        return lambda gs, scale: torch._foreach_mul(gs, scale)  # × 1.0 when not clipping: exact
    return None


def moment_key(j: int) -> str:
    """The state key of first momentum j; j = 0 keeps torch Adam's name, so an AdamW checkpoint's
    first moment maps onto it."""
    return "exp_avg" if j == 0 else f"exp_avg_{j}"


def _trainable(named_params: Any) -> list:
    """``(fqn, param)`` pairs, or param-group dicts of them, without the frozen parameters."""
    items = list(named_params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [(n, p) for n, p in g["params"] if p.requires_grad]} for g in items]
    return [(n, p) for n, p in items if p.requires_grad]


def _replication(p: torch.Tensor, topology: Topology) -> int:
    """How many ranks of this replica's S×T group hold the same local values of ``p`` (after
    :func:`replica_grad`, its gradient is laid out like it): the product of the mesh dims the
    DTensor is ``Replicate`` on — e.g. a norm weight under TP — or all of S×T for a plain tensor."""
    if not isinstance(p, DTensor):
        return topology.shard_size * topology.tp_size
    return math.prod(
        p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)
    )




# Elements per multi-tensor kernel call. On a GPU it bounds the temporaries a call allocates for its
# whole list; on a CPU (where the foreach ops loop over the tensors anyway) a small chunk keeps every
# operation of the update on data still in cache, and the temporaries small enough for the allocator
# to reuse: 2^16 measured best on debugmodel (2^14 … 2^18 within noise, 2^20 ≈ 1.2× slower, one
# chunk for everything ≈ 2× slower than that).
_CHUNK = {"cpu": 1 << 16}
_DEFAULT_CHUNK = 1 << 24


def _chunks(rows: list[list[torch.Tensor]], limit: int) -> list[list[list[torch.Tensor]]]:
    """``rows`` (the tensors of one parameter each: x, g, u_j, v) packed into chunks of at most
    ``limit`` elements (a larger parameter is a chunk of its own)."""
    chunks: list[list[list[torch.Tensor]]] = [[]]
    total = 0
    for row in rows:
        size = row[0].numel()
        if chunks[-1] and total + size > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(row)
        total += size
    return chunks




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
        super().__init__(_trainable(named_params), topology, options, defaults, ledger=ledger)
        self.periods = resolve_periods(cfg, hp)
        # Global, not per group: read with the checkpointed step counter, a resume switches at the same
        # update; param_groups saved before the switch existed still load.
        self.switch_at = hp.warmup_steps if cfg.switch_at == "warmup" else int(cfg.switch_at)
        self._base_beta1 = float(hp.beta1)  # u_0's β before the switch
        self._corrects_switch = cfg.base == "adam" and cfg.bias_correction
        self._local_update = _local_update(cfg)
        self._base = cfg.base
        self._has_v = cfg.base != "sgdm"
        self._clip = _gradient_clip(cfg)
        self._clip_by_norm = cfg.clip == "norm"
        self._clip_threshold = cfg.clip_threshold
        nesterov = cfg.outer == "nesterov"
        self._outer = partial(kernels.nesterov_outer_, lr=cfg.outer_lr, momentum=cfg.outer_momentum) if nesterov else None
        # One replica syncs nothing, unless the outer step runs (DiLoCo with one worker is not Adam).
        self._syncs = topology.replicate_size > 1 or nesterov
        self._replicate = topology.replicate if topology.replicate_size > 1 else None
        self._wire_dtype = None if cfg.transfer_dtype == "native" else comm.DTYPES[cfg.transfer_dtype]
        self._sync_delay = cfg.sync_delay
        # The step counter: one Python int (no host read per parameter); every parameter's
        # state["step"] is the same CPU scalar tensor holding it, so checkpoints carry it.
        self._n = 0
        self._step_t = torch.tensor(0.0)
        # Eager state: DCP's _init_optim_state would otherwise run a dummy zero-grad step (lr 0) on
        # an empty state, advancing the step counter (the sync schedule) and seeding ADOPT's v with 0.
        self._params: list[tuple[dict, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, len(group["betas1"]))
                    self._params.append((group, p))
        self.schedule = SyncSchedule(self.periods, [p.numel() for _, p in self._params], cfg.fragments)
        # [commopt] kernels, decided once: the fused Triton update (fused/adopt.py) for every local step
        # but plain Adam's, which torch's fused AdamW kernel already makes in one pass.
        self._fused_update = (
            _fused_local_update(cfg) if use_triton(options.kernels, {local(p).device for _, p in self._params})
            else None
        )
        if self._fused_update is not None:
            from titan_commopt.fused.adopt import takes  # Triton is imported only where it runs

            self._fused_takes = takes

    # ---- hooks the torchtitan adapter reads (titan/adapter/container.py, state.py) ------------------------
    @property
    def params_replica_local(self) -> bool:
        """Parameters differ across replicas between Kx syncs: checkpoints keep them per replica."""
        return self.periods.Kx != 1

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters now: before the first step (the adapter
        broadcasts replica 0's parameters), or right after a step at which every fragment's x was
        averaged with no delay. With several fragments at different offsets, or a ``sync_delay``
        (local progress is kept at a merge), that never happens after the first step. Read from the
        checkpointed step counter, so it stays right after a resume."""
        return self._n == 0 or (self._sync_delay == 0 and self.schedule.all_x_due(self._n))

    def steps_to_next_sync(self) -> Optional[int]:
        """Steps until the next R sync of any state (x, u_j or v); ``None`` when one period is 1
        (a sync every step) or all are 0 (never), or with one replica."""
        return None if self.topology.replicate_size == 1 else self.schedule.steps_to_next(self._n)

    # ---- state -----------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, n_moments: int) -> dict:
        state = self.state[p]
        if not state:
            zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
            state["step"] = self._step_t
            for j in range(n_moments):
                state[moment_key(j)] = zeros()
            if self._has_v:
                state["exp_avg_sq"] = zeros()
            if self._outer is not None and self.periods.Kx > 0:
                # x at the last sync: the outer step's pseudo-gradient is anchor − mean_R(x)
                state["outer_anchor"] = p.detach().clone()
                state["outer_buf"] = zeros()
        return state

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                work.append((group, p, replica_grad(p, self.topology, ledger=self.ledger)))
        if not work:
            return loss
        self._n += 1
        n = self._n
        self._step_t.fill_(n)

        scale = self._clip_scale([g for _, _, g in work], [p for _, p, _ in work]) if self._clip_by_norm else None
        by_group: dict[int, tuple[dict, list[list[torch.Tensor]]]] = {}
        for group, p, g in work:
            state = self.state[p]
            x = local(p)
            row = [x, g if g.dtype == x.dtype else g.to(x.dtype)]
            row += [local(state[moment_key(j)]) for j in range(len(group["betas1"]))]
            if self._has_v:
                row.append(local(state["exp_avg_sq"]))
            by_group.setdefault(id(group), (group, []))[1].append(row)
        for group, rows in by_group.values():
            hp, corrections = self._hparams(group, n)
            fused = self._fused_update is not None and not (
                self._base == "adam" and kernels.is_plain_adam(len(hp["betas1"]), hp["omegas"], corrections)
            ) and self._fused_takes(rows)  # float64 stays on torch
            # the fused kernel makes no temporaries: one launch for the whole group, its clip folded in
            limit = math.inf if fused else _CHUNK.get(rows[0][0].device.type, _DEFAULT_CHUNK)
            for chunk in _chunks(rows, limit):
                cols = [list(col) for col in zip(*chunk)]
                nm = len(hp["betas1"])
                xs, gs, moments, vs = cols[0], cols[1], cols[2 : 2 + nm], cols[-1] if self._has_v else None
                if fused:
                    self._fused_update(xs, gs, moments, vs, group, hp, n, corrections, scale)
                    continue
                if self._clip is not None:
                    gs = self._clip(gs, scale)
                self._local_update(xs, gs, moments, vs, group, hp, n, corrections)
        self._sync(n)
        return loss

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

    # ---- the R syncs (local_sync.py) -------------------------------------------------------------
    def _sync(self, n: int) -> None:
        """Average every (state, fragment) due after update ``n`` in one fused all-reduce: now
        (``sync_delay`` = 0) or merged after update ``n + sync_delay``; merge what is due now."""
        due = self.schedule.due(n) if self._syncs else {}
        if due:
            states = self._due_states(due)
            if self._sync_delay:
                self.runtime.start(sync_streaming(states, self._reduce, self._outer), due=n + self._sync_delay)
            else:
                self.runtime.run(sync_in_place(states, self._reduce, self._outer))
        self.runtime.advance(n)

    def _due_states(self, due: dict[str, set[int]]) -> DueStates:
        out = DueStates()
        for (group, p), f in zip(self._params, self.schedule.fragment_of):
            state = self.state[p]
            for j in range(len(group["betas1"])):
                if f in due.get(f"u{j}", ()):
                    out.tensors.append(local(state[moment_key(j)]))
            if f in due.get("v", ()):
                out.second_moments.append(len(out.tensors))
                out.tensors.append(local(state["exp_avg_sq"]))
            if f in due.get("x", ()):
                if self._outer is not None:
                    out.outer.append((len(out.tensors), local(state["outer_anchor"]), local(state["outer_buf"])))
                out.tensors.append(local(p))
        return out

    def _reduce(self, tensors: list[torch.Tensor]) -> "comm.Pending[None]":
        return comm.all_reduce_fused(tensors, R, self._replicate, op="mean", dtype=self._wire_dtype,
                                     ledger=self.ledger, async_op=True)


# ---- the family ------------------------------------------------------------------------------------
def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the base (which moments, what they mean), the number of
    first momenta, the Nesterov outer state (Kx > 0) and per-replica parameters (Kx != 1)."""
    cfg, periods = resolved.options, resolve_periods(resolved.options, resolved.hparams)
    return {
        "base": cfg.base,
        "Ku (number of first momenta)": len(periods.Ku),
        "outer": cfg.outer if periods.Kx > 0 else "none (Kx = 0)",
        "Kx": 1 if periods.Kx == 1 else "not 1 (parameters kept per replica)",
    }


FAMILY = Family(
    key="local",
    options=Config,
    presets=PRESETS,
    build=LocalAdaptive,
    r_bytes=local_r_bytes,
    check=check,
    state_shape=state_shape,
    preset_sources=PRESET_SOURCES,
    summary="parameters every Kx, first moments every K_j, second moment every Kv steps (DES-LOC, MT-DAO, "
    "Local Adam, DiLoCo)",
)
