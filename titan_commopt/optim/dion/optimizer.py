"""Dion (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates"), Algorithms 1–2.

Per 2-D weight ``X ∈ R^{m×n}`` (``nn.Linear`` layout: m = out features = rows, n = in features), rank r:

    B = M + G                  # G: this replica's mean gradient, never all-reduced over R
    P = orth(B Q)              # B Q averaged over R before orthogonalization
    R = Bᵀ P                   # averaged over R
    M = B − (1 − μ) P Rᵀ       # error feedback: M keeps what the rank-r update missed
    Q = colnorm(R)
    X = X (1 − η λ) − η sqrt(m/n) P Qᵀ

Distributed as Algorithm 2 / Theorem 2.1: the iterates equal the centralized ones. Over R only P and
R are averaged (R hierarchically where the rows are sharded: ``reduce.py``), and only where that pays,
``(m + n)·r < m·n`` (``compress = "auto"``, the reference's rule); elsewhere the gradient is averaged
and every replica runs the centralized update. S and T shard rows and columns (read from each
DTensor's placements): P is orthonormalized over its row shards by CholeskyQR2, falling back to a QR
of P gathered over them (``optim/orthogonalize.py``); ``P = Σ_j B_j Q_j`` and R's column norms are
summed over column shards. No rank materializes an m×n matrix. Which side Q lives on (``orientation``),
the ranks and the shard groups: ``layout.py``. A column whose R is zero moves nothing (microsoft/dion).

Everything else (embeddings, head, norms, biases) steps with a scalar optimizer, AdamW or Lion (as
the paper and microsoft/dion), on the replica mean of its gradient: one dense fp32 all-reduce, or for
the embedding and head with ``scalar_sync = "demo"`` DeMo's wire on an error-fed gradient (DeMo's
equation numbers, ``optim/demo/optimizer.py``; why these two: ``layout.demo_synced``):

    e_r ← e_r + g_r;  q_r = IDCT(topk(DCT(e_r)));  e_r ← e_r − q_r     # eq. 2 (β = 1), 3–4, 8 (λ = 1)
    G = (1/W) Σ_r q_r;  x ← AdamW/Lion(x, G)                          # eq. 5–6: one all-gather

State: ``momentum`` (M, per replica on the compressed path; a shape batch's momenta are one stacked
buffer, each ``state["momentum"]`` a view of its slice), ``Q`` (a DTensor drawn identically on every
rank from (``seed``, FQN)), the scalar optimizer's moments, and ``scalar_error`` (e_r, per replica).
``mixed_precision`` stores M, Q and the moments in bfloat16 (the products run in the parameter
dtype, unlike microsoft/dion's, which multiplies in the storage dtype); it, the rank and the scalar optimizer shape the state (``state_shape``). Parameters stay
identical across replicas: every replica applies the same averaged P, R and G.

Bytes per rank and step (``layout.dion_r_bytes``): ``(m_loc + ⌈n_loc/k⌉)·r`` elements per compressed
matrix with k row shards (``(m + n)·r/k`` when k divides m and n), the gradient shard otherwise, plus
the scalars' dense mean or their DeMo payload.

Compute: matrices of one param group, shape, rank and layout form a shape batch, known at
construction: its large products are one batched GEMM over the stacked buffer (``matmul_precision``),
its r-sized work one kernel. The R collectives are tasks on ``runtime``: batch i+1 computes while
batch i's mean is in flight; every result is waited for before it is read. One host synchronization
per step reads CholeskyQR2's failure flags.
"""

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_commopt import comm
from titan_commopt.overlap import Task
from titan_commopt.topology import R, Topology

from .. import updates
from ..base import CommOptimizer
from ..base import named_params as params_with_names
from ..common import BaseHParams, local, replica_grad
from ..family import Family, Resolved
from ..orthogonalize import orthonormalizer
from ..routing import named_pairs
from ..shard_groups import group_key, sum_over
from .config import PRESET_SOURCES, PRESETS, Config
from .layout import (
    KINDS, Layout, compressed, demo_synced, dion_r_bytes, dion_rank, initial_q, layout_of, r_slice, route,
    scalar_replicator, transposed,
)
from .reduce import reduce_r

__all__ = ["Dion", "FAMILY", "state_shape", "orient_"]

logger = logging.getLogger(__name__)


# ---- routing into param groups -------------------------------------------------------------------
def _route_groups(named_params: Iterable[Any], cfg: Config, hparams: BaseHParams) -> tuple[list[dict], dict]:
    """Dion's param groups from ``(fqn, param)`` pairs (:func:`route`): the block matrices at the lr,
    the scalar optimizer's parameters at ``lr × scalar_lr_scale`` (embedding and head without weight
    decay, the head with its own lr factor). Also the routed pairs by kind, for the log."""
    routed: dict[str, list[tuple[str, nn.Parameter]]] = {kind: [] for kind in KINDS}
    for fqn, p in named_pairs(named_params, "Dion"):
        routed[route(fqn, p.ndim, cfg)].append((fqn, p))
    scalar_lr = hparams.lr * cfg.scalar_lr_scale
    head_scale = cfg.head_lr_scale
    if head_scale == 0.0:  # auto: 1/sqrt(d_in) with Lion (microsoft/dion), 1 with AdamW
        d_in = next((p.shape[-1] for _, p in routed["head"] if p.ndim == 2), 1)
        head_scale = 1 / math.sqrt(d_in) if cfg.scalar_optimizer == "lion" else 1.0
    algo, wd = cfg.scalar_optimizer, hparams.weight_decay
    groups = [
        dict(params=routed["dion"], algorithm="dion", lr=hparams.lr, weight_decay=wd),
        dict(params=routed["scalar"], algorithm=algo, lr=scalar_lr, weight_decay=wd),
        dict(params=routed["embed"], algorithm=algo, lr=scalar_lr, weight_decay=0.0),
        dict(params=routed["head"], algorithm=algo, lr=scalar_lr * head_scale, weight_decay=0.0),
    ]
    return [g for g in groups if g["params"]], routed


# ---- the scalar optimizer (AdamW or Lion), chosen once -------------------------------------------
def _adamw(x: torch.Tensor, g: torch.Tensor, moments: list[torch.Tensor], group: dict, step: float) -> None:
    (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
    updates.adamw_(x, g, moments[0], moments[1], lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                   weight_decay=wd, step=step)


def _lion(x: torch.Tensor, g: torch.Tensor, moments: list[torch.Tensor], group: dict, step: float) -> None:
    (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
    updates.lion_(x, g, moments[0], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd)


@dataclass(frozen=True)
class _ScalarRule:
    moments: tuple[str, ...]  # the state keys of its moments
    apply: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], dict, float], None]


_SCALAR_RULES = {"adamw": _ScalarRule(("exp_avg", "exp_avg_sq"), _adamw), "lion": _ScalarRule(("exp_avg",), _lion)}


def orient_(opt: "Dion", flags: dict[str, bool]) -> None:
    """Force the orientation of the unsharded matrices named in ``flags`` (fqn → transposed), before
    the first step: a single-process simulation of a sharded run under ``orientation = "reference"``
    runs each matrix the way the sharded run oriented it. The state, still initial, is made again
    (Q's rows follow the orientation)."""
    if opt._stepped:
        raise ValueError("Dion.orient_: the optimizer has already stepped or loaded a state")
    for lay in opt._layouts.values():
        if lay.fqn in flags:
            if lay.rows or lay.cols:
                raise ValueError(f"Dion.orient_: {lay.fqn} is sharded")
            lay.transposed = bool(flags[lay.fqn])
    opt._init_state()


def _oriented(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``t`` (X's local layout, or a stack of them) as the matrix Dion runs on: its transpose (a view)
    where ``lay`` is transposed."""
    return t.mT if lay.transposed else t


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


@contextlib.contextmanager
def _tf32():
    """TF32 allowed for float32 matmuls (torch's ``fp32_precision``), then what it was restored."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


class _Products:
    """Dion's large products at ``matmul_precision`` (see the option): fp32 runs torch's calls as they
    were (bit for bit the reference); tf32 the same calls with TF32 allowed around them, then restored;
    bf16 rounds the operands to bfloat16 and accumulates in float32 (``out_dtype`` on CUDA; on a CPU
    the rounded operands multiplied in float32, which is the same product up to summation order)."""

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self._scope = _tf32 if precision == "tf32" else contextlib.nullcontext
        self._out_dtype_ok = True

    def _bf16_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        mm = torch.bmm if a.dim() == 3 else torch.mm
        if a.is_cuda and self._out_dtype_ok:
            try:
                return mm(a16, b16, out_dtype=torch.float32)
            except (TypeError, RuntimeError):  # a torch without mm's out_dtype for this device
                self._out_dtype_ok = False
        return mm(a16.to(torch.float32), b16.to(torch.float32))

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """out = a b: one matrix, or a stack of them (one batched product)."""
        if self.precision == "bf16" and a.dtype == torch.float32:
            out.copy_(self._bf16_mm(a, b))
            return
        with self._scope():
            (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out=out)

    def addmm_(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
        """c += alpha · a b: one matrix, or a stack of them (one batched product)."""
        if self.precision == "bf16" and a.dtype == torch.float32:
            return c.add_(self._bf16_mm(a, b), alpha=alpha)
        with self._scope():
            return c.baddbmm_(a, b, alpha=alpha) if c.dim() == 3 else c.addmm_(a, b, alpha=alpha)


_STORED = ("momentum", "Q", "exp_avg", "exp_avg_sq")  # the state kept in the storage dtype


def _report_converted_state(opt: "Dion", state_dict: dict) -> None:
    """Load hook: say so when the loaded state's dtypes are not this run's storage dtypes (a
    checkpoint written with another ``mixed_precision``); they are converted on load."""
    want = opt._state_dtype
    seen = {v.dtype for st in state_dict.get("state", {}).values() for k, v in st.items()
            if k in _STORED and isinstance(v, torch.Tensor) and v.is_floating_point()}
    if seen and (seen != {want} if want is not None else torch.bfloat16 in seen):
        logger.warning(
            "Dion: loaded optimizer state in %s, this run stores it in %s (mixed_precision = %s): converted",
            ", ".join(sorted(str(d) for d in seen)), want or "the parameter dtype", opt.options.options.mixed_precision,
        )


def _restore_state(opt: "Dion") -> None:
    """Load hook: torch's ``Optimizer.load_state_dict`` replaces the state's tensors, casting floating
    ones to the parameter's dtype. Each M goes back into its shape batch's buffer (a view of it again,
    in the storage dtype), Q and the scalar moments back into this run's storage dtype, and what the
    checkpoint lacks (a parameter that had no state yet when it was saved) is made as at construction."""
    opt._stepped = True
    opt._fill_state()
    for p, st in opt.state.items():
        dtype = opt._storage_dtype(p)
        for k in _STORED:
            if k in st and isinstance(st[k], torch.Tensor) and st[k].dtype != dtype:
                st[k] = st[k].to(dtype)


@dataclass
class _Stack:
    """A shape batch's momenta in one buffer (:meth:`Dion._init_state`): each member's
    ``state["momentum"]`` is a view of its slice, so the batch's products are one batched product
    over the buffer, without copying M."""

    params: list[torch.Tensor]
    lays: list[Layout]
    buffer: torch.Tensor  # [k, local rows, local columns]: X's local layout, the storage dtype


@dataclass
class _Batch:
    """The members of a shape batch that step now, computed together (:meth:`Dion._batches`): their
    views, and the stacked quantities of this step, filled phase by phase."""

    params: list[torch.Tensor]
    lays: list[Layout]
    grads: list[torch.Tensor]  # this replica's G (the replica mean, for an uncompressed matrix, once reduced)
    group: dict  # the param group as it is now (a load replaces the group dicts)
    stack: _Stack
    index: Optional[torch.Tensor]  # their slots in the stack's buffer; None: all of them
    momenta: list[torch.Tensor]  # their local M (views of the buffer)
    Q_stored: list[torch.Tensor]  # the local Q in its storage dtype
    B: torch.Tensor = field(init=False)  # [k, rows, columns] oriented: the buffer, B = M + G, rebuilt into the new M
    Q: torch.Tensor = field(init=False)  # [k, q rows, r] in the parameter dtype
    P: torch.Tensor = field(init=False)  # [k, rows, r]
    R: torch.Tensor = field(init=False)  # [k, columns, r]
    sq: torch.Tensor = field(init=False)  # [k, r] squared column norms of R

    @property
    def lay(self) -> Layout:
        """The layout every matrix of the batch shares (up to its name and offsets)."""
        return self.lays[0]


# ---- the optimizer ---------------------------------------------------------------------------------
class Dion(CommOptimizer):
    """Dion for the block matrices plus AdamW/Lion for the rest, routed by name (:func:`route`).

    Param groups carry ``algorithm`` (``dion``/``adamw``/``lion``), ``lr``, ``weight_decay`` and
    ``mu`` / ``betas``, ``eps``. Each matrix's name seeds its Q.
    """

    params_replica_local = False  # every replica applies the same averaged P and R: parameters agree
    step_attributes = ("_fallbacks", "_stepped")  # CommOptimizer.snapshot: what step() counts and flags

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional[comm.CommLedger] = None) -> None:
        cfg, hp = options.options, options.hparams
        groups, routed = _route_groups(named_params, cfg, hp)
        defaults = dict(lr=hp.lr, mu=cfg.mu, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay,
                        algorithm="dion")
        super().__init__(groups, topology, options, defaults, ledger=ledger)
        self.register_load_state_dict_pre_hook(_report_converted_state)
        self.register_load_state_dict_post_hook(_restore_state)
        self._state_dtype = torch.bfloat16 if cfg.mixed_precision else None  # None: the parameter's
        self._scalar_rule = _SCALAR_RULES[cfg.scalar_optimizer]
        self._orthonormalize = orthonormalizer(cfg.orthogonalize)
        self._products = _Products(cfg.matmul_precision)
        self._colnorm_eps, self._seed = cfg.colnorm_eps, cfg.seed
        self._fallbacks = 0
        self._layouts: dict[torch.Tensor, Layout] = {
            p: layout_of(name, p, self.topology, cfg)
            for group, name, p in params_with_names(self.param_groups) if group["algorithm"] == "dion"
        }
        # scalar_sync = "demo": the embedding and head, by identity, and their replicators (lazily, per
        # local shape and device). One replica: nothing crosses R, the dense path is exact and free.
        self._demo_synced = (
            {p for kind, pairs in routed.items() if demo_synced(kind, cfg) for _, p in pairs}
            if self.topology.replicated else set()
        )
        self._replicators: dict[tuple, Any] = {}
        self._stepped = False
        # Eager state: torchtitan's init_optim_state (and DCP's _init_optim_state) would otherwise make
        # it by one zero-gradient, lr-0 step, which for Dion is a real step: P, R and the scalar
        # gradients cross R once, and the scalar optimizer counts a step (shifting Adam's bias correction).
        self._init_state()
        self._log_routing(routed)

    def _log_routing(self, routed: dict[str, list[tuple[str, nn.Parameter]]]) -> None:
        algo = self.options.options.scalar_optimizer
        lines = [f"{self.options.name}: {self.topology.describe()}, scalar optimizer {algo}"]
        for kind, pairs in routed.items():
            for fqn, p in pairs:
                how = algo
                if p in self._demo_synced:
                    cfg = self.options.options
                    how += f" demo R-sync (chunk {cfg.scalar_chunk}, top-{cfg.scalar_topk})"
                if kind == "dion":
                    lay = self._layouts[p]
                    how = f"r={lay.r} {'P,R' if lay.compressed else 'full-grad'} R-sync"
                    how += f" rows/{len(lay.rows)} cols/{len(lay.cols)} shard groups"
                    how += " transposed" if lay.transposed else ""
                lines.append(f"  {kind:6s} {fqn} {tuple(p.shape)} -> {how}")
        logger.info("\n".join(lines))

    @property
    def layouts(self) -> dict[str, Layout]:
        """Each Dion matrix's layout by name: its rank, R path, orientation and shard groups."""
        return {lay.fqn: lay for lay in self._layouts.values()}

    def metrics(self) -> dict[str, float]:
        """``orthonormalize_fallbacks``: how many P's CholeskyQR2 could not orthonormalize in their own
        dtype since this optimizer was made (retried in float64, or by QR); read from the flags the
        step already brings to the host. Always 0 with ``orthogonalize = "qr"``."""
        return {"orthonormalize_fallbacks": float(self._fallbacks)}

    # -- state -------------------------------------------------------------------------------------
    def _storage_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of p's optimizer state: bfloat16 under ``mixed_precision``, else p's."""
        return self._state_dtype if self._state_dtype is not None and p.is_floating_point() else p.dtype

    def _init_state(self) -> None:
        """Every trainable parameter's state as its first step would find it: Dion's M (zero, a view of
        its shape batch's buffer) and Q, the scalar optimizer's step and moments, and the error buffer of
        ``scalar_sync = "demo"``. The shape batches are known now: their key depends on the layouts only."""
        self.state.clear()
        members: dict[tuple, list] = {}
        for group in self.param_groups:
            for p in group["params"]:
                lay = self._layouts.get(p)
                if lay is not None and p.requires_grad:
                    members.setdefault(self._batch_key(p, group, lay), []).append((p, lay))
        self._stacks: list[_Stack] = []
        self._slots: dict[torch.Tensor, tuple[_Stack, int]] = {}
        for ms in members.values():
            x = local(ms[0][0])
            buffer = torch.zeros((len(ms), *x.shape), dtype=self._storage_dtype(x), device=x.device)
            stack = _Stack([p for p, _ in ms], [lay for _, lay in ms], buffer)
            self._stacks.append(stack)
            self._slots.update({p: (stack, j) for j, (p, _) in enumerate(ms)})
        self._fill_state()

    def _fill_state(self) -> None:
        """Make what is missing of every trainable parameter's state: all of it at construction, after a
        load what the checkpoint did not have; each M (re)pointed at its slot of the batch buffer."""
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p in self._layouts:
                    self._fill_dion_state(p)
                else:
                    self._fill_scalar_state(p)

    def _batch_key(self, p: torch.Tensor, group: dict, lay: Layout) -> tuple:
        """Matrices computed together, stacked: same param group, global shape, rank, R path, placements
        and shard groups, hence the same local shape on this rank. The key is the same on every rank, so
        batches (and the collectives issued per batch) agree across ranks."""
        return (id(group), lay.m, lay.n, lay.r, lay.compressed, lay.transposed, group_key(lay.rows),
                group_key(lay.cols), lay.q_placements, tuple(getattr(p, "placements", ())),
                tuple(local(p).shape), p.dtype, p.device)

    def _fill_dion_state(self, p: torch.Tensor) -> None:
        stack, j = self._slots[p]
        state, lay, slot = self.state[p], self._layouts[p], stack.buffer[j]
        loaded = state.get("momentum")
        if loaded is None:
            slot.zero_()
        else:  # converted to the storage dtype (torch's load cast it to the parameter's)
            slot.copy_(local(loaded))
        state["momentum"] = (
            DTensor.from_local(slot, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) else slot
        )
        if "Q" not in state:
            state["Q"] = self._initial_q(p, lay)

    def _initial_q(self, p: torch.Tensor, lay: Layout) -> torch.Tensor:
        dtype = self._storage_dtype(p)
        x = local(p)
        q_full = initial_q(lay.fqn, lay.q_rows, lay.r, self._seed, dtype=dtype)
        q_local_rows = x.shape[0] if lay.transposed else x.shape[1]
        q_local = q_full[lay.col_offset : lay.col_offset + q_local_rows].to(x.device).contiguous()
        if isinstance(p, DTensor):
            return DTensor.from_local(
                q_local, p.device_mesh, lay.q_placements, run_check=False,
                shape=torch.Size((lay.q_rows, lay.r)), stride=(lay.r, 1),
            )
        return q_local

    def _fill_scalar_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        dtype = self._storage_dtype(p)
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        for key in self._scalar_rule.moments:
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if p in self._demo_synced and "scalar_error" not in state:
            # the parameter dtype even under mixed_precision (module docstring); a checkpoint of one
            # replica has none
            state["scalar_error"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # -- step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Per shape batch: form P, reduce P, orthonormalize, form R, reduce R, update; the scalar
        parameters' AdamW/Lion steps last."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepped = True
        matrices, scalars = self._gradients()
        # R collectives in the order they are needed (one process group runs them in issue order):
        # the gradients of uncompressed matrices, P and R of each shape batch, then the scalar
        # parameters' gradients, which are only needed at the very end.
        full = comm.all_reduce_fused([g for _, _, lay, g in matrices if not lay.compressed], R,
                                     self.topology.replicate, op="mean", ledger=self.ledger, async_op=True)
        batches = self._batches(matrices)
        self._form_and_reduce_p(batches, full)
        self._sum_p_over_columns(batches)
        self._orthonormalize_p(batches)
        self.runtime.run(*(self._r_task(b) for b in batches))  # R mean of batch i in flight while i+1 forms R
        self.runtime.start(self._scalar_task(scalars), due=0, within_step=True)  # in flight during the updates
        self._column_norms(batches)
        for b in batches:
            self._update(b)
        self.runtime.drain()
        return loss

    def _gradients(self) -> tuple[list, list]:
        """``(param, group, layout, G)`` of the Dion matrices and ``(param, group, G)`` of the rest."""
        copy = self.topology.replicated  # the fused R mean writes back in place: never into p.grad
        matrices, scalars = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                lay = self._layouts.get(p)
                if lay is not None:
                    matrices.append((p, group, lay, self._replica_grad(p, copy and not lay.compressed)))
                else:
                    scalars.append((p, group, self._replica_grad(p, copy)))
        return matrices, scalars

    def _replica_grad(self, p: torch.Tensor, copy: bool) -> torch.Tensor:
        return replica_grad(p, self.topology, copy=copy, ledger=self.ledger)

    def _batches(self, matrices: list) -> list[_Batch]:
        """``matrices`` by shape batch (:meth:`_batch_key`), in the order of first appearance in parameter
        order, compressed batches first (their P means go on the wire while the others compute). A
        batch is its whole stack but where some member has no gradient this step: then only the others,
        their rows of the buffer copied out and back (:meth:`_form_p`, :meth:`_update`)."""
        found: dict[int, tuple[_Stack, list]] = {}
        for p, group, lay, g in matrices:
            stack, j = self._slots[p]
            found.setdefault(id(stack), (stack, []))[1].append((j, p, group, lay, g))
        batches = []
        for stack, ms in sorted(found.values(), key=lambda sm: not sm[0].lays[0].compressed):
            index = None
            if len(ms) < len(stack.params):
                index = torch.tensor([j for j, *_ in ms], device=stack.buffer.device)
            batches.append(_Batch(
                params=[p for _, p, *_ in ms], lays=[lay for *_, lay, _ in ms], grads=[g for *_, g in ms],
                group=ms[0][2], stack=stack, index=index, momenta=[local(self.state[p]["momentum"]) for _, p, *_ in ms],
                Q_stored=[local(self.state[p]["Q"]) for _, p, *_ in ms],
            ))
        return batches

    # -- the phases of the Dion step, in order -----------------------------------------------------
    def _form_and_reduce_p(self, batches: list[_Batch], full: "comm.Pending[None]") -> None:
        """Every batch's P, each one's R reduction in flight while the next batches form theirs.

        The uncompressed batches' tasks go first and yield the gradient mean ``full`` before anything
        else, so they form P only once every compressed batch has formed its own and issued its P
        mean: the compressed P means are on the wire while the uncompressed P's are formed."""
        order = [b for b in batches if not b.lay.compressed] + [b for b in batches if b.lay.compressed]
        self.runtime.run(*(self._p_task(b, full) for b in order))

    def _p_task(self, b: _Batch, full: "comm.Pending[None]") -> Task:
        if not b.lay.compressed:
            yield full  # B = M + E_DP[G]
        self._form_p(b)
        yield from self._reduce_p(b)

    def _form_p(self, b: _Batch) -> None:
        """B = M + G (in M's storage), P̂ = B̂ Q: local rows, partial over the column shards, one batched
        product. The products run in the parameter dtype, whatever the storage dtype (mixed precision:
        bf16 M, Q; the batch converted at once)."""
        cd = b.params[0].dtype
        torch._foreach_add_(b.momenta, b.grads)  # B = M + G (M is rebuilt from B in _update)
        buffer = b.stack.buffer
        b.B = _oriented(buffer if b.index is None else buffer.index_select(0, b.index), b.lay)
        b.Q = torch.stack(b.Q_stored).to(cd)
        b.P = b.Q.new_empty(len(b.params), b.B.shape[1], b.Q.shape[-1])
        self._products.mm(_as(b.B, cd), b.Q, out=b.P)  # P̂ = B̂ Q

    def _reduce_p(self, b: _Batch) -> Task:
        """E_DP[P̂] where P is compressed (one collective per batch, yielded while in flight)."""
        if b.lay.transposed:
            # P's rows are X's columns, its partial sums run over X's row shards (FSDP): the same
            # hierarchical reduction as R's (sum over the column groups; for a compressed matrix
            # a reduce-scatter, the R mean of this rank's slice only, an all-gather), so the R
            # payload stays (m + n)·r/k.
            p_lays = [dataclasses.replace(lay, rows=lay.cols, row_split=lay.col_split) for lay in b.lays]
            yield from reduce_r(list(b.P.unbind(0)), p_lays, self.topology.replicate,
                                self.topology.replicated, self.ledger)
        elif b.lay.compressed:
            yield comm.all_reduce(b.P, R, self.topology.replicate, op="mean", ledger=self.ledger, async_op=True)

    def _sum_p_over_columns(self, batches: list[_Batch]) -> None:
        """P = Σ_j B_j Q_j over the column shards, one fused collective per bucket of all batches (the
        transposed ones summed theirs in :meth:`_reduce_p`)."""
        views = [(P, lay.cols) for b in batches if not b.lay.transposed for P, lay in zip(b.P, b.lays)]
        sum_over([v for v, _ in views], [c for _, c in views], ledger=self.ledger)

    def _orthonormalize_p(self, batches: list[_Batch]) -> None:
        """P = orth(P), all batches at once: one host synchronization (more only on a fallback)."""
        stacks, fallbacks = self._orthonormalize([b.P for b in batches], [b.lay.rows for b in batches], self.ledger)
        for b, P in zip(batches, stacks):
            b.P = P
        self._fallbacks += fallbacks

    def _r_task(self, b: _Batch) -> Task:
        """R̂ = B̂ᵀ P (local columns, partial over the row shards), then R = E_DP[Σ_i B_iᵀ P_i]:
        the row sums now, the R mean yielded while in flight."""
        b.R = b.P.new_empty(len(b.params), b.B.shape[2], b.P.shape[-1])
        self._products.mm(_as(b.B, b.P.dtype).mT, b.P, out=b.R)  # R̂ = B̂ᵀ P
        yield from reduce_r(list(b.R.unbind(0)), b.lays, self.topology.replicate,
                            self.topology.replicated, self.ledger)

    def _column_norms(self, batches: list[_Batch]) -> None:
        """[k, r] squared column norms of R per batch, in float32 at least (as microsoft/dion), summed
        over the column shards: r numbers per matrix, one fused collective per bucket."""
        for b in batches:
            b.sq = b.R.to(torch.promote_types(b.R.dtype, torch.float32)).square().sum(dim=1)
        views = [(sq, lay.cols) for b in batches for sq, lay in zip(b.sq, b.lays)]
        sum_over([v for v, _ in views], [c for _, c in views], ledger=self.ledger)

    def _update(self, b: _Batch) -> None:
        """Q = colnorm(R); M = B − (1−μ) P Rᵀ; X = X (1 − η λ) − η sqrt(m/n) P Qᵀ."""
        lr, wd, mu = b.group["lr"], b.group["weight_decay"], b.group["mu"]
        norm = b.sq.sqrt().unsqueeze(1)
        # A column whose R is exactly zero (every column, when B = M + G is zero on every replica
        # and shard: then P = 0 and "orthogonalizing" it only invents directions) carries nothing:
        # masked out of the error feedback and the update, its Q column kept. Decided from the
        # column norms after every R/S/T sum, so all ranks agree, on the device (no host sync).
        # An all-zero B therefore leaves X to weight decay alone, as microsoft/dion does.
        live = norm > 0
        P = torch.where(live, b.P, 0.0)
        Rm = torch.where(live, b.R, 0.0)
        Q = torch.where(live, (Rm / (norm + self._colnorm_eps)).to(b.Q.dtype), b.Q)  # a dead column keeps its direction
        torch._foreach_copy_(b.Q_stored, list(Q.unbind(0)))  # stored in Q's dtype
        if b.B.dtype == P.dtype:
            self._products.addmm_(b.B, P, Rm.mT, alpha=-(1 - mu))  # M = B − (1−μ) P Rᵀ (error feedback)
        else:  # bf16 storage: the rank-r correction in the parameter dtype, then stored
            b.B.copy_(self._products.addmm_(b.B.to(P.dtype), P, Rm.mT, alpha=-(1 - mu)))
        if b.index is not None:  # the members that stepped: their rows back into the buffer
            b.stack.buffer.index_copy_(0, b.index, _oriented(b.B, b.lay))
        scale = math.sqrt(b.lay.m / b.lay.n)  # X's m, n whatever the orientation
        for j, x in enumerate(b.params):  # X's are separate parameters: one product each
            x = _oriented(updates.decoupled_decay_(local(x), lr, wd), b.lay)
            self._products.addmm_(x, P[j], Q[j].T, alpha=-lr * scale)  # X −= η sqrt(m/n) P Qᵀ

    def _scalar_task(self, scalars: list) -> Task:
        """The scalar parameters' gradient mean over R, then their AdamW/Lion steps. Two R collectives
        at most, issued in this order on every rank: the dense parameters' fused all-reduce, then (with
        ``scalar_sync = "demo"``) one all-gather of every replica's DeMo payload for the embedding and
        head (:meth:`_pack_demo`), the mean decoded by :meth:`_apply_demo`."""
        dense = [(p, group, g) for p, group, g in scalars if p not in self._demo_synced]
        demo = [(p, group, g) for p, group, g in scalars if p in self._demo_synced]
        pending = [comm.all_reduce_fused([g for _, _, g in dense], R, self.topology.replicate, op="mean",
                                         ledger=self.ledger, async_op=True)]
        send, segments = self._pack_demo(demo)
        if send is not None:
            pending.append(comm.all_gather(send, R, self.topology.replicate, ledger=self.ledger, async_op=True))
        results = yield pending
        if send is not None:
            self._apply_demo(results[-1], segments)
        for p, group, g in dense:
            self._scalar_update(p, group, g)

    def _replicator(self, x: torch.Tensor) -> Any:
        key = (tuple(x.shape), x.device)
        if key not in self._replicators:
            self._replicators[key] = scalar_replicator(x.shape, self.options.options, device=x.device)
        return self._replicators[key]

    def _pack_demo(self, demo: list) -> tuple[Optional[torch.Tensor], list]:
        """Error feedback and extraction of every ``scalar_sync = "demo"`` shard (DeMo Algorithm 1 with
        its momentum replaced by the error buffer: e ← e + g, q = top-k of DCT(e), e ← e − q, eq. 8) and
        the fused send buffer (each shard's payload, parameter order; sizes from shapes only, so the
        receivers split it without a header). ``None`` when nothing is sent."""
        payloads, segments, offset = [], [], 0
        for p, group, g in demo:
            e = local(self.state[p]["scalar_error"])
            if not e.numel():
                continue
            rep = self._replicator(e)
            e.add_(g)  # e ← e + g: this replica's gradient joins what it has not sent yet
            q, payload = rep.extract(e, 1)  # the top-k of every chunk's DCT-II (DeMo eq. 3–4)
            e.sub_(q.to(e.dtype))  # e ← e − q (DeMo eq. 8): what was sent leaves the buffer
            payloads.append(payload)
            segments.append((p, group, rep, offset, payload.numel()))
            offset += payload.numel()
        return (torch.cat(payloads) if payloads else None), segments

    def _apply_demo(self, gathered: torch.Tensor, segments: list) -> None:
        """Every replica's payloads (``[W, bytes]``, replica order) → each shard's mean of the replicas'
        decoded selections (DeMo eq. 6, the same bits on every replica) → the scalar optimizer's step
        with it as the gradient."""
        for p, group, rep, offset, n in segments:
            mean = rep.aggregate(gathered[:, offset: offset + n], 1)
            self._scalar_update(p, group, mean.to(local(p).dtype))

    def _scalar_update(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> None:
        state = self.state[p]
        x = local(p)
        stored = [local(state[key]) for key in self._scalar_rule.moments]
        work = [t if t.dtype == x.dtype else t.to(x.dtype) for t in stored]  # bf16 storage: compute in x's dtype
        state["step"] += 1
        self._scalar_rule.apply(x, g, work, group, float(state["step"]))
        for t, w in zip(stored, work):
            if t is not w:
                t.copy_(w)


# ---- the family ----------------------------------------------------------------------------------
def settings(resolved: Resolved) -> dict[str, Any]:
    """The options behind the bytes: the rank, the compression rule, the scalars' sync."""
    o = resolved.options
    what = {**({"rank": o.rank} if o.rank else {"rank_fraction": o.rank_fraction}), "compress": o.compress,
            "scalar_sync": o.scalar_sync}
    if o.scalar_sync == "demo":
        what |= {"scalar_chunk": o.scalar_chunk, "scalar_topk": o.scalar_topk,
                 "scalar_transfer_dtype": o.scalar_transfer_dtype}
    return what


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the checkpointed state: the rank (Q is n×r), the orientation (Q is m×r where a
    matrix runs transposed), the storage dtype (mixed precision), the scalar optimizer (its moments),
    the routing (which parameters hold Dion state and which the scalar optimizer's) and the scalar sync
    (``demo``: an error-feedback buffer per embedding and head shard, different on every replica)."""
    cfg = resolved.options
    return {
        "rank": cfg.rank,
        "rank_fraction": cfg.rank_fraction if cfg.rank == 0 else "unused (rank > 0)",
        "scalar_optimizer": cfg.scalar_optimizer,
        "embed_names": cfg.embed_names,
        "head_names": cfg.head_names,
        "orientation": cfg.orientation,
        "mixed_precision": cfg.mixed_precision,
        "scalar_sync": cfg.scalar_sync,
    }


FAMILY = Family(
    key="dion",
    options=Config,
    presets=PRESETS,
    preset_sources=PRESET_SOURCES,
    build=Dion,
    r_bytes=dion_r_bytes,
    state_shape=state_shape,
    settings=settings,
    summary="low-rank P (m×r) and R (n×r) per matrix; embeddings, head, norms and biases by AdamW or Lion",
)
