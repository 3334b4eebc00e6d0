"""scikit-learn's KNeighborsRegressor on :func:`kermac_like.knn`."""

from __future__ import annotations

import numpy as np
import torch

from .._estimator import HAVE_SKLEARN, RegressorMixin, check_is_fitted
from ..distributed import Comm
from ._base import _collectively, _KNeighborsSupervised, _weights


class KNeighborsRegressor(RegressorMixin, _KNeighborsSupervised):
    """Average of the neighbours' targets (scikit-learn's KNeighborsRegressor, brute force):
    uniform or ``weights="distance"`` / a callable, parameters as in :class:`KNeighborsClassifier`.
    Predictions float64 for numpy targets, the targets' float dtype for tensors.

    >>> import torch
    >>> from kermac_like.neighbors import KNeighborsRegressor
    >>> X = torch.tensor([[0.0], [1.0], [2.0], [10.0]])
    >>> reg = KNeighborsRegressor(n_neighbors=2).fit(X, torch.tensor([0.0, 1.0, 2.0, 10.0]))
    >>> reg.predict(torch.tensor([[1.6]]))          # tensors in, tensors out
    tensor([1.5000])
    """

    if HAVE_SKLEARN:
        def __sklearn_tags__(self):
            tags = super().__sklearn_tags__()
            tags.target_tags.multi_output = True  # a 2-D y: one average per target
            return tags

    def fit(self, X, y):
        comm = Comm()

        def local():
            return self._check_fit(X, y, comm, supervised=True, y_numeric=True), None

        (Xt, y, was_tensor), _ = _collectively(comm, local)
        if torch.is_tensor(y):
            yt = y if y.is_floating_point() else y.to(torch.float64)
        else:
            yt = torch.from_numpy(np.array(y, dtype=np.float64, order="C"))
        if yt.dim() not in (1, 2):
            raise ValueError(f"y: expected shape (n_samples,) or (n_samples, n_targets), got {tuple(yt.shape)}")
        self._y_1d = yt.dim() == 1
        self._fit_points(Xt, comm, was_tensor)
        self._y = (yt.unsqueeze(1) if yt.dim() == 1 else yt).to(Xt.device)  # (n, C), n = 0 on an empty shard
        return self

    def predict(self, X):
        """(n,) or (n, n_targets) like the y of fit."""
        check_is_fitted(self)
        d, _, ny, as_np, dev = self._kneighbors(X, None, Comm(), payload=self._y)
        w = _weights(d.to(torch.float64), self.weights)
        ny64 = ny.to(torch.float64)
        if w is None:
            pred = ny64.mean(1)
        else:
            pred = (ny64 * w.unsqueeze(-1)).sum(1) / w.sum(1, keepdim=True)
        if self._y_1d:
            pred = pred[:, 0]
        if as_np:
            return pred.cpu().numpy()
        return pred.to(device=dev, dtype=self._y.dtype)
