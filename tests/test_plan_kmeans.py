"""plan/kmeans.py on the CPU (tests/conftest.py's as_gpu: the device queries and the kernel
loader stubbed, nothing launched): which seedings the fused kernels serve, the launches of the
seeding's rounds (the first block sums and draw, then gaps, fold and draw per round), the K
buckets and argument tuples of the lengths cuda_templates/ABI.md gives."""

import pytest
import torch

from kermac_like.plan import kmeans as plan_km
from kermac_like.plan.kmeans import Seeding, fused_serves
from kermac_like.runtime.specs.kmeans import TRIALS, draw_spec, gap_spec, k_bucket, update_spec


@pytest.fixture(autouse=True)
def _fused_on(settings):
    settings(kmeans_fused=True)  # on unless KERMAC_LIKE_KMEANS_FUSED=0 is set


def test_cpu_tensors_take_the_torch_path():
    assert not fused_serves(torch.zeros(10, 3))


def test_k_buckets():
    assert [k_bucket(k) for k in (1, 3, 4, 5, 16, 17, 32, 33, 256)] == [4, 4, 4, 8, 16, 32, 32, 0, 0]


@pytest.mark.parametrize("weighted", [False, True])
def test_round_launches(as_gpu, weighted):
    """Seeding's launches: first the weights' block sums (s = -1) and the draw of centre 0; after a
    round [s, e) the gaps (from the second round: one thread per earlier centre), the fold of the
    round's centres and the next round's draw from e; argument tuples of ABI.md's lengths."""
    N, K, C = 5000, 16, 300
    X = torch.randn(N, K)
    w = torch.rand(N) if weighted else None
    sd = Seeding(X, C, w, torch.rand(C, 2 * TRIALS + 1, dtype=torch.float64))
    assert sd.centres.shape == (C, K) and sd.centres.dtype == torch.float32 and sd.nb == 5
    first = sd.start()
    assert [ln.kernel.spec for ln in first] == [update_spec(K), draw_spec()]
    up, dr = first
    assert len(up.args) == 14 and up.grid == (5, 1, 1) and [int(a) for a in up.args[-2:]] == [-1, 0]
    assert (up.args[1] != 0) == weighted  # w, or 0 for unit weights
    assert [int(a) for a in up.args[9:12]] == [K, 1, K]  # sxm, sxk, ldc
    assert len(dr.args) == 18 and dr.grid == (1, 1, 1)
    assert [int(a) for a in dr.args[-4:]] == [5, C, 0, TRIALS]  # nb, C, s, trials
    assert dr.args[5] == sd.u.data_ptr() and dr.args[8] == sd.count.data_ptr()
    assert [ln.kernel.spec for ln in sd.round(0, 1)] == [update_spec(K), draw_spec()]  # no earlier centres: no gaps
    gap, up, dr = sd.round(1, 129)
    assert [ln.kernel.spec for ln in (gap, up, dr)] == [gap_spec(), update_spec(K), draw_spec()]
    assert gap.grid == (1, 1, 1) and [int(a) for a in gap.args[2:]] == [K, K, 1, 129]
    assert [int(a) for a in up.args[-2:]] == [1, 129] and int(dr.args[-2]) == 129
    assert sd.round(300 - 44, 300)[0].grid == (1, 1, 1) and sd.round(257, 300)[0].grid == (2, 1, 1)


def test_uniforms_shape_is_checked(as_gpu):
    with pytest.raises(ValueError, match="u: expected shape"):
        Seeding(torch.randn(100, 3), 4, None, torch.rand(4, dtype=torch.float64))


def test_float64_keeps_the_torch_path_and_16_bit_is_upcast(as_gpu):
    assert not fused_serves(torch.randn(100, 3, dtype=torch.float64))
    assert fused_serves(torch.randn(100, 40, dtype=torch.float16))
    sd = Seeding(torch.randn(100, 40, dtype=torch.float16), 3, None, torch.rand(3, 2 * TRIALS + 1, dtype=torch.float64))
    assert sd.x.dtype == torch.float32  # the upcast x
    assert sd.start()[0].kernel.spec == update_spec(40) and "float, 0>" in update_spec(40).traits


def test_segment_sums_plan(as_gpu):
    from kermac_like.plan.kmeans import plan_segment_sums
    from kermac_like.runtime.specs.kmeans import SEGSUM_ROWS, segsum_combine_spec, segsum_spec

    N, K, C = 10000, 16, 5
    labels = torch.tensor([0, 0, 0, 2, 4] * (N // 5))
    keys, perm = torch.sort(labels.to(torch.int16), stable=True)
    bounds = torch.searchsorted(keys, torch.arange(C + 1, dtype=torch.int16))
    plan = plan_segment_sums(torch.randn(N, K), perm, bounds, torch.rand(N), C)
    assert [launch.kernel.spec for launch in plan.launches] == [segsum_spec(), segsum_combine_spec()]
    main, comb = plan.launches
    assert len(main.args) == 11 and len(comb.args) == 6
    assert main.grid == (-(-N // SEGSUM_ROWS) + C, 1, 1)
    items = plan.scratch[3]
    assert items.tolist() == [0, 2, 2, 3, 3, 4]  # 6000 rows: 2 items; 2000: 1; empty clusters: 0
    assert plan.out.shape == (C * (K + 1),) and plan.out.dtype == torch.float64
    assert plan_segment_sums(torch.randn(N, K, dtype=torch.float64), perm, bounds, None, C) is None


# -- Lloyd's assignment on tensor cores (setting kmeans_assign_mma) --------------------------------------
def test_assign_switch_off_keeps_knn(as_gpu, monkeypatch, settings):
    """Off (KERMAC_LIKE_KMEANS_ASSIGN_MMA=0; on by default): no plan, cluster._assign takes knn."""
    from kermac_like.config import SETTINGS
    from kermac_like.plan.kmeans import assign_mma, plan_assign

    assert SETTINGS["kmeans_assign_mma"].default is True
    settings(kmeans_assign_mma=False)
    X, c = torch.randn(1000, 16), torch.randn(64, 16)
    assert plan_assign(X, c) is None and assign_mma(X, c) is None
    # on: K beyond ASSIGN_UP_TO (where the SIMT argmin measured as fast or faster) stays on knn,
    # though the kernel itself serves it
    settings(kmeans_assign_mma=True)
    X, c = torch.randn(1000, plan_km.ASSIGN_UP_TO + 1), torch.randn(64, plan_km.ASSIGN_UP_TO + 1)
    assert assign_mma(X, c) is None and plan_assign(X, c) is not None


@pytest.mark.parametrize("K, kK, block_m, block_n, split", [(16, 16, 256, 128, 0), (5, 8, 256, 128, 0),
                                                             (33, 64, 128, 32, 1), (32, 32, 128, 64, 0)])
def test_assign_switch_on_plans_the_kernel(as_gpu, monkeypatch, K, kK, block_m, block_n, split, settings):
    """On: the prep kernel (one CTA) then kmeans_assign_mma_kernel over ceil(N / kBlockM) CTAs, with
    the certificate's tau and topk's partial-sum rule; float64, K > 64 and CPU-only calls: no plan."""
    from kermac_like.plan.kmeans import assign_split, assign_tau, plan_assign
    from kermac_like.runtime.specs.kmeans import assign_prep_spec, assign_spec

    settings(kmeans_assign_mma=True)
    N, C = 3000, 300
    plan = plan_assign(torch.randn(N, K), torch.randn(C, K), certificates=True)
    assert plan.family == "kmeans_assign"
    assert [launch.kernel.spec for launch in plan.launches] == [assign_prep_spec(K), assign_spec(K)]
    assert f"KmeansAssignTraits<{kK}>" in assign_spec(K).traits
    prep, main = plan.launches
    assert prep.grid == (1, 1, 1) and len(prep.args) == 7
    assert main.grid == (-(-N // block_m), 1, 1) and len(main.args) == 23
    assert assign_spec(K).launch.block_n == block_n
    assert float(main.args[14]) == assign_tau(K) and int(main.args[15]) == split == assign_split(K)
    assert main.args[16:21] == (0, 0, 0, 0, 0)  # every point, no bounds
    cp = -(-C // block_n) * block_n
    assert plan.scratch[1].numel() == cp * (kK * 2 + K) and plan.scratch[2].numel() == cp  # fragments, ct
    labels, dist, cert = plan.out
    assert labels.dtype == torch.int64 and dist.dtype == torch.float32 and cert.dtype == torch.uint8
    assert plan_assign(torch.randn(N, K, dtype=torch.float64), torch.randn(C, K, dtype=torch.float64)) is None
    assert plan_assign(torch.randn(N, 65), torch.randn(C, 65)) is None


def test_assign_tau_covers_the_derivation():
    """tau (units of u = 2^-24) grows with the k-steps; K = 16: ~2000 u (~1.2e-4 relative)."""
    from kermac_like.plan.kmeans import assign_tau

    u = 2.0 ** -24
    assert 1900 < assign_tau(16) / u < 2100
    assert assign_tau(8) < assign_tau(16) < assign_tau(32) < assign_tau(64)


# -- the pruned iterations' centre statistics (plan.kmeans.centre_bounds) ----------------------------
@pytest.mark.parametrize("C, K", [(2, 3), (70, 16), (1500, 8)])
def test_centre_bounds_are_outward(C, K):
    """drift >= the float64 move, halfs <= half the nearest other centre, rth <= the distance of every
    centre outside the neighbourhood, mdl >= the drift of every centre inside it (those within rth), with
    duplicate centres and a relocated one; row blocks when C x C is large."""
    from kermac_like.plan.kmeans import bound_consts, centre_bounds

    g = torch.Generator().manual_seed(C)
    old = torch.randn(C, K, generator=g)
    new = old + 0.01 * torch.randn(C, K, generator=g)
    if C > 2:
        new[C // 2] = 5.0  # relocated
    new[-1] = new[0]  # a duplicate
    rmax = (0.3 * torch.rand(C, generator=g)).view(torch.int32)
    kap = bound_consts(K)[2]
    drift, mdl, halfs, rth = centre_bounds(old, new, rmax, kap)
    assert all(t.dtype == torch.float32 and t.shape == (C,) for t in (drift, mdl, halfs, rth))
    o, n = old.double(), new.double()
    d = (n - o).norm(dim=1)
    assert (drift.double() >= d).all()
    cc = torch.cdist(n, n, compute_mode="donot_use_mm_for_euclid_dist")
    cc.fill_diagonal_(float("inf"))
    assert (halfs.double() <= cc.min(1).values / 2).all()
    assert halfs[0] == 0 and halfs[-1] == 0
    far = cc >= rth.double()[:, None]
    assert ((cc >= rth.double()[:, None]) | (mdl.double()[:, None] >= d[None, :])).all()
    expect = (rmax.view(torch.float32).double() + drift.double()) * 2 * kap
    assert (rth.double() >= expect).all() and (rth.double() <= expect * 1.001 + 1e-12).all()
    assert far.any() or C == 2


def test_bounds_serve_rule(as_gpu, monkeypatch, settings):
    """Pruned iterations: kmeans_bounds on, the tensor-core assignment serving, K <= ASSIGN_UP_TO, 2 <= C <=
    BOUNDS_MAX_C; KERMAC_LIKE_KMEANS_BOUNDS=0 (or the assignment off) assigns every point."""
    from kermac_like.config import SETTINGS
    from kermac_like.plan.kmeans import bounds_serve

    assert SETTINGS["kmeans_bounds"].default is True
    settings(kmeans_bounds=True)
    settings(kmeans_assign_mma=True)
    X = torch.randn(100, 16)
    assert bounds_serve(X, 2) and bounds_serve(X, plan_km.BOUNDS_MAX_C)
    assert not bounds_serve(X, 1) and not bounds_serve(X, plan_km.BOUNDS_MAX_C + 1)
    assert not bounds_serve(torch.randn(100, plan_km.ASSIGN_UP_TO + 1), 8)
    assert not bounds_serve(X.double(), 8)
    settings(kmeans_assign_mma=False)
    assert not bounds_serve(X, 8)
    settings(kmeans_assign_mma=True)
    settings(kmeans_bounds=False)
    assert not bounds_serve(X, 8)


def test_bounded_assign_launch_arguments(as_gpu, monkeypatch):
    """BoundedAssign's kmeans_bounds_kernel launches (planned on CPU tensors, not run): the filter passes
    the bounds, the four centre statistics, rmax, the work list and its counter in ABI.md's order with
    no dist; the exact mode passes only x, c, labels and dist; one thread a point."""
    from kermac_like.runtime import launcher

    seen = []
    monkeypatch.setattr(launcher, "launch", lambda k, grid, args, debug=False, block=None: seen.append((grid, args)))
    N, K, C = 1000, 16, 7
    X = torch.randn(N, K)
    b = plan_km.BoundedAssign(X, C)
    b.centres = torch.randn(C, K)
    stats = tuple(torch.rand(C) for _ in range(4))
    b._filter(stats)
    b._filter()
    want = [X, b.centres, b.labels, b.ub, b.lb, *stats, b.rmax, b.work, b.counters]
    (g0, a0), (g1, a1) = seen
    assert g0 == g1 == (-(-N // 256), 1, 1) and len(a0) == len(a1) == 21
    assert list(a0[:12]) == [t.data_ptr() for t in want] and a0[12] == 0
    assert list(a1[:3]) == [t.data_ptr() for t in want[:3]] and set(a1[3:12]) == {0} and a1[12] == b.dist.data_ptr()
    assert [int(v) for v in a0[13:15]] == [N, K] and float(a0[19]) == plan_km.bound_consts(K)[2]
