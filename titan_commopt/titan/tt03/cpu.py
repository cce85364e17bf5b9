"""torchtitan 0.3 on a machine without an accelerator (gloo): the fixes a config needs, applied only
there (on a GPU machine :func:`apply_cpu_fixes` returns the config as it is).

- torchtitan's device globals → the CPU (``platform/cpu.py``; gloo follows);
- ``torch.distributed.set_timeout`` for the torch it runs on (``platform/cpu.py``);
- FlexAttention has no CPU backward: every ``FlexAttention.Config`` of the model → SDPA
  (``is_causal=True``; no per-document masks, which only Flex/varlen build);
- ``spmd_types`` (0.3's default backend) fails with more than one process on torch 2.13 →
  ``partial_dtensor``, in a config function's config (before the command line is applied: a
  backend typed there is kept, and refused with one line where it cannot work); a config the user
  wrote whole (our TOML runner's: ``keep_backend``) keeps its backend; ``fused`` optimizers →
  ``foreach``; parameters in float32 (no fast bf16 on CPU);
- SUM instead of AVG in FSDP's reduce-scatter: done by the ``fully_shard`` wrapper (``fsdp.py``).
"""

from typing import Any

from ..platform.cpu import accelerator_available, shim_set_timeout, use_cpu_if_no_accelerator

__all__ = ["apply_cpu_fixes", "use_sdpa"]


def use_sdpa(model_config: Any) -> int:
    """Replace every FlexAttention config in ``model_config``'s tree by SDPA's; how many."""
    from torchtitan.config.override import derive
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    found = list(model_config.traverse(FlexAttention.Config))
    for _, flex, parent, attr in found:
        sdpa = derive(flex, ScaledDotProductAttention.Config)
        if isinstance(attr, int):
            parent[attr] = sdpa
        else:
            setattr(parent, attr, sdpa)
    return len(found)


def apply_cpu_fixes(cfg: Any, *, keep_backend: bool = False) -> Any:
    """``cfg`` (a ``Trainer.Config``) made to run on CPU/gloo; unchanged where an accelerator exists.
    ``keep_backend``: ``parallelism.spmd_backend`` is the user's, not a default to fix."""
    if accelerator_available():
        return cfg
    use_cpu_if_no_accelerator()
    shim_set_timeout()
    if cfg.model_spec is not None:
        use_sdpa(cfg.model_spec)
    if cfg.parallelism.spmd_backend == "spmd_types" and not keep_backend:
        cfg.parallelism.spmd_backend = "partial_dtensor"
    if getattr(cfg.optimizer, "implementation", None) in ("fused", "fused_opt_states_bf16"):
        cfg.optimizer.implementation = "foreach"
    cfg.training.mixed_precision_param = "float32"
    return cfg
