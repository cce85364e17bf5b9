"""torchtitan 0.2.2's tokenizer of our specs (``build_tokenizer_fn``): a SentencePiece model trained at
first use on a bundled corpus (``common/data.py``: ``commopt_tiny`` for the quickstart and tests,
``commopt_world`` for the optimizer quality study) and cached, or one's own.

``[model] hf_assets_path``: ``"bundled"`` (or empty) trains/loads the bundled one; a directory with a
HuggingFace ``tokenizer.json`` (torchtitan's own loader) or a SentencePiece ``tokenizer.model``; a
SentencePiece ``.model`` file. ``scripts/setup.sh`` builds the bundled one into the cache
(:func:`bundled_tokenizer_path`)."""

import os
from pathlib import Path
from typing import Any

from titan_commopt import corpora

from ..common.data import CORPUS_NAME, cache_dir, corpus_path, is_bundled_tokenizer, locked, tokenizer_corpus

VOCAB_SIZE = 1024  # the CPU flavors' vocab_size; SentencePiece may stop below it


def bundled_tokenizer_path(name: str = CORPUS_NAME) -> Path:
    """The SentencePiece model trained on bundled corpus ``name`` (built at first use, cached)."""
    prefix = cache_dir() / f"spm_{name}_v{corpora.VERSIONS[name]}_{VOCAB_SIZE}"
    model = Path(str(prefix) + ".model")
    if not model.exists():
        import sentencepiece as spm

        corpus = corpus_path(name)
        with locked(model):
            if not model.exists():
                tmp_prefix = str(prefix) + f".tmp{os.getpid()}"
                spm.SentencePieceTrainer.train(
                    input=str(corpus),
                    model_prefix=tmp_prefix,
                    vocab_size=VOCAB_SIZE,
                    model_type="bpe",
                    byte_fallback=True,
                    hard_vocab_limit=False,
                    character_coverage=1.0,
                    bos_id=1,
                    eos_id=2,
                    unk_id=0,
                    pad_id=-1,
                    num_threads=1,
                    minloglevel=2,
                )
                os.replace(tmp_prefix + ".model", model)
                os.remove(tmp_prefix + ".vocab")
    return model


def _base_tokenizer_cls() -> type:
    from torchtitan.components.tokenizer import BaseTokenizer

    return BaseTokenizer


class SentencePieceTokenizer(_base_tokenizer_cls()):  # type: ignore[misc]
    """torchtitan ``BaseTokenizer`` over a SentencePiece model."""

    def __init__(self, model_path: str | os.PathLike):
        super().__init__()
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **_: Any) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int], **_: Any) -> str:
        return self.sp.decode(list(ids))

    def get_vocab_size(self) -> int:
        return self.sp.get_piece_size()


def build_tokenizer(job_config: Any) -> Any:
    """``build_tokenizer_fn``: bundled SentencePiece, a user's SentencePiece model, or HF files.
    "bundled" is the tokenizer of the bundled corpus the job trains on (``commopt_tiny``'s for any
    other dataset)."""
    path = (job_config.model.hf_assets_path or "").strip()
    if is_bundled_tokenizer(path):
        return SentencePieceTokenizer(bundled_tokenizer_path(tokenizer_corpus(job_config.training.dataset)))
    p = Path(path)
    if p.is_file() and p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if (p / "tokenizer.model").is_file() and not (p / "tokenizer.json").is_file():
        return SentencePieceTokenizer(p / "tokenizer.model")
    from torchtitan.components.tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(job_config)

