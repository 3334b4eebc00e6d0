"""The kernel machine of one RFM iteration: (K + reg I) c = y on the transformed points.

* ``cholesky``: the regularised kernel matrix formed once (run_kernel, the ridge fused on its
  diagonal), factored in place (:func:`kermac_like.linalg.solve_cholesky`: cuSOLVER on a GPU,
  torch.linalg on a CPU; with the setting ``cholesky_3xtf32`` on, float32 on a GPU:
  :func:`kermac_like.linalg.cholesky_3xtf32_`, trailing updates on tensor cores). A float32 factorisation that breaks down is redone in float64 (the
  matrix formed again in float64); one that fails there too raises a ValueError naming ``reg``.
* ``nystrom``: Falkon through :class:`kermac_like.solvers.KernelRidge` (its Nyström centres,
  preconditioner, streamed and multi-GPU passes): the coefficients live on ``n_centers`` sampled
  rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import config, linalg
from .._args import all_finite
from ..solvers._kernel import SolverKernel
from ..solvers._nystrom import sample_indices
from ..solvers.kernel_ridge import KernelRidge

__all__ = ["KernelMachine", "solve_cholesky", "solve_nystrom"]


@dataclass
class KernelMachine:
    """f(u) = K(u, centres) coef: centres (m, D) in the transformed space, coef (m, C), and the rows of
    the training data they are (None: all of them, in order)."""

    centres: torch.Tensor
    coef: torch.Tensor
    rows: torch.Tensor | None = None


def _cholesky(kernel: SolverKernel, u: torch.Tensor, y: torch.Tensor, reg: float):
    """(c (C, n), info): cuSOLVER in place on a GPU, torch.linalg on a CPU."""
    k = kernel.matrix(u, u, regularization=reg)
    if u.is_cuda and u.dtype == torch.float32 and config.get("cholesky_3xtf32"):
        # the blocked factorisation with 3xTF32 tensor-core trailing updates (lower factor in place)
        info = linalg.cholesky_3xtf32_(k)
        c = torch.cholesky_solve(y.to(u.dtype), k).T if info == 0 else torch.full_like(y.T, float("nan"), dtype=u.dtype)
        del k
        return c, info
    if u.is_cuda:
        c, info, _ = linalg.solve_cholesky(k, y.T.to(u.dtype).contiguous(), overwrite_a=True)
    else:
        factor, info = torch.linalg.cholesky_ex(k, out=(k, torch.empty((), dtype=torch.int32)))
        c = torch.cholesky_solve(y.to(u.dtype), factor).T
    del k
    return c, int(info.item())


def solve_cholesky(kernel: SolverKernel, u: torch.Tensor, y: torch.Tensor, reg: float) -> KernelMachine:
    """(K(u, u) + reg I) c = y; c in float64 when the float32 factorisation broke down."""
    c, info = _cholesky(kernel, u, y, reg)
    ok = info == 0 and all_finite(c)
    if not ok and u.dtype != torch.float64:
        c, info = _cholesky(kernel, u.double(), y.double(), reg)
        ok = info == 0 and all_finite(c)
    if not ok:
        where = f" (Cholesky failed at column {info})" if info > 0 else ""
        raise ValueError(f"reg: the kernel matrix plus reg * I = {reg!r} * I is not positive definite in float64 "
                         f"either{where}; increase reg (duplicate rows with reg = 0 make it singular)")
    return KernelMachine(u, c.T.contiguous())


class _FalkonRidge(KernelRidge):
    """KernelRidge whose kernel is given as a SolverKernel (run_kernel hyper-parameters such as
    distinct inner_p and outer_p, which its ``kernel`` / ``p`` parameters do not express); its
    other parameters take KernelRidge's checks."""

    def __init__(self, solver_kernel: SolverKernel, **kw):
        h = solver_kernel.hypers
        super().__init__(solver_kernel.desc, bandwidth=h["bandwidth"], p=h.get("p", h.get("inner_p", h.get("outer_p"))),
                         **kw)
        self.solver_kernel = solver_kernel

    def _check_params(self):
        super()._check_params()
        return self.solver_kernel


def solve_nystrom(kernel: SolverKernel, u: torch.Tensor, y: torch.Tensor, reg: float, *, n_centers: int,
                  seed: int, tol: float, max_iter, verbose: bool, debug: bool) -> KernelMachine:
    """Falkon on ``n_centers`` rows sampled with ``seed``: KernelRidge(solver="nystrom")."""
    kr = _FalkonRidge(kernel, alpha=float(reg), solver="nystrom", n_centers=int(n_centers), tol=float(tol),
                      max_iter=max_iter, random_state=int(seed), verbose=verbose, debug=debug)
    kr.fit(u, y)
    rows = sample_indices(u.shape[0], int(n_centers), int(seed)).to(u.device)
    return KernelMachine(kr.centers_, kr.dual_coef_, rows)
