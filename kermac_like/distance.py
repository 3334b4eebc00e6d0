"""The distance/kernel-matrix ops: :func:`run_kernel` and :func:`cdist`.

Data flow of one call: validate every argument (nothing is written before
all checks pass) -> choose a path (exact SIMT kernel, tensor-core kernel, or
the torch reference for CPU tensors, float64, pre-sm_80 GPUs and p in {0, inf})
-> describe operand layouts and fold the broadcast batch -> get the compiled
function (memory, cache, or NVRTC) -> launch on the current torch stream.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from . import _debug
from ._args import check_int, check_same, check_scalar_or_tensor, check_tensor
from .descriptor import PRESETS, KernelDescriptor
from .layout import Layout, analyse_matrix, analyse_output, batch_strides, broadcast_batch_shape, plan_batch
from .reference import cdist_reference, distance_reference
from .render import distance_spec, mma_spec, wgmma_prepare_needs, wgmma_prepare_spec, wgmma_spec

log = logging.getLogger("kermac_like.distance")

__all__ = ["run_kernel", "cdist", "COMPUTE_MODES"]

COMPUTE_MODES = (
    "use_mm_for_euclid_dist_if_necessary",
    "use_mm_for_euclid_dist",
    "donot_use_mm_for_euclid_dist",
)

_HYPERS = ("inner_p", "outer_p", "bandwidth", "regularization")


@dataclass
class DistanceCall:
    """A validated run_kernel call (everything the paths need)."""

    desc: KernelDescriptor
    a: torch.Tensor
    b: torch.Tensor
    hypers: dict  # name -> float | Tensor | None
    reg_diag: int
    epsilon: float | None
    batch: tuple
    M: int
    N: int
    K: int

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.M, self.N)

    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype


def prepare_call(descriptor, a, b, *, p=None, inner_p=None, outer_p=None, bandwidth=None, regularization=None,
                 regularization_offset_x=0, regularization_offset_y=0, epsilon=None) -> DistanceCall:
    """Validate a run_kernel call; raises TypeError/ValueError naming the argument."""
    if not isinstance(descriptor, KernelDescriptor):
        raise TypeError(f"descriptor: expected a KernelDescriptor, got {type(descriptor).__name__}")
    check_tensor("a", a)
    check_tensor("b", b)
    check_same("b", b, "a", a)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: last dimension {b.shape[-1]} differs from a's {a.shape[-1]} (the contracted K mode)")
    dev = a.device
    p = check_scalar_or_tensor("p", p, dev, nonnegative=True)
    inner_p = check_scalar_or_tensor("inner_p", inner_p, dev, nonnegative=True)
    outer_p = check_scalar_or_tensor("outer_p", outer_p, dev, positive=True)
    bandwidth = check_scalar_or_tensor("bandwidth", bandwidth, dev, positive=True)
    regularization = check_scalar_or_tensor("regularization", regularization, dev)
    epsilon = check_scalar_or_tensor("epsilon", epsilon, dev, nonnegative=True)
    if isinstance(epsilon, torch.Tensor):
        raise TypeError("epsilon: expected a real number")
    ox = check_int("regularization_offset_x", regularization_offset_x)
    oy = check_int("regularization_offset_y", regularization_offset_y)
    inner_p = inner_p if inner_p is not None else p
    outer_p = outer_p if outer_p is not None else p
    if descriptor.needs_inner_p:
        if inner_p is None:
            raise ValueError(f"p: {descriptor!r} has a POW inner power; pass p or inner_p")
        if isinstance(inner_p, float) and inner_p == 0:
            raise ValueError("inner_p: must be > 0 for a POW inner power (cdist(p=0) counts non-zeros instead)")
    else:
        inner_p = None
    if descriptor.needs_outer_p:
        if outer_p is None:
            raise ValueError(f"p: {descriptor!r} has a POW outer power; pass p or outer_p")
        if isinstance(outer_p, float) and outer_p == 0:
            raise ValueError("outer_p: must be > 0 (the outer power is x^(1/outer_p))")
    else:
        outer_p = None
    if descriptor.needs_bandwidth:
        if bandwidth is None:
            raise ValueError(f"bandwidth: {descriptor!r} has a {descriptor.kernel_type.name} epilogue; pass bandwidth")
    else:
        bandwidth = None
    hypers = dict(inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth, regularization=regularization)
    shapes = {"a": tuple(a.shape[:-2]), "b": tuple(b.shape[:-2])}
    shapes.update({k: tuple(v.shape) for k, v in hypers.items() if isinstance(v, torch.Tensor)})
    batch = broadcast_batch_shape(shapes)
    return DistanceCall(descriptor, a, b, hypers, ox - oy, epsilon, batch, a.shape[-2], b.shape[-2], a.shape[-1])


# -- paths -----------------------------------------------------------------------------
def uses_mm(compute_mode: str, M: int, N: int) -> bool:
    """torch.cdist's choice between the matrix-product (norm expansion) and the
    direct-difference computation of p = 2 distances, mirrored so that both give
    the same NaN and inf: "use_mm_for_euclid_dist_if_necessary" takes the matrix
    product when either operand has more than 25 rows. Here the matrix-product
    path is the tensor-core kernel, the direct one the exact SIMT kernel."""
    if compute_mode == "use_mm_for_euclid_dist":
        return True
    return compute_mode == "use_mm_for_euclid_dist_if_necessary" and (M > 25 or N > 25)


def _gpu_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


def _run_reference(call: DistanceCall, out):
    return distance_reference(
        call.desc, call.a, call.b, reg_diag=call.reg_diag, epsilon=call.epsilon, out=out, **call.hypers
    )


def _plan(call: DistanceCall, tensors: dict):
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()
               if k in ("a", "b", "out")}
    for k, v in tensors.items():
        if k not in strides:
            strides[k] = batch_strides(call.batch, tuple(v.shape), tuple(v.stride()))
    return plan_batch(call.batch, strides)


def _aligned(plan, names, per: int) -> bool:
    """Every batch offset of these operands keeps a ``per``-element alignment."""
    return all(s % per == 0 for k in names for part in plan.strides[k] for s in part)


def _select(call: DistanceCall, out, hypers: dict, compute_mode: str, tf32: bool | None = None):
    """(spec, views, plan, path) for a GPU call, or None for the reference path.
    ``tf32``: plain TF32 allowed (default: torch's matmul setting, read now)."""
    if tf32 is None:
        tf32 = _tf32_allowed()
    tf32_types = (torch.float32, torch.float16, torch.bfloat16)
    if call.desc.is_euclidean and uses_mm(compute_mode, call.M, call.N) and call.dtype in tf32_types:
        av = analyse_matrix("a", call.a, prefer=Layout.ROW_MAJOR)
        bv = analyse_matrix("b", call.b, prefer=Layout.ROW_MAJOR)
        outv = analyse_matrix("out", out, copy_ok=False)  # checked by run_kernel (or freshly allocated)
        tensors = {"a": av.tensor, "b": bv.tensor, "out": outv.tensor, **hypers}
        plan = _plan(call, tensors)
        per = 16 // call.a.element_size()
        offsets_ok = _aligned(plan, ("a", "b"), per)
        spec = None
        if _wgmma_enabled(call.device):
            spec = wgmma_spec(call.desc, av, bv, outv, tf32=tf32, batch_offsets_ok=offsets_ok)
        if spec is None:
            spec = mma_spec(call.desc, av, bv, outv, tf32=tf32, batch_offsets_ok=offsets_ok)
        if spec is not None:
            return spec, (av, bv, outv), tensors, plan, "tensor-core"
    if call.dtype != torch.float32:
        return None
    av = analyse_matrix("a", call.a)
    bv = analyse_matrix("b", call.b)
    outv = analyse_matrix("out", out, copy_ok=False)  # checked by run_kernel (or freshly allocated)
    tensors = {"a": av.tensor, "b": bv.tensor, "out": outv.tensor, **hypers}
    plan = _plan(call, tensors)
    vec_ok = av.vector_ok() and bv.vector_ok() and _aligned(plan, ("a", "b"), 4)
    spec = distance_spec(call.desc, av.layout, bv.layout, outv.layout, 4 if vec_ok else 1)
    return spec, (av, bv, outv), tensors, plan, "simt"


def _launch_distance(call: DistanceCall, out, compute_mode: str, debug: bool):
    """Launch the chosen GPU kernel; returns None when only the reference path applies."""
    from .launcher import get_kernel, launch, max_active_clusters

    hypers = {}
    for k, v in call.hypers.items():
        if isinstance(v, torch.Tensor):
            hypers[k] = v if v.dtype == torch.float32 else v.float()  # at most batch-many scalars
    tf32 = _tf32_allowed()  # read once: the kernel and its b preparation must agree
    chosen = _select(call, out, hypers, compute_mode, tf32)
    if chosen is None:
        return None
    spec, (av, bv, outv), tensors, plan, path = chosen
    if plan.count == 0 or call.M == 0 or call.N == 0:
        return out
    device = call.device.index if call.device.index is not None else torch.cuda.current_device()
    kernel = get_kernel(spec, device, debug=debug)
    L = plan.count
    grid = (math.ceil(call.M / spec.launch.block_m), math.ceil(call.N / spec.launch.block_n), min(L, 65535))
    if spec.launch.persistent:  # the blocks (or clusters) walk all tiles of all batch entries
        c = spec.launch.cluster
        if c > 1:  # clusters of c CTAs over c vertically adjacent tiles
            grid = (min(-(-grid[0] // c) * grid[1] * L, max_active_clusters(kernel)), 1, 1)
        else:
            grid = (min(grid[0] * grid[1] * L, _sm_count(device)), 1, 1)
    if debug:
        log.debug("run_kernel %r: %s path, M=%d N=%d K=%d batch=%s (kernel modes %s, host loop %s)", call.desc, path,
                  call.M, call.N, call.K, call.batch, plan.modes, plan.outer)
    sa, sb, so = plan.strides["a"][1], plan.strides["b"][1], plan.strides["out"][1]
    eps = np.float32(-np.inf if call.epsilon is None else call.epsilon)
    offsets = {k: list(plan.outer_offsets(k)) for k in tensors}
    prepare = _WgmmaPrepare(call, plan, bv, spec, tf32, device, debug) if spec.kernel == WGMMA_KERNEL else None
    for i in range(len(offsets["a"])):
        def ptr(k):
            t = tensors[k]
            return t.data_ptr() + offsets[k][i] * t.element_size()

        args = [
            ptr("a"), ptr("b"), ptr("out"),
            np.int32(call.M), np.int32(call.N), np.int32(call.K),
            np.int64(av.ld), np.int64(bv.ld), np.int64(outv.ld),
            np.int32(L), np.int32(plan.modes[1]), np.int32(plan.modes[2]),
            *(np.int64(s) for s in sa), *(np.int64(s) for s in sb), *(np.int64(s) for s in so),
        ]
        for name in _HYPERS:
            v = hypers.get(name, call.hypers[name])
            if isinstance(v, torch.Tensor):
                s3 = plan.strides[name][1]
                args += [ptr(name), np.int64(s3[0]), np.int64(s3[1]), np.int64(s3[2]), np.float32(0.0)]
            else:
                args += [0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if v is None else v)]
        args += [np.int64(call.reg_diag), eps]
        if prepare is not None:
            args += prepare(ptr("b"))
        launch(kernel, grid, tuple(args), debug=debug)
    return out


WGMMA_KERNEL = "kermac_like::distance_wgmma_kernel"
WGMMA_BLOCK_K = 16  # DistanceWgmmaTraits::kBlockK (= WgmmaPrepareTraits::kTileK)


def b_entries(modes, strides) -> tuple:
    """The entries of b itself among the kernel batch modes ``modes`` (b's element
    strides ``strides``, 0 where b broadcasts): (extents, index strides) such that
    batch entry (l0, l1, l2) reads entry l0 c0 + l1 c1 + l2 c2 of the extents
    (e0, e1, e2), row-major; e_i = 1 and c_i = 0 where b broadcasts."""
    ext = tuple(n if s else 1 for n, s in zip(modes, strides))
    return ext, (ext[1] * ext[2] if strides[0] else 0, ext[2] if strides[1] else 0, 1 if strides[2] else 0)


class _WgmmaPrepare:
    """What distance_wgmma_kernel reads besides the flat ABI: b in the kernel's
    shared-memory image (with B small for 3xTF32) and the b row norms (distances),
    written by wgmma_prepare_b_kernel on the same stream before each launch
    (cuda_templates/distance_wgmma.cuh has the layout). The buffers cover the entries of
    b itself (1 where b broadcasts over the folded batch) and serve every host-loop
    launch in turn (stream order). Scratch: about b's size (twice for 3xTF32), padded
    to whole 256 x 16 tiles."""

    def __init__(self, call: DistanceCall, plan, bv, spec, tf32: bool, device: int, debug: bool):
        from .launcher import get_kernel

        small, norms = wgmma_prepare_needs(call.desc, tf32=tf32)
        self.spec = wgmma_prepare_spec(small=small, norms=norms)
        sb = plan.strides["b"][1]
        ext, self.entry = b_entries(plan.modes, sb)
        self.ext, self.strides, self.bv = ext, sb, bv
        self.N, self.K = call.N, call.K
        self.n_pad = -(-call.N // spec.launch.block_n) * spec.launch.block_n  # whole 256-row tiles
        k_pad = -(-call.K // WGMMA_BLOCK_K) * WGMMA_BLOCK_K  # whole 16-column k-tiles
        entries = math.prod(ext)
        self.rows = entries * self.n_pad
        dev = call.device
        self.blocks = torch.empty(self.rows * k_pad * (2 if small else 1), dtype=torch.float32, device=dev)
        self.norms = torch.empty(self.rows if norms else 0, dtype=torch.float32, device=dev)
        self.kernel = get_kernel(self.spec, device, debug=debug)
        self.debug = debug

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else 0

    def __call__(self, b_ptr: int) -> list:
        from .launcher import launch

        s0, s1, s2 = self.strides
        args = (b_ptr, np.int32(self.N), np.int32(self.K), np.int64(self.bv.ld), np.int32(self.ext[1]),
                np.int32(self.ext[2]), np.int64(s0), np.int64(s1), np.int64(s2), np.int64(self.rows),
                self.blocks.data_ptr(), self._ptr(self.norms), np.int32(self.n_pad))
        grid = (-(-self.rows // self.spec.launch.block_m), 1, 1)
        launch(self.kernel, grid, args, debug=self.debug)
        return [self.blocks.data_ptr(), self._ptr(self.norms), *(np.int64(c) for c in self.entry)]


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _wgmma_enabled(device) -> bool:
    """The sm_90a (wgmma) kernel serves float32 tensor-core calls on sm_90 devices
    (cdist p=2 at 30000^2 x 1024 on an H200: 28.4 ms with mma.sync, 16.4 ms; same error);
    ``KERMAC_LIKE_WGMMA=0`` keeps them on the mma.sync kernel."""
    if os.environ.get("KERMAC_LIKE_WGMMA", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


def forward(call: DistanceCall, out=None, *, compute_mode: str = COMPUTE_MODES[0], debug: bool = False):
    """Compute a validated call (no autograd). ``out`` was validated by the caller."""
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    if call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.a):
        res = _launch_distance(call, out, compute_mode, debug)
        if res is not None:
            return res
    if debug:
        log.debug("run_kernel %r: reference path (%s, %s)", call.desc, call.device, call.dtype)
    return _run_reference(call, out)


def _check_out(out, shape, dtype, device):
    if out is not None:
        analyse_output("out", out, shape, dtype, device)


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


# -- public API ----------------------------------------------------------------------------
def run_kernel(descriptor: KernelDescriptor, a: torch.Tensor, b: torch.Tensor, *, out=None, p=None, inner_p=None,
               outer_p=None, bandwidth=None, regularization=None, regularization_offset_x: int = 0,
               regularization_offset_y: int = 0, epsilon=None, compute_mode: str = COMPUTE_MODES[0],
               debug: bool = False) -> torch.Tensor:
    """Fused kernel matrix ``out[..., m, n] = kernel(a[..., m, :], b[..., n, :])``.

    ``a`` is ``(..., M, K)``, ``b`` is ``(..., N, K)``; leading modes broadcast.
    ``p`` sets both ``inner_p`` and ``outer_p`` (for POW powers); ``bandwidth``
    is required by LAPLACE/GAUSSIAN epilogues; ``regularization`` adds lambda where
    ``m + regularization_offset_x == n + regularization_offset_y``; ``epsilon``
    zeroes distances below it.  Hyper-parameters are floats or tensors over batch
    modes (broadcasting with the data batch; their values are not inspected).
    ``out`` (any row- or column-major layout of the right shape) is written in
    place and returned; it is left untouched when an argument is rejected.
    """
    debug = _debug.resolve(debug)
    if compute_mode not in COMPUTE_MODES:
        raise ValueError(f"compute_mode: {compute_mode!r} is not one of {COMPUTE_MODES}")
    call = prepare_call(descriptor, a, b, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                        regularization=regularization, regularization_offset_x=regularization_offset_x,
                        regularization_offset_y=regularization_offset_y, epsilon=epsilon)
    _check_out(out, call.out_shape, call.dtype, call.device)
    if _needs_grad(a, b, *call.hypers.values()):
        from .autograd import distance_with_grad

        return distance_with_grad(call, out, compute_mode, debug)
    return forward(call, out, compute_mode=compute_mode, debug=debug)


def _cdist_by_torch(x1, x2, p: float, out):
    """p = 0 or inf: torch.cdist itself, so that NaN and inf behave exactly as there
    (torch's p = inf maximum skips NaN on the CPU, p = 0 counts |NaN| as NaN); 16-bit
    inputs, which torch.cdist does not take on every device, through float32 (exact:
    p = 0 counts, p = inf picks one |difference|)."""
    if x1.dtype in (torch.float32, torch.float64):
        res = torch.cdist(x1, x2, p=p)
    else:
        res = torch.cdist(x1.float(), x2.float(), p=p).to(x1.dtype)
    if out is None:
        return res
    return out.copy_(res)


def cdist(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, *, out=None, skip_epilogue: bool = False,
          compute_mode: str = COMPUTE_MODES[0], debug: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.cdist``: p-norm distances between the rows of x1 (..., M, K)
    and x2 (..., N, K), batch modes broadcast, any ``p >= 0`` or ``inf``.

    ``skip_epilogue=True`` returns ``sum |x - y|^p`` without the ``1/p`` root.
    p = 1 and p = 2 use pow-free kernels; p = 2 runs on tensor cores (3xTF32,
    fp32-grade) where torch.cdist would take its matrix-product path (``compute_mode``
    "use_mm_for_euclid_dist", or the default with more than 25 rows in x1 or x2), and on
    the exact kernel otherwise, so that NaN and inf come out as in torch.cdist; on sm_90 that
    path takes temporary GPU memory of about x2's size (twice for 3xTF32) for x2 in
    the kernel's tile layout.
    p = 0 and p = inf call torch.cdist; float64 inputs, and float16/bfloat16 inputs off
    the tensor-core path, take the torch reference path (on the inputs' device).
    """
    debug = _debug.resolve(debug)
    check_tensor("x1", x1)
    check_tensor("x2", x2)
    check_same("x2", x2, "x1", x1)
    p = check_scalar_or_tensor("p", p, x1.device, nonnegative=True, allow_inf=True)
    if isinstance(p, torch.Tensor):
        raise TypeError("p: cdist takes a real number (use run_kernel for per-batch p)")
    if compute_mode not in COMPUTE_MODES:
        raise ValueError(f"compute_mode: {compute_mode!r} is not one of {COMPUTE_MODES}")
    if x1.shape[-1] != x2.shape[-1]:
        raise ValueError(f"x2: last dimension {x2.shape[-1]} differs from x1's {x1.shape[-1]}")
    if p == 0 or math.isinf(p):
        batch = broadcast_batch_shape({"x1": tuple(x1.shape[:-2]), "x2": tuple(x2.shape[:-2])})
        _check_out(out, (*batch, x1.shape[-2], x2.shape[-2]), x1.dtype, x1.device)
        if debug:
            log.debug("cdist p=%s: reference path", p)
        if _needs_grad(x1, x2):
            return torch.cdist(x1, x2, p=p)
        return _cdist_by_torch(x1, x2, p, out)
    if p == 1:
        desc, kw = PRESETS["l1"], {}
    elif p == 2:
        desc, kw = (PRESETS["squared_l2"] if skip_epilogue else PRESETS["l2"]), {}
    else:
        desc, kw = (PRESETS["p_norm_skip_root"] if skip_epilogue else PRESETS["p_norm"]), {"p": p}
    return run_kernel(desc, x1, x2, out=out, compute_mode=compute_mode, debug=debug, **kw)
