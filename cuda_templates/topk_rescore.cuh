// Exact rescoring of the tensor-core top-k's candidates (ABI: cuda_templates/ABI.md, built by
// kermac_like/plan/topk.py when FUSED_RESCORE is on; the torch oracle is plan/topk.py's rescore).
//
// topk_mma_kernel leaves, for every row, `lists` sorted lists of kSel candidate keys
// ((order bits of the TF32 value) << 32 | n, top bit flipped; one list per (N split, quarter),
// unused tail entries all ones). One warp per row:
//   1. merges the lists in their scratch order into the row's kSel first keys (lane s holds
//      entry s; each merge ranks an entry by its position plus the count of the other list's
//      smaller entries, ties to the earlier list): exactly the planner's torch.topk over the
//      lists, all-ones pads included (fewer than kSel points in all);
//   2. recomputes each candidate's value in float32 by direct differences (squared l2) or
//      products (dot): lanes read 16 bytes of the point and of x per step (a 512-byte row of
//      K = 128 is one load per lane), fmaf into a per-lane sum over the lane's columns
//      c = 4 lane + 128 t, then a butterfly over the warp (every lane gets the same bits). A pad's
//      value is +inf (-inf for kLargest) and its index min(n, N - 1), as rescore masks them;
//   3. ranks the kSel (value, index) pairs as torch.sort does (NaN above +inf, -0 == +0, ties by
//      index), writes the k first to the output row (the square root for l2) and the row's
//      certificate: its k-th value clear of the last candidate's approximate value by
//      candidate_bound, evaluated in the torch code's float32 operations and order (no
//      contraction), or a pad among the candidates.
// No (rows, kSel, K) temporary: the gathered points go from memory to registers.
//
// Every loop runs the same trips in every warp of a block (rows past M compute on row M - 1 and
// write nothing): the CPU shim's warp operations are block barriers.
#pragma once

#include "topk.cuh"

namespace kermac_like {

// kInner_: Diff (squared differences) or Dot; kLargest_: descending values.
template <Inner kInner_, bool kLargest_>
struct TopkRescoreTraits {
  static_assert(kInner_ == Inner::Diff || kInner_ == Inner::Dot, "TopkRescoreTraits: Inner::Diff or Inner::Dot");
  static constexpr Inner kInner = kInner_;
  static constexpr bool kLargest = kLargest_;
  static constexpr bool kSigned = kInner_ == Inner::Dot;  // topk.cuh's order bits / value_of
  static constexpr bool kDeferred = true;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kWarps;  // rows per CTA
  static constexpr int kBlockN = 32;      // candidates per row at most (one a lane)
  static constexpr int kMaxSel = 32;
  // Dynamic shared memory, per warp: the running list, the list being merged (u64), values and
  // indices of the candidates (f32, i32).
  static constexpr int kSmemBytes = kWarps * kMaxSel * (8 + 8 + 4 + 4);
};

namespace topk_rescore_detail {

__device__ __forceinline__ void warp_sync() {
#if defined(__CUDA_ARCH__)
  __syncwarp();
#else
  __syncthreads();  // the CPU shim (every thread of the block calls it)
#endif
}

// torch.sort's order of the values: a strictly before b; ascending NaN last, descending NaN first.
template <bool kLargest>
__device__ __forceinline__ bool before(float a, float b) {
  if constexpr (kLargest) return a > b || (a != a && b == b);
  return a < b || (b != b && a == a);
}

__device__ __forceinline__ bool same(float a, float b) { return a == b || (a != a && b != b); }

}  // namespace topk_rescore_detail

// Grid (ceil(M / kWarps)); scratch [lists][M][sel] int64 (topk_mma_kernel's, one batch entry);
// x (M, K) and y (N, K) row-major, K % 4 == 0, 16-byte aligned rows; xnorm (M) f32, the rows'
// norms as the planner's torch.linalg.vector_norm gives them; ynorm: one f32, max |y|.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    topk_rescore_kernel(const long long* __restrict__ scratch, const float* __restrict__ x,
                        const float* __restrict__ y, const float* __restrict__ xnorm,
                        const float* __restrict__ ynorm, float* __restrict__ values, long long* __restrict__ indices,
                        unsigned char* __restrict__ ok, int M, int N, int K, int k, int sel, int lists,
                        long long ldx, long long ldy, long long svm, long long svj, long long sim, long long sij,
                        float bound_k, int root) {
  using Tr = Traits;
  using namespace topk_rescore_detail;
  constexpr bool kDot = Tr::kInner == Inner::Dot;
  const float kPadValue = __uint_as_float(Tr::kLargest ? 0xff800000u : 0x7f800000u);  // -inf / +inf
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m = blockIdx.x * Tr::kWarps + warp;
  const bool live = m < M;
  const int mr = live ? m : M - 1;
  u64* const cur = reinterpret_cast<u64*>(kl_topk_smem) + warp * Tr::kMaxSel;
  u64* const nxt = reinterpret_cast<u64*>(kl_topk_smem) + (Tr::kWarps + warp) * Tr::kMaxSel;
  float* const val = reinterpret_cast<float*>(kl_topk_smem + Tr::kWarps * Tr::kMaxSel * 16) + warp * Tr::kMaxSel;
  int* const idx = reinterpret_cast<int*>(val + Tr::kWarps * Tr::kMaxSel);
  const u64 flip = 0x8000000000000000ull;

  // 1. The row's kSel first keys over its lists, merged in list order.
  const long long* src = scratch + i64(mr) * sel;
  const i64 list_stride = i64(M) * sel;
  if (lane < sel) cur[lane] = u64(src[lane]) ^ flip;
  for (int j = 1; j < lists; ++j) {
    if (lane < sel) nxt[lane] = u64(src[j * list_stride + lane]) ^ flip;
    warp_sync();
    u64 a = 0, b = 0;
    int ra = sel, rb = sel;
    if (lane < sel) {
      a = cur[lane];
      b = nxt[lane];
      ra = rb = lane;
#pragma unroll 1  // (unrolled, ptxas spilled a few bytes on sm_90)
      for (int t = 0; t < sel; ++t) {
        ra += nxt[t] < a;   // the earlier list first on ties (pads)
        rb += cur[t] <= b;
      }
    }
    warp_sync();
    if (ra < sel) cur[ra] = a;
    if (rb < sel) cur[rb] = b;
    warp_sync();
  }

  // 2. Exact values, four candidates per trip (trips past sel are pads; a pad's sum is replaced).
  const float* xr = x + i64(mr) * ldx;
  float mine = 0.f;
  for (int s0 = 0; s0 < sel; s0 += 4) {
    int n[4];  // the point of candidate s0 + u, -1 for a pad
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u64 key = s0 + u < sel ? cur[s0 + u] : ~0ull;
      n[u] = key == ~0ull ? -1 : int(unsigned(key & 0xffffffffu));
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c = 4 * lane; c < K; c += 128) {
      const float4 xv = *reinterpret_cast<const float4*>(xr + c);
      float4 yv[4];  // the four loads issued before any use
#pragma unroll
      for (int u = 0; u < 4; ++u)
        yv[u] = n[u] >= 0 ? *reinterpret_cast<const float4*>(y + i64(n[u]) * ldy + c) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if constexpr (kDot) {
          acc[u] = __fmaf_rn(yv[u].x, xv.x, acc[u]);
          acc[u] = __fmaf_rn(yv[u].y, xv.y, acc[u]);
          acc[u] = __fmaf_rn(yv[u].z, xv.z, acc[u]);
          acc[u] = __fmaf_rn(yv[u].w, xv.w, acc[u]);
        } else {
          const float d0 = math::sub_rn(yv[u].x, xv.x), d1 = math::sub_rn(yv[u].y, xv.y);
          const float d2 = math::sub_rn(yv[u].z, xv.z), d3 = math::sub_rn(yv[u].w, xv.w);
          acc[u] = __fmaf_rn(d0, d0, acc[u]);
          acc[u] = __fmaf_rn(d1, d1, acc[u]);
          acc[u] = __fmaf_rn(d2, d2, acc[u]);
          acc[u] = __fmaf_rn(d3, d3, acc[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[u] = math::add_rn(acc[u], __shfl_xor_sync(0xffffffffu, acc[u], o));
      if (lane == s0 + u) mine = acc[u];
    }
  }
  // This lane's candidate: a pad is +inf (-inf when largest) at N - 1, as rescore() masks them.
  const u64 my_key = lane < sel ? cur[lane] : ~0ull;
  if (my_key == ~0ull) mine = kPadValue;
  const unsigned my_lo = unsigned(my_key & 0xffffffffu);
  const int mine_n = my_lo < unsigned(N) ? int(my_lo) : N - 1;

  // 3. Rank by (value, index), lane order on full ties (pads); the k first to the output row.
  if (lane < sel) {
    val[lane] = mine;
    idx[lane] = mine_n;
  }
  warp_sync();
  int rank = 0;
  if (lane < sel) {
#pragma unroll 1
    for (int t = 0; t < sel; ++t) {
      const float vt = val[t];
      const int nt = idx[t];
      rank += before<Tr::kLargest>(vt, mine) || (same(vt, mine) && (nt < mine_n || (nt == mine_n && t < lane)));
    }
  }
  warp_sync();
  if (lane < sel && rank < k) {
    if (live) {
      values[i64(m) * svm + i64(rank) * svj] = root ? sqrtf(mine) : mine;
      indices[i64(m) * sim + i64(rank) * sij] = mine_n;
    }
    if (rank == k - 1) val[Tr::kMaxSel - 1] = mine;  // the k-th value (every read of val is done)
  }
  warp_sync();
  if (lane == 0 && live) {
    // candidate_bound(xn, ynorm, last, K, dot) and the certificate, in the torch code's order.
    const float kth = val[Tr::kMaxSel - 1];
    const u64 last_key = cur[sel - 1];
    const float last = topk_detail::value_of<Tr>(unsigned(last_key >> 32));
    const float xn = xnorm[m];
    float yn = *ynorm;
    if constexpr (!kDot && !Tr::kLargest) {  // the window: a point that can displace the k-th lies
      // within sqrt(kth) of x, its norm below (|x| + sqrt(kth)) (1 + 2^-16 + K 2^-22)
      const float scale = math::add_rn(1.0f + 0x1p-16f, bound_k);
      if (yn == yn) yn = fminf(yn, math::mul_rn(math::add_rn(xn, math::sqrt_rn(kth)), scale));  // NaN: none certified
    }
    float bound = math::mul_rn(math::mul_rn(kDot ? 0x1p-9f : 0x1p-8f, xn), yn);
    if constexpr (!kDot)
      bound = math::add_rn(bound, math::mul_rn(bound_k, math::add_rn(math::mul_rn(xn, xn), math::mul_rn(yn, yn))));
    bound = math::add_rn(bound, math::mul_rn(0x1p-16f, fabsf(last)));
    const bool clear = Tr::kLargest ? kth > math::add_rn(last, bound) : kth < math::sub_rn(last, bound);
    ok[m] = (clear || last_key == ~0ull) ? 1 : 0;
  }
}

}  // namespace kermac_like
