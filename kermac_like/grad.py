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
import os

import numpy as np
import torch

from . import _debug
from ._args import check_same, check_scalar_or_tensor, check_tensor
from .layout import Layout, analyse_output, batch_strides, broadcast_batch_shape, plan_batch
from .reference import cdist_grad_reference
from .render import grad_kernel_spec

log = logging.getLogger("kermac_like.grad")

__all__ = ["cdist_grad"]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads every operand along a unit-stride last mode."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


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
    """
    debug = _debug.resolve(debug)
    for name, t in (("a", a), ("b", b), ("c", c), ("d", d)):
        check_tensor(name, t)
    for name, t in (("b", b), ("c", c), ("d", d)):
        check_same(name, t, "a", a)
    K, M = a.shape[-2], a.shape[-1]
    N = b.shape[-2]
    O = c.shape[-2]
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
    batch = broadcast_batch_shape(shapes)
    out_shape = (*batch, O, N, M)
    _check_grad_out(out, out_shape, a.dtype, a.device)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b, c, d, p)) and torch.is_grad_enabled():
        raise NotImplementedError("cdist_grad: inputs require grad; differentiating cdist_grad is not supported")

    gpu = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 0) and a.dtype == torch.float32
    if not gpu or 0 in (K, M, N, O) or math.prod(batch) == 0:
        if debug:
            log.debug("cdist_grad: reference path (%s, %s)", a.device, a.dtype)
        res = cdist_grad_reference(a, b, c, d, p)
        if out is None:
            return res
        out.copy_(res)
        return out
    out = _launch_grad(a, b, c, d, p, out, batch, (K, M, N, O), debug)
    if not isinstance(p, torch.Tensor) and p == 1:
        _sign_nan(out, b, d)
    return out


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


def _launch_grad(a, b, c, d, p, out, batch, sizes, debug):
    from .launcher import get_kernel, launch

    K, M, N, O = sizes
    if out is None:
        out = torch.empty((*batch, O, N, M), dtype=a.dtype, device=a.device)
    ops = {"a": _unit_last(a), "b": _unit_last(b), "c": _unit_last(c), "d": _unit_last(d), "out": out}
    if isinstance(p, torch.Tensor):
        ops["p"] = p.float() if p.dtype != torch.float32 else p
        kind = "pow"
    else:
        kind = "abs" if p == 1 else "square" if p == 2 else "pow"
    strides = {}
    for k, t in ops.items():
        nb = t.dim() if k == "p" else t.dim() - (3 if k == "out" else 2)
        strides[k] = batch_strides(batch, tuple(t.shape[:nb]), tuple(t.stride()[:nb]))
    plan = plan_batch(batch, strides, max_modes=1)
    lds = {
        "a": ops["a"].stride(-2), "b": ops["b"].stride(-2), "c": ops["c"].stride(-2), "d": ops["d"].stride(-2),
        "ldo_o": out.stride(-3), "ldo_n": out.stride(-2),
    }
    # kVec = 4 (16-byte a/d/out accesses) needs a, d, out 16-byte aligned with
    # M, their leading dimensions and batch strides multiples of 4; b and c are
    # copied 4 bytes at a time and have no requirement (nor has K).
    vec_ops = ("a", "d", "out")
    vec_strides = [lds[k] for k in ("a", "d", "ldo_o", "ldo_n")] + [
        s for k in vec_ops for s in plan.strides[k][0] + plan.strides[k][1]
    ]
    vec = 4 if (
        M % 4 == 0
        and all(ops[k].data_ptr() % 16 == 0 for k in vec_ops)
        and all(s % 4 == 0 for s in vec_strides)
    ) else 1
    # Tensor-core contraction (3xTF32) where it measured faster; KERMAC_LIKE_GRAD_MMA=0 keeps SIMT.
    use_mma = os.environ.get("KERMAC_LIKE_GRAD_MMA", "1") != "0"
    sm90 = torch.cuda.get_device_capability(a.device) == (9, 0)
    spec = grad_kernel_spec(kind, vec, tensor_cores=use_mma, sm90=sm90)
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    kernel = get_kernel(spec, device, debug=debug)
    L = plan.count
    grid = (math.ceil(M / spec.launch.block_m), math.ceil(N / spec.launch.block_n), min(L, 65535))
    if debug:
        log.debug("cdist_grad: kind=%s vec=%d mma=%s K=%d M=%d N=%d O=%d batch=%s", kind, vec, use_mma, K, M, N, O,
                  batch)
    offsets = {k: list(plan.outer_offsets(k)) for k in ops}
    for i in range(len(offsets["a"])):

        def ptr(k):
            t = ops[k]
            return t.data_ptr() + offsets[k][i] * t.element_size()

        bs = {k: plan.strides[k][1][0] for k in ops}
        args = [
            ptr("a"), ptr("b"), ptr("c"), ptr("d"), ptr("out"),
            np.int32(M), np.int32(N), np.int32(K), np.int32(O),
            np.int64(lds["a"]), np.int64(lds["b"]), np.int64(lds["c"]), np.int64(lds["d"]),
            np.int64(lds["ldo_o"]), np.int64(lds["ldo_n"]),
            np.int32(L), np.int64(bs["a"]), np.int64(bs["b"]), np.int64(bs["c"]), np.int64(bs["d"]), np.int64(bs["out"]),
        ]
        if "p" in ops:
            args += [ptr("p"), np.int64(bs["p"]), np.float32(0.0)]
        else:
            args += [0, np.int64(0), np.float32(p)]
        launch(kernel, grid, tuple(args), debug=debug)
    return out
