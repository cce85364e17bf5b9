"""``[commopt.dion]``: Dion's options, its preset and where the preset's values come from; read by
the optimizer (``optimizer.py``) and by the layout rules (``layout.py``)."""

from dataclasses import dataclass
from typing import Any, Literal

from titan_commopt.options import option

from ..common import LR_SCALE_HELP
from ..routing import EMBED_NAMES, HEAD_NAMES

__all__ = ["Config", "PRESETS", "PRESET_SOURCES"]


@dataclass
class Config:
    """``[commopt.dion]``."""

    rank: int = option(0, "Rank r of every Dion matrix update; 0 = use rank_fraction.", ge=0)
    rank_fraction: float = option(
        0.25, "r = ceil(rank_fraction · min(m, n)) when rank = 0 (1.0 = full rank).", gt=0.0, le=1.0
    )
    mu: float = option(0.95, "Momentum decay μ of the error-feedback momentum.", ge=0.0, lt=1.0)
    orthogonalize: Literal["qr", "cholesky_qr"] = option(
        "cholesky_qr",
        "How P is orthonormalized: cholesky_qr (CholeskyQR2 with an r×r Gram all-reduce over the "
        "row shards; falls back to qr when ill-conditioned) or qr (Householder QR; P is gathered "
        "over row shards, m×r).",
    )
    compress: Literal["auto", "always", "never"] = option(
        "auto",
        "Replicate (R) sync of Dion matrices: auto = all-reduce P and R ((m+n)·r) only where "
        "(m+n)·r < m·n, else the full gradient; always / never force one path.",
    )
    scalar_optimizer: Literal["adamw", "lion"] = option(
        "adamw", "Optimizer of embeddings, output head, norms, biases."
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
    embed_names: str = option(EMBED_NAMES, "Comma-separated module names routed as embeddings.")
    head_names: str = option(HEAD_NAMES, "Comma-separated module names routed as the output head.")
    colnorm_eps: float = option(1e-8, "ε added to the column norms of R (as microsoft/dion).", ge=0.0)
    seed: int = option(0, "Seed of the initial Q (identical on every rank).", ge=0)
    orientation: Literal["reference", "paper"] = option(
        "reference",
        "Which side of each matrix Q lives on: reference = microsoft/dion's rule (a wide matrix, m < n, "
        "runs transposed; a sharded one is oriented by its sharding: transposed when FSDP (S) shards "
        "its rows or TP its columns, not when FSDP shards its columns or TP its rows); paper = the "
        "paper's form for every matrix (Q n×r). Results differ by ~1e-2 relative after a few steps; "
        "sqrt(m/n), r and the R-sync bytes do not change.",
    )
    scalar_sync: Literal["dense", "demo"] = option(
        "dense",
        "Replicate (R) sync of the embedding and output-head gradients: dense = one fp32 all-reduce of the "
        "gradient shard (microsoft/dion); demo = DCT-chunked top-k of the gradient plus a per-replica "
        "error-feedback buffer, the replicas' selections all-gathered and averaged (DeMo's wire), then "
        "the scalar optimizer steps on that mean. Norms and biases stay dense either way. No effect "
        "with one replica.",
    )
    scalar_chunk: int = option(
        64, "scalar_sync = demo: DCT chunk size s per dim (largest divisor of the dim <= s).", ge=1
    )
    scalar_topk: int = option(
        256, "scalar_sync = demo: coefficients sent per chunk (of s*s); >= s*s keeps everything. 256 of 64x64 "
        "is the quality study's choice (docs/benchmarks.md §6).", ge=1
    )
    scalar_transfer_dtype: Literal["fp32", "bf16", "fp16"] = option(
        "bf16", "scalar_sync = demo: wire dtype of the selected values (indices are bit-packed)."
    )
    mixed_precision: bool = option(
        False,
        "Store Dion's momentum and Q and the scalar optimizer's moments in bfloat16 (microsoft/dion's "
        "mixed-precision setting); products, orthogonalization and column norms still run in the "
        "parameter dtype (float32 at least), and P and R go over the wire in the parameter dtype.",
    )
    matmul_precision: Literal["fp32", "tf32", "bf16"] = option(
        "fp32",
        "Precision of Dion's large products (B Q, Bᵀ P and the rank-r updates P Rᵀ, P Qᵀ) on float32 "
        "parameters: fp32 = IEEE float32 (microsoft/dion's results); tf32 = TensorFloat-32 tensor cores "
        "on CUDA (torch's fp32_precision = \"tf32\", set around these products only; no effect on a CPU); "
        "bf16 = operands rounded to bfloat16, products accumulated and returned in float32 (bf16 tensor "
        "cores on CUDA, emulated exactly on a CPU). Orthonormalization and column norms stay float32.",
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
