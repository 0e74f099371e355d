// GPU-vs-float64-reference checks, generic over every registered op (inputs drawn from the schema
// and the case table, outputs compared per tensor).
#include "kspec/check.h"

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "api/src/op.h"
#include "jit/driver.h"

namespace kspec {
namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void encode(DType dt, const std::vector<double>& src, std::vector<unsigned char>& bytes) {
  bytes.resize(src.size() * dtype_size(dt));
  for (size_t i = 0; i < src.size(); ++i) {
    switch (dt) {
      case DType::f32: { float f = static_cast<float>(src[i]); std::memcpy(&bytes[i * 4], &f, 4); break; }
      case DType::f64: std::memcpy(&bytes[i * 8], &src[i], 8); break;
      case DType::f16: { _Float16 h = static_cast<_Float16>(static_cast<float>(src[i])); std::memcpy(&bytes[i * 2], &h, 2); break; }
      case DType::bf16: { uint16_t h = to_bf16(static_cast<float>(src[i])); std::memcpy(&bytes[i * 2], &h, 2); break; }
      default: throw Unsupported(detail::concat("check: dtype ", dtype_name(dt), " not supported"));
    }
  }
}

std::vector<double> decode(DType dt, const std::vector<unsigned char>& bytes) {
  size_t n = bytes.size() / dtype_size(dt);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::f32: { float f; std::memcpy(&f, &bytes[i * 4], 4); out[i] = f; break; }
      case DType::f64: std::memcpy(&out[i], &bytes[i * 8], 8); break;
      case DType::f16: { _Float16 h; std::memcpy(&h, &bytes[i * 2], 2); out[i] = static_cast<float>(h); break; }
      case DType::bf16: { uint16_t h; std::memcpy(&h, &bytes[i * 2], 2); out[i] = from_bf16(h); break; }
      default: break;
    }
  }
  return out;
}

// Rounds values to what the dtype can hold, so the reference sees exactly the GPU's inputs.
void quantize(DType dt, std::vector<double>& v) {
  std::vector<unsigned char> b;
  encode(dt, v, b);
  v = decode(dt, b);
}

struct DeviceBuffer {
  CUdeviceptr ptr = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { CU_CHECK(cuMemAlloc(&ptr, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() {
    if (ptr) jit::driver().cuMemFree(ptr);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr) { o.ptr = 0; }
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  DeviceBuffer(const DeviceBuffer&) = delete;
};

TensorView view_of(CUdeviceptr p, DType dt, const std::vector<int64_t>& shape, int device) {
  TensorView t;
  t.data = reinterpret_cast<void*>(p);
  t.dtype = dt;
  t.rank = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = s;
    s *= shape[d];
  }
  t.device = device;
  return t;
}

double rel_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

Problem problem_for_case(const OpDef& op, const Case& cs, DType dtype, const std::string& arch) {
  CompileRequest req;
  req.op = op.info.name;
  req.dtype = dtype;
  req.arch = arch;
  req.without = cs.without;
  req.tensor_dtypes = cs.tensor_dtypes;
  req.alt_shapes = cs.alt_shapes;
  for (const auto& [k, v] : cs.params.items()) req.params.set(k, v);
  for (const auto& [k, v] : cs.dims) req.params.set(k, v);
  Problem p = problem_from_request(op, req);
  return p;
}

std::string shape_text(const Case& cs) {
  std::string s;
  for (const auto& [k, v] : cs.dims) s += (s.empty() ? "" : " ") + k + "=" + std::to_string(v);
  return s;
}

CheckRow check_one(const OpDef& op, const Case& cs, DType dtype, const CheckOptions& o, uint64_t seed) {
  CheckRow row;
  row.op = op.info.name;
  row.case_name = cs.name;
  row.dtype = dtype_short(dtype);
  row.shape = shape_text(cs);
  row.seed = seed;
  row.tolerance = tolerance_for(dtype) * op.tolerance_scale;
  try {
    jit::ContextGuard guard(o.device);
    Problem p = problem_for_case(op, cs, dtype, "sm_90");
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    const auto& ins = op.info.inputs;
    const auto& outs = op.info.outputs;
    std::vector<HostTensor> host_in(ins.size());
    for (size_t i = 0; i < ins.size(); ++i) {
      if (!p.inputs[i].present) continue;
      HostTensor& h = host_in[i];
      h.defined = true;
      h.shape = shape_of(ins[i], p);
      h.data.resize(h.numel());
      for (auto& v : h.data) v = normal(rng);
    }
    // Round to the input dtypes first, so derived inputs (saved statistics) are those of what the GPU
    // sees, then round the derived ones too.
    for (size_t i = 0; i < ins.size(); ++i)
      if (host_in[i].defined) quantize(p.inputs[i].dtype, host_in[i].data);
    if (op.prepare_inputs) op.prepare_inputs(p, host_in);
    std::vector<DeviceBuffer> buffers;
    std::vector<TensorView> in_views(ins.size()), out_views(outs.size());
    std::vector<unsigned char> bytes;
    for (size_t i = 0; i < ins.size(); ++i) {
      if (!host_in[i].defined) continue;
      DType dt = p.inputs[i].dtype;
      quantize(dt, host_in[i].data);
      encode(dt, host_in[i].data, bytes);
      buffers.emplace_back(bytes.size());
      if (!bytes.empty()) CU_CHECK(cuMemcpyHtoD(buffers.back().ptr, bytes.data(), bytes.size()));
      in_views[i] = view_of(buffers.back().ptr, dt, host_in[i].shape, o.device);
    }
    std::vector<std::vector<int64_t>> out_shapes(outs.size());
    std::vector<size_t> out_buf(outs.size(), SIZE_MAX);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!p.outputs[i].present) continue;
      out_shapes[i] = shape_of(outs[i], p);
      int64_t n = 1;
      for (auto d : out_shapes[i]) n *= d;
      size_t nbytes = static_cast<size_t>(n) * dtype_size(p.outputs[i].dtype);
      buffers.emplace_back(nbytes);
      CU_CHECK(cuMemsetD8(buffers.back().ptr, 0xFF, std::max<size_t>(nbytes, 16)));  // NaN in every float type
      out_buf[i] = buffers.size() - 1;
      out_views[i] = view_of(buffers.back().ptr, p.outputs[i].dtype, out_shapes[i], o.device);
    }
    Params params;
    for (const auto& [k, v] : cs.params.items()) params.set(k, v);
    CallOptions copts;
    copts.config = o.config ? &*o.config : nullptr;
    call(op.info.name, in_views, out_views, params, nullptr, copts);
    CU_CHECK(cuCtxSynchronize());
    auto refs = op.reference(p, host_in);
    row.passed = true;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!p.outputs[i].present) continue;
      DType dt = p.outputs[i].dtype;
      int64_t n = 1;
      for (auto d : out_shapes[i]) n *= d;
      bytes.assign(static_cast<size_t>(n) * dtype_size(dt), 0);
      if (!bytes.empty()) CU_CHECK(cuMemcpyDtoH(bytes.data(), buffers[out_buf[i]].ptr, bytes.size()));
      double err = rel_error(decode(dt, bytes), refs[i].data);
      row.errors.emplace_back(outs[i].name, err);
      if (!(err <= row.tolerance)) {
        row.passed = false;
        row.message += outs[i].name + " error " + std::to_string(err) + " > " + std::to_string(row.tolerance) + "; ";
      }
    }
    Config cfg = o.config                ? *o.config
                 : op.tuning.heuristic ? op.tuning.heuristic(problem_for_case(op, cs, dtype, "sm_90"))
                                       : Config{};
    row.config = cfg.str();
  } catch (const std::exception& e) {
    row.passed = false;
    row.message = e.what();
  }
  if (!row.passed) row.message += " (seed " + std::to_string(seed) + ")";
  return row;
}

}  // namespace

std::vector<std::string> case_names(const std::string& op) {
  std::vector<std::string> out;
  for (const auto& c : Registry::global().get(op).cases) out.push_back(c.name);
  return out;
}

std::vector<Config> configs_for_case(const std::string& op_name, const std::string& case_name, DType dtype,
                                     const std::string& arch) {
  const OpDef& op = Registry::global().get(op_name);
  for (const auto& cs : op.cases)
    if (cs.name == case_name) return op.tuning.enumerate(problem_for_case(op, cs, dtype, arch));
  throw InvalidArgument(detail::concat(op_name, ": no case named '", case_name, "'"));
}

std::vector<CheckRow> check_op(const std::string& op_name, const CheckOptions& o) {
  const OpDef& op = Registry::global().get(op_name);
  std::vector<CheckRow> rows;
  if (!op.generic_check) return rows;  // tested by its own suite (e.g. TensorList inputs)
  std::random_device rd;
  uint64_t seed = o.seed ? o.seed : (static_cast<uint64_t>(rd()) << 32 | rd());
  bool found = o.case_name.empty();
  for (const auto& cs : op.cases) {
    if (!o.case_name.empty() && cs.name != o.case_name) continue;
    found = true;
    if (cs.large && !o.include_large && o.case_name.empty()) continue;
    for (DType dt : o.dtypes.empty() ? op.dtypes : o.dtypes) rows.push_back(check_one(op, cs, dt, o, seed++));
  }
  KSPEC_CHECK(found, op_name, ": no case named '", o.case_name, "'");
  return rows;
}

}  // namespace kspec
