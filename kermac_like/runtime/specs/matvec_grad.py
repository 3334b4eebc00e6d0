"""Spec of the kernel_matvec backward contraction (cuda_templates/matvec_grad.cuh):
the launch mirror of MatvecGradTraits, the register widths and the shipped set."""

from __future__ import annotations

from ...descriptor import PRESETS, InnerOperator, KernelDescriptor
from .kernel_spec import KernelSpec, LaunchShape

# Register widths the fused kernel is instantiated for: K (or C) is rounded up to
# the next one and zero-padded (padding adds exactly 0 to every sum).
FUSED_K_WIDTHS = (1, 2, 3, 4, 8, 16, 32)
FUSED_C_WIDTHS = (1, 2, 4, 8, 16, 32)
CPP_DEFAULT_UNROLL = 2  # MatvecGradTraits' default kUnroll (not rendered)
UNROLL = 2  # what the launches use (H200: 547 ms with 2, 571 ms with 1; bench/notes/matvec_grad.md)


def _rows_per_thread(kk: int, kc: int) -> int:
    return max(1, min(4, 96 // (4 * kk + kc)))


def fused_widths(K: int, C: int):
    """(kK, kC) of the fused kernel for K and C, or None beyond 32."""
    kk = next((w for w in FUSED_K_WIDTHS if w >= K), None)
    kc = next((w for w in FUSED_C_WIDTHS if w >= C), None)
    if kk is None or kc is None or K < 1 or C < 1:
        return None
    return kk, kc


def matvec_grad_spec(desc: KernelDescriptor, kk: int, kc: int, epsilon: bool, *, unroll: int | None = None):
    """The KernelSpec of ``matvec_grad_kernel`` for a DIFF descriptor, register widths
    (kK, kC), whether an epsilon applies and the unrolling of the pair loop (1 or 2;
    default :data:`UNROLL`)."""
    if desc.inner_operator is not InnerOperator.DIFF:
        raise ValueError("descriptor: the fused matvec backward serves DIFF descriptors (DOT is a matrix product)")
    unroll = UNROLL if unroll is None else int(unroll)
    if unroll not in (1, 2):
        raise ValueError(f"unroll: must be 1 or 2, got {unroll}")
    if kk not in FUSED_K_WIDTHS or kc not in FUSED_C_WIDTHS:
        raise ValueError(f"kk/kc: unsupported register widths ({kk}, {kc})")
    rows = _rows_per_thread(kk, kc)
    launch = LaunchShape(threads=128, block_m=128 * rows, block_n=128, smem_bytes=128 * (kk + kc) * 4)
    traits = (
        f"kermac_like::MatvecGradTraits<{desc.inner_power.cpp}, {desc.outer_power.cpp}, {desc.kernel_type.cpp}, "
        f"{kk}, {kc}, {'true' if epsilon else 'false'}{'' if unroll == CPP_DEFAULT_UNROLL else f', {unroll}'}>"
    )
    return KernelSpec("matvec_grad.cuh", "kermac_like::matvec_grad_kernel", traits, launch)


def shipped():
    """The gradients of the usual kernels for 3-D point clouds with one value column
    (other widths compile on first use, ~1 s)."""
    for name in ("gaussian_l2", "laplace_l2", "laplace_l1", "l2", "l1"):
        yield matvec_grad_spec(PRESETS[name], 3, 1, False)
