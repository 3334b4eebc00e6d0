"""The kernel of a solver: its descriptor and hyper-parameters, and the three
products the solvers need.

* ``matrix(a, b)``: the dense block K(a, b) through :func:`kermac_like.run_kernel`
  (cholesky, the m x m landmark matrix, row blocks of K_nm).
* ``matvec(a, b, v)``: K(a, b) @ v without the matrix, through
  :class:`kermac_like.KernelOperator` (kernel_matvec). ``f32_partials``: the blocked
  float64 mode of kernel_matvec's internals (Falkon's products).
* ``gram_of_rows(a, z)``: K(a, z)^T K(a, z) (m x m), accumulated over row blocks
  of ``a`` so that no N x m matrix exists at once.

Translation invariance (kermac_like.centring): a DIFF kernel's dense blocks on the torch path's
matrix product (CPU tensors, float64 data: torch.cdist's norm expansion where a block has more
than 25 rows or columns) are computed from a and b shifted by one reference point, that of the
second operand (the centres or landmarks of the solvers' blocks, so that every row block of one
matrix shares it), whose error is then eps times the data's centred scale rather than
eps (|a|^2 + |b|^2); on a GPU run_kernel's tensor-core kernels shift their operands themselves
and the exact kernels need no shift. The products go through kernel_matvec, whose paths are
shift invariant the same way. DOT kernels are never shifted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import centring, torch_path
from ..centring import reference_point, shift_invariant
from ..descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType, preset
from ..operator import KernelOperator
from ..ops.distance import fused_device, run_kernel
from ..ops.falkon import centre_products
from ..ops.matvec import matvec_f32_partials

__all__ = ["SolverKernel", "resolve_kernel", "BLOCK_BYTES"]

# Largest dense kernel block (bytes) the Gram accumulation builds at once.
BLOCK_BYTES = 1 << 30


def resolve_kernel(kernel, bandwidth, p) -> "SolverKernel":
    """The validated kernel of an estimator: ``kernel`` a preset name or a KernelDescriptor (a formula
    kernel of kermac_like/formula.py included: its other hyper-parameters are the descriptor's
    defaults, a missing one a ValueError naming it at the first product)."""
    if isinstance(kernel, str):
        desc = preset(kernel)  # ValueError naming `name`; re-raised below with `kernel`
    elif isinstance(kernel, KernelDescriptor):
        desc = kernel
    else:
        raise TypeError(f"kernel: expected a preset name or a KernelDescriptor, got {type(kernel).__name__}")
    if desc.fused_ok and desc.inner_operator is not InnerOperator.DOT and desc.kernel_type is KernelType.NONE:
        raise ValueError(
            f"kernel: {desc!r} is a distance, not a positive definite kernel; take a LAPLACE or GAUSSIAN "
            "epilogue (e.g. 'laplace_l2', 'gaussian_l2') or 'dot'"
        )
    hypers = {}
    own_default = not desc.fused_ok and dict(desc.params).get("bandwidth") is not None
    if desc.needs_bandwidth and not (bandwidth is None and own_default):  # (else the formula's own default)
        if bandwidth is None:
            raise ValueError(f"bandwidth: the kernel {desc!r} needs a bandwidth")
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise ValueError(f"bandwidth: expected a positive number, got {bandwidth!r}")
        hypers["bandwidth"] = float(bandwidth)
    if desc.needs_inner_p or desc.needs_outer_p:
        if p is None:
            raise ValueError(f"p: the kernel {desc!r} has a POW power; pass p")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
            raise ValueError(f"p: expected a positive number, got {p!r}")
        hypers["p"] = float(p)
    return SolverKernel(desc, tuple(sorted(hypers.items())))


@dataclass(frozen=True)
class SolverKernel:
    desc: KernelDescriptor
    hyper_items: tuple

    @property
    def hypers(self) -> dict:
        return dict(self.hyper_items)

    def matrix(self, a: torch.Tensor, b: torch.Tensor, *, regularization=None, out=None,
               reference: torch.Tensor | None = None) -> torch.Tensor:
        """K(a, b) (+ regularization on the diagonal), dense. Where its path takes the torch path's
        matrix product (:meth:`shifts`), a and b are shifted by ``reference`` (default the
        reference point of b; one copy of each, one if a is b) first."""
        if self.shifts(a, b):
            a, b, _ = centring.shifted_pair(a, b, point=reference_point(b) if reference is None else reference)
        return run_kernel(self.desc, a, b, regularization=regularization, out=out, **self.hypers)

    def shifts(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether :meth:`matrix` shifts a and b: a DIFF kernel of SQUARE inner power on float32 or
        float64 data whose run_kernel call takes the torch path (CPU tensors, float64) and there
        torch.cdist's matrix product (more than 25 rows of a or b)."""
        return (shift_invariant(self.desc) and self.desc.inner_power is PowerType.SQUARE and a.shape[-1] > 0
                and a.dtype in (torch.float32, torch.float64) and (a.dtype == torch.float64 or not fused_device(a))
                and torch_path.uses_mm(torch_path.DEFAULT_MODE, a.shape[-2], b.shape[-2]))

    def matvec(self, a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, out=None, *,
               f32_partials: bool = False) -> torch.Tensor:
        """K(a, b) @ v for v (n_b, C): (n_a, C), in v's dtype promoted with a's. ``out`` (n_a, C) is
        written in place; a float64 ``out`` of float32 data receives the float64 sums unrounded
        (kernel_matvec's float64 out). ``f32_partials`` with a float64 v of float32/16-bit data:
        kernel_matvec's blocked float64 mode (no autograd: the solvers' products take none)."""
        if f32_partials:
            return matvec_f32_partials(self.desc, a, b, v, out=out, **self.hypers)
        return KernelOperator(self.desc, a, b, **self.hypers).matmul(v, out=out)

    def centre_products(self, z: torch.Tensor, *, blocked: bool, debug: bool = False):
        """Falkon's two products against the centres z for one fit: an object whose ``rows(x, v)`` is
        K(x, z) v and ``cols(x, u)`` is K(z, x) u. plan.falkon's tensor-core products where they serve
        (``blocked``: the blocked float64 mode; the Gaussian kernel at D <= 32 on sm_80+), else
        :meth:`matvec` in the mode ``blocked`` names."""
        products = centre_products(self.desc, self.hypers, z, debug=debug) if blocked else None
        return _MatvecProducts(self, z, blocked) if products is None else products

    def gram_of_rows(self, a: torch.Tensor, z: torch.Tensor, acc_dtype=torch.float64) -> torch.Tensor:
        """K(a, z)^T K(a, z) (m x m, in ``acc_dtype``), over row blocks of ``a``."""
        m = z.shape[0]
        g = torch.zeros((m, m), dtype=acc_dtype, device=a.device)
        rows = max(1, BLOCK_BYTES // max(1, m * a.element_size()))
        ref = reference_point(z) if self.shifts(a, z) else None  # one reference point for every block
        for i in range(0, a.shape[0], rows):
            blk = self.matrix(a[i:i + rows], z, reference=ref)
            g += (blk.T @ blk).to(acc_dtype)
        return g


@dataclass(frozen=True)
class _MatvecProducts:
    """SolverKernel.centre_products through SolverKernel.matvec."""
    kernel: SolverKernel
    z: torch.Tensor
    blocked: bool

    def rows(self, x, v):
        return self.kernel.matvec(x, self.z, v, f32_partials=self.blocked)

    def cols(self, x, u):
        return self.kernel.matvec(self.z, x, u, f32_partials=self.blocked)
