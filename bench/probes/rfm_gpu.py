"""GPU probe of kermac_like.rfm (issue 45): correctness against float64, then the target rows.

    PYTHONPATH=. python3 bench/probes/rfm_gpu.py [--quick] [--rows l2_20k,...] [--skip-checks] [--agop-only]
                                                 [--cholesky]

Prints, each as soon as it is measured (a failing row prints its error and the probe goes on):

1. checks: the AGOP of every kernel in float32 on both GPU paths (the fused contraction, default; the
   written weights, blocks of 1 MiB) against the float64 CPU path on n = 3000 centres, 1000 points (400
   of them centres, 100 near centres), D = 24 / 50 / 100, shifted and clustered, 3 outputs: relative
   Frobenius error (expect <= 1e-4); ``--agop-only``: these and each kernel's AGOP time at n = 20 000,
   D = 50 and 100 on both paths beside kernel_matvec with D + 1 columns; a fit on the GPU (float32) against the same fit on
   the CPU in float64, n = 3000, D = 16, 3 iterations: M_ and predictions, relative (expect <= 1e-3, or
   <= 3x the float64 fit's own change under a 1e-9 relative move of its inputs: product Laplace's 7e-3).
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


def agop_data(D, shift=2.0, clustered=False):
    """n = 3000 centres, 1000 points (400 of them centres: self pairs; 100 centres moved by 1e-4: near
    pairs), 3 outputs; clustered: 8 tight blobs 20 apart."""
    g = torch.Generator().manual_seed(D)
    if clustered:
        c = torch.randn(8, D, generator=g, dtype=torch.float64) * 20.0
        u = c[torch.arange(3000) % 8] + 0.3 * torch.randn(3000, D, generator=g, dtype=torch.float64)
        w = c[torch.arange(500) % 8] + 0.3 * torch.randn(500, D, generator=g, dtype=torch.float64)
    else:
        u = torch.randn(3000, D, generator=g, dtype=torch.float64) + shift
        w = torch.randn(500, D, generator=g, dtype=torch.float64) + shift
    v = torch.cat([w, u[:400], u[400:500] + 1e-4 * torch.randn(100, D, generator=g, dtype=torch.float64)])
    coef = torch.randn(3000, 3, generator=g, dtype=torch.float64) / 50
    return u, v, coef


def check_agop(device):
    """The AGOP in float32 on the GPU against the float64 CPU path, both GPU paths: the fused contraction
    (the default: kernel_matvec's data-input contraction, matvec_grad.cuh, lanes beyond D = 32) and the
    written weights (run_kernel + cdist + cdist_grad, ``contraction=False``); D = 24 (one lane), 50 (two
    lanes of 28), 100 (four); shifted (+2, +100) and clustered data."""
    for D, shift, clustered in ((24, 2.0, False), (50, 2.0, False), (100, 2.0, False), (50, 100.0, False),
                                (50, 0.0, True)):
        u, v, coef = agop_data(D, shift, clustered)
        bw = 6.0 * (D / 24) ** 0.5 if not clustered else 2.0
        uf, vf, cf = (t.float().to(device) for t in (u, v, coef))
        # the reference on the float32-rounded inputs: the kernels' error, not that of rounding the data
        # (near pairs at 1e-4 flip sgn(t) of the l1 kernel where a coordinate's difference is below an ulp)
        u, v, coef = (t.float().double() for t in (u, v, coef))
        for name, q, p in KERNELS:
            try:
                kern = resolve_rfm_kernel(name, q, p)
                want = agop_sum(kern, bw, u, coef, v)
                errs = []
                for fused in (True, False):
                    got = agop_sum(kern, bw, uf, cf, vf, block_bytes=1 << 20, contraction=fused)
                    diag = agop_sum(kern, bw, uf, cf, vf, diag=True, contraction=fused)
                    errs.append((float((got.cpu() - want).norm() / want.norm()),
                                 float((diag.cpu() - want.diagonal()).norm() / want.diagonal().norm())))
                (e, ed), (o, od) = errs
                say(f"check agop D={D} {'clustered' if clustered else f'shift {shift:g}'} {name} q={q} p={p}: "
                    f"fused contraction {e:.2e} (diag {ed:.2e}) [{'ok' if max(e, ed) <= 1e-4 else 'ABOVE 1e-4'}]; "
                    f"written weights {o:.2e} (diag {od:.2e})")
            except Exception as ex:  # noqa: BLE001
                say(f"check agop D={D} {name}: FAILED {type(ex).__name__}: {ex}\n{traceback.format_exc(limit=4)}")


def time_agop(device):
    """Each kernel's AGOP (1 output) at n = 20 000, D = 50 and 100: the fused contraction against the
    written weights and against kernel_matvec with D + 1 columns (the issue's yardstick: <= 1.2x)."""
    import kermac_like as km

    for D in (50, 100):
        x, _ = rfm_bench.make_task(20_000, D, device, 4)
        coef = torch.randn(20_000, 1, device=device) / 20_000 ** 0.5
        v = torch.randn(20_000, D + 1, device=device)
        mv = rfm_bench._event_ms(lambda: km.kernel_matvec(km.preset("laplace_l2"), x, x, v,
                                                          bandwidth=rfm_bench.BANDWIDTH), device)
        say(f"time agop n=20000 D={D}: kernel_matvec laplace_l2 with {D + 1} columns {mv:.3f} ms")
        for name, q, p in KERNELS:
            try:
                kern = resolve_rfm_kernel(name, q, p)
                bw = rfm_bench.BANDWIDTH
                new = rfm_bench._event_ms(lambda: agop_sum(kern, bw, x, coef, x), device)
                old = rfm_bench._event_ms(lambda: agop_sum(kern, bw, x, coef, x, contraction=False), device)
                say(f"time agop n=20000 D={D} {name} q={q} p={p}: fused contraction {new:.3f} ms "
                    f"({new / mv:.2f}x the matvec), written weights {old:.3f} ms ({old / new:.2f}x the fused)")
            except Exception as ex:  # noqa: BLE001
                say(f"time agop D={D} {name}: FAILED {type(ex).__name__}: {ex}\n{traceback.format_exc(limit=4)}")


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
            # the float64 fit's own spread: the same fit on inputs moved by 1e-9 relative (the l1 kernel's
            # gradient jumps where a transformed coordinate's difference changes sign: bench/notes/rfm.md, "(c)")
            xp = x * (1 + 1e-9 * rng.standard_normal(x.shape))
            cpp = RFMRegressor(**kw).fit(xp, y)
            sm = np.linalg.norm(cpp.M_ - cpu.M_) / np.linalg.norm(cpu.M_)
            sp = np.linalg.norm(cpp.predict(xt) - pc) / np.linalg.norm(pc)
            ok = max(em, ep) <= max(1e-3, 3 * max(sm, sp))
            say(f"check fit {name}: GPU float32 vs CPU float64: M_ {em:.2e}, predictions {ep:.2e}; float64 fit "
                f"on inputs moved by 1e-9: M_ {sm:.2e}, predictions {sp:.2e} "
                f"[{'ok' if ok else 'ABOVE max(1e-3, 3x the float64 spread)'}]; GPU seconds per iteration "
                f"{[round(h['seconds'], 4) for h in gpu.history_]}")
        except Exception as e:  # noqa: BLE001
            say(f"check fit {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")


def check_cholesky(device, quick=False):
    """linalg.cholesky_3xtf32_ (blocked, 3xTF32 trailing updates) against cuSOLVER's float32 potrf
    (linalg.solve_cholesky in place): the factor's error against float64 at n = 4000, and the time of
    one factorisation of the regularised l2 Laplace kernel matrix at 20 000 x 50 and 50 000 x 100."""
    import kermac_like as km
    from kermac_like import linalg

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 50, generator=g, dtype=torch.float64) + 3.0
    k = km.run_kernel(km.PRESETS["laplace_l2"], x, x, bandwidth=10.0) + 1e-3 * torch.eye(4000, dtype=torch.float64)
    l64 = torch.linalg.cholesky(k)
    a = k.float().to(device).contiguous()
    info = linalg.cholesky_3xtf32_(a)
    l32 = torch.linalg.cholesky(k.float().to(device))
    err = float((a.double().cpu() - l64).norm() / l64.norm())
    ref = float((l32.double().cpu() - l64).norm() / l64.norm())
    say(f"check cholesky n=4000: 3xTF32 blocked {err:.2e} (info {info}), torch float32 {ref:.2e} "
        f"[{'ok' if err <= 3 * ref + 1e-7 else 'ABOVE 3x float32'}]")
    for n, d in ((2000, 20),) if quick else ((20_000, 50), (50_000, 100)):
        _time_factorisations(device, n, d)


def _time_factorisations(device, n, d):
    """One factorisation of the regularised l2 Laplace kernel matrix (n x d data), cuSOLVER against the
    3xTF32 blocked one, the copy that restores the matrix subtracted."""
    import kermac_like as km
    from kermac_like import linalg

    xs, _ = rfm_bench.make_task(n, d, device, 4)
    kk = km.run_kernel(km.PRESETS["laplace_l2"], xs, xs, bandwidth=rfm_bench.BANDWIDTH, regularization=rfm_bench.REG)
    work = torch.empty_like(kk)
    rhs = torch.randn(1, n, device=device)

    def cusolver():
        work.copy_(kk)
        linalg.solve_cholesky(work, rhs.clone(), overwrite_a=True)

    def tf32():
        work.copy_(kk)
        linalg.cholesky_3xtf32_(work)

    t_copy = rfm_bench._event_ms(lambda: work.copy_(kk), device, repeats=3, warm=1)
    t_cu = rfm_bench._event_ms(cusolver, device, repeats=3, warm=1) - t_copy
    t_tf = rfm_bench._event_ms(tf32, device, repeats=3, warm=1) - t_copy
    say(f"time cholesky n={n}: cuSOLVER float32 potrf+potrs {t_cu:.1f} ms, 3xTF32 blocked {t_tf:.1f} ms "
        f"({t_cu / t_tf:.2f}x)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for the rows")
    ap.add_argument("--rows", default=None, help="comma-separated subset of bench/rfm_bench.py's rows")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--cholesky", action="store_true",
                    help="the 3xTF32 blocked Cholesky: its check and time against cuSOLVER, then the l2 rows with "
                         "the setting cholesky_3xtf32 on (only these)")
    ap.add_argument("--agop-only", action="store_true",
                    help="only the AGOP checks and timings (both paths, every kernel), no fit rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        say("no CUDA device: nothing to probe")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    say(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; xRFM "
        f"{'importable' if rfm_bench.xrfm_modules() is not None else 'not importable'}"
        f"{', Kermac importable' if rfm_bench.xrfm_has_kermac() else ''}")
    if args.cholesky:
        from kermac_like import config

        check_cholesky(device, args.quick)
        with config.override(cholesky_3xtf32=True):
            rows = rfm_bench.rfm_rows(device, args.quick, (args.rows or "l2_20k,l2_50k").split(","), args.repeats, say)
        for r in rows:
            say(f"  cholesky_3xtf32 on: {r['size']}: ours {r.get('ours_ms', 0) / 1e3:.3f} s, test NMSE "
                f"{r.get('error')}, peak {r.get('ours_peak_gb')} GB, xRFM torch {(r.get('torch_ms') or 0) / 1e3:.3f} s")
        return 0
    if args.agop_only:
        check_agop(device)
        time_agop(device)
        return 0
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
