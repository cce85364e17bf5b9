"""Topology built from torchtitan's ParallelDims (``titan/common/mesh.py``: the one mapping function of both lines)."""

import torch

from tests.dist_utils import run_distributed
from titan_commopt import comm
from titan_commopt.topology import R, S


def _from_parallel_dims(rank, world_size, replicate, shard):
    from torchtitan.distributed.parallel_dims import ParallelDims

    from titan_commopt.titan.platform.cpu import use_cpu_if_no_accelerator
    from titan_commopt.titan.common.mesh import topology_of

    use_cpu_if_no_accelerator()
    dims = ParallelDims(dp_shard=shard, dp_replicate=replicate, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size)
    dims.build_mesh()
    topo = topology_of(dims)
    me = torch.tensor([rank])
    return dict(
        sizes=(topo.replicate_size, topo.shard_size, topo.tp_size),
        grad_scale=topo.grad_scale,
        r=comm.all_gather(me, R, topo.replicate)[:, 0].tolist(),
        s=comm.all_gather(me, S, topo.shard)[:, 0].tolist(),
    )


def _degenerate(rank, world_size):
    """Both 2-process meshes in one spawn: DDP (|S| = 1), then FSDP (|R| = 1), each from its own ParallelDims."""
    return {"ddp": _from_parallel_dims(rank, world_size, 2, 1), "fsdp": _from_parallel_dims(rank, world_size, 1, 2)}


def test_hsdp_2x2_parallel_dims():
    for rank, o in enumerate(run_distributed(_from_parallel_dims, 4, 2, 2)):
        assert o["sizes"] == (2, 2, 1)
        assert o["grad_scale"] == 2.0  # torchtitan normalizes by the global token count over 2 replicas
        assert o["r"] == [rank % 2, rank % 2 + 2]  # same shard index, other replica
        assert o["s"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_degenerate_sizes():
    for rank, both in enumerate(run_distributed(_degenerate, 2)):
        o = both["ddp"]  # DDP: |S| = 1
        assert o["sizes"] == (2, 1, 1) and o["r"] == [0, 1] and o["s"] == [rank]
        o = both["fsdp"]  # FSDP: |R| = 1
        assert o["sizes"] == (1, 2, 1) and o["grad_scale"] == 1.0 and o["r"] == [rank] and o["s"] == [0, 1]
