"""The shared update functions (``optim/updates.py``) against torch.optim or the formulas written out,
and the orthogonalization module (``optim/orthogonalize.py``), alone and row-sharded over 2 ranks."""

import math

import pytest
import torch

from titan_commopt.optim import updates
from titan_commopt.optim.orthogonalize import cholesky_qr2, gathered_qr, newton_schulz, orthogonalize
from tests.dist_utils import run_distributed

F64 = torch.float64
STEPS = 25


def _grads(shape, dtype, steps=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=F64).to(dtype) for _ in range(steps)]


def _start(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


# ---- Adam family ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("wd,ref_cls", [(0.0, torch.optim.Adam), (0.1, torch.optim.AdamW)])
@pytest.mark.parametrize("b2,steps", [(0.95, STEPS), (0.5, 60)])
def test_adamw_is_torch_bit_for_bit(dtype, wd, ref_cls, b2, steps):
    lr, b1, eps = 3e-2, 0.8, 1e-6
    if b2 == 0.5:  # a step where math.sqrt(1−β2^t) and torch's (1−β2^t) ** 0.5 round apart
        assert (1 - b2**53) ** 0.5 != math.sqrt(1 - b2**53)
    x = _start((6, 4), dtype)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    ref = x.clone().requires_grad_()
    ref_opt = ref_cls([ref], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    for t, g in enumerate(_grads(x.shape, dtype, steps), 1):
        if t == 10:  # a scheduler's lr change
            lr = ref_opt.param_groups[0]["lr"] = 1e-2
        updates.adamw_(x, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=t)
        ref.grad = g.clone()
        ref_opt.step()
    st = ref_opt.state[ref]
    assert torch.equal(x, ref.detach()) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fused_adamw_multi_is_torchs_fused_adamw_bit_for_bit(dtype):
    """``fused=True`` is torch.optim.AdamW(fused=True) (what torchtitan builds) to the last bit; the
    multi-tensor form agrees with it to round-off."""
    shapes = [(6, 4), (5,), (3, 2)]
    lr, b1, b2, eps, wd = 3e-2, 0.8, 0.95, 1e-6, 0.1
    xs = [_start(s, dtype, seed=i) for i, s in enumerate(shapes)]
    plain = [x.clone() for x in xs]
    ms, vs, pms, pvs = ([torch.zeros_like(x) for x in xs] for _ in range(4))
    refs = [x.clone().requires_grad_() for x in xs]
    ref_opt = torch.optim.AdamW(refs, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
    for t in range(1, STEPS + 1):
        gs = [_grads(s, dtype, 1, seed=100 * t + i)[0] for i, s in enumerate(shapes)]
        if t == 10:  # a scheduler's lr change
            lr = ref_opt.param_groups[0]["lr"] = 1e-2
        hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=t)
        updates.adamw_multi_(xs, gs, ms, vs, **hp, fused=True)
        updates.adamw_multi_(plain, gs, pms, pvs, **hp)
        for r, g in zip(refs, gs):
            r.grad = g.clone()
        ref_opt.step()
    for x, r, m, v in zip(xs, refs, ms, vs):
        st = ref_opt.state[r]
        assert torch.equal(x, r.detach()) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    for x, y in zip(xs + ms + vs, plain + pms + pvs):
        torch.testing.assert_close(x, y, **tol)
    # the fused path needs one dtype and device: otherwise the multi-tensor form runs
    assert not updates.fused_adamw_takes(xs, [g.double() for g in gs], ms, vs) or dtype == F64


def test_adamw_without_bias_correction():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    x = _start(7, F64)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    xr, mr, vr = x.clone(), m.clone(), v.clone()
    for t, g in enumerate(_grads(7, F64), 1):
        updates.adamw_(x, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=t,
                       bias_correction=False)
        mr, vr = b1 * mr + (1 - b1) * g, b2 * vr + (1 - b2) * g * g
        xr = xr * (1 - lr * wd) - lr * mr / (vr.sqrt() + eps)
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-14)


def test_qh_adamw_one_momentum_is_adamw_and_n_momenta_follow_the_formula():
    lr, b2, eps, wd = 1e-2, 0.9, 1e-8, 0.1
    hp = dict(lr=lr, beta2=b2, eps=eps, weight_decay=wd)
    # N = 1, ω = 1: the same operations as adamw_ (torch's rounding), bit for bit
    x, y = _start(9, torch.float32), _start(9, torch.float32)
    mx, vx, my, vy = (torch.zeros(9) for _ in range(4))
    for t, g in enumerate(_grads(9, torch.float32), 1):
        updates.qh_adamw_(x, g, [mx], vx, betas1=(0.8,), omegas=(1.0,), step=t, **hp)
        updates.adamw_(y, g, my, vy, beta1=0.8, step=t, **hp)
    assert torch.equal(x, y) and torch.equal(mx, my) and torch.equal(vx, vy)
    # N = 2 (MT-DAO, Algorithm 1): x ← x(1−ηλ) − η[(1−Σω)g + Σ ω_j û_j] / (√v̂ + ε)
    b, w = (0.5, 0.99), (0.3, 0.6)
    x = _start(7, F64)
    us, v = [torch.zeros(7, dtype=F64) for _ in b], torch.zeros(7, dtype=F64)
    xr, ur, vr = x.clone(), [u.clone() for u in us], v.clone()
    for n, g in enumerate(_grads(7, F64), 1):
        updates.qh_adamw_(x, g, us, v, betas1=b, omegas=w, step=n, **hp)
        ur = [bj * uj + (1 - bj) * g for bj, uj in zip(b, ur)]
        vr = b2 * vr + (1 - b2) * g * g
        num = (1 - sum(w)) * g + sum(wj * uj / (1 - bj**n) for wj, uj, bj in zip(w, ur, b))
        xr = xr * (1 - lr * wd) - lr * num / ((vr / (1 - b2**n)).sqrt() + eps)
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-14)


def test_adam_direction_is_the_update_adamw_applies():
    b1, b2, eps, lr = 0.9, 0.95, 1e-8, 1e-2
    m, v = torch.zeros(5, 3), torch.zeros(5, 3)
    x = _start((5, 3), torch.float32)
    mx, vx = m.clone(), v.clone()
    for t, g in enumerate(_grads((5, 3), torch.float32), 1):
        d = updates.adam_direction_(g, m, v, beta1=b1, beta2=b2, eps=eps, step=t)
        before = x.clone()
        updates.adamw_(x, g, mx, vx, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=0.0, step=t)
        assert torch.equal(m, mx) and torch.equal(v, vx)  # the same moments
        expect = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)  # m̂ / (√v̂ + ε)
        torch.testing.assert_close(d, expect, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(before - lr * d, x, rtol=1e-6, atol=1e-7)


# ---- Lion, SGD-momentum, ADOPT --------------------------------------------------------------------
def test_lion_follows_the_formula():
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    x, m = _start(11, F64), torch.zeros(11, dtype=F64)
    xr, mr = x.clone(), m.clone()
    for g in _grads(11, F64):
        updates.lion_(x, g, m, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
        xr = xr * (1 - lr * wd) - lr * torch.sign(b1 * mr + (1 - b1) * g)
        mr = b2 * mr + (1 - b2) * g
    assert torch.equal(x, xr)  # a sign step: the same bits as long as no sign flips
    torch.testing.assert_close(m, mr, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_heavy_ball_then_descend_is_torch_sgd_momentum_bit_for_bit(dtype):
    """DeMo's base: m ← βm + g; x ← x − ηm (with λ = 0; torch's SGD decay is not decoupled)."""
    lr, beta = 0.05, 0.9
    x = _start((5, 3), dtype)
    m = torch.zeros_like(x)
    ref = x.clone().requires_grad_()
    ref_opt = torch.optim.SGD([ref], lr=lr, momentum=beta, foreach=False)
    for g in _grads(x.shape, dtype):
        updates.descend_(x, updates.heavy_ball_(m, g, beta), lr)
        ref.grad = g.clone()
        ref_opt.step()
    assert torch.equal(x, ref.detach()) and torch.equal(m, ref_opt.state[ref]["momentum_buffer"])


def test_sgdm_is_torch_sgd_at_scaled_lr_and_quasi_hyperbolic_otherwise():
    lr, beta = 0.05, 0.9
    x = _start((5, 3), F64)
    u = torch.zeros_like(x)
    ref = x.clone().requires_grad_()
    # EMA momentum u = (1−β)·buf of torch's undampened buffer → torch lr = η(1−β)
    ref_opt = torch.optim.SGD([ref], lr=lr * (1 - beta), momentum=beta)
    for g in _grads(x.shape, F64):
        updates.sgdm_(x, g, [u], lr=lr, betas1=(beta,), omegas=(1.0,), weight_decay=0.0)
        ref.grad = g.clone()
        ref_opt.step()
    torch.testing.assert_close(x, ref.detach(), rtol=1e-12, atol=1e-13)
    # QHM with two momenta and decoupled decay
    b, w, wd = (0.5, 0.95), (0.4, 0.5), 0.1
    x = _start(6, F64)
    us = [torch.zeros(6, dtype=F64) for _ in b]
    xr, ur = x.clone(), [u.clone() for u in us]
    for g in _grads(6, F64):
        updates.sgdm_(x, g, us, lr=lr, betas1=b, omegas=w, weight_decay=wd)
        ur = [bj * uj + (1 - bj) * g for bj, uj in zip(b, ur)]
        xr = xr * (1 - lr * wd) - lr * ((1 - sum(w)) * g + sum(wj * uj for wj, uj in zip(w, ur)))
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("clip", [True, False])
def test_adopt_follows_the_formula(clip):
    lr, b1, w, b2, eps, wd = 1e-2, 0.9, 0.8, 0.9, 1e-6, 0.1
    x0 = _start(7, F64)
    x, u, v = x0.clone(), torch.zeros(7, dtype=F64), torch.zeros(7, dtype=F64)
    xr, ur, vr = x0.clone(), u.clone(), None
    for n, g in enumerate(_grads(7, F64), 1):
        updates.adopt_(x, g, [u], v, lr=lr, betas1=(b1,), omegas=(w,), beta2=b2, eps=eps, weight_decay=wd,
                       step=n, clip=clip)
        if vr is None:  # step 1 only initializes v = g²
            vr = g * g
            assert torch.equal(x, x0) and torch.equal(v, vr)
            continue
        gn = g / vr.sqrt().clamp(min=eps)  # normalized by the previous v
        if clip:
            gn = gn.clamp(-((n - 1) ** 0.25), (n - 1) ** 0.25)
        ur = b1 * ur + (1 - b1) * gn
        xr = xr * (1 - lr * wd) - lr * ((1 - w) * gn + w * ur)
        vr = b2 * vr + (1 - b2) * g * g
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(v, vr, rtol=1e-12, atol=1e-14)


def test_decoupled_decay_skips_a_zero_decay():
    x = _start(4, torch.float32)
    assert updates.decoupled_decay_(x, 0.1, 0.0) is x and torch.equal(x, _start(4, torch.float32))
    torch.testing.assert_close(updates.decoupled_decay_(x.clone(), 0.1, 0.5), x * 0.95)


# ---- multi-tensor forms = the single-tensor kernels, bit for bit (CPU) ------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["adam", "qh_adam", "adopt", "sgdm"])
def test_multi_tensor_kernels_equal_single_tensor_bit_for_bit(name, dtype):
    shapes = [(6, 4), (5,), (3, 2, 2)]
    omegas = (1.0,) if name == "adam" else (0.3, 0.6)
    betas1 = (0.8,) if name == "adam" else (0.5, 0.95)
    kw = dict(lr=3e-2, betas1=betas1, omegas=omegas, weight_decay=0.1)
    single = [[_start(s, dtype, seed=i) for i, s in enumerate(shapes)]]
    multi = [[t.clone() for t in single[0]]]
    for copy in (single, multi):
        copy.append([[torch.zeros_like(x) for x in copy[0]] for _ in betas1])  # moments [j][i]
        copy.append([torch.zeros_like(x) for x in copy[0]])  # v
    for t in range(1, 13):
        gs = [_grads(s, dtype, 1, seed=100 * t + i)[0] for i, s in enumerate(shapes)]
        for i, g in enumerate(gs):
            x, us, v = single[0][i], [u[i] for u in single[1]], single[2][i]
            if name == "sgdm":
                updates.sgdm_(x, g, us, **kw)
            elif name == "adopt":
                updates.adopt_(x, g, us, v, **kw, beta2=0.9, eps=1e-6, step=t)
            else:
                updates.qh_adamw_(x, g, us, v, **kw, beta2=0.9, eps=1e-6, step=t)
        xs, moments, vs = multi
        if name == "sgdm":
            updates.sgdm_multi_(xs, gs, moments, **kw)
        elif name == "adopt":
            updates.adopt_multi_(xs, gs, moments, vs, **kw, beta2=0.9, eps=1e-6, step=t)
        else:
            updates.qh_adamw_multi_(xs, gs, moments, vs, **kw, beta2=0.9, eps=1e-6, step=t)
    flat = lambda c: [c[0], *c[1], c[2]]  # noqa: E731
    for a, b in zip(flat(single), flat(multi)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(single[0][0], _start(shapes[0], dtype, seed=0))


# ---- orthogonalization ---------------------------------------------------------------------------
def _with_singular_values(m, n, values, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = len(values)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=F64))
    return U, torch.as_tensor(values, dtype=F64), V


@pytest.mark.parametrize("shape", [(24, 10), (10, 24), (16, 16)])
def test_newton_schulz_is_close_to_orthogonal(shape):
    m, n = shape
    U, S, V = _with_singular_values(m, n, torch.linspace(1.0, 10.0, min(shape)).tolist())
    Y = newton_schulz(U @ torch.diag(S) @ V.T, steps=5) / max(1.0, m / n) ** 0.5  # drop Muon's scale
    # U f(S) Vᵀ: the singular vectors kept, the singular values pulled toward 1
    core = U.T @ Y @ V
    f = core.diagonal()
    torch.testing.assert_close(core, torch.diag(f), rtol=0, atol=1e-10)
    assert f.min() > 0.6 and f.max() < 1.25
    assert newton_schulz(torch.randn(3, 4, 5), 5).shape == (3, 4, 5)
    assert newton_schulz(torch.randn(7), 5).shape == (7,)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cholesky_qr2_is_qr_up_to_column_signs(dtype):
    U, S, V = _with_singular_values(40, 6, [1.0, 2, 3, 4, 5, 6])
    P = (U @ torch.diag(S) @ V.T).to(dtype)
    out = cholesky_qr2([P], [[]])[0]
    assert out is not None and out.dtype == dtype
    Q = torch.linalg.qr(P).Q
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, Q * (out * Q).sum(0).sign(), rtol=0, atol=tol)
    torch.testing.assert_close(out.T @ out, torch.eye(6, dtype=dtype), rtol=0, atol=tol)
    # "qr" is Householder QR itself, and every method keeps the list's order
    got = orthogonalize([P, 2 * P], [[], []], "qr")
    assert torch.equal(got[0], Q) and torch.equal(got[1], torch.linalg.qr(2 * P).Q)


def test_ill_conditioned_p_falls_back_to_qr():
    U, S, V = _with_singular_values(40, 6, [1.0, 1, 1, 1, 1, 1e-9])  # cond 1e9: beyond even float64's
    P = U @ torch.diag(S) @ V.T
    assert cholesky_qr2([P], [[]]) == [None]
    out = orthogonalize([P], [[]], "cholesky_qr")[0]
    assert torch.equal(out, gathered_qr(P, []))
    torch.testing.assert_close(out.T @ out, torch.eye(6, dtype=F64), rtol=0, atol=1e-10)
    # float32 with cond 1e4 (beyond float32 CholeskyQR2): retried in float64, still float32 out
    mid = (U @ torch.diag(torch.logspace(0, 4, 6, dtype=F64)) @ V.T).float()
    out32 = cholesky_qr2([mid], [[]])[0]
    assert out32 is not None and out32.dtype == torch.float32
    torch.testing.assert_close(out32.T @ out32, torch.eye(6), rtol=0, atol=1e-5)


def _row_sharded(rank, world):
    """Three P's with rows split unevenly over 2 ranks (7 + 4, 11 + 0, 7 + 4), the last one too
    ill-conditioned for CholeskyQR2, orthogonalized together (the Grams fused in one collective)."""
    import torch.distributed as dist

    rows = [("S", dist.group.WORLD)]
    Ps = [U @ torch.diag(S) @ V.T for U, S, V in (_with_singular_values(11, 3, [1.0, 2, 3], seed=0),
                                                   _with_singular_values(11, 3, [1.0, 2, 3], seed=1),
                                                   _with_singular_values(11, 3, [1.0, 1, 1e-9], seed=2))]
    cuts = [7, 11, 7]  # rank 0 holds rows [0, cut), rank 1 rows [cut, 11)
    mine = [P[:cut] if rank == 0 else P[cut:] for P, cut in zip(Ps, cuts)]
    out = {method: orthogonalize(mine, [rows] * len(mine), method) for method in ("cholesky_qr", "qr")}
    return dict(Ps=Ps, out=out)


def test_row_sharded_orthogonalize_equals_unsharded():
    results = run_distributed(_row_sharded, 2)
    Ps = results[0]["Ps"]
    for method in ("cholesky_qr", "qr"):
        want = orthogonalize(Ps, [[] for _ in Ps], method)
        for i, P in enumerate(Ps):
            got = torch.cat([results[0]["out"][method][i], results[1]["out"][method][i]])
            if method == "qr" or i == 2:  # QR of the gathered rows, which are P itself: the same bits
                assert torch.equal(got, want[i]), (method, i)
            else:  # the Gram summed over two shards: equal up to rounding
                torch.testing.assert_close(got, want[i], rtol=0, atol=1e-12)
