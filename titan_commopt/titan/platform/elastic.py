"""torchrun restarts (``--max-restarts``) and the rendezvous store shared across them.

Since torch 2.4 torchrun's c10d rendezvous shares one TCPStore between the agent and the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``), created once and kept for every restart round, while the
workers' ``env://`` store adds no per-attempt prefix (``torch.distributed.rendezvous``: "We create a
new TCPStore for every retry", which the shared server contradicts). The restarted workers'
process-group init then reads the previous attempt's peer addresses, still in the store, and gloo's
full-mesh connect waits on the dead peers for minutes (README, "Automatic restarts") before the
attempt fails; the next restart does the same (pytorch/pytorch#135712; NCCL can pick up a stale
unique id likewise). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives every
round a fresh store (rank 0 hosts it): restarts then resume from the last checkpoint.
``python -m titan_commopt.run`` sets it when ``--max-restarts`` > 0 (``titan_commopt/run.py``; the
variable is named in ``titan_commopt/launch_env.py``).
:func:`warn_if_restart_would_hang` says so on the console of a restarted run without it.
"""

import os
import sys

from titan_commopt.launch_env import FRESH_STORE

__all__ = ["warn_if_restart_would_hang", "FIX"]

FIX = "=".join(FRESH_STORE)  # the variable the launcher sets itself


def warn_if_restart_would_hang() -> bool:
    """On a torchrun restart (attempt >= 1) with the shared store, print one line (rank 0)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt < 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    if os.environ.get("RANK", "0") == "0":
        print(
            f"titan_commopt: warning: torchrun restart {attempt} reuses the rendezvous store of the failed "
            "attempt, and process-group init may wait minutes on its dead peers, then fail "
            f"(pytorch/pytorch#135712): launch torchrun with {FIX} in its environment (python -m titan_commopt.run "
            "sets it)",
            file=sys.stderr, flush=True,
        )
    return True
