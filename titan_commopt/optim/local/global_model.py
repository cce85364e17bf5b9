"""The global model of the local-step families, swapped into the parameters for an evaluation
(``CommOptimizer.global_params``): what both local engines share.

Between syncs every replica's parameters differ; the model a user keeps is the synchronized one:

- a family with an outer step on an anchor (DiLoCo's Nesterov, SparseLoCo's compressed SGD): the
  anchor, x after the last outer step that landed (:func:`anchors_swapped_in`); with eager overlapped
  outer steps each replica's anchor holds its own fresh share, so the mean_R of the anchors
  (:func:`replica_mean_swapped_in` with ``sources``);
- a family that averages its parameters (DES-LOC, MT-DAO, Local Adam): mean_R(x), what a sync now
  would make, in the sync's own wire dtype (:func:`replica_mean_swapped_in`: one all-reduce over R,
  in buckets of at most :data:`BUCKET_ELEMENTS`).

Both keep a copy of each local shard they overwrite and copy it back on exit, so the replicas'
parameters are back bit for bit (nothing is recomputed): the memory an evaluation costs is one copy
of this rank's parameter shards (plus one bucket while the mean is on the wire).
"""

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from titan_commopt import comm
from titan_commopt.topology import R

from ..common import local
from .steps import DEFAULT_CHUNK_ELEMENTS, column_chunks

__all__ = ["BUCKET_ELEMENTS", "anchors_swapped_in", "replica_mean_swapped_in"]

# Elements per all-reduce of the mean: the buffer it sends is a copy, so a bound keeps the swap's
# memory at one parameter copy (the saved shards) plus this.
BUCKET_ELEMENTS = DEFAULT_CHUNK_ELEMENTS


@contextmanager
def _swapped(params: list[torch.Tensor], fill: Callable[[list[torch.Tensor]], None]) -> Iterator[None]:
    """Inside: ``fill(shards)`` has written the global model into the local shards of ``params``;
    after: each shard's own values, copied back from a copy taken first."""
    with torch.no_grad():
        shards = [local(p) for p in params]
        own = [s.clone() for s in shards]
    try:
        with torch.no_grad():
            fill(shards)
        yield
    finally:
        with torch.no_grad():
            for shard, saved in zip(shards, own):
                shard.copy_(saved)


@contextmanager
def anchors_swapped_in(params: list[torch.Tensor], anchors: list[torch.Tensor]) -> Iterator[None]:
    """Each parameter holds its anchor inside (``anchors[i]`` of ``params[i]``, laid out alike)."""

    def fill(shards: list[torch.Tensor]) -> None:
        for shard, anchor in zip(shards, anchors):
            shard.copy_(local(anchor))

    with _swapped(params, fill):
        yield


@contextmanager
def replica_mean_swapped_in(
    params: list[torch.Tensor], replicate: Optional["torch.distributed.ProcessGroup"], *,
    wire_dtype: Optional[torch.dtype], ledger: "comm.CommLedger", sources: Optional[list[torch.Tensor]] = None,
) -> Iterator[None]:
    """Each parameter holds mean_R of its local shard inside (of ``sources[i]``'s, laid out alike,
    where given: the anchors): the all-reduce a sync would make (``wire_dtype`` on the wire, None:
    each tensor's own), recorded on ``ledger``."""

    def fill(shards: list[torch.Tensor]) -> None:
        if sources is not None:
            for shard, source in zip(shards, sources):
                shard.copy_(local(source))
        for (bucket,) in column_chunks([[s] for s in shards if s.numel()], BUCKET_ELEMENTS):
            comm.all_reduce_fused(bucket, R, replicate, op="mean", dtype=wire_dtype, ledger=ledger)

    with _swapped(params, fill):
        yield
