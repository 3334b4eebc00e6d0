"""Stated semantics a new user relies on: knn's order of NaN query rows on the CPU path (torch.topk's),
and fitted attributes that follow the input's type (numpy in, numpy attributes)."""

import math

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like.cluster import KMeans
from kermac_like.neighbors import KNeighborsClassifier, KNeighborsRegressor
from kermac_like.solvers import KernelRidge


@pytest.mark.parametrize("N", [7, 1000])
@pytest.mark.parametrize("largest", [False, True])
@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, math.inf])
def test_knn_nan_query_rows_ordered_as_torch_topk(N, largest, p):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(40, 3, generator=g)
    x[3, 1] = math.nan
    x[17, 0] = math.nan
    y = torch.randn(N, 3, generator=g)
    v, i = km.knn(x, y, 3, p=p, largest=largest)
    tv, ti = torch.topk(torch.cdist(x, y, p=p), 3, largest=largest)
    assert torch.equal(i[[3, 17]], ti[[3, 17]])  # torch.topk's own order of the NaN rows
    assert torch.equal(v[[3, 17]].isnan(), tv[[3, 17]].isnan())
    # the other rows keep the (float64 value, index) order
    d64 = torch.cdist(x.double(), y.double(), p=p)
    rows = [r for r in range(40) if r not in (3, 17)]
    assert torch.equal(v[rows], d64[rows].gather(1, i[rows]).float())


def test_kernel_topk_nan_rows_batched():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 4, generator=g)
    x[1, 5, 2] = math.nan
    y = torch.randn(2, 300, 4, generator=g)
    desc = km.preset("gaussian_l2")
    v, i = km.kernel_topk(desc, x, y, 4, bandwidth=1.5)
    ref = torch.topk(km.run_kernel(desc, x, y, bandwidth=1.5), 4, largest=True)
    assert torch.equal(i[1, 5], ref.indices[1, 5]) and bool(v[1, 5].isnan().all())
    assert not bool(v[0].isnan().any())


@pytest.mark.parametrize("solver,kw", [("cholesky", {}), ("cg", {"n_landmarks": 10}), ("nystrom", {"n_centers": 12})])
def test_kernel_ridge_fitted_arrays_follow_the_input(solver, kw):
    g = np.random.default_rng(0)
    X = g.random((60, 3))
    y = np.sin(X.sum(1))
    m = KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-2, solver=solver, random_state=0, **kw).fit(X, y)
    names = ["X_fit_", "dual_coef_"] + (["centers_"] if solver == "nystrom" else [])
    assert all(isinstance(getattr(m, n), np.ndarray) for n in names), {n: type(getattr(m, n)) for n in names}
    t = KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-2, solver=solver, random_state=0, **kw).fit(
        torch.from_numpy(X), torch.from_numpy(y))
    assert all(isinstance(getattr(t, n), torch.Tensor) for n in names)
    for n in names:
        np.testing.assert_array_equal(getattr(m, n), getattr(t, n).numpy())
    np.testing.assert_array_equal(m.predict(X[:5]), t.predict(torch.from_numpy(X[:5])).numpy())
    # a refit on tensors replaces the arrays
    m.fit(torch.from_numpy(X), torch.from_numpy(y))
    assert isinstance(m.dual_coef_, torch.Tensor)


def test_cluster_and_neighbors_fitted_arrays_follow_the_input():
    X = np.random.default_rng(1).random((40, 2))
    labels = (X[:, 0] > 0.5).astype(np.int64)
    for data, kind in ((X, np.ndarray), (torch.from_numpy(X), torch.Tensor)):
        m = KMeans(3, random_state=0).fit(data)
        assert isinstance(m.cluster_centers_, kind) and isinstance(m.labels_, kind)
        y = labels if kind is np.ndarray else torch.from_numpy(labels)
        assert isinstance(KNeighborsClassifier(3).fit(data, y).classes_, kind)
        assert isinstance(KNeighborsRegressor(3).fit(data, X[:, 1]).predict(data), kind)
