// k-means assignment on tensor cores: the nearest centre of every point by mma.sync (3xTF32),
// certified, with the exact float32 path inside the kernel for the rows the certificate does not
// cover (ABI: cuda_templates/ABI.md; planned by kermac_like/plan/kmeans.py for
// kermac_like.cluster._assign; derivation and measurements: bench/notes/kmeans.md, "The assignment
// on mma.sync (session 13)").
//
// Result: for every point i, (label, dist) bitwise equal to knn(x, c, 1, direct differences)'s on
// the same data (topk.cuh's SIMT kernel): label = the first centre in the total order (fp32 value,
// index) of the values v_n = fl-sum_q fma((x_q - c_q)^2) (k in order, topk's partial sums), dist =
// sqrtf(v_label). How:
//
//   kmeans_assign_prep_kernel (one CTA): the centres split c = hi + lo (TF32), in the B-fragment
//     order of mma.m16n8k8 (uint4 {hi(k t), hi(k t+4), lo(k t), lo(k t+4)} per (8 columns, k-step,
//     lane)), followed in the same buffer by the centres in groups of 32, ct[((n / 32) K + q) 32 +
//     n % 32] = c_n[q] ((Cp / 32, K, 32) f32: the rescan's coalesced reads at fixed offsets),
//     cn[n] = ||c_n||^2 (fp32; 2^127 for the padded columns n >= C), cmax = max_n cn[n].
//   kmeans_assign_mma_kernel: a CTA owns kBlockM points; each warp 16 kMt of them, their -2 x split
//     hi + lo in registers as A fragments (exact scaling). The CTA streams the centres in tiles of
//     kBlockN (cp.async, two stages); per 8 columns the accumulators start at cn[n] + X (X: the
//     largest fp32 ||x||^2 of the warp's rows) and take lo*hi + hi*lo + hi*hi per k-step, so that
//     they hold s_n = X + ||c_n||^2 - 2 x.c_n (= ||x - c_n||^2 + (X - ||x||^2) >= -error: a per-row
//     shift, the same for every n). Per value, 4 instructions: the key (float bits with the low 5
//     bits replaced by the column's place in the lane's tile, a signed 32-bit integer), best =
//     min(best, key), second = min(second, max(best_old, key)). At the end of a tile the keys are
//     decoded (value without its low 5 bits, column) and merged into the row's running (best value,
//     best column, second value) in the order (value as a signed integer, column); after the last
//     tile the 4 lanes of a quad merge theirs.
//   Certificate: the row is certified when 2^-60 <= B <= 2^100 (B = X + cmax, fp32) and
//     fl(second - best) > tau B, tau from the host (plan.kmeans.assign_tau): then the best column is
//     the label of the exact float32 path (proof in the notes: tau B bounds twice the MMA error of a
//     value, twice the key's quantisation and the exact path's own rounding 4 gamma_{K+4} B). The
//     warp rescans its uncertified rows one at a time (32 lanes over the centres, read
//     coalesced from ct, the rows in registers: the exact path's values and keys, the smallest and
//     the second smallest by a warp merge; the second gives the row's lower bound); a certified
//     row's v_label is computed once by the exact arithmetic. B is the data's scale about the
//     origin: callers centre the data (cluster.KMeans) so that it is the centred scale.
//   Local certificate (KmeansAssignTraits<kK, true>; issue 42, bench/notes/kmeans.md "round 3"): the same
//     arguments, labels[] holding each row's old label; per CTA r = the centre of its first row's old label,
//     rows and centres enter the MMAs as fl(x - r), fl(c - r) (the CTA builds each tile itself), centres
//     with ||c - r||^2 > 9 X'_cta left out (never a row's nearest), B' = X'_warp + the largest kept
//     ||c - r||^2: the local scale, not the distance from the origin. rows[r] < 0: padding, skipped.
// No N x C matrix, no atomics: bitwise repeatable. cert[i] (optional): 1 where certified.
#pragma once

#include "common.cuh"
#include "math.cuh"
#include "block_reduce.cuh"
#include "distance_mma.cuh"

namespace kermac_like {

// kK_: K padded to 8, 16, 32 or 64 (the A fragments of kMt m16 tiles in registers).
// kLocal_: the certificate about the CTA's local reference (the rows ordered by their old labels in labels[];
// plan.kmeans.plan_assign(local=True)); a separate instantiation, so the global one keeps its registers.
template <int kK_, bool kLocal_ = false>
struct KmeansAssignTraits {
  static_assert(kK_ == 8 || kK_ == 16 || kK_ == 32 || kK_ == 64, "KmeansAssignTraits: kK is 8, 16, 32 or 64");
  static constexpr int kK = kK_;
  static constexpr bool kLocal = kLocal_;
  static constexpr int kSteps = kK_ / 8;                       // k-steps of 8
  static constexpr int kMt = kK_ <= 16 ? 2 : 1;                // m16 tiles per warp (128 registers)
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMinBlocks = kK_ <= 16 ? 3 : 2;  // launch bounds: <= 80 / 128 registers
  static constexpr int kBlockM = kWarps * 16 * kMt;            // points per CTA
  static constexpr int kBlockN = kK_ <= 16 ? 128 : 2048 / kK_;  // centres per tile (<= 128: 5 key bits)
  static constexpr int kTileFrag = kBlockN * kK_ * 8;           // bytes of a tile's fragments
  static constexpr int kTileBytes = kTileFrag + kBlockN * 4;    // + cn
  static constexpr int kSmemBytes = 2 * kTileBytes;
  static constexpr int kKeyBits = 5;
  // The rescan's row in registers, else read at each centre (broadcast loads): where that fits the
  // launch bounds without spills (kK 8 and 64 spill a register with it: ptxas, sm_80 and sm_90).
  static constexpr bool kRescanRegs = kK_ == 16 || kK_ == 32;
  static_assert(kBlockN / 8 * 2 <= (1 << kKeyBits), "KmeansAssignTraits: the place of a column needs <= 5 bits");
  static_assert(kTileBytes % 16 == 0, "KmeansAssignTraits: tiles are 16-byte chunks");
};

// The pruned iteration's filter (kmeans_bounds_kernel): one point per thread, any K (runtime loops).
struct KmeansBoundsTraits {
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 256;  // points per CTA
  static constexpr int kBlockN = 1;
  static constexpr int kSmemBytes = 0;
};

namespace kmeans_assign_detail {

#ifndef KERMAC_LIKE_MMA_HOST_EMULATION
__device__ __forceinline__ int shfl_xor_int(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int shfl_int(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ unsigned ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
#endif

// The exact path's value of one pair: topk.cuh's pairs() for Inner::Diff, Power::Square (k in order,
// fma; split = topk's kAcc == 2: even k into one partial sum, odd k into another, then added).
__device__ __forceinline__ float exact_value(const float* xi, i64 sxk, const float* cr, int K, int split) {
  float a0 = 0.0f, a1 = 0.0f;
  if (split) {
    for (int q = 0; q < K; ++q) {
      const float d = math::sub_rn(xi[q * sxk], cr[q]);
      if (q & 1) a1 = math::fma_rn(d, d, a1);
      else a0 = math::fma_rn(d, d, a0);
    }
    return math::add_rn(a0, a1);
  }
  for (int q = 0; q < K; ++q) {
    const float d = math::sub_rn(xi[q * sxk], cr[q]);
    a0 = math::fma_rn(d, d, a0);
  }
  return a0;
}

// The same from a row at stride sx (registers for a unit stride into a local array) and a centre whose
// coordinates lie 32 floats apart (the rescan's copy ct): the same operations in the same order, so the
// same bits.
template <int kK>
__device__ __forceinline__ float exact_value_ct(const float* v, i64 sx, const float* ct_n, int K, int split) {
  float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
  for (int q = 0; q < kK; ++q) {
    if (q < K) {
      const float d = math::sub_rn(v[q * sx], ct_n[q * 32]);
      if (split && (q & 1)) a1 = math::fma_rn(d, d, a1);
      else a0 = math::fma_rn(d, d, a0);
    }
  }
  return split ? math::add_rn(a0, a1) : a0;
}

// The rescan's running (smallest key (value bits, index), second smallest value bits) of a row; merge
// is symmetric (both sides of a shuffle end with the same), the second is the smallest value of every
// entry but the first (a duplicate of the first value included).
struct Keys {
  unsigned v1, n1, v2;
};
__device__ __forceinline__ void merge_keys(Keys& a, unsigned v1, unsigned n1, unsigned v2) {
  if (v1 < a.v1 || (v1 == a.v1 && n1 < a.n1)) {
    a.v2 = min(a.v1, min(a.v2, v2));
    a.v1 = v1, a.n1 = n1;
  } else {
    a.v2 = min(a.v2, min(v1, v2));
  }
}

// Running (best value, best column, second value) of a row in the order (value as a signed integer,
// column); values are float bits with the low kKeyBits cleared.
struct Best {
  int v1, c1, v2;
};
__device__ __forceinline__ void merge(Best& a, int v1, int c1, int v2) {
  const int hi = max(a.v1, v1);
  a.v2 = min(hi, min(a.v2, v2));
  if (v1 < a.v1 || (v1 == a.v1 && c1 < a.c1)) a.v1 = v1, a.c1 = c1;
}

// -- Distance bounds for the pruned Lloyd iteration (plan.kmeans.BoundedAssign) -----------------------
//
// Per point: ub >= ||x - c_label|| and lb <= min over c != label of ||x - c||, both exact real distances
// (Hamerly's bounds). Every rounded step below moves its result one float outward (up / down after a
// round-to-nearest operation: at least the operation's rounding error), so the bounds hold in real
// arithmetic; the same bit operations run in the host emulation.

// The next float above / below a finite v (inf and NaN unchanged, but below(+inf) = FLT_MAX).
__device__ __forceinline__ float above(float v) {
  if (v == 0.0f) return __int_as_float(1);
  if (!(v < __int_as_float(0x7f800000)) || v == -__int_as_float(0x7f800000)) return v;
  return __int_as_float(__float_as_int(v) + (v > 0.0f ? 1 : -1));
}
__device__ __forceinline__ float below(float v) {
  if (v == 0.0f) return -__int_as_float(1);
  if (!(v > -__int_as_float(0x7f800000))) return v;
  return __int_as_float(__float_as_int(v) + (v > 0.0f ? -1 : 1));
}
// A lower bound on a distance: below(v), or 0 where that is negative (NaN: 0).
__device__ __forceinline__ float down(float v) { return v > 0.0f ? below(v) : 0.0f; }

// An upper bound on ||x - c|| from the exact path's value v (K <= 64): ||x - c||^2 <= (v + K 2^-150) /
// (1 - gamma_{K+4}) <= (v + 2^-140) gu, gu >= 1 / (1 - gamma) from the host (plan.kmeans.bound_consts).
__device__ __forceinline__ float upper_of(float v, float gu) {
  return above(math::sqrt_rn(above(math::mul_rn(above(math::add_rn(v, 0x1p-140f)), gu))));
}
// A lower bound on ||x - c||^2 from the exact path's value v: (v - 2^-140) gl, gl <= 1 / (1 + gamma).
__device__ __forceinline__ float lower_sq_of(float v, float gl) {
  return down(math::mul_rn(down(math::sub_rn(v, 0x1p-140f)), gl));
}

// The skip rule: the point keeps its label if ub kap + 2^-60 < max(lb, s_a / 2) (lower bounds from the
// host: halfs[a] <= min_c ||c - c_a|| / 2). Then every other centre is farther than ||x - c_a|| (1 + kappa)
// and than 2^-60, kap = 1 + kappa with kappa >= 2 gamma, so the exact path's value of every other centre
// is strictly above v_label: the full assignment would give the same label (bench/notes/kmeans.md,
// "Pruned Lloyd iterations").
__device__ __forceinline__ bool keeps_label(float ub, float m, float kap) {
  return above(math::add_rn(above(math::mul_rn(ub, kap)), 0x1p-60f)) < m;
}

}  // namespace kmeans_assign_detail

// Grid (1, 1, 1), Traits::kThreads threads. c (C, K) at row stride ldc (K contiguous); cf (Cp / 8,
// kSteps, 32) uint4 then ct (Cp / 32, K, 32) f32 in the same buffer, and cn (Cp) with Cp = C rounded up to
// kBlockN; cmax[0] = max_{n < C} cn[n].
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_assign_prep_kernel(
    const float* __restrict__ c, uint4* __restrict__ cf, float* __restrict__ cn, float* __restrict__ cmax, int C,
    int K, i64 ldc) {
  using Tr = Traits;
  constexpr int T = Tr::kThreads, S = Tr::kSteps;
  extern __shared__ __align__(128) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem);  // (T): the launch's dynamic shared memory
  const int tid = threadIdx.x;
  const int Cp = (C + Tr::kBlockN - 1) / Tr::kBlockN * Tr::kBlockN;
  const int entries = Cp / 8 * S * 32;
  for (int e = tid; e < entries; e += T) {
    const int lane = e & 31, s = (e >> 5) % S, j8 = (e >> 5) / S;
    const int n = j8 * 8 + (lane >> 2), k0 = s * 8 + (lane & 3), k1 = k0 + 4;
    const float* cr = c + i64(n) * ldc;
    const float v0 = n < C && k0 < K ? cr[k0] : 0.0f, v1 = n < C && k1 < K ? cr[k1] : 0.0f;
    unsigned h0, l0, h1, l1;
    mma_detail::split_tf32x3(__float_as_uint(v0), h0, l0);
    mma_detail::split_tf32x3(__float_as_uint(v1), h1, l1);
    cf[e] = uint4{h0, h1, l0, l1};
  }
  float* ct = reinterpret_cast<float*>(cf + entries);  // (Cp / 32, K, 32): the rescan's copy
  for (i64 e = tid; e < i64(K) * Cp; e += T) {
    const i64 b = e / (32 * K), r = e - b * 32 * K;
    const i64 n = b * 32 + (r & 31);
    ct[e] = n < C ? c[n * ldc + (r >> 5)] : 0.0f;
  }
  float m = 0.0f;
  for (int n = tid; n < Cp; n += T) {
    float s = 0x1p127f;  // padded columns: never below a real one (B <= 2^100 where certified)
    if (n < C) {
      s = 0.0f;
      const float* cr = c + i64(n) * ldc;
      for (int q = 0; q < K; ++q) s = math::fma_rn(cr[q], cr[q], s);
      m = fmaxf(m, s);
    }
    cn[n] = s;
  }
  m = block_reduce<T>(red, m, [](float a, float b) { return fmaxf(a, b); });
  if (tid == 0) cmax[0] = m;
}

// Grid ((N + kBlockM - 1) / kBlockM, 1, 1). x (N, K) at strides (sxm, sxk); c, cf, cn, cmax as the
// prep kernel's; labels (N) int64, dist (N) float32, cert (N) uint8 or null. tau: the certificate's
// constant (plan.kmeans.assign_tau(K)); split: topk's kAcc == 2 for this K (the exact path's sums).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks) kmeans_assign_mma_kernel(
    const float* __restrict__ x, const float* __restrict__ c, const uint4* __restrict__ cf,
    const float* __restrict__ cn, const float* __restrict__ cmax, i64* __restrict__ labels,
    float* __restrict__ dist, unsigned char* __restrict__ cert, int N, int C, int K, i64 sxm, i64 sxk, i64 ldc,
    float tau, int split, const int* __restrict__ rows, float* __restrict__ ub, float* __restrict__ lb,
    int* __restrict__ rmax, int* __restrict__ changed, float gu, float gl) {
  using Tr = Traits;
  constexpr bool local = Tr::kLocal;
  using namespace kmeans_assign_detail;
  using mma_detail::mma_tf32;
  // Row r of the launch is point rows[r] (the pruned iteration's work list) or point r.
  auto point = [&](i64 r) -> i64 { return rows ? i64(rows[r]) : r; };
  // local: rows[r] < 0 pads (the host starts each label's rows at a CTA: one reference per label); skipped.
  auto real = [&](i64 r) -> bool { return r < N && (!local || !rows || rows[r] >= 0); };
  constexpr int S = Tr::kSteps, MT = Tr::kMt, BN = Tr::kBlockN, R = 2 * MT;
  constexpr int kMask = (1 << Tr::kKeyBits) - 1;
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const i64 m_warp = i64(blockIdx.x) * Tr::kBlockM + warp * 16 * MT;

  // local: the CTA's reference r = the centre of its first row's label (labels[] holds the old labels;
  // the host orders the rows by them), kept in the second stage (the local mode builds its tiles in the
  // first); the rows and the centres enter the MMAs as fl(x - r), fl(c - r).
  // Stage 1 holds (kK) r, (4) {X'_cta, 9 X'_cta}, (kThreads) the reductions' slots (between them each thread's
  // largest kept cn'): shared memory, not registers, across the tile loop (ptxas spilled them under the launch
  // bounds); the addresses formed where used.
#define KM_RS (reinterpret_cast<float*>(smem + Tr::kTileBytes))
#define KM_SX (reinterpret_cast<float*>(smem + Tr::kTileBytes) + S * 8)
#define KM_RED (reinterpret_cast<float*>(smem + Tr::kTileBytes) + S * 8 + 4)
  if constexpr (local) {
    const i64 m0 = i64(blockIdx.x) * Tr::kBlockM;
    i64 a = real(m0) ? labels[point(m0)] : 0;
    a = a < 0 ? 0 : (a >= C ? C - 1 : a);
    for (int q = tid; q < S * 8; q += Tr::kThreads) KM_RS[q] = q < K ? c[a * ldc + q] : 0.0f;
    __syncthreads();
  }

  // A fragments of -2 x (exact), split; partial squared norms of rows g, g + 8 of each m16 tile.
  unsigned ah[MT][S][4], al[MT][S][4];
  float xn[R];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    float sq[2] = {0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const i64 m = m_warp + i * 16 + g + 8 * (r & 1);
        const int q = s * 8 + t + 4 * (r >> 1);
        const bool in = real(m) && q < K;
        float v = in ? x[point(m) * sxm + q * sxk] : 0.0f;
        if (local && in) v = math::sub_rn(v, KM_RS[q]);
        sq[r & 1] = math::fma_rn(v, v, sq[r & 1]);
        mma_detail::split_tf32x3(__float_as_uint(-2.0f * v), ah[i][s][r], al[i][s][r]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = sq[h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      xn[2 * i + h] = v;
    }
  }
  float xbar = xn[0];
#pragma unroll
  for (int r = 1; r < R; ++r) xbar = fmaxf(xbar, xn[r]);
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) xbar = fmaxf(xbar, __shfl_xor_sync(0xffffffffu, xbar, o));
  // local: X' = the CTA's largest ||fl(x - r)||^2; centres with ||fl(c - r)||^2 > 9 X' are left out (never
  // a row's nearest: r is a centre, so d_best <= ||x - r|| <= sqrt X' < ||x - c|| (the notes)); kmax: the
  // largest ||fl(c - r)||^2 of the kept centres (B' = X'_warp + kmax).
  if constexpr (local) {
    const float xcta = block_reduce<Tr::kThreads>(KM_RED, xbar, [](float p, float q) { return fmaxf(p, q); });
    if (tid == 0) KM_SX[0] = xcta, KM_SX[1] = math::mul_rn(9.0f, xcta);  // read after build_tile's barrier
    KM_RED[tid] = 0.0f;  // each thread's largest kept cn' (reduced after the tiles)
  }

  const int tiles = (C + BN - 1) / BN;
  const unsigned smem_base = mma_detail::smem_u32(smem);
  auto load_tile = [&](int stage, int tile) {
    const unsigned char* src_f = reinterpret_cast<const unsigned char*>(cf) + i64(tile) * Tr::kTileFrag;
    const unsigned char* src_n = reinterpret_cast<const unsigned char*>(cn + i64(tile) * BN);
    const unsigned dst = smem_base + stage * Tr::kTileBytes;
    for (int e = tid; e < Tr::kTileBytes / 16; e += Tr::kThreads) {
      const unsigned char* src = e < Tr::kTileFrag / 16 ? src_f + e * 16 : src_n + (e - Tr::kTileFrag / 16) * 16;
      mma_detail::cp_async_16(dst + e * 16, src, 16);
    }
  };

  Best best[R];
#pragma unroll
  for (int r = 0; r < R; ++r) best[r] = Best{0x7fffffff, 0x7fffffff, 0x7fffffff};

  // local: a tile built in stage 0 by the CTA: cn' (2^127 for the padding and the left-out centres), then
  // the fragments of fl(c - r) (zero for those: their values stay 2^127).
  auto build_tile = [&](int tile) {
    unsigned char* st = smem;
    float* cns = reinterpret_cast<float*>(st + Tr::kTileFrag);
    uint4* fr = reinterpret_cast<uint4*>(st);
    __syncthreads();  // the previous tile's MMAs are done
#pragma unroll 1
    for (int j = tid; j < BN; j += Tr::kThreads) {
      const int n = tile * BN + j;
      float s = 0x1p127f;
      if (n < C) {
        float a = 0.0f;
#pragma unroll 1
        for (int q = 0; q < K; ++q) {
          const float d = math::sub_rn(c[i64(n) * ldc + q], KM_RS[q]);
          a = math::fma_rn(d, d, a);
        }
        if (a <= KM_SX[1]) s = a, KM_RED[tid] = fmaxf(KM_RED[tid], a);  // NaN: left out
      }
      cns[j] = s;
    }
    __syncthreads();
    // entry e = (j8 S + s) 32 + lane: a thread keeps its lane (kThreads is a multiple of 32)
    const int k0 = (lane & 3), jl = lane >> 2;
#pragma unroll 1
    for (int e = tid; e < BN / 8 * S * 32; e += Tr::kThreads) {
      const int js = e >> 5, s = js % S, j = (js / S) * 8 + jl, q0 = s * 8 + k0, q1 = q0 + 4;
      const bool kept = cns[j] < 0x1p127f;
      const float* cr = c + i64(tile * BN + j) * ldc;
      const float v0 = kept && q0 < K ? math::sub_rn(cr[q0], KM_RS[q0]) : 0.0f;
      const float v1 = kept && q1 < K ? math::sub_rn(cr[q1], KM_RS[q1]) : 0.0f;
      unsigned h0, l0, h1, l1;
      mma_detail::split_tf32x3(__float_as_uint(v0), h0, l0);
      mma_detail::split_tf32x3(__float_as_uint(v1), h1, l1);
      fr[e] = uint4{h0, h1, l0, l1};
    }
    __syncthreads();
  };

  // One tile's MMAs and keys from stage st, merged into best.
  auto mma_tile = [&](const unsigned char* st, int tile) {
    const uint4* fr = reinterpret_cast<const uint4*>(st);
    const float* cns = reinterpret_cast<const float*>(st + Tr::kTileFrag);
    int b1[R], b2[R];
#pragma unroll
    for (int r = 0; r < R; ++r) b1[r] = b2[r] = 0x7fffffff;
#pragma unroll (Tr::kLocal ? 2 : 4)
    for (int j = 0; j < BN / 8; ++j) {
      const float2 cp = *reinterpret_cast<const float2*>(cns + j * 8 + 2 * t);
      const float c0 = cp.x + xbar, c1 = cp.y + xbar;
      uint4 bf[S];
#pragma unroll
      for (int s = 0; s < S; ++s) bf[s] = fr[(j * S + s) * 32 + lane];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        float acc[4];
        mma_detail::mma_tf32_c(acc, al[i][0], bf[0].x, bf[0].y, c0, c1);
        mma_tf32(acc, ah[i][0], bf[0].z, bf[0].w);
        mma_tf32(acc, ah[i][0], bf[0].x, bf[0].y);
#pragma unroll
        for (int s = 1; s < S; ++s) {
          mma_tf32(acc, al[i][s], bf[s].x, bf[s].y);
          mma_tf32(acc, ah[i][s], bf[s].z, bf[s].w);
          mma_tf32(acc, ah[i][s], bf[s].x, bf[s].y);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * i + (e >> 1);
          const int key = (__float_as_int(acc[e]) & ~kMask) | (2 * j + (e & 1));
          b2[r] = min(b2[r], max(b1[r], key));
          b1[r] = min(b1[r], key);
        }
      }
    }
    const int n0 = tile * BN;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int p = b1[r] & kMask;
      merge(best[r], b1[r] & ~kMask, n0 + (p >> 1) * 8 + 2 * t + (p & 1), b2[r] & ~kMask);
    }
  };
  // Two loops (not one with a branch per tile): ptxas spilled under the launch bounds with one.
  if constexpr (local) {
    for (int tile = 0; tile < tiles; ++tile) {
      build_tile(tile);
      mma_tile(smem, tile);
    }
  } else {
    load_tile(0, 0);
    mma_detail::cp_async_commit();
    for (int tile = 0; tile < tiles; ++tile) {
      mma_detail::cp_async_wait<0>();
      __syncthreads();  // the tile is in for everyone; the other stage is free
      if (tile + 1 < tiles) load_tile((tile + 1) & 1, tile + 1);
      mma_detail::cp_async_commit();
      mma_tile(smem + (tile & 1) * Tr::kTileBytes, tile);
    }
  }
  mma_detail::cp_async_wait<0>();

  // The quad's lanes hold the same rows: merge (a symmetric merge: every lane ends with the same).
#pragma unroll
  for (int o = 1; o < 4; o <<= 1)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int v1 = shfl_xor_int(best[r].v1, o), c1 = shfl_xor_int(best[r].c1, o), v2 = shfl_xor_int(best[r].v2, o);
      merge(best[r], v1, c1, v2);
    }

  // Lane t of the quad finishes row r = t (rows g + 8 (r & 1) + 16 (r >> 1) of the warp).
  // local: B' = X'_warp + kmax over the CTA; tau 1.01 x: the shifts' rounding (<= 8 u B' on a gap, the notes).
  float kmax = 0.0f;
  if constexpr (local) {
    kmax = block_reduce<Tr::kThreads>(KM_RED, KM_RED[tid], [](float p, float q) { return fmaxf(p, q); });
  }
  const float bw = xbar + (local ? kmax : cmax[0]);
  const float thr = (local ? tau * 1.01f : tau) * bw;
  const bool in_range = bw >= 0x1p-60f && bw <= 0x1p100f;
  int mine = 0;
  bool ok = false;
  float gap = 0.0f;
  i64 m = -1;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (t == r) {
      m = m_warp + 16 * (r >> 1) + 8 * (r & 1) + g;
      mine = best[r].c1;
      gap = __int_as_float(best[r].v2) - __int_as_float(best[r].v1);
      ok = in_range && gap > thr;
    }
  }
  const bool live = m >= 0 && real(m);
  const i64 pm = live ? point(m) : 0;
  // The row's exact-path value v of its label and, on uncertified rows, the second smallest value v2 of
  // every other centre (the rescan's).
  float v = 0.0f, v2 = 0.0f;
  if (live && ok) v = exact_value(x + pm * sxm, sxk, c + i64(mine) * ldc, K, split);
  // The uncertified rows, one at a time by the whole warp: every centre's exact-path value (lane l takes
  // the centres l, l + 32, ..., read coalesced from ct; the row's coordinates in registers), the
  // smallest key (value bits, n) and the second smallest value, merged over the warp; the row's lane
  // keeps them.
  constexpr int KR = S * 8;
  const i64 Cp = (C + BN - 1) / BN * BN;
  const float* ct = reinterpret_cast<const float*>(cf + Cp / 8 * S * 32) + lane;
  unsigned todo = ballot(live && !ok);
  while (todo) {
    const int src = __ffs(todo) - 1;
    todo &= todo - 1;
    const float* xi = x + point(m_warp + shfl_int(int(m - m_warp), src)) * sxm;
    float xr[Tr::kRescanRegs ? KR : 1];
    if constexpr (Tr::kRescanRegs) {
#pragma unroll
      for (int q = 0; q < KR; ++q) xr[q] = q < K ? xi[q * sxk] : 0.0f;
    }
    Keys k{0xffffffffu, 0xffffffffu, 0xffffffffu};
    const float* cg = ct;  // the lane's centre in each group of 32
#pragma unroll 1
    for (int n = lane; n < C; n += 32, cg += 32 * K) {
      const float e = Tr::kRescanRegs ? exact_value_ct<KR>(xr, 1, cg, K, split)
                                      : exact_value_ct<KR>(xi, sxk, cg, K, split);
      merge_keys(k, __float_as_uint(e), unsigned(n), 0xffffffffu);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned ov = unsigned(shfl_xor_int(int(k.v1), o)), on = unsigned(shfl_xor_int(int(k.n1), o));
      const unsigned o2 = unsigned(shfl_xor_int(int(k.v2), o));
      merge_keys(k, ov, on, o2);
    }
    if (lane == src) mine = int(k.n1), v = __uint_as_float(k.v1), v2 = __uint_as_float(k.v2);
  }
  if (!live) return;
  // The row's results; with ub: its bounds (lb from the certified gap, or from the rescan's v2), the
  // cluster's largest ub (float bits of a value >= 0 order as integers), and the count of changed labels.
  if (changed && labels[pm] != mine) atomicAdd(changed, 1);
  labels[pm] = mine;
  dist[pm] = sqrtf(v);
  if (cert) cert[pm] = ok ? 1 : 0;
  if (ub) {
    const float u = upper_of(v, gu);
    float lsq;
    if (ok) {  // min_{n != label} ||x - c_n||^2 >= ||x - c_label||^2 + gap - tau B (the notes)
      const float inc = below(math::sub_rn(below(gap), above(thr)));
      lsq = down(math::add_rn(lower_sq_of(v, gl), inc));
      // local: the left-out centres are farther than 3 sqrt X' - sqrt X' (fp32 slack: 1.97^2 > 3.88)
      if (local) lsq = fminf(lsq, down(math::mul_rn(3.88f, KM_SX[0])));
    } else {  // every other centre's exact value is >= v2 (NaN where there is none: lb 0)
      lsq = lower_sq_of(v2, gl);
    }
    ub[pm] = u;
    lb[pm] = down(math::sqrt_rn(lsq));
    atomicMax(rmax + mine, __float_as_int(u));
  }
}
#undef KM_RS
#undef KM_SX
#undef KM_RED

// The pruned iteration's filter (plan.kmeans.BoundedAssign), one point per thread, grid
// (ceil(N / kThreads), 1, 1). The centres moved: drift[n] >= ||c_n(new) - c_n(old)||; the centres n != a
// split into those nearer to c_a than rth[a] (lower bound on the others' distance) and the rest, mdl[a] >=
// the largest drift of the near ones; halfs[a] <= min_n ||c_n - c_a|| / 2 (all from the host, rounded
// outward; rth[a] ~ 2 kap r_a with r_a the cluster's largest ub after its drift, so that far centres rarely
// decide). Per point: ub += drift[label]; lb = min(lb - mdl[label], rth[label] - ub) (near centres moved by
// at most mdl, far ones are farther than rth - ub by the triangle inequality: a lower bound over every
// other centre); if keeps_label fails, ub is recomputed from the exact path's value for its centre and
// tested again; points that still fail go to
// work[atomicAdd(count)] (their order is free: each is assigned on its own), the others keep their label
// and add ub to rmax[label] (zeroed by the host before). With dist: the exact mode instead, every point's
// dist = sqrtf(exact value to its label's centre) (the bits of the full assignment's dist).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_bounds_kernel(
    const float* __restrict__ x, const float* __restrict__ c, const i64* __restrict__ labels,
    float* __restrict__ ub, float* __restrict__ lb, const float* __restrict__ drift, const float* __restrict__ mdl,
    const float* __restrict__ halfs, const float* __restrict__ rth, int* __restrict__ rmax, int* __restrict__ work,
    int* __restrict__ count, float* __restrict__ dist, int N, int K, i64 sxm, i64 sxk, i64 ldc, int split, float kap,
    float gu) {
  using namespace kmeans_assign_detail;
  const i64 i = i64(blockIdx.x) * Traits::kThreads + threadIdx.x;
  const int lane = threadIdx.x & 31;
  const bool live = i < N;
  if (dist) {
    if (live) dist[i] = sqrtf(exact_value(x + i * sxm, sxk, c + labels[i] * ldc, K, split));
    return;
  }
  bool queue = false;
  if (live) {
    const i64 a = labels[i];
    float u = above(math::add_rn(ub[i], drift[a]));
    const float near = down(math::sub_rn(lb[i], mdl[a]));  // the centres within rth[a] of c_a
    float l = fminf(near, down(math::sub_rn(rth[a], u)));   // and the others: ||x - c|| >= rth[a] - u
    bool keep = keeps_label(u, fmaxf(l, halfs[a]), kap);
    if (!keep) {
      u = upper_of(exact_value(x + i * sxm, sxk, c + a * ldc, K, split), gu);
      l = fminf(near, down(math::sub_rn(rth[a], u)));
      keep = keeps_label(u, fmaxf(l, halfs[a]), kap);
    }
    ub[i] = u;
    lb[i] = l;
    if (keep) atomicMax(rmax + a, __float_as_int(u));
    queue = !keep;
  }
  const unsigned b = ballot(queue);
  if (b) {
    const int leader = __ffs(b) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(count, __popc(b));
    base = shfl_int(base, leader);
    if (queue) work[base + __popc(b & ((1u << lane) - 1u))] = int(i);
  }
}

}  // namespace kermac_like
