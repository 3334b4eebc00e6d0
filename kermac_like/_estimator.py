"""The base classes of the package's estimators: scikit-learn's own when it is installed
(so that clone, Pipeline, GridSearchCV, cross_val_score and check_estimator see a regular
scikit-learn estimator), otherwise small stand-ins with the same parameter protocol, so
that scikit-learn stays an optional dependency.

Estimators here follow scikit-learn's conventions: ``__init__`` stores its arguments
untouched, validation happens in ``fit``, fitted state ends in ``_``.
"""

from __future__ import annotations

import inspect
import numbers
import warnings

import numpy as np

__all__ = ["HAVE_SKLEARN", "BaseEstimator", "RegressorMixin", "ClassifierMixin", "ClusterMixin",
           "TransformerMixin", "MultiOutputMixin", "NotFittedError", "ConvergenceWarning", "check_is_fitted",
           "check_feature_names", "check_seed", "check_count"]

try:
    from sklearn.base import (BaseEstimator, ClassifierMixin, ClusterMixin, MultiOutputMixin, RegressorMixin,
                              TransformerMixin)
    from sklearn.exceptions import ConvergenceWarning, NotFittedError
    from sklearn.utils.validation import check_is_fitted

    HAVE_SKLEARN = True
except ImportError:  # scikit-learn is optional: the same protocol without it
    HAVE_SKLEARN = False

    class NotFittedError(ValueError, AttributeError):
        """Raised when an estimator is used before ``fit`` (scikit-learn's class when installed)."""

    class ConvergenceWarning(UserWarning):
        """An iterative fit stopped at max_iter before tol, or found fewer clusters than asked for (scikit-learn's
        class when installed)."""

    class BaseEstimator:
        """get_params / set_params / repr from the ``__init__`` signature (scikit-learn's protocol)."""

        @classmethod
        def _get_param_names(cls):
            sig = inspect.signature(cls.__init__)
            return sorted(n for n, prm in sig.parameters.items()
                          if n != "self" and prm.kind not in (prm.VAR_KEYWORD, prm.VAR_POSITIONAL))

        def get_params(self, deep=True):
            return {n: getattr(self, n) for n in self._get_param_names()}

        def set_params(self, **params):
            valid = self._get_param_names()
            for k, v in params.items():
                if k not in valid:
                    raise ValueError(f"{k}: invalid parameter for {type(self).__name__} "
                                     f"(valid: {', '.join(valid)})")
                setattr(self, k, v)
            return self

        def __repr__(self):
            defaults = {n: prm.default for n, prm in inspect.signature(type(self).__init__).parameters.items()}
            shown = [f"{k}={v!r}" for k, v in self.get_params().items()
                     if defaults.get(k) is not v and not _equal(defaults.get(k), v)]
            return f"{type(self).__name__}({', '.join(shown)})"

    def _equal(a, b) -> bool:
        try:
            return bool(a == b)
        except Exception:  # arrays, tensors
            return False

    def check_is_fitted(estimator, attributes=None):
        names = [attributes] if isinstance(attributes, str) else attributes
        fitted = (all(hasattr(estimator, a) for a in names) if names else
                  any(v.endswith("_") and not v.startswith("__") for v in vars(estimator)))
        if not fitted:
            raise NotFittedError(f"This {type(estimator).__name__} instance is not fitted yet. "
                                 "Call 'fit' with appropriate arguments before using this estimator.")

    class RegressorMixin:
        _estimator_type = "regressor"

        def score(self, X, y, sample_weight=None):
            """R^2 of ``predict(X)`` against ``y``."""
            yt = _np(y).astype(np.float64)
            yp = _np(self.predict(X)).astype(np.float64).reshape(yt.shape)
            w = np.ones(len(yt)) if sample_weight is None else _np(sample_weight).astype(np.float64)
            w = w.reshape((-1,) + (1,) * (yt.ndim - 1))
            ss_res = (w * (yt - yp) ** 2).sum(axis=0)
            ss_tot = (w * (yt - np.average(yt, axis=0, weights=w.ravel())) ** 2).sum(axis=0)
            r2 = np.where(ss_tot > 0, 1 - ss_res / np.where(ss_tot > 0, ss_tot, 1), 0.0)
            return float(np.mean(r2))

    class ClassifierMixin:
        _estimator_type = "classifier"

        def score(self, X, y, sample_weight=None):
            """Mean accuracy of ``predict(X)`` against ``y``."""
            hit = (_np(self.predict(X)) == _np(y)).astype(np.float64)
            return float(np.average(hit, weights=None if sample_weight is None else _np(sample_weight)))

    class ClusterMixin:
        _estimator_type = "clusterer"

        def fit_predict(self, X, y=None, **kwargs):
            self.fit(X, **kwargs)
            return self.labels_

    class MultiOutputMixin:
        """Marks estimators that take a 2-D y (the tag ``target_tags.multi_output`` with scikit-learn)."""

    class TransformerMixin:
        def fit_transform(self, X, y=None, **fit_params):
            return self.fit(X, y, **fit_params).transform(X)

    def _np(a):
        if hasattr(a, "detach"):  # a torch tensor
            return a.detach().cpu().numpy()
        return np.asarray(a)


def _feature_names(X):
    """The column names of a data frame (pandas, polars: a ``columns`` attribute of strings), else None."""
    cols = getattr(X, "columns", None)
    if cols is None or hasattr(X, "dtype"):  # arrays and tensors have no column names
        return None
    names = np.asarray(list(cols), dtype=object)
    return names if len(names) and all(isinstance(c, str) for c in names) else None


def check_n_features(estimator, n_features: int, *, reset: bool, forget_names: bool = False) -> None:
    """scikit-learn's n_features_in_ protocol where its validate_data does not run (tensors, or no
    scikit-learn): ``fit`` (reset=True) stores it (``forget_names``: and drops feature_names_in_,
    which a tensor has none of); later calls need the same number of features."""
    if reset:
        estimator.n_features_in_ = int(n_features)
        if forget_names:
            estimator.__dict__.pop("feature_names_in_", None)
    elif n_features != estimator.n_features_in_:
        raise ValueError(f"X has {n_features} features, but {type(estimator).__name__} is expecting "
                         f"{estimator.n_features_in_} features as input.")


def check_feature_names(estimator, X, *, reset: bool) -> None:
    """scikit-learn's feature-name protocol: ``fit`` (reset=True) stores the columns of a data frame
    in ``feature_names_in_``; later calls check that X has the same ones (an error when they differ,
    a warning when only one side has names). Works without scikit-learn."""
    names = _feature_names(X)
    name = type(estimator).__name__
    if reset:
        if names is not None:
            estimator.feature_names_in_ = names
        else:
            estimator.__dict__.pop("feature_names_in_", None)
        return
    fitted = getattr(estimator, "feature_names_in_", None)
    if fitted is None and names is None:
        return
    if names is not None and fitted is None:
        warnings.warn(f"X has feature names, but {name} was fitted without feature names", UserWarning,
                      stacklevel=3)
        return
    if names is None:
        warnings.warn(f"X does not have valid feature names, but {name} was fitted with feature names",
                      UserWarning, stacklevel=3)
        return
    if len(fitted) != len(names) or np.any(fitted != names):
        unseen = sorted(set(names) - set(fitted))
        missing = sorted(set(fitted) - set(names))
        detail = "".join([f"\nFeature names unseen at fit time: {unseen}" if unseen else "",
                          f"\nFeature names seen at fit time, yet now missing: {missing}" if missing else "",
                          "" if unseen or missing else
                          "\nFeature names must be in the same order as they were in fit."])
        raise ValueError("The feature names should match those that were passed during fit." + detail)


def check_seed(random_state) -> None:
    """An integer seed or None (KernelRidge's and RFM's random_state): ValueError naming it otherwise."""
    if random_state is not None and (isinstance(random_state, bool) or not isinstance(random_state, (int, np.integer))):
        raise ValueError(f"random_state: expected an integer or None, got {random_state!r}")


def check_count(name: str, v, lo: int = 1) -> int:
    """``v`` as an int, an integer >= lo (KMeans' n_clusters, max_iter, n_init; the neighbours' n_neighbors):
    ValueError naming it otherwise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
    return int(v)
