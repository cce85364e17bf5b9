"""The Muon step of a family's routed matrices, on any mesh; what every family with a Muon step runs
(``[commopt.muon]``, the local engine's ``base = "muon"``, SparseLoCo's ``inner = "muon"``).

Per matrix X (m×n, m rows = fan_out) with gradient G, on the local FSDP2/TP shard:

    M ← μ·M + G              (undamped; lerp: M ← μ·M + (1 − μ)·G)
    U = M                    (Nesterov: G + μ·M; lerp: G.lerp(M, μ))
    O = NS(U)                the whole matrix, on its owner rank (layout.py), in muon_dtype
    X ← X·(1 − η·λ) − η·r(m, n)·O

The momentum and the update are elementwise on the shard (``optim/updates.py``); only U and O cross
the shard groups, in ``muon_dtype`` (bfloat16: what Newton–Schulz reads anyway). Matrices of one
param group whose pieces lie alike form a batch: their U are stacked, exchanged in one collective
per stage, and each owner orthogonalizes its matrices as one stack (batched GEMMs). Each batch is a
task of the optimizer's runtime: a batch computes while the others' pieces are on the wire. The plan
of every batch is made from shapes once (cached per set of members); no host synchronization.
"""

from typing import Any, Optional, Sequence

import torch

from titan_commopt import comm
from titan_commopt.overlap import Runtime, Task
from titan_commopt.topology import Topology

from .. import updates
from ..common import local
from ..orthogonalize import ns_schedule, orthogonalize_stack
from .layout import BatchPlan, Cut, cut_of, gather, plan_batch, scatter
from .options import DTYPES, lr_ratio

__all__ = ["MuonMatrices", "Item"]

Item = tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]  # (param group, parameter, local G, local M)


class MuonMatrices:
    """The Muon step of the parameters in ``param_groups`` whose ``algorithm`` is ``"muon"`` (their
    names from ``param_names``); ``cfg`` carries the ``muon_*`` options (``options.MuonOptions``).
    The groups give ``lr`` and ``weight_decay``."""

    def __init__(self, param_groups: Sequence[dict], topology: Topology, cfg: Any) -> None:
        self.schedule = ns_schedule(cfg.muon_coefficients, cfg.muon_ns_steps)
        self.dtype = DTYPES[cfg.muon_dtype]
        self.eps, self.momentum = cfg.muon_eps, cfg.muon_momentum
        self.lerp, self.nesterov, self.rule = cfg.muon_momentum_form == "lerp", cfg.muon_nesterov, cfg.muon_lr_rule
        self.cuts: dict[torch.Tensor, Cut] = {}
        for group in param_groups:
            if group.get("algorithm") == "muon":
                names = group.get("param_names") or [f"matrix{i}" for i in range(len(group["params"]))]
                for fqn, p in zip(names, group["params"]):
                    self.cuts[p] = cut_of(fqn, p, topology)
        self._plans: dict[tuple, BatchPlan] = {}

    def step(self, items: Sequence[Item], runtime: Runtime, ledger: Optional[comm.CommLedger]) -> None:
        """One Muon step of ``items`` (in parameter order, the same on every rank of their groups)."""
        if not items:
            return
        looks = updates.muon_momentum_multi_([m for *_, m in items], [g for _, _, g, _ in items],
                                             momentum=self.momentum, lerp=self.lerp, nesterov=self.nesterov)
        runtime.run(*self._tasks(items, looks, ledger))

    def _tasks(self, items: Sequence[Item], looks: list[torch.Tensor], ledger) -> list[Task]:
        batches: dict[tuple, list[int]] = {}
        for i, (group, p, _, _) in enumerate(items):
            batches.setdefault((id(group), self.cuts[p].key, p.dtype, local(p).device), []).append(i)
        tasks, base = [], 0
        for key, members in batches.items():
            group, p = items[members[0]][0], items[members[0]][1]
            cut = self.cuts[p]
            plan_key = (key, tuple(id(items[i][1]) for i in members), base)
            if plan_key not in self._plans:
                self._plans[plan_key] = plan_batch(cut, len(members), base, local(p).device)
            tasks.append(self._task(self._plans[plan_key], group, [local(items[i][1]) for i in members],
                                    [looks[i] for i in members], ledger))
            base += len(members) if cut.cut else 0
        return tasks

    def _task(self, plan: BatchPlan, group: dict, xs: list[torch.Tensor], looks: list[torch.Tensor], ledger) -> Task:
        pieces = torch.stack([u.to(self.dtype) for u in looks]).reshape(plan.k, -1)
        whole = yield from gather(plan, pieces, ledger)
        m, n = plan.unit[-2:]
        if whole.numel():
            whole = orthogonalize_stack(whole.reshape(-1, m, n), self.schedule, eps=self.eps).reshape(whole.shape)
        orthogonal = yield from scatter(plan, whole, ledger)
        updates.muon_descend_multi_(xs, list(orthogonal.unbind(0)), lr=group["lr"], ratio=lr_ratio(self.rule, m, n),
                                    weight_decay=group["weight_decay"])
