"""DeToNATION replicators: what a replica extracts from its signal and how R aggregates it.

A :class:`Replicator` serves one local shard of one parameter (:func:`make_replicator` builds it from
the ``[commopt.demo]`` options):

- ``extract(x, step) -> (q, payload)``: ``q`` is the dense part of ``x`` that is being transmitted
  (subtracted from the momentum by the caller: DeMo eq. 8), ``payload`` the ``uint8`` wire bytes;
  both ``None`` when nothing is sent this step;
- ``aggregate(payloads, step) -> Q``: ``payloads`` is ``[W, payload_bytes(step)]`` (every replica's
  bytes, own included), ``Q`` the dense mean (DeMo eq. 6), or ``None`` on a step without sync;
- ``payload_bytes(step)``: exact size, a function of shape, options and step only, so the receiver
  splits the fused buffer without any header; ``sends(step)`` is ``payload_bytes(step) > 0``;
- ``period``: ``payload_bytes`` depends on the step only through ``step mod period``, so the mean
  bytes per step is the mean over one period (``r_bytes_per_step``, the ledger's formula).

Kinds: ``demo`` (DCT-II chunks, top-k, values + indices), ``random`` (one entry per stratum of the
flat shard, chosen by a hash of (seed, step, parameter name, stratum): identical on every replica,
never sent), ``striding`` (every
``1/c``-th entry, offset rotating with the step: each entry once per ``1/c`` steps), ``diloco``
(everything, every ``1/c`` steps), ``full`` (everything, every step). Random/Striding/DiLoCo/Full
work on the flat local shard.

What is selected is the replicator's; how it is written is the codecs' (``packing.ValueCodec`` for
values — ternary or floats —, ``packing.IndexCodec`` for DeMo's indices; DeMo's ``compact`` wire:
``packing.CompactCodec``, Elias–Fano positions and 1-bit signs).
"""

import math
import zlib
from typing import Optional

import torch

from .dct import Chunker, accumulate_chunks_, scatter_chunks, topk_per_chunk
from .packing import WIRE_DTYPES, CompactCodec, IndexCodec, ValueCodec

__all__ = ["KINDS", "WIRES", "period_of", "Replicator", "DeMoReplicator", "RandomReplicator", "StridingReplicator",
           "DiLoCoReplicator", "FullReplicator", "make_replicator", "rate_of"]

KINDS = ("demo", "random", "striding", "diloco", "full")
WIRES = ("packed", "compact")  # how DeMo's selection is written (``packing``); the others always ``packed``

Payload = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


def rate_of(cfg) -> float:
    """Fraction of entries sent: ``compression_rate``, or DeMo's ``k / s²`` when that is 0."""
    return cfg.compression_rate if cfg.compression_rate > 0 else min(1.0, cfg.topk / cfg.chunk**2)


def period_of(cfg) -> int:
    """Steps per cycle of the striding and diloco replicators: ``round(1 / rate)``, at least 1."""
    return max(1, round(1 / rate_of(cfg)))


class Replicator:
    """One local shard of shape ``shape``; the values it selects travel through ``value_codec``."""

    period = 1

    def __init__(self, shape, value_codec: ValueCodec):
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        self.value_codec = value_codec

    def sends(self, step: int) -> bool:
        return self.payload_bytes(step) > 0

    def payload_bytes(self, step: int) -> int:
        raise NotImplementedError

    def extract(self, x: torch.Tensor, step: int) -> Payload:
        raise NotImplementedError

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        raise NotImplementedError


class DeMoReplicator(Replicator):
    """The ``topk`` largest DCT-II coefficients of every chunk (``dct.Chunker``): values + their
    indices in the chunk. ``mean_selected``: average a coefficient over the replicas that selected it
    (the reference code) instead of over all of them (the paper's eq. 6).

    Besides the one-shard interface (``extract``/``aggregate``), the steps are exposed for ``G``
    same-shape shards at once, in the coefficient domain (what the DeMo optimizer batches):
    :meth:`select` (top-k of chunk-major coefficients ``(G·n_chunks, L)``), :meth:`write` (values and
    indices into two ``uint8`` regions of the send buffer, ``(G, value_bytes)`` and ``(G, index_bytes)``:
    each shard's bytes are exactly what ``extract`` sends) and :meth:`mean_coefficients` (every
    replica's bytes → the dense mean, chunk-major, no loop over replicas; :meth:`received` stops
    before the sum, for a kernel that sums inside its inverse transform).

    ``wire``: ``packed`` writes values with ``value_codec`` and indices with ``packing.IndexCodec``;
    ``compact`` (only with ``pack``) writes each chunk's selection with ``packing.CompactCodec`` —
    the same pairs, so the same mean. One combination keeps the packed encoding: ``mean_selected``
    with ``sign_before_sync``, where a selected zero coefficient must count as a selection and the
    compact code's 1-bit sign cannot say where a zero was selected (see ``CompactCodec``)."""

    def __init__(self, shape, value_codec: ValueCodec, chunk: int, topk: int, pack: bool,
                 mean_selected: bool = False, device=None, wire: str = "packed"):
        super().__init__(shape, value_codec)
        self.chunker = Chunker(self.shape, chunk, device=device)
        self.k = min(topk, self.chunker.L)
        self.n_values = self.chunker.n_chunks * self.k
        self.index_codec = IndexCodec(self.chunker.L, pack)
        self.mean_selected = mean_selected
        self.compact = (CompactCodec(self.chunker.L, self.k, value_codec.sign, value_codec.wire_dtype)
                        if wire == "compact" and pack and not (mean_selected and value_codec.sign) else None)
        if self.compact is None:
            self.value_bytes = self.value_codec.nbytes(self.n_values)
            self.index_bytes = self.index_codec.nbytes(self.n_values)
        else:
            self.value_bytes = self.compact.value_bytes(self.chunker.n_chunks)
            self.index_bytes = self.compact.index_bytes(self.chunker.n_chunks)

    def payload_bytes(self, step: int) -> int:
        return self.value_bytes + self.index_bytes

    # ---- G shards, coefficient domain --------------------------------------------------------------
    def select(self, coeffs: torch.Tensor, work: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of every chunk of ``coeffs`` (``(rows, L)``): ``(values, indices)``, each ``(rows, k)``
        (``work``: scratch for the magnitudes, see ``dct.topk_per_chunk``)."""
        return topk_per_chunk(coeffs, self.k, work)

    def write(self, values: torch.Tensor, idx: torch.Tensor, value_out: torch.Tensor,
              index_out: torch.Tensor) -> None:
        """Encode ``G`` shards' selections (``(G·n_chunks, k)`` each) into ``value_out`` ``(G, value_bytes)``
        and ``index_out`` ``(G, index_bytes)``."""
        G = value_out.shape[0]
        if self.compact is not None:
            self.compact.encode_into(values, idx, value_out, index_out)
            return
        self.value_codec.encode_into(values.view(G, self.n_values), value_out)
        index_out.copy_(self.index_codec.encode(idx.view(G, self.n_values)))

    def received(self, value_data: torch.Tensor,
                 index_data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``value_data`` ``(W, G, value_bytes)`` and ``index_data`` ``(W, G, index_bytes)``: every replica's
        bytes (own included, replica order) → the pairs to sum per coefficient, ``(values, indices,
        selected)``, each ``(W, G·n_chunks, k)``: with the plain mean (eq. 6) the values come divided by
        ``W``; with ``mean_selected`` they come whole and ``selected`` (float32) is 1 where a pair is a
        selection (the sum is divided by the sum of ``selected`` per coefficient), else ``None``."""
        W, G = value_data.shape[:2]
        n, k = self.n_values, self.k
        rows = G * self.chunker.n_chunks
        sent = None  # which decoded pairs are selections (None: all)
        if self.compact is None:
            # reshape: a row's fields are cut from whole bytes (a ternary row of n % 4 ≠ 0 is a strided view)
            vals = self.value_codec.decode(value_data, n).reshape(W, rows, k)
            idx = self.index_codec.decode(index_data, n).reshape(W, rows, k)
        else:
            vals, idx, sent = self.compact.decode(value_data, index_data, self.chunker.n_chunks)
            vals, idx = vals.view(W, rows, k), idx.view(W, rows, k)
        if not self.mean_selected:
            return vals / W, idx, None
        return vals, idx, torch.ones_like(vals) if sent is None else sent.view(W, rows, k).to(vals.dtype)

    def mean_coefficients(self, value_data: torch.Tensor, index_data: torch.Tensor,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every replica's bytes (as :meth:`received` takes them) → the dense mean coefficients,
        chunk-major ``(G·n_chunks, L)`` (written into ``out`` when given). Replicas are summed in
        replica order per coefficient (``dct.accumulate_chunks_``): every rank computes the same bits."""
        vals, idx, selected = self.received(value_data, index_data)
        rows, L = vals.shape[1], self.chunker.L
        if out is None:
            dense = torch.zeros(rows, L, device=value_data.device)
        else:
            dense = out.view(-1)[: rows * L].view(rows, L).zero_()
        accumulate_chunks_(dense, idx, vals)
        if selected is None:
            return dense
        count = accumulate_chunks_(torch.zeros_like(dense), idx, selected)
        return dense.div_(count.clamp_min_(1))

    # ---- one shard ----------------------------------------------------------------------------------
    def extract(self, x: torch.Tensor, step: int) -> Payload:
        if not self.sends(step):
            return None, None
        vals, idx = self.select(self.chunker.encode(x))
        q = self.chunker.decode(scatter_chunks(vals, idx, self.chunker.L))
        payload = torch.empty(self.value_bytes + self.index_bytes, dtype=torch.uint8, device=x.device)
        self.write(vals, idx, payload[: self.value_bytes].view(1, -1), payload[self.value_bytes:].view(1, -1))
        return q, payload

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        if not self.sends(step):
            return None
        split = self.value_bytes
        dense = self.mean_coefficients(payloads[:, :split].unsqueeze(1), payloads[:, split:].unsqueeze(1))
        return self.chunker.decode(dense)


class _FlatReplicator(Replicator):
    """Entries of the flat shard chosen from the step alone (the same on every replica, so only the
    values travel), averaged over the replicas. Subclasses say how many (``count``) and which
    (``indices``; ``None`` = the whole shard)."""

    def count(self, step: int) -> int:
        raise NotImplementedError

    def indices(self, step: int, device) -> Optional[torch.Tensor]:
        return None

    def payload_bytes(self, step: int) -> int:
        return self.value_codec.nbytes(self.count(step))

    def extract(self, x: torch.Tensor, step: int, out: Optional[torch.Tensor] = None) -> Payload:
        """As :meth:`Replicator.extract`; ``out``: ``uint8`` of ``payload_bytes(step)`` to write the
        payload into (a slice of the fused send buffer), returned as the payload."""
        if not self.sends(step):
            return None, None
        idx = self.indices(step, x.device)
        if idx is None:
            q, vals = x.clone(), x.reshape(-1)
        else:
            vals = x.reshape(-1)[idx]
            q = torch.zeros_like(x).reshape(-1).index_copy_(0, idx, vals).view_as(x)
        if out is None:
            return q, self.value_codec.encode(vals)
        self.value_codec.encode_into(vals, out)
        return q, out

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        if not self.sends(step):
            return None
        n = self.count(step)
        # all replicas decoded at once; the sum over them is a reduction of fixed order on every rank
        mean = self.value_codec.decode(payloads, n).sum(0) / payloads.shape[0]
        idx = self.indices(step, payloads.device)
        if idx is None:
            return mean.view(self.shape)
        return torch.zeros(self.numel, device=payloads.device).index_copy_(0, idx, mean).view(self.shape)


class RandomReplicator(_FlatReplicator):
    """``n = round(rate·numel)`` entries (at least one; the count is exact), drawn afresh every step
    and the same on every replica: the flat shard is cut into ``n`` consecutive strata of
    ``⌊numel/n⌋`` or ``⌈numel/n⌉`` entries and one entry of each is chosen by a hash of (seed, step,
    parameter name, stratum). Every entry is chosen with probability one over its stratum's size
    (``≈ rate``), no entry twice; unlike a uniform draw of ``n`` of ``numel``, two entries of one
    stratum are never chosen together. Made on the tensors' device in O(n), no permutation of the
    shard, no generator state, the same bits on every device type (integer arithmetic only)."""

    def __init__(self, shape, value_codec: ValueCodec, rate: float, seed: int, name: str):
        super().__init__(shape, value_codec)
        self.n_values = min(self.numel, max(1, round(rate * self.numel)))
        self.seed, self.name_seed = seed, zlib.crc32(name.encode())

    def count(self, step: int) -> int:
        return self.n_values

    def indices(self, step: int, device) -> torch.Tensor:
        n, N = self.n_values, self.numel
        i = torch.arange(n, device=device, dtype=torch.int64)
        start = i * N // n
        size = (i + 1) * N // n - start  # >= 1 since n <= N
        key = _mix64((self.seed * 1_000_003 + step * 7919 + self.name_seed) % 2**62)
        return start + (_splitmix64(i + key) & (2**62 - 1)) % size


_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's constants as signed 64-bit integers
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64


def _mix64(x: int) -> int:
    """:func:`_splitmix64` of one Python integer (the per-step key), as a signed 64-bit integer,
    in Python arithmetic: no tensor, nothing to synchronize."""
    m = 2**64 - 1
    x = (x + _GOLDEN) & m
    x = ((x ^ (x >> 30)) * _MUL1) & m
    x = ((x ^ (x >> 27)) * _MUL2) & m
    x ^= x >> 31
    return x - 2**64 if x >= 2**63 else x


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 (Steele, Lea, Flood 2014) of every int64 of ``x``, in wrapping 64-bit arithmetic;
    right shifts are made logical by masking off the copied sign bits."""
    x = x * 1 + _GOLDEN  # int64 arithmetic wraps around
    x = (x ^ ((x >> 30) & (2**34 - 1))) * _MUL1
    x = (x ^ ((x >> 27) & (2**37 - 1))) * _MUL2
    return x ^ ((x >> 31) & (2**33 - 1))


class StridingReplicator(_FlatReplicator):
    """At step ``t`` the entries ``i ≡ t (mod period)`` of the flat shard: every entry is sent exactly
    once in any ``period`` consecutive steps, the last ``numel mod period`` ones included, so the
    count is ``ceil(numel / period)`` or one less, depending on the step. A shard smaller than the
    period keeps the same cadence: it sends one entry on ``numel`` steps of each period and nothing
    (no bytes, no update) on the others."""

    def __init__(self, shape, value_codec: ValueCodec, period: int):
        super().__init__(shape, value_codec)
        self.period = period

    def count(self, step: int) -> int:
        return len(range(step % self.period, self.numel, self.period))

    def indices(self, step: int, device) -> torch.Tensor:
        return step % self.period + self.period * torch.arange(self.count(step), device=device)


class DiLoCoReplicator(_FlatReplicator):
    """The whole shard every ``period`` steps, nothing in between."""

    def __init__(self, shape, value_codec: ValueCodec, period: int):
        super().__init__(shape, value_codec)
        self.period = period

    def count(self, step: int) -> int:
        return self.numel if step % self.period == 0 else 0


class FullReplicator(DiLoCoReplicator):
    """The whole shard every step: the uncompressed reference."""

    def __init__(self, shape, value_codec: ValueCodec):
        super().__init__(shape, value_codec, period=1)


def make_replicator(cfg, shape, name: str, device=None) -> Replicator:
    """The replicator ``cfg.replicator`` (``[commopt.demo]`` options) for a local shard of ``shape``
    of the parameter ``name``; ``device`` is where DeMo keeps its DCT bases."""
    codec = ValueCodec(cfg.sign_before_sync, WIRE_DTYPES[cfg.transfer_dtype], cfg.pack)
    period = period_of(cfg)
    kind = cfg.replicator
    if kind == "demo":
        return DeMoReplicator(shape, codec, cfg.chunk, cfg.topk, cfg.pack,
                              mean_selected=cfg.aggregate == "mean_selected", device=device,
                              wire=getattr(cfg, "wire", "packed"))  # a config of another family may lack it
    if kind == "random":
        return RandomReplicator(shape, codec, rate_of(cfg), cfg.seed, name)
    if kind == "striding":
        return StridingReplicator(shape, codec, period)
    if kind == "diloco":
        return DiLoCoReplicator(shape, codec, period)
    if kind == "full":
        return FullReplicator(shape, codec)
    raise ValueError(f"replicator {kind!r}: one of {KINDS}")
