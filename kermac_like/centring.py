"""Translation invariance of the product formula: a per-call reference point.

Distances are translation invariant: ``|x - y| = |(x - s) - (y - s)|`` for any point ``s``.
The kernels that form squared distances by the product formula
``|x|^2 + |y|^2 - 2 <x, y>`` (tensor cores, the matrix-product modes) lose
``eps (|x|^2 + |y|^2)`` absolutely, which on data far from the origin (shifted coordinates,
all-positive features) is far larger than the distances themselves. Fed ``x - s`` and
``y - s`` with ``s`` near the data, the same kernels lose only ``eps`` times the data's
*centred* scale, and the subtraction itself is exact in float32 for every coordinate within a
factor of two of ``s``'s (Sterbenz), as on shifted data.

:func:`reference_point` is the one choice of ``s`` every path takes: per column, the median
of the finite coordinates of a strided sample of the rows (at most REFERENCE_ROWS of them),
0 where a column has none; detached from autograd (distances do not depend on it, so neither do
their gradients). A median is one of the data's own values: data on a lattice (integers, pixel
intensities, counts, multiples of a price tick) stay on it after the shift, so their differences
and the products of the kernels stay exact, where a mean (38.37 for pixels) would round each
coordinate; and one far outlier (heavy tails) does not move it. Non-finite inputs keep their
semantics: a column that holds an infinity or a NaN anywhere in the given points is not shifted
(``s`` = 0 there), so the product formula meets the same ``inf * 0 = NaN`` and ``inf - inf``
as torch.cdist's matrix product on the data as given; elsewhere ``s`` is finite.

DOT descriptors (``<x, y>``) are not translation invariant and are never shifted.
"""

from __future__ import annotations

import torch

from .descriptor import InnerOperator, KernelDescriptor

__all__ = ["reference_point", "centred", "shift_invariant", "shifted_pair", "pair_reference", "same_memory",
           "mark_centred", "centred_together", "REFERENCE_ROWS"]


def shift_invariant(desc: KernelDescriptor | None) -> bool:
    """Whether a descriptor's values depend on x - y alone (DIFF), so that a common shift of the
    data changes nothing but the rounding."""
    return desc is not None and desc.inner_operator == InnerOperator.DIFF


REFERENCE_ROWS = 1024  # rows of the sample whose median is the reference point


@torch.no_grad()
def reference_point(*points: torch.Tensor) -> torch.Tensor:
    """(K,) float32: per column, the median of the finite coordinates of a strided sample of the
    rows of ``points`` (each (..., n, K); of a batch, its first entry), 0 where a column has no
    finite value in the sample or a non-finite one anywhere in ``points`` (one maximum and one
    minimum over each: two reads). No host synchronisation."""
    if not points:
        raise ValueError("points: expected at least one tensor")
    K = points[0].shape[-1]
    rows, finite = [], None
    for p in points:
        if p.shape[-1] != K:
            raise ValueError(f"points: expected {K} columns, got {p.shape[-1]}")
        p = p.detach()
        if p.numel():
            dims = tuple(range(p.dim() - 1))
            ok = torch.isfinite(p.amax(dim=dims)) & torch.isfinite(p.amin(dim=dims))
            finite = ok if finite is None else finite & ok.to(finite.device)
        while p.dim() > 2:
            p = p[0]
        step = max(1, -(-p.shape[0] // REFERENCE_ROWS))
        rows.append(p[::step].float())
    sample = torch.cat(rows) if len(rows) > 1 else rows[0]
    if sample.shape[0] == 0:
        return sample.new_zeros(K)
    sample = sample.masked_fill(torch.isinf(sample), float("nan"))
    s = torch.nanmedian(sample, dim=0).values.nan_to_num_(nan=0.0)
    return s if finite is None else s.masked_fill_(~finite, 0.0)


def centred(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t - s`` in t's dtype (a new tensor, contiguous), with ``s`` detached."""
    return torch.sub(t, s.detach().to(t.dtype))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are one view of the same memory (pointer, shape and strides)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """t without its broadcast modes other than the last (stride 0, size > 1): size 1 there."""
    lead = list(zip(t.shape[:-1], t.stride()[:-1]))
    if not any(st == 0 and n > 1 for n, st in lead):
        return t
    return t[tuple(slice(0, 1) if (st == 0 and n > 1) else slice(None) for n, st in lead)]


def _shifted(t: torch.Tensor, s: torch.Tensor, pad_to: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``t - s`` computed in ``dtype`` (a 16-bit t widened first), a fresh row-major tensor
    zero-padded to ``pad_to`` columns, with t's broadcast modes kept broadcast (not copied)."""
    c = _compact(t)
    K = t.shape[-1]
    Kp = pad_to or K
    buf = torch.empty((*c.shape[:-1], Kp), dtype=dtype, device=t.device)
    if Kp > K:
        buf[..., K:].zero_()
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    torch.sub(c, s.to(device=t.device, dtype=wide), out=buf[..., :K])
    return buf if c is t else buf.expand(*t.shape[:-1], Kp)


def pair_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """reference_point of x and y (once where they are the same memory), their
    broadcast modes not materialised: (K,) float32, detached, no host synchronisation."""
    return reference_point(_compact(x)) if same_memory(x, y) else reference_point(_compact(x), _compact(y))


@torch.no_grad()
def shifted_pair(x: torch.Tensor, y: torch.Tensor, *, point: torch.Tensor | None = None, pad_to: int | None = None,
                 dtype: torch.dtype | None = None) -> tuple:
    """(x - s, y - s, s) for the product formula: s = ``point``, default
    reference_point of x and y (per column the median of a row sample,
    float32, no host synchronisation); fresh row-major tensors in ``dtype`` (default x's;
    float32 for 16-bit data, whose subtraction would round) zero-padded to ``pad_to`` columns,
    broadcast batch modes left broadcast, outside autograd (a common shift changes no distance,
    so the callers' gradients are those of x and y). Where x and y are the same memory, one
    tensor for both (the kernels' exact zero self-distance). Cost: one elementwise pass over
    each operand and, without ``point``, one reduction; memory: one copy of each."""
    same = same_memory(x, y)
    if point is None:
        point = pair_reference(x, y)
    dtype = dtype or (x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
    xs = _shifted(x, point, pad_to, dtype)
    return xs, (xs if same else _shifted(y, point, pad_to, dtype)), point


# -- operands shifted once by their caller ------------------------------------------------------
_CENTRED_ATTR = "_kermac_like_centred"


def mark_centred(point, *tensors: torch.Tensor) -> None:
    """Record on each tensor that it holds data shifted by the reference point ``point`` (or any
    object standing for it: operands marked with the same object were shifted together), so
    that the paths that would shift them (:func:`kermac_like.plan.matvec.plan_matvec`) read them
    as they are. The mark holds the tensor's version: an in-place change voids it. No-op while
    compiling and where a tensor has no version counter (inference mode)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        try:
            setattr(t, _CENTRED_ATTR, (point, t._version))
        except (RuntimeError, AttributeError):  # inference tensors; subclasses without attributes
            pass


def _mark_of(t: torch.Tensor):
    mark = getattr(t, _CENTRED_ATTR, None)
    if mark is None:
        return None
    try:
        return mark[0] if mark[1] == t._version else None
    except RuntimeError:
        return None


def centred_together(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether x and y carry valid marks of one reference point (:func:`mark_centred`)."""
    px = _mark_of(x)
    return px is not None and px is _mark_of(y)
