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
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from ..runtime.specs.logsumexp import MAX_C, MAX_K, MAX_SPLIT, c_bucket, lse_combine_spec, lse_spec
from .core import HYPERS, Launch, Plan, batch_plan, _blocks_per_sm, _device_index, _gpu_ok, _sm_count, \
    choose_split

log = logging.getLogger("kermac_like.logsumexp")

__all__ = ["plan_logsumexp", "fused_serves", "SCRATCH_BYTES"]

SCRATCH_BYTES = 32 << 20  # largest split scratch of one launch ([split][batch][M][kC][2] float32)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The fused kernel serves GPU calls by default (tests/test_gpu_logsumexp.py and compute-sanitizer's
# logsumexp family passed on an H100, 2026-11-26); KERMAC_LIKE_LSE_FUSED=0 sends them to the
# blocked path (running maximum over run_kernel blocks) instead.
FUSED = os.environ.get("KERMAC_LIKE_LSE_FUSED", "1") != "0"


def fused_serves(call, lw: torch.Tensor) -> bool:
    """Whether the fused kernel serves this validated call (else: the blocked path)."""
    return (FUSED and call.a.dtype in _DTYPES and lw.dtype == call.a.dtype and 0 < call.K <= MAX_K
            and call.N < 2 ** 31 - 1 and call.M < 2 ** 31 - 1
            and (call.epsilon is None or call.epsilon <= 0) and _gpu_ok(call.a))


def plan_logsumexp(call, lw: torch.Tensor, out: torch.Tensor, debug: bool = False):
    if not fused_serves(call, lw):
        return None
    from ..runtime.launcher import get_kernel

    device = _device_index(call.a.device)
    M, N, K, C = call.M, call.N, call.K, lw.shape[-1]
    dtype = call.a.dtype
    tensors = {"x": call.a, "y": call.b, "lw": lw, "out": out}
    hypers, strides, bplan = batch_plan(call, tensors, skip=("regularization",))
    L = bplan.count
    spec = lse_spec(call.desc, dtype, K, min(C, MAX_C))
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
    for c0 in range(0, C, MAX_C):
        cc = min(MAX_C, C - c0)
        spec_c = lse_spec(call.desc, dtype, K, cc)
        kernel = get_kernel(spec_c, device, debug=debug)
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
            combine = get_kernel(lse_combine_spec(call.desc, dtype, cc), device, debug=debug)
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
            args += [np.int32(split), np.int32(per)]
            launches.append(Launch(kernel, grid, tuple(args)))
            if combine is not None:
                cgrid = (max(1, min(-(-(L * M * cc) // combine.spec.launch.threads), _sm_count(device) * 8)), 1, 1)
                cargs = (part.data_ptr(), ptr("out", c0 * soc), np.int32(M), np.int32(cc), np.int32(split),
                         np.int64(som), np.int64(soc), *dims, *(np.int64(s) for s in bs["out"]))
                launches.append(Launch(combine, cgrid, cargs))
    return Plan("logsumexp", spec, tuple(launches), out, scratch=tuple(scratch), debug=debug)
