"""Dion's routing and shapes: which parameters Dion runs, at which rank, on which side (transposed
or not), with which shard groups (:class:`Layout`), which scalar-optimizer parameters go over R
compressed (:func:`demo_synced`, :func:`scalar_replicator`), and the R payload that follows from it
(:func:`dion_r_bytes`, the family's byte formula). Everything here reads only shapes, placements and
the options, so the optimizer (``optimizer.py``) and the byte formula share one source of truth.
"""

import math
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_commopt import comm
from titan_commopt.compress.packing import WIRE_DTYPES, ValueCodec
from titan_commopt.compress.replicators import DeMoReplicator
from titan_commopt.topology import T, Topology

from .. import routing
from ..family import Bytes, Resolved, ShardShape
from ..shard_groups import Groups, mesh_dim_group
from .config import Config

try:  # FSDP2 over TP shards an already row-sharded dim again: a strided row split
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = ()  # type: ignore[assignment]

__all__ = [
    "KINDS", "route", "dion_rank", "compressed", "transposed", "initial_q", "r_slice", "Layout", "layout_of",
    "demo_synced", "scalar_replicator", "dion_r_bytes",
]

KINDS = ("dion", "embed", "head", "scalar")  # what route() returns, in the order param groups are made


def route(fqn: str, ndim: int, cfg: Config) -> str:
    """``"dion"``, ``"embed"``, ``"head"`` or ``"scalar"`` for a parameter: the shared rule
    (``optim/routing.py``), its 2-D matrices run by Dion."""
    kind = routing.route(fqn, ndim, cfg.embed_names, cfg.head_names)
    return "dion" if kind == "matrix" else kind


def demo_synced(kind: str, cfg: Config) -> bool:
    """Whether a parameter of routing ``kind`` goes over R through DeMo's wire (``scalar_sync = "demo"``):
    the embedding and the output head only. They are all but a sliver of the scalar part's bytes;
    norms and biases are small vectors every token moves, where top-k would drop coordinates for no
    saving, so they stay on the dense (exact) mean. The gradient, not the AdamW direction, is
    compressed: every replica decodes the same bytes, so the scalar optimizer's moments stay equal
    across replicas and only the error feedback e_r is per replica; with β = 1 nothing is dropped,
    only delayed (Σ_t q_t + e_T = Σ_t g_t). Values travel as numbers (``scalar_transfer_dtype``), as
    Adam normalizes G itself; the mean is over all W replicas (DeMo's eq. 6)."""
    return cfg.scalar_sync == "demo" and kind in ("embed", "head")


def scalar_replicator(shape: Sequence[int], cfg: Config, device: Any = None) -> DeMoReplicator:
    """DeMo's replicator for a local shard of ``shape`` of a :func:`demo_synced` parameter: DCT chunks of
    ``scalar_chunk``, the ``scalar_topk`` largest coefficients of each, values in
    ``scalar_transfer_dtype`` (never only their signs: a gradient mean, not a sign vote), indices
    bit-packed, averaged over all replicas (DeMo eq. 6). The optimizer and the byte formula both ask it."""
    codec = ValueCodec(False, WIRE_DTYPES[cfg.scalar_transfer_dtype], pack=True)
    return DeMoReplicator(tuple(shape), codec, cfg.scalar_chunk, cfg.scalar_topk, pack=True, device=device)


def dion_rank(m: int, n: int, cfg: Config) -> int:
    r = cfg.rank if cfg.rank > 0 else math.ceil(cfg.rank_fraction * min(m, n))
    return max(1, min(r, m, n))


def compressed(m: int, n: int, r: int, cfg: Config) -> bool:
    """Whether the R sync sends P and R instead of the gradient (decided on the global shape)."""
    if cfg.compress != "auto":
        return cfg.compress == "always"
    return (m + n) * r < m * n


def transposed(m: int, n: int, sharded: Sequence[tuple[str, int]], orientation: str) -> bool:
    """Whether a matrix of global shape (m, n) runs transposed (Xᵀ, Q of shape m×r), given the
    ``(role, tensor dim)`` of every mesh dim of size > 1 that shards it (role ``T`` for TP, anything
    else FSDP-like, S).

    ``orientation = "paper"``: never. ``"reference"``: microsoft/dion's rule
    (``Dion._get_dion_param_config``, also in its dion_reference.py): transposed when m < n; then,
    for a sharded matrix, not transposed when TP shards its rows or S its columns, and transposed
    when S shards its rows or TP its columns (the last test wins: S rows + TP columns, torchtitan's
    row-wise layers under FSDP, run transposed). The point of the rule: Q sits on the side S shards
    (its rows stay local) and P on the side TP shards (orthogonalized over TP).
    """
    if orientation != "reference":
        return False
    s_dims = {d for role, d in sharded if role != T}
    t_dims = {d for role, d in sharded if role == T}
    out = m < n
    if 0 in t_dims or 1 in s_dims:
        out = False
    if 0 in s_dims or 1 in t_dims:
        out = True
    return out


def initial_q(fqn: str, n: int, r: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (n, r) initial right factor: the same on every rank for the same (seed, fqn)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    return torch.randn(n, r, generator=gen, dtype=torch.float64).to(dtype)


def r_slice(n_loc: int, row_split: tuple[int, int]) -> tuple[int, int]:
    """``(start, rows)`` of slice ``index`` when R's ``n_loc`` rows are split over ``count`` row
    shards in ``ceil(n_loc / count)``-row chunks (``row_split = (index, count)``); the last slices
    may be short or empty."""
    index, count = row_split
    chunk = -(-n_loc // count)
    start = min(index * chunk, n_loc)
    return start, min(chunk, n_loc - start)



# ---- sharding layout of one matrix -----------------------------------------------------------------
@dataclass
class Layout:
    fqn: str
    m: int
    n: int
    r: int
    compressed: bool
    rows: Groups  # groups that shard X's rows (P is row-local over them)
    cols: Groups  # groups that shard X's columns (Q is row-sharded over them)
    col_offset: int  # first global column of the local shard
    q_placements: Optional[tuple] = None
    row_split: tuple[int, int] = (0, 1)  # this rank's R slice: (index, count) over the row groups
    transposed: bool = False  # run on Xᵀ: rows/cols/col_offset/splits above describe Xᵀ (P's rows = X's columns)
    col_split: tuple[int, int] = (0, 1)  # this rank's P slice (transposed only): (index, count) over the col groups

    @property
    def q_rows(self) -> int:
        """Rows of the full Q: the columns of the matrix Dion runs on (X or Xᵀ)."""
        return self.m if self.transposed else self.n


def _split_of(groups: Groups) -> tuple[int, int]:
    """``(index, count)`` of this rank over ``groups``, mixed radix, first group most significant."""
    index, count = 0, 1
    for _, group in groups:
        size = comm.group_size(group)
        index, count = index * size + comm.group_rank(group), count * size
    return index, count


def layout_of(fqn: str, p: torch.Tensor, topology: Topology, cfg: Config) -> Layout:
    m, n = p.shape
    r = dion_rank(m, n, cfg)
    lay = Layout(fqn, m, n, r, compressed(m, n, r, cfg), [], [], 0)
    if not isinstance(p, DTensor):
        lay.transposed = transposed(m, n, (), cfg.orientation)
        return lay
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    rows: Groups = []  # X's row groups and column groups
    cols: Groups = []
    sharded, strided_rows = [], False
    for i, pl in enumerate(p.placements):
        if pl.is_replicate() or mesh.size(i) == 1:
            continue
        if pl.is_partial():
            raise ValueError(f"Dion: {fqn} has a Partial placement on mesh dim {names[i]!r}")
        dim = pl.dim  # Shard and _StridedShard both carry it
        if isinstance(pl, _StridedShard):
            if dim == 1:
                raise NotImplementedError(
                    f"Dion: {fqn} is strided-sharded on its columns; shard FSDP on the dim TP does not "
                    "shard (as microsoft/dion requires)"
                )
            strided_rows = True
        role, group = mesh_dim_group(mesh, i, topology)
        sharded.append((role, dim))
        (rows if dim == 0 else cols).append((role, group))
    # A strided row split (FSDP over TP's column-wise layers, a layout microsoft/dion refuses) keeps the
    # paper's form: Q would have to follow X's non-contiguous rows.
    t = transposed(m, n, sharded, cfg.orientation) and not strided_rows
    lay.transposed = t
    lay.rows, lay.cols = (cols, rows) if t else (rows, cols)
    lay.row_split, lay.col_split = _split_of(lay.rows), _split_of(lay.cols)
    q_dim = 0 if t else 1  # the dim of X whose sharding Q's rows follow
    lay.q_placements = tuple(
        Shard(0) if isinstance(pl, Shard) and pl.dim == q_dim else Replicate() for pl in p.placements
    )
    if lay.cols:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
        lay.col_offset = int(offset[q_dim])
    return lay


# ---- the byte formula (Family.r_bytes) -----------------------------------------------------------
def dion_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """Dion, all-reduce (sent = received), in the parameter dtype: a compressed matrix costs
    ``(m_loc + slice rows)·r`` elements (P's local rows, and this rank's slice of R after the
    reduce-scatter over the row shards: :func:`r_slice`), an uncompressed matrix and every
    scalar-optimizer parameter its local shard. A matrix that runs transposed (:func:`transposed`)
    costs its slice of P (X's ``n_loc`` columns split over X's row shards) plus its slice of R (X's
    ``m_loc`` rows split over X's column shards): the same number as the paper's form wherever
    X's columns are not sharded.

    ``scalar_sync = "demo"``: the embedding's and head's shards go in one all-gather of DeMo payloads
    (the replicator's ``payload_bytes``: values + packed indices), ``recv = (W − 1)·sent`` by the ledger's
    all-gather convention; everything else is an all-reduce (recv = sent)."""
    if replicate_size <= 1:
        return Bytes()
    cfg = resolved.options
    total = gathered = 0
    for s in shards:
        elements = s.numel
        kind = route(s.fqn, len(s.shape), cfg)
        if demo_synced(kind, cfg):
            gathered += scalar_replicator(s.local, cfg).payload_bytes(1) if s.numel else 0
            continue
        if kind == "dion":
            m, n = s.shape
            r = dion_rank(m, n, cfg)
            if compressed(m, n, r, cfg):
                if transposed(m, n, s.sharded, cfg.orientation) and not s.strided:  # as layout_of
                    elements = (r_slice(s.local[1], s.row_split)[1] + r_slice(s.local[0], s.col_split)[1]) * r
                else:
                    elements = (s.local[0] + r_slice(s.local[1], s.row_split)[1]) * r
        total += elements * s.itemsize
    return Bytes(total + gathered, total + (replicate_size - 1) * gathered)

