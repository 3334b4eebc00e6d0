// matvec_grad: the data-input gradients of kernel_matvec, without the kernel matrix.
//
// For a DIFF descriptor (inner power |t|^q, outer power D, epilogue E) the
// forward is out[m,c] = sum_n E(D(acc[m,n])) v[n,c] (+ regularisation, which
// does not depend on the data), acc[m,n] = sum_k |a[m,k] - b[n,k]|^q.  With the
// upstream gradient g (M, C) its derivative with respect to a is
//
//   out[l][m,k] = sum_n phi(acc[m,n]) * (g[m,:] . v[n,:]) * psi(a[m,k] - b[n,k])
//
//   phi(acc) = q * E'(d) * D'(acc),  d = D(acc)     (0 where d < epsilon)
//   psi(t)   = sgn(t) |t|^(q-1)                      (0 where t == 0)
//
// and the gradient with respect to b is the same contraction with (a, g) and
// (b, v) exchanged (acc is symmetric; psi is odd, and the sign of the swapped
// difference is the sign of the b-gradient).  The conventions are those of the
// dense backward (kermac_like/ops/distance_backward.py): phi = 0 where d == 0
// for the SQRT and POW outer powers (D' is unbounded there), psi = sgn(t) for
// q = 1, t for q = 2 (the q of phi carries the factor 2), psi(0) = 0 for every
// q; NaN inputs give NaN (a NaN d keeps its NaN weight, sgn(NaN) = NaN).
//
// FlashAttention's structure with phi in place of the softmax: each CTA owns
// kBlockM = kThreads * kRows rows of a (every thread kRows rows, a and g held
// in registers, zero-padded to kK / kC), loops over b and v in tiles of kBlockN
// rows staged in shared memory (every thread reads the same element: a
// broadcast), forms acc, phi and u = g[m,:] . v[n,:] in registers and
// accumulates u * phi * psi(t) into kK outputs per row.  Nothing of size
// M x N exists anywhere.  Accumulation: each tile is summed in registers
// (at most kBlockN terms), tile sums are added with Kahan compensation, so the
// rounding error does not grow with N.  Every output is written once by the
// thread that owns its row, in a fixed order: the result is bitwise
// reproducible (no atomics).
//
// Per pair (m, n) and kK = 3, kC = 1, Gaussian-l2: 3 FADD, 3 FFMA/FMUL (acc),
// 1 FMUL + 1 MUFU.EX2 (phi), 1 FMUL (w; with C = 1, g[m] multiplies the
// finished sum instead of every pair), 3 FFMA (outputs): 10 FP32
// operations and one exponential (phi's constant factor lives in the g rows),
// against about 8 and one for the forward.
//
// Only NVRTC built-ins are used (no <cuda_runtime.h>).  The `#else` branches of
// the helpers are plain C++ so that tests/test_matvec_grad.py can execute the
// kernel on the CPU (g++ and a thread-per-CUDA-thread shim).
#pragma once

#include "common.cuh"
#include "epilogue.cuh"
#include "math.cuh"

namespace kermac_like {

// ---------------------------------------------------------------------------
// Traits: every launch constant derives from the template parameters.
// ---------------------------------------------------------------------------
// kK_: register width of the contracted mode per lane (K <= kK * kLanes; a and b are zero-padded
// to kK * kLanes in registers and shared memory, which adds 0 to acc and to the outputs).  kC_:
// likewise for the value mode of g and v.  kEpsilon_: whether the launch applies an epsilon (phi
// is then 0 where d < epsilon; without it, the NONE epilogue with a NOOP outer power never forms
// acc at all).  kUnroll_: unrolling of the loop over the b rows of a tile (1 or 2).  kLanes_: the
// lanes that share one row of a (1, 2, 4 or 8; many coordinates, K > 32): lane j of a group owns
// coordinates [j kK, (j + 1) kK) of a, of the tile of b and of the outputs, and the group sums
// its partial acc with log2(kLanes) butterfly shuffles (every lane of the group then
// holds the same acc, summed in the same order), so that no thread holds more than 32 coordinates.
// Epi_: void, or an epilogue functor (epilogue.cuh; base Square, Noop, None, no epsilon): a formula
// kernel's gradient, phi = 2 dk/d(r2) from the functor's dk_dr2 (the fused formula backward,
// ops.matvec._FormulaMatvec: the contraction with the direct differences x_m - y_n, no cancellation
// of two split terms); its hyper-parameter slots p0, p1, p2 ride in bw, q and r.
template <Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, int kK_, int kC_, bool kEpsilon_ = false,
          int kUnroll_ = 2, int kLanes_ = 1, class Epi_ = void>
struct MatvecGradTraits {
  static_assert(kInnerPow_ == Power::Abs || kInnerPow_ == Power::Square || kInnerPow_ == Power::Pow,
                "MatvecGradTraits: the inner power must be Power::Abs, Power::Square or Power::Pow "
                "(DOT descriptors take the separable matrix-product path)");
  static_assert(kOuterPow_ == Power::Noop || kOuterPow_ == Power::Sqrt || kOuterPow_ == Power::Pow,
                "MatvecGradTraits: the outer power must be Power::Noop, Power::Sqrt or Power::Pow");
  static_assert(kK_ >= 1 && kK_ <= 32, "MatvecGradTraits: kK must be in 1..32");
  static_assert(kC_ >= 1 && kC_ <= 32, "MatvecGradTraits: kC must be in 1..32");
  static_assert(kUnroll_ == 1 || kUnroll_ == 2, "MatvecGradTraits: kUnroll must be 1 or 2");
  static_assert(kLanes_ == 1 || kLanes_ == 2 || kLanes_ == 4 || kLanes_ == 8,
                "MatvecGradTraits: kLanes must be 1, 2, 4 or 8");
  static_assert(kLanes_ == 1 || kK_ % 4 == 0, "MatvecGradTraits: kK must be a multiple of 4 when kLanes > 1");

  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr int kK = kK_;
  static constexpr int kC = kC_;
  static constexpr bool kEpsilon = kEpsilon_;
  static constexpr int kUnroll = kUnroll_;
  static constexpr int kLanes = kLanes_;
  static constexpr int kKAll = kK_ * kLanes_;  // the padded width of a row of a and b
  using Epi = Epi_;
  static constexpr bool kFunctor = epilogue::IsFunctor<Epi_>::value;
  static_assert(!kFunctor || (kInnerPow_ == Power::Square && kOuterPow_ == Power::Noop &&
                              kEpilogue_ == Epilogue::None && !kEpsilon_),
                "MatvecGradTraits: an epilogue functor needs the base Square, Noop, None and no epsilon");
  // Whether phi needs acc (NONE with a NOOP outer power and no epsilon is the constant q).
  static constexpr bool kNeedsAcc =
      kFunctor || !(kOuterPow_ == Power::Noop && kEpilogue_ == Epilogue::None && !kEpsilon_);

  // Rows per thread: each shared-memory read of b and v serves kRows pairs.
  // Registers per row: a, the tile sum, the running sum and its compensation
  // (4 kK) and g (kC); about 96 of them per thread for the rows.
  static constexpr int kRowBudget = 96 / (4 * kK + kC);
  static constexpr int kRows = kRowBudget < 1 ? 1 : (kRowBudget > 4 ? 4 : kRowBudget);
  static constexpr int kThreads = 128;
  static constexpr int kRowsPerPass = kThreads / kLanes;  // rows of a CTA's threads at one row each
  static constexpr int kBlockM = kRowsPerPass * kRows;
  // b tile rows: 128 up to 64 padded coordinates, fewer beyond (dynamic shared memory <= 33 KB).
  static constexpr int kBlockN = kKAll <= 64 ? 128 : (kKAll <= 128 ? 64 : 32);
  static constexpr int kSmemBytes = kBlockN * (kKAll + kC) * 4;  // dynamic: b tile, then v tile
};

namespace matvec_grad_detail {

extern __shared__ __align__(16) float kl_matvec_grad_smem[];

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float rsqrt_approx(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.0f / std::sqrt(x);
#endif
}

__device__ __forceinline__ float div_approx(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdividef(x, y);
#else
  return x / y;
#endif
}

// phi(acc) = q E'(d) D'(acc) for one batch entry: operator() returns phi / scale
// (the kernel multiplies scale into its g rows once instead of into every pair).
//   NOOP:  d = acc            D' = 1
//   SQRT:  d = acc^(1/2)      D' = 1 / (2 d)            (0 where acc <= 0)
//   POW:   d = acc^(1/r)      D' = d^(1-r) / r          (0 where acc <= 0)
//   NONE: E' = 1;  LAPLACE: E' = -exp(-d/bw) / bw;  GAUSSIAN: E' = -(d/bw^2) exp(-d^2/(2 bw^2))
// SQRT with GAUSSIAN needs neither a root nor a division:
//   phi = -(q / (2 bw^2)) exp(-acc / (2 bw^2)), and its value at acc = 0 is that
// finite limit rather than the dense backward's 0 (both are multiplied by
// psi(t) = t, which is 0 or below 1e-19 there).
template <Power kOuter, Epilogue kEpi, bool kEps>
struct Phi {
  float scale;  // the constant factor
  float ex;     // log2(e) times the exponent's factor
  float rinv;   // 1 / r            (POW)
  float dpow;   // (1 - r) / r      (POW): d^(1-r) = acc^dpow
  float eps;

  __device__ __forceinline__ Phi(float q, float r, float bw, float eps_) : scale(q), ex(0.0f), rinv(1.0f),
                                                                            dpow(0.0f), eps(eps_) {
    float f = q;
    if constexpr (kOuter == Power::Sqrt) {
      f = 0.5f * q;
    } else if constexpr (kOuter == Power::Pow) {
      rinv = 1.0f / r;
      dpow = (1.0f - r) / r;
      f = q / r;
    }
    if constexpr (kEpi == Epilogue::None) {
      scale = f;
    } else if constexpr (kEpi == Epilogue::Laplace) {
      scale = -f / bw;
      ex = -kLog2e / bw;
    } else {
      scale = -f / (bw * bw);
      ex = -kLog2e / (2.0f * bw * bw);
    }
  }

  __device__ __forceinline__ float operator()(float acc) const {
    float phi, d;
    if constexpr (kOuter == Power::Noop) {
      d = acc;
      if constexpr (kEpi == Epilogue::None) {
        phi = 1.0f;
      } else if constexpr (kEpi == Epilogue::Laplace) {
        phi = math::ex2_approx(d * ex);
      } else {
        phi = d * math::ex2_approx(d * d * ex);
      }
    } else if constexpr (kOuter == Power::Sqrt) {
      if constexpr (kEpi == Epilogue::Gaussian) {
        phi = math::ex2_approx(acc * ex);
        d = kEps ? acc * rsqrt_approx(acc) : 0.0f;
      } else {
        const float rs = rsqrt_approx(acc);
        d = acc * rs;
        if constexpr (kEpi == Epilogue::None) {
          phi = rs;
        } else {
          phi = rs * math::ex2_approx(d * ex);
        }
        phi = acc == 0.0f ? 0.0f : phi;  // a NaN acc keeps its NaN
      }
    } else {
      const float lg = math::lg2_approx(acc);
      d = math::ex2_approx(lg * rinv);
      const float dr = math::ex2_approx(lg * dpow);  // d^(1-r)
      if constexpr (kEpi == Epilogue::None) {
        phi = dr;
      } else if constexpr (kEpi == Epilogue::Laplace) {
        phi = dr * math::ex2_approx(d * ex);
      } else {
        phi = dr * d * math::ex2_approx(d * d * ex);
      }
      phi = acc == 0.0f ? 0.0f : phi;  // a NaN acc keeps its NaN
    }
    if constexpr (kEps) {
      phi = d < eps ? 0.0f : phi;
    }
    return phi;
  }
};

// phi of an epilogue functor: 2 dk/d(r2) (the inner power's q = 2 as the constant factor), the
// functor's constants from the slots p0 = bw, p1 = q, p2 = r.
template <class E>
struct FunctorPhi {
  float scale;  // the constant factor q = 2
  typename E::Args fa;
  float s;  // the functor's scale: dk_dr2 takes z = s acc

  __device__ __forceinline__ FunctorPhi(float q, float r, float bw, float) : scale(2.0f) {
    fa = E::args(epilogue::Params{bw, q, r});
    s = E::scale(fa);
  }
  __device__ __forceinline__ float operator()(float acc) const { return E::dk_dr2(acc * s, fa); }
};

template <class Tr, bool kFunctor = Tr::kFunctor>
struct PhiOf {
  using type = Phi<Tr::kOuterPow, Tr::kEpilogue, Tr::kEpsilon>;
};
template <class Tr>
struct PhiOf<Tr, true> {
  using type = FunctorPhi<typename Tr::Epi>;
};

}  // namespace matvec_grad_detail

// ---------------------------------------------------------------------------
// The kernel.  Flat ABI (cuda.core passes no structs):
//   a (L?, M, K), b (L?, N, K), g (L?, M, C), v (L?, N, C): float32, rows
//     contiguous (row stride K or C); a_bs .. v_bs: element offsets between
//     batch entries (0: broadcast);
//   out (S, L, M, K): float32, dense; S = gridDim.y splits of the N range, split s
//     summing the rows [s n_per, (s + 1) n_per) of b and v into its slice out + s L M K
//     (the caller adds the S slices; S = 1: out holds the result);
//   hyp: nullptr (q, r, bw as given) or float32 triples (q, r, bw) per batch
//     entry at hyp + l * hyp_bs (hyp_bs 0: one triple for all);
//   eps: the epsilon (read only when kEpsilon); n_per: rows of b per split.
// Grid: (ceil(M / kBlockM), S, min(L, 65535)); the z blocks walk the batch.
// ---------------------------------------------------------------------------
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads) matvec_grad_kernel(
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ g,
    const float* __restrict__ v, float* __restrict__ out, int M, int N, int K, int C, int L, i64 a_bs,
    i64 b_bs, i64 g_bs, i64 v_bs, const float* __restrict__ hyp, i64 hyp_bs, float q, float r,
    float bw, float eps, int n_per) {
  using namespace matvec_grad_detail;
  constexpr int kK = Tr::kK;
  constexpr int kC = Tr::kC;
  constexpr int kRows = Tr::kRows;
  constexpr int kBN = Tr::kBlockN;
  constexpr int kKAll = Tr::kKAll;
  constexpr int kLanes = Tr::kLanes;
  constexpr bool kAcc = Tr::kNeedsAcc;
  float* bs = kl_matvec_grad_smem;  // [kBN][kKAll]
  float* vs = bs + kBN * kKAll;     // [kBN][kC]
  const int tid = threadIdx.x;
  const int lane = kLanes == 1 ? 0 : tid % kLanes;  // this thread's coordinates: [lane kK, lane kK + kK)
  const int slot = kLanes == 1 ? tid : tid / kLanes;
  const int k0 = lane * kK;
  const int m0 = blockIdx.x * Tr::kBlockM;
  const int n_lo = blockIdx.y * n_per;
  const int n_hi = N - n_lo < n_per ? N : n_lo + n_per;

  for (int l = blockIdx.z; l < L; l += gridDim.z) {
    const float* al = a + l * a_bs;
    const float* bl = b + l * b_bs;
    const float* gl = g + l * g_bs;
    const float* vl = v + l * v_bs;
    float ql = q, rl = r, bwl = bw;
    if (hyp != nullptr) {
      ql = hyp[l * hyp_bs];
      rl = hyp[l * hyp_bs + 1];
      bwl = hyp[l * hyp_bs + 2];
    }
    const typename PhiOf<Tr>::type phi_of(ql, rl, bwl, eps);

    float x[kRows][kK], gr[kRows][kC], sum[kRows][kK], comp[kRows][kK];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int m = m0 + i * Tr::kRowsPerPass + slot;
      const bool ok = m < M;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        x[i][k] = (ok && k0 + k < K) ? al[static_cast<i64>(m) * K + k0 + k] : 0.0f;
        sum[i][k] = 0.0f;
        comp[i][k] = 0.0f;
      }
#pragma unroll
      for (int c = 0; c < kC; ++c) gr[i][c] = (ok && c < C) ? gl[static_cast<i64>(m) * C + c] * phi_of.scale : 0.0f;
    }

    for (int n0 = n_lo; n0 < n_hi; n0 += kBN) {
      __syncthreads();  // the previous tile has been read by every thread
      for (int idx = tid; idx < kBN * kKAll; idx += Tr::kThreads) {
        const int j = idx / kKAll, k = idx - j * kKAll;
        const int n = n0 + j;
        bs[idx] = (n < n_hi && k < K) ? bl[static_cast<i64>(n) * K + k] : 0.0f;
      }
      for (int idx = tid; idx < kBN * kC; idx += Tr::kThreads) {
        const int j = idx / kC, c = idx - j * kC;
        const int n = n0 + j;
        vs[idx] = (n < n_hi && c < C) ? vl[static_cast<i64>(n) * C + c] : 0.0f;
      }
      __syncthreads();
      const int nt = n_hi - n0 < kBN ? n_hi - n0 : kBN;

      float part[kRows][kK];
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int k = 0; k < kK; ++k) part[i][k] = 0.0f;

#pragma unroll Tr::kUnroll
      for (int j = 0; j < nt; ++j) {
        float yb[kK], vb[kC];
#pragma unroll
        for (int k = 0; k < kK; ++k) yb[k] = bs[j * kKAll + k0 + k];
#pragma unroll
        for (int c = 0; c < kC; ++c) vb[c] = vs[j * kC + c];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float t[kK], pw[kK];
          float acc = 0.0f;
#pragma unroll
          for (int k = 0; k < kK; ++k) {
            t[k] = x[i][k] - yb[k];
            if constexpr (Tr::kInnerPow == Power::Abs) {
              acc += fabsf(t[k]);
            } else if constexpr (Tr::kInnerPow == Power::Square) {
              acc = math::fma_rn(t[k], t[k], acc);
            } else {
              pw[k] = math::abs_pow_mufu(t[k], ql);
              acc += pw[k];
            }
          }
          if constexpr (kLanes > 1 && kAcc) {  // the group's partial sums: the row's acc, in every lane
#pragma unroll
            for (int o = 1; o < kLanes; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
          }
          // kC == 1: g[m] is a factor of the whole sum over n (applied at the store).
          float u = kC == 1 ? vb[0] : gr[i][0] * vb[0];
#pragma unroll
          for (int c = 1; c < kC; ++c) u = math::fma_rn(gr[i][c], vb[c], u);
          const float w = kAcc ? phi_of(acc) * u : u;
#pragma unroll
          for (int k = 0; k < kK; ++k) {
            if constexpr (Tr::kInnerPow == Power::Abs) {
              // sgn(t): +-1, 0 for t == 0, NaN for NaN (t itself in the last two cases); selects, no
              // branches (the nested conditional compiled to a branch a coordinate)
              const float sg = fabsf(t[k]) > 0.0f ? copysignf(1.0f, t[k]) : t[k];
              part[i][k] = math::fma_rn(w, sg, part[i][k]);
            } else if constexpr (Tr::kInnerPow == Power::Square) {
              part[i][k] = math::fma_rn(w, t[k], part[i][k]);
            } else {
              // |t|^q / t = sgn(t) |t|^(q-1); 0 where t == 0.
              const float psi = t[k] != 0.0f ? div_approx(pw[k], t[k]) : 0.0f;
              part[i][k] = math::fma_rn(w, psi, part[i][k]);
            }
          }
        }
      }
      // Kahan: the tile sums (at most kBlockN terms each) into the running sums.
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const float y = part[i][k] - comp[i][k];
          const float s = sum[i][k] + y;
          comp[i][k] = (s - sum[i][k]) - y;
          sum[i][k] = s;
        }
    }

    float* ol = out + (static_cast<i64>(blockIdx.y) * L + l) * M * K;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int m = m0 + i * Tr::kRowsPerPass + slot;
      if (m < M) {
#pragma unroll
        for (int k = 0; k < kK; ++k)
          if (k0 + k < K) ol[static_cast<i64>(m) * K + k0 + k] = kC == 1 ? sum[i][k] * gr[i][0] : sum[i][k];
      }
    }
  }
}

}  // namespace kermac_like
