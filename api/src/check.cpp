// GPU-vs-float64-reference checks, generic over every registered op (inputs drawn from the schema
// and the case table, outputs compared per tensor).
#include "kspec/check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <random>
#include <sstream>
#include <system_error>
#include <thread>

#include "api/src/device_data.h"
#include "api/src/kernels.h"
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

// One (case, dtype) under one or more configs: the inputs drawn once, each config run on them (inputs
// uploaded again and outputs poisoned before every call) and its outputs kept as raw bytes; then the
// float64 reference, computed once, against every config's outputs (compare_with_reference).
struct CaseRun {
  const OpDef* op = nullptr;
  Problem p;
  std::vector<HostTensor> host_in;
  std::vector<CheckRow> rows;                                 // one per config, in order
  std::vector<std::vector<std::vector<unsigned char>>> outs;  // [row][output]: raw bytes as the GPU wrote them

  size_t host_bytes() const {
    size_t n = 0;
    for (const auto& t : host_in) n += t.data.size() * sizeof(double);
    for (const auto& row : outs)
      for (const auto& o : row) n += o.size() * (sizeof(double) + 1);  // bytes + decoded doubles: a bound
    return n;
  }
};

// Compiles (or finds in the cache) the kernels of every config of a call, in parallel: NVRTC is
// thread-safe and the cache locks per key. The configs of cases `precompile --all` does not cover for
// every config were compiled one by one by their calls (most of Gpu.EveryTuningConfigMatchesReference's
// 7 minutes on the H100). Errors are left for each config's call to report in its row.
void compile_configs(const OpDef& op, const std::vector<TensorView>& ins, const std::vector<TensorView>& outs,
                     const Params& params, int device, const std::vector<const Config*>& configs) {
  if (!op.kernels || configs.size() < 2) return;
  Problem p;
  try {
    p = validate_call(op, ins, outs, params, nullptr).problem;
    p.arch = device_arch(device);
  } catch (const std::exception&) {
    return;  // the calls report it
  }
  for_each_compile_thread(configs.size(), [&](size_t i) {
    if (!configs[i]) return;
    try {
      for (const auto& spec : op.kernels(p, *configs[i])) obtain_binary(spec);
    } catch (const std::exception&) {  // the call reports it
    }
  });
}

CaseRun run_on_gpu(const OpDef& op, const Case& cs, DType dtype, const CheckOptions& o, uint64_t seed) {
  std::vector<const Config*> configs;
  for (const auto& c : o.configs) configs.push_back(&c);
  if (configs.empty()) configs.push_back(o.config ? &*o.config : nullptr);  // nullptr: the heuristic's
  CheckRow proto;
  proto.op = op.info.name;
  proto.case_name = cs.name;
  proto.dtype = dtype_short(dtype);
  proto.shape = shape_text(cs);
  proto.seed = seed;
  // A case that pins a tensor's dtype (mlstm's chunk 256: q, k, v in bf16 whatever the run's dtype) is
  // held to the looser of the two precisions.
  double tol = tolerance_for(dtype);
  for (const auto& [name, dt] : cs.tensor_dtypes) tol = std::max(tol, tolerance_for(dt));
  if (dtype == DType::f32 && op.f32_tolerance > 0) tol = std::max(tol, op.f32_tolerance);
  proto.tolerance = tol * op.tolerance_scale;
  CaseRun r;
  r.op = &op;
  try {
    jit::ContextGuard guard(o.device);
    r.p = problem_for_case(op, cs, dtype, "sm_90");
    const Problem& p = r.p;
    const auto& ins = op.info.inputs;
    const auto& outs = op.info.outputs;
    r.host_in = random_inputs(op, p, seed);
    std::vector<std::vector<unsigned char>> in_bytes(ins.size());
    std::vector<std::unique_ptr<DeviceBuffer>> in_buf(ins.size()), out_buf(outs.size());
    std::vector<TensorView> in_views(ins.size()), out_views(outs.size());
    for (size_t i = 0; i < ins.size(); ++i) {
      if (!r.host_in[i].defined) continue;
      DType dt = p.inputs[i].dtype;
      quantize(dt, r.host_in[i].data);
      encode(dt, r.host_in[i].data, in_bytes[i]);
      in_buf[i] = std::make_unique<DeviceBuffer>(in_bytes[i].size());
      in_views[i] = view_of(in_buf[i]->ptr, dt, r.host_in[i].shape, o.device);
    }
    std::vector<size_t> out_bytes(outs.size(), 0);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!p.outputs[i].present) continue;
      std::vector<int64_t> shape = shape_of(outs[i], p);
      int64_t n = 1;
      for (auto d : shape) n *= d;
      out_bytes[i] = static_cast<size_t>(n) * dtype_size(p.outputs[i].dtype);
      out_buf[i] = std::make_unique<DeviceBuffer>(out_bytes[i]);
      out_views[i] = view_of(out_buf[i]->ptr, p.outputs[i].dtype, shape, o.device);
    }
    Params params;
    for (const auto& [k, v] : cs.params.items()) params.set(k, v);
    compile_configs(op, in_views, out_views, params, o.device, configs);
    for (const Config* cfg : configs) {
      CheckRow row = proto;
      std::vector<std::vector<unsigned char>> got(outs.size());
      try {
        for (size_t i = 0; i < ins.size(); ++i)
          if (!in_bytes[i].empty()) CU_CHECK(cuMemcpyHtoD(in_buf[i]->ptr, in_bytes[i].data(), in_bytes[i].size()));
        for (size_t i = 0; i < outs.size(); ++i)  // NaN in every float type: unwritten elements show
          if (p.outputs[i].present) CU_CHECK(cuMemsetD8(out_buf[i]->ptr, 0xFF, std::max<size_t>(out_bytes[i], 16)));
        CallOptions copts;
        copts.config = cfg;
        call(op.info.name, in_views, out_views, params, nullptr, copts);
        CU_CHECK(cuCtxSynchronize());
        for (size_t i = 0; i < outs.size(); ++i) {
          if (!p.outputs[i].present) continue;
          got[i].assign(out_bytes[i], 0);
          if (!got[i].empty()) CU_CHECK(cuMemcpyDtoH(got[i].data(), out_buf[i]->ptr, got[i].size()));
        }
        // What the call used: forced, tuned or the heuristic (the same choice dispatch made).
        row.config = choose_config(op, p, cfg, o.device).config.str(op.info);
        row.passed = true;  // until compared with the reference
      } catch (const std::exception& e) {
        row.passed = false;
        row.message = e.what();
        if (cfg) row.config = cfg->str();
      }
      r.rows.push_back(std::move(row));
      r.outs.push_back(std::move(got));
    }
  } catch (const std::exception& e) {  // before any call: every config's row carries it
    r.rows.clear();
    r.outs.clear();
    for (const Config* cfg : configs) {
      CheckRow row = proto;
      row.message = e.what();
      if (cfg) row.config = cfg->str();
      r.rows.push_back(std::move(row));
      r.outs.emplace_back();
    }
  }
  return r;
}

// The reference of r's inputs, every row that ran compared with it; frees r's host data. Runs on a
// worker thread: touches no CUDA and nothing shared but r.
void compare_with_reference(CaseRun& r) noexcept {
  try {
    bool any = false;
    for (const auto& row : r.rows) any = any || row.passed;
    if (any) {
      std::vector<HostTensor> refs = r.op->reference(r.p, r.host_in);
      std::vector<double> scale;
      if (r.op->error_scale) scale = r.op->error_scale(r.p, r.host_in, refs);
      const auto& outs = r.op->info.outputs;
      for (size_t k = 0; k < r.rows.size(); ++k) {
        CheckRow& row = r.rows[k];
        if (!row.passed) continue;  // the call failed: its message says why
        for (size_t i = 0; i < outs.size(); ++i) {
          if (!r.p.outputs[i].present) continue;
          double err = rel_error(decode(r.p.outputs[i].dtype, r.outs[k][i]), refs[i].data);
          if (i < scale.size() && scale[i] > 0) {  // measured against the terms' norm where it is larger
            double ref_norm = 0;
            for (double v : refs[i].data) ref_norm += v * v;
            ref_norm = std::sqrt(ref_norm);
            if (scale[i] > ref_norm) err = ref_norm > 0 ? err * ref_norm / scale[i] : err / scale[i];
          }
          row.errors.emplace_back(outs[i].name, err);
          if (!(err <= row.tolerance)) {
            row.passed = false;
            row.message +=
                outs[i].name + " error " + std::to_string(err) + " > " + std::to_string(row.tolerance) + "; ";
          }
        }
      }
    }
  } catch (const std::exception& e) {
    for (auto& row : r.rows)
      if (row.passed) {
        row.passed = false;
        row.message = std::string("float64 reference: ") + e.what();
      }
  } catch (...) {
    for (auto& row : r.rows)
      if (row.passed) {
        row.passed = false;
        row.message = "float64 reference: unknown exception";
      }
  }
  for (auto& row : r.rows)
    if (!row.passed) row.message += " (seed " + std::to_string(row.seed) + ")";
  r.host_in = {};
  r.outs = {};
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
  std::vector<std::pair<const Case*, DType>> items;
  for (const auto& cs : op.cases) {
    if (!o.case_name.empty() && cs.name != o.case_name) continue;
    found = true;
    if (cs.large && !o.include_large && o.case_name.empty()) continue;
    for (DType dt : o.dtypes.empty() ? op.dtypes : o.dtypes) items.emplace_back(&cs, dt);
  }
  KSPEC_CHECK(found, op_name, ": no case named '", o.case_name, "'");
  // The GPU part runs item by item on this thread; the float64 references (single-threaded, and most of
  // the time of the large cases) run on worker threads meanwhile: at most `workers` at once, and no more
  // host data pending than kPendingBytes (always one).
  constexpr size_t kPendingBytes = size_t(6) << 30;
  const unsigned hw = std::thread::hardware_concurrency();
  const size_t workers = o.threads > 0 ? static_cast<size_t>(o.threads) : std::clamp<size_t>(hw, 1, 16);
  std::vector<CaseRun> runs(items.size());
  std::deque<std::pair<std::future<void>, size_t>> pending;
  size_t pending_bytes = 0;
  auto wait_one = [&] {
    pending.front().first.get();
    pending_bytes -= pending.front().second;
    pending.pop_front();
  };
  for (size_t i = 0; i < items.size(); ++i) {
    runs[i] = run_on_gpu(op, *items[i].first, items[i].second, o, seed + i);
    const size_t bytes = runs[i].host_bytes();
    while (!pending.empty() && (pending.size() >= workers || pending_bytes + bytes > kPendingBytes)) wait_one();
    CaseRun* r = &runs[i];
    try {
      pending.emplace_back(std::async(std::launch::async, [r] { compare_with_reference(*r); }), bytes);
      pending_bytes += bytes;
    } catch (const std::system_error&) {  // no thread to be had: here, then
      compare_with_reference(*r);
    }
  }
  while (!pending.empty()) wait_one();
  for (auto& r : runs)
    for (auto& row : r.rows) rows.push_back(std::move(row));
  return rows;
}

}  // namespace kspec
