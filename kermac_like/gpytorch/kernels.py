"""Drop-in GPyTorch kernels whose covariance never stores the N x N matrix.

:class:`RBFKernel`, :class:`MaternKernel` (nu = 1/2, 3/2, 5/2), :class:`RQKernel` and
:class:`PeriodicKernel` subclass GPyTorch's kernels of those names: the same lengthscale parameter, priors,
constraints, ``ard_num_dims``, ``batch_shape`` and ``active_dims``, usable inside
``ScaleKernel`` and any model that takes GPyTorch's. Only ``forward`` differs: above
``gpytorch.settings.max_cholesky_size`` it returns a :class:`KermacKernelLinearOperator`
(products through kermac_like.kernel_matvec, memory O(N D)); at or below it, and for the
diagonal, GPyTorch's own dense computation (the Cholesky path takes the dense matrix anyway).
Matérn 3/2 and 5/2, RQ and periodic are the formula kernels of kermac_like/formula.py, whose
covariance is a :class:`KermacFormulaLinearOperator` (kernel_matvec's torch path in blocks on any
device, until the fused templates learn them).

Both centre the inputs once per forward on x1's mean (per batch entry), as GPyTorch's own
``sq_dist`` does: the kernels are translation invariant, and the products that form distances by
the product formula (kernel_matvec's tensor-core and matrix-product paths) lose eps times the
squared distance of the data from the origin, which on data far from it (shifted coordinates,
all-positive features) exceeds the distances themselves. The operator is told so (``centred=True``),
so that no CG or Lanczos product shifts them again.
"""

from __future__ import annotations

import gpytorch
import torch

from ..formula import matern, periodic, rational_quadratic
from ._formula import KermacFormulaLinearOperator
from ._operator import KermacKernelLinearOperator

__all__ = ["RBFKernel", "MaternKernel", "RQKernel", "PeriodicKernel"]

_MATERN = {1.5: matern(1.5), 2.5: matern(2.5)}
_RQ = rational_quadratic()
_PERIODIC = periodic(1.0)


def _lazy(x1: torch.Tensor, x2: torch.Tensor, diag: bool, params: dict) -> bool:
    """Whether forward returns the matrix-free operator rather than GPyTorch's dense result."""
    if diag or params.get("last_dim_is_batch", False):
        return False
    limit = gpytorch.settings.max_cholesky_size.value()
    return max(x1.shape[-2], x2.shape[-2]) > limit


def _scaled(x1: torch.Tensor, x2: torch.Tensor, lengthscale: torch.Tensor) -> tuple:
    """(x1 - m) / l and (x2 - m) / l with m x1's mean, detached (GPyTorch's centring: the float32 distances lose
    less; the kernel depends on differences only, so m's gradient is 0); one tensor for both sides of a training
    covariance (its backward is then one contraction pass, KermacKernelLinearOperator._bilinear_derivative)."""
    mean = x1.detach().mean(dim=-2, keepdim=True)
    z1 = (x1 - mean).div(lengthscale)
    return z1, z1 if x2 is x1 else (x2 - mean).div(lengthscale)


class RBFKernel(gpytorch.kernels.RBFKernel):
    """``k(x1, x2) = exp(-|x1 - x2|^2 / (2 l^2))`` (per-dimension l with ``ard_num_dims``), a drop-in
    for :class:`gpytorch.kernels.RBFKernel` with matrix-free products (see the module docstring).

    >>> import torch, gpytorch
    >>> from kermac_like.gpytorch import RBFKernel
    >>> x = torch.tensor([[0.0], [1.0], [2.0]])
    >>> k = RBFKernel()
    >>> k.lengthscale = 1.0
    >>> with gpytorch.settings.max_cholesky_size(0), torch.no_grad():   # matrix-free at any N
    ...     K = k(x).evaluate_kernel()
    ...     print(type(K).__name__)
    ...     print(K @ torch.tensor([[1.0], [0.0], [-1.0]]))
    KermacKernelLinearOperator
    tensor([[ 0.8647],
            [ 0.0000],
            [-0.8647]])
    """

    def forward(self, x1, x2, diag=False, **params):
        if not _lazy(x1, x2, diag, params):
            return super().forward(x1, x2, diag=diag, **params)
        z1, z2 = _scaled(x1, x2, self.lengthscale)
        return KermacKernelLinearOperator(z1, z2, kernel="rbf", centred=True)


class MaternKernel(gpytorch.kernels.MaternKernel):
    """:class:`gpytorch.kernels.MaternKernel` (``nu`` = 0.5, 1.5 or 2.5) with matrix-free products: nu = 1/2
    ``exp(-d)`` (the Laplace kernel's fused products), nu = 3/2 ``(1 + sqrt(3) d) exp(-sqrt(3) d)``, nu = 5/2
    ``(1 + sqrt(5) d + 5 d^2 / 3) exp(-sqrt(5) d)`` (kermac_like.matern) of ``d = |x1 - x2| / l``.

    >>> import torch, gpytorch
    >>> from kermac_like.gpytorch import MaternKernel
    >>> k = MaternKernel()
    >>> k.lengthscale = 2.0
    >>> with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
    ...     print(k(torch.tensor([[0.0], [1.0], [2.0]])).to_dense())
    tensor([[1.0000, 0.6065, 0.3679],
            [0.6065, 1.0000, 0.6065],
            [0.3679, 0.6065, 1.0000]])
    """

    def __init__(self, nu: float = 0.5, **kwargs):
        if nu not in (0.5, 1.5, 2.5):
            raise ValueError(f"nu: expected 0.5, 1.5 or 2.5, got {nu!r}")
        super().__init__(nu=nu, **kwargs)

    def forward(self, x1, x2, diag=False, **params):
        if not _lazy(x1, x2, diag, params):
            return super().forward(x1, x2, diag=diag, **params)
        z1, z2 = _scaled(x1, x2, self.lengthscale)
        if self.nu != 0.5:
            return KermacFormulaLinearOperator(z1, z2, descriptor=_MATERN[self.nu],
                                               bandwidth=z1.new_ones(self.batch_shape))
        return KermacKernelLinearOperator(z1, z2, kernel="laplace", centred=True)


class RQKernel(gpytorch.kernels.RQKernel):
    """:class:`gpytorch.kernels.RQKernel`, ``(1 + |x1 - x2|^2 / (2 alpha l^2))^-alpha``, with matrix-free
    products (kermac_like.rational_quadratic; alpha's gradient through kernel_matvec's backward).

    >>> import torch, gpytorch
    >>> from kermac_like.gpytorch import RQKernel
    >>> k = RQKernel()
    >>> k.lengthscale, k.alpha = 1.0, 0.5
    >>> with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
    ...     print(k(torch.tensor([[0.0], [2.0]])).to_dense())
    tensor([[1.0000, 0.4472],
            [0.4472, 1.0000]])
    """

    def forward(self, x1, x2, diag=False, **params):
        if not _lazy(x1, x2, diag, params):
            return super().forward(x1, x2, diag=diag, **params)
        z1, z2 = _scaled(x1, x2, self.lengthscale)
        return KermacFormulaLinearOperator(z1, z2, descriptor=_RQ, alpha=self.alpha.reshape(self.batch_shape),
                                           bandwidth=z1.new_ones(self.batch_shape))


class PeriodicKernel(gpytorch.kernels.PeriodicKernel):
    """:class:`gpytorch.kernels.PeriodicKernel`, ``exp(-2 sum_k sin^2(pi |x1_k - x2_k| / p_k) / l)``, with
    matrix-free products (kermac_like.periodic on x / p, bandwidth sqrt(l)). A per-dimension period
    (``ard_num_dims``) is folded into the inputs; a lengthscale that differs between dimensions is not a
    bandwidth of the formula: such a kernel keeps GPyTorch's dense forward.

    >>> import torch, gpytorch
    >>> from kermac_like.gpytorch import PeriodicKernel
    >>> k = PeriodicKernel()
    >>> k.lengthscale, k.period_length = 1.0, 1.0
    >>> with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
    ...     print(k(torch.tensor([[0.0], [0.5], [1.0]])).to_dense()[0])
    tensor([1.0000, 0.1353, 1.0000])
    """

    def forward(self, x1, x2, diag=False, **params):
        ls = self.lengthscale  # (*batch, 1, D or 1)
        if not _lazy(x1, x2, diag, params) or (ls.shape[-1] > 1 and x1.shape[-1] > 1):
            return super().forward(x1, x2, diag=diag, **params)
        z1 = x1.div(self.period_length)
        z2 = z1 if x2 is x1 else x2.div(self.period_length)
        return KermacFormulaLinearOperator(z1, z2, descriptor=_PERIODIC,
                                           bandwidth=ls.reshape(self.batch_shape).sqrt())
