"""Small calls of every kernel family, for compute-sanitizer (bench/sanitize.sh).

    python3 bench/probes/sanitize_calls.py --list          # the family names
    python3 bench/probes/sanitize_calls.py simt wgmma      # run some families
    python3 bench/probes/sanitize_calls.py --warm          # compile everything (no sanitizer)

One family is one entry of FAMILIES: a function making a few calls at odd sizes with
a batch of 2 (ragged tiles, K tails, both output layouts where the family has them),
and the environment it needs. The output is checked against the float64 reference,
so that a run under the sanitizer also shows the calls did their work.
"""

from __future__ import annotations

import functools
import argparse
import os
import sys

import torch

import kermac_like as km
from kermac_like import config
from kermac_like.plan import distance as P
from kermac_like.ops.distance import prepare_call
from kermac_like.reference import cdist_grad_reference, distance_reference
from kermac_like.plan import autotune

SIZES = (2, 131, 97, 37)  # batch, M, N, K: odd, ragged against every tile shape
TC_SIZES = (2, 131, 97, 40)  # the tensor-core kernels take rows of whole 16-byte chunks


def _data(seed=0, dtype=torch.float32, sizes=SIZES):
    L, M, N, K = sizes
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(L, M, K, device="cuda", generator=g).to(dtype),
            torch.randn(L, N, K, device="cuda", generator=g).to(dtype))


def _check(out, desc, a, b, tol, p=None, **kw):
    ref = distance_reference(desc, a.double(), b.double(), inner_p=p, outer_p=p, **kw)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < tol, f"{desc!r}: relative error {err:.2e}"


def _run(desc, a, b, out, mode, kind, **kw):
    """run_kernel, or with ``kind`` (plan.autotune's) the plan of that kind itself."""
    if kind is None:
        return km.run_kernel(desc, a, b, out=out, compute_mode=mode, **kw)
    call = prepare_call(desc, a, b, **kw)
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    plan = P._plan_distance_gpu(call, out, mode, False, P.Settings.current(), kind)
    assert plan is not None and plan.family == {autotune.SIMT: "distance", autotune.LOWK: "distance_lowk"}[kind]
    return plan.run()


def _distance(descs, mode, dtypes=(torch.float32,), tol=1e-4, kind=None):
    for dtype in dtypes:
        a, b = _data(dtype=dtype, sizes=SIZES if mode.startswith("donot") else TC_SIZES)
        for name in descs:
            desc = km.PRESETS[name]
            kw = {"bandwidth": 7.0} if desc.needs_bandwidth else {}
            if desc.needs_inner_p:
                kw["p"] = 1.3
            for out_t in (False, True):  # row-major and column-major output
                out = torch.empty(2, 97, 131, device="cuda", dtype=dtype).mT if out_t else None
                assert desc.is_euclidean or mode.startswith("donot")
                res = _run(desc, a, b, out, mode, kind, regularization=0.5, **kw)
                _check(res, desc, a, b, tol, regularization=0.5, **kw)
        # K = 264: more k-tiles than pipeline stages (every ring wraps), one descriptor
        # (the low-K kernel's generic variant takes K up to 256: K = 200 there)
        K2 = 200 if kind == autotune.LOWK else 264
        a2, b2 = _data(seed=3, dtype=dtype, sizes=(2, 131, 300, K2))
        desc = km.PRESETS["l2"]
        _check(_run(desc, a2, b2, None, mode, kind), desc, a2, b2, tol)
        # transposed (column-major) operands, both alignments: the SIMT loaders
        if mode.startswith("donot"):
            at = a.mT.contiguous().mT
            bt = torch.empty(2, 37, 98, device="cuda")[..., 1:].mT  # unaligned column-major
            bt.copy_(b)
            res = _run(km.PRESETS["l1"], at, bt, None, mode, kind)
            _check(res, km.PRESETS["l1"], a, b, tol)


_EXACT = ["l1", "l2", "p_norm", "laplace_l2", "gaussian_l2", "dot"]


def simt():
    _distance(_EXACT, "donot_use_mm_for_euclid_dist", kind=autotune.SIMT)
    # Both tunings of |x - y| sums (runtime/specs/distance.py): K = 100 takes the moderate-K
    # tuning where two blocks fit an SM (sm_90), K = 400 the default; row-major operands and
    # k-major (column-major) ones.
    desc = km.PRESETS["l1"]
    for K in (100, 400):
        a, b = _data(seed=8, sizes=(1, 131, 300, K))
        for x, y in ((a, b), (a.mT.contiguous().mT, b.mT.contiguous().mT)):
            _check(_run(desc, x, y, None, "donot_use_mm_for_euclid_dist", autotune.SIMT), desc, a, b, 1e-4)


def lowk():
    _distance(_EXACT, "donot_use_mm_for_euclid_dist", kind=autotune.LOWK)
    a, b = _data(seed=5, sizes=(2, 131, 97, 3))  # K = 3: the unrolled variants
    for name in ("l1", "gaussian_l2", "p_norm"):
        desc = km.PRESETS[name]
        kw = {"bandwidth": 2.0} if desc.needs_bandwidth else ({"p": 1.3} if desc.needs_inner_p else {})
        _check(_run(desc, a, b, None, "donot_use_mm_for_euclid_dist", autotune.LOWK, **kw), desc, a, b, 1e-4, **kw)
    # torch.cdist's matrix-product NaN/inf (kMmNonFinite) over several tiles per block:
    # N = 300 (three 128-wide tiles, two blocks along n), one infinite coordinate in b's
    # third tile (a flagged tile computed by mm_tile), the others finite.
    a, b = _data(seed=6, sizes=(1, 131, 300, 8))
    b[0, 270, 2] = float("inf")
    for name in ("l2", "laplace_l2"):
        desc = km.PRESETS[name]
        kw = {"bandwidth": 2.0} if desc.needs_bandwidth else {}
        res = _run(desc, a, b, None, "use_mm_for_euclid_dist_if_necessary", autotune.LOWK, **kw)
        fin = torch.isfinite(b[0]).all(-1)
        _check(res[..., fin], desc, a, b[:, fin], 1e-4, **kw)
    # Eight tiles per block (the planner's choice beyond K = 8 on large outputs), forced
    # here at a small size: 131 x 1100 (the last block's later tiles past N).
    with P.spec_override(lowk_tiles_n=lambda *args: 8):
        a, b = _data(seed=7, sizes=(1, 131, 1100, 37))
        _check(_run(km.PRESETS["l1"], a, b, None, "donot_use_mm_for_euclid_dist", autotune.LOWK), km.PRESETS["l1"],
               a, b, 1e-4)
    # The chunk stream (p = 1 at 64 < K <= LOWK_CHUNKED_UP_TO: runtime/specs/distance_lowk.py):
    # K = 100 (4 chunks of 25) and K = 97 (the last chunk partly zero-filled), row-major and
    # k-major (column-major) operands, a ragged 131 x 300 output over several tiles.
    desc = km.PRESETS["l1"]
    for K in (100, 97):
        a, b = _data(seed=9, sizes=(1, 131, 300, K))
        for x, y in ((a, b), (a.mT.contiguous().mT, b.mT.contiguous().mT)):
            _check(_run(desc, x, y, None, "donot_use_mm_for_euclid_dist", autotune.LOWK), desc, a, b, 1e-4)


def matvec():
    """kernel_matvec forward (one and several columns, a batch, M small enough for the
    split-N combination, the fused wgmma kernel at K > 32) and its backward with respect to
    x, y and v; the blocked float64 mode through a small Nystrom fit (Falkon's products)."""
    g = torch.Generator(device="cuda").manual_seed(4)
    from kermac_like.solvers import KernelRidge
    xs = torch.rand(3001, 8, device="cuda", generator=g)
    ys = torch.sin(4 * xs).sum(1, keepdim=True)
    model = KernelRidge(kernel="gaussian_l2", bandwidth=1.5, alpha=1e-3, solver="nystrom", n_centers=200,
                        random_state=0).fit(xs, ys)
    assert float((model.predict(xs) - ys).square().mean()) < 0.05, "Nystrom fit failed"
    # K = 37 / 40 with the Euclidean descriptors and DOT: the fused wgmma kernel on sm_90
    # (matvec_wgmma.cuh; several N tiles, C = 1 and the 16-column bucket), SIMT elsewhere.
    for K, C, (L, M, N) in ((3, 1, (2, 37, 1031)), (8, 3, (2, 131, 97)), (37, 1, (1, 5, 2049)),
                            (40, 16, (2, 131, 600))):
        x = torch.randn(L, M, K, device="cuda", generator=g)
        y = torch.randn(L, N, K, device="cuda", generator=g)
        v = torch.randn(L, N, C, device="cuda", generator=g)
        for name in ("gaussian_l2", "laplace_l1", "p_norm", "dot"):
            desc = km.PRESETS[name]
            kw = {"bandwidth": 3.0} if desc.needs_bandwidth else ({"p": 1.3} if desc.needs_inner_p else {})
            res = km.kernel_matvec(desc, x, y, v, regularization=0.25, **kw)
            ref = km.run_kernel(desc, x.double(), y.double(), regularization=0.25, **kw) @ v.double()
            err = float((res.double() - ref).norm() / ref.norm())
            assert err < 1e-4, f"kernel_matvec {name} K={K} C={C}: relative error {err:.2e}"
    # A float64 out of float32 inputs (TOut = double): the split path (few rows: float64 scratch and
    # combination) and, with many rows, one launch; D = 3 takes the tuned loop (prefetch, trips of 4).
    for L, M, N in ((2, 37, 1031), (1, 4096, 300)):
        x = torch.randn(L, M, 3, device="cuda", generator=g)
        y = torch.randn(L, N, 3, device="cuda", generator=g)
        v = torch.randn(L, N, 1, device="cuda", generator=g)
        desc = km.PRESETS["gaussian_l2"]
        out = torch.full((L, M, 1), float("nan"), dtype=torch.float64, device="cuda")
        km.kernel_matvec(desc, x, y, v, bandwidth=3.0, out=out)
        ref = km.run_kernel(desc, x.double(), y.double(), bandwidth=3.0) @ v.double()
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-5, f"kernel_matvec float64 out M={M}: relative error {err:.2e}"
    x = torch.randn(2, 37, 3, device="cuda", generator=g, requires_grad=True)
    y = torch.randn(2, 301, 3, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(2, 301, 2, device="cuda", generator=g, requires_grad=True)
    for name in ("gaussian_l2", "laplace_l2", "dot"):
        desc = km.PRESETS[name]
        kw = {"bandwidth": 2.0} if desc.needs_bandwidth else {}
        km.kernel_matvec(desc, x, y, v, **kw).square().sum().backward()
        assert all(bool(t.grad.isfinite().all()) for t in (x, y, v))
        x.grad = y.grad = v.grad = None


def mma():
    _distance(["l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot"], "use_mm_for_euclid_dist",
              dtypes=(torch.float32, torch.float16), tol=2e-2)


def wgmma():
    if torch.cuda.get_device_capability() != (9, 0):
        print("wgmma: not an sm_90 device, skipped")
        return
    _distance(["l2", "laplace_l2", "gaussian_l2", "dot"], "use_mm_for_euclid_dist")


def wgmma_wide():
    """The wide tiles with partial sums (setting wgmma_tile 192 or 256): the wgmma family's calls, then
    N whose 192-column tiles straddle two 256-row prepared blocks (N = 700: n0 = 384 reads rows
    128-255 of block 1 and 0-63 of block 2) or end at the prepared rows (N = 200, 450: the copies and
    norms clipped at n_pad), K = 72 (an odd count of k-tiles: the column halves' last chunk of one),
    and a self-distance with its exact-zero diagonal across tiles."""
    wgmma()
    if torch.cuda.get_device_capability() != (9, 0):
        return
    desc = km.PRESETS["l2"]
    for seed, N in ((4, 200), (5, 450), (6, 700)):
        a, b = _data(seed=seed, sizes=(2, 131, N, 72))
        _check(_run(desc, a, b, None, "use_mm_for_euclid_dist", None), desc, a, b, 1e-4)
    x = _data(seed=7, sizes=(1, 450, 1, 72))[0]
    d = km.cdist(x, x)
    assert (torch.diagonal(d[0]) == 0).all(), "self-distance diagonal not zero"
    _check(d, desc, x, x, 1e-4)


def _grad():
    L, K, M, N, O = 2, 45, 37, 21, 5
    g = torch.Generator(device="cuda").manual_seed(1)
    a, b = torch.randn(L, K, M, device="cuda", generator=g), torch.randn(L, N, K, device="cuda", generator=g)
    c, d = torch.randn(L, O, K, device="cuda", generator=g), torch.randn(L, N, M, device="cuda", generator=g)
    a4 = torch.randn(L, K, 40, device="cuda", generator=g)  # M % 4 == 0: the 16-byte variant
    d4 = torch.randn(L, N, 40, device="cuda", generator=g)
    for p in (1.0, 2.0, 1.3):
        for aa, dd in ((a, d), (a4, d4)):
            out = km.cdist_grad(aa, b, c, dd, p=p)
            ref = cdist_grad_reference(aa.double(), b.double(), c.double(), dd.double(), p)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-4, f"cdist_grad p={p}: relative error {err:.2e}"


def grad_simt():
    _grad()


def grad_mma():
    _grad()


def linalg():
    # cuSOLVER's own kernels only (the sanitizer's reports in them are filtered out):
    # present so that the filter itself is exercised.
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, 33, 33, device="cuda", generator=g)
    a = x @ x.mT + 33 * torch.eye(33, device="cuda")
    b = torch.randn(2, 3, 33, device="cuda", generator=g)  # rows are right-hand sides
    km.linalg.solve_cholesky(a, b)
    km.linalg.solve_lu(a, b)
    km.linalg.eigh(a)
    torch.cuda.synchronize()


def _knn_check(x, y, k, p=2.0, largest=False):
    v, i = km.knn(x, y, k, p=p, largest=largest)
    d = torch.cdist(x.double(), y.double(), p=p)
    want = torch.topk(d, k, dim=-1, largest=largest, sorted=True).values
    err = float(((v.double() - want).abs() / want.abs().clamp_min(1e-30)).max())
    assert err < 1e-4, f"knn p={p} k={k}: relative error {err:.2e}"
    got = torch.gather(d, -1, i)
    assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) < 1e-4, f"knn p={p} k={k}: indices"


def topk():
    """topk.cuh: register lists (k <= 32), memory lists (k > 32), split N with the combine
    (few rows against many points), batches, largest, kernel_topk over a kernel descriptor."""
    g = torch.Generator(device="cuda").manual_seed(9)
    for (L, M, N, K), ks in (((2, 131, 97, 3), (1, 5, 16)), ((2, 37, 1500, 8), (10, 33)),
                             ((1, 3, 3000, 37), (1, 64, 200)), ((2, 300, 1100, 64), (24,))):
        x = torch.randn(L, M, K, device="cuda", generator=g)
        y = torch.randn(L, N, K, device="cuda", generator=g)
        for k in ks:
            for p in (2.0, 1.0, 1.5):
                _knn_check(x, y, k, p=p)
        _knn_check(x, y, ks[0], largest=True)
    x = torch.randn(2, 50, 5, device="cuda", generator=g)
    y = torch.randn(2, 900, 5, device="cuda", generator=g)
    v, i = km.kernel_topk(km.PRESETS["gaussian_l2"], x, y, 7, bandwidth=1.5)
    want = torch.topk(distance_reference(km.PRESETS["gaussian_l2"], x.double(), y.double(), bandwidth=1.5), 7,
                      dim=-1).values
    assert float((v.double() - want).abs().max()) < 1e-5, "kernel_topk gaussian"


def topk_mma():
    """topk_mma.cuh (K > 64: TF32 candidates, rescored): several y tiles, ragged M / N, k <= 16,
    a batch, and few rows (split N)."""
    g = torch.Generator(device="cuda").manual_seed(10)
    for L, M, N, K in ((2, 131, 700, 128), (1, 5, 3000, 96), (1, 257, 513, 200)):
        x = torch.randn(L, M, K, device="cuda", generator=g)
        y = torch.randn(L, N, K, device="cuda", generator=g)
        for k in (1, 10, 16):
            _knn_check(x, y, k)
    # unbatched, K <= 128: the planner's version (6, warp-specialised wgmma, on sm_90; else 5),
    # several y tiles and a ragged last one
    for M, N, K in ((300, 2000, 128), (129, 1500, 72)):
        x = torch.randn(M, K, device="cuda", generator=g)
        y = torch.randn(N, K, device="cuda", generator=g)
        for k in (1, 10):
            _knn_check(x, y, k)
    # binary points, x their copies: ties at the k-th value leave rows uncertified, recomputed by the SIMT
    # selection (topk.cuh's wide buckets kK = 96, 128)
    for M, N, K in ((200, 1500, 128), (70, 900, 96)):
        y = torch.randint(0, 2, (N, K), device="cuda", generator=g).float()
        _knn_check(y[:M].clone(), y, 10)


def topk_rescore():
    """topk_rescore.cuh (the setting topk_fused_rescore): topk_mma's cases with the fused rescoring,
    and several launches of one wave (a short last one) by a small SM count."""
    from kermac_like.plan import topk as plan_topk
    sm = plan_topk._sm_count
    try:
        g = torch.Generator(device="cuda").manual_seed(12)
        for M, N, K in ((131, 700, 128), (5, 3000, 96), (257, 513, 200)):
            x = torch.randn(M, K, device="cuda", generator=g)
            y = torch.randn(N, K, device="cuda", generator=g)
            for k in (1, 10, 16):
                _knn_check(x, y, k)
        plan_topk._sm_count = lambda device: 1  # 128 rows per launch
        x = torch.randn(300, 128, device="cuda", generator=g)
        _knn_check(x, torch.randn(900, 128, device="cuda", generator=g), 10)
    finally:
        plan_topk._sm_count = sm


def logsumexp():
    """logsumexp.cuh (the fused kernel): several column chunks, a -inf weight column, a batch,
    the underflowing bandwidth, few rows (split N)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    for (L, M, N, K, C), bw in (((2, 131, 1031, 3, 11), 0.5), ((1, 7, 5000, 8, 1), 1e-3), ((2, 300, 97, 37, 2), 2.0)):
        x = torch.randn(L, M, K, device="cuda", generator=g)
        y = torch.randn(L, N, K, device="cuda", generator=g)
        lw = torch.randn(L, N, C, device="cuda", generator=g)
        lw[..., 0, :] = -float("inf")
        for name in ("gaussian_l2", "laplace_l2"):
            desc = km.PRESETS[name]
            got = km.kernel_logsumexp(desc, x, y, lw, bandwidth=bw)
            phi = torch.cdist(x.double(), y.double())
            phi = phi / bw if name.startswith("laplace") else phi.square() / (2 * bw * bw)
            want = torch.logsumexp(-phi[..., None] + lw.double()[..., None, :, :], dim=-2)
            err = float(((got.double() - want).abs() / want.abs().clamp_min(1)).max())
            assert err < 1e-5, f"kernel_logsumexp {name} bw={bw}: error {err:.2e}"


def kmeans():
    """cluster.KMeans on the GPU: k-means++ seeding (the fused kernels), the k = 1 assignment and the update."""
    from kermac_like.cluster import KMeans
    g = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(3001, 16, device="cuda", generator=g)
    km_ = KMeans(n_clusters=37, max_iter=5, random_state=0).fit(x)
    d = torch.cdist(x.double(), km_.cluster_centers_.double())
    gap = d.gather(1, km_.labels_.long()[:, None]) - d.min(1, keepdim=True).values
    assert float(gap.abs().max()) < 1e-5, "KMeans labels are not the nearest centres"
    # the fused k-means++ seeding (cuda_templates/kmeans.cuh): weights, the runtime-K update,
    # N not a multiple of its 1024-point block, several rounds (300 centres; far blobs: rounds
    # ended by rejected proposals), every p zero (the degenerate draws)
    from kermac_like.testing import kmeans_seeding

    kmeans_plusplus = kmeans_seeding.kmeans_plusplus
    w = torch.rand(3001, device="cuda", generator=g)
    w[::3] = 0
    for D in (3, 40):
        xd = torch.randn(3001, D, device="cuda", generator=g)
        xd += 40 * torch.randn(64, D, device="cuda", generator=g)[torch.randint(0, 64, (3001,), device="cuda",
                                                                               generator=g)]
        c, idx = kmeans_plusplus(xd, 300, w, torch.Generator(device="cuda").manual_seed(1))
        assert torch.equal(c, xd[idx]) and bool((w[idx] > 0).all()), "fused seeding drew a zero-weight point"
    wz = torch.zeros(3001, device="cuda")
    wz[[5, 2000]] = 1.0
    c, idx = kmeans_plusplus(xd, 4, wz, torch.Generator(device="cuda").manual_seed(1))
    assert sorted(idx[:2].tolist()) == [5, 2000] and idx[2:].tolist() == [3000, 3000], "degenerate draws"
    # the tensor-core assignment (kmeans_assign_mma.cuh): kK 8 and 16, several centre tiles (C = 300),
    # N not a multiple of the CTA's rows, a duplicate centre and points on bisectors (uncertified rows:
    # the kernel's exact rescan), against knn's labels and distance bits
    from kermac_like import knn
    from kermac_like.plan import kmeans as plan_km
    for K, C in ((5, 300), (16, 37)):
        xa = torch.randn(2017, K, device="cuda", generator=g)
        ca = xa[torch.randperm(2017, device="cuda", generator=g)[:C]].clone()
        ca[C - 1] = ca[0]
        ar = torch.arange(64, device="cuda")
        xa[:64] = 0.5 * (ca[ar % C] + ca[(ar + 1) % C])
        lab, dist, cert = plan_km.plan_assign(xa, ca, certificates=True).run()
        d_ref, l_ref = knn(xa, ca, 1, compute_mode="donot_use_mm_for_euclid_dist")
        assert torch.equal(lab, l_ref[:, 0]) and torch.equal(dist, d_ref[:, 0]), "tensor-core assignment differs"
    # Lloyd's pruned iterations (kmeans_bounds_kernel, the assignment on a work list with bounds) against
    # every point assigned: blob data, N not a multiple of the filter's 256 points
    means = 4 * torch.randn(40, 16, device="cuda", generator=g)
    xb = means[torch.randint(0, 40, (5003,), device="cuda", generator=g)] + torch.randn(5003, 16, device="cuda",
                                                                                         generator=g)
    fits = []
    for on in (True, False):
        with config.override(kmeans_bounds=on):
            m = KMeans(n_clusters=40, max_iter=12, tol=0.0, random_state=0).fit(xb)
        fits.append((m.labels_, m.cluster_centers_, m.inertia_))
    assert torch.equal(fits[0][0], fits[1][0]) and torch.equal(fits[0][1], fits[1][1]), "pruned fit differs"


def falkon(sizes=((3001, 517, 8, 1), (777, 300, 13, 3), (130, 1000, 27, 5)), fit=True):
    """Falkon's products on tensor cores (falkon_mma.cuh): the prep, rows and cols kernels at odd N and M, K in
    three buckets, several column chunks, split launches; then a nystrom fit on them."""
    from kermac_like.plan.falkon import FalkonProducts
    g = torch.Generator(device="cuda").manual_seed(21)
    for n, m, k, c in sizes:
        x = torch.rand(n, k, device="cuda", generator=g)
        z = x[:min(m, n)].clone() if m <= n else torch.rand(m, k, device="cuda", generator=g)
        fp = FalkonProducts(z, 0.8)
        v = torch.randn(m, c, device="cuda", dtype=torch.float64, generator=g)
        w = torch.randn(n, c, device="cuda", dtype=torch.float64, generator=g)
        kmat = torch.exp(-torch.cdist(x.double(), z.double()) ** 2 / (2 * 0.8 ** 2))
        for got, ref in ((fp.rows(x, v), kmat @ v.float().double()), (fp.cols(x, w), kmat.T @ w.float().double())):
            assert float((got - ref).norm() / ref.norm()) < 1e-5, "falkon products differ from float64"
        # the several-column rows kernel (GPyTorch's CG products): 8- and 16-column launches, a strided v
        fpv = FalkonProducts(z, 0.8, columns="pv")
        vw = torch.randn(m, 2 * c + 13, device="cuda", generator=g)
        for cols in (slice(0, 2 * c + 11), slice(1, c + 3)):
            vv = vw[:, cols]
            got, ref = fpv.rows_pv(x, vv), kmat @ vv.double()
            assert float((got - ref).norm() / ref.norm()) < 1e-5, "rows_pv differs from float64"
    if not fit:
        return
    from kermac_like.solvers import KernelRidge
    xs = torch.rand(6000, 8, device="cuda", generator=g)
    ys = torch.sin(3 * xs).sum(1)
    KernelRidge("gaussian_l2", bandwidth=0.8, alpha=1e-4, solver="nystrom", n_centers=700, random_state=0).fit(xs, ys)


# name -> (function, environment)
FAMILIES = {
    "simt": (simt, {}),
    "lowk": (lowk, {}),
    "matvec": (matvec, {}),
    "mma": (mma, {"KERMAC_LIKE_WGMMA": "0"}),
    "wgmma": (wgmma, {"KERMAC_LIKE_WGMMA": "always"}),  # also the few-tile calls here
    # the distance kernel with one running sum, and with partial sums of two k-tiles (wgmma_chunk)
    "wgmma_chunk0": (wgmma, {"KERMAC_LIKE_WGMMA": "always", "KERMAC_LIKE_WGMMA_CHUNK": "0"}),
    "wgmma_chunk2": (wgmma, {"KERMAC_LIKE_WGMMA": "always", "KERMAC_LIKE_WGMMA_CHUNK": "2"}),
    # partial sums of two k-tiles in 128 x 192 tiles, and in 128 x 256 tiles by column halves (wgmma_tile)
    "wgmma_tile192": (wgmma_wide, {"KERMAC_LIKE_WGMMA": "always", "KERMAC_LIKE_WGMMA_CHUNK": "2",
                                   "KERMAC_LIKE_WGMMA_TILE": "192"}),
    "wgmma_tile256": (wgmma_wide, {"KERMAC_LIKE_WGMMA": "always", "KERMAC_LIKE_WGMMA_CHUNK": "2",
                                   "KERMAC_LIKE_WGMMA_TILE": "256"}),
    "grad_simt": (grad_simt, {"KERMAC_LIKE_GRAD_MMA": "0"}),
    "grad_mma": (grad_mma, {"KERMAC_LIKE_GRAD_MMA": "1"}),
    "linalg": (linalg, {}),
    "topk": (topk, {}),
    "topk_mma": (topk_mma, {}),
    "topk_rescore": (topk_rescore, {}),
    "logsumexp": (logsumexp, {}),
    "kmeans": (kmeans, {}),
    "falkon": (falkon, {}),
    # every falkon kernel once at one small size, for racecheck (the whole family takes it > 200 s)
    "falkon_small": (functools.partial(falkon, sizes=((777, 300, 13, 3),), fit=False), {}),
}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help="the families to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the families' names and exit")
    parser.add_argument("--warm", action="store_true", help="run every family once (compiles the kernels)")
    args = parser.parse_args(argv)
    if args.list:
        print(" ".join(FAMILIES))
        return
    unknown = [n for n in args.families if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {' '.join(FAMILIES)}")
    names = args.families or list(FAMILIES)
    for name in names:
        fn, env = FAMILIES[name]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fn()
            torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


if __name__ == "__main__":
    main(sys.argv[1:])
