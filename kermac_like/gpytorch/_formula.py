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
from ..formula import check_params
from ..formula_path import grad_factor
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
        return self._stored()

    def _stored(self) -> torch.Tensor:
        """The kernel matrix without autograd, formed once for the operators of these tensors (_kept)."""
        x1, x2 = self.x1, self.x2
        tensors = (x1, x2, *self.tensor_params.values())
        with torch.no_grad():
            return self._kept(tensors, lambda: formula_covar(x1, x2, descriptor=self.descriptor, **self.tensor_params),
                              (self.descriptor, tuple(self.tensor_params)))

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        # Entries at index tensors (the pivoted-Cholesky preconditioner's rows and their diagonal): on the CPU,
        # where no gradient is asked for, from the stored matrix (the products form it anyway) instead of one
        # run_kernel call per request on the gathered pairs
        if (self._dense_serves() and not (torch.is_grad_enabled() and any(
                t.requires_grad for t in (self.x1, self.x2, *self.tensor_params.values())))):
            dense = self._stored()
            if dense.shape[:-2] == self.batch_shape:
                return dense[(*batch_indices, row_index, col_index)]
        return super()._get_indices(row_index, col_index, *batch_indices)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        closed = self._closed_form_derivative(left_vecs, right_vecs)
        return closed if closed is not None else self._autograd_derivative(left_vecs, right_vecs)

    def _autograd_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        """LinearOperator's: autograd of sum(left * K right) through _matmul (kernel_matvec's blocked backward)."""
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

    def _closed_form_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        """The gradients of sum(left * K right) with respect to x1 and x2 on the CPU (where the products multiply by
        the stored matrix) for the kernels of the l2 distance with a closed-form derivative
        (formula_path.grad_factor: Matérn 3/2 and 5/2, RQ, Cauchy, IMQ) whose hyper-parameters need no gradient
        (GPyTorch's Matérn: the lengthscale is in the scaled inputs); None elsewhere. With W = (L R^T) o phi(D),
        phi = (1/d) dk/dd of the pairs' distances D: dx1_m = x1_m sum_n W_mn - (W x2)_m, dx2_n = x2_n sum_m W_mn -
        (W^T x1)_n, the two products and the row sums in float64 (the terms cancel where a point is far from those
        near it; the inputs are centred by the kernels). Against autograd through the formula: no autograd graph of
        the N x N elementwise steps and no cdist backward."""
        x1, x2 = self.x1, self.x2
        phi = grad_factor(self.descriptor)
        if phi is None or not self._dense_serves() or not (x1.requires_grad or x2.requires_grad):
            return None
        params = self.tensor_params
        if any(t.requires_grad for t in params.values()):
            return None
        with torch.no_grad():
            a, b = x1.detach(), x2.detach()
            d = torch.cdist(a, b)  # the distances as the formula's torch path forms them (torch.cdist, default mode)
            w = torch.matmul(left_vecs.to(a.dtype), right_vecs.to(a.dtype).mT).mul_(phi(d, check_params(self.descriptor, dict(params), a.device)))
            del d
            if x1 is x2:  # one tensor in both slots: its gradient once, in its first slot, from W + W^T
                w = w + w.mT
                w = w.to(torch.float64)
                a64 = a.to(torch.float64)
                g1, g2 = torch.matmul(w, a64).sub_(w.sum(-1, keepdim=True) * a64).neg_(), None
            else:
                w = w.to(torch.float64)
                a64, b64 = a.to(torch.float64), b.to(torch.float64)
                g1 = torch.matmul(w, b64).sub_(w.sum(-1, keepdim=True) * a64).neg_() if x1.requires_grad else None
                g2 = torch.matmul(w.mT, a64).sub_(w.sum(-2).unsqueeze(-1) * b64).neg_() if x2.requires_grad else None
        out = [None if g1 is None else g1.sum_to_size(x1.shape).to(x1.dtype),
               None if g2 is None else g2.sum_to_size(x2.shape).to(x2.dtype)]
        return tuple(out) + (None,) * (len(tuple(self.representation())) - 2)
