"""Median timing of GPU (CUDA events) or CPU (perf_counter) calls on fresh inputs.

    t = time_calls(lambda x, y: km.cdist(x, y), make_inputs, device, repeats=10, warmup=2)
    t.median_ms, t.times_ms, t.last_inputs, t.last_output

Every call, warm-ups included, gets new inputs from ``make_inputs()`` (so no
cache holds the previous call's data); input generation is outside the timed
region.  On a GPU the time is the CUDA-event interval around the call on the
current stream, which includes the host's launch overhead whenever the GPU
waits for it.  Each output is released before the next inputs are made, so
peak memory is one call's worth.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Timing", "time_calls", "sync"]


@dataclass
class Timing:
    median_ms: float
    times_ms: list = field(default_factory=list)
    last_inputs: tuple | None = None
    last_output: object = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one(fn, args, device):
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1e3


def event_ms(fn, *args):
    """(ms, output) of one call ``fn(*args)`` on the current CUDA device: CUDA events after a
    synchronisation (the probes' single-call timer; time_calls takes medians)."""
    torch.cuda.synchronize()
    out, ms = _time_one(fn, args, torch.device("cuda"))
    return ms, out


def interleaved(setting: str, fn, reps: int, before=None):
    """Time ``fn()`` with the boolean setting ``setting`` (kermac_like.config) off and on, interleaved:
    one warm-up call each, then ``reps`` rounds of both (``before()`` ahead of every timed call).
    Returns ({False: median ms, True: median ms}, {switch: last output})."""
    from kermac_like import config

    times, outs = {False: [], True: []}, {}
    for on in (False, True):
        with config.override(**{setting: on}):
            outs[on] = fn()
    for _ in range(reps):
        for on in (False, True):
            with config.override(**{setting: on}):
                if before is not None:
                    before()
                ms, outs[on] = event_ms(fn)
            times[on].append(ms)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def _wait_compiles() -> bool:
    """Wait for the kernels compiling in the background (a first call served by the low-K
    run-time-K tier, plan._first_call_tier), so that no timed call runs the stand-in.
    True when there were some."""
    try:
        from kermac_like import testing
    except ImportError:
        return False
    return testing.wait_for_compiles() > 0


def time_calls(fn, make_inputs, device: torch.device, *, repeats: int, warmup: int, keep_last: bool = False) -> Timing:
    """Median of ``repeats`` timed calls ``fn(*make_inputs())`` after ``warmup`` untimed ones.

    With ``keep_last`` the last call's inputs and output are returned (to
    measure its error); otherwise they are dropped.
    """
    repeats = max(1, int(repeats))
    times = []
    args = out = None
    for i in range(max(0, int(warmup)) + repeats):
        args = out = None  # free the previous call's memory first
        args = tuple(make_inputs())
        sync(device)
        if i == warmup and _wait_compiles():  # a kernel compiled aside: warm its plan up too
            out, _ = _time_one(fn, args, device)
        out, ms = _time_one(fn, args, device)
        if i >= warmup:
            times.append(ms)
    t = Timing(statistics.median(times), times)
    if keep_last:
        t.last_inputs, t.last_output = args, out
    return t
