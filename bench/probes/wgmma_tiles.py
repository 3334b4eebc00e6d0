"""The wgmma distance kernel's tile shapes with partial sums (setting wgmma_tile: 128, 192, 256),
timed interleaved in one process on the two bench rows of issue 42, with one running sum
(wgmma_chunk 0) beside them as the target (bench/notes/data_zoo.md, session 23).

    python3 bench/probes/wgmma_tiles.py                 # ~2 minutes on an H200
    python3 bench/probes/wgmma_tiles.py --reps 15 --rows cdist

Per row and shape: the median of --reps CUDA-event timings (each round times every shape once,
same inputs), the max relative error of 256 rows against float64, and whether the output is the
128 x 128 kernel's bit for bit (the partial sums are the same; see
tests/test_gpu_zoo.py::test_wide_tiles_sum_as_the_narrow_ones).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from bench._timing import event_ms  # noqa: E402

SHAPES = {"one sum (128 x 256)": {"wgmma_chunk": 0},
          "128 x 128": {"wgmma_chunk": 2, "wgmma_tile": 128},
          "128 x 192": {"wgmma_chunk": 2, "wgmma_tile": 192},
          "128 x 256 halves": {"wgmma_chunk": 2, "wgmma_tile": 256}}
ERR_ROWS = 256


def rows(which):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    if which in ("all", "cdist"):
        x = torch.randn(30000, 1024, device="cuda", generator=g)
        y = torch.randn(30000, 1024, device="cuda", generator=g)
        o = torch.empty(30000, 30000, device="cuda")
        out["cdist p = 2 30000^2 x 1024"] = (lambda x=x, y=y, o=o: km.cdist(x, y, p=2.0, out=o),
                                            lambda x=x, y=y: torch.cdist(x[:ERR_ROWS].double(), y.double()), o)
    if which in ("all", "laplace"):
        x = torch.randn(50000, 256, device="cuda", generator=g)
        y = torch.randn(50000, 256, device="cuda", generator=g)
        o = torch.empty(50000, 50000, device="cuda")
        bw = (2.0 * 256) ** 0.5  # bench/run.py: ~ the distance of standard normal rows
        lap = km.preset("laplace_l2")
        out["Laplace-l2 50000^2 x 256"] = (lambda x=x, y=y, o=o: km.run_kernel(lap, x, y, bandwidth=bw, out=o),
                                          lambda x=x, y=y: torch.exp(-torch.cdist(x[:ERR_ROWS].double(), y.double()) / bw),
                                          o)
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rows", choices=("all", "cdist", "laplace"), default="all")
    args = ap.parse_args(argv)
    for name, (call, ref_fn, out) in rows(args.rows).items():
        ref = ref_fn()
        times = {s: [] for s in SHAPES}
        errs, same = {}, {}
        first = None
        for s, kw in SHAPES.items():  # warm-up (compiles), error and bits
            with km.config.override(wgmma="on", **kw):
                call()
                torch.cuda.synchronize()
                errs[s] = float(((out[:ERR_ROWS].double() - ref).abs() / ref.abs().clamp_min(1e-30)).max())
                head = out[:ERR_ROWS].clone()
                if s == "128 x 128":
                    first = head
                same[s] = None if first is None else bool(torch.equal(head, first))
        for _ in range(args.reps):
            for s, kw in SHAPES.items():
                with km.config.override(wgmma="on", **kw):
                    ms, _ = event_ms(call)
                times[s].append(ms)
        print(f"\n{name} (median of {args.reps}, ms; max rel. error of {ERR_ROWS} rows vs float64)")
        for s in SHAPES:
            bits = "" if same[s] is None else ("  same bits as 128 x 128" if same[s] else "  bits differ from 128 x 128")
            print(f"  {s:22s} {statistics.median(times[s]):7.2f}  (min {min(times[s]):6.2f})  err {errs[s]:.2e}{bits}")
        del ref


if __name__ == "__main__":
    main(sys.argv[1:])
