"""Offline data for the quickstart, tests and benchmarks: a generated corpus and a SentencePiece
tokenizer trained on it at first use (cached), wired into torchtitan's dataset registry and
``build_tokenizer_fn``.

The corpus is produced by a seeded generator (our own text, so it is free of any licence): short
stories with consistent entities and arithmetic ("Mia has 3 apples. Leo gives her 2 more. Now Mia
has 5 apples.") so that a tiny model has structure to learn beyond word frequencies. About 2.3 MB.

Your own data: ``[training] dataset = "textfile"`` with ``dataset_path`` = a UTF-8 text file (one
document per line). Your own tokenizer: ``[model] hf_assets_path`` = a directory with a
HuggingFace ``tokenizer.json`` (torchtitan's own loader) or a SentencePiece ``tokenizer.model``;
``"bundled"`` (or empty) trains/loads the bundled one.
"""

import fcntl
import os
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

CORPUS_NAME = "commopt_tiny"
TEXTFILE_NAME = "textfile"
CORPUS_VERSION = 1
VOCAB_SIZE = 1024  # the CPU flavors' vocab_size; SentencePiece may stop below it


def cache_dir() -> Path:
    root = os.environ.get("TITAN_COMMOPT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "titan_commopt"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize first-use builds across the ranks of one machine."""
    with open(str(path) + ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- corpus ----------------------------------------------------------------------------------
_NAMES = ["Mia", "Leo", "Ava", "Noah", "Ivy", "Omar", "Zoe", "Finn", "Lena", "Hugo", "Rosa", "Theo"]
_PRONOUN = {n: ("her" if n in {"Mia", "Ava", "Ivy", "Zoe", "Lena", "Rosa"} else "him") for n in _NAMES}
_SUBJECT = {n: ("She" if _PRONOUN[n] == "her" else "He") for n in _NAMES}
_THINGS = ["apples", "books", "coins", "shells", "stones", "pencils", "cards", "marbles", "plums", "keys"]
_PLACES = ["the market", "the river", "the old mill", "the garden", "the library", "the harbor",
           "the hill", "the bakery", "the forest", "the station"]
_ADJ = ["small", "quiet", "bright", "cold", "warm", "busy", "green", "narrow", "tall", "sunny"]
_WEATHER = ["rain fell softly", "the wind was strong", "the sun was high", "fog covered the road",
            "snow lay on the roofs", "the sky was clear"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve"]


def _story(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    place = rng.choice(_PLACES)
    have = rng.randint(1, 9)
    give = rng.randint(1, 3)
    lines = [
        f"One {rng.choice(['morning', 'evening', 'day', 'night'])}, {a} went to {place}.",
        f"The {rng.choice(_ADJ)} streets were {rng.choice(_ADJ)}, and {rng.choice(_WEATHER)}.",
        f"{a} had {have} {thing}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"{b} gave {_PRONOUN[a]} {give} more {thing}.")
        lines.append(f"Now {a} had {have + give} {thing}.")
    else:
        give = min(give, have)
        lines.append(f"{a} gave {b} {give} of the {thing}.")
        lines.append(f"Now {a} had {have - give} {thing}, and {b} had {give}.")
    lines.append(f"{_SUBJECT[a]} counted them: {', '.join(_NUMBER_WORDS[1:min(have, 12) + 1])}.")
    lines.append(f"Then {a} and {b} walked home from {place}.")
    return " ".join(lines)


def generate_corpus(n_docs: int = 4500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_story(rng) for _ in range(rng.randint(1, 3))) for _ in range(n_docs)]


def corpus_path() -> Path:
    path = cache_dir() / f"{CORPUS_NAME}_v{CORPUS_VERSION}.txt"
    if not path.exists():
        with _locked(path):
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text("\n".join(generate_corpus()) + "\n", encoding="utf-8")
                os.replace(tmp, path)
    return path


def read_lines(path: str | os.PathLike) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


# ---- tokenizer ---------------------------------------------------------------------------------
def bundled_tokenizer_path() -> Path:
    prefix = cache_dir() / f"spm_{CORPUS_NAME}_v{CORPUS_VERSION}_{VOCAB_SIZE}"
    model = Path(str(prefix) + ".model")
    if not model.exists():
        import sentencepiece as spm

        corpus = corpus_path()
        with _locked(model):
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
    """``build_tokenizer_fn``: bundled SentencePiece, a user's SentencePiece model, or HF files."""
    path = (job_config.model.hf_assets_path or "").strip()
    if path in ("", "bundled"):
        return SentencePieceTokenizer(bundled_tokenizer_path())
    p = Path(path)
    if p.is_file() and p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if (p / "tokenizer.model").is_file() and not (p / "tokenizer.json").is_file():
        return SentencePieceTokenizer(p / "tokenizer.model")
    from torchtitan.components.tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(job_config)


# ---- dataset registration ----------------------------------------------------------------------
def _lines_dataset(path: str | None) -> Any:
    """``commopt_tiny``: the bundled corpus, or ``dataset_path`` when one is given."""
    from datasets import Dataset

    return Dataset.from_dict({"text": read_lines(path or corpus_path())})


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

    DATASETS.setdefault(CORPUS_NAME, DatasetConfig(path="", loader=_lines_dataset, sample_processor=_text))
    DATASETS.setdefault(TEXTFILE_NAME, DatasetConfig(path="", loader=_textfile_dataset, sample_processor=_text))


if __name__ == "__main__":  # prebuild the cache: python -m titan_commopt.titan.data
    print(corpus_path())
    print(bundled_tokenizer_path())
