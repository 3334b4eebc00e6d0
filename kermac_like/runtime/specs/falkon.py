"""Falkon's products on tensor cores (cuda_templates/falkon_mma.cuh): which instantiation of
``falkon_prep_kernel`` / ``falkon_rows_kernel`` / ``falkon_cols_kernel`` serves a product, their
mirrored launch constants, and the family's shipped set.

Mirrors of ``kermac_like::FalkonRowsTraits<kK, kC>`` and ``FalkonColsTraits<kK, kC>`` (the compile
stub checks them with static_asserts): kK = K rounded up to 8, 16 or 32; kC columns per launch (1, 2,
4, 8). Rows kernel: 8 warps of kMt m16 tiles (kMt = 4, 2, 1 for kK = 8, 16, 32, halved for kC = 4 and
1 for kC = 8), centre tiles of 128 in two stages of (fragments 128 kK 8 B + b 512 B + v 512 kC B).
Cols kernel: 8 warps of kNbw n8 blocks (min(4 / (kK / 8), 4 for kC <= 2, 2 for kC = 4, 1 for kC = 8)), x tiles of 64
rows in two stages of (fragments 4 kK 128 B + a 256 B + w 256 kC B). The prep kernel runs on the rows
traits of kC = 1.

The several-column rows kernel ``falkon_rows_pv_kernel`` (``FalkonRowsPvTraits<kK, kNq>``: kNq n8 column
tiles, kC = 8 kNq columns, products k v on tensor cores) with its v fragments from
``falkon_vprep_kernel``: 8 warps of kMt = 2 (kK = 8) or 1 m16 tiles, centre tiles of 128 in two stages of
(fragments 128 kK 8 B + b 512 B + v fragments 8 kNq 512 B).
"""

from __future__ import annotations

from .kernel_spec import KernelSpec, LaunchShape, bucket

__all__ = ["K_BUCKETS", "MAX_K", "C_BUCKETS", "PAD", "k_bucket", "c_chunk", "rows_shape", "cols_shape", "prep_spec",
           "rows_spec", "cols_spec", "pv_shape", "pv_nq", "vprep_spec", "rows_pv_spec", "shipped"]

K_BUCKETS = (8, 16, 32)
MAX_K = K_BUCKETS[-1]
C_BUCKETS = (1, 2, 4, 8)
PAD = 256  # the centres are padded to a multiple of this (both kernels' centre tiles divide it)


def k_bucket(K: int) -> int:
    """kK for K coordinates; 0 beyond MAX_K (not served)."""
    return bucket(K, K_BUCKETS, 0)


def c_chunk(C: int, kK: int) -> int:
    """kC of a launch over the first of C remaining columns: the largest bucket <= C (8 beyond; 4 at
    kK = 32, where the cols kernel would spill with 8)."""
    top = 4 if kK == 32 else 8
    return max(c for c in C_BUCKETS if c <= max(1, min(C, top)))


def _rows_mt(kK: int, kC: int) -> int:
    mt0 = {8: 4, 16: 2, 32: 1}[kK]
    return mt0 if kC <= 2 else (max(1, mt0 // 2) if kC == 4 else 1)


def rows_shape(kK: int, kC: int) -> LaunchShape:
    bn = 128
    tile = bn * kK * 8 + bn * 4 + bn * kC * 4
    return LaunchShape(threads=256, block_m=8 * 16 * _rows_mt(kK, kC), block_n=bn, smem_bytes=2 * tile)


def cols_shape(kK: int, kC: int) -> LaunchShape:
    nbw = min(max(1, 4 // (kK // 8)), 4 if kC <= 2 else (2 if kC == 4 else 1))
    tile = 4 * (kK // 8) * 32 * 32 + 64 * 4 + 64 * kC * 4
    return LaunchShape(threads=256, block_m=64, block_n=64 * nbw, smem_bytes=2 * tile)


def _rows_traits(kK: int, kC: int) -> str:
    return f"kermac_like::FalkonRowsTraits<{int(kK)}, {int(kC)}>"


def prep_spec(K: int) -> KernelSpec:
    """The centres' B fragments and b_j = -|w_j|^2 (one thread per fragment entry)."""
    kK = k_bucket(K)
    return KernelSpec("falkon_mma.cuh", "kermac_like::falkon_prep_kernel", _rows_traits(kK, 1), rows_shape(kK, 1))


def rows_spec(K: int, kC: int) -> KernelSpec:
    """K(x, z) v for kC columns: a row of x per output."""
    kK = k_bucket(K)
    return KernelSpec("falkon_mma.cuh", "kermac_like::falkon_rows_kernel", _rows_traits(kK, kC), rows_shape(kK, kC))


def cols_spec(K: int, kC: int) -> KernelSpec:
    """K(z, x) w for kC columns: a centre per output."""
    kK = k_bucket(K)
    return KernelSpec("falkon_mma.cuh", "kermac_like::falkon_cols_kernel",
                      f"kermac_like::FalkonColsTraits<{int(kK)}, {int(kC)}>", cols_shape(kK, kC))


def pv_nq(C: int) -> int:
    """kNq (n8 column tiles: 1 or 2) of a several-column launch over the first of C remaining columns: 2 (16
    columns) beyond 8."""
    return 1 if C <= 8 else 2


def pv_shape(kK: int, nq: int) -> LaunchShape:
    bn, mt = 128, (2 if kK == 8 else 1)
    tile = bn * kK * 8 + bn * 4 + bn // 16 * nq * 32 * 16
    return LaunchShape(threads=256, block_m=8 * 16 * mt, block_n=bn, smem_bytes=2 * tile)


def _pv_traits(kK: int, nq: int) -> str:
    return f"kermac_like::FalkonRowsPvTraits<{int(kK)}, {int(nq)}>"


def vprep_spec(K: int, nq: int) -> KernelSpec:
    """v's B fragments for the several-column rows kernel (one thread per fragment entry)."""
    kK = k_bucket(K)
    return KernelSpec("falkon_mma.cuh", "kermac_like::falkon_vprep_kernel", _pv_traits(kK, nq), pv_shape(kK, nq))


def rows_pv_spec(K: int, nq: int) -> KernelSpec:
    """K(x, z) v for up to 8 nq columns, k v on tensor cores (GPyTorch's CG products)."""
    kK = k_bucket(K)
    return KernelSpec("falkon_mma.cuh", "kermac_like::falkon_rows_pv_kernel", _pv_traits(kK, nq), pv_shape(kK, nq))


def shipped():
    """Regression's one column at K <= 8 and <= 16 (the prep and both products) and GPyTorch's CG products
    at K <= 8 (16 columns); other kK / kC / kNq compile on first use."""
    for kK in (8, 16):
        yield prep_spec(kK)
        yield rows_spec(kK, 1)
        yield cols_spec(kK, 1)
    # GPyTorch's CG products at K <= 8 (1 + 10 probe columns: one launch of 16)
    yield vprep_spec(8, 2)
    yield rows_pv_spec(8, 2)
