// The library's version string (from CMake's project version).
#include "kspec/kspec.h"

namespace kspec {
const char* version() { return KSPEC_VERSION; }
}  // namespace kspec
