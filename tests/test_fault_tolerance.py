"""Live fault tolerance, in one process: every family's step is a transaction around the Manager's
commit, a heal makes a group an exact copy of its peer, the replayed data, and the [fault_tolerance]
checks. A stand-in Manager decides the commits; the R collectives of a quorum of one send nothing.
The multi-process runs with torchft's lighthouse are in tests/test_fault_tolerance_live.py."""

import pytest
import torch

from titan_commopt.optim import FAMILIES, resolve
from titan_commopt.titan.common.replica_group_training import ReplayBatches
from titan_commopt.titan.config.fault_tolerance_keys import FtSettings, evaluation_problems, problems
from tests.ft_standins import SETTINGS, StandInManager, blocking, fault_tolerant_container, train_step

NAMES = sorted(name for family in FAMILIES.values() for name in family.presets)
EAGER = {"merge": "eager", "sync_delay": 0}  # DiLoCo's preset streams (sync_delay 1); an overlapped merge needs 0


def _state(model, container):
    tensors = [p.detach().clone() for p in model.parameters()]
    for optimizer in container.optimizers:
        for state in optimizer.state_dict()["state"].values():
            tensors += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", NAMES)
def test_a_step_that_does_not_commit_changes_nothing_and_its_retry_equals_a_committed_step(name):
    steps = 7  # past a local-step family's first syncs (short_periods; SparseLoCo's preset H is 2)
    ref_model, ref = fault_tolerant_container(name, StandInManager(), options=blocking)
    for t in range(1, steps + 1):
        assert train_step(ref_model, ref, t)

    model, container = fault_tolerant_container(name, StandInManager(commits=[True, True, False, True, False, True]),
                                                options=blocking)
    t = 1
    while t <= steps:
        before = _state(model, container)
        taken = container.steps_taken
        if train_step(model, container, t):
            t += 1
        else:
            assert _equal(_state(model, container), before), f"{name}: an uncommitted step {t} changed the state"
            assert container.steps_taken == taken
    assert container.ft.uncommitted_steps == 2
    assert _equal(_state(model, container), _state(ref_model, ref)), f"{name}: retried steps differ from committed ones"


@pytest.mark.parametrize("name", ["FlexDeMo", "DiLoCo", "Dion", "SparseLoCo", "MT-DAO"])
def test_a_healed_group_is_an_exact_copy_of_its_peer_and_stays_one(name):
    peer_model, peer = fault_tolerant_container(name, StandInManager())
    for t in range(1, 4):
        train_step(peer_model, peer, t)
    healed_model, healed = fault_tolerant_container(name, StandInManager(), seed=1)  # a group relaunched from scratch
    load, _ = healed.ft.manager.fns["commopt_optimizer"]
    _, save = peer.ft.manager.fns["commopt_optimizer"]
    load(save())
    assert _equal(_state(healed_model, healed), _state(peer_model, peer))
    assert healed.steps_taken == peer.steps_taken and healed.ledger.totals == peer.ledger.totals
    for t in range(4, 7):  # the same batches from here on: still equal (no state outside the heal)
        train_step(peer_model, peer, t)
        train_step(healed_model, healed, t)
    assert _equal(_state(healed_model, healed), _state(peer_model, peer))


def test_a_heal_copies_not_references():
    """The peer trains on while the healing group reads what it sent (torchft serves it over HTTP)."""
    model, container = fault_tolerant_container("FlexDeMo", StandInManager())
    train_step(model, container, 1)
    _, save = container.ft.manager.fns["commopt_optimizer"]
    sent = save()
    frozen = [v.clone() for v in sent["params"].values()]
    train_step(model, container, 2)
    assert all(torch.equal(a, b) for a, b in zip(sent["params"].values(), frozen))


def test_replayed_batches_come_again_in_order_and_a_heal_skips_to_the_quorums_step():
    batches = ReplayBatches(iter(range(100)))
    assert [next(batches), next(batches)] == [0, 1]
    batches.rewind()  # not committed: the same two again
    assert [next(batches), next(batches)] == [0, 1]
    batches.committed()
    assert next(batches) == 2
    batches.rewind()
    batches.skip_to(10)  # healed to a step whose first batch is the shard's 10th
    assert [next(batches), next(batches)] == [10, 11]


class _Schedulers:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


@pytest.mark.parametrize("counted", ["as read", "at the forward, after CP"])
def test_a_retried_step_counts_its_tokens_once_as_torchtitan_counts_them(monkeypatch, counted):
    """Each attempt of a step passes its batches through torchtitan's own counting (0.2.2 counts a
    batch as it is read, 0.3 at the forward, after context-parallel sharding: half the labels here, as
    CP 2 would); a step that does not commit leaves the count as its quorum left it, which a heal
    sets; the LR schedule moves once per committed step, and the retry trains the same batch."""
    from titan_commopt.titan.config.fault_tolerance_keys import KILL_ENV
    from titan_commopt.titan.common.replica_group import ReplicaGroupFT
    from titan_commopt.titan.common.replica_group_training import ReplicaGroupSteps, ReplicaGroupTraining

    monkeypatch.delenv(KILL_ENV, raising=False)
    manager = StandInManager()
    commits = iter([False, True, False, True])
    heal_at_attempt = 3
    seen = []

    class Torchtitan:  # torchtitan's Trainer as ReplicaGroupSteps uses it
        def batch_generator(self, data):
            for batch in data:
                if counted == "as read":
                    self.ntokens_seen += batch.numel()
                yield batch

        def train_step(self, batches):
            if len(seen) + 1 == heal_at_attempt:  # this quorum heals: torchft calls the registered load
                load, _ = manager.fns["commopt_trainer"]
                load({"step": 7, "ntokens_seen": 500, "lr_schedulers": {"steps": 6}})
            labels = next(batches)
            seen.append(int(labels[0]) // 16)  # the batch's index in the shard
            if counted != "as read":
                self.ntokens_seen += labels.numel() // 2
            self.optimizers.committed = next(commits)
            self.lr_schedulers.step()

    class Trainer(ReplicaGroupSteps, Torchtitan):
        pass

    trainer = Trainer()
    trainer.fault_tolerance = ReplicaGroupTraining(SETTINGS, commopt=None)
    group = trainer.fault_tolerance.group = ReplicaGroupFT(SETTINGS, manager=manager, replicate=None)
    trainer.optimizers = type("Container", (), {"ft": group, "owns_replicate_sync": True, "committed": True})()
    trainer.lr_schedulers, trainer.model_parts, trainer.gradient_accumulation_steps = _Schedulers(), [], 1
    trainer.step, trainer.ntokens_seen = 1, 100
    per_batch = 16 if counted == "as read" else 8
    batches = trainer.batch_generator(torch.arange(160).view(10, 16))
    trainer.train_step(batches)  # not committed, then committed
    assert (trainer.ntokens_seen, trainer.lr_schedulers.steps, seen) == (100 + per_batch, 1, [0, 0])
    trainer.step = 2
    trainer.train_step(batches)  # healed to step 7 in its first quorum (not committed), then committed
    # after the heal the group reads its shard from step 7's batch on: the 7th (index 6)
    assert (trainer.ntokens_seen, trainer.lr_schedulers.steps, seen) == (500 + per_batch, 7, [0, 0, 6, 6])


def _lines(**changes):
    settings = FtSettings(**{**SETTINGS.__dict__, **changes})
    return problems(settings, dp_replicate=1, lighthouse="http://127.0.0.1:29510")


def test_fault_tolerance_settings_that_cannot_work_are_one_line_each():
    assert _lines() == []
    assert problems(FtSettings(), dp_replicate=2, lighthouse=None) == []  # off: nothing to check
    (line,) = _lines(group_size=0)
    assert line.startswith("[fault_tolerance] group_size = 0:")
    (line,) = _lines(replica_id=2)
    assert line.startswith("[fault_tolerance] replica_id = 2: must be in 0..1")
    (line,) = _lines(min_replica_size=3)
    assert line.startswith("[fault_tolerance] min_replica_size = 3")
    (line,) = _lines(semi_sync_method="diloco")
    assert "semi_sync_method" in line and "DiLoCo" in line
    (line,) = problems(SETTINGS, dp_replicate=2, lighthouse="http://h:1")
    assert line.startswith("[parallelism] data_parallel_replicate_degree = 2:")
    (line,) = problems(SETTINGS, dp_replicate=1, lighthouse=None)
    assert line.startswith("[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE is not set")
    (line,) = problems(SETTINGS, dp_replicate=1, lighthouse="http://nowhere")
    assert line.startswith("[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE = 'http://nowhere': not an address")


@pytest.mark.parametrize("variable, value, line", [
    ("TITAN_COMMOPT_FT_KILL", "6", "TITAN_COMMOPT_FT_KILL = '6': a failure rehearsal; allowed is <step>:quorum, "
     "<step>:collective, <step>:heal or <step>:stall"),
    ("TITAN_COMMOPT_FT_KILL", "6:heals", "TITAN_COMMOPT_FT_KILL = '6:heals': a failure rehearsal;"),
    ("TORCHFT_QUORUM_TIMEOUT_SEC", "2m", "TORCHFT_QUORUM_TIMEOUT_SEC = '2m': the seconds a step waits for its quorum "
     "(torchft's); allowed is a finite number > 0 (unset: 120)"),
    ("TORCHFT_QUORUM_TIMEOUT_SEC", "0", "TORCHFT_QUORUM_TIMEOUT_SEC = '0': "),
])
def test_a_bad_fault_tolerance_variable_is_one_line_before_any_process_group(monkeypatch, variable, value, line):
    """The environment a fault-tolerant launch reads (the failure rehearsal, torchft's quorum wait) is
    checked with the config: one line, not a traceback from the Manager's construction."""
    monkeypatch.setenv(variable, value)
    (found,) = problems(SETTINGS, dp_replicate=1, lighthouse="http://127.0.0.1:29510")
    assert found.startswith(line), found
    assert problems(FtSettings(), dp_replicate=1, lighthouse=None) == []  # without fault tolerance, not read


def test_an_evaluation_whose_global_model_is_a_mean_over_the_groups_is_refused_under_fault_tolerance():
    """A sync in flight across steps is a transaction of its own under fault tolerance
    (tests/test_fault_tolerance_fragments.py): nothing of it is refused. An evaluation follows a
    step's commit, where no R collective may run: a family whose global model is a mean over the
    groups is refused with validation on, an eager merge's (each group's anchor holds its own share) too."""
    (line,) = evaluation_problems(SETTINGS, resolve("DiLoCo", EAGER), validating=True)
    assert line.startswith("[validation] enable = true with [optimizer] name = 'DiLoCo' under [fault_tolerance] enable "
                           "= true: its global model between syncs is the mean of the replica groups' anchors"), line
    assert line.endswith("set [validation] enable = false, or set [commopt.local] merge = 'delayed'"), line
    (line,) = evaluation_problems(SETTINGS, resolve("SparseLoCo", {"merge": "eager"}), validating=True)
    assert line.endswith("or set [commopt.sparseloco] merge = 'delayed'"), line
    (line,) = evaluation_problems(SETTINGS, resolve("DES-LOC"), validating=True)
    assert "the mean of the replica groups' parameters" in line
    for name, options in [("DiLoCo", {"merge": "delayed", "sync_delay": 0}), ("DiLoCo", {"fragments": 2, "sync_delay": 1}),
                          ("SparseLoCo", {"sync_delay": 1}), ("DeMo", {"overlap": True})]:
        assert evaluation_problems(SETTINGS, resolve(name, options), validating=True) == [], (name, options)
    assert evaluation_problems(SETTINGS, resolve("DiLoCo", EAGER), validating=False) == []
    assert evaluation_problems(FtSettings(), resolve("DiLoCo", EAGER), validating=True) == []
