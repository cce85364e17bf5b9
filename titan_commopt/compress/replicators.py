"""DeToNATION replicators: what a replica extracts from its signal and how R aggregates it.

Each replicator, per local shard of one parameter:

- ``extract(x, step) -> (q, payload)``: ``q`` is the dense part of ``x`` that is being transmitted
  (subtracted from the momentum by the caller: DeMo eq. 8), ``payload`` the ``uint8`` wire bytes
  (``None`` when nothing is sent this step);
- ``aggregate(payloads, step) -> Q``: ``payloads`` is ``[W, nbytes]`` (every replica's bytes, own
  included), ``Q`` the dense mean (DeMo eq. 6), or ``None`` on a step without sync;
- ``payload_bytes(step)``: exact size, a function of shape and options only, so the receiver splits
  the fused buffer without any header and ``r_bytes_per_step`` matches the ledger.

Kinds: ``demo`` (DCT-II chunks, top-k, values + indices), ``random`` (indices drawn from a generator
seeded by (seed, step, parameter name): identical on every replica, never sent), ``striding`` (every
``1/c``-th entry, offset rotating with the step), ``diloco`` (everything, every ``1/c`` steps), ``full``
(everything, every step). Random/Striding/DiLoCo/Full work on the flat local shard.

Wire: with ``sign`` the values are ternary — 2 bits each when ``pack`` — else floats in ``wire_dtype``.
DeMo's indices are ``ceil(log2(L))`` bits when ``pack`` (12 for a 64×64 chunk) and int64 otherwise
(the reference's format).
"""

import math
import zlib
from typing import Optional

import torch

from titan_commopt.comm import ceil_log2

from .dct import Chunker, scatter_chunks, topk_per_chunk
from .packing import (WIRE_DTYPES, bits_bytes, float_bytes, from_bytes, pack_bits, pack_ternary, to_bytes,
                      unpack_bits, unpack_ternary)

__all__ = ["KINDS", "Replicator", "make_replicator", "rate_of"]

KINDS = ("demo", "random", "striding", "diloco", "full")


def rate_of(cfg) -> float:
    """Fraction of entries sent: ``compression_rate``, or DeMo's ``k / s²`` when that is 0."""
    return cfg.compression_rate if cfg.compression_rate > 0 else min(1.0, cfg.topk / cfg.chunk**2)


class Replicator:
    def __init__(self, kind: str, shape, name: str, cfg, device=None):
        if kind not in KINDS:
            raise ValueError(f"replicator {kind!r}: one of {KINDS}")
        self.kind, self.shape, self.cfg = kind, tuple(shape), cfg
        self.numel = math.prod(self.shape)
        self.name_seed = zlib.crc32(name.encode())
        self.wire = WIRE_DTYPES[cfg.transfer_dtype]
        rate = rate_of(cfg)
        self.period = max(1, round(1 / rate))
        if kind == "demo":
            self.chunker = Chunker(self.shape, cfg.chunk, device=device)
            self.k = min(cfg.topk, self.chunker.L)
            self.n_values = self.chunker.n_chunks * self.k
            self.index_bits = ceil_log2(self.chunker.L)
        elif kind == "random":
            self.n_values = min(self.numel, max(1, round(rate * self.numel)))
        elif kind == "striding":
            self.n_values = max(1, self.numel // self.period)
        else:
            self.n_values = self.numel

    # ---- sizes ------------------------------------------------------------------------------------
    def _value_bytes(self) -> int:
        if self.cfg.sign_before_sync and self.cfg.pack:
            return bits_bytes(self.n_values, 2)
        return float_bytes(self.n_values, self.wire)

    def _index_bytes(self) -> int:
        if self.kind != "demo":
            return 0
        return bits_bytes(self.n_values, self.index_bits) if self.cfg.pack else self.n_values * 8

    def sends(self, step: int) -> bool:
        return self.numel > 0 and (self.kind != "diloco" or step % self.period == 0)

    def payload_bytes(self, step: int) -> int:
        return self._value_bytes() + self._index_bytes() if self.sends(step) else 0

    # ---- shared indices (random / striding) ---------------------------------------------------------
    def indices(self, step: int, device) -> torch.Tensor:
        if self.kind == "random":
            gen = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step * 7919 + self.name_seed) % 2**62)
            return torch.randperm(self.numel, generator=gen)[: self.n_values].to(device)
        if self.kind == "striding":
            if self.numel < self.period:
                return torch.tensor([step % self.numel], device=device)
            return step % self.period + self.period * torch.arange(self.n_values, device=device)
        raise AssertionError(self.kind)

    # ---- wire ---------------------------------------------------------------------------------------
    def _encode_values(self, v: torch.Tensor) -> torch.Tensor:
        if self.cfg.sign_before_sync:
            v = v.sign()
            if self.cfg.pack:
                return pack_ternary(v)
        return to_bytes(v, self.wire)

    def _decode_values(self, data: torch.Tensor) -> torch.Tensor:
        if self.cfg.sign_before_sync and self.cfg.pack:
            return unpack_ternary(data, self.n_values)
        return from_bytes(data, self.wire).float()

    # ---- the two halves -----------------------------------------------------------------------------
    def extract(self, x: torch.Tensor, step: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if not self.sends(step):
            return None, None
        if self.kind == "demo":
            vals, idx = topk_per_chunk(self.chunker.encode(x), self.k)
            q = self.chunker.decode(scatter_chunks(vals, idx, self.chunker.L))
            idx_bytes = pack_bits(idx, self.index_bits) if self.cfg.pack else idx.reshape(-1).view(torch.uint8)
            return q, torch.cat([self._encode_values(vals), idx_bytes])
        if self.kind in ("random", "striding"):
            idx = self.indices(step, x.device)
            vals = x.reshape(-1)[idx]
            q = torch.zeros_like(x).reshape(-1).index_copy_(0, idx, vals).view_as(x)
            return q, self._encode_values(vals)
        return x.clone(), self._encode_values(x)

    def aggregate(self, payloads: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        if not self.sends(step):
            return None
        w = payloads.shape[0]
        nv = self._value_bytes()
        # replicas are summed in replica order on every rank: identical bits, replicas stay in sync
        if self.kind == "demo":
            L = self.chunker.L
            dense = torch.zeros(self.chunker.n_chunks, L, device=payloads.device)
            count = torch.zeros_like(dense) if self.cfg.aggregate == "mean_selected" else None
            for r in range(w):
                vals = self._decode_values(payloads[r, :nv]).view(-1, self.k)
                raw = payloads[r, nv:]
                if self.cfg.pack:
                    idx = unpack_bits(raw, self.n_values, self.index_bits)
                else:
                    idx = from_bytes(raw, torch.int64)
                idx = idx.view(-1, self.k)
                dense.scatter_add_(-1, idx, vals)
                if count is not None:
                    count.scatter_add_(-1, idx, torch.ones_like(vals))
            dense = dense / w if count is None else dense / count.clamp_min(1)  # eq. 6 / reference's mean
            return self.chunker.decode(dense)
        total = self._decode_values(payloads[0, :nv])
        for r in range(1, w):
            total = total + self._decode_values(payloads[r, :nv])
        mean = total / w
        if self.kind in ("random", "striding"):
            idx = self.indices(step, payloads.device)
            return torch.zeros(self.numel, device=payloads.device).index_copy_(0, idx, mean).view(self.shape)
        return mean.view(self.shape)


def make_replicator(cfg, shape, name: str, device=None) -> Replicator:
    """The replicator ``cfg.replicator`` for one local shard of parameter ``name``."""
    return Replicator(cfg.replicator, shape, name, cfg, device=device)
