// Candidate selection on tensor cores for the Euclidean and dot-product top-k at large K (ABI:
// cuda_templates/ABI.md, built by kermac_like/plan/topk.py).
//
// Each CTA owns a 128-row tile of x and walks its range of y in 256-point tiles: the tile's
// dot products come from distance_mma.cuh's k-loop (block_tile_product, TF32 by default), the
// approximate values (||x||^2 + ||y||^2 - 2 x.y clamped at 0, or x.y) go through shared memory
// (the free stages) and every row is scanned by four threads, one per 64-column quarter. Each
// (row, quarter) keeps the kSel first keys it has seen, (order bits of the approximate value)
// << 32 | n as in topk.cuh, in a sorted list in shared memory with its threshold's high word in
// a register: nearly every value fails that one compare. The M x N matrix never exists.
//
// The output is a candidate set, not the answer: every (row, quarter, split) list goes to the
// scratch [split * 4 + quarter][batch][M][kSel] (keys with the top bit flipped, so that int64
// order is their order); the planner takes each row's kSel first candidates, recomputes their
// values exactly (direct differences in float32) and keeps the k best; a row whose k-th exact
// value is not clear of the candidates' bound by the TF32 error bound is recomputed exactly
// (kermac_like/plan/topk.py: certified rows only).
#pragma once

#include "distance_mma.cuh"
#include "topk.cuh"

namespace kermac_like {

// kInner_: Diff (squared l2 distances) or Dot; kPrecision_: Tf32 (candidates) or Tf32x3;
// kSel_: list length per (row, quarter), 8 to 24; kVersion_: 2, topk_mma_kernel; 3, 4 or 5,
// topk_mma_pipelined_kernel (below: the cp.async ring runs on across the y tiles; 4 also scans
// the values in registers; 5 also keeps the x tile in shared memory, K <= 128), the same
// candidate lists bit for bit.
template <Inner kInner_, Precision kPrecision_, bool kLargest_, int kSel_, int kVersion_ = 2>
struct TopkMmaTraits
    : DistanceMmaTraits<kInner_, Power::Noop, Epilogue::None, Layout::RowMajor, Layout::RowMajor,
                        Layout::RowMajor, kPrecision_, float> {
  using Base = DistanceMmaTraits<kInner_, Power::Noop, Epilogue::None, Layout::RowMajor, Layout::RowMajor,
                                 Layout::RowMajor, kPrecision_, float>;
  static_assert(kPrecision_ != Precision::Native16, "TopkMmaTraits: float32 data (Tf32 or Tf32x3)");
  static_assert(kSel_ >= 8 && kSel_ <= 24, "TopkMmaTraits: kSel is 8..24 (the lists fit shared memory)");
  static constexpr bool kLargest = kLargest_;
  static constexpr bool kSigned = kInner_ == Inner::Dot;
  static constexpr bool kDeferred = true;  // topk.cuh's order_bits: the raw bits of a value >= 0
  static constexpr int kSel = kSel_;
  static constexpr int kQuarters = 4;                           // threads per row in the scan
  static constexpr int kQuarterCols = Base::kBlockN / kQuarters;  // 64
  static constexpr int kHalfRows = Base::kBlockM / 2;             // rows per scan pass
  // Scan tile (kHalfRows, 4 quarters of 64 + 4 floats): LDS.128 of a warp's 8 threads per phase
  // (2 rows x 4 quarters) hit distinct banks (row stride 272 = 16 mod 32, quarter 68 = 4 mod 32).
  static constexpr int kQuarterStride = kQuarterCols + 4;
  static constexpr int kRowStride = kQuarters * kQuarterStride;
  static_assert(kHalfRows * kRowStride * 4 <= Base::kStages * Base::kStageBytes, "scan tile fits the stages");
  static_assert(Base::kThreads == kHalfRows * kQuarters, "one (row, quarter) per thread and pass");
  static_assert(kVersion_ >= 2 && kVersion_ <= 5, "TopkMmaTraits: kVersion is 2, 3, 4 or 5");
  static constexpr int kVersion = kVersion_;
  static constexpr bool kPipelined = kVersion_ >= 3;
  // The ring of topk_mma_pipelined_kernel: kRingStages stages, the next y tile's first kPrefetch
  // k-tiles issued right after a tile's MMAs. v3: the scan tile's rows are 1 KiB each (no
  // padding: an XOR swizzle of the 16-byte slots keeps the accesses free of bank conflicts), rows
  // 0..kStageRows-1 in stages 0 and 1, the others in a region of their own after the norms;
  // stages 2 and 3 receive the next tile's k-tiles 0 and 1 while the scan runs. v4: no scan tile
  // (the values are filtered in registers), five stages and one stream of k-tiles over the whole
  // y range (StreamRing): four in flight at all times, across tile boundaries too. v5 (K <= 128
  // only): v4 with the x tile resident in shared memory (loaded once per range, with the first y
  // tile's k-tiles) and stages of y alone: a third less L2 traffic, four stages of 16 KiB.
  static constexpr bool kXResident = kVersion_ == 5;
  static constexpr int kMaxKTiles = 8;  // v5: K <= 128 (the planner's rule)
  static constexpr int kXBytes = kXResident ? kMaxKTiles * Base::kBlockM * Base::kRowBytes : 0;  // 64 KiB
  static constexpr int kRingStages = kVersion_ == 4 ? 5 : Base::kStages;
  static constexpr int kPrefetch = kVersion_ >= 4 ? kRingStages - 1 : 2;
  static constexpr int kRingStageBytes = kXResident ? Base::kBlockN * Base::kRowBytes : Base::kStageBytes;
  static constexpr int kStagesOffset = kXBytes;  // v5: the stages after the x tile
  static constexpr int kNormOffset = kStagesOffset + kRingStages * kRingStageBytes;  // norm_a, norm_b
  static constexpr int kScanRowBytes = Base::kBlockN * 4;              // 1024
  static constexpr int kStageRows = (Base::kStages - 2) * Base::kStageBytes / kScanRowBytes;  // 48 (v3)
  static constexpr int kExtraOffset = Base::kSmemBytes;  // scan rows kStageRows.. (v3)
  static constexpr int kExtraBytes = kVersion_ == 3 ? (kHalfRows - kStageRows) * kScanRowBytes : 0;
  static_assert(kVersion_ != 3 || (Base::kStages == 4 && kStageRows % 16 == 0 && kStageRows < kHalfRows),
                "TopkMmaTraits: the v3 scan tile spans stages 0, 1 and the extra rows");
  // lists after the stages, the norms (and v3's extra scan rows)
  static constexpr int kListOffset = kNormOffset + Base::kNormBytes + kExtraBytes;
  static constexpr int kSmemBytes = kListOffset + Base::kBlockM * kQuarters * kSel_ * 8;
};

namespace topk_mma_detail {
typedef unsigned long long u64;

// Four approximate values of one row (columns c0 .. c0 + 3 of a 64-column quarter starting at
// point nq; columns at or past `cols` ignored) into the row's sorted list of S keys; thr is the
// list's last key's value bits (a value above it cannot enter). The scan of versions 2 and 3.
template <class Tr, int S>
__device__ __forceinline__ void scan_four(const float4 f, int c0, int cols, int nq, u64* list, unsigned& thr) {
  const float v[4] = {f.x, f.y, f.z, f.w};
  unsigned bits[4];
  bool any = false;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    bits[u] = topk_detail::order_bits<Tr>(v[u]);
    any |= bits[u] <= thr && c0 + u < cols;
  }
  if (any) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u64 key = topk_detail::make_key(bits[u], unsigned(nq + c0 + u));
      if (c0 + u < cols && key < list[S - 1]) {
        int s = S - 1;  // insert: shift the larger keys up by one
        while (s > 0 && list[s - 1] > key) {
          list[s] = list[s - 1];
          --s;
        }
        list[s] = key;
        thr = unsigned(list[S - 1] >> 32);
      }
    }
  }
}
}  // namespace topk_mma_detail

// Grid (row tiles, N splits, batch entries (looped)); each CTA walks `per` y tiles from
// split * per. scratch: [n_split * 4][batch][M][kSel] int64.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    topk_mma_kernel(const float* __restrict__ x, const float* __restrict__ y, long long* __restrict__ scratch,
                    int M, int N, int K, long long ldx, long long ldy, int batch, int batch_n1, int batch_n2,
                    long long x_bs0, long long x_bs1, long long x_bs2, long long y_bs0, long long y_bs1,
                    long long y_bs2, int n_split, int per) {
  static_assert(!Traits::kPipelined, "topk_mma_kernel: kVersion 3 and 4 go to topk_mma_pipelined_kernel");
  using Tr = Traits;
  using namespace mma_detail;
  using topk_mma_detail::u64;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, S = Tr::kSel, HR = Tr::kHalfRows;
  constexpr bool kDiff = Tr::kInner == Inner::Diff;

  extern __shared__ __align__(128) unsigned char smem[];
  float* norm_a = reinterpret_cast<float*>(smem + Tr::kStages * Tr::kStageBytes);  // (kBlockM)
  float* norm_b = norm_a + BM;                                                      // (kBlockN)
  float* scan = reinterpret_cast<float*>(smem);                                      // (kHalfRows, kRowStride)
  u64* lists = reinterpret_cast<u64*>(smem + Tr::kListOffset);  // (kBlockM, 4, kSel)

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / Tr::kWarpsN, wn = warp % Tr::kWarpsN;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y;
  const int n_begin = split * per * BN, n_end = min(N, n_begin + per * BN);
  // This thread's scan slots: row sr (+ HR in the second pass), quarter sq.
  const int sr = tid >> 2, sq = tid & 3;

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride xb{x_bs0, x_bs1, x_bs2}, yb{y_bs0, y_bs1, y_bs2};

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const BatchIndex bi = shape.split(l);
    const float* xl = x + xb.offset(bi);
    const float* yl = y + yb.offset(bi);

    // Lists empty (all ones); thresholds' high words in registers (rows past M take nothing).
    unsigned thr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) thr[h] = m0 + sr + h * HR < M ? ~0u : 0u;
    for (int e = tid; e < BM * 4 * S; e += Tr::kThreads) lists[e] = ~0ull;
    // (the first tile's barriers order these stores before any list access)

    for (int n0 = n_begin; n0 < n_end; n0 += BN) {
      float acc[Tr::kTilesM][Tr::kTilesN][4];
      block_tile_product<Tr>(xl, yl, M, N, K, ldx, ldy, m0, n0, smem, acc);
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        // Approximate values of rows pass * HR .. + HR into the scan tile (warps of that half).
        if (wm == pass) {
#pragma unroll
          for (int i = 0; i < Tr::kTilesM; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int row = g + 16 * i + 8 * hh;  // row of the half
              const float na = kDiff ? norm_a[pass * HR + row] : 0.f;
#pragma unroll
              for (int j = 0; j < Tr::kTilesN; ++j) {
                const int c = 2 * t + 8 * j;  // column in quarter wn
                float v0 = acc[i][j][2 * hh], v1 = acc[i][j][2 * hh + 1];
                if constexpr (kDiff) {
                  const float2 nb = *reinterpret_cast<const float2*>(norm_b + wn * Tr::kQuarterCols + c);
                  v0 = math::fmax_nan(fmaf(-2.f, v0, na + nb.x), 0.f);
                  v1 = math::fmax_nan(fmaf(-2.f, v1, na + nb.y), 0.f);
                }
                *reinterpret_cast<float2*>(scan + row * Tr::kRowStride + wn * Tr::kQuarterStride + c) =
                    make_float2(v0, v1);
              }
            }
        }
        __syncthreads();
        // Scan: row sr of the half, quarter sq (64 columns, points n0 + 64 sq ..).
        const int nq = n0 + sq * Tr::kQuarterCols;
        const int cols = min(Tr::kQuarterCols, n_end - nq);
        const float* src = scan + sr * Tr::kRowStride + sq * Tr::kQuarterStride;
        u64* list = lists + ((pass * HR + sr) * 4 + sq) * S;
        for (int c0 = 0; c0 < cols; c0 += 4)
          topk_mma_detail::scan_four<Tr, S>(*reinterpret_cast<const float4*>(src + c0), c0, cols, nq, list, thr[pass]);
        __syncthreads();  // the scan tile is rewritten by the next pass / the next tile's stages
      }
    }

    // This split's lists of the thread's two rows to the scratch, top bit flipped.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + sr + h * HR;
      if (m >= M) continue;
      const u64* list = lists + ((h * HR + sr) * 4 + sq) * S;
      long long* dst = scratch + ((i64(split * 4 + sq) * batch + l) * M + m) * S;
      for (int s = 0; s < S; ++s) dst[s] = (long long)(list[s] ^ 0x8000000000000000ull);
    }
    __syncthreads();  // the lists are reset for the next batch entry
  }
}

// ----------------------------------------------------------------------------------- v3
// topk_mma_pipelined_kernel (TopkMmaTraits<..., kPipelined = true>): topk_mma_kernel's candidate
// lists, bit for bit, with the cp.async ring kept running across a CTA's y tiles. In v2 every y
// tile restarts the pipeline (block_tile_product's prologue: the first k-tile's load latency is
// exposed once per tile, and K = 128 is only 8 k-tiles) and its scan tile covers three of the four
// stages. Here the scan tile takes stages 0 and 1 plus 16 KiB of its own (rows 48..63 of a pass),
// so the next tile's k-tiles 0 and 1 are issued into stages 2 and 3 right after the MMAs and load
// during the two scan passes; the x tile's squared norms are summed in the first y tile only (the
// same sums: every tile summed the same data in the same order). Unchanged: every accumulator's
// MMAs (same fragments, same order), the y norms, the approximate values, and the scan itself
// (the set of the kSel first keys of a (row, quarter) does not depend on the order of arrival, and
// each list sees the same keys with the same thresholds).
namespace topk_mma_detail {

// block_tile_product's k-loop, cut into what both rings share: the copies of one k-tile, the
// MMAs and norm sums of one landed stage, and the norms' reduction.
template <class Tr>
struct RingBase {
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  static constexpr int kStages = Tr::kRingStages, kStageBytes = Tr::kRingStageBytes;
  static constexpr int kBOffset = Tr::kXResident ? 0 : kBlockM * Tr::kRowBytes;  // y rows in a stage
  static constexpr int kRowBytes = Tr::kRowBytes, kBlockK = Tr::kBlockK, kChunkElems = Tr::kChunkElems;
  static constexpr int kChunksA = kBlockM * kRowBytes / 16 / Tr::kThreads;  // 2
  static constexpr int kChunksB = kBlockN * kRowBytes / 16 / Tr::kThreads;  // 4
  static constexpr int kRowsPerPass = Tr::kThreads / 4;                     // 64
  typedef float Acc[Tr::kTilesM][Tr::kTilesN][4];

  const float* a_l;
  const float* b_l;
  int M, N, K;
  long long lda, ldb;
  int m0, num_k_tiles, copy_row, copy_chunk;
  unsigned smem_base, copy_dst;
  // This thread's x sources at k-tile 0 (block_tile_product's src_a; nullptr: a row past M, zero-filled)
  const float* src_a[kChunksA];

  __device__ __forceinline__ RingBase(const float* a_, const float* b_, int M_, int N_, int K_, long long lda_,
                                      long long ldb_, int m0_, unsigned char* smem)
      : a_l(a_), b_l(b_), M(M_), N(N_), K(K_), lda(lda_), ldb(ldb_), m0(m0_) {
    num_k_tiles = ceil_div(K, kBlockK);
    copy_row = threadIdx.x >> 2;
    copy_chunk = threadIdx.x & 3;
    smem_base = mma_detail::smem_u32(smem);
    // block_tile_product's copy assignment and swizzle
    copy_dst = (unsigned)(copy_row * kRowBytes + ((copy_chunk ^ (((copy_row >> 1) & 1) << 1)) * 16));
#pragma unroll
    for (int u = 0; u < kChunksA; ++u) {
      const int row = m0 + copy_row + u * kRowsPerPass;
      src_a[u] = row < M ? a_l + (long long)row * lda + copy_chunk * kChunkElems : nullptr;
    }
  }

  // This thread's first y source of the tile at n0 (its rows n0 + copy_row + 64 u lie 64 ldb apart).
  __device__ __forceinline__ const float* row_b(int n0) const {
    return b_l + (long long)(n0 + copy_row) * ldb + copy_chunk * kChunkElems;
  }

  // Shared memory of stage `stage` (v5: y rows only) and of x's k-tile kt (v5: the resident x).
  __device__ __forceinline__ static const unsigned char* stage_ptr(const unsigned char* smem, int stage) {
    return smem + Tr::kStagesOffset + stage * kStageBytes;
  }

  // k-tile kt of the y tile at n0 (pb: row_b(n0)) and of the x tile (with_x; v5: into the
  // resident x) into `stage`; no commit. block_tile_product's load_tile.
  __device__ __forceinline__ void load_from(int stage, int kt, int n0, const float* pb, bool with_x = true) const {
    const int k_left = K - kt * kBlockK - copy_chunk * kChunkElems;  // elements left in the row
    const int bytes = k_left <= 0 ? 0 : (k_left >= kChunkElems ? 16 : k_left * 4);
    const unsigned dst = smem_base + Tr::kStagesOffset + stage * kStageBytes + copy_dst;
    const int koff = kt * kBlockK;
    if (!Tr::kXResident || with_x) {
      const unsigned xdst = Tr::kXResident ? smem_base + kt * kBlockM * kRowBytes + copy_dst : dst;
#pragma unroll
      for (int u = 0; u < kChunksA; ++u) {
        const bool ok = src_a[u] != nullptr && bytes > 0;
        mma_detail::cp_async_16(xdst + u * kRowsPerPass * kRowBytes, ok ? src_a[u] + koff : a_l, ok ? bytes : 0);
      }
    }
    pb += koff;
#pragma unroll
    for (int u = 0; u < kChunksB; ++u) {
      const bool ok = n0 + copy_row + u * kRowsPerPass < N && bytes > 0;
      mma_detail::cp_async_16(dst + kBOffset + u * kRowsPerPass * kRowBytes, ok ? pb : b_l, ok ? bytes : 0);
      pb += kRowsPerPass * ldb;
    }
  }

  __device__ __forceinline__ static void clear(Acc& acc, float (&sq_a)[kChunksA], float (&sq_b)[kChunksB]) {
#pragma unroll
    for (int i = 0; i < Tr::kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < Tr::kTilesN; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
#pragma unroll
    for (int u = 0; u < kChunksA; ++u) sq_a[u] = 0.f;
#pragma unroll
    for (int u = 0; u < kChunksB; ++u) sq_b[u] = 0.f;
  }

  // One landed k-tile: block_tile_product's norm sums (x's only if first) and MMAs, same order;
  // x's k-tile at xs, y's at ys (a v2 stage: xs = stage, ys = stage + kBlockM rows).
  __device__ __forceinline__ static void mma_stage(const unsigned char* xs, const unsigned char* ys, bool first,
                                                   Acc& acc, float (&sq_a)[kChunksA], float (&sq_b)[kChunksB]) {
    using namespace mma_detail;
    constexpr int kTilesM = Tr::kTilesM, kTilesN = Tr::kTilesN;
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / Tr::kWarpsN, wn = warp % Tr::kWarpsN;
    const int swz = ((g >> 1) & 1) << 1;
    const int frag_a_row = (wm * Tr::kWarpM + g) * kRowBytes;
    const int frag_b_row = (wn * Tr::kWarpN + g) * kRowBytes;
    const int frag_col[2] = {(((0 + (t >> 1)) ^ swz) * 16) + (t & 1) * 8,
                             (((2 + (t >> 1)) ^ swz) * 16) + (t & 1) * 8};
    if constexpr (Tr::kInner == Inner::Diff) {
      if (first) {
#pragma unroll
        for (int u = 0; u < kChunksA; ++u)
          sq_a[u] += chunk_sumsq<float>(*reinterpret_cast<const uint4*>(xs + (tid + u * Tr::kThreads) * 16));
      }
#pragma unroll
      for (int u = 0; u < kChunksB; ++u)
        sq_b[u] += chunk_sumsq<float>(*reinterpret_cast<const uint4*>(ys + (tid + u * Tr::kThreads) * 16));
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      unsigned a_big[kTilesM][4], a_small[kTilesM][4];
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
        const uint2 r0 = *reinterpret_cast<const uint2*>(xs + frag_a_row + (i * 16) * kRowBytes + frag_col[s]);
        const uint2 r1 =
            *reinterpret_cast<const uint2*>(xs + frag_a_row + (i * 16 + 8) * kRowBytes + frag_col[s]);
        const unsigned raw[4] = {r0.x, r1.x, r0.y, r1.y};  // a0 a1 a2 a3
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if constexpr (Tr::kPrecision == Precision::Tf32x3) {
            split_tf32x3(raw[r], a_big[i][r], a_small[i][r]);
          } else {
            a_big[i][r] = tf32_rna(raw[r]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
        const uint2 rb = *reinterpret_cast<const uint2*>(ys + frag_b_row + (j * 8) * kRowBytes + frag_col[s]);
        if constexpr (Tr::kPrecision == Precision::Tf32x3) {
          unsigned b0, b1, b0s, b1s;
          split_tf32x3(rb.x, b0, b0s);
          split_tf32x3(rb.y, b1, b1s);
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) {
            mma_tf32(acc[i][j], a_small[i], b0, b1);
            mma_tf32(acc[i][j], a_big[i], b0s, b1s);
            mma_tf32(acc[i][j], a_big[i], b0, b1);
          }
        } else {
          const unsigned b0 = tf32_rna(rb.x), b1 = tf32_rna(rb.y);
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) mma_tf32(acc[i][j], a_big[i], b0, b1);
        }
      }
    }
  }

  // The squared norms to shared memory (x's only if first), as block_tile_product reduces them.
  __device__ __forceinline__ void norms(bool first, float (&sq_a)[kChunksA], float (&sq_b)[kChunksB],
                                        unsigned char* smem) const {
    float* norm_a = reinterpret_cast<float*>(smem + Tr::kNormOffset);  // (kBlockM)
    float* norm_b = norm_a + kBlockM;                                   // (kBlockN)
    if constexpr (Tr::kInner == Inner::Diff) {
      if (first) mma_detail::store_quad_norms<kRowsPerPass>(sq_a, norm_a, copy_row, copy_chunk);
      mma_detail::store_quad_norms<kRowsPerPass>(sq_b, norm_b, copy_row, copy_chunk);
    }
  }
};

// v3's ring: k-tile kt of a y tile sits in stage (kt + kPrefetch) % kStages, so that the next
// tile's first kPrefetch k-tiles can be issued (after the MMAs' last barrier) while stages
// 0 .. kPrefetch - 1 hold the scan tile.
template <class Tr>
struct TileRing : RingBase<Tr> {
  using B = RingBase<Tr>;
  using B::B;
  static_assert(Tr::kPrefetch >= 1 && Tr::kPrefetch <= B::kStages - 1, "TileRing: prefetch depth");

  __device__ __forceinline__ void load(int kt, int n0, const float* pb) const {
    B::load_from((kt + Tr::kPrefetch) % B::kStages, kt, n0, pb);
  }

  // The first kPrefetch k-tiles of the y tile at n0, one commit group each. Stages kPrefetch ..
  // must be free (after a barrier that follows every read of them).
  __device__ __forceinline__ void prefetch(int n0) const {
    const float* pb = B::row_b(n0);
#pragma unroll
    for (int s = 0; s < Tr::kPrefetch; ++s) {
      if (s < B::num_k_tiles) load(s, n0, pb);
      mma_detail::cp_async_commit();
    }
  }

  // The y tile at n0 (its first kPrefetch k-tiles already issued by prefetch): acc as
  // block_tile_product leaves it, norm_b (and norm_a if first) in shared memory; ends with a
  // barrier (norms visible, every stage read), then issues the tile at next_n0 (< 0: none).
  __device__ __forceinline__ void product(int n0, bool first, int next_n0, unsigned char* smem,
                                          typename B::Acc& acc) const {
    using namespace mma_detail;
    constexpr int kStages = B::kStages;
    float sq_a[B::kChunksA], sq_b[B::kChunksB];
    B::clear(acc, sq_a, sq_b);
    const float* pb = B::row_b(n0);
    // The rest of the prologue (stages 0 .. were the scan tile: free since the last barrier).
#pragma unroll
    for (int s = Tr::kPrefetch; s < kStages - 1; ++s) {
      if (s < B::num_k_tiles) load(s, n0, pb);
      cp_async_commit();
    }
    for (int kt = 0; kt < B::num_k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // k-tile kt has landed (for this thread) ...
      __syncthreads();               // ... for all threads; the stage of k-tile kt - 1 is free
      {
        const int kn = kt + kStages - 1;
        if (kn < B::num_k_tiles) load(kn, n0, pb);
        cp_async_commit();
      }
      const unsigned char* stage = B::stage_ptr(smem, (kt + Tr::kPrefetch) % kStages);
      B::mma_stage(stage, stage + B::kBOffset, first, acc, sq_a, sq_b);
    }
    // (only empty groups are left: no wait; the next ones are the next tile's)
    B::norms(first, sq_a, sq_b, smem);
    __syncthreads();  // norms visible; every warp is past its last read of the stages
    if (next_n0 >= 0) prefetch(next_n0);
  }
};

// v4's ring: one stream of k-tiles over the CTA's whole y range, kStages - 1 always in flight:
// the k-loop of a tile's last iterations already issues the next tile's first k-tiles, and the
// stages rotate through the tiles (k-tile kt of the tile at n0 sits where the stream put it).
template <class Tr>
struct StreamRing : RingBase<Tr> {
  using B = RingBase<Tr>;
  int n_begin, n_end, ld_n0, ld_kt, ld_stage, cs_stage;  // the next copy's tile, k-tile, stage; the next MMAs' stage
  const float* ld_b;  // row_b(ld_n0)

  __device__ __forceinline__ StreamRing(const float* a_, const float* b_, int M_, int N_, int K_, long long lda_,
                                        long long ldb_, int m0_, unsigned char* smem, int n_begin_, int n_end_)
      : B(a_, b_, M_, N_, K_, lda_, ldb_, m0_, smem), n_begin(n_begin_), n_end(n_end_), ld_n0(n_begin_), ld_kt(0),
        ld_stage(0), cs_stage(0) {
    ld_b = B::row_b(n_begin_);
  }

  // The stream's next k-tile (none past the range: an empty group all the same) and one commit;
  // v5: x's k-tiles go with the first y tile's (into the resident x, once per range).
  __device__ __forceinline__ void issue() {
    if (ld_n0 < n_end) B::load_from(ld_stage, ld_kt, ld_n0, ld_b, ld_n0 == n_begin);
    mma_detail::cp_async_commit();
    ld_stage = ld_stage + 1 == B::kStages ? 0 : ld_stage + 1;
    const bool wrap = ++ld_kt == B::num_k_tiles;
    ld_kt = wrap ? 0 : ld_kt;
    ld_n0 += wrap ? B::kBlockN : 0;
    ld_b += wrap ? B::kBlockN * B::ldb : 0;
  }

  // The prologue, once per range (stages free: kernel start or the last barrier).
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int s = 0; s < B::kStages - 1; ++s) issue();
  }

  // The y tile at n0 (the stream's next one): acc and the norms as TileRing::product leaves them;
  // ends with a barrier (norms visible). The stage issued at iteration kt is the one whose MMAs
  // ran at iteration kt - 1 (of this tile or the last), free after iteration kt's barrier.
  __device__ __forceinline__ void product(bool first, unsigned char* smem, typename B::Acc& acc) {
    using namespace mma_detail;
    float sq_a[B::kChunksA], sq_b[B::kChunksB];
    B::clear(acc, sq_a, sq_b);
    for (int kt = 0; kt < B::num_k_tiles; ++kt) {
      cp_async_wait<B::kStages - 2>();  // this k-tile has landed (for this thread) ...
      __syncthreads();                  // ... for all threads; the last k-tile's stage is free
      issue();
      const unsigned char* stage = B::stage_ptr(smem, cs_stage);
      const unsigned char* xs = Tr::kXResident ? smem + kt * B::kBlockM * B::kRowBytes : stage;
      B::mma_stage(xs, stage + B::kBOffset, first, acc, sq_a, sq_b);
      cs_stage = cs_stage + 1 == B::kStages ? 0 : cs_stage + 1;
    }
    B::norms(first, sq_a, sq_b, smem);
    __syncthreads();  // norms visible
  }
};

// v4's scan of one y tile, straight from the accumulators: the thread's values (rows wm * 64 +
// 16 i + 8 hh + g, columns 2 t + 8 j (+1) of quarter wn, as the MMA fragments hold them) are
// compared in registers with their rows' thresholds (the high word of the lists' last keys).
// Nearly every value fails; the survivors go into the lists as in v2, but the four lanes t of a
// row group share their eight rows' lists, so they insert in turn (four rounds, __syncwarp
// between). Each list belongs to one warp (rows of its half, its quarter): no block barrier.
// The values overwrite acc.
template <class Tr>
__device__ __forceinline__ void filter_tile(float (&acc)[Tr::kTilesM][Tr::kTilesN][4], const float* norm_a,
                                            const float* norm_b, u64* lists, int n0, int n_end, int wm, int wn,
                                            int g, int t) {
  constexpr int S = Tr::kSel;
  constexpr bool kDiff = Tr::kInner == Inner::Diff;
  const int col0 = wn * Tr::kQuarterCols + 2 * t;  // tile column of j = 0
  unsigned rows_hit = 0;                           // bit 2 i + hh: that row has a survivor
#pragma unroll
  for (int i = 0; i < Tr::kTilesM; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = wm * Tr::kWarpM + 16 * i + 8 * hh + g;
      // The prefilter in the values' own order: order_bits is monotone, so every value whose
      // bits are <= thr compares <= value_of(thr) (>= for the largest), and NaN (either one)
      // passes; columns past n_end are left to the insertion's exact test.
      const float thr_f = topk_detail::value_of<Tr>(unsigned(lists[(row * 4 + wn) * S + S - 1] >> 32));
      const float na = kDiff ? norm_a[row] : 0.f;
      bool hit = false;
#pragma unroll
      for (int j = 0; j < Tr::kTilesN; ++j) {
        const int c = col0 + 8 * j;
        float v0 = acc[i][j][2 * hh], v1 = acc[i][j][2 * hh + 1];
        if constexpr (kDiff) {
          const float2 nb = *reinterpret_cast<const float2*>(norm_b + c);
          v0 = math::fmax_nan(fmaf(-2.f, v0, na + nb.x), 0.f);
          v1 = math::fmax_nan(fmaf(-2.f, v1, na + nb.y), 0.f);
        }
        acc[i][j][2 * hh] = v0;
        acc[i][j][2 * hh + 1] = v1;
        if constexpr (Tr::kLargest) {
          hit |= !(v0 < thr_f) || !(v1 < thr_f);
        } else {
          hit |= !(v0 > thr_f) || !(v1 > thr_f);
        }
      }
      if (hit) rows_hit |= 1u << (2 * i + hh);
    }
  if (!__any_sync(0xffffffffu, rows_hit != 0)) return;
  __syncwarp();  // every lane's threshold reads before the first round's writes
  for (int r = 0; r < 4; ++r) {
    if (t == r && rows_hit != 0) {
#pragma unroll
      for (int i = 0; i < Tr::kTilesM; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if (!((rows_hit >> (2 * i + hh)) & 1u)) continue;
          u64* list = lists + ((wm * Tr::kWarpM + 16 * i + 8 * hh + g) * 4 + wn) * S;
          const unsigned thr = unsigned(list[S - 1] >> 32);
          unsigned cand = 0;  // bit 2 j + e: value (j, e) at or below the threshold, in range
#pragma unroll
          for (int j = 0; j < Tr::kTilesN; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (topk_detail::order_bits<Tr>(acc[i][j][2 * hh + e]) <= thr && n0 + col0 + 8 * j + e < n_end)
                cand |= 1u << (2 * j + e);
          while (cand != 0) {  // (one insertion loop per row: the value picked by a select chain)
            const int b = __ffs(cand) - 1;
            cand &= cand - 1;
            float value = 0.f;
#pragma unroll
            for (int q = 0; q < 2 * Tr::kTilesN; ++q)
              if (q == b) value = acc[i][q >> 1][2 * hh + (q & 1)];
            const unsigned bits = topk_detail::order_bits<Tr>(value);
            const u64 key = topk_detail::make_key(bits, unsigned(n0 + col0 + 8 * (b >> 1) + (b & 1)));
            if (key < list[S - 1]) {
              int s = S - 1;  // insert: shift the larger keys up by one
              while (s > 0 && list[s - 1] > key) {
                list[s] = list[s - 1];
                --s;
              }
              list[s] = key;
            }
          }
        }
    }
    __syncwarp();  // this round's insertions before the next lane's
  }
}

}  // namespace topk_mma_detail

// Same arguments, grid and scratch as topk_mma_kernel.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    topk_mma_pipelined_kernel(const float* __restrict__ x, const float* __restrict__ y,
                              long long* __restrict__ scratch, int M, int N, int K, long long ldx, long long ldy,
                              int batch, int batch_n1, int batch_n2, long long x_bs0, long long x_bs1,
                              long long x_bs2, long long y_bs0, long long y_bs1, long long y_bs2, int n_split,
                              int per) {
  static_assert(Traits::kPipelined, "topk_mma_pipelined_kernel: TopkMmaTraits<..., kVersion 3, 4 or 5>");
  if constexpr (Traits::kXResident) {
    if (ceil_div(K, Traits::kBlockK) > Traits::kMaxKTiles) __trap();  // v5: K <= 128 (the caller's rule)
  }
  using Tr = Traits;
  using namespace mma_detail;
  using topk_mma_detail::u64;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, S = Tr::kSel, HR = Tr::kHalfRows;
  constexpr int kRowB = Tr::kScanRowBytes, kQuarterB = Tr::kQuarterCols * 4;
  constexpr bool kDiff = Tr::kInner == Inner::Diff;

  extern __shared__ __align__(128) unsigned char smem[];
  float* norm_a = reinterpret_cast<float*>(smem + Tr::kNormOffset);  // (kBlockM)
  float* norm_b = norm_a + BM;                                        // (kBlockN)
  // Scan tile (kHalfRows rows of kBlockN floats): row r at smem + r kRowB (r < kStageRows, stages
  // 0 and 1) or at scan_hi + r kRowB (the region after the norms). 16-byte slot s of quarter q of
  // row r sits at slot s ^ (r % 8) ^ 2q of that quarter: a warp's float2 stores (8 rows x 4 lanes)
  // and a quarter-warp's LDS.128 (2 rows x 4 quarters) each meet every bank equally often.
  unsigned char* scan_hi = smem + Tr::kExtraOffset - Tr::kStageRows * kRowB;
  u64* lists = reinterpret_cast<u64*>(smem + Tr::kListOffset);  // (kBlockM, 4, kSel)

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / Tr::kWarpsN, wn = warp % Tr::kWarpsN;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y;
  const int n_begin = split * per * BN, n_end = min(N, n_begin + per * BN);
  // This thread's scan slots: row sr (+ HR in the second pass), quarter sq.
  const int sr = tid >> 2, sq = tid & 3;
  const unsigned char* scan_src = (sr < Tr::kStageRows ? smem : scan_hi) + sr * kRowB + sq * kQuarterB;
  const int scan_swz = (sr & 7) ^ (2 * sq);

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride xb{x_bs0, x_bs1, x_bs2}, yb{y_bs0, y_bs1, y_bs2};

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const BatchIndex bi = shape.split(l);
    const float* xl = x + xb.offset(bi);
    const float* yl = y + yb.offset(bi);

    unsigned thr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) thr[h] = m0 + sr + h * HR < M ? ~0u : 0u;
    // (rows past M: lists of key 0, which nothing enters; v4 reads its thresholds from the lists)
    for (int e = tid; e < BM * 4 * S; e += Tr::kThreads) lists[e] = m0 + e / (4 * S) < M ? ~0ull : 0ull;

    const topk_mma_detail::TileRing<Tr> ring(xl, yl, M, N, K, ldx, ldy, m0, smem);
    topk_mma_detail::StreamRing<Tr> stream(xl, yl, M, N, K, ldx, ldy, m0, smem, n_begin, n_end);
    if constexpr (Tr::kVersion >= 4) {
      if (n_begin < n_end) stream.start();  // (stages free: kernel start or the last barrier)
    } else {
      if (n_begin < n_end) ring.prefetch(n_begin);
    }
    bool first = true;
    for (int n0 = n_begin; n0 < n_end; n0 += BN) {
      float acc[Tr::kTilesM][Tr::kTilesN][4];
      if constexpr (Tr::kVersion >= 4) {
        stream.product(first, smem, acc);
      } else {
        ring.product(n0, first, n0 + BN < n_end ? n0 + BN : -1, smem, acc);
      }
      first = false;
      if constexpr (Tr::kVersion >= 4) {
        topk_mma_detail::filter_tile<Tr>(acc, norm_a, norm_b, lists, n0, n_end, wm, wn, g, t);
      } else {  // v3: the values through the scan tile, two passes of 64 rows
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
          if (wm == pass) {
#pragma unroll
            for (int i = 0; i < Tr::kTilesM; ++i)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int row = g + 16 * i + 8 * hh;  // row of the half (row % 8 == g)
                unsigned char* dst = (16 * i < Tr::kStageRows ? smem : scan_hi) + row * kRowB + wn * kQuarterB;
                const int swz = g ^ (2 * wn);
                const float na = kDiff ? norm_a[pass * HR + row] : 0.f;
#pragma unroll
                for (int j = 0; j < Tr::kTilesN; ++j) {
                  const int c = 2 * t + 8 * j;  // column in quarter wn
                  float v0 = acc[i][j][2 * hh], v1 = acc[i][j][2 * hh + 1];
                  if constexpr (kDiff) {
                    const float2 nb = *reinterpret_cast<const float2*>(norm_b + wn * Tr::kQuarterCols + c);
                    v0 = math::fmax_nan(fmaf(-2.f, v0, na + nb.x), 0.f);
                    v1 = math::fmax_nan(fmaf(-2.f, v1, na + nb.y), 0.f);
                  }
                  *reinterpret_cast<float2*>(dst + ((((c >> 2) ^ swz)) << 4) + (c & 3) * 4) = make_float2(v0, v1);
                }
              }
          }
          __syncthreads();
          // Scan: row sr of the half, quarter sq (64 columns, points n0 + 64 sq ..), as in v2.
          const int nq = n0 + sq * Tr::kQuarterCols;
          const int cols = min(Tr::kQuarterCols, n_end - nq);
          u64* list = lists + ((pass * HR + sr) * 4 + sq) * S;
          for (int c0 = 0; c0 < cols; c0 += 4)
            topk_mma_detail::scan_four<Tr, S>(
                *reinterpret_cast<const float4*>(scan_src + (((c0 >> 2) ^ scan_swz) << 4)), c0, cols, nq, list, thr[pass]);
          __syncthreads();  // the scan tile is rewritten by the next pass / the next tile's stages
        }
      }
    }

    if constexpr (Tr::kVersion >= 4) __syncthreads();  // every warp's lists are final
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + sr + h * HR;
      if (m >= M) continue;
      const u64* list = lists + ((h * HR + sr) * 4 + sq) * S;
      long long* dst = scratch + ((i64(split * 4 + sq) * batch + l) * M + m) * S;
      for (int s = 0; s < S; ++s) dst[s] = (long long)(list[s] ^ 0x8000000000000000ull);
    }
    __syncthreads();  // the lists are reset for the next batch entry
  }
}

}  // namespace kermac_like
