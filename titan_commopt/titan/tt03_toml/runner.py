"""torchtitan 0.3's ``train.main`` for a TOML run: what ``python -m titan_commopt.train
--job.config_file X.toml`` runs when torchtitan 0.3 is installed.

The ``Trainer.Config`` comes from the TOML (``toml_config.py``, made and checked before any process
group), with the CPU fixes of ``configs.py`` (``apply_cpu_fixes``) on a machine without an
accelerator; then 0.3's own ``Trainer`` trains it, as ``torchtitan.train.main`` does. At the end of
training the R syncs still in flight land and every rank leaves together (as the 0.2.2 adapter's
Trainer does: ``shared/optimizers.leave_together``).
"""

import os

import torch.distributed as dist

from ..config.checkpoint import TOML
from ..common.optimizers import leave_together
from .toml_config import TomlRun

__all__ = ["run_toml"]


def run_toml(run: TomlRun) -> None:
    """torchtitan 0.3's ``train.main`` for ``run.trainer_config`` (logging, training, seed
    checkpoints, shutdown)."""
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    from ..tt03 import container
    from ..tt03.configs import apply_cpu_fixes

    container.settings_spelling = TOML  # a refused resume names the TOML's keys
    init_logger()
    import torchtitan

    logger.info("torchtitan version: %s; titan_commopt TOML run: %s", torchtitan.__version__,
                run.job_config.job.description)
    config = apply_cpu_fixes(run.trainer_config)
    sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                              enable=config.debug.enable_structured_logging)
    trainer = None
    try:
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            assert int(os.environ["WORLD_SIZE"]) == 1, "Must create seed checkpoint using a single device, to disable sharding."
            assert config.checkpoint.enable, "Must enable checkpointing when creating a seed checkpoint."
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
            leave_together(trainer.optimizers)
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        logger.info("Process group destroyed")
