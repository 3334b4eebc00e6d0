"""Autograd for :func:`run_kernel` and :func:`cdist` (w.r.t. the two data inputs): the
backward registered for the op ``kermac_like::run_kernel`` (:func:`setup_context`,
:func:`backward`), traceable by torch.compile (it calls only torch ops and ours).

For a DIFF descriptor with inner power |t|^q, outer power D and epilogue E::

    y[m,n] = E(D(acc[m,n])),  acc[m,n] = sum_k |a[m,k] - b[n,k]|^q
    dL/da[m,k] =  sum_n W[m,n] sgn(a[m,k]-b[n,k]) |a[m,k]-b[n,k]|^(q-1)
    dL/db[n,k] =  sum_m W[m,n] sgn(b[n,k]-a[m,k]) |b[n,k]-a[m,k]|^(q-1)
    W = G * E'(d) * D'(acc) * q

Both sums are :func:`cdist_grad` contractions with O = 1 (so the GPU runs
our kernel, the CPU the reference).  Where d == 0 (or d < epsilon) the
weight is 0, matching torch.cdist's backward.  DOT descriptors are matrix
products: their gradients are ``G @ b`` and ``G^T @ a``.  Gradients with
respect to hyper-parameters are not supported (NotImplementedError), nor is
double backward.
"""

from __future__ import annotations

import torch

from ..descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType
from ..calls import DistanceCall
from ..plan import run_distance
from ._library import descriptor_from_ints, descriptor_ints, direct_call, join_hypers, split_hyper
from .grad import cdist_grad

__all__ = ["setup_context", "backward"]


def _flat(t: torch.Tensor, batch: tuple, tail: tuple) -> torch.Tensor:
    """Expand to the full batch and flatten it into one leading mode."""
    return t.expand(*batch, *tail).reshape(-1, *tail)


def _hyper(x, ndim_tail: int):
    if isinstance(x, torch.Tensor):
        return x.reshape(*x.shape, *([1] * ndim_tail))
    return x


# -- the registered backward of kermac_like::run_kernel --------------------------------------
# The op's inputs, in schema order (ops/distance.py):
#   a, b, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
#   bandwidth_tensor, regularization, regularization_tensor, reg_diag, epsilon,
#   compute_mode, debug
_N_INPUTS = 15


def setup_context(ctx, inputs, output):
    (a, b, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon, compute_mode, debug) = inputs
    ctx.save_for_backward(a, b, output, ipt, opt, bwt, rgt)
    ctx.args = (tuple(descriptor), ip, op, bw, rg, reg_diag, epsilon, compute_mode, debug)


def backward(ctx, grad):
    if torch.is_grad_enabled():
        raise NotImplementedError("kermac_like: double backward through run_kernel/cdist is not supported")
    a, b, y, ipt, opt, bwt, rgt = ctx.saved_tensors
    descriptor, ip, op, bw, rg, reg_diag, epsilon, compute_mode, debug = ctx.args
    call = DistanceCall.of(descriptor_from_ints(descriptor), a, b, join_hypers(ip, ipt, op, opt, bw, bwt, rg, rgt),
                           reg_diag, epsilon)
    ga, gb = _distance_backward(call, a, b, y, grad, ctx.needs_input_grad[:2], compute_mode, debug)
    return (ga, gb) + (None,) * (_N_INPUTS - 2)


def _distances(call, compute_mode: str, debug: bool) -> torch.Tensor:
    """d of ``call`` (its descriptor without epilogue, regularisation and epsilon), through
    the op ``kermac_like::run_kernel`` so that a traced backward records it; eagerly, where
    direct_call allows it, what the op's implementation runs (ops/distance.py: the plan of the
    call, run_distance)."""
    desc = call.desc
    plain = KernelDescriptor(desc.inner_operator, desc.inner_power, desc.outer_power, KernelType.NONE)
    hp = call.hypers
    ip, op = split_hyper(hp["inner_p"]), split_hyper(hp["outer_p"])
    if direct_call(call.a, call.b, ip[1], op[1]):
        hypers = dict(inner_p=hp["inner_p"], outer_p=hp["outer_p"], bandwidth=None, regularization=None)
        return run_distance(DistanceCall.of(plain, call.a, call.b, hypers, call.reg_diag, None), None, compute_mode,
                            debug)
    return torch.ops.kermac_like.run_kernel.default(call.a, call.b, descriptor_ints(plain), *ip, *op, None, None, None,
                                                    None, call.reg_diag, None, compute_mode, debug)


def _distance_backward(call, a, b, y, grad, needs, compute_mode, debug):
    desc: KernelDescriptor = call.desc
    batch, M, N, K = call.batch, call.M, call.N, call.K
    if desc.inner_operator is InnerOperator.DOT:
        ga = (grad @ b).sum_to_size(a.shape) if needs[0] else None
        gb = (grad.mT @ a).sum_to_size(b.shape) if needs[1] else None
        return ga, gb

    hp = call.hypers
    # d: the distance before epsilon, epilogue and regularisation.
    if desc.kernel_type is KernelType.NONE and hp["regularization"] is None and call.epsilon is None:
        d = y
    else:
        d = _distances(call, compute_mode, debug)

    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    w = grad
    bw = _hyper(hp["bandwidth"], 2)
    if desc.kernel_type is KernelType.LAPLACE:
        w = w * (-torch.exp(-d / bw) / bw)
    elif desc.kernel_type is KernelType.GAUSSIAN:
        w = w * (-(d / (bw * bw)) * torch.exp(-(d * d) / (2.0 * bw * bw)))
    q = {PowerType.ABS: 1.0, PowerType.SQUARE: 2.0}.get(desc.inner_power, hp["inner_p"])
    qb = _hyper(q, 2)
    # d == 0 has weight 0 (torch.cdist's backward); a NaN d keeps its NaN weight, so
    # that NaN inputs give NaN gradients where torch.cdist's backward has them.
    if desc.outer_power is PowerType.NOOP:
        w = w * qb
    elif desc.outer_power is PowerType.SQRT:
        w = torch.where(d == 0, zero, w * qb / (2.0 * d))
    else:
        r = _hyper(hp["outer_p"], 2)
        w = torch.where(d == 0, zero, w * (qb / r) * d.pow(1.0 - r))
    if call.epsilon is not None:
        w = torch.where(d < call.epsilon, zero, w)

    # One leading batch mode for the contraction; broadcast inputs are summed back.
    wf = _flat(w, batch, (M, N))
    af = _flat(a, batch, (M, K))
    bf = _flat(b, batch, (N, K))
    qf = q
    if isinstance(q, torch.Tensor):
        qf = q.expand(batch).reshape(-1)
    ga = gb = None
    if needs[0]:
        ones = torch.ones((1, 1, N), dtype=a.dtype, device=a.device)
        g = cdist_grad(wf.mT, bf.mT, ones, af.mT, p=qf, debug=debug)  # (L, 1, K, M)
        ga = g[:, 0].mT.reshape(*batch, M, K).sum_to_size(a.shape)
    if needs[1]:
        ones = torch.ones((1, 1, M), dtype=a.dtype, device=a.device)
        g = cdist_grad(wf, af.mT, ones, bf.mT, p=qf, debug=debug)  # (L, 1, K, N)
        gb = g[:, 0].mT.reshape(*batch, N, K).sum_to_size(b.shape)
    return ga, gb
