"""``[commopt] kernels``: which implementation runs the optimizers' per-element and per-chunk math,
chosen once per optimizer at construction:

- ``"torch"``: torch's eager operators everywhere (the reference, and the CPU path);
- ``"triton"``: the Triton kernels (on a CUDA/ROCm device; on the CPU only under Triton's
  interpreter, ``TRITON_INTERPRET=1``, which is how the tests run them without a GPU);
- ``"auto"`` (default): Triton where the parameters live on a CUDA/ROCm device and Triton imports,
  torch elsewhere.

Each Triton kernel lives beside the torch code it must equal, named for it (``optim/local/update.py``
and ``update_triton.py``, ``optim/demo/plan.py`` and ``plan_triton.py``, ``compress/packing.py`` and
``packing_triton.py``); a ``*_triton`` module is imported only where Triton runs. Triton's AMD
backend runs the same kernels (no CUDA-only intrinsics are used).
"""

import functools
import os
from typing import Iterable

import torch

from titan_commopt.options import ConfigError

__all__ = ["KERNELS", "triton_available", "interpreting", "use_triton"]

KERNELS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton imports (it ships with torch's Linux wheels and with torchtitan)."""
    try:
        import triton.language as tl
    except Exception:  # pragma: no cover - platform dependent (no wheel, broken install)
        return False
    return hasattr(tl, "dot")


def interpreting() -> bool:
    """Triton runs its kernels in the interpreter, on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(kernels: str, devices: "torch.device | Iterable[torch.device]") -> bool:
    """Whether an optimizer whose tensors live on ``devices`` runs its Triton kernels.

    ``kernels = "triton"`` where Triton cannot run (not installed; CPU tensors outside the
    interpreter) is a :class:`ConfigError` naming the key, raised at construction before any
    collective; ``"auto"`` quietly takes the torch path there."""
    if kernels not in KERNELS:
        raise ConfigError(f"[commopt] kernels = {kernels!r}: allowed is one of {', '.join(map(repr, KERNELS))}")
    if kernels == "torch":
        return False
    types = {torch.device(d).type for d in ([devices] if isinstance(devices, (torch.device, str)) else devices)}
    on_gpu = bool(types) and types <= {"cuda"}  # ROCm torch also names its devices "cuda"
    runnable = triton_available() and (on_gpu or (interpreting() and types <= {"cpu", "cuda"}))
    if kernels == "auto":
        return triton_available() and on_gpu
    if not runnable:
        why = "Triton is not installed" if not triton_available() else (
            f"the parameters are on {', '.join(sorted(types)) or 'no device'}; Triton kernels need a CUDA/ROCm "
            "device (or TRITON_INTERPRET=1 to run them in Triton's interpreter on the CPU)"
        )
        raise ConfigError(f"[commopt] kernels = 'triton': {why}; allowed where Triton cannot run: 'auto' or 'torch'")
    return True
