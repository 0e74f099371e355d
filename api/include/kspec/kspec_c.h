/* kspec's stable C ABI: for NIFs (Rust, C, Erlang), Julia, Zig and any language with a C FFI. Every call
 * goes through the same registry as C++ (kspec::call: validation, plan cache, tuning database); no C++
 * exception crosses it: a failing function returns a status and leaves a message for its thread in
 * kspec_last_error(). Pure C (C99); link libkspec (find_package(kspec) -> kspec::kspec).
 *
 * Versioning: KSPEC_C_ABI_VERSION grows only by additions (new functions, new enum values); a struct or a
 * signature never changes meaning within one major. Compare kspec_c_version() with the header's value. */
#ifndef KSPEC_KSPEC_C_H_
#define KSPEC_KSPEC_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KSPEC_C_ABI_VERSION 1

/* One status per class of kspec::Error (Python: kspec.InvalidArgument, ...). */
typedef enum kspec_status {
  KSPEC_OK = 0,
  KSPEC_ERROR_INVALID_ARGUMENT = 1, /* an argument the op's schema does not accept (named in the message) */
  KSPEC_ERROR_UNSUPPORTED = 2,      /* well-formed, but this build, device or op cannot serve it */
  KSPEC_ERROR_COMPILE = 3,          /* NVRTC rejected a specialization (the log is in the message) */
  KSPEC_ERROR_CUDA = 4,             /* a CUDA driver or library call failed (also: no driver, no GPU) */
  KSPEC_ERROR_CACHE = 5,            /* an explicit cache operation failed */
  KSPEC_ERROR_INTERNAL = 6,         /* a broken invariant of kspec's own: a bug to report */
  KSPEC_ERROR_UNKNOWN = 7           /* any other failure (out of host memory, ...) */
} kspec_status;

/* Element types, numbered as kspec::DType. */
typedef enum kspec_dtype {
  KSPEC_F32 = 0,
  KSPEC_F16 = 1,
  KSPEC_BF16 = 2,
  KSPEC_F64 = 3,
  KSPEC_I32 = 4,
  KSPEC_I64 = 5,
  KSPEC_U8 = 6
} kspec_dtype;

#define KSPEC_MAX_RANK 8
#define KSPEC_ABSENT (-1) /* rank of an optional tensor left out */
#define KSPEC_LIST (-2)   /* rank of a list of tensors (adamw's params, grads, ...) */
#define KSPEC_HOST (-1)   /* device of host memory (refused by every op: kspec runs on the GPU) */

/* A non-owning view of a tensor in device memory.
 *   rank >= 0:      data, dtype, shape[rank]; strides[rank] in elements, or NULL for row-major contiguous;
 *                   device: the CUDA device ordinal owning data.
 *   KSPEC_ABSENT:   an optional argument left out (the other fields are ignored).
 *   KSPEC_LIST:     data points to `count` kspec_tensor items (each rank >= 0), e.g. adamw's `params`. */
typedef struct kspec_tensor {
  void* data;
  int32_t dtype; /* kspec_dtype */
  int32_t rank;
  const int64_t* shape;
  const int64_t* strides;
  int32_t device;
  int64_t count; /* KSPEC_LIST only */
} kspec_tensor;

/* The value of KSPEC_C_ABI_VERSION the library was built with. */
int kspec_c_version(void);
/* kspec's own version ("0.1.0"); static storage. */
const char* kspec_version_string(void);

/* Every registered op, one name per line ("adamw\ne79.bwd\n..."); static storage, never NULL. */
const char* kspec_list_ops(void);

/* The op's schema as a JSON object: name, family, doc, inputs and outputs (name, shape, dtypes, optional,
 * present_with, in_place_of, list), params (name, type, default, choices, min, max, runtime), dims,
 * constants, tolerances (by dtype). The string stays valid until this thread's next kspec_op_info_json
 * call. NULL on error (an unknown op: KSPEC_ERROR_INVALID_ARGUMENT; see kspec_last_error()). */
const char* kspec_op_info_json(const char* op);

/* Calls `op` on `stream` (a CUstream / cudaStream_t; NULL: the legacy default stream). inputs and outputs
 * are positional as in the op's schema (kspec_op_info_json), n_inputs and n_outputs their counts (trailing
 * optionals may be omitted). params_json: NULL, "" or a JSON object of the op's params by name, e.g.
 * {"norm": "rmsnorm", "act": "silu", "eps": 1e-5}; an integer is accepted for a float param, true/false
 * for a bool, a string for a choice. Like kspec::call it validates every argument before launching,
 * compiles a missing specialization (NVRTC, then the disk cache) and launches asynchronously. */
kspec_status kspec_call(const char* op, const kspec_tensor* inputs, size_t n_inputs, const kspec_tensor* outputs,
                        size_t n_outputs, const char* params_json, void* stream);

/* The message and status of this thread's last failed kspec_* call ("" and KSPEC_OK if none). A
 * successful call does not clear them. The string stays valid until this thread's next failing call. */
const char* kspec_last_error(void);
kspec_status kspec_last_error_code(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KSPEC_KSPEC_C_H_ */
