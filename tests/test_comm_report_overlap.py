"""The comm report's overlap model: what of an R sync hides behind compute, and the predicted mean step.

``predict_step`` against hand-computed cases (compute T = 1 s per step unless said); then the windows
the report reads from the resolved options (presets and ``--set``), on cpu_tiny at 1 Mbit/s, where a
whole fp32 shard takes seconds on the wire.
"""

import pytest

from scripts import comm_report
from scripts.comm_report import Sync, predict_step


def test_blocking_sync_is_exposed_whole():
    # DiLoCo, H = 30, blocking: the 10 s sync adds 10 s once per 30 steps.
    m = predict_step(1.0, 30, [Sync(10.0, 0)])
    assert m["exposed_s"] == [10.0]
    assert m["mean_step_s"] == pytest.approx(1 + 10 / 30)
    assert m["floor_s"] == 1.0 and m["ratio"] == pytest.approx(1 + 10 / 30)


def test_sync_delay_hides_tau_steps():
    m = predict_step(1.0, 30, [Sync(10.0, 1)])  # τ = 1
    assert m["exposed_s"] == [9.0] and m["mean_step_s"] == pytest.approx(1 + 9 / 30)


def test_delayed_or_eager_hides_a_sync_that_fits_its_period():
    m = predict_step(1.0, 30, [Sync(10.0, 30)])  # in flight over the whole next period: 30 s
    assert m["exposed_s"] == [0.0] and m["mean_step_s"] == 1.0 and m["ratio"] == 1.0
    # 45 s > 30 s: the next sync waits 15 s for this one, the link never idles: 45/30 s per step
    m = predict_step(1.0, 30, [Sync(45.0, 30)])
    assert m["exposed_s"] == [15.0] and m["mean_step_s"] == pytest.approx(1.5) == m["link_s_step"]
    assert m["ratio"] == pytest.approx(1.0)


def test_fragments_each_hide_behind_their_own_window():
    # F = 2, τ = 2, H = 30: two syncs of 5 s per period, each exposed 5 − 2 = 3 s.
    m = predict_step(1.0, 30, [Sync(5.0, 2, per_cycle=2)])
    assert m["exposed_s"] == [3.0] and m["exposed_s_step"] == pytest.approx(6 / 30)
    assert m["mean_step_s"] == pytest.approx(1.2) and m["link_s_step"] == pytest.approx(10 / 30)


@pytest.mark.parametrize("wire, overlap, mean, ratio", [
    (0.4, False, 1.4, 1.4),        # every step waits for its all-gather
    (0.4, True, 1.0, 1.0),         # hidden behind the next step's compute
    (1.5, False, 2.5, 2.5 / 1.5),  # the link is the floor, and still the step waits it out
    (1.5, True, 1.5, 1.0),         # exposed 0.5 s a step: the link's pace
])
def test_demo_with_and_without_overlap(wire, overlap, mean, ratio):
    m = predict_step(1.0, 1, [Sync(wire, int(overlap))])
    assert m["mean_step_s"] == pytest.approx(mean) and m["ratio"] == pytest.approx(ratio)


def test_a_link_so_slow_it_is_the_floor():
    # H = 30, a 300 s sync: the link needs 10 s per step whatever the schedule.
    blocking = predict_step(1.0, 30, [Sync(300.0, 0)])
    assert blocking["floor_s"] == pytest.approx(10.0) and blocking["mean_step_s"] == pytest.approx(11.0)
    assert blocking["ratio"] == pytest.approx(1.1)
    eager = predict_step(1.0, 30, [Sync(300.0, 30)])
    assert eager["mean_step_s"] == pytest.approx(10.0) and eager["ratio"] == pytest.approx(1.0)


def test_syncs_that_would_share_the_link_never_beat_it():
    # Two syncs per step, each within its window alone, together 1.6 s of link per 1 s step.
    m = predict_step(1.0, 1, [Sync(0.8, 1, per_cycle=2)])
    assert m["exposed_s_step"] == 0.0 and m["mean_step_s"] == pytest.approx(1.6) and m["ratio"] == pytest.approx(1.0)


T = 0.5
LINK = 1e6  # 1 Mbit/s


def _row(name, overrides=None):
    (row,) = comm_report.report("cpu_tiny", 2, 2, [name], overrides or {}, link_bps=LINK, step_s=T)
    return row


BLOCKING = {"fragments": 1, "sync_delay": 0, "merge": "additive"}  # DiLoCo as its 2023 paper runs it


@pytest.mark.parametrize("overrides, window", [
    ({}, 0),                                             # the paper's blocking sync
    ({"sync_delay": 1}, 1),
    ({"merge": "eager"}, 32),                            # Kx
    ({"merge": "delayed"}, 32),
    ({"merge": "lerp", "merge_alpha": 0.5}, 0),          # lerp at τ = 0 lands at once
])
def test_diloco_window_comes_from_the_resolved_options(overrides, window):
    row = _row("DiLoCo", {"local": {**BLOCKING, **overrides}})
    o, wire = row["overlap"], row["R_seconds_sync"]
    assert o["cycle_steps"] == 32 and o["syncs_per_cycle"] == 1 and o["sync_wire_s"] == pytest.approx(wire)
    assert o["sync_window_steps"] == window and o["sync_window_s"] == pytest.approx(window * T)
    exposed = max(0.0, wire - window * T)
    assert o["sync_exposed_s"] == pytest.approx(exposed)
    assert o["mean_step_s"] == pytest.approx(max(T + exposed / 32, row["R_seconds_step"]))
    assert o["link_s_step"] == pytest.approx(row["R_seconds_step"])


def test_the_diloco_preset_streams_two_fragments_of_cpu_tiny_each_hidden_one_step():
    """The preset (Streaming DiLoCo's fragments of 3 blocks, at least 2; τ = 1): cpu_tiny's 2 blocks make 2
    fragments, each in flight one step: T of its wire hidden."""
    row = _row("DiLoCo")
    o = row["overlap"]
    assert o["cycle_steps"] == 32 and o["syncs_per_cycle"] == 2 and o["sync_window_steps"] == 1
    assert o["sync_wire_s"] < row["R_seconds_sync"]  # a fragment's burst, not the model's
    blocking = _row("DiLoCo", {"local": BLOCKING})["overlap"]
    assert o["mean_step_s"] < blocking["mean_step_s"]


def test_fragments_are_synced_apart_each_with_its_window():
    overrides = {"local": {"fragments": 2, "sync_delay": 2}}
    row = _row("DiLoCo", overrides)
    steps, cycle = comm_report.sync_cycle(comm_report.resolved_of("DiLoCo", overrides),
                                          comm_report._shards(comm_report.param_shapes("cpu_tiny"), 2), 2,
                                          None)
    assert steps == 32 and sorted(w for _, w, _ in cycle) == [2, 2] and [c for _, _, c in cycle] == [1, 1]
    assert sum(b.sent for b, _, _ in cycle) == pytest.approx(row["R_sent_sync"])  # the fragments make one shard
    wires = [comm_report.wire_seconds(b.sent, b.recv, 2, LINK) for b, _, _ in cycle]
    assert max(wires) < row["R_seconds_sync"]
    o = row["overlap"]
    assert o["syncs_per_cycle"] == 2 and o["sync_wire_s"] == pytest.approx(max(wires))
    assert o["mean_step_s"] == pytest.approx(T + sum(max(0.0, w - 2 * T) for w in wires) / 32)


def test_schedule_due_steps_are_the_updates_where_something_is_due():
    from titan_commopt.optim.local.sync import Periods, SyncSchedule

    schedule = SyncSchedule(Periods(Kx=6, Ku=(9,), Kv=0), [5, 4, 3, 2], fragments=4)
    assert schedule.due_steps(200) == [n for n in range(1, 201) if schedule.due(n)]


def test_eager_des_loc_waits_at_the_next_sync_of_any_state_it_carries():
    o = _row("DES-LOC", {"local": {"merge": "eager"}})["overlap"]
    # x every 32, u every 96, v every 192: every sync carries x, so each is due again 32 steps on.
    assert o["cycle_steps"] == 192 and o["syncs_per_cycle"] == 6 and o["sync_window_steps"] == 32


@pytest.mark.parametrize("name, overrides, window", [
    ("DeMo", {}, 0), ("DeMo", {"demo": {"overlap": True}}, 1), ("FlexDeMo", {"demo": {"overlap": True}}, 1),
    ("SparseLoCo", {}, 0), ("SparseLoCo", {"sparseloco": {"sync_delay": 3}}, 3),
    ("SparseLoCo", {"sparseloco": {"merge": "eager"}}, 30), ("Dion", {}, 0), ("AdamW", {}, 0),
])
def test_every_family_s_window(name, overrides, window):
    assert _row(name, overrides)["overlap"]["sync_window_steps"] == window


def test_link_per_step_is_the_mean_wire_time():
    for row in comm_report.report("cpu_tiny", 2, 2, ["AdamW", "DES-LOC", "DeMo", "DiLoCo", "SparseLoCo"],
                                  link_bps=LINK, step_s=T):
        assert row["overlap"]["link_s_step"] == pytest.approx(row["R_seconds_step"]), row["optimizer"]


def test_cli_prints_the_model_and_set_changes_it(capsys):
    args = ["--flavor", "cpu_tiny", "--shard", "2", "--optimizers", "DiLoCo", "--link", "1mbit",
            "--step-seconds", "0.5"]
    assert comm_report.main(args) == 0
    out = capsys.readouterr().out
    assert "exposed      = max(0, w − k·T)" in out and "mean step    = max(T + Σ c·exposed ÷ P, link)" in out
    assert "| DiLoCo | 2 per 32 steps | 2.95 s | 1 × T = 500 ms | 2.45 s |" in out, out  # the preset streams
    assert comm_report.main(args + ["--set", "local.merge=additive", "local.sync_delay=0", "local.fragments=1"]) == 0
    assert "| DiLoCo | 1 per 32 steps | 3.81 s | 0 × T = 0 s | 3.81 s |" in capsys.readouterr().out
    assert comm_report.main(args + ["--set", "local.merge=eager", "local.sync_delay=0", "local.fragments=1"]) == 0
    assert "| DiLoCo | 1 per 32 steps | 3.81 s | 32 × T = 16 s | 0 s | 0 s |" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--link", "1gbit", "--step-seconds", "0"], "--step-seconds '0': allowed is the compute seconds"),
    (["--link", "1gbit", "--step-seconds", "-1.5"], "--step-seconds '-1.5': allowed is the compute seconds"),
    (["--link", "1gbit", "--step-seconds", "fast"], "--step-seconds 'fast': allowed is the compute seconds"),
    (["--step-seconds", "1.5"], "--step-seconds 1.5: needs --link RATE"),
    (["--link", "1gbit", "--step-seconds", "projected"], "--step-seconds projected: only with --flavor 8B"),
])
def test_bad_step_seconds_is_one_line_exit_2(capsys, args, expected):
    assert comm_report.main(["--flavor", "cpu_tiny", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and expected in lines[0], err


def test_projected_step_is_the_projection_s_forward_backward():
    from scripts.project_time_to_loss import forward_backward_s

    assert comm_report.step_seconds("projected", "8B") == forward_backward_s() == pytest.approx(8192 / 5762)
