/* kspec's ops as XLA custom calls (XLA's typed FFI), for any XLA: jaxlib's (kspec.jax) and EXLA's (Elixir
 * Nx). One execute handler (and one initialize handler) per target, each a thin conversion of XLA buffers
 * and attributes into the same kspec call C++ and Python make. Pure C; link libkspec. The handlers exist when kspec was built with XLA's FFI
 * headers (jax installed at build time); otherwise kspec_xla_register fails with KSPEC_ERROR_UNSUPPORTED
 * and kspec_xla_handler returns NULL. The target table is always there. */
#ifndef KSPEC_KSPEC_XLA_H_
#define KSPEC_KSPEC_XLA_H_

#include "kspec/kspec_c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct XLA_FFI_Api XLA_FFI_Api; /* xla/ffi/api/c_api.h */

/* 1 when the handlers were compiled in, 0 otherwise. */
int kspec_xla_available(void);

/* Registers every target's handler with `api` for `platform` ("CUDA" for jaxlib's and EXLA's GPU client).
 * Call once per process, before compiling a computation that uses the targets. */
kspec_status kspec_xla_register(const XLA_FFI_Api* api, const char* platform);

/* The handler of one target (an XLA_FFI_Handler*: what jax.ffi.register_ffi_target wraps in a capsule),
 * or NULL for an unknown target or a build without the handlers. */
void* kspec_xla_handler(const char* target);

/* The same target's initialize-stage handler: run by XLA before an execution (and before a command
 * buffer records one), it validates the call and compiles and loads its kernels without launching, so
 * the execute handler never compiles. kspec_xla_register registers both; a framework that takes
 * per-stage handlers (jax.ffi.register_ffi_target with {"initialize": ..., "execute": ...}) wants both.
 * NULL as kspec_xla_handler. */
void* kspec_xla_initialize_handler(const char* target);

/* The table of targets as JSON: for each, its name, the op it calls, its operands and results (the op's
 * inputs and outputs) and its attributes with their types; generated from the op registry. Static storage. */
const char* kspec_xla_targets_json(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KSPEC_KSPEC_XLA_H_ */
