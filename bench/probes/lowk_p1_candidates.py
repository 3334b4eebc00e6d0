"""Issue #16's p=1 point: low-K candidates for cdist p=1 at K = 37 (K = 32, 64 as context)
and the Laplace kernel at K = 8 in the default compute mode (kMmNonFinite), one GPU run.

    python bench/probes/lowk_p1_candidates.py [--quick] [--reps 15] [--json out.json]

M = N = 20 000, float32, out= given, CUDA events (bench/_timing.py: medians of fresh-input
calls after warm-up), each variant timed in two interleaved passes (the lower median is
reported, both are printed), the write floor (out.fill_) at the start and the end, the
relative Frobenius error of rows 0..255 against float64. Candidates are spec keywords of
render.lowk_spec (defaults: the shipped kernel), launched through lowk_candidates.launcher:

* ``tiles_n``: kTilesN tiles of 128 x 128 side by side per block: a's tile loaded once, b's
  next tile copied with cp.async into a second buffer while the current one is computed
  and stored (the stores of tile s overlap the arithmetic of tile s + 1); shipped: 2.

``pred`` is the prediction written before the run (bench/notes/lowk.md); the table is last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import kermac_like as km  # noqa: E402
from bench._timing import time_calls  # noqa: E402
from kermac_like.plan import distance  # noqa: E402
from kermac_like.layout import Layout  # noqa: E402
from kermac_like.plan import autotune as tuning  # noqa: E402
from kermac_like.runtime import specs as render  # noqa: E402
from lowk_candidates import launcher, rel  # noqa: E402

# (op, preset, K, name, lowk_spec keywords or None for the public call, predicted ms on an H200)
CANDIDATES = [
    ("cdist_p1", "l1", 16, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 16, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 16, "8 tiles", dict(tiles_n=8), 0.0),
    ("cdist_p1", "l1", 32, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 32, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 32, "8 tiles", dict(tiles_n=8), 0.0),
    ("cdist_p1", "l1", 37, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 37, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 37, "8 tiles", dict(tiles_n=8), 0.0),
    ("cdist_p1", "l1", 64, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 64, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 64, "8 tiles", dict(tiles_n=8), 0.0),
    ("laplace_l2", "laplace_l2", 8, "2 tiles", dict(tiles_n=2), 0.0),
    ("laplace_l2", "laplace_l2", 8, "4 tiles", dict(tiles_n=4), 0.0),
    ("laplace_l2", "laplace_l2", 8, "8 tiles", dict(tiles_n=8), 0.0),
    ("cdist_p1", "l1", 8, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 8, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 8, "8 tiles", dict(tiles_n=8), 0.0),
    ("cdist_p1", "l1", 3, "2 tiles", dict(tiles_n=2), 0.0),
    ("cdist_p1", "l1", 3, "4 tiles", dict(tiles_n=4), 0.0),
    ("cdist_p1", "l1", 3, "8 tiles", dict(tiles_n=8), 0.0),
]


def spec_of(pname, K, kw, M):
    """The instantiation the launcher asks for at M x M (default compute mode: the flag
    for the Euclidean descriptors; the planner's tiles per block unless kw names them)."""
    d = km.preset(pname)
    R = Layout.ROW_MAJOR
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kw = {"tiles_n": render.lowk_tiles_n(K, M, M, 1, render.LOWK_MIN_BLOCKS * sms), **kw}
    return render.lowk_spec(d, R, R, K, mm_nonfinite=render.desc_mm_ok(d), **kw)


def precompile(M):
    from kermac_like.runtime.compiler import arch_of_device, precompile_specs

    t = time.perf_counter()
    specs = list({spec_of(p, K, kw, M).name_expression: spec_of(p, K, kw, M)
                  for _, p, K, _, kw, _ in CANDIDATES if kw is not None}.values())
    print(precompile_specs(specs, arch_of_device(torch.device("cuda")), processes=os.cpu_count()), flush=True)
    print(f"precompile: {len(specs)} kernels, {time.perf_counter() - t:.1f} s", flush=True)


def make_fn(op, pname, K, kw, out):
    desc = km.preset(pname)
    hyp = {"bandwidth": math.sqrt(2.0 * K)} if op in ("laplace_l2", "gaussian_l2") else {}
    if kw is None:  # the public call: whatever the default table picks
        if op == "cdist_p1":
            return (lambda a, b: km.cdist(a, b, p=1.0, out=out)), desc, hyp
        return (lambda a, b: km.run_kernel(desc, a, b, out=out, **hyp)), desc, hyp
    kw = dict(kw)
    return launcher(desc, hyp, out, tuning.LOWK, threads_n=kw.pop("threads_n", None), spec_kw=kw), desc, hyp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2000^2 (a smoke test of the script)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    M = N = 2000 if args.quick else 20000
    precompile(M)
    out = torch.empty(M, N, device=dev)
    floor0 = time_calls(lambda o: o.fill_(1.0), lambda: (out,), dev, repeats=args.reps, warmup=2).median_ms
    print(f"write floor {M}x{N}: {floor0:.4f} ms", flush=True)
    rows = []
    for c in CANDIDATES:
        rows.append({"op": c[0], "K": c[2], "variant": c[3], "pred": c[5], "ms": [], "err": None})
    for rnd in range(2):  # two interleaved passes
        for c, row in zip(CANDIDATES, rows):
            op, pname, K, name, kw, _ = c
            fn, desc, hyp = make_fn(op, pname, K, kw, out)
            make = lambda K=K: (torch.randn(M, K, device=dev), torch.randn(N, K, device=dev))  # noqa: E731
            t = time_calls(fn, make, dev, repeats=args.reps, warmup=args.warmup, keep_last=rnd == 0)
            row["ms"].append(round(t.median_ms, 4))
            if rnd == 0:
                a, b = t.last_inputs
                ref = distance.distance_reference(desc, a[:256].double(), b.double(), **hyp)
                row["err"] = float(f"{rel(out[:256], ref):.2e}")
            print(json.dumps(row), flush=True)
    floor1 = time_calls(lambda o: o.fill_(1.0), lambda: (out,), dev, repeats=args.reps, warmup=2).median_ms
    floor = min(floor0, floor1)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"floor_ms": [floor0, floor1], "rows": rows}, indent=1))
    print(f"\nwall {time.perf_counter() - t0:.1f} s; {torch.cuda.get_device_name(dev)}")
    print("| op | K | variant | ms (min of 2 medians) | both | x floor | pred | err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = min(r["ms"])
        print(f"| {r['op']} | {r['K']} | {r['variant']} | {ms:.3f} | {r['ms'][0]:.3f} / {r['ms'][1]:.3f} | "
              f"{ms / floor:.2f} | {r['pred']:.2f} | {r['err']:.1e} |")
    print("(pred 0.00: no prediction, a sweep)")
    print(f"write floor {floor0:.4f} / {floor1:.4f} ms (start / end)")
    del out
    batch_rows(args, dev)


def batch_rows(args, dev):
    """The bench's batch row (1000 problems of 256 x 256 x 3, Laplace, one bandwidth per
    problem, one launch) with 1 and 2 tiles per block and the public call, interleaved
    twice, beside its write floor (bench/notes/lowk.md: 0.130 vs 0.181 ms in two runs)."""
    L, n, K = (100, 64, 3) if args.quick else (1000, 256, 3)
    desc = km.preset("laplace_l2")
    bw = torch.linspace(0.5, 4.0, L, device=dev)
    out = torch.empty(L, n, n, device=dev)
    make = lambda: (torch.randn(L, n, K, device=dev), torch.randn(L, n, K, device=dev))  # noqa: E731
    variants = {"1 tile": launcher(desc, {"bandwidth": bw}, out, tuning.LOWK, spec_kw={"tiles_n": 1}),
                "2 tiles": launcher(desc, {"bandwidth": bw}, out, tuning.LOWK, spec_kw={"tiles_n": 2}),
                "km.run_kernel": lambda a, b: km.run_kernel(desc, a, b, bandwidth=bw, out=out)}
    ms = {k: [] for k in variants}
    floor = []
    for _ in range(2):
        floor.append(time_calls(lambda o: o.fill_(1.0), lambda: (out,), dev, repeats=args.reps, warmup=2).median_ms)
        for name, fn in variants.items():
            ms[name].append(time_calls(fn, make, dev, repeats=args.reps, warmup=args.warmup).median_ms)
    print(f"\nbatch {L} x {n}^2 x {K} laplace_l2 (write floor {min(floor):.4f} ms): " +
          ", ".join(f"{k} {min(v):.4f} ms ({v[0]:.4f} / {v[1]:.4f})" for k, v in ms.items()))


if __name__ == "__main__":
    main()
