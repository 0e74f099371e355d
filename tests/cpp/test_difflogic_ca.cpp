// difflogic.ca.step.fwd (api/ops/difflogic/ca.cpp). Without a GPU: the architecture's sizes checked with
// messages naming the argument, and the precompile plan compiling for sm_90 without spills or a stack
// frame. On a GPU (skipped without one; the generic checker cannot drive int32 inputs): every case of the
// op's table in every activation dtype against the float64 reference (the checkerboard and tiny
// architectures, zero-padded and periodic, with and without a fire mask, soft and hard), and two runs
// bitwise equal.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

void* fake(uintptr_t slot) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000) + (slot << 28)); }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// tiny: C 2, K 2, perception 8 + 4 + 2 = 14 gates, update 6 + 2 = 8 gates, wired 14 - 8 + 8 = 14.
std::vector<TensorView> tiny_inputs(int64_t C = 2, int64_t wired = 14, int64_t Gp = 14) {
  return {TensorView(fake(1), DType::f32, {2, 3, 4, C}, 0), TensorView(fake(2), DType::i32, {8}, 0),
          TensorView(fake(3), DType::i32, {2, wired}, 0), TensorView(fake(4), DType::f32, {2, Gp, 16}, 0),
          TensorView(fake(5), DType::f32, {8, 16}, 0), TensorView()};
}

}  // namespace

TEST(DiffLogicCa, ArchitectureSizesAreChecked) {
  const char* op = "difflogic.ca.step.fwd";
  const Params tiny = {{"arch", std::string("tiny")}};
  auto out = infer_outputs(op, tiny_inputs(), tiny);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{2, 3, 4, 2}));
  auto msg = message_of([&] { infer_outputs(op, tiny_inputs(3), tiny); });
  EXPECT_NE(msg.find("input 'state''s last dim (C) is 3, but arch 'tiny' has 2"), std::string::npos) << msg;
  msg = message_of([&] { infer_outputs(op, tiny_inputs(2, 15), tiny); });
  EXPECT_NE(msg.find("input 'wires''s second dim"), std::string::npos) << msg;
  msg = message_of([&] { infer_outputs(op, tiny_inputs(2, 14, 13), tiny); });
  EXPECT_NE(msg.find("perception"), std::string::npos) << msg;
  msg = message_of([&] { infer_outputs(op, tiny_inputs()); });  // the checkerboard's C is 8
  EXPECT_NE(msg.find("arch 'checkerboard' has 8"), std::string::npos) << msg;
  msg = message_of([&] { infer_outputs(op, tiny_inputs(), {{"arch", std::string("big")}}); });
  EXPECT_NE(msg.find("parameter 'arch'"), std::string::npos) << msg;
}

// What `kspec precompile --all` builds for the op (both architectures' representative cases, every dtype,
// every config) compiles for sm_90 without spills or a stack frame.
TEST(DiffLogicCa, PrecompilePlanCompilesWithoutSpills) {
  int requests = 0;
  for (const auto& r : precompile_plan({"sm_90"}, {"difflogic.ca.step.fwd"})) {
    ++requests;
    auto reports = compile(r);
    ASSERT_EQ(reports.size(), 2u);
    for (const auto& rep : reports) {
      EXPECT_EQ(rep.spill_bytes, 0) << dtype_short(r.dtype) << ": " << rep.kernel << ", " << rep.registers << " registers";
      EXPECT_EQ(rep.stack_bytes, 0) << dtype_short(r.dtype) << ": " << rep.kernel;
    }
  }
  EXPECT_EQ(requests, 12);  // 2 architectures x 3 dtypes x 2 configs
}

namespace {

struct DevBuf {
  CUdeviceptr p = 0;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(std::max<size_t>(b, 16)) { CU_CHECK(cuMemAlloc(&p, bytes)); }
  ~DevBuf() { jit::driver().cuMemFree(p); }
  void* ptr() const { return reinterpret_cast<void*>(p); }
};

// One case of the op's table on the device: logits N(0, 2), the rest from the op's own generator (a
// valid wiring, states in (0, 1), a 0 / 1 fire mask); the output's raw bytes.
struct CaRun {
  const OpDef& op = Registry::global().get("difflogic.ca.step.fwd");
  Problem p;
  std::vector<HostTensor> in;
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<TensorView> views;
  std::unique_ptr<DevBuf> out;
  Params params;
  size_t out_bytes = 0;

  CaRun(const Case& cs, DType dt) {
    CompileRequest req;
    req.op = op.info.name;
    req.dtype = dt;
    req.arch = "sm_90";
    req.without = cs.without;
    for (const auto& [k, v] : cs.params.items()) req.params.set(k, v);
    for (const auto& [k, v] : cs.dims) req.params.set(k, v);
    p = problem_from_request(op, req);
    // The op's own generator (random_inputs would round the int32 wires through a float dtype).
    in.resize(op.info.inputs.size());
    for (size_t i = 0; i < in.size(); ++i) {
      if (!p.inputs[i].present) continue;
      in[i].defined = true;
      in[i].shape = shape_of(op.info.inputs[i], p);
      in[i].data.assign(static_cast<size_t>(in[i].numel()), 0.0);
    }
    std::mt19937_64 rng(17);
    std::normal_distribution<double> normal(0.0, 2.0);
    for (size_t i : {3, 4})
      for (double& v : in[i].data) v = normal(rng);
    op.prepare_inputs(p, in);
    for (size_t i = 0; i < in.size(); ++i)
      if (in[i].defined && p.inputs[i].dtype != DType::i32) quantize(p.inputs[i].dtype, in[i].data);
    for (size_t i = 0; i < in.size(); ++i) {
      if (!in[i].defined) {
        views.emplace_back();
        continue;
      }
      const DType t = p.inputs[i].dtype;
      std::vector<unsigned char> bytes;
      if (t == DType::i32) {
        std::vector<int32_t> v(in[i].data.begin(), in[i].data.end());
        bytes.resize(v.size() * 4);
        std::memcpy(bytes.data(), v.data(), bytes.size());
      } else {
        encode(t, in[i].data, bytes);
      }
      bufs.push_back(std::make_unique<DevBuf>(bytes.size()));
      CU_CHECK(cuMemcpyHtoD(bufs.back()->p, bytes.data(), bytes.size()));
      views.push_back(view_of(bufs.back()->p, t, in[i].shape, 0));
    }
    const auto shape = shape_of(op.info.outputs[0], p);
    out_bytes = static_cast<size_t>(shape[0] * shape[1] * shape[2] * shape[3]) * dtype_size(dt);
    out = std::make_unique<DevBuf>(out_bytes);
    params = cs.params;
  }
  std::vector<unsigned char> run(const Config* config = nullptr) {
    CU_CHECK(cuMemsetD8(out->p, 0xFF, out->bytes));
    CallOptions opts;
    opts.config = config;
    call(op.info.name, views, {view_of(out->p, p.dtype("next"), shape_of(op.info.outputs[0], p), 0)}, params, nullptr,
         opts);
    CU_CHECK(cuCtxSynchronize());
    std::vector<unsigned char> bytes(out_bytes);
    CU_CHECK(cuMemcpyDtoH(bytes.data(), out->p, bytes.size()));
    return bytes;
  }
};

}  // namespace

TEST(DiffLogicCaGpu, EveryCaseMatchesTheReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const OpDef& op = Registry::global().get("difflogic.ca.step.fwd");
  for (const Case& cs : op.cases)
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      CaRun r(cs, dt);
      const Config c128{{{"threads", 128}}}, c256{{{"threads", 256}}};
      const auto got = r.run(&c128);
      const auto want = op.reference(r.p, r.in)[0].data;
      // fp32 within 1e-4 (issue 30); half precisions: the state's rounding (the dtype table).
      const double tol = dt == DType::f32 ? 1e-4 : tolerance_for(dt);
      EXPECT_LE(rel_error(decode(dt, got), want), tol) << cs.name << " " << dtype_short(dt);
      EXPECT_TRUE(r.run(&c256) == got) << cs.name << " " << dtype_short(dt) << ": the configs differ";
    }
}
