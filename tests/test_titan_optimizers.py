"""Every optimizer family through torchtitan's Trainer on a 2x2 HSDP mesh and on 2 replicas x 2-way
tensor parallelism (4 CPU processes each): R left to the optimizer (FSDP2 over fsdp only), loss goes
down, R bytes below AdamW-HSDP's (Muon's are AdamW-HSDP's own: its gradient sync is the baseline's); on
HSDP the ledger's R and S bytes per step equal the comm report's formulas, on R x TP the replicas are
checked every step where they must agree.

The names each mesh runs, derived from the registry, and the HSDP launches' arguments are
``tests/titan_utils.py``'s. On torchtitan 0.3 (CI's ``-m both_lines`` run, through our TOML runner) one
name per family runs on each mesh (``BOTH_LINES_NAMES``)."""

import json
import math

import pytest

from titan_commopt.optim import available_names, family_of, owns_replicate_sync, resolve
from scripts._bench_common import cli_overrides
from tests.titan_utils import (
    BOTH_LINES_NAMES, COVERED_BY, EXTRA, HSDP_NAMES, HSDP_STEPS, LR, ONLY_ON, TP_APPLIED, TP_NAMES,
    assert_ledger_is_the_comm_report, hsdp_run, losses, read_texts, run_train,
)


def _on_both_lines(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.both_lines) if n in BOTH_LINES_NAMES else n for n in names]


@pytest.mark.both_lines
def test_every_registered_name_is_covered():
    ours = [n for n in available_names() if owns_replicate_sync(n)]
    families = {family_of(n).key for n in ours}
    assert set(COVERED_BY) | set(ONLY_ON) <= set(ours)  # no entry for a name that is gone
    assert {family_of(n).key for n in BOTH_LINES_NAMES} == families and len(BOTH_LINES_NAMES) == len(families)
    assert BOTH_LINES_NAMES <= set(HSDP_NAMES) & set(TP_NAMES)
    assert set(ours) == set(HSDP_NAMES) | set(TP_NAMES) | set(COVERED_BY)
    for names in (HSDP_NAMES, TP_NAMES):  # every family on every mesh
        assert {family_of(n).key for n in names} == families
    for name, runner in COVERED_BY.items():
        assert family_of(name) is family_of(runner) and runner in HSDP_NAMES and runner in TP_NAMES
        assert resolve(name).options.base == resolve(runner).options.base


@pytest.mark.parametrize("name", _on_both_lines(HSDP_NAMES))
def test_optimizer_trains_through_torchtitan_hsdp(tmp_path_factory, name):
    dump, proc, tb = hsdp_run(tmp_path_factory, name)
    assert "Applied FSDP to the model" in proc.stdout and "Applied HSDP" not in proc.stdout
    # the step's token count did not cross R (titan/common/token_count.py)
    assert "token count of each step: within the replica" in proc.stdout
    values = losses(tb)
    assert len(values) == HSDP_STEPS and all(math.isfinite(v) for v in values)
    assert values[-1] < values[0]
    ratio = tb["comm/R_ratio_vs_adamw_hsdp"][-1][1]
    # Muon: AdamW-HSDP's own gradient bytes (ratio 1; the R bytes are held to the formula below)
    assert 0 < ratio < 1 or (family_of(name).key == "muon" and 1 <= ratio < 1.01), ratio
    assert tb["commopt/skipped_steps"][-1][1] == 0
    # the clip's 8 bytes crossed R (over the world) every step unless each replica clipped alone ([commopt]
    # clip_scope "auto"): then only the 4-byte agreement on a replica's stop, before a step that syncs R
    world = [v for _, v in sorted(tb["comm/world_bytes_total"])]
    per_step = [b - a for a, b in zip([0.0] + world, world)]
    assert len(per_step) == HSDP_STEPS
    assert (set(per_step) <= {0.0, 4.0}) if family_of(name).local_steps else min(per_step) >= 8, per_step
    assert_ledger_is_the_comm_report(tb, name, HSDP_STEPS, EXTRA.get(name))
    # the resolved options, once, as text: what the run trained with and where each value came from
    (text,) = read_texts(dump)["commopt/resolved_options/text_summary"]
    record = json.loads(text.strip("`\n"))
    scaled = float(LR.get(name, "0.003")) * resolve(name).options.lr_scale  # the preset's recommended scale
    assert record["optimizer"] == name and record["hparams"]["lr"] == pytest.approx(scaled)


# 2 replicas x TP 2 (no FSDP: dp_shard = 1): gradients reach the optimizers with TP's own placements
# (a Replicate embedding gradient, Partial norm gradients). Periods such that every sync happens in 6 steps
# while the R payload stays below AdamW's (1/Kx + 1/Ku + 1/Kv < 1).
EXTRA_TP = {
    "MT-DAO": {"local": {"Kx": 4, "Ku": [4], "Kv": 4}},
    "LocalAdam": {"local": {"Kx": 4, "Ku": [4], "Kv": 4}},
    "DiLoCo": {"local": {"Kx": 3}},
    "SparseLoCo": {"sparseloco": {"H": 3}},
}


@pytest.mark.parametrize("name", _on_both_lines(TP_NAMES))
def test_optimizer_trains_through_torchtitan_replicas_x_tp(tmp_path, name):
    steps = 6
    proc, tb = run_train(
        tmp_path, 4, "--training.steps", str(steps), "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.tensor_parallel_degree", "2", "--model.flavor", "cpu_tiny", "--optimizer.name", name,
        "--optimizer.lr", LR.get(name, "0.003"), "--commopt.check_replicas_every", "1",
        *cli_overrides(name, EXTRA_TP.get(name, {})),
    )
    assert TP_APPLIED.search(proc.stdout) and "Applied HSDP" not in proc.stdout
    values = losses(tb)
    assert len(values) == steps and all(math.isfinite(v) for v in values)
    assert values[-1] < values[0]
    assert tb["comm/R_sent_bytes_total"][-1][1] > 0
    ratio = tb["comm/R_ratio_vs_adamw_hsdp"][-1][1]
    # Muon: AdamW-HSDP's gradient bytes, plus the replica check's fingerprints over R (every step here)
    assert 0 < ratio < 1 or (family_of(name).key == "muon" and 1 <= ratio < 1.01), ratio
    assert tb["commopt/skipped_steps"][-1][1] == 0
