"""Known-harmless console noise, filtered in one place.

torchtitan 0.2.2 prints warnings that say nothing about the run: they describe HuggingFace files
that our offline tokenizer does not use (on every machine) or, on CPU, the absence of a GPU.
:func:`quiet_known_noise` drops exactly these, and nothing else:

torchtitan log lines (its root logger; the message must match from its start). On every machine
(seen on an H100 too):

- ``HF assets path bundled does not exist!`` (also for an empty path): ``bundled`` is our offline
  tokenizer (``tt022/tokenizer.py``), not a directory;
- ``model.safetensors.index.json not found at hf_assets_path: bundled/...`` (on torchtitan 0.3:
  ``.../hf_tokenizer_<corpus>_v<version>_<vocab>/...``, the bundled tokenizer's folder in the cache): same
  reason, and only HF-format checkpoint export reads that file;
- ``initial_load_model_only=True has no effect without an initial_load_path.`` (torchtitan 0.3,
  from its checkpoint config each time one is made): ``true`` is 0.2.2's default, which a TOML run
  on 0.3 keeps (``tt03_toml/toml_config.py``); with no ``initial_load_path`` it is simply not used.

Only without an accelerator (on a GPU machine they are about the machine, and stay):

- ``Error running lspci: ...``, ``Peak flops undefined for: cpu, fallback to A100`` and ``Peak FLOPS
  used for computing MFU: ...`` (an A100's figure): the MFU estimate looks for a GPU (MFU means
  nothing on a CPU);
- ``ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = ... will be overridden``: NCCL is not used on CPU (gloo);
- ``CUDA graph capture is only supported on NVIDIA CUDA; using eager execution.`` (torchtitan 0.3):
  eager execution is what a CPU run does anyway.

Python warnings (``UserWarning``), only without an accelerator:

- ``DTensor random operators may not have complete support on cpu device mesh`` and ``DTensor
  manual_seed() may not have complete support on cpu device mesh``: torchtitan seeds on every mesh;
  our models initialize on each rank and replicas are made equal by a broadcast;
- ``In CPU autocast, but the target dtype is not supported. Disabling autocast.``: float32 training on
  CPU, where autocast has nothing to do;
- ``'set_vital' is deprecated``: torchdata's dataloader calls a deprecated torch hook;
- ``Set timeout is now only supported for either nccl or gloo.``: when torchtitan lowers the
  process groups' timeout after the first step, its expert-parallel ``efsdp`` mesh (built whenever
  ``dp_shard`` > 1, even without experts) is a ``FakeProcessGroup`` that issues no collective, so
  there is no timeout to set; every real group here is gloo and gets it.
"""

import logging
import os
import re
import warnings

__all__ = ["quiet_known_noise", "NOISE_LOG_LINES", "NOISE_WARNINGS", "OFFLINE_LOG_LINES"]

OFFLINE_LOG_LINES = (
    r"HF assets path (bundled)? does not exist!",
    r"model\.safetensors\.index\.json not found at hf_assets_path: (bundled/|\S*/hf_tokenizer_\w+_\d+/)",
    r"initial_load_model_only=True has no effect without an initial_load_path\.",
)

NOISE_LOG_LINES = OFFLINE_LOG_LINES + (
    r"Error running lspci: ",
    r"Peak flops undefined for: cpu, fallback to A100",
    r"Peak FLOPS used for computing MFU: ",
    r"ENV\[TORCH_NCCL_ASYNC_ERROR_HANDLING\] = \S+ will be overridden",
    r"CUDA graph capture is only supported on NVIDIA CUDA; using eager execution\.",
)

NOISE_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu device mesh",
    r"DTensor manual_seed\(\) may not have complete support on cpu device mesh",
    r"In CPU autocast, but the target dtype is not supported",
    r"'set_vital' is deprecated",
    r"Set timeout is now only supported for either nccl or gloo\.",
)


class _DropKnownNoise(logging.Filter):
    def __init__(self, lines: tuple[str, ...] = NOISE_LOG_LINES) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in lines))

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not self.pattern.match(message)


_installed = False


def quiet_known_noise() -> bool:
    """Drop the log lines and warnings listed in this module's docstring: the offline tokenizer's
    everywhere, the CPU ones on a machine without an accelerator (idempotent). Returns whether the
    CPU ones are dropped."""
    global _installed
    from .cpu import accelerator_available

    on_cpu = not accelerator_available()
    # torchft (imported by torchtitan when installed) logs every quorum and commit at INFO from its
    # Rust side, read once at import: warnings only, unless the user set RUST_LOG
    os.environ.setdefault("RUST_LOG", "warn")
    if not _installed:
        # torchtitan logs through the root logger
        logging.getLogger().addFilter(_DropKnownNoise(NOISE_LOG_LINES if on_cpu else OFFLINE_LOG_LINES))
        if on_cpu:
            for message in NOISE_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
        _installed = True
    return on_cpu
