"""Run a function on N real CPU processes with gloo (spawned, so each gets a fresh interpreter).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every process
after ``init_process_group("gloo")`` and returns the list of per-rank return values (anything
``torch.save`` can write). An exception in any rank fails the call with that rank's traceback.
``fn`` must be a module-level function (it is pickled by name).
"""

import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), outdir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks timed out after {timeout}s")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
