"""torchtitan's ``main()`` once the run's config is made, for both lines: build the Trainer, train
(or write a seed checkpoint), land the R syncs still in flight, leave together, close, destroy the
process group. Each line's entry point (``tt022/trainer.py``, ``tt03_toml/runner.py``) does what
precedes it in its torchtitan's ``main`` (the logger, the version line) and hands over the Trainer."""

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

__all__ = ["train", "leave_together"]


def train(make_trainer: Callable[[], Any], config: Any, *, builds_in_local_tensor_mode: bool) -> None:
    """``config``: the run's torchtitan config (0.2.2's ``JobConfig``, 0.3's ``Trainer.Config``: both have
    ``comm.mode`` and ``checkpoint``). In local tensor mode torchtitan trains nothing: 0.2.2 builds
    the Trainer first (``builds_in_local_tensor_mode``), 0.3 does not build it."""
    trainer = None
    try:
        if builds_in_local_tensor_mode:
            trainer = make_trainer()
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        if trainer is None:
            trainer = make_trainer()
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


def leave_together(optimizers: object) -> None:
    """After the last step: land our optimizers' R syncs still in flight (an overlapped update, a
    streaming fragment; torchtitan's own containers have no ``flush``), then a barrier.

    torchtitan's rank 0 sleeps 2 s after training "for other ranks to complete" while the others go
    on to tear their process groups down; a gloo rank has been seen to abort (SIGABRT) during that
    teardown, under load. All ranks leave training together
    instead (only on success: after an error a peer may never arrive). The abort was seen again after
    this barrier, in the interpreter's teardown: see ``train.exit_after_success``."""
    flush = getattr(optimizers, "flush", None)
    if flush is not None:
        flush()
    if dist.is_initialized():
        # NCCL's barrier wants its device named (else a warning on every rank)
        on_nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_nccl else None)
