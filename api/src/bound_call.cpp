// BoundCall: a call validated, planned and bound once (the op's BoundData built), then run many times
// with new runtime params, outputs and stream; its event keeps the op's tables alive until the last run.
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "api/src/plan.h"
#include "jit/driver.h"
#include "jit/handles.h"

namespace kspec {

struct BoundCall::Impl {
  const OpDef* op = nullptr;
  std::vector<std::vector<TensorView>> lists;  // the list inputs' items, owned here
  Call call;                                   // validated once, with the bound outputs
  std::vector<int> out_align;                  // the bound outputs' pointer alignment (pointer_alignment)
  // What run() launches: a copy of `call` made once, whose outputs, stream and (for a run with runtime
  // params) params are replaced in place, so that a plain run copies no Problem and allocates nothing.
  Call run_call;
  bool run_params_changed = false;             // run_call's params are a runtime-param run's
  std::mutex run_mu;  // runs of one bound call from two threads (Python releases the GIL) take turns
  PlanEntry* plan = nullptr;                   // plans are never freed (see plan_for)
  Config config;
  std::string config_text;
  std::unique_ptr<BoundData> data;
  // With `data` only: recorded after each run outside graph capture; the destructor waits for it.
  jit::OwnedEvent done;
  bool recorded = false;
  int64_t runs = 0;
};

BoundCall::BoundCall(std::string_view op_name, const std::vector<TensorView>& inputs,
                     const std::vector<TensorView>& outputs, const Params& params)
    : impl_(std::make_unique<Impl>()) {
  Impl& b = *impl_;
  b.op = &Registry::global().get(op_name);
  std::vector<TensorView> ins = inputs;
  b.lists.reserve(ins.size());
  for (auto& t : ins) {
    if (!t.is_list()) continue;
    b.lists.emplace_back();
    for (int64_t i = 0; i < t.list_size(); ++i) b.lists.back().push_back(t.item(i));
    t = TensorView::list(b.lists.back().data(), t.list_size());
  }
  b.call = validate_call(*b.op, ins, outputs, params, nullptr);
  b.call.problem.arch = device_arch(b.call.device);
  b.plan = &plan_for(*b.op, b.call.problem, b.call.device, nullptr, nullptr);
  b.config = b.plan->config;
  b.config_text = b.config.str(b.op->info);
  jit::ContextGuard guard(b.call.device);
  if (b.op->bind) b.data = b.op->bind(b.call, b.config);
  b.call.bound = b.data.get();
  b.run_call = b.call;
  for (const auto& t : b.call.outputs) b.out_align.push_back(pointer_alignment(t.data));
  if (b.data) CU_CHECK(cuEventCreate(b.done.out(), CU_EVENT_DISABLE_TIMING));
}

BoundCall::~BoundCall() {
  if (!impl_) return;
  // Its kernels may still read the op's tables (device memory freed with `data`).
  if (impl_->recorded) jit::driver().cuEventSynchronize(impl_->done.get());
}

const std::string& BoundCall::config() const { return impl_->config_text; }
int64_t BoundCall::runs() const { return impl_->runs; }

bool BoundCall::idle() const {
  return !impl_->recorded || jit::driver().cuEventQuery(impl_->done.get()) != CUDA_ERROR_NOT_READY;
}

void BoundCall::run(const Params& runtime_params, const std::vector<TensorView>& outputs, Stream stream) {
  Impl& b = *impl_;
  std::lock_guard<std::mutex> lock(b.run_mu);
  const OpInfo& info = b.op->info;
  Call& c = b.run_call;
  if (!runtime_params.items().empty()) {
    Params merged = b.call.problem.params;
    for (const auto& [name, v] : runtime_params.items()) {
      auto d = std::find_if(info.params.begin(), info.params.end(), [&](const ParamDef& p) { return p.name == name; });
      KSPEC_CHECK(d != info.params.end(), info.name, ": unknown parameter '", name, "'");
      KSPEC_CHECK(d->runtime, info.name, ": parameter '", name,
                  "' is compiled into the bound call; bind the call again to change it");
      merged.set(name, v);
    }
    c.problem.params = complete_params(*b.op, merged);
    b.run_params_changed = true;
  } else if (b.run_params_changed) {
    c.problem.params = b.call.problem.params;
    b.run_params_changed = false;
  }
  KSPEC_CHECK(outputs.size() == b.call.outputs.size(), info.name, ": expected ", b.call.outputs.size(),
              " outputs, got ", outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const TensorView &want = b.call.outputs[i], &got = outputs[i];
    const std::string& name = info.outputs[i].name;
    KSPEC_CHECK(want.defined() == got.defined(), info.name, ": output '", name, "' ",
                want.defined() ? "is required (the call was bound with it)" : "must be None (the call was bound without it)");
    if (!got.defined()) continue;
    bool same = got.dtype == want.dtype && got.rank == want.rank && got.device == want.device &&
                pointer_alignment(got.data) >= b.out_align[i] && (got.data || got.numel() == 0);
    for (int d = 0; same && d < got.rank; ++d) same = got.shape[d] == want.shape[d] && got.strides[d] == want.strides[d];
    KSPEC_CHECK(same, info.name, ": output '", name, "': expected a tensor laid out like the bound one (", want.describe(),
                "), got ", got.describe());
  }
  // Outputs laid out like the bound ones at the same addresses were checked by the bind (~10 us at
  // AdamW's 1000 tensors, spent only when an output moved).
  bool moved = false;
  for (size_t i = 0; i < outputs.size(); ++i) moved = moved || outputs[i].data != b.call.outputs[i].data;
  if (moved) check_no_overlap(info, b.call.inputs, outputs);
  // Laid out like the bound outputs (checked above): only their addresses are new, not the 152-byte views.
  for (size_t i = 0; i < outputs.size(); ++i) c.outputs[i].data = outputs[i].data;
  c.stream = stream;
  if (b.op->check_call) b.op->check_call(c);  // the runtime params' rules
  jit::ContextGuard guard(c.device);
  DeviceLauncher launcher(*b.plan, c.device, stream);
  b.op->launch(c, b.config, launcher);
  launcher.finish();
  ++b.runs;
  // Only the op's tables (device memory its kernels read, freed with `data`) need the destructor to wait for
  // the last run; a bound call without them skips the capture query and the event record, two driver calls
  // that would cost more host time than the rest of a run.
  if (!b.data) return;
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  CU_CHECK(cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &capture));
  if (capture == CU_STREAM_CAPTURE_STATUS_NONE) {
    CU_CHECK(cuEventRecord(b.done.get(), reinterpret_cast<CUstream>(stream)));
    b.recorded = true;
  }
}

}  // namespace kspec
