// Hopper (sm_90a) tensor-core distance kernel: the distance_mma_kernel
// semantics on wgmma, for p=2 distances, the Laplace-l2 and Gaussian kernels
// and the DOT descriptor.
//
//   ||x - y||^2 = ||x||^2 + ||y||^2 - 2 x.y
//
// Same flat ABI and the same limits as distance_mma_kernel
// (.helpers/DISTANCE_ABI.md, cuda_templates/distance_mma.cuh): Inner::Diff
// means the inner power Square with outer Noop or Sqrt; Inner::Dot takes outer
// Noop and Epilogue::None; a and b RowMajor (K contiguous), 16-byte aligned
// base and batch offsets, lda/ldb multiples of 4 floats; K free (tail
// zero-filled); out RowMajor or ColMajor, element alignment only. Exact zero
// self-distance diagonal when a == b and lda == ldb. Float32 data only:
// Precision::Tf32x3 (fp32-grade, three TF32 products) or Precision::Tf32.
// Compile for "sm_90a" (wgmma does not exist on plain sm_90 or on sm_80).
//
// Design (bench/NOTES_wgmma.md has the numbers):
//   * Block 128 x 256, 256 threads = 2 warpgroups; warpgroup w computes rows
//     64 w .. 64 w + 63 against all 256 columns with
//     wgmma.mma_async.m64n256k8.f32.tf32.tf32, both operands read from shared
//     memory through matrix descriptors; 128 fp32 accumulators per thread.
//   * k-tile = 16 floats (64 bytes) of every row, K-major with the 64-byte
//     swizzle of the wgmma descriptor (16-byte chunk c of row r stored at chunk
//     c ^ ((r >> 1) & 3); every tile starts on a 1024-byte boundary).
//   * cp.async (16 bytes, zero-filling rows past M/N and the K tail) fills a
//     ring of kStages raw stages, 4 k-tiles ahead of the tensor cores.
//   * 3xTF32 needs big = tf32(x) and small = tf32(x - big) of BOTH operands in
//     shared memory (wgmma's B always comes from shared memory): one pass of
//     all threads over each landed stage rounds it in place (big) and writes
//     the residual into a ring of 3 "small" tiles, and in the same pass sums
//     the squared row norms in fp32 from the raw values. Then per k-step
//     small*big, big*small, big*big accumulate into the same registers.
//   * Pipeline per k-tile kt (one __syncthreads):
//       wait raw(kt+1); barrier; issue wgmma(kt) (6 instructions);
//       split(kt+1) + norms + fence.proxy.async; copy raw(kt+4); wgmma.wait(kt-1).
//     The split of the next tile overlaps the tensor cores' work on this one.
//   * Epilogue as in distance_mma_kernel (clamp, sqrt.approx, epsilon,
//     ex2.approx, regularisation, exact self-distance diagonal).
#pragma once

#include "distance_mma.cuh"

namespace kermac_like {

namespace wgmma_detail {

using mma_detail::SameType;
using mma_detail::tf32_rna;

// 64-byte swizzle of the shared-memory tiles: byte offset of 16-byte chunk c
// (0..3) of row r inside a tile whose rows are 64 bytes long.
__host__ __device__ __forceinline__ unsigned swizzled(unsigned r, unsigned c) {
  return r * 64u + ((c ^ ((r >> 1) & 3u)) << 4);
}

#ifndef KERMAC_LIKE_MMA_HOST_EMULATION

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format" of
// wgmma): start address >> 4 in bits 0-13, leading-dimension byte offset >> 4
// in bits 16-29 (unused for swizzled K-major tiles; 1 by convention), stride
// byte offset >> 4 in bits 32-45 (8 rows x 64 bytes = 512 between 8-row
// groups), base offset 0 (tiles 512-byte aligned; the k-step offset of 32
// bytes inside the swizzle row is added to the start address), swizzle mode
// in bits 62-63 (2 = 64-byte swizzle).
__device__ __forceinline__ unsigned long long make_desc(unsigned smem_addr) {
  return (unsigned long long)((smem_addr & 0x3ffffu) >> 4) | (1ull << 16) | ((512ull >> 4) << 32) |
         (2ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Generic-proxy writes to shared memory (st.shared) become visible to the async
// proxy (wgmma operand reads) after this fence in the writing thread and a barrier.
// (KERMAC_LIKE_WGMMA_SKIP_PROXY_FENCE is a diagnostic for bench/try_wgmma.py only:
// it measures the fence's cost and is not a correct program.)
__device__ __forceinline__ void fence_proxy_async() {
#ifndef KERMAC_LIKE_WGMMA_SKIP_PROXY_FENCE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// D (64 x 256, f32) += A (64 x 8, tf32, K-major, descriptor) * B (256 x 8,
// tf32, K-major, descriptor)^T. Accumulator fragment (PTX ISA "Register
// Fragments" of wgmma .m64nNk8, D): warp w of the warpgroup holds rows
// 16 w .. 16 w + 15; with g = lane / 4, t = lane % 4, register 4 j + 2 h + e
// is row 16 w + g + 8 h, column 8 j + 2 t + e (j = 0..31, h, e = 0..1).
__device__ __forceinline__ void wgmma_m64n256k8_tf32(float (&d)[128], unsigned long long desc_a,
                                                   unsigned long long desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}


#endif  // KERMAC_LIKE_MMA_HOST_EMULATION

}  // namespace wgmma_detail

// ------------------------------------------------------------------- traits

template <Inner kInner_, Power kOuter_, Epilogue kEpilogue_, Layout kLayoutA_, Layout kLayoutB_,
          Layout kLayoutO_, Precision kPrecision_, class T_>
struct DistanceWgmmaTraits {
  using T = T_;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kOuter = kOuter_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr Layout kLayoutA = kLayoutA_;
  static constexpr Layout kLayoutB = kLayoutB_;
  static constexpr Layout kLayoutO = kLayoutO_;
  static constexpr Precision kPrecision = kPrecision_;

  static_assert(kInner == Inner::Diff || kInner == Inner::Dot, "DistanceWgmmaTraits: unknown Inner");
  static_assert(kInner != Inner::Diff || kOuter == Power::Noop || kOuter == Power::Sqrt,
                "DistanceWgmmaTraits: Inner::Diff (inner power Square) takes outer power Noop "
                "(squared distance) or Sqrt (distance) only");
  static_assert(kInner != Inner::Dot || (kOuter == Power::Noop && kEpilogue == Epilogue::None),
                "DistanceWgmmaTraits: Inner::Dot takes outer power Noop and Epilogue::None only");
  static_assert(kLayoutA == Layout::RowMajor && kLayoutB == Layout::RowMajor,
                "DistanceWgmmaTraits: a and b must be RowMajor (K contiguous); make a contiguous copy "
                "or use the SIMT kernel");
  static_assert(wgmma_detail::SameType<T, float>::value &&
                    (kPrecision == Precision::Tf32x3 || kPrecision == Precision::Tf32),
                "DistanceWgmmaTraits: only T = float with Precision Tf32x3 or Tf32 (16-bit data: use "
                "DistanceMmaTraits)");

  static constexpr bool kSplit = kPrecision == Precision::Tf32x3;  // big + small tiles
  static constexpr int kThreads = 256;  // 2 warpgroups
  static constexpr int kBlockM = 128;   // 64 rows per warpgroup
  static constexpr int kBlockN = 256;   // one m64n256k8 per k-step and product
  static constexpr int kRowBytes = 64;  // one k-tile of a row: 16 floats, two k8 steps
  static constexpr int kBlockK = kRowBytes / 4;
  static constexpr int kTileABytes = kBlockM * kRowBytes;         // 8 KiB
  static constexpr int kStageBytes = (kBlockM + kBlockN) * kRowBytes;  // 24 KiB
  static constexpr int kStages = 6;     // raw/big ring: wgmma(kt-1), wgmma(kt), split(kt+1), 3 in flight
  static constexpr int kSmallTiles = kSplit ? 3 : 0;  // small ring: wgmma(kt-1), wgmma(kt), split(kt+1)
  static constexpr int kNormBytes = (kBlockM + kBlockN) * 4;
  static constexpr int kAlignSlack = 1024;  // the kernel aligns its base to 1024 bytes
  static constexpr int kSmemBytes =
      (kStages + kSmallTiles) * kStageBytes + kNormBytes + kAlignSlack;  // 223744 for Tf32x3
  static constexpr int kGroupM = 16;  // M tiles that sweep N together (L2 reuse)
  static_assert(kSmemBytes <= 227 * 1024, "DistanceWgmmaTraits: shared memory above 227 KiB");
};

// ------------------------------------------------------------------- kernel
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    distance_wgmma_kernel(const float* __restrict__ a, const float* __restrict__ b,
                          float* __restrict__ out, int M, int N, int K, long long lda, long long ldb,
                          long long ldo, int batch, int batch_n1, int batch_n2, long long a_bs0,
                          long long a_bs1, long long a_bs2, long long b_bs0, long long b_bs1,
                          long long b_bs2, long long o_bs0, long long o_bs1, long long o_bs2,
                          const float* inner_p_ptr, long long inner_p_bs0, long long inner_p_bs1,
                          long long inner_p_bs2, float inner_p, const float* outer_p_ptr,
                          long long outer_p_bs0, long long outer_p_bs1, long long outer_p_bs2,
                          float outer_p, const float* bw_ptr, long long bw_bs0, long long bw_bs1,
                          long long bw_bs2, float bandwidth, const float* reg_ptr, long long reg_bs0,
                          long long reg_bs1, long long reg_bs2, float regularization,
                          long long reg_diag, float epsilon) {
  using namespace mma_detail;
  using namespace wgmma_detail;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kStageBytes = Traits::kStageBytes;
  constexpr int kRowBytes = Traits::kRowBytes, kBlockK = Traits::kBlockK;
  constexpr int kTileABytes = Traits::kTileABytes;
  constexpr bool kSplit = Traits::kSplit;
  constexpr int kSmall = kSplit ? Traits::kSmallTiles : 1;
  constexpr bool kDiff = Traits::kInner == Inner::Diff;
  constexpr int kChunksA = kBlockM * kRowBytes / 16 / Traits::kThreads;  // 2
  constexpr int kChunksB = kBlockN * kRowBytes / 16 / Traits::kThreads;  // 4
  constexpr int kRowsPerPass = Traits::kThreads / 4;                     // 64

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1024-byte aligned base (the swizzle pattern follows absolute address bits).
  const unsigned raw_base = smem_u32(smem_raw);
  const unsigned base = (raw_base + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw_base);
  // [kStages raw/big stages][kSmallTiles small tiles][norm_a][norm_b]
  float* norm_a = reinterpret_cast<float*>(smem + (kStages + Traits::kSmallTiles) * kStageBytes);
  float* norm_b = norm_a + kBlockM;
  const unsigned small_base = base + kStages * kStageBytes;

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2;  // warpgroup: rows 64 wg .. 64 wg + 63 of the block

  // Block tile, grouped so that kGroupM consecutive M tiles sweep N together.
  const int tiles_m = gridDim.x, tiles_n = gridDim.y;
  const int linear = blockIdx.y * tiles_m + blockIdx.x;
  const int group_size = Traits::kGroupM * tiles_n;
  const int first_m = (linear / group_size) * Traits::kGroupM;
  const int rows_in_group = min(tiles_m - first_m, Traits::kGroupM);
  const int in_group = linear % group_size;
  const int m0 = (first_m + in_group % rows_in_group) * kBlockM;
  const int n0 = (in_group / rows_in_group) * kBlockN;

  // Copy assignment: thread tid copies logical chunk tid % 4 of rows
  // tid / 4 + 64 u (rows 64 apart keep the same swizzle).
  const int copy_row = tid >> 2, copy_chunk = tid & 3;
  const unsigned copy_dst = swizzled(copy_row, copy_chunk);

  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride a_stride{a_bs0, a_bs1, a_bs2}, b_stride{b_bs0, b_bs1, b_bs2},
      o_stride{o_bs0, o_bs1, o_bs2};
  const HyperParam bw_param{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth};
  const HyperParam reg_param{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};
  const bool reg_on = reg_ptr != nullptr || regularization != 0.f;
  (void)inner_p_ptr, (void)inner_p_bs0, (void)inner_p_bs1, (void)inner_p_bs2, (void)inner_p;
  (void)outer_p_ptr, (void)outer_p_bs0, (void)outer_p_bs1, (void)outer_p_bs2, (void)outer_p;

  const int num_k_tiles = ceil_div(K, kBlockK);

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    int l0, l1, l2;
    shape.split(l, l0, l1, l2);
    const float* a_l = a + a_stride.offset(l0, l1, l2);
    const float* b_l = b + b_stride.offset(l0, l1, l2);
    float* out_l = out + o_stride.offset(l0, l1, l2);

    const float* src_a[kChunksA];
    const float* src_b[kChunksB];
#pragma unroll
    for (int u = 0; u < kChunksA; ++u) {
      const int row = m0 + copy_row + u * kRowsPerPass;
      src_a[u] = row < M ? a_l + (long long)row * lda + copy_chunk * 4 : nullptr;
    }
#pragma unroll
    for (int u = 0; u < kChunksB; ++u) {
      const int row = n0 + copy_row + u * kRowsPerPass;
      src_b[u] = row < N ? b_l + (long long)row * ldb + copy_chunk * 4 : nullptr;
    }

    auto load_tile = [&](int kt) {
      const int k_left = K - kt * kBlockK - copy_chunk * 4;  // floats left in the row
      const int bytes = k_left <= 0 ? 0 : (k_left >= 4 ? 16 : k_left * 4);
      const unsigned dst = base + (kt % kStages) * kStageBytes + copy_dst;
#pragma unroll
      for (int u = 0; u < kChunksA; ++u) {
        const bool ok = src_a[u] != nullptr && bytes > 0;
        cp_async_16(dst + u * kRowsPerPass * kRowBytes, ok ? src_a[u] + kt * kBlockK : a_l,
                    ok ? bytes : 0);
      }
#pragma unroll
      for (int u = 0; u < kChunksB; ++u) {
        const bool ok = src_b[u] != nullptr && bytes > 0;
        cp_async_16(dst + kTileABytes + u * kRowsPerPass * kRowBytes,
                    ok ? src_b[u] + kt * kBlockK : b_l, ok ? bytes : 0);
      }
    };

    // Partial squared norms of rows copy_row + 64 u (4 threads per row).
    float sq_a[kChunksA], sq_b[kChunksB];
#pragma unroll
    for (int u = 0; u < kChunksA; ++u) sq_a[u] = 0.f;
#pragma unroll
    for (int u = 0; u < kChunksB; ++u) sq_b[u] = 0.f;

    // Split pass over landed k-tile kt: every thread takes the 16-byte chunks
    // tid + 256 u of the stage (any chunk order: the split is elementwise and
    // the norms are sums; chunk tid + 256 u belongs to row tid / 4 + 64 u).
    auto split_tile = [&](int kt) {
      unsigned char* stage = smem + (kt % kStages) * kStageBytes;
      unsigned char* small = smem + kStages * kStageBytes + (kt % kSmall) * kStageBytes;
#pragma unroll
      for (int u = 0; u < kChunksA + kChunksB; ++u) {
        const int off = (tid + u * Traits::kThreads) * 16;
        uint4 v = *reinterpret_cast<const uint4*>(stage + off);
        if constexpr (kDiff) {
          const float s = chunk_sumsq<float>(v);
          if (u < kChunksA) {
            sq_a[u < kChunksA ? u : 0] += s;
          } else {
            sq_b[u >= kChunksA ? u - kChunksA : 0] += s;
          }
        }
        const uint4 big = make_uint4(tf32_rna(v.x), tf32_rna(v.y), tf32_rna(v.z), tf32_rna(v.w));
        *reinterpret_cast<uint4*>(stage + off) = big;
        if constexpr (kSplit) {
          const uint4 sm = make_uint4(
              tf32_rna(__float_as_uint(__uint_as_float(v.x) - __uint_as_float(big.x))),
              tf32_rna(__float_as_uint(__uint_as_float(v.y) - __uint_as_float(big.y))),
              tf32_rna(__float_as_uint(__uint_as_float(v.z) - __uint_as_float(big.z))),
              tf32_rna(__float_as_uint(__uint_as_float(v.w) - __uint_as_float(big.w))));
          *reinterpret_cast<uint4*>(small + off) = sm;
        }
      }
      fence_proxy_async();  // these st.shared are read next by wgmma (async proxy)
    };

    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;

    // Prologue: k-tiles 0 .. kStages - 3 in flight, then split k-tile 0.
#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) {
      if (s < num_k_tiles) load_tile(s);
      cp_async_commit();
    }
    cp_async_wait<kStages - 3>();
    __syncthreads();
    split_tile(0);

    for (int kt = 0; kt < num_k_tiles; ++kt) {
      // Groups committed: k-tiles 0 .. kt + kStages - 3; k-tile kt + 1 must have landed.
      cp_async_wait<kStages - 4>();
      // After this barrier: split(kt) is complete and fenced by every thread;
      // raw k-tile kt + 1 is visible; every warpgroup has passed wgmma.wait
      // for k-tile kt - 2, so its stage and small tile are free.
      __syncthreads();

      {
        const unsigned st = base + (kt % kStages) * kStageBytes;
        const unsigned sm = small_base + (kt % kSmall) * kStageBytes;
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // two k8 steps: 32 bytes into each 64-byte row
          const unsigned a_off = wg * 64 * kRowBytes + s * 32;
          const unsigned b_off = kTileABytes + s * 32;
          const unsigned long long a_big = make_desc(st + a_off), b_big = make_desc(st + b_off);
          if constexpr (kSplit) {
            const unsigned long long a_small = make_desc(sm + a_off), b_small = make_desc(sm + b_off);
            wgmma_m64n256k8_tf32(acc, a_small, b_big);  // least significant terms first
            wgmma_m64n256k8_tf32(acc, a_big, b_small);
          }
          wgmma_m64n256k8_tf32(acc, a_big, b_big);
        }
        wgmma_commit();
      }

      if (kt + 1 < num_k_tiles) split_tile(kt + 1);
      {
        // Into the stage of k-tile kt - 2 (free). Issued after the split's
        // proxy fence, so that the fence never has this group outstanding.
        const int kn = kt + kStages - 2;
        if (kn < num_k_tiles) load_tile(kn);
        cp_async_commit();
      }
      wgmma_wait<1>();  // k-tile kt - 1 done (this warpgroup)
    }
    wgmma_wait<0>();
    cp_async_wait<0>();  // only empty groups can be left

    if constexpr (kDiff) {
#pragma unroll
      for (int u = 0; u < kChunksA; ++u) {
        sq_a[u] += __shfl_xor_sync(0xffffffffu, sq_a[u], 1);
        sq_a[u] += __shfl_xor_sync(0xffffffffu, sq_a[u], 2);
        if (copy_chunk == 0) norm_a[copy_row + u * kRowsPerPass] = sq_a[u];
      }
#pragma unroll
      for (int u = 0; u < kChunksB; ++u) {
        sq_b[u] += __shfl_xor_sync(0xffffffffu, sq_b[u], 1);
        sq_b[u] += __shfl_xor_sync(0xffffffffu, sq_b[u], 2);
        if (copy_chunk == 0) norm_b[copy_row + u * kRowsPerPass] = sq_b[u];
      }
    }
    // Norms visible to all; every warpgroup is done with the stages, so the
    // next batch entry may refill them.
    __syncthreads();

    // ------------------------------------------------------------ epilogue
    const float bw = bw_param.at(l0, l1, l2);
    const float lam = reg_on ? reg_param.at(l0, l1, l2) : 0.f;
    constexpr float kLog2e = 1.4426950408889634f;
    const float laplace_scale = -kLog2e / bw;
    const float gauss_scale = -kLog2e / (2.f * bw * bw);
    const float eps = epsilon > 0.f ? epsilon : -__uint_as_float(0x7f800000u);
    const bool vec_out = Traits::kLayoutO == Layout::RowMajor &&
                         ((unsigned long long)out_l % 8) == 0 && (ldo % 2) == 0;

    auto finish = [&](float dot, float na, float nb, bool regularised) -> float {
      float d, d2 = 0.f;
      if constexpr (kDiff) {
        d2 = fmaxf(fmaf(-2.f, dot, na + nb), 0.f);
        d = Traits::kOuter == Power::Sqrt ? sqrt_approx(d2) : d2;
      } else {
        d = dot;
      }
      if (d < eps) d = d2 = 0.f;
      float y;
      if constexpr (Traits::kEpilogue == Epilogue::Laplace) {
        y = exp2_approx(d * laplace_scale);
      } else if constexpr (Traits::kEpilogue == Epilogue::Gaussian) {
        y = exp2_approx((Traits::kOuter == Power::Sqrt ? d2 : d * d) * gauss_scale);
      } else {
        y = d;
      }
      return regularised ? y + lam : y;
    };

    // Tile-local row of this thread's accumulators h = 0 (row0) and h = 1
    // (row0 + 8), column 8 j + 2 t + e. The empty asm keeps the epilogue's
    // addresses from being hoisted out of the batch loop.
    int row0 = wg * 64 + (warp & 3) * 16 + g, col0 = 2 * t;
    asm volatile("" : "+r"(row0), "+r"(col0));
    float na[2];
    int reg_col[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + h * 8;
      na[h] = kDiff ? norm_a[row] : 0.f;
      const long long c = (long long)(m0 + row) + reg_diag - n0;
      reg_col[h] = reg_on && c >= 0 && c < kBlockN ? (int)c : -1;
    }

    if (kDiff && a_l == b_l && lda == ldb && m0 < n0 + kBlockN && n0 < m0 + kBlockM) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = col0 + j * 8;
        const float2 nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int diag = m0 + row0 + h * 8 - n0;  // tile-local column of m == n
          if (diag == col) acc[4 * j + 2 * h] = 0.5f * (na[h] + nb.x);
          if (diag == col + 1) acc[4 * j + 2 * h + 1] = 0.5f * (na[h] + nb.y);
        }
      }
    }

#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = col0 + j * 8;
      const int n = n0 + col;
      if (n >= N) continue;
      float2 nb = make_float2(0.f, 0.f);
      if constexpr (kDiff) nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + row0 + h * 8;
        if (m >= M) continue;
        const float y0 = finish(acc[4 * j + 2 * h], na[h], nb.x, reg_col[h] == col);
        const float y1 = finish(acc[4 * j + 2 * h + 1], na[h], nb.y, reg_col[h] == col + 1);
        if constexpr (Traits::kLayoutO == Layout::RowMajor) {
          float* p = out_l + (long long)m * ldo + n;
          if (n + 1 < N) {
            if (vec_out) {
              store_two<float>(p, y0, y1);
            } else {
              p[0] = y0;
              p[1] = y1;
            }
          } else {
            p[0] = y0;
          }
        } else {
          float* p = out_l + (long long)n * ldo + m;
          p[0] = y0;
          if (n + 1 < N) p[ldo] = y1;
        }
      }
    }
    // The next batch entry's prologue overwrites the stages and the norms:
    // every thread must be past its epilogue reads of norm_a/norm_b.
    __syncthreads();
  }
}

}  // namespace kermac_like
