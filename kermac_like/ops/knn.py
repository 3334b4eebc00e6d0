"""k nearest neighbours without the distance matrix: :func:`kernel_topk` and :func:`knn`.

``kernel_topk`` returns the k best entries of every row of ``run_kernel(descriptor, x, y,
...)`` (the smallest distances, or the largest kernel values / dot products) and their
column indices; ``knn`` is its distance case with torch.cdist's p. Data flow of one call:
validate every argument (nothing is written before all checks pass) -> the fused planner
(:func:`kermac_like.plan.topk.plan_topk`) -> when it serves no kernel (CPU tensors, float64,
k beyond the fused limit, p = 0 or inf, GPUs before sm_80), the blocked path of this module:
the kernel matrix in row and column blocks of bounded size, each block's candidates merged
into a running top-k per row.

The order is total and deterministic: ``(value, index)`` lexicographically, the best value
first (ascending for ``largest=False``, descending for ``largest=True``), exact ties by the
smaller column index. NaN is ordered as torch.topk and torch.sort order it: above every
number, +inf included, so a NaN comes first with ``largest=True`` and last with
``largest=False`` (where it is selected only when a row has fewer than k numbers); NaNs tie
with each other (smaller index first), and -0.0 ties with 0.0. On the CPU path a query row
with a NaN coordinate (all its values NaN) takes torch.topk's indices of its all-NaN row.

Internal entry points: :func:`prepare_topk` (validation -> :class:`TopkCall`),
:func:`topk_forward` (no autograd), :func:`topk_blocked` (the blocked path),
:func:`recompute_rows` (the rows the tensor-core candidates left uncertified),
:func:`topk_backward_pairs` (the gradient at the selected pairs) and :func:`merge_candidates` /
:func:`merge_order` (the exact merge, shared with the multi-process search of
:mod:`kermac_like.neighbors`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from .. import _debug, config, formula_path
from ..calls import DistanceCall, TopkCall, values_are_distances
from ..centring import pair_reference
from .._args import check_int, check_scalar_or_tensor
from ..descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType
from ..layout import analyse_output, broadcast_batch_shape
from ..plan.topk import plan_topk
from ..reference import distance_reference
from ._library import (check_no_hyper_grad, descriptor_from_ints, descriptor_ints, direct_call, join_hypers,
                       register_autograd, split_hyper)
from . import distance_backward
from .distance import COMPUTE_MODES, cdist, check_data, prepare_call, run_kernel

log = logging.getLogger("kermac_like.knn")

__all__ = ["kernel_topk", "knn", "TopkCall", "prepare_topk", "prepare_knn", "topk_forward", "topk_blocked",
           "recompute_rows", "sample_groups", "row_groups", "merge_candidates", "merge_order", "BLOCK_ELEMENTS_CPU", "BLOCK_ELEMENTS_GPU"]

# Elements of one block of kernel values on the blocked path (all batch entries together):
# 16 MB of float64 on a CPU, 128 MB of float32 on a GPU (plan.MATVEC_TILE_ELEMENTS).
BLOCK_ELEMENTS_CPU = 1 << 21
BLOCK_ELEMENTS_GPU = 1 << 25
# Columns of one block at least (more when M is small, so that few rows see all of N at once).
MIN_BLOCK_COLUMNS = 4096
# GPU blocks take at most this many bytes of y per block (float32, K coordinates), so that the
# distance kernels' own copies of a block (the wgmma path's prepared b, 8 bytes per coordinate;
# k-major copies) stay small when few rows see all of y, as the uncertified rows of the
# tensor-core path do (one block of all 10^6 points at K = 128 prepared 1 GB).
GPU_BLOCK_Y_BYTES = 8 << 20
# Elements (rows x k x K over the batch) of one gathered block in the backward.
BACKWARD_BLOCK_ELEMENTS = 1 << 22

_CDIST_PRESETS = {PRESETS["l1"]: 1.0, PRESETS["l2"]: 2.0}


def _check_k(k, N: int) -> int:
    k = check_int("k", k)
    if N == 0 and k >= 1:
        raise ValueError(f"y: has no rows (N = 0): there are no points to select the k = {k} best of")
    if not 1 <= k <= N:
        raise ValueError(f"k: expected 1 <= k <= {N} (the points of y), got {k}")
    return k


def _check_largest(largest, default: bool) -> bool:
    if largest is None:
        return default
    if not isinstance(largest, bool):
        raise TypeError(f"largest: expected a bool or None, got {type(largest).__name__}")
    return largest


def prepare_topk(descriptor, x, y, k, *, largest=None, p=None, inner_p=None, outer_p=None, bandwidth=None,
                 regularization=None, regularization_offset_x=0, regularization_offset_y=0,
                 epsilon=None, params=None, data_checked=False) -> TopkCall:
    """Validate a kernel_topk call; TypeError/ValueError naming the argument (``params``: a formula
    kernel's own hyper-parameters; ``data_checked``: ops.distance.prepare_call's)."""
    dc = prepare_call(descriptor, x, y, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                      regularization=regularization, regularization_offset_x=regularization_offset_x,
                      regularization_offset_y=regularization_offset_y, epsilon=epsilon, names=("x", "y"), params=params,
                      data_checked=data_checked)
    k = _check_k(k, dc.N)
    distance = values_are_distances(descriptor)
    return TopkCall(descriptor, x, y, dc.hypers, dc.reg_diag, dc.epsilon, dc.batch, dc.M, dc.N, dc.K, k,
                    _check_largest(largest, not distance), distance)


def prepare_knn(x, y, k, *, p=2.0, largest=False, compute_mode=COMPUTE_MODES[0]) -> TopkCall:
    """Validate a knn call (torch.cdist's p: any p >= 0 and inf)."""
    check_data(x, y, ("x", "y"))
    p = check_scalar_or_tensor("p", p, x.device, nonnegative=True, allow_inf=True)
    if isinstance(p, torch.Tensor):
        raise TypeError("p: knn takes a real number (use kernel_topk for per-batch p)")
    if compute_mode not in COMPUTE_MODES:
        raise ValueError(f"compute_mode: {compute_mode!r} is not one of {COMPUTE_MODES}")
    largest = _check_largest(largest, False)
    if p == 0 or math.isinf(p):
        batch = broadcast_batch_shape({"x": tuple(x.shape[:-2]), "y": tuple(y.shape[:-2])})
        k = _check_k(k, y.shape[-2])
        hypers = dict(inner_p=None, outer_p=None, bandwidth=None, regularization=None)
        return TopkCall(None, x, y, hypers, 0, None, batch, x.shape[-2], y.shape[-2], x.shape[-1], k, largest, True,
                        p, compute_mode)
    desc = PRESETS["l1"] if p == 1 else PRESETS["l2"] if p == 2 else PRESETS["p_norm"]
    call = prepare_topk(desc, x, y, k, largest=largest, p=None if p in (1.0, 2.0) else p, data_checked=True)
    return replace(call, p=p, compute_mode=compute_mode)


def _check_out(call: TopkCall, out) -> tuple:
    """(values, indices) of a user-provided ``out`` pair, after every check."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a pair (values, indices) of tensors, got {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    values, indices = out
    analyse_output("out[0]", values, call.out_shape, call.dtype, call.device)
    analyse_output("out[1]", indices, call.out_shape, torch.int64, call.device)
    if values.untyped_storage().data_ptr() == indices.untyped_storage().data_ptr():
        raise ValueError("out: values and indices share memory")
    return values, indices


# -- the exact merge --------------------------------------------------------------------------
def merge_order(values: Tensor, valid: Tensor | None, k: int, largest: bool) -> Tensor:
    """Positions (R, min(k, C)) of the k best of each row's candidates under the order
    (value, index).

    ``values`` ``(R, C)``: candidates laid out so that equal values appear in increasing index
    order along the row (e.g. several lists, each sorted by (value, index), concatenated in
    increasing index ranges, or block columns in order); ``valid`` marks real candidates (None:
    all). Two stable sorts: by value (torch.sort's NaN order, the same as torch.topk's), then
    real candidates before padding."""
    order = torch.sort(values, dim=1, descending=largest, stable=True).indices
    if valid is not None:
        flag = (~valid).gather(1, order).to(torch.uint8)
        order = order.gather(1, torch.sort(flag, dim=1, stable=True).indices)
    return order[:, :k]


def merge_candidates(values: Tensor, indices: Tensor, valid: Tensor | None, k: int, largest: bool) -> tuple:
    """(values, indices) of the k best candidates of each row (:func:`merge_order`)."""
    order = merge_order(values, valid, k, largest)
    return values.gather(1, order), indices.gather(1, order)


def _threshold(tv: Tensor, largest: bool) -> tuple:
    """(t, t_is_nan) of a row's kk best values ``tv`` (any order): t the worst of them, NaN
    ranking above +inf (a NaN t with largest=True only when tv is all NaN)."""
    tnan = tv.isnan()
    if largest:
        t_is_nan = tnan.all(1, keepdim=True)
        t = torch.where(tnan, torch.full_like(tv, math.inf), tv).amin(1, keepdim=True)
    else:
        t_is_nan = tnan.any(1, keepdim=True)
        t = torch.where(tnan, torch.full_like(tv, -math.inf), tv).amax(1, keepdim=True)
    return t, t_is_nan


def _mask_candidates(v: Tensor, kk: int, largest: bool) -> tuple:
    """_block_candidates for rows with ties at their kk-th value: every value strictly better
    than it, and of the values equal to it (all NaNs when it is NaN) the first kk by column."""
    t, t_is_nan = _threshold(torch.topk(v, kk, dim=1, largest=largest, sorted=False).values, largest)
    nan = v.isnan()
    if largest:
        better = ~t_is_nan & (nan | (v > t))
    else:
        better = torch.where(t_is_nan, ~nan, v < t)
    eq = torch.where(t_is_nan, nan, v == t)
    mask = better | (eq & (eq.to(torch.int32).cumsum(1) <= kk))
    counts = mask.sum(1)
    width = int(counts.max()) if counts.numel() else 0
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: columns in increasing order per row
    starts = counts.cumsum(0) - counts
    pos = torch.arange(rows.numel(), device=v.device) - starts[rows]
    out_cols = torch.zeros((v.shape[0], width), dtype=torch.int64, device=v.device)
    valid = torch.zeros((v.shape[0], width), dtype=torch.bool, device=v.device)
    out_cols[rows, pos] = cols
    valid[rows, pos] = True
    return out_cols, valid


def _block_candidates(v: Tensor, kk: int, largest: bool) -> tuple:
    """Columns of a block ``v`` (R, nb) that can be among each row's kk best, in increasing
    column order: ``(cols (R, C), valid (R, C) or None)``, kk <= C <= 2 kk. One torch.topk of
    kk + 1: its first kk columns are the answer unless the (kk + 1)-th value ties with the kk-th
    t (torch.topk does not break ties by index) or t is NaN; such rows take
    :func:`_mask_candidates`."""
    R, nb = v.shape
    if kk >= nb:  # every column
        return torch.arange(nb, device=v.device).expand(R, nb), None
    tv, ti = torch.topk(v, kk + 1, dim=1, largest=largest, sorted=True)
    t, nxt = tv[:, kk - 1], tv[:, kk]
    ok = (nxt < t) if largest else ((nxt > t) | nxt.isnan())
    ok &= ~t.isnan()
    cols = ti[:, :kk].sort(1).values
    if bool(ok.all()):
        return cols, None
    bad = (~ok).nonzero()[:, 0]
    bcols, bvalid = _mask_candidates(v[bad], kk, largest)
    width = max(kk, bcols.shape[1])
    out = torch.zeros((R, width), dtype=torch.int64, device=v.device)
    valid = torch.zeros((R, width), dtype=torch.bool, device=v.device)
    out[:, :kk] = cols
    valid[:, :kk] = True
    out[bad] = torch.nn.functional.pad(bcols, (0, width - bcols.shape[1]))
    valid[bad] = torch.nn.functional.pad(bvalid, (0, width - bvalid.shape[1]))
    return out, valid


# -- the blocked path ---------------------------------------------------------------------------
def _work_dtype(call: TopkCall) -> torch.dtype:
    """CPU: float64, so that the selection is the float64 one; GPU: x's dtype (float32 for 16-bit)."""
    if call.device.type == "cpu":
        return torch.float64
    return torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype


def _resolved_mode(call: TopkCall) -> str:
    """torch.cdist's rule for the whole problem (blocks are smaller than it)."""
    if call.compute_mode == COMPUTE_MODES[0]:
        return COMPUTE_MODES[1] if call.M > 25 or call.N > 25 else COMPUTE_MODES[2]
    return call.compute_mode


def _hyper_to(h, dtype):
    return h.to(dtype) if isinstance(h, torch.Tensor) else h


def _torch_blocks(call: TopkCall) -> bool:
    """Whether blocks are computed by torch itself (CPU) rather than by the package's ops (GPU)."""
    return call.device.type == "cpu"


def _block_values(call: TopkCall, xb: Tensor, yb: Tensor, m0: int, n0: int, work: torch.dtype) -> Tensor:
    """Kernel values of rows [m0, m0 + mb) and columns [n0, n0 + nb): (*batch, mb, nb) in ``work``."""
    xw, yw = xb.to(work), yb.to(work)
    if call.p is not None:  # knn: torch.cdist's distances
        if _torch_blocks(call):
            return torch.cdist(xw, yw, p=call.p, compute_mode=_resolved_mode(call))
        return cdist(xw, yw, p=call.p, compute_mode=_resolved_mode(call))
    hyp = {name: _hyper_to(h, work) for name, h in call.hypers.items()}
    if not call.desc.fused_ok:  # a formula kernel: its torch path's values, direct differences
        with torch.no_grad():
            return formula_path.values(call.desc, xw, yw, hyp, diag=call.reg_diag - n0 + m0, epsilon=call.epsilon,
                                       compute_mode=COMPUTE_MODES[2])
    if _torch_blocks(call):
        cp = _CDIST_PRESETS.get(call.desc)
        if cp is not None and hyp["regularization"] is None and call.epsilon is None:
            return torch.cdist(xw, yw, p=cp, compute_mode=COMPUTE_MODES[2])  # direct differences
        return distance_reference(call.desc, xw, yw, reg_diag=call.reg_diag - n0 + m0, epsilon=call.epsilon, **hyp)
    # Direct differences (as the fused kernels and the reference form them): a block's values do
    # not depend on the block's size, as torch.cdist's matrix-product rule would make them.
    return run_kernel(call.desc, xw, yw, regularization_offset_x=m0 + call.reg_diag, regularization_offset_y=n0,
                      epsilon=call.epsilon, compute_mode=COMPUTE_MODES[2], **hyp)


def _rescores(call: TopkCall) -> bool:
    """Whether the blocked path's selection is rescored by direct differences: knn p = 2 on a
    GPU where torch.cdist's rule takes the matrix product (the package's tensor-core cdist,
    shifted by a reference point: float32-grade relative to the data's centred scale, but not
    relative to a near neighbour's small distance, nor 0 at a duplicate)."""
    return call.p == 2 and not _torch_blocks(call) and _resolved_mode(call) == COMPUTE_MODES[1]


RESCORE_ELEMENTS = 1 << 24  # gathered float64 coordinates of one rescoring chunk


def _rescored(x: Tensor, y: Tensor, v: Tensor, i: Tensor, k: int, largest: bool) -> tuple:
    """(values, indices) of the selected ``i`` (B, m, k) of rows ``x`` (B, m, K) among ``y``
    (B, N, K), their distances recomputed by direct differences in float64 (rounded once to
    float32: an exact duplicate gives 0) and put back in the (value, index) order. Where the
    matrix product gave NaN or inf (an infinite coordinate: inf - inf), its value stays, as in
    torch.cdist's matrix-product path."""
    B, m, K = x.shape
    exact = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    rows = max(1, RESCORE_ELEMENTS // max(1, k * K))
    for b in range(B):
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            g = y[b][i[b, r0:r1]].double()  # (rows, k, K)
            g.sub_(x[b, r0:r1, None, :].double())
            exact[b, r0:r1] = g.square_().sum(-1).sqrt_()
    exact = torch.where(torch.isfinite(v), exact.to(v.dtype), v).reshape(B * m, k)
    i = i.reshape(B * m, k)
    by_index = torch.sort(i, dim=1).indices
    exact, i = exact.gather(1, by_index), i.gather(1, by_index)
    order = merge_order(exact, None, k, largest)
    return exact.gather(1, order).view(B, m, k), i.gather(1, order).view(B, m, k)


def _nan_rows_as_torch(call: TopkCall, xb: Tensor, run_v: Tensor, run_i: Tensor) -> None:
    """Rows of a NaN query point (a NaN coordinate in ``xb`` (R, K); every value of the row is
    then NaN, except under p = inf, where torch.cdist's maximum skips NaN) get torch.topk's
    indices of an all-NaN row of N values, in place of the index order: torch.topk breaks
    such ties in an order of its own, which depends on N, k and largest only."""
    if call.p is not None and math.isinf(call.p):
        return
    rows = xb.isnan().any(1) & run_v.isnan().all(1)
    if not bool(rows.any()):
        return
    nan_row = torch.full((call.N,), math.nan, dtype=torch.float32, device=run_v.device)
    run_i[rows] = torch.topk(nan_row, call.k, largest=call.largest, sorted=True).indices


def topk_blocked(call: TopkCall, values: Tensor, indices: Tensor, *, block_elements: int | None = None,
                 debug: bool = False) -> tuple:
    """The top-k of a validated call by blocks: writes ``values`` and ``indices`` (checked by the
    caller). Memory beyond inputs and outputs: one block of at most ``block_elements`` values
    (BLOCK_ELEMENTS_CPU / _GPU by device) with its masks, each row block's running top-k, and
    the block's rows of x and y in the work dtype (float64 on a CPU; on a GPU at most
    GPU_BLOCK_Y_BYTES of y per block, so that the distance kernels' copies of it stay small)."""
    work = _work_dtype(call)
    budget = block_elements or (BLOCK_ELEMENTS_GPU if call.device.type == "cuda" else BLOCK_ELEMENTS_CPU)
    B = math.prod(call.batch) if call.batch else 1
    M, N, K, k = call.M, call.N, call.K, call.k
    columns = budget // max(1, B * M)
    if call.device.type == "cuda":
        columns = min(columns, GPU_BLOCK_Y_BYTES // (4 * max(1, K)))
    nb = min(N, max(k, MIN_BLOCK_COLUMNS, columns))
    mb = max(1, min(M, budget // max(1, B * nb)))
    x = call.x.expand(*call.batch, M, K)
    y = call.y.expand(*call.batch, N, K)
    rescore = _rescores(call)
    if debug:
        log.debug("topk k=%d largest=%s %s: blocked path on %s (%s), blocks of %d rows x %d columns, batch %s",
                  k, call.largest, call.desc if call.p is None else f"p={call.p:g}", call.device, work, mb, nb,
                  call.batch)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        R = B * (m1 - m0)
        run_v = torch.empty((R, 0), dtype=work, device=call.device)
        run_i = torch.empty((R, 0), dtype=torch.int64, device=call.device)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            v = _block_values(call, x[..., m0:m1, :], y[..., n0:n1, :], m0, n0, work).reshape(R, n1 - n0)
            cols, valid = _block_candidates(v, min(k, n1 - n0), call.largest)
            cand_v = v.gather(1, cols)
            del v
            if run_v.shape[1] > 0:  # the running top-k first: its indices are the smaller ones
                if valid is not None:
                    valid = torch.cat([torch.ones_like(run_i, dtype=torch.bool), valid], 1)
                cand_v, cols = torch.cat([run_v, cand_v], 1), torch.cat([run_i, cols + n0], 1)
            else:
                cols = cols + n0
            run_v, run_i = merge_candidates(cand_v, cols, valid, k, call.largest)
        if rescore:
            run_v, run_i = _rescored(x[..., m0:m1, :].reshape(B, m1 - m0, K), y.reshape(B, N, K),
                                     run_v.view(B, m1 - m0, k), run_i.view(B, m1 - m0, k), k, call.largest)
        if _torch_blocks(call):
            _nan_rows_as_torch(call, x[..., m0:m1, :].reshape(R, K), run_v, run_i)
        values[..., m0:m1, :] = run_v.view(*call.batch, m1 - m0, k)
        indices[..., m0:m1, :] = run_i.view(*call.batch, m1 - m0, k)
    return values, indices


def _run_on_rows(sub: TopkCall, rows: Tensor, values: Tensor, indices: Tensor, run):
    """``run(sub, v, i)`` for ``sub``, the call on rows ``rows`` of x, into fresh (len(rows), k) values
    and indices, then scattered into the whole call's ``values`` and ``indices``; returns run's result."""
    v = torch.empty((sub.M, sub.k), dtype=values.dtype, device=values.device)
    i = torch.empty((sub.M, sub.k), dtype=torch.int64, device=values.device)
    out = run(sub, v, i)
    values[rows] = v
    indices[rows] = i
    return out


def recompute_rows(call: TopkCall, values: Tensor, indices: Tensor, rows: Tensor, debug: bool = False) -> None:
    """Rows ``rows`` (int64 indices) of ``values`` and ``indices`` (``(M, k)``) computed anew: the rows
    the tensor-core candidates left uncertified (plan.topk's "topk_mma" plan), by the exact SIMT
    selection (float32 direct differences, as the rescoring's) where K fits its registers, else by
    the blocked path. One host synchronisation (the number of rows)."""
    if not rows.numel():
        return
    sub = replace(call, x=call.x[rows], M=int(rows.numel()))

    def exact(sub, v, i):
        simt = plan_topk(sub, v, i, debug, fallback=True)
        if simt is None:
            topk_blocked(sub, v, i, debug=debug)
            return False
        simt.run()
        return True

    simt = _run_on_rows(sub, rows, values, indices, exact)
    if debug:
        log.debug("topk: %d of %d rows recomputed by the %s", sub.M, call.M,
                  "SIMT selection" if simt else "blocked path")


# -- clustered data: the tensor-core candidates about a centre per group of rows -----------------
# About one reference point for all the data, the TF32 bound of a row scales with the data's
# spread, not with the gaps between a cluster's points: on clustered data (blobs, mixtures) most
# rows fail the certificate. Shifted by the centre of their own cluster, the rows' and their
# neighbours' norms are the cluster's scale and the certificate's window leaves the other
# clusters out, so the rows certify as on centred data; y is copied once per group.
GROUP_SHARE = 0.2  # auto: groups where the call about the data's reference point leaves more of its rows
# uncertified ...
GROUP_RATIO = 0.25  # ... and the rows' squared distances to their group's centre are below this share of
# their squared distances to the reference point (medians over a sample: the groups resolve clusters)
GROUP_ANCHORS = 16  # anchors by farthest-point traversal of a sample of the rows
GROUP_SAMPLE = 4096  # rows of that sample
GROUP_MIN_ROWS = 8192  # auto groups calls of at least this many rows


def sample_groups(x: Tensor, s: Tensor, count: int = GROUP_ANCHORS) -> tuple:
    """Anchors for knn's groups, and whether they resolve clusters, from a strided sample of
    GROUP_SAMPLE rows of x (M, K) about the reference point s, on the device (no host
    synchronisation): (indices of ``count`` rows of x (int64), ratio (a 0-dim tensor)). The anchors: a
    farthest-point traversal (the first finite sample row, then each time the row farthest from the
    anchors so far; rows with a non-finite coordinate never), so that well-separated clusters each
    get one among the first. ratio: the median of the sample rows' squared distances to their
    group's centre (:func:`row_groups` on the sample) over the median of their squared distances to s."""
    step = max(1, -(-x.shape[0] // GROUP_SAMPLE))
    rows = torch.arange(0, x.shape[0], step, device=x.device)
    sample = x[rows]
    xs = sample.float() - s
    finite = torch.isfinite(xs).all(1)
    xs = xs.masked_fill(~finite[:, None], 0.0)
    picks = [finite.to(torch.int8).argmax().view(1)]  # (1,) int64 on the device: index_select, no host read
    dmin = None
    for _ in range(1, min(count, xs.shape[0])):
        d = (xs - xs.index_select(0, picks[-1])).square_().sum(1)
        dmin = d if dmin is None else torch.minimum(dmin, d)
        picks.append(dmin.masked_fill(~finite, -1.0).argmax().view(1))
    picks = torch.cat(picks)
    group, centres = row_groups(sample, s, sample.index_select(0, picks))
    near = (xs - (centres - s)[group]).square_().sum(1)[finite].median()
    far = xs.square().sum(1)[finite].median()
    return rows[picks], near / far.clamp_min(torch.finfo(torch.float32).tiny)


def row_groups(x: Tensor, s: Tensor, points: Tensor) -> tuple:
    """The rows of x (M, K) in groups about ``points`` (G, K) (each row to its nearest;
    :func:`sample_groups` chooses them) and each group's centre, the mean of its finite rows in x's
    coordinates: (group (M,) int64, centres (G, K) float32). No host synchronisation."""
    xs = x.float() - s
    finite = torch.isfinite(xs).all(1, keepdim=True)
    xs = torch.where(finite, xs, 0.0)
    group = torch.cdist(xs, points.float() - s).argmin(1)
    G = points.shape[0]
    sums = xs.new_zeros(G, xs.shape[1]).index_add_(0, group, xs)
    n = xs.new_zeros(G).index_add_(0, group, finite.squeeze(1).float())
    return group, sums / n.clamp_min(1.0)[:, None] + s


def _grouped(call: TopkCall, group: Tensor, centres: Tensor, values: Tensor, indices: Tensor, debug: bool) -> Tensor:
    """The tensor-core candidates of every row about its group's centre (:func:`row_groups`): one
    plan per group with the centre as its reference point, enqueued one after the other (no host
    read between them). Returns the mask (M,) of the rows left uncertified. One host
    synchronisation (the groups' sizes)."""
    order = torch.argsort(group)
    counts = torch.bincount(group, minlength=centres.shape[0]).tolist()
    bad = torch.zeros(call.M, dtype=torch.bool, device=call.device)
    o = 0
    for g, c in enumerate(counts):
        if not c:
            continue
        rows = order[o:o + c]
        o += c
        sub = replace(call, x=call.x[rows], M=c, reference=centres[g])
        bad[rows] = _run_on_rows(sub, rows, values, indices, lambda sub, v, i: plan_topk(sub, v, i, debug).run())
    if debug:
        log.debug("topk: %d rows in %d groups about their centres", call.M, sum(1 for c in counts if c))
    return bad


def _mma_rows(call: TopkCall, plan, values: Tensor, indices: Tensor, debug: bool) -> Tensor:
    """The tensor-core plan's run about the data's reference point, then (the setting knn_groups)
    its uncertified rows again in groups about centres near them. auto, for calls of at least
    GROUP_MIN_ROWS rows: where more than GROUP_SHARE of the rows are left uncertified and, on a sample,
    the groups bring the rows nearer their centre than GROUP_RATIO (squared, medians) of their
    distance to the reference point (clusters: not ties, which no shift removes); on: the uncertified
    rows always. Calls whose rows certify pay nothing. Returns the rows left uncertified (int64 on
    the device; one host synchronisation, which their recomputation needs anyway)."""
    bad = plan.run()
    mode = config.get("knn_groups")
    distances = call.desc.inner_operator == InnerOperator.DIFF and not call.largest
    rows = bad.nonzero().squeeze(1)  # one host synchronisation
    if (mode == "off" or not distances or (mode == "auto" and call.M < GROUP_MIN_ROWS) or not rows.numel()
            or (mode == "auto" and rows.numel() <= GROUP_SHARE * call.M)):
        return rows
    s = pair_reference(call.x, call.y)
    sub = replace(call, x=call.x[rows], M=int(rows.numel()))
    anchors, ratio = sample_groups(sub.x, s)
    if mode == "auto":
        ratio = float(ratio)  # one more, where many rows failed
        if debug:
            log.debug("topk: %d of %d rows uncertified; rows to their group's centre %.3g of the reference "
                      "point's distance (squared, medians of a sample)", rows.numel(), call.M, ratio)
        if not ratio < GROUP_RATIO:
            return rows
    group, centres = row_groups(sub.x, s, sub.x[anchors])
    still = _run_on_rows(sub, rows, values, indices, lambda sub, v, i: _grouped(sub, group, centres, v, i, debug))
    return rows[still]  # one more host synchronisation


def topk_forward(call: TopkCall, out=None, *, debug: bool = False) -> tuple:
    """Compute a validated call without autograd; ``out`` (values, indices) checked by the
    caller, or None. The fused plan gets contiguous values/indices (``out``'s own tensors when
    they are contiguous, else temporaries copied into them)."""
    if out is None:
        values = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
        indices = torch.empty(call.out_shape, dtype=torch.int64, device=call.device)
    else:
        values, indices = out
    with torch.no_grad():  # the op's implementation: its backward is registered, nothing to record
        return _topk_forward(call, values, indices, debug)


def _topk_forward(call: TopkCall, values: Tensor, indices: Tensor, debug: bool) -> tuple:
    plan = None
    if call.desc is not None and call.K > 0:
        v = values if values.is_contiguous() else torch.empty_like(values, memory_format=torch.contiguous_format)
        i = indices if indices.is_contiguous() else torch.empty_like(indices, memory_format=torch.contiguous_format)
        plan = plan_topk(call, v, i, debug)
        if plan is not None:
            if plan.family == "topk_mma":  # the tensor-core candidates: the rows they left uncertified
                recompute_rows(call, v, i, _mma_rows(call, plan, v, i, debug), debug)
            else:
                plan.run()
            if v is not values:
                values.copy_(v)
            if i is not indices:
                indices.copy_(i)
    if plan is None:
        topk_blocked(call, values, indices, debug=debug)
    return values, indices


# -- autograd -----------------------------------------------------------------------------------
def _inf_norm_backward(a: Tensor, b: Tensor, g: Tensor) -> tuple:
    """torch.cdist's p = inf backward for pairs a (..., 1, K), b (..., k, K), g (..., 1, k):
    grad sgn(a - b) on the coordinates where |a - b| reaches the maximum."""
    diff = a - b
    mag = diff.abs()
    w = g.mT * torch.sign(diff) * (mag == mag.amax(-1, keepdim=True))
    return w.sum(-2, keepdim=True), -w


def topk_backward_pairs(call: TopkCall, indices: Tensor, grad: Tensor, needs: tuple, debug: bool = False) -> tuple:
    """dL/dx and dL/dy of L(values) with values[..., m, j] = kernel(x_m, y_{indices[m, j]}):
    the selected pairs recomputed from gathered rows of y (row blocks of at most
    BACKWARD_BLOCK_ELEMENTS) and differentiated by run_kernel's backward
    (ops/distance_backward.py: weight 0 at zero distance, like cdist); p = 0 has zero
    gradients and p = inf torch.cdist's. Never M x N; memory O((M + N) K) plus one block."""
    batch, M, N, K, k = call.batch, call.M, call.N, call.K, call.k
    B = math.prod(batch) if batch else 1
    x = call.x.expand(*batch, M, K)
    y = call.y.expand(*batch, N, K)
    gx = torch.zeros((*batch, M, K), dtype=call.dtype, device=call.device) if needs[0] else None
    gy = torch.zeros((*batch, N, K), dtype=call.dtype, device=call.device) if needs[1] else None
    if call.p == 0 or not any(needs):
        return (None if gx is None else gx.sum_to_size(call.x.shape),
                None if gy is None else gy.sum_to_size(call.y.shape))
    # Hyper-parameter tensors over the batch gain a trailing mode for the rows (the pairs'
    # batch is (*batch, M)); the regularisation is a constant and drops out.
    hyp = {name: (h.reshape(*h.shape, 1) if isinstance(h, torch.Tensor) else h) for name, h in call.hypers.items()}
    hyp["regularization"] = None
    mb = max(1, min(M, BACKWARD_BLOCK_ELEMENTS // max(1, B * k * max(K, 1))))
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        idx = indices[..., m0:m1, :]  # (*batch, mb, k)
        a = x[..., m0:m1, :].unsqueeze(-2)  # (*batch, mb, 1, K)
        yv = y.unsqueeze(-3).expand(*batch, m1 - m0, N, K)
        b = torch.gather(yv, -2, idx.unsqueeze(-1).expand(*batch, m1 - m0, k, K))  # (*batch, mb, k, K)
        g = grad[..., m0:m1, :].unsqueeze(-2)  # (*batch, mb, 1, k)
        if call.p is not None and math.isinf(call.p):
            ga, gb = _inf_norm_backward(a, b, g)
        else:
            pairs = DistanceCall.of(call.desc, a, b, hyp, 0, call.epsilon)
            d = None
            if call.desc.kernel_type is KernelType.NONE and call.epsilon is None:
                d = run_kernel(call.desc, a, b, inner_p=hyp["inner_p"], outer_p=hyp["outer_p"],
                               compute_mode=COMPUTE_MODES[2], debug=debug)
            ga, gb = distance_backward._distance_backward(pairs, a, b, d, g, needs, COMPUTE_MODES[2], debug)
        if gx is not None:
            gx[..., m0:m1, :] += ga.sum_to_size(a.shape).squeeze(-2)
        if gy is not None:
            gb = gb.sum_to_size(b.shape).reshape(*batch, (m1 - m0) * k, K)
            gy.scatter_add_(-2, idx.reshape(*batch, (m1 - m0) * k, 1).expand(*batch, (m1 - m0) * k, K), gb)
    return (None if gx is None else gx.sum_to_size(call.x.shape),
            None if gy is None else gy.sum_to_size(call.y.shape))


# -- the ops: kermac_like::kernel_topk and kermac_like::kernel_topk_out --------------------------
def _call_of(x, y, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
             regularization, regularization_tensor, reg_diag, epsilon, k, largest, p, compute_mode) -> TopkCall:
    """The call of the op's arguments (checked once by kernel_topk or knn; the backward's alike)."""
    hypers = join_hypers(inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                         regularization, regularization_tensor)
    return TopkCall.of(descriptor_from_ints(descriptor) if descriptor else None, x, y, k, largest, hypers, reg_diag,
                       epsilon, p, compute_mode)


def _topk_impl(x: Tensor, y: Tensor, descriptor: list[int], inner_p: Optional[float], inner_p_tensor: Optional[Tensor],
             outer_p: Optional[float], outer_p_tensor: Optional[Tensor], bandwidth: Optional[float],
             bandwidth_tensor: Optional[Tensor], regularization: Optional[float],
             regularization_tensor: Optional[Tensor], reg_diag: int, epsilon: Optional[float], k: int, largest: bool,
             p: Optional[float], compute_mode: str, debug: bool) -> tuple[Tensor, Tensor]:
    call = _call_of(x, y, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                    regularization, regularization_tensor, reg_diag, epsilon, k, largest, p, compute_mode)
    return topk_forward(call, None, debug=debug)


_topk_op = torch.library.custom_op("kermac_like::kernel_topk", _topk_impl, mutates_args=())


@torch.library.custom_op("kermac_like::kernel_topk_out", mutates_args=("values", "indices"))
def _topk_out_op(x: Tensor, y: Tensor, descriptor: list[int], inner_p: Optional[float],
                 inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
                 bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], regularization: Optional[float],
                 regularization_tensor: Optional[Tensor], reg_diag: int, epsilon: Optional[float], k: int,
                 largest: bool, p: Optional[float], compute_mode: str, debug: bool, values: Tensor,
                 indices: Tensor) -> None:
    call = _call_of(x, y, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                    regularization, regularization_tensor, reg_diag, epsilon, k, largest, p, compute_mode)
    topk_forward(call, (values, indices), debug=debug)


@_topk_op.register_fake
def _topk_fake(x, y, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
               regularization, regularization_tensor, reg_diag, epsilon, k, largest, p, compute_mode, debug):
    hypers = (inner_p_tensor, outer_p_tensor, bandwidth_tensor, regularization_tensor)
    batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2], *(t.shape for t in hypers if t is not None))
    shape = (*batch, x.shape[-2], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


@_topk_out_op.register_fake
def _topk_out_fake(*args):
    return None


# The op's inputs, in schema order (above): x, y, descriptor, inner_p, inner_p_tensor, outer_p,
# outer_p_tensor, bandwidth, bandwidth_tensor, regularization, regularization_tensor, reg_diag,
# epsilon, k, largest, p, compute_mode, debug
_N_INPUTS = 18


def _setup_context(ctx, inputs, output):
    (x, y, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon, k, largest, p, compute_mode,
     debug) = inputs
    ctx.save_for_backward(x, y, output[1], ipt, opt, bwt, rgt)
    ctx.args = (tuple(descriptor), ip, op, bw, rg, reg_diag, epsilon, k, largest, p, compute_mode, debug)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_values, grad_indices):
    if torch.is_grad_enabled():
        raise NotImplementedError("kermac_like: double backward through kernel_topk/knn is not supported")
    x, y, indices, ipt, opt, bwt, rgt = ctx.saved_tensors
    descriptor, ip, op, bw, rg, reg_diag, epsilon, k, largest, p, compute_mode, debug = ctx.args
    call = _call_of(x, y, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon, k, largest, p,
                    compute_mode)
    gx, gy = topk_backward_pairs(call, indices, grad_values, ctx.needs_input_grad[:2], debug)
    return (gx, gy) + (None,) * (_N_INPUTS - 2)


_TOPK_GRAD = register_autograd(_topk_op, _topk_impl, _backward, _setup_context)
_TOPK = torch.ops.kermac_like.kernel_topk.default
_TOPK_OUT = torch.ops.kermac_like.kernel_topk_out.default


def _op_args(call: TopkCall) -> tuple:
    """The op's arguments of a validated call, up to debug."""
    hp = call.hypers
    desc = [] if call.desc is None else descriptor_ints(call.desc)
    return (call.x, call.y, desc, *split_hyper(hp["inner_p"]), *split_hyper(hp["outer_p"]),
            *split_hyper(hp["bandwidth"]), *split_hyper(hp["regularization"]), call.reg_diag, call.epsilon, call.k,
            call.largest, call.p, call.compute_mode)


def _formula_pairs(call: TopkCall, indices: Tensor) -> Tensor:
    """The values of the selected pairs of a formula kernel recomputed by its torch formulas
    (differentiable with respect to x, y and the tensor hyper-parameters): y's rows gathered,
    memory O(M k K)."""
    batch, M, N, K, k = call.batch, call.M, call.N, call.K, call.k
    work = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
    x = call.x.to(work).expand(*batch, M, K)
    y = call.y.to(work).expand(*batch, N, K)
    b = torch.gather(y.unsqueeze(-3).expand(*batch, M, N, K), -2, indices.unsqueeze(-1).expand(*batch, M, k, K))
    hyp = {name: (h.to(work).reshape(*h.shape, 1) if isinstance(h, torch.Tensor) else h)
           for name, h in call.hypers.items()}
    v = formula_path.values(call.desc, x.unsqueeze(-2), b, hyp, epsilon=call.epsilon,
                            compute_mode=COMPUTE_MODES[2]).squeeze(-2)  # (*batch, M, k)
    lam = hyp["regularization"]
    if lam is not None:  # the pairs on the regularised diagonal
        on = (indices - torch.arange(M, device=indices.device).unsqueeze(-1)) == call.reg_diag
        v = v + on.to(v.dtype) * (lam.reshape(*lam.shape, 1) if isinstance(lam, Tensor) else lam)
    return v.to(call.dtype)


def _run(call: TopkCall, out, debug: bool) -> tuple:
    if out is not None:
        out = _check_out(call, out)
    hyper_tensors = [h for h in call.hypers.values() if isinstance(h, torch.Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (call.x, call.y, *hyper_tensors))
    if call.desc is not None and not call.desc.fused_ok:
        # A formula kernel: the blocked selection of its torch path's values (no op schema carries it);
        # under autograd the selected pairs' values recomputed differentiably.
        v, i = topk_forward(call, None, debug=debug)
        if grad:
            v = _formula_pairs(call, i)
        return (v, i) if out is None else (out[0].copy_(v), out[1].copy_(i))
    if grad:
        check_no_hyper_grad(call.hypers, "kernel_topk")
    elif direct_call(call.x, call.y, *(out or ()), *hyper_tensors):
        return topk_forward(call, out, debug=debug)  # the op's implementation, without the dispatcher
    args = _op_args(call)
    if grad:  # (an eager call without the dispatcher, as above: ops/_library.py)
        v, i = _TOPK_GRAD(call.x, call.y, *(out or ()), *hyper_tensors)(*args, debug)
        # out= variants carry no autograd: compute, then copy into out (values join the graph)
        return (v, i) if out is None else (out[0].copy_(v), out[1].copy_(i))
    if out is None:
        return tuple(_TOPK(*args, debug))
    _TOPK_OUT(*args, debug, *out)
    return out[0], out[1]


# -- public API ----------------------------------------------------------------------------
def kernel_topk(descriptor: KernelDescriptor, x: torch.Tensor, y: torch.Tensor, k: int, *, largest=None, out=None,
                p=None, inner_p=None, outer_p=None, bandwidth=None, regularization=None,
                regularization_offset_x: int = 0, regularization_offset_y: int = 0, epsilon=None,
                debug: bool = False, **params) -> tuple:
    """The k best entries of each row of ``run_kernel(descriptor, x, y, ...)`` and their
    column indices, without the M x N matrix: ``(values, indices)``, both ``(..., M, k)``,
    values in x's dtype, indices int64 (rows of y).

    ``largest``: None picks False for distances (DIFF descriptors without epilogue: the
    nearest points) and True for LAPLACE/GAUSSIAN kernels and DOT similarities. Hyper-parameters,
    regularisation and broadcasting of batch modes (and of tensor hyper-parameters) as in
    run_kernel. The result equals ``torch.topk`` of run_kernel computed in float64 from the
    given inputs, ``sorted=True``, with ties in a fixed order: (value, index) lexicographically,
    the smaller index first among equal values; NaN ranks above every number as in torch.topk
    (first with largest=True, last with largest=False), and on the CPU path a query row with a
    NaN coordinate gets torch.topk's own indices of its all-NaN row. On a CPU the blocked path
    computes the values in float64 and selects exactly; on a GPU the fused kernel computes them
    in float32 (16-bit inputs too), so pairs whose values differ by float32 rounding may be
    selected differently. The values returned are the selected values rounded to x's dtype.

    ``out=(values, indices)`` (any strides run_kernel's out takes) is written in place and
    returned; it is left untouched when an argument is rejected. values differentiate with
    respect to x and y (the gradient of the formula at the selected pairs, 0 at zero distance
    as in cdist; not with respect to hyper-parameters: NotImplementedError). Underneath it is
    the custom op ``torch.ops.kermac_like.kernel_topk`` (``kernel_topk_out`` for ``out=``).
    Memory beyond inputs and outputs: O((M + N) K) and one block of the matrix
    (BLOCK_ELEMENTS_CPU / BLOCK_ELEMENTS_GPU values) on the blocked path.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    >>> y = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    >>> values, indices = km.kernel_topk(km.preset("gaussian_l2"), x, y, 1, bandwidth=1.0)
    >>> indices                      # the largest kernel value of each row: its nearest point
    tensor([[0],
            [2]])
    >>> values                       # exp(-1 / 2)
    tensor([[0.6065],
            [0.6065]])
    """
    debug = _debug.resolve(debug)
    call = prepare_topk(descriptor, x, y, k, largest=largest, p=p, inner_p=inner_p, outer_p=outer_p,
                        bandwidth=bandwidth, regularization=regularization,
                        regularization_offset_x=regularization_offset_x,
                        regularization_offset_y=regularization_offset_y, epsilon=epsilon, params=params)
    return _run(call, out, debug)


def knn(x: torch.Tensor, y: torch.Tensor, k: int, *, p: float = 2.0, largest: bool = False, out=None,
        compute_mode: str = COMPUTE_MODES[0], debug: bool = False) -> tuple:
    """The k nearest rows of y to each row of x under torch.cdist's p-norm distance (any
    p >= 0 and inf): ``(distances, indices)`` ``(..., M, k)``, nearest first, ties by the smaller
    index; ``largest=True`` gives the k farthest. ``kernel_topk`` with the l1 (p = 1), l2
    (p = 2) or p_norm preset; p = 0 and p = inf take the blocked path with torch.cdist's
    semantics. ``compute_mode`` as in torch.cdist: where it takes its matrix product (p = 2,
    "use_mm_for_euclid_dist", or the default with more than 25 rows in x or y) the distances
    are those of the product formula, NaN and inf included. x ``(..., M, D)``, y ``(..., N, D)``,
    ``1 <= k <= N``; ``out``, dtypes, autograd, memory and errors (ValueError / TypeError naming
    the argument) as in :func:`kernel_topk`.

    Order: the order of the distances computed in float64 from the given inputs (on a CPU,
    torch.cdist's formula for ``compute_mode`` evaluated in float64; on a GPU the fused kernels
    select on float32 distances, see :func:`kernel_topk`), ties by the smaller index, NaN last
    as in torch.topk; a query row with a NaN coordinate gets torch.topk's indices of its NaN
    row on the CPU path. ``torch.topk(torch.cdist(x, y), k, largest=False)`` on float32 inputs
    selects by float32 distances instead: where two distances of a row are within float32
    rounding of each other (the product formula's rounding grows with the points' norms, and
    near ties are common at small D: 2.5 rows in 10^4 at D = 2 on Gaussian data) its indices
    can differ from these, and it breaks exact ties in no stated order.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    >>> y = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    >>> distances, indices = km.knn(x, y, k=2)
    >>> indices
    tensor([[0, 1],
            [2, 0]])
    >>> distances
    tensor([[1.0000, 2.0000],
            [1.0000, 2.2361]])
    """
    debug = _debug.resolve(debug)
    call = prepare_knn(x, y, k, p=p, largest=largest, compute_mode=compute_mode)
    return _run(call, out, debug)
