"""The planner: one place that decides how a validated call runs.

A rule per op turns (descriptor, tensors, hyper-parameters, device, settings) into an
immutable :class:`Plan`:

* ``family``: which kernel family serves the call ("distance", "distance_lowk", "distance_mma",
  "distance_wgmma", "cdist_grad", "cdist_grad_mma") or "reference" (the torch path:
  CPU tensors, float64, GPUs before sm_80, shapes the kernels do not take);
* ``spec``: the main template instantiation (:mod:`kermac_like.runtime.specs`);
* ``launches``: every kernel launch in stream order, each with its grid and its
  argument tuple (the flat ABI of ``cuda_templates/ABI.md``): preparation steps
  (the wgmma b layout) come right before the launch that reads them, and batch modes
  that do not fold into the kernel's three repeat the pair once per host-loop entry;
* ``scratch``: temporary tensors the launches read (kept alive by the plan);
* ``reference``: the callable of the reference path (family "reference").

The op executes the plan top to bottom with :meth:`Plan.run`. Settings that steer the
choice are read once per call into :class:`Settings`. Distance plans are built as
templates (pointer arguments symbolic) kept per call signature, so a repeated call only
fills in its pointers and allocates its scratch (bench/notes/ops.md). A new kernel family is one
template, one spec module (runtime/specs) and one rule here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from .descriptor import KernelDescriptor
from .layout import Layout, analyse_matrix, batch_strides, plan_batch
from .reference import cdist_grad_reference
from . import torch_path
from .runtime import autotune
from .runtime.autotune import uses_mm  # noqa: F401  (torch.cdist's matrix-product rule, re-exported)
from .runtime.specs import (
    LOWK_GENERIC_MAX_K,
    LOWK_MAX_K,
    LOWK_MIN_BLOCKS,
    default_distance_tuning,
    desc_mm_ok,
    lowk_spec,
    lowk_tiles_n,
    distance_spec,
    grad_kernel_spec,
    mma_spec,
    wgmma_prepare_needs,
    wgmma_prepare_spec,
    wgmma_spec,
)
from .runtime.specs.matvec import MAX_C, c_bucket, combine_spec, matvec_spec, part_bytes
from .runtime.specs.matvec_wgmma import carry_spec, matvec_wgmma_spec

log = logging.getLogger("kermac_like.distance")
log_grad = logging.getLogger("kermac_like.grad")

__all__ = ["Settings", "Launch", "Plan", "DistanceCall", "plan_distance", "run_distance", "plan_cdist_grad", "b_entries",
           "plan_matvec", "choose_split", "MATVEC_SCRATCH_BYTES", "MATVEC_WGMMA_BLOCK_BYTES"]

# The hyper-parameters of the distance ABI, in argument order.
HYPERS = ("inner_p", "outer_p", "bandwidth", "regularization")


# -- what a plan is ------------------------------------------------------------------------
class Settings(NamedTuple):
    """Global switches a plan depends on, read once per call.

    ``tf32``: torch's ``allow_tf32`` matmul flag (plain TF32 instead of 3xTF32; the
    wgmma kernel and its b preparation must agree, hence read once); ``wgmma``:
    ``KERMAC_LIKE_WGMMA != "0"``; ``wgmma_always``: ``KERMAC_LIKE_WGMMA == "always"``
    (also the calls of a few output tiles, which otherwise take the one-launch mma.sync
    kernel: :func:`_few_tiles`); ``grad_mma``: ``KERMAC_LIKE_GRAD_MMA != "0"``."""

    tf32: bool
    wgmma: bool
    grad_mma: bool
    wgmma_always: bool = False

    @staticmethod
    def current() -> "Settings":
        env = os.environ
        wgmma = env.get("KERMAC_LIKE_WGMMA", "1")
        return Settings(bool(torch.backends.cuda.matmul.allow_tf32), wgmma != "0",
                        env.get("KERMAC_LIKE_GRAD_MMA", "1") != "0", wgmma == "always")


class Launch(NamedTuple):
    kernel: object  # runtime.launcher.LoadedKernel
    grid: tuple
    args: tuple
    block: object = None  # runtime.launcher.ArgBlock of a cached template's launch


class Plan(NamedTuple):
    family: str
    spec: object  # KernelSpec of the main kernel, None for the reference path
    launches: tuple  # of Launch, in stream order
    out: torch.Tensor | None
    scratch: tuple = ()
    reference: Callable | None = None
    debug: bool = False

    def run(self):
        """Execute the plan; returns the result (``out``, or the reference's result)."""
        if self.reference is not None:
            return self.reference()
        if self.launches:
            from .runtime.launcher import launch

            for k, grid, args, block in self.launches:
                launch(k, grid, args, debug=self.debug, block=block)
        return self.out


def _reference_plan(fn: Callable, debug: bool) -> Plan:
    return Plan("reference", None, (), None, reference=fn, debug=debug)


def _gpu_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_per_sm(device: int) -> int:
    """Shared memory of one SM in bytes; 0 where torch does not report it."""
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", 0) or 0)


def _aligned(plan, names, per: int) -> bool:
    """Every batch offset of these operands keeps a ``per``-element alignment."""
    return all(s % per == 0 for k in names for part in plan.strides[k] for s in part)


# -- distance: run_kernel and cdist ----------------------------------------------------------
@dataclass
class DistanceCall:
    """A validated run_kernel call (everything the planner needs)."""

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
    autotune: bool | None = None  # measure the kernel choice (None: runtime.autotune's setting)

    @classmethod
    def of(cls, desc: KernelDescriptor, a, b, hypers: dict, reg_diag: int, epsilon) -> "DistanceCall":
        """A call from already-checked arguments (the batch: a, b and tensor hyper-parameters broadcast)."""
        shapes = [a.shape[:-2], b.shape[:-2]] + [v.shape for v in hypers.values() if isinstance(v, torch.Tensor)]
        batch = tuple(torch.broadcast_shapes(*shapes))
        return cls(desc, a, b, hypers, reg_diag, epsilon, batch, a.shape[-2], b.shape[-2], a.shape[-1])

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.M, self.N)

    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype


def _wgmma_enabled(device, settings: Settings | None = None) -> bool:
    """The sm_90a (wgmma) kernel serves float32 tensor-core calls on sm_90 devices
    (cdist p=2 at 30000^2 x 1024 on an H200: 28.4 ms with mma.sync, 16.4 ms; same error);
    ``KERMAC_LIKE_WGMMA=0`` keeps them on the mma.sync kernel."""
    if settings is None:
        settings = Settings.current()
    if not settings.wgmma or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


# Calls whose output the wgmma kernel would cover with at most this many 128 x 256 tiles
# (and K at most _FEW_TILES_MAX_K) run the mma.sync kernel: one launch instead of the b
# preparation plus the kernel, at sizes where both take a few microseconds of GPU time
# and the host's launches are the cost (256 x 256 x 8: bench/host_overhead.py).
_FEW_TILES = 8
_FEW_TILES_MAX_K = 1024


def _few_tiles(call: DistanceCall) -> bool:
    if call.K > _FEW_TILES_MAX_K:
        return False
    *batch, M, N = call.out_shape
    tiles = -(-M // 128) * -(-N // 256)
    for b in batch:
        tiles *= b
    return tiles <= _FEW_TILES


def _batch_plan(call: DistanceCall, tensors: dict):
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()
               if k in ("a", "b", "out")}
    for k, v in tensors.items():
        if k not in strides:
            strides[k] = batch_strides(call.batch, tuple(v.shape), tuple(v.stride()))
    return plan_batch(call.batch, strides)


def _padded_for_tensor_cores(call: DistanceCall) -> DistanceCall:
    """The call with a and b zero-padded along K to whole 16-byte rows when K is not a
    multiple of 16 bytes (the tensor-core kernels need aligned rows): x.y and |x - y|^2
    are unchanged by zero columns; one copy of each input (M x K and N x K elements),
    small beside the M x N output it unlocks (K = 37 at 20000^2: cdist p=2 3.05 -> 0.80 ms
    on an H200, bench/notes/lowk.md)."""
    per = 16 // call.a.element_size()
    if call.K % per == 0 or not call.desc.is_euclidean:
        return call
    Kp = -(-call.K // per) * per
    a, b = _pad_pair(call.a, call.b, Kp)
    return dataclasses.replace(call, a=a, b=b, K=Kp)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _pad_pair(a: torch.Tensor, b: torch.Tensor, Kp: int) -> tuple:
    """a and b zero-padded to Kp columns; one copy when they are the same memory, so that
    the kernels still see a == b (their exact zero self-distance diagonal)."""
    pa = _pad_k(a, Kp)
    return pa, (pa if _same_memory(a, b) else _pad_k(b, Kp))


def _pad_k(t: torch.Tensor, Kp: int) -> torch.Tensor:
    """``t`` zero-padded along its last mode to ``Kp`` columns (a fresh row-major tensor)."""
    return torch.nn.functional.pad(t, (0, Kp - t.shape[-1]))


# The SIMT kernel copies a k-contiguous (row-major) operand into its k-major shared tiles with
# one 4-byte cp.async per element, and at large K those copies throttle the load/store unit
# (ncu: lg_throttle, the kernel's largest stall). A k-major copy of the operand made before
# the launch lets it copy 16 bytes at a time: cdist p=1 at 30000^2 x 1024 on an H200
# 76.6 -> 69.2 ms with the copies' time included, 20000^2 x 256 8.92 -> 8.26 ms
# (bench/probes/p1_layouts.py, bench/notes/distance.md). The copies are temporary memory
# beside the output (the one exception to "nothing but the output", with the tensor-core
# paths' padded copies and b image), so they are made only for large outputs and when
# they hold at most a quarter of the output's elements. At 4096^2 x 512 the copies cost what
# they save (0.79 ms without, 0.84 with): from 2^25 output elements (5793^2) on.
_KMAJOR_MIN_K = 64
_KMAJOR_MIN_OUT = 1 << 25  # output elements over the batch
_KMAJOR_MIN_ROWS = 128  # rows of a and of b (one output tile)
_KMAJOR_MAX_SHARE = 4  # copies <= output elements / this


def _kmajor_worthwhile(call: DistanceCall) -> bool:
    """Whether a SIMT call reads k-major copies of its operands (see above)."""
    if call.dtype != torch.float32 or call.K < _KMAJOR_MIN_K or min(call.M, call.N) < _KMAJOR_MIN_ROWS:
        return False
    out = math.prod(call.out_shape)
    copies = (0 if _kmajor_ready(call.a) else call.a.numel()) + \
        (0 if _kmajor_ready(call.b) or _same_memory(call.a, call.b) else call.b.numel())
    return out >= _KMAJOR_MIN_OUT and 0 < copies * _KMAJOR_MAX_SHARE <= out


def _kmajor_ready(t: torch.Tensor) -> bool:
    """t is already m-contiguous with 16-byte aligned columns (what the k-major copy makes)."""
    return t.stride(-2) == 1 and t.stride(-1) % 4 == 0 and t.data_ptr() % 16 == 0


def _kmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., rows, K) as an m-contiguous copy: a (..., K, rows rounded up to 4) buffer,
    viewed back as (..., rows, K), so that every column starts 16-byte aligned."""
    if _kmajor_ready(t):
        return t
    rows, k = t.shape[-2], t.shape[-1]
    if rows % 4 == 0:  # torch's transposing copy into a fresh tensor (faster than copy_ into a view)
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    buf = torch.empty((*t.shape[:-2], k, -(-rows // 4) * 4), dtype=t.dtype, device=t.device)
    view = buf[..., :rows].transpose(-1, -2)
    view.copy_(t)
    return view


def _kmajor_pair(a: torch.Tensor, b: torch.Tensor) -> tuple:
    ka = _kmajor(a)
    return ka, (ka if _same_memory(a, b) else _kmajor(b))


def _lowk_serves(kind: str, K: int) -> bool:
    """Whether the low-K kernel serves an exact call of this kind (else the SIMT kernel)."""
    return kind == autotune.LOWK and K <= LOWK_GENERIC_MAX_K


def _select(call: DistanceCall, out, hypers: dict, compute_mode: str, settings: Settings, kind: str):
    """(spec, views, tensors, batch plan, family) for a GPU call served by ``kind``
    (runtime.autotune's kinds), or None for the reference path."""
    tf32 = settings.tf32
    tf32_types = (torch.float32, torch.float16, torch.bfloat16)
    if kind == autotune.TENSOR_CORE and call.desc.is_euclidean and call.dtype in tf32_types:
        av = analyse_matrix("a", call.a, prefer=Layout.ROW_MAJOR)
        bv = analyse_matrix("b", call.b, prefer=Layout.ROW_MAJOR)
        outv = analyse_matrix("out", out, copy_ok=False)  # checked by run_kernel (or freshly allocated)
        tensors = {"a": av.tensor, "b": bv.tensor, "out": outv.tensor, **hypers}
        bplan = _batch_plan(call, tensors)
        per = 16 // call.a.element_size()
        offsets_ok = _aligned(bplan, ("a", "b"), per)
        spec, family = None, "distance_mma"
        if _wgmma_enabled(call.device, settings) and (settings.wgmma_always or not _few_tiles(call)):
            spec, family = wgmma_spec(call.desc, av, bv, outv, tf32=tf32, batch_offsets_ok=offsets_ok), "distance_wgmma"
        if spec is None:
            spec, family = mma_spec(call.desc, av, bv, outv, tf32=tf32, batch_offsets_ok=offsets_ok), "distance_mma"
        if spec is not None:
            return spec, (av, bv, outv), tensors, bplan, family
        # Not applicable to these views (e.g. a misaligned batch offset): the exact kernels.
        kind = autotune.LOWK if autotune.LOWK in autotune.candidates(call.desc, call.dtype, call.K, "donot_use_mm_for_euclid_dist") \
            else autotune.SIMT
    if call.dtype != torch.float32:
        return None
    av = analyse_matrix("a", call.a)
    bv = analyse_matrix("b", call.b)
    outv = analyse_matrix("out", out, copy_ok=False)  # checked by run_kernel (or freshly allocated)
    tensors = {"a": av.tensor, "b": bv.tensor, "out": outv.tensor, **hypers}
    bplan = _batch_plan(call, tensors)
    if _lowk_serves(kind, call.K):
        # Row-major output only: a column-major out is computed as out^T = kernel(b, a).
        swap = outv.layout is Layout.COL_MAJOR
        first, second = (bv, av) if swap else (av, bv)
        M, N = (call.N, call.M) if swap else (call.M, call.N)
        # Mirroring torch.cdist's matrix product: its NaN/inf (autotune.candidates).
        mm = autotune.uses_mm(compute_mode, call.M, call.N) and desc_mm_ok(call.desc) and call.K <= LOWK_MAX_K
        tiles = lowk_tiles_n(call.K, M, N, bplan.count, LOWK_MIN_BLOCKS * _sm_count(_device_index(call.device)))
        spec = lowk_spec(call.desc, first.layout, second.layout, call.K, mm_nonfinite=mm, tiles_n=tiles)
        return spec, (av, bv, outv), tensors, bplan, "distance_lowk"
    # distance.cuh's 16-byte loader copies only the valid bytes of a column's last chunk.
    vec_ok = (av.vector_ok(whole_lines=False) and bv.vector_ok(whole_lines=False)
              and _aligned(bplan, ("a", "b"), 4))
    tuning = default_distance_tuning(call.desc, call.K, _smem_per_sm(_device_index(call.device)))
    spec = distance_spec(call.desc, av.layout, bv.layout, outv.layout, 4 if vec_ok else 1, tuning=tuning)
    return spec, (av, bv, outv), tensors, bplan, "distance"


def plan_distance(call: DistanceCall, out: torch.Tensor | None, compute_mode: str, debug: bool,
                  settings: Settings | None = None, call_key=None) -> Plan:
    """The plan of a validated run_kernel call writing ``out`` (checked; None: a fresh tensor,
    on the torch path its kernels' own result)."""
    if call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.a):
        if out is None:
            out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
        plan = _plan_distance_gpu(call, out, compute_mode, debug, settings or Settings.current(), call_key=call_key)
        if plan is not None:
            return plan
    if debug:
        log.debug("run_kernel %r: reference path (%s, %s)", call.desc, call.device, call.dtype)
    return _reference_plan(functools.partial(torch_path.distance, call, out, compute_mode), debug)


def run_distance(call: DistanceCall, out, compute_mode: str, debug: bool, call_key=None) -> torch.Tensor:
    """Plan and run a validated call (no autograd); ``out`` None or checked."""
    return plan_distance(call, out, compute_mode, debug, call_key=call_key).run()


WGMMA_KERNEL = "kermac_like::distance_wgmma_kernel"
WGMMA_BLOCK_K = 16  # DistanceWgmmaTraits::kBlockK (= WgmmaPrepareTraits::kTileK)


class _Ptr(NamedTuple):
    """A pointer argument of a launch template: tensor ``name``'s data plus ``offset`` bytes."""

    name: str
    offset: int


class _Template(NamedTuple):
    """A plan without its data: launches whose pointer arguments are :class:`_Ptr` (at
    ``positions``), and the float32 scratch buffers (name, elements) a call allocates.
    What a template depends on is the key of :func:`_distance_key`."""

    family: str
    spec: object
    launches: tuple  # of (kernel, grid, args, positions, ArgBlock or None)
    scratch: tuple  # of (name, numel)
    pad_k: int = 0  # a and b are read zero-padded to this many columns (a copy per call)
    kmajor: bool = False  # a and b are read from m-contiguous copies (a copy per call: _kmajor)


# Templates of recent calls, by _distance_key: a repeated call (same shapes, strides,
# alignment, dtype, descriptor, hyper-parameter kinds and settings) skips the layout
# analysis, batch folding, spec choice and argument packing, and only fills in pointers.
_TEMPLATES: dict = {}
_TEMPLATES_MAX = 512
# The same templates by the public op's own arguments (ops.distance's call keys), so that
# a repeated eager call skips the validation and planning its key implies.
_BY_CALL: dict = {}


def clear_templates() -> None:
    _TEMPLATES.clear()
    _BY_CALL.clear()


# The names replaced by the active spec_override and their (hashable) values: part of every
# template key, so that a template is reused only under the replacements it was built with
# (the key holds the values themselves: no id of a collected function is ever reused).
_OVERRIDES: tuple = ()


@contextlib.contextmanager
def spec_override(**values):
    """Tests and probes: names of this module (``lowk_spec``, ``lowk_tiles_n``,
    ``distance_spec``, ``LOWK_GENERIC_MAX_K``, ...) replaced inside the block. The
    template caches key everything of a call except the spec it gets, so plans made under
    the replacements are kept apart by the replacements themselves (hashable values; the
    same function objects in a later block find their templates again, so a timing loop
    may enter the block per call), and public calls inside the block neither use nor leave
    templates under their call keys."""
    global _OVERRIDES
    g = globals()
    unknown = sorted(k for k in values if k not in g)
    if unknown:
        raise ValueError(f"spec_override: kermac_like.plan has no {', '.join(unknown)}")
    saved, saved_key = {k: g[k] for k in values}, _OVERRIDES
    g.update(values)
    _OVERRIDES = saved_key + tuple(sorted(values.items()))
    try:
        yield
    finally:
        g.update(saved)
        _OVERRIDES = saved_key


def _distance_key(call: DistanceCall, out, compute_mode: str, settings: Settings):
    """Everything the distance template of a call depends on, or None when it cannot be
    reused (a hyper-parameter tensor that is not float32 is converted per call)."""
    hk = []
    for name in HYPERS:
        v = call.hypers[name]
        if isinstance(v, torch.Tensor):
            if v.dtype != torch.float32:
                return None
            hk.append((v.shape, v.stride()))
        else:
            hk.append(v)
    a, b = call.a, call.b
    return (call.desc, a.shape, a.stride(), b.shape, b.stride(), out.shape, out.stride(), a.dtype, a.device,
            a.data_ptr() % 16, b.data_ptr() % 16, tuple(hk), call.reg_diag, call.epsilon, compute_mode, settings)


def _instantiate(t: _Template, tensors: dict, device, debug: bool) -> Plan:
    """The plan of a template for these tensors (pointers filled in, scratch allocated)."""
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    scratch = []
    for name, numel in t.scratch:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        scratch.append(buf)
        ptrs[name] = buf.data_ptr()
    launches = []
    for kernel, grid, args, positions, block in t.launches:
        if positions:
            args = list(args)
            for i in positions:
                ref = args[i]
                args[i] = ptrs[ref.name] + ref.offset
            args = tuple(args)
        launches.append(Launch(kernel, grid, args, block))
    # Copies the layout analysis made (and float32 hyper-parameters) live as long as the plan.
    return Plan(t.family, t.spec, tuple(launches), tensors["out"], scratch=(*scratch, tensors), debug=debug)


def _launch_template(kernel, grid, args) -> tuple:
    args = tuple(args)
    return kernel, grid, args, tuple(i for i, v in enumerate(args) if isinstance(v, _Ptr)), None


def _with_arg_blocks(t: _Template) -> _Template:
    """The template with an ArgBlock per launch (packed once: a template that serves later
    calls; one built for a single call keeps cuda.core's launch)."""
    from .runtime.launcher import ArgBlock

    launches = tuple((k, g, a, pos, ArgBlock(k, g, a, pos) if ArgBlock.supports(a, pos) else None)
                     for k, g, a, pos, _ in t.launches)
    return t._replace(launches=launches)


def _instantiate_template(t: _Template, a, b, out, hyper_tensors: dict, device, debug: bool) -> Plan:
    """The plan of a cached template for the operands of a call (zero-padded copies of a
    and b where the template reads them padded)."""
    if t.pad_k:
        a, b = _pad_pair(a, b, t.pad_k)
    if t.kmajor:
        a, b = _kmajor_pair(a, b)
    return _instantiate(t, {"a": a, "b": b, "out": out, **hyper_tensors}, device, debug)


def _remember_call(call_key, t: _Template, call: DistanceCall) -> None:
    if len(_BY_CALL) >= 4 * _TEMPLATES_MAX:
        _BY_CALL.clear()
    names = tuple(k for k in HYPERS if isinstance(call.hypers[k], torch.Tensor))
    _BY_CALL[call_key] = (t, call.out_shape, names)


def run_by_call_key(call_key, a: torch.Tensor, b: torch.Tensor, out, hypers: dict | None = None):
    """Run the template an earlier eager call with this ``call_key`` (ops.distance) was
    planned to, on ``a``, ``b`` and ``out`` (None: allocated); None when there is none.
    ``hypers``: where each hyper-parameter of HYPERS comes from in this call (the
    template reads the tensor ones).
    The key holds everything the validation and the plan of that call depended on
    (shapes, strides, alignments, dtypes, devices, hyper-parameter values, settings), so
    neither is repeated."""
    hit = None if _OVERRIDES else _BY_CALL.get(call_key)
    if hit is None:
        return None
    t, out_shape, names = hit
    if out is None:
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    return _instantiate_template(t, a, b, out, {k: hypers[k] for k in names} if names else {}, a.device,
                                 False).run()


def _plan_distance_gpu(call: DistanceCall, out, compute_mode: str, debug: bool, settings: Settings,
                       kind: str | None = None, call_key=None):
    """The kernel plan of a GPU call (``kind``: runtime.autotune's; default: its choice,
    the one hook of the kernel selection); None when only the reference path applies.
    ``call_key``: the public op's key of this call (ops.distance._call_key), under which
    the template is also kept (:func:`run_by_call_key`)."""
    if kind is None:
        kind = autotune.choose(call, out, compute_mode, settings.tf32,
                               lambda k: _plan_distance_gpu(call, out, compute_mode, False, settings, k).run(),
                               autotune_flag=call.autotune, debug=debug)
    if kind is None:
        return None
    key = None if debug else _distance_key(call, out, compute_mode, settings)  # debug: log every decision
    key = None if key is None else (key, kind, _OVERRIDES)
    if key is None or _OVERRIDES or autotune.autotune_enabled(call.autotune):  # an autotuned choice may be forgotten
        call_key = None
    t = _TEMPLATES.get(key) if key is not None else None
    if t is not None:
        if call_key is not None:
            _remember_call(call_key, t, call)
        hyper_tensors = {k: v for k, v in call.hypers.items() if isinstance(v, torch.Tensor)}
        return _instantiate_template(t, call.a, call.b, out, hyper_tensors, call.device, debug)
    built = _distance_template(call, out, compute_mode, debug, settings, kind)
    if built is None:
        return None
    t, tensors, reusable = built
    if key is not None and reusable:
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            clear_templates()
        t = _TEMPLATES[key] = _with_arg_blocks(t)
        if call_key is not None:
            _remember_call(call_key, t, call)
    return _instantiate(t, tensors, call.device, debug)


def _distance_template(call: DistanceCall, out, compute_mode: str, debug: bool, settings: Settings, kind: str):
    """(template, the tensors it reads, whether it serves later calls), or None for the
    reference path."""
    from .runtime.launcher import get_kernel, max_active_clusters

    padded = kmajor = False
    if kind == autotune.TENSOR_CORE:
        padded_call = _padded_for_tensor_cores(call)
        padded, call = padded_call is not call, padded_call
    elif not _lowk_serves(kind, call.K) and _kmajor_worthwhile(call):
        kmajor = True
        a, b = _kmajor_pair(call.a, call.b)
        call = dataclasses.replace(call, a=a, b=b)
    hypers = {}
    for k, v in call.hypers.items():
        if isinstance(v, torch.Tensor):
            hypers[k] = v if v.dtype == torch.float32 else v.float()  # at most batch-many scalars
    chosen = _select(call, out, hypers, compute_mode, settings, kind)
    if chosen is None:
        return None
    spec, (av, bv, outv), tensors, bplan, family = chosen
    # A layout copy is made anew by every call (and not cached); the zero padding is
    # redone by the template (its copies are fresh row-major tensors, analysed alike).
    reusable = not (av.copied or bv.copied)
    pad_k = call.K if padded else 0
    if bplan.count == 0 or call.M == 0 or call.N == 0:
        return _Template(family, spec, (), (), pad_k, kmajor), tensors, reusable
    device = _device_index(call.device)
    kernel = get_kernel(spec, device, debug=debug)
    L = bplan.count
    # The low-K kernel writes a column-major out as the row-major out^T = kernel(b, a).
    swap = family == "distance_lowk" and outv.layout is Layout.COL_MAJOR
    first, second = ("b", "a") if swap else ("a", "b")
    M, N = (call.N, call.M) if swap else (call.M, call.N)
    lda, ldb = (bv.ld, av.ld) if swap else (av.ld, bv.ld)
    reg_diag = -call.reg_diag if swap else call.reg_diag
    grid = (math.ceil(M / spec.launch.block_m), math.ceil(N / spec.launch.block_n), min(L, 65535))
    if spec.launch.persistent:  # the blocks (or clusters) walk all tiles of all batch entries
        c = spec.launch.cluster
        if c > 1:  # clusters of c CTAs over c vertically adjacent tiles
            grid = (min(-(-grid[0] // c) * grid[1] * L, max_active_clusters(kernel)), 1, 1)
        else:
            grid = (min(grid[0] * grid[1] * L, _sm_count(device)), 1, 1)
    path = {"distance": "simt", "distance_lowk": "low-K"}.get(family, "tensor-core")
    if debug:
        log.debug("run_kernel %r: %s path%s%s, M=%d N=%d K=%d batch=%s (kernel modes %s, host loop %s), "
                  "blocks of %d x %d outputs, grid %s, %d threads and %d B of shared memory per block, "
                  "%d blocks per SM", call.desc, path, " (out^T = kernel(b, a))" if swap else "",
                  " (k-major copies of a, b)" if kmajor else "", call.M, call.N, call.K, call.batch, bplan.modes,
                  bplan.outer, spec.launch.block_m, spec.launch.block_n, grid, spec.launch.threads,
                  spec.launch.smem_bytes, _blocks_per_sm(kernel))
    sa, sb, so = bplan.strides[first][1], bplan.strides[second][1], bplan.strides["out"][1]
    eps = np.float32(-np.inf if call.epsilon is None else call.epsilon)
    offsets = {k: list(bplan.outer_offsets(k)) for k in tensors}
    prepare = None
    if spec.kernel == WGMMA_KERNEL:
        prepare = _WgmmaPrepare(call, bplan, bv, spec, settings.tf32, device, debug)
    launches = []
    for i in range(len(offsets["a"])):
        def ptr(k):
            return _Ptr(k, offsets[k][i] * tensors[k].element_size())

        args = [
            ptr(first), ptr(second), ptr("out"),
            np.int32(M), np.int32(N), np.int32(call.K),
            np.int64(lda), np.int64(ldb), np.int64(outv.ld),
            np.int32(L), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]),
            *(np.int64(s) for s in sa), *(np.int64(s) for s in sb), *(np.int64(s) for s in so),
        ]
        for name in HYPERS:
            v = hypers.get(name, call.hypers[name])
            if isinstance(v, torch.Tensor):
                s3 = bplan.strides[name][1]
                args += [ptr(name), np.int64(s3[0]), np.int64(s3[1]), np.int64(s3[2]), np.float32(0.0)]
            else:
                args += [0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if v is None else v)]
        args += [np.int64(reg_diag), eps]
        if prepare is not None:
            step, extra = prepare.launch_for(ptr("b"))
            launches.append(_launch_template(*step))
            args += extra
        launches.append(_launch_template(kernel, grid, args))
    scratch = prepare.scratch if prepare is not None else ()
    return _Template(family, spec, tuple(launches), scratch, pad_k, kmajor), tensors, reusable


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
    to whole 256 x 16 tiles, allocated by every call from torch's caching allocator."""

    def __init__(self, call: DistanceCall, bplan, bv, spec, tf32: bool, device: int, debug: bool):
        from .runtime.launcher import get_kernel

        small, norms = wgmma_prepare_needs(call.desc, tf32=tf32)
        self.spec = wgmma_prepare_spec(small=small, norms=norms)
        sb = bplan.strides["b"][1]
        ext, self.entry = b_entries(bplan.modes, sb)
        self.ext, self.strides, self.bv = ext, sb, bv
        self.N, self.K = call.N, call.K
        self.n_pad = -(-call.N // spec.launch.block_n) * spec.launch.block_n  # whole 256-row tiles
        k_pad = -(-call.K // WGMMA_BLOCK_K) * WGMMA_BLOCK_K  # whole 16-column k-tiles
        entries = math.prod(ext)
        self.rows = entries * self.n_pad
        self.scratch = (("wgmma_blocks", self.rows * k_pad * (2 if small else 1)),)
        self.norms = _Ptr("wgmma_norms", 0) if norms else 0
        if norms:
            self.scratch += (("wgmma_norms", self.rows),)
        self.kernel = get_kernel(self.spec, device, debug=debug)

    def launch_for(self, b_ptr):
        """((kernel, grid, args) of the preparation for b at ``b_ptr``, the arguments the
        main launch appends)."""
        s0, s1, s2 = self.strides
        blocks = _Ptr("wgmma_blocks", 0)
        args = (b_ptr, np.int32(self.N), np.int32(self.K), np.int64(self.bv.ld), np.int32(self.ext[1]),
                np.int32(self.ext[2]), np.int64(s0), np.int64(s1), np.int64(s2), np.int64(self.rows),
                blocks, self.norms, np.int32(self.n_pad))
        grid = (-(-self.rows // self.spec.launch.block_m), 1, 1)
        extra = [blocks, self.norms, *(np.int64(c) for c in self.entry)]
        return (self.kernel, grid, args), extra


# -- cdist_grad ------------------------------------------------------------------------------
def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads every operand along a unit-stride last mode."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def plan_cdist_grad(a, b, c, d, p, out, batch: tuple, sizes: tuple, debug: bool,
                    settings: Settings | None = None) -> Plan:
    """The plan of a validated cdist_grad call (``p`` a float or a float tensor over the
    batch; ``out`` None or checked)."""
    K, M, N, O = sizes
    gpu = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 0) and a.dtype == torch.float32
    if not gpu or 0 in (K, M, N, O) or math.prod(batch) == 0:
        if debug:
            log_grad.debug("cdist_grad: reference path (%s, %s)", a.device, a.dtype)

        def reference():
            res = cdist_grad_reference(a, b, c, d, p)
            if out is None:
                return res
            out.copy_(res)
            return out

        return _reference_plan(reference, debug)
    from .runtime.launcher import get_kernel

    settings = settings or Settings.current()
    if out is None:
        out = torch.empty((*batch, O, N, M), dtype=a.dtype, device=a.device)
    ops = {"a": _unit_last(a), "b": _unit_last(b), "c": _unit_last(c), "d": _unit_last(d), "out": out}
    if isinstance(p, torch.Tensor):
        ops["p"] = p.float() if p.dtype != torch.float32 else p
        kind = "pow"
    else:
        kind = "abs" if p == 1 else "square" if p == 2 else "pow"
    strides = {}
    for k, t in ops.items():
        nb = t.dim() if k == "p" else t.dim() - (3 if k == "out" else 2)
        strides[k] = batch_strides(batch, tuple(t.shape[:nb]), tuple(t.stride()[:nb]))
    bplan = plan_batch(batch, strides, max_modes=1)
    lds = {
        "a": ops["a"].stride(-2), "b": ops["b"].stride(-2), "c": ops["c"].stride(-2), "d": ops["d"].stride(-2),
        "ldo_o": out.stride(-3), "ldo_n": out.stride(-2),
    }
    # kVec = 4 (16-byte a/d/out accesses) needs a, d, out 16-byte aligned with
    # M, their leading dimensions and batch strides multiples of 4; b and c are
    # copied 4 bytes at a time and have no requirement (nor has K).
    vec_ops = ("a", "d", "out")
    vec_strides = [lds[k] for k in ("a", "d", "ldo_o", "ldo_n")] + [
        s for k in vec_ops for s in bplan.strides[k][0] + bplan.strides[k][1]
    ]
    vec = 4 if (
        M % 4 == 0
        and all(ops[k].data_ptr() % 16 == 0 for k in vec_ops)
        and all(s % 4 == 0 for s in vec_strides)
    ) else 1
    # Tensor-core contraction (3xTF32) where it measured faster; KERMAC_LIKE_GRAD_MMA=0 keeps SIMT.
    use_mma = settings.grad_mma
    sm90 = torch.cuda.get_device_capability(a.device) == (9, 0)
    spec = grad_kernel_spec(kind, vec, tensor_cores=use_mma, sm90=sm90)
    family = "cdist_grad_mma" if spec.kernel == "kermac_like::cdist_grad_mma_kernel" else "cdist_grad"
    kernel = get_kernel(spec, _device_index(a.device), debug=debug)
    L = bplan.count
    grid = (math.ceil(M / spec.launch.block_m), math.ceil(N / spec.launch.block_n), min(L, 65535))
    if debug:
        log_grad.debug("cdist_grad: kind=%s vec=%d mma=%s K=%d M=%d N=%d O=%d batch=%s", kind, vec, use_mma, K, M,
                       N, O, batch)
    offsets = {k: list(bplan.outer_offsets(k)) for k in ops}
    bs = {k: bplan.strides[k][1][0] for k in ops}
    launches = []
    for i in range(len(offsets["a"])):

        def ptr(k):
            t = ops[k]
            return t.data_ptr() + offsets[k][i] * t.element_size()

        args = [
            ptr("a"), ptr("b"), ptr("c"), ptr("d"), ptr("out"),
            np.int32(M), np.int32(N), np.int32(K), np.int32(O),
            np.int64(lds["a"]), np.int64(lds["b"]), np.int64(lds["c"]), np.int64(lds["d"]),
            np.int64(lds["ldo_o"]), np.int64(lds["ldo_n"]),
            np.int32(L), np.int64(bs["a"]), np.int64(bs["b"]), np.int64(bs["c"]), np.int64(bs["d"]), np.int64(bs["out"]),
        ]
        if "p" in ops:
            args += [ptr("p"), np.int64(bs["p"]), np.float32(0.0)]
        else:
            args += [0, np.int64(0), np.float32(p)]
        launches.append(Launch(kernel, grid, tuple(args)))
    return Plan(family, spec, tuple(launches), out, scratch=(ops,), debug=debug)


# -- kernel_matvec -------------------------------------------------------------------------------
log_matvec = logging.getLogger("kermac_like.matvec")

# Largest split-N scratch (partial sums: float32, float64 for a float64 out) one kernel_matvec
# call allocates on the GPU.
MATVEC_SCRATCH_BYTES = 32 << 20

# Euclidean/DOT float32 calls with more coordinates than this run on tensor cores: the fused
# matvec_wgmma_kernel on sm_90 (_plan_matvec_wgmma: Gaussian at K = 256, N = M = 2e5 on an
# H200: 166 ms with C = 1, 208 ms with C = 16), else kernel tiles times v (matvec_blocked:
# 267 / 325 ms). At K = 256 the fused SIMT kernel (1 FADD + 1 FFMA per pair and coordinate)
# took 1.68 s, torch in row blocks 0.88 s (bench/notes/matvec.md).
MATVEC_BLOCKED_MIN_K = 32
# Elements of one kernel tile of matvec_blocked (float32: 128 MB).
MATVEC_TILE_ELEMENTS = 1 << 25

_occupancy: dict = {}


def matvec_blocked(call, out: torch.Tensor, debug: bool = False, compute_mode: str = "use_mm_for_euclid_dist_if_necessary",
                   tile_elements: int | None = None) -> torch.Tensor:
    """kernel_matvec as kernel tiles times v: each tile (all batch entries, at most
    ``tile_elements``, default MATVEC_TILE_ELEMENTS) is one run_kernel plan (on a GPU the
    3xTF32 tensor-core distance kernel for Euclidean/DOT descriptors, the regularised
    diagonal included), multiplied into float32 accumulators of its rows. Memory beyond
    inputs and output: one tile, the accumulators of one row block (and the distance
    kernel's own scratch), whatever M and N. A float64 ``out`` of float32 inputs: float64
    accumulators and products (the tile converted to float64, the tile a third the size so that
    the float32 tile and its float64 copy stay within the same bytes)."""
    budget = tile_elements or MATVEC_TILE_ELEMENTS
    wide = torch.float64 if torch.float64 in (call.dtype, out.dtype) else torch.float32
    if wide != call.dtype:
        budget = max(1, budget // 3)
    L = math.prod(call.batch) if call.batch else 1
    M, N, C = call.M, call.N, call.C
    om = out.unsqueeze(-1) if call.vector else out
    nb = max(1, min(N, 8192))
    mb = max(1, min(M, budget // max(1, nb * L)))
    tile = torch.empty(L * mb * nb, dtype=call.dtype, device=call.device)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        acc = torch.zeros((*call.batch, m1 - m0, C), dtype=wide, device=call.device)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            dc = DistanceCall(call.desc, call.x[..., m0:m1, :], call.y[..., n0:n1, :], call.hypers,
                              call.reg_diag - n0 + m0, call.epsilon, call.batch, m1 - m0, n1 - n0, call.K)
            kb = tile[: L * (m1 - m0) * (n1 - n0)].view(*call.batch, m1 - m0, n1 - n0)
            plan_distance(dc, kb, compute_mode, debug).run()
            acc += torch.matmul(kb.to(wide), call.v[..., n0:n1, :].to(wide))
        om[..., m0:m1, :] = acc
    return out


def _blocks_per_sm(kernel) -> int:
    key = (kernel.device, kernel.spec)
    n = _occupancy.get(key)
    if n is None:
        try:
            launch = kernel.spec.launch  # its dynamic shared memory too (0 for kernel_matvec)
            n = int(kernel.function.occupancy.max_active_blocks_per_multiprocessor(launch.threads, launch.smem_bytes))
        except Exception:  # older cuda.core: the kernel's launch bound
            n = 2
        _occupancy[key] = n = max(1, n)
    return n


def choose_split(m_tiles: int, n_tiles: int, slots: int, max_split: int) -> int:
    """Splits of kernel_matvec's N range: the fewest (at most ``max_split``, each split at
    least 4 y tiles) whose CTA count fills the last wave of ``slots`` concurrent CTAs to
    >= 97%, else the best fill. Depends on shapes and the device only (results are
    bitwise reproducible)."""
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


def _add_hyper_tensors(call, hypers: dict, tensors: dict, strides: dict) -> None:
    """The tensor hyper-parameters of a matvec call join its tensors, with their batch strides."""
    for k, h in hypers.items():
        if isinstance(h, torch.Tensor):
            tensors[k] = h
            strides[k] = batch_strides(call.batch, tuple(h.shape), tuple(h.stride()))


def plan_matvec(call, out: torch.Tensor, debug: bool) -> Plan:
    """The plan of a validated kernel_matvec call (``ops.matvec.MatvecCall``) writing ``out``
    (the call's output tensor): matvec_kernel over row tiles x N splits x batch, one
    launch per column chunk of MAX_C and per host-loop batch entry, each split launch
    followed by matvec_combine_kernel; Euclidean/DOT float32 calls with K > 32 on tensor
    cores (:func:`_plan_matvec_wgmma` on sm_90 unless KERMAC_LIKE_WGMMA=0, else
    :func:`matvec_blocked`); the torch reference for CPU tensors, float64, GPUs before
    sm_80 and K == 0.

    A float64 ``out`` of float32/16-bit inputs (validated by ops.matvec) is the float64 mode:
    the fused kernel with TOut = double (v read as float64, a float32 v widened by a copy of
    N x C; float64 products, sums, split scratch and combination; the totals stored
    unrounded), matvec_blocked with float64 accumulation for the tensor-core calls (the
    Hopper kernel matvec_wgmma rounds its output in float32: not used), float64 accumulation
    on the reference path."""
    if not (call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.x)):
        if debug:
            log_matvec.debug("kernel_matvec %r: reference path (%s, %s)", call.desc, call.device, call.dtype)
        return _reference_plan(lambda: torch_path.matvec(call, out), debug)
    wide_out = out.dtype == torch.float64 and call.dtype != torch.float64
    if call.K > MATVEC_BLOCKED_MIN_K and call.desc.is_euclidean and call.dtype == torch.float32:
        settings = Settings.current()
        if not wide_out and _wgmma_enabled(call.device, settings):
            return _plan_matvec_wgmma(call, out, debug, settings)
        if debug:
            log_matvec.debug("kernel_matvec %r: K=%d, tensor-core distance tiles times v", call.desc, call.K)
        return Plan("matvec_blocked", None, (), out, reference=lambda: matvec_blocked(call, out, debug), debug=debug)
    from .runtime.launcher import get_kernel

    om = out.unsqueeze(-1) if call.vector else out
    device = _device_index(call.device)
    hypers = {k: (h.float() if isinstance(h, torch.Tensor) and h.dtype != torch.float32 else h)
              for k, h in call.hypers.items()}
    v = call.v.to(torch.float64) if wide_out else call.v  # the float64 mode reads v as float64
    tensors = {"x": call.x, "y": call.y, "v": v, "out": om}
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()}
    _add_hyper_tensors(call, hypers, tensors, strides)
    bplan = plan_batch(call.batch, strides)
    L = bplan.count
    M, N, K = call.M, call.N, call.K
    if L == 0 or M == 0 or call.C == 0:
        return Plan("matvec", None, (), out, debug=debug)
    if N == 0:  # an empty sum
        return _reference_plan(lambda: (om.zero_(), out)[1], debug)
    eps = np.float32(0.0 if call.epsilon is None else call.epsilon)
    sxm, sxk = call.x.stride()[-2:]
    sym, syk = call.y.stride()[-2:]
    svn, svc = v.stride()[-2:]
    som, soc = om.stride()[-2:]
    offsets = {k: list(bplan.outer_offsets(k)) for k in tensors}
    bs = {k: bplan.strides[k][1] for k in ("x", "y", "v", "out")}
    launches, first = [], None
    scratch = [h for h in hypers.values() if isinstance(h, torch.Tensor)]  # float32 copies stay alive
    if v is not call.v:
        scratch.append(v)  # the float64 copy of v stays alive
    kernel = combine = part = None
    out_dtype = torch.float64 if wide_out else None
    pbytes = part_bytes(call.dtype, out_dtype)  # float64 split sums for a float64 out
    part_dtype = torch.float64 if pbytes == 8 else torch.float32
    for c0 in range(0, call.C, MAX_C):
        cc = min(MAX_C, call.C - c0)
        spec = matvec_spec(call.desc, call.dtype, K, cc, epsilon=call.epsilon, out_dtype=out_dtype)
        first = first or spec
        if kernel is None or kernel.spec != spec:
            kernel = get_kernel(spec, device, debug=debug)
        m_tiles = -(-M // spec.launch.block_m)
        n_tiles = -(-N // spec.launch.block_n)
        slots = _sm_count(device) * _blocks_per_sm(kernel)
        max_split = max(1, MATVEC_SCRATCH_BYTES // (pbytes * L * M * cc))
        split = choose_split(m_tiles * min(L, 65535), n_tiles, slots, max_split)
        per = -(-n_tiles // split)
        split = -(-n_tiles // per)
        if split > 1:  # one scratch for every chunk: stream order serialises their use
            if part is None or part.numel() < split * L * M * cc:
                part = torch.empty(split * L * M * cc, dtype=part_dtype, device=call.device)
                scratch.append(part)
            if combine is None:
                combine = get_kernel(combine_spec(call.dtype, out_dtype), device, debug=debug)
        grid = (m_tiles, split, min(L, 65535))
        if debug:
            log_matvec.debug("kernel_matvec %r: M=%d N=%d K=%d C=%d (columns %d..%d) batch=%s: grid %s, %d y tiles "
                             "per split", call.desc, M, N, K, call.C, c0, c0 + cc, call.batch, grid, per)
        for i in range(len(offsets["x"])):
            def ptr(k, extra=0):
                t = tensors[k]
                return t.data_ptr() + (offsets[k][i] + extra) * t.element_size()

            args = [ptr("x"), ptr("y"), ptr("v", c0 * svc), ptr("out", c0 * soc),
                    part.data_ptr() if split > 1 else 0,
                    np.int32(M), np.int32(N), np.int32(K), np.int32(cc),
                    *(np.int64(s) for s in (sxm, sxk, sym, syk, svn, svc, som, soc)),
                    np.int32(L), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]),
                    *(np.int64(s) for k in ("x", "y", "v", "out") for s in bs[k])]
            hyper_args = []
            for name in HYPERS:
                h = hypers[name]
                if isinstance(h, torch.Tensor):
                    s3 = bplan.strides[name][1]
                    hyper_args.append([ptr(name), np.int64(s3[0]), np.int64(s3[1]), np.int64(s3[2]), np.float32(0)])
                else:
                    hyper_args.append([0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if h is None else h)])
            args += [a for h in hyper_args for a in h]
            args += [np.int64(call.reg_diag), eps, np.int32(split), np.int32(per)]
            launches.append(Launch(kernel, grid, tuple(args)))
            if split > 1:
                total = L * M * cc
                cgrid = (max(1, min(-(-total // 256), _sm_count(device) * 8)), 1, 1)
                cargs = (part.data_ptr(), ptr("v", c0 * svc), ptr("out", c0 * soc), np.int32(M), np.int32(N),
                         np.int32(cc), np.int64(svn), np.int64(svc), np.int64(som), np.int64(soc), np.int32(L),
                         np.int32(bplan.modes[1]), np.int32(bplan.modes[2]),
                         *(np.int64(s) for k in ("v", "out") for s in bs[k]), *hyper_args[3],
                         np.int64(call.reg_diag), np.int32(split))
                launches.append(Launch(combine, cgrid, cargs))
    return Plan("matvec", first, tuple(launches), out, scratch=tuple(scratch), debug=debug)


# -- kernel_matvec on Hopper: matvec_wgmma_kernel ------------------------------------------------
# Largest prepared y (b blocks, B small, norms) one launch reads: a longer N range runs in
# several launches whose float64 sums go through a carry buffer ([batch][M][C]), so that the
# call's memory stays O((M + N) C) beside this bound (the whole y prepared at N = 2e5,
# K = 256 would take 410 MB).
MATVEC_WGMMA_BLOCK_BYTES = 64 << 20
MATVEC_WGMMA_TILE = 256  # MatvecWgmmaTraits::kBlockN (= WgmmaPrepareTraits::kTileN)


def _tc_rows_ok(t: torch.Tensor) -> bool:
    """Row-major with 16-byte aligned base, rows and batch offsets (the kernel's cp.async
    and the b preparation's float4 loads)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    if t.data_ptr() % 16:
        return False
    strides = [st for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1]
    return all(st % 4 == 0 for st in strides)


def _prepare_v(v: torch.Tensor, c0: int, cc: int, kc: int, tiles: int) -> torch.Tensor:
    """Columns c0 .. c0 + cc of v (..., N, C) as matvec_wgmma_kernel's v tiles
    (..., tiles * 256 * kc) float32: zero past N and past cc; within a tile, row
    n = 8 j + 2 t + e and column c at matvec_wgmma_detail::v_offset (the float4 chunks of
    quad lane t for step j side by side)."""
    vb, N = v.shape[:-2], v.shape[-2]
    vp = torch.zeros((*vb, tiles * MATVEC_WGMMA_TILE, kc), dtype=torch.float32, device=v.device)
    vp[..., :N, :cc] = v[..., c0:c0 + cc]
    if kc == 1:
        return vp.reshape(*vb, -1)
    vp = vp.view(*vb, tiles, 32, 4, kc // 2, 4)  # (tile, j, t, chunk q of (e, c), r)
    return vp.transpose(-3, -2).contiguous().reshape(*vb, -1)


class _ChunkCall(NamedTuple):
    """What _WgmmaPrepare reads of a distance call, for one range of y's rows."""

    desc: KernelDescriptor
    N: int
    K: int


class _RowMajor(NamedTuple):
    ld: int


def _plan_matvec_wgmma(call, out: torch.Tensor, debug: bool, settings: Settings) -> Plan:
    """kernel_matvec of a Euclidean/DOT float32 call on an sm_90 device: matvec_wgmma_kernel
    (cuda_templates/matvec_wgmma.cuh) after wgmma_prepare_b_kernel, per host-loop batch
    entry, range of N (at most MATVEC_WGMMA_BLOCK_BYTES of prepared y) and column chunk
    of MAX_C; a split N range is finished by matvec_combine_kernel (one range) or
    matvec_carry_kernel (several). Memory beyond inputs and output: the prepared y of one
    range, v's tiles (N x C), split sums (<= MATVEC_SCRATCH_BYTES) and the float64 carry
    (batch x M x C, several ranges only); padded copies of x and y where their rows are
    not 16-byte aligned."""
    from .runtime.launcher import get_kernel, max_active_clusters

    om = out.unsqueeze(-1) if call.vector else out
    device = _device_index(call.device)
    M, N, K, C = call.M, call.N, call.K, call.C
    L = math.prod(call.batch) if call.batch else 1
    if L == 0 or M == 0 or C == 0:
        return Plan("matvec_wgmma", None, (), out, debug=debug)
    if N == 0:  # an empty sum
        return _reference_plan(lambda: (om.zero_(), out)[1], debug)
    x, y = call.x, call.y
    if not (_tc_rows_ok(x) and _tc_rows_ok(y)):
        # fresh row-major copies, K zero-padded to whole 16-byte rows (one copy if x is y)
        Kp = -(-K // 4) * 4
        px = _pad_k(x, Kp).contiguous()
        x, y = px, (px if _same_memory(x, y) else _pad_k(y, Kp).contiguous())
    self_on = _same_memory(x, y)
    hypers = {k: (h.float() if isinstance(h, torch.Tensor) and h.dtype != torch.float32 else h)
              for k, h in call.hypers.items()}
    tensors = {"a": x, "b": y, "out": om}
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()}
    vb = tuple(call.v.shape[:-2])
    unit = torch.empty(vb, device="meta").stride() if vb else ()  # v tiles: one unit per entry
    strides["v"] = batch_strides(call.batch, vb, unit)
    _add_hyper_tensors(call, hypers, tensors, strides)
    bplan = plan_batch(call.batch, strides)
    Lk = bplan.count
    offsets = {k: list(bplan.outer_offsets(k)) for k in strides}
    tf32 = settings.tf32

    tiles = -(-N // MATVEC_WGMMA_TILE)
    b_ext, _ = b_entries(bplan.modes, bplan.strides["b"][1])
    k_pad = -(-K // WGMMA_BLOCK_K) * WGMMA_BLOCK_K
    tile_bytes = MATVEC_WGMMA_TILE * (k_pad * 4 * (1 if tf32 else 2) + 4)
    per_range = max(1, MATVEC_WGMMA_BLOCK_BYTES // max(1, math.prod(b_ext) * tile_bytes))
    ranges = [(t0, min(tiles, t0 + per_range)) for t0 in range(0, tiles, per_range)]
    chunks = [(c0, min(MAX_C, C - c0)) for c0 in range(0, C, MAX_C)]
    vps = [_prepare_v(call.v, c0, cc, c_bucket(cc), tiles) for c0, cc in chunks]
    scratch = [x, y, vps, *(h for h in hypers.values() if isinstance(h, torch.Tensor))]

    kernels = {}
    for c0, cc in chunks:
        spec = matvec_wgmma_spec(call.desc, c_bucket(cc), tf32=tf32)
        if spec not in kernels:
            kernels[spec] = get_kernel(spec, device, debug=debug)
    first_spec = next(iter(kernels))
    clusters = max_active_clusters(kernels[first_spec])
    tiles_m = -(-M // first_spec.launch.block_m)
    pairs_m = -(-tiles_m // first_spec.launch.cluster)  # items per split and batch entry
    carry = part = combine = carry_k = None
    if len(ranges) > 1:  # [chunk][batch][M][columns of the chunk]
        carry = torch.empty(Lk * M * C, dtype=torch.float64, device=call.device)
        scratch.append(carry)
    eps = np.float32(0.0 if call.epsilon is None else call.epsilon)
    som, soc = om.stride()[-2:]
    ldx = x.stride(-2) if M > 1 else max(K, 4)
    sx, so, sv = bplan.strides["a"][1], bplan.strides["out"][1], bplan.strides["v"][1]
    launches = []
    blocks = norms = None
    for i in range(len(offsets["a"])):
        for g, (t0, t1) in enumerate(ranges):
            r0, r1 = t0 * MATVEC_WGMMA_TILE, min(N, t1 * MATVEC_WGMMA_TILE)
            prep = _WgmmaPrepare(_ChunkCall(call.desc, r1 - r0, K), bplan, _RowMajor(y.stride(-2) if N > 1 else k_pad),
                                 first_spec, tf32, device, debug)
            need = dict(prep.scratch)
            if blocks is None:  # sized by the first (largest) range; reused in stream order
                blocks = torch.empty(need["wgmma_blocks"], dtype=torch.float32, device=call.device)
                norms = (torch.empty(need["wgmma_norms"], dtype=torch.float32, device=call.device)
                         if "wgmma_norms" in need else None)
                scratch += [blocks, norms]
            y_ptr = y.data_ptr() + (offsets["b"][i] + r0 * y.stride(-2)) * 4
            (pk, pgrid, pargs), extra = prep.launch_for(y_ptr)
            resolve = {"wgmma_blocks": blocks.data_ptr(), "wgmma_norms": norms.data_ptr() if norms is not None else 0}
            fix = lambda a: resolve[a.name] + a.offset if isinstance(a, _Ptr) else a  # noqa: E731
            launches.append(Launch(pk, pgrid, tuple(fix(a) for a in pargs)))
            extra = [fix(a) for a in extra]
            mode = (1 if g > 0 else 0) | (2 if g < len(ranges) - 1 else 0)
            for ci, (c0, cc) in enumerate(chunks):
                kc = c_bucket(cc)
                spec = matvec_wgmma_spec(call.desc, kc, tf32=tf32)
                kernel = kernels[spec]
                n_tiles = t1 - t0
                max_split = max(1, MATVEC_SCRATCH_BYTES // (4 * Lk * M * cc))
                split = choose_split(pairs_m * min(Lk, 65535), n_tiles, clusters, max_split)
                per = -(-n_tiles // split)
                split = -(-n_tiles // per)
                if split > 1 and (part is None or part.numel() < split * Lk * M * cc):
                    part = torch.empty(split * Lk * M * cc, dtype=torch.float32, device=call.device)
                    scratch.append(part)
                entry = tiles * MATVEC_WGMMA_TILE * kc  # floats of one entry of v's tiles
                out_ptr = om.data_ptr() + (offsets["out"][i] + c0 * soc) * 4
                carry_ptr = carry.data_ptr() + c0 * Lk * M * 8 if carry is not None else 0
                args = [x.data_ptr() + offsets["a"][i] * 4, out_ptr, part.data_ptr() if split > 1 else 0, carry_ptr,
                        np.int32(M), np.int32(r1 - r0), np.int32(K), np.int32(cc), np.int64(ldx), np.int64(som),
                        np.int64(soc), np.int32(Lk), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]),
                        *(np.int64(s_) for s_ in sx), *(np.int64(s_) for s_ in so)]
                hyper_args = []
                for name in HYPERS:
                    h = hypers[name]
                    if isinstance(h, torch.Tensor):
                        s3 = bplan.strides[name][1]
                        hyper_args += [h.data_ptr() + offsets[name][i] * 4, *(np.int64(s_) for s_ in s3), np.float32(0)]
                    else:
                        hyper_args += [0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if h is None else h)]
                args += hyper_args
                args += [np.int64(call.reg_diag - r0), eps, np.int32(1 if self_on else 0), np.int64(-r0), *extra,
                         vps[ci].data_ptr() + (offsets["v"][i] * entry + t0 * MATVEC_WGMMA_TILE * kc) * 4,
                         *(np.int64(s_ * entry) for s_ in sv), np.int32(split), np.int32(per),
                         np.int32(mode if split == 1 else 0)]
                items = pairs_m * split * Lk
                launches.append(Launch(kernel, (max(1, min(items, clusters)), 1, 1), tuple(args)))
                if split > 1:
                    total = Lk * M * cc
                    cgrid = (max(1, min(-(-total // 256), _sm_count(device) * 8)), 1, 1)
                    if len(ranges) == 1:  # the split sums into out (the regularisation is in the sums)
                        if combine is None:
                            combine = get_kernel(combine_spec(torch.float32), device, debug=debug)
                        cargs = (part.data_ptr(), 0, out_ptr, np.int32(M), np.int32(N), np.int32(cc), np.int64(0),
                                 np.int64(0), np.int64(som), np.int64(soc), np.int32(Lk), np.int32(bplan.modes[1]),
                                 np.int32(bplan.modes[2]), *([np.int64(0)] * 3), *(np.int64(s_) for s_ in so),
                                 0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0), np.int64(0),
                                 np.int32(split))
                        launches.append(Launch(combine, cgrid, cargs))
                    else:
                        if carry_k is None:
                            carry_k = get_kernel(carry_spec(), device, debug=debug)
                        cargs = (part.data_ptr(), carry_ptr, out_ptr, np.int32(M), np.int32(cc), np.int64(som),
                                 np.int64(soc), np.int32(Lk), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]),
                                 *(np.int64(s_) for s_ in so), np.int32(split), np.int32(mode))
                        launches.append(Launch(carry_k, cgrid, cargs))
                if debug:
                    log_matvec.debug("kernel_matvec %r: wgmma M=%d N=%d (rows %d..%d) K=%d C=%d (columns %d..%d) "
                                     "batch=%s: %d clusters, %d splits of %d y tiles, carry mode %d%s", call.desc, M,
                                     N, r0, r1, K, C, c0, c0 + cc, call.batch, min(items, clusters), split, per, mode,
                                     ", x is y" if self_on else "")
    return Plan("matvec_wgmma", first_spec, tuple(launches), out, scratch=tuple(scratch), debug=debug)
