"""Live fault tolerance with a sync in flight across steps (streaming fragments, overlapped merges,
DeMo's overlap), in one process: the rule of ``titan/common/replica_group.py``. A fragment's sync is a
transaction from the quorum it is issued in to the commit of the step that merges it:

- while the quorum stays, a committed run equals the engine without fault tolerance, bit for bit;
- a quorum that changes before the merge fails it: its fragment back to its global copy (the anchor),
  its outer state unchanged, no committed step lost;
- a step that does not commit (the merge step too) is undone, and the syncs then in flight fail;
- a group that heals mid-fragment takes its peer's records and fails them as its peer does: both go on
  equal.

A stand-in Manager decides the commits and the quorum's id; R is a quorum of one (its collectives send
nothing). The multi-process run with torchft's lighthouse is in tests/test_fault_tolerance_live.py."""

import pytest
import torch

from titan_commopt import comm
from titan_commopt.optim import build_optimizer, resolve
from titan_commopt.optim.common import local
from titan_commopt.titan.common.replica_group import Quorum
from titan_commopt.topology import Topology
from tests.ft_standins import StandInManager, Toy, fault_tolerant_container, grads, train_step

pytestmark = pytest.mark.both_lines  # the container and the rule are both lines' (titan/common/)

STREAMING = {"Kx": 4, "fragments": 2, "sync_delay": 2}  # fragment 0 issued after update 4, merged after 6
CONFIGS = {
    "DiLoCo streaming": ("DiLoCo", STREAMING),
    "DiLoCo lerp": ("DiLoCo", {"Kx": 4, "fragments": 2, "sync_delay": 1, "merge": "lerp", "merge_alpha": 0.5}),
    "LocalAdam streaming": ("LocalAdam", {"Kx": 4, "Ku": [4], "Kv": 4, "fragments": 2, "sync_delay": 2}),
    "DiLoCo delayed": ("DiLoCo", {"Kx": 4, "merge": "delayed", "sync_delay": 0}),
    "LocalAdam eager": ("LocalAdam", {"Kx": 4, "Ku": [4], "Kv": 4, "merge": "eager"}),
    "SparseLoCo streaming": ("SparseLoCo", {"H": 4, "sync_delay": 3}),
    "SparseLoCo eager": ("SparseLoCo", {"H": 4, "merge": "eager"}),
    "DeMo overlap": ("DeMo", {"overlap": True}),
}
IN_FLIGHT_AT = 6  # after this step every configuration has a sync in flight


def _container(config, manager, seed=0):
    name, options = CONFIGS[config]
    return fault_tolerant_container(name, manager, seed=seed, options=lambda _: options)


def _state(model, container):
    """Parameters, then every state tensor of every parameter, read raw (no state_dict: nothing lands)."""
    (optimizer,) = container.optimizers
    return _raw_state(model, optimizer)


def _raw_state(model, optimizer):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [local(v).detach().clone() for _, v in sorted(optimizer.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _outer(model, optimizer):
    """The outer state (anchors, outer momenta, error feedback) of every parameter, by key."""
    return {(i, k): local(v).clone() for i, p in enumerate(model.parameters())
            for k, v in optimizer.state[p].items() if k in ("outer_anchor", "outer_buf", "error_feedback")}


class _BareEngine:
    """The same optimizer without fault tolerance, on the same model and gradients: what a run under a
    quorum that stays must equal."""

    def __init__(self, config):
        name, options = CONFIGS[config]
        torch.manual_seed(0)
        self.model = Toy()
        topology = Topology(quorum=Quorum(StandInManager(), 1))
        self.optimizer = build_optimizer(list(self.model.named_parameters()), topology, resolve(name, options),
                                         ledger=comm.CommLedger())

    def step(self, t):
        for p, g in zip(self.model.parameters(), grads(self.model, t)):
            p.grad = g.clone()
        self.optimizer.step()

    def state(self):
        return _raw_state(self.model, self.optimizer)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_while_the_quorum_stays_a_committed_run_equals_the_engine_without_fault_tolerance(config):
    model, container = _container(config, StandInManager())
    bare = _BareEngine(config)
    (optimizer,) = container.optimizers
    assert not optimizer.runtime.defers_launch  # a sync goes on the wire in the quorum of its own step
    in_flight = 0
    for t in range(1, 11):
        assert train_step(model, container, t)
        bare.step(t)
        in_flight += optimizer.runtime.in_flight
        assert _equal(_state(model, container), bare.state()), f"{config}: step {t} differs from the engine"
    assert in_flight and container.ft.failed_syncs == 0


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_checkpoint_step_lands_the_syncs_in_flight_inside_its_transaction(config):
    """The trainer says a checkpoint follows step 6 (``checkpoint_follows``): the syncs in flight land in
    that step, before its commit, as a checkpoint without fault tolerance lands them (the engine without
    fault tolerance, flushed after step 6, as its ``state_dict`` does), so the checkpoint fails none and the
    run goes on as that engine's, bit for bit."""
    model, container = _container(config, StandInManager())
    bare = _BareEngine(config)
    (optimizer,) = container.optimizers
    for t in range(1, 11):
        container.checkpoint_follows = lambda t=t: t == IN_FLIGHT_AT
        assert train_step(model, container, t)
        bare.step(t)
        if t == IN_FLIGHT_AT:
            assert bare.optimizer.runtime.in_flight and optimizer.runtime.in_flight == 0, config
            bare.optimizer.flush()
            container.state_dict()  # what the checkpoint reads: nothing left to fail
        assert _equal(_state(model, container), bare.state()), f"{config}: step {t} differs"
    assert container.ft.failed_syncs == 0


def test_the_trainer_says_when_torchtitans_checkpointer_saves():
    """``checkpoint_follows`` asks torchtitan's own rule (``CheckpointManager._should_save``, this line's),
    with the step being taken and whether it is the last: every interval-th step and the last one."""
    import types

    from torchtitan.components.checkpoint import CheckpointManager

    from titan_commopt.titan.common.replica_group_training import _checkpoint_follows

    rule = types.SimpleNamespace(enable=True, load_only=False, enable_first_step_checkpoint=False, interval=4)
    checkpointer = types.SimpleNamespace(_should_save=lambda *a, **k: CheckpointManager._should_save(rule, *a, **k))
    trainer = types.SimpleNamespace(checkpointer=checkpointer, step=0)
    trainer.should_continue_training = lambda: trainer.step < 10
    follows = []
    for trainer.step in range(1, 11):
        follows.append(_checkpoint_follows(trainer))
    assert [step for step, yes in enumerate(follows, 1) if yes] == [4, 8, 10]
    rule.enable = False
    assert not _checkpoint_follows(trainer)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_quorum_that_changes_before_the_merge_fails_the_fragment_back_to_its_anchor(config):
    manager = StandInManager()
    model, container = _container(config, manager)
    for t in range(1, IN_FLIGHT_AT + 1):
        assert train_step(model, container, t)
    (optimizer,) = container.optimizers
    assert optimizer.runtime.in_flight
    params, outer = [p.detach().clone() for p in model.parameters()], _outer(model, optimizer)
    committed = (container.steps_taken, manager.step)
    manager._quorum_id = 1  # a group lost or joined: the next quorum is another
    container.zero_grad()
    assert optimizer.runtime.in_flight == 0 and container.ft.failed_syncs >= 1
    assert _equal(list(_outer(model, optimizer).values()), list(outer.values())), "the outer state moved"
    assert (container.steps_taken, manager.step) == committed  # no committed step undone
    anchored = [i for i, key in outer if key == "outer_anchor"]
    returned = 0
    for i, (p, before) in enumerate(zip(model.parameters(), params)):
        if torch.equal(p.detach(), before):
            continue
        assert i in anchored and torch.equal(p.detach(), local(optimizer.state[p]["outer_anchor"])), (config, i)
        returned += 1
    # a family with an anchor sends its fragment back to it; without one (LocalAdam's averaging, DeMo),
    # nothing of the parameters changes
    assert returned if config not in ("LocalAdam streaming", "DeMo overlap") else not returned, config
    for t in range(IN_FLIGHT_AT + 1, IN_FLIGHT_AT + 5):  # and it trains on, committing every step
        assert train_step(model, container, t)
    assert container.steps_taken == IN_FLIGHT_AT + 4


def _fragment_params(model, optimizer, fragment):
    return [i for i, (p, f) in enumerate(zip(model.parameters(), optimizer.schedule.fragment_of)) if f == fragment]


def test_a_failed_commit_at_the_merge_step_restores_the_fragments_global_copy_bit_for_bit():
    """DiLoCo, 2 fragments, sync_delay 2, Kx 4: fragment 0 is issued after update 4 and merged at
    step 6, whose commit fails. Fragment 0 is then its anchor, bit for bit; fragment 1 (not in flight)
    and every anchor and outer momentum are as step 6 found them; the step is trained again."""
    manager = StandInManager(commits=[True] * 5 + [False])
    model, container = _container("DiLoCo streaming", manager)
    for t in range(1, 6):
        assert train_step(model, container, t)
    (optimizer,) = container.optimizers
    before, outer = _state(model, container), _outer(model, optimizer)
    assert [record for _, _, record in optimizer.runtime.records()] == [("streaming", 4)]
    assert not train_step(model, container, 6)
    assert optimizer.runtime.in_flight == 0 and container.ft.failed_syncs == 1
    params = list(model.parameters())
    for i in _fragment_params(model, optimizer, 0):
        assert torch.equal(params[i].detach(), optimizer.state[params[i]]["outer_anchor"]), i
    for i in _fragment_params(model, optimizer, 1):
        assert torch.equal(params[i].detach(), before[i]), i
    assert _equal(list(_outer(model, optimizer).values()), list(outer.values()))
    assert container.steps_taken == 5 and manager.step == 5
    assert train_step(model, container, 6) and container.steps_taken == 6


def test_a_group_healed_mid_fragment_rejoins_and_stays_equal_to_its_peer():
    """The peer has fragment 0 in flight (issued after update 4) when a relaunched group heals from
    it: the heal carries the state and the records of the syncs in flight, not their collectives; the
    quorum is a new one, so both fail that fragment alike and train on equal."""
    peer_manager = StandInManager()
    peer_model, peer = _container("DiLoCo streaming", peer_manager)
    for t in range(1, 6):
        assert train_step(peer_model, peer, t)
    healed_manager = StandInManager()
    healed_model, healed = _container("DiLoCo streaming", healed_manager, seed=1)  # relaunched from scratch
    load, _ = healed.ft.manager.fns["commopt_optimizer"]
    _, save = peer.ft.manager.fns["commopt_optimizer"]
    load(save())  # torchft: inside the new quorum, before the healed group's first step
    assert healed.optimizers[0].runtime.in_flight == 1  # adopted: a record, no collective
    peer_manager._quorum_id = healed_manager._quorum_id = 1  # the quorum with the relaunched group
    for t in range(6, 10):
        assert train_step(peer_model, peer, t)
        assert train_step(healed_model, healed, t)
        assert _equal(_state(healed_model, healed), _state(peer_model, peer)), t
    assert peer.ft.failed_syncs == healed.ft.failed_syncs == 1
