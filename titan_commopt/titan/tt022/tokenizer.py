"""Offline data for the quickstart, tests and benchmarks: the bundled generated corpora
(``titan_commopt/corpora.py``: ``commopt_tiny`` for the quickstart and tests, ``commopt_world`` for the
optimizer quality study) and a SentencePiece tokenizer trained on each at first use (cached), wired
into torchtitan's dataset registry and ``build_tokenizer_fn``.

Your own data: ``[training] dataset = "textfile"`` with ``dataset_path`` = a UTF-8 text file (one
document per line). Your own tokenizer: ``[model] hf_assets_path`` = a directory with a
HuggingFace ``tokenizer.json`` (torchtitan's own loader) or a SentencePiece ``tokenizer.model``;
``"bundled"`` (or empty) trains/loads the bundled one.
"""

import os
from pathlib import Path
from typing import Any

from titan_commopt import corpora

from ..common.data import BUNDLED, CORPUS_NAME, cache_dir, corpus_path, locked, read_lines

TEXTFILE_NAME = "textfile"
VOCAB_SIZE = 1024  # the CPU flavors' vocab_size; SentencePiece may stop below it


# ---- tokenizer ---------------------------------------------------------------------------------
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
    if path in ("", "bundled"):
        dataset = job_config.training.dataset.lower()
        return SentencePieceTokenizer(bundled_tokenizer_path(dataset if dataset in BUNDLED else CORPUS_NAME))
    p = Path(path)
    if p.is_file() and p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if (p / "tokenizer.model").is_file() and not (p / "tokenizer.json").is_file():
        return SentencePieceTokenizer(p / "tokenizer.model")
    from torchtitan.components.tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(job_config)


# ---- dataset registration ----------------------------------------------------------------------
def _bundled_loader(name: str) -> Any:
    def load(path: str | None) -> Any:
        """A bundled corpus, or ``dataset_path`` when one is given."""
        from datasets import Dataset

        return Dataset.from_dict({"text": read_lines(path or corpus_path(name))})

    return load


def _textfile_dataset(path: str | None) -> Any:
    """``textfile``: ``dataset_path``, one document per line. No path, or a file without text, is an
    error here (the pre-flight check says so first): torchtitan would re-loop an empty set forever."""
    from datasets import Dataset

    if not path:
        raise ValueError('[training] dataset = "textfile" needs dataset_path = a UTF-8 text file, one document per line')
    lines = read_lines(path)
    if not lines:
        raise ValueError(f"[training] dataset_path = {str(path)!r}: has no text (empty or only blank lines)")
    return Dataset.from_dict({"text": lines})


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add the bundled corpus and the plain-text-file loader to torchtitan's dataset registry."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name in BUNDLED:
        DATASETS.setdefault(name, DatasetConfig(path="", loader=_bundled_loader(name), sample_processor=_text))
    DATASETS.setdefault(TEXTFILE_NAME, DatasetConfig(path="", loader=_textfile_dataset, sample_processor=_text))


if __name__ == "__main__":  # prebuild the cache: python -m titan_commopt.titan.adapter.data [corpus ...]
    import sys

    for corpus in sys.argv[1:] or [CORPUS_NAME]:
        print(corpus_path(corpus))
        print(bundled_tokenizer_path(corpus))
