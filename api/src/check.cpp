// GPU-vs-float64-reference checks, generic over every registered op (inputs drawn from the schema
// and the case table, outputs compared per tensor).
#include "kspec/check.h"

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "api/src/tuning.h"
#include "jit/driver.h"

namespace kspec {
namespace {

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
    const auto& ins = op.info.inputs;
    const auto& outs = op.info.outputs;
    std::vector<HostTensor> host_in = random_inputs(op, p, seed);
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
    // What the call used: forced, tuned or the heuristic (the same choice dispatch made).
    row.config = choose_config(op, p, o.config ? &*o.config : nullptr, o.device).config.str();
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
