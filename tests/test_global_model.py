"""The global model an evaluation sees (``CommOptimizer.global_params``, the container's
``global_model``), on real gloo processes.

- Two replicas, every registered name: inside, the parameters are the global model computed here
  independently of the optimizer (the parameters right after the last sync for an anchor family,
  the mean of the replicas' parameters for an averaging one, the parameters for the others), the
  same on both replicas; after, every parameter bit for bit as before, and nine steps with three
  evaluations end bit for bit where a twin that never evaluated ends (parameters, optimizer state,
  training bytes); the evaluation's bytes are on the ledger it was given, none on training's.
- The same replicas made to differ under a per-step family: the container's check stops every rank
  with one line.
- HSDP 2 x 2 (FSDP2 shards inside each replica), DiLoCo and DES-LOC through the container, a forward
  pass inside as an evaluation makes it: the global model as above on the whole tensors, and the
  training after it equal to a twin's.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_commopt import comm, optim
from titan_commopt.optim import BaseHParams, build_optimizer, resolve
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

STEPS = 9
PERIOD = 4  # every sync period of the local-step families here: steps 4 and 8 sync
EVALUATE_AT = (1, 4, 6)  # before the first sync, at one, between two
HPARAMS = BaseHParams(lr=0.01, weight_decay=0.0)


def _lands(resolved) -> int:
    """Steps from a sync's issue to its landing: an anchor family's global model is the outer step's
    result, which the parameters take where the sync lands (DiLoCo's preset streams, α = 0: τ = 1)."""
    return getattr(resolved.options, "sync_delay", 0) if resolved is not None else 0


# Short periods, so that the nine steps cross syncs (each family's preset keeps its other values).
OPTIONS = {
    "DiLoCo": {"Kx": PERIOD, "fragments": 1},  # the preset's streaming sync, all at once: lands one step on
    "DES-LOC": {"Kx": PERIOD, "Ku": [2 * PERIOD], "Kv": 2 * PERIOD},
    "DES-LOC-ADOPT": {"Kx": PERIOD, "Ku": [2 * PERIOD], "Kv": 2 * PERIOD},
    "LocalAdam": {"Kx": PERIOD, "Ku": [PERIOD], "Kv": PERIOD},
    "MT-DAO": {"Kx": PERIOD, "Ku": [PERIOD], "Kv": PERIOD, "switch_at": 0},
    "MT-DAO-halflife": {"Kx": PERIOD, "Ku": [2 * PERIOD], "Kv": 2 * PERIOD, "switch_at": 0},
    "SparseLoCo": {"H": PERIOD},
    "MuLoCo": {"Kx": PERIOD},
    "MuLoCo-2bit": {"H": PERIOD},
}


def _kind(name: str) -> str:
    """What the global model of ``name`` is, from its family and options alone: ``anchor`` (an outer
    step on an anchor), ``mean`` (parameters averaged every few steps), ``params`` (the rest)."""
    if not optim.owns_replicate_sync(name):
        return "params"
    resolved = resolve(name, OPTIONS.get(name, {}), HPARAMS)
    if resolved.family.key == "sparseloco" or getattr(resolved.options, "outer", None) == "nesterov":
        return "anchor"
    return "mean" if resolved.family.key == "local" else "params"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)  # each replica its own batches
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def _backward(model: nn.Module, replica: int, step: int) -> None:
    x, y = _batch(replica, step)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _mean_over_replicas(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """mean_R of each tensor, computed in float64 from every replica's copy (not the optimizer's way)."""
    out = []
    for t in tensors:
        copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, t.contiguous())
        out.append((torch.stack(copies).double().mean(0)).to(t.dtype))
    return out


def _equal_on_every_replica(tensors: list[torch.Tensor]) -> bool:
    from titan_commopt.titan.common.replica_state import fingerprint

    prints = torch.tensor([fingerprint(t) for t in tensors])
    copies = [torch.empty_like(prints) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, prints)
    return all(torch.equal(c, copies[0]) for c in copies)


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.detach().clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _bytes(ledger: comm.CommLedger) -> dict[str, float]:
    return {k: v for k, v in ledger.current().items() if not k.endswith("_seconds")}


def _stock_step(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """torchtitan's AdamW/Adam over HSDP: the gradient averaged over R in backward, then the step."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()


def _one_name(name: str, rank: int, topo: Topology) -> dict:
    from titan_commopt.titan.common.container import CommOptimizersContainer

    kind, ours = _kind(name), optim.owns_replicate_sync(name)
    twins = []
    for _ in range(2):  # [evaluates, never evaluates]
        model, ledger = _model(), comm.CommLedger()
        if ours:
            resolved = resolve(name, OPTIONS.get(name, {}), HPARAMS, kernels="torch")
            opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
        else:
            resolved = None
            opt = getattr(torch.optim, name)(model.parameters(), lr=HPARAMS.lr)
        container = CommOptimizersContainer(
            [model], [opt], name=name, resolved=resolved, topology=topo, ledger=ledger, fsdp_traffic=None,
            adamw_reference_r_bytes=0)
        twins.append((model, opt, ledger, container))
    (model, opt, ledger, container), (twin, twin_opt, twin_ledger, _) = twins
    eval_ledger = comm.CommLedger()
    params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    last_sync = params(model)  # the replicas start equal
    out = {"inside": [], "same_on_replicas": [], "restored": [], "swapped": [], "eval_bytes": []}
    for step in range(1, STEPS + 1):
        for m, o in ((model, opt), (twin, twin_opt)):
            _backward(m, rank, step)
            if ours:
                o.step()
            else:
                _stock_step(o, m)
        if step > _lands(resolved) and (step - _lands(resolved)) % PERIOD == 0:
            last_sync = params(model)
        if step not in EVALUATE_AT:
            continue
        before = params(model)
        expected = {"params": before, "anchor": last_sync, "mean": _mean_over_replicas(before)}[kind]
        sent = eval_ledger.totals.get("R_sent", 0.0)
        # the optimizer's swap alone, then the container's (its check included), as a validator runs it
        for context in ((opt.global_params(ledger=eval_ledger),) if ours else ()) + (container.global_model(),):
            with context:
                inside = params(model)
                out["inside"].append(all(torch.equal(a, b) for a, b in zip(inside, expected)))
                out["swapped"].append(not all(torch.equal(a, b) for a, b in zip(inside, before)))
                out["same_on_replicas"].append(_equal_on_every_replica(inside))
            out["restored"].append(all(torch.equal(a, b) for a, b in zip(params(model), before)))
        eval_ledger.end_step()
        out["eval_bytes"].append(eval_ledger.totals.get("R_sent", 0.0) - sent)
    out["kind"] = kind
    out["d"] = sum(p.numel() for p in model.parameters())
    out["as_twin"] = all(torch.equal(a, b) for a, b in zip(params(model), params(twin)))
    out["state_as_twin"] = all(torch.equal(a, b) for a, b in zip(_state(opt), _state(twin_opt)))
    out["training_bytes_as_twin"] = _bytes(ledger) == _bytes(twin_ledger)
    out["container_eval_bytes"] = container.eval_metrics()["comm/eval_R_sent_bytes_total"]
    return out


def _drift(rank: int, topo: Topology) -> tuple:
    """FlexDeMo's replicas made to differ by a write outside the optimizer: the evaluation's check."""
    from titan_commopt.titan.common.container import CommOptimizersContainer
    from titan_commopt.titan.platform.stop import RunStopped

    model, ledger = _model(), comm.CommLedger()
    resolved = resolve("FlexDeMo", {}, HPARAMS, kernels="torch")
    opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
    container = CommOptimizersContainer([model], [opt], name="FlexDeMo", resolved=resolved, topology=topo,
                                        ledger=ledger, fsdp_traffic=None, adamw_reference_r_bytes=0)
    for step in (1, 2):
        _backward(model, rank, step)
        container.step()
    if rank == 1:
        with torch.no_grad():
            model[2].bias[0] += 1e-6
    try:
        with container.global_model():
            return ("evaluated",)
    except RunStopped as stop:
        return stop.message, stop.status


def _two_replicas(rank: int, world: int) -> dict:
    topo = Topology(replicate=dist.group.WORLD)
    out = {name: _one_name(name, rank, topo) for name in optim.available_names()}
    out["drift"] = _drift(rank, topo)
    return out


@pytest.fixture(scope="module")
def two_replicas():
    return run_distributed(_two_replicas, 2)


@pytest.mark.parametrize("name", optim.available_names())
def test_global_params_is_the_global_model_and_leaves_training_as_it_was(two_replicas, name):
    ours = optim.owns_replicate_sync(name)
    for o in (rank[name] for rank in two_replicas):
        assert o["kind"] == _kind(name)
        assert all(o["inside"]) and all(o["same_on_replicas"]) and all(o["restored"]), o
        assert len(o["inside"]) == len(EVALUATE_AT) * (2 if ours else 1)
        assert o["as_twin"] and o["state_as_twin"] and o["training_bytes_as_twin"]
        # the local-step families' replicas hold another model than the global one two steps after a
        # sync (step 6; ADOPT's first step moves nothing), the others never: so "the same on both
        # replicas" above means something; at the sync itself (step 4) only while it is in flight (DiLoCo's
        # preset streams: its anchor moves where the sync lands)
        swapped = dict(zip(EVALUATE_AT, o["swapped"][:: 2 if ours else 1]))
        in_flight = ours and _lands(resolve(name, OPTIONS.get(name, {}))) > 0
        assert swapped[6] == (o["kind"] != "params") and swapped[4] == in_flight
        assert o["kind"] != "params" or not any(o["swapped"])
        # the mean is one fp32 all-reduce of every parameter where the replicas may differ (not at a sync)
        mean = [4 * o["d"] * (step % PERIOD != 0) if o["kind"] == "mean" else 0 for step in EVALUATE_AT]
        if ours:
            assert o["eval_bytes"] == mean
        # the container's evaluations: the same mean, and the check's 8-byte fingerprint per parameter
        assert o["container_eval_bytes"] == sum(mean) + 8 * 4 * len(EVALUATE_AT)


def test_replicas_that_differ_stop_the_evaluation_with_one_line(two_replicas):
    out = [rank["drift"] for rank in two_replicas]
    assert len(set(out)) == 1 and out[0][0] != "evaluated", out
    message, status = out[0]
    assert "replicas disagree on parameter '2.bias'" in message
    assert "stopped before evaluating the global model after optimizer step 2" in message
    assert "\n" not in message and status == 1


# ---- HSDP 2 x 2: FSDP2 shards inside each replica, through the container as a validator uses it -------
HSDP_NAMES = ("DiLoCo", "DES-LOC")


def _hsdp_model(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()  # the same initial values on every rank
    fully_shard(model[0], mesh=mesh["fsdp"])
    # as torchtitan's last layers: kept unsharded after a forward (an evaluation's values would stay in it)
    fully_shard(model[2], mesh=mesh["fsdp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["fsdp"])
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            m.set_gradient_divide_factor(1.0)
    return model


def _hsdp_backward(model: nn.Module, replica: int, shard: int, step: int) -> None:
    x, y = _batch(replica, step)
    half = slice(shard * 4, shard * 4 + 4)
    model.zero_grad()
    (((model(x[half]) - y[half]) ** 2).sum() / (8 * 8)).backward()  # summed over S: the replica's mean


def _hsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_commopt.titan.common.container import CommOptimizersContainer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh, grad_scale=1.0)
    replica, shard, replicate = topo.replica_index, topo.shard_rank, mesh["dp_replicate"].get_group()
    full = lambda m: [p.full_tensor().detach().clone() for p in m.parameters()]  # noqa: E731
    out = {}
    for name in HSDP_NAMES:
        twins = []
        for _ in range(2):  # [evaluates, never evaluates]
            model, ledger = _hsdp_model(mesh), comm.CommLedger()
            resolved = resolve(name, OPTIONS[name], HPARAMS, kernels="torch")
            opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
            twins.append((model, CommOptimizersContainer(
                [model], [opt], name=name, resolved=resolved, topology=topo, ledger=ledger, fsdp_traffic=None,
                adamw_reference_r_bytes=0)))
        (model, container), (twin, twin_container) = twins
        last_sync, checks = full(model), []
        for step in range(1, STEPS + 1):
            for m, c in twins:
                _hsdp_backward(m, replica, shard, step)
                c.step()
            if step > _lands(resolved) and (step - _lands(resolved)) % PERIOD == 0:
                last_sync = full(model)
            if step not in EVALUATE_AT:
                continue
            before = [p.to_local().detach().clone() for p in model.parameters()]
            mine = full(model)
            copies = [[torch.empty_like(t) for _ in range(2)] for t in mine]
            for t, c in zip(mine, copies):
                dist.all_gather(c, t, group=replicate)
            expected = last_sync if name == "DiLoCo" else [torch.stack(c).double().mean(0).float() for c in copies]
            with container.global_model():
                inside = full(model)
                model.eval()
                with torch.no_grad():
                    model(_batch(0, 100)[0])  # the evaluation's forward (FSDP2 all-gathers the swapped shards)
                model.train()
            checks.append({
                "inside": all(torch.equal(a, b) for a, b in zip(inside, expected)),
                "swapped": not all(torch.equal(a, b) for a, b in zip(inside, mine)),
                "restored": all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before)),
            })
        out[name] = {"checks": checks, "as_twin": all(torch.equal(a, b) for a, b in zip(full(model), full(twin)))}
    return out


@pytest.fixture(scope="module")
def hsdp():
    return run_distributed(_hsdp, 4)


@pytest.mark.parametrize("name", HSDP_NAMES)
def test_hsdp_global_model_and_training_after_it_as_a_twin(hsdp, name):
    for rank in hsdp:
        o = rank[name]
        assert all(c["inside"] and c["restored"] for c in o["checks"]), o
        assert o["checks"][-1]["swapped"]  # step 6: the replicas' own models are not the global one
        assert o["as_twin"]
