"""Our llama3 model, for both lines: its names, and the shapes of the flavors we add to llama3's.

0.2.2 registers the names as TrainSpecs (``tt022/spec.py``) and builds ``TransformerModelArgs`` from
the shapes; our TOML on 0.3 accepts the names (``tt03_toml/toml_config.py``) and builds a
``Llama3Model.Config``. ``vocab_size`` None: the bundled tokenizer's vocabulary (its size differs
between the lines)."""

from typing import Any

__all__ = ["COMMOPT_SPEC", "REFERENCE_SPEC", "FLAVOR_SHAPES"]

COMMOPT_SPEC = "llama3_commopt"  # torchtitan's llama3 + our optimizers (any [optimizer] name)
REFERENCE_SPEC = "llama3_reference"  # torchtitan's stock llama3, with only what a CPU run needs: the baseline

FLAVOR_SHAPES: dict[str, dict[str, Any]] = {
    # ~63k parameters (0.2.2), ~3.8x fewer than cpu_tiny: the quality study's smaller model, at the same
    # tokens per parameter, so that a gap can be read against the model size.
    "cpu_micro": dict(dim=24, n_layers=2, n_heads=4, vocab_size=None, multiple_of=32),
    # ~0.2M parameters: unit/integration tests and the quality study.
    "cpu_tiny": dict(dim=64, n_layers=2, n_heads=4, vocab_size=None, multiple_of=64),
    # ~1.2M parameters: the quickstart and CPU benchmarks.
    "cpu_small": dict(dim=128, n_layers=4, n_heads=4, vocab_size=None, multiple_of=64),
    # ~110M: optimizer step overhead on CPU.
    "100M": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, multiple_of=256),
    # ~300M shape of the DeMo paper's OLMo-300M scale, for comm reports (meta device).
    "300M": dict(dim=1024, n_layers=16, n_heads=16, vocab_size=50304, multiple_of=256),
    # ~1.5B, Llama 3.2 1B's shape (its embedding untied, as torchtitan's llama3 has it): one-GPU runs.
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               rope_theta=500000, vocab_size=128256),
}
