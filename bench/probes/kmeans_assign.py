"""KMeans' assignment on tensor cores (plan.topk below MAX_K: topk_mma's merged lists and
topk_rescore_best_kernel) against the SIMT kernel alone, on one GPU: per shape one assignment
(cluster._assign, k = 1) timed by CUDA events (median after warm-up, fresh random data each
call: C Gaussian means, N points around them), labels and distance bits compared; then the
bench row's fit (k-means++ then 20 Lloyd iterations, tol 0) with either assignment. A table last.

    python3 bench/probes/kmeans_assign.py [--quick] [--n 10000000] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from _timing import time_calls  # noqa: E402

from kermac_like import cluster  # noqa: E402
from kermac_like.plan import topk as P  # noqa: E402


def data(N, D, C, gen):
    means = 4 * torch.randn(C, D, device="cuda", generator=gen)
    X = means[torch.randint(0, C, (N,), device="cuda", generator=gen)] + torch.randn(N, D, device="cuda", generator=gen)
    return X, X[torch.randint(0, N, (C,), device="cuda", generator=gen)].clone()


def assign(tc, X, centres):
    cluster.TENSOR_CORES = tc
    return cluster._assign(X, centres, False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    N = 200_000 if a.quick else a.n
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), f"MMA_VERSION {P.MMA_VERSION}, MMA_MIN_K {P.MMA_MIN_K}", flush=True)
    rows = []
    P.MMA_MIN_K = 8  # the sweep decides where tensor cores start: every shape below may take them
    for D, C in ((16, 1024), (8, 1024), (12, 1024), (24, 1024), (32, 1024), (64, 1024), (16, 256), (16, 4096)):
        try:
            make = lambda: data(N, D, C, gen)  # noqa: E731
            t = {tc: time_calls(lambda X, c, tc=tc: assign(tc, X, c), make, torch.device("cuda"), repeats=a.reps,
                                warmup=2).median_ms for tc in (False, True)}
            X, c = make()
            l0, d0 = assign(False, X, c)
            l1, d1 = assign(True, X, c)
            same = int((l0 != l1).sum())
            bits = int((d0 != d1).sum())
            rows.append((f"assign N={N} D={D} C={C}", t[False], t[True], f"labels differ {same}, distances differ {bits}"))
        except Exception as e:  # a shape must not stop the probe
            traceback.print_exc()
            rows.append((f"assign N={N} D={D} C={C}", float("nan"), float("nan"), f"ERROR {type(e).__name__}: {e}"))
        print(rows[-1], flush=True)
    P.MMA_MIN_K = 16
    for D, C in ((16, 1024),):
        try:
            make = lambda: (data(N, D, C, gen)[0],)  # noqa: E731
            fit = lambda X: cluster.KMeans(C, max_iter=20, tol=0.0, random_state=0).fit(X)  # noqa: E731
            t, fits = {}, {}
            for tc in (False, True):
                cluster.TENSOR_CORES = tc
                r = time_calls(fit, make, torch.device("cuda"), repeats=max(1, a.reps // 2), warmup=1)
                t[tc] = r.median_ms
            X = make()[0]
            for tc in (False, True):
                cluster.TENSOR_CORES = tc
                fits[tc] = fit(X)
            same = torch.equal(fits[False].labels_, fits[True].labels_)
            rel = abs(fits[True].inertia_ / fits[False].inertia_ - 1)
            rows.append((f"fit N={N} D={D} C={C} (k-means++ + 20 Lloyd)", t[False], t[True],
                         f"labels equal {same}, inertia rel. diff {rel:.1e}"))
        except Exception as e:
            traceback.print_exc()
            rows.append((f"fit N={N} D={D} C={C}", float("nan"), float("nan"), f"ERROR {type(e).__name__}: {e}"))
        print(rows[-1], flush=True)
    cluster.TENSOR_CORES = True
    print(f"\n{'case':<48} {'SIMT ms':>10} {'TC ms':>10} {'speed-up':>9}  check")
    for name, t0, t1, note in rows:
        print(f"{name:<48} {t0:>10.2f} {t1:>10.2f} {t0 / t1 if t1 == t1 and t1 > 0 else float('nan'):>8.2f}x  {note}")


if __name__ == "__main__":
    main()
