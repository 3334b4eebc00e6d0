"""The kernel store: the one place that answers "the loaded kernel of this spec on this device".

Lookup order for a :class:`~kermac_like.runtime.specs.KernelSpec` on a device:

1. the process cache (a dict: a hit does no I/O and takes no lock);
2. the warm reader of the user's kernel cache (:mod:`.cache.warm`: sqlite3, no SQLAlchemy);
3. the bundles of prebuilt kernels (``$KERMAC_LIKE_BUNDLE``'s folders, then the package's);
4. the full SQLite cache (:mod:`.cache.store`), where the warm read had a doubt;
5. NVRTC (:mod:`.compiler`), the cubin stored in the cache.

Steps 2-5 give a cubin, which :mod:`.loader` loads once per device. The same order runs in
worker threads for :func:`prefetch` (the several kernels of one call compile side by side;
NVRTC releases the GIL) and :func:`wait_pending` waits for them. :func:`prepare_in_background`
does the warm lookup's once-per-process work while the program starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time

from .. import config
from . import cache as kernel_cache, loader
from .cache.warm import open_reader, read_bundled, read_kernel_status
from .compiler import KernelSpec, arch_of_device, compile_specs, kernel_key, nvrtc_version, template_hash
from .loader import LoadedKernel

log = logging.getLogger("kermac_like.store")

__all__ = ["get_kernel", "prefetch", "available", "wait_pending", "clear_loaded", "prepare_in_background"]

_lock = threading.Lock()
_loaded: dict = {}  # (device, spec) -> LoadedKernel: the process cache
# Kernels being found or compiled, by this thread or a worker (prefetch): (arch, spec) -> Future.
_pending: dict = {}
_pool = None


def clear_loaded() -> None:
    """Forget loaded kernels and modules (tests use it to force a cache round trip)."""
    with _lock:
        _loaded.clear()
        loader.clear()


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


def _open_cache_in_background():
    """Open the full cache (SQLAlchemy's import and engine: ~0.1-0.2 s) in a thread while
    NVRTC runs in this one (NVRTC releases the GIL); returns a callable giving the cache."""
    opened = _futures().Future()

    def run():
        try:
            opened.set_result(kernel_cache.get_cache())
        except BaseException as e:  # re-raised in the caller's thread
            opened.set_exception(e)

    threading.Thread(target=run, name="kermac_like-cache-open", daemon=True).start()
    return opened.result


def _find(key: str) -> tuple:
    """Steps 2 and 3: (((cubin, lowered name, module sha256), source), absent) of ``key`` from
    the user's cache (SQLAlchemy-free read) or a bundle; (None, absent) when neither has it,
    ``absent`` as from warm.read_kernel_status."""
    found, absent = read_kernel_status(key)
    if found is not None:
        return (found, "cache"), False
    found = read_bundled(key)
    if found is not None:
        return (found, "bundle"), False
    return None, absent


def _find_or_compile(spec: KernelSpec, arch: str, key: str, debug: bool, looked: tuple | None = None) -> tuple:
    """Steps 2-5: ((cubin, lowered name, module sha256), source) of ``spec``. Needs no GPU and
    no lock: prefetch runs it in worker threads. ``looked``: :func:`_find`'s answer when the
    caller already asked."""
    hit, absent = looked if looked is not None else _find(key)
    if hit is not None:
        return hit
    # (another thread may be importing the full cache's module: read its cache through getattr)
    full = sys.modules.get(__package__ + ".cache.store")
    singleton = getattr(full, "_singleton", None)
    if absent and singleton is not None and singleton[1].in_memory:
        absent = False  # no usable file: this process's in-memory cache may hold it
    if absent:  # the cache file has no such row (or no file yet): compile while the cache opens
        cache_of = _open_cache_in_background()
    else:
        cache = kernel_cache.get_cache()  # the full cache decides what the warm read doubted
        entry = cache.get(key)
        if entry is not None:
            return (entry.cubin, entry.lowered_name, entry.module_sha256), "cache"
        cache_of = lambda: cache  # noqa: E731
    record, _ = compile_specs([spec], arch, debug=debug)
    cache_of().put(record)
    return (record.cubin, record.kernels[0][2], hashlib.sha256(record.cubin).hexdigest()), "compiled"


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
    several kernels of one call compile side by side; :func:`get_kernel` then waits for its
    own. A spec already loaded, or already on its way, is skipped. The cache and bundles are
    read here first: a warm start finds its kernels in well under a millisecond, less than a
    worker thread's start."""
    arch = None
    for spec in dict.fromkeys(specs):
        if (device, spec) in _loaded:
            continue
        if arch is None:
            arch = arch_of_device(device)
        if (arch, spec) in _pending or not spec.supports(arch):
            continue
        key = kernel_key(spec, arch)
        looked = _find(key)
        with _lock:
            if (device, spec) in _loaded or (arch, spec) in _pending:
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
    if (device, spec) in _loaded:
        return True
    arch = arch_of_device(device)
    pending = _pending.get((arch, spec))
    if pending is not None:
        return pending.done()
    return _find(kernel_key(spec, arch))[0] is not None


def get_kernel(spec: KernelSpec, device: int, *, debug: bool = False) -> LoadedKernel:
    """The loaded kernel of ``spec`` on CUDA device ``device``."""
    hit = _loaded.get((device, spec))
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    arch = arch_of_device(device)
    key = kernel_key(spec, arch)
    mine = None
    with _lock:
        hit = _loaded.get((device, spec))
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
        hit = _loaded.get((device, spec))
        if hit is not None:
            return hit
        loaded = _loaded[(device, spec)] = loader.load(spec, device, found, key, source)
    if debug:
        log.debug("kernel %s on cuda:%d (%s): %s in %.1f ms", spec.name_expression, device, arch,
                  {"cache": "cache hit", "bundle": "prebuilt bundle"}.get(source, "cache miss, compiled"),
                  (time.perf_counter() - t0) * 1e3)
    return loaded
