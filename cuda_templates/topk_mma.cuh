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
// kSel_: list length per (row, quarter), 8 to 24.
template <Inner kInner_, Precision kPrecision_, bool kLargest_, int kSel_>
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
  static constexpr int kListOffset = Base::kSmemBytes;  // lists after the stages and norms
  static constexpr int kSmemBytes = kListOffset + Base::kBlockM * kQuarters * kSel_ * 8;
};

namespace topk_mma_detail {
typedef unsigned long long u64;
}  // namespace topk_mma_detail

// Grid (row tiles, N splits, batch entries (looped)); each CTA walks `per` y tiles from
// split * per. scratch: [n_split * 4][batch][M][kSel] int64.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    topk_mma_kernel(const float* __restrict__ x, const float* __restrict__ y, long long* __restrict__ scratch,
                    int M, int N, int K, long long ldx, long long ldy, int batch, int batch_n1, int batch_n2,
                    long long x_bs0, long long x_bs1, long long x_bs2, long long y_bs0, long long y_bs1,
                    long long y_bs2, int n_split, int per) {
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
        for (int c0 = 0; c0 < cols; c0 += 4) {
          const float4 f = *reinterpret_cast<const float4*>(src + c0);
          const float v[4] = {f.x, f.y, f.z, f.w};
          unsigned bits[4];
          bool any = false;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            bits[u] = topk_detail::order_bits<Tr>(v[u]);
            any |= bits[u] <= thr[pass] && c0 + u < cols;
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
                thr[pass] = unsigned(list[S - 1] >> 32);
              }
            }
          }
        }
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

}  // namespace kermac_like
