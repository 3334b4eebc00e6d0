// Hopper (sm_90a) fused kernel matrix-vector product for Euclidean/DOT descriptors
// (ABI: cuda_templates/ABI.md, built by kermac_like/plan/matvec_wgmma.py _plan_matvec_wgmma):
//
//   out[l][m, c] = sum_n (k(x[l][m], y[l][n]) + lambda [n - m == reg_diag]) v[l][n, c]
//
// distance_wgmma_kernel's machinery (distance_wgmma.cuh) with a different epilogue:
// the same persistent, warp-specialised CTA (a loader warpgroup, two consumer
// warpgroups), the same clusters of two CTAs over vertically adjacent 128-row tiles
// that share each prepared b block by multicast, the same 3xTF32 products from
// wgmma_prepare_b_kernel's blocks, the same per-entry epilogue (EntryEpilogue:
// clamp, sqrt, epsilon, exp2, the regularised diagonal) and the exact zero
// self-distance. Instead of storing its 128 x 256 tile of k, a consumer thread
// multiplies its 2 rows x 64 columns of the tile by the matching rows of v, staged
// in shared memory with the tile (as the b norms are), and keeps the products as
// per-row sums in registers while the CTA walks its range of N tiles for a fixed
// row tile. No M x N matrix, no tile in memory.
//
// Work items: (batch entry, pair of 128-row tiles, split of the N range); a cluster
// walks items cluster_id, cluster_id + clusters, ... (consecutive items are
// consecutive row pairs of the same N range, so concurrent clusters read the same b
// blocks from L2). Shared-memory epilogue buffers (b norms + v tile) form a ring of
// kEpiBufs with their own full/empty mbarriers: the loader copies a tile's buffer
// with the tile's last k-tile; the consumers give it back after the epilogue.
//
// Accumulation: a thread's 64-term float32 partial per row and column of v for each
// tile; the four lanes of a quad (the 256 columns of a row) are combined per tile by
// a reduce-scatter (kC >= 2: each lane then owns kC/4 columns, or 1), and the tile
// sums are added into float64 totals; the last lanes' totals are combined at the end
// of the item. So the rounding error does not grow with N (as in matvec.cuh). With a
// split N range (n_split > 1) each item writes float32 totals to `part`
// ([split][batch][M][C]) and a combination kernel adds the splits in split order;
// with the N range in several launches (bounded scratch for the prepared b) the
// float64 totals go through `carry` ([batch][M][C]) in launch order. No atomics:
// results are bitwise reproducible.
#pragma once

#include "distance_wgmma.cuh"

namespace kermac_like {

// kC_: columns of v per launch (1, 2, 4, 8 or 16; fewer real columns are
// zero-padded in the prepared v). kStagesArg: 0 = the largest ring that fits with
// the epilogue buffers.
template <Inner kInner_, Power kOuter_, Epilogue kEpilogue_, int kC_, Precision kPrecision_ = Precision::Tf32x3,
          int kStagesArg = 0>
struct MatvecWgmmaTraits
    : mma_detail::TensorCoreDistance<kInner_, kOuter_, kEpilogue_, Layout::RowMajor, Layout::RowMajor,
                                     Layout::RowMajor, kPrecision_, float> {
  static_assert(kPrecision_ == Precision::Tf32x3 || kPrecision_ == Precision::Tf32,
                "MatvecWgmmaTraits: Precision Tf32x3 or Tf32 (float32 data)");
  static_assert(kC_ == 1 || kC_ == 2 || kC_ == 4 || kC_ == 8 || kC_ == 16,
                "MatvecWgmmaTraits: kC is 1, 2, 4, 8 or 16");

  static constexpr int kC = kC_;
  static constexpr bool kSplit = kPrecision_ == Precision::Tf32x3;
  static constexpr bool kDiff = kInner_ == Inner::Diff;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kProducerRegs = 56;  // 56 * 128 + 224 * 256 = 168 * 384
  static constexpr int kConsumerRegs = 224;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kRowBytes = 64;
  static constexpr int kBlockK = kRowBytes / 4;
  static constexpr int kTileABytes = kBlockM * kRowBytes;                 // 8 KiB
  static constexpr int kTileBBytes = kBlockN * kRowBytes;                 // 16 KiB
  static constexpr int kBBlockBytes = kTileBBytes * (kSplit ? 2 : 1);     // one prepared b block
  static constexpr int kStageBytes = kTileABytes + kBBlockBytes;          // A raw, B raw, B small
  // Epilogue buffer: the tile's b norms (Inner::Diff), then its v rows (kBlockN x kC).
  static constexpr int kNormBytes = kDiff ? kBlockN * 4 : 0;
  static constexpr int kVBytes = kBlockN * kC * 4;
  static constexpr int kEpiBytes = kNormBytes + kVBytes;
  static constexpr int kClusterM = 2;
  static constexpr int kAlignSlack = 1024;
  static constexpr int kMaxSmem = 227 * 1024;
  static constexpr int kDefaultStages = kSplit ? 5 : 8;
  __host__ __device__ static constexpr int smem_for(int stages, int bufs) {
    return stages * kStageBytes + bufs * kEpiBytes + 16 * (stages + bufs) + kAlignSlack;
  }
  // Two epilogue buffers (the loader copies tile t + 1's while tile t's is read) where
  // they fit beside the full ring, else one (kC = 16 with 3xTF32).
  static constexpr int kEpiBufs = smem_for(kDefaultStages, 2) <= kMaxSmem ? 2 : 1;
  static constexpr int kStages = kStagesArg > 0 ? kStagesArg : kDefaultStages;
  static constexpr int kSmemBytes = smem_for(kStages, kEpiBufs);
  static constexpr bool kPersistent = true;
  // Reduce-scatter steps across the quad per tile and columns a lane owns after them.
  static constexpr int kSteps = kC >= 4 ? 2 : (kC == 2 ? 1 : 0);
  static constexpr int kLaneC = kC >> kSteps;
  // Independent float32 partial chains per row (the two columns of a pair) for small kC.
  static constexpr int kChains = kC <= 2 ? 2 : 1;
  // Columns of v per pass over the tile's k values (kC = 16: two passes, fewer live registers).
  static constexpr int kGroupC = kC > 8 ? 8 : kC;

  static_assert(kStages >= 3, "MatvecWgmmaTraits: at least 3 stages");
  static_assert(kStageBytes % 1024 == 0 && kEpiBytes % 1024 == 0,
                "MatvecWgmmaTraits: stages and buffers keep the 1 KiB alignment of the swizzle");
  static_assert(kSmemBytes <= kMaxSmem, "MatvecWgmmaTraits: shared memory above 227 KiB");
};

namespace matvec_wgmma_detail {

// Float offset of element (column n, value f = e kC + c) of the prepared v tile, where
// n = 8 j + 2 t + e: lane t of a quad reads its 2 kC values of step j as float2 (kC = 1)
// or float4 chunks q = f / 4 (4 consecutive lanes, 64 contiguous bytes per load).
// kermac_like/plan/matvec_wgmma.py writes the same layout (_prepare_v).
template <int kC>
__host__ __device__ constexpr int v_offset(int j, int t, int e, int c) {
  if (kC == 1) return 8 * j + 2 * t + e;
  const int f = e * kC + c;
  return j * 8 * kC + ((f >> 2) * 4 + t) * 4 + (f & 3);
}

// One reduce-scatter step across a lane pair (xor kLane): each lane sends the half of
// q[h][0, 2 kHalf) it gives up and adds the peer's copy of the half it keeps (the upper half
// where `upper`), leaving it in q[h][0, kHalf).
template <int kHalf, int kLane, int kN>
__device__ __forceinline__ void halve_across_pair(float (&q)[2][kN], bool upper) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? q[h][i] : q[h][i + kHalf];
      const float keep = upper ? q[h][i + kHalf] : q[h][i];
      q[h][i] = keep + __shfl_xor_sync(0xffffffffu, send, kLane);
    }
}

}  // namespace matvec_wgmma_detail

// The flat ABI (cuda_templates/ABI.md, "kernel_matvec on Hopper"): x (M, K) row-major
// with 16-byte aligned rows and batch offsets; y read only through what
// wgmma_prepare_b_kernel wrote (b_blocks, b_norm, entry strides bc*); v through its
// prepared tiles (v_blocks, batch strides vb_bs*, tile t of an entry at t * kBlockN * kC
// floats). self_on: x is y (the diagonal n - m == self_diag has distance exactly 0).
// Grid: min(items in clusters, active clusters) clusters of kClusterM CTAs.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) matvec_wgmma_kernel(
    const float* __restrict__ x, float* __restrict__ out, float* __restrict__ part, double* __restrict__ carry,
    int M, int N, int K, int C, long long ldx, long long som, long long soc, int batch, int batch_n1,
    int batch_n2, long long x_bs0, long long x_bs1, long long x_bs2, long long o_bs0, long long o_bs1,
    long long o_bs2, const float* inner_p_ptr, long long inner_p_bs0, long long inner_p_bs1,
    long long inner_p_bs2, float inner_p, const float* outer_p_ptr, long long outer_p_bs0,
    long long outer_p_bs1, long long outer_p_bs2, float outer_p, const float* bw_ptr, long long bw_bs0,
    long long bw_bs1, long long bw_bs2, float bandwidth, const float* reg_ptr, long long reg_bs0,
    long long reg_bs1, long long reg_bs2, float regularization, long long reg_diag, float epsilon, int self_on,
    long long self_diag, const float* __restrict__ b_blocks, const float* __restrict__ b_norm, long long bc0,
    long long bc1, long long bc2, const float* __restrict__ v_blocks, long long vb_bs0, long long vb_bs1,
    long long vb_bs2, int n_split, int tiles_per_split, int carry_mode) {
  using namespace mma_detail;
  using namespace wgmma_detail;
  using matvec_wgmma_detail::v_offset;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kC = Traits::kC;
  constexpr int kStages = Traits::kStages, kStageBytes = Traits::kStageBytes;
  constexpr int kEpiBufs = Traits::kEpiBufs, kEpiBytes = Traits::kEpiBytes;
  constexpr int kRowBytes = Traits::kRowBytes, kBlockK = Traits::kBlockK;
  constexpr int kTileABytes = Traits::kTileABytes, kTileBBytes = Traits::kTileBBytes;
  constexpr int kBBlockBytes = Traits::kBBlockBytes;
  constexpr int kCluster = Traits::kClusterM;
  constexpr bool kSplit = Traits::kSplit;
  constexpr bool kDiff = Traits::kDiff;
  constexpr int kRowsPerPass = Traits::kProducerThreads / 4;
  constexpr int kPassesA = kBlockM / kRowsPerPass;
  using Prepared = WgmmaPrepareTraits<kSplit, kDiff>;
  static_assert(Prepared::kTileN == kBlockN && Prepared::kTileK == kBlockK &&
                    Prepared::kBlockFloats * 4 == kBBlockBytes,
                "matvec_wgmma_kernel: the prepared b blocks are this kernel's b tiles");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw_base = smem_u32(smem_raw);
  const unsigned base = (raw_base + 1023u) & ~1023u;
  // [kStages x (A raw, B raw, B small)][kEpiBufs x (b norms, v tile)]
  // [full[kStages]][empty[kStages]][epi_full[kEpiBufs]][epi_empty[kEpiBufs]]
  const unsigned epi_base = base + kStages * kStageBytes;
  const unsigned bar_full = epi_base + kEpiBufs * kEpiBytes;
  const unsigned bar_empty = bar_full + 8 * kStages;
  const unsigned bar_epi_full = bar_empty + 8 * kStages;
  const unsigned bar_epi_empty = bar_epi_full + 8 * kEpiBufs;

  const int tid = threadIdx.x;
  const unsigned rank = cluster_ctarank();
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, Traits::kProducerThreads + 1);
      mbar_init(bar_empty + 8 * s, kCluster * Traits::kConsumerThreads / 32);
    }
    for (int e = 0; e < kEpiBufs; ++e) {
      mbar_init(bar_epi_full + 8 * e, 1);  // the expect_tx arrival; the bytes complete it
      mbar_init(bar_epi_empty + 8 * e, kCluster * Traits::kConsumerThreads / 32);
    }
    fence_mbarrier_init_cluster();
  }
  cluster_sync();

  const int tiles_m = ceil_div(M, kBlockM), tiles_n = ceil_div(N, kBlockN);
  const int pairs_m = ceil_div(tiles_m, kCluster);
  const long long total = (long long)pairs_m * n_split * batch;
  const int num_k_tiles = ceil_div(K, kBlockK);
  const long long n_pad = (long long)tiles_n * kBlockN;
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride x_stride{x_bs0, x_bs1, x_bs2}, o_stride{o_bs0, o_bs1, o_bs2}, b_entry{bc0, bc1, bc2},
      vb_stride{vb_bs0, vb_bs1, vb_bs2};
  (void)inner_p_ptr, (void)inner_p_bs0, (void)inner_p_bs1, (void)inner_p_bs2, (void)inner_p;
  (void)outer_p_ptr, (void)outer_p_bs0, (void)outer_p_bs1, (void)outer_p_bs2, (void)outer_p;
  const long long first = cluster_id_x(), step = cluster_count_x();

  // Item w: (batch entry l, split s, row pair), row pairs fastest; this CTA's rows
  // from m0, the item's y tiles [t0, t1).
  auto item_of = [&](long long w, int& l, int& s, int& m0, int& t0, int& t1) {
    const int pair = (int)(w % pairs_m);
    const long long r = w / pairs_m;
    s = (int)(r % n_split);
    l = (int)(r / n_split);
    m0 = (pair * kCluster + (int)rank) * kBlockM;
    t0 = s * tiles_per_split;
    t1 = min(tiles_n, t0 + tiles_per_split);
  };

  if (tid < Traits::kProducerThreads) {
    // ================================================================== loader
    regs_decrease<Traits::kProducerRegs>();
    const int chunk = tid & 3, prow = tid >> 2;
    const unsigned dst = swizzled(prow, chunk);
    constexpr unsigned short kMask = (1u << kCluster) - 1u;
    constexpr unsigned kShare = kBBlockBytes / kCluster;
    int stage = 0, ebuf = 0;
    unsigned phase = 0, ephase = 0;
    for (long long w = first; w < total; w += step) {
      int l, s, m0, t0, t1;
      item_of(w, l, s, m0, t0, t1);
      (void)s;
      int l0, l1, l2;
      shape.split(l, l0, l1, l2);
      const float* a_row = x + x_stride.offset(l0, l1, l2) + (long long)(m0 + prow) * ldx + chunk * 4;
      const long long entry = b_entry.offset(l0, l1, l2);
      const float* v_l = v_blocks + vb_stride.offset(l0, l1, l2);
      const int a_rows = M - m0 - prow;
      for (int t = t0; t < t1; ++t) {
        const unsigned char* blocks = reinterpret_cast<const unsigned char*>(b_blocks) +
                                      (entry * tiles_n + t) * num_k_tiles * (long long)kBBlockBytes;
        for (int kt = 0; kt < num_k_tiles; ++kt) {
          mbar_wait(bar_empty + 8 * stage, phase ^ 1u);
          const unsigned st = base + stage * kStageBytes;
          if (tid == 0) {
            mbar_arrive_expect_tx(bar_full + 8 * stage, kBBlockBytes);
            bulk_copy_multicast(st + kTileABytes + rank * kShare, blocks + kt * (long long)kBBlockBytes + rank * kShare,
                                kShare, bar_full + 8 * stage, kMask);
            if (kt == num_k_tiles - 1) {
              // The tile's epilogue buffer: b norms and v rows (whole tiles: both are
              // padded to n_pad rows), multicast by rank 0 once the buffer is free in
              // both CTAs (its empty barrier counts the consumer warps of the cluster).
              const unsigned eb = epi_base + ebuf * kEpiBytes;
              mbar_wait(bar_epi_empty + 8 * ebuf, ephase ^ 1u);
              mbar_arrive_expect_tx(bar_epi_full + 8 * ebuf, kEpiBytes);
              if (rank == 0) {
                if constexpr (kDiff)
                  bulk_copy_multicast(eb, b_norm + entry * n_pad + (long long)t * kBlockN, Traits::kNormBytes,
                                      bar_epi_full + 8 * ebuf, kMask);
                bulk_copy_multicast(eb + Traits::kNormBytes, v_l + (long long)t * kBlockN * kC, Traits::kVBytes,
                                    bar_epi_full + 8 * ebuf, kMask);
              }
              if (++ebuf == kEpiBufs) {
                ebuf = 0;
                ephase ^= 1u;
              }
            }
          }
          const int k_left = K - kt * kBlockK - chunk * 4;
          const int bytes = k_left <= 0 ? 0 : (k_left >= 4 ? 16 : k_left * 4);
#pragma unroll
          for (int u = 0; u < kPassesA; ++u) {
            const bool ok = u * kRowsPerPass < a_rows && bytes > 0;
            cp_async_16(st + dst + u * kRowsPerPass * kRowBytes, ok ? a_row + u * kRowsPerPass * ldx + kt * kBlockK : x,
                        ok ? bytes : 0);
          }
          cp_async_mbar_arrive(bar_full + 8 * stage);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
    cp_async_wait_all();
  } else {
    // ================================================================ consumers
    regs_increase<Traits::kConsumerRegs>();
    const int ctid = tid - Traits::kProducerThreads;
    const int lane = ctid & 31, cwarp = ctid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wg = cwarp >> 2;
    unsigned ld_off[2];
    a_fragment_offsets(lane, cwarp, ld_off);
    int stage = 0, ebuf = 0;
    unsigned phase = 0, ephase = 0;
    // A stage (or epilogue buffer) goes back to the loaders of every CTA of the cluster: one
    // arrival per warp after __syncwarp, which orders every lane's reads before it (see the
    // release of distance_wgmma.cuh). compute-sanitizer's racecheck reports these reads (b
    // norms, v tile, ldmatrix) against the loader's next copies: the tool's limit with one-lane
    // arrivals, shown by bench/probes/racecheck_mbarrier.py (bench/notes/sanitizer.md).
    auto release = [&](unsigned bar) {
      __syncwarp();
      if (lane < kCluster) mbar_arrive_cluster(bar, (unsigned)lane);
    };

    const HyperParam bw_param{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth};
    const HyperParam reg_param{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};
    const bool reg_on = reg_ptr != nullptr || regularization != 0.f;
    // Accumulator h (0: row0, 1: row0 + 8), columns 8 j + 2 t4 + e of the tile.
    const int row0 = wg * 64 + (cwarp & 3) * 16 + g, col0 = 2 * t4;
    const bool b1 = (t4 >> 1) & 1, b0 = t4 & 1;

    float acc[128];
    for (long long w = first; w < total; w += step) {
      int l, s, m0, t0, t1;
      item_of(w, l, s, m0, t0, t1);
      double total_h[2][Traits::kLaneC];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < Traits::kLaneC; ++i) total_h[h][i] = 0.0;

      for (int t = t0; t < t1; ++t) {
        const int n0 = t * kBlockN;
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        float na[2] = {0.f, 0.f};

        // The k-loop of distance_wgmma_kernel: two fragment buffers (even and odd
        // k-tiles) so that an in-flight wgmma's A registers are never rewritten.
        int prev_stage = -1;
        auto k_tile = [&](int kt, unsigned (&frag)[2][2][4]) {
          mbar_wait(bar_full + 8 * stage, phase);
          consume_k_tile<kSplit, kDiff, kTileABytes, kTileBBytes>(acc, frag, na, base + stage * kStageBytes,
                                                                  ld_off, num_k_tiles);
          wgmma_wait<1>();
          if (kt > 0) release(bar_empty + 8 * prev_stage);
          prev_stage = stage;
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        };
        unsigned frag_even[2][2][4], frag_odd[2][2][4];
        for (int kt = 0; kt < num_k_tiles; kt += 2) {
          k_tile(kt, frag_even);
          if (kt + 1 < num_k_tiles) k_tile(kt + 1, frag_odd);
        }
        wgmma_wait<0>();
        release(bar_empty + 8 * prev_stage);  // the epilogue reads no stage

        // ---------------------------------------------------------- epilogue
        // (The item's batch entry and hyper-parameters are recomputed here and at the
        // end rather than kept live across the k-loop: registers.)
        int l0, l1, l2;
        shape.split((int)(w / pairs_m / n_split), l0, l1, l2);
        const EntryEpilogue<Traits> finish(bw_param.at(l0, l1, l2), reg_on ? reg_param.at(l0, l1, l2) : 0.f, epsilon);
        mbar_wait(bar_epi_full + 8 * ebuf, ephase);
        const float* epi = reinterpret_cast<const float*>(smem_raw + (base - raw_base) + ebuf * kEpiBytes +
                                                          (epi_base - base));
        const float* norm_b = epi;
        const float* vt = epi + Traits::kNormBytes / 4;

        int reg_col[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kDiff) {
            na[h] += __shfl_xor_sync(0xffffffffu, na[h], 1);
            na[h] += __shfl_xor_sync(0xffffffffu, na[h], 2);
          }
          const long long c = (long long)(m0 + row0 + h * 8) + reg_diag - n0;
          reg_col[h] = reg_on && c >= 0 && c < kBlockN ? (int)c : -1;
        }
        // Self distances (x is y): dot = (na + nb) / 2 on the diagonal n - m == self_diag,
        // so that na + nb - 2 dot is exactly 0 there.
        if (kDiff && self_on && (long long)m0 + self_diag < n0 + kBlockN &&
            (long long)n0 < m0 + kBlockM + self_diag) {
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int col = col0 + j * 8;
            const float2 nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const long long diag = (long long)(m0 + row0 + h * 8) + self_diag - n0;  // tile-local column
              if (diag == col) acc[4 * j + 2 * h] = 0.5f * (na[h] + nb.x);
              if (diag == col + 1) acc[4 * j + 2 * h + 1] = 0.5f * (na[h] + nb.y);
            }
          }
        }

        // 1. k in place of the accumulators (k of rows past M is never stored; columns
        // past N become 0). Tiles inside the output with epsilon off and the regularised
        // diagonal not crossing them take a copy without bounds, epsilon or diagonal tests.
        const bool fast = n0 + kBlockN <= N && !(epsilon > 0.f) &&
                          (!reg_on || (long long)m0 + reg_diag >= n0 + kBlockN ||
                           (long long)m0 + kBlockM - 1 + reg_diag < n0);
        auto kernel_values = [&](const bool kFast) {
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int col = col0 + j * 8;
            float2 nb = make_float2(0.f, 0.f);
            if constexpr (kDiff) nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float& k0 = acc[4 * j + 2 * h];
              float& k1 = acc[4 * j + 2 * h + 1];
              k0 = finish(k0, na[h], nb.x, reg_col[h] == col, kFast);
              k1 = finish(k1, na[h], nb.y, reg_col[h] == col + 1, kFast);
              if (!kFast) {
                if (n0 + col >= N) k0 = 0.f;
                if (n0 + col + 1 >= N) k1 = 0.f;
              }
            }
          }
        };
        if (fast) {
          kernel_values(true);
        } else {
          kernel_values(false);
        }

        asm volatile("" ::: "memory");  // step 2 after step 1 in NVVM (ptxas still schedules freely)
        // 2. k times v, kG columns at a time: p[h][chain][c] are this thread's 64-term
        // float32 partials of the tile (rows row0 + 8 h, columns 8 j + 2 t4 + e).
        constexpr int kG = Traits::kGroupC, kChains = Traits::kChains;
#pragma unroll
        for (int grp = 0; grp < kC / kG; ++grp) {
          float p[2][kChains][kG];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < kChains; ++q)
#pragma unroll
              for (int c = 0; c < kG; ++c) p[h][q][c] = 0.f;
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            if constexpr (kC == 1) {
              const float2 vv = *reinterpret_cast<const float2*>(vt + v_offset<1>(j, t4, 0, 0));
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                p[h][0][0] = fmaf(acc[4 * j + 2 * h], vv.x, p[h][0][0]);
                p[h][1][0] = fmaf(acc[4 * j + 2 * h + 1], vv.y, p[h][1][0]);
              }
            } else if constexpr (kC == 2) {  // one float4: (e, c) = (0, 0), (0, 1), (1, 0), (1, 1)
              const float4 vv = *reinterpret_cast<const float4*>(vt + v_offset<2>(j, t4, 0, 0));
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                p[h][0][0] = fmaf(acc[4 * j + 2 * h], vv.x, p[h][0][0]);
                p[h][0][1] = fmaf(acc[4 * j + 2 * h], vv.y, p[h][0][1]);
                p[h][1][0] = fmaf(acc[4 * j + 2 * h + 1], vv.z, p[h][1][0]);
                p[h][1][1] = fmaf(acc[4 * j + 2 * h + 1], vv.w, p[h][1][1]);
              }
            } else {
#pragma unroll
              for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int c = 0; c < kG; c += 4) {  // float4 chunks of the row n = 8 j + 2 t4 + e
                  const float4 f = *reinterpret_cast<const float4*>(vt + v_offset<kC>(j, t4, e, grp * kG + c));
#pragma unroll
                  for (int h = 0; h < 2; ++h) {
                    const float kv = acc[4 * j + 2 * h + e];
                    p[h][0][c] = fmaf(kv, f.x, p[h][0][c]);
                    p[h][0][c + 1] = fmaf(kv, f.y, p[h][0][c + 1]);
                    p[h][0][c + 2] = fmaf(kv, f.z, p[h][0][c + 2]);
                    p[h][0][c + 3] = fmaf(kv, f.w, p[h][0][c + 3]);
                  }
                }
            }
          }
          // 3. The quad's four partials of each row and column: a reduce-scatter, after
          // which lane t4 = (b1, b0) holds columns cbase + [0, kLaneC) (cbase below) summed
          // over the 256 columns of the tile. kG == kC: step (xor 2) to half of the
          // columns by b1, step (xor 1) to a quarter by b0 (as far as kC allows). Two
          // groups (kC = 16, kG = 8): group grp belongs to the lanes with b1 == grp; a
          // step (xor 1) halves it by b0, a sum (xor 2) completes it.
          float q1[2][kG];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < kG; ++c) q1[h][c] = kChains == 2 ? p[h][0][c] + p[h][kChains - 1][c] : p[h][0][c];
          if constexpr (kG == kC) {
            if constexpr (Traits::kSteps >= 1) matvec_wgmma_detail::halve_across_pair<kC / 2, 2>(q1, b1);
            if constexpr (Traits::kSteps >= 2) matvec_wgmma_detail::halve_across_pair<kC / 4, 1>(q1, b0);
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int i = 0; i < Traits::kLaneC; ++i) total_h[h][i] += (double)q1[h][i];
          } else {
            static_assert(kC == 2 * kG && Traits::kLaneC == kG / 2, "matvec_wgmma_kernel: two column groups");
            constexpr int kHalf = kG / 2;
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int i = 0; i < kHalf; ++i) {
                const float send = b0 ? q1[h][i] : q1[h][i + kHalf];
                const float keep = b0 ? q1[h][i + kHalf] : q1[h][i];
                float r = keep + __shfl_xor_sync(0xffffffffu, send, 1);
                r += __shfl_xor_sync(0xffffffffu, r, 2);
                if (b1 == (grp == 1)) total_h[h][i] += (double)r;
              }
          }
        }
        release(bar_epi_empty + 8 * ebuf);
        if (++ebuf == kEpiBufs) {
          ebuf = 0;
          ephase ^= 1u;
        }
      }

      // ------------------------------------------------------ the item's sums
      if constexpr (Traits::kSteps == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          total_h[h][0] += __shfl_xor_sync(0xffffffffu, total_h[h][0], 1);
          total_h[h][0] += __shfl_xor_sync(0xffffffffu, total_h[h][0], 2);
        }
      } else if constexpr (Traits::kSteps == 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) total_h[h][0] += __shfl_xor_sync(0xffffffffu, total_h[h][0], 1);
      }
      item_of(w, l, s, m0, t0, t1);
      int l0, l1, l2;
      shape.split(l, l0, l1, l2);
      const bool writer = Traits::kSteps == 2 || (Traits::kSteps == 1 ? !b0 : t4 == 0);
      const int cbase = (Traits::kSteps >= 1 ? (b1 ? kC / 2 : 0) : 0) + (Traits::kSteps >= 2 ? (b0 ? kC / 4 : 0) : 0);
      if (writer) {
        float* out_l = out + o_stride.offset(l0, l1, l2);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = m0 + row0 + h * 8;
          if (m >= M) continue;
#pragma unroll
          for (int i = 0; i < Traits::kLaneC; ++i) {
            const int c = cbase + i;
            if (c >= C) continue;
            if (n_split > 1) {
              part[(((long long)s * batch + l) * M + m) * C + c] = (float)total_h[h][i];
            } else {
              double r = total_h[h][i];
              const long long at = ((long long)l * M + m) * C + c;
              if (carry_mode & 1) r += carry[at];
              if (carry_mode & 2) {
                carry[at] = r;
              } else {
                out_l[(long long)m * som + (long long)c * soc] = (float)r;
              }
            }
          }
        }
      }
    }
  }
  cluster_sync();  // no CTA leaves while a peer may still multicast into it or arrive on its barriers
}

// Launch constants of matvec_carry_kernel (kermac_like/runtime/specs/matvec_wgmma.py).
struct MatvecCarryTraits {
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 1;  // grid-stride over batch * M * C
  static constexpr int kBlockN = 1;
  static constexpr int kSmemBytes = 0;
};

// After a split launch of one range of N (of several): r = (carry_mode & 1 ? carry : 0)
// + sum_s part[s] (split order, float64); written to carry (carry_mode & 2) or to out.
// Grid-stride over batch * M * C.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) matvec_carry_kernel(
    const float* __restrict__ part, double* __restrict__ carry, float* __restrict__ out, int M, int C,
    long long som, long long soc, int batch, int batch_n1, int batch_n2, long long o_bs0, long long o_bs1,
    long long o_bs2, int n_split, int carry_mode) {
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride o_bs{o_bs0, o_bs1, o_bs2};
  const i64 per = i64(M) * C, total = per * batch;
  for (i64 e = blockIdx.x * i64(blockDim.x) + threadIdx.x; e < total; e += i64(gridDim.x) * blockDim.x) {
    double r = (carry_mode & 1) ? carry[e] : 0.0;
    for (int s = 0; s < n_split; ++s) r += double(part[i64(s) * total + e]);
    if (carry_mode & 2) {
      carry[e] = r;
    } else {
      const int l = int(e / per);
      const int m = int((e % per) / C), c = int(e % C);
      out[o_bs.offset(shape.split(l)) + i64(m) * som + c * soc] = float(r);
    }
  }
}

}  // namespace kermac_like
