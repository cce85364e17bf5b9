"""The traffic that is not a family's: the AdamW-HSDP baseline and FSDP2's own collectives.

Each family's R payload formula lives in the family's module, beside the code whose bytes it
counts (``Family.r_bytes``). These two are used by the training container
(``comm/R_ratio_vs_adamw_hsdp`` and FSDP2's estimated traffic), by ``scripts/comm_report.py`` (any
flavor and mesh, on the meta device) and by the tests that hold the ledger of real runs against
them. Units follow ``titan_commopt.comm``: payload per rank
(an all-reduce of n bytes: n sent, n received; an all-gather over W ranks: n sent, (W − 1)·n
received). Every formula reads parameters as :class:`~titan_commopt.optim.family.ShardShape`.
"""

from dataclasses import dataclass
from typing import Sequence

from titan_commopt import comm
from titan_commopt.topology import R, S

from .family import Bytes, ShardShape

__all__ = ["FsdpTraffic", "fsdp_traffic", "adamw_hsdp_r_bytes"]


# ---- the baseline and FSDP2's own collectives ----------------------------------------------------
def adamw_hsdp_r_bytes(shards: Sequence[ShardShape], replicate_size: int, reduce_bytes: int = 4) -> Bytes:
    """AdamW over HSDP/DDP: the all-reduce of each rank's gradient shard over R, every step
    (``reduce_bytes``: the gradient reduce dtype's size, fp32 by default)."""
    if replicate_size <= 1:
        return Bytes()
    n = sum(s.numel for s in shards) * reduce_bytes
    return Bytes(n, n)


@dataclass(frozen=True)
class FsdpTraffic:
    """Per-rank payload per step of the collectives FSDP2/HSDP issue themselves (estimates)."""

    s_all_gather_sent: int = 0  # forward (+ backward re-gather) of the local parameter shards
    s_all_gather_recv: int = 0
    s_reduce_scatter: int = 0  # gradient reduce-scatter: (S − 1)/S of the full gradient each way
    r_all_reduce: int = 0  # HSDP's gradient all-reduce of the local shard over R (AdamW only)

    @property
    def s_bytes(self) -> Bytes:
        return Bytes(self.s_all_gather_sent + self.s_reduce_scatter, self.s_all_gather_recv + self.s_reduce_scatter)

    def record(self, ledger: comm.CommLedger) -> None:
        if self.s_all_gather_sent:
            comm.record_estimate(S, "fsdp_all_gather", self.s_all_gather_sent, self.s_all_gather_recv, ledger=ledger)
        if self.s_reduce_scatter:
            comm.record_estimate(S, "fsdp_reduce_scatter", self.s_reduce_scatter, self.s_reduce_scatter, ledger=ledger)
        if self.r_all_reduce:
            comm.record_estimate(R, "hsdp_all_reduce", self.r_all_reduce, self.r_all_reduce, ledger=ledger)


def fsdp_traffic(
    shards: Sequence[ShardShape], shard_size: int, replicate_size: int, *, param_bytes: int = 4,
    reduce_bytes: int = 4, gathers: int = 2, hsdp_r_sync: bool = False,
) -> FsdpTraffic:
    """FSDP2's traffic from the local shards: ``gathers`` all-gathers of the parameters per step (2
    when they are resharded after forward, 1 otherwise) and one gradient reduce-scatter over S;
    plus HSDP's all-reduce over R when FSDP2 (not the optimizer) syncs R."""
    numel = sum(s.numel for s in shards)
    out = FsdpTraffic()
    if shard_size > 1:
        out = FsdpTraffic(
            s_all_gather_sent=gathers * numel * param_bytes,
            s_all_gather_recv=gathers * (shard_size - 1) * numel * param_bytes,
            s_reduce_scatter=(shard_size - 1) * numel * reduce_bytes,
        )
    if hsdp_r_sync and replicate_size > 1:
        out = FsdpTraffic(out.s_all_gather_sent, out.s_all_gather_recv, out.s_reduce_scatter, numel * reduce_bytes)
    return out
