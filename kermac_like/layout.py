"""Tensor-layout analysis shared by every op.

Every op describes its operands the same way:

* a *matrix* operand is the last two modes of a tensor, ``(..., rows, cols)``;
  it is row-major when ``cols`` is the unit-stride mode, column-major when
  ``rows`` is, and otherwise (both strides > 1) it is copied to a contiguous
  tensor (documented behaviour, logged in debug mode);
* a *batched scalar* operand (a hyper-parameter tensor such as a per-batch
  bandwidth) is all batch modes;
* the leading modes of all operands broadcast against each other like torch
  broadcasting (right-aligned, size 1 broadcasts).

:func:`plan_batch` folds the broadcast batch modes into at most three kernel
modes (merging modes that are contiguous for every operand) and leaves any
remaining outer modes to a host loop.  Element strides of 0 mean "broadcast".
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
from dataclasses import dataclass

import torch

__all__ = [
    "Layout",
    "MatrixView",
    "analyse_matrix",
    "analyse_output",
    "broadcast_batch_shape",
    "batch_strides",
    "BatchPlan",
    "plan_batch",
    "KERNEL_BATCH_MODES",
]

log = logging.getLogger("kermac_like.layout")

KERNEL_BATCH_MODES = 3


class Layout(enum.IntEnum):
    ROW_MAJOR = 0
    COL_MAJOR = 1

    @property
    def cpp(self) -> str:
        return "kermac_like::Layout::RowMajor" if self is Layout.ROW_MAJOR else "kermac_like::Layout::ColMajor"


@dataclass(frozen=True)
class MatrixView:
    """One matrix operand as the kernels see it."""

    name: str
    tensor: torch.Tensor  # what the kernel reads: the argument itself or a contiguous copy
    rows: int
    cols: int
    layout: Layout
    ld: int  # element stride of the non-unit mode
    copied: bool

    @property
    def batch_shape(self) -> tuple:
        return tuple(self.tensor.shape[:-2])

    @property
    def contiguous_extent(self) -> int:
        return self.cols if self.layout is Layout.ROW_MAJOR else self.rows

    def vector_ok(self, width_bytes: int = 16, *, whole_lines: bool = True) -> bool:
        """Whether 16-byte vector accesses along the unit-stride mode are safe:
        aligned base pointer, and every line and (``whole_lines``) the contiguous extent a
        whole number of vectors (so no vector straddles a line end). ``whole_lines=False``
        for kernels that copy only the valid bytes of a line's last vector."""
        per = width_bytes // self.tensor.element_size()
        ld_ok = self.ld % per == 0 or self.ld == 0
        return (self.tensor.data_ptr() % width_bytes == 0 and ld_ok
                and (not whole_lines or self.contiguous_extent % per == 0))


def _matrix_layout(rows: int, cols: int, sr: int, sc: int):
    """(layout, ld) for a (rows, cols) view with strides (sr, sc), or None."""
    if rows == 1:  # one row: row-major when its elements are adjacent, else a strided column-major line
        return (Layout.ROW_MAJOR, cols) if sc == 1 or cols == 1 else (Layout.COL_MAJOR, sc)
    if sc == 1 or cols == 1:  # element [r, c] at r*sr + c
        return Layout.ROW_MAJOR, sr
    if sr == 1:  # element [r, c] at r + c*sc
        return Layout.COL_MAJOR, sc
    return None


def analyse_matrix(name: str, t: torch.Tensor, *, copy_ok: bool = True, prefer: Layout | None = None) -> MatrixView:
    """Describe the last two modes of ``t`` as a row- or column-major matrix.

    A layout the kernels cannot take (no unit-stride mode) is copied to a
    contiguous tensor when ``copy_ok``; otherwise a ``ValueError`` names ``name``.
    ``prefer`` forces a copy to that layout when the view has the other one
    (used by kernels that support only one layout).
    """
    if t.dim() < 2:
        raise ValueError(f"{name}: expected a tensor of at least 2 dimensions (..., rows, cols), got shape {tuple(t.shape)}")
    rows, cols = t.shape[-2], t.shape[-1]
    sr, sc = t.stride()[-2], t.stride()[-1]
    found = _matrix_layout(rows, cols, sr, sc)
    if found is not None and prefer is not None and found[0] is not prefer and rows > 1 and cols > 1:
        found = None
    if found is None:
        if not copy_ok:
            raise ValueError(
                f"{name}: strides {tuple(t.stride())} have no unit-stride matrix mode; pass a contiguous tensor"
            )
        if prefer is Layout.COL_MAJOR:
            t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            layout, ld = Layout.COL_MAJOR, max(rows, 1)
        else:
            t = t.contiguous()
            layout, ld = Layout.ROW_MAJOR, max(cols, 1)
        log.debug("%s: copied to a %s tensor (strides had no usable unit-stride mode)", name, layout.name)
        return MatrixView(name, t, rows, cols, layout, ld, True)
    layout, ld = found
    return MatrixView(name, t, rows, cols, layout, ld, False)


def analyse_output(name: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> MatrixView:
    """Check a user-provided ``out`` and describe it; never copies (we must write in place)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{name}: expected device {device}, got {out.device}")
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: must not require grad (it is written in place)")
    view = analyse_matrix(name, out, copy_ok=False)
    # Writes must not alias: a zero stride over a batch mode of extent > 1, or a
    # leading dimension smaller than the contiguous extent, would overlap.
    for size, stride in zip(out.shape[:-2], out.stride()[:-2]):
        if size > 1 and stride == 0:
            raise ValueError(f"{name}: has overlapping memory (zero stride over a batch mode)")
    other = view.rows if view.layout is Layout.ROW_MAJOR else view.cols
    if other > 1 and view.ld < view.contiguous_extent:
        raise ValueError(f"{name}: has overlapping memory (leading dimension {view.ld} < {view.contiguous_extent})")
    return view


def broadcast_shapes(*shapes) -> tuple:
    """torch.broadcast_shapes of shapes that are known to broadcast, in plain Python: torch's
    imports sympy on its first call (0.7-2 s of a first call; bench/notes/jit.md). Symbolic
    sizes (fake tensors under torch.compile) go to torch's."""
    if not all(isinstance(d, int) for s in shapes for d in s):
        return tuple(torch.broadcast_shapes(*shapes))
    nd = max(map(len, shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, d in enumerate(s, nd - len(s)):
            if d != 1:
                out[i] = d
    return tuple(out)


def broadcast_batch_shape(shapes: "dict[str, tuple]") -> tuple:
    """torch-style broadcast of several batch shapes; the error names the arguments."""
    ndim = max([len(s) for s in shapes.values()] + [0])
    out = []
    for i in range(ndim):
        size, owner = 1, None
        for name, s in shapes.items():
            j = i - (ndim - len(s))
            if j < 0 or s[j] == 1:
                continue
            if size == 1:
                size, owner = s[j], name
            elif s[j] != size:
                raise ValueError(
                    f"{name}: batch shape {tuple(s)} does not broadcast with {owner}'s {tuple(shapes[owner])}"
                )
        out.append(size)
    return tuple(out)


def batch_strides(batch: tuple, shape: tuple, strides: tuple) -> tuple:
    """Element strides of a tensor's batch modes ``shape``/``strides`` over the
    broadcast ``batch`` (right-aligned; 0 where the tensor broadcasts)."""
    pad = len(batch) - len(shape)
    res = []
    for i in range(len(batch)):
        j = i - pad
        if j < 0 or shape[j] == 1:
            res.append(0)
        else:
            res.append(strides[j])
    return tuple(res)


@dataclass(frozen=True)
class BatchPlan:
    """How a broadcast batch is launched.

    ``modes`` are the kernel batch modes (``max_modes`` of them), outermost
    first, padded with extent 1; ``outer`` are the modes looped over on the host.
    ``strides[name]`` is ``(outer_strides, kernel_strides)`` for each operand.
    """

    shape: tuple
    modes: tuple  # (n0, n1, n2)
    outer: tuple
    strides: dict

    @property
    def count(self) -> int:
        return math.prod(self.modes)

    def outer_offsets(self, name: str):
        """Element offsets of ``name`` for every host-loop iteration."""
        ostr = self.strides[name][0]
        for idx in itertools.product(*(range(n) for n in self.outer)):
            yield sum(i * s for i, s in zip(idx, ostr))


def plan_batch(batch: tuple, operand_strides: "dict[str, tuple]", max_modes: int = KERNEL_BATCH_MODES) -> BatchPlan:
    """Fold the broadcast ``batch`` into kernel modes.

    ``operand_strides[name]`` are that operand's strides over ``batch`` (from
    :func:`batch_strides`).  Modes of extent 1 are dropped; adjacent modes are
    merged when every operand walks them as one (stride_i == stride_j * n_j).
    """
    names = list(operand_strides)
    modes = [(n, [operand_strides[k][i] for k in names]) for i, n in enumerate(batch) if n != 1]
    merged = []
    for n, st in modes:
        if merged:
            pn, pst = merged[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    outer, inner = (merged[:-max_modes], merged[-max_modes:]) if len(merged) > max_modes else ([], merged)
    while len(inner) < max_modes:
        inner.insert(0, (1, [0] * len(names)))
    strides = {
        k: (tuple(st[i] for _, st in outer), tuple(st[i] for _, st in inner)) for i, k in enumerate(names)
    }
    plan = BatchPlan(
        shape=tuple(batch),
        modes=tuple(n for n, _ in inner),
        outer=tuple(n for n, _ in outer),
        strides=strides,
    )
    assert math.prod(plan.modes) * math.prod(plan.outer) == math.prod(batch)
    return plan
