"""torchrun that checks a titan_commopt config before it starts any worker.

    python -m titan_commopt.run --nproc_per_node=8 [any torchrun option] -m titan_commopt.train --job.config_file my.toml ...

The arguments are exactly torchrun's (``torch.distributed.run``). When the training module is
``titan_commopt.train``, the config is checked here first, with ``WORLD_SIZE`` = ``--nnodes`` ×
``--nproc_per_node`` when ``--nnodes`` is a fixed number: a bad config prints one line per problem
(key or file, value, what is allowed) and exits with status 2 before any worker starts. Otherwise
(or when all is well) it runs torchrun unchanged; if the workers then stop on a pre-flight error
(something only they can see), torchrun's ~40-line failure summary is replaced by that error's
lines, last on the console, and the exit status is 2. The same holds for the lines with which the
workers stop a run on purpose (``titan/platform/stop.py``: a refused resume, status 2; a safeguard that stops
training, status 1). Every other failure is reported by torchrun as usual.
``TITAN_COMMOPT_TRACEBACK=1`` adds the traceback of a pre-flight error.

With ``--max-restarts`` > 0 it also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set), which
torchrun's restarts need (``titan/platform/elastic.py``).

On a multi-node job each node's launcher checks the config on that node (same files as its workers).
"""

import os
import sys
from typing import Optional

__all__ = ["main", "world_size_of"]

from .launch_env import FRESH_STORE, LAUNCHER_ENV

TRAIN_MODULE = "titan_commopt.train"


def world_size_of(args) -> Optional[int]:
    """nnodes × nproc_per_node, or None when torchrun decides it later (an elastic ``MIN:MAX``)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(args.nnodes)
        if low != high:
            return None
        return low * determine_local_world_size(args.nproc_per_node)
    except (ValueError, RuntimeError):
        return None  # torchrun will say what is wrong with its own arguments


def _is_ours(args) -> bool:
    script = args.training_script
    return (args.module and script == TRAIN_MODULE) or (
        not args.module and script.replace(os.sep, "/").endswith("titan_commopt/train.py")
    )


def _pre_flight(args) -> None:
    from titan_commopt.options import ConfigError

    from .titan.platform.console import quiet_known_noise
    from .train import check_config, report_config_error

    quiet_known_noise()
    try:
        check_config(list(args.training_script_args), world_size_of(args))
    except ConfigError as error:
        report_config_error(error, launcher=True)


def recorded_stop(error) -> Optional[tuple[str, int]]:
    """``(lines, status)`` that a failed worker recorded for us (``titan/platform/stop.py``: a pre-flight
    error, a refused resume, a safeguard's stop), the earliest if several did; None otherwise.
    Every failure is looked at: a peer torchrun stopped with SIGTERM may be the "first" one."""
    from .titan.platform.stop import recorded_stop as recorded

    ours = [(f.timestamp, rank, found) for rank, f in error.failures.items() if (found := recorded(f))]
    return min(ours)[2] if ours else None


def _launch(args) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ[LAUNCHER_ENV] = "1"  # the workers leave printing our lines to us
    try:
        run(args)
    except ChildFailedError as error:
        found = recorded_stop(error)
        if found is None:
            raise
        text, status = found
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
        raise SystemExit(status) from None


def fresh_store_per_restart(args) -> bool:
    """With ``--max-restarts`` > 0, give every restart round a fresh rendezvous store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, unless the environment sets it): with the store
    shared across rounds the restarted workers' gloo init waits on the failed attempt's dead peers,
    then fails (``titan/platform/elastic.py``). Returns whether it set it."""
    name, value = FRESH_STORE
    if getattr(args, "max_restarts", 0) > 0 and name not in os.environ:
        os.environ[name] = value
        return True
    return False


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if _is_ours(args):
        _pre_flight(args)
    fresh_store_per_restart(args)
    record(_launch)(args)  # as torchrun's own main: a worker's error file reaches the scheduler


if __name__ == "__main__":
    main()
