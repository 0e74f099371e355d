// The C ABI kspec._C offers the optional torch extension (kspec._torch_ext, python/src/torch_ext/): plain
// structs and function pointers, handed over in a PyCapsule ("kspec._C._ext_api"). The two modules are
// built against different C++ runtimes (_C links a private libstdc++, the extension torch's), so nothing
// of the standard library crosses; the extension reaches the one registry, call cache and module cache
// that kspec._C holds instead of linking a second copy of kspec.
#pragma once

#include <cstdint>

#include "kspec/tensor.h"

namespace kspec_ext {

constexpr int kApiVersion = 2;
constexpr int kMaxOutputs = 16;

enum ParamKind : int { kInt = 0, kFloat = 1, kBool = 2, kStr = 3 };

struct Param {
  const char* name;
  int kind;  // ParamKind
  int64_t i;
  double f;
  const char* s;
};

struct Output {
  int present;
  int dtype;  // kspec::DType
  int rank;
  int64_t shape[kspec::kMaxRank];
};

struct Api {
  int version;  // kApiVersion
  // Each returns 0 when done, -1 when kspec raised: the error is kept (per thread) until raise_error.
  // Neither needs the GIL.
  int (*infer_outputs)(const char* op, const kspec::TensorView* in, int n_in, const Param* params, int n_params,
                       Output* out, int capacity, int* n_out);
  int (*call)(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
              const Param* params, int n_params, void* stream);
  // call, done only where kspec has the call cached (kspec::call_cached): 1, nothing done, where it has not.
  // Such a call compiles nothing and takes no lock: the extension runs it with the GIL held, as torch's own
  // launches run, and releases the GIL only for the rest.
  int (*call_cached)(const char* op, const kspec::TensorView* in, int n_in, const kspec::TensorView* out, int n_out,
                     const Param* params, int n_params, void* stream);
  // With the GIL held: sets the kept error as the Python exception kspec._C raises for it (same type,
  // message and attributes).
  void (*raise_error)();
};

}  // namespace kspec_ext
