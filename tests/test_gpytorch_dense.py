"""The GPyTorch operators' CPU products on their kernel matrix formed once (KERMAC_LIKE_GP_DENSE, _operator.py
and _formula.py _dense_kernel): the same products as kernel_matvec's blocks, bit for bit, where those are one
block; the RBF and Laplace training backward from the stored matrix against a float64 oracle on centred and
offset data; training steps with and without it (the formula kernels too); the budget and in-place changes."""

import pytest
import torch

pytest.importorskip("gpytorch")
pytest.importorskip("linear_operator")

import gpytorch  # noqa: E402

from kermac_like import config  # noqa: E402
from kermac_like.gpytorch import KermacKernelLinearOperator, RBFKernel, ScaledExactGP  # noqa: E402
from kermac_like.testing import gp_operator as _operator  # noqa: E402


@pytest.mark.parametrize("kernel", ["rbf", "laplace"])
@pytest.mark.parametrize("centred", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products_are_kernel_matvecs_bit_for_bit(kernel, centred, dtype):
    g = torch.Generator().manual_seed(0)
    x1 = (torch.randn(300, 5, generator=g) + (0.0 if centred else 40.0)).to(dtype)
    x2 = (torch.randn(200, 5, generator=g) + (0.0 if centred else 40.0)).to(dtype)
    rhs = torch.randn(200, 7, generator=g, dtype=dtype)
    kw = {"centred": True} if centred else {}
    s = torch.tensor(1.3, dtype=dtype)
    with torch.no_grad():
        with config.override(gp_dense=True):
            op = KermacKernelLinearOperator(x1, x2, kernel=kernel, outputscale=s, **kw)
            got = op._matmul(rhs)
            assert op._dense_kernel() is not None
            again = op._matmul(rhs[:, 0])  # a vector, from the same stored matrix
        with config.override(gp_dense=False):
            op = KermacKernelLinearOperator(x1, x2, kernel=kernel, outputscale=s, **kw)
            assert op._dense_kernel() is None
            want = op._matmul(rhs)
            want_vec = op._matmul(rhs[:, 0])
    assert torch.equal(got, want)
    assert torch.equal(again, want_vec)


@pytest.mark.parametrize("kernel", ["rbf", "laplace"])
@pytest.mark.parametrize("offset,centred", [(0.0, True), (0.0, False), (1000.0, False), (3.0, True)])
def test_backward_from_the_stored_matrix_against_float64(kernel, offset, centred):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(600, 8, generator=g) * 1.5 + offset
    if centred:
        x0 = x0 - x0.mean(0)
    x0[7] = x0[3]  # a duplicate point: distance 0, zero gradient there
    u, v = torch.randn(600, 11, generator=g), torch.randn(600, 11, generator=g)
    s = torch.tensor(1.7)
    x64 = x0.double().requires_grad_(True)
    xc = x64 - x64.mean(0).detach()
    sq = ((xc[:, None] - xc[None]) ** 2).sum(-1)
    if kernel == "rbf":
        k64 = torch.exp(-sq / 2) * s.double()
    else:  # |x_m - x_n| with gradient 0 at 0
        k64 = torch.exp(-torch.where(sq > 0, sq, 1).sqrt() * (sq > 0)) * s.double()
    gx64, = torch.autograd.grad((u.double() * (k64 @ v.double())).sum(), x64)
    errors = {}
    for dense in (True, False):
        with config.override(gp_dense=dense):
            x = x0.clone().requires_grad_(True)
            kw = {"centred": True} if centred else {}
            op = KermacKernelLinearOperator(x, x, kernel=kernel, outputscale=s, **kw)
            gx = op._bilinear_derivative(u, v)[0]
        assert gx.dtype == torch.float32
        errors[dense] = ((gx.double() - gx64).norm() / gx64.norm()).item()
    # the matrix-free contraction (direct differences): ~5e-7; the stored matrix's products in float64: as close
    assert errors[True] < 2e-6 and errors[True] < 2 * errors[False] + 1e-7, errors


def test_a_training_step_with_and_without_the_stored_matrix():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(900, 8, generator=g) * 2 - 1 + 50.0  # offset data: the kernel centres it
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(900, generator=g)
    out = {}
    for dense in (True, False):
        with config.override(gp_dense=dense):
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
            model = ScaledExactGP(x, y, likelihood, RBFKernel(ard_num_dims=8))
            model.covar_module.base_kernel.lengthscale = torch.linspace(0.3, 2.0, 8)
            mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
            model.train()
            likelihood.train()
            torch.manual_seed(0)
            loss = -mll(model(x), y)  # N = 900 > max_cholesky_size: CG and Lanczos on the operator
            loss.backward()
            out[dense] = (loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.equal(out[True][0], out[False][0])  # the forward's products are the same bits
    torch.testing.assert_close(out[True][1], out[False][1], rtol=2e-5, atol=1e-6)


def test_budget_and_in_place_changes():
    big = torch.zeros(1, 3).expand(6000, 3)  # 3.6e7 entries > DENSE_CPU_ELEMENTS: never formed
    assert 6000 * 6000 > _operator.DENSE_CPU_ELEMENTS
    with config.override(gp_dense=True):
        assert KermacKernelLinearOperator(big, big, kernel="rbf")._dense_kernel() is None
        x = torch.randn(50, 3)
        op = KermacKernelLinearOperator(x, x, kernel="rbf")
        v = torch.randn(50, 2)
        first = op._matmul(v)
        x.mul_(2.0)  # the stored matrix is keyed by the tensors' versions: formed again
        second = op._matmul(v)
    with config.override(gp_dense=False):
        want = KermacKernelLinearOperator(x, x, kernel="rbf")._matmul(v)
    assert not torch.equal(first, second)
    assert torch.equal(second, want)


@pytest.mark.parametrize("nu", [1.5, 2.5])
def test_formula_kernels_step_with_and_without_the_stored_matrix(nu):
    """The formula kernels' operator (Matern 3/2, 5/2): a training step's loss and gradients with the stored matrix
    (run_kernel, once without autograd for CG, with autograd for the backward) against kernel_matvec's blocks."""
    from kermac_like.gpytorch import MaternKernel

    g = torch.Generator().manual_seed(3)
    x = torch.rand(900, 8, generator=g) * 2 - 1 + 20.0
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(900, generator=g)
    out = {}
    for dense in (True, False):
        with config.override(gp_dense=dense):
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
            model = ScaledExactGP(x, y, likelihood, MaternKernel(nu=nu, ard_num_dims=8))
            mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
            model.train()
            likelihood.train()
            torch.manual_seed(0)
            loss = -mll(model(x), y)
            loss.backward()
            out[dense] = (loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-4, atol=1e-5)
