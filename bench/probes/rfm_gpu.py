"""GPU probe of kermac_like.rfm (issue 45): correctness against float64, then the target rows.

    PYTHONPATH=. python3 bench/probes/rfm_gpu.py [--quick] [--rows l2_20k,...] [--skip-checks]

Prints, each as soon as it is measured (a failing row prints its error and the probe goes on):

1. checks: the AGOP of every kernel (float32, fused cdist_grad path, blocks of 1 MiB) against the
   float64 CPU path on n = 3000 centres, 1000 points (400 of them centres), D = 24, 3 outputs:
   relative Frobenius error (expect <= 1e-4); a fit on the GPU (float32) against the same fit on
   the CPU in float64, n = 3000, D = 16, 3 iterations: M_ and predictions, relative (expect <= 1e-3).
2. rows (bench/rfm_bench.py): fit seconds, test NMSE and peak GPU memory of ours and of xRFM (torch
   kernels; with Kermac where importable) for l2 Laplace / product Laplace / lpq p = 1.5 at
   20 000 x 50 (5 iterations), l2 50 000 x 100 (3 iterations), l2 2 x 10^5 x 50 (ours Falkon, xRFM its
   tree), l2 10^6 x 50 (ours alone), and the AGOP against kernel_matvec with d + 1 columns.
   Targets: NMSE <= xRFM's + 2 %; fit <= 0.35 / 2.9 / 2.1 / 1.8 s; <= 4 GB at 20 000 x 50;
   2 x 10^5: >= 5x faster than xRFM; 10^6: <= 60 s, <= 16 GB; AGOP <= 1.2x the matvec.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import rfm_bench  # noqa: E402

from kermac_like.rfm import RFMRegressor, agop_sum, resolve_rfm_kernel  # noqa: E402

KERNELS = [("laplace_l2", 1.0, 2.0), ("product_laplace", 1.0, 2.0), ("lpq", 1.0, 1.5), ("gaussian", 1.0, 2.0),
           ("lpq", 0.8, 1.3)]


def say(*a):
    print(*a, flush=True)


def check_agop(device):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3000, 24, generator=g, dtype=torch.float64) + 2.0
    v = torch.cat([torch.randn(600, 24, generator=g, dtype=torch.float64) + 2.0, u[:400]])
    coef = torch.randn(3000, 3, generator=g, dtype=torch.float64) / 50
    for name, q, p in KERNELS:
        try:
            kern = resolve_rfm_kernel(name, q, p)
            want = agop_sum(kern, 6.0, u, coef, v)
            t0 = time.perf_counter()
            got = agop_sum(kern, 6.0, u.float().to(device), coef.float().to(device), v.float().to(device),
                           block_bytes=1 << 20)
            torch.cuda.synchronize(device)
            err = float((got.cpu() - want).norm() / want.norm())
            diag = agop_sum(kern, 6.0, u.float().to(device), coef.float().to(device), v.float().to(device),
                            diag=True)
            err_d = float((diag.cpu() - want.diagonal()).norm() / want.diagonal().norm())
            say(f"check agop {name} q={q} p={p}: relative error {err:.2e} (diag {err_d:.2e}) "
                f"[{'ok' if max(err, err_d) <= 1e-4 else 'ABOVE 1e-4'}] ({time.perf_counter() - t0:.2f} s)")
        except Exception as e:  # noqa: BLE001
            say(f"check agop {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")


def check_fit(device):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 16))
    y = x[:, 0] * x[:, 1] + np.sin(2 * x[:, 2]) + 0.05 * rng.standard_normal(3000)
    xt = rng.standard_normal((500, 16))
    for name, q, p in KERNELS[:3]:
        try:
            kw = dict(kernel=name, exponent=q, norm_p=p, bandwidth=8.0, iters=3)
            cpu = RFMRegressor(**kw).fit(x, y)
            gpu = RFMRegressor(**kw, device=device).fit(x, y)
            em = np.linalg.norm(gpu.M_ - cpu.M_) / np.linalg.norm(cpu.M_)
            pc = cpu.predict(xt)
            ep = np.linalg.norm(gpu.predict(xt) - pc) / np.linalg.norm(pc)
            say(f"check fit {name}: GPU float32 vs CPU float64: M_ {em:.2e}, predictions {ep:.2e} "
                f"[{'ok' if max(em, ep) <= 1e-3 else 'ABOVE 1e-3'}]; GPU seconds per iteration "
                f"{[round(h['seconds'], 4) for h in gpu.history_]}")
        except Exception as e:  # noqa: BLE001
            say(f"check fit {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for the rows")
    ap.add_argument("--rows", default=None, help="comma-separated subset of bench/rfm_bench.py's rows")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        say("no CUDA device: nothing to probe")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    say(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; xRFM "
        f"{'importable' if rfm_bench.xrfm_modules() is not None else 'not importable'}"
        f"{', Kermac importable' if rfm_bench.xrfm_has_kermac() else ''}")
    if not args.skip_checks:
        check_agop(device)
        check_fit(device)
    rows = rfm_bench.rfm_rows(device, args.quick, args.rows.split(",") if args.rows else None, args.repeats, say)
    say("\nsummary (seconds / test NMSE / peak GB):")
    for r in rows:
        def cell(col, err, peak):
            ms = r.get(col)
            if ms is None:
                return "-"
            e, g = r.get(err), r.get(peak)
            return (f"{ms / 1e3:.3f} s" + (f" / {e:.4f}" if e is not None else "") +
                    (f" / {g:.2f} GB" if g is not None else ""))
        if "ratio_to_matvec" in r:
            say(f"  {r['size']}: AGOP {r['ours_ms']:.3f} ms, matvec {r['matvec_ms']:.3f} ms, "
                f"{r['ratio_to_matvec']:.2f}x")
        else:
            say(f"  {r['size']}: ours {cell('ours_ms', 'error', 'ours_peak_gb')}; xRFM torch "
                f"{cell('torch_ms', 'torch_error', 'torch_peak_gb')}; xRFM+Kermac "
                f"{cell('kermac_ms', 'kermac_error', 'kermac_peak_gb')}; {r.get('note', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
