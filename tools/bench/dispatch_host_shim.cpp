// For tools/bench/dispatch_host.py (no GPU): kspec._C's C ABI for the torch extension (python/src/ext_api.h)
// with every tensor view moved to device 0, so that torch's CPU tensors reach kspec::call as device memory of
// the mock driver (tests/mock_cuda, KSPEC_LIBCUDA) and the whole host path of the extension runs: at::Tensor
// reads, at::empty, the registry's infer_outputs, validation, the call cache and a launch that only counts.
#include <cstdint>

#include "python/src/ext_api.h"

namespace {

const kspec_ext::Api* g_real = nullptr;
constexpr int kMaxViews = 32;

// Copies views into `out` with host tensors (kCpuDevice) on device 0; false when there are too many.
bool on_device(const kspec::TensorView* in, int n, kspec::TensorView* out) {
  if (n > kMaxViews) return false;
  for (int i = 0; i < n; ++i) {
    out[i] = in[i];
    if (out[i].device == kspec::kCpuDevice) out[i].device = 0;
  }
  return true;
}

int infer_outputs(const char* op, const kspec::TensorView* in, int n_in, const kspec_ext::Param* params, int n_params,
                  kspec_ext::Output* out, int capacity, int* n_out) {
  kspec::TensorView v[kMaxViews];
  if (!on_device(in, n_in, v)) return g_real->infer_outputs(op, in, n_in, params, n_params, out, capacity, n_out);
  return g_real->infer_outputs(op, v, n_in, params, n_params, out, capacity, n_out);
}

int call(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
         const kspec_ext::Param* params, int n_params, void* stream) {
  kspec::TensorView vi[kMaxViews], vo[kMaxViews];
  if (!on_device(in, n_in, vi) || !on_device(out, n_out, vo))
    return g_real->call(op, in, n_in, out, n_out, params, n_params, stream);
  return g_real->call(op, vi, n_in, vo, n_out, params, n_params, stream);
}

void raise_error() { g_real->raise_error(); }

kspec_ext::Api g_shim = {kspec_ext::kApiVersion, &infer_outputs, &call, &raise_error};

}  // namespace

// The shim's Api over `real` (kspec._C._ext_api's pointer).
extern "C" __attribute__((visibility("default"))) const void* kspec_ext_shim(const void* real) {
  g_real = static_cast<const kspec_ext::Api*>(real);
  return &g_shim;
}
