// Tensor-core distance kernel: p=2 distances, the Laplace-l2 and Gaussian
// kernels and the DOT descriptor as one fused matrix product.
//
//   ||x - y||^2 = ||x||^2 + ||y||^2 - 2 x.y
//
// The dot products run on the tensor cores (mma.sync, sm_80 and newer); the
// squared row norms are summed in fp32 on the FMA pipe from the same
// shared-memory tiles, in the same pass over K; the epilogue (clamp at 0, sqrt,
// epsilon, exp, regularisation) runs on the accumulator registers, and the
// kernel matrix leaves registers only for its final write.
//
// Precision (template parameter):
//   Tf32x3   float32 data, each operand split x = big + small with
//            big = tf32(x), small = tf32(x - big), and the product taken as
//            big*big + big*small + small*big (small*small, ~2^-22 relative,
//            dropped): fp32-grade dot products from three TF32 MMAs.
//   Tf32     float32 data rounded to TF32 (10-bit mantissa), one MMA.
//   Native16 IEEE half (kermac_like::float16) or bfloat16 (kermac_like::bfloat16)
//            data on their own MMA (m16n8k16), fp32 accumulation, fp32 norms,
//            output rounded to the data type.
//
// Same ABI as distance_kernel (cuda_templates/ABI.md), with these limits,
// checked by static_asserts where they are static:
//   Inner::Diff means the inner power Square (implied, not a parameter); the
//   outer power is Noop (squared distance) or Sqrt (distance).
//   Inner::Dot takes outer Noop and Epilogue::None.
//   a and b are RowMajor (K contiguous). out is RowMajor or ColMajor.
//   Runtime requirements the launcher must guarantee (else use the SIMT kernel
//   or make a contiguous, aligned copy):
//     a, b, and every batch offset of them, 16-byte aligned;
//     lda, ldb multiples of 16 bytes (4 floats, 8 sixteen-bit elements).
//   K itself may be anything >= 1 (the K tail is zero-filled), and out needs
//   only element alignment (vector stores are used when out and ldo allow).
//
// Self distances: when a row of a and the row of b with the same index are
// the same memory (a == b and lda == ldb after the batch offsets), the
// diagonal n == m is exactly 0 (before the epilogue). Any other pair of equal
// points gets the cancellation noise of the norm expansion, up to about
// sqrt(eps_fp32 * (||x||^2 + ||y||^2)) in the distance, like torch.cdist's
// matrix-product path. Squared distances are clamped at 0.
//
// Non-finite inputs (tests/test_nonfinite.py): a NaN coordinate gives NaN in its
// row (column) of the output, every epilogue included. An infinite coordinate
// gives what torch.cdist's matrix-product path gives (IEEE fp32 products in
// ||x||^2 + ||y||^2 - 2 x.y: +inf, or NaN for inf - inf and inf * 0) with Tf32 and
// 16-bit data, and with Tf32x3 through split_tf32x3 (a plain split would give
// big = inf, small = tf32_rna(inf - inf) and big * small_y = inf * 0 = NaN wherever
// y is exact in TF32); distance_wgmma_kernel splits the same way.
#pragma once

#include "common.cuh"
#include "storage16.cuh"
#include "math.cuh"
#include "epilogue.cuh"

namespace kermac_like {

enum class Precision : int { Tf32x3 = 0, Tf32 = 1, Native16 = 2 };

namespace mma_detail {

// Round an fp32 bit pattern to TF32, to nearest with ties away from zero (the
// rounding of cvt.rna.tf32.f32, without its special case for inf/NaN).
__device__ __forceinline__ unsigned tf32_rna(unsigned x) { return (x + 0x1000u) & 0xffffe000u; }

// The 3xTF32 split x = big + small of one operand, with infinities kept apart
// from NaN. The plain split of x = +-inf gives big = +-inf and small = inf - inf
// = NaN, so every product with that coordinate would be NaN, where torch's
// matrix-product path (fp32 IEEE products) has +-inf or, against a 0, NaN.
// Here big comes from x clamped to +-2^64 (beyond it x^2 overflows fp32, so the
// norm expansion is inf or NaN anyway): x = +-inf gives big = +-2^64 and small
// = +-inf, and the three products big*b_small + small*b_big + big*b_big are
// +-inf or NaN exactly where the IEEE product x*y is (for |y| below 2^40, where
// 2^64 * y_small cannot overflow against the sign of x*y). A NaN coordinate
// reaches the distance through the squared row norms (every tensor-core
// descriptor is Euclidean), whatever its halves become. Cost: two FMNMX.NAN per
// split value (the NaN-keeping min/max, so that the SASS keeps no plain FMNMX).
__device__ __forceinline__ void split_tf32x3(unsigned x, unsigned& big, unsigned& small) {
  const float xf = __uint_as_float(x);
  big = tf32_rna(__float_as_uint(math::fmin_nan(math::fmax_nan(xf, -18446744073709551616.f), 18446744073709551616.f)));
  small = tf32_rna(__float_as_uint(xf - __uint_as_float(big)));
}

// ------------------------------------------------------------ PTX primitives
// Everything that is inline PTX. tests/test_templates_mma.py defines
// KERMAC_LIKE_MMA_HOST_EMULATION and supplies host versions of exactly these
// (plus threadIdx, __syncthreads, __shfl_xor_sync), so that the rest of this
// file, the kernel included, runs unchanged on the CPU against a float64 oracle.
#ifndef KERMAC_LIKE_MMA_HOST_EMULATION

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global -> shared copy; bytes < 16 zero-fills the rest (0: all zero,
// nothing is read). See common.cuh.
using async_copy::cp_async_16;
using async_copy::cp_async_commit;
using async_copy::cp_async_wait;


// d += a * b on a 16x8x8 TF32 tile: fragment layout in common.cuh.
using tensor_core::mma_tf32;

// d += a * b on a 16x8x16 tile of f16 or bf16 (PTX ISA "Matrix Fragments for
// mma.m16n8k16 with floating point type"). Each register holds two elements,
// the lower k in the low half:
//   a0 (row g, k 2t,2t+1)  a1 (row g+8, k 2t,2t+1)  a2 (row g, k 2t+8,2t+9)  a3 (row g+8, k 2t+8,2t+9)
//   b0 (k 2t,2t+1, col g)  b1 (k 2t+8,2t+9, col g)
//   d as for mma_tf32.
template <class T>
struct Mma16;
template <>
struct Mma16<float16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma16<bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Element conversions without CUDA headers.
template <class T>
struct Convert16;
template <>
struct Convert16<float16> {
  static __device__ __forceinline__ float lo(unsigned w) {
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(w));
    return f;
  }
  static __device__ __forceinline__ float hi(unsigned w) {
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(w));
    return f;
  }
  static __device__ __forceinline__ unsigned short one(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
  }
  static __device__ __forceinline__ unsigned two(float lo_x, float hi_x) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_x), "f"(lo_x));
    return r;
  }
};
template <>
struct Convert16<bfloat16> {
  static __device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
  static __device__ __forceinline__ unsigned short one(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
  }
  static __device__ __forceinline__ unsigned two(float lo_x, float hi_x) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_x), "f"(lo_x));
    return r;
  }
};

__device__ __forceinline__ float sqrt_approx(float x) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

#endif  // KERMAC_LIKE_MMA_HOST_EMULATION

// d = a * b + {c0, c1, c0, c1} on a 16x8x8 TF32 tile (the C operand apart from D, one value per
// column: no moves into the accumulators). On the host emulation, on the emulator's mma_tf32.
#ifndef KERMAC_LIKE_MMA_HOST_EMULATION
__device__ __forceinline__ void mma_tf32_c(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, float c0,
                                           float c1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%10,%11};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c0), "f"(c1));
}
#else
inline void mma_tf32_c(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, float c0, float c1) {
  d[0] = c0, d[1] = c1, d[2] = c0, d[3] = c1;
  mma_tf32(d, a, b0, b1);
}
#endif

// Sum of squares of the values in one 16-byte chunk (4 floats or 8 halves).
template <class T>
__device__ __forceinline__ float chunk_sumsq(uint4 v) {
  if constexpr (sizeof(T) == 4) {
    float x0 = __uint_as_float(v.x), x1 = __uint_as_float(v.y);
    float x2 = __uint_as_float(v.z), x3 = __uint_as_float(v.w);
    float s = x0 * x0;
    s = fmaf(x1, x1, s);
    s = fmaf(x2, x2, s);
    return fmaf(x3, x3, s);
  } else {
    using C = Convert16<T>;
    float s0 = C::lo(v.x), s1 = C::hi(v.x);
    float s = s0 * s0;
    s = fmaf(s1, s1, s);
    s0 = C::lo(v.y), s1 = C::hi(v.y);
    s = fmaf(s0, s0, s);
    s = fmaf(s1, s1, s);
    s0 = C::lo(v.z), s1 = C::hi(v.z);
    s = fmaf(s0, s0, s);
    s = fmaf(s1, s1, s);
    s0 = C::lo(v.w), s1 = C::hi(v.w);
    s = fmaf(s0, s0, s);
    return fmaf(s1, s1, s);
  }
}

// The 4 lanes tid % 4 = 0..3 hold partial squared norms of the same rows (one per 16-byte chunk
// of a row): add them and let lane 0 of the four store each row's norm (rows copy_row + u *
// kRowsPerPass of the tile).
template <int kRowsPerPass, int kChunks>
__device__ __forceinline__ void store_quad_norms(float (&sq)[kChunks], float* norm, int copy_row, int copy_chunk) {
#pragma unroll
  for (int u = 0; u < kChunks; ++u) {
    sq[u] += __shfl_xor_sync(0xffffffffu, sq[u], 1);
    sq[u] += __shfl_xor_sync(0xffffffffu, sq[u], 2);
    if (copy_chunk == 0) norm[copy_row + u * kRowsPerPass] = sq[u];
  }
}

template <class T>
__device__ __forceinline__ void store_one(T* p, float y) {
  if constexpr (sizeof(T) == 4) {
    *p = y;
  } else {
    *reinterpret_cast<unsigned short*>(p) = Convert16<T>::one(y);
  }
}
// Two consecutive elements at an address aligned to their combined size.
template <class T>
__device__ __forceinline__ void store_two(T* p, float y0, float y1) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float2*>(p) = make_float2(y0, y1);
  } else {
    *reinterpret_cast<unsigned*>(p) = Convert16<T>::two(y0, y1);
  }
}

// Near pairs (issue 42; bench/notes/data_zoo.md). The expansion's squared distance is off by up
// to about K 2^-24 (||x||^2 + ||y||^2) with Tf32x3 (the tensor cores' fp32 accumulation is biased:
// measured 0.35 K 2^-24 on blob data at K = 1024), a large share of a small distance (an exact
// duplicate came out as 0.0096 at D = 64). Entries whose expansion is below kNearShare = 2^-10 of
// ||x||^2 + ||y||^2 of the rows as the kernel reads them (shifted by the planner's reference
// point, so that the share follows the data's centred scale) are flagged, one bit per MMA tile
// (or column pair) of the thread, and rewritten after the tile from the direct differences of
// their two rows as the caller gave them (NearOperands), summed in fp64 by the whole warp
// (coalesced rows): every difference and square of two floats is exact there, so an exact
// duplicate gives exactly 0 and a near pair its float32-grade distance. Above the share the
// distance's relative error is up to about K 2^-24 (||x||^2 + ||y||^2) / (2 d^2). The share is a
// cost bound: at 1/32, blob data (every within-blob pair at a ratio of about 0.012 of its shifted
// norms) rewrote an eighth of all pairs, cdist 30000^2 x 1024 2.9 s against 15 ms; at 2^-10,
// 15.1 ms with errors up to 8.9e-4 there (torch.cdist 3.6e-4). Shifting by a point near each
// tile rather than near the data is the way to both (bench/notes/data_zoo.md, "What remains").
#ifndef KERMAC_LIKE_NEAR_SHARE
#define KERMAC_LIKE_NEAR_SHARE 0.0009765625f
#endif

#ifndef KERMAC_LIKE_MMA_HOST_EMULATION
__device__ __forceinline__ unsigned near_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
__device__ __forceinline__ int near_shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ double near_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
#endif

// ||x - y||^2 of two float rows of K coordinates (strides sx, sy) by direct differences in fp64,
// summed by the 32 lanes of a warp (lane l: coordinates l, l + 32, ...; coalesced reads of the
// two rows), rounded once; every lane gets the sum.
__device__ __forceinline__ float warp_sq_distance(const float* x, long long sx, const float* y, long long sy, int K,
                                                  int lane) {
  double s0 = 0.0, s1 = 0.0;
#pragma unroll 1
  for (int k = lane; k < K; k += 64) {
    const double d0 = (double)x[k * sx] - (double)y[k * sy];
    s0 = fma(d0, d0, s0);
    if (k + 32 < K) {
      const double d1 = (double)x[(k + 32) * sx] - (double)y[(k + 32) * sy];
      s1 = fma(d1, d1, s1);
    }
  }
  return (float)near_sum(s0 + s1);
}

// The operands as the caller gave them, before the planner's shift and zero padding (the kernels'
// trailing arguments): the near pairs' direct differences read them, so that they are those of
// the given float32 values (a shifted copy rounds coordinates far from the reference point).
// Row m of batch entry (l0, l1, l2): a0 + a_bs.offset(l0, l1, l2) + m a_sm, coordinate k at
// k a_sk, k < k0. a0 == nullptr: the kernel's own operands (no copy was made, or only a padded one).
struct NearOperands {
  const float* a0;
  const float* b0;
  int k0;
  long long a_sm, a_sk, b_sm, b_sk;
  BatchStride a_bs, b_bs;

  // ||a[m] - b[n]||^2 of batch entry (l0, l1, l2), from a0/b0, or from the kernel's own rows: the
  // whole warp computes it (warp_sq_distance), every lane with the same (m, n).
  __device__ __forceinline__ float operator()(int l0, int l1, int l2, int m, int n, const float* a_l, long long lda,
                                              const float* b_l, long long ldb, int K, int lane) const {
    if (a0 == nullptr) return warp_sq_distance(a_l + (long long)m * lda, 1, b_l + (long long)n * ldb, 1, K, lane);
    return warp_sq_distance(a0 + a_bs.offset(l0, l1, l2) + (long long)m * a_sm, a_sk,
                            b0 + b_bs.offset(l0, l1, l2) + (long long)n * b_sm, b_sk, k0, lane);
  }
};

// A lane's flagged entries, popped one at a time: each set bit b of `mask` names four entries, rows
// r, r + 8 and columns c, c + 1 from origin(b, r, c) (an MMA tile's, or a column pair's); those
// outside M x N are skipped.
template <class Origin>
struct NearEntries {
  unsigned mask;
  int M, N;
  Origin origin;
  int q = 4, r = 0, c = 0;  // entry q of the current four (row q / 2, column q % 2); 4: none

  __device__ __forceinline__ bool operator()(int& m, int& n) {
    for (;;) {
      if (q == 4) {
        if (mask == 0u) return false;
        origin(__ffs(mask) - 1, r, c);
        mask &= mask - 1u;
        q = 0;
      }
      m = r + (q >> 1) * 8;
      n = c + (q & 1);
      ++q;
      if (m < M && n < N) return true;
    }
  }
};

// The near pairs' rewrite after a tile's write, by the whole warp: while a lane holds a flagged
// entry (``next(m, n)`` pops one and returns whether it had one), the lowest such lane's (m, n)
// is broadcast, the warp sums its direct differences (NearOperands), and that lane writes
// ``store(m, n, d2)``. Every lane of the warp calls it (the ballots and shuffles are the warp's).
template <class Next, class Store>
__device__ __forceinline__ void rewrite_near_pairs(const NearOperands& ops, int l0, int l1, int l2, const float* a_l,
                                                   long long lda, const float* b_l, long long ldb, int K, int lane,
                                                   Next&& next, Store&& store) {
  int m = 0, n = 0;
  bool mine = next(m, n);
#pragma unroll 1
  for (unsigned who = near_ballot(mine); who != 0u; who = near_ballot(mine)) {
    const int src = __ffs(who) - 1;
    const int pm = near_shfl(m, src), pn = near_shfl(n, src);
    const float d2 = ops(l0, l1, l2, pm, pn, a_l, lda, b_l, ldb, K, lane);
    if (lane == src) {
      store(pm, pn, d2);
      mine = next(m, n);
    }
  }
}

// Whether an entry's expansion is a near pair's (NaN and inf compare false: they keep the
// expansion's value, as in torch.cdist's matrix-product path).
__device__ __forceinline__ bool near_pair(float dot, float na, float nb) {
  const float s = na + nb;
  return fmaf(-2.f, dot, s) < KERMAC_LIKE_NEAR_SHARE * s;
}

// The fused epilogue of one kernel-matrix entry from its dot product and the two
// squared row norms (both tensor-core kernels): ||x-y||^2 clamped at 0, sqrt,
// "d < epsilon -> 0" (epsilon <= 0: no effect, also for a negative DOT), then
// exp(-d / bw) or exp(-d^2 / (2 bw^2)) through ex2, plus the regularisation;
// of_sq_distance: the same from a squared distance (the near pairs' rewrite).
// An epilogue functor's constants (epilogue.cuh), as an empty base where the traits have none.
template <class Traits, bool kFunctor = Traits::kFunctor>
struct FunctorArgs {
  __device__ __forceinline__ void init(float, float, float) {}
};
template <class Traits>
struct FunctorArgs<Traits, true> {
  typename Traits::Epi::Args fa;
  __device__ __forceinline__ void init(float p0, float p1, float p2) { fa = Traits::Epi::args({p0, p1, p2}); }
};

// With an epilogue functor (Traits::Epi: the kernel of the squared distance, outer Noop, no enum
// epilogue) the value is Epi::value(scale d2) in place of the exponentials; p0 = bw, p1, p2 its
// hyper-parameters (the launch's bandwidth, inner_p and outer_p slots).
template <class Traits>
struct EntryEpilogue : FunctorArgs<Traits> {
  static constexpr bool kDiff = Traits::kInner == Inner::Diff;
  float laplace_scale, gauss_scale, eps, lam;

  __device__ __forceinline__ EntryEpilogue(float bw, float lam_, float epsilon, float p1 = 0.f, float p2 = 0.f) {
    this->init(bw, p1, p2);
    constexpr float kLog2e = 1.4426950408889634f;
    laplace_scale = -kLog2e / bw;
    gauss_scale = -kLog2e / (2.f * bw * bw);
    eps = epsilon > 0.f ? epsilon : -__uint_as_float(0x7f800000u);
    lam = lam_;
  }

  // plain (a constant at the call site): the caller knows that epsilon is off and
  // `regularised` is false (tiles that the regularised diagonal does not cross).
  // fma_exp (a constant at the call site): the exponential on the FMA pipe
  // (exp2_fma, math.cuh) instead of MUFU, to share the epilogue's transcendental work
  // between the two pipes.
  __device__ __forceinline__ float operator()(float dot, float na, float nb, bool regularised,
                                              bool plain = false, bool fma_exp = false) const {
    float d, d2 = 0.f;
    if constexpr (kDiff) {
      // Clamped at 0 against cancellation; NaN (a NaN coordinate, or inf - inf of the
      // expansion) stays NaN, as in torch.cdist's matrix-product path.
      d2 = math::fmax_nan(fmaf(-2.f, dot, na + nb), 0.f);
      d = Traits::kOuter == Power::Sqrt ? sqrt_approx(d2) : d2;
    } else {
      d = dot;
    }
    return tail(d, d2, regularised, plain, fma_exp);
  }

  __device__ __forceinline__ float of_sq_distance(float d2, bool regularised) const {
    return tail(Traits::kOuter == Power::Sqrt ? sqrt_approx(d2) : d2, d2, regularised, false, false);
  }

  __device__ __forceinline__ float tail(float d, float d2, bool regularised, bool plain, bool fma_exp) const {
    if (plain) {
      regularised = false;
    } else if (d < eps) {
      d = d2 = 0.f;
    }
    float y;
    if constexpr (Traits::kFunctor) {
      using E = typename Traits::Epi;
      const float z = d2 * E::scale(this->fa);
      y = fma_exp ? E::template value<true>(z, this->fa) : E::template value<false>(z, this->fa);
    } else if constexpr (Traits::kEpilogue == Epilogue::Laplace) {
      y = fma_exp ? math::exp2_fma(d * laplace_scale) : exp2_approx(d * laplace_scale);
    } else if constexpr (Traits::kEpilogue == Epilogue::Gaussian) {
      const float t = (Traits::kOuter == Power::Sqrt ? d2 : d * d) * gauss_scale;
      y = fma_exp ? math::exp2_fma(t) : exp2_approx(t);
    } else {
      y = d;
    }
    return regularised ? y + lam : y;
  }
};

// The template parameters and the operand rules common to both tensor-core
// distance kernels (DistanceMmaTraits below, DistanceWgmmaTraits in
// distance_wgmma.cuh): ||x - y||^2 = ||x||^2 + ||y||^2 - 2 x.y, or the dot product.
template <Inner kInner_, Power kOuter_, Epilogue kEpilogue_, Layout kLayoutA_, Layout kLayoutB_,
          Layout kLayoutO_, Precision kPrecision_, class T_, class Epi_ = void>
struct TensorCoreDistance {
  using T = T_;
  // An epilogue functor of the squared distance (epilogue.cuh), or void (the enum epilogue).
  using Epi = Epi_;
  static constexpr bool kFunctor = !SameType<Epi_, void>::value;
  static_assert(!kFunctor || (kInner_ == Inner::Diff && kOuter_ == Power::Noop && kEpilogue_ == Epilogue::None),
                "tensor-core distance: an epilogue functor takes Inner::Diff, outer Noop, Epilogue::None");
  static constexpr Inner kInner = kInner_;
  static constexpr Power kOuter = kOuter_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr Layout kLayoutA = kLayoutA_;
  static constexpr Layout kLayoutB = kLayoutB_;
  static constexpr Layout kLayoutO = kLayoutO_;
  static constexpr Precision kPrecision = kPrecision_;

  static_assert(kInner == Inner::Diff || kInner == Inner::Dot, "tensor-core distance: unknown Inner");
  static_assert(kInner != Inner::Diff || kOuter == Power::Noop || kOuter == Power::Sqrt,
                "tensor-core distance: Inner::Diff (inner power Square) takes outer power Noop "
                "(squared distance) or Sqrt (distance) only");
  static_assert(kInner != Inner::Dot || (kOuter == Power::Noop && kEpilogue == Epilogue::None),
                "tensor-core distance: Inner::Dot takes outer power Noop and Epilogue::None only");
  static_assert(kLayoutA == Layout::RowMajor && kLayoutB == Layout::RowMajor,
                "tensor-core distance: a and b must be RowMajor (K contiguous); make a contiguous copy "
                "or use the SIMT kernel");
};

}  // namespace mma_detail

// ------------------------------------------------------------------- traits

template <Inner kInner_, Power kOuter_, Epilogue kEpilogue_, Layout kLayoutA_, Layout kLayoutB_,
          Layout kLayoutO_, Precision kPrecision_, class T_, class Epi_ = void>
struct DistanceMmaTraits : mma_detail::TensorCoreDistance<kInner_, kOuter_, kEpilogue_, kLayoutA_, kLayoutB_,
                                                          kLayoutO_, kPrecision_, T_, Epi_> {
  // (T_ and kPrecision_ below: the base's members are not visible by plain name here)
  static constexpr bool kIsFloat = SameType<T_, float>::value;
  static constexpr bool kIs16 =
      SameType<T_, float16>::value || SameType<T_, bfloat16>::value;

  static_assert(kIsFloat || kIs16,
                "DistanceMmaTraits: T must be float, kermac_like::float16 or kermac_like::bfloat16");
  static_assert(kIsFloat == (kPrecision_ == Precision::Tf32x3 || kPrecision_ == Precision::Tf32),
                "DistanceMmaTraits: Precision Tf32x3/Tf32 take T = float, Native16 takes "
                "T = float16 or bfloat16");
  static_assert(kIs16 == (kPrecision_ == Precision::Native16),
                "DistanceMmaTraits: Precision::Native16 takes T = float16 or bfloat16");

  // Block tile (kBlockM x kBlockN) of 8 warps in a 2 x 4 grid, 64 x 64 per warp.
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kWarpsM = 2;
  static constexpr int kWarpsN = 4;
  static constexpr int kWarpM = kBlockM / kWarpsM;  // 64
  static constexpr int kWarpN = kBlockN / kWarpsN;  // 64
  static constexpr int kTilesM = kWarpM / 16;       // MMA tiles per warp along M (4)
  static constexpr int kTilesN = kWarpN / 8;        // MMA tiles per warp along N (8)

  // One k-tile is 64 bytes of every row: 16 floats or 32 sixteen-bit values,
  // two MMA k-steps (k8 for TF32, k16 for 16-bit) of 32 bytes each.
  static constexpr int kRowBytes = 64;
  static constexpr int kBlockK = kRowBytes / (int)sizeof(T_);
  static constexpr int kChunkElems = 16 / (int)sizeof(T_);
  static constexpr int kStages = 4;
  static constexpr int kStageBytes = (kBlockM + kBlockN) * kRowBytes;  // 24 KiB
  static constexpr int kNormBytes = (kBlockM + kBlockN) * 4;
  // 99840 bytes: fits the 99 KiB opt-in limit of sm_86/sm_89 as well as sm_80/sm_90.
  static constexpr int kSmemBytes = kStages * kStageBytes + kNormBytes;
  // Rows of consecutive tiles along M that share their B tiles in L2.
  static constexpr int kGroupM = 16;

  static_assert(kThreads == 32 * kWarpsM * kWarpsN, "warp grid does not match kThreads");
  static_assert(kBlockM * kRowBytes / 16 % kThreads == 0, "A tile chunks per thread");
  static_assert(kBlockN * kRowBytes / 16 % kThreads == 0, "B tile chunks per thread");
};

// ------------------------------------------------------------------- kernel
//
// Shared memory, one stage (kStageBytes):
//   A tile (kBlockM rows, 64 bytes each), then B tile (kBlockN rows, 64 bytes).
//   A row is 4 chunks of 16 bytes; logical chunk c of row r sits at physical
//   chunk c ^ swz(r), swz(r) = ((r >> 1) & 1) << 1, so that the 8-byte fragment
//   loads below are free of bank conflicts (each half-warp touches 4 rows x 32
//   bytes = all 32 banks once) and the 16-byte cp.async writes of 8 rows cover
//   512 contiguous bytes.
// After the stages: float norm_a[kBlockM], norm_b[kBlockN] (squared row norms).
//
// K order inside an MMA: the sum over k does not care which data column feeds
// which MMA k slot, as long as A and B use the same assignment. In k-step s of
// a k-tile, thread (g, t) loads the 8 bytes at logical byte 32 s + 8 t of each
// of its rows with one LDS.64: the data columns 8 s + 2 t, 8 s + 2 t + 1
// (TF32) or 16 s + 4 t .. 16 s + 4 t + 3 (16-bit). The first word goes to the
// MMA's k slot t (TF32: a0/a1, b0; 16-bit: k 2t, 2t+1: a0/a1, b0), the second
// to k slot t + 4 (TF32: a2/a3, b1; 16-bit: k 2t+8, 2t+9: a2/a3, b1), for A and
// B alike, so every data column of the k-tile is multiplied exactly once.
namespace mma_detail {

// The block tile's dot products and squared row norms: the k-loop of distance_mma_kernel, and of
// topk_mma_kernel tile after tile. acc: (MMA tile m, MMA tile n, fragment d0..d3) of the tile at
// (m0, n0) of a_l (M x K) and b_l (N x K); for Inner::Diff, the squared norms of the tile's rows
// land in norm_a[kBlockM] and norm_b[kBlockN] after the stages. Ends with a barrier: the norms
// are visible to every thread and the stages are free.
template <class Traits>
__device__ __forceinline__ void block_tile_product(const typename Traits::T* a_l, const typename Traits::T* b_l,
                                                   int M, int N, int K, long long lda, long long ldb, int m0,
                                                   int n0, unsigned char* smem,
                                                   float (&acc)[Traits::kTilesM][Traits::kTilesN][4]) {
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kTilesM = Traits::kTilesM, kTilesN = Traits::kTilesN;
  constexpr int kStages = Traits::kStages, kStageBytes = Traits::kStageBytes;
  constexpr int kRowBytes = Traits::kRowBytes, kBlockK = Traits::kBlockK;
  constexpr int kChunkElems = Traits::kChunkElems;
  constexpr bool kDiff = Traits::kInner == Inner::Diff;
  constexpr int kChunksA = kBlockM * kRowBytes / 16 / Traits::kThreads;  // 2
  constexpr int kChunksB = kBlockN * kRowBytes / 16 / Traits::kThreads;  // 4
  constexpr int kRowsPerPass = Traits::kThreads / 4;                     // 64 rows per chunk pass

  float* norm_a = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // (kBlockM)
  float* norm_b = norm_a + kBlockM;                                        // (kBlockN)
  const unsigned smem_base = smem_u32(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / Traits::kWarpsN, wn = warp % Traits::kWarpsN;

  // Copy assignment: thread tid copies chunk (tid % 4) of rows tid / 4 + 64 u.
  const int copy_row = tid >> 2, copy_chunk = tid & 3;
  const unsigned copy_dst = (unsigned)(copy_row * kRowBytes +
                                       ((copy_chunk ^ (((copy_row >> 1) & 1) << 1)) * 16));
  // (64 u rows further down keep the same swizzle: 64 is a multiple of 4.)

  // Fragment-load offsets (bytes) in a stage: row part, and the chunk part of
  // k-step s (same for every row of this thread: rows differ by multiples of 8).
  const int swz = ((g >> 1) & 1) << 1;
  const int frag_a_row = (wm * Traits::kWarpM + g) * kRowBytes;
  const int frag_b_row = kBlockM * kRowBytes + (wn * Traits::kWarpN + g) * kRowBytes;
  const int frag_col[2] = {(((0 + (t >> 1)) ^ swz) * 16) + (t & 1) * 8,
                           (((2 + (t >> 1)) ^ swz) * 16) + (t & 1) * 8};

  const int num_k_tiles = ceil_div(K, kBlockK);

  // Global sources of this thread's chunks (k-tile 0); nullptr where the
  // row is out of range (then the chunk is zero-filled).
  const T* src_a[kChunksA];
  const T* src_b[kChunksB];
#pragma unroll
  for (int u = 0; u < kChunksA; ++u) {
    const int row = m0 + copy_row + u * kRowsPerPass;
    src_a[u] = row < M ? a_l + (long long)row * lda + copy_chunk * kChunkElems : nullptr;
  }
#pragma unroll
  for (int u = 0; u < kChunksB; ++u) {
    const int row = n0 + copy_row + u * kRowsPerPass;
    src_b[u] = row < N ? b_l + (long long)row * ldb + copy_chunk * kChunkElems : nullptr;
  }

  auto load_tile = [&](int stage, int kt) {
    const int k_left = K - kt * kBlockK - copy_chunk * kChunkElems;  // elements left in the row
    const int bytes = k_left <= 0 ? 0 : (k_left >= kChunkElems ? 16 : k_left * (int)sizeof(T));
    const unsigned dst = smem_base + stage * kStageBytes + copy_dst;
#pragma unroll
    for (int u = 0; u < kChunksA; ++u) {
      const bool ok = src_a[u] != nullptr && bytes > 0;
      cp_async_16(dst + u * kRowsPerPass * kRowBytes, ok ? src_a[u] + kt * kBlockK : a_l,
                  ok ? bytes : 0);
    }
#pragma unroll
    for (int u = 0; u < kChunksB; ++u) {
      const bool ok = src_b[u] != nullptr && bytes > 0;
      cp_async_16(dst + kBlockM * kRowBytes + u * kRowsPerPass * kRowBytes,
                  ok ? src_b[u] + kt * kBlockK : b_l, ok ? bytes : 0);
    }
  };

#pragma unroll
  for (int i = 0; i < kTilesM; ++i)
#pragma unroll
    for (int j = 0; j < kTilesN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  // Partial squared norms of rows copy_row + 64 u, over this thread's chunks.
  float sq_a[kChunksA], sq_b[kChunksB];
#pragma unroll
  for (int u = 0; u < kChunksA; ++u) sq_a[u] = 0.f;
#pragma unroll
  for (int u = 0; u < kChunksB; ++u) sq_b[u] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // k-tile kt has landed (for this thread) ...
    __syncthreads();               // ... for all threads; stage (kt - 1) % kStages is free
    {
      const int kn = kt + kStages - 1;
      if (kn < num_k_tiles) load_tile(kn % kStages, kn);
      cp_async_commit();
    }
    const unsigned char* stage = smem + (kt % kStages) * kStageBytes;

    if constexpr (kDiff) {
      // Squared norms in fp32 from the raw data (not the TF32 split): the
      // thread reads its copy chunks back (any chunk order: a sum).
#pragma unroll
      for (int u = 0; u < kChunksA; ++u)
        sq_a[u] += chunk_sumsq<T>(
            *reinterpret_cast<const uint4*>(stage + (tid + u * Traits::kThreads) * 16));
#pragma unroll
      for (int u = 0; u < kChunksB; ++u)
        sq_b[u] += chunk_sumsq<T>(*reinterpret_cast<const uint4*>(
            stage + kBlockM * kRowBytes + (tid + u * Traits::kThreads) * 16));
    }

#pragma unroll
    for (int s = 0; s < 2; ++s) {
      // A fragments of the warp's kTilesM MMA tiles for k-step s.
      unsigned a_big[kTilesM][4], a_small[kTilesM][4];
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
        const uint2 r0 =
            *reinterpret_cast<const uint2*>(stage + frag_a_row + (i * 16) * kRowBytes + frag_col[s]);
        const uint2 r1 = *reinterpret_cast<const uint2*>(stage + frag_a_row +
                                                         (i * 16 + 8) * kRowBytes + frag_col[s]);
        const unsigned raw[4] = {r0.x, r1.x, r0.y, r1.y};  // a0 a1 a2 a3
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if constexpr (Traits::kPrecision == Precision::Tf32x3) {
            // Infinities kept apart from NaN, as torch's products have them (+6% on
            // cdist p=2 30000^2 x 1024 with KERMAC_LIKE_WGMMA=0 on an H200, 28.7 ->
            // 30.5 ms: the fragments are split once per warp that reads them).
            split_tf32x3(raw[r], a_big[i][r], a_small[i][r]);
          } else if constexpr (Traits::kPrecision == Precision::Tf32) {
            a_big[i][r] = tf32_rna(raw[r]);
          } else {
            a_big[i][r] = raw[r];
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
        const uint2 rb =
            *reinterpret_cast<const uint2*>(stage + frag_b_row + (j * 8) * kRowBytes + frag_col[s]);
        if constexpr (Traits::kPrecision == Precision::Tf32x3) {
          unsigned b0, b1, b0s, b1s;
          split_tf32x3(rb.x, b0, b0s);
          split_tf32x3(rb.y, b1, b1s);
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) {
            // The k8 step's three products in a fresh partial sum (small terms first: they are
            // the least significant), added to the running sum in float32: the tensor cores'
            // accumulation truncates, and one running sum over K would lose about 0.35 K 2^-24
            // of its magnitude in one direction (bench/notes/data_zoo.md, session 22).
            // Distances only: DOT products keep one running sum (no registers to spare there), as
            // does the sm_90 build (16 bytes spilled in the shipped build: there the wgmma kernel
            // takes every call whose K spans more than one k-tile, plan.distance._few_tiles).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            constexpr bool kPartial = false;
#else
            constexpr bool kPartial = kDiff;
#endif
            if constexpr (kPartial) {
              float part[4];
              mma_tf32_c(part, a_small[i], b0, b1, 0.f, 0.f);
              mma_tf32(part, a_big[i], b0s, b1s);
              mma_tf32(part, a_big[i], b0, b1);
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[i][j][r] += part[r];
            } else {
              mma_tf32(acc[i][j], a_small[i], b0, b1);
              mma_tf32(acc[i][j], a_big[i], b0s, b1s);
              mma_tf32(acc[i][j], a_big[i], b0, b1);
            }
          }
        } else if constexpr (Traits::kPrecision == Precision::Tf32) {
          const unsigned b0 = tf32_rna(rb.x), b1 = tf32_rna(rb.y);
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) mma_tf32(acc[i][j], a_big[i], b0, b1);
        } else {
#pragma unroll
          for (int i = 0; i < kTilesM; ++i) Mma16<T>::run(acc[i][j], a_big[i], rb.x, rb.y);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be left; drain them anyway

  if constexpr (kDiff) {
    store_quad_norms<kRowsPerPass>(sq_a, norm_a, copy_row, copy_chunk);
    store_quad_norms<kRowsPerPass>(sq_b, norm_b, copy_row, copy_chunk);
  }
  // Norms visible to all; every warp is past its last read of the stages,
  // so the next batch entry may refill them.
  __syncthreads();
}

}  // namespace mma_detail

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    distance_mma_kernel(const typename Traits::T* __restrict__ a,
                        const typename Traits::T* __restrict__ b, typename Traits::T* __restrict__ out,
                        int M, int N, int K, long long lda, long long ldb, long long ldo, int batch,
                        int batch_n1, int batch_n2, long long a_bs0, long long a_bs1, long long a_bs2,
                        long long b_bs0, long long b_bs1, long long b_bs2, long long o_bs0,
                        long long o_bs1, long long o_bs2, const float* inner_p_ptr,
                        long long inner_p_bs0, long long inner_p_bs1, long long inner_p_bs2,
                        float inner_p, const float* outer_p_ptr, long long outer_p_bs0,
                        long long outer_p_bs1, long long outer_p_bs2, float outer_p,
                        const float* bw_ptr, long long bw_bs0, long long bw_bs1, long long bw_bs2,
                        float bandwidth, const float* reg_ptr, long long reg_bs0, long long reg_bs1,
                        long long reg_bs2, float regularization, long long reg_diag, float epsilon,
                        const float* __restrict__ a0 = nullptr, const float* __restrict__ b0 = nullptr,
                        int k0 = 0, long long a0_sm = 0, long long a0_sk = 0, long long b0_sm = 0,
                        long long b0_sk = 0, long long a0_bs0 = 0, long long a0_bs1 = 0, long long a0_bs2 = 0,
                        long long b0_bs0 = 0, long long b0_bs1 = 0, long long b0_bs2 = 0) {
  using T = typename Traits::T;
  using namespace mma_detail;
  const NearOperands near_ops{a0, b0, k0, a0_sm, a0_sk, b0_sm, b0_sk, {a0_bs0, a0_bs1, a0_bs2}, {b0_bs0, b0_bs1, b0_bs2}};
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kTilesM = Traits::kTilesM, kTilesN = Traits::kTilesN;
  constexpr int kStages = Traits::kStages, kStageBytes = Traits::kStageBytes;
  constexpr bool kDiff = Traits::kInner == Inner::Diff;

  extern __shared__ __align__(128) unsigned char smem[];
  float* norm_a = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // (kBlockM)
  float* norm_b = norm_a + kBlockM;                                        // (kBlockN)

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / Traits::kWarpsN, wn = warp % Traits::kWarpsN;

  // Block tile, grouped so that kGroupM consecutive M tiles sweep N together
  // (B tiles stay in L2 while they are reused).
  const int tiles_m = gridDim.x, tiles_n = gridDim.y;
  const int linear = blockIdx.y * tiles_m + blockIdx.x;
  const int group_size = Traits::kGroupM * tiles_n;
  const int first_m = (linear / group_size) * Traits::kGroupM;
  const int rows_in_group = min(tiles_m - first_m, Traits::kGroupM);
  const int in_group = linear % group_size;
  const int m0 = (first_m + in_group % rows_in_group) * kBlockM;
  const int n0 = (in_group / rows_in_group) * kBlockN;

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride a_stride{a_bs0, a_bs1, a_bs2}, b_stride{b_bs0, b_bs1, b_bs2},
      o_stride{o_bs0, o_bs1, o_bs2};
  const HyperParam bw_param{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth};
  const HyperParam reg_param{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};
  const bool reg_on = reg_ptr != nullptr || regularization != 0.f;
  (void)inner_p_ptr, (void)inner_p_bs0, (void)inner_p_bs1, (void)inner_p_bs2, (void)inner_p;
  (void)outer_p_ptr, (void)outer_p_bs0, (void)outer_p_bs1, (void)outer_p_bs2, (void)outer_p;

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    int l0, l1, l2;
    shape.split(l, l0, l1, l2);
    const T* a_l = a + a_stride.offset(l0, l1, l2);
    const T* b_l = b + b_stride.offset(l0, l1, l2);
    T* out_l = out + o_stride.offset(l0, l1, l2);

    float acc[kTilesM][kTilesN][4];  // (MMA tile m, MMA tile n, fragment d0..d3)
    block_tile_product<Traits>(a_l, b_l, M, N, K, lda, ldb, m0, n0, smem, acc);

    // ------------------------------------------------------------ epilogue
    const EntryEpilogue<Traits> finish(
        bw_param.at(l0, l1, l2), reg_on ? reg_param.at(l0, l1, l2) : 0.f, epsilon,
        Traits::kFunctor ? HyperParam{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p}.at(l0, l1, l2) : 0.f,
        Traits::kFunctor ? HyperParam{outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p}.at(l0, l1, l2) : 0.f);
    const bool vec_out = Traits::kLayoutO == Layout::RowMajor &&
                         ((unsigned long long)out_l % (2 * sizeof(T))) == 0 && (ldo % 2) == 0;

    // Tile-local row and column of this thread's first accumulator. The empty
    // asm keeps the compiler from hoisting the epilogue's 128 addresses out of
    // the batch loop (they would stay live, i.e. spilled, across the k-loop).
    int row0 = wm * Traits::kWarpM + g, col0 = wn * Traits::kWarpN + 2 * t;
    asm volatile("" : "+r"(row0), "+r"(col0));
    float na[kTilesM][2];   // squared norms of rows row0 + 16 i + 8 h
    int reg_col[kTilesM][2];  // tile-local column regularised in that row, or -1
#pragma unroll
    for (int i = 0; i < kTilesM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + i * 16 + h * 8;
        na[i][h] = kDiff ? norm_a[row] : 0.f;
        const long long c = (long long)(m0 + row) + reg_diag - n0;
        reg_col[i][h] = reg_on && c >= 0 && c < kBlockN ? (int)c : -1;
      }

    // Self distances: where row m of a is row m of b, set dot = (na + nb) / 2
    // on the diagonal, so that na + nb - 2 dot is exactly 0 there. Only the
    // blocks that meet the diagonal take this branch.
    if (kDiff && a_l == b_l && lda == ldb && m0 < n0 + kBlockN && n0 < m0 + kBlockM) {
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
        const int col = col0 + j * 8;
        const float2 nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
        for (int i = 0; i < kTilesM; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int diag = m0 + row0 + i * 16 + h * 8 - n0;  // tile-local column of m == n
            if (diag == col) acc[i][j][2 * h] = 0.5f * (na[i][h] + nb.x);
            if (diag == col + 1) acc[i][j][2 * h + 1] = 0.5f * (na[i][h] + nb.y);
          }
      }
    }

    // Near pairs (above): bit j kTilesM + i of near_mask when one of the four entries of MMA tile
    // (i, j) that this thread holds is near; the four are rewritten after the tile (one register).
    constexpr bool kNear = kDiff && Traits::kPrecision == Precision::Tf32x3;
    static_assert(kTilesM * kTilesN <= 32, "distance_mma_kernel: one near-pair bit per MMA tile");
    unsigned near_mask = 0u;
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
      const int col = col0 + j * 8;  // columns col, col + 1 of MMA tile j
      const int n = n0 + col;
      if (n >= N) continue;
      float2 nb = make_float2(0.f, 0.f);
      if constexpr (kDiff) nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g and g + 8 of MMA tile i
          const int m = m0 + row0 + i * 16 + h * 8;
          if (m >= M) continue;
          if constexpr (kNear) {
            near_mask |= (unsigned)(near_pair(acc[i][j][2 * h], na[i][h], nb.x) |
                                    near_pair(acc[i][j][2 * h + 1], na[i][h], nb.y)) << (j * kTilesM + i);
          }
          const float y0 = finish(acc[i][j][2 * h], na[i][h], nb.x, reg_col[i][h] == col);
          const float y1 = finish(acc[i][j][2 * h + 1], na[i][h], nb.y, reg_col[i][h] == col + 1);
          if constexpr (Traits::kLayoutO == Layout::RowMajor) {
            T* p = out_l + (long long)m * ldo + n;
            if (n + 1 < N) {
              if (vec_out) {
                store_two<T>(p, y0, y1);
              } else {
                store_one<T>(p, y0);
                store_one<T>(p + 1, y1);
              }
            } else {
              store_one<T>(p, y0);
            }
          } else {
            T* p = out_l + (long long)n * ldo + m;
            store_one<T>(p, y0);
            if (n + 1 < N) store_one<T>(p + ldo, y1);
          }
        }
      }
    }
    if constexpr (kNear) {  // the near pairs rewritten from their direct differences, warp by warp
      auto tile_origin = [&](int tile, int& r, int& c) {  // MMA tile (tile % kTilesM, tile / kTilesM)
        r = m0 + row0 + (tile % kTilesM) * 16;
        c = n0 + col0 + (tile / kTilesM) * 8;
      };
      NearEntries<decltype(tile_origin)> next{near_mask, M, N, tile_origin};
      auto store = [&](int m, int n, float d2) {
        const bool regularised = reg_on && (long long)m + reg_diag == n;
        store_one<T>(Traits::kLayoutO == Layout::RowMajor ? out_l + (long long)m * ldo + n
                                                          : out_l + (long long)n * ldo + m,
                     finish.of_sq_distance(d2, regularised));
      };
      rewrite_near_pairs(near_ops, l0, l1, l2, a_l, lda, b_l, ldb, K, lane, next, store);
    }
  }
}

}  // namespace kermac_like
