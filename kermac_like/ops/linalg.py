"""Batched dense solves and symmetric eigendecomposition on cuSOLVER.

Kernel methods factor a regularised kernel matrix ``K + lambda I`` and solve
for many label columns at once; a hyper-parameter sweep does so for a batch of
bandwidths or regularisers. One bad entry (a bandwidth too small, a
regulariser too weak) must not stall the training loop, so nothing here waits
for the GPU unless asked to: failures are reported through info tensors on the
device, and the solution of a failed entry is filled with NaN on the device so
that it cannot be consumed silently.

Public functions (all keyword options after the operands)::

    solve_cholesky(a, b, *, overwrite_a=False, overwrite_b=False,
                   check_errors=False, debug=False) -> (x, factor_info, solve_info)
    solve_lu(a, b, ...same options...)         -> (x, factor_info, solve_info)
    eigh(a, *, overwrite_a=False, check_errors=False, debug=False)
                                                -> (eigenvalues, eigenvectors, info)

Shapes and layout
-----------------
``a`` is ``(N, N)`` or ``(L, N, N)``; ``b`` is ``(C, N)`` or ``(L, C, N)``
with the same batch: each *row* of ``b`` is one right-hand side, so the
solution ``x`` (same shape as ``b``) satisfies ``a @ x[..., c, :] == b[..., c, :]``
for every ``c``, i.e. ``x = solve(a, b.mT).mT``. A row-major ``(C, N)`` block
is exactly a column-major ``N x C`` matrix with leading dimension ``N``, which
is what cuSOLVER wants: ``b`` is never transposed or copied for layout.

* ``solve_cholesky``: ``a`` symmetric positive definite; only its *upper*
  triangle (row-major) is read. The row-major upper triangle is the
  column-major lower one, and cuSOLVER runs with ``uplo = LOWER`` because its
  lower-fill Cholesky is markedly faster than the upper-fill one. With
  ``overwrite_a`` the upper triangle of ``a`` receives ``U`` with
  ``a = U^T U`` (``torch.linalg.cholesky(a, upper=True)``) and the strict
  lower triangle keeps its input values.
* ``solve_lu``: ``a`` general square. A row-major ``A`` is the column-major
  ``A^T``: we factor ``A^T = P L U`` in place (xgetrf) and solve with
  ``trans = T`` (xgetrs), which solves ``A x = b`` without copying ``A``. With
  ``overwrite_a``, ``a`` receives the packed LU factors of ``A^T`` in
  column-major order, i.e. ``a.mT`` equals ``torch.linalg.lu_factor(A^T)[0]``
  up to pivoting ties. The pivots are internal and not returned.
* ``eigh``: ``a`` symmetric; only its upper triangle is read (like
  ``torch.linalg.eigh(a, UPLO="U")``; cuSOLVER ``uplo = LOWER`` as for the
  Cholesky). Eigenvalues come back ascending, shape
  ``(L, N)`` / ``(N,)``; eigenvectors are the *columns* of the returned
  ``(L, N, N)`` / ``(N, N)`` tensor, so ``a @ V == V * w[..., None, :]`` as for
  ``torch.linalg.eigh``. cuSOLVER writes the vectors column-major over ``a``'s
  storage, so the returned tensor is the transposed view ``work.mT``; with
  ``overwrite_a`` it is literally ``a.mT`` (same storage).

Supported dtypes: float32 and float64 (``b`` must have ``a``'s dtype and
device). Results do not take part in autograd.

Copies and in-place writes
--------------------------
Without ``overwrite_*`` the inputs are never written: the GPU path works on a
contiguous copy. With ``overwrite_a`` / ``overwrite_b`` the factorisation and
the solution are written into ``a`` / ``b`` themselves (no second copy of an
``L x 5000 x 5000`` matrix), and the returned ``x`` *is* ``b``. In-place work
needs a C-contiguous tensor: ``overwrite_*`` on a non-contiguous tensor raises
``ValueError`` (a silent copy would break the promise that ``x is b``).
Non-contiguous inputs without ``overwrite_*`` are copied.

Info tensors
------------
int32 tensors on ``a``'s device, shape ``(L,)`` for a batch and ``()`` for a
single matrix (like ``torch.linalg.cholesky_ex``), with cuSOLVER / LAPACK
meaning: ``0`` success, ``-i`` the i-th argument was invalid, ``i > 0``:

* xpotrf: the leading minor of order ``i`` is not positive definite;
* xgetrf: ``U[i-1, i-1]`` is exactly zero (singular matrix);
* xsyevd: ``i`` off-diagonal elements of an intermediate tridiagonal form did
  not converge.

``solve_info`` is the info of the solve step (xpotrs / xgetrs), non-zero only
for invalid arguments; a failed factorisation shows in ``factor_info``.
Every output of a failed entry (``x``, or eigenvalues and eigenvectors) is set
to NaN on the device; with ``overwrite_a`` the partial factorisation left in
``a`` for that entry is unspecified. The other entries are solved normally.

``check_errors=True`` synchronises the host once after the work and raises
:class:`LinAlgError` naming the failed entries and their info codes.

GPU execution
-------------
Each batch entry runs on one stream of a small per-device pool (at most
``KERMAC_LIKE_LINALG_STREAMS`` streams, default 16, reused round-robin); every
pool stream first waits on an event recorded on the current stream, and the
current stream finally waits on one event per pool stream, so the call is
ordered like any other operation on the current stream and returns without
synchronising the host (this wrapper never does; whether a cuSOLVER routine
waits internally is the library's business, and the GPU tests check it). Entries sharing a stream run one after the other and
share that stream's workspace, so device workspace is
``min(L, pool) x`` the per-matrix size (xsyevd needs about ``2 N^2`` elements
per matrix). Workspaces come from torch's caching allocator. cuSOLVER handles
(one per pool stream) and one params object are cached per (device, thread);
a thread's set is adopted by a later thread once the first one has ended, and
all are destroyed at interpreter exit.

CPU tensors take ``torch.linalg`` (the reference path) with the same
signatures, outputs and info semantics; so do CUDA tensors when nvmath-python
is not installed (with one warning).

``debug=True`` (or ``KERMAC_LIKE_DEBUG=1``) logs handle creation, workspace
sizes and stream assignment to the ``kermac_like.linalg`` logger at DEBUG level.

First call
----------
The first GPU call of a process waits for the work already queued on the device
(bench/probes/linalg_first_call.py times each step behind a 1 s torch.cuda._sleep;
on an H200: torch's first pool stream 1002 ms, the first solve_cholesky after it
1073 ms, the first solve_lu 1002 ms, the first eigh 1024 ms; nvmath's import,
cuSOLVER handle and params creation and workspace allocation return at once).
Creating torch's stream pool waits, and CUDA loads each library kernel on its
first launch (lazy loading), which waits for the device: running the routines
on other sizes beforehand did not remove the wait of a later first call, since
cuSOLVER and cuBLAS pick their kernels by size. :func:`warmup` is the one step
that waits: call it once per device (before the training loop, at the shapes the
loop will use) and later calls at those shapes do not wait (H200, fresh processes,
tests/test_linalg.py: without it the first solve_cholesky and solve_lu at 96 x 96 and
the first solve_cholesky at 384 x 384 waited for a 1e9-cycle sleep; after it, none of
the four did). A first call at a
shape :func:`warmup` did not see may still wait once; ``CUDA_MODULE_LOADING=EAGER``
(set before CUDA starts) loads every kernel up front instead, at the cost of
start-up time and memory for all of torch's kernels too.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import logging
import re
import threading
import warnings
import weakref

import torch
from torch import Tensor

from .. import config
from .._args import check_device

from ._library import direct_call

__all__ = [
    "LinAlgError",
    "cache_info",
    "cholesky_3xtf32_",
    "eigh",
    "solve_cholesky",
    "solve_lu",
    "warmup",
]

logger = logging.getLogger("kermac_like.linalg")

# cuSOLVER / cuBLAS / CUDA enum values, as exposed by nvmath.bindings
# (tests check them against nvmath's enums): kept as plain ints so that the
# hot path touches no enum machinery.
_FILL_LOWER = 0  # cublasFillMode_t CUBLAS_FILL_MODE_LOWER (nvmath.bindings.cublas.FillMode.LOWER)
_OP_T = 1  # cublasOperation_t CUBLAS_OP_T (nvmath.bindings.cublas.Operation.T)
_EIG_VECTOR = 1  # cusolverEigMode_t CUSOLVER_EIG_MODE_VECTOR (nvmath.bindings.cusolver.EigMode.VECTOR)
_CUDA_DTYPE = {  # cudaDataType_t (nvmath.CudaDataType)
    torch.float32: 0,  # CUDA_R_32F
    torch.float64: 1,  # CUDA_R_64F
}

_WORKSPACE_ALIGN = 256  # bytes between per-stream workspace slices


class LinAlgError(torch.linalg.LinAlgError):
    """A factorisation or eigendecomposition failed for some batch entries.

    ``routine`` names the function, ``failed`` maps each failed batch index
    (0 for an unbatched call) to ``(factor_info, solve_info)`` codes.
    """

    def __init__(self, message: str, routine: str, failed: dict):
        super().__init__(message)
        self.routine = routine
        self.failed = failed


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _check_a(a) -> int:
    """Validate ``a``; return the batch size L (0 means unbatched)."""
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
    if a.dtype not in _CUDA_DTYPE:
        raise TypeError(f"a must be float32 or float64, got {a.dtype}")
    if a.dim() not in (2, 3):
        raise ValueError(f"a must have shape (N, N) or (L, N, N), got {tuple(a.shape)}")
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be square in its last two dims, got {tuple(a.shape)}")
    return a.shape[0] if a.dim() == 3 else 0


def _check_b(a, b) -> None:
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"b must be a torch.Tensor, got {type(b).__name__}")
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")
    n = a.shape[-1]
    if a.dim() == 2:
        if b.dim() != 2 or b.shape[1] != n:
            raise ValueError(
                f"b must have shape (C, {n}) for a of shape {tuple(a.shape)} "
                f"(each row one right-hand side), got {tuple(b.shape)}"
            )
    elif b.dim() != 3 or b.shape[0] != a.shape[0] or b.shape[2] != n:
        raise ValueError(
            f"b must have shape ({a.shape[0]}, C, {n}) for a of shape {tuple(a.shape)} "
            f"(each row one right-hand side), got {tuple(b.shape)}"
        )


def _check_overwrite(t: torch.Tensor, name: str, overwrite: bool) -> None:
    if overwrite and not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {t.stride()}): overwrite_{name}=True "
            f"writes the result in place and needs a C-contiguous tensor; pass "
            f"{name}.contiguous() or overwrite_{name}=False"
        )


def _work_copy(t: torch.Tensor, overwrite: bool) -> torch.Tensor:
    """The tensor the solver writes into: ``t`` itself or a contiguous copy."""
    return t if overwrite else t.clone(memory_format=torch.contiguous_format)


def _debug_on(debug: bool) -> bool:
    return debug or config.get("debug")


# --------------------------------------------------------------------------- #
# Errors (check_errors=True)
# --------------------------------------------------------------------------- #

_INFO_MEANING = {
    "xpotrf": "info = i > 0: the leading minor of order i is not positive definite",
    "xgetrf": "info = i > 0: U[i-1, i-1] is exactly zero, the matrix is singular",
    "xsyevd": "info = i > 0: i off-diagonal elements of an intermediate tridiagonal form did not converge",
}


def _raise_on_failure(routine: str, factor: str, infos: torch.Tensor, batched: bool) -> None:
    """Synchronise once (one device-to-host copy) and raise on any non-zero info.

    ``infos``: (K, L) int32, row 0 the factorisation's info, row 1 (if any) the solve's.
    """
    codes = infos.cpu()  # the one host synchronisation
    bad = (codes != 0).any(dim=0).nonzero().flatten().tolist()
    if not bad:
        return
    failed = {i: tuple(int(c) for c in codes[:, i]) for i in bad}
    where = f"batch entries {bad}" if batched else "the matrix"
    shown = ", ".join(f"{i}: {c if len(c) > 1 else c[0]}" for i, c in failed.items())
    kind = "(factor_info, solve_info)" if codes.shape[0] > 1 else "info"
    raise LinAlgError(
        f"{routine}: {factor} failed for {where}; {kind} codes {{{shown}}}. "
        f"{_INFO_MEANING[factor]}; info < 0: argument -info was invalid. "
        f"The outputs of failed entries are NaN.",
        routine,
        failed,
    )


# --------------------------------------------------------------------------- #
# Reference path: torch.linalg (CPU tensors, or CUDA without nvmath)
# --------------------------------------------------------------------------- #


def _ref_solve_cholesky(a3, b3, x3, overwrite_a):
    # a3 (L,N,N) input, b3 (L,C,N) input, x3 (L,C,N) output (may be b3)
    # Upper triangle read, a = U^T U: the same elements and factor as the GPU path.
    factor, finfo = torch.linalg.cholesky_ex(a3, upper=True)
    x3.copy_(torch.cholesky_solve(b3.mT, factor, upper=True).mT)
    if overwrite_a:
        a3.copy_(factor.triu() + a3.tril(-1))  # U in the upper triangle, lower kept
    return finfo, torch.zeros_like(finfo)


def _lu_factor_ex(a: torch.Tensor):
    """torch.linalg.lu_factor_ex, with its batched CPU form checked: torch 2.13's CPU build (oneMKL) returns
    invalid pivots from a batch once the process changed torch.set_num_threads ("Parameter 6 was incorrect
    on entry to SLASWP"); such a batch is factored again one matrix at a time, which is not affected."""
    lu, piv, info = torch.linalg.lu_factor_ex(a)
    if a.dim() > 2 and a.device.type == "cpu" and piv.numel() and (
            int(piv.min()) < 1 or int(piv.max()) > a.shape[-2]):
        parts = [torch.linalg.lu_factor_ex(m) for m in a.reshape(-1, *a.shape[-2:])]
        lu = torch.stack([p[0] for p in parts]).reshape(lu.shape)
        piv = torch.stack([p[1] for p in parts]).reshape(piv.shape)
        info = torch.stack([p[2] for p in parts]).reshape(info.shape)
    return lu, piv, info


def _ref_solve_lu(a3, b3, x3, overwrite_a):
    # Factor A^T as cuSOLVER does on the row-major buffer, solve with A = (A^T)^T.
    lu, piv, finfo = _lu_factor_ex(a3.mT)
    x3.copy_(torch.linalg.lu_solve(lu, piv, b3.mT, adjoint=True).mT)
    if overwrite_a:
        a3.copy_(lu.mT)
    return finfo.to(torch.int32), torch.zeros_like(finfo, dtype=torch.int32)


_EIGH_CODE = re.compile(r"error code: (-?\d+)")


def _ref_eigh(a3):
    # Returns w (L,N), V (L,N,N) with eigenvectors as columns, info (L,) int32.
    L = a3.shape[0]
    info = torch.zeros(L, dtype=torch.int32, device=a3.device)
    try:
        w, v = torch.linalg.eigh(a3, UPLO="U")
        return w, v, info
    except torch.linalg.LinAlgError:
        pass
    # One entry failed the whole batch: redo entry by entry to find which.
    w = torch.empty(a3.shape[:2], dtype=a3.dtype, device=a3.device)
    v = torch.empty_like(a3)
    for i in range(L):
        try:
            w[i], v[i] = torch.linalg.eigh(a3[i], UPLO="U")
        except torch.linalg.LinAlgError as e:
            m = _EIGH_CODE.search(str(e))
            info[i] = int(m.group(1)) if m else 1
            w[i] = float("nan")
            v[i] = float("nan")
    return w, v, info


# --------------------------------------------------------------------------- #
# cuSOLVER backend: lazy nvmath import, stream pool, per-thread handles
# --------------------------------------------------------------------------- #

_cusolver_module = None
_cusolver_missing = False
_warned_fallback = False


def _cusolver():
    """nvmath.bindings.cusolverDn, imported on first GPU use; None if unavailable."""
    global _cusolver_module, _cusolver_missing, _warned_fallback
    if _cusolver_module is None and not _cusolver_missing:
        try:
            from nvmath.bindings import cusolverDn
        except ImportError as e:
            _cusolver_missing = True
            if not _warned_fallback:
                _warned_fallback = True
                warnings.warn(
                    f"kermac_like.linalg: nvmath-python is not available ({e}); CUDA "
                    f"tensors take torch.linalg (may synchronise the host). For cuSOLVER, "
                    f"install the extra of your CUDA toolkit: pip install 'kermac_like[cu13]' "
                    f"(CUDA 13) or 'kermac_like[cu12]' (CUDA 12).",
                    RuntimeWarning,
                    stacklevel=4,
                )
        else:
            _cusolver_module = cusolverDn
    return _cusolver_module


_lock = threading.Lock()
_streams: dict[int, list] = {}  # device index -> [torch.cuda.Stream], grown to <= config "linalg_streams"
_solvers: list["_Solver"] = []  # every handle set ever made (for atexit and adoption)
_local = threading.local()  # .solvers: {device index: _Solver} of this thread
_host_pools: dict = {}  # device index -> ThreadPoolExecutor (see _host_pool)
# xsyevd blocks the calling host thread inside each call; issuing the entries of a
# batch from one worker thread per stream slot lets them overlap on the GPU.
# Small matrices return to the host at once (measured n=128), so they stay on the
# calling thread; at n=5000 (L=10) the threads took eigh from 2212 ms to 1248 ms on an H200.
EIGH_HOST_THREADS_MIN_N = 1024
_atexit_registered = False


def _pool_streams(device: int, count: int) -> list:
    pool = _streams.get(device)
    if pool is None or len(pool) < count:
        with _lock:
            pool = _streams.setdefault(device, [])
            while len(pool) < count:
                pool.append(torch.cuda.Stream(device=device))
    return pool


class _Solver:
    """cuSOLVER handles of one (device, thread): handle k drives pool stream k."""

    def __init__(self, cs, device: int):
        self.cs = cs
        self.device = device
        self.owner = weakref.ref(threading.current_thread())
        try:
            self.params = cs.create_params()
        except Exception as e:  # nvmath present but libcusolver missing or unusable
            raise RuntimeError(
                f"kermac_like.linalg: cuSOLVER could not be initialised through "
                f"nvmath-python on device {device} ({type(e).__name__}: {e}); install the "
                f"cuSOLVER library matching your CUDA (e.g. nvmath-python[cu12] or [cu13])"
            ) from e
        self.handles: list[int] = []
        self.slot_params: list[int] = []  # one params object per slot for concurrent host threads
        self.fork = torch.cuda.Event()
        self.joins: list = []
        # (event, host buffers) kept alive until the event completes
        self.host_keepalive: list = []

    def ensure(self, count: int, log: bool) -> None:
        while len(self.handles) < count:
            handle = self.cs.create()
            self.handles.append(handle)
            self.slot_params.append(self.cs.create_params())
            self.joins.append(torch.cuda.Event())
            if log:
                logger.debug(
                    "created cuSOLVER handle 0x%x for device %s, thread %s (slot %d)",
                    handle, self.device, threading.current_thread().name, len(self.handles) - 1,
                )

    def destroy(self) -> None:
        cs = self.cs
        for handle in self.handles:
            cs.destroy(handle)
        for prm in self.slot_params:
            cs.destroy_params(prm)
        self.handles = []
        self.slot_params = []
        if self.params:
            cs.destroy_params(self.params)
            self.params = 0


def _solver(cs, device: int, log: bool) -> _Solver:
    mine = getattr(_local, "solvers", None)
    if mine is None:
        mine = _local.solvers = {}
    solver = mine.get(device)
    if solver is not None:
        return solver
    global _atexit_registered
    with _lock:
        # Adopt the handles of a thread that has ended rather than leak them.
        for cand in _solvers:
            owner = cand.owner()
            if cand.device == device and (owner is None or not owner.is_alive()):
                cand.owner = weakref.ref(threading.current_thread())
                solver = cand
                break
        if solver is None:
            with torch.cuda.device(device):
                solver = _Solver(cs, device)
            _solvers.append(solver)
            if not _atexit_registered:
                atexit.register(_shutdown)
                _atexit_registered = True
    if log:
        logger.debug("cuSOLVER handle set for device %s, thread %s (%d sets in total)",
                     device, threading.current_thread().name, len(_solvers))
    mine[device] = solver
    return solver


def _shutdown() -> None:
    """Destroy every cached handle and params object (atexit)."""
    with _lock:
        solvers = list(_solvers)
        _solvers.clear()
    for solver in solvers:
        try:
            with torch.cuda.device(solver.device):
                torch.cuda.synchronize(solver.device)
                solver.destroy()
        except Exception:  # CUDA may already be torn down at interpreter exit
            pass
    _streams.clear()


def cache_info() -> dict:
    """Cached GPU resources: pool streams per device, handle sets, handles.

    >>> import kermac_like as km
    >>> info = km.linalg.cache_info()           # {"streams": {device: n}, "solvers": n, "handles": n}
    >>> sorted(info)
    ['handles', 'solvers', 'streams']
    """
    with _lock:
        return {
            "streams": {d: len(s) for d, s in _streams.items()},
            "solvers": len(_solvers),
            "handles": sum(len(s.handles) for s in _solvers),
        }


def _host_pool(device: int):
    """Worker threads that issue cuSOLVER calls for several stream slots at once
    (routines such as xsyevd wait on the host inside each call)."""
    with _lock:
        pool = _host_pools.get(device)
        if pool is None:
            pool = _host_pools[device] = concurrent.futures.ThreadPoolExecutor(
                max_workers=config.get("linalg_streams"), thread_name_prefix=f"kermac_like-linalg-{device}")
        return pool


def _run_batched(cs, device, batch, query, enqueue, *, extra_slot_bytes=0, log=False, what="",
                 host_threads=False):
    """Fork ``batch`` entries over the stream pool, enqueue them, join back.

    ``query(handle, params) -> (device_bytes, host_bytes)`` sizes one entry's
    workspace; ``enqueue(i, handle, params, ws_ptr, ws_bytes, host_ptr,
    host_bytes, slot_ptr)`` issues entry ``i``'s cuSOLVER calls, where
    ``slot_ptr`` points at ``extra_slot_bytes`` of per-stream scratch (pivots).

    Allocation and the caching allocator: the workspace is allocated on the
    current stream before the fork and freed (when this function returns) after
    the current stream has been made to wait for every pool stream. A later
    reuse of the block is therefore ordered after the pool work, so no
    ``record_stream`` is needed.
    """
    solver = _solver(cs, device, log)
    slots = min(batch, config.get("linalg_streams"))
    solver.ensure(slots, log)
    streams = _pool_streams(device, slots)
    current = torch.cuda.current_stream(device)
    params = solver.params

    dev_bytes, host_bytes = query(solver.handles[0], params)
    stride = -(-max(dev_bytes, 1) // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    extra = -(-extra_slot_bytes // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    workspace = torch.empty(slots * (stride + extra), dtype=torch.uint8, device=device)
    base = workspace.data_ptr()
    host_bufs = [bytearray(host_bytes) for _ in range(slots)] if host_bytes else None
    if log:
        logger.debug(
            "%s: %d entries on %d streams, workspace %d device bytes + %d host bytes per stream",
            what, batch, slots, dev_bytes, host_bytes,
        )
    if solver.host_keepalive:
        solver.host_keepalive = [(e, b) for e, b in solver.host_keepalive if not e.query()]

    solver.fork.record(current)
    for k in range(slots):
        streams[k].wait_event(solver.fork)
        cs.set_stream(solver.handles[k], streams[k].cuda_stream)
    def issue(i, prm):
        k = i % slots
        slot = base + k * (stride + extra)
        host_ptr = 0
        if host_bufs is not None:
            host_ptr = _buffer_address(host_bufs[k])
        if log:
            logger.debug("%s: entry %d -> stream slot %d (stream 0x%x)",
                         what, i, k, streams[k].cuda_stream)
        enqueue(i, solver.handles[k], prm, slot, dev_bytes, host_ptr, host_bytes, slot + stride)

    def issue_slot_in_worker(k):
        with torch.cuda.device(device):  # the worker thread's current context
            for i in range(k, batch, slots):
                issue(i, solver.slot_params[k])

    try:
        if host_threads and slots > 1:
            futures = [_host_pool(device).submit(issue_slot_in_worker, k) for k in range(slots)]
            for f in futures:
                f.result()
        else:
            for i in range(batch):
                issue(i, params)
    finally:
        # Join even if a call raised, so the current stream stays ordered.
        for k in range(slots):
            solver.joins[k].record(streams[k])
            current.wait_event(solver.joins[k])
    if host_bufs is not None:
        done = torch.cuda.Event()
        done.record(current)
        solver.host_keepalive.append((done, host_bufs))
    return workspace  # the caller drops it after the join (see docstring)


def _buffer_address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _use_cusolver(a: torch.Tensor):
    return _cusolver() if a.is_cuda else None


# --------------------------------------------------------------------------- #
# Public functions
# --------------------------------------------------------------------------- #


def _solve(routine, a, b, overwrite_a, overwrite_b, check_errors, debug):
    batch = _check_a(a)
    _check_b(a, b)
    _check_overwrite(a, "a", overwrite_a)
    _check_overwrite(b, "b", overwrite_b)
    batched = a.dim() == 3
    L = batch if batched else 1
    n = a.shape[-1]
    c = b.shape[-2]
    cs = _use_cusolver(a)
    log = _debug_on(debug)

    with torch.no_grad():
        if cs is None:
            a3 = a if batched else a.unsqueeze(0)
            b3 = b if batched else b.unsqueeze(0)
            x = b if overwrite_b else torch.empty_like(b, memory_format=torch.contiguous_format)
            x3 = x if batched else x.unsqueeze(0)
            if log:
                logger.debug("%s: torch.linalg reference path on %s, L=%d N=%d C=%d",
                             routine, a.device, L, n, c)
            ref = _ref_solve_cholesky if routine == "solve_cholesky" else _ref_solve_lu
            if L and n:
                finfo, sinfo = ref(a3, b3, x3, overwrite_a)
            else:
                finfo = torch.zeros(L, dtype=torch.int32, device=a.device)
                sinfo = torch.zeros_like(finfo)
        else:
            work_a = _work_copy(a, overwrite_a)
            x = _work_copy(b, overwrite_b)
            x3 = x if batched else x.unsqueeze(0)
            finfo = torch.zeros(L, dtype=torch.int32, device=a.device)
            sinfo = torch.zeros_like(finfo)
            if L and n:
                _solve_gpu(cs, routine, work_a, x, finfo, sinfo, L, n, c, log)
        bad = (finfo != 0) | (sinfo != 0)
        x3.masked_fill_(bad.view(L, 1, 1), float("nan"))

    if check_errors:
        factor = "xpotrf" if routine == "solve_cholesky" else "xgetrf"
        _raise_on_failure(routine, factor, torch.stack([finfo, sinfo]), batched)
    if not batched:
        finfo, sinfo = finfo.view(()), sinfo.view(())
    return x, finfo, sinfo


def _solve_gpu(cs, routine, work_a, x, finfo, sinfo, L, n, c, log):
    device = work_a.device.index
    dt = _CUDA_DTYPE[work_a.dtype]
    esize = work_a.element_size()
    a_ptr, x_ptr = work_a.data_ptr(), x.data_ptr()
    f_ptr, s_ptr = finfo.data_ptr(), sinfo.data_ptr()
    a_step, x_step = n * n * esize, c * n * esize

    if routine == "solve_cholesky":
        def query(h, p):
            return cs.xpotrf_buffer_size(h, p, _FILL_LOWER, n, dt, a_ptr, n, dt)

        def enqueue(i, h, p, ws, ws_bytes, host, host_bytes, _scratch):
            ai = a_ptr + i * a_step
            cs.xpotrf(h, p, _FILL_LOWER, n, dt, ai, n, dt, ws, ws_bytes, host, host_bytes, f_ptr + 4 * i)
            if c:
                cs.xpotrs(h, p, _FILL_LOWER, n, c, dt, ai, n, dt, x_ptr + i * x_step, n, s_ptr + 4 * i)

        extra = 0
    else:
        def query(h, p):
            return cs.xgetrf_buffer_size(h, p, n, n, dt, a_ptr, n, dt)

        def enqueue(i, h, p, ws, ws_bytes, host, host_bytes, ipiv):
            # The row-major buffer is A^T column-major: factor it, solve with trans=T.
            ai = a_ptr + i * a_step
            cs.xgetrf(h, p, n, n, dt, ai, n, ipiv, dt, ws, ws_bytes, host, host_bytes, f_ptr + 4 * i)
            if c:
                cs.xgetrs(h, p, _OP_T, n, c, dt, ai, n, ipiv, dt, x_ptr + i * x_step, n, s_ptr + 4 * i)

        extra = 8 * n  # int64 pivots per stream

    with torch.cuda.device(device):
        _run_batched(cs, device, L, query, enqueue, extra_slot_bytes=extra, log=log, what=routine)


WARMUP_SHAPES = ((64, 1), (64, 16), (512, 1), (512, 16))


def warmup(device=None, shapes=WARMUP_SHAPES, dtypes=(torch.float32, torch.float64)) -> None:
    """Do once, on ``device``, what makes a first call wait for the GPU, then synchronise.

    Creates the stream pool and every cuSOLVER handle of this thread, and runs
    :func:`solve_cholesky`, :func:`solve_lu` and :func:`eigh` on a batch of two
    random well-conditioned matrices for each ``(n, c)`` in ``shapes`` (n x n
    matrices, c right-hand sides) and each dtype in ``dtypes``, so that CUDA has
    loaded the kernels those calls use (see "First call" in the module docstring).
    Later calls at these shapes do not synchronise the host. ``device``: a CUDA
    device (default: the current one); a CPU device, no ``device`` on a machine
    without CUDA, or nvmath-python missing, makes it return at once (the reference
    path never waits for a GPU); a CUDA device that this torch cannot use is a
    ValueError naming ``device``. Handles are per thread: a thread that solves calls
    its own warmup.

    >>> import kermac_like as km
    >>> km.linalg.warmup("cpu")                 # CPU tensors take torch.linalg: nothing to do
    >>> sorted(km.linalg.cache_info())
    ['handles', 'solvers', 'streams']
    """
    if device is not None and not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device: expected a torch.device, str or int, got {type(device).__name__}")
    try:
        shapes = [tuple(s) for s in shapes]
    except TypeError:
        raise TypeError(f"shapes: expected (n, c) pairs, got {shapes!r}") from None
    for s in shapes:
        if len(s) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in s) or s[0] < 1 or s[1] < 0:
            raise ValueError(f"shapes: each entry is (n, c) with integers n >= 1, c >= 0; got {s!r}")
    dtypes = tuple(dtypes)
    for dt in dtypes:
        if dt not in _CUDA_DTYPE:
            raise TypeError(f"dtypes: expected torch.float32 or torch.float64, got {dt!r}")
    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    device = check_device("device", device)
    if device.type != "cuda":
        return
    cs = _cusolver()
    if cs is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    with torch.cuda.device(index):
        solver = _solver(cs, index, False)
        streams = config.get("linalg_streams")
        solver.ensure(streams, False)
        _pool_streams(index, streams)
        g = torch.Generator(device=device).manual_seed(0)
        for dt in dtypes:
            seen = set()
            for n, c in shapes:
                r = torch.randn(2, n, n, dtype=dt, device=device, generator=g)
                a = r @ r.mT / n + torch.eye(n, dtype=dt, device=device)
                b = torch.randn(2, c, n, dtype=dt, device=device, generator=g)
                solve_cholesky(a, b)
                solve_lu(a, b)
                if n not in seen:  # eigh does not depend on c
                    seen.add(n)
                    eigh(a)
        torch.cuda.synchronize(index)


def solve_cholesky(a, b, *, overwrite_a=False, overwrite_b=False, check_errors=False, debug=False):
    """Solve ``a x_c = b_c`` for each row ``b_c`` of ``b``, ``a`` symmetric positive definite.

    cuSOLVER xpotrf + xpotrs per batch entry (see the module docstring for
    layout, overwrite and info semantics). ``a``: ``(N, N)`` or ``(L, N, N)``,
    only the upper triangle read; ``b``: ``(C, N)`` or ``(L, C, N)``.

    Returns ``(x, factor_info, solve_info)``: ``x`` shaped like ``b`` (``b``
    itself with ``overwrite_b``), NaN for entries whose factorisation failed;
    int32 info tensors of shape ``(L,)`` or ``()``. Does not synchronise the
    host unless ``check_errors``, which raises :class:`LinAlgError` on failure.

    >>> import torch, kermac_like as km
    >>> a = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
    >>> x, factor_info, solve_info = km.linalg.solve_cholesky(a, torch.tensor([[2.0, 1.0]]))
    >>> x, int(factor_info), int(solve_info)
    (tensor([[0.5000, 0.0000]]), 0, 0)
    """
    return _solve_call("solve_cholesky", a, b, overwrite_a, overwrite_b, check_errors, debug)


def solve_lu(a, b, *, overwrite_a=False, overwrite_b=False, check_errors=False, debug=False):
    """Solve ``a x_c = b_c`` for each row ``b_c`` of ``b``, ``a`` general square.

    cuSOLVER xgetrf + xgetrs (trans=T on the row-major buffer, which is
    ``a^T`` column-major) per batch entry; same shapes, outputs and options
    as :func:`solve_cholesky`. ``factor_info = i > 0`` flags an exactly
    singular ``U``; that entry's ``x`` is NaN.

    >>> import torch, kermac_like as km
    >>> a = torch.tensor([[0.0, 1.0], [2.0, 0.0]])      # needs pivoting
    >>> x, factor_info, _ = km.linalg.solve_lu(a, torch.tensor([[3.0, 4.0]]))
    >>> x, int(factor_info)
    (tensor([[2., 3.]]), 0)
    """
    return _solve_call("solve_lu", a, b, overwrite_a, overwrite_b, check_errors, debug)


def eigh(a, *, overwrite_a=False, check_errors=False, debug=False):
    """Eigenvalues and eigenvectors of symmetric ``a`` (upper triangle read).

    cuSOLVER xsyevd (jobz=VECTOR) per batch entry. Returns ``(eigenvalues,
    eigenvectors, info)``: eigenvalues ascending, ``(L, N)`` or ``(N,)``;
    eigenvectors as columns, ``(L, N, N)`` or ``(N, N)``, a transposed view
    of the work buffer (of ``a`` itself with ``overwrite_a``); int32 info of
    shape ``(L,)`` or ``()``. Outputs of failed entries are NaN.

    >>> import torch, kermac_like as km
    >>> a = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    >>> w, v, info = km.linalg.eigh(a)
    >>> w
    tensor([1., 3.])
    >>> torch.allclose(a @ v, v * w)
    True
    """
    _check_a(a)
    _check_overwrite(a, "a", overwrite_a)
    if direct_call(a, grad=False):
        return _eigh(a, overwrite_a, check_errors, debug)
    with torch.no_grad():  # results take no part in autograd
        if not overwrite_a:
            return _EIGH(a, check_errors, debug)
        w, info = _EIGH_INPLACE(a, check_errors, debug)
        return w, a.mT, info


def _eigh(a, overwrite_a, check_errors, debug):
    batch = _check_a(a)
    _check_overwrite(a, "a", overwrite_a)
    batched = a.dim() == 3
    L = batch if batched else 1
    n = a.shape[-1]
    cs = _use_cusolver(a)
    log = _debug_on(debug)

    with torch.no_grad():
        if cs is None:
            if log:
                logger.debug("eigh: torch.linalg reference path on %s, L=%d N=%d", a.device, L, n)
            a3 = a if batched else a.unsqueeze(0)
            if L and n:
                w, v, info = _ref_eigh(a3)
            else:
                w = a3.new_empty((L, n))
                v = a3.new_empty((L, n, n))
                info = torch.zeros(L, dtype=torch.int32, device=a.device)
            if overwrite_a:
                a3.copy_(v.mT)  # same storage content as the GPU path
                vectors = a.mT
            else:
                vectors = v if batched else v[0]
        else:
            work = _work_copy(a, overwrite_a)
            w = torch.empty((L, n), dtype=a.dtype, device=a.device)
            info = torch.zeros(L, dtype=torch.int32, device=a.device)
            if L and n:
                _eigh_gpu(cs, work, w, info, L, n, log)
            work3 = work if batched else work.unsqueeze(0)
            bad = info != 0
            work3.masked_fill_(bad.view(L, 1, 1), float("nan"))
            vectors = work.mT  # column-major vectors = transposed row-major buffer
        w.masked_fill_((info != 0).view(L, 1), float("nan"))

    if check_errors:
        _raise_on_failure("eigh", "xsyevd", info.view(1, L), batched)
    if not batched:
        w, info = w[0], info.view(())
    return w, vectors, info


def _eigh_gpu(cs, work, w, info, L, n, log):
    device = work.device.index
    dt = _CUDA_DTYPE[work.dtype]
    esize = work.element_size()
    a_ptr, w_ptr, i_ptr = work.data_ptr(), w.data_ptr(), info.data_ptr()

    def query(h, p):
        return cs.xsyevd_buffer_size(h, p, _EIG_VECTOR, _FILL_LOWER, n, dt, a_ptr, n, dt, w_ptr, dt)

    def enqueue(i, h, p, ws, ws_bytes, host, host_bytes, _scratch):
        cs.xsyevd(h, p, _EIG_VECTOR, _FILL_LOWER, n, dt, a_ptr + i * n * n * esize, n,
                  dt, w_ptr + i * n * esize, dt, ws, ws_bytes, host, host_bytes, i_ptr + 4 * i)

    with torch.cuda.device(device):
        threads = n >= EIGH_HOST_THREADS_MIN_N
        _run_batched(cs, device, L, query, enqueue, log=log, what="eigh", host_threads=threads)


# --------------------------------------------------------------------------- #
# torch.library ops
# --------------------------------------------------------------------------- #
# Each routine is three ops: functional (no input written), ``_inplace`` (``a`` and the
# solution buffer ``x`` written: overwrite_a) and ``_into`` (only ``x`` written:
# overwrite_b alone). ``x`` holds b on entry and the solution on return; with
# overwrite_b it is b itself, else a contiguous copy of b (what the solver would have
# copied anyway). eigh: functional and ``eigh_inplace`` (``a`` receives the vectors).


def _solve_call(routine, a, b, overwrite_a, overwrite_b, check_errors, debug):
    _check_a(a)
    _check_b(a, b)
    _check_overwrite(a, "a", overwrite_a)
    _check_overwrite(b, "b", overwrite_b)
    if direct_call(a, b, grad=False):
        return _solve(routine, a, b, overwrite_a, overwrite_b, check_errors, debug)
    functional, inplace, into = _SOLVE_OPS[routine]
    with torch.no_grad():  # results take no part in autograd
        if not overwrite_a and not overwrite_b:
            return functional(a, b, check_errors, debug)
        x = b if overwrite_b else b.clone(memory_format=torch.contiguous_format)
        finfo, sinfo = (inplace if overwrite_a else into)(a, x, check_errors, debug)
        return x, finfo, sinfo


def _info_fake(a):
    return a.new_empty((a.shape[0],) if a.dim() == 3 else (), dtype=torch.int32)


def _register_solve(routine: str):
    def functional(a: Tensor, b: Tensor, check_errors: bool, debug: bool) -> tuple[Tensor, Tensor, Tensor]:
        return _solve(routine, a, b, False, False, check_errors, debug)

    def inplace(a: Tensor, x: Tensor, check_errors: bool, debug: bool) -> tuple[Tensor, Tensor]:
        return _solve(routine, a, x, True, True, check_errors, debug)[1:]

    def into(a: Tensor, x: Tensor, check_errors: bool, debug: bool) -> tuple[Tensor, Tensor]:
        return _solve(routine, a, x, False, True, check_errors, debug)[1:]

    ops = (
        torch.library.custom_op(f"kermac_like::{routine}", functional, mutates_args=()),
        torch.library.custom_op(f"kermac_like::{routine}_inplace", inplace, mutates_args=("a", "x")),
        torch.library.custom_op(f"kermac_like::{routine}_into", into, mutates_args=("x",)),
    )

    def functional_fake(a, b, check_errors, debug):
        return torch.empty_like(b, memory_format=torch.contiguous_format), _info_fake(a), _info_fake(a)

    def mutating_fake(a, x, check_errors, debug):
        return _info_fake(a), _info_fake(a)

    ops[0].register_fake(functional_fake)
    ops[1].register_fake(mutating_fake)
    ops[2].register_fake(mutating_fake)
    namespace = torch.ops.kermac_like
    return tuple(getattr(namespace, name).default for name in (routine, f"{routine}_inplace", f"{routine}_into"))


_SOLVE_OPS = {routine: _register_solve(routine) for routine in ("solve_cholesky", "solve_lu")}


@torch.library.custom_op("kermac_like::eigh", mutates_args=())
def _eigh_op(a: Tensor, check_errors: bool, debug: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _eigh(a, False, check_errors, debug)


@torch.library.custom_op("kermac_like::eigh_inplace", mutates_args=("a",))
def _eigh_inplace_op(a: Tensor, check_errors: bool, debug: bool) -> tuple[Tensor, Tensor]:
    w, _vectors, info = _eigh(a, True, check_errors, debug)
    return w, info


@_eigh_op.register_fake
def _eigh_fake(a, check_errors, debug):
    n = a.shape[-1]
    w = a.new_empty((*a.shape[:-2], n))
    return w, a.new_empty(a.shape).mT, _info_fake(a)  # vectors: the transposed work buffer


@_eigh_inplace_op.register_fake
def _eigh_inplace_fake(a, check_errors, debug):
    return a.new_empty((*a.shape[:-2], a.shape[-1])), _info_fake(a)


_EIGH = torch.ops.kermac_like.eigh.default
_EIGH_INPLACE = torch.ops.kermac_like.eigh_inplace.default


# -- a blocked Cholesky whose trailing updates run on tensor cores in 3xTF32 (RFM's solve, issue 45) -----
def round_tf32(x: Tensor) -> Tensor:
    """x rounded to TF32 (10 explicit mantissa bits, round half up on the magnitude): exactly what a
    tensor core multiplies, so that x - round(x) is exact in float32 (the 3xTF32 split's low part)."""
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def cholesky_3xtf32_(a: Tensor, *, block: int | None = None) -> int:
    """Factor the symmetric positive definite float32 matrix ``a`` (N, N) in place into its lower
    Cholesky factor L (a = L L^T; the strict upper triangle is zeroed); returns 0, or the 1-based
    column where the factorisation broke down (a is then partly overwritten). Reads the lower
    triangle only.

    Blocked right-looking: per panel of ``block`` columns (default 512, 1024 beyond N = 30 000) the
    diagonal block by torch.linalg.cholesky_ex (cuSOLVER), the panel below it by a triangular solve
    (float32), and the trailing lower part minus P P^T in a few column groups, each one matrix
    product of [P_hi | P_lo | P_hi] and [P_hi | P_hi | P_lo] (P = P_hi + P_lo, P_hi rounded to TF32):
    P_hi P_hi^T + P_lo P_hi^T + P_hi P_lo^T accumulated in float32, the 3xTF32 scheme (float32-level
    products: P_lo's own TF32 rounding is ~2^-21 of P) with TF32 tensor cores on a GPU
    (torch.backends.cuda.matmul.allow_tf32 around those products only; the panel's solve in float32). n^3 / 3 flops x 3 on tensor cores against
    float32 cuSOLVER's n^3 / 3 on the FP32 pipe (bench/notes/rfm.md, "(b)"). On the CPU the same
    algorithm runs in float32 (the TF32 rounding of P_lo then not applied: products are exact float32),
    for tests. Memory: the matrix in place plus two panels of N x 3 block floats.

    The error is meant to be float32 Cholesky's (backward error ~ N eps |A|), not TF32's: so on the CPU (tests);
    on an H200 (session 23) the factor's relative error was 1.5e-3 against float32 potrf's 2.2e-5 while the panel's
    triangular solve ran with TF32 allowed, now in float32; not yet measured since (bench/notes/rfm.md).

    >>> import torch
    >>> from kermac_like.linalg import cholesky_3xtf32_
    >>> g = torch.Generator().manual_seed(0)
    >>> b = torch.randn(300, 300, generator=g)
    >>> a = b @ b.T + 300 * torch.eye(300)
    >>> want = torch.linalg.cholesky(a)
    >>> cholesky_3xtf32_(a, block=64)
    0
    >>> bool(torch.allclose(a, want, rtol=1e-4, atol=1e-4))
    True
    """
    if not isinstance(a, Tensor):
        raise TypeError(f"a: expected a torch.Tensor, got {type(a).__name__}")
    if a.dtype != torch.float32 or a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"a: expected a square float32 matrix, got {tuple(a.shape)} {a.dtype}")
    if not a.is_contiguous():
        raise ValueError("a: must be C-contiguous (it is factored in place)")
    n = a.shape[0]
    nb = int(block) if block is not None else (512 if n <= 30_000 else 1024)
    if nb < 1:
        raise ValueError(f"block: expected a positive integer, got {block!r}")
    cuda = a.is_cuda
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        # TF32 only for the trailing updates' products: cuBLAS's TRSM (and torch's other float32 calls) run as
        # float32 (with TF32 allowed, cuBLAS may run the panel solve on TF32 tensor cores too: 1.5e-3 relative
        # error of the factor at n = 4000 on an H200, session 23, against float32 potrf's 2.2e-5)
        torch.backends.cuda.matmul.allow_tf32 = False
        infos = []  # read once at the end: no host wait between panels (a failed panel's successors
        for k0 in range(0, n, nb):  # compute NaNs, and the first failure is reported)
            k1 = min(n, k0 + nb)
            lkk, info = torch.linalg.cholesky_ex(a[k0:k1, k0:k1])
            infos.append(info)
            a[k0:k1, k0:k1] = lkk
            if k1 == n:
                break
            p = torch.linalg.solve_triangular(lkk.mT, a[k1:, k0:k1], upper=True, left=False)  # A21 L^-T
            a[k1:, k0:k1] = p
            hi = round_tf32(p)
            lo = p - hi
            if not cuda:  # the tensor cores' rounding of the low part, modelled
                lo = round_tf32(lo)
            w = torch.cat([hi, lo, hi], 1)  # (n - k1, 3 nb)
            v = torch.cat([hi, hi, lo], 1)
            rest = n - k1
            width = max(nb, -(-rest // 4))  # four column groups: ~1/8 of the flops above the diagonal
            torch.backends.cuda.matmul.allow_tf32 = cuda
            for j0 in range(0, rest, width):
                j1 = min(rest, j0 + width)
                a[k1 + j0:, k1 + j0:k1 + j1].addmm_(w[j0:], v[j0:j1].mT, alpha=-1.0)
            torch.backends.cuda.matmul.allow_tf32 = False
        a.tril_()
        for k0, info in zip(range(0, n, nb), torch.stack(infos).tolist()):
            if info:
                return k0 + int(info)
        return 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
