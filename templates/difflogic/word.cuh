// The word of a bit-packed difflogic tensor: kWidth = 32 or 64 samples, sample s in bit s mod kWidth of
// word s / kWidth (packed.cuh, pack.cuh, group_sum.cuh).
#pragma once

namespace kspec {

template <int kWidth>
struct DiffLogicWord;
template <>
struct DiffLogicWord<32> {
  using type = unsigned int;
};
template <>
struct DiffLogicWord<64> {
  using type = unsigned long long;
};

}  // namespace kspec
