import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titan_commopt import comm
from titan_commopt.topology import R, S, Topology
from tests.dist_utils import run_distributed


def _mesh_and_ledger(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh, grad_scale=2.0)
    ledger = comm.CommLedger()
    # Which ranks share R / S: gather global ranks over each group.
    r_members = [int(x) for x in comm.all_gather(torch.tensor([rank]), R, topo.replicate, ledger=ledger)[:, 0]]
    s_members = [int(x) for x in comm.all_gather(torch.tensor([rank]), S, topo.shard, ledger=ledger)[:, 0]]
    ledger.end_step()
    # Sizes the ledger must report equal what was sent.
    x = torch.full((10, 3), float(rank))
    comm.all_reduce(x, R, topo.replicate, op="mean", ledger=ledger)
    y = torch.ones(7, dtype=torch.bfloat16) * rank
    gathered = comm.all_gather(y, S, topo.shard, ledger=ledger)
    a, b = torch.full((4,), float(rank)), torch.full((2, 2), 10.0 * rank, dtype=torch.float64)
    comm.all_reduce_fused([a, b], R, topo.replicate, op="mean", dtype=torch.bfloat16, ledger=ledger)
    step = ledger.end_step()
    return dict(
        r=r_members, s=s_members, sizes=(topo.replicate_size, topo.shard_size, topo.tp_size),
        replica=topo.replica_index, x=x, gathered=gathered, a=a, b=b, step=step,
        totals=dict(ledger.totals), grad=topo.replica_grad(torch.ones(2)),
    )


def test_topology_2x2_and_ledger_counts():
    out = run_distributed(_mesh_and_ledger, 4)
    for rank, o in enumerate(out):
        # mesh [[0,1],[2,3]]: dp_replicate is the outer dim, fsdp the inner one.
        assert o["r"] == [rank % 2, rank % 2 + 2]
        assert o["s"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert o["sizes"] == (2, 2, 1)
        assert o["replica"] == rank // 2
        assert torch.equal(o["x"], torch.full((10, 3), (rank % 2 + rank % 2 + 2) / 2))
        assert torch.equal(o["gathered"].float(), torch.tensor([[rank // 2 * 2.0] * 7, [rank // 2 * 2 + 1.0] * 7]))
        assert torch.allclose(o["a"], torch.full((4,), float(rank % 2 + 1)))
        assert o["b"].dtype == torch.float64
        # ledger: x = 30 fp32 = 120 B all-reduced; fused = 8 bf16 = 16 B; gather 7 bf16 = 14 B sent, 14 recv.
        assert o["step"]["R_sent"] == 120 + 16 and o["step"]["R_recv"] == 120 + 16
        assert o["step"]["S_sent"] == 14 and o["step"]["S_recv"] == 14
        assert o["step"]["R_calls"] == 2 and o["step"]["S_calls"] == 1
        assert o["totals"]["R_sent"] == 136 + 8  # the first step's 1-element int64 gather
        assert torch.equal(o["grad"], torch.full((2,), 2.0))


def test_single_topology_is_noop():
    topo = Topology.single()
    ledger = comm.CommLedger()
    x = torch.ones(3)
    comm.all_reduce(x, R, topo.replicate, op="mean", ledger=ledger)
    assert torch.equal(comm.all_gather(x, R, topo.replicate, ledger=ledger), x.unsqueeze(0))
    assert ledger.end_step() == {}
    assert (topo.replicate_size, topo.shard_size, topo.tp_size, topo.replica_index) == (1, 1, 1, 0)


def _async_collectives(rank, world_size):
    """Every collective with ``async_op=True``: issued first, waited for later, equal to the
    synchronous form; bytes counted at issue, seconds at completion (no extra calls)."""
    group = dist.group.WORLD
    sync_ledger, async_ledger = comm.CommLedger(), comm.CommLedger()
    x = torch.arange(6.0) * (rank + 1)
    fused = [torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank, dtype=torch.float64)]
    stacked = torch.arange(8.0).view(2, 4) + rank

    def run(ledger, async_op):
        xs, fs = x.clone(), [t.clone() for t in fused]
        issued = [
            comm.all_reduce(xs, R, group, op="mean", ledger=ledger, async_op=async_op),
            comm.all_gather(x, R, group, ledger=ledger, async_op=async_op),
            comm.reduce_scatter(stacked, R, group, ledger=ledger, async_op=async_op),
            comm.all_reduce_fused(fs, R, group, op="mean", ledger=ledger, async_op=async_op),
        ]
        if async_op:
            at_issue = ledger.current()
            issued = [p.wait() for p in issued]
            return issued[:3], fs, at_issue, ledger.end_step()
        return issued[:3], fs, None, ledger.end_step()

    return run(sync_ledger, False), run(async_ledger, True)


def _two_rank_world(rank, world_size):
    """Both 2-rank checks of this file in one spawn (the second builds its own mesh and groups)."""
    return {"async": _async_collectives(rank, world_size),
            "r_own_group": _r_in_flight_and_a_world_collective(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_results():
    # a deadlock (R sharing the world's group) fails the spawn at its timeout
    return run_distributed(_two_rank_world, 2, timeout=180)


def test_async_collectives_equal_sync_and_are_counted_once(two_rank_results):
    for (sync_out, sync_fused, _, sync_step), (async_out, async_fused, at_issue, async_step) in \
            (out["async"] for out in two_rank_results):
        for a, b in zip(sync_out + sync_fused, async_out + async_fused):
            assert torch.equal(a, b)
        assert at_issue["R_sent"] == async_step["R_sent"] == sync_step["R_sent"]
        assert at_issue.get("R_seconds", 0.0) == 0.0 and async_step["R_seconds"] > 0.0
        assert async_step["R_calls"] == sync_step["R_calls"] == 4
    assert async_fused[0][0] == 0.5  # mean of 0 and 1: gloo has no AVG, SUM then divide


def _r_in_flight_and_a_world_collective(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_replicate",))
    topo = Topology.from_mesh(mesh)  # R spans the world: DeviceMesh's group for it is the default one
    ledger = comm.CommLedger()
    big, small = torch.full((1 << 16,), float(rank + 1)), torch.full((1,), 10.0 * (rank + 1))
    # The ranks issue the two collectives in opposite orders, as a step does when R's transfer is
    # left in flight (overlap, sync_delay) and the next step's clip all-reduces over the world:
    # only separate groups keep each collective matched with its own kind on the other rank.
    if rank == 0:
        pending = comm.all_reduce(big, R, topo.replicate, op="sum", ledger=ledger, async_op=True)
        dist.all_reduce(small)
    else:
        dist.all_reduce(small)
        pending = comm.all_reduce(big, R, topo.replicate, op="sum", ledger=ledger, async_op=True)
    pending.wait()
    return dict(own=topo.replicate != dist.group.WORLD, ranks=dist.get_process_group_ranks(topo.replicate),
                big=big[:3].tolist(), small=small.tolist())


def test_r_gets_its_own_group_when_it_spans_the_world(two_rank_results):
    for o in (out["r_own_group"] for out in two_rank_results):
        assert o["own"] and o["ranks"] == [0, 1]
        assert o["big"] == [3.0, 3.0, 3.0] and o["small"] == [30.0]
