"""The DeMo replicator's wire bytes written (and read) inside Triton kernels; the torch twin is
``compress.packing`` (``ValueCodec``, ``IndexCodec``, ``CompactCodec``), whose byte layout this
module reproduces bit for bit:

- a stream of bit fields, little-endian bit order: bit ``j`` of a region is bit ``j mod 8`` of its
  byte ``j // 8`` — and so bit ``j mod 32`` of the little-endian 32-bit word ``j // 32`` of an aligned
  buffer, which is how the kernels address it (every GPU Triton targets is little-endian);
- the ``packed`` wire: per shard, its ``n_chunks·k`` values back to back (ternary codes ``v + 1`` in
  2 bits, or the wire dtype's raw bits) and then, in its own region, its indices back to back in
  ``ceil(log2 L)`` bits (64 without ``pack``: int64), pairs in the order the kernel selected them;
- the ``compact`` wire: per chunk, its pairs in position order; values as the wire dtype's bits, or
  with ``sign`` one bit per pair (a zero pair repeats the position before it; the all-zero chunk and
  ``k = 1`` are marked as ``CompactCodec`` says); positions as Elias–Fano low bits (a run over the
  shard) then high parts (a rank of ``high_bits`` bits, or a ``k + H``-bit bitmap, per chunk).

A kernel writes one *run* (a chunk's fields of one kind) at a time with :func:`put_run`: the run's
32-bit words are built in registers, the words wholly inside it stored, and its first and last words,
which a neighbouring run may share, OR-ed in atomically — so the buffer must start zeroed. The result
does not depend on the order in which programs run.

Rounding to the wire dtype: bf16 by round-to-nearest-even on the bits (NaN → ``0x7FC0``), exactly
torch's ``.to(torch.bfloat16)`` (Triton's interpreter truncates instead); fp16 by Triton's cast (RNE
on GPUs and in the interpreter).
"""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

__all__ = ["VALUE_FLOAT", "VALUE_TERNARY", "VALUE_SIGN_BITS", "FLOAT_BITS", "MAX_TK", "Wire", "wire_of",
           "read_constexprs", "words_for", "put_run", "float_field", "rank_in_chunk", "write_selection", "get_fields", "float_of",
           "read_selection"]

# how the values travel (a constexpr of the kernels)
VALUE_FLOAT, VALUE_TERNARY, VALUE_SIGN_BITS = 0, 1, 2
# the wire dtype as a constexpr: its width in bits (bf16 and fp16 told apart by BF16)
FLOAT_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}

MAX_TK = 64  # a chunk's pairs are ranked with a (k × k) comparison in registers: larger k stays on torch
MAX_RUN_CELLS = 8192  # words × pairs of the register tile that builds a run's words


@dataclass(frozen=True)
class Wire:
    """One DeMo replicator's wire as the kernels' constexprs (see the module docstring).

    ``values``: ``VALUE_*``; ``float_bits``/``bf16``: the wire dtype of float values; ``sign``: float
    values are the selection's signs (the packed wire with ``sign_before_sync`` and no ``pack``);
    ``index_bits``: bits per packed index (64: int64), 0 for the compact wire; ``compact`` with
    ``ef_low`` (l), ``ef_ranked``, ``ef_high_bits`` and ``ef_H``; per shard ``value_bytes``,
    ``index_bytes`` and ``low_bytes`` (the compact low-bit run's bytes, where its high run starts);
    ``table``: the binomials ``C(u, j)`` of the ranked compact code (``(k + 1, k + H)`` int64)."""

    k: int
    values: int
    float_bits: int
    bf16: bool
    sign: bool
    index_bits: int
    compact: bool
    ef_low: int
    ef_ranked: bool
    ef_high_bits: int
    ef_H: int
    value_bytes: int
    index_bytes: int
    low_bytes: int
    table: Optional[torch.Tensor]
    tiles: tuple[int, int, int]  # TW of the value, index (or low-bit) and high runs: see put_run

    def constexprs(self) -> dict[str, Any]:
        """:func:`write_selection`'s constexprs."""
        return dict(**_layout(self), SIGN=self.sign, TW_V=self.tiles[0], TW_I=self.tiles[1], TW_H=self.tiles[2])


def _layout(wire: Optional[Wire]) -> dict[str, Any]:
    """The constexprs both sides take: how the fields lie (any values where there is no wire)."""
    if wire is None:
        return dict(VALUES=0, FLOAT_BITS=32, BF16=False, INDEX_BITS=0, COMPACT=False, EF_LOW=0, EF_RANKED=False,
                    EF_HIGH_BITS=0, EF_H=0, LOW_BYTES=0)
    return dict(VALUES=wire.values, FLOAT_BITS=wire.float_bits, BF16=wire.bf16, INDEX_BITS=wire.index_bits,
                COMPACT=wire.compact, EF_LOW=wire.ef_low, EF_RANKED=wire.ef_ranked, EF_HIGH_BITS=wire.ef_high_bits,
                EF_H=wire.ef_H, LOW_BYTES=wire.low_bytes)


def read_constexprs(wire: Optional[Wire]) -> dict[str, Any]:
    """:func:`read_selection`'s constexprs (placeholders for a kernel that is given no wire)."""
    tn = triton.next_power_of_2(wire.k + wire.ef_H) if wire is not None and wire.compact else 1
    return dict(**_layout(wire), TN=tn)


def _words_tile(bits: int) -> int:
    """``TW`` of :func:`put_run` for a run of ``bits`` bits at any bit offset."""
    return triton.next_power_of_2(bits // 32 + 2)


def wire_of(rep, device) -> Optional[Wire]:
    """The wire of ``rep`` (a ``compress.replicators.DeMoReplicator``, read by its attributes), or
    ``None`` where the kernels do not write it (``k > MAX_TK``, or a run too long for the register
    tile): the codecs then pack the kernel's selection."""
    k, L = rep.k, rep.chunker.L
    tk = triton.next_power_of_2(k)
    if tk > MAX_TK:
        return None
    vc, compact = rep.value_codec, rep.compact
    fbits, bf16 = FLOAT_BITS[vc.wire_dtype], vc.wire_dtype == torch.bfloat16
    if compact is None:
        values = VALUE_TERNARY if vc.ternary else VALUE_FLOAT
        ibits = rep.index_codec.bits if rep.index_codec.pack else 64
        runs = [(k * (2 if values == VALUE_TERNARY else fbits), k), (k * ibits, k), (0, 1)]  # no high run
        fields = dict(values=values, float_bits=fbits, bf16=bf16, sign=vc.sign, index_bits=ibits, compact=False,
                      ef_low=0, ef_ranked=False, ef_high_bits=0, ef_H=0, low_bytes=0, table=None)
    else:
        ef = compact.positions
        values = VALUE_SIGN_BITS if compact.sign else VALUE_FLOAT
        high = (ef.high_bits, 1) if ef.ranked else (k + ef.H, k)
        runs = [(compact.value_bits if compact.sign else k * fbits, k), (k * max(ef.l, 1), k), high]
        fields = dict(values=values, float_bits=fbits, bf16=bf16, sign=False, index_bits=0, compact=True,
                      ef_low=ef.l, ef_ranked=ef.ranked, ef_high_bits=ef.high_bits, ef_H=ef.H,
                      low_bytes=compact.low_bytes(rep.chunker.n_chunks),
                      table=ef.binomials(device) if ef.ranked else None)
    tiles = tuple(_words_tile(bits) for bits, _ in runs)
    if any(tw * tk > MAX_RUN_CELLS for tw in tiles):
        return None
    bitmap = compact is not None and not compact.positions.ranked
    if bitmap and tk * triton.next_power_of_2(k + compact.positions.H) > MAX_RUN_CELLS:
        return None  # the bitmap's positions are read back with a (k × (k + H)) count
    return Wire(k=k, value_bytes=rep.value_bytes, index_bytes=rep.index_bytes, tiles=tiles, **fields)


def words_for(nbytes: int) -> int:
    """32-bit words that hold ``nbytes`` bytes (the zeroed buffer a kernel writes into)."""
    return math.ceil(nbytes / 4)


# ---- device functions ----------------------------------------------------------------------------
@triton.jit
def put_run(words_ptr, run_bit, fields, slots, valid, FIELD_BITS: tl.constexpr, RUN_BITS: tl.constexpr,
            TW: tl.constexpr):
    """OR the ``fields`` (int64 vector, each ``< 2**FIELD_BITS``, ``FIELD_BITS ≤ 64``) into field slots
    ``slots`` (int64) of the run of ``RUN_BITS`` bits that starts at absolute bit ``run_bit`` (an
    int64 scalar) of the int32 buffer ``words_ptr``; ``valid`` masks the vector's padding. ``TW``: a
    power of two above the words the run spans (``RUN_BITS // 32 + 2`` at most)."""
    first = run_bit >> 5
    n_words = ((run_bit & 31) + RUN_BITS + 31) >> 5
    t = tl.arange(0, TW).to(tl.int64)
    # d: where each field's bit 0 lands relative to bit 0 of each word of the run ([words, fields])
    d = (run_bit + slots * FIELD_BITS)[None, :] - (first + t)[:, None] * 32
    f = tl.where(valid, fields, 0)[None, :]
    up = (f << tl.minimum(tl.maximum(d, 0), 31)) & 0xFFFFFFFF  # the field starts inside this word
    down = ((f >> tl.minimum(tl.maximum(-d, 0), 62)) >> tl.where(-d > 62, 1, 0)) & 0xFFFFFFFF  # or before it
    part = tl.where(d >= 0, tl.where(d < 32, up, 0), tl.where(-d < FIELD_BITS, down, 0))
    word = tl.sum(part, 1)  # the fields' bits are disjoint: their sum is their OR
    shared = (t == 0) | (t == n_words - 1)  # a neighbouring run may write into these two
    value = word.to(tl.int32)  # the low 32 bits, as a two's-complement int32
    inside = t < n_words
    tl.atomic_or(words_ptr + first + t, value, mask=inside & shared & (word != 0))
    tl.store(words_ptr + first + t, value, mask=inside & ~shared)


@triton.jit
def float_field(v, FLOAT_BITS: tl.constexpr, BF16: tl.constexpr):
    """The raw bits of ``v`` (float32) in the wire dtype, as int64 fields, rounded as torch rounds."""
    if FLOAT_BITS == 32:
        bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    elif BF16:  # round to nearest even on the fp32 bits; NaN → torch's quiet NaN 0x7FC0
        u = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        bits = tl.where(v != v, 0x7FC0, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    else:
        bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
    return bits


@triton.jit
def rank_in_chunk(keys, valid):
    """Each key's rank among the valid ``keys`` (distinct int64): where it lands in ascending order."""
    below = (keys[None, :] < keys[:, None]) & valid[None, :]
    return tl.sum(below.to(tl.int64), 1)


@triton.jit
def write_selection(words_ptr, table_ptr, value_bit, index_bit, chunk, vals, idx, valid,
                    K: tl.constexpr, L: tl.constexpr, VALUES: tl.constexpr, FLOAT_BITS: tl.constexpr,
                    BF16: tl.constexpr, SIGN: tl.constexpr, INDEX_BITS: tl.constexpr, COMPACT: tl.constexpr,
                    EF_LOW: tl.constexpr, EF_RANKED: tl.constexpr, EF_HIGH_BITS: tl.constexpr, EF_H: tl.constexpr,
                    LOW_BYTES: tl.constexpr, TW_V: tl.constexpr, TW_I: tl.constexpr, TW_H: tl.constexpr):
    """One chunk's selection (``vals`` float32, ``idx`` int64 positions in the chunk, ``K`` valid of
    the vectors) into the wire of its shard, whose value and index regions start at absolute bits
    ``value_bit`` and ``index_bit`` of ``words_ptr``; ``chunk``: the chunk's number in the shard."""
    if not COMPACT:  # the packed wire: pairs in the order they were selected
        slots = tl.arange(0, vals.shape[0]).to(tl.int64)
        if VALUES == 1:  # ternary: sign + 1 in 2 bits
            code = tl.where(vals > 0, 2, tl.where(vals < 0, 0, 1)).to(tl.int64)
            put_run(words_ptr, value_bit + chunk * (K * 2), code, slots, valid, 2, K * 2, TW_V)
        else:
            v = vals
            if SIGN:
                v = tl.where(vals > 0, 1.0, tl.where(vals < 0, -1.0, 0.0))
            put_run(words_ptr, value_bit + chunk * (K * FLOAT_BITS), float_field(v, FLOAT_BITS, BF16), slots, valid,
                    FLOAT_BITS, K * FLOAT_BITS, TW_V)
        put_run(words_ptr, index_bit + chunk * (K * INDEX_BITS), idx, slots, valid, INDEX_BITS, K * INDEX_BITS, TW_I)
    else:  # the compact wire: pairs in position order (with sign bits, the non-zeros first)
        nonzero = vals != 0  # NaN counts as non-zero, as in the codec
        if VALUES == 2:
            slots = rank_in_chunk(idx + tl.where(nonzero, 0, L), valid)
            count = tl.sum((nonzero & valid).to(tl.int32), 0)
            last = tl.max(tl.where(nonzero & valid, idx, 0), 0)  # the last non-zero's position (0: none)
            pos = tl.where(nonzero, idx, last)  # a zero repeats the position before it
            negative = ((vals < 0) & nonzero).to(tl.int64)
            run_bits: tl.constexpr = K + (K == 1)
            if K >= 2:  # the all-zero chunk's mark: the sign bit of its (repeated) second pair
                negative = tl.where((count == 0) & (slots == 1), 1, negative)
            put_run(words_ptr, value_bit + chunk * run_bits, negative, slots, valid, 1, run_bits, TW_V)
            if K == 1:  # k = 1: a second bit says whether the value is non-zero
                put_run(words_ptr, value_bit + chunk * run_bits, nonzero.to(tl.int64), slots + 1, valid, 1,
                        run_bits, TW_V)
        else:
            slots = rank_in_chunk(idx, valid)
            pos = idx
            put_run(words_ptr, value_bit + chunk * (K * FLOAT_BITS), float_field(vals, FLOAT_BITS, BF16), slots,
                    valid, FLOAT_BITS, K * FLOAT_BITS, TW_V)
        if EF_LOW > 0:
            put_run(words_ptr, index_bit + chunk * (K * EF_LOW), pos & ((1 << EF_LOW) - 1), slots, valid, EF_LOW,
                    K * EF_LOW, TW_I)
        unary = (pos >> EF_LOW) + slots  # u_i = h_i + i, strictly increasing in slot order
        high_bit = index_bit + LOW_BYTES * 8
        if EF_RANKED:  # Σ_i C(u_i, i + 1): the subset's rank in the combinatorial number system
            binomial = tl.load(table_ptr + (slots + 1) * (K + EF_H) + unary, mask=valid, other=0)
            rank = tl.sum(tl.where(valid, binomial, 0), 0)
            lane0 = tl.arange(0, vals.shape[0]) == 0  # a run of one field: the rank in lane 0
            put_run(words_ptr, high_bit + chunk * EF_HIGH_BITS, tl.where(lane0, rank, 0), slots * 0, lane0,
                    EF_HIGH_BITS, EF_HIGH_BITS, TW_H)
        else:  # the unary bitmap: bit u_i of the chunk's k + H bits
            put_run(words_ptr, high_bit + chunk * (K + EF_H), tl.full(unary.shape, 1, tl.int64), unary, valid, 1,
                    K + EF_H, TW_H)


@triton.jit
def get_fields(bytes_ptr, bit, valid, FIELD_BITS: tl.constexpr):
    """The fields of ``FIELD_BITS`` bits (≤ 64) at absolute bits ``bit`` (int64 vector) of the
    ``uint8`` buffer ``bytes_ptr``, as int64 (bytes are read one by one: any alignment, nothing
    past a field's last byte)."""
    TB: tl.constexpr = triton.next_power_of_2((FIELD_BITS + 14) // 8)  # bytes a field can span
    first = bit >> 3
    s = bit & 7
    t = tl.arange(0, TB).to(tl.int64)
    span = (s + FIELD_BITS + 7) >> 3
    b = tl.load(bytes_ptr + first[:, None] + t[None, :], mask=valid[:, None] & (t[None, :] < span[:, None]),
                other=0).to(tl.int64) & 0xFF
    shift = 8 * t[None, :] - s[:, None]  # where byte t's bit 0 lands in the field
    part = tl.where(shift >= 0, b << tl.minimum(tl.maximum(shift, 0), 63), b >> tl.minimum(tl.maximum(-shift, 0), 7))
    value = tl.sum(part, 1)  # disjoint bits: the sum is the OR
    if FIELD_BITS < 64:
        value = value & ((1 << FIELD_BITS) - 1)
    return value


@triton.jit
def float_of(bits, FLOAT_BITS: tl.constexpr, BF16: tl.constexpr):
    """Inverse of :func:`float_field`: the wire dtype's bits → float32 (exact)."""
    if FLOAT_BITS == 32:
        v = bits.to(tl.int32).to(tl.float32, bitcast=True)
    elif BF16:
        v = (bits << 16).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _shift_up(x, lane):
    """``x`` moved one lane up: lane ``i`` gets lane ``i − 1``'s value (lane 0 gets 0)."""
    return tl.sum(tl.where(lane[None, :] == lane[:, None] - 1, x[None, :], 0), 1)


@triton.jit
def read_selection(bytes_ptr, table_ptr, value_bit, index_bit, chunk, lane,
                   K: tl.constexpr, VALUES: tl.constexpr, FLOAT_BITS: tl.constexpr,
                   BF16: tl.constexpr, INDEX_BITS: tl.constexpr, COMPACT: tl.constexpr,
                   EF_LOW: tl.constexpr, EF_RANKED: tl.constexpr, EF_HIGH_BITS: tl.constexpr, EF_H: tl.constexpr,
                   LOW_BYTES: tl.constexpr, TN: tl.constexpr):
    """Inverse of :func:`write_selection` for one chunk of one replica's bytes: ``(values float32,
    positions int64, sent)`` over ``lane`` (``K`` valid lanes); ``sent``: 1.0 where a pair is a
    selection (0.0: a zero the compact sign code sends as a repeat, which adds nothing). ``TN``: a
    power of two ≥ ``K + EF_H`` (the compact high part's universe)."""
    valid = lane < K
    sent = tl.where(valid, 1.0, 0.0)
    if not COMPACT:
        if VALUES == 1:
            vals = (get_fields(bytes_ptr, value_bit + (chunk * K + lane) * 2, valid, 2) - 1).to(tl.float32)
        else:
            vals = float_of(get_fields(bytes_ptr, value_bit + (chunk * K + lane) * FLOAT_BITS, valid, FLOAT_BITS),
                            FLOAT_BITS, BF16)
        pos = get_fields(bytes_ptr, index_bit + (chunk * K + lane) * INDEX_BITS, valid, INDEX_BITS)
    else:
        if EF_LOW > 0:
            low = get_fields(bytes_ptr, index_bit + (chunk * K + lane) * EF_LOW, valid, EF_LOW)
        else:
            low = lane.to(tl.int64) * 0
        high_bit = index_bit + LOW_BYTES * 8
        unary = lane.to(tl.int64) * 0
        if EF_RANKED:  # unranking, largest first: u_i = the largest u with C(u, i + 1) ≤ what is left
            first = lane == 0
            rank = tl.sum(get_fields(bytes_ptr, high_bit + chunk * EF_HIGH_BITS + lane * 0, first, EF_HIGH_BITS), 0)
            u = tl.arange(0, TN)
            for r in range(K):
                i = K - 1 - r
                row = tl.load(table_ptr + (i + 1) * (K + EF_H) + u, mask=u < K + EF_H, other=1 << 62)
                at = tl.sum((row <= rank).to(tl.int64), 0) - 1
                rank -= tl.sum(tl.where(u == at, row, 0), 0)
                unary = tl.where(lane == i, at, unary)
        else:  # the bitmap: u_i is where the running count of set bits reaches i + 1
            u = tl.arange(0, TN).to(tl.int64)
            bits = get_fields(bytes_ptr, high_bit + chunk * (K + EF_H) + u, u < K + EF_H, 1)
            count = tl.cumsum(bits, 0)
            unary = tl.sum((count[None, :] < (lane + 1).to(tl.int64)[:, None]).to(tl.int64), 1)
        pos = ((unary - lane) << EF_LOW) | low
        if VALUES == 2:  # one sign bit per pair (and k = 1's non-zero flag)
            run_bits: tl.constexpr = K + (K == 1)
            negative = get_fields(bytes_ptr, value_bit + chunk * run_bits + lane, valid, 1)
            if K >= 2:
                repeat = (lane > 0) & (pos == _shift_up(pos, lane))
                second = (lane == 1) & repeat & (negative == 1)  # the all-zero chunk's mark
                first_zero = tl.sum(second.to(tl.int32), 0) > 0
                zero = tl.where(lane == 0, first_zero, repeat)
            else:
                zero = get_fields(bytes_ptr, value_bit + chunk * run_bits + 1 + lane * 0, valid, 1) == 0
            sent = tl.where(valid & ~zero, 1.0, 0.0)
            vals = (1.0 - 2.0 * negative.to(tl.float32)) * sent
        else:
            vals = float_of(get_fields(bytes_ptr, value_bit + (chunk * K + lane) * FLOAT_BITS, valid, FLOAT_BITS),
                            FLOAT_BITS, BF16)
    return vals, pos, sent
