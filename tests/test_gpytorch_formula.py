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
