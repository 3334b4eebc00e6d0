"""The loader: a cubin found by the kernel store -> a ``cuda.core`` kernel on one device.

One module per (device, cubin) per process; a kernel whose launch asks for more shared
memory than the static 48 KiB gets its dynamic shared-memory limit raised once, here. The
store (:mod:`.store`) decides where a cubin comes from and keeps what is loaded; the
launcher launches it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .specs import KernelSpec

__all__ = ["LoadedKernel", "load", "core", "make_current", "clear"]

_STATIC_SMEM_LIMIT = 48 * 1024


def core():
    """``cuda.core`` (its experimental namespace before cuda-core 0.4)."""
    try:
        import cuda.core as c

        c.LaunchConfig  # noqa: B018  (cuda-core >= 0.4 exports at top level)
    except (ImportError, AttributeError):
        import cuda.core.experimental as c  # type: ignore
    return c


@dataclass(frozen=True)
class LoadedKernel:
    spec: KernelSpec
    device: int
    function: object  # cuda.core Kernel
    key: str
    source: str  # "cache" | "bundle" (prebuilt) | "compiled"


_modules: dict = {}  # (device, module sha256) -> cuda.core ObjectCode
_current = threading.local()


def make_current(device: int) -> None:
    """Make ``device``'s primary context current in this thread (once per thread and device)."""
    done = getattr(_current, "devices", None)
    if done is None:
        done = _current.devices = set()
    if device not in done:
        core().Device(device).set_current()
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


def load(spec: KernelSpec, device: int, found: tuple, key: str, source: str) -> LoadedKernel:
    """``spec``'s kernel on ``device`` from ``found`` = (cubin, lowered name, module sha256).
    The caller serialises loads (the store's lock)."""
    cubin, lowered, module_sha = found
    make_current(device)
    module = _modules.get((device, module_sha))
    if module is None:
        module = _modules[(device, module_sha)] = core().ObjectCode.from_cubin(cubin)
    fn = module.get_kernel(lowered)
    if spec.launch.smem_bytes > _STATIC_SMEM_LIMIT:
        _set_dynamic_smem(fn, device, spec.launch.smem_bytes)
    return LoadedKernel(spec, device, fn, key, source)


def clear() -> None:
    """Forget the loaded modules (the store forgets its kernels with them)."""
    _modules.clear()
