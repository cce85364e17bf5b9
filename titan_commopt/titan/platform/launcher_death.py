"""A worker of a fault-tolerant run dies with its launcher.

torchrun starts every worker in a session of its own (``start_new_session``), so a launcher killed
with SIGKILL (an OOM kill, a crashed agent, a scheduler signalling the wrong process) leaves its
workers running, reparented to init. Under live fault tolerance that is a zombie replica group:
group rank 0's torchft Manager heartbeats the lighthouse from threads of its own (its Rust server),
so the lighthouse keeps the orphans in every quorum, and once the group is launched again they and
the new group are both in it: no step commits until the orphans are killed by hand (seen for more
than 4 minutes; ``[commopt] ft_stall_timeout_s`` does not end them, their steps are not stalled).

:func:`die_with_launcher` makes the kernel SIGKILL this process when the launcher's process dies
(``prctl(PR_SET_PDEATHSIG)``); the lighthouse then drops the group after its heartbeat timeout, as
for any lost group. Why this, and not a thread that polls ``os.getppid()``:

- the heartbeat stops only with the process: it runs on torchft's own threads, which neither an
  exception in the main thread nor ``sys.exit`` from another thread ends (interpreter exit waits
  for torchft's quorum executor), and a polling thread needs the GIL, which a wedged main thread
  may hold. A kernel signal ends every thread at once, whatever the interpreter is doing;
- SIGKILL, not SIGTERM: a library's SIGTERM handler would run only when the main thread gets back
  to Python (after a collective's timeout, at worst).

Two things decide whether the signal comes, both held here:

- the setting belongs to the calling thread (the kernel keeps it per thread and sends it when any
  thread that holds it sees its parent go); it is lost when that thread ends, so it is made from
  the main thread, which lives as long as the process;
- the "parent" is the launcher's thread that started the worker, not its whole process: torch's
  elastic agent (torchrun, and ``python -m titan_commopt.run``, which runs it in-process) starts its
  workers from its main thread (``LocalElasticAgent._start_workers``, called from ``run``), which
  lives as long as the launcher.

A launcher that died before the call has orphaned the worker already: ``python -m titan_commopt.run``
passes its process id to the workers (``LAUNCHER_ENV``), against which the parent is compared. Under
plain torchrun the workers reach this point only after the process group exists, which they form
through the agent's rendezvous store (hosted by the agent unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``
is set): a worker whose agent died before then fails there instead.
"""

import ctypes
import logging
import os
import signal
import sys
import threading

from titan_commopt.launch_env import LAUNCHER_ENV

__all__ = ["die_with_launcher", "launched_by_an_agent"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_AGENT_ENV = "TORCHELASTIC_RUN_ID"  # set by torch's elastic agent in every worker it starts


def launched_by_an_agent() -> bool:
    """Whether this process is a worker started by torch's elastic agent (torchrun or ours)."""
    return _AGENT_ENV in os.environ


def die_with_launcher() -> bool:
    """SIGKILL this process when its launcher dies (module docstring). Call it from the main thread.
    A process not started by an elastic agent (or on a system without ``prctl``) is left alone;
    returns whether the signal is armed. A launcher already gone: this process ends now (status 1)."""
    if not launched_by_an_agent() or not sys.platform.startswith("linux"):
        return False
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("die_with_launcher: call it from the main thread (the setting dies with its thread)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("fault tolerance: prctl(PR_SET_PDEATHSIG) failed (errno %d): this process would outlive "
                       "its launcher", ctypes.get_errno())
        return False
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and int(launcher) != os.getppid():
        logger.error("fault tolerance: the launcher (pid %s) is gone: this process leaves", launcher)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)
    return True
