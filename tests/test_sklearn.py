"""The package's estimators as scikit-learn sees them: ``check_estimator`` on each (CPU, the
checks' own small data), model selection (GridSearchCV, Pipeline, cross_val_score), clone and
pickling, array types in and out, and the stand-in base classes without scikit-learn.

To put an estimator under scikit-learn's checks, add an instance to ESTIMATORS; a check it
fails goes in EXPECTED_FAILED_CHECKS only where scikit-learn's own estimator of the same kind
fails it too, with the reason.
"""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.base import clone  # noqa: E402
from sklearn.exceptions import NotFittedError  # noqa: E402
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from kermac_like.cluster import KMeans  # noqa: E402
from kermac_like.neighbors import KNeighborsClassifier, KNeighborsRegressor, NearestNeighbors  # noqa: E402
from kermac_like.solvers import KernelRidge  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One instance per estimator and solver; the checks use their own data (tens to a few hundred
# points), which the CPU reference path fits in milliseconds.
ESTIMATORS = [
    KernelRidge("laplace_l2", bandwidth=1.0),
    KernelRidge("gaussian_l2", bandwidth=2.0, solver="cg", tol=1e-5, random_state=0),  # float32 data reach 1e-5
    KernelRidge("gaussian_l2", bandwidth=2.0, solver="nystrom", random_state=0),
    NearestNeighbors(),
    KNeighborsClassifier(),
    KNeighborsRegressor(weights="distance"),
    KMeans(n_clusters=2, n_init=2, max_iter=5, random_state=0),  # scikit-learn's own test parameters
]

# {estimator class name: {check name: reason}}: checks that scikit-learn's estimator of the same
# kind fails too.
EXPECTED_FAILED_CHECKS: dict[str, dict[str, str]] = {
    "KMeans": {
        "check_sample_weight_equivalence_on_dense_data":
            "the seeding is random: integer weights and repeated points draw different initial centres from "
            "the same random_state, so the two fits may end in different local optima (scikit-learn's KMeans "
            "with these parameters fails this check too)",
    },
}


def _expected_failed_checks(estimator):
    return EXPECTED_FAILED_CHECKS.get(type(estimator).__name__, {})


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks)
def test_check_estimator(estimator, check):
    check(estimator)


# -- model selection --------------------------------------------------------------------------
def regression_data(n=80, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, d))
    y = np.sin(2 * x[:, 0]) * np.cos(x[:, 1:].sum(1)) + 0.05 * rng.standard_normal(n)
    return x, y


def test_grid_search_over_bandwidth_and_alpha():
    x, y = regression_data()
    grid = GridSearchCV(KernelRidge("gaussian_l2", bandwidth=1.0),
                        {"bandwidth": [0.05, 1.0], "alpha": [1e-2, 10.0]}, cv=KFold(3))
    grid.fit(x, y)
    assert grid.best_params_ == {"bandwidth": 1.0, "alpha": 1e-2}, grid.cv_results_["mean_test_score"]
    assert grid.best_estimator_.bandwidth == 1.0 and grid.best_score_ > 0.8
    assert grid.predict(x).shape == (80,)


def test_pipeline_and_cross_val_score_match_sklearn():
    from sklearn.kernel_ridge import KernelRidge as SkKernelRidge

    x, y = regression_data(60)
    ours = cross_val_score(make_pipeline(StandardScaler(), KernelRidge("gaussian_l2", bandwidth=2.0, alpha=0.1)),
                           x, y, cv=KFold(3))
    ref = cross_val_score(make_pipeline(StandardScaler(), SkKernelRidge(alpha=0.1, kernel="rbf", gamma=1 / 8)),
                          x, y, cv=KFold(3))
    np.testing.assert_allclose(ours, ref, rtol=1e-9)


def test_clone_pickle_and_params():
    x, y = regression_data(40)
    m = KernelRidge("laplace_l2", bandwidth=1.5, alpha=0.2).fit(x, y)
    c = clone(m)
    assert c.get_params() == m.get_params() and not hasattr(c, "dual_coef_")
    assert repr(c) == "KernelRidge(alpha=0.2, bandwidth=1.5)"
    back = pickle.loads(pickle.dumps(m))
    np.testing.assert_array_equal(back.predict(x), m.predict(x))
    with pytest.raises(ValueError, match="gamma"):
        m.set_params(gamma=1.0)


def test_arrays_in_and_out():
    x, y = regression_data(40)
    m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.1)
    # numpy in, numpy out, in the dtype scikit-learn's KernelRidge returns (X and y promoted)
    assert m.fit(x, y).predict(x).dtype == np.float64
    assert m.fit(x.astype(np.float32), y).predict(x.astype(np.float32)).dtype == np.float64
    p32 = m.fit(x.astype(np.float32), y.astype(np.float32)).predict(x.astype(np.float32))
    assert isinstance(p32, np.ndarray) and p32.dtype == np.float32
    assert m.fit(x.tolist(), y.tolist()).predict(x[:3].tolist()).dtype == np.float64
    # a tensor in, a tensor out (on X's device)
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    pt = m.fit(xt, yt).predict(xt)
    assert isinstance(pt, torch.Tensor) and pt.dtype == torch.float32 and pt.device == xt.device
    assert m.fit(x, y[:, None]).predict(x).shape == (40, 1)
    # fitted attributes follow scikit-learn's naming
    assert m.n_features_in_ == 3 and hasattr(m, "dual_coef_") and not hasattr(m, "feature_names_in_")


@pytest.mark.parametrize("case", ["unfitted", "features", "y_none", "sparse", "complex", "empty", "x_1d"])
def test_bad_input_errors(case):
    x, y = regression_data(20)
    m = KernelRidge("gaussian_l2", bandwidth=1.0)
    if case == "unfitted":
        with pytest.raises(NotFittedError, match="not fitted yet"):
            m.predict(x)
    elif case == "features":
        m.fit(x, y)
        with pytest.raises(ValueError, match="^X has 2 features, but KernelRidge is expecting 3 features"):
            m.predict(x[:, :2])
        with pytest.raises(ValueError, match="^X has 2 features"):
            m.score(x[:, :2], y)
    elif case == "y_none":
        with pytest.raises(ValueError, match="^y: KernelRidge requires y to be passed"):
            m.fit(x, None)
    elif case == "sparse":
        from scipy import sparse

        with pytest.raises(TypeError, match="^X: sparse input is not supported"):
            m.fit(sparse.csr_matrix(x), y)
    elif case == "complex":
        with pytest.raises(ValueError, match="^X: Complex data not supported"):
            m.fit(x + 1j, y)
    elif case == "empty":
        with pytest.raises(ValueError, match=r"^X: found 0 sample\(s\)"):
            m.fit(x[:0], y[:0])
        with pytest.raises(ValueError, match=r"^X: 0 feature\(s\)"):
            m.fit(x[:, :0], y)
    elif case == "x_1d":
        m.fit(x, y)
        with pytest.raises(ValueError, match="^X: expected a 2-D array .* Reshape your data"):
            m.predict(x[0])


class _Frame:
    """The part of a data frame the feature-name protocol reads: ``columns`` and ``__array__``."""

    def __init__(self, values, columns):
        self.values, self.columns = values, columns

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)


def test_feature_names():
    x, y = regression_data(20)
    m = KernelRidge("gaussian_l2", bandwidth=1.0).fit(_Frame(x, ["a", "b", "c"]), y)
    assert list(m.feature_names_in_) == ["a", "b", "c"]
    m.predict(_Frame(x, ["a", "b", "c"]))
    with pytest.raises(ValueError, match="feature names should match"):
        m.predict(_Frame(x, ["a", "c", "b"]))
    with pytest.warns(UserWarning, match="X does not have valid feature names"):
        m.predict(x)
    m.fit(x, y)
    assert not hasattr(m, "feature_names_in_")
    with pytest.warns(UserWarning, match="X has feature names, but KernelRidge was fitted without"):
        m.predict(_Frame(x, ["a", "b", "c"]))


WITHOUT_SKLEARN = r'''
import sys, pickle
sys.modules["sklearn"] = None  # import sklearn raises ImportError
import numpy as np
from kermac_like import _estimator
from kermac_like.solvers import KernelRidge
assert not _estimator.HAVE_SKLEARN
rng = np.random.default_rng(0)
x = rng.uniform(-1, 1, (30, 2)); y = np.sin(x[:, 0])
m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.01)
try:
    m.predict(x)
except _estimator.NotFittedError as e:
    assert isinstance(e, ValueError) and isinstance(e, AttributeError)
assert m.fit(x, y).score(x, y) > 0.99
assert repr(m.set_params(alpha=0.5)) == "KernelRidge(alpha=0.5, bandwidth=1.0, kernel='gaussian_l2')", repr(m)
try:
    m.set_params(gamma=1)
    raise SystemExit("set_params took an unknown parameter")
except ValueError as e:
    assert str(e).startswith("gamma:"), e
back = pickle.loads(pickle.dumps(m.fit(x, y)))
assert np.array_equal(back.predict(x), m.predict(x))
from kermac_like.cluster import KMeans
km = KMeans(3, random_state=0).fit(x)
assert km.labels_.dtype == np.int32 and np.array_equal(km.predict(x), km.labels_)
assert km.transform(x).shape == (30, 3) and km.score(x) == -km.inertia_
print("ok")
'''


def test_estimators_work_without_sklearn():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", WITHOUT_SKLEARN], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
