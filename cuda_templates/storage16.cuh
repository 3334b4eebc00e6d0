// 16-bit storage types and type equality, shared by the families that take float16
// and bfloat16 data (distance_mma.cuh, distance_wgmma.cuh through it, matvec.cuh, topk.cuh),
// and their element loads and stores in float32.
#pragma once

namespace kermac_like {

// 16-bit storage types: bit patterns only, so that the templates need no CUDA
// header (<cuda_fp16.h> is not on NVRTC's include path here). A torch.float16
// or torch.bfloat16 tensor's data pointer is passed as a pointer to these.
struct float16 {
  unsigned short bits;
};
struct bfloat16 {
  unsigned short bits;
};

// Type equality for the traits' static checks (no <type_traits> under NVRTC).
template <class A, class B>
struct SameType {
  static constexpr bool value = false;
};
template <class A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// Element loads and stores in float32.
__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const float16* p) {
  float f;
  asm("{ .reg .b16 h; ld.global.b16 h, [%1]; cvt.f32.f16 %0, h; }" : "=f"(f) : "l"(p));
  return f;
}
__device__ __forceinline__ float load_f(const bfloat16* p) {
  return __uint_as_float(static_cast<unsigned>(p->bits) << 16);
}
__device__ __forceinline__ void store_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f(float16* p, float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p->bits = h;
}
__device__ __forceinline__ void store_f(bfloat16* p, float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p->bits = h;
}

}  // namespace kermac_like
