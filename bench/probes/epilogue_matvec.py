"""The epilogue functors' open questions in one call (issue 44 items 4-5; bench/notes/epilogue.md):

1. Matérn 5/2 kernel_matvec at D = 3, N = M = 10^6 (matern_matvec_d3) against the Gaussian's on the
   same data: the expanded form with FMA-pipe exponentials for kPolyPairs of a trip's 32 pairs
   (0, 4, 8, 12, 16), untuned, and the direct form; the Matérn 3/2, RQ, Cauchy, IMQ functors; the
   same Matérn written as an expression (custom_kernel). Target: Matérn <= 1.5x Gaussian, the
   expression <= 1.1x the built-in. Error: max relative to max(|value|, 1e-5) on 256 rows vs float64.
2. A new expression's first call with an empty kernel cache, in a fresh process (target <= 1.5 s).
3. The fused backward (gradients for x, y, v) against the torch path's blocked backward at
   N = 5 x 10^4, D = 8, C = 11 (GPyTorch's shape), and its error vs float64.
4. run_kernel of Matérn 5/2 at 50000^2 x 256 on the tensor cores (the functor in the wgmma / mma
   epilogue) against laplace_l2's (target <= 1.2x), and its error vs float64 on 256 rows.

    python bench/probes/epilogue_matvec.py [--n 1000000] [--reps 3] [--skip-backward]

Prints one table per part; no files.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kermac_like as km  # noqa: E402
from kermac_like.runtime.specs import matvec as ms  # noqa: E402
from kermac_like.testing import record_plans  # noqa: E402
from _timing import time_calls  # noqa: E402

EXPR = "(1 + sqrt(5*r)/h + 5*r/(3*h**2))*exp(-sqrt(5*r)/h)"
# name: (FORMULA_EXPAND, FORMULA_TUNING)
MATERN = {
    "expanded_p0": (True, {"unroll_j": 4, "poly_pairs": 0, "prefetch": True}),
    "expanded_p4": (True, {"unroll_j": 4, "poly_pairs": 4, "prefetch": True}),
    "expanded_p8 (shipped)": (None, None),
    "expanded_p12": (True, {"unroll_j": 4, "poly_pairs": 12, "prefetch": True}),
    "expanded_p16": (True, {"unroll_j": 4, "poly_pairs": 16, "prefetch": True}),
    "expanded_untuned": (True, {}),
    "direct": (False, {}),
}
FIRST_CALL = r"""
import time, torch
t0 = time.perf_counter()
import kermac_like as km
t1 = time.perf_counter()
d = km.kernel_expression("1.2345*(1 + sqrt(5*r)/h + 5*r/(3*h**2))*exp(-sqrt(5*r)/h)", params=("h",))
x = torch.randn(64, 3, device="cuda"); v = torch.rand(64, 1, device="cuda")
km.kernel_matvec(d, x, x, v, h=1.0); torch.cuda.synchronize()
t2 = time.perf_counter()
km.kernel_matvec(d, x, x, v, h=1.0); torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.4f}")
"""


def err(desc, x, y, v, got, **kw):
    ref = km.kernel_matvec(desc, x[:256].double(), y.double(), v.double(), **kw)
    return float(((got[:256].double() - ref).abs() / ref.abs().clamp_min(1e-5)).max())


def timed(desc, n, reps, **kw):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda: (torch.randn(n, 3, device="cuda", generator=g), torch.randn(n, 3, device="cuda", generator=g),  # noqa: E731
                    torch.rand(n, 1, device="cuda", generator=g))
    t = time_calls(lambda x, y, v: km.kernel_matvec(desc, x, y, v, **kw), make, torch.device("cuda"), repeats=reps,
                   warmup=1, keep_last=True)
    e = err(desc, *t.last_inputs, t.last_output, **kw)
    return t.median_ms, e


def part1(n, reps):
    print(f"\n## kernel_matvec at D = 3, N = M = {n}, C = 1 (ms; ratio to the Gaussian; max error vs float64)")
    gauss, ge = timed(km.preset("gaussian_l2"), n, reps, bandwidth=1.0)
    print("| kernel | variant | ms | / Gaussian | error |\n|---|---|---|---|---|")
    print(f"| gaussian_l2 | shipped | {gauss:.1f} | 1.00 | {ge:.1e} |")
    builtin = None
    for name, (expand, tuning) in MATERN.items():
        ms.FORMULA_EXPAND = expand
        ms.FORMULA_TUNING = tuning if tuning is not None else dict(DEFAULT)
        t, e = timed(km.matern(2.5), n, reps, bandwidth=1.0)
        if tuning is None:
            builtin = t
        print(f"| matern52 | {name} | {t:.1f} | {t / gauss:.2f} | {e:.1e} |")
    ms.FORMULA_EXPAND, ms.FORMULA_TUNING = None, dict(DEFAULT)
    for d, kw in ((km.matern(1.5), {"bandwidth": 1.0}), (km.rational_quadratic(), {"bandwidth": 1.0, "alpha": 1.5}),
                  (km.cauchy(), {"bandwidth": 1.0}), (km.inverse_multiquadric(), {"bandwidth": 1.0}),
                  (km.powered_exponential(), {"bandwidth": 1.0, "q": 1.5})):
        t, e = timed(d, n, reps, **kw)
        print(f"| {d.family} | shipped | {t:.1f} | {t / gauss:.2f} | {e:.1e} |")
    t, e = timed(km.kernel_expression(EXPR, params=("h",)), n, reps, h=1.0)
    print(f"| expression (Matérn 5/2) | shipped | {t:.1f} | {t / gauss:.2f} | {e:.1e} |")
    print(f"\nexpression / built-in Matérn 5/2: {t / builtin:.2f} (target <= 1.1)")


def part2():
    print("\n## a new expression's first call, fresh process, empty cache (s)")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=d, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-2000:])
        return
    imp, first, second = (float(s) for s in out.stdout.split())
    print("| import kermac_like | first call (expression, render, NVRTC, run) | second call |\n|---|---|---|")
    print(f"| {imp:.2f} | {first:.2f} (target <= 1.5) | {second * 1e3:.2f} ms |")


def part3(reps):
    print("\n## backward of kernel_matvec (Matérn 5/2), N = 5e4, D = 8, C = 11 (ms; error vs float64)")
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 50_000
    x = torch.rand(n, 8, device="cuda", generator=g) * 2 - 1
    v = torch.randn(n, 11, device="cuda", generator=g)
    w = torch.randn(n, 11, device="cuda", generator=g)
    d = km.matern(2.5)

    def run(bw):
        xl, vl = x.clone().requires_grad_(True), v.clone().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gx, gv = torch.autograd.grad((km.kernel_matvec(d, xl, xl, vl, bandwidth=bw) * w).sum(), (xl, vl))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, gx, gv

    run(1.0)
    fused = sorted(run(1.0)[0] for _ in range(reps))[reps // 2]
    _, gx, gv = run(1.0)
    bw_t = torch.tensor(1.0, device="cuda", requires_grad=True)  # a hyper-parameter gradient: the torch path
    torch_ms = run(bw_t)[0]
    xl, vl = x.double().requires_grad_(True), v.double().requires_grad_(True)
    rx, rv = torch.autograd.grad((km.kernel_matvec(d, xl, xl, vl, bandwidth=1.0) * w.double()).sum(), (xl, vl))
    ex = float((gx.double() - rx).abs().max() / rx.abs().max())
    ev = float((gv.double() - rv).abs().max() / rv.abs().max())
    print("| fused forward + backward | torch path | gx error | gv error |\n|---|---|---|---|")
    print(f"| {fused:.1f} | {torch_ms:.1f} | {ex:.1e} | {ev:.1e} |")


def part4(reps):
    print("\n## run_kernel 50000^2 x 256 (ms; ratio to laplace_l2; error vs float64 on 256 rows)")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(50_000, 256, device="cuda", generator=g)
    bw = 16.0
    rows = [("laplace_l2", km.preset("laplace_l2"), {"bandwidth": bw}), ("matern52", km.matern(2.5), {"bandwidth": bw}),
            ("expression (Matérn 5/2)", km.kernel_expression(EXPR, params=("h",)), {"h": bw}),
            ("rational_quadratic", km.rational_quadratic(), {"bandwidth": bw, "alpha": 1.5})]
    print("| kernel | ms | / laplace | error | plan |\n|---|---|---|---|---|")
    base = None
    for name, d, kw in rows:
        with record_plans() as plans:
            out = km.run_kernel(d, x, x, **kw)
        torch.cuda.synchronize()
        t = time_calls(lambda a: km.run_kernel(d, a, a, **kw), lambda: (x,), torch.device("cuda"), repeats=reps,
                       warmup=1).median_ms
        base = base or t
        ref = km.run_kernel(d, x[:256].double(), x.double(), **kw)
        e = float(((out[:256].double() - ref).abs() / ref.abs().clamp_min(1e-5)).max())
        print(f"| {name} | {t:.1f} | {t / base:.2f} | {e:.1e} | {plans.families[-1]} |")
        del out


DEFAULT = dict(ms.FORMULA_TUNING)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-backward", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    part2()  # first: nothing of this process warms the cache it uses
    part1(args.n, args.reps)
    part4(args.reps)
    if not args.skip_backward:
        part3(args.reps)
