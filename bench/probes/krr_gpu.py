"""One GPU session of the solvers' measurements (issue: kernel ridge regression past one GPU):
kernel_matvec at D = 8 and N = 10^6, the landmark preconditioner's build, the exact-vs-cg
check at N = 10^5, cg and nystrom at N = 10^6. Prints a table last.

    python bench/probes/krr_gpu.py [--skip-exact] [--landmarks 5000 10000]
"""

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import kermac_like as km  # noqa: E402
import large_scale_krr as ex  # noqa: E402
from kermac_like.solvers._dist import Comm  # noqa: E402
from kermac_like.solvers._kernel import resolve_kernel  # noqa: E402
from kermac_like.solvers._nystrom import LandmarkNystromPreconditioner  # noqa: E402


def cuda_time(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument("--landmarks", type=int, nargs="+", default=[5000])
    ap.add_argument("--max-iter", type=int, default=80)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    table = []
    k = resolve_kernel("gaussian_l2", 1.5, None)
    x, y = ex.make_data(1_000_000, 8, device=dev)
    v = y[:, None].contiguous()
    t = cuda_time(lambda: k.matvec(x, x, v))
    table.append(("kernel_matvec gaussian D=8, 1e6 x 1e6, C=1", f"{t:.3f} s", ""))
    print(table[-1], flush=True)
    for m in args.landmarks:
        z = x[torch.randperm(x.shape[0], device=dev)[:m]]
        t = cuda_time(lambda: k.matvec(z, x, v))
        table.append((f"kernel_matvec {m} landmarks x 1e6, C=1", f"{t * 1e3:.1f} ms", ""))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pre = LandmarkNystromPreconditioner(k, x, z, 1.0, x.shape[0], Comm())
        torch.cuda.synchronize()
        tb = time.perf_counter() - t0
        ta = cuda_time(lambda: pre(v))
        table.append((f"landmark preconditioner m={m}: build / apply", f"{tb:.2f} s / {ta * 1e3:.1f} ms",
                       f"rank kept {pre.rank}, lambda_max {float(pre.eigenvalues[0]):.3g}"))
        print(table[-1], flush=True)
        del pre, z
    del x, y, v
    torch.cuda.empty_cache()
    if not args.skip_exact:
        r = ex.main(["-N", "100000", "--check-exact", "--n-landmarks", str(args.landmarks[0]),
                     "--max-iter", str(args.max_iter)])
        table.append(("N=1e5 cg (lam 1e-6) vs cholesky", f"cg {r['fit_s']:.2f} s, exact {r['exact_fit_s']:.2f} s",
                      f"{r['n_iter']} it, res {r['residual']:.1e}, MSE {r['test_mse']:.5f} vs exact "
                      f"{r['exact_test_mse']:.5f} ({abs(r['test_mse'] / r['exact_test_mse'] - 1) * 100:.2f}%)"))
        print(table[-1], flush=True)
        torch.cuda.empty_cache()
    for m in args.landmarks:
        r = ex.main(["-N", "1000000", "--n-landmarks", str(m), "--max-iter", str(args.max_iter)])
        table.append((f"N=1e6 cg, {m} landmarks, tol 1e-4", f"{r['fit_s']:.2f} s",
                      f"{r['n_iter']} it, res {r['residual']:.1e}, test MSE {r['test_mse']:.5f}"))
        print(table[-1], flush=True)
        torch.cuda.empty_cache()
    r = ex.main(["-N", "1000000", "--solver", "nystrom", "--n-centers", "20000", "--max-iter", str(args.max_iter)])
    table.append(("N=1e6 nystrom, 20000 centres, tol 1e-4", f"{r['fit_s']:.2f} s",
                  f"{r['n_iter']} it, res {r['residual']:.1e}, test MSE {r['test_mse']:.5f}"))
    print("\n| measurement | time | notes |\n|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
