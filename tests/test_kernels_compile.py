"""Every Triton kernel of the package (the ``*_triton.py`` modules, each beside its torch twin) compiles
for an H100 (sm_90) and an MI250 (gfx90a), on this GPU-less machine: ``scripts/kernel_report.py
--check`` records the launches the optimizers make and compiles each through Triton's own launch path (ptxas and the AMD backend ship in the
Triton wheel). The interpreter the other kernel tests run accepts code the compiler rejects; this
is the check that the kernels are GPU code at all, and that none spills registers to memory. What
each one uses is printed in the report and recorded in docs/benchmarks.md §7.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _toolchain() -> bool:
    try:
        import triton
    except ImportError:
        return False
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (nvidia / "cuobjdump").exists() and (Path(triton.__file__).parent / "backends" / "amd").exists()


@pytest.mark.skipif(not _toolchain(), reason="Triton's NVIDIA/AMD compilers are not installed")
def test_every_kernel_compiles_for_h100_and_mi250(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled now, not found in a cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton 3.9's notice; its default)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--check",
                           "--targets", "cuda:90", "hip:gfx90a"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    kernels = {row.split(" | ")[1] for row in rows}
    assert kernels == {"_encode_kernel", "_wire_kernel", "_decode_kernel", "_local_adaptive_body"}, kernels
    for row in rows:
        assert "FAILED" not in row and " registers, " in row and " VGPRs, " in row, row
        # No kernel spills (a static property of the compiled code, not a timing): a spill, e.g. of
        # the DeMo encode kernel's tiles on sm_90 (docs/benchmarks.md §7), only a GPU timing would
        # otherwise show.
        assert " registers, 0 B stack" in row and " 0 spilled, 0 B scratch" in row, row
