"""Recursive Feature Machines as scikit-learn estimators: :class:`RFMRegressor`, :class:`RFMClassifier`.

One RFM iteration (Radhakrishnan et al., Science 2024; xRFM's leaf model):

1. u = x S                      the transform S = M^power folded into the data once
2. (K(u, u) + reg I) c = y      Cholesky, or Falkon beyond the size that fits
3. G = sum_j,o grad f_o grad f_o^T at the AGOP's points (all training rows, or a sample)
4. M = S G S / max|S G S|       the AGOP in the input space, scaled as xRFM scales it
   S = M^power                  (power 1/2: the kernel's metric S^2 is the AGOP)

``iters`` updates of M, ``iters + 1`` kernel machines; with an ``eval_set`` the best of them on
its metric is kept (xRFM's return_best_params) and the loop stops early once the metric is worse
than ``early_stop_multiplier`` times the best.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from .. import _debug
from .._args import all_finite
from .._estimator import (BaseEstimator, ClassifierMixin, MultiOutputMixin, RegressorMixin, check_feature_names,
                          check_is_fitted, check_seed)
from ..ops.distance import cdist
from ..solvers._nystrom import sample_indices
from ..solvers.kernel_ridge import _Progress, _as_tensor, _free_bytes, _shape_2d
from ._agop import AGOP_BLOCK_BYTES, agop_sum
from ._kernel import resolve_rfm_kernel
from ._solve import solve_cholesky, solve_nystrom

log = logging.getLogger("kermac_like.rfm")

__all__ = ["RFMRegressor", "RFMClassifier"]

SOLVERS = ("auto", "cholesky", "nystrom")
# auto takes cholesky while the n x n matrix needs at most this fraction of the free memory
CHOLESKY_MEMORY_FRACTION = 0.25
MEDIAN_ROWS = 2000  # rows of the sample of the median heuristic
DEFAULT_CENTERS = 20000

_MINIMISE = {"mse": True, "mae": True, "brier": True, "logloss": True, "accuracy": False}


def _number(name, v, *, lo=None, lo_open=False, allow_none=False, integer=False):
    if v is None and allow_none:
        return None
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(float(v)):
        raise ValueError(f"{name}: expected a{'n integer' if integer else ' finite number'}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name}: expected a value {'>' if lo_open else '>='} {lo}, got {v!r}")
    return v


class _RFMBase(BaseEstimator):
    _metrics = ("mse",)

    def __init__(self, kernel="laplace_l2", *, bandwidth=10.0, exponent=1.0, norm_p=2.0, bandwidth_mode="constant",
                 reg=1e-3, iters=5, diag=False, power=0.5, normalize="max", center_grads=False,
                 agop_samples=20000, solver="auto", n_centers=None, tol=1e-6, max_iter=None,
                 early_stop_multiplier=1.1, tuning_metric=None, random_state=None, device=None,
                 verbose=False, debug=False):
        self.kernel = kernel
        self.bandwidth = bandwidth
        self.exponent = exponent
        self.norm_p = norm_p
        self.bandwidth_mode = bandwidth_mode
        self.reg = reg
        self.iters = iters
        self.diag = diag
        self.power = power
        self.normalize = normalize
        self.center_grads = center_grads
        self.agop_samples = agop_samples
        self.solver = solver
        self.n_centers = n_centers
        self.tol = tol
        self.max_iter = max_iter
        self.early_stop_multiplier = early_stop_multiplier
        self.tuning_metric = tuning_metric
        self.random_state = random_state
        self.device = device
        self.verbose = verbose
        self.debug = debug

    # -- parameters -------------------------------------------------------------------------------
    def _check_params(self):
        kern = resolve_rfm_kernel(self.kernel, self.exponent, self.norm_p)
        _number("bandwidth", self.bandwidth, lo=0, lo_open=True)
        if self.bandwidth_mode not in ("constant", "median"):
            raise ValueError(f"bandwidth_mode: expected 'constant' or 'median', got {self.bandwidth_mode!r}")
        _number("reg", self.reg, lo=0)
        _number("iters", self.iters, lo=0, integer=True)
        if not isinstance(self.diag, (bool, np.bool_)):
            raise ValueError(f"diag: expected True or False, got {self.diag!r}")
        _number("power", self.power, lo=0, lo_open=True)
        if self.normalize not in ("max", "trace", None):
            raise ValueError(f"normalize: expected 'max', 'trace' or None, got {self.normalize!r}")
        _number("agop_samples", self.agop_samples, lo=1, integer=True)
        if self.solver not in SOLVERS:
            raise ValueError(f"solver: {self.solver!r} is not one of {SOLVERS}")
        _number("n_centers", self.n_centers, lo=1, integer=True, allow_none=True)
        _number("tol", self.tol, lo=0, lo_open=True)
        _number("max_iter", self.max_iter, lo=1, integer=True, allow_none=True)
        _number("early_stop_multiplier", self.early_stop_multiplier, lo=1, allow_none=True)
        metric = self._metrics[0] if self.tuning_metric is None else self.tuning_metric
        if metric not in self._metrics:
            raise ValueError(f"tuning_metric: {metric!r} is not one of {self._metrics}")
        check_seed(self.random_state)
        if self.solver == "nystrom" and not self.reg > 0:
            raise ValueError(f"reg: the nystrom solver needs reg > 0, got {self.reg!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device: {self.device!r} is not a torch device ({e})") from None
        return kern, metric

    # -- data ---------------------------------------------------------------------------------------
    def _X(self, name, X, *, fit):
        Xt, was_np = _as_tensor(name, X)
        _shape_2d(name, Xt, None if fit else self.n_features_in_, type(self).__name__)
        if fit and Xt.shape[0] == 0:
            raise ValueError(f"{name}: found 0 sample(s) (shape={tuple(Xt.shape)}) while a minimum of 1 is required.")
        return Xt, was_np

    def _to_compute(self, name, Xt):
        Xc = Xt.to(device=self._device, dtype=self._dtype)
        if not all_finite(Xc):
            raise ValueError(f"{name}: contains NaN or infinity")
        return Xc

    def _compute_device(self, data_device):
        if self.device is None:
            return data_device
        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _transform(self, x, s):
        return x * s if s.dim() == 1 else x @ s

    # -- the RFM loop -------------------------------------------------------------------------------
    def _fit(self, X, Y, eval_set):
        """X (n, D), Y (n, C) targets on the compute device; eval_set (Xv, targets for the metric) or None."""
        debug = _debug.resolve(self.debug)
        kern, metric = self._kern, self._metric
        n, D = X.shape
        dt, dev = X.dtype, X.device
        reg = float(self.reg)
        if reg == 0 and torch.unique(X, dim=0).shape[0] < n:
            raise ValueError("reg: reg = 0 with duplicate rows in X makes the kernel matrix singular; pass reg > 0")
        seed = int(self.random_state) if self.random_state is not None else int(np.random.randint(0, 2**31 - 1))
        solver = self.solver
        if solver == "auto":
            fits = n * n * X.element_size() <= CHOLESKY_MEMORY_FRACTION * _free_bytes(dev)
            solver = "cholesky" if fits or not reg > 0 else "nystrom"
        m_centres = min(n, DEFAULT_CENTERS if self.n_centers is None else int(self.n_centers))
        agop_rows = sample_indices(n, int(self.agop_samples), seed + 1).to(dev) if n > self.agop_samples else None
        median_rows = sample_indices(n, MEDIAN_ROWS, seed + 2).to(dev) if n > MEDIAN_ROWS else None
        minimise = _MINIMISE[metric]

        s = torch.ones(D, dtype=dt, device=dev) if self.diag else torch.eye(D, dtype=dt, device=dev)
        M = s.clone()
        history, best = [], None
        self.n_iter_ = 0
        progress = _Progress(bool(self.verbose or debug), int(self.iters) + 1, type(self).__name__)
        bar = progress.bar
        if debug:
            log.debug("%s: n=%d D=%d outputs=%d on %s (%s), solver %s, %s kernel, %d iterations", type(self).__name__,
                      n, D, Y.shape[1], dev, dt, solver, kern.name, int(self.iters))
        try:
            for it in range(int(self.iters) + 1):
                t0 = time.perf_counter()
                u = self._transform(X, s)
                bw = float(self.bandwidth)
                if self.bandwidth_mode == "median":
                    bw *= _median_distance(u if median_rows is None else u[median_rows], kern.p)
                sk = kern.solver_kernel(bw)
                if solver == "cholesky":
                    machine = solve_cholesky(sk, u, Y, reg)
                else:
                    machine = solve_nystrom(sk, u, Y, reg, n_centers=m_centres, seed=seed, tol=self.tol,
                                            max_iter=self.max_iter, verbose=False, debug=debug)
                score = None
                if eval_set is not None:
                    pred = sk.matvec(self._transform(eval_set[0], s), machine.centres, machine.coef)
                    score = self._score_metric(pred, eval_set[1], metric)
                if best is None or (score is not None and (score < best["score"] if minimise else score > best["score"])) \
                        or eval_set is None:
                    best = dict(score=score, iter=it, s=s, M=M, bw=bw, machine=machine)
                stop = (eval_set is not None and self.early_stop_multiplier is not None and it > 0 and
                        (score > best["score"] * self.early_stop_multiplier if minimise
                         else score < best["score"] / self.early_stop_multiplier))
                if not stop and it < int(self.iters):
                    v = u if agop_rows is None else u[agop_rows]
                    g = agop_sum(kern, bw, machine.centres, machine.coef, v, diag=bool(self.diag),
                                 center=bool(self.center_grads), block_bytes=AGOP_BLOCK_BYTES)
                    M, s = self._metric_update(g, s)
                    self.n_iter_ += 1
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                history.append(dict(iter=it, metric=score, seconds=time.perf_counter() - t0, bandwidth=bw))
                if debug:
                    log.debug("rfm iteration %d: bandwidth %.4g, %s solve, %s %s, %s, %.3f s", it, bw, solver, metric,
                              "-" if score is None else f"{score:.4g}",
                              "stop" if stop else "last" if it == int(self.iters) else "AGOP and metric update",
                              history[-1]["seconds"])
                if bar is not None:
                    bar.update(1)
                    if score is not None:
                        bar.set_postfix_str(f"{metric} {score:.4g}")
                if stop:
                    break
        finally:
            progress.close()
        self.solver_ = solver
        self.history_ = history
        self.best_iter_ = best["iter"]
        self.bandwidth_ = best["bw"]
        self._s, self._M, self._machine = best["s"], best["M"], best["machine"]
        self._solver_kernel = kern.solver_kernel(best["bw"])

    def _metric_update(self, g_u: torch.Tensor, s: torch.Tensor):
        """The AGOP in the transformed space -> (M, S): M = S G S scaled, S = M^power (float64 maths)."""
        s64 = s.to(torch.float64)
        if self.diag:
            m = g_u * s64.square()
        else:
            m = s64 @ g_u @ s64
            m = (m + m.T) / 2
        if self.normalize == "max":
            m = m / (m.max() + 1e-30)
        elif self.normalize == "trace":
            tr = m.sum() if self.diag else m.diagonal().sum()
            m = m * (m.shape[0] / tr) if tr > 0 else m
        if not bool(torch.isfinite(m).all()):
            raise FloatingPointError("the AGOP is not finite (gradients overflowed); lower the bandwidth's range "
                                     "or increase reg")
        power = float(self.power)
        if self.diag:
            new_s = m.clamp_min(0).pow(power)
        else:
            w, q = torch.linalg.eigh(m)
            new_s = (q * w.clamp_min(0).pow(power)) @ q.T
        return m.to(s.dtype), new_s.to(s.dtype)

    # -- prediction ---------------------------------------------------------------------------------
    def _raw_predict(self, X):
        check_is_fitted(self, "dual_coef_")
        check_feature_names(self, X, reset=False)
        Xt, was_np = self._X("X", X, fit=False)
        src = Xt.device
        Xc = self._to_compute("X", Xt)
        with torch.no_grad():
            out = self._solver_kernel.matvec(self._transform(Xc, self._s), self._machine.centres, self._machine.coef)
        return out, was_np, src

    def _publish(self, X_fit, was_np, src):
        """The fitted attributes in the input's kind: numpy for numpy input, tensors on its device."""
        def out(t):
            return t.detach().cpu().numpy() if was_np else t.to(src)

        mach = self._machine
        self.M_ = out(self._M)
        self.sqrtM_ = out(self._s)
        self.dual_coef_ = out(mach.coef)
        self.X_fit_ = out(X_fit if mach.rows is None else X_fit[mach.rows])

    def _fit_data(self, X, y, eval_set):
        """Validate everything, run the loop on the compute device, publish the fitted attributes."""
        for name in ("M_", "sqrtM_", "dual_coef_", "X_fit_", "history_", "best_iter_", "n_iter_"):
            self.__dict__.pop(name, None)
        self._kern, self._metric = self._check_params()
        Xt, was_np = self._X("X", X, fit=True)
        if y is None:
            raise ValueError(f"y: {type(self).__name__} requires y to be passed, but the target y is None")
        dev = self._compute_device(Xt.device)
        self._device = dev
        # the fused kernels are float32; on a CPU the data's own floating dtype (numpy: float64)
        self._dtype = torch.float32 if dev.type == "cuda" else Xt.dtype
        Xc = self._to_compute("X", Xt)
        Y = self._targets(y, Xt.shape[0])  # (n, C) in the compute dtype, on the device
        self.n_features_in_ = int(Xt.shape[1])
        ev = None
        if eval_set is not None:
            if isinstance(eval_set, list) and len(eval_set) == 1:
                eval_set = eval_set[0]
            if not (isinstance(eval_set, tuple) and len(eval_set) == 2):
                raise ValueError("eval_set: expected a pair (X_val, y_val) (or a list holding one pair)")
            Xv, _ = self._X("eval_set", eval_set[0], fit=False)
            if Xv.shape[0] == 0:
                raise ValueError("eval_set: X_val has 0 rows")
            ev = (self._to_compute("eval_set", Xv), self._eval_targets(eval_set[1], Xv.shape[0]))
        check_feature_names(self, X, reset=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            self._fit(Xc, Y, ev)
        self.fit_time_ = time.perf_counter() - t0
        self._publish(Xc, was_np, Xt.device)
        return self


def _y_tensor(name, y, device, n):
    yt, _ = _as_tensor(name, y, device=device)
    if yt.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape (n_samples,) or (n_samples, n_targets), got {tuple(yt.shape)}")
    if yt.shape[0] != n:
        raise ValueError(f"{name}: has {yt.shape[0]} rows but X has {n}")
    if not all_finite(yt):
        raise ValueError(f"{name}: contains NaN or infinity")
    return yt


def _to_numpy(a):
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


class RFMRegressor(MultiOutputMixin, RegressorMixin, _RFMBase):
    """A Recursive Feature Machine for regression, on the package's fused kernels.

    A scikit-learn estimator (BaseEstimator + mixins; ``check_estimator`` passes): numpy in, numpy
    out; a tensor in, a tensor out on its device. The computations run on ``device`` (default:
    X's), in float32 on a GPU (the fused kernels) and in the data's floating dtype on a CPU.

    Parameters
    ----------
    kernel : str or KernelDescriptor, default "laplace_l2"
        ``laplace_l2`` (xRFM's ``l2``) exp(-(||x - z||_2 / L)^exponent); ``product_laplace``
        (``l1``) exp(-sum_k |x_k - z_k|^exponent / L^exponent); ``lpq``
        exp(-(||x - z||_norm_p / L)^exponent); ``gaussian`` exp(-||x - z||^2 / (2 L^2)); all in the
        learnt metric (x -> x S). 0 < exponent <= norm_p <= 2 (:mod:`kermac_like.rfm._kernel`).
    bandwidth : float, default 10.0
        L, or with ``bandwidth_mode="median"`` its multiple of the median distance between
        training points (transformed; on a sample of 2000 rows), recomputed every iteration.
    exponent, norm_p : float, default 1.0, 2.0
        The kernel's powers (q and p above; norm_p is read by ``lpq`` only).
    reg : float, default 1e-3
        The ridge: (K + reg I) c = y.
    iters : int, default 5
        Updates of the metric (iters + 1 kernel machines are fitted).
    diag : bool, default False
        Learn a diagonal M (``M_`` and ``sqrtM_`` are then vectors).
    power : float, default 0.5
        S = M^power transforms the data (xRFM's agop_power).
    normalize : {"max", "trace", None}, default "max"
        M = AGOP / max entry (xRFM), scaled to trace D, or unscaled.
    center_grads : bool, default False
        The AGOP of the gradients minus their mean (over the AGOP's points and outputs).
    agop_samples : int, default 20000
        The AGOP is taken at all training points up to this many, else at a sample of this size.
    solver : {"auto", "cholesky", "nystrom"}, default "auto"
        cholesky (exact; float32 on a GPU, redone in float64 where it breaks down) while the n x n
        matrix takes at most a quarter of the free memory under "auto", else nystrom: Falkon on
        ``n_centers`` centres (default min(n, 20000)) through :class:`kermac_like.solvers.KernelRidge`,
        its CG to ``tol`` (at most ``max_iter`` iterations).
    early_stop_multiplier : float or None, default 1.1
        With an eval_set: stop once its metric is worse than this times the best so far (None: never).
    tuning_metric : {"mse", "mae"}, default "mse"
        The eval_set's metric that picks the model kept.
    random_state : int, optional
        Seeds the samples (AGOP points, median rows, Falkon's centres).
    device : str or torch.device, optional
    verbose, debug : bool
        A tqdm bar over the iterations (when tqdm is installed); debug also logs every step.

    Memory: X and its transform (2 n D), the Cholesky matrix (n^2 in the compute dtype, factored
    in place; with nystrom, KernelRidge's bound instead), and the AGOP's O(D^2 + n B) (512 MiB of
    weights at a time, :mod:`kermac_like.rfm._agop`): the gradients (outputs x points x D) are never
    stored.

    Fitted attributes: ``M_`` (the kept model's metric: identity for iteration 0), ``sqrtM_``
    (S = M_^power), ``X_fit_`` and ``dual_coef_`` (the training rows, or Falkon's centres, and their
    coefficients: predictions are K(X S, X_fit_ S) dual_coef_), ``n_iter_`` (metric updates made),
    ``best_iter_`` (the kept model's iteration, 0..iters), ``history_`` (per iteration: ``iter``,
    the eval_set's ``metric``, ``seconds``, ``bandwidth``), ``bandwidth_``, ``solver_``,
    ``fit_time_``, ``n_features_in_``.

    Examples
    --------
    >>> import torch
    >>> from kermac_like.rfm import RFMRegressor
    >>> g = torch.Generator().manual_seed(0)
    >>> X = torch.randn(200, 5, generator=g, dtype=torch.float64)
    >>> y = X[:, 0] * X[:, 1]
    >>> model = RFMRegressor(bandwidth=5.0, iters=2).fit(X, y)
    >>> model.M_.shape, model.n_iter_
    (torch.Size([5, 5]), 2)
    >>> d = torch.diagonal(model.M_)   # the metric weighs the two features y depends on
    >>> bool(d[:2].min() > 100 * d[2:].max())
    True
    >>> model.predict(X[:3]).shape
    torch.Size([3])
    """

    _metrics = ("mse", "mae")

    def fit(self, X, y, eval_set=None):
        """Fit on (X, y): X (n, D), y (n,) or (n, C); eval_set (X_val, y_val) for early stopping."""
        self._y_1d = None
        return self._fit_data(X, y, eval_set)

    def _targets(self, y, n):
        yt = _y_tensor("y", y, self._device, n)
        self._y_1d = yt.dim() == 1
        self._out_dtype = torch.promote_types(self._in_dtype(yt), self._dtype)
        self._n_targets = 1 if self._y_1d else int(yt.shape[1])
        return (yt[:, None] if self._y_1d else yt).to(self._dtype)

    def _in_dtype(self, yt):
        return yt.dtype if yt.dtype.is_floating_point else torch.float64

    def _eval_targets(self, y, n):
        yt = _y_tensor("eval_set", y, self._device, n)
        yt = yt[:, None] if yt.dim() == 1 else yt
        if yt.shape[1] != self._n_targets:
            raise ValueError(f"eval_set: y_val has {yt.shape[1]} targets, y has {self._n_targets}")
        return yt.to(self._dtype)

    def _score_metric(self, pred, target, metric):
        if pred.shape != target.shape:
            raise ValueError(f"eval_set: y_val has shape {tuple(target.shape)}, the predictions {tuple(pred.shape)}")
        err = (pred.to(torch.float64) - target.to(torch.float64))
        return float(err.square().mean() if metric == "mse" else err.abs().mean())

    def predict(self, X):
        """K(X S, X_fit_ S) dual_coef_: (n,) or (n, C) like the y of fit."""
        out, was_np, src = self._raw_predict(X)
        out = out.to(self._out_dtype)
        if self._y_1d:
            out = out[:, 0]
        return out.cpu().numpy() if was_np else out.to(src)

    def score(self, X, y, sample_weight=None):
        """R^2 of predict(X) against y (scikit-learn's r2_score, uniform average over targets)."""
        pred = _to_numpy(self.predict(X)).astype(np.float64)
        yt = _to_numpy(y).astype(np.float64)
        if yt.shape != pred.shape:
            raise ValueError(f"y: shape {yt.shape} differs from the prediction's {pred.shape}")
        yt2, pr2 = yt.reshape(len(yt), -1), pred.reshape(len(pred), -1)
        w = np.ones(len(yt2)) if sample_weight is None else _to_numpy(sample_weight).astype(np.float64)
        w = w[:, None]
        mean = (w * yt2).sum(0) / w.sum()
        ss_res = (w * (yt2 - pr2) ** 2).sum(0)
        ss_tot = (w * (yt2 - mean) ** 2).sum(0)
        r2 = np.where(ss_tot > 0, 1 - ss_res / np.where(ss_tot > 0, ss_tot, 1), np.where(ss_res > 0, 0.0, 1.0))
        return float(r2.mean())


class RFMClassifier(ClassifierMixin, _RFMBase):
    """A Recursive Feature Machine for classification: regression on one-hot targets (one {0, 1}
    column for two classes), as xRFM's default ``zero_one`` mode.

    ``predict_proba`` clips the outputs to [1e-3, 1 - 1e-3] and normalises each row (two classes:
    (1 - f, f)), as xRFM; ``predict`` is its argmax; ``decision_function`` the outputs themselves
    (two classes: f - 1/2, positive for ``classes_[1]``). ``tuning_metric``: "brier" (default, the
    mean squared error of predict_proba against one-hot labels, xRFM's for classification),
    "accuracy" or "logloss". Every other parameter, the memory bound and the fitted attributes are
    :class:`RFMRegressor`'s, plus ``classes_``.

    Examples
    --------
    >>> import numpy as np
    >>> from kermac_like.rfm import RFMClassifier
    >>> X = np.random.default_rng(0).standard_normal((150, 4))
    >>> y = (X[:, 0] > 0).astype(int)
    >>> clf = RFMClassifier(bandwidth=5.0, iters=1).fit(X, y)
    >>> clf.classes_, clf.predict_proba(X[:2]).shape, clf.score(X, y)
    (array([0, 1]), (2, 2), 1.0)
    """

    _metrics = ("brier", "accuracy", "logloss")
    PROBA_EPS = 1e-3

    def fit(self, X, y, eval_set=None):
        """Fit on (X, y): y (n,) class labels; eval_set (X_val, y_val) for early stopping."""
        return self._fit_data(X, y, eval_set)

    def _targets(self, y, n):
        labels = y
        if isinstance(y, torch.Tensor):
            labels = y.detach().cpu().numpy()
            self._label_tensor = y.device
        else:
            self._label_tensor = None
        labels = np.asarray(labels)
        try:
            from sklearn.utils.multiclass import check_classification_targets
            from sklearn.utils.validation import column_or_1d
        except ImportError:
            if labels.ndim == 2 and labels.shape[1] == 1:
                labels = labels.ravel()
            if labels.dtype.kind == "f" and not np.all(np.isfinite(labels)):
                raise ValueError("y: contains NaN or infinity") from None
        else:
            labels = column_or_1d(labels, warn=True)
            check_classification_targets(labels)
        if labels.ndim != 1:
            raise ValueError(f"y: expected class labels of shape (n_samples,), got {labels.shape}")
        if labels.shape[0] != n:
            raise ValueError(f"y: has {labels.shape[0]} rows but X has {n}")
        classes, idx = np.unique(labels, return_inverse=True)
        if len(classes) < 2:
            raise ValueError(f"y: only one class ({classes[0]!r}) is present; RFMClassifier needs at least two classes")
        self.classes_ = classes if self._label_tensor is None else torch.as_tensor(classes, device=self._label_tensor)
        self._classes_np = classes
        idx = torch.as_tensor(idx.reshape(-1), device=self._device)
        return self._one_hot(idx)

    def _one_hot(self, idx):
        k = len(self._classes_np)
        if k == 2:
            return idx.to(self._dtype)[:, None]
        return torch.nn.functional.one_hot(idx, k).to(self._dtype)

    def _eval_targets(self, y, n):
        labels = np.asarray(_to_numpy(y)).reshape(-1)
        if labels.shape[0] != n:
            raise ValueError(f"eval_set: y_val has {labels.shape[0]} rows but X_val has {n}")
        pos = np.searchsorted(self._classes_np, labels)
        pos = np.clip(pos, 0, len(self._classes_np) - 1)
        if not np.all(self._classes_np[pos] == labels):
            raise ValueError("eval_set: y_val holds labels that y does not")
        return torch.as_tensor(pos, device=self._device)

    def _probas(self, raw):
        f = raw.to(torch.float64)
        if f.shape[1] == 1:
            f = torch.cat([1 - f, f], 1)
        f = f.clamp(self.PROBA_EPS, 1 - self.PROBA_EPS)
        return f / f.sum(1, keepdim=True)

    def _score_metric(self, pred, target, metric):
        proba = self._probas(pred)
        if metric == "accuracy":
            return float((proba.argmax(1) == target).to(torch.float64).mean())
        if metric == "logloss":
            return float(-proba.gather(1, target[:, None]).log().mean())
        onehot = torch.nn.functional.one_hot(target, proba.shape[1]).to(torch.float64)
        return float((onehot - proba).square().mean())

    def decision_function(self, X):
        """The regression outputs: (n,) f - 1/2 for two classes, else (n, n_classes)."""
        out, was_np, src = self._raw_predict(X)
        out = out.to(torch.float64)
        out = out[:, 0] - 0.5 if out.shape[1] == 1 else out
        return out.cpu().numpy() if was_np else out.to(src)

    def predict_proba(self, X):
        """Class probabilities (n, n_classes): the outputs clipped to [1e-3, 1 - 1e-3], rows normalised."""
        out, was_np, src = self._raw_predict(X)
        p = self._probas(out)
        return p.cpu().numpy() if was_np else p.to(src)

    def predict(self, X):
        """The class of the largest probability."""
        out, was_np, src = self._raw_predict(X)
        idx = self._probas(out).argmax(1)
        if isinstance(self.classes_, torch.Tensor) and not was_np:
            return self.classes_.to(src)[idx.to(src)]
        return self._classes_np[idx.cpu().numpy()]

    def score(self, X, y, sample_weight=None):
        """Mean accuracy of predict(X) against y."""
        hit = (_to_numpy(self.predict(X)) == _to_numpy(y).reshape(-1)).astype(np.float64)
        w = None if sample_weight is None else _to_numpy(sample_weight).astype(np.float64)
        return float(np.average(hit, weights=w))


def _median_distance(u: torch.Tensor, p: float) -> float:
    """The median of the distances between distinct rows of u (1 where they are all 0)."""
    if u.shape[0] < 2:
        return 1.0
    r = cdist(u, u, p=p)
    i, j = torch.triu_indices(u.shape[0], u.shape[0], 1, device=u.device)
    med = float(r[i, j].median())
    return med if med > 1e-14 else 1.0
