"""The cdist gradient contraction :func:`cdist_grad`.

    out[..., o, n, m] = sum_k c[o,k] a[k,m] sgn(d[n,m] - b[n,k]) |d[n,m] - b[n,k]|^(p-1)

with a (..., K, M), b (..., N, K), c (..., O, K), d (..., N, M), out (..., O, N, M).
In a Recursive Feature Machine, a is the kernel matrix, b the data, c the
coefficients and d the points where the gradient is taken; the backward of
cdist is the same contraction with O = 1.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import Tensor

from .. import _debug
from .._args import check_same, check_scalar_or_tensor, check_tensor
from ..centring import REFERENCE_ROWS
from ..calls import GradCall
from ..layout import Layout, analyse_output, broadcast_batch_shape
from ..plan import plan_cdist_grad
from ._library import direct_call, join_hyper, split_hyper

__all__ = ["cdist_grad"]

log_grad = logging.getLogger("kermac_like.grad")


def _check_grad_out(out, shape, dtype, device):
    """The shared output checks, plus the kernel's unit-stride last (m) mode."""
    if out is None:
        return
    view = analyse_output("out", out, shape, dtype, device)
    if view.layout is not Layout.ROW_MAJOR and out.shape[-1] > 1:
        raise ValueError(f"out: its last (m) mode must be unit-stride, got strides {tuple(out.stride())}")


def cdist_grad(a, b, c, d, *, out=None, p=2.0, debug: bool = False) -> torch.Tensor:
    """Gradient contraction of cdist (see the module docstring).

    ``p`` is a float (``p - 1`` is the power of the distance factor; p = 1 and
    p = 2 are pow-free) or a tensor over the batch modes.  Where
    ``d[n,m] == b[n,k]`` the factor is 0.  Views are accepted; an operand whose
    last mode is not unit-stride is copied.  ``out`` must have a unit-stride
    last mode; it is left untouched when an argument is rejected.

    >>> import torch, kermac_like as km
    >>> a = torch.tensor([[1.0, 2.0]])      # (K, M) = (1, 2)
    >>> b = torch.tensor([[0.0], [3.0]])    # (N, K) = (2, 1)
    >>> c = torch.tensor([[1.0]])           # (O, K) = (1, 1)
    >>> d = torch.ones(2, 2)                # (N, M)
    >>> km.cdist_grad(a, b, c, d)           # p = 2: c[o, k] a[k, m] (d[n, m] - b[n, k])
    tensor([[[ 1.,  2.],
             [-2., -4.]]])
    """
    debug = _debug.resolve(debug)
    for name, t in (("a", a), ("b", b), ("c", c), ("d", d)):
        check_tensor(name, t)
    for name, t in (("b", b), ("c", c), ("d", d)):
        check_same(name, t, "a", a)
    K, M, N = a.shape[-2], a.shape[-1], b.shape[-2]
    if b.shape[-1] != K:
        raise ValueError(f"b: expected (..., N, K) with K={K} (a is (..., K, M)), got {tuple(b.shape)}")
    if c.shape[-1] != K:
        raise ValueError(f"c: expected (..., O, K) with K={K}, got {tuple(c.shape)}")
    if tuple(d.shape[-2:]) != (N, M):
        raise ValueError(f"d: expected (..., N, M) = (..., {N}, {M}), got {tuple(d.shape)}")
    p = check_scalar_or_tensor("p", p, a.device, nonnegative=True)
    shapes = {n: tuple(t.shape[:-2]) for n, t in (("a", a), ("b", b), ("c", c), ("d", d))}
    if isinstance(p, torch.Tensor):
        shapes["p"] = tuple(p.shape)
    call = GradCall(a, b, c, d, p, broadcast_batch_shape(shapes))
    _check_grad_out(out, call.out_shape, a.dtype, a.device)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b, c, d, p)) and torch.is_grad_enabled():
        raise NotImplementedError("cdist_grad: inputs require grad; differentiating cdist_grad is not supported")

    if direct_call(a, b, c, d, out, p if isinstance(p, torch.Tensor) else None):
        return _run(call, out, debug)  # the ops' implementation, without the dispatcher
    if out is None:
        return _CDIST_GRAD(a, b, c, d, *split_hyper(p), debug)
    _CDIST_GRAD_OUT(a, b, c, d, *split_hyper(p), debug, out)
    return out


# -- the ops: kermac_like::cdist_grad and kermac_like::cdist_grad_out (no autograd) -------------
def _row_reference(b: Tensor) -> Tensor:
    """(..., N, 1): per feature n a reference value r_n for the CPU p = 2 path, the median of a
    strided sample of row n of b (at most REFERENCE_ROWS of its K points) rounded to a multiple of
    the largest power of two at most the sample's root-mean-square spread about it (0 where the
    data are centred within their spread, so that nothing is copied; unrounded where the spread is
    0). b - r and d - r are then exact for values within a factor of two of r (Sterbenz)."""
    K = b.shape[-1]
    sample = b[..., ::max(1, -(-K // REFERENCE_ROWS))].to(torch.float64)  # (..., N, k)
    ref = sample.median(-1, keepdim=True).values
    spread = (sample - ref).square_().mean(-1, keepdim=True).sqrt_()
    grid = torch.exp2(torch.floor(torch.log2(spread)))
    return torch.where(spread > 0, torch.round(ref / grid) * grid, ref).to(b.dtype)


def _cpu_p2(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """p = 2 on the CPU: sum_k c[o,k] a[k,m] (d[n,m] - b[n,k]) splits into two matrix products,
    ``d[n,m] (c a)[o,m] - ((c[o,:] * b[n,:]) a)[o n, m]``, each by torch's BLAS. The products
    cancel where d and b are far from the origin (both terms grow with the offset, their
    difference does not), so b and d are first taken about a per-feature reference point
    (:func:`_row_reference`; a common shift changes nothing but the rounding), which the
    difference does not depend on. Error: that of float sums of K terms of c a (d - b) on centred
    data, as the direct formula's."""
    r = _row_reference(b)
    if bool(r.any()):
        b, d = b - r, d - r
    O, N = c.shape[-2], b.shape[-2]
    ca = c @ a  # (..., O, M)
    cb = (c.unsqueeze(-2) * b.unsqueeze(-3)).flatten(-3, -2)  # (..., O N, K)
    out = (cb @ a).unflatten(-2, (O, N))  # (..., O, N, M)
    return out.neg_().addcmul_(d.unsqueeze(-3), ca.unsqueeze(-2))


def _cpu_p2_serves(a, p) -> bool:
    """Whether :func:`_cpu_p2` is tried: CPU float32/float64 operands, p = 2 (a number)."""
    return a.device.type == "cpu" and not isinstance(p, torch.Tensor) and p == 2 and a.dtype in (torch.float32,
                                                                                                  torch.float64)


def _run(call: GradCall, out, debug: bool) -> Tensor:
    a, b, c, d, p, _ = call
    if _cpu_p2_serves(a, p) and min(a.numel(), b.numel(), c.numel(), d.numel()) > 0:
        res = _cpu_p2(a, b, c, d)
        # A NaN or infinity in any operand reaches the result (every product of c a (d - b) meets it,
        # and 0 x inf is NaN); only a finite result is kept: else the direct formula's own NaN and
        # inf positions (one float64 sum of the result, whose overflow only costs the direct formula)
        if math.isfinite(float(res.sum(dtype=torch.float64))):
            if debug:
                log_grad.debug("cdist_grad p=2: CPU matrix products (%s)", a.dtype)
            return res if out is None else out.copy_(res)
    plan = plan_cdist_grad(call, out, debug)
    res = plan.run()
    if plan.family != "reference" and not isinstance(p, torch.Tensor) and p == 1:
        _sign_nan(res, b, d)
    return res


def _sign_nan(out, b, d):
    """p = 1: sgn(NaN) is NaN (torch.cdist's backward; the reference), but the kernels'
    sign step gives a NaN difference no weight, or -a. out[..., o, n, m] is NaN wherever
    d[n, m] - b[n, k] is NaN for some k: a NaN in d[n, m] or in row n of b, or the same
    infinity in both. Elementwise masks on the device (no host synchronisation)."""
    if b.shape[-1] == 0:
        return
    bad = d.isnan() | b.isnan().any(-1, keepdim=True)
    bad |= d.isposinf() & b.isposinf().any(-1, keepdim=True)
    bad |= d.isneginf() & b.isneginf().any(-1, keepdim=True)
    out.masked_fill_(bad.unsqueeze(-3), float("nan"))


@torch.library.custom_op("kermac_like::cdist_grad", mutates_args=())
def _cdist_grad_op(a: Tensor, b: Tensor, c: Tensor, d: Tensor, p: Optional[float], p_tensor: Optional[Tensor],
                   debug: bool) -> Tensor:
    return _run(GradCall.of(a, b, c, d, join_hyper(p, p_tensor)), None, debug)


@torch.library.custom_op("kermac_like::cdist_grad_out", mutates_args=("out",))
def _cdist_grad_out_op(a: Tensor, b: Tensor, c: Tensor, d: Tensor, p: Optional[float],
                       p_tensor: Optional[Tensor], debug: bool, out: Tensor) -> None:
    _run(GradCall.of(a, b, c, d, join_hyper(p, p_tensor)), out, debug)


@_cdist_grad_op.register_fake
def _cdist_grad_fake(a, b, c, d, p, p_tensor, debug):
    return a.new_empty(GradCall.of(a, b, c, d, join_hyper(p, p_tensor)).out_shape)


@_cdist_grad_out_op.register_fake
def _cdist_grad_out_fake(*args):
    return None


_CDIST_GRAD = torch.ops.kermac_like.cdist_grad.default
_CDIST_GRAD_OUT = torch.ops.kermac_like.cdist_grad_out.default
