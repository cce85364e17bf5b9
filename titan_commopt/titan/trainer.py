"""torchtitan's ``main`` with our Trainer: what ``python -m titan_commopt.train`` runs once the config
is checked (the entry point itself imports nothing of torchtitan: only ``titan/`` does)."""

from typing import Any

__all__ = ["run_torchtitan"]


def run_torchtitan(job_config: Any) -> None:
    """torchtitan's ``main`` (logging, training, seed checkpoints, shutdown), given our job config."""
    import torchtitan.train as torchtitan_train

    from . import config as commopt_config

    class Trainer(torchtitan_train.Trainer):
        """torchtitan's Trainer; remembers its job config for our ``build_optimizers_fn``."""

        def __init__(self, job_config):
            commopt_config.set_current(job_config)
            super().__init__(job_config)

        def train(self) -> None:
            super().train()
            from .container import container_cls

            if isinstance(self.optimizers, container_cls()):  # not a stock TrainSpec's own container
                self.optimizers.flush()  # an overlapped update or a streaming fragment still in flight
            # torchtitan's rank 0 sleeps 2 s here "for other ranks to complete" while the others
            # go on to tear their process groups down; a gloo rank has been seen to abort
            # (SIGABRT) during that teardown (twice in one CI run of ~100 launches, under load). All ranks
            # leave training together instead (only on success: after an error a peer may never
            # arrive). The abort was seen again after this barrier, in the interpreter's teardown:
            # see ``train.exit_after_success``.
            import torch
            import torch.distributed as dist

            if dist.is_initialized():
                # NCCL's barrier wants its device named (else a warning on every rank)
                on_nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
                dist.barrier(device_ids=[torch.cuda.current_device()] if on_nccl else None)

    class ParsedConfig(torchtitan_train.ConfigManager):
        """What ``torchtitan.train.main`` parses: the config already parsed and checked."""

        def parse_args(self, args: Any = None) -> Any:
            self.config = job_config
            return job_config

    torchtitan_train.ConfigManager = ParsedConfig  # main() looks the name up when it runs
    torchtitan_train.main(Trainer)
