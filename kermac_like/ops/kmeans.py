"""The k-means kernels of :class:`kermac_like.cluster.KMeans` (cuda_templates/kmeans.cuh,
kmeans_assign_mma.cuh): each function checks its arguments once, then runs plan.kmeans' plan, or returns
None where the fused kernels do not serve the call (the estimator then takes its torch path, the same
algorithm; plan.kmeans says which calls they serve).

* :func:`seed_plusplus`: a k-means++ seeding from pre-drawn uniforms ``(n_clusters, 2 SEED_TRIALS + 1)``;
* :func:`segment_sums`: Lloyd's update, the points summed by label from a stable sort of the labels;
* :func:`assign`: Lloyd's assignment on tensor cores (knn(X, centres, 1)'s labels and distances, bitwise);
* :func:`bounded_assign`: the pruned assignments of one Lloyd run (plan.kmeans.BoundedAssign).

SAMPLE_BLOCK, SEED_ROUND, SEED_TRIALS: the seeding kernels' points per sampler block, centres per round
and proposals per centre, which the torch path shares so that both draw the same centres from the same
uniforms.
"""

from __future__ import annotations

import torch

from ..plan import kmeans as plan_kmeans
from ..runtime.specs.kmeans import BLOCK_M as SAMPLE_BLOCK, ROUND as SEED_ROUND, TRIALS as SEED_TRIALS

__all__ = ["seed_plusplus", "segment_sums", "assign", "bounded_assign", "SAMPLE_BLOCK", "SEED_ROUND", "SEED_TRIALS"]


def _on_cuda(X: torch.Tensor, **tensors) -> bool:
    """Whether X (a 2-D tensor) is a CUDA tensor, after checking that ``tensors`` (None or on X's device) are
    where X is: ValueError naming the argument."""
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise ValueError(f"X: expected a 2-D tensor (n_samples, n_features), got {getattr(X, 'shape', X)!r}")
    for name, t in tensors.items():
        if t is not None and t.device != X.device:
            raise ValueError(f"{name}: on {t.device}, X on {X.device}")
    return X.is_cuda


def seed_plusplus(X: torch.Tensor, n_clusters: int, weights: torch.Tensor | None, u: torch.Tensor, *,
                  debug: bool = False, hint: list | None = None):
    """(centres (C, K) in X's dtype, indices (C,) int64) of the fused k-means++ seeding, or None
    (plan.kmeans.seed_plusplus; ``hint`` gets every point's nearest centre)."""
    if not _on_cuda(X, weights=weights, u=u):
        return None
    return plan_kmeans.seed_plusplus(X, n_clusters, weights, u, debug=debug, hint=hint)


def segment_sums(X: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor, weights: torch.Tensor | None,
                 n_clusters: int, *, debug: bool = False):
    """(sums (C, K) float64, weight per cluster (C,) float64) of the points by label from a stable sort of
    the labels (``perm`` (N,)) and the clusters' row ranges in it (``bounds`` (C + 1,)), or None."""
    if not _on_cuda(X, perm=perm, bounds=bounds, weights=weights):
        return None
    return plan_kmeans.segment_sums_fused(X, perm, bounds, weights, n_clusters, debug)


def assign(X: torch.Tensor, centres: torch.Tensor, *, debug: bool = False):
    """(labels (N,) int64, dist (N,) float32) of the tensor-core assignment where it is the faster one, or
    None (knn's argmin then)."""
    if not _on_cuda(X, centres=centres):
        return None
    return plan_kmeans.assign_mma(X, centres, debug)


def bounded_assign(X: torch.Tensor, n_clusters: int, *, debug: bool = False):
    """A plan.kmeans.BoundedAssign for the Lloyd iterations on X where the pruned assignments serve
    (plan.kmeans.bounds_serve), else None."""
    if not (_on_cuda(X) and plan_kmeans.bounds_serve(X, n_clusters)):
        return None
    return plan_kmeans.BoundedAssign(X, n_clusters, debug)
