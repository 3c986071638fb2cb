"""A few CPU ranks as spawned local processes, outside Ray: for measurements that need bare
torch.distributed processes (gloo on 127.0.0.1) and nothing else running in them."""
from __future__ import annotations

import os
import socket
from typing import Any, Callable


def free_port() -> int:
    """A loopback port free now, for gloo's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(target: Callable[..., None], world: int, args: tuple = (), timeout_s: float = 120.0) -> Any:
    """Run `target(rank, world, port, *args, out)` in `world` new processes and return the first
    object one of them puts on the queue `out` (rank 0's result, by the targets' convention); the
    processes are joined, and killed if they outlive `timeout_s` after it."""
    port = free_port()
    ctx = _context()
    out = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_in_environment, args=(env, target, r, world, port, *args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _context():
    """A fork server that has imported torch once: each rank forks from it, fresh, instead of starting
    an interpreter and importing torch again (seconds per rank on a small host)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _in_environment(env: dict, target: Callable[..., None], *args: Any) -> None:
    """Run `target` in the caller's environment as it is now: a forked rank inherits the fork server's,
    which is the caller's when the server started."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)
