"""DeMo / FlexDeMo's decoupled-AdamW base (``base = "adamw"``) against ``torch.optim.AdamW`` itself: the
step count behind the bias corrections, pinned without a recorded digest (so on any CPU).

Every step of the run below, each parameter's direction must be AdamW's m̂/(√v̂+ε) at that parameter's
own step t = 1, 2, ... (the count of the steps in which it had a gradient), through DCP's lr-0 init step
(``_init_optim_state``, torchtitan's alike: it must not count, the state is made at construction), a
step without one parameter's gradient, and a save and a load into a fresh optimizer (which must restore
the counts). The reference is torch's AdamW, fed the same gradients; a second reference, one step ahead
(torch's own AdamW after that init step: its state is lazy, so the init step counts), is far from ours,
so the check tells the two apart.

- one process (``Topology.single()``): with ``rule = "identity"`` the optimizer *is* AdamW, parameters
  compared with ``torch.optim.AdamW`` on a twin model;
- two processes (R = 2 replicas, each an FSDP2 mesh of one rank: DTensor parameters and moments), each
  replica its own batches: with the whole direction sent (``replicator = "full"``, and the DCT replicator
  keeping every coefficient of each chunk) in fp32 and ``rule = "identity"``, a step is
  x ← x·(1 − ηλ) − η·mean over the replicas of their AdamW directions, each replica's from torch's AdamW
  on that replica's gradients (its moments its own).

Float round-off only: torch rounds m̂/(√v̂+ε) in another order, and the DCT path transforms it there and
back. The bias corrections √(1−β2^t)/(1−β1^t) of steps t and t + 1 differ by 4 % or more here (t ≤ 6).
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state as init_optim_state  # DCP's init step

from titan_commopt.optim import BaseHParams, build_optimizer, resolve
from titan_commopt.optim.common import local
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

LR, WD, BETAS, EPS = 0.05, 0.1, (0.9, 0.95), 1e-8
HPARAMS = BaseHParams(lr=LR, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
STEPS = 6
NO_GRAD_STEP, NO_GRAD = 3, "2.weight"  # 1-based step in which this parameter has no gradient: its count stays
LOAD_AFTER = 4  # steps, then a save and a load into a fresh optimizer, which runs the rest
KEYS = {  # [commopt.demo]: the direction reaches the parameters whole, in fp32 (lr_scale 1: η is LR)
    "full": dict(base="adamw", rule="identity", replicator="full", sign_before_sync=False, transfer_dtype="fp32",
                 lr_scale=1.0),
    "demo_all_kept": dict(base="adamw", rule="identity", replicator="demo", chunk=4, topk=16, sign_before_sync=False,
                          transfer_dtype="fp32", lr_scale=1.0),
}
CLOSE = dict(rtol=1e-5, atol=1e-6)  # round-off; one step ahead is ≥ 1e-4 off (asserted)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def _backward(model, x, y, t):
    ((model(x) - y) ** 2).mean().backward()
    if t == NO_GRAD_STEP:
        model.get_parameter(NO_GRAD).grad = None


def _torch_adamw(params, ahead: bool, **kw) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(params, **kw)
    if ahead:
        init_optim_state(opt)  # torch's state is made by this zero-gradient step, which counts it
        assert all(int(st["step"]) == 1 for st in opt.state.values())
    return opt


def _far(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-4


# ---- one process: the optimizer is AdamW -----------------------------------------------------------
def test_single_replica_adamw_base_is_torch_adamw_step_for_step():
    resolved = resolve("FlexDeMo", KEYS["full"], HPARAMS, kernels="torch")
    model, twin, ahead = _model(), _model(), _model()
    opt = build_optimizer(list(model.named_parameters()), Topology.single(), resolved)
    assert opt.param_groups[0]["lr"] == LR
    init_optim_state(opt)  # runs nothing: the state exists
    refs = [_torch_adamw(m.parameters(), a, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            for m, a in ((twin, False), (ahead, True))]
    for t, (x, y) in enumerate(_batches(1), start=1):
        for m in (model, twin, ahead):
            _backward(m, x, y, t)
        for o in (opt, *refs):
            o.step()
            o.zero_grad()
        if t == LOAD_AFTER:  # a checkpoint, loaded into a fresh optimizer (DCP's init step first)
            saved = copy.deepcopy(opt.state_dict())
            opt = build_optimizer(list(model.named_parameters()), Topology.single(), resolved)
            init_optim_state(opt)
            opt.load_state_dict(saved)
        for (n, p), q, r in zip(model.named_parameters(), twin.parameters(), ahead.parameters()):
            torch.testing.assert_close(p, q, **CLOSE, msg=lambda m: f"step {t} {n}: {m}")
            assert _far(p, r), f"step {t} {n}: one step ahead is within round-off"
    names = [n for n, _ in model.named_parameters()]
    counts = {names[i]: int(st["step"]) for i, st in opt.state_dict()["state"].items()}
    assert counts == {n: STEPS - (n == NO_GRAD) for n, _ in model.named_parameters()}
    for p, q in zip(model.parameters(), twin.parameters()):  # the moments too
        mine, torchs = opt.state[p], refs[0].state[q]
        torch.testing.assert_close(mine["exp_avg"], torchs["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(mine["exp_avg_sq"], torchs["exp_avg_sq"], rtol=1e-5, atol=1e-9)


# ---- two replicas, FSDP2 (DTensor) parameters ----------------------------------------------------------
def _directions(probes, optims, grads):
    """Each replica's AdamW direction m̂/(√v̂+ε) by torch's AdamW (lr 1, no weight decay, from a zero
    parameter: −z after its step), its moments and count its own."""
    out = []
    for z, o, g in zip(probes, optims, grads):
        for zi, gi in zip(z, g):
            zi.detach().zero_()
            zi.grad = gi
        o.step()
        out.append([-zi.detach() for zi in z])
    return out


def _two_replica_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh)
    data = _batches(1 + rank)  # each replica its own batches
    out = {}
    for name, keys in KEYS.items():
        resolved = resolve("FlexDeMo", keys, HPARAMS, kernels="torch")
        model = _model()
        fully_shard(model, mesh=mesh["fsdp"])
        build = lambda: build_optimizer(list(model.named_parameters()), topo, resolved)  # noqa: E731
        opt = build()
        init_optim_state(opt)
        names = [n for n, _ in model.named_parameters()]
        start = {n: local(p).detach().clone() for n, p in model.named_parameters()}  # |S| = 1: the whole tensor
        ref = {ahead: {n: v.clone() for n, v in start.items()} for ahead in (False, True)}
        probes = {ahead: [[torch.zeros_like(v, requires_grad=True) for v in start.values()] for _ in range(world)]
                  for ahead in (False, True)}
        optims = {ahead: [_torch_adamw(z, ahead, lr=1.0, betas=BETAS, eps=EPS, weight_decay=0.0) for z in zs]
                  for ahead, zs in probes.items()}
        off, near = [], []  # (step, parameter) beyond round-off of the reference; within it of one ahead
        for t, (x, y) in enumerate(data, start=1):
            _backward(model, x, y, t)
            mine = [local(p.grad).clone() if p.grad is not None else None for p in model.parameters()]
            gathered = []  # [parameter][replica]
            for g in mine:
                if g is None:
                    gathered.append([None] * world)
                else:
                    parts = [torch.empty_like(g) for _ in range(world)]
                    dist.all_gather(parts, g)
                    gathered.append(parts)
            grads = [[gathered[i][r] for i in range(len(mine))] for r in range(world)]
            opt.step()
            opt.zero_grad()
            if t == LOAD_AFTER:
                saved = copy.deepcopy(opt.state_dict())
                opt = build()
                init_optim_state(opt)
                opt.load_state_dict(saved)
            for ahead in (False, True):
                d = _directions(probes[ahead], optims[ahead], grads)
                for i, n in enumerate(names):
                    if mine[i] is not None:
                        mean = sum(d[r][i] for r in range(world)) / world
                        ref[ahead][n].mul_(1 - LR * WD).add_(mean, alpha=-LR)
            now = {n: local(p).detach().clone() for n, p in model.named_parameters()}
            off += [(t, n, (now[n] - ref[False][n]).abs().max().item()) for n in names
                    if not torch.allclose(now[n], ref[False][n], **CLOSE)]
            near += [(t, n) for n in names if not _far(now[n], ref[True][n])]
        counts = {names[i]: int(st["step"]) for i, st in opt.state_dict()["state"].items()}
        out[name] = dict(off=off, near=near, counts=counts,
                         params={n: local(p).detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def two_replicas():
    return run_distributed(_two_replica_worker, 2)


@pytest.mark.parametrize("name", list(KEYS))
def test_two_replica_adamw_base_is_the_mean_of_torch_adamw_directions(two_replicas, name):
    """Every step, every parameter within round-off of the reference made of torch's AdamW, and far
    from the one a step ahead; the saved counts each parameter's own; both replicas on the same
    parameters."""
    for rank, res in enumerate(two_replicas):
        res = res[name]
        assert not res["off"], f"rank {rank}: (step, parameter, |error|) off the torch AdamW reference: {res['off']}"
        assert not res["near"], f"rank {rank}: (step, parameter) within round-off of one step ahead: {res['near']}"
        assert res["counts"] == {n: STEPS - (n == NO_GRAD) for n in res["counts"]}
    a, b = (res[name]["params"] for res in two_replicas)
    assert all(torch.equal(a[n], b[n]) for n in a)
