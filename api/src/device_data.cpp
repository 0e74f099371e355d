// Random inputs, dtype conversion, device buffers and relative errors for the checker and the tuner.
#include "api/src/device_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>


namespace kspec {
namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void encode(DType dt, const std::vector<double>& src, std::vector<unsigned char>& bytes) {
  bytes.resize(src.size() * dtype_size(dt));
  for (size_t i = 0; i < src.size(); ++i) {
    switch (dt) {
      case DType::f32: { float f = static_cast<float>(src[i]); std::memcpy(&bytes[i * 4], &f, 4); break; }
      case DType::f64: std::memcpy(&bytes[i * 8], &src[i], 8); break;
      case DType::f16: { _Float16 h = static_cast<_Float16>(static_cast<float>(src[i])); std::memcpy(&bytes[i * 2], &h, 2); break; }
      case DType::bf16: { uint16_t h = to_bf16(static_cast<float>(src[i])); std::memcpy(&bytes[i * 2], &h, 2); break; }
      // Integer data (wires, CSR offsets): the value rounded; an op's prepare_inputs makes it valid.
      case DType::i32: { auto v = static_cast<int32_t>(std::llround(src[i])); std::memcpy(&bytes[i * 4], &v, 4); break; }
      case DType::i64: { auto v = static_cast<int64_t>(std::llround(src[i])); std::memcpy(&bytes[i * 8], &v, 8); break; }
      default: throw Unsupported(detail::concat("check: dtype ", dtype_name(dt), " not supported"));
    }
  }
}

std::vector<double> decode(DType dt, const std::vector<unsigned char>& bytes) {
  size_t n = bytes.size() / dtype_size(dt);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::f32: { float f; std::memcpy(&f, &bytes[i * 4], 4); out[i] = f; break; }
      case DType::f64: std::memcpy(&out[i], &bytes[i * 8], 8); break;
      case DType::f16: { _Float16 h; std::memcpy(&h, &bytes[i * 2], 2); out[i] = static_cast<float>(h); break; }
      case DType::bf16: { uint16_t h; std::memcpy(&h, &bytes[i * 2], 2); out[i] = from_bf16(h); break; }
      case DType::i32: { int32_t v; std::memcpy(&v, &bytes[i * 4], 4); out[i] = v; break; }
      case DType::i64: { int64_t v; std::memcpy(&v, &bytes[i * 8], 8); out[i] = static_cast<double>(v); break; }
      default: break;
    }
  }
  return out;
}

// Rounds values to what the dtype can hold, so the reference sees exactly the GPU's inputs.
void quantize(DType dt, std::vector<double>& v) {
  std::vector<unsigned char> b;
  encode(dt, v, b);
  v = decode(dt, b);
}

TensorView view_of(CUdeviceptr p, DType dt, const std::vector<int64_t>& shape, int device) {
  TensorView t;
  t.data = reinterpret_cast<void*>(p);
  t.dtype = dt;
  t.rank = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = s;
    s *= shape[d];
  }
  t.device = device;
  return t;
}

double rel_error(const std::vector<double>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<HostTensor> random_inputs(const OpDef& op, const Problem& p, uint64_t seed, bool for_timing) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto& ins = op.info.inputs;
  std::vector<HostTensor> host_in(ins.size());
  for (size_t i = 0; i < ins.size(); ++i) {
    if (!p.inputs[i].present) continue;
    HostTensor& h = host_in[i];
    h.defined = true;
    h.shape = shape_of(ins[i], p);
    h.data.resize(h.numel());
    for (auto& v : h.data) v = normal(rng);
  }
  // Round to the input dtypes first, so derived inputs (saved statistics) are those of what the GPU
  // sees, then round the derived ones too.
  for (size_t i = 0; i < ins.size(); ++i)
    if (host_in[i].defined) quantize(p.inputs[i].dtype, host_in[i].data);
  if (op.prepare_inputs && (op.prepare_for_timing || !for_timing)) {
    op.prepare_inputs(p, host_in);
    for (size_t i = 0; i < ins.size(); ++i)
      if (host_in[i].defined) quantize(p.inputs[i].dtype, host_in[i].data);
  }
  return host_in;
}

namespace {
double element(DType dt, const unsigned char* b, size_t i) {
  switch (dt) {
    case DType::f32: { float f; std::memcpy(&f, b + i * 4, 4); return f; }
    case DType::f64: { double d; std::memcpy(&d, b + i * 8, 8); return d; }
    case DType::f16: { _Float16 h; std::memcpy(&h, b + i * 2, 2); return static_cast<float>(h); }
    case DType::bf16: { uint16_t h; std::memcpy(&h, b + i * 2, 2); return from_bf16(h); }
    default: return 0;
  }
}
}  // namespace

double rel_error_bytes(DType dt, const std::vector<unsigned char>& out, const std::vector<unsigned char>& ref) {
  size_t n = std::min(out.size(), ref.size()) / dtype_size(dt);
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    double o = element(dt, out.data(), i), r = element(dt, ref.data(), i);
    if (!std::isfinite(o)) {
      if (std::isfinite(r) || std::isnan(o) != std::isnan(r)) return INFINITY;
      continue;
    }
    num += (o - r) * (o - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace kspec
