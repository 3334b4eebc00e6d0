"""The launcher: get a kernel function for a device and launch it on torch's stream.

Lookup order for a :class:`~kermac_like.runtime.specs.KernelSpec` on a device:
in-process dict -> persistent cache (SQLite) -> compile (NVRTC) and store.
One loaded module per (device, cubin) per process.  Launches go through
``cuda.core`` on ``torch.cuda.current_stream()``; nothing here synchronises
the host, and a hit in the in-process dict does no I/O.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import torch

from .compiler import KernelSpec, arch_of_device, compile_specs, kernel_key

log = logging.getLogger("kermac_like.launcher")

__all__ = ["LoadedKernel", "get_kernel", "launch", "clear_loaded", "max_active_clusters"]

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
    source: str  # "memory" | "cache" | "compiled"


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


def get_kernel(spec: KernelSpec, device: int, *, debug: bool = False) -> LoadedKernel:
    """The loaded function of ``spec`` on CUDA device ``device``."""
    hit = _functions.get((device, spec))
    if hit is not None:
        return hit
    with _lock:
        hit = _functions.get((device, spec))
        if hit is not None:
            return hit
        from .cache.warm import read_kernel

        t0 = time.perf_counter()
        arch = arch_of_device(device)
        key = kernel_key(spec, arch)
        source = "cache"
        found = read_kernel(key)  # warm start without SQLAlchemy
        if found is None:
            from .cache import get_cache

            cache = get_cache()
            entry = cache.get(key)
            if entry is None:
                source = "compiled"
                record, _ = compile_specs([spec], arch, debug=debug)
                cache.put(record)
                found = (record.cubin, record.kernels[0][2], hashlib.sha256(record.cubin).hexdigest())
            else:
                found = (entry.cubin, entry.lowered_name, entry.module_sha256)
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
                spec.name_expression, device, arch, "cache hit" if source == "cache" else "cache miss, compiled",
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


def launch(kernel: LoadedKernel, grid: tuple, args: tuple, *, debug: bool = False) -> None:
    """Launch on the current torch stream of the kernel's device (asynchronous). For a
    clustered kernel (``spec.launch.cluster > 1``) ``grid`` counts clusters."""
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
