"""A study diagnostic, loaded by Python at start-up when this folder is on PYTHONPATH; it does nothing
unless ``UPDATE_NORMS_OUT`` is set. Then rank 0 writes one JSON line per step of each optimizer (not
torchtitan's container): ``rms``, the root mean square per coordinate of that step's parameter change
on this rank's shards; ``cos_prev``, the cosine between this step's change and the previous step's;
``n``, the coordinates; ``lr``, the group's learning rate. It reads parameters only (a copy before each
step), so the run trains exactly as without it.

    UPDATE_NORMS_OUT=/tmp/flexdemo.jsonl PYTHONPATH=scripts/update_norms \\
        .venv/bin/python scripts/convergence.py --steps 500 --optimizers FlexDeMo --out /tmp/study
    .venv/bin/python scripts/update_norms.py /tmp/flexdemo.jsonl
"""

import os

if os.environ.get("UPDATE_NORMS_OUT") and os.environ.get("RANK", "0") == "0":
    import json
    import math

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _before: dict = {}
    _previous: dict = {}
    _steps = [0]
    _out = open(os.environ["UPDATE_NORMS_OUT"], "w")

    def _local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    def _inner(optimizer) -> bool:  # torchtitan's container holds the optimizers that step
        return not hasattr(optimizer, "optimizers")

    def _pre(optimizer, args, kwargs):
        if _inner(optimizer):
            _before[id(optimizer)] = [_local(p).detach().clone() for g in optimizer.param_groups for p in g["params"]]

    def _post(optimizer, args, kwargs):
        if not _inner(optimizer) or id(optimizer) not in _before:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        change = torch.cat([(_local(p).detach() - b).flatten().double() for p, b in zip(params, _before.pop(id(optimizer)))])
        previous = _previous.get(id(optimizer))
        norms = change.norm() * (previous.norm() if previous is not None else 0)
        cos = float(change @ previous / norms) if previous is not None and norms > 0 else float("nan")
        _previous[id(optimizer)] = change
        _steps[0] += 1
        _out.write(json.dumps({"step": _steps[0], "rms": float(change.norm() / math.sqrt(max(1, change.numel()))),
                               "cos_prev": cos, "n": change.numel(), "lr": optimizer.param_groups[0]["lr"]}) + "\n")
        _out.flush()

    register_optimizer_step_pre_hook(_pre)
    register_optimizer_step_post_hook(_post)
