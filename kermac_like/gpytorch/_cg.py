"""linear_operator's ``linear_cg`` without the host waits its stopping rule does not need.

GPyTorch's solves (training: 1 + num_trace_samples columns with their Lanczos tridiagonals; prediction: the
mean cache) run ``linear_operator.utils.linear_cg``. Each of its iterations reads two device values on the
host: the mean residual norm (``bool(residual_norm.mean() < tolerance)``, evaluated from iteration 10 on) and
the tridiagonal's last off-diagonal (``t_mat[k - 1, k].max() < 1e-6``, every iteration with tridiagonals).
Each read waits for the GPU, which then idles while Python launches the next iteration: ~15 ms of a 95 ms
training step at N = 5 x 10^4 on an H100 (bench/notes/gpytorch.md, "Where a step waits").

:func:`linear_cg` runs the same recurrences through the same torch operations in the same order (its
updates are linear_operator's own scripted functions), so its solves and tridiagonals are linear_operator's
bit for bit, but it reads the device only where the answer can change what runs:

* the tolerance test from the first iteration at which linear_cg may stop
  (``k >= min(10, max_iter - 1)`` and, with tridiagonals, ``k >= min(n_tridiag_iter, max_iter - 1)``);
  before it, linear_cg evaluates the test but cannot act on it;
* the tridiagonal's end (``update_tridiag``): every iteration writes its tridiagonal entries and the first
  iteration whose off-diagonal falls below 1e-6 is kept on the device; one read after the loop cuts the
  tridiagonal there, which drops exactly the entries linear_cg would not have written;
* with a zero initial guess (``initial_guess=None``) and ``zero_residual=(shape, dtype)``, the residual
  ``rhs - A 0`` is ``rhs`` without the product with zeros (one product of the ~22 of a training solve).
  linear_cg's NaN check on that product (``RuntimeError``, "NaNs encountered ...") then reads the first
  real product instead: A x holds a non-finite entry wherever A 0 holds a NaN, since NaN x 0 and inf x 0
  are NaN. The check (and the one on the residual) is read at the first read above, or after the loop.

``KERMAC_LIKE_GP_CG=0`` gives the operator linear_operator's own linear_cg.
"""

from __future__ import annotations

import warnings

import torch
from linear_operator import settings
from linear_operator.utils.deprecation import bool_compat
from linear_operator.utils.linear_cg import (
    _default_preconditioner,
    _jit_linear_cg_updates,
    _jit_linear_cg_updates_no_precond,
)
from linear_operator.utils.warnings import NumericalWarning

__all__ = ["linear_cg"]

_NAN_MESSAGE = "NaNs encountered when trying to perform matrix-vector multiplication"


def linear_cg(matmul_closure, rhs, n_tridiag=0, tolerance=None, eps=1e-10, stop_updating_after=1e-10,
              max_iter=None, max_tridiag_iter=None, initial_guess=None, preconditioner=None, zero_residual=None):
    """``linear_operator.utils.linear_cg`` (same arguments, results and errors; see the module docstring).

    ``zero_residual``: None, or ``(shape, dtype)`` of ``matmul_closure(zeros_like(rhs))`` (rhs as a matrix),
    which the caller vouches is zero where finite; with ``initial_guess=None`` that product is not run.
    """
    is_vector = rhs.ndimension() == 1
    if is_vector:
        rhs = rhs.unsqueeze(-1)
    if max_iter is None:
        max_iter = settings.max_cg_iterations.value()
    if max_tridiag_iter is None:
        max_tridiag_iter = settings.max_lanczos_quadrature_iterations.value()
    skip_zero_product = initial_guess is None and zero_residual is not None
    if initial_guess is None:
        initial_guess = torch.zeros_like(rhs)
    else:
        is_vector = initial_guess.ndimension() == 1  # linear_cg's own rule
        if is_vector:
            initial_guess = initial_guess.unsqueeze(-1)
    if tolerance is None:
        tolerance = settings.cg_tolerance.value()
    if preconditioner is None:
        preconditioner = _default_preconditioner
        precond = False
    else:
        precond = True
    if max_tridiag_iter > max_iter:
        raise RuntimeError("Getting a tridiagonalization larger than the number of CG iterations run is not possible!")
    if torch.is_tensor(matmul_closure):
        matmul_closure = matmul_closure.matmul
    elif not callable(matmul_closure):
        raise RuntimeError("matmul_closure must be a tensor, or a callable object!")

    num_rows = rhs.size(-2)
    n_iter = min(max_iter, num_rows) if settings.terminate_cg_by_size.on() else max_iter
    n_tridiag_iter = min(max_tridiag_iter, num_rows)
    eps = torch.tensor(eps, dtype=rhs.dtype, device=rhs.device)

    rhs_norm = rhs.norm(2, dim=-2, keepdim=True)
    rhs_is_zero = rhs_norm.lt(eps)
    rhs_norm = rhs_norm.masked_fill_(rhs_is_zero, 1)
    rhs = rhs.div(rhs_norm)
    initial_guess = initial_guess.div(rhs_norm)

    if skip_zero_product:
        shape, dtype = zero_residual
        residual = rhs - torch.zeros((), dtype=dtype, device=rhs.device).expand(shape)
    else:
        residual = rhs - matmul_closure(initial_guess)
    batch_shape = residual.shape[:-2]
    result = initial_guess.expand_as(residual).contiguous()

    if settings.verbose_linalg.on():
        settings.verbose_linalg.logger.debug(
            f"Running CG on a {rhs.shape} RHS for {n_iter} iterations (tol={tolerance}). Output: {result.shape}."
        )

    # linear_cg raises here (torch.equal(residual, residual)); the flags are read at the first read below
    bad = [residual.isnan().any()]
    residual_norm = residual.norm(2, dim=-2, keepdim=True)
    has_converged = torch.lt(residual_norm, stop_updating_after)

    if not n_tridiag and _checked(bad) and has_converged.all():
        n_iter = 0
    else:
        precond_residual = preconditioner(residual)
        curr_conjugate_vec = precond_residual
        residual_inner_prod = precond_residual.mul(residual).sum(-2, keepdim=True)
        mul_storage = torch.empty_like(residual)
        alpha = torch.empty(*batch_shape, 1, rhs.size(-1), dtype=residual.dtype, device=residual.device)
        beta = torch.empty_like(alpha)
        is_zero = torch.empty(*batch_shape, 1, rhs.size(-1), dtype=bool_compat, device=residual.device)

    if n_tridiag:
        t_mat = torch.zeros(n_tridiag_iter, n_tridiag_iter, *batch_shape, n_tridiag, dtype=alpha.dtype,
                            device=alpha.device)
        alpha_tridiag_is_zero = torch.empty(*batch_shape, n_tridiag, dtype=bool_compat, device=t_mat.device)
        alpha_reciprocal = torch.empty(*batch_shape, n_tridiag, dtype=t_mat.dtype, device=t_mat.device)
        prev_alpha_reciprocal = torch.empty_like(alpha_reciprocal)
        prev_beta = torch.empty_like(alpha_reciprocal)
        # the first k >= 1 whose off-diagonal max is < 1e-6 (linear_cg's update_tridiag turns off after it)
        tridiag_end = torch.full((), n_tridiag_iter, dtype=torch.int64, device=t_mat.device)
    last_loop_update = -1  # the last k whose tridiagonal entries were written

    first_stop = min(10, max_iter - 1)
    if n_tridiag:
        first_stop = max(first_stop, min(n_tridiag_iter, max_iter - 1))
    tolerance_reached = False

    for k in range(n_iter):
        mvms = matmul_closure(curr_conjugate_vec)
        if k == 0 and skip_zero_product:
            bad.append(~torch.isfinite(mvms).all())
        if precond:
            torch.mul(curr_conjugate_vec, mvms, out=mul_storage)
            torch.sum(mul_storage, -2, keepdim=True, out=alpha)
            torch.lt(alpha, eps, out=is_zero)
            alpha.masked_fill_(is_zero, 1)
            torch.div(residual_inner_prod, alpha, out=alpha)
            alpha.masked_fill_(is_zero, 0)
            alpha.masked_fill_(has_converged, 0)
            residual = torch.addcmul(residual, alpha, mvms, value=-1, out=residual)
            precond_residual = preconditioner(residual)
            _jit_linear_cg_updates(result, alpha, residual_inner_prod, eps, beta, residual, precond_residual,
                                   mul_storage, is_zero, curr_conjugate_vec)
        else:
            _jit_linear_cg_updates_no_precond(mvms, result, has_converged, alpha, residual_inner_prod, eps, beta,
                                              residual, precond_residual, mul_storage, is_zero,
                                              curr_conjugate_vec)

        torch.norm(residual, 2, dim=-2, keepdim=True, out=residual_norm)
        residual_norm.masked_fill_(rhs_is_zero, 0)
        torch.lt(residual_norm, stop_updating_after, out=has_converged)

        if k >= first_stop and _checked(bad) and bool(residual_norm.mean() < tolerance):
            tolerance_reached = True
            break

        if n_tridiag and k < n_tridiag_iter:
            alpha_tridiag = alpha.squeeze(-2).narrow(-1, 0, n_tridiag)
            beta_tridiag = beta.squeeze(-2).narrow(-1, 0, n_tridiag)
            torch.eq(alpha_tridiag, 0, out=alpha_tridiag_is_zero)
            alpha_tridiag.masked_fill_(alpha_tridiag_is_zero, 1)
            torch.reciprocal(alpha_tridiag, out=alpha_reciprocal)
            alpha_tridiag.masked_fill_(alpha_tridiag_is_zero, 0)
            if k == 0:
                t_mat[k, k].copy_(alpha_reciprocal)
            else:
                torch.addcmul(alpha_reciprocal, prev_beta, prev_alpha_reciprocal, out=t_mat[k, k])
                torch.mul(prev_beta.sqrt_(), prev_alpha_reciprocal, out=t_mat[k, k - 1])
                t_mat[k - 1, k].copy_(t_mat[k, k - 1])
                ends = (t_mat[k - 1, k].max() < 1e-6) & (tridiag_end == n_tridiag_iter)
                tridiag_end = torch.where(ends, k, tridiag_end)
            last_loop_update = k
            prev_alpha_reciprocal.copy_(alpha_reciprocal)
            prev_beta.copy_(beta_tridiag)

    _checked(bad)
    result = result.mul(rhs_norm)
    if not tolerance_reached and n_iter > 0:
        warnings.warn(
            "CG terminated in {} iterations with average residual norm {}"
            " which is larger than the tolerance of {} specified by"
            " linear_operator.settings.cg_tolerance."
            " If performance is affected, consider raising the maximum number of CG iterations by running code in"
            " a linear_operator.settings.max_cg_iterations(value) context.".format(
                k + 1, residual_norm.mean(), tolerance
            ),
            NumericalWarning,
        )
    if is_vector:
        result = result.squeeze(-1)
    if n_tridiag:
        last = 0 if last_loop_update < 0 else min(int(tridiag_end), last_loop_update)
        t_mat = t_mat[: last + 1, : last + 1]
        return result, t_mat.permute(-1, *range(2, 2 + len(batch_shape)), 0, 1).contiguous()
    return result


def _checked(bad: list) -> bool:
    """Raise linear_cg's NaN error if a pending device flag is set (one read, then the list is emptied);
    True otherwise, so that it can open an ``and`` chain."""
    if bad:
        flags = torch.stack(bad).any() if len(bad) > 1 else bad[0]
        bad.clear()
        if bool(flags):
            raise RuntimeError(_NAN_MESSAGE)
    return True
