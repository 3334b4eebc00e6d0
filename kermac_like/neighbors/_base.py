"""What the neighbour estimators share: the metrics, the input checks, the fit of the points and
the (collective) search over :func:`kermac_like.knn` (the package's docstring)."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .._args import all_finite
from .._estimator import HAVE_SKLEARN, BaseEstimator, check_count, check_is_fitted, check_n_features
from ..distributed import Comm
from ..ops.knn import knn, merge_order

# metric name -> p (None: the estimator's p)
METRICS = {"minkowski": None, "euclidean": 2.0, "l2": 2.0, "manhattan": 1.0, "cityblock": 1.0, "l1": 1.0,
           "chebyshev": math.inf, "infinity": math.inf}
_EFFECTIVE = {2.0: "euclidean", 1.0: "manhattan", math.inf: "chebyshev"}


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
    every rank (:meth:`Comm.raise_collectively`)."""
    err, res, meta = None, None, None
    try:
        res, meta = fn()
    except (TypeError, ValueError) as e:
        err = (type(e), str(e))
    return res, comm.raise_collectively(err, meta)


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

    # -- input conversion -------------------------------------------------------------------------
    def _validate(self, X, y=None, *, reset: bool, y_numeric: bool = False, min_samples: int = 1):
        """(X tensor, y array/tensor or None, X was a tensor). numpy/lists through scikit-learn's
        validate_data (n_features_in_, feature names, its messages); tensors here. ``min_samples=0``:
        a rank's shard of a sharded fit may be empty (the total is checked in ``_fit_points``)."""
        if torch.is_tensor(X):
            Xt = _tensor_X("X", X, min_samples=min_samples)
            check_n_features(self, Xt.shape[1], reset=reset, forget_names=True)
            if y is not None:
                if not torch.is_tensor(y):
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
                    y = y.cpu().numpy() if torch.is_tensor(y) else np.asarray(y)
                    if y.shape[0] != 0:
                        raise ValueError(f"y: has {y.shape[0]} rows but X has 0")
            else:
                Xa, y = validate_data(self, X, y.cpu().numpy() if torch.is_tensor(y) else y, reset=reset,
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
    def _check_fit(self, X, y, comm: Comm, *, supervised: bool, **validate) -> tuple:
        """The parameters checked, then fit's X (and y) validated: (X tensor, y, X was a tensor); a rank's
        shard may be empty under a process group."""
        check_count("n_neighbors", self.n_neighbors)
        self._effective_p()
        if supervised:
            _check_weights(self.weights)
            if y is None:
                raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        return self._validate(X, y, reset=True, min_samples=0 if comm.active else 1, **validate)

    def _fit_points(self, Xt: torch.Tensor, comm: Comm, was_tensor: bool) -> None:
        self._fit_np = not was_tensor
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
            k = check_count("n_neighbors", self.n_neighbors if n_neighbors is None else n_neighbors)
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


class _KNeighborsSupervised(_KNeighborsBase):
    """The parameters of the classifier and the regressor."""

    def __init__(self, n_neighbors=5, *, weights="uniform", p=2, metric="minkowski", debug=False):
        self.n_neighbors = n_neighbors
        self.weights = weights
        self.p = p
        self.metric = metric
        self.debug = debug


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
