// What every mock-driver test executable sets up once (include it in exactly one source file of the
// executable: it replaces the global operator new/delete): every heap allocation of the process counted in
// g_allocations (the library's too), and KSPEC_LIBCUDA and KSPEC_LIBCUBLASLT pointed at the mock
// (KSPEC_CUDA_MOCK, from CMake) before anything loads them (kMockSelected, asserted by the tests).
#pragma once

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace {
const bool kMockSelected =
    setenv("KSPEC_LIBCUDA", KSPEC_CUDA_MOCK, 1) == 0 && setenv("KSPEC_LIBCUBLASLT", KSPEC_CUDA_MOCK, 1) == 0;
}  // namespace
