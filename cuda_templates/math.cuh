// Fast, accurate fp32 power / exp2 / log2 helpers shared by the kernel families.
//
// Two pipes can evaluate 2^t on an SM:
//   * MUFU.EX2 (ex2_approx): 1 issue slot, but the MUFU pipe runs at 1/8 of the
//     fp32 rate (16 lanes/clk/SM), so a warp-wide MUFU occupies it for 8 clocks;
//   * the FMA pipe (exp2_fma_split): ~10 issue slots of FFMA/FADD/FMNMX/SHL.
// A kernel that needs one log2 and one exp2 per element (|d|^p) is MUFU-bound
// (16 clk per warp-element) unless it sends a fixed fraction of its exp2s to
// the FMA pipe; see bench/NOTES.md (distance section) for the balance.
//
// Accuracy (relative, measured against float64 by a CPU emulation of the exact
// fp32 operation sequence, see tests/test_templates_distance.py):
//   ex2_approx            ~2 ulp (PTX ex2.approx.ftz.f32, MUFU.EX2)
//   lg2_approx            ~2^-22 (PTX lg2.approx.ftz.f32, MUFU.LG2)
//   exp2_fma_split        <= 2e-7 for t in [-126, 127.4] (1.6e-7 on [-0.5, 0.5])
// so |x|^p = 2^(p*log2|x|) is good to ~1e-6 relative per term, most of it the
// fp32 rounding of log2|x| (the same on both pipes).
//
// Self-contained on purpose (no <cuda_runtime.h>, no CUDA math headers): the
// header compiles under NVRTC with only this directory on the include path.
// The `#else` branches give plain C++ equivalents so the tests can execute the
// kernels on the CPU; NVRTC always takes the `__CUDA_ARCH__` branch.
#pragma once

#include "common.cuh"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace kermac_like {
namespace math {

// ---------------------------------------------------------------- bit casts
__device__ __forceinline__ int float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(x);
#else
  int i;
  std::memcpy(&i, &x, 4);
  return i;
#endif
}

__device__ __forceinline__ float bits_float(int i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float x;
  std::memcpy(&x, &i, 4);
  return x;
#endif
}

// ------------------------------------------------------------- MUFU (1 op)
// log2(x) for x >= 0; flushes denormal x to 0, and log2(0) = -inf.
__device__ __forceinline__ float lg2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return x < 1.17549435e-38f ? -INFINITY : std::log2(x);
#endif
}

// 2^t; 2^-inf = 0, denormal results flushed to 0.
__device__ __forceinline__ float ex2_approx(float t) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
#else
  float y = std::exp2(t);
  return y < 1.17549435e-38f ? 0.0f : y;
#endif
}

// Round-to-nearest fp32 add / subtract / fma that the compiler may not contract or
// reorder (__fadd_rn etc.), with plain C++ equivalents for the host emulations.
__device__ __forceinline__ float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__device__ __forceinline__ float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

__device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// fp32 square root, correctly rounded (the host emulation: std::sqrt, also correctly rounded).
__device__ __forceinline__ float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// sqrt(x) on MUFU (relative error ~2^-23); denormal x flushed to 0.
__device__ __forceinline__ float sqrt_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return x < 1.17549435e-38f ? 0.0f : std::sqrt(x);
#endif
}

// 1/x and 1/sqrt(x) on MUFU (~1 ulp; denormals flushed).
__device__ __forceinline__ float rcp_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / x;
#endif
}

__device__ __forceinline__ float rsqrt_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / std::sqrt(x);
#endif
}

// ----------------------------------------------------- FMA-pipe exp2 (no MUFU)
// 2^f on [-0.5, 0.5]: degree-5 polynomial, c0 = 1 exactly, coefficients fitted
// for relative error and re-tuned after rounding to fp32 (Horner in fp32 with
// FMA: max relative error 1.6e-7).
constexpr float kExp2C1 = 0.6931470036506653f;
constexpr float kExp2C2 = 0.24022245407104492f;
constexpr float kExp2C3 = 0.05550733208656311f;
constexpr float kExp2C4 = 0.009671512991189957f;
constexpr float kExp2C5 = 0.001326472731307149f;

// 1.5 * 2^23 + 127: adding it to t in [-2^21, 2^21] rounds t to the nearest
// integer n and leaves n + 127 (the biased exponent of 2^n) in the low mantissa
// bits of the sum.
constexpr float kExp2Magic = 12583039.0f;

// 2^(x*y) = mant * scale, for x*y in [-127, 128] (callers clamp; the product is
// formed exactly inside the FMAs, never rounded on its own).
//   scale = 2^n with n = round(x*y): the biased exponent n + 127 (0..255) is
//           shifted into place, so n = -127 gives scale = +0 (2^t underflows to
//           exactly 0) and n = 128 gives +inf;
//   mant  = 2^f, f = x*y - n in [-0.5, 0.5].
// Keeping the two factors apart lets the caller fuse the final multiply into
// its accumulation: acc = fma(mant, scale, acc).  Cost: 3 + 5 FFMA/FADD + 1 SHL.
__device__ __forceinline__ void exp2_fma_split(float x, float y, float& mant, float& scale) {
#if defined(__CUDA_ARCH__)
  const float j = __fmaf_rn(x, y, kExp2Magic);
  const float n = __fsub_rn(j, kExp2Magic);
  const float f = __fmaf_rn(x, y, -n);
  float q = __fmaf_rn(kExp2C5, f, kExp2C4);
  q = __fmaf_rn(q, f, kExp2C3);
  q = __fmaf_rn(q, f, kExp2C2);
  q = __fmaf_rn(q, f, kExp2C1);
  q = __fmaf_rn(q, f, 1.0f);
#else
  const float j = std::fma(x, y, kExp2Magic);
  const float n = j - kExp2Magic;
  const float f = std::fma(x, y, -n);
  float q = std::fma(kExp2C5, f, kExp2C4);
  q = std::fma(q, f, kExp2C3);
  q = std::fma(q, f, kExp2C2);
  q = std::fma(q, f, kExp2C1);
  q = std::fma(q, f, 1.0f);
#endif
  mant = q;
  // The low 9 bits of j's pattern are n + 127 (mod 512); << 23 drops the rest.
  scale = bits_float(static_cast<int>(static_cast<unsigned>(float_bits(j)) << 23));
}

// ------------------------------------------------- NaN-propagating min / max
// fmaxf/fminf return the other operand when one is NaN (IEEE maxNum), so a
// clamp written with them turns NaN into a bound: a NaN input would leave a
// finite (wrong) result. max.NaN / min.NaN (PTX ISA 7.0, sm_80+) return NaN
// when either operand is NaN; in SASS they are the same single FMNMX (with its
// .NAN flag), so they cost exactly what fmaxf/fminf cost.
__device__ __forceinline__ float fmax_nan(float x, float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return (std::isnan(x) || std::isnan(y)) ? NAN : std::fmax(x, y);
#endif
}

__device__ __forceinline__ float fmin_nan(float x, float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return (std::isnan(x) || std::isnan(y)) ? NAN : std::fmin(x, y);
#endif
}

// x clamped to [lo, hi]; NaN stays NaN.
__device__ __forceinline__ float clampf(float x, float lo, float hi) {
  return fmin_nan(fmax_nan(x, lo), hi);
}

// 2^t on the FMA pipe for any t: -inf -> 0, +inf -> inf, NaN -> NaN (the clamp
// keeps NaN; exp2_fma_split of NaN gives a NaN mantissa, and NaN * scale is NaN
// whatever the scale bits hold).
__device__ __forceinline__ float exp2_fma(float t) {
  float mant, scale;
  exp2_fma_split(clampf(t, -127.0f, 128.0f), 1.0f, mant, scale);
  return mant * scale;
}

// ---------------------------------------------------------------- |x|^p
// Per-launch constants of |x|^p = 2^(p * log2|x|) on the FMA pipe: log2|x| is
// clamped to [lo, hi] = [-127/p, 128/p] so that p*log2|x| stays in the range
// exp2_fma_split handles: x == 0 (log2 = -inf) and results below 2^-126.5 give
// exactly 0, results of 2^127.5 and up give +inf, NaN stays NaN (like torch's
// |NaN|^p).  Requires p > 0.
struct PowArgs {
  float p, lo, hi;
};

__device__ __forceinline__ PowArgs make_pow_args(float p) {
  PowArgs a;
  a.p = p;
  a.lo = -127.0f / p;
  a.hi = 128.0f / p;
  return a;
}

// |x|^p with both transcendental steps on MUFU (2 MUFU, 1 FMUL).  p > 0:
// 0^p = ex2(p * -inf) = 0.
__device__ __forceinline__ float abs_pow_mufu(float x, float p) {
  return ex2_approx(p * lg2_approx(fabsf(x)));
}

// acc + |x|^p with the exp2 on the FMA pipe (1 MUFU, 2 FMNMX, 9 FFMA/FADD, 1 SHL).
__device__ __forceinline__ float abs_pow_fma_acc(float acc, float x, const PowArgs& a) {
  const float lg = clampf(lg2_approx(fabsf(x)), a.lo, a.hi);
  float mant, scale;
  exp2_fma_split(a.p, lg, mant, scale);
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(mant, scale, acc);
#else
  return std::fma(mant, scale, acc);
#endif
}

__device__ __forceinline__ float abs_pow_fma(float x, const PowArgs& a) {
  return abs_pow_fma_acc(0.0f, x, a);
}

}  // namespace math

// ------------------------------------------- exact SIMT inner operator, epilogue
// Shared by the exact fp32 SIMT kernels (distance.cuh, distance_lowk.cuh). Tr
// provides kInner, kInnerPow, kOuterPow, kEpilogue and exp2_on_fma(i, j) (which
// micro-tile elements of a fractional p take the FMA-pipe exp2).
namespace exact {

// acc + inner(x, y) for micro-tile element (i, j).
template <class Tr>
__device__ __forceinline__ float accumulate(float acc, float x, float y, int i, int j,
                                            const math::PowArgs& pw) {
  if constexpr (Tr::kInner == Inner::Dot) {
    return math::fma_rn(x, y, acc);
  } else {
    const float d = math::sub_rn(x, y);
    if constexpr (Tr::kInnerPow == Power::Abs) {
      return math::add_rn(acc, fabsf(d));
    } else if constexpr (Tr::kInnerPow == Power::Square) {
      return math::fma_rn(d, d, acc);
    } else {  // Power::Pow
      if (Tr::exp2_on_fma(i, j)) return math::abs_pow_fma_acc(acc, d, pw);
      return math::add_rn(acc, math::abs_pow_mufu(d, pw.p));
    }
  }
}

// ----------------------------------------------------------------- epilogue
struct EpilogueArgs {
  float inv_outer_p;  // 1 / outer_p (Power::Pow)
  math::PowArgs outer;  // acc^(1 / outer_p) on the FMA pipe (Power::Pow, finish_mufu)
  float epsilon;
  float exp_scale;    // Laplace: -1/bw; Gaussian: -1/(2 bw^2)
  float exp2_scale;   // exp_scale * log2(e) (finish_mufu)
};

// y = epilogue(outer(acc)) with the epsilon cut, before regularisation.
template <class Tr>
__device__ __forceinline__ float finish(float acc, const EpilogueArgs& e) {
  if constexpr (Tr::kOuterPow == Power::Sqrt && Tr::kEpilogue == Epilogue::Gaussian) {
    // exp(-d^2 / (2 bw^2)) with d^2 = acc: skip the square root (exact and
    // cheaper) unless the epsilon cut needs d itself.
    float d2 = acc;
    if (e.epsilon > 0.0f && sqrtf(acc) < e.epsilon) d2 = 0.0f;
    return expf(d2 * e.exp_scale);
  } else {
    float d = acc;
    if constexpr (Tr::kOuterPow == Power::Sqrt) d = sqrtf(acc);
    if constexpr (Tr::kOuterPow == Power::Pow) d = powf(acc, e.inv_outer_p);
    // epsilon <= 0 disables the cut: distances are >= 0 anyway, and a dot
    // product's negative values must survive the default epsilon of 0.
    if (e.epsilon > 0.0f && d < e.epsilon) d = 0.0f;
    if constexpr (Tr::kEpilogue == Epilogue::Laplace) d = expf(d * e.exp_scale);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = expf((d * d) * e.exp_scale);
    return d;
  }
}

// finish() with the square root and the exponential on MUFU (sqrt.approx, ex2.approx
// of the argument times log2(e): ~2 instructions instead of ~8-10 each; ~1e-7 relative
// for exponents of order 1, denormal results flushed to 0), and the outer power as the
// inner one is taken (abs_pow_fma: one MUFU.LG2 and the FMA-pipe exp2, the product
// p * log2 formed inside the FMAs; ~3e-7 relative, a sum below 2^-126 gives 0) instead of
// powf, whose ~40 instructions inlined 64 times per tile made half the compile time of a
// low-K p-norm kernel (bench/notes/jit.md). Same epsilon and ordering.
template <class Tr>
__device__ __forceinline__ float finish_mufu(float acc, const EpilogueArgs& e) {
  if constexpr (Tr::kOuterPow == Power::Sqrt && Tr::kEpilogue == Epilogue::Gaussian) {
    float d2 = acc;
    if (e.epsilon > 0.0f && math::sqrt_approx(acc) < e.epsilon) d2 = 0.0f;
    return math::ex2_approx(d2 * e.exp2_scale);
  } else {
    float d = acc;
    if constexpr (Tr::kOuterPow == Power::Sqrt) d = math::sqrt_approx(acc);
    if constexpr (Tr::kOuterPow == Power::Pow) d = math::abs_pow_fma(acc, e.outer);
    if (e.epsilon > 0.0f && d < e.epsilon) d = 0.0f;
    if constexpr (Tr::kEpilogue == Epilogue::Laplace) d = math::ex2_approx(d * e.exp2_scale);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = math::ex2_approx((d * d) * e.exp2_scale);
    return d;
  }
}

// The epilogue constants of batch entry `index` (hyper-parameters read from the
// kernel's DistanceBatchArgs).
template <class Tr, class Args>
__device__ __forceinline__ EpilogueArgs epilogue_args(const Args& args, const BatchIndex& index, float epsilon) {
  EpilogueArgs ea;
  ea.epsilon = epsilon;
  ea.inv_outer_p = 0.0f;
  ea.outer = math::PowArgs{0.0f, 0.0f, 0.0f};
  ea.exp_scale = 0.0f;
  if constexpr (Tr::kOuterPow == Power::Pow) {
    ea.inv_outer_p = 1.0f / args.outer_p.at(index);
    ea.outer = math::make_pow_args(ea.inv_outer_p);
  }
  if constexpr (Tr::kEpilogue == Epilogue::Laplace) ea.exp_scale = -1.0f / args.bandwidth.at(index);
  if constexpr (Tr::kEpilogue == Epilogue::Gaussian) {
    const float bw = args.bandwidth.at(index);
    ea.exp_scale = -0.5f / (bw * bw);
  }
  ea.exp2_scale = ea.exp_scale * 1.4426950408889634f;
  return ea;
}

}  // namespace exact

}  // namespace kermac_like
