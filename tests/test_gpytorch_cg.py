"""The GPyTorch operator's linear_cg (kermac_like.testing.gp_cg) against linear_operator's linear_cg (CPU): the same solves and
tridiagonals bit for bit (float64 and float32, with and without preconditioner and tridiagonals, batches,
zero and vector right-hand sides, an initial guess, a stop on the tolerance, on the iteration cap and on the
tridiagonal's end), the same errors and warnings; one product fewer and host reads only where the stopping
rule can act; the operator's solves through it equal linear_operator's own on a training step.
"""

import warnings

import pytest
import torch

pytest.importorskip("gpytorch")
pytest.importorskip("linear_operator")

from linear_operator import settings  # noqa: E402
from linear_operator.utils.linear_cg import linear_cg as lo_linear_cg  # noqa: E402

from kermac_like.testing import gp_cg as _cg  # noqa: E402


def spd(n, batch=(), dtype=torch.float64, seed=0, spectrum=None):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=g, dtype=torch.float64))
    if spectrum is None:
        spectrum = torch.logspace(-2, 1, n, dtype=torch.float64)
    return (q * spectrum) @ q.mT, g


class Counting:
    """A dense matmul closure that counts its calls."""

    def __init__(self, a):
        self.a, self.calls = a, 0

    def __call__(self, v):
        self.calls += 1
        return self.a @ v


def run_both(a, rhs, **kw):
    """(ours, linear_operator's, our closure calls, theirs, our warnings, theirs) on the same arguments."""
    ours, theirs = Counting(a), Counting(a)
    zero = (a @ torch.zeros_like(rhs if rhs.dim() > 1 else rhs[:, None])).shape
    with warnings.catch_warnings(record=True) as w1:
        warnings.simplefilter("always")
        r1 = _cg.linear_cg(ours, rhs, zero_residual=(zero, torch.promote_types(a.dtype, rhs.dtype)), **kw)
    with warnings.catch_warnings(record=True) as w2:
        warnings.simplefilter("always")
        r2 = lo_linear_cg(theirs, rhs, **kw)
    return r1, r2, ours.calls, theirs.calls, [str(x.message) for x in w1], [str(x.message) for x in w2]


def assert_same(r1, r2):
    r1 = r1 if isinstance(r1, tuple) else (r1,)
    r2 = r2 if isinstance(r2, tuple) else (r2,)
    assert len(r1) == len(r2)
    for a, b in zip(r1, r2):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), (a - b).abs().max()


def jacobi(a):
    d = a.diagonal(dim1=-2, dim2=-1)[..., None]
    return lambda r: r / d


CASES = {
    "plain": dict(n=60, cols=4, kw={}),
    "tridiag": dict(n=60, cols=5, kw=dict(n_tridiag=3)),
    "precond_tridiag": dict(n=60, cols=5, kw=dict(n_tridiag=5), precond=True),
    "precond": dict(n=60, cols=3, kw={}, precond=True),
    "batch": dict(n=40, cols=3, batch=(2,), kw=dict(n_tridiag=2)),
    "cap": dict(n=80, cols=2, kw=dict(max_iter=12, max_tridiag_iter=12, n_tridiag=2)),
    "small": dict(n=6, cols=3, kw=dict(n_tridiag=3)),
    "tolerance": dict(n=60, cols=3, kw=dict(tolerance=1e-6, n_tridiag=1)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_for_bit_linear_operators(name, dtype):
    case = CASES[name]
    a, g = spd(case["n"], case.get("batch", ()))
    a = a.to(dtype)
    rhs = torch.randn(case["n"], case["cols"], generator=g, dtype=torch.float64).to(dtype)
    kw = dict(case["kw"])
    if case.get("precond"):
        kw["preconditioner"] = jacobi(a)
    r1, r2, c1, c2, w1, w2 = run_both(a, rhs, **kw)
    assert_same(r1, r2)
    assert c1 == c2 - 1  # no product with the zero initial guess
    assert w1 == w2
    if name == "cap":
        assert len(w1) == 1 and "CG terminated in 12 iterations" in w1[0]


def test_tridiagonal_end_and_zero_column():
    # three eigenvalues: CG is exact after three iterations and the tridiagonal's off-diagonal collapses
    n = 50
    a, g = spd(n, spectrum=torch.tensor([1.0, 3.0, 7.0], dtype=torch.float64).repeat_interleave(torch.tensor([20, 20, 10])))
    rhs = torch.randn(n, 4, generator=g, dtype=torch.float64)
    rhs[:, 2] = 0
    r1, r2, c1, c2, w1, w2 = run_both(a, rhs, n_tridiag=3, tolerance=1e-30)
    assert_same(r1, r2)
    assert 2 <= r2[1].shape[-1] < 10  # the tridiagonal ended early, and ours ends it at the same row
    assert w1 == w2 and c1 == c2 - 1


def test_vector_rhs_initial_guess_and_no_zero_residual():
    a, g = spd(30)
    rhs = torch.randn(30, generator=g, dtype=torch.float64)
    guess = torch.randn(30, generator=g, dtype=torch.float64)
    for kw in ({}, dict(initial_guess=guess)):
        r1, r2, c1, c2, _, _ = run_both(a, rhs, **kw)
        assert_same(r1, r2)
        assert c1 == c2 - ("initial_guess" not in kw)
    ours, theirs = Counting(a), Counting(a)  # without the hint the product with zeros runs, as linear_cg's
    assert_same(_cg.linear_cg(ours, rhs), lo_linear_cg(theirs, rhs))
    assert ours.calls == theirs.calls


def test_converged_at_start_runs_no_iteration():
    a, _ = spd(20)
    rhs = torch.zeros(20, 2, dtype=torch.float64)
    r1, r2, c1, c2, w1, w2 = run_both(a, rhs)
    assert_same(r1, r2)
    assert (c1, c2, w1, w2) == (0, 1, [], [])


@pytest.mark.parametrize("where", ["matrix", "rhs"])
def test_nan_raises_linear_operators_error(where):
    a, g = spd(30)
    rhs = torch.randn(30, 3, generator=g, dtype=torch.float64)
    if where == "matrix":
        a[4, 7] = float("nan")
    else:
        rhs[3, 1] = float("nan")
    for fn in (lambda: lo_linear_cg(a.matmul, rhs, n_tridiag=2),
               lambda: _cg.linear_cg(a.matmul, rhs, n_tridiag=2, zero_residual=((30, 3), a.dtype))):
        with pytest.raises(RuntimeError, match="NaNs encountered"):
            fn()


def test_reads_the_device_only_where_the_stop_can_act(monkeypatch):
    """linear_cg reads a device value every iteration (the tridiagonal's end while it is built, the tolerance
    from iteration 10 on); ours reads none before the first iteration that may stop (k = 20 with the default
    20 Lanczos iterations), then one an iteration."""
    a, g = spd(200, spectrum=torch.logspace(-2, 1, 200, dtype=torch.float64))
    rhs = torch.randn(200, 4, generator=g, dtype=torch.float64)
    reads = []
    for name in ("__bool__", "__int__", "item"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *args, _orig=orig, _name=name):
            reads.append(_name)
            return _orig(self, *args)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    with settings.cg_tolerance(1e-3):
        theirs = Counting(a)
        r2 = lo_linear_cg(theirs, rhs, n_tridiag=2)
        n_theirs = len(reads)
        reads.clear()
        ours = Counting(a)
        r1 = _cg.linear_cg(ours, rhs, n_tridiag=2, zero_residual=(rhs.shape, rhs.dtype))
        n_ours = len(reads)
    monkeypatch.undo()
    assert_same(r1, r2)
    iterations = theirs.calls - 1
    assert iterations > 25  # the stop is past the first possible one
    assert n_theirs >= iterations + 9  # the tolerance from k = 10, the tridiagonal's end at k = 1 ... 19
    # one read per iteration from k = 20 on, the NaN flags once, has_converged's skip test never
    # (tridiagonals), the tridiagonal's end once
    assert n_ours == (iterations - 20) + 2, (n_ours, iterations)


def test_operator_solve_uses_it_and_matches(monkeypatch):
    """A training step (CG and Lanczos, the pivoted-Cholesky preconditioner) with the package's linear_cg and
    with linear_operator's: the same MLL and gradients bit for bit."""
    import gpytorch

    from kermac_like.gpytorch import RBFKernel, ScaledExactGP

    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 3, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(300, generator=g, dtype=torch.float64)

    def step():
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(torch.float64)
        model = ScaledExactGP(x, y, likelihood, RBFKernel()).to(torch.float64)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        model.train()
        likelihood.train()
        torch.manual_seed(1)
        with gpytorch.settings.max_cholesky_size(0):
            loss = -mll(model(x), y)
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    calls = []
    orig = _cg.linear_cg
    monkeypatch.setattr(_cg, "linear_cg", lambda *a, **k: calls.append(1) or orig(*a, **k))
    ours = step()
    assert calls
    monkeypatch.setenv("KERMAC_LIKE_GP_CG", "0")
    n = len(calls)
    theirs = step()
    assert len(calls) == n
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (a - b).abs().max()
