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
struct BatchShape {
  int n1, n2;  // extents of modes 1 and 2; mode 0 is whatever is left
  __device__ __forceinline__ void split(int l, int& l0, int& l1, int& l2) const {
    l2 = l % n2;
    int r = l / n2;
    l1 = r % n1;
    l0 = r / n1;
  }
};

struct BatchStride {
  i64 s0, s1, s2;
  __device__ __forceinline__ i64 offset(int l0, int l1, int l2) const {
    return l0 * s0 + l1 * s1 + l2 * s2;
  }
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
};

template <class T>
__device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace kermac_like
