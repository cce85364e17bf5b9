"""torchtitan's token count within the replica for optimizers that own R (``titan/common/token_count.py``).

4 gloo processes, one spawn, on torchtitan's own meshes: HSDP 2 × 2 (replicas {0, 1} and {2, 3}) and
DDP 4 × 1 (|S| = 1). Rank r counts r + 1 tokens, so every sum tells which ranks it spanned:
torchtitan's count over the batch mesh is 10 on every rank; the count within the replica is
|R| × 3 = 6 on replica 0 and |R| × 7 = 14 on replica 1 at 2 × 2, and 4 × (r + 1) at 4 × 1.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.both_lines


def _counts_on(dims):
    from torchtitan.distributed import utils as dist_utils

    from titan_commopt.titan.common import token_count
    from titan_commopt.topology import Topology

    dims.build_mesh()

    def group(*names):  # S is "fsdp" on 0.2.2, "dp_shard" on 0.3; a dim of size 1 has none
        for name in names:
            try:
                mesh = dims.get_optional_mesh(name)
            except ValueError:  # a name this line does not know
                continue
            return mesh.get_group() if mesh is not None and mesh.size() > 1 else None

    topology = Topology(replicate=group("dp_replicate"), shard=group("fsdp", "dp_shard"))
    batch, loss = dims.get_mesh("batch"), dims.get_mesh("loss")
    tokens = torch.tensor(dist_utils_rank() + 1, dtype=torch.int64)

    def count(mesh, name=None):
        # looked up at the call, as torchtitan's train step does: 0.2.2 counts with dist_sum (a Python
        # number), 0.3 with dist_sum_tensor (a tensor)
        name = name or ("dist_sum_tensor" if hasattr(dist_utils, "dist_sum_tensor") else "dist_sum")
        x = getattr(dist_utils, name)(tokens, mesh)
        return int(x.item() if isinstance(x, torch.Tensor) else x)

    out = {"before": count(batch)}
    with token_count.per_replica(batch, topology):
        out["step"] = count(batch)
        out["other_mesh"] = count(loss, "dist_sum")  # the loss logs: over every rank
        out["sum"] = count(batch, "dist_sum")  # either function, the same rule
    out["after"] = count(batch)  # the evaluation's count, outside a step
    out["applies_without_r"] = token_count.replica_count_applies(batch, None)
    return out


def dist_utils_rank():
    import torch.distributed as dist

    return dist.get_rank()


def _counts(rank, world_size):
    from torchtitan.distributed.parallel_dims import ParallelDims

    from titan_commopt.titan.platform.cpu import use_cpu_if_no_accelerator

    use_cpu_if_no_accelerator()
    fields = ParallelDims.__dataclass_fields__  # 0.2.2 has etp, 0.3 not
    degrees = dict(cp=1, tp=1, pp=1, ep=1, **({"etp": 1} if "etp" in fields else {}))
    meshes = {"hsdp": (2, 2), "ddp": (4, 1)}
    return {name: _counts_on(ParallelDims(dp_shard=shard, dp_replicate=replicate, world_size=world_size, **degrees))
            for name, (replicate, shard) in meshes.items()}


def test_the_steps_token_count_stays_within_the_replica():
    for rank, out in enumerate(run_distributed(_counts, 4)):
        hsdp, ddp = out["hsdp"], out["ddp"]
        assert hsdp["step"] == hsdp["sum"] == 2 * (3 if rank < 2 else 7), (rank, hsdp)
        assert ddp["step"] == ddp["sum"] == 4 * (rank + 1), (rank, ddp)
        for o in (hsdp, ddp):
            assert o["before"] == o["after"] == o["other_mesh"] == 10, (rank, o)
            assert o["applies_without_r"] is False
