"""scikit-learn's KNeighborsClassifier on :func:`kermac_like.knn`."""

from __future__ import annotations

import numpy as np
import torch

from .._estimator import HAVE_SKLEARN, ClassifierMixin, check_is_fitted
from ..distributed import Comm
from ._base import _collectively, _KNeighborsSupervised, _weights


class KNeighborsClassifier(ClassifierMixin, _KNeighborsSupervised):
    """k-nearest-neighbour vote (scikit-learn's KNeighborsClassifier, brute force).

    Parameters: ``n_neighbors=5``, ``weights`` ("uniform", "distance" (1 / distance; a query at
    distance 0 of training points takes only those) or a callable on the distance array),
    ``p``, ``metric``, ``debug`` as in :class:`NearestNeighbors`. Ties of the vote go to the
    smallest class. Fitted: ``classes_``, ``n_features_in_``, ``n_samples_fit_``,
    ``effective_metric_``, ``outputs_2d_`` (False: one target).

    >>> import numpy as np
    >>> from kermac_like.neighbors import KNeighborsClassifier
    >>> X = np.array([[0.0], [1.0], [2.0], [10.0]])
    >>> clf = KNeighborsClassifier(n_neighbors=3).fit(X, [0, 0, 1, 1])
    >>> clf.predict([[0.4], [9.0]])
    array([0, 1])
    >>> clf.predict_proba([[0.4]])
    array([[0.66666667, 0.33333333]])
    """

    def fit(self, X, y):
        comm = Comm()

        def local():
            Xt, yv, was_tensor = self._check_fit(X, y, comm, supervised=True)
            if torch.is_tensor(yv):
                if yv.dim() == 2 and yv.shape[1] == 1:
                    yv = yv[:, 0]
                if yv.dim() != 1:
                    raise ValueError(f"y: expected shape (n_samples,), got {tuple(yv.shape)}")
                return (Xt, yv, was_tensor), torch.unique(yv).cpu()
            if HAVE_SKLEARN:
                from sklearn.utils.multiclass import check_classification_targets
                from sklearn.utils.validation import column_or_1d

                yv = column_or_1d(yv, warn=True)
                check_classification_targets(yv)
            else:
                yv = np.asarray(yv).reshape(-1) if np.ndim(yv) == 2 and np.shape(yv)[1] == 1 else np.asarray(yv)
            return (Xt, yv, was_tensor), np.unique(yv)

        (Xt, y, was_tensor), classes = _collectively(comm, local)
        if torch.is_tensor(y):
            self.classes_ = torch.unique(torch.cat([torch.as_tensor(c) for c in classes])).to(y.device)
            if y.dtype == torch.bool:  # (torch.searchsorted has no bool kernel: the order of False < True in uint8)
                enc = torch.searchsorted(self.classes_.to(torch.uint8), y.to(torch.uint8).contiguous())
            else:
                enc = torch.searchsorted(self.classes_, y.contiguous())
        else:
            self.classes_ = np.unique(np.concatenate(classes))
            enc = torch.from_numpy(np.searchsorted(self.classes_, y).astype(np.int64))
        self.outputs_2d_ = False
        self._fit_points(Xt, comm, was_tensor)
        self._y = enc.to(Xt.device)
        return self

    def _class_weights(self, X):
        """(per-class weight sums (n, n_classes) float64, as numpy?, device)."""
        check_is_fitted(self)
        d, _, lab, as_np, dev = self._kneighbors(X, None, Comm(), payload=self._y.unsqueeze(1))
        lab = lab[..., 0]
        w = _weights(d.to(torch.float64), self.weights)
        if w is None:
            w = torch.ones(lab.shape, dtype=torch.float64, device=lab.device)
        sums = torch.zeros((lab.shape[0], len(self.classes_)), dtype=torch.float64, device=lab.device)
        sums.scatter_add_(1, lab, w)
        return sums, as_np, dev

    def predict_proba(self, X):
        """Class probabilities (n, n_classes) float64: the neighbours' (weighted) share per class."""
        sums, as_np, dev = self._class_weights(X)
        norm = sums.sum(1, keepdim=True)
        proba = sums / torch.where(norm == 0, torch.ones_like(norm), norm)
        return proba.cpu().numpy() if as_np else proba.to(dev)

    def predict(self, X):
        """The class of the largest (weighted) vote, the smallest class among equal votes."""
        sums, as_np, dev = self._class_weights(X)
        best = sums.argmax(1)
        if isinstance(self.classes_, np.ndarray):
            out = self.classes_[best.cpu().numpy()]
            return out if as_np else torch.as_tensor(out, device=dev) if out.dtype.kind in "biuf" else out
        out = self.classes_[best.to(self.classes_.device)]
        return out.cpu().numpy() if as_np else out.to(dev)
