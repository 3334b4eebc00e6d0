"""The average gradient outer product without the gradient tensor.

For the predictor f_o(v) = sum_i c[i, o] k(u_i, v) (u_i: the n centres, c: (n, O) coefficients)
and evaluation points v_j (m of them), :func:`agop_sum` returns

    sum_j sum_o grad f_o(v_j) grad f_o(v_j)^T        (D, D)       (diag: its diagonal, (D,))

in blocks of B evaluation points: per block the block's gradients (O, B, D), their outer products
added into the (D, D) sum.

* GPU (float32, sm_80+, D <= 256): the gradients are kernel_matvec's data-input contraction
  (ops.matvec_backward.diff_contraction, cuda_templates/matvec_grad.cuh), one pass a output:
  each thread (or 2-8 lanes beyond D = 32) owns an evaluation point, walks the centres in
  shared-memory tiles, forms the distance, the weight phi (the kernel's derivative, from the
  distance, in registers) and its D outputs from direct differences: nothing of size n x B is
  written; self pairs contribute exactly 0 (psi(0) = 0; phi(0) = 0 where it is unbounded), near
  pairs keep their accuracy (no product formula). Memory O(D^2 + O D B) (B = ``block_bytes`` /
  (2 O D itemsize): one block below millions of points) plus the split partial sums (<= 32 MiB).
* elsewhere (CPU tensors, float64, D > 256), per block the weight matrix w (n, B) (one
  run_kernel call, and one cdist where the kernel's weight has a power of the distance) and one
  contraction: cdist_grad (fused on the GPU) with a = w, b = u^T, c = (scale * coefficients)^T,
  d = v_block^T and the kernel's p; on the CPU for p = 2 one matrix product per block:
  grad f_o(v_j) = v_j (w^T c_o)_j - (w^T (c_o u))_j on points shifted by a reference point (the
  centres' median: the two terms cancel to the data's centred scale only), for other p
  cdist_grad's reference in blocks. Memory O(D^2 + O D B + n B) with
  B = ``block_bytes`` / (n * itemsize * (1 or 2)), 512 MiB of weights by default.

Nothing of size O x m x D exists at once.
"""

from __future__ import annotations

import torch

from ..centring import reference_point
from ..ops.distance import cdist, fused_device
from ..ops.grad import cdist_grad
from ..ops.matvec_backward import diff_contraction, fused_serves
from ._kernel import RFMKernel

__all__ = ["agop_sum", "function_gradients", "gradient_blocks", "AGOP_BLOCK_BYTES", "DISTANCE_FLOOR"]

AGOP_BLOCK_BYTES = 1 << 29
# Pairs closer than this (in the transformed space) get the weight of this distance: their
# difference factor is 0 (identical points, the cusp of the Laplace kernels) or as small.
DISTANCE_FLOOR = 1e-10


def _fused(u: torch.Tensor) -> bool:
    return u.dtype == torch.float32 and fused_device(u)


def _distances(u: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """r (n, B). Off the fused path, p = 2 takes torch.cdist's matrix product on points shifted
    by the centres' reference point, whose error eps (|u|^2 + |v|^2) swamps the distance of near
    pairs (identical rows come out at 1e-8 instead of 0): those below 2^-5 of the largest shifted
    norm are recomputed from direct differences."""
    if p != 2 or _fused(u):
        return cdist(u, v, p=p)
    s = reference_point(u).to(u.dtype)
    us, vs = u - s, v - s
    r = cdist(us, vs, p=2.0)
    # one threshold for the block (the largest norms): a superset of the near pairs, one pass
    limit = 2.0 ** -5 * float(us.square().sum(1).max() + vs.square().sum(1).max()) ** 0.5
    near = (r < limit).nonzero()
    if near.numel():
        i, j = near[:, 0], near[:, 1]
        r[i, j] = (us[i] - vs[j]).norm(dim=1)
    return r


def _weights(kernel: RFMKernel, bandwidth: float, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w / scale = k(u_i, v_j) r_ij^(q - p): (n, B). Pairs closer than DISTANCE_FLOOR: on the fused
    path, the weight of that distance (cdist_grad's difference factor is exactly 0 for identical
    points); elsewhere 0 (the p = 2 matrix product's implicit differences are not exact)."""
    power = kernel.weight_power
    if power == 0:
        return kernel.solver_kernel(bandwidth).matrix(u, v)
    if _fused(u):  # the kernel and the distances from two fused kernels
        w = kernel.solver_kernel(bandwidth).matrix(u, v)
        r = cdist(u, v, p=kernel.p).clamp_min_(DISTANCE_FLOOR)
    else:  # one distance matrix, the kernel from it
        r = _distances(u, v, kernel.p)
        zero = r < DISTANCE_FLOOR
        w = r.div(kernel.length(bandwidth)).pow_(kernel.q).neg_().exp_().masked_fill_(zero, 0.0)
        r.clamp_min_(DISTANCE_FLOOR)
    if power == -1:
        w.div_(r)
    else:
        w.mul_(r.pow_(power))
    return w


def contraction_hypers(kernel: RFMKernel, bandwidth: float) -> dict:
    """The descriptor's hyper-parameters of k with this bandwidth as diff_contraction takes them
    (inner_p, outer_p, bandwidth; a POW power's shared ``p`` split into both)."""
    sk = kernel.solver_kernel(bandwidth)
    h = sk.hypers
    desc = sk.desc
    return {"inner_p": h.get("inner_p", h.get("p")) if desc.needs_inner_p else None,
            "outer_p": h.get("outer_p", h.get("p")) if desc.needs_outer_p else None,
            "bandwidth": h.get("bandwidth") if desc.needs_bandwidth else None}


def _contraction_blocks(kernel: RFMKernel, bandwidth: float, u: torch.Tensor, coef: torch.Tensor, v: torch.Tensor,
                        block_bytes: int):
    """gradient_blocks through kernel_matvec's data-input contraction (one pass a output and block):
    grad f_o(v_j) = sum_i coef[i, o] grad_v k(v_j, u_i), the kernel's own derivative."""
    m, D = v.shape
    coef = coef.to(u.dtype)
    O = coef.shape[1]
    desc = kernel.solver_kernel(bandwidth).desc
    hyp = contraction_hypers(kernel, bandwidth)
    B = max(1, min(m, int(block_bytes) // max(1, 2 * O * D * u.element_size())))
    ones = torch.ones((B, 1), dtype=u.dtype, device=u.device)
    for j0 in range(0, m, B):
        vb = v[j0:j0 + B]
        g = torch.stack([diff_contraction(desc, vb, u, ones[:vb.shape[0]], coef[:, o:o + 1], **hyp)
                         for o in range(O)])
        yield j0, g  # (O, B, D)


def gradient_blocks(kernel: RFMKernel, bandwidth: float, u: torch.Tensor, coef: torch.Tensor, v: torch.Tensor, *,
                    block_bytes: int = AGOP_BLOCK_BYTES, contraction: bool | None = None):
    """Yield (j0, g) with g (O, B, D) the gradients at v[j0:j0+B] of f_o = sum_i coef[i, o] k(u_i, .)
    (u (n, D) centres, coef (n, O), v (m, D)), in the data's dtype. ``contraction``: take kernel_matvec's
    data-input contraction (default: where its fused kernel serves, ops.matvec_backward.fused_serves;
    True elsewhere: its blocked reference, for tests)."""
    if contraction is None:
        contraction = _fused(u) and fused_serves(u)
    if contraction:
        yield from _contraction_blocks(kernel, bandwidth, u, coef, v, block_bytes)
        return
    n, D = u.shape
    m = v.shape[0]
    dt = u.dtype
    scale = kernel.weight_scale(bandwidth)
    c = coef.to(dt) * scale  # (n, O)
    O = c.shape[1]
    per_col = n * u.element_size() * (1 if kernel.weight_power == 0 else 2)
    B = max(1, min(m, int(block_bytes) // max(1, per_col)))
    if _fused(u):
        ut = u.T.contiguous()  # (D, n)
        ct = c.T.contiguous()  # (O, n)
        for j0 in range(0, m, B):
            vb = v[j0:j0 + B]
            w = _weights(kernel, bandwidth, u, vb)  # (n, B)
            g = cdist_grad(w, ut, ct, vb.T.contiguous(), p=kernel.p)  # (O, D, B)
            del w
            yield j0, g.mT
        return
    if kernel.p == 2:
        s = reference_point(u).to(dt)
        uc = u - s
        wide = torch.cat([c, (c[:, :, None] * uc[:, None, :]).reshape(n, O * D)], 1)  # (n, O (1 + D))
        for j0 in range(0, m, B):
            vb = v[j0:j0 + B]
            w = _weights(kernel, bandwidth, u, vb)  # (n, B)
            prod = w.T @ wide  # (B, O (1 + D))
            del w
            g = (vb - s)[None] * prod[:, :O].T[:, :, None] - prod[:, O:].reshape(-1, O, D).transpose(0, 1)
            yield j0, g  # (O, B, D)
        return
    ut = u.T.contiguous()
    ct = c.T.contiguous()
    for j0 in range(0, m, B):
        vb = v[j0:j0 + B]
        w = _weights(kernel, bandwidth, u, vb)
        g = cdist_grad(w, ut, ct, vb.T.contiguous(), p=kernel.p)  # (O, D, B)
        del w
        yield j0, g.mT


@torch.no_grad()
def function_gradients(kernel: RFMKernel, bandwidth: float, u: torch.Tensor, coef: torch.Tensor,
                       v: torch.Tensor, *, block_bytes: int = AGOP_BLOCK_BYTES,
                       contraction: bool | None = None) -> torch.Tensor:
    """The gradients (O, m, D) of f_o = sum_i coef[i, o] k(u_i, .) at the rows of v: the whole
    tensor (for tests and small problems; :func:`agop_sum` never forms it).

    >>> import torch
    >>> from kermac_like.rfm import function_gradients, resolve_rfm_kernel
    >>> g = torch.Generator().manual_seed(0)
    >>> u = torch.randn(50, 3, generator=g, dtype=torch.float64)
    >>> coef = torch.randn(50, 1, generator=g, dtype=torch.float64)
    >>> function_gradients(resolve_rfm_kernel("laplace_l2", 1.0, 2.0), 2.0, u, coef, u[:10]).shape
    torch.Size([1, 10, 3])
    """
    out = torch.empty((coef.shape[1], v.shape[0], v.shape[1]), dtype=u.dtype, device=u.device)
    for j0, g in gradient_blocks(kernel, bandwidth, u, coef, v, block_bytes=block_bytes, contraction=contraction):
        out[:, j0:j0 + g.shape[1]] = g
    return out


@torch.no_grad()
def agop_sum(kernel: RFMKernel, bandwidth: float, u: torch.Tensor, coef: torch.Tensor, v: torch.Tensor, *,
             diag: bool = False, center: bool = False, block_bytes: int = AGOP_BLOCK_BYTES,
             contraction: bool | None = None) -> torch.Tensor:
    """sum over the points v_j and outputs o of grad f_o(v_j) grad f_o(v_j)^T: (D, D) in float64
    (``diag``: its diagonal, (D,)); ``center``: of the gradients minus their mean over all points
    and outputs (xRFM's center_grads, over the whole sample). Memory O(D^2 + n B) (module docstring).

    >>> import torch
    >>> from kermac_like.rfm import agop_sum, function_gradients, resolve_rfm_kernel
    >>> g = torch.Generator().manual_seed(0)
    >>> u = torch.randn(50, 3, generator=g, dtype=torch.float64)
    >>> coef = torch.randn(50, 1, generator=g, dtype=torch.float64)
    >>> k = resolve_rfm_kernel("laplace_l2", 1.0, 2.0)
    >>> G = function_gradients(k, 2.0, u, coef, u[:10])
    >>> torch.allclose(agop_sum(k, 2.0, u, coef, u[:10]), torch.einsum("omd,ome->de", G, G))
    True
    """
    D = u.shape[1]
    f64 = torch.float64
    acc = torch.zeros((D,) if diag else (D, D), dtype=f64, device=u.device)
    total = torch.zeros(D, dtype=f64, device=u.device) if center else None
    for _, g in gradient_blocks(kernel, bandwidth, u, coef, v, block_bytes=block_bytes, contraction=contraction):
        # (O, B, D): the outer products of the block's gradients, in the data's dtype, summed in float64
        if diag:
            acc += g.square().sum((0, 1), dtype=f64)
        elif g.shape[0] == 1:
            acc += (g[0].T @ g[0]).to(f64)
        else:
            acc += (g.mT @ g).sum(0, dtype=f64)
        if center:
            total += g.sum((0, 1), dtype=f64)
    if center:
        count = coef.shape[1] * v.shape[0]
        mean = total / max(1, count)
        acc -= count * (mean.square() if diag else torch.outer(mean, mean))
    return acc
