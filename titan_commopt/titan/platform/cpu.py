"""Everything torchtitan (0.2.2 and 0.3) assumes about CUDA, handled in one place.

torchtitan picks ``device_type = "cuda"`` when no accelerator exists and several modules copy
``device_type`` / ``device_module`` at import time (found by trial on torchtitan 0.2.2). On a machine without an
accelerator :func:`use_cpu_if_no_accelerator` points all of them at ``"cpu"`` and at
:class:`CpuDeviceModule`, a stand-in for the ``torch.cuda``-like module they call. Once
``device_type`` is ``"cpu"``, torchtitan's backend selection picks gloo by itself.

gloo has no AVG / PREMUL_SUM reduce-scatter, so FSDP2 modules must reduce with SUM on CPU
(:func:`force_sum_reduction`; torchtitan already sets the gradient divide factor to 1).

On a machine with an accelerator nothing here changes anything: the same entry point uses it.
"""

import os
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn

# Modules of each torchtitan line that bind device_type / device_module at import time.
_MODULES_WITH_DEVICE_GLOBALS = {
    "0.2": (
        "torchtitan.tools.utils",
        "torchtitan.components.metrics",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.tools.profiling",
    ),
    "0.3": (
        "torchtitan.tools.utils",
        "torchtitan.components.metrics",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.tools.profiler",
        "torchtitan.models.common.token_dispatcher",
    ),
}


def accelerator_available() -> bool:
    return torch.accelerator.is_available()


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 34


class CpuDeviceModule:
    """The subset of the ``torch.cuda`` API torchtitan's Trainer calls, for the CPU.

    Memory statistics are not tracked on CPU: peaks report 0 (torchtitan prints them as 0 GiB).
    """

    memory = SimpleNamespace(_record_memory_history=lambda *a, **k: None, _snapshot=lambda: {})

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0  # an int: torch.distributed.barrier(device_ids=[...]) insists

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=_total_memory(), name="cpu")

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


def use_cpu_if_no_accelerator() -> bool:
    """Point torchtitan at the CPU when no accelerator exists. Returns whether it did.

    Must run before torchtitan's ``Trainer.__init__`` (it reads ``device_type`` first thing);
    ``titan_commopt.train`` calls it before building the Trainer.
    """
    if accelerator_available():
        return False
    import importlib

    from ..line import installed_version, line_of

    stand_in = CpuDeviceModule()
    for name in _MODULES_WITH_DEVICE_GLOBALS[line_of(installed_version()) or "0.2"]:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = stand_in
    return True


CPU_CONFIG_MODULE = "titan_commopt.titan.tt03.configs"  # 0.3: applies the CPU fixes to torchtitan's configs too


def _flag(argv: list[str], name: str) -> Optional[str]:
    """The value of ``--name`` (either spelling) on a command line, the last one given."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def stock_module_problem(argv: list[str]) -> Optional[str]:
    """On a machine without an accelerator, the one line that refuses 0.3's own entry point
    (``-m torchtitan.train``, ``argv`` its arguments) with one of torchtitan's config modules
    (``--module llama3``, ``--module torchtitan.models.llama3``): torchtitan's Trainer sets the CUDA
    device first thing, before any code of ours runs (an ``--override.imports`` of ours is imported
    only after the process group exists), and stops with torch's ``_cuda_setDevice`` traceback. Our
    config module names the same config and applies the CPU fixes to it. None otherwise."""
    from ..line import installed_version, line_of

    module = _flag(argv, "--module")
    if module is None or line_of(installed_version()) != "0.3" or accelerator_available():
        return None
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module not in _supported_models | _supported_experiments and not module.startswith("torchtitan."):
        return None
    config = _flag(argv, "--config") or "<its config>"
    return (f"--module {module} on a machine without an accelerator: torchtitan's own config module and Trainer "
            "assume CUDA (torch.cuda.set_device fails before any titan_commopt code runs, an --override.imports of "
            f"ours included); allowed is our config module, which applies the CPU fixes to torchtitan's configs by "
            f"name: --module {CPU_CONFIG_MODULE} --config {config}")


def on_cpu() -> bool:
    import torchtitan.tools.utils as utils

    return utils.device_type == "cpu"


def force_sum_reduction(model: nn.Module) -> None:
    """gloo lacks AVG/PREMUL_SUM reduce-scatter: make every FSDP2 module reduce with SUM."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def shim_set_timeout() -> None:
    """torchtitan 0.3 calls ``torch.distributed.set_timeout`` (a newer torch's) after step 1; torch
    2.13 has the same function, private, as ``distributed_c10d._set_pg_timeout(timeout, group)``."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
