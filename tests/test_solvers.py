"""kermac_like.solvers.KernelRidge: scikit-learn's KernelRidge as the oracle (float64), the
Nyström estimator against the exact one, two gloo processes against one, bad input.

CPU tests are small (the reference path runs every kernel product); the GPU tests (marker
``gpu``) run the fused kernels in float32 against a float64 exact solution.
"""

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from gloo_spawn import spawn_workers

from kermac_like.solvers import ConvergenceWarning, KernelRidge
from kermac_like.testing import solver_cg

sklearn = pytest.importorskip("sklearn")
from sklearn.gaussian_process.kernels import Matern  # noqa: E402
from sklearn.kernel_ridge import KernelRidge as SkKernelRidge  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smooth_data(n, n_test, d=3, targets=1, seed=0, dtype=torch.float64, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n + n_test, d, dtype=torch.float64, generator=g) * 2 - 1
    f = torch.stack([torch.sin(2 * x[:, 0] + t) * torch.cos(x[:, 1:].sum(1)) for t in range(targets)], 1)
    y = f + noise * torch.randn(f.shape, dtype=torch.float64, generator=g)
    if targets == 1:
        y, f = y[:, 0], f[:, 0]
    return x[:n].to(dtype), y[:n].to(dtype), x[n:].to(dtype), f[n:].to(dtype)


# kernel preset, bandwidth -> the equal scikit-learn kernel
SKLEARN_KERNELS = {
    "gaussian_l2": lambda bw: dict(kernel="rbf", gamma=1.0 / (2 * bw * bw)),
    "laplace_l1": lambda bw: dict(kernel="laplacian", gamma=1.0 / bw),
    "laplace_l2": lambda bw: dict(kernel=Matern(length_scale=bw, nu=0.5)),
}


def sk_predict(kernel, bw, alpha, x, y, xt):
    m = SkKernelRidge(alpha=alpha, **SKLEARN_KERNELS[kernel](bw)).fit(x.numpy(), y.numpy())
    return torch.from_numpy(m.predict(xt.numpy()))


@pytest.mark.parametrize("kernel", sorted(SKLEARN_KERNELS))
def test_cholesky_matches_sklearn(kernel):
    x, y, xt, _ = smooth_data(120, 40, targets=2)
    ref = sk_predict(kernel, 0.8, 0.05, x, y, xt)
    m = KernelRidge(kernel, bandwidth=0.8, alpha=0.05, solver="cholesky").fit(x, y)
    pred = m.predict(xt)
    assert pred.shape == ref.shape == (40, 2)
    assert torch.allclose(pred, ref, rtol=0, atol=1e-6 * ref.abs().max()), (pred - ref).abs().max()
    assert m.solver_ == "cholesky" and m.n_iter_ == 1 and m.residual_ is None
    assert m.dual_coef_.shape == (120, 2) and m.X_fit_.shape == (120, 3) and m.n_features_in_ == 3


def test_cg_matches_sklearn_and_converges():
    x, y, xt, _ = smooth_data(150, 40)
    ref = sk_predict("gaussian_l2", 0.7, 0.02, x, y, xt)
    m = KernelRidge("gaussian_l2", bandwidth=0.7, alpha=0.02, solver="cg", n_landmarks=30, tol=1e-8,
                    random_state=0).fit(x, y)
    pred = m.predict(xt)
    assert pred.shape == (40,)
    assert (pred - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert m.residual_ <= 1e-8 and 1 <= m.n_iter_ < 100 and m.preconditioner_rank_ > 0
    # the recursive residual the solver reports is the true one (float64)
    k = torch.exp(-torch.cdist(x, x) ** 2 / (2 * 0.7 ** 2))
    true = (y - k @ m.dual_coef_[:, 0] - 0.02 * m.dual_coef_[:, 0]).norm() / y.norm()
    assert true <= 1e-7
    # the preconditioner pays: without it CG needs many more iterations
    plain = KernelRidge("gaussian_l2", bandwidth=0.7, alpha=0.02, solver="cg", n_landmarks=0, tol=1e-8,
                        max_iter=2000).fit(x, y)
    assert plain.n_iter_ > 2 * m.n_iter_


def test_nystrom_all_centres_is_exact_and_100_centres_close():
    x, y, xt, ft = smooth_data(300, 100)
    exact = KernelRidge("gaussian_l2", bandwidth=0.8, alpha=0.03, solver="cholesky").fit(x, y)
    pe = exact.predict(xt)
    full = KernelRidge("gaussian_l2", bandwidth=0.8, alpha=0.03, solver="nystrom", n_centers=300, tol=1e-8,
                       random_state=1).fit(x, y)
    assert (full.predict(xt) - pe).abs().max() <= 1e-4 * pe.abs().max()
    few = KernelRidge("gaussian_l2", bandwidth=0.8, alpha=0.03, solver="nystrom", n_centers=100,
                      random_state=1).fit(x, y)
    assert few.centers_.shape == (100, 3) and few.dual_coef_.shape == (100, 1)
    mse_exact = float(((pe - ft) ** 2).mean())
    mse_few = float(((few.predict(xt) - ft) ** 2).mean())
    assert abs(mse_few - mse_exact) <= 0.1 * mse_exact, (mse_few, mse_exact)


def test_nystrom_float32_reaches_tol():
    """Falkon on float32 data (here the CPU reference path) at lambda = alpha / N = 1e-6 reaches
    tol = 1e-7 with no floor: its products run in kernel_matvec's float64 mode (float32 kernel values,
    float64 products and sums, beta kept in float64) and its penalty takes the factored K_ZZ + delta I
    (exactly SPD). The predictions then differ from float64 data's by the float32 data alone (~1e-5).
    History: float32 products stalled at 2.3e-4 (tol 1e-4), then at 2.2e-5 with K_Zn u in float64;
    with the raw K_ZZ in the penalty CG diverged past ~2e-4 at N = 10^6 (bench/notes/solvers.md)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1700, 8, dtype=torch.float64, generator=g) * 2 - 1
    f = (torch.sin(math.pi * (x[:, 0] + x[:, 1]) / 2) * torch.cos(math.pi * x[:, 2] / 2)
         + 0.5 * torch.tanh(x[:, 3] + x[:, 4] - x[:, 5]) + 0.25 * x[:, 6] * x[:, 7])
    y = f + 0.1 * torch.randn(f.shape, dtype=torch.float64, generator=g)
    x, y, xt = x[:1500], y[:1500], x[1500:]
    kw = dict(bandwidth=1.5, alpha=1.5e-3, solver="nystrom", n_centers=300, tol=1e-7, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        m32 = KernelRidge("gaussian_l2", **kw).fit(x.float(), y.float())
    assert m32.residual_ <= 1e-7 and m32.n_iter_ < 100, (m32.residual_, m32.n_iter_)
    assert m32.dual_coef_.dtype == torch.float64  # beta cancels: kept in float64
    p64 = KernelRidge("gaussian_l2", **kw).fit(x, y).predict(xt)
    p32 = m32.predict(xt.float())
    assert p32.dtype == torch.float32  # predictions in the data's dtype
    p32 = p32.double()
    assert (p32 - p64).norm() <= 3e-5 * p64.norm(), float((p32 - p64).norm() / p64.norm())


def test_auto_numpy_score_and_params():
    x, y, xt, ft = smooth_data(100, 30, seed=3)
    m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.1)
    assert m.fit(x.numpy(), y.numpy()) is m and m.solver_ == "cholesky"  # tiny: it fits
    pred = m.predict(xt.numpy())
    assert isinstance(pred, np.ndarray) and pred.shape == (30,)
    sk = SkKernelRidge(alpha=0.1, kernel="rbf", gamma=0.5).fit(x.numpy(), y.numpy())
    assert abs(m.score(xt.numpy(), ft.numpy()) - sk.score(xt.numpy(), ft.numpy())) < 1e-9
    params = m.get_params()
    assert params["alpha"] == 0.1 and params["solver"] == "auto" and params["kernel"] == "gaussian_l2"
    from sklearn.base import clone

    c = clone(m).set_params(alpha=0.5)
    assert c.alpha == 0.5 and not hasattr(c, "dual_coef_") and "alpha=0.5" in repr(c)
    with pytest.raises(ValueError, match="gamma"):
        m.set_params(gamma=1.0)


def test_convergence_warning_reports_residual():
    x, y, _, _ = smooth_data(80, 1)
    with pytest.warns(ConvergenceWarning, match=r"relative residual \d\.\d+e-\d+"):
        m = KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-3, solver="cg", n_landmarks=0, max_iter=2,
                        tol=1e-12).fit(x, y)
    assert m.n_iter_ == 2 and m.residual_ > 1e-12


def test_cg_one_host_read_per_iteration():
    """The stopping test is the only device-to-host read of an iteration: float() of a tensor,
    counted here through a tensor subclass of the residuals (plus one before the loop and one
    for the true residual checked at convergence)."""
    reads = []

    class Counted(torch.Tensor):
        def __float__(self):
            reads.append(1)
            return super().__float__()

    a = torch.randn(30, 30, dtype=torch.float64)
    a = a @ a.T + 30 * torch.eye(30, dtype=torch.float64)
    b = torch.randn(30, 2, dtype=torch.float64)

    def dots(pairs):
        return torch.stack([(u * v).sum(0, dtype=torch.float64) for u, v in pairs]).as_subclass(Counted)

    res = solver_cg.pcg(lambda v: a @ v, lambda r: r.clone(), b, tol=1e-10, max_iter=100, dots=dots)
    assert res.converged and res.n_iter > 3
    assert len(reads) == res.n_iter + 2  # one per iteration, one before the first, one for the true residual
    assert torch.allclose(a @ res.x.as_subclass(torch.Tensor), b, atol=1e-8)


def _noisy_spd(n=200, cond=100, noise=1e-4, grow_after=None, seed=0):
    """An SPD operator (eigenvalues 1 .. cond) applied with relative rounding ``noise`` (a
    float32 product stands for it), optionally garbage after ``grow_after`` products."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    a = (q * torch.logspace(0, math.log10(cond), n, dtype=torch.float64)) @ q.T
    calls = []

    def apply_a(v):
        calls.append(1)
        w = a @ v
        scale = noise * (a.abs() @ v.abs())
        if grow_after is not None and len(calls) > grow_after:
            scale = scale * 10.0 ** (len(calls) - grow_after)
        return w + scale * torch.randn(w.shape, dtype=w.dtype, generator=g)

    return a, apply_a, calls


@pytest.mark.parametrize("grow_after", [None, 30])
def test_cg_true_residual_checks_keep_the_best_iterate(grow_after):
    """check_every: an operator whose rounding CG cannot outrun (a noise floor, or noise that
    takes over) stops at its best iterate long before max_iter, about as accurate as CG run
    to max_iter without the checks (or, where that diverges, still accurate)."""
    b = torch.randn(200, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def true_residual(a, x):
        return float(((b - a @ x).norm(dim=0) / b.norm(dim=0)).max())

    a, apply_a, _ = _noisy_spd(grow_after=grow_after)
    res = solver_cg.pcg(apply_a, lambda r: r.clone(), b, tol=1e-12, max_iter=1000, check_every=5)
    checked = true_residual(a, res.x)
    assert not res.converged and res.n_iter < 100, res.n_iter
    assert checked == pytest.approx(res.residual, rel=0.5)  # reported: the x's own (measured with noise)
    a, apply_a, _ = _noisy_spd(grow_after=grow_after)
    plain = solver_cg.pcg(apply_a, lambda r: r.clone(), b, tol=1e-12, max_iter=300)
    assert plain.n_iter == 300 or not math.isfinite(plain.residual)
    if grow_after is None:
        assert checked < 3 * true_residual(a, plain.x) and checked < 0.05
    else:  # without the checks the run blows up; with them it keeps what it had reached
        assert not math.isfinite(plain.residual) and checked < 0.05


def test_cg_check_at_tol_is_the_verification():
    """A check (check_every) whose true residual is at tol while the recursive one is not ends CG there:
    no second true residual of the same x (one product: a whole data pass in Falkon). The true residual
    here is the caller's form scaled by 1/2, so that the check sees tol before the recursion does."""
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(60, 60, dtype=torch.float64, generator=g))
    a = q @ torch.diag(torch.linspace(1, 4, 60, dtype=torch.float64)) @ q.T
    b = torch.randn(60, 1, dtype=torch.float64, generator=g)
    calls = []

    def residual(x):
        calls.append(1)
        return 0.5 * (b - a @ x)

    rec = []
    solver_cg.pcg(lambda v: a @ v, lambda r: r.clone(), b, tol=1e-30, max_iter=3, progress=lambda it, w: rec.append(w))
    tol = 0.75 * rec[2]
    assert rec[0] > tol and rec[1] > tol  # the recursion is above tol up to the check
    res = solver_cg.pcg(lambda v: a @ v, lambda r: r.clone(), b, tol=tol, max_iter=50, check_every=3, residual=residual)
    assert res.converged and res.n_iter == 3 and len(calls) == 1, (res.n_iter, len(calls))
    assert res.residual == pytest.approx(0.5 * rec[2], rel=1e-6)


@pytest.mark.parametrize("case", ["y_rows", "nan_x", "nan_y", "alpha_cg", "alpha_nystrom", "n_centers", "solver",
                                  "distance", "bandwidth", "x_dim"])
def test_bad_input(case):
    x, y, _, _ = smooth_data(20, 1)
    kw = dict(bandwidth=1.0, alpha=0.1)
    est, X, Y, match = KernelRidge("gaussian_l2", **kw), x, y, None
    if case == "y_rows":
        Y, match = y[:-1], "^y: has 19 rows but X has 20"
    elif case == "nan_x":
        X = x.clone()
        X[3, 1] = float("nan")
        match = "^X: contains NaN"
    elif case == "nan_y":
        Y = y.clone()
        Y[0] = float("nan")
        match = "^y: contains NaN"
    elif case == "alpha_cg":
        est, match = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.0, solver="cg"), "^alpha: .*alpha > 0"
    elif case == "alpha_nystrom":
        est, match = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=-1.0, solver="nystrom"), "^alpha"
    elif case == "n_centers":
        est, match = KernelRidge("gaussian_l2", solver="nystrom", n_centers=21, **kw), "^n_centers: 21 centres"
    elif case == "solver":
        est, match = KernelRidge("gaussian_l2", solver="lsqr", **kw), "^solver"
    elif case == "distance":
        est, match = KernelRidge("l2", **kw), "^kernel: .*not a positive definite kernel"
    elif case == "bandwidth":
        est, match = KernelRidge("gaussian_l2", alpha=0.1), "^bandwidth"
    elif case == "x_dim":
        X, match = x[:, 0], "^X: expected a 2-D array"
    with pytest.raises(ValueError, match=match):
        est.fit(X, Y)
    assert not hasattr(est, "dual_coef_")


def test_predict_checks():
    x, y, xt, _ = smooth_data(30, 5)
    m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.1)
    with pytest.raises(sklearn.exceptions.NotFittedError, match="not fitted yet"):
        m.predict(xt)
    m.fit(x, y)
    with pytest.raises(ValueError, match="^X has 2 features, but KernelRidge is expecting 3 features as input"):
        m.predict(xt[:, :2])
    bad = xt.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="^X: contains NaN or infinity"):
        m.predict(bad)


# -- two gloo processes ---------------------------------------------------------------------------

SOLVER_CASES = [("cholesky", {}), ("cg", dict(n_landmarks=30, tol=1e-10)), ("nystrom", dict(n_centers=50, tol=1e-10))]
BAD_CASES = {
    "y_rows": "^y: has 5 rows but X has 60 \\(on rank 1\\)",
    "features": "^X: rank 1 passes features 2, rank 0 passes 3",
    "dtype": "^X: rank 1 passes dtype 'torch.float32'",
    "nan": "^X: contains NaN or infinity \\(on rank 0\\)",
    "predict_rows": "^X: ranks pass different numbers of rows",
}


def _worker(rank, port, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x, y, xt, _ = smooth_data(151, 30, targets=2, seed=5)
        rows = slice(0, 91) if rank == 0 else slice(91, None)  # uneven shards
        out = {}
        for solver, kw in SOLVER_CASES:
            m = KernelRidge("gaussian_l2", bandwidth=0.6, alpha=0.05, solver=solver, random_state=0, **kw)
            out[solver] = m.fit(x[rows], y[rows]).predict(xt).numpy()  # numpy: no shared memory
        xr, yr = x[rows], y[rows]
        for case in BAD_CASES:
            X, Y = xr, yr
            if case == "y_rows" and rank == 1:
                Y = yr[:5]
            elif case == "features" and rank == 1:
                X = xr[:, :2]
            elif case == "dtype" and rank == 1:
                X, Y = xr.float(), yr.float()
            elif case == "nan" and rank == 0:
                X = xr.clone()
                X[0, 0] = float("nan")
            try:
                solver = "cholesky" if case == "predict_rows" else "cg"
                m = KernelRidge("gaussian_l2", bandwidth=0.6, alpha=0.05, solver=solver, n_landmarks=10)
                if case == "predict_rows":
                    m.fit(xr, yr).predict(xt[: 10 + rank])
                else:
                    m.fit(X, Y)
                out[case] = "no error"
            except ValueError as e:
                out[case] = str(e)
        q.put((rank, out))
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        q.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_one():
    results = spawn_workers(_worker)
    assert all(isinstance(r, dict) for r in results.values()), results
    x, y, xt, _ = smooth_data(151, 30, targets=2, seed=5)
    for solver, kw in SOLVER_CASES:
        one = KernelRidge("gaussian_l2", bandwidth=0.6, alpha=0.05, solver=solver, random_state=0, **kw).fit(x, y)
        ref = one.predict(xt)
        for rank in (0, 1):
            err = (torch.from_numpy(results[rank][solver]) - ref).abs().max() / ref.abs().max()
            assert err <= (1e-12 if solver == "cholesky" else 1e-6), (solver, rank, float(err))
    import re

    for case, pattern in BAD_CASES.items():
        for rank in (0, 1):  # every rank raises the same error, nobody hangs
            assert re.search(pattern, results[rank][case]), (case, rank, results[rank][case])


def test_example_quick_runs():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KERMAC_LIKE_DEBUG", None)
    p = subprocess.run([sys.executable, "examples/large_scale_krr.py", "--quick", "-N", "400", "--n-test", "100",
                        "--n-landmarks", "40"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "iterations, relative residual" in out and "exact (cholesky)" in out, out
    diff = float(out.split("test error difference ")[1].split("%")[0])
    assert diff < 1.0, out


# -- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("solver", ["cholesky", "cg", "nystrom"])
def test_gpu_float32_matches_float64_exact(solver):
    x, y, xt, ft = smooth_data(3000, 500, d=8, seed=11)
    exact = SkKernelRidge(alpha=0.3, kernel="rbf", gamma=1 / (2 * 1.5 ** 2)).fit(x.numpy(), y.numpy())
    ref = torch.from_numpy(exact.predict(xt.numpy()))
    kw = dict(n_centers=3000) if solver == "nystrom" else dict(n_landmarks=500) if solver == "cg" else {}
    m = KernelRidge("gaussian_l2", bandwidth=1.5, alpha=0.3, solver=solver, tol=1e-5, random_state=0, **kw)
    pred = m.fit(x.float().cuda(), y.float().cuda()).predict(xt.float().cuda())
    assert pred.is_cuda and pred.dtype == torch.float32
    err = float((pred.double().cpu() - ref).norm() / ref.norm())
    assert err < 1e-3, err
    if solver == "cg":
        assert m.residual_ <= 1e-5
    elif solver == "nystrom":
        # The residual of Falkon's preconditioned normal equations has a float32 floor far above
        # cg's (H200: 6.3e-4 after 168 iterations with every point a centre, while the
        # predictions above match float64): the fit must still report it and stop.
        assert m.residual_ <= 1e-2 and m.n_iter_ > 0


@pytest.mark.gpu
def test_gpu_cg_one_sync_per_iteration():
    """CUDA's sync debug mode flags every synchronising call: one per CG iteration (the stopping
    test) plus a fixed number in the preconditioner's setup."""
    x, y, _, _ = smooth_data(4000, 1, d=8, seed=2)
    x, y = x.float().cuda(), y.float().cuda()
    counts = {}
    # One warm-up fit first, so that one-time planning and kernel loading stay out of the counts.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ConvergenceWarning of max_iter=2
        KernelRidge("gaussian_l2", bandwidth=1.5, alpha=0.5, solver="cg", n_landmarks=200, tol=1e-30, max_iter=2,
                    random_state=0).fit(x, y)
    for max_iter in (3, 8):
        m = KernelRidge("gaussian_l2", bandwidth=1.5, alpha=0.5, solver="cg", n_landmarks=200, tol=1e-30,
                        max_iter=max_iter, random_state=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m.fit(x, y)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts[max_iter] = sum("synchroniz" in str(w.message) for w in caught)
    # At most one synchronisation per iteration (the stopping test): 5 more iterations, at most
    # 5 more synchronisations (H200, 2026-11-23: 4 more, {3: 17, 8: 21}, with or without the warm-up).
    assert 0 < counts[8] - counts[3] <= 5, counts
