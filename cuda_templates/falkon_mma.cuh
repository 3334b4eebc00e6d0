// Falkon's two products on tensor cores: the Gaussian kernel of the data rows x (N x K) and the
// centres z (M x K) at small K (<= 32), applied without the N x M matrix in both directions,
//
//   falkon_rows_kernel:  out[i, c] = sum_j k(x_i, z_j) v[j, c]   (K_nZ v: a row of x per output)
//   falkon_cols_kernel:  out[j, c] = sum_i k(x_i, z_j) w[i, c]   (K_Zn w: a centre per output)
//
// with the same kernel value of every pair in both (bit for bit), so that the solver's operator
// K_Zn K_nZ is exactly a product with its own transpose. Planned by kermac_like/plan/falkon.py for
// KernelRidge(solver="nystrom") (ABI: cuda_templates/ABI.md; derivation and measurements:
// bench/notes/krr_1e9.md, "Falkon's products on tensor cores").
//
// Kernel value (the float64 mode's symmetric expanded form, matvec.cuh, with the dot product on
// tensor cores): coordinates centred on one vector `centre` and scaled by r = sqrt(s),
// s = log2(e) / (2 bw^2): u = r (x - centre), w = r (z - centre); a_i = -|u_i|^2 (fp32, k in the
// order below), b_j = -|w_j|^2 (falkon_prep_kernel), and the exponent
//   t_ij = fl(mma chain: b_j + lo(2u).hi(w) + hi(2u).lo(w) + hi(2u).hi(w), k-steps in order) + a_i,
//   k_ij = ex2.approx(t_ij)   (= exp(-|x_i - z_j|^2 / (2 bw^2)) up to the roundings),
// 2u split hi + lo (TF32, 3xTF32: the lo.lo term, 2^-22 relative, is dropped). Both kernels take
// x's A fragments from the same function (x_frags) and z's B fragments from the same prepared
// array, with A = x and B = z in both: one mma orientation, hence one value per pair. The rows
// kernel holds x in registers and streams z tiles; the cols kernel holds its centres in registers
// and streams x tiles (the fragments made by four of its warps, two stages).
//
// Sums (the blocked float64 mode of matvec.cuh): v and w arrive in float32 (rounded once by the
// caller); k * v is an FFMA into float32 partials of kGroup = 8 terms (rows kernel: 8 centres of
// one row; cols kernel: 8 rows of one centre), added into float64 totals; the 4 (rows) or 8
// (cols) lanes that hold parts of one output add their float64 totals in a fixed butterfly.
// Error beyond exact sums of the float32 terms: at most (kGroup + 1) u sum |k v|, u = 2^-24.
// With the centre range split (n_split > 1), each split writes out + split * split_stride and
// the caller adds the splits in order. No atomics: bitwise repeatable.
#pragma once

#include "common.cuh"
#include "math.cuh"
#include "distance_mma.cuh"

namespace kermac_like {

// kK_: K padded to 8, 16 or 32 (A fragments of kMt m16 tiles in registers); kC_: columns of v / w
// per launch (1, 2, 4 or 8; at most 4 with kK = 32).
template <int kK_, int kC_>
struct FalkonTraitsBase {
  static_assert(kK_ == 8 || kK_ == 16 || kK_ == 32, "FalkonTraits: kK is 8, 16 or 32");
  static_assert(kC_ == 1 || kC_ == 2 || kC_ == 4 || kC_ == 8, "FalkonTraits: kC is 1, 2, 4 or 8");
  static_assert(kK_ < 32 || kC_ <= 4, "FalkonTraits: kK = 32 takes kC <= 4 (the cols kernel spills at 8)");
  static constexpr int kK = kK_;
  static constexpr int kC = kC_;
  static constexpr int kSteps = kK_ / 8;  // k-steps of mma.m16n8k8
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kGroup = 8;  // float32 terms per partial
};

// The rows kernel: a CTA owns kBlockM rows (each warp 16 kMt), streams the centres in tiles of
// kBlockN (cp.async, two stages of fragments, b and v).
template <int kK_, int kC_>
struct FalkonRowsTraits : FalkonTraitsBase<kK_, kC_> {
  // m16 tiles per warp: <= ~100 registers of fragments, partials and totals
  static constexpr int kMt0 = kK_ == 8 ? 4 : kK_ == 16 ? 2 : 1;
  static constexpr int kMt = kC_ <= 2 ? kMt0 : kC_ == 4 ? (kMt0 > 1 ? kMt0 / 2 : 1) : 1;
  static constexpr int kBlockM = 8 * 16 * kMt;
  static constexpr int kBlockN = 128;
  static constexpr int kTileFrag = kBlockN * kK_ * 8;          // bytes: uint4 per (n8 block, k-step, lane)
  static constexpr int kTileBytes = kTileFrag + kBlockN * 4 + kBlockN * kC_ * 4;  // + b + v
  static constexpr int kSmemBytes = 2 * kTileBytes;
  static_assert((kBlockN / 8) % 4 == 0, "FalkonRowsTraits: a group is 4 n8 blocks (8 centres of a row)");
};

// The cols kernel: a CTA owns kBlockN centres (each warp kNbw n8 blocks), streams x in tiles of
// kBlockM = 64 rows (4 m16 tiles: 8 rows of a lane, one group) through two stages of fragments.
template <int kK_, int kC_>
struct FalkonColsTraits : FalkonTraitsBase<kK_, kC_> {
  // n8 blocks per warp: B fragments of <= 16 registers (4 / kSteps blocks), fewer for wide kC
  static constexpr int kNbwK = 4 / (kK_ / 8) > 0 ? 4 / (kK_ / 8) : 1;
  static constexpr int kNbwC = kC_ <= 2 ? 4 : kC_ == 4 ? 2 : 1;
  static constexpr int kNbw = kNbwK < kNbwC ? kNbwK : kNbwC;
  static constexpr int kBlockN = 8 * 8 * kNbw;
  static constexpr int kBlockM = 64;
  static constexpr int kMtX = kBlockM / 16;                        // m16 tiles of an x tile (4)
  static constexpr int kXFrag = kMtX * (kK_ / 8) * 32 * 32;      // bytes: hi, lo uint4 per (tile, step, lane)
  static constexpr int kXTileBytes = kXFrag + kBlockM * 4 + kBlockM * kC_ * 4;  // + a + w
  static constexpr int kSmemBytes = 2 * kXTileBytes;
};

namespace falkon_detail {

#ifndef KERMAC_LIKE_MMA_HOST_EMULATION
__device__ __forceinline__ double shfl_xor_double(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
#endif

// x's side of the m16 tile whose rows start at row m0 (lane (g, t), mma.m16n8k8's A layout: element
// r of k-step s is row m0 + g + 8 (r & 1), column 8 s + t + 4 (r >> 1)): the raw values xv (zero past
// N and K), u = r (x - centre) (zero past K), the split of 2u, and a_i = -|u_i|^2 of rows g and g + 8:
// per lane the fma chain over its columns (s in order, then r), then the quad's four partials added
// by the butterfly (lanes t ^ 1, then t ^ 2: the same bits in all four lanes).
template <int S>
__device__ __forceinline__ void load_x(const float* __restrict__ x, i64 ldx, i64 m0, i64 N, int K, int g, int t,
                                       float (&xv)[S][4]) {
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const i64 m = m0 + g + 8 * (r & 1);
      const int q = s * 8 + t + 4 * (r >> 1);
      xv[s][r] = m < N && q < K ? x[m * ldx + q] : 0.0f;
    }
}

template <int S>
__device__ __forceinline__ void x_frags(const float (&xv)[S][4], const float (&cv)[S][2], float scale, int K, int t,
                                        unsigned (&ah)[S][4], unsigned (&al)[S][4], float (&a)[2]) {
  float sq[2] = {0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int q = s * 8 + t + 4 * (r >> 1);
      const float u = q < K ? __fmul_rn(__fsub_rn(xv[s][r], cv[s][r >> 1]), scale) : 0.0f;
      sq[r & 1] = __fmaf_rn(u, u, sq[r & 1]);
      mma_detail::split_tf32x3(__float_as_uint(2.0f * u), ah[s][r], al[s][r]);
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = sq[h];
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    a[h] = -v;
  }
}

// The centre's coordinates of lane t's columns (k-step s: 8 s + t and 8 s + t + 4; zero past K).
template <int S>
__device__ __forceinline__ void load_centre(const float* __restrict__ centre, int K, int t, float (&cv)[S][2]) {
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = s * 8 + t + 4 * h;
      cv[s][h] = q < K ? centre[q] : 0.0f;
    }
}

// The exponents of one (m16, n8) tile: b_j + 2u.w by three mma per k-step (lo.hi, hi.lo, hi.hi), the
// accumulator starting at (b of columns 2t, 2t + 1). bf: {hi(k t), hi(k t + 4), lo(k t), lo(k t + 4)}.
template <int S>
__device__ __forceinline__ void exponents(float (&acc)[4], const unsigned (&ah)[S][4], const unsigned (&al)[S][4],
                                          const uint4 (&bf)[S], float b0, float b1) {
  mma_detail::mma_tf32_c(acc, al[0], bf[0].x, bf[0].y, b0, b1);
  mma_detail::mma_tf32(acc, ah[0], bf[0].z, bf[0].w);
  mma_detail::mma_tf32(acc, ah[0], bf[0].x, bf[0].y);
#pragma unroll
  for (int s = 1; s < S; ++s) {
    mma_detail::mma_tf32(acc, al[s], bf[s].x, bf[s].y);
    mma_detail::mma_tf32(acc, ah[s], bf[s].z, bf[s].w);
    mma_detail::mma_tf32(acc, ah[s], bf[s].x, bf[s].y);
  }
}

// The rows kernels' x side: MT m16 tiles of rows from m_warp, as 3xTF32 A fragments of 2u and a_i = -|u_i|^2.
template <int S, int MT>
__device__ __forceinline__ void x_tiles(const float* __restrict__ x, i64 ldx, i64 m_warp, i64 N, int K,
                                        const float* __restrict__ centre, float scale, int g, int t,
                                        unsigned (&ah)[MT][S][4], unsigned (&al)[MT][S][4], float (&a)[2 * MT]) {
  float cv[S][2];
  load_centre<S>(centre, K, t, cv);
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    float xv[S][4], ai[2];
    load_x<S>(x, ldx, m_warp + 16 * i, N, K, g, t, xv);
    x_frags<S>(xv, cv, scale, K, t, ah[i], al[i], ai);
    a[2 * i] = ai[0], a[2 * i + 1] = ai[1];
  }
}

// The rows kernels' centre tiles [tile0, tile1) through two shared stages of Tr::kTileBytes, double-buffered
// (cp.async by the CTA's threads): a stage holds the tile's z fragments (kTileFrag bytes), its b (kBlockN
// floats) and its v part (vbytes from vsrc + tile * vbytes). body(stage, tile) runs once the tile is in for
// every thread, while the next one loads.
template <class Tr, class Body>
__device__ __forceinline__ void stream_centre_tiles(unsigned char* smem, int tile0, int tile1,
                                                    const uint4* __restrict__ zf, const float* __restrict__ zb,
                                                    const unsigned char* __restrict__ vsrc, int vbytes, int tid,
                                                    Body&& body) {
  constexpr int BN = Tr::kBlockN, nf = Tr::kTileFrag / 16, nb = BN * 4 / 16;
  const int nv = vbytes / 16;
  const unsigned base = mma_detail::smem_u32(smem);
  auto load = [&](int stage, int tile) {
    const unsigned char* src_f = reinterpret_cast<const unsigned char*>(zf) + i64(tile) * Tr::kTileFrag;
    const unsigned char* src_b = reinterpret_cast<const unsigned char*>(zb + i64(tile) * BN);
    const unsigned char* src_v = vsrc + i64(tile) * vbytes;
    const unsigned dst = base + stage * Tr::kTileBytes;
    for (int e = tid; e < nf + nb + nv; e += Tr::kThreads) {
      const unsigned char* src = e < nf ? src_f + e * 16 : e < nf + nb ? src_b + (e - nf) * 16 : src_v + (e - nf - nb) * 16;
      mma_detail::cp_async_16(dst + e * 16, src, 16);
    }
  };
  if (tile0 < tile1) load(0, tile0);
  mma_detail::cp_async_commit();
  for (int tile = tile0; tile < tile1; ++tile) {
    const int st_i = (tile - tile0) & 1;
    mma_detail::cp_async_wait<0>();
    __syncthreads();  // the tile is in for everyone; the other stage is free
    if (tile + 1 < tile1) load(st_i ^ 1, tile + 1);
    mma_detail::cp_async_commit();
    body(static_cast<const unsigned char*>(smem + st_i * Tr::kTileBytes), tile);
  }
  mma_detail::cp_async_wait<0>();
}

}  // namespace falkon_detail

// Grid (Mp / 8 * kSteps, 1, 1) x 32 threads per (n8 block, k-step) entry, in CTAs of kThreads:
// z (M, K) at row stride ldz (K contiguous); zf (Mp / 8, kSteps, 32) uint4 (B fragments of w,
// {hi(k t), hi(k t + 4), lo(k t), lo(k t + 4)} for column g of the block), zb (Mp) = b_j (zero for the
// padded centres j >= M, whose w is zero). Mp: M rounded up to a multiple of 256 (both kernels' tiles).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) falkon_prep_kernel(const float* __restrict__ z, i64 ldz, int M,
                                                                        int K, const float* __restrict__ centre,
                                                                        float scale, int Mp, uint4* __restrict__ zf,
                                                                        float* __restrict__ zb) {
  constexpr int S = Traits::kSteps;
  const i64 e = i64(blockIdx.x) * Traits::kThreads + threadIdx.x;
  const i64 entries = i64(Mp / 8) * S * 32;
  if (e < entries) {
    const int lane = int(e & 31), s = int((e >> 5) % S);
    const i64 j8 = (e >> 5) / S;
    const i64 n = j8 * 8 + (lane >> 2);
    unsigned w[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = s * 8 + (lane & 3) + 4 * h;
      const float v = n < M && q < K ? __fmul_rn(__fsub_rn(z[n * ldz + q], centre[q]), scale) : 0.0f;
      mma_detail::split_tf32x3(__float_as_uint(v), w[h][0], w[h][1]);
    }
    zf[e] = uint4{w[0][0], w[1][0], w[0][1], w[1][1]};
  }
  if (e < Mp) {
    float sq = 0.0f;
    if (e < M)
      for (int q = 0; q < K; ++q) {
        const float w = __fmul_rn(__fsub_rn(z[e * ldz + q], centre[q]), scale);
        sq = __fmaf_rn(w, w, sq);
      }
    zb[e] = -sq;
  }
}

// Grid (ceil(N / kBlockM), n_split, 1). x (N, K) at row stride ldx; centre (K), scale as above; zf, zb
// from the prep kernel (Mp centres); v (Mp, kC) float32, zero past M; out[split * ss + i * so + c]
// (float64). The split `split` takes the centre tiles [split * tiles_per_split, ...).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 2) falkon_rows_kernel(
    const float* __restrict__ x, i64 ldx, i64 N, int K, const float* __restrict__ centre, float scale,
    const uint4* __restrict__ zf, const float* __restrict__ zb, const float* __restrict__ v, int Mp,
    double* __restrict__ out, i64 so, i64 ss, int tiles_per_split) {
  using Tr = Traits;
  constexpr int S = Tr::kSteps, MT = Tr::kMt, BN = Tr::kBlockN, KC = Tr::kC, R = 2 * MT;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const i64 m_warp = i64(blockIdx.x) * Tr::kBlockM + warp * 16 * MT;

  unsigned ah[MT][S][4], al[MT][S][4];
  float a[R];
  falkon_detail::x_tiles<S, MT>(x, ldx, m_warp, N, K, centre, scale, g, t, ah, al, a);

  const int tiles_all = Mp / BN;
  const int tile0 = blockIdx.y * tiles_per_split;
  const int tile1 = min(tiles_all, tile0 + tiles_per_split);

  float part[R][KC];
  double total[R][KC];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < KC; ++c) part[r][c] = 0.0f, total[r][c] = 0.0;

  falkon_detail::stream_centre_tiles<Tr>(smem, tile0, tile1, zf, zb, reinterpret_cast<const unsigned char*>(v),
                                         BN * KC * 4, tid, [&](const unsigned char* st, int) {
    const uint4* fr = reinterpret_cast<const uint4*>(st);
    const float* bs = reinterpret_cast<const float*>(st + Tr::kTileFrag);
    const float* vs = bs + BN;
#pragma unroll 1
    for (int j0 = 0; j0 < BN / 8; j0 += 4) {  // a group: 4 n8 blocks, 8 centres of every row
#pragma unroll 2
      for (int j = j0; j < j0 + 4; ++j) {
        uint4 bf[S];
#pragma unroll
        for (int s = 0; s < S; ++s) bf[s] = fr[(j * S + s) * 32 + lane];
        const float2 bp = *reinterpret_cast<const float2*>(bs + j * 8 + 2 * t);
        float v0[KC], v1[KC];
#pragma unroll
        for (int c = 0; c < KC; ++c) v0[c] = vs[(j * 8 + 2 * t) * KC + c], v1[c] = vs[(j * 8 + 2 * t + 1) * KC + c];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          float acc[4];
          falkon_detail::exponents<S>(acc, ah[i], al[i], bf, bp.x, bp.y);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 2 * i + h;
            const float k0 = math::ex2_approx(__fadd_rn(acc[2 * h], a[r]));
            const float k1 = math::ex2_approx(__fadd_rn(acc[2 * h + 1], a[r]));
#pragma unroll
            for (int c = 0; c < KC; ++c) part[r][c] = __fmaf_rn(k1, v1[c], __fmaf_rn(k0, v0[c], part[r][c]));
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < KC; ++c) total[r][c] += double(part[r][c]), part[r][c] = 0.0f;
    }
  });

  // The quad's lanes hold the same rows: their totals added in a fixed butterfly, lane t = 0 stores.
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      double s = total[r][c];
      s += falkon_detail::shfl_xor_double(s, 1);
      s += falkon_detail::shfl_xor_double(s, 2);
      total[r][c] = s;
    }
  if (t == 0) {
    double* o = out + i64(blockIdx.y) * ss;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const i64 m = m_warp + 16 * (r >> 1) + g + 8 * (r & 1);
      if (m < N)
#pragma unroll
        for (int c = 0; c < KC; ++c) o[m * so + c] = total[r][c];
    }
  }
}

// Grid (Mp / kBlockN, n_split, 1). x, centre, scale, zf, zb as above; w (N, kC) float32 at row stride
// ldw (the row weights); out[split * ss + j * so + c] (float64) for the CTA's centres j < M. The split
// takes the rows [split * rows_per_split, ...) (rows_per_split a multiple of kBlockM).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 2) falkon_cols_kernel(
    const float* __restrict__ x, i64 ldx, i64 N, int K, const float* __restrict__ centre, float scale,
    const uint4* __restrict__ zf, const float* __restrict__ zb, const float* __restrict__ w, i64 ldw, int M,
    double* __restrict__ out, i64 so, i64 ss, i64 rows_per_split) {
  using Tr = Traits;
  constexpr int S = Tr::kSteps, NB = Tr::kNbw, KC = Tr::kC, BM = Tr::kBlockM, MTX = Tr::kMtX;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  // This warp's centres: n8 blocks nb0 .. nb0 + NB - 1, their B fragments and b in registers.
  const i64 nb0 = (i64(blockIdx.x) * Tr::kBlockN + warp * 8 * NB) / 8;
  uint4 bf[NB][S];
  float b0[NB], b1[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
#pragma unroll
    for (int s = 0; s < S; ++s) bf[j][s] = zf[((nb0 + j) * S + s) * 32 + lane];
    b0[j] = zb[(nb0 + j) * 8 + 2 * t];
    b1[j] = zb[(nb0 + j) * 8 + 2 * t + 1];
  }

  const i64 row0 = i64(blockIdx.y) * rows_per_split;
  const i64 row1 = min(N, row0 + rows_per_split);
  const int tiles = row1 > row0 ? int((row1 - row0 + BM - 1) / BM) : 0;

  // The stages' fragments are made by warps 0 .. MTX - 1 (m16 tile `warp` of the x tile), from raw
  // values read one tile ahead into registers.
  const bool maker = warp < MTX;
  float cv[S][2];
  falkon_detail::load_centre<S>(centre, K, t, cv);
  float xv[S][4], wv[2][KC];
  auto fetch = [&](int tile) {  // raw x and the row weights of this lane's rows of the maker's m16 tile
    const i64 m0 = row0 + i64(tile) * BM + 16 * warp;
    falkon_detail::load_x<S>(x, ldx, m0, row1, K, g, t, xv);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 m = m0 + g + 8 * h;
#pragma unroll
      for (int c = 0; c < KC; ++c) wv[h][c] = m < row1 && t == 0 ? w[m * ldw + c] : 0.0f;
    }
  };
  auto make = [&](int stage) {
    unsigned char* st = smem + stage * Tr::kXTileBytes;
    uint4* fr = reinterpret_cast<uint4*>(st);
    float* as = reinterpret_cast<float*>(st + Tr::kXFrag);
    float* ws = as + BM;
    unsigned ah[S][4], al[S][4];
    float ai[2];
    falkon_detail::x_frags<S>(xv, cv, scale, K, t, ah, al, ai);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      fr[((warp * S + s) * 32 + lane) * 2] = uint4{ah[s][0], ah[s][1], ah[s][2], ah[s][3]};
      fr[((warp * S + s) * 32 + lane) * 2 + 1] = uint4{al[s][0], al[s][1], al[s][2], al[s][3]};
    }
    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = 16 * warp + g + 8 * h;
        as[rr] = ai[h];
#pragma unroll
        for (int c = 0; c < KC; ++c) ws[rr * KC + c] = wv[h][c];
      }
    }
  };

  float part[NB][2][KC];
  double total[NB][2][KC];
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int c = 0; c < KC; ++c) part[j][e][c] = 0.0f, total[j][e][c] = 0.0;

  if (maker && tiles > 0) {
    fetch(0);
    make(0);
    if (tiles > 1) fetch(1);
  }
  __syncthreads();
  for (int q = 0; q < tiles; ++q) {
    const int st_i = q & 1;
    if (maker && q + 1 < tiles) {  // the other stage was last read in iteration q - 1 (barrier since)
      make(st_i ^ 1);
      if (q + 2 < tiles) fetch(q + 2);
    }
    const unsigned char* st = smem + st_i * Tr::kXTileBytes;
    const uint4* fr = reinterpret_cast<const uint4*>(st);
    const float* as = reinterpret_cast<const float*>(st + Tr::kXFrag);
    const float* ws = as + BM;
#pragma unroll 2
    for (int i = 0; i < MTX; ++i) {
      unsigned ah[S][4], al[S][4];
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const uint4 hi = fr[((i * S + s) * 32 + lane) * 2], lo = fr[((i * S + s) * 32 + lane) * 2 + 1];
        ah[s][0] = hi.x, ah[s][1] = hi.y, ah[s][2] = hi.z, ah[s][3] = hi.w;
        al[s][0] = lo.x, al[s][1] = lo.y, al[s][2] = lo.z, al[s][3] = lo.w;
      }
      const float a0 = as[16 * i + g], a1 = as[16 * i + g + 8];
      float w0[KC], w1[KC];
#pragma unroll
      for (int c = 0; c < KC; ++c) w0[c] = ws[(16 * i + g) * KC + c], w1[c] = ws[(16 * i + g + 8) * KC + c];
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        float acc[4];
        falkon_detail::exponents<S>(acc, ah, al, bf[j], b0[j], b1[j]);
        const float k00 = math::ex2_approx(__fadd_rn(acc[0], a0)), k01 = math::ex2_approx(__fadd_rn(acc[1], a0));
        const float k10 = math::ex2_approx(__fadd_rn(acc[2], a1)), k11 = math::ex2_approx(__fadd_rn(acc[3], a1));
#pragma unroll
        for (int c = 0; c < KC; ++c) {
          part[j][0][c] = __fmaf_rn(k10, w1[c], __fmaf_rn(k00, w0[c], part[j][0][c]));
          part[j][1][c] = __fmaf_rn(k11, w1[c], __fmaf_rn(k01, w0[c], part[j][1][c]));
        }
      }
    }
    // 4 m16 tiles: 8 rows of every centre of this lane in the partials
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int c = 0; c < KC; ++c) total[j][e][c] += double(part[j][e][c]), part[j][e][c] = 0.0f;
    __syncthreads();  // stage st_i read by all; the makers' next stage written
  }

  // The 8 lanes g = 0..7 of one t hold the same centres: a fixed butterfly, lanes g = 0 store.
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        double s = total[j][e][c];
        s += falkon_detail::shfl_xor_double(s, 4);
        s += falkon_detail::shfl_xor_double(s, 8);
        s += falkon_detail::shfl_xor_double(s, 16);
        total[j][e][c] = s;
      }
  if (g == 0) {
    double* o = out + i64(blockIdx.y) * ss;
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const i64 n = (nb0 + j) * 8 + 2 * t + e;
        if (n < M)
#pragma unroll
          for (int c = 0; c < KC; ++c) o[n * so + c] = total[j][e][c];
      }
  }
}

// ------------------------------------------------------------------ several columns on tensor cores
// falkon_rows_pv_kernel: K(x, z) v for up to kC = 8 kNq columns, with the products k v on tensor cores
// too (FlashAttention's P V): the exponents' accumulators of two (m16, n8) tiles (centre blocks j, j + 1)
// are the A fragment of an mma.m16n8k16 (f16) over those 16 centres, whose B operand is v's rows of them.
// Split products in f16, each term exact in the float32 accumulators:
//   k = kh + kl 2^-12,  kh = f16(k), kl = f16((k - kh) 2^12)     (k in [0, 1]: both in f16's normal range
//                                                                 down to k ~ 2^-26; below, 2^-36 absolute)
//   v s_c = vh + vl 2^-12 (falkon_vprep_kernel), s_c = 2^(14 - e_c), max|v[:, c]| < 2^e_c: |v s_c| < 2^14
//   k v s_c = kh vh + 2^-12 (kl vh + kh vl)   (kl vl, 2^-22 relative, dropped)
// in two accumulators per column tile (main: kh vh; corr: kl vh + kh vl, two independent mma chains),
// added into float64 totals: main after every centre tile (8 k16 steps, 128 centres), corr (2^-12 of the
// sum) every kCorrTiles = 4 tiles (512 centres) and after the last; the store divides by s_c (exact).
// The flushes' F2F.F64.F32 share the XU pipe with ex2: flushing both every 2 k16 steps (one F2F per
// pair, as many as ex2) held the kernel at 62 % of XU's peak; 2.28 -> 1.74 ms at N = 5 x 10^4, C = 11
// on an H100 (bench/notes/gpytorch.md, "Session 18"; flush intervals measured there). Float32 accumulation error of main
// over a flush: 8 mma.m16n8k16, ~8 2^-23 of its sum of |k v| (tensor cores truncate); of corr: 2^-12 of
// 32 mma's. Three mma.m16n8k16 per 16 centres and column tile, against 6 mma.m16n8k8 in
// 3xTF32 (measured 1.16x kernel_matvec at C = 11 with those; bench/notes/gpytorch.md, "The CG products on
// tensor cores"). Each lane owns its outputs (rows g, g + 8, columns 8 q + 2t, 8 q + 2t + 1): no butterfly.
template <int kK_, int kNq_>
struct FalkonRowsPvTraits {
  static_assert(kK_ == 8 || kK_ == 16 || kK_ == 32, "FalkonRowsPvTraits: kK is 8, 16 or 32");
  static_assert(kNq_ == 1 || kNq_ == 2, "FalkonRowsPvTraits: kNq is 1 or 2 (8 or 16 columns)");
  static constexpr int kK = kK_;
  static constexpr int kSteps = kK_ / 8;
  static constexpr int kNq = kNq_;
  static constexpr int kC = 8 * kNq_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMt = kK_ == 8 ? 2 : 1;  // m16 tiles per warp (registers: fragments, accumulators, totals)
  static constexpr int kBlockM = 8 * 16 * kMt;
  static constexpr int kBlockN = 128;
  static constexpr int kCorrTiles = 4;  // centre tiles per float64 flush of corr (main: every tile)
  static constexpr int kTileFrag = kBlockN * kK_ * 8;           // z's B fragments
  static constexpr int kVFrag = kBlockN / 16 * kNq_ * 32 * 16;  // v's B fragments
  static constexpr int kTileBytes = kTileFrag + kBlockN * 4 + kVFrag;
  static constexpr int kSmemBytes = 2 * kTileBytes;
};

namespace falkon_detail {

// s_c = 2^(14 - e) for max|v[:, c]| = m 2^e (m in [0.5, 1)); 1 where the maximum is 0, inf or NaN (an exact
// power of two, its exponent clamped to float's normal range).
__device__ __forceinline__ float column_scale(float amax) {
  if (!(amax > 0.0f && amax <= 3.4028234663852886e38f)) return 1.0f;
  int e = int((__float_as_uint(amax) >> 23) & 0xffu) - 126;  // amax < 2^e (normal amax)
  if (e < -125) e = -125;                                    // subnormal maxima: 2^-125 bounds them
  int p = 14 - e;
  p = p > 127 ? 127 : (p < -126 ? -126 : p);
  return __uint_as_float(unsigned(p + 127) << 23);
}

// {f16(a), f16(b)} and {f16((a - f16(a)) 2^12), f16((b - f16(b)) 2^12)} (low half a).
__device__ __forceinline__ void split_f16(float a, float b, unsigned& hi, unsigned& lo) {
  using C16 = mma_detail::Convert16<float16>;
  hi = C16::two(a, b);
  lo = C16::two(__fmul_rn(__fsub_rn(a, C16::lo(hi)), 4096.0f), __fmul_rn(__fsub_rn(b, C16::hi(hi)), 4096.0f));
}

}  // namespace falkon_detail

// Grid (ceil(Mp / 16 * kNq * 32 / 256), 1, 1): v (N rows, C <= kC columns) at strides (svn, svc), amax (C)
// f32 = max |v[:, c]| -> vf (Mp / 16, kNq, 32) uint4, entry (jj, q, lane (g, t)) = {vh0, vh1, vl0, vl1} with
// vh0 = {hi(v s)[16 jj + 2t], hi(v s)[16 jj + 2t + 1]} of column 8 q + g, vh1 the same at centres + 8 (the
// B fragment of mma.m16n8k16), vl the low parts (falkon_detail::split_f16), zero past N rows and C columns.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) falkon_vprep_kernel(const float* __restrict__ v, i64 svn,
                                                                         i64 svc, i64 N, int C,
                                                                         const float* __restrict__ amax, int Mp,
                                                                         uint4* __restrict__ vf) {
  constexpr int NQ = Traits::kNq;
  const i64 e = i64(blockIdx.x) * Traits::kThreads + threadIdx.x;
  if (e >= i64(Mp / 16) * NQ * 32) return;
  const int lane = int(e & 31), q = int((e >> 5) % NQ);
  const i64 jj = (e >> 5) / NQ;
  const int c = 8 * q + (lane >> 2);
  const float sc = c < C ? falkon_detail::column_scale(amax[c]) : 1.0f;
  float val[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) {  // centres 16 jj + 2t + (h & 1) + 8 (h >> 1)
    const i64 n = jj * 16 + 2 * (lane & 3) + (h & 1) + 8 * (h >> 1);
    val[h] = n < N && c < C ? __fmul_rn(v[n * svn + c * svc], sc) : 0.0f;
  }
  unsigned h0, l0, h1, l1;
  falkon_detail::split_f16(val[0], val[1], h0, l0);
  falkon_detail::split_f16(val[2], val[3], h1, l1);
  vf[e] = uint4{h0, h1, l0, l1};
}

// Grid (ceil(N / kBlockM), n_split, 1), kSmemBytes of dynamic shared memory. x, centre, scale, zf, zb as
// falkon_rows_kernel's; vf from falkon_vprep_kernel (Mp / 16 k16 steps) with the same amax;
// out[split * ss + i * so + c] (float64) for rows i < N and columns c < C. The split `split` takes the
// centre tiles [split * tiles_per_split, ...).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 2) falkon_rows_pv_kernel(
    const float* __restrict__ x, i64 ldx, i64 N, int K, const float* __restrict__ centre, float scale,
    const uint4* __restrict__ zf, const float* __restrict__ zb, const uint4* __restrict__ vf,
    const float* __restrict__ amax, int Mp, int C, double* __restrict__ out, i64 so, i64 ss, int tiles_per_split) {
  using Tr = Traits;
  constexpr int S = Tr::kSteps, MT = Tr::kMt, BN = Tr::kBlockN, NQ = Tr::kNq;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const i64 m_warp = i64(blockIdx.x) * Tr::kBlockM + warp * 16 * MT;

  unsigned ah[MT][S][4], al[MT][S][4];
  float a[2 * MT];
  falkon_detail::x_tiles<S, MT>(x, ldx, m_warp, N, K, centre, scale, g, t, ah, al, a);

  const int tiles_all = Mp / BN;
  const int tile0 = blockIdx.y * tiles_per_split;
  const int tile1 = min(tiles_all, tile0 + tiles_per_split);
  float main_acc[MT][NQ][4], corr[MT][NQ][4];
  double total[MT][NQ][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int q = 0; q < NQ; ++q)
#pragma unroll
      for (int r = 0; r < 4; ++r) main_acc[i][q][r] = 0.0f, corr[i][q][r] = 0.0f, total[i][q][r] = 0.0;

  falkon_detail::stream_centre_tiles<Tr>(smem, tile0, tile1, zf, zb, reinterpret_cast<const unsigned char*>(vf),
                                         Tr::kVFrag, tid, [&](const unsigned char* st, int tile) {
    const uint4* fr = reinterpret_cast<const uint4*>(st);
    const float* bs = reinterpret_cast<const float*>(st + Tr::kTileFrag);
    const uint4* vs = reinterpret_cast<const uint4*>(st + Tr::kTileFrag + BN * 4);
#pragma unroll 1
    for (int s16 = 0; s16 < BN / 16; ++s16) {  // a k16 step: centre blocks j = 2 s16, 2 s16 + 1
      uint4 bf[2][S], vq[NQ];
      float2 bp[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int s = 0; s < S; ++s) bf[h][s] = fr[((2 * s16 + h) * S + s) * 32 + lane];
        bp[h] = *reinterpret_cast<const float2*>(bs + (2 * s16 + h) * 8 + 2 * t);
      }
#pragma unroll
      for (int q = 0; q < NQ; ++q) vq[q] = vs[(s16 * NQ + q) * 32 + lane];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        unsigned kh[4], kl[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float d[4];
          falkon_detail::exponents<S>(d, ah[i], al[i], bf[h], bp[h].x, bp[h].y);
          // rows g (k of centres 2t, 2t + 1: a[2h]) and g + 8 (a[2h + 1]) of centre block 2 s16 + h
          falkon_detail::split_f16(math::ex2_approx(__fadd_rn(d[0], a[2 * i])),
                                   math::ex2_approx(__fadd_rn(d[1], a[2 * i])), kh[2 * h], kl[2 * h]);
          falkon_detail::split_f16(math::ex2_approx(__fadd_rn(d[2], a[2 * i + 1])),
                                   math::ex2_approx(__fadd_rn(d[3], a[2 * i + 1])), kh[2 * h + 1], kl[2 * h + 1]);
        }
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
          mma_detail::Mma16<float16>::run(corr[i][q], kl, vq[q].x, vq[q].y);
          mma_detail::Mma16<float16>::run(main_acc[i][q], kh, vq[q].x, vq[q].y);
          mma_detail::Mma16<float16>::run(corr[i][q], kh, vq[q].z, vq[q].w);
        }
      }
    }
    const bool corr_too = (tile - tile0) % Tr::kCorrTiles == Tr::kCorrTiles - 1 || tile + 1 == tile1;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int q = 0; q < NQ; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          total[i][q][r] += double(main_acc[i][q][r]), main_acc[i][q][r] = 0.0f;
          if (corr_too) total[i][q][r] += double(corr[i][q][r]) * (1.0 / 4096.0), corr[i][q][r] = 0.0f;
        }
  });

  double* o = out + i64(blockIdx.y) * ss;
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = 8 * q + 2 * t + e;
      if (c >= C) continue;
      const double inv = 1.0 / double(falkon_detail::column_scale(amax[c]));  // exact
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const i64 m = m_warp + 16 * i + g + 8 * h;
          if (m < N) o[m * so + c] = total[i][q][2 * h + e] * inv;
        }
    }
}

}  // namespace kermac_like
