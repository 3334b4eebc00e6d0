"""Host time per call of small ops: what a training loop pays in Python before the GPU works.

    python3 bench/host_overhead.py --label after                    # GPU machine; JSON on stdout
    PYTHONPATH=<old checkout> python3 bench/host_overhead.py --label before

For each case (256 x 256 x 8 float32 by default): warm up, then ``--repeats`` times time
``--calls`` back-to-back calls with ``time.perf_counter`` around the loop and no
synchronisation inside it (the launches queue; at these sizes the GPU finishes each call
long before the host issues the next, so the loop measures the host), synchronise
outside the timed region; report the median microseconds per call. Uses only the public
API, so it runs against any version of the package on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import kermac_like as km


def _cases(m: int, n: int, k: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)
    y = torch.randn(n, k, device="cuda", generator=g)
    out = torch.empty(m, n, device="cuda")
    bw = torch.tensor([2.0], device="cuda")
    x5, y5 = x[:, :5].contiguous(), y[:, :5].contiguous()  # K = 5: zero-padded for the tensor cores
    yield "cdist_p2", lambda: km.cdist(x, y)
    yield "cdist_p2_out", lambda: km.cdist(x, y, out=out)
    yield "cdist_p1", lambda: km.cdist(x, y, 1.0)
    yield "laplace_l2_bw_tensor", lambda: km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=bw)
    yield "laplace_l2_bw_float", lambda: km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=2.0)
    yield "cdist_p2_k5_padded", lambda: km.cdist(x5, y5)
    x20, y20 = torch.randn(m, 20, device="cuda", generator=g), torch.randn(n, 20, device="cuda", generator=g)
    yield "cdist_p2_k20", lambda: km.cdist(x20, y20)  # K > 8: the tensor cores (a few tiles: mma.sync)
    yield "torch_cdist_p2", lambda: torch.cdist(x, y)  # the floor a torch op pays
    try:  # the parts of a call, where the package has a planner
        from kermac_like import plan as P
        from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
    except ImportError:
        return
    call = prepare_call(km.PRESETS["l2"], x, y)
    mode = COMPUTE_MODES[0]
    yield "part_prepare_call", lambda: prepare_call(km.PRESETS["l2"], x, y)
    yield "part_plan_p2_cached", lambda: P.plan_distance(call, out, mode, False)
    plan = P.plan_distance(call, out, mode, False)
    yield "part_launches_p2", plan.run


def measure(fn, calls: int, repeats: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        per_call.append((t1 - t0) / calls * 1e6)
    return statistics.median(per_call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--size", default="256x256x8", help="MxNxK")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    m, n, k = (int(v) for v in args.size.split("x"))
    result = {
        "label": args.label, "size": args.size, "device": torch.cuda.get_device_name(),
        "package": os.path.dirname(km.__file__), "torch": torch.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith("KERMAC_LIKE_")},
        "us_per_call": {name: round(measure(fn, args.calls, args.repeats), 2) for name, fn in _cases(m, n, k)},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
