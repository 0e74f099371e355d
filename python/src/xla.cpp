// kspec._C's XLA part: the handlers as PyCapsules (what jax.ffi.register_ffi_target takes) and the target
// table. The handlers live in the same module as the rest of kspec, so JAX's calls share its plan cache.
#include <pybind11/pybind11.h>

#include "kspec/kspec_xla.h"
#include "python/src/bindings.h"

namespace kspec_py {

void bind_xla(py::module_& m) {
  m.def("_xla_available", [] { return kspec_xla_available() == 1; });
  m.def("_xla_targets", [] {
    const char* json = kspec_xla_targets_json();
    if (!json) throw kspec::InternalError(kspec_last_error());
    return std::string(json);
  });
  // stage: "execute" or "initialize" (jax.ffi.register_ffi_target's stage names).
  m.def(
      "_xla_handler",
      [](const std::string& target, const std::string& stage) -> py::object {
        if (stage != "execute" && stage != "initialize")
          throw kspec::InvalidArgument("_xla_handler: stage must be \"execute\" or \"initialize\", got \"" + stage +
                                       "\"");
        void* fn =
            stage == "execute" ? kspec_xla_handler(target.c_str()) : kspec_xla_initialize_handler(target.c_str());
        if (!fn) return py::none();
        return py::capsule(fn);  // unnamed, as jax.ffi.pycapsule makes them
      },
      py::arg("target"), py::arg("stage") = "execute");
}

}  // namespace kspec_py
