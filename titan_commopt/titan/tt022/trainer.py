"""torchtitan 0.2.2's ``main`` with our Trainer: what ``python -m titan_commopt.train`` runs once the run is
made (the entry point itself imports nothing of torchtitan: only ``titan/`` does).

The run (``run_context.py``) reaches the builders through the Trainer: torchtitan's
``Trainer.__init__`` looks its TrainSpec up by the model's name and calls the spec's builders right
away, so our Trainer binds the run into the spec as ``__init__`` sets it (``spec.bind_run``).
:func:`run_torchtitan` is torchtitan 0.2.2's ``main`` (``common/main.py``) given the run instead of
parsing ``sys.argv`` a second time.

Under ``[fault_tolerance] enable`` (``common/fault_tolerance.py``) the Trainer starts torchft's Manager
right after its replica group's process group exists (before any optimizer is built on R), gives
each group its own checkpoint folder (``<folder>/replica_<id>``), and trains each step until it commits.
"""

import os
from typing import Any

import torchtitan.train as torchtitan_train
from torchtitan.tools.logging import init_logger, logger

from ..common import fault_tolerance
from ..common.main import train
from ..config.fault_tolerance import FtSettings
from ..config.section import commopt_of
from .run_context import CommoptRun
from .spec import bind_run

__all__ = ["Trainer", "run_torchtitan"]


class Trainer(torchtitan_train.Trainer):
    """torchtitan's Trainer, building from ``run``."""

    def __init__(self, run: CommoptRun) -> None:
        self.run = run
        settings = FtSettings.of(run.job_config.fault_tolerance)
        if settings.enable:
            checkpoint = run.job_config.checkpoint
            checkpoint.folder = os.path.join(checkpoint.folder, f"replica_{settings.replica_id}")
        super().__init__(run.job_config)
        self._ft_training = None
        if run.ft is not None:
            if run.resolved is None:
                fault_tolerance.average_gradients_over_quorum(self.model_parts, run.ft)
            self._ft_training = fault_tolerance.FaultTolerantTraining(self, run.ft)

    def init_distributed(self) -> Any:
        parallel_dims = super().init_distributed()
        settings = FtSettings.of(self.run.job_config.fault_tolerance)
        if settings.enable:
            self.run.ft = fault_tolerance.start(settings, commopt_of(self.run.job_config))
        return parallel_dims

    def train_step(self, data_iterator: Any) -> None:
        if self._ft_training is None:
            super().train_step(data_iterator)
        else:
            self._ft_training.train_step(data_iterator, super().train_step)

    def close(self) -> None:
        if self._ft_training is not None:
            self._ft_training.finish()
        super().close()
        if self.run.ft is not None:
            self.run.ft.shutdown()

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
