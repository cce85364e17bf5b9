"""Live fault tolerance in one process (tests/test_fault_tolerance.py, tests/test_transaction.py): a
stand-in for torchft's Manager, a toy model, and a container under fault tolerance whose R is a quorum
of one (every family takes its R path; its collectives send nothing)."""

import torch
from torch import nn

from titan_commopt import comm
from titan_commopt.optim import build_optimizer, resolve
from titan_commopt.topology import Topology
from titan_commopt.titan.common.container import CommOptimizersContainer
from titan_commopt.titan.common.replica_group import ReplicaGroupFT
from titan_commopt.titan.config.fault_tolerance_keys import FtSettings

SETTINGS = FtSettings(enable=True, replica_id=0, group_size=2)


class StandInManager:
    """What ReplicaGroupFT asks of torchft's Manager; ``commits`` scripts should_commit's answers.
    ``_quorum_id`` is torchft's id of the quorum (the same attribute): a test sets it to a new one
    before a step to stand for a quorum that changed (a group lost or joined)."""

    def __init__(self, commits=()):
        self.commits = list(commits)
        self.step = 0
        self.fns = {}
        self._quorum_id = 0

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)

    def start_quorum(self):
        pass

    def should_commit(self):
        ok = self.commits.pop(0) if self.commits else True
        self.step += ok
        return ok

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0

    def errored(self):
        return None

    def current_step(self):
        return self.step

    def batches_committed(self):
        return self.step

    def load_state_dict(self, state):
        self.step = state["step"]


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.w1 = nn.Linear(8, 12, bias=False)
        self.w2 = nn.Linear(12, 8, bias=False)
        self.output = nn.Linear(8, 16, bias=False)


def short_periods(name):
    """The local-step families sync every few steps here (their presets sync every 30-6931)."""
    if resolve(name).family.key == "sparseloco":
        return {"H": 2}
    if resolve(name).family.key != "local":
        return {}
    options = resolve(name).options
    return {"Kx": 2, "Ku": [3 if k else 0 for k in options.Ku], "Kv": 4 if options.Kv else 0}


def blocking(name):
    """:func:`short_periods`, with a preset's streaming sync (DiLoCo's) made blocking: a sync in flight across
    steps is a transaction of its own (tests/test_fault_tolerance_fragments.py)."""
    options = short_periods(name)
    if resolve(name).family.key == "local" and resolve(name).options.sync_delay:
        options.update(fragments=1, sync_delay=0, merge="additive", merge_alpha=0.0)
    return options


def fault_tolerant_container(name, manager, seed=0, options=short_periods):
    """A :class:`Toy` and its container of optimizer ``name`` (``options(name)``: its options) under
    live fault tolerance with ``manager``, a quorum of one."""
    torch.manual_seed(seed)
    model = Toy()
    ft = ReplicaGroupFT(SETTINGS, manager=manager, replicate=None)
    topology = Topology(quorum=ft.quorum)
    ledger = comm.CommLedger()
    resolved = resolve(name, options(name))
    optimizer = build_optimizer(list(model.named_parameters()), topology, resolved, ledger=ledger)
    made = CommOptimizersContainer(
        [model], [optimizer], name=name, resolved=resolved, topology=topology, ledger=ledger, fsdp_traffic=None,
        adamw_reference_r_bytes=0,
    )
    made.attach_fault_tolerance(ft)
    return model, made


def grads(model, step):
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def train_step(model, container, step):
    container.zero_grad()
    for p, g in zip(model.parameters(), grads(model, step)):
        p.grad = g.clone()
    container.step()
    return container.committed
