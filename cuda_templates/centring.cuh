// The per-call reference point of the product formula and the operands shifted by it
// (kermac_like/centring.py: per column, the median of the finite coordinates of a strided sample
// of each operand's rows, 0 where the column holds a non-finite value anywhere; then x - s and
// y - s, zero-padded to Kp columns), in three small kernels of the package's own. The torch steps
// they replace on a GPU (amax, amin, isfinite, isinf, masked_fill, nanmedian, nan_to_num, sub, ...)
// are a dozen torch kernels, each of which loads its module from torch's fatbinary on its first
// launch in a process: ~150 ms of a first call on an H200, against one small module here
// (bench/notes/jit.md, "The warm first call again").
//
// The same values, bit for bit, as those torch steps on a GPU: the median is a selection (the
// lower median of the sample's non-NaN values, infinities counted as NaN, in the order of torch's
// radix selection: -0 before +0), the shift one float subtraction per coordinate, and the flags
// exact. Operands are 2-D float32 with any element strides (ldr between rows, ldc between
// columns); y may be null (x and y are the same memory: one sample, one copy).
#pragma once

namespace kermac_like {

struct CentringTraits {
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 1, kBlockN = 1;  // (the launch mirror's fields; grids per kernel below)
  static constexpr int kSmemBytes = 0;
  static constexpr int kCols = 32;  // centring_flags_kernel: columns per block, one per lane
  static constexpr int kRowLanes = kThreads / kCols;
  static constexpr int kSample = 1024;  // rows of each operand's sample: centring.REFERENCE_ROWS
  static constexpr int kKeys = 2 * kSample;  // both samples, sorted in shared memory
  static constexpr int kWarps = kThreads / 32;
};

namespace centring_detail {

// A float's key in torch's radix order (SortingRadixSelect.cuh's TopKTypeConfig<float>::convert):
// ascending unsigned keys are ascending values, -0 before +0; NaN (and here +-inf, which
// reference_point turns into NaN first) the largest key, 0xffffffff.
__device__ __forceinline__ unsigned key_of(float v) {
  if (!(fabsf(v) <= 3.402823466e38f)) return 0xffffffffu;
  const unsigned u = __float_as_uint(v);
  return u ^ ((u & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}

__device__ __forceinline__ float value_of(unsigned k) {
  return __uint_as_float(k ^ ((k & 0x80000000u) ? 0x80000000u : 0xffffffffu));
}

// The sum of v over the block (every thread gets it); `scratch` holds Traits::kThreads ints.
template <class Traits>
__device__ __forceinline__ int block_sum(int v, int* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int s = Traits::kThreads / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
    __syncthreads();
  }
  const int r = scratch[0];
  __syncthreads();
  return r;
}

}  // namespace centring_detail

// Non-finite flags. Blocks (blockIdx.x over the row chunks of x, then of y; blockIdx.y over
// groups of kCols columns): flags[chunk K + c] = 1 when rows [chunk rpc, (chunk + 1) rpc) of the
// chunk's operand hold a NaN or an infinity in column c, else 0 (chunks of y follow x's: chunk
// x_chunks + i is y's chunk i). rpc: rows per chunk of each operand.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    centring_flags_kernel(const float* __restrict__ x, long long x_rows, long long x_ldr, long long x_ldc,
                          long long x_rpc, int x_chunks, const float* __restrict__ y, long long y_rows,
                          long long y_ldr, long long y_ldc, long long y_rpc, int K, int* __restrict__ flags) {
  __shared__ int part[Traits::kThreads];
  const bool on_y = (int)blockIdx.x >= x_chunks;
  const float* p = on_y ? y : x;
  const long long rows = on_y ? y_rows : x_rows, ldr = on_y ? y_ldr : x_ldr, ldc = on_y ? y_ldc : x_ldc;
  const long long rpc = on_y ? y_rpc : x_rpc;
  const long long chunk = on_y ? (long long)blockIdx.x - x_chunks : (long long)blockIdx.x;
  const int lane = threadIdx.x % Traits::kCols, r0 = threadIdx.x / Traits::kCols;
  const int c = blockIdx.y * Traits::kCols + lane;
  const long long lo = chunk * rpc;
  const long long hi = lo + rpc < rows ? lo + rpc : rows;
  int bad = 0;
  if (c < K) {
    for (long long r = lo + r0; r < hi; r += Traits::kRowLanes) {
      const float v = p[r * ldr + (long long)c * ldc];
      bad |= !(fabsf(v) <= 3.402823466e38f) ? 1 : 0;
    }
  }
  part[threadIdx.x] = bad;
  __syncthreads();
  if (r0 == 0 && c < K) {
    for (int i = 1; i < Traits::kRowLanes; ++i) bad |= part[i * Traits::kCols + lane];
    flags[(long long)blockIdx.x * K + c] = bad;
  }
}

// The reference point: block c (one per column) ORs the column's `chunks` flags, sorts the keys
// of the samples (x's rows 0, x_step, 2 x_step, ... below x_rows, then y's likewise; y null: none)
// and writes s[c] = the lower median of the non-NaN sample values, or 0 where the column is
// flagged or the sample holds no finite value.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    centring_point_kernel(const float* __restrict__ x, long long x_rows, long long x_ldr, long long x_ldc,
                          long long x_step, const float* __restrict__ y, long long y_rows, long long y_ldr,
                          long long y_ldc, long long y_step, int K, const int* __restrict__ flags, int chunks,
                          float* __restrict__ s) {
  __shared__ unsigned keys[Traits::kKeys];
  __shared__ int scratch[Traits::kThreads];
  using namespace centring_detail;
  const int c = blockIdx.x;
  int bad = 0;
  for (int i = threadIdx.x; i < chunks; i += Traits::kThreads) bad |= flags[(long long)i * K + c];
  bad = block_sum<Traits>(bad, scratch);
  const int nx = x_rows > 0 ? (int)((x_rows + x_step - 1) / x_step) : 0;
  const int ny = (y != nullptr && y_rows > 0) ? (int)((y_rows + y_step - 1) / y_step) : 0;
  const int n = nx + ny;  // <= kKeys: steps of at least rows / kSample
  int width = 2;
  while (width < n) width <<= 1;
  int valid = 0;
  for (int i = threadIdx.x; i < width; i += Traits::kThreads) {
    unsigned k = 0xffffffffu;
    if (i < nx) {
      k = key_of(x[(long long)i * x_step * x_ldr + (long long)c * x_ldc]);
    } else if (i < n) {
      k = key_of(y[(long long)(i - nx) * y_step * y_ldr + (long long)c * y_ldc]);
    }
    keys[i] = k;
    valid += k != 0xffffffffu ? 1 : 0;
  }
  valid = block_sum<Traits>(valid, scratch);  // (its barrier also publishes the keys)
  if (bad || valid == 0) {
    if (threadIdx.x == 0) s[c] = 0.f;
    return;
  }
  // Bitonic sort of keys[0, width), ascending (the padding keys 0xffffffff stay at the end).
  for (int size = 2; size <= width; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < width; i += Traits::kThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned a = keys[i], b = keys[j];
          if ((a > b) == ((i & size) == 0)) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) s[c] = value_of(keys[(valid - 1) / 2]);
}

// The shifted copies: xs[r Kp + c] = x[r, c] - s[c] for c < K, 0 for K <= c < Kp (row-major,
// fresh); the same for y into ys when y is not null. One warp per row, its lanes over the
// columns; the blocks stride over the rows of x, then of y.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    centring_shift_kernel(const float* __restrict__ x, long long x_rows, long long x_ldr, long long x_ldc,
                          float* __restrict__ xs, const float* __restrict__ y, long long y_rows, long long y_ldr,
                          long long y_ldc, float* __restrict__ ys, int K, int Kp, const float* __restrict__ s) {
  const long long total = x_rows + (y != nullptr ? y_rows : 0);
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * Traits::kWarps;
  for (long long w = (long long)blockIdx.x * Traits::kWarps + (threadIdx.x >> 5); w < total; w += warps) {
    const bool on_y = w >= x_rows;
    const long long r = on_y ? w - x_rows : w;
    const float* src = on_y ? y + r * y_ldr : x + r * x_ldr;
    const long long ldc = on_y ? y_ldc : x_ldc;
    float* dst = (on_y ? ys : xs) + r * Kp;
    for (int c = lane; c < Kp; c += 32) dst[c] = c < K ? src[(long long)c * ldc] - s[c] : 0.f;
  }
}

}  // namespace kermac_like
