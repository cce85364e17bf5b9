"""Dion (Ahn et al., "Dion: Distributed Orthonormalized Updates"), one family in four modules:
``config.py`` (``[commopt.dion]``), ``layout.py`` (which parameters Dion runs, at which rank, on which
side, and the byte formula), ``reduce.py`` (the R reduction of P and R), ``optimizer.py`` (the
optimizer and its ``FAMILY``)."""

from .config import PRESET_SOURCES, PRESETS, Config
from .layout import Layout, compressed, dion_r_bytes, dion_rank, initial_q, r_slice, route, transposed
from .optimizer import FAMILY, Dion, orient_, state_shape

__all__ = [
    "Config", "PRESETS", "PRESET_SOURCES", "Dion", "FAMILY", "state_shape", "orient_", "Layout", "route", "dion_rank",
    "compressed", "transposed", "initial_q", "r_slice", "dion_r_bytes",
]
