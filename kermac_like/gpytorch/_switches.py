"""The GPyTorch kernels' switches (kermac_like.config, read at each use): ``KERMAC_LIKE_GP_<NAME>=0`` restores
linear_operator's own path for one piece (TC: the CG products on tensor cores; CG: the solves' linear_cg without
host waits; SYMGRAD: the training backward in one contraction pass; GRAPH: the pivoted-Cholesky loop as a CUDA
graph; DENSE: the CPU products on a kernel matrix formed once per operator)."""

from .. import config

__all__ = ["on"]


def on(name: str) -> bool:
    """Whether the setting ``gp_<name>`` (``KERMAC_LIKE_GP_<NAME>``) is on."""
    return config.get("gp_" + name.lower())
