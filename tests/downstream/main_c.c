/* Downstream use of an installed kspec from C: the C ABI through find_package(kspec). */
#include <kspec/kspec_c.h>

#include <stdio.h>
#include <string.h>

int main(void) {
  if (kspec_c_version() != KSPEC_C_ABI_VERSION) return 1;
  const char* info = kspec_op_info_json("selective_scan.fwd");
  if (!info || !strstr(info, "\"dstate\"")) return 1;
  if (kspec_call("no.such_op", NULL, 0, NULL, 0, NULL, NULL) != KSPEC_ERROR_INVALID_ARGUMENT) return 1;
  printf("kspec %s from C (ABI %d): unknown op rejected: %.60s\n", kspec_version_string(), kspec_c_version(),
         kspec_last_error());
  return 0;
}
