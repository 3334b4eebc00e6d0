"""The launcher: launch a loaded kernel on torch's current stream.

Kernels come from the kernel store (:mod:`.store`: lookup, compile, load); launches go
through ``cuda.core`` on ``torch.cuda.current_stream()``, and nothing here synchronises the
host.

A launch that repeats (a plan template's, :mod:`kermac_like.plan`) can carry an
:class:`ArgBlock`: its arguments packed once into 8-byte slots, its launch
configuration built once; a call patches the pointer slots and calls the driver
(``cuLaunchKernel``, ``cuLaunchKernelEx`` for clusters) directly, which saves the
per-call argument conversion and configuration of ``cuda.core``'s launch
(bench/notes/ops.md).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading

import numpy as np

import torch

from .loader import LoadedKernel, core as _core, make_current as _make_current

log = logging.getLogger("kermac_like.launcher")

__all__ = ["launch", "max_active_clusters", "ArgBlock"]

_streams: dict = {}  # (device, stream handle) -> cuda.core Stream


def _stream_for(device: int):
    ts = torch.cuda.current_stream(device)
    handle = ts.cuda_stream
    s = _streams.get((device, handle))
    if s is None:
        core = _core()
        if hasattr(core.Stream, "from_handle"):
            s = core.Stream.from_handle(handle)
        else:  # cuda-core < 0.4: wrap through the __cuda_stream__ protocol
            class _Proto:
                def __cuda_stream__(self, _h=handle):
                    return (0, _h)

            s = core.Device(device).create_stream(_Proto())
        if len(_streams) > 256:
            _streams.clear()
        _streams[(device, handle)] = s
    return s


def _config(shape, grid: tuple):
    core = _core()
    if shape.cluster > 1:  # grid counts clusters
        return core.LaunchConfig(grid=grid, cluster=(shape.cluster, 1, 1), block=(shape.threads, 1, 1),
                                 shmem_size=shape.smem_bytes)
    return core.LaunchConfig(grid=grid, block=(shape.threads, 1, 1), shmem_size=shape.smem_bytes)


_max_clusters: dict = {}


def max_active_clusters(kernel: LoadedKernel) -> int:
    """How many clusters of ``kernel`` run at once on its device (a persistent grid of
    clusters must not exceed it: the excess would wait for a second wave)."""
    key = (kernel.device, kernel.spec)
    n = _max_clusters.get(key)
    if n is None:
        _make_current(kernel.device)
        n = int(kernel.function.occupancy.max_active_clusters(_config(kernel.spec.launch, (1, 1, 1)),
                                                               stream=_stream_for(kernel.device)))
        if n < 1:
            raise RuntimeError(f"{kernel.spec.name_expression}: no cluster of {kernel.spec.launch.cluster} CTAs fits "
                               f"cuda:{kernel.device}")
        _max_clusters[key] = n
    return n


# Slot formats of the argument types the templates pass (numpy scalars of the C++ types,
# Python ints for pointers); anything else is left to cuda.core.
_SLOT_FORMATS = {np.int32: "<i", np.uint32: "<I", np.int64: "<q", np.uint64: "<Q", np.float32: "<f",
                 np.float64: "<d"}
_POINTER = struct.Struct("<Q")


def _slot_format(v):
    f = _SLOT_FORMATS.get(type(v))
    if f is not None:
        return f
    if type(v) is int:  # a pointer (or a null pointer)
        return "<Q" if v >= 0 else None
    return None


class ArgBlock:
    """The arguments of one repeated launch, packed once.

    Every argument takes one 8-byte slot of ``slots`` (a value narrower than 8 bytes at
    the slot's start: the driver reads each parameter from its own address with its
    declared size) and ``params[i]`` points at slot i: the ``void **kernelParams`` of
    ``cuLaunchKernel``. ``positions`` are the pointer arguments a call fills in. The
    slots are shared by every plan instantiated from the template, so a call patches
    and launches under the block's lock (the driver copies the parameters at launch).
    """

    __slots__ = ("kernel", "grid", "positions", "slots", "params", "_params_addr", "_fn", "_config", "_lock", "_driver",
                 "_dims")

    def __init__(self, kernel: LoadedKernel, grid: tuple, args: tuple, positions: tuple):
        n = max(len(args), 1)
        self.kernel, self.grid, self.positions = kernel, tuple(grid), tuple(positions)
        self.slots = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self.slots)
        self.params = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
        self._params_addr = ctypes.addressof(self.params)
        for i, v in enumerate(args):
            if i not in self.positions:
                struct.pack_into(_slot_format(v), self.slots, 8 * i, v)
        self._fn = None
        self._config = None
        self._driver = None  # cuda.bindings.driver, bound by _prepare
        self._lock = threading.Lock()
        shape = kernel.spec.launch
        g = self.grid + (1,) * (3 - len(self.grid))
        self._dims = (g[0] * shape.cluster, g[1], g[2], shape.threads, 1, 1, shape.smem_bytes)

    @staticmethod
    def supports(args: tuple, positions: tuple) -> bool:
        """Whether every argument has a slot format (else the launch goes through cuda.core)."""
        return all(i in positions or _slot_format(v) is not None for i, v in enumerate(args))

    def _prepare(self):
        from cuda.bindings import driver

        self._driver = driver
        handle = self.kernel.function.handle
        self._fn = int(handle)
        shape = self.kernel.spec.launch
        if shape.cluster > 1:
            cfg = driver.CUlaunchConfig()
            gx, gy, gz, bx, by, bz, smem = self._dims
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
            cfg.sharedMemBytes = smem
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = shape.cluster, 1, 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            self._config = cfg

    def fill(self, args) -> None:
        """Write the pointer arguments of ``args`` (the launch's arguments, in ABI order) into
        their slots."""
        for i in self.positions:
            _POINTER.pack_into(self.slots, 8 * i, args[i])

    def launch(self, args) -> None:
        """Fill in the pointer arguments of ``args`` (the launch's arguments) and launch on
        the current torch stream of the kernel's device."""
        device = self.kernel.device
        if torch.cuda.current_device() != device:
            with torch.cuda.device(device):
                return self.launch(args)
        _make_current(device)
        stream = _raw_stream(device)
        with self._lock:
            if self._fn is None:
                self._prepare()
            self.fill(args)
            driver = self._driver
            if self._config is not None:
                self._config.hStream = stream
                (err,) = driver.cuLaunchKernelEx(self._config, self._fn, self._params_addr, 0)
            else:
                (err,) = driver.cuLaunchKernel(self._fn, *self._dims, stream, self._params_addr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"launch of {self.kernel.spec.name_expression} failed: {err}")


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds


def _raw_stream(device: int) -> int:
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(device)
    return torch.cuda.current_stream(device).cuda_stream


def launch(kernel: LoadedKernel, grid: tuple, args: tuple, *, debug: bool = False, block: ArgBlock | None = None) -> None:
    """Launch on the current torch stream of the kernel's device (asynchronous). For a
    clustered kernel (``spec.launch.cluster > 1``) ``grid`` counts clusters. ``block``:
    the launch's :class:`ArgBlock` (same kernel and grid), which takes the pointers from
    ``args`` and launches through the driver."""
    if block is not None and not debug:
        return block.launch(args)
    device = kernel.device
    if torch.cuda.current_device() != device:
        with torch.cuda.device(device):
            return launch(kernel, grid, args, debug=debug)
    _make_current(device)
    shape = kernel.spec.launch
    smem = shape.smem_bytes
    cfg = _config(shape, grid)
    stream = _stream_for(device)
    if debug:
        log.debug(
            "launch %s grid=%s%s block=(%d,1,1) smem=%d stream=0x%x",
            kernel.spec.name_expression, grid, f" clusters of {shape.cluster}" if shape.cluster > 1 else "",
            shape.threads, smem, torch.cuda.current_stream(device).cuda_stream,
        )
    _core().launch(stream, cfg, kernel.function, *args)
