// Exact fp32 SIMT distance / kernel-matrix kernel (ABI: cuda_templates/ABI.md).
//
//   out[l][m,n] = epilogue(outer(sum_k inner(a[l][m,k], b[l][n,k]))) (+ lambda on a diagonal)
//
// Structure (numbers for the default traits; bench/NOTES.md has the cost model):
//   * block 256 threads -> 128x128 outputs; thread 8x8 outputs in registers as
//     two 4-wide groups per dimension, 64 apart, so every shared-memory read of
//     the inner loop is one LDS.128 and a warp reads 64 or 128 contiguous bytes;
//   * shared tiles are k-major, (BK, BM+4) per operand: row k holds the BM
//     values of one k, so a k-step reads 2 float4 of A and 2 float4 of B;
//   * global -> shared by cp.async through a kStages ring (one barrier per
//     k-tile).  m-contiguous operands (ColMajor) copy straight: 16-byte copies
//     when kVec == 4, 4-byte copies otherwise.  k-contiguous operands (RowMajor)
//     are transposed on the way in with 4-byte copies: a warp copies 4 rows x 8
//     k (32 contiguous bytes per row), and the +4 padding makes those 32 stores
//     hit 32 distinct banks.  That is 1 instruction per element and no staging
//     registers, versus 1.25 (LDG.128 + 4 STS.32, with bank conflicts) for a
//     register transpose, so kVec does not change RowMajor loads;
//   * two-level accumulation: `part` sums kChunkTiles k-tiles, then is added to
//     `total`; this keeps the fp32 summation error ~1e-7 relative for any K
//     (a single running sum reaches 1e-6 near K = 4096);
//   * fractional p: exp2 of kPolyPer64/64 of the micro-tile's elements runs on
//     the FMA pipe (math.cuh), the rest on MUFU, balancing the two pipes;
//   * epilogue through shared memory: one output per thread per step, warps
//     store 32 consecutive floats for either output layout.
// Edges: rows past M/N are clamped (k-contiguous) or skipped (m-contiguous):
// they only feed outputs that are never stored.  k past K is zero-filled, and
// inner(0, 0) == 0 for every inner operator, so no predicate runs per element.
#pragma once

#include "common.cuh"
#include "math.cuh"

namespace kermac_like {

// Tuning parameters (defaults = the shipped configuration; bench/try_simt.py
// times the alternatives):
//   kPolyPer64_      fractional p: exp2 of this many of the 64 micro-tile
//                    elements runs on the FMA pipe, the rest on MUFU;
//   kBlockK_         k per pipeline stage (8, 16, 32 or 64);
//   kMinBlocksPerSm_ 1: 64 partial + 64 total accumulators in registers (up to
//                    255 registers, 8 warps per SM); 2: the totals live in
//                    shared memory and registers are capped at 128, so two
//                    blocks (16 warps) share an SM when the shared memory fits
//                    (sm_90 with kBlockK_ <= 16; sm_80 runs one block).
template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_,
          Layout kLayoutA_, Layout kLayoutB_, Layout kLayoutOut_, int kVec_,
          int kPolyPer64_ = 41, int kBlockK_ = 32, int kMinBlocksPerSm_ = 1>
struct DistanceTraits {
  // ---- static preconditions: impossible combinations fail here, by name.
  static_assert(kVec_ == 1 || kVec_ == 4, "DistanceTraits: kVec must be 1 or 4");
  static_assert(kInner_ != Inner::Dot || kInnerPow_ == Power::Noop,
                "DistanceTraits: Inner::Dot requires inner power Power::Noop");
  static_assert(kInner_ != Inner::Dot || kOuterPow_ == Power::Noop,
                "DistanceTraits: Inner::Dot requires outer power Power::Noop");
  static_assert(kInner_ != Inner::Dot || kEpilogue_ == Epilogue::None,
                "DistanceTraits: Inner::Dot requires Epilogue::None");
  static_assert(kInner_ != Inner::Diff || kInnerPow_ != Power::Noop,
                "DistanceTraits: Inner::Diff requires an inner power (Abs, Square or Pow)");
  static_assert(kInnerPow_ != Power::Sqrt, "DistanceTraits: inner power Power::Sqrt is not supported");
  static_assert(kOuterPow_ != Power::Abs && kOuterPow_ != Power::Square,
                "DistanceTraits: outer power must be Noop, Sqrt or Pow");

  using T = float;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr Layout kLayoutA = kLayoutA_;
  static constexpr Layout kLayoutB = kLayoutB_;
  static constexpr Layout kLayoutOut = kLayoutOut_;
  static constexpr int kVec = kVec_;

  // ---- tile configuration (static).  Retune here; the loaders and the
  // fragment layout below check their assumptions with static_asserts.
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kThreadsM = 16, kThreadsN = 16;  // thread grid (warp: 4 x 8 threads)
  static constexpr int kThreadM = 8, kThreadN = 8;      // per-thread micro-tile
  static constexpr int kBlockM = kThreadsM * kThreadM;  // 128
  static constexpr int kBlockN = kThreadsN * kThreadN;  // 128
  static constexpr int kBlockK = kBlockK_;              // k per pipeline stage (32)
  static constexpr int kStages = 2;                     // 3 also fits sm_80/sm_90 (101.9 KB)
  static constexpr int kSmemStride = kBlockM + 4;       // floats per k-row (+4: conflict-free transpose)
  // A (BK, S), B (BK, S), then one spare row: the fragment prefetch of a tile's
  // last k-step reads row BK of A (B's row 0) and of B (the spare row). With
  // the spare row inside the stage, that read never touches the next stage,
  // whose cp.async copies are in flight while this stage is consumed
  // (compute-sanitizer racecheck: "invalid memcpy_async synchronization").
  static constexpr int kStageFloats = (2 * kBlockK + 1) * kSmemStride;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // 1: 235-255 registers, one block per SM
  static constexpr bool kTotalInSmem = kMinBlocksPerSm_ > 1;  // totals in shared memory (128 registers)
  // Shared memory: the stages (each with its spare row), then (kTotalInSmem)
  // 64 totals per thread; the epilogue's (BM, BN + 1) sum tile reuses the front.
  static constexpr int kTotalOffset = kStages * kStageFloats;  // floats, 16-byte aligned
  static constexpr int kMainFloats = kTotalOffset + (kTotalInSmem ? kThreads * 64 : 0);
  static constexpr int kEpiFloats = kBlockM * (kBlockN + 1);
  static constexpr int kSmemBytes = (kMainFloats > kEpiFloats ? kMainFloats : kEpiFloats) * 4;
  static constexpr int kUnrollK =                       // k-steps per inner-loop trip
      kInnerPow_ == Power::Pow ? 2 : (kMinBlocksPerSm_ > 1 ? 4 : 8);
  static constexpr int kChunkTiles = 256 / kBlockK_;    // k-tiles per partial sum (256 k)
  static constexpr int kPolyPer64 = kPolyPer64_;        // exp2 on the FMA pipe, per 64 elements

  static_assert(kThreadsM * kThreadsN == kThreads, "thread grid must match kThreads");
  static_assert(kThreadM == 8 && kThreadN == 8, "fragments are two float4 per operand");
  static_assert(kBlockM == kBlockN, "A and B tiles share one shared-memory row stride");
  static_assert(kBlockK % 8 == 0 && kBlockK % kWarps == 0, "loader mappings need BK % 8 == 0");
  static_assert(kBlockM % (kWarps * 4) == 0 && kBlockM % 32 == 0, "loader mappings need BM % 32 == 0");
  static_assert(kBlockK % kUnrollK == 0 && kUnrollK % 2 == 0, "fragment double buffer needs an even unroll");
  static_assert(kStages >= 2, "the cp.async ring needs at least two stages");
  static_assert(kPolyPer64 >= 0 && kPolyPer64 <= 64, "kPolyPer64 is a count out of 64");
  static_assert(kBlockK_ == 8 || kBlockK_ == 16 || kBlockK_ == 32 || kBlockK_ == 64,
                "DistanceTraits: kBlockK must be 8, 16, 32 or 64");
  static_assert(kMinBlocksPerSm_ == 1 || kMinBlocksPerSm_ == 2, "DistanceTraits: kMinBlocksPerSm must be 1 or 2");
  static_assert(kTotalOffset % 4 == 0, "the shared totals are float4 rows");
  static_assert(kThreads % kBlockM == 0 && kThreads % kBlockN == 0, "epilogue walks need BM, BN | kThreads");

  // Elements (i, j) of the micro-tile whose exp2 runs on the FMA pipe: exactly
  // kPolyPer64 of the 64, evenly spread (element x is chosen when
  // floor((x + 1) P / 64) steps past floor(x P / 64)).
  __host__ __device__ static constexpr bool exp2_on_fma(int i, int j) {
    return ((i * kThreadN + j + 1) * kPolyPer64) / 64 > ((i * kThreadN + j) * kPolyPer64) / 64;
  }
};

namespace distance_detail {

// Dynamic shared memory of the kernel: (kStages * (2 * BK + 1), S) floats; stage
// s = A tile (BK, S), B tile (BK, S), one spare row.
extern __shared__ __align__(16) float kl_distance_smem[];

// ------------------------------------------------------ async-copy primitives
// Destinations are shared-window byte addresses (computed once per thread, so
// predicated copies do not each re-derive the window base).
__device__ __forceinline__ unsigned smem_addr(const float* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#else
  return static_cast<unsigned>((p - kl_distance_smem) * 4);
#endif
}

#if !defined(__CUDA_ARCH__)
__device__ __forceinline__ float* smem_ptr(unsigned addr) { return kl_distance_smem + addr / 4; }
#endif

// 4-byte copy global -> shared through L1 (LDGSTS.E); neighbouring k of a row
// are fetched by other instructions of the same thread, so L1 keeps the sector.
__device__ __forceinline__ void cp_async_4(unsigned dst, const float* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
#else
  *smem_ptr(dst) = *src;
#endif
}

// Same, but copies `bytes` (0 or 4) and zero-fills the rest.
__device__ __forceinline__ void cp_async_4_zfill(unsigned dst, const float* src, int bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#else
  *smem_ptr(dst) = bytes ? *src : 0.0f;
#endif
}

// 16-byte copy bypassing L1 (LDGSTS.E.BYPASS.128); copies `bytes` (0..16) and
// zero-fills the rest.  dst and src 16-byte aligned.
__device__ __forceinline__ void cp_async_16_zfill(unsigned dst, const float* src, int bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#else
  for (int e = 0; e < 4; ++e) smem_ptr(dst)[e] = 4 * e < bytes ? src[e] : 0.0f;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `kPending` of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ int min_int(int x, int y) { return x < y ? x : y; }

// x, hidden from the optimiser: values derived from it are recomputed where
// they are used instead of being hoisted out of loops into registers.
__device__ __forceinline__ i64 opaque(i64 x) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
#endif
  return x;
}

// --------------------------------------------------------------- tile loaders
// A loader fills one operand's (BK, S) k-major tile of a stage:
//   tile[k][r] = x[row0 + r, k0 + k]   for r < BM, k < BK
// with x[r, k] = 0 for k >= K (zero fill) and anything for row0 + r >= rows.
template <class Tr, Layout kLayout, int kVec>
struct TileLoader;

// k-contiguous operand (x[r, k] at base + r * ld + k): transposing 4-byte copies.
// Lane (r4 = lane / 8, kl = lane % 8) of warp w copies rows g*32 + w*4 + r4 at
// k = 8*kk + kl, for g < BM/32 and kk < BK/8.  Shared-memory banks of one
// instruction: (kl * S + r4) % 32 = 4*kl + r4 (S % 32 == 4): all distinct.
template <class Tr, int kVec>
struct TileLoader<Tr, Layout::RowMajor, kVec> {
  static constexpr int S = Tr::kSmemStride;
  static constexpr int kRowGroups = Tr::kBlockM / (Tr::kWarps * 4);
  static constexpr int kKGroups = Tr::kBlockK / 8;
  static_assert(S % 32 == 4, "transposing copies need S % 32 == 4 to be conflict-free");

  // Register budget: one pointer per row group, or (kTotalInSmem, 128
  // registers) one pointer plus row indices, the row addresses recomputed per
  // tile (one IMAD.WIDE per row group).
  static constexpr bool kCompact = Tr::kTotalInSmem;
  static constexpr int kPtrs = kCompact ? 1 : kRowGroups;
  const float* row_[kPtrs];       // this thread's rows at k = k0 + kl (advanced by load)
  int rowi_[kCompact ? kRowGroups : 1];
  int dst_;                       // offset of (k = kl, r = w*4 + r4) in the tile
  int kl_;

  __device__ __forceinline__ void init(const float* base, i64 ld, int rows, int row0, int tid) {
    const int lane = tid & 31, warp = tid >> 5;
    kl_ = lane & 7;
    const int r = warp * 4 + (lane >> 3);
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
      const int row = min_int(row0 + g * Tr::kWarps * 4 + r, rows - 1);  // clamp: never stored
      if constexpr (kCompact) {
        rowi_[g] = row;
      } else {
        row_[g] = base + row * ld + kl_;
      }
    }
    if constexpr (kCompact) row_[0] = base + kl_;
    dst_ = kl_ * S + r;
  }

  // Loads the tile at k0 (tiles are loaded in order, k0 = 0, BK, 2 BK, ...);
  // ld: the same leading dimension as in init (read again from the kernel
  // parameters instead of occupying registers).
  __device__ __forceinline__ void load(unsigned tile, int k0, int K, i64 ld) {
    if constexpr (kCompact) {
      const float* rp[kRowGroups];
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) rp[g] = row_[0] + rowi_[g] * opaque(ld);
      load_rows(tile, k0, K, rp);
      row_[0] += Tr::kBlockK;
    } else {
      load_rows(tile, k0, K, row_);
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) row_[g] += Tr::kBlockK;
    }
  }

  __device__ __forceinline__ void load_rows(unsigned tile, int k0, int K, const float* const (&rp)[kRowGroups]) {
    const unsigned dst = tile + 4 * dst_;
    if (k0 + Tr::kBlockK <= K) {
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g)
#pragma unroll
        for (int kk = 0; kk < kKGroups; ++kk)
          cp_async_4(dst + 4 * (kk * 8 * S + g * Tr::kWarps * 4), rp[g] + kk * 8);
    } else {
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g)
#pragma unroll
        for (int kk = 0; kk < kKGroups; ++kk) {
          const int k = k0 + kk * 8 + kl_;
          const bool in = k < K;
          cp_async_4_zfill(dst + 4 * (kk * 8 * S + g * Tr::kWarps * 4), rp[g] + ((in ? k : K - 1) - k0 - kl_), in ? 4 : 0);
        }
    }
  }
};

// m-contiguous operand (x[r, k] at base + k * ld + r), 16-byte copies (kVec == 4:
// base 16-byte aligned and ld % 4 == 0).  Lane copies rows 4*lane..4*lane+3;
// warp w copies k = w + kWarps*i.  A chunk that straddles `rows` copies only
// its valid bytes; chunks past `rows` are skipped.
template <class Tr>
struct TileLoader<Tr, Layout::ColMajor, 4> {
  static constexpr int S = Tr::kSmemStride;
  static constexpr int kKRows = Tr::kBlockK / Tr::kWarps;
  static_assert(Tr::kBlockM == 32 * 4, "one 16-byte chunk per lane covers the tile's rows");

  const float* src_;  // this lane's chunk at k = k0 + warp (advanced by load)
  i64 ld_;
  int bytes_;  // valid bytes of this lane's chunk (0 = skip)
  int dst_;
  int warp_;

  __device__ __forceinline__ void init(const float* base, i64 ld, int rows, int row0, int tid) {
    const int lane = tid & 31;
    warp_ = tid >> 5;
    const int r = row0 + 4 * lane;
    bytes_ = r < rows ? 4 * min_int(4, rows - r) : 0;
    src_ = base + (r < rows ? r : 0) + warp_ * ld;
    ld_ = ld;
    dst_ = warp_ * S + 4 * lane;
  }

  // Loads the tile at k0 (tiles are loaded in order, k0 = 0, BK, 2 BK, ...).
  __device__ __forceinline__ void load(unsigned tile, int k0, int K, i64 /*ld*/) {
    const unsigned dst = tile + 4 * dst_;
    const i64 step = Tr::kWarps * ld_;
    if (bytes_ != 0) {
      if (k0 + Tr::kBlockK <= K) {
        const float* src = src_;
#pragma unroll
        for (int i = 0; i < kKRows; ++i, src += step) cp_async_16_zfill(dst + 4 * (i * Tr::kWarps * S), src, bytes_);
      } else {
#pragma unroll
        for (int i = 0; i < kKRows; ++i) {
          const int k = k0 + warp_ + i * Tr::kWarps;
          const bool in = k < K;
          cp_async_16_zfill(dst + 4 * (i * Tr::kWarps * S), src_ + ((in ? k : K - 1) - k0 - warp_) * ld_,
                            in ? bytes_ : 0);
        }
      }
    }
    src_ += kKRows * step;
  }
};

// m-contiguous operand, 4-byte copies (any alignment).  Lane copies rows
// lane + 32*q (q < BM/32); warp w copies k = w + kWarps*i.  Rows past `rows`
// are skipped.
template <class Tr>
struct TileLoader<Tr, Layout::ColMajor, 1> {
  static constexpr int S = Tr::kSmemStride;
  static constexpr int kKRows = Tr::kBlockK / Tr::kWarps;
  static constexpr int kRowGroups = Tr::kBlockM / 32;

  const float* src_;  // row row0 + lane at k = k0 + warp (advanced by load)
  i64 ld_;
  int valid_;  // bit q: row row0 + lane + 32*q is < rows
  int dst_;
  int warp_;

  __device__ __forceinline__ void init(const float* base, i64 ld, int rows, int row0, int tid) {
    const int lane = tid & 31;
    warp_ = tid >> 5;
    valid_ = 0;
#pragma unroll
    for (int q = 0; q < kRowGroups; ++q) valid_ |= (row0 + lane + 32 * q < rows ? 1 : 0) << q;
    src_ = base + row0 + lane + warp_ * ld;  // dereferenced only for valid rows
    ld_ = ld;
    dst_ = warp_ * S + lane;
  }

  // Loads the tile at k0 (tiles are loaded in order, k0 = 0, BK, 2 BK, ...).
  __device__ __forceinline__ void load(unsigned tile, int k0, int K, i64 /*ld*/) {
    const unsigned dst = tile + 4 * dst_;
    const i64 step = Tr::kWarps * ld_;
    if (k0 + Tr::kBlockK <= K) {
      const float* src = src_;
#pragma unroll
      for (int i = 0; i < kKRows; ++i, src += step)
#pragma unroll
        for (int q = 0; q < kRowGroups; ++q)
          if (valid_ & (1 << q)) cp_async_4(dst + 4 * (i * Tr::kWarps * S + 32 * q), src + 32 * q);
    } else {
#pragma unroll
      for (int i = 0; i < kKRows; ++i) {
        const int k = k0 + warp_ + i * Tr::kWarps;
        const bool in = k < K;
        const float* src = src_ + ((in ? k : K - 1) - k0 - warp_) * ld_;
#pragma unroll
        for (int q = 0; q < kRowGroups; ++q)
          if (valid_ & (1 << q)) cp_async_4_zfill(dst + 4 * (i * Tr::kWarps * S + 32 * q), src + 32 * q, in ? 4 : 0);
      }
    }
    src_ += kKRows * step;
  }
};

// The inner operator and the epilogue live in math.cuh (namespace exact), shared
// with the low-K kernel (distance_lowk.cuh).
using exact::accumulate;
using exact::EpilogueArgs;
using exact::finish;

}  // namespace distance_detail

// ------------------------------------------------------------------- kernel
// Two blocks per SM need 2 x ~100 KB of shared memory: only sm_90 (228 KB per
// SM) has it, so other architectures keep the 255-register budget (no spills).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KL_DISTANCE_MIN_BLOCKS(Tr) 1
#else
#define KL_DISTANCE_MIN_BLOCKS(Tr) Tr::kMinBlocksPerSm
#endif

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, KL_DISTANCE_MIN_BLOCKS(Traits)) distance_kernel(
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
  using namespace distance_detail;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, BK = Tr::kBlockK, S = Tr::kSmemStride;
  constexpr int kHalfM = BM / 2, kHalfN = BN / 2;  // distance between a thread's two 4-wide groups

  const DistanceBatchArgs<typename Tr::T> args(
      a, b, out, batch_n1, batch_n2, a_bs0, a_bs1, a_bs2, b_bs0, b_bs1, b_bs2, o_bs0, o_bs1, o_bs2,
      inner_p_ptr, inner_p_bs0, inner_p_bs1, inner_p_bs2, inner_p, outer_p_ptr, outer_p_bs0,
      outer_p_bs1, outer_p_bs2, outer_p, bw_ptr, bw_bs0, bw_bs1, bw_bs2, bandwidth, reg_ptr,
      reg_bs0, reg_bs1, reg_bs2, regularization);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  // Warp = 4 (m) x 8 (n) threads; warps 4 (m) x 2 (n).  Thread (tm, tn) owns
  // rows tm*4 + {0..3} and kHalfM + tm*4 + {0..3}, columns likewise with tn.
  const int tm = (warp >> 1) * 4 + (lane >> 3);
  const int tn = (warp & 1) * 8 + (lane & 7);
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int num_tiles = (K + BK - 1) / BK;

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const auto entry = args.at(l);

    math::PowArgs pw{};
    if constexpr (Tr::kInnerPow == Power::Pow) pw = math::make_pow_args(args.inner_p.at(entry.index));

    TileLoader<Tr, Tr::kLayoutA, Tr::kVec> load_a;
    TileLoader<Tr, Tr::kLayoutB, Tr::kVec> load_b;
    load_a.init(entry.a, lda, M, m0, tid);
    load_b.init(entry.b, ldb, N, n0, tid);

    const unsigned smem_base = smem_addr(kl_distance_smem);
    auto load_tile = [&](int t) {
      const unsigned stage = smem_base + (t % Tr::kStages) * (Tr::kStageFloats * 4);
      load_a.load(stage, t * BK, K, lda);
      load_b.load(stage + BK * S * 4, t * BK, K, ldb);
    };

    // part: the current 256-k chunk; total: the folded chunks, in registers
    // or (kTotalInSmem) as 16 float4 per thread in shared memory, thread-major
    // so that a warp's float4 accesses are conflict-free.
    constexpr int kTotRegs = Tr::kTotalInSmem ? 1 : 8;
    float part[8][8], total[kTotRegs][8];  // (kThreadM, kThreadN)
    float4* const tot_s = reinterpret_cast<float4*>(kl_distance_smem + Tr::kTotalOffset) + tid;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) part[i][j] = 0.0f;
    if constexpr (Tr::kTotalInSmem) {
#pragma unroll
      for (int e = 0; e < 16; ++e) tot_s[e * Tr::kThreads] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    } else {
#pragma unroll
      for (int i = 0; i < kTotRegs; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) total[i][j] = 0.0f;
    }
    // total += part, part = 0 (add_only: part += total, for the epilogue).
    auto fold = [&](bool add_only) {
      if constexpr (Tr::kTotalInSmem) {
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          float4 t = tot_s[e * Tr::kThreads];
          float* pe = &part[e >> 1][(e & 1) * 4];
          t.x += pe[0], t.y += pe[1], t.z += pe[2], t.w += pe[3];
          if (add_only) {
            pe[0] = t.x, pe[1] = t.y, pe[2] = t.z, pe[3] = t.w;
          } else {
            tot_s[e * Tr::kThreads] = t;
            pe[0] = pe[1] = pe[2] = pe[3] = 0.0f;
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < kTotRegs; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (add_only) {
              part[i][j] += total[i][j];
            } else {
              total[i][j] += part[i][j];
              part[i][j] = 0.0f;
            }
          }
      }
    };

    // Prologue: tiles 0 .. kStages-2 in flight (one commit group per tile,
    // empty groups included, so wait_group counts stay uniform).
#pragma unroll
    for (int t = 0; t < Tr::kStages - 1; ++t) {
      if (t < num_tiles) load_tile(t);
      cp_async_commit();
    }

    int chunk = 0;
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<Tr::kStages - 2>();  // this thread's copies of tile t landed
      __syncthreads();                   // everyone's did; stage (t-1) % kStages is free
      if (t + Tr::kStages - 1 < num_tiles) load_tile(t + Tr::kStages - 1);
      cp_async_commit();

      const float* sa = kl_distance_smem + (t % Tr::kStages) * Tr::kStageFloats + tm * 4;
      const float* sb = kl_distance_smem + (t % Tr::kStages) * Tr::kStageFloats + BK * S + tn * 4;
      float fa[2][8], fb[2][8];  // fragments of k and k + 1
      auto fetch = [&](float(&x)[8], const float* p) {
        const float4 lo = *reinterpret_cast<const float4*>(p);
        const float4 hi = *reinterpret_cast<const float4*>(p + kHalfM);
        x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w;
        x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
      };
      // Registers permitting, the fragments of k + 1 are fetched while k is
      // consumed; at 128 registers (kTotalInSmem) the compiler schedules the
      // loads itself and the other warps hide their latency.
      constexpr bool kPrefetch = !Tr::kTotalInSmem;
      if constexpr (kPrefetch) {
        fetch(fa[0], sa);
        fetch(fb[0], sb);
      }
#pragma unroll 1
      for (int kb = 0; kb < BK; kb += Tr::kUnrollK) {
#pragma unroll
        for (int kk = 0; kk < Tr::kUnrollK; ++kk) {
          if constexpr (kPrefetch) {
            // Prefetch k + 1 (the last step of the tile reads row BK: B's row 0
            // or the stage's spare row; the values are never used).
            fetch(fa[(kk + 1) & 1], sa + (kk + 1) * S);
            fetch(fb[(kk + 1) & 1], sb + (kk + 1) * S);
          } else {
            fetch(fa[kk & 1], sa + kk * S);
            fetch(fb[kk & 1], sb + kk * S);
          }
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j)
              part[i][j] = accumulate<Tr>(part[i][j], fa[kk & 1][i], fb[kk & 1][j], i, j, pw);
        }
        sa += Tr::kUnrollK * S;
        sb += Tr::kUnrollK * S;
      }

      if (++chunk == Tr::kChunkTiles) {
        chunk = 0;
        fold(false);
      }
    }
    fold(true);  // part = the whole sum

    // ---- epilogue.  The sums go through shared memory as a (BM, BN + 1) tile
    // so that (a) finish() is instantiated once, in a loop, not 64 times
    // (compile time, code size), and (b) every warp store writes 32 contiguous
    // floats for either output layout.  The odd row stride keeps both the
    // row walk (RowMajor out) and the column walk (ColMajor out) conflict-free.
    constexpr int CS = BN + 1;
    __syncthreads();  // every warp is done with the last stage (and its shared totals)
    {
      float* cs = kl_distance_smem;  // (BM, CS)
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          cs[((i >> 2) * kHalfM + tm * 4 + (i & 3)) * CS + (j >> 2) * kHalfN + tn * 4 + (j & 3)] = part[i][j];
    }
    __syncthreads();

    const EpilogueArgs ea = exact::epilogue_args<Tr>(args, entry.index, epsilon);
    // The diagonal n - m == reg_diag is, in tile coordinates, c - r == target.
    float lam = 0.0f;
    int target = 0;
    if (args.reg_on) {
      const i64 t = reg_diag - (i64(n0) - i64(m0));
      if (t > -BM && t < BN) {
        lam = args.regularization.at(entry.index);
        target = int(t);
      }
    }
    const int rows = min_int(BM, M - m0), cols = min_int(BN, N - n0);
    if constexpr (Tr::kLayoutOut == Layout::RowMajor) {
      // Thread walks column c = tid % BN down rows r = tid / BN + step * it.
      constexpr int kStep = Tr::kThreads / BN;
      const int c = tid % BN;
      if (c < cols) {
        float* dst = entry.out + i64(m0 + tid / BN) * ldo + n0 + c;
#pragma unroll 1
        for (int r = tid / BN; r < rows; r += kStep, dst += kStep * ldo) {
          float y = finish<Tr>(kl_distance_smem[r * CS + c], ea);
          if (lam != 0.0f && c - r == target) y += lam;
          *dst = y;
        }
      }
    } else {
      // Thread walks row r = tid % BM across columns c = tid / BM + step * it.
      constexpr int kStep = Tr::kThreads / BM;
      const int r = tid % BM;
      if (r < rows) {
        float* dst = entry.out + i64(n0 + tid / BM) * ldo + m0 + r;
#pragma unroll 1
        for (int c = tid / BM; c < cols; c += kStep, dst += kStep * ldo) {
          float y = finish<Tr>(kl_distance_smem[r * CS + c], ea);
          if (lam != 0.0f && c - r == target) y += lam;
          *dst = y;
        }
      }
    }
    __syncthreads();  // the next batch entry's prologue overwrites stages still being read
  }
}

}  // namespace kermac_like
