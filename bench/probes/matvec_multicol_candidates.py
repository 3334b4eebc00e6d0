"""Candidates for kernel_matvec with several right-hand-side columns at small D (GPyTorch's
CG/Lanczos products: C = 1 + 10 probe vectors = 11 at D = 8, issue 29's gp_step): the
MatvecTraits (kK, kC, kUnrollJ) of the expanded Gaussian kernel, selected by patching
plan.matvec.matvec_spec. The rule before session 10 took kK = 12 (K + 1 = 9 slots rounded up),
kC = 16 (11 columns padded) and one row per thread (the register rule: 96 // (kK + 3 kC + 1));
the shipped rule now takes kK = 9, kC = 12, two rows per thread.

CUDA events, median of --reps after one warm-up, on fresh points; relative error against
float64 on 256 sampled rows.

    python bench/probes/matvec_multicol_candidates.py [--n 1000000] [--d 8] [--c 11] [--reps 3]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import kermac_like as km  # noqa: E402
import kermac_like.plan.matvec as pm  # noqa: E402
from kermac_like.runtime.specs.matvec import matvec_traits_spec  # noqa: E402
from try_matvec import error  # noqa: E402

# name: (kK, kC, unroll_j); None: the shipped rule. Rows per thread follow the register rule
# (9 / 12: two). The one-row and forced-two-row candidates of session 10's run 2 (k9_c12_r1,
# k9_c16_r2_u1, k12_c12_r2) used a kRowsArg template knob, removed after the run (git 04e4a41).
CANDIDATES = {
    "shipped": None,
    "k9_c12_u1": (9, 12, 1),
    "k12_c1": (12, 1, 0),  # the one-column kernel before kK = 9
    "k9_c1": (9, 1, 0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--c", type=int, default=11)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    desc = km.preset("gaussian_l2")
    shipped_spec = pm.matvec_spec
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(0)}: kernel_matvec gaussian N = M = {a.n}, D = {a.d}, C = {a.c}, bandwidth 1.45")
    for name, cand in CANDIDATES.items():
        if a.only and name not in a.only.split(","):
            continue
        if cand is None:
            pm.matvec_spec = shipped_spec
        else:
            def spec(d, dtype, K, C, *, epsilon=None, out_dtype=None, _c=cand):
                if out_dtype is not None or K + 1 > _c[0] or C > _c[1]:
                    return shipped_spec(d, dtype, K, C, epsilon=epsilon, out_dtype=out_dtype)
                return matvec_traits_spec(d, dtype, _c[0], _c[1], expand=True, unroll_j=_c[2])

            pm.matvec_spec = spec
        try:
            times = []
            for i in range(a.reps + 1):
                x = torch.rand(a.n, a.d, device=dev, generator=g) * 2 - 1
                v = torch.randn(a.n, a.c, device=dev, generator=g)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = km.kernel_matvec(desc, x, x, v, bandwidth=1.45)
                e.record()
                e.synchronize()
                if i:
                    times.append(s.elapsed_time(e))
            err = error(desc, x, x, v, out, 256, bandwidth=1.45)
            times.sort()
            print(f"  {name:14s} {times[len(times) // 2]:9.1f} ms  ({a.n * a.n / times[len(times) // 2] / 1e9:.2f}e12 "
                  f"pairs/s)  rel err {err[0]:.2e} (worst row {err[1]:.2e})", flush=True)
        except Exception as ex:  # a candidate that does not build or run: report, go on
            print(f"  {name:14s} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    pm.matvec_spec = shipped_spec


if __name__ == "__main__":
    main()
