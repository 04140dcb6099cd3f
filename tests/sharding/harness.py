"""Run a function on R real processes joined by a process group; never hang.

gloo on CPU by default; ``FBTD_DIST_BACKEND=nccl`` runs the same tests on one GPU per rank
(``device()`` tells a test function where its tensors go).

Each rank runs ``fn(rank, world_size, *args)`` in a spawned process; return values come back
in rank order. A rank that raises makes ``run_ranks`` raise with its traceback; a rank that
does not finish within ``timeout`` seconds gets every process killed and a TimeoutError.
"""

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    return os.environ.get("FBTD_DIST_BACKEND", "gloo")


def device():
    """This rank's device: its GPU under NCCL, else the CPU."""
    import torch

    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _entry(fn, rank, world_size, port, results, pg_timeout, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend() == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            backend(),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout: float = 120.0):
    if backend() == "nccl":
        import pytest
        import torch

        if torch.cuda.device_count() < world_size:
            pytest.skip(f"NCCL run needs {world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, results, pg_timeout, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(outs) - set(errors))} "
                    f"did not finish within {timeout:.0f} s"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outs and r not in errors
                ]
                for r in dead:
                    errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                continue
            (outs if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [outs[r] for r in range(world_size)]
