"""Kernel matrix-vector products without the matrix: :func:`kernel_matvec`.

``out[..., m, c] = sum_n k(x_m, y_n) v[n, c]`` (plus lambda v[m + offset_x - offset_y, c]
on run_kernel's regularised diagonal) for any :class:`KernelDescriptor`, in memory
linear in M + N: the GPU path is one fused kernel (cuda_templates/matvec.cuh), the CPU
and float64 path computes the kernel matrix in row and column blocks of bounded size.

Internal entry points (used by the backward and by lazy kernel operators):
:func:`prepare_matvec` (validation -> :class:`MatvecCall`), :func:`matvec_forward`
(no autograd) and :func:`matvec_reference`.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import _debug
from ._args import check_int, check_same, check_scalar_or_tensor, check_tensor
from .descriptor import KernelDescriptor
from .distance import prepare_call
from .layout import analyse_output, batch_strides, broadcast_batch_shape, plan_batch
from .matvec_spec import MAX_C, combine_spec, matvec_spec
from .reference import BLOCK_ELEMENTS, distance_reference

log = logging.getLogger("kermac_like.matvec")

__all__ = ["kernel_matvec", "MatvecCall", "prepare_matvec", "matvec_forward", "matvec_reference",
           "SCRATCH_BYTES"]

_HYPERS = ("inner_p", "outer_p", "bandwidth", "regularization")

# Largest split-N scratch (float32 partial sums) one call allocates on the GPU.
SCRATCH_BYTES = 32 << 20


@dataclass(frozen=True)
class MatvecCall:
    """A validated kernel_matvec call. ``v`` is always a matrix ``(..., N, C)`` (a 1-D
    right-hand side was given a trailing mode of 1 and ``vector`` is set)."""

    desc: KernelDescriptor
    x: torch.Tensor
    y: torch.Tensor
    v: torch.Tensor
    hypers: dict  # inner_p/outer_p/bandwidth/regularization -> float | Tensor | None
    reg_diag: int  # entry (m, n) is regularised where n - m == reg_diag
    epsilon: float | None
    batch: tuple
    M: int
    N: int
    K: int
    C: int
    vector: bool

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.M) if self.vector else (*self.batch, self.M, self.C)

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def with_v(self, v: torch.Tensor) -> "MatvecCall":
        """The same kernel matrix applied to another right-hand side ``(..., N, C')`` or ``(N,)``."""
        return _with_v(self, "v", v)

    def transposed(self, v: torch.Tensor) -> "MatvecCall":
        """K^T @ v: x and y swapped (every descriptor is symmetric), the regularised
        diagonal mirrored, ``v`` ``(..., M, C')`` or ``(M,)``."""
        t = replace(self, x=self.y, y=self.x, M=self.N, N=self.M, reg_diag=-self.reg_diag)
        return _with_v(t, "v", v)


def _rhs(name: str, v, x: torch.Tensor, N: int):
    """(matrix view (..., N, C), vector?) of a right-hand side, checked."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    check_tensor(name, v, min_dim=1)
    check_same(name, v, "x", x)
    vector = v.dim() == 1
    vm = v.unsqueeze(-1) if vector else v
    if vm.shape[-2] != N:
        raise ValueError(f"{name}: expected {N} rows (the points of y), got shape {tuple(v.shape)}")
    return vm, vector


def _with_v(call: MatvecCall, name: str, v) -> MatvecCall:
    vm, vector = _rhs(name, v, call.x, call.N)
    shapes = {"x": tuple(call.x.shape[:-2]), "y": tuple(call.y.shape[:-2]), name: tuple(vm.shape[:-2]),
              "batch": call.batch}
    batch = broadcast_batch_shape(shapes)
    return replace(call, v=vm, vector=vector, C=vm.shape[-1], batch=batch)


def prepare_matvec(descriptor, x, y, v, *, p=None, inner_p=None, outer_p=None, bandwidth=None,
                   regularization=None, regularization_offset_x=0, regularization_offset_y=0,
                   epsilon=None) -> MatvecCall:
    """Validate a kernel_matvec call; TypeError/ValueError naming the argument."""
    if not isinstance(descriptor, KernelDescriptor):
        raise TypeError(f"descriptor: expected a KernelDescriptor, got {type(descriptor).__name__}")
    check_tensor("x", x)
    check_tensor("y", y)
    check_same("y", y, "x", x)
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"y: last dimension {y.shape[-1]} differs from x's {x.shape[-1]} (the coordinates K)")
    vm, vector = _rhs("v", v, x, y.shape[-2])
    check_int("regularization_offset_x", regularization_offset_x)
    check_int("regularization_offset_y", regularization_offset_y)
    # Batch shapes first, named in this op's terms (prepare_call names its operands a and b).
    shapes = {"x": tuple(x.shape[:-2]), "y": tuple(y.shape[:-2]), "v": tuple(vm.shape[:-2])}
    named = dict(p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth, regularization=regularization)
    for k, h in named.items():
        h = check_scalar_or_tensor(k, h, x.device)
        if isinstance(h, torch.Tensor):
            shapes[k] = tuple(h.shape)
    broadcast_batch_shape(shapes)
    dc = prepare_call(descriptor, x, y, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                      regularization=regularization, regularization_offset_x=regularization_offset_x,
                      regularization_offset_y=regularization_offset_y, epsilon=epsilon)
    batch = broadcast_batch_shape({"x": dc.batch, "v": tuple(vm.shape[:-2])})
    return MatvecCall(descriptor, x, y, vm, dc.hypers, dc.reg_diag, dc.epsilon, batch, dc.M, dc.N, dc.K,
                      vm.shape[-1], vector)


def _check_out(call: MatvecCall, out) -> torch.Tensor:
    """``out`` as a matrix view (..., M, C), after the checks of a user-provided output."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(call.out_shape):
        raise ValueError(f"out: expected shape {tuple(call.out_shape)}, got {tuple(out.shape)}")
    om = out.unsqueeze(-1) if call.vector else out
    analyse_output("out", om, (*call.batch, call.M, call.C), call.dtype, call.device)
    return om


# -- reference path -------------------------------------------------------------------------
def _reference_blocks(call: MatvecCall) -> tuple:
    """(row block, column block) of the reference path: the kernel block of all batch
    entries stays within reference.BLOCK_ELEMENTS elements."""
    nb_batch = math.prod(call.batch) if call.batch else 1
    nb = max(1, min(call.N, 4096))
    mb = max(1, min(call.M, BLOCK_ELEMENTS // max(1, nb * nb_batch)))
    return mb, nb


def matvec_reference(call: MatvecCall, out=None) -> torch.Tensor:
    """The torch path: kernel blocks of at most BLOCK_ELEMENTS entries (row and column
    blocks) times blocks of v; computed in the inputs' dtype (float32 for float16/bfloat16).
    Memory beyond inputs and output: O(BLOCK_ELEMENTS + M C) whatever M and N."""
    dtype = call.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, y, v = call.x.to(work), call.y.to(work), call.v.to(work)
    hyp = {k: (h.to(work) if isinstance(h, torch.Tensor) else h) for k, h in call.hypers.items()}
    if out is None:
        out = torch.empty(call.out_shape, dtype=dtype, device=call.device)
    om = out.unsqueeze(-1) if call.vector else out
    M, N, C = call.M, call.N, call.C
    mb, nb = _reference_blocks(call)
    reg = hyp["regularization"]
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        acc = torch.zeros((*call.batch, m1 - m0, C), dtype=work, device=call.device)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            kb = distance_reference(call.desc, x[..., m0:m1, :], y[..., n0:n1, :], inner_p=hyp["inner_p"],
                                    outer_p=hyp["outer_p"], bandwidth=hyp["bandwidth"], regularization=reg,
                                    reg_diag=call.reg_diag - n0 + m0, epsilon=call.epsilon)
            acc += kb @ v[..., n0:n1, :]
        om[..., m0:m1, :] = acc
    return out


# -- GPU path ------------------------------------------------------------------------------
def _gpu_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_occupancy: dict = {}


def _blocks_per_sm(kernel) -> int:
    key = (kernel.device, kernel.spec)
    n = _occupancy.get(key)
    if n is None:
        try:
            n = int(kernel.function.occupancy.max_active_blocks_per_multiprocessor(kernel.spec.launch.threads, 0))
        except Exception:  # older cuda.core: the kernel's launch bound
            n = 2
        _occupancy[key] = n = max(1, n)
    return n


def choose_split(m_tiles: int, n_tiles: int, slots: int, max_split: int) -> int:
    """Splits of the N range: the fewest (at most ``max_split``, each split at least 4 y
    tiles) whose CTA count fills the last wave of ``slots`` concurrent CTAs to >= 97%,
    else the best fill. Depends on shapes and the device only (results are bitwise
    reproducible)."""
    limit = max(1, min(max_split, n_tiles // 4))
    if m_tiles >= 16 * slots:
        return 1
    best, best_eff = 1, -1.0
    for s in range(1, limit + 1):
        items = m_tiles * s
        waves = items / slots
        eff = waves / math.ceil(waves)  # fill of the last wave
        if items < 2 * slots:  # a GPU not yet twice full: more splits help regardless
            eff *= items / (2 * slots)
        if eff > best_eff * 1.01:
            best, best_eff = s, eff
        if eff >= 0.97:
            break
    return best


def _launch_matvec(call: MatvecCall, om: torch.Tensor, debug: bool) -> None:
    from .launcher import get_kernel, launch

    device = call.device.index if call.device.index is not None else torch.cuda.current_device()
    hypers = {k: (h.float() if isinstance(h, torch.Tensor) and h.dtype != torch.float32 else h)
              for k, h in call.hypers.items()}
    tensors = {"x": call.x, "y": call.y, "v": call.v, "out": om}
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()}
    for k, h in hypers.items():
        if isinstance(h, torch.Tensor):
            tensors[k] = h
            strides[k] = batch_strides(call.batch, tuple(h.shape), tuple(h.stride()))
    plan = plan_batch(call.batch, strides)
    L = plan.count
    if L == 0 or call.M == 0 or call.C == 0:
        return
    if call.N == 0:
        om.zero_()
        return
    M, N, K = call.M, call.N, call.K
    eps = np.float32(0.0 if call.epsilon is None else call.epsilon)
    sxm, sxk = call.x.stride()[-2:]
    sym, syk = call.y.stride()[-2:]
    svn, svc = call.v.stride()[-2:]
    som, soc = om.stride()[-2:]
    offsets = {k: list(plan.outer_offsets(k)) for k in tensors}
    kernel = combine = None
    for c0 in range(0, call.C, MAX_C):
        cc = min(MAX_C, call.C - c0)
        spec = matvec_spec(call.desc, call.dtype, K, cc, epsilon=call.epsilon)
        if kernel is None or kernel.spec != spec:
            kernel = get_kernel(spec, device, debug=debug)
        m_tiles = -(-M // spec.launch.block_m)
        n_tiles = -(-N // spec.launch.block_n)
        slots = _sm_count(device) * _blocks_per_sm(kernel)
        max_split = max(1, SCRATCH_BYTES // (4 * L * M * cc))
        split = choose_split(m_tiles * min(L, 65535), n_tiles, slots, max_split)
        per = -(-n_tiles // split)
        split = -(-n_tiles // per)
        part = None
        if split > 1:
            part = torch.empty(split * L * M * cc, dtype=torch.float32, device=call.device)
            if combine is None:
                combine = get_kernel(combine_spec(call.dtype), device, debug=debug)
        grid = (m_tiles, split, min(L, 65535))
        if debug:
            log.debug("kernel_matvec %r: M=%d N=%d K=%d C=%d (columns %d..%d) batch=%s: grid %s, %d y tiles per "
                      "split", call.desc, M, N, K, call.C, c0, c0 + cc, call.batch, grid, per)
        for i in range(len(offsets["x"])):
            def ptr(k, extra=0):
                t = tensors[k]
                return t.data_ptr() + (offsets[k][i] + extra) * t.element_size()

            bs = {k: plan.strides[k][1] for k in ("x", "y", "v", "out")}
            args = [ptr("x"), ptr("y"), ptr("v", c0 * svc), ptr("out", c0 * soc),
                    part.data_ptr() if part is not None else 0,
                    np.int32(M), np.int32(N), np.int32(K), np.int32(cc),
                    *(np.int64(s) for s in (sxm, sxk, sym, syk, svn, svc, som, soc)),
                    np.int32(L), np.int32(plan.modes[1]), np.int32(plan.modes[2]),
                    *(np.int64(s) for k in ("x", "y", "v", "out") for s in bs[k])]
            hyper_args = []
            for name in _HYPERS:
                h = hypers[name]
                if isinstance(h, torch.Tensor):
                    s3 = plan.strides[name][1]
                    hyper_args.append([ptr(name), np.int64(s3[0]), np.int64(s3[1]), np.int64(s3[2]), np.float32(0)])
                else:
                    hyper_args.append([0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if h is None else h)])
            args += [a for h in hyper_args for a in h]
            args += [np.int64(call.reg_diag), eps, np.int32(split), np.int32(per)]
            launch(kernel, grid, tuple(args), debug=debug)
            if split > 1:
                total = L * M * cc
                cgrid = (max(1, min(-(-total // 256), _sm_count(device) * 8)), 1, 1)
                cargs = (part.data_ptr(), ptr("v", c0 * svc), ptr("out", c0 * soc), np.int32(M), np.int32(N),
                         np.int32(cc), np.int64(svn), np.int64(svc), np.int64(som), np.int64(soc), np.int32(L),
                         np.int32(plan.modes[1]), np.int32(plan.modes[2]),
                         *(np.int64(s) for k in ("v", "out") for s in bs[k]), *hyper_args[3],
                         np.int64(call.reg_diag), np.int32(split))
                launch(combine, cgrid, cargs, debug=debug)


def matvec_forward(call: MatvecCall, out=None, *, debug: bool = False) -> torch.Tensor:
    """Compute a validated call without autograd. ``out`` was checked by the caller (or is None).

    GPU memory beyond inputs and output: float32 tensor hyper-parameters (batch-many
    scalars) and, when the N range is split across CTAs (few rows of x), split partial
    sums of at most SCRATCH_BYTES; never anything of size M x N."""
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    om = out.unsqueeze(-1) if call.vector else out
    if call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.x):
        _launch_matvec(call, om, debug)
        return out
    if debug:
        log.debug("kernel_matvec %r: reference path (%s, %s)", call.desc, call.device, call.dtype)
    return matvec_reference(call, out)


def _needs_grad(call: MatvecCall) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (call.x, call.y, call.v, *call.hypers.values()))


def kernel_matvec(descriptor: KernelDescriptor, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, *, out=None,
                  p=None, inner_p=None, outer_p=None, bandwidth=None, regularization=None,
                  regularization_offset_x: int = 0, regularization_offset_y: int = 0, epsilon=None,
                  debug: bool = False) -> torch.Tensor:
    """Kernel matrix times ``v`` without the kernel matrix:
    ``out[..., m, c] = sum_n K[..., m, n] v[..., n, c]`` with ``K = run_kernel(descriptor, x,
    y, ...)`` (same descriptor semantics, hyper-parameters, broadcasting and regularisation:
    ``regularization`` is added to K where ``m + regularization_offset_x == n +
    regularization_offset_y``).

    ``x`` is ``(..., M, K)``, ``y`` ``(..., N, K)``; ``v`` follows torch.matmul: a 1-D ``(N,)``
    gives ``(..., M)``, a ``(..., N, C)`` matrix gives ``(..., M, C)``; batch modes of x, y, v
    and tensor hyper-parameters broadcast. dtypes: float32; float16/bfloat16 (float32
    accumulation, output in the input dtype); float64 and CPU tensors take the torch
    reference path (row and column blocks).

    Memory (GPU) beyond inputs and output: O((M + N) C) at most, never M x N: at most
    ``SCRATCH_BYTES`` (32 MB) of float32 split-N partial sums when M is small, plus
    batch-many float32 hyper-parameters. The sums are accumulated per y tile in float32 and
    across tiles in float64, and combined in a fixed order: results are bitwise identical
    from run to run. NaN/inf propagate like the dense product (an infinite distance gives
    k = 0, a NaN gives NaN; on the Gaussian's fast path a pair of infinite coordinates
    gives 0 rather than NaN).

    ``out`` (any strides with a unit-stride or size-1 mode, no overlap) is written in place
    and returned; it is left untouched when an argument is rejected.
    """
    debug = _debug.resolve(debug)
    call = prepare_matvec(descriptor, x, y, v, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                          regularization=regularization, regularization_offset_x=regularization_offset_x,
                          regularization_offset_y=regularization_offset_y, epsilon=epsilon)
    if out is not None:
        _check_out(call, out)
    if _needs_grad(call):
        try:
            from .matvec_grad import matvec_with_grad
        except ImportError:
            raise NotImplementedError("kernel_matvec: gradients are not available in this build; "
                                      "call it under torch.no_grad() or detach the inputs") from None
        return matvec_with_grad(call, out, debug)
    return matvec_forward(call, out, debug=debug)
