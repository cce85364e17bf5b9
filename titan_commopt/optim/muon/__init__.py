"""Muon, one step in four modules, run by every family with a Muon step: ``options.py`` (the ``muon_*``
keys every such table has, the routing into param groups), ``layout.py`` (each matrix gathered whole
to one owner rank of the groups that cut it, and the price of that), ``engine.py`` (the step),
``optimizer.py`` (``[commopt.muon]``: Muon on HSDP, and its ``FAMILY``)."""

from .engine import MuonMatrices
from .options import MuonOptions, lr_ratio, muon_problems, routed_groups
from .layout import muon_shard_bytes
from .optimizer import FAMILY, PRESET_SOURCES, PRESETS, Config, Muon, check, muon_r_bytes, muon_s_bytes

__all__ = [
    "Config", "PRESETS", "PRESET_SOURCES", "Muon", "FAMILY", "check", "muon_r_bytes", "muon_s_bytes", "muon_shard_bytes",
    "MuonMatrices", "MuonOptions", "lr_ratio", "muon_problems", "routed_groups",
]
