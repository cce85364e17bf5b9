"""Pieces every optimizer family shares: hyper-parameters from torchtitan's ``[optimizer]``,
local views of DTensor shards, and the contract of a family's ``build`` function."""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from titan_commopt.topology import Topology

__all__ = ["BaseHParams", "local", "FamilyBuilder", "NamedParams"]

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class BaseHParams:
    """The generic knobs of torchtitan's ``[optimizer]`` section (same names)."""

    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (a view: in-place ops write through), or ``t``."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


class FamilyBuilder(Protocol):
    """``optim/<family>.py`` exposes ``build(name, named_params, topology, hparams, cfg)``.

    ``named_params`` are the model's trainable parameters with their FQNs (DTensors on the S/T mesh
    when FSDP2/TP is on; R is never part of their mesh: the optimizer syncs R itself through
    ``titan_commopt.comm``). ``cfg`` is the family's options dataclass (``[commopt.<family>]``)
    with the preset of ``name`` applied. Returns a ``torch.optim.Optimizer``.
    """

    def __call__(
        self, name: str, named_params: NamedParams, topology: Topology, hparams: BaseHParams, cfg: object
    ) -> torch.optim.Optimizer: ...
