"""Fused top-k kernel (cuda_templates/topk.cuh) on the GPU through its planner alone:
correctness against a float64 oracle (the acceptance rule of tests/test_gpu_knn.py) on fresh
random data with poisoned outputs, then timings of the issue's workloads beside torch's way
(row blocks of torch.cdist + torch.topk; timed on a slice of rows and scaled).

    python3 bench/probes/topk_probe.py [--quick] [--only check|time|variants|mma|mma3|mma6|rescore]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, ".")
import kermac_like as km  # noqa: E402
from kermac_like import config  # noqa: E402


def fused(desc, x, y, k, largest, hypers=None):
    """kernel_topk into poisoned outputs (the fused kernels serve these calls; the probe's
    rows are chosen so that none takes the blocked path)."""
    batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    shape = (*batch, x.shape[-2], k)
    values = torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
    indices = torch.full(shape, -5, dtype=torch.int64, device=x.device)
    km.kernel_topk(desc, x, y, k, largest=largest, out=(values, indices), **(hypers or {}))
    return values, indices


def oracle_values(desc, x, y, hypers):
    """Values of every pair in float64 (run_kernel's reference formula)."""
    from kermac_like.reference import distance_reference

    h = {k: v for k, v in (hypers or {}).items() if v is not None}
    return distance_reference(desc, x.double(), y.double(), **h)


def check(desc, x, y, k, largest, hypers=None, rtol=1e-5, rows=256):
    """Acceptance rule: values within rtol of the float64 value of the returned pair; index sets
    equal except where the float64 gap at the k-th place is below rtol."""
    v, i = fused(desc, x, y, k, largest, hypers)
    assert (i >= 0).all() and (i < y.shape[-2]).all(), "indices not written"
    worst, bad_sets = 0.0, 0
    xs = x[..., :rows, :]
    ref = oracle_values(desc, xs, y, hypers)  # (..., rows, N)
    vs, is_ = v[..., :rows, :], i[..., :rows, :]
    got_ref = torch.gather(ref, -1, is_)
    fin = torch.isfinite(got_ref)
    err = ((vs.double() - got_ref).abs() / got_ref.abs().clamp_min(1e-30))[fin]
    worst = err.max().item() if err.numel() else 0.0
    assert torch.equal(torch.isnan(vs.double()), torch.isnan(got_ref)), "NaN placement"
    refv, _ = torch.topk(ref, k, dim=-1, largest=largest)  # finite data
    kth = refv[..., -1:]
    # a returned pair must not be worse than the k-th float64 value by more than rtol
    if largest:
        ok = got_ref >= kth - rtol * kth.abs()
    else:
        ok = got_ref <= kth + rtol * kth.abs()
    bad_sets = int((~ok & fin).sum())
    return worst, bad_sets


CHECKS = [
    ("l2", 2000, 5000, 3, 10, False, torch.float32),
    ("l2", 3, 200000, 16, 10, False, torch.float32),  # split N + combine
    ("l1", 1500, 4000, 64, 16, False, torch.float32),
    ("l1", 700, 3000, 37, 100, False, torch.float32),
    ("p_norm", 900, 3000, 8, 7, False, torch.float32),
    ("l2", 512, 4096, 8, 1024, False, torch.float32),
    ("laplace_l2", 800, 3000, 3, 20, True, torch.float32),
    ("gaussian_l2", 800, 3000, 12, 20, True, torch.float32),
    ("dot", 600, 3000, 24, 15, True, torch.float32),
    ("l2", 800, 3000, 3, 10, False, torch.float16),
    ("l2", 800, 3000, 3, 10, False, torch.bfloat16),
    ("l2", 800, 3000, 3, 10, True, torch.float32),
    ("l2", 3000, 20000, 128, 10, False, torch.float32),  # tensor-core candidates (K > 64)
    ("l2", 5, 100000, 100, 16, False, torch.float32),  # split N
    ("squared_l2", 1000, 5000, 130, 1, False, torch.float32),
    ("l2", 1000, 5000, 96, 16, True, torch.float32),
    ("dot", 2000, 10000, 128, 10, True, torch.float32),
    ("dot", 700, 3000, 256, 5, False, torch.float32),
]


def run_checks():
    dev = torch.device("cuda")
    print("check: desc M N K k largest dtype -> worst value error, pairs beyond the k-th place")
    for name, M, N, K, k, largest, dt in CHECKS:
        x = torch.randn(M, K, device=dev).to(dt)
        y = torch.randn(N, K, device=dev).to(dt)
        hyp = {"bandwidth": 2.0} if "laplace" in name or "gaussian" in name else {}
        if name == "p_norm":
            hyp = {"inner_p": 1.5, "outer_p": 1.5}
        tol = 1e-5 if dt == torch.float32 else 1e-5
        w, b = check(km.PRESETS[name], x, y, k, largest, hyp, rtol=tol)
        print(f"  {name:12s} {M:6d} {N:7d} {K:3d} {k:5d} {largest!s:5s} {str(dt):15s} {w:.2e} {b}")
    # batches with broadcasting and a tensor bandwidth
    x = torch.randn(4, 1, 300, 5, device=dev)
    y = torch.randn(1, 3, 2000, 5, device=dev)
    bw = torch.rand(4, 3, device=dev) + 0.5
    w, b = check(km.PRESETS["laplace_l2"], x, y, 9, True, {"bandwidth": bw})
    print(f"  batch (4,1)x(1,3) laplace tensor bw: {w:.2e} {b}")
    # determinism: two calls identical, bitwise
    x = torch.randn(5, 16, device=dev)
    y = torch.randn(300000, 16, device=dev)
    a = fused(km.PRESETS["l2"], x, y, 50, False)
    c = fused(km.PRESETS["l2"], x, y, 50, False)
    print("  deterministic:", torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def whole_knn(xm, y, k, rows):
    """km.knn(xm, y, k) with the planner as set: compiled and warmed on xm[:rows] first, then the
    median of two calls (ms), the peak memory beyond what was allocated before (MiB), the last output."""
    km.knn(xm[:rows], y, k)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = []
    t = time_ms(lambda: res.append(km.knn(xm, y, k)), reps=2, warm=0)
    extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return t, extra, res.pop()


def time_ms(fn, reps=5, warm=1):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def torch_blocks(x, y, k, p, rows=4096):
    out_v, out_i = [], []
    for r in range(0, x.shape[0], rows):
        d = torch.cdist(x[r:r + rows], y, p=p)
        v, i = torch.topk(d, k, dim=-1, largest=False)
        out_v.append(v)
        out_i.append(i)
    return torch.cat(out_v), torch.cat(out_i)


def run_timings(quick, only=()):
    dev = torch.device("cuda")
    rows = []
    cases = [("knn_d3", 10 ** 6, 3, 10, 2.0), ("knn_p1_d64", 2 * 10 ** 5, 64, 16, 1.0),
             ("knn_d16", 10 ** 6, 16, 10, 2.0), ("knn_d3_k100", 2 * 10 ** 5, 3, 100, 2.0),
             ("knn_d8_k1", 10 ** 6, 8, 1, 2.0), ("knn_d3_k32", 10 ** 6, 3, 32, 2.0),
             ("knn_d128", 10 ** 6, 128, 10, 2.0)]
    if quick:
        cases = [(n, m // 10, K, k, p) for n, m, K, k, p in cases]
    for name, M, K, k, p in cases:
        if only and name not in only:
            continue
        desc = km.PRESETS["l1" if p == 1 else "l2"]
        x = torch.randn(M, K, device=dev)
        y = torch.randn(M, K, device=dev)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time_ms(lambda: fused(desc, x, y, k, False), reps=3)
        extra = (torch.cuda.max_memory_allocated() - base - M * k * 12) / 2 ** 20
        sl = 8192
        tt = time_ms(lambda: torch_blocks(x[:sl], y, k, p), reps=2) * M / sl
        rows.append((name, t, tt, extra))
    # batched: 256 problems of 1000 x 1000 x 8, k = 8
    x = torch.randn(256, 1000, 8, device=dev)
    y = torch.randn(256, 1000, 8, device=dev)
    t = time_ms(lambda: fused(km.PRESETS["l2"], x, y, 8, False), reps=10)
    tt = time_ms(lambda: torch.topk(torch.cdist(x, y), 8, dim=-1, largest=False), reps=10)
    rows.append(("knn_batched", t, tt, 0.0))
    # few queries against many points (split N)
    x = torch.randn(64, 16, device=dev)
    y = torch.randn(10 ** 6, 16, device=dev)
    t = time_ms(lambda: fused(km.PRESETS["l2"], x, y, 10, False), reps=10)
    tt = time_ms(lambda: torch.topk(torch.cdist(x, y), 10, dim=-1, largest=False), reps=10)
    rows.append(("knn_m64_n1e6_d16", t, tt, 0.0))
    print(f"{'workload':20s} {'ours ms':>10s} {'torch ms':>10s} {'speedup':>8s} {'extra MB':>9s}")
    for name, t, tt, extra in rows:
        print(f"{name:20s} {t:10.2f} {tt:10.2f} {tt / t:8.1f} {extra:9.1f}")


VARIANT_CASES = [("d3_k10", 2 * 10 ** 5, 3, 10, "l2"), ("d16_k10", 2 * 10 ** 5, 16, 10, "l2"),
                 ("p1_d64_k16", 10 ** 5, 64, 16, "l1"), ("d8_k1", 2 * 10 ** 5, 8, 1, "l2"),
                 ("d3_k32", 10 ** 5, 3, 32, "l2"), ("d3_k100", 10 ** 5, 3, 100, "l2")]
VARIANTS = [None, {"rows": 4, "unroll_j": 2}, {"rows": 2, "unroll_j": 4}, {"rows": 2, "unroll_j": 2},
            {"rows": 4, "unroll_j": 4}, {"rows": 1, "unroll_j": 4}, {"rows": 1, "unroll_j": 2}]


def run_variants():
    """Each tuning of TopkTraits (rows per thread, points per trip) on each case, interleaved
    twice in opposite orders; ms per call (median of 3)."""
    from kermac_like.runtime.specs import topk as S

    dev = torch.device("cuda")
    data = {c[0]: (torch.randn(c[1], c[2], device=dev), torch.randn(c[1], c[2], device=dev)) for c in VARIANT_CASES}
    res = {}
    for rnd, order in enumerate((VARIANTS, VARIANTS[::-1])):
        for v in order:
            S.TUNING = v
            for name, M, K, k, d in VARIANT_CASES:
                rows = (v or {}).get("rows", 0)
                if rows * (S.k_bucket(K) + 2 * S.sel_bucket(k)) > 160:
                    continue  # would not fit the registers
                x, y = data[name]
                t = time_ms(lambda: fused(km.PRESETS[d], x, y, k, False), reps=3)
                res.setdefault((name, str(v)), []).append(t)
    S.TUNING = None
    print(f"{'case':12s} " + " ".join(f"{str(v):>34s}" for v in VARIANTS))
    for name, *_ in VARIANT_CASES:
        cells = []
        for v in VARIANTS:
            ts = res.get((name, str(v)))
            cells.append(f"{min(ts):34.2f}" if ts else f"{'-':>34s}")
        print(f"{name:12s} " + " ".join(cells))


def run_mma_parts():
    """Where knn_d128's time goes: topk_mma_kernel alone (one launch of a wave of row tiles against
    10^6 points, TF32 and 3xTF32), against the whole call on the same rows."""
    import numpy as np

    from kermac_like.plan import core
    from kermac_like.runtime.launcher import get_kernel, launch
    from kermac_like.runtime.specs.topk import mma_sel, topk_mma_spec

    dev = torch.device("cuda")
    N, K, k = 10 ** 6, 128, 10
    slots = core._sm_count(0)
    rows = slots * 128
    x = torch.randn(rows, K, device=dev)
    y = torch.randn(N, K, device=dev)
    sel = mma_sel(k)
    for prec in ("Tf32", "Tf32x3"):
        kern = get_kernel(topk_mma_spec(False, False, k, prec), 0)
        for split in (1, 2):
            per = -(-(-(-N // 256)) // split)
            scratch = torch.empty((4 * split, rows, sel), dtype=torch.int64, device=dev)
            args = (x.data_ptr(), y.data_ptr(), scratch.data_ptr(), np.int32(rows), np.int32(N), np.int32(K),
                    np.int64(K), np.int64(K), np.int32(1), np.int32(1), np.int32(1), *(np.int64(0),) * 6,
                    np.int32(split), np.int32(per))
            t = time_ms(lambda: launch(kern, (rows // 128, split, 1), args), reps=3)
            tiles = rows // 128 * (-(-N // 256))
            print(f"topk_mma_kernel {prec} split {split}: {t:.2f} ms for {rows} rows x 10^6 "
                  f"({t * 1e3 / (tiles / slots):.2f} us per 128x256 tile per SM); x {10 ** 6 / rows:.1f} launches "
                  f"= {t * 10 ** 6 / rows / 1e3:.2f} s at M = 10^6")
    t = time_ms(lambda: fused(km.PRESETS["l2"], x, y, k, False), reps=3)
    print(f"kernel_topk (l2, k = 10) on the same {rows} rows: {t:.2f} ms")


def run_mma3(M=10 ** 6):
    """topk_mma versions 2 (topk_mma_kernel), 3, 4 and 5 (topk_mma_pipelined_kernel; plan.topk.MMA_VERSION,
    env KERMAC_LIKE_TOPK_MMA_VERSION): one launch of a wave of row tiles against 10^6 points at
    knn_d128's shape (K = 128, k = 10), interleaved (2 3 4 5 5 4 3 2), best of two medians of 3; the
    scratch lists must be bitwise those of version 2 (also for the dot product, largest, and
    3xTF32). Then knn_d128's whole call (M = N = 10^6) per version, with the outputs compared.
    Each part reports its own failure and the probe goes on."""
    import traceback

    import numpy as np

    from kermac_like.plan import core
    from kermac_like.plan import topk as P
    from kermac_like.runtime.launcher import get_kernel, launch
    from kermac_like.runtime.specs.topk import MMA_VERSIONS, mma_sel, mma_smem, topk_mma_spec

    dev = torch.device("cuda")
    N, K, k = 10 ** 6, 128, 10
    slots = core._sm_count(0)
    rows = slots * 128
    optin = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 0)
    sel = mma_sel(k)
    versions = [v for v in MMA_VERSIONS if v <= 5 and (not optin or mma_smem(sel, v) <= optin)]  # (6: --only mma6)
    print(f"{slots} SMs, {optin} B shared memory per block; versions {versions} "
          f"(smem {[mma_smem(sel, v) for v in versions]})", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, K, device=dev, generator=g)
    y = torch.randn(N, K, device=dev, generator=g)
    tiles = rows // 128 * (-(-N // 256))

    def launcher_of(v, dot=False, largest=False, prec="Tf32", n=N):
        kern = get_kernel(topk_mma_spec(dot, largest, k, prec, version=v), 0)
        scratch = torch.full((4, rows, sel), -3, dtype=torch.int64, device=dev)
        args = (x.data_ptr(), y.data_ptr(), scratch.data_ptr(), np.int32(rows), np.int32(n), np.int32(K),
                np.int64(K), np.int64(K), np.int32(1), np.int32(1), np.int32(1), *(np.int64(0),) * 6,
                np.int32(1), np.int32(-(-n // 256)))
        return (lambda: launch(kern, (rows // 128, 1, 1), args)), scratch

    times, ok = {}, {}
    for prec in ("Tf32", "Tf32x3"):
        try:
            runs = {v: launcher_of(v, prec=prec) for v in versions}
            for v in versions:
                runs[v][0]()
            torch.cuda.synchronize()
            for v in versions:
                ok[(prec, v)] = torch.equal(runs[v][1], runs[versions[0]][1])
            for v in versions + versions[::-1]:
                times.setdefault((prec, v), []).append(time_ms(runs[v][0], reps=3))
            base = min(times[(prec, versions[0])])
            for v in versions:
                t = min(times[(prec, v)])
                print(f"topk_mma {prec} version {v}: {t:.2f} ms per launch ({rows} rows x 10^6, "
                      f"{t * 1e3 / (tiles / slots):.2f} us per 128x256 tile per SM, {base / t:.2f}x of version "
                      f"{versions[0]}; {t * M / rows / 1e3:.2f} s at M = 10^6); lists == version {versions[0]}: "
                      f"{ok[(prec, v)]}", flush=True)
            del runs
        except Exception:
            traceback.print_exc()
    for dot, largest in ((True, True), (True, False), (False, True)):
        try:
            runs = {v: launcher_of(v, dot, largest, n=2 * 10 ** 5) for v in versions}
            for v in versions:
                runs[v][0]()
            torch.cuda.synchronize()
            same = [torch.equal(runs[v][1], runs[versions[0]][1]) for v in versions]
            print(f"dot={dot} largest={largest} (N = 2e5): lists equal to version {versions[0]}: {same}", flush=True)
            del runs
        except Exception:
            traceback.print_exc()
    # knn_d128's whole call per version (the planner's switch), outputs compared with version 2's
    try:
        xm = torch.randn(M, K, device=dev, generator=g)
        outs = {}
        for v in versions:
            os.environ["KERMAC_LIKE_TOPK_MMA_VERSION"] = str(v)
            t, extra, outs[v] = whole_knn(xm, y, k, rows)
            same = (torch.equal(outs[v][0], outs[versions[0]][0]) and torch.equal(outs[v][1], outs[versions[0]][1]))
            print(f"knn_d128 M = N = 10^6, k = 10, MMA_VERSION={v} (FUSED_RESCORE={config.get('topk_fused_rescore')}): {t:.0f} ms, "
                  f"peak {extra:.0f} MiB beyond inputs; outputs == version {versions[0]}: {same}", flush=True)
            if v != versions[0]:
                del outs[v]
        os.environ.pop("KERMAC_LIKE_TOPK_MMA_VERSION", None)
    except Exception:
        traceback.print_exc()


def run_mma6(M=10 ** 6):
    """topk_mma version 6 (cuda_templates/topk_wgmma.cuh: warp-specialised wgmma, sm_90 only) against
    version 5 on one GPU, in one command (~2-3 min with the NVRTC compiles):

        python3 bench/probes/topk_probe.py --only mma6

    (1) One launch of a wave of row tiles (16896 rows on an H100) against 10^6 points at knn_d128's
    shape (K = 128, k = 10, TF32), interleaved 5 6 6 5, best of two medians of 3 (ms per launch, us
    per 128x256 tile per SM); whether each row's merged kSel first candidates (the sorted union of
    its 4 lists: v6's lists are another partition of the points) equal version 5's bit for bit (they
    do where wgmma sums a k8 step as mma.sync does; otherwise a few rows differ by near-ties of the
    TF32 values, which the planner's certificate absorbs). Also dot / largest at N = 2e5.
    (2) knn_d128's whole call (M = N = 10^6, k = 10) per version (plan.topk.MMA_VERSION): time, peak
    memory beyond the inputs, and the outputs of 256 spread rows against float64 (bench/run.py's
    rule: values within 1e-5 relative of the float64 value of the returned pair, no returned pair
    worse than the float64 k-th value by more than 1e-5 relative), and whether v6's outputs equal v5's.
    Prints one compact table last.

    Predicted (H100, bench/notes/knn.md "topk_mma v6"): version 5 12.6 us per tile, 49 ms per
    launch, knn_d128 3.2 s; version 6 ~3.5 us per tile (2.6-5 us), ~14 ms per launch (10-19 ms),
    knn_d128 ~1.1 s (0.9-1.5 s)."""
    import traceback

    import numpy as np

    from kermac_like.plan import core
    from kermac_like.plan import topk as P
    from kermac_like.runtime.launcher import get_kernel, launch
    from kermac_like.runtime.specs.topk import mma_sel, topk_mma_spec

    dev = torch.device("cuda")
    N, K, k = 10 ** 6, 128, 10
    slots = core._sm_count(0)
    rows = slots * 128
    sel = mma_sel(k)
    versions = (5, 6)
    print(f"{slots} SMs, capability {torch.cuda.get_device_capability(0)}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, K, device=dev, generator=g)
    y = torch.randn(N, K, device=dev, generator=g)
    tiles = rows // 128 * (-(-N // 256))
    table = []

    def launcher_of(v, dot=False, largest=False, n=N):
        kern = get_kernel(topk_mma_spec(dot, largest, k, version=v), 0)
        scratch = torch.full((4, rows, sel), -3, dtype=torch.int64, device=dev)
        args = (x.data_ptr(), y.data_ptr(), scratch.data_ptr(), np.int32(rows), np.int32(n), np.int32(K),
                np.int64(K), np.int64(K), np.int32(1), np.int32(1), np.int32(1), *(np.int64(0),) * 6,
                np.int32(1), np.int32(-(-n // 256)))
        return (lambda: launch(kern, (rows // 128, 1, 1), args)), scratch

    def merged(scratch):
        return torch.sort(scratch.permute(1, 0, 2).reshape(rows, -1), dim=1).values[:, :sel]

    per_launch, same_rows = {}, {}
    try:
        t0 = time.time()
        runs = {v: launcher_of(v) for v in versions}
        print(f"compiled in {time.time() - t0:.1f} s", flush=True)
        for v in versions:
            runs[v][0]()
        torch.cuda.synchronize()
        m5 = merged(runs[5][1])
        for v in versions:
            same_rows[v] = int((merged(runs[v][1]) == m5).all(1).sum())
        times = {}
        for v in versions + versions[::-1]:
            times.setdefault(v, []).append(time_ms(runs[v][0], reps=3))
        for v in versions:
            per_launch[v] = min(times[v])
            print(f"version {v}: {per_launch[v]:.2f} ms per launch, {per_launch[v] * 1e3 / (tiles / slots):.2f} us per "
                  f"tile; rows whose merged candidates == version 5: {same_rows[v]} of {rows}", flush=True)
        del runs
    except Exception:
        traceback.print_exc()
    for dot, largest in ((True, True), (False, True)):
        try:
            runs = {v: launcher_of(v, dot, largest, n=2 * 10 ** 5) for v in versions}
            for v in versions:
                runs[v][0]()
            torch.cuda.synchronize()
            same = int((merged(runs[6][1]) == merged(runs[5][1])).all(1).sum())
            print(f"dot={dot} largest={largest} (N = 2e5): rows with v6 merged == v5: {same} of {rows}", flush=True)
            table.append((f"merged == v5, dot={dot} largest={largest}", f"{same}/{rows}"))
            del runs
        except Exception:
            traceback.print_exc()

    calls = {}
    try:
        xm = torch.randn(M, K, device=dev, generator=g)
        pick = torch.linspace(0, M - 1, 256, device=dev).long()
        ref, yd = [], y.double()
        yn = (yd * yd).sum(1)[None]
        for c in range(0, 256, 32):  # float64 distances of the checked rows, 32 rows at a time
            xs = xm[pick[c:c + 32]].double()
            d = (xs * xs).sum(1, keepdim=True) - 2 * xs @ yd.T + yn
            ref.append(d.clamp_min_(0).sqrt_())
            del d
        ref = torch.cat(ref)  # (256, N)
        del yd, yn
        kth = torch.topk(ref, k, dim=1, largest=False).values[:, -1:]
        outs = {}
        for v in versions:
            os.environ["KERMAC_LIKE_TOPK_MMA_VERSION"] = str(v)
            t, extra, (vals, idx) = whole_knn(xm, y, k, rows)
            got = torch.gather(ref, 1, idx[pick])
            err = ((vals[pick].double() - got).abs() / got.abs().clamp_min(1e-30)).max().item()
            worse = int((got > kth + 1e-5 * kth).sum())
            outs[v] = (vals, idx)
            same = torch.equal(vals, outs[5][0]) and torch.equal(idx, outs[5][1])
            idx_same = float((idx == outs[5][1]).all(1).float().mean())
            calls[v] = (t, extra, err, worse, same, idx_same)
            print(f"knn_d128 MMA_VERSION={v}: {t:.0f} ms, peak {extra:.0f} MiB beyond inputs (outputs included); "
                  f"256 rows vs float64: max rel error {err:.2e}, pairs beyond the k-th {worse}; outputs == v5: {same} "
                  f"(rows with equal indices {idx_same:.6f})", flush=True)
            if v != 5:
                del outs[v]
        os.environ.pop("KERMAC_LIKE_TOPK_MMA_VERSION", None)
    except Exception:
        traceback.print_exc()
        os.environ.pop("KERMAC_LIKE_TOPK_MMA_VERSION", None)

    print("\n| version | ms per launch | us per tile | merged == v5 (rows) | knn_d128 ms | peak MiB | max rel err | "
          "beyond k-th | outputs == v5 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in versions:
        pl = per_launch.get(v)
        c = calls.get(v)
        print(f"| {v} | {pl:.2f} | {pl * 1e3 / (tiles / slots):.2f} | {same_rows.get(v)}/{rows} | " if pl else
              f"| {v} | - | - | - | ", end="")
        print(f"{c[0]:.0f} | {c[1]:.0f} | {c[2]:.1e} | {c[3]} | {c[4]} ({c[5]:.6f} rows) |" if c else "- | - | - | - | - |")
    for name, val in table:
        print(f"{name}: {val}")


def run_rescore(M=10 ** 6):
    """the setting topk_fused_rescore (cuda_templates/topk_rescore.cuh) against the torch rescoring:
    one launch's wave of rows against 10^6 points (D = 128, k = 10) with the rescoring alone
    timed on the same candidate scratch (and its extra memory), then knn_d128's whole call
    (M = N = 10^6) with the flag off and on: CUDA events, median of 3, and the peak memory
    beyond inputs and outputs."""
    import numpy as np

    from kermac_like.plan import core
    from kermac_like.plan import topk as P
    from kermac_like.runtime.launcher import get_kernel, launch
    from kermac_like.runtime.specs.topk import RESCORE_WARPS, mma_sel, topk_mma_spec, topk_rescore_spec

    dev = torch.device("cuda")
    N, K, k = 10 ** 6, 128, 10
    rows = core._sm_count(0) * 128
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, K, device=dev, generator=g)
    y = torch.randn(N, K, device=dev, generator=g)
    sel = mma_sel(k)
    kern = get_kernel(topk_mma_spec(False, False, k), 0)
    split = 1
    scratch = torch.empty((4 * split, rows, sel), dtype=torch.int64, device=dev)
    launch(kern, (rows // 128, split, 1), (x.data_ptr(), y.data_ptr(), scratch.data_ptr(), np.int32(rows), np.int32(N),
                                           np.int32(K), np.int64(K), np.int64(K), np.int32(1), np.int32(1), np.int32(1),
                                           *(np.int64(0),) * 6, np.int32(split), np.int32(-(-N // 256))))
    ynorm = torch.linalg.vector_norm(y, dim=1).max()
    out = {f: (torch.empty(rows, k, device=dev), torch.empty(rows, k, dtype=torch.int64, device=dev),
               torch.empty(rows, dtype=torch.bool, device=dev)) for f in (False, True)}
    fused_k = get_kernel(topk_rescore_spec(False, False), 0)
    flags = torch.empty(rows, dtype=torch.uint8, device=dev)

    def torch_path():
        v, i, ok = out[False]
        idx, pad, last = P.merged_candidates(scratch, sel, N, False, False)
        for s0 in range(0, rows, P.RESCORE_ROWS):
            s1 = min(rows, s0 + P.RESCORE_ROWS)
            vv, ii, oo = P.rescore(x[s0:s1], y, idx[s0:s1], pad[s0:s1], last[s0:s1], ynorm, k, dot=False,
                                   largest=False)
            v[s0:s1], i[s0:s1], ok[s0:s1] = vv.sqrt(), ii, oo

    def fused_path():
        v, i, ok = out[True]
        xn = torch.linalg.vector_norm(x, dim=1)
        launch(fused_k, (-(-rows // RESCORE_WARPS), 1, 1),
               (scratch.data_ptr(), x.data_ptr(), y.data_ptr(), xn.data_ptr(), ynorm.data_ptr(), v.data_ptr(),
                i.data_ptr(), flags.data_ptr(), np.int32(rows), np.int32(N), np.int32(K), np.int32(k), np.int32(sel),
                np.int32(4 * split), np.int64(K), np.int64(K), np.int64(k), np.int64(1), np.int64(k), np.int64(1),
                np.float32(K * 2.0 ** -22), np.int32(1)))
        ok.copy_(flags != 0)

    for name, fn in (("torch rescore()", torch_path), ("topk_rescore_kernel", fused_path)):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time_ms(fn, reps=3)
        extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        print(f"{name}: {t:.2f} ms per launch of {rows} rows (kSel {sel}, {4 * split} lists), {extra:.1f} MiB extra")
    (v0, i0, o0), (v1, i1, o1) = out[False], out[True]
    print(f"  same indices in {int((i0 == i1).all(1).sum())} of {rows} rows, same certificates in "
          f"{int((o0 == o1).sum())}, certified {int(o1.sum())}; max |dv|/v {float(((v1 - v0).abs() / v0).max()):.2e}")
    del x, scratch, out
    xm = torch.randn(M, K, device=dev, generator=g)
    for flag in (False, True):
        os.environ["KERMAC_LIKE_TOPK_FUSED_RESCORE"] = str(int(flag))
        fused(km.PRESETS["l2"], xm[:rows], y, k, False)  # compiled and warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time_ms(lambda: km.knn(xm, y, k), reps=3, warm=0)
        extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        print(f"knn_d128 M = N = 10^6, k = 10, FUSED_RESCORE={flag}: {t:.0f} ms, peak {extra:.0f} MiB beyond inputs "
              f"(outputs {M * k * 12 / 2 ** 20:.0f} MiB included)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["check", "time", "variants", "mma", "mma3", "mma6", "rescore"])
    ap.add_argument("--cases", default="", help="comma-separated timing rows (default: all)")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(0))
    t0 = time.time()
    if a.only in (None, "check"):
        run_checks()
    if a.only in (None, "time"):
        run_timings(a.quick, a.cases.split(',') if a.cases else ())
    if a.only == "variants":
        run_variants()
    if a.only == "mma":
        run_mma_parts()
    if a.only == "mma3":
        run_mma3()
    if a.only == "mma6":
        run_mma6()
    if a.only == "rescore":
        run_rescore()
    print(f"total {time.time() - t0:.1f} s")
