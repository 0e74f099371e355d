// The device buffer the difflogic GPU tests share: cuMemAlloc'd bytes freed on scope exit, with an upload, a
// download and a poison fill (so that a byte an op should write but does not shows in the result).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "jit/driver.h"

namespace kspec::testing {

// kPoison: the byte poison() fills with (0xFF makes every unwritten float a NaN).
template <unsigned char kPoison = 0xA5>
struct DeviceBuffer {
  CUdeviceptr p = 0;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t b) : bytes(std::max<size_t>(b, 16)) { CU_CHECK(cuMemAlloc(&p, bytes)); }
  ~DeviceBuffer() { jit::driver().cuMemFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr() const { return reinterpret_cast<void*>(p); }
  void upload(const void* data, size_t n) { CU_CHECK(cuMemcpyHtoD(p, data, n)); }
  std::vector<unsigned char> download(size_t n) const {
    std::vector<unsigned char> v(n);
    CU_CHECK(cuMemcpyDtoH(v.data(), p, n));
    return v;
  }
  void poison() { CU_CHECK(cuMemsetD8(p, kPoison, bytes)); }
};

}  // namespace kspec::testing
