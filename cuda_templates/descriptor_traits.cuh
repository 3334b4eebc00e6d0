// The descriptor part of the SIMT kernel families' traits (topk.cuh, logsumexp.cuh, matvec.cuh):
// the checks every family makes of a descriptor and its data type, and the members that name
// them. A family's traits derive from it and add their own checks and tile constants.
#pragma once

#include "common.cuh"
#include "storage16.cuh"

namespace kermac_like {

template <Inner kInner_, Power kInnerPow_, Power kOuterPow_, Epilogue kEpilogue_, class T_>
struct DescriptorTraits {
  static_assert(kInner_ != Inner::Dot || (kInnerPow_ == Power::Noop && kOuterPow_ == Power::Noop &&
                                          kEpilogue_ == Epilogue::None),
                "kernel traits: Inner::Dot takes Noop powers and Epilogue::None");
  static_assert(kInner_ != Inner::Diff || kInnerPow_ != Power::Noop,
                "kernel traits: Inner::Diff requires an inner power (Abs, Square or Pow)");
  static_assert(kInnerPow_ != Power::Sqrt, "kernel traits: inner power Power::Sqrt is not supported");
  static_assert(kOuterPow_ != Power::Abs && kOuterPow_ != Power::Square,
                "kernel traits: outer power must be Noop, Sqrt or Pow");
  static_assert(SameType<T_, float>::value || SameType<T_, float16>::value ||
                    SameType<T_, bfloat16>::value,
                "kernel traits: T must be float, kermac_like::float16 or kermac_like::bfloat16");

  using T = T_;
  static constexpr Inner kInner = kInner_;
  static constexpr Power kInnerPow = kInnerPow_;
  static constexpr Power kOuterPow = kOuterPow_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
};

}  // namespace kermac_like
