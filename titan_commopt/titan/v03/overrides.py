"""Deprecated: ``--override.imports titan_commopt.titan.tt03.overrides.commopt`` (``.comm_metrics``).

torchtitan finds an ``@override`` by the module and name of the function that carries it, so the
old names are registered here, each handing over to the new one."""

from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import override

from ..tt03 import overrides
from . import announce_moved

__all__ = ["commopt", "comm_metrics"]

announce_moved("titan_commopt.titan.v03.overrides", "titan_commopt.titan.tt03.overrides")


@override(target=OptimizersContainer.Config, description="deprecated name of titan_commopt.titan.tt03.overrides.commopt")
def commopt(cfg: Any, name: str = "FlexDeMo", **options: Any) -> Any:
    return overrides.commopt(cfg, name, **options)


@override(target=MetricsProcessor.Config, description="deprecated name of titan_commopt.titan.tt03.overrides.comm_metrics")
def comm_metrics(cfg: Any) -> Any:
    return overrides.comm_metrics(cfg)
