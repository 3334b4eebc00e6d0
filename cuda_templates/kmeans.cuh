// k-means++ seeding (D^2 sampling) without host synchronisation: kmeans_update_kernel and
// kmeans_draw_kernel (ABI: cuda_templates/ABI.md, built by kermac_like/plan/kmeans.py for
// kermac_like.cluster.kmeans_plusplus).
//
// State over the N points (float32 data x (N, K), optional float32 weights w): the running
// minimum squared distance d2[i] to the centres drawn so far and its centre near[i] (int32), and
// the sampling weights p[i] = d2[i] w[i] (float32 product; d2[i] without weights; w[i] or 1 for the
// first draw), never stored: block sums of p over blocks of kBlockM = 1024 points (the sampler's
// SAMPLE_BLOCK) in float64, bsum[(N + 1023) / 1024].
//
// Per centre j, two launches in stream order:
//
//   kmeans_draw_kernel (one CTA): r = u[j] x (sum of bsum), the first block whose cumulative sum
//     exceeds r (right searchsorted; the last block where none does), then in that block the
//     first point whose cumulative sum of p exceeds r minus the block's preceding sum (the last
//     point of the block where none does), clamped to N - 1 (cluster.py's _Sampler.draw; an all-zero
//     p draws N - 1). Writes idx[j], centres[j] = x[idx[j]] and cc[a] = ||c_a - c_j||^2 for a < j.
//   kmeans_update_kernel (one CTA per 1024 points): for every point with cc[near] < 4 d2
//     (1 + 1e-6) (the others cannot get closer: ||c_j - c_a|| >= 2 d), dn = ||x_i - c_j||^2;
//     where dn < d2: d2 = dn, near = j. A CTA where some point changed writes its block sum of p
//     again; the others keep theirs (the same p, the same sum). Most points cost the 8 bytes of
//     (near, d2): x is read for the candidates only.
//
// With KmeansTraits::kScreen, a candidate is first screened by a bf16 copy of x (written by the
// j = -1 launch, N x screen_row(K) x 2 bytes): its float32 row is read only where the screen
// cannot prove dn >= d2 (the bitwise-same result: "The bf16 screen" below).
//
// j = 0 (the first centre): every point takes dn and near = 0 (d2 and near are not read). The
// first draw's block sums come from kmeans_update_kernel with j = -1 (the sums of w, or the
// counts; nothing else written). Determinism: every sum has a fixed order (distances over k in
// order, without contraction; block sums by a fixed shared-memory tree; the draw's scans by fixed
// chunks and a fixed Hillis-Steele scan); no atomics. The same inputs and u give the same bits.
#pragma once

#include "common.cuh"
#include "storage16.cuh"
#include "math.cuh"
#include "block_reduce.cuh"

namespace kermac_like {

// kK_: the padded K of the centre kept in registers (4, 8, 16, 32), or 0 for a runtime loop over
// any K (the centre read from global memory). kScreen_: the update screens its candidates with a
// bf16 copy of x before reading their float32 rows (below: "The bf16 screen").
template <class T_, int kK_, bool kScreen_ = false>
struct KmeansTraits {
  static_assert(SameType<T_, float>::value, "KmeansTraits: float32 data (16-bit data is upcast by the host)");
  static_assert(kK_ == 0 || kK_ == 4 || kK_ == 8 || kK_ == 16 || kK_ == 32, "KmeansTraits: kK is 0, 4, 8, 16 or 32");
  using T = T_;
  static constexpr int kK = kK_;
  static constexpr bool kScreen = kScreen_;
  static constexpr int kThreads = 256;
  static constexpr int kPoints = 4;                     // points per thread of the update
  static constexpr int kBlockM = kThreads * kPoints;    // points per block sum (SAMPLE_BLOCK)
  static constexpr int kBlockN = 1;                     // (no second tile dimension)
  static constexpr int kSmemBytes = 0;                  // static shared memory only
};

namespace kmeans_detail {

// 4 d^2 (1 + 1e-6) in float32, as cluster.py's `d2 * (4.0 * (1.0 + 1e-6))`.
constexpr float kMargin = 4.000004f;

// ||x_i - c||^2 in float32, k in order, each square rounded before its add (torch's
// (x - c).square_().sum(1) term by term; no contraction, so the CPU shim gives the same bits).
template <class Tr>
__device__ __forceinline__ float sq_dist(const float* xi, i64 sxk, const float* c_reg, const float* cj, int K) {
  float acc = 0.0f;
  if constexpr (Tr::kK > 0) {
    float v[Tr::kK];
#pragma unroll
    for (int q = 0; q < Tr::kK; ++q) v[q] = q < K ? xi[q * sxk] : 0.0f;
#pragma unroll
    for (int q = 0; q < Tr::kK; ++q) {
      if (q < K) {
        const float d = math::sub_rn(v[q], c_reg[q]);
        acc = math::add_rn(acc, math::mul_rn(d, d));
      }
    }
  } else {
#pragma unroll 4
    for (int q = 0; q < K; ++q) {
      const float d = math::sub_rn(xi[q * sxk], cj[q]);
      acc = math::add_rn(acc, math::mul_rn(d, d));
    }
  }
  return acc;
}

// The sum of the block's kThreads values v, by a fixed tree.
template <int T>
__device__ __forceinline__ double block_sum(double* red, double v) {
  return block_reduce<T>(red, v, [](double a, double b) { return a + b; });
}

// Inclusive scan of the block's values v (Hillis-Steele, two buffers, a fixed order): returns
// the sum of the values of threads before this one; *total the sum of all.
template <int T>
__device__ __forceinline__ double block_exclusive_scan(double (*buf)[T], double v, double* total) {
  const int tid = threadIdx.x;
  buf[0][tid] = v;
  __syncthreads();
  int in = 0;
#pragma unroll 1
  for (int off = 1; off < T; off <<= 1) {
    double s = buf[in][tid];
    if (tid >= off) s = buf[in][tid - off] + s;
    buf[1 - in][tid] = s;
    in = 1 - in;
    __syncthreads();
  }
  const double excl = tid > 0 ? buf[in][tid - 1] : 0.0;
  *total = buf[in][T - 1];
  __syncthreads();
  return excl;
}

// The smallest of the block's values v.
template <int T>
__device__ __forceinline__ int block_min(int* red, int v) {
  return block_reduce<T>(red, v, [](int a, int b) { return min(a, b); });
}

// -- The bf16 screen (KmeansTraits::kScreen) -----------------------------------------------------
//
// The update's j = -1 launch also writes xs, a bf16 copy of x (row-major, screen_row(K) bf16 per
// point: kK, or K rounded up to 8 for the runtime loop; 0 past K; two coordinates per 32-bit word,
// the even one in the low half), and eb[b], an upper bound on ||x_i - xs_i||_2 over the points of
// block b (encode_row's e_i, proved below; the max over the block by a fixed tree). A later update
// reads a candidate's bf16 row (16-byte vector loads) instead of its float32 row and takes the
// float32 row and dn exactly as without the screen unless screen_skips proves dn >= d2, in which
// case the unscreened kernel would not change the point ("strictly smaller" fails): the state,
// the block sums and the draws are bitwise those of the unscreened kernel.
//
// Proof (u = 2^-24; fl(.) a round-to-nearest fp32 operation: fl(a op b) = (a op b)(1 + e) + h,
// |e| <= u, |h| <= 2^-150, h = 0 for add / subtract and sqrt). K <= 1024 (the planner's check).
// 1. The bound: e2 = sum_k fma(dk, dk, e2) with dk = fl(x_k - xs_k) satisfies
//    e2 >= ||x - xs||^2 (1 - u)^(K + 2) - K 2^-150, and e_i = fl(fl(sqrt(fl(fl(e2 g1) + 2^-100))) g2)
//    with g1 = 1 + (2K + 12) u, g2 = 1 + 8u (both exact in fp32) is >= ||x - xs|| (the factors cover
//    (1 - u)^-(K + 8), 2^-100 the underflow terms). Non-finite parts give inf or NaN (NaN only where
//    x_k is NaN or inf: such a point never changes, its exact dn is NaN or inf; fmax drops NaN).
// 2. The screen: s = sum_k fma(tk, tk, s), tk = fl(xs_k - c_k) (k in order), so
//    s <= a^2 (1 + u)^(K + 2) + 2K 2^-150 with a = ||xs - c||. With f = 1 - (2K + 16) u (exact),
//    t = fl(fl(sqrt(s)) f) - E (rounded), q = fl(fl(t t) f): skip only when d2 >= 2^-100, t > 0,
//    q is finite and q >= d2. Then every step above was finite and normal, and walking back:
//    t^2 >= d2 / (f (1 + u)^2), a >= fl(sqrt(s)) f (1 + u) ... >= t / (1 + u) + E (f absorbs
//    (1 + u)^((K + 6) / 2) and the 2K 2^-150), so by the triangle inequality r = ||x - c|| >=
//    a - E >= t / (1 + u) > 0 and r^2 >= d2 / (f (1 + u)^4).
// 3. The exact dn = fl-sum of fl(fl(x_k - c_k)^2) (sq_dist) is >= r^2 (1 - u)^(K + 2) - K 2^-150
//    (or inf on overflow) >= d2 (1 - u)^(K + 2) / (f (1 + u)^4) - K 2^-150 >= d2 (1 + (K + 9) u)
//    - K 2^-150 >= d2, as d2 >= 2^-100. So dn < d2 is false: nothing changes.
// Overflow or NaN anywhere in the screen (s, t or q infinite or NaN, E = inf) fails the test: the
// point takes the exact path. tests/test_templates_kmeans.py checks the bound at its edges.

using math::sqrt_rn;  // fp32 square root, correctly rounded

// bf16 bits of v, rounded to nearest even (overflow to inf; NaN stays NaN); bf16 -> fp32 exactly.
__device__ __forceinline__ unsigned bf16_bits(float v) {
  const unsigned b = __float_as_uint(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// bf16 per row of the copy: kK, or K rounded up to 8 (16-byte chunks) for the runtime loop.
template <class Tr>
__device__ __forceinline__ int screen_row(int K) {
  return Tr::kK > 0 ? Tr::kK : (K + 7) & ~7;
}

// W 32-bit words at p by vectors (W = 2: one 8-byte load; W a multiple of 4: 16-byte loads).
template <int W>
__device__ __forceinline__ void load_words(const unsigned* p, unsigned* w) {
  if constexpr (W == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
#pragma unroll
    for (int c = 0; c < W / 4; ++c) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[c];
      w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
    }
  }
}
template <int W>
__device__ __forceinline__ void store_words(unsigned* p, const unsigned* w) {
  if constexpr (W == 2) {
    *reinterpret_cast<uint2*>(p) = uint2{w[0], w[1]};
  } else {
#pragma unroll
    for (int c = 0; c < W / 4; ++c)
      reinterpret_cast<uint4*>(p)[c] = uint4{w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]};
  }
}

// Coordinates q, q + 1 of row xi as one word of bf16 (0 past K), their rounding errors squared
// added to e2 (fma, in order).
__device__ __forceinline__ unsigned encode_pair(const float* xi, i64 sxk, int K, int q, float& e2) {
  const float v0 = q < K ? xi[q * sxk] : 0.0f, v1 = q + 1 < K ? xi[(q + 1) * sxk] : 0.0f;
  const unsigned b0 = bf16_bits(v0), b1 = bf16_bits(v1);
  const unsigned wd = b0 | (b1 << 16);
  const float d0 = math::sub_rn(v0, bf16_lo(wd)), d1 = math::sub_rn(v1, bf16_hi(wd));
  e2 = math::fma_rn(d0, d0, e2);
  e2 = math::fma_rn(d1, d1, e2);
  return wd;
}

// The bound e_i >= ||x_i - xs_i|| from e2 (step 1 of the proof).
__device__ __forceinline__ float screen_err_bound(float e2, int K) {
  const float g1 = math::add_rn(1.0f, float(2 * K + 12) * 0x1p-24f);
  return math::mul_rn(sqrt_rn(math::add_rn(math::mul_rn(e2, g1), 0x1p-100f)), 1.0f + 0x1p-21f);
}

// Writes row xi's bf16 copy at xw (screen_row(K) / 2 words); returns its bound e_i.
template <class Tr>
__device__ __forceinline__ float encode_row(const float* xi, i64 sxk, int K, unsigned* xw) {
  float e2 = 0.0f;
  if constexpr (Tr::kK > 0) {
    constexpr int W = Tr::kK / 2;
    unsigned wv[W];
#pragma unroll
    for (int w = 0; w < W; ++w) wv[w] = encode_pair(xi, sxk, K, 2 * w, e2);
    store_words<W>(xw, wv);
  } else {
#pragma unroll 1
    for (int q0 = 0; q0 < K; q0 += 8) {
      unsigned wv[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) wv[w] = encode_pair(xi, sxk, K, q0 + 2 * w, e2);
      store_words<4>(xw + q0 / 2, wv);
    }
  }
  return screen_err_bound(e2, K);
}

// s = sum_k fma(tk, tk, s), tk = fl(xs_k - c_k), from the bf16 row at xw (step 2 of the proof).
template <class Tr>
__device__ __forceinline__ float screen_dist(const unsigned* xw, const float* c_reg, const float* cj, int K) {
  float s = 0.0f;
  if constexpr (Tr::kK > 0) {  // c_reg and the copy are 0 past K: those terms add exactly 0
    constexpr int W = Tr::kK / 2;
    unsigned wv[W];
    load_words<W>(xw, wv);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float d0 = math::sub_rn(bf16_lo(wv[w]), c_reg[2 * w]);
      s = math::fma_rn(d0, d0, s);
      const float d1 = math::sub_rn(bf16_hi(wv[w]), c_reg[2 * w + 1]);
      s = math::fma_rn(d1, d1, s);
    }
  } else {
#pragma unroll 1
    for (int q0 = 0; q0 < K; q0 += 8) {
      unsigned wv[4];
      load_words<4>(xw + q0 / 2, wv);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int q = q0 + 2 * w;
        const float d0 = math::sub_rn(bf16_lo(wv[w]), q < K ? cj[q] : 0.0f);
        s = math::fma_rn(d0, d0, s);
        const float d1 = math::sub_rn(bf16_hi(wv[w]), q + 1 < K ? cj[q + 1] : 0.0f);
        s = math::fma_rn(d1, d1, s);
      }
    }
  }
  return s;
}

// Whether the screen proves that the exact dn is >= d2 (step 2 and 3 of the proof): s from
// screen_dist, e the block's bound, f = 1 - (2K + 16) u.
__device__ __forceinline__ bool screen_skips(float s, float e, float f, float d2) {
  const float t = math::sub_rn(math::mul_rn(sqrt_rn(s), f), e);
  const float q = math::mul_rn(math::mul_rn(t, t), f);
  return d2 >= 0x1p-100f && t > 0.0f && q <= 0x1.fffffep127f && q >= d2;
}

// f of screen_skips for K coordinates (exact in fp32).
__device__ __forceinline__ float screen_slack(int K) {
  return math::sub_rn(1.0f, float(2 * K + 16) * 0x1p-24f);
}

}  // namespace kmeans_detail

// Grid ((N + kBlockM - 1) / kBlockM, 1, 1): CTA b owns points [b kBlockM, (b + 1) kBlockM), thread t
// the points b kBlockM + t + e kThreads (e < kPoints, coalesced). j = -1: bsum[b] = the block's sum
// of w (or its point count); with the screen also the block's rows of the bf16 copy xs and its
// bound eb[b] (else xs and eb are not used). j >= 0: the update by centre j = centres[j] (row
// stride ldc) as described above.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_update_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ centres,
    const float* __restrict__ cc, float* __restrict__ d2, int* __restrict__ near, double* __restrict__ bsum,
    unsigned* __restrict__ xs, float* __restrict__ eb, int N, int K, i64 sxm, i64 sxk, i64 ldc, int j) {
  using Tr = Traits;
  using namespace kmeans_detail;
  constexpr int T = Tr::kThreads, P = Tr::kPoints;
  __shared__ double red[T];
  const int tid = threadIdx.x;
  const i64 base = i64(blockIdx.x) * Tr::kBlockM;
  const int kw = screen_row<Tr>(K) / 2;  // 32-bit words per row of xs (with the screen)

  if (j < 0) {  // the first draw's weights (and the screen's copy)
    double part = 0.0;
    float emax = 0.0f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const i64 i = base + tid + e * T;
      if (i < N) {
        part += w ? double(w[i]) : 1.0;
        if constexpr (Tr::kScreen) emax = fmaxf(emax, encode_row<Tr>(x + i * sxm, sxk, K, xs + i * kw));
      }
    }
    const double s = block_sum<T>(red, part);
    if (tid == 0) bsum[blockIdx.x] = s;
    if constexpr (Tr::kScreen) {
      const double m = block_reduce<T>(red, double(emax), [](double a, double b) { return fmax(a, b); });
      if (tid == 0) eb[blockIdx.x] = float(m);
    }
    return;
  }

  const float* cj = centres + i64(j) * ldc;
  float c_reg[Tr::kK > 0 ? Tr::kK : 1];
  if constexpr (Tr::kK > 0) {
#pragma unroll
    for (int q = 0; q < Tr::kK; ++q) c_reg[q] = q < K ? cj[q] : 0.0f;
  }
  float e_blk = 0.0f, f = 0.0f;  // the screen's bound for this block and its slack
  if constexpr (Tr::kScreen) {
    if (j > 0) e_blk = eb[blockIdx.x], f = screen_slack(K);
  }
  float pv[P];
  bool changed = false;
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const i64 i = base + tid + e * T;
    pv[e] = 0.0f;
    if (i >= N) continue;
    float old;
    if (j == 0) {
      old = sq_dist<Tr>(x + i * sxm, sxk, c_reg, cj, K);
      d2[i] = old;
      near[i] = 0;
      changed = true;
    } else {
      old = d2[i];
      const int a = near[i];
      if (cc[a] < old * kMargin) {  // a candidate: c_j may be nearer
        bool skip = false;          // with the screen: proved dn >= d2 from the bf16 row
        if constexpr (Tr::kScreen) skip = screen_skips(screen_dist<Tr>(xs + i * kw, c_reg, cj, K), e_blk, f, old);
        if (!skip) {
          const float dn = sq_dist<Tr>(x + i * sxm, sxk, c_reg, cj, K);
          if (dn < old) {
            old = dn;
            d2[i] = dn;
            near[i] = j;
            changed = true;
          }
        }
      }
    }
    pv[e] = old;
  }
  if (__syncthreads_and(!changed)) return;  // the block's p unchanged: its sum stands
  double part = 0.0;
#pragma unroll
  for (int e = 0; e < P; ++e) {  // p = d2 w (w read only in blocks that changed)
    const i64 i = base + tid + e * T;
    part += double(w && i < N ? pv[e] * w[i] : pv[e]);
  }
  const double s = block_sum<T>(red, part);
  if (tid == 0) bsum[blockIdx.x] = s;
}

// Grid (1, 1, 1): the draw of centre j (u[j] in [0, 1)) from the nb = (N + kBlockM - 1) / kBlockM
// block sums and, in the chosen block, p (w or 1 for j = 0, else d2 w or d2); writes idx[j],
// centres[j] (row stride ldc) and cc[a] = ||c_a - c_j||^2 for a < j.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_draw_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ d2,
    const double* __restrict__ bsum, const double* __restrict__ u, i64* __restrict__ idx, float* __restrict__ centres,
    float* __restrict__ cc, int N, int K, i64 sxm, i64 sxk, i64 ldc, int nb, int j) {
  using Tr = Traits;
  using namespace kmeans_detail;
  constexpr int T = Tr::kThreads, BM = Tr::kBlockM, E = BM / T, kBatch = 8;
  __shared__ double scan[2][T];
  __shared__ int imin[T];
  __shared__ double s_base;
  const int tid = threadIdx.x;

  // 1. The block: thread t scans block sums [b0, b1), a contiguous chunk, kBatch loads at a time
  // (issued together, then added in order).
  const int per = (nb + T - 1) / T;
  const int b0 = min(nb, tid * per), b1 = min(nb, b0 + per);
  double s = 0.0;
  for (int b = b0; b < b1; b += kBatch) {
    double v[kBatch];
#pragma unroll
    for (int e = 0; e < kBatch; ++e) v[e] = b + e < b1 ? bsum[b + e] : 0.0;
#pragma unroll
    for (int e = 0; e < kBatch; ++e) s += v[e];
  }
  double total;
  const double excl = block_exclusive_scan<T>(scan, s, &total);
  const double r = u[j] * total;
  // The first b of the chunk whose cumulative sum exceeds r; the same additions in the same order
  // (v[e] = 0 past b1 adds nothing).
  int found = nb;
  double run = excl, at = 0.0;
  for (int b = b0; b < b1 && found == nb; b += kBatch) {
    double v[kBatch];
#pragma unroll
    for (int e = 0; e < kBatch; ++e) v[e] = b + e < b1 ? bsum[b + e] : 0.0;
#pragma unroll
    for (int e = 0; e < kBatch; ++e) {
      if (found == nb && b + e < b1) {
        run += v[e];
        if (run > r) found = b + e, at = run - v[e];
      }
    }
  }
  int bsel = block_min<T>(imin, found);
  // The cumulative sum before bsel, as the scan formed it (cum[b] - bs[b], as _Sampler.draw):
  // from the thread that found it, or where none did (bsel = nb - 1), the owner of the last block
  // (its run went through its whole chunk).
  if (found == bsel && found < nb) s_base = at;
  if (bsel >= nb) {
    bsel = nb - 1;
    if (b0 < b1 && b1 == nb) s_base = run - bsum[nb - 1];
  }
  __syncthreads();
  const double rem = r - s_base;

  // 2. The point: thread t owns points t E .. t E + E - 1 of block bsel.
  const i64 p0 = i64(bsel) * BM + tid * E;
  double pe[E];
  double ps = 0.0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const i64 i = p0 + e;
    float p = 0.0f;
    if (i < N) {
      if (j == 0) p = w ? w[i] : 1.0f;
      else p = w ? d2[i] * w[i] : d2[i];
    }
    pe[e] = double(p);
    ps += pe[e];
  }
  double tot2;
  const double ex2 = block_exclusive_scan<T>(scan, ps, &tot2);
  int f2 = BM;
  double run2 = ex2;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    run2 += pe[e];
    if (f2 == BM && run2 > rem) f2 = tid * E + e;
  }
  int isel = block_min<T>(imin, f2);
  if (isel > BM - 1) isel = BM - 1;
  i64 pick = i64(bsel) * BM + isel;
  if (pick > N - 1) pick = N - 1;

  // 3. The centre and its squared distances to the earlier ones.
  const float* xr = x + pick * sxm;
  if (tid == 0) idx[j] = pick;
  float* cj = centres + i64(j) * ldc;
  for (int q = tid; q < K; q += T) cj[q] = xr[q * sxk];
  for (int a = tid; a < j; a += T) {
    const float* ca = centres + i64(a) * ldc;
    float acc = 0.0f;
    for (int q = 0; q < K; ++q) {
      const float d = math::sub_rn(ca[q], xr[q * sxk]);
      acc = math::add_rn(acc, math::mul_rn(d, d));
    }
    cc[a] = acc;
  }
}

// -- Lloyd's update: the deterministic segmented sum --------------------------------------------
//
// The points sorted by label (perm: a stable sort of the labels, so index order within a cluster),
// cluster c's rows perm[bounds[c] .. bounds[c + 1]) cut into items of at most rows_per_item rows:
// items[c] .. items[c + 1] - 1 (an exclusive prefix of the clusters' item counts; the grid
// ceil(N / rows_per_item) + C covers every item, CTAs past items[C] return). CTA b sums its item
// in float64 by a fixed order (threads over (row group g, dimension q), rows strided by the
// groups, then a fixed tree over the groups) into part[b][0 .. K) and its weight (sum of w, or
// the row count) into part[b][K]; kmeans_segsum_combine_kernel adds a cluster's items in item
// order. No atomics: the same labels give the same bits.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_segsum_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const i64* __restrict__ perm,
    const i64* __restrict__ bounds, const i64* __restrict__ items, double* __restrict__ part, int K, int C, i64 sxm,
    i64 sxk, int rows_per_item) {
  using Tr = Traits;
  using namespace kmeans_detail;
  constexpr int T = Tr::kThreads;
  __shared__ double red[T];
  const int tid = threadIdx.x;
  const i64 b = blockIdx.x;
  if (b >= items[C]) return;
  int lo = 0, hi = C;  // the cluster: the last c with items[c] <= b (items non-decreasing)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (items[mid] <= b) lo = mid;
    else hi = mid;
  }
  const int c = lo;
  const i64 r0 = bounds[c] + (b - items[c]) * rows_per_item;
  const i64 r1 = min(bounds[c + 1], r0 + rows_per_item);
  double* out = part + b * (K + 1);
  int kd = 1;  // dimensions per row group: the power of two >= K, at most T
  while (kd < K && kd < T) kd <<= 1;
  const int G = T / kd, g = tid / kd, q0 = tid - g * kd;
  for (int qc = 0; qc < K; qc += kd) {
    const int q = qc + q0;
    double acc = 0.0;
    if (q < K) {
#pragma unroll 4
      for (i64 r = r0 + g; r < r1; r += G) {
        const i64 i = perm[r];
        double v = double(x[i * sxm + q * sxk]);
        if (w) v *= double(w[i]);
        acc += v;
      }
    }
    red[tid] = acc;
    __syncthreads();
#pragma unroll 1
    for (int s = G / 2; s > 0; s >>= 1) {
      if (g < s) red[tid] = red[tid] + red[tid + s * kd];
      __syncthreads();
    }
    if (g == 0 && q < K) out[q] = red[tid];
    __syncthreads();
  }
  if (w) {
    double acc = 0.0;
    for (i64 r = r0 + tid; r < r1; r += T) acc += double(w[perm[r]]);
    const double sw = block_sum<T>(red, acc);
    if (tid == 0) out[K] = sw;
  } else if (tid == 0) {
    out[K] = double(r1 - r0);
  }
}

// Grid-stride over the C (K + 1) outputs: sums[c][q] (q < K, row stride K) and wsum[c] (q = K),
// cluster c's items added in item order (0 for a cluster without points).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_segsum_combine_kernel(
    const double* __restrict__ part, const i64* __restrict__ items, double* __restrict__ sums,
    double* __restrict__ wsum, int K, int C) {
  const int total = C * (K + 1);  // (< 2^31: the planner's check; int division, no 64-bit call)
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    const int c = e / (K + 1), q = e - c * (K + 1);
    double s = 0.0;
    for (i64 it = items[c]; it < items[c + 1]; ++it) s += part[it * (K + 1) + q];
    if (q < K) sums[i64(c) * K + q] = s;
    else wsum[c] = s;
  }
}

}  // namespace kermac_like
