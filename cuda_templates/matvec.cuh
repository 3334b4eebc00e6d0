// Fused kernel matrix-vector product without the matrix (ABI: cuda_templates/ABI.md, built by
// kermac_like/plan/matvec.py plan_matvec).
//
//   out[l][m, c] = sum_n (k(x[l][m], y[l][n]) + lambda [n - m == reg_diag]) v[l][n, c]
//
// with k exactly run_kernel's (descriptor, hyper-parameters, epsilon cut). The M x N
// matrix never exists: each CTA owns kBlockM rows of x (kRows per thread, strided by
// kThreads so that loads and stores of a row index are coalesced), walks its range of y
// in tiles of kBlockN points staged in shared memory, forms k(x_m, y_n) in registers and
// accumulates k * v[n, :] into kC float32 partial sums per row: FlashAttention's
// structure with the kernel epilogue in place of the softmax.
//
// Two K strategies (compile time):
//   * kK > 0 ("registers"): K <= kK; the thread's x rows live in registers, zero-padded to
//     kK (inner(0, 0) == 0 for every inner operator, so padding changes no sum); a pair
//     costs kK inner operations, the epilogue, and kC FFMA;
//   * kK == 0 ("chunked", any K): y tiles of 32 points x 256 coordinates in shared memory,
//     x read 4 coordinates at a time, 32 partial distances per row in registers.
//
// Expanded exponent (kExpand, Diff/Square with an exponential of the squared distance:
// Gaussian of the l2 distance, Laplace of the squared one, no epsilon cut):
//   k = 2^(a_m + b_n + sum_k x'_mk y_nk),  x' = 2 s x,  a_m = -s |x_m|^2,  b_n = -s |y_n|^2
// with s = log2(e) * scale folded in, so a pair costs K + 1 FFMA, one exponential and kC
// FFMA (the direct form costs 2K + 1). The rounding error of the exponent grows with
// |x|^2 + |y|^2 instead of |x - y|^2, so coordinates are centred on the mean of the CTA's
// x rows (distances are translation invariant): x rows when loaded, each y tile as it is
// staged. b_n travels in y's last padding slot (x' there is 1). When every row of the tile
// has -a_m <= kFoldMax (the usual case), a_m leaves the pair loop: the loop computes
// 2^(b_n + x'.y) (K FFMA) and the totals are scaled by 2^a_m at the end. kPolyRows of the kRows rows
// evaluate 2^t on the FMA pipe (math.cuh), the others on MUFU.EX2: the MUFU pipe (16
// lanes/clk/SM) is the floor of this kernel, the FMA pipe has room for ~1/8 of them.
//
// Accumulation: a pair's product goes into a float32 partial of the current y tile (at
// most kBlockN terms), which is added into a float64 total after each tile, so the
// rounding error does not grow with N (2e6 positive terms: ~1e-7 relative). With a split
// N range (n_split > 1) each CTA writes its total for its range (float32; float64 with a
// float64 output) to `part`
// ([split][batch][M][C]) and matvec_combine_kernel adds the splits in split order: the
// result is bitwise identical from run to run (no atomics).
//
// The float64 mode's expanded form (kExpand with TOut = double) is symmetric, so that K(x, y)
// and K(y, x) are bitwise transposes (Falkon's two products K_nZ v and K_Zn u must be one
// operator and its transpose): every coordinate is centred on one vector `centre` given by the
// caller for both operands (no CTA mean) and scaled by r = sqrt(s) (the same rounding on
// either side): u = r (x - centre), w = r (y - centre); a row keeps x' = 2 u (exact doubling)
// and a_m = -|u|^2, a point b_n = -|w|^2 (the same sum of squares either way), and a pair
// forms t = (a_m + b_n) + sum_k x'_k w_k (one FADD, commutative, then the FFMA chain, whose
// products 2 u_k w_k are the same either way), k = 2^t: K + 1 FFMA/FADD and the exponential per
// pair against the direct form's 2K + 2. No fold (2^a_m would be rounded on one side only).
//
// Output type (kTOut = TOut_, default T): T rounds the float64 totals once at the store.
// double is the float64 mode (kernel_matvec with a float64 `out` for float32/16-bit inputs,
// e.g. Falkon's products, whose float32 rounding its preconditioner amplifies): v is read as
// double (TVIn), each pair's product k * v and the sums are float64 (DFMA on the float32 kernel
// value: no float32 tile partials, no rounding of v or of the result), only k itself is
// computed in float32. The split scratch `part` (TPart) is double exactly when the output
// is double, so that the instantiations with a T output are unchanged.
//
// Blocked float64 mode (kF32Group > 0, the symmetric expanded form only; Falkon's products): as the
// float64 mode (the same kernel values bit for bit, v read as double, float64 totals, split
// scratch and output) except that v is rounded to float32 once as it is staged and each pair's
// k * v is an FFMA into a float32 partial of kF32Group consecutive points of the tile, added into
// the float64 total after each group. The widening F2F.F64.F32 and the DFMA of every pair share
// the exponential's XU pipe and the FP64 pipe in the float64 mode; here they happen once per group.
// Error beyond the float64 mode's: v's rounding (u = 2^-24 of each term) and the group sums, at
// most (kF32Group + 1) u sum |k v| (positive terms: ~sqrt(kF32Group) u of the sum), independent
// of N as the float64 totals take the rest.
#pragma once

#include "common.cuh"
#include "descriptor_traits.cuh"
#include "storage16.cuh"
#include "math.cuh"
#include "epilogue.cuh"

namespace kermac_like {

namespace matvec_detail {

// Element loads and stores in float32 (storage16.cuh), and of v in the float64 mode.
using kermac_like::load_f;

// v in the float64 mode (TVIn = double).
__device__ __forceinline__ double load_f(const double* p) { return *p; }

// partial + k * v: float32 FMA, or (float64 mode) float64 FMA of the widened kernel value.
__device__ __forceinline__ float fma_acc(float k, float v, float acc) { return __fmaf_rn(k, v, acc); }
__device__ __forceinline__ double fma_acc(float k, double v, double acc) { return __fma_rn(double(k), v, acc); }

// The final store of a float64 total: rounded to float32 then to T, or (double) as is.
template <class U>
__device__ __forceinline__ void store_out(U* p, double r) { store_f(p, float(r)); }
__device__ __forceinline__ void store_out(double* p, double r) { *p = r; }

// The split scratch of an output type: double for a double output (no rounding before the
// combination), float otherwise; also the type of the per-tile partial sums.
template <class TOut>
struct PartOf { using type = float; };
template <>
struct PartOf<double> { using type = double; };

// A if kCond, else B.
template <bool kCond, class A, class B>
struct Select { using type = A; };
template <class A, class B>
struct Select<false, A, B> { using type = B; };

// The per-entry constants of an epilogue functor (epilogue.cuh); none without one.
template <class Epi>
struct EpiArgsOf { using type = typename Epi::Args; };
struct NoEpiArgs {};
template <>
struct EpiArgsOf<void> { using type = NoEpiArgs; };

// The type of v in memory: T, or double in the float64 mode.
template <class TOut, class T>
struct VOf { using type = T; };
template <class T>
struct VOf<double, T> { using type = double; };

__host__ __device__ constexpr int floor_pow2(int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }

}  // namespace matvec_detail

// kK_: 0 (chunked, any K) or the padded K of the register strategy (1..32, K <= kK);
// kC_: columns of v per launch (1, 2, 4, 8 or 16; fewer real columns are zero-padded);
// kExpand_: the expanded exponent (needs K + 1 <= kK); kPolyRows_: rows per thread whose
// exponential runs on the FMA pipe (kExpand only).
// Tuning knobs of the expanded kernel (defaults: the shipped loop; bench/probes/matvec_d3_candidates.py):
// kUnrollJ_: points per trip of the pair loop (0: 2 for float32, 1 otherwise); with kUnrollJ_ > 0
//   or kPolyPairs_ >= 0 the tile is walked in whole trips (padded points carry v = 0);
// kPolyPairs_: (row, point) pairs of a trip whose exponential runs on the FMA pipe (-1: kPolyRows
//   whole rows; pair (i, u) is a polynomial one when i * kUnrollJ + u < kPolyPairs);
// kPrefetch_: each thread loads the next tile's point (BN == threads) into registers before the
//   pair loop and stages it (centre, b_n) itself after the loop: no exposed global latency, no
//   separate centring pass, two barriers per tile.
// TOut_: the type of `out` (T_ or double: the float64 mode, v read as double, float64 products
//   and sums, `part` in double).
// kF32Group_: 0, or (float64 mode, expanded form) the blocked float64 mode: float32 partials of
//   kF32Group_ points added into the float64 totals (a divisor of kBlockN, a multiple of kUnrollJ).
// Epi_: void (the descriptor's enum epilogue), or an epilogue functor of the squared l2 distance
//   (epilogue.cuh: Matérn, rational quadratic, ..., a user expression's rendered functor) with the
//   base Diff, Square, Noop, None: k = Epi::value(scale * |x - y|^2), the direct form or (kExpand)
//   the expanded one with the functor's scale folded in as the Gaussian's (no fold of a_m: the
//   functor is not an exponential); kPolyRows / kPolyPairs then choose the pairs whose functor
//   takes its exponential on the FMA pipe. float32 output only.
template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, class T_, int kK_, int kC_,
          bool kExpand_ = false, int kPolyRows_ = 0, int kUnrollJ_ = 0, int kPolyPairs_ = -1,
          bool kPrefetch_ = false, class TOut_ = T_, int kF32Group_ = 0, class Epi_ = void>
struct MatvecTraits : DescriptorTraits<kInner_, kInnerPow_, kOuterPow_, kEpilogue_, T_> {
  using Epi = Epi_;
  static constexpr bool kFunctor = !SameType<Epi_, void>::value;
  using EpiArgs = typename matvec_detail::EpiArgsOf<Epi_>::type;
  static_assert(!kFunctor || (kInner_ == Inner::Diff && kInnerPow_ == Power::Square &&
                              kOuterPow_ == Power::Noop && kEpilogue_ == Epilogue::None),
                "MatvecTraits: an epilogue functor takes the base Diff, Square, Noop, None (r2 = |x - y|^2)");
  static_assert(!kFunctor || SameType<TOut_, T_>::value, "MatvecTraits: an epilogue functor has no float64 mode");
  static_assert(kK_ >= 0 && kK_ <= 32, "MatvecTraits: kK is 0 (any K) or the padded K, at most 32");
  static_assert(kC_ == 1 || kC_ == 2 || kC_ == 4 || kC_ == 8 || kC_ == 12 || kC_ == 16,
                "MatvecTraits: kC is 1, 2, 4, 8, 12 or 16");
  static_assert(!kExpand_ || kFunctor ||
                    (kInner_ == Inner::Diff && kInnerPow_ == Power::Square &&
                     ((kOuterPow_ == Power::Sqrt && kEpilogue_ == Epilogue::Gaussian) ||
                      (kOuterPow_ == Power::Noop && kEpilogue_ == Epilogue::Laplace))),
                "MatvecTraits: kExpand needs an exponential of the squared l2 distance or an epilogue functor");
  static_assert(!kExpand_ || kK_ >= 2, "MatvecTraits: kExpand needs kK >= K + 1 (b_n rides in the last slot)");
  static_assert(kExpand_ || kPolyRows_ == 0, "MatvecTraits: kPolyRows applies to kExpand only");

  static_assert(SameType<TOut_, T_>::value || SameType<TOut_, double>::value,
                "MatvecTraits: TOut must be T or double");
  using TOut = TOut_;
  using TPart = typename matvec_detail::PartOf<TOut_>::type;  // split partial sums
  static constexpr bool kWide = SameType<TOut_, double>::value;
  static constexpr int kF32Group = kF32Group_;
  static constexpr bool kBlocked = kF32Group_ > 0;  // the blocked float64 mode
  // v as staged and the partial sums: float, or double (float64 mode, unless blocked)
  using TW = typename matvec_detail::Select<kBlocked, float, TPart>::type;
  using TVIn = typename matvec_detail::VOf<TOut_, T_>::type;   // v in memory: T or double
  static constexpr int kK = kK_;
  static constexpr int kC = kC_;
  static constexpr bool kExpand = kExpand_;
  static constexpr bool kChunked = kK_ == 0;

  static constexpr int kThreads = 256;
  // Registers per row: x (kK, or 4 per step when chunked), kC partials (float32, or float64 in
  // the float64 mode), kC float64 totals; the chunked strategy also keeps kTileN distances per row.
  static constexpr int kRegK = kChunked ? 4 : kK_;
  static constexpr int kRows16 =
      matvec_detail::floor_pow2(96 / (kRegK + (kWide ? 4 : 3) * kC_ + (kChunked ? 32 : 1)));
  // 16-bit inputs: their conversions cost registers; 8 rows would spill at 128.
  static constexpr int kRows = (!SameType<T_, float>::value && kRows16 == 8) ? 4 : kRows16;
  static constexpr int kPolyRows = kPolyRows_;
  static_assert(kPolyRows_ >= 0 && kPolyRows_ < kRows, "MatvecTraits: kPolyRows must leave a MUFU row");
  static constexpr int kBlockM = kThreads * kRows;
  // y tile: kBlockN points; shared row of a point: kKS floats (float4 reads), then v.
  static constexpr int kKS = kChunked ? 256 : (kK_ + 3) / 4 * 4;
  static constexpr int kBlockN = kChunked ? 32 : (kKS + kC_ > 24 ? 128 : 256);
  static constexpr int kChunkK = kChunked ? 256 : kK_;  // coordinates staged per y sub-tile
  static constexpr int kSmemBytes = 0;  // static shared memory only
  // Points per trip of the pair loop: 2 amortises the loop's ~7 instructions over 16 pairs
  // (the kernel is issue-bound once kPolyRows moves exponentials off MUFU); 16-bit inputs
  // keep 1 (their conversions leave no registers for a second point at 128).
  static constexpr int kUnrollJ = kUnrollJ_ > 0 ? kUnrollJ_ : (SameType<T_, float>::value ? 2 : 1);
  // Trip-structured pair loop (compile-time point index inside a trip): the tuned variants.
  static constexpr bool kTrips = kExpand_ && (kUnrollJ_ > 0 || kPolyPairs_ >= 0);
  static constexpr int kPolyPairs = kPolyPairs_ >= 0 ? kPolyPairs_ : kPolyRows_ * kUnrollJ;
  static constexpr bool kPrefetch = kPrefetch_;
  static_assert(kUnrollJ_ >= 0 && kUnrollJ_ <= 8, "MatvecTraits: kUnrollJ is 0 (default) or 1..8");
  static_assert(kPolyPairs_ >= -1 && kPolyPairs_ < kRows * kUnrollJ, "MatvecTraits: kPolyPairs must leave a MUFU pair");
  static_assert(kExpand_ || (kPolyPairs_ <= 0 && kUnrollJ_ == 0 && !kPrefetch_),
                "MatvecTraits: kUnrollJ, kPolyPairs and kPrefetch tune the expanded kernel only");
  static constexpr int kStaticSmem = 4 * kBlockN * kKS + int(sizeof(TW)) * kBlockN * kC_;
  static_assert(kStaticSmem <= 48 * 1024, "MatvecTraits: the y tile must fit static shared memory");
  static_assert(!kPrefetch_ || (kBlockN == kThreads && kBlockN % kUnrollJ == 0 && kK_ <= 8),
                "MatvecTraits: kPrefetch needs one point per thread (kBlockN == kThreads) and kK <= 8");
  static_assert(!kTrips || kBlockN % kUnrollJ == 0, "MatvecTraits: kUnrollJ must divide kBlockN");
  static_assert(!(kExpand_ && kWide) || (!kTrips && !kPrefetch_ && kPolyRows_ == 0),
                "MatvecTraits: the float64 mode's (symmetric) expanded form takes no tuning knobs");
  static_assert(kF32Group_ >= 0, "MatvecTraits: kF32Group is 0 or the points of a float32 partial");
  static_assert(!kBlocked || (kWide && kExpand_),
                "MatvecTraits: kF32Group (the blocked float64 mode) needs TOut = double and kExpand");
  static_assert(!kBlocked || (kBlockN % kF32Group_ == 0 && kF32Group_ % kUnrollJ == 0),
                "MatvecTraits: kF32Group must divide kBlockN and be a multiple of kUnrollJ");
};

namespace matvec_detail {

// Per-entry constants of the epilogue.
struct KernelArgs {
  float inv_outer_p;  // Power::Pow outer
  float inner_p;      // Power::Pow inner
  float epsilon;      // <= 0: no cut
  float exp2_scale;   // Laplace: -log2(e)/bw; Gaussian: -log2(e)/(2 bw^2)
};

constexpr float kLog2e = 1.4426950408889634f;

// Largest -a_m (= s |x_m - centre|^2) for which the expanded kernel factors 2^a_m out of
// the pair loop: the loop's 2^(b_n + x'.y) stays <= 2^kFoldMax, so a tile partial of
// kBlockN terms cannot overflow unless |v| exceeds ~2^(128 - kFoldMax - 8).
constexpr float kFoldMax = 32.0f;


// acc + inner(x, y).
template <class Tr>
__device__ __forceinline__ float inner(float acc, float x, float y, float p) {
  if constexpr (Tr::kInner == Inner::Dot) {
    return __fmaf_rn(x, y, acc);
  } else {
    const float d = __fsub_rn(x, y);
    if constexpr (Tr::kInnerPow == Power::Abs) return __fadd_rn(acc, fabsf(d));
    if constexpr (Tr::kInnerPow == Power::Square) return __fmaf_rn(d, d, acc);
    if constexpr (Tr::kInnerPow == Power::Pow) return __fadd_rn(acc, math::abs_pow_mufu(d, p));
  }
}

// k = epilogue(outer(acc)) with the epsilon cut (the semantics of distance.cuh's finish,
// exponentials as 2^t on MUFU).
template <class Tr>
__device__ __forceinline__ float kernel_value(float acc, const KernelArgs& e) {
  if constexpr (Tr::kOuterPow == Power::Sqrt && Tr::kEpilogue == Epilogue::Gaussian) {
    float d2 = acc;  // exp(-d^2/(2 bw^2)) needs d^2 = acc, not d
    if (e.epsilon > 0.0f && sqrtf(acc) < e.epsilon) d2 = 0.0f;
    return math::ex2_approx(d2 * e.exp2_scale);
  } else {
    float d = acc;
    if constexpr (Tr::kOuterPow == Power::Sqrt) d = sqrtf(acc);
    if constexpr (Tr::kOuterPow == Power::Pow) d = math::ex2_approx(e.inv_outer_p * math::lg2_approx(acc));
    if (e.epsilon > 0.0f && d < e.epsilon) d = 0.0f;
    if constexpr (Tr::kEpilogue == Epilogue::Laplace) d = math::ex2_approx(d * e.exp2_scale);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = math::ex2_approx((d * d) * e.exp2_scale);
    return d;
  }
}

// 2^t on the FMA pipe (t <= 0 up to rounding; NaN stays NaN: the clamp is a select that a
// NaN fails, and a NaN mantissa poisons the product).
__device__ __forceinline__ float exp2_poly(float t) {
  t = t < -127.0f ? -127.0f : t;
  float mant, scale;
  math::exp2_fma_split(t, 1.0f, mant, scale);
  return mant * scale;
}

// k of one pair from its sum (direct form): the functor's value of scale * r2, or kernel_value.
template <class Tr>
__device__ __forceinline__ float pair_value(float acc, const KernelArgs& ka, const typename Tr::EpiArgs& fa) {
  if constexpr (Tr::kFunctor) {
    return Tr::Epi::template value<false>(acc * Tr::Epi::scale(fa), fa);
  } else {
    return kernel_value<Tr>(acc, ka);
  }
}

// k of one pair of the expanded form from its exponent e (a functor's: e = -scale r2); kFma: the
// exponential on the FMA pipe.
template <class Tr, bool kFma>
__device__ __forceinline__ float expanded_value(float e, const typename Tr::EpiArgs& fa) {
  if constexpr (Tr::kFunctor) {
    return Tr::Epi::template value<kFma>(-e, fa);
  } else if constexpr (kFma) {
    return exp2_poly(e);
  } else {
    return math::ex2_approx(e);
  }
}

// A functor's expanded form, or its direct one for a spread tile (kSpread): the expanded form rounds
// r2 to about eps (|x - c|^2 + |y - c|^2) (c the CTA's centre), which moves k by up to L times that
// relative, L = |dk/dr2(0)| / k(0) (per unit r2: the largest relative slope over r2 >= 0 of every
// built-in functor). Where L |x - c|^2 of a row or L |y - c|^2 of a point exceeds kSpread / 2 (spread or
// anisotropic data at a small bandwidth: per-feature scales 1e-2 .. 1e1 missed 1e-5 by up to 10x), the
// CTA takes the direct differences from that tile on (sticky: its rows are reloaded once). CPU shim,
// D = 3, randn data times sigma, the expanded form throughout: Matérn 5/2 (the steepest built-in at
// a given L |x - c|^2) 2.7e-6 at max L |x - c|^2 = 116, 1.9e-5 at 465 (bench/notes/epilogue.md); so
// 64 a side. NaN or inf norms, or k(0) == 0, take the direct form too.
// (KERMAC_LIKE_FORMULA_SPREAD: the CPU shim's override, to show the expanded form's miss without it.)
#ifndef KERMAC_LIKE_FORMULA_SPREAD
#define KERMAC_LIKE_FORMULA_SPREAD 128.0f
#endif
constexpr float kSpread = KERMAC_LIKE_FORMULA_SPREAD;

template <class Tr>
__device__ __forceinline__ float spread_slope(const typename Tr::EpiArgs& fa) {
  if constexpr (Tr::kFunctor) {
    return fabsf(Tr::Epi::dk_dr2(0.0f, fa)) / fabsf(Tr::Epi::template value<false>(0.0f, fa));
  } else {
    return 0.0f;
  }
}

// Whether a centred squared norm n2 is past the expanded form's half of the spread budget.
__device__ __forceinline__ bool spread_past(float slope, float n2) { return !(slope * n2 <= 0.5f * kSpread); }

// The launch arguments shared by matvec_kernel and matvec_combine_kernel (flat ABI;
// cuda.core passes no structs), gathered once at entry.
template <class T>
struct Operands {
  const T* x;
  const T* y;
  const T* v;
  T* out;
  i64 sxm, sxk, sym, syk, svn, svc, som, soc;
  BatchShape shape;
  BatchStride x_bs, y_bs, v_bs, o_bs;
};

// lambda * v[m + reg_diag, c] (the regularised diagonal n - m == reg_diag), or 0.
template <class T>
__device__ __forceinline__ double reg_term(const T* v, i64 svn, i64 svc, int N, int m, int c, i64 reg_diag,
                                           float lam) {
  const i64 n = i64(m) + reg_diag;
  if (lam == 0.0f || n < 0 || n >= N) return 0.0;
  return double(lam) * double(load_f(v + n * svn + c * svc));
}

// The pairs of one staged y tile, registers strategy: rows in registers (xr, xa), one point
// of the tile per step. kFold (expanded, CTA uniform): the exponent starts from b_n and
// a_m is applied to the totals at the end.
template <class Tr, bool kFold, bool kDirect = false>
__device__ __forceinline__ void pair_tile(const float* ys, const typename Tr::TW* vs, int jn,
                                          const float (&xr)[Tr::kRows][Tr::kChunked ? 1 : Tr::kK],
                                          const float (&xa)[Tr::kRows],
                                          typename Tr::TW (&partial)[Tr::kRows][Tr::kC], const KernelArgs& ka,
                                          const typename Tr::EpiArgs& fa) {
  constexpr int R = Tr::kRows, KC = Tr::kC, KS = Tr::kKS;
#pragma unroll(Tr::kBlocked ? Tr::kF32Group : Tr::kUnrollJ)
  for (int j = 0; j < jn; ++j) {
    float yj[KS];
#pragma unroll
    for (int q = 0; q < KS / 4; ++q) {
      const float4 f = reinterpret_cast<const float4*>(ys + j * KS)[q];
      yj[4 * q] = f.x, yj[4 * q + 1] = f.y, yj[4 * q + 2] = f.z, yj[4 * q + 3] = f.w;
    }
    typename Tr::TW vj[KC];
#pragma unroll
    for (int c = 0; c < KC; ++c) vj[c] = vs[j * KC + c];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float kv;
      if constexpr (Tr::kExpand && Tr::kWide && !kDirect) {  // symmetric: (a_m + b_n) first, then x'.y', times s
        float e = __fadd_rn(xa[i], yj[Tr::kK - 1]);
#pragma unroll
        for (int k = 0; k < Tr::kK - 1; ++k) e = __fmaf_rn(xr[i][k], yj[k], e);
        kv = math::ex2_approx(e);
      } else if constexpr (Tr::kExpand && !kDirect) {
        float e = kFold ? yj[Tr::kK - 1] : xa[i];
#pragma unroll
        for (int k = 0; k < (kFold ? Tr::kK - 1 : Tr::kK); ++k) e = __fmaf_rn(xr[i][k], yj[k], e);
        kv = i < Tr::kPolyRows ? expanded_value<Tr, true>(e, fa) : expanded_value<Tr, false>(e, fa);
      } else {
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < Tr::kK; ++k) acc = inner<Tr>(acc, xr[i][k], yj[k], ka.inner_p);
        kv = pair_value<Tr>(acc, ka, fa);
      }
#pragma unroll
      for (int c = 0; c < KC; ++c) partial[i][c] = fma_acc(kv, vj[c], partial[i][c]);
    }
  }
}

// The pairs of one staged y tile in trips of kUnrollJ points (expanded kernel, tuned
// variants): jn is rounded up to whole trips; the padded points of a partial tile have v = 0
// and a finite exponent (zero coordinates staged like real ones), so they add exact zeros.
template <class Tr, bool kFold>
__device__ __forceinline__ void pair_tile_trips(const float* ys, const typename Tr::TW* vs, int jn,
                                                const float (&xr)[Tr::kRows][Tr::kK], const float (&xa)[Tr::kRows],
                                                typename Tr::TW (&partial)[Tr::kRows][Tr::kC],
                                                const typename Tr::EpiArgs& fa) {
  constexpr int R = Tr::kRows, KC = Tr::kC, KS = Tr::kKS, U = Tr::kUnrollJ;
  const int jend = (jn + U - 1) / U * U;
#pragma unroll 1
  for (int j0 = 0; j0 < jend; j0 += U) {
    float yj[U][KS];
    typename Tr::TW vj[U][KC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int q = 0; q < KS / 4; ++q) {
        const float4 f = reinterpret_cast<const float4*>(ys + (j0 + u) * KS)[q];
        yj[u][4 * q] = f.x, yj[u][4 * q + 1] = f.y, yj[u][4 * q + 2] = f.z, yj[u][4 * q + 3] = f.w;
      }
    }
    if constexpr (KC == 1 && U % 4 == 0 && !Tr::kWide) {
#pragma unroll
      for (int u = 0; u < U; u += 4) {
        const float4 f = *reinterpret_cast<const float4*>(vs + j0 + u);
        vj[u][0] = f.x, vj[u + 1][0] = f.y, vj[u + 2][0] = f.z, vj[u + 3][0] = f.w;
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int c = 0; c < KC; ++c) vj[u][c] = vs[(j0 + u) * KC + c];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float e = kFold ? yj[u][Tr::kK - 1] : xa[i];
#pragma unroll
        for (int k = 0; k < (kFold ? Tr::kK - 1 : Tr::kK); ++k) e = __fmaf_rn(xr[i][k], yj[u][k], e);
        const float kv = (i * U + u < Tr::kPolyPairs) ? expanded_value<Tr, true>(e, fa)
                                                       : expanded_value<Tr, false>(e, fa);
#pragma unroll
        for (int c = 0; c < KC; ++c) partial[i][c] = fma_acc(kv, vj[u][c], partial[i][c]);
      }
    }
  }
}

// The blocked float64 mode's pairs of one staged y tile: groups of kF32Group points, each summed
// into float32 partials (pair_tile's symmetric loop, a compile-time trip count) and added into the
// float64 totals. jn is rounded up to whole groups: the padded points of a partial tile have v = 0
// and a finite exponent (zero coordinates staged like real ones), so they add exact zeros.
template <class Tr>
__device__ __forceinline__ void pair_tile_groups(const float* ys, const float* vs, int jn,
                                                 const float (&xr)[Tr::kRows][Tr::kK], const float (&xa)[Tr::kRows],
                                                 float (&partial)[Tr::kRows][Tr::kC],
                                                 double (&total)[Tr::kRows][Tr::kC], const KernelArgs& ka,
                                                 const typename Tr::EpiArgs& fa) {
  constexpr int R = Tr::kRows, KC = Tr::kC, KS = Tr::kKS, G = Tr::kF32Group;
  const int jend = (jn + G - 1) / G * G;
#pragma unroll 1
  for (int j0 = 0; j0 < jend; j0 += G) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < KC; ++c) partial[i][c] = 0.0f;
    pair_tile<Tr, false>(ys + j0 * KS, vs + j0 * KC, G, xr, xa, partial, ka, fa);
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < KC; ++c) total[i][c] += double(partial[i][c]);
  }
}

// The same with the CTA-uniform choice of the folded loop made at run time.
template <class Tr>
__device__ __forceinline__ void pair_tile_trips(bool fold, const float* ys, const typename Tr::TW* vs, int jn,
                                                const float (&xr)[Tr::kRows][Tr::kK], const float (&xa)[Tr::kRows],
                                                typename Tr::TW (&partial)[Tr::kRows][Tr::kC],
                                                const typename Tr::EpiArgs& fa) {
  if (!Tr::kFunctor && fold) {  // (a functor's expanded form never folds)
    pair_tile_trips<Tr, Tr::kFunctor ? false : true>(ys, vs, jn, xr, xa, partial, fa);
  } else {
    pair_tile_trips<Tr, false>(ys, vs, jn, xr, xa, partial, fa);
  }
}

// kPrefetch: the point of tile t that this thread stages (index tid of the tile), read into
// registers (zeros past N and past K / C).
template <class Tr, class T>
__device__ __forceinline__ void load_point(const T* yl, const typename Tr::TVIn* vl, int n, int N, int K, int C,
                                           i64 sym, i64 syk, i64 svn, i64 svc, float (&py)[Tr::kK],
                                           typename Tr::TW (&pv)[Tr::kC]) {
#pragma unroll
  for (int k = 0; k < Tr::kK; ++k) py[k] = (n < N && k < K) ? load_f(yl + i64(n) * sym + k * syk) : 0.0f;
#pragma unroll
  for (int c = 0; c < Tr::kC; ++c)
    pv[c] = (n < N && c < C) ? typename Tr::TW(load_f(vl + i64(n) * svn + c * svc)) : typename Tr::TW(0);
}

// kPrefetch: centre the point, b_n = -s |y - centre|^2 into the last slot (non-finite: zero
// coordinates, b_n = -inf or NaN; as the staging pass of the default kernel), store it.
template <class Tr>
__device__ __forceinline__ void store_point(float* ys, typename Tr::TW* vs, int j, int K, float s,
                                            const float (&centre)[Tr::kK], const float (&py)[Tr::kK],
                                            const typename Tr::TW (&pv)[Tr::kC]) {
  constexpr int KS = Tr::kKS;
  float yv[KS];
  float n2 = 0.0f;
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const float d = k < Tr::kK ? __fsub_rn(py[k], centre[k]) : 0.0f;
    if (k < Tr::kK && k < K) n2 = __fmaf_rn(d, d, n2);
    yv[k] = (k < Tr::kK && k < K) ? d : 0.0f;
  }
  const float b = -s * n2;
  const bool finite = fabsf(b) <= 3.402823466e38f;
#pragma unroll
  for (int k = 0; k < KS; ++k) yv[k] = finite ? yv[k] : 0.0f;
  yv[Tr::kK - 1] = finite ? b : (b != b ? b : -__int_as_float(0x7f800000));
#pragma unroll
  for (int q = 0; q < KS / 4; ++q)
    reinterpret_cast<float4*>(ys + j * KS)[q] = make_float4(yv[4 * q], yv[4 * q + 1], yv[4 * q + 2], yv[4 * q + 3]);
#pragma unroll
  for (int c = 0; c < Tr::kC; ++c) vs[j * Tr::kC + c] = pv[c];
}

// A functor's direct form in the expanded kernel (kSpread): the point raw (zeros past K, as loaded).
template <class Tr>
__device__ __forceinline__ void store_raw_point(float* ys, typename Tr::TW* vs, int j, const float (&py)[Tr::kK],
                                                const typename Tr::TW (&pv)[Tr::kC]) {
  constexpr int KS = Tr::kKS;
#pragma unroll
  for (int q = 0; q < KS / 4; ++q) {
    float4 f;
    f.x = 4 * q < Tr::kK ? py[4 * q] : 0.0f;
    f.y = 4 * q + 1 < Tr::kK ? py[4 * q + 1] : 0.0f;
    f.z = 4 * q + 2 < Tr::kK ? py[4 * q + 2] : 0.0f;
    f.w = 4 * q + 3 < Tr::kK ? py[4 * q + 3] : 0.0f;
    reinterpret_cast<float4*>(ys + j * KS)[q] = f;
  }
#pragma unroll
  for (int c = 0; c < Tr::kC; ++c) vs[j * Tr::kC + c] = pv[c];
}

// Whether a real point (``real``) of raw coordinates py is past the spread budget about the centre.
template <class Tr>
__device__ __forceinline__ bool spread_point(float slope, int K, bool real, const float (&centre)[Tr::kK],
                                             const float (&py)[Tr::kK]) {
  float n2 = 0.0f;
#pragma unroll
  for (int k = 0; k < Tr::kK; ++k) {
    const float d = __fsub_rn(py[k], centre[k]);
    if (k < K) n2 = __fmaf_rn(d, d, n2);
  }
  return real && spread_past(slope, n2);
}

// The rows of this thread raw into xr (zeros past K): a functor's direct form in the expanded kernel.
// (Rows and pointer recomputed from values live anyway: nothing more held through the pair loop.)
template <class Tr, class T>
__device__ __forceinline__ void load_rows(const T* xl, int m0, int M, int K, i64 sxm, i64 sxk,
                                          float (&xr)[Tr::kRows][Tr::kChunked ? 1 : Tr::kK]) {
  if constexpr (!Tr::kChunked) {
#pragma unroll
    for (int i = 0; i < Tr::kRows; ++i) {
      const int m = min(m0 + int(threadIdx.x) + Tr::kThreads * i, M - 1);
#pragma unroll
      for (int k = 0; k < Tr::kK; ++k) xr[i][k] = k < K ? load_f(xl + i64(m) * sxm + k * sxk) : 0.0f;
    }
  }
}

}  // namespace matvec_detail

// Grid: (ceil(M / kBlockM), n_split, min(batch, 65535)). Split s covers y tiles
// [s * tiles_per_split, (s + 1) * tiles_per_split). n_split == 1: out[l][m, c] is written
// (regularisation included); n_split > 1: part[s][l][m][c] (TPart: float32, or float64 for
// a float64 output; contiguous, C columns) is, and matvec_combine_kernel finishes.
// Two CTAs per SM (128 registers) on sm_90; sm_80 spills at that budget, so it runs one.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KL_MATVEC_MIN_BLOCKS 1
#else
#define KL_MATVEC_MIN_BLOCKS 2
#endif

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, KL_MATVEC_MIN_BLOCKS) matvec_kernel(
    const typename Traits::T *__restrict__ x, const typename Traits::T *__restrict__ y,
    const typename Traits::TVIn *__restrict__ v, typename Traits::TOut *__restrict__ out,
    typename Traits::TPart *__restrict__ part,
    int M, int N, int K, int C, long long sxm, long long sxk, long long sym, long long syk, long long svn,
    long long svc, long long som, long long soc, int batch, int batch_n1, int batch_n2, long long x_bs0,
    long long x_bs1, long long x_bs2, long long y_bs0, long long y_bs1, long long y_bs2, long long v_bs0,
    long long v_bs1, long long v_bs2, long long o_bs0, long long o_bs1, long long o_bs2,
    const float *inner_p_ptr, long long inner_p_bs0, long long inner_p_bs1, long long inner_p_bs2,
    float inner_p, const float *outer_p_ptr, long long outer_p_bs0, long long outer_p_bs1,
    long long outer_p_bs2, float outer_p, const float *bw_ptr, long long bw_bs0, long long bw_bs1,
    long long bw_bs2, float bandwidth, const float *reg_ptr, long long reg_bs0, long long reg_bs1,
    long long reg_bs2, float regularization, long long reg_diag, float epsilon, int n_split,
    int tiles_per_split, const float* __restrict__ centre_ptr) {
  using Tr = Traits;
  using T = typename Tr::T;
  using TW = typename Tr::TW;
  using namespace matvec_detail;
  constexpr int R = Tr::kRows, KC = Tr::kC, BN = Tr::kBlockN, KS = Tr::kKS, NT = Tr::kThreads;

  __shared__ __align__(16) float ys[BN * KS];  // (BN, KS): a point's coordinates (+ b_n)
  __shared__ __align__(16) TW vs[BN * KC];     // (BN, KC)

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride x_bs{x_bs0, x_bs1, x_bs2}, y_bs{y_bs0, y_bs1, y_bs2}, v_bs{v_bs0, v_bs1, v_bs2},
      o_bs{o_bs0, o_bs1, o_bs2};
  const HyperParam hp_inner{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p};
  const HyperParam hp_outer{outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p};
  const HyperParam hp_bw{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth};
  const HyperParam hp_reg{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};

  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * Tr::kBlockM;
  const int split = blockIdx.y;
  const int n_tiles = (N + BN - 1) / BN;
  const int t_begin = split * tiles_per_split;
  const int t_end = min(n_tiles, t_begin + tiles_per_split);

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const BatchIndex bi = shape.split(l);
    const T* xl = x + x_bs.offset(bi);
    const T* yl = y + y_bs.offset(bi);
    const typename Tr::TVIn* vl = v + v_bs.offset(bi);

    KernelArgs ka;
    ka.inner_p = Tr::kInnerPow == Power::Pow ? hp_inner.at(bi) : 0.0f;
    ka.inv_outer_p = Tr::kOuterPow == Power::Pow ? 1.0f / hp_outer.at(bi) : 0.0f;
    ka.epsilon = epsilon;
    ka.exp2_scale = 0.0f;
    if constexpr (Tr::kEpilogue == Epilogue::Laplace) ka.exp2_scale = -kLog2e / hp_bw.at(bi);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) {
      const float bw = hp_bw.at(bi);
      ka.exp2_scale = -kLog2e * (0.5f / (bw * bw));
    }
    // An epilogue functor's constants (from the bandwidth, inner_p and outer_p slots).
    typename Tr::EpiArgs fa{};
    if constexpr (Tr::kFunctor) fa = Tr::Epi::args(epilogue::Params{hp_bw.at(bi), hp_inner.at(bi), hp_outer.at(bi)});
    // Expanded form: exponent = -s d^2 with s = -exp2_scale (Laplace of d^2: d = acc); a functor's
    // own scale (its value is taken of z = s d^2).
    float s = -ka.exp2_scale;
    if constexpr (Tr::kFunctor) s = Tr::Epi::scale(fa);
    const float r = Tr::kWide ? sqrtf(s) : 1.0f;  // the symmetric form's coordinate scale

    // Rows of this thread: m0 + tid + NT * i (clamped; the clamped ones are never stored).
    int rows[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rows[i] = min(m0 + tid + NT * i, M - 1);

    // Centre of the expanded form: the mean of the tile's finite x rows.
    float centre[Tr::kChunked ? 1 : Tr::kK];
    float xr[R][Tr::kChunked ? 1 : Tr::kK];  // (R, kK) registers strategy
    float xa[R];                              // a_m (expanded)
    bool fold = false;                        // expanded: a_m factored out of the pair loop
    // A functor's expanded form: the CTA's direct form from a spread tile on (kSpread), the rows raw in xr.
    bool direct = false, spread = false;
    if constexpr (!Tr::kChunked) {
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int k = 0; k < Tr::kK; ++k) xr[i][k] = k < K ? load_f(xl + i64(rows[i]) * sxm + k * sxk) : 0.0f;
#pragma unroll
      for (int k = 0; k < Tr::kK; ++k) centre[k] = 0.0f;
      if constexpr (Tr::kExpand && Tr::kWide) {
        // Symmetric form: u = r (x - centre) with the caller's centre, x' = 2 u, a_m = -|u|^2.
#pragma unroll
        for (int k = 0; k < Tr::kK; ++k) centre[k] = k < K ? centre_ptr[k] : 0.0f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float n2 = 0.0f;
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) {
            const float xv = __fmul_rn(__fsub_rn(xr[i][k], centre[k]), r);
            n2 = __fmaf_rn(xv, xv, n2);
            xr[i][k] = xv;
          }
          const float a = -n2;
          const bool finite = fabsf(a) <= 3.402823466e38f;
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) xr[i][k] = (finite && k < K) ? 2.0f * xr[i][k] : 0.0f;
          xa[i] = finite ? a : (a != a ? a : -__int_as_float(0x7f800000));
        }
      } else if constexpr (Tr::kExpand) {
        float cnt = 0.0f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float n2 = 0.0f;
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) n2 = __fmaf_rn(xr[i][k], xr[i][k], n2);
          if (m0 + tid + NT * i < M && n2 <= 1e30f) {  // a real, finite row (NaN fails too)
            cnt += 1.0f;
#pragma unroll
            for (int k = 0; k < Tr::kK; ++k) centre[k] += xr[i][k];
          }
        }
        // Block sum: warp shuffles, then the 8 warp sums through shared memory.
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) centre[k] += __shfl_xor_sync(0xffffffffu, centre[k], o);
        }
        __syncthreads();  // the previous batch entry's last tile is consumed
        if ((tid & 31) == 0) {
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) ys[(tid >> 5) * Tr::kK + k] = centre[k];
          vs[tid >> 5] = cnt;
        }
        __syncthreads();
        cnt = 0.0f;
#pragma unroll
        for (int k = 0; k < Tr::kK; ++k) centre[k] = 0.0f;
        for (int w = 0; w < NT / 32; ++w) {
          cnt += vs[w];
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) centre[k] += ys[w * Tr::kK + k];
        }
        const float inv = cnt > 0.0f ? 1.0f / cnt : 0.0f;
#pragma unroll
        for (int k = 0; k < Tr::kK; ++k) centre[k] *= inv;

        bool fold_ok = true;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float n2 = 0.0f;
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) {
            const float xv = __fsub_rn(xr[i][k], centre[k]);
            n2 = __fmaf_rn(xv, xv, n2);
            xr[i][k] = xv;
          }
          if constexpr (Tr::kFunctor) spread = spread || (m0 + tid + NT * i < M && spread_past(spread_slope<Tr>(fa), n2));
          // x'_k = 2 s x_k; the last slot carries 1 (times b_n). A non-finite row (inf, NaN
          // or an overflowing norm) keeps x' = 0 and a_m = -inf (k = 0, as the dense kernel
          // gives for an infinite distance) or NaN (propagates).
          const float a = -s * n2;
          const bool finite = fabsf(a) <= 3.402823466e38f;
#pragma unroll
          for (int k = 0; k < Tr::kK; ++k) {
            const float xp = k < K ? 2.0f * s * xr[i][k] : (k == Tr::kK - 1 ? 1.0f : 0.0f);
            xr[i][k] = finite ? xp : 0.0f;
          }
          xa[i] = finite ? a : (a != a ? a : -__int_as_float(0x7f800000));
          fold_ok = fold_ok && finite && a >= -kFoldMax;
        }
        // Every row of the tile within kFoldMax of its centre: 2^(b_n + x'.y) <= 2^kFoldMax,
        // so a_m moves out of the pair loop (one FFMA less per pair) into a final 2^a_m.
        if constexpr (!Tr::kFunctor) fold = __syncthreads_and(fold_ok) != 0;
        if constexpr (Tr::kFunctor) {
          direct = __syncthreads_and(!spread) == 0;
          if (direct) load_rows<Tr>(x + x_bs.offset(bi), m0, M, K, sxm, sxk, xr);
        }
      }
    }

    TW partial[R][KC];
    double total[R][KC];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < KC; ++c) total[i][c] = 0.0;

    if constexpr (Tr::kPrefetch) {
      // ---- expanded kernel, one point per thread: the next tile's point waits in registers
      // while the pairs of this one run.
      float py[Tr::kK];
      TW pv[KC];
      if (t_begin < t_end) load_point<Tr>(yl, vl, t_begin * BN + tid, N, K, C, sym, syk, svn, svc, py, pv);
#pragma unroll 1
      for (int t = t_begin; t < t_end; ++t) {
        const int jn = min(BN, N - t * BN);
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int c = 0; c < KC; ++c) partial[i][c] = TW(0);
        if constexpr (Tr::kFunctor) {  // (the barrier: the previous tile is consumed)
          const bool was = direct;
          const bool real = t * BN + tid < N;
          direct = __syncthreads_and(!(direct || spread_point<Tr>(spread_slope<Tr>(fa), K, real, centre, py))) == 0;
          if (direct && !was) load_rows<Tr>(x + x_bs.offset(bi), m0, M, K, sxm, sxk, xr);
          if (direct) {
            store_raw_point<Tr>(ys, vs, tid, py, pv);
          } else {
            store_point<Tr>(ys, vs, tid, K, s, centre, py, pv);
          }
        } else {
          __syncthreads();  // the previous tile is consumed
          store_point<Tr>(ys, vs, tid, K, s, centre, py, pv);
        }
        if (t + 1 < t_end) load_point<Tr>(yl, vl, (t + 1) * BN + tid, N, K, C, sym, syk, svn, svc, py, pv);
        __syncthreads();
        if (Tr::kFunctor && direct) {
          pair_tile<Tr, false, true>(ys, vs, jn, xr, xa, partial, ka, fa);
        } else {
          pair_tile_trips<Tr>(fold, ys, vs, jn, xr, xa, partial, fa);
        }
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int c = 0; c < KC; ++c) total[i][c] += double(partial[i][c]);
      }
    } else
#pragma unroll 1
    for (int t = t_begin; t < t_end; ++t) {
      const int n0 = t * BN;
      const int jn = min(BN, N - n0);
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < KC; ++c) partial[i][c] = TW(0);

      // ---- stage v (and, registers strategy, y) of this tile
      __syncthreads();  // the previous tile is consumed
      for (int e = tid; e < BN * KC; e += NT) {
        const int j = e / KC, c = e % KC;
        vs[e] = (j < jn && c < C) ? TW(load_f(vl + i64(n0 + j) * svn + c * svc)) : TW(0);
      }
      if constexpr (!Tr::kChunked) {
        for (int e = tid; e < BN * KS; e += NT) {
          const int j = e / KS, k = e % KS;
          ys[e] = (j < jn && k < K) ? load_f(yl + i64(n0 + j) * sym + k * syk) : 0.0f;
        }
        if constexpr (Tr::kExpand && Tr::kFunctor) {  // a spread tile: the direct form (kSpread)
          bool far = false;
          __syncthreads();
          for (int j = tid; j < BN; j += NT) {
            float py[Tr::kK];
#pragma unroll
            for (int k = 0; k < Tr::kK; ++k) py[k] = ys[j * KS + k];
            far = far || spread_point<Tr>(spread_slope<Tr>(fa), K, j < jn, centre, py);
          }
          const bool was = direct;
          direct = __syncthreads_and(!(direct || far)) == 0;
          if (direct && !was) load_rows<Tr>(x + x_bs.offset(bi), m0, M, K, sxm, sxk, xr);
        }
        if constexpr (Tr::kExpand) {
          if (!Tr::kFunctor) __syncthreads();
          // One thread per point: centre, b_n = -s |y_n - centre|^2 into the last slot (the
          // symmetric form: w = r (y - centre), b_n = -|w|^2).
          for (int j = tid; j < BN && !(Tr::kFunctor && direct); j += NT) {
            float n2 = 0.0f;
            float* yj = ys + j * KS;
#pragma unroll
            for (int k = 0; k < Tr::kK; ++k) {
              const float yv = Tr::kWide ? __fmul_rn(__fsub_rn(yj[k], centre[k]), r) : __fsub_rn(yj[k], centre[k]);
              if (k < K) n2 = __fmaf_rn(yv, yv, n2);
              yj[k] = k < K ? yv : 0.0f;
            }
            const float b = Tr::kWide ? -n2 : -s * n2;
            const bool finite = fabsf(b) <= 3.402823466e38f;
            if (!finite) {
#pragma unroll
              for (int k = 0; k < Tr::kK; ++k) yj[k] = 0.0f;
            }
            yj[Tr::kK - 1] = finite ? b : (b != b ? b : -__int_as_float(0x7f800000));
          }
        }
        __syncthreads();

        // ---- the pairs (fold is CTA uniform)
        if constexpr (Tr::kBlocked) {
          pair_tile_groups<Tr>(ys, vs, jn, xr, xa, partial, total, ka, fa);
        } else if (Tr::kFunctor && Tr::kExpand && direct) {
          pair_tile<Tr, false, true>(ys, vs, jn, xr, xa, partial, ka, fa);
        } else if constexpr (Tr::kTrips) {
          pair_tile_trips<Tr>(fold, ys, vs, jn, xr, xa, partial, fa);
        } else if (Tr::kExpand && !Tr::kFunctor && fold) {
          pair_tile<Tr, !Tr::kFunctor>(ys, vs, jn, xr, xa, partial, ka, fa);
        } else {
          pair_tile<Tr, false>(ys, vs, jn, xr, xa, partial, ka, fa);
        }
      } else {
        // ---- chunked: 32 points per tile, K in shared-memory chunks of 256, x read 4
        // coordinates at a time
        float dist[R][BN];
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int j = 0; j < BN; ++j) dist[i][j] = 0.0f;
#pragma unroll 1
        for (int k0 = 0; k0 < K; k0 += Tr::kChunkK) {
          const int kn = min(Tr::kChunkK, K - k0);
          __syncthreads();  // the previous chunk is consumed
          for (int e = tid; e < BN * KS; e += NT) {
            const int j = e / KS, k = e % KS;
            ys[e] = (j < jn && k < kn) ? load_f(yl + i64(n0 + j) * sym + i64(k0 + k) * syk) : 0.0f;
          }
          __syncthreads();
#pragma unroll 1
          for (int kk = 0; kk < kn; kk += 4) {
            float xc[R][4];
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
              for (int k = 0; k < 4; ++k)
                xc[i][k] = kk + k < kn ? load_f(xl + i64(rows[i]) * sxm + i64(k0 + kk + k) * sxk) : 0.0f;
#pragma unroll
            for (int j = 0; j < BN; ++j) {
              const float4 f = *reinterpret_cast<const float4*>(ys + j * KS + kk);
#pragma unroll
              for (int i = 0; i < R; ++i) {
                float a = dist[i][j];
                a = inner<Tr>(a, xc[i][0], f.x, ka.inner_p);
                a = inner<Tr>(a, xc[i][1], f.y, ka.inner_p);
                a = inner<Tr>(a, xc[i][2], f.z, ka.inner_p);
                a = inner<Tr>(a, xc[i][3], f.w, ka.inner_p);
                dist[i][j] = a;
              }
            }
          }
        }
#pragma unroll
        for (int j = 0; j < BN; ++j) {
          if (j < jn) {
            TW vj[KC];
#pragma unroll
            for (int c = 0; c < KC; ++c) vj[c] = vs[j * KC + c];
#pragma unroll
            for (int i = 0; i < R; ++i) {
              const float kv = pair_value<Tr>(dist[i][j], ka, fa);
#pragma unroll
              for (int c = 0; c < KC; ++c) partial[i][c] = fma_acc(kv, vj[c], partial[i][c]);
            }
          }
        }
      }
      if constexpr (!Tr::kBlocked) {  // (blocked: the groups are in total already)
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int c = 0; c < KC; ++c) total[i][c] += double(partial[i][c]);
      }
    }

    if constexpr (Tr::kExpand) {
      if (fold) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const double sc = double(exp2f(xa[i]));
#pragma unroll
          for (int c = 0; c < KC; ++c) total[i][c] *= sc;
        }
      }
    }

    // ---- write: the finished rows, or this split's partial sums
    const float lam = (reg_ptr != nullptr || regularization != 0.0f) ? hp_reg.at(bi) : 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int m = m0 + tid + NT * i;
      if (m < M) {
#pragma unroll
        for (int c = 0; c < KC; ++c) {
          if (c < C) {
            if (n_split == 1) {
              const double r = total[i][c] + reg_term(vl, svn, svc, N, m, c, reg_diag, lam);
              store_out(out + o_bs.offset(bi) + i64(m) * som + c * soc, r);
            } else {
              part[((i64(split) * batch + l) * M + m) * C + c] = typename Tr::TPart(total[i][c]);
            }
          }
        }
      }
    }
  }
}

// Launch constants of matvec_combine_kernel (mirrored by kermac_like/runtime/specs/matvec.py).
// TOut_: as MatvecTraits' (T_ or double); TPart: the split scratch (double for a double output).
template <class T_, class TOut_ = T_>
struct MatvecCombineTraits {
  static_assert(SameType<T_, float>::value || SameType<T_, float16>::value ||
                    SameType<T_, bfloat16>::value,
                "MatvecCombineTraits: T must be float, kermac_like::float16 or kermac_like::bfloat16");
  static_assert(SameType<TOut_, T_>::value || SameType<TOut_, double>::value,
                "MatvecCombineTraits: TOut must be T or double");
  using T = T_;
  using TOut = TOut_;
  using TPart = typename matvec_detail::PartOf<TOut_>::type;
  using TVIn = typename matvec_detail::VOf<TOut_, T_>::type;  // v in memory (the regularised diagonal's term)
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 1;  // grid-stride over batch * M * C
  static constexpr int kBlockN = 1;
  static constexpr int kSmemBytes = 0;
};

// Finishes a split product: out[l][m, c] = sum_s part[s][l][m][c] (in split order, in
// float64) + the regularisation term. Grid-stride over batch * M * C.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) matvec_combine_kernel(
    const typename Traits::TPart* __restrict__ part, const typename Traits::TVIn* __restrict__ v,
    typename Traits::TOut* __restrict__ out,
    int M, int N, int C, long long svn, long long svc, long long som, long long soc, int batch, int batch_n1,
    int batch_n2, long long v_bs0, long long v_bs1, long long v_bs2, long long o_bs0, long long o_bs1,
    long long o_bs2, const float* reg_ptr, long long reg_bs0, long long reg_bs1, long long reg_bs2,
    float regularization, long long reg_diag, int n_split) {
  using namespace matvec_detail;
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride v_bs{v_bs0, v_bs1, v_bs2}, o_bs{o_bs0, o_bs1, o_bs2};
  const HyperParam hp_reg{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};
  const i64 per = i64(M) * C, total = per * batch;
  for (i64 e = blockIdx.x * i64(blockDim.x) + threadIdx.x; e < total; e += i64(gridDim.x) * blockDim.x) {
    const int l = int(e / per);
    const int m = int((e % per) / C), c = int(e % C);
    double r = 0.0;
    for (int s = 0; s < n_split; ++s) r += double(part[i64(s) * total + e]);
    const BatchIndex bi = shape.split(l);
    const float lam = (reg_ptr != nullptr || regularization != 0.0f) ? hp_reg.at(bi) : 0.0f;
    r += reg_term(v + v_bs.offset(bi), svn, svc, N, m, c, reg_diag, lam);
    store_out(out + o_bs.offset(bi) + i64(m) * som + c * soc, r);
  }
}

}  // namespace kermac_like
