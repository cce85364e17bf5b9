"""Whole matrices for Newton–Schulz on any mesh: each matrix brought to one owner rank of the groups
that cut it, orthogonalized there, its pieces sent back (the idea of microsoft/dion's megabatch and
torchtitan's DistMuon; our own code). Everything here reads shapes and placements only: the plan of
every exchange is made once, at construction, and :func:`exchange_bytes` prices it from the same
numbers, for the byte formula (``muon_shard_bytes``) the ledger is tested against.

**Cut groups.** A matrix (2-D, or each ``[m, n]`` slice of a 3-D stack) is *cut* by the mesh dims of
size > 1 that shard one of its two matrix dims (FSDP2's ``Shard(0)``, TP's column- and row-wise layers,
``_StridedShard``); a mesh dim that shards only the stack dim (experts) leaves every local slice whole.
Over the cut groups g = 1..G (sizes W_g, in mesh-dim order; this rank's index c_g in each) the ranks
hold P = Π W_g pieces, the piece of coordinate q a block (box) of the matrix, its place read from
torch's own shard arithmetic (a layout whose pieces do not tile the matrix is refused at construction).

**Owners.** The matrices of one *batch* (same global shape, placements and groups: the same pieces)
are items j = 0..k−1, item j owned by the rank of index o(j) = (base + j) mod P (mixed radix, first
group most significant), ``base`` counting the items of the batches before it, so the work spreads
over every rank of the groups. Stage g (g = 1..G) is one ``all_to_all`` over group g: whoever holds
pieces of item j sends all it holds of it to the member with index o_g(j); after stage G the owner
holds all P pieces, ordered with q_G most significant, and assembles the matrix. The pieces go back
by the same stages reversed. Memory: an owner holds its ~k/P whole matrices, the size of its own
pieces of all k: proportional to what is sent. Bytes per stage (both directions alike): what a rank
sends of the items it does not own at that stage plus what it receives of those it does (ledger
convention of ``comm.all_to_all``); a matrix nobody cuts (one rank, or replicated: a TP norm's
neighbours) moves nothing and is orthogonalized where it is.
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from titan_commopt import comm
from titan_commopt.topology import Topology

from ..family import Bytes, ShardShape
from ..shard_groups import Groups, group_key, mesh_dim_group
from .options import DTYPES, is_muon_matrix

__all__ = ["Cut", "cut_of", "BatchPlan", "plan_batch", "gather", "scatter", "exchange_bytes", "muon_shard_bytes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) of a piece within the unit


@dataclass(frozen=True)
class Cut:
    """How one parameter's matrices lie over the ranks that cut them.

    ``unit``: the tensor the owner assembles (the local extent along a 3-D stack's dim 0, the whole
    matrix along the last two dims); ``groups``/``sizes``/``coord``: the cut groups, their sizes,
    this rank's index in each; ``boxes``: every coordinate's piece (coordinates in mixed radix, the
    first group most significant), within ``unit``."""

    unit: tuple[int, ...]
    groups: Groups = field(default_factory=list)
    sizes: tuple[int, ...] = ()
    coord: tuple[int, ...] = ()
    boxes: tuple[Box, ...] = ()

    @property
    def cut(self) -> bool:
        return bool(self.groups)

    @property
    def key(self) -> tuple:
        """What two parameters share when their pieces lie alike (batched together)."""
        return (self.unit, group_key(self.groups), self.sizes, self.boxes)


def _coordinates(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate, mixed radix with the first entry most significant."""
    return list(itertools.product(*(range(w) for w in sizes)))


def _tiles(boxes: Sequence[Box], unit: Sequence[int]) -> bool:
    """Whether the boxes cover ``unit`` exactly once (volumes add up, no two overlap)."""
    if sum(math.prod(shape) for _, shape in boxes) != math.prod(unit):
        return False
    solid = [b for b in boxes if math.prod(b[1])]
    for (o1, s1), (o2, s2) in itertools.combinations(solid, 2):
        if all(a < c + w and c < a + v for a, v, c, w in zip(o1, s1, o2, s2)):
            return False
    return True


def cut_of(fqn: str, p: torch.Tensor, topology: Topology) -> Cut:
    """The :class:`Cut` of parameter ``p`` (a plain tensor or a DTensor on its S/T mesh)."""
    local = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
    matrix_dims = (p.ndim - 2, p.ndim - 1)
    unit = (*local[:-2], *p.shape[-2:])
    if not isinstance(p, DTensor):
        return Cut(unit)
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = p.device_mesh
    cut_dims = [i for i, pl in enumerate(p.placements)
                if mesh.size(i) > 1 and not (pl.is_replicate() or pl.is_partial()) and pl.dim in matrix_dims]
    if not cut_dims:
        return Cut(unit)
    if any(pl.is_partial() for pl in p.placements):
        raise ValueError(f"Muon: {fqn} has a Partial placement")
    groups = [mesh_dim_group(mesh, i, topology) for i in cut_dims]
    sizes = tuple(mesh.size(i) for i in cut_dims)
    own = list(mesh.get_coordinate())
    coord = tuple(own[i] for i in cut_dims)
    boxes = []
    for q in _coordinates(sizes):
        at = list(own)
        for i, qi in zip(cut_dims, q):
            at[i] = qi
        shape, offset = _compute_local_shape_and_global_offset(p.shape, mesh.shape, at, p.placements)
        # along the stack dim the unit is this rank's own slab: offsets relative to it
        rel = tuple(0 if d < p.ndim - 2 else int(o) for d, o in enumerate(offset))
        boxes.append((rel, tuple(int(s) for s in shape)))
    if not _tiles(boxes, unit) or boxes[_coordinates(sizes).index(coord)][1] != local:
        raise ValueError(
            f"Muon: {fqn}'s shards {tuple(str(pl) for pl in p.placements)} over mesh {tuple(mesh.shape)} are not "
            "blocks that tile its matrices; shard FSDP on the dim tensor parallelism does not shard"
        )
    return Cut(unit, groups, sizes, coord, tuple(boxes))


# ---- the exchange of one batch ------------------------------------------------------------------
@dataclass
class _Stage:
    """One stage of the gather (and, reversed, of the scatter) over one cut group."""

    role: str
    group: Any
    send_counts: list[int]  # elements to each member, gather direction
    recv_counts: list[int]
    order: Optional[torch.Tensor]  # the held rows in send order (by destination, then item); None: as held
    widths: list[int]  # per source member: the held width of an item there (the gathered row's blocks)
    held: int  # the held width of an item here before the stage
    rows_before: int  # items held before the stage
    rows_after: int  # items held after it


@dataclass
class BatchPlan:
    """The exchange of one batch of ``k`` items: its gather stages, and the owner's assembly (the
    boxes in the order of the gathered row); ``owned`` the items this rank orthogonalizes."""

    k: int
    unit: tuple[int, ...]
    local: tuple[int, ...]
    stages: list[_Stage]
    boxes: list[Box]  # in the order of the gathered row's columns
    owned: list[int]


def _owner(index: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for w in reversed(sizes):
        out.append(index % w)
        index //= w
    return tuple(reversed(out))


def _held_width(volumes: dict, coord: Sequence[int], level: int) -> int:
    """Elements of one item a rank of coordinate ``coord`` holds after stage ``level``: the pieces
    of every coordinate that agrees with it beyond ``level``."""
    rest = tuple(coord[level:])
    return sum(v for q, v in volumes.items() if q[level:] == rest)


def plan_batch(cut: Cut, k: int, base: int, device: torch.device) -> BatchPlan:
    """The exchange of a batch of ``k`` items lying as ``cut``, item j owned by index ``(base + j) mod P``."""
    local = cut.boxes[_coordinates(cut.sizes).index(cut.coord)][1] if cut.cut else cut.unit
    if not cut.cut:
        return BatchPlan(k, cut.unit, local, [], [((0,) * len(cut.unit), cut.unit)], list(range(k)))
    coords = _coordinates(cut.sizes)
    volumes = {q: math.prod(shape) for q, (_, shape) in zip(coords, cut.boxes)}
    P = len(coords)
    owners = [_owner((base + j) % P, cut.sizes) for j in range(k)]
    me = cut.coord
    rows = list(range(k))  # the items held, in item order
    stages = []
    for g, ((role, group), w) in enumerate(zip(cut.groups, cut.sizes)):
        dest = [owners[j][g] for j in rows]
        order = sorted(range(len(rows)), key=lambda i: (dest[i], i))
        held = _held_width(volumes, me, g)
        kept = [j for j in rows if owners[j][g] == me[g]]
        widths = [_held_width(volumes, (*me[:g], s, *me[g + 1:]), g) for s in range(w)]
        stages.append(_Stage(
            role, group,
            send_counts=[dest.count(s) * held for s in range(w)],
            recv_counts=[len(kept) * widths[s] for s in range(w)],
            order=None if order == list(range(len(rows))) else torch.tensor(order, device=device),
            widths=widths, held=held, rows_before=len(rows), rows_after=len(kept),
        ))
        rows = kept
    # the gathered row's columns: q_G most significant, ..., q_1 least
    gathered = sorted(coords, key=lambda q: tuple(reversed(q)))
    return BatchPlan(k, cut.unit, local, stages, [cut.boxes[coords.index(q)] for q in gathered], rows)


def gather(plan: BatchPlan, pieces: torch.Tensor, ledger: Optional[comm.CommLedger]):
    """A task step by step: ``pieces`` ``[k, local numel]`` (this rank's piece of every item) → the
    whole units this rank owns, ``[len(owned), *unit]``. Yields each stage's collective."""
    held = pieces
    for st in plan.stages:
        send = held if st.order is None else held.index_select(0, st.order)
        received = yield comm.all_to_all(send, st.send_counts, st.recv_counts, st.role, st.group,
                                         ledger=ledger, async_op=True)
        blocks = received.split(st.recv_counts)
        held = torch.cat([b.view(st.rows_after, width) for b, width in zip(blocks, st.widths)], dim=1)
    whole = held.new_empty((len(plan.owned), *plan.unit))
    column = 0
    for offset, shape in plan.boxes:
        size = math.prod(shape)
        view = whole[(slice(None), *(slice(o, o + s) for o, s in zip(offset, shape)))]
        view.copy_(held[:, column: column + size].view(len(plan.owned), *shape))
        column += size
    return whole


def scatter(plan: BatchPlan, whole: torch.Tensor, ledger: Optional[comm.CommLedger]):
    """The inverse of :func:`gather`: the owned units → this rank's piece of every item, ``[k, *local]``."""
    owned = len(plan.owned)
    held = torch.cat([whole[(slice(None), *(slice(o, o + s) for o, s in zip(offset, shape)))].reshape(owned, math.prod(shape))
                      for offset, shape in plan.boxes], dim=1)
    for st in reversed(plan.stages):
        send = torch.cat([b.reshape(-1) for b in held.split(st.widths, dim=1)])
        received = yield comm.all_to_all(send, st.recv_counts, st.send_counts, st.role, st.group,
                                         ledger=ledger, async_op=True)
        rows = received.view(st.rows_before, st.held)
        held = rows if st.order is None else torch.empty_like(rows).index_copy_(0, st.order, rows)
    return held.view(plan.k, *plan.local)


# ---- the price of it (the byte formula's) -------------------------------------------------------
def exchange_bytes(shards: Sequence[ShardShape], is_matrix, itemsize: int) -> dict[str, Bytes]:
    """Per role (S, T), the payload per rank of one step's gathers and scatters of the matrices among
    ``shards`` (``is_matrix(shard)``: routed to Muon; all of them stepping), batched and owned as the
    optimizer batches and owns them, ``itemsize`` bytes per element on the wire. The cut of a shard
    is read from ``ShardShape.sharded`` (its mesh dims of size > 1 on dims 0 and 1 of a 2-D matrix,
    ``mesh_sizes``: their sizes) with pieces as torch's ``Shard`` makes them (a strided split has the
    same pieces where it divides evenly). A 3-D stack moves nothing where only its stack dim is split;
    one that TP cuts on a matrix dim is exchanged but not priced (``ShardShape`` sees dims 0 and 1)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    batches: dict[tuple, list[ShardShape]] = {}
    for s in shards:
        if is_matrix(s) and len(s.shape) == 2 and s.sharded:
            sizes = s.mesh_sizes or tuple(count for count in (s.row_split[1], s.col_split[1]) if count > 1)
            batches.setdefault((s.shape, s.sharded, sizes, s.itemsize), []).append(s)
    out: dict[str, Bytes] = {}
    base = 0
    for (shape, sharded, sizes, _), members in batches.items():
        placements = [Shard(dim) for _, dim in sharded]
        coords = _coordinates(sizes)
        volumes = {q: math.prod(_compute_local_shape_and_global_offset(shape, sizes, list(q), placements)[0])
                   for q in coords}
        first = members[0]
        me = _rank_coordinate(first, sharded, sizes)
        P = len(coords)
        for j in range(len(members)):
            owner = _owner((base + j) % P, sizes)
            for g, (role, _) in enumerate(sharded):
                if owner[:g] != me[:g]:
                    continue  # this rank holds nothing of the item at stage g
                if owner[g] == me[g]:  # receives the others' holdings, sends them back
                    moved = sum(_held_width(volumes, (*me[:g], x, *me[g + 1:]), g)
                                for x in range(sizes[g]) if x != me[g])
                else:  # sends its holding, gets it back
                    moved = _held_width(volumes, me, g)
                got = out.get(role, Bytes())
                out[role] = got + Bytes(moved * itemsize, moved * itemsize)
        base += len(members)
    return out


def _rank_coordinate(s: ShardShape, sharded, sizes) -> tuple[int, ...]:
    """This rank's index in each cut group, from the shard's (index, count) splits (mixed radix, the
    first mesh dim most significant per tensor dim)."""
    out = []
    remaining = {0: s.row_split, 1: s.col_split}
    for (_, dim), w in reversed(list(zip(sharded, sizes))):
        index, count = remaining[dim]
        out.append(index % w)
        remaining[dim] = (index // w, count // w)
    return tuple(reversed(out))


def muon_shard_bytes(shards: Sequence[ShardShape], cfg: Any, role: str = "S") -> Bytes:
    """The S (or T) payload per rank per step of the Muon step of ``cfg`` (its ``muon_*`` and routing
    options): :func:`exchange_bytes` of the shards routed to Muon, in ``muon_dtype``."""
    itemsize = torch.empty((), dtype=DTYPES[cfg.muon_dtype]).element_size()
    per_role = exchange_bytes(shards, lambda s: is_muon_matrix(s.fqn, s.shape, cfg), itemsize)
    return per_role.get(role, Bytes())
