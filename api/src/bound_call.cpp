// BoundCall: a call validated, planned and bound once (the op's BoundData built), then run many times
// with new runtime params, outputs and stream; its event keeps the op's tables alive until the last run.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

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
  // Runs of one bound call from two threads (Python releases the GIL) take turns: a flag claimed with one
  // exchange and released with a store, where a mutex's lock and unlock were two atomic read-modify-writes
  // and ~50 instructions of a run (~1000 on the mock driver); the rare waiter yields.
  std::atomic<bool> running{false};
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

namespace {

// The error for output i of a run that is not laid out like the bound one (or present where that is absent,
// or the other way round).
[[noreturn]] void output_mismatch(const OpInfo& info, size_t i, const TensorView& want, const TensorView& got) {
  const std::string& name = info.outputs[i].name;
  KSPEC_CHECK(want.defined() == got.defined(), info.name, ": output '", name, "' ",
              want.defined() ? "is required (the call was bound with it)" : "must be None (the call was bound without it)");
  throw InvalidArgument(detail::concat(info.name, ": output '", name, "': expected a tensor laid out like the bound one (",
                                       want.describe(), "), got ", got.describe()));
}

class Turn {
 public:
  explicit Turn(std::atomic<bool>& running) : running_(running) {
    while (running_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  }
  ~Turn() { running_.store(false, std::memory_order_release); }
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  std::atomic<bool>& running_;
};

}  // namespace

void BoundCall::run(const Params& runtime_params, const std::vector<TensorView>& outputs, Stream stream) {
  Impl& b = *impl_;
  Turn turn(b.running);
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
  // One pass: each output checked against the bound one, and its address taken into run_call (laid out like
  // the bound output: only the address is new, not the 152-byte view). A failed check throws from
  // output_mismatch with the message it names; run_call's addresses are every run's own anyway.
  const size_t n = outputs.size();
  const TensorView* given = outputs.data();
  const TensorView* bound = b.call.outputs.data();
  TensorView* run_outputs = c.outputs.data();
  bool moved = false;
  for (size_t i = 0; i < n; ++i) {
    const TensorView &want = bound[i], &got = given[i];
    bool same = got.rank == want.rank;  // so defined() alike: outputs are never lists
    if (same && got.rank >= 0) {
      same = got.dtype == want.dtype && got.device == want.device && pointer_alignment(got.data) >= b.out_align[i] &&
             (got.data || got.numel() == 0);
      for (int d = 0; same && d < got.rank; ++d) same = got.shape[d] == want.shape[d] && got.strides[d] == want.strides[d];
    }
    if (!same) output_mismatch(info, i, want, got);
    moved = moved || got.data != want.data;
    run_outputs[i].data = got.data;
  }
  // Outputs laid out like the bound ones at the same addresses were checked by the bind (~10 us at
  // AdamW's 1000 tensors, spent only when an output moved).
  if (moved) check_no_overlap(info, b.call.inputs, outputs);
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
