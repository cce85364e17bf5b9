"""Every byte formula in one place: what a rank sends and receives per step.

Used by the training container (``comm/R_ratio_vs_adamw_hsdp`` and FSDP2's estimated traffic), by
``scripts/comm_report.py`` (any flavor and mesh, on the meta device) and by the tests that hold the
ledger of real runs against these numbers. Units follow ``titan_commopt.comm``: payload per rank
(an all-reduce of n bytes: n sent, n received; an all-gather over W ranks: n sent, (W − 1)·n
received). Every formula reads parameters as :class:`~titan_commopt.optim.family.ShardShape`.
"""

from dataclasses import dataclass
from typing import Sequence

from titan_commopt import comm
from titan_commopt.topology import R, S

from .family import Bytes, Resolved, ShardShape

__all__ = [
    "FsdpTraffic", "fsdp_traffic", "adamw_hsdp_r_bytes", "demo_r_bytes", "local_r_bytes", "dion_r_bytes",
]


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


# ---- the families' R payloads --------------------------------------------------------------------
def demo_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """DeMo/FlexDeMo: one all-gather of every shard's packed payload (averaged over the
    replicator's period), so received = (W − 1) × sent."""
    from titan_commopt.compress.replicators import make_replicator

    if replicate_size <= 1:
        return Bytes()
    sent = 0.0
    for s in shards:
        if s.numel == 0:
            continue
        rep = make_replicator(resolved.options, s.local, s.fqn)
        sent += sum(rep.payload_bytes(t) for t in range(1, rep.period + 1)) / rep.period
    return Bytes(sent, (replicate_size - 1) * sent)


def local_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """DES-LOC / MT-DAO / LocalAdam / DiLoCo: d·(1/Kx + Σ_j 1/K_j + 1/Kv)·bytes, all-reduce (sent =
    received); d = the local shard's elements, bytes = the transfer dtype's (the parameter's for
    ``native``); a period of 0 (never) adds nothing."""
    from .local_adaptive import settings

    if replicate_size <= 1:
        return Bytes()
    st = settings(resolved.options, resolved.hparams)
    inv = lambda k: 1.0 / k if k > 0 else 0.0  # noqa: E731
    per_element = inv(st.Kx) + sum(inv(k) for k in st.periods_u) + inv(st.Kv)
    dtype = resolved.options.transfer_dtype
    total = sum(s.numel * (s.itemsize if dtype == "native" else comm.DTYPES[dtype].itemsize) for s in shards)
    return Bytes(total * per_element, total * per_element)


def dion_r_bytes(shards: Sequence[ShardShape], resolved: Resolved, replicate_size: int) -> Bytes:
    """Dion, all-reduce (sent = received), in the parameter dtype: a compressed matrix costs
    ``(m_loc + slice rows)·r`` elements (P's local rows, and this rank's slice of R after the
    reduce-scatter over the row shards: ``dion.r_slice``), an uncompressed matrix and every
    scalar-optimizer parameter its local shard. A matrix that runs transposed (``dion.transposed``)
    costs its slice of P (X's ``n_loc`` columns split over X's row shards) plus its slice of R (X's
    ``m_loc`` rows split over X's column shards): the same number as the paper's form wherever
    X's columns are not sharded."""
    from .dion import compressed, dion_rank, r_slice, route, transposed

    if replicate_size <= 1:
        return Bytes()
    cfg = resolved.options
    total = 0
    for s in shards:
        elements = s.numel
        if route(s.fqn, len(s.shape), cfg) == "dion":
            m, n = s.shape
            r = dion_rank(m, n, cfg)
            if compressed(m, n, r, cfg):
                if transposed(m, n, s.sharded, cfg.orientation):
                    elements = (r_slice(s.local[1], s.row_split)[1] + r_slice(s.local[0], s.col_split)[1]) * r
                else:
                    elements = (s.local[0] + r_slice(s.local[1], s.row_split)[1]) * r
        total += elements * s.itemsize
    return Bytes(total, total)

