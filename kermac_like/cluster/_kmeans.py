"""k-means clustering on :func:`kermac_like.knn`: :class:`KMeans`, scikit-learn's estimator.

Lloyd's algorithm with scikit-learn's semantics (``KMeans(algorithm="lloyd")``): the same
parameters, stopping rule, final relabelling, empty-cluster rule and errors. Each iteration is

* the assignment: the nearest centre of every point, ``knn(X, centres, 1)`` (the fused
  argmin of the selection reduction on a GPU: the N x n_clusters distance matrix is never
  stored);
* the update: one segmented sum of the points by label (a stable sort of the labels, then
  ``torch.segment_reduce`` over the sorted rows in row blocks, accumulated in float64 in a
  fixed order; on CUDA in float32 one fused kernel over the sorted rows instead,
  cuda_templates/kmeans.cuh): no one-hot matrix and no floating-point atomics, so the same
  data and initial centres give bitwise the same centres run to run, on a CPU as on a GPU.

k-means++ seeding in rounds (:func:`kmeans_plusplus`: up to 128 centres a round drawn exactly by
rejection from the round's starting distribution, then folded into the running minimum distance
in one pass): on CUDA in float32 three fused kernels a round (cuda_templates/kmeans.cuh,
kermac_like/plan/kmeans.py) and one host synchronisation a round; elsewhere torch ops, one host
synchronisation a proposal (the same draws from the same uniforms).

The fit runs about a reference point s (:func:`_reference`: per column a median of the data
rounded to a power of two below its spread): X - s once per fit, the seeding and every iteration
in those coordinates, the centres given back as c + s. Distances do not depend on s, but their
rounding does: the tensor-core assignment's certificate and the pruned iterations' bounds lose
eps x the squared norms of what they are fed, so on data far from the origin (shifted,
all-positive, pixel-like) they would lose eps |x|^2 instead of eps times the centred scale.

Memory beyond X: X - s where s is not 0 (a copy of X), O(N) (labels, distances, the sort's
permutation), one row block of X in float64 and the knn op's own blocks; never N x n_clusters
(``transform``'s output aside).
numpy in, numpy out (``labels_`` int32, centres in X's float dtype, as scikit-learn); torch
tensors in, tensors out on their device (labels int64), the fit on X's device.
"""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np
import torch

from .._args import all_finite
from .._estimator import (HAVE_SKLEARN, BaseEstimator, ClusterMixin, ConvergenceWarning, TransformerMixin,
                          check_count, check_is_fitted, check_n_features)
from ..centring import REFERENCE_ROWS, centred
from ..ops.distance import cdist
from ._kmeans_plusplus import _random_init, kmeans_plusplus
from ._lloyd import _DIRECT, _assign, _block_rows, _inertia, _local_certificate, lloyd

__all__ = ["KMeans"]

INITS = ("k-means++", "random")


def _random_state(random_state) -> np.random.RandomState:
    """scikit-learn's check_random_state."""
    if random_state is None or random_state is np.random:
        return np.random.mtrand._rand
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        return np.random.RandomState(random_state)
    if isinstance(random_state, np.random.RandomState):
        return random_state
    raise ValueError(f"random_state: {random_state!r} cannot be used to seed a numpy.random.RandomState instance")


def _check_tensor_X(name: str, X: torch.Tensor) -> torch.Tensor:
    if X.is_complex():
        raise ValueError(f"{name}: Complex data not supported")
    if X.layout != torch.strided:
        raise TypeError(f"{name}: sparse input is not supported; pass a dense tensor ({name}.to_dense())")
    if X.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (n_samples, n_features), got shape {tuple(X.shape)}")
    if X.dtype not in (torch.float32, torch.float64):
        X = X.to(torch.float64)
    if X.shape[0] == 0:
        raise ValueError(f"{name}: found 0 sample(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if X.shape[1] == 0:
        raise ValueError(f"{name}: 0 feature(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if not _finite(X):
        raise ValueError(f"Input {name} contains NaN or infinity.")
    return X.contiguous()


def _finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t``: its sum in float64 is finite (one read, no temporaries: a NaN or an
    infinity makes it NaN or infinite; float32 data cannot overflow it), else all_finite's
    elementwise check (float64 data whose sum overflows)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64))) or all_finite(t)


def _same_clustering(a: torch.Tensor, b: torch.Tensor, C: int) -> bool:
    """scikit-learn's _is_same_clustering: one partition up to a renaming of the labels."""
    pairs = torch.unique(a * C + b)
    return pairs.numel() == torch.unique(a).numel() == torch.unique(b).numel()


def _reference(X: torch.Tensor) -> torch.Tensor:
    """(D,) in X's dtype and device: the fit's reference point s, :func:`centring.reference_point`
    (per column a median of a sample of the rows: one of the data's own values) rounded to a
    multiple of the largest power of two at most the column's spread (the root mean square of the
    same sample about it; unrounded where that is 0). So x - s rounds by at most eps |x - s| (eps
    times the centred scale) and not at all on a power-of-two lattice (integers, pixels: s stays on
    it) or far from the origin (x and s within a factor of two: Sterbenz), and data centred within
    its spread get s = 0: the fit is then that of X itself, bitwise (and X is not copied)."""
    rows = X[::max(1, -(-X.shape[0] // REFERENCE_ROWS))]  # reference_point's own sample of X
    # X is finite (validated): reference_point's scan of every row for infinities finds none, and
    # its median ignores no NaN: per column the lower median of the sample in float32, as
    # reference_point gives it (torch.median along contiguous rows: half nanmedian's time down columns)
    ref = torch.median(rows.t().float().contiguous(), dim=1).values.to(torch.float64)
    sample = rows.to(torch.float64) - ref
    spread = sample.square_().mean(0).sqrt_()
    grid = torch.exp2(torch.floor(torch.log2(spread)))
    return torch.where(spread > 0, torch.round(ref / grid) * grid, ref).to(X.dtype)


def _tolerance(X: torch.Tensor, tol: float) -> float:
    """scikit-learn's _tolerance: tol x the mean over features of the (population) variance,
    in float64 by row blocks."""
    if tol == 0:
        return 0.0
    N, D = X.shape
    mean = X.sum(0, dtype=torch.float64) / N
    ss = torch.zeros(D, dtype=torch.float64, device=X.device)
    R = _block_rows(N, D)
    for b0 in range(0, N, R):
        ss += (X[b0:b0 + R].to(torch.float64) - mean).square_().sum(0)
    return float((ss / N).mean()) * tol


class KMeans(ClusterMixin, TransformerMixin, BaseEstimator):
    """k-means clustering, Lloyd's algorithm (scikit-learn's ``KMeans(algorithm="lloyd")``).

    Parameters
    ----------
    n_clusters : int, default 8
    init : "k-means++", "random" or an array (n_clusters, n_features), default "k-means++"
        "k-means++": D^2 sampling (each new centre drawn with probability proportional to the
        weight times the squared distance to the nearest centre so far, exactly; one draw per
        centre, not scikit-learn's greedy best of 2 + log(k) trials; see kmeans_plusplus). "random": n_clusters distinct
        points, drawn with probability proportional to the weight. An array (numpy or a
        tensor) gives the initial centres: one run, as scikit-learn.
    n_init : int or "auto", default 1
        Runs from different seeds; the one of least inertia is kept (a later run only when it
        is a different partition, as scikit-learn). "auto": 1 for "k-means++" and an array, 10
        for "random".
    max_iter : int, default 300
    tol : float, default 1e-4
        Relative to the data: the run stops when the centres move by at most
        tol x (the mean over features of X's variance) in squared Euclidean norm (summed over
        the centres), or when no label changes.
    random_state : None, int or numpy.random.RandomState
        Seeds the initialisations (drawn on X's device with a torch.Generator, so a CPU and a
        GPU give different seeds for the same random_state; the same device, data and
        random_state give bitwise the same result).
    verbose : bool
    debug : bool
        Log the knn op's path (as ``debug`` of :func:`kermac_like.knn`).

    Empty clusters (no weight after an assignment) are handled as scikit-learn does: each
    takes one of the points farthest from their centres (farthest first, ties to the smaller
    index), which leaves its old cluster.

    Fitted attributes: ``cluster_centers_`` (n_clusters, n_features), ``labels_`` (n_samples,),
    ``inertia_`` (float: the weighted sum of squared distances to the nearest centre),
    ``n_iter_``, ``n_features_in_``, ``feature_names_in_`` (data frames). numpy X: numpy
    centres in X's float dtype and int32 labels (scikit-learn's types); a tensor X: tensors on
    its device, int64 labels.

    >>> import numpy as np
    >>> from kermac_like.cluster import KMeans
    >>> X = np.array([[0.0, 0.0], [0.0, 1.0], [10.0, 10.0], [10.0, 11.0]])
    >>> fit = KMeans(n_clusters=2, random_state=0).fit(X)
    >>> sorted(fit.cluster_centers_.tolist()), fit.inertia_
    ([[0.0, 0.5], [10.0, 10.5]], 1.0)
    >>> fit.labels_.dtype, bool(fit.labels_[0] == fit.labels_[1] != fit.labels_[2])
    (dtype('int32'), True)

    The assignment is ``knn(X, centres, 1)``: on a CPU (and for float64 on a GPU) exact in
    float64; on a GPU in float32 for float32 data, so points whose two nearest centres are
    within float32 rounding of each other may take the other one. Inertia is summed in float64.
    On a GPU in float32 with n_features <= 16 and 2 to 8192 clusters the assignment runs on tensor
    cores with a certificate, and the iterations after the first assign only the points whose
    label distance bounds cannot prove (Hamerly's bounds with Elkan's half-distance test): the
    same labels as assigning every point, bitwise (``KERMAC_LIKE_KMEANS_BOUNDS=0`` assigns every
    point). The fit, predict, transform and score run about a reference point of the training data
    (the module's docstring): a common shift of the data shifts the centres and changes no label
    beyond float32 rounding of the centred coordinates (none where the shift is exact, e.g. on a
    power-of-two lattice). Device memory: X and, unless the data are centred already, X - s;
    ~24 bytes a point for the bounded iterations (labels, two bounds, a distance and the work list)
    and O(n_clusters x n_features) per step; no n_samples x n_clusters matrix. Errors:
    ``ValueError`` naming the argument for bad parameters, shapes, n_clusters > n_samples and
    NaN/inf in X; ``NotFittedError`` before ``fit``.
    """

    def __init__(self, n_clusters=8, *, init="k-means++", n_init=1, max_iter=300, tol=1e-4, random_state=None,
                 verbose=False, debug=False):
        self.n_clusters = n_clusters
        self.init = init
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state
        self.verbose = verbose
        self.debug = debug

    # -- validation ---------------------------------------------------------------------------------
    def _check_params(self) -> tuple:
        """(n_clusters, n_init, max_iter, tol, init) after checking each parameter."""
        C = check_count("n_clusters", self.n_clusters)
        max_iter = check_count("max_iter", self.max_iter)
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"tol: expected a finite real number >= 0, got {tol!r}")
        init = self.init
        array_init = not isinstance(init, str)
        if isinstance(init, str) and init not in INITS:
            raise ValueError(f"init: {init!r} is not one of {INITS} or an array of shape (n_clusters, n_features)")
        if array_init and (callable(init) or not (torch.is_tensor(init) or hasattr(init, "__len__")
                                                   or hasattr(init, "__array__"))):
            raise TypeError(f"init: expected 'k-means++', 'random' or an array, got {type(init).__name__}")
        if self.n_init == "auto":
            n_init = 10 if init == "random" else 1
        else:
            n_init = check_count("n_init", self.n_init)
        if array_init and n_init != 1:
            warnings.warn(f"Explicit initial center position passed: performing only one init in "
                          f"{type(self).__name__} instead of n_init={n_init}.", RuntimeWarning, stacklevel=3)
            n_init = 1
        return C, n_init, max_iter, float(tol), init

    def _validate(self, X, *, reset: bool) -> tuple:
        """(X tensor, X was a tensor). numpy/lists through scikit-learn's validate_data
        (n_features_in_, feature names, its messages); tensors here."""
        if torch.is_tensor(X):
            Xt = _check_tensor_X("X", X)
            check_n_features(self, Xt.shape[1], reset=reset, forget_names=True)
            return Xt, True
        if (type(X) is np.ndarray and X.dtype in (np.float32, np.float64) and X.ndim == 2 and X.size
                and X.flags.c_contiguous and X.flags.writeable
                and (reset or getattr(self, "feature_names_in_", None) is None)):
            # a plain C-ordered float array (no names, nothing to convert): validate_data's checks here,
            # ~0.5 ms fewer a call; a non-finite value goes to it below for its message
            Xt = torch.from_numpy(X)
            if _finite(Xt):
                check_n_features(self, X.shape[1], reset=reset, forget_names=True)
                return Xt, False
        if HAVE_SKLEARN:
            from sklearn.utils.validation import validate_data

            Xa = validate_data(self, X, reset=reset, dtype=[np.float64, np.float32], order="C")
        else:
            if hasattr(X, "toarray") and hasattr(X, "nnz"):
                raise TypeError("X: sparse input is not supported; pass a dense array (X.toarray())")
            Xa = np.asarray(X)
            if np.iscomplexobj(Xa):
                raise ValueError("X: Complex data not supported")
            if Xa.dtype not in (np.float32, np.float64):
                Xa = Xa.astype(np.float64)
            Xt = _check_tensor_X("X", torch.from_numpy(np.ascontiguousarray(Xa)))
            check_n_features(self, Xa.shape[1], reset=reset)
        Xa = np.ascontiguousarray(Xa)
        return torch.from_numpy(Xa if Xa.flags.writeable else Xa.copy()), False

    def _sample_weight(self, sample_weight, Xt: torch.Tensor):
        """(N,) tensor in X's dtype on X's device, or None for unit weights."""
        if sample_weight is None:
            return None
        if isinstance(sample_weight, numbers.Number):
            w = torch.full((Xt.shape[0],), float(sample_weight), dtype=Xt.dtype, device=Xt.device)
        elif torch.is_tensor(sample_weight):
            if sample_weight.device != Xt.device:
                raise ValueError(f"sample_weight: on {sample_weight.device}, X on {Xt.device}")
            w = sample_weight.to(Xt.dtype)
        else:
            w = torch.from_numpy(np.array(sample_weight, dtype=np.float64)).to(Xt.dtype)
        if w.dim() != 1 or w.shape[0] != Xt.shape[0]:
            raise ValueError(f"sample_weight.shape == {tuple(w.shape)}, expected ({Xt.shape[0]},)!")
        if not all_finite(w):
            raise ValueError("Input sample_weight contains NaN or infinity.")
        if bool((w < 0).any()):
            raise ValueError("Negative values in data passed to sample_weight")
        if not bool((w > 0).any()):
            raise ValueError("sample_weight: the weights sum to zero")
        return w

    def _init_array(self, Xt: torch.Tensor, C: int) -> torch.Tensor:
        init = self.init
        if torch.is_tensor(init):
            if init.device != Xt.device:
                raise ValueError(f"init: on {init.device}, X on {Xt.device}")
            c = init.detach()
        else:
            try:
                c = torch.from_numpy(np.array(init, dtype=np.float64))
            except (TypeError, ValueError) as e:
                raise TypeError(f"init: cannot be read as an array of numbers ({e})") from None
        if c.is_complex():
            raise ValueError("init: Complex data not supported")
        if c.dim() != 2:
            raise ValueError(f"init: expected a 2-D array (n_clusters, n_features), got shape {tuple(c.shape)}")
        if c.shape[0] != C:
            raise ValueError(f"The shape of the initial centers {tuple(c.shape)} does not match the number of "
                             f"clusters {C}.")
        if c.shape[1] != Xt.shape[1]:
            raise ValueError(f"The shape of the initial centers {tuple(c.shape)} does not match the number of "
                             f"features of the data {Xt.shape[1]}.")
        c = c.to(Xt.dtype).clone().contiguous()
        if not all_finite(c):
            raise ValueError("Input init contains NaN or infinity.")
        return c

    # -- fit ----------------------------------------------------------------------------------------
    def fit(self, X, y=None, sample_weight=None):
        """Compute the clustering. ``sample_weight`` (n_samples,): the weight of each point in
        the seeding, the centres and the inertia. Returns self. A rejected argument raises
        TypeError/ValueError naming it and leaves the estimator as it was."""
        saved = dict(self.__dict__)
        try:
            return self._fit(X, sample_weight)
        except (TypeError, ValueError):
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def _fit(self, X, sample_weight):
        C, n_init, max_iter, tol, init = self._check_params()
        Xt, was_tensor = self._validate(X, reset=True)
        N = Xt.shape[0]
        if N < C:
            raise ValueError(f"n_samples={N} should be >= n_clusters={C}.")
        w = self._sample_weight(sample_weight, Xt)
        if w is not None and int((w > 0).sum()) < C and init == "random":
            raise ValueError(f"sample_weight: {int((w > 0).sum())} points of nonzero weight, fewer than "
                             f"n_clusters={C}")
        centres0 = None if isinstance(init, str) else self._init_array(Xt, C)
        rs = _random_state(self.random_state)
        with torch.no_grad():
            ref = _reference(Xt)  # the fit in X - ref (the module's docstring)
            shifted = bool(ref.any())
            Xc = centred(Xt, ref) if shifted else Xt
            if centres0 is not None and shifted:
                centres0 = centred(centres0, ref)
            tol_abs = _tolerance(Xc, tol)
            best = None
            for _ in range(n_init):
                hint = [] if _local_certificate() else None  # the seeding's nearest centres (BoundedAssign.first)
                if centres0 is not None:
                    start = centres0
                else:
                    g = torch.Generator(device=Xt.device).manual_seed(int(rs.randint(np.iinfo(np.int32).max)))
                    if init == "k-means++":
                        start = kmeans_plusplus(Xc, C, w, g, debug=self.debug, hint=hint)[0]
                    else:
                        start = _random_init(Xc, C, w, g)[0]
                if self.verbose:
                    print("Initialization complete")
                labels, inertia, centres, n_iter = lloyd(Xc, w, start, max_iter, tol_abs, self.verbose, self.debug,
                                                         hint[0] if hint else None)
                if best is None or (inertia < best[1] and not _same_clustering(labels, best[0], C)):
                    best = (labels, inertia, centres, n_iter)
            labels, inertia, centred_centres, n_iter = best
            centres = centred_centres + ref if shifted else centred_centres
        distinct = int(torch.bincount(labels, minlength=C).count_nonzero())
        if distinct < C:
            warnings.warn(f"Number of distinct clusters ({distinct}) found smaller than n_clusters ({C}). "
                          "Possibly due to duplicate points in X.", ConvergenceWarning, stacklevel=2)
        if was_tensor:
            self.cluster_centers_, self.labels_ = centres, labels
        else:
            self.cluster_centers_ = centres.numpy()
            self.labels_ = labels.numpy().astype(np.int32)
        self.inertia_ = inertia
        self.n_iter_ = n_iter
        self._n_features_out = C
        # predict, transform and score work about the same point, from the centres before the shift back
        self._centring = (ref, centred_centres) if shifted else None
        return self

    def fit_predict(self, X, y=None, sample_weight=None):
        """``fit(X).labels_``."""
        return self.fit(X, sample_weight=sample_weight).labels_

    # -- after fit ----------------------------------------------------------------------------------
    def _query(self, X):
        """(X, the centres), both on the centres' device and dtype and about the fit's reference point;
        X was a tensor; X's device. The centres: the fit's own before the shift back (c + s rounds c)
        while cluster_centers_ holds what the fit gave it, else cluster_centers_ - s."""
        check_is_fitted(self)
        Xt, was_tensor = self._validate(X, reset=False)
        c = self.cluster_centers_
        c = c if torch.is_tensor(c) else torch.from_numpy(np.ascontiguousarray(c))
        Xq = Xt.to(device=c.device, dtype=c.dtype)
        if getattr(self, "_centring", None) is not None:
            ref, cc = (t.to(device=c.device, dtype=c.dtype) for t in self._centring)
            with torch.no_grad():
                Xq = centred(Xq, ref)
                c = cc if cc.shape == c.shape and torch.equal(cc + ref, c) else centred(c, ref)
        return Xq, c, was_tensor, Xt.device

    def predict(self, X, sample_weight=None):
        """The nearest centre of each point (int32 for numpy, int64 tensors for tensors)."""
        Xq, c, was_tensor, dev = self._query(X)
        with torch.no_grad():
            labels, _ = _assign(Xq, c, self.debug)
        return labels.to(dev) if was_tensor else labels.cpu().numpy().astype(np.int32)

    def transform(self, X):
        """Euclidean distances (n_samples, n_clusters) to the centres, in the centres' dtype."""
        Xq, c, was_tensor, dev = self._query(X)
        with torch.no_grad():
            out = cdist(Xq, c, compute_mode=_DIRECT, debug=self.debug)
        return out.to(dev) if was_tensor else out.cpu().numpy()

    def fit_transform(self, X, y=None, sample_weight=None):
        """``fit(X).transform(X)``."""
        return self.fit(X, sample_weight=sample_weight).transform(X)

    def score(self, X, y=None, sample_weight=None):
        """Minus the (weighted) sum of squared distances of X to the nearest centre."""
        Xq, c, _, _ = self._query(X)
        w = self._sample_weight(sample_weight, Xq)
        with torch.no_grad():
            _, d2 = _assign(Xq, c, self.debug)
        return -_inertia(d2, w)

    def get_feature_names_out(self, input_features=None):
        """Names of transform's columns: "kmeans0", "kmeans1", ... (scikit-learn's)."""
        check_is_fitted(self, "_n_features_out")
        return np.asarray([f"{type(self).__name__.lower()}{i}" for i in range(self._n_features_out)], dtype=object)

    if HAVE_SKLEARN:
        def __sklearn_tags__(self):
            tags = super().__sklearn_tags__()
            tags.input_tags.sparse = False
            return tags
