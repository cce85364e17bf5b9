"""Muon on any mesh (``optim/muon/``) and the families that run it: Muon, MuLoCo, MuLoCo-2bit.

One process: one setting of ``[commopt.muon]`` is ``torch.optim.Muon`` (with torch's fused AdamW on the
parameters routed around it) bit for bit; a stack of matrices orthogonalizes each as alone; bad options
are one line; the exchange's byte formula on a case counted by hand; MuLoCo-2bit's wire.

One gloo spawn of 6 processes: Muon on HSDP 2 × 3 (uneven rows), HSDP 3 × 2, TP 2 (three replicas) and
FSDP 3 × TP 2 equals the unsharded Muon on the replicas' mean gradient (the matrices bit for bit, the
AdamW parameters to round-off), and its ledger equals the byte formulas (R, S, T) on every rank;
MuLoCo and MuLoCo-2bit on HSDP 2 × 3 equal their unsharded runs on the same two replicas, their S bytes
the formulas'.
"""


import pytest
import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import BaseHParams, ShardShape, build_optimizer, make, resolve
from titan_commopt.optim.common import local
from titan_commopt.optim.local.adaptive import local_s_bytes, moment_key
from titan_commopt.optim.local.sparseloco import sparseloco_r_bytes, sparseloco_s_bytes
from titan_commopt.optim.muon import muon_r_bytes, muon_s_bytes
from titan_commopt.optim.muon.layout import exchange_bytes
from titan_commopt.optim.orthogonalize import newton_schulz_flops, ns_schedule, orthogonalize_stack
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed

HP = BaseHParams(lr=0.02, weight_decay=0.1)
# torch.optim.Muon's algorithm (and its defaults μ = 0.95, Nesterov), torch's AdamW β for the rest
TORCH = dict(muon_momentum_form="lerp", muon_nesterov=True, muon_coefficients="keller", muon_lr_rule="original",
             muon_momentum=0.95, scalar_beta1=0.9, scalar_beta2=0.95)


def _mlp():
    torch.manual_seed(0)
    # three 32×32 matrices (one batch), a wide and a tall one, biases for AdamW
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Linear(32, 8))


def _train_against_torch(options, adjust_lr_fn):
    ours, theirs = _mlp(), _mlp()
    opt = make("Muon", ours.named_parameters(), hparams=HP, **options)
    matrices = [p for p in theirs.parameters() if p.ndim == 2]
    torch_muon = torch.optim.Muon(matrices, lr=HP.lr, weight_decay=HP.weight_decay, momentum=0.95, nesterov=True,
                                  adjust_lr_fn=adjust_lr_fn)
    torch_adamw = torch.optim.AdamW([p for p in theirs.parameters() if p.ndim != 2], lr=HP.lr, betas=(0.9, 0.95),
                                    eps=HP.eps, weight_decay=HP.weight_decay, fused=True)
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for model in (ours, theirs):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        opt.step()
        torch_muon.step()
        torch_adamw.step()
    return [torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters())]


@pytest.mark.parametrize("rule,adjust_lr_fn", [("original", None), ("match_rms_adamw", "match_rms_adamw")])
def test_one_setting_is_torch_muon_bit_for_bit(rule, adjust_lr_fn):
    assert all(_train_against_torch({**TORCH, "muon_lr_rule": rule}, adjust_lr_fn))
    # the comparison can fail: MuLoCo's undamped momentum, or MuLoCo's triples, is another optimizer
    for other in ({"muon_momentum_form": "undamped"}, {"muon_coefficients": "muloco"}):
        equal = _train_against_torch({**TORCH, "muon_lr_rule": rule, **other}, adjust_lr_fn)
        assert not any(e for e, p in zip(equal, _mlp().parameters()) if p.ndim == 2)


@pytest.mark.parametrize("shape", [(6, 24, 16), (5, 16, 24)])
def test_a_stack_orthogonalizes_each_matrix_as_alone(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    for name in ("keller", "muloco"):
        schedule = ns_schedule(name, 5)
        stacked = orthogonalize_stack(g, schedule)
        assert all(torch.equal(stacked[i], orthogonalize_stack(g[i], schedule)) for i in range(shape[0]))
        singular = torch.linalg.svdvals(stacked.float())
        assert 0.5 < singular.min() and singular.max() < 1.3  # pushed towards 1, not onto it


def test_the_newton_schulz_flops_by_hand_and_as_torch_counts_them():
    # m = 2, n = 3: X Xᵀ 2·2²·3 = 24, A² 2·2³ = 16, B X 24: 64 per iteration, the same for the tall 3 × 2
    assert newton_schulz_flops(2, 3, 1) == newton_schulz_flops(3, 2, 1) == 64
    assert newton_schulz_flops(4, 4, 5) == 5 * (4 * 16 * 4 + 2 * 64) == 1920
    from torch.utils.flop_counter import FlopCounterMode

    schedule = ns_schedule("muloco", 5)
    for shape in [(6, 10), (10, 6), (3, 6, 10)]:
        with FlopCounterMode(display=False) as counter:
            orthogonalize_stack(torch.randn(shape), schedule)
        stack = shape[0] if len(shape) == 3 else 1
        assert counter.get_total_flops() == stack * newton_schulz_flops(*shape[-2:], len(schedule)), shape


def test_a_3d_stack_steps_as_its_matrices_would_alone():
    """A [4, 24, 16] parameter (experts) is routed to Muon and each slice orthogonalized alone: the same
    update as four 24×16 parameters, bit for bit (and the lr factor is a slice's)."""
    g = torch.Generator().manual_seed(3)
    stack = nn.Parameter(torch.randn(4, 24, 16, generator=g))
    alone = [nn.Parameter(stack.detach()[i].clone()) for i in range(4)]
    grads = [torch.randn(4, 24, 16, generator=g) for _ in range(3)]
    ours = make("Muon", [("experts.w", stack)], hparams=HP)
    theirs = make("Muon", [(f"expert{i}.w", p) for i, p in enumerate(alone)], hparams=HP)
    assert [group["algorithm"] for group in ours.param_groups] == ["muon"]
    for grad in grads:
        stack.grad = grad.clone()
        for i, p in enumerate(alone):
            p.grad = grad[i].clone()
        ours.step()
        theirs.step()
    assert all(torch.equal(stack.detach()[i], p.detach()) for i, p in enumerate(alone))


@pytest.mark.parametrize("name,given,expected", [
    ("Muon", {"muon_ns_steps": 7}, "[commopt.muon] muon_ns_steps = 7: allowed is 5 with muon_coefficients"),
    ("Muon", {"muon_dtype": "fp16"}, "[commopt.muon] muon_dtype = 'fp16'"),
    ("Muon", {"scalar_beta2": 1.0}, "[commopt.muon] scalar_beta2 = 1.0"),
    ("MuLoCo", {"Ku": [4, 8], "omega": [0.5, 0.5], "beta1": [0.9, 0.9]}, "allowed with base = \"muon\" is one momentum"),
    ("MuLoCo", {"switch_at": 5}, "[commopt.local] switch_at = 5: allowed with base = \"muon\" is 0"),
    ("MuLoCo-2bit", {"muon_ns_steps": 3}, "[commopt.sparseloco] muon_ns_steps = 3"),
    ("MuLoCo-2bit", {"outer_momentum": 1.0}, "[commopt.sparseloco] outer_momentum = 1.0"),
    ("MuLoCo-2bit", {"inner": "lion"}, "[commopt.sparseloco] inner = 'lion'"),
])
def test_a_bad_option_is_one_line_naming_it(name, given, expected):
    with pytest.raises(ConfigError) as info:
        resolve(name, given)
    assert len(str(info.value).splitlines()) == 1 and expected in str(info.value), str(info.value)


def test_the_exchange_formula_on_a_case_counted_by_hand():
    """Three 10×4 matrices over S = 3 (rows 4, 4, 2: 16, 16, 8 elements), bf16: item j is owned by rank
    j. Rank 0 owns item 0 (receives 16 + 8, sends them back) and sends its 16 of items 1 and 2."""
    cfg = resolve("Muon").options
    for rank, expected in ((0, 24 + 16 + 16), (1, 16 + 24 + 16), (2, 8 + 8 + 32)):
        shards = [ShardShape.fsdp(f"w{i}.weight", (10, 4), 3, rank) for i in range(3)]
        assert muon_s_bytes(shards, resolve("Muon")) == exchange_bytes(shards, lambda s: True, 2)["S"]
        assert exchange_bytes(shards, lambda s: True, 2)["S"].sent == 2 * expected
    assert muon_s_bytes([ShardShape.fsdp("w.weight", (10, 4), 1)], resolve("Muon")).sent == 0
    assert cfg.muon_dtype == "bf16"


def test_muloco_2bit_sends_every_value_in_two_bits():
    """A 64×64 tensor: 4096 codes of 2 bits and 4 float32 levels per sync, no indices; sent every H."""
    resolved = resolve("MuLoCo-2bit")
    shards = [ShardShape.fsdp("w.weight", (64, 64), 1)]
    assert sparseloco_r_bytes(shards, resolved, 2).sent == (4096 * 2 // 8 + 4 * 4) / resolved.options.H


@pytest.mark.parametrize("name,options", [("Muon", {}), ("MuLoCo", {"Kx": 2}), ("MuLoCo-2bit", {"H": 2})])
def test_a_checkpoint_loaded_into_a_fresh_optimizer_resumes_exactly(name, options):
    """Three steps, a state dict (as a checkpoint keeps it), a fresh (eager) optimizer loads it: the next
    steps equal the uninterrupted optimizer's, parameters and state, bit for bit."""
    import copy

    def build():
        model = _mlp()
        return model, make(name, model.named_parameters(), hparams=HP, **options)

    def train(model, opt, steps):
        for step in steps:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            model.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    twin, fresh = build()
    twin.load_state_dict(model.state_dict())
    fresh.load_state_dict(saved)
    train(model, opt, range(3, 6))
    train(twin, fresh, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    a, b = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


# ---- on six gloo processes -------------------------------------------------------------------------------
D, H, V = 12, 24, 16


class Block(nn.Module):
    """Attention and FFN projections of a llama block (torchtitan's TP plan applies), an FSDP-only
    matrix of 10 rows (uneven over 3), embedding, norm and head (routed to AdamW). No forward: the
    gradients are given."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.norm = nn.RMSNorm(D)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, nn.Linear(D, D, bias=False))
        self.w1, self.w3, self.w2 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)
        self.extra = nn.Linear(D, 10, bias=False)
        self.output = nn.Linear(D, V, bias=False)


def _block():
    torch.manual_seed(0)
    return Block()


def _grads(replica, step):
    """Multiples of 1/16 below 4 in magnitude: sums over replicas are exact, so is their mean's rounding."""
    gen = torch.Generator().manual_seed(100 * replica + step)
    return [torch.randint(-64, 64, p.shape, generator=gen).float() / 16 for p in _block().parameters()]


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = mesh.mesh_dim_names
    if "tp" in names:
        parallelize_module(model, mesh["tp"], {**{n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")},
                                               **{n: RowwiseParallel() for n in ("wo", "w2")}})
    if "fsdp" in names:
        fully_shard(model, mesh=mesh["fsdp"])
    return model


def _set_grads(model, grads):
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(model.parameters(), grads):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _compare(model, reference):
    """(every matrix bit for bit, the largest difference of the AdamW parameters)."""
    exact, worst = True, 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name.split(".")[0] in ("tok_embeddings", "norm", "output"):
            worst = max(worst, (_full(p) - q).abs().max().item())
        else:
            exact = exact and torch.equal(_full(p), q.detach())
    return exact, worst


def _ledger_vs_formulas(ledger, steps, shards, resolved, replicas, s_formula, r_formula):
    totals = ledger.totals
    return {
        "R": (totals.get("R_sent", 0.0) / steps, r_formula(shards, resolved, replicas).sent),
        "S": (totals.get("S_sent", 0.0) / steps, s_formula(shards, resolved, "S").sent),
        "T": (totals.get("T_sent", 0.0) / steps, s_formula(shards, resolved, "T").sent),
        "S_recv": (totals.get("S_recv", 0.0) / steps, s_formula(shards, resolved, "S").recv),
    }


def _muon_on(mesh, replica, replicas):
    """Muon sharded on ``mesh`` against the unsharded Muon on the mean of the replicas' gradients."""
    topology = Topology.from_mesh(mesh)
    model, reference = _shard(_block(), mesh), _block()
    resolved = resolve("Muon", {}, HP)
    ledger = comm.CommLedger()
    opt = build_optimizer(list(model.named_parameters()), topology, resolved, ledger=ledger)
    ref = build_optimizer(list(reference.named_parameters()), Topology.single(), resolved, ledger=comm.CommLedger())
    steps = 3
    for step in range(steps):
        _set_grads(model, _grads(replica, step))
        every = [_grads(r, step) for r in range(replicas)]
        for q, *gs in zip(reference.parameters(), *every):
            q.grad = torch.stack(gs).sum(0) / replicas
        opt.step()
        ref.step()
        ledger.end_step()
    shards = [ShardShape.of(n, p) for n, p in model.named_parameters()]
    return {"compare": _compare(model, reference),
            "bytes": _ledger_vs_formulas(ledger, steps, shards, resolved, replicas, muon_s_bytes, muon_r_bytes)}


def _local_family_on(mesh, replica, name, options):
    """MuLoCo / MuLoCo-2bit on HSDP against their unsharded runs on the same replicas (R groups); for the
    local engine, also each step's Muon momenta M (this rank's shards), to compare across replicas."""
    topology = Topology.from_mesh(mesh)
    model, reference = _shard(_block(), mesh), _block()
    resolved = resolve(name, options, HP)
    ledger = comm.CommLedger()
    opt = build_optimizer(list(model.named_parameters()), topology, resolved, ledger=ledger)
    unsharded = Topology(replicate=mesh.get_group("dp_replicate"))
    ref = build_optimizer(list(reference.named_parameters()), unsharded, resolved, ledger=comm.CommLedger())
    steps, momenta = 4, []
    matrices = [p for group in opt.param_groups if group["algorithm"] == "muon" for p in group["params"]]
    for step in range(steps):
        grads = _grads(replica, step)
        _set_grads(model, grads)
        for q, g in zip(reference.parameters(), grads):
            q.grad = g.clone()
        opt.step()
        ref.step()
        ledger.end_step()
        if resolved.family.key == "local":
            momenta.append([local(opt.state[p][moment_key(0)]).clone() for p in matrices])
    shards = [ShardShape.of(n, p) for n, p in model.named_parameters()]
    formula = local_s_bytes if resolved.family.key == "local" else sparseloco_s_bytes
    r_formula = resolved.family.r_bytes
    return {"compare": _compare(model, reference), "momenta": momenta,
            "bytes": _ledger_vs_formulas(ledger, steps, shards, resolved, 2, formula, r_formula)}


def _six(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for label, shape, names in [("hsdp 2x3", (2, 3), ("dp_replicate", "fsdp")),
                                ("hsdp 3x2", (3, 2), ("dp_replicate", "fsdp")),
                                ("tp 2, 3 replicas", (3, 2), ("dp_replicate", "tp")),
                                ("fsdp 3 x tp 2", (1, 3, 2), ("dp_replicate", "fsdp", "tp"))]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        replica = mesh.get_local_rank("dp_replicate")
        out[label] = _muon_on(mesh, replica, shape[0])
        if label == "hsdp 2x3":
            out["MuLoCo"] = _local_family_on(mesh, replica, "MuLoCo", {"Kx": 2})
            out["MuLoCo-2bit"] = _local_family_on(mesh, replica, "MuLoCo-2bit", {"H": 2})
            # DES-LOC's schedule with a Muon base: M averaged over R every Ku = 2 steps, x and Adam's v every 4
            out["MuLoCo Ku"] = _local_family_on(mesh, replica, "MuLoCo", {"Kx": 4, "Ku": [2], "Kv": 4})
    return out


@pytest.fixture(scope="module")
def six():
    return run_distributed(_six, 6)


@pytest.mark.parametrize("case", ["hsdp 2x3", "hsdp 3x2", "tp 2, 3 replicas", "fsdp 3 x tp 2", "MuLoCo", "MuLoCo-2bit",
                                  "MuLoCo Ku"])
def test_sharded_equals_unsharded_and_the_ledger_the_formulas(six, case):
    for rank, result in enumerate(six):
        exact, worst = result[case]["compare"]
        # the matrices bit for bit (MuLoCo-2bit's quantizer sums its statistics in another order: to round-off)
        assert exact or (case == "MuLoCo-2bit" and worst < 1e-5), (rank, case)
        assert worst < 1e-5, (rank, case, worst)  # fused AdamW's vector and scalar tails round apart
        for role, (measured, formula) in result[case]["bytes"].items():
            assert measured == pytest.approx(formula, rel=1e-12), (rank, case, role)
    moved = [result[case]["bytes"][role][0] for result in six for role in ("S", "T")]
    assert sum(moved) > 0  # every case exchanges pieces within the replicas


def test_the_muon_momentum_is_averaged_over_r_on_its_ku_period(six):
    """base = "muon" with Ku = [2]: after steps 2 and 4 the two replicas hold the same M (bit for bit, on
    every shard), after steps 1 and 3 their own (they step on different gradients)."""
    for shard in range(3):  # ranks shard and shard + 3: the same FSDP piece on replicas 0 and 1
        mine, theirs = six[shard]["MuLoCo Ku"]["momenta"], six[shard + 3]["MuLoCo Ku"]["momenta"]
        agree = [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(mine, theirs)]
        assert agree == [False, True, False, True], (shard, agree)
