"""The planner of the fused top-k selection (k nearest neighbours, kernel_topk):
cuda_templates/topk.cuh.

``plan_topk(call, values, indices, debug)`` returns a :class:`kermac_like.plan.Plan` that
writes ``values`` (``(*batch, M, k)``, x's dtype) and ``indices`` (same shape, int64), or
None when no fused kernel serves the call; the caller then takes the blocked path (for K >
MAX_K the tensor-core candidates' plan, whose run() returns the rows it left uncertified: the
caller recomputes those, ops/knn.py). The fused kernel serves float32/16-bit CUDA tensors on
sm_80 and newer with K <= MAX_K coordinates, k <= MAX_SELECT, no regularisation and no epsilon
cut.

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

from .. import config
from ..centring import shifted_pair
from ..descriptor import PRESETS
from ..runtime import launcher, store
from ..runtime.specs.topk import (FALLBACK_MAX_K, MAX_K, MAX_SELECT, MAX_SPLIT, MMA_BLOCK_M, MMA_BLOCK_N, MMA_MAX_SELECT, MMA_V5_MAX_K,
                                  MMA_VERSIONS, RESCORE_WARPS, mma_sel, mma_smem, topk_combine_spec, topk_mma_spec,
                                  topk_rescore_spec, topk_spec)
from .core import HYPERS, Launch, Plan, batch_plan, _blocks_per_sm, _device_index, _gpu_ok, _sm_count, \
    _smem_per_block_optin, choose_split

log = logging.getLogger("kermac_like.topk")

__all__ = ["plan_topk", "fused_serves", "mma_serves", "exact_products", "SCRATCH_BYTES"]

SCRATCH_BYTES = 32 << 20  # largest split scratch of one call ([split][batch][M][k] int64 keys)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_serves(call, wide: bool = False) -> bool:
    """Whether the fused kernel serves this validated call (else: the blocked path); ``wide``:
    up to FALLBACK_MAX_K coordinates (the tensor-core candidates' uncertified rows)."""
    reg = call.hypers.get("regularization")
    return (call.dtype in _DTYPES and 0 < call.K <= (FALLBACK_MAX_K if wide else MAX_K) and 1 <= call.k <= MAX_SELECT
            and call.N < 2 ** 31 - 1 and call.M < 2 ** 31 - 1
            and (reg is None or (not isinstance(reg, torch.Tensor) and reg == 0))
            and (call.epsilon is None or call.epsilon <= 0) and _gpu_ok(call.x))


def plan_topk(call, values: torch.Tensor, indices: torch.Tensor, debug: bool = False, *, fallback: bool = False):
    """The plan of a validated call, or None (the blocked path). The tensor-core plan (family
    "topk_mma", :func:`mma_serves`) returns from ``run()`` the mask of the rows it left uncertified
    (:func:`_run_mma`), for the caller to recompute; ``fallback``: the exact SIMT selection of
    such rows (K up to FALLBACK_MAX_K; never the tensor-core path again). A descriptor no template
    knows (``desc.fused_ok`` False): None."""
    if call.desc is not None and not call.desc.fused_ok:
        return None
    if not fallback and mma_serves(call):
        return Plan("topk_mma", None, (), values, reference=lambda: _run_mma(call, values, indices, debug),
                    debug=debug)
    if not fused_serves(call, wide=fallback):
        return None
    device = _device_index(call.device)
    spec = topk_spec(call.desc, call.dtype, call.K, call.largest, call.k)
    kernel = store.get_kernel(spec, device, debug=debug)
    tensors = {"x": call.x, "y": call.y, "values": values, "indices": indices}
    hypers, strides, bplan = batch_plan(call, tensors, skip=("regularization",))
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
        combine = store.get_kernel(topk_combine_spec(call.desc, call.dtype, call.largest), device, debug=debug)
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


# -- K > MAX_K: candidates on tensor cores, rescored exactly -------------------------------------
_MMA_DESCS = (PRESETS["l2"], PRESETS["squared_l2"], PRESETS["dot"])
RESCORE_ROWS = 1024  # rows per rescoring block: (rows, kSel, K) gathered float32 points
# The candidates rescored by topk_rescore_kernel (cuda_templates/topk_rescore.cuh: lists merged,
# values, order and certificate in one launch, no gathered temporary) instead of rescore()'s
# torch blocks: 0.11 ms instead of 7.7 ms per launch of 16896 rows on an H200, same indices and
# certificates (bench/notes/knn.md, "Fused rescoring"). The setting topk_fused_rescore off
# (KERMAC_LIKE_TOPK_FUSED_RESCORE=0) restores the torch rescoring (the oracle of the tests).
# topk_mma's version (runtime.specs.topk.topk_mma_spec): 2, topk_mma_kernel; 3, 4 or 5,
# topk_mma_pipelined_kernel (the cp.async ring runs on across y tiles; 4 also scans in registers;
# 5 also keeps x in shared memory, K <= 128, else 4), the same candidate lists bit for bit.
# Measured on an H200 at knn_d128 (bench/notes/knn.md, "topk_mma v3"): 66.3 / 70.8 / 50.0 / 49.1 ms
# per TF32 launch for versions 2 / 3 / 4 / 5, the whole call 5.77 / 4.57 / 3.37 / 3.32 s: 5.
# 6 (cuda_templates/topk_wgmma.cuh: warp-specialised wgmma, sm_90 only, K <= 128) on an H100
# (bench/results/2026-11-26-session12/run3, `bench/probes/topk_probe.py --only mma6`): 26.60 against
# version 5's 47.90 ms per launch, the merged candidates of all 16896 rows equal to version 5's, the
# whole knn_d128 call 1,772 against 4,582 ms in the probe: 6 (5 where 6 cannot run: see mma_version).
# The version: the setting topk_mma_version (KERMAC_LIKE_TOPK_MMA_VERSION, default 6).
_FLIP = -(1 << 63)  # the scratch keys' top bit (int64 order = key order)


def mma_serves(call) -> bool:
    """Whether the tensor-core candidate path serves this call: float32 Euclidean or dot-product
    selection at K > MAX_K with k <= MMA_MAX_SELECT, no batch modes, on sm_80 and newer, where
    some version's shared memory fits the device (:func:`mma_version`)."""
    reg = call.hypers.get("regularization")
    return (call.K > MAX_K and call.dtype == torch.float32 and call.desc in _MMA_DESCS
            and 1 <= call.k <= min(MMA_MAX_SELECT, call.N) and not call.batch and call.N < 2 ** 31 - 1
            and (reg is None or (not isinstance(reg, torch.Tensor) and reg == 0))
            and (call.epsilon is None or call.epsilon <= 0) and _gpu_ok(call.x)
            and mma_version(call) is not None)


def _smem_optin(device: torch.device) -> int:
    """Shared memory one block may opt in to (bytes); unbounded off CUDA (the CPU shim tests)."""
    if device.type != "cuda":
        return 1 << 30
    return _smem_per_block_optin(_device_index(device)) or (227 << 10)


def _sm90(device: torch.device) -> bool:
    """Whether topk_mma version 6 (sm_90a: wgmma, setmaxnreg) exists on this device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def mma_version(call):
    """The topk_mma version a call runs: the setting topk_mma_version (5 and 6 only where K <= MMA_V5_MAX_K, else 4;
    6 only on sm_90 devices, else 5),
    or the highest lower one whose shared memory fits the device's opt-in limit per block (an
    A100's 163 KiB holds none at kSel 24: those calls take the blocked path); None if none fits."""
    wide = -(-call.K // 4) * 4 > MMA_V5_MAX_K
    version = config.get("topk_mma_version")
    want = 4 if version >= 5 and wide else version
    optin = _smem_optin(call.x.device)
    sel = mma_sel(call.k)
    # version 6 (wgmma, sm_90a) on sm_90 devices only; elsewhere the versions below it
    fits = [v for v in MMA_VERSIONS if v <= want and mma_smem(sel, v) <= optin and (v < 6 or _sm90(call.x.device))]
    return max(fits) if fits else None


def _rows_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major rows of K % 4 == 0 floats at a 16-byte aligned address (distance_mma.cuh's
    operand rule), zero-padded along K where needed (zeros change no distance or dot product)."""
    K = t.shape[-1]
    if K % 4 == 0 and t.stride(-1) == 1 and t.stride(-2) == K and t.data_ptr() % 16 == 0:
        return t
    out = t.new_zeros((t.shape[0], -(-K // 4) * 4))
    out[:, :K] = t
    return out


def _decode(bits: torch.Tensor, dot: bool, largest: bool) -> torch.Tensor:
    """Values (float32) of order bits held in int64 (topk.cuh's order_bits inverted)."""
    if largest:
        bits = bits ^ 0xFFFFFFFF
    if dot:
        neg = bits < 0x80000000
        bits = torch.where(neg, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # the low word's bit pattern


def candidate_bound(xn: torch.Tensor, ynorm, a: torch.Tensor, K: int, dot: bool,
                    kth: torch.Tensor | None = None) -> torch.Tensor:
    """How far a TF32 candidate value can be from the float32 one, for rows of norm ``xn``
    against points of norm <= ``ynorm`` (``a``: the values at stake, for the float32 rounding
    of the rescoring): twice the TF32 rounding of both operands (2^-10 |x||y| per dot product,
    with fp32 accumulation over K), and for squared distances the two norms' fp32 sums.

    ``kth`` (squared distances, smallest first): the row's k-th exact value. A point that can
    displace it lies within sqrt(kth) of x, so its norm is at most |x| + sqrt(kth) (with the
    norms' own float32 error as slack): the bound then takes that window's norm where it is
    below ``ynorm`` (far points and heavy tails no longer widen every row's bound)."""
    if dot:
        return 2.0 ** -9 * xn * ynorm + 2.0 ** -16 * a.abs()
    if kth is not None:
        ynorm = torch.minimum(ynorm, (xn + kth.sqrt()) * window_scale(K))  # a NaN norm still certifies nothing
    return 2.0 ** -8 * xn * ynorm + K * 2.0 ** -22 * (xn * xn + ynorm * ynorm) + 2.0 ** -16 * a.abs()


def window_scale(K: int) -> float:
    """The slack factor of candidate_bound's window (float32): 1 + 2^-16 (the rescored k-th
    value's rounding) + K 2^-22 (the norms' float32 sums), as topk_rescore.cuh forms it."""
    return float(np.float32(np.float32(1.0 + 2.0 ** -16) + np.float32(K * 2.0 ** -22)))


def rescore(xs: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, pad: torch.Tensor, last: torch.Tensor, ynorm,
            k: int, *, dot: bool, largest: bool, xn: torch.Tensor | None = None) -> tuple:
    """The k best of each row's candidates ``idx`` (b, sel) (``pad``: entries that are no
    candidate) by float32 values recomputed by direct differences (squared distances, or dot
    products), in the (value, index) order; and whether each row is certified: its k-th value
    clear of ``last`` (the approximate value of the row's last candidate, beyond which every
    point left out lies) by :func:`candidate_bound` with the norms the candidates were formed
    from (``xn``: the rows' norms, default |xs|; ``ynorm``: the points' largest).
    Returns (values (b, k), indices, ok (b,))."""
    xs = xs.float()
    yg = y[idx].float()  # (b, sel, K)
    if dot:
        ev = (yg * xs[:, None, :]).sum(-1)
    else:
        yg.sub_(xs[:, None, :])
        ev = yg.square_().sum(-1)
    del yg
    ev.masked_fill_(pad, float("-inf") if largest else float("inf"))
    # (value, index) order: by index, then a stable sort by value (NaN as torch.sort orders it)
    oi = torch.sort(idx, dim=1).indices
    ev, ii = ev.gather(1, oi), idx.gather(1, oi)
    ov = torch.sort(ev, dim=1, descending=largest, stable=True).indices[:, :k]
    ev, ii = ev.gather(1, ov), ii.gather(1, ov)
    kth = ev[:, -1]
    bound = candidate_bound(torch.linalg.vector_norm(xs, dim=1) if xn is None else xn, ynorm, last, xs.shape[1], dot,
                            kth=None if dot or largest else kth)
    ok = (kth > last + bound) if largest else (kth < last - bound)
    return ev, ii, ok | pad.any(1)


def merged_candidates(cand: torch.Tensor, sel: int, N: int, dot: bool, largest: bool) -> tuple:
    """Each row's kSel first candidates over topk_mma_kernel's lists ``cand`` (lists, rows, kSel)
    (keys, top bit flipped): their indices (rows, kSel) (pads: N - 1), which are pads (lists
    shorter than kSel: N small, every point a candidate), and the approximate value of the last."""
    rr = cand.shape[1]
    cand = cand.permute(1, 0, 2).reshape(rr, -1)
    top = torch.topk(cand, sel, dim=1, largest=False, sorted=True).values ^ _FLIP  # (rr, sel) keys
    pad = top == -1
    idx = (top & 0xFFFFFFFF).clamp_max(N - 1)
    last = _decode((top[:, -1] >> 32) & 0xFFFFFFFF, dot, largest)
    return idx, pad, last


def exact_products(x: torch.Tensor, y: torch.Tensor, K: int) -> torch.Tensor:
    """Whether the candidates' values are exact for these operands (a 0-dim bool on the device, no
    host synchronisation): every coordinate an integer of magnitude m <= 2^11 (exact in TF32) with
    4 K m^2 <= 2^24, so that every product, norm, sum and difference the kernels form is an exact
    float32 integer (one-hot codes, small counts). The candidates then come in the exact (value,
    index) order, ties included, and every row is certified: no TF32 bound, no tie at the k-th
    value left to the fallback."""
    m = torch.maximum(x.abs().amax(), y.abs().amax()) if x.numel() and y.numel() else x.new_zeros(())
    integral = ~((x != x.round()).any() | (y != y.round()).any())
    return integral & (m <= 2.0 ** 11) & (4.0 * K * m * m <= 2.0 ** 24)


def _run_mma(call, values: torch.Tensor, indices: torch.Tensor, debug: bool):
    """Per launch of one wave of row tiles: topk_mma_kernel's candidate lists (kSel per row,
    TF32 dot products), their values recomputed in float32 by direct differences (as the
    SIMT kernel forms them) and the k best kept in the (value, index) order. A row is certified
    when its k-th exact value is clear of every point left out: those have approximate values
    beyond the candidates' last, and an approximate value is within the TF32 error bound B of
    the exact one (B = 2^-8 |x| max|y| + K 2^-22 (|x|^2 + max|y|^2) for distances, 2^-9 |x|
    max|y| for dot products, plus 2^-16 of the value for the float32 rescoring). Returns which rows
    are not certified (NaN rows, near-ties across the margin; none where :func:`exact_products`
    holds): a bool mask (M,) on the device, no host synchronisation; the caller recomputes them (ops/knn.py: the fused SIMT selection, ``plan_topk(...,
    fallback=True)``, where K <= FALLBACK_MAX_K; beyond it the blocked path).
    With topk_fused_rescore, topk_rescore_kernel does the merge, the rescoring, the order and the
    certificate of each launch's rows in one launch (same candidates, same bound; the float32
    sums in another order: values within a few ulps)."""
    dot = call.desc.inner_operator.name == "DOT"
    largest, k, M, N, K = call.largest, call.k, call.M, call.N, call.K
    device = _device_index(call.device)
    version = mma_version(call)
    spec = topk_mma_spec(dot, largest, k, version=version)
    sel = mma_sel(k)
    kernel = store.get_kernel(spec, device, debug=debug)
    x, y = _rows_ready(call.x), _rows_ready(call.y)
    # Distances: the candidates' TF32 products and their bound on the data shifted by its
    # reference point, so that the bound (and the share of rows it certifies) follows the data's
    # centred scale, not |x| (features shifted by +3 at knn_d128: every row uncertified before);
    # the rescoring's direct differences read the data as given.
    Kp = x.shape[1]
    # The reference point is the call's (ops/knn.py's groups: an anchor near the rows), else the data's.
    point = getattr(call, "reference", None)
    xc, yc = (x, y) if dot else shifted_pair(call.x, call.y, point=point, pad_to=Kp)[:2]  # one copy each, padded
    exact = exact_products(xc, yc, Kp)
    slots = _sm_count(device) * _blocks_per_sm(kernel)
    rows = min(M, slots * MMA_BLOCK_M)  # one wave of row tiles per launch
    m_tiles = -(-rows // MMA_BLOCK_M)
    n_tiles = -(-N // MMA_BLOCK_N)
    split = choose_split(m_tiles, n_tiles, slots, max(1, min(MAX_SPLIT, SCRATCH_BYTES // (4 * rows * sel * 8))))
    per = -(-n_tiles // split)
    split = -(-n_tiles // per)
    scratch = torch.empty((4 * split, rows, sel), dtype=torch.int64, device=call.device)
    ynorm = torch.linalg.vector_norm(yc, dim=1).max()
    fused = flags = None
    if config.get("topk_fused_rescore"):  # the rows' certificates (uint8) of the fused rescoring
        fused = store.get_kernel(topk_rescore_spec(dot, largest), device, debug=debug)
        flags = torch.empty(M, dtype=torch.uint8, device=call.device)
        svm, svj = values.stride()
        sim, sij = indices.stride()
    if debug:
        log.debug("topk %r: M=%d N=%d K=%d k=%d on tensor cores: %d rows per launch, grid (%d, %d), %d y tiles per "
                  "split, %d candidates per row", call.desc, M, N, K, k, rows, m_tiles, split, per, sel)
    bad = torch.zeros(M, dtype=torch.bool, device=call.device)
    for r0 in range(0, M, rows):
        rr = min(rows, M - r0)
        args = (xc.data_ptr() + r0 * Kp * 4, yc.data_ptr(), scratch.data_ptr(), np.int32(rr), np.int32(N),
                np.int32(Kp), np.int64(Kp), np.int64(Kp), np.int32(1), np.int32(1), np.int32(1),
                *(np.int64(0),) * 6, np.int32(split), np.int32(per))
        launcher.launch(kernel, (-(-rr // MMA_BLOCK_M), split, 1), args, debug=debug)
        if fused is not None:
            xn = torch.linalg.vector_norm(xc[r0:r0 + rr], dim=1)
            launcher.launch(fused, (-(-rr // RESCORE_WARPS), 1, 1),
                            (scratch.data_ptr(), x.data_ptr() + r0 * Kp * 4, y.data_ptr(), xn.data_ptr(),
                             ynorm.data_ptr(), values.data_ptr() + r0 * svm * 4, indices.data_ptr() + r0 * sim * 8,
                             flags.data_ptr() + r0, np.int32(rr), np.int32(N), np.int32(Kp), np.int32(k),
                             np.int32(sel), np.int32(4 * split), np.int64(Kp), np.int64(Kp), np.int64(svm),
                             np.int64(svj), np.int64(sim), np.int64(sij), np.float32(K * 2.0 ** -22),
                             np.int32(call.desc == PRESETS["l2"])), debug=debug)
            continue
        # the kernel's layout is [4 * split][rr][sel]: a short last launch packs its lists
        lists = scratch.view(-1)[:4 * split * rr * sel].view(4 * split, rr, sel)
        idx, pad, last = merged_candidates(lists, sel, N, dot, largest)
        for s0 in range(0, rr, RESCORE_ROWS):
            s1 = min(rr, s0 + RESCORE_ROWS)
            v, ii, ok = rescore(call.x[r0 + s0:r0 + s1], call.y, idx[s0:s1], pad[s0:s1], last[s0:s1], ynorm, k,
                                dot=dot, largest=largest, xn=torch.linalg.vector_norm(xc[r0 + s0:r0 + s1], dim=1))
            values[r0 + s0:r0 + s1] = v.sqrt() if call.desc == PRESETS["l2"] else v
            indices[r0 + s0:r0 + s1] = ii
            bad[r0 + s0:r0 + s1] = ~ok
    return ((flags == 0) if fused is not None else bad) & ~exact
