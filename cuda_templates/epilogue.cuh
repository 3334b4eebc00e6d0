// Epilogue functors: the kernel value as a function of the squared l2 distance, handed to a
// family's mainloop as a template parameter (as CUTLASS hands an epilogue visitor to any
// mainloop, FlashAttention-3 its epilogue to its mainloop). A mainloop that sums (x_k - y_k)^2
// into r2 serves every functor here; a new kernel is one functor (its value and its derivative),
// not an edit of each template.
//
// A functor E (all members static, __device__ __forceinline__):
//   struct Args                        per batch entry: constants derived from the hyper-parameters
//   Args args(const Params& p)         p.p0 = bandwidth, p.p1, p.p2 = the descriptor's other
//                                      hyper-parameters in name order (runtime/specs/epilogue.py)
//   float scale(const Args&)           the mainloop hands z = scale * r2 (the expanded form folds
//                                      the scale into its operands: no multiply per pair)
//   template <bool kFma> float value(float z, const Args&)
//                                      k; kFma: the exponential on the FMA pipe (math::exp2_fma)
//                                      instead of MUFU.EX2, for a share of the pairs (the balance of
//                                      the two pipes: bench/notes/epilogue.md)
//   float dk_dr2(float z, const Args&) dk / d(r2), the derivative the backward needs
//   float log2_value(float z, const Args&)
//                                      log2 k of a positive kernel (kernel_logsumexp: no underflow
//                                      where the built-ins' closed forms have none)
//
// z may be slightly negative where the mainloop's expanded form rounds a zero distance: every
// functor clamps it at 0. The built-in functors (below) mirror kermac_like/formula.py's families
// over the l2 distance; a user expression's functor is rendered by SymPy's C printer into the
// instantiation stub (kermac_like/runtime/specs/epilogue.py), in namespace kermac_like::formula,
// from the helpers of that namespace below.
#pragma once

#include "common.cuh"
#include "math.cuh"

namespace kermac_like {
namespace epilogue {

// Whether a traits' functor parameter names one (void: none).
template <class E>
struct IsFunctor {
  static constexpr bool value = true;
};
template <>
struct IsFunctor<void> {
  static constexpr bool value = false;
};

// The hyper-parameter slots of one batch entry (the launch's bandwidth, inner_p and outer_p
// slots of the flat ABI, which a formula kernel's base fields leave unused).
struct Params {
  float p0, p1, p2;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^t on MUFU or on the FMA pipe (t <= 0 up to rounding: the upper clamp of math::exp2_fma is left
// out; NaN stays NaN: the select fails for it, and a NaN mantissa poisons the product).
template <bool kFma>
__device__ __forceinline__ float exp2_on(float t) {
  if constexpr (kFma) {
    float mant, scale;
    math::exp2_fma_split(t < -127.0f ? -127.0f : t, 1.0f, mant, scale);
    return mant * scale;
  } else {
    return math::ex2_approx(t);
  }
}

// Matérn 3/2: k = (1 + t) e^-t, t = sqrt(3) d / h. z = (t log2 e)^2 = u^2: k = (1 + ln2 u) 2^-u.
// dk/dr2 = -(3 / (2 h^2)) e^-t (finite at d = 0: the kernel is once differentiable).
struct Matern32 {
  struct Args {
    float scale, g;
  };
  __device__ __forceinline__ static Args args(const Params& p) {
    const float ih2 = 1.0f / (p.p0 * p.p0);
    return {3.0f * kLog2e * kLog2e * ih2, -1.5f * ih2};
  }
  __device__ __forceinline__ static float scale(const Args& a) { return a.scale; }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args&) {
    const float u = math::sqrt_approx(fabsf(z));
    return math::fma_rn(u, kLn2, 1.0f) * exp2_on<kFma>(-u);
  }
  __device__ __forceinline__ static float dk_dr2(float z, const Args& a) {
    return a.g * math::ex2_approx(-math::sqrt_approx(fmaxf(z, 0.0f)));
  }
  __device__ __forceinline__ static float log2_value(float z, const Args&) {
    const float u = math::sqrt_approx(fabsf(z));
    return math::lg2_approx(math::fma_rn(u, kLn2, 1.0f)) - u;
  }
};

// Matérn 5/2: k = (1 + t + t^2 / 3) e^-t, t = sqrt(5) d / h; with u = t log2 e (z = u^2)
// k = (1 + ln2 u + (ln2^2 / 3) u^2) 2^-u: one MUFU.SQRT, one exponential, 3 FFMA/FMUL.
// dk/dr2 = -(5 / (6 h^2)) (1 + t) e^-t.
struct Matern52 {
  struct Args {
    float scale, g;
  };
  __device__ __forceinline__ static Args args(const Params& p) {
    const float ih2 = 1.0f / (p.p0 * p.p0);
    return {5.0f * kLog2e * kLog2e * ih2, -(5.0f / 6.0f) * ih2};
  }
  __device__ __forceinline__ static float scale(const Args& a) { return a.scale; }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args&) {
    const float u = math::sqrt_approx(fabsf(z));  // (|z|: a free operand modifier; z < 0 only by rounding)
    const float poly = math::fma_rn(u, math::fma_rn(u, kLn2 * kLn2 / 3.0f, kLn2), 1.0f);
    return poly * exp2_on<kFma>(-u);
  }
  __device__ __forceinline__ static float dk_dr2(float z, const Args& a) {
    const float u = math::sqrt_approx(fmaxf(z, 0.0f));
    return a.g * math::fma_rn(u, kLn2, 1.0f) * math::ex2_approx(-u);
  }
  __device__ __forceinline__ static float log2_value(float z, const Args&) {
    const float u = math::sqrt_approx(fabsf(z));
    return math::lg2_approx(math::fma_rn(u, math::fma_rn(u, kLn2 * kLn2 / 3.0f, kLn2), 1.0f)) - u;
  }
};

// Rational quadratic: k = (1 + r2 / (2 alpha h^2))^-alpha = 2^(-alpha log2(1 + z)), z = r2 / (2 alpha h^2).
// Slots: p0 = bandwidth, p1 = alpha. dk/dr2 = -alpha scale k / (1 + z).
struct RationalQuadratic {
  struct Args {
    float scale, alpha;
  };
  __device__ __forceinline__ static Args args(const Params& p) {
    return {0.5f / (p.p1 * p.p0 * p.p0), p.p1};
  }
  __device__ __forceinline__ static float scale(const Args& a) { return a.scale; }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args& a) {
    return exp2_on<kFma>(-a.alpha * math::lg2_approx(1.0f + fmaxf(z, 0.0f)));
  }
  __device__ __forceinline__ static float dk_dr2(float z, const Args& a) {
    const float w = 1.0f + fmaxf(z, 0.0f);
    return -a.alpha * a.scale * math::ex2_approx(-a.alpha * math::lg2_approx(w)) * math::rcp_approx(w);
  }
  __device__ __forceinline__ static float log2_value(float z, const Args& a) {
    return -a.alpha * math::lg2_approx(1.0f + fmaxf(z, 0.0f));
  }
};

// Cauchy (kSqrt false): k = 1 / (1 + r2 / h^2), dk/dr2 = -k^2 / h^2; inverse multiquadric (kSqrt):
// k = 1 / sqrt(1 + r2 / h^2), dk/dr2 = -k^3 / (2 h^2). One MUFU (RCP or RSQ), no exponential.
template <bool kSqrt>
struct InverseQuadratic {
  struct Args {
    float scale;
  };
  __device__ __forceinline__ static Args args(const Params& p) { return {1.0f / (p.p0 * p.p0)}; }
  __device__ __forceinline__ static float scale(const Args& a) { return a.scale; }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args&) {
    const float w = 1.0f + fabsf(z);
    return kSqrt ? math::rsqrt_approx(w) : math::rcp_approx(w);
  }
  __device__ __forceinline__ static float dk_dr2(float z, const Args& a) {
    const float k = value<false>(z, a);
    return kSqrt ? -0.5f * a.scale * k * k * k : -a.scale * k * k;
  }
  __device__ __forceinline__ static float log2_value(float z, const Args&) {
    const float l = math::lg2_approx(1.0f + fabsf(z));
    return kSqrt ? -0.5f * l : -l;
  }
};
using Cauchy = InverseQuadratic<false>;
using InverseMultiquadric = InverseQuadratic<true>;

// Powered exponential of the l2 distance: k = exp(-(d / h)^q) = 2^(-log2e 2^((q/2) log2 z)),
// z = r2 / h^2 (z = 0: log2 0 = -inf, k = 1). Slots: p0 = bandwidth, p1 = q.
// dk/dr2 = -k (q / 2) z^(q/2 - 1) / h^2 (infinite at d = 0 for q < 2: the backward takes 0 there,
// as the torch path's powers do).
struct PoweredExponential {
  struct Args {
    float scale, half_q;
  };
  __device__ __forceinline__ static Args args(const Params& p) { return {1.0f / (p.p0 * p.p0), 0.5f * p.p1}; }
  __device__ __forceinline__ static float scale(const Args& a) { return a.scale; }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args& a) {
    const float w = math::ex2_approx(a.half_q * math::lg2_approx(fmaxf(z, 0.0f)));  // (d / h)^q
    return exp2_on<kFma>(-kLog2e * w);
  }
  __device__ __forceinline__ static float dk_dr2(float z, const Args& a) {
    const float zc = fmaxf(z, 0.0f);
    if (zc == 0.0f) return 0.0f;
    const float w = math::ex2_approx(a.half_q * math::lg2_approx(zc));
    return -math::ex2_approx(-kLog2e * w) * a.half_q * w * math::rcp_approx(zc) * a.scale;
  }
  __device__ __forceinline__ static float log2_value(float z, const Args& a) {
    return -kLog2e * math::ex2_approx(a.half_q * math::lg2_approx(fmaxf(z, 0.0f)));
  }
};

// The derivative dk/d(r2) of a functor as a functor (the fused backward's kernel: its products
// with g v^T-weighted right-hand sides give the gradients with respect to x and y).
template <class E>
struct Derivative {
  using Args = typename E::Args;
  __device__ __forceinline__ static Args args(const Params& p) { return E::args(p); }
  __device__ __forceinline__ static float scale(const Args& a) { return E::scale(a); }
  template <bool kFma>
  __device__ __forceinline__ static float value(float z, const Args& a) {
    return E::dk_dr2(z, a);
  }
  __device__ __forceinline__ static float dk_dr2(float, const Args&) { return 0.0f; }  // (not used)
};

}  // namespace epilogue

// The namespace of the rendered functors of user expressions: SymPy's C printer writes expf,
// powf, sqrtf, logf, ...; the renderer maps them to these (MUFU forms, accurate to a few ulp
// where the value matters: ~1e-7 relative for exponents of order 1) and writes pi as a float.
namespace formula {

// e^x; kFma: on the FMA pipe (the functor's value<kFma> for its share of the pairs).
template <bool kFma>
__device__ __forceinline__ float kl_exp(float x) {
  if constexpr (kFma) {
    return math::exp2_fma(x * epilogue::kLog2e);  // (both clamps: a user's exponent may be positive)
  } else {
    return math::ex2_approx(x * epilogue::kLog2e);
  }
}
__device__ __forceinline__ float kl_log(float x) { return math::lg2_approx(x) * epilogue::kLn2; }
__device__ __forceinline__ float kl_sqrt(float x) { return math::sqrt_approx(x); }
// 2^x (the renderer writes e^a as 2^(a log2 e), the factor folded into a's constant); kFma: the FMA pipe.
template <bool kFma>
__device__ __forceinline__ float kl_exp2(float x) {
  if constexpr (kFma) {
    return math::exp2_fma(x);
  } else {
    return math::ex2_approx(x);
  }
}

// x^n for an integer n (SymPy prints r**2 as powf(r, 2)): n multiplications after inlining.
__device__ __forceinline__ float kl_pow(float x, int n) {
  float out = 1.0f;
  const bool inv = n < 0;
  unsigned m = inv ? unsigned(-n) : unsigned(n);
  float b = x;
  while (m != 0u) {
    if (m & 1u) out *= b;
    b *= b;
    m >>= 1;
  }
  return inv ? 1.0f / out : out;
}

// x^y for x >= 0 (a distance's powers; 0^y = 0 for y > 0, 1 for y == 0); a negative base takes
// powf's definition (integer exponents).
__device__ __forceinline__ float kl_pow(float x, float y) {
  if (x > 0.0f) return math::ex2_approx(y * math::lg2_approx(x));
  return powf(x, y);
}

}  // namespace formula

}  // namespace kermac_like
