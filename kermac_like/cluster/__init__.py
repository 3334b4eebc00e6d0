"""k-means clustering: :class:`KMeans`, scikit-learn's estimator (Lloyd's algorithm), and
:func:`kmeans_plusplus`, its seeding (as sklearn.cluster.kmeans_plusplus beside sklearn.cluster.KMeans).

As scikit-learn's sklearn/cluster/: the estimator (``_kmeans.py``) beside its algorithms, Lloyd's
iterations (``_lloyd.py``) and the k-means++ seeding (``_kmeans_plusplus.py``), which run the fused
kernels through :mod:`kermac_like.ops.kmeans`.
"""

from .._deprecated import moved
from ._kmeans import KMeans
from ._kmeans_plusplus import kmeans_plusplus

__all__ = ["KMeans", "kmeans_plusplus"]

# the module kermac_like/cluster.py's other public names, until the next release
__getattr__ = moved(__name__, {
    f"{__name__}._kmeans": "INITS ConvergenceWarning",
    f"{__name__}._kmeans_plusplus": "SAMPLE_BLOCK SEED_ROUND SEED_TRIALS seed_uniforms",
    f"{__name__}._lloyd": "BLOCK_ROWS ASSIGN_BLOCK_ELEMENTS COLUMN_MAJOR_UP_TO segment_sums lloyd"})
