"""Spec of the tensor-core distance kernel, mma.sync (cuda_templates/distance_mma.cuh)."""

from __future__ import annotations

import torch

from ...descriptor import KernelDescriptor, PowerType
from ...layout import Layout
from .kernel_spec import SHIPPED_DESCRIPTORS, KernelSpec, LaunchShape

# Mirror of kermac_like::DistanceMmaTraits (cuda_templates/distance_mma.cuh): the same
# constants for every instantiation; the dynamic shared memory exceeds 48 KiB.
MMA_LAUNCH = LaunchShape(threads=256, block_m=128, block_n=256, smem_bytes=99840)
_MMA_TYPES = {
    torch.float32: "float",
    torch.float16: "kermac_like::float16",
    torch.bfloat16: "kermac_like::bfloat16",
}


def mma_traits_spec(desc: KernelDescriptor, out: Layout, dtype, *, tf32: bool = False, functor=None) -> KernelSpec:
    """``functor``: (C++ name, stub source) of an epilogue functor (specs.epilogue.functor of a formula
    kernel of the l2 distance): the traits then take Diff, outer Noop, Epilogue::None and the functor
    (its value of the squared distance in place of the enum epilogue)."""
    if functor is not None:
        traits = (f"kermac_like::DistanceMmaTraits<kermac_like::Inner::Diff, kermac_like::Power::Noop, "
                  f"kermac_like::Epilogue::None, {Layout.ROW_MAJOR.cpp}, {Layout.ROW_MAJOR.cpp}, {out.cpp}, "
                  f"kermac_like::Precision::{'Tf32' if tf32 else 'Tf32x3'}, float, {functor[0]}>")
        return KernelSpec("distance_mma.cuh", "kermac_like::distance_mma_kernel", traits, MMA_LAUNCH,
                          prelude=functor[1])
    outer = "kermac_like::Power::Noop" if desc.outer_power is PowerType.NOOP else "kermac_like::Power::Sqrt"
    if dtype == torch.float32:
        precision = "kermac_like::Precision::Tf32" if tf32 else "kermac_like::Precision::Tf32x3"
    else:
        precision = "kermac_like::Precision::Native16"
    row = Layout.ROW_MAJOR.cpp
    traits = (
        f"kermac_like::DistanceMmaTraits<{desc.inner_operator.cpp}, {outer}, {desc.kernel_type.cpp}, "
        f"{row}, {row}, {out.cpp}, {precision}, {_MMA_TYPES[dtype]}>"
    )
    return KernelSpec("distance_mma.cuh", "kermac_like::distance_mma_kernel", traits, MMA_LAUNCH)


def mma_spec(desc: KernelDescriptor, a, b, out, *, tf32: bool, batch_offsets_ok: bool = True, functor=None):
    """The tensor-core instantiation for these operand views, or None when the
    path does not apply (the caller then takes the exact SIMT kernel).

    Requires a Euclidean/DOT descriptor, row-major ``a`` and ``b`` with 16-byte
    aligned base pointers and rows (every batch offset too: ``batch_offsets_ok``),
    and a float32/float16/bfloat16 dtype.  ``out`` may have any layout. ``functor``: as
    :func:`mma_traits_spec`'s.
    """
    if not desc.is_euclidean or a.tensor.dtype not in _MMA_TYPES:
        return None
    if a.layout is not Layout.ROW_MAJOR or b.layout is not Layout.ROW_MAJOR or not batch_offsets_ok:
        return None
    per = 16 // a.tensor.element_size()
    for v in (a, b):
        if v.tensor.data_ptr() % 16 or (v.rows > 1 and v.ld % per):
            return None
    return mma_traits_spec(desc, out.layout, a.tensor.dtype, tf32=tf32, functor=functor)


def mma_specs_for(desc: KernelDescriptor) -> list:
    """The tensor-core instantiations ``precompile`` builds for ``desc`` (float32,
    both precisions, row-major output)."""
    if not desc.is_euclidean:
        return []
    return [mma_traits_spec(desc, Layout.ROW_MAJOR, torch.float32, tf32=t) for t in (False, True)]


def shipped():
    for desc in SHIPPED_DESCRIPTORS:
        if desc.is_euclidean:
            yield from mma_specs_for(desc)
            for dt in (torch.float16, torch.bfloat16):
                yield mma_traits_spec(desc, Layout.ROW_MAJOR, dt)

