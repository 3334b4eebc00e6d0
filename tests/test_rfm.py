"""Recursive Feature Machines (kermac_like.rfm): the gradients and the AGOP against torch.autograd,
the whole RFM loop against a float64 reference written plainly here (kernel matrix, solve,
autograd gradients, AGOP), against xRFM on the CPU where it is installed, scikit-learn's
check_estimator and model selection, early stopping, the solvers, and bad input.
"""

import math

import numpy as np
import pytest
import torch

from kermac_like.rfm import RFMClassifier, RFMRegressor, agop_sum, function_gradients, resolve_rfm_kernel

F64 = torch.float64


def task(n, d, seed, noise=0.05):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    y = x[:, 0] * x[:, 1] + np.sin(2 * x[:, 2]) + 0.5 * (x[:, 3] > 0) + noise * rng.standard_normal(n)
    return x, y


# -- a plain float64 reference RFM ------------------------------------------------------------------
def ref_kernel(a, b, p, q, L):
    r = (a[:, None, :] - b[None, :, :]).abs().pow(p).sum(-1).pow(1 / p)
    return torch.exp(-(r / L) ** q)


def ref_gradients(u, coef, v, p, q, L):
    """(O, m, D) by autograd; the self pairs' cusp (r = 0) masked as the estimator does."""
    vv = v.clone().requires_grad_(True)
    d = vv[:, None, :] - u[None, :, :]
    r = d.abs().pow(p).sum(-1)
    same = r == 0
    r = torch.where(same, torch.ones_like(r), r).pow(1 / p)
    k = torch.where(same, torch.ones_like(r), torch.exp(-(r / L) ** q))  # constant where r = 0
    f = k @ coef  # (m, O)
    return torch.stack([torch.autograd.grad(f[:, o].sum(), vv, retain_graph=True)[0] for o in range(coef.shape[1])])


def ref_rfm(x, y, *, p, q, L, reg, iters, diag=False, power=0.5):
    """(M, S, coef) of the last of iters + 1 machines, and predictions of that machine at x."""
    D = x.shape[1]
    s = torch.ones(D, dtype=F64) if diag else torch.eye(D, dtype=F64)
    m = s.clone()
    for it in range(iters + 1):
        u = x * s if diag else x @ s
        k = ref_kernel(u, u, p, q, L) + reg * torch.eye(len(u), dtype=F64)
        coef = torch.linalg.solve(k, y)
        if it == iters:
            return m, s, coef
        g = ref_gradients(u, coef, u, p, q, L)  # (O, n, D) in the transformed space
        gx = g * s if diag else g @ s.T  # chain rule: grad_x = S grad_u
        g2 = gx.reshape(-1, D)
        a = (g2 * g2).sum(0) if diag else g2.T @ g2
        m = a / a.max()
        if diag:
            s = m.clamp_min(0) ** power
        else:
            w, vecs = torch.linalg.eigh(m)
            s = (vecs * w.clamp_min(0) ** power) @ vecs.T


KERNELS = [  # (name, exponent, norm_p) -> p, q
    ("laplace_l2", 1.0, 2.0), ("product_laplace", 1.0, 2.0), ("lpq", 1.0, 1.5), ("gaussian", 1.0, 2.0),
    ("lpq", 0.8, 1.3), ("laplace_l2", 1.5, 2.0),
]


@pytest.mark.parametrize("name,exponent,norm_p", KERNELS)
def test_gradients_and_agop_match_autograd(name, exponent, norm_p):
    kern = resolve_rfm_kernel(name, exponent, norm_p)
    g = torch.Generator().manual_seed(7)
    u = torch.randn(37, 5, generator=g, dtype=F64) + 3.0  # off the origin: the p = 2 path shifts
    v = torch.cat([torch.randn(20, 5, generator=g, dtype=F64) + 3.0, u[:4]])  # with self pairs
    coef = torch.randn(37, 2, generator=g, dtype=F64)
    L = kern.length(1.9)
    want = ref_gradients(u, coef, v, kern.p, kern.q, L)
    got = function_gradients(kern, 1.9, u, coef, v, block_bytes=37 * 8 * 3)  # blocks of 1-3 points
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    a = agop_sum(kern, 1.9, u, coef, v, block_bytes=37 * 8 * 7)
    torch.testing.assert_close(a, torch.einsum("omd,ome->de", want, want), rtol=1e-9, atol=1e-12)
    ad = agop_sum(kern, 1.9, u, coef, v, diag=True)
    torch.testing.assert_close(ad, want.square().sum((0, 1)), rtol=1e-9, atol=1e-12)
    ac = agop_sum(kern, 1.9, u, coef, v, center=True)
    flat = want.reshape(-1, 5)
    flat = flat - flat.mean(0)
    torch.testing.assert_close(ac, flat.T @ flat, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name,exponent,norm_p,diag", [("laplace_l2", 1.0, 2.0, False),
                                                       ("product_laplace", 1.0, 2.0, True),
                                                       ("lpq", 1.0, 1.5, False), ("gaussian", 1.0, 2.0, False)])
def test_matches_float64_reference_rfm(name, exponent, norm_p, diag):
    x, y = task(120, 6, seed=1)
    kern = resolve_rfm_kernel(name, exponent, norm_p)
    bw = 4.0
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)[:, None]
    m, s, coef = ref_rfm(xt, yt, p=kern.p, q=kern.q, L=kern.length(bw), reg=1e-3, iters=2, diag=diag)
    est = RFMRegressor(name, bandwidth=bw, exponent=exponent, norm_p=norm_p, reg=1e-3, iters=2, diag=diag).fit(x, y)
    assert est.n_iter_ == 2 and est.best_iter_ == 2 and len(est.history_) == 3
    assert isinstance(est.M_, np.ndarray) and isinstance(est.dual_coef_, np.ndarray)
    np.testing.assert_allclose(est.M_, m.numpy(), rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(est.sqrtM_, s.numpy(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(est.dual_coef_, coef.numpy(), rtol=1e-6, atol=1e-6 * np.abs(coef.numpy()).max())
    xq = torch.from_numpy(task(30, 6, seed=2)[0])
    uq, u = (xq * s, xt * s) if diag else (xq @ s, xt @ s)
    want = (ref_kernel(uq, u, kern.p, kern.q, kern.length(bw)) @ coef)[:, 0]
    np.testing.assert_allclose(est.predict(xq.numpy()), want.numpy(), rtol=1e-7, atol=1e-9)


def test_trace_normalisation_and_power():
    x, y = task(80, 5, seed=3)
    est = RFMRegressor(bandwidth=5.0, iters=1, normalize="trace", power=1.0).fit(x, y)
    assert np.trace(est.M_) == pytest.approx(5.0)
    np.testing.assert_allclose(est.sqrtM_, est.M_, rtol=1e-6, atol=1e-9)  # power 1: S = M


# -- xRFM on the CPU --------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,exponent,norm_p", [("l2", 1.0, 2.0), ("l1", 1.0, 2.0), ("lpq", 1.0, 1.5)])
def test_same_as_xrfm_after_one_iteration(kernel, exponent, norm_p):
    rfm_mod = pytest.importorskip("xrfm.rfm_src.recursive_feature_machine")
    x, y = task(120, 6, seed=4)
    xv, yv = task(40, 6, seed=5)
    xt = task(50, 6, seed=6)[0]
    theirs = rfm_mod.RFM(kernel=kernel, iters=1, bandwidth=5.0, exponent=exponent, norm_p=norm_p, device="cpu",
                         verbose=False, solver="solve")
    theirs.fit((torch.from_numpy(x), torch.from_numpy(y)[:, None]), (torch.from_numpy(xv), torch.from_numpy(yv)[:, None]),
               iters=1, reg=1e-3, return_best_params=False, early_stop_rfm=False, verbose=False)
    ours = RFMRegressor(kernel, bandwidth=5.0, exponent=exponent, norm_p=norm_p, reg=1e-3, iters=1).fit(x, y)
    m_theirs = theirs.M.numpy()
    assert np.linalg.norm(ours.M_ - m_theirs) <= 1e-4 * np.linalg.norm(m_theirs)
    p_theirs = theirs.predict(torch.from_numpy(xt)).numpy()[:, 0]
    assert np.linalg.norm(ours.predict(xt) - p_theirs) <= 1e-4 * np.linalg.norm(p_theirs)


# -- early stopping, the kept model, the solvers ----------------------------------------------------
def test_early_stopping_keeps_the_best_iteration():
    x, y = task(100, 6, seed=8)
    xv, yv = task(60, 6, seed=9)
    est = RFMRegressor(bandwidth=5.0, iters=4, early_stop_multiplier=None).fit(x, y, eval_set=(xv, yv))
    scores = [h["metric"] for h in est.history_]
    assert len(scores) == 5 and est.best_iter_ == int(np.argmin(scores))
    # the kept model is the machine of that iteration: a fit with iters = best_iter_ ends on it
    again = RFMRegressor(bandwidth=5.0, iters=est.best_iter_).fit(x, y)
    np.testing.assert_allclose(est.predict(xv), again.predict(xv), rtol=1e-9, atol=1e-12)
    assert np.mean((est.predict(xv) - yv) ** 2) == pytest.approx(min(scores))
    # a multiplier below any change stops at the first iteration that is worse than the best
    early = RFMRegressor(bandwidth=5.0, iters=4, early_stop_multiplier=1.0).fit(x, y, eval_set=[(xv, yv)])
    worse = [i for i in range(1, 5) if scores[i] > min(scores[:i])]
    assert len(early.history_) == (worse[0] + 1 if worse else 5)


def test_nystrom_with_every_point_a_centre_is_cholesky():
    x, y = task(90, 5, seed=10)
    exact = RFMRegressor(bandwidth=5.0, iters=1, reg=1e-2, solver="cholesky").fit(x, y)
    falkon = RFMRegressor(bandwidth=5.0, iters=1, reg=1e-2, solver="nystrom", n_centers=90, tol=1e-10,
                          random_state=0).fit(x, y)
    np.testing.assert_allclose(falkon.M_, exact.M_, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(falkon.predict(x[:20]), exact.predict(x[:20]), rtol=1e-5, atol=1e-6)
    part = RFMRegressor(bandwidth=5.0, iters=1, reg=1e-2, solver="nystrom", n_centers=40, random_state=0).fit(x, y)
    assert part.X_fit_.shape == (40, 5) and part.dual_coef_.shape == (40, 1) and part.solver_ == "nystrom"


def test_median_bandwidth_and_agop_sample():
    x, y = task(150, 5, seed=11)
    est = RFMRegressor(bandwidth=1.0, bandwidth_mode="median", iters=2, agop_samples=60, random_state=3).fit(x, y)
    u = x @ est.sqrtM_
    d = np.sqrt(((u[:, None] - u[None]) ** 2).sum(-1))[np.triu_indices(150, 1)]
    assert est.bandwidth_ == pytest.approx(np.median(d), rel=1e-3)  # torch's median: the lower middle value
    assert est.score(x, y) > 0.9


# -- classification ----------------------------------------------------------------------------------
def test_classifier_labels_probabilities_and_decision():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    labels = np.where(y == 1, "benign", "malignant")
    clf = RFMClassifier(bandwidth=10.0, iters=2).fit(X[:400], labels[:400], eval_set=(X[400:480], labels[400:480]))
    assert list(clf.classes_) == ["benign", "malignant"]
    proba = clf.predict_proba(X[480:])
    np.testing.assert_allclose(proba.sum(1), 1.0)
    assert proba.min() >= 1e-3 / (1 + 1e-3) - 1e-12
    dec = clf.decision_function(X[480:])
    np.testing.assert_array_equal(clf.predict(X[480:]), clf.classes_[(dec > 0).astype(int)])
    assert clf.score(X[480:], labels[480:]) > 0.9
    # three classes: one-hot targets, (n, 3) outputs
    from sklearn.datasets import load_iris

    Xi, yi = load_iris(return_X_y=True)
    c3 = RFMClassifier(bandwidth=5.0, iters=1, tuning_metric="accuracy").fit(Xi[::2], yi[::2], eval_set=(Xi[1::2], yi[1::2]))
    assert c3.dual_coef_.shape == (75, 3) and c3.decision_function(Xi[:4]).shape == (4, 3)
    assert c3.score(Xi[1::2], yi[1::2]) > 0.9


def test_tensors_in_tensors_out():
    x, y = task(70, 4, seed=12)
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    est = RFMRegressor(bandwidth=5.0, iters=1).fit(xt, yt)
    pred = est.predict(xt[:5])
    assert isinstance(pred, torch.Tensor) and pred.dtype == torch.float32 and pred.shape == (5,)
    assert isinstance(est.M_, torch.Tensor) and isinstance(est.dual_coef_, torch.Tensor)
    clf = RFMClassifier(bandwidth=5.0, iters=1).fit(xt, (yt > yt.median()).long())
    out = clf.predict(xt[:5])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,fit,match", [
    (dict(kernel="matern"), None, "kernel"),
    (dict(power=0.0), None, "power"),
    (dict(power=-1.0), None, "power"),
    (dict(reg=-1.0), None, "reg"),
    (dict(bandwidth=0.0), None, "bandwidth"),
    (dict(kernel="lpq", exponent=1.5, norm_p=1.2), None, "exponent"),
    (dict(solver="lu"), None, "solver"),
    (dict(tuning_metric="accuracy"), None, "tuning_metric"),
    (dict(), "nan_x", "X"),
    (dict(), "nan_y", "y"),
    (dict(), "short_y", "y"),
    (dict(reg=0.0), "duplicates", "reg"),
    (dict(), "eval_set", "eval_set"),
])
def test_bad_input_raises_naming_the_argument(params, fit, match):
    x, y = task(40, 4, seed=13)
    est = RFMRegressor(**{"bandwidth": 5.0, "iters": 1, **params})
    if fit == "nan_x":
        x[3, 1] = np.nan
    elif fit == "nan_y":
        y[5] = np.inf
    elif fit == "short_y":
        y = y[:-1]
    elif fit == "duplicates":
        x[7] = x[2]
    kw = dict(eval_set=(x[:5, :2], y[:5])) if fit == "eval_set" else {}
    with pytest.raises(ValueError, match=match):
        est.fit(x, y, **kw)


# -- scikit-learn ----------------------------------------------------------------------------------
sklearn = pytest.importorskip("sklearn")
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402


@parametrize_with_checks([RFMRegressor(bandwidth=5.0, iters=1), RFMClassifier(bandwidth=5.0, iters=1)])
def test_check_estimator(estimator, check):
    check(estimator)


def test_grid_search_over_bandwidth_and_reg():
    from sklearn.model_selection import GridSearchCV, KFold

    x, y = task(90, 5, seed=14)
    grid = GridSearchCV(RFMRegressor(iters=1), {"bandwidth": [0.05, 5.0], "reg": [1e-3, 100.0]}, cv=KFold(3))
    grid.fit(x, y)
    assert grid.best_params_ == {"bandwidth": 5.0, "reg": 1e-3}, grid.cv_results_["mean_test_score"]


# -- GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name,exponent,norm_p", KERNELS)
def test_gpu_agop_matches_float64(name, exponent, norm_p):
    kern = resolve_rfm_kernel(name, exponent, norm_p)
    g = torch.Generator().manual_seed(21)
    u = torch.randn(1000, 16, generator=g, dtype=F64)
    v = torch.cat([torch.randn(300, 16, generator=g, dtype=F64), u[:50]])
    coef = torch.randn(1000, 3, generator=g, dtype=F64) / 30
    want = agop_sum(kern, 4.0, u, coef, v)
    got = agop_sum(kern, 4.0, u.float().cuda(), coef.float().cuda(), v.float().cuda(), block_bytes=1 << 20)
    assert (got.cpu() - want).norm() <= 1e-4 * want.norm()


@pytest.mark.gpu
def test_gpu_fit_matches_cpu_float64():
    x, y = task(2000, 12, seed=22)
    xt = task(300, 12, seed=23)[0]
    cpu = RFMRegressor(bandwidth=8.0, iters=3).fit(x, y)
    gpu = RFMRegressor(bandwidth=8.0, iters=3, device="cuda").fit(x, y)
    assert isinstance(gpu.M_, np.ndarray)
    assert np.linalg.norm(gpu.M_ - cpu.M_) <= 1e-3 * np.linalg.norm(cpu.M_)
    p = cpu.predict(xt)
    assert np.linalg.norm(gpu.predict(xt) - p) <= 1e-3 * np.linalg.norm(p)
    assert math.isfinite(gpu.history_[-1]["seconds"])
