// k-means++ seeding (D^2 sampling) in rounds: kmeans_draw_kernel, kmeans_gap_kernel and
// kmeans_update_kernel (ABI: cuda_templates/ABI.md, built by kermac_like/plan/kmeans.py for
// kermac_like.cluster.kmeans_plusplus, whose torch path is the same algorithm).
//
// State over the N points (float32 data x (N, K), optional float32 weights w): the running
// minimum squared distance d2[i] to the centres folded in so far and its centre near[i] (int32);
// the sampling weights p[i] = d2[i] w[i] (float32 product; d2[i] without weights; w[i] or 1 before
// the first centre), never stored: block sums of p over blocks of kBlockM = 1024 points (the
// sampler's SAMPLE_BLOCK) in float64, bsum[(N + 1023) / 1024].
//
// A round starts with s centres folded into the state (s = 0: none) and draws centres s, s + 1, ...:
//
//   kmeans_draw_kernel (one CTA): the cumulative block sums cum (written to scratch), then
//     - centre s exactly from p (the proposal at uniform u[s][trials]: the first block whose
//       cumulative sum exceeds r = u x total, then in it the first point whose cumulative sum of p
//       exceeds r - (cum[b] - bsum[b]); the last block / point where none does; clamped to N - 1:
//       cluster.py's _Sampler.draw);
//     - each next centre j (j < s + kBlockN, j < C; only centre 0 when s = 0) by rejection from
//       the same stale p: up to `trials` proposals t at u[j][t], each accepted when
//       u[j][trials + 1 + t] p_s < p_j, with p_s the proposal's stale p and p_j its p against every
//       centre drawn so far (d2_j = min(d2, ||x - c_i||^2 for s <= i < j), times w). A proposal
//       comes with probability p_s / Z_s and is kept with probability p_j / p_s, so an accepted
//       point has probability p_j / Z_j: exactly D^2 sampling (Z_s / Z_j proposals on average).
//       When every proposal of a centre is rejected, the round ends before it: the next round
//       draws it exactly from the refreshed state (its own uniform u[j][trials]).
//     Where the total of p is 0, every remaining centre is N - 1 (the exact draw's clamp).
//     Writes idx[j], centres[j] for the centres drawn and count[0] = the next round's s.
//   kmeans_gap_kernel: gap[a] = min over the round's centres i of ||c_a - c_i||^2, a < s.
//   kmeans_update_kernel (one CTA per 1024 points): folds the round's centres [s, e) into the
//     state. A point whose centre a has gap[a] >= 4 d2 (1 + 1e-6) cannot get closer to any of them
//     (||c_i - c_a|| >= 2 d); the others (the CTA's candidates, compacted) take dn = ||x - c_i||^2
//     for every i in order, d2 = dn and near = i where dn < d2. A CTA where some point changed
//     writes its block sum of p again. s = -1: the block sums of w for the first draw.
//
// The host launches draw, then (reading count) gap and update, round after round: about
// C / kBlockN rounds plus one per centre whose proposals were all rejected. Determinism: every
// sum has a fixed order (distances over k in order, without contraction; block sums by a fixed
// tree; the draw's scans by fixed chunks and a fixed Hillis-Steele scan); no atomics. The same
// inputs and u give the same bits.
#pragma once

#include "common.cuh"
#include "storage16.cuh"
#include "math.cuh"
#include "block_reduce.cuh"

namespace kermac_like {

// kK_: the padded K of a point's row kept in registers (4, 8, 16, 32), or 0 for a runtime loop
// over any K (rows and centres read from global memory).
template <class T_, int kK_>
struct KmeansTraits {
  static_assert(SameType<T_, float>::value, "KmeansTraits: float32 data (16-bit data is upcast by the host)");
  static_assert(kK_ == 0 || kK_ == 4 || kK_ == 8 || kK_ == 16 || kK_ == 32, "KmeansTraits: kK is 0, 4, 8, 16 or 32");
  using T = T_;
  static constexpr int kK = kK_;
  static constexpr int kThreads = 256;
  static constexpr int kPoints = 4;                     // points per thread of the update
  static constexpr int kBlockM = kThreads * kPoints;    // points per block sum (SAMPLE_BLOCK)
  static constexpr int kBlockN = 128;                   // centres per round at most (the update's staging)
  static constexpr int kSmemBytes = 0;                  // static shared memory only
};

namespace kmeans_detail {

// 4 d^2 (1 + 1e-6) in float32, as cluster.py's `d2 * (4.0 * (1.0 + 1e-6))`.
constexpr float kMargin = 4.000004f;

// ||a - b||^2 in float32 over K coordinates, k in order, each square rounded before its add
// (torch's (x - c).square_().sum(1) term by term; no contraction, so the CPU shim gives the same
// bits). a and b with their own strides.
__device__ __forceinline__ float sq_dist(const float* a, i64 sa, const float* b, i64 sb, int K) {
  float acc = 0.0f;
#pragma unroll 4
  for (int q = 0; q < K; ++q) {
    const float d = math::sub_rn(a[q * sa], b[q * sb]);
    acc = math::add_rn(acc, math::mul_rn(d, d));
  }
  return acc;
}

// The same from a row in registers (kK values, those past K unused) and a centre (unit stride).
template <int kK>
__device__ __forceinline__ float sq_dist_reg(const float* v, const float* c, int K) {
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < kK; ++q) {
    if (q < K) {
      const float d = math::sub_rn(v[q], c[q]);
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

}  // namespace kmeans_detail

// Grid ((N + kBlockM - 1) / kBlockM, 1, 1): CTA b owns points [b kBlockM, (b + 1) kBlockM), thread t
// the points b kBlockM + t + e kThreads (e < kPoints, coalesced). s = -1: bsum[b] = the block's sum
// of w (or its point count). s >= 0: the round's centres [s, e) (e - s <= kBlockN; centres with row
// stride ldc) folded into (d2, near) as described above; s = 0 sets every point's state (d2 and
// near not read; the first centre taken without comparison). gap is read for s > 0 only.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_update_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ centres,
    const float* __restrict__ gap, float* __restrict__ d2, int* __restrict__ near, double* __restrict__ bsum, int N,
    int K, i64 sxm, i64 sxk, i64 ldc, int s, int e) {
  using Tr = Traits;
  using namespace kmeans_detail;
  constexpr int T = Tr::kThreads, P = Tr::kPoints, BM = Tr::kBlockM, kK = Tr::kK;
  __shared__ double red[T];
  const int tid = threadIdx.x;
  const i64 base = i64(blockIdx.x) * BM;

  if (s < 0) {  // the first draw's weights
    double part = 0.0;
#pragma unroll
    for (int q = 0; q < P; ++q) {
      const i64 i = base + tid + q * T;
      if (i < N) part += w ? double(w[i]) : 1.0;
    }
    const double sum = block_sum<T>(red, part);
    if (tid == 0) bsum[blockIdx.x] = sum;
    return;
  }

  __shared__ double scan[2][T];
  __shared__ float sd2[BM];
  __shared__ int list[BM];
  __shared__ float sc[kK > 0 ? Tr::kBlockN * kK : 1];
  const int nc = e - s;
  if constexpr (kK > 0) {  // the round's centres, kK floats each (0 past K)
    for (int r = tid; r < nc * kK; r += T) {
      const int c = r / kK, q = r - c * kK;
      sc[r] = q < K ? centres[i64(s + c) * ldc + q] : 0.0f;
    }
  }
  // 1. The candidates, compacted in thread order.
  bool cand[P];
  int mine = 0;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int loc = tid + q * T;
    const i64 i = base + loc;
    cand[q] = false;
    sd2[loc] = 0.0f;
    if (i >= N) continue;
    if (s == 0) {
      cand[q] = true;
    } else {
      const float old = d2[i];
      sd2[loc] = old;
      cand[q] = gap[near[i]] < old * kMargin;
    }
    mine += cand[q];
  }
  double total;
  int at = int(block_exclusive_scan<T>(scan, double(mine), &total));
#pragma unroll
  for (int q = 0; q < P; ++q)
    if (cand[q]) list[at++] = tid + q * T;
  __syncthreads();
  const int n = int(total);

  // 2. Each candidate against the round's centres, in order.
  bool changed = false;
  for (int r = tid; r < n; r += T) {
    const int loc = list[r];
    const i64 i = base + loc;
    const float* xi = x + i * sxm;
    float v[kK > 0 ? kK : 1];
    if constexpr (kK > 0) {
#pragma unroll
      for (int q = 0; q < kK; ++q) v[q] = q < K ? xi[q * sxk] : 0.0f;
    }
    // ||x_i - c_{s + c}||^2 for every c in order; s = 0: the first taken without comparison
    float old = s == 0 ? __int_as_float(0x7f800000) : sd2[loc];
    int nr = -1;
    bool mine_changed = false;
#pragma unroll 1
    for (int c = 0; c < nc; ++c) {
      float dn;
      if constexpr (kK > 0) dn = sq_dist_reg<kK>(v, sc + c * kK, K);
      else dn = sq_dist(xi, sxk, centres + i64(s + c) * ldc, 1, K);
      if (dn < old || (s == 0 && c == 0)) old = dn, nr = s + c, mine_changed = true;
    }
    if (mine_changed) {
      d2[i] = old;
      near[i] = nr;
      sd2[loc] = old;
      changed = true;
    }
  }
  if (__syncthreads_and(!changed)) return;  // the block's p unchanged: its sum stands
  // 3. The block sum of p = d2 w (w read only in blocks that changed).
  double part = 0.0;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int loc = tid + q * T;
    const i64 i = base + loc;
    part += double(w && i < N ? sd2[loc] * w[i] : sd2[loc]);
  }
  const double sum = block_sum<T>(red, part);
  if (tid == 0) bsum[blockIdx.x] = sum;
}

// Grid (ceil(s / kThreads), 1, 1): gap[a] = min over i in [s, e) of ||c_a - c_i||^2 (float32, k in
// order), a < s.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_gap_kernel(
    const float* __restrict__ centres, float* __restrict__ gap, int K, i64 ldc, int s, int e) {
  using namespace kmeans_detail;
  const int a = blockIdx.x * Traits::kThreads + threadIdx.x;
  if (a >= s) return;
  const float* ca = centres + i64(a) * ldc;
  float g = __int_as_float(0x7f800000);
#pragma unroll 1
  for (int i = s; i < e; ++i) g = fminf(g, sq_dist(ca, 1, centres + i64(i) * ldc, 1, K));
  gap[a] = g;
}

// Grid (1, 1, 1): one round of draws from centre s (above). u: (C, 2 trials + 1) float64 uniforms
// in [0, 1), row j: proposals [0, trials), the exact draw's at [trials], acceptances after it. cum:
// scratch of nb float64. Writes idx[j] and centres[j] (row stride ldc) for the centres drawn and
// count[0], the first centre not drawn (C when done).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) kmeans_draw_kernel(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ d2,
    const double* __restrict__ bsum, double* __restrict__ cum, const double* __restrict__ u, i64* __restrict__ idx,
    float* __restrict__ centres, int* __restrict__ count, int N, int K, i64 sxm, i64 sxk, i64 ldc, int nb, int C,
    int s, int trials) {
  using Tr = Traits;
  using namespace kmeans_detail;
  constexpr int T = Tr::kThreads, BM = Tr::kBlockM, E = BM / T, kBatch = 8;
  __shared__ double scan[2][T];
  __shared__ int ired[T];
  __shared__ float fred[T];
  const int tid = threadIdx.x;
  const int ut = 2 * trials + 1;

  // 1. The cumulative block sums: thread t sums block sums [b0, b1), a contiguous chunk, kBatch
  // loads at a time (issued together, then added in order), after the chunks before it.
  const int per = (nb + T - 1) / T;
  const int b0 = min(nb, tid * per), b1 = min(nb, b0 + per);
  double part = 0.0;
  for (int b = b0; b < b1; b += kBatch) {
    double v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) v[q] = b + q < b1 ? bsum[b + q] : 0.0;
#pragma unroll
    for (int q = 0; q < kBatch; ++q) part += v[q];
  }
  double total;
  double run = block_exclusive_scan<T>(scan, part, &total);
  for (int b = b0; b < b1; ++b) {
    run += bsum[b];
    cum[b] = run;
  }
  __syncthreads();

  // The index drawn at uniform uu from the state's p (s = 0: w or 1): the block as the first b with
  // cum[b] > r (the first chunk whose end exceeds r, then inside it), the point by a scan of the
  // block's p.
  auto draw = [&](double uu) -> i64 {
    const double r = uu * total;
    // (cum rises inside a chunk; across a chunk's edge the scan's rounding may differ: the first
    // b with cum[b] > r lies in the first chunk whose end exceeds r)
    const int ch = block_min<T>(ired, b0 < b1 && cum[b1 - 1] > r ? tid : T);
    int bsel = nb - 1;
    if (ch < T) {
      const int c0 = ch * per, c1 = min(nb, c0 + per);
      int first = nb;
      for (int b = c0 + tid; b < c1 && first == nb; b += T)
        if (cum[b] > r) first = b;
      bsel = block_min<T>(ired, first);
    }
    const double rem = r - (cum[bsel] - bsum[bsel]);
    const i64 p0 = i64(bsel) * BM + tid * E;
    double pe[E];
    double ps = 0.0;
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const i64 i = p0 + q;
      float p = 0.0f;
      if (i < N) {
        if (s == 0) p = w ? w[i] : 1.0f;
        else p = w ? d2[i] * w[i] : d2[i];
      }
      pe[q] = double(p);
      ps += pe[q];
    }
    double tot2;
    double run2 = block_exclusive_scan<T>(scan, ps, &tot2);
    int f2 = BM;
#pragma unroll
    for (int q = 0; q < E; ++q) {
      run2 += pe[q];
      if (f2 == BM && run2 > rem) f2 = tid * E + q;
    }
    int isel = block_min<T>(ired, f2);
    if (isel > BM - 1) isel = BM - 1;
    const i64 pick = i64(bsel) * BM + isel;
    return pick > N - 1 ? N - 1 : pick;
  };

  // 2. The round's centres.
  const int lim = s == 0 ? 1 : min(C, s + Tr::kBlockN);
  int j = s;
  for (; j < lim; ++j) {
    const double* uj = u + i64(j) * ut;
    i64 pick = N - 1;  // every p zero: the exact draw's clamp, for every remaining centre
    bool ok = true;
    if (total > 0.0) {
      if (j == s) {
        pick = draw(uj[trials]);
      } else {
        ok = false;
        for (int t = 0; t < trials && !ok; ++t) {
          pick = draw(uj[t]);
          const float* xr = x + pick * sxm;
          const float ds = d2[pick];
          const float ws = w ? w[pick] : 1.0f;
          const float ps = w ? ds * ws : ds;
          if (!(ps > 0.0f)) continue;  // (uniform: every thread holds the same pick and state)
          float m = __int_as_float(0x7f800000);
          for (int c = s + tid; c < j; c += T) m = fminf(m, sq_dist(xr, sxk, centres + i64(c) * ldc, 1, K));
          m = block_reduce<T>(fred, m, [](float a, float b) { return fminf(a, b); });
          const float dj = fminf(ds, m);
          const float pj = w ? dj * ws : dj;
          ok = uj[trials + 1 + t] * double(ps) < double(pj);
        }
      }
    }
    if (!ok) break;
    if (tid == 0) idx[j] = pick;
    const float* xr = x + pick * sxm;
    float* cj = centres + i64(j) * ldc;
    for (int q = tid; q < K; q += T) cj[q] = xr[q * sxk];
    __syncthreads();  // centre j visible to the next candidates' distances
  }
  if (tid == 0) count[0] = j;
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
