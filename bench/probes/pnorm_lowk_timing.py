"""cdist with a fractional p on the low-K kernel: GPU time and error, to compare two versions
of distance_lowk.cuh / math.cuh (bench/notes/jit.md: the k loop no longer fully unrolled for
fractional p, the outer power on the FMA pipe instead of powf).

    python3 bench/probes/pnorm_lowk_timing.py [--json out.json]     # GPU machine

M = N = 20000, out given, p = 1.7 and 1.3, K in 1, 3, 8, 16 (the default table's low-K
range for fractional p), medians of bench/_timing.time_calls; error: relative Frobenius
against float64 torch.cdist on the first 256 rows. Run it once per checkout (same process
image, same machine) and compare the two tables.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from bench._timing import time_calls  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("-M", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    M = args.M
    out = torch.empty(M, M, device=dev)
    rows = []
    for p in (1.7, 1.3):
        for K in (1, 3, 8, 16):
            x, y = torch.randn(M, K, device=dev), torch.randn(M, K, device=dev)
            t = time_calls(lambda a, b: km.cdist(a, b, p=p, out=out), lambda: (x, y), dev, repeats=args.repeats,
                           warmup=2)
            ref = torch.cdist(x[:256].double(), y.double(), p=p)
            err = ((out[:256].double() - ref).norm() / ref.norm()).item()
            rows.append(dict(p=p, K=K, ms=round(t.median_ms, 4), times=[round(v, 4) for v in t.times_ms], error=err))
            print(f"p={p} K={K:2d}: {t.median_ms:.3f} ms, error {err:.2e}", flush=True)
    print(f"device {torch.cuda.get_device_name(dev)}, kermac_like at {ROOT}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
