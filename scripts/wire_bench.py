"""DeMo's wire, ``packed`` vs ``compact``: bytes per shard and the time of one shard's DeMo step.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/wire_bench.py --repeats 3

For each preset (DeMo, FlexDeMo) and local shard shape (default: llama3-8B's 4096×4096 and
14336×4096 weights sharded 8 ways over S, ``512×4096`` and ``1792×4096``), the work one step does
per shard on a replica — forward DCT, top-k, writing the payload, decoding ``--replicas`` payloads
into the mean, inverse DCT — is timed with either wire, the two interleaved in one process (the
median of ``--steps`` steps each), the whole repeated ``--repeats`` times. Printed: the payload
bytes, the encode (write) and decode (mean) times, the step's time, and the ratio compact ÷ packed
of that step per repeat (the machine's noise moves both alike). ``--device cuda`` times on a GPU
(synchronized around each timed region).
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from titan_commopt.compress.replicators import make_replicator  # noqa: E402
from titan_commopt.optim.demo import PRESETS, Config  # noqa: E402


def _timer(device):
    def now():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _step_parts(rep, x, W, device):
    """Callables for one shard's step: transform + top-k, write, mean + inverse."""
    ch = rep.chunker
    out, tmp, work = (torch.empty(ch.numel, device=device) for _ in range(3))
    value_out = torch.empty(1, rep.value_bytes, dtype=torch.uint8, device=device)
    index_out = torch.empty(1, rep.index_bytes, dtype=torch.uint8, device=device)
    state = {}

    def select():
        coeffs = ch.blocks_to_chunk_major(ch.forward([x], out=out, tmp=tmp)).reshape(ch.n_chunks, ch.L)
        state["sel"] = rep.select(coeffs, work=tmp)

    def write():
        rep.write(*state["sel"], value_out, index_out)
        state["payloads"] = (value_out.unsqueeze(0).expand(W, 1, -1).contiguous(),
                             index_out.unsqueeze(0).expand(W, 1, -1).contiguous())

    def mean():
        dense = rep.mean_coefficients(*state["payloads"], out=work)
        ch.inverse(dense, out=out, tmp=tmp)

    return select, write, mean


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=["512x4096", "1792x4096"])
    p.add_argument("--presets", nargs="*", default=["FlexDeMo", "DeMo"], choices=list(PRESETS))
    p.add_argument("--replicas", type=int, default=2, help="payloads decoded per step (|R|)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    device = torch.device(a.device)
    now = _timer(device)
    print("| preset | shard | wire | payload bytes | write ms | mean ms | step ms | step compact ÷ packed, per repeat |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in a.presets:
        opts = {k: v for k, v in PRESETS[preset].items() if k not in ("lr_scale", "lr")}
        for text in a.shapes:
            shape = tuple(int(d) for d in text.split("x"))
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(shape, generator=g, device=device)
            reps = {w: make_replicator(dataclasses.replace(Config(), **opts, wire=w), shape, "w", device=device)
                    for w in ("packed", "compact")}
            parts = {w: _step_parts(r, x, a.replicas, device) for w, r in reps.items()}
            times = {w: [] for w in reps}  # per repeat: (select, write, mean) medians
            for _ in range(a.repeats):
                for w in reps:  # interleaved: both wires see the same load
                    samples = []
                    for step in range(a.steps + 1):
                        t = []
                        for f in parts[w]:
                            t0 = now()
                            f()
                            t.append(now() - t0)
                        if step:  # the first is a warm-up
                            samples.append(t)
                    times[w].append([statistics.median(s[i] for s in samples) * 1e3 for i in range(3)])
            ratios = [sum(c) / sum(p) for c, p in zip(times["compact"], times["packed"])]
            for w, r in reps.items():
                med = [statistics.median(t[i] for t in times[w]) for i in range(3)]
                col = " ".join(f"{q:.3f}" for q in ratios) if w == "compact" else ""
                print(f"| {preset} | {text} | {w} | {r.payload_bytes(1)} | {med[1]:.2f} | {med[2]:.2f} | "
                      f"{sum(med):.2f} | {col} |")


if __name__ == "__main__":
    main()
