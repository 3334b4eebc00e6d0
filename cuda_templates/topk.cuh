// Fused top-k selection over the kernel matrix without the matrix: k nearest neighbours
// and kernel_topk (ABI: cuda_templates/ABI.md, built by kermac_like/plan/topk.py).
//
//   for every row m of batch entry l: the k points n whose values
//   r(m, n) = value(x[l][m], y[l][n]) come first in the total order (value, n), ascending
//   (kLargest: descending value, ascending n), NaN above +inf as torch.topk orders it.
//
// value is run_kernel's: epilogue(outer(sum_k inner(x_mk, y_nk))). Without an epilogue the
// outer power (none, sqrt, 1/p) is monotone, so the selection orders the sums and the outer
// power is applied to the k selected sums only (kDeferred).
//
// The M x N matrix never exists: each CTA owns kBlockM rows of x (kRows per thread, strided
// by kThreads so that loads and stores of a row index are coalesced; x in registers, zero-
// padded to kK: inner(0, 0) == 0), walks its range of y in tiles of kBlockN points staged in
// shared memory (broadcast reads), forms the values in registers and tests each against its
// row's threshold: the key of the row's current k-th entry (all ones until k are kept). A
// key is (order bits of the value) << 32 | n, so one 64-bit compare is the whole order and
// every key is distinct: the selected set does not depend on the order in which candidates
// arrive, which makes splits, merges and the result deterministic.
//
// Where a row's list lives (kSel, compile time):
//   * kSel > 0 (k <= kSel <= 32): kSel sorted keys in registers; the first kSel - k are zeros
//     (below every real key, they never move), so the threshold is the last register and an
//     insertion is one unrolled pass of compare-and-shift;
//   * kSel == 0 (any k up to MAX_SELECT): k sorted keys in global memory (`keys`: the int64
//     indices output itself, or the split scratch). Candidates that pass go to the row's
//     buffer in shared memory (kCap keys, owned by the row's thread: no atomics); a full buffer
//     is sorted and merged into the list from the back, in place, and the threshold becomes
//     the list's k-th key.
// After a few thousand points nearly every candidate fails the threshold test: a pair costs
// the inner operations, the order bits (0 to 2 instructions) and the compare.
//
// Output: with one N range per row (n_split == 1) the kernel decodes its lists in place:
// values (outer power applied for deferred descriptors, rounded to T) and the indices over the
// keys. With n_split > 1 each CTA leaves its range's sorted list in `keys` (the scratch,
// [split][batch][M][k], unused tail entries all ones) and topk_combine_kernel merges the
// splits of a row and decodes them.
#pragma once

#include "common.cuh"
#include "descriptor_traits.cuh"
#include "storage16.cuh"
#include "math.cuh"

namespace kermac_like {

typedef unsigned long long u64;

// kK_: the padded K (1..64; x rows in registers); kLargest_: descending values; kSel_: 0 (lists
// in global memory, any k) or the register list's length (k <= kSel_ <= 32).
// Tuning knobs (0: the shipped choice; bench/probes/topk_probe.py --variants times others):
// kRows_ rows per thread (1, 2 or 4); kUnrollJ_ points per trip of the pair loop (1, 2 or 4).
template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, class T_, int kK_,
          bool kLargest_, int kSel_ = 0, int kRows_ = 0, int kUnrollJ_ = 0>
struct TopkTraits : DescriptorTraits<kInner_, kInnerPow_, kOuterPow_, kEpilogue_, T_> {
  static_assert(kK_ >= 1 && kK_ <= 128, "TopkTraits: kK is the padded K, 1..128");
  static_assert(kSel_ >= 0 && kSel_ <= 32, "TopkTraits: kSel is 0 (lists in memory) or 1..32 (in registers)");

  static constexpr int kK = kK_;
  static constexpr bool kLargest = kLargest_;
  // Values ordered by the sum itself (no epilogue: the outer power is monotone).
  static constexpr bool kDeferred = kEpilogue_ == Epilogue::None;
  // Values of either sign (dot products); otherwise >= 0 or NaN.
  static constexpr bool kSigned = kInner_ == Inner::Dot;

  static constexpr int kSel = kSel_;
  static constexpr int kThreads = 128;
  // Rows per thread: x takes kK and a register list 2 kSel registers per row; about 80 of them
  // in all (the first power of two that fits, 1 to 4), one row with lists in memory (their
  // buffers then take the least shared memory). Points per trip: 4. Measured on an H100
  // (bench/notes/knn.md, v2): this beats the neighbouring choices at D = 3, 8, 16, 64.
  static constexpr int kRowRegs = kK_ + 2 * kSel_;
  static constexpr int kRows = kRows_ > 0 ? kRows_
                               : kSel_ == 0 ? 1
                               : kRowRegs * 4 <= 80 ? 4 : kRowRegs * 2 <= 80 ? 2 : 1;
  static_assert(kRows == 1 || kRows == 2 || kRows == 4, "TopkTraits: kRows is 1, 2 or 4");
  static constexpr int kUnrollJ = kUnrollJ_ > 0 ? kUnrollJ_ : 4;
  static_assert(kUnrollJ == 1 || kUnrollJ == 2 || kUnrollJ == 4, "TopkTraits: kUnrollJ is 1, 2 or 4");
  static constexpr int kBlockM = kThreads * kRows;
  static constexpr int kKS = (kK_ + 3) / 4 * 4;  // shared row of a point (float4 reads)
  static constexpr int kBlockN = kKS <= 16 ? 256 : 128;  // y points per shared-memory tile
  static constexpr int kCap = kSel_ > 0 ? 0 : 16;  // buffered candidates per row (lists in memory)
  // Dynamic shared memory: the buffers (kCap, kBlockM) keys, then the y tile (kBlockN, kKS).
  static constexpr int kBufBytes = kCap * kBlockM * 8;
  static constexpr int kSmemBytes = kBufBytes + kBlockN * kKS * 4;
  // Partial sums per pair: two interleaved ones where few rows give little independent work.
  static constexpr int kAcc = (kRows == 1 && kK_ >= 8) ? 2 : 1;

  // exact::accumulate's choice of pipe for |d|^p: MUFU throughout.
  __host__ __device__ static constexpr bool exp2_on_fma(int, int) { return false; }
};

namespace topk_detail {

// Order bits of a value: unsigned integers in the order of the values (NaN of either sign
// above +inf, -0 equal to +0), reversed for kLargest.
template <class Tr>
__device__ __forceinline__ unsigned order_bits(float v) {
  unsigned b;
  if constexpr (Tr::kSigned) {
    b = __float_as_uint(v + 0.0f);  // -0 + 0 = +0
    if (v != v) b = 0x7fffffffu;
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  } else if constexpr (Tr::kDeferred) {
    // A sum of terms >= 0 that starts from +0 and ends in an arithmetic instruction: +0, not
    // -0, and a NaN is the GPU's canonical NaN (0x7fffffff), above +inf.
    b = __float_as_uint(v);
  } else {
    b = __float_as_uint(v) & 0x7fffffffu;  // an epilogue's value >= 0 or NaN of either sign
  }
  if constexpr (Tr::kLargest) b = ~b;
  return b;
}

// The value whose order bits are b (NaN as the canonical NaN).
template <class Tr>
__device__ __forceinline__ float value_of(unsigned b) {
  if constexpr (Tr::kLargest) b = ~b;
  if constexpr (Tr::kSigned) b = (b & 0x80000000u) ? (b & 0x7fffffffu) : ~b;
  return __uint_as_float(b);
}

__device__ __forceinline__ u64 make_key(unsigned bits, unsigned n) { return (u64(bits) << 32) | n; }

// The value reported for a selected key: the outer power of a deferred sum, as run_kernel's
// finish computes it (epsilon is not supported here: such calls take the blocked path).
template <class Tr>
__device__ __forceinline__ float reported(u64 key, float inv_outer_p) {
  float v = value_of<Tr>(unsigned(key >> 32));
  if constexpr (Tr::kDeferred && Tr::kOuterPow == Power::Sqrt) v = sqrtf(v);
  if constexpr (Tr::kDeferred && Tr::kOuterPow == Power::Pow) v = powf(v, inv_outer_p);
  return v;
}

// Merges a row's buffer (cnt keys at buf[0], buf[bs], ...) into its sorted list (len keys at
// list[0], list[ls], ...; at most k kept): insertion sort of the buffer, then a merge from the
// back (an output position is never below an unread list position, so it runs in place).
// Returns the new length and threshold: the k-th key once k are kept, else all ones (a struct,
// not a reference: the caller's per-row thresholds stay in registers).
struct ListState {
  int len;
  u64 thr;
};

__device__ __noinline__ ListState merge_row(u64* buf, int bs, int cnt, i64* list, i64 ls, int len, int k) {
  for (int a = 1; a < cnt; ++a) {
    const u64 v = buf[a * bs];
    int b = a - 1;
    while (b >= 0 && buf[b * bs] > v) {
      buf[(b + 1) * bs] = buf[b * bs];
      --b;
    }
    buf[(b + 1) * bs] = v;
  }
  int i = len - 1, j = cnt - 1;
  u64 li = i >= 0 ? u64(list[i * ls]) : 0;
  for (int pos = len + cnt - 1; j >= 0; --pos) {
    const u64 bj = buf[j * bs];
    u64 v;
    if (i >= 0 && li > bj) {
      v = li;
      --i;
      if (i >= 0) li = u64(list[i * ls]);
    } else {
      v = bj;
      --j;
    }
    if (pos < k) list[pos * ls] = i64(v);
  }
  const int n = len + cnt < k ? len + cnt : k;
  return {n, n == k ? u64(list[(k - 1) * ls]) : ~0ull};
}

// Inserts key into a sorted register list (the largest entry drops out): one unrolled pass,
// each entry the one below it (shifted up) or the smaller of itself and key.
template <int S>
__device__ __forceinline__ void insert_sorted(u64 (&list)[S], u64 key) {
#pragma unroll
  for (int s = S - 1; s > 0; --s) list[s] = list[s - 1] > key ? list[s - 1] : (list[s] < key ? list[s] : key);
  list[0] = list[0] < key ? list[0] : key;
}

// The hyper-parameters of batch entry `index`.
struct Hypers {
  HyperParam inner_p, outer_p, bandwidth;
};

// A thread's rows' selection state: register lists (kSel > 0), or thresholds, buffer counts
// and list lengths of the lists in memory.
template <class Tr>
struct RowLists {
  static constexpr int R = Tr::kRows, S = Tr::kSel > 0 ? Tr::kSel : 1;
  u64 lst[R][S];  // register lists: kSel - k zeros, then the row's sorted keys
  u64 thr[R];     // lists in memory: the row's k-th key (all ones until k are kept)
  int cnt[R], len[R];
  u64* buf;       // (kCap, kBlockM) buffered keys
  i64* lists;     // the list of the CTA's first row (the thread's row i: tid + i * kThreads)
  i64 lm, ls;     // list strides: rows, entries
  int k, tid;

  __device__ __forceinline__ int row(int i) const { return tid + i * Tr::kThreads; }
  __device__ __forceinline__ i64* list(int i) const { return lists + i64(row(i)) * lm; }

  // Offers key to row i.
  __device__ __forceinline__ void offer(int i, u64 key) {
    if constexpr (Tr::kSel > 0) {
      if (key < lst[i][S - 1]) insert_sorted(lst[i], key);
    } else if (key < thr[i]) {
      buf[cnt[i] * Tr::kBlockM + row(i)] = key;
      if (++cnt[i] == Tr::kCap) {
        const ListState st = merge_row(buf + row(i), Tr::kBlockM, cnt[i], list(i), ls, len[i], k);
        len[i] = st.len, thr[i] = st.thr;
        cnt[i] = 0;
      }
    }
  }

  __device__ __forceinline__ u64 bound(int i) const { return Tr::kSel > 0 ? lst[i][S - 1] : thr[i]; }
};

// One trip of the pair loop: points j .. j + U - 1 of the staged tile (global index n ..)
// against the thread's rows; one branch for all of them, nearly always not taken.
template <class Tr, int U>
__device__ __forceinline__ void pairs(const float* ys, int j, unsigned n, const float (&xr)[Tr::kRows][Tr::kK],
                                      const math::PowArgs& pw, const exact::EpilogueArgs& ea, RowLists<Tr>& rs) {
  constexpr int R = Tr::kRows, KS = Tr::kKS, KK = Tr::kK;
  float yj[U][KS];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int q = 0; q < KS / 4; ++q) {
      const float4 f = reinterpret_cast<const float4*>(ys + (j + u) * KS)[q];
      yj[u][4 * q] = f.x, yj[u][4 * q + 1] = f.y, yj[u][4 * q + 2] = f.z, yj[u][4 * q + 3] = f.w;
    }
  u64 key[U][R];
  bool any = false;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float acc[Tr::kAcc];
#pragma unroll
      for (int a = 0; a < Tr::kAcc; ++a) acc[a] = 0.0f;
#pragma unroll
      for (int q = 0; q < KK; ++q)
        acc[q % Tr::kAcc] = exact::accumulate<Tr>(acc[q % Tr::kAcc], xr[i][q], yj[u][q], i, q, pw);
      float v = acc[0];
#pragma unroll
      for (int a = 1; a < Tr::kAcc; ++a) v = math::add_rn(v, acc[a]);
      if constexpr (!Tr::kDeferred) v = exact::finish<Tr>(v, ea);
      const unsigned bits = order_bits<Tr>(v);
      key[u][i] = make_key(bits, n + u);
      // The high word alone (one compare): equal values go to offer's full comparison.
      any |= bits <= unsigned(rs.bound(i) >> 32);
    }
  if (any) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < R; ++i) rs.offer(i, key[u][i]);
  }
}

}  // namespace topk_detail

extern __shared__ __align__(16) unsigned char kl_topk_smem[];

// Grid: (row tiles, N splits, batch entries (looped beyond gridDim.z)). n_split CTAs share a
// row tile, each over `per` y tiles; keys: [batch][M][k] at strides (kbs, skm, skj) when
// n_split == 1 (the indices output), else the contiguous scratch [split][batch][M][k].
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) topk_kernel(
    const typename Traits::T* __restrict__ x, const typename Traits::T* __restrict__ y,
    typename Traits::T* __restrict__ values, i64* __restrict__ keys, int M, int N, int K, int k, i64 sxm,
    i64 sxk, i64 sym, i64 syk, i64 svm, i64 svj, i64 skm, i64 skj, int batch, int batch_n1, int batch_n2,
    i64 x_bs0, i64 x_bs1, i64 x_bs2, i64 y_bs0, i64 y_bs1, i64 y_bs2, i64 v_bs0, i64 v_bs1, i64 v_bs2,
    i64 k_bs0, i64 k_bs1, i64 k_bs2, const float* inner_p_ptr, i64 inner_p_bs0, i64 inner_p_bs1,
    i64 inner_p_bs2, float inner_p, const float* outer_p_ptr, i64 outer_p_bs0, i64 outer_p_bs1,
    i64 outer_p_bs2, float outer_p, const float* bw_ptr, i64 bw_bs0, i64 bw_bs1, i64 bw_bs2, float bandwidth,
    int n_split, int per) {
  using Tr = Traits;
  using namespace topk_detail;
  constexpr int R = Tr::kRows, BM = Tr::kBlockM, BN = Tr::kBlockN, KS = Tr::kKS, KK = Tr::kK;
  u64* const buf = reinterpret_cast<u64*>(kl_topk_smem);                    // (kCap, BM)
  float* const ys = reinterpret_cast<float*>(kl_topk_smem + Tr::kBufBytes);  // (BN, KS)

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride xb{x_bs0, x_bs1, x_bs2}, yb{y_bs0, y_bs1, y_bs2}, vb{v_bs0, v_bs1, v_bs2},
      kb{k_bs0, k_bs1, k_bs2};
  const Hypers hp{{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p},
                  {outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p},
                  {bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth}};
  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y;
  const int n_begin = split * per * BN;
  const int n_end = min(N, n_begin + per * BN);
  const bool direct = n_split == 1;

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    const BatchIndex bi = shape.split(l);
    const typename Tr::T* xl = x + xb.offset(bi);
    const typename Tr::T* yl = y + yb.offset(bi);
    // This CTA's lists: the row's k keys at list(i) + j * ls.
    i64* kl;
    i64 lm, ls;
    if (direct) {
      kl = keys + kb.offset(bi);
      lm = skm, ls = skj;
    } else {
      kl = keys + (i64(split) * batch + l) * M * i64(k);
      lm = k, ls = 1;
    }

    math::PowArgs pw{};
    if constexpr (Tr::kInnerPow == Power::Pow) pw = math::make_pow_args(hp.inner_p.at(bi));
    exact::EpilogueArgs ea;
    ea.epsilon = 0.0f;
    ea.inv_outer_p = 0.0f;
    ea.exp_scale = 0.0f;
    if constexpr (Tr::kOuterPow == Power::Pow) ea.inv_outer_p = 1.0f / hp.outer_p.at(bi);
    if constexpr (Tr::kEpilogue == Epilogue::Laplace) ea.exp_scale = -1.0f / hp.bandwidth.at(bi);
    if constexpr (Tr::kEpilogue == Epilogue::Gaussian) {
      const float bw = hp.bandwidth.at(bi);
      ea.exp_scale = -0.5f / (bw * bw);
    }
    ea.exp2_scale = ea.exp_scale * 1.4426950408889634f;

    constexpr int S = RowLists<Tr>::S, U = Tr::kUnrollJ;
    float xr[R][KK];
    RowLists<Tr> rs;
    rs.buf = buf, rs.lists = kl + i64(m0) * lm, rs.lm = lm, rs.ls = ls, rs.k = k, rs.tid = tid;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int m = m0 + tid + i * Tr::kThreads;
      const bool live = m < M;
#pragma unroll
      for (int q = 0; q < KK; ++q) xr[i][q] = (live && q < K) ? load_f(xl + i64(m) * sxm + i64(q) * sxk) : 0.0f;
      rs.thr[i] = live ? ~0ull : 0ull;  // rows past M never take a candidate
#pragma unroll
      for (int q = 0; q < S; ++q) rs.lst[i][q] = (live && q >= S - k) ? ~0ull : 0ull;
      rs.cnt[i] = 0;
      rs.len[i] = 0;
    }

    for (int n0 = n_begin; n0 < n_end; n0 += BN) {
      const int jn = min(BN, n_end - n0);
      __syncthreads();  // the previous tile is consumed
      for (int e = tid; e < BN * KS; e += Tr::kThreads) {
        const int j = e / KS, q = e - j * KS;
        ys[e] = (j < jn && q < K) ? load_f(yl + i64(n0 + j) * sym + i64(q) * syk) : 0.0f;
      }
      __syncthreads();
      const int jfull = jn - jn % U;
#pragma unroll 1
      for (int j = 0; j < jfull; j += U) pairs<Tr, U>(ys, j, unsigned(n0 + j), xr, pw, ea, rs);
#pragma unroll 1
      for (int j = jfull; j < jn; ++j) pairs<Tr, 1>(ys, j, unsigned(n0 + j), xr, pw, ea, rs);
    }

    // Flush the buffers; then decode (one range) or pad the range's list (splits).
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = tid + i * Tr::kThreads, m = m0 + r;
      if (m >= M) continue;
      i64* list = rs.list(i);
      if constexpr (Tr::kSel > 0) {
        // The last k registers, sorted: decoded (one range) or stored as keys (splits).
#pragma unroll
        for (int q = 0; q < S; ++q) {
          if (q < S - k) continue;
          const int j = q - (S - k);
          if (direct) {
            store_f(values + vb.offset(bi) + i64(m) * svm + j * svj, reported<Tr>(rs.lst[i][q], ea.inv_outer_p));
            list[j * ls] = i64(rs.lst[i][q] & 0xffffffffull);
          } else {
            list[j * ls] = i64(rs.lst[i][q]);
          }
        }
        continue;
      }
      if (rs.cnt[i] > 0) rs.len[i] = merge_row(buf + r, BM, rs.cnt[i], list, ls, rs.len[i], k).len;
      if (direct) {
        typename Tr::T* vr = values + vb.offset(bi) + i64(m) * svm;
        for (int j = 0; j < rs.len[i]; ++j) {
          const u64 key = u64(list[j * ls]);
          store_f(vr + j * svj, reported<Tr>(key, ea.inv_outer_p));
          list[j * ls] = i64(key & 0xffffffffull);
        }
      } else {
        for (int j = rs.len[i]; j < k; ++j) list[j * ls] = -1;  // all ones: after every real key
      }
    }
  }
}

// One thread per (batch entry, row): the n_split sorted lists of the row (scratch
// [split][batch][M][k]) merged to the k first keys, decoded into values and indices.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) topk_combine_kernel(
    const i64* __restrict__ scratch, typename Traits::T* __restrict__ values, i64* __restrict__ indices, int M,
    int k, int n_split, i64 svm, i64 svj, i64 sim, i64 sij, int batch, int batch_n1, int batch_n2, i64 v_bs0,
    i64 v_bs1, i64 v_bs2, i64 i_bs0, i64 i_bs1, i64 i_bs2, const float* outer_p_ptr, i64 outer_p_bs0,
    i64 outer_p_bs1, i64 outer_p_bs2, float outer_p) {
  using Tr = Traits;
  using namespace topk_detail;
  constexpr int kMaxSplit = 512;
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride vb{v_bs0, v_bs1, v_bs2}, ib{i_bs0, i_bs1, i_bs2};
  const HyperParam op{outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p};
  const i64 rows = i64(batch) * M;
  for (i64 t = i64(blockIdx.x) * blockDim.x + threadIdx.x; t < rows; t += i64(gridDim.x) * blockDim.x) {
    const int l = int(t / M), m = int(t - i64(l) * M);
    const BatchIndex bi = shape.split(l);
    float inv_outer_p = 0.0f;
    if constexpr (Tr::kDeferred && Tr::kOuterPow == Power::Pow) inv_outer_p = 1.0f / op.at(bi);
    int head[kMaxSplit];
    for (int s = 0; s < n_split; ++s) head[s] = 0;
    const i64 split_stride = rows * k;
    const i64* base = scratch + t * k;
    typename Tr::T* vr = values + vb.offset(bi) + i64(m) * svm;
    i64* ir = indices + ib.offset(bi) + i64(m) * sim;
    for (int j = 0; j < k; ++j) {
      int best = 0;
      u64 bk = ~0ull;
      for (int s = 0; s < n_split; ++s) {
        if (head[s] < k) {
          const u64 c = u64(base[s * split_stride + head[s]]);
          if (c < bk) bk = c, best = s;
        }
      }
      ++head[best];
      store_f(vr + j * svj, reported<Tr>(bk, inv_outer_p));
      ir[j * sij] = i64(bk & 0xffffffffull);
    }
  }
}

}  // namespace kermac_like
