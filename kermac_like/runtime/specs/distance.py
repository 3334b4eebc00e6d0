"""Spec of the exact fp32 SIMT distance kernel (cuda_templates/distance.cuh)."""

from __future__ import annotations

from ...descriptor import InnerOperator, KernelDescriptor, PowerType
from ...layout import Layout
from .kernel_spec import SHIPPED_DESCRIPTORS, KernelSpec, LaunchShape

# Mirror of kermac_like::DistanceTraits (cuda_templates/distance.cuh): the same
# constants for every instantiation; the dynamic shared memory exceeds 48 KiB.
DISTANCE_TUNING = (41, 32, 1)  # defaults of (kPolyPer64, kBlockK, kMinBlocksPerSm)


def distance_launch(block_k: int = 32, min_blocks: int = 1) -> LaunchShape:
    """Mirror of DistanceTraits' launch constants for a tuning (kBlockK, kMinBlocksPerSm)."""
    stride = 128 + 4
    main = 2 * (2 * block_k + 1) * stride + (256 * 64 if min_blocks > 1 else 0)  # 2 stages, each with a spare row
    return LaunchShape(threads=256, block_m=128, block_n=128, smem_bytes=4 * max(main, 128 * 129))


DISTANCE_LAUNCH = distance_launch()  # 68640 bytes of dynamic shared memory


# Measured on an H200 (bench/notes/history.md, v2): two blocks per SM with 48/64 of the
# exp2 on the FMA pipe win for fractional p (421 -> 406 ms at 30000^2 x 1024); the
# defaults stay best for p = 1, 2 and DOT. Both fit 99 KiB of shared memory (sm_86/89).
POW_TUNING = (48, 16, 2)

# Moderate K (|x - y| and (x - y)^2 sums): two blocks per SM with 16-wide k steps. cdist at
# 20000^2 on an H100, the planner's k-major copies, two interleaved passes
# (bench/probes/simt_p1_candidates.py --sweep, bench/notes/distance.md): p=1 K = 64 2.72 ->
# 2.49 ms, 96 3.69 -> 3.42, 128 4.61 -> 4.31, 192 6.46 -> 6.22, 256 8.36 -> 8.17, 384 12.12 ->
# 11.98; p=2 (exact) 128 4.93 -> 4.50, 256 8.74 -> 8.27; no gain at 512 and 768, none at 1024
# (30000^2: 69.5 either way). The gain is the second block's overlap, so the tuning is
# taken only where two blocks fit in one SM's shared memory (sm_90; not sm_80 or sm_86/89).
MODERATE_K_TUNING = (41, 16, 2)
MODERATE_K_MAX = 384
# Shared memory two such blocks take on one SM (1 KiB per block is reserved by the system).
_MODERATE_K_SM_BYTES = 2 * (distance_launch(*MODERATE_K_TUNING[1:3]).smem_bytes + 1024)


def default_distance_tuning(desc: KernelDescriptor, K: int | None = None, smem_per_sm: int = 0) -> tuple:
    """The SIMT kernel's tuning for ``desc``; with ``K`` and the device's shared memory per
    SM (bytes), the moderate-K tuning where it applies (see MODERATE_K_TUNING)."""
    if desc.inner_power is PowerType.POW:
        return POW_TUNING
    if K is not None and K <= MODERATE_K_MAX and moderate_k_applies(desc) and _MODERATE_K_SM_BYTES <= smem_per_sm:
        return MODERATE_K_TUNING
    return DISTANCE_TUNING


def moderate_k_applies(desc: KernelDescriptor) -> bool:
    return desc.inner_operator is InnerOperator.DIFF and desc.inner_power in (PowerType.ABS, PowerType.SQUARE)


def distance_tunings(desc: KernelDescriptor) -> tuple:
    """Every tuning a call with ``desc`` can get (None: the default), for precompiling."""
    return (None, MODERATE_K_TUNING) if moderate_k_applies(desc) else (None,)


def distance_spec(desc: KernelDescriptor, a: Layout, b: Layout, out: Layout, vec: int, *,
                  tuning: tuple | None = None) -> KernelSpec:
    """``vec`` (4 or 1) selects 16-byte loads of column-major inputs; row-major
    inputs are transposed into shared memory by 4-byte copies either way, so a
    row-major pair always renders as ``vec=1`` (one instantiation, not two).
    ``tuning``: (kPolyPer64, kBlockK, kMinBlocksPerSm); the defaults render no
    extra template arguments."""
    if a is Layout.ROW_MAJOR and b is Layout.ROW_MAJOR:
        vec = 1
    tuning = tuple(default_distance_tuning(desc) if tuning is None else tuning)
    extra = "" if tuning == DISTANCE_TUNING else ", " + ", ".join(str(int(v)) for v in tuning)
    traits = f"kermac_like::DistanceTraits<{desc.cpp_args()}, {a.cpp}, {b.cpp}, {out.cpp}, {vec}{extra}>"
    return KernelSpec("distance.cuh", "kermac_like::distance_kernel", traits, distance_launch(tuning[1], tuning[2]))


def shipped():
    # Row-major inputs with either output layout, and transposed (column-major)
    # inputs in both alignments; mixed input layouts compile on first use (~1 s).
    row, col = Layout.ROW_MAJOR, Layout.COL_MAJOR
    # The moderate-K tuning beside the default where it applies.
    for desc in SHIPPED_DESCRIPTORS:
        for tuning in distance_tunings(desc):
            yield distance_spec(desc, row, row, row, 1, tuning=tuning)
            yield distance_spec(desc, row, row, col, 1, tuning=tuning)
            yield distance_spec(desc, col, col, row, 4, tuning=tuning)
            yield distance_spec(desc, col, col, row, 1, tuning=tuning)
