"""The public ops, each a thin layer over the planner: validate the arguments (nothing is
written before every check passes), then run the plan :mod:`kermac_like.plan` makes.

* ``distance``: :func:`cdist`, :func:`run_kernel` (gradients: ``distance_backward``)
* ``grad``: :func:`cdist_grad`
* ``linalg``: batched cuSOLVER solves and eigendecomposition
"""
