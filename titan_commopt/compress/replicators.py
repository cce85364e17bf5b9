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

Kinds: ``demo`` (DCT-II chunks, top-k, values + indices), ``random`` (indices drawn from a generator
seeded by (seed, step, parameter name): identical on every replica, never sent), ``striding`` (every
``1/c``-th entry, offset rotating with the step: each entry once per ``1/c`` steps), ``diloco``
(everything, every ``1/c`` steps), ``full`` (everything, every step). Random/Striding/DiLoCo/Full
work on the flat local shard.

What is selected is the replicator's; how it is written is the codecs' (``packing.ValueCodec`` for
values — ternary or floats —, ``packing.IndexCodec`` for DeMo's indices).
"""

import math
import zlib
from typing import Optional

import torch

from .dct import Chunker, scatter_chunks, topk_per_chunk
from .packing import WIRE_DTYPES, IndexCodec, ValueCodec

__all__ = ["KINDS", "Replicator", "DeMoReplicator", "RandomReplicator", "StridingReplicator",
           "DiLoCoReplicator", "FullReplicator", "make_replicator", "rate_of"]

KINDS = ("demo", "random", "striding", "diloco", "full")

Payload = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


def rate_of(cfg) -> float:
    """Fraction of entries sent: ``compression_rate``, or DeMo's ``k / s²`` when that is 0."""
    return cfg.compression_rate if cfg.compression_rate > 0 else min(1.0, cfg.topk / cfg.chunk**2)


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
    (the reference code) instead of over all of them (the paper's eq. 6)."""

    def __init__(self, shape, value_codec: ValueCodec, chunk: int, topk: int, pack: bool,
                 mean_selected: bool = False, device=None):
        super().__init__(shape, value_codec)
        self.chunker = Chunker(self.shape, chunk, device=device)
        self.k = min(topk, self.chunker.L)
        self.n_values = self.chunker.n_chunks * self.k
        self.index_codec = IndexCodec(self.chunker.L, pack)
        self.mean_selected = mean_selected

    def payload_bytes(self, step: int) -> int:
        return self.value_codec.nbytes(self.n_values) + self.index_codec.nbytes(self.n_values)

    def extract(self, x: torch.Tensor, step: int) -> Payload:
        if not self.sends(step):
            return None, None
        vals, idx = topk_per_chunk(self.chunker.encode(x), self.k)
        q = self.chunker.decode(scatter_chunks(vals, idx, self.chunker.L))
        return q, torch.cat([self.value_codec.encode(vals), self.index_codec.encode(idx)])

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        if not self.sends(step):
            return None
        n, split = self.n_values, self.value_codec.nbytes(self.n_values)
        dense = torch.zeros(self.chunker.n_chunks, self.chunker.L, device=payloads.device)
        count = torch.zeros_like(dense) if self.mean_selected else None
        for row in payloads:  # replica order on every rank: identical bits, replicas stay in sync
            vals = self.value_codec.decode(row[:split], n).view(-1, self.k)
            idx = self.index_codec.decode(row[split:], n).view(-1, self.k)
            dense.scatter_add_(-1, idx, vals)
            if count is not None:
                count.scatter_add_(-1, idx, torch.ones_like(vals))
        dense = dense / count.clamp_min(1) if count is not None else dense / payloads.shape[0]
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

    def extract(self, x: torch.Tensor, step: int) -> Payload:
        if not self.sends(step):
            return None, None
        idx = self.indices(step, x.device)
        if idx is None:
            return x.clone(), self.value_codec.encode(x)
        vals = x.reshape(-1)[idx]
        q = torch.zeros_like(x).reshape(-1).index_copy_(0, idx, vals).view_as(x)
        return q, self.value_codec.encode(vals)

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        if not self.sends(step):
            return None
        n = self.count(step)
        total = self.value_codec.decode(payloads[0], n)
        for row in payloads[1:]:  # replica order on every rank: identical bits, replicas stay in sync
            total = total + self.value_codec.decode(row, n)
        mean = total / payloads.shape[0]
        idx = self.indices(step, payloads.device)
        if idx is None:
            return mean.view(self.shape)
        return torch.zeros(self.numel, device=payloads.device).index_copy_(0, idx, mean).view(self.shape)


class RandomReplicator(_FlatReplicator):
    """``round(rate·numel)`` entries (at least one) drawn without replacement, from a generator seeded
    by (seed, step, parameter name)."""

    def __init__(self, shape, value_codec: ValueCodec, rate: float, seed: int, name: str):
        super().__init__(shape, value_codec)
        self.n_values = min(self.numel, max(1, round(rate * self.numel)))
        self.seed, self.name_seed = seed, zlib.crc32(name.encode())

    def count(self, step: int) -> int:
        return self.n_values

    def indices(self, step: int, device) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step * 7919 + self.name_seed) % 2**62)
        return torch.randperm(self.numel, generator=gen)[: self.n_values].to(device)


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
    period = max(1, round(1 / rate_of(cfg)))
    kind = cfg.replicator
    if kind == "demo":
        return DeMoReplicator(shape, codec, cfg.chunk, cfg.topk, cfg.pack,
                              mean_selected=cfg.aggregate == "mean_selected", device=device)
    if kind == "random":
        return RandomReplicator(shape, codec, rate_of(cfg), cfg.seed, name)
    if kind == "striding":
        return StridingReplicator(shape, codec, period)
    if kind == "diloco":
        return DiLoCoReplicator(shape, codec, period)
    if kind == "full":
        return FullReplicator(shape, codec)
    raise ValueError(f"replicator {kind!r}: one of {KINDS}")
