"""The training rows of one rank as a sequence of row chunks on the compute device.

The Nyström (Falkon) solver touches the data only through passes over its rows: each
pass takes one chunk at a time, computes ``K(chunk, Z) v`` and ``K(Z, chunk) t`` and adds
an (m, C) block. :class:`RowSource` hands out those chunks, in row order, from one of
three places:

* ``memory``: X and y already on the compute device; chunks are views, sized so that the
  pass's temporaries stay below ``WORK_BYTES`` (7.5e6 rows a chunk at C = 1).
* ``resident`` (a prefix of the rows copied to the device once) followed by
* ``stream``: the rest, copied per pass through two device buffers (double buffering).
  On CUDA the copies run on their own stream from two pinned host buffers, which a helper
  thread fills from X and y (pageable host memory, numpy) while the GPU computes; the
  compute stream waits for a chunk's copy with an event, and the copy into a buffer waits
  for the compute that last read it. On a CPU device the same plan (chunk sizes from the
  byte budget, chunk order, the two buffers) runs with plain copies: the chunking is
  tested without a GPU.

Chunks come in the same row order whatever the plan, and the passes accumulate their
(m, C) blocks in float64 in that order: a streamed fit equals the in-memory fit up to
the rounding of those float64 sums.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("kermac_like.solvers")

__all__ = ["RowSource", "HostMemoryError", "WORK_BYTES", "SLOT_BYTES", "plan_rows"]

# Device temporaries of one pass over one chunk: at most this many bytes (with MATVEC_ROW_BYTES:
# 7.5e6 rows at C = 1; 0.54 GB beside the preconditioner's 8 m^2 at m = 20 000).
WORK_BYTES = 1 << 29
# Per chunk row, what the two kernel_matvec products of a pass allocate beside our (rows, C) vector:
# measured, not derived (one H200, D = 8, C = 1, float32 data, float64 vectors: the peak of a pass
# above the preconditioner was 72 bytes a chunk row, 0.72 GB for a 10^7-row chunk); its source
# inside kernel_matvec is not identified.
MATVEC_ROW_BYTES = 64
# Largest stream buffer (data bytes of one chunk): larger chunks do not copy faster.
SLOT_BYTES = 1 << 30
TEMP_VECTORS = 1  # (rows, C) float64 temporaries of a pass a chunk row (K_cZ v, y_c - K_cZ v in place)


class HostMemoryError(MemoryError):
    """Not enough host memory for the pinned chunk buffers of a streamed fit."""


def _row_bytes(x: torch.Tensor, y: torch.Tensor | None) -> int:
    b = x.shape[1] * x.element_size()
    if y is not None:
        b += y.shape[1] * y.element_size()
    return b


def plan_rows(n: int, row_bytes: int, work_row_bytes: int, budget: int | None, on_device: bool):
    """(resident rows, chunk rows of the resident part, stream chunk rows) for n rows.

    ``budget``: the bytes this source may hold on the compute device (None: no limit).
    Data already on the device without a budget: everything resident (views), chunks of
    WORK_BYTES of temporaries. Otherwise: everything resident if it fits the budget with its
    temporaries, else two stream buffers (each at most SLOT_BYTES, at most a quarter of the
    budget) and as many leading rows resident as the rest of the budget holds."""
    work_rows = max(1, WORK_BYTES // max(1, work_row_bytes))
    if budget is None and on_device:
        return n, min(max(n, 1), work_rows), 0
    if budget is None:
        budget = 1 << 62
    work_rows = max(1, min(work_rows, budget // 4 // max(1, work_row_bytes)))
    if n * row_bytes + min(n, work_rows) * work_row_bytes <= budget:
        return n, min(max(n, 1), work_rows), 0
    slot_rows = min(n, SLOT_BYTES // row_bytes, budget // 4 // (2 * row_bytes + work_row_bytes))
    if slot_rows < 1:
        raise ValueError(f"max_gpu_bytes: {budget} bytes left for the data cannot hold two buffers of one "
                         f"row ({row_bytes} bytes a row)")
    left = budget - slot_rows * (2 * row_bytes + work_row_bytes)
    resident = max(0, min(n, left // row_bytes))
    return resident, min(work_rows, max(resident, 1)), slot_rows


class RowSource:
    """This rank's rows (x (n, D), y (n, C) or None) as chunks on ``device``.

    ``budget``: bytes of the compute device this source may use (data kept there, buffers and
    the temporaries of a pass), None for no limit. ``chunks()`` yields (start, x_chunk,
    y_chunk or None) in row order; a yielded chunk is valid until the next one is asked for.
    ``allocate()`` makes the buffers (raising :class:`HostMemoryError` when the pinned host
    buffers cannot be had): call it where its failure can be agreed on by every rank.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None, device, *, budget: int | None = None,
                 c: int = 1):
        self.x, self.y = x, y
        self.device = torch.device(device)
        self.n = int(x.shape[0])
        self.row_bytes = _row_bytes(x, y)
        self.work_row_bytes = TEMP_VECTORS * 8 * max(1, c) + MATVEC_ROW_BYTES
        on_device = x.device == self.device and (y is None or y.device == self.device)
        self.n_res, self.work_rows, self.slot_rows = plan_rows(self.n, self.row_bytes, self.work_row_bytes,
                                                               budget, on_device)
        self.cuda = self.device.type == "cuda"
        self.streams = self.n_res < self.n
        self._allocated = False

    @property
    def mode(self) -> str:
        if not self.streams:
            return "memory"
        return "stream" if self.n_res == 0 else "resident+stream"

    def host_bytes(self) -> int:
        """Pinned host bytes of the two staging buffers (CUDA streaming from pageable memory)."""
        if not (self.streams and self.cuda) or self._direct():
            return 0
        return 2 * self.slot_rows * self.row_bytes

    def device_bytes(self) -> int:
        """Device bytes the source holds: resident rows and the two stream buffers."""
        data = self.n_res * self.row_bytes if (self.x.device != self.device or self.streams) else 0
        return data + (2 * self.slot_rows * self.row_bytes if self.streams else 0)

    def _direct(self) -> bool:
        """Host data already in pinned memory: copied to the device without staging."""
        try:
            return self.x.is_pinned() and (self.y is None or self.y.is_pinned())
        except RuntimeError:
            return False

    # -- buffers ---------------------------------------------------------------------------------
    def allocate(self):
        if self._allocated:
            return
        x, y, dev = self.x, self.y, self.device
        if not self.streams:
            self.xr = x if x.device == dev else x.to(dev)
            self.yr = None if y is None else (y if y.device == dev else y.to(dev))
        else:
            r = self.n_res
            self.xr = x[:r].to(dev, copy=True) if r else None
            self.yr = None if (y is None or not r) else y[:r].to(dev, copy=True)
            s = self.slot_rows
            self.dx = [torch.empty((s, x.shape[1]), dtype=x.dtype, device=dev) for _ in range(2)]
            self.dy = None if y is None else [torch.empty((s, y.shape[1]), dtype=y.dtype, device=dev)
                                              for _ in range(2)]
            if self.cuda:
                self._allocate_cuda()
        self._allocated = True

    def _allocate_cuda(self):
        x, y = self.x, self.y
        self.copy_stream = torch.cuda.Stream(self.device)
        self.h2d_done = [torch.cuda.Event() for _ in range(2)]
        self.used = [torch.cuda.Event() for _ in range(2)]
        self.px = self.py = None
        if self._direct():
            return
        s = self.slot_rows
        try:
            self.px = [torch.empty((s, x.shape[1]), dtype=x.dtype, pin_memory=True) for _ in range(2)]
            self.py = None if y is None else [torch.empty((s, y.shape[1]), dtype=y.dtype, pin_memory=True)
                                              for _ in range(2)]
        except (RuntimeError, MemoryError) as e:
            raise HostMemoryError(f"not enough host memory for the chunk buffers: 2 x {s} rows of pinned "
                                  f"memory ({self.host_bytes() / 2**30:.2f} GiB) could not be allocated ({e})") from None

    def release(self):
        for name in ("xr", "yr", "dx", "dy", "px", "py"):
            self.__dict__.pop(name, None)
        self._allocated = False

    # -- the chunks ----------------------------------------------------------------------------
    def chunks(self):
        self.allocate()
        for s in range(0, self.n_res, self.work_rows):
            e = min(s + self.work_rows, self.n_res)
            yield s, self.xr[s:e], None if self.yr is None else self.yr[s:e]
        if self.streams:
            yield from (self._stream_cuda() if self.cuda else self._stream_plain())

    def starts(self):
        return list(range(self.n_res, self.n, self.slot_rows))

    def _stream_plain(self):
        """Chunks through the two buffers with plain copies (a CPU device)."""
        for i, s in enumerate(self.starts()):
            e = min(s + self.slot_rows, self.n)
            k = i % 2
            bx = self.dx[k][:e - s]
            bx.copy_(self.x[s:e])
            by = None
            if self.y is not None:
                by = self.dy[k][:e - s]
                by.copy_(self.y[s:e])
            yield s, bx, by

    def _stream_cuda(self):
        """Chunks through two device buffers: pinned staging on a helper thread, host-to-device
        copies on the copy stream, events between the copy and the compute streams."""
        starts = self.starts()
        compute = torch.cuda.current_stream(self.device)
        copy = self.copy_stream
        direct = self.px is None

        def bounds(i):
            s = starts[i]
            return s, min(s + self.slot_rows, self.n)

        def stage(i):  # host: pinned slot i % 2 <- rows of chunk i (after its previous copy is done)
            s, e = bounds(i)
            k = i % 2
            self.h2d_done[k].synchronize()
            self.px[k][:e - s].copy_(self.x[s:e])
            if self.y is not None:
                self.py[k][:e - s].copy_(self.y[s:e])

        pool = None if direct else ThreadPoolExecutor(1, thread_name_prefix="kermac_like-stage")
        fut = None if direct else pool.submit(stage, 0)
        try:
            for i in range(len(starts)):
                s, e = bounds(i)
                k = i % 2
                if fut is not None:
                    fut.result()
                src_x = self.x[s:e] if direct else self.px[k][:e - s]
                src_y = None if self.y is None else (self.y[s:e] if direct else self.py[k][:e - s])
                with torch.cuda.stream(copy):
                    copy.wait_event(self.used[k])  # the compute that last read device slot k is done
                    self.dx[k][:e - s].copy_(src_x, non_blocking=True)
                    if src_y is not None:
                        self.dy[k][:e - s].copy_(src_y, non_blocking=True)
                    self.h2d_done[k].record(copy)
                if not direct and i + 1 < len(starts):
                    fut = pool.submit(stage, i + 1)  # overlaps the copy above and the compute below
                else:
                    fut = None
                compute.wait_event(self.h2d_done[k])
                yield s, self.dx[k][:e - s], None if self.y is None else self.dy[k][:e - s]
                self.used[k].record(compute)
        finally:
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001  (the pass that failed reports its own error)
                    pass
            if pool is not None:
                pool.shutdown(wait=True)
