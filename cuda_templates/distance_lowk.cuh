// Exact fp32 SIMT distance / kernel-matrix kernel for low dimension K (ABI: the
// argument list of distance_kernel, cuda_templates/distance.cuh).
//
//   out[l][m,n] = epilogue(outer(sum_k inner(a[l][m,k], b[l][n,k]))) (+ lambda on a diagonal)
//
// At K <= 64 a 20000^2 float32 matrix costs more to write (1.6 GB) than to
// compute, so this kernel is built around the store:
//   * the whole K of the block's rows is loaded once into shared memory (k-major,
//     (K, BM + 4) per operand), no pipeline, no second pass: kK is a compile-time
//     parameter (the launcher picks the smallest instantiated kK >= K; k >= K is
//     zero-filled and inner(0, 0) == 0) and the k loop is fully unrolled;
//     kK == 0 is the generic variant: K in chunks of kChunkK through the same
//     shared tiles, one barrier per chunk, the chunk's k loop unrolled by 4;
//   * block 256 threads -> 128 x 128 outputs, thread 8 x 8: rows tm*8 .. tm*8+7
//     (one float4 pair of a per k) and columns tn*4 + {0..3} and 64 + tn*4 + {0..3}
//     (one float4 pair of b per k): 4 LDS.128 per 128 FP instructions;
//   * warp = 2 (m) x 16 (n) threads, so each store instruction writes two rows of
//     256 contiguous bytes: 16-byte streaming stores (st.global.cs, evict-first:
//     the output is not read again by this kernel) straight from registers when
//     out's rows are 16-byte aligned, scalar stores otherwise and at the right edge;
//   * the output is row-major: the launcher computes a column-major out as the
//     row-major out^T = kernel(b, a) (every inner operator is symmetric, the
//     regularised diagonal changes sign);
//   * two (kMinBlocksPerSm) blocks per SM: one block's stores overlap the other's
//     loads and arithmetic.
// Inner operator and epilogue: math.cuh (namespace exact), the same code as the
// K-blocked SIMT kernel, so both give identical results for the same k order.
// Edges: rows past M/N are clamped on load (their outputs are never stored).
#pragma once

#include "common.cuh"
#include "math.cuh"

namespace kermac_like {

template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, Layout kLayoutA_,
          Layout kLayoutB_, int kK_, int kMinBlocksPerSm_ = 2>
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
  static_assert(kK_ >= 0 && kK_ <= 64, "DistanceLowKTraits: kK is 1..64 (0: K at run time)");
  static_assert(kMinBlocksPerSm_ >= 1 && kMinBlocksPerSm_ <= 3, "DistanceLowKTraits: kMinBlocksPerSm is 1..3");

  using T = float;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr Layout kLayoutA = kLayoutA_;
  static constexpr Layout kLayoutB = kLayoutB_;
  static constexpr Layout kLayoutOut = Layout::RowMajor;
  static constexpr int kK = kK_;

  static constexpr int kThreads = 256;
  static constexpr int kThreadM = 8, kThreadN = 8;
  static constexpr int kBlockM = 16 * kThreadM;  // 128
  static constexpr int kBlockN = 16 * kThreadN;  // 128
  static constexpr int kChunkK = kK_ > 0 ? kK_ : 32;  // k resident in shared memory at once
  static constexpr int kSmemStride = kBlockM + 4;     // floats per k-row (float4-aligned rows)
  static constexpr int kSmemBytes = 2 * kChunkK * kSmemStride * 4;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kPolyPer64 = 41;  // fractional p: exp2 on the FMA pipe, per 64 elements

  static_assert(kBlockM == kBlockN, "A and B tiles share one shared-memory row stride");

  __host__ __device__ static constexpr bool exp2_on_fma(int i, int j) {
    return ((i * kThreadN + j + 1) * kPolyPer64) / 64 > ((i * kThreadN + j) * kPolyPer64) / 64;
  }
};

namespace lowk_detail {

extern __shared__ __align__(16) float kl_lowk_smem[];

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
template <class Tr, Layout kLayout, int kc>
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ x, i64 ld, int rows, int row0,
                                          int k0, int K, int tid) {
  constexpr int BM = Tr::kBlockM, S = Tr::kSmemStride, kCount = BM * kc;
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
    }
  }
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

// acc[i][j] += inner(a[k], b[k]) for one k of the shared tiles.
template <class Tr>
__device__ __forceinline__ void step(float (&acc)[8][8], const float* sa, const float* sb, const math::PowArgs& pw) {
  const float4 a0 = *reinterpret_cast<const float4*>(sa);
  const float4 a1 = *reinterpret_cast<const float4*>(sa + 4);
  const float4 b0 = *reinterpret_cast<const float4*>(sb);
  const float4 b1 = *reinterpret_cast<const float4*>(sb + Tr::kBlockN / 2);
  const float fa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const float fb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = exact::accumulate<Tr>(acc[i][j], fa[i], fb[j], i, j, pw);
  // The next step's shared-memory reads stay behind this point: hoisting every
  // step's fragments ahead of the arithmetic costs 16 registers per step and
  // spills at the 128-register budget of two blocks per SM.
#if defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
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
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, S = Tr::kSmemStride, KC = Tr::kChunkK;

  const DistanceBatchArgs<typename Tr::T> args(
      a, b, out, batch_n1, batch_n2, a_bs0, a_bs1, a_bs2, b_bs0, b_bs1, b_bs2, o_bs0, o_bs1, o_bs2,
      inner_p_ptr, inner_p_bs0, inner_p_bs1, inner_p_bs2, inner_p, outer_p_ptr, outer_p_bs0,
      outer_p_bs1, outer_p_bs2, outer_p, bw_ptr, bw_bs0, bw_bs1, bw_bs2, bandwidth, reg_ptr,
      reg_bs0, reg_bs1, reg_bs2, regularization);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int tm = warp * 2 + (lane >> 4);  // rows tm*8 .. tm*8 + 7
  const int tn = lane & 15;               // columns tn*4 + {0..3}, BN/2 + tn*4 + {0..3}
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  float* const sa = kl_lowk_smem;
  float* const sb = kl_lowk_smem + KC * S;

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const auto entry = args.at(l);
    math::PowArgs pw{};
    if constexpr (Tr::kInnerPow == Power::Pow) pw = math::make_pow_args(args.inner_p.at(entry.index));

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    if constexpr (Tr::kK > 0) {
      if (l != int(blockIdx.z)) __syncthreads();  // the previous entry's reads are done
      load_tile<Tr, Tr::kLayoutA, KC>(sa, entry.a, lda, M, m0, 0, K, tid);
      load_tile<Tr, Tr::kLayoutB, KC>(sb, entry.b, ldb, N, n0, 0, K, tid);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < KC; ++k) step<Tr>(acc, sa + k * S + tm * 8, sb + k * S + tn * 4, pw);
    } else {
#pragma unroll 1
      for (int k0 = 0; k0 < K; k0 += KC) {
        if (k0 > 0 || l != int(blockIdx.z)) __syncthreads();  // the previous chunk's reads are done
        load_tile<Tr, Tr::kLayoutA, KC>(sa, entry.a, lda, M, m0, k0, K, tid);
        load_tile<Tr, Tr::kLayoutB, KC>(sb, entry.b, ldb, N, n0, k0, K, tid);
        __syncthreads();
        const int kc = K - k0 < KC ? K - k0 : KC;  // k of this chunk (zero-filled up to KC)
        const float* pa = sa + tm * 8;
        const float* pb = sb + tn * 4;
#pragma unroll 1
        for (int k = 0; k < kc; k += 4, pa += 4 * S, pb += 4 * S) {
#pragma unroll
          for (int u = 0; u < 4; ++u) step<Tr>(acc, pa + u * S, pb + u * S, pw);
        }
      }
    }

    // ---- epilogue, from registers.
    const exact::EpilogueArgs ea = exact::epilogue_args<Tr>(args, entry.index, epsilon);
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
    float* const o = entry.out;
    // Whole tile and 16-byte aligned rows: vector stores without predicates.
    const bool fast = n0 + BN <= N && m0 + BM <= M &&
                      ((reinterpret_cast<unsigned long long>(o) | (unsigned long long)(ldo * 4)) & 15) == 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = tm * 8 + i;
      if (!fast && m0 + r >= M) break;
      float* const row = o + i64(m0 + r) * ldo + n0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = h * (BN / 2) + tn * 4;
        float y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] = exact::finish<Tr>(acc[i][h * 4 + e], ea);
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
            if (n0 + c + e < N) store_stream(row + c + e, y[e]);
        }
      }
    }
  }
}

}  // namespace kermac_like
