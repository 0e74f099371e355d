/* kspec_xla_register and the target table from C, against a stand-in XLA_FFI_Api that records what is
 * registered (no XLA needed): every target once, for the platform asked, with its execute and initialize
 * handlers (no instantiate or prepare stage) and no command-buffer trait; XLA's refusal and an API of
 * another major version come back as errors. */
#include <kspec/kspec_xla.h>

#include "check.h"

#include <stdio.h>
#include <string.h>

#ifdef KSPEC_HAVE_XLA_HEADERS
#include "xla/ffi/api/c_api.h"
#endif

static const char* const kTargets[] = {"kspec_selective_scan_fwd", "kspec_selective_scan_bwd", "kspec_selective_scan_step",
                                       "kspec_norm_act_fwd",       "kspec_norm_act_bwd",       "kspec_e79_fwd",
                                       "kspec_e79_bwd",            "kspec_adamw"};
#define N_TARGETS (sizeof(kTargets) / sizeof(kTargets[0]))

#ifdef KSPEC_HAVE_XLA_HEADERS
static char names[16][64], platforms[16][16];
static void *executes[16], *initializes[16], *others[16];
static unsigned traits[16];
static int registered = 0, refuse_at = -1;
static XLA_FFI_Error* const kRefused = (XLA_FFI_Error*)&refuse_at; /* any non-NULL pointer */

static XLA_FFI_Error* fake_register(XLA_FFI_Handler_Register_Args* args) {
  if (registered == refuse_at) return kRefused;
  if (registered < 16) {
    snprintf(names[registered], 64, "%.*s", (int)args->name.len, args->name.ptr);
    snprintf(platforms[registered], 16, "%.*s", (int)args->platform.len, args->platform.ptr);
    executes[registered] = (void*)args->bundle.execute;
    initializes[registered] = (void*)args->bundle.initialize;
    others[registered] = args->bundle.instantiate ? (void*)args->bundle.instantiate : (void*)args->bundle.prepare;
    traits[registered] = args->traits;
  }
  ++registered;
  return NULL;
}
/* XLA's FFI API 0.4 (jaxlib 0.11.1) replaced GetMessage with GetDetails. */
#if XLA_FFI_API_MAJOR > 0 || XLA_FFI_API_MINOR >= 4
#define KSPEC_FFI_ERROR_TEXT XLA_FFI_Error_GetDetails
typedef XLA_FFI_Error_GetDetails_Args ErrorTextArgs;
#else
#define KSPEC_FFI_ERROR_TEXT XLA_FFI_Error_GetMessage
typedef XLA_FFI_Error_GetMessage_Args ErrorTextArgs;
#endif
static void fake_message(ErrorTextArgs* args) { args->message = "target already registered"; }
static int destroyed = 0;
static void fake_destroy(XLA_FFI_Error_Destroy_Args* args) { destroyed += args->error == kRefused; }
#endif

int main(void) {
  const char* table = kspec_xla_targets_json();
  EXPECT(table != NULL, "no table: %s", kspec_last_error());
  for (size_t i = 0; table && i < N_TARGETS; ++i) {
    EXPECT(strstr(table, kTargets[i]) != NULL, "table lacks %s", kTargets[i]);
    EXPECT((kspec_xla_handler(kTargets[i]) != NULL) == (kspec_xla_available() == 1), "handler of %s", kTargets[i]);
    EXPECT((kspec_xla_initialize_handler(kTargets[i]) != NULL) == (kspec_xla_available() == 1),
           "initialize handler of %s", kTargets[i]);
  }
  EXPECT(kspec_xla_handler("kspec_nope") == NULL && kspec_xla_handler(NULL) == NULL, "unknown target has a handler");
  EXPECT(kspec_xla_initialize_handler("kspec_nope") == NULL && kspec_xla_initialize_handler(NULL) == NULL,
         "unknown target has an initialize handler");
  printf("XLA handlers %s; %zu targets in the table\n", kspec_xla_available() ? "built" : "not built", N_TARGETS);

#ifdef KSPEC_HAVE_XLA_HEADERS
  EXPECT(kspec_xla_available() == 1, "built with the headers but not available");
  EXPECT(kspec_xla_register(NULL, "CUDA") == KSPEC_ERROR_INVALID_ARGUMENT, "NULL api accepted");
  XLA_FFI_Api api;
  memset(&api, 0, sizeof api);
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version.major_version = XLA_FFI_API_MAJOR;
  api.api_version.minor_version = XLA_FFI_API_MINOR;
  api.XLA_FFI_Handler_Register = fake_register;
  api.KSPEC_FFI_ERROR_TEXT = fake_message;
  api.XLA_FFI_Error_Destroy = fake_destroy;
  EXPECT(kspec_xla_register(&api, "CUDA") == KSPEC_OK, "register: %s", kspec_last_error());
  EXPECT(registered == (int)N_TARGETS, "%d registered", registered);
  for (int i = 0; i < registered && i < 16; ++i) {
    EXPECT(strcmp(platforms[i], "CUDA") == 0, "platform %s", platforms[i]);
    EXPECT(executes[i] != NULL && executes[i] == kspec_xla_handler(names[i]), "handler of %s", names[i]);
    EXPECT(initializes[i] != NULL && initializes[i] == kspec_xla_initialize_handler(names[i]) &&
               initializes[i] != executes[i], "initialize handler of %s", names[i]);
    EXPECT(others[i] == NULL, "%s registers an instantiate or prepare stage", names[i]);
    EXPECT(traits[i] == 0, "%s declares traits %u", names[i], traits[i]);
  }
  registered = 0;
  refuse_at = 2;
  EXPECT(kspec_xla_register(&api, "CUDA") == KSPEC_ERROR_UNKNOWN, "refusal not reported");
  EXPECT(strstr(kspec_last_error(), "already registered") && strstr(kspec_last_error(), kTargets[2]),
         "message: %s", kspec_last_error());
  EXPECT(destroyed == 1, "XLA's error destroyed %d times", destroyed);
  printf("  refused -> %s\n", kspec_last_error());
  api.api_version.major_version = XLA_FFI_API_MAJOR + 1;
  EXPECT(kspec_xla_register(&api, "CUDA") == KSPEC_ERROR_UNSUPPORTED, "other major accepted");
  printf("  other API version -> %s\n", kspec_last_error());
#else
  {
    int not_an_api = 0;
    EXPECT(kspec_xla_register((const XLA_FFI_Api*)(void*)&not_an_api, "CUDA") == KSPEC_ERROR_UNSUPPORTED,
           "stub register did not refuse");
    EXPECT(strstr(kspec_last_error(), "without XLA") != NULL, "message: %s", kspec_last_error());
  }
#endif
  return finish("kspec_xla_register");
}
