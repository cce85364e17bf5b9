"""torchtitan 0.3's ``train.main`` for a TOML run: what ``python -m titan_commopt.train
--job.config_file X.toml`` runs when torchtitan 0.3 is installed.

The ``Trainer.Config`` comes from the TOML (``toml_config.py``, made and checked before any process
group), with the CPU fixes of ``configs.py`` (``apply_cpu_fixes``) on a machine without an
accelerator; then 0.3's own ``Trainer`` trains it, as ``torchtitan.train.main`` does. At the end of
training the R syncs still in flight land and every rank leaves together (as the 0.2.2 adapter's
Trainer does, ``adapter/trainer.py``).
"""

import os
from typing import Any

import torch
import torch.distributed as dist

from .toml_config import TomlRun

__all__ = ["run_toml"]


def _leave_together(trainer: Any) -> None:
    """Land the optimizer's R syncs still in flight, then a barrier: a gloo rank has been seen to
    abort in teardown while a peer still trained (see ``adapter/trainer.py``)."""
    flush = getattr(trainer.optimizers, "flush", None)
    if flush is not None:  # our container (torchtitan's own has none)
        flush()
    if dist.is_initialized():
        on_nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_nccl else None)


def run_toml(run: TomlRun) -> None:
    """torchtitan 0.3's ``train.main`` for ``run.trainer_config`` (logging, training, seed
    checkpoints, shutdown)."""
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    from .configs import apply_cpu_fixes

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
            _leave_together(trainer)
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        logger.info("Process group destroyed")
