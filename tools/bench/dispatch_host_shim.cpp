// For tools/bench/dispatch_host.py (no GPU): kspec._C's C ABI for the torch extension (python/src/ext_api.h)
// with every tensor view moved to device 0, so that torch's CPU tensors reach kspec::call as device memory of
// the mock driver (tests/mock_cuda, KSPEC_LIBCUDA) and the whole host path of the extension runs: at::Tensor
// reads, at::empty, the registry's infer_outputs, validation, the call cache and a launch that only counts.
#include <dlfcn.h>

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

// What the extension asked for, for tests: calls run by call_cached (and whether the GIL was held then),
// calls it left to call, and whether the GIL was held in the last call (PyGILState_Check, looked up in the
// process: the shim is built without Python's headers).
long long g_cached = 0, g_not_cached = 0, g_calls = 0;
int g_gil_in_cached = -1, g_gil_in_call = -1;

int gil_held() {
  static auto check = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
  return check ? check() : -1;
}

int call(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
         const kspec_ext::Param* params, int n_params, void* stream) {
  ++g_calls;
  g_gil_in_call = gil_held();
  kspec::TensorView vi[kMaxViews], vo[kMaxViews];
  if (!on_device(in, n_in, vi) || !on_device(out, n_out, vo))
    return g_real->call(op, in, n_in, out, n_out, params, n_params, stream);
  return g_real->call(op, vi, n_in, vo, n_out, params, n_params, stream);
}

int call_cached(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
                const kspec_ext::Param* params, int n_params, void* stream) {
  kspec::TensorView vi[kMaxViews], vo[kMaxViews];
  const bool moved = on_device(in, n_in, vi) && on_device(out, n_out, vo);
  const int rc = moved ? g_real->call_cached(op, vi, n_in, vo, n_out, params, n_params, stream)
                       : g_real->call_cached(op, in, n_in, out, n_out, params, n_params, stream);
  if (rc == 0) {
    ++g_cached;
    g_gil_in_cached = gil_held();
  } else if (rc == 1) {
    ++g_not_cached;
  }
  return rc;
}

void raise_error() { g_real->raise_error(); }

kspec_ext::Api g_shim = {kspec_ext::kApiVersion, &infer_outputs, &call, &call_cached, &raise_error};

}  // namespace

// [calls run by call_cached, calls it declined, calls run by call, GIL held in the last cached one, in the
// last call] (-1: unknown).
extern "C" __attribute__((visibility("default"))) void kspec_ext_shim_counts(long long* out) {
  out[0] = g_cached;
  out[1] = g_not_cached;
  out[2] = g_calls;
  out[3] = g_gil_in_cached;
  out[4] = g_gil_in_call;
}

// The shim's Api over `real` (kspec._C._ext_api's pointer).
extern "C" __attribute__((visibility("default"))) const void* kspec_ext_shim(const void* real) {
  g_real = static_cast<const kspec_ext::Api*>(real);
  return &g_shim;
}
