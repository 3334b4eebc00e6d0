"""k-means clustering: :class:`KMeans`, scikit-learn's estimator (Lloyd's algorithm, k-means++ seeding).

As scikit-learn's sklearn/cluster/: the estimator (``_kmeans.py``) beside its algorithms, Lloyd's
iterations (``_lloyd.py``) and the k-means++ seeding (``_kmeans_plusplus.py``), which run the fused
kernels through :mod:`kermac_like.ops.kmeans`.
"""

from .._deprecated import moved
from ._kmeans import KMeans

__all__ = ["KMeans"]

# the module kermac_like/cluster.py's other public names, until the next release
__getattr__ = moved(__name__, {
    f"{__name__}._kmeans": "INITS ConvergenceWarning",
    f"{__name__}._kmeans_plusplus": "SAMPLE_BLOCK SEED_ROUND SEED_TRIALS seed_uniforms kmeans_plusplus",
    f"{__name__}._lloyd": "BLOCK_ROWS ASSIGN_BLOCK_ELEMENTS COLUMN_MAJOR_UP_TO segment_sums lloyd"})
