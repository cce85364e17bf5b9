"""Measured R bytes of the DES-LOC / MT-DAO engine for the papers' configurations, on 2 real
replicas, against AdamW-HSDP (which all-reduces d fp32 gradient elements over R every step).

The ratio does not depend on d, so a small d runs many steps cheaply. Run with ``-s`` to see the
table (the numbers quoted in the issue note):

    .venv/bin/python -m pytest -q -s tests/test_local_adaptive_bytes.py
"""

import dataclasses

import torch

from titan_commopt import comm
from titan_commopt.optim import BaseHParams, ShardShape, make, resolve, traffic
from titan_commopt.optim import local_adaptive as la
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
        opt = make("LocalAdam", [("w", p)], topo, BaseHParams(lr=1e-3), **dataclasses.asdict(cfg))
        opt.ledger = comm.CommLedger()
        for n in range(STEPS):
            p.grad = grads[n % 64].clone()
            opt.step()
        out[name] = (opt.ledger.current().get("R_sent", 0.0), opt.ledger.current().get("R_calls", 0.0))
    return out


def test_measured_r_bytes_vs_adamw_hsdp():
    res = run_distributed(_measure, 2)
    adamw = traffic.adamw_hsdp_r_bytes([ShardShape("w", (D,), (D,))], 2).sent * STEPS  # d fp32 per step
    print(f"\nR bytes/step vs AdamW-HSDP (d fp32/step), {STEPS} steps, 2 replicas:")
    for name, cfg in CONFIGS.items():
        sent, calls = res[0][name]
        assert res[1][name] == res[0][name]
        resolved = resolve("LocalAdam", dataclasses.asdict(cfg))
        r = la.settings(resolved.options)
        size = 2 if cfg.transfer_dtype == "bf16" else 4
        events = STEPS // r.Kx + sum(STEPS // k for k in r.periods_u) + STEPS // r.Kv
        assert sent == D * events * size  # every element of each due state, once per event
        # one fused collective per step that has anything due
        due_steps = sum(1 for n in range(1, STEPS + 1) if any(n % k == 0 for k in (r.Kx, *r.periods_u, r.Kv)))
        assert calls == due_steps
        analytic = traffic.local_r_bytes([ShardShape("w", (D,), (D,))], resolved, 2).sent / (D * 4)
        print(f"  {name:42s} measured {sent / STEPS / D:.5f} B/param/step = 1/{adamw / sent:6.2f} of AdamW-HSDP"
              f" (analytic 1/{1 / analytic:6.2f}); {calls:.0f} collectives")
        assert abs(sent / adamw - analytic) < 0.01 * analytic
