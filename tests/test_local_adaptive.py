"""DES-LOC / MT-DAO engine (``titan_commopt.optim.local.adaptive``): the exact special cases of
ALGORITHMS.md §3-§4, replica consistency at syncs, HSDP == single-process simulation, R bytes; the
streaming merges (additive, Streaming DiLoCo's lerp, strided fragments) and the overlapped outer steps
(Kale et al.'s delayed and eager) == single-process simulations of their formulas on 2 gloo processes.

Gradient convention of the FSDP test: gloo lacks AVG reduce-scatter, so FSDP2 is told to SUM over S
(``set_force_sum_reduction_for_comms`` plus ``set_gradient_divide_factor(1.0)``, since the
former alone still divides by |S|); each S rank's loss is the sum of its half-batch's
per-sample losses divided by the replica's whole batch size, so the S-summed gradient is the
replica's mean gradient and ``grad_scale = 1``.
"""

import copy
import dataclasses
import hashlib
import math

import pytest
import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.compress.minifloat import MiniFloatWire

from titan_commopt.optim import ShardShape, family_of, make, resolve
from titan_commopt.optim.local import sync as local_sync
from titan_commopt.optim.local import adaptive as la
from titan_commopt.optim.common import BaseHParams
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed
from tests.sim_utils import nesterov_outer_step_

F64 = torch.float64


# [optimizer]'s values under every optimizer below (torch Adam's defaults, no weight decay): a test's
# own lr, beta2, eps or weight_decay is set in the [commopt.local] table, which wins.
HP = BaseHParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def local_adaptive(params, topology=None, *, ledger=None, hparams=HP, names=None, **options):
    """LocalAdaptive over ``params`` (named p0, p1, … in order, or ``names``) with the ``[commopt.local]``
    ``options`` set (the family defaults, which are LocalAdam's preset, elsewhere)."""
    named = list(zip(names or [f"p{i}" for i in range(len(params))], params))
    return la.LocalAdaptive(named, topology or Topology.single(), resolve("LocalAdam", options, hparams),
                            ledger=ledger)


def _grads(seed, shapes, steps, replicas=1):
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(s, generator=g, dtype=F64) for s in shapes] for _ in range(replicas)] for _ in range(steps)]


# ---- one replica: the plain base optimizers ---------------------------------------------------------
@pytest.mark.parametrize("wd,ref_cls", [(0.0, torch.optim.Adam), (0.1, torch.optim.AdamW)])
def test_one_replica_adam_equals_torch(wd, ref_cls):
    shapes = [(6, 4), (4,)]
    init = [torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]
    # periods are irrelevant with one replica: syncs must be no-ops
    opt = local_adaptive(ours, lr=3e-2, beta1=(0.8,), beta2=0.95, eps=1e-6, weight_decay=wd,
                           Ku=(3,), Kv=5, Kx=2, outer="average")
    ref_opt = ref_cls(ref, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    for step, (grads,) in enumerate(_grads(1, shapes, 25)):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 10:  # the scheduler's lr change is read from param_groups
            for grp in opt.param_groups + ref_opt.param_groups:
                grp["lr"] = 1e-2
        opt.step()
        ref_opt.step()
    for p, q, t in zip(ours, ref, init):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
        assert (p - t).abs().max() > 1e-2  # it did train
    st = opt.state_dict()["state"][0]
    assert int(st["step"]) == 25
    torch.testing.assert_close(st["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])


def test_one_replica_adam_is_torchtitans_fused_adamw_bit_for_bit():
    """Plain Adam (one momentum, ω = 1) runs torch's fused AdamW kernel: on one replica, float32, the
    same bits as ``torch.optim.AdamW(fused=True)``, the optimizer torchtitan builds by default."""
    shapes = [(6, 4), (4,)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]
    opt = local_adaptive(ours, lr=3e-2, beta1=(0.8,), beta2=0.95, eps=1e-6, weight_decay=0.1,
                           Ku=(3,), Kv=5, Kx=2, outer="average")
    ref_opt = torch.optim.AdamW(ref, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True)
    for (grads,) in _grads(1, shapes, 12):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.float(), g.float()
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))


def test_one_replica_sgdm_equals_torch_sgd_momentum():
    beta, lr = 0.9, 0.05
    shapes = [(5, 3)]
    p = torch.randn(5, 3, dtype=F64, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt = local_adaptive([p], base="sgdm", lr=lr, beta1=(beta,), Ku=(1,), Kx=1, weight_decay=0.0)
    # EMA momentum u = (1−β)·buf of torch's undampened buffer → torch lr = η(1−β)
    ref_opt = torch.optim.SGD([q], lr=lr * (1 - beta), momentum=beta)
    x0 = p.detach().clone()
    for (grads,) in _grads(2, shapes, 30):
        p.grad, q.grad = grads[0].clone(), grads[0].clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13)
    assert (p.detach() - x0).abs().max() > 1e-2


def test_one_replica_quasi_hyperbolic_and_adopt_math():
    """N=2 momenta with ω and ADOPT against the formulas written out (float64)."""
    torch.manual_seed(0)
    x0 = torch.randn(7, dtype=F64)
    grads = [torch.randn(7, dtype=F64) for _ in range(12)]
    b, w, b2, lr, eps, wd = (0.5, 0.99), (0.3, 0.6), 0.9, 0.01, 1e-8, 0.1
    p = x0.clone().requires_grad_()
    opt = local_adaptive([p], base="adam", lr=lr, beta1=b, omega=w, Ku=(1, 1), beta2=b2,
                           eps=eps, weight_decay=wd, Kv=1, Kx=1)
    x, u, v = x0.clone(), [torch.zeros(7, dtype=F64) for _ in b], torch.zeros(7, dtype=F64)
    for n, g in enumerate(grads, 1):
        p.grad = g.clone()
        opt.step()
        u = [bj * uj + (1 - bj) * g for bj, uj in zip(b, u)]
        v = b2 * v + (1 - b2) * g * g
        num = (1 - sum(w)) * g + sum(wj * uj / (1 - bj**n) for wj, uj, bj in zip(w, u, b))
        x = x * (1 - lr * wd) - lr * num / ((v / (1 - b2**n)).sqrt() + eps)
    torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-14)

    p = x0.clone().requires_grad_()
    opt = local_adaptive([p], base="adopt", lr=lr, beta1=(0.9,), omega=(0.8,), Ku=(1,), beta2=b2,
                           eps=1e-6, weight_decay=0.0, Kv=1, Kx=1, adopt_clip=True)
    x, m, v = x0.clone(), torch.zeros(7, dtype=F64), None
    for n, g in enumerate(grads, 1):
        p.grad = g.clone()
        opt.step()
        if v is None:
            v = g * g
            continue
        gn = (g / v.sqrt().clamp(min=1e-6)).clamp(-((n - 1) ** 0.25), (n - 1) ** 0.25)
        m = 0.9 * m + 0.1 * gn
        x = x - lr * (0.2 * gn + 0.8 * m)
        v = b2 * v + (1 - b2) * g * g
    torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-14)


# ---- MT-DAO's switch from the base optimizer at the end of warm-up ----------------------------------
def _run(opt, params, data):
    out = []
    for grads in data:
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("base", ["adam", "adopt", "sgdm"])
def test_switch_runs_the_plain_base_optimizer_until_switch_at(base):
    shapes, k = [(5, 3), (4,)], 6
    data = _grads(7, shapes, 14)
    common = dict(base=base, lr=2e-2, beta2=0.97, eps=1e-6, weight_decay=0.05, Ku=(4,), Kv=4, Kx=2)
    a = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    b = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    # MT-DAO after the switch; before it the plain base optimizer with [optimizer] beta1 = 0.9
    switched = local_adaptive(a, beta1=(0.99,), omega=(0.8,), switch_at=k, **common)
    plain = local_adaptive(b, beta1=(0.9,), omega=(1.0,), **common)
    got, ref = _run(switched, a, data), _run(plain, b, data)
    for n in range(k):  # updates 1..k: bit for bit the plain base optimizer
        assert all(torch.equal(p, q) for p, q in zip(got[n], ref[n])), n
    for n in range(k, len(data)):  # updates k+1.. differ (configured β1, ω)
        assert any((p - q).abs().max() > 1e-6 for p, q in zip(got[n], ref[n])), n


def test_switch_to_the_same_momentum_is_no_switch_and_carries_the_buffer():
    """Adam's bias correction after the switch divides u_0 by the weight it has gathered,
    1 − β^k·β1^(n−k): switching to the same β and ω = 1 changes nothing (the buffer is carried)."""
    shapes = [(5, 3), (4,)]
    data = _grads(8, shapes, 12)
    common = dict(lr=2e-2, beta2=0.97, eps=1e-6, Ku=(4,), Kv=4, Kx=2)
    a = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    b = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    got = _run(local_adaptive(a, beta1=(0.9,), switch_at=5, **common), a, data)
    ref = _run(local_adaptive(b, beta1=(0.9,), **common), b, data)
    for p, q in zip(got[-1], ref[-1]):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    # and to another β: u_0 carried, divided by 1 − β_base^k·β1^(n−k) (written out here)
    x = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    got = _run(local_adaptive(x, beta1=(0.99,), switch_at=5, **common), x, data)
    want = [torch.ones(s, dtype=F64) for s in shapes]
    m, v = [torch.zeros(s, dtype=F64) for s in shapes], [torch.zeros(s, dtype=F64) for s in shapes]
    gathered = 1.0  # Π of the β each update used: u_0 has weight 1 − Π
    for n, (grads,) in enumerate(data, start=1):
        beta = 0.9 if n <= 5 else 0.99
        gathered *= beta
        for w, mi, vi, g in zip(want, m, v, grads):
            mi.mul_(beta).add_(g, alpha=1 - beta)
            vi.mul_(0.97).addcmul_(g, g, value=0.03)
            w.sub_(2e-2 * (mi / (1 - gathered)) / ((vi / (1 - 0.97**n)).sqrt() + 1e-6))
    for p, q in zip(got[-1], want):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_switch_survives_a_checkpoint_taken_before_it():
    shapes = [(4, 4), (3,)]
    data = _grads(9, shapes, 12)
    kw = dict(base="adopt", lr=1e-2, beta1=(0.999,), omega=(0.95,), Ku=(3,), Kv=3, Kx=3, switch_at=6,)
    a = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    opt = local_adaptive(a, **kw)
    _run(opt, a, data[:4])
    saved = copy.deepcopy(opt.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt2 = local_adaptive(b, **kw)
    opt2.load_state_dict(saved)
    got, ref = _run(opt2, b, data[4:]), _run(opt, a, data[4:])
    assert all(torch.equal(p, q) for p, q in zip(got[-1], ref[-1]))


def test_switch_at_warmup_reads_lr_scheduler_warmup_steps():
    hp = BaseHParams(beta1=0.9, warmup_steps=7)
    model = nn.Linear(3, 2)
    opt = make("MT-DAO", model.named_parameters(), Topology.single(), hp)
    assert (opt.switch_at, opt.param_groups[0]["eps"]) == (7, 1e-6)
    assert make("MT-DAO", model.named_parameters(), Topology.single(), hp, switch_at=0).switch_at == 0
    assert make("MT-DAO", model.named_parameters(), Topology.single(), hp, switch_at=3).switch_at == 3
    assert make("MT-DAO", model.named_parameters(), Topology.single(), BaseHParams()).switch_at == 0
    opt = make("MT-DAO-halflife", model.named_parameters(), Topology.single(), hp)
    g = opt.param_groups[0]
    assert (g["betas1"], g["omegas"], opt.periods, g["beta2"], g["eps"], opt.switch_at) == (
        (0.999,), (0.95,), local_sync.Periods(Kx=32, Ku=(693,), Kv=6931), 0.9999, 1e-6, 7)
    opt = make("DES-LOC-ADOPT", model.named_parameters(), Topology.single(), hp)
    g = opt.param_groups[0]
    assert (opt.options.options.base, g["betas1"], g["beta2"], g["eps"], g["weight_decay"], opt.periods) == (
        "adopt", (0.95,), 0.9999, 1e-6, 0.0, local_sync.Periods(Kx=32, Ku=(96,), Kv=192))
    with pytest.raises(ConfigError, match=r'^\[commopt.local\] switch_at = \'soon\': allowed is an integer >= 0 or "warmup"$'):
        resolve("MT-DAO", {"switch_at": "soon"})


@pytest.mark.parametrize("fragments,sync_delay", [(1, 0), (3, 1), (2, 2)])
def test_state_dict_roundtrip_continues_identically(fragments, sync_delay):
    """A checkpoint taken with fragments in flight (one replica: the Nesterov outer step still runs
    its syncs) merges them first; a run resumed from it continues bit for bit like the run that saved."""
    shapes = [(4, 4), (3,), (5, 2)]
    data = _grads(3, shapes, 20)
    kw = dict(lr=1e-2, beta1=(0.9, 0.99), omega=(0.5, 0.4), Ku=(3, 4), Kv=4, Kx=3, outer="nesterov",
              fragments=fragments, sync_delay=sync_delay)
    a = [torch.ones(s, dtype=F64, requires_grad=True) for s in shapes]
    opt = local_adaptive(a, **kw)
    for grads in data[:10]:
        for p, g in zip(a, grads[0]):
            p.grad = g.clone()
        opt.step()
    # step 10 leaves a sync in flight
    assert (opt.metrics()["syncs_in_flight"] > 0) == (sync_delay > 0)
    saved = copy.deepcopy(opt.state_dict())  # load_state_dict aliases same-dtype tensors
    assert opt.metrics()["syncs_in_flight"] == 0  # merged before saving
    b = [p.detach().clone().requires_grad_() for p in a]
    opt2 = local_adaptive(b, **kw)
    opt2.load_state_dict(saved)
    assert set(opt2.state[b[0]]) == {"step", "exp_avg", "exp_avg_1", "exp_avg_sq", "outer_anchor", "outer_buf"}
    assert int(opt2.state[b[0]]["step"]) == 10 and opt2.state[b[0]]["step"] is opt2.state[b[2]]["step"]  # one shared counter
    for grads in data[10:]:
        for p, q, g in zip(a, b, grads[0]):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and int(opt2.state[b[1]]["step"]) == 20


def test_fragments_schedule_and_options():
    # greedy by size, ties to the lower index: balanced and the same on every replica
    assert local_sync.partition([100, 10, 60, 50, 5], 2) == [0, 0, 1, 1, 0]  # 115 and 110 elements
    assert local_sync.partition([7, 7, 7], 3) == [0, 1, 2]
    assert local_sync.offsets(32, 1) == [0] and local_sync.offsets(32, 4) == [0, 8, 16, 24] and local_sync.offsets(2, 4) == [0, 0, 1, 1]
    # strided (Streaming DiLoCo): block k in fragment k mod F, the parameters outside a block round-robin
    names = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.ffn_norm.weight", "layers.1.w",
             "layers.2.w", "layers.13.w", "norm.weight", "output.weight", "l1.weight"]
    assert [local_sync.block_index(n) for n in names] == [None, 0, 0, 1, 2, 13, None, None, None]
    assert local_sync.strided_partition(names, 3) == [0, 0, 0, 1, 2, 0, 1, 2, 0]  # block 13 is the 4th: i = 3
    assert local_adaptive([torch.zeros(2, requires_grad=True) for _ in names], names=names, fragments=3,
                          fragment_layout="strided").schedule.fragment_of == [0, 0, 0, 1, 2, 0, 1, 2, 0]
    # an nn.Sequential's numbered blocks 0 and 2 fill both fragments; a fragment left empty is not one
    assert local_sync.strided_partition(["0.weight", "0.bias", "2.weight", "2.bias"], 2) == [0, 0, 1, 1]
    one_block = local_adaptive([torch.zeros(2, requires_grad=True) for _ in range(3)], fragments=3,
                               names=["layers.0.a", "layers.0.b", "layers.0.c"], fragment_layout="strided")
    assert one_block.schedule.fragments == 1 and one_block.schedule.fragment_of == [0, 0, 0]
    # "auto": Streaming DiLoCo's 3 blocks a fragment, at least 2 where there are 2 blocks; the blocks counted once
    assert local_adaptive([torch.zeros(2, requires_grad=True) for _ in names], names=names, fragments="auto",
                          fragment_layout="strided").schedule.fragment_of == [0, 0, 0, 1, 0, 1, 1, 0, 1]  # 4 blocks: F = 2
    llama8b = ["tok_embeddings.weight"] + [f"layers.{k}.{w}" for k in range(32) for w in ("attention.wq.weight", "ffn_norm.weight")]
    assert [la.fragment_count("auto", llama8b[:1 + 2 * L]) for L in (0, 1, 2, 3, 5, 6, 7, 32)] == [1, 1, 2, 2, 2, 2, 3, 11]
    assert la.fragment_count(4, llama8b) == 4 and la.fragment_count("auto", ["w1", "w2"]) == 1  # no blocks: one fragment
    assert la.settings(resolve("DES-LOC", {"fragments": "auto", "fragment_layout": "strided"}))["fragments"] == "auto"
    p = [torch.zeros(3, requires_grad=True) for _ in range(2)]
    assert local_adaptive(p, fragments=5).schedule.fragments == 2  # at most one fragment per parameter
    with pytest.raises(ConfigError, match=r"sync_delay = 4: allowed is an integer >= 0 below the smallest period > 0, "
                       r"\[commopt.local\] Kx = 4: "):
        local_adaptive(p, Ku=(4,), Kv=8, Kx=4, sync_delay=4)
    hp = BaseHParams()
    assert la.check(la.Config(fragments=4, sync_delay=3, Kx=4, Ku=[8], Kv=0), hp) == []
    with pytest.raises(ConfigError) as e:
        resolve("DES-LOC", {"sync_delay": la.PRESETS["DES-LOC"]["Kx"]})  # Kx is the smallest period
    assert "[commopt.local] sync_delay" in str(e.value)
    for bad in (0, "all"):
        with pytest.raises(ConfigError, match="fragments"):
            resolve("DES-LOC", {"fragments": bad})


# ---- config, registry, analytic bytes --------------------------------------------------------------
def r_sent(shapes, cfg, replicate_size):
    """la.local_r_bytes with every option of ``cfg`` set by the user."""
    shards = [ShardShape(n, tuple(s), tuple(s)) for n, s in shapes]
    return la.local_r_bytes(shards, resolve("LocalAdam", dataclasses.asdict(cfg)), replicate_size).sent


def test_registry_names():
    for name in ("DES-LOC", "DES-LOC-ADOPT", "MT-DAO", "MT-DAO-halflife", "LocalAdam", "DiLoCo"):
        assert family_of(name) is la.FAMILY
        preset = resolve(name).options
        assert all(getattr(preset, k) == v for k, v in la.PRESETS[name].items())


@pytest.mark.parametrize("name, key, value", [
    ("MT-DAO", "base", "adam"),  # MT-DAO-Adam, the MT-DAO paper's main algorithm
    ("DES-LOC", "clip", "none"),
    ("DiLoCo", "outer", "average"),
    ("LocalAdam", "Kx", 32),
])
def test_a_key_set_to_the_family_default_beats_the_preset(name, key, value):
    assert getattr(la.Config(), key) == value  # the family default ...
    resolved = resolve(name, {key: value})
    assert getattr(resolved.options, key) == value  # ... set by the user, kept
    assert key not in resolved.preset_keys()
    opt = make(name, nn.Linear(3, 2).named_parameters(), Topology.single(), **{key: value})
    assert getattr(opt.options.options, key) == value


def test_presets_and_config_errors():
    assert {"DES-LOC", "MT-DAO", "LocalAdam", "DiLoCo"} <= set(la.PRESETS)
    hp = BaseHParams(lr=1e-3, beta1=0.85, beta2=0.97, eps=1e-7, weight_decay=0.05)
    model = nn.Linear(3, 2)
    opt = make("LocalAdam", model.named_parameters(), Topology.single(), hp)
    g = opt.param_groups[0]
    # [optimizer] fills what the table leaves unset; the table wins where set
    assert (g["lr"], g["betas1"], g["beta2"], g["eps"], g["weight_decay"]) == (1e-3, (0.85,), 0.97, 1e-7, 0.05)
    opt = make("DES-LOC", model.named_parameters(), Topology.single(), hp)
    g = opt.param_groups[0]  # [optimizer]'s Adam β and eps (the study's winners), no weight decay
    assert g["lr"] == pytest.approx(1e-3 * la.PRESETS["DES-LOC"]["lr_scale"])  # the recommended multiplier
    assert (g["betas1"], g["beta2"], g["eps"], g["weight_decay"]) == ((0.85,), 0.97, 1e-7, 0.0)
    g = make("DES-LOC-ADOPT", model.named_parameters(), Topology.single(), hp).param_groups[0]
    assert (g["betas1"], g["beta2"], g["eps"], g["weight_decay"]) == ((0.95,), 0.9999, 1e-6, 0.0)
    assert (opt.periods, opt.options.options.clip, opt.switch_at) == (local_sync.Periods(32, (96,), 192), "coordinate", 0)
    g = make("DES-LOC", model.named_parameters(), Topology.single(), hp, beta2=0.97).param_groups[0]
    assert g["beta2"] == 0.97  # the user's value beats the preset's
    r = make("MT-DAO", model.named_parameters(), Topology.single(), hp, lr=0.5, weight_decay=0.0)
    g = r.param_groups[0]
    assert (r.options.options.base, g["betas1"], g["omegas"], g["beta2"], g["lr"], g["weight_decay"]) == (
        "adopt", (0.999,), (0.95,), 0.9999, 0.5, 0.0)
    dl = make("DiLoCo", model.named_parameters(), Topology.single(), hp)
    assert dl.options.options.outer == "nesterov" and dl.periods == local_sync.Periods(Kx=32, Ku=(0,), Kv=0)
    # "auto": power of two nearest the half-life (0.999 → 693 → 512; 0.9999 → 6931 → 8192)
    r = la.resolve_periods(la.Config(beta1=[0.999], Ku=["auto"], beta2=0.9999, Kv="auto", Kx="auto"), hp)
    assert r == local_sync.Periods(Kx=512, Ku=(512,), Kv=8192)


@pytest.mark.parametrize("table, hparams, line", [
    (dict(Ku=["auto"]), dict(beta1=0.0), '[commopt.local] Ku[0] = "auto": the power of two nearest the half-life of first '
     "momentum u0's decay, [optimizer] beta1 = 0.0, which only a decay in (0, 1) has; allowed is an integer >= 0"),
    (dict(Ku=[8, "auto"], beta1=[0.9, 0.0], omega=[0.5, 0.5]), {}, '[commopt.local] Ku[1] = "auto": the power of two '
     "nearest the half-life of first momentum u1's decay, [commopt.local] beta1[1] = 0.0,"),
    (dict(Kv="auto", beta2=0.0), {}, '[commopt.local] Kv = "auto": the power of two nearest the half-life of the second '
     "moment's decay, [commopt.local] beta2 = 0.0,"),
    (dict(Kv="auto"), dict(beta2=0.0), '[commopt.local] Kv = "auto": the power of two nearest the half-life of the second '
     "moment's decay, [optimizer] beta2 = 0.0,"),
    (dict(Kx="auto"), dict(beta2=0.0), '[commopt.local] Kx = "auto": the power of two nearest the half-life of the fastest '
     "state's decay, [optimizer] beta2 = 0.0,"),
    (dict(Kx=8, Ku=[8], Kv="auto", sync_delay=8), {}, '[commopt.local] sync_delay = 8: allowed is an integer >= 0 below the '
     "smallest period > 0, [commopt.local] Kx = 8: "),
    (dict(Kx="auto", Ku=[0], Kv=0, sync_delay=64), {}, '[commopt.local] sync_delay = 64: allowed is an integer >= 0 below '
     'the smallest period > 0, [commopt.local] Kx = "auto" (8): '),
])
def test_a_refused_derived_period_names_the_key_written_and_the_decay_it_comes_from(table, hparams, line):
    """A period the user wrote as "auto" is derived from a decay set elsewhere (the table's beta1/beta2,
    or [optimizer]'s): a refusal names both, one line."""
    (found,) = la.check(la.Config(**table), BaseHParams(**hparams))
    assert found.startswith(line), found


@pytest.mark.parametrize("bad, key", [
    (dict(switch_at="soon"), "switch_at"),
    (dict(switch_at=-1), "switch_at"),
    (dict(Ku=[32, 64], omega=[0.5]), "omega"),
    (dict(Ku=[32], beta1=[0.9, 0.99], omega=[1.0]), "beta1"),
    (dict(Kv=-1), "Kv"),
    (dict(Kx="often"), "Kx"),
    (dict(Ku=[16, 0.5], omega=[0.5, 0.5]), "Ku[1]"),
    (dict(omega=[1.5]), "omega"),
    (dict(clip="global"), "clip"),
])
def test_config_error_names_the_key(bad, key):
    hp = BaseHParams(lr=1e-3, beta1=0.85, beta2=0.97, eps=1e-7, weight_decay=0.05)
    with pytest.raises(ConfigError) as e:
        resolve("LocalAdam", bad, hp)  # the pre-flight resolution: before any process group exists
    msg = str(e.value)
    assert "\n" not in msg and f"[commopt.local] {key}" in msg, msg


def test_r_bytes_formula_and_paper_configurations():
    shapes = [("a", (100, 10)), ("b", (24,))]
    d = 1024
    cfg = la.Config(Kx=4, Ku=[8], Kv=16)
    assert r_sent(shapes, cfg, 2) == pytest.approx(d * (1 / 4 + 1 / 8 + 1 / 16) * 4)
    assert r_sent(shapes, la.Config(Kx=4, Ku=[8], Kv=16, transfer_dtype="bf16"), 2) == \
        pytest.approx(d * (1 / 4 + 1 / 8 + 1 / 16) * 2)
    assert r_sent(shapes, cfg, 1) == 0
    # SGDM has no second moment; N=2 momenta count twice; 0 = never
    assert r_sent(shapes, la.Config(base="sgdm", Kx=2, Ku=[4, 0], omega=[0.5, 0.5]), 4) == \
        pytest.approx(d * (1 / 2 + 1 / 4) * 4)
    # vs AdamW-HSDP (d fp32 per step): K = 32 all → 32/3; Ku = 3Kx, Kv = 6Kx → Kx/1.5; half-life
    ratio = lambda c: d * 4 / r_sent(shapes, c, 2)  # noqa: E731
    assert ratio(la.Config(Kx=32, Ku=[32], Kv=32)) == pytest.approx(32 / 3)
    assert ratio(la.Config(Kx=32, Ku=[96], Kv=192)) == pytest.approx(32 / 1.5)
    assert ratio(la.Config(Kx=32, Ku=[693], Kv=6931)) == pytest.approx(1 / (1 / 32 + 1 / 693 + 1 / 6931))


# ---- two replicas, no sharding ---------------------------------------------------------------------
def _hash(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _two_replicas(rank, world):
    import torch.distributed as dist

    topo = Topology(replicate=dist.group.WORLD)
    out = {}
    shapes = [(8, 5), (5,)]
    init = [torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(10 + i)) for i, s in enumerate(shapes)]

    # (a) SGDM Kx = Ku = 1 == synchronous DP SGD-momentum on the averaged gradient
    data = _grads(4, shapes, 15, replicas=world)
    ps = [t.clone().requires_grad_() for t in init]
    opt = local_adaptive(ps, topo, base="sgdm", lr=0.1, beta1=(0.9,), Ku=(1,), Kx=1,
                           weight_decay=0.0, transfer_dtype="native")
    ref = [t.clone().requires_grad_() for t in init]
    ref_opt = torch.optim.SGD(ref, lr=0.1 * (1 - 0.9), momentum=0.9)
    for step in data:
        for i, p in enumerate(ps):
            p.grad = step[rank][i].clone()
        for i, q in enumerate(ref):
            q.grad = sum(step[r][i] for r in range(world)) / world
        opt.step()
        ref_opt.step()
    out["sgdm_diff"] = max(float((p - q).detach().abs().max()) for p, q in zip(ps, ref))
    out["sgdm_moved"] = max(float((p.detach() - t).abs().max()) for p, t in zip(ps, init))

    # (b) DES-LOC Adam: replicas identical right after every Kx sync, different in between;
    # R bytes over 100 steps = d·(100/Kx + 100/Ku + 100/Kv) elements × 4 (fp32 on the wire)
    ledger = comm.CommLedger()
    ps = [t.clone().float().requires_grad_() for t in init]
    opt = local_adaptive(ps, topo, lr=1e-2, beta1=(0.9,), Ku=(20,), beta2=0.99, Kv=50, Kx=4,
                           weight_decay=0.1, ledger=ledger)
    data = _grads(5, shapes, 100, replicas=world)
    hashes, calls, in_sync = [], [], [opt.replicas_in_sync()]
    for step in data:
        for i, p in enumerate(ps):
            p.grad = step[rank][i].float()
        opt.step()
        hashes.append("".join(_hash(p) for p in ps))
        in_sync.append(opt.replicas_in_sync())
        calls.append(ledger.end_step().get("R_calls", 0))
    out["hashes"], out["calls"], out["bytes"] = hashes, calls, ledger.totals["R_sent"]
    out["in_sync"], out["replica_local"] = in_sync, opt.params_replica_local
    out["d"] = sum(p.numel() for p in ps)
    # bf16 transfer halves the bytes of the same schedule
    ledger2 = comm.CommLedger()
    ps2 = [t.clone().float().requires_grad_() for t in init]
    opt2 = local_adaptive(ps2, topo, lr=1e-2, Ku=(20,), Kv=50, Kx=4, transfer_dtype="bf16",
                            ledger=ledger2)
    for step in data:
        for i, p in enumerate(ps2):
            p.grad = step[rank][i].float()
        opt2.step()
    out["bytes_bf16"] = ledger2.current()["R_sent"]  # never closed: all 100 steps are "current"
    out["r_bytes_formula"] = r_sent([("a", shapes[0]), ("b", shapes[1])], la.Config(Kx=4, Ku=[20], Kv=50), world)
    return out


def _two_rank_world(rank, world):
    """Every 2-process check of this file in one spawn: two replicas, streaming sync, the norm clip
    over a TP mesh (each on its own optimizers, groups and mesh)."""
    return {"two_replicas": _two_replicas(rank, world), "streaming": _streaming(rank, world),
            "overlapped": _overlapped(rank, world), "tp_norm_clip": _tp_norm_clip(rank, world)}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_rank_world, 2)


@pytest.fixture(scope="module")
def two_replicas(two_rank_results):
    return [out["two_replicas"] for out in two_rank_results]


def test_two_replicas_sgdm_with_period_1_is_dp_sgd_momentum(two_replicas):
    for o in two_replicas:
        assert o["sgdm_diff"] < 1e-12 and o["sgdm_moved"] > 1e-2


def test_two_replicas_des_loc_in_sync_after_each_kx_sync_and_bytes(two_replicas):
    res = two_replicas
    d = res[0]["d"]
    for n in range(1, 101):
        same = res[0]["hashes"][n - 1] == res[1]["hashes"][n - 1]
        assert same == (n % 4 == 0), n
        assert res[0]["in_sync"][n] == same  # the adapter's drift check runs exactly then
        # one fused collective per sync step, none otherwise
        assert res[0]["calls"][n - 1] == (1 if n % 4 == 0 or n % 20 == 0 or n % 50 == 0 else 0)
    assert res[0]["in_sync"][0] and res[0]["replica_local"]
    expected = d * (100 / 4 + 100 / 20 + 100 / 50) * 4
    assert res[0]["bytes"] == res[1]["bytes"] == expected
    assert res[0]["r_bytes_formula"] * 100 == pytest.approx(expected)


def test_two_replicas_bf16_transfer_halves_the_bytes(two_replicas):
    d = two_replicas[0]["d"]
    assert two_replicas[0]["bytes_bf16"] == d * (100 / 4 + 100 / 20 + 100 / 50) * 4 / 2


# ---- streaming sync: fragments at staggered offsets, merged sync_delay steps after issue ---------------
STREAM_SHAPES = [(8, 5), (5,), (6, 6), (3,), (10, 2)]
STREAM_STEPS = 24  # a multiple of every period below; the last step leaves fragment 0 in flight
STREAM_CONFIGS = [  # (label, optimizer kwargs)
    *[(f"adam/F3/tau{tau}", dict(base="adam", beta1=(0.9,), Ku=(4,), Kv=8, Kx=4, weight_decay=0.1,
                                 fragments=3, sync_delay=tau)) for tau in (0, 1, 2)],
    ("adopt2/F2/tau2", dict(base="adopt", beta1=(0.5, 0.95), omega=(0.3, 0.6), Ku=(3, 6), beta2=0.9,
                            Kv=6, Kx=3, eps=1e-6, clip="norm", clip_threshold=0.5, fragments=2, sync_delay=2)),
    *[(f"diloco/F3/tau{tau}", dict(base="adam", beta1=(0.9,), Ku=(0,), Kv=0, Kx=4, outer="nesterov",
                                   outer_lr=0.7, outer_momentum=0.9, fragments=3, sync_delay=tau)) for tau in (0, 2)],
    ("sgdm/F4/tau1", dict(base="sgdm", beta1=(0.9,), Ku=(3,), Kx=3, weight_decay=0.01, fragments=4,
                          sync_delay=1)),
    # Streaming DiLoCo's merge, t ← α·t + (1 − α)·t̃
    ("diloco/F3/tau2/lerp0.5", dict(base="adam", beta1=(0.9,), Ku=(0,), Kv=0, Kx=4, outer="nesterov", outer_lr=0.7,
                                    outer_momentum=0.9, fragments=3, sync_delay=2, merge="lerp", merge_alpha=0.5)),
    ("adam/F3/tau1/lerp0", dict(base="adam", beta1=(0.9,), Ku=(4,), Kv=8, Kx=4, weight_decay=0.1, fragments=3,
                                sync_delay=1, merge="lerp")),
    # Streaming DiLoCo's strided fragments: blocks 0, 2 in fragment 0, block 1 in 1, the loose ones round-robin
    # (by size the same parameters would go [0, 0, 1, 0, 1])
    ("adam/F2/tau1/strided", dict(base="adam", beta1=(0.9,), Ku=(4,), Kv=8, Kx=4, fragments=2, sync_delay=1,
                                  fragment_layout="strided", names=["layers.1.w", "layers.0.w", "emb.weight",
                                                                    "layers.2.w", "out.weight"])),
    ("adam/F3/tau0/lerp0.25", dict(base="adam", beta1=(0.9,), Ku=(4,), Kv=8, Kx=4, weight_decay=0.1, fragments=3,
                                   sync_delay=0, merge="lerp", merge_alpha=0.25)),
]


def _stream_fragments(kw):
    """Each parameter's fragment: balanced by size, or for the strided layout, by hand from the names."""
    if kw.get("fragment_layout") == "strided":
        assert kw["fragments"] == 2
        assert kw["names"] == ["layers.1.w", "layers.0.w", "emb.weight", "layers.2.w", "out.weight"]
        return [1, 0, 0, 0, 1]  # blocks 1, 0 → k mod 2, emb (loose 0), block 2, out (loose 1)
    return local_sync.partition([math.prod(s) for s in STREAM_SHAPES], kw["fragments"])


def _stream_grads(replica, step):
    gen = torch.Generator().manual_seed(10_000 * replica + step)
    return [torch.randn(s, generator=gen, dtype=F64) for s in STREAM_SHAPES]


def _stream_init():
    gen = torch.Generator().manual_seed(77)
    return [torch.randn(s, generator=gen, dtype=F64) for s in STREAM_SHAPES]


def _simulate_streaming(kw):
    """The streaming algorithm written out for two replicas in one process: local steps by
    LocalAdaptive with one replica (no syncs), the schedule, snapshots, means and merges by hand."""
    F, tau, K_x = kw["fragments"], kw["sync_delay"], kw["Kx"]
    params = [[t.clone().requires_grad_() for t in _stream_init()] for _ in range(2)]
    opts = [local_adaptive(ps, **dict(kw, outer="average", fragments=1, sync_delay=0)) for ps in params]
    frag = _stream_fragments(kw)
    anchors = [t.clone() for t in _stream_init()]
    bufs = [torch.zeros_like(t) for t in anchors]
    kinds = [(f"u{j}", k) for j, k in enumerate(kw["Ku"])] + [("v", kw.get("Kv", 0)), ("x", K_x)]
    if kw["base"] == "sgdm":
        kinds = [(k, K) for k, K in kinds if k != "v"]

    def tensor(r, kind, i):
        st = opts[r].state[params[r][i]]
        if kind == "x":
            return params[r][i].data
        return st["exp_avg_sq"] if kind == "v" else st[la.moment_key(int(kind[1:]))]

    flight, hashes = [], []
    for n in range(1, STREAM_STEPS + 1):
        for r in range(2):
            for p, g in zip(params[r], _stream_grads(r, n)):
                p.grad = g
            opts[r].step()
        with torch.no_grad():
            for kind, K in kinds:  # issue: fragment f of a state with period K when (n − ⌊fK/F⌋) % K == 0
                for i, f in enumerate(frag):
                    if K > 0 and (n - f * K // F) % K == 0:
                        snaps = [tensor(r, kind, i).clone() for r in range(2)]
                        flight.append((n + tau, kind, i, snaps, (snaps[0] + snaps[1]) / 2))
            for entry in [e for e in flight if e[0] == n]:  # merge: t ← (t − t_issue) + mean_R(t_issue)
                flight.remove(entry)
                _, kind, i, snaps, mean = entry
                if kind == "x" and kw.get("outer") == "nesterov":  # the outer step on the snapshot's mean
                    delta = anchors[i] - mean
                    bufs[i].mul_(kw["outer_momentum"]).add_(delta)
                    mean = anchors[i].clone().sub_(delta.add_(bufs[i], alpha=kw["outer_momentum"]),
                                                   alpha=kw["outer_lr"])
                    anchors[i] = mean.clone()
                for r in range(2):
                    t = tensor(r, kind, i)
                    if kw.get("merge") == "lerp":  # Streaming DiLoCo: θ ← α·θ_local + (1 − α)·θ̃
                        alpha = kw.get("merge_alpha", 0.0)
                        t.copy_(alpha * t + (1 - alpha) * mean)
                        continue
                    t.sub_(snaps[r]).add_(mean)
                    if kind == "v":
                        t.clamp_min_(0)
        hashes.append([[_hash(p) for p in params[r]] for r in range(2)])
    return [[p.detach() for p in ps] for ps in params], hashes


def _streaming(rank, world):
    import torch.distributed as dist

    topo = Topology(replicate=dist.group.WORLD)
    out = {}
    for label, kw in STREAM_CONFIGS:
        ledger = comm.CommLedger()
        ps = [t.clone().requires_grad_() for t in _stream_init()]
        opt = local_adaptive(ps, topo, lr=1e-2, transfer_dtype="native", ledger=ledger, **kw)
        calls, hashes, in_sync = [], [], []
        for n in range(1, STREAM_STEPS + 1):
            for p, g in zip(ps, _stream_grads(rank, n)):
                p.grad = g
            opt.step()
            calls.append(ledger.end_step().get("R_calls", 0))
            hashes.append([_hash(p) for p in ps])
            in_sync.append(opt.replicas_in_sync())
        out[label] = dict(params=[p.detach().clone() for p in ps], calls=calls, hashes=hashes, in_sync=in_sync,
                          bytes=ledger.totals["R_sent"], in_flight=opt.metrics()["syncs_in_flight"],
                          replica_local=opt.params_replica_local)
        if label == "diloco/F3/tau2":  # a checkpoint with syncs in flight, resumed on fresh objects
            saved = copy.deepcopy(opt.state_dict())
            qs = [p.detach().clone().requires_grad_() for p in ps]
            opt2 = local_adaptive(qs, topo, lr=1e-2, transfer_dtype="native", **kw)
            opt2.load_state_dict(saved)
            for n in range(STREAM_STEPS + 1, STREAM_STEPS + 8):
                for p, q, g in zip(ps, qs, _stream_grads(rank, n)):
                    p.grad, q.grad = g.clone(), g.clone()
                opt.step()
                opt2.step()
            out["resumed_equal"] = all(torch.equal(p, q) for p, q in zip(ps, qs))
            out["resumed_n"] = int(opt2.state[qs[0]]["step"])
    return out


@pytest.fixture(scope="module")
def streaming_results(two_rank_results):
    return [out["streaming"] for out in two_rank_results]


@pytest.mark.parametrize("label, kw", STREAM_CONFIGS, ids=[label for label, _ in STREAM_CONFIGS])
def test_streaming_sync_equals_simulation_and_bytes(streaming_results, label, kw):
    res = streaming_results
    want, want_hashes = _simulate_streaming(dict(kw, lr=1e-2))
    F, tau, K_x = kw["fragments"], kw["sync_delay"], kw["Kx"]
    frag = _stream_fragments(kw)
    for rank in range(2):
        got = res[rank][label]
        for a, b in zip(got["params"], want[rank]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13, msg=label)
        assert got["hashes"] == [h[rank] for h in want_hashes] or tau > 0 or kw.get("outer") or kw.get("merge"), label
        assert got["in_flight"] == (1 if tau else 0)  # the last step's sync is still on the wire
        assert got["replica_local"]
        # one fused collective per step at most; bytes per period as the byte formula says
        assert max(got["calls"]) == 1, label
        cfg = la.Config(base=kw["base"], Kx=K_x, Ku=list(kw["Ku"]), Kv=kw.get("Kv", 0),
                        beta1=list(kw["beta1"]), omega=list(kw.get("omega", (1.0,) * len(kw["beta1"]))),
                        transfer_dtype="native", fragments=F, sync_delay=tau)
        shards = [ShardShape(str(i), s, s, itemsize=8) for i, s in enumerate(STREAM_SHAPES)]
        per_step = la.local_r_bytes(shards, resolve("LocalAdam", dataclasses.asdict(cfg)), 2).sent
        assert got["bytes"] == pytest.approx(per_step * STREAM_STEPS), label
        # replicas_in_sync: only with a single offset and no delay (never here after step 1)
        assert not any(got["in_sync"]), label
    if tau == 0 and kw.get("merge_alpha", 0.0) == 0.0:  # right after a fragment's x merges, the replicas agree on it
        for n in range(1, STREAM_STEPS + 1):
            for i, f in enumerate(frag):
                merged = (n - f * K_x // F) % K_x == 0
                same = res[0][label]["hashes"][n - 1][i] == res[1][label]["hashes"][n - 1][i]
                assert same == merged, (label, n, i)


def test_streaming_checkpoint_with_syncs_in_flight_resumes_identically(streaming_results):
    """diloco/F3/tau2 saved with syncs in flight, resumed on fresh objects on both replicas."""
    for res in streaming_results:
        assert res["resumed_equal"] and res["resumed_n"] == STREAM_STEPS + 7


# ---- overlapped outer steps (merge = delayed / eager): a period's sync lands at the next one ----------
def test_eager_pseudo_gradient_is_the_papers_formula():
    """Kale et al.'s eager outer gradient, written as their Algorithm 3 reads: replica m's fresh Δ_m(t)
    and every other replica's stale Δ_m'(t−1), each weighted 1/M."""
    gen = torch.Generator().manual_seed(5)
    M = 3
    stale = [torch.randn(4, 3, generator=gen, dtype=F64) for _ in range(M)]
    fresh = [torch.randn(4, 3, generator=gen, dtype=F64) for _ in range(M)]
    mean = sum(stale) / M
    for m in range(M):
        want = (fresh[m] + sum(stale[k] for k in range(M) if k != m)) / M
        inputs = [t.clone() for t in (mean, stale[m], fresh[m])]
        got = local_sync.eager_pseudo_gradient(*inputs, M)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (mean, stale[m], fresh[m])))  # inputs untouched
        assert not torch.allclose(got, mean) and not torch.allclose(got, fresh[m])


OVERLAP_CONFIGS = [  # (label, optimizer kwargs); STREAM_STEPS = 24 ends on a sync of x: it stays in flight
    *[(f"diloco/{merge}", dict(base="adam", beta1=(0.9,), Ku=(0,), Kv=0, Kx=4, outer="nesterov", outer_lr=0.7,
                               outer_momentum=0.9, merge=merge)) for merge in ("delayed", "eager")],
    ("localadam/F3/eager", dict(base="adam", beta1=(0.9,), Ku=(4,), Kv=4, Kx=4, weight_decay=0.1, fragments=3,
                                merge="eager")),
    ("desloc-adopt2/F2/delayed", dict(base="adopt", beta1=(0.5, 0.95), omega=(0.3, 0.6), Ku=(3, 6), beta2=0.9,
                                      Kv=6, Kx=3, eps=1e-6, clip="norm", clip_threshold=0.5, fragments=2,
                                      merge="delayed")),
    ("desloc-adopt2/F2/eager", dict(base="adopt", beta1=(0.5, 0.95), omega=(0.3, 0.6), Ku=(3, 6), beta2=0.9,
                                    Kv=6, Kx=3, eps=1e-6, outer="nesterov", fragments=2, merge="eager")),
    ("sgdm/eager", dict(base="sgdm", beta1=(0.9,), Ku=(3,), Kx=6, weight_decay=0.01, merge="eager")),
]
RESUMED = "desloc-adopt2/F2/eager"  # checkpointed mid-period (update 22) with a sync of every state in flight


def _simulate_overlapped(kw):
    """Kale et al.'s delayed / eager outer steps written out for M = 2 replicas in one process, from the
    paper's formulas on each replica's own sends (no engine state): local steps by LocalAdaptive with
    one replica (no syncs), the schedule, the means and the outer steps by hand. A parameter's wire
    value is Δ_r = a_r − x_r from its replica's anchor a_r, a state's its value; at the sync after
    update n of a tensor, with s_r what replica r sent at its previous sync (zeros before the first):

        delayed: Δ̃_r = (1/M)·Σ_r' s_r'                   eager: Δ̃_r = (1/M)·(w_r + Σ_{r'≠r} s_r')

    then x_r ← OuterOpt(a_r, Δ̃_r), a_r ← x_r (a state: t_r ← Δ̃_r, v ≥ 0), and s_r ← w_r."""
    M, F, merge = 2, kw.get("fragments", 1), kw["merge"]
    params = [[t.clone().requires_grad_() for t in _stream_init()] for _ in range(M)]
    local_kw = dict(kw, outer="average", fragments=1, merge="additive")
    opts = [local_adaptive(ps, lr=1e-2, transfer_dtype="native", **local_kw) for ps in params]
    frag = local_sync.partition([math.prod(s) for s in STREAM_SHAPES], F)
    anchors = [[t.clone() for t in _stream_init()] for _ in range(M)]
    bufs = [[torch.zeros_like(t) for t in _stream_init()] for _ in range(M)]
    kinds = [(f"u{j}", k) for j, k in enumerate(kw["Ku"])] + [("v", kw.get("Kv", 0)), ("x", kw["Kx"])]
    if kw["base"] == "sgdm":
        kinds = [(k, K) for k, K in kinds if k != "v"]
    sent = {}  # (kind, i) → what each replica sent at the previous sync

    def tensor(r, kind, i):
        st = opts[r].state[params[r][i]]
        if kind == "x":
            return params[r][i].data
        return st["exp_avg_sq"] if kind == "v" else st[la.moment_key(int(kind[1:]))]

    states = []
    for n in range(1, STREAM_STEPS + 1):
        for r in range(M):
            for p, g in zip(params[r], _stream_grads(r, n)):
                p.grad = g
            opts[r].step()
        with torch.no_grad():
            for kind, K in kinds:
                for i, f in enumerate(frag):
                    if not (K > 0 and (n - f * K // F) % K == 0):
                        continue
                    live = [tensor(r, kind, i) for r in range(M)]
                    wire = [anchors[r][i] - live[r] if kind == "x" else live[r].clone() for r in range(M)]
                    stale = sent.get((kind, i), [torch.zeros_like(w) for w in wire])
                    for r in range(M):
                        if merge == "eager":
                            delta = (wire[r] + sum(stale[q] for q in range(M) if q != r)) / M
                        else:
                            delta = sum(stale) / M
                        if kind != "x":
                            live[r].copy_(delta.clamp_min(0) if kind == "v" else delta)
                        elif kw.get("outer") == "nesterov":
                            mu, lr = kw.get("outer_momentum", 0.9), kw.get("outer_lr", 0.7)  # Config's defaults
                            bufs[r][i] = mu * bufs[r][i] + delta
                            live[r].copy_(anchors[r][i] - lr * (delta + mu * bufs[r][i]))
                            anchors[r][i] = live[r].clone()
                        else:  # averaging: outer SGD at lr 1
                            live[r].copy_(anchors[r][i] - delta)
                            anchors[r][i] = live[r].clone()
                    sent[(kind, i)] = wire
        states.append([[p.detach().clone() for p in params[r]] for r in range(M)])
    return states, anchors


def _overlapped(rank, world):
    import torch.distributed as dist

    topo = Topology(replicate=dist.group.WORLD)
    out = {}
    for label, kw in OVERLAP_CONFIGS:
        ledger = comm.CommLedger()
        ps = [t.clone().requires_grad_() for t in _stream_init()]
        opt = local_adaptive(ps, topo, lr=1e-2, transfer_dtype="native", ledger=ledger, **kw)
        calls, params, in_sync = [], [], []
        for n in range(1, STREAM_STEPS + 1):
            for p, g in zip(ps, _stream_grads(rank, n)):
                p.grad = g
            opt.step()
            calls.append(ledger.end_step().get("R_calls", 0))
            params.append([p.detach().clone() for p in ps])
            in_sync.append(opt.replicas_in_sync())
        with opt.global_params(ledger=comm.CommLedger()):
            global_model = [p.detach().clone() for p in ps]
        out[label] = dict(params=params, calls=calls, in_sync=in_sync, bytes=ledger.totals["R_sent"],
                          in_flight=opt.metrics()["syncs_in_flight"], global_model=global_model,
                          after_eval=[p.detach().clone() for p in ps])
    # A checkpoint mid-period with syncs in flight: the run that saves, one resumed from it on fresh
    # objects, and one that never saved take the same steps, bit for bit.
    kw = dict(OVERLAP_CONFIGS)[RESUMED]
    runs = {}
    for name in ("saves", "never"):
        ps = [t.clone().requires_grad_() for t in _stream_init()]
        opt = local_adaptive(ps, topo, lr=1e-2, transfer_dtype="native", **kw)
        for n in range(1, 31):
            if n == 23 and name == "saves":
                in_flight = opt.metrics()["syncs_in_flight"]
                saved = copy.deepcopy(opt.state_dict())
                qs = [p.detach().clone().requires_grad_() for p in ps]
                resumed = local_adaptive(qs, topo, lr=1e-2, transfer_dtype="native", **kw)
                resumed.load_state_dict(saved)
                runs["resumed"] = (qs, resumed)
            for p, g in zip(ps, _stream_grads(rank, n)):
                p.grad = g.clone()
            opt.step()
            if "resumed" in runs and name == "saves":
                qs, resumed = runs["resumed"]
                for q, g in zip(qs, _stream_grads(rank, n)):
                    q.grad = g.clone()
                resumed.step()
        runs[name] = ps
    out["checkpoint"] = dict(
        in_flight_at_save=in_flight, saved_keys=sorted(saved["state"][0]),
        saves_equals_never=all(torch.equal(p, q) for p, q in zip(runs["saves"], runs["never"])),
        resumed_equals_never=all(torch.equal(p, q) for p, q in zip(runs["resumed"][0], runs["never"])))
    return out


@pytest.fixture(scope="module")
def overlapped_results(two_rank_results):
    return [out["overlapped"] for out in two_rank_results]


@pytest.mark.parametrize("label, kw", OVERLAP_CONFIGS, ids=[label for label, _ in OVERLAP_CONFIGS])
def test_overlapped_outer_steps_equal_the_papers_formulas_and_bytes(overlapped_results, label, kw):
    """Two processes on gloo == the single-process simulation of the paper's formulas at every step;
    the overlap moves bytes in time only (the blocking schedule's bytes, one fused all-reduce a step)."""
    want, anchors = _simulate_overlapped(kw)
    F = kw.get("fragments", 1)
    for rank in range(2):
        got = overlapped_results[rank][label]
        for n in range(STREAM_STEPS):
            for a, b in zip(got["params"][n], want[n][rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{label} update {n + 1}")
        # on the wire: each sync issued less than a period (its fastest due state's) before the end
        periods = la.resolve_periods(resolve("LocalAdam", kw).options, HP)
        sched = local_sync.SyncSchedule(periods, [math.prod(s) for s in STREAM_SHAPES], F)
        kinds = dict(periods.kinds())
        assert got["in_flight"] == sum(1 for n in range(1, STREAM_STEPS + 1) if sched.due(n)
                                       and n + min(kinds[k] for k in sched.due(n)) > STREAM_STEPS) >= 1
        assert max(got["calls"]) == 1, label
        cfg = la.Config(base=kw["base"], Kx=kw["Kx"], Ku=list(kw["Ku"]), Kv=kw.get("Kv", 0), transfer_dtype="native",
                        beta1=list(kw["beta1"]), omega=list(kw.get("omega", (1.0,) * len(kw["beta1"]))), fragments=F)
        shards = [ShardShape(str(i), s, s, itemsize=8) for i, s in enumerate(STREAM_SHAPES)]
        per_step = la.local_r_bytes(shards, resolve("LocalAdam", dataclasses.asdict(cfg)), 2).sent
        assert got["bytes"] == pytest.approx(per_step * STREAM_STEPS), label
        # the global model: the anchor, averaged over R where eager replicas' anchors differ
        mean_anchor = [(a + b) / 2 for a, b in zip(*anchors)]
        own_anchor = anchors[rank]
        for g, a, m in zip(got["global_model"], own_anchor, mean_anchor):
            torch.testing.assert_close(g, m if kw["merge"] == "eager" else a, rtol=0, atol=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(got["after_eval"], got["params"][-1]))  # swapped back
    # eager replicas never agree after the first update; delayed ones right after each sync of every
    # fragment (update 1: ADOPT's first step only seeds v, so x has not moved anywhere yet)
    for n in range(1, STREAM_STEPS + 1):
        same = all(torch.equal(a, b) for a, b in zip(overlapped_results[0][label]["params"][n - 1],
                                                      overlapped_results[1][label]["params"][n - 1]))
        all_x = all((n - f * kw["Kx"] // F) % kw["Kx"] == 0 for f in range(F))
        claimed = overlapped_results[0][label]["in_sync"][n - 1]
        assert claimed == (kw["merge"] == "delayed" and all_x) and (same or not claimed), (label, n)
        assert same == claimed or n == 1, (label, n)


def test_overlapped_checkpoint_mid_period_changes_nothing(overlapped_results):
    """A checkpoint with every state's sync in flight completes the all-reduces and keeps their means as
    state without applying them: the run that saved, a run resumed from it and a run that never saved
    are bit-identical."""
    for res in overlapped_results:
        c = res["checkpoint"]
        assert c["in_flight_at_save"] == 2  # the syncs issued at updates 21 and 22 (Kx = Ku[0] = 3, F = 2)
        assert {"inflight_x", "sent_x", "inflight_exp_avg", "sent_exp_avg_1", "inflight_exp_avg_sq",
                "outer_anchor", "outer_buf"} <= set(c["saved_keys"])
        assert c["saves_equals_never"] and c["resumed_equals_never"]


def test_overlapped_merge_options():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ConfigError, match=r"^\[commopt.local\] merge = 'eager' with sync_delay = 1: allowed is "
                       r"sync_delay = 0 with merge = \"delayed\" or \"eager\""):
        local_adaptive(p, Kx=4, Ku=(4,), Kv=4, merge="eager", sync_delay=1)
    with pytest.raises(ConfigError, match=r"^\[commopt.local\] merge = 'streaming': allowed is one of 'additive', "
                       r"'lerp', 'delayed', 'eager'$"):
        resolve("DiLoCo", {"merge": "streaming"})
    with pytest.raises(ConfigError, match=r"^\[commopt.local\] merge_alpha = 0.5 with merge = 'eager': merge_alpha is "
                       r"read only by merge = \"lerp\""):
        resolve("DiLoCo", {"merge": "eager", "merge_alpha": 0.5, "sync_delay": 0})
    with pytest.raises(ConfigError, match=r"^\[commopt.local\] merge = 'eager' with sync_delay = 1"):
        resolve("DiLoCo", {"merge": "eager"})  # the preset's streaming sync_delay: an overlapped merge needs 0
    with pytest.raises(ConfigError, match=r"^\[commopt.local\] merge_alpha = 1.5"):
        resolve("DiLoCo", {"merge": "lerp", "merge_alpha": 1.5})
    assert resolve("DiLoCo", {"merge": "lerp", "merge_alpha": 0.5}).options.merge_alpha == 0.5
    for name in ("LocalAdam", "DES-LOC", "MT-DAO"):  # presets keep the blocking sync
        assert resolve(name).options.merge == "additive" and resolve(name).options.sync_delay == 0
        assert "merge" not in resolve(name).record()["state_shape"]
    streaming = resolve("DiLoCo").options  # DiLoCo streams as Streaming DiLoCo does (its authors' follow-up)
    assert (streaming.fragments, streaming.fragment_layout, streaming.sync_delay, streaming.merge,
            streaming.merge_alpha) == ("auto", "strided", 1, "lerp", 0.0)
    assert "merge" not in resolve("DiLoCo").record()["state_shape"]  # no state of its own: blocking checkpoints resume
    assert resolve("DiLoCo", {"merge": "eager", "sync_delay": 0}).record()["state_shape"]["merge"] == "eager"
    # averaging keeps an anchor under an overlapped merge; the Nesterov momentum only where it steps
    opt = local_adaptive(p, Kx=4, Ku=(0,), Kv=8, merge="delayed")
    assert set(opt.state[p[0]]) == {"step", "exp_avg", "exp_avg_sq", "outer_anchor", "inflight_x",
                                    "inflight_exp_avg_sq"}
    # one replica that averages syncs nothing: its model is x itself, not the anchor that never moves
    q = [torch.ones(3, dtype=F64, requires_grad=True)]
    opt = local_adaptive(q, Kx=2, Ku=(2,), Kv=2, merge="eager")
    for _ in range(3):
        q[0].grad = torch.ones(3, dtype=F64)
        opt.step()
    x = q[0].detach().clone()
    with opt.global_params():
        assert torch.equal(q[0], x) and not torch.equal(x, torch.ones(3, dtype=F64))


# ---- 2x2 HSDP (dp_replicate=2, fsdp=2) == single-process simulation of the two replicas ----------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


HSDP_CONFIGS = [
    # N = 2 quasi-hyperbolic momenta, desynced periods, norm clip (sums over S), Nesterov outer
    dict(base="adam", lr=2e-2, beta1=(0.5, 0.95), omega=(0.3, 0.6), Ku=(2, 3), beta2=0.9, Kv=6, Kx=2,
         eps=1e-8, weight_decay=0.05, clip="norm", clip_threshold=0.5, outer="nesterov", outer_lr=0.7,
         outer_momentum=0.9),
    dict(base="adopt", lr=1e-2, beta1=(0.9,), omega=(0.9,), Ku=(3,), beta2=0.99, Kv=4, Kx=2,
         eps=1e-6, weight_decay=0.0, clip="coordinate", clip_threshold=0.3),
    dict(base="sgdm", lr=5e-2, beta1=(0.9,), omega=(1.0,), Ku=(4,), Kx=3, weight_decay=0.01),
    # the FP4 outer wire: each rank's Δ = anchor − x of its own FSDP shard (blocks and scales per local shard)
    dict(base="adam", lr=2e-2, beta1=(0.9,), Ku=(2,), beta2=0.9, Kv=4, Kx=2, eps=1e-8, weight_decay=0.05,
         outer="nesterov", outer_lr=0.7, outer_momentum=0.9, outer_wire_dtype="fp4"),
]
HSDP_IDS = ["adam-qh2-norm-clip-nesterov", "adopt-coordinate-clip", "sgdm", "adam-nesterov-fp4-wire"]
STEPS, BATCH = 13, 8  # 13: the run ends between parameter syncs


def _batches(replica, step):
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(BATCH, 6, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)


def _simulate(cfg):
    """Two replicas in one process: local steps with Topology.single(), syncs done here by hand."""
    torch.manual_seed(0)
    base = _Net().double()
    models = [_Net().double() for _ in range(2)]
    for m in models:
        m.load_state_dict(base.state_dict())
    # the outer step is simulated below; a local optimizer with one replica would apply it again
    opts = [local_adaptive(list(m.parameters()), **dict(cfg, outer="average")) for m in models]
    anchors = [p.detach().clone() for p in models[0].parameters()]
    bufs = [torch.zeros_like(p) for p in anchors]
    for step in range(1, STEPS + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            x, y = _batches(r, step)
            m.zero_grad()
            ((m(x) - y) ** 2).sum(-1).mean().backward()
            o.step()

        def avg(get):
            for tensors in zip(*[get(o, m) for o, m in zip(opts, models)]):
                mean = sum(tensors) / 2
                for t in tensors:
                    t.copy_(mean)

        with torch.no_grad():
            for j, k in enumerate(cfg["Ku"]):
                if step % k == 0:
                    avg(lambda o, m: [o.state[p][la.moment_key(j)] for p in m.parameters()])
            if cfg["base"] != "sgdm" and step % cfg["Kv"] == 0:
                avg(lambda o, m: [o.state[p]["exp_avg_sq"] for p in m.parameters()])
            if step % cfg["Kx"] == 0:
                if "outer_wire_dtype" in cfg:  # mean_R x = anchor − mean_R decode(Δ_r), per FSDP shard (dim 0)
                    wire = MiniFloatWire(cfg["outer_wire_dtype"])
                    for i, ps in enumerate(zip(*[m.parameters() for m in models])):
                        pieces = []
                        for a, *xs in zip(*[t.chunk(2) for t in (anchors[i], *[p.data for p in ps])]):
                            decoded = [wire.decode(wire.encode(wire.to_blocks([a - x], [a.numel()]))) for x in xs]
                            mean = wire.from_blocks((decoded[0] + decoded[1]) / 2, [a.numel()])[0]
                            pieces.append(a - mean.view_as(a))
                        for p in ps:
                            p.data.copy_(torch.cat(pieces))
                else:
                    avg(lambda o, m: [p.data for p in m.parameters()])
                if cfg.get("outer") == "nesterov":
                    nesterov_outer_step_(models, anchors, bufs, cfg["outer_momentum"], cfg["outer_lr"])
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(mesh, grad_scale=1.0)
    replica, srank = topo.replica_index, topo.shard_rank
    out = []
    for cfg in HSDP_CONFIGS:
        torch.manual_seed(0)
        model = _Net().double()  # same init on every rank (as broadcast_parameters would make it)
        for layer in (model.l1, model.l2):
            fully_shard(layer, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)  # force-sum alone still divides by |S|
        ledger = comm.CommLedger()
        opt = local_adaptive(list(model.parameters()), topo, transfer_dtype="native", ledger=ledger, **cfg)
        for step in range(1, STEPS + 1):
            x, y = _batches(replica, step)
            half = slice(srank * BATCH // 2, (srank + 1) * BATCH // 2)
            model.zero_grad()
            (((model(x[half]) - y[half]) ** 2).sum(-1).sum() / BATCH).backward()  # S-sum = replica mean
            opt.step()
            ledger.end_step()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        out.append(dict(params=full, replica=replica, R_sent=ledger.totals.get("R_sent", 0.0),
                        d_local=sum(p.to_local().numel() for p in model.parameters()),
                        local_numels=[p.to_local().numel() for p in model.parameters()],
                        dtensor_state=all(type(v).__name__ == "DTensor" for k, v in
                                          opt.state[next(iter(model.parameters()))].items() if k != "step")))
    return out


@pytest.fixture(scope="module")
def hsdp_results():
    return run_distributed(_hsdp, 4)


@pytest.mark.parametrize("c", range(len(HSDP_CONFIGS)), ids=HSDP_IDS)
def test_hsdp_2x2_equals_single_process_simulation(hsdp_results, c):
    cfg = HSDP_CONFIGS[c]
    ref = _simulate(cfg)
    for rank_out in hsdp_results:
        o = rank_out[c]
        assert o["dtensor_state"]
        for k, v in ref[o["replica"]].items():
            torch.testing.assert_close(o["params"][k], v, rtol=1e-10, atol=1e-12, msg=f"cfg {c} {k}")
        # R bytes: every local-shard element of each state on its own schedule, float64 native (x: its codes
        # and scales with the FP4 wire)
        per_d = sum(STEPS // k for k in cfg["Ku"]) + (STEPS // cfg["Kv"] if cfg["base"] != "sgdm" else 0)
        x = (MiniFloatWire(cfg["outer_wire_dtype"]).nbytes(o["local_numels"]) if "outer_wire_dtype" in cfg
             else o["d_local"] * 8)
        assert o["R_sent"] == o["d_local"] * per_d * 8 + x * (STEPS // cfg["Kx"])
    # mid-period the two replicas really differ (so the comparison per replica means something)
    assert any(not torch.allclose(ref[0][k], ref[1][k]) for k in ref[0])


# ---- norm clip over a TP mesh: sharded and replicated parameters counted once ----------------------
def _tp_norm_clip(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    topo = Topology.from_mesh(mesh)  # T = the 2 ranks, no R, no S
    shapes, places = [(4, 3), (5,), (2, 6)], [[Shard(0)], [Replicate()], [Shard(1)]]
    init = [torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(20 + i)) for i, s in enumerate(shapes)]
    ps = [nn.Parameter(distribute_tensor(t.clone(), mesh, pl)) for t, pl in zip(init, places)]
    kw = dict(lr=0.1, beta1=(0.9,), beta2=0.99, clip="norm", clip_threshold=0.5, Ku=(1,), Kv=1, Kx=1,
              weight_decay=0.1)
    opt = local_adaptive(ps, topo, **kw)
    data = _grads(7, shapes, 6)
    for (grads,) in data:
        for p, g, pl in zip(ps, grads, places):
            p.grad = distribute_tensor(g.clone(), mesh, pl)
        opt.step()
    return [p.full_tensor() for p in ps], sum(float(g.norm() ** 2) for g in data[0][0]) ** 0.5


def test_norm_clip_over_tp_shards_equals_single_process(two_rank_results):
    res = [out["tp_norm_clip"] for out in two_rank_results]
    shapes = [(4, 3), (5,), (2, 6)]
    init = [torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(20 + i)) for i, s in enumerate(shapes)]
    ps = [t.clone().requires_grad_() for t in init]
    opt = local_adaptive(ps, lr=0.1, beta1=(0.9,), beta2=0.99, clip="norm", clip_threshold=0.5, Ku=(1,),
                           Kv=1, Kx=1, weight_decay=0.1)
    for (grads,) in _grads(7, shapes, 6):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    assert res[0][1] > 0.5  # the clip is active
    for full, _ in res:
        for a, b in zip(full, ps):
            torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-14)


def test_state_is_eager_so_dcp_does_not_run_a_dummy_step():
    """torch DCP's _init_optim_state steps an optimizer with empty state once (zero grads, lr 0):
    that would shift the sync schedule and put v = 0 into ADOPT. The state exists from the start."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    p = torch.ones(3, dtype=F64, requires_grad=True)
    opt = local_adaptive([p], base="adopt", Ku=(2,), Kv=2, Kx=2)
    assert opt.replicas_in_sync()
    _init_optim_state(opt)
    assert int(opt.state[p]["step"]) == 0 and p.grad is None
    p.grad = torch.full((3,), 2.0, dtype=F64)
    opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], torch.full((3,), 4.0, dtype=F64))  # ADOPT: v = g²
