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
of one chunk in cache across its operations).

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
the registry's ``resolve`` into ``Resolved.hparams.lr``, which is what ``settings`` reads (so the scale
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
by the replicas' common norm (``titan/container.py``) when ``step()`` runs. ``clip`` is a second,
optional clip inside the optimizer: ``coordinate`` is DES-LOC's algorithm (its preset keeps it: the
paper's analysis bounds state changes by the per-coordinate radius ρ); ``norm`` clips by this
replica's own norm (MT-DAO's paper clips per worker; its ρ = 1 is the training loop's max_norm, so
the preset leaves ``clip = "none"``).

``settings(cfg, hparams)`` turns the table into concrete numbers (periods, betas, lr) and does every
cross-field check (list lengths, Σω, periods) without any collective; ``build``, the byte formula
(``traffic.local_r_bytes``) and the registry's ``check`` call it. The fused sync concatenates every due state into one buffer (up to
3× the local parameter shard at a step where x, u and v are all due): that is the price of one
collective per step.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Replicate

from titan_commopt import comm
from titan_commopt.options import ConfigError, option, resolve_auto_period
from titan_commopt.topology import R, S, T, Topology

from . import kernels
from .base import CommOptimizer
from .common import LR_SCALE_HELP, BaseHParams, NamedParams, local, replica_grad
from .family import Family, Resolved
from .traffic import local_r_bytes

__all__ = ["Config", "PRESETS", "LocalAdaptive", "FAMILY", "build", "check", "settings", "Settings"]

SECTION = "commopt.local"


@dataclass
class Config:
    """``[commopt.local]``: the DES-LOC / MT-DAO engine (also LocalAdam and DiLoCo presets)."""

    base: str = option("adam", "Local base optimizer.", choices=("adam", "adopt", "sgdm"))
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
    outer: str = option(
        "average", "Outer optimizer at a Kx sync: average (x = mean_R x) or nesterov (Nesterov "
        "momentum on the pseudo-gradient x_anchor − mean_R x, DiLoCo).", choices=("average", "nesterov"),
    )
    outer_lr: float = option(0.7, "Outer (Nesterov) learning rate.", gt=0.0)
    outer_momentum: float = option(0.9, "Outer (Nesterov) momentum.", ge=0.0, lt=1.0)
    clip: str = option(
        "none", "A second gradient clip inside the optimizer, after [training] max_norm: "
        "coordinate-wise to ±clip_threshold (DES-LOC's algorithm) or by this replica's own gradient "
        "norm.",
        choices=("none", "coordinate", "norm"),
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
    transfer_dtype: str = option(
        "fp32", "dtype of synced states on the wire (native = the state's own dtype).",
        choices=("fp32", "bf16", "native"),
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
    # DiLoCo-style: states never synced (persistent local state), Nesterov outer step every Kx.
    "DiLoCo": {"base": "adam", "Kx": 32, "Ku": [0], "Kv": 0, "outer": "nesterov"},
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
    "DiLoCo": "DiLoCo (Douillard et al. 2023): Nesterov outer step, outer lr 0.7, momentum 0.9; states never "
    "synced (FedAvg with persistent local states, DES-LOC §4.1 baseline (iii))",
}


# ---- configuration → concrete numbers (shared by build and the byte formula) ---------------------
@dataclass(frozen=True)
class Settings:
    base: str
    betas1: tuple[float, ...]
    omegas: tuple[float, ...]
    periods_u: tuple[int, ...]
    beta2: float
    Kv: int
    Kx: int
    lr: float
    eps: float
    weight_decay: float
    fragments: int = 1
    sync_delay: int = 0
    switch_at: int = 0
    base_beta1: float = 0.9


def _period(value: Any, beta: float, key: str) -> int:
    if value == "auto":
        return resolve_auto_period(value, beta)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"[{SECTION}] {key} = {value!r}: allowed is an integer >= 0 (0 = never) or \"auto\""
        )
    return value


def settings(cfg: Config, hparams: Optional[BaseHParams] = None) -> Settings:
    """The table's concrete numbers, defaults filled in from ``hparams`` (torchtitan's
    ``[optimizer]``; ``hparams.lr`` is taken as the effective lr: ``resolve`` has applied ``lr_scale``).
    Raises ``ConfigError`` on a cross-field problem."""
    hp = hparams or BaseHParams()
    ku, om = list(cfg.Ku), list(cfg.omega)
    b1 = list(cfg.beta1) or [hp.beta1] * len(ku)
    n = len(ku)
    if n == 0:
        raise ConfigError(f"[{SECTION}] Ku = []: allowed is one period per first momentum (N >= 1)")
    for key, values in (("beta1", b1), ("omega", om)):
        if len(values) != n:
            raise ConfigError(
                f"[{SECTION}] {key} = {values!r}: allowed is a list of {n} entries, one per Ku entry "
                f"(Ku = {ku!r})"
            )
    for key, values in (("beta1", b1), ("omega", om)):
        for v in values:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            ok = ok and (0.0 <= v < 1.0 if key == "beta1" else 0.0 <= v <= 1.0)
            if not ok:
                allowed = "numbers in [0, 1)" if key == "beta1" else "numbers in [0, 1]"
                raise ConfigError(f"[{SECTION}] {key} = {values!r}: allowed is {allowed}")
    if sum(om) > 1.0 + 1e-12:
        raise ConfigError(f"[{SECTION}] omega = {om!r}: allowed is weights with sum <= 1")
    beta2 = hp.beta2 if cfg.beta2 < 0 else cfg.beta2
    if not 0.0 <= beta2 < 1.0:
        raise ConfigError(f"[{SECTION}] beta2 = {beta2!r}: allowed is a number in [0, 1)")
    periods_u = tuple(_period(k, b, f"Ku[{j}]") for j, (k, b) in enumerate(zip(ku, b1)))
    kv = _period(cfg.Kv, beta2, "Kv")
    fastest = min(b1 + ([beta2] if cfg.base != "sgdm" else []))
    kx = _period(cfg.Kx, fastest, "Kx")
    kv = kv if cfg.base != "sgdm" else 0
    positive = [k for k in (kx, kv, *periods_u) if k > 0]
    if positive and cfg.sync_delay >= min(positive):
        raise ConfigError(
            f"[{SECTION}] sync_delay = {cfg.sync_delay!r}: allowed is an integer >= 0 below the smallest "
            f"period > 0 ({min(positive)}): a fragment must have merged before it is due again"
        )
    return Settings(
        base=cfg.base,
        betas1=tuple(float(b) for b in b1),
        omegas=tuple(float(w) for w in om),
        periods_u=periods_u,
        beta2=float(beta2),
        Kv=kv,
        Kx=kx,
        lr=hp.lr if cfg.lr < 0 else cfg.lr,
        eps=hp.eps if cfg.eps < 0 else cfg.eps,
        weight_decay=hp.weight_decay if cfg.weight_decay < 0 else cfg.weight_decay,
        fragments=int(cfg.fragments),
        sync_delay=int(cfg.sync_delay),
        switch_at=hp.warmup_steps if cfg.switch_at == "warmup" else int(cfg.switch_at),
        base_beta1=float(hp.beta1),
    )


def check(cfg: Config, hparams: Optional[BaseHParams] = None) -> list[str]:
    """The family's cross-field rules (list lengths, Σω, periods), no collectives."""
    try:
        settings(cfg, hparams)
    except ConfigError as error:
        return [str(error)]
    return []


def _offsets(period: int, fragments: int) -> list[int]:
    """Step offset of each fragment within a period: spread evenly, fragment 0 at 0 (so one
    fragment is today's schedule: due when ``step % period == 0``)."""
    return [f * period // fragments for f in range(fragments)]


def _partition(sizes: Sequence[int], fragments: int) -> list[int]:
    """Fragment of each parameter: greedy by size (largest first onto the lightest fragment, ties to
    the lower index), so fragments are balanced in elements. Deterministic from the sizes alone,
    hence the same on every replica."""
    load = [0] * fragments
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (load[f], f))
        out[i] = f
        load[f] += sizes[i]
    return out


def _replication(p: torch.Tensor, topology: Topology) -> int:
    """How many ranks of this replica's S×T group hold the same local values of ``p`` (after
    :func:`replica_grad`, its gradient is laid out like it): the product of the mesh dims the
    DTensor is ``Replicate`` on — e.g. a norm weight under TP — or all of S×T for a plain tensor."""
    if not isinstance(p, DTensor):
        return topology.shard_size * topology.tp_size
    return math.prod(
        p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)
    )


@dataclass
class _InFlight:
    """One step's fused sync in flight (``sync_delay`` > 0): merged after update ``merge_at``."""

    merge_at: int
    tensors: list[torch.Tensor]  # the live local states (x, u_j, v)
    snapshots: list[torch.Tensor]  # their values at issue; mean_R of those once ``pending`` is waited for
    kinds: list[str]  # "x", "u" or "v" per tensor
    states: list[Optional[dict]]  # the parameter's state for "x" (the outer step's anchor and buffer)
    pending: "comm.Pending[None]"


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


class LocalAdaptive(CommOptimizer):
    """One engine for DES-LOC (N = 1, ω = 1), MT-DAO (N momenta, quasi-hyperbolic), Local Adam
    (Ku = Kv = Kx) and DiLoCo (Ku = Kv = 0, Nesterov outer). See the module docstring for the math.

    ``betas1``/``omegas``/``beta2``/``eps``/``weight_decay``/``lr`` are per param group;
    the periods, base algorithm, clipping and outer optimizer are global (syncs are fused over all
    parameters, and the norm clip is over the whole replica gradient).
    """

    def __init__(
        self,
        params: Any,
        topology: Optional[Topology] = None,
        *,
        base: str = "adam",
        lr: float = 1e-3,
        betas1: Sequence[float] = (0.9,),
        omegas: Sequence[float] = (1.0,),
        periods_u: Sequence[int] = (32,),
        beta2: float = 0.999,
        Kv: int = 32,
        Kx: int = 32,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adopt_clip: bool = True,
        clip: str = "none",
        clip_threshold: float = 1.0,
        outer: str = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        transfer_dtype: Optional[torch.dtype] = torch.float32,
        fragments: int = 1,
        sync_delay: int = 0,
        switch_at: int = 0,
        base_beta1: float = 0.9,
        ledger: Optional["comm.CommLedger"] = None,
    ) -> None:
        if not (len(betas1) == len(omegas) == len(periods_u) >= 1):
            raise ValueError("betas1, omegas and periods_u need one entry per first momentum")
        if base not in ("adam", "adopt", "sgdm") or clip not in ("none", "coordinate", "norm"):
            raise ValueError(f"bad base {base!r} or clip {clip!r}")
        if outer not in ("average", "nesterov"):
            raise ValueError(f"bad outer {outer!r}")
        defaults = dict(
            lr=lr, betas1=tuple(betas1), omegas=tuple(omegas), beta2=beta2, eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, topology or Topology.single(), None, defaults, ledger=ledger)
        self.base = base
        self.periods_u = tuple(int(k) for k in periods_u)
        self.Kv = int(Kv) if base != "sgdm" else 0
        self.Kx = int(Kx)
        self.bias_correction = bias_correction
        self.adopt_clip = adopt_clip
        self.clip = clip
        self.clip_threshold = clip_threshold
        self.outer = outer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.transfer_dtype = transfer_dtype
        positive = [k for k in (self.Kx, self.Kv, *self.periods_u) if k > 0]
        if fragments < 1 or sync_delay < 0 or (positive and sync_delay >= min(positive)):
            raise ValueError(f"fragments = {fragments} (>= 1), sync_delay = {sync_delay} (>= 0, below every period > 0)")
        self.sync_delay = int(sync_delay)
        if switch_at < 0 or not 0.0 <= base_beta1 < 1.0:
            raise ValueError(f"switch_at = {switch_at} (>= 0), base_beta1 = {base_beta1} (in [0, 1))")
        # Global, not per group: read with the checkpointed step counter, a resume switches at the same
        # update; param_groups saved before the switch existed still load.
        self.switch_at = int(switch_at)
        self.base_beta1 = float(base_beta1)
        # The step counter: one Python int (no host read per parameter); every parameter's
        # state["step"] is the same CPU scalar tensor holding it, so checkpoints carry it.
        self._n = 0
        self._step_t = torch.tensor(0.0)
        self._in_flight: list[_InFlight] = []
        # Eager state: DCP's _init_optim_state would otherwise run a dummy zero-grad step (lr 0) on
        # an empty state, advancing the step counter (the sync schedule) and seeding ADOPT's v with 0.
        self._params: list[tuple[dict, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, len(group["betas1"]))
                    self._params.append((group, p))
        self.fragments = max(1, min(int(fragments), len(self._params)))
        self._fragment = _partition([p.numel() for _, p in self._params], self.fragments)
        # (state kind, period): "u<j>" for first momentum j, "v", "x"; in the fused buffer's order
        self._kinds = [(f"u{j}", k) for j, k in enumerate(self.periods_u)] + [("v", self.Kv), ("x", self.Kx)]

    # ---- hooks the torchtitan adapter reads (titan/optimizers.py, state.py) ------------------------
    @property
    def params_replica_local(self) -> bool:
        """Parameters differ across replicas between Kx syncs: checkpoints keep them per replica."""
        return self.Kx != 1

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters now: before the first step (the adapter
        broadcasts replica 0's parameters), or right after a step at which every fragment's x was
        averaged with no delay. With several fragments at different offsets, or a ``sync_delay``
        (local progress is kept at a merge), that never happens after the first step. Read from the
        checkpointed step counter, so it stays right after a resume."""
        n = self._n
        if n == 0:
            return True
        if self.sync_delay > 0 or self.Kx <= 0:
            return False
        return all((n - off) % self.Kx == 0 for off in _offsets(self.Kx, self.fragments))

    def steps_to_next_sync(self) -> Optional[int]:
        """Steps until the next R sync of any state (x, u_j or v); ``None`` when one period is 1
        (a sync every step) or all are 0 (never)."""
        periods = [k for k in (self.Kx, self.Kv, *self.periods_u) if k > 0]
        if not periods or min(periods) == 1 or self.topology.replicate_size == 1:
            return None
        n = self._n  # a fragment f of a state with period k syncs when (n − offset_f) % k == 0
        return min((off - n - 1) % k + 1 for k in periods for off in _offsets(k, self.fragments))

    # ---- state -----------------------------------------------------------------------------------
    @staticmethod
    def _moment_key(j: int) -> str:
        # j = 0 keeps torch Adam's name so an AdamW checkpoint's first moment maps onto it
        return "exp_avg" if j == 0 else f"exp_avg_{j}"

    def _init_state(self, p: torch.Tensor, n_moments: int) -> dict:
        state = self.state[p]
        if not state:
            zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
            state["step"] = self._step_t
            for j in range(n_moments):
                state[self._moment_key(j)] = zeros()
            if self.base != "sgdm":
                state["exp_avg_sq"] = zeros()
            if self.outer == "nesterov" and self.Kx > 0:
                # x at the last sync: the outer step's pseudo-gradient is anchor − mean_R(x)
                state["outer_anchor"] = p.detach().clone()
                state["outer_buf"] = zeros()
        return state

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Merges every fragment still in flight first (waiting for its collective): a checkpoint
        holds no half-done sync, and the run that saved continues from the same merged state as a
        run resumed from it. (Those fragments merge up to ``sync_delay`` − 1 steps early, at the
        checkpoint's step: the one thing a checkpoint changes in the trajectory.)"""
        self.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for entry in self._in_flight:  # the state is replaced: drain the collectives, drop the merges
            entry.pending.wait()
        self._in_flight = []
        super().load_state_dict(state_dict)
        # Read the step counter once (a checkpoint of per-parameter counters takes their largest),
        # then share one tensor again.
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self._n = int(max(float(t) for t in steps)) if steps else 0
        self._step_t = torch.tensor(float(self._n))
        for s in self.state.values():
            if "step" in s:
                s["step"] = self._step_t

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
        return (self.clip_threshold / (sq.sqrt() + 1e-12)).clamp(max=1.0)

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

        scale = None
        if self.clip == "norm":
            scale = self._clip_scale([g for _, _, g in work], [p for _, p, _ in work])

        by_group: dict[int, tuple[dict, list[list[torch.Tensor]]]] = {}
        for group, p, g in work:
            state = self.state[p]
            x = local(p)
            row = [x, g if g.dtype == x.dtype else g.to(x.dtype)]
            row += [local(state[self._moment_key(j)]) for j in range(len(group["betas1"]))]
            if self.base != "sgdm":
                row.append(local(state["exp_avg_sq"]))
            by_group.setdefault(id(group), (group, []))[1].append(row)
        for group, rows in by_group.values():
            limit = _CHUNK.get(rows[0][0].device.type, _DEFAULT_CHUNK)
            for chunk in _chunks(rows, limit):
                cols = [list(col) for col in zip(*chunk)]
                cols[1] = self._clipped(cols[1], scale)
                self._update(group, cols, n)
        self._sync(n)
        return loss

    def _clipped(self, gs: list[torch.Tensor], scale: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """The clipped gradients (new tensors; ``p.grad`` is never written), per chunk so that only a
        chunk's worth of temporaries exists at a time."""
        if self.clip == "coordinate":
            return [g.clamp(-self.clip_threshold, self.clip_threshold) for g in gs]
        if self.clip == "norm":
            return torch._foreach_mul(gs, scale)  # × 1.0 when not clipping: exact
        return gs

    def _update(self, group: dict, cols: list[list[torch.Tensor]], n: int) -> None:
        """One local step: ``cols`` = [xs, gs, u_0s, …, u_{N−1}s(, vs)] of some parameters of ``group``."""
        nm = len(group["betas1"])
        xs, gs, moments, vs = cols[0], cols[1], cols[2 : 2 + nm], cols[2 + nm] if self.base != "sgdm" else None
        betas1, omegas, corrections = group["betas1"], group["omegas"], None
        k = self.switch_at
        if n <= k:  # before MT-DAO's switch: the plain base optimizer on u_0 (the other u_j stay 0)
            betas1, omegas, moments = (self.base_beta1,), (1.0,), moments[:1]
        elif k > 0 and self.base == "adam" and self.bias_correction:
            # The weight each EMA has gathered: u_0 was built with the base β for k updates, then β1_0
            # (1 − β^k·β1_0^(n−k)); u_j (j ≥ 1) started at zero at the switch (1 − β1_j^(n−k)).
            carried = [self.base_beta1**k] + [1.0] * (nm - 1)
            corrections = [1 - c * b ** (n - k) for c, b in zip(carried, betas1)]
        hp = dict(lr=group["lr"], betas1=betas1, omegas=omegas, weight_decay=group["weight_decay"])
        if self.base == "sgdm":
            kernels.sgdm_multi_(xs, gs, moments, **hp)
        elif self.base == "adopt":
            kernels.adopt_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                 clip=self.adopt_clip)
        else:
            kernels.qh_adamw_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                    bias_correction=self.bias_correction, corrections1=corrections, fused=True)

    # ---- the R syncs -----------------------------------------------------------------------------
    def _due(self, n: int) -> dict[str, set[int]]:
        """The fragments of each state kind due after update ``n``."""
        due: dict[str, set[int]] = {}
        for kind, period in self._kinds:
            if period > 0:
                frags = {f for f, off in enumerate(_offsets(period, self.fragments)) if (n - off) % period == 0}
                if frags:
                    due[kind] = frags
        return due

    def _sync(self, n: int) -> None:
        """Issue the fused all-reduce of every (state, fragment) due after update ``n``; merge it now
        (``sync_delay`` = 0) or after update ``n + sync_delay``; merge what is due now."""
        due = self._due(n) if self.topology.replicate_size > 1 or self.outer == "nesterov" else {}
        if due:
            tensors, kinds, states = [], [], []
            for (group, p), f in zip(self._params, self._fragment):
                state = self.state[p]
                for j in range(len(group["betas1"])):
                    if f in due.get(f"u{j}", ()):
                        tensors.append(local(state[self._moment_key(j)]))
                        kinds.append("u")
                        states.append(None)
                if f in due.get("v", ()):
                    tensors.append(local(state["exp_avg_sq"]))
                    kinds.append("v")
                    states.append(None)
                if f in due.get("x", ()):
                    tensors.append(local(p))
                    kinds.append("x")
                    states.append(state)
            self._issue(n, tensors, kinds, states)
        while self._in_flight and self._in_flight[0].merge_at <= n:
            self._merge(self._in_flight.pop(0))

    def _issue(self, n: int, tensors: list, kinds: list[str], states: list) -> None:
        replicate = self.topology.replicate if self.topology.replicate_size > 1 else None
        kw = dict(op="mean", dtype=self.transfer_dtype, ledger=self.ledger)
        if self.sync_delay == 0:  # blocking, in place: x = mean_R(x), then the outer step
            comm.all_reduce_fused(tensors, R, replicate, **kw)
            if self.outer == "nesterov":
                for t, kind, state in zip(tensors, kinds, states):
                    if kind == "x":
                        self._nesterov(t, state)
            return
        snapshots = [t.clone() for t in tensors]  # the price of the overlap: one copy of what is sent
        pending = comm.all_reduce_fused(snapshots, R, replicate, async_op=True, **kw)
        self._in_flight.append(_InFlight(n + self.sync_delay, tensors, snapshots, kinds, states, pending))

    def _merge(self, entry: _InFlight) -> None:
        """t ← mean_R(t at issue) + (t − t at issue) for every tensor of ``entry`` (Streaming DiLoCo's
        rule, keeping the local progress made while the sync was in flight); for x with the Nesterov
        outer step, the step is applied to the snapshot's mean first."""
        torch._foreach_sub_(entry.tensors, entry.snapshots)  # the local progress since the issue
        entry.pending.wait()  # snapshots := mean_R(snapshots)
        if self.outer == "nesterov":
            for snap, kind, state in zip(entry.snapshots, entry.kinds, entry.states):
                if kind == "x":
                    self._nesterov(snap, state)
        torch._foreach_add_(entry.tensors, entry.snapshots)
        for t, kind in zip(entry.tensors, entry.kinds):
            if kind == "v":
                t.clamp_min_(0)  # v − v_issue + mean_R(v_issue) can dip below 0 when β2^τ is small

    @torch.no_grad()
    def flush(self) -> None:
        """Wait for every sync in flight and merge it now (before a checkpoint; at the end of a run)."""
        while self._in_flight:
            self._merge(self._in_flight.pop(0))

    def _nesterov(self, x: torch.Tensor, state: dict) -> None:
        """DiLoCo outer step; ``x`` already holds mean_R(x)."""
        anchor, buf = local(state["outer_anchor"]), local(state["outer_buf"])
        mu = self.outer_momentum
        delta = anchor - x  # pseudo-gradient Δ = x_anchor − mean_R(x)
        buf.mul_(mu).add_(delta)  # b ← μ b + Δ
        x.copy_(anchor).sub_(delta.add_(buf, alpha=mu), alpha=self.outer_lr)  # x ← anchor − η(Δ + μ b)
        anchor.copy_(x)


# ---- the family ------------------------------------------------------------------------------------
def build(named_params: NamedParams, topology: Topology, resolved: Resolved, *, ledger=None) -> LocalAdaptive:
    cfg = resolved.options
    st = settings(cfg, resolved.hparams)
    return LocalAdaptive(
        [{"params": [(n, p) for n, p in named_params if p.requires_grad]}],
        topology,
        base=st.base,
        lr=st.lr,
        betas1=st.betas1,
        omegas=st.omegas,
        periods_u=st.periods_u,
        beta2=st.beta2,
        Kv=st.Kv,
        Kx=st.Kx,
        eps=st.eps,
        weight_decay=st.weight_decay,
        bias_correction=cfg.bias_correction,
        adopt_clip=cfg.adopt_clip,
        clip=cfg.clip,
        clip_threshold=cfg.clip_threshold,
        outer=cfg.outer,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        transfer_dtype=None if cfg.transfer_dtype == "native" else comm.DTYPES[cfg.transfer_dtype],
        fragments=st.fragments,
        sync_delay=st.sync_delay,
        switch_at=st.switch_at,
        base_beta1=st.base_beta1,
        ledger=ledger,
    )


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the base (which moments, what they mean), the number of
    first momenta, the Nesterov outer state (Kx > 0) and per-replica parameters (Kx != 1)."""
    st = settings(resolved.options, resolved.hparams)
    return {
        "base": st.base,
        "Ku (number of first momenta)": len(st.periods_u),
        "outer": resolved.options.outer if st.Kx > 0 else "none (Kx = 0)",
        "Kx": 1 if st.Kx == 1 else "not 1 (parameters kept per replica)",
    }


FAMILY = Family(
    key="local",
    options=Config,
    presets=PRESETS,
    build=build,
    r_bytes=local_r_bytes,
    check=check,
    state_shape=state_shape,
    preset_sources=PRESET_SOURCES,
    summary="parameters every Kx, first moments every K_j, second moment every Kv steps (DES-LOC, MT-DAO, "
    "Local Adam, DiLoCo)",
)
