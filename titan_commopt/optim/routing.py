"""Which update a parameter gets in the families that split the model by kind (Dion, and every family
with a Muon step): the hidden matrices get the matrix update; embeddings, the output head, norms and
biases a scalar optimizer (AdamW; Lion for Dion). The rule of the Dion and Muon papers and of
microsoft/dion's and MuLoCo's codes, written once: by module name first (by shape an embedding or a
head is a matrix like any other), then by the number of dims."""

from typing import Any, Iterable, Iterator

__all__ = ["KINDS", "EMBED_NAMES", "HEAD_NAMES", "route", "named_pairs"]

KINDS = ("matrix", "embed", "head", "scalar")  # what route() returns

# The module names found as embeddings and as the output head (torchtitan's, Hugging Face's, GPT-2's).
EMBED_NAMES = "tok_embeddings,embed_tokens,wte"
HEAD_NAMES = "output,lm_head"

_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"}


def _names(csv: str) -> set[str]:
    return {s.strip() for s in csv.split(",") if s.strip()}


def route(fqn: str, ndim: int, embed_names: str, head_names: str, matrix_ndims: tuple[int, ...] = (2,)) -> str:
    """``"matrix"``, ``"embed"``, ``"head"`` or ``"scalar"`` for the parameter ``fqn`` of ``ndim``
    dims: ``head`` or ``embed`` when a dotted component of its module's name is one of the
    comma-separated ``head_names`` / ``embed_names`` (the wrappers of torch.compile, activation
    checkpointing and FSDP left out), else ``matrix`` when ``ndim`` is one of ``matrix_ndims``."""
    parts = [p for p in fqn.split(".")[:-1] if p not in _WRAPPERS]
    if _names(head_names).intersection(parts):
        return "head"
    if _names(embed_names).intersection(parts):
        return "embed"
    return "matrix" if ndim in matrix_ndims else "scalar"


def named_pairs(named_params: Iterable[Any], family: str) -> Iterator[tuple[str, Any]]:
    """``(fqn, param)`` pairs, given as such or inside param-group dicts of them (a family that routes
    makes its param groups itself: a dict that carries more than ``params`` is refused, naming
    ``family``)."""
    for entry in named_params:
        if isinstance(entry, dict):
            if set(entry) - {"params"}:
                raise ValueError(f"{family}: param groups are made by routing (fqn, param) pairs; a param-group "
                                 f"dict carries only 'params', got {sorted(entry)}")
            yield from entry["params"]
        else:
            yield entry
