"""Benchmark kermac_like.linalg against torch.linalg on SPD Laplace kernel matrices.

    python bench/bench_linalg.py                       # L=10, N=5000, C=16 on cuda
    python bench/bench_linalg.py --device cpu -N 300   # smoke test

``bench_linalg(device, ...)`` returns one dict per workload with the medians
of the timings (CUDA events on a GPU, perf_counter on a CPU), each iteration on
freshly generated matrices:

    workload     "solve_cholesky L=10 N=5000 C=16 float32", ...
    ours_ms      kermac_like.linalg (default options: inputs untouched)
    torch_ms     torch.linalg.cholesky + torch.cholesky_solve / torch.linalg.solve /
                 torch.linalg.eigh on the same data
    error        ours: max relative residual ||A x - b|| / ||b|| (solves) or
                 ||A V - V diag(w)|| / ||A|| (eigh), in float64
    torch_error  the same for torch.linalg
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch


def _linalg():
    try:
        from kermac_like import linalg
    except ImportError:  # running from a source checkout without installing
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from kermac_like import linalg
    return linalg


def laplace_matrices(L, n, dtype, device, generator, d=8, bandwidth=1.0, reg=1e-2):
    """(L, n, n) SPD Laplace kernel matrices exp(-||x_i - x_j|| / bw) + reg I."""
    x = torch.randn(L, n, d, device=device, dtype=dtype, generator=generator)
    k = torch.exp(-torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / bandwidth)
    k.diagonal(dim1=-2, dim2=-1).add_(reg)
    return k


def _solve_error(a, x, b):
    worst = 0.0
    for i in range(a.shape[0]):  # one entry at a time keeps float64 copies small
        r = x[i].double() @ a[i].double().mT - b[i].double()
        worst = max(worst, (r.norm() / b[i].double().norm()).item())
    return worst


def _eigh_error(a, w, v):
    worst = 0.0
    for i in range(a.shape[0]):
        ai, vi = a[i].double(), v[i].double()
        r = ai @ vi - vi * w[i].double()
        worst = max(worst, (r.norm() / ai.norm()).item())
    return worst


class _Timer:
    """Times one call with CUDA events (GPU) or perf_counter (CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3


def bench_linalg(device="cuda", L=10, N=5000, C=16, warmup=3, iters=10, dtype=torch.float32,
                 eigh_iters=None, seed=0) -> list[dict]:
    """Median timings of solve_cholesky, solve_lu and eigh vs torch.linalg.

    ``eigh`` is ~1.5 s per call at the default size, so it runs
    ``eigh_iters`` (default ``min(iters, 3)``) timed and one warm-up iteration.
    """
    linalg = _linalg()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)
    timer = _Timer(device)
    if eigh_iters is None:
        eigh_iters = max(1, min(iters, 3))
    tag = f"L={L} N={N} C={C} {str(dtype).replace('torch.', '')}"

    def torch_cholesky(a, b):
        return torch.cholesky_solve(b.mT, torch.linalg.cholesky(a)).mT

    workloads = [
        ("solve_cholesky", lambda a, b: linalg.solve_cholesky(a, b)[0], torch_cholesky,
         _solve_error, warmup, iters),
        ("solve_lu", lambda a, b: linalg.solve_lu(a, b)[0], lambda a, b: torch.linalg.solve(a, b.mT).mT,
         _solve_error, warmup, iters),
        ("eigh", lambda a, b: linalg.eigh(a)[:2], lambda a, b: torch.linalg.eigh(a),
         lambda a, b, out: _eigh_error(a, *out), min(warmup, 1), eigh_iters),
    ]

    rows = []
    for name, ours, theirs, error, n_warm, n_iter in workloads:
        ours_ms, torch_ms = [], []
        err = torch_err = float("nan")
        for it in range(n_warm + n_iter):
            a = laplace_matrices(L, N, dtype, device, gen)
            b = torch.randn(L, C, N, device=device, dtype=dtype, generator=gen)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out_ours, t_ours = timer(lambda: ours(a, b))
            out_torch, t_torch = timer(lambda: theirs(a, b))
            if it >= n_warm:
                ours_ms.append(t_ours)
                torch_ms.append(t_torch)
            if it == n_warm + n_iter - 1:
                if name == "eigh":
                    err, torch_err = error(a, b, out_ours), error(a, b, out_torch)
                else:
                    err, torch_err = error(a, out_ours, b), error(a, out_torch, b)
            del out_ours, out_torch, a, b
        rows.append({
            "workload": f"{name} {tag}",
            "ours_ms": statistics.median(ours_ms),
            "torch_ms": statistics.median(torch_ms),
            "error": err,
            "torch_error": torch_err,
        })
    return rows


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="kermac_like.linalg vs torch.linalg")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("-L", type=int, default=10)
    p.add_argument("-N", type=int, default=5000)
    p.add_argument("-C", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    rows = bench_linalg(args.device, L=args.L, N=args.N, C=args.C, warmup=args.warmup,
                        iters=args.iters, dtype=getattr(torch, args.dtype))
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, total {time.perf_counter() - t0:.1f} s")
    print("| workload | ours (ms) | torch (ms) | speed-up | error ours | error torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['ours_ms']:.1f} | {r['torch_ms']:.1f} | "
              f"{r['torch_ms'] / r['ours_ms']:.2f}x | {r['error']:.1e} | {r['torch_error']:.1e} |")


if __name__ == "__main__":
    main()
