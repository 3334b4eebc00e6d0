"""scikit-learn's nearest-neighbour estimators on :func:`kermac_like.knn`:
:class:`NearestNeighbors`, :class:`KNeighborsClassifier`, :class:`KNeighborsRegressor`.

They follow scikit-learn's brute-force estimators (``algorithm="brute"``): the same
parameters where they make sense (``n_neighbors``, ``weights``, ``p``, ``metric`` for the
Minkowski family), the same results up to the order of exactly tied neighbours (here the
smaller training index comes first), the same errors. numpy in, numpy out (distances
float64, indices int64, as scikit-learn); torch tensors in, tensors out on their device, the
search on the device of the training data (the fused GPU kernels for CUDA tensors).

Under torch.distributed (a process group initialised before ``fit``, as for
:class:`kermac_like.solvers.KernelRidge`) each rank passes its own shard of the training set
to ``fit``; ``kneighbors``, ``predict``, ``predict_proba`` and ``score`` are collective: every
rank passes the same X and receives the global k nearest neighbours, with global indices
(the shards concatenated in rank order), the same result as one process. Ranks exchange
only their (M x k) candidates (all_gather; with the neighbours' targets for predict) and
merge them with the package's (distance, index) order.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ._args import all_finite
from ._estimator import (HAVE_SKLEARN, BaseEstimator, ClassifierMixin, RegressorMixin, check_is_fitted,
                         check_n_features)
from .ops.knn import knn, merge_order
from .solvers._dist import Comm

__all__ = ["NearestNeighbors", "KNeighborsClassifier", "KNeighborsRegressor"]

# metric name -> p (None: the estimator's p)
METRICS = {"minkowski": None, "euclidean": 2.0, "l2": 2.0, "manhattan": 1.0, "cityblock": 1.0, "l1": 1.0,
           "chebyshev": math.inf, "infinity": math.inf}
_EFFECTIVE = {2.0: "euclidean", 1.0: "manhattan", math.inf: "chebyshev"}


def _is_tensor(a) -> bool:
    return isinstance(a, torch.Tensor)


def _tensor_X(name: str, X: torch.Tensor, *, min_samples: int = 1) -> torch.Tensor:
    if X.dim() != 2:
        raise ValueError(f"Expected 2D array, got {X.dim()}D tensor instead ({name} of shape {tuple(X.shape)})")
    if X.is_complex() or X.dtype == torch.bool:
        raise ValueError(f"{name}: expected a real-valued tensor, got {X.dtype}")
    if not X.is_floating_point():
        X = X.to(torch.float64)
    if X.shape[0] < min_samples:
        raise ValueError(f"Found array with 0 sample(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if not all_finite(X):
        raise ValueError(f"Input {name} contains NaN or infinity.")
    return X


def _collectively(comm: Comm, fn):
    """``fn()``'s (result, meta) on this rank and every rank's meta, after its checks ran on
    every rank: a TypeError/ValueError of any rank is raised on all of them (nobody is left
    waiting in a collective that another rank never enters)."""
    err, res, meta = None, None, None
    try:
        res, meta = fn()
    except (TypeError, ValueError) as e:
        err = e
    if not comm.active:
        if err is not None:
            raise err
        return res, [meta]
    everyone = comm.all_gather_object((None if err is None else (type(err), str(err)), meta))
    for r, (e, _) in enumerate(everyone):
        if e is not None:
            raise e[0](f"{e[1]} (on rank {r})")
    return res, [m for _, m in everyone]


class _KNeighborsBase(BaseEstimator):
    """What the three estimators share: parameters, fit of the points, the (collective) search."""

    # -- parameters -------------------------------------------------------------------------------
    def _effective_p(self) -> float:
        if not isinstance(self.metric, str) or self.metric not in METRICS:
            raise ValueError(f"metric: {self.metric!r} is not supported (valid: {', '.join(METRICS)}); "
                             "the Minkowski family only")
        p = METRICS[self.metric]
        if p is None:
            p = self.p
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or math.isnan(p) or not p > 0:
                raise ValueError(f"p: expected a real number > 0 (or inf), got {p!r}")
            p = float(p)
        return p

    def _check_n_neighbors(self, n, name="n_neighbors") -> int:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {n!r}")
        return int(n)

    # -- input conversion -------------------------------------------------------------------------
    def _validate(self, X, y=None, *, reset: bool, y_numeric: bool = False, min_samples: int = 1):
        """(X tensor, y array/tensor or None, X was a tensor). numpy/lists through scikit-learn's
        validate_data (n_features_in_, feature names, its messages); tensors here. ``min_samples=0``:
        a rank's shard of a sharded fit may be empty (the total is checked in ``_fit_points``)."""
        if _is_tensor(X):
            Xt = _tensor_X("X", X, min_samples=min_samples)
            check_n_features(self, Xt.shape[1], reset=reset, forget_names=True)
            if y is not None:
                if not _is_tensor(y):
                    y = np.asarray(y)
                if y.shape[0] != Xt.shape[0]:
                    raise ValueError(f"y: has {y.shape[0]} rows but X has {Xt.shape[0]}")
            return Xt, y, True
        if HAVE_SKLEARN:
            from sklearn.utils.validation import validate_data

            if y is None or (min_samples == 0 and np.shape(X)[:1] == (0,)):
                Xa = validate_data(self, X, reset=reset, dtype=[np.float64, np.float32],
                                   ensure_min_samples=min_samples)
                if y is not None:  # an empty shard: its y (0 rows) is only checked against X's rows
                    y = y.cpu().numpy() if _is_tensor(y) else np.asarray(y)
                    if y.shape[0] != 0:
                        raise ValueError(f"y: has {y.shape[0]} rows but X has 0")
            else:
                Xa, y = validate_data(self, X, y.cpu().numpy() if _is_tensor(y) else y, reset=reset,
                                      dtype=[np.float64, np.float32], multi_output=True, y_numeric=y_numeric)
        else:
            Xa = np.asarray(X)
            if Xa.dtype not in (np.float32, np.float64):
                Xa = Xa.astype(np.float64)
            if Xa.ndim != 2:
                raise ValueError(f"Expected 2D array, got {Xa.ndim}D array instead")
            if not np.isfinite(Xa).all():
                raise ValueError("Input X contains NaN or infinity.")
            check_n_features(self, Xa.shape[1], reset=reset)
            if y is not None:
                y = np.asarray(y)
        Xa = np.ascontiguousarray(Xa)
        return torch.from_numpy(Xa if Xa.flags.writeable else Xa.copy()), y, False

    # -- fit --------------------------------------------------------------------------------------
    def _fit_points(self, Xt: torch.Tensor, comm: Comm) -> None:
        self._p = self._effective_p()
        self.effective_metric_ = _EFFECTIVE.get(self._p, "minkowski")
        self.effective_metric_params_ = {} if self.effective_metric_ != "minkowski" else {"p": self._p}
        self._fit_X = Xt
        metas = comm.all_gather_object((int(Xt.shape[0]), int(Xt.shape[1]), str(Xt.dtype)))
        for r, (n, d, dt) in enumerate(metas):
            if (d, dt) != metas[0][1:]:
                raise ValueError(f"X: rank {r} passes {d} features of {dt}, rank 0 {metas[0][1]} of {metas[0][2]} "
                                 "(every rank must pass the same columns and dtype)")
        self._counts = [m[0] for m in metas]
        self._offset = sum(self._counts[:comm.rank])
        self.n_samples_fit_ = sum(self._counts)
        if self.n_samples_fit_ == 0:  # every shard empty (a shard of its own may be, under a process group)
            raise ValueError(f"Found array with 0 sample(s) (shape={tuple(Xt.shape)}) on all {comm.size} ranks "
                             "while a minimum of 1 is required.")

    # -- the search ---------------------------------------------------------------------------------
    def _query(self, X):
        """(query tensor on the fit device/dtype, return as numpy?, result device)."""
        check_is_fitted(self)
        Xt, _, was_tensor = self._validate(X, reset=False)
        dev = Xt.device
        return Xt.to(device=self._fit_X.device, dtype=self._fit_X.dtype), not was_tensor, dev

    def _search(self, Xq: torch.Tensor, k: int, comm: Comm, payload: torch.Tensor | None = None):
        """Global (distances, indices[, payload rows]) of the k nearest fitted points (collective
        under torch.distributed; ``payload`` (n_local, C): a row per local point, returned for
        the neighbours)."""
        X = self._fit_X
        n_local = X.shape[0]
        kl = min(k, n_local)
        M = Xq.shape[0]
        with torch.no_grad():
            if kl > 0:
                d, i = knn(Xq, X, kl, p=self._p, debug=self.debug)
            else:
                d = Xq.new_empty((M, 0))
                i = torch.empty((M, 0), dtype=torch.int64, device=X.device)
        if not comm.active:
            return d, i, (None if payload is None else payload[i])
        pay = None if payload is None else payload[i]
        width = k
        pad = width - kl
        d = torch.nn.functional.pad(d, (0, pad))
        gi = torch.nn.functional.pad(i + self._offset, (0, pad))
        valid = torch.zeros((M, width), dtype=torch.uint8, device=X.device)
        valid[:, :kl] = 1
        # every rank's (M, k) candidates: rank r's rows [r M, (r + 1) M), in rank order, so
        # that the concatenation along the row keeps equal distances in increasing index order
        gd = comm.all_gather_padded(d.contiguous(), M).view(comm.size, M, width).permute(1, 0, 2).reshape(M, -1)
        gidx = comm.all_gather_padded(gi.contiguous(), M).view(comm.size, M, width).permute(1, 0, 2).reshape(M, -1)
        gval = comm.all_gather_padded(valid, M).view(comm.size, M, width).permute(1, 0, 2).reshape(M, -1).bool()
        order = merge_order(gd, gval, k, False)
        out_pay = None
        if pay is not None:
            C = pay.shape[-1]
            pay = torch.nn.functional.pad(pay, (0, 0, 0, pad))
            gp = comm.all_gather_padded(pay.reshape(M, width * C).contiguous(), M)
            gp = gp.view(comm.size, M, width, C).permute(1, 0, 2, 3).reshape(M, -1, C)
            out_pay = gp.gather(1, order.unsqueeze(-1).expand(M, k, C))
        return gd.gather(1, order), gidx.gather(1, order), out_pay

    def _all_training_points(self, comm: Comm) -> torch.Tensor:
        """The global training set (every rank's shard, in rank order)."""
        if not comm.active:
            return self._fit_X
        n_max = max(self._counts)
        xa = comm.all_gather_padded(self._fit_X.contiguous(), n_max)
        return torch.cat([xa[r * n_max:r * n_max + c] for r, c in enumerate(self._counts)])

    def _kneighbors(self, X, n_neighbors, comm: Comm, payload=None):
        """(dist, ind, payload rows, as numpy?, device) with scikit-learn's X=None rule."""
        query_is_train = X is None

        def local():
            check_is_fitted(self)
            k = self._check_n_neighbors(self.n_neighbors if n_neighbors is None else n_neighbors, "n_neighbors")
            q = None if query_is_train else self._query(X)
            m = self.n_samples_fit_ if query_is_train else q[0].shape[0]
            k1 = k + 1 if query_is_train else k
            if k1 > self.n_samples_fit_:
                rule = "n_neighbors < n_samples_fit" if query_is_train else "n_neighbors <= n_samples_fit"
                raise ValueError(f"Expected {rule}, but n_neighbors = {k}, n_samples_fit = {self.n_samples_fit_}, "
                                 f"n_samples = {m}")
            return (k1, q), m

        (k, q), rows = _collectively(comm, local)
        if any(r != rows[0] for r in rows):
            raise ValueError(f"X: ranks pass different numbers of rows {rows}; the search is collective and takes "
                             "the same X on every rank")
        if query_is_train:
            Xq, as_np, dev = self._all_training_points(comm), self._fit_np, self._fit_X.device
        else:
            Xq, as_np, dev = q
        d, i, pay = self._search(Xq, k, comm, payload)
        if query_is_train:
            # scikit-learn: drop each point itself, or the first neighbour when the point is not
            # among them (more than k duplicates of it)
            keep = i != torch.arange(i.shape[0], device=i.device).unsqueeze(1)
            drop_first = keep.all(1)
            keep[:, 0] &= ~drop_first
            n, kk = i.shape[0], k - 1
            d, i = d[keep].view(n, kk), i[keep].view(n, kk)
            if pay is not None:
                pay = pay[keep].view(n, kk, pay.shape[-1])
        return d, i, pay, as_np, dev

    def kneighbors(self, X=None, n_neighbors=None, return_distance=True):
        """The ``n_neighbors`` nearest fitted points of each row of X: ``(distances, indices)``
        ``(n_queries, n_neighbors)`` nearest first (or only the indices). X=None: every training
        point's neighbours, itself excluded. Collective under torch.distributed."""
        d, i, _, as_np, dev = self._kneighbors(X, n_neighbors, Comm())
        if as_np:
            d, i = d.cpu().numpy().astype(np.float64, copy=False), i.cpu().numpy()
        else:
            d, i = d.to(dev), i.to(dev)
        return (d, i) if return_distance else i


def _weights(d: torch.Tensor, weights) -> torch.Tensor | None:
    """scikit-learn's _get_weights on a tensor (float64): None for uniform; 1/d, rows with
    a zero distance weighting those points 1 and the others 0; or the callable's result."""
    if weights in (None, "uniform"):
        return None
    if weights == "distance":
        with np.errstate(divide="ignore"):
            w = 1.0 / d
        inf = w.isinf()
        row = inf.any(1, keepdim=True)
        return torch.where(row, inf.to(w.dtype), w)
    w = weights(d.cpu().numpy())
    return torch.as_tensor(np.asarray(w, dtype=np.float64), device=d.device)


def _check_weights(weights):
    if weights in (None, "uniform", "distance") or callable(weights):
        return weights
    raise ValueError(f"weights: {weights!r} is not 'uniform', 'distance', None or a callable")


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
            self._check_n_neighbors(self.n_neighbors)
            self._effective_p()
            return self._validate(X, reset=True, min_samples=0 if comm.active else 1), None

        (Xt, _, was_tensor), _ = _collectively(comm, local)
        self._fit_np = not was_tensor
        self._fit_points(Xt, comm)
        return self


class KNeighborsClassifier(ClassifierMixin, _KNeighborsBase):
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

    def __init__(self, n_neighbors=5, *, weights="uniform", p=2, metric="minkowski", debug=False):
        self.n_neighbors = n_neighbors
        self.weights = weights
        self.p = p
        self.metric = metric
        self.debug = debug

    def fit(self, X, y):
        comm = Comm()

        def local():
            self._check_n_neighbors(self.n_neighbors)
            self._effective_p()
            _check_weights(self.weights)
            if y is None:
                raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
            Xt, yv, was_tensor = self._validate(X, y, reset=True, min_samples=0 if comm.active else 1)
            if _is_tensor(yv):
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
        self._fit_np = not was_tensor
        if _is_tensor(y):
            self.classes_ = torch.unique(torch.cat([torch.as_tensor(c) for c in classes])).to(y.device)
            if y.dtype == torch.bool:  # (torch.searchsorted has no bool kernel: the order of False < True in uint8)
                enc = torch.searchsorted(self.classes_.to(torch.uint8), y.to(torch.uint8).contiguous())
            else:
                enc = torch.searchsorted(self.classes_, y.contiguous())
        else:
            self.classes_ = np.unique(np.concatenate(classes))
            enc = torch.from_numpy(np.searchsorted(self.classes_, y).astype(np.int64))
        self.outputs_2d_ = False
        self._fit_points(Xt, comm)
        self._y = enc.to(Xt.device)
        return self

    def _class_weights(self, X):
        """(per-class weight sums (n, n_classes) float64, as numpy?, device)."""
        check_is_fitted(self)
        comm = Comm()
        d, _, lab, as_np, dev = self._kneighbors(X, None, comm, payload=self._y.unsqueeze(1))
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


class KNeighborsRegressor(RegressorMixin, _KNeighborsBase):
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

    def __init__(self, n_neighbors=5, *, weights="uniform", p=2, metric="minkowski", debug=False):
        self.n_neighbors = n_neighbors
        self.weights = weights
        self.p = p
        self.metric = metric
        self.debug = debug

    if HAVE_SKLEARN:
        def __sklearn_tags__(self):
            tags = super().__sklearn_tags__()
            tags.target_tags.multi_output = True  # a 2-D y: one average per target
            return tags

    def fit(self, X, y):
        comm = Comm()

        def local():
            self._check_n_neighbors(self.n_neighbors)
            self._effective_p()
            _check_weights(self.weights)
            if y is None:
                raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
            return self._validate(X, y, reset=True, y_numeric=True, min_samples=0 if comm.active else 1), None

        (Xt, y, was_tensor), _ = _collectively(comm, local)
        self._fit_np = not was_tensor
        if _is_tensor(y):
            yt = y if y.is_floating_point() else y.to(torch.float64)
        else:
            yt = torch.from_numpy(np.array(y, dtype=np.float64, order="C"))
        if yt.dim() not in (1, 2):
            raise ValueError(f"y: expected shape (n_samples,) or (n_samples, n_targets), got {tuple(yt.shape)}")
        self._y_1d = yt.dim() == 1
        self._fit_points(Xt, comm)
        self._y = (yt.unsqueeze(1) if yt.dim() == 1 else yt).to(Xt.device)  # (n, C), n = 0 on an empty shard
        return self

    def predict(self, X):
        """(n,) or (n, n_targets) like the y of fit."""
        check_is_fitted(self)
        comm = Comm()
        d, _, ny, as_np, dev = self._kneighbors(X, None, comm, payload=self._y)
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
