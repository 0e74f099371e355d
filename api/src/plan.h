// The plan cache and the launcher shared by kspec::call (plan.cpp), BoundCall (bound_call.cpp) and the
// compile requests (requests.cpp): a problem's config and loaded kernels per device, and the Launcher
// that runs them on a stream.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "api/src/kernels.h"
#include "api/src/op.h"

namespace kspec {

struct PlanEntry {
  Config config;
  std::vector<LoadedKernel*> kernels;
  uint64_t generation = 0;
  bool bucketed = false;  // a marker: the plan depends on the shape bucket (see plan_for)
};

// A library op (no kernels function) compiles nothing.
std::vector<jit::KernelSpec> kernel_specs(const OpDef& op, const Problem& p, const Config& c);

// The plan of a problem on a device, cached by signature (and, when the tuning database has entries
// for that signature, by shape bucket too: the tuned config may differ between buckets). A plan built
// before this process last wrote the database is rebuilt once. Plans are never freed: launches and
// bound calls may still hold them.
PlanEntry& plan_for(const OpDef& op, const Problem& p, int device, const Config* forced, Stream stream);

// A read-only run of views read in place: a vector's, or the initializer list a call was written with.
class ViewList {
 public:
  ViewList() = default;
  ViewList(const std::vector<TensorView>& v) : data_(v.data()), size_(v.size()) {}  // NOLINT: implicit
  ViewList(const TensorView* data, size_t size) : data_(data), size_(size) {}
  size_t size() const { return size_; }
  const TensorView* begin() const { return data_; }
  const TensorView* end() const { return data_ + size_; }
  const TensorView& operator[](size_t i) const { return data_[i]; }
  std::vector<TensorView> to_vector() const { return {begin(), end()}; }

 private:
  const TensorView* data_ = nullptr;
  size_t size_ = 0;
};

// A call key being written: grown as needed and never zero-filled first (a std::string's resize writes
// every byte before the key does, ~100 instructions of a cache hit's ~2400 on the mock driver).
class CallKey {
 public:
  void clear() { size_ = 0; }
  // Room for n more bytes at the end: where they go.
  char* extend(size_t n);
  // Gives back the last n bytes of an extend() that wrote fewer (an upper bound asked first).
  void shrink(size_t n) { size_ -= n; }
  std::string_view view() const { return {data_.get(), size_}; }
  // A hash of the key's bytes, 8 at a time (a multiply and a shift each): the call cache's table index.
  uint64_t hash() const;

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0, capacity_ = 0;
};

// The compact signature of a call for the call cache: the op, every view's presence, dtype, rank, shape,
// strides, device and pointer alignment (the largest power of two up to 16 dividing it), and the params as
// given. Everything validation reads but the pointers themselves, so two calls with one signature pass or
// fail validation alike except for what depends on the pointers (null, overlap, the op's check_call).
// False (nothing appended) for a call the cache does not take: a TensorList argument.
bool append_call_key(CallKey& key, const OpDef& op, ViewList inputs, ViewList outputs, const Params& params);

// Whether `given` has the signature (append_call_key's fields: all but the addresses, and those's
// alignment) of `last`, the views of a call with as many (`last` may have more: absent padding).
bool same_views(const std::vector<TensorView>& last, ViewList given);
// Params equal as the key compares them: names, order, types, and values bit for bit (-0.0 is not 0.0).
bool same_params(const Params& last, const Params& given);

// Whether n bytes at a and b are equal, compared in place 8 at a time: the names and choices a call's params
// are compared by are a few bytes long, and libc's memcmp behind std::string's == cost ~25 instructions a
// call, five per norm_act call.
inline bool same_bytes(const char* a, const char* b, size_t n) {
  for (; n >= 8; n -= 8, a += 8, b += 8) {
    uint64_t x, y;
    std::memcpy(&x, a, 8);
    std::memcpy(&y, b, 8);
    if (x != y) return false;
  }
  for (; n > 0; --n)
    if (*a++ != *b++) return false;
  return true;
}
inline bool same_string(std::string_view a, std::string_view b) {
  return a.size() == b.size() && same_bytes(a.data(), b.data(), a.size());
}

// The largest power of two up to 16 dividing p's address (16 for null): its lowest set bit, without the
// divisions a loop of `% al` costs (~25 cycles each, up to four per view of a call key).
inline int pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) | 16;
  return static_cast<int>(a & (~a + 1));
}

// What kspec::call does before its launches, without them: validation, the plan, its kernels compiled (or
// read from the disk cache) and loaded on the tensors' device — for a caller that must not compile later
// (an XLA handler's initialize stage, run before a command buffer may capture the execution). The buffers'
// contents are not read. A call already prepared (append_call_key's signature) returns at once.
void prepare_call(std::string_view op, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
                  const Params& params);

class DeviceLauncher final : public Launcher {
 public:
  DeviceLauncher(PlanEntry& plan, int device, Stream stream) : plan_(plan), device_(device), stream_(stream) {}
  // An op that threw mid-capture: its graph-owned workspace is freed on the stream all the same (the capture
  // is broken anyway; nothing to report from a destructor). Inline, as finish(): outside capture (every
  // eager call) there is nothing to free, and the two out-of-line calls were ~45 of a hit's instructions.
  ~DeviceLauncher() override {
    if (!graph_owned_.empty()) free_graph_owned(false);
  }
  DeviceLauncher(const DeviceLauncher&) = delete;
  DeviceLauncher& operator=(const DeviceLauncher&) = delete;

  // After the op's launches: a captured call's workspace is freed in the graph, behind its kernels.
  void finish() {
    if (!graph_owned_.empty()) free_graph_owned(true);
  }

  void launch(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) override;
  void launch_clusters(size_t k, Dim3 grid, Dim3 block, Dim3 cluster, unsigned shared_bytes, void** args) override;
  void launch_dependent(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) override;
  // See plan.cpp for who shares a workspace and who does not (eager calls vs. graph capture).
  void* workspace(size_t bytes) override;
  int multiprocessors() const override;
  int occupancy(size_t k, unsigned block_threads, unsigned shared_bytes) override;

 private:
  // cuLaunchKernelEx with one attribute (`what` describes it in the error). By value: CUlaunchConfig points
  // at a mutable attribute.
  void launch_ex(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args, CUlaunchAttribute attr,
                 const std::string& what);
  // The plan's kernel k with room for shared_bytes of dynamic shared memory; null when the grid is
  // empty (nothing to do, e.g. zero rows).
  LoadedKernel* prepare(size_t k, Dim3 grid, unsigned shared_bytes);
  // cuMemFreeAsync of graph_owned_ on the stream; `check`: a failure throws (finish), else is ignored.
  void free_graph_owned(bool check);

  PlanEntry& plan_;
  int device_;
  Stream stream_;
  std::vector<CUdeviceptr> graph_owned_;  // this call's workspace(s) inside a capture
  size_t graph_bytes_ = 0;                // the size of graph_owned_.back()
};

}  // namespace kspec
