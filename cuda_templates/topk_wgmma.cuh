// topk_mma version 6 (sm_90a): the tensor-core candidate pass of the Euclidean / dot-product
// top-k on wgmma, warp-specialised (bench/notes/knn.md, "topk_mma v6"). Same arguments, grid
// and scratch as topk_mma_kernel (cuda_templates/topk_mma.cuh); TF32 only; K <= 128.
//
// Roles (384 threads, one CTA per SM):
//   * warpgroup 0, the loader: the CTA's y range as one stream of k-tiles (256 points x 16
//     floats, 64-byte swizzle of distance_wgmma.cuh's b tiles) into a ring of kStages stages,
//     cp.async; kProducerLag k-tiles later each thread reads its own chunks back, adds their
//     squares to the points' norms (from the raw data, v5's chunk order: the same sums), rounds
//     them to TF32 in place (tf32_rna, as the mma.sync fragments do), fences the generic-proxy
//     writes for the async proxy (fence.proxy.async: wgmma reads B through it) and arrives on
//     the stage's "full" mbarrier; with a tile's last k-tile it also stores the tile's 256
//     squared norms into that stage. No __syncthreads in the k-loop: mbarriers only.
//   * warpgroups 1 and 2, the consumers (rows 0-63 and 64-127 of the x tile): x lives in
//     registers for the whole range (16 k8 steps x 4 TF32 words = 64 registers, loaded once),
//     so that per k-tile a consumer only waits for the stage and issues two
//     wgmma.m64n256k8 (A from registers, B = the y stage) with one k-tile in flight; then the
//     values of the tile (v4's expression) are filtered in registers against the rows'
//     thresholds, and the rare survivors go into the lists.
//   The two consumer warpgroups run their own wgmma streams: while one filters, the other's
//   MMAs keep the tensor cores busy.
//
// Lists: the accumulator of wgmma.m64n256 gives lane (g, t) of a warp the columns 8 j + 2 t
// (+1) of two rows, so list "quarter" t of a row holds the points whose tile column is 2 t or
// 2 t + 1 mod 8 (another partition of the points than v2-v5's 64-column quarters: the merged
// kSel first keys of a row are the same set whenever the approximate values are). Each list
// belongs to one lane: no shuffles, no barrier, no rounds. A list is kept unsorted with its
// largest key and its position (max_key / max_pos in shared memory): a survivor replaces the
// largest key, and the new largest is found by a pass over the kSel entries (independent loads,
// the same instructions in every lane that inserts). The set kept is the kSel smallest distinct
// keys offered (as v2's sorted lists); sorted once at the end, then written to the scratch.
#pragma once

#include "topk_mma.cuh"
#include "distance_wgmma.cuh"

namespace kermac_like {

template <Inner kInner_, bool kLargest_, int kSel_>
struct TopkWgmmaTraits {
  static_assert(kSel_ >= 8 && kSel_ <= 24, "TopkWgmmaTraits: kSel is 8..24");
  static constexpr Inner kInner = kInner_;
  static constexpr Precision kPrecision = Precision::Tf32;
  static constexpr bool kLargest = kLargest_;
  static constexpr bool kSigned = kInner_ == Inner::Dot;
  static constexpr bool kDeferred = true;  // topk.cuh's order_bits: the raw bits of a value >= 0
  static constexpr int kSel = kSel_;
  static constexpr int kVersion = 6;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // setmaxnreg: 56 * 128 + 224 * 256 = 64512 = 168 * 384, the launch allocation (40 / 232 spilled
  // the loader's source pointer, 8 bytes; 56 / 224 has no spills on NVRTC 13)
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kRowBytes = 64;  // one k-tile of a row: 16 floats, two k8 steps
  static constexpr int kBlockK = 16;
  static constexpr int kMaxKTiles = 8;  // K <= 128: x in registers
  static constexpr int kQuarters = 4;
  static constexpr int kTileBytes = kBlockN * kRowBytes;  // 16 KiB of y per k-tile
  static constexpr int kNormSlot = kTileBytes;            // the tile's y norms (its last k-tile's stage)
  static constexpr int kStageBytes = kTileBytes + kBlockN * 4;  // 17 KiB (a multiple of 1 KiB: the swizzle)
  static constexpr int kStages = 7;
  static constexpr int kProducerLag = 4;  // k-tiles in flight per loader thread (<= kStages - 2: no deadlock)
  static constexpr int kLists = kBlockM * kQuarters;  // 512 lists of kSel keys; entry s of list L at s * 512 + L
  static constexpr int kListOffset = kStages * kStageBytes;
  static constexpr int kMaxOffset = kListOffset + kLists * kSel_ * 8;  // largest key of each list
  static constexpr int kPosOffset = kMaxOffset + kLists * 8;           // its position
  static constexpr int kNormAOffset = kPosOffset + kLists * 4;         // x norms (kBlockM)
  static constexpr int kBarOffset = kNormAOffset + kBlockM * 4;        // full[kStages], empty[kStages]
  static constexpr int kAlignSlack = 1024;                             // the kernel aligns its base to 1 KiB
  static constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8 + kAlignSlack;
  static_assert(kProducerLag >= 1 && kProducerLag <= kStages - 2, "TopkWgmmaTraits: loader lag");
  static_assert(kStageBytes % 1024 == 0, "TopkWgmmaTraits: stages keep the 1 KiB alignment of the swizzle");
};

namespace topk_wgmma_detail {
using topk_mma_detail::u64;

// Lane-private list L (entries L, L + kLists, ...): key enters if below the largest.
template <class Tr>
__device__ __forceinline__ void offer(u64* lists, u64* max_key, int* max_pos, int L, u64 key) {
  constexpr int S = Tr::kSel, NL = Tr::kLists;
  if (!(key < max_key[L])) return;
  lists[max_pos[L] * NL + L] = key;
  u64 mx = lists[L];
  int pos = 0;
#pragma unroll
  for (int s = 1; s < S; ++s) {
    const u64 e = lists[s * NL + L];
    if (e > mx) {
      mx = e;
      pos = s;
    }
  }
  max_key[L] = mx;
  max_pos[L] = pos;
}
}  // namespace topk_wgmma_detail

// Grid (row tiles, N splits, 1); each CTA walks `per` y tiles from split * per. scratch:
// [n_split * 4][M][kSel] int64 (sorted lists, top bit flipped). One batch entry (batch == 1,
// the planner's only use: no batch modes at K > 64; the batch arguments are ignored).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    topk_wgmma_kernel(const float* __restrict__ x, const float* __restrict__ y, long long* __restrict__ scratch,
                      int M, int N, int K, long long ldx, long long ldy, int batch, int batch_n1, int batch_n2,
                      long long x_bs0, long long x_bs1, long long x_bs2, long long y_bs0, long long y_bs1,
                      long long y_bs2, int n_split, int per) {
  using Tr = Traits;
  using namespace mma_detail;
  using namespace wgmma_detail;
  using topk_mma_detail::u64;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, S = Tr::kSel, NL = Tr::kLists;
  constexpr int kStages = Tr::kStages, kStageBytes = Tr::kStageBytes, kLag = Tr::kProducerLag;
  constexpr bool kDiff = Tr::kInner == Inner::Diff;
  (void)n_split;
  const int nkt = ceil_div(K, Tr::kBlockK);
  if (nkt > Tr::kMaxKTiles || batch != 1) __trap();  // K <= 128, one batch entry (the caller's rule)

  extern __shared__ __align__(1024) unsigned char smem[];  // (named smem: the host emulation defines it)
  const unsigned raw_base = smem_u32(smem);
  const unsigned base = (raw_base + 1023u) & ~1023u;  // the swizzle follows address bits
  unsigned char* sm = smem + (base - raw_base);
  u64* lists = reinterpret_cast<u64*>(sm + Tr::kListOffset);
  u64* max_key = reinterpret_cast<u64*>(sm + Tr::kMaxOffset);
  int* max_pos = reinterpret_cast<int*>(sm + Tr::kPosOffset);
  float* norm_a = reinterpret_cast<float*>(sm + Tr::kNormAOffset);
  const unsigned bar_full = base + Tr::kBarOffset;
  const unsigned bar_empty = bar_full + 8 * kStages;

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, Tr::kProducerThreads);
      mbar_init(bar_empty + 8 * s, Tr::kConsumerThreads / 32);
    }
    fence_mbarrier_init_cluster();
  }
  __syncthreads();

  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y;
  const int n_begin = split * per * BN, n_end = min(N, n_begin + per * BN);
  const int n_tiles = n_begin < n_end ? ceil_div(n_end - n_begin, BN) : 0;
  (void)batch_n1, (void)batch_n2, (void)x_bs0, (void)x_bs1, (void)x_bs2, (void)y_bs0, (void)y_bs1, (void)y_bs2;

  if (tid < Tr::kProducerThreads) {
    // ================================================================== loader
    regs_decrease<Tr::kProducerRegs>();
    // Thread (prow, p) copies rows prow + 32 u (u < 8) of every y tile, logical chunk lc: the
    // chunk v5's norm sums give to quad position p (p ^ its swizzle bit), the same for all u.
    const int p = tid & 3, prow = tid >> 2;
    const int lc = p ^ (((prow >> 1) & 1) << 1);
    const unsigned dst = swizzled(prow, lc);  // + 32 u rows: same swizzle (32 u >> 1 is a multiple of 4)
    int is = 0, rs = 0;                       // the next issue's and retirement's stage
    unsigned iphase = 0;
    {
      const float* yl = y;
      const int total = n_tiles * nkt;
      float sq[8];
      int i_kt = 0, r_kt = 0;  // k-tile of the next issue / retirement
      const float* src = yl + (long long)(n_begin + prow) * ldy + lc * 4;  // the next issue's rows (k-tile 0)
      int rows_left = N - n_begin - prow;  // of the next issue's tile: row u is in range if 32 u < rows_left
      for (int q = 0; q < total + kLag; ++q) {
        if (q < total) {
          mbar_wait(bar_empty + 8 * is, iphase ^ 1u);  // the consumers are done with this stage
          const unsigned st = base + is * kStageBytes + dst;
          const int k_left = K - i_kt * Tr::kBlockK - lc * 4;
          const int bytes = k_left <= 0 ? 0 : (k_left >= 4 ? 16 : k_left * 4);
          const float* s_u = src + i_kt * Tr::kBlockK;
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const bool ok = 32 * u < rows_left && bytes > 0;
            cp_async_16(st + u * 32 * Tr::kRowBytes, ok ? s_u : y, ok ? bytes : 0);
            s_u += 32 * ldy;
          }
          if (++is == kStages) {
            is = 0;
            iphase ^= 1u;
          }
          if (++i_kt == nkt) {
            i_kt = 0;
            rows_left -= BN;
            src += BN * ldy;
          }
        }
        cp_async_commit();
        if (q >= kLag) {
          cp_async_wait<kLag>();  // this thread's copies of k-tile q - kLag have landed
          unsigned char* st = sm + rs * kStageBytes;
          if (r_kt == 0) {
#pragma unroll
            for (int u = 0; u < 8; ++u) sq[u] = 0.f;
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            uint4* c = reinterpret_cast<uint4*>(st + dst + u * 32 * Tr::kRowBytes);
            uint4 v = *c;
            if constexpr (kDiff) sq[u] += chunk_sumsq<float>(v);
            v.x = tf32_rna(v.x);
            v.y = tf32_rna(v.y);
            v.z = tf32_rna(v.z);
            v.w = tf32_rna(v.w);
            *c = v;
            asm volatile("" ::: "memory");  // one chunk at a time (the loader's 40 registers)
          }
          if (++r_kt == nkt) {
            r_kt = 0;
            if constexpr (kDiff) store_quad_norms<32>(sq, reinterpret_cast<float*>(st + Tr::kNormSlot), prow, p);
          }
          fence_proxy_async();  // the rounded stage (generic writes) before wgmma's async-proxy reads
          mbar_arrive(bar_full + 8 * rs);
          if (++rs == kStages) rs = 0;
        }
      }
    }
  } else {
    // ================================================================ consumers
    regs_increase<Tr::kConsumerRegs>();
    const int ctid = tid - Tr::kProducerThreads;
    const int lane = ctid & 31, cwarp = ctid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = (cwarp >> 2) * 64 + (cwarp & 3) * 16 + g;  // rows row0, row0 + 8 of the x tile
    int cs = 0;
    unsigned cphase = 0;
    auto release = [&](int s) {
      __syncwarp();  // every lane's reads of the stage (wgmma retired, norms read)
      if (lane == 0) mbar_arrive(bar_empty + 8 * s);
    };

    {
      const float* xl = x;
      // x's TF32 A fragments of the whole range (wgmma .tf32 A: a0 (row g, k t), a1 (row g + 8,
      // k t), a2 (row g, k t + 4), a3 (row g + 8, k t + 4) of each k8 step).
      unsigned xf[Tr::kMaxKTiles][2][4];
#pragma unroll
      for (int kt = 0; kt < Tr::kMaxKTiles; ++kt)
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const int r = m0 + row0 + 8 * (v & 1), c = kt * Tr::kBlockK + 8 * s + t + 4 * (v >> 1);
            xf[kt][s][v] = r < M && c < K ? tf32_rna(__float_as_uint(xl[(long long)r * ldx + c])) : 0u;
          }
      // x norms as v5 sums them (thread ctid as v5's tid: rows ctid / 4 + 64 u, the chunk v5's quad
      // position ctid % 4 reads), from global memory.
      if constexpr (kDiff) {
        const int cr = ctid >> 2, cp = ctid & 3;
        float sqa[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = cr + 64 * u;
          const int c4 = (cp ^ (((r >> 1) & 1) << 1)) * 4;
          sqa[u] = 0.f;
          for (int kt = 0; kt < nkt; ++kt) {
            uint4 ch;
            unsigned w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = kt * Tr::kBlockK + c4 + e;
              w[e] = m0 + r < M && c < K ? __float_as_uint(xl[(long long)(m0 + r) * ldx + c]) : 0u;
            }
            ch.x = w[0], ch.y = w[1], ch.z = w[2], ch.w = w[3];
            sqa[u] += chunk_sumsq<float>(ch);
          }
        }
        store_quad_norms<64>(sqa, norm_a, cr, cp);
      }
      // This lane's two lists (rows past M: key 0, which nothing enters).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int L = (row0 + 8 * h) * 4 + t;
        const u64 empty = m0 + row0 + 8 * h < M ? ~0ull : 0ull;
        for (int s = 0; s < S; ++s) lists[s * NL + L] = empty;
        max_key[L] = empty;
        max_pos[L] = 0;
      }
      named_barrier<1, Tr::kConsumerThreads>();  // norm_a visible

      for (int tile = 0; tile < n_tiles; ++tile) {
        const int n0 = n_begin + tile * BN;
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int prev = 0;
#pragma unroll
        for (int kt = 0; kt < Tr::kMaxKTiles; ++kt) {
          if (kt < nkt) {
            mbar_wait(bar_full + 8 * cs, cphase);
            wgmma_fence();
            const unsigned st = base + cs * kStageBytes;
#pragma unroll
            for (int s = 0; s < 2; ++s) wgmma_m64n256k8_tf32_rs(acc, xf[kt][s], make_desc(st + s * 32));
            wgmma_commit();
            wgmma_wait<1>();  // the previous k-tile's wgmma is done: its stage goes back
            if (kt > 0) release(prev);
            prev = cs;
            if (++cs == kStages) {
              cs = 0;
              cphase ^= 1u;
            }
          }
        }
        wgmma_wait<0>();
        const float* norm_b = reinterpret_cast<const float*>(sm + prev * kStageBytes + Tr::kNormSlot);

        // The values (v4's expression) and the prefilter against the thresholds (values' order:
        // every value whose bits are <= the threshold's passes, NaN passes).
        float na[2], thr_f[2];
        unsigned thr_b[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int L = (row0 + 8 * h) * 4 + t;
          na[h] = kDiff ? norm_a[row0 + 8 * h] : 0.f;
          thr_b[h] = unsigned(max_key[L] >> 32);
          thr_f[h] = topk_detail::value_of<Tr>(thr_b[h]);
        }
        bool hit[2] = {false, false};
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          float2 nb = make_float2(0.f, 0.f);
          if constexpr (kDiff) nb = *reinterpret_cast<const float2*>(norm_b + 8 * j + 2 * t);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float v = acc[4 * j + 2 * h + e];
              if constexpr (kDiff) v = math::fmax_nan(fmaf(-2.f, v, na[h] + (e ? nb.y : nb.x)), 0.f);
              acc[4 * j + 2 * h + e] = v;
              if constexpr (Tr::kLargest) {
                hit[h] |= !(v < thr_f[h]);
              } else {
                hit[h] |= !(v > thr_f[h]);
              }
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!hit[h]) continue;
          const int L = (row0 + 8 * h) * 4 + t;
          u64 cand = 0;  // bit 2 j + e: value (j, e) at or below the threshold, in range
#pragma unroll
          for (int j = 0; j < 32; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (topk_detail::order_bits<Tr>(acc[4 * j + 2 * h + e]) <= thr_b[h] && n0 + 8 * j + 2 * t + e < n_end)
                cand |= 1ull << (2 * j + e);
          while (cand != 0) {
            const int b = __ffsll((long long)cand) - 1;
            cand &= cand - 1;
            float value = 0.f;
#pragma unroll
            for (int qq = 0; qq < 64; ++qq)
              if (qq == b) value = acc[4 * (qq >> 1) + 2 * h + (qq & 1)];
            const u64 key = topk_detail::make_key(topk_detail::order_bits<Tr>(value),
                                                  unsigned(n0 + 8 * (b >> 1) + 2 * t + (b & 1)));
            topk_wgmma_detail::offer<Tr>(lists, max_key, max_pos, L, key);
          }
        }
        release(prev);  // the tile's last stage (its norms read)
      }

      // The lane's lists, sorted, to the scratch (quarter t), top bit flipped.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + row0 + 8 * h;
        if (m >= M) continue;
        const int L = (row0 + 8 * h) * 4 + t;
        for (int i = 1; i < S; ++i) {  // insertion sort (once per range)
          const u64 key = lists[i * NL + L];
          int s = i;
          while (s > 0 && lists[(s - 1) * NL + L] > key) {
            lists[s * NL + L] = lists[(s - 1) * NL + L];
            --s;
          }
          lists[s * NL + L] = key;
        }
        long long* dstp = scratch + (i64(split * 4 + t) * M + m) * S;
        for (int s = 0; s < S; ++s) dstp[s] = (long long)(lists[s * NL + L] ^ 0x8000000000000000ull);
      }
    }
  }
}

}  // namespace kermac_like
