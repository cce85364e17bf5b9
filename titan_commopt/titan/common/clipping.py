"""``[training] max_norm`` for optimizers that own R: torchtitan's clip call, handed to our container.

torchtitan's ``Trainer.train_step`` (0.2.2 and 0.3) clips with ``torchtitan.distributed.utils.clip_grad_norm_``
(looked up on that module at every step) and logs what it returns as ``grad_norm``. With R hidden
from FSDP2 that function would see one replica's gradient, which torchtitan's loss scaling makes
``1/W`` of the replica's mean gradient: ``max_norm`` would be ``W``× looser than for AdamW-HSDP and
``grad_norm`` ``W``× smaller. :func:`install` wraps the function once: parameters that belong to a
container of ours owning R go to its ``clip_grad_norm_`` (``container.py``: the norm of the
replicas' mean gradients, one rule for every family); anything else (AdamW/Adam, pipeline or
expert parallel, other norm types) calls torchtitan's own function unchanged.

Module-level state: the containers the clip is routed to. torchtitan's seam forces it (a function
looked up on its module, called with the parameters only, by torchtitan's own Trainer as well as
ours); :func:`register` sets it (``build.py: route_clipping``, once per container that owns R),
:func:`owner_of` reads it. A ``WeakSet``: a container that is gone is forgotten.
"""

import weakref
from typing import Any, Callable, Optional

import torch

from .patch import wrap_once

__all__ = ["install", "register", "owner_of"]

_containers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(container: Any) -> None:
    """Route the clip of ``container``'s parameters to ``container.clip_grad_norm_``."""
    _containers.add(container)


def owner_of(params: list[torch.Tensor]) -> Optional[Any]:
    for container in list(_containers):
        if container.owns_replicate_sync and container.owns(params):
            return container
    return None


def install() -> None:
    """Wrap ``torchtitan.distributed.utils.clip_grad_norm_`` (once)."""
    from torchtitan.distributed import utils as dist_utils

    wrap_once(dist_utils, "clip_grad_norm_", _routed)


def _routed(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def clip_grad_norm_(
        parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None, pp_mesh: Any = None, ep_enabled: bool = False,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owner = None
        if norm_type == 2.0 and pp_mesh is None and not ep_enabled and not error_if_nonfinite:
            owner = owner_of(params)
        if owner is None:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        return owner.clip_grad_norm_(params, max_norm, foreach=foreach)

    return clip_grad_norm_
