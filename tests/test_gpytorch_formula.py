"""kermac_like.gpytorch's Matérn 3/2 and 5/2, RQ and periodic kernels against GPyTorch's own at
N = 50 (float64): the exact MLL and the gradients of every parameter, matrix-free covariances."""

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")
import kermac_like.gpytorch as kg  # noqa: E402

N, D = 50, 3


def _mll(kernel, ours: bool, batch=False):
    torch.manual_seed(0)
    X = torch.randn(N, D, dtype=torch.float64)
    Y = torch.sin(X.sum(-1)) + 0.1 * torch.randn(N, dtype=torch.float64)

    class GP(gpytorch.models.ExactGP):
        def __init__(self, lik):
            super().__init__(X, Y, lik)
            self.mean = gpytorch.means.ConstantMean()
            self.cov = gpytorch.kernels.ScaleKernel(kernel)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = GP(lik).double()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    with gpytorch.settings.max_cholesky_size(0 if ours else 10 ** 6), \
            gpytorch.settings.fast_computations(log_prob=False, covar_root_decomposition=False, solves=False):
        out = model(X)
        if ours:
            assert "Kermac" in type(model.cov.base_kernel(X).evaluate_kernel()).__name__
        loss = -mll(out, Y)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["matern15", "matern25", "rq", "periodic"])
def test_mll_and_gradients_match_gpytorch(name):
    make = {
        "matern15": lambda m: m.MaternKernel(nu=1.5, ard_num_dims=D),
        "matern25": lambda m: m.MaternKernel(nu=2.5),
        "rq": lambda m: m.RQKernel(ard_num_dims=D),
        "periodic": lambda m: m.PeriodicKernel(),
    }[name]
    theirs, g_theirs = _mll(make(gpytorch.kernels), False)
    ours, g_ours = _mll(make(kg), True)
    assert torch.allclose(ours, theirs, rtol=1e-10)
    for n, g in g_theirs.items():
        assert torch.allclose(g_ours[n], g, rtol=1e-8, atol=1e-10), n


def test_matern_nu_and_batches():
    with pytest.raises(ValueError, match="nu"):
        kg.MaternKernel(nu=3.5)
    x = torch.randn(2, 30, D, dtype=torch.float64)
    for make in (lambda m: m.MaternKernel(nu=2.5, batch_shape=torch.Size([2]), ard_num_dims=D),
                 lambda m: m.RQKernel(batch_shape=torch.Size([2]))):
        theirs, ours = make(gpytorch.kernels).double(), make(kg).double()
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(torch.rand_like(p))
        ours.load_state_dict(theirs.state_dict())
        with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
            v = torch.randn(2, 30, 2, dtype=torch.float64)
            assert torch.allclose(ours(x) @ v, theirs(x).to_dense() @ v, rtol=1e-10, atol=1e-12)


def _operator(desc, z1, z2, **params):
    return kg.KermacFormulaLinearOperator(z1, z2, descriptor=desc, **params)


@pytest.mark.parametrize("family", ["matern32", "matern52", "rq", "cauchy", "imq"])
@pytest.mark.parametrize("same", [True, False])
def test_closed_form_derivative_equals_autograd(family, same):
    """The CPU's closed-form gradients of sum(L * K R) (formula_path.grad_factor) against autograd through the
    formula (the generic path), float64, a batch mode, points at distance 0 (duplicates) included."""
    import kermac_like as km

    desc, params = {"matern32": (km.matern(1.5), {}), "matern52": (km.matern(2.5), {}),
                    "rq": (km.rational_quadratic(), {"alpha": torch.tensor([0.7, 1.9], dtype=torch.float64)}),
                    "cauchy": (km.cauchy(), {}), "imq": (km.inverse_multiquadric(), {})}[family]
    g = torch.Generator().manual_seed(4)
    z1 = torch.randn(2, 40, 3, generator=g, dtype=torch.float64) + 5.0
    z1[:, 7] = z1[:, 3]  # a duplicate point
    z1.requires_grad_(True)
    z2 = z1 if same else (torch.randn(2, 30, 3, generator=g, dtype=torch.float64) + 5.0).requires_grad_(True)
    params = {**params, "bandwidth": torch.tensor([1.3, 0.6], dtype=torch.float64)}
    L = torch.randn(2, 40, 4, generator=g, dtype=torch.float64)
    R = torch.randn(2, z2.shape[1], 4, generator=g, dtype=torch.float64)
    op = _operator(desc, z1, z2, **params)
    closed = op._closed_form_derivative(L, R)
    want = op._autograd_derivative(L, R)
    assert closed is not None and len(closed) == len(want)
    for a, b in zip(closed, want):
        assert (a is None) == (b is None)
        assert a is None or torch.allclose(a, b, rtol=1e-9, atol=1e-11)
    if same:  # 2-D: one tensor in both slots (GPyTorch's training covariance), its gradient in the first
        z = z1[0].detach().requires_grad_(True)
        op2 = _operator(desc, z, z, **{k: v[0] for k, v in params.items()})
        closed, want = op2._closed_form_derivative(L[0], R[0]), op2._autograd_derivative(L[0], R[0])
        assert closed[1] is None and want[1] is None
        assert torch.allclose(closed[0], want[0], rtol=1e-9, atol=1e-11)
    # a hyper-parameter that needs its gradient keeps the generic path
    params_grad = {**params, "bandwidth": params["bandwidth"].clone().requires_grad_(True)}
    assert _operator(desc, z1, z2, **params_grad)._closed_form_derivative(L, R) is None


def test_stored_matrix_shared_and_indexed():
    """Operators of the same tensors form the CPU matrix once; the preconditioner's entries come from it (equal
    to the generic path's entries computed pair by pair)."""
    import kermac_like as km

    g = torch.Generator().manual_seed(5)
    z = torch.randn(60, 3, generator=g, dtype=torch.float64)
    bw = torch.ones((), dtype=torch.float64)
    a, b = _operator(km.matern(2.5), z, z, bandwidth=bw), _operator(km.matern(2.5), z, z, bandwidth=bw)
    assert a._stored() is b._stored()
    assert _operator(km.matern(1.5), z, z, bandwidth=bw)._stored() is not a._stored()
    rows, cols = torch.randint(0, 60, (25,), generator=g), torch.randint(0, 60, (25,), generator=g)
    got = a._get_indices(rows, cols)
    want = super(kg.KermacFormulaLinearOperator, a)._get_indices(rows, cols)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    z.add_(1.0)  # changed in place: formed again
    assert a._stored() is not b._stored() or a._stored()[0, 1] == a._stored()[0, 1]
    assert torch.allclose(a._stored(), km.run_kernel(km.matern(2.5), z, z, bandwidth=bw), rtol=1e-12)
