// The device buffers the GPU tests share: cuMemAlloc'd bytes freed on scope exit, with an upload, a download and a
// poison fill (so that a byte an op should write but does not shows in the result); the fp32 form of the mhc, e79
// and mlstm tests, and their error measures against the float64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
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

// fp32 data: upload and download count floats (upload(data, bytes) still takes raw bytes, e.g. bf16), and
// poison() makes every float a NaN.
struct FloatBuffer : DeviceBuffer<0xFF> {
  using DeviceBuffer::DeviceBuffer;
  using DeviceBuffer::upload;
  void upload(const std::vector<float>& v) { upload(v.data(), v.size() * 4); }
  std::vector<float> download(size_t n) const {
    std::vector<float> v(n);
    CU_CHECK(cuMemcpyDtoH(v.data(), p, n * 4));
    return v;
  }
};

// max |out - ref| / max |ref| over the shorter of the two (issue 34's measure); infinite where out holds a NaN or
// an infinity.
inline double max_rel(const std::vector<float>& out, const std::vector<double>& ref) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < std::min(out.size(), ref.size()); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    err = std::max(err, std::abs(out[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return err / std::max(scale, 1e-300);
}

// ||out - ref|| / ||ref|| over out's elements; infinite where out holds a NaN or an infinity.
inline double rel_err(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// count normal floats times scale.
inline std::vector<float> randn(std::mt19937_64& rng, size_t count, float scale) {
  std::normal_distribution<float> nd;
  std::vector<float> v(count);
  for (auto& x : v) x = scale * nd(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

}  // namespace kspec::testing
