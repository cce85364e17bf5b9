"""Non-finite steps, replica drift and the container's other runtime rules on real gloo meshes, and a run
stopped by persistent non-finite gradients."""

import copy
import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.dist_utils import run_distributed
from titan_commopt import comm
from titan_commopt.topology import Topology


def _container(on_nonfinite, check_every):
    from titan_commopt.titan.common.container import CommOptimizersContainer, Safeguards

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    container = CommOptimizersContainer(
        [model], [opt], name="AdamW", resolved=None, topology=topo, ledger=comm.CommLedger(), fsdp_traffic=None,
        adamw_reference_r_bytes=0, safeguards=Safeguards(on_nonfinite=on_nonfinite, check_replicas_every=check_every),
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
    except SystemExit as error:  # titan_commopt.titan.platform.stop.RunStopped
        return {"raised": str(error), "status": error.code}
    skipped_equal = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # A clean step afterwards is taken by everyone.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    moved = not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return {"skipped": container.skipped_steps, "unchanged": skipped_equal, "moved": moved}




def _drift(rank, world_size):
    from titan_commopt.titan.platform.stop import RunStopped

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
    except RunStopped as stop:
        return stop.message, stop.status
    return None


def _four_rank_rules(rank, world_size):
    """Every 2 x 2 scenario above in one spawn (each builds its own container on a fresh mesh)."""
    return {
        "skip": _nonfinite(rank, world_size, "skip"),
        "stop": _nonfinite(rank, world_size, "stop"),
        "drift": _drift(rank, world_size),
    }


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(_four_rank_rules, 4)


def test_nan_on_one_rank_every_rank_skips(four_rank_results):
    for out in four_rank_results:
        assert out["skip"] == {"skipped": 1, "unchanged": True, "moved": True}


def test_nan_on_one_rank_stop_stops_everyone(four_rank_results):
    for out in four_rank_results:
        assert "non-finite gradient at optimizer step 1" in out["stop"]["raised"] and out["stop"]["status"] == 1


def test_drift_stops_every_rank_naming_the_parameter(four_rank_results):
    out = [rank["drift"] for rank in four_rank_results]
    # Only shard 0's R group (ranks {0, 2}) sees the drift; every rank stops alike, with its finding.
    assert len(set(out)) == 1 and out[0] is not None, out
    message, status = out[0]
    assert "'1.weight'" in message and "replicas disagree" in message and "optimizer step 4" in message
    assert status == 1


# ---- one 2-replica world for the container's runtime rules (one spawn for all of them) ----------
def _own_r_container(topo, name, safeguards=None, clip_scope="replicas", **options):
    from titan_commopt.optim import build_optimizer, resolve
    from titan_commopt.titan.common.container import CommOptimizersContainer, Safeguards

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    resolved = resolve(name, options)
    ledger = comm.CommLedger()
    opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
    container = CommOptimizersContainer(
        [model], [opt], name=name, resolved=resolved, topology=topo, ledger=ledger, fsdp_traffic=None,
        adamw_reference_r_bytes=0, safeguards=safeguards or Safeguards(), clip_scope=clip_scope,
    )
    return model, container


def _runtime(rank, world_size):
    from torchtitan.distributed import utils as dist_utils

    from titan_commopt.titan.common import clipping
    from titan_commopt.titan.common.container import CommOptimizersContainer, Safeguards
    from titan_commopt.titan.platform.stop import RunStopped

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_replicate",))
    topo = Topology.from_mesh(mesh, grad_scale=2.0)  # torchtitan: p.grad = g / W
    out = {"rank": rank}

    # [training] max_norm through torchtitan's clip function: N = sqrt(mean_r |W p.grad_r|^2), one factor.
    model, container = _own_r_container(topo, "LocalAdam")
    clipping.install()
    clipping.register(container)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5 * (rank + 1))
    before = [p.grad.clone() for p in model.parameters()]
    norm = dist_utils.clip_grad_norm_(list(model.parameters()), 0.5, foreach=True)
    out["norm"] = float(norm)
    out["scale"] = [float((p.grad / b).flatten()[0]) for p, b in zip(model.parameters(), before)]
    out["numel"] = sum(p.numel() for p in model.parameters())

    # max_consecutive_skips: NaN on one rank -> both skip; a clean step resets; the 3rd in a row stops.
    model, container = _own_r_container(topo, "LocalAdam", Safeguards(max_consecutive_skips=3))
    events = []
    for i, bad in enumerate([True, True, False, True, True, True]):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if bad and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        snapshot = [p.detach().clone() for p in model.parameters()]
        try:
            dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            container.step()
        except RunStopped as stopped:
            events.append(("stopped", i, stopped.status, stopped.message))
            break
        moved = not all(torch.equal(a, p) for a, p in zip(snapshot, model.parameters()))
        events.append(("moved" if moved else "skipped", container.consecutive_skips))
    out["events"] = events

    # clip_scope = "replica": each replica by its own norm N_r = |W p.grad_r| (here (r + 1) * sqrt(numel)),
    # with no collective at all in the clip
    model, container = _own_r_container(topo, "LocalAdam", clip_scope="replica")
    clipping.register(container)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5 * (rank + 1))
    before = [p.grad.clone() for p in model.parameters()]
    totals = dict(container.ledger.totals)
    out["own_norm"] = float(dist_utils.clip_grad_norm_(list(model.parameters()), 0.5, foreach=True))
    out["own_scale"] = [float((p.grad / b).flatten()[0]) for p, b in zip(model.parameters(), before)]
    out["own_clip_sent"] = dict(container.ledger.totals) != totals

    # ... and a NaN/Inf step is skipped by that replica alone (replica 1, step 1), keeping the schedule:
    # both replicas sync at step Kx = 2 (parameters, momenta and v: equal after it); the skip and the
    # steps' counters saved and loaded with this replica's state, the clock set back from the steps taken
    model, container = _own_r_container(topo, "LocalAdam", clip_scope="replica", Kx=2, Ku=[2], Kv=2)
    clipping.register(container)  # the clip's norm decides the skip
    optimizer = container.optimizers[0]
    trace = []
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5 * (rank + 1))
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        snapshot = [p.detach().clone() for p in model.parameters()]
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        container.step()
        moved = not all(torch.equal(a, p) for a, p in zip(snapshot, model.parameters()))
        trace.append((moved, optimizer._n, optimizer._clock, container.steps_to_next_sync()))
        if step == 1:
            state = copy.deepcopy(container.state_dict())  # its tensors are the live state's
    out["alone_trace"] = trace
    out["alone_skipped"] = container.skipped_steps
    out["alone_params"] = [p.detach().clone() for p in model.parameters()]
    _, loaded = _own_r_container(topo, "LocalAdam", clip_scope="replica", Kx=2, Ku=[2], Kv=2)
    loaded.load_state_dict(state)
    out["alone_loaded"] = (loaded.optimizers[0]._n, loaded.optimizers[0]._clock, loaded.skipped_steps,
                           loaded.steps_to_next_sync())

    # ... and a stop it decides (on_nonfinite = "stop", replica 1 at step 1) is agreed at the next R sync,
    # before step Kx = 3: every rank stops there alike, with replica 1's line
    model, container = _own_r_container(topo, "LocalAdam", Safeguards(on_nonfinite="stop"), clip_scope="replica",
                                        Kx=3, Ku=[3], Kv=3)
    stops = []  # its clip not routed to it (torchtitan's own runs): the step decides the replica's skip itself
    for step in (1, 2, 3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        try:
            dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            container.step()
            stops.append(("stepped", step))
        except RunStopped as stopped:
            stops.append(("stopped", step, stopped.status, stopped.message))
            break
    out["alone_stop"] = stops

    # next R sync of periodic optimizers (console hint)
    model, container = _own_r_container(topo, "LocalAdam", Kx=4, Ku=[4], Kv=4)
    hints = [container.steps_to_next_sync()]
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        container.step()
        hints.append(container.steps_to_next_sync())
    out["local_hints"] = hints
    # a step every replica skips (clip_scope "replicas": agreed) keeps the schedule too
    model, container = _own_r_container(topo, "LocalAdam", Kx=4, Ku=[4], Kv=4)
    hints = []
    for step in range(1, 5):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if step == 2 and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        container.step()
        hints.append(container.steps_to_next_sync())
    out["skipped_together_hints"] = (hints, container.skipped_steps, container.optimizers[0]._n)
    model, container = _own_r_container(topo, "DeMo", replicator="diloco", compression_rate=0.25)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    out["diloco_hint"] = container.steps_to_next_sync()
    model, container = _own_r_container(topo, "FlexDeMo")
    out["flexdemo_hint"] = container.steps_to_next_sync()

    # The drift check's bytes are counted in the step that sent them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    container = CommOptimizersContainer(
        [model], [torch.optim.SGD(model.parameters(), lr=0.1)], name="AdamW", resolved=None, topology=topo,
        ledger=comm.CommLedger(), fsdp_traffic=None, adamw_reference_r_bytes=0,
        safeguards=Safeguards(check_replicas_every=1),
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    out["drift_step_r_sent"] = container.ledger.last_step.get("R_sent", 0)
    out["drift_step_world_sent"] = container.ledger.last_step.get("world_sent", 0)
    out["drift_step_metrics"] = container.metrics()

    # On load, this run's hyper-parameters win over the checkpoint's (except lr: the scheduler's).
    model, saved = _own_r_container(topo, "LocalAdam", eps=1e-3)
    model2, loaded = _own_r_container(topo, "LocalAdam", eps=1e-6, lr=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    saved.step()
    loaded.load_state_dict(saved.state_dict())
    group = loaded.optimizers[0].param_groups[0]
    out["loaded_eps_lr"] = (group["eps"], group["lr"])
    return out


def _two_rank_world(rank, world_size):
    """Every 2-rank check of this file in one spawn: the runtime rules, the end-of-training flush of an
    overlapped update, and the ledger's totals in a checkpoint (each on its own mesh or topology)."""
    return {"runtime": _runtime(rank, world_size), "flush": _flush_at_end(rank, world_size),
            "ledger": _ledger_in_checkpoint(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_results():
    """One 2-process world (one spawn) for every 2-rank check below: each rank's results."""
    return run_distributed(_two_rank_world, 2)


@pytest.fixture(scope="module")
def runtime_results(two_rank_results):
    return [out["runtime"] for out in two_rank_results]


def _own_norm(out):
    import math

    return (out["rank"] + 1) * math.sqrt(out["numel"])  # g_r = W * p.grad = (r + 1) everywhere


def _expected_norm(out):
    import math

    return math.sqrt(2.5 * out["numel"])  # g_r = W * p.grad = (r + 1) everywhere: N^2 = mean(1, 4) * numel


RUNTIME_RULES = {
    "max_norm through torchtitan's clip function": lambda out: (
        out["norm"] == pytest.approx(_expected_norm(out), rel=1e-6)
        and out["scale"] == pytest.approx([0.5 / (_expected_norm(out) + 1e-6)] * 4, rel=1e-6)
    ),
    "clip_scope replica: each replica by its own norm, no collective": lambda out: (
        out["own_norm"] == pytest.approx(_own_norm(out), rel=1e-6) and not out["own_clip_sent"]
        and out["own_scale"] == pytest.approx([0.5 / (_own_norm(out) + 1e-6)] * 4, rel=1e-6)
    ),
    # (moved, updates, clock, steps to the next sync) after steps 1 and 2: replica 1 skipped step 1 alone
    "clip_scope replica: a NaN/Inf step skipped by its replica alone keeps the schedule": lambda out: (
        out["alone_trace"] == ([(True, 1, 1, 1), (True, 2, 2, 2)] if out["rank"] == 0
                               else [(False, 0, 1, 1), (True, 1, 2, 2)])
        and out["alone_skipped"] == out["rank"] and out["alone_loaded"] == (1 - out["rank"], 1, out["rank"], 1)
    ),
    "clip_scope replica: a replica's stop agreed at the next R sync": lambda out: (
        out["alone_stop"][:2] == [("stepped", 1), ("stepped", 2)] and out["alone_stop"][2][:3] == ("stopped", 3, 1)
        and out["alone_stop"][2][3] == "non-finite gradient at optimizer step 1 on replica 1 ([commopt] on_nonfinite "
        "= \"stop\"); resume from the last checkpoint once the cause (learning rate, data) is fixed; stopped before "
        "optimizer step 3, at an R sync"
    ),
    "consecutive non-finite skips reset by a clean step": lambda out: (
        out["events"][:5] == [("skipped", 1), ("skipped", 2), ("moved", 0), ("skipped", 1), ("skipped", 2)]
    ),
    "max_consecutive_skips stops the run": lambda out: (
        out["events"][5][:3] == ("stopped", 5, 1) and "last 3 optimizer steps" in out["events"][5][3]
    ),
    "a step skipped by every replica keeps the sync schedule": lambda out: (
        out["skipped_together_hints"] == ([3, 2, 1, 4], 1, 3)
    ),
    "next R sync of a periodic optimizer": lambda out: (
        out["local_hints"] == [4, 3, 2, 1, 4] and out["diloco_hint"] == 3 and out["flexdemo_hint"] is None
    ),
    # one int64 fingerprint per tensor over R; over the world the non-finite vote and the drift
    # check's flag (4 bytes each), all in this step and in the container's scalars
    "drift check's bytes counted in its step": lambda out: (
        out["drift_step_r_sent"] == 8 * 2 and out["drift_step_world_sent"] == 2 * 4
        and out["drift_step_metrics"]["comm/world_bytes"] == 2 * 4
        and out["drift_step_metrics"]["comm/R_sent_bytes_total"] == 8 * 2
    ),
    # eps: this run's; lr: the checkpoint's (default)
    "this run's hyper-parameters win on load": lambda out: out["loaded_eps_lr"] == (1e-6, 8e-4),
}


@pytest.mark.parametrize("rule", list(RUNTIME_RULES))
def test_runtime_rule_on_two_replicas(runtime_results, rule):
    for rank, out in enumerate(runtime_results):
        assert RUNTIME_RULES[rule](out), (rank, {k: v for k, v in out.items()})


def test_clip_scope_replica_replicas_equal_after_the_sync_that_follows_a_skip(runtime_results):
    first, second = (out["alone_params"] for out in runtime_results)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_persistent_nonfinite_gradients_stop_the_run(tmp_path):
    """lr = 1e20 turns every weight into Inf after step 1: every later step is skipped. DES-LOC's replicas
    step alone (``clip_scope = "auto"``: each clips and skips by its own gradient), so each skips its own
    steps and keeps the sync schedule, and the stop its third skip in a row decides (step 4) is agreed at
    the next R sync (before step Kx = 8): one line (rank 0), exit status 1, the skips on disk in TensorBoard."""
    from tests.titan_utils import run_train

    proc, scalars = run_train(
        tmp_path, 2, "--optimizer.name", "DES-LOC", "--optimizer.lr", "1e20", "--model.flavor", "cpu_tiny",
        "--parallelism.data_parallel_replicate_degree", "2", "--training.steps", "20", "--commopt.local.Kx", "8",
        "--commopt.max_consecutive_skips", "3", check=False, all_ranks=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "titan_commopt: the last 3 optimizer steps" in line]
    lines = [line for line in lines if line.startswith("[rank")]  # torchrun's summary shows it too
    assert len(lines) == 1 and lines[0].startswith("[rank0]:"), out[-3000:]
    assert "(up to step 4) were all skipped by replica 0" in lines[0] and "max_consecutive_skips = 3" in lines[0]
    assert lines[0].endswith("stopped before optimizer step 8, at an R sync"), lines[0]
    # torchrun names the first failure's exit status in its log line or, where the rank left an error
    # file, in the summary ("exitcode  : 1"): status 1 either way, and no traceback of ours
    assert re.search(r"exitcode\)?\s*:\s*1\b", out) and "titan_commopt/titan" not in out, out[-3000:]
    assert sorted(scalars["commopt/skipped_steps"]) == [(step, float(step - 1)) for step in range(1, 8)]
    # the console says when DES-LOC syncs R: skipped steps keep the schedule
    assert re.search(r"step:  1 .*R sent: 0B/step .*next R sync at step 8\n", out)
    assert re.search(r"step:  2 .*next R sync at step 8\n", out)


def _flush_at_end(rank, world_size):
    from titan_commopt.optim import build_optimizer, resolve
    from titan_commopt.titan.common.container import CommOptimizersContainer

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_replicate",))
    topo = Topology.from_mesh(mesh)
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
        resolved = resolve("DeMo", {"overlap": overlap, "chunk": 4, "topk": 2})
        ledger = comm.CommLedger()
        opt = build_optimizer(list(model.named_parameters()), topo, resolved, ledger=ledger)
        container = CommOptimizersContainer(
            [model], [opt], name="DeMo", resolved=resolved, topology=topo, ledger=ledger, fsdp_traffic=None,
            adamw_reference_r_bytes=0,
        )
        torch.manual_seed(1 + rank)  # replicas see different gradients
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in model.parameters()]
        container.step()
        out[f"moved_by_step_{overlap}"] = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        container.flush()  # what the trainer calls once training ends
        out[overlap] = [p.detach().clone() for p in model.parameters()]
    out["equal"] = all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(out[False], out[True]))
    return {k: v for k, v in out.items() if isinstance(k, str)}


def test_flush_at_end_of_training_applies_the_overlapped_update(two_rank_results):
    for out in (rank["flush"] for rank in two_rank_results):
        # overlap leaves step 1's update in flight; the end-of-training flush applies it, giving
        # the parameters of the non-overlapped run
        assert out == {"moved_by_step_False": True, "moved_by_step_True": False, "equal": True}


def _ledger_in_checkpoint(rank, world_size):
    from titan_commopt.titan.common.container import CommOptimizersContainer
    from titan_commopt.titan.config.checkpoint import LEDGER_KEY

    model = nn.Linear(4, 3)
    ledger = comm.CommLedger()
    ledger.record("R", "all_reduce_sum", 5, 5)
    ledger.end_step()

    def container(in_checkpoint):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return CommOptimizersContainer(
            [model], [opt], name="AdamW", resolved=None, topology=Topology.single(), ledger=ledger,
            fsdp_traffic=None, adamw_reference_r_bytes=0, ledger_in_checkpoint=in_checkpoint,
        )

    saved = container(True).state_dict()
    old = container(False)  # resuming a checkpoint written before the ledger's totals were saved
    asked = old.state_dict()
    old.load_state_dict({k: v for k, v in saved.items() if k != LEDGER_KEY})
    return {"saved": LEDGER_KEY in saved, "asked": LEDGER_KEY in asked, "after": LEDGER_KEY in old.state_dict(),
            "totals": ledger.totals["R_sent"]}


def test_a_checkpoint_without_ledger_totals_loads_and_the_next_save_has_them(two_rank_results):
    for out in (rank["ledger"] for rank in two_rank_results):  # Topology.single() on each rank: no collective
        assert out == {"saved": True, "asked": False, "after": True, "totals": 5}
