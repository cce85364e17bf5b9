"""The update functions: the per-element math of every optimizer family, written once.

In the spirit of torch's ``optim/adamw.py`` (its single-tensor path) and microsoft/dion's
``scalar_opts.py``: plain functions on *local* tensors (the shard behind a DTensor, see
``common.local``), no collectives, no state dicts. A family fetches its shards, calls an update and
does its own communication around it. A trailing ``_`` means the function writes into its tensor
arguments (the parameter ``x`` and the optimizer states).

Notation of the comments: x parameter, g gradient, m or u_j first moment(s), v second moment,
η learning rate, λ decoupled weight decay, t the 1-based step, m̂ = m/(1−β1^t), v̂ = v/(1−β2^t).

Rounding: :func:`adamw_` performs torch AdamW's single-tensor operations in torch's order (moments
by ``lerp_``/``addcmul_``, ``denom = √v / (1−β2^t) ** 0.5 + ε`` — Python's ``** 0.5``, as torch, not
``math.sqrt``, which rounds differently on about 0.1 % of steps — and ``x += (−η/(1−β1^t))·m/denom``),
so Dion's scalar AdamW matches ``torch.optim.Adam``/``AdamW`` to the last bit. LocalAdaptive's plain
Adam (one momentum, ω = 1) uses :func:`adamw_multi_` with ``fused``: torch's fused kernel, bit for
bit ``AdamW(fused=True)``, torchtitan's default. Updates are not interchangeable bit for bit: a
quasi-hyperbolic step with one momentum and ω = 1 *is* :func:`adamw_` for that reason.
"""

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "decoupled_decay_", "descend_", "ema_", "ema_sq_", "heavy_ball_", "quasi_hyperbolic",
    "adam_denominator", "adamw_", "qh_adamw_", "adam_direction_", "lion_", "sgdm_", "adopt_",
    "adamw_multi_", "qh_adamw_multi_", "sgdm_multi_", "adopt_multi_", "is_plain_adam", "muon_momentum_multi_",
    "muon_descend_multi_", "nesterov_step_", "nesterov_outer_",
]


# ---- building blocks -----------------------------------------------------------------------------
def _correction(beta: float, step: float, enabled: bool = True) -> float:
    """1 − β^t: the weight an EMA started at zero has gathered after t steps (1 when disabled)."""
    return 1 - beta**step if enabled else 1.0


def decoupled_decay_(x: Tensor, lr: float, weight_decay: float) -> Tensor:
    """x ← x·(1 − η·λ): weight decay decoupled from the gradient (Loshchilov & Hutter, AdamW)."""
    if weight_decay != 0:  # skipped like torch does; multiplying by 1.0 would not change a bit anyway
        x.mul_(1 - lr * weight_decay)
    return x


def descend_(x: Tensor, update: Tensor, lr: float, weight_decay: float = 0.0) -> Tensor:
    """x ← x·(1 − η·λ) − η·update: the last line of every optimizer here except Adam's."""
    decoupled_decay_(x, lr, weight_decay)
    return x.add_(update, alpha=-lr)


def ema_(avg: Tensor, value: Tensor, beta: float) -> Tensor:
    """avg ← β·avg + (1−β)·value, as torch's Adam computes its first moment (``lerp_``)."""
    return avg.lerp_(value, 1 - beta)


def ema_sq_(v: Tensor, g: Tensor, beta2: float) -> Tensor:
    """v ← β2·v + (1−β2)·g², as torch's Adam computes its second moment."""
    return v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def heavy_ball_(m: Tensor, g: Tensor, beta: float) -> Tensor:
    """m ← β·m + g: torch SGD's undampened momentum buffer, DeMo's eq. 2 (from zero: the first step
    gives m = g exactly, as torch's ``clone`` of the first gradient)."""
    return m.mul_(beta).add_(g)


def quasi_hyperbolic(
    g: Tensor, moments: Sequence[Tensor], omegas: Sequence[float], corrections: Optional[Sequence[float]] = None
) -> Tensor:
    """(1 − Σω_j)·g + Σ_j ω_j·u_j/c_j, a new tensor: QHM's mix of the gradient with N momenta
    (c_j = 1 unless ``corrections`` gives Adam's 1 − β1_j^t, making u_j/c_j = û_j)."""
    out = g * (1 - sum(omegas))
    for j, (u, w) in enumerate(zip(moments, omegas)):
        out.add_(u, alpha=w if corrections is None else w / corrections[j])
    return out


def adam_denominator(v: Tensor, beta2: float, step: float, eps: float, bias_correction: bool = True) -> Tensor:
    """√v̂ + ε, a new tensor, rounded as torch's AdamW: √v / (1−β2^t) ** 0.5, then + ε."""
    return (v.sqrt() / _correction(beta2, step, bias_correction) ** 0.5).add_(eps)


# ---- Adam family ---------------------------------------------------------------------------------
def adamw_(
    x: Tensor, g: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, step: float, bias_correction: bool = True,
) -> None:
    """One AdamW step (Adam at λ = 0; Kingma & Ba 2015, Loshchilov & Hutter 2019):
    x ← x·(1−ηλ) − η·m̂/(√v̂+ε). torch's operations in torch's order (see the module docstring)."""
    decoupled_decay_(x, lr, weight_decay)
    ema_(m, g, beta1)  # m ← β1·m + (1−β1)·g
    ema_sq_(v, g, beta2)  # v ← β2·v + (1−β2)·g²
    denom = adam_denominator(v, beta2, step, eps, bias_correction)  # √v̂ + ε
    x.addcdiv_(m, denom, value=-lr / _correction(beta1, step, bias_correction))  # − η/(1−β1^t) · m/denom


def qh_adamw_(
    x: Tensor, g: Tensor, moments: Sequence[Tensor], v: Tensor, *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], beta2: float, eps: float, weight_decay: float, step: float,
    bias_correction: bool = True,
) -> None:
    """Quasi-hyperbolic Adam with N first momenta (MT-DAO, Algorithm 1):
    u_j ← β1_j·u_j + (1−β1_j)·g;  x ← x·(1−ηλ) − η·[(1−Σω)·g + Σ ω_j·û_j] / (√v̂ + ε).
    One momentum with ω = 1 is plain AdamW and goes through :func:`adamw_` (torch's rounding)."""
    if len(moments) == 1 and omegas[0] == 1.0:
        adamw_(x, g, moments[0], v, lr=lr, beta1=betas1[0], beta2=beta2, eps=eps, weight_decay=weight_decay,
               step=step, bias_correction=bias_correction)
        return
    decoupled_decay_(x, lr, weight_decay)
    for u, b in zip(moments, betas1):
        ema_(u, g, b)
    ema_sq_(v, g, beta2)
    denom = adam_denominator(v, beta2, step, eps, bias_correction)
    corrections = [_correction(b, step, bias_correction) for b in betas1]
    x.addcdiv_(quasi_hyperbolic(g, moments, omegas, corrections), denom, value=-lr)


def adam_direction_(
    g: Tensor, m: Tensor, v: Tensor, *, beta1: float, beta2: float, eps: float, step: float
) -> Tensor:
    """Update Adam's moments and return the bias-corrected direction m̂/(√v̂+ε) (a new tensor)
    without applying it: DeMo's decoupled-AdamW base hands it to the replicator instead."""
    ema_(m, g, beta1)
    ema_sq_(v, g, beta2)
    return torch.div(m, adam_denominator(v, beta2, step, eps)).div_(_correction(beta1, step))


# ---- sign, momentum and ADOPT --------------------------------------------------------------------
def lion_(
    x: Tensor, g: Tensor, m: Tensor, *, lr: float, beta1: float, beta2: float, weight_decay: float
) -> None:
    """Lion (Chen et al. 2023): x ← x·(1−ηλ) − η·sign(β1·m + (1−β1)·g), then m ← β2·m + (1−β2)·g.
    The step interpolates with β1, the momentum tracks with β2."""
    descend_(x, torch.sign(m.lerp(g, 1 - beta1)), lr, weight_decay)
    ema_(m, g, beta2)


def sgdm_(
    x: Tensor, g: Tensor, moments: Sequence[Tensor], *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], weight_decay: float,
) -> None:
    """SGD with EMA momenta, quasi-hyperbolic (QHM; MT-DAO, Algorithm 3):
    u_j ← β1_j·u_j + (1−β1_j)·g;  x ← x·(1−ηλ) − η·[(1−Σω)·g + Σ ω_j·u_j].
    With one momentum and ω = 1 it is torch's SGD(momentum=β) at lr η·(1−β) (torch keeps u/(1−β))."""
    for u, b in zip(moments, betas1):
        ema_(u, g, b)
    descend_(x, quasi_hyperbolic(g, moments, omegas), lr, weight_decay)


def adopt_(
    x: Tensor, g: Tensor, moments: Sequence[Tensor], v: Tensor, *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], beta2: float, eps: float, weight_decay: float, step: int, clip: bool = True,
) -> None:
    """ADOPT (Taniguchi et al. 2024) with N quasi-hyperbolic momenta (MT-DAO, Algorithm 2).

    The gradient is normalized by the *previous* second moment, ĝ = g / max(√v, ε) (clipped to
    ±(t−1)^¼ when ``clip``), before it enters the momenta; then x ← x·(1−ηλ) − η·[(1−Σω)·ĝ + Σ ω_j·u_j]
    and v is updated last. Step 1 only initializes v = g² (v must still be zero), no update.
    """
    if step == 1:
        v.addcmul_(g, g)  # v = 0 + g²
        return
    gn = g / v.sqrt().clamp_(min=eps)  # ĝ = g / max(√v_{t−1}, ε)
    if clip:
        c = (step - 1) ** 0.25
        gn.clamp_(-c, c)
    for u, b in zip(moments, betas1):
        ema_(u, gn, b)  # u_j ← β1_j·u_j + (1−β1_j)·ĝ
    descend_(x, quasi_hyperbolic(gn, moments, omegas), lr, weight_decay)
    ema_sq_(v, g, beta2)  # v last: ADOPT's order, which is what lets it converge for any β2


# ---- multi-tensor forms --------------------------------------------------------------------------
# The same operations in the same order as the single-tensor updates above, each one ``torch._foreach_*``
# call over lists of tensors (one launch per operation for a whole list on a GPU instead of one per
# tensor, no Python loop over the tensors). Bit for bit the single-tensor results on the CPU (where
# the foreach ops run the single-tensor kernels); the same formulas on a GPU. Temporaries exist for
# the whole list at once: callers bound the list's size. ``moments`` is indexed [j][i]: momentum j
# of tensor i.
Tensors = Sequence[Tensor]


def _decay_multi_(xs: Tensors, lr: float, weight_decay: float) -> None:
    if weight_decay != 0:
        torch._foreach_mul_(xs, 1 - lr * weight_decay)


def _denominator_multi(vs: Tensors, beta2: float, step: float, eps: float, bias_correction: bool) -> list[Tensor]:
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, _correction(beta2, step, bias_correction) ** 0.5)
    torch._foreach_add_(denom, eps)
    return denom


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_adamw_takes(*lists: Tensors) -> bool:
    """Whether torch's fused AdamW kernel takes these lists: dense tensors of one floating dtype on
    one CPU or CUDA/HIP device."""
    first = lists[0][0] if lists[0] else None
    if first is None or first.device.type not in ("cpu", "cuda") or first.dtype not in _FUSED_DTYPES:
        return False
    return all(t.device == first.device and t.dtype == first.dtype and t.layout == torch.strided
               for ts in lists for t in ts)


def adamw_multi_(
    xs: Tensors, gs: Tensors, ms: Tensors, vs: Tensors, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, step: float, bias_correction: bool = True, fused: bool = False,
) -> None:
    """:func:`adamw_` over lists. ``fused``: torch's fused AdamW kernel where it applies (bias
    correction on, see :func:`fused_adamw_takes`) — the same update in one pass over each tensor
    instead of about ten (one kernel per launch group on GPUs). It is
    ``torch.optim.AdamW(fused=True)`` — what torchtitan builds — to the last bit, and agrees with
    :func:`adamw_` (torch's single-tensor and foreach order) to round-off only."""
    if fused and bias_correction and fused_adamw_takes(xs, gs, ms, vs):
        # the kernel reads t from a tensor per parameter (float32: exact up to 2^24 steps)
        t = torch.full((), float(step), dtype=torch.float32, device=xs[0].device)
        torch._fused_adamw_(xs, gs, ms, vs, [], [t] * len(xs), lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    _decay_multi_(xs, lr, weight_decay)
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
    denom = _denominator_multi(vs, beta2, step, eps, bias_correction)
    torch._foreach_addcdiv_(xs, ms, denom, value=-lr / _correction(beta1, step, bias_correction))


def _quasi_hyperbolic_multi(
    gs: Tensors, moments: Sequence[Tensors], omegas: Sequence[float], corrections: Optional[Sequence[float]] = None,
    *, inplace: bool = False,
) -> list[Tensor]:
    """:func:`quasi_hyperbolic` over lists (written into ``gs`` when ``inplace``)."""
    if inplace:
        torch._foreach_mul_(gs, 1 - sum(omegas))
        out = list(gs)
    else:
        out = torch._foreach_mul(gs, 1 - sum(omegas))
    for j, (us, w) in enumerate(zip(moments, omegas)):
        torch._foreach_add_(out, us, alpha=w if corrections is None else w / corrections[j])
    return out


def is_plain_adam(n_moments: int, omegas: Sequence[float], corrections1: Optional[Sequence[float]] = None) -> bool:
    """Whether a quasi-hyperbolic Adam step is plain AdamW (one momentum, ω = 1, its own bias
    correction), which :func:`qh_adamw_multi_` runs as :func:`adamw_multi_` (torch's rounding, and
    torch's fused kernel where asked)."""
    return corrections1 is None and n_moments == 1 and omegas[0] == 1.0


def qh_adamw_multi_(
    xs: Tensors, gs: Tensors, moments: Sequence[Tensors], vs: Tensors, *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], beta2: float, eps: float, weight_decay: float, step: float,
    bias_correction: bool = True, corrections1: Optional[Sequence[float]] = None, fused: bool = False,
) -> None:
    """:func:`qh_adamw_` over lists. ``corrections1``: the first momenta's bias corrections when not
    1 − β1_j^t (a momentum whose β changed mid-run, MT-DAO's switch). ``fused``: see
    :func:`adamw_multi_` (one momentum with ω = 1 only)."""
    if is_plain_adam(len(moments), omegas, corrections1):
        adamw_multi_(xs, gs, moments[0], vs, lr=lr, beta1=betas1[0], beta2=beta2, eps=eps,
                     weight_decay=weight_decay, step=step, bias_correction=bias_correction, fused=fused)
        return
    _decay_multi_(xs, lr, weight_decay)
    for us, b in zip(moments, betas1):
        torch._foreach_lerp_(us, gs, 1 - b)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
    denom = _denominator_multi(vs, beta2, step, eps, bias_correction)
    corrections = corrections1 if corrections1 is not None else [_correction(b, step, bias_correction) for b in betas1]
    torch._foreach_addcdiv_(xs, _quasi_hyperbolic_multi(gs, moments, omegas, corrections), denom, value=-lr)


def sgdm_multi_(
    xs: Tensors, gs: Tensors, moments: Sequence[Tensors], *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], weight_decay: float,
) -> None:
    """:func:`sgdm_` over lists."""
    for us, b in zip(moments, betas1):
        torch._foreach_lerp_(us, gs, 1 - b)
    update = _quasi_hyperbolic_multi(gs, moments, omegas)
    _decay_multi_(xs, lr, weight_decay)
    torch._foreach_add_(xs, update, alpha=-lr)


def adopt_multi_(
    xs: Tensors, gs: Tensors, moments: Sequence[Tensors], vs: Tensors, *, lr: float, betas1: Sequence[float],
    omegas: Sequence[float], beta2: float, eps: float, weight_decay: float, step: int, clip: bool = True,
) -> None:
    """:func:`adopt_` over lists (the normalized gradient's buffer is reused for the update)."""
    if step == 1:
        torch._foreach_addcmul_(vs, gs, gs)
        return
    denom = torch._foreach_sqrt(vs)
    torch._foreach_clamp_min_(denom, eps)
    gn = torch._foreach_div(gs, denom)  # ĝ = g / max(√v_{t−1}, ε)
    del denom
    if clip:
        c = (step - 1) ** 0.25
        torch._foreach_clamp_min_(gn, -c)
        torch._foreach_clamp_max_(gn, c)
    for us, b in zip(moments, betas1):
        torch._foreach_lerp_(us, gn, 1 - b)
    update = _quasi_hyperbolic_multi(gn, moments, omegas, inplace=True)
    _decay_multi_(xs, lr, weight_decay)
    torch._foreach_add_(xs, update, alpha=-lr)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)


def muon_momentum_multi_(
    ms: Tensors, gs: Tensors, *, momentum: float, lerp: bool, nesterov: bool
) -> list[Tensor]:
    """Muon's momentum over lists, and what is orthogonalized. M ← μ·M + G (undamped: MuLoCo's, Keller
    Jordan's) or M ← μ·M + (1 − μ)·G (``lerp``: torch.optim.Muon's ``buf.lerp_(grad, 1 − μ)``); returns
    M itself, or with ``nesterov`` new tensors G + μ·M (undamped) or G.lerp(M, μ) (torch's)."""
    if lerp:
        torch._foreach_lerp_(ms, gs, 1 - momentum)
        return torch._foreach_lerp(gs, ms, momentum) if nesterov else list(ms)
    torch._foreach_mul_(ms, momentum)
    torch._foreach_add_(ms, gs)
    if not nesterov:
        return list(ms)
    look_ahead = torch._foreach_mul(ms, momentum)
    torch._foreach_add_(look_ahead, gs)
    return look_ahead


def muon_descend_multi_(xs: Tensors, orthogonal: Tensors, *, lr: float, ratio: float, weight_decay: float) -> None:
    """x ← x·(1 − η·λ) − η·r·O: the decay at the base lr η, the orthogonalized O (any dtype: added in
    x's) at η·r, r the matrix's shape factor (torch.optim.Muon's and MuLoCo's order)."""
    _decay_multi_(xs, lr, weight_decay)
    torch._foreach_add_(xs, orthogonal, alpha=-(lr * ratio))


def nesterov_step_(anchor: Tensor, delta: Tensor, buf: Tensor, *, lr: float, momentum: float) -> None:
    """The outer Nesterov step on a pseudo-gradient Δ (``delta``, overwritten), as torch's SGD with
    Nesterov: b ← μ·b + Δ; x_anchor ← x_anchor − η·(Δ + μ·b)."""
    buf.mul_(momentum).add_(delta)  # b ← μ b + Δ
    anchor.sub_(delta.add_(buf, alpha=momentum), alpha=lr)  # x_anchor ← x_anchor − η(Δ + μ b)


def nesterov_outer_(x: Tensor, anchor: Tensor, buf: Tensor, *, lr: float, momentum: float) -> None:
    """DiLoCo's outer step on ``x`` = mean_R(x), with ``anchor`` = x at the previous outer step and
    ``buf`` the outer momentum; the anchor moves to the new x."""
    nesterov_step_(anchor, anchor - x, buf, lr=lr, momentum=momentum)  # Δ = x_anchor − mean_R(x)
    x.copy_(anchor)
