"""The planner of kernel_logsumexp's fused forward: cuda_templates/logsumexp.cuh.

``plan_logsumexp(call, lw, out, debug)`` returns a :class:`kermac_like.plan.Plan` that writes
``out`` (``(*batch, M, C)``, x's dtype) from the validated distance call (``call.a`` = x,
``call.b`` = y) and the log weights ``lw`` (``(..., N, C)``, x's dtype), or None when the fused
kernel does not serve the call; the op then takes its blocked path. The fused kernel serves
float32/16-bit CUDA tensors on sm_80 and newer with K <= MAX_K coordinates and no epsilon cut.

One launch of lse_kernel per column chunk (MAX_C columns) and host-loop batch entry over (row
tiles, N splits, batch). When the row tiles alone cannot fill the GPU, the N range is split
(kernel_matvec's rule, choose_split: it depends on the shapes and the device only), each split
leaves its (max, sum) pairs in a scratch of at most SCRATCH_BYTES and lse_combine_kernel
combines them in split order: the same inputs give the same bits on the same device.

The expanded exponent (LseTraits kVariant 3, one column, an exponential of the squared l2
distance, no batch): expand_params computes on the device, without a host synchronisation, a
bound on its rounding error from the data and passes the kernel [flag, centre]; the kernel takes
the expanded loop where the flag is set (and keeps the direct one where it is not).

Translation invariance: the expanded exponent forms |u|^2 + |w|^2 - 2 u.w, the product formula, but
on u = x - c, w = y - c about the centre c of x's finite rows (subtracted in the kernel, exact for
coordinates within a factor of two of c's), and expand_params's bound is computed from those centred
u and w: data offset by any vector get the same flag (up to the rounding of c) and the same error as
centred data. The direct form takes differences. Nothing else is shifted.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from .. import config
from ..descriptor import PRESETS, KernelType
from ..runtime import store
from ..runtime.specs import logsumexp as specs
from ..runtime.specs.matvec import expandable  # exp(-S d^2) of the squared l2 distance
from ..runtime.specs.logsumexp import MAX_C, MAX_K, MAX_SPLIT, c_bucket, functor_lse_spec, lse_combine_spec, lse_spec
from .core import HYPERS, Launch, Plan, batch_plan, _blocks_per_sm, _device_index, _gpu_ok, _sm_count, \
    choose_split

log = logging.getLogger("kermac_like.logsumexp")

__all__ = ["plan_logsumexp", "fused_serves", "expand_params", "SCRATCH_BYTES", "EXPAND_TOL"]

SCRATCH_BYTES = 32 << 20  # largest split scratch of one launch ([split][batch][M][kC][2] float32)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The expanded exponent where the data allow it; the setting lse_expand off (KERMAC_LIKE_LSE_EXPAND=0):
# the direct form's kernel (kVariant 2) for every call, as before it.
# The expanded exponent's error bound (natural log units) at which the kernel takes it: 2.5x below
# the 1e-5 target of max(1, |value|) (see expand_params for the bound and its constant).
EXPAND_TOL = 4e-6
_LN2_U32 = math.log(2.0) * 2.0 ** -24  # unit roundoff of float32, log2 -> natural units


def fused_serves(call, lw: torch.Tensor) -> bool:
    """Whether the fused kernel serves this validated call (else: the blocked path, a running maximum
    over run_kernel blocks)."""
    return (call.a.dtype in _DTYPES and lw.dtype == call.a.dtype and 0 < call.K <= MAX_K
            and call.N < 2 ** 31 - 1 and call.M < 2 ** 31 - 1
            and (call.epsilon is None or call.epsilon <= 0) and _gpu_ok(call.a))


def expand_params(desc, x: torch.Tensor, y: torch.Tensor, bandwidth) -> torch.Tensor:
    """[flag, centre (K)] (float32, x's device) for lse_kernel's `expand` argument: the centre c
    is the mean of x's finite rows, flag = 1.0 where the expanded exponent's error bound is at
    most EXPAND_TOL, else 0.0. Device operations only (no host synchronisation): a few reductions
    over x and y, ~1e-4 of the pair loop's time at M = N = 10^6.

    Bound: the kernel forms v - ref = (c_m + sum_k x'_k w_k) + bl_n with u = x - c, w = y - c,
    x' = 2 S u, c_m = -S |u|^2 - ref, bl_n = -S |w|^2 + lw (base 2, S = log2(e) / (2 bw^2) or
    log2(e) / bw); its K + 3 roundings fall on partial sums of size up to ~S (|u|^2 + |w|^2) (those of
    the direct form on ~S |u - w|^2), so its absolute error is about 2^-24 S (|u|^2 + |w|^2) times
    a small constant, in log2 units. The bound takes the constant 1 over the largest |u|^2 and
    |w|^2 of the finite rows (the kernel centres on the same c, so they bound every pair's):
    ln 2 2^-24 S (max |u|^2 + max |w|^2). Calibration (float32 emulation of the loop, randn D = 3,
    10^6 points, the 64 rows farthest from c): the worst result error was 0.75x the bound at
    bandwidth 0.3 (terms from few points) and 0.14x at 1.0 (errors average over many terms), so at
    EXPAND_TOL = 4e-6 the result stays within ~3e-6 of max(1, |value|). randn D = 3, 10^6 points:
    max |u|^2 + max |w|^2 ~ 62, bound 1.9e-6 / bw^2: the expanded form from bw ~ 0.7 up.
    Non-finite rows and points are left out of the maxima: the kernel keeps the direct loop in a
    CTA with a non-finite row and gives non-finite points the direct form's term. The bound and
    the kernel's loop use the same centred data (u, w about c): translation invariant, the fast
    path is chosen on shifted data as on centred data."""
    K = x.shape[-1]
    xf, yf = x.reshape(-1, K).float(), y.reshape(-1, K).float()
    fx, fy = torch.isfinite(xf).all(-1), torch.isfinite(yf).all(-1)
    centre = torch.where(fx[:, None], xf, 0).sum(0) / fx.sum().clamp_min(1)
    rx = torch.where(fx, (xf - centre).square().sum(-1), 0).amax() if xf.shape[0] else xf.new_zeros(())
    ry = torch.where(fy, (yf - centre).square().sum(-1), 0).amax() if yf.shape[0] else yf.new_zeros(())
    bw = torch.as_tensor(bandwidth, dtype=torch.float64, device=x.device).abs().amin()
    gauss = desc.kernel_type is KernelType.GAUSSIAN
    s = (math.log2(math.e) / (2.0 * bw * bw)) if gauss else (math.log2(math.e) / bw)
    bound = _LN2_U32 * s * (rx.double() + ry.double())
    flag = (bound <= EXPAND_TOL).float()  # NaN / inf bounds: 0
    return torch.cat([flag.reshape(1), centre])


def plan_logsumexp(call, lw: torch.Tensor, out: torch.Tensor, debug: bool = False, functor: tuple | None = None):
    """The fused kernel's plan of a validated call, or None (the blocked path). ``functor``: (C++ name,
    stub source) of a positive formula kernel's epilogue functor; ``call`` is then the squared_l2
    proxy with the functor's slots as hyper-parameters (ops.logsumexp)."""
    if not call.desc.fused_ok or not fused_serves(call, lw):
        return None
    device = _device_index(call.a.device)
    M, N, K, C = call.M, call.N, call.K, lw.shape[-1]
    dtype = call.a.dtype
    tensors = {"x": call.a, "y": call.b, "lw": lw, "out": out}
    hypers, strides, bplan = batch_plan(call, tensors, skip=("regularization",))
    L = bplan.count
    # The expanded exponent (kVariant 3's spec, flag and centre on the device): one column, one
    # batch entry, the shipped pair loop (probes' TUNING choose their own) and lse_expand; else the
    # direct form's kernel (kVariant 2).
    tune = specs.TUNING or specs.default_tuning(specs.k_bucket(K), c_bucket(min(C, MAX_C)), call.desc, dtype)
    expand = (config.get("lse_expand") and C == 1 and L == 1 and expandable(call.desc) and tune.get("variant") == 3
              and M > 0 and N > 0 and functor is None)
    variant = None if expand or specs.TUNING is not None else 2

    def spec_of(cc):
        if functor is not None:
            return functor_lse_spec(functor, dtype, K, cc)
        return lse_spec(call.desc, dtype, K, cc, variant=variant)

    spec = spec_of(min(C, MAX_C))
    if L == 0 or M == 0 or C == 0:
        return Plan("logsumexp", spec, (), out, debug=debug)
    if N == 0:  # no terms: log 0
        return Plan("logsumexp", spec, (), out, reference=lambda: out.fill_(-float("inf")), debug=debug)
    sxm, sxk = call.a.stride()[-2:]
    sym, syk = call.b.stride()[-2:]
    sln, slc = lw.stride()[-2:]
    som, soc = out.stride()[-2:]
    offsets = {name: list(bplan.outer_offsets(name)) for name in tensors}
    bs = {name: bplan.strides[name][1] for name in tensors}
    dims = (np.int32(L), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]))
    launches, scratch = [], [h for h in hypers.values() if isinstance(h, torch.Tensor)]  # float32 copies stay alive
    params = None
    if expand:
        params = expand_params(call.desc, call.a, call.b, call.hypers["bandwidth"])
        scratch.append(params)
    for c0 in range(0, C, MAX_C):
        cc = min(MAX_C, C - c0)
        spec_c = spec_of(cc)
        kernel = store.get_kernel(spec_c, device, debug=debug)
        kC = c_bucket(cc)
        m_tiles = -(-M // spec_c.launch.block_m)
        n_tiles = -(-N // spec_c.launch.block_n)
        slots = _sm_count(device) * _blocks_per_sm(kernel)
        max_split = max(1, min(MAX_SPLIT, SCRATCH_BYTES // (8 * kC * L * M)))
        split = choose_split(m_tiles * min(L, 65535), n_tiles, slots, max_split)
        per = -(-n_tiles // split)
        split = -(-n_tiles // per)
        part, combine = None, None
        if split > 1:
            part = torch.empty(split * L * M * kC * 2, dtype=torch.float32, device=call.a.device)
            scratch.append(part)
            combine_desc = PRESETS["gaussian_l2"] if functor is not None else call.desc  # (T and kC only)
            combine = store.get_kernel(lse_combine_spec(combine_desc, dtype, cc), device, debug=debug)
        grid = (m_tiles, split, min(L, 65535))
        if debug:
            log.debug("logsumexp %r: M=%d N=%d K=%d columns %d..%d batch=%s: grid %s, %d y tiles per split", call.desc,
                      M, N, K, c0, c0 + cc, call.batch, grid, per)
        for i in range(len(offsets["x"])):
            def ptr(name, col=0):
                t = tensors[name]
                return t.data_ptr() + (offsets[name][i] + col) * t.element_size()

            def hyper(name):
                h = hypers.get(name)
                if isinstance(h, torch.Tensor):
                    return [ptr(name), *(np.int64(s) for s in bs[name]), np.float32(0)]
                return [0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if h is None else h)]

            args = [ptr("x"), ptr("y"), ptr("lw", c0 * slc), ptr("out", c0 * soc),
                    0 if part is None else part.data_ptr(), np.int32(M), np.int32(N), np.int32(K), np.int32(cc),
                    *(np.int64(s) for s in (sxm, sxk, sym, syk, sln, slc, som, soc)), *dims,
                    *(np.int64(s) for name in ("x", "y", "lw", "out") for s in bs[name])]
            for name in HYPERS[:3]:  # inner_p, outer_p, bandwidth
                args += hyper(name)
            args += [np.int32(split), np.int32(per), 0 if params is None else params.data_ptr()]
            launches.append(Launch(kernel, grid, tuple(args)))
            if combine is not None:
                cgrid = (max(1, min(-(-(L * M * cc) // combine.spec.launch.threads), _sm_count(device) * 8)), 1, 1)
                cargs = (part.data_ptr(), ptr("out", c0 * soc), np.int32(M), np.int32(cc), np.int32(split),
                         np.int64(som), np.int64(soc), *dims, *(np.int64(s) for s in bs["out"]))
                launches.append(Launch(combine, cgrid, cargs))
    return Plan("logsumexp", spec, tuple(launches), out, scratch=tuple(scratch), debug=debug)
