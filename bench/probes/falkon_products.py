"""The two products of a Falkon pass at D = 8 (issue 28): K(x, z) v and K(z, x) u, m = 20 000
centres against a chunk of N rows, in kernel_matvec's float32 and float64 modes; pairs/s of
each, then (``--fit N``) a torch.profiler summary of one nystrom fit (kernel time by name).

    python3 bench/probes/falkon_products.py [--n 10000000] [--fit 10000000]
"""
import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

import kermac_like as km  # noqa: E402
from _timing import time_calls  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--m", type=int, default=20_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--fit", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    g = km.preset("gaussian_l2")
    torch.manual_seed(0)
    x = torch.rand(args.n, args.d, device=dev) * 2 - 1
    z = x[torch.randperm(args.n, device=dev)[:args.m]].contiguous()
    rows = []
    pairs = args.n * args.m
    for mode in ("float32", "float64"):  # fresh v and u for every call (time_calls)
        dt = getattr(torch, mode)
        o1 = torch.empty(args.n, 1, device=dev, dtype=dt)
        o2 = torch.empty(args.m, 1, device=dev, dtype=dt)
        t1 = time_calls(lambda v: km.kernel_matvec(g, x, z, v, out=o1, bandwidth=1.5),
                        lambda: (torch.randn(args.m, 1, device=dev, dtype=dt),), dev, repeats=3, warmup=1,
                        keep_last=True)
        t2 = time_calls(lambda u: km.kernel_matvec(g, z, x, u, out=o2, bandwidth=1.5),
                        lambda: (torch.randn(args.n, 1, device=dev, dtype=dt),), dev, repeats=3, warmup=1)
        v = t1.last_inputs[0]  # error of a few rows against float64
        ref = torch.exp(-torch.cdist(x[:64].double(), z.double()) ** 2 / (2 * 1.5 ** 2)) @ v.double()
        e1 = float(((o1[:64].double() - ref).norm() / ref.norm()))
        for name, t in ((f"K(x,z) v  {mode}", t1.median_ms / 1e3), (f"K(z,x) u  {mode}", t2.median_ms / 1e3)):
            rows.append((name, f"{t * 1e3:9.1f} ms", f"{pairs / t / 1e12:6.2f}e12 pairs/s"))
        rows.append((f"  err K(x,z) v {mode}", f"{e1:.2e}", ""))
        print(rows[-3:], flush=True)
    if args.fit:
        import large_scale_krr as ex
        X, y = ex.make_data(args.fit, args.d, device=dev)
        from kermac_like.solvers import KernelRidge
        est = KernelRidge(kernel="gaussian_l2", bandwidth=1.5, alpha=1e-6 * args.fit, solver="nystrom", n_centers=args.m)
        est.set_params(alpha=1e-6 * 100_000).fit(X[:100_000], y[:100_000]).set_params(alpha=1e-6 * args.fit)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            est.fit(X, y)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=90))
        print("fit_time_", getattr(est, "fit_time_", None), "n_iter_", est.n_iter_)
    print("\n== falkon products (N=%d, m=%d, D=%d) on %s" % (args.n, args.m, args.d, torch.cuda.get_device_name(0)))
    for r in rows:
        print("  ".join(r))


if __name__ == "__main__":
    main()
