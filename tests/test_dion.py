"""Dion (titan_commopt/optim/dion/): the equations, the routing, and Theorem 2.1 on real meshes.

Gradient convention of the distributed tests (the torchtitan one, TORCHTITAN_NOTES.md §8): every rank
divides its *summed* loss by the global sample count, and FSDP2 SUMs gradients over S (gradient
divide factor 1, as torchtitan's llama3 ``parallelize`` sets it; ``set_force_sum_reduction_for_comms``
for gloo — which alone still divides by S, found by this test), so ``p.grad`` is 1/W of the replica's mean gradient and the
Topology gets ``grad_scale = W``. The single-process reference sees the whole global batch with the
same loss (sum / global count) and ``Topology.single()``; everything runs in float64.
"""

import dataclasses
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_commopt import comm
from titan_commopt.compress.dct import Chunker, accumulate_chunks_, scatter_chunks, topk_per_chunk
from titan_commopt.optim import ShardShape, dion, make, resolve, shard_groups
from titan_commopt.optim.dion import reduce as dion_reduce
from titan_commopt.optim.orthogonalize import cholesky_qr2, orthogonalize
from titan_commopt.optim.common import BaseHParams
from titan_commopt.options import ConfigError, validate
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

D, V, N, L, STEPS = 16, 24, 8, 6, 3
HP = BaseHParams(lr=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def build(named_params, topology, cfg, hp=HP):
    """Dion with every option of ``cfg`` set by the user (no preset in the way)."""
    return make("Dion", named_params, topology, hp, **dataclasses.asdict(cfg))


def direct(named_params, *, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **options):
    """Dion on one process with these ``[optimizer]`` values and ``[commopt.dion]`` options, at exactly
    ``lr`` (the family's own lr: no preset scale)."""
    hp = BaseHParams(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    return make("Dion", named_params, Topology.single(), hp, lr=lr, **options)


def r_sent(entries, cfg, replicate_size=2, itemsize=4):
    """R bytes sent per step from ``(fqn, local[, global[, row_split]])`` entries (dion.dion_r_bytes)."""
    shards = [ShardShape(e[0], tuple(e[1]), tuple(e[2]) if len(e) > 2 else tuple(e[1]),
                         tuple(e[3]) if len(e) > 3 else (0, 1), itemsize) for e in entries]
    return dion.dion_r_bytes(shards, resolve("Dion", dataclasses.asdict(cfg)), replicate_size).sent


# ---- a direct dense implementation of the paper's equations (Algorithm 1 + sqrt(m/n), decay) ------
def dense_dion(X, grads, Q, lr, mu, wd, eps=1e-8):
    m, n = X.shape
    M = torch.zeros_like(X)
    for G in grads:
        B = M + G
        P, _ = torch.linalg.qr(B @ Q)
        Rm = B.T @ P
        M = B - (1 - mu) * P @ Rm.T
        Q = Rm / (Rm.norm(dim=0) + eps)
        X = X * (1 - lr * wd) - lr * math.sqrt(m / n) * P @ Q.T
    return X, M, Q


def reference_dion(X, grads, Q, lr, mu, wd, eps=1e-8):
    """microsoft/dion's single-matrix update (dion_reference.py ``dion_update``, one power iteration,
    Householder QR), written again: a wide matrix (m < n) runs on Mᵀ with Q of shape m×r, the error
    feedback and the update transposed back (R Pᵀ, Q Pᵀ), the scale still sqrt(fan_out/fan_in)."""
    m, n = X.shape
    transpose = m < n
    M = torch.zeros_like(X)
    for G in grads:
        M = M + G
        B = M.T if transpose else M
        P, _ = torch.linalg.qr(B @ Q)
        Rm = B.T @ P
        M = M - (1 - mu) * (Rm @ P.T if transpose else P @ Rm.T)
        Q = Rm / (Rm.norm(dim=0, keepdim=True) + eps)
        X = X * (1 - lr * wd) - math.sqrt(m / n) * lr * (Q @ P.T if transpose else P @ Q.T)
    return X, M, Q


def dense_lion(X, grads, lr, b1, b2, wd):
    m = torch.zeros_like(X)
    for g in grads:
        X = X * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return X


@pytest.mark.parametrize("shape,rank,method", [
    ((12, 8), 3, "cholesky_qr"), ((8, 12), 3, "qr"), ((10, 10), 10, "cholesky_qr"), ((6, 9), 6, "qr"),
])
@pytest.mark.parametrize("orientation", ["paper", "reference"])
def test_matches_dense_equations(shape, rank, method, orientation):
    """paper: the paper's equations on every matrix; reference: microsoft/dion's update, which runs
    the wide matrices ((8, 12), (6, 9)) transposed and the tall/square ones as the paper does."""
    torch.manual_seed(1)
    X0 = torch.randn(shape, dtype=torch.float64)
    grads = [torch.randn(shape, dtype=torch.float64) for _ in range(5)]
    p = nn.Parameter(X0.clone())
    opt = direct([("w", p)], lr=0.05, mu=0.9, weight_decay=0.1, rank=rank, orthogonalize=method,
                 orientation=orientation)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    wide = shape[0] < shape[1]
    assert opt.layouts["w"].transposed == (orientation == "reference" and wide)
    if orientation == "paper":
        X, M, Q = dense_dion(X0, grads, dion.initial_q("w", shape[1], rank, 0, torch.float64), 0.05, 0.9, 0.1)
    else:
        q0 = dion.initial_q("w", min(shape) if wide else shape[1], rank, 0, torch.float64)
        X, M, Q = reference_dion(X0, grads, q0, 0.05, 0.9, 0.1)
        if wide:  # the two forms really differ (not round-off)
            Xp = dense_dion(X0, grads, dion.initial_q("w", shape[1], rank, 0, torch.float64), 0.05, 0.9, 0.1)[0]
            assert float((Xp - X).abs().max()) > 1e-3
    torch.testing.assert_close(p.detach(), X, rtol=0, atol=1e-10)
    torch.testing.assert_close(opt.state[p]["momentum"], M, rtol=0, atol=1e-10)
    # Q is defined up to the sign of each column (QR vs Cholesky-QR); P Qᵀ and P Rᵀ are not.
    torch.testing.assert_close(opt.state[p]["Q"].abs(), Q.abs(), rtol=0, atol=1e-10)
    assert not torch.equal(p.detach(), X0)


def test_zero_gradient_step_keeps_everything():
    """DCP's ``_init_optim_state`` steps once with zero gradients and lr 0 to create state: that must
    leave X, M and Q as they were (P = 0 is not orthonormalizable; Q keeps its columns)."""
    torch.manual_seed(6)
    X0 = torch.randn(9, 7, dtype=torch.float64)
    p, v = nn.Parameter(X0.clone()), nn.Parameter(torch.ones(7, dtype=torch.float64))
    opt = direct([("w", p), ("v", v)], lr=0.0, rank=3, weight_decay=0.1)  # v: AdamW
    p.grad, v.grad = torch.zeros_like(p), torch.zeros_like(v)
    opt.step()
    assert torch.equal(p.detach(), X0) and torch.equal(v.detach(), torch.ones(7, dtype=torch.float64))
    assert torch.equal(opt.state[p]["Q"], dion.initial_q("w", 7, 3, 0, torch.float64))
    assert not opt.state[p]["momentum"].any()


def test_scalar_optimizers_match_references():
    """Vectors (routed to the scalar optimizer, base weight decay): AdamW as torch's, Lion as its equations."""
    torch.manual_seed(2)
    X0 = torch.randn(15, dtype=torch.float64)
    grads = [torch.randn(15, dtype=torch.float64) for _ in range(4)]
    a, b, c = (nn.Parameter(X0.clone()) for _ in range(3))
    hp = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    ours = [direct([("a", a)], scalar_optimizer="adamw", **hp), direct([("c", c)], scalar_optimizer="lion", **hp)]
    assert [g["algorithm"] for o in ours for g in o.param_groups] == ["adamw", "lion"]
    ref = torch.optim.AdamW([b], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    for g in grads:
        a.grad, b.grad, c.grad = g.clone(), g.clone(), g.clone()
        for opt in ours:
            opt.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(c.detach(), dense_lion(X0, grads, 0.01, 0.8, 0.9, 0.2), rtol=0, atol=1e-12)


def test_cholesky_qr_falls_back_when_ill_conditioned():
    torch.manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(40, 6, dtype=torch.float64))
    good = U * torch.tensor([1.0, 2, 3, 4, 5, 6], dtype=torch.float64)
    bad = U * torch.tensor([1.0, 1, 1, 1, 1, 1e-9], dtype=torch.float64)  # cond 1e9 > limit (~7e6)
    assert cholesky_qr2([good], [[]])[0] is not None and cholesky_qr2([bad], [[]])[0] is None
    # float32 P with cond 1e4 (beyond fp32 CholeskyQR2's ~4e3): the float64 Gram still handles it
    mid = (U * torch.logspace(0, 4, 6, dtype=torch.float64)).float()
    out32 = cholesky_qr2([mid], [[]])[0]
    assert out32 is not None and out32.dtype == torch.float32
    torch.testing.assert_close(out32.T @ out32, torch.eye(6), rtol=0, atol=1e-5)
    for P in (good, bad):
        out = orthogonalize([P.clone()], [[]], "cholesky_qr")[0]
        torch.testing.assert_close(out.T @ out, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-10)
        # same column space as P, up to column signs: the Q factor of P
        torch.testing.assert_close((out.T @ torch.linalg.qr(P).Q).abs(), torch.eye(6, dtype=torch.float64),
                                   rtol=0, atol=1e-6)


def test_state_dict_roundtrip_continues_identically():
    torch.manual_seed(4)
    grads = [torch.randn(8, 6, dtype=torch.float64) for _ in range(4)]
    bias_grads = [torch.randn(6, dtype=torch.float64) for _ in range(4)]

    def make():
        torch.manual_seed(5)
        w, bvec = nn.Parameter(torch.randn(8, 6, dtype=torch.float64)), nn.Parameter(torch.zeros(6, dtype=torch.float64))
        opt = direct([("w", w), ("b", bvec)], lr=0.05, rank=2)
        return w, bvec, opt

    def run(w, bvec, opt, ks):
        for k in ks:
            w.grad, bvec.grad = grads[k].clone(), bias_grads[k].clone()
            opt.step()

    w1, b1, o1 = make()
    run(w1, b1, o1, range(4))
    w2, b2, o2 = make()
    run(w2, b2, o2, range(2))
    saved = o2.state_dict()
    w3, b3, o3 = make()
    with torch.no_grad():
        w3.copy_(w2)
        b3.copy_(b2)
    o3.load_state_dict(saved)
    run(w3, b3, o3, range(2, 4))
    assert torch.equal(w3, w1) and torch.equal(b3, b1)


# ---- a llama-shaped toy model (torchtitan names) -----------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(D)
        self.wo = nn.Linear(D, D, bias=True)  # bias → scalar optimizer
        self.w1 = nn.Linear(D, 2 * D, bias=False)  # tall
        self.w2 = nn.Linear(2 * D, D, bias=False)  # wide

    def forward(self, x):
        x = x + self.wo(self.attention_norm(x))
        return x + self.w2(torch.tanh(self.w1(x)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_toy():
    torch.manual_seed(0)
    return Toy().double()


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (N, L), generator=gen), torch.randint(0, V, (N, L), generator=gen)


def loss_of(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum") / (N * L)


def train(model, opt, part=None, ledger=None):
    """STEPS steps; ``part = (index, count)`` takes this data-parallel rank's slice of the batch."""
    r_bytes, s_bytes = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        if part is not None:
            k = N // part[1]
            tokens, targets = tokens[part[0] * k:(part[0] + 1) * k], targets[part[0] * k:(part[0] + 1) * k]
        loss_of(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        if ledger is not None:
            summary = ledger.end_step()
            r_bytes.append(summary.get("R_sent", 0.0))
            s_bytes.append(summary.get("S_sent", 0.0))
    return r_bytes, s_bytes


def orientations(opt):
    """fqn → whether the matrix runs transposed (``orientation = "reference"`` orients by layout)."""
    return {fqn: lay.transposed for fqn, lay in opt.layouts.items()}


def reference(cfg, flags=None, hp=HP):
    """The single-process run; ``flags``: the sharded run's orientations (``dion.orient_``), so both
    run the same form of every matrix."""
    model = make_toy()
    opt = build(model.named_parameters(), Topology.single(), cfg, hp)
    dion.orient_(opt, flags or {})
    train(model, opt)
    return {k: v.detach() for k, v in model.named_parameters()}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_shapes(model, row_split=(0, 1)):
    """``(fqn, local, global, row_split)`` of every parameter (all sharded alike, as FSDP2 does)."""
    out = []
    for name, p in model.named_parameters():
        loc = p.to_local().shape if hasattr(p, "to_local") else p.shape
        out.append((name, tuple(loc), tuple(p.shape), row_split))
    return out


def compare(model, ref):
    return max(float((full(p.detach()) - ref[name]).abs().max()) for name, p in model.named_parameters())


def state_layout(opt):
    """Each checkpointed state entry's (shape, dtype, placements), by parameter index and key."""
    return {(i, k): (tuple(v.shape), v.dtype, tuple(getattr(v, "placements", ())))
            for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("mixed", [False, True])
def test_state_is_eager_so_init_optim_state_is_a_no_op(mixed):
    """torchtitan's init_optim_state and DCP's _init_optim_state step an optimizer whose state is empty
    once, zero gradients at lr 0: for Dion a real step (P, R and the scalar gradients over R, one step
    counted by AdamW's bias correction). Dion makes its state at construction, as the first step would
    find it, so that step never runs: the same trajectory, bit for bit, with or without it."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    cfg = dion.Config(rank_fraction=0.25, mixed_precision=mixed)
    model, ref_model = make_toy(), make_toy()
    opt, ref = build(model.named_parameters(), Topology.single(), cfg), build(ref_model.named_parameters(), Topology.single(), cfg)
    store = torch.bfloat16 if mixed else torch.float64
    assert set(opt.state) == set(model.parameters())
    for name, p in model.named_parameters():
        st = opt.state[p]
        lay = opt.layouts.get(name)
        if lay is not None:  # Dion: M = 0, Q as seeded (n×r, m×r transposed)
            assert set(st) == {"momentum", "Q"}
            assert st["momentum"].dtype == store and st["momentum"].shape == p.shape and not st["momentum"].any()
            assert torch.equal(st["Q"], dion.initial_q(name, lay.q_rows, lay.r, 0, store))
        else:  # AdamW: no step counted, zero moments
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 0
            assert all(st[k].dtype == store and not st[k].any() for k in ("exp_avg", "exp_avg_sq"))
    initial = state_layout(opt)
    before = [p.detach().clone() for p in model.parameters()]
    _init_optim_state(opt)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
    train(model, opt)
    train(ref_model, ref)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    assert state_layout(opt) == initial  # a checkpoint before step 1 holds what one after does


def momentum_buffers(model, opt):
    """The storages the toy's Dion momenta live in, by kind of block matrix (w1, w2, wo), per layer."""
    buffers = {}
    for name, p in model.named_parameters():
        if name in opt.layouts:
            buffers.setdefault(name.split(".", 2)[-1], []).append(
                local_of(opt.state[p]["momentum"]).untyped_storage().data_ptr())
    return buffers


def one_buffer_per_batch(buffers):
    return len(buffers) == 3 and all(len(b) == 2 and b[0] == b[1] for b in buffers.values()) and \
        len({b[0] for b in buffers.values()}) == 3


def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("mixed", [False, True])
def test_shape_batch_momenta_share_one_buffer_and_resume_identically(mixed):
    """The matrices of a shape batch (here each block's w1, w2 and wo: one batch per kind) keep their
    momenta in one buffer, each M a view of its slice, so the batch's products run as one batched
    product. A checkpoint holds each M as its own entry; a load puts them back into the buffer, and the
    resumed run continues bit for bit, also at the lr set after the load."""
    import io

    cfg = dion.Config(rank_fraction=0.25, mixed_precision=mixed)
    straight = make_toy()
    opt = build(straight.named_parameters(), Topology.single(), cfg)
    assert one_buffer_per_batch(momentum_buffers(straight, opt))
    train(straight, opt)
    saving = make_toy()
    saved_opt = build(saving.named_parameters(), Topology.single(), cfg)
    train(saving, saved_opt)
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), saving.parameters()))
    file = io.BytesIO()
    torch.save(saved_opt.state_dict(), file)
    file.seek(0)
    saved = torch.load(file)
    by_index = [p for group in saved_opt.param_groups for p in group["params"]]
    for i, entries in saved["state"].items():  # every M its own entry, of its matrix's shape
        if "momentum" in entries:
            assert set(entries) == {"momentum", "Q"} and entries["momentum"].shape == by_index[i].shape
    resumed = make_toy()
    resumed.load_state_dict(saving.state_dict())
    opt2 = build(resumed.named_parameters(), Topology.single(), cfg)
    opt2.load_state_dict(saved)
    assert one_buffer_per_batch(momentum_buffers(resumed, opt2))
    for o in (opt, opt2):  # as an lr schedule does, into the param groups the load made
        for group in o.param_groups:
            group["lr"] *= 0.5
    train(straight, opt)
    train(resumed, opt2)
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))
    assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for p, q in zip(straight.parameters(), resumed.parameters())
               for k in opt.state[p])


@pytest.mark.parametrize("shape,mixed", [((9, 7), False), ((7, 9), True)])  # (7, 9): transposed, bf16 M
def test_shape_batch_member_without_gradient_is_left_alone(shape, mixed):
    """A matrix with no gradient this step (``grad is None``) is skipped as torch's optimizers skip it:
    its M and X stay; its batch-mates step exactly as they would without it."""
    torch.manual_seed(8)
    X0, G = torch.randn(2, *shape, dtype=torch.float64), torch.randn(3, *shape, dtype=torch.float64)
    a, b, alone = nn.Parameter(X0[0].clone()), nn.Parameter(X0[1].clone()), nn.Parameter(X0[0].clone())
    pair = direct([("a", a), ("b", b)], rank=3, lr=0.05, mixed_precision=mixed)
    single = direct([("a", alone)], rank=3, lr=0.05, mixed_precision=mixed)
    assert pair.layouts["a"].transposed == (shape[0] < shape[1])
    for step, g in enumerate(G):
        a.grad, alone.grad = g.clone(), g.clone()
        b.grad = g.clone() if step == 2 else None
        pair.step()
        single.step()
        if step < 2:
            assert torch.equal(b.detach(), X0[1]) and not pair.state[b]["momentum"].any()
    assert torch.equal(a.detach(), alone.detach())
    assert torch.equal(pair.state[a]["momentum"], single.state[alone]["momentum"])
    assert not torch.equal(b.detach(), X0[1])  # b stepped once, with its batch-mate


def test_routing_groups_and_log(caplog):
    model = make_toy()
    with caplog.at_level(logging.INFO, logger="titan_commopt.optim.dion"):
        opt = build(model.named_parameters(), Topology.single(),
                    dion.Config(scalar_optimizer="lion", scalar_lr_scale=0.5))
    groups = {tuple(g["param_names"]): g for g in opt.param_groups}
    by_algo = {}
    for names, g in groups.items():
        by_algo.setdefault(g["algorithm"], []).append((names, g))
    dion_names = by_algo["dion"][0][0]
    assert sorted(dion_names) == sorted(f"layers.{i}.{w}.weight" for i in range(2) for w in ("wo", "w1", "w2"))
    lion = {names: g for names, g in by_algo["lion"]}
    assert lion[("tok_embeddings.weight",)]["weight_decay"] == 0.0
    assert lion[("tok_embeddings.weight",)]["lr"] == pytest.approx(0.01)
    assert lion[("output.weight",)]["weight_decay"] == 0.0
    assert lion[("output.weight",)]["lr"] == pytest.approx(0.01 / math.sqrt(D))  # Lion head: 1/sqrt(d_in)
    rest = [g for names, g in lion.items() if "norm.weight" in names]
    assert rest and rest[0]["weight_decay"] == 0.1 and "layers.0.wo.bias" in rest[0]["param_names"]
    text = caplog.text
    assert "layers.0.w1.weight" in text and "tok_embeddings.weight" in text and "output.weight" in text
    # AdamW head keeps the base lr (auto scale is Lion-only)
    opt2 = build(model.named_parameters(), Topology.single(), dion.Config())
    head = [g for g in opt2.param_groups if g["param_names"] == ["output.weight"]][0]
    assert head["algorithm"] == "adamw" and head["lr"] == pytest.approx(HP.lr)


def test_rank_compression_rule_and_bytes_formula():
    cfg = dion.Config(rank_fraction=0.25)
    assert dion.dion_rank(256, 768, cfg) == 64 and dion.dion_rank(10, 7, cfg) == 2
    assert dion.dion_rank(256, 768, dion.Config(rank=300)) == 256
    assert dion.compressed(256, 256, 64, cfg) and not dion.compressed(256, 256, 256, cfg)
    assert dion.compressed(256, 256, 256, dion.Config(compress="always"))
    shapes = [("layers.0.wq.weight", (128, 256), (256, 256)), ("norm.weight", (256,)),
              ("tok_embeddings.weight", (1024, 256), (2048, 256)), ("layers.0.w2.weight", (256, 768))]
    got = r_sent(shapes, cfg, replicate_size=2)
    assert got == 4 * ((128 + 256) * 64 + 256 + 1024 * 256 + (256 + 768) * 64)
    full_rank = r_sent(shapes, dion.Config(rank_fraction=1.0), 2)
    assert full_rank == 4 * (128 * 256 + 256 + 1024 * 256 + 256 * 768)
    assert r_sent(shapes, cfg, 1) == 0
    # R split over row shards: (m_loc + rows of this rank's ceil(n_loc/k) slice)·r; (index, count)
    wq = ("layers.0.wq.weight", (128, 256), (256, 256))
    assert r_sent([(*wq, (1, 2))], cfg, 2) == 4 * (128 + 128) * 64
    assert r_sent([(*wq, (0, 1))], cfg, 2) == r_sent([wq], cfg, 2)
    # uneven: 9 rows over 2 shards -> 5 + 4; over 4 -> 3, 3, 3, 0 (an empty slice)
    assert [dion.r_slice(9, (i, 2)) for i in range(2)] == [(0, 5), (5, 4)]
    assert [dion.r_slice(9, (i, 4)) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 0)]
    odd = ("layers.0.wo.weight", (6, 9), (11, 9))
    assert [r_sent([(*odd, (i, 4))], dion.Config(rank=4), 2) for i in range(4)] == \
        [4 * (6 + 3) * 4] * 3 + [4 * 6 * 4]
    # only compressed matrices are split: the full-rank path still sends the local gradient
    assert r_sent([(*wq, (1, 2))], dion.Config(rank_fraction=1.0), 2) == 4 * 128 * 256
    # scalar_sync = demo: the embedding (1024 x 256 local) goes as DeMo payloads: 64 x 64 chunks, 64 of
    # them, 32 bf16 values (2 B) and 32 twelve-bit indices each; an all-gather (recv = (W - 1) x sent).
    demo = dion.Config(rank_fraction=0.25, scalar_sync="demo", scalar_topk=32)
    payload = 64 * 32 * 2 + 64 * 32 * 12 // 8
    dense_rest = 4 * ((128 + 256) * 64 + 256 + (256 + 768) * 64)
    shards = [ShardShape(e[0], e[1], e[2] if len(e) > 2 else e[1]) for e in shapes]
    for w in (2, 3):
        got = dion.dion_r_bytes(shards, resolve("Dion", dataclasses.asdict(demo)), w)
        assert (got.sent, got.recv) == (dense_rest + payload, dense_rest + (w - 1) * payload)
    fp32_all = dion.Config(scalar_sync="demo", scalar_transfer_dtype="fp32", scalar_chunk=16, scalar_topk=256)
    assert r_sent([shapes[2]], fp32_all, 2) == 1024 * 256 * (4 + 1)  # every coefficient: 4 B + 8-bit index
    assert r_sent(shapes, demo, 1) == 0


def test_config_validation():
    validate(dion.Config(), "commopt.dion")
    with pytest.raises(ConfigError) as e:
        validate(dion.Config(rank_fraction=1.5, orthogonalize="svd", mu=1.0), "commopt.dion")
    assert "rank_fraction" in str(e.value) and "orthogonalize" in str(e.value) and "mu" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(dion.Config(scalar_sync="sign"), "commopt.dion")
    assert "scalar_sync" in str(e.value) and "'dense'" in str(e.value) and "\n" not in str(e.value).strip()
    with pytest.raises(ConfigError, match="scalar_topk"):
        validate(dion.Config(scalar_topk=0), "commopt.dion")
    # the error-feedback buffers exist only under demo: a resume that changes it is refused
    assert dion.state_shape(resolve("Dion", {"scalar_sync": "demo"}))["scalar_sync"] == "demo"
    assert dion.state_shape(resolve("Dion", {}))["scalar_sync"] == "dense"


# ---- distributed: Theorem 2.1 on real meshes ---------------------------------------------------------
CONFIGS = {
    "low": dict(rank_fraction=0.25),  # compressed P,R sync for every block matrix
    "full_qr": dict(rank_fraction=1.0, orthogonalize="qr", scalar_optimizer="lion"),  # full-grad path
    "low_paper": dict(rank_fraction=0.25, orientation="paper"),  # the paper's form of every matrix
}
FSDP_CONFIGS = {**CONFIGS, "low_qr": dict(rank_fraction=0.25, orthogonalize="qr")}
TWO_RANK_CASES = [f"dp/{name}" for name in CONFIGS] + [f"fsdp/{name}" for name in FSDP_CONFIGS]
# One DTensor matrix against single-process Dion: case -> (global shape, options); DP_TP: the tensor
# dim TP shards (1: row-wise parallel, columns; 0: column-wise parallel, rows).
HSDP_MATRICES = {  # uneven shards over fsdp
    "hsdp/(11, 9)/": ((11, 9), dict(rank=4)),
    "hsdp/(11, 9)/qr": ((11, 9), dict(rank=4, orthogonalize="qr")),
    "hsdp/(5, 1)/": ((5, 1), dict(rank=1, compress="always")),
}
FSDP_TP_MATRICES = {"fsdp_tp/(11, 9)": ((11, 9), dict(rank=3, orthogonalize="qr")),
                    "fsdp_tp/(12, 10)": ((12, 10), dict(rank=10))}
DP_TP_MATRICES = {
    "dp_tp/cols": (1, (12, 10), dict(rank=3)),
    "dp_tp/rows": (0, (12, 10), dict(rank=3, orthogonalize="qr")),
    "dp_tp/cols_full": (1, (12, 10), dict(rank_fraction=1.0)),
}
FOUR_RANK_CASES = [f"hsdp/{name}" for name in CONFIGS] + [*HSDP_MATRICES, *FSDP_TP_MATRICES, *DP_TP_MATRICES]


# scalar_sync = demo: the embedding and head through DeMo's wire. "demo": 4 of 64 coefficients per chunk;
# "demo_all": every coefficient (must equal the dense scalar sync up to round-off); fp32 on the wire,
# bf16 in the HSDP case. AdamW's eps is large here so that a gradient of round-off size (the DCT's, in
# float32, where the dense gradient is exactly zero: rows of tokens not in the batch) moves nothing.
DEMO_CONFIGS = {
    "demo": dict(rank_fraction=0.25, scalar_sync="demo", scalar_chunk=8, scalar_topk=4, scalar_transfer_dtype="fp32"),
    "demo_all": dict(rank_fraction=0.25, scalar_sync="demo", scalar_chunk=8, scalar_topk=64,
                     scalar_transfer_dtype="fp32"),
}
HSDP_DEMO = dict(rank_fraction=0.25, scalar_sync="demo", scalar_chunk=8, scalar_topk=4, scalar_transfer_dtype="bf16")
HP_DEMO = dataclasses.replace(HP, eps=1e-3)


def demo_reference(cfg, flags, row_parts, replicas=2):
    """Single-process simulation of Dion with ``scalar_sync = "demo"`` over ``replicas`` replicas, from
    the equations: each replica's gradient of its half of the batch; Dion's matrices, norms and biases
    step on the replicas' mean; per embedding/head and replica an error buffer e ← e + g, q = top-k of
    the DCT of each chunk, e ← e − q; the scalar AdamW steps on the mean of the replicas' q (values
    rounded to the wire dtype). ``row_parts``: the row blocks a rank holds (FSDP shards), each
    chunked on its own."""
    wire = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.scalar_transfer_dtype]
    model = make_toy()
    opt = build(model.named_parameters(), Topology.single(), dataclasses.replace(cfg, scalar_sync="dense"), HP_DEMO)
    dion.orient_(opt, flags)
    demo_names = {n for n, p in model.named_parameters() if dion.route(n, p.ndim, cfg) in ("embed", "head")}
    errors = [{n: torch.zeros_like(p) for n, p in model.named_parameters() if n in demo_names}
              for _ in range(replicas)]
    for step in range(STEPS):
        tokens, targets = batch(step)
        k = N // replicas
        grads = []
        for r in range(replicas):
            model.zero_grad()
            loss_of(model, tokens[r * k:(r + 1) * k], targets[r * k:(r + 1) * k]).backward()
            grads.append({n: p.grad * replicas for n, p in model.named_parameters()})  # the replica's mean
        for n, p in model.named_parameters():
            if n not in demo_names:
                p.grad = sum(g[n] for g in grads) / replicas
                continue
            mean = torch.empty_like(p)
            rows = -(-p.shape[0] // row_parts)
            for a in range(0, p.shape[0], rows):
                ch, vals, idx = None, [], []
                for r in range(replicas):
                    e = errors[r][n][a:a + rows]
                    e.add_(grads[r][n][a:a + rows])
                    ch = Chunker(e.shape, cfg.scalar_chunk)
                    v, i = topk_per_chunk(ch.encode(e), cfg.scalar_topk)
                    e.sub_(ch.decode(scatter_chunks(v, i, ch.L)).to(e.dtype))
                    vals.append(v.to(wire).float())
                    idx.append(i)
                dense = accumulate_chunks_(torch.zeros(ch.n_chunks, ch.L), torch.stack(idx),
                                           torch.stack(vals) / replicas)
                mean[a:a + rows] = ch.decode(dense)
            p.grad = mean
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


def _eager_state(opt, ledger):
    """torchtitan's init_optim_state (DCP's, before a checkpoint) on the new optimizer: what it sent
    (nothing: the state exists) and the checkpointed state's layout before step 1."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    ledger.reset()
    _init_optim_state(opt)
    return dict(init_traffic=ledger.end_step(), initial_layout=state_layout(opt))


def _demo_run(topo, shard_mesh, dp_index, dp_count, cfg_kwargs):
    """A toy run with ``scalar_sync = "demo"``: its distance to :func:`demo_reference`, to the dense
    scalar sync (single process), its R bytes (sent and received) and the byte formula's."""
    cfg = dion.Config(**cfg_kwargs)
    model = make_toy()
    if shard_mesh is not None:
        _fsdp(model, shard_mesh)
    opt = build(model.named_parameters(), topo, cfg, HP_DEMO)
    ledger = comm.get_ledger()
    eager = _eager_state(opt, ledger)
    ledger.reset()
    sent, recv = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        k = N // dp_count
        loss_of(model, tokens[dp_index * k:(dp_index + 1) * k], targets[dp_index * k:(dp_index + 1) * k]).backward()
        opt.step()
        opt.zero_grad()
        summary = ledger.end_step()
        sent.append(summary.get("R_sent", 0.0))
        recv.append(summary.get("R_recv", 0.0))
    split = (shard_mesh.get_local_rank(), shard_mesh.size()) if shard_mesh is not None else (0, 1)
    shards = [ShardShape(n, loc, glob, rs, 8) for n, loc, glob, rs in local_shapes(model, split)]
    expected = dion.dion_r_bytes(shards, resolve("Dion", dataclasses.asdict(cfg)), topo.replicate_size)
    flags = orientations(opt)
    parts = shard_mesh.size() if shard_mesh is not None else 1
    errors = {n for n, p in model.named_parameters() if "scalar_error" in opt.state[p]}
    return dict(
        **eager, layout=state_layout(opt),
        diff=compare(model, demo_reference(cfg, flags, parts)),
        dense_diff=compare(model, reference(dataclasses.replace(cfg, scalar_sync="dense"), flags, HP_DEMO)),
        sent=sent, recv=recv, expected=(expected.sent, expected.recv), errors=errors,
        shards={n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                for n, p in model.named_parameters()},
    )


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo: no AVG/PREMUL_SUM reduce-scatter
            m.set_gradient_divide_factor(1.0)  # torchtitan's setting: SUM over S, no division
    return model


def _toy_run(mesh, topo, shard_mesh, dp_index, dp_count, cfg_kwargs):
    cfg = dion.Config(**cfg_kwargs)
    model = make_toy()
    if shard_mesh is not None:
        _fsdp(model, shard_mesh)
    opt = build(model.named_parameters(), topo, cfg)
    ledger = comm.get_ledger()
    eager = _eager_state(opt, ledger)
    ledger.reset()
    r_bytes, s_bytes = train(model, opt, part=(dp_index, dp_count), ledger=ledger)
    # FSDP2 shards every row over the shard mesh: R is split in |S| slices, this rank's is its index.
    split = (shard_mesh.get_local_rank(), shard_mesh.size()) if shard_mesh is not None else (0, 1)
    expected = r_sent(local_shapes(model, split), cfg, topo.replicate_size, itemsize=8)
    shards = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    return dict(**eager, layout=state_layout(opt),
                diff=compare(model, reference(cfg, orientations(opt))), r_bytes=r_bytes, expected=expected,
                s_bytes=s_bytes, shards=shards, transposed=orientations(opt))


def _two_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_replicate",))
    topo = Topology.from_mesh(dp, grad_scale=2.0)
    for name, kw in CONFIGS.items():
        out[f"dp/{name}"] = _toy_run(dp, topo, None, rank, 2, kw)
    for name, kw in DEMO_CONFIGS.items():
        out[f"dp/{name}"] = _demo_run(topo, None, rank, 2, kw)
    fs = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    topo = Topology.from_mesh(fs, grad_scale=1.0)
    for name, kw in FSDP_CONFIGS.items():
        out[f"fsdp/{name}"] = _toy_run(fs, topo, fs["fsdp"], rank, 2, kw)
    return out


def _matrix_case(mesh, topo, placements, shape, grads_of, cfg_kwargs, row_split=(0, 1)):
    """One DTensor matrix vs single-process Dion; ``row_split``: this rank's R slice (index, count)."""
    from torch.distributed.tensor import distribute_tensor

    cfg = dion.Config(**cfg_kwargs)
    torch.manual_seed(7)
    X0 = torch.randn(shape, dtype=torch.float64)
    p = nn.Parameter(distribute_tensor(X0.clone(), mesh, placements, src_data_rank=None))
    opt = build([("layers.0.attention.wo.weight", p)], topo, cfg)
    ref_p = nn.Parameter(X0.clone())
    ref = build([("layers.0.attention.wo.weight", ref_p)], Topology.single(), cfg)
    dion.orient_(ref, orientations(opt))
    ledger = comm.get_ledger()
    ledger.reset()
    r_bytes = []
    for step in range(STEPS):
        mine, mean = grads_of(step)
        p.grad = distribute_tensor(mine, mesh, placements, src_data_rank=None)
        ref_p.grad = mean
        opt.step()
        ref.step()
        r_bytes.append(ledger.end_step().get("R_sent", 0.0))
    loc = tuple(p.to_local().shape)
    shard = ShardShape.of("layers.0.attention.wo.weight", p)
    assert shard.local == loc and shard.row_split == (row_split if topo.replicate_size > 1 else shard.row_split)
    expected = dion.dion_r_bytes([shard], resolve("Dion", dataclasses.asdict(cfg)), topo.replicate_size).sent
    return dict(diff=float((p.full_tensor() - ref_p.detach()).abs().max()), r_bytes=r_bytes, expected=expected,
                local=loc, r=dion.dion_rank(*shape, cfg), transposed=orientations(opt)["layers.0.attention.wo.weight"])


def _four_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    out = {}
    # HSDP 2x2: FSDP2 over "fsdp" only; Dion does R itself.
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    topo = Topology.from_mesh(hsdp, grad_scale=2.0)
    for name, kw in CONFIGS.items():
        out[f"hsdp/{name}"] = _toy_run(hsdp, topo, hsdp["fsdp"], rank, 4, kw)
    out["hsdp/demo"] = _demo_run(topo, hsdp["fsdp"], rank, 4, HSDP_DEMO)

    def grads(replica, count):
        def of(step):
            gen = torch.Generator().manual_seed(step)
            shape = of.shape
            per_replica = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(count)]
            return per_replica[replica], torch.stack(per_replica).mean(0)
        return of

    # HSDP with uneven shards: 11 rows (6 + 5 per fsdp rank) and R's 9 rows split 5 + 4 over fsdp;
    # (5, 1) forced compressed: R has 1 row, the second fsdp rank's slice is empty.
    topo = Topology.from_mesh(hsdp)  # grads below are already the replica's mean: grad scale 1
    fsdp_index = hsdp.get_local_rank("fsdp")
    for case, (shape, kw) in HSDP_MATRICES.items():
        g = grads(topo.replica_index, 2)
        g.shape = shape
        out[case] = _matrix_case(
            hsdp["fsdp"], topo, [Shard(0)], shape, g, kw, row_split=(fsdp_index, 2))

    # FSDP rows × TP columns on a 2-D mesh (uneven shards: 11 rows, 9 columns).
    st = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    topo = Topology.from_mesh(st)
    for case, (shape, kw) in FSDP_TP_MATRICES.items():
        g = grads(0, 1)
        g.shape = shape
        out[case] = _matrix_case(st, topo, [Shard(0), Shard(1)], shape, g, kw)
    # Replicas × TP: columns (row-wise parallel) and rows (column-wise parallel) over tp.
    rt = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    topo = Topology.from_mesh(rt)
    replica = topo.replica_index
    for case, (dim, shape, kw) in DP_TP_MATRICES.items():
        g = grads(replica, 2)
        g.shape = shape
        split = (rt.get_local_rank("tp"), 2) if dim == 0 else (0, 1)
        out[case] = _matrix_case(rt["tp"], topo, [Shard(dim)], shape, g, kw, row_split=split)
    return out


def _check(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["diff"] < 1e-9, (rank, r["diff"])
        assert all(b == r["expected"] for b in r["r_bytes"]), (rank, r["r_bytes"], r["expected"])


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_ranks, 2)


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_distributed_dp_and_fsdp_equal_single_process(two_rank_results, case):
    _check(two_rank_results, case)


def test_distributed_state_is_eager(two_rank_results):
    """Dion's state exists from construction: torchtitan's init_optim_state before a checkpoint sends
    nothing (lazy state made it a real step: P, R and the scalar gradients over R, an AdamW step
    counted, so the runs compared above would differ), and a checkpoint before step 1 holds the same
    entries (shapes, dtypes, DTensor placements) as one after."""
    for rank, results in enumerate(two_rank_results):
        for case, r in results.items():
            assert r["init_traffic"] == {}, (rank, case, r["init_traffic"])
            assert r["initial_layout"] == r["layout"], (rank, case)


def test_distributed_dp_and_fsdp_orientation_and_traffic(two_rank_results):
    r = two_rank_results[0]
    assert r["dp/low"]["expected"] > 0 and r["fsdp/low"]["expected"] == 0  # no R without replicas
    # microsoft/dion's orientation: unsharded, only the wide matrices run transposed; FSDP2 shards every
    # row, and then every matrix runs transposed (Q follows X's local rows); paper: none
    shapes = {k: tuple(v.shape) for k, v in make_toy().named_parameters()}
    assert r["dp/low"]["transposed"] == {k: shapes[k][0] < shapes[k][1] for k in r["dp/low"]["transposed"]}
    assert any(r["dp/low"]["transposed"].values()) and not all(r["dp/low"]["transposed"].values())
    assert all(r["fsdp/low"]["transposed"].values())
    assert not any(r["fsdp/low_paper"]["transposed"].values())
    # S traffic of row-sharded Cholesky-QR Dion, nothing m×n. Paper form: two r×r Grams + the n×r R sum
    # per matrix. Transposed (reference): the n×r sum of P (its rows are X's whole columns, orthogonalized
    # locally: no Gram) + the r column norms of R (R's rows are X's local rows).
    cfg = dion.Config(**CONFIGS["low"])
    mats = [tuple(v.shape) for k, v in make_toy().named_parameters() if dion.route(k, v.ndim, cfg) == "dion"]
    ranks = [(n, dion.dion_rank(m, n, cfg)) for m, n in mats]
    assert r["fsdp/low_paper"]["s_bytes"] == [8 * sum(2 * rk**2 + n * rk for n, rk in ranks)] * STEPS
    assert r["fsdp/low"]["s_bytes"] == [8 * sum(n * rk + rk for n, rk in ranks)] * STEPS
    assert r["dp/low"]["s_bytes"] == [0.0] * STEPS
    # the compressed path sends less than the full gradients of the same model
    assert r["dp/low"]["expected"] < r["dp/full_qr"]["expected"]


@pytest.mark.parametrize("case", [f"dp/{name}" for name in DEMO_CONFIGS])
def test_distributed_demo_scalar_sync_equals_simulation_and_ledger(two_rank_results, case):
    for rank, r in enumerate(two_rank_results):
        assert r[case]["diff"] < 1e-12, (rank, r[case]["diff"])  # the simulation, op for op
        assert r[case]["sent"] == [r[case]["expected"][0]] * STEPS, (rank, r[case]["sent"], r[case]["expected"])
        assert r[case]["recv"] == [r[case]["expected"][1]] * STEPS
        assert r[case]["errors"] == {"tok_embeddings.weight", "output.weight"}  # one error buffer each
    a, b = two_rank_results[0][case]["shards"], two_rank_results[1][case]["shards"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # every replica applies the same update


def test_distributed_demo_scalar_sync_everything_kept_equals_dense(two_rank_results):
    r = two_rank_results[0]
    # every coefficient sent: the dense scalar sync up to float32 round-off (the DCT runs in float32)
    assert r["dp/demo_all"]["dense_diff"] < 1e-6, r["dp/demo_all"]["dense_diff"]
    # 4 of 64: a different algorithm, visibly (the check above could fail)
    assert r["dp/demo"]["dense_diff"] > 1e-4, r["dp/demo"]["dense_diff"]
    # fewer bytes than the dense scalar sync of the same run (dp/low: the same matrices, fp64 scalars)
    assert r["dp/demo"]["expected"][0] < r["dp/low"]["expected"]


def _four_rank_world(rank, world):
    """Both 4-process worlds' checks in one spawn: HSDP and TP, then FSDP over TP (each its own meshes)."""
    return {"four_ranks": _four_ranks(rank, world), "tp_fsdp": _tp_fsdp(rank, world)}


@pytest.fixture(scope="module")
def four_rank_world():
    return run_distributed(_four_rank_world, 4)


@pytest.fixture(scope="module")
def four_rank_results(four_rank_world):
    return [out["four_ranks"] for out in four_rank_world]


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_distributed_hsdp_and_tp_equal_single_process(four_rank_results, case):
    _check(four_rank_results, case)


def test_distributed_hsdp_and_tp_replicas_layouts_and_payload(four_rank_results):
    results = four_rank_results
    r0 = results[0]
    # Replicas stay bit-identical (ranks 0/2 and 1/3 hold the same shard on different replicas),
    # although their momenta differ by design on the compressed path.
    for a, b in ((0, 2), (1, 3)):
        for case in ("hsdp/low", "hsdp/full_qr"):
            sa, sb = results[a][case]["shards"], results[b][case]["shards"]
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (a, b, case)
    assert r0["fsdp_tp/(11, 9)"]["local"] == (6, 5) and results[3]["fsdp_tp/(11, 9)"]["local"] == (5, 4)
    # compressed R payload: (m_loc + this rank's slice of n_loc)·r doubles; full rank: the local gradient
    # TP shards the columns: microsoft/dion runs it transposed, P (X's 5 local columns) + R (X's 12 rows,
    # split over the tp shards: 6) -- (12 + 5)·3 in the paper's form
    assert r0["dp_tp/cols"]["transposed"] and not r0["dp_tp/rows"]["transposed"]
    assert r0["dp_tp/cols"]["expected"] == 8 * (5 + 6) * 3
    assert r0["dp_tp/rows"]["expected"] == 8 * (6 + 5) * 3  # R's 10 rows split over the tp row shards
    assert r0["dp_tp/cols_full"]["expected"] == 8 * 12 * 5
    assert r0["hsdp/low"]["expected"] > 0
    # HSDP 2x2, (11, 9) at r = 4: fsdp rank 0 holds 6 rows and R slice 5, rank 1 holds 5 rows and slice 4
    # (ranks 0, 1 are fsdp 0, 1 of replica 0). The old payload (m_loc + n)·r was above the fp64 gradient
    # shard m_loc·n on both; the split one is below.
    for rank, (m_loc, rows) in enumerate([(6, 5), (5, 4)]):
        for case in ("hsdp/(11, 9)/", "hsdp/(11, 9)/qr"):
            res = results[rank][case]
            assert res["local"] == (m_loc, 9) and res["r"] == 4
            assert res["expected"] == 8 * (m_loc + rows) * 4
            assert res["r_bytes"] == [res["expected"]] * STEPS
            grad_shard = 8 * m_loc * 9
            assert res["expected"] < grad_shard < 8 * (m_loc + 9) * 4, (rank, res["expected"], grad_shard)
    assert [results[k]["hsdp/(5, 1)/"]["expected"] for k in range(4)] == [8 * (3 + 1), 8 * 2] * 2
    # scalar_sync = demo on HSDP (bf16 wire, each FSDP shard chunked on its own): the simulation, the
    # ledger equal to the formula, replicas identical
    for rank, res in enumerate(results):
        demo = res["hsdp/demo"]
        assert demo["diff"] < 1e-12, (rank, demo["diff"])
        assert demo["sent"] == [demo["expected"][0]] * STEPS and demo["recv"] == [demo["expected"][1]] * STEPS
    for a, b in ((0, 2), (1, 3)):
        sa, sb = results[a]["hsdp/demo"]["shards"], results[b]["hsdp/demo"]["shards"]
        assert all(torch.equal(sa[k], sb[k]) for k in sa), (a, b)


# ---- real tensor parallelism: torchtitan's layouts (colwise → rows over tp, FSDP on top) ----------------
def _tp_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    topo = Topology.from_mesh(mesh)
    out = {}
    for name, kw in CONFIGS.items():
        cfg = dion.Config(**kw)
        model = make_toy()
        for layer in model.layers:
            # w1 column-wise (rows over tp), w2 and wo row-wise (columns over tp), as torchtitan's FFN/attention
            parallelize_module(layer, mesh["tp"], {
                "w1": ColwiseParallel(), "w2": RowwiseParallel(),
                "wo": RowwiseParallel(input_layouts=Replicate()),
            })
        _fsdp(model, mesh["fsdp"])
        placements = {n: tuple((type(pl).__name__, getattr(pl, "dim", None)) for pl in p.placements)
                      for n, p in model.named_parameters()}
        opt = build(model.named_parameters(), topo, cfg)
        layouts = {fqn: (len(lay.rows), len(lay.cols)) for fqn, lay in opt.layouts.items()}
        train(model, opt, part=(mesh.get_local_rank("fsdp"), 2))
        out[name] = dict(diff=compare(model, reference(cfg, orientations(opt))), r_bytes=[0.0], expected=0,
                         placements=placements, layouts=layouts, transposed=orientations(opt))
    # The hierarchical R reduction over two row groups (w1: fsdp then tp) and one (w2: fsdp), with
    # uneven (7 rows over 4) and empty (3 rows over 4) slices, equals the plain sum over the row groups
    # (the R mean itself is a no-op here: no replicas).
    by_fqn = {fqn: dataclasses.replace(lay, compressed=True) for fqn, lay in opt.layouts.items()}
    lays = [by_fqn[f] for f in ("layers.0.w1.weight", "layers.1.w1.weight", "layers.0.w2.weight")]
    gen = torch.Generator().manual_seed(rank)
    Rs = [torch.randn(n, 2, generator=gen, dtype=torch.float64) for n in (3, 7, 5)]
    want = [Rm.clone() for Rm in Rs]
    shard_groups.sum_over(want, [lay.rows for lay in lays])
    ledger = comm.CommLedger()
    dion_reduce.reduce_r_now(Rs, lays, None, True, ledger)
    out["nested"] = dict(diff=max(float((a - b).abs().max()) for a, b in zip(Rs, want)), r_bytes=[0.0], expected=0,
                         splits=[lay.row_split for lay in lays],
                         ops=[(c.role, c.op) for c in ledger.records if c.op != comm.TIME_OP])
    return out


@pytest.fixture(scope="module")
def tp_fsdp_results(four_rank_world):
    return [out["tp_fsdp"] for out in four_rank_world]


@pytest.mark.parametrize("case", [*CONFIGS, "nested"])
def test_distributed_fsdp_over_tensor_parallel_equals_single_process(tp_fsdp_results, case):
    _check(tp_fsdp_results, case)


def test_distributed_fsdp_over_tensor_parallel_layouts_and_collectives(tp_fsdp_results):
    results = tp_fsdp_results
    r = results[0]["low"]
    # colwise w1: FSDP re-shards TP's rows (strided); row-wise w2: rows over fsdp, columns over tp
    assert r["layouts"]["layers.0.w1.weight"] == (2, 0) and r["layouts"]["layers.0.w2.weight"] == (1, 1)
    assert r["placements"]["layers.0.w2.weight"] == (("Shard", 0), ("Shard", 1))
    assert r["placements"]["layers.0.w1.weight"] == (("_StridedShard", 0), ("Shard", 0))
    for rank, res in enumerate(results):  # fsdp index major, tp minor: the global rank on this mesh
        assert res["nested"]["splits"] == [(rank, 4), (rank, 4), (rank // 2, 2)]
    # one fused collective per row group and bucket: reduce-scatter fsdp, tp (w1s), fsdp (w2), then back
    assert results[0]["nested"]["ops"] == [("S", "reduce_scatter"), ("T", "reduce_scatter"), ("S", "reduce_scatter"),
                                           ("T", "all_gather"), ("S", "all_gather"), ("S", "all_gather")]


# ---- mixed precision (microsoft/dion's DionMixedPrecisionConfig: bf16 momentum, Q, variance) ---------
def _mp_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8))


def _mp_opt(model, mixed, orientation="reference", scalar="adamw"):
    return direct(list(model.named_parameters()), lr=0.02, rank=4, weight_decay=0.01, mixed_precision=mixed,
                  orientation=orientation, scalar_optimizer=scalar)


@pytest.mark.parametrize("orientation,scalar", [("reference", "adamw"), ("paper", "lion")])
def test_mixed_precision_state_update_and_training(orientation, scalar):
    """bf16 storage of M, Q and the scalar moments; the step stays close to the float32 one and a tiny
    regression still learns. Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3);
    the rounding of M and Q feeds back through the QR and Adam's m/sqrt(v), so after 3 steps the float32
    and bf16 runs are compared by the relative size of their total updates, 5e-2 (a systematic error,
    e.g. a lost factor or a transpose, is O(1)); later the two trajectories drift apart as any two
    nearby runs do, so the 30-step runs are only held to learning about as well."""
    torch.manual_seed(5)
    xs, ys = torch.randn(64, 12), torch.randn(64, 8)
    runs = {}
    for mixed in (False, True):
        model = _mp_model()
        x0 = [p.detach().clone() for p in model.parameters()]
        opt = _mp_opt(model, mixed, orientation, scalar)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = F.mse_loss(model(xs), ys)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if len(losses) == 3:
                early = [p.detach().clone() for p in model.parameters()]
        runs[mixed] = (model, opt, x0, losses, early)
    model, opt, x0, losses, early = runs[True]
    for p in model.parameters():
        st = opt.state[p]
        assert p.dtype == torch.float32
        for key in ("momentum", "Q", "exp_avg", "exp_avg_sq"):
            if key in st:
                assert st[key].dtype == torch.bfloat16, key
    # weights (16, 12) tall and (8, 16) wide: the reference runs the wide one transposed
    assert opt.layouts["0.weight"].transposed is False
    assert opt.layouts["2.weight"].transposed == (orientation == "reference")
    assert losses[-1] < 0.8 * losses[0]
    for p, q, p0 in zip(early, runs[False][4], x0):
        assert float((p - q).norm() / (q - p0).norm()) < 5e-2
    assert abs(losses[-1] - runs[False][3][-1]) < 5e-2 * runs[False][3][0]


def test_matmul_precision():
    """fp32 is the default and the reference's products; tf32 changes nothing on a CPU (no TF32 units:
    bit for bit fp32); bf16 rounds the operands of B Q, Bᵀ P, P Rᵀ and P Qᵀ to bfloat16 (2⁻⁹ relative
    each) and accumulates in float32, so after 3 steps its total update is within 5e-2 of the fp32
    one by relative size (as mixed_precision's, above: the rounding feeds back through the QR), and
    really differs from it."""
    torch.manual_seed(5)
    xs, ys = torch.randn(64, 12), torch.randn(64, 8)
    runs = {}
    for precision in ("default", "fp32", "tf32", "bf16"):
        model = _mp_model()
        x0 = [p.detach().clone() for p in model.parameters()]
        options = {} if precision == "default" else {"matmul_precision": precision}
        opt = direct(list(model.named_parameters()), lr=0.02, rank=4, weight_decay=0.01, **options)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
        runs[precision] = [p.detach() for p in model.parameters()]
    for precision in ("fp32", "tf32"):
        assert all(torch.equal(a, b) for a, b in zip(runs[precision], runs["default"])), precision
    for p, q, p0 in zip(runs["bf16"], runs["fp32"], x0):
        assert float((p - q).norm() / (q - p0).norm()) < 5e-2
    assert any(not torch.equal(p, q) for p, q in zip(runs["bf16"], runs["fp32"]))
    with pytest.raises(ConfigError, match="matmul_precision"):
        direct(list(_mp_model().named_parameters()), matmul_precision="fp16")


class _captured_log:
    """Collect titan_commopt.optim.dion's log records in a string buffer."""

    def __enter__(self):
        import io

        self.buf, self.logger = io.StringIO(), logging.getLogger("titan_commopt.optim.dion")
        self.handler = logging.StreamHandler(self.buf)
        self.logger.addHandler(self.handler)
        return self.buf

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def test_mixed_precision_state_dict_round_trip():
    """torch's load_state_dict casts floating state to the parameter dtype; Dion puts it back into its
    storage dtype, and converts (saying so) a checkpoint written with the other setting."""
    torch.manual_seed(6)
    xs, ys = torch.randn(16, 12), torch.randn(16, 8)

    def trained(mixed):
        model = _mp_model()
        opt = _mp_opt(model, mixed)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
        return model, opt

    model, opt = trained(True)
    saved = opt.state_dict()
    fresh_model = _mp_model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = _mp_opt(fresh_model, True)
    fresh.load_state_dict(saved)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        for key, v in opt.state[p].items():
            assert fresh.state[q][key].dtype == v.dtype and torch.equal(fresh.state[q][key], v), key
    # a float32 checkpoint into a bf16 run (and back): converted, with a warning
    _, opt32 = trained(False)
    with _captured_log() as logs:
        fresh.load_state_dict(opt32.state_dict())
    assert "converted" in logs.getvalue()
    assert fresh.state[fresh_model[0].weight]["momentum"].dtype == torch.bfloat16
    back = _mp_opt(_mp_model(), False)
    back.load_state_dict(saved)
    assert all(v.dtype == torch.float32 for st in back.state.values() for k, v in st.items() if k != "step")
    # the checkpoint records both options as shaping the state (a change is refused on resume)
    shape = dion.state_shape(resolve("Dion", {"mixed_precision": True}))
    assert shape["mixed_precision"] is True and shape["orientation"] == "reference"
