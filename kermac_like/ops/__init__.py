"""The public ops, each a thin layer over the planner: validate the arguments (nothing is
written before every check passes), then run the plan :mod:`kermac_like.plan` makes.

* ``distance``: :func:`cdist`, :func:`run_kernel` (gradients: ``distance_backward``)
* ``knn``: :func:`kernel_topk`, :func:`knn` (k nearest neighbours; the fused planner is
  :mod:`kermac_like.plan_topk`)
* ``grad``: :func:`cdist_grad`
* ``linalg``: batched cuSOLVER solves and eigendecomposition
"""
