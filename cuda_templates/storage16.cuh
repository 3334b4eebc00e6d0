// 16-bit storage types and type equality, shared by the families that take float16
// and bfloat16 data (distance_mma.cuh, distance_wgmma.cuh through it, matvec.cuh).
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

}  // namespace kermac_like
