"""Every optimizer family on meshes with tensor parallelism: R×T (2×2, 4 gloo processes) and R×S×T
(2×2×2, 8 processes, FSDP2 over TP), against single-process simulations.

The model uses torchtitan's llama3 TP layouts (real ``parallelize_module``): a row-wise parallel
embedding whose gradient comes back ``Replicate`` while the weight is ``Shard(0)``, a
sequence-parallel RMSNorm whose replicated weight gets a ``Partial`` gradient, a column-wise ``w1``
(rows over tp) and a row-wise ``w2`` (columns over tp, sequence-sharded output). Without FSDP2
(R×T) those gradients reach the optimizer as they are; with it (R×S×T) FSDP2 redistributes them and
shards again on top of TP (``_StridedShard`` rows for ``w1`` and the embedding).

Gradient convention (torchtitan's): each rank's loss is its local part of the squared error divided
by the global element count over both replicas, FSDP2 SUMs over S, so ``p.grad`` is 1/W of the
replica's mean gradient and ``grad_scale = W``. The simulations compute each replica's mean
gradient of the whole model directly, in float64:

- DeMo / FlexDeMo (every replicator): per parameter *piece* — the local shard a rank holds, read
  from the distributed run's placements — per replica, the momentum, extraction and aggregation of
  ``tests/sim_utils.py``'s DeMo simulation (DeMo works on the local shard; its momenta are float32).
- DES-LOC (Adam and ADOPT) / MT-DAO / LocalAdam / DiLoCo: two single-replica optimizers
  (``Topology.single()``, so the norm clip sees the whole model) with the R syncs done by hand, as
  ``tests/test_local_adaptive.py``; DiLoCo on the FP4 outer wire quantizes each piece's pseudo-gradient
  by hand (``compress/minifloat.py``'s blocks are per local shard).
- Dion: one centralized Dion on the mean gradient of both replicas (Theorem 2.1), including a
  matrix whose gradient is zero on every rank (it must change by weight decay only).

Every case also checks that replicas hold bit-identical shards at the end (6 steps: a multiple of
every Kx here) and that optimizer state tensors are DTensors with their parameter's placements
(what DCP checkpoints reshard by).
"""

import dataclasses

import pytest
import torch

from titan_commopt import comm
from titan_commopt.compress.minifloat import MiniFloatWire
from titan_commopt.optim import ShardShape, build_optimizer, resolve
from titan_commopt.optim.local import adaptive as la
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed
from tests.sim_utils import demo_aggregate, demo_extract, nesterov_outer_step_, phi
from tests.tp_utils import HP, L, N, W, batch, index_of, make_net, parallelize, replica_grads, shard_slices, sq_error

STEPS = 6
DEMO_LR = 0.01

# name -> (registered optimizer, options on top of its preset)
DEMO_CASES = {
    "DeMo": ("DeMo", dict(chunk=4, topk=3, beta=0.9, transfer_dtype="fp32")),
    "DeMo/identity_selected_lambda": ("DeMo", dict(chunk=4, topk=5, beta=0.9, rule="identity", transfer_dtype="fp32",
                                                   aggregate="mean_selected", momentum_subtraction=0.5, pack=False)),
    "FlexDeMo/demo": ("FlexDeMo", dict(chunk=4, topk=3)),
    "FlexDeMo/random": ("FlexDeMo", dict(replicator="random", compression_rate=0.25)),
    "FlexDeMo/striding": ("FlexDeMo", dict(replicator="striding", compression_rate=0.25)),
    "FlexDeMo/diloco": ("FlexDeMo", dict(replicator="diloco", compression_rate=0.5)),
    "FlexDeMo/full": ("FlexDeMo", dict(replicator="full", rule="identity", sign_before_sync=False)),
    # Decoupled AdamW: its first update is ±1 or 0 (untouched embedding rows) everywhere, whose DCT
    # top-k is all ties, so it is paired with an index-free replicator here
    "FlexDeMo/adamw_random": ("FlexDeMo", dict(base="adamw", replicator="random", compression_rate=0.25)),
}
# every preset (MT-DAO-halflife is MT-DAO with longer periods: with the periods set here, the same
# run), periods short enough that each kind of sync happens within STEPS; clip thresholds low enough
# that the clips are active (checked below)
LOCAL_CASES = {
    "DES-LOC": dict(Kx=2, Ku=[3], Kv=6, clip_threshold=0.02),
    "DES-LOC-ADOPT": dict(Kx=2, Ku=[3], Kv=6, clip_threshold=0.02),  # ADOPT under the coordinate clip
    "MT-DAO": dict(Kx=2, Ku=[3], Kv=3, beta1=[0.9], beta2=0.99, clip_threshold=0.05),
    "LocalAdam": dict(Kx=3, Ku=[3], Kv=3),
    # blocking, as the simulation below (the preset's streaming sync against its own simulation:
    # tests/test_local_adaptive.py's streaming cases, on the same engine)
    "DiLoCo": dict(Kx=2, fragments=1, sync_delay=0, merge="additive"),
    # each rank's pseudo-gradient of its own piece on the FP4 wire (blocks and scales per local shard)
    "DiLoCo/fp4": dict(Kx=2, outer_wire_dtype="fp4", fragments=1, sync_delay=0, merge="additive"),
}
DION_CASES = {
    "Dion": dict(rank_fraction=0.25),
    "Dion/qr_lion": dict(rank_fraction=0.25, orthogonalize="qr", scalar_optimizer="lion"),
    "Dion/full_rank": dict(rank_fraction=1.0),
    "Dion/zero_w1": dict(rank_fraction=0.25),  # w1's gradient is zero on every rank, every step
}
ZERO = {"Dion/zero_w1": "w1.weight"}


def _resolved(case, **changes):
    """The case's options as a user would set them (the preset fills the rest)."""
    if case in DEMO_CASES:
        name, kw = DEMO_CASES[case]
        return resolve(name, {**kw, **changes}, dataclasses.replace(HP, lr=DEMO_LR))
    if case in LOCAL_CASES:  # float64 syncs
        return resolve(case.split("/")[0], {**LOCAL_CASES[case], "transfer_dtype": "native", **changes}, HP)
    return resolve("Dion", {**DION_CASES[case], **changes}, HP)


def _build(case, named, topo, ledger):
    resolved = _resolved(case)
    return build_optimizer(named, topo, resolved, ledger=ledger), resolved


def _worker(rank, world, dims, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    names = ("dp_replicate", "fsdp", "tp") if len(dims) == 3 else ("dp_replicate", "tp")
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    topo = Topology.from_mesh(mesh, grad_scale=float(W))
    replica, t = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("tp")
    s, n_s = (mesh.get_local_rank("fsdp"), mesh["fsdp"].size()) if "fsdp" in names else (0, 1)
    rows, cols = slice(s * N // n_s, (s + 1) * N // n_s), slice(t * L // 2, (t + 1) * L // 2)
    out = {}
    for case in cases:
        model = parallelize(make_net(), mesh)
        named = list(model.named_parameters())
        ledger = comm.CommLedger()
        opt, resolved = _build(case, named, topo, ledger)
        for step in range(1, STEPS + 1):
            tokens, y = batch(replica, step)
            sq_error(model(tokens[rows]), y[rows, cols]).backward()
            if case in ZERO:
                p = dict(named)[ZERO[case]]
                p.grad = torch.zeros_like(p.grad)
            opt.step()
            opt.zero_grad()
            ledger.end_step()
        states_ok = all(
            isinstance(v, DTensor) and v.placements == p.placements
            for p in opt.state for v in opt.state[p].values()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        )
        out[case] = dict(
            local={n: p.to_local().detach().clone() for n, p in named},
            slices={n: shard_slices(p) for n, p in named},
            placements={n: tuple((type(pl).__name__, getattr(pl, "dim", None)) for pl in p.placements)
                        for n, p in named},
            states_ok=states_ok, in_sync=getattr(opt, "replicas_in_sync", lambda: True)(),
            R_sent=ledger.totals.get("R_sent", 0.0), T_sent=ledger.totals.get("T_sent", 0.0),
            formula=(resolved.family.r_bytes([ShardShape.of(n, p) for n, p in named], resolved, W).sent
                     if case in DEMO_CASES else None),
        )
    return dict(replica=replica, out=out)


# ---- simulations --------------------------------------------------------------------------------
def simulate_demo(case, pieces):
    name, kw = DEMO_CASES[case]
    cfg = _resolved(case).options
    model = make_net()
    params = dict(model.named_parameters())
    state, lr, wd = {}, _resolved(case).hparams.lr, HP.weight_decay  # DEMO_LR × the preset's lr_scale
    b1, b2, eps = HP.beta1, HP.beta2, HP.eps
    for t in range(1, STEPS + 1):
        grads = [replica_grads(model, r, t) for r in range(W)]
        with torch.no_grad():
            for n, p in params.items():
                for sl in pieces[n]:
                    view = p[index_of(sl)]
                    sent = []
                    for r in range(W):
                        g = grads[r][n][index_of(sl)].float()  # DeMo's states are float32
                        st = state.setdefault((n, r, sl), {"m": torch.zeros_like(g), "v": torch.zeros_like(g)})
                        if cfg.base == "sgd":
                            st["m"] = cfg.beta * st["m"] + g
                            x = st["m"]
                        else:  # the optimizer's own expressions (bit-for-bit in float32)
                            st["m"].lerp_(g, 1 - b1)
                            st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                            x = (st["m"] / (1 - b1**t)) / ((st["v"] / (1 - b2**t)).sqrt_().add_(eps))
                        sent.append(demo_extract(cfg, x, t, n, st))
                    Q = demo_aggregate(cfg, sent, view.shape, t, n)
                    if Q is not None:
                        view.mul_(1 - lr * wd).sub_(lr * phi(Q, cfg.rule).to(view.dtype))
    return [{n: p.detach() for n, p in params.items()}] * W


def simulate_local(case, pieces):
    cfg = _resolved(case).options
    models = [make_net() for _ in range(W)]
    # the outer step is simulated here; one replica's optimizer would apply it once more
    opts = [build_optimizer(list(m.named_parameters()), Topology.single(), _resolved(case, outer="average"))
            for m in models]
    o0 = opts[0]
    anchors = [p.detach().clone() for p in models[0].parameters()]
    bufs = [torch.zeros_like(a) for a in anchors]
    norms = []
    for step in range(1, STEPS + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            grads = replica_grads(m, r, step)
            norms.append(sum(float(g.norm() ** 2) for g in grads.values()) ** 0.5)
            o.step()

        def avg(get):
            for tensors in zip(*[get(o, m) for o, m in zip(opts, models)]):
                mean = sum(tensors) / W
                for x in tensors:
                    x.copy_(mean)

        with torch.no_grad():
            for j, k in enumerate(o0.periods.Ku):
                if k and step % k == 0:
                    avg(lambda o, m: [o.state[p][la.moment_key(j)] for p in m.parameters()])
            if o0.periods.Kv and step % o0.periods.Kv == 0:
                avg(lambda o, m: [o.state[p]["exp_avg_sq"] for p in m.parameters()])
            if step % o0.periods.Kx == 0:
                if cfg.outer_wire_dtype == "same":
                    avg(lambda o, m: [p.data for p in m.parameters()])
                else:  # per piece: mean_R x = anchor − mean_R decode(Q(anchor − x_r)), decoded in float32
                    wire = MiniFloatWire(cfg.outer_wire_dtype)
                    for anchor, (n, _), *ps in zip(anchors, models[0].named_parameters(),
                                                   *[m.parameters() for m in models]):
                        for sl in pieces[n]:
                            idx = index_of(sl)
                            a = anchor[idx]
                            shares = [wire.decode(wire.encode(wire.to_blocks([a - p.data[idx]], [a.numel()])))
                                      for p in ps]
                            mean = wire.from_blocks(sum(shares[1:], shares[0]) / W, [a.numel()])[0].view_as(a)
                            for p in ps:
                                p.data[idx] = a - mean
                if cfg.outer == "nesterov":
                    nesterov_outer_step_(models, anchors, bufs, cfg.outer_momentum, cfg.outer_lr)
    return [{n: p.detach() for n, p in m.named_parameters()} for m in models], min(norms)


def simulate_dion(case):
    model = make_net()
    opt = build_optimizer(list(model.named_parameters()), Topology.single(), _resolved(case))
    for step in range(1, STEPS + 1):
        grads = [replica_grads(model, r, step) for r in range(W)]
        for n, p in model.named_parameters():
            p.grad = sum(g[n] for g in grads) / W
            if n == ZERO.get(case):
                p.grad = torch.zeros_like(p.grad)
        opt.step()
    return [{n: p.detach() for n, p in model.named_parameters()}] * W


def _simulate(case, pieces):
    if case in DEMO_CASES:
        return simulate_demo(case, pieces)
    if case in LOCAL_CASES:
        ref, min_norm = simulate_local(case, pieces)
        kw = LOCAL_CASES[case]
        if "clip_threshold" in kw:  # the clip does act (norm clip: on the whole-model norm, summed over S, T)
            assert min_norm > kw["clip_threshold"], (case, min_norm)
        return ref
    return simulate_dion(case)


def _check(results, case, n_ranks):
    pieces = {n: sorted({res["out"][case]["slices"][n] for res in results}) for n in results[0]["out"][case]["slices"]}
    ref = _simulate(case, pieces)
    start = dict(make_net().named_parameters())
    tol = dict(atol=2e-5, rtol=1e-4) if case in DEMO_CASES else dict(atol=1e-10, rtol=1e-9)
    moved = 0.0
    for rank, res in enumerate(results):
        o = res["out"][case]
        assert o["states_ok"] and o["in_sync"], (case, rank)
        for n, shard in o["local"].items():
            idx = index_of(o["slices"][n])
            torch.testing.assert_close(shard, ref[res["replica"]][n][idx], **tol, msg=f"{case} rank {rank} {n}")
            moved = max(moved, float((shard - start[n].detach()[idx]).abs().max()))
        if o["formula"] is not None:  # DeMo: the measured R bytes are the formula's
            assert o["R_sent"] == pytest.approx(o["formula"] * STEPS)
        assert o["R_sent"] > 0, case
    assert moved > 1e-3, case
    half = n_ranks // W  # ranks r·half + k and r'·half + k hold the same shard on different replicas
    for k in range(half):
        for n, shard in results[k]["out"][case]["local"].items():
            assert torch.equal(shard, results[half + k]["out"][case]["local"][n]), (case, k, n)
    if case in ZERO:  # the all-zero-gradient matrix changed by weight decay only, exactly
        n = ZERO[case]
        x = start[n].detach().clone()
        lr = _resolved(case).hparams.lr  # HP.lr × the preset's lr_scale
        for _ in range(STEPS):
            x.mul_(1 - lr * HP.weight_decay)
        for res in results:
            o = res["out"][case]
            assert torch.equal(o["local"][n], x[index_of(o["slices"][n])]), res["replica"]


ALL_CASES = [*DEMO_CASES, *LOCAL_CASES, *DION_CASES]


@pytest.fixture(scope="module")
def rt_results():
    return run_distributed(_worker, 4, (2, 2), ALL_CASES)


@pytest.mark.parametrize("case", ALL_CASES)
def test_replicas_x_tp_equal_simulation(rt_results, case):
    _check(rt_results, case, 4)


def test_replicas_x_tp_layouts_and_t_traffic(rt_results):
    o = rt_results[0]["out"]["DeMo"]
    # what reaches the optimizer without FSDP2: the parameters' TP placements ...
    assert o["placements"] == {"tok_embeddings.weight": (("Shard", 0),), "norm.weight": (("Replicate", None),),
                               "w1.weight": (("Shard", 0),), "w2.weight": (("Shard", 1),)}
    # ... while the norm's gradient was Partial: summed over T by replica_grad, and counted
    for case in ALL_CASES:
        assert rt_results[0]["out"][case]["T_sent"] > 0, case


# ---- R×S×T: 2 replicas × FSDP2 over 2 × TP over 2 (8 processes) -----------------------------------
@pytest.fixture(scope="module")
def rst_results():
    return run_distributed(_worker, 8, (2, 2, 2), ALL_CASES)


@pytest.mark.parametrize("case", ALL_CASES)
def test_replicas_x_fsdp_x_tp_equal_simulation(rst_results, case):
    _check(rst_results, case, 8)


def test_replicas_x_fsdp_x_tp_layouts(rst_results):
    o = rst_results[0]["out"]["DeMo"]
    # FSDP2 shards on top of TP: strided rows where TP already split them
    assert o["placements"] == {
        "tok_embeddings.weight": (("_StridedShard", 0), ("Shard", 0)),
        "norm.weight": (("Shard", 0), ("Replicate", None)),
        "w1.weight": (("_StridedShard", 0), ("Shard", 0)),
        "w2.weight": (("Shard", 0), ("Shard", 1)),
    }
