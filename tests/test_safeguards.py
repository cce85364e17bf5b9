"""Non-finite steps and replica drift on a real 2x2 gloo mesh, through the optimizer container."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.dist_utils import run_distributed
from titan_commopt.topology import Topology


def _container(on_nonfinite, check_every):
    from titan_commopt.titan.container import Safeguards, container_cls

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    container = container_cls()(
        [model], [opt], name="AdamW", resolved=None, topology=topo, fsdp_traffic=None, adamw_reference_r_bytes=0,
        safeguards=Safeguards(on_nonfinite=on_nonfinite, check_replicas_every=check_every),
    )
    return model, container


def _nonfinite(rank, world_size, on_nonfinite):
    model, container = _container(on_nonfinite, 0)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if rank == 3:
        model[1].bias.grad[0] = float("nan")
    try:
        container.step()
    except FloatingPointError as error:
        return {"raised": str(error)}
    skipped_equal = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # A clean step afterwards is taken by everyone.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    moved = not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return {"skipped": container.skipped_steps, "unchanged": skipped_equal, "moved": moved}


def test_nan_on_one_rank_every_rank_skips():
    for out in run_distributed(_nonfinite, 4, "skip"):
        assert out == {"skipped": 1, "unchanged": True, "moved": True}


def test_nan_on_one_rank_stop_stops_everyone():
    for out in run_distributed(_nonfinite, 4, "stop"):
        assert "non-finite gradient at optimizer step 1" in out["raised"]


def _drift(rank, world_size):
    from titan_commopt.state import ReplicaDriftError

    model, container = _container("skip", 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    container.step()  # check at step 2: replicas agree
    if rank == 2:  # replica 1, shard 0: corrupt one element on purpose
        with torch.no_grad():
            model[1].weight[0, 0] += 1e-6
    container.step()
    try:
        container.step()  # check at step 4
    except ReplicaDriftError as error:
        return str(error)
    return None


def test_drift_is_detected_with_parameter_name():
    out = run_distributed(_drift, 4)
    # Shard 0's R group is ranks {0, 2}: both fail loudly naming the parameter; shard 1 saw no drift.
    assert out[1] is None and out[3] is None
    for rank in (0, 2):
        assert out[rank] is not None and "'1.weight'" in out[rank] and "replicas disagree" in out[rank]
