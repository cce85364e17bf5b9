"""Optimizer step time of every registered optimizer vs torch AdamW, one process on CPU.

    .venv/bin/python scripts/step_overhead.py --flavors cpu_small 100M --repeats 5

The model is torchtitan's llama3 ``Transformer`` (real weights, random gradients), the topology
``Topology.single()`` (no replicas: the numbers are the optimizer's own compute — DCT/top-k,
orthogonalization, state updates — without communication). torchtitan's AdamW is
``torch.optim.AdamW`` (foreach, the default on CPU), which is the reference here. Times are medians
over ``--repeats`` steps after one warm-up step.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts._bench_common import family_config, flavor_args, parse_overrides, table  # noqa: E402


def _model(flavor: str):
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(0)
    model = Transformer(flavor_args(flavor))
    with torch.no_grad():
        model.init_weights()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _build(name: str, model, overrides: dict):
    from titan_commopt.optim import family_module
    from titan_commopt.optim.common import BaseHParams
    from titan_commopt.topology import Topology

    hp = BaseHParams(lr=1e-3)
    if name == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                 weight_decay=hp.weight_decay)
    family, cfg = family_config(name, overrides)
    return family_module(family).build(name, list(model.named_parameters()), Topology.single(), hp, cfg)


def time_steps(name: str, flavor: str, repeats: int, overrides: dict) -> float:
    model = _model(flavor)
    opt = _build(name, model, overrides)
    opt.step()  # state allocation, plan building
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(flavors: list[str], names: list[str] | None, repeats: int, overrides: dict) -> list[list]:
    from titan_commopt.optim import available_names

    names = names or [n for n in available_names() if n != "Adam"]
    rows = []
    for flavor in flavors:
        n_params = sum(p.numel() for p in _model(flavor).parameters())
        ref = time_steps("AdamW", flavor, repeats, overrides)
        for name in names:
            try:
                t = ref if name == "AdamW" else time_steps(name, flavor, repeats, overrides)
            except Exception as error:  # keep the rest of the table
                print(f"# {flavor} {name}: {type(error).__name__}: {error}", file=sys.stderr)
                continue
            rows.append([f"{flavor} ({n_params / 1e6:.1f}M)", name, f"{t * 1e3:.1f}", f"{t / ref:.2f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", nargs="+", default=["cpu_small", "100M"])
    p.add_argument("--optimizers", nargs="*")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--set", nargs="*", default=[], metavar="FAMILY.OPTION=VALUE")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run(a.flavors, a.optimizers, a.repeats, parse_overrides(a.set))
    print(f"torch threads: {torch.get_num_threads()}\n")
    print(table(["model", "optimizer", "step ms (median)", "÷ torch AdamW"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
