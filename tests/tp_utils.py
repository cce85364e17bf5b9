"""The tensor-parallel toy model the TP tests share (tests/test_tp.py, tests/test_sparseloco.py): a
llama3-like block small enough for float64 simulations, its batches and loss (torchtitan's gradient
convention), torchtitan's llama3 TP plan on it, and where each rank's shard lies in the whole tensor."""

import torch
from torch import nn

from titan_commopt.optim.common import BaseHParams

F64 = torch.float64
V, D, H, N, L, W = 16, 8, 12, 4, 4, 2  # vocab, model dim, hidden dim, batch, sequence, replicas
HP = BaseHParams(lr=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.norm = nn.RMSNorm(D)
        self.w1 = nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        return h + self.w2(torch.tanh(self.w1(self.norm(h))))


def make_net():
    torch.manual_seed(0)
    net = Net().double()
    with torch.no_grad():  # a norm weight that is not all ones
        net.norm.weight.add_(0.1 * torch.randn(D, dtype=F64))
    return net


def batch(replica, step):
    gen = torch.Generator().manual_seed(100 * replica + step)
    return torch.randint(0, V, (N, L), generator=gen), torch.randn(N, L, D, generator=gen, dtype=F64)


def sq_error(out, y):
    return ((out - y) ** 2).sum() / (W * N * L * D)  # divided by the global count (torchtitan)


def parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    parallelize_module(model, mesh["tp"], {  # torchtitan's llama3 plan
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    if "fsdp" in mesh.mesh_dim_names:
        fully_shard(model, mesh=mesh["fsdp"])
        model.set_force_sum_reduction_for_comms(True)  # gloo: no AVG/PREMUL_SUM reduce-scatter
        model.set_gradient_divide_factor(1.0)  # torchtitan's setting
    return model


def shard_slices(p):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(zip(offset, shape))


def replica_grads(model, replica, step):
    """This replica's mean gradient of the whole model (the sum of its ranks' losses, ×W)."""
    model.zero_grad()
    tokens, y = batch(replica, step)
    (W * sq_error(model(tokens), y)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def index_of(sl):
    """The slices of the whole tensor that a ``shard_slices`` result names."""
    return tuple(slice(a, a + n) for a, n in sl)
