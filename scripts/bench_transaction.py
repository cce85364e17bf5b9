"""The fault-tolerance transaction's optimizer copy, timed alone, against the checkpoint's form.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python scripts/bench_transaction.py \\
        --flavors cpu_tiny debugmodel --names FlexDeMo DiLoCo --repeats 21

Under live fault tolerance the container copies, before every step, what the step may change and
puts it back when the step does not commit (``titan/common/container.py``). Per optimizer the copy is
``snapshot()`` (the raw state, no conversion) and the put-back ``restore()``; a heal sends the
``state_dict()`` instead (it crosses processes), which for DeMo/FlexDeMo converts every momentum to
the parameter domain in float64 and back, and which was also the transaction's until 2026-11-29.
Both are timed on one process, on the whole model of each ``--flavors`` entry (torchtitan's llama3
``Transformer``, real weights, random gradients, 3 steps first) with the optimizer on its R path (a
quorum of one, as under fault tolerance: DeMo's momentum in the coefficient domain):

- every step: ``snapshot()``, against the heal's copy of the ``state_dict()`` (``clone_tree``);
- a step that does not commit, besides: ``restore()``, against ``load_state_dict()`` of that copy.

Milliseconds: the median and the range over ``--repeats`` rounds, each round all four one after the
other (the box's load falls alike on each), after one untimed round. The parameters' own copy, the
same either way, is left out. In the runs of ``scripts/bench_ft.py`` each rank holds a shard of the
model (2 per group there: about half of these numbers).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts._bench_common import build_model, table  # noqa: E402
from titan_commopt import comm  # noqa: E402
from titan_commopt.optim import make  # noqa: E402
from titan_commopt.titan.common.replica_group import Quorum, clone_tree  # noqa: E402
from titan_commopt.topology import Topology  # noqa: E402

WARMUP_STEPS = 3


def _optimizer(flavor: str, name: str):
    torch.manual_seed(0)
    model = build_model(flavor)
    topology = Topology(quorum=Quorum(None, 1))  # not started: a quorum of one, asks its Manager nothing
    optimizer = make(name, model.named_parameters(), topology, ledger=comm.CommLedger())
    generator = torch.Generator().manual_seed(0)
    for _ in range(WARMUP_STEPS):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return model, optimizer


def _times_ms(optimizer, repeats: int) -> dict[str, list[float]]:
    """The times of each column over ``repeats`` rounds; a round runs all four, one after the other
    (the box's load then falls alike on each), after one untimed round (first-use allocations, DeMo's
    float64 chunkers)."""
    out: dict[str, list[float]] = {"snapshot": [], "restore": [], "state_dict": [], "load": []}

    def timed(column: str, action):
        start = time.perf_counter()
        result = action()
        out[column].append(1e3 * (time.perf_counter() - start))
        return result

    for _ in range(repeats + 1):
        snapshot = timed("snapshot", optimizer.snapshot)
        timed("restore", lambda: optimizer.restore(snapshot))
        saved = timed("state_dict", lambda: clone_tree(optimizer.state_dict()))
        timed("load", lambda: optimizer.load_state_dict(saved))
    return {column: times[1:] for column, times in out.items()}


def _cell(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} [{min(times):.2f}–{max(times):.2f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavors", nargs="+", default=["cpu_tiny"])
    p.add_argument("--names", nargs="+", default=["FlexDeMo", "DiLoCo"], help="optimizer names of ours")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for flavor in args.flavors:
        for name in args.names:
            model, optimizer = _optimizer(flavor, name)
            params = sum(x.numel() for x in model.parameters())
            state = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor))
            times = _times_ms(optimizer, args.repeats)
            rows.append([flavor, name, f"{params / 1e6:.2f} M", f"{state / 2**20:.1f} MiB",
                         *(_cell(times[column]) for column in ("snapshot", "state_dict", "restore", "load"))])
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(f"Optimizer copy of the FT transaction (ms; median [min–max] over {args.repeats} rounds)\n")
    print(table(["flavor", "optimizer", "parameters", "optimizer state", "snapshot (every step)",
                 "state_dict copy (every step, before)", "restore (undone step)",
                 "load_state_dict (undone step, before)"], rows))


if __name__ == "__main__":
    main()
