"""k-means clustering on :func:`kermac_like.knn`: :class:`KMeans`, scikit-learn's estimator.

Lloyd's algorithm with scikit-learn's semantics (``KMeans(algorithm="lloyd")``): the same
parameters, stopping rule, final relabelling, empty-cluster rule and errors. Each iteration is

* the assignment: the nearest centre of every point, ``knn(X, centres, 1)`` (the fused
  argmin of the selection reduction on a GPU: the N x n_clusters distance matrix is never
  stored);
* the update: one segmented sum of the points by label (a stable sort of the labels, then
  ``torch.segment_reduce`` over the sorted rows in row blocks, accumulated in float64 in a
  fixed order; on CUDA in float32 one fused kernel over the sorted rows instead,
  cuda_templates/kmeans.cuh): no one-hot matrix and no floating-point atomics, so the same
  data and initial centres give bitwise the same centres run to run, on a CPU as on a GPU.

k-means++ seeding in rounds (:func:`kmeans_plusplus`: up to 128 centres a round drawn exactly by
rejection from the round's starting distribution, then folded into the running minimum distance
in one pass): on CUDA in float32 three fused kernels a round (cuda_templates/kmeans.cuh,
kermac_like/plan/kmeans.py) and one host synchronisation a round; elsewhere torch ops, one host
synchronisation a proposal (the same draws from the same uniforms).

The fit runs about a reference point s (:func:`_reference`: per column a median of the data
rounded to a power of two below its spread): X - s once per fit, the seeding and every iteration
in those coordinates, the centres given back as c + s. Distances do not depend on s, but their
rounding does: the tensor-core assignment's certificate and the pruned iterations' bounds lose
eps x the squared norms of what they are fed, so on data far from the origin (shifted,
all-positive, pixel-like) they would lose eps |x|^2 instead of eps times the centred scale.

Memory beyond X: X - s where s is not 0 (a copy of X), O(N) (labels, distances, the sort's
permutation), one row block of X in float64 and the knn op's own blocks; never N x n_clusters
(``transform``'s output aside).
numpy in, numpy out (``labels_`` int32, centres in X's float dtype, as scikit-learn); torch
tensors in, tensors out on their device (labels int64), the fit on X's device.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import warnings

import numpy as np
import torch

from . import config
from ._args import all_finite
from ._estimator import (HAVE_SKLEARN, BaseEstimator, ClusterMixin, TransformerMixin, check_is_fitted,
                         check_n_features)
from .centring import REFERENCE_ROWS, centred, reference_point
from .ops.knn import knn
from .runtime.specs.kmeans import BLOCK_M as _SEED_BLOCK_M, ROUND as _SEED_ROUND, TRIALS as _SEED_TRIALS

try:
    from sklearn.exceptions import ConvergenceWarning
except ImportError:  # scikit-learn is optional
    class ConvergenceWarning(UserWarning):
        """Fewer distinct clusters than n_clusters were found."""

__all__ = ["KMeans"]

log = logging.getLogger("kermac_like.kmeans")

# Rows of X handled at once by the update, the seeding and the variance (memory: one block in
# float64, 2^20 x D x 8 bytes).
BLOCK_ROWS = 1 << 20
# The k-means++ sampler's points per block (two-level inverse-CDF sampling: block sums, then one
# block's cumulative sum); kmeans_plusplus' centres per round at most and proposals per centre
# before a round ends: the fused kernels' constants (runtime/specs/kmeans.py), which the torch
# path shares so that both draw the same centres from the same uniforms.
SAMPLE_BLOCK, SEED_ROUND, SEED_TRIALS = _SEED_BLOCK_M, _SEED_ROUND, _SEED_TRIALS
# torch.cdist's direct differences on the CPU path (the fused GPU kernel forms them anyway):
# distances without the matrix-product formula's cancellation.
_DIRECT = "donot_use_mm_for_euclid_dist"
INITS = ("k-means++", "random")


def _is_tensor(a) -> bool:
    return isinstance(a, torch.Tensor)


def _random_state(random_state) -> np.random.RandomState:
    """scikit-learn's check_random_state."""
    if random_state is None or random_state is np.random:
        return np.random.mtrand._rand
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        return np.random.RandomState(random_state)
    if isinstance(random_state, np.random.RandomState):
        return random_state
    raise ValueError(f"random_state: {random_state!r} cannot be used to seed a numpy.random.RandomState instance")


def _check_tensor_X(name: str, X: torch.Tensor) -> torch.Tensor:
    if X.is_complex():
        raise ValueError(f"{name}: Complex data not supported")
    if X.layout != torch.strided:
        raise TypeError(f"{name}: sparse input is not supported; pass a dense tensor ({name}.to_dense())")
    if X.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (n_samples, n_features), got shape {tuple(X.shape)}")
    if X.dtype not in (torch.float32, torch.float64):
        X = X.to(torch.float64)
    if X.shape[0] == 0:
        raise ValueError(f"{name}: found 0 sample(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if X.shape[1] == 0:
        raise ValueError(f"{name}: 0 feature(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if not all_finite(X):
        raise ValueError(f"Input {name} contains NaN or infinity.")
    return X.contiguous()


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
    if X.is_cuda:  # float32 on sm_80+: one fused segmented sum over the sorted rows
        from .plan.kmeans import segment_sums_fused

        out = segment_sums_fused(X, perm, bounds, weights, C)
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


# -- seeding ------------------------------------------------------------------------------------
class _Sampler:
    """Draws an index with probability proportional to a non-negative vector ``p`` (N,): block
    sums (in float64) and their cumulative sum, formed by :meth:`refresh`, then per draw one
    block's cumulative sum. No host synchronisation."""

    def __init__(self, N: int, dtype, device):
        self.N = N
        self.nb = -(-N // SAMPLE_BLOCK)
        self.p = torch.zeros(self.nb * SAMPLE_BLOCK, dtype=dtype, device=device)

    def refresh(self) -> None:
        """The block sums and their cumulative sum of the current p."""
        self.bs = self.p.view(self.nb, SAMPLE_BLOCK).sum(1, dtype=torch.float64)
        self.cum = self.bs.cumsum(0)

    def draw(self, u: torch.Tensor) -> torch.Tensor:
        """The index (1-element int64 tensor) at ``u`` (1 element, in [0, 1)) of the distribution
        of p as of the last refresh."""
        blocks = self.p.view(self.nb, SAMPLE_BLOCK)
        cum, bs = self.cum, self.bs
        r = u * cum[-1:]
        b = torch.searchsorted(cum, r, right=True).clamp_(max=self.nb - 1)
        inner = blocks.index_select(0, b)[0].cumsum(0, dtype=torch.float64)  # (no host sync, unlike blocks[b])
        i = torch.searchsorted(inner, r - (cum.index_select(0, b) - bs.index_select(0, b)), right=True)
        return (b * SAMPLE_BLOCK + i.clamp_(max=SAMPLE_BLOCK - 1)).clamp_(max=self.N - 1)


def _sq_dist_to(X: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """||x - c||^2 of every row (N,) by direct differences, in row blocks."""
    N, D = X.shape
    out = torch.empty(N, dtype=X.dtype, device=X.device)
    R = _block_rows(N, D)
    for b0 in range(0, N, R):
        out[b0:b0 + R] = (X[b0:b0 + R] - c).square_().sum(1)
    return out


def _sq_dists_nan_inf(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||a - b||^2 (rows of A against rows of B, direct differences), NaN read as +inf (a NaN
    distance never wins a comparison)."""
    d = (A[:, None, :] - B[None, :, :]).square_().sum(-1)
    return d.masked_fill_(d.isnan(), float("inf"))


def seed_uniforms(n_clusters: int, generator: torch.Generator, device) -> torch.Tensor:
    """The uniforms of a k-means++ seeding, (n_clusters, 2 SEED_TRIALS + 1) float64 in [0, 1)
    from ``generator`` (on ``device``): row j holds centre j's proposals (SEED_TRIALS), its exact
    draw's uniform, and its acceptance uniforms (SEED_TRIALS)."""
    return torch.rand((n_clusters, 2 * SEED_TRIALS + 1), dtype=torch.float64, device=device, generator=generator)


def kmeans_plusplus(X: torch.Tensor, n_clusters: int, weights: torch.Tensor | None, generator: torch.Generator,
                    debug: bool = False, hint: list | None = None):
    """k-means++ seeding (Arthur and Vassilvitskii): the first centre drawn with probability
    proportional to the weight, each next one proportional to weight x squared distance to the
    nearest centre so far (D^2 sampling, exactly). Never N x n_clusters. Returns (centres (C, D)
    in X's dtype, indices (C,) int64).

    Rounds: a round starts from the running minimum distance d2 (and each point's nearest centre)
    of the centres drawn so far, draws its first centre exactly, then up to SEED_ROUND - 1 more by
    rejection from that same distribution: a proposal x (probability p_s(x) / Z_s) is kept with
    probability p_j(x) / p_s(x), p_j against every centre drawn so far, so a kept point has
    probability p_j(x) / Z_j, as D^2 sampling; after SEED_TRIALS rejected proposals the round
    ends and the next one draws that centre exactly. The round's centres are then folded into
    d2 in one pass, only for the points they can improve: a point whose nearest centre a lies at
    least twice its distance from every new centre c (||c - a||^2 >= 4 d^2) cannot get closer.

    The uniforms, :func:`seed_uniforms`, come from ``generator`` first. On a CUDA device (sm_80+)
    in float32 (16-bit data upcast) the fused kernels of cuda_templates/kmeans.cuh draw
    (kermac_like.plan.kmeans: about C / 128 rounds, one host synchronisation a round); else, and
    as their oracle, the torch path :func:`_kmeans_plusplus_torch` (the same algorithm from the
    same uniforms). Memory: O(N) besides X. ``hint`` (a list): gets each point's nearest centre index as
    the seeding last folded it (the first Lloyd assignment's row order: plan.kmeans.BoundedAssign)."""
    u = seed_uniforms(n_clusters, generator, X.device)
    if X.is_cuda:
        from .plan.kmeans import seed_plusplus

        out = seed_plusplus(X, n_clusters, weights, u, debug=debug, hint=hint)
        if out is not None:
            return out
    return _kmeans_plusplus_torch(X, n_clusters, weights, u, hint)


def _kmeans_plusplus_torch(X: torch.Tensor, n_clusters: int, weights: torch.Tensor | None, u: torch.Tensor,
                           hint: list | None = None):
    """kmeans_plusplus by torch ops from the uniforms ``u`` (seed_uniforms): the rounds of the
    fused kernels, each proposal decided on the host (one synchronisation a proposal), each
    round's fold over the candidates of the triangle bound in row blocks."""
    N, D = X.shape
    dev = X.device
    C, T = n_clusters, SEED_TRIALS
    ud = u.to(device=dev, dtype=torch.float64)  # the draws' uniforms, on X's device
    uh = ud.cpu()  # the acceptance tests' (decided on the host)
    w = None if weights is None else weights.to(X.dtype)
    sampler = _Sampler(N, X.dtype, dev)
    sampler.p[:N] = 1.0 if w is None else w
    sampler.refresh()
    idx = torch.empty(C, dtype=torch.int64, device=dev)
    centres = torch.empty((C, D), dtype=X.dtype, device=dev)
    idx[:1] = sampler.draw(ud[0, T:T + 1])
    centres[:1] = X.index_select(0, idx[:1])
    d2 = _sq_dist_to(X, centres[0])  # (N,) running minimum squared distance
    near = torch.zeros(N, dtype=torch.int64, device=dev)  # its centre
    R = max(1, _block_rows(N, D) // SEED_ROUND)
    s = 1
    while s < C:
        sampler.p[:N] = d2 if w is None else d2 * w
        sampler.refresh()
        if not float(sampler.cum[-1]) > 0:  # every p zero: the exact draw's clamp, N - 1, for every centre left
            idx[s:] = N - 1
            centres[s:] = X[N - 1]
            break
        idx[s:s + 1] = sampler.draw(ud[s, T:T + 1])
        centres[s:s + 1] = X.index_select(0, idx[s:s + 1])
        j = s + 1
        while j < min(C, s + SEED_ROUND):
            pick = None
            for t in range(T):
                q = sampler.draw(ud[j, t:t + 1])
                ps = sampler.p.index_select(0, q)
                if not float(ps) > 0:
                    continue
                xq = X.index_select(0, q)
                dj = torch.fmin(d2.index_select(0, q), _sq_dists_nan_inf(xq, centres[s:j]).amin(1))
                pj = dj if w is None else dj * w.index_select(0, q)
                if float(uh[j, T + 1 + t]) * float(ps) < float(pj):
                    pick = q
                    break
            if pick is None:
                break
            idx[j:j + 1] = pick
            centres[j:j + 1] = X.index_select(0, pick)
            j += 1
        # fold centres [s, j) into (d2, near) for the candidates of the triangle bound
        new = centres[s:j]
        gap = torch.cat([_sq_dists_nan_inf(centres[a0:min(s, a0 + R)], new).amin(1)  # (s,) ||c_a - c_i||^2,
                         for a0 in range(0, s, R)])  # min over the round (row blocks: memory as the fold's)
        # a margin of 1e-6 relative keeps points whose bound is within rounding of the limit
        cand = (gap[near] < d2 * (4.0 * (1.0 + 1e-6))).nonzero()[:, 0]
        for b0 in range(0, cand.numel(), R):
            cb = cand[b0:b0 + R]  # distinct indices: the writes below are deterministic
            dn, k = _sq_dists_nan_inf(X.index_select(0, cb), new).min(1)  # the first index of the smallest
            old = d2.index_select(0, cb)
            better = dn < old
            d2[cb] = torch.where(better, dn, old)
            near[cb] = torch.where(better, k + s, near.index_select(0, cb))
        s = j
    if hint is not None:
        hint.append(near)
    return centres, idx


def _random_init(X, n_clusters, weights, generator):
    """n_clusters distinct points drawn without replacement with probability proportional to
    the weight (Efraimidis-Spirakis keys log(u) / w, the largest n_clusters)."""
    N = X.shape[0]
    u = torch.rand(N, dtype=torch.float64, device=X.device, generator=generator)
    keys = u.log_() if weights is None else u.log_() / weights.to(torch.float64)
    idx = torch.topk(keys, n_clusters).indices
    return X[idx].clone(), idx


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

    def __init__(self, X: torch.Tensor):
        N, K = X.shape
        self.X = X
        self.work = w = X.dtype if _exact_float_matmul(X.dtype) else torch.float64
        self.fi = torch.finfo(w)
        self.ibits = torch.int32 if w == torch.float32 else torch.int64
        self.xn = X.to(torch.float64).square().sum(1)  # (N,) |x|^2 (X itself is float64 data: not in place)
        self.xn_max = float(self.xn.max())
        self._per_c = None  # what labels() keeps for one number of centres (_setup)

    def _setup(self, C: int) -> tuple:
        """(centre-major, [x, |x|^2, 1] in that layout, tau |x|^2 in dtype (N,), tau, bits, block rows R,
        the block's buffer, the column numbers, each block row's first value in the buffer) for C
        centres. Up to COLUMN_MAJOR_UP_TO centres the block is laid out centre-major (C, rows): the row
        minima are then reductions across rows, which torch vectorises, where a row of a few values is
        not."""
        if self._per_c is not None and self._per_c[0] == C:
            return self._per_c[1]
        X, w = self.X, self.work
        N, K = X.shape
        bits = max(1, (C - 1).bit_length())
        tau = (16 * K + 32 + 2.0 ** (bits + 4)) * self.fi.eps / 2
        centre_major = C <= COLUMN_MAJOR_UP_TO
        xa = torch.cat([X.to(w), self.xn.to(w).unsqueeze(1), torch.ones((N, 1), dtype=w)], 1)  # (N, K + 2)
        R = max(1, min(N, ASSIGN_BLOCK_ELEMENTS // C))
        first_of_row = torch.arange(R) * (1 if centre_major else C)
        out = (centre_major, xa.t().contiguous() if centre_major else xa, self.xn.mul(tau).to(w), tau, bits, R,
               torch.empty(R * C, dtype=w), torch.arange(C, dtype=self.ibits), first_of_row)
        self._per_c = (C, out)
        return out

    def labels(self, centres: torch.Tensor, debug: bool = False) -> torch.Tensor:
        X, w, ibits = self.X, self.work, self.ibits
        N, K = X.shape
        C = centres.shape[0]
        centre_major, xa, thr_x, tau, bits, R, buf, cols, first_of_row = self._setup(C)
        c64 = centres.to(torch.float64)
        cn = c64.square().sum(1)  # (C,) |c|^2
        ca = torch.cat([c64.mul(-2.0), torch.ones((C, 1), dtype=torch.float64), cn.unsqueeze(1)], 1).to(w)
        cn_max = float(cn.max())
        if not self.xn_max + cn_max < self.fi.max / 64:  # the product could overflow: every row exactly
            return self._exact(torch.arange(N), c64, torch.empty(N, dtype=torch.int64), debug)
        thr_c = tau * cn_max + 16 * (K + 3) * self.fi.tiny  # the threshold's part common to every row
        low = (1 << bits) - 1
        labels, unsure = [], []
        for b0 in range(0, N, R):
            b1 = min(N, b0 + R)
            rows = b1 - b0
            if centre_major:  # (rows, C) squared distances, a view of buf in either layout
                d = torch.mm(ca, xa[:, b0:b1], out=buf[:rows * C].view(C, rows)).t()
            else:
                d = torch.mm(xa[b0:b1], ca.t(), out=buf[:rows * C].view(rows, C))
            key = d.view(ibits)  # the distances' bits
            key.bitwise_and_(~low).bitwise_or_(cols)
            first = key.amin(1)
            lab = first.bitwise_and(low)
            flat = torch.add(first_of_row[:rows], lab, alpha=key.stride(1))  # (rows,) int64: in buf
            buf.view(ibits).index_fill_(0, flat, torch.iinfo(ibits).max)
            second = key.amin(1)
            # the values with their column bits (2^bits ulps, in tau); C = 1: second is NaN, certified
            near = second.view(w).sub_(thr_c) <= first.view(w).add_(thr_x[b0:b1])
            labels.append(lab.long())
            unsure.append(near.nonzero()[:, 0].add_(b0) if b0 else near.nonzero()[:, 0])
        labels = labels[0] if len(labels) == 1 else torch.cat(labels)
        idx = unsure[0] if len(unsure) == 1 else torch.cat(unsure)
        return self._exact(idx, c64, labels, debug)

    def _exact(self, idx: torch.Tensor, c64: torch.Tensor, labels: torch.Tensor, debug: bool) -> torch.Tensor:
        """``labels`` with rows ``idx`` rescored as knn's CPU path: float64 direct differences."""
        if idx.numel():
            exact = torch.cdist(self.X.index_select(0, idx).to(torch.float64), c64, compute_mode=_DIRECT)
            labels[idx] = exact.argmin(1)
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
            pairs = torch.cdist(X[b0:b1].to(torch.float64).unsqueeze(1), c64.index_select(0, labels[b0:b1]).unsqueeze(1),
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
    if X.is_cuda:
        from .plan.kmeans import assign_mma

        out = assign_mma(X, centres, debug)
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


def lloyd(X, weights, centres, max_iter, tol, verbose=False, debug=False, hint=None):
    """scikit-learn's _kmeans_single_lloyd: (labels, inertia, centres, n_iter).

    On CUDA in float32 (K <= 16, 2 to 8192 clusters; plan.kmeans.bounds_serve) the iterations after the
    first assign only the points whose label the distance bounds cannot prove (plan.kmeans.BoundedAssign):
    the same labels, centres, inertia and n_iter as assigning every point, bitwise. ``hint``: each point's
    nearest centre as the seeding knew it (orders the first assignment's rows; any values are valid)."""
    C = centres.shape[0]
    from .plan.kmeans import BoundedAssign, bounds_serve

    bounded = BoundedAssign(X, C, debug) if X.is_cuda and bounds_serve(X, C) else None
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
        pos = wsum > 0
        new = torch.where(pos.unsqueeze(1), sums / torch.where(pos, wsum, 1.0).unsqueeze(1), sums).to(X.dtype)
        if verbose:
            print(f"Iteration {i}, inertia {_inertia(d2 if bounded is None else bounded.exact_d2(), weights)}.")
        shift = float((new.to(torch.float64) - centres.to(torch.float64)).square_().sum())
        centres = new
        if same:
            if verbose:
                print(f"Converged at iteration {i}: strict convergence.")
            strict = True
            break
        if shift <= tol:
            if verbose:
                print(f"Converged at iteration {i}: center shift {shift} within tolerance {tol}.")
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


def _same_clustering(a: torch.Tensor, b: torch.Tensor, C: int) -> bool:
    """scikit-learn's _is_same_clustering: one partition up to a renaming of the labels."""
    pairs = torch.unique(a * C + b)
    return pairs.numel() == torch.unique(a).numel() == torch.unique(b).numel()


def _reference(X: torch.Tensor) -> torch.Tensor:
    """(D,) in X's dtype and device: the fit's reference point s, :func:`centring.reference_point`
    (per column a median of a sample of the rows: one of the data's own values) rounded to a
    multiple of the largest power of two at most the column's spread (the root mean square of the
    same sample about it; unrounded where that is 0). So x - s rounds by at most eps |x - s| (eps
    times the centred scale) and not at all on a power-of-two lattice (integers, pixels: s stays on
    it) or far from the origin (x and s within a factor of two: Sterbenz), and data centred within
    its spread get s = 0: the fit is then that of X itself, bitwise (and X is not copied)."""
    rows = X[::max(1, -(-X.shape[0] // REFERENCE_ROWS))]  # reference_point's own sample of X
    # X is finite (validated): reference_point's scan of every row for infinities finds none, so
    # it is given the sample alone (the same point; two reads of X fewer)
    ref = reference_point(rows).to(device=X.device, dtype=torch.float64)
    sample = rows.to(torch.float64) - ref
    spread = sample.square_().mean(0).sqrt_()
    grid = torch.exp2(torch.floor(torch.log2(spread)))
    return torch.where(spread > 0, torch.round(ref / grid) * grid, ref).to(X.dtype)


def _tolerance(X: torch.Tensor, tol: float) -> float:
    """scikit-learn's _tolerance: tol x the mean over features of the (population) variance,
    in float64 by row blocks."""
    if tol == 0:
        return 0.0
    N, D = X.shape
    mean = X.sum(0, dtype=torch.float64) / N
    ss = torch.zeros(D, dtype=torch.float64, device=X.device)
    R = _block_rows(N, D)
    for b0 in range(0, N, R):
        ss += (X[b0:b0 + R].to(torch.float64) - mean).square_().sum(0)
    return float((ss / N).mean()) * tol


class KMeans(ClusterMixin, TransformerMixin, BaseEstimator):
    """k-means clustering, Lloyd's algorithm (scikit-learn's ``KMeans(algorithm="lloyd")``).

    Parameters
    ----------
    n_clusters : int, default 8
    init : "k-means++", "random" or an array (n_clusters, n_features), default "k-means++"
        "k-means++": D^2 sampling (each new centre drawn with probability proportional to the
        weight times the squared distance to the nearest centre so far, exactly; one draw per
        centre, not scikit-learn's greedy best of 2 + log(k) trials; see kmeans_plusplus). "random": n_clusters distinct
        points, drawn with probability proportional to the weight. An array (numpy or a
        tensor) gives the initial centres: one run, as scikit-learn.
    n_init : int or "auto", default 1
        Runs from different seeds; the one of least inertia is kept (a later run only when it
        is a different partition, as scikit-learn). "auto": 1 for "k-means++" and an array, 10
        for "random".
    max_iter : int, default 300
    tol : float, default 1e-4
        Relative to the data: the run stops when the centres move by at most
        tol x (the mean over features of X's variance) in squared Euclidean norm (summed over
        the centres), or when no label changes.
    random_state : None, int or numpy.random.RandomState
        Seeds the initialisations (drawn on X's device with a torch.Generator, so a CPU and a
        GPU give different seeds for the same random_state; the same device, data and
        random_state give bitwise the same result).
    verbose : bool
    debug : bool
        Log the knn op's path (as ``debug`` of :func:`kermac_like.knn`).

    Empty clusters (no weight after an assignment) are handled as scikit-learn does: each
    takes one of the points farthest from their centres (farthest first, ties to the smaller
    index), which leaves its old cluster.

    Fitted attributes: ``cluster_centers_`` (n_clusters, n_features), ``labels_`` (n_samples,),
    ``inertia_`` (float: the weighted sum of squared distances to the nearest centre),
    ``n_iter_``, ``n_features_in_``, ``feature_names_in_`` (data frames). numpy X: numpy
    centres in X's float dtype and int32 labels (scikit-learn's types); a tensor X: tensors on
    its device, int64 labels.

    >>> import numpy as np
    >>> from kermac_like.cluster import KMeans
    >>> X = np.array([[0.0, 0.0], [0.0, 1.0], [10.0, 10.0], [10.0, 11.0]])
    >>> fit = KMeans(n_clusters=2, random_state=0).fit(X)
    >>> sorted(fit.cluster_centers_.tolist()), fit.inertia_
    ([[0.0, 0.5], [10.0, 10.5]], 1.0)
    >>> fit.labels_.dtype, bool(fit.labels_[0] == fit.labels_[1] != fit.labels_[2])
    (dtype('int32'), True)

    The assignment is ``knn(X, centres, 1)``: on a CPU (and for float64 on a GPU) exact in
    float64; on a GPU in float32 for float32 data, so points whose two nearest centres are
    within float32 rounding of each other may take the other one. Inertia is summed in float64.
    On a GPU in float32 with n_features <= 16 and 2 to 8192 clusters the assignment runs on tensor
    cores with a certificate, and the iterations after the first assign only the points whose
    label distance bounds cannot prove (Hamerly's bounds with Elkan's half-distance test): the
    same labels as assigning every point, bitwise (``KERMAC_LIKE_KMEANS_BOUNDS=0`` assigns every
    point). The fit, predict, transform and score run about a reference point of the training data
    (the module's docstring): a common shift of the data shifts the centres and changes no label
    beyond float32 rounding of the centred coordinates (none where the shift is exact, e.g. on a
    power-of-two lattice). Device memory: X and, unless the data are centred already, X - s;
    ~24 bytes a point for the bounded iterations (labels, two bounds, a distance and the work list)
    and O(n_clusters x n_features) per step; no n_samples x n_clusters matrix. Errors:
    ``ValueError`` naming the argument for bad parameters, shapes, n_clusters > n_samples and
    NaN/inf in X; ``NotFittedError`` before ``fit``.
    """

    def __init__(self, n_clusters=8, *, init="k-means++", n_init=1, max_iter=300, tol=1e-4, random_state=None,
                 verbose=False, debug=False):
        self.n_clusters = n_clusters
        self.init = init
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state
        self.verbose = verbose
        self.debug = debug

    # -- validation ---------------------------------------------------------------------------------
    def _check_params(self) -> tuple:
        """(n_clusters, n_init, max_iter, tol, init) after checking each parameter."""
        def integer(name, v, lo=1):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
            return int(v)

        C = integer("n_clusters", self.n_clusters)
        max_iter = integer("max_iter", self.max_iter)
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"tol: expected a finite real number >= 0, got {tol!r}")
        init = self.init
        array_init = not isinstance(init, str)
        if isinstance(init, str) and init not in INITS:
            raise ValueError(f"init: {init!r} is not one of {INITS} or an array of shape (n_clusters, n_features)")
        if array_init and (callable(init) or not (_is_tensor(init) or hasattr(init, "__len__")
                                                   or hasattr(init, "__array__"))):
            raise TypeError(f"init: expected 'k-means++', 'random' or an array, got {type(init).__name__}")
        if self.n_init == "auto":
            n_init = 10 if init == "random" else 1
        else:
            n_init = integer("n_init", self.n_init)
        if array_init and n_init != 1:
            warnings.warn(f"Explicit initial center position passed: performing only one init in "
                          f"{type(self).__name__} instead of n_init={n_init}.", RuntimeWarning, stacklevel=3)
            n_init = 1
        return C, n_init, max_iter, float(tol), init

    def _validate(self, X, *, reset: bool) -> tuple:
        """(X tensor, X was a tensor). numpy/lists through scikit-learn's validate_data
        (n_features_in_, feature names, its messages); tensors here."""
        if _is_tensor(X):
            Xt = _check_tensor_X("X", X)
            check_n_features(self, Xt.shape[1], reset=reset, forget_names=True)
            return Xt, True
        if HAVE_SKLEARN:
            from sklearn.utils.validation import validate_data

            Xa = validate_data(self, X, reset=reset, dtype=[np.float64, np.float32], order="C")
        else:
            if hasattr(X, "toarray") and hasattr(X, "nnz"):
                raise TypeError("X: sparse input is not supported; pass a dense array (X.toarray())")
            Xa = np.asarray(X)
            if np.iscomplexobj(Xa):
                raise ValueError("X: Complex data not supported")
            if Xa.dtype not in (np.float32, np.float64):
                Xa = Xa.astype(np.float64)
            Xt = _check_tensor_X("X", torch.from_numpy(np.ascontiguousarray(Xa)))
            check_n_features(self, Xa.shape[1], reset=reset)
        Xa = np.ascontiguousarray(Xa)
        return torch.from_numpy(Xa if Xa.flags.writeable else Xa.copy()), False

    def _sample_weight(self, sample_weight, Xt: torch.Tensor):
        """(N,) tensor in X's dtype on X's device, or None for unit weights."""
        if sample_weight is None:
            return None
        if isinstance(sample_weight, numbers.Number):
            w = torch.full((Xt.shape[0],), float(sample_weight), dtype=Xt.dtype, device=Xt.device)
        elif _is_tensor(sample_weight):
            if sample_weight.device != Xt.device:
                raise ValueError(f"sample_weight: on {sample_weight.device}, X on {Xt.device}")
            w = sample_weight.to(Xt.dtype)
        else:
            w = torch.from_numpy(np.array(sample_weight, dtype=np.float64)).to(Xt.dtype)
        if w.dim() != 1 or w.shape[0] != Xt.shape[0]:
            raise ValueError(f"sample_weight.shape == {tuple(w.shape)}, expected ({Xt.shape[0]},)!")
        if not all_finite(w):
            raise ValueError("Input sample_weight contains NaN or infinity.")
        if bool((w < 0).any()):
            raise ValueError("Negative values in data passed to sample_weight")
        if not bool((w > 0).any()):
            raise ValueError("sample_weight: the weights sum to zero")
        return w

    def _init_array(self, Xt: torch.Tensor, C: int) -> torch.Tensor:
        init = self.init
        if _is_tensor(init):
            if init.device != Xt.device:
                raise ValueError(f"init: on {init.device}, X on {Xt.device}")
            c = init.detach()
        else:
            try:
                c = torch.from_numpy(np.array(init, dtype=np.float64))
            except (TypeError, ValueError) as e:
                raise TypeError(f"init: cannot be read as an array of numbers ({e})") from None
        if c.is_complex():
            raise ValueError("init: Complex data not supported")
        if c.dim() != 2:
            raise ValueError(f"init: expected a 2-D array (n_clusters, n_features), got shape {tuple(c.shape)}")
        if c.shape[0] != C:
            raise ValueError(f"The shape of the initial centers {tuple(c.shape)} does not match the number of "
                             f"clusters {C}.")
        if c.shape[1] != Xt.shape[1]:
            raise ValueError(f"The shape of the initial centers {tuple(c.shape)} does not match the number of "
                             f"features of the data {Xt.shape[1]}.")
        c = c.to(Xt.dtype).clone().contiguous()
        if not all_finite(c):
            raise ValueError("Input init contains NaN or infinity.")
        return c

    # -- fit ----------------------------------------------------------------------------------------
    def fit(self, X, y=None, sample_weight=None):
        """Compute the clustering. ``sample_weight`` (n_samples,): the weight of each point in
        the seeding, the centres and the inertia. Returns self. A rejected argument raises
        TypeError/ValueError naming it and leaves the estimator as it was."""
        saved = dict(self.__dict__)
        try:
            return self._fit(X, sample_weight)
        except (TypeError, ValueError):
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def _fit(self, X, sample_weight):
        C, n_init, max_iter, tol, init = self._check_params()
        Xt, was_tensor = self._validate(X, reset=True)
        N = Xt.shape[0]
        if N < C:
            raise ValueError(f"n_samples={N} should be >= n_clusters={C}.")
        w = self._sample_weight(sample_weight, Xt)
        if w is not None and int((w > 0).sum()) < C and init == "random":
            raise ValueError(f"sample_weight: {int((w > 0).sum())} points of nonzero weight, fewer than "
                             f"n_clusters={C}")
        centres0 = None if isinstance(init, str) else self._init_array(Xt, C)
        rs = _random_state(self.random_state)
        with torch.no_grad():
            ref = _reference(Xt)  # the fit in X - ref (the module's docstring)
            shifted = bool(ref.any())
            Xc = centred(Xt, ref) if shifted else Xt
            if centres0 is not None and shifted:
                centres0 = centred(centres0, ref)
            tol_abs = _tolerance(Xc, tol)
            best = None
            for _ in range(n_init):
                hint = [] if _local_certificate() else None  # the seeding's nearest centres (BoundedAssign.first)
                if centres0 is not None:
                    start = centres0
                else:
                    g = torch.Generator(device=Xt.device).manual_seed(int(rs.randint(np.iinfo(np.int32).max)))
                    if init == "k-means++":
                        start = kmeans_plusplus(Xc, C, w, g, debug=self.debug, hint=hint)[0]
                    else:
                        start = _random_init(Xc, C, w, g)[0]
                if self.verbose:
                    print("Initialization complete")
                labels, inertia, centres, n_iter = lloyd(Xc, w, start, max_iter, tol_abs, self.verbose, self.debug,
                                                         hint[0] if hint else None)
                if best is None or (inertia < best[1] and not _same_clustering(labels, best[0], C)):
                    best = (labels, inertia, centres, n_iter)
            labels, inertia, centred_centres, n_iter = best
            centres = centred_centres + ref if shifted else centred_centres
        distinct = int(torch.bincount(labels, minlength=C).count_nonzero())
        if distinct < C:
            warnings.warn(f"Number of distinct clusters ({distinct}) found smaller than n_clusters ({C}). "
                          "Possibly due to duplicate points in X.", ConvergenceWarning, stacklevel=2)
        if was_tensor:
            self.cluster_centers_, self.labels_ = centres, labels
        else:
            self.cluster_centers_ = centres.numpy()
            self.labels_ = labels.numpy().astype(np.int32)
        self.inertia_ = inertia
        self.n_iter_ = n_iter
        self._n_features_out = C
        # predict, transform and score work about the same point, from the centres before the shift back
        self._centring = (ref, centred_centres) if shifted else None
        return self

    def fit_predict(self, X, y=None, sample_weight=None):
        """``fit(X).labels_``."""
        return self.fit(X, sample_weight=sample_weight).labels_

    # -- after fit ----------------------------------------------------------------------------------
    def _query(self, X):
        """(X, the centres), both on the centres' device and dtype and about the fit's reference point;
        X was a tensor; X's device. The centres: the fit's own before the shift back (c + s rounds c)
        while cluster_centers_ holds what the fit gave it, else cluster_centers_ - s."""
        check_is_fitted(self)
        Xt, was_tensor = self._validate(X, reset=False)
        c = self.cluster_centers_
        c = c if _is_tensor(c) else torch.from_numpy(np.ascontiguousarray(c))
        Xq = Xt.to(device=c.device, dtype=c.dtype)
        if getattr(self, "_centring", None) is not None:
            ref, cc = (t.to(device=c.device, dtype=c.dtype) for t in self._centring)
            with torch.no_grad():
                Xq = centred(Xq, ref)
                c = cc if cc.shape == c.shape and torch.equal(cc + ref, c) else centred(c, ref)
        return Xq, c, was_tensor, Xt.device

    def predict(self, X, sample_weight=None):
        """The nearest centre of each point (int32 for numpy, int64 tensors for tensors)."""
        Xq, c, was_tensor, dev = self._query(X)
        with torch.no_grad():
            labels, _ = _assign(Xq, c, self.debug)
        return labels.to(dev) if was_tensor else labels.cpu().numpy().astype(np.int32)

    def transform(self, X):
        """Euclidean distances (n_samples, n_clusters) to the centres, in the centres' dtype."""
        from .ops.distance import cdist

        Xq, c, was_tensor, dev = self._query(X)
        with torch.no_grad():
            out = cdist(Xq, c, compute_mode=_DIRECT, debug=self.debug)
        return out.to(dev) if was_tensor else out.cpu().numpy()

    def fit_transform(self, X, y=None, sample_weight=None):
        """``fit(X).transform(X)``."""
        return self.fit(X, sample_weight=sample_weight).transform(X)

    def score(self, X, y=None, sample_weight=None):
        """Minus the (weighted) sum of squared distances of X to the nearest centre."""
        Xq, c, _, _ = self._query(X)
        w = self._sample_weight(sample_weight, Xq)
        with torch.no_grad():
            _, d2 = _assign(Xq, c, self.debug)
        return -_inertia(d2, w)

    def get_feature_names_out(self, input_features=None):
        """Names of transform's columns: "kmeans0", "kmeans1", ... (scikit-learn's)."""
        check_is_fitted(self, "_n_features_out")
        return np.asarray([f"{type(self).__name__.lower()}{i}" for i in range(self._n_features_out)], dtype=object)

    if HAVE_SKLEARN:
        def __sklearn_tags__(self):
            tags = super().__sklearn_tags__()
            tags.input_tags.sparse = False
            return tags
