"""An undone step is undone bit for bit: ``snapshot()`` / ``restore()`` of every optimizer name.

Live fault tolerance undoes every step that does not commit (``titan/common/container.py``'s
transaction). Here, for every name in ``available_names()`` (a new family is covered by its
registration): a few steps, a snapshot, a step that changes the whole state, a restore; then every
attribute of the optimizer — its ``state`` tensors as the objects they were (a view stays a view),
their dtype, shape and bits, the param groups, every counter and flag — is compared with a copy
taken before that step, read from the live objects, never through ``state_dict()`` (which converts
DeMo's momenta and would hide a difference). The steps after a restore equal an untouched twin's.

One process: a quorum of one (``Topology.quorum``, as under fault tolerance) gives every family its
R path, whose collectives send nothing; one 2-process gloo run repeats the check with two real
replicas (each family's state then depends on the other's), each sharded by FSDP2 as in torchtitan
(parameters and states are DTensors).
"""

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from titan_commopt import comm
from titan_commopt.optim import (
    NATIVE_NAMES, BaseHParams, available_names, build_optimizer, owns_replicate_sync, resolve,
)
from titan_commopt.optim.base import CommOptimizer, Snapshot
from titan_commopt.optim.common import local
from titan_commopt.optim.demo import DeMo
from titan_commopt.topology import Topology
from titan_commopt.titan.common.replica_group import Quorum
from tests.dist_utils import run_distributed
from tests.ft_standins import StandInManager, Toy, blocking, fault_tolerant_container, grads, train_step

HP = BaseHParams(lr=1e-2)
WARMUP = 3  # steps before the snapshot; the undone step is the 4th: a sync step of every family here
UNDONE = WARMUP + 1

# ---- a copy of everything an optimizer holds, to compare with later ------------------------------
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def copy_of(value, names: dict):
    """``value`` as it is now: a tensor as (the object, a clone of its local values), a dict or list
    as (the object, its entries), tuples and sets item by item, Python values as they are, any other
    object by identity. ``names``: a label for each parameter (by ``id``), shown for dict keys."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value, local(value).detach().clone())
    if isinstance(value, dict):
        return ("dict", value, {k: (names.get(id(k), repr(k)), copy_of(v, names)) for k, v in value.items()})
    if isinstance(value, list):
        return ("list", value, [copy_of(v, names) for v in value])
    if isinstance(value, (tuple, set, frozenset)):
        items = sorted(value, key=id) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, None, [copy_of(v, names) for v in items])
    if isinstance(value, _PLAIN):
        return ("value", None, value)
    return ("object", value, None)


def differences(before, after, path="") -> list[str]:
    """Where two :func:`copy_of` results differ, one line each (empty: identical)."""
    (kind, obj, a), (kind_after, obj_after, b) = before, after
    if kind != kind_after:
        return [f"{path}: {kind} became {kind_after}"]
    if obj is not obj_after:  # the object step() and whatever holds it (a plan, a view's base) use
        return [f"{path}: another {type(obj).__name__} object"]
    if kind == "tensor":
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} became {b.dtype}{tuple(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if kind == "dict":
        out = [f"{path}[{a[k][0]}]: missing" for k in a if k not in b]
        out += [f"{path}[{b[k][0]}]: added" for k in b if k not in a]
        return out + [line for k in a if k in b for line in differences(a[k][1], b[k][1], f"{path}[{a[k][0]}]")]
    if kind in ("list", "tuple", "set", "frozenset"):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items became {len(b)}"]
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, f"{path}[{i}]")]
    if kind == "value":
        return [] if a == b else [f"{path}: {a!r} became {b!r}"]
    return []


def everything(model, optimizer) -> dict:
    """The parameters and every attribute of ``optimizer`` (its ``state``, ``param_groups``, counters,
    flags, plan ...), each as :func:`copy_of` takes it; parameters are labelled ``param<i>``."""
    params = list(model.parameters())
    names = {id(p): f"param{i}" for i, p in enumerate(params)}
    return {"parameters": copy_of(tuple(params), names), **{k: copy_of(v, names) for k, v in vars(optimizer).items()}}


def changes(before: dict, after: dict) -> list[str]:
    """:func:`differences` of two :func:`everything` results."""
    out = [f"{k}: missing" for k in before if k not in after] + [f"{k}: added" for k in after if k not in before]
    return out + [line for k in before if k in after for line in differences(before[k], after[k], k)]


# ---- the optimizers, their steps, their snapshots ---------------------------------------------------
def options_of(name) -> dict:
    """Options under which the undone step changes the whole state on a :class:`Toy`: the local-step
    families sync within a few steps, and land their sync in that step (DiLoCo's streaming preset made
    blocking: a sync in flight across steps is tests/test_fault_tolerance_fragments.py's); DeMo keeps a
    part of each chunk (a top-k of every coefficient of the toy's chunks would empty the momentum every
    step)."""
    if resolve(name).family.key == "demo":
        return {"topk": 16}
    return blocking(name)


def build(name, topology, fsdp_mesh=None):
    """Optimizer ``name`` on a :class:`Toy` (sharded by FSDP2 over ``fsdp_mesh``, if given: parameters
    and states are then DTensors): torchtitan's own AdamW/Adam as it builds them (fused), or ours with
    :func:`options_of`."""
    torch.manual_seed(0)
    model = Toy()
    if fsdp_mesh is not None:
        fully_shard(model, mesh=fsdp_mesh)
    if name in NATIVE_NAMES:
        cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
        return model, cls(model.parameters(), lr=HP.lr, betas=(HP.beta1, HP.beta2), eps=HP.eps,
                          weight_decay=HP.weight_decay, fused=True)
    resolved = resolve(name, options_of(name), HP)
    return model, build_optimizer(list(model.named_parameters()), topology, resolved, ledger=comm.CommLedger())


def quorum_of_one() -> Topology:
    return Topology(quorum=Quorum(StandInManager(), 1))


def step(model, optimizer, t, replica=0):
    for p, g in zip(model.parameters(), grads(model, 1000 * replica + t)):
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g  # one shard
    optimizer.step()


def take(model, optimizer):
    """What the container keeps before a step: the parameters, the optimizer's snapshot."""
    snapshot = optimizer.snapshot() if isinstance(optimizer, CommOptimizer) else Snapshot.take(optimizer)
    return [p.detach().clone() for p in model.parameters()], snapshot


@torch.no_grad()
def put_back(model, optimizer, taken):
    params, snapshot = taken
    for p, saved in zip(model.parameters(), params):
        p.copy_(saved)
    if isinstance(optimizer, CommOptimizer):
        optimizer.restore(snapshot)
    else:
        snapshot.restore(optimizer)


def undo_a_step(name, topology, replica=0, fsdp_mesh=None):
    """``(what the undone step changed, what its restore left changed, the optimizer, its model)``."""
    model, optimizer = build(name, topology, fsdp_mesh)
    for t in range(1, WARMUP + 1):
        step(model, optimizer, t, replica)
    before = everything(model, optimizer)
    taken = take(model, optimizer)
    step(model, optimizer, 100 + UNDONE, replica)  # other gradients than the retried step's
    changed = changes(before, everything(model, optimizer))
    put_back(model, optimizer, taken)
    return changed, changes(before, everything(model, optimizer)), model, optimizer


def unchanged_state(changed: list[str], model, optimizer) -> list[str]:
    """The state tensors the undone step left as they were (a restore of those proves nothing)."""
    paths = [f"state[param{i}][{k!r}]" for i, p in enumerate(model.parameters()) for k in optimizer.state.get(p, ())]
    return [path for path in paths if not any(line.startswith(path + ":") for line in changed)]


def outcome(model, optimizer):
    """Parameters and state after a step, by position (a twin's tensors are other objects)."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        tensors += [local(v).detach().clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    extra = (optimizer.metrics(), optimizer.steps_to_next_sync()) if isinstance(optimizer, CommOptimizer) else ()
    return tensors, extra


def same_outcome(a, b) -> bool:
    (x, extra_x), (y, extra_y) = a, b
    return extra_x == extra_y and len(x) == len(y) and all(
        u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v) for u, v in zip(x, y))


def retried_equals_twin(name, topology, model, optimizer, replica=0, fsdp_mesh=None) -> bool:
    """After the restore: the undone step retried, and one more, equal an untouched twin's."""
    twin_model, twin = build(name, topology, fsdp_mesh)
    for t in range(1, WARMUP + 1):
        step(twin_model, twin, t, replica)
    for t in (UNDONE, UNDONE + 1):
        step(model, optimizer, t, replica)
        step(twin_model, twin, t, replica)
        if not same_outcome(outcome(model, optimizer), outcome(twin_model, twin)):
            return False
    return True


# ---- one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", available_names())
def test_a_restored_step_leaves_every_tensor_counter_and_flag_as_before_and_the_next_steps_equal_a_twins(name):
    changed, left, model, optimizer = undo_a_step(name, quorum_of_one())
    assert unchanged_state(changed, model, optimizer) == [], f"{name}: the undone step must change every state tensor"
    assert left == [], f"{name}: the restore left\n" + "\n".join(left)
    assert retried_equals_twin(name, quorum_of_one(), model, optimizer)


def _without_clock(original):
    @functools.wraps(original)
    def snapshot(self):
        names = self.step_attributes
        self.step_attributes = tuple(n for n in names if n != "_clock")
        try:
            return original(self)
        finally:
            del self.step_attributes  # the class attribute again
    return snapshot


def _without_one_momentum(original):
    @functools.wraps(original)
    def snapshot(self):
        state = next(iter(self.state.values()))
        momentum = state.pop("momentum")
        try:
            return original(self)
        finally:
            state["momentum"] = momentum
    return snapshot


@pytest.mark.parametrize("mutation,expected", [(_without_clock, "_clock: 3 became 4"),
                                               (_without_one_momentum, "state[param0]['momentum']: missing")])
def test_a_snapshot_that_misses_a_counter_or_a_state_entry_fails_the_comparison(monkeypatch, mutation, expected):
    """The check above cannot pass vacuously: DeMo's snapshot without its step clock, or without one
    parameter's momentum, is caught (and named) by the same comparison."""
    _, left, _, _ = undo_a_step("DeMo", quorum_of_one())
    assert left == []
    monkeypatch.setattr(DeMo, "snapshot", mutation(DeMo.snapshot))
    _, left, _, _ = undo_a_step("DeMo", quorum_of_one())
    assert left == [expected]


def test_a_snapshot_keeps_the_record_of_a_sync_in_flight_and_a_restore_fails_it():
    """DeMo's ``overlap`` parks each step's exchange until the next step. A snapshot taken then keeps
    that sync's record (``Runtime.records``), not its suspended task; a restore drops every parked sync
    (the undone step's own too) and fails the ones in flight when it was taken: for DeMo, its update
    is not applied (``DeMo._fail_sync``). The state is the snapshot's, bit for bit, with nothing in flight."""
    model = Toy()
    optimizer = build_optimizer(list(model.named_parameters()), quorum_of_one(),
                                resolve("DeMo", {"overlap": True}, HP), ledger=comm.CommLedger())
    step(model, optimizer, 1)
    assert optimizer.runtime.in_flight == 1
    before = everything(model, optimizer)
    taken = take(model, optimizer)
    assert [record for _, _, record in taken[1].in_flight] == [1]  # the update of step 1
    step(model, optimizer, 2)  # lands step 1's update, parks its own
    assert optimizer.runtime.in_flight == 1
    put_back(model, optimizer, taken)
    assert optimizer.runtime.in_flight == 0
    assert changes(before, everything(model, optimizer)) == []


# ---- through the container, under the fault-tolerance transaction --------------------------------------
@pytest.mark.parametrize("name", [name for name in available_names() if owns_replicate_sync(name)])
def test_a_step_that_does_not_commit_is_undone_bit_for_bit_in_the_raw_state(name):
    model, container = fault_tolerant_container(name, StandInManager(commits=[True] * WARMUP + [False]),
                                                options=options_of)
    for t in range(1, WARMUP + 1):
        assert train_step(model, container, t)
    (optimizer,) = container.optimizers
    before = everything(model, optimizer)
    counters = (container.steps_taken, container.skipped_steps, container.consecutive_skips)
    assert not train_step(model, container, UNDONE)
    assert changes(before, everything(model, optimizer)) == []
    assert (container.steps_taken, container.skipped_steps, container.consecutive_skips) == counters
    assert train_step(model, container, UNDONE)  # the same step, committed, changes every state tensor
    assert unchanged_state(changes(before, everything(model, optimizer)), model, optimizer) == []


# ---- two real replicas, FSDP2 DTensors -------------------------------------------------------------------
def _undo_on_two_replicas(rank, world_size):
    """Each replica an FSDP2 mesh of one rank, as in torchtitan: parameters and states are DTensors."""
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_replicate", "fsdp"))
    topology, fsdp_mesh = Topology.from_mesh(mesh), mesh["fsdp"]
    out = {}
    for name in available_names():
        changed, left, model, optimizer = undo_a_step(name, topology, rank, fsdp_mesh)
        out[name] = (unchanged_state(changed, model, optimizer), left,
                     retried_equals_twin(name, topology, model, optimizer, rank, fsdp_mesh))
    return out


def test_on_two_replicas_a_restored_step_is_undone_bit_for_bit_and_the_next_steps_equal_a_twins():
    for rank, results in enumerate(run_distributed(_undo_on_two_replicas, 2)):
        for name, (unchanged, left, retried_ok) in results.items():
            assert unchanged == [], f"rank {rank} {name}: the undone step must change every state tensor"
            assert left == [], f"rank {rank} {name}: the restore left\n" + "\n".join(left)
            assert retried_ok, f"rank {rank} {name}: the steps after the restore differ from a twin's"
