"""Falkon (KernelRidge solver="nystrom") at N = 10^6, D = 8, 20 000 centres on float32 data with
kernel_matvec's float64 mode: the residual history with the float32 safety net (a true-residual
check every 10 iterations, stop after three checks without a 10 % gain) and without it (plain
CG, verified at tol), to tell a precision floor from slow convergence.

    python3 bench/probes/falkon_checks.py [N] [centres]      (GPU; history and table last)
"""
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))
import kermac_like as km  # noqa: E402
from kermac_like.solvers import kernel_ridge as kr  # noqa: E402
from large_scale_krr import make_data, make_test  # noqa: E402
from log_capture import captured  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
m = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
dev = "cuda"
X, y = make_data(N, 8, device=dev)
Xt, _, ft = make_test(10_000, 8, device=dev)
ft = ft.double().cpu()
records = captured("kermac_like.solvers", logging.INFO)
orig = kr.pcg
rows = []
for name, force in (("checks (shipped)", None), ("plain CG", "none")):
    def pcg(*a, **kw):
        if force == "none":
            kw["check_every"] = None
        return orig(*a, **kw)
    kr.pcg = pcg
    records.clear()
    est = km.solvers.KernelRidge("gaussian_l2", bandwidth=1.5, alpha=1e-6 * N, solver="nystrom", n_centers=m,
                                 tol=1e-4, max_iter=150, random_state=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    import warnings
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        est.fit(X, y)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    mse = float(((torch.as_tensor(est.predict(Xt)).double().cpu() - ft) ** 2).mean())
    hist = [r for r in records if "residual" in r]
    print(f"== {name}: {t:.2f} s, {est.n_iter_} iterations, residual {est.residual_:.3e}, test MSE {mse:.5f}")
    for r in hist:
        print("   ", r)
    rows.append((name, t, est.n_iter_, est.residual_, mse))
kr.pcg = orig
print("== falkon_checks")
for name, t, it, res, mse in rows:
    print(f"{name:<18} {t:7.2f} s {it:5d} it  residual {res:.3e}  MSE {mse:.5f}")
