"""Entry point: torchtitan's own Trainer with titan_commopt plugged in, from a TOML train config, on
torchtitan 0.2.2 or (the same TOML, translated: docs/toml_on_03.md) 0.3.

    python -m titan_commopt.run --nproc_per_node=2 -m titan_commopt.train --job.config_file train_configs/debug_cpu.toml

(``python -m titan_commopt.run`` is torchrun that checks the config first; plain ``torchrun`` works
too.) Differences from ``python -m torchtitan.train``, all before torchtitan's Trainer starts:

1. on a machine without an accelerator, torchtitan is pointed at the CPU (``titan/platform/cpu.py``;
   on 0.3 with the other CPU fixes of ``titan/tt03/cpu.py``) and its known-harmless CPU warnings
   are filtered (``titan/platform/console.py``);
2. ``--job.custom_config_module`` / ``--experimental.custom_import`` default to ours, so the
   ``[commopt]`` section and our TrainSpecs exist whatever the TOML says;
3. the config is checked before any process group exists (``titan/config/parse.py``: file, sections,
   keys, types, command line; ``titan/config/validate.py``: values, the mesh against ``WORLD_SIZE``,
   ``[optimizer]`` and every ``[commopt]`` key): a bad config exits with status 2 and one line per
   problem (key, value, what is allowed), printed by rank 0 (by the launcher under
   ``titan_commopt.run``), no traceback unless ``TITAN_COMMOPT_TRACEBACK=1``; what a valid config
   probably does not mean (a ``[commopt.<family>]`` table the chosen optimizer does not read, MT-DAO's
   switch in a short run) is one warning line each, printed once (:func:`report_warnings`);
4. the run made in step 3 is what torchtitan's Trainer builds from: on 0.2.2 a ``CommoptRun``
   (``titan/tt022/run_context.py``: the job config, parsed once, the resolved optimizer, the comm
   ledger) trained by ``titan/tt022/trainer.py``; on 0.3 a ``TomlRun``
   (``titan/tt03_toml/toml_config.py``: the same, and 0.3's ``Trainer.Config``) trained by
   ``titan/tt03_toml/runner.py`` with 0.3's own Trainer;
5. a run that trained to the end leaves with ``os._exit(0)`` once its output is flushed: see
   :func:`exit_after_success`.
"""

import os
import sys
import traceback
from typing import Any, Optional

from .launch_env import WARNED_ENV

PREFIX = "titan_commopt: bad config: "  # every pre-flight line starts with it
TRACEBACK_ENV = "TITAN_COMMOPT_TRACEBACK"  # =1: print the traceback of a pre-flight error too
WARNING_PREFIX = "titan_commopt: warning: "  # every line of report_warnings starts with it


def check_config(argv: list[str], world_size: Optional[int] = None) -> Any:
    """The run (``CommoptRun``: the job config parsed once, the keys the user set, the resolved
    optimizer, None for torchtitan's own) made without touching torch.distributed; raises
    ConfigError listing every problem. ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (unset:
    the mesh is not checked against it). On torchtitan 0.3 the same TOML and command line make a
    ``TomlRun``, which also holds 0.3's ``Trainer.Config``."""
    import titan_commopt.titan  # noqa: F401  (0.2.2: registers the TrainSpecs and datasets)

    if titan_commopt.titan.LINE == "0.3":
        from .titan.tt03_toml.toml_config import TomlRun

        return TomlRun.from_command_line(argv, world_size)
    from .titan.tt022.run_context import CommoptRun

    return CommoptRun.from_command_line(argv, world_size)


def format_error(error: BaseException) -> str:
    """One line per problem, each starting with :data:`PREFIX`."""
    return "\n".join(PREFIX + line for line in str(error).splitlines() if line.strip())


def report_config_error(error: BaseException, launcher: bool = False) -> None:
    """Print the pre-flight lines once (rank 0, or nobody when ``titan_commopt.run`` prints them;
    ``launcher``: this is that launcher), record them for torchrun's agent, and exit with status 2."""
    from .titan.platform.stop import announce

    text = format_error(error)
    if launcher or os.environ.get("RANK", "0") == "0":
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exception(error)
    if launcher:
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
    else:
        announce(text, 2)  # rank 0 prints it, unless titan_commopt.run prints it from the error file, last
    raise SystemExit(2)


def report_warnings(run: Any, launcher: bool = False) -> None:
    """Print the run's config warnings (``run.warnings``) once: by ``titan_commopt.run`` before any
    worker starts (``launcher``; it tells its workers so through :data:`WARNED_ENV`), else by global
    rank 0 (plain torchrun, or a launcher that did not print them)."""
    if not run.warnings:
        return
    if launcher:
        os.environ[WARNED_ENV] = "1"  # the workers inherit the launcher's environment
    elif os.environ.get(WARNED_ENV) or os.environ.get("RANK", "0") != "0":
        return
    sys.stdout.flush()
    print("\n".join(WARNING_PREFIX + line for line in run.warnings), file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .titan.platform.console import quiet_known_noise
    from .titan.platform.cpu import use_cpu_if_no_accelerator

    import titan_commopt.titan

    quiet_known_noise()
    on_03 = titan_commopt.titan.LINE == "0.3"
    if not on_03:  # on 0.3 the CPU fixes are part of the run's config (titan/tt03_toml/runner.py)
        use_cpu_if_no_accelerator()
    from titan_commopt.options import ConfigError

    try:
        run = check_config(argv)
    except ConfigError as error:
        report_config_error(error)
    report_warnings(run)

    if on_03:
        from .titan.tt03_toml.runner import run_toml

        run_toml(run)
        return
    from .titan.tt022.trainer import run_torchtitan

    run_torchtitan(run)


def exit_after_success() -> None:
    """Leave the process now, exit status 0, skipping the interpreter's teardown.

    By the time torchtitan's ``main`` returns, the trainer is closed (checkpoints written, the
    TensorBoard writer closed) and the process group destroyed: nothing is left to do. Yet the
    interpreter's teardown that follows (C++ static destructors and the finalizers of torch's
    objects) can abort a gloo rank with SIGABRT ("terminate called without an active exception": a
    joinable C++ thread destroyed) after the process group was destroyed; torchrun then reports the
    successful run as failed and the other node waits out its exit barrier (300 s). So a successful
    run flushes what it printed and logged and ends here; a run that failed raises instead and never
    gets here."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_after_success()
