// Fused log-domain kernel sums without the matrix: kernel_logsumexp (ABI: cuda_templates/ABI.md,
// built by kermac_like/plan/logsumexp.py).
//
//   out[l][m][c] = log sum_n exp(-phi(x[l][m], y[l][n]) + lw[l][n][c])
//
// for a descriptor with a Laplace or Gaussian epilogue: phi = d / bw or d^2 / (2 bw^2) of
// run_kernel's distance d = outer(sum_k inner(x_mk, y_nk)) (Gaussian of a Euclidean distance:
// phi straight from the sum of squares). The kernel value exp(-phi) is never formed, so nothing
// underflows: every row and column keeps a running maximum mx and a sum s of exp2(v - mx) over
// the terms v seen so far, in base 2 (v = -phi log2(e) + lw log2(e)), kUnrollJ points at a time:
// their maximum first, the sum rescaled once, then one exp2 per term (MUFU ex2.approx: ~2 ulp;
// terms below 2^-126 of the maximum flush to 0). A NaN term leaves s NaN; -inf terms add nothing.
//
// Structure as topk.cuh: each CTA owns kBlockM rows of x (kRows per thread, strided by kThreads;
// x in registers, zero-padded to kK), walks its range of y in tiles of kBlockN points staged in
// shared memory with their kC log-weight columns (times log2(e); broadcast reads), in index
// order. Columns beyond kC: the planner launches one column chunk after another.
//
// Output: with one N range (n_split == 1) out = (mx + log2(s)) ln(2). With n_split > 1 each CTA leaves its range's (mx, s) in the scratch
// [split][batch][M][kC][2] and lse_combine_kernel combines the splits of a row in split order:
// the same bits for the same inputs and split count.
#pragma once

#include "common.cuh"
#include "storage16.cuh"
#include "math.cuh"

namespace kermac_like {

// kK_: the padded K (1..64; x rows in registers); kC_: log-weight columns per launch (1..8).
template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, class T_, int kK_, int kC_>
struct LseTraits {
  static_assert(kInner_ == Inner::Diff, "LseTraits: phi is a distance (Inner::Diff)");
  static_assert(kInnerPow_ != Power::Noop && kInnerPow_ != Power::Sqrt,
                "LseTraits: inner power Abs, Square or Pow");
  static_assert(kOuterPow_ != Power::Abs && kOuterPow_ != Power::Square,
                "LseTraits: outer power must be Noop, Sqrt or Pow");
  static_assert(kEpilogue_ == Epilogue::Laplace || kEpilogue_ == Epilogue::Gaussian,
                "LseTraits: the kernel is exp(-phi): Epilogue::Laplace or Epilogue::Gaussian");
  static_assert(SameType<T_, float>::value || SameType<T_, float16>::value ||
                    SameType<T_, bfloat16>::value,
                "LseTraits: T must be float, kermac_like::float16 or kermac_like::bfloat16");
  static_assert(kK_ >= 1 && kK_ <= 64, "LseTraits: kK is the padded K, 1..64");
  static_assert(kC_ >= 1 && kC_ <= 8, "LseTraits: kC is 1..8 columns");

  using T = T_;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr int kK = kK_;
  static constexpr int kC = kC_;
  // phi from the sum of squares itself (no square root, then no square).
  static constexpr bool kSquared = kEpilogue_ == Epilogue::Gaussian && kOuterPow_ == Power::Sqrt;

  static constexpr int kThreads = 128;
  // Rows per thread: x and the (mx, s) pairs take kK + 2 kC registers per row; about 80 in all
  // (topk.cuh's rule).
  static constexpr int kRowRegs = kK_ + 2 * kC_;
  static constexpr int kRows = kRowRegs * 4 <= 80 ? 4 : kRowRegs * 2 <= 80 ? 2 : 1;
  static constexpr int kBlockM = kThreads * kRows;
  static constexpr int kKS = (kK_ + 3) / 4 * 4;  // shared row of a point (float4 reads)
  static constexpr int kBlockN = kKS <= 16 ? 256 : 128;  // y points per shared-memory tile
  // Dynamic shared memory: the y tile (kBlockN, kKS), then its log-weights (kBlockN, kC).
  static constexpr int kSmemBytes = kBlockN * (kKS + kC_) * 4;
  // Points per trip of the pair loop (their maximum first, one rescale of the running sum): as
  // many as the y registers allow (kUnrollJ * kKS of them).
  static constexpr int kUnrollJ = kKS <= 8 ? (kC_ <= 2 ? 4 : 2) : kKS <= 16 ? 2 : 1;

  // exact::accumulate's choice of pipe for |d|^p: MUFU throughout.
  __host__ __device__ static constexpr bool exp2_on_fma(int, int) { return false; }
};

namespace lse_detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr float kLowest = -3.40282347e38f;  // the running maximum of no term

// log(sum) in natural units from the base-2 (mx, s): -inf where every term is (s = 0, log2 -inf),
// NaN where one is (s NaN).
__device__ __forceinline__ float finish(float mx, float s) { return (mx + log2f(s)) * kLn2; }

// The hyper-parameters of batch entry `index`.
struct Hypers {
  HyperParam inner_p, outer_p, bandwidth;
};

// Points j .. j + U - 1 of the staged tile against the thread's rows, FlashAttention's way: per
// row and column the U terms v (base 2), their maximum, the running sum rescaled once to the new
// maximum mn (one exp2), then s += exp2(v - mn) per term: 1 + 1/U exp2 per term. NaN terms drop
// out of the maximum and make s NaN; -inf terms add 0; mx starts at the lowest finite float (a
// rescale of an empty sum never forms -inf - -inf).
template <class Tr, int U>
__device__ __forceinline__ void pairs(const float* ys, const float* ls, int j, const float (&xr)[Tr::kRows][Tr::kK],
                                      const math::PowArgs& pw, float inv_outer_p, float scale2,
                                      float (&mx)[Tr::kRows][Tr::kC], float (&sm)[Tr::kRows][Tr::kC]) {
  constexpr int R = Tr::kRows, KS = Tr::kKS, KK = Tr::kK, C = Tr::kC;
  float yj[U][KS], lj[U][C];
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int q = 0; q < KS / 4; ++q) {
      const float4 f = reinterpret_cast<const float4*>(ys + (j + u) * KS)[q];
      yj[u][4 * q] = f.x, yj[u][4 * q + 1] = f.y, yj[u][4 * q + 2] = f.z, yj[u][4 * q + 3] = f.w;
    }
#pragma unroll
    for (int c = 0; c < C; ++c) lj[u][c] = ls[(j + u) * C + c];
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    float t[U];  // -phi log2(e) of the U pairs
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc = 0.0f;
#pragma unroll
      for (int q = 0; q < KK; ++q) acc = exact::accumulate<Tr>(acc, xr[i][q], yj[u][q], i, q, pw);
      float d = acc;
      if constexpr (!Tr::kSquared) {
        if constexpr (Tr::kOuterPow == Power::Sqrt) d = math::sqrt_approx(acc);  // MUFU, no slow-path call
        if constexpr (Tr::kOuterPow == Power::Pow) d = powf(acc, inv_outer_p);
        if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = d * d;
      }
      t[u] = d * scale2;
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      float v[U];
      float mn = mx[i][c];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v[u] = math::add_rn(t[u], lj[u][c]);
        mn = fmaxf(mn, v[u]);
      }
      float s = sm[i][c] * math::ex2_approx(math::sub_rn(mx[i][c], mn));
#pragma unroll
      for (int u = 0; u < U; ++u) s = math::add_rn(s, math::ex2_approx(math::sub_rn(v[u], mn)));
      sm[i][c] = s, mx[i][c] = mn;
    }
  }
}

}  // namespace lse_detail

extern __shared__ __align__(16) unsigned char kl_lse_smem[];

// Grid: (row tiles, N splits, batch entries (looped beyond gridDim.z)). n_split CTAs share a
// row tile, each over `per` y tiles. C <= kC columns of lw and out (the planner's chunk).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) lse_kernel(
    const typename Traits::T* __restrict__ x, const typename Traits::T* __restrict__ y,
    const typename Traits::T* __restrict__ lw, typename Traits::T* __restrict__ out, float* __restrict__ scratch,
    int M, int N, int K, int C, i64 sxm, i64 sxk, i64 sym, i64 syk, i64 sln, i64 slc, i64 som, i64 soc, int batch,
    int batch_n1, int batch_n2, i64 x_bs0, i64 x_bs1, i64 x_bs2, i64 y_bs0, i64 y_bs1, i64 y_bs2, i64 l_bs0,
    i64 l_bs1, i64 l_bs2, i64 o_bs0, i64 o_bs1, i64 o_bs2, const float* inner_p_ptr, i64 inner_p_bs0,
    i64 inner_p_bs1, i64 inner_p_bs2, float inner_p, const float* outer_p_ptr, i64 outer_p_bs0, i64 outer_p_bs1,
    i64 outer_p_bs2, float outer_p, const float* bw_ptr, i64 bw_bs0, i64 bw_bs1, i64 bw_bs2, float bandwidth,
    int n_split, int per) {
  using Tr = Traits;
  using namespace lse_detail;
  constexpr int R = Tr::kRows, BM = Tr::kBlockM, BN = Tr::kBlockN, KS = Tr::kKS, KK = Tr::kK, KC = Tr::kC;
  float* const ys = reinterpret_cast<float*>(kl_lse_smem);  // (BN, KS)
  float* const ls = ys + BN * KS;                           // (BN, KC), times log2(e)

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride xb{x_bs0, x_bs1, x_bs2}, yb{y_bs0, y_bs1, y_bs2}, lb{l_bs0, l_bs1, l_bs2},
      ob{o_bs0, o_bs1, o_bs2};
  const Hypers hp{{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p},
                  {outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p},
                  {bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth}};
  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y;
  const int n_begin = split * per * BN;
  const int n_end = min(N, n_begin + per * BN);

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const BatchIndex bi = shape.split(l);
    const typename Tr::T* xl = x + xb.offset(bi);
    const typename Tr::T* yl = y + yb.offset(bi);
    const typename Tr::T* ll = lw + lb.offset(bi);

    math::PowArgs pw{};
    if constexpr (Tr::kInnerPow == Power::Pow) pw = math::make_pow_args(hp.inner_p.at(bi));
    float inv_outer_p = 0.0f;
    if constexpr (Tr::kOuterPow == Power::Pow) inv_outer_p = 1.0f / hp.outer_p.at(bi);
    const float bw = hp.bandwidth.at(bi);
    const float scale2 = (Tr::kEpilogue == Epilogue::Laplace ? -1.0f / bw : -0.5f / (bw * bw)) * kLog2e;

    float xr[R][KK], mx[R][KC], sm[R][KC];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int m = m0 + tid + i * Tr::kThreads;
      const bool live = m < M;
#pragma unroll
      for (int q = 0; q < KK; ++q) xr[i][q] = (live && q < K) ? load_f(xl + i64(m) * sxm + i64(q) * sxk) : 0.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) mx[i][c] = kLowest, sm[i][c] = 0.0f;
    }

    for (int n0 = n_begin; n0 < n_end; n0 += BN) {
      const int jn = min(BN, n_end - n0);
      __syncthreads();  // the previous tile is consumed
      for (int e = tid; e < BN * KS; e += Tr::kThreads) {
        const int j = e / KS, q = e - j * KS;
        ys[e] = (j < jn && q < K) ? load_f(yl + i64(n0 + j) * sym + i64(q) * syk) : 0.0f;
      }
      for (int e = tid; e < BN * KC; e += Tr::kThreads) {
        const int j = e / KC, c = e - j * KC;
        ls[e] = (j < jn && c < C) ? load_f(ll + i64(n0 + j) * sln + i64(c) * slc) * kLog2e : 0.0f;
      }
      __syncthreads();
      constexpr int U = Tr::kUnrollJ;
      const int jfull = jn - jn % U;
#pragma unroll 1
      for (int j = 0; j < jfull; j += U) pairs<Tr, U>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm);
#pragma unroll 1
      for (int j = jfull; j < jn; ++j) pairs<Tr, 1>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm);
    }

#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int m = m0 + tid + i * Tr::kThreads;
      if (m >= M) continue;
      if (n_split == 1) {
        typename Tr::T* orow = out + ob.offset(bi) + i64(m) * som;
#pragma unroll
        for (int c = 0; c < KC; ++c)
          if (c < C) store_f(orow + c * soc, finish(mx[i][c], sm[i][c]));
      } else {
        float* srow = scratch + ((i64(split) * batch + l) * M + m) * (2 * KC);
#pragma unroll
        for (int c = 0; c < KC; ++c) srow[2 * c] = mx[i][c], srow[2 * c + 1] = sm[i][c];
      }
    }
  }
}

// One thread per (batch entry, row, column): the n_split (mx, s) of scratch [split][batch][M][kC][2]
// combined in split order (the first split's maximum, then each split rescaled into the running
// pair, the smaller maximum's sum rescaled by one exp2), finished into out.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) lse_combine_kernel(
    const float* __restrict__ scratch, typename Traits::T* __restrict__ out, int M, int C, int n_split, i64 som,
    i64 soc, int batch, int batch_n1, int batch_n2, i64 o_bs0, i64 o_bs1, i64 o_bs2) {
  using Tr = Traits;
  using namespace lse_detail;
  constexpr int KC = Tr::kC;
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride ob{o_bs0, o_bs1, o_bs2};
  const i64 rows = i64(batch) * M, total = rows * C;
  for (i64 t = i64(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += i64(gridDim.x) * blockDim.x) {
    const i64 r = t / C;
    const int c = int(t - r * C);
    const int l = int(r / M), m = int(r - i64(l) * M);
    const BatchIndex bi = shape.split(l);
    float mx = kLowest, s = 0.0f;
    for (int sp = 0; sp < n_split; ++sp) {
      const float* p = scratch + ((i64(sp) * batch + l) * M + m) * (2 * KC) + 2 * c;
      const float m2 = p[0], s2 = p[1];
      // (mx, s) + (m2, s2): the smaller maximum's sum scaled by exp2(its maximum - the larger).
      const bool gt = m2 > mx;
      const float hi = gt ? m2 : mx;
      const float e = math::ex2_approx(math::sub_rn(gt ? mx : m2, hi));
      s = gt ? math::fma_rn(s, e, s2) : math::fma_rn(s2, e, s);
      mx = hi;
    }
    store_f(out + ob.offset(bi) + i64(m) * som + i64(c) * soc, finish(mx, s));
  }
}

}  // namespace kermac_like
