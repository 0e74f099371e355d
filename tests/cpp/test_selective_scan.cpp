// selective_scan without a GPU: the schema's alternative B/C shapes (fixed [dim, dstate] or variable
// [batch, groups, dstate, seqlen]) in validation, output inference and the specialization key; the
// cross-argument checks (groups | dim, dstate <= 256); every case of the table plans its kernels.
// (GPU checks of every case against the float64 reference: GpuEveryOp.EveryCaseEveryDtypeMatchesReference.)
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>

#include "api/src/op.h"
#include "api/src/tuning.h"
#include "jit/key.h"
#include "jit/sources.h"
#include "selective_scan/params.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;

namespace {

// A bf16 scan, batch 2, dim 8, seqlen 100, dstate 4; B and C variable with `groups` groups.
struct ScanArgs {
  int64_t batch = 2, dim = 8, seqlen = 100, dstate = 4, groups = 2;
  TensorView u{fake(), DType::bf16, {2, 8, 100}, 0};
  TensorView delta{fake(1 << 20), DType::bf16, {2, 8, 100}, 0};
  TensorView A{fake(2 << 20), DType::f32, {8, 4}, 0};
  TensorView B{fake(3 << 20), DType::bf16, {2, 2, 4, 100}, 0};
  TensorView C{fake(4 << 20), DType::bf16, {2, 2, 4, 100}, 0};
  TensorView D{fake(5 << 20), DType::f32, {8}, 0};
  std::vector<TensorView> in() const { return {u, delta, A, B, C, D, {}, {}, {}}; }
};

std::string invalid_message(const ScanArgs& a, const char* op = "selective_scan.fwd") {
  try {
    infer_outputs(op, a.in(), {{"delta_softplus", true}});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(SelectiveScan, VariableAndFixedBShapesInferOutputs) {
  ScanArgs a;
  auto outs = infer_outputs("selective_scan.fwd", a.in());
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_FALSE(outs[2].present);  // states: only when the caller asks (training)
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{2, 8, 100}));
  EXPECT_EQ(outs[0].dtype, DType::bf16);
  EXPECT_EQ(outs[1].shape, (std::vector<int64_t>{2, 8, 4}));
  EXPECT_EQ(outs[1].dtype, DType::f32);

  // The backward's dB and dC take B's and C's shape: here B fixed, C variable.
  a.B = TensorView(fake(3 << 20), DType::f32, {8, 4}, 0);
  TensorView dout(fake(6 << 20), DType::bf16, {2, 8, 100}, 0);
  std::vector<TensorView> in = {dout, a.u, a.delta, a.A, a.B, a.C, a.D, {}, {}, {}, {}};
  auto grads = infer_outputs("selective_scan.bwd", in);
  ASSERT_EQ(grads.size(), 9u);
  EXPECT_EQ(grads[3].shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(grads[3].dtype, DType::f32);
  EXPECT_EQ(grads[4].shape, (std::vector<int64_t>{2, 2, 4, 100}));
  EXPECT_TRUE(grads[5].present);   // dD with D
  EXPECT_FALSE(grads[6].present);  // no z, no dz
  EXPECT_FALSE(grads[8].present);  // no h0, no dh0
}

// The forward's states for the backward: ceil(seqlen / 16) of them, checked on both ops before any
// launch (BoundCall validates and plans without launching on these fake pointers).
TEST(SelectiveScan, StatesCountAndShapeAreChecked) {
  ScanArgs a;  // seqlen 100: 7 states
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  TensorView out(fake(6 << 20), DType::bf16, {2, 8, 100}, 0), last(fake(7 << 20), DType::f32, {2, 8, 4}, 0);
  TensorView six(fake(8 << 20), DType::f32, {2, 8, 6, 4}, 0);
  std::string m = message([&] { BoundCall b("selective_scan.fwd", a.in(), {out, last, six}); });
  EXPECT_NE(m.find("'states': expected 7 states"), std::string::npos) << m;
  TensorView dout(fake(9 << 20), DType::bf16, {2, 8, 100}, 0);
  TensorView wrong_dstate(fake(8 << 20), DType::f32, {2, 8, 7, 5}, 0);
  std::vector<TensorView> in = {dout, a.u, a.delta, a.A, a.B, a.C, a.D, {}, {}, {}, {}, wrong_dstate};
  m = message([&] { infer_outputs("selective_scan.bwd", in); });
  EXPECT_NE(m.find("input 'states'"), std::string::npos) << m;
  TensorView bf16_states(fake(8 << 20), DType::bf16, {2, 8, 7, 4}, 0);
  in.back() = bf16_states;
  m = message([&] { infer_outputs("selective_scan.bwd", in); });
  EXPECT_NE(m.find("input 'states'"), std::string::npos) << m;
  TensorView seven(fake(8 << 20), DType::f32, {2, 8, 7, 4}, 0);
  in.back() = seven;
  EXPECT_NO_THROW(infer_outputs("selective_scan.bwd", in));
}

// A request (compile, tune) that names seqlen but not nstates gets ceil(seqlen / 16) states, so the
// tuner's tensors pass the call's check; the tuning bucket leaves the derived dim out.
TEST(SelectiveScan, RequestsDeriveTheStateCountFromSeqlen) {
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    CompileRequest r;
    r.op = name;
    r.dtype = DType::bf16;
    r.params = {{"batch", int64_t(8)}, {"dim", int64_t(2048)}, {"seqlen", int64_t(2047)}, {"dstate", int64_t(16)}};
    Problem p = problem_from_request(op, r);
    EXPECT_EQ(p.dim("nstates"), 128) << name;
    EXPECT_EQ(tune_bucket(p), "batch=8,dim=2048,seqlen=2048,groups=1") << name;
  }
  const OpDef& e79 = Registry::global().get("e79.fwd");
  CompileRequest r;
  r.op = "e79.fwd";
  r.dtype = DType::bf16;
  r.params = {{"n", int64_t(32)}, {"seqlen", int64_t(100)}, {"chunk", int64_t(16)}};
  EXPECT_EQ(problem_from_request(e79, r).dim("nchk"), 7);
}

TEST(SelectiveScan, ValidationNamesTheArgument) {
  {
    ScanArgs a;
    a.B = TensorView(fake(3 << 20), DType::bf16, {2, 4, 100}, 0);  // rank 3: the Python API unsqueezes it
    std::string m = invalid_message(a);
    EXPECT_NE(m.find("input 'B'"), std::string::npos) << m;
    EXPECT_NE(m.find("[batch, groups, dstate, seqlen] or [dim, dstate]"), std::string::npos) << m;
  }
  {
    ScanArgs a;
    a.B = TensorView(fake(3 << 20), DType::bf16, {2, 3, 4, 100}, 0);
    a.C = TensorView(fake(4 << 20), DType::bf16, {2, 3, 4, 100}, 0);
    std::string m = invalid_message(a);
    EXPECT_NE(m.find("groups = 3 must divide dim = 8"), std::string::npos) << m;
  }
  {
    ScanArgs a;
    a.delta.dtype = DType::f16;
    std::string m = invalid_message(a);
    EXPECT_NE(m.find("input 'delta'"), std::string::npos) << m;
    EXPECT_NE(m.find("bfloat16"), std::string::npos) << m;
  }
  {
    ScanArgs a;
    a.A = TensorView(fake(2 << 20), DType::f32, {8, 300}, 0);
    a.B = TensorView(fake(3 << 20), DType::f32, {8, 300}, 0);
    a.C = TensorView(fake(4 << 20), DType::f32, {8, 300}, 0);
    EXPECT_THROW(infer_outputs("selective_scan.fwd", a.in()), Unsupported);
    std::string m = invalid_message(a);
    EXPECT_NE(m.find("input 'A': dstate = 300"), std::string::npos) << m;
  }
  {
    ScanArgs a;
    a.C = TensorView(fake(4 << 20), DType::bf16, {2, 2, 5, 100}, 0);  // dstate 5 against A's 4
    std::string m = invalid_message(a);
    EXPECT_NE(m.find("input 'C'"), std::string::npos) << m;
    EXPECT_NE(m.find("dstate"), std::string::npos) << m;
  }
}

TEST(SelectiveScan, KeyTellsFixedFromVariableAndEvenLengths) {
  const OpDef& op = Registry::global().get("selective_scan.fwd");
  auto problem = [&](std::vector<std::string> alt, int64_t seqlen) {
    CompileRequest r;
    r.op = op.info.name;
    r.dtype = DType::bf16;
    r.params = {{"dstate", int64_t(16)}, {"seqlen", seqlen}};
    r.alt_shapes = alt;
    return problem_from_request(op, r);
  };
  Problem var = problem({}, 100), fixed = problem({"B", "C"}, 100), even = problem({}, 1024);
  EXPECT_NE(var.signature(), fixed.signature());
  EXPECT_NE(var.signature(), even.signature());
  EXPECT_NE(op.kernels(var, op.tuning.heuristic(var))[0].name_expression(),
            op.kernels(fixed, op.tuning.heuristic(fixed))[0].name_expression());
  EXPECT_EQ(shape_of(op.info.inputs[3], fixed), (std::vector<int64_t>{1, 16}));
  EXPECT_EQ(shape_of(op.info.inputs[3], var), (std::vector<int64_t>{1, 1, 16, 100}));
  CompileRequest bad;
  bad.op = op.info.name;
  bad.params = {{"dstate", int64_t(16)}};
  bad.alt_shapes = {"u"};
  EXPECT_THROW(problem_from_request(op, bad), InvalidArgument);
}

// The backward's warps must divide dim / groups with a variable B/C: problems differing only in dim
// (a runtime dim) but admitting different warp counts must not share a plan (dim 37 once ran with
// the 4-warp plan of dim 64, and its extra warps wrote other channels' rows).
TEST(SelectiveScan, BackwardKeyTellsDimsAdmittingDifferentWarps) {
  const OpDef& op = Registry::global().get("selective_scan.bwd");
  auto problem = [&](int64_t dim) {
    CompileRequest r;
    r.op = op.info.name;
    r.dtype = DType::f32;
    r.params = {{"dstate", int64_t(16)}, {"seqlen", int64_t(129)}, {"dim", dim}};
    return problem_from_request(op, r);
  };
  Problem d64 = problem(64), d37 = problem(37), d36 = problem(36), d72 = problem(72);
  EXPECT_NE(d64.signature(), d37.signature());
  EXPECT_NE(d64.signature(), d36.signature());  // 8 divides 64, 4 divides 36
  EXPECT_EQ(d64.signature(), d72.signature());  // 8 divides both
  EXPECT_EQ(op.tuning.heuristic(d37).get("warps"), 1);
  std::string why;
  EXPECT_FALSE(op.tuning.valid(d37, op.tuning.heuristic(d64), &why));
  EXPECT_NE(why.find("divide"), std::string::npos) << why;
}

// The plan cache keys a heuristic choice by the problem's signature: two problems with the same
// signature must get the same heuristic config (8x5120x2048 once ran with the lanes of 8x2048x2048, and
// segments depend on batch * dim and seqlen, both runtime dims).
TEST(SelectiveScan, ProblemsSharingAPlanShareTheHeuristic) {
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    std::vector<Problem> ps;
    for (auto [b, d, t] : std::vector<std::array<int64_t, 3>>{{8, 2048, 2048}, {8, 5120, 2048}, {8, 2048, 8192},
                                                             {1, 2048, 65536}, {1, 2048, 8192}, {1, 2048, 4096},
                                                             {2, 64, 300}, {2, 32, 9000}, {1, 8, 65536},
                                                             {8, 1024, 512}, {16, 4096, 1024}, {4, 4096, 4096},
                                                             {1, 2048, 65000}, {4, 1536, 1000}, {2, 4096, 333},
                                                             {1, 1024, 2000}, {16, 768, 256}, {2, 2048, 700},
                                                             {1, 2048, 512}, {1, 1024, 100}, {3, 1000, 1000},
                                                             {16, 1024, 504}, {9, 1000, 40}, {16, 768, 264},
                                                             {16, 1024, 512}, {2, 4096, 336}, {24, 768, 264}}) {
      CompileRequest r;
      r.op = name;
      r.dtype = DType::bf16;
      r.params = {{"dstate", int64_t(16)}, {"batch", b}, {"dim", d}, {"seqlen", t}, {"delta_softplus", true}};
      ps.push_back(problem_from_request(op, r));
    }
    for (const auto& p : ps)
      for (const auto& q : ps) {
        if (p.signature() == q.signature()) {
          EXPECT_EQ(op.tuning.heuristic(p).str(), op.tuning.heuristic(q).str())
              << name << ": " << p.dim("batch") << "x" << p.dim("dim") << "x" << p.dim("seqlen") << " and "
              << q.dim("batch") << "x" << q.dim("dim") << "x" << q.dim("seqlen");
        }
      }
    // 1x2048x65536: the forward takes the one-pass tile kernel (algo 2, 6 warps), the backward 16 segments;
    // with 1024 channels (the tile kernel's grid would fill half the GPU) the forward takes 32 segments at
    // 8 states per thread
    const bool fwd = std::string(name) == "selective_scan.fwd";
    EXPECT_EQ(op.tuning.heuristic(ps[3]).get("algo"), fwd ? 2 : 1) << name;
    EXPECT_EQ(op.tuning.heuristic(ps[3]).get("segs"), fwd ? 1 : 16) << name;
    EXPECT_EQ(op.tuning.heuristic(ps[3]).get("lanes"), fwd ? 1 : 4) << name;
    if (fwd) {
      CompileRequest r;
      r.op = name;
      r.dtype = DType::bf16;
      r.params = {{"dstate", int64_t(16)}, {"batch", int64_t(1)}, {"dim", int64_t(1024)}, {"seqlen", int64_t(65536)},
                  {"delta_softplus", true}};
      const Problem narrow = problem_from_request(op, r);
      EXPECT_NE(narrow.signature(), ps[3].signature());
      EXPECT_EQ(op.tuning.heuristic(narrow).get("algo"), 1);
      EXPECT_EQ(op.tuning.heuristic(narrow).get("segs"), 32);
      EXPECT_EQ(op.tuning.heuristic(narrow).get("lanes"), 2);
      r.dtype = DType::f32;  // the tile kernel takes 16-bit inputs only
      r.params.set("dim", int64_t(2048));
      EXPECT_NE(op.tuning.heuristic(problem_from_request(op, r)).get("algo"), 2);
      // From 2048 to 8192 channels (batch * dim) the tile kernel, also where the sequence is too short for
      // segments (algo 0 before) and wherever seqlen is a multiple of 8; past 8192 algo 1.
      r.dtype = DType::bf16;
      for (auto [b, d, t, algo] : std::vector<std::array<int64_t, 4>>{{1, 4096, 2048, 2},
                                                                     {1, 2048, 512, 2},
                                                                     {1, 8192, 8192, 2},
                                                                     {4, 2048, 1024, 2},
                                                                     {2, 6144, 8192, 1},
                                                                     {1, 8200, 8192, 1},
                                                                     {1, 2040, 2048, 1},
                                                                     {4, 1536, 1000, 2},
                                                                     {1, 4096, 2000, 2},
                                                                     {1, 4096, 2004, 0}}) {
        r.params.set("batch", b);
        r.params.set("dim", d);
        r.params.set("seqlen", t);
        EXPECT_EQ(op.tuning.heuristic(problem_from_request(op, r)).get("algo"), algo) << b << "x" << d << "x" << t;
      }
      // Its 32-bit offsets: dstate * seqlen must fit in an int.
      r.params.set("batch", int64_t(1));
      r.params.set("dim", int64_t(2048));
      r.params.set("seqlen", int64_t(1) << 27);
      const Problem huge = problem_from_request(op, r);
      std::string why;
      EXPECT_FALSE(op.tuning.valid(huge, Config{{{"algo", 2}, {"warps", 6}, {"items", 4}, {"lanes", 1}, {"chunk", 32},
                                                 {"segs", 1}}},
                                   &why));
      EXPECT_NE(why.find("32-bit offsets"), std::string::npos) << why;
      EXPECT_NE(op.tuning.heuristic(huge).get("algo"), 2);
    }
    // 65000 steps: no vector chunks for algos 0 and 1 (4 states per thread with segments); the forward's
    // tile kernel takes any multiple of 8 steps
    if (fwd) EXPECT_EQ(op.tuning.heuristic(ps[12]).get("algo"), 2) << name;
    else EXPECT_EQ(op.tuning.heuristic(ps[12]).get("lanes"), 4) << name;
    EXPECT_EQ(op.tuning.heuristic(ps[0]).get("segs"), 1) << name;
  }
}

// Few channels, short sequences (where algo 0 ran before; issue 33's small Mamba shapes): algo 1 at 2
// states per thread with segments filling 8192 channel-segments; short sequences with many channels
// take the lanes that give 48k threads.
TEST(SelectiveScan, HeuristicForShortSequences) {
  auto heuristic = [](const char* name, int64_t b, int64_t d, int64_t t) {
    const OpDef& op = Registry::global().get(name);
    CompileRequest r;
    r.op = name;
    r.dtype = DType::bf16;
    r.params = {{"dstate", int64_t(16)}, {"batch", b}, {"dim", d}, {"seqlen", t}, {"delta_softplus", true}};
    return op.tuning.heuristic(problem_from_request(op, r));
  };
  const char* bwd = "selective_scan.bwd";
  const char* fwd = "selective_scan.fwd";
  for (auto [b, d, t, segs] : std::vector<std::array<int64_t, 4>>{
           {1, 1024, 2000, 8}, {1, 2048, 512, 4}, {2, 2048, 700, 2}, {4, 1536, 1000, 1}, {3, 1000, 1000, 2}}) {
    const Config c = heuristic(bwd, b, d, t);
    EXPECT_EQ(c.get("algo"), 1) << b << "x" << d << "x" << t;
    EXPECT_EQ(c.get("lanes"), 8) << b << "x" << d << "x" << t;
    EXPECT_EQ(c.get("segs"), segs) << b << "x" << d << "x" << t;
  }
  EXPECT_EQ(heuristic(bwd, 1, 1024, 100).get("algo"), 0);  // under 128 steps: the warp scan
  EXPECT_EQ(heuristic(fwd, 1, 1024, 2000).get("segs"), 8);
  EXPECT_EQ(heuristic(fwd, 1, 1024, 2000).get("lanes"), 8);
  EXPECT_EQ(heuristic(fwd, 4, 1536, 1004).get("algo"), 0);  // 6144 channels: the warp scan stays ahead
  EXPECT_EQ(heuristic(fwd, 2, 4096, 333).get("lanes"), 8);
  // 8192..16384 channels under 512 steps of whole 8-step vectors: the wide kernel (4 warps)
  EXPECT_EQ(heuristic(fwd, 16, 768, 256).get("algo"), 3);
  EXPECT_EQ(heuristic(fwd, 16, 768, 256).get("warps"), 4);
  EXPECT_EQ(heuristic(fwd, 16, 768, 264).get("algo"), 3);
  EXPECT_EQ(heuristic(fwd, 16, 1024, 504).get("algo"), 3);
  EXPECT_EQ(heuristic(fwd, 9, 1000, 40).get("algo"), 3);
  EXPECT_EQ(heuristic(fwd, 16, 768, 260).get("algo"), 1);  // not whole vectors: algo 1 as before
  EXPECT_EQ(heuristic(fwd, 16, 768, 260).get("lanes"), 4);
  EXPECT_EQ(heuristic(fwd, 16, 768, 512).get("algo"), 1);  // from 512 steps
  EXPECT_EQ(heuristic(fwd, 24, 768, 256).get("algo"), 1);  // past 16384 channels
  EXPECT_EQ(heuristic(fwd, 2, 4096, 336).get("algo"), 2);  // 8192 channels: the tile kernel's
  EXPECT_EQ(heuristic(bwd, 16, 768, 256).get("algo"), 1);  // the backward has no wide kernel
  EXPECT_EQ(heuristic(fwd, 8, 2048, 2048).get("lanes"), 2);  // long sequences as before
  // the tile kernel: 4 warps up to 512 steps (whole 64-step tiles), 6 beyond
  EXPECT_EQ(heuristic(fwd, 1, 2048, 512).get("algo"), 2);
  EXPECT_EQ(heuristic(fwd, 1, 2048, 512).get("warps"), 4);
  EXPECT_EQ(heuristic(fwd, 1, 2048, 520).get("warps"), 6);
}

// The wide kernel (algo=wide, forward only) takes 16-bit data, dstate 16, whole 8-step vectors, 4 or 8
// warps of 8 channels of one B/C group and rows that 32-bit offsets reach; each rule names itself.
TEST(SelectiveScan, WideKernelRules) {
  const OpDef& op = Registry::global().get("selective_scan.fwd");
  auto wide = [](int64_t warps, int64_t items = 4) {
    return Config{{{"algo", 3}, {"warps", warps}, {"items", items}, {"lanes", 1}, {"chunk", 32}, {"segs", 1}}};
  };
  auto request = [&](int64_t b, int64_t d, int64_t t) {
    CompileRequest r;
    r.op = "selective_scan.fwd";
    r.dtype = DType::bf16;
    r.params = {{"dstate", int64_t(16)}, {"batch", b}, {"dim", d}, {"seqlen", t}, {"delta_softplus", true}};
    return r;
  };
  auto why_not = [&](const CompileRequest& r, const Config& c) {
    std::string why;
    return op.tuning.valid(problem_from_request(op, r), c, &why) ? std::string("valid") : why;
  };
  CompileRequest r = request(16, 768, 256);
  for (int64_t w : {4, 8}) EXPECT_EQ(why_not(r, wide(w)), "valid") << w;
  for (int64_t w : {2, 6}) EXPECT_NE(why_not(r, wide(w)).find("4 or 8 warps"), std::string::npos) << w;
  EXPECT_NE(why_not(r, wide(4, 8)).find("does not use items"), std::string::npos);
  for (int64_t t : {1, 2, 260}) {  // seqlen 1, 2 and a non-multiple of 8: refused, and not the heuristic's
    CompileRequest s = request(16, 768, t);
    EXPECT_NE(why_not(s, wide(4)).find("seqlen a multiple of 8"), std::string::npos) << t;
    EXPECT_NE(op.tuning.heuristic(problem_from_request(op, s)).get("algo"), 3) << t;
  }
  CompileRequest f32 = r;
  f32.dtype = DType::f32;
  EXPECT_NE(why_not(f32, wide(4)).find("16-bit"), std::string::npos);
  EXPECT_NE(op.tuning.heuristic(problem_from_request(op, f32)).get("algo"), 3);
  CompileRequest n8 = r;
  n8.params.set("dstate", int64_t(8));
  EXPECT_NE(why_not(n8, wide(4)).find("dstate 16"), std::string::npos);
  // 2 groups of 32 channels: blocks of 32 channels (4 warps) fit a group, of 64 do not; of 48, neither
  CompileRequest grouped = request(16, 64, 256);
  grouped.params.set("groups", int64_t(2));
  EXPECT_EQ(why_not(grouped, wide(4)), "valid");
  EXPECT_NE(why_not(grouped, wide(8)).find("one B/C group"), std::string::npos);
  grouped.params.set("dim", int64_t(96));
  EXPECT_NE(why_not(grouped, wide(4)).find("one B/C group"), std::string::npos);
  // a fixed B (or C) beside a variable one: one variable tensor's rows staged
  CompileRequest fixed_b = r;
  fixed_b.alt_shapes = {"B"};
  EXPECT_EQ(why_not(fixed_b, wide(4)), "valid");
  // 64 channels of 2^25 steps overflow an int (8 warps); 32 channels do not
  CompileRequest longest = request(1, 64, int64_t(1) << 25);
  EXPECT_NE(why_not(longest, wide(8)).find("32-bit offsets"), std::string::npos);
  EXPECT_EQ(why_not(longest, wide(4)), "valid");
  EXPECT_FALSE(op.kernels(problem_from_request(op, r), wide(4)).empty());
}

// algo=tile with lanes=8 (2 states a lane, 4 channels a block, 2 or 4 warps): its own rules, its own kernel (a
// third template argument; lanes=1 keeps the kernel name it had), a launch of one block per 4 channels.
TEST(SelectiveScan, TileKernelTwoStatesALaneRules) {
  const OpDef& op = Registry::global().get("selective_scan.fwd");
  auto tile = [](int64_t warps, int64_t lanes) {
    return Config{{{"algo", 2}, {"warps", warps}, {"items", 4}, {"lanes", lanes}, {"chunk", 32}, {"segs", 1}}};
  };
  CompileRequest r;
  r.op = "selective_scan.fwd";
  r.dtype = DType::bf16;
  r.params = {{"dstate", int64_t(16)}, {"batch", int64_t(1)}, {"dim", int64_t(2048)}, {"seqlen", int64_t(512)},
              {"delta_softplus", true}};
  auto why_not = [&](const CompileRequest& req, const Config& c) {
    std::string why;
    return op.tuning.valid(problem_from_request(op, req), c, &why) ? std::string("valid") : why;
  };
  for (int64_t w : {2, 4}) EXPECT_EQ(why_not(r, tile(w, 8)), "valid") << w;
  for (int64_t w : {6, 8}) EXPECT_NE(why_not(r, tile(w, 8)).find("lanes=8 runs 2 or 4 warps"), std::string::npos) << w;
  EXPECT_NE(why_not(r, tile(2, 1)).find("4, 6 or 8 warps"), std::string::npos);
  for (int64_t l : {2, 4, 16}) EXPECT_NE(why_not(r, tile(4, l)).find("lanes 1"), std::string::npos) << l;
  // 2 groups of 4 channels: a block of 4 channels fits a group, one of 8 does not
  CompileRequest grouped = r;
  grouped.params.set("dim", int64_t(8));
  grouped.params.set("groups", int64_t(2));
  EXPECT_EQ(why_not(grouped, tile(4, 8)), "valid");
  EXPECT_NE(why_not(grouped, tile(4, 1)).find("one B/C group"), std::string::npos);
  const Problem p = problem_from_request(op, r);
  const auto two = op.kernels(p, tile(4, 8)), four = op.kernels(p, tile(4, 1));
  ASSERT_EQ(two.size(), 1u);
  ASSERT_EQ(four.size(), 1u);
  EXPECT_NE(two[0].name_expression().find(", 4, 2>"), std::string::npos) << two[0].name_expression();
  EXPECT_NE(four[0].name_expression().find(", 4>"), std::string::npos) << four[0].name_expression();
  // the heuristic keeps lanes=1 (lanes=8 is a config until an H100 run says otherwise)
  EXPECT_EQ(op.tuning.heuristic(p).get("lanes"), 1);
}

TEST(SelectiveScan, EveryCasePlansItsKernels) {
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd", "selective_scan.step"}) {
    const OpDef& op = Registry::global().get(name);
    EXPECT_TRUE(std::any_of(op.cases.begin(), op.cases.end(), [](const Case& c) { return c.representative; }));
    for (const auto& cs : op.cases) {
      for (DType dt : op.dtypes) {
        CompileRequest r;
        r.op = name;
        r.dtype = dt;
        r.without = cs.without;
        r.tensor_dtypes = cs.tensor_dtypes;
        r.alt_shapes = cs.alt_shapes;
        for (const auto& [k, v] : cs.params.items()) r.params.set(k, v);
        for (const auto& [k, v] : cs.dims) r.params.set(k, v);
        Problem p = problem_from_request(op, r);
        auto configs = op.tuning.enumerate(p);
        EXPECT_FALSE(configs.empty()) << name << " " << cs.name;
        Config h = op.tuning.heuristic(p);
        std::string why;
        EXPECT_TRUE(op.tuning.valid(p, h, &why)) << name << " " << cs.name << ": " << why;
        EXPECT_FALSE(op.kernels(p, h).empty());
      }
    }
  }
}

// One header per algorithm: editing the step kernel (or the tile kernel) changes the cache key of its own
// binaries and of no other scan kernel (the key hashes a header's whole include tree; with every kernel
// in one header, an edit to the step rebuilt every scan binary).
TEST(SelectiveScan, AnAlgorithmsHeaderEditChangesOnlyItsKernelsKeys) {
  kspec::testing::TempDir tmp;
  const std::string root = tmp.path() + "/templates";
  std::filesystem::copy(std::string(KSPEC_SOURCE_DIR) + "/templates", root,
                        std::filesystem::copy_options::recursive);
  auto problem = [](const char* name, bool with_seqlen) {
    const OpDef& op = Registry::global().get(name);
    CompileRequest r;
    r.op = name;
    r.dtype = DType::bf16;
    r.params = {{"dstate", int64_t(16)}};
    if (with_seqlen) r.params.set("seqlen", int64_t(1024));
    return problem_from_request(op, r);
  };
  auto config = [](int64_t algo, int64_t warps) {
    return Config{{{"algo", algo}, {"warps", warps}, {"items", 4}, {"lanes", 2}, {"chunk", 16}, {"segs", 2}}};
  };
  std::vector<jit::KernelSpec> specs;
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd"}) {
    const Problem p = problem(name, true);
    for (int64_t algo : {0, 1, 2, 3}) {
      // the tile and wide kernels are forward only
      if (algo >= 2 && std::string(name) == "selective_scan.bwd") continue;
      for (auto& k : p.op->kernels(p, config(algo, algo == 2 ? 6 : 4))) specs.push_back(k);
    }
  }
  const Problem step = problem("selective_scan.step", false);
  for (auto& k : step.op->kernels(step, step.op->tuning.heuristic(step))) specs.push_back(k);
  auto keys = [&] {
    std::map<std::string, std::string> m;
    auto src = jit::TemplateSource::from_directory(root);
    for (const auto& k : specs) m[k.name_expression()] = jit::compute_content_key(k, src);
    return m;
  };
  auto changed = [](const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
    std::vector<std::string> names;
    for (const auto& [name, key] : a)
      if (b.at(name) != key) names.push_back(name.substr(0, name.find('<')));
    return names;
  };
  const auto k0 = keys();
  // Every scan kernel once: 4 forward algorithms and the segments' forward pass, 2 backward algorithms, the
  // segments' backward pass, the backward's reduce and zero kernels, the step.
  ASSERT_EQ(k0.size(), 11u);
  // Each header edited in turn changes the keys of its own kernels only.
  const std::vector<std::pair<std::string, std::vector<std::string>>> edits = {
      {"step.cuh", {"kspec::selective_scan_step_kernel"}},
      {"tile.cuh", {"kspec::selective_scan_fwd_tile_kernel"}},
      {"wide.cuh", {"kspec::selective_scan_fwd_wide_kernel"}},
      {"packed.cuh", {"kspec::selective_scan_fwd_tile_kernel", "kspec::selective_scan_fwd_wide_kernel"}},
      // the one pack2 (common/pack.cuh, shared with the tensor-core fragments): the kernels that store packed
      {"../common/pack.cuh", {"kspec::selective_scan_fwd_tile_kernel", "kspec::selective_scan_fwd_wide_kernel"}},
      {"sequential_fwd.cuh", {"kspec::selective_scan_fwd_seq_kernel"}},
      {"sequential_bwd.cuh", {"kspec::selective_scan_bwd_seq_kernel"}},
      {"sequential_segments.cuh", {"kspec::selective_scan_seg_bwd_kernel", "kspec::selective_scan_seg_fwd_kernel"}}};
  auto before = k0;
  for (const auto& [header, kernels] : edits) {
    std::ofstream(root + "/selective_scan/" + header, std::ios::app) << "\n// edited\n";
    const auto after = keys();
    EXPECT_EQ(changed(before, after), kernels) << header;
    before = after;
  }
}

// Each kernel's argument list, read from ScanParams by one function per signature, names the kernel's
// parameters in the template's order (a launch copies them by position: a swapped pair would pass one
// tensor for another).
TEST(SelectiveScan, ArgumentListsFollowTheKernelSignatures) {
  using namespace kspec::scan;
  ScanParams s;
  const std::map<const void*, std::string> field = {
      {&s.u, "u"}, {&s.delta, "delta"}, {&s.A, "A"}, {&s.B, "B"}, {&s.C, "C"}, {&s.D, "D"}, {&s.z, "z"},
      {&s.delta_bias, "delta_bias"}, {&s.h0, "h0"}, {&s.out, "out"}, {&s.last_state, "last_state"},
      {&s.states, "states"}, {&s.dout, "dout"}, {&s.dlast_state, "dlast_state"}, {&s.du, "du"},
      {&s.ddelta, "ddelta"}, {&s.dz, "dz"}, {&s.dh0, "dh0"}, {&s.dB_acc, "dB_acc"}, {&s.dC_acc, "dC_acc"},
      {&s.partials, "partials"}, {&s.given, "given"}, {&s.seg_h, "seg_h"}, {&s.seg_g, "seg_g"},
      {&s.seg_dt, "seg_dt"}, {&s.seg_ready, "seg_ready"}, {&s.dim, "dim"}, {&s.seqlen, "seqlen"},
      {&s.channels_per_group, "channels_per_group"}, {&s.groups, "groups"}, {&s.seg_len, "seg_len"},
      {&s.nsegs, "nsegs"}};
  auto names = [&](auto args) {
    std::vector<std::string> out;
    for (void* a : args) out.push_back(field.at(a));
    return out;
  };
  auto signature = [](const std::string& header, const std::string& kernel) {
    std::ifstream in(std::string(KSPEC_SOURCE_DIR) + "/templates/selective_scan/" + header);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::smatch m;
    EXPECT_TRUE(std::regex_search(text, m, std::regex(kernel + "\\(([^)]*)\\)"))) << kernel;
    std::vector<std::string> out;
    const std::string params = m[1];
    const std::regex name("(\\w+)\\s*(,|$)");
    for (auto it = std::sregex_iterator(params.begin(), params.end(), name); it != std::sregex_iterator(); ++it)
      out.push_back((*it)[1]);
    return out;
  };
  EXPECT_EQ(names(fwd_args(s)), signature("warp_scan.cuh", "selective_scan_fwd_kernel"));
  EXPECT_EQ(names(fwd_args(s)), signature("tile.cuh", "selective_scan_fwd_tile_kernel"));
  EXPECT_EQ(names(fwd_args(s)), signature("wide.cuh", "selective_scan_fwd_wide_kernel"));
  EXPECT_EQ(names(fwd_seq_args(s)), signature("sequential_fwd.cuh", "selective_scan_fwd_seq_kernel"));
  EXPECT_EQ(names(bwd_args(s)), signature("warp_scan.cuh", "selective_scan_bwd_kernel"));
  EXPECT_EQ(names(bwd_seq_args(s)), signature("sequential_bwd.cuh", "selective_scan_bwd_seq_kernel"));
  EXPECT_EQ(names(seg_fwd_args(s)), signature("sequential_segments.cuh", "selective_scan_seg_fwd_kernel"));
  EXPECT_EQ(names(seg_bwd_args(s)), signature("sequential_segments.cuh", "selective_scan_seg_bwd_kernel"));
}
