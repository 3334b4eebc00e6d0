"""The GPyTorch kernels' switches, read from the environment at each use: ``KERMAC_LIKE_GP_<NAME>=0`` restores
linear_operator's own path for one piece (TC: the CG products on tensor cores; CG: the solves' linear_cg without
host waits; SYMGRAD: the training backward in one contraction pass; GRAPH: the pivoted-Cholesky loop as a CUDA
graph). Anything else, or unset, keeps the package's."""

import os

__all__ = ["on"]


def on(name: str) -> bool:
    """Whether ``KERMAC_LIKE_GP_<name>`` is not "0"."""
    return os.environ.get(f"KERMAC_LIKE_GP_{name}", "1") != "0"
