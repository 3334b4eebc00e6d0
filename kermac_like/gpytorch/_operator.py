"""The covariance of the package's GPyTorch kernels: a linear_operator LinearOperator whose
products run through :func:`kermac_like.kernel_matvec` and never store the matrix.

``KermacKernelLinearOperator(x1, x2, kernel="rbf")`` stands for
``k(x1_m, x2_n)`` with x1, x2 already divided by the lengthscale (``(*batch, M, D)``,
``(*batch, N, D)``): ``exp(-|x1 - x2|^2 / 2)`` ("rbf") or ``exp(-|x1 - x2|)`` ("laplace",
Matern nu = 1/2). It is linear_operator's KernelLinearOperator (indexing, batch shapes,
transposes, the representation the autograd Functions rebuild it from) with

* ``_matmul``: ``kernel_matvec`` (O((M + N) C) memory). A float64 right-hand side of float32
  data takes kernel_matvec's float64 mode (float64 products and sums) where no gradient is
  asked for, as in the solves of CG and Lanczos;
* gradients: linear_operator's ``_bilinear_derivative`` differentiates ``_matmul``, i.e.
  kernel_matvec's autograd with respect to x1 and x2, and autograd carries them on to the
  lengthscale through ``x / lengthscale``;
* ``_diagonal``: O(N) from the paired rows;
* ``to_dense``: the dense matrix with GPyTorch's own distance functions (differentiable),
  only for the small blocks that linear_operator densifies (pivoted-Cholesky rows, the
  Cholesky path below ``gpytorch.settings.max_cholesky_size``).
"""

from __future__ import annotations

import math

import torch
from gpytorch.kernels.kernel import dist, sq_dist
from linear_operator.operators import KernelLinearOperator

from ..descriptor import preset
from ..ops.matvec import WIDE_OUT_INPUTS, kernel_matvec

__all__ = ["KermacKernelLinearOperator", "dense_covar", "KERNELS"]

# name -> the package's descriptor, evaluated at bandwidth 1 on x / lengthscale
KERNELS = {"rbf": preset("gaussian_l2"), "laplace": preset("laplace_l2")}


def dense_covar(x1: torch.Tensor, x2: torch.Tensor, *, kernel: str) -> torch.Tensor:
    """The dense kernel matrix (GPyTorch's formulas), for small blocks."""
    if kernel == "rbf":
        return sq_dist(x1, x2).div_(-2.0).exp_()
    return dist(x1, x2).neg_().exp_()


class KermacKernelLinearOperator(KernelLinearOperator):
    """KernelLinearOperator with the matrix-free products of the package; see the module docstring."""

    def __init__(self, x1, x2, covar_func=None, num_outputs_per_input=(1, 1), num_nonbatch_dimensions=None,
                 **params):
        covar_func = dense_covar if covar_func is None else covar_func
        kernel = params.get("kernel")
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {sorted(KERNELS)}, got {kernel!r}")
        if tuple(num_outputs_per_input) != (1, 1):
            raise ValueError(f"num_outputs_per_input: expected (1, 1), got {num_outputs_per_input!r}")
        super().__init__(x1, x2, covar_func=covar_func, num_outputs_per_input=num_outputs_per_input,
                         num_nonbatch_dimensions=num_nonbatch_dimensions, **params)

    @property
    def kernel(self) -> str:
        return self.nontensor_params["kernel"]

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        # rhs: (*batch2, N, C) or (N,) -> (..., M, C) or (..., M)
        x1, x2 = self.x1, self.x2
        grad = torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or rhs.requires_grad)
        wide = rhs.dtype == torch.float64 and x1.dtype in WIDE_OUT_INPUTS and not grad
        if not wide and rhs.dtype != x1.dtype:
            rhs = rhs.to(x1.dtype)
        return kernel_matvec(KERNELS[self.kernel], x1.contiguous(), x2.contiguous(), rhs.contiguous(), bandwidth=1.0)

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        # Entries k(x1[row], x2[col]) at index tensors, as the pivoted-Cholesky preconditioner's
        # backward asks for them (all N rows x its rank columns). The base class runs GPyTorch's
        # batched sq_dist on N x rank 1 x 1 matrices, whose padded temporaries took 4.6 GB at
        # N = 10^6, D = 8: here direct differences, summed over coordinate chunks of at most 2^24
        # values.
        a, b = self.x1[(*batch_indices, row_index)], self.x2[(*batch_indices, col_index)]
        n = math.prod(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]))
        chunk = max(1, (1 << 24) // max(1, n))
        sq = None
        for k0 in range(0, a.shape[-1], chunk):
            part = (a[..., k0:k0 + chunk] - b[..., k0:k0 + chunk]).square().sum(-1)
            sq = part if sq is None else sq + part
        return self._of_squared_distance(sq)

    def _diagonal(self) -> torch.Tensor:
        # k(x1_i, x2_i): (*batch, N)
        return self._of_squared_distance((self.x1 - self.x2).square().sum(-1))

    def _of_squared_distance(self, sq: torch.Tensor) -> torch.Tensor:
        """k from squared distances; the Laplace kernel's distance is the square root of a clamped
        square, as GPyTorch's dist forms it (gradient 0 at 0)."""
        if self.kernel == "rbf":
            return sq.div(-2.0).exp()
        return sq.clamp_min(1e-30).sqrt().neg().exp()

    def to_dense(self) -> torch.Tensor:
        return self.covar_mat
