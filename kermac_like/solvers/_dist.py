"""Deprecated: the communicator is :mod:`kermac_like.distributed` (this path goes in the next release)."""

import warnings

from ..distributed import Comm

__all__ = ["Comm"]

warnings.warn("kermac_like.solvers._dist is deprecated; import Comm from kermac_like.distributed",
              DeprecationWarning, stacklevel=2)
