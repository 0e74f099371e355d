// kspec._C's side of the C ABI for the torch extension (python/src/ext_api.h): the registry's
// infer_outputs and call behind plain structs, errors kept per thread and raised as _C raises them.
#include "python/src/ext_api.h"

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "api/src/call_cached.h"
#include "kspec/kspec.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace kspec_py {
namespace {

thread_local std::exception_ptr g_error;

// What one C ABI call hands kspec, kept per thread so that a repeated call allocates nothing: the views
// and params refilled in place (kspec::call and infer_outputs take vectors). `busy` while in use: a call
// that re-enters on this thread (a Python log handler calling kspec) gets its own.
struct Scratch {
  std::vector<kspec::TensorView> in, out;
  kspec::Params params;
  std::vector<kspec::OutputSpec> specs;
  bool busy = false;
};

class ScratchLease {
 public:
  ScratchLease() : s_(t_scratch.busy ? own_ : t_scratch) { s_.busy = true; }
  ~ScratchLease() { s_.busy = false; }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  Scratch* operator->() { return &s_; }

 private:
  static thread_local Scratch t_scratch;
  Scratch own_;
  Scratch& s_;
};
thread_local Scratch ScratchLease::t_scratch;

void fill_params(const kspec_ext::Param* p, int n, kspec::Params* out) {
  out->clear();
  out->reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    switch (p[i].kind) {
      case kspec_ext::kInt: out->set(p[i].name, p[i].i); break;
      case kspec_ext::kFloat: out->set(p[i].name, p[i].f); break;
      case kspec_ext::kBool: out->set(p[i].name, p[i].i != 0); break;
      default: out->set(p[i].name, std::string(p[i].s)); break;
    }
  }
}

int infer_outputs(const char* op, const kspec::TensorView* in, int n_in, const kspec_ext::Param* params,
                  int n_params, kspec_ext::Output* out, int capacity, int* n_out) {
  try {
    ScratchLease s;
    s->in.assign(in, in + n_in);
    fill_params(params, n_params, &s->params);
    kspec::infer_outputs(op, s->in, s->params, &s->specs);
    const auto& specs = s->specs;
    if (static_cast<int>(specs.size()) > capacity)
      throw kspec::InternalError(std::string(op) + ": more outputs than the torch extension takes");
    for (size_t i = 0; i < specs.size(); ++i) {
      out[i].present = specs[i].present;
      out[i].dtype = static_cast<int>(specs[i].dtype);
      out[i].rank = static_cast<int>(specs[i].shape.size());
      for (size_t d = 0; d < specs[i].shape.size(); ++d) out[i].shape[d] = specs[i].shape[d];
    }
    *n_out = static_cast<int>(specs.size());
    return 0;
  } catch (...) {
    g_error = std::current_exception();
    return -1;
  }
}

// call and call_cached: 0 done, 1 not cached (call_cached only), -1 raised (kept).
int call_with(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
              const kspec_ext::Param* params, int n_params, void* stream, bool cached_only) {
  try {
    ScratchLease s;
    s->in.assign(in, in + n_in);
    s->out.assign(out, out + n_out);
    fill_params(params, n_params, &s->params);
    const auto st = static_cast<kspec::Stream>(stream);
    if (cached_only) return kspec::call_cached(op, s->in, s->out, s->params, st) ? 0 : 1;
    kspec::call(op, s->in, s->out, s->params, st);
    return 0;
  } catch (...) {
    g_error = std::current_exception();
    return -1;
  }
}

int call(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
         const kspec_ext::Param* params, int n_params, void* stream) {
  return call_with(op, in, n_in, out, n_out, params, n_params, stream, false);
}

int call_cached(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
                const kspec_ext::Param* params, int n_params, void* stream) {
  return call_with(op, in, n_in, out, n_out, params, n_params, stream, true);
}

void raise_error() {
  try {
    std::exception_ptr e = std::exchange(g_error, nullptr);
    if (!e) throw kspec::InternalError("the torch extension raised a kspec error that was not kept");
    std::rethrow_exception(e);
  } catch (...) {
    py::detail::try_translate_exceptions();  // _C's registered translators: the exception _C raises
  }
}

const kspec_ext::Api kApi = {kspec_ext::kApiVersion, &infer_outputs, &call, &call_cached, &raise_error};

}  // namespace

py::capsule ext_api_capsule() {
  return py::capsule(const_cast<kspec_ext::Api*>(&kApi), "kspec._C._ext_api");
}

}  // namespace kspec_py
