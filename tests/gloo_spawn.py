"""Multi-process tests on CPU: spawn worker processes that form a gloo group and report back."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(target, n: int = 2, timeout: float = 120) -> dict:
    """Run ``target(rank, port, queue)`` in ``n`` spawned processes (each puts ``(rank, result)``
    on the queue); returns {rank: result}. Stragglers are killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
