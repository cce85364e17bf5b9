"""A family is a value: its options, presets, builder, byte formula and checks in one object.

The registry (``titan_commopt.optim``) imports each family module and lists its ``FAMILY``. From
``[optimizer]`` + ``[commopt.<family>]`` + the name's preset it makes one :class:`Resolved` value —
validated once — that both ``Family.build`` and ``Family.r_bytes`` take. A preset fills only the
keys the user did not set: "set" is tracked by key (what the TOML or the command line named), never
by comparing a value with its default, so a user who sets a key to the family default keeps it.

:class:`ShardShape` is the one description of a parameter shard every byte formula reads: the
container fills it from the live DTensors, the comm report from a meta-device model.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .common import BaseHParams, mesh_dim_role

try:  # FSDP2 over TP shards an already row-sharded dim again: a strided row split
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = ()  # type: ignore[assignment,misc]

__all__ = ["Family", "Resolved", "ShardShape", "Bytes", "PeriodicSyncs"]


@dataclass(frozen=True)
class Bytes:
    """Payload per rank per step, in bytes (periodic syncs averaged over their period)."""

    sent: float = 0.0
    recv: float = 0.0

    def __add__(self, other: "Bytes") -> "Bytes":
        return Bytes(self.sent + other.sent, self.recv + other.recv)


@dataclass(frozen=True)
class ShardShape:
    """One parameter as this rank holds it.

    ``row_split = (index, count)``: the parameter's rows (dim 0) are split over ``count`` ranks of
    the S/T meshes (FSDP2's ``Shard(0)``, TP's column-wise layers) and this rank holds the
    ``index``-th part, mixed radix with the first sharding mesh dim most significant. ``itemsize``:
    bytes per element of the parameter (what a family that sends parameter-dtype tensors sends).
    ``col_split``: the same for the columns (dim 1: TP's row-wise layers). ``sharded``: ``(role,
    tensor dim)`` of every mesh dim of size > 1 that shards the parameter, role ``"T"`` for a mesh dim
    named ``tp`` and ``"S"`` otherwise (as Dion assigns them; its orientation rule reads them).
    ``offset``: where the local shard starts in the parameter, per dim (empty: at the origin).
    ``mesh_sizes``: the size of each mesh dim of ``sharded``, in the same order (empty: one mesh dim
    per split tensor dim, its size the split's count). ``strided``: one of them is a ``_StridedShard``
    (FSDP2 over rows tensor parallelism split first: the local rows are not where ``row_split``'s
    mixed radix would put them, ``offset`` says where).
    """

    fqn: str
    local: tuple[int, ...]
    shape: tuple[int, ...]
    row_split: tuple[int, int] = (0, 1)
    itemsize: int = 4
    col_split: tuple[int, int] = (0, 1)
    sharded: tuple[tuple[str, int], ...] = ()
    offset: tuple[int, ...] = ()
    mesh_sizes: tuple[int, ...] = ()
    strided: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.local)

    def start(self, dim: int) -> int:
        """The first index of the local shard along ``dim``: ``offset``'s, or where it is not given,
        the ``(index, count)`` split's ceil-sized parts (FSDP2's and TP's) for dims 0 and 1."""
        if self.offset:
            return self.offset[dim]
        if dim > 1:
            return 0
        index, count = (self.row_split, self.col_split)[dim]
        return min(index * -(-self.shape[dim] // count), self.shape[dim])

    @classmethod
    def of(cls, fqn: str, p: torch.Tensor) -> "ShardShape":
        """From a live parameter (a DTensor on the S/T mesh, or a plain tensor)."""
        to_local = getattr(p, "to_local", None)
        if to_local is None:
            return cls(fqn, tuple(p.shape), tuple(p.shape), (0, 1), p.element_size())
        splits = [[0, 1], [0, 1]]
        sharded, sizes, strided = [], [], False
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            size = mesh.size(dim)
            is_strided = isinstance(placement, _StridedShard)
            if size > 1 and (placement.is_shard() or is_strided) and placement.dim in (0, 1):
                strided = strided or is_strided
                split = splits[placement.dim]
                split[0], split[1] = split[0] * size + mesh.get_local_rank(dim), split[1] * size
                sharded.append((mesh_dim_role(mesh, dim), placement.dim))
                sizes.append(size)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
        return cls(fqn, tuple(to_local().shape), tuple(p.shape), tuple(splits[0]), p.element_size(),
                   tuple(splits[1]), tuple(sharded), tuple(int(o) for o in offset), tuple(sizes), strided)

    @classmethod
    def fsdp(cls, fqn: str, shape: Sequence[int], shards: int, rank: int = 0, itemsize: int = 4) -> "ShardShape":
        """Rank ``rank``'s FSDP2 shard of a parameter of global ``shape``: dim 0 in ceil-sized chunks."""
        shape = tuple(shape)
        if shards <= 1 or not shape:
            return cls(fqn, shape, shape, (0, 1), itemsize)
        chunk = math.ceil(shape[0] / shards)
        local = (max(0, min(chunk, shape[0] - rank * chunk)), *shape[1:])
        offset = (min(rank * chunk, shape[0]), *(0 for _ in shape[1:]))
        return cls(fqn, local, shape, (rank, shards), itemsize, sharded=(("S", 0),), offset=offset,
                   mesh_sizes=(shards,))


@dataclass(frozen=True)
class PeriodicSyncs:
    """The R syncs of a family that sends on a period (what a report needs to price its largest step).

    ``periods``: the period of each state synced on one (> 0); ``due_alone(subset)``: the options of
    a run that syncs exactly the states in ``subset`` (indices into ``periods``) on every step and
    nothing else, so that the family's ``r_bytes`` asked of it is the payload of a step where exactly
    those states are due; ``exact``: False where syncs are split further in time (e.g. fragments),
    so that payload is only an upper bound of any real step; ``states``: the name each period's state
    has in the family's sync schedule (the local family's ``"x"``, ``"v"``, ``"u<j>"``), where it
    has several, so that a report can price each state of a schedule's step apart."""

    periods: tuple[int, ...]
    due_alone: Callable[[tuple[int, ...]], Any]
    exact: bool = True
    states: tuple[str, ...] = ()


def no_problems(options: Any, hparams: BaseHParams) -> list[str]:
    return []


def no_state_shape(resolved: "Resolved") -> dict[str, Any]:
    return {}


def syncs_every_step(resolved: "Resolved") -> Optional[PeriodicSyncs]:
    return None


def every_option(resolved: "Resolved") -> dict[str, Any]:
    return dataclasses.asdict(resolved.options)


@dataclass(frozen=True)
class Family:
    """One optimizer family.

    - ``key``: its ``[commopt.<key>]`` table; ``options``: that table's dataclass (fields made with
      ``titan_commopt.options.option``);
    - ``presets``: ``{optimizer name: {option: value}}``, the names it registers;
    - ``build(named_params, topology, resolved, *, ledger=None)``: the optimizer (a ``CommOptimizer``);
      the optimizer class itself, whose constructor has exactly this signature;
    - ``r_bytes(shards, resolved, replicate_size)``: the analytic R payload per rank per step
      (a :class:`Bytes`), the formula the ledger is tested against and the comm report prints;
    - ``check(options, hparams)``: cross-field rules, one problem line each (no collectives);
    - ``state_shape(resolved)``: ``{option key: value}`` of what decides the optimizer state's keys,
      shapes and meaning (JSON values); a checkpoint records it and a resume with another value is
      refused (``titan/config/resume.py``). Every other option may change on resume;
    - ``periodic(resolved)``: its R syncs on a period (:class:`PeriodicSyncs`), or ``None`` when it
      sends alike on every step; the comm report prices the largest step from it;
    - ``settings(resolved)``: ``{option: value}`` of the resolved values behind its bytes, for the
      comm report's rows (default: every option);
    - ``s_bytes(shards, resolved)``: the family's own S payload per rank per step (what it sums over
      the shard groups itself, beside FSDP2's traffic), or ``None`` where it sends nothing over S
      that is priced;
    - ``summary``: one line for the docs;
    - ``preset_sources``: ``{optimizer name: where its values come from}`` (paper, section/table),
      printed beside each preset in ``docs/options.md``;
    - ``local_steps``: its replicas step alone between syncs, each on its own gradient (its optimizer
      a ``local.steps.LocalSteps``): ``[commopt] clip_scope = "auto"`` clips each by its own norm.

    Every ``options`` dataclass has ``lr`` (negative = unset) and ``lr_scale``: the registry turns
    them into the effective learning rate once (``resolve``), so builders read ``hparams.lr`` only.
    """

    key: str
    options: type
    presets: Mapping[str, Mapping[str, Any]]
    build: Callable[..., torch.optim.Optimizer]  # (named_params, topology, resolved, *, ledger=None)
    r_bytes: Callable[[Sequence[ShardShape], "Resolved", int], Bytes]
    check: Callable[[Any, BaseHParams], list[str]] = no_problems
    state_shape: Callable[["Resolved"], Mapping[str, Any]] = no_state_shape
    periodic: Callable[["Resolved"], Optional[PeriodicSyncs]] = syncs_every_step
    settings: Callable[["Resolved"], Mapping[str, Any]] = every_option
    summary: str = ""
    preset_sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    s_bytes: Optional[Callable[[Sequence[ShardShape], "Resolved"], Bytes]] = None
    local_steps: bool = False

    @property
    def section(self) -> str:
        return f"commopt.{self.key}"


@dataclass(frozen=True)
class Resolved:
    """``[optimizer]`` + ``[commopt.<family>]`` + the preset of ``name``: what a run trains with.

    ``options`` is the family's options dataclass with the preset filled in where the user left a
    key unset (``user_set`` names the keys the user set); ``hparams`` are ``[optimizer]``'s, with
    ``lr`` the effective initial learning rate (``options.lr`` when >= 0, else ``optimizer_lr`` ×
    ``options.lr_scale``); ``optimizer_lr`` is ``[optimizer] lr`` as given.
    """

    name: str
    family: Family
    options: Any
    hparams: BaseHParams
    user_set: frozenset[str] = frozenset()
    optimizer_lr: Optional[float] = None
    kernels: str = "auto"  # [commopt] kernels: "auto" | "torch" | "triton" (titan_commopt.kernels.use_triton)

    def preset_keys(self) -> list[str]:
        """Keys whose value came from the preset (not set by the user)."""
        return sorted(set(self.family.presets[self.name]) - self.user_set)

    def record(self) -> dict[str, Any]:
        """Plain-data form, for the log, TensorBoard and the checkpoint."""
        return {
            "optimizer": self.name,
            "family": self.family.key,
            "options": dataclasses.asdict(self.options),
            "hparams": dataclasses.asdict(self.hparams),
            "effective_lr": self.hparams.lr,
            "lr_from": self.lr_source(),
            "from_preset": self.preset_keys(),
            "state_shape": dict(self.family.state_shape(self)),
        }

    def lr_source(self) -> str:
        """Where the effective initial learning rate ``hparams.lr`` came from."""
        if getattr(self.options, "lr", -1.0) >= 0:
            return f"[{self.family.section}] lr"
        if self.optimizer_lr is None:
            return "[optimizer] lr"
        return f"[optimizer] lr {self.optimizer_lr!r} × lr_scale {self.options.lr_scale!r}"

    def describe(self) -> str:
        """One line per option, marking where each value came from; last the effective lr."""
        preset = set(self.preset_keys())
        lines = [f"{self.name} ([{self.family.section}], [optimizer] {dataclasses.asdict(self.hparams)}):"]
        for f in dataclasses.fields(self.options):
            source = "set" if f.name in self.user_set else "preset" if f.name in preset else "default"
            lines.append(f"  {f.name} = {getattr(self.options, f.name)!r} ({source})")
        lines.append(f"  effective lr = {self.hparams.lr!r} ({self.lr_source()})")
        return "\n".join(lines)
