// Non-owning tensor views: pointer, dtype, shape, strides (in elements), device. kspec never allocates
// a caller's tensors; these views are how tensors from torch, CuPy or raw cuMemAlloc reach an op.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "kspec/error.h"

namespace kspec {

enum class DType : uint8_t { f32, f16, bf16, f64, i32, i64, u8 };

const char* dtype_name(DType t);        // "float32", "float16", "bfloat16", ...
const char* dtype_short(DType t);       // "f32", "f16", "bf16", ...
const char* dtype_cuda_type(DType t);   // "float", "__half", "__nv_bfloat16", ...
int dtype_size(DType t);
// Accepts the long and short names and torch's spelling ("torch.bfloat16", "bf16", "half", "fp16").
DType parse_dtype(std::string_view name);

constexpr int kMaxRank = 8;
constexpr int kCpuDevice = -1;
constexpr int kListRank = -2;  // a TensorView that stands for a list of tensors (TensorView::list)

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = -1;  // -1: no tensor (an optional argument left out); kListRank: a list of tensors
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};  // in elements, not bytes
  int device = kCpuDevice;         // CUDA device ordinal, or kCpuDevice for host memory

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* ptr, DType dt, std::initializer_list<int64_t> dims, int dev);
  static TensorView strided(void* ptr, DType dt, std::initializer_list<int64_t> dims,
                            std::initializer_list<int64_t> stride_elems, int dev);

  // A list of tensors in one argument slot (a TensorList input, e.g. an optimizer's parameters). Like
  // every view it owns nothing: `items` must outlive the call.
  static TensorView list(const TensorView* items, int64_t count);

  bool defined() const { return rank >= 0 || rank == kListRank; }
  bool is_list() const { return rank == kListRank; }
  int64_t list_size() const { return is_list() ? shape[0] : 0; }
  const TensorView& item(int64_t i) const { return static_cast<const TensorView*>(data)[i]; }
  int64_t numel() const;
  int64_t size(int d) const { return shape[d < 0 ? d + rank : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + rank : d]; }
  bool is_contiguous() const;
  std::string describe() const;  // "bfloat16[16, 4096] strides [4096, 1] on cuda:0"
};

}  // namespace kspec

namespace kspec {
// The CUDA device ordinal owning a device pointer (for __cuda_array_interface__ objects, which do
// not say). Throws InvalidArgument for host or unknown pointers.
int pointer_device(const void* ptr);
}  // namespace kspec
