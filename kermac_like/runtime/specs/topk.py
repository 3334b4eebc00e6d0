"""The top-k family (cuda_templates/topk.cuh): which instantiation of
``topk_kernel<TopkTraits<...>>`` serves a selection call (k nearest neighbours,
kernel_topk), its mirrored launch constants, and the family's shipped set.

Mirror of ``kermac_like::TopkTraits``: kThreads, kRows (rows of x per thread, from kK and
kSel), kBlockM = kThreads * kRows, kBlockN (y points per shared-memory tile) and kSmemBytes
(the candidate buffers of the lists in memory, and the y tile); the compile stub checks them
with static_asserts.
"""

from __future__ import annotations

import torch

from ...descriptor import PRESETS, KernelDescriptor
from .kernel_spec import CPP_TYPES, KernelSpec, LaunchShape, bucket

__all__ = ["K_BUCKETS", "WIDE_K_BUCKETS", "FALLBACK_MAX_K", "SEL_BUCKETS", "MAX_K", "MAX_SELECT", "MAX_SPLIT", "MMA_MAX_SELECT", "k_bucket",
           "sel_bucket", "mma_sel", "rows_per_thread", "topk_spec", "topk_combine_spec", "topk_mma_spec", "topk_rescore_spec",
           "shipped"]

THREADS = 128
CAP = 16  # TopkTraits::kCap of the lists in memory (kSel = 0)
# Padded K of the x rows in registers (each bucket one instantiation: K = 1..8 exact, then
# steps whose padding costs at most a third of the inner operations).
K_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MAX_K = K_BUCKETS[-1]  # larger K: the tensor-core candidates (plan.topk.mma_serves), else the blocked path
# Rows of x up to 128 floats in registers (one row per thread, no spills: 166-206 registers on
# sm_90): the exact selection of the rows the tensor-core candidates leave uncertified.
WIDE_K_BUCKETS = (96, 128)
FALLBACK_MAX_K = WIDE_K_BUCKETS[-1]
MAX_SELECT = 1024  # largest k of the fused kernel (the list of a row lives in the indices output)
# Register lists (kSel): k up to the last bucket; beyond it the lists live in memory (kSel = 0).
SEL_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
MAX_SPLIT = 512  # topk_combine_kernel's kMaxSplit

_T = CPP_TYPES


def k_bucket(K: int, wide: bool = False) -> int:
    """kK for K coordinates; 0 beyond MAX_K (``wide``: FALLBACK_MAX_K) (no fused kernel)."""
    return bucket(K, K_BUCKETS + WIDE_K_BUCKETS if wide else K_BUCKETS, 0)


def sel_bucket(k: int) -> int:
    """kSel for k selected: the register list's length, or 0 (lists in memory) beyond 32."""
    return bucket(k, SEL_BUCKETS, 0)


def rows_per_thread(kK: int, kSel: int) -> int:
    """Mirror of TopkTraits::kRows (the default)."""
    if kSel == 0:
        return 1
    regs = kK + 2 * kSel
    return 4 if regs * 4 <= 80 else 2 if regs * 2 <= 80 else 1


def _launch(kK: int, kSel: int, rows: int = 0) -> LaunchShape:
    rows = rows or rows_per_thread(kK, kSel)
    ks = (kK + 3) // 4 * 4
    block_n = 256 if ks <= 16 else 128
    smem = (0 if kSel else CAP) * THREADS * rows * 8 + block_n * ks * 4
    return LaunchShape(threads=THREADS, block_m=THREADS * rows, block_n=block_n, smem_bytes=smem)


def _traits(desc: KernelDescriptor, dtype, kK: int, largest: bool, kSel: int, rows: int = 0,
            unroll_j: int = 0) -> str:
    if dtype not in _T:
        raise ValueError(f"topk: no kernel for dtype {dtype} (float32, float16, bfloat16)")
    knobs = f", {int(rows)}, {int(unroll_j)}" if rows or unroll_j else ""
    return (f"kermac_like::TopkTraits<{desc.cpp_args()}, {_T[dtype]}, {int(kK)}, {str(bool(largest)).lower()}, "
            f"{int(kSel)}{knobs}>")


# Probes override the tuning knobs: TUNING = {"rows": ..., "unroll_j": ...}; None: the defaults.
TUNING: dict | None = None


def topk_spec(desc: KernelDescriptor, dtype, K: int, largest: bool, k: int, *, rows: int = 0,
              unroll_j: int = 0) -> KernelSpec:
    """The selection kernel for ``desc`` over K coordinates (K <= FALLBACK_MAX_K) selecting k;
    ``rows`` / ``unroll_j``: TopkTraits' tuning knobs kRows / kUnrollJ (0: the default, or
    :data:`TUNING`'s)."""
    if TUNING is not None and not (rows or unroll_j):
        rows, unroll_j = TUNING.get("rows", 0), TUNING.get("unroll_j", 0)
    kK = k_bucket(K, wide=True)
    if kK == 0:
        raise ValueError(f"topk: K = {K} is beyond the fused kernel's {FALLBACK_MAX_K}")
    if not 1 <= k <= MAX_SELECT:
        raise ValueError(f"topk: k = {k} is outside the fused kernel's 1..{MAX_SELECT}")
    kSel = sel_bucket(k)
    return KernelSpec("topk.cuh", "kermac_like::topk_kernel", _traits(desc, dtype, kK, largest, kSel, rows, unroll_j),
                      _launch(kK, kSel, rows))


def topk_combine_spec(desc: KernelDescriptor, dtype, largest: bool) -> KernelSpec:
    """The merge of split-N lists (topk_combine_kernel): one per descriptor, dtype and order
    (it decodes the values), on the traits of kK = 1, kSel = 0."""
    return KernelSpec("topk.cuh", "kermac_like::topk_combine_kernel", _traits(desc, dtype, 1, largest, 0),
                      _launch(1, 0))


# -- candidates on tensor cores (cuda_templates/topk_mma.cuh), K > MAX_K ---------------------------
MMA_THREADS, MMA_BLOCK_M, MMA_BLOCK_N = 256, 128, 256  # DistanceMmaTraits' block tile
MMA_BASE_SMEM = 99840  # DistanceMmaTraits::kSmemBytes (stages and norms)
MMA_MARGIN = 8  # candidates per row beyond k
MMA_MAX_SELECT = 16  # largest k: its candidate lists (k + margin, bucketed) fit shared memory


def mma_sel(k: int) -> int:
    """TopkMmaTraits::kSel for k: the candidates kept per (row, quarter) and per row."""
    return max(8, sel_bucket(k + MMA_MARGIN))


MMA_V3_EXTRA_SMEM = 16 * 1024  # TopkMmaTraits::kExtraBytes of kVersion 3: scan rows 48..63
MMA_STAGE_BYTES = (MMA_BLOCK_M + MMA_BLOCK_N) * 64  # DistanceMmaTraits::kStageBytes
MMA_V5_MAX_K = 128  # TopkMmaTraits::kMaxKTiles * 16: the resident x tile of version 5
MMA_VERSIONS = (2, 3, 4, 5, 6)
# Version 6 (cuda_templates/topk_wgmma.cuh, sm_90a only, TF32, K <= MMA_V5_MAX_K): warp-specialised
# wgmma, 384 threads, TopkWgmmaTraits' layout: kStages stages of (16 KiB of y + the tile's norms),
# the lists, their largest keys and positions, the x norms, the barriers, 1 KiB of alignment.
MMA_V6_THREADS = 384
MMA_V6_STAGES = 7


def mma_v6_smem(sel: int) -> int:
    """TopkWgmmaTraits::kSmemBytes."""
    lists = MMA_BLOCK_M * 4
    return (MMA_V6_STAGES * (MMA_BLOCK_N * 64 + MMA_BLOCK_N * 4) + lists * sel * 8 + lists * 12 + MMA_BLOCK_M * 4
            + 2 * MMA_V6_STAGES * 8 + 1024)


def mma_smem(sel: int, version: int = 2) -> int:
    """TopkMmaTraits::kSmemBytes: the stages (v4: five), the norms, v3's extra scan rows, the lists
    (version 6: TopkWgmmaTraits::kSmemBytes)."""
    if version == 6:
        return mma_v6_smem(sel)
    base = MMA_BASE_SMEM + (MMA_STAGE_BYTES if version == 4 else 0) + (MMA_V3_EXTRA_SMEM if version == 3 else 0)
    if version == 5:  # the resident x tile, four stages of y alone, the norms
        base = MMA_V5_MAX_K // 16 * MMA_BLOCK_M * 64 + 4 * MMA_BLOCK_N * 64 + (MMA_BLOCK_M + MMA_BLOCK_N) * 4
    return base + MMA_BLOCK_M * 4 * sel * 8


def topk_mma_spec(dot: bool, largest: bool, k: int, precision: str = "Tf32", *, version: int = 2) -> KernelSpec:
    """The tensor-core candidate kernel: squared l2 distances (dot False) or dot products,
    ``precision`` "Tf32" (the candidates, rescored exactly by the planner) or "Tf32x3".
    ``version`` (TopkMmaTraits' kVersion): 2, topk_mma_kernel; 3, topk_mma_pipelined_kernel with
    the cp.async ring running on across y tiles (the next tile's first k-tiles load during the
    scan); 4, the same ring with five stages and the scan done in registers (no scan tile, no
    block barrier); 5, version 4 with the x tile resident in shared memory and four stages of y
    alone (K <= MMA_V5_MAX_K only: the caller's rule). Same arguments, grid and candidate lists
    (bit for bit) in every version. 6 (sm_90a, TF32, K <= MMA_V5_MAX_K): topk_wgmma_kernel
    (cuda_templates/topk_wgmma.cuh), same arguments, grid and scratch layout; its quarters are
    another partition of the points, so the lists differ while each row's merged kSel first
    candidates are the same set wherever the approximate values are."""
    if not 1 <= k <= MMA_MAX_SELECT:
        raise ValueError(f"topk: k = {k} is outside the tensor-core kernel's 1..{MMA_MAX_SELECT}")
    if version not in MMA_VERSIONS:
        raise ValueError(f"topk: topk_mma version {version} is not one of {MMA_VERSIONS}")
    sel = mma_sel(k)
    if version == 6:  # wgmma (sm_90a), TF32 candidates only
        if precision != "Tf32":
            raise ValueError("topk: topk_mma version 6 is TF32 only")
        traits = (f"kermac_like::TopkWgmmaTraits<kermac_like::Inner::{'Dot' if dot else 'Diff'}, "
                  f"{str(bool(largest)).lower()}, {sel}>")
        shape = LaunchShape(threads=MMA_V6_THREADS, block_m=MMA_BLOCK_M, block_n=MMA_BLOCK_N, smem_bytes=mma_v6_smem(sel))
        return KernelSpec("topk_wgmma.cuh", "kermac_like::topk_wgmma_kernel", traits, shape, arch_suffix="a")
    knob = f", {int(version)}" if version != 2 else ""
    traits = (f"kermac_like::TopkMmaTraits<kermac_like::Inner::{'Dot' if dot else 'Diff'}, "
              f"kermac_like::Precision::{precision}, {str(bool(largest)).lower()}, {sel}{knob}>")
    shape = LaunchShape(threads=MMA_THREADS, block_m=MMA_BLOCK_M, block_n=MMA_BLOCK_N, smem_bytes=mma_smem(sel, version))
    kernel = "kermac_like::topk_mma_pipelined_kernel" if version >= 3 else "kermac_like::topk_mma_kernel"
    return KernelSpec("topk_mma.cuh", kernel, traits, shape)


RESCORE_WARPS = 4  # TopkRescoreTraits::kWarps: rows per CTA, one warp each
RESCORE_MAX_SEL = 32  # TopkRescoreTraits::kMaxSel: candidates per row, one a lane


def topk_rescore_spec(dot: bool, largest: bool) -> KernelSpec:
    """The fused exact rescoring of topk_mma_kernel's candidates (cuda_templates/topk_rescore.cuh):
    one per inner operator and order; kSel, k and the square root (l2) are arguments, so four
    instantiations serve every k <= MMA_MAX_SELECT of l2, squared_l2 and dot."""
    traits = f"kermac_like::TopkRescoreTraits<kermac_like::Inner::{'Dot' if dot else 'Diff'}, {str(bool(largest)).lower()}>"
    shape = LaunchShape(threads=32 * RESCORE_WARPS, block_m=RESCORE_WARPS, block_n=RESCORE_MAX_SEL,
                        smem_bytes=RESCORE_WARPS * RESCORE_MAX_SEL * 24)
    return KernelSpec("topk_rescore.cuh", "kermac_like::topk_rescore_kernel", traits, shape)


def shipped():
    """The instantiations the public calls reach for common inputs: knn (l2, l1) at the point-
    cloud and embedding sizes, with their split merges, and kernel_topk of the Laplace and
    Gaussian kernels; float16 / bfloat16 loads once."""
    f32 = torch.float32
    for name in ("l2", "l1"):
        desc = PRESETS[name]
        for K in (2, 3, 8, 16, 32, 64):
            yield topk_spec(desc, f32, K, False, 10)
        yield topk_spec(desc, f32, 3, False, 1)  # the argmin (k-means' assignment)
        yield topk_spec(desc, f32, 3, False, 100)  # lists in memory
        yield topk_combine_spec(desc, f32, False)
    yield topk_spec(PRESETS["l2"], f32, 128, False, 10)  # knn_d128's uncertified rows
    for name in ("laplace_l2", "gaussian_l2"):
        yield topk_spec(PRESETS[name], f32, 3, True, 10)
        yield topk_combine_spec(PRESETS[name], f32, True)
    for dt in (torch.float16, torch.bfloat16):
        yield topk_spec(PRESETS["l2"], dt, 3, False, 10)
        yield topk_combine_spec(PRESETS["l2"], dt, False)
    # the planner's default versions: 6 at K <= MMA_V5_MAX_K (sm_90 only), 4 beyond. Version 5 (the planner's
    # choice off sm_90) fits no such device's shared memory (an A100 opts in to 163 KiB; version 5 needs 226 KiB),
    # so it is not shipped: KERMAC_LIKE_TOPK_MMA_VERSION=5 compiles it on first use.
    for version in (6, 4):
        yield topk_mma_spec(False, False, 10, version=version)  # knn at K > 64
        yield topk_mma_spec(True, True, 10, version=version)  # the largest dot products
    for dot in (False, True):  # their fused rescoring (plan.topk.FUSED_RESCORE): every k <= 16, either order
        for largest in (False, True):
            yield topk_rescore_spec(dot, largest)
