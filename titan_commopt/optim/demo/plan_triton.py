"""DeMo's DCT replicator in two Triton kernels, one pass each way per chunk (the torch twin is
``compress.dct.Chunker`` + ``compress.dct.topk_per_chunk`` + ``plan.Plan``).

- :func:`encode`: per ``c0 × c1`` chunk of a shard — read the chunk, forward DCT ``B₀ X B₁ᵀ``
  (two ``tl.dot``), DeMo-SGD's momentum ``m ← β·m + DCT(g)`` in place (eq. 2, coefficient
  domain), the ``k`` largest magnitudes by ``k`` rounds of max-and-mask (no sort), eq. 8's
  ``m[sel] ← m[sel] − λ·m[sel]``, and the selection (values, int64 positions in the chunk) written to
  ``(n_chunks, k)`` buffers; then, given the replicator's wire (``compress/packing_triton.py``), a second kernel (one
  warp per chunk) reads each chunk's ``k`` pairs back and writes their wire bytes into the send
  buffer — byte for byte what the codecs (``compress.packing``) write. Not inside the first kernel:
  its 64 × 64 tiles and rounds already fill the registers (``scripts/kernel_report.py``), and the
  pairs written and read back are 1–3 % of the bytes it moves per chunk (gradient, momentum twice).
- :func:`decode`: per chunk — every replica's ``k`` pairs (read from its wire bytes in place, or
  given decoded) summed into the dense chunk in replica order (the same bits on every replica), the
  mean (over all replicas, or over those that selected), the inverse DCT ``B₀ᵀ C B₁``, φ (sign or
  identity) and eq. 7 ``p ← p·(1 − η·wd) − η·φ(Q)`` on the parameter's chunk.

A vector is the matrix ``(1, numel)`` with chunks ``1 × c`` (``B₀ = [1]``), as ``Chunker`` treats it.
Chunk sizes need not be powers of two: tiles are padded to one (at least 16, what ``tl.dot`` takes)
and masked; a padded coefficient is never selected.

Ties: the max-and-mask rounds take the largest magnitude and, among equal ones, the smallest
position. ``torch.topk`` leaves the order of ties unspecified, so where a chunk holds ties at the
k-th magnitude (e.g. fewer than ``k`` non-zeros) the two paths may select different positions of
the same magnitude; each selection is a valid top-k. Values are returned largest first.

Precision: ``"ieee"`` (default) keeps the products in fp32 (within round-off of torch's fp32
matmuls); ``"tf32"`` uses TF32 tensor cores (about 1e-3 relative error in the transform).
"""

import torch
import triton
import triton.language as tl

from titan_commopt.compress.packing_triton import read_constexprs, read_selection, wire_of, words_for, write_selection

__all__ = ["PRECISIONS", "encode", "decode", "wire_of", "words_for"]

PRECISIONS = ("ieee", "tf32")


def _tile(c: int) -> int:
    return max(16, triton.next_power_of_2(c))


def _warps(t0: int, t1: int) -> int:
    """Warps per chunk: a 64 × 64 fp32 tile and its products fill 4 warps' registers twice over."""
    return 8 if t0 * t1 >= 4096 else 4


@triton.jit
def _encode_kernel(x_ptr, b0_ptr, b1_ptr, m_ptr, val_ptr, idx_ptr, rest, n1, beta, lam,
                   C0: tl.constexpr, C1: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, K: tl.constexpr,
                   MOMENTUM: tl.constexpr, PRECISION: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    i0, i1 = chunk // n1, chunk % n1
    a, b = tl.arange(0, T0), tl.arange(0, T1)
    in0, in1 = a < C0, b < C1
    inside = in0[:, None] & in1[None, :]
    x = tl.load(x_ptr + (i0 * C0 + a)[:, None] * rest + (i1 * C1 + b)[None, :], mask=inside, other=0.0)
    b0t = tl.load(b0_ptr + a[None, :] * C0 + a[:, None], mask=in0[:, None] & in0[None, :], other=0.0)
    b1t = tl.load(b1_ptr + b[None, :] * C1 + b[:, None], mask=in1[:, None] & in1[None, :], other=0.0)
    xb = tl.dot(x.to(tl.float32), b1t, input_precision=PRECISION)  # X B₁ᵀ
    # B₀ X B₁ᵀ, the chunk's DCT-II, as ((X B₁ᵀ)ᵀ B₀ᵀ)ᵀ: the same products summed in the same order,
    # with the fresh X B₁ᵀ as first operand. The operands are read from shared memory first one,
    # then the other: a B₀ read first stays live across the barrier before X B₁ᵀ can be read
    # (sm_90, 8 warps: 104 B stack with B₀ · X B₁ᵀ, none so).
    c = tl.trans(tl.dot(tl.trans(xb), b0t, input_precision=PRECISION))
    pos = a[:, None] * C1 + b[None, :]  # position in the chunk-major row of L = C0·C1
    row = chunk * (C0 * C1)
    if MOMENTUM:  # eq. 2 in the coefficient domain: m ← β·m + DCT(g), one fma as torch.add(c, m, alpha=β)
        # An fma after the dot, not c + β·m, which Triton folds into the dot's accumulator: m's layout
        # conversion (a barrier) then sits between the dot's operand reads from shared memory and its
        # products, holding the 512 operand values per thread across it (sm_90, 8 warps: 64
        # registers and 2960 B stack, 255 and 0 B so).
        c = tl.fma(tl.load(m_ptr + row + pos, mask=inside, other=0.0), beta, c)
    # NaN counts as the largest magnitude, as in torch.topk (and every round then finds a position)
    mag = tl.where(inside, tl.where(c != c, float("inf"), tl.abs(c)), -1.0)
    for j in range(K):  # k rounds of max-and-mask: the largest magnitude, ties to the smallest position
        best = tl.max(tl.max(mag, 1), 0)
        at = tl.min(tl.min(tl.where(mag == best, pos, C0 * C1), 1), 0)
        hit = pos == at
        v = tl.sum(tl.sum(tl.where(hit, c, 0.0), 1), 0)
        tl.store(val_ptr + chunk * K + j, v)
        tl.store(idx_ptr + chunk * K + j, at.to(tl.int64))
        mag = tl.where(hit, -1.0, mag)
        if MOMENTUM:  # eq. 8: m[sel] −= λ·m[sel], as the torch path's scatter_add_ of −λ·values
            c = tl.where(hit, c + v * (-lam), c)
    if MOMENTUM:
        tl.store(m_ptr + row + pos, c, mask=inside)


@triton.jit
def _wire_kernel(val_ptr, idx_ptr, words_ptr, table_ptr, value_bit, index_bit, n_chunks, shard_value_bits,
                 shard_index_bits, K: tl.constexpr, TK: tl.constexpr, L: tl.constexpr, VALUES: tl.constexpr,
                 FLOAT_BITS: tl.constexpr, BF16: tl.constexpr, SIGN: tl.constexpr, INDEX_BITS: tl.constexpr,
                 COMPACT: tl.constexpr, EF_LOW: tl.constexpr, EF_RANKED: tl.constexpr, EF_HIGH_BITS: tl.constexpr,
                 EF_H: tl.constexpr, LOW_BYTES: tl.constexpr, TW_V: tl.constexpr, TW_I: tl.constexpr,
                 TW_H: tl.constexpr):
    """One chunk's selection (``K`` pairs of the encode kernel's output) → its wire bytes."""
    row = tl.program_id(0).to(tl.int64)
    shard, chunk = row // n_chunks, row % n_chunks
    lane = tl.arange(0, TK)
    valid = lane < K
    vals = tl.load(val_ptr + row * K + lane, mask=valid, other=0.0)
    idx = tl.load(idx_ptr + row * K + lane, mask=valid, other=0)
    write_selection(words_ptr, table_ptr, value_bit + shard * shard_value_bits, index_bit + shard * shard_index_bits,
                    chunk, vals, idx, valid, K, L, VALUES, FLOAT_BITS, BF16, SIGN, INDEX_BITS, COMPACT, EF_LOW,
                    EF_RANKED, EF_HIGH_BITS, EF_H, LOW_BYTES, TW_V, TW_I, TW_H)


@triton.jit
def _decode_kernel(val_ptr, idx_ptr, weight_ptr, bytes_ptr, table_ptr, value_bit, index_bit, dense_ptr, count_ptr,
                   b0_ptr, b1_ptr, p_ptr, W, replicas, replica_stride, rest, n1, lr, decay,
                   C0: tl.constexpr, C1: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, K: tl.constexpr,
                   TK: tl.constexpr, MEAN_SELECTED: tl.constexpr, SIGN: tl.constexpr, DECAY: tl.constexpr,
                   PRECISION: tl.constexpr, WIRE: tl.constexpr, VALUES: tl.constexpr, FLOAT_BITS: tl.constexpr,
                   BF16: tl.constexpr, INDEX_BITS: tl.constexpr, COMPACT: tl.constexpr,
                   EF_LOW: tl.constexpr, EF_RANKED: tl.constexpr, EF_HIGH_BITS: tl.constexpr, EF_H: tl.constexpr,
                   LOW_BYTES: tl.constexpr, TN: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    i0, i1 = chunk // n1, chunk % n1
    a, b = tl.arange(0, T0), tl.arange(0, T1)
    in0, in1 = a < C0, b < C1
    inside = in0[:, None] & in1[None, :]
    pos = a[:, None] * C1 + b[None, :]
    row = chunk * (C0 * C1)
    tl.store(dense_ptr + row + pos, tl.zeros((T0, T1), tl.float32), mask=inside)
    if MEAN_SELECTED:
        tl.store(count_ptr + row + pos, tl.zeros((T0, T1), tl.float32), mask=inside)
    j = tl.arange(0, TK)
    sel = j < K
    tl.debug_barrier()
    replica_bytes = bytes_ptr  # replica w's row of the gathered bytes (pointer arithmetic is 64-bit)
    for w in range(W):  # replica order: ((0 + q₀) + q₁) + …, as compress.dct.accumulate_chunks_
        if WIRE:  # replica w's bytes of this chunk, read in place (``packing_triton``)
            v, at, n = read_selection(replica_bytes, table_ptr, value_bit, index_bit, chunk, j, K, VALUES, FLOAT_BITS,
                                      BF16, INDEX_BITS, COMPACT, EF_LOW, EF_RANKED, EF_HIGH_BITS, EF_H, LOW_BYTES, TN)
            replica_bytes += replica_stride
            if not MEAN_SELECTED:  # eq. 6: each replica's values divided by W, as the torch path
                v = tl.math.div_rn(v, replicas)
        else:
            pair = w * replica_stride + chunk * K + j
            at = tl.load(idx_ptr + pair, mask=sel, other=0)
            v = tl.load(val_ptr + pair, mask=sel, other=0.0)
            if MEAN_SELECTED:
                n = tl.load(weight_ptr + pair, mask=sel, other=0.0)
        # Only the pairs that add something: the compact sign code sends a chunk's zeros as repeats of
        # one position, and lanes that store to one address keep one lane's sum, not all of them.
        # The rest of a replica's positions are distinct (and adding 0 changes no bit of the sum).
        if MEAN_SELECTED:
            adds = sel & ((v != 0) | (n != 0))
            tl.store(count_ptr + row + at, tl.load(count_ptr + row + at, mask=adds, other=0.0) + n, mask=adds)
        else:
            adds = sel & (v != 0)
        tl.store(dense_ptr + row + at, tl.load(dense_ptr + row + at, mask=adds, other=0.0) + v, mask=adds)
        tl.debug_barrier()  # a replica's positions are distinct; the next replica may hit the same ones
    dense = tl.load(dense_ptr + row + pos, mask=inside, other=0.0)
    if MEAN_SELECTED:  # eq. 6 over the replicas that selected the coefficient
        dense = dense / tl.maximum(tl.load(count_ptr + row + pos, mask=inside, other=1.0), 1.0)
    b0 = tl.load(b0_ptr + a[:, None] * C0 + a[None, :], mask=in0[:, None] & in0[None, :], other=0.0)
    b1 = tl.load(b1_ptr + b[:, None] * C1 + b[None, :], mask=in1[:, None] & in1[None, :], other=0.0)
    cb = tl.dot(dense, b1, input_precision=PRECISION)  # C B₁
    # B₀ᵀ C B₁ as ((C B₁)ᵀ B₀)ᵀ, the fresh C B₁ first, as in the encode kernel (sm_90, 8 warps: 255
    # registers and 168 B stack with B₀ᵀ · C B₁, 80 and none so)
    q = tl.trans(tl.dot(tl.trans(cb), b0, input_precision=PRECISION))
    if SIGN:  # φ = sign (torch.sign: 0 stays 0)
        q = tl.where(q > 0, 1.0, tl.where(q < 0, -1.0, 0.0))
    at_p = p_ptr + (i0 * C0 + a)[:, None] * rest + (i1 * C1 + b)[None, :]
    x = tl.load(at_p, mask=inside, other=0.0)
    update = q.to(x.dtype).to(tl.float32)  # the torch path casts φ(Q) to the parameter's dtype first
    if DECAY:  # eq. 7's decoupled weight decay, rounded to the parameter's dtype as x.mul_ does
        x = (x.to(tl.float32) * decay).to(x.dtype)
    tl.store(at_p, (x.to(tl.float32) + update * (-lr)).to(x.dtype), mask=inside)


def _check(x: torch.Tensor, shape: tuple) -> None:
    if not x.is_contiguous() or tuple(x.shape) != tuple(shape):
        raise ValueError(f"expected a contiguous shard of shape {tuple(shape)}, got {tuple(x.shape)} "
                         f"(contiguous: {x.is_contiguous()})")


def _geometry(chunker) -> tuple[int, int, int, int]:
    """``(rest, n1, c0, c1)`` of a chunker: a vector is the matrix ``(1, numel)``."""
    if len(chunker.dims) == 1:
        return chunker.numel, chunker.counts[0], 1, chunker.chunks[0]
    return chunker.dims[1], chunker.counts[1], chunker.chunks[0], chunker.chunks[1]


def _bases(chunker) -> tuple[torch.Tensor, torch.Tensor]:
    if len(chunker.dims) == 1:
        return torch.ones(1, 1, device=chunker.device), chunker.bases[0]
    return chunker.bases[0], chunker.bases[1]


def encode(chunker, xs, k: int, values: torch.Tensor, indices: torch.Tensor,
           momentum: torch.Tensor | None = None, beta: float = 0.0, lam: float = 0.0, precision: str = "ieee",
           wire=None, words: torch.Tensor | None = None, value_byte: int = 0, index_byte: int = 0) -> None:
    """Shards ``xs`` (each ``chunker.shape``, contiguous, float32 or bf16) → their chunks' top-``k``
    into ``values`` (float32) and ``indices`` (int64), each ``(len(xs)·n_chunks, k)``.

    ``momentum``: DeMo-SGD's coefficient-domain momentum ``(len(xs)·n_chunks, L)``, float32: updated in
    place (``β·m + DCT(x)``), the top-k taken of it, then ``λ`` times the selection subtracted (eq. 8);
    ``None``: the top-k of ``DCT(x)`` itself (the decoupled AdamW base).

    ``wire`` (a ``packing_triton.Wire`` of the shards' replicator) with ``words`` (the send buffer as
    int32 words, zeroed): the selection's wire bytes written there too — shard ``i``'s values at byte
    ``value_byte + i·wire.value_bytes``, its indices at ``index_byte + i·wire.index_bytes`` — what the
    replicator's ``write`` puts there, by a second, light kernel that reads the ``k`` pairs per chunk
    back (see the module docstring for why not inside the first)."""
    rest, n1, c0, c1 = _geometry(chunker)
    b0, b1 = _bases(chunker)
    n = chunker.n_chunks
    for i, x in enumerate(xs):
        _check(x, chunker.shape)
        m = momentum[i * n: (i + 1) * n] if momentum is not None else values  # (unused without momentum)
        _encode_kernel[(n,)](x, b0, b1, m, values[i * n: (i + 1) * n], indices[i * n: (i + 1) * n], rest, n1,
                             float(beta), float(lam), C0=c0, C1=c1, T0=_tile(c0), T1=_tile(c1), K=k,
                             MOMENTUM=momentum is not None, PRECISION=precision, num_warps=_warps(_tile(c0), _tile(c1)))
    if wire is not None:
        _wire_kernel[(len(xs) * n,)](values, indices, words, wire.table if wire.table is not None else words,
                                     8 * value_byte, 8 * index_byte, n, 8 * wire.value_bytes, 8 * wire.index_bytes,
                                     K=k, TK=max(2, triton.next_power_of_2(k)), L=chunker.L, **wire.constexprs(),
                                     num_warps=1)


def decode(chunker, values: torch.Tensor | None, indices: torch.Tensor | None, params, lrs, weight_decays,
           sign: bool, selected: torch.Tensor | None = None, dense: torch.Tensor | None = None,
           count: torch.Tensor | None = None, precision: str = "ieee", wire=None, payloads: torch.Tensor | None = None,
           value_byte: int = 0, index_byte: int = 0, mean_selected: bool = False) -> None:
    """Every replica's selection → eq. 7 on each shard of ``params``.

    The selection comes either decoded — ``values`` (float32) and ``indices`` (int64), ``(W,
    len(params)·n_chunks, k)``, replica order; for the plain mean (eq. 6) the values already divided
    by ``W``; ``selected``: with ``mean_selected``, ``(W, rows, k)`` float32 weights (1 where a pair is
    a selection), and the sum is divided by the number of replicas that selected each coefficient —
    or as wire bytes: ``wire`` (a ``packing_triton.Wire``) and ``payloads`` (``(W, bytes)`` uint8, every
    replica's send buffer), shard ``i``'s values at byte ``value_byte + i·wire.value_bytes`` and its
    indices at ``index_byte + i·wire.index_bytes`` of each row, read inside the kernel
    (``mean_selected`` says which mean). ``params``: the contiguous local shards
    (float32/bf16/fp16, ``chunker.shape``), updated in place with their own ``lrs`` and
    ``weight_decays``; ``sign``: φ = sign, else identity. ``dense`` (and ``count``, with the
    selected mean): optional float32 scratch of at least ``rows·L`` elements for the dense chunks (and
    their counts)."""
    rest, n1, c0, c1 = _geometry(chunker)
    b0, b1 = _bases(chunker)
    n, L = chunker.n_chunks, chunker.L
    if wire is not None:
        W, k, rows = payloads.shape[0], wire.k, len(params) * n
        payloads = payloads if payloads.stride(1) == 1 else payloads.contiguous()
        mean_selected, stride = bool(mean_selected), payloads.stride(0)
        table = wire.table if wire.table is not None else payloads
    else:
        W, rows, k = values.shape
        mean_selected, stride = selected is not None, rows * k
        values, indices = values.contiguous(), indices.contiguous()
        table = values
    dense = _scratch(dense, rows * L, params[0].device)
    count = _scratch(count, rows * L, params[0].device) if mean_selected else dense  # (unused then)
    weights = selected.contiguous() if selected is not None else values  # (unused without selected)
    for i, (p, lr, wd) in enumerate(zip(params, lrs, weight_decays)):
        _check(p, chunker.shape)
        span, cells = slice(i * n, (i + 1) * n), slice(i * n * L, (i + 1) * n * L)
        if wire is not None:  # (the decoded-selection pointers are unused)
            pointers = (payloads, payloads, payloads, payloads, table, 8 * (value_byte + i * wire.value_bytes),
                        8 * (index_byte + i * wire.index_bytes))
        else:
            pointers = (values[:, span], indices[:, span], weights[:, span], values, table, 0, 0)
        _decode_kernel[(n,)](*pointers, dense[cells], count[cells], b0, b1, p, W, float(W), stride, rest, n1, float(lr),
                             1.0 - lr * wd, C0=c0, C1=c1, T0=_tile(c0), T1=_tile(c1), K=k,
                             TK=max(2, triton.next_power_of_2(k)), MEAN_SELECTED=mean_selected, SIGN=sign,
                             DECAY=wd != 0, PRECISION=precision, WIRE=wire is not None, **read_constexprs(wire),
                             num_warps=_warps(_tile(c0), _tile(c1)))


def _scratch(buf: torch.Tensor | None, n: int, device) -> torch.Tensor:
    return torch.empty(n, device=device) if buf is None else buf.view(-1)[:n]
