"""scikit-learn's NearestNeighbors on :func:`kermac_like.knn`."""

from __future__ import annotations

from ..distributed import Comm
from ._base import _collectively, _KNeighborsBase


class NearestNeighbors(_KNeighborsBase):
    """Unsupervised nearest-neighbour search (scikit-learn's NearestNeighbors, brute force).

    Parameters
    ----------
    n_neighbors : int, default 5
    p : float, default 2
        The Minkowski power (any p > 0 and inf) for ``metric="minkowski"``.
    metric : str, default "minkowski"
        "minkowski" (with p), "euclidean"/"l2" (p = 2), "manhattan"/"cityblock"/"l1" (p = 1),
        "chebyshev"/"infinity" (p = inf).
    debug : bool

    Fitted attributes: ``n_features_in_``, ``n_samples_fit_`` (over all ranks),
    ``effective_metric_``, ``effective_metric_params_``.

    >>> import numpy as np
    >>> from kermac_like.neighbors import NearestNeighbors
    >>> X = np.array([[0.0], [1.0], [2.0], [10.0]])
    >>> distances, indices = NearestNeighbors(n_neighbors=2).fit(X).kneighbors([[1.2]])
    >>> distances, indices
    (array([[0.2, 0.8]]), array([[1, 2]]))
    """

    def __init__(self, n_neighbors=5, *, p=2, metric="minkowski", debug=False):
        self.n_neighbors = n_neighbors
        self.p = p
        self.metric = metric
        self.debug = debug

    def fit(self, X, y=None):
        """Store the training points (this rank's shard under torch.distributed: collective)."""
        comm = Comm()

        def local():
            return self._check_fit(X, None, comm, supervised=False), None

        (Xt, _, was_tensor), _ = _collectively(comm, local)
        self._fit_points(Xt, comm, was_tensor)
        return self
