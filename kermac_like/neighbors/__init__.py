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

from .._deprecated import moved
from ._classification import KNeighborsClassifier
from ._regression import KNeighborsRegressor
from ._unsupervised import NearestNeighbors

__all__ = ["NearestNeighbors", "KNeighborsClassifier", "KNeighborsRegressor"]

# the module kermac_like/neighbors.py's other names, until the next release
__getattr__ = moved(__name__, {f"{__name__}._base": "METRICS"})
