/* The C tests' one check macro and their exit: EXPECT counts a failed condition (file, line, the
 * condition's text and a printf-style note) and goes on; finish() prints the count and gives main's
 * status. Header-only, static: each test is one translation unit. */
#ifndef KSPEC_TESTS_C_CHECK_H
#define KSPEC_TESTS_C_CHECK_H

#include <stdio.h>

static int failures = 0;

#define EXPECT(cond, ...)                                             \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

/* main's status: 1 after any failure (with their count on stderr), else 0 after `passed` on stdout. */
static int finish(const char* passed) {
  if (failures) {
    fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  printf("%s: all checks passed\n", passed);
  return 0;
}

#endif
