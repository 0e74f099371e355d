// The XLA entry points of a kspec built without XLA's FFI headers (no jax at build time): present, so the
// C ABI is one whatever the build, and saying why they cannot serve.
#include "api/src/c_abi.h"
#include "kspec/kspec_xla.h"

extern "C" {

int kspec_xla_available(void) { return 0; }

void* kspec_xla_handler(const char*) { return nullptr; }

void* kspec_xla_initialize_handler(const char*) { return nullptr; }

kspec_status kspec_xla_register(const XLA_FFI_Api*, const char*) {
  return kspec::c_abi::set_error(KSPEC_ERROR_UNSUPPORTED,
                                 "kspec_xla_register: kspec was built without XLA's FFI headers (install jax, or "
                                 "pass -DKSPEC_XLA_FFI_INCLUDE=<dir with xla/ffi/api/ffi.h>, and rebuild)");
}

}  // extern "C"
