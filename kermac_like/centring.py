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

__all__ = ["reference_point", "centred", "shift_invariant", "centred_pair", "REFERENCE_ROWS"]


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


def centred_pair(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor | None = None) -> tuple:
    """(x - s, y - s, s) with ``s`` = :func:`reference_point` of y and x unless given. When x and
    y are one tensor, its centred copy serves both."""
    if s is None:
        s = reference_point(y) if x is y else reference_point(y, x)
    yc = centred(y, s)
    xc = yc if (x is y) else centred(x, s)
    return xc, yc, s
