"""Kernel sums in the log domain: :func:`kernel_logsumexp`.

``out[..., m, c] = log sum_n exp(-phi(x_m, y_n) + log_weights[..., n, c])`` for a descriptor
with a LAPLACE or GAUSSIAN epilogue (its kernel is ``exp(-phi)``: ``phi = d / bandwidth`` or
``d^2 / (2 bandwidth^2)``), without the M x N matrix and without forming ``exp(-phi)`` (which
underflows to 0 in float32 for nearly every pair at small bandwidths): blocks of ``phi``
(the descriptor's distance from run_kernel's fused kernels, the epilogue dropped) are combined
with a running maximum per row and column, FlashAttention's online softmax, in a fixed order.

On sm_80 and newer GPUs the fused kernel (cuda_templates/logsumexp.cuh) computes float32/16-bit
calls with K <= 64 in one pass over y, no block in memory; the blocked computation serves the
rest; memory O((M + N) C) plus one block. Autograd with
respect to x, y and log_weights: the backward weights each block by the softmax
``exp(-phi + log_weights - out)`` and differentiates phi on it (never M x N either).
Underneath it is the custom op ``torch.ops.kermac_like.kernel_logsumexp`` (``kernel_logsumexp_out``
for ``out=``), as every family's (ops/_library.py): fake shapes for torch.compile, the backward
registered with the op; eager calls skip the dispatcher where it has nothing to do.

Error model: phi depends on x - y only (DIFF descriptors), and every path computes it so: the
fused kernel's direct form and the blocked path (run_kernel without the matrix product,
"donot_use_mm_for_euclid_dist") take direct differences, the backward too; the fused kernel's
expanded exponent (|u|^2 + |w|^2 - 2 u.w) works on u = x - c, w = y - c about a centre c of the
data, and the planner takes it only where its error bound, computed from those centred u and w,
allows (plan/logsumexp.py expand_params): data offset by 1000 x its spread take the same path
with the error of centred data. On the CPU, float32 Euclidean Gaussian / Laplace calls form the
squared distances by the matrix product as torch.cdist does, but about the data's reference point
where that lowers the operands' norms, with the pairs the product cannot resolve (near pairs; at
small bandwidths the terms that can matter) recomputed by direct differences
(:func:`_forward_cpu_product`): never less accurate than torch.logsumexp over torch.cdist in
float32 (bench/notes/cpu_paths.md), the other calls in float64 by direct differences.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch
from torch import Tensor

from .. import _debug, config, formula_path, torch_path
from .._args import check_same, check_tensor
from ..descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType, PowerType
from ..runtime.specs import epilogue
from ..centring import shifted_pair
from ..calls import DistanceCall
from ..layout import analyse_output, broadcast_shapes
from ..plan.logsumexp import plan_logsumexp
from ._library import (check_no_hyper_grad, descriptor_from_ints, descriptor_ints, direct_call, join_hypers,
                       register_autograd, split_hyper)
from .distance import COMPUTE_MODES, check_data, prepare_call, run_kernel

log = logging.getLogger("kermac_like.logsumexp")

__all__ = ["kernel_logsumexp", "BLOCK_ELEMENTS"]

BLOCK_ELEMENTS = 1 << 22  # phi values of one block, all batch entries and columns of log_weights together


def _distance_desc(desc: KernelDescriptor, epsilon) -> tuple:
    """(the descriptor whose values phi is formed from, whether they are already squared)."""
    squared = (desc.kernel_type is KernelType.GAUSSIAN and desc.outer_power is PowerType.SQRT
               and epsilon is None)  # phi = s / (2 bw^2) straight from the sum: no sqrt then square
    outer = PowerType.NOOP if squared else desc.outer_power
    return dataclasses.replace(desc, outer_power=outer, kernel_type=KernelType.NONE), squared


def _phi(desc: KernelDescriptor, d: Tensor, squared: bool, bw) -> Tensor:
    """phi of distances d (``squared``: d holds squared distances); a new tensor."""
    bw = bw.reshape(*bw.shape, 1, 1) if isinstance(bw, Tensor) else bw
    if desc.kernel_type is KernelType.LAPLACE:
        return d / bw
    return (d if squared else d * d) / (2.0 * bw * bw)


def _phi_differentiable(desc: KernelDescriptor, xb: Tensor, yb: Tensor, hyp: dict, epsilon) -> Tensor:
    """phi of every pair of the blocks by torch operations that autograd differentiates, with
    zero gradient at zero distance (as the package's cdist backward)."""
    diff = xb.unsqueeze(-2) - yb.unsqueeze(-3)  # (*batch, mb, nb, K)
    ip = hyp["inner_p"]
    if desc.inner_power is PowerType.ABS:
        s = diff.abs().sum(-1)
    elif desc.inner_power is PowerType.SQUARE:
        s = diff.square().sum(-1)
    else:
        p = ip.reshape(*ip.shape, 1, 1, 1) if isinstance(ip, Tensor) else ip
        a = diff.abs()
        s = torch.where(a > 0, torch.where(a > 0, a, 1).pow(p), 0).sum(-1)
    squared = desc.kernel_type is KernelType.GAUSSIAN and desc.outer_power is PowerType.SQRT and epsilon is None
    if not squared:
        pos = s > 0
        safe = torch.where(pos, s, 1)
        if desc.outer_power is PowerType.SQRT:
            s = torch.where(pos, safe.sqrt(), 0)
        elif desc.outer_power is PowerType.POW:
            op = hyp["outer_p"]
            op = op.reshape(*op.shape, 1, 1) if isinstance(op, Tensor) else op
            s = torch.where(pos, safe.pow(1.0 / op), 0)
        if epsilon is not None:
            s = torch.where(s < epsilon, 0, s)
    return _phi(desc, s, squared, hyp["bandwidth"])


def _blocks(batch: tuple, M: int, N: int, C: int) -> tuple:
    B = math.prod(batch) if batch else 1
    # at least 1: no rows of y (an empty sum: -inf, as torch.logsumexp) or of x loop zero times
    nb = max(1, min(N, max(256, BLOCK_ELEMENTS // max(1, B * M * C))))
    mb = max(1, min(M, max(1, BLOCK_ELEMENTS // max(1, B * nb * C))))
    return mb, nb


# The CPU float32 path recomputes by direct differences the pairs whose squared distance from the matrix product
# is below this fraction of their bound |u|^2 + max |w|^2 (u, w the operands as multiplied): the product's error
# is a few eps times that bound, which near pairs (the largest terms of the sum) would carry as a relative
# error of eps |u|^2 / |u - w|^2.
NEAR_FRACTION = 2.0 ** -10


def _cpu_product_terms(call, lw: Tensor):
    """For the CPU float32 path (:func:`_forward_cpu_product`): ``[-2 u, 1, |u|^2]``, ``[w, |w|^2, 1]`` (their
    product is ``|u - w|^2``) and each row's rescoring threshold NEAR_FRACTION (|u|^2 + max |w|^2), with (u, w)
    x and y shifted by their reference point where that divides max |u|^2 + max |w|^2 by more than 4, else as
    given (torch.cdist's operands: no rounding of a shift on data about the origin);
    None where that path does not serve the call: Euclidean (SQUARE inner power, SQRT outer) Gaussian or
    Laplace, float32 x, y and log_weights on the CPU, no batch modes, a float bandwidth, no epsilon, finite
    squared norms (a non-finite coordinate, or one whose square passes float32's range, keeps the float64
    direct differences, whose infinities give exp(-inf) = 0 where the product gives NaN)."""
    desc = call.desc
    if not (call.device.type == "cpu" and call.a.dtype == call.b.dtype == lw.dtype == torch.float32
            and desc.inner_power is PowerType.SQUARE and desc.outer_power is PowerType.SQRT
            and call.epsilon is None and not call.batch and call.a.dim() == 2 and call.b.dim() == 2
            and lw.dim() == 2 and call.M > 0 and call.N > 0 and call.K > 0
            and not isinstance(call.hypers["bandwidth"], Tensor)):
        return None
    x, y = call.a.contiguous(), call.b.contiguous()
    xn, yn = x.square().sum(-1, keepdim=True), y.square().sum(-1, keepdim=True)
    if not (bool(torch.isfinite(xn).all()) and bool(torch.isfinite(yn).all())):
        return None
    u, w, _ = shifted_pair(x, y)
    un, wn = u.square().sum(-1, keepdim=True), w.square().sum(-1, keepdim=True)
    if 4.0 * (float(un.max()) + float(wn.max())) > float(xn.max()) + float(yn.max()):
        u, w, un, wn = x, y, xn, yn  # the shift's own rounding (eps |x - s| a coordinate) would cost more
    a = torch.cat([u.mul(-2.0), torch.ones_like(un), un], -1)
    b = torch.cat([w, wn, torch.ones_like(wn)], -1)
    bound = un.add(wn.max())  # (M, 1): |u|^2 + max |w|^2
    return a, b, bound * NEAR_FRACTION, bound.mul_((2 * call.K + 8) * 2.0 ** -24), x, y


def _forward_cpu_product(call, lw: Tensor, terms) -> Tensor:
    """(M, C) float32: the CPU path of Euclidean Gaussian / Laplace calls on float32 data, torch's way in
    row blocks of all N points: the squared distances by one matrix product of the padded operands about
    the data's reference point (``terms``, :func:`_cpu_product_terms`), the pairs below their threshold
    (every negative value among them) recomputed by direct differences of x and y; ``t = -phi +
    log_weights``, at small bandwidths the terms that can matter recomputed so too; torch.logsumexp's steps
    over the points in place; blocks of points (where one row of all N passes BLOCK_ELEMENTS) combined by
    logaddexp.
    Error against float64 (bench/notes/cpu_paths.md): at most torch.logsumexp over torch.cdist's in float32
    on centred data, and so on data at any offset (torch's own loses eps (|x|^2 + |y|^2) in each squared
    distance)."""
    a, b, thr, err, x, y = terms
    M, N, C, K = call.M, call.N, lw.shape[-1], call.K
    bw = float(call.hypers["bandwidth"])
    laplace = call.desc.kernel_type is KernelType.LAPLACE
    # a quotient, as _phi's (not times a rounded reciprocal)
    den = torch.tensor(-bw if laplace else -(2.0 * bw * bw), dtype=torch.float32)
    # each row's bound on its exponents' error (the product's error err on the squared distances; for the
    # Laplace kernel's root |sqrt(a) - sqrt(b)| <= sqrt(|a - b|)), and the margin below the row's largest
    # exponent within which a term can matter: 17 (exp(-17) ~ 2^-24) + log N + twice the bound
    err = (err.sqrt() if laplace else err).div_(abs(float(den)))
    margin = err.mul(2.0).add_(17.0 + math.log(N))
    nb = max(1, min(N, BLOCK_ELEMENTS // C))
    mb = max(1, min(M, BLOCK_ELEMENTS // (nb * C)))
    pairs = max(1, BLOCK_ELEMENTS // K)  # near pairs recomputed at once
    out = torch.empty(M, C, dtype=torch.float32)
    s = torch.empty(mb * nb, dtype=torch.float32)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        res = None
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            d = torch.matmul(a[m0:m1], b[n0:n1].mT, out=s[: (m1 - m0) * (n1 - n0)].view(m1 - m0, n1 - n0))
            # (P, 2): (row, column) in the block; every negative value is among them (thr >= 0), so no clamp
            near = torch.nonzero(d < thr[m0:m1])
            for p0 in range(0, near.shape[0], pairs):
                i, j = near[p0:p0 + pairs].unbind(1)
                d[i, j] = (x[i + m0] - y[j + n0]).square_().sum(-1)
            if laplace:
                d.sqrt_()
            if C == 1:  # t = log_weights + d / denominator (addcdiv: the quotient, then the sum), in place
                t = torch.addcdiv(lw[n0:n1, 0], d, den, out=d)
            else:
                t = torch.addcdiv(lw[n0:n1], d.unsqueeze(-1), den)
            top = t.amax(-1 if C == 1 else -2, keepdim=True)
            # Rows whose exponents' error bound passes 2^-20 max(1, |largest|) (small bandwidths: phi large): the
            # terms that can matter recomputed by direct differences, so that the result's error is that of
            # float32 exponents, not of the product formula's distances (relative eps |u|^2 / |u - w|^2), where
            # they are few: at most 1/8 of the first 64 rows' terms (at moderate bandwidths every term can
            # matter; the product's typical error is then ~sqrt(K) eps |u|^2 / |phi|, as torch.cdist's)
            rows = err[m0:m1] > top.abs().clamp_min(1.0).view(m1 - m0, -1)[:, :1] * 2.0 ** -20
            lim = torch.where(rows, (top if C == 1 else top.amin(-1)).view(m1 - m0, 1) - margin[m0:m1], math.inf)
            best = t if C == 1 else t.amax(-1)  # (mb, nb)
            if bool(rows.any()) and 8 * int((best[:64] >= lim[:64]).sum()) <= best[:64].numel():
                near = torch.nonzero(best >= lim)
                for p0 in range(0, near.shape[0], pairs):
                    i, j = near[p0:p0 + pairs].unbind(1)
                    dd = (x[i + m0] - y[j + n0]).square_().sum(-1)
                    if laplace:
                        dd.sqrt_()
                    t[i, j] = torch.addcdiv(lw[j + n0] if C > 1 else lw[j + n0, 0],
                                            dd if C == 1 else dd.unsqueeze(-1), den)
                top = t.amax(-1 if C == 1 else -2, keepdim=True)
            # torch.logsumexp over the points, its temporaries written over t
            top = torch.where(torch.isfinite(top), top, 0)  # all terms -inf (or one +inf): nothing to rescale
            part = t.sub_(top).exp_().sum(-1 if C == 1 else -2, keepdim=True).log_().add_(top).view(m1 - m0, C)
            res = part if res is None else torch.logaddexp(res, part)
        out[m0:m1] = res
    return out


def _forward(call, lw: Tensor, work, debug: bool = False) -> Tensor:
    """(*batch, M, C) in ``work``: the fused kernel's (plan/logsumexp.py), the CPU float32 path
    (:func:`_forward_cpu_product`), else the blocked running (max, sum) combination."""
    if work == torch.float32 and call.device.type == "cuda":
        fused = torch.empty((*call.batch, call.M, lw.shape[-1]), dtype=call.a.dtype, device=call.device)
        plan = plan_logsumexp(call, lw.to(call.a.dtype), fused, debug)
        if plan is not None:
            return plan.run().to(work)
    if call.device.type == "cpu":
        terms = _cpu_product_terms(call, lw)
        if terms is not None:
            if debug:
                log.debug("kernel_logsumexp: CPU float32 path (the matrix product about the reference point)")
            return _forward_cpu_product(call, lw, terms).to(work)
    dd, squared = _distance_desc(call.desc, call.epsilon)
    batch, M, N = call.batch, call.M, call.N
    C = lw.shape[-1]
    mb, nb = _blocks(batch, M, N, C)
    hyp = dict(call.hypers)
    bw = hyp.pop("bandwidth")
    bw = bw.to(work) if isinstance(bw, Tensor) else bw
    x, y = call.a.to(work), call.b.to(work)
    lw = lw.to(work).expand(*batch, N, C)
    out = torch.empty((*batch, M, C), dtype=work, device=call.device)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        run_max = torch.full((*batch, m1 - m0, C), -math.inf, dtype=work, device=call.device)
        run_sum = torch.zeros_like(run_max)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            d = run_kernel(dd, x[..., m0:m1, :], y[..., n0:n1, :], epsilon=call.epsilon, compute_mode=COMPUTE_MODES[2],
                           debug=debug and m0 == n0 == 0,  # the first block's plan (the others repeat it)
                           **{k: v for k, v in hyp.items() if k != "regularization"})
            t = _phi(call.desc, d.to(work), squared, bw).neg_().unsqueeze(-1) + lw[..., None, n0:n1, :]
            del d
            run_max, run_sum = torch_path.lse_accumulate(run_max, run_sum, t)
        out[..., m0:m1, :] = torch_path.lse_result(run_max, run_sum)
    return out


def _work_dtype(x: Tensor) -> torch.dtype:
    """The dtype the sums are formed in: float64 for float64 data and on the CPU, else float32."""
    return torch.float64 if (x.dtype == torch.float64 or x.device.type == "cpu") else torch.float32


def _formula_fused(call, lw: Tensor, work, debug: bool):
    """A positive formula kernel that an epilogue functor serves (specs.epilogue.served) on the fused
    kernel with its functor (the term log2 k of the exact squared distance; plan.logsumexp), where
    the setting formula_fused is on, the GPU and data take it and nothing needs a gradient; else None
    (the formula's torch path)."""
    desc = call.desc
    if not (config.get("formula_fused") and epilogue.served(desc) and work == torch.float32
            and call.device.type == "cuda" and call.K > 0 and not call.epsilon):
        return None
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                       for t in (call.a, call.b, lw, *call.hypers.values())):
        return None
    proxy = call._replace(desc=PRESETS["squared_l2"], hypers=epilogue.slot_hypers(desc, call.hypers))
    out = torch.empty((*call.batch, call.M, lw.shape[-1]), dtype=call.a.dtype, device=call.device)
    plan = plan_logsumexp(proxy, lw.to(call.a.dtype), out, debug, functor=epilogue.functor(desc))
    return None if plan is None else plan.run().to(work)


def _backward_blocks(call, x, y, lw, out, g, needs, work):
    """(dL/dx, dL/dy, dL/dlog_weights) (None where not ``needs``) of ``out`` (the forward's result in
    ``work``) for the upstream ``g``: per block, the softmax weights ``exp(-phi + log_weights - out)``
    times phi's derivative (autograd of the block's torch formula); never M x N."""
    batch, M, N, C = call.batch, call.M, call.N, lw.shape[-1]
    mb, nb = _blocks(batch, M, N, C)
    xe, ye = x.expand(*batch, M, x.shape[-1]), y.expand(*batch, N, y.shape[-1])
    lwe = lw.expand(*batch, N, C)
    gx = torch.zeros(xe.shape, dtype=work, device=x.device) if needs[0] else None
    gy = torch.zeros(ye.shape, dtype=work, device=x.device) if needs[1] else None
    glw = torch.zeros(lwe.shape, dtype=work, device=x.device) if needs[2] else None
    hyp = {k: (v.to(work) if isinstance(v, Tensor) else v) for k, v in call.hypers.items()}
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            with torch.enable_grad():
                xb = xe[..., m0:m1, :].detach().to(work).requires_grad_(needs[0])
                yb = ye[..., n0:n1, :].detach().to(work).requires_grad_(needs[1])
                lb = lwe[..., n0:n1, :].detach().to(work).requires_grad_(needs[2])
                t = -_phi_differentiable(call.desc, xb, yb, hyp, call.epsilon).unsqueeze(-1) + lb.unsqueeze(-3)
                w = torch.exp(t.detach() - out[..., m0:m1, None, :].to(work))  # softmax weights
                s = (g[..., m0:m1, None, :].to(work) * w * t).sum()
                wanted = [v for v, n in zip((xb, yb, lb), needs) if n]
                grads = iter(torch.autograd.grad(s, wanted)) if wanted else iter(())
            if needs[0]:
                gx[..., m0:m1, :] += next(grads)
            if needs[1]:
                gy[..., n0:n1, :] += next(grads)
            if needs[2]:
                glw[..., n0:n1, :] += next(grads)
    return [None if gr is None else gr.sum_to_size(t_.shape).to(t_.dtype) for gr, t_ in zip((gx, gy, glw), (x, y, lw))]


# -- the ops: kermac_like::kernel_logsumexp and kermac_like::kernel_logsumexp_out ---------------------------
# kernel_logsumexp(x, y, log_weights (..., N, C), descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor,
# bandwidth, bandwidth_tensor, epsilon, debug) -> (..., M, C) in the work dtype (float64 for float64 data and on
# the CPU, else float32: the backward's softmax weights need the unrounded result; the wrapper rounds to x's).
_N_OP_INPUTS = 12


def _call_of(x, y, lw, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
             epsilon) -> DistanceCall:
    hypers = join_hypers(inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor, None, None)
    call = DistanceCall.of(descriptor_from_ints(descriptor), x, y, hypers, 0, epsilon)
    return call._replace(batch=broadcast_shapes(call.batch, lw.shape[:-2]))


def _lse_impl(x: Tensor, y: Tensor, log_weights: Tensor, descriptor: list[int], inner_p: Optional[float],
              inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
              bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], epsilon: Optional[float],
              debug: bool) -> Tensor:
    call = _call_of(x, y, log_weights, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                    bandwidth_tensor, epsilon)
    return _forward(call, log_weights, _work_dtype(x), debug)


_lse_op = torch.library.custom_op("kermac_like::kernel_logsumexp", _lse_impl, mutates_args=())


@torch.library.custom_op("kermac_like::kernel_logsumexp_out", mutates_args=("out",))
def _lse_out_op(x: Tensor, y: Tensor, log_weights: Tensor, descriptor: list[int], inner_p: Optional[float],
                inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
                bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], epsilon: Optional[float], debug: bool,
                out: Tensor) -> None:
    """``out`` (..., M, C), or (..., M) for one column of log_weights, in x's dtype."""
    res = _lse_impl(x, y, log_weights, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                    bandwidth_tensor, epsilon, debug)
    out.copy_(res.squeeze(-1) if out.dim() < res.dim() else res)


@_lse_op.register_fake
def _lse_fake(x, y, log_weights, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
              bandwidth_tensor, epsilon, debug):
    hypers = (inner_p_tensor, outer_p_tensor, bandwidth_tensor)
    batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2], log_weights.shape[:-2],
                                   *(t.shape for t in hypers if t is not None))
    return x.new_empty((*batch, x.shape[-2], log_weights.shape[-1]), dtype=_work_dtype(x))


@_lse_out_op.register_fake
def _lse_out_fake(*args):
    return None


def _setup_context(ctx, inputs, output):
    x, y, lw, descriptor, ip, ipt, op, opt, bw, bwt, epsilon, debug = inputs
    ctx.save_for_backward(x, y, lw, output, ipt, opt, bwt)
    ctx.args = (tuple(descriptor), ip, op, bw, epsilon)


def _backward(ctx, g):
    """dL/dx, dL/dy, dL/dlog_weights of the op (None for the other inputs); double backward raises."""
    if torch.is_grad_enabled():
        raise NotImplementedError("kermac_like: double backward through kernel_logsumexp is not supported (the "
                                  "backward is not differentiable)")
    x, y, lw, out, ipt, opt, bwt = ctx.saved_tensors
    descriptor, ip, op, bw, epsilon = ctx.args
    call = _call_of(x, y, lw, descriptor, ip, ipt, op, opt, bw, bwt, epsilon)
    grads = _backward_blocks(call, x, y, lw, out, g, ctx.needs_input_grad[:3], out.dtype)
    return (*grads,) + (None,) * (_N_OP_INPUTS - 3)


_LSE_GRAD = register_autograd(_lse_op, _lse_impl, _backward, _setup_context)
_LSE = torch.ops.kermac_like.kernel_logsumexp.default
_LSE_OUT = torch.ops.kermac_like.kernel_logsumexp_out.default


def kernel_logsumexp(descriptor: KernelDescriptor, x: Tensor, y: Tensor, log_weights=None, *, out=None, p=None,
                     inner_p=None, outer_p=None, bandwidth=None, epsilon=None, debug: bool = False, **params) -> Tensor:
    """``out[..., m, c] = log sum_n exp(-phi(x_m, y_n) + log_weights[..., n, c])``, stably.

    ``descriptor`` needs a LAPLACE or GAUSSIAN epilogue: its kernel is ``exp(-phi)`` with
    ``phi = d / bandwidth`` (Laplace) or ``d^2 / (2 bandwidth^2)`` (Gaussian) of the
    descriptor's distance d (inner norm, outer power, ``epsilon`` cut as in run_kernel).
    x ``(..., M, K)``, y ``(..., N, K)``, log_weights ``(..., N, C)`` or ``(..., N)`` (default
    0: ``out`` is the log of the kernel's row sums) -> ``(..., M, C)`` or ``(..., M)`` in x's
    dtype; batch modes and tensor hyper-parameters broadcast as in run_kernel. The result is
    finite wherever one term is, however small the kernel values (the sum is combined around
    a running maximum in blocks of at most BLOCK_ELEMENTS values, in a fixed order: the same
    inputs give the same bits), computed in float32 from float32/16-bit inputs and in float64
    from float64 inputs; on CPU tensors in float64 by direct differences, except float32
    Euclidean Gaussian / Laplace calls (2-D, a float bandwidth, no epsilon, finite data): torch's
    way in float32 (torch.logsumexp over the matrix product's squared distances in row blocks),
    about the data's reference point, near pairs by direct differences. Memory O((M + N) C) plus
    one block. Translation
    invariant: the error is that of centred data whatever the data's offset (direct
    differences, or the fused kernel's expanded exponent about the data's centre where its
    bound on centred data allows it).

    Differentiable with respect to x, y and log_weights (a softmax-weighted sum of phi's
    derivatives, blocked; zero gradient at zero distance); not with respect to the
    hyper-parameters. ``out``: written in place and returned (left untouched when an argument
    is rejected). Errors: TypeError/ValueError naming the argument.

    A formula kernel (kermac_like/formula.py, its hyper-parameters as ``**params``) must be
    positive (``descriptor.positive``; else ValueError): ``out = log sum_n k(x_m, y_n) w_n`` with
    log k from the log of its epilogue (closed forms for the built-ins, SymPy's expand_log of an
    expression), on the torch path in blocks, differentiable with respect to x, y, log_weights and
    its tensor hyper-parameters.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0], [1.0], [2.0]])
    >>> km.kernel_logsumexp(km.preset("gaussian_l2"), x, x, bandwidth=1.0)
    tensor([0.5550, 0.7944, 0.5550])
    >>> torch.logsumexp(-torch.cdist(x, x) ** 2 / 2, dim=1)   # the same, through the matrix
    tensor([0.5550, 0.7944, 0.5550])
    """
    debug = _debug.resolve(debug)
    if not isinstance(descriptor, KernelDescriptor):
        raise TypeError(f"descriptor: expected a KernelDescriptor, got {type(descriptor).__name__}")
    if not descriptor.fused_ok:
        if not descriptor.positive:
            raise ValueError(f"descriptor: {descriptor!r} is not a positive kernel (its log is not defined everywhere)")
    elif descriptor.kernel_type not in (KernelType.LAPLACE, KernelType.GAUSSIAN):
        raise ValueError(f"descriptor: {descriptor!r} has no LAPLACE or GAUSSIAN epilogue (its kernel must be exp(-phi))")
    elif descriptor.inner_operator is not InnerOperator.DIFF:
        raise ValueError(f"descriptor: {descriptor!r} is not a distance (inner operator DIFF)")
    check_data(x, y, ("x", "y"))
    if log_weights is None:
        lw, vector = x.new_zeros(y.shape[-2], 1), True
    else:
        check_tensor("log_weights", log_weights, min_dim=1)
        check_same("log_weights", log_weights, "x", x)
        vector = log_weights.dim() == 1
        lw = log_weights.unsqueeze(-1) if vector else log_weights
        if lw.shape[-2] != y.shape[-2]:
            raise ValueError(f"log_weights: expected {y.shape[-2]} rows (the points of y), got shape "
                             f"{tuple(log_weights.shape)}")
    call = prepare_call(descriptor, x, y, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                        epsilon=epsilon, names=("x", "y"), extra_shapes={"log_weights": tuple(lw.shape[:-2])},
                        params=params, data_checked=True)
    if descriptor.fused_ok and torch.is_grad_enabled():  # (a formula kernel's hyper-parameters are differentiable)
        check_no_hyper_grad(call.hypers, "kernel_logsumexp")
    shape = (*call.batch, call.M) if vector else (*call.batch, call.M, lw.shape[-1])
    if out is not None:
        if not isinstance(out, Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if vector:  # (..., M): checked as the matrix (..., M, 1)
            analyse_output("out", out.unsqueeze(-1), (*shape, 1), x.dtype, x.device)
        else:
            analyse_output("out", out, shape, x.dtype, x.device)
    work = _work_dtype(x)
    if debug:
        log.debug("kernel_logsumexp %r: M=%d N=%d K=%d C=%d batch=%s in %s blocks of %d x %d", descriptor, call.M,
                  call.N, call.K, lw.shape[-1], call.batch, work, *_blocks(call.batch, call.M, call.N, lw.shape[-1]))
    if not descriptor.fused_ok:
        res = _formula_fused(call, lw, work, debug)
        if res is None:
            res = formula_path.logsumexp(call, lw, work)
        res = (res.squeeze(-1) if vector else res).to(x.dtype)
        return res if out is None else out.copy_(res)
    hyper_tensors = [h for h in call.hypers.values() if isinstance(h, Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, lw))
    if not grad and direct_call(x, y, lw, out, *hyper_tensors):  # the op's implementation, without the dispatcher
        res = _forward(call, lw, work, debug)
    else:
        hp = call.hypers
        args = (x, y, lw, descriptor_ints(descriptor), *split_hyper(hp["inner_p"]), *split_hyper(hp["outer_p"]),
                *split_hyper(hp["bandwidth"]), call.epsilon, debug)
        if not grad and out is not None:
            _LSE_OUT(*args, out)
            return out
        res = _LSE_GRAD(x, y, lw, *hyper_tensors)(*args) if grad else _LSE(*args)
    res = (res.squeeze(-1) if vector else res).to(x.dtype)
    # out= carries no autograd: computed, then copied into out (out joins the graph)
    return res if out is None else out.copy_(res)
