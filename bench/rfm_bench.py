"""The rfm workload (issue 45): Recursive Feature Machines, kermac_like.rfm beside xRFM in the same run.

    python bench/rfm_bench.py [--quick] [--rows l2_20k,product_20k,...] [--repeats N]
    python bench/run.py --only rfm             # the same rows in the benchmark table

Data: y = x0 x1 + sin(2 x2) + 0.5 [x3 > 0] + 0.1 noise, Gaussian features (float32 on the device);
a validation set of 4000 rows (xRFM's early stopping and best-iteration pick; ours takes it as
eval_set) and a test set of 10 000. Every model: bandwidth 10, reg 1e-3, exponent 1. Columns per
row: fit seconds (host clock around fit after a device synchronisation, kernels compiled by a small
warm-up fit first; the fastest of ``repeats`` fits), test NMSE (mean squared error / variance of the
test targets), peak GPU memory (torch.cuda.max_memory_allocated from a reset before the fit, the
data included).

Rows: the four of the issue's table (l2 Laplace 20 000 x 50, product Laplace 20 000 x 50, lpq
p = 1.5 20 000 x 50, l2 Laplace 50 000 x 100 with 3 iterations; xRFM's RFM leaf with torch
kernels and with Kermac where importable), n = 2 x 10^5 (ours: Falkon; xRFM: its tree of leaves),
n = 10^6 (ours alone), and the AGOP alone against one kernel_matvec of the same size with d + 1
columns (n = 20 000, d = 50, one output).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from kermac_like.rfm import RFMRegressor, agop_sum, resolve_rfm_kernel  # noqa: E402

BANDWIDTH, REG = 10.0, 1e-3
N_VAL, N_TEST = 4000, 10000
# name -> (kernel, norm_p, n, d, iters, xRFM's model: "leaf" | "tree" | None)
ROWS = {
    "l2_20k": ("laplace_l2", 2.0, 20_000, 50, 5, "leaf"),
    "product_20k": ("product_laplace", 2.0, 20_000, 50, 5, "leaf"),
    "lpq_20k": ("lpq", 1.5, 20_000, 50, 5, "leaf"),
    "l2_50k": ("laplace_l2", 2.0, 50_000, 100, 3, "leaf"),
    "l2_200k": ("laplace_l2", 2.0, 200_000, 50, 5, "tree"),
    "l2_1m": ("laplace_l2", 2.0, 1_000_000, 50, 5, None),
}
QUICK = {"l2_20k": (2000, 20), "product_20k": (2000, 20), "lpq_20k": (2000, 20), "l2_50k": (3000, 30),
         "l2_200k": (6000, 20), "l2_1m": (8000, 20)}
XRFM_KERNEL = {"laplace_l2": "l2", "product_laplace": "l1", "lpq": "lpq"}


def make_task(n, d, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=g)
    y = x[:, 0] * x[:, 1] + torch.sin(2 * x[:, 2]) + 0.5 * (x[:, 3] > 0) + 0.1 * torch.randn(n, device=device,
                                                                                          generator=g)
    return x, y


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device):
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def nmse(pred, y):
    pred = torch.as_tensor(pred).reshape(-1).to(y.device, torch.float64)
    y = y.to(torch.float64)
    return float(((pred - y) ** 2).mean() / y.var())


def timed(fit, device, repeats):
    """(seconds of the fastest of ``repeats`` calls, its model, peak GB of that call)."""
    best = None
    for _ in range(max(1, repeats)):
        _fresh(device)
        t0 = time.perf_counter()
        model = fit()
        sync(device)
        dt = time.perf_counter() - t0
        peak = _peak_gb(device)
        if best is None or dt < best[0]:
            best = (dt, model, peak)
        del model
    return best


# -- the fits ----------------------------------------------------------------------------------------
def ours(kernel, norm_p, iters, data, device):
    x, y, xv, yv = data
    return RFMRegressor(kernel, bandwidth=BANDWIDTH, norm_p=norm_p, reg=REG, iters=iters, device=device,
                        random_state=0).fit(x, y, eval_set=(xv, yv))


def xrfm_modules():
    """(xRFM's RFM module, the xRFM tree class) or None where xRFM is not importable."""
    try:
        from xrfm import xRFM
        from xrfm.rfm_src import recursive_feature_machine as rfm_mod
    except Exception:  # noqa: BLE001  (not installed, or a broken install)
        return None
    return rfm_mod, xRFM


class _KermacSwitch:
    """xRFM picks its Kermac kernels when the module-level ``kermac`` is set: off for the torch column."""

    def __init__(self, rfm_mod, on):
        self.mod, self.on = rfm_mod, on

    def __enter__(self):
        self.saved = self.mod.kermac
        if not self.on:
            self.mod.kermac = None

    def __exit__(self, *exc):
        self.mod.kermac = self.saved


def xrfm_fit(kind, kernel, norm_p, iters, data, device, use_kermac):
    rfm_mod, xRFM = xrfm_modules()
    x, y, xv, yv = data
    model_params = dict(kernel=XRFM_KERNEL[kernel], bandwidth=BANDWIDTH, exponent=1.0, norm_p=norm_p, diag=False,
                        bandwidth_mode="constant")
    with _KermacSwitch(rfm_mod, use_kermac):
        if kind == "leaf":
            m = rfm_mod.RFM(**model_params, iters=iters, device=device, verbose=False, tuning_metric="mse")
            m.fit((x, y[:, None]), (xv, yv[:, None]), iters=iters, reg=REG, verbose=False)
            return m
        params = dict(model=model_params, fit=dict(reg=REG, iters=iters, return_best_params=True, verbose=False))
        m = xRFM(rfm_params=params, device=device, tuning_metric="mse", verbose=False)
        m.fit(x, y, xv, yv)
        return m


def xrfm_has_kermac():
    mods = xrfm_modules()
    return mods is not None and mods[0].kermac is not None


# -- rows ------------------------------------------------------------------------------------------
def fit_row(name, device, quick=False, repeats=1, log=print):
    kernel, norm_p, n, d, iters, xkind = ROWS[name]
    if quick:
        n, d = QUICK[name]
    x, y = make_task(n, d, device, 1)
    xv, yv = make_task(N_VAL if not quick else 500, d, device, 2)
    xt, yt = make_task(N_TEST if not quick else 1000, d, device, 3)
    data = (x, y, xv, yv)
    size = f"{kernel}{' p=' + str(norm_p) if kernel == 'lpq' else ''}, {n} x {d}, {iters} iterations"
    row = dict(workload="rfm", size=size, unit="ms", ours_ms=None, torch_ms=None, kermac_ms=None, error=None,
               torch_error=None, kermac_error=None, ours_peak_gb=None, torch_peak_gb=None, kermac_peak_gb=None,
               note="error columns: test NMSE", speedup=None, kermac_speedup=None)
    small = tuple(t[:min(n, 500)] for t in data)
    ours(kernel, norm_p, 1, small, device)  # the kernels compiled before the clock starts
    dt, model, peak = timed(lambda: ours(kernel, norm_p, iters, data, device), device, repeats)
    row.update(ours_ms=dt * 1e3, error=nmse(model.predict(xt), yt), ours_peak_gb=peak,
               ours_solver=model.solver_, ours_best_iter=model.best_iter_,
               ours_seconds_per_iter=[round(h["seconds"], 4) for h in model.history_])
    del model
    log(f"  ours: {dt:.3f} s, NMSE {row['error']:.4f}, peak {peak if peak is None else round(peak, 2)} GB, "
        f"solver {row['ours_solver']}")
    if xkind is not None and xrfm_modules() is not None:
        for col, use_kermac in (("torch", False), ("kermac", True)):
            if use_kermac and not xrfm_has_kermac():
                row["note"] += "; xRFM with Kermac: Kermac not importable"
                continue
            try:
                xrfm_fit(xkind, kernel, norm_p, 1, small, device, use_kermac)  # Kermac's JIT before the clock
                dt_x, mx, peak_x = timed(lambda: xrfm_fit(xkind, kernel, norm_p, iters, data, device, use_kermac),
                                         device, repeats)
                row[f"{col}_ms"] = dt_x * 1e3
                row[f"{col}_error"] = nmse(mx.predict(xt), yt)
                row[f"{col}_peak_gb"] = peak_x
                del mx
                log(f"  xRFM ({col} kernels{', tree' if xkind == 'tree' else ''}): {dt_x:.3f} s, "
                    f"NMSE {row[f'{col}_error']:.4f}, peak {peak_x if peak_x is None else round(peak_x, 2)} GB")
            except Exception as e:  # noqa: BLE001  (xRFM's own failure, e.g. out of memory: recorded, not fatal)
                row["note"] += f"; xRFM ({col}) failed: {type(e).__name__}: {str(e)[:200]}"
                log(f"  xRFM ({col}) failed: {type(e).__name__}: {e}")
    elif xkind is not None:
        row["note"] += "; xRFM not importable"
    for col in ("torch", "kermac"):
        if row[f"{col}_ms"]:
            row["speedup" if col == "torch" else "kermac_speedup"] = row[f"{col}_ms"] / row["ours_ms"]
    return row


def _event_ms(fn, device, repeats=5, warm=2):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def agop_row(device, quick=False, log=print):
    """The AGOP of one output at n = 20 000, d = 50 (l2 Laplace, bandwidth 10) against one
    kernel_matvec of the same kernel and size with d + 1 columns."""
    n, d = (2000, 20) if quick else (20_000, 50)
    x, y = make_task(n, d, device, 4)
    coef = torch.randn(n, 1, device=device) / n ** 0.5
    kern = resolve_rfm_kernel("laplace_l2", 1.0, 2.0)
    v = torch.randn(n, d + 1, device=device)
    desc = km.preset("laplace_l2")
    agop_ms = _event_ms(lambda: agop_sum(kern, BANDWIDTH, x, coef, x), device)
    mv_ms = _event_ms(lambda: km.kernel_matvec(desc, x, x, v, bandwidth=BANDWIDTH), device)
    # the previous version (weights written per block, then cdist_grad) beside it, for the notes
    old_ms = _event_ms(lambda: agop_sum(kern, BANDWIDTH, x, coef, x, contraction=False), device)
    log(f"  AGOP {agop_ms:.3f} ms (written weights: {old_ms:.3f} ms), kernel_matvec with {d + 1} columns "
        f"{mv_ms:.3f} ms: {agop_ms / mv_ms:.2f}x")
    return dict(workload="rfm", size=f"AGOP alone, laplace_l2, n={n}, d={d}, 1 output", unit="ms", ours_ms=agop_ms,
                torch_ms=None, kermac_ms=None, error=None, torch_error=None, matvec_ms=mv_ms,
                ratio_to_matvec=agop_ms / mv_ms, speedup=None, kermac_speedup=None,
                note=f"kernel_matvec(laplace_l2, n x n, {d + 1} columns) {mv_ms:.3f} ms; target <= 1.2x; "
                     f"written-weights AGOP {old_ms:.3f} ms")


def rfm_rows(device, quick=False, rows=None, repeats=1, log=print):
    """Every row (or those named); a row that fails is reported in its note and the others still run."""
    out = []
    for name in (rows or list(ROWS) + ["agop"]):
        log(f"rfm {name}:")
        try:
            out.append(agop_row(device, quick, log) if name == "agop" else fit_row(name, device, quick, repeats, log))
        except Exception as e:  # noqa: BLE001
            log(f"  FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
            out.append(dict(workload="rfm", size=name, unit="ms", ours_ms=None, torch_ms=None, kermac_ms=None,
                            error=None, torch_error=None, speedup=None, kermac_speedup=None,
                            note=f"failed: {type(e).__name__}: {str(e)[:300]}"))
        _fresh(device)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--rows", default=None, help=f"comma-separated subset of {', '.join(list(ROWS) + ['agop'])}")
    ap.add_argument("--repeats", type=int, default=1, help="fits per measurement (the fastest is reported)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows = rfm_rows(device, args.quick, args.rows.split(",") if args.rows else None, args.repeats)
    for r in rows:
        print(r)
    return rows


if __name__ == "__main__":
    main()
