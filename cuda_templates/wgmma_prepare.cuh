// b preparation for the Hopper (sm_90a) distance kernel (distance_wgmma.cuh), in a
// header of its own so that it compiles in a fraction of a second (it needs none of the
// tensor-core machinery).
#pragma once

namespace kermac_like {

// 64-byte swizzle of the shared-memory tiles: byte offset of 16-byte chunk c
// (0..3) of row r inside a tile whose rows are 64 bytes long.
__host__ __device__ __forceinline__ unsigned swizzled(unsigned r, unsigned c) {
  return r * 64u + ((c ^ ((r >> 1) & 3u)) << 4);
}

// ------------------------------------------------------------ b preparation
// Once per launch, on the stream before distance_wgmma_kernel: b rearranged into the
// kernel's shared-memory image, one contiguous block per (entry of b, 256-row n tile,
// 16-column k tile) that a single bulk copy moves: the 256 x 16 floats of b in the
// 64-byte swizzle of the tiles (`swizzled`), then for 3xTF32 the same image of
// B small = b - trunc(b) (the tensor cores read fp32 as TF32 by truncation, so b
// itself is the big half and small is exact); rows past N and columns past K are 0.
// Also the squared row norms of b (Inner::Diff). Both once per row of b rather than
// once per output tile (bench/NOTES.md, v10-v11).
//
// Entries are those of b itself, not of the broadcast output: entry e = (i0, i1, i2)
// over extents (e0, e1, e2) (1 where b broadcasts), e = (i0 e1 + i1) e2 + i2; b's
// element (e, n, k) is b[i0 s0 + i1 s1 + i2 s2 + n ldb + k]. Block (e, tn, kt) starts
// at float ((e tiles_n + tn) k_tiles + kt) kBlockFloats; norms[e n_pad + n] for
// n < n_pad = 256 tiles_n (0 past N). One warp per row; b rows 16-byte aligned.
template <bool kSmall_, bool kNorms_>
struct WgmmaPrepareTraits {
  static constexpr bool kSmall = kSmall_, kNorms = kNorms_;
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = kThreads / 32;  // rows per block
  static constexpr int kBlockN = 1;
  static constexpr int kSmemBytes = 0;
  static constexpr int kTileN = 256, kTileK = 16;  // DistanceWgmmaTraits' kBlockN, kBlockK
  static constexpr int kBlockFloats = kTileN * kTileK * (kSmall ? 2 : 1);
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    wgmma_prepare_b_kernel(const float* __restrict__ b, int N, int K, long long ldb, int e1, int e2, long long s0,
                           long long s1, long long s2, long long rows, float* __restrict__ blocks,
                           float* __restrict__ norms, int n_pad) {
  const long long r = (long long)blockIdx.x * Traits::kBlockM + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long e = r / n_pad;
  const int n = (int)(r - e * n_pad);
  const int tiles_n = n_pad / Traits::kTileN, row = n % Traits::kTileN;
  const int k_tiles = (K + Traits::kTileK - 1) / Traits::kTileK;
  const long long q = e / e2;
  const float* src = b + (q / e1) * s0 + (q % e1) * s1 + (e % e2) * s2 + (long long)n * ldb;
  float* dst = blocks + (e * tiles_n + n / Traits::kTileN) * k_tiles * (long long)Traits::kBlockFloats;
  float sum = 0.f;
  for (int c = lane; c < 4 * k_tiles; c += 32) {  // 16-byte chunk c: k = 4c .. 4c + 3
    const int k = 4 * c;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (n < N && k < K) {
      if (k + 4 <= K) {
        v = *reinterpret_cast<const float4*>(src + k);
      } else {
        v.x = src[k];
        if (k + 1 < K) v.y = src[k + 1];
        if (k + 2 < K) v.z = src[k + 2];
      }
    }
    if constexpr (Traits::kNorms) sum = fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, fmaf(v.x, v.x, sum))));
    float* block = dst + (c >> 2) * (long long)Traits::kBlockFloats + swizzled(row, c & 3) / 4;
    if constexpr (Traits::kSmall) {
      // 3xTF32: big = b clamped to +-2^64, small = b - trunc(big), so that b = +-inf
      // gives big = +-2^64, small = +-inf rather than inf and inf - inf = NaN (the
      // a side does the same: split_tf32x3 in distance_mma.cuh says why). NaN stays
      // NaN (in small). The norms above use b itself.
      auto big = [](float x) { return fminf(fmaxf(x, -18446744073709551616.f), 18446744073709551616.f); };
      auto lo = [](float x, float c) { return x - __uint_as_float(__float_as_uint(c) & 0xffffe000u); };
      const float4 h = make_float4(big(v.x), big(v.y), big(v.z), big(v.w));
      *reinterpret_cast<float4*>(block) = h;
      *reinterpret_cast<float4*>(block + Traits::kTileN * Traits::kTileK) =
          make_float4(lo(v.x, h.x), lo(v.y, h.y), lo(v.z, h.z), lo(v.w, h.w));
    } else {
      *reinterpret_cast<float4*>(block) = v;
    }
  }
  if constexpr (Traits::kNorms) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) norms[r] = sum;
  }
}

}  // namespace kermac_like
