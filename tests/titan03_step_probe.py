"""A torchtitan 0.3 ``@override`` that changes nothing and shows every step of a titan_commopt
optimizer on the console: one line (``STEP_LINE``, the optimizer's class, its learning rates) per
``step()``, through torch's global step pre-hook. A test counts the lines to know how many steps ran
(torchtitan's ``init_optim_state`` steps an optimizer whose state is empty once, with lr 0).

    --override.imports tests.titan03_step_probe.show_steps
"""

import sys
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import override

from titan_commopt.optim.base import CommOptimizer

STEP_LINE = "titan_commopt step probe:"


def _print_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if isinstance(optimizer, CommOptimizer):
        # one write of the whole line: four ranks share the console pipe, and a write this short is atomic
        sys.stdout.write(f"{STEP_LINE} {type(optimizer).__name__} lr {[g['lr'] for g in optimizer.param_groups]}\n")
        sys.stdout.flush()


register_optimizer_step_pre_hook(_print_step)  # on import: every rank imports the override's module


@override(target=OptimizersContainer.Config, description="the config unchanged; every optimizer step on the console")
def show_steps(cfg: Any) -> Any:
    return cfg
