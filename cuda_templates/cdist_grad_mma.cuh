// cdist_grad on tensor cores: the same contraction as cdist_grad.cuh,
//
//   out[l][o,n,m] = sum_k c[l][o,k] * W[k,(n,m)],
//   W[k,(n,m)]    = a[l][k,m] * sgn(d[l][n,m] - b[l][n,k]) * |d[l][n,m] - b[l][n,k]|^(p-1),
//
// with the O-contraction on mma.sync m16n8k8 TF32 in a 3xTF32 split (fp32-grade
// products) instead of 16 FFMA per element.  Same flat argument list, launch
// contract and factor conventions as cdist_grad_kernel (see cdist_grad.cuh:
// sgn(0) = 0, Pow with p <= 1 zero at ties, MUFU lg2/ex2 with ftz, kVec), only
// kBlockM / kBlockN differ (the launcher reads them from the traits mirror).
//
// Structure.  The MMA is D(16 o x 8 pairs) += A(16 o x 8 k) * B(8 k x 8 pairs):
// A = c (rows past O zero-filled), B = W.  A block owns kBlockN x kBlockM (n,m)
// pairs; warp (wm, wn) owns 8 consecutive m times kTilesN consecutive n, one
// MMA tile per n.  Lane (g, t) of the warp generates exactly the two W values
// of its own B fragment (pair m = g, k slots t and t + 4) straight into
// registers: W is computed once per (n,m,k) and o-chunk, never stored, with no
// barrier between generation and MMA.  Each value is split into big = tf32(W)
// and small = W - big (the MMA ignores small's low mantissa bits); c is split
// the same way per fragment.  Three MMAs (small*big, big*small, big*big).
//
// K order inside an MMA: k slot t takes data column 2t and slot t + 4 data
// column 2t + 1 of the 8-column step, for A and B alike, so a lane reads b and
// c as 8-byte pairs.
//
// Accumulation: each kFlushK-long k-chunk is summed in fresh MMA accumulators
// and then added to the running fp32 sums with one FADD per element.  The
// tensor cores accumulate with truncation; restarting every kFlushK (default
// 32) k keeps that error per chunk small, and the running sum over K / kFlushK
// chunks rounds to nearest (relative error at K = 10000 about 1e-6 instead of ~1e-5).
//
// O > 16 runs o-chunks of 16 one after another, regenerating W per chunk (W
// in registers cannot be kept across the K loop); the MMA cost is per o-chunk
// anyway.
//
// Only NVRTC built-ins are used (no <cuda_runtime.h>).
#pragma once

#include "cdist_grad.cuh"

namespace kermac_like {

// kMinBlocksPerSM_: the occupancy registers are budgeted for.  1 (default):
// ~170 registers, no spills, 8 warps per SM.  2: 128 registers, 16 warps per
// SM, a few bytes of spills outside the MMA loop (a tuning to time).
//
// Tuning knobs (the defaults render the v3 kernel):
//   kFlushK_  k per fresh set of MMA accumulators (32, 64 or 128; a multiple of
//             kBlockK): longer periods cost fewer FADDs / accumulator resets and
//             add tensor-core truncation error roughly in proportion.
//   kBlockK_  k per pipeline stage (32: 3 stages; 64: 2 stages, half the
//             barriers and cp.async waits per k, same 48 KiB static budget).
//   kUnrollK_ 8-k MMA steps per unrolled loop body (1, 2 or 4).
//   kTruncW_  1: split W by truncation (big = W with its low 13 bits cleared,
//             2 instructions instead of 3); small then carries up to 2^-10 of W
//             instead of 2^-11, so the dropped small*small and the MMA's own
//             truncation of small grow 2x (about 2^-21 per product).
template <Power kPower_, int kVec_, int kMinBlocksPerSM_ = 1, int kFlushK_ = 32, int kBlockK_ = 32,
          int kUnrollK_ = 1, int kTruncW_ = 0>
struct CdistGradMmaTraits {
  static_assert(kPower_ == Power::Abs || kPower_ == Power::Square || kPower_ == Power::Pow,
                "CdistGradMmaTraits: the power must be Power::Abs (p == 1), Power::Square "
                "(p == 2) or Power::Pow (any other p); Noop and Sqrt have no gradient path");
  static_assert(kVec_ == 1 || kVec_ == 4,
                "CdistGradMmaTraits: kVec must be 1 (any alignment) or 4 (16-byte vectors)");

  static_assert(kMinBlocksPerSM_ == 1 || kMinBlocksPerSM_ == 2,
                "CdistGradMmaTraits: kMinBlocksPerSM must be 1 or 2");
  static_assert(kBlockK_ == 32 || kBlockK_ == 64, "CdistGradMmaTraits: kBlockK must be 32 or 64");
  static_assert(kFlushK_ % kBlockK_ == 0 && kFlushK_ >= kBlockK_ && kFlushK_ <= 128,
                "CdistGradMmaTraits: kFlushK must be a multiple of kBlockK, at most 128");
  static_assert(kUnrollK_ == 1 || kUnrollK_ == 2 || kUnrollK_ == 4,
                "CdistGradMmaTraits: kUnrollK must be 1, 2 or 4");
  static_assert(kTruncW_ == 0 || kTruncW_ == 1, "CdistGradMmaTraits: kTruncW must be 0 or 1");

  static constexpr Power kPower = kPower_;
  static constexpr int kVec = kVec_;

  static constexpr int kWarpsM = 4;
  static constexpr int kWarpsN = 2;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;  // 256
  static constexpr int kWarpM = 8;                         // m per warp (MMA columns)
  static constexpr int kTilesN = 8;                        // n per warp, one MMA tile each
  static constexpr int kBlockM = kWarpsM * kWarpM;         // 32
  static constexpr int kBlockN = kWarpsN * kTilesN;        // 16
  static constexpr int kBlockK = kBlockK_;                 // k per pipeline stage
  static constexpr int kStages = kBlockK_ == 32 ? 3 : 2;   // cp.async ring depth (48 KiB static)
  static constexpr int kFlushK = kFlushK_;                 // k per fresh MMA accumulator set
  static constexpr int kFlushChunks = kFlushK_ / kBlockK_; // pipeline stages per flush
  static constexpr int kUnrollK = kUnrollK_;               // MMA steps per unrolled body
  static constexpr bool kTruncW = kTruncW_ == 1;
  static constexpr int kOChunk = 16;                       // MMA rows
  static constexpr int kMinBlocksPerSM = kMinBlocksPerSM_;
  static constexpr int kSmemBytes = 0;  // static shared memory only

  // Shared pitches (floats).  a_s[k][m]: lanes read rows 2t, 2t+1 at column
  // g, so a pitch of 4 mod 32 puts the 32 lanes on 32 banks.  c_s[o][k]:
  // 8-byte reads at (g, 2t): a pitch of 8 mod 32 makes each half-warp
  // conflict-free.  b_s[n][k]: one n per warp instruction (broadcast).
  static constexpr int kPitchA = kBlockM + 4;  // 36
  static constexpr int kPitchB = kBlockK + 4;  // 36
  static constexpr int kPitchC = kBlockK + 8;  // 40

  static_assert(kPitchA % 32 == 4 && kPitchC % 32 == 8 && kPitchB % 2 == 0, "bank layout");
  static_assert(kBlockK % (8 * kUnrollK) == 0, "k-chunks are whole unrolled MMA steps");
  static_assert((kBlockK * kBlockM / kVec) % kThreads == 0, "a tile must split evenly over threads");
  static_assert((kBlockK * kBlockN) % kThreads == 0, "b tile must split evenly over threads");
  static_assert((kBlockK * kOChunk) % kThreads == 0, "c tile must split evenly over threads");
  static_assert(kThreads % kBlockK == 0, "b / c copies: whole rows per pass");
  static_assert(kBlockM % 4 == 0 && kPitchA % 4 == 0, "16-byte copies of a");
  static_assert(kStages >= 2, "the cp.async ring needs at least two stages");
};

namespace grad_mma_detail {

using grad_detail::cp_async_16;
using grad_detail::cp_async_4;
using grad_detail::cp_async_commit;
using grad_detail::cp_async_wait;
using grad_detail::GradTile;
using grad_detail::tid_fresh;
using grad_detail::WeightGen;

// big = tf32(x) rounded to nearest, ties away (cvt.rna.tf32.f32 without its
// inf/NaN special case, which costs a compare and a select more), small =
// x - big (exact in fp32; the MMA reads its top 10 mantissa bits).  Two
// integer ops and one FADD.  Non-finite x gives NaN.
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
  const unsigned b = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  big = b;
  small = __float_as_uint(x - __uint_as_float(b));
}

// big = x with the low 13 mantissa bits cleared (truncation), small = x - big
// (exact): one LOP3 and one FADD.  |small| < 2^-10 |x|.
__device__ __forceinline__ void split_tf32_trunc(float x, unsigned& big, unsigned& small) {
  const unsigned b = __float_as_uint(x) & 0xffffe000u;
  big = b;
  small = __float_as_uint(x - __uint_as_float(b));
}

// d += a * b on a 16x8x8 TF32 tile (fragment layout in common.cuh).
using tensor_core::mma_tf32;

template <class Traits>
struct Smem {
  static constexpr int S = Traits::kStages, BK = Traits::kBlockK;
  alignas(16) float a[S][BK][Traits::kPitchA];               // a[k0+k, m0+m]
  alignas(16) float b[S][Traits::kBlockN][Traits::kPitchB];  // b[n0+n, k0+k]
  alignas(16) float c[S][Traits::kOChunk][Traits::kPitchC];  // c[o0+o, k0+k]
};

// cp.async producer: fixed (row, column) slots per thread, the k origin moves.
// Out-of-range elements are zero-filled (padded k: a = b = c = 0).
template <class Traits>
struct Loader {
  static constexpr int BK = Traits::kBlockK, BM = Traits::kBlockM, BN = Traits::kBlockN;
  static constexpr int T = Traits::kThreads, OC = Traits::kOChunk;
  static constexpr int kAPerRow = BM / Traits::kVec;
  static constexpr int kACopies = BK * kAPerRow / T;
  static constexpr int kARowStep = T / kAPerRow;
  static constexpr int kRows = T / BK;  // b / c rows per pass (k fastest over threads)
  static constexpr int kBCopies = BN / kRows;
  static constexpr int kCCopies = OC / kRows;
  static_assert(T % kAPerRow == 0, "a row split");

  const float* a;  // a[k0 + ka, m0 + ma]
  const float* b;  // b[n0 + r, k0 + kr]
  const float* c;  // c[o0 + r, k0 + kr]
  int ka, ma, r, kr;

  __device__ __forceinline__ void init(const GradTile& t, int o0, int tid) {
    ka = tid / kAPerRow;
    ma = (tid % kAPerRow) * Traits::kVec;
    r = tid / BK;
    kr = tid % BK;
    a = t.a + ka * t.lda + t.m0 + ma;
    b = t.b + (t.n0 + r) * t.ldb + kr;
    c = t.c + (o0 + r) * t.ldc + kr;
  }

  __device__ __forceinline__ void load(Smem<Traits>& s, int slot, int k0, const GradTile& t,
                                       int o0) {
    const bool a_col = t.m0 + ma < t.M;  // kVec 4: M % 4 == 0, quads all in or out
#pragma unroll
    for (int i = 0; i < kACopies; ++i) {
      const int k = ka + i * kARowStep;
      const bool ok = a_col && k0 + k < t.K;
      const float* src = ok ? a + i * kARowStep * t.lda : t.safe;
      if constexpr (Traits::kVec == 4) {
        cp_async_16(&s.a[slot][k][ma], src, ok);
      } else {
        cp_async_4(&s.a[slot][k][ma], src, ok);
      }
    }
    const bool k_ok = k0 + kr < t.K;
#pragma unroll
    for (int i = 0; i < kBCopies; ++i) {
      const bool ok = k_ok && t.n0 + r + i * kRows < t.N;
      cp_async_4(&s.b[slot][r + i * kRows][kr], ok ? b + i * kRows * t.ldb : t.safe, ok);
    }
#pragma unroll
    for (int i = 0; i < kCCopies; ++i) {
      const bool ok = k_ok && o0 + r + i * kRows < t.O;
      cp_async_4(&s.c[slot][r + i * kRows][kr], ok ? c + i * kRows * t.ldc : t.safe, ok);
    }
    a += BK * t.lda;
    b += BK;
    c += BK;
  }
};

// One (n,m) tile, one o-chunk [o0, o0 + 16): the whole k loop.
template <class Traits, class Gen>
__device__ __forceinline__ void run_o_chunk(Smem<Traits>& s, const GradTile& t, int o0,
                                            const float (&dv)[Traits::kTilesN], const Gen& gen) {
  constexpr int BK = Traits::kBlockK, S = Traits::kStages, J = Traits::kTilesN;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int wm = warp % Traits::kWarpsM, wn = warp / Traits::kWarpsM;
  constexpr int R = Traits::kFlushChunks, U = Traits::kUnrollK;
  const int num_k = ceil_div(t.K, BK);

  float acc[J][4];  // (n tile, fragment d0..d3): running fp32 sums
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.0f;

  float part[J][4];  // MMA sums of the current flush period

  Loader<Traits> loader;
  loader.init(t, o0, tid);

  __syncthreads();  // the previous o-chunk / tile may still read the ring
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < num_k) loader.load(s, st, st * BK, t, o0);
    cp_async_commit();
  }

  // Flush periods of R pipeline stages: fresh MMA sums, then one FADD per
  // element into acc (a loop nest, so no per-stage flush predicate).
  int slot = 0, fill = S - 1;
  for (int kp = 0; kp < num_k; kp += R) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) part[j][r] = 0.0f;
    const int kend = min(kp + R, num_k);
#pragma unroll 1
    for (int kc = kp; kc < kend; ++kc) {
      cp_async_wait<S - 2>();
      __syncthreads();
      if (kc + S - 1 < num_k) loader.load(s, fill, (kc + S - 1) * BK, t, o0);
      cp_async_commit();

      const float* sa = &s.a[slot][2 * tq][wm * Traits::kWarpM + g];  // a[k 2t, m g]
      const float* sb = &s.b[slot][wn * J][2 * tq];                   // b[n j, k 2t]
      const float* sc = &s.c[slot][g][2 * tq];                        // c[o g, k 2t]

#pragma unroll U
      for (int ks = 0; ks < BK / 8; ++ks) {
        // A = c: (a0, a2) = c[g][2t, 2t+1], (a1, a3) = c[g+8][2t, 2t+1].
        const float2 c_lo = *reinterpret_cast<const float2*>(sc + ks * 8);
        const float2 c_hi = *reinterpret_cast<const float2*>(sc + 8 * Traits::kPitchC + ks * 8);
        unsigned cb[4], cs[4];
        split_tf32(c_lo.x, cb[0], cs[0]);
        split_tf32(c_hi.x, cb[1], cs[1]);
        split_tf32(c_lo.y, cb[2], cs[2]);
        split_tf32(c_hi.y, cb[3], cs[3]);
        const float a0 = sa[(ks * 8) * Traits::kPitchA];
        const float a1 = sa[(ks * 8 + 1) * Traits::kPitchA];
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const float2 bv = *reinterpret_cast<const float2*>(sb + j * Traits::kPitchB + ks * 8);
          unsigned wb0, ws0, wb1, ws1;
          if constexpr (Traits::kTruncW) {
            split_tf32_trunc(gen(a0, bv.x, dv[j]), wb0, ws0);
            split_tf32_trunc(gen(a1, bv.y, dv[j]), wb1, ws1);
          } else {
            split_tf32(gen(a0, bv.x, dv[j]), wb0, ws0);
            split_tf32(gen(a1, bv.y, dv[j]), wb1, ws1);
          }
          mma_tf32(part[j], cs, wb0, wb1);
          mma_tf32(part[j], cb, ws0, ws1);
          mma_tf32(part[j], cb, wb0, wb1);
        }
      }
      slot = slot + 1 == S ? 0 : slot + 1;
      fill = fill + 1 == S ? 0 : fill + 1;
    }
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[j][r] += part[j][r];
  }
  cp_async_wait<0>();

  // out[o0 + g (+8), n0 + wn*J + j, m0 + wm*8 + 2t (+1)].
  const int tid_out = tid_fresh();
  const int lane_o = tid_out & 31, warp_o = tid_out >> 5;
  const int go = lane_o >> 2, to = lane_o & 3;
  const int m = t.m0 + (warp_o % Traits::kWarpsM) * Traits::kWarpM + 2 * to;
  const int nb = t.n0 + (warp_o / Traits::kWarpsM) * J;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int o = o0 + go + 8 * h;
    if (o >= t.O) continue;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int n = nb + j;
      if (n >= t.N || m >= t.M) continue;
      float* p = t.out + o * t.ldo_o + n * t.ldo_n + m;
      const float y0 = acc[j][2 * h], y1 = acc[j][2 * h + 1];
      if constexpr (Traits::kVec == 4) {
        // M % 4 == 0 and m even: both columns in range, 8-byte aligned.
        *reinterpret_cast<float2*>(p) = make_float2(y0, y1);
      } else {
        p[0] = y0;
        if (m + 1 < t.M) p[1] = y1;
      }
    }
  }
}

template <class Traits>
__device__ __forceinline__ void run_tile(Smem<Traits>& s, const GradTile& t, float q) {
  constexpr int J = Traits::kTilesN;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  // d for this lane's pairs: n = n0 + wn*J + j, m = m0 + wm*8 + g; 0 outside.
  const int m = t.m0 + (warp % Traits::kWarpsM) * Traits::kWarpM + (lane >> 2);
  const int nb = t.n0 + (warp / Traits::kWarpsM) * J;
  float dv[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dv[j] = (nb + j < t.N && m < t.M) ? t.d[(nb + j) * t.ldd + m] : 0.0f;

  // q is uniform per batch entry: Pow with p <= 1 (or NaN p) needs the
  // explicit zero at ties.
  const bool fast = Traits::kPower != Power::Pow || q > 0.0f;
  constexpr bool kSignFma = Traits::kPower == Power::Abs;  // shipped p = 1 generator
  for (int o0 = 0; o0 < t.O; o0 += Traits::kOChunk) {
    if (fast) {
      run_o_chunk<Traits>(s, t, o0, dv, WeightGen<Traits::kPower, false, kSignFma>{q});
    } else if constexpr (Traits::kPower == Power::Pow) {
      run_o_chunk<Traits>(s, t, o0, dv, WeightGen<Power::Pow, true>{q});
    }
  }
}

}  // namespace grad_mma_detail

// Launch: block (kThreads), grid (ceil(M/kBlockM), ceil(N/kBlockN),
// min(batch, 65535)), dynamic smem kSmemBytes (0).  Arguments exactly as
// cdist_grad_kernel.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSM)
cdist_grad_mma_kernel(const float* __restrict__ a, const float* __restrict__ b,
                      const float* __restrict__ c, const float* __restrict__ d,
                      float* __restrict__ out,
                      int M, int N, int K, int O,
                      long long lda, long long ldb, long long ldc, long long ldd,
                      long long ldo_o, long long ldo_n,
                      int batch, long long a_bs, long long b_bs, long long c_bs, long long d_bs,
                      long long o_bs,
                      const float* p_ptr, long long p_bs, float p) {
  using namespace grad_mma_detail;
  __shared__ Smem<Traits> smem;

  grad_detail::for_each_batch_tile<Traits::kBlockM, Traits::kBlockN>(
      a, b, c, d, out, M, N, K, O, lda, ldb, ldc, ldd, ldo_o, ldo_n, batch, a_bs, b_bs, c_bs, d_bs,
      o_bs, p_ptr, p_bs, p, [&](const GradTile& t, float q) { run_tile<Traits>(smem, t, q); });
}

}  // namespace kermac_like
