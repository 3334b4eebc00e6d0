"""The operator's CG / Lanczos products on tensor cores: ``K(x1, x2) V`` for the RBF kernel with several
columns (GPyTorch's 1 + num_trace_samples probe columns) through plan.falkon's several-column rows kernel
(cuda_templates/falkon_mma.cuh ``falkon_rows_pv_kernel``: the exponents' dot products in 3xTF32 on
mma.m16n8k8, the products k v on mma.m16n8k16 with k and v split in two f16 parts each, float32 partial
sums added in float64).

Against kernel_matvec's SIMT kernel at C = 11 it takes the 8 FFMA of the exponent and the 11 FFMA of the
columns off the FMA pipe (bench/notes/gpytorch.md, "The CG products on tensor cores"), and its host path is
two launches a product (v's fragments, the product) with x2's side prepared once per operator.

Served (else the caller keeps kernel_matvec): ``KERMAC_LIKE_GP_TC`` not "0"; the RBF kernel; float32 x1, x2
(M, D), (N, D) on one CUDA device of sm_80 or newer with 1 <= D <= 32 and no batch modes; a float32
right-hand side (N, C) or (N,) with C >= MIN_COLUMNS; no autograd (CG and Lanczos run inside
linear_operator's Functions; the bilinear derivative keeps kernel_matvec's autograd). The data must be
finite (the expanded form, as GPyTorch's own ``sq_dist``: an infinite coordinate gives NaN, not 0).

The expanded form's error grows with the operands' squared distance from its centre, which the kernels take
as x2's mean (plan.falkon.FalkonProducts: subtracted from x1's and x2's rows as they are loaded): the
products are translation invariant, with no shifted copy of x1 or x2 per product.
"""

from __future__ import annotations

import torch

from ..ops.falkon import rows_pv_products, rows_pv_serves
from . import _switches

__all__ = ["matmul", "MIN_COLUMNS"]

# Fewer columns stay on kernel_matvec: its one-column SIMT loop pays no padding to 8 columns.
MIN_COLUMNS = 2


def _serves(kernel: str, x1: torch.Tensor, x2: torch.Tensor, rhs: torch.Tensor) -> bool:
    if not (_switches.on("TC") and kernel == "rbf" and x1.dim() == 2 and x2.dim() == 2 and rhs.dim() in (1, 2)):
        return False
    return (rhs.shape[1] if rhs.dim() == 2 else 1) >= MIN_COLUMNS and rows_pv_serves(x1, x2, rhs)


def matmul(op, x1: torch.Tensor, x2: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor | None:
    """``k(x1, x2) @ rhs`` (float32, the shape of kernel_matvec's result) on tensor cores where served, else
    None. The caller (the operator's ``_matmul``) calls it only outside autograd. x2's prepared side is kept on
    ``op`` for its later products (keyed by x2's storage and version)."""
    if not _serves(op.kernel, x1, x2, rhs):
        return None
    key = (x2.data_ptr(), x2._version, tuple(x2.shape), tuple(x2.stride()))
    cached = op.__dict__.get("_kl_tc_products")
    if cached is None or cached[0] != key:
        cached = (key, rows_pv_products(x2.detach()))
        op.__dict__["_kl_tc_products"] = cached
    v = rhs.unsqueeze(-1) if rhs.dim() == 1 else rhs
    out = cached[1].rows_pv(x1.detach(), v.detach()).to(torch.float32)
    return out.squeeze(-1) if rhs.dim() == 1 else out
