/* The C ABI from C (compiled as C99, linked against libkspec): version, list, op info, and every error
 * path that needs no GPU. Run by ctest; on a machine with a GPU the last check calls for real. */
#include <kspec/kspec_c.h>

#include "check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A failing call: its status and a message containing `needle`. */
static void expect_error(kspec_status got, kspec_status want, const char* needle, const char* what) {
  EXPECT(got == want, "%s: status %d, expected %d (%s)", what, (int)got, (int)want, kspec_last_error());
  EXPECT(kspec_last_error_code() == want, "%s: last error code %d", what, (int)kspec_last_error_code());
  EXPECT(strstr(kspec_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what, kspec_last_error(), needle);
  printf("  %-28s -> %d: %.110s\n", what, (int)got, kspec_last_error());
}

int main(void) {
  EXPECT(kspec_c_version() == KSPEC_C_ABI_VERSION, "library %d, header %d", kspec_c_version(), KSPEC_C_ABI_VERSION);
  printf("kspec %s, C ABI %d\n", kspec_version_string(), kspec_c_version());
  EXPECT(kspec_last_error_code() == KSPEC_OK && kspec_last_error()[0] == '\0', "fresh thread has an error");

  const char* ops = kspec_list_ops();
  EXPECT(strstr(ops, "norm_act.fwd\n") && strstr(ops, "selective_scan.bwd\n") && strstr(ops, "adamw\n"),
         "list: %s", ops);

  const char* info = kspec_op_info_json("norm_act.fwd");
  EXPECT(info && strstr(info, "\"name\":\"norm_act.fwd\"") && strstr(info, "\"hidden\"") &&
             strstr(info, "\"tolerances\""), "info: %s", info ? info : "(null)");

  /* Error paths: unknown op, NULL op, NULL arrays, bad dtype code, bad rank, wrong counts, bad params. */
  expect_error(kspec_op_info_json("no.such_op") ? KSPEC_OK : kspec_last_error_code(), KSPEC_ERROR_INVALID_ARGUMENT,
               "no.such_op", "info of an unknown op");
  expect_error(kspec_call("no.such_op", NULL, 0, NULL, 0, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "no.such_op",
               "call of an unknown op");
  expect_error(kspec_call(NULL, NULL, 0, NULL, 0, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "op is NULL", "NULL op");
  expect_error(kspec_call("norm_act.fwd", NULL, 2, NULL, 0, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT,
               "inputs is NULL", "NULL inputs");

  static float x_mem[4 * 64], w_mem[64], y_mem[4 * 64], mean_mem[4], rstd_mem[4];
  int64_t x_shape[2] = {4, 64}, w_shape[1] = {64}, r_shape[1] = {4};
  kspec_tensor in[3] = {
      {x_mem, KSPEC_F32, 2, x_shape, NULL, 0, 0}, {w_mem, KSPEC_F32, 1, w_shape, NULL, 0, 0}, {NULL, 0, KSPEC_ABSENT, NULL, NULL, 0, 0}};
  kspec_tensor out[3] = {
      {y_mem, KSPEC_F32, 2, x_shape, NULL, 0, 0}, {mean_mem, KSPEC_F32, 1, r_shape, NULL, 0, 0}, {rstd_mem, KSPEC_F32, 1, r_shape, NULL, 0, 0}};

  in[0].dtype = 42;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "dtype code 42",
               "bad dtype code");
  in[0].dtype = KSPEC_I32;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "'x'",
               "dtype the op refuses");
  in[0].dtype = KSPEC_F32;
  in[1].rank = 2; /* weight [4, 64] where [hidden] is expected */
  in[1].shape = x_shape;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "weight",
               "wrong rank");
  in[1].rank = 1;
  in[1].shape = w_shape;
  in[0].shape = NULL;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "shape is NULL",
               "NULL shape");
  in[0].shape = x_shape;
  in[0].rank = 9;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "rank must be",
               "rank out of range");
  in[0].rank = 2;
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 5, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT, "at most 3",
               "too many outputs");
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, "{\"act\": 3}", NULL), KSPEC_ERROR_INVALID_ARGUMENT,
               "'act'", "param of the wrong type");
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, "{\"nrom\": \"rmsnorm\"}", NULL),
               KSPEC_ERROR_INVALID_ARGUMENT, "unknown param 'nrom'", "unknown param");
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, "{not json", NULL), KSPEC_ERROR_INVALID_ARGUMENT,
               "params_json", "params not JSON");
  expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, "{\"act\": \"swish\"}", NULL),
               KSPEC_ERROR_INVALID_ARGUMENT, "swish", "unknown choice");

  /* Host memory is refused by name, GPU or not; nothing is launched. */
  {
    int i;
    for (i = 0; i < 3; ++i) in[i].device = out[i].device = KSPEC_HOST;
    expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, "{\"norm\": \"rmsnorm\", \"eps\": 1}", NULL),
                 KSPEC_ERROR_INVALID_ARGUMENT, "host memory", "host memory");
  }
  /* A device that does not exist (none here has 100 GPUs; without a GPU, 0 are visible): refused by name. */
  {
    int i;
    for (i = 0; i < 3; ++i) in[i].device = out[i].device = 99;
    expect_error(kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL), KSPEC_ERROR_INVALID_ARGUMENT,
                 "device 99 does not exist", "no such device");
  }
  /* Device 0 with NULL data: refused before any launch, with or without a GPU (without one: device 0 does
   * not exist; with one: the NULL pointer). */
  {
    int i;
    for (i = 0; i < 3; ++i) {
      in[i].device = out[i].device = 0;
      in[i].data = out[i].data = NULL;
    }
    kspec_status st = kspec_call("norm_act.fwd", in, 3, out, 3, NULL, NULL);
    EXPECT(st == KSPEC_ERROR_INVALID_ARGUMENT || st == KSPEC_ERROR_CUDA, "status %d: %s", (int)st, kspec_last_error());
    EXPECT(strlen(kspec_last_error()) > 0, "no message");
    printf("  %-28s -> %d: %.110s\n", "device 0, NULL data", (int)st, kspec_last_error());
  }

  return finish("C ABI");
}
