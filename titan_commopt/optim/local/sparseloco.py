"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706): DiLoCo's local steps with DeMo-style chunked top-k of the outer
pseudo-gradient, 2-bit values and error feedback in place of DiLoCo's outer momentum.

Algorithm 1 of the paper, on every replica r, per parameter, on the local FSDP2/TP shard:

    x ← AdamW_H(x)                          # H inner steps (torch's fused AdamW kernel)
    Δ = x_anchor − x                        # the pseudo-gradient
    e ← β·e + Δ                             # error feedback (replaces the outer momentum)
    Δ̂ = Q(Top-k(e))                         # per chunk the k largest |e|, values quantized
    e ← e − Δ̂                               # what was sent (dequantized) leaves the buffer
    x_anchor ← x_anchor − α·mean_R(Δ̂)        # one all-gather of every replica's bytes; outer SGD
    x ← x_anchor

Chunks are ``compress/dct.py``'s (``chunk``: 64×64 = 4096 for a matrix, 64 for a vector, each the
largest divisor of its dim that is ≤ ``chunk``); ``transform = "none"`` selects on the values
themselves (the paper's choice), ``"dct"`` on their DCT-II coefficients (DeMo's, the reference
code's option). The quantizer is the reference code's statistical one (``compress/quantize.py``:
``bins`` levels over ±``quant_range``/2 standard deviations of the shard's selected values, each
level the mean of its bin); ``quantization = "none"`` sends float32 values. On the wire, per shard:
the codes in log₂(bins) bits, the in-chunk indices in ⌈log₂ L⌉ bits (``packing.IndexCodec``), the
``bins`` float32 levels; every shard's bytes in one ``uint8`` buffer, one all-gather over R per
sync. Every replica decodes the same bytes in the same order and sums the replicas in replica order
(``dct.accumulate_chunks_``), so the anchors and the parameters are bit-identical on every replica
right after a sync; between syncs parameters, AdamW moments and error feedback are per replica
(``params_replica_local``; a checkpoint keeps each replica's copy).

AdamW's moments and step count persist across syncs (as DiLoCo's inner optimizer). The step counter
is a Python int (every parameter's ``state["step"]`` is one shared CPU scalar tensor holding it);
the sync runs after update n when ``n % H == 0``.

``sync_delay`` τ (off by default; it changes the algorithm, as the local-adaptive family's
streaming sync does): the all-gather issued after update n is completed after update n + τ, the
next τ inner steps overlapping it; then x_anchor ← x_anchor − α·mean_R(Δ̂) and x ← x_anchor + (x −
x at issue), keeping the local progress of those τ steps (Streaming DiLoCo's merge). It costs one
copy of the parameters in flight. τ < H. ``state_dict`` completes a sync in flight first, so a
checkpoint holds none and a resumed run continues as the run that saved it.

TP and FSDP change only which shard a rank works on (``common.replica_grad`` brings the gradient to
the parameter's placements); a parameter replicated over T is processed identically on every T rank.
The byte formula is :func:`sparseloco_r_bytes`. Host synchronizations: none per step.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.compress.dct import Chunker, accumulate_chunks_, topk_per_chunk
from titan_commopt.compress.packing import IndexCodec, float_bytes, from_bytes, to_bytes
from titan_commopt.compress.quantize import StatisticalQuantizer
from titan_commopt.options import option
from titan_commopt.topology import R, Topology

from .. import updates
from ..base import CommOptimizer
from ..common import LR_SCALE_HELP, BaseHParams, local
from ..family import Bytes, Family, PeriodicSyncs, Resolved, ShardShape
from .steps import LocalSteps, chunk_limit, column_chunks, trainable

__all__ = ["Config", "PRESETS", "PRESET_SOURCES", "SparseLoCo", "FAMILY", "check", "sparseloco_r_bytes", "ShardCodec"]

SECTION = "commopt.sparseloco"


@dataclass
class Config:
    """``[commopt.sparseloco]``."""

    H: int = option(15, "Inner AdamW steps between two outer steps (syncs).", ge=1)
    chunk: int = option(64, "Chunk size per dim (compress/dct.py's chunker: 64 → 64×64 = 4096 values of a "
                        "matrix, 64 of a vector).", ge=1)
    topk: int = option(64, "Values kept per chunk (of the error feedback, largest magnitude).", ge=1)
    transform: Literal["none", "dct"] = option(
        "none", "Top-k on the values themselves (none, the paper) or on their DCT-II coefficients (dct, DeMo's).")
    quantization: Literal["2bit", "none"] = option(
        "2bit", "Selected values on the wire: 2-bit statistical quantization (4 levels, the paper) or float32.")
    quant_range: float = option(6.0, "Range of the quantizer in standard deviations of a shard's selected "
                                "values (the reference code's range_in_sigmas).", gt=0.0)
    error_decay: float = option(0.95, "Error-feedback decay β: e ← β·e + Δ.", ge=0.0, le=1.0)
    outer_lr: float = option(1.0, "Outer learning rate α: x_anchor ← x_anchor − α·mean_R(Δ̂).", gt=0.0)
    sync_delay: int = option(
        0, "Steps τ the outer all-gather stays in flight (overlapped with the next τ inner steps) before "
        "the outer step lands, keeping the local progress of those steps: x ← x_anchor + (x − x at issue). "
        "0 = the paper's blocking sync; must be below H. Changes the algorithm.", ge=0)
    lr: float = option(
        -1.0, "Initial inner learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and "
        "over the preset's lr_scale) when set.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)


PRESETS: dict[str, dict[str, Any]] = {
    "SparseLoCo": {"H": 15, "chunk": 64, "topk": 64, "transform": "none", "quantization": "2bit",
                   "quant_range": 6.0, "error_decay": 0.95, "outer_lr": 1.0},
}

PRESET_SOURCES: dict[str, str] = {
    "SparseLoCo": "SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706), Algorithm 1: e ← β·e + Δ, Top-k, quantizer Q, "
    "e ← e − Δ̂, outer step x ← x − α·mean Δ̂. Chunk 64 (64×64 = 4096), k = 64 per chunk (1.56 % density), no "
    "DCT, 4 quantization bins (2 bits), β = 0.95: the Templar reference code's hparams (topk_compression 64, "
    "target_chunk 64, use_dct false, quantization_bins 4, momentum_decay 0.95) and its quantizer's range of 6σ. "
    "H = 15: the shortest of the paper's communication intervals H ∈ {15, 30, 50, 100} (its Figure 1, where "
    "SparseLoCo beats DiLoCo at each); α = 1 is not verified against the paper's tables (Templar's production "
    "config runs H = 30, α = 0.7)",
}


def check(cfg: Config, hparams: Optional[BaseHParams] = None) -> list[str]:
    """Cross-field rules of ``[commopt.sparseloco]``, one line per problem."""
    if cfg.topk > cfg.chunk ** 2:
        return [f"[{SECTION}] topk = {cfg.topk}: allowed is at most chunk^2 = {cfg.chunk ** 2} (chunk = {cfg.chunk})"]
    if cfg.sync_delay >= cfg.H:
        return [f"[{SECTION}] sync_delay = {cfg.sync_delay}: allowed is an integer >= 0 below H = {cfg.H} "
                "(a sync must land before the next one is issued)"]
    return []


class ShardCodec:
    """What one local shard sends at a sync: its chunking (``transform``), top-k, values and indices.
    ``to_chunks``/``from_chunks``: the shard ↔ its ``(n_chunks, L)`` chunk-major values (or DCT
    coefficients), copies."""

    def __init__(self, cfg: Config, shape: Sequence[int], device=None, dtype=torch.float32):
        self.shape = tuple(shape)
        self.chunker = Chunker(self.shape, cfg.chunk, device=device, dtype=dtype)
        self.dct = cfg.transform == "dct"
        self.rows, self.L = self.chunker.n_chunks, self.chunker.L
        self.k = min(cfg.topk, self.L)
        self.n = self.rows * self.k
        self.quantizer = StatisticalQuantizer(4, cfg.quant_range) if cfg.quantization == "2bit" else None
        self.index_codec = IndexCodec(self.L, pack=True)
        self.value_bytes = self.quantizer.nbytes(self.n) if self.quantizer else float_bytes(self.n, torch.float32)
        self.index_bytes = self.index_codec.nbytes(self.n)
        self.nbytes = self.value_bytes + self.index_bytes

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        if self.dct:
            return self.chunker.encode(x)
        ch = self.chunker
        view = ch.blocks_to_chunk_major(ch.blocks(x.contiguous().reshape(1, *self.shape)))
        return torch.empty(view.shape, dtype=x.dtype, device=x.device).copy_(view).view(self.rows, self.L)

    def from_chunks(self, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.dct:
            return self.chunker.decode(c).to(dtype)
        out = torch.empty(self.shape, dtype=dtype, device=c.device)
        ch = self.chunker
        ch.blocks(out.view(1, *self.shape)).copy_(ch.chunk_major_to_blocks(c.reshape(1, -1)))
        return out

    def encode(self, e_chunks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Top-k of every chunk of ``e_chunks``, quantized, written into ``out`` (``uint8``,
        ``nbytes``): returns the dense chunk-major float32 values sent (zeros elsewhere)."""
        vals, idx = topk_per_chunk(e_chunks, self.k)
        flat = vals.reshape(1, self.n)
        if self.quantizer is not None:
            codes, levels = self.quantizer.quantize(flat)
            sent = self.quantizer.dequantize(codes, levels)
            self.quantizer.encode_into(codes, levels, out[: self.value_bytes].view(1, -1))
        else:
            sent = flat.float()
            out[: self.value_bytes].copy_(to_bytes(sent.view(-1), torch.float32))
        out[self.value_bytes:].copy_(self.index_codec.encode(idx.reshape(1, self.n)).view(-1))
        return torch.zeros(self.rows, self.L, device=e_chunks.device).scatter_(-1, idx, sent.view(self.rows, self.k))

    def mean(self, payloads: torch.Tensor) -> torch.Tensor:
        """Every replica's bytes ``(W, nbytes)`` → the chunk-major float32 mean of what they sent,
        summed in replica order (the same bits on every rank)."""
        W = payloads.shape[0]
        values = payloads[:, : self.value_bytes]
        if self.quantizer is not None:
            vals = self.quantizer.decode(values, self.n)
        else:
            vals = from_bytes(values, torch.float32)
        idx = self.index_codec.decode(payloads[:, self.value_bytes:], self.n)
        dense = torch.zeros(self.rows, self.L, device=payloads.device)
        return accumulate_chunks_(dense, idx.view(W, self.rows, self.k), vals.view(W, self.rows, self.k) / W)


def sparseloco_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """One all-gather of every shard's payload every H steps: per shard with elements, codes
    (log₂ bins bits) + indices (⌈log₂ L⌉ bits) + ``bins`` float32 levels (float32 values without
    quantization); sent = that ÷ H, received = (W − 1) × sent."""
    if replicate_size <= 1:
        return Bytes()
    cfg = resolved.options
    per_sync = sum(ShardCodec(cfg, s.local, device="meta").nbytes for s in shards if s.numel)
    sent = per_sync / cfg.H
    return Bytes(sent, (replicate_size - 1) * sent)


def periodic(resolved: Resolved) -> Optional[PeriodicSyncs]:
    """One all-gather every H steps."""
    options = resolved.options
    if options.H > 1:
        return PeriodicSyncs((options.H,), lambda subset: dataclasses.replace(options, H=1, sync_delay=0))
    return None


def settings(resolved: Resolved) -> dict[str, Any]:
    """The options behind the bytes."""
    o = resolved.options
    return {"H": o.H, "chunk": o.chunk, "topk": o.topk, "transform": o.transform, "quantization": o.quantization,
            **({"sync_delay": o.sync_delay} if o.sync_delay else {})}


class SparseLoCo(LocalSteps, CommOptimizer):
    """SparseLoCo on one replica's shards (see the module docstring). Per-parameter state:
    ``step`` (shared), ``exp_avg``, ``exp_avg_sq`` (AdamW's), ``outer_anchor`` (x at the last outer
    step), ``error_feedback`` (e); all but ``step`` DTensors like their parameter."""

    params_replica_local = True  # parameters differ across replicas between syncs

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional["comm.CommLedger"] = None) -> None:
        cfg, hp = options.options, options.hparams
        defaults = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        super().__init__(trainable(named_params), topology, options, defaults, ledger=ledger)
        self.cfg = cfg
        self.H, self._sync_delay = cfg.H, cfg.sync_delay
        self._replicate = topology.replicate if topology.replicate_size > 1 else None
        self._codecs: dict[tuple, ShardCodec] = {}
        self.start_step_counter()
        self._params: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)
                self._params.append(p)

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if state:
            return
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        state["step"] = self._step_t
        state["exp_avg"], state["exp_avg_sq"] = zeros(), zeros()
        state["outer_anchor"] = p.detach().clone()
        state["error_feedback"] = zeros()

    # ---- hooks the torchtitan adapter reads ---------------------------------------------------------
    def replicas_in_sync(self) -> bool:
        """Right after a blocking outer step (and before the first step) every replica holds the anchor."""
        return self._n == 0 or (self._sync_delay == 0 and self._n % self.H == 0)

    def steps_to_next_sync(self) -> Optional[int]:
        if self.topology.replicate_size == 1 or self.H == 1:
            return None
        return self.H - self._n % self.H

    # ---- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, work = self.begin_local_step(closure, lambda group: ["exp_avg", "exp_avg_sq"])
        if work is None:
            return loss
        n = work.n
        for group, rows in work.groups:
            b1, b2 = group["betas"]
            for xs, gs, ms, vs in column_chunks(rows, chunk_limit(rows[0][0].device)):
                updates.adamw_multi_(xs, gs, ms, vs, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                     weight_decay=group["weight_decay"], step=n, fused=True)  # inner AdamW
        if n % self.H == 0:
            if self._sync_delay:
                self.runtime.start(self._outer_step(streaming=True), due=n + self._sync_delay)
            else:
                self.runtime.run(self._outer_step(streaming=False))
        self.runtime.advance(n)
        return loss

    def _codec(self, x: torch.Tensor) -> ShardCodec:
        key = (tuple(x.shape), x.device, x.dtype)
        if key not in self._codecs:
            self._codecs[key] = ShardCodec(self.cfg, x.shape, device=x.device, dtype=x.dtype)
        return self._codecs[key]

    def _outer_step(self, streaming: bool):
        """One sync, a task of :attr:`runtime`: Δ, e and the payload of every shard now, the
        all-gather, then the outer step (for ``streaming``, keeping the local progress since)."""
        live = [p for p in self._params if local(p).numel()]
        if not live:
            return
        codecs = [self._codec(local(p)) for p in live]
        send = torch.empty(sum(c.nbytes for c in codecs), dtype=torch.uint8, device=local(live[0]).device)
        offset = 0
        for p, codec in zip(live, codecs):
            x, st = local(p), self.state[p]
            anchor, e = local(st["outer_anchor"]), local(st["error_feedback"])
            e.mul_(self.cfg.error_decay).add_(anchor - x)  # e ← β·e + Δ, Δ = x_anchor − x
            sent = codec.encode(codec.to_chunks(e), send[offset: offset + codec.nbytes])  # Δ̂ = Q(Top-k(e))
            e.sub_(codec.from_chunks(sent, e.dtype))  # e ← e − Δ̂
            offset += codec.nbytes
        snapshots = [local(p).clone() for p in live] if streaming else None  # x at issue
        payloads = yield comm.all_gather(send, R, self._replicate, async_op=True, ledger=self.ledger)
        offset = 0
        for i, (p, codec) in enumerate(zip(live, codecs)):
            x, anchor = local(p), local(self.state[p]["outer_anchor"])
            mean = codec.from_chunks(codec.mean(payloads[:, offset: offset + codec.nbytes]), anchor.dtype)
            anchor.sub_(mean, alpha=self.cfg.outer_lr)  # x_anchor ← x_anchor − α·mean_R(Δ̂)
            if streaming:
                x.sub_(snapshots[i]).add_(anchor)  # x ← x_anchor + (x − x at issue)
            else:
                x.copy_(anchor)
            offset += codec.nbytes


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """The state is the same for every option value (AdamW's moments, anchor, error feedback)."""
    return {"state": "exp_avg, exp_avg_sq, outer_anchor, error_feedback (per replica)"}


FAMILY = Family(
    key="sparseloco",
    options=Config,
    presets=PRESETS,
    build=SparseLoCo,
    r_bytes=sparseloco_r_bytes,
    check=check,
    state_shape=state_shape,
    periodic=periodic,
    settings=settings,
    preset_sources=PRESET_SOURCES,
    summary="H local AdamW steps, then chunked top-k of the error-fed pseudo-gradient in 2-bit values, one "
    "all-gather, outer SGD on the mean (SparseLoCo)",
)
