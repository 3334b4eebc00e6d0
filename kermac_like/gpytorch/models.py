"""A ready ExactGP for the kernels of this module."""

import gpytorch

__all__ = ["ScaledExactGP"]


class ScaledExactGP(gpytorch.models.ExactGP):
    """``gpytorch.models.ExactGP`` with a constant mean and ``ScaleKernel(kernel)``: the usual
    exact GP regression model, for kernels of this module (or GPyTorch's own, to compare).

    x ``(*batch, N, D)``, y ``(*batch, N)`` with ``batch`` the kernel's ``batch_shape`` (the mean
    and the scale take it too), likelihood e.g. ``gpytorch.likelihoods.GaussianLikelihood()``;
    training and prediction as for any ExactGP (``gpytorch.mlls.ExactMarginalLogLikelihood``).

    >>> import math, torch, gpytorch
    >>> from kermac_like.gpytorch import RBFKernel, ScaledExactGP
    >>> x = torch.linspace(0, 1, 20).unsqueeze(-1)
    >>> y = torch.sin(6 * x[:, 0])
    >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
    >>> model = ScaledExactGP(x, y, likelihood, RBFKernel())
    >>> mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> _ = model.train(), likelihood.train()
    >>> for _ in range(20):
    ...     opt.zero_grad()
    ...     loss = -mll(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    >>> _ = model.eval(), likelihood.eval()
    >>> with torch.no_grad():
    ...     mean = likelihood(model(torch.tensor([[0.25]]))).mean
    >>> abs(float(mean) - math.sin(1.5)) < 0.2
    True
    """

    def __init__(self, x, y, likelihood, kernel):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=kernel.batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel, batch_shape=kernel.batch_shape)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
