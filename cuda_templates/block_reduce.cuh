// A block-wide reduction along a fixed tree (bitwise the same result run to run), shared by the
// k-means kernels (kmeans.cuh, kmeans_assign_mma.cuh).
#pragma once

namespace kermac_like {

// The block's T values v combined by `op` along a fixed tree: red[tid] = v, then halves, T a power
// of two, red at least T values of shared memory. The result is read after the final barrier by
// every thread (red may be reused after the call).
template <int T, class V, class Op>
__device__ __forceinline__ V block_reduce(V* red, V v, Op op) {
  const int tid = threadIdx.x;
  red[tid] = v;
  __syncthreads();
#pragma unroll 1
  for (int s = T / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] = op(red[tid], red[tid + s]);
    __syncthreads();
  }
  const V r = red[0];
  __syncthreads();
  return r;
}

}  // namespace kermac_like
