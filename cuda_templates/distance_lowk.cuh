// Exact fp32 SIMT distance / kernel-matrix kernel for low dimension K (ABI: the
// argument list of distance_kernel, cuda_templates/distance.cuh).
//
//   out[l][m,n] = epilogue(outer(sum_k inner(a[l][m,k], b[l][n,k]))) (+ lambda on a diagonal)
//
// At K <= 64 a 20000^2 float32 matrix costs more to write (1.6 GB) than to
// compute, so this kernel is built around the store:
//   * the whole K of the block's rows is loaded once into shared memory (k-major,
//     (K, BM + 4) per operand), no pipeline, no second pass: kK is a compile-time
//     parameter (the launcher compiles kK = K; a larger kK would also serve, k >= K
//     is zero-filled and inner(0, 0) == 0) and the k loop is unrolled;
//     kK == 0 is the generic variant: K in chunks of kChunkK through the same
//     shared tiles, one barrier per chunk, the chunk's k loop unrolled by 4;
//   * block 256 threads -> 128 x 128, 64 x 256 or 32 x 512 outputs (kThreadsN = 16,
//     32, 64 threads along n), thread 8 x 8: rows tm*8 .. tm*8+7 (one float4 pair
//     of a per k) and columns tn*4 + {0..3} and BN/2 + tn*4 + {0..3} (one float4
//     pair of b per k): 4 LDS.128 per 128 FP instructions;
//   * lanes run along n (warp = 2 x 16 or 1 x 32 threads), so each store
//     instruction writes two rows of 256 or one row of 512 contiguous bytes (wider
//     tiles: longer runs per DRAM page): 16-byte streaming stores (st.global.cs, evict-first:
//     the output is not read again by this kernel) straight from registers when
//     out's rows are 16-byte aligned, scalar stores otherwise and at the right edge;
//   * the output is row-major: the launcher computes a column-major out as the
//     row-major out^T = kernel(b, a) (every inner operator is symmetric, the
//     regularised diagonal changes sign);
//   * two (kMinBlocksPerSm) blocks per SM: one block's stores overlap the other's
//     loads and arithmetic;
//   * kTilesN > 1 (compile-time K; the planner picks 2, 4 or 8: lowk_tiles_n): a block
//     computes kTilesN tiles side by side along n; a's tile is loaded once and b's next
//     tile is copied with cp.async (registers untouched, warps along rows: one global
//     address per row) into a second buffer while the current tile is computed and
//     stored; one barrier per tile. The single-tile loads (kTilesN = 1) wait for their global
//     reads before the arithmetic: at K = 37 they cost ~17 % of the time (H100).
//   * kChunksK > 1 (compile-time kK up to 256, a multiple of kChunksK): K in kChunksK
//     chunks of kChunkK = kK / kChunksK k; the block runs its kTilesN tiles as one stream of
//     (tile, chunk) steps through two buffers (a's and b's chunk each), the next step's
//     copies (cp.async, k >= K zero-filled) in flight while this one is computed, one
//     barrier per step; a tile's stores overlap the next tile's first chunk. Unlike the
//     K-blocked SIMT kernel (distance.cuh) there is no pipeline fill per tile and no k
//     padded to its 16-k steps.
// Inner operator and epilogue: math.cuh (namespace exact), the same code as the
// K-blocked SIMT kernel, so both give identical results for the same k order.
// Edges: rows past M/N are clamped on load (their outputs are never stored).
#pragma once

#include "common.cuh"
#include "epilogue.cuh"
#include "math.cuh"

namespace kermac_like {

template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, Layout kLayoutA_,
          Layout kLayoutB_, int kK_, int kMinBlocksPerSm_ = 2, int kThreadsN_ = 16, bool kMufuEpilogue_ = true,
          bool kMmNonFinite_ = false, int kTilesN_ = 1, int kChunksK_ = 1, class Epi_ = void>
struct DistanceLowKTraits {
  static_assert(kInner_ != Inner::Dot || kInnerPow_ == Power::Noop,
                "DistanceLowKTraits: Inner::Dot requires inner power Power::Noop");
  static_assert(kInner_ != Inner::Dot || kOuterPow_ == Power::Noop,
                "DistanceLowKTraits: Inner::Dot requires outer power Power::Noop");
  static_assert(kInner_ != Inner::Dot || kEpilogue_ == Epilogue::None,
                "DistanceLowKTraits: Inner::Dot requires Epilogue::None");
  static_assert(kInner_ != Inner::Diff || kInnerPow_ != Power::Noop,
                "DistanceLowKTraits: Inner::Diff requires an inner power (Abs, Square or Pow)");
  static_assert(kInnerPow_ != Power::Sqrt, "DistanceLowKTraits: inner power Power::Sqrt is not supported");
  static_assert(kOuterPow_ != Power::Abs && kOuterPow_ != Power::Square,
                "DistanceLowKTraits: outer power must be Noop, Sqrt or Pow");
  static_assert(kK_ >= 0 && kK_ <= (kChunksK_ > 1 ? 256 : 64),
                "DistanceLowKTraits: kK is 1..64, up to 256 with kChunksK > 1 (0: K at run time)");
  static_assert(kChunksK_ >= 1 && kChunksK_ <= 8 && (kChunksK_ == 1 || (kK_ > 0 && kK_ % kChunksK_ == 0)),
                "DistanceLowKTraits: kChunksK is 1..8 (beyond 1: a compile-time kK, a multiple of it)");
  static_assert(!kMmNonFinite_ || kChunksK_ == 1, "DistanceLowKTraits: kMmNonFinite needs kChunksK == 1");
  static_assert(kMinBlocksPerSm_ >= 1 && kMinBlocksPerSm_ <= 3, "DistanceLowKTraits: kMinBlocksPerSm is 1..3");
  static_assert(kThreadsN_ == 16 || kThreadsN_ == 32 || kThreadsN_ == 64,
                "DistanceLowKTraits: kThreadsN is 16 (128 x 128 tile), 32 (64 x 256) or 64 (32 x 512)");
  static_assert(!kMmNonFinite_ || (kInner_ == Inner::Diff && kInnerPow_ == Power::Square && kK_ > 0),
                "DistanceLowKTraits: kMmNonFinite needs Inner::Diff, Power::Square and a compile-time kK");
  static_assert(kTilesN_ >= 1 && kTilesN_ <= 8 && (kTilesN_ == 1 || kK_ > 0),
                "DistanceLowKTraits: kTilesN is 1..8 (beyond 1: a compile-time kK)");

  // Epi_: void, or an epilogue functor (epilogue.cuh; base Diff, Square, Noop, None): a formula kernel's
  // values Epi::value(scale r2) of the exact squared distances (run_kernel of a formula at low K:
  // direct differences, no expansion to round; plan.distance._formula_tensor_core_plan), its
  // hyper-parameters p0, p1, p2 in the bandwidth, inner_p and outer_p slots.
  using Epi = Epi_;
  static constexpr bool kFunctor = epilogue::IsFunctor<Epi_>::value;
  static_assert(!kFunctor || (kInner_ == Inner::Diff && kInnerPow_ == Power::Square && kOuterPow_ == Power::Noop &&
                              kEpilogue_ == Epilogue::None),
                "DistanceLowKTraits: an epilogue functor needs the base Diff, Square, Noop, None");

  using T = float;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr Layout kLayoutA = kLayoutA_;
  static constexpr Layout kLayoutB = kLayoutB_;
  static constexpr Layout kLayoutOut = Layout::RowMajor;
  static constexpr int kK = kK_;
  // Square root and exponential of the epilogue on MUFU (exact::finish_mufu) instead of
  // the IEEE sqrtf / expf sequences (exact::finish): at K <= 8 the epilogue is a large
  // part of the issued instructions.
  static constexpr bool kMufuEpilogue = kMufuEpilogue_;
  // Non-finite values as torch.cdist's matrix-product path has them (the call mirrors
  // its "use_mm_for_euclid_dist" choice): a pair whose |x|^2, |y|^2 or x.y is not finite
  // (an infinite or NaN coordinate, or one whose square overflows) takes |x|^2 + |y|^2 -
  // 2 x.y with IEEE products (inf * 0 = NaN, inf - inf = NaN), every other pair the direct
  // sum of (x - y)^2. Found per tile: the loads flag values of magnitude >= 2^59 or NaN
  // (below it no sum of K <= 64 squares or products overflows), and a flagged tile (one
  // __syncthreads_or) is computed by mm_tile; other tiles pay one compare per loaded value.
  static constexpr bool kMmNonFinite = kMmNonFinite_;

  static constexpr int kThreads = 256;
  static constexpr int kThreadsN = kThreadsN_, kThreadsM = kThreads / kThreadsN_;  // thread grid
  static constexpr int kThreadM = 8, kThreadN = 8;
  static constexpr int kBlockM = kThreadsM * kThreadM;  // 128, 64 or 32
  static constexpr int kTileN = kThreadsN * kThreadN;   // 128, 256 or 512: the outputs of one pass
  // kTilesN > 1: the block computes kTilesN tiles side by side along n (kBlockN, the grid's
  // unit, = kTilesN * kTileN): a's tile is loaded once, b's next tile is copied with
  // cp.async into a second buffer while the current one is computed, and the current
  // tile's stores overlap the next one's arithmetic (one barrier per tile).
  static constexpr int kTilesN = kTilesN_;
  static constexpr int kBlockN = kTileN * kTilesN;
  // k chunks of compile-time K (kChunksK > 1: the (tile, chunk) stream)
  static constexpr int kChunksK = kChunksK_;
  // k in shared memory at once (the run-time-K loop reads 4 k per trip: a multiple of 4)
  static constexpr int kChunkK = kK_ > 0 ? kK_ / kChunksK_ : 8192 / (kBlockM + kBlockN) / 4 * 4;
  static constexpr int kStrideA = kBlockM + 4, kStrideB = kTileN + 4;  // floats per k-row (float4-aligned)
  // A (kChunkK, kStrideA), then B (kChunkK + 1, kStrideB), twice when kTilesN > 1: the
  // spare row is read by the last step's fragment prefetch (never used). kChunksK > 1: two
  // stages of A and B (kStageFloats each).
  static constexpr int kBBufs = kTilesN > 1 ? 2 : 1;
  static constexpr int kBufB = (kChunkK + 1) * kStrideB;  // floats of one B buffer
  static constexpr int kStageFloats = kChunkK * kStrideA + kBufB;
  static constexpr int kSmemBytes =
      (kChunksK > 1 ? 2 * kStageFloats : kChunkK * kStrideA + kBBufs * kBufB) * 4;
  // Full unrolling of the k loop up to 16 k; beyond, 4 k per trip (the instruction
  // cache: a fully unrolled K = 64 body is ~8,500 instructions and ran 30 % slower).
  // Fractional p: 2 k per trip at any K (tile_products). A k step is 64 powers of ~6-14
  // instructions each, so the loop's own instructions are < 1 % of it, and the fully
  // unrolled K = 8 build took 4.2 s of NVRTC (NVVM 2.2 + ptxas 2.1) against 2.2 s
  // (bench/notes/jit.md).
  static constexpr bool kFullUnroll = kChunkK <= 16 && kInnerPow_ != Power::Pow;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kPolyPer64 = 41;  // fractional p: exp2 on the FMA pipe, per 64 elements


  __host__ __device__ static constexpr bool exp2_on_fma(int i, int j) {
    return ((i * kThreadN + j + 1) * kPolyPer64) / 64 > ((i * kThreadN + j) * kPolyPer64) / 64;
  }
};

namespace lowk_detail {

extern __shared__ __align__(16) float kl_lowk_smem[];

// An epilogue functor's constants of one batch entry (none without one).
template <class Tr, bool kFunctor = Tr::kFunctor>
struct LowkFunctor {
  template <class Args>
  __device__ __forceinline__ LowkFunctor(const Args&, const BatchIndex&) {}
  __device__ __forceinline__ float operator()(float acc) const { return acc; }
};
template <class Tr>
struct LowkFunctor<Tr, true> {
  typename Tr::Epi::Args fa;
  float s;
  template <class Args>
  __device__ __forceinline__ LowkFunctor(const Args& args, const BatchIndex& index) {
    fa = Tr::Epi::args(epilogue::Params{args.bandwidth.at(index), args.inner_p.at(index), args.outer_p.at(index)});
    s = Tr::Epi::scale(fa);
  }
  __device__ __forceinline__ float operator()(float acc) const {
    return Tr::Epi::template value<false>(acc * s, fa);
  }
};

// x, hidden from the optimiser: addresses derived from it are recomputed per
// chunk instead of being hoisted out of the chunk loop into (spilled) registers.
__device__ __forceinline__ i64 opaque(i64 x) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
#endif
  return x;
}

// tile[k][r] = x[row0 + r, k0 + k] for k < kc (0 for k0 + k >= K), r < BM (rows
// clamped to `rows` - 1). Consecutive threads take consecutive k (RowMajor) or
// consecutive rows (ColMajor), so the global reads follow the operand's layout.
template <class Tr, Layout kLayout, int kc, int BM, int S>
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ x, i64 ld, int rows, int row0,
                                          int k0, int K, int tid, bool& big) {
  constexpr int kCount = BM * kc;
  ld = opaque(ld);
  // At most 4 loads in flight per thread (the accumulators are live meanwhile).
#pragma unroll 4
  for (int idx0 = 0; idx0 < kCount; idx0 += Tr::kThreads) {
    const int idx = idx0 + tid;
    if (kCount % Tr::kThreads == 0 || idx < kCount) {
      const int k = kLayout == Layout::RowMajor ? idx % kc : idx / BM;
      const int r = kLayout == Layout::RowMajor ? idx / kc : idx % BM;
      const int row = row0 + r < rows ? row0 + r : rows - 1;
      float v = 0.0f;
      if (k0 + k < K) v = kLayout == Layout::RowMajor ? x[i64(row) * ld + (k0 + k)] : x[i64(k0 + k) * ld + row];
      tile[k * S + r] = v;
      if constexpr (Tr::kMmNonFinite) big |= !(fabsf(v) < 0x1p59f);
    }
  }
}

// How the threads of a block share a (kc, BM) row-major tile's copies (for_each_own,
// load_tile_async): a warp takes whole rows, kLanesK lanes along k and kRowsW = 32 /
// kLanesK rows; kPassesK passes of kLanesK k per row, kTrips passes of kRowsPass rows.
template <class Tr, int kc, int BM>
struct RowCopies {
  static constexpr int kWarps = Tr::kThreads / 32;
  static constexpr int kLanesK = kc > 16 ? 32 : kc > 8 ? 16 : kc > 4 ? 8 : kc > 2 ? 4 : kc > 1 ? 2 : 1;
  static constexpr int kRowsW = 32 / kLanesK, kRowsPass = kRowsW * kWarps;
  static constexpr int kPassesK = (kc + kLanesK - 1) / kLanesK;
  static constexpr int kTrips = (BM + kRowsPass - 1) / kRowsPass;
};

// Every element (k, r) of a (kc, BM) tile that thread `tid` copies with cp.async, f(k, r):
// RowMajor: a warp takes whole rows (kLanesK lanes along k, 32 / kLanesK rows; one or two
// passes of 32 k), so each element's shared address is a base plus a compile-time
// offset and each row's global address is formed once; ColMajor: a warp takes one k,
// lanes along r. tid is hidden from the optimiser: the per-element values are recomputed
// per tile rather than hoisted out of the tile loop into (spilled) registers.
template <class Tr, Layout kLayout, int kc, int BM, class F>
__device__ __forceinline__ void for_each_own(int tid, F&& f) {
  constexpr int kWarps = Tr::kThreads / 32;
  tid = int(opaque(tid));
  const int warp = tid >> 5, lane = tid & 31;
  if constexpr (kLayout == Layout::RowMajor) {
    using RC = RowCopies<Tr, kc, BM>;
    constexpr int kLanesK = RC::kLanesK, kRowsW = RC::kRowsW, kRowsPass = RC::kRowsPass, kPassesK = RC::kPassesK;
    const int kl = lane % kLanesK, rl = warp * kRowsW + lane / kLanesK;
#pragma unroll
    for (int j = 0; j < (BM + kRowsPass - 1) / kRowsPass; ++j) {
      const int r = rl + j * kRowsPass;
      if (BM % kRowsPass == 0 || r < BM) {
#pragma unroll
        for (int q = 0; q < kPassesK; ++q)
          if (kc % kLanesK == 0 || kl + q * kLanesK < kc) f(kl + q * kLanesK, r);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < (kc + kWarps - 1) / kWarps; ++j) {
      const int k = warp + j * kWarps;
      if (kc % kWarps == 0 || k < kc) {
#pragma unroll
        for (int q = 0; q < (BM + 31) / 32; ++q)
          if (BM % 32 == 0 || lane + 32 * q < BM) f(k, lane + 32 * q);
      }
    }
  }
}

// 4 bytes global -> shared without registers (cp.async, sm_80+) to element `off` of the
// shared-memory base `dst` (smem_base: the address conversion once, outside the copies'
// predicates); bytes = 0 writes 0 (zero-fill, nothing read). Host (the CPU test shim): a
// plain copy.
#if defined(__CUDA_ARCH__)
using SmemBase = unsigned;
__device__ __forceinline__ SmemBase smem_base(float* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void copy_async4(SmemBase dst, int off, const float* src, int bytes = 4) {
  async_copy::cp_async_4(dst + 4u * unsigned(off), src, bytes);
}
#else
using SmemBase = float*;
inline SmemBase smem_base(float* p) { return p; }
inline void copy_async4(SmemBase dst, int off, const float* src, int bytes = 4) { dst[off] = bytes ? *src : 0.0f; }
#endif

// Rows k = K .. kc - 1 of a (kc, S) tile set to 0 (inner(0, 0) == 0). load_tile_async
// never writes them, so once per buffer at the kernel's start is enough (none when
// kK == K, the launcher's choice).
template <class Tr, int kc, int S>
__device__ __forceinline__ void zero_tail(float* tile, int K, int tid) {
  for (int idx = K * S + tid; idx < kc * S; idx += Tr::kThreads) tile[idx] = 0.0f;
}

__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__)
  async_copy::cp_async_commit();
#endif
}

__device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__)
  async_copy::cp_async_wait<0>();
#endif
}

// load_tile through cp.async (kTilesN > 1): the copies land while the caller computes;
// it waits (copies_wait) and passes a barrier before reading. The elements of
// for_each_own with k < K (rows k >= K: zero_tail; kZfill: zero-filled copies, for the
// chunk stream, whose buffers hold other chunks' rows there); RowMajor: one global
// address per row (at the thread's first k; its other k are immediate offsets), stepped
// by a pointer increment when the tile's rows are all inside (else clamped per row).
template <class Tr, Layout kLayout, int kc, int BM, int S, bool kZfill = false>
__device__ __forceinline__ void load_tile_async(float* tile, const float* __restrict__ x, i64 ld, int rows, int row0,
                                                int K, int tid) {
  if constexpr (kLayout == Layout::RowMajor) {
    using RC = RowCopies<Tr, kc, BM>;
    constexpr int kLanesK = RC::kLanesK, kRowsW = RC::kRowsW, kRowsPass = RC::kRowsPass, kPassesK = RC::kPassesK;
    constexpr int kTrips = RC::kTrips;
    tid = int(opaque(tid));
    const int warp = tid >> 5, lane = tid & 31;
    const int kl = lane % kLanesK, rl = warp * kRowsW + lane / kLanesK;
    const SmemBase dst = smem_base(tile + kl * S + rl);
    bool own[kPassesK], in[kPassesK];  // this thread's k of pass q inside the tile, and inside K
#pragma unroll
    for (int q = 0; q < kPassesK; ++q) {
      own[q] = kc % kLanesK == 0 || kl + q * kLanesK < kc;
      in[q] = own[q] && kl + q * kLanesK < K;
    }
    auto row_copies = [&](const float* p, int j) {  // p: the row's element k = kl
#pragma unroll
      for (int q = 0; q < kPassesK; ++q) {
        if constexpr (kZfill) {  // k >= K: 0, read from nowhere (the address: the row's k = 0, valid)
          if (own[q]) copy_async4(dst, q * kLanesK * S + j * kRowsPass, in[q] ? p + q * kLanesK : p - kl, in[q] ? 4 : 0);
        } else if (in[q]) {
          copy_async4(dst, q * kLanesK * S + j * kRowsPass, p + q * kLanesK);
        }
      }
    };
    if ((BM % kRowsPass == 0 || rl < BM - (kTrips - 1) * kRowsPass) && row0 + BM <= rows) {
      const float* p = x + i64(row0 + rl) * ld + kl;
      const i64 step = i64(kRowsPass) * ld;
#pragma unroll
      for (int j = 0; j < kTrips; ++j, p += step) row_copies(p, j);
    } else {
#pragma unroll
      for (int j = 0; j < kTrips; ++j) {
        const int r = rl + j * kRowsPass;
        if (BM % kRowsPass == 0 || r < BM) row_copies(x + i64(row0 + r < rows ? row0 + r : rows - 1) * ld + kl, j);
      }
    }
  } else {
    const SmemBase dst = smem_base(tile);
    for_each_own<Tr, kLayout, kc, BM>(tid, [&](int k, int r) {
      const int row = row0 + r < rows ? row0 + r : rows - 1;
      if constexpr (kZfill) {
        copy_async4(dst, k * S + r, x + (i64(k < K ? k : 0) * ld + row), k < K ? 4 : 0);
      } else if (k < K) {
        copy_async4(dst, k * S + r, x + (i64(k) * ld + row));
      }
    });
  }
  copies_commit();
}

// Whether this thread's elements of a landed tile hold a flagged value (kMmNonFinite).
template <class Tr, Layout kLayout, int kc, int BM, int S>
__device__ __forceinline__ bool tile_big(const float* tile, int tid) {
  bool big = false;
  for_each_own<Tr, kLayout, kc, BM>(tid, [&](int k, int r) { big |= !(fabsf(tile[k * S + r]) < 0x1p59f); });
  return big;
}

__device__ __forceinline__ void store_stream(float* p, float v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.cs.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
#else
  *p = v;
#endif
}

__device__ __forceinline__ void store_stream4(float* p, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
#else
  p[0] = x, p[1] = y, p[2] = z, p[3] = w;
#endif
}

// One k of the fragments: a (rows tm*8 .. +7) and b (columns tn*4 + {0..3}, BN/2 + ...).
struct Frag {
  float4 a0, a1, b0, b1;
};

template <class Tr>
__device__ __forceinline__ void load_frag(Frag& f, const float* sa, const float* sb) {
  f.a0 = *reinterpret_cast<const float4*>(sa);
  f.a1 = *reinterpret_cast<const float4*>(sa + 4);
  f.b0 = *reinterpret_cast<const float4*>(sb);
  f.b1 = *reinterpret_cast<const float4*>(sb + Tr::kTileN / 2);
}

// acc[i][j] += inner(a[i], b[j]), then a scheduling fence: later shared-memory reads
// stay behind it, so at most two fragments (this k and the prefetched next one) are
// live: hoisting every step's fragments costs 16 registers per step and spills at the
// 128-register budget of two blocks per SM.
template <class Tr>
__device__ __forceinline__ void compute(float (&acc)[8][8], const Frag& f, const math::PowArgs& pw) {
  const float fa[8] = {f.a0.x, f.a0.y, f.a0.z, f.a0.w, f.a1.x, f.a1.y, f.a1.z, f.a1.w};
  const float fb[8] = {f.b0.x, f.b0.y, f.b0.z, f.b0.w, f.b1.x, f.b1.y, f.b1.z, f.b1.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = exact::accumulate<Tr>(acc[i][j], fa[i], fb[j], i, j, pw);
#if defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
}

// The accumulators of a tile holding a flagged value (DistanceLowKTraits::kMmNonFinite):
// per pair, the direct sum, or |x|^2 + |y|^2 - 2 x.y (clamped at 0, NaN kept) where one of
// its three sums is not finite. Rare, so compact: k not unrolled.
template <class Tr, int SA, int SB>
__device__ __forceinline__ void mm_tile(float (&acc)[8][8], const float* pa, const float* pb, const math::PowArgs& pw) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float* py = pb + (j < 4 ? j : Tr::kTileN / 2 + j - 4);
      float d = 0.0f, xx = 0.0f, yy = 0.0f, xy = 0.0f;
#pragma unroll 1
      for (int k = 0; k < Tr::kChunkK; ++k) {
        const float x = pa[k * SA + i], y = py[k * SB];
        d = exact::accumulate<Tr>(d, x, y, i, j, pw);
        xx = fmaf(x, x, xx);
        yy = fmaf(y, y, yy);
        xy = fmaf(x, y, xy);
      }
      constexpr float kMax = 3.40282347e38f;  // finite: |v| <= FLT_MAX (false for inf and NaN)
      const bool mm = !(fabsf(xx) <= kMax && fabsf(yy) <= kMax && fabsf(xy) <= kMax);
      acc[i][j] = mm ? math::fmax_nan(fmaf(-2.0f, xy, xx + yy), 0.0f) : d;
    }
  }
}

// acc += the n k-steps at pa, pb (row strides SA, SB), the fragments of k + 1 read
// while k is computed (row n is read, never used: the tiles have a spare row).
// kUnroll: pairs of steps per unrolled trip (n is a compile-time constant when the
// caller unrolls fully).
template <class Tr, int SA, int SB, int kUnroll>
__device__ __forceinline__ void run_steps(float (&acc)[8][8], const float* pa, const float* pb, int n,
                                          const math::PowArgs& pw) {
  Frag f0, f1;
  load_frag<Tr>(f0, pa, pb);
  int k = 0;
#pragma unroll kUnroll
  for (; k + 1 < n; k += 2) {
    load_frag<Tr>(f1, pa + (k + 1) * SA, pb + (k + 1) * SB);
    compute<Tr>(acc, f0, pw);
    load_frag<Tr>(f0, pa + (k + 2) * SA, pb + (k + 2) * SB);
    compute<Tr>(acc, f1, pw);
  }
  if (k < n) compute<Tr>(acc, f0, pw);
}

// The tile's products from the staged k-rows at pa, pb: a tile flagged by the loads (the
// matrix product's NaN/inf mode) by mm_tile, else the direct sums, fully unrolled when the
// traits say so (KC steps), in pairs of steps otherwise.
template <class Tr, int SA, int SB, int KC>
__device__ __forceinline__ void tile_products(float (&acc)[8][8], const float* pa, const float* pb, bool big,
                                              const math::PowArgs& pw) {
  if (Tr::kMmNonFinite && big) {
    mm_tile<Tr, SA, SB>(acc, pa, pb, pw);
  } else if constexpr (Tr::kFullUnroll) {
    run_steps<Tr, SA, SB, KC>(acc, pa, pb, KC, pw);
  } else if constexpr (Tr::kInnerPow == Power::Pow) {
    run_steps<Tr, SA, SB, 1>(acc, pa, pb, KC, pw);
  } else {
    run_steps<Tr, SA, SB, 2>(acc, pa, pb, KC, pw);
  }
}

}  // namespace lowk_detail

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm) distance_lowk_kernel(
    const typename Traits::T* __restrict__ a, const typename Traits::T* __restrict__ b,
    typename Traits::T* __restrict__ out, int M, int N, int K, long long lda, long long ldb,
    long long ldo, int batch, int batch_n1, int batch_n2, long long a_bs0, long long a_bs1,
    long long a_bs2, long long b_bs0, long long b_bs1, long long b_bs2, long long o_bs0,
    long long o_bs1, long long o_bs2, const float* inner_p_ptr, long long inner_p_bs0,
    long long inner_p_bs1, long long inner_p_bs2, float inner_p, const float* outer_p_ptr,
    long long outer_p_bs0, long long outer_p_bs1, long long outer_p_bs2, float outer_p,
    const float* bw_ptr, long long bw_bs0, long long bw_bs1, long long bw_bs2, float bandwidth,
    const float* reg_ptr, long long reg_bs0, long long reg_bs1, long long reg_bs2,
    float regularization, long long reg_diag, float epsilon) {
  using Tr = Traits;
  using namespace lowk_detail;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, TN = Tr::kTileN, SA = Tr::kStrideA, SB = Tr::kStrideB,
                KC = Tr::kChunkK;

  const DistanceBatchArgs<typename Tr::T> args(
      a, b, out, batch_n1, batch_n2, a_bs0, a_bs1, a_bs2, b_bs0, b_bs1, b_bs2, o_bs0, o_bs1, o_bs2,
      inner_p_ptr, inner_p_bs0, inner_p_bs1, inner_p_bs2, inner_p, outer_p_ptr, outer_p_bs0,
      outer_p_bs1, outer_p_bs2, outer_p, bw_ptr, bw_bs0, bw_bs1, bw_bs2, bandwidth, reg_ptr,
      reg_bs0, reg_bs1, reg_bs2, regularization);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  // Lanes run along n: a warp is 2 x 16, 1 x 32 threads (kThreadsN 16, >= 32).
  constexpr int kLanesN = Tr::kThreadsN < 32 ? Tr::kThreadsN : 32;
  constexpr int kWarpsN = Tr::kThreadsN / kLanesN;
  const int tm = (warp / kWarpsN) * (32 / kLanesN) + lane / kLanesN;  // rows tm*8 .. tm*8 + 7
  const int tn = (warp % kWarpsN) * kLanesN + lane % kLanesN;        // columns tn*4 + {0..3}, BN/2 + tn*4 + {0..3}
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  float* const sa = kl_lowk_smem;
  float* const sb = kl_lowk_smem + KC * SA;

  // ---- epilogue of the tile at columns nt .. nt + TN - 1, from registers.
  auto store_tile = [&](const float (&acc)[8][8], const decltype(args.at(0))& entry, int nt) {
    const exact::EpilogueArgs ea = exact::epilogue_args<Tr>(args, entry.index, epsilon);
    const LowkFunctor<Tr> functor(args, entry.index);
    // The diagonal n - m == reg_diag is, in tile coordinates, c - r == target.
    float lam = 0.0f;
    int target = 0;
    if (args.reg_on) {
      const i64 t = reg_diag - (i64(nt) - i64(m0));
      if (t > -BM && t < TN) {
        lam = args.regularization.at(entry.index);
        target = int(t);
      }
    }
    float* const o = entry.out;
    // Whole tile and 16-byte aligned rows: vector stores without predicates.
    const bool fast = nt + TN <= N && m0 + BM <= M &&
                      ((reinterpret_cast<unsigned long long>(o) | (unsigned long long)(ldo * 4)) & 15) == 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = tm * 8 + i;
      if (!fast && m0 + r >= M) break;
      float* const row = o + i64(m0 + r) * ldo + nt;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = h * (TN / 2) + tn * 4;
        float y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          y[e] = Tr::kFunctor        ? functor(acc[i][h * 4 + e])
                 : Tr::kMufuEpilogue ? exact::finish_mufu<Tr>(acc[i][h * 4 + e], ea)
                                     : exact::finish<Tr>(acc[i][h * 4 + e], ea);
        if (lam != 0.0f) {  // the regularised column of row r, relative to c
          const int dc = r + target - c;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (e == dc) y[e] += lam;
        }
        if (fast) {
          store_stream4(row + c, y[0], y[1], y[2], y[3]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (nt + c + e < N) store_stream(row + c + e, y[e]);
        }
      }
    }
  };

  if constexpr (Tr::kK > 0 && Tr::kTilesN > 1 && Tr::kChunksK == 1) {  // k >= K of every buffer (read before the first barrier)
    zero_tail<Tr, KC, SA>(sa, K, tid);
    zero_tail<Tr, KC, SB>(sb, K, tid);
    zero_tail<Tr, KC, SB>(sb + Tr::kBufB, K, tid);
  }

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const auto entry = args.at(l);
    math::PowArgs pw{};
    if constexpr (Tr::kInnerPow == Power::Pow) pw = math::make_pow_args(args.inner_p.at(entry.index));

    if constexpr (Tr::kChunksK > 1) {
      // Steps q = (tile q / kChunksK, chunk q % kChunksK) through two stages: step q + 1's
      // copies (a's and b's chunk, k >= K zero-filled) issued after the barrier of step q.
      if (l != int(blockIdx.z)) __syncthreads();  // the previous entry's reads are done
      const int tiles = (N - n0 + TN - 1) / TN < Tr::kTilesN ? (N - n0 + TN - 1) / TN : Tr::kTilesN;
      const int steps = tiles * Tr::kChunksK;
      auto issue = [&](int q) {
        const auto& e = entry;
        const int k0 = (q % Tr::kChunksK) * KC;
        float* const st = kl_lowk_smem + (q & 1) * Tr::kStageFloats;
        const i64 ka = Tr::kLayoutA == Layout::RowMajor ? i64(k0) : i64(k0) * lda;
        const i64 kb = Tr::kLayoutB == Layout::RowMajor ? i64(k0) : i64(k0) * ldb;
        load_tile_async<Tr, Tr::kLayoutA, KC, BM, SA, true>(st, e.a + ka, opaque(lda), M, m0, K - k0, tid);
        load_tile_async<Tr, Tr::kLayoutB, KC, TN, SB, true>(st + KC * SA, e.b + kb, opaque(ldb), N,
                                                            n0 + (q / Tr::kChunksK) * TN, K - k0, tid);
      };
      issue(0);
#pragma unroll 1
      for (int s = 0; s < tiles; ++s) {
        float acc[8][8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
#pragma unroll 1
        for (int c = 0; c < Tr::kChunksK; ++c) {
          const int q = s * Tr::kChunksK + c;
          copies_wait();
          __syncthreads();  // step q has landed; every thread is done with step q - 1 (its stage is refilled next)
          if (q + 1 < steps) issue(q + 1);
          const float* const st = kl_lowk_smem + (q & 1) * Tr::kStageFloats;
          tile_products<Tr, SA, SB, KC>(acc, st + tm * 8, st + KC * SA + tn * 4, false, pw);
        }
        store_tile(acc, entry, n0 + s * TN);
      }
      continue;
    }

    if constexpr (Tr::kK > 0 && Tr::kTilesN > 1) {
      // a's tile once, b's tiles in turn: b's next tile copied (cp.async, the other
      // buffer) while this one is computed and stored.
      if (l != int(blockIdx.z)) __syncthreads();  // the previous entry's reads are done
      bool big_a = false, big = false;
      load_tile_async<Tr, Tr::kLayoutA, KC, BM, SA>(sa, entry.a, opaque(lda), M, m0, K, tid);
      load_tile_async<Tr, Tr::kLayoutB, KC, TN, SB>(sb, entry.b, opaque(ldb), N, n0, K, tid);
      copies_wait();
      if constexpr (Tr::kMmNonFinite) big_a = tile_big<Tr, Tr::kLayoutA, KC, BM, SA>(sa, tid);
#pragma unroll 1
      for (int s = 0; s < Tr::kTilesN; ++s) {
        const int nt = n0 + s * TN;
        if (nt >= N) break;  // (uniform over the block)
        const float* const sbt = sb + (s & 1) * Tr::kBufB;
        if (s > 0) copies_wait();
        if constexpr (Tr::kMmNonFinite) big = tile_big<Tr, Tr::kLayoutB, KC, TN, SB>(sbt, tid);
        // Tile s has landed and every thread is done with tile s - 1 (its buffer is refilled next).
        if constexpr (Tr::kMmNonFinite) {
          big = __syncthreads_or(big || big_a);
        } else {
          __syncthreads();
        }
        if (s + 1 < Tr::kTilesN && nt + TN < N)
          load_tile_async<Tr, Tr::kLayoutB, KC, TN, SB>(sb + ((s + 1) & 1) * Tr::kBufB, entry.b, opaque(ldb), N,
                                                        nt + TN, K, tid);
        float acc[8][8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
        tile_products<Tr, SA, SB, KC>(acc, sa + tm * 8, sbt + tn * 4, big, pw);
        store_tile(acc, entry, nt);
      }
      continue;
    }

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    if constexpr (Tr::kK > 0) {
      if (l != int(blockIdx.z)) __syncthreads();  // the previous entry's reads are done
      bool big = false;
      load_tile<Tr, Tr::kLayoutA, KC, BM, SA>(sa, entry.a, lda, M, m0, 0, K, tid, big);
      load_tile<Tr, Tr::kLayoutB, KC, TN, SB>(sb, entry.b, ldb, N, n0, 0, K, tid, big);
      if constexpr (Tr::kMmNonFinite) {
        big = __syncthreads_or(big);
      } else {
        __syncthreads();
      }
      tile_products<Tr, SA, SB, KC>(acc, sa + tm * 8, sb + tn * 4, big, pw);
    } else {
#pragma unroll 1
      for (int k0 = 0; k0 < K; k0 += KC) {
        if (k0 > 0 || l != int(blockIdx.z)) __syncthreads();  // the previous chunk's reads are done
        bool big = false;  // (kMmNonFinite is compile-time K only)
        load_tile<Tr, Tr::kLayoutA, KC, BM, SA>(sa, entry.a, lda, M, m0, k0, K, tid, big);
        load_tile<Tr, Tr::kLayoutB, KC, TN, SB>(sb, entry.b, ldb, N, n0, k0, K, tid, big);
        __syncthreads();
        const int kc = K - k0 < KC ? K - k0 : KC;  // k of this chunk (zero-filled up to KC)
        run_steps<Tr, SA, SB, 2>(acc, sa + tm * 8, sb + tn * 4, (kc + 3) & ~3, pw);  // zero-filled to 4
      }
    }
    store_tile(acc, entry, n0);
  }
}

}  // namespace kermac_like
