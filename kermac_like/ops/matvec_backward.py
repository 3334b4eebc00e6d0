"""Backward of :func:`kermac_like.kernel_matvec` without the kernel matrix: its contraction,
here; the backward registered with the op (:func:`kermac_like.ops.matvec.gradients`, which
calls the op itself for dL/dv) beside the op in ops/matvec.py.

The forward is ``out[..., m, c] = sum_n k(x_m, y_n) v[..., n, c]`` (plus
``lambda * v[n, c]`` where ``m + offset_x == n + offset_y``).  With the upstream
gradient ``g = dL/dout``:

* ``dL/dv = K^T g``: the transposed matvec, i.e. the forward with x and y
  swapped and the regularisation offsets swapped.
* DIFF descriptors (inner power ``|t|^q``, outer power D, epilogue E)::

      dL/dx[m,k] = sum_n phi(acc[m,n]) (g[m,:] . v[n,:]) psi(x[m,k] - y[n,k])
      dL/dy[n,k] = sum_m phi(acc[m,n]) (v[n,:] . g[m,:]) psi(y[n,k] - x[m,k])
      phi = q E'(d) D'(acc),  d = D(acc);  psi(t) = sgn(t) |t|^(q-1)

  with the dense backward's conventions (kermac_like/ops/distance_backward.py): phi = 0
  where d < epsilon, and for the SQRT and POW outer powers where d == 0; psi(0) = 0;
  NaN inputs give NaN gradients where the dense backward has them.
  The regularisation term does not depend on x or y.
* DOT: separable, ``dL/dx = g (v^T y)`` and ``dL/dy = v (g^T x)``: matrix
  products with (C, K) intermediates.

Paths of the DIFF contraction (:func:`diff_contraction`):

* GPU, float32/float16/bfloat16 inputs, K <= 256 and C <= 32: the fused kernel
  of ``cuda_templates/matvec_grad.cuh`` (spec: ``runtime/specs/matvec_grad.py``) (float32 arithmetic; float16/bfloat16
  are converted to float32 first).  Each CTA owns rows, loops over the other
  side in shared-memory tiles, and accumulates K outputs per row in registers (beyond K = 32,
  2, 4 or 8 lanes share a row, each with at most 32 of its coordinates; the N range split over
  CTAs where the rows alone leave the GPU under-filled).  Also the gradients of Recursive
  Feature Machines (kermac_like.rfm: the AGOP's gradients at points a of f = sum_n vb[n] k(., b_n)).
* everything else (CPU, float64, larger K or C): :func:`diff_contraction_reference`,
  plain torch in (row block x column block) pieces of at most
  ``reference.BLOCK_ELEMENTS`` elements (x K), so that the temporaries are
  bounded whatever M and N.

Memory: no M x N tensor is ever built.  Beyond the inputs and the gradients the
backward allocates O((M + N)(C + K)) per batch entry (float32 copies of
non-contiguous, broadcast or half-precision operands; the (C, K) products of
DOT) plus at most a fixed block budget on the reference path.

Gradients with respect to tensor hyper-parameters and double backward raise
``NotImplementedError``.

Translation invariance: the DIFF contraction forms acc and psi from direct differences
a[m,k] - b[n,k] on both paths (no product formula), so it needs no shift and reads x and y as
the forward received them; dL/dv is a kernel_matvec, shift invariant as the forward (its
product-formula paths shift their operands themselves). A common shift of x and y changes no
gradient. DOT gradients are matrix products of x and y as given (error relative to |x| |y|).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..descriptor import KernelDescriptor, KernelType, PowerType
from ..layout import broadcast_shapes
from ..reference import BLOCK_ELEMENTS
from ._library import call_op, check_no_hyper_grad, descriptor_from_ints, descriptor_ints, join_hyper, split_hyper
from ..runtime import launcher, store
from ..plan.core import MATVEC_SCRATCH_BYTES, _blocks_per_sm, _sm_count, choose_split
from ..runtime.specs.matvec_grad import (FUSED_C_WIDTHS, FUSED_K_WIDTHS, functor_grad_spec, fused_widths, lane_widths,
                                         matvec_grad_spec)

log = logging.getLogger("kermac_like.matvec_grad")

__all__ = [
    "diff_contraction",
    "contraction",
    "diff_contraction_reference",
    "dot_contraction_reference",
    "check_no_hyper_grad",
    "matvec_grad_spec",
    "fused_widths",
    "fused_serves",
    "FUSED_K_WIDTHS",
    "FUSED_C_WIDTHS",
]


# -- the launch mirror: kermac_like/runtime/specs/matvec_grad.py ------------------------------------
# -- hyper-parameters --------------------------------------------------------------------
def _q_of(desc: KernelDescriptor, inner_p):
    if desc.inner_power is PowerType.ABS:
        return 1.0
    if desc.inner_power is PowerType.SQUARE:
        return 2.0
    return inner_p


def _hyper_batched(h, batch: tuple, dtype, device, tail: int):
    """A float or a batch tensor as something broadcastable over (*batch, <tail dims>)."""
    if isinstance(h, torch.Tensor):
        h = h.to(dtype=dtype, device=device)
        return h.reshape(*h.shape, *([1] * tail))
    return h


# -- the reference contraction (any device, any dtype, bounded memory) ----------------------
def _phi(desc: KernelDescriptor, acc, q, r, bw, epsilon):
    """phi(acc) = q E'(d) D'(acc) (the dense backward's formulas, elementwise)."""
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    if desc.outer_power is PowerType.NOOP:
        d = acc
    elif desc.outer_power is PowerType.SQRT:
        d = acc.sqrt()
    else:
        d = acc.pow(1.0 / r)
    if desc.kernel_type is KernelType.NONE:
        e = torch.ones((), dtype=acc.dtype, device=acc.device)
    elif desc.kernel_type is KernelType.LAPLACE:
        e = -torch.exp(-d / bw) / bw
    else:
        e = -(d / (bw * bw)) * torch.exp(-(d * d) / (2.0 * bw * bw))
    # d == 0 has weight 0; a NaN d keeps its NaN weight (the dense backward's rule)
    if desc.outer_power is PowerType.NOOP:
        phi = e * q
    elif desc.outer_power is PowerType.SQRT:
        phi = torch.where(d == 0, zero, e * q / (2.0 * d))
    else:
        phi = torch.where(d == 0, zero, e * (q / r) * d.pow(1.0 - r))
    if epsilon is not None:
        phi = torch.where(d < epsilon, zero, phi)
    return phi


def diff_contraction_reference(desc: KernelDescriptor, a, b, ga, vb, *, inner_p=None, outer_p=None, bandwidth=None,
                               epsilon=None, out=None):
    """out[..., m, k] = sum_n phi(acc[m,n]) (ga[m,:] . vb[n,:]) psi(a[m,k] - b[n,k]) in plain torch.

    a (..., M, K), b (..., N, K), ga (..., M, C), vb (..., N, C): batch modes broadcast
    (hyper-parameter tensors too).  Computed in the dtype of ``a`` in pieces of
    (rows of a) x (rows of b) whose temporaries hold at most ``BLOCK_ELEMENTS``
    elements times K, so memory stays bounded whatever M and N.  Returns the
    full-batch (*batch, M, K) tensor.
    """
    dtype, device = a.dtype, a.device
    q = _q_of(desc, inner_p)
    hyp = {"q": q, "r": outer_p, "bw": bandwidth}
    hshapes = [tuple(h.shape) for h in hyp.values() if isinstance(h, torch.Tensor)]
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], ga.shape[:-2], vb.shape[:-2], *hshapes)
    M, N, K = a.shape[-2], b.shape[-2], a.shape[-1]
    C = ga.shape[-1]
    if out is None:
        out = torch.zeros(*batch, M, K, dtype=dtype, device=device)
    else:
        out.zero_()
    if M == 0 or N == 0 or K == 0:
        return out
    a = a.expand(*batch, M, K)
    b = b.expand(*batch, N, K)
    ga = ga.expand(*batch, M, C)
    vb = vb.expand(*batch, N, C)
    q2, r2, bw2 = (_hyper_batched(h, batch, dtype, device, 2) for h in hyp.values())
    q3 = _hyper_batched(q, batch, dtype, device, 3)
    nbatch = math.prod(batch) if batch else 1
    nb = min(N, max(1, int(math.isqrt(BLOCK_ELEMENTS // max(1, nbatch * K)))))
    mb = min(M, max(1, BLOCK_ELEMENTS // max(1, nbatch * K * nb)))
    zero = torch.zeros((), dtype=dtype, device=device)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        ab, gb = a[..., m0:m1, :], ga[..., m0:m1, :]
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            diff = ab.unsqueeze(-2) - b[..., n0:n1, :].unsqueeze(-3)  # (*batch, mb, nb, K)
            if desc.inner_power is PowerType.ABS:
                acc = diff.abs().sum(-1)
                psi = torch.where(diff.isnan(), diff, torch.sign(diff))  # sgn(NaN) = NaN
            elif desc.inner_power is PowerType.SQUARE:
                acc = (diff * diff).sum(-1)
                psi = diff
            else:
                mag = diff.abs()
                acc = mag.pow(q3).sum(-1)
                psi = torch.where(diff == 0, zero, torch.sign(diff) * mag.pow(q3 - 1))
                psi = torch.where(diff.isnan(), diff, psi)
            w = _phi(desc, acc, q2, r2, bw2, epsilon) * (gb @ vb[..., n0:n1, :].mT)  # (*batch, mb, nb)
            out[..., m0:m1, :] += torch.einsum("...mn,...mnk->...mk", w, psi)
    return out


def dot_contraction_reference(a, b, ga, vb, *, epsilon):
    """DOT with an epsilon: out[m,k] = sum_n [a_m . b_n >= epsilon] (ga_m . vb_n) b[n,k], in blocks
    (the thresholded product is not separable)."""
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], ga.shape[:-2], vb.shape[:-2])
    M, N, K, C = a.shape[-2], b.shape[-2], a.shape[-1], ga.shape[-1]
    out = torch.zeros(*batch, M, K, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0 or K == 0:
        return out
    a, b = a.expand(*batch, M, K), b.expand(*batch, N, K)
    ga, vb = ga.expand(*batch, M, C), vb.expand(*batch, N, C)
    nbatch = math.prod(batch) if batch else 1
    nb = min(N, max(1, int(math.isqrt(BLOCK_ELEMENTS // nbatch))))
    mb = min(M, max(1, BLOCK_ELEMENTS // (nbatch * nb)))
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        ab, gb = a[..., m0:m1, :], ga[..., m0:m1, :]
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            d = ab @ b[..., n0:n1, :].mT
            w = torch.where(d < epsilon, torch.zeros((), dtype=d.dtype, device=d.device),
                            gb @ vb[..., n0:n1, :].mT)
            out[..., m0:m1, :] += w @ b[..., n0:n1, :]
    return out


# -- the fused GPU contraction ---------------------------------------------------------------
def _gpu_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


def _flat_operand(t: torch.Tensor, batch: tuple, L: int):
    """(float32 contiguous tensor, batch stride in elements): stride 0 when t does not vary over the batch."""
    rows, cols = t.shape[-2], t.shape[-1]
    if math.prod(t.shape[:-2]) == 1:
        return t.reshape(rows, cols).to(torch.float32).contiguous(), 0
    f = t.expand(*batch, rows, cols).reshape(L, rows, cols).to(torch.float32).contiguous()
    return f, rows * cols


def _hyper_table(values, batch: tuple, L: int, device):
    """(L, 3) float32 table of (q, r, bw) when any of them is a tensor, else None."""
    if not any(isinstance(h, torch.Tensor) for h in values):
        return None
    cols = []
    for h in values:
        if isinstance(h, torch.Tensor):
            cols.append(h.to(device=device, dtype=torch.float32).expand(batch).reshape(L))
        else:
            cols.append(torch.full((L,), 1.0 if h is None else float(h), dtype=torch.float32, device=device))
    return torch.stack(cols, -1).contiguous()


def fused_serves(a: torch.Tensor, C: int = 1) -> bool:
    """Whether :func:`diff_contraction` takes the fused kernel for data like ``a`` (..., M, K) and C
    value columns: a GPU of sm_80 or newer, not float64, K <= 256 and C <= 32."""
    return a.dtype != torch.float64 and lane_widths(a.shape[-1], C) is not None and _gpu_ok(a)


def _fused_contraction(desc, a, b, ga, vb, *, q, r, bw, epsilon, batch, widths, debug, functor=False):
    """The fused kernel over the full batch: (*batch, M, K) float32. ``widths``: (kK, kC, kLanes)
    (specs.matvec_grad.lane_widths). Where the row tiles times the batch leave the GPU's CTA slots
    under-filled, the N range is split over gridDim.y (plan.core.choose_split, as kernel_matvec's;
    split partial sums of at most MATVEC_SCRATCH_BYTES, added in a fixed order: reproducible)."""
    M, N, K, C = a.shape[-2], b.shape[-2], a.shape[-1], ga.shape[-1]
    L = math.prod(batch) if batch else 1
    dev = a.device
    if L * M * K == 0:
        return torch.empty(*batch, M, K, dtype=torch.float32, device=dev)
    if N == 0:
        return torch.zeros(*batch, M, K, dtype=torch.float32, device=dev)
    kk, kc, lanes = widths
    if functor:  # a formula kernel's epilogue functor (q, r, bw: its slots p1, p2, p0)
        spec = functor_grad_spec(desc, kk, kc, lanes=lanes)
    else:
        spec = matvec_grad_spec(desc, kk, kc, epsilon is not None, lanes=lanes)  # unroll: specs.matvec_grad.UNROLL
    device = dev.index if dev.index is not None else torch.cuda.current_device()
    kernel = store.get_kernel(spec, device, debug=debug)
    m_tiles = -(-M // spec.launch.block_m)
    n_tiles = -(-N // spec.launch.block_n)
    slots = _sm_count(device) * _blocks_per_sm(kernel)
    split = choose_split(m_tiles * min(L, 65535), n_tiles, slots, max(1, MATVEC_SCRATCH_BYTES // (4 * L * M * K)))
    per = -(-n_tiles // split) * spec.launch.block_n  # rows of b a split (whole tiles)
    split = -(-N // per)
    out = torch.empty(split, L, M, K, dtype=torch.float32, device=dev)
    (af, sa), (bf, sb), (gf, sg), (vf, sv) = (_flat_operand(t, batch, L) for t in (a, b, ga, vb))
    table = _hyper_table((q, r, bw), batch, L, dev)
    scal = [1.0 if (h is None or isinstance(h, torch.Tensor)) else float(h) for h in (q, r, bw)]
    grid = (m_tiles, split, min(L, 65535))
    if debug:
        log.debug("matvec backward %r: fused kernel kK=%d kC=%d lanes=%d, M=%d N=%d K=%d C=%d L=%d grid=%s",
                  desc, kk, kc, lanes, M, N, K, C, L, grid)
    args = (
        af.data_ptr(), bf.data_ptr(), gf.data_ptr(), vf.data_ptr(), out.data_ptr(),
        np.int32(M), np.int32(N), np.int32(K), np.int32(C), np.int32(L),
        np.int64(sa), np.int64(sb), np.int64(sg), np.int64(sv),
        0 if table is None else table.data_ptr(), np.int64(0 if table is None or table.shape[0] == 1 else 3),
        np.float32(scal[0]), np.float32(scal[1]), np.float32(scal[2]),
        np.float32(0.0 if epsilon is None else epsilon), np.int32(per),
    )
    launcher.launch(kernel, grid, args, debug=debug)
    res = out[0] if split == 1 else out.sum(0)
    return res.reshape(*batch, M, K)


def diff_contraction(desc: KernelDescriptor, a, b, ga, vb, *, inner_p=None, outer_p=None, bandwidth=None,
                     epsilon=None, debug: bool = False):
    """out[..., m, k] = sum_n phi(acc[m,n]) (ga[m,:] . vb[n,:]) psi(a[m,k] - b[n,k]) over the full batch,
    in the dtype of ``a``; the fused kernel where it applies (K <= 256, C <= 32: specs.matvec_grad.lane_widths),
    the blocked reference elsewhere."""
    q = _q_of(desc, inner_p)
    hyp = (q, outer_p, bandwidth)
    hshapes = [tuple(h.shape) for h in hyp if isinstance(h, torch.Tensor)]
    batch = tuple(broadcast_shapes(a.shape[:-2], b.shape[:-2], ga.shape[:-2], vb.shape[:-2], *hshapes))
    K, C = a.shape[-1], ga.shape[-1]
    widths = lane_widths(K, C)
    if widths is not None and a.dtype != torch.float64 and _gpu_ok(a) and math.prod(batch) <= 2**31 - 1:
        out = _fused_contraction(desc, a, b, ga, vb, q=q, r=outer_p, bw=bandwidth, epsilon=epsilon, batch=batch,
                                 widths=widths, debug=debug)
        return out if a.dtype == torch.float32 else out.to(a.dtype)
    if debug:
        log.debug("matvec backward %r: blocked reference (%s, %s, K=%d, C=%d)", desc, a.device, a.dtype, K, C)
    if a.dtype in (torch.float16, torch.bfloat16):  # float32 arithmetic, like the kernel
        a, b, ga, vb = (t.float() for t in (a, b, ga, vb))
    return diff_contraction_reference(desc, a, b, ga, vb, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                                      epsilon=epsilon)


def formula_contraction(desc, a, b, ga, vb, slots: dict, *, debug: bool = False):
    """The DIFF contraction of a formula kernel that an epilogue functor serves, on the fused kernel
    with the functor (phi = 2 dk/d(r2)): out[..., m, k] = sum_n 2 k'(r2_mn) (ga[m,:] . vb[n,:]) (a[m,k] -
    b[n,k]), float32 (*batch, M, K). ``slots``: specs.epilogue.slot_hypers of the call. None where
    the kernel does not take it (not on a GPU of sm_80+, float64, K > 256 or C > 32)."""
    K, C = a.shape[-1], ga.shape[-1]
    widths = lane_widths(K, C)
    hyp = (slots["inner_p"], slots["outer_p"], slots["bandwidth"])
    hshapes = [tuple(h.shape) for h in hyp if isinstance(h, torch.Tensor)]
    batch = tuple(broadcast_shapes(a.shape[:-2], b.shape[:-2], ga.shape[:-2], vb.shape[:-2], *hshapes))
    if widths is None or a.dtype == torch.float64 or not _gpu_ok(a) or math.prod(batch) > 2**31 - 1:
        return None
    return _fused_contraction(desc, a, b, ga, vb, q=hyp[0], r=hyp[1], bw=hyp[2], epsilon=None, batch=batch,
                              widths=widths, debug=debug, functor=True)


# -- the contraction as a torch.library op (so that a registered backward calls only ops) ----------
def _contraction_impl(a: torch.Tensor, b: torch.Tensor, ga: torch.Tensor, vb: torch.Tensor, descriptor: list[int],
                    inner_p: float | None, inner_p_tensor: torch.Tensor | None, outer_p: float | None,
                    outer_p_tensor: torch.Tensor | None, bandwidth: float | None,
                    bandwidth_tensor: torch.Tensor | None, epsilon: float | None, debug: bool) -> torch.Tensor:
    desc = descriptor_from_ints(descriptor)
    out = diff_contraction(desc, a, b, ga, vb, inner_p=join_hyper(inner_p, inner_p_tensor),
                           outer_p=join_hyper(outer_p, outer_p_tensor),
                           bandwidth=join_hyper(bandwidth, bandwidth_tensor), epsilon=epsilon, debug=debug)
    return out.clone() if any(out.data_ptr() == t.data_ptr() for t in (a, b, ga, vb)) else out


_contraction_op = torch.library.custom_op("kermac_like::matvec_grad_contraction", _contraction_impl, mutates_args=())


@_contraction_op.register_fake
def _(a, b, ga, vb, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
      epsilon, debug):
    hs = [tuple(t.shape) for t in (inner_p_tensor, outer_p_tensor, bandwidth_tensor) if t is not None]
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], ga.shape[:-2], vb.shape[:-2], *hs)
    return a.new_empty((*batch, a.shape[-2], a.shape[-1]))


def contraction(desc: KernelDescriptor, a, b, ga, vb, *, inner_p=None, outer_p=None, bandwidth=None, epsilon=None,
                debug: bool = False):
    """:func:`diff_contraction` through the ``kermac_like::matvec_grad_contraction`` op."""
    return call_op(torch.ops.kermac_like.matvec_grad_contraction.default, _contraction_impl,
                   a, b, ga, vb, descriptor_ints(desc), *split_hyper(inner_p), *split_hyper(outer_p),
                   *split_hyper(bandwidth), epsilon, bool(debug))
