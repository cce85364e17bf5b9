"""DeMo and FlexDeMo/DeToNATION, one family in three modules: ``optimizer.py`` (``[commopt.demo]``,
the optimizer and its ``FAMILY``), ``plan.py`` (one step's exchange over R, laid out once), and
``plan_triton.py`` (the plan's DCT encode and decode as Triton kernels, its twin)."""

from .optimizer import FAMILY, PRESET_SOURCES, PRESETS, Config, DeMo, check, demo_r_bytes, state_shape

__all__ = ["Config", "PRESETS", "PRESET_SOURCES", "DeMo", "FAMILY", "check", "demo_r_bytes", "state_shape"]
