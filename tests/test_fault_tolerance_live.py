"""Live fault tolerance on torchtitan 0.2.2 (torchft): real replica groups on CPU/gloo, each its own
``python -m titan_commopt.run`` launch, joined by a torchft lighthouse (``tests/ft_utils.py``).

- FlexDeMo, 2 groups x 2 processes, group 1 SIGKILLed during a collective and relaunched at once: the
  survivor undoes that step, goes on alone without a restart, the relaunched group heals from it and
  rejoins; both end on the same parameters, and the losses up to the kill are those of a run that
  never failed (FlexDeMo's no-failure run, which is also its short run).
- DiLoCo (blocking), the same, killed between steps inside an outer period: the run checks the replicas'
  parameters at every sync (``[commopt] check_replicas_every``), and they end equal. DiLoCo rather
  than SparseLoCo: it runs on the local-step engine DES-LOC, MT-DAO and LocalAdam share (the anchor,
  the outer optimizer's momentum and the sync schedule a heal must carry), and it is the algorithm
  torchft itself ships, so its behaviour under failures is the one users compare with; SparseLoCo
  (and DES-LOC, whose optimizer states sync too) get a short run below.
- Streaming DiLoCo (fragments in flight across steps), 2 groups x 1 process: group 1 dies while two
  fragments' all-reduces are in flight; the survivor waits in the quorum, the relaunched group heals
  from it, both fail those fragments alike (each back to its anchor) and end on the same anchors; a
  checkpoint written later, with two fragments in flight, fails none (the step lands them first).
- DeMo with ``overlap`` (its exchange overlapped: each step's update lands in the next), 2 groups x 2
  processes, group 1 killed at step 6's first R collective with step 5's exchange parked: the survivor's
  undone step drops it, it trains on alone, heals the relaunched group, and both end on the same parameters.
- Launchers killed alone, three groups, a heal cut short: a worker whose launcher (``titan_commopt.run``
  or plain ``torchrun``) is SIGKILLed leaves by itself instead of heartbeating on as a zombie group;
  two failures at different times, one while the relaunched group applies its heal, one group
  relaunched twice: no committed step lost, the three end on the same parameters, nothing left over.
- Every family a short run (2 groups x 1 process; MuLoCo, the local-step engine with its Muon step, too; torchtitan's own AdamW through its FSDP hook, 2 x 2).
- Bad input: one line each, exit status 2 (an unreachable lighthouse after a bounded wait)."""

import os
import re
import subprocess
import sys

import pytest

from titan_commopt.titan.config.fault_tolerance_keys import LIGHTHOUSE_ENV, LIGHTHOUSE_WAIT_ENV, QUORUM_TIMEOUT_ENV


from tests.ft_utils import LIGHTHOUSE_BIN, FtJob, GroupLog, KILL_ENV, RUN_S, START_S, alive, free_port, processes_naming
from tests.titan_utils import CONFIG, EXTRA, LINE, LR, ROOT

pytestmark = pytest.mark.skipif(LINE != "0.2", reason="the live fault-tolerance runs are torchtitan 0.2.2's")

TINY = ["--model.flavor", "cpu_tiny"]
# FtJob.hold_back paces a survivor as if its steps were long: its stall watchdog ([commopt]
# ft_stall_timeout_s) would take that for a stall, so the failure runs (and their references) turn it off.
NO_WATCHDOG = ["--commopt.ft_stall_timeout_s", "0"]
NPROC = 2  # processes per replica group in the failure runs

# FlexDeMo: group 1 dies at step KILL_AT (before its first R collective there: its peer is inside it).
# Up to KILL_AT the LR is in its warm-up, which does not depend on the run's length: the no-failure
# run (WARMUP steps) and the failure run train alike until the kill.
WARMUP = 10
KILL_AT = 6
# Steps after the kill: the survivor's steps alone (a few: it is held back while the relaunched group
# starts, FtJob.hold_back) and the steps both groups then train together.
AFTER_KILL = 34


def _demo_family(name: str, steps: int, *extra: str) -> list[str]:
    """FlexDeMo or DeMo at its preset (both block), ``extra`` on top."""
    return [*TINY, *NO_WATCHDOG, "--optimizer.name", name, "--optimizer.lr", LR[name], "--lr_scheduler.warmup_steps",
            str(WARMUP), "--training.steps", str(steps), "--commopt.check_replicas_every", "5", *extra]


DEMO_OVERLAP = ["--commopt.demo.overlap", "true"]  # each step's update lands in the next step


# DiLoCo: an outer step every KX steps; group 1 dies before the quorum of step DILOCO_KILL_AT, inside the
# period that ends at step 8; both runs end on a sync.
KX = 4
# blocking, as its 2023 paper runs it: the replicas equal after every sync (the preset streams; its sync in
# flight across steps: the streaming test below)
DILOCO_BLOCKING = ["--commopt.local.fragments", "1", "--commopt.local.sync_delay", "0", "--commopt.local.merge", "additive"]
DILOCO_KILL_AT = 6
DILOCO_STEPS = 40


def _diloco(steps: int) -> list[str]:
    return [*TINY, *NO_WATCHDOG, "--optimizer.name", "DiLoCo", "--commopt.local.Kx", str(KX), "--lr_scheduler.warmup_steps",
            str(2 * KX), "--training.steps", str(steps), "--commopt.check_replicas_every", str(KX), *DILOCO_BLOCKING]


def _run(tmp, args: list[str], nproc: int = NPROC) -> list[GroupLog]:
    """A job that never fails: its two groups' logs (a one-process group without torchrun)."""
    with FtJob(tmp, args, nproc=nproc, launcher=nproc > 1) as job:
        return job.finish(job.start())


@pytest.fixture(scope="module")
def flexdemo_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("flexdemo"), _demo_family("FlexDeMo", WARMUP))


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("diloco"), _diloco(2 * KX))


def _assert_short_run(logs: list[GroupLog], steps: int, nproc: int) -> None:
    """Both groups trained every step together from the first (the job's first quorum waits for every
    group), nothing undone or healed, and the same rank of both groups ends on the same parameters."""
    for replica_id, log in enumerate(logs):
        for rank in range(nproc):
            assert log.quorums[rank] == [(2, replica_id, 0)], (replica_id, rank, log.quorums)
            assert sorted(log.loss_by_step(rank)) == list(range(1, steps + 1))
        assert not log.not_committed and not log.heals
    for rank in range(nproc):
        assert logs[0].fingerprints[rank][0] == steps
        assert logs[0].fingerprints[rank] == logs[1].fingerprints[rank], rank
    # each group reads its own part of the data
    assert logs[0].loss_by_step()[1] != logs[1].loss_by_step()[1]


def _kill_and_relaunch(job: FtJob, kill_at: int, where: str):
    """Start the job with group 1 set to die at step ``kill_at`` (``where``: "quorum" or "collective"),
    relaunch it as soon as it died, hold the survivor back (``FtJob.hold_back``) from its first quorum
    alone until the relaunched group starts training, and wait for both to end. Returns the logs of
    the killed launch, the survivor and the relaunched group, and the survivor's console."""
    survivor, victim = job.start(env={1: {KILL_ENV: f"{kill_at}:{where}"}})
    job.until(lambda: len(victim.log().killed) == NPROC, f"group 1 killing itself at step {kill_at}", RUN_S,
              [victim, survivor])
    victim.kill()  # its workers are gone; its launcher need not finish its report first
    again = job.launch(1, label="group1_relaunched")
    # the survivor's quorum alone forms once the lighthouse misses the dead group's heartbeats; held
    # back from then on, it trains that step (and a few more) alone, then heals the relaunched group
    job.until(lambda: [w for w, _, _ in survivor.log().quorums.get(0, [])][1:] == [1], "the survivor's quorum alone",
              RUN_S, [survivor])
    job.hold_back(survivor, lambda: again.text().count("Training starts at step 1") == NPROC,
                  "the relaunched group to start training", START_S)
    survivor_log, again_log = job.finish([survivor, again])
    return victim.log(), survivor_log, again_log, survivor.text()


def _assert_killed_and_healed(killed: GroupLog, survivor: GroupLog, again: GroupLog, survivor_text: str,
                              reference: list[GroupLog], kill_at: int, steps: int) -> None:
    """What a kill at ``kill_at`` and a relaunch must show."""
    assert killed.killed == set(range(NPROC))
    for rank in range(NPROC):
        # losses up to the kill: those of the run that never failed (the survivor's step kill_at too:
        # its forward ran on the parameters of step kill_at - 1)
        assert killed.loss_by_step(rank) == reference[1].loss_by_step(rank, upto=kill_at - 1), rank
        assert survivor.loss_by_step(rank, upto=kill_at) == reference[0].loss_by_step(rank, upto=kill_at), rank
        # the survivor went on alone, in the same process
        first, alone, *rest = survivor.quorums[rank]
        assert first == (2, 0, 0) and alone == (1, 0, kill_at - 1), survivor.quorums[rank]
        (healed_at, _), = again.heals[rank]
        assert rest == [(2, 0, healed_at)], survivor.quorums[rank]
        assert again.quorums[rank] == [(2, 1, healed_at)]
        assert healed_at >= kill_at, "the survivor trained a step alone before the relaunched group joined"
        assert sorted(again.loss_by_step(rank)) == list(range(healed_at + 1, steps + 1))
        # from the heal on, both send the same R traffic each step (the same collectives; a local-step
        # family keeps the job's sync schedule)
        assert again.r_sent[rank] == {s: b for s, b in survivor.r_sent[rank].items() if s > healed_at}
        # both reach the last step on the same parameters
        assert survivor.fingerprints[rank][0] == again.fingerprints[rank][0] == steps
        assert survivor.fingerprints[rank] == again.fingerprints[rank], rank
    assert survivor_text.count("Training starts at step 1") == NPROC  # never restarted


def test_flexdemo_short_run(flexdemo_run):
    _assert_short_run(flexdemo_run, WARMUP, NPROC)


def _killed_in_a_collective(tmp_path, name: str, reference: list[GroupLog], *extra: str) -> GroupLog:
    """Group 1 of a ``name`` job (``extra``: its options on top) killed at its first R collective of step
    KILL_AT, relaunched: what a kill must show, and the step the survivor's peer died in undone and
    trained again. The survivor's log."""
    steps = KILL_AT + AFTER_KILL
    with FtJob(tmp_path, _demo_family(name, steps, *extra)) as job:
        killed, survivor, again, text = _kill_and_relaunch(job, KILL_AT, "collective")
    _assert_killed_and_healed(killed, survivor, again, text, reference, KILL_AT, steps)
    assert all(survivor.not_committed[rank] == [KILL_AT] for rank in range(NPROC)), survivor.not_committed
    assert not again.not_committed
    return survivor


def test_flexdemo_group_killed_during_a_collective_heals_and_rejoins(tmp_path, flexdemo_run):
    _killed_in_a_collective(tmp_path, "FlexDeMo", flexdemo_run)


@pytest.fixture(scope="module")
def demo_overlap_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("demo"), _demo_family("DeMo", WARMUP, *DEMO_OVERLAP))


def test_overlapped_demo_group_killed_with_an_exchange_in_flight_heals_and_rejoins(tmp_path, demo_overlap_run):
    """DeMo with ``overlap``: when group 1 dies at its first R collective of step KILL_AT (the clip's),
    step KILL_AT - 1's exchange is parked, its update not yet landed. The survivor undoes step KILL_AT,
    which drops that exchange (its update never lands, on either group), trains on alone, heals the
    relaunched group, and both end on the same parameters, checked every 5 steps."""
    _assert_short_run(demo_overlap_run, WARMUP, NPROC)
    survivor = _killed_in_a_collective(tmp_path, "DeMo", demo_overlap_run, *DEMO_OVERLAP)
    # the parked exchange, dropped with the undone step
    assert all(survivor.syncs_failed[rank][0] == (1, f"step {KILL_AT} did not commit") for rank in range(NPROC))


def test_diloco_short_run(diloco_run):
    _assert_short_run(diloco_run, 2 * KX, NPROC)


def test_diloco_group_killed_between_steps_inside_a_period_heals_and_syncs(tmp_path, diloco_run):
    assert DILOCO_KILL_AT % KX not in (0, 1) and DILOCO_STEPS % KX == 0  # inside a period; ends on a sync
    with FtJob(tmp_path, _diloco(DILOCO_STEPS)) as job:
        killed, survivor, again, text = _kill_and_relaunch(job, DILOCO_KILL_AT, "quorum")
    # the run checked the replicas' parameters at every sync after the heal (a difference stops it with
    # exit status 1); they end equal
    _assert_killed_and_healed(killed, survivor, again, text, diloco_run, DILOCO_KILL_AT, DILOCO_STEPS)
    # lost between steps: no step of the survivor was undone
    assert not survivor.not_committed and not again.not_committed


# ---- streaming DiLoCo: a group lost while fragments are in flight ----
STREAM_STEPS = 12
STREAM_KILL_AT = 7
# after the relaunch (a checkpoint written before it would be what the relaunched group resumes from);
# fragment 0 (issued after update 8) and fragment 1 (after 10) are in flight after step 10
STREAM_CHECKPOINT_AT = 10


def test_streaming_diloco_group_lost_with_fragments_in_flight_heals_and_both_fail_them_alike(tmp_path):
    """Streaming DiLoCo (Kx 4, 2 fragments, sync_delay 3: from step 2 on a fragment's all-reduce is in
    flight after every step), 2 groups x 1 process, a quorum needing both (the lighthouse's
    ``--min_replicas 2``). Group 1 dies before step 7's quorum with fragment 0 (issued after update 4)
    and fragment 1 (after 6) in flight. The survivor waits in that quorum for the relaunched group,
    which heals from it (the survivor's state and the records of its syncs in flight, not their
    collectives); the quorum is a new one, so both fail those two fragments alike (each back to its
    anchor) and train on together. A checkpoint after step STREAM_CHECKPOINT_AT, with two fragments in
    flight again, fails none of them: the step lands them inside its own transaction. The survivor
    commits every step once, in one process; both end on the same anchors, the global model (their
    parameters differ by each one's local progress)."""
    args = [*TINY, "--optimizer.name", "DiLoCo", "--commopt.local.Kx", "4", "--commopt.local.fragments", "2",
            "--commopt.local.sync_delay", "3", "--training.steps", str(STREAM_STEPS), "--validation.enable", "false",
            "--checkpoint.enable", "true", "--checkpoint.interval", str(STREAM_CHECKPOINT_AT)]
    wait = {QUORUM_TIMEOUT_ENV: str(START_S)}  # the survivor's quorum waits out the relaunch's start-up
    with FtJob(tmp_path, args, nproc=1, launcher=False, min_replicas=2) as job:
        survivor, victim = job.start(env={0: wait, 1: {**wait, KILL_ENV: f"{STREAM_KILL_AT}:quorum"}})
        job.until(lambda: not victim.running(), f"group 1 killing itself at step {STREAM_KILL_AT}", RUN_S, [survivor])
        assert victim.log().killed == {0}, victim.tail()
        again = job.launch(1, env=wait, label="group1_relaunched")
        survivor_log, again_log = job.finish([survivor, again])
    why = f"the quorum changed before they merged, step {STREAM_KILL_AT}"
    assert sorted(survivor_log.loss_by_step()) == list(range(1, STREAM_STEPS + 1))
    assert survivor.text().count("Training starts at step 1") == 1  # never restarted
    assert not survivor_log.not_committed and not again_log.not_committed and not survivor_log.heals
    (healed_at, _), = again_log.heals[0]
    assert healed_at == STREAM_KILL_AT - 1  # what the survivor had committed stands
    assert survivor_log.syncs_failed[0] == again_log.syncs_failed[0] == [(2, why)]  # none at the checkpoint
    for k in range(2):  # each group wrote it whole (torchft: a folder per replica group), as the 0.3 test checks
        assert (tmp_path / f"out{k}" / "checkpoint" / f"replica_{k}" / f"step-{STREAM_CHECKPOINT_AT}" / ".metadata").exists()
    assert sorted(again_log.loss_by_step()) == list(range(STREAM_KILL_AT, STREAM_STEPS + 1))
    assert again_log.r_sent[0] == {s: b for s, b in survivor_log.r_sent[0].items() if s >= STREAM_KILL_AT}
    assert survivor_log.anchors[0][0] == again_log.anchors[0][0] == STREAM_STEPS
    assert survivor_log.anchors[0] == again_log.anchors[0]


# ---- launchers killed alone; three groups, failures at different times, one during a heal ----
ORPHAN_STEPS = 8


def test_launchers_killed_alone_and_a_heal_cut_short_lose_no_committed_step(tmp_path):
    """Three groups of one process, group 1 launched by ``python -m titan_commopt.run``, the others (and
    every relaunch: no config check before the workers, a shorter start-up) by plain ``torchrun``. A quorum needs all three (the lighthouse's ``--min_replicas 3``): the others wait in
    it for each relaunch instead of training on (a relaunch's start-up is many steps long here). Group
    1's launcher alone is SIGKILLed: its worker leaves by itself (it would heartbeat on as a zombie
    group, and no step with the relaunched group would commit); relaunched, group 1 dies while it
    applies its heal; then group 2's torchrun alone is SIGKILLed, and its worker leaves too; group 1
    (its second relaunch) and group 2 are launched again, both heal, and the three end on the same
    parameters, group 0 having committed every step once, in one process; nothing of the job is left."""
    args = [*TINY, "--optimizer.name", "FlexDeMo", "--optimizer.lr", LR["FlexDeMo"],
            "--training.steps", str(ORPHAN_STEPS), "--commopt.check_replicas_every", "2"]
    wait = {QUORUM_TIMEOUT_ENV: str(START_S)}  # a quorum waits out a relaunch's start-up
    with FtJob(tmp_path, args, groups=3, nproc=1, min_replicas=3) as job:
        g0, g1, g2 = job.start(env={k: wait for k in range(3)}, via={0: "torchrun", 2: "torchrun"})
        job.until(lambda: 2 in g0.log().loss_by_step(), "group 0's step 2", RUN_S, [g0, g1, g2])
        orphans = g1.kill_launcher()
        job.until(lambda: not any(map(alive, orphans)), "group 1's worker leaving with its launcher", START_S, [g0, g2])
        cut = job.launch(1, env={**wait, KILL_ENV: "1:heal"}, label="group1_cut", via="torchrun")
        job.until(lambda: not cut.running(), "the relaunched group 1 dying in its heal", RUN_S, [g0, g2])
        assert cut.log().killed == {0}, cut.tail()
        orphans += g2.kill_launcher()
        job.until(lambda: not any(map(alive, orphans)), "group 2's worker leaving with its torchrun", START_S, [g0])
        again = [job.launch(k, env=wait, label=f"group{k}_again", via="torchrun") for k in (1, 2)]
        logs = job.finish([g0, *again])
        assert processes_naming(str(tmp_path)) == []  # no orphan: nothing the job started runs
    survivor, *relaunched = logs
    assert sorted(survivor.loss_by_step()) == list(range(1, ORPHAN_STEPS + 1))
    assert g0.text().count("Training starts at step 1") == 1 and not survivor.heals  # never restarted or healed
    for killed, log in zip([g1, g2], relaunched):
        (healed_at, _), = log.heals[0]
        assert healed_at >= max(killed.log().loss_by_step(), default=0)  # what the group had committed stands
        assert sorted(log.loss_by_step()) == list(range(healed_at + 1, ORPHAN_STEPS + 1))
    assert survivor.fingerprints[0][0] == ORPHAN_STEPS
    assert survivor.fingerprints[0] == relaunched[0].fingerprints[0] == relaunched[1].fingerprints[0]


# ---- every family: a short run (2 groups x 1 process), ending where the replicas must be equal ----
SHORT = {  # name: (steps, [commopt] check_replicas_every); the local-step families end on a sync of every state
    "DeMo": (4, 2),
    "Dion": (4, 2),
    "DES-LOC": (8, 2),  # EXTRA: parameters every 2 steps, the states every 4 and 8
    "SparseLoCo": (4, 2),  # its preset's H = 2
    "Muon": (4, 2),  # the gradient averaged over the quorum every step, as AdamW-HSDP's
    "MuLoCo": (8, 4),  # EXTRA: an outer step every 4 steps; Muon's momentum never synced
}


@pytest.mark.parametrize("name", sorted(SHORT))
def test_short_run(tmp_path, name):
    from scripts._bench_common import cli_overrides

    steps, every = SHORT[name]
    args = [*TINY, "--optimizer.name", name, "--optimizer.lr", LR.get(name, "0.003"), "--training.steps", str(steps),
            "--commopt.check_replicas_every", str(every), *cli_overrides(name, EXTRA.get(name, {}))]
    if name == "DES-LOC":  # its global model between syncs is a mean over R: no evaluation under fault tolerance
        args += ["--validation.enable", "false"]
    _assert_short_run(_run(tmp_path, args, nproc=1), steps, 1)


def test_adamw_short_run_through_fsdp_hook(tmp_path):
    """torchtitan's own AdamW under torchft, torchtitan's way: FSDP (2 processes per group) averages
    each reduce-scattered gradient over the quorum's groups."""
    _assert_short_run(_run(tmp_path, [*TINY, "--optimizer.name", "AdamW", "--training.steps", "4"]), 4, NPROC)


# ---- the job's first quorum waits for every group (a stand-in Manager) ----
class _Manager:
    """torchft's Manager as ReplicaGroupFT.begin_step uses it: the quorums it will return, in turn."""

    def __init__(self, sizes: list[int], step: int = 0) -> None:
        self.sizes, self.step, self.asked = sizes, step, 0

    def start_quorum(self) -> None:
        self.asked += 1

    def num_participants(self) -> int:
        return self.sizes[min(self.asked, len(self.sizes)) - 1]

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return self.step


@pytest.mark.parametrize("sizes, step, wait, asked, size", [
    ([1, 1, 2], 0, 30.0, 3, 2),  # a fresh job: asked again until both groups are in
    ([2], 0, 30.0, 1, 2),
    ([1], 0, 1.5, 4, 1),  # the other group never came: after the wait (3 asks more) it starts alone
    ([1, 2], 5, 30.0, 1, 1),  # joining a job that trained (a relaunch healed to step 5): at once
])
def test_first_quorum_waits_for_every_group(monkeypatch, sizes, step, wait, asked, size):
    """[commopt] ft_start_wait_s: a job's first step waits for every group, a bounded number of asks."""
    from titan_commopt.titan.common.replica_group import ReplicaGroupFT
    from titan_commopt.titan.config.fault_tolerance_keys import FtSettings

    monkeypatch.delenv(KILL_ENV, raising=False)
    manager = _Manager(sizes, step)
    ft = ReplicaGroupFT(FtSettings(enable=True, replica_id=0, group_size=2), manager=manager, start_wait_s=wait)
    ft.begin_step()
    ft.begin_step()  # within the step: nothing more
    assert (manager.asked, ft.quorum.size()) == (asked, size)


# ---- bad input ----
FT_ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "0"]


@pytest.mark.parametrize("cli, lighthouse, expected", [
    (["--fault_tolerance.enable", "--fault_tolerance.group_size", "0"], "http://127.0.0.1:29510",
     "[fault_tolerance] group_size = 0: with [fault_tolerance] enable = true it is the number of replica groups"),
    ([*FT_ON, "--fault_tolerance.replica_id", "2"], "http://127.0.0.1:29510",
     "[fault_tolerance] replica_id = 2: must be in 0..1 ([fault_tolerance] group_size = 2)"),
    ([*FT_ON, "--parallelism.data_parallel_replicate_degree", "2"], "http://127.0.0.1:29510",
     "[parallelism] data_parallel_replicate_degree = 2: with [fault_tolerance] enable = true the replicas are the "
     "replica groups"),
    (FT_ON, None, "[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE is not set: every replica group"),
    (FT_ON, "127.0.0.1", "[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE = '127.0.0.1': not an address"),
    ([*FT_ON, "--optimizer.name", "DiLoCo", "--commopt.local.merge", "eager", "--commopt.local.sync_delay", "0"],
     "http://127.0.0.1:29510",
     "[validation] enable = true with [optimizer] name = 'DiLoCo' under [fault_tolerance] enable = true: its global "
     "model between syncs is the mean of the replica groups' anchors"),
])
def test_bad_fault_tolerance_setting_is_one_line(monkeypatch, cli, lighthouse, expected):
    from titan_commopt.options import ConfigError
    from titan_commopt.train import check_config

    if lighthouse is None:
        monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    else:
        monkeypatch.setenv(LIGHTHOUSE_ENV, lighthouse)
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), *cli], world_size=2)
    assert str(info.value).splitlines() == [line for line in str(info.value).splitlines() if line.strip()]
    (line,) = str(info.value).splitlines()
    assert line.startswith(expected), line


def test_bad_lighthouse_wait_is_one_line(monkeypatch):
    from titan_commopt.options import ConfigError
    from titan_commopt.train import check_config

    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://127.0.0.1:29510")
    monkeypatch.setenv(LIGHTHOUSE_WAIT_ENV, "0")
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), *FT_ON], world_size=2)
    (line,) = str(info.value).splitlines()
    assert line.startswith("TITAN_COMMOPT_LIGHTHOUSE_WAIT_S = '0': the seconds a launch waits"), line


def _launch(env: dict, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """One replica group's launch, ``TORCHFT_LIGHTHOUSE`` only as ``env`` says."""
    full = {k: v for k, v in os.environ.items() if k not in (LIGHTHOUSE_ENV, "TITAN_COMMOPT_TRACEBACK")}
    full.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", "titan_commopt.run", f"--nproc_per_node={nproc}", "--master_port", str(free_port()),
         "-m", "titan_commopt.train", "--job.config_file", str(CONFIG), *TINY, *args],
        cwd=ROOT, env=full, capture_output=True, text=True, timeout=START_S)


def _our_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines titan_commopt printed, once the launch ended with status 2 and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("titan_commopt: ")]


def test_launcher_refuses_bad_fault_tolerance_keys_before_any_worker():
    proc = _launch({}, *FT_ON, "--fault_tolerance.replica_id", "2", "--parallelism.data_parallel_replicate_degree", "2",
                   nproc=2)
    lines = _our_lines(proc)
    assert len(lines) == 3, lines
    for line, start in zip(lines, ["[fault_tolerance] replica_id = 2: ",
                                   "[parallelism] data_parallel_replicate_degree = 2: ",
                                   "[fault_tolerance] enable = true: TORCHFT_LIGHTHOUSE is not set: "]):
        assert line.startswith("titan_commopt: bad config: " + start), line
    assert "Starting job" not in proc.stdout + proc.stderr  # no worker started


def test_unreachable_lighthouse_is_one_line_after_a_bounded_wait(tmp_path):
    """Nothing listens at TORCHFT_LIGHTHOUSE: the group waits (here 2 s, TITAN_COMMOPT_LIGHTHOUSE_WAIT_S;
    30 s by default), says what it waited for, and stops with one line, exit status 2."""
    url = f"http://127.0.0.1:{free_port()}"
    proc = _launch({LIGHTHOUSE_ENV: url, LIGHTHOUSE_WAIT_ENV: "2"},
                   *FT_ON, "--job.dump_folder", str(tmp_path))
    (line,) = _our_lines(proc)
    assert line.startswith(f"titan_commopt: fault tolerance: TORCHFT_LIGHTHOUSE = {url}: no torchft lighthouse "
                           "answered there within 2 s"), line
    assert f"waits up to 2 s for the torchft lighthouse at {url}" in proc.stdout + proc.stderr


def test_a_stalled_group_leaves_and_the_other_goes_on(tmp_path):
    """Group 1 hangs at step 4, alive and heartbeating (torchft's lighthouse would wait for it forever):
    past [commopt] ft_stall_timeout_s it leaves with one line, exit status 1; group 0 undoes that step
    and trains to the end alone."""
    steps, stall_at = 10, 4
    args = [*TINY, "--optimizer.name", "FlexDeMo", "--training.steps", str(steps), "--commopt.ft_stall_timeout_s", "4"]
    with FtJob(tmp_path, args, nproc=1, launcher=False) as job:
        survivor, stalled = job.start(env={1: {KILL_ENV: f"{stall_at}:stall"}})
        assert stalled.wait(RUN_S) == 1, stalled.tail()
        assert "replica group 1 stalled: a step ran past [commopt] ft_stall_timeout_s = 4 s" in stalled.text()
        (log,) = job.finish([survivor])
    assert log.not_committed[0] == [stall_at]
    assert log.quorums[0][0] == (2, 0, 0) and log.quorums[0][-1] == (1, 0, stall_at - 1)
    assert sorted(log.loss_by_step()) == list(range(1, steps + 1))


def test_a_lighthouse_that_never_forms_a_quorum_is_one_line_after_the_quorum_timeout(tmp_path):
    """A lighthouse that wants 3 groups, one group: it waits TORCHFT_QUORUM_TIMEOUT_SEC, then one line,
    exit status 1, naming the lighthouse and the timeout."""
    port = free_port()
    lighthouse = subprocess.Popen([str(LIGHTHOUSE_BIN), "--min_replicas", "3", "--bind", f"127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "TORCHFT_QUORUM_TIMEOUT_SEC": "5",
               "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.pop(KILL_ENV, None)
        out = subprocess.run(
            [sys.executable, "-m", "titan_commopt.train", "--job.config_file", str(CONFIG), *TINY,
             "--optimizer.name", "FlexDeMo", "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out"),
             "--metrics.enable_tensorboard", "false", "--fault_tolerance.enable", "--fault_tolerance.replica_id", "0",
             "--fault_tolerance.group_size", "2", "--commopt.ft_start_wait_s", "0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_S)
    finally:
        lighthouse.kill()
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    lines = [line for line in text.splitlines() if "got no quorum from the lighthouse" in line]
    assert lines and re.search(rf"at http://127.0.0.1:{port} within 5 s", lines[0]), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
