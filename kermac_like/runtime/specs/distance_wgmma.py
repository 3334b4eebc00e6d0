"""Specs of the Hopper tensor-core distance kernel (wgmma, sm_90a;
cuda_templates/distance_wgmma.cuh) and of its b preparation (wgmma_prepare.cuh)."""

from __future__ import annotations

import torch

from ... import config
from ...descriptor import InnerOperator, KernelDescriptor, PowerType
from ...layout import Layout
from .distance_mma import mma_spec
from .kernel_spec import SHIPPED_DESCRIPTORS, KernelSpec, LaunchShape

# Mirror of kermac_like::DistanceWgmmaTraits (cuda_templates/distance_wgmma.cuh): float32
# data only; 384 threads (loader warpgroup + 2 consumer warpgroups), a persistent grid;
# the dynamic shared memory depends on the precision (3xTF32 stages carry a "small" b
# tile). Compiled for "sm_90a" (arch_suffix "a"): wgmma exists on no other target.
# Launched in clusters of 2 CTAs (M-tile pairs that share each b block by multicast), each
# launch preceded by wgmma_prepare_b_kernel (b in the kernel's shared-memory image, B small
# for 3xTF32, b row norms for distances), which :func:`wgmma_prepare_spec` renders.
# Chunked (3xTF32 only; DistanceWgmmaTraits::kChunkTiles, setting wgmma_chunk): 128 x 128 tiles
# (or 128 x 192: kChunkN, setting wgmma_tile) whose products sum in fresh partial sums of 1 or 2
# k-tiles; one running sum: 128 x 256 tiles.
WGMMA_TILES = (128, 192, 256)  # the chunked kernel's tile widths (the setting wgmma_tile's choices)


def _wgmma_smem(tf32: bool, block_n: int) -> int:  # (256: also the partial sums in column halves)
    stages = 5 if block_n == 256 and not tf32 else 6 if block_n == 192 else 8
    stage = 128 * 64 + block_n * 64 * (1 if tf32 else 2) + block_n * 4  # a, b, (B small), b norms
    stage = -(-stage // 1024) * 1024  # the swizzle's 1 KiB alignment
    return stages * stage + 2 * stages * 8 + 1024  # stages, barriers, alignment


WGMMA_LAUNCH = {  # (tf32, the tile's columns)
    (tf32, n): LaunchShape(threads=384, block_m=128, block_n=n, smem_bytes=_wgmma_smem(tf32, n), persistent=True,
                           cluster=2)
    for tf32, n in ((False, 256), (True, 256), (False, 128), (False, 192))
}
WGMMA_PREPARE_TILE = 256  # WgmmaPrepareTraits::kTileN: the prepared b blocks' rows, whatever the tile
WGMMA_PREPARE_LAUNCH = LaunchShape(threads=256, block_m=8, block_n=1)  # one warp per row of b


def wgmma_chunk(desc: KernelDescriptor, *, tf32: bool, chunk: int = 2, K: int | None = None) -> int:
    """The k-tiles per partial sum of a call of ``desc`` (the traits' kChunkTiles): the setting
    wgmma_chunk (``chunk``) for 3xTF32 distances; 0 (one running sum, 128 x 256 tiles) for plain
    TF32 and DOT, and where the call's ``K`` fits in one partial sum (the same sums either way)."""
    if tf32 or desc.inner_operator is InnerOperator.DOT or (K is not None and K <= 16 * chunk):
        return 0
    return chunk


def wgmma_traits_spec(desc: KernelDescriptor, out: Layout, *, tf32: bool = False, functor=None,
                      chunk: int = 0, tile: int = 128) -> KernelSpec:
    """``functor``: (C++ name, stub source) of an epilogue functor (specs.epilogue.functor), as
    distance_mma.mma_traits_spec's: Diff, outer Noop, Epilogue::None and the functor. ``chunk``:
    :func:`wgmma_chunk`'s answer (the traits' kChunkTiles); ``tile``: the chunked tiles' columns
    (the setting wgmma_tile; the traits' kChunkN where not the default 128; 256: the partial sums
    column half by column half), ignored without chunk."""
    if tile not in WGMMA_TILES:
        raise ValueError(f"wgmma tile width {tile!r}: one of {WGMMA_TILES}")
    outer = "kermac_like::Power::Noop" if desc.outer_power is PowerType.NOOP else "kermac_like::Power::Sqrt"
    precision = "kermac_like::Precision::Tf32" if tf32 else "kermac_like::Precision::Tf32x3"
    row = Layout.ROW_MAJOR.cpp
    wide = f", {tile}" if chunk and tile != 128 else ""
    tail = f", 0, void, {chunk}{wide}" if chunk else ""
    launch = WGMMA_LAUNCH[tf32, (tile if chunk else 256)]
    if functor is not None:
        tail = f", 0, {functor[0]}" + (f", {chunk}{wide}" if chunk else "")
        traits = (f"kermac_like::DistanceWgmmaTraits<kermac_like::Inner::Diff, kermac_like::Power::Noop, "
                  f"kermac_like::Epilogue::None, {row}, {row}, {out.cpp}, {precision}, float{tail}>")
        return KernelSpec("distance_wgmma.cuh", "kermac_like::distance_wgmma_kernel", traits, launch,
                          arch_suffix="a", prelude=functor[1])
    traits = (
        f"kermac_like::DistanceWgmmaTraits<{desc.inner_operator.cpp}, {outer}, {desc.kernel_type.cpp}, "
        f"{row}, {row}, {out.cpp}, {precision}, float{tail}>"
    )
    return KernelSpec("distance_wgmma.cuh", "kermac_like::distance_wgmma_kernel", traits, launch, arch_suffix="a")


def wgmma_prepare_spec(*, small: bool, norms: bool) -> KernelSpec:
    """The b preparation a wgmma launch needs: b's blocks, plus B small (``small``, 3xTF32)
    and the row norms (``norms``, distances, not DOT)."""
    traits = f"kermac_like::WgmmaPrepareTraits<{str(bool(small)).lower()}, {str(bool(norms)).lower()}>"
    return KernelSpec("wgmma_prepare.cuh", "kermac_like::wgmma_prepare_b_kernel", traits, WGMMA_PREPARE_LAUNCH,
                      arch_suffix="a")


def wgmma_prepare_needs(desc: KernelDescriptor, *, tf32: bool) -> tuple:
    """(small, norms): what a wgmma launch of ``desc`` reads prepared besides b's blocks:
    B small for 3xTF32, the b row norms for distances (not DOT)."""
    return not tf32, desc.inner_operator is not InnerOperator.DOT


def wgmma_spec(desc: KernelDescriptor, a, b, out, *, tf32: bool, batch_offsets_ok: bool = True,
               chunk: int = 2, tile: int = 128, functor=None):
    """The sm_90a (wgmma) instantiation for these operand views, or None when it does
    not apply: the requirements of :func:`mma_spec`, float32 data only. The caller
    checks that the device is sm_90. ``chunk``: the setting wgmma_chunk; ``tile``: the setting
    wgmma_tile; ``functor``: as :func:`wgmma_traits_spec`'s."""
    if a.tensor.dtype != torch.float32:
        return None
    if mma_spec(desc, a, b, out, tf32=tf32, batch_offsets_ok=batch_offsets_ok) is None:
        return None
    return wgmma_traits_spec(desc, out.layout, tf32=tf32, functor=functor, tile=tile,
                             chunk=wgmma_chunk(desc, tf32=tf32, chunk=chunk, K=a.tensor.shape[-1]))

def wgmma_specs_for(desc: KernelDescriptor, tile: int | None = None) -> list:
    """The wgmma instantiations a call of ``desc`` can reach with a row-major output: per precision
    the default's partial sums (tiles ``tile`` wide, default the setting wgmma_tile) and one running
    sum (K <= 32, plain TF32, DOT)."""
    tile = config.get("wgmma_tile") if tile is None else tile
    return [wgmma_traits_spec(desc, Layout.ROW_MAJOR, tf32=tf32, chunk=chunk, tile=tile)
            for tf32 in (False, True) for chunk in dict.fromkeys((wgmma_chunk(desc, tf32=tf32), 0))]


def shipped():
    for desc in SHIPPED_DESCRIPTORS:
        if desc.is_euclidean:
            yield from wgmma_specs_for(desc)
    for small in (True, False):
        for norms in (True, False):
            yield wgmma_prepare_spec(small=small, norms=norms)

