"""bench/run.py's workloads of the formula kernels on the fused templates (issue 44 items 4-5):

* ``matern_matvec_d3``: kernel_matvec of Matérn 5/2 (the epilogue functor, tuned expanded form) at
  matvec_d3's size (M = N = 10^6, D = 3), beside torch in row blocks and beside the Gaussian's
  kernel_matvec on the same data in the same run (target: <= 1.5x the Gaussian);
* ``custom_kernel``: the same kernel written as an expression (kernel_expression over the squared
  distance: a rendered functor), beside the built-in in the same run (target <= 1.1x), and a new
  expression's first call (SymPy, the limit, the render, NVRTC; target <= 1.5 s with an empty cache);
* ``gp_step_matern``: gp_step (bench/run.py) with ScaleKernel(Matérn 5/2, ARD over D = 8): the
  package's MaternKernel (fused products and backward) beside GPyTorch's MaternKernel at 5 x 10^4,
  ours alone at 10^6.
"""

from __future__ import annotations

import functools
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


def gp_step_matern_rows(bench, add_ratios):
    """gp_step with ScaleKernel(Matérn 5/2, ARD over D = 8): ours (kermac_like.gpytorch.MaternKernel:
    fused products through the Matern52 functor, the fused backward) beside GPyTorch's MaternKernel at
    N = 5 x 10^4 (--quick: 10^4), ours alone at 10^6 (not with --quick)."""
    if bench.device.type != "cuda":
        return []
    try:
        import gpytorch

        from bench._gp import model_step
        from kermac_like.gpytorch import MaternKernel
    except ImportError as e:
        return [dict(workload="gp_step_matern", size="", ours_ms=None, torch_ms=None, kermac_ms=None, error=None,
                     torch_error=None, unit="ms", note=f"skipped: {e}", speedup=None, kermac_speedup=None)]
    dev, D = bench.device, 8
    ours_cls = functools.partial(MaternKernel, nu=2.5, ard_num_dims=D)
    theirs_cls = functools.partial(gpytorch.kernels.MaternKernel, nu=2.5, ard_num_dims=D)

    def data(n):
        x = bench.rand(n, D) * 2 - 1
        return x, torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * bench.randn(n)

    def measure(cls, x, y, reps, warm):
        times, peak, res = [], 0.0, None
        for i in range(warm + reps):
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            try:
                loss, model = model_step(cls, x, y, seed=bench.args.seed)
            except torch.cuda.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                return str(e).split(".")[0]
            torch.cuda.synchronize(dev)
            if i >= warm:
                times.append((time.perf_counter() - t0) * 1e3)
            peak = max(peak, (torch.cuda.max_memory_allocated(dev) - base) / 2**20)
            res = (-loss, model.covar_module.base_kernel.raw_lengthscale.grad.detach().clone())
        return sorted(times)[len(times) // 2], peak, *res

    model_step(ours_cls, *data(4096))  # compile first
    rows = []
    for n, both in ((10_000, True),) if bench.args.quick else ((50_000, True), (1_000_000, False)):
        x, y = data(n)
        ours = measure(ours_cls, x, y, bench.reps(3) if n <= 100_000 else 1, bench.warm(1) if n <= 100_000 else 0)
        if isinstance(ours, str):
            raise RuntimeError(f"gp_step_matern N={n}: {ours}")
        theirs = measure(theirs_cls, x, y, bench.reps(3), bench.warm(1)) if both else None
        note, err, torch_ms = f"peak extra GPU memory: ours {ours[1]:.0f} MB", None, None
        if isinstance(theirs, str):
            note += f"; GPyTorch's MaternKernel: {theirs}"
        elif theirs is not None:
            torch_ms = theirs[0]
            err = float((ours[2] - theirs[2]).abs() / theirs[2].abs())
            gerr = float((ours[3] - theirs[3]).norm() / theirs[3].norm())
            note += (f", GPyTorch's {theirs[1]:.0f} MB; MLL {float(ours[2]):.5f} vs {float(theirs[2]):.5f}, "
                     f"raw-lengthscale (ARD) gradient relative difference {gerr:.1e}")
        r = dict(workload="gp_step_matern", size=f"N={n}, D=8, ScaleKernel(Matern 5/2, ARD), float32",
                 ours_ms=ours[0], torch_ms=torch_ms, kermac_ms=None, error=err, torch_error=None, unit="ms",
                 note="torch column: gpytorch.kernels.MaternKernel(2.5, ARD); " + note, peak_extra_mb=ours[1])
        add_ratios(r)
        rows.append(r)
        del x, y
        torch.cuda.empty_cache()
    return rows
