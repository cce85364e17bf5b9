"""DeMo / FlexDeMo numbers for the issue note: R bytes per step and ratio vs AdamW-HSDP on the llama3
debug shape and the ~300M shape (meta device, |S| = 1: DDP-style per-GPU payload, the papers' unit),
packed and unpacked; optimizer step time vs torch AdamW on 2 real replicas. Run with ``-s``:

    .venv/bin/python -m pytest -q -s tests/test_demo_report.py
"""

import time

import torch

from titan_commopt import comm
from titan_commopt.optim import ShardShape, make, resolve, traffic
from titan_commopt.optim.common import BaseHParams
from tests.dist_utils import run_distributed


def _shapes(flavor):
    from torchtitan.models.llama3 import Transformer, llama3_args

    from titan_commopt.titan.spec import EXTRA_FLAVORS

    args = {**llama3_args, **EXTRA_FLAVORS}[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


VARIANTS = {
    "DeMo packed (bf16 values, 12-bit idx)": ("DeMo", {}),
    "DeMo unpacked (fp32 values, int64 idx)": ("DeMo", {"pack": False, "transfer_dtype": "fp32"}),
    "FlexDeMo packed (ternary, 10-bit idx)": ("FlexDeMo", {}),
    "FlexDeMo unpacked (fp32 signs, int64 idx)": ("FlexDeMo", {"pack": False}),
    "Random c=1/64 sign packed": ("FlexDeMo", {"replicator": "random", "compression_rate": 1 / 64}),
}


def test_r_bytes_vs_adamw_hsdp():
    print()
    for flavor in ("debugmodel", "300M"):
        shards = [ShardShape(fqn, shape, shape) for fqn, shape in _shapes(flavor)]
        adamw = traffic.adamw_hsdp_r_bytes(shards, 2).sent  # fp32 gradient all-reduce payload
        print(f"{flavor}: {adamw / 2**20:.2f} MiB/step/rank AdamW-HSDP (fp32 all-reduce)")
        ratios = {}
        for label, (name, kw) in VARIANTS.items():
            sent = traffic.demo_r_bytes(shards, resolve(name, kw), 2).sent
            ratios[label] = adamw / sent
            print(f"  {label:45s} {sent / 2**20:8.3f} MiB/step  {adamw / sent:7.1f}x less")
        assert ratios["DeMo packed (bf16 values, 12-bit idx)"] > 3 * ratios["DeMo unpacked (fp32 values, int64 idx)"]
        assert ratios["FlexDeMo packed (ternary, 10-bit idx)"] > 5 * ratios["FlexDeMo unpacked (fp32 signs, int64 idx)"]
        assert ratios["DeMo unpacked (fp32 values, int64 idx)"] > 40  # ~ the paper's 85x at s=64, k=32 / (4+8 B)


def _timing(rank, world, flavor):
    import torch.distributed as dist
    from torchtitan.models.llama3 import Transformer, llama3_args

    from titan_commopt.titan.spec import EXTRA_FLAVORS
    from titan_commopt.topology import Topology

    torch.manual_seed(0)
    model = Transformer({**llama3_args, **EXTRA_FLAVORS}[flavor])
    params = list(model.parameters())
    topo = Topology(replicate=dist.group.WORLD)
    hp = BaseHParams(lr=1e-3)
    out = {}
    for label, (name, kw) in list(VARIANTS.items())[:3] + [("AdamW", (None, {}))]:
        if name is None:
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        else:
            opt = make(name, model.named_parameters(), topo, hp, **kw)
        times = []
        for it in range(4):
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            dist.barrier()
            t0 = time.perf_counter()
            with comm.use_ledger(comm.CommLedger()):
                opt.step()
            times.append(time.perf_counter() - t0)
        out[label] = min(times[1:])
    return out


def test_step_time_vs_adamw():
    res = run_distributed(_timing, 2, "debugmodel")[0]
    print()
    for label, t in res.items():
        print(f"  debugmodel step {label:45s} {t * 1e3:8.1f} ms  ({t / res['AdamW']:.2f}x AdamW)")
    assert all(t > 0 for t in res.values())
