"""Translation invariance of the product formula: a per-call reference point.

Distances are translation invariant: ``|x - y| = |(x - s) - (y - s)|`` for any point ``s``.
The kernels that form squared distances by the product formula
``|x|^2 + |y|^2 - 2 <x, y>`` (tensor cores, the matrix-product modes) lose
``eps (|x|^2 + |y|^2)`` absolutely, which on data far from the origin (shifted coordinates,
all-positive features) is far larger than the distances themselves. Fed ``x - s`` and
``y - s`` with ``s`` near the data, the same kernels lose only ``eps`` times the data's
*centred* scale, and the subtraction itself is exact in float32 for every coordinate within a
factor of two of ``s``'s (Sterbenz), as on shifted data.

:func:`reference_point` is the one choice of ``s`` every path takes: the mean of the finite
coordinates of the given points, per column (0 where a column has none), detached from
autograd (distances do not depend on it, so neither do their gradients). Non-finite inputs
keep their semantics: ``s`` is finite, so ``inf - s = inf`` and ``NaN - s = NaN``.

DOT descriptors (``<x, y>``) are not translation invariant and are never shifted.
"""

from __future__ import annotations

import torch

from .descriptor import InnerOperator, KernelDescriptor

__all__ = ["reference_point", "centred", "shift_invariant", "centred_pair"]


def shift_invariant(desc: KernelDescriptor | None) -> bool:
    """Whether a descriptor's values depend on x - y alone (DIFF), so that a common shift of the
    data changes nothing but the rounding."""
    return desc is not None and desc.inner_operator == InnerOperator.DIFF


@torch.no_grad()
def reference_point(*points: torch.Tensor) -> torch.Tensor:
    """(K,) float32: per column, the mean of the finite coordinates of the rows of ``points``
    (each (..., n, K), leading dimensions flattened), 0 where a column has no finite value.
    No host synchronisation."""
    if not points:
        raise ValueError("points: expected at least one tensor")
    K = points[0].shape[-1]
    total = None
    count = None
    for p in points:
        if p.shape[-1] != K:
            raise ValueError(f"points: expected {K} columns, got {p.shape[-1]}")
        rows = p.detach().reshape(-1, K)
        finite = torch.isfinite(rows)
        s = torch.where(finite, rows, 0).sum(0, dtype=torch.float64)
        c = finite.sum(0, dtype=torch.float64)
        total = s if total is None else total + s.to(total.device)
        count = c if count is None else count + c.to(count.device)
    return (total / count.clamp_min(1)).to(torch.float32)


def centred(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t - s`` in t's dtype (a new tensor, contiguous), with ``s`` detached."""
    return torch.sub(t, s.detach().to(t.dtype))


def centred_pair(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor | None = None) -> tuple:
    """(x - s, y - s, s) with ``s`` = :func:`reference_point` of y unless given. When x and y
    are one tensor, its centred copy serves both."""
    if s is None:
        s = reference_point(y)
    yc = centred(y, s)
    xc = yc if (x is y) else centred(x, s)
    return xc, yc, s
