"""The product formula's per-call shift on a GPU by the package's own kernels.

:func:`kermac_like.centring.shifted_pair` takes a dozen torch kernels (amax, amin, isfinite,
isinf, masked_fill, nanmedian, nan_to_num, sub, ...); on a GPU each of them loads its module from
torch's fatbinary on its first launch in a process, which made the warm first call of a
tensor-core distance ~150 ms on an H200 (bench/notes/jit.md, "The warm first call again"). For
a 2-D float32 pair on a GPU the same copies come from three launches of
``cuda_templates/centring.cuh`` (non-finite flags per row chunk, the reference point per
column, the shifted copies), whose module the kernel store finds beside the call's other
kernels (the install's bundle holds it: runtime/first_calls.json). The values are those of
``centring.shifted_pair`` bit for bit (a selection and one subtraction per coordinate;
tests/test_centring_kernels.py runs the kernels on the CPU). The setting centring_kernels off
(``KERMAC_LIKE_CENTRING_KERNELS=0``) keeps torch's steps.
"""

from __future__ import annotations

import numpy as np

import torch

from .. import centring, config
from ..runtime import launcher, store
from ..runtime.specs.centring import CENTRING_COLS, CENTRING_SAMPLE, CENTRING_WARPS, centring_specs
from .core import _device_index, _gpu_ok

__all__ = ["shifted_pair", "serves"]

_MIN_ROWS_PER_CHUNK = 64  # rows one block of the flags kernel scans at least
_MAX_CHUNKS = 512  # row chunks per operand (blocks along the rows)
_MAX_K = 1 << 20  # the flags kernel's grid.y: K / 32 blocks
_MAX_SHIFT_BLOCKS = 4096


def serves(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernels make the shifted copies of this pair: 2-D float32 operands of one
    GPU (sm_80+) with the same K, and the setting centring_kernels on."""
    return (x.dim() == 2 and y.dim() == 2 and x.dtype == torch.float32 and y.dtype == torch.float32
            and 0 < x.shape[-1] == y.shape[-1] <= _MAX_K and x.device == y.device and config.get("centring_kernels")
            and _gpu_ok(x))


def _on_device(x: torch.Tensor) -> bool:
    """Whether the kernels run (a CUDA tensor); a test of the GPU path's host work stands in for it."""
    return x.is_cuda


def _chunks(rows: int) -> tuple:
    """(rows per chunk, chunks) of one operand for the flags kernel."""
    if rows == 0:
        return 1, 0
    rpc = max(_MIN_ROWS_PER_CHUNK, -(-rows // _MAX_CHUNKS))
    return rpc, -(-rows // rpc)


def _step(rows: int) -> int:
    """The sample's row step: reference_point's ``p[::step]``."""
    return max(1, -(-rows // CENTRING_SAMPLE))


def shifted_pair(x: torch.Tensor, y: torch.Tensor, *, pad_to: int | None = None, debug: bool = False) -> tuple:
    """(x - s, y - s): ``centring.shifted_pair(x, y, pad_to=pad_to)[:2]`` (s the reference point of x
    and y; fresh row-major float32 copies zero-padded to ``pad_to`` columns; one copy when x and y
    are the same memory), by the centring kernels where :func:`serves`, else by torch's steps."""
    if not serves(x, y):
        return centring.shifted_pair(x, y, pad_to=pad_to)[:2]
    device = _device_index(x.device)
    specs = centring_specs()
    store.prefetch(specs, device, debug=debug)
    flags_k, point_k, shift_k = (store.get_kernel(s, device, debug=debug) for s in specs)
    if not _on_device(x):  # planned as on a GPU (tests, tests/first_calls.py): the kernels asked for, torch's values
        return centring.shifted_pair(x, y, pad_to=pad_to)[:2]
    K = x.shape[-1]
    Kp = pad_to or K
    same = centring.same_memory(x, y)
    y_rows = 0 if same else y.shape[0]
    x_rpc, x_chunks = _chunks(x.shape[0])
    y_rpc, y_chunks = _chunks(y_rows)
    chunks = x_chunks + y_chunks
    i32, i64 = np.int32, np.int64
    flags = torch.empty(max(chunks * K, 1), dtype=torch.int32, device=x.device)
    s = torch.empty(K, dtype=torch.float32, device=x.device)
    xs = torch.empty((x.shape[0], Kp), dtype=torch.float32, device=x.device)
    ys = xs if same else torch.empty((y_rows, Kp), dtype=torch.float32, device=x.device)
    yp = 0 if same else y.data_ptr()
    x_view = (x.data_ptr(), i64(x.shape[0]), i64(x.stride(0)), i64(x.stride(1)))
    y_view = (yp, i64(y_rows), i64(y.stride(0)), i64(y.stride(1)))
    if chunks:
        launcher.launch(flags_k, (chunks, -(-K // CENTRING_COLS), 1),
                        (*x_view, i64(x_rpc), i32(x_chunks), *y_view, i64(y_rpc), i32(K), flags.data_ptr()), debug=debug)
    launcher.launch(point_k, (K, 1, 1), (*x_view, i64(_step(x.shape[0])), *y_view, i64(_step(y_rows)), i32(K),
                                         flags.data_ptr(), i32(chunks), s.data_ptr()), debug=debug)
    rows = x.shape[0] + y_rows
    if rows:
        blocks = min(-(-rows // CENTRING_WARPS), _MAX_SHIFT_BLOCKS)
        launcher.launch(shift_k, (blocks, 1, 1), (*x_view, xs.data_ptr(), *y_view, 0 if same else ys.data_ptr(),
                                                  i32(K), i32(Kp), s.data_ptr()), debug=debug)
    return xs, ys
