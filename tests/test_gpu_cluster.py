"""kermac_like.cluster.KMeans on CUDA tensors: the same fit as scikit-learn's Lloyd KMeans from the
same initial centres, bitwise repeats, a 10^6-point fit. Skipped without a GPU of compute
capability 8.0+."""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.cluster import KMeans as SkKMeans  # noqa: E402
from sklearn.datasets import load_iris, make_blobs  # noqa: E402

from kermac_like.testing import kmeans_seeding  # noqa: E402
from kermac_like.cluster import KMeans  # noqa: E402

pytestmark = pytest.mark.gpu


def _init(X, C, seed=0):
    return X[np.random.default_rng(seed).choice(len(X), C, replace=False)]


@pytest.mark.parametrize("data", ["iris", "blobs"])
def test_same_as_sklearn_on_cuda(data):
    if data == "iris":
        X, C = load_iris().data, 3
    else:
        X, C = make_blobs(20000, 16, centers=64, cluster_std=3.0, random_state=0)[0], 64
    init = _init(X, C)
    ref = SkKMeans(C, init=init, n_init=1, algorithm="lloyd").fit(X)
    # float64 tensors: the float64 selection
    ours = KMeans(C, init=torch.from_numpy(init).cuda()).fit(torch.from_numpy(X).cuda())
    assert ours.labels_.is_cuda and ours.cluster_centers_.dtype == torch.float64
    np.testing.assert_array_equal(ours.labels_.cpu().numpy(), ref.labels_)
    assert abs(ours.inertia_ / ref.inertia_ - 1) <= 1e-5
    # float32 tensors: the fused float32 argmin; labels may differ where two centres are within
    # float32 rounding of each other
    o32 = KMeans(C, init=torch.from_numpy(init).float().cuda()).fit(torch.from_numpy(X).float().cuda())
    assert (o32.labels_.cpu().numpy() == ref.labels_).mean() >= 0.999
    assert abs(o32.inertia_ / ref.inertia_ - 1) <= 1e-4


def test_bitwise_deterministic_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(200_000, 16, device="cuda", generator=g)
    fits = [KMeans(256, random_state=3, max_iter=10).fit(X) for _ in range(2)]
    assert torch.equal(fits[0].cluster_centers_, fits[1].cluster_centers_)
    assert torch.equal(fits[0].labels_, fits[1].labels_)
    assert fits[0].inertia_ == fits[1].inertia_
    # the same centres from the same init, twice
    init = fits[0].cluster_centers_
    a, b = (KMeans(256, init=init, max_iter=5).fit(X) for _ in range(2))
    assert torch.equal(a.cluster_centers_, b.cluster_centers_)


def test_one_million_points_smoke():
    g = torch.Generator(device="cuda").manual_seed(1)
    X = torch.randn(1_000_000, 16, device="cuda", generator=g)
    m = KMeans(1024, random_state=0, max_iter=10, tol=0.0).fit(X)
    assert m.n_iter_ == 10 and m.labels_.shape == (1_000_000,)
    assert m.cluster_centers_.shape == (1024, 16) and bool(torch.isfinite(m.cluster_centers_).all())
    assert len(torch.unique(m.labels_)) == 1024
    # the inertia is the sum of squared distances to the nearest centre
    d = torch.cdist(X[:4096].double(), m.cluster_centers_.double()).min(1).values
    lab = m.predict(X[:4096])
    assert torch.equal(lab, m.labels_[:4096]) or (lab != m.labels_[:4096]).float().mean() < 1e-3
    assert d.square().sum().item() <= m.inertia_


@pytest.mark.parametrize("N,D,C,weighted,integer", [(200_003, 16, 256, False, True), (50_001, 3, 64, True, True),
                                                    (30_000, 40, 32, True, True), (1_000_000, 16, 1024, False, True),
                                                    (200_003, 16, 256, True, False)])
def test_fused_seeding_same_as_torch_on_cuda(N, D, C, weighted, integer):
    """cuda_templates/kmeans.cuh's seeding against the torch path from the same uniforms. Integer
    data and weights in quarters: every distance, product and sum exact in any order, so the
    same indices and centres; Gaussian data: float32 distances summed in another order than
    torch's may flip a draw whose uniform lands within rounding of a boundary (then every later
    centre differs), so the same draws up to at least the 64th. Bitwise the same twice."""
    from kermac_like.plan.kmeans import fused_serves

    kmeans_plusplus, seed_uniforms = kmeans_seeding.kmeans_plusplus, kmeans_seeding.seed_uniforms

    g = torch.Generator(device="cuda").manual_seed(N + D)
    if integer:
        X = torch.randint(-20, 21, (N, D), device="cuda", generator=g).float()
    else:
        X = torch.randn(N, D, device="cuda", generator=g) * 2
    w = None
    if weighted:
        w = torch.randint(0, 9, (N,), device="cuda", generator=g).float() / 4  # zeros among them
    assert fused_serves(X)
    c, idx = kmeans_plusplus(X, C, w, torch.Generator(device="cuda").manual_seed(7))
    u = seed_uniforms(C, torch.Generator(device="cuda").manual_seed(7), "cuda")
    c_ref, idx_ref = kmeans_seeding._kmeans_plusplus_torch(X, C, w, u)
    diff = (idx != idx_ref).nonzero()
    first = C if diff.numel() == 0 else int(diff[0])
    if integer:
        assert first == C, f"first different draw: centre {first}"
        assert torch.equal(c, c_ref)
    else:
        assert first >= 64, f"first different draw: centre {first}"
        assert torch.equal(c[:first], c_ref[:first])
    if weighted:
        assert bool((w[idx] > 0).all())
    c2, idx2 = kmeans_plusplus(X, C, w, torch.Generator(device="cuda").manual_seed(7))
    assert torch.equal(idx, idx2) and torch.equal(c.view(torch.int32), c2.view(torch.int32))


@pytest.mark.parametrize("N,D,C", [(1_000_000, 16, 1024), (200_003, 2, 300)])
def test_fused_seeding_rounds_on_blobs(N, D, C):
    """Far blobs (proposals rejected, rounds ended early) and more centres than a round: the
    fused seeding against the torch path on integer data (the same indices), every index
    distinct (no point has p > 0 once drawn), the round count between C / 128 and C."""
    from kermac_like.plan.kmeans import Seeding

    seed_uniforms = kmeans_seeding.seed_uniforms

    g = torch.Generator(device="cuda").manual_seed(D)
    means = torch.randint(-50, 51, (C, D), device="cuda", generator=g).float() * 40
    X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randint(-3, 4, (N, D), device="cuda",
                                                                                     generator=g).float()
    u = seed_uniforms(C, torch.Generator(device="cuda").manual_seed(1), "cuda")
    sd = Seeding(X, C, None, u)
    c, idx = sd.run()
    assert -(-C // 128) < sd.rounds < C
    assert len(torch.unique(idx)) == C
    c_ref, idx_ref = kmeans_seeding._kmeans_plusplus_torch(X, C, None, u)
    assert torch.equal(idx, idx_ref) and torch.equal(c, c_ref)


def test_fused_seeding_is_d2_sampling_on_cuda():
    """The law of the fused seeding's first three centres on six weighted points, far apart, so
    that most proposals of the third centre are rejected (tests/d2_law.py)."""
    from d2_law import POINTS, WEIGHTS, bound, statistic

    kmeans_plusplus = kmeans_seeding.kmeans_plusplus

    X, w = POINTS.float().cuda(), WEIGHTS.float().cuda()
    chi, df = statistic(lambda sd: kmeans_plusplus(X, 3, w, torch.Generator(device="cuda").manual_seed(sd))[1], 2000)
    assert chi < bound(df), (chi, df)


def test_fused_seeding_zero_weights_and_16_bit_on_cuda():
    kmeans_plusplus, seed_uniforms = kmeans_seeding.kmeans_plusplus, kmeans_seeding.seed_uniforms

    X = torch.randn(5000, 8, device="cuda")
    w = torch.zeros(5000, device="cuda")
    w[[3, 1024, 4999]] = 1.0  # three weighted points, five centres: two degenerate draws (N - 1)
    c, idx = kmeans_plusplus(X, 5, w, torch.Generator(device="cuda").manual_seed(1))
    u = seed_uniforms(5, torch.Generator(device="cuda").manual_seed(1), "cuda")
    assert torch.equal(idx, kmeans_seeding._kmeans_plusplus_torch(X, 5, w, u)[1])
    assert set(idx[:3].tolist()) == {3, 1024, 4999} and idx[3:].tolist() == [4999, 4999]
    Xh = X.to(torch.bfloat16)
    ch, ih = kmeans_plusplus(Xh, 16, None, torch.Generator(device="cuda").manual_seed(2))
    assert ch.dtype == torch.bfloat16 and torch.equal(ch, Xh[ih])


@pytest.mark.parametrize("K,weighted", [(16, False), (3, True), (300, True)])
def test_fused_segment_sums_on_cuda(monkeypatch, K, weighted, settings):
    """Lloyd's update by kmeans_segsum_kernel against the torch path (sort + segment_reduce):
    exact on integer data, within float64 rounding on Gaussian data; a cluster of most points
    (many items), empty clusters; bitwise the same twice."""
    from kermac_like.testing import kmeans_lloyd

    segment_sums = kmeans_lloyd.segment_sums
    from kermac_like.plan import kmeans as plan_km

    g = torch.Generator(device="cuda").manual_seed(K)
    N, C = 300_001, 97
    labels = torch.randint(0, C, (N,), device="cuda", generator=g)
    labels[: N // 2] = 5  # one large cluster
    labels[labels == 7] = 8  # an empty one
    w = torch.rand(N, device="cuda", generator=g) if weighted else None
    for integer in (True, False):
        X = torch.randint(-50, 51, (N, K), device="cuda", generator=g).float() if integer else \
            torch.randn(N, K, device="cuda", generator=g)
        wi = None if w is None else ((w * 8).floor() / 4 if integer else w)
        s, ws = segment_sums(X, labels, wi, C)
        s2, ws2 = segment_sums(X, labels, wi, C)
        assert torch.equal(s, s2) and torch.equal(ws, ws2)
        settings(kmeans_segsum=False)
        r, rw = segment_sums(X, labels, wi, C)
        settings(kmeans_segsum=True)
        if integer:
            assert torch.equal(s, r) and torch.equal(ws, rw)
        else:
            torch.testing.assert_close(s, r, rtol=1e-12, atol=1e-9)
            torch.testing.assert_close(ws, rw, rtol=1e-12, atol=0)
        assert (s[7] == 0).all() and ws[7] == 0


# -- the assignment on tensor cores (plan.kmeans.ASSIGN_MMA) -------------------------------------------
@pytest.mark.parametrize("K, C, blobs", [(16, 256, True), (16, 1024, False), (5, 70, False), (33, 300, True),
                                         (64, 129, False)])
def test_mma_assignment_is_knns_on_cuda(monkeypatch, K, C, blobs, settings):
    """One assignment with the switch on: knn(X, centres, 1, direct)'s labels and distance bits, every
    row (certified rows by the certificate, the others by the kernel's exact rescan), near-ties,
    duplicate centres and points on centres included; bitwise repeatable; most rows certified."""
    from kermac_like import knn
    from kermac_like.plan import kmeans as plan_km

    settings(kmeans_assign_mma=True)
    g = torch.Generator(device="cuda").manual_seed(K + C)
    N = 200_000
    if blobs:
        means = 4 * torch.randn(C, K, device="cuda", generator=g)
        X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, K, device="cuda", generator=g)
    else:
        X = torch.randn(N, K, device="cuda", generator=g)
    centres = X[torch.randperm(N, device="cuda", generator=g)[:C]].clone()
    centres[C - 1] = centres[0]  # a duplicate: index 0 wins
    X[:1000] = 0.5 * (centres[torch.arange(1000, device="cuda") % C] + centres[(torch.arange(1000, device="cuda") + 1) % C])
    X[1000:1100] = centres[torch.arange(100, device="cuda") % C]
    plan = plan_km.plan_assign(X, centres, certificates=True)
    labels, dist, cert = (t.clone() for t in plan.run())
    d_ref, l_ref = knn(X, centres, 1, compute_mode="donot_use_mm_for_euclid_dist")
    assert torch.equal(labels, l_ref[:, 0]), int((labels != l_ref[:, 0]).sum())
    assert torch.equal(dist.view(torch.int32), d_ref[:, 0].contiguous().view(torch.int32))
    assert float(cert.float().mean()) > 0.9
    assert not bool(cert[1000:1100].any()) or bool((dist[1000:1100][cert[1000:1100] == 1] == 0).all())
    again = plan_km.plan_assign(X, centres, certificates=True).run()
    assert all(torch.equal(a, b) for a, b in zip((labels, dist, cert), again))


def test_mma_assignment_fit_same_as_knn_fit_on_cuda(monkeypatch, settings):
    """KMeans fit (N = 2e5, D = 16, C = 256, k-means++ then 20 iterations at tol 0) with the switch on:
    the labels, centres and inertia of the switch-off fit, bitwise (the assignment is knn's, row for
    row), and bitwise repeatable."""
    from kermac_like.plan import kmeans as plan_km

    g = torch.Generator(device="cuda").manual_seed(3)
    N, D, C = 200_000, 16, 256
    means = 4 * torch.randn(C, D, device="cuda", generator=g)
    X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)
    fits = []
    for on in (False, True, True):
        settings(kmeans_assign_mma=on)
        m = KMeans(C, max_iter=20, tol=0.0, random_state=0).fit(X)
        fits.append((m.labels_, m.cluster_centers_, m.inertia_, m.n_iter_))
    for other in fits[1:]:
        assert torch.equal(fits[0][0], other[0]) and torch.equal(fits[0][1], other[1])
        assert fits[0][2] == other[2] and fits[0][3] == other[3]


# -- pruned iterations (plan.kmeans.BOUNDS, BoundedAssign) ----------------------------------------------
@pytest.mark.parametrize("case", ["blobs16", "uniform3-weighted", "empties8", "blobs16-verbose"])
def test_pruned_fit_same_as_full_fit_on_cuda(monkeypatch, capsys, case, settings):
    """KMeans with the distance bounds on and off: the same labels, centres, inertia, n_iter and verbose
    log, bitwise; the bounds leave most points unassigned in the later iterations of blob data. Cases:
    blobs (N = 2e5, D = 16, C = 256), uniform D = 3 with weights, an init with duplicate centres (empty
    clusters relocated in the first iterations), verbose."""
    from kermac_like.plan import kmeans as plan_km

    g = torch.Generator(device="cuda").manual_seed(11)
    weights, init, verbose = None, "k-means++", case.endswith("verbose") or case == "empties8"
    if case.startswith("blobs16"):
        N, D, C = 200_000, 16, 256
        means = 4 * torch.randn(C, D, device="cuda", generator=g)
        X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)
    elif case == "uniform3-weighted":
        N, D, C = 100_000, 3, 100
        X = torch.rand(N, D, device="cuda", generator=g)
        weights = torch.rand(N, device="cuda", generator=g) + 0.5
    else:
        N, D, C = 50_000, 8, 64
        X = torch.randn(N, D, device="cuda", generator=g)
        init = X[:C].clone()
        init[C // 2:] = init[0]  # 32 copies of one centre: empty clusters to relocate
    assigned = []
    step = plan_km.BoundedAssign.step

    def spy(self, centres):
        out = step(self, centres)
        assigned.append(self.assigned)
        return out

    monkeypatch.setattr(plan_km.BoundedAssign, "step", spy)
    fits, logs = [], []
    for on in (False, True, True):
        settings(kmeans_bounds=on)
        m = KMeans(C, init=init, max_iter=30, tol=0.0, random_state=0, verbose=verbose).fit(X, sample_weight=weights)
        fits.append((m.labels_, m.cluster_centers_, m.inertia_, m.n_iter_))
        logs.append(capsys.readouterr().out)
    for other in fits[1:]:
        assert torch.equal(fits[0][0], other[0]) and torch.equal(fits[0][1], other[1])
        assert fits[0][2] == other[2] and fits[0][3] == other[3]
    assert logs[0] == logs[1] == logs[2]
    assert assigned, "the pruned path did not run"
    if case.startswith("blobs16"):
        assert min(assigned) < 0.2 * N, assigned
    if case == "empties8":
        assert "Relocating" in logs[0]
