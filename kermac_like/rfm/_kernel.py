"""The kernels of a Recursive Feature Machine: one family, k(u, v) = exp(-(||u - v||_p / L)^q).

=====================================  =====  ==========  ============================
name (aliases)                          p      q           L (``bandwidth`` = b)
=====================================  =====  ==========  ============================
``laplace_l2`` (``l2``, ``laplace``)    2      exponent    b
``product_laplace`` (``laplace_l1``,    exp.   exponent    b
``l1``)
``lpq``                                 norm_p exponent    b
``gaussian`` (``gaussian_l2``)          2      2           sqrt(2) b: exp(-||u-v||^2 / (2 b^2))
=====================================  =====  ==========  ============================

These are xRFM's ``l2`` / ``product_laplace`` / ``lpq`` kernels (its ``exponent`` and ``norm_p``),
plus the package's Gaussian. Valid when 0 < q <= p <= 2 (positive definite).

The kernel matrix is one :func:`kermac_like.run_kernel` call (the descriptor below carries the
powers: the inner power |d|^p, the outer power acc^(q/p), the Laplace epilogue with bandwidth
L^q), and the gradient of f(v) = sum_i c_i k(u_i, v) is

    grad_v f = sum_i c_i w(u_i, v) sgn(v - u_i) |v - u_i|^(p-1),   w = -(q / L^q) k r^(q-p)

with r = ||u_i - v||_p: cdist_grad's contraction with the weight matrix w (its ``a``) and the
power p. ``w`` is the kernel matrix times r^(q-p) (one cdist where q != p) and a scalar that
the coefficients take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType, PowerType
from ..solvers._kernel import SolverKernel

__all__ = ["RFMKernel", "resolve_rfm_kernel", "KERNEL_NAMES"]

# alias -> canonical name
KERNEL_NAMES = {
    "laplace_l2": "laplace_l2", "l2": "laplace_l2", "laplace": "laplace_l2",
    "product_laplace": "product_laplace", "laplace_l1": "product_laplace", "l1": "product_laplace",
    "lpq": "lpq",
    "gaussian": "gaussian", "gaussian_l2": "gaussian",
}

_D, _P, _L = InnerOperator.DIFF, PowerType, KernelType.LAPLACE


@dataclass(frozen=True)
class RFMKernel:
    """exp(-(||u - v||_p / (scale * bandwidth))^q).

    >>> from kermac_like.rfm import resolve_rfm_kernel
    >>> resolve_rfm_kernel("lpq", 1.5, 1.5)
    RFMKernel(name='lpq', p=1.5, q=1.5, scale=1.0)
    """

    name: str
    p: float
    q: float
    scale: float = 1.0  # L = scale * bandwidth (sqrt(2) for the Gaussian)

    def length(self, bandwidth: float) -> float:
        return self.scale * float(bandwidth)

    def solver_kernel(self, bandwidth: float) -> SolverKernel:
        """The descriptor and run_kernel hyper-parameters of k with this bandwidth."""
        p, q, L = self.p, self.q, self.length(bandwidth)
        if self.name == "gaussian":
            return SolverKernel(PRESETS["gaussian_l2"], (("bandwidth", float(bandwidth)),))
        if p == 2 and q == 1:
            return SolverKernel(PRESETS["laplace_l2"], (("bandwidth", L),))
        if p == 1 and q == 1:
            return SolverKernel(PRESETS["laplace_l1"], (("bandwidth", L),))
        if p == 2:  # (sum d^2)^(q/2) / L^q
            desc = KernelDescriptor(_D, _P.SQUARE, _P.NOOP if q == 2 else _P.POW, _L)
            hyp = (("bandwidth", L ** q),) if q == 2 else (("bandwidth", L ** q), ("outer_p", 2.0 / q))
            return SolverKernel(desc, hyp)
        if p == q:  # sum |d|^p / L^p: a product of one-dimensional kernels
            return SolverKernel(KernelDescriptor(_D, _P.POW, _P.NOOP, _L), (("bandwidth", L ** q), ("inner_p", p)))
        if q == 1:
            return SolverKernel(PRESETS["laplace_p"], (("bandwidth", L), ("p", p)))
        return SolverKernel(KernelDescriptor(_D, _P.POW, _P.POW, _L),
                            (("bandwidth", L ** q), ("inner_p", p), ("outer_p", p / q)))

    def weight_scale(self, bandwidth: float) -> float:
        """The scalar of the gradient's weight: -q / L^q."""
        return -self.q / self.length(bandwidth) ** self.q

    @property
    def weight_power(self) -> float:
        """w = (scalar) k r^(q - p): the power of the distance (0: the kernel matrix alone)."""
        return self.q - self.p


def resolve_rfm_kernel(kernel, exponent, norm_p) -> RFMKernel:
    """The validated kernel of an estimator's parameters; errors name the parameter.

    >>> from kermac_like.rfm import resolve_rfm_kernel
    >>> resolve_rfm_kernel("laplace_l2", 1.0, 2.0)
    RFMKernel(name='laplace_l2', p=2.0, q=1.0, scale=1.0)
    """
    if isinstance(kernel, KernelDescriptor):
        found = [n for n, d in PRESETS.items() if d == kernel and n in ("laplace_l2", "laplace_l1", "laplace_p",
                                                                          "gaussian_l2")]
        if not found:
            raise ValueError(f"kernel: {kernel!r} is not an RFM kernel (laplace_l2, laplace_l1, laplace_p, "
                             "gaussian_l2)")
        kernel = {"laplace_p": "lpq"}.get(found[0], found[0])
    if not isinstance(kernel, str):
        raise TypeError(f"kernel: expected a kernel name or a KernelDescriptor, got {type(kernel).__name__}")
    name = KERNEL_NAMES.get(kernel.lower())
    if name is None:
        raise ValueError(f"kernel: unknown kernel {kernel!r} (valid: {', '.join(KERNEL_NAMES)})")
    for arg, v in (("exponent", exponent), ("norm_p", norm_p)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 2:
            raise ValueError(f"{arg}: expected a number in (0, 2], got {v!r}")
    if name == "gaussian":
        return RFMKernel(name, 2.0, 2.0, math.sqrt(2.0))
    if name == "laplace_l2":
        return RFMKernel(name, 2.0, float(exponent))
    if name == "product_laplace":
        return RFMKernel(name, float(exponent), float(exponent))
    if exponent > norm_p:
        raise ValueError(f"exponent: the lpq kernel needs exponent <= norm_p (positive definite), got exponent "
                         f"{exponent!r} > norm_p {norm_p!r}")
    return RFMKernel(name, float(norm_p), float(exponent))
