"""The offline data of both torchtitan lines: the bundled generated corpora (``titan_commopt/corpora.py``)
as files in the cache, and the datasets torchtitan's registry learns from us (the bundled corpora, and
``textfile``: a UTF-8 text file of one's own, one document per line), with the checks of a run's
dataset settings made before any process group exists. The cache is ``$TITAN_COMMOPT_CACHE`` or
``~/.cache/titan_commopt``; first-use builds are serialized across the ranks of one machine by a file
lock. The tokenizers trained on the corpora are each line's own: SentencePiece on 0.2.2
(``tt022/tokenizer.py``), a HuggingFace BPE on 0.3 (``tt03/assets.py``)."""

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from titan_commopt import corpora

__all__ = [
    "CORPUS_NAME", "BUNDLED", "HELD_OUT", "TEXTFILE_NAME", "BUNDLED_TOKENIZER", "cache_dir", "locked", "corpus_path", "read_lines",
    "is_bundled_tokenizer", "tokenizer_corpus", "register_datasets", "text_dataset_problems", "dataset_problems",
]

CORPUS_NAME = "commopt_tiny"  # the default bundled corpus
BUNDLED = tuple(corpora.GENERATORS)  # every bundled corpus: commopt_tiny, commopt_world and their held-out twins
HELD_OUT = dict(corpora.HELD_OUT)  # training corpus -> its held-out twin, the [validation] dataset
TEXTFILE_NAME = "textfile"  # the dataset that reads [training] dataset_path, one document per line
BUNDLED_TOKENIZER = "bundled"  # [model] hf_assets_path naming the tokenizer trained on a bundled corpus


def cache_dir() -> Path:
    root = os.environ.get("TITAN_COMMOPT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "titan_commopt"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialize first-use builds across the ranks of one machine."""
    with open(str(path) + ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def corpus_path(name: str = CORPUS_NAME) -> Path:
    path = cache_dir() / f"{name}_v{corpora.VERSIONS[name]}.txt"
    if not path.exists():
        with locked(path):
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text("\n".join(corpora.generate(name)) + "\n", encoding="utf-8")
                os.replace(tmp, path)
    return path


def read_lines(path: str | os.PathLike) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


def is_bundled_tokenizer(hf_assets_path: Optional[str]) -> bool:
    """Whether ``[model] hf_assets_path`` names the bundled tokenizer (``"bundled"``, or empty)."""
    return (hf_assets_path or "").strip() in ("", BUNDLED_TOKENIZER)


def tokenizer_corpus(dataset: str) -> str:
    """The bundled corpus the bundled tokenizer is trained on: the run's (a held-out twin's training
    corpus: held-out text is read with the tokenizer its model was trained with), else the default one."""
    name = dataset.lower()
    training = {heldout: corpus for corpus, heldout in HELD_OUT.items()}
    return training.get(name, name if name in BUNDLED else CORPUS_NAME)


# ---- torchtitan's dataset registry ---------------------------------------------------------------
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


# ---- the checks, before any process group ---------------------------------------------------------
def text_dataset_problems(job_config: Any, lines_needed: int) -> list[str]:
    """``[training]``'s dataset, and ``[validation]``'s when enabled (both torchtitan lines)."""
    training = job_config.training
    out = dataset_problems("training", training.dataset, training.dataset_path, lines_needed)
    if training.dataset.lower() in HELD_OUT.values():
        out.append(f"[training] dataset = {training.dataset!r}: held-out text is never trained on; allowed is a "
                   f"training corpus ({', '.join(HELD_OUT)}), with {training.dataset!r} as [validation] dataset")
    if job_config.validation.enable:
        validation = job_config.validation
        out += dataset_problems("validation", validation.dataset, validation.dataset_path, lines_needed)
    return out


def _nonblank_lines(path: str, at_least: int) -> int:
    """How many non-blank lines ``path`` has, counting no further than ``at_least``."""
    count = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                count += 1
                if count >= at_least:
                    break
    return count


_LOCAL_DATASETS = ("c4_test",)  # torchtitan datasets whose default path is a local directory


def dataset_problems(section: str, dataset: str, dataset_path: Optional[str], dp: int) -> list[str]:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    name = dataset.lower()  # torchtitan lowers the name too
    if name not in DATASETS:
        return [f"[{section}] dataset = {dataset!r}: allowed is one of {', '.join(sorted(DATASETS))}"]
    if name not in (*BUNDLED, TEXTFILE_NAME):
        # torchtitan's own datasets: its loaders decide, except for a local path that does not exist
        # (c4_test reads ./tests/assets/c4_test; a dataset_path given as a filesystem path)
        path = dataset_path or DATASETS[name].path
        local = name in _LOCAL_DATASETS or os.path.isabs(path) or path.startswith(("./", "../", "~"))
        if local and not os.path.exists(os.path.expanduser(path)):
            key = "dataset_path" if dataset_path else "dataset"
            shown = dataset_path if dataset_path else dataset
            return [
                f"[{section}] {key} = {shown!r}: {os.path.abspath(os.path.expanduser(path))} does not exist "
                f"(torchtitan's {name!r} reads it); allowed is an existing dataset directory, or dataset = "
                f"\"textfile\" with dataset_path = a UTF-8 text file"
            ]
        return []
    if name == TEXTFILE_NAME and not dataset_path:
        return [f"[{section}] dataset = {dataset!r} needs dataset_path = a UTF-8 text file, one document per line"]
    if not dataset_path:
        return []
    where = f"[{section}] dataset_path = {dataset_path!r}"
    if not os.path.isfile(dataset_path):
        why = "is a directory" if os.path.isdir(dataset_path) else "no such file"
        return [f"{where}: {why}; allowed is a UTF-8 text file, one document per line"]
    try:
        found = _nonblank_lines(dataset_path, dp)
    except UnicodeDecodeError:
        return [f"{where}: not UTF-8 text; allowed is a UTF-8 text file, one document per line"]
    except OSError as error:
        return [f"{where}: cannot be read ({error.strerror or error})"]
    if found == 0:
        return [f"{where}: has no text (empty or only blank lines); allowed is a file with one document per line"]
    if found < dp:
        return [
            f"{where}: has {found} non-blank line(s) but the data-parallel degree is {dp}: every data-parallel "
            f"rank needs at least one document (one per line)"
        ]
    return []
