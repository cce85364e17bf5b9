"""The fused local-adaptive kernel (``optim/local/update_triton.py``) against its torch twin
(``optim/local/update.py`` over ``optim/updates.py``), run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``; on a CUDA machine the same tests run the compiled kernel on the GPU), and ``kernels = "triton"`` end to end in the optimizer.

The interpreter is chosen when the kernel is jitted (``triton.jit`` reads TRITON_INTERPRET then);
``update_triton.py`` jits on first use per interpreter setting, so setting the variable per test works.
"""

import pytest
import torch

from titan_commopt import optim
from titan_commopt.kernels import triton_available
from titan_commopt.optim import updates
from titan_commopt.options import ConfigError

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(33, 40), (7,), (2048 + 5,), (3, 1, 4)]  # several chunks' worth of blocks, ragged ends, tiny tensors
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tensors(dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=gen)).to(dtype).to(DEVICE) for s in SHAPES]


def _torch_step(base, xs, gs, moments, vs, *, clip, rho, scale, hp, step, corrections1):
    """The torch path as ``LocalAdaptive`` runs it: the optimizer's clip, then the multi-tensor kernel."""
    if clip == "coordinate":
        gs = [g.clamp(-rho, rho) for g in gs]
    elif clip == "norm":
        gs = torch._foreach_mul(gs, scale)
    common = dict(lr=hp["lr"], betas1=hp["betas1"], omegas=hp["omegas"], weight_decay=hp["weight_decay"])
    if base == "adopt":
        updates.adopt_multi_(xs, gs, moments, vs, **common, beta2=hp["beta2"], eps=hp["eps"], step=step,
                             clip=hp["adopt_clip"])
    elif base == "adam":
        updates.qh_adamw_multi_(xs, gs, moments, vs, **common, beta2=hp["beta2"], eps=hp["eps"], step=step,
                                corrections1=corrections1)
    else:
        updates.sgdm_multi_(xs, gs, moments, **common)


def _run(base, n_moments, clip, wd, dtype, steps=3, ref_dtype=None, corrections=False, each_step=None):
    """``steps`` updates of the fused kernel on ``dtype`` tensors and of the torch path on ``ref_dtype``
    copies of the same values; returns both sets of (x, u_j, v). ``each_step(fused, reference)`` is
    called after every step, and the reference then restarts from the fused state (one step's
    rounding compared at a time)."""
    from titan_commopt.optim.local.update_triton import local_adaptive_

    ref_dtype = ref_dtype or dtype
    hp = dict(lr=3e-2, betas1=[0.9, 0.99, 0.6][:n_moments], omegas=[0.8 / n_moments] * n_moments,
              weight_decay=wd, beta2=0.95, eps=1e-2, adopt_clip=True)  # an ε that moves the result
    rho = 0.75  # exact in bf16: the bf16 kernel and the float32 reference clip to the same bound
    xs = _tensors(dtype, 1)
    moments = [[torch.zeros_like(x) for x in xs] for _ in range(n_moments)]
    vs = [torch.zeros_like(x) for x in xs] if base != "sgdm" else None
    copy = lambda ts: [t.to(ref_dtype, copy=True) for t in ts]  # noqa: E731
    ref = copy(xs), [copy(col) for col in moments], copy(vs) if vs is not None else None
    for step in range(1, steps + 1):
        if each_step is not None and step > 1:
            for a, b in zip(_flat(xs, moments, vs), _flat(*ref)):
                b.copy_(a)
        gs = _tensors(dtype, 100 + step, scale=2.0)
        scale = torch.tensor(0.37, dtype=torch.float64, device=DEVICE)
        corrections1 = [1 - 0.5 * b**step for b in hp["betas1"]] if corrections else None
        local_adaptive_(xs, gs, moments, vs, base=base, **{k: hp[k] for k in ("lr", "betas1", "omegas", "weight_decay")},
                        beta2=hp["beta2"], eps=hp["eps"], step=step, corrections1=corrections1,
                        adopt_clip=hp["adopt_clip"], clip=clip, clip_threshold=rho, clip_scale=scale)
        _torch_step(base, ref[0], copy(gs), ref[1], ref[2], clip=clip, rho=rho, scale=scale, hp=hp, step=step,
                    corrections1=corrections1)
        if each_step is not None:
            each_step(_flat(xs, moments, vs), _flat(*ref))
    return _flat(xs, moments, vs), _flat(*ref)


def _flat(xs, moments, vs):
    return xs + [t for col in moments for t in col] + (vs or [])


def _assert_close(fused, reference, rtol, atol):
    for i, (a, b) in enumerate(zip(fused, reference)):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("base", ["adopt", "adam", "sgdm"])
@pytest.mark.parametrize("n_moments", [1, 2, 3])
def test_fused_equals_torch_float32(base, n_moments):
    """Three steps (ADOPT's first only seeds v) with weight decay and the coordinate clip: float32
    results within round-off (1e-6 relative) of the torch path's."""
    fused, reference = _run(base, n_moments, "coordinate", 0.1, F32)
    _assert_close(fused, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("base", ["adopt", "adam"])
@pytest.mark.parametrize("clip,wd", [("none", 0.0), ("norm", 0.1), ("coordinate", 0.0)])
def test_fused_clip_and_weight_decay_combinations(base, clip, wd):
    fused, reference = _run(base, 2, clip, wd, F32)
    _assert_close(fused, reference, rtol=1e-6, atol=1e-7)


def test_fused_adam_with_mt_daos_switch_corrections():
    fused, reference = _run("adam", 2, "none", 0.1, F32, corrections=True)
    _assert_close(fused, reference, rtol=1e-6, atol=1e-7)


def test_adopt_first_step_only_seeds_v():
    fused, reference = _run("adopt", 2, "coordinate", 0.1, F32, steps=1)
    x0 = _tensors(F32, 1)
    n = len(SHAPES)
    assert all(torch.equal(a, b) for a, b in zip(fused[:n], x0))  # x untouched
    assert all(not t.any() for t in fused[n : 3 * n])  # momenta untouched
    assert all(torch.equal(a, b) for a, b in zip(fused[3 * n :], reference[3 * n :]))  # v = clip(g)² exactly


def _to_bf16_as_triton_stores(t):
    """float32 → bfloat16 as the kernel's store rounds: to nearest even when compiled (LLVM's
    fptrunc); toward zero in Triton 3.9's interpreter (its ``cast_impl`` drops the low 16 bits)."""
    if DEVICE != "cpu":
        return t.to(BF16)
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(BF16)  # exact: low bits are zero


@pytest.mark.parametrize("base", ["adopt", "adam", "sgdm"])
def test_fused_bfloat16_is_the_float32_update_rounded_once(base):
    """bf16 tensors: the kernel keeps every intermediate in float32 and rounds only what it stores, so
    each step is the float32 torch path (on the same bf16 inputs) rounded once to bf16 — the same bits
    but for a few percent of elements one ulp apart — checked step by step from the same state (torch's
    own bf16 path rounds every intermediate, so it is not the reference here)."""
    checked = []

    def each_step(fused, reference):
        assert all(t.dtype == BF16 for t in fused)
        expected = [_to_bf16_as_triton_stores(t) for t in reference]
        # one float32 result an ulp from the reference's (torch's CPU kernels contract a multiply-add
        # here and there) may round to the neighbouring bf16 value: 0.1–2 % of the elements, by one
        # bf16 ulp (2⁻⁷ relative at most), or, where x·(1−ηλ) − η·Δ cancels, by a float32 ulp of the
        # operands (atol: 2⁻¹⁶ of the tensor's largest value, 1/256 of its bf16 resolution)
        for a, b in zip(fused, expected):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-16 * float(b.abs().max()))
        mismatched = sum(int((a != b).sum()) for a, b in zip(fused, expected))
        assert mismatched <= 0.03 * sum(t.numel() for t in fused)
        checked.append(True)

    _run(base, 2, "coordinate", 0.1, BF16, ref_dtype=F32, each_step=each_step)
    assert len(checked) == 3


def test_noncontiguous_tensors_are_written_back():
    from titan_commopt.optim.local.update_triton import local_adaptive_

    x = torch.randn(6, 8, device=DEVICE).T  # non-contiguous
    g = torch.randn(8, 6, device=DEVICE)
    u, v = torch.zeros_like(x), torch.ones_like(x)
    xr, ur, vr = x.clone(), u.clone(), v.clone()
    hp = dict(lr=0.1, betas1=[0.9], omegas=[0.5], weight_decay=0.0, beta2=0.99, eps=1e-6, step=2)
    local_adaptive_([x], [g], [[u]], [v], base="adopt", **hp)
    updates.adopt_multi_([xr], [g], [[ur]], [vr], **hp)
    _assert_close([x, u, v], [xr, ur, vr], rtol=1e-6, atol=1e-7)


# ---- the optimizer with kernels = "triton" -------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEVICE)


def _train(name, kernels_choice, steps=4, **options):
    model = _model()
    opt = optim.make(name, model.named_parameters(), kernels=kernels_choice, **options)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        data = torch.randn(8, 16, generator=gen).to(DEVICE)
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], opt


@pytest.mark.parametrize("name,options", [
    ("MT-DAO", {"switch_at": 2}),  # ADOPT, one quasi-hyperbolic momentum, the switch after 2 updates
    ("DES-LOC-ADOPT", {}),  # ADOPT with the coordinate clip
    ("DES-LOC", {"beta1": [0.9, 0.99], "Ku": [48, 96], "omega": [0.5, 0.3], "clip": "norm"}),  # QH-Adam
    ("LocalAdam", {"base": "sgdm", "beta1": [0.9, 0.5], "Ku": [32, 32], "omega": [0.5, 0.5], "weight_decay": 0.1}),
])
def test_optimizer_with_triton_kernels_equals_torch(name, options):
    """Four steps of a tiny model, kernels = "triton" against "torch": the parameters within float32
    round-off (a wrong kernel fails here: checked by flipping a sign in it), and they did move."""
    fused, _ = _train(name, "triton", **options)
    reference, _ = _train(name, "torch", **options)
    _assert_close(fused, reference, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(fused, [p.detach() for p in _model().parameters()]))


def test_triton_on_cpu_without_the_interpreter_is_one_config_error(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the parameters are on a GPU: Triton runs there")
    monkeypatch.delenv("TRITON_INTERPRET")
    one_line = r"^\[commopt\] kernels = 'triton': the parameters are on cpu.*'auto' or 'torch'$"
    with pytest.raises(ConfigError, match=one_line):
        optim.make("MT-DAO", _model().named_parameters(), kernels="triton")
    optim.make("MT-DAO", _model().named_parameters(), kernels="auto")  # auto on CPU: the torch path, no error
