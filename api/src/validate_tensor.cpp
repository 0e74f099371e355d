// Validation of one argument against its TensorDef: rank, dtype, device, dims and layout of a tensor,
// the same of each tensor of a TensorList, and the helpers that name them in messages. validate_call
// (validate.cpp) runs these on every call.
#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "api/src/validate.h"

namespace kspec::validation {

std::string join_dtypes(const std::vector<DType>& ds) {
  std::string s;
  for (size_t i = 0; i < ds.size(); ++i) s += (i ? "|" : "") + std::string(dtype_name(ds[i]));
  return s;
}

std::string shape_text(const std::vector<std::string>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i];
  return s + "]";
}

std::string shape_text(const TensorDef& t) {
  return t.alt_shape.empty() ? shape_text(t.shape) : shape_text(t.shape) + " or " + shape_text(t.alt_shape);
}

// The shape a tensor is laid out in: its alternative one when the call (or request) chose that.
const std::vector<std::string>& shape_for(const TensorDef& t, bool alt) { return alt ? t.alt_shape : t.shape; }

std::ostream& operator<<(std::ostream& os, const What& w) { return os << w.kind << " '" << w.name << "'"; }

bool is_leading(const std::string& tok) {
  return tok.size() >= 3 && tok[0] == '.' && tok[1] == '.' && tok[2] == '.';
}

// The distance between consecutive rows once the dims before the last are flattened: the stride of
// the innermost of them with more than one element (size-1 dims have arbitrary strides).
int64_t row_stride_of(const TensorView& t) {
  for (int j = t.rank - 2; j >= 0; --j)
    if (t.shape[j] > 1) return t.strides[j];
  return t.rank >= 1 ? t.shape[t.rank - 1] : 1;
}

const DimDef* find_dim(const OpInfo& info, std::string_view name) {
  for (const auto& d : info.dims)
    if (d.name == name) return &d;
  return nullptr;
}

int64_t bucket_of(const DimDef& d, int64_t v) {
  for (int64_t b : d.buckets)
    if (v <= b) return b;
  return v;  // above the largest bucket: exact
}


namespace {

void bind_dim(Problem& p, const std::string& op, const What& what, const std::string& dim,
              int64_t value) {
  for (auto& [name, v] : p.dims) {
    if (name == dim) {
      KSPEC_CHECK(v == value, op, ": ", what, " has ", dim, " = ", value, " but an earlier argument has ",
                  dim, " = ", v);
      return;
    }
  }
  p.dims.emplace_back(dim, value);
}

}  // namespace

bool is_number(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

int pow2_align(uint64_t x) {
  int a = 16;
  while (a > 1 && (x % a) != 0) a /= 2;
  return a;
}

}  // namespace

// Checks one tensor's rank, dtype, dims and layout; binds its dims. Returns its row stride (elements).
void check_tensor(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& t,
                  const What& what, int* device, bool is_output, TensorMeta& meta) {
  const std::string& op = info.name;
  KSPEC_CHECK(t.rank <= kMaxRank, op, ": ", what, ": rank ", t.rank, " exceeds ", kMaxRank);
  // An alternative shape has no leading "..." dims and another rank than the main one: the rank decides.
  meta.alt = !def.alt_shape.empty() && t.rank == static_cast<int>(def.alt_shape.size());
  const std::vector<std::string>& shape = shape_for(def, meta.alt);
  bool leading = !shape.empty() && is_leading(shape[0]);
  int fixed = static_cast<int>(shape.size()) - (leading ? 1 : 0);
  KSPEC_CHECK(leading ? t.rank >= fixed : t.rank == fixed, op, ": ", what, ": expected shape ",
              shape_text(def), def.alt_shape.empty() ? " (rank " : " (main rank ", leading ? ">= " : "", fixed,
              "), got ", t.describe());
  // dtype
  if (!def.dtype_of.empty()) {
    DType want = p.dtype(def.dtype_of);
    KSPEC_CHECK(t.dtype == want || (def.or_float32 && t.dtype == DType::f32), op, ": ", what,
                ": expected dtype ", dtype_name(want), def.or_float32 ? " (or float32)" : "",
                " like '", def.dtype_of, "', got ", dtype_name(t.dtype));
  } else {
    KSPEC_CHECK(std::find(def.dtypes.begin(), def.dtypes.end(), t.dtype) != def.dtypes.end(), op, ": ",
                what, ": expected dtype ", join_dtypes(def.dtypes), ", got ", dtype_name(t.dtype));
  }
  // device and pointer
  KSPEC_CHECK(t.device != kCpuDevice, op, ": ", what, ": expected a CUDA tensor, got one in host memory (",
              t.describe(), ")");
  KSPEC_CHECK(t.device >= 0, op, ": ", what, ": invalid device ", t.device);
  if (*device < 0) *device = t.device;
  KSPEC_CHECK(t.device == *device, op, ": ", what, ": expected a tensor on cuda:", *device,
              " like the other arguments, got cuda:", t.device);
  if (t.numel() > 0) KSPEC_CHECK(t.data != nullptr, op, ": ", what, ": null data pointer for ", t.describe());
  auto addr = reinterpret_cast<uintptr_t>(t.data);
  KSPEC_CHECK(addr % dtype_size(t.dtype) == 0, op, ": ", what, ": data pointer 0x", std::hex, addr, std::dec,
              " is not aligned to its element size (", dtype_size(t.dtype), " bytes)");
  // dims
  int lead_count = t.rank - fixed;
  if (leading) {
    std::string dim = shape[0].substr(3);
    int64_t prod = 1;
    std::vector<int64_t> lead;
    for (int d = 0; d < lead_count; ++d) {
      prod *= t.shape[d];
      lead.push_back(t.shape[d]);
    }
    bind_dim(p, op, what, dim, prod);
    bool have = false;
    for (const auto& l : p.leading) have = have || l.first == dim;
    if (!have) p.leading.emplace_back(dim, lead);
  }
  for (int i = 0; i < fixed; ++i) {
    const std::string& tok = shape[(leading ? 1 : 0) + i];
    int64_t v = t.shape[lead_count + i];
    KSPEC_CHECK(v >= 0, op, ": ", what, ": negative size in ", t.describe());
    if (is_number(tok)) {
      KSPEC_CHECK(v == std::stoll(tok), op, ": ", what, ": dim ", lead_count + i, " must be ", tok,
                  ", got ", v);
    } else {
      bind_dim(p, op, what, tok, v);
    }
  }
  // layout
  if (t.numel() > 0 && def.layout == Layout::Strided) {
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));  // the op's check_call judges the strides
  } else if (t.numel() > 0) {
    if (def.layout == Layout::Contiguous) {
      KSPEC_CHECK(t.is_contiguous(), op, ": ", what, ": expected a contiguous tensor, got ", t.describe());
    } else {
      KSPEC_CHECK(t.rank == 0 || t.shape[t.rank - 1] == 1 || t.strides[t.rank - 1] == 1, op, ": ", what,
                  ": expected the last dim to be contiguous (stride 1), got ", t.describe());
      // Leading dims must collapse into one row index: stride[j] == stride[j+1] * shape[j+1].
      int rows_end = t.rank - 1;       // all dims but the last form the rows
      for (int j = 0; j + 1 < rows_end; ++j) {
        if (t.shape[j] == 1 || t.shape[j + 1] == 1) continue;
        KSPEC_CHECK(t.strides[j] == t.strides[j + 1] * t.shape[j + 1], op, ": ", what,
                    ": its leading dims cannot be flattened into rows without a copy (", t.describe(),
                    "); pass a tensor whose dims before the last have a single row stride");
      }
      if (t.rank >= 2) {
        int64_t rs = row_stride_of(t);
        if (is_output && t.numel() > t.shape[t.rank - 1])
          KSPEC_CHECK(rs >= t.shape[t.rank - 1], op, ": ", what, ": rows overlap (row stride ", rs,
                      " < row length ", t.shape[t.rank - 1], "); outputs must not alias themselves");
        p.align_bytes = std::min(p.align_bytes, pow2_align(static_cast<uint64_t>(rs) * dtype_size(t.dtype)));
      }
    }
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));
  }
}

// Checks a TensorList input: every element has the list's dtype, lives on the call's device, has the
// def's layout (Contiguous or any), a pointer aligned to its element size; binds the count dim.
void check_list(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& list, const What& what,
                int* device) {
  const std::string& op = info.name;
  KSPEC_CHECK(list.is_list(), op, ": ", what, ": expected a list of tensors, got ", list.describe());
  if (!def.shape.empty()) bind_dim(p, op, what, def.shape[0], list.list_size());
  DType want = list.list_size() > 0 ? list.item(0).dtype : (def.dtypes.empty() ? DType::f32 : def.dtypes.front());
  if (!def.dtype_of.empty()) {
    DType other = p.dtype(def.dtype_of);
    KSPEC_CHECK(want == other || (def.or_float32 && want == DType::f32), op, ": ", what, ": expected dtype ",
                dtype_name(other), def.or_float32 ? " (or float32)" : "", " like '", def.dtype_of, "', got ",
                dtype_name(want));
  } else {
    KSPEC_CHECK(std::find(def.dtypes.begin(), def.dtypes.end(), want) != def.dtypes.end(), op, ": ", what,
                ": expected dtype ", join_dtypes(def.dtypes), ", got ", dtype_name(want));
  }
  for (int64_t i = 0; i < list.list_size(); ++i) {
    const TensorView& t = list.item(i);
    KSPEC_CHECK(t.defined() && !t.is_list(), op, ": ", what, "[", i, "]: expected a tensor, got ", t.describe());
    KSPEC_CHECK(t.rank <= kMaxRank, op, ": ", what, "[", i, "]: rank ", t.rank, " exceeds ", kMaxRank);
    KSPEC_CHECK(t.dtype == want, op, ": ", what, "[", i, "]: expected dtype ", dtype_name(want),
                " like the list's first tensor, got ", dtype_name(t.dtype));
    KSPEC_CHECK(t.device != kCpuDevice, op, ": ", what, "[", i, "]: expected a CUDA tensor, got one in host memory");
    if (*device < 0) *device = t.device;
    KSPEC_CHECK(t.device == *device, op, ": ", what, "[", i, "]: expected a tensor on cuda:", *device,
                " like the other arguments, got cuda:", t.device);
    if (t.numel() == 0) continue;
    KSPEC_CHECK(t.data != nullptr, op, ": ", what, "[", i, "]: null data pointer for ", t.describe());
    auto addr = reinterpret_cast<uintptr_t>(t.data);
    KSPEC_CHECK(addr % dtype_size(t.dtype) == 0, op, ": ", what, "[", i, "]: data pointer 0x", std::hex, addr,
                std::dec, " is not aligned to its element size (", dtype_size(t.dtype), " bytes)");
    if (def.layout == Layout::Contiguous)
      KSPEC_CHECK(t.is_contiguous(), op, ": ", what, "[", i, "]: expected a contiguous tensor, got ", t.describe());
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));
  }
}

// Element i of `list` has the shape of element i of `other` (same length too).
void check_same_shapes(const std::string& op, const What& what, const TensorView& list, const std::string& other_name,
                       const TensorView& other) {
  KSPEC_CHECK(list.list_size() == other.list_size(), op, ": ", what, " has ", list.list_size(),
              " tensors but '", other_name, "' has ", other.list_size());
  for (int64_t i = 0; i < list.list_size(); ++i) {
    const TensorView &a = list.item(i), &b = other.item(i);
    bool same = a.rank == b.rank;
    for (int d = 0; same && d < a.rank; ++d) same = a.shape[d] == b.shape[d];
    KSPEC_CHECK(same, op, ": ", what, "[", i, "] has shape ", a.describe(), " but '", other_name, "'[", i,
                "] has ", b.describe());
  }
}

}  // namespace kspec::validation
