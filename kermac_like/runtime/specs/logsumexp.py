"""The log-domain kernel-sum family (cuda_templates/logsumexp.cuh): which instantiation of
``lse_kernel<LseTraits<...>>`` serves a kernel_logsumexp call, its mirrored launch constants,
and the family's shipped set.

Mirror of ``kermac_like::LseTraits``: kThreads, kRows (rows of x per thread, from kK and kC),
kBlockM = kThreads * kRows, kBlockN (y points per shared-memory tile) and kSmemBytes (the y
tile and its log-weight columns); the compile stub checks them with static_asserts.
"""

from __future__ import annotations

import dataclasses

import torch

from ...descriptor import PRESETS, KernelDescriptor, KernelType
from .kernel_spec import CPP_TYPES, KernelSpec, LaunchShape, bucket
from .topk import K_BUCKETS, MAX_K, k_bucket

__all__ = ["K_BUCKETS", "C_BUCKETS", "MAX_K", "MAX_C", "MAX_SPLIT", "k_bucket", "c_bucket", "rows_per_thread",
           "unroll_j", "lse_spec", "lse_combine_spec", "functor_lse_spec", "shipped", "trip_shape"]

THREADS = 128
# K_BUCKETS, MAX_K and k_bucket are topk's (x rows in registers); larger K: the blocked path.
C_BUCKETS = (1, 2, 4, 8)  # log-weight columns per launch; more columns: chunks of MAX_C
MAX_C = C_BUCKETS[-1]
MAX_SPLIT = 1024  # N splits of one call (the combine loops over them)

_T = CPP_TYPES
_GAUSS_ARGS = PRESETS["gaussian_l2"].cpp_args()
# exp(-S d^2) of the squared l2 distance: the Gaussian of the l2 distance, the Laplace of the squared one.
_EXPANDABLE = (_GAUSS_ARGS, dataclasses.replace(PRESETS["squared_l2"], kernel_type=KernelType.LAPLACE).cpp_args())


def c_bucket(C: int) -> int:
    """kC for C columns (one launch): the bucket of min(C, MAX_C)."""
    return bucket(C, C_BUCKETS, MAX_C)


# The pair loop of the fused kernel: LseTraits' (kVariant, kUnrollJ, kRows); 0 = the template's
# default. Variant 0: a running maximum per trip; 1: a lazy reference; 2: 1 with the reference and
# the scale folded into the distance (Gaussian-l2, one column); 3: 2 with the expanded exponent
# where plan/logsumexp.py's bound allows it (exp(-S d^2) of the squared l2 distance, one column).
# bench/notes/logsumexp.md.
# Probes override it: TUNING = {"variant": v, "unroll_j": u, "rows": r}; None: the default.
DEFAULT_TUNING = {"variant": 2, "unroll_j": 0, "rows": 0}
TUNING: dict | None = None


def default_tuning(kK: int, kC: int, desc: KernelDescriptor | None = None, dtype=torch.float32) -> dict:
    """The shipped pair loop for padded K and the column bucket: the lazy reference with the fold
    and, for one column of an exponential of the squared l2 distance, the expanded exponent where
    the planner allows it (variant 3; else 2, whose plain lazy loop serves where the fold does not
    apply: Laplace, several columns), 8
    points per trip for float32 Gaussian point clouds with one column (elsewhere 8 spills a few
    registers on sm_90), 4 up to K = 16, the template's default beyond. Measured on an H200 at 10^6 x 10^6 (bench/probes/lse_variants.py, ms, kernel_matvec
    beside): D = 3, C = 1: 537 (variant 0) -> 369 (v2, 8 per trip), matvec 274; D = 16, C = 1
    (N = 2.5e5): 373 -> 341 (v2, 4), matvec 331; D = 3, C = 4 (N = 2.5e5): 440 -> 278 (v1, 4)."""
    wide = kK <= 4 and kC == 1 and dtype == torch.float32 and (desc is None or desc.cpp_args() == _GAUSS_ARGS)
    unroll = 8 if wide else 4 if kK <= 16 else 0
    # (float32, K 3..16: there ptxas spills nothing on sm_80 / sm_90; at K = 2, 64 and for 16-bit
    # inputs variant 3 spilled 12-36 bytes, so they keep variant 2)
    expand = (kC == 1 and 3 <= kK <= 16 and dtype == torch.float32
              and (desc is None or desc.cpp_args() in _EXPANDABLE))
    return dict(DEFAULT_TUNING, variant=3 if expand else DEFAULT_TUNING["variant"], unroll_j=unroll)


def rows_per_thread(kK: int, kC: int) -> int:
    """Mirror of LseTraits::kRows (the default)."""
    regs = kK + 2 * kC
    return 4 if regs * 4 <= 80 else 2 if regs * 2 <= 80 else 1


def unroll_j(kK: int, kC: int) -> int:
    """Mirror of LseTraits::kUnrollJ (the default)."""
    ks = (kK + 3) // 4 * 4
    return (4 if kC <= 2 else 2) if ks <= 8 else 2 if ks <= 16 else 1


def _launch(kK: int, kC: int, rows: int = 0) -> LaunchShape:
    rows = rows or rows_per_thread(kK, kC)
    ks = (kK + 3) // 4 * 4
    block_n = 256 if ks <= 16 else 128
    return LaunchShape(threads=THREADS, block_m=THREADS * rows, block_n=block_n, smem_bytes=block_n * (ks + kC) * 4)


def _traits(desc: KernelDescriptor, dtype, kK: int, kC: int, variant: int = 0, unroll: int = 0,
            rows: int = 0) -> str:
    if dtype not in _T:
        raise ValueError(f"logsumexp: no kernel for dtype {dtype} (float32, float16, bfloat16)")
    extra = f", {int(variant)}, {int(unroll)}, {int(rows)}" if (variant or unroll or rows) else ""
    return f"kermac_like::LseTraits<{desc.cpp_args()}, {_T[dtype]}, {int(kK)}, {int(kC)}{extra}>"


def lse_spec(desc: KernelDescriptor, dtype, K: int, C: int, *, variant: int | None = None,
             unroll_j: int | None = None, rows: int | None = None) -> KernelSpec:
    """The kernel for ``desc`` (a Laplace or Gaussian distance kernel) over K coordinates
    (K <= MAX_K) and C log-weight columns (one launch takes at most MAX_C of them).
    ``variant`` / ``unroll_j`` / ``rows``: LseTraits' kVariant / kUnrollJ / kRows (None: TUNING,
    else DEFAULT_TUNING; 0: the template's default, left out of the name)."""
    kK = k_bucket(K)
    if kK == 0:
        raise ValueError(f"logsumexp: K = {K} is beyond the fused kernel's {MAX_K}")
    kC = c_bucket(C)
    tune = default_tuning(kK, kC, desc, dtype) if TUNING is None else dict(TUNING)
    v = tune.get("variant", 0) if variant is None else variant
    u = tune.get("unroll_j", 0) if unroll_j is None else unroll_j
    r = tune.get("rows", 0) if rows is None else rows
    if v not in (0, 1, 2, 3) or not 0 <= u <= 8 or not 0 <= r <= 8:
        raise ValueError(f"logsumexp: variant {v}, unroll_j {u}, rows {r} out of range")
    return KernelSpec("logsumexp.cuh", "kermac_like::lse_kernel", _traits(desc, dtype, kK, kC, v, u, r),
                      _launch(kK, kC, r))


def functor_lse_spec(functor: tuple, dtype, K: int, C: int) -> KernelSpec:
    """lse_kernel of a positive formula kernel that an epilogue functor serves: the base squared_l2,
    kVariant 0 (a running maximum per trip), the term log2 k = Epi::log2_value of the exact squared
    distance; ``functor``: (C++ name, stub source) of specs.epilogue.functor."""
    kK = k_bucket(K)
    if kK == 0:
        raise ValueError(f"logsumexp: K = {K} is beyond the fused kernel's {MAX_K}")
    kC = c_bucket(C)
    traits = _traits(PRESETS["squared_l2"], dtype, kK, kC).rstrip(">") + f", 0, 0, 0, {functor[0]}>"
    return KernelSpec("logsumexp.cuh", "kermac_like::lse_kernel", traits, _launch(kK, kC), prelude=functor[1])


def trip_shape(spec: KernelSpec) -> tuple:
    """(points per trip, rows per thread) of an lse_kernel spec (from its traits' arguments)."""
    args = [a.strip() for a in spec.traits.rstrip(">").split(",")]
    kK, kC = int(args[5]), int(args[6])
    u = int(args[8]) if len(args) > 8 else 0
    r = int(args[9]) if len(args) > 9 else 0
    return u or unroll_j(kK, kC), r or rows_per_thread(kK, kC)


def lse_combine_spec(desc: KernelDescriptor, dtype, C: int) -> KernelSpec:
    """The combination of split-N partial sums (lse_combine_kernel): one per descriptor,
    dtype and column bucket (the scratch's row length), on the traits of kK = 1."""
    kC = c_bucket(C)
    return KernelSpec("logsumexp.cuh", "kermac_like::lse_combine_kernel", _traits(desc, dtype, 1, kC),
                      _launch(1, kC))


def shipped():
    """The instantiations the public calls reach for common inputs: the Gaussian and Laplace
    kernels of point clouds (K = 2, 3) and small embeddings (8, 16, 64), one column (Sinkhorn's
    potentials; Gaussian K = 3, 8, 16: variant 3, the expanded exponent, and K = 3's variant 2 for
    the calls it does not serve) and a few, with their split combinations; float16 / bfloat16 once."""
    f32 = torch.float32
    for name in ("gaussian_l2", "laplace_l2"):
        desc = PRESETS[name]
        for K in (2, 3, 8, 16, 64):
            yield lse_spec(desc, f32, K, 1)
        if name == "gaussian_l2":  # the direct form's kernel (KERMAC_LIKE_LSE_EXPAND=0, batched calls)
            yield lse_spec(desc, f32, 3, 1, variant=2)
        yield lse_spec(desc, f32, 3, MAX_C)
        yield lse_combine_spec(desc, f32, 1)
        yield lse_combine_spec(desc, f32, MAX_C)
    for dt in (torch.float16, torch.bfloat16):
        yield lse_spec(PRESETS["gaussian_l2"], dt, 3, 1)
        yield lse_combine_spec(PRESETS["gaussian_l2"], dt, 1)
