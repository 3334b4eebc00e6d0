"""The planner of the fused top-k selection (k nearest neighbours, kernel_topk):
cuda_templates/topk.cuh.

``plan_topk(call, values, indices, debug)`` returns a :class:`kermac_like.plan.Plan` that
writes ``values`` (``(*batch, M, k)``, x's dtype) and ``indices`` (same shape, int64), or
None when no fused kernel serves the call; the caller then takes the blocked path. The
fused kernel serves float32/16-bit CUDA tensors on sm_80 and newer with K <= MAX_K
coordinates, k <= MAX_SELECT, no regularisation and no epsilon cut.

One launch of topk_kernel per host-loop batch entry over (row tiles, N splits, batch). With
one N range per row tile the kernel keeps each row's list in the indices output and decodes
it there; when the row tiles alone cannot fill the GPU (few rows, e.g. a handful of queries
against a large y), the N range is split (kernel_matvec's rule, choose_split), each split
leaves its sorted list in a scratch of at most SCRATCH_BYTES and topk_combine_kernel merges
the splits in a fixed order: keys are distinct (value bits, index), so the result does not
depend on the split count.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..layout import batch_strides, plan_batch
from ..runtime.specs.topk import MAX_K, MAX_SELECT, MAX_SPLIT, topk_combine_spec, topk_spec
from .core import HYPERS, Launch, Plan, _add_hyper_tensors, _blocks_per_sm, _device_index, _gpu_ok, _sm_count, \
    choose_split

log = logging.getLogger("kermac_like.topk")

__all__ = ["plan_topk", "fused_serves", "SCRATCH_BYTES"]

SCRATCH_BYTES = 32 << 20  # largest split scratch of one call ([split][batch][M][k] int64 keys)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_serves(call) -> bool:
    """Whether the fused kernel serves this validated call (else: the blocked path)."""
    reg = call.hypers.get("regularization")
    return (call.dtype in _DTYPES and 0 < call.K <= MAX_K and 1 <= call.k <= MAX_SELECT
            and call.N < 2 ** 31 - 1 and call.M < 2 ** 31 - 1
            and (reg is None or (not isinstance(reg, torch.Tensor) and reg == 0))
            and (call.epsilon is None or call.epsilon <= 0) and _gpu_ok(call.x))


def plan_topk(call, values: torch.Tensor, indices: torch.Tensor, debug: bool = False):
    if not fused_serves(call):
        return None
    from ..runtime.launcher import get_kernel

    device = _device_index(call.device)
    spec = topk_spec(call.desc, call.dtype, call.K, call.largest, call.k)
    kernel = get_kernel(spec, device, debug=debug)
    hypers = {k: (h.float() if isinstance(h, torch.Tensor) and h.dtype != torch.float32 else h)
              for k, h in call.hypers.items() if k != "regularization"}
    tensors = {"x": call.x, "y": call.y, "values": values, "indices": indices}
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()}
    _add_hyper_tensors(call, hypers, tensors, strides)
    bplan = plan_batch(call.batch, strides)
    L = bplan.count
    M, N, K, k = call.M, call.N, call.K, call.k
    if L == 0 or M == 0:
        return Plan("topk", spec, (), values, debug=debug)
    m_tiles = -(-M // spec.launch.block_m)
    n_tiles = -(-N // spec.launch.block_n)
    slots = _sm_count(device) * _blocks_per_sm(kernel)
    max_split = max(1, min(MAX_SPLIT, SCRATCH_BYTES // (8 * L * M * k)))
    split = choose_split(m_tiles * min(L, 65535), n_tiles, slots, max_split)
    per = -(-n_tiles // split)
    split = -(-n_tiles // per)
    scratch, combine = [], None
    if split > 1:
        part = torch.empty(split * L * M * k, dtype=torch.int64, device=call.device)
        scratch.append(part)
        combine = get_kernel(topk_combine_spec(call.desc, call.dtype, call.largest), device, debug=debug)
    scratch += [h for h in hypers.values() if isinstance(h, torch.Tensor)]  # float32 copies stay alive
    grid = (m_tiles, split, min(L, 65535))
    if debug:
        log.debug("topk %r: M=%d N=%d K=%d k=%d largest=%s batch=%s: grid %s, %d y tiles per split, %d rows per CTA",
                  call.desc, M, N, K, k, call.largest, call.batch, grid, per, spec.launch.block_m)
    sxm, sxk = call.x.stride()[-2:]
    sym, syk = call.y.stride()[-2:]
    svm, svj = values.stride()[-2:]
    sim, sij = indices.stride()[-2:]
    offsets = {name: list(bplan.outer_offsets(name)) for name in tensors}
    bs = {name: bplan.strides[name][1] for name in tensors}
    launches = []
    for i in range(len(offsets["x"])):
        def ptr(name):
            t = tensors[name]
            return t.data_ptr() + offsets[name][i] * t.element_size()

        def hyper(name):
            h = hypers.get(name)
            if isinstance(h, torch.Tensor):
                return [ptr(name), *(np.int64(s) for s in bs[name]), np.float32(0)]
            return [0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0 if h is None else h)]

        dims = (np.int32(L), np.int32(bplan.modes[1]), np.int32(bplan.modes[2]))
        keys = ptr("indices") if split == 1 else scratch[0].data_ptr()
        args = [ptr("x"), ptr("y"), ptr("values") if split == 1 else 0, keys, np.int32(M), np.int32(N), np.int32(K),
                np.int32(k), *(np.int64(s) for s in (sxm, sxk, sym, syk, svm, svj, sim, sij)), *dims,
                *(np.int64(s) for name in ("x", "y", "values", "indices") for s in bs[name])]
        for name in HYPERS[:3]:  # inner_p, outer_p, bandwidth
            args += hyper(name)
        args += [np.int32(split), np.int32(per)]
        launches.append(Launch(kernel, grid, tuple(args)))
        if combine is not None:
            cgrid = (max(1, min(-(-(L * M) // combine.spec.launch.threads), _sm_count(device) * 8)), 1, 1)
            cargs = (scratch[0].data_ptr(), ptr("values"), ptr("indices"), np.int32(M), np.int32(k), np.int32(split),
                     *(np.int64(s) for s in (svm, svj, sim, sij)), *dims,
                     *(np.int64(s) for name in ("values", "indices") for s in bs[name]), *hyper("outer_p"))
            launches.append(Launch(combine, cgrid, cargs))
    return Plan("topk", spec, tuple(launches), values, scratch=tuple(scratch), debug=debug)
