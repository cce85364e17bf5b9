"""compress/: DCT-II chunking, top-k, wire packing, replicators (single process, numeric)."""

import dataclasses
import math

import pytest
import torch

from titan_commopt.compress.dct import (Chunker, accumulate_chunks_, chunk_size, dct_basis, scatter_chunks,
                                        topk_per_chunk)
from titan_commopt.compress.packing import (WIRE_DTYPES, CompactCodec, EliasFano, IndexCodec, ValueCodec, bits_bytes,
                                            ef_low_bits,
                                            from_bytes, pack_bits, pack_ternary, subset_bits, to_bytes,
                                            unpack_bits, unpack_ternary)
from titan_commopt.compress.replicators import KINDS, make_replicator
from titan_commopt.optim.demo import Config


def test_chunk_size_largest_divisor():
    assert [chunk_size(d, 64) for d in (4096, 96, 67, 10, 1, 128 * 3)] == [64, 48, 1, 10, 1, 64]
    assert chunk_size(100, 32) == 25


@pytest.mark.parametrize("n", [1, 2, 7, 32, 64])
def test_dct_basis_orthonormal_and_dct_ii(n):
    b = dct_basis(n, dtype=torch.float64)
    assert torch.allclose(b @ b.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = torch.randn(n, dtype=torch.float64)
    # DCT-II with orthonormal scaling, written out coefficient by coefficient
    for k in range(n):
        scale = math.sqrt((1 if k == 0 else 2) / n)
        ref = scale * sum(x[i].item() * math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n))
        assert abs((b @ x)[k].item() - ref) < 1e-10


@pytest.mark.parametrize("shape", [(96, 40), (64, 64), (8, 6, 5), (50,), (67, 8), (1,), (3, 1)])
def test_chunker_round_trip_and_parseval(shape):
    c = Chunker(shape, 32)
    x = torch.randn(shape)
    coeffs = c.encode(x)
    assert coeffs.shape == (c.n_chunks, c.L) and c.n_chunks * c.L == x.numel()
    assert torch.allclose(c.decode(coeffs), x, atol=1e-5)
    assert torch.allclose(coeffs.norm(), x.norm(), rtol=1e-5)  # orthonormal: energy preserved


def test_chunker_is_separable_2d_per_chunk():
    c = Chunker((64, 48), 32)  # chunks 32 x 24
    x = torch.randn(64, 48, dtype=torch.float32)
    b0, b1 = dct_basis(32), dct_basis(24)
    block = x[32:64, 24:48]  # chunk (1, 1): the 4th in row-major chunk order
    assert torch.allclose(c.encode(x)[3], (b0 @ block @ b1.T).reshape(-1), atol=1e-5)


def test_topk_keeps_k_largest():
    coeffs = torch.randn(5, 100)
    vals, idx = topk_per_chunk(coeffs, 7)
    for row in range(5):
        expect = coeffs[row].abs().sort(descending=True).values[:7]
        assert torch.equal(vals[row].abs().sort(descending=True).values, expect)
        assert torch.equal(coeffs[row, idx[row]], vals[row])
    dense = scatter_chunks(vals, idx, 100)
    assert (dense != 0).sum() == 35 and torch.equal(dense.gather(-1, idx), vals)


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 8, 12, 13, 17])
def test_pack_bits_round_trip(bits):
    n = 1001
    v = torch.randint(0, 2**bits, (n,))
    packed = pack_bits(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bits_bytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, n, bits), v)


def test_ternary_and_float_round_trip():
    t = torch.randint(-1, 2, (333,)).float()
    packed = pack_ternary(t)
    assert packed.numel() == math.ceil(333 / 4)
    assert torch.equal(unpack_ternary(packed, 333), t)
    x = torch.randn(50).to(torch.bfloat16).float()  # bf16-representable: the wire is exact
    assert torch.equal(from_bytes(to_bytes(x, torch.bfloat16), torch.bfloat16).float(), x)
    assert to_bytes(x, torch.bfloat16).numel() == 100


@pytest.mark.parametrize("sign, dtype, pack", [(True, torch.float32, True), (True, torch.bfloat16, False),
                                               (False, torch.bfloat16, True), (False, torch.float16, False)])
def test_value_codec_sizes_and_round_trip(sign, dtype, pack):
    codec = ValueCodec(sign, dtype, pack)
    x = torch.randn(101).to(dtype).float()  # representable in the wire dtype
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(101)
    assert data.numel() == (math.ceil(101 / 4) if sign and pack else 101 * torch.finfo(dtype).bits // 8)
    assert torch.equal(codec.decode(data, 101), x.sign() if sign else x)


@pytest.mark.parametrize("pack", [True, False])
def test_index_codec_sizes_and_round_trip(pack):
    codec = IndexCodec(4096, pack)  # a 64 x 64 chunk: 12-bit indices
    idx = torch.randint(0, 4096, (77,))
    data = codec.encode(idx)
    assert data.numel() == codec.nbytes(77) == (math.ceil(77 * 12 / 8) if pack else 77 * 8)
    assert torch.equal(codec.decode(data, 77), idx)


def _cfg(**kw):
    return dataclasses.replace(Config(chunk=8, topk=5, compression_rate=0.25), **kw)


def _received(rep, cfg, x, q):
    """Dense picture of what one replica contributes to the mean: ``q``, or its sign with
    ``sign_before_sync`` (for DeMo the sign of the kept DCT coefficients, not of ``q``)."""
    if not cfg.sign_before_sync:
        return q
    if cfg.replicator != "demo":
        return q.sign()
    c = rep.chunker
    vals, idx = topk_per_chunk(c.encode(x), rep.k)
    return c.decode(scatter_chunks(vals.sign(), idx, c.L))


CASES = [dict(replicator=k, pack=p, sign_before_sync=s, transfer_dtype=d)
         for k in KINDS for p in (True, False) for s in (True, False) for d in ("fp32", "bf16")]
CASES += [dict(replicator="demo", pack=True, sign_before_sync=s, transfer_dtype=d, wire="packed")
          for s in (True, False) for d in ("fp32", "bf16")]  # the default wire is compact


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_replicator_payload_size_and_self_aggregate(kw):
    cfg = _cfg(**kw)
    shape = (24, 16)
    rep = make_replicator(cfg, shape, "layer.w")
    x = torch.randn(shape)
    for step in range(1, 5):
        q, payload = rep.extract(x, step)
        if not rep.sends(step):
            assert q is None and payload is None and rep.payload_bytes(step) == 0
            continue
        assert payload.dtype == torch.uint8 and payload.numel() == rep.payload_bytes(step)
        # q holds only what is transmitted: its energy is at most x's, and everything when full
        assert q.norm() <= x.norm() * (1 + 1e-5)
        # two identical replicas: the mean is their common transmitted part
        Q = rep.aggregate(torch.stack([payload, payload]), step)
        expect = _received(rep, cfg, x, q)
        atol = 1e-2 if cfg.transfer_dtype == "bf16" and not cfg.sign_before_sync else 1e-5
        assert torch.allclose(Q, expect, atol=atol * max(1.0, expect.abs().max().item()))


def test_demo_replicator_sizes():
    cfg = dataclasses.replace(Config(), wire="packed")  # s = 64, k = 32, bf16, packed
    rep = make_replicator(cfg, (4096, 4096), "w")
    assert rep.index_codec.bits == 12 and rep.n_values == 4096 * 32
    assert rep.payload_bytes(1) == 4096 * 32 * 2 + 4096 * 32 * 12 // 8
    compact = make_replicator(Config(), (4096, 4096), "w")  # the default wire: 284 bits per chunk's 32 indices
    assert Config().wire == "compact" and compact.payload_bytes(1) == 4096 * 32 * 2 + 4096 * 284 // 8
    unpacked = make_replicator(dataclasses.replace(cfg, pack=False, transfer_dtype="fp32"), (4096, 4096), "w")
    assert unpacked.payload_bytes(1) == 4096 * 32 * (4 + 8)


def test_shared_indices_agree_without_being_sent():
    cfg = _cfg(replicator="random")
    a, b = make_replicator(cfg, (40, 10), "blk.w"), make_replicator(cfg, (40, 10), "blk.w")
    other = make_replicator(cfg, (40, 10), "blk.v")
    ia, ib = a.indices(3, "cpu"), b.indices(3, "cpu")
    assert torch.equal(ia, ib) and ia.numel() == 100 and ia.unique().numel() == 100
    assert not torch.equal(ia, a.indices(4, "cpu")) and not torch.equal(ia, other.indices(3, "cpu"))
    s = make_replicator(_cfg(replicator="striding"), (40, 10), "w")  # stride 4
    seen = torch.cat([s.indices(t, "cpu") for t in range(1, 5)])
    assert s.count(1) == 100 and torch.equal(seen.sort().values, torch.arange(400))  # offsets rotate
    assert torch.equal(s.indices(1, "cpu")[:3], torch.tensor([1, 5, 9]))


def test_diloco_sends_every_period():
    rep = make_replicator(_cfg(replicator="diloco"), (8, 8), "w")  # rate 1/4
    assert [rep.sends(t) for t in range(1, 9)] == [False, False, False, True] * 2


@pytest.mark.parametrize("sign", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_two_replicas_aggregate_to_the_mean_of_what_they_selected(kind, sign):
    cfg = _cfg(replicator=kind, sign_before_sync=sign, transfer_dtype="fp32")
    rep = make_replicator(cfg, (24, 16), "layer.w")
    for step in range(1, rep.period + 1):
        xs = [torch.randn(24, 16) for _ in range(2)]
        sent = [rep.extract(x, step) for x in xs]
        if not rep.sends(step):
            assert sent == [(None, None)] * 2 and rep.aggregate(torch.empty(2, 0, dtype=torch.uint8), step) is None
            continue
        Q = rep.aggregate(torch.stack([payload for _, payload in sent]), step)
        expect = sum(_received(rep, cfg, x, q) for x, (q, _) in zip(xs, sent)) / 2
        torch.testing.assert_close(Q, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape, rate", [((100,), 1 / 64), ((7,), 1 / 8), ((10, 13), 1 / 8), ((40, 10), 1 / 4),
                                         ((3,), 1 / 64), ((1,), 1 / 2), ((5, 3), 1.0)])
def test_striding_sends_every_entry_once_per_period(shape, rate):
    """Each entry is sent exactly once in any ``period`` consecutive steps, including the last
    ``numel mod period`` ones and shards smaller than the period; the byte count follows the step."""
    rep = make_replicator(_cfg(replicator="striding", compression_rate=rate), shape, "w")
    assert rep.period == round(1 / rate)
    numel = math.prod(shape)
    for start in (1, 6):
        steps = range(start, start + rep.period)
        seen = torch.cat([rep.indices(t, "cpu") for t in steps])
        assert torch.equal(seen.sort().values, torch.arange(numel))
        x = torch.randn(shape)
        sent_q, produced = torch.zeros(shape), 0
        for t in steps:
            q, payload = rep.extract(x, t)
            if payload is None:
                assert q is None and rep.payload_bytes(t) == 0
                continue
            assert payload.numel() == rep.payload_bytes(t) > 0
            sent_q += q
            produced += payload.numel()
        assert produced == sum(rep.payload_bytes(t) for t in steps)
        assert torch.equal(sent_q, x)  # over one period the replicator transmits all of x


# ---- batched and device-friendly paths -----------------------------------------------------------------
@pytest.mark.parametrize("L, k", [(4096, 32), (1024, 16), (3072, 32), (64, 6), (512, 1)])
def test_topk_pruned_equals_plain_topk(L, k):
    """CPU top-k prunes long chunks by strided block maxima first: the same magnitudes as a plain top-k."""
    g = torch.Generator().manual_seed(L + k)
    coeffs = torch.randn(40, L, generator=g)
    coeffs[3] = 0.0  # an all-tied chunk still gets k distinct indices
    coeffs[5, ::7] *= 100  # a few large entries sharing strided blocks
    vals, idx = topk_per_chunk(coeffs, k)
    expect = coeffs.abs().topk(k, dim=-1).values.sort(-1).values
    assert torch.equal(vals.abs().sort(-1).values, expect)
    assert torch.equal(coeffs.gather(-1, idx), vals)
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()


@pytest.mark.parametrize("bits", [2, 8, 12, 13])
def test_pack_bits_row_by_row(bits):
    """Rows are packed apart, each padded to whole bytes: row r's bytes are pack_bits(row r)."""
    v = torch.randint(0, 2**bits, (3, 5, 37))
    packed = pack_bits(v, bits)
    assert packed.shape == (3, 5, bits_bytes(37, bits))
    for i in range(3):
        for j in range(5):
            assert torch.equal(packed[i, j], pack_bits(v[i, j], bits))
    assert torch.equal(unpack_bits(packed, 37, bits), v)


def test_dct_basis_cache_is_bounded_and_per_dtype():
    from titan_commopt.compress import dct

    assert dct._basis.cache_info().maxsize == dct.BASIS_CACHE_SIZE
    b32, b64 = dct_basis(16), dct_basis(16, dtype=torch.float64)
    assert b32.dtype == torch.float32 and b64.dtype == torch.float64 and dct_basis(16) is b32
    assert torch.equal(b32, b64.float())


@pytest.mark.parametrize("shape", [(96, 40), (64, 64), (8, 6, 5), (50,)])
def test_chunker_batched_forward_inverse(shape):
    """G shards at once (block layout out of forward, chunk-major in and out of inverse) = one by one."""
    c = Chunker(shape, 32)
    xs = [torch.randn(shape) for _ in range(3)]
    coeffs = c.blocks_to_chunk_major(c.forward(xs)).reshape(3 * c.n_chunks, c.L)
    for i, x in enumerate(xs):
        torch.testing.assert_close(coeffs[i * c.n_chunks: (i + 1) * c.n_chunks], c.encode(x))
    back = c.chunk_major_to_blocks(c.inverse(coeffs).view(3, -1))
    for i, x in enumerate(xs):
        torch.testing.assert_close(back[i].reshape(shape), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mean_selected", [False, True])
def test_demo_aggregate_vectorized_over_replicas(mean_selected):
    """Three replicas' bytes decode at once into the mean a replica-by-replica loop gives."""
    cfg = _cfg(aggregate="mean_selected" if mean_selected else "mean", transfer_dtype="fp32")
    rep = make_replicator(cfg, (24, 16), "w")
    xs = [torch.randn(24, 16) for _ in range(3)]
    payloads = torch.stack([rep.extract(x, 1)[1] for x in xs])
    dense, count = torch.zeros(rep.chunker.n_chunks, rep.chunker.L), torch.zeros(rep.chunker.n_chunks, rep.chunker.L)
    for x in xs:
        vals, idx = topk_per_chunk(rep.chunker.encode(x), rep.k)
        dense.scatter_add_(-1, idx, vals)
        count.scatter_add_(-1, idx, torch.ones_like(vals))
    dense = dense / count.clamp_min(1) if mean_selected else dense / 3
    torch.testing.assert_close(rep.aggregate(payloads, 1), rep.chunker.decode(dense))


def test_accumulate_sums_replicas_in_replica_order():
    """Replicas that chose one coefficient are added in replica order, whatever the values: 1e8 + 1 − 1e8
    in float32 is 0 in that order (1 in another), on every row and device."""
    a, b, c = 1e8, 1.0, -1e8
    idx = torch.tensor([[[3, 0]], [[3, 1]], [[3, 2]]])  # (W=3, rows=1, k=2): all pick coefficient 3
    vals = torch.tensor([[[a, 5.0]], [[b, 6.0]], [[c, 7.0]]])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        out = accumulate_chunks_(torch.zeros(1, 4, device=device), idx.to(device), vals.to(device)).cpu()
        expected = torch.tensor([[5.0, 6.0, 7.0, (torch.tensor(a) + b) + c]])
        assert torch.equal(out, expected), (device, out)


def test_random_indices_exact_count_one_per_stratum():
    cfg = _cfg(replicator="random", compression_rate=0.3)
    rep = make_replicator(cfg, (7, 11), "blk.w")  # 77 entries, 23 drawn: strata of 3 or 4
    n, N = rep.n_values, rep.numel
    assert n == 23
    for step in range(1, 30):
        idx = rep.indices(step, "cpu")
        assert idx.dtype == torch.int64 and idx.numel() == n and torch.equal(idx, rep.indices(step, "cpu"))
        strata = torch.arange(n) * N // n
        assert ((idx >= strata) & (idx < torch.arange(1, n + 1) * N // n)).all()  # one in each stratum
    seen = torch.cat([rep.indices(t, "cpu") for t in range(1, 200)]).bincount(minlength=N)
    assert (seen > 0).all()  # every entry gets its turn


# ---- the compact wire ------------------------------------------------------------------------------------
def _index_sets(L, k, rows, g):
    """Random k-subsets of range(L) and adversarial ones: the first k, the last k, 0 and L−1 with a run."""
    idx = torch.rand(rows, L, generator=g).argsort(-1)[:, :k]
    idx[0] = torch.arange(k)
    idx[1] = torch.arange(L - k, L)
    if k >= 2:
        start = 1 + (L - k) // 2  # a run of k − 2 consecutive positions inside (0, L − 1)
        run = torch.arange(start, start + k - 2)
        idx[2] = torch.cat([torch.tensor([L - 1]), run, torch.tensor([0])])  # unsorted on purpose
    return idx


@pytest.mark.parametrize("L, k", [(1024, 16), (4096, 32), (1, 1), (8, 8), (512, 1), (30, 7), (64, 6), (2, 1),
                                  (1024, 64), (64, 64)])  # the last two: too many subsets for a rank, a bitmap
@pytest.mark.parametrize("sign", [True, False])
def test_compact_round_trip(L, k, sign):
    """Every chunk's (value, index) pairs come back exactly; with ``sign``, zeros (an all-zero chunk, a
    chunk with 3 non-zeros) come back as 0 and not as selections; sizes are a function of (L, k, chunks)."""
    g = torch.Generator().manual_seed(L * 31 + k)
    G, chunks = 3, 4
    codec = CompactCodec(L, k, sign, torch.float32)
    idx = _index_sets(L, k, G * chunks, g)
    vals = torch.randn(G * chunks, k, generator=g)
    if sign:
        vals = vals.sign()
    vals[3] = 0.0  # an all-zero chunk (fewer non-zeros than k: top-k then selects zeros)
    vals[4, 3:] = 0.0  # three non-zeros (all of them when k <= 3)
    value_out = torch.empty(G, codec.value_bytes(chunks), dtype=torch.uint8)
    index_out = torch.empty(G, codec.index_bytes(chunks), dtype=torch.uint8)
    codec.encode_into(vals, idx, value_out, index_out)
    ef = EliasFano(L, k)
    high = (math.comb(k + ef.H, k) - 1).bit_length() if ef.ranked else k + ef.H
    assert ef.ranked == (k <= 32)
    assert codec.index_bytes(chunks) == bits_bytes(chunks, ef.bits) == math.ceil(chunks * (k * ef.l + high) / 8)
    assert codec.value_bytes(chunks) == (bits_bytes(chunks, k + (k == 1)) if sign else 4 * chunks * k)
    got_vals, got_idx, sent = codec.decode(value_out.unsqueeze(0), index_out.unsqueeze(0), chunks)
    got_vals, got_idx = got_vals.view(-1, k), got_idx.view(-1, k)
    assert got_idx.min() >= 0 and got_idx.max() < L
    for r in range(G * chunks):
        expect = sorted((i, v) for i, v in zip(idx[r].tolist(), vals[r].tolist()) if v != 0 or not sign)
        if sign:
            keep = sent.view(-1, k)[r]
            got = sorted(zip(got_idx[r][keep].tolist(), got_vals[r][keep].tolist()))
            assert (got_vals[r][~keep] == 0).all()
        else:
            got = sorted(zip(got_idx[r].tolist(), got_vals[r].tolist()))
        assert got == expect, (r, got, expect)


def test_compact_sizes_against_the_subset_bound():
    """Elias–Fano bits per index vs log2 C(L, k) / k (the exact bound) and ceil(log2 L) (the packed wire)."""
    for L, k, ef_bits, bitmap_bits, packed_bits in [(1024, 16, 119, 127, 10), (4096, 32, 284, 287, 12)]:
        ef = EliasFano(L, k)
        assert ef.bits == ef_bits and ef.bits / k < packed_bits
        assert bitmap_bits == k * ef_low_bits(L, k) + k + ((L - 1) >> ef_low_bits(L, k))  # Elias–Fano's own form
        assert subset_bits(L, k) <= ef.bits <= subset_bits(L, k) + k  # within 1 bit per index
    codec = CompactCodec(1024, 16, True, torch.float32)  # FlexDeMo: 16 sign bits + 119 per 32x32 chunk
    assert codec.value_bytes(8) + codec.index_bytes(8) == math.ceil(8 * 16 / 8) + math.ceil(8 * 119 / 8)


CHUNKER_SHAPES = [(96, 40), (64, 64), (8, 6, 5), (50,), (67, 8), (1,), (3, 1), (128, 96)]


@pytest.mark.parametrize("shape", CHUNKER_SHAPES)
@pytest.mark.parametrize("sign, aggregate", [(True, "mean"), (False, "mean"), (False, "mean_selected"),
                                             (True, "mean_selected")])
def test_compact_wire_same_mean_as_packed(shape, sign, aggregate):
    """Three replicas' payloads: the compact wire's aggregate is bit-identical to the packed wire's, on
    every shape the chunker produces (ragged chunks, vectors, chunk 1, k = L), and smaller."""
    kw = dict(chunk=32, topk=16, sign_before_sync=sign, transfer_dtype="fp32", aggregate=aggregate)
    packed = make_replicator(_cfg(**kw, wire="packed"), shape, "w")
    compact = make_replicator(_cfg(**kw, wire="compact"), shape, "w")
    g = torch.Generator().manual_seed(sum(shape))
    xs = [torch.randn(shape, generator=g) for _ in range(3)]
    a = [packed.extract(x, 1) for x in xs]
    b = [compact.extract(x, 1) for x in xs]
    for (qa, pa), (qb, pb) in zip(a, b):
        assert torch.equal(qa, qb) and pb.numel() == compact.payload_bytes(1)
    Qa = packed.aggregate(torch.stack([p for _, p in a]), 1)
    Qb = compact.aggregate(torch.stack([p for _, p in b]), 1)
    assert torch.equal(Qa, Qb)
    assert compact.payload_bytes(1) <= packed.payload_bytes(1)
    if compact.chunker.L >= 32 and not (sign and aggregate == "mean_selected"):
        assert compact.payload_bytes(1) < packed.payload_bytes(1)


def test_compact_zero_chunks_decode_as_zero():
    """Sign before sync, chunks with no and with 3 non-zero coefficients (top-k then selects zeros): the
    compact wire sends those zeros as zeros (not ±1), the same mean as the packed wire, in the
    coefficient domain the optimizer works in (select, write, mean_coefficients)."""
    kw = dict(chunk=8, topk=6, sign_before_sync=True, transfer_dtype="fp32")
    reps = [make_replicator(_cfg(**kw, wire=w), (16, 8), "w") for w in ("packed", "compact")]
    c = reps[0].chunker
    coeffs = torch.zeros(c.n_chunks, c.L)  # chunk 0: all zero; chunk 1: 3 non-zeros
    coeffs[1, [0, 9, 63]] = torch.tensor([2.0, -1.0, 0.5])
    means = []
    for rep in reps:
        vals, idx = rep.select(coeffs)
        value_out = torch.empty(1, rep.value_bytes, dtype=torch.uint8)
        index_out = torch.empty(1, rep.index_bytes, dtype=torch.uint8)
        rep.write(vals, idx, value_out, index_out)
        means.append(rep.mean_coefficients(torch.stack([value_out] * 2), torch.stack([index_out] * 2)))
    expect = torch.zeros(c.n_chunks, c.L)
    expect[1, [0, 9, 63]] = torch.tensor([1.0, -1.0, 1.0])
    assert torch.equal(means[0], expect) and torch.equal(means[1], expect)


def _one_replica_segment(payload: torch.Tensor, before: int = 8) -> torch.Tensor:
    """``payload`` (bytes) as the all-gather of one replica hands it to a decoder: a ``(1, n)`` slice
    of a fused buffer that starts ``before`` bytes in (aligned for every element size) and whose row
    is an odd number of bytes long (a stride no element size divides)."""
    n = payload.numel()
    after = 1 + (before + n) % 2
    fused = torch.randint(0, 256, (1, before + n + after), dtype=torch.uint8)
    fused[0, before: before + n] = payload
    return fused[:, before: before + n]


def test_from_bytes_reinterprets_a_segment_of_any_stride():
    values = torch.randn(5)
    segment = _one_replica_segment(to_bytes(values, torch.float32))
    assert segment.is_contiguous() and segment.stride(0) % 4  # is_contiguous ignores a size-1 dim's stride
    assert torch.equal(from_bytes(segment, torch.float32), values.view(1, 5))
    wide = torch.arange(24, dtype=torch.uint8).view(2, 12)[:, :8]  # two rows 12 bytes apart: viewable in place
    assert from_bytes(wide, torch.float32).data_ptr() == wide.data_ptr()


def _decode_float_values(wire):
    values = torch.randn(1, 45)
    floats = ValueCodec(False, wire, pack=True)
    assert torch.equal(floats.decode(_one_replica_segment(floats.encode(values)), 45), values.to(wire).float())


def _decode_int64_indices(wire):
    idx = torch.randperm(64)[:45].view(1, 45)
    unpacked = IndexCodec(64, pack=False)
    assert torch.equal(unpacked.decode(_one_replica_segment(unpacked.encode(idx)), 45), idx)


def _decode_compact_floats(wire):
    compact = CompactCodec(64, 5, sign=False, wire_dtype=wire)
    sel, pos = torch.randn(9, 5), torch.stack([torch.randperm(64)[:5] for _ in range(9)])
    v_out = torch.empty(1, compact.value_bytes(9), dtype=torch.uint8)
    i_out = torch.empty(1, compact.index_bytes(9), dtype=torch.uint8)
    compact.encode_into(sel, pos, v_out, i_out)
    got_v, got_p, _ = compact.decode(_one_replica_segment(v_out.view(-1)), i_out, 9)
    order = pos.sort(-1)
    assert torch.equal(got_p[0], order.values)
    assert torch.equal(got_v[0], sel.gather(-1, order.indices).to(wire).float())


def _decode_demo_replicator(wire):
    dtype = next(name for name, d in WIRE_DTYPES.items() if d == wire)
    cfg = dataclasses.replace(Config(), chunk=4, topk=3, pack=True, sign_before_sync=False, transfer_dtype=dtype)
    for wire_format in ("packed", "compact"):
        rep = make_replicator(dataclasses.replace(cfg, wire=wire_format), (45,), "v")
        q, payload = rep.extract(torch.randn(45), 1)
        got = rep.aggregate(_one_replica_segment(payload), 1)
        assert torch.equal(got, rep.aggregate(payload.view(1, -1).clone(), 1))
        torch.testing.assert_close(got, q, rtol=0, atol=1e-2 if dtype != "fp32" else 1e-6)


def _decode_quantizer_levels(wire):
    from titan_commopt.compress.quantize import StatisticalQuantizer

    quantizer = StatisticalQuantizer(4, 6.0)
    codes, levels = quantizer.quantize(torch.randn(1, 45))
    out = torch.empty(1, quantizer.nbytes(45), dtype=torch.uint8)
    quantizer.encode_into(codes, levels, out)
    assert torch.equal(quantizer.decode(_one_replica_segment(out.view(-1)), 45), quantizer.dequantize(codes, levels))


DECODE_PATHS = {"float_values": _decode_float_values, "int64_indices": _decode_int64_indices,
                "compact_floats": _decode_compact_floats, "demo_replicator": _decode_demo_replicator,
                "quantizer_levels": _decode_quantizer_levels}


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_every_decode_path_takes_one_replicas_unaligned_segment(path, wire):
    """Each decode path that reinterprets bytes as wider elements (float values, unpacked int64
    indices, the compact wire's floats, the DeMo replicator's aggregate that DeMo and Dion's
    compressed scalars run, the 2-bit quantizer's levels that SparseLoCo reads) on a segment of a
    one-replica fused buffer with an odd row stride."""
    DECODE_PATHS[path](WIRE_DTYPES[wire])


def test_chunker_takes_a_given_grid():
    """``chunks``: a whole tensor's grid on a shard it tiles (64 of 128 rows, chunk 64 of 64 columns)
    instead of the shard's own divisors; a grid that does not tile the shard is refused."""
    c = Chunker((64, 192), 64, chunks=(32, 64))
    assert (c.chunks, c.L, c.n_chunks) == ((32, 64), 2048, 6)
    x = torch.randn(64, 192)
    torch.testing.assert_close(c.decode(c.encode(x)), x, atol=1e-5, rtol=1e-5)
    assert Chunker((64, 192), 64).chunks == (64, 64)
    with pytest.raises(ValueError, match="do not tile"):
        Chunker((48, 64), 64, chunks=(32, 64))
