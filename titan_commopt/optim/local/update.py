"""The local-adaptive family's local step in torch, chosen once from ``[commopt.local]``: the
optimizer's own gradient clip and the base optimizer's multi-tensor update (``optim/updates.py``).
``update_triton.py`` beside it computes the same, clip included, in one Triton kernel pass;
:func:`fused_local_update` is that kernel with the same arguments.
"""

from typing import Callable, Optional

import torch

from .. import updates

__all__ = ["LocalUpdate", "GradientClip", "local_update", "fused_local_update", "gradient_clip"]

LocalUpdate = Callable[..., None]  # (xs, gs, moments, vs, group, hp, n, corrections) → None


def local_update(base: str, *, adopt_clip: bool, bias_correction: bool) -> LocalUpdate:
    """The multi-tensor update of ``base`` (``[commopt.local]``'s, with its ``adopt_clip`` and
    ``bias_correction``); ``hp`` = lr, betas1, omegas, weight_decay of this update, ``corrections`` the
    first momenta's bias corrections after MT-DAO's switch."""
    if base == "sgdm":
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            updates.sgdm_multi_(xs, gs, moments, **hp)
    elif base == "adopt":
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            updates.adopt_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                 clip=adopt_clip)
    else:
        def update(xs, gs, moments, vs, group, hp, n, corrections):
            updates.qh_adamw_multi_(xs, gs, moments, vs, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                                    bias_correction=bias_correction, corrections1=corrections, fused=True)
    return update


def fused_local_update(
    base: str, *, adopt_clip: bool, bias_correction: bool, clip: str, clip_threshold: float
) -> Callable[..., None]:
    """:func:`local_update` after :func:`gradient_clip`, as one Triton kernel (``update_triton.py``);
    ``scale`` is the norm clip's min(1, ρ/‖g‖)."""
    from .update_triton import local_adaptive_  # Triton is imported only where it runs

    def update(xs, gs, moments, vs, group, hp, n, corrections, scale):
        local_adaptive_(xs, gs, moments, vs, base=base, **hp, beta2=group["beta2"], eps=group["eps"], step=n,
                        bias_correction=bias_correction, corrections1=corrections, adopt_clip=adopt_clip,
                        clip=clip, clip_threshold=clip_threshold, clip_scale=scale)
    return update


GradientClip = Callable[[list[torch.Tensor], Optional[torch.Tensor]], list[torch.Tensor]]


def gradient_clip(clip: str, rho: float) -> Optional[GradientClip]:
    """The optimizer's own clip of a chunk's gradients (new tensors; ``p.grad`` is never written):
    ``coordinate`` to ±ρ, or ``norm`` given the replica's norm scale min(1, ρ/‖g‖); ``None`` for no clip."""
    if clip == "coordinate":
        return lambda gs, scale: [g.clamp(-rho, rho) for g in gs]
    if clip == "norm":
        return lambda gs, scale: torch._foreach_mul(gs, scale)  # × 1.0 when not clipping: exact
    return None
