"""The tokenizer files a run names, read before any process group exists by the library that reads
them in training: a damaged file is one line naming it, instead of the tokenizer library's traceback
on every rank once the process group exists (SentencePiece's ``could not parse ModelProto`` on
0.2.2, HuggingFace tokenizers' ``expected value at line 1 column 2`` on 0.3, which names no file).

Each line's checks (``tt022/checks.py``, ``tt03_toml/toml_config.py``, ``tt03/preflight.py``) name the
files their loader reads; :func:`first_damaged` reads them. A file is read, not just found: these are
small next to a model (a llama3 ``tokenizer.json`` parses in a fraction of a second)."""

import json
import os
from typing import Optional

__all__ = ["SENTENCEPIECE", "damaged", "first_damaged", "huggingface_files"]

SENTENCEPIECE = "tokenizer.model"  # our 0.2.2 tokenizer's, when no tokenizer.json is beside it


def damaged(path: str) -> Optional[str]:
    """Why the tokenizer file ``path`` cannot be read as what its name says (``*.model``: a
    SentencePiece model; ``tokenizer.json``: a HuggingFace tokenizer; ``*.json``: JSON; ``*.jinja``:
    a Jinja template), as the words that follow its name ("cannot be read ..."); None when it reads."""
    name = os.path.basename(path)
    try:
        if name.endswith(".model"):
            import sentencepiece

            sentencepiece.SentencePieceProcessor(model_file=path)
        elif name == "tokenizer.json":
            from tokenizers import Tokenizer

            Tokenizer.from_file(path)
        elif name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
        elif name.endswith(".jinja"):
            import jinja2.ext
            import jinja2.sandbox

            with open(path, encoding="utf-8") as f:  # torchtitan's environment, as it compiles the template
                jinja2.sandbox.ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]).from_string(f.read())
    except Exception as error:  # noqa: BLE001 - each library has its own types; any failure is the file's
        what = ("by HuggingFace tokenizers" if name == "tokenizer.json" else
                "as a SentencePiece model" if name.endswith(".model") else
                "as JSON" if name.endswith(".json") else "as a Jinja template")
        detail = str(error).splitlines()[0] if str(error).strip() else ""
        return f"cannot be read {what} ({type(error).__name__}{': ' + detail if detail else ''})"
    return None


def huggingface_files(directory: str, *, chat_template: bool) -> tuple[str, ...]:
    """The files torchtitan's HuggingFaceTokenizer parses in ``directory``: ``tokenizer.json``, or
    without it ``vocab.json``; ``tokenizer_config.json``; and with it, where ``chat_template`` (0.3),
    ``chat_template.jinja``."""
    has = lambda name: os.path.isfile(os.path.join(directory, name))  # noqa: E731
    names = ["tokenizer.json" if has("tokenizer.json") else "vocab.json", "tokenizer_config.json"]
    if chat_template and has("tokenizer_config.json"):
        names.append("chat_template.jinja")
    return tuple(names)


def first_damaged(directory: str, names: tuple[str, ...]) -> Optional[str]:
    """``<file>: <why>`` of the first of ``names`` in ``directory`` that is there and damaged, or None."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            problem = damaged(path)
            if problem is not None:
                return f"{path} {problem}"
    return None
