"""DeMo's DCT replicator in Triton (``titan_commopt.optim.demo.plan_triton``) against its torch twin
(``compress.dct`` and ``optim.demo.plan``), on the CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set when ``triton.jit`` decorates the kernels (at the import of
``plan_triton.py``, which only the optimizers import, and only where Triton runs): the fixture sets
it first and checks that the kernels it gets are the interpreter's. Where a GPU is present (and the
interpreter is not asked for) the kernel tests run compiled, on the GPU. Tolerances: the transforms
differ from torch's matmuls by fp32 round-off (a few ulps of the chunk's largest coefficient); everything else
(the selection, eq. 8, the replica-order sum, φ = sign) is compared exactly.
"""

import importlib
import os

import pytest
import torch
from torch import nn

from titan_commopt.compress.dct import Chunker, accumulate_chunks_, scatter_chunks, topk_per_chunk
from titan_commopt.optim import make
from titan_commopt.optim import demo
from titan_commopt.optim.demo.plan import descend_shard
from titan_commopt.optim.common import BaseHParams
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

# (local shape, chunk s): the chunker's shapes — square, rectangular, a ≥3-dim tensor, sizes that are
# no power of two, a vector, a prime dim (chunk 1)
SHAPES = [((128, 96), 64), ((64, 2, 8), 32), ((7, 30), 8), ((48,), 32), ((31,), 8), ((12, 10), 4)]


ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def plan_triton(monkeypatch):
    """``optim/demo/plan_triton.py``, with the tensors the test makes on its device (the GPU, or the CPU under
    Triton's interpreter)."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = importlib.import_module("titan_commopt.optim.demo.plan_triton")
    if not ON_GPU:
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(module._encode_kernel, InterpretedFunction), "imported before TRITON_INTERPRET was set"
    torch.set_default_device(DEVICE)
    yield module
    torch.set_default_device(None)


def _rows(ch, G):
    return G * ch.n_chunks


def _torch_encode(ch, xs, k, momentum=None, beta=0.0, lam=0.0):
    """What ``Plan._pack_demo`` computes: (values, indices) and the updated momentum."""
    coeffs = ch.blocks_to_chunk_major(ch.forward([x.float() for x in xs])).reshape(_rows(ch, len(xs)), ch.L)
    if momentum is None:
        return (*topk_per_chunk(coeffs, k), None)
    m = momentum.clone()
    torch.add(coeffs, m, alpha=beta, out=m)
    vals, idx = topk_per_chunk(m, k)
    if lam:
        m.scatter_add_(-1, idx, vals * -lam)
    return vals, idx, m


def _sorted(vals, idx):
    order = idx.argsort(-1)
    return vals.gather(-1, order), idx.gather(-1, order)


@pytest.mark.parametrize("shape,s", SHAPES)
@pytest.mark.parametrize("k,momentum,dtype", [(1, True, torch.float32), (5, True, torch.bfloat16),
                                              (16, False, torch.float32)])
def test_encode_equals_torch(plan_triton, shape, s, k, momentum, dtype):
    torch.manual_seed(0)
    ch, G = Chunker(shape, s, device=DEVICE), 2
    k = min(k, ch.L)
    xs = [torch.randn(shape).to(dtype) for _ in range(G)]
    m0 = torch.randn(_rows(ch, G), ch.L) if momentum else None
    ref_vals, ref_idx, ref_m = _torch_encode(ch, xs, k, m0, beta=0.9, lam=1.0)
    vals = torch.empty(_rows(ch, G), k)
    idx = torch.empty(_rows(ch, G), k, dtype=torch.int64)
    m = m0.clone() if momentum else None
    plan_triton.encode(ch, xs, k, vals, idx, momentum=m, beta=0.9, lam=1.0)
    ref_vals, ref_idx = _sorted(ref_vals, ref_idx)
    vals_s, idx_s = _sorted(vals, idx)
    assert torch.equal(idx_s, ref_idx)  # the same selection
    torch.testing.assert_close(vals_s, ref_vals, atol=2e-6, rtol=1e-5)
    assert torch.equal(vals.abs(), vals.abs().sort(-1, descending=True).values)  # largest first
    if momentum:
        torch.testing.assert_close(m, ref_m, atol=2e-6, rtol=1e-5)
        assert torch.equal(m.gather(-1, idx), torch.zeros_like(vals))  # eq. 8 with λ = 1: exactly zero


def test_encode_ties_take_the_smallest_position_and_keep_the_sum(plan_triton):
    """A zero gradient with β = 1 puts the momentum itself through top-k (the DCT of zeros is zeros):
    a chunk with a tie at the k-th magnitude, and one with fewer non-zeros than k."""
    ch, k = Chunker((4, 4), 4, device=DEVICE), 4
    x = torch.zeros(4, 4)
    chosen = []
    for row in ([3.0, -2, 2, 0, -2, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0.5],
                [0.0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]):
        m0 = torch.tensor([row])
        m = m0.clone()
        vals, idx = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
        plan_triton.encode(ch, [x], k, vals, idx, momentum=m, beta=1.0, lam=1.0)
        ref_vals, ref_idx, ref_m = _torch_encode(ch, [x], k, m0, beta=1.0, lam=1.0)
        # the same magnitudes selected and left, whichever tied position each path took
        assert torch.equal(vals.abs().sort(-1).values, ref_vals.abs().sort(-1).values)
        assert torch.equal(m.abs().sort(-1).values, ref_m.abs().sort(-1).values)
        assert torch.equal(m + scatter_chunks(vals, idx, ch.L), m0)  # what is sent is what eq. 8 took
        chosen.append(idx.tolist())
    assert chosen[0] == [[0, 1, 2, 4]]  # 3, then three of the four 2's: positions 1, 2, 4 (not 8)
    assert chosen[1] == [[3, 11, 0, 1]]  # the two non-zeros, then zeros from position 0


def test_encode_selects_nan_first_as_torch_does(plan_triton):
    ch, k = Chunker((4, 4), 4, device=DEVICE), 3
    m0 = torch.tensor([[1.0, 0, 0, 0, 0, float("nan"), 0, 0, 0, 0, 0, 0, 0, 0, 0, -2]])
    vals, idx = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
    plan_triton.encode(ch, [torch.zeros(4, 4)], k, vals, idx, momentum=m0.clone(), beta=1.0, lam=1.0)
    _, ref_idx, _ = _torch_encode(ch, [torch.zeros(4, 4)], k, m0, beta=1.0, lam=1.0)
    assert idx.tolist() == [[5, 15, 0]] and sorted(ref_idx[0].tolist()) == [0, 5, 15]


def _torch_decode(ch, vals, idx, ps, lr, wd, sign, selected=None):
    """What ``Plan.apply`` computes for one group: the dense mean, the inverse, φ, eq. 7."""
    rows = vals.shape[1]
    dense = accumulate_chunks_(torch.zeros(rows, ch.L), idx, vals)
    if selected is not None:
        dense.div_(accumulate_chunks_(torch.zeros(rows, ch.L), idx, selected).clamp_min_(1))
    Q = ch.inverse(dense)
    if sign:
        Q.sign_()
    blocks = ch.chunk_major_to_blocks(Q.view(len(ps), -1))
    for i, p in enumerate(ps):
        descend_shard(p, blocks[i], lr, wd, blocks=ch)
    return dense


def _received(ch, W, G, k, seed):
    g = torch.Generator().manual_seed(seed)
    rows = _rows(ch, G)
    idx = torch.stack([torch.rand(rows, ch.L, generator=g, device="cpu").argsort(-1)[:, :k] for _ in range(W)])
    # magnitudes far apart, so the sum's order shows in its bits
    vals = torch.randn(W, rows, k, generator=g, device="cpu") * torch.logspace(-3, 3, W, device="cpu").view(W, 1, 1)
    return vals.to(DEVICE), idx.to(DEVICE)


@pytest.mark.parametrize("shape,s", SHAPES)
@pytest.mark.parametrize("W,sign,mean_selected,dtype,wd", [(3, True, False, torch.float32, 0.1),
                                                          (2, False, True, torch.float32, 0.0),
                                                          (1, False, False, torch.bfloat16, 0.1)])
def test_decode_equals_torch(plan_triton, shape, s, W, sign, mean_selected, dtype, wd):
    torch.manual_seed(1)
    ch, G, lr = Chunker(shape, s, device=DEVICE), 2, 0.05
    k = min(4, ch.L)
    vals, idx = _received(ch, W, G, k, seed=2)
    selected = (torch.rand(vals.shape) > 0.3).float() if mean_selected else None
    if not mean_selected:
        vals = vals / W
    ps = [torch.randn(shape).to(dtype) for _ in range(G)]
    ref = [p.clone() for p in ps]
    dense_ref = _torch_decode(ch, vals, idx, ref, lr, wd, sign, selected)
    dense = torch.empty(_rows(ch, G) * ch.L)
    plan_triton.decode(ch, vals, idx, ps, [lr] * G, [wd] * G, sign, selected=selected, dense=dense)
    if not mean_selected:
        assert torch.equal(dense.view_as(dense_ref), dense_ref)  # the replica-order sum, bit for bit
    for p, r in zip(ps, ref):
        if dtype == torch.bfloat16:  # one bf16 ulp where the fp32 round-off crosses a rounding boundary
            torch.testing.assert_close(p, r, atol=1e-2, rtol=1e-2)
        else:
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)


# (local shape, chunk, k): an Elias–Fano rank, a bitmap (k = 48 of 256), l = 0, k = 1, a vector
WIRE_SHAPES = [((64, 32), 32, 16), ((7, 30), 8, 5), ((16, 16), 16, 48), ((12, 10), 4, 1), ((48,), 32, 3)]
# (sign_before_sync, pack, wire, transfer dtype): every way DeMoReplicator writes a selection
WIRE_CODECS = [(True, True, "compact", torch.float32), (False, True, "compact", torch.bfloat16),
               (False, True, "compact", torch.float16), (True, True, "packed", torch.float32),
               (False, True, "packed", torch.bfloat16), (False, False, "packed", torch.float16),
               (True, False, "packed", torch.bfloat16)]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("shape,s,k", WIRE_SHAPES)
@pytest.mark.parametrize("sign,pack,wire,dtype", WIRE_CODECS)
def test_encode_writes_the_bytes_the_codecs_write(plan_triton, shape, s, k, sign, pack, wire, dtype):
    """The encode kernel's wire bytes are the replicator's ``write`` of the same selection, byte for
    byte, for shards at odd byte offsets of one buffer (neighbouring runs share words), with an
    all-zero shard and chunks with fewer than k non-zeros (the compact sign code's marks)."""
    from titan_commopt.compress.packing import ValueCodec
    from titan_commopt.compress.replicators import DeMoReplicator

    torch.manual_seed(0)
    rep = DeMoReplicator(shape, ValueCodec(sign, dtype, pack), s, k, pack, wire=wire, device=DEVICE)
    spec = plan_triton.wire_of(rep, DEVICE)
    assert spec is not None and spec.compact == (wire == "compact")
    ch, G = rep.chunker, 3
    xs = [torch.randn(shape) for _ in range(G)]
    xs[1].zero_()
    xs[2].view(-1)[::3] = 0
    xs[0].view(-1)[:5] = torch.tensor([1e6, -1e-30, 3.0, -3.0, 2.5])  # rounding and subnormals in the wire dtype
    rows = G * ch.n_chunks
    vals, idx = torch.empty(rows, rep.k), torch.empty(rows, rep.k, dtype=torch.int64)
    value_byte = 3
    index_byte = value_byte + G * rep.value_bytes + 1
    total = index_byte + G * rep.index_bytes + 2
    words = torch.zeros(plan_triton.words_for(total), dtype=torch.int32)
    plan_triton.encode(ch, xs, rep.k, vals, idx, wire=spec, words=words, value_byte=value_byte, index_byte=index_byte)
    expected = torch.zeros(total, dtype=torch.uint8)
    rep.write(vals, idx, expected[value_byte: value_byte + G * rep.value_bytes].view(G, -1),
              expected[index_byte: index_byte + G * rep.index_bytes].view(G, -1))
    got = words.view(torch.uint8)[:total]
    assert torch.equal(got, expected), f"bytes differ at {(got != expected).nonzero().flatten()[:8].tolist()}"
    # the raw selection is what encode gives without the wire, and the kernels' top-k (checked above)
    vals2, idx2 = torch.empty_like(vals), torch.empty_like(idx)
    plan_triton.encode(ch, xs, rep.k, vals2, idx2)
    assert torch.equal(vals2, vals) and torch.equal(idx2, idx)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("shape,s,k", WIRE_SHAPES)
@pytest.mark.parametrize("codec", range(len(WIRE_CODECS)))
def test_decode_reads_the_wire_as_the_codecs_do(plan_triton, shape, s, k, codec):
    """Decoding the replicas' wire bytes inside the kernel updates the shards bit for bit as decoding
    them with the codecs (``DeMoReplicator.received``) and handing the kernel the pairs; chunks with
    fewer than k non-zeros (none at all, one, two) exercise the compact sign code's marks.
    Every other codec averages over the replicas that selected (``mean_selected``)."""
    from titan_commopt.compress.packing import ValueCodec
    from titan_commopt.compress.replicators import DeMoReplicator

    (sign, pack, wire, dtype), mean_selected = WIRE_CODECS[codec], codec % 2 == 1
    torch.manual_seed(1)
    rep = DeMoReplicator(shape, ValueCodec(sign, dtype, pack), s, k, pack, wire=wire, device=DEVICE,
                         mean_selected=mean_selected)
    spec = plan_triton.wire_of(rep, DEVICE)
    ch, G, W = rep.chunker, 2, 3
    value_byte = 1
    index_byte = value_byte + G * rep.value_bytes + 3
    total = index_byte + G * rep.index_bytes
    payloads = torch.zeros(W, total, dtype=torch.uint8)
    rows = G * ch.n_chunks
    for w in range(W):  # each replica's selection written by the codecs
        idx = torch.rand(rows, ch.L).argsort(-1)[:, : rep.k].contiguous()
        vals = torch.randn(rows, rep.k)
        for r in range(min(rows - 1, 3)):  # chunks with 0, 1 and 2 non-zeros (the compact sign code's repeats)
            vals[r + w % 2, r:] = 0
        rep.write(vals, idx, payloads[w, value_byte: value_byte + G * rep.value_bytes].view(G, -1),
                  payloads[w, index_byte: index_byte + G * rep.index_bytes].view(G, -1))
    params = [torch.randn(shape) for _ in range(G)]
    lrs, wds = [0.1, 0.05], [0.0, 0.1]
    from_bytes = [p.clone() for p in params]
    dense, count = torch.empty(rows * ch.L), torch.empty(rows * ch.L)
    plan_triton.decode(ch, None, None, from_bytes, lrs, wds, sign=not sign, wire=spec, payloads=payloads,
                   value_byte=value_byte, index_byte=index_byte, mean_selected=rep.mean_selected, dense=dense,
                   count=count)
    values = payloads[:, value_byte: value_byte + G * rep.value_bytes].view(W, G, -1)
    indices = payloads[:, index_byte: index_byte + G * rep.index_bytes].view(W, G, -1)
    vals, idx, selected = rep.received(values, indices)
    # the kernel's sum over replicas is the torch path's, bit for bit (a zero sent as a repeated
    # position adds nothing, however the kernel's lanes meet at that position)
    assert torch.equal(dense.view(rows, ch.L), accumulate_chunks_(torch.zeros(rows, ch.L), idx, vals))
    if mean_selected:
        assert torch.equal(count.view(rows, ch.L), accumulate_chunks_(torch.zeros(rows, ch.L), idx, selected))
    from_pairs = [p.clone() for p in params]
    plan_triton.decode(ch, vals, idx, from_pairs, lrs, wds, sign=not sign, selected=selected)
    for got, expected, before in zip(from_bytes, from_pairs, params):
        assert not torch.equal(expected, before)
        assert torch.equal(got, expected)


def test_wire_left_to_the_codecs_where_the_kernel_cannot_write_it(plan_triton):
    """k above ``wire.MAX_TK`` (or a run too long for the register tile): no wire, the codecs pack."""
    from titan_commopt.compress.packing import ValueCodec
    from titan_commopt.compress.replicators import DeMoReplicator

    assert plan_triton.wire_of(DeMoReplicator((64, 64), ValueCodec(True, torch.float32, True), 64, 128, True),
                           DEVICE) is None
    assert plan_triton.wire_of(DeMoReplicator((8, 8), ValueCodec(False, torch.float32, False), 8, 64, False,
                                          wire="packed"), DEVICE) is None  # 64 int64 indices: 4096 bits a run


def test_triton_on_cpu_without_the_interpreter_is_one_clear_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"\[commopt\] kernels = 'triton'"):
        make("DeMo", model.named_parameters(), Topology(), BaseHParams(lr=0.1), kernels="triton")
    assert make("DeMo", model.named_parameters(), Topology(), BaseHParams(lr=0.1), kernels="auto").fused is None


def test_dct_precision_reaches_the_kernels():
    """``[commopt.demo] dct_precision`` is the kernels' product precision; its allowed values are the
    kernels' own (the interpreter computes in fp32 either way: TF32 is checked only on a GPU)."""
    import typing

    from titan_commopt.optim.demo import plan_triton

    assert typing.get_args(demo.Config.__annotations__["dct_precision"]) == plan_triton.PRECISIONS
    model = nn.Linear(4, 4)
    for precision in plan_triton.PRECISIONS:
        opt = make("DeMo", model.named_parameters(), Topology(), BaseHParams(lr=0.1), kernels="triton",
                   dct_precision=precision)
        assert opt.fused.precision == precision


# ---- end to end: DeMo built with kernels = "triton" vs "torch", two gloo replicas ------------------------
E2E_STEPS = 2
E2E = {  # name -> (preset, options); the variants on FlexDeMo's 32 × 32 chunks (the interpreter is slow)
    "DeMo": ("DeMo", dict(transfer_dtype="fp32")),
    "FlexDeMo": ("FlexDeMo", dict()),
    "identity_mean_selected_packed": ("FlexDeMo", dict(rule="identity", aggregate="mean_selected", wire="packed",
                                                       momentum_subtraction=0.5, sign_before_sync=False)),
    # identity: at step 1 the direction m̂/(√v̂+ε) is ±1 almost everywhere, whose DCT has near-ties and
    # near-zero sums that φ = sign would turn from round-off into ±η
    "adamw_base": ("FlexDeMo", dict(base="adamw", rule="identity", sign_before_sync=False)),
    "muon": ("FlexDeMo", dict(rule="muon")),  # the receiving side on torch
    "random": ("FlexDeMo", dict(replicator="random")),  # no DCT: torch whatever kernels says
}


def _e2e_model():
    torch.manual_seed(0)  # the presets' chunks: (64, 64) and (32, 32), (16, 64) and (16, 32), vectors
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))


def _e2e_worker(rank, world):
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "1"  # before the optimizer imports the kernels
    topo = Topology(replicate=dist.group.WORLD)
    g = torch.Generator().manual_seed(10 + rank)
    data = [(torch.randn(8, 64, generator=g), torch.randn(8, 16, generator=g)) for _ in range(E2E_STEPS)]
    out = {}
    for name, (preset, options) in E2E.items():
        for kernels in ("torch", "triton"):
            model = _e2e_model()
            opt = make(preset, model.named_parameters(), topo, BaseHParams(lr=0.01, weight_decay=0.1),
                       kernels=kernels, **options)
            for x, y in data:
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
            out[name, kernels] = dict(
                params={n: p.detach().clone() for n, p in model.named_parameters()},
                momentum={k: st["momentum"] for k, st in opt.state_dict()["state"].items() if "momentum" in st},
                fused=opt.fused is not None,
                wired=[(grp.wire is not None, grp.rep.k) for grp in opt._plan.groups] if opt.fused is not None else [])
    return out


def _fits_register_ranking(k: int) -> bool:
    import triton

    from titan_commopt.compress.packing_triton import MAX_TK

    return triton.next_power_of_2(k) <= MAX_TK


@pytest.fixture(scope="module")
def e2e():
    return run_distributed(_e2e_worker, 2)


@pytest.mark.parametrize("name", list(E2E))
def test_triton_optimizer_equals_torch(e2e, name):
    for res in e2e:
        torch_run, triton_run = res[name, "torch"], res[name, "triton"]
        assert triton_run["fused"] == (E2E[name][1].get("replicator", "demo") == "demo")
        assert not torch_run["fused"]
        # the kernel writes each group's wire bytes itself, up to MAX_TK kept per chunk (the (k x k) ranking
        # in registers); above it (DeMo's preset keeps 128 of 64 x 64) the codecs pack its selection
        wired, expected = [w for w, _ in triton_run["wired"]], [_fits_register_ranking(k) for _, k in triton_run["wired"]]
        assert wired == expected and (any(wired) or name == "random"), (name, triton_run["wired"])
        for n, p in torch_run["params"].items():
            torch.testing.assert_close(triton_run["params"][n], p, atol=2e-6, rtol=1e-5, msg=f"{name} {n}")
        for key, m in torch_run["momentum"].items():  # a different selection would differ by O(1)
            torch.testing.assert_close(triton_run["momentum"][key], m, atol=2e-6, rtol=1e-5, msg=f"{name} {key}")
    for n, p in e2e[0][name, "triton"]["params"].items():  # replicas stay bit-identical
        assert torch.equal(p, e2e[1][name, "triton"]["params"][n]), f"{name} {n}"
