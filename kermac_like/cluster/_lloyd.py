"""Lloyd's algorithm of :class:`kermac_like.cluster.KMeans` (scikit-learn's ``_kmeans_single_lloyd``):
:func:`lloyd` alternates

* the assignment, :func:`_assign`: the nearest centre of every point, the labels and values of
  ``knn(X, centres, 1)`` in its direct-difference mode (on a CPU :class:`_NearestCpu`, one matrix product
  with a certificate; on CUDA in float32 the tensor-core kernel, pruned by distance bounds after the first
  iteration; else knn);
* the update, :func:`segment_sums`: one deterministic segmented sum of the points by label (no one-hot
  matrix, no floating-point atomics), with scikit-learn's rule for empty clusters (:func:`_relocate_empty`).

On a CPU where X is one block of the update, :func:`_lloyd_cpu` runs the same iterations in fewer torch ops
(the update one ``scatter_add_`` of a feature-major float64 [x w, w] made once a run): the same labels,
centres, inertia and n_iter, bitwise.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import config
from ..ops.kmeans import assign as assign_mma
from ..ops.kmeans import bounded_assign
from ..ops.kmeans import segment_sums as fused_segment_sums
from ..ops.knn import knn

__all__ = ["lloyd", "segment_sums", "BLOCK_ROWS"]

log = logging.getLogger("kermac_like.kmeans")

# Rows of X handled at once by the update, the seeding and the variance (memory: one block in
# float64, 2^20 x D x 8 bytes).
BLOCK_ROWS = 1 << 20
# torch.cdist's direct differences on the CPU path (the fused GPU kernel forms them anyway):
# distances without the matrix-product formula's cancellation.
_DIRECT = "donot_use_mm_for_euclid_dist"


def _block_rows(N: int, D: int) -> int:
    return max(1, min(N, BLOCK_ROWS * 16 // max(D, 16)))


# -- the update: one deterministic segmented sum ---------------------------------------------
def _label_keys(labels: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """The labels in the narrowest integer type that holds them: a radix sort makes one pass per
    byte of the key (int16 up to 32767 clusters: two passes instead of int64's eight)."""
    if n_clusters <= torch.iinfo(torch.int16).max:
        return labels.to(torch.int16)
    return labels.to(torch.int32)


def segment_sums(X: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, n_clusters: int,
                 x64: torch.Tensor | None = None) -> tuple:
    """(sums (C, D) float64, weight per cluster (C,) float64) of the points (times their weights)
    by label, without atomics, each cluster's points added in float64 in increasing row order. The
    result is the same bitwise run to run.

    On a CPU: ``index_add_`` of row blocks of X in float64 (one pass; it adds the rows in index
    order), the blocks' partial sums added in block order; ``x64``: X in float64 where it is one
    block (lloyd keeps it from iteration to iteration). On CUDA: a stable sort of the labels,
    then ``torch.segment_reduce`` in float64 over row blocks of the sorted points, the blocks'
    partial sums added in block order; each block laid out feature-major, (D, rows) flattened, so
    that the reduction is 1-D with D x C segments (one cub segmented reduction, a thread block per
    segment, each in a fixed order). ``unsafe=True``: the lengths sum to the block's rows by
    construction, and the check would synchronise the host. Both give the same sums where X fits
    one block (BLOCK_ROWS x 16 / D rows); above, the blocks group the rows differently (original
    against sorted order), which can change the last bits.

    On CUDA in float32 (sm_80+) the sorted rows go to one fused kernel instead
    (cuda_templates/kmeans.cuh kmeans_segsum_kernel: each cluster's rows in items of at most 4096,
    summed in float64 in a fixed order, the items added in order): no gather, no float64 copy."""
    N, D = X.shape
    C = n_clusters
    R = _block_rows(N, D)
    if X.device.type == "cpu":
        sums = torch.zeros((C, D), dtype=torch.float64)
        wsum = torch.zeros(C, dtype=torch.float64)
        for b0 in range(0, N, R):
            lb = labels[b0:b0 + R]
            xb = (X if x64 is None else x64)[b0:b0 + R].to(torch.float64)  # (rows, D); no copy if float64
            if weights is not None:
                wb = weights[b0:b0 + R].to(torch.float64)
                xb = xb * wb.unsqueeze(1)
                part_w = torch.zeros(C, dtype=torch.float64).index_add_(0, lb, wb)
                wsum = part_w if b0 == 0 else wsum.add_(part_w)
            part = torch.zeros((C, D), dtype=torch.float64).index_add_(0, lb, xb)
            sums = part if b0 == 0 else sums.add_(part)
        if weights is None:
            wsum = torch.bincount(labels, minlength=C).to(torch.float64)
        return sums, wsum
    keys = _label_keys(labels, C)
    sorted_keys, perm = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(C + 1, device=X.device, dtype=keys.dtype))
    out = fused_segment_sums(X, perm, bounds, weights, C)  # CUDA, float32 on sm_80+: one fused kernel
    if out is not None:
        return out
    sums = torch.zeros((D, C), dtype=torch.float64, device=X.device)
    wsum = None if weights is None else torch.zeros(C, dtype=torch.float64, device=X.device)
    for b0 in range(0, N, R):
        b1 = min(N, b0 + R)
        p = perm[b0:b1]
        lengths = bounds.clamp(b0, b1).diff()  # (C,) rows of each cluster in this block
        xb = X.index_select(0, p).to(torch.float64)  # (rows, D)
        if weights is not None:
            wb = weights.index_select(0, p).to(torch.float64)
            xb.mul_(wb.unsqueeze(1))
            wsum += torch.segment_reduce(wb, "sum", lengths=lengths, axis=0, unsafe=True)
        flat = xb.t().contiguous().view(-1)  # (D * rows,): feature d's rows at [d rows, (d + 1) rows)
        sums += torch.segment_reduce(flat, "sum", lengths=lengths.repeat(D), axis=0, unsafe=True).view(D, C)
    if weights is None:
        wsum = bounds.diff().to(torch.float64)
    return sums.t().contiguous(), wsum


def _relocate_empty(X, weights, labels, d2, sums, wsum, verbose) -> None:
    """scikit-learn's rule for clusters left without weight: the j-th empty cluster takes the j-th
    point farthest from its centre (ties by the smaller index), which leaves its old cluster.
    ``sums`` and ``wsum`` are updated in place, by tensor ops (no loop over the clusters): the
    points leaving one cluster are summed in their order (a stable sort, a segmented sum) and
    subtracted once, so the result is repeatable on a GPU too. ``d2``: the squared distances (N,),
    or a callable giving them (called only when a cluster is empty)."""
    empty = (wsum == 0).nonzero()[:, 0]
    n_empty = int(empty.numel())
    if n_empty == 0:
        return
    if callable(d2):
        d2 = d2()
    far = torch.sort(d2, descending=True, stable=True).indices[:n_empty]
    if verbose:
        print(f"Relocating {n_empty} empty cluster(s) to the farthest points.")
    w = (torch.ones(n_empty, dtype=torch.float64, device=X.device) if weights is None
         else weights.index_select(0, far).double())
    xw = X.index_select(0, far).double() * w.unsqueeze(1)
    old, order = torch.sort(labels.index_select(0, far), stable=True)
    left, count = torch.unique_consecutive(old, return_counts=True)
    sums.index_add_(0, left, torch.segment_reduce(xw.index_select(0, order), "sum", lengths=count, axis=0).neg_())
    wsum.index_add_(0, left, torch.segment_reduce(w.index_select(0, order), "sum", lengths=count).neg_())
    sums[empty] = xw
    wsum[empty] = w


# -- one Lloyd run ------------------------------------------------------------------------------
# Kernel entries (rows x centres) of one block of the CPU assignment's product: 16 MB of float32.
ASSIGN_BLOCK_ELEMENTS = 1 << 19
# Centres up to which the CPU assignment lays its block out centre-major (one thread, 4000 x 10: each
# row minimum over 16 centres 70-110 -> 5 us; 50 000 x 16, 64 centres: row-major the faster, 0.4 against
# 1.0 ms for the minimum, 2.9-4.1 against 4.2-6.2 ms for the product).
COLUMN_MAJOR_UP_TO = 32


def _exact_float_matmul(dtype) -> bool:
    """Whether a CPU matrix product in ``dtype`` is IEEE (every product and sum rounded in dtype):
    not where torch may take bfloat16 or TF32 for float32 (set_float32_matmul_precision below
    "highest", mkldnn's fp32_precision)."""
    if dtype != torch.float32:
        return True
    mk = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return (torch.get_float32_matmul_precision() == "highest"
            and getattr(mk, "fp32_precision", "none") in ("none", "ieee"))


class _NearestCpu:
    """The nearest centre of each row of X (N, K) on a CPU: the labels of knn(X, centres, 1) in its
    direct-difference float64 mode (the smallest distance, ties to the smaller index), bitwise, at the
    cost of one matrix product in X's dtype.

    Per row block: the squared distances by one product of [x, |x|^2, 1] and [-2c, 1, |c|^2]; each
    value's low ``bits`` = ceil(log2 C) mantissa bits replaced by its column, so that one integer amin
    over the bit patterns (monotone for values >= 0; a negative value is only a rounding of a distance
    within the error bound) gives the smallest value and its column, a second amin after masking it
    the runner-up. A row is certified when the runner-up exceeds the smallest by more than
    ``tau (|x|^2 + max |c|^2)``, tau = (16 K + 32 + 2^(bits + 4)) u: at least twice, summed, the
    product's error bound (gamma_(K+2) (|x| + |c|)^2, and u |x|^2, u |c|^2 for the rounded norms), the
    direct float64 distances' own and the column bits (2^bits ulps of each value); (|x| + |c|)^2 <=
    2 (|x|^2 + |c|^2). Other rows (ties, near ties) are rescored as knn does: torch.cdist in float64
    by direct differences against every centre, the first of the smallest. Norms that could overflow
    dtype rescore every row. ``d2``: the squared float64 distances to the given labels, as knn's
    values (float64 direct differences, rounded to X's dtype), bitwise: torch.cdist's kernel on the
    (row, centre) pairs.

    Memory: [x, |x|^2, 1] (N x (K + 2) in X's dtype), its own block (ASSIGN_BLOCK_ELEMENTS values)
    and O(N); the block and the per-row constants are kept from call to call (a fresh allocation
    above glibc's mmap threshold costs its page faults every Lloyd iteration)."""

    def __init__(self, X: torch.Tensor, xt64: torch.Tensor | None = None):
        """``xt64``: X^T in float64 (K, N) where the caller has it (the norms are then taken from it)."""
        N, K = X.shape
        self.X = X
        self.work = w = X.dtype if _exact_float_matmul(X.dtype) else torch.float64
        self.fi = torch.finfo(w)
        self.ibits = torch.int32 if w == torch.float32 else torch.int64
        # (N,) |x|^2 in float64 (a few float64 roundings of the float64 norm: far within the certificate's
        # u |x|^2 for the norm's rounding to w), without a float64 copy of X or of its squares
        self.xn = (torch.linalg.vector_norm(X, dim=1, dtype=torch.float64) if xt64 is None
                   else torch.linalg.vector_norm(xt64, dim=0)).square_()
        self.xn_max = float(self.xn.max())
        self._per_c = None  # what labels() keeps for one number of centres (_setup)

    def _setup(self, C: int) -> tuple:
        """(centre-major, tau, bits, the block's buffer (as integers), the column numbers, the centres'
        operand [-2c, 1, |c|^2] (C, K + 2) with its column of ones set, per row block (b0, b1, [x, |x|^2, 1]
        of its rows, the product's output in buf, its bits as (rows, C), each row's first value in buf,
        tau |x|^2 in dtype), (the views of ca labels() writes, ca^T, the integers' largest)) for C centres. Up to
        COLUMN_MAJOR_UP_TO centres the block is laid out centre-major (C, rows): the row minima are then
        reductions across rows, which torch vectorises, where a row of a few values is not."""
        if self._per_c is not None and self._per_c[0] == C:
            return self._per_c[1]
        X, w = self.X, self.work
        N, K = X.shape
        bits = max(1, (C - 1).bit_length())
        tau = (16 * K + 32 + 2.0 ** (bits + 4)) * self.fi.eps / 2
        centre_major = C <= COLUMN_MAJOR_UP_TO
        xa = torch.empty((K + 2, N) if centre_major else (N, K + 2), dtype=w)  # [x, |x|^2, 1] in that layout
        xv = xa.t() if centre_major else xa
        xv[:, :K] = X
        xv[:, K] = self.xn
        xv[:, K + 1] = 1.0
        R = max(1, min(N, ASSIGN_BLOCK_ELEMENTS // C))
        ca = torch.empty((C, K + 2), dtype=w)
        ca[:, K] = 1.0
        first_of_row = torch.arange(R) * (1 if centre_major else C)
        buf = torch.empty(R * C, dtype=w)
        thr_x = self.xn.mul(tau).to(w)
        blocks = []  # per row block, the views labels() reads and writes (made once: fewer calls an iteration)
        for b0 in range(0, N, R):
            b1 = min(N, b0 + R)
            rows = b1 - b0
            if centre_major:  # (rows, C) squared distances, a view of buf in either layout
                src, dst = xa[:, b0:b1], buf[:rows * C].view(C, rows)
                key = dst.t().view(self.ibits)
            else:
                src, dst = xa[b0:b1], buf[:rows * C].view(rows, C)
                key = dst.view(self.ibits)
            blocks.append((b0, b1, src, dst, key, first_of_row[:rows], thr_x[b0:b1]))
        out = (centre_major, tau, bits, buf.view(self.ibits), torch.arange(C, dtype=self.ibits), ca, blocks,
               (ca[:, :K], ca[:, K + 1], ca.t(), torch.iinfo(self.ibits).max))
        self._per_c = (C, out)
        return out

    def labels(self, centres: torch.Tensor, debug: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) int64: knn's labels of X against ``centres`` (in ``out`` where given). Keeps the centres in
        float64 as ``c64``."""
        X, w = self.X, self.work
        N, K = X.shape
        C = centres.shape[0]
        centre_major, tau, bits, bufi, cols, ca, blocks, (ca_c, ca_n, cat, imax) = self._setup(C)
        self.c64 = c64 = centres.to(torch.float64)
        cn = c64.square().sum(1)  # (C,) |c|^2
        torch.mul(centres, -2.0, out=ca_c)  # exact: -2c in X's dtype (w is X's or float64)
        ca_n.copy_(cn)  # rounded to w
        cn_max = float(cn.max())
        if not self.xn_max + cn_max < self.fi.max / 64:  # the product could overflow: every row exactly
            return self._exact(torch.arange(N), c64, torch.empty(N, dtype=torch.int64) if out is None else out, debug)
        thr_c = tau * cn_max + 16 * (K + 3) * self.fi.tiny  # the threshold's part common to every row
        low = (1 << bits) - 1
        labels = torch.empty(N, dtype=torch.int64) if out is None else out
        unsure = []
        for b0, b1, src, dst, key, first_of_row, thr_x in blocks:
            if centre_major:
                torch.mm(ca, src, out=dst)
            else:
                torch.mm(src, cat, out=dst)
            key.bitwise_and_(~low).bitwise_or_(cols)  # the distances' bits, their low bits the column
            first = key.amin(1)
            lab = labels[b0:b1] if len(blocks) > 1 else labels
            lab.copy_(first.bitwise_and(low))  # (bitwise_and into an int64 out=: a slow casting loop)
            flat = torch.add(first_of_row, lab, alpha=key.stride(1))  # (rows,) int64: in buf
            bufi.index_fill_(0, flat, imax)  # (scatter_ on key: 3x slower row-major)
            second = key.amin(1)
            # the values with their column bits (2^bits ulps, in tau); C = 1: second is NaN, certified
            near = second.view(w).sub_(thr_c) <= first.view(w).add_(thr_x)
            unsure.append(near.nonzero().view(-1).add_(b0) if b0 else near.nonzero().view(-1))
        idx = unsure[0] if len(unsure) == 1 else torch.cat(unsure)
        return self._exact(idx, c64, labels, debug)

    def _exact(self, idx: torch.Tensor, c64: torch.Tensor, labels: torch.Tensor, debug: bool) -> torch.Tensor:
        """``labels`` with rows ``idx`` rescored as knn's CPU path: float64 direct differences."""
        if idx.numel():
            exact = torch.cdist(self.X.index_select(0, idx).to(torch.float64), c64, compute_mode=_DIRECT)
            labels.index_copy_(0, idx, exact.argmin(1))  # (idx distinct; no Python indexing)
        if debug:
            log.debug("kmeans assignment on the CPU: %d rows, %d centres (K = %d, %s product), %d rescored",
                      self.X.shape[0], c64.shape[0], self.X.shape[1], self.work, idx.numel())
        return labels

    def d2(self, centres: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(N,) float64: the squared distance of each row to centres[labels], as knn's value."""
        X = self.X
        N, K = X.shape
        out = torch.empty(N, dtype=torch.float64)
        c64 = centres.to(torch.float64)
        R = max(1, min(N, ASSIGN_BLOCK_ELEMENTS // max(1, K)))
        for b0 in range(0, N, R):
            b1 = min(N, b0 + R)
            cb = torch.embedding(c64, labels[b0:b1])  # centres[labels] (a gather ~7x index_select's speed here)
            pairs = torch.cdist(X[b0:b1].to(torch.float64).unsqueeze(1), cb.unsqueeze(1),
                                compute_mode=_DIRECT)  # (rows, 1, 1): torch.cdist's kernel per pair
            out[b0:b1] = pairs.view(-1).to(X.dtype)
        return out.square_()


def _assign(X, centres, debug, nearest=None, d2=True):
    """(labels (N,) int64, squared distances (N,) float64 or None) to the nearest centre: the labels
    and values of knn(X, centres, 1) in its direct-difference mode (float64 on a CPU). On the CPU by
    :class:`_NearestCpu` (``nearest``: one built for X already; ``d2=False``: the distances left out,
    None). On CUDA in float32 with K <= 16 (plan.kmeans.ASSIGN_UP_TO; KERMAC_LIKE_KMEANS_ASSIGN_MMA=0
    turns it off): the certified tensor-core kernel (cuda_templates/kmeans_assign_mma.cuh), bitwise
    knn's labels and distances; else knn (``d2`` ignored)."""
    if X.device.type == "cpu":
        nearest = nearest or _NearestCpu(X)
        labels = nearest.labels(centres, debug)
        return labels, (nearest.d2(centres, labels) if d2 else None)
    out = assign_mma(X, centres, debug=debug)
    if out is not None:
        return out[0], out[1].to(torch.float64).square_()
    dist, lab = knn(X, centres, 1, compute_mode=_DIRECT, debug=debug)
    return lab[:, 0], dist[:, 0].to(torch.float64).square_()


def _inertia(d2, weights):
    return float(d2.sum() if weights is None else (d2 * weights.to(torch.float64)).sum())


def _local_certificate() -> bool:
    """Whether Lloyd's first assignment takes the local certificate (the setting kmeans_local), for which
    the seeding hands over each point's nearest centre (one more fold of its last round)."""
    return config.get("kmeans_local") == "on"


def _divided(sums: torch.Tensor, wsum: torch.Tensor, dtype) -> torch.Tensor:
    """The new centres (C, D) in ``dtype``: each cluster's sum over its weight; a cluster without weight keeps
    its sum (the relocated point's row, or zeros)."""
    pos = wsum > 0
    return torch.where(pos.unsqueeze(1), sums / torch.where(pos, wsum, 1.0).unsqueeze(1), sums).to(dtype)


def _converged(i: int, same: bool, shift: float, tol: float, verbose: bool) -> tuple:
    """(stop, strict) after iteration ``i``: scikit-learn's two tests (no label changed: strict; the centres'
    squared shift within ``tol``), with its messages."""
    if same:
        if verbose:
            print(f"Converged at iteration {i}: strict convergence.")
        return True, True
    if shift <= tol:
        if verbose:
            print(f"Converged at iteration {i}: center shift {shift} within tolerance {tol}.")
        return True, False
    return False, False


def lloyd(X, weights, centres, max_iter, tol, verbose=False, debug=False, hint=None):
    """scikit-learn's _kmeans_single_lloyd: (labels, inertia, centres, n_iter).

    On CUDA in float32 (K <= 16, 2 to 8192 clusters; plan.kmeans.bounds_serve) the iterations after the
    first assign only the points whose label the distance bounds cannot prove (plan.kmeans.BoundedAssign):
    the same labels, centres, inertia and n_iter as assigning every point, bitwise. ``hint``: each point's
    nearest centre as the seeding knew it (orders the first assignment's rows; any values are valid)."""
    C = centres.shape[0]
    if X.device.type == "cpu" and _block_rows(*X.shape) >= X.shape[0]:
        return _lloyd_cpu(X, weights, centres, max_iter, tol, verbose, debug)
    bounded = bounded_assign(X, C, debug=debug)
    # the CPU: one assignment object for the run, X in float64 for the update where it is one block;
    # the distances only where they are read
    nearest = x64 = None
    if X.device.type == "cpu":
        nearest = _NearestCpu(X)
        x64 = X.to(torch.float64) if _block_rows(*X.shape) >= X.shape[0] else None
    labels_old = None
    strict = False
    labels = d2 = None
    i = 0
    for i in range(max_iter):
        if bounded is None:
            labels, d2 = _assign(X, centres, debug, nearest, d2=nearest is None or verbose)
            if d2 is None:  # the distances of this assignment, for an empty cluster's relocation
                d2 = functools.partial(nearest.d2, centres, labels)
            same = labels_old is not None and torch.equal(labels, labels_old)
        elif i == 0:
            labels, same = bounded.first(centres, hint), False
        else:
            labels, changed = bounded.step(centres)
            same = changed == 0
        sums, wsum = segment_sums(X, labels, weights, C, x64)
        _relocate_empty(X, weights, labels, d2 if bounded is None else bounded.exact_d2, sums, wsum, verbose)
        new = _divided(sums, wsum, X.dtype)
        if verbose:
            print(f"Iteration {i}, inertia {_inertia(d2 if bounded is None else bounded.exact_d2(), weights)}.")
        shift = float((new.to(torch.float64) - centres.to(torch.float64)).square_().sum())
        centres = new
        stop, strict = _converged(i, same, shift, tol, verbose)
        if stop:
            break
        labels_old = labels
    if bounded is not None:
        if not strict:  # the final E-step
            labels = bounded.step(centres)[0]
        d2 = bounded.exact_d2()
    elif not strict:  # the final E-step: labels (and inertia) of the final centres
        labels, d2 = _assign(X, centres, debug, nearest)
    # after a strict convergence the centres are those of the unchanged labels: d2 holds
    return labels, _inertia(d2() if callable(d2) else d2, weights), centres, i + 1


def _lloyd_cpu(X, weights, centres, max_iter, tol, verbose=False, debug=False):
    """:func:`lloyd` on a CPU where X is one block of the update (BLOCK_ROWS x 16 / D rows): the same
    labels, centres, inertia and n_iter, bitwise, in fewer torch ops an iteration (each op is a
    dispatch, a parallel region above torch's grain and, on a loaded machine, a wait).

    The update is one ``scatter_add_`` along the rows of [x w, w]^T (D + 1, N) in float64, built once a
    fit (lloyd's own products x w, and its weights, each iteration): each cluster's sums and weight in
    increasing row order, as :func:`segment_sums` (torch's scatter kernel runs each output row's index
    dimension in order; index_add_ on (N, D + 1) rows takes its sorting path, ~2x slower); the division
    and the centre shift without the empty clusters' masks unless a cluster is empty. On the caller's
    threads: torch.set_num_threads is not touched (after a change of the thread count, torch 2.13's CPU
    build with oneMKL returns invalid pivots from a batched torch.linalg.lu_factor_ex, "Parameter 6 was
    incorrect on entry to SLASWP": a fit must not leave that behind)."""
    N, D = X.shape
    C = centres.shape[0]
    xw = torch.empty((D + 1, N), dtype=torch.float64)  # feature-major: scatter_add_ runs along each row
    xw[:D] = X.t()
    nearest = _NearestCpu(X, xw[:D])  # its norms from X^T in float64 (before the weights)
    if weights is None:
        xw[D] = 1.0
    else:
        w64 = weights.to(torch.float64)
        xw[:D].mul_(w64)
        xw[D] = w64
    acc = torch.empty((D + 1, C), dtype=torch.float64)
    sums, wsum = acc[:D].t(), acc[D]
    wcol = wsum.unsqueeze(1)
    lab_bufs = (torch.empty(N, dtype=torch.int64), torch.empty(N, dtype=torch.int64))  # labels, labels_old
    lab_rows = tuple(b.expand(D + 1, N) for b in lab_bufs)  # scatter_add_'s index: the labels on every row
    labels_old = None
    strict = False
    labels = d2 = None
    i = 0
    for i in range(max_iter):
        labels = nearest.labels(centres, debug, out=lab_bufs[i % 2])
        c64 = nearest.c64
        same = labels_old is not None and torch.equal(labels, labels_old)
        acc.zero_().scatter_add_(1, lab_rows[i % 2], xw)  # each (feature, cluster) in row order
        d2 = nearest.d2(centres, labels) if verbose else functools.partial(nearest.d2, centres, labels)
        if float(wsum.min()) > 0:  # no empty cluster (the weights are >= 0)
            new = torch.div(sums, wcol, out=torch.empty((C, D), dtype=X.dtype))  # in float64, rounded
        else:
            _relocate_empty(X, weights, labels, d2, sums, wsum, verbose)
            new = _divided(sums, wsum, X.dtype)
        if verbose:
            print(f"Iteration {i}, inertia {_inertia(d2, weights)}.")
        shift = float(torch.sub(new, c64).square_().sum())
        centres = new
        stop, strict = _converged(i, same, shift, tol, verbose)
        if stop:
            break
        labels_old = labels
    if not strict:  # the final E-step: labels (and inertia) of the final centres
        labels = nearest.labels(centres, debug, out=lab_bufs[(i + 1) % 2])
        d2 = nearest.d2(centres, labels)
    # after a strict convergence the centres are those of the unchanged labels: d2 holds (the distances, or
    # the callable that gives them)
    return labels, _inertia(d2() if callable(d2) else d2, weights), centres, i + 1
