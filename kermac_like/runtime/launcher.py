"""The launcher: get a kernel function for a device and launch it on torch's stream.

Lookup order for a :class:`~kermac_like.runtime.specs.KernelSpec` on a device:
in-process dict -> persistent cache (SQLite) -> compile (NVRTC) and store.
One loaded module per (device, cubin) per process.  Launches go through
``cuda.core`` on ``torch.cuda.current_stream()``; nothing here synchronises
the host, and a hit in the in-process dict does no I/O.

A launch that repeats (a plan template's, :mod:`kermac_like.plan`) can carry an
:class:`ArgBlock`: its arguments packed once into 8-byte slots, its launch
configuration built once; a call patches the pointer slots and calls the driver
(``cuLaunchKernel``, ``cuLaunchKernelEx`` for clusters) directly, which saves the
per-call argument conversion and configuration of ``cuda.core``'s launch
(bench/notes/ops.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

import torch

from .. import config
from . import cache as kernel_cache
from .cache.warm import open_reader, read_bundled, read_kernel, read_kernel_status
from .compiler import KernelSpec, arch_of_device, compile_specs, kernel_key, nvrtc_version, template_hash

log = logging.getLogger("kermac_like.launcher")

__all__ = ["LoadedKernel", "get_kernel", "prefetch", "available", "wait_pending", "launch", "clear_loaded", "max_active_clusters", "ArgBlock",
           "prepare_in_background"]

_STATIC_SMEM_LIMIT = 48 * 1024


def _core():
    try:
        import cuda.core as core

        core.LaunchConfig  # noqa: B018  (cuda-core >= 0.4 exports at top level)
    except (ImportError, AttributeError):
        import cuda.core.experimental as core  # type: ignore
    return core


@dataclass(frozen=True)
class LoadedKernel:
    spec: KernelSpec
    device: int
    function: object  # cuda.core Kernel
    key: str
    source: str  # "cache" | "bundle" (prebuilt) | "compiled"


_lock = threading.Lock()
_functions: dict = {}  # (device, spec) -> LoadedKernel
_modules: dict = {}  # (device, module sha256) -> cuda.core ObjectCode
_streams: dict = {}  # (device, stream handle) -> cuda.core Stream
_current = threading.local()


def clear_loaded() -> None:
    """Forget loaded functions (tests use it to force a cache round trip)."""
    with _lock:
        _functions.clear()
        _modules.clear()


def _make_current(device: int) -> None:
    done = getattr(_current, "devices", None)
    if done is None:
        done = _current.devices = set()
    if device not in done:
        _core().Device(device).set_current()
        done.add(device)


def _set_dynamic_smem(fn, device: int, nbytes: int) -> None:
    from cuda.bindings import driver

    handle = fn.handle
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):
        err, dev = driver.cuDeviceGet(device)
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, dev)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if int(err) != 0:
        raise RuntimeError(f"could not raise the dynamic shared memory limit to {nbytes} bytes: {err}")


def _open_cache_in_background():
    """Open the full cache (SQLAlchemy's import and engine: ~0.1-0.2 s) in a thread while
    NVRTC runs in this one (NVRTC releases the GIL); returns a callable giving the cache."""
    box = {}

    def run():
        try:
            box["cache"] = kernel_cache.get_cache()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="kermac_like-cache-open", daemon=True)
    t.start()

    def result():
        t.join()
        if "error" in box:
            raise box["error"]
        return box["cache"]

    return result


def prepare_in_background() -> threading.Thread | None:
    """Start a daemon thread that does, once per process, what a warm first call otherwise does
    itself before its lookup: the kernel keys' process-wide inputs (compiler.template_hash:
    the templates read and hashed; compiler.nvrtc_version: the NVRTC wheel's metadata) and
    the warm reader's connection to the cache file with its schema stamp read (cache.warm's
    open_reader). ``import kermac_like`` starts it where cuda.core is installed, so that these
    ~3-5 ms overlap what a program does between the import and its first call (creating its
    CUDA tensors: the CUDA context alone takes far longer); a first call that comes earlier
    computes or waits for the same memoised values (bench/notes/jit.md). Best effort: any
    failure leaves the first call to do the work as before. KERMAC_LIKE_PREPARE=0 turns it off."""
    if not config.get("prepare"):
        return None

    def run():
        try:
            template_hash()
            nvrtc_version()
            open_reader()
        except Exception:  # noqa: BLE001 (best effort: the first call does it itself)
            pass

    global prepare_thread
    t = prepare_thread = threading.Thread(target=run, name="kermac_like-prepare", daemon=True)
    t.start()
    return t


prepare_thread = None  # the thread prepare_in_background started (tests join it)


def _find(key: str) -> tuple:
    """(((cubin, lowered name, module sha256), source), absent) of ``key`` from the user's
    cache (SQLAlchemy-free read) or a bundle of prebuilt kernels; (None, absent) when
    neither has it, ``absent`` as from warm.read_kernel_status."""
    found, absent = read_kernel_status(key)  # warm start without SQLAlchemy
    if found is not None:
        return (found, "cache"), False
    found = read_bundled(key)
    if found is not None:
        return (found, "bundle"), False
    return None, absent


def _find_or_compile(spec: KernelSpec, arch: str, key: str, debug: bool, looked: tuple | None = None) -> tuple:
    """((cubin, lowered name, module sha256), source) of ``spec``: the user's cache
    (SQLAlchemy-free read), a bundle of prebuilt kernels, else NVRTC (stored in the
    cache). Needs no GPU and no lock: prefetch runs it in worker threads. ``looked``:
    :func:`_find`'s answer when the caller already asked."""
    hit, absent = looked if looked is not None else _find(key)
    if hit is not None:
        return hit
    # (another thread may be importing the store module: read its cache through getattr)
    store = sys.modules.get(__package__ + ".cache.store")
    singleton = getattr(store, "_singleton", None)
    if absent and singleton is not None and singleton[1].in_memory:
        absent = False  # no usable file: this process's in-memory cache may hold it
    if absent:  # the cache file has no such row (or no file yet): compile while the cache opens
        cache_of = _open_cache_in_background()
        record, _ = compile_specs([spec], arch, debug=debug)
        cache_of().put(record)
        return (record.cubin, record.kernels[0][2], hashlib.sha256(record.cubin).hexdigest()), "compiled"
    cache = kernel_cache.get_cache()  # the full cache decides what the warm read doubted
    entry = cache.get(key)
    if entry is not None:
        return (entry.cubin, entry.lowered_name, entry.module_sha256), "cache"
    record, _ = compile_specs([spec], arch, debug=debug)
    cache.put(record)
    return (record.cubin, record.kernels[0][2], hashlib.sha256(record.cubin).hexdigest()), "compiled"


# Kernels being found or compiled in worker threads (prefetch): (arch, spec) -> Future.
_pending: dict = {}
_pool = None


def _futures():
    import concurrent.futures

    return concurrent.futures


def _workers():
    global _pool
    if _pool is None:
        _pool = _futures().ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                      thread_name_prefix="kermac_like-compile")
    return _pool


def prefetch(specs, device: int, *, debug: bool = False) -> None:
    """Start finding or compiling ``specs`` for ``device`` in worker threads, so that the
    several kernels of one call compile side by side (NVRTC runs without the GIL, one
    program per thread); :func:`get_kernel` then waits for its own. A spec already
    loaded, or already on its way, is skipped. The cache and bundles are read here first:
    a warm start finds its kernels in well under a millisecond, less than a worker
    thread's start."""
    arch = None
    for spec in dict.fromkeys(specs):
        if (device, spec) in _functions:
            continue
        if arch is None:
            arch = arch_of_device(device)
        if (arch, spec) in _pending or not spec.supports(arch):
            continue
        key = kernel_key(spec, arch)
        looked = _find(key)
        with _lock:
            if (device, spec) in _functions or (arch, spec) in _pending:
                continue
            if looked[0] is not None:
                _pending[(arch, spec)] = done = _futures().Future()
                done.set_result(looked[0])
            else:
                _pending[(arch, spec)] = _workers().submit(_find_or_compile, spec, arch, key, debug, looked)


def wait_pending() -> int:
    """Wait for every kernel being found or compiled in a worker thread; returns how many
    there were (benchmarks call it before timing, tests before comparing kernels)."""
    with _lock:
        pending = list(_pending.values())
    for f in pending:
        f.exception()  # waits; a failure surfaces in the get_kernel that needs the kernel
    return len(pending)


def available(spec: KernelSpec, device: int) -> bool:
    """Whether :func:`get_kernel` would return ``spec`` without compiling: loaded, found by
    a finished prefetch, in the user's cache or in a bundle (reads the cache: for plans,
    not for every call)."""
    if (device, spec) in _functions:
        return True
    arch = arch_of_device(device)
    pending = _pending.get((arch, spec))
    if pending is not None:
        return pending.done()
    key = kernel_key(spec, arch)
    return read_kernel(key) is not None or read_bundled(key) is not None


def get_kernel(spec: KernelSpec, device: int, *, debug: bool = False) -> LoadedKernel:
    """The loaded function of ``spec`` on CUDA device ``device``."""
    hit = _functions.get((device, spec))
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    arch = arch_of_device(device)
    key = kernel_key(spec, arch)
    mine = None
    with _lock:
        hit = _functions.get((device, spec))
        if hit is not None:
            return hit
        pending = _pending.get((arch, spec))
        if pending is None:  # this thread finds or compiles it; others asking meanwhile wait
            pending = mine = _pending[(arch, spec)] = _futures().Future()
    # Outside the lock: other kernels load meanwhile.
    try:
        if mine is not None:
            try:
                mine.set_result(_find_or_compile(spec, arch, key, debug))
            except BaseException as e:
                mine.set_exception(e)
        found, source = pending.result()
    finally:
        with _lock:
            if _pending.get((arch, spec)) is pending:
                del _pending[(arch, spec)]
    with _lock:
        hit = _functions.get((device, spec))
        if hit is not None:
            return hit
        cubin, lowered, module_sha = found
        _make_current(device)
        core = _core()
        module = _modules.get((device, module_sha))
        if module is None:
            module = core.ObjectCode.from_cubin(cubin)
            _modules[(device, module_sha)] = module
        fn = module.get_kernel(lowered)
        if spec.launch.smem_bytes > _STATIC_SMEM_LIMIT:
            _set_dynamic_smem(fn, device, spec.launch.smem_bytes)
        loaded = LoadedKernel(spec, device, fn, key, source)
        _functions[(device, spec)] = loaded
        if debug:
            log.debug(
                "kernel %s on cuda:%d (%s): %s in %.1f ms",
                spec.name_expression, device, arch,
                {"cache": "cache hit", "bundle": "prebuilt bundle"}.get(source, "cache miss, compiled"),
                (time.perf_counter() - t0) * 1e3,
            )
        return loaded


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

    def fill(self, pointers) -> None:
        """Write the pointer arguments (in ``positions`` order) into their slots."""
        for i, p in zip(self.positions, pointers):
            _POINTER.pack_into(self.slots, 8 * i, p)

    def launch(self, pointers) -> None:
        """Fill in the pointer arguments (in ``positions`` order) and launch on the
        current torch stream of the kernel's device."""
        device = self.kernel.device
        if torch.cuda.current_device() != device:
            with torch.cuda.device(device):
                return self.launch(pointers)
        _make_current(device)
        stream = _raw_stream(device)
        with self._lock:
            if self._fn is None:
                self._prepare()
            self.fill(pointers)
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
        return block.launch([args[i] for i in block.positions])
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
