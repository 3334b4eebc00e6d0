"""The matvec family (cuda_templates/matvec.cuh): which instantiation of
``matvec_kernel<MatvecTraits<...>>`` serves a call, its mirrored launch constants, and
the family's shipped set.

Mirror of ``kermac_like::MatvecTraits``: kThreads, kRows (rows of x per thread),
kBlockM = kThreads * kRows, kBlockN (y points per shared-memory tile); the compile stub
checks them with static_asserts (KernelSpec.asserts).
"""

from __future__ import annotations

import torch

from ... import formula as _formula
from ...descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType, PowerType
from . import epilogue
from .kernel_spec import CPP_TYPES, KernelSpec, LaunchShape, bucket

__all__ = [
    "K_BUCKETS",
    "C_BUCKETS",
    "MAX_C",
    "expandable",
    "k_bucket",
    "c_bucket",
    "simt_c_bucket",
    "SIMT_C_BUCKETS",
    "matvec_traits_spec",
    "TUNING",
    "matvec_spec",
    "combine_spec",
    "shipped",
    "rows_per_thread",
    "part_bytes",
    "F32_GROUP",
    "formula_matvec_spec",
    "FORMULA_TUNING",
]

THREADS = 256
# Padded K of the registers strategy (x rows in registers); K beyond the last takes the
# chunked strategy (kK = 0). Padding costs kK - K wasted inner operations per pair.
# 9: D = 8 in the expanded form (K + 1 slots): 8 FFMA per pair with the fold instead of 11 at 12.
K_BUCKETS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 24, 32)
# Columns per launch of the tensor-core kernel (matvec_wgmma.cuh) ...
C_BUCKETS = (1, 2, 4, 8, 16)
MAX_C = C_BUCKETS[-1]  # wider v runs in column chunks of MAX_C (one launch each)
# ... and of the SIMT kernel (matvec.cuh), which also takes 12: GPyTorch's products have
# 1 + 10 probe columns. Measured on an H200 (bench/probes/matvec_multicol_candidates.py,
# bench/notes/matvec.md "Several columns"): Gaussian D = 8, C = 11, N = M = 10^6: kK = 12,
# kC = 16, one row per thread 2201 ms; kK = 9, kC = 12, two rows per thread 1055 ms.
SIMT_C_BUCKETS = (1, 2, 4, 8, 12, 16)

_T = CPP_TYPES


def _out_arg(dtype, out_dtype) -> str:
    """The TOut template argument: "" for an output in the input dtype (the default), "double"
    for a float64 output of float32/16-bit inputs (the float64 mode: v, products and sums in
    float64, no final rounding)."""
    if out_dtype is None or out_dtype == dtype:
        return ""
    if out_dtype == torch.float64 and dtype in _T:
        return "double"
    raise ValueError(f"out: dtype {out_dtype} is not an output of {dtype} inputs (float64 or {dtype})")


def part_bytes(dtype, out_dtype=None) -> int:
    """Bytes per element of the split scratch (MatvecTraits::TPart): 8 for a float64 output."""
    return 8 if _out_arg(dtype, out_dtype) else 4


def _floor_pow2(x: int) -> int:
    return 8 if x >= 8 else 4 if x >= 4 else 2 if x >= 2 else 1


def rows_per_thread(kK: int, kC: int, dtype=torch.float32, wide: bool = False) -> int:
    """Mirror of MatvecTraits::kRows (``wide``: the float64 mode, TOut = double)."""
    chunked = kK == 0
    reg_k = 4 if chunked else kK
    rows = _floor_pow2(96 // (reg_k + (4 if wide else 3) * kC + (32 if chunked else 1)))
    return 4 if dtype != torch.float32 and rows == 8 else rows


def block_n(kK: int, kC: int) -> int:
    """Mirror of MatvecTraits::kBlockN."""
    if kK == 0:
        return 32
    ks = (kK + 3) // 4 * 4
    return 128 if ks + kC > 24 else 256


def expandable(desc: KernelDescriptor) -> bool:
    """Whether k is an exponential of the squared l2 distance (the expanded exponent):
    Gaussian of the l2 distance, or Laplace of the squared l2 distance."""
    if desc.inner_operator is not InnerOperator.DIFF or desc.inner_power is not PowerType.SQUARE:
        return False
    return (desc.outer_power, desc.kernel_type) in (
        (PowerType.SQRT, KernelType.GAUSSIAN),
        (PowerType.NOOP, KernelType.LAPLACE),
    )


def k_bucket(slots: int) -> int:
    """kK for ``slots`` coordinates per point (K, or K + 1 for the expanded form); 0 (chunked)
    beyond the last bucket."""
    return bucket(slots, K_BUCKETS, 0)


def c_bucket(c: int) -> int:
    """kC of the tensor-core kernel for c columns (at most MAX_C)."""
    return bucket(c, C_BUCKETS, MAX_C)


def simt_c_bucket(c: int) -> int:
    """kC of the SIMT kernel for c columns (at most MAX_C)."""
    return bucket(c, SIMT_C_BUCKETS, MAX_C)


# Rows of eight whose exponential runs on the FMA pipe in the expanded kernel. Measured on an
# H200 (bench/notes/matvec.md, v2): 0 -> 294.7 ms, 1 -> 302.3 ms at D = 3, N = M = 1e6 (the
# folded loop is issue-bound enough that the polynomial's ~10 extra instructions cost more
# than the MUFU time they free).
POLY_ROWS = 0


# Tuning of the expanded float32 kernel: {"unroll_j": points per trip, "poly_pairs": FMA-pipe
# exponentials per trip, "prefetch": register prefetch of the next tile}. Measured on an H200
# (bench/probes/matvec_d3_candidates.py, bench/notes/matvec.md v3) at D = 3, C = 1, N = M = 1e6:
# untuned 294.9 ms, prefetch + 4 points per trip + 4 of 32 exponentials on the FMA pipe 273.5 ms.
# Applied where the loop is MUFU-bound as there: kK <= 4 (D <= 3) and one column; elsewhere the
# untuned loop (more FFMA per pair: the polynomial would take issue slots the loop needs).
# Probes override it: TUNING = {...} (an empty dict: the untuned loop); None: the default.
DEFAULT_TUNING = {"unroll_j": 4, "poly_pairs": 4, "prefetch": True}
TUNING: dict | None = None


def _tuning(kK: int, kC: int) -> dict:
    if TUNING is not None:
        return dict(TUNING)
    return dict(DEFAULT_TUNING) if kK <= 4 and kC == 1 else {}


# Points of a float32 partial in the blocked float64 mode (MatvecTraits' kF32Group, the group's
# pairs fully unrolled): its group sums add at most (F32_GROUP + 1) 2^-24 sum |k v| to the float64
# mode's error (measured 0.2 2^-24 at most: the CPU shim's test_blocked_float64_mode_cpu), and the
# group's widening and float64 add cost 1/F32_GROUP of a pair's XU and FP64 work. SASS at D = 8
# (sm_90): 12.22 instructions a pair at 8 (a 391-instruction loop), 12.09 at 16 (774: 12 KB of
# code, the size of an SM partition's L0 instruction cache), 13.6 in the float64 mode.
# Probes override it (bench/probes/falkon_products.py --group).
F32_GROUP = 8


def matvec_traits_spec(desc: KernelDescriptor, dtype, kK: int, kC: int, *, expand: bool = False,
                       poly_rows: int | None = None, unroll_j: int = 0, poly_pairs: int = -1,
                       prefetch: bool = False, out_dtype=None, f32_group: int = 0) -> KernelSpec:
    """``unroll_j`` / ``poly_pairs`` / ``prefetch``: MatvecTraits' kUnrollJ / kPolyPairs / kPrefetch
    (expanded kernel only; defaults leave the template arguments out). ``out_dtype``: torch.float64
    selects TOut = double, the float64 mode (v read as float64, float64 products and sums, the
    totals stored without rounding); None or ``dtype``: the default TOut = T (the template
    argument left out, so that those names do not change). ``f32_group`` > 0 (float64 mode,
    expanded form): kF32Group, the blocked float64 mode (v staged in float32, float32 partials of
    that many points added into the float64 totals)."""
    tout = _out_arg(dtype, out_dtype)
    if f32_group and not (tout and expand and block_n(kK, kC) % f32_group == 0):
        raise ValueError("matvec_traits_spec: f32_group needs the float64 mode's expanded form and to divide kBlockN")
    rows = rows_per_thread(kK, kC, dtype, wide=bool(tout))
    if poly_rows is None:
        poly_rows = POLY_ROWS if expand and rows >= 8 else 0
    tuned = bool(unroll_j) or poly_pairs >= 0 or prefetch
    if tuned and not expand:
        raise ValueError("matvec_traits_spec: unroll_j, poly_pairs and prefetch tune the expanded kernel only")
    if prefetch and (block_n(kK, kC) != THREADS or kK > 8):
        raise ValueError("matvec_traits_spec: prefetch needs kBlockN == 256 and kK <= 8")
    extra = f", {str(bool(expand)).lower()}, {int(poly_rows)}" if (expand or poly_rows or tout) else ""
    if tuned or tout:
        extra += f", {int(unroll_j)}, {int(poly_pairs)}, {str(bool(prefetch)).lower()}"
    if tout:
        extra += f", {tout}"
    if f32_group:
        extra += f", {int(f32_group)}"
    traits = f"kermac_like::MatvecTraits<{desc.cpp_args()}, {_T[dtype]}, {int(kK)}, {int(kC)}{extra}>"
    shape = LaunchShape(threads=THREADS, block_m=THREADS * rows, block_n=block_n(kK, kC), smem_bytes=0)
    return KernelSpec("matvec.cuh", "kermac_like::matvec_kernel", traits, shape)


# Tuning of the expanded float32 kernel with an epilogue functor (Matérn, RQ, ..., user
# expressions of the squared l2 distance), D <= 3 and one column: the Gaussian's trips and prefetch,
# and more of a trip's 32 exponentials on the FMA pipe, as a functor adds a MUFU.SQRT (Matérn) or
# MUFU.LG2 (RQ) per pair to the MUFU.EX2 (prediction: bench/notes/epilogue.md; the lead's probe
# bench/probes/epilogue_matvec.py sweeps poly_pairs). Functors without an exponential keep 0.
FORMULA_TUNING = {"unroll_j": 4, "poly_pairs": 8, "prefetch": True}
# Columns up to which a functor takes the expanded form; wider v (GPyTorch's 1 + 10 probe columns,
# kC = 12) the direct form: the expanded one spills on sm_90 at kK = 9, kC = 12 (Matérn 5/2: 24
# bytes, a user expression 64; ptxas, 128 registers), the direct one at kK = 8 does not.
FORMULA_EXPAND_MAX_C = 8
# Probes force the form (True: expanded where K + 1 fits, False: direct); None: the rule above.
FORMULA_EXPAND: bool | None = None


def formula_matvec_spec(desc: KernelDescriptor, dtype, K: int, C: int, *, tuning: dict | None = None,
                        expand: bool | None = None) -> KernelSpec:
    """The instantiation of a formula kernel that an epilogue functor serves (specs.epilogue.served):
    MatvecTraits with the base Diff, Square, Noop, None and the functor; the expanded form (the
    functor's scale folded into the operands, K + 1 FFMA a pair) where K + 1 fits the register
    buckets, v has at most FORMULA_EXPAND_MAX_C columns and the kernel has no cusp at distance 0
    (specs.epilogue.smooth_at_zero), else the direct form (registers, or chunked beyond 31). ``tuning``: the trips' {"unroll_j", "poly_pairs",
    "prefetch"} (None: FORMULA_TUNING at D <= 3 and one column, the untuned loop elsewhere)."""
    name, prelude = epilogue.functor(desc)
    kC = simt_c_bucket(C)
    if expand is None and FORMULA_EXPAND is not None:
        expand = FORMULA_EXPAND
    if expand is None:
        expand = k_bucket(K + 1) != 0 and kC <= FORMULA_EXPAND_MAX_C and epilogue.smooth_at_zero(desc)
    kK = k_bucket(K + 1 if expand else K)
    expand = expand and kK != 0
    if tuning is None:
        tuning = dict(FORMULA_TUNING) if (expand and dtype == torch.float32 and kK <= 4 and kC == 1) else {}
        if tuning and not epilogue.has_exponential(desc):
            tuning["poly_pairs"] = 0
    unroll_j, poly_pairs = int(tuning.get("unroll_j", 0)), int(tuning.get("poly_pairs", -1))
    prefetch = bool(tuning.get("prefetch", False))
    if (unroll_j or poly_pairs >= 0 or prefetch) and not expand:
        raise ValueError("formula_matvec_spec: unroll_j, poly_pairs and prefetch tune the expanded kernel only")
    if prefetch and (block_n(kK, kC) != THREADS or kK > 8):
        raise ValueError("formula_matvec_spec: prefetch needs kBlockN == 256 and kK <= 8")
    rows = rows_per_thread(kK, kC, dtype)
    base = ", ".join((InnerOperator.DIFF.cpp, PowerType.SQUARE.cpp, PowerType.NOOP.cpp, KernelType.NONE.cpp))
    t = _T[dtype]
    traits = (f"kermac_like::MatvecTraits<{base}, {t}, {int(kK)}, {int(kC)}, {str(expand).lower()}, 0, "
              f"{unroll_j}, {poly_pairs}, {str(prefetch).lower()}, {t}, 0, {name}>")
    shape = LaunchShape(threads=THREADS, block_m=THREADS * rows, block_n=block_n(kK, kC), smem_bytes=0)
    return KernelSpec("matvec.cuh", "kermac_like::matvec_kernel", traits, shape, prelude=prelude)


def expands(desc: KernelDescriptor, K: int, epsilon=None) -> bool:
    """Whether matvec_spec takes the expanded exponent for a call (either output mode): an
    exponential of the squared l2 distance, no epsilon cut (the expanded exponent never forms
    the distance), and K + 1 slots within the register buckets."""
    return expandable(desc) and not (epsilon is not None and epsilon > 0) and k_bucket(K + 1) != 0


def matvec_spec(desc: KernelDescriptor, dtype, K: int, C: int, *, epsilon=None, out_dtype=None,
                f32_partials: bool = False) -> KernelSpec:
    """The instantiation serving a call: K and C (columns of one launch, at most MAX_C) of
    the data, ``epsilon`` as validated (None or a float), ``out_dtype`` the output's dtype (None:
    ``dtype``; torch.float64 with float32/16-bit data: the float64 mode, TOut = double, whose
    expanded form is the symmetric one: the caller's centre for both operands, so that K(x, y)
    and K(y, x) are bitwise transposes; no tuning knobs). ``f32_partials`` (the float64 mode):
    the blocked float64 mode (float32 partials of F32_GROUP points) where the call takes the
    expanded form; elsewhere the float64 mode."""
    wide = bool(_out_arg(dtype, out_dtype))
    expand = expands(desc, K, epsilon)
    kK = k_bucket(K + 1 if expand else K)
    tuning = {}
    kC = simt_c_bucket(C)
    if expand and not wide and dtype == torch.float32 and kK <= 8 and block_n(kK, kC) == THREADS:
        tuning = _tuning(kK, kC)
    if wide and expand and f32_partials:
        tuning = {"f32_group": F32_GROUP}
    return matvec_traits_spec(desc, dtype, kK, kC, expand=expand, out_dtype=out_dtype, **tuning)


COMBINE_LAUNCH = LaunchShape(threads=256, block_m=1, block_n=1, smem_bytes=0)


def combine_spec(dtype, out_dtype=None) -> KernelSpec:
    """The fixed-order combination of split-N partial sums (matvec_combine_kernel); ``out_dtype``
    torch.float64: float64 partial sums and output."""
    tout = _out_arg(dtype, out_dtype)
    return KernelSpec("matvec.cuh", "kermac_like::matvec_combine_kernel",
                      f"kermac_like::MatvecCombineTraits<{_T[dtype]}{', ' + tout if tout else ''}>", COMBINE_LAUNCH)


def shipped():
    """The lean shipped set: one instantiation per code path of the template (the
    Gaussian's expanded kernel at D = 3 with 1 and 16 columns, the registers strategy for
    the p-norm (inner and outer powers) and DOT, the chunked strategy, float16 and bfloat16 loads)
    and the combination kernels; the float64 mode (TOut = double, the symmetric expanded form, as
    Falkon's products take it): the D = 3 and D = 8 one-column kernels and the float32 -> float64
    combination; the blocked float64 mode's D = 3 and D = 8 one-column kernels (Falkon's products)."""
    f32 = torch.float32
    g = PRESETS["gaussian_l2"]
    yield matvec_spec(g, f32, 3, 1)
    yield matvec_traits_spec(g, f32, 4, 1, expand=True)  # the untuned loop (D <= 3 is tuned)
    yield matvec_traits_spec(g, f32, 4, 1, expand=True, poly_rows=1)  # the FMA-pipe exponential
    yield matvec_spec(g, f32, 3, 16)
    yield matvec_spec(g, f32, 8, 11)  # kC = 12, two rows per thread (GPyTorch's 1 + 10 probe columns)
    for name in ("p_norm", "dot"):
        yield matvec_spec(PRESETS[name], f32, 3, 1)
    yield matvec_spec(PRESETS["laplace_l1"], f32, 64, 1)
    yield matvec_spec(g, f32, 64, 4)
    for dt in (torch.float16, torch.bfloat16):
        yield matvec_spec(g, dt, 3, 1)
    for dt in (f32, torch.float16, torch.bfloat16):
        yield combine_spec(dt)
    for d in (3, 8):
        yield matvec_spec(g, f32, d, 1, out_dtype=torch.float64)
    for d in (3, 8):
        yield matvec_spec(g, f32, d, 1, out_dtype=torch.float64, f32_partials=True)
    yield combine_spec(f32, torch.float64)
    # epilogue functors (epilogue.cuh): Matérn 5/2 at D = 3 tuned (matern_matvec_d3) and untuned, the
    # direct chunked form at K = 64, several columns (GPyTorch's 1 + 10 probes at D = 8), and the
    # other built-in functors at D = 3
    yield formula_matvec_spec(_formula.matern(2.5), f32, 3, 1)
    yield formula_matvec_spec(_formula.matern(2.5), f32, 3, 1, tuning={})
    yield formula_matvec_spec(_formula.matern(2.5), f32, 64, 1)
    yield formula_matvec_spec(_formula.matern(2.5), f32, 8, 11)
    for d in (_formula.matern(1.5), _formula.rational_quadratic(), _formula.cauchy(),
              _formula.inverse_multiquadric(), _formula.powered_exponential()):
        yield formula_matvec_spec(d, f32, 3, 1)
