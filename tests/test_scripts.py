"""The benchmark scripts run end to end on tiny settings, and the comm report equals the ledger.

The comm-report check launches real 2 x 2 (|R| = 2 replicas x |S| = 2 FSDP shards) CPU runs of the
cpu_tiny flavor through ``titan_commopt.train`` and compares ``comm/R_sent_bytes_total`` /
``comm/S_bytes_total`` (what rank 0's ledger counted over the run, read back from TensorBoard)
with ``scripts/comm_report.py``'s numbers for the same flavor, mesh and family options.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import comm_report
from scripts._bench_common import ROOT

# The comm report's per-step formulas equal the ledger of real runs: tests/test_titan_optimizers.py
# (every family on 2 x 2 HSDP) and tests/test_titan_integration.py (AdamW) check it on their launches.


def test_comm_report_cli_and_png(tmp_path):
    png = tmp_path / "r.png"
    out = subprocess.run(
        [sys.executable, "scripts/comm_report.py", "--flavor", "debugmodel", "--replicate", "2", "--shard", "4", "--png", str(png)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "| AdamW |" in out and png.stat().st_size > 1000
    rows = {r["optimizer"]: r for r in comm_report.report("debugmodel", 2, 4)}
    assert rows["AdamW"]["vs_adamw_hsdp"] == pytest.approx(1.0)
    assert rows["AdamW"]["vs_adamw_ddp"] == pytest.approx(4.0, rel=0.02)  # shards hold ~1/4 of each tensor


# Periods that all divide SYNC_STEPS: DES-LOC's x, u, v first coincide after update 8, DeMo's diloco
# replicator sends the whole shard every 4 updates.
BURST_OVERRIDES = {"local": {"Kx": 2, "Ku": [4], "Kv": 8}, "demo": {"replicator": "diloco", "compression_rate": 0.25}}
# the same DES-LOC with x's pseudo-gradients on the FP4 wire (all-gathered codes and scales)
FP4_OVERRIDES = {"local": dict(BURST_OVERRIDES["local"], outer_wire_dtype="fp4")}
SYNC_STEPS = 8


def _named(name):
    """(optimizer name, overrides) of a row of the burst checks."""
    return name.split()[0], FP4_OVERRIDES if name.endswith("fp4") else BURST_OVERRIDES


def _ledger_per_step(rank, world):
    """R bytes each step of DES-LOC and DeMo (diloco) record on 2 real replicas (cpu_tiny, |S| = 1)."""
    import torch
    import torch.distributed as dist

    from titan_commopt import comm
    from titan_commopt.optim import make
    from titan_commopt.topology import Topology

    from scripts._bench_common import param_shapes

    out = {}
    for name in ("DES-LOC", "DeMo", "DES-LOC fp4"):
        params = [(fqn, torch.zeros(shape, requires_grad=True)) for fqn, shape in param_shapes("cpu_tiny")]
        ledger = comm.CommLedger()
        optimizer, overrides = _named(name)
        family = "local" if optimizer == "DES-LOC" else "demo"
        opt = make(optimizer, params, Topology(replicate=dist.group.WORLD), ledger=ledger, **overrides[family])
        g = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(SYNC_STEPS):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            step = ledger.end_step()
            steps.append((step.get("R_sent", 0.0), step.get("R_recv", 0.0)))
        out[name] = steps
    return out


@pytest.fixture(scope="module")
def ledger_per_step():
    from tests.dist_utils import run_distributed

    return run_distributed(_ledger_per_step, 2)[0]


@pytest.mark.parametrize("name, horizon, sync_at", [
    ("DES-LOC", None, 8),  # x, u and v after update 8
    ("DES-LOC", 7, 4),  # x and u after update 4: the largest step within 7 updates
    ("DeMo", None, 4),
    ("DES-LOC fp4", None, 8),
])
def test_comm_report_burst_is_the_ledger_at_a_sync_step(ledger_per_step, name, horizon, sync_at):
    optimizer, overrides = _named(name)
    (row,) = comm_report.report("cpu_tiny", 2, 1, [optimizer], overrides, horizon=horizon)
    steps = ledger_per_step[name]
    assert row["sync_at_update"] == sync_at
    assert (row["R_sent_sync"], row["R_recv_sync"]) == steps[sync_at - 1]
    assert row["R_sent_sync"] == max(sent for sent, _ in steps[:horizon or SYNC_STEPS]) > row["R_sent"]
    assert sum(sent for sent, _ in steps) / SYNC_STEPS == pytest.approx(row["R_sent"], rel=1e-9)


def test_comm_report_burst_of_every_step_optimizers_is_the_mean():
    for row in comm_report.report("cpu_tiny", 2, 2, ["AdamW", "DeMo", "FlexDeMo", "Dion"]):
        assert row["sync_at_update"] == 1 and row["R_sent_sync"] == row["R_sent"], row
    (never,) = comm_report.report("cpu_tiny", 2, 2, ["DiLoCo"], {"local": {"Kx": 0}})
    assert never["sync_at_update"] == 0 and never["R_sent_sync"] == never["R_sent"] == 0
    (streamed,) = comm_report.report("cpu_tiny", 2, 2, ["LocalAdam"], {"local": {"fragments": 4}})
    assert streamed["sync_is_upper_bound"] and streamed["R_sent_sync"] == pytest.approx(32 * streamed["R_sent"])


def test_comm_report_shows_the_resolved_settings_behind_each_row(capsys):
    rows = {r["optimizer"]: r["settings"] for r in comm_report.report(
        "cpu_tiny", 2, 2, ["AdamW", "DES-LOC", "FlexDeMo", "Dion"], {"local": {"Ku": ["auto"]}})}
    assert rows["DES-LOC"] == {"Kx": 32, "Ku": [8], "Kv": 192, "transfer_dtype": "fp32"}  # Ku auto: β1 0.9's half-life
    assert rows["FlexDeMo"] == {"replicator": "demo", "chunk": 32, "topk": 32, "sign_before_sync": True, "pack": True,
                                 "wire": "compact"}
    assert rows["Dion"] == {"rank_fraction": 0.25, "compress": "auto", "scalar_sync": "dense"}
    assert rows["AdamW"] == {"gradient_all_reduce": "float32"}
    assert comm_report.main(["--flavor", "cpu_tiny", "--optimizers", "DES-LOC", "--set", "local.Ku=['auto']"]) == 0
    assert "| DES-LOC | Kx=32 Ku=[8] Kv=192 transfer_dtype=fp32 |" in capsys.readouterr().out


@pytest.mark.parametrize("text, bps", [("10mbit", 1e7), ("100mbit", 1e8), ("1gbit", 1e9), ("100gbit", 1e11),
                                       ("400gbit", 4e11), ("2.5Gbit", 2.5e9)])
def test_parse_link(text, bps):
    assert comm_report.parse_link(text) == bps


def test_comm_report_link_time_per_step_and_per_sync(capsys):
    two = {r["optimizer"]: r for r in comm_report.report("cpu_tiny", 2, 2, ["AdamW", "DiLoCo"], link_bps=1e9)}
    for r in two.values():  # W = 2: an all-reduce of n moves n each way
        assert r["R_seconds_step"] == pytest.approx(r["R_sent"] * 8 / 1e9)
        assert r["R_seconds_sync"] == pytest.approx(r["R_sent_sync"] * 8 / 1e9)
    assert two["DiLoCo"]["R_seconds_sync"] == pytest.approx(32 * two["DiLoCo"]["R_seconds_step"])
    four = {r["optimizer"]: r for r in comm_report.report("cpu_tiny", 4, 1, ["AdamW", "DeMo"], link_bps=1e9,
                                                          ranks_per_link=2)}
    adamw, demo = four["AdamW"], four["DeMo"]
    assert adamw["R_seconds_step"] == pytest.approx(2 * 3 / 4 * adamw["R_sent"] * 8 * 2 / 1e9)  # ring all-reduce
    assert demo["R_recv"] == 3 * demo["R_sent"]
    assert demo["R_seconds_step"] == pytest.approx(3 * demo["R_sent"] * 8 * 2 / 1e9)  # all-gather: (W-1)·n
    assert comm_report.main(["--flavor", "cpu_tiny", "--optimizers", "DiLoCo", "--link", "1gbit"]) == 0
    out = capsys.readouterr().out
    assert "time = wire bytes per rank × 8 / 1gbit" in out and "wire = 2·(W−1)/W·n" in out
    assert "| DiLoCo | 29.0 KiB | 0.238 ms | ≤ 929.2 KiB | ≤ 7.61 ms |" in out, out  # fragments: a burst's bound


def test_step_overhead_runs():
    out = subprocess.run(
        [sys.executable, "scripts/step_overhead.py", "--flavors", "cpu_tiny", "--repeats", "1", "--optimizers", "AdamW", "DeMo"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "| cpu_tiny (0.2M) | DeMo |" in out


def test_step_overhead_shards_over_s_and_muon_exchanges_there():
    out = subprocess.run(
        [sys.executable, "scripts/step_overhead.py", "--flavors", "cpu_tiny", "--repeats", "1", "--replicas", "1",
         "--shard", "2", "--optimizers", "AdamW", "Muon"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "|R| = 1 × |S| = 2 (FSDP2) processes" in out and "S sent / step" in out
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| cpu_tiny")}
    assert rows["AdamW"][-1] == "0 B" and rows["Muon"][-1] != "0 B"  # Muon gathers its matrices to owners


def test_muon_step_projection_counts_by_hand():
    from scripts import muon_step_projection as projection

    # shard 2, one iteration: the (4, 8) batch's items go to ranks 0, 1; (8, 4) (another batch, base 2) to
    # rank 0; (2, 8) (base 3) to rank 1. 4 × 8: 4·4²·8 + 2·4³ = 640 flops, as 8 × 4; 2 × 8: 4·2²·8 + 2·2³ = 144.
    matrices = [("a", (4, 8)), ("b", (8, 4)), ("c", (4, 8)), ("d", (2, 8))]
    assert projection.rank_flops(matrices, 2, 1) == [640 + 640, 640 + 144]
    assert projection.rank_flops(matrices, 1, 1) == [3 * 640 + 144]
    # a stack of 3 (4 × 8) matrices, split 2 + 1 along the stack dim: each rank its own slices
    assert projection.rank_flops([("experts", (3, 4, 8))], 2, 1) == [2 * 640, 640]
    # llama3 8B: per layer wq, wo 4096², wk, wv 1024 × 4096, w1, w3 14336 × 4096, w2 4096 × 14336; 5 iterations
    square, kv, ffn = 6 * 4096**3, 4 * 1024**2 * 4096 + 2 * 1024**3, 4 * 4096**2 * 14336 + 2 * 4096**3
    p = projection.projection("8B", shard=8)
    assert p["total_flops"] == 32 * 5 * (2 * square + 2 * kv + 3 * ffn) == 665_891_729_571_840
    assert p["rank_flops"] == [p["total_flops"] // 8] * 8  # 64, 64, 64 and 32 matrices per shape: an even share
    assert p["fwd_bwd_flops"] == 6 * p["params"] * 8192
    assert projection.main(["--flavor", "cpu_tiny", "--shard", "2"]) == 0


def test_bench_transaction_runs():
    out = subprocess.run(
        [sys.executable, "scripts/bench_transaction.py", "--flavors", "cpu_tiny", "--names", "FlexDeMo", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "| cpu_tiny | FlexDeMo |" in out


def test_train_each_runs_every_name_and_reports_a_failure(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/train_each.py", "--nproc", "2", "--steps", "2", "--optimizers", "DeMo", "Nope",
         "--out", str(tmp_path), "--", "--model.flavor", "cpu_tiny", "--parallelism.data_parallel_replicate_degree", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]  # one run failed
    rows = {line.split(" | ")[0].strip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    demo = [cell.strip() for cell in rows["DeMo"].strip("|").split("|")]
    assert 0 < float(demo[2]) < 20 and demo[5].endswith("KiB"), rows["DeMo"]  # trained, sent R bytes
    assert "failed (exit 2)" in rows["Nope"] and "allowed" in rows["Nope"], rows["Nope"]
    assert (tmp_path / "DeMo.log").exists() and (tmp_path / "Nope.log").exists()


def test_bench_netns_runs_or_skips(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/bench_netns.py", "--rates", "100mbit", "--optimizers", "AdamW", "DeMo", "--flavor", "cpu_tiny",
         "--steps", "3", "--warmup", "1", "--timeout", "180", "--out", str(tmp_path),
         "--png", str(tmp_path / "steps.png"), "--json", str(tmp_path / "r.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc_ok(out)
    if out.stdout.startswith("SKIP:"):
        pytest.skip(out.stdout.strip())
    assert "| AdamW |" in out.stdout and "| DeMo |" in out.stdout, out.stdout + out.stderr[-3000:]
    assert (tmp_path / "steps.png").stat().st_size > 1000
    # What crossed the link in the measured window carries at least the ledger's payload, and not
    # much more (TCP/IP headers, the loss all-reduce of logging).
    for name, r in json.loads((tmp_path / "r.json").read_text())["runs"].items():
        for link in r["link_bytes_per_step"]:
            assert 0.95 * r["ledger_r_node_per_step"] <= link <= 1.5 * r["ledger_r_node_per_step"] + 16384, (name, r)
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tcb" not in leftover


def test_link_queue_probe_runs_or_skips():
    """A small message's round trip on the shaped link, idle and behind a bulk stream: behind it the
    round trip grows by the queue the bulk bytes fill (at 100 Mbit/s about 20 ms on this box, against
    under 0.1 ms idle)."""
    out = subprocess.run(
        [sys.executable, "scripts/link_queue_probe.py", "--rate", "100mbit", "--queues", "400ms", "--bulk-bytes", "2000000"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc_ok(out)
    if out.stdout.startswith("SKIP:"):
        pytest.skip(out.stdout.strip())
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 400ms"))
    idle, busy_median, busy_max = (float(cell) for cell in row.strip("|").split("|")[1:4])
    assert idle < 5 and busy_max > 10 * max(idle, 0.5), out.stdout
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tcb" not in leftover


def proc_ok(proc) -> bool:
    return proc.returncode == 0


@pytest.mark.parametrize("args, expected", [
    (["--optimizers", "Adamm"], "--optimizers 'Adamm': allowed is one of AdamW"),
    (["--set", "local.Kx=-1"], "--set: [commopt.local] Kx = -1: allowed is an integer >= 0"),
    (["--set", "demo.chnk=3"], "unknown key 'chnk'; did you mean 'chunk'?"),
    (["--set", "dem.chunk=3"], "unknown family or optimizer 'dem'; did you mean 'demo'?"),
    (["--set", "DiLoCoo.Kx=3"], "unknown family or optimizer 'DiLoCoo'; did you mean 'DiLoCo'?"),
    (["--set", "chunk=3"], "--set 'chunk=3': allowed is FAMILY.OPTION=VALUE or OPTIMIZER.OPTION=VALUE"),
    (["--flavor", "9B"], "--flavor '9B': allowed is one of debugmodel"),
    (["--replicate", "0"], "--replicate 0: allowed is an integer >= 1"),
    (["--shard", "-1"], "--shard -1: allowed is an integer >= 1"),
    (["--param-dtype", "bf16"], "argument --param-dtype: invalid choice: 'bf16'"),
    (["--link", "100gbps"], "--link '100gbps': allowed is a rate > 0 in bits per second such as 10mbit"),
    (["--link", "fast"], "--link 'fast': allowed is a rate > 0"),
    (["--link", "0gbit"], "--link '0gbit': allowed is a rate > 0"),
    (["--ranks-per-link", "0"], "--ranks-per-link 0: allowed is an integer >= 1"),
    (["--steps", "0"], "--steps 0: allowed is an integer >= 1"),
])
def test_comm_report_bad_argument_is_one_line_exit_2(capsys, args, expected):
    try:
        rc = comm_report.main(args)
    except SystemExit as exit_:  # argparse's own checks
        rc = exit_.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err


def test_set_of_one_optimizer_leaves_its_family_alone():
    from scripts._bench_common import cli_overrides, parse_overrides

    overrides = parse_overrides(["local.Kx=16", "DiLoCo.lr_scale=1", "DiLoCo.Kx=8"])
    assert cli_overrides("DiLoCo", overrides) == ["--commopt.local.Kx", "8", "--commopt.local.lr_scale", "1"]
    assert cli_overrides("DES-LOC", overrides) == ["--commopt.local.Kx", "16"]
    names = ["DiLoCo", "LocalAdam"]
    rows = {r["optimizer"]: r for r in comm_report.report("cpu_tiny", 2, 2, names, overrides)}
    plain = {r["optimizer"]: r for r in comm_report.report("cpu_tiny", 2, 2, names, parse_overrides(["local.Kx=16"]))}
    assert rows["DiLoCo"]["R_sent"] == pytest.approx(2 * plain["DiLoCo"]["R_sent"])
    assert rows["LocalAdam"]["R_sent"] == plain["LocalAdam"]["R_sent"]


def test_comm_report_param_dtype_changes_only_the_all_gathers():
    bf16, fp32 = (comm_report.report("cpu_tiny", 2, 2, ["AdamW", "DeMo"], param_dtype=d) for d in ("bfloat16", "float32"))
    for a, b in zip(bf16, fp32):
        assert a["R_sent"] == b["R_sent"] and a["S_sent"] < b["S_sent"]
    from titan_commopt.optim import ShardShape
    from scripts._bench_common import param_shapes

    shard_elements = sum(ShardShape.fsdp(n, s, 2).numel for n, s in param_shapes("cpu_tiny"))
    assert fp32[0]["S_sent"] - bf16[0]["S_sent"] == 2 * shard_elements * 2  # 2 all-gathers x 2 bytes saved per element


def test_convergence_rerun_reads_only_its_own_log_not_a_killed_run_s(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    from scripts import convergence

    def write_log(folder: Path, losses: list[float]):
        with SummaryWriter(str(folder)) as writer:
            for step, loss in enumerate(losses, 1):
                writer.add_scalar("loss_metrics/global_avg_loss", loss, step)

    where = convergence.Setting(2, 2, "cpu_tiny", 4, 16, "commopt_world", eval_every=1, eval_steps=1)
    dump = tmp_path / "runs" / convergence.run_folder("AdamW", 0.1, 42, where)
    write_log(dump / "tb" / "killed", [9.0, 8.0, 7.0])  # a run stopped at step 3, never recorded
    monkeypatch.setattr(convergence, "run_train", lambda dump, *args, **kw: write_log(dump / "tb" / "rerun", [4.0, 3.0, 2.0, 1.0]))
    run = convergence.run_one("AdamW", 0.1, 42, where, tmp_path, {})
    assert run["steps"] == [1, 2, 3, 4] and run["loss"] == [4.0, 3.0, 2.0, 1.0]


def test_project_time_to_loss_prints_every_assumption_and_refuses_a_missing_ratio(capsys):
    from scripts import project_time_to_loss as project

    assert project.main(["--optimizers", "AdamW", "FlexDeMo", "--links", "10gbit", "--steps-ratio", "FlexDeMo=2"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per GPU" in out and "FlexDeMo: " in out and "| FlexDeMo | 2 |" in out
    assert project.main(["--optimizers", "AdamW", "FlexDeMo", "--links", "10gbit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps-ratio: no ratio for FlexDeMo" in err[0]


def _free_port_base(span: int) -> int:
    """A port from which ``span`` consecutive ports are free on 127.0.0.1 (the script's MASTER_PORTs)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(30000, 60000 - span)
        try:
            socks = []
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_bench_ft_measures_a_fault_tolerant_run(tmp_path):
    """The smallest run of scripts/bench_ft.py: the lighthouse and 2 replica groups x 2 processes, a
    few steps; the mean step time comes from both groups' step lines. (The kill runs take a minute
    each: two start-ups, one after the other.)"""
    base = _free_port_base(12)
    proc = subprocess.run(
        [sys.executable, "scripts/bench_ft.py", "--runs", "ft", "--repeats", "1", "--steps", "6", "--warmup", "2",
         "--lighthouse-port", str(base + 11), "--port-base", str(base), "--timeout", "300",
         "--out", str(tmp_path / "logs"), "--json", str(tmp_path / "r.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["run"] == "ft" and row["config"] == "FlexDeMo", row
    assert len(row["step_s_by_group"]) == 2 and all(0 < s < 30 for s in row["step_s_by_group"]), row
    assert f"| FlexDeMo | – | {row['step_s'] * 1e3:.1f} | – | – | – | {row['step_median_s'] * 1e3:.1f} |" in proc.stdout, proc.stdout
    for group in (0, 1):  # each group trained to the last step inside a quorum of both
        log = (tmp_path / "logs" / f"FlexDeMo-ft-r0-g{group}.log").read_text()
        assert "quorum of 2 replica group(s)" in log and "step:  6  loss:" in log


def test_bench_ft_reads_the_survivor_s_stall_and_the_heal_from_the_console_lines(tmp_path):
    from scripts.bench_ft import Log

    lines = [
        "[rank0]:[titan] 2026-11-27 21:42:05,100 - titan_commopt.titan.common.replica_group - INFO - "
        "fault tolerance: quorum of 2 replica group(s), replica group 0 is replica 0 (step 0)",
        "[rank0]:[titan] 2026-11-27 21:42:05,300 - root - INFO - step: 63  loss:  3.1  grad_norm:  0.4",
        "[rank0]:[titan] 2026-11-27 21:42:05,300 - root - INFO - step: 63  loss:  3.1  R sent: 3.72KB/step",
        "[rank0]:[titan] 2026-11-27 21:42:10,500 - titan_commopt.titan.common.replica_group - WARNING - "
        "fault tolerance: step 64 not committed (a peer failed or too few groups); undone",
        "[rank0]:[titan] 2026-11-27 21:42:10,637 - titan_commopt.titan.common.replica_group - INFO - "
        "fault tolerance: quorum of 1 replica group(s), replica group 0 is replica 0 (step 63)",
        "[rank0]:[titan] 2026-11-27 21:42:10,800 - root - INFO - step: 64  loss:  3.0  grad_norm:  0.4",
        "[rank0]:[titan] 2026-11-27 21:42:11,000 - root - INFO - step: 65  loss:  3.0  grad_norm:  0.4",
        "[rank0]:[titan] 2026-11-27 21:42:27,077 - titan_commopt.titan.common.replica_group - INFO - "
        "fault tolerance: replica group 1 healed from a peer at step 223 in 0.16 s",
        "[rank0]:[titan] 2026-11-27 21:42:28,000 - titan_commopt.titan.common.replica_group - WARNING - "
        "fault tolerance: TITAN_COMMOPT_FT_KILL=64:quorum: this process kills itself now",
    ]
    path = tmp_path / "g.log"
    path.write_text("\n".join(lines) + "\n")
    log = Log.read(path)
    assert sorted(log.steps) == [63, 64, 65]
    assert log.steps[64] - log.steps[63] == pytest.approx(5.5, abs=1e-3)
    assert log.mean_step(63, 65) == pytest.approx(2.85, abs=1e-3)
    assert [(s, round(g, 3)) for s, _, g in log.gaps()] == [(64, 5.5), (65, 0.2)]
    assert [(n, s) for _, n, s in log.quorums] == [(2, 0), (1, 63)]
    assert [(s, sec) for _, s, sec in log.heals] == [(223, 0.16)]
    assert [s for _, s in log.uncommitted] == [64] and len(log.kills) == 1


@pytest.mark.parametrize("args, expected", [
    (["--runs", "kill"], "--runs 'kill': allowed are plain, ft, kill-quorum, kill-collective, kill-launcher, stall"),
    (["--warmup", "60"], "--warmup 60: allowed is 0 .. --steps - 1 (59)"),
    (["--kill-step", "2"], "--kill-step 2: allowed is an integer >= 3"),
    (["--heartbeat-ms", "0"], "--heartbeat-ms 0: allowed are integers >= 1"),
    (["--configs", "nope.toml"], "--configs 'nope.toml': no such file"),
])
def test_bench_ft_bad_argument_is_one_line_exit_2(capsys, args, expected):
    from scripts import bench_ft

    with pytest.raises(SystemExit) as stop:
        bench_ft.main(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and err.startswith(expected), err
