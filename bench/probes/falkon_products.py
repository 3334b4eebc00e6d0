"""The two products of a Falkon pass at D = 8 (issue 28): K(x, z) v and K(z, x) u, m = 20 000
centres against a chunk of N rows, in kernel_matvec's float32 mode, float64 mode and blocked float64
mode (float32 partials of --group points), and plan.falkon's tensor-core products (mma: what the nystrom
solver runs by default for the Gaussian kernel); time (CUDA
events, median of --repeats after a warm-up) and pairs/s of each, the error of each mode's outputs
against the float64 mode's on one fixed v and u (relative 2-norm, and the largest difference over
K |v|, the blocked mode's bound being (group + 1) 2^-24), the float32 mode's also against float64
arithmetic on 64 rows; then (``--fit N``) a torch.profiler summary of one nystrom fit.

    python3 bench/probes/falkon_products.py [--n 10000000] [--modes float32 float64 blocked] [--group 8]
        [--fit 10000000]
"""
import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

import kermac_like as km  # noqa: E402
from kermac_like.ops import matvec as mv  # noqa: E402
from kermac_like.runtime.specs import matvec as ms  # noqa: E402
from _timing import time_calls  # noqa: E402

BW = 1.5


PAIRS = {}


def product(mode, g, a, b, w, out):
    """K(a, b) w into out in one of the modes (blocked: kernel_matvec's internal flag, as the solver before;
    mma: plan.falkon's tensor-core products, as the solver now; b or a is the centres)."""
    if mode == "mma":
        from kermac_like.plan.falkon import FalkonProducts
        z = b if b.shape[0] < a.shape[0] else a
        fp = PAIRS.get(id(z)) or PAIRS.setdefault(id(z), FalkonProducts(z, BW))
        return fp.rows(a, w, out=out) if z is b else fp.cols(b, w, out=out)
    if mode == "blocked":
        return mv.matvec_f32_partials(g, a, b, w, out=out, bandwidth=BW)
    return km.kernel_matvec(g, a, b, w, out=out, bandwidth=BW)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--m", type=int, default=20_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--modes", nargs="*", default=["float32", "float64", "blocked", "mma"])
    ap.add_argument("--group", type=int, default=ms.F32_GROUP, help="kF32Group of the blocked mode (8, 16, 32)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fit", type=int, default=0)
    args = ap.parse_args()
    ms.F32_GROUP = args.group
    dev = torch.device("cuda", 0)
    g = km.preset("gaussian_l2")
    torch.manual_seed(0)
    x = torch.rand(args.n, args.d, device=dev) * 2 - 1
    z = x[torch.randperm(args.n, device=dev)[:args.m]].contiguous()
    pairs = args.n * args.m
    gen = torch.Generator(device=dev).manual_seed(1)
    v0 = torch.randn(args.m, 1, device=dev, dtype=torch.float64, generator=gen)  # the error's fixed inputs
    u0 = torch.randn(args.n, 1, device=dev, dtype=torch.float64, generator=gen)
    mag1 = km.kernel_matvec(g, x, z, v0.abs(), out=torch.empty(args.n, 1, device=dev, dtype=torch.float64),
                            bandwidth=BW)
    mag2 = km.kernel_matvec(g, z, x, u0.abs(), out=torch.empty(args.m, 1, device=dev, dtype=torch.float64),
                            bandwidth=BW)
    ref1 = km.kernel_matvec(g, x, z, v0, out=torch.empty_like(mag1), bandwidth=BW)  # the float64 mode
    ref2 = km.kernel_matvec(g, z, x, u0, out=torch.empty_like(mag2), bandwidth=BW)
    rows = []
    for mode in args.modes:
        dt = torch.float32 if mode == "float32" else torch.float64
        o1 = torch.empty(args.n, 1, device=dev, dtype=dt)
        o2 = torch.empty(args.m, 1, device=dev, dtype=dt)
        t1 = time_calls(lambda v: product(mode, g, x, z, v, o1),
                        lambda: (torch.randn(args.m, 1, device=dev, dtype=dt),), dev, repeats=args.repeats,
                        warmup=1, keep_last=True)
        v = t1.last_inputs[0]
        ref = torch.exp(-torch.cdist(x[:64].double(), z.double()) ** 2 / (2 * BW ** 2)) @ v.double()
        e64 = float(((o1[:64].double() - ref).norm() / ref.norm()))
        t2 = time_calls(lambda u: product(mode, g, z, x, u, o2),
                        lambda: (torch.randn(args.n, 1, device=dev, dtype=dt),), dev, repeats=args.repeats, warmup=1)
        errs = []
        for a, b, w, o, r, mag in ((x, z, v0, o1, ref1, mag1), (z, x, u0, o2, ref2, mag2)):
            product(mode, g, a, b, w.to(dt), o)
            d = o.double() - r
            errs.append(f"{float(d.norm() / r.norm()):.2e} / {float((d.abs() / mag).max()) / 2 ** -24:.2f} u")
        name = f"blocked (G={args.group})" if mode == "blocked" else "mma (G=8)" if mode == "mma" else mode
        for which, t, e in (("K(x,z) v", t1.median_ms, errs[0]), ("K(z,x) u", t2.median_ms, errs[1])):
            rows.append(f"{name:15s} {which}  {t:9.1f} ms  {pairs / t / 1e9:6.2f}e12 pairs/s   vs float64 mode: {e}")
        rows.append(f"{name:15s} K(x,z) v on 64 rows vs float64 arithmetic: {e64:.2e}")
        print("\n".join(rows[-3:]), flush=True)
    if args.fit:
        import large_scale_krr as ex
        X, y = ex.make_data(args.fit, args.d, device=dev)
        from kermac_like.solvers import KernelRidge
        est = KernelRidge(kernel="gaussian_l2", bandwidth=BW, alpha=1e-6 * args.fit, solver="nystrom", n_centers=args.m)
        est.set_params(alpha=1e-6 * 100_000).fit(X[:100_000], y[:100_000]).set_params(alpha=1e-6 * args.fit)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            est.fit(X, y)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=90))
        print("fit_time_", getattr(est, "fit_time_", None), "n_iter_", est.n_iter_)
    print("\n== falkon products (N=%d, m=%d, D=%d) on %s; error: relative 2-norm / max |diff| over K|w|"
          % (args.n, args.m, args.d, torch.cuda.get_device_name(0)))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
