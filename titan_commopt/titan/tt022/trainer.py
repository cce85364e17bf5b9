"""torchtitan's ``main`` with our Trainer: what ``python -m titan_commopt.train`` runs once the run is
made (the entry point itself imports nothing of torchtitan: only ``titan/`` does).

The run (``run_context.py``) reaches the builders through the Trainer: torchtitan's
``Trainer.__init__`` looks its TrainSpec up by the model's name and calls the spec's builders right
away, so our Trainer binds the run into the spec as ``__init__`` sets it (``spec.bind_run``).
:func:`run_torchtitan` is torchtitan 0.2.2's ``main`` given the run instead of parsing ``sys.argv``
a second time.
"""

import os
from typing import Any

import torch.distributed as dist
import torchtitan.train as torchtitan_train
from torchtitan.tools.logging import init_logger, logger

from ..common.optimizers import leave_together
from .run_context import CommoptRun
from .spec import bind_run

__all__ = ["Trainer", "run_torchtitan"]


class Trainer(torchtitan_train.Trainer):
    """torchtitan's Trainer, building from ``run``; at the end of training it lands the R syncs
    still in flight and leaves together with every rank."""

    def __init__(self, run: CommoptRun) -> None:
        self.run = run
        super().__init__(run.job_config)

    @property
    def train_spec(self) -> Any:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: Any) -> None:  # set by torchtitan's __init__, used right after
        self._train_spec = bind_run(spec, self.run)

    def train(self) -> None:
        super().train()
        leave_together(self.optimizers)


def run_torchtitan(run: CommoptRun) -> None:
    """torchtitan 0.2.2's ``main`` (logging, training, seed checkpoints, shutdown) for ``run``."""
    init_logger()
    import torchtitan

    logger.info("torchtitan version: %s (0.0.0 means __version__ is not defined correctly).",
                torchtitan.__version__)
    config = run.job_config
    trainer = None
    try:
        trainer = Trainer(run)
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        if config.checkpoint.create_seed_checkpoint:
            assert int(os.environ["WORLD_SIZE"]) == 1, (
                "Must create seed checkpoint using a single device, to disable sharding."
            )
            assert config.checkpoint.enable, "Must enable checkpointing when creating a seed checkpoint."
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        logger.info("Process group destroyed")
