"""The covariance of the package's GPyTorch kernels for any descriptor (the formula kernels of
kermac_like/formula.py: Matérn 3/2 and 5/2, rational quadratic, periodic, user-written): a
linear_operator KernelLinearOperator whose products run through :func:`kermac_like.kernel_matvec`
and never store the matrix.

``KermacFormulaLinearOperator(z1, z2, descriptor=d, **tensor_params)`` stands for
``k(z1_m, z2_n)`` with z1, z2 the inputs already scaled by the kernel (``(*batch, M, D)``,
``(*batch, N, D)``) and the descriptor's hyper-parameters as tensors over the batch
(``(*batch)``: RQ's alpha, the periodic kernel's bandwidth) or the descriptor's defaults:

* ``_matmul``: kernel_matvec (the formula's torch path in blocks: O((M + N) C) memory);
* gradients: linear_operator's autograd of ``_matmul``, through kernel_matvec's blocked backward
  (to z1, z2 and the tensor hyper-parameters: the lengthscale, alpha and period reach them through
  the scaling and the parameters' transforms);
* ``covar_func`` (dense blocks: the Cholesky path below ``max_cholesky_size``, the diagonal,
  indexed entries): run_kernel, differentiable.

On the CPU, below _operator.DENSE_CPU_ELEMENTS entries (``KERMAC_LIKE_GP_DENSE``), the products multiply
by the kernel matrix: formed once per operator by run_kernel for the products without gradient (CG,
Lanczos), and for the training backward by run_kernel with autograd (GPyTorch's own way), where
kernel_matvec's torch path evaluates the formula for every pair at every product.
"""

from __future__ import annotations

import torch

from ..descriptor import KernelDescriptor
from ..ops.distance import run_kernel
from ..ops.matvec import kernel_matvec
from ._operator import KermacLinearOperatorBase

__all__ = ["KermacFormulaLinearOperator", "formula_covar"]


def formula_covar(x1: torch.Tensor, x2: torch.Tensor, *, descriptor: KernelDescriptor, **params) -> torch.Tensor:
    """The dense kernel matrix of a block (run_kernel; differentiable)."""
    return run_kernel(descriptor, x1, x2, **params)


class KermacFormulaLinearOperator(KermacLinearOperatorBase):
    """KernelLinearOperator of any descriptor with matrix-free products; see the module docstring.

    >>> import torch, kermac_like as km
    >>> from kermac_like.gpytorch import KermacFormulaLinearOperator
    >>> z = torch.tensor([[0.0], [1.0], [2.0]])
    >>> K = KermacFormulaLinearOperator(z, z, descriptor=km.matern(2.5), bandwidth=torch.tensor(1.0))
    >>> K @ torch.ones(3, 1)
    tensor([[1.6627],
            [2.0480],
            [1.6627]])
    """

    def __init__(self, x1, x2, covar_func=None, num_outputs_per_input=(1, 1), num_nonbatch_dimensions=None,
                 **params):
        desc = params.get("descriptor")
        if not isinstance(desc, KernelDescriptor):
            raise TypeError(f"descriptor: expected a KernelDescriptor, got {type(desc).__name__}")
        for name, v in params.items():
            if name != "descriptor" and not torch.is_tensor(v):
                raise TypeError(f"{name}: expected a tensor over the batch modes, got {type(v).__name__}")
        num_nonbatch_dimensions = {**{n: 0 for n in params if n != "descriptor"}, **(num_nonbatch_dimensions or {})}
        super().__init__(x1, x2, covar_func=formula_covar if covar_func is None else covar_func,
                         num_outputs_per_input=num_outputs_per_input,
                         num_nonbatch_dimensions=num_nonbatch_dimensions, **params)

    @property
    def descriptor(self) -> KernelDescriptor:
        return self.nontensor_params["descriptor"]

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        # rhs: (*batch2, N, C) or (N,) -> (..., M, C) or (..., M)
        if rhs.dtype != self.x1.dtype:
            rhs = rhs.to(self.x1.dtype)
        dense = self._dense_kernel(rhs)
        if dense is not None:
            return torch.matmul(dense, rhs)
        return kernel_matvec(self.descriptor, self.x1, self.x2, rhs.contiguous(), **self.tensor_params)

    def _dense_kernel(self, rhs: torch.Tensor) -> torch.Tensor | None:
        """The kernel matrix ``(*batch, M, N)`` on the CPU where it has at most DENSE_CPU_ELEMENTS entries, else
        None: with autograd (run_kernel's, a fresh matrix) where a gradient is asked for, else formed once per
        operator (again if an operand or hyper-parameter changed in place) without it."""
        if not self._dense_serves():
            return None
        x1, x2 = self.x1, self.x2
        tensors = (x1, x2, *self.tensor_params.values())
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, rhs)):
            return formula_covar(x1, x2, descriptor=self.descriptor, **self.tensor_params)
        with torch.no_grad():
            return self._kept(tensors, lambda: formula_covar(x1, x2, descriptor=self.descriptor, **self.tensor_params))

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        # LinearOperator's: autograd of sum(left * K right) through _matmul (kernel_matvec's blocked backward)
        args = tuple(self.representation())
        wanted = tuple(a for a in args if a.requires_grad)
        if not wanted:
            return tuple(None for _ in args)
        unique = []  # one tensor in both slots (a training covariance): its gradient once, in its first slot
        for a in wanted:
            if not any(a is u for u in unique):
                unique.append(a)
        with torch.autograd.enable_grad():
            loss = (left_vecs * self._matmul(right_vecs)).sum()
            grads = torch.autograd.grad(loss, unique, allow_unused=True)
        out, seen = [], []
        for a in args:
            i = next((j for j, u in enumerate(unique) if u is a), None)
            if i is None or any(a is s for s in seen):
                out.append(None)
            else:
                out.append(grads[i])
                seen.append(a)
        return tuple(out)
