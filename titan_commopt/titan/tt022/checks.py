"""torchtitan 0.2.2's checks of the model, tokenizer and data a run names (its TrainSpec registry),
made before any process group exists: the ``spec_problems`` the config check
(``config/torchtitan_keys.py``) is given on this line."""

import os
from typing import Any

from titan_commopt.optim import owns_replicate_sync

from ..common.data import is_bundled_tokenizer, text_dataset_problems
from ..config.tokenizer_files import SENTENCEPIECE, damaged, first_damaged, huggingface_files
from ..common.model import COMMOPT_SPEC
from . import tokenizer

__all__ = ["spec_problems"]


def _model_problems(job_config: Any) -> tuple[list[str], Any]:
    """Unknown model name or flavor, or an optimizer of ours on a spec that cannot build it.
    Returns (problems, the TrainSpec or None)."""
    from torchtitan.protocols import train_spec as registry

    model, name = job_config.model, job_config.optimizer.name
    try:
        spec = registry.get_train_spec(model.name)
    except ValueError:
        from torchtitan.models import _supported_models

        known = sorted(set(registry._extra_train_specs) | set(_supported_models))
        return [f"[model] name = {model.name!r}: allowed is one of {', '.join(known)}"], None
    except Exception:  # a torchtitan model that does not import here: leave it to torchtitan
        return [], None
    out = []
    if owns_replicate_sync(name) and model.name != COMMOPT_SPEC:
        out.append(
            f"[model] name = {model.name!r} with [optimizer] name = {name!r}: allowed is {COMMOPT_SPEC!r} "
            f"(the TrainSpec that builds titan_commopt optimizers; {model.name!r} knows only AdamW and Adam)"
        )
    flavors = getattr(spec, "model_args", None) or {}
    if flavors and model.flavor not in flavors:
        out.append(f"[model] flavor = {model.flavor!r}: allowed is one of {', '.join(flavors)} (model {model.name!r})")
    return out, spec


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # what the loaders read


_HF_FILES = tuple(f for f in _TOKENIZER_FILES if f != "tokenizer.model")  # what torchtitan's build_hf_tokenizer reads


def _tokenizer_problems(model: Any, spec: Any) -> list[str]:
    """Our specs' tokenizer (``tokenizer.py: build_tokenizer``): ``bundled``, a SentencePiece
    ``.model`` file, or a directory holding one of the files torchtitan's loader reads; torchtitan's
    own specs (``build_hf_tokenizer``): a directory holding one of those files."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    builder = getattr(spec, "build_tokenizer_fn", None) if spec is not None else None
    if builder is build_hf_tokenizer:
        path = model.hf_assets_path or ""
        where = f"[model] hf_assets_path = {path!r}"
        allowed = f"allowed is a directory with {', '.join(_HF_FILES[:-1])} or {_HF_FILES[-1]} (model {model.name!r})"
        if not os.path.isdir(path):
            return [f"{where}: {'not a directory' if os.path.exists(path) else 'no such directory'}; {allowed}"]
        if not any(os.path.isfile(os.path.join(path, f)) for f in _HF_FILES):
            return [f"{where}: holds no tokenizer; {allowed}"]
        problem = first_damaged(path, huggingface_files(path, chat_template=False))
        return [f"{where}: {problem}; {allowed}"] if problem else []
    if builder is not tokenizer.build_tokenizer:
        return []
    path = (model.hf_assets_path or "").strip()
    if is_bundled_tokenizer(path):
        return []
    allowed = ('allowed is "bundled" (the offline tokenizer), a directory with tokenizer.json (HuggingFace) '
               "or tokenizer.model (SentencePiece), or a SentencePiece .model file")
    where = f"[model] hf_assets_path = {model.hf_assets_path!r}"
    if os.path.isfile(path) and path.endswith(".model"):
        problem = damaged(path)
        return [f"{where}: the file {problem}; {allowed}"] if problem else []
    if not os.path.exists(path):
        return [f"{where}: no such file or directory; {allowed}"]
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return [f"{where}: holds no tokenizer ({', '.join(_TOKENIZER_FILES)}); {allowed}"]
    sentencepiece = not os.path.isfile(os.path.join(path, "tokenizer.json")) and \
        os.path.isfile(os.path.join(path, SENTENCEPIECE))  # as tokenizer.build_tokenizer picks
    names = (SENTENCEPIECE,) if sentencepiece else huggingface_files(path, chat_template=False)
    problem = first_damaged(path, names)
    return [f"{where}: {problem}; {allowed}"] if problem else []


def _uses_text_datasets(spec: Any) -> bool:
    if spec is None:
        return False
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    return getattr(spec, "build_dataloader_fn", None) is build_text_dataloader


def spec_problems(job_config: Any, lines_needed: int) -> list[str]:
    """torchtitan 0.2.2's model, tokenizer and dataset checks (its TrainSpec registry)."""
    models, spec = _model_problems(job_config)
    out = models + _tokenizer_problems(job_config.model, spec)
    if _uses_text_datasets(spec):
        out += text_dataset_problems(job_config, lines_needed)
    return out
