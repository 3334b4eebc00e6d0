"""A/B of kernel_logsumexp's pair-loop variants (cuda_templates/logsumexp.cuh LseTraits kVariant,
kUnrollJ, kRows; bench/notes/logsumexp.md) beside kernel_matvec at the same size, one process.

    python3 bench/probes/lse_variants.py [--full] [--reps 5] [--only d3c1]

Per (D, C): each variant through the planner (runtime.specs.logsumexp.TUNING), CUDA-event
median of --reps calls after one warm-up, fresh random data per call (randn x, y, log weights;
Gaussian, bandwidth 1.0); its error against float64 on the first 256 rows at bandwidth 1e-3
(data as is, and scaled by 0.003: phi of order 1..100 for the nearest points) and 1.0, relative
to max(1, |value|) (acceptance: <= 1e-5), and whether two calls give the same bits. D = 3, C = 1
runs at M = N = 1e6; D = 16, C = 1 and D = 3, C = 4 at N = 2.5e5 (times scaled to N = 1e6 in the
last column) unless --full. Runtime ~60-80 s on an H100.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import kermac_like as km  # noqa: E402
from kermac_like.runtime.specs import logsumexp as specs  # noqa: E402

# (label, TUNING): None is the shipped default.
VARIANTS = {
    "d3c1": [("shipped", None), ("v1 U4 R4", dict(variant=1)), ("v1 U8 R4", dict(variant=1, unroll_j=8)),
             ("v2 U4 R4", dict(variant=2)), ("v2 U8 R4", dict(variant=2, unroll_j=8)),
             ("v2 U8 R8", dict(variant=2, unroll_j=8, rows=8)), ("v2 U8 R2", dict(variant=2, unroll_j=8, rows=2))],
    "d16c1": [("shipped", None), ("v1", dict(variant=1)), ("v2", dict(variant=2)),
              ("v2 U4", dict(variant=2, unroll_j=4))],
    "d3c4": [("shipped", None), ("v1", dict(variant=1)), ("v1 U4", dict(variant=1, unroll_j=4))],
}
SHAPES = {"d3c1": (3, 1), "d16c1": (16, 1), "d3c4": (3, 4)}
DESC = km.preset("gaussian_l2")
ERR_ROWS = 256
_REFS = {}


def lse(x, y, w, bw):
    return km.kernel_logsumexp(DESC, x, y, w, bandwidth=bw)


def time_fn(fn, make, reps):
    times = []
    for i in range(reps + 1):
        args = make()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        if i:
            times.append(a.elapsed_time(b))
        del args
    return statistics.median(times)


def errors(K, C, N, dev):
    """Worst error relative to max(1, |float64|) over the three checks, and same bits twice."""
    g = torch.Generator(device=dev).manual_seed(7)
    worst, same = 0.0, True
    for bw, scale in ((1e-3, 1.0), (1e-3, 0.003), (1.0, 1.0)):
        x = torch.randn(ERR_ROWS, K, device=dev, generator=g) * scale
        y = torch.randn(N, K, device=dev, generator=g) * scale
        w = torch.randn(N, C, device=dev, generator=g)
        got = lse(x, y, w, bw)
        again = lse(x, y, w, bw)
        same &= torch.equal(got.view(torch.int32), again.view(torch.int32))
        key = (K, C, N, bw, scale)  # the same data for every variant (seeded): one float64 reference
        if key not in _REFS:
            _REFS[key] = lse(x.double(), y.double(), w.double(), bw)
        ref = _REFS[key]
        assert torch.isfinite(ref).all()
        worst = max(worst, ((got.double() - ref).abs() / ref.abs().clamp_min(1)).max().item())
    return worst, same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="M = N = 1e6 for every shape")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", action="append", choices=list(VARIANTS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    # Compile every variant first (in parallel: NVRTC runs outside the GIL).
    from kermac_like.runtime.launcher import get_kernel

    todo = []
    for key in args.only or VARIANTS:
        K, C = SHAPES[key]
        for _, tune in VARIANTS[key]:
            todo.append(specs.lse_spec(DESC, torch.float32, K, C, **(tune or {})))
            todo.append(specs.lse_combine_spec(DESC, torch.float32, C))
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda s: get_kernel(s, dev.index or 0), todo))
    print(f"compiled {len(todo)} specs in {time.perf_counter() - t0:.1f} s; device {torch.cuda.get_device_name()}")
    print(f"{'shape':<28} {'variant':<10} {'ms':>9} {'/matvec':>8} {'ms@N=1e6':>9} {'err':>9} {'bits':>5}")
    for key in args.only or VARIANTS:
        K, C = SHAPES[key]
        M = 10 ** 6
        N = M if (args.full or key == "d3c1") else 250_000
        scale = 10 ** 6 / N
        make_mv = lambda: (torch.randn(M, K, device=dev), torch.randn(N, K, device=dev),  # noqa: E731
                           torch.rand(N, C, device=dev))
        mv = time_fn(lambda x, y, v: km.kernel_matvec(DESC, x, y, v, bandwidth=1.0), make_mv, args.reps)
        shape = f"D={K} C={C} M={M:.0e} N={N:.0e}"
        print(f"{shape:<28} {'matvec':<10} {mv:9.1f} {1.0:8.2f} {mv * scale:9.1f}")
        make = lambda: (torch.randn(M, K, device=dev), torch.randn(N, K, device=dev),  # noqa: E731
                        torch.randn(N, C, device=dev))
        for label, tune in VARIANTS[key]:
            specs.TUNING = tune
            try:
                err, same = errors(K, C, N, dev)
                ms = time_fn(lambda x, y, w: lse(x, y, w, 1.0), make, args.reps)
            finally:
                specs.TUNING = None
            flag = "" if err <= 1e-5 and same else "  <-- FAILS"
            print(f"{shape:<28} {label:<10} {ms:9.1f} {ms / mv:8.2f} {ms * scale:9.1f} {err:9.2e} "
                  f"{'same' if same else 'DIFF':>5}{flag}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
