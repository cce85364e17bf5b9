"""SparseLoCo against a single-process simulation of the paper's Algorithm 1, on R = 2 (2 gloo
processes), R×S (2×2, FSDP2 over S) and R×T (2×2, torchtitan's llama3 TP plan); the ledger against
``sparseloco_r_bytes``; resume; bad values.

The simulation is written from the paper's box, per parameter *piece* (the local shard a rank
holds, read from the distributed run): each replica runs torch's fused AdamW on its own copy of the
whole model (the replica's mean gradient), then every H steps, per piece and replica,
Δ = anchor − x, e ← β·e + Δ, the k largest |e| of every chunk, the reference quantizer (mean shift,
unbiased σ, scale = range·σ/bins, round, clamp, bin means), e ← e − Δ̂; then
anchor ← anchor − α·mean_r Δ̂ and x ← anchor (``sync_delay``: x ← anchor + (x − x at issue), τ steps
later; ``merge`` = delayed / eager: each replica's anchor moves by the aggregate of the period before,
eager with its own share of it replaced by this period's, Δ̂_r(t) − Δ̂_r(t−1) over R added).
"""

import copy
import math

import pytest
import torch

from titan_commopt import comm
from titan_commopt.compress.dct import chunk_size, dct_basis
from titan_commopt.optim import ShardShape, build_optimizer, resolve
from titan_commopt.optim.local.sparseloco import sparseloco_s_bytes
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed
from tests.tp_utils import HP, L, N, W, batch, index_of, make_net, parallelize, replica_grads, shard_slices, sq_error

H, STEPS = 2, 6  # three syncs
BASE = dict(H=H, chunk=4, topk=3)
TEMPLAR = dict(aggregate="senders", clip="median_norm", topk_rule="even")  # Templar's outer step
PAPER = dict(aggregate="senders", topk_rule="area")  # the paper code's
CASES = {
    "2bit": {},
    "2bit/beta0.5_alpha0.7": dict(error_decay=0.5, outer_lr=0.7),
    "fp32": dict(quantization="none"),
    "dct": dict(transform="dct"),
    "sync_delay1": dict(sync_delay=1),
    "lerp0.25": dict(merge="lerp", merge_alpha=0.25),  # Streaming DiLoCo's merge, at once
    "sync_delay1/lerp0.5": dict(sync_delay=1, merge="lerp", merge_alpha=0.5),
    "delayed": dict(merge="delayed"),
    "eager": dict(merge="eager"),  # aggregate = mean: the eager share 1/R is exact
    "templar/eager": dict(TEMPLAR, merge="eager"),
    "delayed/outer_momentum0.9": dict(merge="delayed", outer_momentum=0.9, outer_lr=0.7),  # MuLoCo's outer step
    "templar": TEMPLAR,
    # the authors' α = 0.7 in both e and the step (their rule) is our outer_lr = 0.49
    "templar/authors_alpha0.7": dict(TEMPLAR, outer_lr=0.49, authors_alpha=0.7),
    "paper": PAPER,
    "fp32/median_norm": dict(quantization="none", clip="median_norm", topk=5),
}
MESH_CASES = ["2bit", "dct", "templar"]
RESUME_CASES = ["2bit", "sync_delay1", "eager"]  # saved after 2H + 1 updates: eager's sync in flight


def _resolved(case, **changes):
    given = {k: v for k, v in CASES[case].items() if k != "authors_alpha"}
    return resolve("SparseLoCo", {**BASE, **given, **changes}, HP)


# ---- the distributed runs -------------------------------------------------------------------------
def _train(model, opt, replica, steps, rows, cols, ledger, start=1):
    for step in range(start, start + steps):
        tokens, y = batch(replica, step)
        sq_error(model(tokens[rows]), y[rows, cols]).backward()
        opt.step()
        opt.zero_grad()
        ledger.end_step()


def _worker(rank, world, dims, names, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    topo = Topology.from_mesh(mesh, grad_scale=float(W))
    replica = mesh.get_local_rank("dp_replicate")
    s, n_s = (mesh.get_local_rank("fsdp"), mesh["fsdp"].size()) if "fsdp" in names else (0, 1)
    t, n_t = (mesh.get_local_rank("tp"), 2) if "tp" in names else (0, 1)
    rows, cols = slice(s * N // n_s, (s + 1) * N // n_s), slice(t * L // n_t, (t + 1) * L // n_t)

    def build(case):
        model = make_net()
        if "tp" in names:
            parallelize(model, mesh)
        elif "fsdp" in names:
            fully_shard(model, mesh=mesh["fsdp"])
            model.set_force_sum_reduction_for_comms(True)
            model.set_gradient_divide_factor(1.0)
        named = list(model.named_parameters())
        ledger = comm.CommLedger()
        resolved = _resolved(case)
        return model, named, build_optimizer(named, topo, resolved, ledger=ledger), ledger, resolved

    out = {}
    for case in cases:
        model, named, opt, ledger, resolved = build(case)
        _train(model, opt, replica, STEPS, rows, cols, ledger)
        in_sync = opt.replicas_in_sync()
        opt.flush()  # a sync still in flight (sync_delay) lands; an overlapped one only completes
        with opt.global_params(ledger=comm.CommLedger()):
            global_model = {n: comm_local(p) for n, p in named}
        out[case] = dict(
            local={n: comm_local(p) for n, p in named}, slices={n: shard_slices(p) if isinstance(p, DTensor) else
                                                              tuple((0, d) for d in p.shape) for n, p in named},
            in_sync=in_sync, R_sent=ledger.totals.get("R_sent", 0.0), global_model=global_model,
            formula=resolved.family.r_bytes([ShardShape.of(n, p) for n, p in named], resolved, W).sent,
            S_sent=ledger.totals.get("S_sent", 0.0), T_sent=ledger.totals.get("T_sent", 0.0),
            formula_S=sparseloco_s_bytes([ShardShape.of(n, p) for n, p in named], resolved, "S").sent,
            formula_T=sparseloco_s_bytes([ShardShape.of(n, p) for n, p in named], resolved, "T").sent,
            states_ok=all(isinstance(v, DTensor) and v.placements == p.placements for p in opt.state
                          for k, v in opt.state[p].items() if k != "step") if "tp" in names or "fsdp" in names else True,
        )
    if len(dims) == 1:  # resume: state_dict → new optimizer → load → the same next steps
        for case in RESUME_CASES:
            model, named, opt, ledger, _ = build(case)
            _train(model, opt, replica, 2 * H + 1, rows, cols, ledger)
            saved = copy.deepcopy(opt.state_dict())
            saved_params = {n: p.detach().clone() for n, p in named}
            _train(model, opt, replica, 3, rows, cols, ledger, start=2 * H + 2)
            model2, named2, opt2, ledger2, _ = build(case)
            with torch.no_grad():
                for n, p in named2:
                    p.copy_(saved_params[n])
            opt2.load_state_dict(saved)
            _train(model2, opt2, replica, 3, rows, cols, ledger2, start=2 * H + 2)
            out[f"resume/{case}"] = all(torch.equal(p.detach(), q.detach()) for (_, p), (_, q) in zip(named, named2))
    return dict(replica=replica, out=out)


def comm_local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


@pytest.fixture(scope="module")
def r2():
    return run_distributed(_worker, 2, (2,), ("dp_replicate",), list(CASES))


def _meshes(rank, world):
    """R×S and R×T in one spawn of 4 processes (a mesh each)."""
    return {names[1]: _worker(rank, world, (2, 2), names, MESH_CASES)
            for names in (("dp_replicate", "fsdp"), ("dp_replicate", "tp"))}


@pytest.fixture(scope="module")
def meshes():
    return run_distributed(_meshes, 4)


@pytest.fixture(scope="module")
def rs(meshes):
    return [res["fsdp"] for res in meshes]


@pytest.fixture(scope="module")
def rt(meshes):
    return [res["tp"] for res in meshes]


# ---- the simulation (the paper's Algorithm 1 with the authors' codes' options, plainly) --------------
def _flat(shape):
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (math.prod(shape),)


def _grid(shape, sl, s):
    """Chunk sizes of the piece ``sl`` of a tensor of ``shape``: the whole tensor's (largest divisors
    <= s of its dims) where the piece is a union of its chunks, else the piece's own."""
    whole = tuple(chunk_size(d, s) for d in _flat(shape))
    for d, (start, extent) in enumerate(sl):
        if extent == shape[d]:
            continue
        if d > 1 or (d == 1 and len(shape) > 2) or start % whole[d] or extent % whole[d]:
            return tuple(chunk_size(d, s) for d in _flat(tuple(n for _, n in sl)))
    return whole


def _to_chunks(x, cs, dct):
    dims = _flat(x.shape)
    if len(dims) == 1:
        c = x.reshape(-1, cs[0])
        return c @ dct_basis(cs[0], dtype=x.dtype).T if dct else c.clone()
    (d0, d1), (c0, c1) = dims, cs
    blocks = x.reshape(d0 // c0, c0, d1 // c1, c1).permute(0, 2, 1, 3)  # (n0, n1, c0, c1)
    if dct:
        b0, b1 = dct_basis(c0, dtype=x.dtype), dct_basis(c1, dtype=x.dtype)
        blocks = b0 @ blocks @ b1.T
    return blocks.reshape(-1, c0 * c1)


def _from_chunks(c, shape, cs, dct):
    dims = _flat(shape)
    if len(dims) == 1:
        return (c @ dct_basis(cs[0], dtype=c.dtype) if dct else c).reshape(shape)
    (d0, d1), (c0, c1) = dims, cs
    blocks = c.reshape(d0 // c0, d1 // c1, c0, c1)
    if dct:
        b0, b1 = dct_basis(c0, dtype=c.dtype), dct_basis(c1, dtype=c.dtype)
        blocks = b0.T @ blocks @ b1
    return blocks.permute(0, 2, 1, 3).reshape(shape)


def _k(cfg, L):
    """Values kept per chunk: ours min(topk, L); Templar's _clamp_topk (at least 2, even); the paper
    code's k scaled to the chunk's area (without DCT)."""
    if cfg.topk_rule == "even":
        k = max(2, min(cfg.topk, L))
        return min(L, k - k % 2)
    if cfg.topk_rule == "area" and cfg.transform == "none":
        return min(L, max(1, round(L * cfg.topk / cfg.chunk**2)))
    return min(cfg.topk, L)


def _quantize(v, bins=4, rng=6.0):
    """The reference code's statistical quantizer on the flat selected values of one whole tensor
    (float32, as the reference computes it): the dequantized values."""
    v = v.float()
    shift = v.mean()
    c = v - shift
    std = c.norm() / math.sqrt(c.numel() - 1)
    scale = rng * std / bins
    if scale == 0 or not torch.isfinite(scale):
        scale = torch.tensor(1.0)
    q = (c / scale + bins // 2).round().clamp(0, bins - 1).long()
    sums = torch.zeros(bins).scatter_add_(0, q, c)
    counts = torch.zeros(bins).scatter_add_(0, q, torch.ones_like(c))
    lookup = torch.where(counts > 0, sums / counts, 0.0)
    return lookup[q] + shift


def reference_aggregate(cfg, sent, L):
    """One piece's aggregate of every replica's ``(indices, values)`` (``(chunks, k)`` each), as the
    codes write it: with the clip each replica's values scaled by min(1, median / (‖v_r‖ + 1e-8)),
    ‖v_r‖ over its whole tensor (given as the third item), torch.median (the lower one for even R);
    ``senders``: scatter_reduce's mean over the replicas that sent a coordinate (include_self=False,
    every replica's indices concatenated along the chunk); ``mean``: the sum over replicas ÷ R."""
    vals = [v for _, v, _ in sent]
    if cfg.clip == "median_norm":
        norms = torch.stack([norm for _, _, norm in sent])
        median = torch.median(norms)
        vals = [v * torch.clamp(median / (n + 1e-8), max=1) for v, n in zip(vals, norms)]
    chunks = sent[0][0].shape[0]
    if cfg.aggregate == "senders":
        idx, cat = torch.cat([i for i, _, _ in sent], -1), torch.cat(vals, -1)
        return torch.zeros(chunks, L).scatter_reduce_(-1, idx, cat, reduce="mean", include_self=False)
    out = torch.zeros(chunks, L)
    for (i, _, _), v in zip(sent, vals):
        out.scatter_add_(-1, i, v / len(sent))
    return out


def simulate(case, pieces, anchors_out=None):
    cfg = _resolved(case).options
    hp = _resolved(case).hparams
    # the authors' outer lr (both codes): e ← β·e + α·Δ and x ← x − α·agg; ours at outer_lr = α²
    authors_alpha = CASES[case].get("authors_alpha")
    ef_scale, alpha = (authors_alpha, authors_alpha) if authors_alpha else (1.0, cfg.outer_lr)
    models = [make_net() for _ in range(W)]
    inner = [torch.optim.AdamW(m.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                               weight_decay=hp.weight_decay, fused=True) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    anchors = [{n: p.detach().clone() for n, p in params[0].items()} for _ in range(W)]  # each replica's
    anchor = anchors[0]
    err = {(n, sl, r): torch.zeros_like(anchor[n][index_of(sl)]) for n in anchor for sl in pieces[n] for r in range(W)}
    pending = []  # (lands after step, {(n, sl): aggregate}, snapshots)
    dct = cfg.transform == "dct"
    overlapped = cfg.merge in ("delayed", "eager")
    landed, stale = {}, {}  # overlapped: (n, sl) → the aggregate of the period before; (n, sl, r) → Δ̂_r sent then
    bufs = {}  # (n, sl, r) → the outer momentum (outer_momentum > 0: Nesterov SGD on the aggregate)

    def outer(a, delta, key):
        if not cfg.outer_momentum:
            a.sub_(delta, alpha=alpha)
            return
        mu = cfg.outer_momentum
        bufs[key] = mu * bufs.get(key, torch.zeros_like(delta)) + delta
        a.sub_(alpha * (delta + mu * bufs[key]))

    def land(aggs, snaps):
        with torch.no_grad():
            for (n, sl), agg in aggs.items():
                for r in range(W):
                    a = anchors[r][n][index_of(sl)]
                    outer(a, agg, (n, sl, r))
                    x = params[r][n][index_of(sl)]
                    if cfg.merge == "lerp":  # Streaming DiLoCo: x ← α·x + (1 − α)·x_anchor
                        x.copy_(cfg.merge_alpha * x + (1 - cfg.merge_alpha) * a)
                    elif snaps is None:
                        x.copy_(a)
                    else:
                        x.sub_(snaps[(n, sl, r)]).add_(a)

    def land_overlapped(aggs, fresh):
        with torch.no_grad():
            for (n, sl), agg in aggs.items():
                for r in range(W):
                    before = landed.get((n, sl), torch.zeros_like(agg))
                    delta = before.clone()
                    if cfg.merge == "eager":  # the own stale share out, the fresh one in
                        delta += (fresh[(n, sl, r)] - stale.get((n, sl, r), torch.zeros_like(agg))) / W
                    a = anchors[r][n][index_of(sl)]
                    outer(a, delta, (n, sl, r))
                    params[r][n][index_of(sl)].copy_(a)
                    stale[(n, sl, r)] = fresh[(n, sl, r)]
                landed[(n, sl)] = agg

    for t in range(1, STEPS + 1):
        for r in range(W):
            grads = replica_grads(models[r], r, t)
            for n, p in params[r].items():
                p.grad = grads[n]
            inner[r].step()
        if t % cfg.H == 0:
            aggs, snaps, fresh = {}, ({} if cfg.sync_delay else None), {}
            with torch.no_grad():
                for n in anchor:
                    shape = tuple(anchor[n].shape)
                    grids = {sl: _grid(shape, sl, cfg.chunk) for sl in pieces[n]}
                    sent = {}  # (sl, r) -> (indices, dequantized values)
                    for r in range(W):
                        selected = {}
                        for sl in pieces[n]:
                            x, e = params[r][n][index_of(sl)], err[(n, sl, r)]
                            e.mul_(cfg.error_decay).add_(anchors[r][n][index_of(sl)] - x, alpha=ef_scale)  # e ← β e + Δ
                            ec = _to_chunks(e, grids[sl], dct)
                            idx = ec.abs().topk(_k(cfg, ec.shape[1]), dim=-1).indices
                            selected[sl] = (idx, ec.gather(-1, idx), ec.shape)
                            if snaps is not None:
                                snaps[(n, sl, r)] = x.clone()
                        flat = torch.cat([v.reshape(-1) for _, v, _ in selected.values()])  # the whole tensor's
                        deq = _quantize(flat, rng=cfg.quant_range) if cfg.quantization == "2bit" else flat.float()
                        norm, at = deq.norm(), 0
                        for sl, (idx, v, ec_shape) in selected.items():
                            d = deq[at: at + v.numel()].view(v.shape)
                            at += v.numel()
                            dense = torch.zeros(ec_shape).scatter_(-1, idx, d)
                            fresh[(n, sl, r)] = _from_chunks(dense.to(anchor[n].dtype), err[(n, sl, r)].shape,
                                                             grids[sl], dct)
                            err[(n, sl, r)].sub_(fresh[(n, sl, r)])  # e ← e − Δ̂
                            sent[(sl, r)] = (idx, d, norm)
                    for sl in pieces[n]:
                        L = math.prod(grids[sl])
                        agg = reference_aggregate(cfg, [sent[(sl, r)] for r in range(W)], L)
                        aggs[(n, sl)] = _from_chunks(agg.to(anchor[n].dtype), anchor[n][index_of(sl)].shape,
                                                     grids[sl], dct)
            if overlapped:
                land_overlapped(aggs, fresh)
            else:
                pending.append((t + cfg.sync_delay, aggs, snaps))
        while pending and pending[0][0] <= t:
            land(*pending.pop(0)[1:])
    for _, aggs, snaps in pending:  # flush()
        land(aggs, snaps)
    if anchors_out is not None:  # each replica's anchor: the global model's pieces
        anchors_out.extend(anchors)
    return [{n: p.detach() for n, p in ps.items()} for ps in params]


def _check(results, case):
    pieces = {n: sorted({res["out"][case]["slices"][n] for res in results}) for n in results[0]["out"][case]["slices"]}
    anchors = []
    ref = simulate(case, pieces, anchors)
    start = dict(make_net().named_parameters())
    moved = 0.0
    for rank, res in enumerate(results):
        o = res["out"][case]
        assert o["states_ok"], (case, rank)
        eager = CASES[case].get("merge") == "eager"
        apart = eager or CASES[case].get("merge_alpha", 0.0) > 0  # each replica keeps something of its own
        assert o["in_sync"] == (CASES[case].get("sync_delay", 0) == 0 and not apart), (case, rank)
        for n, shard in o["local"].items():
            idx = index_of(o["slices"][n])
            torch.testing.assert_close(shard, ref[res["replica"]][n][idx], atol=5e-8, rtol=1e-6,  # float32 values: round-off only
                                       msg=lambda m: f"{case} rank {rank} {n}: {m}")
            moved = max(moved, float((shard - start[n].detach()[idx]).abs().max()))
            # the global model: the anchor (after the flush), the replicas' mean of theirs for eager ones
            want = sum(a[n] for a in anchors) / W if eager else anchors[res["replica"]][n]
            torch.testing.assert_close(o["global_model"][n], want[idx], atol=5e-8, rtol=1e-6)
        assert o["R_sent"] > 0 and o["R_sent"] == o["formula"] * STEPS, (case, o["R_sent"], o["formula"])
        # the quantizer's statistics summed over the shard groups: all of S's traffic here (T also
        # carries the sequence-parallel norm's Partial gradient, replica_grad's)
        assert o["S_sent"] == pytest.approx(o["formula_S"] * STEPS), (case, o["S_sent"], o["formula_S"])
        assert o["T_sent"] >= o["formula_T"] * STEPS > 0 or o["formula_T"] == 0, (case, o["T_sent"], o["formula_T"])
    assert moved > 1e-3, case
    half = len(results) // W  # the same shard on the two replicas: bit-identical after a sync (not eager, lerp)
    for k in range(half if CASES[case].get("merge") not in ("eager", "lerp") else 0):
        for n, shard in results[k]["out"][case]["local"].items():
            assert torch.equal(shard, results[half + k]["out"][case]["local"][n]), (case, k, n)


@pytest.mark.parametrize("case", list(CASES))
def test_two_replicas_equal_the_papers_algorithm_and_the_byte_formula(r2, case):
    _check(r2, case)


@pytest.mark.parametrize("case", MESH_CASES)
def test_replicate_x_fsdp_equals_the_papers_algorithm(rs, case):
    _check(rs, case)


@pytest.mark.parametrize("case", MESH_CASES)
def test_replicate_x_tp_equals_the_papers_algorithm(rt, case):
    _check(rt, case)


@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_continues_identically(r2, case):
    assert all(res["out"][f"resume/{case}"] for res in r2)


def test_byte_formula_counts_codes_indices_and_levels():
    resolved = resolve("SparseLoCo", {"H": 4, "chunk": 4, "topk": 3, "topk_rule": "min", "clip": "none"})
    # an 8×12 matrix: 6 chunks of 4×4 (L = 16), 18 values: 5 bytes of 2-bit codes, 9 of 4-bit indices,
    # 16 of levels; a 6-vector: 2 chunks of 3 (k = 3 of 3: no indices), 6 values: 2 + 16; an empty
    # shard sends nothing. Per step: one sync's bytes / H.
    shards = [ShardShape("w", (8, 12), (8, 12)), ShardShape("b", (6,), (6,)), ShardShape("z", (0, 3), (4, 3))]
    got = resolved.family.r_bytes(shards, resolved, 3)
    assert got.sent == ((5 + 9 + 16) + (2 + 16)) / 4
    assert got.recv == 2 * got.sent
    assert resolved.family.r_bytes(shards, resolved, 1).sent == 0
    clipped = resolve("SparseLoCo", {"H": 4, "chunk": 4, "topk": 3, "topk_rule": "min", "clip": "median_norm"})
    assert clipped.family.r_bytes(shards, clipped, 3).sent == got.sent + 2 * 4 / 4  # + a float32 norm per shard
    even = resolve("SparseLoCo", {"H": 4, "chunk": 4, "topk": 3, "topk_rule": "even", "clip": "none"})
    # Templar's k: the matrix keeps 2 of 16 per chunk (12 values: 3 + 6 + 16 bytes), the vector 2 of 3
    # (4 values: 1 + 1 + 16)
    assert even.family.r_bytes(shards, even, 3).sent == ((3 + 6 + 16) + (1 + 1 + 16)) / 4


def test_byte_formulas_follow_the_chunk_grid_and_count_the_statistics():
    resolved = resolve("SparseLoCo", {"H": 5, "topk": 64, "topk_rule": "min", "clip": "none"})  # chunk 64, top 64, 2 bits
    bytes_of = lambda shard: resolved.family.r_bytes([shard], resolved, 2).sent * 5  # noqa: E731  one sync
    # 128×128 over S = 2: rank 0's 64 rows are one row of the tensor's 64×64 chunks (2 chunks, 12-bit
    # indices); over S = 3 its 43 rows are chunked on their own: 43×64 chunks (12-bit indices too)
    on_grid, off_grid = ShardShape.fsdp("a", (128, 128), 2), ShardShape.fsdp("a", (128, 128), 3)
    assert bytes_of(on_grid) == 128 * 2 / 8 + 16 + 128 * 12 / 8
    assert bytes_of(off_grid) == 128 * 2 / 8 + 16 + 128 * 12 / 8
    # 192×64 over S = 2: 96 rows off the 64-row grid, chunked 48×64 (two chunks of 3072, 12 bits)
    assert bytes_of(ShardShape.fsdp("b", (192, 64), 2)) == 128 * 2 / 8 + 16 + 128 * 12 / 8
    # a vector of 96 over S = 2 (rank 1: 48, the tensor's chunk 48): k = 48 of 48, every value, no indices
    assert bytes_of(ShardShape.fsdp("v", (96,), 2, rank=1)) == 48 * 2 / 8 + 16
    # ... and with top 16 of each 48: 6-bit indices
    top16 = resolve("SparseLoCo", {"H": 5, "topk": 16, "topk_rule": "min", "clip": "none"})
    assert top16.family.r_bytes([ShardShape.fsdp("v", (96,), 2, rank=1)], top16, 2).sent * 5 == 4 + 16 + 12
    # the statistics: 3 + 2·4 float64 per S-sharded tensor per sync, an empty shard's included
    shards = [ShardShape.fsdp("a", (128, 128), 3, rank=2), ShardShape.fsdp("z", (2, 4), 3, rank=2),
              ShardShape("plain", (5,), (5,))]
    assert shards[1].numel == 0
    assert sparseloco_s_bytes(shards, resolved).sent == 2 * 11 * 8 / 5
    assert sparseloco_s_bytes(shards, resolve("SparseLoCo", {"quantization": "none", "clip": "none"})).sent == 0
    assert sparseloco_s_bytes(shards, resolve("SparseLoCo", {"quantization": "none", "clip": "median_norm",
                                                             "H": 5})).sent == 2 * 8 / 5


def test_preset_and_bad_values_are_one_line_config_errors():
    cfg = resolve("SparseLoCo").options
    assert (cfg.H, cfg.chunk, cfg.topk, cfg.transform, cfg.quantization, cfg.error_decay, cfg.outer_lr, cfg.aggregate,
            cfg.clip, cfg.topk_rule) == (30, 64, 64, "none", "2bit", 0.95, 1.0, "senders", "median_norm", "even")
    for given, message in [
        ({"topk": 20, "chunk": 4}, r"^\[commopt.sparseloco\] topk = 20: allowed is at most chunk\^2 = 16 \(chunk = 4\)$"),
        ({"sync_delay": 2, "H": 2}, r"^\[commopt.sparseloco\] sync_delay = 2: allowed is an integer >= 0 below H = 2"),
        ({"quantization": "3bit"}, r"^\[commopt.sparseloco\] quantization = '3bit'"),
        ({"merge": "eager", "sync_delay": 1}, r"^\[commopt.sparseloco\] merge = 'eager' with sync_delay = 1: allowed is "
                                              r"sync_delay = 0 with merge = \"delayed\" or \"eager\""),
        ({"merge": "streaming"}, r"^\[commopt.sparseloco\] merge = 'streaming': allowed is one of 'additive', 'lerp', "
                                 r"'delayed', 'eager'$"),
        ({"merge_alpha": 0.5}, r"^\[commopt.sparseloco\] merge_alpha = 0.5 with merge = 'additive': merge_alpha is read "
                               r"only by merge = \"lerp\""),
        ({"error_decay": 1.5}, r"^\[commopt.sparseloco\] error_decay = 1.5"),
    ]:
        with pytest.raises(ConfigError, match=message) as e:
            resolve("SparseLoCo", given)
        assert "\n" not in str(e.value)
    assert cfg.merge == "additive" and "merge" not in resolve("SparseLoCo").record()["state_shape"]
    assert resolve("SparseLoCo", {"merge": "delayed"}).record()["state_shape"]["merge"] == "delayed"
    with pytest.raises(ConfigError, match="did you mean 'SparseLoCo'"):
        resolve("sparseloco2")


# ---- the same update whatever the FSDP layout, where the shards tile the chunk grid ----------------
# chunk 64, top 16: the 128×128 matrix's rows split 64/64 over S = 2 (on the grid), 43/43/42 over S = 3 (off);
# the 192×64 one's 96/96 (off) and 64/64/64 (on); the 256-vector's 128/128 (on) and 86/86/84 (off)
LAYOUT_SHAPES = {"a": (128, 128), "b": (192, 64), "v": (256,)}
ON_GRID = {2: {"a", "v"}, 3: {"b"}}
LAYOUT_STEPS, LAYOUT_H = 4, 2


class _Layout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        for name, shape in LAYOUT_SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))


def _layout_grads(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(shape, generator=gen) * (1 + i) for i, (n, shape) in enumerate(LAYOUT_SHAPES.items())}


def _layout_run(mesh):
    """4 steps of SparseLoCo (R = 1, H = 2) from the same parameters and gradients, the parameters
    FSDP2-sharded over ``mesh`` (``None``: plain tensors): this rank's pieces, the log lines, the S
    bytes against the formula."""
    import logging

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _Layout()
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    topo = Topology.single() if mesh is None else Topology.from_mesh(mesh)
    resolved = resolve("SparseLoCo", dict(H=LAYOUT_H, topk=16))  # a vector chunk of 64 keeps 16
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("titan_commopt.optim.local.sparseloco")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ledger = comm.CommLedger()
        opt = build_optimizer(named, topo, resolved, ledger=ledger)
        for step in range(1, LAYOUT_STEPS + 1):
            for (name, p), g in zip(named, _layout_grads(step).values()):
                if isinstance(p, DTensor):
                    g = DTensor.from_local(g[index_of(shard_slices(p))], p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                p.grad = g
            opt.step()
            ledger.end_step()
    finally:
        logger.removeHandler(handler)
    shards = [ShardShape.of(n, p) for n, p in named]
    return dict(local={n: comm_local(p) for n, p in named},
                slices={n: shard_slices(p) if isinstance(p, DTensor) else tuple((0, d) for d in p.shape) for n, p in named},
                logs=[r.getMessage() for r in records], S_sent=ledger.totals.get("S_sent", 0.0),
                formula_S=sparseloco_s_bytes(shards, resolved).sent * LAYOUT_STEPS)


def _layouts(rank, world):
    """S = 1 (rank 0, plain tensors), S = 2 (ranks 0 and 1) and S = 3 (all), in one spawn of 3."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = {1: _layout_run(None) if rank == 0 else None}
    pair = dist.new_group([0, 1])  # every rank makes it; ranks 0 and 1 use it
    out[2] = _layout_run(DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("fsdp",))) if rank < 2 else None
    out[3] = _layout_run(init_device_mesh("cpu", (3,), mesh_dim_names=("fsdp",)))
    return out


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_layouts, 3)


@pytest.mark.parametrize("S", [2, 3])
def test_the_update_is_the_same_on_every_layout_that_tiles_the_chunk_grid(layouts, S):
    whole = layouts[0][1]["local"]
    runs = [res[S] for res in layouts[:S]]
    assert sorted(run["slices"]["a"][0] for run in runs) == ([(0, 64), (64, 64)] if S == 2 else
                                                             [(0, 43), (43, 43), (86, 42)])
    for name in LAYOUT_SHAPES:
        full = torch.empty_like(whole[name])
        for run in runs:
            full[index_of(run["slices"][name])] = run["local"][name]
        moved = (whole[name] - _Layout().get_parameter(name).detach()).abs().max()
        diff = (full - whole[name]).abs().max()
        if name in ON_GRID[S]:  # the same values kept, the same codes and levels: round-off at most
            torch.testing.assert_close(full, whole[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"S={S} {name}: {m}")
        else:  # the shard's own chunks keep other values
            assert diff > 1e-3 * moved, (S, name, float(diff), float(moved))
    for rank, run in enumerate(runs):
        off = [line for line in run["logs"] if "do not tile" in line]
        assert len(off) == 1, (S, rank, run["logs"])  # once per run, not per step
        assert all(f"{n} " in off[0] for n in set(LAYOUT_SHAPES) - ON_GRID[S])
        assert run["S_sent"] == pytest.approx(run["formula_S"]) and run["S_sent"] > 0
    assert not [line for line in layouts[0][1]["logs"] if "do not tile" in line]


def test_one_replica_with_a_payload_of_no_whole_float():
    """One replica (no R group: the all-gather hands the payload back as a (1, n) view of itself) and
    a 45-vector, whose 2-bit payload is no multiple of 4 bytes: the outer step decodes it."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(45)), torch.nn.Parameter(torch.randn(7, 9))
    for changes in ({}, {"quantization": "none"}, dict(TEMPLAR), dict(PAPER)):
        resolved = resolve("SparseLoCo", {"H": 2, "chunk": 8, "topk": 3, **changes})  # 45 = 5 chunks of 9
        model = [("v", p), ("m", q)]
        payload = resolved.family.r_bytes([ShardShape.of(n, t) for n, t in model], resolved, 2).sent * 2
        assert payload % 4, (changes, payload)  # no whole number of floats
        opt = build_optimizer(model, Topology.single(), resolved)
        before = p.detach().clone()
        for _ in range(2):
            p.grad, q.grad = torch.randn(45), torch.randn(7, 9)
            opt.step()
        assert not torch.equal(p.detach(), before) and torch.isfinite(p).all()


@pytest.mark.parametrize("W", [3, 4])
@pytest.mark.parametrize("options", [TEMPLAR, PAPER, {}], ids=["templar", "paper", "mean"])
def test_outer_step_aggregate_is_the_authors_formula(W, options):
    """W replicas' error feedback of one 96×200 tensor (Templar's 48×50 chunks) through the codec —
    top-k, the whole tensor's 2-bit quantizer, the bytes, the aggregate of every replica's bytes —
    against the references' formula on the same inputs (:func:`reference_aggregate`): even W = 4
    takes torch.median's lower middle norm."""
    from titan_commopt.optim.local.sparseloco import ShardCodec

    cfg = resolve("SparseLoCo", {"topk": 64, **options}).options  # top 64 of each chunk, as the authors run
    codec = ShardCodec(cfg, (96, 200))
    q = codec.quantizer
    gen = torch.Generator().manual_seed(W)
    errors = [torch.randn(96, 200, generator=gen) * (1 + r) for r in range(W)]  # norms far apart: the clip acts
    payloads, sent = [], []
    for e in errors:
        ec = _to_chunks(e, (48, 50), False)
        vals, idx = codec.select(codec.to_chunks(e))
        assert torch.equal(codec.to_chunks(e), ec)
        codes, levels = q.quantize(vals)
        out = torch.empty(codec.nbytes, dtype=torch.uint8)
        norm = q.norms(q.bin_sums(vals, codes, q.scale_of(q.moments(vals))[0]), levels)
        codec.write(vals, idx, out, codes, levels, norm)
        payloads.append(out)
        ref_idx = ec.abs().topk(_k(cfg, 2400), dim=-1).indices
        assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
        deq = _quantize(ec.gather(-1, idx).reshape(-1)).view(idx.shape)
        sent.append((idx, deq, deq.norm()))
    got = codec.aggregate(torch.stack(payloads))
    want = reference_aggregate(cfg, sent, 2400)
    # float32 round-off: our statistics are sums in float64 (the reference's float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert codec.k == _k(cfg, 2400) == (38 if options is PAPER else 64)  # 2400·64/4096 = 37.5, rounded to even
