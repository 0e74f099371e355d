// offsetof for the parameter headers (templates/<family>/params.h), which both the host compiler and
// NVRTC compile, so that each asserts the same layout: NVRTC has no <cstddef> and no __builtin_offsetof,
// and the null-pointer form (libcu++'s offsetof under NVRTC) is not a constant expression there; its
// front end's __INTADDR__ is.
#pragma once

#ifdef __CUDACC_RTC__
#define KSPEC_OFFSETOF(type, member) ((unsigned long)__INTADDR__(&(((type*)0)->member)))
#else
#include <cstddef>
#define KSPEC_OFFSETOF(type, member) offsetof(type, member)
#endif
