"""Windows of the per-step update statistics written by ``scripts/update_norms/sitecustomize.py``: per
window of ``--window`` steps, the mean RMS per coordinate of a step's parameter change, that RMS ÷ the
step's learning rate, and the mean cosine between consecutive steps' changes.

    .venv/bin/python scripts/update_norms.py /tmp/adamw.jsonl /tmp/flexdemo.jsonl --window 50
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._bench_common import table  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--window", type=int, default=50)
    a = p.parse_args(argv)
    for path in a.files:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        out = []
        for start in range(0, len(rows), a.window):
            w = rows[start:start + a.window]
            cos = [r["cos_prev"] for r in w if not math.isnan(r["cos_prev"])]
            out.append([f"{w[0]['step']}–{w[-1]['step']}", f"{statistics.fmean(r['rms'] for r in w):.5f}",
                        f"{statistics.fmean(r['rms'] / r['lr'] for r in w if r['lr'] > 0):.3f}",
                        f"{statistics.fmean(cos):.3f}" if cos else "-"])
        print(f"{path} ({rows[0]['n']} coordinates on rank 0)" if rows else f"{path}: empty")
        print(table(["steps", "update RMS per coordinate", "RMS ÷ lr", "cos(this step's, the previous step's)"], out))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
