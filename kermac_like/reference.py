"""Reference implementations in plain torch: the tests' oracle (run_kernel, cdist and
kernel_matvec on CPU tensors and float64 take torch_path.py; cdist_grad's CPU path is
:func:`cdist_grad_reference`).

Everything is computed by direct differences (no ``|x|^2 + |y|^2 - 2xy``
expansion), in the dtype of the inputs (pass float64 for an oracle), in row
blocks so that the temporaries stay under a fixed element budget whatever the
problem size.
"""

from __future__ import annotations

import math

import torch

from .descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType
from .layout import broadcast_shapes

__all__ = ["distance_reference", "cdist_reference", "cdist_grad_reference", "matvec_reference", "BLOCK_ELEMENTS"]

# Largest temporary (elements) a reference computation builds at once.
BLOCK_ELEMENTS = 1 << 23


def _as_batched(x, dtype, device):
    """A hyper-parameter as a tensor broadcastable over (*batch, rows, cols)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype=dtype, device=device).reshape(*x.shape, 1, 1)
    return x


def _batch_of(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else ()


def _pairwise_blocks(a, b, batch, per_pair):
    """Yield (m0, m1, a_block) so that a_block x b x per_pair stays in budget."""
    M, N = a.shape[-2], b.shape[-2]
    nb = math.prod(batch) if batch else 1
    mb = max(1, BLOCK_ELEMENTS // max(1, nb * N * per_pair))
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        yield m0, m1, a[..., m0:m1, :]


def distance_reference(desc: KernelDescriptor, a, b, *, inner_p=None, outer_p=None, bandwidth=None,
                       regularization=None, reg_diag: int = 0, epsilon=None, out=None):
    """out[..., m, n] for a (..., M, K), b (..., N, K); see :class:`KernelDescriptor`.

    Hyper-parameters are floats or tensors whose shape broadcasts against the
    batch modes.  Regularisation adds ``regularization`` where ``n - m == reg_diag``.
    """
    dtype, device = a.dtype, a.device
    hypers = [inner_p, outer_p, bandwidth, regularization]
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], *(_batch_of(h) for h in hypers))
    M, N, K = a.shape[-2], b.shape[-2], a.shape[-1]
    a = a.expand(*batch, M, K)
    b = b.expand(*batch, N, K)
    ip, op, bw, lam = (_as_batched(h, dtype, device) for h in hypers)
    if out is None:
        out = torch.empty(*batch, M, N, dtype=dtype, device=device)
    bt = b.transpose(-1, -2)
    for m0, m1, ab in _pairwise_blocks(a, b, batch, K):
        if desc.inner_operator is InnerOperator.DOT:
            acc = ab @ bt
        else:
            diff = ab.unsqueeze(-2) - b.unsqueeze(-3)  # (*batch, mb, N, K)
            if desc.inner_power is PowerType.ABS:
                acc = diff.abs().sum(-1)
            elif desc.inner_power is PowerType.SQUARE:
                acc = (diff * diff).sum(-1)
            else:
                p = ip.unsqueeze(-1) if isinstance(ip, torch.Tensor) else ip
                acc = diff.abs().pow(p).sum(-1)
        if desc.outer_power is PowerType.SQRT:
            acc = acc.sqrt()
        elif desc.outer_power is PowerType.POW:
            acc = acc.pow(1.0 / op)
        if epsilon is not None:
            acc = torch.where(acc < epsilon, torch.zeros((), dtype=dtype, device=device), acc)
        if desc.kernel_type is KernelType.LAPLACE:
            acc = torch.exp(-acc / bw)
        elif desc.kernel_type is KernelType.GAUSSIAN:
            acc = torch.exp(-(acc * acc) / (2.0 * bw * bw))
        if regularization is not None:
            rows = torch.arange(m0, m1, device=device).unsqueeze(-1)
            cols = torch.arange(N, device=device)
            mask = (cols - rows) == reg_diag
            acc = acc + torch.where(mask, lam, torch.zeros((), dtype=dtype, device=device))
        out[..., m0:m1, :] = acc
    return out


def cdist_reference(x1, x2, p: float = 2.0, *, skip_epilogue: bool = False, out=None):
    """torch.cdist semantics (any p >= 0 and inf), plus ``skip_epilogue``
    (sum |x - y|^p without the 1/p root)."""
    dtype, device = x1.dtype, x1.device
    batch = broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    M, N, K = x1.shape[-2], x2.shape[-2], x1.shape[-1]
    x1 = x1.expand(*batch, M, K)
    x2 = x2.expand(*batch, N, K)
    if out is None:
        out = torch.empty(*batch, M, N, dtype=dtype, device=device)
    for m0, m1, ab in _pairwise_blocks(x1, x2, batch, K):
        diff = (ab.unsqueeze(-2) - x2.unsqueeze(-3)).abs()
        if p == 0:
            acc = diff.ceil().clamp(max=1).sum(-1)  # torch.cdist's count: |NaN| gives NaN
        elif math.isinf(p):
            acc = diff.amax(-1) if K > 0 else diff.sum(-1)
        elif p == 1:
            acc = diff.sum(-1)
        elif p == 2:
            acc = (diff * diff).sum(-1)
            if not skip_epilogue:
                acc = acc.sqrt()
        else:
            acc = diff.pow(p).sum(-1)
            if not skip_epilogue:
                acc = acc.pow(1.0 / p)
        out[..., m0:m1, :] = acc
    return out


def cdist_grad_reference(a, b, c, d, p=2.0, *, out=None):
    """out[..., o, n, m] = sum_k c[o,k] a[k,m] sgn(d[n,m]-b[n,k]) |d[n,m]-b[n,k]|^(p-1).

    a (..., K, M), b (..., N, K), c (..., O, K), d (..., N, M); ``p`` a float or a
    tensor over the batch.  The factor is 0 where d[n,m] == b[n,k] (sgn(0) = 0) and NaN
    where d[n,m] - b[n,k] is NaN (any p).
    """
    dtype, device = a.dtype, a.device
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2], d.shape[:-2], _batch_of(p))
    K, M = a.shape[-2], a.shape[-1]
    N, O = b.shape[-2], c.shape[-2]
    a = a.expand(*batch, K, M)
    b = b.expand(*batch, N, K)
    c = c.expand(*batch, O, K)
    d = d.expand(*batch, N, M)
    pe = p.to(dtype=dtype, device=device).reshape(*p.shape, 1, 1, 1) if isinstance(p, torch.Tensor) else p
    if out is None:
        out = torch.zeros(*batch, O, N, M, dtype=dtype, device=device)
    else:
        out.zero_()
    nb = math.prod(batch) if batch else 1
    kb = max(1, BLOCK_ELEMENTS // max(1, nb * N * M))
    zero = torch.zeros((), dtype=dtype, device=device)
    for k0 in range(0, K, kb):
        k1 = min(K, k0 + kb)
        diff = d.unsqueeze(-3) - b[..., k0:k1].transpose(-1, -2).unsqueeze(-1)  # (*batch, kb, N, M)
        if not isinstance(p, torch.Tensor) and p == 2:
            phi = diff
        elif not isinstance(p, torch.Tensor) and p == 1:
            phi = torch.where(diff.isnan(), diff, torch.sign(diff))  # sgn(NaN) = NaN, as in torch.cdist's backward
        else:
            mag = diff.abs()
            phi = torch.where(diff == 0, zero, torch.sign(diff) * mag.pow(pe - 1))
            phi = torch.where(diff.isnan(), diff, phi)  # (torch.sign(NaN) is 0 and NaN^0 is 1)
        w = a[..., k0:k1, :].unsqueeze(-2) * phi  # (*batch, kb, N, M)
        out += torch.einsum("...ok,...knm->...onm", c[..., k0:k1], w)
    return out


def matvec_blocks(batch: tuple, M: int, N: int) -> tuple:
    """(row block, column block) of :func:`matvec_reference`: the kernel block of all batch
    entries stays within BLOCK_ELEMENTS elements."""
    nb_batch = math.prod(batch) if batch else 1
    nb = max(1, min(N, 4096))
    mb = max(1, min(M, BLOCK_ELEMENTS // max(1, nb * nb_batch)))
    return mb, nb


def matvec_reference(call, out=None):
    """kernel_matvec in torch for a validated call (``kermac_like.ops.matvec.MatvecCall``):
    kernel blocks of at most BLOCK_ELEMENTS entries (row and column blocks, each through
    :func:`distance_reference`) times blocks of v, in the inputs' dtype (float32 for
    float16/bfloat16; float64 products and sums when ``out`` is float64). Memory beyond inputs
    and output: O(BLOCK_ELEMENTS + M C) whatever M and N."""
    dtype = call.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.out_dtype, device=call.device)
    # A float64 out of float32/16-bit inputs: kernel values in the work dtype, v (float32 or
    # float64) and the products and sums in float64.
    acc_dt = torch.float64 if out.dtype == torch.float64 else work
    x, y, v = call.x.to(work), call.y.to(work), call.v.to(acc_dt)
    hyp = {k: (h.to(work) if isinstance(h, torch.Tensor) else h) for k, h in call.hypers.items()}
    om = out.unsqueeze(-1) if call.vector else out
    M, N, C = call.M, call.N, call.C
    mb, nb = matvec_blocks(call.batch, M, N)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        acc = torch.zeros((*call.batch, m1 - m0, C), dtype=acc_dt, device=call.device)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            kb = distance_reference(call.desc, x[..., m0:m1, :], y[..., n0:n1, :], inner_p=hyp["inner_p"],
                                    outer_p=hyp["outer_p"], bandwidth=hyp["bandwidth"],
                                    regularization=hyp["regularization"], reg_diag=call.reg_diag - n0 + m0,
                                    epsilon=call.epsilon)
            acc += kb.to(acc_dt) @ v[..., n0:n1, :]
        om[..., m0:m1, :] = acc
    return out
