"""Specs of the reference-point kernels (cuda_templates/centring.cuh): the per-call reference point
of the product formula (kermac_like/centring.py) and the shifted copies on a GPU, in the package's
own three kernels (their launch mirror and the shipped set)."""

from __future__ import annotations

from .kernel_spec import KernelSpec, LaunchShape

CENTRING_TRAITS = "kermac_like::CentringTraits"
CENTRING_LAUNCH = LaunchShape(threads=256, block_m=1, block_n=1)
CENTRING_COLS = 32  # CentringTraits::kCols: columns per block of the flags kernel
CENTRING_WARPS = 8  # CentringTraits::kWarps: rows per block of the shift kernel (one warp a row)
CENTRING_SAMPLE = 1024  # CentringTraits::kSample (= centring.REFERENCE_ROWS: tests/test_centring_kernels.py)


def _spec(kernel: str) -> KernelSpec:
    return KernelSpec("centring.cuh", f"kermac_like::{kernel}", CENTRING_TRAITS, CENTRING_LAUNCH)


def centring_specs() -> tuple:
    """(flags, point, shift): the three kernels of one shift, in launch order."""
    return tuple(_spec(k) for k in ("centring_flags_kernel", "centring_point_kernel", "centring_shift_kernel"))


def shipped():
    yield from centring_specs()
