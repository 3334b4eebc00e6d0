"""kermac_like.neighbors against scikit-learn's brute-force estimators (equal up to the order of
exactly tied neighbours), numpy/torch in and out, errors, and two gloo processes against one."""

import os

import numpy as np
import pytest
import torch
from gloo_spawn import spawn_workers

from kermac_like.neighbors import KNeighborsClassifier, KNeighborsRegressor, NearestNeighbors

sklearn = pytest.importorskip("sklearn")
from sklearn import neighbors as skn  # noqa: E402
from sklearn.datasets import load_digits, load_iris  # noqa: E402
from sklearn.exceptions import NotFittedError  # noqa: E402


def assert_same_up_to_ties(d1, i1, d2, i2, rtol=1e-12):
    """Equal distances; per row, equal index sets below the k-th distance, and the same number
    of points at it (which of several tied points is taken may differ)."""
    np.testing.assert_allclose(d1, d2, rtol=rtol, atol=1e-12)
    for r in range(d1.shape[0]):
        last = d2[r, -1]
        inner = d2[r] < last * (1 - rtol) - 1e-12
        inner1 = d1[r] < last * (1 - rtol) - 1e-12
        assert set(i1[r][inner1]) == set(i2[r][inner]), r
        # tied groups inside the list (not only at its end) hold the same points
        for dv in np.unique(d2[r][inner]):
            same1, same2 = np.isclose(d1[r], dv, rtol=rtol, atol=0), np.isclose(d2[r], dv, rtol=rtol, atol=0)
            assert set(i1[r][same1]) == set(i2[r][same2])


def _boundary_untied(sk, X, k):
    """Rows whose k-th and (k+1)-th neighbour distances differ (the vote is the same for any
    tie order there)."""
    d, _ = sk.kneighbors(X, k + 1)
    return ~np.isclose(d[:, k - 1], d[:, k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [1, 1.5, 2, 3, np.inf])
def test_nearest_neighbors_random_data(p):
    rng = np.random.default_rng(int(p) if np.isfinite(p) else 9)
    X = rng.standard_normal((150, 4))
    Q = rng.standard_normal((40, 4))
    ours = NearestNeighbors(n_neighbors=7, p=p).fit(X)
    ref = skn.NearestNeighbors(n_neighbors=7, p=p, algorithm="brute").fit(X)
    d1, i1 = ours.kneighbors(Q)
    d2, i2 = ref.kneighbors(Q)
    assert d1.dtype == np.float64 and i1.dtype == np.int64 and d1.shape == (40, 7)
    np.testing.assert_allclose(d1, d2, rtol=1e-12)
    np.testing.assert_array_equal(i1, i2)
    d1, i1 = ours.kneighbors(n_neighbors=3)  # X=None: each point's neighbours without itself
    d2, i2 = ref.kneighbors(n_neighbors=3)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(ours.kneighbors(Q, 2, return_distance=False),
                                  ref.kneighbors(Q, 2, return_distance=False))
    want = {1: "manhattan", 2: "euclidean", np.inf: "chebyshev"}.get(p, "minkowski")
    assert ours.effective_metric_ == ref.effective_metric_ == want
    assert ours.effective_metric_params_ == ({} if want != "minkowski" else {"p": p})
    assert ours.n_samples_fit_ == 150 and ours.n_features_in_ == 4


def test_duplicates_and_self_exclusion():
    rng = np.random.default_rng(3)
    X = rng.integers(0, 3, (60, 2)).astype(np.float64)  # many duplicates: ties everywhere
    ours = NearestNeighbors(n_neighbors=4).fit(X)
    ref = skn.NearestNeighbors(n_neighbors=4, algorithm="brute").fit(X)
    d1, i1 = ours.kneighbors()
    d2, i2 = ref.kneighbors()
    np.testing.assert_allclose(d1, d2)
    assert not (i1 == np.arange(60)[:, None]).any() or (d1[:, 0] == 0).all()
    # ours is deterministic: equal distances in increasing index order
    dd = np.diff(d1, axis=1)
    assert ((dd > 0) | ((dd == 0) & (np.diff(i1, axis=1) > 0))).all()


@pytest.mark.parametrize("weights", ["uniform", "distance"])
def test_classifier_iris_and_digits(weights):
    for loader, k in ((load_iris, 5), (load_digits, 3)):
        X, y = loader(return_X_y=True)
        tr, te = slice(0, None, 2), slice(1, None, 2)
        ours = KNeighborsClassifier(k, weights=weights).fit(X[tr], y[tr])
        ref = skn.KNeighborsClassifier(k, weights=weights, algorithm="brute").fit(X[tr], y[tr])
        assert_same_up_to_ties(*ours.kneighbors(X[te]), *ref.kneighbors(X[te]))
        ok = _boundary_untied(ref, X[te], k)
        assert ok.mean() > 0.5
        np.testing.assert_array_equal(ours.predict(X[te])[ok], ref.predict(X[te])[ok])
        np.testing.assert_allclose(ours.predict_proba(X[te])[ok], ref.predict_proba(X[te])[ok], rtol=1e-12)
        assert abs(ours.score(X[te], y[te]) - ref.score(X[te], y[te])) < 0.02
        np.testing.assert_array_equal(ours.classes_, ref.classes_)


def test_classifier_string_labels_and_callable_weights():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((80, 3))
    y = np.array(["b", "a", "c"])[rng.integers(0, 3, 80)]
    w = lambda d: np.exp(-d)  # noqa: E731
    ours = KNeighborsClassifier(6, weights=w).fit(X, y)
    ref = skn.KNeighborsClassifier(6, weights=w, algorithm="brute").fit(X, y)
    Q = rng.standard_normal((25, 3))
    np.testing.assert_array_equal(ours.predict(Q), ref.predict(Q))
    np.testing.assert_allclose(ours.predict_proba(Q), ref.predict_proba(Q), rtol=1e-12)


@pytest.mark.parametrize("weights", ["uniform", "distance"])
def test_regressor_random_data(weights):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((120, 3))
    Y = rng.standard_normal((120, 2))
    Q = np.vstack([rng.standard_normal((30, 3)), X[:3]])  # three queries at distance 0
    for y in (Y[:, 0], Y):
        ours = KNeighborsRegressor(4, weights=weights, metric="manhattan").fit(X, y)
        ref = skn.KNeighborsRegressor(4, weights=weights, metric="manhattan", algorithm="brute").fit(X, y)
        np.testing.assert_allclose(ours.predict(Q), ref.predict(Q), rtol=1e-12)
        assert ours.predict(Q).shape == ref.predict(Q).shape
        assert abs(ours.score(Q, ref.predict(Q)) - 1.0) < 1e-12


def test_torch_in_torch_out():
    g = torch.Generator().manual_seed(6)
    X = torch.randn(70, 3, generator=g)
    y = torch.randint(0, 3, (70,), generator=g)
    Q = torch.randn(9, 3, generator=g)
    d, i = NearestNeighbors(n_neighbors=3).fit(X).kneighbors(Q)
    assert isinstance(d, torch.Tensor) and d.dtype == torch.float32 and i.dtype == torch.int64
    d2, i2 = NearestNeighbors(n_neighbors=3).fit(X.numpy()).kneighbors(Q.numpy())
    np.testing.assert_array_equal(i.numpy(), i2)
    np.testing.assert_allclose(d.numpy(), d2, rtol=1e-6)
    clf = KNeighborsClassifier(3).fit(X, y)
    pred = clf.predict(Q)
    assert isinstance(pred, torch.Tensor) and torch.equal(pred, torch.from_numpy(
        KNeighborsClassifier(3).fit(X.numpy(), y.numpy()).predict(Q.numpy())))
    reg = KNeighborsRegressor(3).fit(X, y.double())
    assert isinstance(reg.predict(Q), torch.Tensor) and reg.predict(Q).dtype == torch.float64


def test_errors():
    X = np.random.default_rng(7).standard_normal((10, 3))
    with pytest.raises(NotFittedError):
        NearestNeighbors().kneighbors(X)
    with pytest.raises(NotFittedError):
        KNeighborsClassifier().predict(X)
    nn = NearestNeighbors(n_neighbors=3).fit(X)
    with pytest.raises(ValueError, match="Expected n_neighbors <= n_samples_fit, but n_neighbors = 11"):
        nn.kneighbors(X, 11)
    with pytest.raises(ValueError, match="Expected n_neighbors < n_samples_fit, but n_neighbors = 10"):
        nn.kneighbors(None, 10)
    with pytest.raises(ValueError, match="X has 2 features, but NearestNeighbors is expecting 3"):
        nn.kneighbors(X[:, :2])
    with pytest.raises(ValueError, match="X has 2 features, but NearestNeighbors is expecting 3"):
        nn.kneighbors(torch.from_numpy(X[:, :2]))
    with pytest.raises(ValueError, match="^metric: 'cosine' is not supported"):
        NearestNeighbors(metric="cosine").fit(X)
    with pytest.raises(ValueError, match="^p: expected a real number > 0"):
        NearestNeighbors(p=0).fit(X)
    with pytest.raises(ValueError, match="^n_neighbors: expected an integer >= 1"):
        NearestNeighbors(n_neighbors=0).fit(X)
    with pytest.raises(ValueError, match="^weights: "):
        KNeighborsClassifier(weights="bad").fit(X, np.arange(10))
    bad = X.copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        NearestNeighbors().fit(bad)
    with pytest.raises(ValueError, match="NaN"):
        nn.kneighbors(torch.from_numpy(bad))


# -- two gloo processes ---------------------------------------------------------------------------

def _data():
    rng = np.random.default_rng(11)
    X = rng.standard_normal((97, 3))
    X[50] = X[10]  # a tie across the two shards
    return X, rng.standard_normal((13, 3)), rng.integers(0, 4, 97), rng.standard_normal(97)


def _worker(rank, port, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        X, Q, yc, yr = _data()
        rows = slice(0, 40) if rank == 0 else slice(40, None)  # uneven shards
        out = {}
        nn = NearestNeighbors(n_neighbors=6).fit(X[rows])
        out["kn"] = nn.kneighbors(Q)
        out["self"] = nn.kneighbors(n_neighbors=4)
        out["far"] = NearestNeighbors(n_neighbors=45, p=1).fit(torch.from_numpy(X[rows])).kneighbors(
            torch.from_numpy(Q))  # k beyond rank 0's 40 points
        out["far"] = tuple(t.numpy() for t in out["far"])
        out["clf"] = KNeighborsClassifier(5, weights="distance").fit(X[rows], yc[rows]).predict_proba(Q)
        out["reg"] = KNeighborsRegressor(5).fit(X[rows], yr[rows]).predict(Q)
        try:
            NearestNeighbors().fit(X[rows][:, : 3 - rank])
            out["error"] = "no error"
        except ValueError as e:
            out["error"] = str(e)
        q.put((rank, out))
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        q.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_one():
    results = spawn_workers(_worker)
    assert all(isinstance(r, dict) for r in results.values()), results
    X, Q, yc, yr = _data()
    want = {
        "kn": NearestNeighbors(n_neighbors=6).fit(X).kneighbors(Q),
        "self": NearestNeighbors(n_neighbors=4).fit(X).kneighbors(n_neighbors=4),
        "far": NearestNeighbors(n_neighbors=45, p=1).fit(X).kneighbors(Q),
    }
    clf = KNeighborsClassifier(5, weights="distance").fit(X, yc).predict_proba(Q)
    reg = KNeighborsRegressor(5).fit(X, yr).predict(Q)
    for rank in (0, 1):
        r = results[rank]
        for key, (d, i) in want.items():
            np.testing.assert_array_equal(r[key][1], i)
            # p = 2: matrix products of other shapes round differently
            np.testing.assert_allclose(r[key][0], d, rtol=1e-6 if key == "far" else 1e-13)
        np.testing.assert_allclose(r["clf"], clf, rtol=1e-14)
        np.testing.assert_allclose(r["reg"], reg, rtol=1e-14)
        assert r["error"].startswith("X: rank 1 passes 2 features"), r["error"]


def test_classifier_with_bool_label_tensor():
    """Boolean labels (a torch tensor): classes_ [False, True] in their order, predictions of the same dtype."""
    import torch

    from kermac_like.neighbors import KNeighborsClassifier

    X = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = X[:, 0] > 0
    m = KNeighborsClassifier(n_neighbors=1).fit(X, y)
    assert m.classes_.tolist() == [False, True]
    pred = m.predict(X)
    assert pred.dtype == torch.bool and torch.equal(pred, y)
