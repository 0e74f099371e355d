// The difflogic layer GPU tests' shared fixture (test_difflogic.cpp, test_difflogic_hybrid.cpp): one layer's
// inputs drawn from a seed, kept on the host (float64, rounded to the activation dtype) and on the device, the
// forward and backward ops called on them with outputs poisoned first, and the tolerance by dtype.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"

namespace kspec::testing {

using DevBuf = kspec::testing::DeviceBuffer<0xFF>;  // NaN in every float left unwritten

// [rows, cols] row-major -> [cols, rows] row-major.
inline std::vector<double> transposed(const std::vector<double>& v, int64_t rows, int64_t cols) {
  std::vector<double> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

// One layer on the host (float64, rounded to the activation dtype) and on the device; with fm, the device
// activations are feature-major (layout feature_major: [B, n] views of contiguous [n, B] buffers) and
// fwd / bwd hand back row-major [B, n] values like the reference's.
struct LayerRun {
  int64_t B, n_in, n_out;
  DType dt;
  bool fm = false;
  std::vector<double> x, logits, dout;
  std::vector<int32_t> a, b, csr;
  std::unique_ptr<DevBuf> dx_, dlogits_, y_, x_, logits_, a_, b_, dout_, csr_;

  LayerRun(int64_t B_, int64_t n_in_, int64_t n_out_, DType dt_, bool bits, uint64_t seed, bool fm_ = false)
      : B(B_), n_in(n_in_), n_out(n_out_), dt(dt_), fm(fm_) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    std::normal_distribution<double> normal(0.0, 1.5);
    std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(n_in - 1));
    x.resize(B * n_in);
    for (double& v : x) v = bits ? std::floor(unit(rng) * 2.0) : unit(rng);
    logits.resize(n_out * 16);
    for (double& v : logits) v = normal(rng);
    dout.resize(B * n_out);
    for (double& v : dout) v = normal(rng);
    for (int64_t g = 0; g < n_out; ++g) {
      a.push_back(wire(rng));
      b.push_back(g % 3 == 0 ? a.back() : wire(rng));
    }
    quantize(dt, x);
    quantize(dt, dout);
    quantize(DType::f32, logits);
    const auto c = ref::difflogic_consumers(n_in, a, b);
    csr.assign(c.offsets.begin(), c.offsets.end());
    csr.insert(csr.end(), c.entries.begin(), c.entries.end());
    auto up = [](std::unique_ptr<DevBuf>& d, const void* data, size_t n) {
      d = std::make_unique<DevBuf>(n);
      d->upload(data, n);
    };
    std::vector<unsigned char> bytes;
    encode(dt, fm ? transposed(x, B, n_in) : x, bytes);
    up(x_, bytes.data(), bytes.size());
    encode(dt, fm ? transposed(dout, B, n_out) : dout, bytes);
    up(dout_, bytes.data(), bytes.size());
    encode(DType::f32, logits, bytes);
    up(logits_, bytes.data(), bytes.size());
    up(a_, a.data(), a.size() * 4);
    up(b_, b.data(), b.size() * 4);
    up(csr_, csr.data(), csr.size() * 4);
    y_ = std::make_unique<DevBuf>(B * n_out * dtype_size(dt));
    dx_ = std::make_unique<DevBuf>(B * n_in * dtype_size(dt));
    dlogits_ = std::make_unique<DevBuf>(n_out * 16 * 4);
  }
  // A [B, n] activation in the run's layout.
  TensorView act(const DevBuf& d, int64_t n) const {
    return fm ? TensorView::strided(d.ptr(), dt, {B, n}, {1, B}, 0) : TensorView(d.ptr(), dt, {B, n}, 0);
  }
  // The float64 reference forward in mode "soft" or "hard", and backward.
  std::vector<double> fwd_ref(const std::string& mode) const {
    return ref::difflogic_layer_fwd_ref(B, n_in, x, logits, a, b,
                                        mode == "hard" ? ref::DiffLogicMode::Hard : ref::DiffLogicMode::Soft);
  }
  ref::DiffLogicGrads bwd_ref(double grad_factor) const {
    return ref::difflogic_layer_bwd_ref(B, n_in, x, logits, a, b, dout, grad_factor);
  }
  // dx (a backward's row-major values) is exactly 0 at every input no gate reads.
  void expect_unread_inputs_zero(const std::vector<double>& dx) const {
    for (int64_t j = 0; j < n_in; ++j) {
      if (csr[j] != csr[j + 1]) continue;
      for (int64_t s = 0; s < B; ++s) ASSERT_EQ(dx[s * n_in + j], 0.0) << "unread input " << j << ", sample " << s;
    }
  }
  // A downloaded [B, n] activation, row-major.
  std::vector<double> values(const std::vector<unsigned char>& bytes, int64_t n) const {
    auto v = decode(dt, bytes);
    return fm ? transposed(v, n, B) : v;
  }
  std::vector<TensorView> inputs() const {
    return {act(*x_, n_in), TensorView(logits_->ptr(), DType::f32, {n_out, 16}, 0),
            TensorView(a_->ptr(), DType::i32, {n_out}, 0), TensorView(b_->ptr(), DType::i32, {n_out}, 0)};
  }
  std::vector<double> fwd(const std::string& mode, Params extra = {}, const Config* config = nullptr) {
    y_->poison();
    extra.set("mode", mode);
    if (fm) extra.set("layout", std::string("feature_major"));
    CallOptions opts;
    opts.config = config;
    call("difflogic.layer.fwd", inputs(), {act(*y_, n_out), TensorView()}, extra, nullptr, opts);
    CU_CHECK(cuCtxSynchronize());
    return values(y_->download(B * n_out * dtype_size(dt)), n_out);
  }
  // dx and dlogits as raw bytes (for bitwise comparisons), dx in the run's layout (values() reads it).
  std::pair<std::vector<unsigned char>, std::vector<unsigned char>> bwd(double grad_factor, Params extra = {},
                                                                        const Config* config = nullptr) {
    dx_->poison();
    dlogits_->poison();
    auto in = inputs();
    in.push_back(act(*dout_, n_out));
    in.push_back(TensorView(csr_->ptr(), DType::i32, {static_cast<int64_t>(csr.size())}, 0));
    extra.set("grad_factor", grad_factor);
    if (fm) extra.set("layout", std::string("feature_major"));
    CallOptions opts;
    opts.config = config;
    call("difflogic.layer.bwd", in,
         {act(*dx_, n_in), TensorView(dlogits_->ptr(), DType::f32, {n_out, 16}, 0)}, extra,
         nullptr, opts);
    CU_CHECK(cuCtxSynchronize());
    return {dx_->download(B * n_in * dtype_size(dt)), dlogits_->download(n_out * 16 * 4)};
  }
  // The feature-major backward with dx_layout row_major: dx [B, n_in] contiguous (raw bytes), dlogits.
  std::pair<std::vector<unsigned char>, std::vector<unsigned char>> bwd_dx_row_major(double grad_factor,
                                                                                     const Config* config) {
    dx_->poison();
    dlogits_->poison();
    auto in = inputs();
    in.push_back(act(*dout_, n_out));
    in.push_back(TensorView(csr_->ptr(), DType::i32, {static_cast<int64_t>(csr.size())}, 0));
    Params extra;
    extra.set("grad_factor", grad_factor);
    extra.set("layout", std::string("feature_major"));
    extra.set("dx_layout", std::string("row_major"));
    CallOptions opts;
    opts.config = config;
    call("difflogic.layer.bwd", in,
         {TensorView(dx_->ptr(), dt, {B, n_in}, 0), TensorView(dlogits_->ptr(), DType::f32, {n_out, 16}, 0)}, extra,
         nullptr, opts);
    CU_CHECK(cuCtxSynchronize());
    return {dx_->download(B * n_in * dtype_size(dt)), dlogits_->download(n_out * 16 * 4)};
  }
};

// fp32 within 1e-4 (issue 30); half precisions: their rounding of y and dx (the table's tolerance).
inline double tol(DType dt) { return dt == DType::f32 ? 1e-4 : tolerance_for(dt); }

// The forward with save_xt: y (row-major values) and xt [n_in, B] as raw bytes.
inline std::pair<std::vector<double>, std::vector<unsigned char>> fwd_save_xt(LayerRun& r, const std::string& mode,
                                                                      const Config& config) {
  DevBuf xt(r.B * r.n_in * dtype_size(r.dt));
  xt.poison();
  r.y_->poison();
  Params extra;
  extra.set("mode", mode);
  extra.set("save_xt", true);
  CallOptions opts;
  opts.config = &config;
  call("difflogic.layer.fwd", r.inputs(), {r.act(*r.y_, r.n_out), TensorView(xt.ptr(), r.dt, {r.n_in, r.B}, 0)},
       extra, nullptr, opts);
  CU_CHECK(cuCtxSynchronize());
  return {r.values(r.y_->download(r.B * r.n_out * dtype_size(r.dt)), r.n_out),
          xt.download(r.B * r.n_in * dtype_size(r.dt))};
}

// x [B, n_in] as the device holds it, transposed: the bytes xt must have.
inline std::vector<unsigned char> transposed_bytes(const LayerRun& r) {
  std::vector<unsigned char> bytes;
  encode(r.dt, transposed(r.x, r.B, r.n_in), bytes);
  return bytes;
}

}  // namespace kspec::testing
