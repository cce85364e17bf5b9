"""torchtitan 0.2.2's ``main`` with our Trainer: what ``python -m titan_commopt.train`` runs once the run is
made (the entry point itself imports nothing of torchtitan: only ``titan/`` does).

The run (``run_context.py``) reaches the builders through the Trainer: torchtitan's
``Trainer.__init__`` looks its TrainSpec up by the model's name and calls the spec's builders right
away, so our Trainer binds the run into the spec as ``__init__`` sets it (``spec.bind_run``).
:func:`run_torchtitan` is torchtitan 0.2.2's ``main`` (``common/main.py``) given the run instead of
parsing ``sys.argv`` a second time.

Under ``[fault_tolerance] enable`` the Trainer is one replica group of a fault-tolerant run
(``common/replica_group_training.py``, which both lines share): its own checkpoint folder
(``<folder>/replica_<id>``) and data shard (``spec.bind_run``), torchft's Manager right after its
process group, each step trained until it commits.
"""

from typing import Any

import torchtitan.train as torchtitan_train
from torchtitan.tools.logging import init_logger, logger

from ..common.main import train
from ..common.replica_group_training import ReplicaGroupSteps, ReplicaGroupTraining
from ..config.section import commopt_of
from .run_context import CommoptRun
from .spec import bind_run

__all__ = ["Trainer", "run_torchtitan"]


class Trainer(ReplicaGroupSteps, torchtitan_train.Trainer):
    """torchtitan's Trainer, building from ``run``."""

    def __init__(self, run: CommoptRun) -> None:
        self.run = run
        self.fault_tolerance = run.fault_tolerance = ReplicaGroupTraining.of(
            run.ft_settings, lambda: commopt_of(run.job_config))
        if self.fault_tolerance is not None:
            checkpoint = run.job_config.checkpoint
            checkpoint.folder = self.fault_tolerance.checkpoint_folder(checkpoint.folder)
        super().__init__(run.job_config)

    @property
    def train_spec(self) -> Any:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: Any) -> None:  # set by torchtitan's __init__, used right after
        self._train_spec = bind_run(spec, self.run)


def run_torchtitan(run: CommoptRun) -> None:
    """torchtitan 0.2.2's ``main`` (logging, training, seed checkpoints, shutdown) for ``run``."""
    init_logger()
    import torchtitan

    logger.info("torchtitan version: %s (0.0.0 means __version__ is not defined correctly).",
                torchtitan.__version__)
    train(lambda: Trainer(run), run.job_config, builds_in_local_tensor_mode=True)
