"""Kernel specs: which C++ instantiation serves a call, and how it is written.

Every kernel family has a traits struct in C++ (``cuda_templates/*.cuh``) and a
module here (distance, distance_lowk, distance_mma, distance_wgmma, cdist_grad) that mirrors, field
for field, the constants the launcher needs
(threads, block tile, dynamic shared memory) and renders:

* the NVRTC *name expression* of an instantiation, e.g.
  ``kermac_like::distance_kernel<kermac_like::DistanceTraits<...>>``;
* the compile stub: the family's header plus one ``static_assert`` per
  mirrored constant, so a stale mirror fails to compile (in CI, without a GPU)
  instead of launching a wrong grid.

It also lists the *shipped set*: the instantiations ``precompile --all``
builds, chosen as the ones the public API reaches for common inputs
(:data:`FAMILIES`: one generator per family).
"""

from __future__ import annotations

# Every family's names, re-exported: ``from kermac_like.runtime.specs import distance_spec``.
from . import cdist_grad, distance, distance_lowk, distance_mma, distance_wgmma, matvec, matvec_grad  # noqa: F401
from . import centring, falkon, kmeans, logsumexp, matvec_wgmma, topk  # noqa: F401
from .cdist_grad import (  # noqa: F401
    ABS_GRAD_TUNING,
    GRAD_LAUNCH,
    GRAD_MMA_KINDS,
    GRAD_MMA_LAUNCH,
    GRAD_MMA_MIN_BLOCKS,
    GRAD_MMA_SM90,
    GRAD_TUNING,
    grad_kernel_spec,
    grad_mma_spec,
    grad_spec,
)
from .distance import (  # noqa: F401
    DISTANCE_LAUNCH,
    DISTANCE_TUNING,
    MODERATE_K_MAX,
    MODERATE_K_TUNING,
    POW_TUNING,
    default_distance_tuning,
    distance_launch,
    distance_spec,
    distance_tunings,
    moderate_k_applies,
)
from .distance_lowk import (  # noqa: F401
    LOWK_GENERIC_MAX_K,
    LOWK_MAX_K,
    LOWK_MIN_BLOCKS,
    LOWK_TILES_N,
    desc_mm_ok,
    lowk_bucket,
    lowk_spec,
    lowk_threads_n,
    lowk_tiles_n,
)
from .distance_mma import MMA_LAUNCH, mma_spec, mma_specs_for, mma_traits_spec  # noqa: F401
from .distance_wgmma import (  # noqa: F401
    WGMMA_LAUNCH,
    WGMMA_PREPARE_LAUNCH,
    WGMMA_PREPARE_TILE,
    wgmma_chunk,
    wgmma_prepare_needs,
    wgmma_prepare_spec,
    wgmma_spec,
    wgmma_specs_for,
    wgmma_traits_spec,
)
from .kernel_spec import SHIPPED_DESCRIPTORS, KernelSpec, LaunchShape, render_source  # noqa: F401
from ...layout import Layout  # noqa: F401  (the layouts the spec functions take)

__all__ = [
    "LaunchShape",
    "KernelSpec",
    "render_source",
    "distance_spec",
    "lowk_spec",
    "lowk_bucket",
    "mma_spec",
    "wgmma_spec",
    "wgmma_prepare_spec",
    "wgmma_prepare_needs",
    "wgmma_chunk",
    "wgmma_specs_for",
    "WGMMA_PREPARE_TILE",
    "grad_spec",
    "grad_mma_spec",
    "grad_kernel_spec",
    "shipped_specs",
    "FAMILIES",
]

# The shipped set of each family (``precompile --all``), in this order. A new family
# registers its generator here.
FAMILIES = {
    "distance": distance.shipped,
    "distance_mma": distance_mma.shipped,
    "cdist_grad": cdist_grad.shipped,
    "distance_wgmma": distance_wgmma.shipped,  # sm_90 only (KernelSpec.supports)
    "cdist_grad_mma": cdist_grad.shipped_mma,
    "distance_lowk": distance_lowk.shipped,
    "matvec": matvec.shipped,
    "matvec_grad": matvec_grad.shipped,
    "matvec_wgmma": matvec_wgmma.shipped,  # sm_90 only (KernelSpec.supports)
    "topk": topk.shipped,
    "logsumexp": logsumexp.shipped,
    "kmeans": kmeans.shipped,
    "falkon": falkon.shipped,
    "centring": centring.shipped,  # last: the earlier families' NVRTC programs stay as they were
}


def shipped_specs(families=None) -> list:
    """Every instantiation ``precompile --all`` builds (optionally some families)."""
    names = FAMILIES if families is None else families
    out = []
    for name in names:
        out.extend(FAMILIES[name]())
    return list(dict.fromkeys(out))
