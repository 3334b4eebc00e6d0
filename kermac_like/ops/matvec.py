"""Kernel matrix-vector products without the matrix: :func:`kernel_matvec`.

``out[..., m, c] = sum_n k(x_m, y_n) v[n, c]`` (plus lambda v[m + offset_x - offset_y, c]
on run_kernel's regularised diagonal) for any :class:`KernelDescriptor`, in memory
linear in M + N: the GPU path is one fused kernel (cuda_templates/matvec.cuh), the CPU
and float64 path (torch_path.py) computes the kernel matrix in row and column blocks of
bounded size.

Internal entry points (used by the backward and by lazy kernel operators):
:func:`prepare_matvec` (validation -> :class:`MatvecCall`), :func:`matvec_forward`
(no autograd), :func:`matvec_reference` and :func:`gradients` (the backward of a call).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from .. import _debug, formula_path
from ..descriptor import InnerOperator, KernelDescriptor
from ..calls import WIDE_OUT_INPUTS, MatvecCall, check_rhs
from ..layout import analyse_output
from ..plan import MATVEC_SCRATCH_BYTES, plan_matvec
from ..plan.matvec import matvec_shifts  # (for the operators that keep shifted operands)
from ..plan.matvec import formula_fused
from ..runtime.specs import epilogue
from ..reference import matvec_reference
from . import matvec_backward
from ._library import (check_no_hyper_grad, descriptor_from_ints, descriptor_ints, direct_call, join_hypers,
                       register_autograd, split_hyper)
from .distance import check_data, prepare_call

log = logging.getLogger("kermac_like.matvec")

__all__ = ["kernel_matvec", "MatvecCall", "prepare_matvec", "matvec_forward", "matvec_reference", "gradients",
           "SCRATCH_BYTES", "WIDE_OUT_INPUTS", "matvec_shifts"]

SCRATCH_BYTES = MATVEC_SCRATCH_BYTES  # largest split-N scratch of one call (plan/core.py)
def prepare_matvec(descriptor, x, y, v, *, p=None, inner_p=None, outer_p=None, bandwidth=None,
                   regularization=None, regularization_offset_x=0, regularization_offset_y=0,
                   epsilon=None, params=None) -> MatvecCall:
    """Validate a kernel_matvec call; TypeError/ValueError naming the argument. ``params``: a
    formula kernel's own hyper-parameters (ops.distance.prepare_call)."""
    check_data(x, y, ("x", "y"))
    vm, vector = check_rhs("v", v, x, y.shape[-2])
    dc = prepare_call(descriptor, x, y, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                      regularization=regularization, regularization_offset_x=regularization_offset_x,
                      regularization_offset_y=regularization_offset_y, epsilon=epsilon, names=("x", "y"),
                      extra_shapes={"v": tuple(vm.shape[:-2])}, params=params, data_checked=True)
    return MatvecCall(descriptor, x, y, dc.hypers, dc.reg_diag, dc.epsilon, dc.batch, dc.M, dc.N, dc.K, vm,
                      vm.shape[-1], vector)


def _check_out(call: MatvecCall, out) -> torch.Tensor:
    """``out`` as a matrix view (..., M, C), after the checks of a user-provided output."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(call.out_shape):
        raise ValueError(f"out: expected shape {tuple(call.out_shape)}, got {tuple(out.shape)}")
    if call.wide_v and out.dtype != torch.float64:
        raise TypeError(f"out: expected dtype torch.float64 (v is float64: the float64 mode), got {out.dtype}")
    if out.dtype != call.dtype and not (out.dtype == torch.float64 and call.dtype in WIDE_OUT_INPUTS):
        ok = "float64" if call.dtype == torch.float64 else f"{call.dtype} or torch.float64"
        raise TypeError(f"out: expected dtype {ok}, got {out.dtype}")
    om = out.unsqueeze(-1) if call.vector else out
    analyse_output("out", om, (*call.batch, call.M, call.C), out.dtype, call.device)
    return om


def matvec_forward(call: MatvecCall, out=None, *, debug: bool = False) -> torch.Tensor:
    """Compute a validated call without autograd. ``out`` was checked by the caller (or is None).

    GPU memory beyond inputs and output: float32 copies of tensor hyper-parameters
    (batch-many scalars) and, when the N range is split across CTAs (few rows of x), split
    partial sums of at most SCRATCH_BYTES; never anything of size M x N."""
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.out_dtype, device=call.device)
    return plan_matvec(call, out, debug).run()


def matvec_f32_partials(descriptor, x, y, v, *, out=None, **hypers) -> torch.Tensor:
    """kernel_matvec(descriptor, x, y, v, out=out, **hypers) in the blocked float64 mode where it applies
    (internal, Falkon's products: a float64 v of float32/16-bit data and the expanded form; MatvecCall's
    ``f32_partials``), else as kernel_matvec computes it. No autograd, no custom-op dispatch."""
    call = replace(prepare_matvec(descriptor, x, y, v, **hypers), f32_partials=True)
    if out is not None:
        _check_out(call, out)
    return matvec_forward(call, out)


# -- a formula kernel's fused autograd (epilogue functors, cuda_templates/epilogue.cuh) -------------
def _formula_fused_grad(call: MatvecCall) -> bool:
    """Whether a differentiable formula call takes the fused kernels both ways (_FormulaMatvec): an
    epilogue functor serves it on the GPU (plan.matvec.formula_fused), no hyper-parameter needs a
    gradient (those take the torch path's blocked backward), no regularised diagonal, and x, y and v
    share their batch modes."""
    probe = torch.empty(0, dtype=call.dtype, device=call.device)
    return (formula_fused(call, probe) and call.hypers.get("regularization") in (None, 0.0)
            and not any(isinstance(h, torch.Tensor) and h.requires_grad for h in call.hypers.values())
            and call.x.shape[:-2] == call.y.shape[:-2] == call.v.shape[:-2])


def _formula_product(call: MatvecCall, desc, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
    """K(x, y) v of ``desc`` (the call's kernel or its derivative) with the call's hyper-parameters,
    through the fused kernel, no autograd: (*batch, rows of x, columns of v)."""
    c = replace(call, desc=desc, x=x, y=y, v=v, M=x.shape[-2], N=y.shape[-2], C=v.shape[-1], vector=False,
                reg_diag=0)
    return matvec_forward(c)


class _FormulaMatvec(torch.autograd.Function):
    """K(x, y) v of a formula kernel that an epilogue functor serves, both ways on the fused kernel:
    the forward as kernel_matvec's; the backward from products with the kernel itself and with its
    derivative k' = dk/d(r2) (specs.epilogue.derivative), r2 = |x_m - y_n|^2, w_mn = sum_c g_mc v_nc:

        dL/dv   = K(y, x) g                                    (k is symmetric in its operands)
        dL/dx_m = 2 sum_n k'_mn w_mn (x_m - y_n) = 2 [x_m sum_c g_mc (K' v)_mc - sum_c g_mc (K' (v_c y))_m]
        dL/dy_n = 2 [y_n sum_c v_nc (K'^T g)_nc - sum_c v_nc (K'^T (g_c x))_n],  K'^T = K'(y, x)

    with x and y centred on y's mean first (the differences are unchanged; the two terms' cancellation
    is then that of centred data): C (1 + D) columns of K' products for x, as many for y."""

    @staticmethod
    def forward(ctx, call, x, y, v):
        ctx.save_for_backward(x, y, v)
        ctx.call = call
        return _formula_product(call, call.desc, x.detach(), y.detach(), v.detach())

    @staticmethod
    def backward(ctx, g):
        x, y, v = ctx.saved_tensors
        call = ctx.call
        nx, ny, nv = ctx.needs_input_grad[1:4]
        g = g.to(call.dtype).contiguous()
        x, y, v = x.detach(), y.detach(), v.detach()
        gx = gy = gv = None
        if nv:
            gv = _formula_product(call, call.desc, y, x, g)
        if nx or ny:  # the contraction kernel with the functor's dk/d(r2): direct differences x_m - y_n
            slots = epilogue.slot_hypers(call.desc, call.hypers)
            if nx:
                gx = matvec_backward.formula_contraction(call.desc, x, y, g, v, slots)
            if ny:
                gy = matvec_backward.formula_contraction(call.desc, y, x, v, g, slots)
            gx = gx if gx is None else gx.to(call.dtype)
            gy = gy if gy is None else gy.to(call.dtype)
        if (nx and gx is None) or (ny and gy is None):  # beyond its widths: products with K' (split terms)
            dk = epilogue.derivative(call.desc)
            c = y.mean(dim=-2, keepdim=True)
            xc, yc = x - c, y - c
            D, C = x.shape[-1], v.shape[-1]

            def pull(a, b, w, u):
                # 2 [a sum_c u_c (K'(a, b) w)_c - sum_c u_c (K'(a, b) (w_c b))]: the gradient at a's rows
                rhs = torch.cat([w, (w.unsqueeze(-1) * b.unsqueeze(-2)).flatten(-2)], dim=-1).contiguous()
                prod = _formula_product(call, dk, a, b, rhs)
                first = (u * prod[..., :C]).sum(-1, keepdim=True)
                second = (u.unsqueeze(-1) * prod[..., C:].unflatten(-1, (C, D))).sum(-2)
                return 2.0 * (a * first - second)

            if nx and gx is None:
                gx = pull(xc, yc, v, g)
            if ny and gy is None:
                gy = pull(yc, xc, g, v)
        return None, gx, gy, gv


def _needs_grad(call: MatvecCall) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (call.x, call.y, call.v, *call.hypers.values()))


# -- the backward registered with the op (its contraction: ops/matvec_backward.py) --------------
def gradients(call, grad, needs=(True, True, True), *, debug: bool = False):
    """(dL/dx, dL/dy, dL/dv) of ``matvec_forward(call)`` for ``grad = dL/dout``.

    ``call`` is the forward's validated ``kermac_like.matvec.MatvecCall``; ``grad`` has its
    ``out_shape``; the v gradient has the shape of ``call.v`` (the (N, 1) view of a 1-D v).  ``needs``: which of the three to compute (None in the others' place).
    Each gradient has the shape and dtype of its input (broadcast batch modes summed).
    Tensor hyper-parameters must not require grad (:func:`._library.check_no_hyper_grad`).

    * dL/dv = K^T grad: ``kernel_matvec`` with x and y swapped and the regularised
      diagonal mirrored.
    * DIFF: two ``kermac_like::matvec_grad_contraction`` ops (:func:`.matvec_backward.contraction`),
      (x, y, grad, v) and (y, x, v, grad).

    Only torch ops and kermac_like ops are called (no kernel launch of its own), so a
    backward registered with ``torch.library.register_autograd`` stays traceable.
    * DOT: ``grad (v^T y)`` and ``v (grad^T x)``; with an epsilon (the thresholded
      product is not separable) a blocked contraction.
    """
    check_no_hyper_grad(call.hypers, "kernel_matvec")
    desc, x, y, v, hp = call.desc, call.x, call.y, call.v, call.hypers
    v2 = v  # always (..., N, C): a 1-D right-hand side is the (N, 1) view call.v
    g2 = grad.unsqueeze(-1) if call.vector else grad
    gx = gy = gv = None
    if needs[2]:
        # K^T g2: x and y swapped, the regularised diagonal mirrored (offset_x - offset_y = -reg_diag)
        hyp = {k: h for k, h in hp.items() if h is not None}
        gv = kernel_matvec(desc, y, x, g2, regularization_offset_x=0, regularization_offset_y=call.reg_diag,
                           epsilon=call.epsilon, debug=debug, **hyp)
        gv = gv.sum_to_size(v.shape).to(v.dtype)
    if not (needs[0] or needs[1]):
        return gx, gy, gv
    if desc.inner_operator is InnerOperator.DOT:
        wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xf, yf, vf, gf = (t.to(wide) for t in (x, y, v2, g2))
        if call.epsilon is None:
            if needs[0]:
                gx = gf @ (vf.mT @ yf)
            if needs[1]:
                gy = vf @ (gf.mT @ xf)
        else:
            if needs[0]:
                gx = matvec_backward.dot_contraction_reference(xf, yf, gf, vf, epsilon=call.epsilon)
            if needs[1]:
                gy = matvec_backward.dot_contraction_reference(yf, xf, vf, gf, epsilon=call.epsilon)
    else:
        kw = dict(inner_p=hp["inner_p"], outer_p=hp["outer_p"], bandwidth=hp["bandwidth"], epsilon=call.epsilon,
                  debug=debug)
        if needs[0]:
            gx = matvec_backward.contraction(desc, x, y, g2, v2, **kw)
        if needs[1]:
            gy = matvec_backward.contraction(desc, y, x, v2, g2, **kw)
    if gx is not None:
        gx = gx.sum_to_size(x.shape).to(x.dtype)
    if gy is not None:
        gy = gy.sum_to_size(y.shape).to(y.dtype)
    return gx, gy, gv


def backward_for_autograd(call, grad, needs, *, debug: bool = False):
    """The body of the registered backward (torch.library.register_autograd, and the
    eager autograd.Function of ops/_library.register_autograd): refuses double backward,
    then :func:`gradients`."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "kermac_like: double backward through kernel_matvec is not supported (the backward is not differentiable)"
        )
    return gradients(call, grad.contiguous() if not grad.is_contiguous() else grad, needs, debug=debug)


# Registered with torch.library.register_autograd for an op ``kermac_like::kernel_matvec(x, y, v,
# descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
# regularization, regularization_tensor, reg_diag, epsilon, debug)`` (run_kernel's schema with v
# after y): op.register_autograd(backward, setup_context=setup_context).
_N_OP_INPUTS = 15


def setup_context(ctx, inputs, output):
    (x, y, v, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon, debug) = inputs
    ctx.save_for_backward(x, y, v, ipt, opt, bwt, rgt)
    ctx.args = (tuple(descriptor), ip, op, bw, rg, reg_diag, epsilon, debug)


def backward(ctx, grad):
    """dL/dx, dL/dy, dL/dv of the op (None for the other inputs); only ops are called
    (``kermac_like::matvec_grad_contraction`` and the public kernel_matvec), so a traced
    backward records them. Tensor hyper-parameters that require grad and double
    backward raise NotImplementedError."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "kermac_like: double backward through kernel_matvec is not supported (the backward is not differentiable)"
        )
    x, y, v, ipt, opt, bwt, rgt = ctx.saved_tensors
    descriptor, ip, op, bw, rg, reg_diag, epsilon, debug = ctx.args
    call = _call_of(x, y, v, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon)
    gx, gy, gv = backward_for_autograd(call, grad, ctx.needs_input_grad[:3], debug=debug)
    if gv is not None:
        gv = gv.reshape(v.shape)  # a 1-D v: (N, 1) -> (N,)
    return (gx, gy, gv) + (None,) * (_N_OP_INPUTS - 3)


# -- the ops: kermac_like::kernel_matvec and kermac_like::kernel_matvec_out ----------------------
def _call_of(x, y, v, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
             regularization, regularization_tensor, reg_diag, epsilon) -> MatvecCall:
    hypers = join_hypers(inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                         regularization, regularization_tensor)
    return MatvecCall.of(descriptor_from_ints(descriptor), x, y, v, hypers, reg_diag, epsilon)


def _matvec_impl(x: Tensor, y: Tensor, v: Tensor, descriptor: list[int], inner_p: Optional[float],
               inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
               bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], regularization: Optional[float],
               regularization_tensor: Optional[Tensor], reg_diag: int, epsilon: Optional[float],
               debug: bool) -> Tensor:
    call = _call_of(x, y, v, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                    bandwidth_tensor, regularization, regularization_tensor, reg_diag, epsilon)
    return matvec_forward(call, None, debug=debug)


_matvec_op = torch.library.custom_op("kermac_like::kernel_matvec", _matvec_impl, mutates_args=())


@torch.library.custom_op("kermac_like::kernel_matvec_out", mutates_args=("out",))
def _matvec_out_op(x: Tensor, y: Tensor, v: Tensor, descriptor: list[int], inner_p: Optional[float],
                   inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
                   bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], regularization: Optional[float],
                   regularization_tensor: Optional[Tensor], reg_diag: int, epsilon: Optional[float], debug: bool,
                   out: Tensor) -> None:
    call = _call_of(x, y, v, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                    bandwidth_tensor, regularization, regularization_tensor, reg_diag, epsilon)
    matvec_forward(call, out, debug=debug)


@_matvec_op.register_fake
def _matvec_fake(x, y, v, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                 regularization, regularization_tensor, reg_diag, epsilon, debug):
    hypers = (inner_p_tensor, outer_p_tensor, bandwidth_tensor, regularization_tensor)
    vb = v.shape[:-2] if v.dim() > 1 else ()
    batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2], vb, *(t.shape for t in hypers if t is not None))
    tail = (x.shape[-2],) if v.dim() == 1 else (x.shape[-2], v.shape[-1])
    wide = v.dtype == torch.float64 and x.dtype != torch.float64
    return x.new_empty((*batch, *tail), dtype=torch.float64 if wide else x.dtype)


@_matvec_out_op.register_fake
def _matvec_out_fake(*args):
    return None


_MATVEC_GRAD = register_autograd(_matvec_op, _matvec_impl, backward, setup_context)
_MATVEC = torch.ops.kermac_like.kernel_matvec.default
_MATVEC_OUT = torch.ops.kermac_like.kernel_matvec_out.default


def _op_args(call: MatvecCall, v: Tensor) -> tuple:
    """The op's arguments of a validated call (``v`` as the caller gave it), up to debug."""
    hp = call.hypers
    return (call.x, call.y, v, descriptor_ints(call.desc), *split_hyper(hp["inner_p"]), *split_hyper(hp["outer_p"]),
            *split_hyper(hp["bandwidth"]), *split_hyper(hp["regularization"]), call.reg_diag, call.epsilon)


# -- public API ----------------------------------------------------------------------------
def kernel_matvec(descriptor: KernelDescriptor, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, *, out=None,
                  p=None, inner_p=None, outer_p=None, bandwidth=None, regularization=None,
                  regularization_offset_x: int = 0, regularization_offset_y: int = 0, epsilon=None,
                  debug: bool = False, **params) -> torch.Tensor:
    """Kernel matrix times ``v`` without the kernel matrix:
    ``out[..., m, c] = sum_n K[..., m, n] v[..., n, c]`` with ``K = run_kernel(descriptor, x,
    y, ...)`` (same descriptor semantics, hyper-parameters, broadcasting and regularisation:
    ``regularization`` is added to K where ``m + regularization_offset_x == n +
    regularization_offset_y``).

    ``x`` is ``(..., M, K)``, ``y`` ``(..., N, K)``; ``v`` follows torch.matmul: a 1-D ``(N,)``
    gives ``(..., M)``, a ``(..., N, C)`` matrix gives ``(..., M, C)``; batch modes of x, y, v
    and tensor hyper-parameters broadcast. dtypes: float32; float16/bfloat16 (float32
    accumulation, output in the input dtype); float64 and CPU tensors take the torch
    path (kermac_like/torch_path.py: run_kernel's blocks in its default compute mode, at most
    2^22 entries on the CPU, times blocks of v; the float64 mode by direct differences).
    ``out`` may be float64 for float32/float16/bfloat16 inputs, and ``v`` may be float64 (then
    the result is float64): the float64 mode, in which the kernel values are computed in
    float32 as always and everything after them is float64
    (v read as float64, a float32 v widened; each product k * v and all sums in float64, split
    sums combined in float64, the result stored without rounding; float64 accumulation on the
    torch path and in matvec_blocked, which then serves the K > 32 Euclidean calls in place
    of the sm_90 tensor-core kernel). For iterative solvers whose products cancel (Falkon's
    preconditioned system). Not under autograd (ValueError naming ``out`` or ``v``).

    Paths: one fused kernel (cuda_templates/matvec.cuh) for every descriptor; for
    Euclidean/DOT descriptors with K > 32 in float32, on sm_90 (H100/H200) the fused
    tensor-core kernel of cuda_templates/matvec_wgmma.cuh (3xTF32 distances, the kernel's
    epilogue and the product with v in registers), elsewhere (or with KERMAC_LIKE_WGMMA=0)
    kernel tiles from run_kernel's tensor-core (3xTF32) kernels times v (plan.matvec_blocked).
    Memory (GPU) beyond inputs and output: O((M + N) C), never M x N: the fused kernels
    take at most ``SCRATCH_BYTES`` (32 MB) of split-N partial sums when M is small (float64 in
    the float64 mode), plus batch-many float32 hyper-parameters and, in the float64 mode with a
    float32/16-bit v, v widened to float64 (N x C); the sm_90 large-K kernel also y prepared for
    the tensor cores one range of N at a time (at most plan.matvec_wgmma.MATVEC_WGMMA_BLOCK_BYTES, 64 MB),
    v's tiles (N x C) and, for several ranges, a float64 carry (M x C); matvec_blocked one
    kernel tile of at most plan.matvec.MATVEC_TILE_ELEMENTS (128 MB) and the distance kernel's copy
    of one y block. Where x or y lack 16-byte aligned rows (K not a multiple of 4, views),
    the tensor-core paths read zero-padded row-major copies; for DIFF descriptors the sm_90
    kernel always reads such copies, shifted (the error model below), and so does the torch
    path's matrix product (M x K and N x K elements). The fused kernels' sums are
    accumulated per y tile in float32 and across tiles in float64, and combined in a fixed
    order: results are bitwise identical from run to run.

    Error model: DIFF descriptors are translation invariant, and every path computes them so:
    where distances come from the product formula ``|x|^2 + |y|^2 - 2 <x, y>`` on the operands
    as given (the sm_90 tensor-core kernel; the torch path's matrix product of SQUARE inner
    powers), x and y are first shifted by one reference point (their mean,
    kermac_like.centring: one elementwise pass and a copy of each, no host synchronisation),
    and the tensor-core tiles of matvec_blocked are run_kernel's, which do the same; the fused
    SIMT kernel takes direct differences or centres its expanded form itself. The kernel
    values' error is thus eps times the data's centred scale (data offset by 1000 x its spread
    is computed as well as centred data), not eps (|x|^2 + |y|^2). The shift is applied where
    a path needs it only, and not at all for DOT descriptors, whose error is relative to
    |x| |y| as the dot product's own. Gradients are those of x and y as given (a common shift
    changes no distance; the backward takes direct differences). NaN/inf
    propagate like the dense product (an infinite distance gives k = 0, a NaN gives NaN; on
    the Gaussian's fast path a pair of infinite coordinates gives 0 rather than NaN; on the
    torch path, where SQUARE inner powers take the matrix product above 25 rows of x or y, an
    infinite coordinate gives NaN or inf as in run_kernel(...) @ v there).

    ``out`` (any strides with a unit-stride or size-1 mode, no overlap) is written in place
    and returned; it is left untouched when an argument is rejected. Underneath it is the
    custom op ``torch.ops.kermac_like.kernel_matvec`` (``kernel_matvec_out`` for ``out=``):
    fake shapes for torch.compile, autograd for x, y and v (:func:`gradients`, the contraction in
    ops/matvec_backward.py).

    Formula kernels (kermac_like/formula.py; their hyper-parameters as ``**params``): those of the l2
    distance on a GPU (float32/16-bit) through the fused SIMT kernel with their epilogue functor (up
    to K = 64; the tensor-core tiles beyond), differentiable with respect to x, y and v by the fused
    contraction (setting formula_fused, on by default); the others, and gradients of tensor
    hyper-parameters, on the torch path (kermac_like/formula_path.py: blocks of bounded memory, a
    backward that recomputes each block: memory O((M + N) C + block) in both passes).

    >>> import torch, kermac_like as km
    >>> g = km.preset("gaussian_l2")
    >>> x = torch.tensor([[0.0], [1.0], [2.0]])
    >>> v = torch.tensor([[1.0], [0.0], [-1.0]])
    >>> km.kernel_matvec(g, x, x, v, bandwidth=1.0)          # the matrix is never formed
    tensor([[ 0.8647],
            [ 0.0000],
            [-0.8647]])
    >>> torch.allclose(km.run_kernel(g, x, x, bandwidth=1.0) @ v, km.kernel_matvec(g, x, x, v, bandwidth=1.0))
    True
    """
    debug = _debug.resolve(debug)
    call = prepare_matvec(descriptor, x, y, v, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                          regularization=regularization, regularization_offset_x=regularization_offset_x,
                          regularization_offset_y=regularization_offset_y, epsilon=epsilon, params=params)
    if out is not None:
        _check_out(call, out)
    hyper_tensors = [h for h in call.hypers.values() if isinstance(h, torch.Tensor)]
    grad = _needs_grad(call)
    if grad and call.wide_v:
        raise ValueError(f"v: a float64 v with {call.dtype} x and y (the float64 mode) takes no part in autograd; "
                         "detach the inputs, or pass v in x's dtype")
    if grad and out is not None and out.dtype != call.dtype:
        raise ValueError(f"out: a {out.dtype} out of {call.dtype} inputs takes no part in autograd (the "
                         "differentiable product returns the inputs' dtype); detach the inputs or drop out=")
    if not call.desc.fused_ok:  # a formula kernel: the torch path (no op schema carries it)
        if not grad:
            return matvec_forward(call, out, debug=debug)
        if _formula_fused_grad(call):
            res = _FormulaMatvec.apply(call, call.x, call.y, call.v)
            res = res.squeeze(-1) if call.vector else res
        else:
            res = formula_path.matvec_autograd(call)
        return res if out is None else out.copy_(res)
    if grad:
        check_no_hyper_grad(call.hypers, "kernel_matvec")
    elif direct_call(x, y, v, out, *hyper_tensors):
        return matvec_forward(call, out, debug=debug)  # the op's implementation, without the dispatcher
    args = _op_args(call, v)
    if grad:  # (an eager call without the dispatcher, as above: ops/_library.py)
        res = _MATVEC_GRAD(x, y, v, out, *hyper_tensors)(*args, debug)
        # out= variants carry no autograd: compute, then copy into out (out joins the graph)
        return res if out is None else out.copy_(res)
    if out is None:
        return _MATVEC(*args, debug)
    _MATVEC_OUT(*args, debug, out)
    return out
