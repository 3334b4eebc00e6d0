"""Does matvec_wgmma's kC = 16 build pay for its spills? (issue 26: no shipped kernel spills unless
a measurement shows the spill is the faster choice.)

On sm_90 the Laplace and Gaussian matvec_wgmma kernels at kC = 16 spill 396 B (tests/test_compile.py
SPILL_ALLOWANCE); kC <= 8 do not. The planner runs a call with 9 <= C <= 16 as one kC = 16 launch
(specs.matvec.c_bucket). The alternative without spills: the same call in column chunks of 8
(plan.matvec_wgmma.MAX_C patched to 8: C = 16 -> 8 + 8, C = 12 -> 8 + 4, C = 9 -> 8 + 1), i.e. the
pair work done twice with kC = 8. Each row: both ways interleaved (CUDA events, median of --reps
after a warm-up, fresh randn data per call), the relative Frobenius error of each against float64
on 256 sampled rows.

    python bench/probes/matvec_wgmma_kc16.py [--n 100000] [--reps 5]
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
from kermac_like.plan import matvec_wgmma as PW  # noqa: E402


def run(desc, bw, x, y, v, max_c):
    saved = PW.MAX_C
    PW.MAX_C = max_c
    try:
        return km.kernel_matvec(desc, x, y, v, bandwidth=bw)
    finally:
        PW.MAX_C = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = a.n
    rows = []
    for name, bw in (("gaussian_l2", 16.0), ("laplace_l2", 16.0)):
        desc = km.preset(name)
        for d in (64, 256):
            for C in (16, 12, 9):
                times = {16: [], 8: []}
                errs = {}
                for r in range(a.reps + 1):
                    for max_c in ((16, 8) if r % 2 == 0 else (8, 16)):
                        x, y = torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")
                        v = torch.randn(n, C, device="cuda")
                        torch.cuda.synchronize()
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        out = run(desc, bw, x, y, v, max_c)
                        e1.record()
                        e1.synchronize()
                        if r:
                            times[max_c].append(e0.elapsed_time(e1))
                        if r == a.reps:
                            idx = torch.randperm(n, device="cuda")[:256]
                            ref = mv.matvec_reference(mv.prepare_matvec(desc, x[idx].double(), y.double(),
                                                                        v.double(), bandwidth=bw))
                            errs[max_c] = ((out[idx].double() - ref).norm() / ref.norm()).item()
                t16, t8 = statistics.median(times[16]), statistics.median(times[8])
                rows.append((name, d, C, t16, t8, errs[16], errs[8]))
                print(f"KC16 {name} D={d} C={C}: kC=16 (spills) {t16:.2f} ms, chunks of 8 {t8:.2f} ms, "
                      f"ratio {t8 / t16:.2f}; errors {errs[16]:.1e} / {errs[8]:.1e}", flush=True)
    print(f"\n| descriptor | D | C | kC = 16 one launch (ms) | chunks of 8 (ms) | chunks / kC16 | err kC16 | err chunks |  "
          f"({torch.cuda.get_device_name()}, N = M = {n})")
    print("|---|---|---|---|---|---|---|---|")
    for name, d, C, t16, t8, e16, e8 in rows:
        print(f"| {name} | {d} | {C} | {t16:.2f} | {t8:.2f} | {t8 / t16:.2f} | {e16:.1e} | {e8:.1e} |")


if __name__ == "__main__":
    main()
