"""KMeans on data as it comes (issue 42): the fit runs about a reference point of the data
(cluster._kmeans._reference), so a common shift of the data shifts the centres and changes no label.

CPU: fits on X and X + 1024 x spread (exact in float32: X on a 2^-6 lattice) are the same fit,
bitwise, centres shifted back within the last shift's rounding; a shift that rounds the data
(+ 1000 x spread) agrees to float32 grade; the reference point keeps integer data on its lattice
and is 0 on centred data (the fit of X itself); 8 wide blobs far from the origin against
scikit-learn's Lloyd (float64) from the same initial centres; integer data with ties and
duplicate rows; empty clusters relocated by tensor ops as scikit-learn's loop does, several from
one cluster included. GPU (marker gpu): the same on CUDA float32 (the tensor-core assignment, its
rescan and the pruned iterations), against the CPU path's labels."""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.cluster import KMeans as SkKMeans  # noqa: E402

from kermac_like.testing import kmeans_estimator, kmeans_lloyd, kmeans_seeding  # noqa: E402
from kermac_like.cluster import KMeans  # noqa: E402


def wide_blobs(n, d, seed, shift=0.0):
    """8 unit blobs at 4 x randint(0, 8) per coordinate (all positive), on a 2^-6 lattice, + shift."""
    g = torch.Generator().manual_seed(seed)
    centres = 4.0 * torch.randint(0, 8, (8, d), generator=g)
    x = torch.randn(n, d, generator=g) + centres[torch.randint(0, 8, (n,), generator=g)]
    return torch.round(x * 64) / 64 + shift


def pixels(n, d, seed):
    """Integers 0..255, mostly 0 (ties), a third of the rows copies of others."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 256, (n, d), generator=g).float().masked_fill_(torch.rand(n, d, generator=g) < 0.6, 0)
    return u[torch.cat([torch.arange(2 * n // 3), torch.randint(0, 2 * n // 3, (n - 2 * n // 3,), generator=g)])]


def fit(X, C, **kw):
    kw = dict(random_state=0, max_iter=10, tol=0.0) | kw
    return KMeans(C, **kw).fit(X)


def test_reference_point():
    """0 on centred data (the fit of X itself, no copy); on a lattice of integers the shift keeps data on
    it; shifted data: the shift moves the reference point by the same amount when it is on its grid."""
    g = torch.Generator().manual_seed(0)
    assert not kmeans_estimator._reference(torch.randn(5000, 16, generator=g)).any()
    px = pixels(3000, 16, 1)
    s = kmeans_estimator._reference(px)
    assert torch.equal(s, s.round()) and s.dtype == torch.float32
    x = wide_blobs(3000, 16, 2)
    assert torch.equal(kmeans_estimator._reference(x + 1024.0), kmeans_estimator._reference(x) + 1024.0)
    assert kmeans_estimator._reference(x.double()).dtype == torch.float64


def test_shift_exact_in_float32_gives_the_same_fit():
    """X and X + 1024 x spread, both exact in float32: the same labels, inertia and n_iter bitwise; the
    centres shifted back within half an ulp of the shifted centres; predict and transform agree."""
    N, D, C = 2000, 16, 16
    x = wide_blobs(N, D, 3)
    a = fit(x, C)
    b = fit(x + 4096.0, C)
    assert torch.equal(a.labels_, b.labels_)
    assert a.inertia_ == b.inertia_ and a.n_iter_ == b.n_iter_
    ulp = torch.finfo(torch.float32).eps * 4096 * 2
    assert float((b.cluster_centers_ - 4096.0 - a.cluster_centers_).abs().max()) <= ulp / 2
    assert torch.equal(b.predict(x[:500] + 4096.0), a.labels_[:500])
    torch.testing.assert_close(b.transform(x[:50] + 4096.0), a.transform(x[:50]), rtol=0, atol=0)
    assert b.score(x + 4096.0) == a.score(x)


def test_shift_that_rounds_the_data_agrees_to_float32_grade():
    """X + 1000 x spread rounds every coordinate (by up to 2^-11): labels agree but for rows that rounding
    moves across a bisector, the centres within float32 rounding of the shifted data."""
    N, D, C = 2000, 16, 16
    x = wide_blobs(N, D, 4)
    spread = float(x.std(0).mean())
    shift = 1000.0 * spread
    a = fit(x, C)
    b = fit(x + shift, C)
    assert (a.labels_ == b.labels_).double().mean() >= 0.999
    assert float((b.cluster_centers_ - shift - a.cluster_centers_).abs().max()) <= 1e-6 * 50 * shift
    assert abs(b.inertia_ / a.inertia_ - 1) < 1e-5


def test_wide_blobs_far_from_the_origin_match_sklearn():
    """All-positive wide blobs shifted by 100 x spread, float32, against scikit-learn's float64 Lloyd from
    the same initial centres: the same labels but for float32 near-ties, the same inertia to 1e-5."""
    N, D, C = 3000, 16, 32
    x = wide_blobs(N, D, 5, shift=100.0 * 4.6)
    init = x[torch.randperm(N, generator=torch.Generator().manual_seed(5))[:C]]
    ref = SkKMeans(C, init=init.double().numpy(), n_init=1, max_iter=10, tol=0.0, algorithm="lloyd").fit(
        x.double().numpy())
    ours = KMeans(C, init=init, max_iter=10, tol=0.0).fit(x)
    assert (ours.labels_.numpy() == ref.labels_).mean() >= 0.999
    assert abs(ours.inertia_ / ref.inertia_ - 1) < 1e-5


def test_integer_data_with_ties_and_duplicates():
    """Pixel-like integers (ties, duplicate rows): the shift stays on the integers, so X + 1024 is the same
    fit bitwise (float32 and float64; the centres up to the shift back's rounding); more clusters than
    distinct rows: scikit-learn's warning."""
    N, D, C = 1200, 16, 24
    px = pixels(N, D, 6)
    for dtype in (torch.float32, torch.float64):
        a = fit(px.to(dtype), C)
        b = fit(px.to(dtype) + 1024.0, C)
        assert torch.equal(a.labels_, b.labels_) and a.inertia_ == b.inertia_
        ulp = torch.finfo(dtype).eps * 2048
        assert float((b.cluster_centers_ - 1024.0 - a.cluster_centers_).abs().max()) <= ulp / 2
    few = px[:5].repeat(40, 1) + 300.0  # 5 distinct rows
    with pytest.warns(Warning, match="Number of distinct clusters"):
        m = KMeans(8, random_state=0).fit(few)
    assert len(torch.unique(m.labels_)) == 5 and m.inertia_ == 0.0


def _relocate_loop(X, weights, labels, d2, sums, wsum):
    """scikit-learn's relocation loop, one empty cluster at a time (the reference)."""
    empty = (wsum == 0).nonzero()[:, 0]
    far = torch.sort(d2, descending=True, stable=True).indices[:empty.numel()]
    for new, i in zip(empty.tolist(), far.tolist()):
        old = int(labels[i])
        w = torch.ones((), dtype=torch.float64) if weights is None else weights[i].double()
        sums[old] -= X[i].double() * w
        sums[new] = X[i].double() * w
        wsum[new] = w
        wsum[old] -= w


@pytest.mark.parametrize("weighted", [False, True])
def test_empty_clusters_relocated_by_tensor_ops(weighted):
    """Six empty clusters, the farthest points mostly in one cluster (several leave it): the loop's sums and
    weights (to float64 rounding; exactly where a cluster loses one point)."""
    segment_sums = kmeans_lloyd.segment_sums
    g = torch.Generator().manual_seed(7)
    X = torch.randn(400, 5, generator=g, dtype=torch.float64)
    X[:8] *= 30  # the farthest points
    labels = torch.randint(0, 4, (400,), generator=g)
    labels[:6] = 1
    d2 = X.square().sum(1)
    w = torch.rand(400, generator=g, dtype=torch.float64) + 0.5 if weighted else None
    sums, wsum = segment_sums(X, labels, w, 10)
    ref_s, ref_w = sums.clone(), wsum.clone()
    _relocate_loop(X, w, labels, d2, ref_s, ref_w)
    kmeans_lloyd._relocate_empty(X, w, labels, lambda: d2, sums, wsum, False)
    torch.testing.assert_close(sums, ref_s, rtol=1e-14, atol=1e-12)
    torch.testing.assert_close(wsum, ref_w, rtol=1e-14, atol=1e-12)
    assert (wsum > 0).all()
    moved = labels[torch.sort(d2, descending=True, stable=True).indices[:6]]
    for c in range(4):
        if int((moved == c).sum()) <= 1:
            assert torch.equal(sums[c], ref_s[c])


def test_fit_relocates_empty_clusters_like_sklearn():
    """Three initial centres far from every point: empty after the first assignment, they take the three
    farthest points (two of them from one cluster), as scikit-learn's fit does."""
    rng = np.random.default_rng(8)
    X = np.concatenate([rng.normal(0, 1, (200, 3)), rng.normal(10, 1, (200, 3)), [[30, 30, 30], [31, 29, 30]]])
    X += 500.0
    init = np.array([X[0], X[250], [1e4] * 3, [2e4] * 3, [3e4] * 3])
    ref = SkKMeans(5, init=init, n_init=1, algorithm="lloyd").fit(X)
    ours = KMeans(5, init=init).fit(X)
    np.testing.assert_array_equal(ours.labels_, ref.labels_)
    np.testing.assert_allclose(ours.cluster_centers_, ref.cluster_centers_, rtol=1e-12)
    assert ours.inertia_ == pytest.approx(ref.inertia_, rel=1e-9)


# -- CUDA ---------------------------------------------------------------------------------------------
def _cuda_families(n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    randint = lambda hi, *s: torch.randint(0, hi, s, device="cuda", generator=g)  # noqa: E731
    bench = 4 * randn(256, d)[randint(256, n)] + randn(n, d)
    blobs = torch.round((randn(n, d) + 4.0 * randint(8, 8, d)[randint(8, n)]) * 64) / 64
    return {"bench": bench, "wide_blobs": blobs, "wide_blobs_centred": blobs - blobs.mean(0).round(),
            "wide_blobs_shifted": blobs + 512.0, "relu": torch.relu(bench),
            "pixels": pixels(n, d, seed).cuda()}


@pytest.mark.gpu
def test_shift_invariance_on_cuda():
    """CUDA float32 (the tensor-core assignment and the pruned iterations): X and X + 4096 (exact) give the
    same fit bitwise, and its labels agree with the CPU path's from the same initial centres."""
    x = wide_blobs(200_000, 16, 9).cuda()
    a = fit(x, 256, max_iter=20)
    b = fit(x + 4096.0, 256, max_iter=20)
    assert torch.equal(a.labels_, b.labels_) and a.inertia_ == b.inertia_ and a.n_iter_ == b.n_iter_
    assert float((b.cluster_centers_ - 4096.0 - a.cluster_centers_).abs().max()) <= 2.0 ** -11
    init = x[:256].clone()
    gpu = KMeans(256, init=init + 4096.0, max_iter=5, tol=0.0).fit(x + 4096.0)
    cpu = KMeans(256, init=init.cpu() + 4096.0, max_iter=5, tol=0.0).fit(x.cpu() + 4096.0)
    assert (gpu.labels_.cpu() == cpu.labels_).double().mean() >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bench", "wide_blobs", "wide_blobs_centred", "wide_blobs_shifted", "relu",
                                    "pixels"])
def test_families_on_cuda(monkeypatch, family, settings):
    """Each family on CUDA: the pruned fit is the full-assignment fit bitwise (the rescanned rows' lower
    bounds hold), bitwise repeatable, and the labels of the first iterations agree with the CPU path's
    from the same centres."""
    from kermac_like.plan import kmeans as plan_km

    x = _cuda_families(200_000, 16, 10)[family]
    fits = []
    for on in (False, True, True):
        settings(kmeans_bounds=on)
        m = fit(x, 256, max_iter=20)
        fits.append((m.labels_, m.cluster_centers_, m.inertia_, m.n_iter_))
    for other in fits[1:]:
        assert torch.equal(fits[0][0], other[0]) and torch.equal(fits[0][1], other[1])
        assert fits[0][2] == other[2] and fits[0][3] == other[3]
    init = x[torch.randperm(len(x), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))[:256]]
    gpu = KMeans(256, init=init, max_iter=3, tol=0.0).fit(x)
    cpu = KMeans(256, init=init.cpu(), max_iter=3, tol=0.0).fit(x.cpu())
    assert (gpu.labels_.cpu() == cpu.labels_).double().mean() >= 0.999


@pytest.mark.gpu
def test_empty_clusters_relocated_on_cuda():
    """Duplicate initial centres on CUDA, integer data (every distance and sum exact, ties the same ties): the
    relocation by tensor ops is bitwise repeatable and gives the CPU path's labels and centres exactly."""
    g = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randint(-20, 21, (50_000, 8), device="cuda", generator=g).float() + 300.0
    init = x[:64].clone()
    init[32:] = init[0]
    a, b = (KMeans(64, init=init, max_iter=10, tol=0.0).fit(x) for _ in range(2))
    assert torch.equal(a.cluster_centers_, b.cluster_centers_) and torch.equal(a.labels_, b.labels_)
    c = KMeans(64, init=init.cpu(), max_iter=1, tol=0.0).fit(x.cpu())
    d = KMeans(64, init=init, max_iter=1, tol=0.0).fit(x)
    assert torch.equal(d.labels_.cpu(), c.labels_) and torch.equal(d.cluster_centers_.cpu(), c.cluster_centers_)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bench", "wide_blobs", "wide_blobs_shifted", "relu"])
def test_local_certificate_on_cuda(monkeypatch, family, settings):
    """The setting kmeans_local (the certificate about each CTA's reference centre, rows ordered by label): the
    same fit bitwise as the global certificate's, and as "auto"'s; one full assignment in local mode gives the
    global one's labels and distance bits; "auto" takes the local certificate exactly where the first
    assignment's global one leaves more than plan.kmeans.LOCAL_SHARE of the rows uncertified."""
    from kermac_like.plan import kmeans as plan_km

    x = _cuda_families(200_000, 16, 10)[family]
    fits = []
    for on in ("off", "on", "auto"):
        settings(kmeans_local=on)
        m = fit(x, 256, max_iter=20)
        fits.append((m.labels_, m.cluster_centers_, m.inertia_, m.n_iter_))
    for other in fits[1:]:
        assert torch.equal(fits[0][0], other[0]) and torch.equal(fits[0][1], other[1])
        assert fits[0][2] == other[2] and fits[0][3] == other[3]

    xc = (x - kmeans_estimator._reference(x)).contiguous()
    c = xc[torch.randperm(len(xc), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))[:1024]]
    labels, dist, cert = plan_km.plan_assign(xc, c, certificates=True).run()
    rows = torch.sort(labels.int(), stable=True).indices.int()
    old = labels.clone()
    l2, d2, c2 = plan_km.plan_assign(xc, c, certificates=True, rows=rows, n_rows=len(xc), labels=old,
                                     local=True).run()
    assert torch.equal(l2, labels) and torch.equal(d2.view(torch.int32), dist.view(torch.int32))
    settings(kmeans_local="auto")
    ba = plan_km.BoundedAssign(xc, c.shape[0])
    assert torch.equal(ba.first(c), labels)
    assert ba.local == (1.0 - float(cert.float().mean()) > plan_km.LOCAL_SHARE)
    # the seeding's hint (plan.kmeans.seed_plusplus(hint=...), the last round folded): each point's nearest centre
    hint = []
    cs, _ = kmeans_seeding.kmeans_plusplus(xc, 256, None, torch.Generator(device="cuda").manual_seed(0), hint=hint)
    near = plan_km.plan_assign(xc, cs.contiguous()).run()[0]
    assert len(hint) == 1 and float((hint[0].long() == near).float().mean()) > 0.999
