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
import time
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
        progress=None, label: str = "cg", round_to: torch.dtype | None = None, verify: bool = True,
        max_restarts: int = 3, check_every: int | None = None, residual=None) -> CGResult:
    """Solve A x = b (A symmetric positive definite) with preconditioner P ~ A^-1.

    ``apply_a(v)`` and ``apply_p(v)`` map (n, C) to (n, C); ``dots(pairs)`` returns the
    (len(pairs), C) float64 column inner products over all ranks. Stops when every
    column's relative residual ||r|| / ||b|| is at most ``tol`` or after ``max_iter``
    iterations. ``progress(it, residual)`` is called once per iteration.

    ``round_to``: the dtype the products run in (float32 data with float64 vectors): the
    search direction is rounded to it before use, so that x and r move by the same vector.
    ``verify``: when the recursive residual passes ``tol``, the true residual b - A x is
    computed (one more product); if it does not pass, CG restarts from it (at most
    ``max_restarts`` times). The residual reported is then the true one.
    ``check_every``: for an operator whose rounding CG cannot outrun (the products of a
    float32 Falkon system): every ``check_every`` iterations the true residual is computed
    (one more product); at tol CG stops there (that is the verification), else r is replaced
    by it (residual replacement), and the best x so far is kept. CG stops at the best x when three checks in a row have not brought the true
    residual below 0.9 times the best before (stagnation at the data's precision) or it has grown past
    10 times the best (rounding has taken over); the ConvergenceWarning of the caller
    then reports the residual reached.
    ``residual``: ``residual(x)`` returns b - A x computed in a form of the caller's choosing
    (Falkon's takes the long sums over the training points of the training residual, see
    kernel_ridge._fit_nystrom); it replaces ``b - apply_a(x)`` wherever the true residual is
    needed (the verification at tol, the checks, max_iter).
    """
    x = torch.zeros_like(b)
    bb = dots([(b, b)])[0]
    bnorm = bb.sqrt()
    scale = torch.where(bnorm > 0, 1.0 / bnorm, torch.zeros_like(bnorm))  # zero columns: converged at x = 0

    def rounded(v):
        return v if round_to is None or round_to == v.dtype else v.to(round_to).to(v.dtype)

    def true_residual(x):
        """(b - A x, its per-column relative norms, their largest): one more product."""
        r_true = b - apply_a(rounded(x)) if residual is None else residual(rounded(x))
        rel = dots([(r_true, r_true)])[0].clamp_min(0).sqrt() * scale
        return r_true, rel, float(rel.max())

    r = b.clone()
    z = apply_p(r)
    p = rounded(z)
    rz = dots([(r, z)])[0]
    res = torch.ones_like(bnorm) * (bnorm > 0)
    worst = float(res.max()) if res.numel() else 0.0
    it = restarts = 0
    last_true = False  # worst is the true residual (not the recursive one)
    # With check_every: the best iterate by its true residual (x = 0 to begin with).
    best_x, best, best_res = (x.clone() if check_every else None), worst, res
    checks = []  # the true residuals of the checks
    t_start = t_last = time.perf_counter()
    while True:
        if worst <= tol:
            if not verify or it == 0:
                break
            r_true, res, worst = true_residual(x)
            last_true = True
            log.info("%s: true relative residual %.3e after %d iterations", label, worst, it)
            if worst <= tol or restarts >= max_restarts or it >= max_iter:
                break
            restarts += 1
            r = r_true
            z = apply_p(r)
            p = rounded(z)
            rz = dots([(r, z)])[0]
        if it >= max_iter:
            break
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
        if log.isEnabledFor(logging.DEBUG):  # the residual read above has synchronised the device
            now = time.perf_counter()
            log.debug("%s iteration %d: relative residual %.3e, %.3f s (%.2f s in all)", label, it, worst,
                      now - t_last, now - t_start)
            t_last = now
        if not math.isfinite(worst) and check_every is None:
            break
        if check_every and (it % check_every == 0 or not math.isfinite(worst)) and worst > tol:
            r_true, res_true, true = true_residual(x)
            checks.append(true)
            log.info("%s: true relative residual %.3e after %d iterations (check)", label, true, it)
            if true <= tol:  # this x is verified: the verification at tol would compute the same again
                res, worst, last_true = res_true, true, True
                break
            if true < best:
                best, best_x, best_res = true, x.clone(), res_true
            stalled = len(checks) > 3 and not min(checks[-3:]) < 0.9 * min(checks[:-3])
            if not math.isfinite(true) or true > 10 * best or stalled:
                log.info("%s: stopped at the best iterate (true relative residual %.3e): %s", label, best,
                         "stagnation" if stalled and math.isfinite(true) and true <= 10 * best else "growth")
                x, res, worst, last_true = best_x, best_res, best, True
                break
            r = r_true  # residual replacement: the recursion restarts from the truth
            z = apply_p(r)
            both = dots([(r, z), (r, z_old)])
            rz_new, rz_cross = both[0], both[1]
            res, worst = res_true, true
        # Polak-Ribiere (flexible) step: equal to Fletcher-Reeves in exact arithmetic, robust
        # to a preconditioner applied with rounding.
        beta = torch.where(rz > 0, (rz_new - rz_cross) / torch.where(rz > 0, rz, 1.0), torch.zeros_like(rz))
        p = rounded(z + p * beta.to(p.dtype))
        rz = rz_new
        last_true = False
    if verify and it > 0 and not last_true:  # stopped by max_iter: report the true residual too
        _, res, worst = true_residual(x)
        log.info("%s: true relative residual %.3e after %d iterations (max_iter)", label, worst, it)
        if check_every and best < worst:  # an earlier check was better: that x
            x, res, worst = best_x, best_res, best
    return CGResult(rounded(x), it, worst, res.cpu(), worst <= tol)
