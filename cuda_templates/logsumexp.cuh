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
// LseTraits' kVariant 1 / 2 (opt-in, bench/notes/logsumexp.md) keep these semantics with a lazy
// reference in place of the running maximum (see lse_detail::kLazyMax): one exp2 per term.
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
#include "descriptor_traits.cuh"
#include "storage16.cuh"
#include "math.cuh"
#include "epilogue.cuh"

namespace kermac_like {

// kK_: the padded K (1..64; x rows in registers); kC_: log-weight columns per launch (1..8).
// kVariant_ (the pair loop; bench/notes/logsumexp.md, bench/probes/lse_variants.py):
//   0: a running maximum per trip of kUnrollJ points (maximum first, one rescale per trip);
//   1: a lazy reference: s += exp2(v - ref) with ref moved only when a trip leaves s > kLazyMax
//      (then the trip is redone against the new reference), padded trips (no tail loop), the
//      log-weight in y's first padding slot when kC = 1 and kK % 4 != 0;
//   2: as 1, and for the Gaussian of the l2 distance with kC = 1 the reference and the scale
//      folded into the distance: exp2(fma(d^2 + a, -S, lw)), ref = S a (one FFMA per pair less);
//   3: as 2, and for an exponential of the squared l2 distance (Gaussian-l2, Laplace of the squared
//      l2) with kC = 1 the expanded exponent where the planner allows it (lse_detail::kPathExpand).
// kUnrollJ_ / kRows_: 0 (the defaults below) or the points per trip / rows per thread.
// Epi_: void, or an epilogue functor of a positive kernel (epilogue.cuh; base Diff, Square, Noop, None,
// kVariant 0): the term is log2 k = Epi::log2_value(scale r2) of the exact squared distance (a formula
// kernel's kernel_logsumexp), its hyper-parameters p0, p1, p2 in the bandwidth, inner_p and outer_p slots.
template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, class T_, int kK_, int kC_,
          int kVariant_ = 0, int kUnrollJ_ = 0, int kRows_ = 0, class Epi_ = void>
struct LseTraits : DescriptorTraits<kInner_, kInnerPow_, kOuterPow_, kEpilogue_, T_> {
  using Epi = Epi_;
  static constexpr bool kFunctor = epilogue::IsFunctor<Epi_>::value;
  static_assert(kInner_ == Inner::Diff, "LseTraits: phi is a distance (Inner::Diff)");
  static_assert(kFunctor || kEpilogue_ == Epilogue::Laplace || kEpilogue_ == Epilogue::Gaussian,
                "LseTraits: the kernel is exp(-phi): Epilogue::Laplace or Epilogue::Gaussian");
  static_assert(!kFunctor || (kInnerPow_ == Power::Square && kOuterPow_ == Power::Noop &&
                              kEpilogue_ == Epilogue::None && kVariant_ == 0),
                "LseTraits: an epilogue functor needs the base Diff, Square, Noop, None and kVariant 0");
  static_assert(kK_ >= 1 && kK_ <= 64, "LseTraits: kK is the padded K, 1..64");
  static_assert(kC_ >= 1 && kC_ <= 8, "LseTraits: kC is 1..8 columns");

  static constexpr int kK = kK_;
  static constexpr int kC = kC_;
  // phi from the sum of squares itself (no square root, then no square).
  static constexpr bool kSquared = kEpilogue_ == Epilogue::Gaussian && kOuterPow_ == Power::Sqrt;

  static constexpr int kThreads = 128;
  // Rows per thread: x and the (mx, s) pairs take kK + 2 kC registers per row; about 80 in all
  // (topk.cuh's rule).
  static constexpr int kRowRegs = kK_ + 2 * kC_;
  static constexpr int kRows = kRows_ > 0 ? kRows_ : kRowRegs * 4 <= 80 ? 4 : kRowRegs * 2 <= 80 ? 2 : 1;
  static constexpr int kBlockM = kThreads * kRows;
  static constexpr int kKS = (kK_ + 3) / 4 * 4;  // shared row of a point (float4 reads)
  static constexpr int kBlockN = kKS <= 16 ? 256 : 128;  // y points per shared-memory tile
  // Dynamic shared memory: the y tile (kBlockN, kKS), then its log-weights (kBlockN, kC).
  static constexpr int kSmemBytes = kBlockN * (kKS + kC_) * 4;
  // Points per trip of the pair loop (their maximum first, one rescale of the running sum): as
  // many as the y registers allow (kUnrollJ * kKS of them).
  static constexpr int kUnrollJ = kUnrollJ_ > 0 ? kUnrollJ_ : kKS <= 8 ? (kC_ <= 2 ? 4 : 2) : kKS <= 16 ? 2 : 1;
  static_assert(kVariant_ >= 0 && kVariant_ <= 3, "LseTraits: kVariant is 0..3");
  static_assert(kRows_ >= 0 && kRows_ <= 8 && kUnrollJ_ >= 0 && kUnrollJ_ <= 8, "LseTraits: kRows, kUnrollJ 0..8");
  static_assert(kBlockN % kUnrollJ == 0, "LseTraits: kUnrollJ must divide kBlockN");
  static constexpr int kVariant = kVariant_;
  static constexpr bool kLazy = kVariant_ >= 1;
  // The log-weight rides in y's first padding slot (one float4 read per point).
  static constexpr bool kLInY = kLazy && kC_ == 1 && kK_ % 4 != 0;
  // Reference and scale folded into the distance's FFMA chain (Gaussian-l2, one column).
  static constexpr bool kFold = kVariant_ >= 2 && kC_ == 1 && kSquared;
  // The expanded exponent (kVariant 3, one column, exp(-S d^2) of the squared l2 distance d^2).
  static constexpr bool kExpand = kVariant_ == 3 && kC_ == 1 && kInnerPow_ == Power::Square &&
                                  ((kSquared) || (kOuterPow_ == Power::Noop && kEpilogue_ == Epilogue::Laplace));

  // exact::accumulate's choice of pipe for |d|^p: MUFU throughout.
  __host__ __device__ static constexpr bool exp2_on_fma(int, int) { return false; }
};

namespace lse_detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr float kLowest = -3.40282347e38f;  // the running maximum of no term
__device__ __forceinline__ float neg_inf() { return math::bits_float(int(0xff800000u)); }

// log(sum) in natural units from the base-2 (mx, s): -inf where every term is (s = 0, log2 -inf),
// NaN where one is (s NaN).
__device__ __forceinline__ float finish(float mx, float s) { return (mx + log2f(s)) * kLn2; }

// The hyper-parameters of batch entry `index`.
struct Hypers {
  HyperParam inner_p, outer_p, bandwidth;
};

// An epilogue functor's constants of one batch entry; its term log2 k of a squared distance.
template <class Tr, bool kFunctor = Tr::kFunctor>
struct LseFunctor {
  __device__ __forceinline__ LseFunctor(const Hypers&, const BatchIndex&) {}
  __device__ __forceinline__ float operator()(float acc) const { return acc; }
};
template <class Tr>
struct LseFunctor<Tr, true> {
  typename Tr::Epi::Args fa;
  float s;
  __device__ __forceinline__ LseFunctor(const Hypers& hp, const BatchIndex& bi) {
    fa = Tr::Epi::args(epilogue::Params{hp.bandwidth.at(bi), hp.inner_p.at(bi), hp.outer_p.at(bi)});
    s = Tr::Epi::scale(fa);
  }
  __device__ __forceinline__ float operator()(float acc) const { return Tr::Epi::log2_value(acc * s, fa); }
};
struct NoLseFunctor {};

// Point j of the staged tile (KS floats, 16-byte aligned) into registers.
template <int KS>
__device__ __forceinline__ void stage_point(const float* src, float (&dst)[KS]) {
#pragma unroll
  for (int q = 0; q < KS / 4; ++q) {
    const float4 f = reinterpret_cast<const float4*>(src)[q];
    dst[4 * q] = f.x, dst[4 * q + 1] = f.y, dst[4 * q + 2] = f.z, dst[4 * q + 3] = f.w;
  }
}

// Points j .. j + U - 1 of the staged tile against the thread's rows, FlashAttention's way: per
// row and column the U terms v (base 2), their maximum, the running sum rescaled once to the new
// maximum mn (one exp2), then s += exp2(v - mn) per term: 1 + 1/U exp2 per term. NaN terms drop
// out of the maximum and make s NaN; -inf terms add 0; mx starts at the lowest finite float (a
// rescale of an empty sum never forms -inf - -inf).
template <class Tr, int U, class Fn = NoLseFunctor>
__device__ __forceinline__ void pairs(const float* ys, const float* ls, int j, const float (&xr)[Tr::kRows][Tr::kK],
                                      const math::PowArgs& pw, float inv_outer_p, float scale2,
                                      float (&mx)[Tr::kRows][Tr::kC], float (&sm)[Tr::kRows][Tr::kC],
                                      const Fn& fn = Fn{}) {
  constexpr int R = Tr::kRows, KS = Tr::kKS, KK = Tr::kK, C = Tr::kC;
  float yj[U][KS], lj[U][C];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    stage_point<KS>(ys + (j + u) * KS, yj[u]);
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
      if constexpr (Tr::kFunctor) {
        t[u] = fn(acc);  // log2 k
      } else {
        float d = acc;
        if constexpr (!Tr::kSquared) {
          if constexpr (Tr::kOuterPow == Power::Sqrt) d = math::sqrt_approx(acc);  // MUFU, no slow-path call
          if constexpr (Tr::kOuterPow == Power::Pow) d = powf(acc, inv_outer_p);
          if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = d * d;
        }
        t[u] = d * scale2;
      }
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

// ---------------------------------------------------------------- lazy reference (kVariant 1, 2)
// Per row and column a reference ref and s = sum exp2(v - ref) over the terms v seen so far. ref
// moves only when a trip leaves s above kLazyMax (a term above ref + 32, an overflow to inf, or
// the first finite term against the initial lowest float): the trip is then redone from the s
// before it against mn = max(the trip's terms, ref + log2 s), so s stays in [~1, 2^32] and no
// term or sum overflows (N < 2^31 terms <= 1 each add less than 2^32). The moves depend on the
// data only (fixed order): the same bits for the same inputs. NaN terms make s NaN (a NaN s
// fails the compare: no redo); -inf terms add 0; padded points (y = 0, weight -inf) add +0.
constexpr float kLazyMax = 4294967296.0f;  // 2^32

// The lazy loop's exponent (CTA uniform): the plain v = fma(d, -S, lw) - ref; the fold (kVariant 2);
// the expanded exponent (kVariant 3): with u = x - c, w = y - c about the planner's centre c
// (distances are translation invariant), -S |u - w|^2 + lw = a_m + bl_n + sum_k x'_k w_k with
// x' = 2 S u and a_m = -S |u|^2 per row (registers), bl_n = -S |w|^2 + lw per point (staged with
// w: y's padding slot or the weight array). The row keeps c_m = a_m - ref in mx and a pair costs
// K FFMA + 1 FADD: e = (c_m + x'.w) + bl_n = v - ref; the result's reference is a_m - c_m. Its
// rounding error is ~2^-24 S (|u|^2 + |w|^2) instead of the direct form's ~2^-24 S |u - w|^2: the
// planner (plan/logsumexp.py expand_params) takes it only where that stays below its tolerance,
// and a CTA with a non-finite row keeps the direct loop (an infinite row against an infinite
// point is NaN there; the expansion cannot tell).
constexpr int kPathPlain = 0, kPathFold = 1, kPathExpand = 2;
constexpr float kHighest = 3.40282347e38f;  // the expanded path's c_m of no term (ref = lowest)

// The pre-scale phi of (x row, y point): the sum of inner terms started at acc0 (the fold's a),
// then the outer power / square unless phi is the squared sum itself.
template <class Tr, int KS>
__device__ __forceinline__ float pre_phi(const float (&xr)[Tr::kK], const float (&yv)[KS], float acc0, int i,
                                         const math::PowArgs& pw, float inv_outer_p) {
  float acc = acc0;
#pragma unroll
  for (int q = 0; q < Tr::kK; ++q) acc = exact::accumulate<Tr>(acc, xr[q], yv[q], i, q, pw);
  float d = acc;
  if constexpr (!Tr::kSquared) {
    if constexpr (Tr::kOuterPow == Power::Sqrt) d = math::sqrt_approx(acc);
    if constexpr (Tr::kOuterPow == Power::Pow) d = powf(acc, inv_outer_p);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) d = d * d;
  }
  return d;
}

// The lazy loop's constants of a batch entry: scale2 = -S (S = log2(e) / bw or log2(e) / (2 bw^2)),
// 1 / S for the fold's a = ref / S.
struct LazyArgs {
  float scale2, inv_s;
};

// A pointer the compiler cannot prove equal to its argument: the redo re-reads the tile instead of
// keeping the trip's differences and terms alive in registers for it.
template <class P>
__device__ __forceinline__ P* opaque(P* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
#endif
  return p;
}

// The trip of row i, column c redone against a new reference (rare: the first finite terms, a
// term 2^32 above the reference), its points re-read from the tile; s0 is the sum before the
// trip, ref is a = ref / S on the fold's path, c_m = a_m - ref on the expanded one.
template <class Tr, int U, int kPath>
__device__ __forceinline__ void lazy_redo(const float* ys, const float* ls, int j, const float (&xr)[Tr::kK], int i,
                                          int c, const math::PowArgs& pw, float inv_outer_p, LazyArgs la, float s0,
                                          float& ref, float& s) {
  constexpr int KS = Tr::kKS, C = Tr::kC;
  ys = opaque(ys), ls = opaque(ls);
  float yj[U][KS], lj[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int q = 0; q < KS; ++q) yj[u][q] = ys[(j + u) * KS + q];
    lj[u] = Tr::kLInY ? yj[u][Tr::kK] : ls[(j + u) * C + c];
  }
  float d[U], mn = neg_inf();
  if constexpr (kPath == kPathExpand) {  // the terms minus a_m, against -c_m (the old reference minus a_m)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float e = 0.0f;
#pragma unroll
      for (int q = 0; q < Tr::kK; ++q) e = math::fma_rn(xr[q], yj[u][q], e);
      mn = fmaxf(mn, math::add_rn(e, lj[u]));
    }
    mn = fmaxf(mn, math::add_rn(-ref, math::lg2_approx(s0)));
    const float cn = -mn;
    float acc = s0 * math::ex2_approx(math::sub_rn(cn, ref));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float e = cn;
#pragma unroll
      for (int q = 0; q < Tr::kK; ++q) e = math::fma_rn(xr[q], yj[u][q], e);
      acc = math::add_rn(acc, math::ex2_approx(math::add_rn(e, lj[u])));
    }
    ref = cn, s = acc;
    return;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    d[u] = pre_phi<Tr, KS>(xr, yj[u], 0.0f, i, pw, inv_outer_p);
    mn = fmaxf(mn, math::fma_rn(d[u], la.scale2, lj[u]));
  }
  constexpr bool kFoldPath = kPath == kPathFold;
  const float old = kFoldPath ? -la.scale2 * ref : ref;  // the reference in log2 units
  mn = fmaxf(mn, math::add_rn(old, math::lg2_approx(s0)));  // s0 = 0: -inf
  float acc;
  if constexpr (kFoldPath) {
    const float a = mn * la.inv_s;
    const float now = -la.scale2 * a;
    acc = s0 * math::ex2_approx(math::fma_rn(-la.scale2, ref, -now));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float e = pre_phi<Tr, KS>(xr, yj[u], a, i, pw, inv_outer_p);
      acc = math::add_rn(acc, math::ex2_approx(math::fma_rn(e, la.scale2, lj[u])));
    }
    ref = a;
  } else {
    acc = s0 * math::ex2_approx(math::sub_rn(old, mn));
#pragma unroll
    for (int u = 0; u < U; ++u)
      acc = math::add_rn(acc, math::ex2_approx(math::sub_rn(math::fma_rn(d[u], la.scale2, lj[u]), mn)));
    ref = mn;
  }
  s = acc;
}

// Points j .. j + U - 1 of the staged tile (whole trips: padded points add +0) against the
// thread's rows. kPathFold: the reference lives in mx as a = ref / S and starts the distance's
// FFMA chain, the exponent one FFMA: fma(d^2 + a, -S, lw) (Gaussian-l2, one column).
// kPathExpand: mx holds c_m = a_m - ref, xr the rows' x', the tile w and bl (see kPathExpand).
template <class Tr, int U, int kPath>
__device__ __forceinline__ void pairs_lazy(const float* ys, const float* ls, int j,
                                           const float (&xr)[Tr::kRows][Tr::kK], const math::PowArgs& pw,
                                           float inv_outer_p, LazyArgs la, float (&mx)[Tr::kRows][Tr::kC],
                                           float (&sm)[Tr::kRows][Tr::kC]) {
  constexpr int R = Tr::kRows, KS = Tr::kKS, C = Tr::kC;
  float yj[U][KS], lj[U][C];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    stage_point<KS>(ys + (j + u) * KS, yj[u]);
    if constexpr (Tr::kLInY) {
      lj[u][0] = yj[u][Tr::kK];
    } else if constexpr (C == 1 && U % 4 == 0) {
      if (u % 4 == 0) {
        const float4 f = *reinterpret_cast<const float4*>(ls + j + u);
        lj[u][0] = f.x, lj[u + 1 < U ? u + 1 : u][0] = f.y, lj[u + 2 < U ? u + 2 : u][0] = f.z,
        lj[u + 3 < U ? u + 3 : u][0] = f.w;
      }
    } else {
#pragma unroll
      for (int c = 0; c < C; ++c) lj[u][c] = ls[(j + u) * C + c];
    }
  }
  // Every row's sums first, then one test for the trip (the redo is rare; one branch per trip).
  float st[R][C];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if constexpr (kPath == kPathExpand) {
      float s = sm[i][0];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float e = mx[i][0];
#pragma unroll
        for (int q = 0; q < Tr::kK; ++q) e = math::fma_rn(xr[i][q], yj[u][q], e);
        s = math::add_rn(s, math::ex2_approx(math::add_rn(e, lj[u][0])));
      }
      st[i][0] = s;
    } else if constexpr (kPath == kPathFold) {
      float s = sm[i][0];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float e = pre_phi<Tr, KS>(xr[i], yj[u], mx[i][0], i, pw, inv_outer_p);
        s = math::add_rn(s, math::ex2_approx(math::fma_rn(e, la.scale2, lj[u][0])));
      }
      st[i][0] = s;
    } else {
      float d[U];
#pragma unroll
      for (int u = 0; u < U; ++u) d[u] = pre_phi<Tr, KS>(xr[i], yj[u], 0.0f, i, pw, inv_outer_p);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float s = sm[i][c];
        const float ref = mx[i][c];
#pragma unroll
        for (int u = 0; u < U; ++u)
          s = math::add_rn(s, math::ex2_approx(math::fma_rn(d[u], la.scale2, lj[u][c]) - ref));
        st[i][c] = s;
      }
    }
  }
  // One compare per trip: the largest sum (fmaxf drops NaN sums, which need no redo).
  float smax = st[0][0];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < C; ++c) smax = fmaxf(smax, st[i][c]);
  if (smax > kLazyMax) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (st[i][c] > kLazyMax)
          lazy_redo<Tr, U, kPath>(ys, ls, j, xr[i], i, c, pw, inv_outer_p, la, sm[i][c], mx[i][c], st[i][c]);
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < C; ++c) sm[i][c] = st[i][c];
}

}  // namespace lse_detail

extern __shared__ __align__(16) unsigned char kl_lse_smem[];

// Grid: (row tiles, N splits, batch entries (looped beyond gridDim.z)). n_split CTAs share a
// row tile, each over `per` y tiles. C <= kC columns of lw and out (the planner's chunk).
// expand (kVariant 3): null, or the planner's [flag, centre (K)]: flag > 0 takes the expanded
// exponent (lse_detail::kPathExpand) about that centre in every CTA whose rows are finite.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) lse_kernel(
    const typename Traits::T* __restrict__ x, const typename Traits::T* __restrict__ y,
    const typename Traits::T* __restrict__ lw, typename Traits::T* __restrict__ out, float* __restrict__ scratch,
    int M, int N, int K, int C, i64 sxm, i64 sxk, i64 sym, i64 syk, i64 sln, i64 slc, i64 som, i64 soc, int batch,
    int batch_n1, int batch_n2, i64 x_bs0, i64 x_bs1, i64 x_bs2, i64 y_bs0, i64 y_bs1, i64 y_bs2, i64 l_bs0,
    i64 l_bs1, i64 l_bs2, i64 o_bs0, i64 o_bs1, i64 o_bs2, const float* inner_p_ptr, i64 inner_p_bs0,
    i64 inner_p_bs1, i64 inner_p_bs2, float inner_p, const float* outer_p_ptr, i64 outer_p_bs0, i64 outer_p_bs1,
    i64 outer_p_bs2, float outer_p, const float* bw_ptr, i64 bw_bs0, i64 bw_bs1, i64 bw_bs2, float bandwidth,
    int n_split, int per, const float* __restrict__ expand) {
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
    // The fold (kVariant 2) where S = -scale2 keeps a = ref / S and S a in range; else the plain loop.
    const bool fold = Tr::kFold && -scale2 >= 0x1p-20f && -scale2 <= 0x1p40f;
    const LazyArgs la{scale2, fold ? -1.0f / scale2 : 0.0f};

    float xr[R][KK], mx[R][KC], sm[R][KC], xa[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int m = m0 + tid + i * Tr::kThreads;
      const bool live = m < M;
#pragma unroll
      for (int q = 0; q < KK; ++q) xr[i][q] = (live && q < K) ? load_f(xl + i64(m) * sxm + i64(q) * sxk) : 0.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) mx[i][c] = kLowest, sm[i][c] = 0.0f;
    }
    // The expanded exponent (CTA uniform): the planner's flag and every row's |x - c|^2 finite.
    bool expand_cta = false;
    if constexpr (Tr::kExpand) {
      if (expand != nullptr && expand[0] > 0.0f) {  // the same for every CTA
        bool ok = true;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float n2 = 0.0f;
#pragma unroll
          for (int q = 0; q < KK; ++q) {
            const float u = math::sub_rn(xr[i][q], q < K ? expand[1 + q] : 0.0f);
            n2 = math::fma_rn(u, u, n2);
          }
          xa[i] = math::mul_rn(scale2, n2);  // a_m = -S |u|^2
          ok = ok && fabsf(xa[i]) <= -kLowest;  // NaN fails
        }
        expand_cta = __syncthreads_and(ok) != 0;
      }
      if (expand_cta) {
        const float s2 = -2.0f * scale2;  // x' = 2 S u
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int q = 0; q < KK; ++q)
            xr[i][q] = math::mul_rn(s2, math::sub_rn(xr[i][q], q < K ? expand[1 + q] : 0.0f));
          mx[i][0] = kHighest;  // c_m = a_m - ref with ref the lowest float: the first terms redo
        }
      }
    }

    for (int n0 = n_begin; n0 < n_end; n0 += BN) {
      const int jn = min(BN, n_end - n0);
      __syncthreads();  // the previous tile is consumed
      constexpr int U = Tr::kUnrollJ;
      if constexpr (Tr::kLazy) {
        // Whole trips: the points past jn have coordinates 0 and weights -inf (terms +0).
        const int jround = (jn + U - 1) / U * U;
        for (int e = tid; e < BN * KS; e += Tr::kThreads) {
          const int j = e / KS, q = e - j * KS;
          float v = (j < jn && q < K) ? load_f(yl + i64(n0 + j) * sym + i64(q) * syk) : 0.0f;
          if (Tr::kLInY && q == KK) v = j < jn ? load_f(ll + i64(n0 + j) * sln) * kLog2e : neg_inf();
          ys[e] = v;
        }
        if constexpr (!Tr::kLInY) {
          for (int e = tid; e < BN * KC; e += Tr::kThreads) {
            const int j = e / KC, c = e - j * KC;
            ls[e] = j >= jn ? neg_inf() : c < C ? load_f(ll + i64(n0 + j) * sln + i64(c) * slc) * kLog2e : 0.0f;
          }
        }
        __syncthreads();
        if constexpr (Tr::kExpand) {
          if (expand_cta) {
            // One thread per point: w = y - c and bl = -S |w|^2 + lw in place of y and lw (a
            // non-finite |w|^2: zero coordinates, bl = -inf + lw or NaN, as the direct form gives).
            for (int j = tid; j < BN; j += Tr::kThreads) {
              float* p = ys + j * KS;
              float w[KK], n2 = 0.0f;
#pragma unroll
              for (int q = 0; q < KK; ++q) {
                w[q] = math::sub_rn(p[q], q < K ? expand[1 + q] : 0.0f);
                n2 = math::fma_rn(w[q], w[q], n2);
              }
              const float b = math::mul_rn(scale2, n2);
              const bool finite = fabsf(b) <= -kLowest;
#pragma unroll
              for (int q = 0; q < KK; ++q) p[q] = finite ? w[q] : 0.0f;
              float& l = Tr::kLInY ? p[KK] : ls[j];
              l = math::add_rn(b, l);
            }
            __syncthreads();
#pragma unroll 1
            for (int j = 0; j < jround; j += U) pairs_lazy<Tr, U, kPathExpand>(ys, ls, j, xr, pw, inv_outer_p, la, mx, sm);
            continue;
          }
        }
        if (fold) {
#pragma unroll 1
          for (int j = 0; j < jround; j += U)
            pairs_lazy<Tr, U, Tr::kFold ? kPathFold : kPathPlain>(ys, ls, j, xr, pw, inv_outer_p, la, mx, sm);
        } else {
#pragma unroll 1
          for (int j = 0; j < jround; j += U) pairs_lazy<Tr, U, kPathPlain>(ys, ls, j, xr, pw, inv_outer_p, la, mx, sm);
        }
      } else {
        for (int e = tid; e < BN * KS; e += Tr::kThreads) {
          const int j = e / KS, q = e - j * KS;
          ys[e] = (j < jn && q < K) ? load_f(yl + i64(n0 + j) * sym + i64(q) * syk) : 0.0f;
        }
        for (int e = tid; e < BN * KC; e += Tr::kThreads) {
          const int j = e / KC, c = e - j * KC;
          ls[e] = (j < jn && c < C) ? load_f(ll + i64(n0 + j) * sln + i64(c) * slc) * kLog2e : 0.0f;
        }
        __syncthreads();
        const int jfull = jn - jn % U;
        if constexpr (Tr::kFunctor) {
          const LseFunctor<Tr> fn(hp, bi);
#pragma unroll 1
          for (int j = 0; j < jfull; j += U) pairs<Tr, U>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm, fn);
#pragma unroll 1
          for (int j = jfull; j < jn; ++j) pairs<Tr, 1>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm, fn);
        } else {
#pragma unroll 1
          for (int j = 0; j < jfull; j += U) pairs<Tr, U>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm);
#pragma unroll 1
          for (int j = jfull; j < jn; ++j) pairs<Tr, 1>(ys, ls, j, xr, pw, inv_outer_p, scale2, mx, sm);
        }
      }
    }
    if (expand_cta) {  // mx holds c_m = a_m - ref: the reference (lowest float while no term)
#pragma unroll
      for (int i = 0; i < R; ++i) mx[i][0] = fmaxf(math::sub_rn(xa[i], mx[i][0]), kLowest);
    } else if (fold) {  // mx holds a = ref / S: the reference itself (lowest float while no term)
#pragma unroll
      for (int i = 0; i < R; ++i) mx[i][0] = fmaxf(-scale2 * mx[i][0], kLowest);
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
