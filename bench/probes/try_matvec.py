"""kernel_matvec probe: the Gaussian matvec at D = 3 (N = M = 10^6) with each exponential
split (kPolyRows 0 or 1 of 8 rows on the FMA pipe), D = 256 (N = M = 2e5, C = 1 and 16), and
the Laplace-l2 generic path; CUDA-event medians on fresh data, error vs float64 on sampled
rows, peak extra memory. Prints a table last.

    python bench/probes/try_matvec.py [--n 1000000] [--reps 3] [--only d3,d256,laplace]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from kermac_like import matvec as mv  # noqa: E402
from kermac_like.runtime.specs import matvec as ms  # noqa: E402


def timed(fn, make, reps):
    times, out, args = [], None, None
    for i in range(reps + 1):
        out = args = None
        args = make()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn(*args)
        b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b))
    return statistics.median(times), args, out


def error(desc, x, y, v, out, rows, **h):
    idx = torch.randperm(x.shape[0], device=x.device)[:rows]
    call = mv.prepare_matvec(desc, x[idx].double(), y.double(), v.double(), **h)
    ref = mv.matvec_reference(call)
    o = out[idx].double()
    return ((o - ref).norm() / ref.norm()).item(), ((o - ref).abs() / ref.abs()).max().item()


def peak_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--n256", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="d3,d256,laplace")
    args = ap.parse_args()
    only = args.only.split(",")
    dev = torch.device("cuda")
    g = km.preset("gaussian_l2")
    rows = []
    if "d3" in only:
        N = args.n
        for poly in (1, 0):
            ms.POLY_ROWS = poly
            make = lambda: (torch.randn(N, 3, device=dev), torch.randn(N, 3, device=dev), torch.rand(N, 1, device=dev))  # noqa: E731
            t, (x, y, v), out = timed(lambda x, y, v: km.kernel_matvec(g, x, y, v, bandwidth=1.0), make, args.reps)
            fro, mx = error(g, x, y, v, out, 256, bandwidth=1.0)
            pk = peak_mb(lambda: km.kernel_matvec(g, x, y, v, bandwidth=1.0, out=out))
            rows.append((f"gauss d3 poly_rows={poly}", f"{N}^2 C=1", t, fro, mx, pk))
            del x, y, v, out
        ms.POLY_ROWS = 1
        # a clustered cloud (points sorted along a curve: CTA tiles are spatially local)
        make = lambda: (torch.rand(N, 1, device=dev).sort(0).values * torch.ones(1, 3, device=dev) + 0.01 * torch.randn(N, 3, device=dev),  # noqa: E731
                        torch.rand(N, 3, device=dev), torch.rand(N, 1, device=dev))
        t, (x, y, v), out = timed(lambda x, y, v: km.kernel_matvec(g, x, y, v, bandwidth=0.1), make, args.reps)
        fro, mx = error(g, x, y, v, out, 256, bandwidth=0.1)
        rows.append(("gauss d3 sorted x, bw=0.1", f"{N}^2 C=1", t, fro, mx, None))
        del x, y, v, out
    if "laplace" in only:
        N = args.n // 2
        d = km.preset("laplace_l2")
        make = lambda: (torch.randn(N, 3, device=dev), torch.randn(N, 3, device=dev), torch.rand(N, 1, device=dev))  # noqa: E731
        t, (x, y, v), out = timed(lambda x, y, v: km.kernel_matvec(d, x, y, v, bandwidth=1.0), make, args.reps)
        fro, mx = error(d, x, y, v, out, 128, bandwidth=1.0)
        rows.append(("laplace_l2 d3 (generic)", f"{N}^2 C=1", t, fro, mx, None))
        del x, y, v, out
    if "d256" in only:
        N = args.n256
        for C in (1, 16):
            make = lambda: (torch.randn(N, 256, device=dev), torch.randn(N, 256, device=dev), torch.rand(N, C, device=dev))  # noqa: E731
            t, (x, y, v), out = timed(lambda x, y, v: km.kernel_matvec(g, x, y, v, bandwidth=16.0), make,
                                      max(1, args.reps - 1))
            fro, mx = error(g, x, y, v, out, 64, bandwidth=16.0)
            rows.append((f"gauss d256 C={C} (chunked SIMT)", f"{N}^2 C={C}", t, fro, mx, None))
            del x, y, v, out
    print(f"\n{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"| case | size | ms | rel Frobenius err | max row rel err | peak extra MB |")
    print("|---|---|---|---|---|---|")
    for name, size, t, fro, mx, pk in rows:
        print(f"| {name} | {size} | {t:.1f} | {fro:.2e} | {mx:.2e} | {'' if pk is None else f'{pk:.1f}'} |")


if __name__ == "__main__":
    main()
