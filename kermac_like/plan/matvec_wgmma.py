"""kernel_matvec on Hopper: the plan of matvec_wgmma_kernel (cuda_templates/matvec_wgmma.cuh)
after the distance rule's wgmma b preparation (:class:`.distance._WgmmaPrepare`), chosen
by :func:`.matvec.plan_matvec` for Euclidean/DOT float32 calls on sm_90.

The kernel forms squared distances by the product formula in 3xTF32 (b's squared norms from
the preparation, the dot products on the tensor cores), whose error is ~eps (|x|^2 + |y|^2):
DIFF calls read x and y shifted by their reference point (:func:`kermac_like.centring.shifted_pair`), so
that the error is eps times the data's centred scale whatever its offset; DOT calls read them
as given (error relative to |x| |y|, as the dot product's own)."""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch

from ..centring import centred_together, shift_invariant
from ..descriptor import KernelDescriptor
from ..layout import batch_strides
from ..runtime import launcher, store
from ..runtime.specs.matvec import MAX_C, c_bucket, combine_spec
from ..runtime.specs import wgmma_prepare_needs, wgmma_prepare_spec
from ..runtime.specs.matvec_wgmma import carry_spec, matvec_wgmma_spec
from .core import (
    HYPERS,
    MATVEC_SCRATCH_BYTES,
    Launch,
    Plan,
    Settings,
    batch_plan,
    _device_index,
    _reference_plan,
    _sm_count,
    choose_split,
)
from . import shift
from .distance import WGMMA_BLOCK_K, _pad_k, _Ptr, _same_memory, _WgmmaPrepare, b_entries

__all__ = ["MATVEC_WGMMA_BLOCK_BYTES", "MATVEC_WGMMA_TILE"]

log_matvec = logging.getLogger("kermac_like.matvec")

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
    (batch x M x C, several ranges only); for DIFF descriptors, x and y shifted by their
    reference point (one copy of each, zero-padded to whole 16-byte rows; one for both where
    x is y; none where they are marked as centred together, :func:`kermac_like.centring.mark_centred`),
    else padded copies of x and y where their rows are not 16-byte aligned."""
    om = out.unsqueeze(-1) if call.vector else out
    device = _device_index(call.device)
    M, N, K, C = call.M, call.N, call.K, call.C
    L = math.prod(call.batch) if call.batch else 1
    if L == 0 or M == 0 or C == 0:
        return Plan("matvec_wgmma", None, (), out, debug=debug)
    if N == 0:  # an empty sum
        return _reference_plan(lambda: (om.zero_(), out)[1], debug)
    x, y = call.x, call.y
    if shift_invariant(call.desc) and not centred_together(x, y):
        # the product formula on x - s, y - s (fresh row-major copies, K zero-padded to whole 16-byte rows)
        x, y = shift.shifted_pair(x, y, pad_to=-(-K // 4) * 4, debug=debug)  # (plan.shift: the GPU's kernels)
    elif not (_tc_rows_ok(x) and _tc_rows_ok(y)):
        # fresh row-major copies, K zero-padded to whole 16-byte rows (one copy if x is y)
        Kp = -(-K // 4) * 4
        px = _pad_k(x, Kp).contiguous()
        x, y = px, (px if _same_memory(x, y) else _pad_k(y, Kp).contiguous())
    self_on = _same_memory(x, y)
    tensors = {"a": x, "b": y, "out": om}
    vb = tuple(call.v.shape[:-2])
    unit = torch.empty(vb, device="meta").stride() if vb else ()  # v tiles: one unit per entry
    hypers, strides, bplan = batch_plan(call, tensors, extra_strides={"v": batch_strides(call.batch, vb, unit)})
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

    small, norms = wgmma_prepare_needs(call.desc, tf32=tf32)  # compiled side by side with the kernels
    store.prefetch([*(matvec_wgmma_spec(call.desc, c_bucket(cc), tf32=tf32) for _, cc in chunks),
              wgmma_prepare_spec(small=small, norms=norms)], device, debug=debug)

    kernels = {}
    for c0, cc in chunks:
        spec = matvec_wgmma_spec(call.desc, c_bucket(cc), tf32=tf32)
        if spec not in kernels:
            kernels[spec] = store.get_kernel(spec, device, debug=debug)
    first_spec = next(iter(kernels))
    clusters = launcher.max_active_clusters(kernels[first_spec])
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
                            combine = store.get_kernel(combine_spec(torch.float32), device, debug=debug)
                        cargs = (part.data_ptr(), 0, out_ptr, np.int32(M), np.int32(N), np.int32(cc), np.int64(0),
                                 np.int64(0), np.int64(som), np.int64(soc), np.int32(Lk), np.int32(bplan.modes[1]),
                                 np.int32(bplan.modes[2]), *([np.int64(0)] * 3), *(np.int64(s_) for s_ in so),
                                 0, np.int64(0), np.int64(0), np.int64(0), np.float32(0.0), np.int64(0),
                                 np.int32(split))
                        launches.append(Launch(combine, cgrid, cargs))
                    else:
                        if carry_k is None:
                            carry_k = store.get_kernel(carry_spec(), device, debug=debug)
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
