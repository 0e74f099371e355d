// DType names and TensorView helpers.
#include <algorithm>
#include <cctype>
#include <sstream>

#include "kspec/tensor.h"

namespace kspec {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "?";
}

const char* dtype_short(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

const char* dtype_cuda_type(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f16: return "__half";
    case DType::bf16: return "__nv_bfloat16";
    case DType::f64: return "double";
    case DType::i32: return "int";
    case DType::i64: return "long long";
    case DType::u8: return "unsigned char";
  }
  return "?";
}

int dtype_size(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

DType parse_dtype(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f64" || s == "fp64" || s == "float64" || s == "double") return DType::f64;
  if (s == "i32" || s == "int32" || s == "int") return DType::i32;
  if (s == "i64" || s == "int64" || s == "long") return DType::i64;
  if (s == "u8" || s == "uint8") return DType::u8;
  throw InvalidArgument("dtype: unknown dtype '" + std::string(name) +
                        "' (expected one of f32, f16, bf16, f64, i32, i64, u8)");
}

TensorView::TensorView(void* ptr, DType dt, std::initializer_list<int64_t> dims, int dev)
    : data(ptr), dtype(dt), device(dev) {
  KSPEC_CHECK(dims.size() <= static_cast<size_t>(kMaxRank), "TensorView: rank ", dims.size(),
              " exceeds kMaxRank ", kMaxRank);
  rank = static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) shape[i++] = d;
  int64_t s = 1;
  for (int d = rank - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
}

TensorView TensorView::strided(void* ptr, DType dt, std::initializer_list<int64_t> dims,
                               std::initializer_list<int64_t> stride_elems, int dev) {
  KSPEC_CHECK(dims.size() == stride_elems.size(), "TensorView::strided: ", dims.size(), " dims but ",
              stride_elems.size(), " strides");
  TensorView t(ptr, dt, dims, dev);
  int i = 0;
  for (int64_t s : stride_elems) t.strides[i++] = s;
  return t;
}

int64_t TensorView::numel() const {
  if (rank < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

TensorView TensorView::list(const TensorView* items, int64_t count) {
  TensorView t;
  t.data = const_cast<TensorView*>(items);
  t.rank = kListRank;
  t.shape[0] = count;
  return t;
}

std::string TensorView::describe() const {
  if (is_list()) return "a list of " + std::to_string(list_size()) + " tensors";
  if (rank < 0) return "None";
  std::ostringstream os;
  os << dtype_name(dtype) << '[';
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << shape[d];
  os << "] strides [";
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << strides[d];
  os << "] on " << (device == kCpuDevice ? std::string("cpu") : "cuda:" + std::to_string(device));
  return os.str();
}

}  // namespace kspec
