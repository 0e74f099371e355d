// difflogic.ca.step.fwd and .bwd (api/ops/difflogic/ca.cpp). Without a GPU: the architecture's sizes checked with
// messages naming the argument, the precompile plan compiling for sm_90 without spills or a stack
// frame, and the generic checker's inputs of the difflogic ops valid wirings. On a GPU (skipped without one; the generic checker cannot drive int32 inputs): every case of the
// op's table in every activation dtype against the float64 reference (the checkerboard and tiny
// architectures, zero-padded and periodic, with and without a fire mask, soft and hard), and two runs
// bitwise equal.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <variant>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "device_buffer_test_util.h"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "templates/difflogic/params.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::message_of;

namespace {

void* fake(uintptr_t slot) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000) + (slot << 28)); }

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

using DevBuf = kspec::testing::DeviceBuffer<0xFF>;  // NaN in every float left unwritten

// A case's problem (sm_90, the case's dims and params), as the checker makes it.
struct CaRunSpec {
  Problem p;
  CaRunSpec(const OpDef& op, const Case& cs) {
    CompileRequest req;
    req.op = op.info.name;
    req.dtype = DType::f32;
    req.arch = "sm_90";
    req.without = cs.without;
    for (const auto& [k, v] : cs.params.items()) req.params.set(k, v);
    for (const auto& [k, v] : cs.dims) req.params.set(k, v);
    p = problem_from_request(op, req);
  }
};

// One case of an op's table on the device: logits N(0, 2), the rest from the op's own generator (a
// valid wiring, states in (0, 1), a 0 / 1 fire mask, dnext in (-1, 1)); every output's raw bytes.
struct CaRun {
  const OpDef& op;
  Problem p;
  std::vector<HostTensor> in;
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<TensorView> views;
  std::vector<std::unique_ptr<DevBuf>> outs;
  std::vector<TensorView> out_views;
  Params params;

  CaRun(const char* name, const Case& cs, DType dt) : op(Registry::global().get(name)) {
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
      if (!bytes.empty()) CU_CHECK(cuMemcpyHtoD(bufs.back()->p, bytes.data(), bytes.size()));
      views.push_back(view_of(bufs.back()->p, t, in[i].shape, 0));
    }
    for (size_t o = 0; o < op.info.outputs.size(); ++o) {
      const auto shape = shape_of(op.info.outputs[o], p);
      const DType t = p.outputs[o].dtype;
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      outs.push_back(std::make_unique<DevBuf>(static_cast<size_t>(n) * dtype_size(t)));
      out_views.push_back(view_of(outs.back()->p, t, shape, 0));
    }
    params = cs.params;
  }
  // Each output's bytes (outputs poisoned with 0xFF, NaN in every float dtype, first).
  std::vector<std::vector<unsigned char>> run(const Config* config = nullptr) {
    for (const auto& o : outs) o->poison();
    CallOptions opts;
    opts.config = config;
    call(op.info.name, views, out_views, params, nullptr, opts);
    CU_CHECK(cuCtxSynchronize());
    std::vector<std::vector<unsigned char>> got;
    for (size_t o = 0; o < outs.size(); ++o) {
      got.emplace_back(static_cast<size_t>(out_views[o].numel()) * dtype_size(out_views[o].dtype));
      if (!got.back().empty()) CU_CHECK(cuMemcpyDtoH(got.back().data(), outs[o]->p, got.back().size()));
    }
    return got;
  }
};

}  // namespace

TEST(DiffLogicCaGpu, EveryCaseMatchesTheReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const OpDef& op = Registry::global().get("difflogic.ca.step.fwd");
  for (const Case& cs : op.cases)
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      CaRun r("difflogic.ca.step.fwd", cs, dt);
      const Config c128{{{"threads", 128}}}, c256{{{"threads", 256}}};
      const auto got = r.run(&c128);
      const auto want = op.reference(r.p, r.in)[0].data;
      // fp32 within 1e-4 (issue 30); half precisions: the state's rounding (the dtype table).
      const double tol = dt == DType::f32 ? 1e-4 : tolerance_for(dt);
      EXPECT_LE(rel_error(decode(dt, got[0]), want), tol) << cs.name << " " << dtype_short(dt);
      EXPECT_TRUE(r.run(&c256) == got) << cs.name << " " << dtype_short(dt) << ": the configs differ";
    }
}

// difflogic.ca.step.bwd: the forward's schema plus dnext, three outputs.
TEST(DiffLogicCaBwd, SchemaAndChecks) {
  const char* op = "difflogic.ca.step.bwd";
  const Params tiny = {{"arch", std::string("tiny")}};
  auto in = tiny_inputs();
  in.push_back(TensorView(fake(6), DType::f32, {2, 3, 4, 2}, 0));
  auto out = infer_outputs(op, in, tiny);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{2, 3, 4, 2}));
  EXPECT_EQ(out[1].shape, (std::vector<int64_t>{2, 14, 16}));
  EXPECT_EQ(out[2].shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(out[1].dtype, DType::f32);
  auto bad = in;
  bad[6] = TensorView(fake(6), DType::f32, {2, 3, 5, 2}, 0);
  auto msg = message_of([&] { infer_outputs(op, bad, tiny); });
  EXPECT_NE(msg.find("dnext"), std::string::npos) << msg;
  bad[6] = TensorView(fake(6), DType::f16, {2, 3, 4, 2}, 0);
  msg = message_of([&] { infer_outputs(op, bad, tiny); });
  EXPECT_NE(msg.find("dnext"), std::string::npos) << msg;
  // float16 states are refused: their gradient flushes to zero through the update network.
  auto f16_in = in;
  f16_in[0] = TensorView(fake(1), DType::f16, {2, 3, 4, 2}, 0);
  f16_in[6] = TensorView(fake(6), DType::f16, {2, 3, 4, 2}, 0);
  EXPECT_THROW(infer_outputs(op, f16_in, tiny), Unsupported);
  msg = message_of([&] { infer_outputs(op, f16_in, tiny); });
  EXPECT_NE(msg.find("input 'state' is float16"), std::string::npos) << msg;
  auto wide = tiny_inputs(3);
  wide.push_back(TensorView(fake(6), DType::f32, {2, 3, 4, 3}, 0));
  msg = message_of([&] { infer_outputs(op, wide, tiny); });
  EXPECT_NE(msg.find("arch 'tiny' has 2"), std::string::npos) << msg;
  // The backward numbers cells with an int.
  std::vector<TensorView> big = in;
  big[0] = TensorView(fake(1), DType::f32, {32768, 65535, 1, 2}, 0);
  big[6] = TensorView(fake(6), DType::f32, {32768, 65535, 1, 2}, 0);
  EXPECT_NO_THROW(infer_outputs(op, big, tiny));
  big[0] = TensorView(fake(1), DType::f32, {32768, 65535, 2, 2}, 0);
  big[6] = TensorView(fake(6), DType::f32, {32768, 65535, 2, 2}, 0);
  msg = message_of([&] { infer_outputs(op, big, tiny); });
  EXPECT_NE(msg.find("batch * height * width = 4294901760 cells, expected at most 2^31 - 1"), std::string::npos) << msg;
  EXPECT_EQ(op_info(op).params.size(), 2u);  // arch, periodic: the backward is the soft step's
}

// Its precompile plan (both architectures, every dtype and config: 4 kernels each, 5 with readers = 1, the
// readers CSR's) compiles for sm_90 without spills or a stack frame; the case table covers both architectures.
TEST(DiffLogicCaBwd, PrecompilePlanCompilesWithoutSpills) {
  int requests = 0;
  for (const auto& r : precompile_plan({"sm_90"}, {"difflogic.ca.step.bwd"})) {
    ++requests;
    auto reports = compile(r);
    ASSERT_TRUE(r.config.has_value());
    ASSERT_EQ(reports.size(), r.config->get("readers") ? 5u : 4u);
    for (const auto& rep : reports) {
      EXPECT_EQ(rep.spill_bytes, 0) << dtype_short(r.dtype) << ": " << rep.kernel << ", " << rep.registers << " registers";
      EXPECT_EQ(rep.stack_bytes, 0) << dtype_short(r.dtype) << ": " << rep.kernel;
    }
  }
  EXPECT_EQ(requests, 8);  // 2 architectures x 2 dtypes (no float16) x 2 configs (256 threads, readers 0 / 1)
  std::set<std::string> archs;
  for (const Case& c : Registry::global().get("difflogic.ca.step.bwd").cases) archs.insert(std::get<std::string>(*c.params.find("arch")));
  EXPECT_EQ(archs, (std::set<std::string>{"checkerboard", "tiny"}));
}

// On the GPU, every case in every dtype against the float64 reference's backward: dstate within 1e-4 in
// fp32 (the state's rounding in fp16 / bf16), dlogits within 1e-4 (fp32 sums of the same inputs); both
// configs (readers 0: every gate tested per input; 1: the readers CSR, the default) and a rerun give the same
// bits (the sums' order depends on neither).
TEST(DiffLogicCaGpu, BackwardMatchesTheReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const OpDef& op = Registry::global().get("difflogic.ca.step.bwd");
  for (const Case& cs : op.cases)
    for (DType dt : {DType::f32, DType::bf16}) {  // float16 is refused (DiffLogicCaBwd.SchemaAndChecks)
      CaRun r("difflogic.ca.step.bwd", cs, dt);
      const Config c256{{{"threads", 256}, {"readers", 0}}};  // every axis named: a config lacking one is refused
      const auto got = r.run(&c256);
      const auto want = op.reference(r.p, r.in);
      const char* names[] = {"dstate", "dperception_logits", "dupdate_logits"};
      for (size_t o = 0; o < 3; ++o) {
        const DType t = o == 0 ? dt : DType::f32;
        const double tol = t == DType::f32 ? 1e-4 : tolerance_for(t);
        EXPECT_LE(rel_error(decode(t, got[o]), want[o].data), tol) << cs.name << " " << dtype_short(dt) << " " << names[o];
      }
      EXPECT_TRUE(r.run(&c256) == got) << cs.name << " " << dtype_short(dt) << ": a rerun differs";
      const Config readers{{{"threads", 256}, {"readers", 1}}};
      EXPECT_TRUE(r.run(&readers) == got) << cs.name << " " << dtype_short(dt) << ": readers = 1 differs";
      EXPECT_TRUE(r.run(nullptr) == got) << cs.name << " " << dtype_short(dt) << ": the default config differs";
    }
}

// The generic checker (kspec check, tools/gpu/sanitize_all.sh) draws the int32 inputs of the difflogic ops
// it runs through random_inputs: integers survive the round trip, and every case's wiring is valid (the CA's
// perm a permutation of the neighbours and each layer's wires inside its inputs; the layers' wires in
// [0, n_in) and their CSR the consumers of that wiring).
TEST(DiffLogicGenericCheck, CaseInputsAreValidWirings) {
  std::vector<double> ints = {-3.0, 0.0, 7.0, 2147483647.0};
  quantize(DType::i32, ints);
  EXPECT_EQ(ints, (std::vector<double>{-3.0, 0.0, 7.0, 2147483647.0}));
  for (const char* name : {"difflogic.ca.step.fwd", "difflogic.ca.step.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    EXPECT_TRUE(op.generic_check) << name;
    for (const Case& cs : op.cases) {
      CaRunSpec s(op, cs);
      const auto in = random_inputs(op, s.p, 99);
      std::vector<double> perm = in[1].data;
      std::sort(perm.begin(), perm.end());
      EXPECT_EQ(perm, (std::vector<double>{0, 1, 2, 3, 5, 6, 7, 8})) << name << " " << cs.name;
      // Each layer's columns of the wires against its inputs (the arch's widths).
      const auto& A = kDiffLogicCaArchs[std::get<std::string>(*cs.params.find("arch")) == "tiny" ? 1 : 0];
      const int64_t wired = s.p.dim("wired");
      std::vector<std::pair<int, int>> layers;  // (n_in, width)
      for (int l = 1; l < A.n_perception; ++l) layers.emplace_back(A.perception[l - 1], A.perception[l]);
      int n_in = A.C + A.C * A.perception[A.n_perception - 1] * A.K;
      for (int l = 0; l < A.n_update; ++l) {
        layers.emplace_back(n_in, A.update[l]);
        n_in = A.update[l];
      }
      int64_t col = 0;
      for (auto [n, width] : layers)
        for (int g = 0; g < width; ++g, ++col)
          for (int64_t row : {int64_t{0}, wired})
            ASSERT_TRUE(in[2].data[row + col] >= 0 && in[2].data[row + col] < n) << name << " " << cs.name << " col " << col;
      EXPECT_EQ(col, wired);
    }
  }
  for (const char* name : {"difflogic.layer.fwd", "difflogic.layer.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    EXPECT_TRUE(op.generic_check) << name;
    for (const Case& cs : op.cases) {
      CaRunSpec s(op, cs);
      const auto in = random_inputs(op, s.p, 99);
      const int64_t n_in = s.p.dim("n_in");
      for (size_t w : {2, 3})
        for (double v : in[w].data) ASSERT_TRUE(v >= 0 && v < n_in) << name << " " << cs.name;
      if (std::string(name) == "difflogic.layer.bwd") {
        std::vector<int32_t> a(in[2].data.begin(), in[2].data.end()), b(in[3].data.begin(), in[3].data.end());
        const auto c = ref::difflogic_consumers(n_in, a, b);
        std::vector<double> want(c.offsets.begin(), c.offsets.end());
        want.insert(want.end(), c.entries.begin(), c.entries.end());
        EXPECT_EQ(in[5].data, want) << cs.name;
      }
    }
  }
}
