"""torchtitan training with each optimizer for a few steps: does every optimizer train through
torchtitan on this machine, how fast, with how much memory, sending how many bytes?

    # one GPU: llama3 1B-class, 20 steps each (train_configs/llama3_1b_gpu.toml)
    python scripts/train_each.py --config train_configs/llama3_1b_gpu.toml --nproc 1 --steps 20
    # CPU smoke: two replicas of the small CPU model
    .venv/bin/python scripts/train_each.py --nproc 2 --steps 4 --optimizers AdamW DeMo \\
        -- --parallelism.data_parallel_replicate_degree 2

Each run is ``python -m titan_commopt.run --nproc_per_node N --standalone -m titan_commopt.train``
with the config, ``--optimizer.name``, ``--training.steps`` and ``--metrics.log_freq 1`` set and
every argument after ``--`` passed on. The table reads each run's TensorBoard log: the first and last logged loss, the median
tokens per second and the peak reserved memory over the logged steps after the first (torchtitan's
``throughput(tps)`` and ``memory/max_reserved(GiB)``; on CPU memory reads 0), and R bytes sent per
step (``comm/R_sent_bytes``, 0 with one replica). A failed run is one row with its last lines; the
others still run. Logs: ``<out>/<optimizer>.log``.
"""

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import CONFIG, ROOT, human, read_scalars, table, torchrun_cmd, train_env  # noqa: E402


def train(name: str, config: Path, nproc: int, steps: int, out: Path, extra: list[str]) -> tuple[int, str]:
    cmd = torchrun_cmd(nproc, out / name, "--optimizer.name", name, "--training.steps", str(steps),
                       "--metrics.log_freq", "1", *extra, config=config, launcher="titan_commopt.run")
    proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(log)
    return proc.returncode, log


def summary(name: str, dump: Path) -> list[str]:
    scalars = read_scalars(dump)

    def values(tag):
        return [v for _, v in scalars.get(tag, [])]

    loss = values("loss_metrics/global_avg_loss")
    tps = values("throughput(tps)")[1:] or values("throughput(tps)")
    mem = values("memory/max_reserved(GiB)")[1:] or values("memory/max_reserved(GiB)")
    sent = values("comm/R_sent_bytes")
    return [name, f"{loss[0]:.3f}", f"{loss[-1]:.3f}", f"{statistics.median(tps):,.0f}" if tps else "–",
            f"{max(mem):.1f}" if mem else "–", human(statistics.median(sent)) if sent else "–"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--optimizers", nargs="*", help="default: AdamW and every registered optimizer")
    p.add_argument("--out", default="outputs/train_each")
    p.add_argument("extra", nargs="*", help="after --: more torchtitan arguments for every run")
    a = p.parse_args(argv)
    from titan_commopt.optim import available_names

    names = a.optimizers or ["AdamW", *(n for n in available_names() if n not in ("Adam", "AdamW"))]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], 0
    for name in names:
        rc, log = train(name, Path(a.config).resolve(), a.nproc, a.steps, out, a.extra)
        if rc == 0:
            rows.append(summary(name, out / name))
        else:
            failed += 1
            tail = " / ".join(line.strip() for line in log.strip().splitlines()[-3:])
            rows.append([name, f"failed (exit {rc}): {tail[:300]}", "", "", "", ""])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(f"\n{a.steps} steps, {a.nproc} process(es), {a.config}\n")
    print(table(["optimizer", "first loss", "last loss", "tokens/s (median)", "peak reserved GiB",
                 "R sent / step"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
