"""kermac_like.cluster.KMeans on the CPU path: the same fit as scikit-learn's Lloyd KMeans from
the same initial centres, the seeding, empty clusters, determinism, array types, bad input.
(scikit-learn's check_estimator runs on it in test_sklearn.py; CUDA in test_gpu_cluster.py.)"""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.cluster import KMeans as SkKMeans  # noqa: E402
from sklearn.datasets import load_iris, make_blobs  # noqa: E402

from kermac_like.cluster import KMeans, kmeans_plusplus  # noqa: E402
from kermac_like.testing import kmeans_lloyd  # noqa: E402


def blobs(n=2000, d=6, centers=12, seed=0):
    X, _ = make_blobs(n, d, centers=centers, cluster_std=2.0, random_state=seed)
    return X


def first_rows(X, C, seed=0):
    return X[np.random.default_rng(seed).choice(len(X), C, replace=False)]


def assert_same_fit(ours, ref, rtol):
    np.testing.assert_array_equal(ours.labels_, ref.labels_)
    assert abs(ours.inertia_ / ref.inertia_ - 1) <= rtol, (ours.inertia_, ref.inertia_)
    assert ours.n_iter_ == ref.n_iter_
    np.testing.assert_allclose(ours.cluster_centers_, ref.cluster_centers_, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("data", ["iris", "blobs"])
@pytest.mark.parametrize("tol", [1e-4, 0.0])
def test_same_as_sklearn_from_the_same_init(data, tol):
    X = load_iris().data if data == "iris" else blobs()
    C = 3 if data == "iris" else 12
    init = first_rows(X, C)
    ref = SkKMeans(C, init=init, n_init=1, tol=tol, algorithm="lloyd").fit(X)
    ours = KMeans(C, init=init, tol=tol).fit(X)
    assert_same_fit(ours, ref, 1e-5 if data == "iris" else 1e-9)
    assert ours.labels_.dtype == np.int32 and ours.cluster_centers_.dtype == np.float64
    np.testing.assert_array_equal(ours.predict(X), ref.predict(X))
    np.testing.assert_allclose(ours.transform(X[:50]), ref.transform(X[:50]), rtol=1e-9)
    assert ours.score(X) == pytest.approx(ref.score(X), rel=1e-9)


def test_float32_and_sample_weight_match_sklearn():
    X = blobs(1500, 4, 8, seed=1)
    init = first_rows(X, 8, 1)
    ref = SkKMeans(8, init=init, n_init=1, algorithm="lloyd").fit(X)
    ours = KMeans(8, init=init.astype(np.float32)).fit(X.astype(np.float32))
    assert ours.cluster_centers_.dtype == np.float32
    assert (ours.labels_ == ref.labels_).mean() > 0.999
    assert abs(ours.inertia_ / ref.inertia_ - 1) < 1e-4
    w = np.random.default_rng(0).uniform(0.1, 3.0, len(X))
    ref = SkKMeans(8, init=init, n_init=1, algorithm="lloyd").fit(X, sample_weight=w)
    ours = KMeans(8, init=init).fit(X, sample_weight=w)
    assert_same_fit(ours, ref, 1e-9)
    assert ours.score(X, sample_weight=w) == pytest.approx(ref.score(X, sample_weight=w), rel=1e-9)


def test_kmeans_plusplus_seeding():
    X = torch.from_numpy(blobs(1200, 3, 10))
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    c, idx = kmeans_plusplus(X, 40, None, g(3))
    assert len(set(idx.tolist())) == 40 and torch.equal(c, X[idx])
    c2, idx2 = kmeans_plusplus(X, 40, None, g(3))
    assert torch.equal(idx, idx2)
    assert not torch.equal(idx, kmeans_plusplus(X, 40, None, g(4))[1])
    # zero-weight points are never drawn
    w = torch.ones(len(X), dtype=X.dtype)
    w[::2] = 0
    assert (kmeans_plusplus(X, 40, w, g(5))[1] % 2 == 1).all()
    # the estimator: random_state reproduces the fit; the seeding beats random centres
    a = KMeans(10, random_state=7).fit(X.numpy())
    b = KMeans(10, random_state=7).fit(X.numpy())
    np.testing.assert_array_equal(a.cluster_centers_, b.cluster_centers_)
    assert KMeans(10, random_state=7, n_init=4).fit(X.numpy()).inertia_ <= a.inertia_
    ref = np.median([SkKMeans(10, n_init=1, random_state=s).fit(X.numpy()).inertia_ for s in range(5)])
    ours = np.median([KMeans(10, random_state=s).fit(X.numpy()).inertia_ for s in range(5)])
    assert ours < 1.2 * ref
    r = KMeans(10, init="random", n_init=3, random_state=0).fit(X.numpy())
    assert len(np.unique(r.labels_)) == 10


def test_segment_sums_match_a_loop():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 3, generator=g, dtype=torch.float32)
    lab = torch.randint(0, 9, (500,), generator=g)
    lab[lab == 4] = 5  # an empty cluster
    w = torch.rand(500, generator=g)
    for weights in (None, w):
        sums, wsum = kmeans_lloyd.segment_sums(X, lab, weights, 9)
        ww = torch.ones(500, dtype=torch.float64) if weights is None else weights.double()
        for c in range(9):
            m = lab == c
            torch.testing.assert_close(sums[c], (X[m].double() * ww[m, None]).sum(0), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(wsum[c], ww[m].sum(), rtol=1e-12, atol=1e-12)
        assert sums[4].abs().sum() == 0 and wsum[4] == 0


def test_empty_cluster_moves_to_the_farthest_point():
    # centre 2 is far from every point: empty after the first assignment, it takes the point
    # farthest from its centre (x = 10), as scikit-learn's KMeans does
    X = np.array([[0.0], [0.1], [0.2], [1.0], [1.1], [10.0]])
    init = np.array([[0.0], [1.0], [100.0]])
    ref = SkKMeans(3, init=init, n_init=1, algorithm="lloyd").fit(X)
    ours = KMeans(3, init=init).fit(X)
    assert_same_fit(ours, ref, 1e-12)
    assert sorted(ours.cluster_centers_[:, 0].round(6)) == [0.1, 1.05, 10.0]


def test_bitwise_deterministic():
    X = blobs(3000, 5, 16).astype(np.float32)
    fits = [KMeans(16, random_state=1).fit(X) for _ in range(2)]
    assert fits[0].cluster_centers_.tobytes() == fits[1].cluster_centers_.tobytes()
    np.testing.assert_array_equal(fits[0].labels_, fits[1].labels_)
    assert fits[0].inertia_ == fits[1].inertia_


def test_numpy_and_torch_in_and_out():
    X = blobs(400, 3, 4)
    init = first_rows(X, 4)
    m = KMeans(4, init=init).fit(X)
    Xt = torch.from_numpy(X).float()
    t = KMeans(4, init=torch.from_numpy(init).float()).fit(Xt)
    assert isinstance(t.cluster_centers_, torch.Tensor) and t.cluster_centers_.dtype == torch.float32
    assert isinstance(t.labels_, torch.Tensor) and t.labels_.dtype == torch.int64
    assert isinstance(t.inertia_, float) and isinstance(t.n_iter_, int)
    assert torch.equal(t.labels_, torch.from_numpy(m.labels_).long())
    p = t.predict(Xt[:10])
    assert isinstance(p, torch.Tensor) and p.dtype == torch.int64
    d = t.transform(Xt[:10])
    assert isinstance(d, torch.Tensor) and d.shape == (10, 4) and d.dtype == torch.float32
    assert isinstance(t.fit_predict(Xt), torch.Tensor) and isinstance(m.fit_predict(X), np.ndarray)
    assert isinstance(m.predict(Xt.double()), torch.Tensor)  # a tensor query of a numpy fit: a tensor
    assert isinstance(t.predict(X), np.ndarray)
    assert KMeans(4, init=init).fit(torch.from_numpy(X).long()).cluster_centers_.dtype == torch.float64


def test_bad_input():
    X = blobs(30, 3, 2)
    m = KMeans(2, random_state=0).fit(X)
    before = m.cluster_centers_.copy()
    cases = [
        (dict(n_clusters=31), X, ValueError, r"n_samples=30 should be >= n_clusters=31"),
        (dict(n_clusters=0), X, ValueError, "^n_clusters:"),
        (dict(n_clusters=2.5), X, ValueError, "^n_clusters:"),
        (dict(max_iter=0), X, ValueError, "^max_iter:"),
        (dict(tol=-1.0), X, ValueError, "^tol:"),
        (dict(n_init=0), X, ValueError, "^n_init:"),
        (dict(init="kmeans"), X, ValueError, "^init:"),
        (dict(init=lambda X, k, rs: X[:k]), X, TypeError, "^init:"),
        (dict(init=np.zeros((3, 3))), X, ValueError, "number of clusters 2"),
        (dict(init=np.zeros((2, 4))), X, ValueError, "number of features of the data 3"),
        (dict(init=np.full((2, 3), np.nan)), X, ValueError, "init contains NaN"),
        (dict(init=torch.zeros(2, 3, device="meta")), torch.from_numpy(X), ValueError, "^init: on meta"),
        (dict(random_state="a"), X, ValueError, "^random_state:"),
        ({}, np.where(np.arange(90).reshape(30, 3) == 4, np.nan, X), ValueError, "NaN"),
        ({}, torch.from_numpy(X).index_fill(0, torch.tensor([3]), float("inf")), ValueError, "^Input X contains NaN"),
        ({}, torch.from_numpy(X)[:, :, None], ValueError, "^X: expected a 2-D tensor"),
        ({}, torch.from_numpy(X) * 1j, ValueError, "^X: Complex data"),
        ({}, torch.from_numpy(X)[:0], ValueError, r"^X: found 0 sample\(s\)"),
        ({}, X[0], ValueError, "Expected 2D array"),
    ]
    for params, data, err, msg in cases:
        with pytest.raises(err, match=msg):
            m.set_params(**params).fit(data)
        m.set_params(n_clusters=2, init="k-means++", n_init=1, max_iter=300, tol=1e-4, random_state=0)
        np.testing.assert_array_equal(m.cluster_centers_, before)  # nothing written
        assert m.n_features_in_ == 3
    with pytest.raises(ValueError, match=r"sample_weight.shape == \(29,\)"):
        m.fit(X, sample_weight=np.ones(29))
    with pytest.raises(ValueError, match="Negative values in data passed to sample_weight"):
        m.fit(X, sample_weight=-np.ones(30))
    with pytest.raises(ValueError, match="^sample_weight: on meta"):
        m.fit(torch.from_numpy(X), sample_weight=torch.ones(30, device="meta"))
    with pytest.raises(ValueError, match="^X has 2 features, but KMeans is expecting 3"):
        m.predict(X[:, :2])
    with pytest.raises(ValueError, match="^X has 2 features"):
        m.transform(torch.from_numpy(X[:, :2]))
    with pytest.warns(RuntimeWarning, match="performing only one init"):
        KMeans(2, init=X[:2], n_init=3).fit(X)


def test_kmeans_plusplus_is_d2_sampling():
    """The rounds' rejection of stale proposals leaves every draw exactly D^2 sampling: the law of
    the first three centres on six weighted points (tests/d2_law.py), where most proposals of the
    third centre are rejected. Accepting every proposal (the stale law) gives a statistic ~50x
    this bound."""
    from d2_law import POINTS, WEIGHTS, bound, statistic

    chi, df = statistic(lambda sd: kmeans_plusplus(POINTS, 3, WEIGHTS, torch.Generator().manual_seed(sd))[1], 1500)
    assert chi < bound(df), (chi, df)
