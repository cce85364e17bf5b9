"""Compile every Triton kernel of the package (the ``*_triton.py`` modules) for GPU targets on a
machine without a GPU, and report what each compiled kernel uses: registers and stack (spills) per
thread on NVIDIA (``cuobjdump --dump-resource-usage`` on the cubin, ptxas from the Triton wheel), VGPRs and scratch
on AMD (the ``amdgcn`` assembly's metadata).

Triton's interpreter (what the tests run on the CPU) is lenient: code it runs may not compile, and it
says nothing of registers. This script takes the launches the optimizers make (recorded by running
the kernels' host functions on small CPU tensors with each kernel replaced by a recorder) and compiles
each one through Triton's own launch path (``JITFunction.warmup``) against a stand-in driver that
names the target and never launches.

    python scripts/kernel_report.py                 # the table (markdown), both targets
    python scripts/kernel_report.py --targets cuda:90 --check   # exit 1 if a kernel fails to compile

Run it without ``TRITON_INTERPRET`` (it refuses otherwise: the kernels would be interpreter functions).
"""

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_report: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = {"cuda:90": GPUTarget("cuda", 90, 32), "cuda:80": GPUTarget("cuda", 80, 32),
           "hip:gfx90a": GPUTarget("hip", "gfx90a", 64), "hip:gfx942": GPUTarget("hip", "gfx942", 64)}


class _CompileOnlyDriver:
    """What ``JITFunction.run`` asks of a driver before it compiles (``warmup`` stops there)."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(target: GPUTarget):
    previous = driver._active  # (reading driver.active would make the default one: none without a GPU)
    driver.set_active(_CompileOnlyDriver(target))
    try:
        yield
    finally:
        driver._active = previous


@dataclass
class Launch:
    case: str
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, case: list, out: list):
        self.kernel, self.case, self.out = kernel, case, out

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append(Launch(self.case[0], self.kernel, args, kwargs))
        return launch


def _demo_launches() -> list[Launch]:
    from titan_commopt.compress.packing import ValueCodec
    from titan_commopt.compress.replicators import DeMoReplicator
    from titan_commopt.optim.demo import plan_triton

    out, case = [], [""]
    names = ("_encode_kernel", "_wire_kernel", "_decode_kernel")
    real = {n: getattr(plan_triton, n) for n in names}
    for n in names:
        setattr(plan_triton, n, _Recorder(real[n], case, out))
    try:
        # (label, local shape, chunk, k, sign_before_sync, wire, transfer dtype, momentum)
        for label, shape, s, k, sign, wire, dtype, momentum in [
            ("DeMo 64×64 k32 compact bf16", (128, 128), 64, 32, False, "compact", torch.bfloat16, True),
            ("FlexDeMo 32×32 k16 compact sign", (64, 64), 32, 16, True, "compact", torch.float32, True),
            ("DeMo vector c64 k32 packed bf16", (4096,), 64, 32, False, "packed", torch.bfloat16, True),
            ("FlexDeMo 32×32 k16 packed ternary", (64, 64), 32, 16, True, "packed", torch.float32, True),
            ("AdamW base 64×64 k32 compact bf16", (128, 128), 64, 32, False, "compact", torch.bfloat16, False),
        ]:
            case[0] = label
            rep = DeMoReplicator(shape, ValueCodec(sign, dtype, True), s, k, True, wire=wire)
            ch, spec = rep.chunker, plan_triton.wire_of(rep, "cpu")
            n = ch.n_chunks
            vals, idx = torch.empty(n, rep.k), torch.empty(n, rep.k, dtype=torch.int64)
            words = torch.zeros(plan_triton.words_for(rep.value_bytes + rep.index_bytes), dtype=torch.int32)
            plan_triton.encode(ch, [torch.randn(shape)], rep.k, vals, idx,
                            momentum=torch.zeros(n, ch.L) if momentum else None, beta=0.999, lam=1.0,
                            wire=spec, words=words, value_byte=0, index_byte=rep.value_bytes)
            payloads = torch.zeros(2, rep.value_bytes + rep.index_bytes, dtype=torch.uint8)
            plan_triton.decode(ch, None, None, [torch.randn(shape).bfloat16()], [0.1], [0.1], sign=not sign,
                            wire=spec, payloads=payloads, value_byte=0, index_byte=rep.value_bytes)
    finally:
        for n in names:
            setattr(plan_triton, n, real[n])
    return out


def _adopt_launches() -> list[Launch]:
    from titan_commopt.optim.local import update_triton

    out, case = [], [""]
    real = update_triton._kernel

    def recording(interpret):
        return _Recorder(real(interpret), case, out)

    update_triton._kernel = recording
    try:
        for base, n_moments, dtype in [("adopt", 2, torch.float32), ("adopt", 2, torch.bfloat16),
                                       ("adam", 3, torch.float32), ("sgdm", 1, torch.float32)]:
            case[0] = f"{base}, {n_moments} momenta, {str(dtype)[6:]}"
            shapes = [(64, 32), (100,)]
            xs = [torch.randn(s).to(dtype) for s in shapes]
            gs = [torch.randn(s).to(dtype) for s in shapes]
            moments = [[torch.zeros(s).to(dtype) for s in shapes] for _ in range(n_moments)]
            vs = [torch.ones(s).to(dtype) for s in shapes] if base != "sgdm" else None
            update_triton.local_adaptive_(xs, gs, moments, vs, base=base, lr=1e-3, betas1=[0.9, 0.99, 0.5][:n_moments],
                                  omegas=[0.5 / n_moments] * n_moments, weight_decay=0.1, beta2=0.999, eps=1e-8,
                                  step=3, clip="coordinate", clip_threshold=1.0)
    finally:
        update_triton._kernel = real
    return out


def _nvidia_usage(compiled) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return f"{m.group(1)} registers, {m.group(2)} B stack" if m else "?"


def _amd_usage(compiled) -> str:
    asm = compiled.asm.get("amdgcn", "")
    vgpr = re.search(r"; NumVgprs: (\d+)", asm)
    spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", asm)
    scratch = re.search(r"; ScratchSize: (\d+)", asm)
    return (f"{vgpr.group(1) if vgpr else '?'} VGPRs, {spill.group(1) if spill else '?'} spilled, "
            f"{scratch.group(1) if scratch else '?'} B scratch")


def compile_launch(launch: Launch, target: GPUTarget):
    """The launch compiled for ``target`` (raises what Triton raises when it does not compile)."""
    launch.kernel.device_caches.clear()  # a JITFunction keeps its target per device: another target, another binder
    with compiling_for(target):
        return launch.kernel.warmup(*launch.args, grid=(1,), **launch.kwargs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["cuda:90", "hip:gfx90a"], choices=sorted(TARGETS))
    parser.add_argument("--check", action="store_true", help="exit 1 if any launch fails to compile")
    args = parser.parse_args(argv)
    launches = _demo_launches() + _adopt_launches()
    failures = 0
    print("| case | kernel | warps | " + " | ".join(args.targets) + " |")
    print("|---|---|---|" + "---|" * len(args.targets))
    seen = set()
    for launch in launches:
        name = launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else str(launch.kernel)
        key = (launch.case, name)
        if key in seen:  # one row per (case, kernel): a case's shards launch the same specialization
            continue
        seen.add(key)
        cells = []
        for t in args.targets:
            try:
                compiled = compile_launch(launch, TARGETS[t])
                cells.append(_nvidia_usage(compiled) if TARGETS[t].backend == "cuda" else _amd_usage(compiled))
            except Exception as e:  # noqa: BLE001 - reported per launch, the run goes on
                failures += 1
                cells.append(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        print(f"| {launch.case} | {name} | {launch.kwargs.get('num_warps', 4)} | " + " | ".join(cells) + " |")
    if failures:
        print(f"{failures} launch(es) failed to compile", file=sys.stderr)
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
