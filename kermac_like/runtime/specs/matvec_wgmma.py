"""Specs of the Hopper (sm_90a) fused kernel_matvec (cuda_templates/matvec_wgmma.cuh):
``matvec_wgmma_kernel<MatvecWgmmaTraits<...>>`` for Euclidean/DOT descriptors and float32
data, and ``matvec_carry_kernel`` (the split sums of one N range added into the float64
carry, or into out on the last range).

Mirror of ``kermac_like::MatvecWgmmaTraits``: 384 threads (loader warpgroup + 2 consumer
warpgroups), 128 x 256 tiles, a persistent grid in clusters of 2 CTAs, the stage ring and
the epilogue buffers (b norms + the v tile) in dynamic shared memory. The compile stub
checks the mirror with static_asserts (KernelSpec.asserts).
"""

from __future__ import annotations

from ...descriptor import PRESETS, InnerOperator, KernelDescriptor, PowerType
from .kernel_spec import KernelSpec, LaunchShape
from .matvec import C_BUCKETS

__all__ = ["matvec_wgmma_spec", "carry_spec", "wgmma_smem", "wgmma_launch", "epi_buffers", "shipped",
           "SHIPPED_PRESETS", "SHIPPED_C"]

_MAX_SMEM = 227 * 1024
_ALIGN_SLACK = 1024


def _stage_bytes(tf32: bool) -> int:
    return 128 * 64 + 256 * 64 * (1 if tf32 else 2)  # a, b (and B small for 3xTF32)


def _epi_bytes(diff: bool, kc: int) -> int:
    return (256 * 4 if diff else 0) + 256 * kc * 4  # b norms, v tile


def _smem_for(stages: int, bufs: int, tf32: bool, diff: bool, kc: int) -> int:
    return stages * _stage_bytes(tf32) + bufs * _epi_bytes(diff, kc) + 16 * (stages + bufs) + _ALIGN_SLACK


def epi_buffers(tf32: bool, diff: bool, kc: int) -> int:
    """Mirror of MatvecWgmmaTraits::kEpiBufs: two epilogue buffers where they fit beside
    the default ring (5 stages for 3xTF32, 8 for TF32), else one."""
    stages = 8 if tf32 else 5
    return 2 if _smem_for(stages, 2, tf32, diff, kc) <= _MAX_SMEM else 1


def wgmma_smem(tf32: bool, diff: bool, kc: int) -> int:
    """Mirror of MatvecWgmmaTraits::kSmemBytes."""
    return _smem_for(8 if tf32 else 5, epi_buffers(tf32, diff, kc), tf32, diff, kc)


def wgmma_launch(tf32: bool, diff: bool, kc: int) -> LaunchShape:
    return LaunchShape(threads=384, block_m=128, block_n=256, smem_bytes=wgmma_smem(tf32, diff, kc), persistent=True,
                       cluster=2)


def matvec_wgmma_spec(desc: KernelDescriptor, kc: int, *, tf32: bool = False) -> KernelSpec:
    """The instantiation for a Euclidean/DOT descriptor and a column bucket ``kc``
    (matvec.C_BUCKETS); ``tf32``: plain TF32 products (torch's allow_tf32) instead of 3xTF32."""
    if not desc.is_euclidean:
        raise ValueError(f"matvec_wgmma_spec: {desc!r} is not Euclidean/DOT")
    if kc not in C_BUCKETS:
        raise ValueError(f"matvec_wgmma_spec: kc={kc} is not one of {C_BUCKETS}")
    outer = "kermac_like::Power::Noop" if desc.outer_power is PowerType.NOOP else "kermac_like::Power::Sqrt"
    precision = ", kermac_like::Precision::Tf32" if tf32 else ""
    traits = (f"kermac_like::MatvecWgmmaTraits<{desc.inner_operator.cpp}, {outer}, {desc.kernel_type.cpp}, "
              f"{int(kc)}{precision}>")
    diff = desc.inner_operator is not InnerOperator.DOT
    return KernelSpec("matvec_wgmma.cuh", "kermac_like::matvec_wgmma_kernel", traits, wgmma_launch(tf32, diff, kc),
                      arch_suffix="a")


CARRY_LAUNCH = LaunchShape(threads=256, block_m=1, block_n=1, smem_bytes=0)


def carry_spec() -> KernelSpec:
    """matvec_carry_kernel (needs nothing of sm_90a, but lives beside the kernel it serves;
    compiled for sm_90a with it)."""
    return KernelSpec("matvec_wgmma.cuh", "kermac_like::matvec_carry_kernel",
                      "kermac_like::MatvecCarryTraits", CARRY_LAUNCH, arch_suffix="a")


# The shipped set (sm_90 only): the kernels of kernel methods' solvers and multi-output
# regression at large dimension (Gaussian and Laplace, one column and the full chunk of 16);
# other descriptors and column buckets compile on first use.
SHIPPED_PRESETS = ("gaussian_l2", "laplace_l2")
SHIPPED_C = (1, 16)


def shipped():
    for name in SHIPPED_PRESETS:
        for kc in SHIPPED_C:
            yield matvec_wgmma_spec(PRESETS[name], kc)
    yield carry_spec()
