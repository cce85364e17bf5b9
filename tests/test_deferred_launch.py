"""A sync started in a step goes on the wire at the next ``zero_grad``, behind torchtitan's log
collectives (``overlap.py``'s ``defers_launch``), on two gloo replicas through the container.

For every family that keeps a sync in flight across steps (DiLoCo's preset streaming fragments, the
eager overlapped merge, SparseLoCo's ``sync_delay``, DeMo's ``overlap``): after ``step()`` a started
sync is counted but not launched, and stays so while a log all-reduce runs; after
``zero_grad()`` it is on the wire; the run ends bit for bit where a twin that launches at once ends
(parameters, optimizer state, bytes per step). Under fault tolerance the container launches at once
(``attach_fault_tolerance``: a sync belongs to the quorum of its step): ``test_fault_tolerance*``.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import BaseHParams, build_optimizer, resolve
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

STEPS = 10
HPARAMS = BaseHParams(lr=0.01, weight_decay=0.0)
CASES = {
    "DiLoCo streaming (preset)": ("DiLoCo", {"Kx": 4}),
    "DiLoCo eager": ("DiLoCo", {"Kx": 4, "merge": "eager", "sync_delay": 0, "fragments": 1}),
    "SparseLoCo sync_delay": ("SparseLoCo", {"H": 4, "sync_delay": 1}),
    "DeMo overlap": ("DeMo", {"overlap": True}),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))


def _run(name: str, options: dict, topo: Topology, rank: int, defer: bool) -> dict:
    from titan_commopt.titan.common.container import CommOptimizersContainer

    model, ledger = _model(), comm.CommLedger()
    resolved = resolve(name, options, HPARAMS, kernels="torch")
    opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
    container = CommOptimizersContainer([model], [opt], name=name, resolved=resolved, topology=topo,
                                        ledger=ledger, fsdp_traffic=None, adamw_reference_r_bytes=0)
    assert opt.runtime.defers_launch  # the container's default
    opt.runtime.defers_launch = defer
    after_step, after_zero_grad, per_step = [], [], []
    for step in range(1, STEPS + 1):
        container.zero_grad()
        after_zero_grad.append(opt.runtime.unlaunched)
        g = torch.Generator().manual_seed(1000 * rank + step)  # each replica its own batches
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        container.step()
        per_step.append({k: v for k, v in ledger.totals.items() if not k.endswith("_seconds")})
        after_step.append(opt.runtime.unlaunched)
        # torchtitan's log step: the loss averaged over the world, while the step's sync waits to launch
        logged = loss.detach().reshape(1).clone()
        dist.all_reduce(logged)
        assert opt.runtime.unlaunched == after_step[-1]
    container.flush()
    state = [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return dict(params=[p.detach().clone() for p in model.parameters()], state=state, per_step=per_step,
                after_step=after_step, after_zero_grad=after_zero_grad, in_flight=opt.runtime.in_flight)


def _two_replicas(rank: int, world: int) -> dict:
    topo = Topology(replicate=dist.group.WORLD)
    return {case: (_run(name, options, topo, rank, True), _run(name, options, topo, rank, False))
            for case, (name, options) in CASES.items()}


@pytest.fixture(scope="module")
def two_replicas():
    return run_distributed(_two_replicas, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_a_started_sync_launches_at_the_next_zero_grad_and_changes_nothing_else(two_replicas, case):
    for out in two_replicas:
        deferred, at_once = out[case]
        # a sync started in most steps' step() waits there; zero_grad always launches every one
        assert sum(n > 0 for n in deferred["after_step"]) >= STEPS // 4
        assert deferred["after_zero_grad"] == [0] * STEPS and deferred["in_flight"] == 0
        assert at_once["after_step"] == [0] * STEPS
        assert all(torch.equal(a, b) for a, b in zip(deferred["params"], at_once["params"]))
        assert len(deferred["state"]) == len(at_once["state"])
        assert all(torch.equal(a, b) for a, b in zip(deferred["state"], at_once["state"]))
        assert deferred["per_step"] == at_once["per_step"]  # bytes counted in the step that issued them
