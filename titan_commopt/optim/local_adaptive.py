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

after update number ``n`` (1-based, ``state["step"]``) a state with period ``K`` is averaged when
``n % K == 0``; every state due at ``n`` (all parameters, all kinds) goes in ONE fused all-reduce
over R. Period 0 = never sync (Ku = Kv = 0 is FedAvg/DiLoCo with persistent local states).

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
``[optimizer]`` value (``hparams``). ``lr`` is only the initial value of ``param_groups[i]["lr"]``:
the LR scheduler owns it afterwards and every step reads it from there.

Sharding: all state lives on the local FSDP2/TP shard (``local(p)``); state tensors shaped like a
parameter are DTensors with its placement (DCP), the per-parameter step counter is a plain scalar
tensor in ``state`` (checkpointable). They are *per replica* state: between syncs u, v, x differ
across replicas, so checkpoints must keep each replica's copy. The global-norm clip sums squared
local norms over S and T (1 float each); nothing else leaves the replica except the R syncs.
Gradient scale: ``topology.replica_grad`` (topology.py). The adapter reads two hooks:
``params_replica_local`` (parameters differ across replicas between syncs: Kx ≠ 1) and
``replicas_in_sync()`` (true right after a Kx sync: when its drift check may run).

Outer optimizer ``nesterov`` (DiLoCo): with ``a`` = x at the previous sync (``outer_anchor``) and
``b`` = ``outer_buf``: Δ = a − mean_R(x); b ← μ·b + Δ; x ← a − η_out·(Δ + μ·b); a ← x. With one
replica it still runs (DiLoCo with one worker is not plain Adam).

Presets (``PRESETS``): ``DES-LOC`` (Adam, Kx=32, Ku=96=3Kx, Kv=192=6Kx, coordinate clip),
``MT-DAO`` (ADOPT, β1=0.999, ω=0.95, β2=0.9999, K=32 for all), ``LocalAdam``
(Kx=Ku=Kv=32), ``DiLoCo`` (Kx=32, Ku=Kv=0, Nesterov outer lr 0.7, μ 0.9).

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
from .common import BaseHParams, NamedParams, local, replica_grad
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
    lr: float = option(-1.0, "Initial learning rate; negative = [optimizer] lr.")
    eps: float = option(-1.0, "ε of the denominator; negative = [optimizer] eps.")
    weight_decay: float = option(-1.0, "Decoupled weight decay λ; negative = [optimizer] weight_decay.")
    bias_correction: bool = option(True, "Adam's bias correction of u_j and v (base = adam only).")
    adopt_clip: bool = option(True, "ADOPT's clip of the normalized gradient to ±(step−1)^¼.")
    transfer_dtype: str = option(
        "fp32", "dtype of synced states on the wire (native = the state's own dtype).",
        choices=("fp32", "bf16", "native"),
    )


PRESETS: dict[str, dict[str, Any]] = {
    # DES-LOC: Adam, parameters synced most often, states at multiples of Kx (Ku = 3Kx, Kv = 6Kx).
    "DES-LOC": {"base": "adam", "Kx": 32, "Ku": [96], "Kv": 192, "clip": "coordinate"},
    # MT-DAO as the paper runs it: N = 1 quasi-hyperbolic slow momentum on ADOPT, K = 32 for all.
    # Its norm clip at rho = 1 (paper, Table 2) is the training loop's: [training] max_norm = 1.
    "MT-DAO": {
        "base": "adopt", "beta1": [0.999], "omega": [0.95], "beta2": 0.9999,
        "Kx": 32, "Ku": [32], "Kv": 32,
    },
    # Local Adam: everything synced together.
    "LocalAdam": {"base": "adam", "Kx": 32, "Ku": [32], "Kv": 32},
    # DiLoCo-style: states never synced (persistent local state), Nesterov outer step every Kx.
    "DiLoCo": {"base": "adam", "Kx": 32, "Ku": [0], "Kv": 0, "outer": "nesterov"},
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
    ``[optimizer]``). Raises ``ConfigError`` on a cross-field problem."""
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
    return Settings(
        base=cfg.base,
        betas1=tuple(float(b) for b in b1),
        omegas=tuple(float(w) for w in om),
        periods_u=periods_u,
        beta2=float(beta2),
        Kv=kv if cfg.base != "sgdm" else 0,
        Kx=kx,
        lr=hp.lr if cfg.lr < 0 else cfg.lr,
        eps=hp.eps if cfg.eps < 0 else cfg.eps,
        weight_decay=hp.weight_decay if cfg.weight_decay < 0 else cfg.weight_decay,
    )


def check(cfg: Config, hparams: Optional[BaseHParams] = None) -> list[str]:
    """The family's cross-field rules (list lengths, Σω, periods), no collectives."""
    try:
        settings(cfg, hparams)
    except ConfigError as error:
        return [str(error)]
    return []


def _due(step: int, period: int) -> bool:
    return period > 0 and step % period == 0


def _replication(p: torch.Tensor, topology: Topology) -> int:
    """How many ranks of this replica's S×T group hold the same local values of ``p`` (after
    :func:`replica_grad`, its gradient is laid out like it): the product of the mesh dims the
    DTensor is ``Replicate`` on — e.g. a norm weight under TP — or all of S×T for a plain tensor."""
    if not isinstance(p, DTensor):
        return topology.shard_size * topology.tp_size
    return math.prod(
        p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)
    )


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
        super().__init__(params, defaults)
        self.topology = topology or Topology.single()
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
        self.ledger = ledger
        # Eager state: DCP's _init_optim_state would otherwise run a dummy zero-grad step (lr 0) on
        # an empty state, advancing the step counter (the sync schedule) and seeding ADOPT's v with 0.
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, len(group["betas1"]))

    # ---- hooks the torchtitan adapter reads (titan/optimizers.py, state.py) ------------------------
    @property
    def params_replica_local(self) -> bool:
        """Parameters differ across replicas between Kx syncs: checkpoints keep them per replica."""
        return self.Kx != 1

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters now (right after a Kx sync, or before
        the first step: the adapter broadcasts replica 0's parameters). Read from the checkpointed
        step counters, so it stays right after a resume."""
        steps = {int(s["step"]) for s in self.state.values() if "step" in s}
        return not steps or (self.Kx > 0 and all(n % self.Kx == 0 for n in steps))

    def steps_to_next_sync(self) -> Optional[int]:
        """Steps until the next R sync of any state (x, u_j or v); ``None`` when one period is 1
        (a sync every step) or all are 0 (never)."""
        periods = [k for k in (self.Kx, self.Kv, *self.periods_u) if k > 0]
        if not periods or min(periods) == 1 or self.topology.replicate_size == 1:
            return None
        n = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)
        return min(k - n % k for k in periods)

    # ---- state -----------------------------------------------------------------------------------
    @staticmethod
    def _moment_key(j: int) -> str:
        # j = 0 keeps torch Adam's name so an AdamW checkpoint's first moment maps onto it
        return "exp_avg" if j == 0 else f"exp_avg_{j}"

    def _init_state(self, p: torch.Tensor, n_moments: int) -> dict:
        state = self.state[p]
        if not state:
            zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
            state["step"] = torch.tensor(0.0)
            for j in range(n_moments):
                state[self._moment_key(j)] = zeros()
            if self.base != "sgdm":
                state["exp_avg_sq"] = zeros()
            if self.outer == "nesterov" and self.Kx > 0:
                # x at the last sync: the outer step's pseudo-gradient is anchor − mean_R(x)
                state["outer_anchor"] = p.detach().clone()
                state["outer_buf"] = zeros()
        return state

    # ---- step ------------------------------------------------------------------------------------
    def _clip_scale(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> float:
        """min(1, ρ/‖g‖) with ‖g‖ the replica's whole-model gradient norm (shards summed over S, T)."""
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)  # on the grads' device (NCCL)
        for g, p in zip(grads, params):
            sq += g.double().pow(2).sum() / _replication(p, self.topology)
        comm.all_reduce(sq, S, self.topology.shard, op="sum", ledger=self.ledger)
        comm.all_reduce(sq, T, self.topology.tp, op="sum", ledger=self.ledger)
        norm = float(sq.sqrt())
        return min(1.0, self.clip_threshold / (norm + 1e-12))

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

        if self.clip == "coordinate":
            work = [(grp, p, g.clamp(-self.clip_threshold, self.clip_threshold)) for grp, p, g in work]
        elif self.clip == "norm":
            scale = self._clip_scale([g for _, _, g in work], [p for _, p, _ in work])
            if scale < 1.0:
                work = [(grp, p, g * scale) for grp, p, g in work]

        due_states: list[torch.Tensor] = []  # averaged over R: the one fused collective
        due_params: list[tuple[torch.Tensor, dict]] = []  # (local x, state) needing the outer step
        for group, p, g in work:
            state = self._init_state(p, len(group["betas1"]))
            state["step"] += 1
            n = int(state["step"].item())
            self._update(group, p, g, state, n)
            for j, period in enumerate(self.periods_u):
                if _due(n, period):
                    due_states.append(local(state[self._moment_key(j)]))
            if _due(n, self.Kv):
                due_states.append(local(state["exp_avg_sq"]))
            if _due(n, self.Kx):
                x = local(p)
                due_states.append(x)
                due_params.append((x, state))

        if due_states and self.topology.replicate_size > 1:
            comm.all_reduce_fused(
                due_states, R, self.topology.replicate, op="mean", dtype=self.transfer_dtype,
                ledger=self.ledger,
            )
        if self.outer == "nesterov":
            for x, state in due_params:
                self._nesterov(x, state)
        return loss

    def _update(self, group: dict, p: torch.Tensor, g: torch.Tensor, state: dict, n: int) -> None:
        x = local(p)
        g = g.to(x.dtype)
        moments = [local(state[self._moment_key(j)]) for j in range(len(group["betas1"]))]
        hp = dict(lr=group["lr"], betas1=group["betas1"], omegas=group["omegas"],
                  weight_decay=group["weight_decay"])
        if self.base == "sgdm":
            kernels.sgdm_(x, g, moments, **hp)
            return
        v = local(state["exp_avg_sq"])
        if self.base == "adopt":
            kernels.adopt_(x, g, moments, v, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                           clip=self.adopt_clip)
        else:
            kernels.qh_adamw_(x, g, moments, v, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                              bias_correction=self.bias_correction)

    def _nesterov(self, x: torch.Tensor, state: dict) -> None:
        """DiLoCo outer step; ``x`` already holds mean_R(x)."""
        anchor, buf = local(state["outer_anchor"]), local(state["outer_buf"])
        mu = self.outer_momentum
        delta = anchor - x  # pseudo-gradient Δ = x_anchor − mean_R(x)
        buf.mul_(mu).add_(delta)  # b ← μ b + Δ
        x.copy_(anchor).sub_(delta.add_(buf, alpha=mu), alpha=self.outer_lr)  # x ← anchor − η(Δ + μ b)
        anchor.copy_(x)


# ---- the family ------------------------------------------------------------------------------------
def build(named_params: NamedParams, topology: Topology, resolved: Resolved) -> LocalAdaptive:
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
    summary="parameters every Kx, first moments every K_j, second moment every Kv steps (DES-LOC, MT-DAO, "
    "Local Adam, DiLoCo)",
)
