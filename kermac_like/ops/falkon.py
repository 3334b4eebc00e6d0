"""Falkon's products on tensor cores (plan.falkon, cuda_templates/falkon_mma.cuh) for the solvers and the
GPyTorch operator: each function checks its arguments, then builds plan.falkon's FalkonProducts, or
returns None where the kernels do not serve the call (the caller keeps kernel_matvec).

* :func:`centre_products`: KernelRidge(solver="nystrom")'s K(x, z) v and K(z, x) w against a fit's centres;
* :func:`rows_pv_products`: K(x1, x2) V for several columns (GPyTorch's CG products), x2 prepared once.
"""

from __future__ import annotations

import torch

from ..plan import falkon as plan_falkon
from ..plan.core import _gpu_ok
from ..runtime.specs.falkon import MAX_K

__all__ = ["centre_products", "rows_pv_serves", "rows_pv_products"]


def centre_products(desc, hypers: dict, z: torch.Tensor, *, debug: bool = False):
    """The products against the centres z (M, K) of a fit of the kernel ``desc`` at ``hypers``
    (``rows(x, v)``: K(x, z) v, ``cols(x, w)``: K(z, x) w), or None (plan.falkon.serves)."""
    if not plan_falkon.serves(desc, hypers, z):
        return None
    return plan_falkon.FalkonProducts(z, hypers["bandwidth"], debug=debug)


def rows_pv_serves(x1: torch.Tensor, x2: torch.Tensor, rhs: torch.Tensor) -> bool:
    """Whether :func:`rows_pv_products` serves k(x1, x2) rhs: x1 (M, D), x2 (N, D) and rhs (N, C) float32 on
    one CUDA device of sm_80 or newer, 1 <= D <= 32, 0 < N < 2^31 - 256."""
    return (x1.dtype == x2.dtype == rhs.dtype == torch.float32 and 1 <= x1.shape[1] <= MAX_K
            and rhs.shape[0] == x2.shape[0] and x1.device == x2.device == rhs.device and _gpu_ok(x1)
            and 0 < x2.shape[0] < 2 ** 31 - 256)


def rows_pv_products(x2: torch.Tensor):
    """The Gaussian kernel's products of bandwidth 1 against x2 (N, D), prepared once for the calls
    ``rows_pv(x1, rhs)`` that :func:`rows_pv_serves` admits."""
    return plan_falkon.FalkonProducts(x2, 1.0, columns="pv")
