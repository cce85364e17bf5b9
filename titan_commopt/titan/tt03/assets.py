"""The offline tokenizer and dataset of the CPU config (torchtitan 0.3), built at first use.

torchtitan 0.3 reads a HuggingFace ``tokenizer.json`` (+ ``tokenizer_config.json``) from
``hf_assets_path`` and a JSON dataset directory (``datasets.load_dataset(dir, split="train")``,
its ``c4_test`` loader) from ``dataloader.dataset_path``. Both are built here from the bundled corpus
(``common/data.py``) into the cache: a byte-level BPE tokenizer of :data:`VOCAB_SIZE` ids (below
llama3 ``debugmodel``'s 2048) trained with HuggingFace ``tokenizers``, and one ``{"text": ...}``
object per line. Nothing is downloaded. ``scripts/setup.sh`` builds both in a 0.3 venv
(``python -m titan_commopt.titan.tt03.assets`` does too).
"""

import json
import os
import shutil
from pathlib import Path

from titan_commopt import corpora

from ..common.data import CORPUS_NAME, cache_dir, corpus_path, locked, read_lines

__all__ = ["VOCAB_SIZE", "tokenizer_dir", "dataset_dir"]

VOCAB_SIZE = 2000
_BOS, _EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _build_once(path: Path, build) -> Path:
    if not path.exists():
        with locked(path):
            if not path.exists():
                tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                build(tmp)
                os.replace(tmp, path)
    return path


def tokenizer_dir(corpus: str = CORPUS_NAME) -> Path:
    """A directory with ``tokenizer.json`` and ``tokenizer_config.json`` for ``corpus``."""

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE, special_tokens=[_BOS, _EOS], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train([str(corpus_path(corpus))], trainer)
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": _BOS, "eos_token": _EOS}))

    return _build_once(cache_dir() / f"hf_tokenizer_{_versioned(corpus)}_{VOCAB_SIZE}", build)


def dataset_dir(corpus: str = CORPUS_NAME) -> Path:
    """A directory with ``data.json``: ``corpus`` as one JSON object ``{"text": ...}`` per line."""

    def build(out: Path) -> None:
        with open(out / "data.json", "w", encoding="utf-8") as handle:
            for line in read_lines(corpus_path(corpus)):
                handle.write(json.dumps({"text": line}) + "\n")

    return _build_once(cache_dir() / f"json_dataset_{_versioned(corpus)}", build)


def _versioned(corpus: str) -> str:
    """The cache name of what is built from ``corpus``: its generator's version in it, so that a
    changed corpus is never read through a stale build."""
    return f"{corpus}_v{corpora.VERSIONS[corpus]}" if corpus in corpora.VERSIONS else corpus


if __name__ == "__main__":
    print(tokenizer_dir())
    print(dataset_dir())
