"""Test-only (tests/test_rank_loss.py): SIGKILL one rank while it writes a checkpoint.

On ``PYTHONPATH`` this file is imported at interpreter start by every process torchrun launches.
``TITAN_COMMOPT_TEST_KILL_SAVE = "<step folder>:<global rank>:<torchrun attempt>"`` makes that rank,
in that attempt, write ``<step folder>.killed`` (the time) next to the folder and kill itself as
DCP hands it the data to write: the other ranks have written, or are writing, theirs, and the
folder never gets its ``.metadata``.
"""

import os
import signal
import time

_spec = os.environ.get("TITAN_COMMOPT_TEST_KILL_SAVE", "")
if _spec and "RANK" in os.environ:
    _folder, _rank, _attempt = _spec.split(":")
    if os.environ["RANK"] == _rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == _attempt:
        from torch.distributed.checkpoint import filesystem as _fs

        _write_data = _fs._FileSystemWriter.write_data

        def _write_data_then_die(self, plan, planner):
            path = str(self.path)
            if os.path.basename(path.rstrip("/")) == _folder:
                with open(path.rstrip("/") + ".killed", "w") as handle:
                    handle.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return _write_data(self, plan, planner)

        _fs._FileSystemWriter.write_data = _write_data_then_die
