"""Candidates for the Gaussian matvec at D = 3, N = M = 10^6, C = 1 (issue 15 target <= 0.30 s):
the shipped expanded loop against the tuned MatvecTraits variants (kUnrollJ points per trip,
kPolyPairs FMA-pipe exponentials per trip, kPrefetch register prefetch of the next y tile),
selected through ``specs.matvec.TUNING``. CUDA events, median of ``--reps`` after ``--warmup``
on fresh randn points and uniform v (bw = 1); relative error vs float64 on 256 sampled rows
(Frobenius and worst row); mean SM clock / max power from nvidia-smi while each one runs.

    python bench/probes/matvec_d3_candidates.py [--n 1000000] [--reps 3] [--only shipped,pf_u8_p8]

Model column (sm_90 SASS of the folded pair loop, bench/notes/matvec.md): issue slots per pair
(1/clk per scheduler) and MUFU cycles per pair (8 per warp-wide EX2): the bound is the larger;
"pred ms" scales the shipped kernel's 294.7 ms by bound / 8.0 (optimistic near balance: the
old one-row polynomial, issue 6.94 vs MUFU 7.0, measured 302 ms, not 258).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import kermac_like as km  # noqa: E402
from kermac_like.runtime.specs import matvec as ms  # noqa: E402
from _timing import time_calls  # noqa: E402
from try_matvec import error  # noqa: E402

# name: (TUNING, POLY_ROWS, issue slots per pair, MUFU cycles per pair) -- counts of the folded
# loop in the sm_90 SASS (NVRTC 13, 127-128 registers, no spills).
CANDIDATES = {
    "shipped": ({}, 0, 89 / 16, 8.0),
    "shipped_poly1": ({}, 1, 111 / 16, 7.0),  # the measured 302 ms anchor
    "pf_u2": ({"prefetch": True}, 0, 88 / 16, 8.0),
    "pf_u4": ({"unroll_j": 4, "prefetch": True}, 0, 171 / 32, 8.0),
    "pf_u8": ({"unroll_j": 8, "prefetch": True}, 0, 336 / 64, 8.0),
    "pf_u4_p2": ({"unroll_j": 4, "poly_pairs": 2, "prefetch": True}, 0, 193 / 32, 8 * 30 / 32),
    "pf_u4_p3": ({"unroll_j": 4, "poly_pairs": 3, "prefetch": True}, 0, 203 / 32, 8 * 29 / 32),
    "pf_u4_p4": ({"unroll_j": 4, "poly_pairs": 4, "prefetch": True}, 0, 213 / 32, 8 * 28 / 32),
    "pf_u8_p6": ({"unroll_j": 8, "poly_pairs": 6, "prefetch": True}, 0, 398 / 64, 8 * 58 / 64),
    "pf_u8_p8": ({"unroll_j": 8, "poly_pairs": 8, "prefetch": True}, 0, 418 / 64, 8 * 56 / 64),
    "u4_p3": ({"unroll_j": 4, "poly_pairs": 3}, 0, 202 / 32, 8 * 29 / 32),
}
SHIPPED_MS = 294.7


class Clocks:
    """nvidia-smi samples (SM MHz, W) while the block runs; empty without nvidia-smi."""

    def __init__(self, device_index: int):
        self.idx, self.samples, self.proc = device_index, [], None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe:
            self.proc = subprocess.Popen([exe, "-i", str(self.idx), "--query-gpu=clocks.sm,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "100"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                mhz, w = (float(p) for p in line.split(","))
                self.samples.append((mhz, w))
            except ValueError:
                pass

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join(timeout=1)

    def summary(self):
        if not self.samples:
            return "", ""
        busy = [s for s in self.samples if s[1] > 150] or self.samples  # drop idle samples
        return f"{sum(m for m, _ in busy) / len(busy):.0f}", f"{max(w for _, w in busy):.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--only", default=",".join(CANDIDATES))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    dev = torch.device("cuda")
    g = km.preset("gaussian_l2")
    N = args.n

    # compile every candidate first, in parallel (the spec the plan will ask for)
    from kermac_like.runtime.compiler import arch_of_device, precompile_specs

    specs = []
    for name in names:
        tuning, poly, *_ = CANDIDATES[name]
        ms.TUNING, ms.POLY_ROWS = dict(tuning), poly
        specs.append(ms.matvec_spec(g, torch.float32, 3, 1))
    print(precompile_specs(specs, arch_of_device(0), processes=min(16, os.cpu_count() or 1)), flush=True)

    make = lambda: (torch.randn(N, 3, device=dev), torch.randn(N, 3, device=dev), torch.rand(N, 1, device=dev))  # noqa: E731
    rows = []
    for name in names:
        tuning, poly, issue, mufu = CANDIDATES[name]
        ms.TUNING, ms.POLY_ROWS = dict(tuning), poly
        with Clocks(dev.index or 0) as clk:
            t = time_calls(lambda x, y, v: km.kernel_matvec(g, x, y, v, bandwidth=1.0), make, dev,
                           repeats=args.reps, warmup=args.warmup, keep_last=True)
        x, y, v = t.last_inputs
        fro, worst = error(g, x, y, v, t.last_output, args.rows, bandwidth=1.0)
        mhz, watts = clk.summary()
        bound = max(issue, mufu)
        rows.append((name, issue, mufu, SHIPPED_MS * bound / 8.0, t.median_ms, t.times_ms, fro, worst, mhz, watts))
        print(f"{name}: {t.median_ms:.1f} ms {['%.1f' % a for a in t.times_ms]} err {fro:.2e}/{worst:.2e} "
              f"SM {mhz} MHz {watts} W", flush=True)
        del x, y, v, t
    ms.TUNING, ms.POLY_ROWS = None, 0

    print(f"\n{torch.cuda.get_device_name(0)}; torch {torch.__version__}; D=3 N=M={N} C=1 bw=1")
    print("| candidate | issue/pair | MUFU/pair | pred ms | ms (median) | vs shipped | rel Frobenius | worst row "
          "| SM MHz | max W |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = next((r[4] for r in rows if r[0] == "shipped"), None)
    for name, issue, mufu, pred, med, _, fro, worst, mhz, watts in rows:
        rel = f"{med / base - 1:+.1%}" if base else ""
        print(f"| {name} | {issue:.2f} | {mufu:.2f} | {pred:.0f} | {med:.1f} | {rel} | {fro:.2e} | {worst:.2e} "
              f"| {mhz} | {watts} |")


if __name__ == "__main__":
    main()
