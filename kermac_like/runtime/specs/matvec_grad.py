"""Spec of the kernel_matvec backward contraction (cuda_templates/matvec_grad.cuh):
the launch mirror of MatvecGradTraits, the register widths and the shipped set."""

from __future__ import annotations

from ...descriptor import PRESETS, InnerOperator, KernelDescriptor
from . import epilogue
from .kernel_spec import KernelSpec, LaunchShape

# Register widths the fused kernel is instantiated for: K (or C) is rounded up to
# the next one and zero-padded (padding adds exactly 0 to every sum).
FUSED_K_WIDTHS = (1, 2, 3, 4, 8, 16, 32)
FUSED_C_WIDTHS = (1, 2, 4, 8, 16, 32)
# Lanes that share a row where K > 32 (MatvecGradTraits' kLanes): each lane holds kK <= 32 of the
# coordinates, kK a multiple of 4 (the b tile's rows stay 16-byte aligned), K <= 32 * 8.
LANES = (1, 2, 4, 8)
MAX_K = 32 * LANES[-1]
CPP_DEFAULT_UNROLL = 2  # MatvecGradTraits' default kUnroll (not rendered)
UNROLL = 2  # what the launches use (H200: 547 ms with 2, 571 ms with 1; bench/notes/matvec_grad.md)
# ... beyond 16 coordinates a lane (one lane or several): 1 (kK = 28 at two lanes, sm_90: 168 registers and
# no spills, three CTAs an SM; unrolled twice ptxas keeps 168 and spills 16 bytes, as at kK = 20 for the
# Gaussian; the pair loop is ~113 instructions, bench/notes/rfm.md)
UNROLL_WIDE = 1


def _rows_per_thread(kk: int, kc: int) -> int:
    return max(1, min(4, 96 // (4 * kk + kc)))


def _block_n(kk_all: int) -> int:
    return 128 if kk_all <= 64 else (64 if kk_all <= 128 else 32)


def fused_widths(K: int, C: int):
    """(kK, kC) of the fused kernel for K and C at one lane a row, or None beyond 32."""
    kk = next((w for w in FUSED_K_WIDTHS if w >= K), None)
    kc = next((w for w in FUSED_C_WIDTHS if w >= C), None)
    if kk is None or kc is None or K < 1 or C < 1:
        return None
    return kk, kc


def lane_widths(K: int, C: int):
    """(kK, kC, kLanes) for K and C: one lane up to K = 32 (kK = K up to 4, else K rounded up to a multiple of
    4: padding costs work, not accuracy); beyond, the fewest
    lanes a row (2, 4, 8) that hold K in kK <= 32 coordinates each, kK = ceil(K / lanes) rounded up to
    a multiple of 4 (K = 50: 2 lanes of 28, 12 % padding; K = 100: 4 of 28). None beyond MAX_K or 32
    columns."""
    kc = next((w for w in FUSED_C_WIDTHS if w >= C), None)
    if kc is None or C < 1 or K < 1 or K > MAX_K:
        return None
    if K <= 32:  # one lane: K itself up to 4, else the next multiple of 4 (K = 20: 20, not 32)
        return (K if K <= 4 else -(-K // 4) * 4), kc, 1
    lanes = next(n for n in LANES if K <= 32 * n)
    per = -(-K // lanes)
    return -(-per // 4) * 4, kc, lanes


def matvec_grad_spec(desc: KernelDescriptor, kk: int, kc: int, epsilon: bool, *, unroll: int | None = None,
                     lanes: int = 1, functor: tuple | None = None):
    """The KernelSpec of ``matvec_grad_kernel`` for a DIFF descriptor, register widths
    (kK, kC), whether an epsilon applies, the unrolling of the pair loop (1 or 2;
    default :data:`UNROLL`, :data:`UNROLL_WIDE` beyond 16 coordinates a lane) and the lanes that share a row (:data:`LANES`; kK a multiple of 4
    beyond one). ``functor``: (C++ name, stub source) of an epilogue functor (specs.epilogue.functor; the
    traits' last parameter, phi = 2 dk/d(r2)) for ``desc`` the base squared_l2 without epsilon."""
    if desc.inner_operator is not InnerOperator.DIFF:
        raise ValueError("descriptor: the fused matvec backward serves DIFF descriptors (DOT is a matrix product)")
    unroll = (UNROLL if lanes == 1 and kk <= 16 else UNROLL_WIDE) if unroll is None else int(unroll)
    if unroll not in (1, 2):
        raise ValueError(f"unroll: must be 1 or 2, got {unroll}")
    if lanes not in LANES:
        raise ValueError(f"lanes: must be one of {LANES}, got {lanes}")
    multiple_of_4 = 4 <= kk <= 32 and kk % 4 == 0
    if kc not in FUSED_C_WIDTHS or not (multiple_of_4 or (lanes == 1 and kk in FUSED_K_WIDTHS)):
        raise ValueError(f"kk/kc: unsupported register widths ({kk}, {kc}) at {lanes} lane(s) a row")
    rows = _rows_per_thread(kk, kc)
    block_n = _block_n(kk * lanes)
    launch = LaunchShape(threads=128, block_m=128 // lanes * rows, block_n=block_n,
                         smem_bytes=block_n * (kk * lanes + kc) * 4)
    tail = ""
    if lanes != 1 or functor is not None:
        tail = f", {unroll}, {lanes}" + (f", {functor[0]}" if functor is not None else "")
    elif unroll != CPP_DEFAULT_UNROLL:
        tail = f", {unroll}"
    traits = (
        f"kermac_like::MatvecGradTraits<{desc.inner_power.cpp}, {desc.outer_power.cpp}, {desc.kernel_type.cpp}, "
        f"{kk}, {kc}, {'true' if epsilon else 'false'}{tail}>"
    )
    return KernelSpec("matvec_grad.cuh", "kermac_like::matvec_grad_kernel", traits, launch,
                      prelude="" if functor is None else functor[1])


def functor_grad_spec(desc, kk: int, kc: int, *, lanes: int = 1, unroll: int | None = None) -> KernelSpec:
    """matvec_grad_kernel of a formula kernel that an epilogue functor serves (specs.epilogue.served):
    the base Square, Noop, None with the functor (phi = 2 dk/d(r2), its slots p0, p1, p2 in bw, q, r),
    no epsilon; the widths as :func:`lane_widths` chooses them (the fused formula backward)."""
    return matvec_grad_spec(PRESETS["squared_l2"], kk, kc, False, unroll=unroll, lanes=lanes,
                            functor=epilogue.functor(desc))


def shipped():
    """The gradients of the usual kernels for 3-D point clouds with one value column
    (other widths compile on first use, ~1 s)."""
    for name in ("gaussian_l2", "laplace_l2", "laplace_l1", "l2", "l1"):
        yield matvec_grad_spec(PRESETS[name], 3, 1, False)
