"""Dion: distributed orthonormalized updates (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates").

Per 2-D weight ``X ∈ R^{m×n}`` (``nn.Linear`` layout: m = out features = rows, n = in features):

    B = M + G                  # G: this replica's mean gradient, never all-reduced over R
    P = orth(B Q)              # B Q all-reduce-meaned over R *before* orthogonalization
    R = Bᵀ P                   # all-reduce-meaned over R
    M = B − (1 − μ) P Rᵀ       # error feedback: M keeps what the rank-r update missed
    Q = colnorm(R)
    X = X (1 − η λ) − η sqrt(m/n) P Qᵀ

Distributed exactly as Algorithm 2 / Theorem 2.1 (the iterates equal the centralized ones):

- R (``dp_replicate``): only P (local rows × r) and R (local columns × r) are averaged, one fused
  collective each per step and shape batch (below), instead of the ``m_loc·n_loc`` gradient. P's rows are
  already sharded. R is needed whole on every row shard, so where X's rows are sharded (over
  ``k`` ranks in all) R is reduced hierarchically: a reduce-scatter over the row groups (the sum
  over row shards, fast link) leaves each rank one ``ceil(n_loc/k)``-row slice, only that slice is
  averaged over R, and an all-gather over the row groups puts the averaged R back together — the
  same sums in another order (Theorem 2.1). Per matrix and rank: ``(m_loc + ceil(n_loc/k))·r``
  elements (fewer on a rank whose slice overhangs n_loc), ``(m + n)·r/k`` when k divides m and n,
  hence below the gradient shard ``m·n/k`` wherever compression pays (up to rounding). Both the
  reduce-scatter and the all-gather are one fused collective per row group for all matrices of a
  shape batch. This
  "compressed" path is used only where it pays on the global shape,
  ``(m + n)·r < m·n`` (the reference's rule; ``compress = "auto"``); otherwise — always at full rank —
  the gradient itself is averaged over R (one fused collective for all such matrices) and every
  replica runs the same centralized update. ``traffic.dion_r_bytes`` follows the same rule.
- S/T (weight sharding, read from each DTensor's placements): a mesh dim that shards dim 0 (FSDP2's
  ``Shard(0)``, also ``_StridedShard(0)`` under TP: the row order never matters) makes P row-local;
  P is orthogonalized without gathering it by Cholesky-QR (r×r Gram all-reduce-sum, twice:
  CholeskyQR2; retried in float64 where P's dtype is not enough), falling back to a QR of P
  gathered over the row groups (m×r, never m×n) when the Gram is not positive definite or P is
  ill-conditioned even so; ``R = Σ_i B_iᵀ P_i`` is an all-reduce-sum. A mesh dim that shards dim 1 (TP's ``Shard(1)``, row-wise parallel layers)
  makes Q column-sharded: ``P = Σ_j B_j Q_j`` is an all-reduce-sum and the column norms of R are
  summed (r numbers). No rank ever materializes an m×n matrix. Mesh dims named ``tp`` are the T
  role (``topology.tp``), every other sharding dim is S (``topology.shard``). Each S/T reduction
  (Grams, P's column sums, R's column norms) is one fused collective for all matrices sharing the
  same groups; R's row sums go per shape batch.
- Q starts identical on every rank: drawn from the full (n, r) shape with a generator seeded by
  (``seed``, FQN), then sliced to the local columns. It is kept as a DTensor (rows sharded like X's
  columns, replicated elsewhere) so DCP checkpoints it correctly.

Everything that is not a matrix of a transformer block goes to a scalar optimizer (AdamW or Lion),
as the paper and microsoft/dion do: embeddings (``tok_embeddings``) and the output head (``output``)
with weight decay 0 (the head with a smaller lr for Lion: ``1/sqrt(d_in)``), norms, biases and any
non-2-D tensor with the base weight decay. Their gradients are averaged over R (FSDP2 does not, the
adapter hides R from it) in one fused collective.

GPU fitness and overlap. Matrices of the same param group, shape, rank and layout form a shape
batch, computed stacked: everything r-sized (Grams, Cholesky factors, triangular solves, column
norms, the new Q) is one kernel per batch, the large products (B Q, Bᵀ P and the two rank-r
updates) one matmul per matrix written into the batch's stacked buffers. CholeskyQR2 keeps its
failure flags on the device; one host synchronization per step reads them all (a step where some P
needs the fallback synchronizes again for it). The R collectives are issued async in the order they
are needed: the uncompressed matrices' gradients, then each batch's P mean as soon as its P exists
(running while the next batches compute theirs), each batch's R mean as soon as its Bᵀ P exists
(running while the next batches compute theirs), and last the scalar gradients' mean (running while
the matrices are updated). Overlap changes no value: every result is waited for before it is read.

A Dion column whose R is exactly zero after every sum moves nothing (its P column is masked, its
Q column kept): with B = M + G zero everywhere, X changes by weight decay alone (microsoft/dion's
rule; the QR of an all-zero P would otherwise invent directions).

Orientation (``orientation``). The paper writes every matrix as X (m×n) with Q n×r. microsoft/dion,
whose runs are the ones to match, runs some matrices transposed — on Xᵀ, with Q m×r, the error
feedback and the update transposed back, the scale still sqrt(m/n) of X: every wide matrix (m < n),
and for a sharded one the side its sharding picks (:func:`transposed`; FSDP rows or TP columns
sharded: transposed, so Q follows the rows FSDP keeps local and P the side TP orthogonalizes over).
The two forms are different algorithms (results differ by ~1e-2 relative after a few steps), so
``"reference"`` is the default (fidelity to the authors' code) and ``"paper"`` keeps the paper's form.
r, sqrt(m/n) and the R payload do not depend on it: transposed, P's partial sums over X's row shards
go through the same reduce-scatter / R-mean-of-a-slice / all-gather as R's, so a rank still sends
``(m + n)·r/k`` (``traffic.dion_r_bytes`` follows both forms). One layout keeps the paper's form
under either setting: rows split by ``_StridedShard`` (FSDP over TP's column-wise layers), which
microsoft/dion refuses and where Q could not follow X's non-contiguous rows.

Mixed precision (``mixed_precision``). As microsoft/dion's mixed-precision setting: M, Q and the
scalar optimizer's moments are stored in bfloat16 (half the optimizer memory of float32 state);
orthogonalization and column norms always run in float32 at least. Unlike the reference, which
multiplies in the storage dtype, the products (B Q, Bᵀ P, the rank-r corrections) run in the
parameter dtype, one matrix converted at a time, so P and R go over the wire in the parameter
dtype (the byte formula does not change) and bf16 rounding enters only where state is stored.
torch's ``load_state_dict`` would cast the state to the parameter dtype; Dion casts it back to its
storage dtype (converting, with a warning, a state saved under the other setting). Both options
shape the checkpointed state (``state_shape``): a resume that changes them is refused.

Momenta (M, and the scalar optimizer's moments on the compressed path's siblings) differ across
replicas on the compressed path — by design (decoupled momentum); checkpoints must keep them per
replica. Gradient scale: ``topology.replica_grad`` (see topology.py).
"""

import dataclasses
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_commopt import comm
from titan_commopt.options import option
from titan_commopt.topology import R, T, Topology

from . import kernels
from .base import CommOptimizer, named_params
from .common import LR_SCALE_HELP, BaseHParams, NamedParams, local, mesh_dim_role, replica_grad
from .family import Family, Resolved
from .orthogonalize import cholesky_qr2, orthogonalize, orthonormalize_stacked
from .shard_groups import Groups, buckets as _buckets, group_key as _group_key, sum_over as _sum_over
from .traffic import dion_r_bytes

try:  # FSDP2 over TP shards an already row-sharded dim again: a strided row split
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = ()  # type: ignore[assignment]

__all__ = [
    "Config", "PRESETS", "Dion", "FAMILY", "build", "r_slice", "route", "dion_rank", "compressed", "initial_q",
    "transposed", "orient_",
]

logger = logging.getLogger(__name__)


@dataclass
class Config:
    """``[commopt.dion]``."""

    rank: int = option(0, "Rank r of every Dion matrix update; 0 = use rank_fraction.", ge=0)
    rank_fraction: float = option(
        0.25, "r = ceil(rank_fraction · min(m, n)) when rank = 0 (1.0 = full rank).", gt=0.0, le=1.0
    )
    mu: float = option(0.95, "Momentum decay μ of the error-feedback momentum.", ge=0.0, lt=1.0)
    orthogonalize: str = option(
        "cholesky_qr",
        "How P is orthonormalized: cholesky_qr (CholeskyQR2 with an r×r Gram all-reduce over the "
        "row shards; falls back to qr when ill-conditioned) or qr (Householder QR; P is gathered "
        "over row shards, m×r).",
        choices=("qr", "cholesky_qr"),
    )
    compress: str = option(
        "auto",
        "Replicate (R) sync of Dion matrices: auto = all-reduce P and R ((m+n)·r) only where "
        "(m+n)·r < m·n, else the full gradient; always / never force one path.",
        choices=("auto", "always", "never"),
    )
    scalar_optimizer: str = option(
        "adamw", "Optimizer of embeddings, output head, norms, biases.", choices=("adamw", "lion")
    )
    scalar_lr_scale: float = option(1.0, "lr of the scalar optimizer = [optimizer] lr × this.", gt=0.0)
    lr: float = option(
        -1.0, "Initial learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and over "
        "the preset's lr_scale) when set. scalar_lr_scale and head_lr_scale multiply this effective lr.",
    )
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)
    head_lr_scale: float = option(
        0.0,
        "Extra lr factor of the output head; 0 = auto: 1/sqrt(d_in) with Lion (microsoft/dion), "
        "1 with AdamW.",
        ge=0.0,
    )
    embed_names: str = option(
        "tok_embeddings,embed_tokens,wte", "Comma-separated module names routed as embeddings."
    )
    head_names: str = option("output,lm_head", "Comma-separated module names routed as the output head.")
    colnorm_eps: float = option(1e-8, "ε added to the column norms of R (as microsoft/dion).", ge=0.0)
    seed: int = option(0, "Seed of the initial Q (identical on every rank).", ge=0)
    orientation: str = option(
        "reference",
        "Which side of each matrix Q lives on: reference = microsoft/dion's rule (a wide matrix, m < n, "
        "runs transposed; a sharded one is oriented by its sharding: transposed when FSDP (S) shards "
        "its rows or TP its columns, not when FSDP shards its columns or TP its rows); paper = the "
        "paper's form for every matrix (Q n×r). Results differ by ~1e-2 relative after a few steps; "
        "sqrt(m/n), r and the R-sync bytes do not change.",
        choices=("reference", "paper"),
    )
    mixed_precision: bool = option(
        False,
        "Store Dion's momentum and Q and the scalar optimizer's moments in bfloat16 (microsoft/dion's "
        "mixed-precision setting); products, orthogonalization and column norms still run in the "
        "parameter dtype (float32 at least), and P and R go over the wire in the parameter dtype.",
    )


# lr_scale: the quality study's best lr ÷ AdamW-HSDP's best (docs/benchmarks.md §4).
PRESETS: dict[str, dict[str, Any]] = {"Dion": {"lr_scale": 1.92}}

# Where each preset's values come from (docs/options.md prints it beside the preset).
PRESET_SOURCES: dict[str, str] = {
    "Dion": "Dion (Ahn et al.): Algorithms 1–2 (error-feedback momentum μ, rank r, √(m/n) scale), §5 (rank "
    "d/4 to d/16; AdamW for embedding, head, norms); microsoft/dion's Dion class: μ = 0.95, ε = 1e-8, the "
    "transposed orientation of wide and row-sharded matrices, fp32 orthogonalization. One difference by "
    "choice: rank_fraction = 0.25 where microsoft/dion defaults to 1.0 (full rank, no compression of R).",
}


# ---- routing and shapes (shared by build and the byte formula, traffic.dion_r_bytes) ----------------
_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"}


def _names(csv: str) -> set[str]:
    return {s.strip() for s in csv.split(",") if s.strip()}


def route(fqn: str, ndim: int, cfg: Config) -> str:
    """``"dion"``, ``"embed"``, ``"head"`` or ``"scalar"`` for a parameter, by FQN and rank.

    Embedding and head are found by module name (any dotted component), because by shape they are
    indistinguishable from block matrices.
    """
    parts = [p for p in fqn.split(".")[:-1] if p not in _WRAPPERS]
    if _names(cfg.head_names).intersection(parts):
        return "head"
    if _names(cfg.embed_names).intersection(parts):
        return "embed"
    return "dion" if ndim == 2 else "scalar"


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
class _Layout:
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


def _group_for(mesh: Any, dim: int, topology: Topology) -> tuple[str, Any]:
    role = mesh_dim_role(mesh, dim)  # by the mesh dim's name, as ShardShape.of (the byte formula's)
    candidate = topology.tp if role == T else topology.shard
    own = mesh.get_group(dim)
    # Prefer the Topology's group (the roles' single source of truth) when it is the same set of ranks.
    if candidate is not None and comm.group_ranks(candidate) == comm.group_ranks(own):
        return role, candidate
    return role, own


def _split_of(groups: Groups) -> tuple[int, int]:
    """``(index, count)`` of this rank over ``groups``, mixed radix, first group most significant."""
    index, count = 0, 1
    for _, group in groups:
        size = comm.group_size(group)
        index, count = index * size + comm.group_rank(group), count * size
    return index, count


def _layout(fqn: str, p: torch.Tensor, topology: Topology, cfg: Config) -> _Layout:
    m, n = p.shape
    r = dion_rank(m, n, cfg)
    lay = _Layout(fqn, m, n, r, compressed(m, n, r, cfg), [], [], 0)
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
        role, group = _group_for(mesh, i, topology)
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


def orient_(opt: "Dion", flags: dict[str, bool]) -> None:
    """Force the orientation of the unsharded matrices named in ``flags`` (fqn → transposed), before
    the first step: a single-process simulation of a sharded run under ``orientation = "reference"``
    runs each matrix the way the sharded run oriented it."""
    for p, lay in opt._layouts.items():
        if lay.fqn in flags:
            if lay.rows or lay.cols or opt.state[p]:
                raise ValueError(f"Dion.orient_: {lay.fqn} is sharded or already has state")
            lay.transposed = bool(flags[lay.fqn])


# ---- the R reduction -------------------------------------------------------------------------------
def _scatter_level(buffers: list[torch.Tensor], role: str, group: Any) -> list[torch.Tensor]:
    """One fused reduce-scatter over ``group`` for all the flat ``buffers``: each keeps this rank's
    1/W block, summed over the group."""
    w = comm.group_size(group)
    sizes = [b.numel() // w for b in buffers]
    mine = comm.reduce_scatter(torch.cat([b.view(w, k) for b, k in zip(buffers, sizes)], dim=1), role, group)
    return list(mine.split(sizes))


def _gather_level(buffers: list[torch.Tensor], role: str, group: Any) -> list[torch.Tensor]:
    """The inverse of :func:`_scatter_level`: one fused all-gather, each buffer becomes the W ranks'
    blocks in rank order."""
    sizes = [b.numel() for b in buffers]
    gathered = comm.all_gather(torch.cat(buffers), role, group)
    return [g.reshape(-1) for g in gathered.split(sizes, dim=1)]


def _reduce_r(Rs: list[torch.Tensor], lays: list[_Layout], replicate: Any, syncs_r: bool) -> None:
    """In place: R = Σ_i B_iᵀ P_i over the row groups, then, for compressed matrices, its mean over R
    (:func:`_reduce_r_async`, waited for at once)."""
    _reduce_r_async(Rs, lays, replicate, syncs_r)()


def _reduce_r_async(
    Rs: list[torch.Tensor], lays: list[_Layout], replicate: Any, syncs_r: bool
) -> Callable[[], None]:
    """R = Σ_i B_iᵀ P_i over the row groups, then, for compressed matrices, its mean over R; in place,
    complete once the returned function has run. The row-group collectives run now; the R mean is
    issued async and waited for by the returned function (then the all-gathers), so the caller can
    compute meanwhile (Dion overlaps it with the next shape batch's Bᵀ P).

    A compressed matrix whose rows are sharded goes hierarchically: a reduce-scatter over each of its
    row groups leaves this rank the ``row_split`` slice of the sum (ceil(n_loc/k) rows, zero-padded),
    only that slice's real rows join the one fused R all-reduce, and all-gathers over the row groups
    (in reverse order) rebuild the averaged R everywhere. The split runs over *all* row groups (S,
    and T where TP shards the rows too, e.g. FSDP over a column-wise TP layer): only then is the R
    payload ``(m_loc + ceil(n_loc/k))·r ≈ (m + n)·r/k`` below the gradient shard ``m·n/k`` for every
    layout that compresses — an S-only split would still send ``n/|S|`` rows against a shard of
    ``m·n/(|S|·|T|)`` — and on each (fast) row group the reduce-scatter + all-gather pair moves what
    the all-reduce it replaces moved.
    """
    split = [syncs_r and lay.compressed and bool(lay.rows) for lay in lays]
    plain = [i for i, sp in enumerate(split) if not sp]
    _sum_over([Rs[i] for i in plain], [lays[i].rows for i in plain])
    scattered, mine = [], {}
    for groups, members in _buckets([lay.rows if sp else [] for lay, sp in zip(lays, split)]):
        bufs = []
        for i in members:
            (n_loc, r), count = Rs[i].shape, lays[i].row_split[1]
            buf = Rs[i].new_zeros(-(-n_loc // count) * count * r)
            buf[: n_loc * r] = Rs[i].reshape(-1)
            bufs.append(buf)
        for role, group in groups:
            bufs = _scatter_level(bufs, role, group)
        scattered.append((groups, members, bufs))
        for i, buf in zip(members, bufs):
            mine[i] = buf[: r_slice(Rs[i].shape[0], lays[i].row_split)[1] * Rs[i].shape[1]]
    # E_DP[R̂]: whole R of the unsplit compressed matrices, this rank's slice of the others: one collective.
    means = [mine.get(i, Rs[i]) for i, lay in enumerate(lays) if lay.compressed]
    pending = comm.all_reduce_fused([t for t in means if t.numel()], R, replicate, op="mean", async_op=True)

    def finish() -> None:
        pending.wait()
        for groups, members, bufs in scattered:
            for role, group in reversed(groups):
                bufs = _gather_level(bufs, role, group)
            for i, buf in zip(members, bufs):
                Rs[i].copy_(buf[: Rs[i].numel()].view_as(Rs[i]))

    return finish


# Single-matrix forms of the orthogonalization, which tests/test_dion.py reaches for.
def _cholesky_qr(P: torch.Tensor, rows: Groups) -> Optional[torch.Tensor]:
    return cholesky_qr2([P], [rows])[0]


def _orthogonalize(P: torch.Tensor, rows: Groups, method: str) -> torch.Tensor:
    return orthogonalize([P], [rows], method)[0]


def _oriented(t: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """``t`` (X's local layout) as the matrix Dion runs on: its transpose (a view) where ``lay`` is
    transposed."""
    return t.T if lay.transposed else t


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


_STORED = ("momentum", "Q", "exp_avg", "exp_avg_sq")  # the state kept in the storage dtype


def _report_converted_state(opt: "Dion", state_dict: dict) -> None:
    """Load hook: say so when the loaded state's dtypes are not this run's storage dtypes (a
    checkpoint written with another ``mixed_precision``); they are converted on load."""
    want = torch.bfloat16 if opt.cfg.mixed_precision else None
    seen = {v.dtype for st in state_dict.get("state", {}).values() for k, v in st.items()
            if k in _STORED and isinstance(v, torch.Tensor) and v.is_floating_point()}
    if seen and (seen != {want} if want is not None else torch.bfloat16 in seen):
        logger.warning(
            "Dion: loaded optimizer state in %s, this run stores it in %s (mixed_precision = %s): converted",
            ", ".join(sorted(str(d) for d in seen)), want or "the parameter dtype", opt.cfg.mixed_precision,
        )


def _restore_storage_dtypes(opt: "Dion") -> None:
    """Load hook: torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype;
    put M, Q and the scalar moments back into this run's storage dtype."""
    for p, st in opt.state.items():
        dtype = opt._storage_dtype(p)
        for k in _STORED:
            if k in st and isinstance(st[k], torch.Tensor) and st[k].dtype != dtype:
                st[k] = st[k].to(dtype)


# ---- the optimizer ---------------------------------------------------------------------------------
class Dion(CommOptimizer):
    """Dion for 2-D matrices (``algorithm = "dion"`` groups) plus AdamW/Lion for the rest.

    Param groups carry ``algorithm`` (``dion``/``adamw``/``lion``), ``lr``, ``weight_decay`` and
    ``mu`` / ``betas``, ``eps``. Pass ``(name, param)`` pairs so each matrix gets its own seeded Q.
    """

    params_replica_local = False  # every replica applies the same averaged P and R: parameters agree

    def __init__(
        self,
        params: Any,
        topology: Optional[Topology] = None,
        *,
        lr: float = 0.01,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        rank: int = 0,
        rank_fraction: float = 0.25,
        orthogonalize: str = "cholesky_qr",
        compress: str = "auto",
        colnorm_eps: float = 1e-8,
        seed: int = 0,
        orientation: str = "reference",
        mixed_precision: bool = False,
    ) -> None:
        defaults = dict(lr=lr, mu=mu, betas=betas, eps=eps, weight_decay=weight_decay, algorithm="dion")
        super().__init__(params, topology or Topology.single(), None, defaults)
        self.cfg = Config(
            rank=rank, rank_fraction=rank_fraction, orthogonalize=orthogonalize, compress=compress,
            colnorm_eps=colnorm_eps, seed=seed, orientation=orientation, mixed_precision=mixed_precision,
        )
        self.register_load_state_dict_pre_hook(_report_converted_state)
        self.register_load_state_dict_post_hook(_restore_storage_dtypes)
        self._layouts: dict[torch.Tensor, _Layout] = {}
        for group in self.param_groups:
            if group["algorithm"] not in ("dion", "adamw", "lion"):
                raise ValueError(f"Dion: unknown algorithm {group['algorithm']!r}")
        for group, name, p in named_params(self.param_groups):  # the name seeds the matrix's Q
            if group["algorithm"] != "dion":
                continue
            if p.ndim != 2:
                raise ValueError(f"Dion: {name} has {p.ndim} dims; Dion takes 2-D matrices only")
            self._layouts[p] = _layout(name, p, self.topology, self.cfg)

    # -- state -------------------------------------------------------------------------------------
    def _storage_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of p's optimizer state: bfloat16 under ``mixed_precision``, else p's."""
        return torch.bfloat16 if self.cfg.mixed_precision and p.is_floating_point() else p.dtype

    def _init_dion_state(self, p: torch.Tensor, lay: _Layout) -> dict[str, Any]:
        state = self.state[p]
        dtype = self._storage_dtype(p)
        state["momentum"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        x = local(p)
        q_full = initial_q(lay.fqn, lay.q_rows, lay.r, self.cfg.seed, dtype=dtype)
        q_local_rows = x.shape[0] if lay.transposed else x.shape[1]
        q_local = q_full[lay.col_offset : lay.col_offset + q_local_rows].to(x.device).contiguous()
        if isinstance(p, DTensor):
            state["Q"] = DTensor.from_local(
                q_local, p.device_mesh, lay.q_placements, run_check=False,
                shape=torch.Size((lay.q_rows, lay.r)), stride=(lay.r, 1),
            )
        else:
            state["Q"] = q_local
        return state

    def _init_scalar_state(self, p: torch.Tensor, algorithm: str) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        dtype = self._storage_dtype(p)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if algorithm == "adamw":
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _replica_grad(self, p: torch.Tensor, needs_copy: bool) -> torch.Tensor:
        # The fused R mean writes back in place; don't let it rewrite p.grad behind the caller.
        return replica_grad(p, self.topology, copy=needs_copy)

    # -- step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        topo = self.topology
        syncs_r = topo.replicate_size > 1
        scalars: list[tuple[torch.Tensor, dict, torch.Tensor]] = []
        matrices: list[tuple[torch.Tensor, dict, _Layout, torch.Tensor]] = []
        full_matrices: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["algorithm"] == "dion":
                    lay = self._layouts[p]
                    g = self._replica_grad(p, needs_copy=syncs_r and not lay.compressed)
                    matrices.append((p, group, lay, g))
                    if not lay.compressed:
                        full_matrices.append(g)
                else:
                    scalars.append((p, group, self._replica_grad(p, needs_copy=syncs_r)))

        # R collectives in the order they are needed (one process group runs them in issue order):
        # the gradients of uncompressed matrices, P and R of each shape batch (inside _dion_update),
        # then the scalar parameters' gradients, which are only needed at the very end.
        full = comm.all_reduce_fused(full_matrices, R, topo.replicate, op="mean", async_op=True)
        scalar_grads = [g for _, _, g in scalars]
        if matrices:
            self._dion_update(matrices, full, lambda: comm.all_reduce_fused(
                scalar_grads, R, topo.replicate, op="mean", async_op=True))
        else:
            full.wait()
            comm.all_reduce_fused(scalar_grads, R, topo.replicate, op="mean")
        for p, group, g in scalars:
            self._scalar_update(p, group, g)
        return loss

    def _scalar_update(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> None:
        state = self.state[p] or self._init_scalar_state(p, group["algorithm"])
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        x, m = local(p), local(state["exp_avg"])
        stored = [m] if group["algorithm"] == "lion" else [m, local(state["exp_avg_sq"])]
        work = [t if t.dtype == x.dtype else t.to(x.dtype) for t in stored]  # bf16 storage: compute in x's dtype
        state["step"] += 1
        if group["algorithm"] == "lion":
            kernels.lion_(x, g, work[0], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd)
        else:
            kernels.adamw_(x, g, work[0], work[1], lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=wd, step=float(state["step"]))
        for t, w in zip(stored, work):
            if t is not w:
                t.copy_(w)

    def _batches(self, matrices: list) -> list[list[int]]:
        """Indices of ``matrices`` computed together, stacked: same param group, global shape, rank,
        R path, placements and shard groups, hence the same local shape on this rank. The key is
        the same on every rank, so batches (and the collectives issued per batch) agree across
        ranks; their order is first appearance in parameter order."""
        found: dict[tuple, list[int]] = {}
        for i, (p, group, lay, _) in enumerate(matrices):
            key = (id(group), lay.m, lay.n, lay.r, lay.compressed, lay.transposed, _group_key(lay.rows), _group_key(lay.cols),
                   lay.q_placements, tuple(getattr(p, "placements", ())), tuple(local(p).shape), p.dtype, p.device)
            found.setdefault(key, []).append(i)
        # compressed batches first: their P means go on the wire while the others compute
        return sorted(found.values(), key=lambda ix: not matrices[ix[0]][2].compressed)

    def _dion_update(self, matrices: list, full: "comm.Pending[None]", issue_scalars: Callable[[], Any]) -> None:
        """The Dion step of every matrix, stacked by shape batch (:meth:`_batches`).

        Per batch the large products (B Q, Bᵀ P and the two rank-r updates) are one matmul per
        matrix, written into stacked buffers; everything r-sized (P's and R's means, Grams,
        Cholesky, triangular solves, column norms, the new Q) is one kernel per batch. Overlap:
        each batch's P mean over R is issued async as soon as its P exists and runs while the next
        batches compute theirs; likewise each batch's R mean runs while the next batches compute
        Bᵀ P, and the scalar parameters' gradient mean runs during the final updates. S/T sums
        stay one fused collective per shard-group bucket over all batches. Host synchronizations:
        one per step (the orthonormalization's failure flags), more only on a fallback step.
        ``full``: the in-flight R mean of the uncompressed matrices' gradients (waited for before
        their B is formed); ``issue_scalars()`` issues the scalar gradients' R mean and returns its
        pending result.
        """
        topo = self.topology
        syncs_r = topo.replicate_size > 1
        for p, _, lay, _ in matrices:
            if not self.state[p]:
                self._init_dion_state(p, lay)
        batches = self._batches(matrices)
        # B (in M's storage) and X as Dion sees them: transposed views where the layout runs on Xᵀ.
        Bs = [_oriented(local(self.state[p]["momentum"]), lay) for p, _, lay, _ in matrices]
        Q_locals = [local(self.state[p]["Q"]) for p, _, _, _ in matrices]
        Ps, Qs, p_means = [], [], []
        for ix in batches:
            lay0 = matrices[ix[0]][2]
            if not lay0.compressed:
                full.wait()  # uncompressed: B = M + E_DP[G]
            # Products in the parameter dtype, whatever the storage dtype (mixed precision: bf16 M, Q).
            cd = matrices[ix[0]][0].dtype
            Q = torch.stack([Q_locals[i] for i in ix]).to(cd)
            P = Q.new_empty(len(ix), Bs[ix[0]].shape[0], Q.shape[-1])
            for j, i in enumerate(ix):
                Bs[i].add_(_oriented(matrices[i][3], lay0))  # B = M + G, kept in M's storage (M is rebuilt from B below)
                torch.mm(_as(Bs[i], cd), Q[j], out=P[j])  # P̂ = B̂ Q: local rows, partial over column shards
            if lay0.transposed:
                # P's rows are X's columns, its partial sums run over X's row shards (FSDP): the same
                # hierarchical reduction as R's (sum over the column groups; for a compressed matrix
                # a reduce-scatter, the R mean of this rank's slice only, an all-gather), so the R
                # payload stays (m + n)·r/k. The R mean is in flight from now.
                p_lays = [dataclasses.replace(matrices[i][2], rows=matrices[i][2].cols,
                                              row_split=matrices[i][2].col_split) for i in ix]
                p_means.append(_reduce_r_async(list(P.unbind(0)), p_lays, topo.replicate, syncs_r))
            elif lay0.compressed:
                # E_DP[P̂] (m_loc × r per compressed matrix), one collective per batch, in flight from now.
                p_means.append(comm.all_reduce(P, R, topo.replicate, op="mean", async_op=True).wait)
            else:
                p_means.append(None)
            Ps.append(P)
            Qs.append(Q)
        full.wait()
        for finish in p_means:
            if finish is not None:
                finish()
        # P = Σ_j B_j Q_j over the column shards (the transposed batches summed theirs above)
        views = [(P[j], matrices[i][2].cols) for ix, P in zip(batches, Ps) for j, i in enumerate(ix)
                 if not matrices[i][2].transposed]
        _sum_over([v for v, _ in views], [c for _, c in views])  # P = Σ_j B_j Q_j over column shards
        Ps = orthonormalize_stacked(Ps, [matrices[ix[0]][2].rows for ix in batches], self.cfg.orthogonalize)
        Rs, r_means = [], []
        for ix, P in zip(batches, Ps):
            Rm = P.new_empty(len(ix), Bs[ix[0]].shape[1], P.shape[-1])
            for j, i in enumerate(ix):
                torch.mm(_as(Bs[i], P.dtype).T, P[j], out=Rm[j])  # R̂ = B̂ᵀ P: local columns, partial over row shards
            # R = E_DP[Σ_i B_iᵀ P_i]: row sums now, the R mean in flight while the next batch computes.
            r_means.append(_reduce_r_async(list(Rm.unbind(0)), [matrices[i][2] for i in ix], topo.replicate, syncs_r))
            Rs.append(Rm)
        scalar_means = issue_scalars()
        for finish in r_means:
            finish()
        # [k, r] squared column norms of R per batch, in float32 at least (as microsoft/dion)
        sqs = [Rm.to(torch.promote_types(Rm.dtype, torch.float32)).square().sum(dim=1) for Rm in Rs]
        views = [(sq[j], matrices[i][2].cols) for ix, sq in zip(batches, sqs) for j, i in enumerate(ix)]
        _sum_over([v for v, _ in views], [c for _, c in views])  # over column shards: r numbers per matrix
        for ix, P, Rm, Q, sq in zip(batches, Ps, Rs, Qs, sqs):
            _, group, lay, _ = matrices[ix[0]]
            lr, wd, mu = group["lr"], group["weight_decay"], group["mu"]
            norm = sq.sqrt().unsqueeze(1)
            # A column whose R is exactly zero (every column, when B = M + G is zero on every replica
            # and shard: then P = 0 and "orthogonalizing" it only invents directions) carries nothing:
            # masked out of the error feedback and the update, its Q column kept. Decided from the
            # column norms after every R/S/T sum, so all ranks agree, on the device (no host sync).
            # An all-zero B therefore leaves X to weight decay alone, as microsoft/dion does.
            live = norm > 0
            P = torch.where(live, P, 0.0)
            Rm = torch.where(live, Rm, 0.0)
            # Q = colnorm(R); a column with R = 0 keeps its old direction instead of dying at 0.
            Q = torch.where(live, (Rm / (norm + self.cfg.colnorm_eps)).to(Q.dtype), Q)
            torch._foreach_copy_([Q_locals[i] for i in ix], list(Q.unbind(0)))  # stored in Q's dtype
            for j, i in enumerate(ix):  # one matrix at a time: its B and X stay in cache
                if Bs[i].dtype == P.dtype:
                    Bs[i].addmm_(P[j], Rm[j].T, alpha=-(1 - mu))  # M = B − (1−μ) P Rᵀ (error feedback)
                else:  # bf16 storage: the rank-r correction in the parameter dtype, then stored
                    Bs[i].copy_(Bs[i].to(P.dtype).addmm_(P[j], Rm[j].T, alpha=-(1 - mu)))
                x = _oriented(kernels.decoupled_decay_(local(matrices[i][0]), lr, wd), lay)
                x.addmm_(P[j], Q[j].T, alpha=-lr * math.sqrt(lay.m / lay.n))  # X −= η sqrt(m/n) P Qᵀ (X's m, n)
        scalar_means.wait()


# ---- the family ----------------------------------------------------------------------------------
def build(named_params: NamedParams, topology: Topology, resolved: Resolved, *, ledger=None) -> Dion:
    """Route ``named_params`` (Dion / embedding / head / scalar) and build one :class:`Dion`."""
    cfg, hparams, name = resolved.options, resolved.hparams, resolved.name
    buckets: dict[str, list[tuple[str, nn.Parameter]]] = {"dion": [], "embed": [], "head": [], "scalar": []}
    for fqn, p in named_params:
        buckets[route(fqn, p.ndim, cfg)].append((fqn, p))
    scalar_lr = hparams.lr * cfg.scalar_lr_scale
    head_scale = cfg.head_lr_scale
    if head_scale == 0.0:
        d_in = next((p.shape[-1] for _, p in buckets["head"] if p.ndim == 2), 1)
        head_scale = 1 / math.sqrt(d_in) if cfg.scalar_optimizer == "lion" else 1.0
    algo = cfg.scalar_optimizer
    groups = [
        dict(params=buckets["dion"], algorithm="dion", lr=hparams.lr, weight_decay=hparams.weight_decay),
        dict(params=buckets["scalar"], algorithm=algo, lr=scalar_lr, weight_decay=hparams.weight_decay),
        dict(params=buckets["embed"], algorithm=algo, lr=scalar_lr, weight_decay=0.0),
        dict(params=buckets["head"], algorithm=algo, lr=scalar_lr * head_scale, weight_decay=0.0),
    ]
    groups = [g for g in groups if g["params"]]
    opt = Dion(
        groups, topology, lr=hparams.lr, mu=cfg.mu, betas=(hparams.beta1, hparams.beta2), eps=hparams.eps,
        weight_decay=hparams.weight_decay, rank=cfg.rank, rank_fraction=cfg.rank_fraction,
        orthogonalize=cfg.orthogonalize, compress=cfg.compress, colnorm_eps=cfg.colnorm_eps, seed=cfg.seed,
        orientation=cfg.orientation, mixed_precision=cfg.mixed_precision,
    )
    opt.cfg = cfg  # the routing options too
    if ledger is not None:
        opt.ledger = ledger
    lines = [f"{name}: {topology.describe()}, scalar optimizer {algo}"]
    for kind in ("dion", "embed", "head", "scalar"):
        for fqn, p in buckets[kind]:
            if kind == "dion":
                lay = opt._layouts[p]
                how = f"r={lay.r} {'P,R' if lay.compressed else 'full-grad'} R-sync"
                how += f" rows/{len(lay.rows)} cols/{len(lay.cols)} shard groups"
                how += " transposed" if lay.transposed else ""
            else:
                how = algo
            lines.append(f"  {kind:6s} {fqn} {tuple(p.shape)} -> {how}")
    logger.info("\n".join(lines))
    return opt


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the rank (Q is n×r), the orientation (Q is m×r where a
    matrix runs transposed), the storage dtype (mixed precision), the scalar optimizer (its moments)
    and the routing (which parameters hold Dion state and which the scalar optimizer's)."""
    cfg = resolved.options
    return {
        "rank": cfg.rank,
        "rank_fraction": cfg.rank_fraction if cfg.rank == 0 else "unused (rank > 0)",
        "scalar_optimizer": cfg.scalar_optimizer,
        "embed_names": cfg.embed_names,
        "head_names": cfg.head_names,
        "orientation": cfg.orientation,
        "mixed_precision": cfg.mixed_precision,
    }


FAMILY = Family(
    key="dion",
    options=Config,
    presets=PRESETS,
    preset_sources=PRESET_SOURCES,
    build=build,
    r_bytes=dion_r_bytes,
    state_shape=state_shape,
    summary="low-rank P (m×r) and R (n×r) per matrix; embeddings, head, norms and biases by AdamW or Lion",
)
