"""The registry and the family values: one resolution per run, loud failures for incomplete families,
one shard-shape record for every byte formula."""

import json

import pytest
import torch
from torch import nn

from titan_commopt.optim import (
    FAMILIES, CommOptimizer, Family, ShardShape, available_names, build_optimizer, family_of, resolve,
)
from titan_commopt.optim.common import BaseHParams
from titan_commopt.optim.traffic import adamw_hsdp_r_bytes, fsdp_traffic
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology
from tests.dist_utils import run_distributed


def test_every_name_belongs_to_one_family():
    names = [n for f in FAMILIES.values() for n in f.presets]
    assert len(names) == len(set(names))
    assert set(available_names()) == {"AdamW", "Adam", *names}
    for family in FAMILIES.values():
        assert isinstance(family, Family) and family.section == f"commopt.{family.key}"
        for name in family.presets:
            assert family_of(name) is family


def test_a_family_optimizer_must_say_whether_params_are_replica_local():
    with pytest.raises(TypeError, match="params_replica_local"):
        class Forgetful(CommOptimizer):  # noqa: F841
            pass

    class Careful(CommOptimizer):
        params_replica_local = False

    assert Careful([torch.zeros(1, requires_grad=True)], Topology.single(), None, {"lr": 0.1}).replicas_in_sync()


def test_build_refuses_a_plain_torch_optimizer():
    base = resolve("DeMo")
    family = Family("demo", base.family.options, base.family.presets,
                    build=lambda named, topo, res, ledger=None: torch.optim.SGD([p for _, p in named], lr=0.1),
                    r_bytes=base.family.r_bytes)
    rogue = type(base)(base.name, family, base.options, base.hparams)
    with pytest.raises(TypeError, match="not a CommOptimizer"):
        build_optimizer(list(nn.Linear(2, 2).named_parameters()), Topology.single(), rogue)


def test_resolve_reports_every_problem_once_with_did_you_mean():
    with pytest.raises(ConfigError) as e:
        resolve("DeMo", {"chnk": 32})
    assert "did you mean 'chunk'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve("DeMo", {"chunk": 0, "beta": 1.5})
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and all(line.startswith("[commopt.demo]") for line in lines)
    with pytest.raises(ConfigError, match="allowed is one of"):
        resolve("Adamw")


@pytest.mark.parametrize("name", [n for f in FAMILIES.values() for n in f.presets])
def test_resolved_record_is_plain_data_and_names_the_preset_keys(name):
    resolved = resolve(name, hparams=BaseHParams(lr=1e-3))
    record = json.loads(json.dumps(resolved.record()))
    scale = resolved.family.presets[name].get("lr_scale", 1.0)
    assert record["optimizer"] == name and record["hparams"]["lr"] == pytest.approx(1e-3 * scale)
    assert record["from_preset"] == sorted(resolved.family.presets[name])
    assert all(f"({'preset' if k in record['from_preset'] else 'default'})" in line
               for k, line in zip(record["options"], resolved.describe().splitlines()[1:]))


def test_shard_shape_from_plain_and_fsdp_layouts():
    s = ShardShape.of("w", torch.zeros(6, 4, dtype=torch.float64))
    assert (s.local, s.shape, s.row_split, s.itemsize, s.numel) == ((6, 4), (6, 4), (0, 1), 8, 24)
    assert [ShardShape.fsdp("w", (7, 3), 4, r).local for r in range(4)] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert ShardShape.fsdp("w", (7, 3), 4, 3).row_split == (3, 4)


def test_shared_byte_formulas():
    shards = [ShardShape.fsdp("a", (8, 4), 2), ShardShape.fsdp("b", (5,), 2)]  # 16 + 3 local elements
    assert adamw_hsdp_r_bytes(shards, 2).sent == 19 * 4 and adamw_hsdp_r_bytes(shards, 1).sent == 0
    t = fsdp_traffic(shards, 2, 2, param_bytes=2, reduce_bytes=4, gathers=2, hsdp_r_sync=True)
    assert (t.s_all_gather_sent, t.s_all_gather_recv, t.s_reduce_scatter, t.r_all_reduce) == (76, 76, 76, 76)
    assert t.s_bytes.sent == 152
    assert fsdp_traffic(shards, 1, 2).s_bytes.sent == 0 and fsdp_traffic(shards, 2, 2).r_all_reduce == 0


def _dtensor_shapes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    rows = distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0), Shard(0)])  # rows over fsdp, then tp
    cols = distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0), Shard(1)])
    return [(s.local, s.shape, s.row_split) for s in (ShardShape.of("r", rows), ShardShape.of("c", cols))]


def test_shard_shape_of_dtensors_on_a_2x2_mesh():
    got = run_distributed(_dtensor_shapes, 4)
    # rank = 2·fsdp + tp; rows split over both dims (mixed radix, fsdp first), columns over tp only
    assert [g[0][2] for g in got] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [g[1][2] for g in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [g[1][0] for g in got] == [(5, 2), (5, 2), (4, 2), (4, 2)] and got[0][0][1] == (9, 4)


# ---- the effective learning rate: decided once in resolve() -----------------------------------------
FIRST_OF_EACH = [next(iter(f.presets)) for f in FAMILIES.values()]


def _group_lrs(name, hparams, **options):
    opt = build_optimizer(list(nn.Linear(4, 3).named_parameters()), Topology.single(),
                          resolve(name, options, hparams))
    return sorted({g["lr"] for g in opt.param_groups})


@pytest.mark.parametrize("name", FIRST_OF_EACH)
def test_effective_lr_preset_scale_user_lr_and_user_scale(name, monkeypatch):
    family = family_of(name)
    defaults = family.options()
    assert (defaults.lr, defaults.lr_scale) == (-1.0, 1.0)  # every family has both, unset / neutral
    hp = BaseHParams(lr=0.02)
    assert resolve(name, hparams=hp).hparams.lr == pytest.approx(0.02 * family.presets[name].get("lr_scale", 1.0))
    monkeypatch.setitem(family.presets[name], "lr_scale", 0.25)  # a preset's recommended multiplier
    r = resolve(name, hparams=hp)
    assert r.hparams.lr == 0.02 * 0.25 and r.optimizer_lr == 0.02 and "lr_scale" in r.preset_keys()
    assert _group_lrs(name, hp)[-1] == 0.02 * 0.25  # the builder reads it, scaled once (not 0.02 * 0.25²)
    assert resolve(name, {"lr_scale": 2.0}, hp).hparams.lr == 0.04  # the user's scale beats the preset's
    r = resolve(name, {"lr": 0.003, "lr_scale": 2.0}, hp)  # the family's lr beats any scale
    assert r.hparams.lr == 0.003 and _group_lrs(name, hp, lr=0.003, lr_scale=2.0)[-1] == 0.003
    record = json.loads(json.dumps(resolve(name, hparams=hp).record()))
    assert record["effective_lr"] == record["hparams"]["lr"] == 0.005
    assert record["lr_from"] == "[optimizer] lr 0.02 × lr_scale 0.25"
    assert resolve(name, hparams=hp).describe().splitlines()[-1] == (
        "  effective lr = 0.005 ([optimizer] lr 0.02 × lr_scale 0.25)")
    assert r.describe().splitlines()[-1] == f"  effective lr = 0.003 ([{family.section}] lr)"
    with pytest.raises(ConfigError, match=rf"^\[{family.section}\] lr_scale = 0: allowed is a number > 0$"):
        resolve(name, {"lr_scale": 0})


def test_dion_scalar_groups_are_relative_to_the_effective_lr():
    lrs = _group_lrs("Dion", BaseHParams(lr=0.02), lr_scale=0.5, scalar_lr_scale=0.1)
    assert lrs == [pytest.approx(0.001), 0.01]  # the bias (scalar) at 0.01 × 0.1, the matrix at 0.01


def test_every_paper_preset_names_its_source_and_the_docs_print_it():
    import importlib.util  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    path = Path(__file__).resolve().parents[1] / "scripts" / "options_reference.py"  # docs/options.md's generator
    spec = importlib.util.spec_from_file_location("options_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.render()
    for family in FAMILIES.values():
        for name in family.presets:
            assert family.preset_sources.get(name), name
            assert f"| **{name}** | `[{family.section}]` |" in text and family.preset_sources[name] in text


def test_broadcast_parameters_on_one_replica_leaves_them_as_they_are():
    """Runs outside a process group; the registry's own names are not shadowed by its subpackages
    (``optim.local`` is the local-step families' package, not ``common.local``)."""
    from titan_commopt import optim

    params = [torch.nn.Parameter(torch.arange(3.0))]
    optim.broadcast_parameters(params, Topology.single())
    assert torch.equal(params[0].detach(), torch.arange(3.0))
