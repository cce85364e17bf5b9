"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706): DiLoCo's local steps with DeMo-style chunked top-k of the outer
pseudo-gradient, 2-bit values and error feedback in place of DiLoCo's outer momentum.

Algorithm 1 of the paper, on every replica r, per parameter, on the local FSDP2/TP shard:

    x ← AdamW_H(x)                          # H inner steps (torch's fused AdamW kernel)
    Δ = x_anchor − x                        # the pseudo-gradient
    e ← β·e + Δ                             # error feedback (replaces the outer momentum)
    Δ̂ = Q(Top-k(e))                         # per chunk the k largest |e|, values quantized
    e ← e − Δ̂                               # what was sent (dequantized) leaves the buffer
    x_anchor ← x_anchor − α·agg_R(Δ̂)         # one all-gather of every replica's bytes; outer SGD
    x ← x_anchor

The aggregate (``aggregate``): ``mean``, the paper's (1/R)·Σ_r Δ̂_r; ``senders``, per coordinate the
mean over the replicas that sent it, what both authors' codes compute (``scatter_reduce(...,
reduce="mean", include_self=False)`` over every replica's indices). ``clip = "median_norm"``
(Templar's ``batch_decompress``): each replica's Δ̂_r of a parameter is first scaled by
min(1, median_r ‖Δ̂_r‖ / (‖Δ̂_r‖ + 1e-8)), ‖·‖ over the whole tensor, ``torch.median``'s lower middle
for an even R; each shard sends its replica's norm as one float32. Templar's outer step is
``senders`` + ``median_norm`` + ``topk_rule = "even"``; the paper code's, ``senders`` + ``topk_rule =
"area"`` (``tests/test_sparseloco.py`` holds both against the formulas on the same inputs).

The outer learning rate. Both authors' codes add their α to the error feedback too (e ← β·e + α·Δ)
and then step SGD with lr α: Δ̂ scales with α (top-k, the quantizer and the clip's ratio are
scale-free), so their step is α²·Q(Top-k(e)) on an error buffer α times ours. Ours (the paper's
Algorithm 1) takes α in the step alone: their α is our ``outer_lr`` = α² (the same at α = 1, their
shipped value), not an option of its own.

Chunks: ``compress/dct.py``'s (``chunk``: 64×64 = 4096 for a matrix, 64 for a vector, each the largest
divisor of its dim that is ≤ ``chunk``) on the *whole tensor's* grid: a shard that is a union of the
tensor's chunks (its start and extent along every split dim multiples of the chunk: FSDP2's 64 of 128
rows) selects exactly what an unsharded run selects. A shard that cuts chunks (43 of 128 rows over
S = 3; 96 of 192 over S = 2) cannot without moving values between ranks: it is chunked on its own
(its dims' largest divisors ≤ ``chunk``), keeps k per chunk of its own (a 128×128 tensor over S = 3
keeps 3 × 2 × 64 = 384 values instead of 256), so its update depends on the layout, unless both grids
keep every value; one log line per run names such shards (:func:`chunk_grid`). Values per chunk of L (``topk_rule``): ours min(topk,
L); Templar's even(max(2, min(topk, L))) (it packs index pairs); the paper code's max(1, round(L·topk /
chunk²)) (a 64-vector keeps 1 where we keep 64). All three agree on full 64×64 chunks; "1.56 %
density" and 12-bit indices hold only where dims divide by 64.

``transform = "none"`` selects on the values themselves (the paper's choice), ``"dct"`` on their
DCT-II coefficients (DeMo's, the reference code's option). The quantizer is the reference code's
statistical one (``compress/quantize.py``: ``bins`` levels over ±``quant_range``/2 standard deviations
of the selected values, each level the mean of its bin) over the *whole tensor's* selected values,
as the references quantize a tensor: each shard's sums (n, Σv, Σv², then every bin's Σc and count,
float64) are added over the groups that shard the tensor, two small fused all-reduces per group and
sync through ``comm`` (:func:`sparseloco_s_bytes`), so codes and levels do not depend on the layout.
``quantization = "none"`` sends float32 values. On the wire, per shard: the codes in log₂(bins) bits,
the in-chunk indices in ⌈log₂ L⌉ bits (``packing.IndexCodec``; none where k = L: every value goes,
in chunk order), the ``bins`` float32 levels (and the clip's norm); every shard's bytes in one ``uint8`` buffer, one all-gather over R per sync. Every
replica decodes the same bytes in the same order and sums the replicas in replica order
(``dct.accumulate_chunks_``), so the anchors and the parameters are bit-identical on every replica
right after a sync; between syncs parameters, AdamW moments and error feedback are per replica
(``params_replica_local``; a checkpoint keeps each replica's copy).

The inner optimizer (``inner``): AdamW (torch's fused kernel), or MuLoCo's Muon on the hidden
matrices (``optim/muon/engine.py``: Newton–Schulz of each whole matrix on its owner rank of S/T) with
AdamW on the parameters routed around them (``optim/routing.py``). The outer step (``outer_momentum``
μ > 0, MuLoCo's quantized outer SGD: Nesterov momentum on top of the error feedback) is then
b ← μ·b + agg_R(Δ̂); x_anchor ← x_anchor − α·(agg_R(Δ̂) + μ·b). MuLoCo-2bit keeps every value of
each chunk (``topk`` = ``chunk``², no indices): 2 bits per value plus 4 float32 levels per shard.

AdamW's moments (Muon's momentum) and the step count persist across syncs (as DiLoCo's inner optimizer). The step counter
is a Python int (every parameter's ``state["step"]`` is one shared CPU scalar tensor holding it);
the sync runs after update n when ``n % H == 0``.

``sync_delay`` τ (off by default; it changes the algorithm, as the local-adaptive family's
streaming sync does): the all-gather issued after update n is completed after update n + τ, the
next τ inner steps overlapping it; then x_anchor ← x_anchor − α·agg_R(Δ̂) and x ← x_anchor + (x −
x at issue), keeping the local progress of those τ steps; with ``merge = "lerp"`` Streaming DiLoCo's
own merge (Douillard et al. 2025, §2.3), x ← a·x + (1 − a)·x_anchor, a = ``merge_alpha``. It costs one
copy of the parameters in flight. τ < H. ``state_dict`` completes a sync in flight first, so a
checkpoint holds none and a resumed run continues as the run that saved it.

``merge`` = ``"delayed"`` / ``"eager"`` (off by default; Kale, Douillard, Donchev 2025, "Eager Updates
For Overlapped Communication and Computation in DiLoCo", arXiv 2502.12996, Algorithms 2 and 3, with
SparseLoCo's compressed Δ̂ in place of DiLoCo's Δ): the all-gather issued after update n stays in
flight over the whole next period and is applied after update n + H, where the next one is issued.
On replica m, with agg(t−1) the aggregate that arrived and Δ̂_m(t−1) what m sent then (both zero
before the first sync), after this period's e ← β·e + Δ, Δ̂_m(t) = Q(Top-k(e)), e ← e − Δ̂_m(t):

    delayed:  Δ̃ = agg(t−1)                                   # the naive one-outer-step delay
    eager:    Δ̃ = agg(t−1) + (Δ̂_m(t) − Δ̂_m(t−1))/M           # own fresh share in place of its stale one
    x_anchor ← x_anchor − α·Δ̃;  x ← x_anchor

The eager share 1/M is exact for ``aggregate = "mean"`` without a clip (the paper's (1/R)·Σ); with
``senders`` or ``median_norm`` a replica's weight in the aggregate differs per coordinate and is
taken as 1/M. The aggregate in flight (``inflight_update``) and, eager, the share sent
(``sent_update``) are state: a checkpoint completes the all-gather and keeps its aggregate without
applying it, so a resumed run continues exactly as one that never saved. Eager replicas' anchors
differ slightly (the global model is then their mean over R); delayed ones agree after every sync.

TP and FSDP change only which shard a rank works on (``common.replica_grad`` brings the gradient to
the parameter's placements); a parameter replicated over T is processed identically on every T rank.
The byte formulas are :func:`sparseloco_r_bytes` and :func:`sparseloco_s_bytes`. Host
synchronizations: none per step.
"""

import dataclasses
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.compress.dct import Chunker, accumulate_chunks_, chunk_size, topk_per_chunk
from titan_commopt.compress.packing import IndexCodec, float_bytes, from_bytes, to_bytes
from titan_commopt.compress.quantize import StatisticalQuantizer
from titan_commopt.options import option
from titan_commopt.topology import R, Topology

from .. import updates
from ..base import CommOptimizer
from ..base import named_params as params_by_name
from ..common import LR_SCALE_HELP, BaseHParams, local
from ..family import Bytes, Family, PeriodicSyncs, Resolved, ShardShape
from ..shard_groups import Groups, sharding_groups, sum_over
from ..muon.engine import MuonMatrices
from ..muon.layout import muon_shard_bytes
from ..muon.options import MuonOptions, muon_problems, routed_groups
from .global_model import anchors_swapped_in, replica_mean_swapped_in
from .sync import eager_pseudo_gradient
from .steps import LocalSteps, chunk_limit, column_chunks, trainable

__all__ = ["Config", "PRESETS", "PRESET_SOURCES", "SparseLoCo", "FAMILY", "check", "sparseloco_r_bytes",
           "sparseloco_s_bytes", "ShardCodec", "chunk_topk", "chunk_grid", "whole_grid"]

SECTION = "commopt.sparseloco"
CLIP_EPS = 1e-8  # Templar's: a replica's scale is min(1, median / (‖v‖ + 1e-8))
BINS = 4  # 2-bit values

logger = logging.getLogger(__name__)


@dataclass
class _Own:
    """``[commopt.sparseloco]``'s keys besides the Muon step's (``inner = "muon"``)."""

    H: int = option(15, "Inner steps between two outer steps (syncs).", ge=1)
    inner: Literal["adamw", "muon"] = option(
        "adamw", "Inner optimizer: AdamW, or Muon on the hidden matrices (the muon_* keys) with AdamW on the "
        "parameters routed around them (embed_names, head_names, norms, biases; MuLoCo's).")
    beta1: float = option(-1.0, "The inner AdamW's β1; negative = [optimizer] beta1.", lt=1.0)
    beta2: float = option(-1.0, "The inner AdamW's β2; negative = [optimizer] beta2.", lt=1.0)
    chunk: int = option(64, "Chunk size per dim (compress/dct.py's chunker: 64 → 64×64 = 4096 values of a "
                        "matrix, 64 of a vector).", ge=1)
    topk: int = option(64, "Values kept per chunk (of the error feedback, largest magnitude).", ge=1)
    transform: Literal["none", "dct"] = option(
        "none", "Top-k on the values themselves (none, the paper) or on their DCT-II coefficients (dct, DeMo's).")
    quantization: Literal["2bit", "none"] = option(
        "2bit", "Selected values on the wire: 2-bit statistical quantization (4 levels, the paper) or float32.")
    quant_range: float = option(6.0, "Range of the quantizer in standard deviations of a tensor's selected "
                                "values (the reference code's range_in_sigmas).", gt=0.0)
    topk_rule: Literal["min", "even", "area"] = option(
        "min", "Values kept per chunk of L values: min(topk, L) (min); Templar's even(max(2, min(topk, L))) "
        "(even); the paper code's max(1, round(L·topk/chunk²)), chunk² the full chunk's area (area; with "
        "transform = dct it keeps min(topk, L), as that code does).")
    error_decay: float = option(0.95, "Error-feedback decay β: e ← β·e + Δ.", ge=0.0, le=1.0)
    outer_lr: float = option(
        1.0, "Outer learning rate α: x_anchor ← x_anchor − α·agg_R(Δ̂). Both authors' codes (and MuLoCo's) also "
        "scale Δ by their outer lr a in the error feedback, a² in effect: their a is outer_lr = a² here.", gt=0.0)
    outer_momentum: float = option(
        0.0, "Nesterov momentum μ of the outer step on the aggregate (MuLoCo's quantized outer SGD, on top of the "
        "error feedback): b ← μ·b + agg_R(Δ̂); x_anchor ← x_anchor − α·(agg_R(Δ̂) + μ·b). 0 = the paper's plain "
        "step, no momentum state.", ge=0.0, lt=1.0)
    aggregate: Literal["mean", "senders"] = option(
        "mean", "Per coordinate, the mean of what the replicas sent over all R replicas (mean, the paper's "
        "(1/R)·Σ) or over the replicas that sent that coordinate (senders, both authors' codes).")
    clip: Literal["none", "median_norm"] = option(
        "none", "Scale each replica's sent values of a parameter by min(1, median_r ‖v_r‖ / ‖v_r‖) before "
        "aggregating (median_norm, Templar's; the lower median for even R; costs one float32 per shard per "
        "sync) or not (none).")
    sync_delay: int = option(
        0, "Steps τ the outer all-gather stays in flight (overlapped with the next τ inner steps) before "
        "the outer step lands, keeping the local progress of those steps: x ← x_anchor + (x − x at issue). "
        "0 = the paper's blocking sync; must be below H. Changes the algorithm.", ge=0)
    merge: Literal["additive", "lerp", "delayed", "eager"] = option(
        "additive", "How the outer step lands. additive: blocking with sync_delay = 0, else after sync_delay "
        "steps keeping the local progress (sync_delay above). lerp: Streaming DiLoCo's merge (Douillard et al. "
        "2025, §2.3) after sync_delay steps (0: at once), x ← α·x + (1 − α)·x_anchor, α = merge_alpha. "
        "delayed / eager (Kale, Douillard, Donchev 2025, "
        "arXiv 2502.12996): the all-gather stays in flight over the whole next period and is applied after it; "
        "delayed applies the aggregate that arrived, agg(t−1) (their naive one-outer-step delay), eager that "
        "aggregate with this replica's stale share replaced by its fresh one, agg(t−1) + (Δ̂_m(t) − Δ̂_m(t−1))/M "
        "(their eager update; the share 1/M is exact for aggregate = mean without a clip). Need sync_delay = 0; "
        "keep one (delayed) or two (eager) more copies of the parameters as state.")
    merge_alpha: float = option(
        0.0, "α of merge = \"lerp\": the weight the local parameters keep at the merge (Streaming DiLoCo's α; "
        "torchft's fragment_update_alpha). 0 = take the new anchor (the local steps since the issue dropped).",
        ge=0.0, le=1.0)
    lr: float = option(
        -1.0, "Initial inner learning rate; negative = [optimizer] lr × lr_scale. Wins over lr_scale (and "
        "over the preset's lr_scale) when set.")
    lr_scale: float = option(1.0, LR_SCALE_HELP, gt=0.0)


@dataclass
class Config(MuonOptions, _Own):
    """``[commopt.sparseloco]``."""


# The preset is SparseLoCo as Templar runs it; lr_scale (the study's best inner lr ÷ AdamW-HSDP's best,
# docs/benchmarks.md §8) is the one value our study sets: the lr is always tuned.
PRESETS: dict[str, dict[str, Any]] = {
    "SparseLoCo": {"H": 30, "chunk": 64, "topk": 64, "transform": "none", "quantization": "2bit",
                   "quant_range": 6.0, "topk_rule": "even", "error_decay": 0.95, "outer_lr": 1.0,
                   "aggregate": "senders", "clip": "median_norm", "lr_scale": 0.25},
    # MuLoCo's 2-bit outer wire: Muon inside, every value of the error-fed pseudo-gradient in 2 bits (no
    # top-k: each chunk keeps all its values, no indices on the wire), the replicas' mean, their Nesterov
    # outer SGD on top (their outer lr a = 0.8 is outer_lr = a² here, as SparseLoCo's).
    "MuLoCo-2bit": {"inner": "muon", "H": 30, "chunk": 64, "topk": 4096, "topk_rule": "min", "transform": "none",
                    "quantization": "2bit", "quant_range": 6.0, "error_decay": 0.9, "outer_lr": 0.64,
                    "outer_momentum": 0.9, "aggregate": "mean", "clip": "none", "beta1": 0.9, "beta2": 0.99,
                    "muon_momentum": 0.9, "muon_momentum_form": "undamped", "muon_nesterov": False,
                    "muon_coefficients": "muloco", "muon_dtype": "bf16", "muon_lr_rule": "spectral_norm",
                    "scalar_lr_scale": 1.0, "lr_scale": 1.0},
}

PRESET_SOURCES: dict[str, str] = {
    "SparseLoCo": "Algorithm 1 of Sarfi et al. 2025 (arXiv 2508.15706) as Templar v2.1.3 runs it "
    "(tplr-ai/templar c2397ac, hparams/hparams.json: inner_steps 30, target_chunk 64, topk_compression 64, "
    "use_dct false, quantization_bins 4 (2 bits), quantization_range 6, momentum_decay 0.95 (the error "
    "feedback's), outer_learning_rate 1.0; its outer step: the mean over the senders of a coordinate, each replica scaled to the "
    "median norm, an even k per chunk): 4203× fewer R bytes than AdamW-HSDP at 8B 2×8. lr_scale: our study's "
    "(docs/benchmarks.md §8: at cpu_tiny, 20 tokens per parameter, its best lr was 0.25× AdamW-HSDP's, the lowest "
    "tried (the optimum may lie lower); at cpu_micro 2×). Alternatives, from our small-model study (0.2 M parameters, 500 steps, "
    "docs/benchmarks.md §6): H = 2 with every value of a chunk (topk = 4096; 32× fewer bytes) ended +1.1 % of "
    "AdamW-HSDP's training loss; the paper's plain mean and no clip (aggregate = \"mean\", clip = \"none\", "
    "topk_rule = \"min\")",
    "MuLoCo-2bit": "MuLoCo (Thérien et al. 2025, arXiv 2505.23725) with its statistical 2-bit outer wire and error "
    "feedback, as facebookresearch/MuLoCo 475bbf4 configures it for two workers "
    "(torchtitan/config/diloco/2x_4gpu_muloco_quantized_outer.py: L37 outer lr a = 0.8, whose square is our "
    "outer_lr as SparseLoCo's (its error feedback takes a too: e ← 0.9·e + a·Δ, "
    "torchtitan/components/quantized_outer_sgd.py L1193-1195); L41-42 Nesterov momentum 0.9 on top of the error "
    "feedback; L39 error decay 0.9; L45 range 6 σ; L91 H = 30; Muon L12-15 μ = 0.9, Nesterov off, spectral_norm, "
    "the routed AdamW L2-3 β = 0.9, 0.99 at the Muon lr L28-31) with 4 bins (2 bits) from the paper's sweep "
    "(jobs/muloco_paper/inner_sweep_distributed_quantized_streaming.py L234: (0.9, 4)); every replica's dequantized "
    "payload averaged (quantized_outer_sgd.py L1246-1249). Our quantizer is their `statistical` one, per tensor "
    "(quantized_outer_sgd.py L263-306: bins of width range·σ/bins around the mean, each decoded to the mean of "
    "its members, as their code does it, not the ±range σ its docstring reads), over every value (topk = chunk² keeps each chunk whole: no top-k, no "
    "indices). Differences, not offered: the sweep's row-wise statistics (L282), its dense embeddings and norms "
    "(L279, L283) and its re-quantized aggregate (L280); the shipped config's compressor_type = \"topk\" (L50), "
    "which leaves its bins unused. lr_scale = 1, measured (docs/benchmarks.md §8.5: MuLoCo-2bit's best lr at cpu_micro, seed 42 = AdamW-HSDP's, 0.054)",
}


def check(cfg: Config, hparams: Optional[BaseHParams] = None) -> list[str]:
    """Cross-field rules of ``[commopt.sparseloco]``, one line per problem."""
    hparams = hparams or BaseHParams()
    for key, fallback in (("beta1", hparams.beta1), ("beta2", hparams.beta2)):
        value = fallback if getattr(cfg, key) < 0 else getattr(cfg, key)
        if not 0.0 <= value < 1.0:
            return [f"[{SECTION}] {key} = {getattr(cfg, key)!r}: allowed is a number in [0, 1) (negative: "
                    f"[optimizer] {key}, {fallback!r} here, which is not)"]
    if cfg.inner == "muon" and muon_problems(cfg, SECTION):
        return muon_problems(cfg, SECTION)
    if cfg.topk > cfg.chunk ** 2:
        return [f"[{SECTION}] topk = {cfg.topk}: allowed is at most chunk^2 = {cfg.chunk ** 2} (chunk = {cfg.chunk})"]
    if cfg.merge in ("delayed", "eager") and cfg.sync_delay:
        return [f"[{SECTION}] merge = {cfg.merge!r} with sync_delay = {cfg.sync_delay}: allowed is sync_delay = 0 with "
                "merge = \"delayed\" or \"eager\" (their sync stays in flight for a whole period by itself), or merge = "
                "\"additive\" for a sync_delay"]
    if cfg.merge != "lerp" and cfg.merge_alpha != 0.0:
        return [f"[{SECTION}] merge_alpha = {cfg.merge_alpha!r} with merge = {cfg.merge!r}: merge_alpha is read only by "
                "merge = \"lerp\"; set merge = \"lerp\", or leave merge_alpha unset"]
    if cfg.sync_delay >= cfg.H:
        return [f"[{SECTION}] sync_delay = {cfg.sync_delay}: allowed is an integer >= 0 below H = {cfg.H} "
                "(a sync must land before the next one is issued)"]
    return []


def chunk_topk(cfg: Config, L: int) -> int:
    """Values kept per chunk of ``L`` values (``topk_rule``)."""
    if cfg.topk_rule == "even":  # Templar: at least 2 and even (it packs index pairs)
        k = max(2, min(cfg.topk, L))
        return min(L, k - k % 2)
    if cfg.topk_rule == "area" and cfg.transform == "none":  # the paper code: k scaled to the chunk's area
        return min(L, max(1, round(L * cfg.topk / cfg.chunk**2)))
    return min(cfg.topk, L)


def _flat_dims(shape: Sequence[int]) -> tuple[int, ...]:
    """The dims chunks tile (``dct.Chunker``'s): ``(d0, rest)`` of a tensor of two or more dims."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (math.prod(shape),)


def whole_grid(shape: Sequence[int], s: int) -> tuple[int, ...]:
    """The tensor's chunk sizes: each (flattened) dim's largest divisor ≤ ``s``."""
    return tuple(chunk_size(d, s) for d in _flat_dims(shape))


def chunk_grid(shard: ShardShape, s: int) -> tuple[tuple[int, ...], bool]:
    """Chunk sizes for the local shard, and whether they are the tensor's own grid (each dim's largest
    divisor ≤ ``s``, of the whole tensor): they are wherever the shard is a union of the grid's chunks
    (along every split dim its start and extent are multiples of the chunk), so top-k picks the values
    an unsharded run picks. Elsewhere the shard is chunked on its own (its dims' largest divisors)."""
    whole = whole_grid(shard.shape, s)
    if not shard.numel or tuple(shard.local) == tuple(shard.shape):
        return whole, True
    for dim, (extent, size) in enumerate(zip(shard.local, shard.shape)):
        if extent == size:
            continue
        if dim > 1 or (dim == 1 and len(shard.shape) > 2):  # split inside the flattened rest: no grid
            break
        if extent % whole[dim] or shard.start(dim) % whole[dim]:
            break
    else:
        return whole, True
    return tuple(chunk_size(d, s) for d in _flat_dims(shard.local)), False


class ShardCodec:
    """What one local shard sends at a sync: its chunking (``transform``, ``chunks``: the chunk grid,
    :func:`chunk_grid`), per-chunk top-k, values, indices, and with ``clip`` its replica's norm.
    ``to_chunks``/``from_chunks``: the shard ↔ its ``(n_chunks, L)`` chunk-major values (or DCT
    coefficients), copies. Bytes of a shard: the codes in 2 bits and ``bins`` float32 levels (or
    float32 values), the in-chunk indices in ⌈log₂ L⌉ bits (none when k = L: every value, in chunk
    order), then (``median_norm``) one float32."""

    def __init__(self, cfg: Config, shape: Sequence[int], chunks: Optional[Sequence[int]] = None, device=None,
                 dtype=torch.float32):
        self.shape = tuple(shape)
        self.chunker = Chunker(self.shape, cfg.chunk, device=device, dtype=dtype, chunks=chunks)
        self.dct = cfg.transform == "dct"
        self.rows, self.L = self.chunker.n_chunks, self.chunker.L
        self.k = chunk_topk(cfg, self.L)
        self.n = self.rows * self.k
        self.quantizer = StatisticalQuantizer(BINS, cfg.quant_range) if cfg.quantization == "2bit" else None
        self.whole = self.k == self.L  # every value of every chunk: in chunk order, no indices on the wire
        self.index_codec = IndexCodec(self.L, pack=True)
        self.senders = cfg.aggregate == "senders"
        self.value_bytes = self.quantizer.nbytes(self.n) if self.quantizer else float_bytes(self.n, torch.float32)
        self.index_bytes = 0 if self.whole else self.index_codec.nbytes(self.n)
        self.norm_bytes = 4 if cfg.clip == "median_norm" else 0
        self.nbytes = self.value_bytes + self.index_bytes + self.norm_bytes

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

    def select(self, e_chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest-magnitude values of every chunk: ``(values (1, n) float32, indices (rows, k))``."""
        if self.whole:
            return e_chunks.reshape(1, self.n).float(), self._positions(self.rows, e_chunks.device)
        vals, idx = topk_per_chunk(e_chunks, self.k)
        return vals.reshape(1, self.n).float(), idx

    def _positions(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.L, device=device).expand(rows, self.L)

    def write(self, vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, codes: Optional[torch.Tensor] = None,
              levels: Optional[torch.Tensor] = None, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The selection (:meth:`select`; with the quantizer its ``codes`` and ``levels``, with
        ``median_norm`` the replica's ``norm``) into ``out`` (``uint8``, ``nbytes``): returns the dense
        chunk-major float32 values sent (zeros elsewhere)."""
        if self.quantizer is not None:
            sent = self.quantizer.dequantize(codes, levels)
            self.quantizer.encode_into(codes, levels, out[: self.value_bytes].view(1, -1))
        else:
            sent = vals
            out[: self.value_bytes].copy_(to_bytes(sent.view(-1), torch.float32))
        end = self.value_bytes + self.index_bytes
        if not self.whole:
            out[self.value_bytes: end].copy_(self.index_codec.encode(idx.reshape(1, self.n)).view(-1))
        if self.norm_bytes:
            out[end:].copy_(to_bytes(norm.reshape(1).float(), torch.float32))
        return torch.zeros(self.rows, self.L, device=vals.device).scatter_(-1, idx, sent.view(self.rows, self.k))

    def aggregate(self, payloads: torch.Tensor) -> torch.Tensor:
        """Every replica's bytes ``(W, nbytes)`` → the chunk-major float32 aggregate of what they sent
        (``aggregate``, after the ``clip``), replicas summed in replica order (the same bits on every
        rank)."""
        W = payloads.shape[0]
        values = payloads[:, : self.value_bytes]
        if self.quantizer is not None:
            vals = self.quantizer.decode(values, self.n)
        else:
            vals = from_bytes(values, torch.float32)
        end = self.value_bytes + self.index_bytes
        if self.whole:
            idx = self._positions(self.rows, payloads.device).expand(W, self.rows, self.L)
        else:
            idx = self.index_codec.decode(payloads[:, self.value_bytes: end], self.n).view(W, self.rows, self.k)
        if self.norm_bytes:  # each replica's values scaled to at most the median replica norm
            norms = from_bytes(payloads[:, end:], torch.float32).view(W)
            vals = vals * (norms.median() / (norms + CLIP_EPS)).clamp(max=1).unsqueeze(-1)
        vals = vals.view(W, self.rows, self.k)
        dense = torch.zeros(self.rows, self.L, device=payloads.device)
        if not self.senders:
            return accumulate_chunks_(dense, idx, vals / W)
        accumulate_chunks_(dense, idx, vals)
        senders = accumulate_chunks_(torch.zeros_like(dense), idx, torch.ones_like(vals))
        return dense.div_(senders.clamp_min_(1))


def _codec_for(cfg: Config, shard: ShardShape, device=None, dtype=torch.float32) -> ShardCodec:
    return ShardCodec(cfg, shard.local, chunk_grid(shard, cfg.chunk)[0], device=device, dtype=dtype)


def sparseloco_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """One all-gather of every shard's payload every H steps: per shard with elements, codes
    (log₂ bins bits) + indices (⌈log₂ L⌉ bits, none where k = L) + ``bins`` float32 levels (float32 values without
    quantization), + one float32 norm with ``median_norm``, on the chunk grid of :func:`chunk_grid`;
    sent = that ÷ H, received = (W − 1) × sent."""
    if replicate_size <= 1:
        return Bytes()
    cfg = resolved.options
    per_sync = sum(_codec_for(cfg, s, device="meta").nbytes for s in shards if s.numel)
    sent = per_sync / cfg.H
    return Bytes(sent, (replicate_size - 1) * sent)


def periodic(resolved: Resolved) -> Optional[PeriodicSyncs]:
    """One all-gather every H steps."""
    options = resolved.options
    if options.H > 1:
        return PeriodicSyncs((options.H,), lambda subset: dataclasses.replace(options, H=1, sync_delay=0,
                                                                               merge="additive", merge_alpha=0.0))
    return None


def settings(resolved: Resolved) -> dict[str, Any]:
    """The options behind the bytes (the non-default aggregation rules where set)."""
    o = resolved.options
    return {"H": o.H, "chunk": o.chunk, "topk": o.topk, "transform": o.transform, "quantization": o.quantization,
            **({"topk_rule": o.topk_rule} if o.topk_rule != "min" else {}),
            **({"clip": o.clip} if o.clip != "none" else {}),
            **({"inner": o.inner} if o.inner != "adamw" else {}),
            **({"sync_delay": o.sync_delay} if o.sync_delay else {}),
            **({"merge": o.merge} if o.merge != "additive" else {})}


def statistics_floats(cfg: Config) -> int:
    """float64 sums per tensor per sync that its shards add over each group sharding it: n, Σv, Σv²,
    then every bin's Σc and count with the quantizer; ‖v‖² alone for ``median_norm`` without it."""
    if cfg.quantization == "2bit":
        return 3 + 2 * BINS
    return 1 if cfg.clip == "median_norm" else 0


def sparseloco_s_bytes(shards: Sequence[ShardShape], resolved: Resolved, role: str = "S") -> Bytes:
    """The quantizer's (and the clip's) statistics over the shard groups, per rank per step: an
    all-reduce (sent = received) of :func:`statistics_floats` float64 per tensor sharded over a mesh
    dim of ``role`` (every such tensor, an empty local shard included), per sync ÷ H; with ``inner =
    "muon"`` plus the Muon step's exchanges of every step. Not part of FSDP2's traffic
    (``traffic.fsdp_traffic``): the training ledger records it beside it."""
    cfg = resolved.options
    per_sync = 8 * statistics_floats(cfg) * sum(
        sum(1 for r, _ in s.sharded if r == role) for s in shards)
    statistics = Bytes(per_sync / cfg.H, per_sync / cfg.H)
    if cfg.inner == "muon":  # and every inner step's Muon exchanges (muon/layout.py)
        return statistics + muon_shard_bytes(shards, cfg, role)
    return statistics


@dataclass
class _Piece:
    """One parameter as this rank syncs it: its codec (``None`` for an empty local shard) and the
    groups whose ranks hold its other pieces (the statistics are summed over them)."""

    p: torch.Tensor
    codec: Optional[ShardCodec]
    groups: Groups


class SparseLoCo(LocalSteps, CommOptimizer):
    """SparseLoCo on one replica's shards (see the module docstring). Per-parameter state:
    ``step`` (shared), ``exp_avg``, ``exp_avg_sq`` (AdamW's; with ``inner = "muon"`` a matrix has
    Muon's ``momentum_buffer`` instead), ``outer_anchor`` (x at the last outer step),
    ``error_feedback`` (e), ``outer_buf`` (b, with ``outer_momentum`` > 0); all but ``step``
    DTensors like their parameter."""

    params_replica_local = True  # parameters differ across replicas between syncs

    def __init__(self, named_params: Any, topology: Topology, options: Resolved, *,
                 ledger: Optional["comm.CommLedger"] = None) -> None:
        cfg, hp = options.options, options.hparams
        betas = (hp.beta1 if cfg.beta1 < 0 else cfg.beta1, hp.beta2 if cfg.beta2 < 0 else cfg.beta2)
        defaults = dict(lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)
        params = trainable(named_params)
        if cfg.inner == "muon":  # the hidden matrices step by Muon, the rest by AdamW (optim/routing.py)
            params = routed_groups(params, cfg, options.name, lr=hp.lr, muon={}, adamw={})
        super().__init__(params, topology, options, defaults, ledger=ledger)
        self.cfg = cfg
        self.muon = MuonMatrices(self.param_groups, topology, cfg) if cfg.inner == "muon" else None
        self.H, self._sync_delay, self._merge = cfg.H, cfg.sync_delay, cfg.merge
        self._alpha = cfg.merge_alpha if cfg.merge == "lerp" else None
        self._quantizer = StatisticalQuantizer(BINS, cfg.quant_range) if cfg.quantization == "2bit" else None
        self._replicate = topology.replicate if topology.replicated else None
        self._codecs: dict[tuple, ShardCodec] = {}
        self.start_step_counter()
        self._pieces: list[_Piece] = []
        off_grid = []
        for group, name, p in params_by_name(self.param_groups):
            self._init_state(p, group)
            shard, x = ShardShape.of(name, p), local(p)
            chunks, on_grid = chunk_grid(shard, cfg.chunk)
            codec = self._codec(x, chunks) if x.numel() else None
            self._pieces.append(_Piece(p, codec, sharding_groups(p, topology)))
            whole_L = math.prod(whole_grid(shard.shape, cfg.chunk))
            if not on_grid and not (codec.whole and chunk_topk(cfg, whole_L) == whole_L):  # else: every value
                off_grid.append(f"{name} {tuple(shard.local)} of {tuple(shard.shape)}")
        if off_grid:  # once per run: the layout decides what these shards keep
            logger.info(
                "%s: %d of %d parameter shards on this rank do not tile their tensor's chunk grid (e.g. %s): "
                "their top-k runs on the shard's own chunks, so the values kept and the update depend on the "
                "FSDP/TP layout there (the quantizer's statistics stay the whole tensor's)",
                options.name, len(off_grid), sum(pc.codec is not None for pc in self._pieces),
                "; ".join(off_grid[:3]))

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if state:
            return
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        state["step"] = self._step_t
        for key in self._row_states(group):
            state[key] = zeros()
        state["outer_anchor"] = p.detach().clone()
        state["error_feedback"] = zeros()
        if self.cfg.outer_momentum > 0:
            state["outer_buf"] = zeros()
        if self._merge in ("delayed", "eager"):  # zeros: the sync of nothing at update 0
            state["inflight_update"] = zeros()
            if self._merge == "eager":
                state["sent_update"] = zeros()

    @staticmethod
    def _row_states(group: dict) -> list[str]:
        """The inner optimizer's states of a parameter (after x and g in a step's row)."""
        return ["momentum_buffer"] if group.get("algorithm") == "muon" else ["exp_avg", "exp_avg_sq"]

    # ---- hooks the torchtitan adapter reads ---------------------------------------------------------
    def replicas_in_sync(self) -> bool:
        """Right after a blocking or delayed outer step, or a lerp at α = 0 (and before the first step)
        every replica holds the anchor; an eager one applies each replica's own fresh share."""
        exact = self._merge in ("additive", "delayed") or (self._merge == "lerp" and self._alpha == 0.0)
        return self._clock == 0 or (self._sync_delay == 0 and exact and self._clock % self.H == 0)

    def steps_to_next_sync(self) -> Optional[int]:
        if not self.topology.replicated or self.H == 1:
            return None
        return self.H - self._clock % self.H

    @contextmanager
    def global_params(self, *, ledger: Optional["comm.CommLedger"] = None) -> Iterator[None]:
        """The global model (``CommOptimizer.global_params``): the anchor, x after the last outer
        step that landed (with a sync in flight, the one before it); sends nothing, but for
        ``merge = "eager"``, whose replicas' anchors differ: their mean over R, one all-reduce recorded
        on ``ledger`` (default: ``self.ledger``)."""
        params = [pc.p for pc in self._pieces]
        anchors = [self.state[p]["outer_anchor"] for p in params]
        if self._merge == "eager" and self._replicate is not None:
            with replica_mean_swapped_in(params, self._replicate, wire_dtype=None,
                                         ledger=ledger if ledger is not None else self.ledger, sources=anchors):
                yield
            return
        with anchors_swapped_in(params, anchors):
            yield

    # ---- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, work = self.begin_local_step(closure, self._row_states)
        if work is None:
            return loss
        n = work.n
        matrices = []
        for group, rows in work.groups:
            if group.get("algorithm") == "muon":  # inner Muon (muon/engine.py), below
                stepping = [p for p in group["params"] if p.grad is not None]
                matrices += [(group, p, row[1], row[2]) for p, row in zip(stepping, rows)]
                continue
            b1, b2 = group["betas"]
            for xs, gs, ms, vs in column_chunks(rows, chunk_limit(rows[0][0].device)):
                updates.adamw_multi_(xs, gs, ms, vs, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                     weight_decay=group["weight_decay"], step=n, fused=True)  # inner AdamW
        if self.muon is not None:
            self.muon.step(matrices, self.runtime, self.ledger)
        self._sync(work.clock)
        return loss

    def _sync(self, n: int) -> None:
        """The outer step due after step ``n`` (the clock): every H steps, now, after ``sync_delay``
        steps, or overlapped with the next period (``merge``)."""
        if self._merge in ("delayed", "eager"):
            # The all-gather issued a period ago lands first (its aggregate into inflight_update), then this
            # period's outer step applies it and issues its own, landing by the next period's end.
            self.runtime.advance(n)
            if n % self.H == 0:
                self.runtime.start(self._overlapped_outer_step(), due=n + self.H, record=("overlapped", n))
            return
        if n % self.H == 0:
            if self._sync_delay:
                self.runtime.start(self._outer_step(streaming=True), due=n + self._sync_delay,
                                   record=("streaming", n))
            else:
                self.runtime.run(self._outer_step(streaming=False))
        self.runtime.advance(n)

    def _fail_sync(self, record: tuple[str, int]) -> None:
        """Live fault tolerance: the sync issued after update n (``record``) will not land, its quorum
        having ended first (the rule: ``titan/common/replica_group.py``). Every parameter returns to its
        anchor, its last global copy (the local steps since are lost, as torchft's DiLoCo loses them);
        the anchor and the outer momentum stay as they were. The error feedback keeps what it was at the
        issue: Δ̂ left it then and is lost with the sync. With an overlapped merge the aggregate in flight
        and the share sent become zero, the sync of nothing the merge starts from. Every replica decides
        alike, so the anchors stay equal."""
        overlapped = record[0] == "overlapped"
        for pc in self._pieces:
            st = self.state[pc.p]
            local(pc.p).copy_(local(st["outer_anchor"]))
            if overlapped:
                local(st["inflight_update"]).zero_()
                if "sent_update" in st:
                    local(st["sent_update"]).zero_()

    def _codec(self, x: torch.Tensor, chunks: tuple[int, ...]) -> ShardCodec:
        key = (tuple(x.shape), chunks, x.device, x.dtype)
        if key not in self._codecs:
            self._codecs[key] = ShardCodec(self.cfg, x.shape, chunks, device=x.device, dtype=x.dtype)
        return self._codecs[key]

    def _statistics(self, selected: list[Optional[torch.Tensor]]) -> list[tuple]:
        """``(codes, levels, norm)`` of every piece's ``selected`` values (``None``: an empty shard,
        which still joins its groups' sums) from its whole tensor's statistics: each piece's sums
        added over its shard groups, with the quantizer in two fused all-reduces per group (n, Σv, Σv²;
        then every bin's Σc and count), for the clip alone in one (‖v‖²)."""
        q, clip, ledger = self._quantizer, self.cfg.clip == "median_norm", self.ledger
        groups = [pc.groups for pc in self._pieces]
        devices = [local(pc.p).device for pc in self._pieces]

        def zeros(width: int, device: torch.device) -> torch.Tensor:
            return torch.zeros(1, width, dtype=torch.float64, device=device)

        if q is None:
            if not clip:
                return [(None, None, None)] * len(selected)
            squares = [v.double().square().sum().view(1, 1) if v is not None else zeros(1, d)
                       for v, d in zip(selected, devices)]
            sum_over(squares, groups, ledger=ledger)
            return [(None, None, sq.sqrt().float().view(1)) for sq in squares]
        moments = [q.moments(v) if v is not None else zeros(3, d) for v, d in zip(selected, devices)]
        sum_over(moments, groups, ledger=ledger)
        scales = [q.scale_of(m) for m in moments]
        codes = [q.codes(v, *sc) if v is not None else None for v, sc in zip(selected, scales)]
        bins = [q.bin_sums(v, c, sc[0]) if v is not None else zeros(2 * BINS, d)
                for v, c, sc, d in zip(selected, codes, scales, devices)]
        sum_over(bins, groups, ledger=ledger)
        levels = [q.levels(b, sc[0]) for b, sc in zip(bins, scales)]
        return [(c, lv, q.norms(b, lv) if clip else None) for c, lv, b in zip(codes, levels, bins)]

    def _compress(self) -> tuple[list, Optional[torch.Tensor], list[torch.Tensor]]:
        """This sync's payload: Δ, e ← β·e + Δ, Δ̂ = Q(Top-k(e)) and e ← e − Δ̂ for every shard (the
        statistics summed over the shard groups first). ``(live pieces, the send buffer, each live
        piece's Δ̂ in its shard's shape)``; no live piece: ``([], None, [])``."""
        pieces = self._pieces
        selections: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []
        for pc in pieces:
            if pc.codec is None:
                selections.append(None)
                continue
            x, st = local(pc.p), self.state[pc.p]
            anchor, e = local(st["outer_anchor"]), local(st["error_feedback"])
            e.mul_(self.cfg.error_decay).add_(anchor - x)  # e ← β·e + Δ, Δ = x_anchor − x
            selections.append(pc.codec.select(pc.codec.to_chunks(e)))  # Top-k(e)
        stats = self._statistics([sel[0] if sel is not None else None for sel in selections])
        live = [(pc, sel, st) for pc, sel, st in zip(pieces, selections, stats) if pc.codec is not None]
        if not live:
            return [], None, []
        send = torch.empty(sum(pc.codec.nbytes for pc, _, _ in live), dtype=torch.uint8, device=local(live[0][0].p).device)
        offset, updates_sent = 0, []
        for pc, (vals, idx), st in live:
            codec, e = pc.codec, local(self.state[pc.p]["error_feedback"])
            chunks = codec.write(vals, idx, send[offset: offset + codec.nbytes], *st)  # Δ̂ = Q(Top-k(e)), chunk-major
            sent = codec.from_chunks(chunks, e.dtype)
            e.sub_(sent)  # e ← e − Δ̂
            updates_sent.append(sent)
            offset += codec.nbytes
        return live, send, updates_sent

    def _aggregates(self, live: list, payloads: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(piece, agg_R(Δ̂) in its anchor's shape and dtype)`` for every live piece, from every
        replica's bytes."""
        offset = 0
        for pc, _, _ in live:
            codec, anchor = pc.codec, self.state[pc.p]["outer_anchor"]
            yield pc, codec.from_chunks(codec.aggregate(payloads[:, offset: offset + codec.nbytes]), anchor.dtype)
            offset += codec.nbytes

    def _outer_update(self, state: dict, delta: torch.Tensor) -> None:
        """The outer step on the anchor from an aggregate ``delta`` (used up): SGD, x_anchor ← x_anchor −
        α·delta, or with an outer momentum MuLoCo's Nesterov SGD."""
        anchor = local(state["outer_anchor"])
        if self.cfg.outer_momentum > 0:  # MuLoCo's: Nesterov SGD on the aggregate
            updates.nesterov_step_(anchor, delta, local(state["outer_buf"]), lr=self.cfg.outer_lr,
                                   momentum=self.cfg.outer_momentum)
        else:
            anchor.sub_(delta, alpha=self.cfg.outer_lr)  # x_anchor ← x_anchor − α·agg_R(Δ̂)

    def _outer_step(self, streaming: bool):
        """One sync, a task of :attr:`runtime`: Δ, e and the payload of every shard now
        (:meth:`_compress`), the all-gather, then the outer step (for ``streaming``, keeping the
        local progress since)."""
        live, send, _ = self._compress()
        if not live:
            return
        additive = streaming and self._alpha is None
        snapshots = [local(pc.p).clone() for pc, _, _ in live] if additive else None  # x at issue
        payloads = yield comm.all_gather(send, R, self._replicate, async_op=True, ledger=self.ledger)
        for i, (pc, agg) in enumerate(self._aggregates(live, payloads)):
            x, anchor = local(pc.p), local(self.state[pc.p]["outer_anchor"])
            self._outer_update(self.state[pc.p], agg)
            if self._alpha is not None:
                x.lerp_(anchor, 1.0 - self._alpha)  # x ← α·x + (1 − α)·x_anchor (weight 1: the anchor itself)
            elif additive:
                x.sub_(snapshots[i]).add_(anchor)  # x ← x_anchor + (x − x at issue)
            else:
                x.copy_(anchor)

    def _overlapped_outer_step(self):
        """One period's sync under ``merge = "delayed"`` / ``"eager"``, a task of :attr:`runtime`: this
        period's Δ̂_m(t) (:meth:`_compress`); the outer step on the aggregate that landed (delayed) or on
        it with this replica's stale share replaced by Δ̂_m(t) (eager, ``sync.eager_pseudo_gradient``);
        then Δ̂_m(t) kept as the share sent and the all-gather issued, parked until the next period's
        end (or a checkpoint), when its aggregate is written into ``inflight_update``."""
        live, send, updates_sent = self._compress()
        if not live:
            return
        eager, replicas = self._merge == "eager", self.topology.replicate_size
        for (pc, _, _), fresh in zip(live, updates_sent):
            st = self.state[pc.p]
            x, anchor, landed = local(pc.p), local(st["outer_anchor"]), local(st["inflight_update"])
            delta = eager_pseudo_gradient(landed, local(st["sent_update"]), fresh, replicas) if eager else landed.clone()
            self._outer_update(st, delta)  # x_anchor ← x_anchor − α·Δ̃ (or MuLoCo's Nesterov on Δ̃)
            x.copy_(anchor)
            if eager:
                local(st["sent_update"]).copy_(fresh)
        payloads = yield comm.all_gather(send, R, self._replicate, async_op=True, ledger=self.ledger)
        for pc, agg in self._aggregates(live, payloads):
            local(self.state[pc.p]["inflight_update"]).copy_(agg)


def state_shape(resolved: Resolved) -> dict[str, Any]:
    """What shapes the state: the inner optimizer (and its routing: which parameters keep Muon's
    momentum, which AdamW's moments), whether the outer step keeps a momentum, and an overlapped merge,
    which adds the aggregate in flight (and the share sent)."""
    cfg = resolved.options
    return {
        "inner": cfg.inner,
        **({"embed_names": cfg.embed_names, "head_names": cfg.head_names} if cfg.inner == "muon" else {}),
        "outer_momentum": "none (0)" if cfg.outer_momentum == 0 else "kept (> 0)",
        **({"merge": cfg.merge} if cfg.merge in ("delayed", "eager") else {}),
    }


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
    s_bytes=sparseloco_s_bytes,
    local_steps=True,
    summary="H local AdamW (or Muon) steps, then chunked top-k of the error-fed pseudo-gradient in 2-bit values, "
    "one all-gather, outer SGD on their aggregate (SparseLoCo; MuLoCo's 2-bit wire: every value, Muon inside, "
    "Nesterov outer momentum)",
)
