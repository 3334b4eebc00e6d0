"""Shared command-line, device and timing helpers of the example scripts.

Every example is run as ``python examples/NAME.py [--quick] [-d]``; this module
puts the repository root on ``sys.path`` when kermac_like is not installed, so
the examples also run from a source checkout.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import sys
import time

import torch

try:
    import kermac_like  # noqa: F401
except ImportError:  # a source checkout: the package sits one level up
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import kermac_like  # noqa: F401
from kermac_like._args import check_device  # noqa: E402

__all__ = ["parser", "setup", "device_arg", "median_ms", "rel_err", "fmt_ms", "sync"]


def parser(description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the options every example shares."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-d", "--debug", action="store_true",
                   help="log JIT compilation, cache hits/misses and launches (debug=True on every op)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds on a CPU")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--seed", type=int, default=0)
    return p


def device_arg(value, debug: bool = False) -> torch.device:
    """The ``--device`` option as a torch.device. A device this torch cannot use (a CUDA device
    on a CPU-only build) ends the script with one line on stderr and exit status 2, as
    argparse's own errors do; with ``-d`` the traceback instead."""
    try:
        return check_device("--device", value)
    except (TypeError, ValueError) as e:
        if debug:
            raise
        print(f"{pathlib.Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)


def setup(args) -> torch.device:
    """Configure logging, the seed and the device; print which path runs."""
    if args.debug:
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
        logging.getLogger("kermac_like").setLevel(logging.DEBUG)
    torch.manual_seed(args.seed)
    device = device_arg(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), args.debug)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.quick:
        args.repeats = min(args.repeats, 2)
    print(f"kermac_like {kermac_like.__version__}, torch {torch.__version__}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = torch.cuda.get_device_capability(device)
        path = "fused CUDA kernels" if cap >= (8, 0) else "torch reference path (GPU older than sm_80)"
        print(f"device: {name} (sm_{cap[0]}{cap[1]}): {path}")
    else:
        print("device: cpu: CPU reference path (plain torch; no kernels are compiled)")
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls.

    CUDA events on the current stream for a GPU device, ``perf_counter`` on a CPU.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||ours - ref|| / ||ref||, computed in float64."""
    ref = ref.double()
    den = ref.norm().item()
    num = (ours.double() - ref).norm().item()
    return num / den if den > 0 else num


def fmt_ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1e4 else f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"
