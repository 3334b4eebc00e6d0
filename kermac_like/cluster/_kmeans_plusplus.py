"""k-means++ seeding of :class:`kermac_like.cluster.KMeans` (:func:`kmeans_plusplus`: D^2 sampling in
rounds, exactly, on CUDA by the fused kernels of cuda_templates/kmeans.cuh, elsewhere by torch ops from the
same uniforms) and the "random" initialisation (:func:`_random_init`)."""

from __future__ import annotations

import torch

from ..ops.kmeans import SAMPLE_BLOCK, SEED_ROUND, SEED_TRIALS, seed_plusplus
from ._lloyd import _block_rows

__all__ = ["kmeans_plusplus", "seed_uniforms", "SAMPLE_BLOCK", "SEED_ROUND", "SEED_TRIALS"]


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
    the seeding last folded it (the first Lloyd assignment's row order: plan.kmeans.BoundedAssign).

    >>> import torch
    >>> from kermac_like.cluster import kmeans_plusplus
    >>> X = torch.tensor([[0.0, 0.0], [0.0, 1.0], [10.0, 10.0], [10.0, 11.0]])
    >>> centres, indices = kmeans_plusplus(X, 2, None, torch.Generator().manual_seed(0))
    >>> centres.shape, indices.dtype
    (torch.Size([2, 2]), torch.int64)
    """
    u = seed_uniforms(n_clusters, generator, X.device)
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
