"""bench/run.py's workloads of the formula kernels on the fused templates (issue 44 items 4-5):

* ``matern_matvec_d3``: kernel_matvec of Matérn 5/2 (the epilogue functor, tuned expanded form) at
  matvec_d3's size (M = N = 10^6, D = 3), beside torch in row blocks and beside the Gaussian's
  kernel_matvec on the same data in the same run (target: <= 1.5x the Gaussian);
* ``custom_kernel``: the same kernel written as an expression (kernel_expression over the squared
  distance: a rendered functor), beside the built-in in the same run (target <= 1.1x), and a new
  expression's first call (SymPy, the limit, the render, NVRTC; target <= 1.5 s with an empty cache);
(``gp_step_matern``, gp_step with ScaleKernel(Matérn 5/2, ARD), is bench/run.py's gp_step_rows.)
"""

from __future__ import annotations

import random
import time

import torch

import kermac_like as km

# Matérn 5/2 of the squared distance r, as a user writes it (h: the bandwidth)
MATERN52_EXPRESSION = "(1 + sqrt(5*r)/h + 5*r/(3*h**2))*exp(-sqrt(5*r)/h)"


def torch_matern52_matvec(x, y, v, bw, block=4096):
    """A user's Matérn 5/2 kernel matvec in torch: row blocks of 4096 (cdist, the formula, matmul)."""
    out = torch.empty(x.shape[0], v.shape[1], dtype=x.dtype, device=x.device)
    s = 5.0 ** 0.5 / bw
    for m0 in range(0, x.shape[0], block):
        t = torch.cdist(x[m0:m0 + block], y).mul_(s)
        k = (1.0 + t + t * t / 3.0) * torch.exp(-t)
        torch.matmul(k, v, out=out[m0:m0 + block])
    return out


def _error(desc, x, y, v, got, r, floor, **kw):
    """max |got - float64| / max(|float64|, floor) over the first r rows (the float64 torch path)."""
    ref = km.kernel_matvec(desc, x[:r].double(), y.double(), v.double(), **kw)
    return float(((got[:r].double() - ref).abs() / ref.abs().clamp_min(floor)).max())


def matern_matvec_rows(bench, time_calls, err_rows: int, floor: float):
    M, N, K = bench.sizes["matvec_d3"]
    bw = bench.spread(K)
    desc, gauss = km.matern(2.5), km.preset("gaussian_l2")
    make = lambda: (*bench.pair(M, N, K), bench.rand(N, 1))  # noqa: E731
    ours = time_calls(lambda x, y, v: km.kernel_matvec(desc, x, y, v, bandwidth=bw), make, bench.device,
                      repeats=bench.reps(), warmup=bench.warm(), keep_last=True)
    x, y, v = ours.last_inputs
    err = _error(desc, x, y, v, ours.last_output, min(err_rows, M), floor, bandwidth=bw)
    terr = _error(desc, x, y, v, torch_matern52_matvec(x[:err_rows], y, v, bw), min(err_rows, M), floor, bandwidth=bw)
    ours.last_inputs = ours.last_output = None
    del x, y, v
    g = time_calls(lambda x, y, v: km.kernel_matvec(gauss, x, y, v, bandwidth=bw), make, bench.device,
                   repeats=bench.reps(), warmup=bench.warm())
    slow = M * N * K > 10**12 and not bench.args.quick
    theirs = time_calls(lambda x, y, v: torch_matern52_matvec(x, y, v, bw), make, bench.device,
                        repeats=1 if slow else bench.reps(3), warmup=0 if slow else bench.warm(1))
    ratio = ours.median_ms / g.median_ms
    note = (f"Gaussian kernel_matvec on the same data {g.median_ms:.4g} ms, Matérn / Gaussian {ratio:.2f} "
            f"(target <= 1.5); torch: row blocks of 4096 (cdist, the formula, matmul); v uniform [0, 1)")
    return [bench.row("matern_matvec_d3", f"{M}x{N}x{K}, C=1, bw={bw:.3g}", ours, theirs, None, err, terr, note,
                      gauss_ms=g.median_ms, vs_gauss=ratio)]


def custom_kernel_rows(bench, time_calls, err_rows: int, floor: float):
    M, N, K = bench.sizes["matvec_d3"]
    bw = bench.spread(K)
    # a new expression's first call: a constant no earlier run used, so that no cache holds its kernel
    c = 1.0 + random.random() * 1e-3
    t0 = time.perf_counter()
    fresh = km.kernel_expression(f"{c!r}*{MATERN52_EXPRESSION}", params=("h",))
    xs = bench.randn(64, K)
    km.kernel_matvec(fresh, xs, xs, bench.rand(64, 1), h=bw)
    if bench.device.type == "cuda":
        torch.cuda.synchronize(bench.device)
    first_s = time.perf_counter() - t0
    desc = km.kernel_expression(MATERN52_EXPRESSION, params=("h",))
    builtin = km.matern(2.5)
    make = lambda: (*bench.pair(M, N, K), bench.rand(N, 1))  # noqa: E731
    ours = time_calls(lambda x, y, v: km.kernel_matvec(desc, x, y, v, h=bw), make, bench.device,
                      repeats=bench.reps(), warmup=bench.warm(), keep_last=True)
    x, y, v = ours.last_inputs
    err = _error(desc, x, y, v, ours.last_output, min(err_rows, M), floor, h=bw)
    ours.last_inputs = ours.last_output = None
    del x, y, v
    b = time_calls(lambda x, y, v: km.kernel_matvec(builtin, x, y, v, bandwidth=bw), make, bench.device,
                   repeats=bench.reps(), warmup=bench.warm())
    ratio = ours.median_ms / b.median_ms
    note = (f"kernel_expression({MATERN52_EXPRESSION!r}) beside km.matern(2.5) {b.median_ms:.4g} ms: "
            f"expression / built-in {ratio:.2f} (target <= 1.1); a new expression's first call "
            f"(parse, render, compile, run at 64 x 64) {first_s:.2f} s (target <= 1.5 s)")
    return [bench.row("custom_kernel", f"{M}x{N}x{K}, C=1", ours, None, None, err, None, note,
                      builtin_ms=b.median_ms, vs_builtin=ratio, first_call_s=first_s)]
