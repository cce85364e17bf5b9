"""torchtitan 0.3's ``train.main`` for a TOML run: what ``python -m titan_commopt.train
--job.config_file X.toml`` runs when torchtitan 0.3 is installed.

The ``Trainer.Config`` comes from the TOML (``toml_config.py``, made and checked before any process
group), with the CPU fixes (``tt03/cpu.py``) on a machine without an accelerator; then 0.3's own
``Trainer`` trains it, as ``torchtitan.train.main`` does (``common/main.py``).
"""

from ..common.main import train
from ..config.checkpoint import TOML
from ..tt03.replica_group_trainer import ReplicaGroupTrainer
from .toml_config import TomlRun

__all__ = ["TomlTrainer", "run_toml"]


class TomlTrainer(ReplicaGroupTrainer):
    """torchtitan 0.3's Trainer for a TOML run: a refused resume names the TOML's keys
    (``tt03/building.py: spelling_of``); ``[fault_tolerance] enable``: one replica group of a
    fault-tolerant run (``tt03/replica_group_trainer.py``)."""

    settings_spelling = TOML


def run_toml(run: TomlRun) -> None:
    """torchtitan 0.3's ``train.main`` for ``run.trainer_config`` (logging, training, seed
    checkpoints, shutdown)."""
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    from ..tt03.configs import apply_cpu_fixes

    init_logger()
    import torchtitan

    logger.info("torchtitan version: %s; titan_commopt TOML run: %s", torchtitan.__version__,
                run.job_config.job.description)
    config = apply_cpu_fixes(run.trainer_config, keep_backend=True)  # the TOML's backend, checked before
    sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                              enable=config.debug.enable_structured_logging)
    train(lambda: TomlTrainer(config), config, builds_in_local_tensor_mode=False)
