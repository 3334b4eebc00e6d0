"""Kernel ridge regression past one GPU's memory: :class:`KernelRidge`.

The model is scikit-learn's KernelRidge: ``(K + alpha I) c = y`` on the training
points, prediction ``K(X, X_fit) c``. Four solvers:

* ``"cholesky"``: the dense matrix (run_kernel with the ridge on its diagonal) and
  :func:`kermac_like.linalg.solve_cholesky`; exact, while N x N fits in memory.
* ``"cg"``: conjugate gradients on (K + alpha I) through kernel products that never
  store K, preconditioned with a randomized Nyström approximation on ``n_landmarks``
  sampled points (Frangella, Tropp, Udell 2021).
* ``"nystrom"``: Falkon (Rudi et al. 2017; Meanti et al. 2020): the estimator restricted to
  ``n_centers`` sampled centres Z, ``(K_Zn K_nZ + alpha K_ZZ) beta = K_Zn y``, solved by CG
  with Falkon's Cholesky preconditioner; prediction ``K(X, Z) beta``. With every training
  point a centre it is the exact estimator again. Its two products per pass (K_nZ v, K_Zn u)
  take float32 kernel values and float64 sums; for the Gaussian kernel at D <= 32 on sm_80+
  GPUs they run on tensor cores with one kernel value per pair in both
  (:mod:`kermac_like.plan.falkon`; KERMAC_LIKE_FALKON_MMA=0 for kernel_matvec's products).
* ``"auto"``: cholesky while the N x N matrix takes at most a quarter of the free memory
  (of the device holding X, on every rank), else nystrom when ``n_centers`` is given, else cg.

Under torch.distributed (a process group initialised before ``fit``) each rank passes its
own rows to ``fit(X, y)``, none on some ranks if need be (at least one row over all ranks): the
result is the one-process fit on the shards concatenated in rank order. nystrom never moves X
or y: the m centres (one all_reduce of m x D) and one (m, C) block per pass over the rows
(all_reduce) are all that cross ranks, whatever N (the per-rank memory bound is in
KernelRidge's docstring); cg and cholesky
exchange the N x D points and N x C vectors (all_gather) and CG scalars and m x m blocks. ``predict(X)`` and ``score(X, y)``
are collective: every rank passes the same X and receives the full prediction, each rank
contributing the products against its own share of the fitted points. The fitted
``X_fit_`` / ``dual_coef_`` are that share (all of it in a single process).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings

import numpy as np
import torch

from .. import _debug
from .._args import all_finite, check_device, finite_flag
from .. import linalg
from ..distributed import Comm
from .._estimator import (BaseEstimator, ConvergenceWarning, MultiOutputMixin, RegressorMixin, check_feature_names,
                          check_is_fitted, check_seed)
from ._cg import local_dots, pcg
from ._kernel import resolve_kernel
from ._nystrom import FalkonPreconditioner, LandmarkNystromPreconditioner, build_bytes, gather_global_rows, sample_indices
from ._rows import HostMemoryError, RowSource

log = logging.getLogger("kermac_like.solvers")

__all__ = ["KernelRidge", "ConvergenceWarning"]

SOLVERS = ("auto", "cholesky", "cg", "nystrom")
# auto takes cholesky while the N x N matrix needs at most this fraction of the free memory.
CHOLESKY_MEMORY_FRACTION = 0.25
DEFAULT_MAX_ITER = 1000
# fitted arrays: numpy arrays after a numpy fit, tensors after a tensor fit
_FITTED_ARRAYS = ("X_fit_", "dual_coef_", "centers_")


# --------------------------------------------------------------------------------------------
# Input conversion and collective validation
# --------------------------------------------------------------------------------------------

def _as_tensor(name: str, a, device=None, dtype=None) -> tuple[torch.Tensor, bool]:
    """(tensor, was_numpy). numpy/list inputs become float64 (float32 kept) on ``device``; the
    errors are the ones scikit-learn's checks expect (TypeError for sparse or non-numeric input,
    ValueError for complex numbers), each naming the argument."""
    if a is None:
        raise ValueError(f"{name}: expected an array, got None")
    if isinstance(a, torch.Tensor):
        t, was_np = a, False
        if t.is_complex():
            raise ValueError(f"{name}: Complex data not supported")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: sparse input is not supported; pass a dense tensor ({name}.to_dense())")
        if t.dtype not in (torch.float32, torch.float64):
            if t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                                                    torch.bool):
                t = t.to(torch.float64 if dtype is None else dtype)
            else:
                raise TypeError(f"{name}: expected a real-valued tensor, got {t.dtype}")
    else:
        if hasattr(a, "toarray") and hasattr(a, "nnz"):  # scipy.sparse (matrix or array)
            raise TypeError(f"{name}: sparse input is not supported; pass a dense array ({name}.toarray())")
        try:
            arr = np.asarray(a)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"{name}: cannot be read as an array ({e})") from None
        if np.iscomplexobj(arr):
            raise ValueError(f"{name}: Complex data not supported")
        if arr.dtype == object:  # numbers stored as objects are read as numbers, like scikit-learn does
            try:
                arr = arr.astype(np.float64)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{name}: expected numbers ({e})") from None
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            raise TypeError(f"{name}: expected numbers, got an array of {arr.dtype}")
        if arr.dtype != np.float32:
            arr = arr.astype(np.float64)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # a read-only buffer (memmap): torch wants its own copy
            arr = arr.copy()
        t, was_np = torch.from_numpy(arr), True
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is not None and t.device != torch.device(device):
        t = t.to(device)
    return t, was_np


def _shape_2d(name: str, t: torch.Tensor, n_features=None, estimator="KernelRidge"):
    """Raise the errors scikit-learn's checks expect for a badly shaped X."""
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D array (n_samples, n_features), got shape {tuple(t.shape)}. "
                         f"Reshape your data with {name}.reshape(-1, 1) if it has a single feature or "
                         f"{name}.reshape(1, -1) if it is a single sample")
    if t.shape[1] == 0:
        raise ValueError(f"{name}: 0 feature(s) (shape={tuple(t.shape)}) while a minimum of 1 is required.")
    if n_features is not None and t.shape[1] != n_features:
        raise ValueError(f"{name} has {t.shape[1]} features, but {estimator} is expecting {n_features} "
                         "features as input")


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class _Progress:
    """tqdm bar (rank 0, when asked) plus the per-iteration logging of the CG loop. While the bar
    is up, the console handlers of the root and package loggers write through tqdm
    (logging_redirect_tqdm), so that debug records land on lines of their own, not on the bar's."""

    def __init__(self, show: bool, total: int, label: str):
        self.bar = None
        self._redirect = None
        if show:
            try:
                from tqdm.auto import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:
                return
            loggers = [lg for lg in (logging.getLogger(), logging.getLogger("kermac_like"))
                       if any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
                              for h in lg.handlers)]  # (it gives a logger without a console handler one)
            if loggers:
                self._redirect = logging_redirect_tqdm(loggers=loggers, tqdm_class=tqdm)
                self._redirect.__enter__()
            self.bar = tqdm(total=total, desc=label, unit="it", leave=False)

    def __call__(self, it, residual):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"residual {residual:.2e}")

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------

class KernelRidge(MultiOutputMixin, RegressorMixin, BaseEstimator):
    """Kernel ridge regression, scikit-learn's estimator interface, on the package's kernels.

    A scikit-learn estimator when scikit-learn is installed (clone, Pipeline, GridSearchCV,
    cross_val_score, pickling; ``check_estimator`` passes), the same parameter protocol without
    it. numpy in, numpy out (X's and y's dtypes promoted, as scikit-learn's KernelRidge returns);
    a tensor in, a tensor out on its device.

    Parameters
    ----------
    kernel : str or KernelDescriptor, default "laplace_l2"
        A preset name (``kermac_like.PRESETS``) with a LAPLACE or GAUSSIAN epilogue, ``"dot"``,
        or a KernelDescriptor. ``laplace_l2`` is exp(-||x - y|| / bandwidth) (scikit-learn's
        Matern(nu=0.5, length_scale=bandwidth)); ``laplace_l1`` is scikit-learn's
        ``laplacian`` with gamma = 1 / bandwidth; ``gaussian_l2`` is exp(-||x - y||^2 /
        (2 bandwidth^2)), scikit-learn's ``rbf`` with gamma = 1 / (2 bandwidth^2).
    bandwidth : float
        The kernel's bandwidth (required by LAPLACE/GAUSSIAN kernels).
    alpha : float
        The ridge: the model solves (K + alpha I) c = y. > 0 for cg and nystrom, >= 0 for cholesky.
    solver : {"auto", "cholesky", "cg", "nystrom"}, default "auto"
    n_centers : int, optional
        Nyström centres of the nystrom solver (default: min(N, 10 000)); under "auto", giving
        it selects nystrom when the exact matrix does not fit.
    n_landmarks : int, optional
        Landmarks of cg's Nyström preconditioner (default min(N, 2000)); 0 runs CG unpreconditioned.
    tol : float, default 1e-6
        CG stops when every target's relative residual ||y - (K + alpha I) c|| / ||y|| is at
        most tol (nystrom: the residual of its preconditioned normal equations).
    max_iter : int, optional
        CG iterations (default 1000); reaching it warns with a ConvergenceWarning.
    p : float, optional
        The power of p-norm kernels (laplace_p).
    random_state : int, optional
        Seed of the landmark / centre sampling (default: drawn once, shared by the ranks). The
        sampled indices are a function of (N, m, random_state) only: global row numbers of the
        ranks' shards concatenated in rank order. The same random_state therefore picks the same
        centres (the same rows of that concatenation, bit for bit) on any number of ranks; a
        different split of the same rows over the ranks picks the same centres when the
        concatenation is the same data set in the same order.
    debug, verbose : bool
        debug: log every step (KERMAC_LIKE_DEBUG=1 does too; logger ``kermac_like.solvers``, the
        residual and seconds of every CG iteration at DEBUG); either shows a tqdm bar of the CG
        iterations on rank 0 (when tqdm is installed; quiet otherwise).
    device : str or torch.device, optional
        Where the products run (default: X's device). With X and y in host memory (numpy, CPU
        tensors) and ``device="cuda"``, cholesky and cg copy the data to the device; nystrom keeps
        it where it is and copies row chunks when it does not fit (see ``max_gpu_bytes``).
    max_gpu_bytes : int, optional
        nystrom: the bytes of the compute device one fit may hold (per rank): the preconditioner
        (8 m^2 and the blocks of its build), the centres, the data kept on the device and the stream buffers. When X and y do
        not fit, a prefix of the rows stays on the device and the rest is streamed from host
        memory every pass (two device buffers, pinned host staging, copies on their own CUDA
        stream overlapped with the products). Without it, host data given to a CUDA ``device``
        streams only when it does not fit 90 % of the free memory. predict streams X the same way.
        On a CPU device it forces the same chunking (tests of the streaming path).

    Sharded fits (torch.distributed): the nystrom solver never gathers X or y. What moves between
    ranks: the m centre rows (one all_reduce of m x D), one all_reduce of an (m, C) float64 block
    per product pass (one per CG iteration, plus the right-hand side, the periodic true-residual
    checks and the final one), a few objects of validation metadata (O(ranks)), and nothing of
    size N. Per-rank device memory of a nystrom fit: its rows (X and y, or the resident prefix and
    two stream buffers under max_gpu_bytes) + 8 m^2 bytes (the float64 factors T and A of
    Falkon's preconditioner in one m x m buffer; 3.2 GB at m = 20 000) + O(m (D + C)) + the larger
    of the build's row blocks (~0.15 GB at m = 20 000, and cuSOLVER's potrf workspace) and a pass's
    temporaries (512 MiB a chunk, kernel_matvec's included: 3.2 + 0.54 GB at m = 20 000). cg and cholesky gather X (N x D) and cg N x C vectors on every rank.

    Fitted attributes: ``X_fit_`` and ``dual_coef_`` (this rank's share of the points and
    coefficients; the centres and beta for nystrom, beta in float64 with float32/16-bit data
    because its entries cancel), ``solver_`` (the solver used),
    ``n_iter_`` (CG iterations, 1 for cholesky's direct solve), ``residual_`` (relative residual reached,
    None for cholesky), ``n_features_in_``, ``n_samples_fit_`` (N over all ranks),
    ``fit_time_`` (seconds, the host clock after a device synchronisation). ``X_fit_``,
    ``dual_coef_`` and ``centers_`` (nystrom: every centre) follow X's type: numpy arrays after a
    fit on numpy data (as scikit-learn's), tensors on the compute device after a fit on tensors.

    >>> import numpy as np
    >>> from kermac_like.solvers import KernelRidge
    >>> X = np.linspace(0, 1, 20).reshape(-1, 1)
    >>> y = np.sin(3 * X[:, 0])
    >>> model = KernelRidge("gaussian_l2", bandwidth=0.3, alpha=1e-3).fit(X, y)
    >>> model.solver_, type(model.dual_coef_).__name__, model.dual_coef_.shape
    ('cholesky', 'ndarray', (20, 1))
    >>> model.predict([[0.5]]).round(3)          # sin(1.5) = 0.997
    array([0.996])
    """

    def __init__(self, kernel="laplace_l2", *, bandwidth=None, alpha=1.0, solver="auto", n_centers=None,
                 n_landmarks=None, tol=1e-6, max_iter=None, p=None, random_state=None, debug=False,
                 verbose=False, device=None, max_gpu_bytes=None):
        self.kernel = kernel
        self.bandwidth = bandwidth
        self.alpha = alpha
        self.solver = solver
        self.n_centers = n_centers
        self.n_landmarks = n_landmarks
        self.tol = tol
        self.max_iter = max_iter
        self.p = p
        self.random_state = random_state
        self.debug = debug
        self.verbose = verbose
        self.device = device
        self.max_gpu_bytes = max_gpu_bytes

    # -- parameter checks (local: the same on every rank) ------------------------------------------
    def _check_params(self):
        if self.solver not in SOLVERS:
            raise ValueError(f"solver: {self.solver!r} is not one of {SOLVERS}")
        try:
            kernel = resolve_kernel(self.kernel, self.bandwidth, self.p)
        except ValueError as e:
            msg = str(e)
            raise ValueError("kernel: " + msg[len("name: "):] if msg.startswith("name: ") else msg) from None
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
            raise ValueError(f"alpha: expected a finite number >= 0, got {a!r}")
        if self.solver in ("cg", "nystrom") and not a > 0:
            raise ValueError(f"alpha: the {self.solver} solver needs alpha > 0 (got {a!r}); "
                             "K alone is only positive semi-definite")
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not self.tol > 0:
            raise ValueError(f"tol: expected a positive number, got {self.tol!r}")
        for name in ("max_iter", "n_centers", "n_landmarks"):
            v = getattr(self, name)
            lo = 0 if name == "n_landmarks" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo):
                raise ValueError(f"{name}: expected an integer >= {lo} or None, got {v!r}")
        check_seed(self.random_state)
        mg = self.max_gpu_bytes
        if mg is not None and (isinstance(mg, bool) or not isinstance(mg, (int, float, np.integer, np.floating))
                               or not math.isfinite(mg) or mg < 1):
            raise ValueError(f"max_gpu_bytes: expected a number of bytes >= 1 or None, got {mg!r}")
        if self.device is not None:
            check_device("device", self.device)
        return kernel

    def _compute_device(self, data_device: torch.device) -> torch.device:
        if self.device is None:
            return data_device
        dev = check_device("device", self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _streams(self, data_device, dev) -> bool:
        """Whether a nystrom fit may stream this data (its finiteness is then checked on the device
        during the first pass instead of on the host up front)."""
        return self.solver == "nystrom" and (self.max_gpu_bytes is not None or data_device != dev)

    # -- fit ------------------------------------------------------------------------------------
    def fit(self, X, y):
        """Fit on (X, y): X (n, D), y (n,) or (n, C). Under torch.distributed: this rank's rows (n = 0 allowed)."""
        debug = _debug.resolve(self.debug)
        for name in ("X_fit_", "dual_coef_", "centers_", "preconditioner_rank_", "n_iter_", "residual_", "data_mode_",
                     "_fitted"):
            self.__dict__.pop(name, None)  # a refit never keeps a previous solver's attributes
        comm = Comm()
        # Everything that can fail is checked locally first, then exchanged: every rank raises
        # the same error, and no rank enters a collective that depends on shapes another lacks.
        err, meta = None, None
        try:
            kernel = self._check_params()
            Xt, x_numpy = _as_tensor("X", X)
            dev = self._compute_device(Xt.device)
            _shape_2d("X", Xt)
            if y is None:
                raise ValueError("y: KernelRidge requires y to be passed, but the target y is None")
            yt, _ = _as_tensor("y", y, device=Xt.device)
            y_dtype = yt.dtype
            yt = yt.to(Xt.dtype)
            if yt.dim() not in (1, 2):
                raise ValueError(f"y: expected shape (n_samples,) or (n_samples, n_targets), got {tuple(yt.shape)}")
            if yt.shape[0] != Xt.shape[0]:
                raise ValueError(f"y: has {yt.shape[0]} rows but X has {Xt.shape[0]}")
            defer_finite = self._streams(Xt.device, dev)
            if not defer_finite:  # streamed data: checked chunk by chunk on the device (first pass)
                if not all_finite(Xt):
                    raise ValueError("X: contains NaN or infinity")
                if not all_finite(yt):
                    raise ValueError("y: contains NaN or infinity")
            meta = dict(n=int(Xt.shape[0]), d=int(Xt.shape[1]), y_dim=yt.dim(),
                        c=1 if yt.dim() == 1 else int(yt.shape[1]), dtype=str(Xt.dtype),
                        device=dev.type, free=_free_bytes(dev), params=self._shared_params(), defer=defer_finite)
        except (TypeError, ValueError) as e:
            err = (type(e), str(e))
        metas = comm.raise_collectively(err, meta)
        self._check_ranks_agree(comm, metas)
        counts = [m["n"] for m in metas]
        n_total = sum(counts)
        if n_total == 0:
            raise ValueError(f"X: found 0 sample(s) (shape={tuple(Xt.shape)}) while a minimum of 1 is required.")
        # a rank that streams checks its data during the first pass: every rank joins that check's all_reduce
        defer_finite = any(m["defer"] for m in metas)
        check_feature_names(self, X, reset=True)
        if self.n_centers is not None and self.n_centers > n_total:
            raise ValueError(f"n_centers: {self.n_centers} centres asked for {n_total} training samples")
        if self.n_landmarks is not None and self.n_landmarks > n_total:
            raise ValueError(f"n_landmarks: {self.n_landmarks} landmarks asked for {n_total} training samples")
        solver = self._choose_solver(n_total, Xt.element_size(), min(m["free"] for m in metas))
        seed = self.random_state
        if seed is None:
            seed = comm.broadcast_object(int(torch.randint(0, 2**62, (1,)).item()))
        y2 = yt.reshape(-1, 1) if yt.dim() == 1 else yt
        offset = sum(counts[:comm.rank])
        if solver != "nystrom" and Xt.device != dev:  # cholesky and cg take the data to the device
            Xt, y2 = Xt.to(dev), y2.to(dev)
        if solver == "nystrom":
            rows = self._row_source(comm, kernel, Xt, y2, dev, n_total)  # collective: agreed errors

        t0 = time.perf_counter()
        if debug:
            log.debug("KernelRidge.fit: solver %s, N=%d (this rank %d), D=%d, targets %d, %s on %s, ranks %d",
                      solver, n_total, Xt.shape[0], Xt.shape[1], y2.shape[1], Xt.dtype, Xt.device, comm.size)
        show = (self.verbose or debug) and comm.rank == 0
        with torch.no_grad():
            if solver == "cholesky":
                self._fit_cholesky(kernel, comm, Xt, y2, counts, offset)
            elif solver == "cg":
                self._fit_cg(kernel, comm, Xt, y2, counts, offset, seed, show, debug)
            else:
                try:
                    self._fit_nystrom(kernel, comm, Xt, y2, counts, offset, seed, show, debug, rows, dev,
                                      defer_finite)
                finally:
                    rows.release()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.fit_time_ = time.perf_counter() - t0
        # The fitted arrays follow X's type (numpy in, numpy attributes, as scikit-learn's); predict
        # reads the tensors (a CPU tensor and its array share memory).
        self._fitted = {name: self.__dict__[name] for name in _FITTED_ARRAYS if name in self.__dict__}
        if x_numpy:
            for name, t in self._fitted.items():
                setattr(self, name, t.detach().cpu().numpy())
        self.solver_ = solver
        self.n_features_in_ = int(Xt.shape[1])
        self.n_samples_fit_ = n_total
        self._y_1d = yt.dim() == 1
        # predictions take the dtype of X and y promoted (float32 X with float64 y predicts in
        # float64, as scikit-learn's KernelRidge does); the products run in X's dtype
        self._out_dtype = torch.promote_types(Xt.dtype, y_dtype)
        self._kernel = kernel
        self._device, self._dtype = dev, Xt.dtype
        if self.residual_ is not None and self.residual_ > self.tol:
            warnings.warn(
                f"KernelRidge ({solver}): CG stopped after {self.n_iter_} iterations at relative residual "
                f"{self.residual_:.3e} > tol={self.tol:g} (max_iter reached, or the true residual stays above tol: "
                "the data's precision); raise max_iter, n_landmarks/n_centers or alpha, or fit in float64",
                ConvergenceWarning, stacklevel=2)
        log.info("KernelRidge.fit: %s, N=%d, %d iterations, relative residual %s, %.3f s", solver, n_total,
                 self.n_iter_, "-" if self.residual_ is None else f"{self.residual_:.3e}", self.fit_time_)
        return self

    # parameters every rank must share (verbose, debug and the per-rank memory limit may differ)
    _PER_RANK_PARAMS = ("verbose", "debug", "max_gpu_bytes", "device")

    def _shared_params(self) -> dict:
        return {k: repr(v) for k, v in self.get_params(deep=False).items() if k not in self._PER_RANK_PARAMS}

    @staticmethod
    def _check_ranks_agree(comm, metas):
        first = metas[0]
        for r, m in enumerate(metas):
            diff = [k for k in first["params"] if m["params"].get(k) != first["params"][k]]
            if diff:
                k = diff[0]
                raise ValueError(f"{k}: rank {r} passes {k}={m['params'][k]}, rank 0 passes {k}={first['params'][k]} "
                                 "(every rank must fit the same estimator: same kernel and parameters)")
        for r, m in enumerate(metas):
            for key, name, what in (("d", "X", "features"), ("dtype", "X", "dtype"), ("device", "X", "device type"),
                                    ("y_dim", "y", "dimensions"), ("c", "y", "targets")):
                if m[key] != first[key]:
                    raise ValueError(f"{name}: rank {r} passes {what} {m[key]!r}, rank 0 passes {first[key]!r} "
                                     "(every rank must pass the same columns and dtype)")

    def _choose_solver(self, n_total, itemsize, free_min):
        if self.solver != "auto":
            return self.solver
        if n_total * n_total * itemsize <= CHOLESKY_MEMORY_FRACTION * free_min:
            return "cholesky"
        if not self.alpha > 0:
            raise ValueError(f"alpha: N={n_total} is too large for the exact solver, and the iterative solvers "
                             "need alpha > 0")
        return "nystrom" if self.n_centers is not None else "cg"

    def _max_iter(self):
        return DEFAULT_MAX_ITER if self.max_iter is None else int(self.max_iter)

    # -- the solvers ------------------------------------------------------------------------------
    def _fit_cholesky(self, kernel, comm, X, y, counts, offset):
        n_max = max(counts)
        if comm.active:  # every rank solves the whole (small) system and keeps its own rows
            xa = _unpad(comm.all_gather_padded(X, n_max), counts, n_max)
            ya = _unpad(comm.all_gather_padded(y, n_max), counts, n_max)
        else:
            xa, ya = X, y
        k = kernel.matrix(xa, xa, regularization=float(self.alpha))
        c, _, _ = linalg.solve_cholesky(k, ya.T.contiguous(), overwrite_a=True, check_errors=True)
        del k
        self.X_fit_ = X
        self.dual_coef_ = c.T[offset:offset + X.shape[0]].contiguous()
        # one direct solve: scikit-learn's convention that an estimator with max_iter reports n_iter_ >= 1
        self.n_iter_, self.residual_ = 1, None

    def _fit_cg(self, kernel, comm, X, y, counts, offset, seed, show, debug):
        n_total = sum(counts)
        n_max = max(counts)
        alpha = float(self.alpha)
        xa = comm.all_gather_padded(X, n_max)  # every rank's points (zero rows pad the blocks)
        buf = torch.empty((comm.size * n_max, y.shape[1]), dtype=X.dtype, device=X.device) if comm.active else None

        dt = X.dtype

        def apply_a(v64):  # (K + alpha I) v: vectors in float64, the product in the data's dtype
            va = comm.all_gather_padded(v64.to(dt), n_max, out=buf)  # padded rows of v are zero
            return kernel.matvec(X, xa, va).to(torch.float64).add_(v64, alpha=alpha)

        m = min(n_total, 2000) if self.n_landmarks is None else int(self.n_landmarks)
        t0 = time.perf_counter()
        if m > 0:
            idx = sample_indices(n_total, m, seed)
            z = gather_global_rows(comm, X, offset, idx)
            pre = LandmarkNystromPreconditioner(kernel, X, z, alpha, n_total, comm, debug=debug)
            self.preconditioner_rank_ = pre.rank
        else:
            pre = None
            self.preconditioner_rank_ = 0
        if debug:
            if X.is_cuda:
                torch.cuda.synchronize(X.device)
            log.debug("cg: preconditioner on %d landmarks built in %.3f s", m, time.perf_counter() - t0)

        def dots(pairs):
            return comm.all_reduce(local_dots(pairs))

        bar = _Progress(show, self._max_iter(), "KernelRidge cg")
        try:
            res = pcg(apply_a, pre if pre is not None else (lambda r: r.clone()), y.to(torch.float64),
                      tol=float(self.tol), max_iter=self._max_iter(), dots=dots, progress=bar, label="cg",
                      round_to=dt)
        finally:
            bar.close()
        self.X_fit_ = X
        self.dual_coef_ = res.x.to(dt)
        self.n_iter_, self.residual_ = res.n_iter, res.residual

    def _n_centers(self, n_total):
        return min(n_total, 10000) if self.n_centers is None else int(self.n_centers)

    def _row_source(self, comm, kernel, X, y, dev, n_total) -> RowSource:
        """The chunk plan of this rank's rows and its buffers; an error of any rank (max_gpu_bytes
        below the fixed needs, no host memory for the pinned buffers) is raised on every rank
        before any of them starts the solve."""
        err = None
        rows = None
        try:
            m = self._n_centers(n_total)
            c = y.shape[1]
            fixed = build_bytes(m) + 8 * m * (X.shape[1] + 4 * c)  # T and A in one buffer, the centres, m x C vectors
            budget = None
            if self.max_gpu_bytes is not None:
                budget = int(self.max_gpu_bytes) - fixed
                if budget <= 0:
                    raise ValueError(f"max_gpu_bytes: {int(self.max_gpu_bytes)} bytes do not hold the "
                                     f"preconditioner of {m} centres ({fixed} bytes: 8 m^2 + O(m (D + C)) + its build's blocks)")
            elif X.device != dev and dev.type == "cuda":
                budget = max(1, int(0.9 * _free_bytes(dev)) - fixed)
            rows = RowSource(X, y, dev, budget=budget, c=c)
            need = rows.host_bytes()
            if need and need > _free_bytes(torch.device("cpu")):
                raise HostMemoryError(f"not enough host memory for the chunk buffers: {need / 2**30:.2f} GiB of "
                                      f"pinned memory needed, {_free_bytes(torch.device('cpu')) / 2**30:.2f} GiB free")
            rows.allocate()
        except (ValueError, HostMemoryError) as e:
            err = (type(e), str(e))
        except torch.OutOfMemoryError as e:
            err = (MemoryError, f"max_gpu_bytes: the device ran out of memory for the resident rows ({e}); "
                                "pass a smaller max_gpu_bytes")
        if err is not None and rows is not None:
            rows.release()
        comm.raise_collectively(err, None)
        log.debug("nystrom data: %s, %d rows (%d on the device, chunks of %d, stream chunks of %d), device %s",
                  rows.mode, rows.n, rows.n_res, rows.work_rows, rows.slot_rows, dev)
        return rows

    def _fit_nystrom(self, kernel, comm, X, y, counts, offset, seed, show, debug, rows, dev, check_finite):
        n_total = sum(counts)
        alpha = float(self.alpha)
        m = self._n_centers(n_total)
        f64 = torch.float64
        t0 = time.perf_counter()
        idx = sample_indices(n_total, m, seed)
        z = gather_global_rows(comm, X, offset, idx, device=dev)

        # The products in kernel_matvec's blocked float64 mode (1.13x the float64 mode's fit at N = 10^7): the
        # float64 mode's kernel values and float64 sums, v rounded to float32 and float32 partials of
        # 8 pairs (~0.2 2^-24 of sum |k v| per product). B amplifies that rounding too: on the CPU model
        # (N = 2e4, m = 2e3) CG took 37 iterations instead of 30, same predictions to 7e-5 relative
        # (bench/notes/krr_1e9.md, "blocked float64 mode").
        # In that mode, the Gaussian kernel at K <= 32 on sm_80+ takes both products on tensor cores
        # (plan.falkon, KERMAC_LIKE_FALKON_MMA): the same arithmetic with the exponent's dot product in
        # 3xTF32 and one kernel value per pair in both products (bench/notes/krr_1e9.md).
        products = kernel.centre_products(z, blocked=True, debug=debug)

        # One pass over the rows = one (m, C) float64 block: sum over the chunks c of K_Zc (...).
        def data_pass(v64=None, minus_y=False, flags=None):
            """K_Zn K_nZ v (v64), K_Zn y (v64 None), or K_Zn (y - K_nZ v) (minus_y) over this rank's
            rows; ``flags`` (a bool (2,) tensor) collects NaN/inf of the chunks of X and y."""
            acc = torch.zeros((m, y.shape[1]), dtype=f64, device=dev)
            for _, xc, yc in rows.chunks():
                if flags is not None:
                    flags[0] |= ~finite_flag(xc)  # in blocks: no chunk-sized temporaries
                    flags[1] |= ~finite_flag(yc)
                if v64 is None:
                    u = yc.to(f64)
                else:
                    u = products.rows(xc, v64)  # K_cZ v (rows, C)
                    if minus_y:
                        u.neg_().add_(yc)  # y_c - K_cZ v, bit for bit, in place: one (rows, C) temporary
                acc += products.cols(xc, u)
            return comm.all_reduce(acc)

        # The first pass: K_Zn y, and the finiteness of streamed data (agreed on by every rank with one
        # all_reduce before the preconditioner's build and the solve).
        flags = torch.zeros(2, dtype=torch.bool, device=dev) if check_finite else None
        k_zn_y = data_pass(flags=flags)
        if check_finite:
            everyone = torch.zeros((comm.size, 2), dtype=f64, device=dev)
            everyone[comm.rank] = flags.to(f64)
            everyone = comm.all_reduce(everyone)
            bad = everyone.nonzero().tolist()
            if bad:
                r, which = bad[0]
                where = f" (on rank {r})" if comm.active else ""
                raise ValueError(("X" if which == 0 else "y") + ": contains NaN or infinity" + where)

        pre = FalkonPreconditioner(kernel, z, n_total, alpha, debug=debug)
        if debug:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            log.debug("nystrom: %d centres sampled and the preconditioner built in %.3f s (first pass included)",
                      m, time.perf_counter() - t0)

        # The system is (K_Zn K_nZ + alpha T^T T) beta = K_Zn y with T^T T = K_ZZ + delta I, the factored
        # (jittered) K_ZZ, as Falkon takes it: exactly symmetric positive definite (the K_ZZ of the kernel
        # matrix itself can have rounding-sized negative eigenvalues, which the preconditioner amplifies
        # into an indefinite system on which CG diverges once the residual reaches ~2e-4;
        # bench/notes/solvers.md, N = 10^6). Its term of B^T (...) B is A^-T A^-1 / N (pre.normal).
        # Every vector is float64, so with float32/16-bit data both products run in kernel_matvec's
        # float64 mode (the kernel values in the data's dtype, every product and sum in float64). B
        # amplifies the rounding of either: the long coherent sum of K_Zn u, and K_nZ v, whose terms
        # cancel (v = B g oscillates); bench/notes/solvers.md.
        def apply_a(g):  # one pass over the rows, one all_reduce of (m, C)
            return pre.normal(g, data_pass, alpha)

        def residual(g):
            """B^T (K_Zn (y - K_nZ beta) - alpha T^T T beta) for beta = B g: b - A g with the long sum
            over the training points taken of the training residual y - K_nZ beta, not of K_nZ beta
            (see the notes)."""
            return pre.normal(g, lambda beta: data_pass(beta, minus_y=True), -alpha)

        b = pre.apply_t(k_zn_y)  # = residual(0)

        bar = _Progress(show, self._max_iter(), "KernelRidge nystrom")
        try:
            # True residuals (the checks, the verification at tol, max_iter) in the residual form
            # above; with float32/16-bit data (float32 kernel values), a check every 10 iterations
            # restarts the recursion from the true residual and keeps the best iterate (the safety
            # net of _cg.pcg).
            res = pcg(apply_a, lambda r: r.clone(), b, tol=float(self.tol), max_iter=self._max_iter(),
                      progress=bar, label="nystrom", check_every=None if X.dtype == f64 else 10,
                      residual=residual)
        finally:
            bar.close()
        # beta stays float64 whatever the data: its entries cancel (rounding them to float32 would
        # add eps32 ||K|| ||beta|| to every prediction); predict's product then runs in
        # kernel_matvec's float64 mode.
        beta = pre.apply(res.x)
        share = _share(m, comm)
        self.X_fit_ = z[share]
        self.dual_coef_ = beta[share]
        self.centers_ = z
        self.n_iter_, self.residual_ = res.n_iter, res.residual
        self.data_mode_ = rows.mode

    # -- predict / score --------------------------------------------------------------------------
    def predict(self, X):
        """K(X, X_fit) @ dual_coef: (n,) or (n, C) like the y of fit. Collective under torch.distributed
        (every rank passes the same X and receives the whole prediction). numpy in, numpy out; a
        tensor in, a tensor out on X's device."""
        check_is_fitted(self, "dual_coef_")
        comm = Comm()
        err, meta = None, None
        try:
            check_feature_names(self, X, reset=False)
            Xt, was_np = _as_tensor("X", X)
            src_device = Xt.device
            _shape_2d("X", Xt, self.n_features_in_, type(self).__name__)
            stream = getattr(self, "max_gpu_bytes", None) is not None or Xt.device != self._device
            Xt = Xt.to(dtype=self._dtype) if stream else Xt.to(device=self._device, dtype=self._dtype)
            if not all_finite(Xt):
                raise ValueError("X: contains NaN or infinity")
            meta = (int(Xt.shape[0]),)
        except (TypeError, ValueError) as e:
            err = (type(e), str(e))
        metas = comm.raise_collectively(err, meta)
        if any(mm != metas[0] for mm in metas):
            raise ValueError(f"X: ranks pass different numbers of rows {[mm[0] for mm in metas]}; predict is "
                             "collective and takes the same X on every rank")
        with torch.no_grad():
            if stream:  # row chunks of X through the device, the prediction gathered where X is
                out = self._predict_chunks(Xt)
            else:
                out = self._kernel.matvec(Xt, self._fitted["X_fit_"], self._fitted["dual_coef_"])
            out = comm.all_reduce(out).to(self._out_dtype)
        if self._y_1d:
            out = out[:, 0]
        if was_np:
            return out.cpu().numpy()
        return out.to(src_device)

    def _predict_chunks(self, Xt):
        """K(X, X_fit) dual_coef with X's rows streamed through the device (RowSource) under
        max_gpu_bytes, minus what the fitted model holds there; the output on X's device."""
        x_fit, coef = self._fitted["X_fit_"], self._fitted["dual_coef_"]
        out = torch.empty((Xt.shape[0], coef.shape[1]), dtype=torch.promote_types(self._dtype, coef.dtype),
                          device=Xt.device)
        budget = None
        fitted = x_fit.numel() * x_fit.element_size() + coef.numel() * coef.element_size()
        if self.max_gpu_bytes is not None:
            budget = max(1, int(self.max_gpu_bytes) - fitted)
        elif self._device.type == "cuda" and Xt.device != self._device:
            budget = max(1, int(0.9 * _free_bytes(self._device)))
        rows = RowSource(Xt, None, self._device, budget=budget, c=coef.shape[1])
        try:
            for s, xc, _ in rows.chunks():
                o = self._kernel.matvec(xc, x_fit, coef)
                out[s:s + xc.shape[0]].copy_(o)
        finally:
            rows.release()
        return out

    def score(self, X, y, sample_weight=None):
        """R^2 of predict(X) against y (scikit-learn's r2_score: weighted by ``sample_weight``,
        uniform average over targets). Collective under torch.distributed, like predict."""
        pred = self.predict(X)
        pred_t = torch.as_tensor(pred).to(torch.float64)
        yt, _ = _as_tensor("y", y, device=pred_t.device, dtype=torch.float64)
        if yt.shape != pred_t.shape:
            raise ValueError(f"y: shape {tuple(yt.shape)} differs from the prediction's {tuple(pred_t.shape)}")
        yt2 = yt.reshape(yt.shape[0], -1)
        pr2 = pred_t.reshape(pred_t.shape[0], -1)
        if sample_weight is None:
            w = torch.ones((yt2.shape[0], 1), dtype=torch.float64, device=yt2.device)
        else:
            w, _ = _as_tensor("sample_weight", sample_weight, device=yt2.device, dtype=torch.float64)
            if w.shape != (yt2.shape[0],):
                raise ValueError(f"sample_weight: expected shape ({yt2.shape[0]},), got {tuple(w.shape)}")
            w = w[:, None]
        mean = (w * yt2).sum(0) / w.sum()
        ss_res = (w * (yt2 - pr2) ** 2).sum(0)
        ss_tot = (w * (yt2 - mean) ** 2).sum(0)
        r2 = torch.where(ss_tot > 0, 1 - ss_res / torch.where(ss_tot > 0, ss_tot, 1.0),
                         torch.where(ss_res > 0, torch.zeros_like(ss_res), torch.ones_like(ss_res)))
        return float(r2.mean())


def _unpad(t: torch.Tensor, counts, n_max: int) -> torch.Tensor:
    if all(c == n_max for c in counts):
        return t
    return torch.cat([t[r * n_max:r * n_max + c] for r, c in enumerate(counts)])


def _share(m: int, comm) -> slice:
    """This rank's contiguous share of m replicated rows."""
    per = -(-m // comm.size)
    return slice(min(m, comm.rank * per), min(m, (comm.rank + 1) * per))
