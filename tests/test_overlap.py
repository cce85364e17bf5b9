"""The overlap runtime (titan_commopt/overlap.py): the order it issues, waits and resumes in."""

import pytest
import torch

from titan_commopt import comm
from titan_commopt.comm import Pending
from titan_commopt.overlap import Runtime


class _Work:
    """A stand-in for an async collective's work handle: logs when it is waited for."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _collective(log: list, name: str, result=None) -> Pending:
    log.append(f"issue {name}")
    return Pending(_Work(log, name), lambda: result if result is not None else name, None)


def _task(log: list, name: str, rounds: int):
    for i in range(rounds):
        log.append(f"compute {name}{i}")
        got = yield _collective(log, f"{name}{i}")
        log.append(f"got {got}")


def test_run_is_round_robin_issuing_every_first_collective_before_any_wait():
    log: list = []
    Runtime().run(_task(log, "a", 2), _task(log, "b", 1))
    assert log == [
        "compute a0", "issue a0", "compute b0", "issue b0",
        "wait a0", "got a0", "compute a1", "issue a1",
        "wait b0", "got b0",
        "wait a1", "got a1",
    ]


def test_a_list_of_pendings_comes_back_as_a_list_of_results():
    log: list = []
    seen = []

    def task():
        seen.append((yield [_collective(log, "x", 1), _collective(log, "y", 2)]))

    Runtime().run(task())
    assert seen == [[1, 2]] and log == ["issue x", "issue y", "wait x", "wait y"]


def test_yield_none_gives_way_without_waiting():
    log: list = []

    def task(name):
        log.append(f"{name} before")
        yield None
        log.append(f"{name} after")

    Runtime().run(task("a"), task("b"))
    assert log == ["a before", "b before", "a after", "b after"]


def test_parked_tasks_complete_when_due_in_start_order():
    log: list = []
    rt = Runtime()
    rt.start(_task(log, "late", 1), due=3)
    rt.start(_task(log, "early", 1), due=2)
    assert rt.in_flight == 2 and rt.next_due() == 2
    assert log == ["compute late0", "issue late0", "compute early0", "issue early0"]
    rt.advance(1)
    assert rt.in_flight == 2 and len(log) == 4
    rt.advance(2)
    assert log[4:] == ["wait early0", "got early0"] and rt.in_flight == 1
    rt.advance(5)
    assert log[6:] == ["wait late0", "got late0"] and rt.in_flight == 0 and rt.next_due() is None


def test_advance_completes_tasks_that_yield_again_after_resuming():
    log: list = []
    rt = Runtime()
    rt.start(_task(log, "a", 3), due=1)
    rt.advance(1)
    assert log.count("got a2") == 1 and rt.in_flight == 0


def test_drain_finishes_everything_and_abandon_waits_without_resuming():
    log: list = []
    rt = Runtime()
    rt.start(_task(log, "a", 1), due=10)
    rt.drain()
    assert log[-1] == "got a0" and rt.in_flight == 0
    log.clear()
    rt.start(_task(log, "b", 2), due=10)
    rt.abandon()
    assert log == ["compute b0", "issue b0", "wait b0"] and rt.in_flight == 0


def test_a_task_without_collectives_runs_to_completion_at_start():
    log: list = []

    def task():
        log.append("done")
        return
        yield  # noqa: unreachable: makes this a generator

    rt = Runtime()
    rt.start(task(), due=5)
    assert log == ["done"] and rt.in_flight == 0


def test_an_error_inside_a_task_reaches_the_caller():
    def task():
        yield None
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Runtime().run(task())


def test_fail_drops_the_tasks_of_other_epochs_and_hands_back_their_records():
    """Live fault tolerance: a task belongs to the epoch (the quorum) it was started in; ``fail(epoch)``
    drops the others (their collectives waited for, not resumed) and returns their records; records
    ``adopt``-ed from a peer (a heal: no collective here) fail whatever the epoch."""
    log: list = []
    rt = Runtime()
    rt.epoch = 1
    rt.start(_task(log, "a", 1), due=10, record="a")
    rt.epoch = 2
    rt.start(_task(log, "b", 1), due=10, record="b")
    assert rt.records() == [(1, 10, "a"), (2, 10, "b")]
    log.clear()
    assert rt.fail(2) == ["a"] and log == ["wait a0"] and rt.in_flight == 1
    healed = Runtime()
    healed.adopt(rt.records())
    assert healed.in_flight == 1 and healed.fail(2) == ["b"] and healed.in_flight == 0
    rt.advance(10)
    assert log[-1] == "got b0" and rt.in_flight == 0


def test_drop_waits_for_a_collective_without_its_result_and_swallows_its_error():
    """``Pending.drop``: a sync that can no longer land waits for its collectives (the parts of a
    composite one too) without running their result code; an error (a peer gone) is not raised."""
    class Failing:
        def wait(self) -> None:
            raise RuntimeError("connection closed by peer")

    finished: list = []
    inner = Pending(Failing(), lambda: finished.append("inner"), None)
    outer = Pending(None, lambda: finished.append("outer"), None, parts=(inner,))
    outer.drop()
    outer.drop()
    assert finished == [] and outer.wait() is None


def _counted(log: list, ledger: comm.CommLedger, name: str) -> Pending:
    """A collective through comm's own issue path (counted, launched or deferred as comm decides)."""
    log.append(f"issue {name}")

    def launch(async_op: bool) -> _Work:
        log.append(f"launch {name}")
        return _Work(log, name)

    return comm._issue(ledger, "R", "all_reduce_sum", 4, 4, torch.device("cpu"), launch, lambda: name, True)


def _counted_task(log: list, ledger: comm.CommLedger, name: str):
    got = yield _counted(log, ledger, name)
    log.append(f"got {got}")


def _deferring() -> tuple[list, comm.CommLedger, Runtime]:
    rt = Runtime()
    rt.defers_launch = True
    return [], comm.CommLedger(), rt


def test_a_deferred_start_counts_now_and_launches_at_launch_in_issue_order():
    """``defers_launch``: a parked task's collective is counted in the step that starts it and goes
    on the wire at ``launch()`` (the container's zero_grad, after torchtitan's log collectives), in
    the order the tasks were started; a task the step completes itself (``within_step``) at once."""
    log, ledger, rt = _deferring()
    rt.start(_counted_task(log, ledger, "a"), due=2)
    rt.start(_counted_task(log, ledger, "b"), due=1)
    assert log == ["issue a", "issue b"] and rt.unlaunched == 2
    assert ledger.current()["R_sent"] == 8 and ledger.current().get("R_seconds", 0.0) == 0.0
    log.append("the log step's all-reduce")
    rt.launch()
    assert log[3:] == ["launch a", "launch b"] and rt.unlaunched == 0
    rt.launch()  # nothing twice
    rt.start(_counted_task(log, ledger, "c"), due=2)
    rt.start(_counted_task(log, ledger, "now"), due=0, within_step=True)
    assert log[5:] == ["issue c", "issue now", "launch now"] and rt.unlaunched == 1
    rt.advance(1)  # b (and the within-step task) land; c, started in this step, stays for launch()
    assert log[8:] == ["wait b", "got b", "wait now", "got now"] and rt.unlaunched == 1
    rt.drain()  # launches what is left first, then completes in start order
    assert log[12:] == ["launch c", "wait a", "got a", "wait c", "got c"] and rt.in_flight == 0
    assert ledger.current()["R_sent"] == 16


def test_whatever_completes_or_drops_a_deferred_task_first_launches_its_collective():
    """Before ``launch()`` comes: the task's own wait (``advance`` once it is due), ``abandon`` (a load,
    an undone step), ``fail`` (a sync of another quorum) put it on the wire; none is left unsent, so
    the ranks' process groups stay in step."""
    log, ledger, rt = _deferring()
    rt.start(_counted_task(log, ledger, "w"), due=1)
    rt.advance(1)
    assert log == ["issue w", "launch w", "wait w", "got w"] and rt.unlaunched == 0
    log.clear()
    rt.start(_counted_task(log, ledger, "x"), due=5)
    rt.start(_counted_task(log, ledger, "y"), due=5)
    rt.abandon()
    assert log == ["issue x", "issue y", "launch x", "launch y", "wait x", "wait y"] and rt.in_flight == 0
    log.clear()
    rt.start(_counted_task(log, ledger, "z"), due=5, record="r")
    assert rt.fail(epoch="another") == ["r"]
    assert log == ["issue z", "launch z", "wait z"]
    with comm.deferred([]):  # a synchronous collective inside a deferred scope is launched at once
        log.clear()
        assert comm._issue(ledger, "R", "all_reduce_sum", 4, 4, torch.device("cpu"),
                           lambda a: log.append("launch sync"), lambda: "done", False) == "done"
        assert log == ["launch sync"]
