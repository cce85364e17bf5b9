"""Measured R bytes of the DES-LOC / MT-DAO engine for the papers' configurations, on 2 real
replicas, against AdamW-HSDP (which all-reduces d fp32 gradient elements over R every step).

The ratio does not depend on d, so a small d runs many steps cheaply. Run with ``-s`` to see the
table (the numbers quoted in the issue note):

    .venv/bin/python -m pytest -q -s tests/test_local_adaptive_bytes.py
"""

import dataclasses

import pytest
import torch

from titan_commopt import comm
from titan_commopt.optim import BaseHParams, ShardShape, resolve, traffic
from titan_commopt.optim.local import adaptive as la
from tests.dist_utils import run_distributed

STEPS = 6931 * 2  # covers two Kv = 6931 events of the half-life configuration
D = 37  # any d: the ratio is independent of it
CONFIGS = {
    "LocalAdam K=32 (all states)": la.Config(Kx=32, Ku=[32], Kv=32),
    "DES-LOC Kx=32, Ku=3Kx, Kv=6Kx": la.Config(Kx=32, Ku=[96], Kv=192),
    "MT-DAO half-life Kx=32, Ku=693, Kv=6931": la.Config(Kx=32, Ku=[693], Kv=6931),
    "DES-LOC Kx=32, Ku=3Kx, Kv=6Kx, bf16": la.Config(Kx=32, Ku=[96], Kv=192, transfer_dtype="bf16"),
}


def _measure(rank, world):
    import torch.distributed as dist

    from titan_commopt.topology import Topology

    topo = Topology(replicate=dist.group.WORLD)
    out = {}
    g = torch.Generator().manual_seed(rank)
    grads = torch.randn(64, D, generator=g)
    for name, cfg in CONFIGS.items():
        p = torch.zeros(D, requires_grad=True)
        ledger = comm.CommLedger()
        resolved = resolve("LocalAdam", dataclasses.asdict(cfg), BaseHParams(lr=1e-3))
        opt = la.LocalAdaptive([("w", p)], topo, resolved, ledger=ledger)
        for n in range(STEPS):
            p.grad = grads[n % 64].clone()
            opt.step()
        out[name] = (ledger.current().get("R_sent", 0.0), ledger.current().get("R_calls", 0.0))
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, 2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_measured_r_bytes_vs_adamw_hsdp(measured, name):
    cfg = CONFIGS[name]
    adamw = traffic.adamw_hsdp_r_bytes([ShardShape("w", (D,), (D,))], 2).sent * STEPS  # d fp32 per step
    sent, calls = measured[0][name]
    assert measured[1][name] == measured[0][name]
    resolved = resolve("LocalAdam", dataclasses.asdict(cfg))
    r = la.resolve_periods(resolved.options, resolved.hparams)
    size = 2 if cfg.transfer_dtype == "bf16" else 4
    events = STEPS // r.Kx + sum(STEPS // k for k in r.Ku) + STEPS // r.Kv
    assert sent == D * events * size  # every element of each due state, once per event
    # one fused collective per step that has anything due
    due_steps = sum(1 for n in range(1, STEPS + 1) if any(n % k == 0 for k in (r.Kx, *r.Ku, r.Kv)))
    assert calls == due_steps
    analytic = la.local_r_bytes([ShardShape("w", (D,), (D,))], resolved, 2).sent / (D * 4)
    print(f"\n  {name:42s} measured {sent / STEPS / D:.5f} B/param/step = 1/{adamw / sent:6.2f} of AdamW-HSDP"
          f" (analytic 1/{1 / analytic:6.2f}); {calls:.0f} collectives, {STEPS} steps, 2 replicas")
    assert abs(sent / adamw - analytic) < 0.01 * analytic
