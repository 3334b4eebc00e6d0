"""Mirror of kermac_like::DistanceLowKTraits (cuda_templates/distance_lowk.cuh), the
exact SIMT kernel for low dimension K: launch constants, the compiled K, tile shape and
tiles per block a call gets, the shipped set."""

from __future__ import annotations

from ...descriptor import PRESETS, InnerOperator, KernelDescriptor, PowerType
from ...layout import Layout
from .kernel_spec import KernelSpec, LaunchShape

__all__ = ["LOWK_MAX_K", "LOWK_GENERIC_MAX_K", "LOWK_CHUNKED_MAX_K", "desc_mm_ok", "lowk_bucket", "lowk_chunks",
           "lowk_threads_n", "lowk_tiles_n", "lowk_launch", "lowk_spec", "shipped"]

# Mirror of kermac_like::DistanceLowKTraits (cuda_templates/distance_lowk.cuh): 256 threads,
# 128 x 128 outputs per block, row-major output (a column-major out is launched as out^T),
# the dynamic shared memory holds kChunkK k of both operands' tiles.
LOWK_MAX_K = 64  # largest compile-time kK; beyond it the generic (kK = 0) variant
LOWK_GENERIC_MAX_K = 256  # one running sum per output: the generic variant serves K up to here
LOWK_MIN_BLOCKS = 2  # default of kMinBlocksPerSm (renders no extra argument)
# The chunk stream (kChunksK > 1: compile-time kK in chunks through two stages, the block's
# tiles one stream of (tile, chunk) steps; bench/notes/lowk.md, session 8): the template's
# limit, and the K up to which the planner gives it: 128, measured on an H100
# (bench/probes/p1_moderate_k_candidates.py, bench/results/2026-11-26-session12/run5; p = 1 at
# 20000^2, ms, SIMT -> stream): K = 100 3.772 -> 3.408, K = 128 4.203 -> 4.123; at K = 200 the
# stream gains nothing (6.566 -> 6.582), so the SIMT kernel keeps K > 128. plan.autotune's
# default table takes the low-K kernel for p = 1 up to it.
LOWK_CHUNKED_MAX_K = 256
LOWK_CHUNKED_UP_TO = 128
LOWK_CHUNK_K = 32  # most k per chunk the planner gives (two stages of 128 x 128 tiles: 68.6 KB)


def lowk_chunks(K: int) -> int:
    """k-chunks (kChunksK) of the compile-time variant that serves ``K``: 1 up to
    LOWK_MAX_K (the whole K in shared memory), ceil(K / LOWK_CHUNK_K) up to
    LOWK_CHUNKED_UP_TO, 0 beyond (the generic run-time-K variant)."""
    if K <= LOWK_MAX_K:
        return 1
    if K <= min(LOWK_CHUNKED_UP_TO, LOWK_CHUNKED_MAX_K):
        return -(-int(K) // LOWK_CHUNK_K)
    return 0


def lowk_bucket(K: int, chunks: int | None = None) -> int:
    """The compile-time kK that serves ``K`` in ``chunks`` k-chunks (default
    :func:`lowk_chunks`): K itself in one chunk (up to LOWK_MAX_K; one instantiation per
    K: zero-filled k cost up to 17 % more arithmetic in the multiples-of-8 buckets used
    before), K rounded up to whole chunks (chunks * ceil(K / chunks): fewer than
    ``chunks`` zero-filled k), 0 (K at run time) for chunks = 0."""
    chunks = lowk_chunks(K) if chunks is None else int(chunks)
    if chunks == 0:
        return 0
    K = max(int(K), 1)
    return chunks * -(-K // chunks)


LOWK_THREADS_N = 16  # default of kThreadsN: 128 x 128 tiles
# Tiles per block along n at compile-time K (kTilesN; the template's default is 1): a's tile
# loaded once, b's next tile copied with cp.async while the current one is computed and
# stored. H100, bench/probes/lowk_p1_candidates.py (bench/notes/lowk.md): p=1 K = 37
# 1.707 -> 1.409 ms with kK = 37 (4 and 8 tiles 1.411 / 1.396), K = 16 0.868 -> 0.737,
# K = 8 3-6 % faster for every op, K <= 3 unchanged.
LOWK_TILES_N = 2


def desc_mm_ok(desc: KernelDescriptor) -> bool:
    """Whether kMmNonFinite applies: the squared-difference (Euclidean) inner operator."""
    return desc.inner_operator is InnerOperator.DIFF and desc.inner_power is PowerType.SQUARE


def lowk_launch(kk: int, threads_n: int = LOWK_THREADS_N, tiles_n: int = 1, chunks: int = 1) -> LaunchShape:
    """Mirror of kBlockM, kBlockN (= kTilesN tiles of kTileN) and kSmemBytes (b's tile
    twice when kTilesN > 1; two stages of a's and b's chunk when kChunksK > 1)."""
    bm, tn = (256 // threads_n) * 8, threads_n * 8
    chunk = kk // chunks if kk > 0 else 8192 // (bm + tn) // 4 * 4
    if chunks > 1:
        floats = 2 * (chunk * (bm + 4) + (chunk + 1) * (tn + 4))
    else:
        floats = chunk * (bm + 4) + (2 if tiles_n > 1 else 1) * (chunk + 1) * (tn + 4)
    return LaunchShape(threads=256, block_m=bm, block_n=tn * tiles_n, smem_bytes=floats * 4)


def lowk_tiles_n(K: int, M: int, N: int, batch: int, blocks_per_wave: int) -> int:
    """Tiles per block along n (kTilesN) for an M x N output (row-major; ``batch``
    entries) at dimension K, ``blocks_per_wave`` blocks in flight (2 per SM): 8 tiles
    beyond K = 8 (fewer exposed first loads per tile: p=1 at 20000^2, H100, K = 16 / 32 /
    37 / 64: 0.730 / 1.198 / 1.380 / 2.162 ms with 2 tiles, 0.717 / 1.171 / 1.337 / 2.084
    with 8), 4 where 8 would leave fewer than 4 waves of blocks, else LOWK_TILES_N (also at
    K <= 8, where 2, 4 and 8 tiles measured within 1-3 %); 1 for the run-time-K variant."""
    if lowk_bucket(K) == 0:
        return 1
    if K <= 8:
        return LOWK_TILES_N
    tile = lowk_launch(K, lowk_threads_n(K))  # one tile per block: its block_n is the tile's width
    for t in (8, 4):
        if -(-M // tile.block_m) * -(-N // (tile.block_n * t)) * max(batch, 1) >= 4 * blocks_per_wave:
            return t
    return LOWK_TILES_N


def lowk_threads_n(K: int) -> int:
    """The tile shape for K (H200, bench/notes/lowk.md, run 2): 64 x 256 tiles up to K = 4
    (longer store runs; p=1 K=3 0.547 -> 0.529 ms, p=2 0.684 -> 0.637), 128 x 128 beyond
    (a's reuse: p=1 K=8 0.596 vs 0.644)."""
    return 32 if K <= 4 else LOWK_THREADS_N


def lowk_spec(desc: KernelDescriptor, a: Layout, b: Layout, K: int, *, min_blocks: int = LOWK_MIN_BLOCKS,
              threads_n: int | None = None, mufu_epilogue: bool = True, mm_nonfinite: bool = False,
              tiles_n: int | None = None, chunks: int | None = None, functor: tuple | None = None) -> KernelSpec:
    """The low-K instantiation for inputs of layouts ``a``, ``b`` and dimension ``K``
    (output row-major; the caller swaps the operands for a column-major out).
    ``min_blocks`` (kMinBlocksPerSm, 1..3) and ``threads_n`` (kThreadsN: 16, 32, 64 for
    128 x 128, 64 x 256, 32 x 512 tiles; default :func:`lowk_threads_n`): tuning; the
    template defaults (2, 16) render no extra arguments. ``mufu_epilogue``: square root and
    exponential on MUFU (default) or the IEEE sqrtf/expf sequences. ``mm_nonfinite``
    (Euclidean descriptors, K <= LOWK_MAX_K): infinities and overflows as torch.cdist's
    matrix-product path gives them (kMmNonFinite), for calls that mirror its choice.
    ``tiles_n`` (kTilesN, 1..8, compile-time K only; default LOWK_TILES_N there, 1 for the
    run-time-K variant; the planner passes :func:`lowk_tiles_n`): tiles per block along n.
    ``chunks`` (kChunksK; default :func:`lowk_chunks`): 0 the generic run-time-K variant,
    1 the whole K in shared memory (K <= LOWK_MAX_K), 2..8 the chunk stream (kK =
    :func:`lowk_bucket`, up to LOWK_CHUNKED_MAX_K). ``functor``: (C++ name, stub source) of an
    epilogue functor (specs.epilogue.functor; ``desc`` then the base squared_l2): a formula kernel's
    values of the exact squared distances (every template argument rendered)."""
    chunks = lowk_chunks(K) if chunks is None else int(chunks)
    kk = lowk_bucket(K, chunks)
    if not (chunks in (0, 1) and kk <= LOWK_MAX_K or 2 <= chunks <= 8 and kk <= LOWK_CHUNKED_MAX_K
            and (chunks - 1) * (kk // chunks) < K):
        raise ValueError(f"chunks: 0, 1 (K <= {LOWK_MAX_K}) or 2..8 with K > (chunks - 1) chunks and "
                         f"K <= {LOWK_CHUNKED_MAX_K}, got {chunks}, K = {K}")
    if mm_nonfinite and not (desc_mm_ok(desc) and chunks == 1):
        raise ValueError(f"mm_nonfinite: needs a Euclidean descriptor and K <= {LOWK_MAX_K}, got {desc!r}, K = {K}")
    if tiles_n is None:
        tiles_n = LOWK_TILES_N if kk > 0 else 1
    if tiles_n != 1 and not (1 <= tiles_n <= 8 and kk > 0):
        raise ValueError(f"tiles_n: 1..8 with a compile-time K, got {tiles_n}, K = {K}, chunks = {chunks}")
    if threads_n is None:
        threads_n = lowk_threads_n(K)
    args = [int(min_blocks), int(threads_n), "true" if mufu_epilogue else "false", "true" if mm_nonfinite else "false",
            int(tiles_n), max(chunks, 1)]
    defaults = [LOWK_MIN_BLOCKS, LOWK_THREADS_N, "true", "false", 1, 1]
    if functor is not None:
        args.append(functor[0])
    while functor is None and args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    extra = "".join(f", {x}" for x in args)
    traits = f"kermac_like::DistanceLowKTraits<{desc.cpp_args()}, {a.cpp}, {b.cpp}, {kk}{extra}>"
    return KernelSpec("distance_lowk.cuh", "kermac_like::distance_lowk_kernel", traits,
                      lowk_launch(kk, threads_n, tiles_n, max(chunks, 1)), prelude=functor[1] if functor else "")


# The low-K set: row-major inputs (either output layout: one kernel), the presets a
# low-dimensional user reaches first (cdist p=1/p=2, the Laplace and Gaussian kernels),
# K = 1..4, 8 and the generic variant; other (K, descriptor, layout) combinations compile
# on first use.
LOWK_SHIPPED_K = (1, 2, 3, 4, 8, 0)
LOWK_SHIPPED_PRESETS = ("l1", "l2", "laplace_l2", "gaussian_l2")
# The Euclidean presets also with kMmNonFinite at the K the default table gives them in
# torch.cdist's matrix-product mode (plan/autotune.py LOWK_MM_UP_TO).
LOWK_SHIPPED_MM_K = (1, 2, 3, 4, 8)
# First calls of issue 26's latency list that the set above missed (the bundle of prebuilt
# kernels holds the shipped set): cdist with a fractional p (p_norm) at K <= 8, and cdist
# p=1 at K = 64 with each tile count the planner gives it (lowk_tiles_n: 2 up to ~5000^2,
# 4, 8 at large outputs); and p_norm's run-time-K variant, which serves a first call at
# another K while that K's kernel compiles (plan._first_call_tier). Minutes of NVRTC per architecture for precompile --all: the
# p_norm builds take ~4 s each (bench/notes/jit.md).
LOWK_SHIPPED_EXTRA = tuple(("p_norm", K, None) for K in (1, 2, 3, 4, 8)) + (("p_norm", 0, None),) + \
    tuple(("l1", 64, t) for t in (2, 4, 8))


def shipped():
    row = Layout.ROW_MAJOR
    for name in LOWK_SHIPPED_PRESETS:
        for K in LOWK_SHIPPED_K:
            yield lowk_spec(PRESETS[name], row, row, K if K else LOWK_MAX_K + 1, chunks=None if K else 0)
        if desc_mm_ok(PRESETS[name]):
            for K in LOWK_SHIPPED_MM_K:
                yield lowk_spec(PRESETS[name], row, row, K, mm_nonfinite=True)
    for name, K, tiles in LOWK_SHIPPED_EXTRA:  # K = 0: the generic variant
        yield lowk_spec(PRESETS[name], row, row, K or LOWK_MAX_K + 1, tiles_n=tiles, chunks=None if K else 0)
