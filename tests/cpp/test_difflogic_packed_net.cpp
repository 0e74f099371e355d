// difflogic.packed.net (api/ops/difflogic/packed_net.cpp). Without a GPU: the messages for bad input (a
// layer's logits or wires of the wrong shape, k not dividing the last width, the word count), the tuning
// space (algo=layers carries canonical chunk/inflight; the heuristics' measured picks), and every specialization of
// the precompile plan compiling for sm_80 and sm_90 without spills. On a GPU (skipped without one): both
// algorithms, every legal config, w = 32 and 64, B from 1 to several chunks (not a multiple of w), a wire
// out of range, equal to difflogic_packed_fwd_ref chained over the layers and then
// difflogic_packed_group_sum_ref, bit for bit, and a rerun equal to the first run.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "api/src/op.h"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

constexpr const char* kOp = "difflogic.packed.net";

void* fake(uintptr_t slot) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000) + (slot << 28)); }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_in(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

// A network's views on fake pointers: x [n_in, words], logits[l] [widths[l], 16], a[l], b[l] [wires[l]].
struct FakeNet {
  std::vector<TensorView> logits, a, b;
  FakeNet(const std::vector<int64_t>& widths, const std::vector<int64_t>& wires, int64_t logit_cols = 16) {
    for (size_t l = 0; l < widths.size(); ++l) {
      logits.emplace_back(fake(10 + 3 * l), DType::f32, std::initializer_list<int64_t>{widths[l], logit_cols}, 0);
      a.emplace_back(fake(11 + 3 * l), DType::i32, std::initializer_list<int64_t>{wires[l]}, 0);
      b.emplace_back(fake(12 + 3 * l), DType::i32, std::initializer_list<int64_t>{wires[l]}, 0);
    }
  }
  std::vector<TensorView> inputs(DType words_dt, int64_t n_in, int64_t words) const {
    return {TensorView(fake(1), words_dt, {n_in, words}, 0), TensorView::list(logits.data(), int64_t(logits.size())),
            TensorView::list(a.data(), int64_t(a.size())), TensorView::list(b.data(), int64_t(b.size()))};
  }
};

std::string validate_net(const FakeNet& net, DType dt, int64_t n_in, int64_t words, int64_t B, int64_t k) {
  return message_of([&] {
    validate_call(Registry::global().get(kOp), net.inputs(dt, n_in, words), {TensorView(fake(2), DType::i32, {B, k}, 0)},
                  {}, nullptr);
  });
}

}  // namespace

TEST(DiffLogicPackedNet, ValidationNamesTheArgument) {
  EXPECT_EQ(validate_net(FakeNet({300, 40}, {300, 40}), DType::i32, 100, 4, 100, 10), "");
  EXPECT_EQ(validate_net(FakeNet({300, 40}, {300, 40}), DType::i64, 100, 2, 100, 10), "");
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}), DType::i64, 100, 4, 100, 10),
            {"batch = 100 samples (counts' rows) need 2 words of 64 bits per row, but input 'x' has 4"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}), DType::i32, 100, 4, 100, 3),
            {"k = 3 groups (counts' columns) must divide the last layer's 40 gates"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 41}), DType::i32, 100, 4, 100, 10),
            {"input 'a'[1] must be [40]", "logits[1] has 40 rows"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}, 15), DType::i32, 100, 4, 100, 10),
            {"input 'logits'[0] must be [n_out, 16]"});
}

// algo=layers reads neither chunk nor inflight: only their canonical values are legal with it; the
// heuristic's config is legal.
TEST(DiffLogicPackedNet, TuningSpace) {
  const OpDef& op = Registry::global().get(kOp);
  CompileRequest req;
  req.op = kOp;
  req.arch = "sm_90";
  const Problem p = problem_from_request(op, req);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 0}, {"chunk", 128}, {"inflight", 2}}}, &why)) << why;
  EXPECT_FALSE(op.tuning.valid(p, Config{{{"algo", 0}, {"chunk", 64}, {"inflight", 2}}}, &why));
  EXPECT_NE(why.find("canonical values 128, 2"), std::string::npos) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 1}, {"chunk", 32}, {"inflight", 4}}}, &why)) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 2}, {"chunk", 64}, {"inflight", 8}}}, &why)) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 3}, {"chunk", 128}, {"inflight", 2}}}, &why)) << why;
  EXPECT_EQ(Config::parse("algo=early,chunk=64,inflight=2", op.info).get("algo"), 3);
  const Config h = op.tuning.heuristic(p);
  EXPECT_TRUE(op.tuning.valid(p, h, &why)) << why;
  // The measured defaults (H100, run 20): chunked at 128-byte rows, 2 chunks in flight; packed.fwd's rows kernel.
  EXPECT_EQ(h.get("algo"), 1);
  EXPECT_EQ(h.get("chunk"), 128);
  EXPECT_EQ(h.get("inflight"), 2);
  const OpDef& fwd = Registry::global().get("difflogic.packed.fwd");
  const Config f = fwd.tuning.heuristic(problem_from_request(fwd, [] {
    CompileRequest r;
    r.op = "difflogic.packed.fwd";
    r.arch = "sm_90";
    return r;
  }()));
  EXPECT_EQ(f.get("vec"), 1);
  EXPECT_EQ(f.get("threads"), 128);
}

// Every specialization `kspec precompile --all` builds for the op compiles for sm_80 and sm_90 without
// spills or a stack frame.
TEST(DiffLogicPackedNet, PrecompilePlanCompilesWithoutSpills) {
  std::map<std::string, int> kernels;
  for (const auto& r : precompile_plan({"sm_80", "sm_90"}, {kOp}))
    for (const auto& rep : kspec::testing::expect_compiles_without_spills(r)) ++kernels[rep.kernel];
  // algo=layers: the per-layer kernels at w = 32 and 64; chunked and chains: the ops kernel and a network kernel
  // per chunk (kChains false / true); early: the early kernel per chunk.
  for (const char* k : {"kspec::difflogic_packed_fwd_kernel<32, 256>", "kspec::difflogic_packed_fwd_kernel<64, 256>",
                        "kspec::difflogic_packed_ops_kernel<256>", "kspec::difflogic_packed_net_kernel<32, 256, false>",
                        "kspec::difflogic_packed_net_kernel<256, 256, false>",
                        "kspec::difflogic_packed_net_kernel<32, 256, true>",
                        "kspec::difflogic_packed_net_kernel<256, 256, true>",
                        "kspec::difflogic_packed_net_early_kernel<32, 256>",
                        "kspec::difflogic_packed_net_early_kernel<256, 256>"})
    EXPECT_GT(kernels[k], 0) << k;
}

namespace {

struct DevBuf {
  CUdeviceptr p = 0;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(std::max<size_t>(b, 16)) { CU_CHECK(cuMemAlloc(&p, bytes)); }
  ~DevBuf() { jit::driver().cuMemFree(p); }
  void* ptr() const { return reinterpret_cast<void*>(p); }
  void upload(const void* data, size_t n) { CU_CHECK(cuMemcpyHtoD(p, data, n)); }
  std::vector<unsigned char> download(size_t n) const {
    std::vector<unsigned char> v(n);
    CU_CHECK(cuMemcpyDtoH(v.data(), p, n));
    return v;
  }
  void poison() { CU_CHECK(cuMemsetD8(p, 0xA5, bytes)); }
};

template <typename T>
std::unique_ptr<DevBuf> device_copy(const std::vector<T>& v) {
  auto d = std::make_unique<DevBuf>(v.size() * sizeof(T));
  d->upload(v.data(), v.size() * sizeof(T));
  return d;
}

std::vector<unsigned char> word_bytes(const std::vector<uint64_t>& words, int w) {
  std::vector<unsigned char> bytes(words.size() * (w / 8));
  for (size_t j = 0; j < words.size(); ++j) std::memcpy(&bytes[j * (w / 8)], &words[j], w / 8);
  return bytes;
}

}  // namespace

// Widths 40 -> 300 -> 35 -> 50 (k = 5), one gate of the second layer with a wire out of range (zero bits:
// the reference runs it as op 0, FALSE, on wires 0, 0). B = 1, 33, 1000, 4224 and 5000 (20 chunks of 32 bytes:
// several rounds of every inflight, the last chunk partial; 1000 and 4224 with 16-byte rows, which
// algo=early's layer 1 reads straight from x, 4224's last chunk partial at every chunk size), x aligned and not.
TEST(DiffLogicPackedNetGpu, CountsEqualTheChainedReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const OpDef& op = Registry::global().get(kOp);
  const std::vector<int64_t> widths = {40, 300, 35, 50};
  const int64_t k = 5;
  std::mt19937_64 rng(30);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> wa, wb;
  for (size_t l = 1; l < widths.size(); ++l) {
    std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(widths[l - 1] - 1));
    logits.emplace_back(widths[l] * 16);
    for (float& v : logits.back()) v = normal(rng);
    wa.emplace_back();
    wb.emplace_back();
    for (int64_t g = 0; g < widths[l]; ++g) {
      wa.back().push_back(wire(rng));
      wb.back().push_back(wire(rng));
    }
  }
  wb[1][7] = static_cast<int32_t>(widths[1]);  // out of range
  std::vector<std::unique_ptr<DevBuf>> dev;
  std::vector<TensorView> lv, av, bv;
  for (size_t l = 0; l < logits.size(); ++l) {
    dev.push_back(device_copy(logits[l]));
    lv.emplace_back(dev.back()->ptr(), DType::f32, std::initializer_list<int64_t>{widths[l + 1], 16}, 0);
    dev.push_back(device_copy(wa[l]));
    av.emplace_back(dev.back()->ptr(), DType::i32, std::initializer_list<int64_t>{widths[l + 1]}, 0);
    dev.push_back(device_copy(wb[l]));
    bv.emplace_back(dev.back()->ptr(), DType::i32, std::initializer_list<int64_t>{widths[l + 1]}, 0);
  }
  for (int w : {32, 64})
    for (int64_t B : {1, 33, 1000, 4224, 5000}) {
      const int64_t W = (B + w - 1) / w;
      std::bernoulli_distribution bit(0.5);
      std::vector<double> x(B * widths[0]);
      for (double& v : x) v = bit(rng);
      std::vector<uint64_t> words = ref::difflogic_pack_ref(B, widths[0], x, w);
      const std::vector<unsigned char> xbytes = word_bytes(words, w);
      auto xd = device_copy(xbytes);
      // The same words one word past a 16-byte boundary: algo=early's layer 1 then leaves x to stage 0's copy
      // (its direct 16-byte loads need x and its rows aligned; B 1000 and 4224 have 16-byte rows).
      DevBuf xoff(xbytes.size() + 16);
      CU_CHECK(cuMemcpyHtoD(xoff.p + w / 8, xbytes.data(), xbytes.size()));
      for (size_t l = 0; l < logits.size(); ++l) {
        std::vector<int> ops = ref::difflogic_hard_ops(std::vector<double>(logits[l].begin(), logits[l].end()),
                                                       widths[l + 1]);
        std::vector<int32_t> a = wa[l], b = wb[l];
        for (int64_t g = 0; g < widths[l + 1]; ++g)
          if (a[g] >= widths[l] || b[g] >= widths[l]) ops[g] = a[g] = b[g] = 0;
        words = ref::difflogic_packed_fwd_ref(B, widths[l], words, w, ops, a, b);
      }
      const std::vector<int64_t> want = ref::difflogic_packed_group_sum_ref(B, widths.back(), words, w, k);
      CompileRequest req;
      req.op = kOp;
      const Problem p = problem_from_request(op, req);
      DevBuf counts(B * k * 4);
      for (const Config& c : op.tuning.enumerate(p))
        for (void* xp : {xd->ptr(), reinterpret_cast<void*>(xoff.p + w / 8)}) {
          std::vector<int32_t> first;
          for (int run = 0; run < 2; ++run) {
            counts.poison();
            CallOptions o;
            o.config = &c;
            call(kOp,
                 {TensorView(xp, w == 32 ? DType::i32 : DType::i64, {widths[0], W}, 0),
                  TensorView::list(lv.data(), int64_t(lv.size())), TensorView::list(av.data(), int64_t(av.size())),
                  TensorView::list(bv.data(), int64_t(bv.size()))},
                 {TensorView(counts.ptr(), DType::i32, {B, k}, 0)}, {}, nullptr, o);
            CU_CHECK(cuCtxSynchronize());
            std::vector<int32_t> got(B * k);
            const auto bytes = counts.download(B * k * 4);
            std::memcpy(got.data(), bytes.data(), bytes.size());
            const std::string what = "w " + std::to_string(w) + " B " + std::to_string(B) + " " + c.str(op.info) +
                                     (xp == xd->ptr() ? "" : " (x not 16-byte aligned)");
            EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), want) << what;
            if (run == 0) first = got;
            else EXPECT_EQ(got, first) << "rerun " << what;
          }
        }
    }
}
