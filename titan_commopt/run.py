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
``TITAN_COMMOPT_TRACEBACK=1`` adds the traceback of a pre-flight error. A config that is valid but
probably not meant (a ``[commopt.<family>]`` table the optimizer does not read, MT-DAO's switch in a
short run) gets one warning line each, printed here once, before any worker starts.

With ``--max-restarts`` > 0 it also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set), which
torchrun's restarts need (``titan/platform/elastic.py``).

The console shows one copy of the log: unless the command line says what the console shows (any of
torchrun's ``--local-ranks-filter``, ``--tee``, ``--redirects``, in either spelling, or their
``PET_*`` variables), the launcher adds ``--local-ranks-filter 0 --tee 3``: local rank 0's lines on
the console, each prefixed with its global rank (``[rank0]:``; ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
if set), and every rank's stdout and stderr in files under
torchrun's log directory (``--log-dir``, else a new ``/tmp/torchelastic_*``). A worker of another
local rank that fails is named on the console with its stderr file and, when torchrun's summary has
no traceback of it, the last lines of that file. To see every rank's lines, pass torchrun's own
``--tee 3`` (each line prefixed ``[rank<N>]:``), or ``--local-ranks-filter 0,1 --tee 3`` for some.

On a multi-node job each node's launcher checks the config on that node (same files as its workers),
and each node's console shows its own local rank 0.
"""

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["main", "world_size_of", "console_of_rank_zero", "hidden_failures", "RankLogs"]

from .launch_env import FRESH_STORE, LAUNCHER_ENV

TRAIN_MODULE = "titan_commopt.train"
TORCHTITAN_TRAIN_MODULE = "torchtitan.train"  # 0.3's own entry point (--module, --config)

# torchrun's options that decide what its console shows, with their defaults: a value other than
# the default was set by the command line or by torchrun's PET_* variable of that option.
# (--log-dir is not one of them: it only says where torchrun's files go.)
CONSOLE_OPTION_DEFAULTS = {"local_ranks_filter": "", "tee": "0", "redirects": "0"}
RANK_PREFIX = ("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")  # torchrun's header of a tee'd line
STDERR_LINES_SHOWN = 30  # of a failed worker whose stderr was off the console


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
    from .train import check_config, report_config_error, report_warnings

    quiet_known_noise()
    try:
        run = check_config(list(args.training_script_args), world_size_of(args))
    except ConfigError as error:
        report_config_error(error, launcher=True)
    report_warnings(run, launcher=True)


def _pre_flight_torchtitan(args) -> None:
    """0.3's own entry point with one of torchtitan's config modules on a machine without an
    accelerator: one line before any worker (the workers would stop in torchtitan's CUDA call before
    any code of ours runs)."""
    from titan_commopt.options import ConfigError

    from .titan.platform.cpu import stock_module_problem
    from .train import report_config_error

    problem = stock_module_problem(list(args.training_script_args))
    if problem is not None:
        report_config_error(ConfigError(problem), launcher=True)


def recorded_stop(error) -> Optional[tuple[str, int]]:
    """``(lines, status)`` that a failed worker recorded for us (``titan/platform/stop.py``: a pre-flight
    error, a refused resume, a safeguard's stop), the earliest if several did; None otherwise.
    Every failure is looked at: a peer torchrun stopped with SIGTERM may be the "first" one."""
    from .titan.platform.stop import recorded_stop as recorded

    ours = [(f.timestamp, rank, found) for rank, f in error.failures.items() if (found := recorded(f))]
    return min(ours)[2] if ours else None


def console_of_rank_zero(args) -> Optional["RankLogs"]:
    """Show local rank 0's output alone on the console (``--local-ranks-filter 0 --tee 3``), unless
    the user chose what the console shows (:data:`CONSOLE_OPTION_DEFAULTS`). Returns where every
    rank's files then are, or None. Either way a line torchrun copies to the console is prefixed
    with its global rank (``[rank8]:``; torchrun's own ``[default0]:`` is the local rank)."""
    prefix_variable, template = RANK_PREFIX
    os.environ.setdefault(prefix_variable, template)
    if any(getattr(args, name) != default for name, default in CONSOLE_OPTION_DEFAULTS.items()):
        return None
    # --tee, not --redirects: rank 0's lines still reach the console; the others' only their files
    args.local_ranks_filter, args.tee = "0", "3"
    if args.log_dir is None:  # torchrun would make the same; made here to know where it is
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    return RankLogs(Path(args.log_dir))


class RankLogs:
    """The workers' files of this launch under torchrun's ``--log-dir`` (which runs may share):
    ``<log dir>/<run id>_<random>/attempt_<restart>/<local rank>/stderr.log``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._before = set(os.listdir(root)) if root.is_dir() else set()  # other launches' runs

    def stderr_of(self, local_rank: int) -> Optional[Path]:
        """The worker's stderr file of the latest attempt (restart) of this launch, if any."""
        found = [path for run in self.root.glob("*") if run.name not in self._before
                 for path in run.glob(f"attempt_*/{local_rank}/stderr.log")]
        return max(found, key=lambda path: int(path.parent.parent.name.split("_")[1]), default=None)


def hidden_failures(error, logs: RankLogs) -> str:
    """For each failed worker but local rank 0 (whose lines are on the console): its rank, its stderr
    file and, unless torchrun's summary shows the worker's traceback (from its error file), the last
    :data:`STDERR_LINES_SHOWN` lines of that file. Empty if there is none."""
    out = []
    for rank, failure in sorted(error.failures.items()):
        log = logs.stderr_of(failure.local_rank) if failure.local_rank != 0 else None
        if log is None:
            continue
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.signal_name()
        head = f"titan_commopt: rank {rank} failed ({how}); its stderr, not on the console: {log}"
        if isinstance(failure.message, dict):  # its error file: torchrun's summary shows the traceback
            out.append(head)
        else:
            tail = log.read_text(errors="replace").splitlines()[-STDERR_LINES_SHOWN:]
            out.append("\n".join([head + f" (last {len(tail)} lines):", *tail]))
    return "\n".join(out)


def _launch(args, logs: Optional[RankLogs] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers leave printing our lines to us, and know their launcher
    try:
        run(args)
    except ChildFailedError as error:
        found = recorded_stop(error)
        if found is None:
            hidden = hidden_failures(error, logs) if logs else ""
            if hidden:  # before torchrun's summary, which the exception prints
                sys.stdout.flush()
                print(hidden, file=sys.stderr, flush=True)
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
    elif args.module and args.training_script == TORCHTITAN_TRAIN_MODULE:
        _pre_flight_torchtitan(args)
    fresh_store_per_restart(args)
    logs = console_of_rank_zero(args)
    record(_launch)(args, logs)  # as torchrun's own main: a worker's error file reaches the scheduler


if __name__ == "__main__":
    main()
