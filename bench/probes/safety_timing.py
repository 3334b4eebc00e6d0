"""Times of the kernels that the NaN / sanitizer changes touch, at bench/run.py's sizes
(CUDA events, medians after warm-up, fresh random data per call; bench/_timing.py).
bench/gpu_check.sh runs it from two checkouts in alternation to compare.

    PYTHONPATH=<checkout> python3 bench/probes/safety_timing.py LABEL [REPEATS]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_calls  # noqa: E402

import kermac_like as km  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("label", help="the name on each TIMING line (before, after)")
parser.add_argument("repeats", nargs="?", type=int, default=7, help="timed calls per case (default 7)")
args = parser.parse_args()
label, reps = args.label, args.repeats
dev = torch.device("cuda")


def rnd(*shape):
    return torch.randn(*shape, device=dev)


def cdist_case(M, N, K, p, env=None):
    def run():
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            out = torch.empty(M, N, device=dev)
            return time_calls(lambda a, b: km.cdist(a, b, p, out=out), lambda: (rnd(M, K), rnd(N, K)), dev,
                              repeats=reps, warmup=1).median_ms
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return run


def laplace_case(M, N, K):
    def run():
        out = torch.empty(M, N, device=dev)
        return time_calls(lambda a, b: km.run_kernel(km.PRESETS["laplace_l2"], a, b, bandwidth=16.0, out=out),
                          lambda: (rnd(M, K), rnd(N, K)), dev, repeats=reps, warmup=1).median_ms
    return run


def grad_case(p):
    L, K, M, N, O = 2, 10000, 10000, 768, 16

    def run():
        out = torch.empty(L, O, N, M, device=dev)
        return time_calls(lambda a, b, c, d: km.cdist_grad(a, b, c, d, p=p, out=out),
                          lambda: (rnd(L, K, M), rnd(L, N, K), rnd(L, O, K), rnd(L, N, M)), dev,
                          repeats=reps, warmup=1).median_ms
    return run


CASES = {
    "cdist_p1 30000^2x1024 (simt)": cdist_case(30000, 30000, 1024, 1.0),
    "cdist_p1.3 30000^2x1024 (simt)": cdist_case(30000, 30000, 1024, 1.3),
    "cdist_p2 30000^2x1024 (wgmma)": cdist_case(30000, 30000, 1024, 2.0),
    "cdist_p2 30000^2x1024 (mma.sync)": cdist_case(30000, 30000, 1024, 2.0, {"KERMAC_LIKE_WGMMA": "0"}),
    "laplace_l2 50000^2x256 (wgmma)": laplace_case(50000, 50000, 256),
    "cdist_p2 20000^2x3 (wgmma)": cdist_case(20000, 20000, 3, 2.0),
    "cdist_grad_p1 (2,10000,10000,768,16)": grad_case(1.0),
}
res = {}
only = os.environ.get("TIMING_CASES")  # comma-separated substrings of the case names
for name, fn in CASES.items():
    if only and not any(w in name for w in only.split(",")):
        continue
    res[name] = round(fn(), 3)
    torch.cuda.empty_cache()
print("TIMING " + json.dumps({"label": label, "ms": res}), flush=True)
