"""The kernel_matvec rule: a validated kernel_matvec call -> the plan of the fused SIMT
matvec kernel (cuda_templates/matvec.cuh), of the Hopper tensor-core kernel
(:mod:`.matvec_wgmma`), of tensor-core kernel tiles times v (:func:`matvec_blocked`),
or the reference path.

Translation invariance (kermac_like.centring): the paths that form DIFF distances by the
product formula ``|x|^2 + |y|^2 - 2 <x, y>`` on the operands as given (:func:`matvec_shifts`:
the Hopper tensor-core kernel, the torch path's matrix product) read x and y shifted by one
reference point (:func:`shifted_pair`), so that their error is ``eps`` times the data's centred
scale, as on centred data, instead of ``eps (|x|^2 + |y|^2)``. The others need no shift: the
fused SIMT kernel takes direct differences or centres its expanded form itself (the mean of a
CTA's rows; the float64 mode's symmetric centre), matvec_blocked's tensor-core tiles are
run_kernel's, which shift their operands (plan/distance.py), and the float64 mode of the torch
path takes direct differences. Operands that a caller centred once (:func:`mark_centred`, e.g.
KernelOperator's copies) are read as they are. DOT descriptors are never shifted."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import torch

from .. import config, formula_path, torch_path
from ..centring import (  # noqa: F401  (re-exported: the matvec paths' one shift and its marks)
    centred_together,
    mark_centred,
    pair_reference,
    shift_invariant,
    shifted_pair,
)
from ..descriptor import PowerType
from ..runtime import store
from ..runtime.specs import epilogue
from ..runtime.specs.matvec import MAX_C, combine_spec, expands, formula_matvec_spec, matvec_spec, part_bytes
from .core import (
    HYPERS,
    MATVEC_SCRATCH_BYTES,
    Launch,
    Plan,
    Settings,
    batch_plan,
    _blocks_per_sm,
    _device_index,
    _gpu_ok,
    _reference_plan,
    _sm_count,
    _wgmma_enabled,
    choose_split,
)
from ..calls import DistanceCall
from .distance import FORMULA_LOWK_UP_TO, plan_distance
from .matvec_wgmma import _plan_matvec_wgmma

__all__ = ["plan_matvec", "matvec_blocked", "MATVEC_BLOCKED_MIN_K", "MATVEC_TILE_ELEMENTS", "matvec_shifts",
           "shifted_pair", "pair_reference", "mark_centred", "centred_together"]

log_matvec = logging.getLogger("kermac_like.matvec")

# Euclidean/DOT float32 calls with more coordinates than this run on tensor cores: the fused
# matvec_wgmma_kernel on sm_90 (_plan_matvec_wgmma: Gaussian at K = 256, N = M = 2e5 on an
# H200: 166 ms with C = 1, 208 ms with C = 16), else kernel tiles times v (matvec_blocked:
# 267 / 325 ms). At K = 256 the fused SIMT kernel (1 FADD + 1 FFMA per pair and coordinate)
# took 1.68 s, torch in row blocks 0.88 s (bench/notes/matvec.md).
MATVEC_BLOCKED_MIN_K = 32
# Elements of one kernel tile of matvec_blocked (float32: 128 MB).
MATVEC_TILE_ELEMENTS = 1 << 25


def matvec_shifts(desc, x: torch.Tensor, y: torch.Tensor, wide: bool) -> bool:
    """Whether :func:`plan_matvec`'s path for a call on x (..., M, K) and y (..., N, K) forms DIFF
    distances by the product formula from the operands as given, and so reads them shifted by
    a reference point (:func:`shifted_pair`): on the torch path (CPU tensors, float64), a
    SQUARE inner power outside the float64 mode where torch.cdist takes the matrix product (M or
    N above 25); on a GPU, the sm_90 tensor-core kernel (Euclidean, K > MATVEC_BLOCKED_MIN_K,
    float32, not the float64 mode). ``wide``: the float64 mode (a float64 out or v of
    float32/16-bit data). DOT descriptors: never."""
    K = x.shape[-1]
    if not shift_invariant(desc) or K == 0:
        return False
    if x.dtype == torch.float64 or not _gpu_ok(x):
        return (desc.inner_power is PowerType.SQUARE and not wide
                and torch_path.uses_mm(torch_path.DEFAULT_MODE, x.shape[-2], y.shape[-2]))
    return (K > MATVEC_BLOCKED_MIN_K and desc.is_euclidean and x.dtype == torch.float32 and not wide
            and _wgmma_enabled(x.device, Settings.current()))


def matvec_blocked(call, out: torch.Tensor, debug: bool = False, compute_mode: str = "use_mm_for_euclid_dist_if_necessary",
                   tile_elements: int | None = None, settings: Settings | None = None) -> torch.Tensor:
    """kernel_matvec as kernel tiles times v: each tile (all batch entries, at most
    ``tile_elements``, default MATVEC_TILE_ELEMENTS) is one run_kernel plan (on a GPU the
    3xTF32 tensor-core distance kernel for Euclidean/DOT descriptors, the regularised
    diagonal included), multiplied into float32 accumulators of its rows. Memory beyond
    inputs and output: one tile, the accumulators of one row block (and the distance
    kernel's own scratch), whatever M and N. A float64 ``out`` of float32 inputs: float64
    accumulators and products (the tile converted to float64, the tile a third the size so that
    the float32 tile and its float64 copy stay within the same bytes). The tiles' DIFF distances
    are shift invariant as run_kernel's are: its tensor-core kernels read each tile's operands
    shifted by their reference point (plan/distance.py), its exact kernels take direct
    differences; nothing is shifted here. ``settings``: the call's (read once; default: now), every tile's."""
    budget, settings = tile_elements or MATVEC_TILE_ELEMENTS, settings or Settings.current()
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
            plan_distance(dc, kb, compute_mode, debug, settings).run()
            acc += torch.matmul(kb.to(wide), call.v[..., n0:n1, :].to(wide))
        om[..., m0:m1, :] = acc
    return out


def _symmetric_centre(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The float64 mode's centre of both operands (matvec.cuh's symmetric expanded form): the
    mean of x's rows and y's rows, averaged in an order that does not depend on which is which,
    so that K(x, y) and K(y, x) see the same centre; zeros where a mean is not finite."""
    def mean(t):  # float32 (no float64 copy of the data: any centre is exact, this one is accurate)
        return t.mean(dim=tuple(range(t.dim() - 1)), dtype=torch.float32)

    c = (mean(x) + mean(y)) * 0.5
    return torch.where(torch.isfinite(c), c, 0.0)


def formula_fused(call, out: torch.Tensor) -> bool:
    """Whether the fused SIMT kernel serves a formula kernel's call through an epilogue functor
    (cuda_templates/epilogue.cuh, specs.epilogue.served: Matérn 3/2 and 5/2, rational quadratic,
    Cauchy, inverse multiquadric, powered exponential of the l2 distance, user expressions of the
    squared distance): a GPU of sm_80 or newer, float32/16-bit data with an output of the same dtype
    (no float64 mode), K > 0 and no epsilon cut, with the setting formula_fused on (off by default
    until the functors meet 1e-5 on every data family). Elsewhere the formula's torch path."""
    return (config.get("formula_fused") and epilogue.served(call.desc) and call.K > 0 and call.dtype != torch.float64 and out.dtype == call.dtype
            and not call.epsilon and _gpu_ok(call.x))


def plan_matvec(call, out: torch.Tensor, debug: bool) -> Plan:
    """The plan of a validated kernel_matvec call (``ops.matvec.MatvecCall``) writing ``out``
    (the call's output tensor): matvec_kernel over row tiles x N splits x batch, one
    launch per column chunk of MAX_C and per host-loop batch entry, each split launch
    followed by matvec_combine_kernel; Euclidean/DOT float32 calls with K > 32 on tensor
    cores (:func:`_plan_matvec_wgmma` on sm_90 unless KERMAC_LIKE_WGMMA=0, else
    :func:`matvec_blocked`); the torch reference for CPU tensors, float64, GPUs before
    sm_80 and K == 0.

    DIFF calls whose path forms distances by the product formula (:func:`matvec_shifts`: the
    sm_90 tensor-core kernel, the torch path's matrix product) read x and y shifted by their
    reference point (:func:`shifted_pair`; one pass and one copy of each, no host
    synchronisation) unless they are marked as centred together (:func:`mark_centred`): the
    error is then that of centred data whatever the data's offset. DOT calls read them as given
    (their error is relative to |x| |y|, as the dot product's own).

    A float64 ``out`` of float32/16-bit inputs (validated by ops.matvec) is the float64 mode:
    the fused kernel with TOut = double (v read as float64, a float32 v widened by a copy of
    N x C; float64 products, sums, split scratch and combination; the totals stored
    unrounded), matvec_blocked with float64 accumulation for the tensor-core calls (the
    Hopper kernel matvec_wgmma rounds its output in float32: not used), float64 accumulation
    on the reference path. ``call.f32_partials`` selects the blocked float64 mode where the
    fused kernel takes the float64 mode's expanded form (``matvec_spec``'s rule). A descriptor no
    template knows (``desc.fused_ok`` False: kermac_like/formula.py) takes the torch path on every
    device (kermac_like/formula_path.py), except where an epilogue functor serves it
    (:func:`formula_fused`): then the fused SIMT kernel with the functor in place of the enum
    epilogue (specs.matvec.formula_matvec_spec), its hyper-parameters in the bandwidth, inner_p and
    outer_p slots (specs.epilogue.slot_hypers)."""
    functor = not call.desc.fused_ok and formula_fused(call, out)
    if functor and call.K > FORMULA_LOWK_UP_TO and call.dtype == torch.float32:
        # many coordinates: run_kernel's tensor-core tiles with the functor (plan.distance) times v; up
        # to FORMULA_LOWK_UP_TO the fused SIMT kernel's direct differences (the expansion's rounding of
        # r2 misses 1e-5 on anisotropic data)
        if debug:
            log_matvec.debug("kernel_matvec %r: K=%d, tensor-core tiles with its epilogue functor times v",
                             call.desc, call.K)
        return Plan("matvec_blocked", None, (), out, reference=lambda: matvec_blocked(call, out, debug), debug=debug)
    if functor:  # the functor's hyper-parameters in the ABI's bandwidth, inner_p and outer_p slots
        call = replace(call, hypers=epilogue.slot_hypers(call.desc, call.hypers))
    elif not call.desc.fused_ok:
        if debug:
            log_matvec.debug("kernel_matvec %r: torch path (a formula kernel; %s, %s)", call.desc, call.device,
                             call.dtype)
        return _reference_plan(lambda: formula_path.matvec(call, out), debug)
    wide_out = out.dtype == torch.float64 and call.dtype != torch.float64
    if not (call.K > 0 and call.dtype != torch.float64 and _gpu_ok(call.x)):
        shift = matvec_shifts(call.desc, call.x, call.y, wide_out) and not centred_together(call.x, call.y)
        if shift:  # the matrix product's sums, on x and y shifted by their reference point
            x, y, _ = shifted_pair(call.x, call.y, dtype=torch_path.work_dtype(call.dtype))
            call = replace(call, x=x, y=y)
        if debug:
            log_matvec.debug("kernel_matvec %r: torch path (%s, %s)%s", call.desc, call.device, call.dtype,
                             ", x and y shifted by their reference point" if shift else "")
        return _reference_plan(lambda: torch_path.matvec(call, out), debug)
    if call.K > MATVEC_BLOCKED_MIN_K and call.desc.is_euclidean and call.dtype == torch.float32:
        settings = Settings.current()
        if not wide_out and _wgmma_enabled(call.device, settings):
            return _plan_matvec_wgmma(call, out, debug, settings)
        if debug:
            log_matvec.debug("kernel_matvec %r: K=%d, tensor-core distance tiles times v", call.desc, call.K)
        return Plan("matvec_blocked", None, (), out, debug=debug,
                    reference=lambda: matvec_blocked(call, out, debug, settings=settings))
    om = out.unsqueeze(-1) if call.vector else out
    device = _device_index(call.device)
    v = call.v.to(torch.float64) if wide_out else call.v  # the float64 mode reads v as float64
    tensors = {"x": call.x, "y": call.y, "v": v, "out": om}
    hypers, strides, bplan = batch_plan(call, tensors)
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
    centre = 0
    if wide_out and expands(call.desc, K, call.epsilon):
        c = _symmetric_centre(call.x, call.y)
        scratch.append(c)
        centre = c.data_ptr()
    for c0 in range(0, call.C, MAX_C):
        cc = min(MAX_C, call.C - c0)
        if functor:
            spec = formula_matvec_spec(call.desc, call.dtype, K, cc)
        else:
            spec = matvec_spec(call.desc, call.dtype, K, cc, epsilon=call.epsilon, out_dtype=out_dtype,
                               f32_partials=call.f32_partials)
        first = first or spec
        if kernel is None or kernel.spec != spec:
            kernel = store.get_kernel(spec, device, debug=debug)
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
                combine = store.get_kernel(combine_spec(call.dtype, out_dtype), device, debug=debug)
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
            args += [np.int64(call.reg_diag), eps, np.int32(split), np.int32(per), centre]
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
