"""Multi-process tests on CPU: spawn worker processes that form a gloo group and report back.

Two ranks (what every file's default test takes) are one pair of processes for the whole session:
started by the first call, each later call hands both the new target (and a free port), so that the
four files' checks pay the pair's start-up (an import of torch, the package and scikit-learn in each
process: ~3 CPU-s) once instead of four times. A target must leave its process as it found it apart
from what the pair restores itself (torch's thread count, the environment); the pair is stopped and
replaced after a call that fails to report."""

from __future__ import annotations

import atexit
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, tasks, results) -> None:
    """A rank of the session's pair: run ``target(rank, port, results)`` for each (target, port) handed
    in, until None."""
    import os

    import torch

    threads, env = torch.get_num_threads(), dict(os.environ)
    while True:
        item = tasks.get()
        if item is None:
            return
        target, port = item
        try:
            target(rank, port, results)
        finally:
            torch.set_num_threads(threads)
            os.environ.clear()
            os.environ.update(env)


_pair = None  # (processes, task queues, result queue)


def _stop_pair(kill: bool = False) -> None:
    global _pair
    pair, _pair = _pair, None
    if pair is None:
        return
    procs, tasks, _ = pair
    for p, q in zip(procs, tasks):
        if not kill:
            q.put(None)
    for p in procs:
        p.join(timeout=0 if kill else 30)
        if p.is_alive():
            p.kill()


atexit.register(_stop_pair)


def _start_pair():
    global _pair
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tasks, results = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(r, tasks[r], results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    _pair = (procs, tasks, results)
    return _pair


def spawn_workers(target, n: int = 2, timeout: float = 120) -> dict:
    """Run ``target(rank, port, queue)`` in ``n`` processes (each puts ``(rank, result)`` on the
    queue); returns {rank: result}. Two ranks run in the session's pair; other counts in processes
    spawned for the call. Stragglers are killed."""
    port = free_port()
    if n == 2:
        procs, tasks, results = _pair or _start_pair()
        for q in tasks:
            q.put((target, port))
        try:
            return dict(results.get(timeout=timeout) for _ in procs)
        except BaseException:
            _stop_pair(kill=True)  # a rank that did not report: the next call starts a new pair
            raise
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
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
