// DType names, TensorView helpers, and the check that a call's outputs share no memory with its inputs.
#include <algorithm>
#include <cctype>
#include <sstream>

#include "api/src/op.h"
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

// Outputs that share memory with inputs or with each other: validation refuses them before a launch,
// since a kernel reading what another of its threads already wrote gives wrong results silently.
// This runs on every call and BoundCall::run (AdamW: ~1000 input tensors), so a pair's spans are
// compared first and density is judged only for the rare pair whose spans intersect.
namespace kspec {
namespace {

// The bytes a non-empty view's elements lie in, [lo, hi); its lowest element ends at first_end, its
// highest starts at last. `known` is false where the arithmetic would overflow: such a view is never
// called overlapping.
struct Span {
  uintptr_t lo = 0, hi = 0, first_end = 0, last = 0;
  bool known = false;  // false also for an empty view or none: nothing to share
};

Span span_of(const TensorView& t) {
  Span e;
  const int64_t size = dtype_size(t.dtype);
  int64_t below = 0, above = 0;  // elements before / after the data pointer
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] <= 0) return e;
    int64_t reach = 0;
    if (__builtin_mul_overflow(t.strides[d], t.shape[d] - 1, &reach)) return e;
    if (reach < 0 ? __builtin_sub_overflow(below, reach, &below) : __builtin_add_overflow(above, reach, &above))
      return e;
  }
  int64_t below_bytes = 0, above_bytes = 0;
  if (__builtin_mul_overflow(below, size, &below_bytes) || __builtin_mul_overflow(above, size, &above_bytes)) return e;
  auto base = reinterpret_cast<uintptr_t>(t.data);
  if (__builtin_sub_overflow(base, static_cast<uintptr_t>(below_bytes), &e.lo) ||
      __builtin_add_overflow(base, static_cast<uintptr_t>(above_bytes), &e.last) ||
      __builtin_add_overflow(e.last, static_cast<uintptr_t>(size), &e.hi))
    return e;
  e.first_end = e.lo + size;
  e.known = true;
  return e;
}

// Whether the elements fill the span exactly once (a permutation of a contiguous tensor): sorted by
// stride, the dims of more than one element step 1, then each the product of those before it.
bool dense(const TensorView& t) {
  int64_t stride[kMaxRank], count[kMaxRank];  // an insertion sort: dims are few
  int n = 0;
  for (int d = 0; d < t.rank && d < kMaxRank; ++d) {
    if (t.shape[d] == 1) continue;
    if (t.strides[d] <= 0) return false;
    int i = n++;
    for (; i > 0 && stride[i - 1] > t.strides[d]; --i) {
      stride[i] = stride[i - 1];
      count[i] = count[i - 1];
    }
    stride[i] = t.strides[d];
    count[i] = t.shape[d];
  }
  int64_t expect = 1;
  for (int i = 0; i < n; ++i)
    if (stride[i] != expect || __builtin_mul_overflow(expect, count[i], &expect)) return false;
  return true;
}

bool intersect(uintptr_t lo1, uintptr_t hi1, uintptr_t lo2, uintptr_t hi2) { return lo1 < hi2 && lo2 < hi1; }

// Sure to share an element: both start at one address, or one fills its span and the other's lowest
// or highest element lies in it. (Strided views whose spans interleave without a common element, like
// two column blocks of one matrix, are not reported.)
bool overlap(const TensorView& a, const Span& sa, const TensorView& b, const Span& sb) {
  if (!sa.known || !sb.known) return false;
  if (a.data == b.data) return true;
  if (!intersect(sa.lo, sa.hi, sb.lo, sb.hi)) return false;
  auto holds_end_of = [](const Span& full, const Span& other) {
    return intersect(full.lo, full.hi, other.lo, other.first_end) || intersect(full.lo, full.hi, other.last, other.hi);
  };
  return (dense(a) && holds_end_of(sa, sb)) || (dense(b) && holds_end_of(sb, sa));
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int d = 0; d < a.rank; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

std::string arg_text(const char* kind, const TensorDef& def, int64_t item) {
  std::string s = std::string(kind) + " '" + def.name + "'";
  return item >= 0 ? s + "[" + std::to_string(item) + "]" : s;
}

}  // namespace

void check_no_overlap(const OpInfo& info, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs) {
  // Outputs are few (e79.bwd has the most, 8) and never lists: their spans stay off the heap.
  const size_t n_out = std::min(outputs.size(), info.outputs.size());
  Span local[16];
  std::vector<Span> more(n_out > 16 ? n_out : 0);
  Span* out_span = n_out > 16 ? more.data() : local;
  bool any = false;
  for (size_t i = 0; i < n_out; ++i) {
    const TensorView& o = outputs[i];
    if (o.rank < 0) continue;
    out_span[i] = span_of(o);
    any = any || out_span[i].known;
    for (size_t j = 0; j < i; ++j)
      KSPEC_CHECK(!overlap(o, out_span[i], outputs[j], out_span[j]), info.name, ": ",
                  arg_text("output", info.outputs[i], -1), " (", o.describe(), ") shares memory with ",
                  arg_text("output", info.outputs[j], -1), " (", outputs[j].describe(), "); outputs must not overlap");
  }
  if (!any) return;
  auto check_input = [&](const TensorView& in, const TensorDef& def, int64_t item) {
    const Span s = span_of(in);
    if (!s.known) return;
    for (size_t i = 0; i < n_out; ++i) {
      const TensorView& o = outputs[i];
      if (!overlap(o, out_span[i], in, s)) continue;
      const TensorDef& odef = info.outputs[i];
      bool in_place = !odef.in_place_of.empty() && odef.in_place_of == def.name && item < 0;
      KSPEC_CHECK(in_place && same_view(o, in), info.name, ": ", arg_text("output", odef, -1), " (", o.describe(),
                  ") shares memory with ", arg_text("input", def, item), " (", in.describe(),
                  in_place ? "): it may be that tensor itself (updated in place) but not overlap it otherwise"
                           : "); outputs must not overlap inputs");
    }
  };
  for (size_t k = 0; k < inputs.size() && k < info.inputs.size(); ++k) {
    const TensorView& t = inputs[k];
    if (t.is_list()) {
      for (int64_t e = 0; e < t.list_size(); ++e) check_input(t.item(e), info.inputs[k], e);
    } else if (t.rank >= 0) {
      check_input(t, info.inputs[k], -1);
    }
  }
}

}  // namespace kspec
