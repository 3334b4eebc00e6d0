"""The k-means++ seeding family (cuda_templates/kmeans.cuh): which instantiation of
``kmeans_update_kernel`` / ``kmeans_gap_kernel`` / ``kmeans_draw_kernel`` over
``KmeansTraits<float, kK>`` serves a seeding, its mirrored launch constants, and the family's
shipped set.

Mirror of ``kermac_like::KmeansTraits``: kThreads = 256, kBlockM = 1024 (points per block sum,
cluster.SAMPLE_BLOCK), kBlockN = 128 (centres per round of the seeding at most: the update stages
them in shared memory), kSmemBytes = 0 (static shared memory only); the compile stub checks them
with static_asserts. kK: a point's row in registers for K <= 32 (buckets 4, 8, 16, 32), a
runtime loop over K (kK = 0) beyond.
"""

from __future__ import annotations

from .kernel_spec import KernelSpec, LaunchShape, bucket

__all__ = ["K_BUCKETS", "THREADS", "BLOCK_M", "ROUND", "TRIALS", "SEGSUM_ROWS", "k_bucket", "update_spec", "gap_spec",
           "draw_spec", "segsum_spec", "segsum_combine_spec", "shipped", "ASSIGN_K_BUCKETS", "ASSIGN_MAX_K",
           "assign_k_bucket", "assign_shape", "assign_spec", "assign_prep_spec", "bounds_spec"]

THREADS = 256
BLOCK_M = 1024  # points per block sum (the torch path's too: cluster.SAMPLE_BLOCK)
ROUND = 128  # centres per round of the seeding at most (KmeansTraits::kBlockN)
TRIALS = 8  # proposals per centre before a round ends (the torch path's too: cluster.SEED_TRIALS)
K_BUCKETS = (4, 8, 16, 32)  # beyond: kK = 0, the runtime loop
SEGSUM_ROWS = 4096  # rows per item of Lloyd's segmented sum (a cluster's rows in items of at most this)
LAUNCH = LaunchShape(threads=THREADS, block_m=BLOCK_M, block_n=ROUND, smem_bytes=0)


def k_bucket(K: int) -> int:
    """kK for K coordinates: a row in registers up to 32, else 0 (a runtime loop)."""
    return bucket(K, K_BUCKETS, 0)


def _traits(kK: int) -> str:
    return f"kermac_like::KmeansTraits<float, {int(kK)}>"


def update_spec(K: int) -> KernelSpec:
    """A round's fold of its centres into (d2, near) and the block sums, for K coordinates."""
    return KernelSpec("kmeans.cuh", "kermac_like::kmeans_update_kernel", _traits(k_bucket(K)), LAUNCH)


def gap_spec() -> KernelSpec:
    """Each earlier centre's smallest squared distance to a round's centres (any K)."""
    return KernelSpec("kmeans.cuh", "kermac_like::kmeans_gap_kernel", _traits(0), LAUNCH)


def draw_spec() -> KernelSpec:
    """The one-CTA round of draws (any K: its loops are runtime loops), on the traits of kK = 0."""
    return KernelSpec("kmeans.cuh", "kermac_like::kmeans_draw_kernel", _traits(0), LAUNCH)


def segsum_spec() -> KernelSpec:
    """Lloyd's update: the float64 sums of a cluster's item of sorted rows (any K)."""
    return KernelSpec("kmeans.cuh", "kermac_like::kmeans_segsum_kernel", _traits(0), LAUNCH)


def segsum_combine_spec() -> KernelSpec:
    """Lloyd's update: each cluster's items added in order."""
    return KernelSpec("kmeans.cuh", "kermac_like::kmeans_segsum_combine_kernel", _traits(0), LAUNCH)


def shipped():
    """The draw, the gaps, Lloyd's segmented sum and its combination, and the update for the point clouds and embeddings of KMeans' common inputs
    (K = 2, 3 -> kK 4; 8; 16; 32) and any larger K (kK = 0)."""
    yield draw_spec()
    yield gap_spec()
    yield segsum_spec()
    yield segsum_combine_spec()
    for kK in (4, 8, 16, 32, 0):
        yield KernelSpec("kmeans.cuh", "kermac_like::kmeans_update_kernel", _traits(kK), LAUNCH)
    # the tensor-core assignment (plan.kmeans.ASSIGN_MMA, K <= ASSIGN_UP_TO = 16): kK 8 (points, K <= 8)
    # and 16 (the bench); kK 32 and 64 (plan_assign called directly) compile on first use
    for kK in (8, 16):
        yield assign_prep_spec(kK)
        yield assign_spec(kK)
    yield bounds_spec()  # the pruned iterations' filter (any K)


# -- the assignment on tensor cores (cuda_templates/kmeans_assign_mma.cuh) --------------------------
# Mirror of kermac_like::KmeansAssignTraits<kK>: kK = K rounded up to 8, 16, 32 or 64; 8 warps, kMt m16
# tiles per warp (2 up to kK = 16, else 1), kBlockN centres per tile (128 up to kK = 16, else 2048 / kK),
# two stages of (kBlockN kK 8 bytes of fragments + kBlockN 4 bytes of norms).
ASSIGN_K_BUCKETS = (8, 16, 32, 64)
ASSIGN_MAX_K = ASSIGN_K_BUCKETS[-1]


def assign_k_bucket(K: int) -> int:
    """kK of the tensor-core assignment for K coordinates; 0 beyond ASSIGN_MAX_K (not served)."""
    return bucket(K, ASSIGN_K_BUCKETS, 0)


def assign_shape(kK: int) -> LaunchShape:
    mt = 2 if kK <= 16 else 1
    bn = 128 if kK <= 16 else 2048 // kK
    return LaunchShape(threads=256, block_m=8 * 16 * mt, block_n=bn, smem_bytes=2 * (bn * kK * 8 + bn * 4))


def _assign_traits(kK: int, local: bool = False) -> str:
    return f"kermac_like::KmeansAssignTraits<{int(kK)}{', true' if local else ''}>"


def assign_spec(K: int, local: bool = False) -> KernelSpec:
    """The assignment kernel (mma.sync 3xTF32, certified, the exact rescan inside) for K coordinates;
    ``local``: the certificate about each CTA's reference centre (rows ordered by their old labels; issue 42,
    bench/notes/kmeans.md), compiled on first use."""
    kK = assign_k_bucket(K)
    return KernelSpec("kmeans_assign_mma.cuh", "kermac_like::kmeans_assign_mma_kernel", _assign_traits(kK, local),
                      assign_shape(kK))


def assign_prep_spec(K: int) -> KernelSpec:
    """The one-CTA split of the centres into B fragments, their norms and the largest norm."""
    kK = assign_k_bucket(K)
    return KernelSpec("kmeans_assign_mma.cuh", "kermac_like::kmeans_assign_prep_kernel", _assign_traits(kK),
                      assign_shape(kK))


BOUNDS_LAUNCH = LaunchShape(threads=256, block_m=256, block_n=1, smem_bytes=0)


def bounds_spec() -> KernelSpec:
    """The pruned Lloyd iteration's filter (kmeans_bounds_kernel over KmeansBoundsTraits: one point per
    thread, any K): the bounds moved by the centres' drift, the points that keep their label, the work
    list of the others; or every point's exact distance to its centre."""
    return KernelSpec("kmeans_assign_mma.cuh", "kermac_like::kmeans_bounds_kernel", "kermac_like::KmeansBoundsTraits",
                      BOUNDS_LAUNCH)
