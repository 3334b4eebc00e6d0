"""The distance rule (run_kernel and cdist): a validated :class:`DistanceCall` -> the plan
of the SIMT, low-K, mma.sync or wgmma distance kernel (with the wgmma b preparation), or
the reference path. Plans are built as templates (pointer arguments symbolic) kept per
call signature and per eager call key, so a repeated call only fills in its pointers and
allocates its scratch (bench/notes/ops.md)."""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..centring import same_memory as _same_memory, shift_invariant
from ..calls import DistanceCall
from ..descriptor import PRESETS
from ..layout import Layout, analyse_matrix, batch_strides, plan_batch
from .. import config, formula_path, torch_path
from ..runtime import launcher, store
from ..runtime.specs import epilogue
from . import autotune, shift
from ..runtime.specs import (
    LOWK_GENERIC_MAX_K,
    LOWK_MAX_K,
    LOWK_MIN_BLOCKS,
    default_distance_tuning,
    desc_mm_ok,
    lowk_bucket,
    lowk_spec,
    lowk_tiles_n,
    distance_spec,
    mma_spec,
    WGMMA_PREPARE_TILE,
    wgmma_chunk,
    wgmma_prepare_needs,
    wgmma_prepare_spec,
    wgmma_spec,
)
from .core import (
    HYPERS,
    Launch,
    Plan,
    Settings,
    _blocks_per_sm,
    _device_index,
    _gpu_ok,
    _reference_plan,
    _sm_count,
    _smem_per_sm,
    _wgmma_enabled,
    plans,
)

__all__ = ["DistanceCall", "plan_distance", "run_distance", "run_by_call_key", "clear_templates", "Tune",
           "spec_override", "b_entries", "WGMMA_KERNEL", "WGMMA_BLOCK_K"]

log = logging.getLogger("kermac_like.distance")


def _aligned(plan, names, per: int) -> bool:
    """Every batch offset of these operands keeps a ``per``-element alignment."""
    return all(s % per == 0 for k in names for part in plan.strides[k] for s in part)


class Tune(NamedTuple):
    """The rule's spec functions and size limits that no setting names, as one value: tests and
    probes replace fields (:func:`spec_override`) to force a tile shape or a threshold. It is the
    setting distance_tune, read into :class:`Settings` and so part of every template key and of
    the ops' call keys: plans made under replacements are kept apart by the replaced values
    themselves (the same function objects in a later block find their templates again)."""

    lowk_spec: Callable = lowk_spec
    lowk_tiles_n: Callable = lowk_tiles_n
    distance_spec: Callable = distance_spec
    mma_spec: Callable = mma_spec
    wgmma_spec: Callable = wgmma_spec
    lowk_generic_max_k: int = LOWK_GENERIC_MAX_K  # the low-K kernel's largest K (_lowk_serves)
    # where the SIMT kernel reads k-major copies (_kmajor_worthwhile): K, output elements over the
    # batch, rows of a and of b (one output tile) from which, and copies <= output elements / share
    kmajor_min_k: int = 64
    kmajor_min_out: int = 1 << 25
    kmajor_min_rows: int = 128
    kmajor_max_share: float = 4


SHIPPED = Tune()


def spec_override(**values):
    """Tests and probes: ``with spec_override(lowk_tiles_n=lambda *a: 8): ...``, fields of
    :class:`Tune` replaced inside the block over those in effect (blocks nest): a configuration
    override of the setting distance_tune. A name that is not a field: ValueError naming it and
    the fields."""
    unknown = sorted(set(values) - set(Tune._fields))
    if unknown:
        raise ValueError(f"spec_override: {', '.join(unknown)}: not a field of plan.distance.Tune; the fields are "
                         f"{', '.join(Tune._fields)}")
    tune = (config.get("distance_tune") or SHIPPED)._replace(**values)
    return config.override(distance_tune=None if tune == SHIPPED else tune)


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


# The matrices of a plan's tensors (batch modes before the last two): the operands, the output, and
# the operands as given (a0, b0) that the tensor-core kernels' near pairs read when they read a
# shifted copy.
_MATRICES = ("a", "b", "out", "a0", "b0")


def _batch_plan(call: DistanceCall, tensors: dict):
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()
               if k in _MATRICES}
    for k, v in tensors.items():
        if k not in strides:
            strides[k] = batch_strides(call.batch, tuple(v.shape), tuple(v.stride()))
    return plan_batch(call.batch, strides)


def _centres_for_tensor_cores(call: DistanceCall) -> bool:
    """Whether the tensor-core kernels read a and b shifted by the call's reference point
    (kermac_like.centring): every float32 DIFF call. Their product formula
    |x|^2 + |y|^2 - 2 x.y loses eps (|x|^2 + |y|^2), so on data far from the origin
    (cdist p = 2 at an offset of 1000 x the spread: relative error 0.95 unshifted) the
    shift brings the error back to the data's centred scale; the copies are one pass over
    a and b, small beside the M x N output (bench/notes/distance.md, "Data as it comes")."""
    return shift_invariant(call.desc) and call.dtype == torch.float32


def _tensor_core_operands(call: DistanceCall) -> tuple:
    """(the call as the tensor-core kernels read it, pad_k, centre): a and b zero-padded
    along K to whole 16-byte rows when K is not a multiple of 16 bytes (the kernels need
    aligned rows; x.y and |x - y|^2 are unchanged by zero columns; K = 37 at 20000^2: cdist
    p=2 3.05 -> 0.80 ms on an H200, bench/notes/lowk.md), and shifted by the reference
    point (:func:`_centres_for_tensor_cores`); one copy of each input in all."""
    per = 16 // call.a.element_size()
    Kp = call.K if call.K % per == 0 or not call.desc.is_euclidean else -(-call.K // per) * per
    centre = _centres_for_tensor_cores(call)
    if Kp == call.K and not centre:
        return call, 0, False
    a, b = _prepared_pair(call.a, call.b, Kp, centre)
    return call._replace(a=a, b=b, K=Kp), (Kp if Kp != call.K else 0), centre


def _prepared_pair(a: torch.Tensor, b: torch.Tensor, Kp: int, centre: bool) -> tuple:
    """a and b zero-padded to Kp columns and, with ``centre``, shifted by their reference point
    (kermac_like.centring.shifted_pair, on a GPU by plan.shift's kernels: a column with a
    non-finite value in either stays unshifted); one copy when they are the same memory, so
    that the kernels still see a == b (their exact zero self-distance diagonal)."""
    if centre:
        return shift.shifted_pair(a, b, pad_to=Kp)
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
# they save (0.79 ms without, 0.84 with): from 2^25 output elements (5793^2) on (Tune.kmajor_*).


def _kmajor_worthwhile(call: DistanceCall, tune: Tune) -> bool:
    """Whether a SIMT call reads k-major copies of its operands (see above)."""
    if call.dtype != torch.float32 or call.K < tune.kmajor_min_k or min(call.M, call.N) < tune.kmajor_min_rows:
        return False
    out = math.prod(call.out_shape)
    copies = (0 if _kmajor_ready(call.a) else call.a.numel()) + \
        (0 if _kmajor_ready(call.b) or _same_memory(call.a, call.b) else call.b.numel())
    return out >= tune.kmajor_min_out and 0 < copies * tune.kmajor_max_share <= out


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


def _lowk_serves(kind: str, K: int, tune: Tune) -> bool:
    """Whether the low-K kernel serves an exact call of this kind (else the SIMT kernel)."""
    return kind == autotune.LOWK and K <= tune.lowk_generic_max_k


def _select(call: DistanceCall, out, hypers: dict, compute_mode: str, settings: Settings, kind: str,
            given: dict | None = None):
    """(spec, views, tensors, batch plan, family) for a GPU call served by ``kind``
    (plan.autotune's kinds), or None for the reference path. ``given``: the operands as the
    caller gave them ({"a0", "b0"}) where the call reads shifted copies."""
    tf32, tune = settings.tf32, settings.distance_tune or SHIPPED
    tf32_types = (torch.float32, torch.float16, torch.bfloat16)
    if kind == autotune.TENSOR_CORE and call.desc.is_euclidean and call.dtype in tf32_types:
        av = analyse_matrix("a", call.a, prefer=Layout.ROW_MAJOR)
        bv = analyse_matrix("b", call.b, prefer=Layout.ROW_MAJOR)
        outv = analyse_matrix("out", out, copy_ok=False)  # checked by run_kernel (or freshly allocated)
        tensors = {"a": av.tensor, "b": bv.tensor, "out": outv.tensor, **(given or {}), **hypers}
        bplan = _batch_plan(call, tensors)
        kw = dict(tf32=tf32, batch_offsets_ok=_aligned(bplan, ("a", "b"), 16 // call.a.element_size()))
        spec, family = None, "distance_mma"
        # A call the wgmma kernel would sum in partial sums takes it whatever its size: the sm_90
        # mma.sync build keeps one running sum (2-4x torch.cdist's error at K = 1024).
        partial = call.dtype == torch.float32 and wgmma_chunk(call.desc, tf32=tf32, chunk=settings.wgmma_chunk, K=call.K)
        if _wgmma_enabled(call.device, settings) and (settings.wgmma_always or partial or not _few_tiles(call)):
            spec = tune.wgmma_spec(call.desc, av, bv, outv, chunk=settings.wgmma_chunk, tile=settings.wgmma_tile,
                                   **kw)
            family = "distance_wgmma"
        if spec is None:
            spec, family = tune.mma_spec(call.desc, av, bv, outv, **kw), "distance_mma"
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
    if _lowk_serves(kind, call.K, tune):
        # Row-major output only: a column-major out is computed as out^T = kernel(b, a).
        swap = outv.layout is Layout.COL_MAJOR
        first, second = (bv, av) if swap else (av, bv)
        M, N = (call.N, call.M) if swap else (call.M, call.N)
        # Mirroring torch.cdist's matrix product: its NaN/inf (autotune.candidates).
        mm = autotune.uses_mm(compute_mode, call.M, call.N) and desc_mm_ok(call.desc) and call.K <= LOWK_MAX_K
        tiles = tune.lowk_tiles_n(call.K, M, N, bplan.count, LOWK_MIN_BLOCKS * _sm_count(_device_index(call.device)))
        spec = tune.lowk_spec(call.desc, first.layout, second.layout, call.K, mm_nonfinite=mm, tiles_n=tiles)
        return spec, (av, bv, outv), tensors, bplan, "distance_lowk"
    # distance.cuh's 16-byte loader copies only the valid bytes of a column's last chunk.
    vec_ok = (av.vector_ok(whole_lines=False) and bv.vector_ok(whole_lines=False)
              and _aligned(bplan, ("a", "b"), 4))
    tuning = default_distance_tuning(call.desc, call.K, _smem_per_sm(_device_index(call.device)))
    spec = tune.distance_spec(call.desc, av.layout, bv.layout, outv.layout, 4 if vec_ok else 1, tuning=tuning)
    return spec, (av, bv, outv), tensors, bplan, "distance"


def plan_distance(call: DistanceCall, out: torch.Tensor | None, compute_mode: str, debug: bool,
                  settings: Settings | None = None, call_key=None) -> Plan:
    """The plan of a validated run_kernel call writing ``out`` (checked; None: a fresh tensor,
    on the torch path its kernels' own result). A descriptor no template knows
    (``desc.fused_ok`` False: kermac_like/formula.py) takes :func:`_formula_tensor_core_plan`'s fused
    kernels with its epilogue functor where one serves it, else the torch path."""
    if not call.desc.fused_ok:
        plan = _formula_tensor_core_plan(call, out, compute_mode, debug)
        if plan is not None:
            return plan
        if debug:
            log.debug("run_kernel %r: torch path (a formula kernel; %s, %s)", call.desc, call.device, call.dtype)
        return _reference_plan(functools.partial(formula_path.distance, call, out, compute_mode), debug)
    if call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.a):
        if out is None:
            out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
        plan = _plan_distance_gpu(call, out, compute_mode, debug, settings or Settings.current(), call_key=call_key)
        if plan is not None:
            return plan
    if debug:
        log.debug("run_kernel %r: torch path (%s, %s)", call.desc, call.device, call.dtype)
    return _reference_plan(functools.partial(torch_path.distance, call, out, compute_mode), debug)


# -- formula kernels of the l2 distance on the tensor cores (epilogue functors, issue 44) ----------
@functools.lru_cache(maxsize=64)
def _functor_specs(functor: tuple) -> tuple:
    """(wgmma_spec, mma_spec) with the epilogue functor in the traits: the same objects for the same
    functor, so that the template keys (their Tune) find their templates again."""

    return functools.partial(wgmma_spec, functor=functor), functools.partial(mma_spec, functor=functor)


@functools.lru_cache(maxsize=64)
def _functor_lowk(functor: tuple):
    """lowk_spec with the epilogue functor (the same object for the same functor, as _functor_specs)."""
    return functools.partial(lowk_spec, functor=functor)


# Formula kernels up to this K take exact kernels with their functor (direct differences): run_kernel
# the low-K kernel, kernel_matvec the fused SIMT kernel (plan.matvec). The tensor cores' |x|^2 + |y|^2 -
# 2 x.y rounds r2 to ~4 eps (|x|^2 + |y|^2), which moves a value by up to L times that (L: its relative
# slope in r2): on anisotropic data 1.1e-4 - 3.5e-4 at D = 3 and 1.4e-5 - 1.8e-5 at D = 64 against the
# flat 1e-5 (H200, session 21; the partial sums of session 22 left the D = 64 misses: 19 expected failures
# before and after). The low-K kernel is as fast as the tensor cores up to K ~ 16 and ~2x slower at
# K = 37 - 64 (bench/notes/lowk.md); beyond 64: the tensor cores (partial sums).
FORMULA_LOWK_UP_TO = 64


def _formula_tensor_core_plan(call: DistanceCall, out, compute_mode: str, debug: bool):
    """A formula kernel that an epilogue functor serves (runtime.specs.epilogue.served; float32 on a
    GPU of sm_80+, no epsilon cut): up to FORMULA_LOWK_UP_TO coordinates the exact low-K kernel of the
    squared distance with the functor, beyond the tensor-core kernels (their plan, the operands
    centred, the near pairs' direct differences) with it, in place of the enum epilogue, its
    hyper-parameters in the bandwidth, inner_p and outer_p slots. None where neither takes the call
    (then the torch path)."""
    if not (config.get("formula_fused") and epilogue.served(call.desc) and call.K > 0
            and call.dtype == torch.float32 and not call.epsilon and _gpu_ok(call.a)):
        return None
    proxy = call._replace(desc=PRESETS["squared_l2"], hypers=epilogue.slot_hypers(call.desc, call.hypers))
    functor = epilogue.functor(call.desc)
    wgmma, mma = _functor_specs(functor)
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    settings = Settings.current()
    lowk = call.K <= FORMULA_LOWK_UP_TO
    tune = (settings.distance_tune or SHIPPED)._replace(wgmma_spec=wgmma, mma_spec=mma, lowk_spec=_functor_lowk(functor))
    plan = _plan_distance_gpu(proxy, out, compute_mode, debug, settings._replace(distance_tune=tune),
                              autotune.LOWK if lowk else autotune.TENSOR_CORE)
    if plan is None or plan.family not in (("distance_lowk",) if lowk else ("distance_mma", "distance_wgmma")):
        return None
    if debug:
        log.debug("run_kernel %r: %s with its epilogue functor", call.desc, plan.family)
    return plan


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
    centre: bool = False  # a and b are read shifted by the call's reference point (the same copy)
    kmajor: bool = False  # a and b are read from m-contiguous copies (a copy per call: _kmajor)


# Templates of recent calls live in the plan cache (plan.core.plans), kind "templates" by
# _distance_key: a repeated call (same shapes, strides, alignment, dtype, descriptor,
# hyper-parameter kinds and settings) skips the layout analysis, batch folding, spec choice
# and argument packing, and only fills in pointers; kind "calls" by the public op's own
# arguments (ops.distance's call keys), so that a repeated eager call skips the validation and
# planning its key implies.
clear_templates = functools.partial(plans.clear, "templates", "calls")


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
    launches = tuple((k, g, a, pos, launcher.ArgBlock(k, g, a, pos) if launcher.ArgBlock.supports(a, pos) else None)
                     for k, g, a, pos, _ in t.launches)
    return t._replace(launches=launches)


def _instantiate_template(t: _Template, a, b, out, hyper_tensors: dict, device, debug: bool) -> Plan:
    """The plan of a cached template for the operands of a call (zero-padded copies of a
    and b where the template reads them padded)."""
    given = {"a0": a, "b0": b} if t.centre else {}
    if t.pad_k or t.centre:
        a, b = _prepared_pair(a, b, t.pad_k or a.shape[-1], t.centre)
    if t.kmajor:
        a, b = _kmajor_pair(a, b)
    return _instantiate(t, {"a": a, "b": b, "out": out, **given, **hyper_tensors}, device, debug)


def _remember_call(call_key, t: _Template, call: DistanceCall) -> None:
    names = tuple(k for k in HYPERS if isinstance(call.hypers[k], torch.Tensor))
    plans.put(call_key, (t, call.out_shape, names), "calls")


def run_by_call_key(call_key, a: torch.Tensor, b: torch.Tensor, out, hypers: dict | None = None):
    """Run the template an earlier eager call with this ``call_key`` (ops.distance) was
    planned to, on ``a``, ``b`` and ``out`` (None: allocated); None when there is none.
    ``hypers``: where each hyper-parameter of HYPERS comes from in this call (the
    template reads the tensor ones).
    The key holds everything the validation and the plan of that call depended on
    (shapes, strides, alignments, dtypes, devices, hyper-parameter values, settings), so
    neither is repeated."""
    hit = plans.get(call_key)
    if hit is None:
        return None
    t, out_shape, names = hit
    if out is None:
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    return _instantiate_template(t, a, b, out, {k: hypers[k] for k in names} if names else {}, a.device,
                                 False).run()


def _plan_distance_gpu(call: DistanceCall, out, compute_mode: str, debug: bool, settings: Settings,
                       kind: str | None = None, call_key=None):
    """The kernel plan of a GPU call (``kind``: plan.autotune's; default: its choice,
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
    key = None if key is None else (key, kind)
    if key is None or autotune.autotune_enabled(call.autotune):  # an autotuned choice may be forgotten
        call_key = None
    t = plans.get(key) if key is not None else None
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
        t = plans.put(key, _with_arg_blocks(t), "templates")
        if call_key is not None:
            _remember_call(call_key, t, call)
    return _instantiate(t, tensors, call.device, debug)


# A low-K call whose kernel (specialised on K) is neither loaded, cached nor bundled runs the
# run-time-K variant of its descriptor when that one is at hand (the bundle ships it for the
# low-K presets), while the specialised kernel compiles in a worker thread; such a plan is
# not kept, so the first call after that compile takes the specialised kernel. Both compute
# every output with the same operations in the same k order (the zero-filled k of the
# run-time-K chunks add exact zeros): the same results. The setting jit_tier off
# (KERMAC_LIKE_JIT_TIER=0): wait for the compile instead (bench/notes/jit.md).


def _first_call_tier(spec, call: DistanceCall, views, compute_mode: str, debug: bool, tuned: bool) -> tuple:
    """(the low-K spec that serves this call now, whether its template may be kept)."""
    # Not under a Tune (``tuned``: a probe or test wants its own spec) nor while autotuning (the
    # timings must be the specialised kernel's).
    if not config.get("jit_tier") or lowk_bucket(call.K) == 0 or tuned or autotune.autotune_enabled(call.autotune):
        return spec, True
    device = _device_index(call.device)
    if store.available(spec, device):
        return spec, True
    if autotune.uses_mm(compute_mode, call.M, call.N) and desc_mm_ok(call.desc):
        return spec, True  # kMmNonFinite exists at compile-time K only
    av, bv, outv = views
    first, second = (bv, av) if outv.layout is Layout.COL_MAJOR else (av, bv)
    generic = lowk_spec(call.desc, first.layout, second.layout, LOWK_MAX_K + 1, chunks=0)
    if not store.available(generic, device):
        return spec, True
    store.prefetch([spec], device, debug=debug)
    if debug:
        log.debug("run_kernel %r K=%d: %s compiling in the background; this call runs %s", call.desc, call.K,
                  spec.name_expression, generic.name_expression)
    return generic, False


def _distance_template(call: DistanceCall, out, compute_mode: str, debug: bool, settings: Settings, kind: str):
    """(template, the tensors it reads, whether it serves later calls), or None for the
    reference path."""
    pad_k, centre, kmajor, given = 0, False, False, None
    tune = settings.distance_tune or SHIPPED
    if kind == autotune.TENSOR_CORE:
        a0, b0 = call.a, call.b
        call, pad_k, centre = _tensor_core_operands(call)
        given = {"a0": a0, "b0": b0} if centre else None
    elif not _lowk_serves(kind, call.K, tune) and _kmajor_worthwhile(call, tune):
        kmajor = True
        a, b = _kmajor_pair(call.a, call.b)
        call = call._replace(a=a, b=b)
    hypers = {}
    for k, v in call.hypers.items():
        if isinstance(v, torch.Tensor):
            hypers[k] = v if v.dtype == torch.float32 else v.float()  # at most batch-many scalars
    chosen = _select(call, out, hypers, compute_mode, settings, kind, given)
    if chosen is None:
        return None
    spec, (av, bv, outv), tensors, bplan, family = chosen
    # A layout copy is made anew by every call (and not cached); the zero padding is
    # redone by the template (its copies are fresh row-major tensors, analysed alike).
    reusable = not (av.copied or bv.copied)
    if family == "distance_lowk":
        tuned = settings.distance_tune is not None
        spec, kept = _first_call_tier(spec, call, (av, bv, outv), compute_mode, debug, tuned)
        reusable = reusable and kept
    if bplan.count == 0 or call.M == 0 or call.N == 0:
        return _Template(family, spec, (), (), pad_k, centre, kmajor), tensors, reusable
    device = _device_index(call.device)
    if spec.kernel == WGMMA_KERNEL:  # the kernel and its b preparation compile side by side
        small, norms = wgmma_prepare_needs(call.desc, tf32=settings.tf32)
        store.prefetch([spec, wgmma_prepare_spec(small=small, norms=norms)], device, debug=debug)
    kernel = store.get_kernel(spec, device, debug=debug)
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
            grid = (min(-(-grid[0] // c) * grid[1] * L, launcher.max_active_clusters(kernel)), 1, 1)
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
        if family in ("distance_mma", "distance_wgmma"):
            args += _given_args(tensors, bplan, ptr)
        launches.append(_launch_template(kernel, grid, args))
    scratch = prepare.scratch if prepare is not None else ()
    return _Template(family, spec, tuple(launches), scratch, pad_k, centre, kmajor), tensors, reusable


def _given_args(tensors: dict, bplan, ptr) -> list:
    """The tensor-core kernels' trailing arguments: the operands as given (a0, b0: pointers, K, row
    and coordinate strides, kernel-mode batch strides) whose direct differences their near pairs
    take when the kernels read shifted copies (distance_mma.cuh, NearOperands); zeros otherwise."""
    if "a0" not in tensors:
        return [0, 0, np.int32(0), *(np.int64(0),) * 10]
    a0, b0 = tensors["a0"], tensors["b0"]
    return [ptr("a0"), ptr("b0"), np.int32(a0.shape[-1]),
            *(np.int64(v) for v in (a0.stride(-2), a0.stride(-1), b0.stride(-2), b0.stride(-1))),
            *(np.int64(v) for v in bplan.strides["a0"][1]), *(np.int64(v) for v in bplan.strides["b0"][1])]


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
        small, norms = wgmma_prepare_needs(call.desc, tf32=tf32)
        self.spec = wgmma_prepare_spec(small=small, norms=norms)
        sb = bplan.strides["b"][1]
        ext, self.entry = b_entries(bplan.modes, sb)
        self.ext, self.strides, self.bv = ext, sb, bv
        self.N, self.K = call.N, call.K
        self.n_pad = -(-call.N // WGMMA_PREPARE_TILE) * WGMMA_PREPARE_TILE  # whole 256-row prepared blocks (whatever the kernel's tile)
        k_pad = -(-call.K // WGMMA_BLOCK_K) * WGMMA_BLOCK_K  # whole 16-column k-tiles
        entries = math.prod(ext)
        self.rows = entries * self.n_pad
        self.scratch = (("wgmma_blocks", self.rows * k_pad * (2 if small else 1)),)
        self.norms = _Ptr("wgmma_norms", 0) if norms else 0
        if norms:
            self.scratch += (("wgmma_norms", self.rows),)
        self.kernel = store.get_kernel(self.spec, device, debug=debug)

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
