"""The local-adaptive update (ADOPT, quasi-hyperbolic Adam, SGD with EMA momenta) as one Triton kernel.

The torch twin is ``update.py`` (over ``optim/updates.py``): :func:`local_adaptive_` computes what
its ``adopt_multi_``, ``qh_adamw_multi_`` (with N momenta, ω ≠ 1 or MT-DAO's switch corrections) and
``sgdm_multi_`` compute, after the optimizer's own gradient clip (coordinate-wise to ±ρ, or by the replica norm's scale
min(1, ρ/‖g‖)), in one pass over memory: each element of (x, g, u_1..u_N, v) is read once and
x, u_j, v written once, every intermediate in float32 registers. torch's eager path makes about
sixteen passes (each ``_foreach`` operation reads and writes whole tensors, plus the clip's copy).

Per element, in the torch path's order (ĝ the normalized gradient, c_j the first momenta's bias
corrections, √ĉ2 = (1 − β2^t)^½):

    g  ← clip(g)                                        # coordinate: clamp ±ρ; norm: g · scale
    adopt:  ĝ = clamp(g / max(√v, ε), ±(t−1)^¼)          # the previous v (ADOPT's order)
            u_j ← lerp(u_j, ĝ, 1−β1_j)
            x ← x·(1−ηλ) − η·[(1−Σω)·ĝ + Σ ω_j·u_j]
            v ← β2·v + (1−β2)·g²                         # step 1: v ← g² only, nothing else moves
    adam:   x ← x·(1−ηλ); u_j ← lerp(u_j, g, 1−β1_j); v ← β2·v + (1−β2)·g²
            x ← x − η·[(1−Σω)·g + Σ (ω_j/c_j)·u_j] / (√v/√ĉ2 + ε)
    sgdm:   u_j ← lerp(u_j, g, 1−β1_j); x ← x·(1−ηλ) − η·[(1−Σω)·g + Σ ω_j·u_j]

Rounding. float32 tensors: the same operations in the same order (IEEE division and square root,
``div_rn``/``sqrt_rn``; ``lerp`` with torch's two-sided formula), so results agree with the torch
path to round-off (a contracted multiply-add here or there: ~1e-7 relative). bfloat16/float16
tensors: torch rounds every intermediate to the tensor's dtype, this kernel only the stored results
(the gradient is rounded to the parameter's dtype first, and again after the clip, as torch's copy
is): the fused result is the float32 computation rounded once, within one unit in the last place
of it, and closer to exact math than the eager path.

Multi-tensor, one launch per dtype group. Tensors live in separate allocations (the parameters and
their states, DTensor local shards included), so the kernel reads a *pointer table* (int64
[roles, T]: the data pointers of x, g, u_1..u_N, v of each of the T tensors, cast to typed pointers
in the kernel) and a *chunk table* (for each program: its tensor and its first element). Every
tensor is cut into chunks of ``CHUNK`` elements; program c updates chunk c, BLOCK elements at a
time. The chunk table depends only on the tensors' sizes and is built once (cached per size list
and device); the pointer table is rebuilt each step (gradients move) from a pinned host buffer,
copied without blocking the host. This is torch's ``multi_tensor_apply`` scheme; flattening the
tensors into one buffer instead would cost a copy each way per step, or a state layout that
checkpoints would see. Non-contiguous tensors (rare: local shards are contiguous) go through a
contiguous copy, written back after the launch.

Triton's AMD backend runs it unchanged (no CUDA-only intrinsics). The kernel is jitted on first use,
not at import, so that ``TRITON_INTERPRET`` is read when a kernel is first needed: Triton's ``jit``
reads it at decoration time, and the tests set it before that.
"""

import functools
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

try:  # Triton ships with torch's Linux wheels; the torch path never imports this module's kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platform dependent: use_triton never picks this module then
    import types

    triton, tl = None, types.SimpleNamespace(constexpr=None)

from titan_commopt.kernels import interpreting

__all__ = ["BASES", "CLIPS", "DTYPES", "takes", "local_adaptive_"]

BASES = ("adam", "adopt", "sgdm")
CLIPS = ("none", "coordinate", "norm")
BLOCK = 1024  # elements per program iteration: 4 warps × 32 threads × 8 elements
CHUNK = 16 * BLOCK  # elements per program: ~64k programs for 1B parameters


def _local_adaptive_body(
    PTRS, NUMELS, CHUNK_TENSOR, CHUNK_START, SCALE, T,
    neg_lr, decay, beta2, one_minus_beta2, eps, bc2_sqrt, adopt_bound, rho, grad_weight, LERP_W, QH_W,
    N: tl.constexpr, BASE: tl.constexpr, CLIP: tl.constexpr, ADOPT_CLIP: tl.constexpr,
    FIRST: tl.constexpr, X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    # BASE: 0 adam, 1 adopt, 2 sgdm; CLIP: 0 none, 1 coordinate, 2 norm (the order of BASES, CLIPS)
    chunk = tl.program_id(0)
    t = tl.load(CHUNK_TENSOR + chunk)
    start = tl.load(CHUNK_START + chunk)
    numel = tl.load(NUMELS + t)
    x_ptr = tl.load(PTRS + t).to(tl.pointer_type(X_DTYPE))
    g_ptr = tl.load(PTRS + T + t).to(tl.pointer_type(G_DTYPE))
    if BASE != 2:
        v_ptr = tl.load(PTRS + (2 + N) * T + t).to(tl.pointer_type(S_DTYPE))
    if CLIP == 2:
        scale = tl.load(SCALE).to(tl.float32)
    for block in tl.range(0, tl.minimum(CHUNK, numel - start), BLOCK):  # a tensor's last chunk may be short
        offs = start + block + tl.arange(0, BLOCK)
        mask = offs < numel
        # the gradient in the parameter's dtype (the torch path converts it), then clipped
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(X_DTYPE).to(tl.float32)
        if CLIP == 1:
            g = tl.minimum(tl.maximum(g, -rho), rho).to(X_DTYPE).to(tl.float32)
        if CLIP == 2:
            g = (g * scale).to(X_DTYPE).to(tl.float32)
        if BASE != 2:
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FIRST:  # ADOPT's first step: v = g², nothing else moves
            tl.store(v_ptr + offs, (v + g * g).to(S_DTYPE), mask=mask)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if BASE == 1:
                g_in = tl.div_rn(g, tl.maximum(tl.sqrt_rn(v), eps))  # ĝ = g / max(√v_{t−1}, ε)
                if ADOPT_CLIP:
                    g_in = tl.minimum(tl.maximum(g_in, -adopt_bound), adopt_bound)  # ±(t−1)^¼
            else:
                g_in = g
            if BASE == 0:
                x = x * decay  # x·(1−ηλ) first: torch's AdamW order
            direction = g_in * grad_weight  # (1−Σω)·g, then + Σ w_j·u_j
            for j in tl.static_range(N):
                u_ptr = tl.load(PTRS + (2 + j) * T + t).to(tl.pointer_type(S_DTYPE))
                u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w = LERP_W[j]  # u_j ← β1_j·u_j + (1−β1_j)·g as torch's lerp: two-sided around w = ½
                u = tl.where(w < 0.5, u + w * (g_in - u), g_in - (g_in - u) * (1 - w))
                tl.store(u_ptr + offs, u.to(S_DTYPE), mask=mask)
                direction = direction + QH_W[j] * u
            if BASE == 0:
                v = v * beta2 + one_minus_beta2 * g * g  # v ← β2·v + (1−β2)·g²
                denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # √v̂ + ε
                x = x + neg_lr * tl.div_rn(direction, denom)
            else:
                x = x * decay + neg_lr * direction
                if BASE == 1:
                    v = v * beta2 + one_minus_beta2 * g * g  # v last: ADOPT's order
            tl.store(x_ptr + offs, x.to(X_DTYPE), mask=mask)
            if BASE != 2:
                tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """The jitted kernel, made once per interpreter setting (``triton.jit`` reads TRITON_INTERPRET when
    it wraps a function; a process that sets it later still gets the interpreter's version)."""
    del interpret  # the cache key: triton.jit reads the environment itself
    return triton.jit(_local_adaptive_body)


_TL_DTYPES = {} if triton is None else {
    torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
}
# float64 is left to torch: the kernel computes in float32 and Triton passes float scalars as float32
DTYPES = tuple(_TL_DTYPES)


def takes(rows: Sequence[Sequence[Tensor]]) -> bool:
    """Whether the kernel takes these parameters' tensors (rows of x, g, u_j, v): dtypes in
    :data:`DTYPES`."""
    return all(t.dtype in _TL_DTYPES for row in rows for t in row)


@functools.lru_cache(maxsize=64)
def _chunk_table(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(tensor index, first element) of every chunk, and the tensors' sizes, on ``device``: built once
    per size list (the parameters of a dtype group do not change size)."""
    counts = [math.ceil(n / CHUNK) for n in numels]
    tensor = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(counts, dtype=torch.int64))
    first = torch.cat([torch.arange(c, dtype=torch.int64) * CHUNK for c in counts]) if counts else tensor
    return (tensor.to(device), first.to(device), torch.tensor(numels, dtype=torch.int64, device=device))


def _pointer_table(columns: Sequence[Sequence[Tensor]], device: torch.device) -> Tensor:
    """int64 [roles, T]: the data pointers, copied from pinned memory without blocking the host."""
    pointers = [[t.data_ptr() for t in col] for col in columns]
    pinned = device.type == "cuda"
    table = torch.tensor(pointers, dtype=torch.int64, pin_memory=pinned)
    return table.to(device, non_blocking=True) if pinned else table


def local_adaptive_(
    xs: Sequence[Tensor], gs: Sequence[Tensor], moments: Sequence[Sequence[Tensor]], vs: Optional[Sequence[Tensor]],
    *, base: str, lr: float, betas1: Sequence[float], omegas: Sequence[float], weight_decay: float,
    beta2: float = 0.0, eps: float = 0.0, step: int, bias_correction: bool = True,
    corrections1: Optional[Sequence[float]] = None, adopt_clip: bool = True, clip: str = "none",
    clip_threshold: float = 1.0, clip_scale: Optional[Tensor] = None,
) -> None:
    """One local step of ``base`` over lists (``moments`` indexed [j][i], ``vs`` None for sgdm), the
    optimizer's ``clip`` folded in (``clip_scale``: the 0-dim min(1, ρ/‖g‖) of ``norm``). Writes x, u_j,
    v in place; ``gs`` is only read. One launch per (device, dtypes) group of the tensors."""
    if base not in BASES or clip not in CLIPS:
        raise ValueError(f"base = {base!r}, clip = {clip!r}: allowed are {BASES} and {CLIPS}")
    n_moments = len(moments)
    adam, adopt = base == "adam", base == "adopt"
    if adopt and step == 1:  # ADOPT's first step only seeds v
        moments, n_moments = [], 0
    corrections = (corrections1 if corrections1 is not None else
                   [1 - b**step if bias_correction else 1.0 for b in betas1]) if adam else [1.0] * len(betas1)
    rows = [[xs[i], gs[i], *(col[i] for col in moments), *((vs[i],) if vs is not None else ())] for i in range(len(xs))]
    groups: dict[tuple, list[list[Tensor]]] = {}
    for row in rows:
        states = {t.dtype for t in row[2:]}
        if len(states) > 1:
            raise ValueError(f"the optimizer states of one parameter differ in dtype: {sorted(map(str, states))}")
        key = (row[0].device, row[0].dtype, row[1].dtype, states.pop() if states else row[0].dtype)
        groups.setdefault(key, []).append(row)
    scalars = dict(
        neg_lr=-lr, decay=1 - lr * weight_decay if weight_decay != 0 else 1.0, beta2=beta2,
        one_minus_beta2=1 - beta2, eps=eps, bc2_sqrt=(1 - beta2**step) ** 0.5 if adam and bias_correction else 1.0,
        adopt_bound=(step - 1) ** 0.25 if step > 1 else 0.0, rho=clip_threshold, grad_weight=1 - sum(omegas),
        # (0.0,) where no momentum steps (ADOPT's first step): a kernel argument is never an empty tuple
        LERP_W=tuple(1 - b for b in betas1[:n_moments]) or (0.0,),
        QH_W=tuple(w / c for w, c in zip(omegas[:n_moments], corrections)) or (0.0,),
    )
    flags = dict(N=n_moments, BASE=BASES.index(base), CLIP=CLIPS.index(clip), ADOPT_CLIP=adopt_clip,
                 FIRST=adopt and step == 1)
    kernel = _kernel(interpreting())
    for (device, x_dtype, g_dtype, s_dtype), group in groups.items():
        written_back: list[tuple[Tensor, Tensor]] = []

        def flat(t: Tensor, role: int) -> Tensor:
            if t.is_contiguous():
                return t
            copy = t.contiguous()
            if role != 1:  # the gradient is only read
                written_back.append((t, copy))
            return copy

        columns = [[flat(t, role) for t in col] for role, col in enumerate(zip(*group))]
        tensor, first, numels = _chunk_table(tuple(t.numel() for t in columns[0]), device)
        if tensor.numel() == 0:
            continue
        scale = clip_scale if clip == "norm" else numels  # an unread placeholder where there is no scale
        kernel[(tensor.numel(),)](
            _pointer_table(columns, device), numels, tensor, first, scale, len(columns[0]), **scalars, **flags,
            X_DTYPE=_TL_DTYPES[x_dtype], G_DTYPE=_TL_DTYPES[g_dtype], S_DTYPE=_TL_DTYPES[s_dtype],
            CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
        )
        for t, copy in written_back:
            t.copy_(copy)
