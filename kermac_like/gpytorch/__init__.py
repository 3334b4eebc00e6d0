"""GPyTorch kernels on the package's matrix-free kernel products (needs gpytorch and
linear_operator: ``pip install "kermac_like[gpytorch]"``).

    import gpytorch
    from kermac_like.gpytorch import RBFKernel, MaternKernel

    covar_module = gpytorch.kernels.ScaleKernel(RBFKernel(ard_num_dims=8))   # in an ExactGP

:class:`RBFKernel`, :class:`MaternKernel` (nu = 1/2, 3/2, 5/2), :class:`RQKernel` and
:class:`PeriodicKernel` are drop-ins for GPyTorch's: above
``gpytorch.settings.max_cholesky_size`` their covariance is a :class:`KermacKernelLinearOperator`
whose products, diagonal and lengthscale gradients never form the N x N matrix, so GPyTorch's
CG / Lanczos training and prediction run at N where the dense kernel cannot exist.
:class:`ScaledExactGP` is the usual exact GP regression model (constant mean, ScaleKernel).
"""

try:
    import gpytorch  # noqa: F401
    import linear_operator  # noqa: F401
except ImportError as e:  # optional dependencies
    raise ImportError("kermac_like.gpytorch needs gpytorch and linear_operator: "
                      "pip install \"kermac_like[gpytorch]\"") from e

from ._formula import KermacFormulaLinearOperator
from ._operator import KermacKernelLinearOperator
from .kernels import MaternKernel, PeriodicKernel, RBFKernel, RQKernel
from .models import ScaledExactGP

__all__ = ["RBFKernel", "MaternKernel", "RQKernel", "PeriodicKernel", "KermacKernelLinearOperator",
           "KermacFormulaLinearOperator", "ScaledExactGP"]
