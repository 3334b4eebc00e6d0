"""The planner of the fused top-k selection (k nearest neighbours over any descriptor).

``plan_topk(call, values, indices, debug)`` returns a :class:`kermac_like.plan.Plan` that
writes ``values`` (``call``'s out shape ``(*batch, M, k)``, x's dtype) and ``indices``
(same shape, int64), or None when no fused kernel serves the call (CPU tensors, float64,
k beyond the fused limit, GPUs before sm_80): the caller then takes the blocked path.
The fused kernels land here; until then every call takes the blocked path.
"""

from __future__ import annotations


def plan_topk(call, values, indices, debug: bool = False):
    return None
