"""The bundled generated corpora (``titan_commopt/corpora.py``) as files in the cache, for both
torchtitan lines (0.2.2: ``adapter/data.py``; 0.3: ``v03/assets.py``). The cache is
``$TITAN_COMMOPT_CACHE`` or ``~/.cache/titan_commopt``; first-use builds are serialized across the
ranks of one machine by a file lock."""

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from titan_commopt import corpora

__all__ = ["CORPUS_NAME", "BUNDLED", "cache_dir", "locked", "corpus_path", "read_lines"]

CORPUS_NAME = "commopt_tiny"  # the default bundled corpus
BUNDLED = tuple(corpora.GENERATORS)  # every bundled corpus: commopt_tiny, commopt_world


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
