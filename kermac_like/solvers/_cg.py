"""Preconditioned conjugate gradients on a block of right-hand sides.

Every column of the (n, C) right-hand side runs its own CG (its own step
lengths) through the same operator applications, so C targets cost one
kernel product per iteration. The operator, the preconditioner and the inner
product are callables: a distributed solve passes ones that combine ranks
(its inner product all-reduces the local sums), the single-process solve plain
ones. Scalars stay on the device; the only host synchronisation of an iteration
is the stopping test (one (C,) residual read back).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger("kermac_like.solvers")

__all__ = ["pcg", "CGResult", "local_dots"]


@dataclass
class CGResult:
    x: torch.Tensor  # (n, C) solution
    n_iter: int
    residual: float  # the largest relative residual ||b - A x|| / ||b|| over the columns (recursive)
    residuals: torch.Tensor  # (C,) per column, float64, on the host
    converged: bool


def local_dots(pairs) -> torch.Tensor:
    """Column inner products of (u, v) pairs: a (len(pairs), C) float64 tensor."""
    return torch.stack([(u * v).sum(0, dtype=torch.float64) for u, v in pairs])


def pcg(apply_a, apply_p, b: torch.Tensor, *, tol: float, max_iter: int, dots=local_dots,
        progress=None, label: str = "cg") -> CGResult:
    """Solve A x = b (A symmetric positive definite) with preconditioner P ~ A^-1.

    ``apply_a(v)`` and ``apply_p(v)`` map (n, C) to (n, C); ``dots(pairs)`` returns the
    (len(pairs), C) float64 column inner products over all ranks. Stops when every
    column's relative residual ||r|| / ||b|| is at most ``tol`` or after ``max_iter``
    iterations. ``progress(it, residual)`` is called once per iteration.
    """
    x = torch.zeros_like(b)
    bb = dots([(b, b)])[0]
    bnorm = bb.sqrt()
    scale = torch.where(bnorm > 0, 1.0 / bnorm, torch.zeros_like(bnorm))  # zero columns: converged at x = 0
    r = b.clone()
    z = apply_p(r)
    p = z.clone()
    rz = dots([(r, z)])[0]
    res = torch.ones_like(bnorm) * (bnorm > 0)
    worst = float(res.max()) if res.numel() else 0.0
    it = 0
    while worst > tol and it < max_iter:
        it += 1
        ap = apply_a(p)
        pap = dots([(p, ap)])[0]
        step = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1.0), torch.zeros_like(pap))
        step_c = step.to(x.dtype)
        x.add_(p * step_c)
        r.sub_(ap * step_c)
        z_old = z
        z = apply_p(r)
        both = dots([(r, z), (r, r), (r, z_old)])
        rz_new, rr, rz_cross = both[0], both[1], both[2]
        res = rr.clamp_min(0).sqrt() * scale
        worst = float(res.max())  # the one host synchronisation of the iteration
        if progress is not None:
            progress(it, worst)
        log.info("%s iteration %d: relative residual %.3e", label, it, worst)
        if not math.isfinite(worst):
            break
        # Polak-Ribiere (flexible) step: equal to Fletcher-Reeves in exact arithmetic, robust
        # to a preconditioner applied with rounding.
        beta = torch.where(rz > 0, (rz_new - rz_cross) / torch.where(rz > 0, rz, 1.0), torch.zeros_like(rz))
        p = z + p * beta.to(p.dtype)
        rz = rz_new
    return CGResult(x, it, worst, res.cpu(), worst <= tol)
