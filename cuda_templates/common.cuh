// Shared vocabulary of every kermac_like kernel family.
//
// The enums mirror kermac_like/descriptor.py value for value: the Python side
// renders template arguments such as `kermac_like::Power::Abs` from its own
// enums, so renaming or renumbering one side without the other breaks the
// name expressions at compile time (never silently).
//
// Only NVRTC built-ins are used here (no <cuda_runtime.h>, no <cstdint>): the
// templates compile with nothing but NVRTC on the include path.
#pragma once

namespace kermac_like {

typedef long long i64;

enum class Inner : int { Diff = 0, Dot = 1 };
enum class Power : int { Noop = 0, Abs = 1, Square = 2, Sqrt = 3, Pow = 4 };
enum class Epilogue : int { None = 0, Laplace = 1, Gaussian = 2 };
// Row-major: the last (contiguous) mode of a (rows, cols) matrix is cols.
enum class Layout : int { RowMajor = 0, ColMajor = 1 };

// Up to three broadcast batch modes, flattened into one index by the launcher
// (outermost first).  Unused modes have extent 1 and stride 0.
// One flattened batch index split into its three modes.
struct BatchIndex {
  int l0, l1, l2;
};

struct BatchShape {
  int n1, n2;  // extents of modes 1 and 2; mode 0 is whatever is left
  __device__ __forceinline__ void split(int l, int& l0, int& l1, int& l2) const {
    l2 = l % n2;
    int r = l / n2;
    l1 = r % n1;
    l0 = r / n1;
  }
  __device__ __forceinline__ BatchIndex split(int l) const {
    BatchIndex i;
    split(l, i.l0, i.l1, i.l2);
    return i;
  }
};

struct BatchStride {
  i64 s0, s1, s2;
  __device__ __forceinline__ i64 offset(int l0, int l1, int l2) const {
    return l0 * s0 + l1 * s1 + l2 * s2;
  }
  __device__ __forceinline__ i64 offset(const BatchIndex& i) const { return offset(i.l0, i.l1, i.l2); }
};

// A hyper-parameter that is either one scalar (ptr == nullptr) or a float32
// tensor broadcast over the batch modes (stride 0 where it broadcasts).
struct HyperParam {
  const float* ptr;
  BatchStride stride;
  float value;
  __device__ __forceinline__ float at(int l0, int l1, int l2) const {
    return ptr ? ptr[stride.offset(l0, l1, l2)] : value;
  }
  __device__ __forceinline__ float at(const BatchIndex& i) const { return at(i.l0, i.l1, i.l2); }
};

// The batch and hyper-parameter arguments of the distance kernels' flat ABI
// (cuda_templates/ABI.md; cuda.core passes no structs), gathered once at
// kernel entry. at(l) gives batch entry l: its operands and the index at which
// its hyper-parameters are read (read where they are used, so that a kernel
// keeps them live only as long as it needs them).
template <class T>
struct DistanceBatchArgs {
  struct Entry {
    const T* a;
    const T* b;
    T* out;
    BatchIndex index;
  };

  const T* a;
  const T* b;
  T* out;
  BatchShape shape;
  BatchStride a_stride, b_stride, o_stride;
  HyperParam inner_p, outer_p, bandwidth, regularization;
  bool reg_on;  // regularisation requested: a tensor, or a nonzero scalar

  // Arguments in the kernels' order, from batch_n1 to regularization
  // (batch itself bounds the kernels' batch loop).
  __device__ __forceinline__ DistanceBatchArgs(
      const T* a_, const T* b_, T* out_, int batch_n1, int batch_n2, i64 a_bs0, i64 a_bs1,
      i64 a_bs2, i64 b_bs0, i64 b_bs1, i64 b_bs2, i64 o_bs0, i64 o_bs1, i64 o_bs2,
      const float* inner_p_ptr, i64 inner_p_bs0, i64 inner_p_bs1, i64 inner_p_bs2, float inner_p_,
      const float* outer_p_ptr, i64 outer_p_bs0, i64 outer_p_bs1, i64 outer_p_bs2, float outer_p_,
      const float* bw_ptr, i64 bw_bs0, i64 bw_bs1, i64 bw_bs2, float bandwidth_,
      const float* reg_ptr, i64 reg_bs0, i64 reg_bs1, i64 reg_bs2, float regularization_)
      : a(a_),
        b(b_),
        out(out_),
        shape{batch_n1, batch_n2},
        a_stride{a_bs0, a_bs1, a_bs2},
        b_stride{b_bs0, b_bs1, b_bs2},
        o_stride{o_bs0, o_bs1, o_bs2},
        inner_p{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p_},
        outer_p{outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p_},
        bandwidth{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth_},
        regularization{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization_},
        reg_on(reg_ptr != nullptr || regularization_ != 0.0f) {}

  __device__ __forceinline__ Entry at(int l) const {
    const BatchIndex i = shape.split(l);
    return {a + a_stride.offset(i), b + b_stride.offset(i), out + o_stride.offset(i), i};
  }
};

// cp.async (sm_80 and newer): asynchronous global -> shared copies. dst is a
// shared-window address; `bytes` (0 up to the copy's size) are read and the
// rest of the destination is zero-filled (0 reads nothing, but src must still
// be a mapped address). The "memory" clobbers keep ordinary memory accesses
// from moving across the copies, the commits and the waits. A namespace of
// their own: distance.cuh keeps host-runnable copies under the same names, and
// the mma host emulation supplies its own.
namespace async_copy {

// 4 bytes through L1 (.ca).
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

// 16 bytes bypassing L1 (.cg); dst and src 16-byte aligned.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace async_copy

template <class T>
__device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Tensor-core instructions shared by the kernel families (mma.sync, sm_80+).
// The mma host emulation (tests) supplies its own under the same name.
namespace tensor_core {

// d += a * b on a 16x8x8 TF32 tile (PTX ISA "Matrix Fragments for mma.m16n8k8",
// .tf32). With g = lane / 4, t = lane % 4:
//   a0 (row g, k t)   a1 (row g+8, k t)   a2 (row g, k t+4)   a3 (row g+8, k t+4)
//   b0 (k t, col g)   b1 (k t+4, col g)
//   d0 (row g, col 2t)  d1 (row g, col 2t+1)  d2 (row g+8, col 2t)  d3 (row g+8, col 2t+1)
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace tensor_core

}  // namespace kermac_like
