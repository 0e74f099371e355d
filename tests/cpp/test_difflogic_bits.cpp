// difflogic GroupSum and bit packing (api/ops/difflogic/bits.cpp). Without a GPU: output inference, the
// messages for bad input (k not dividing n, tau, word counts, word dtypes), the binarize rule of the
// reference, and the precompile plan compiling for sm_90 without spills. On a GPU (skipped without one):
// pack (every activation dtype, w = 32 and 64, B not a multiple of w, values at and around 0.5, NaN),
// unpack and packed.group_sum equal to the integer reference bit for bit; pack -> packed.fwd ->
// packed.group_sum equal to the hard layer's GroupSum; group_sum.fwd on {0, 1} exact and two runs bitwise
// equal; group_sum.bwd on an expanded (stride 0) gradient. (group_sum.fwd/.bwd against the float64
// reference on every case: the generic checker.)
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;
using kspec::testing::message_of;

namespace {

TensorView view(uintptr_t slot, DType dt, std::initializer_list<int64_t> shape) {
  return TensorView(fake(slot << 28), dt, shape, 0);
}

void expect_in(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

void validate(const char* op, const std::vector<TensorView>& in, const std::vector<TensorView>& out,
              const Params& params = {}) {
  validate_call(Registry::global().get(op), in, out, params, nullptr);
}

}  // namespace

// GroupSum's dims are its input's (x viewed as [batch, k, n / k]); pack's word count comes from the
// output given.
TEST(DiffLogicBits, OutputsAndTheirDims) {
  auto y = infer_outputs("difflogic.group_sum.fwd", {view(1, DType::bf16, {4, 10, 100})});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(y[0].shape, (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(y[0].dtype, DType::bf16);
  Call c = validate_call(Registry::global().get("difflogic.group_sum.fwd"), {view(1, DType::bf16, {4, 10, 100})},
                         {view(2, DType::f32, {4, 10})}, {}, nullptr);
  EXPECT_EQ(c.problem.dtype("y"), DType::f32);  // x's dtype or float32
  // The backward reads dy through its strides: an expanded [batch, k] gradient (stride 0) is accepted.
  auto dx = infer_outputs("difflogic.group_sum.bwd",
                          {TensorView::strided(fake(1 << 28), DType::f16, {4, 10, 100}, {10, 1, 0}, 0)});
  EXPECT_EQ(dx[0].shape, (std::vector<int64_t>{4, 10, 100}));
  Call p = validate_call(Registry::global().get("difflogic.pack"), {view(1, DType::f16, {100, 7})},
                         {view(2, DType::i64, {7, 2})}, {}, nullptr);
  EXPECT_EQ(p.problem.dim("words"), 2);
}

TEST(DiffLogicBits, ValidationNamesTheArgument) {
  expect_in(message_of([] {
              validate("difflogic.group_sum.fwd", {view(1, DType::f32, {4, 10, 10})}, {view(2, DType::f32, {4, 10})},
                       {{"tau", 0.0}});
            }),
            {"parameter 'tau' must be > 0"});
  expect_in(message_of([] { validate("difflogic.group_sum.fwd", {view(1, DType::bf16, {4, 10, 10})}, {view(2, DType::f16, {4, 10})}); }),
            {"output 'y'"});
  expect_in(message_of([] { validate("difflogic.group_sum.fwd", {view(1, DType::f32, {4, 100})}, {view(2, DType::f32, {4, 10})}); }),
            {"input 'x'", "[batch, k, m]"});
  expect_in(message_of([] { validate("difflogic.group_sum.bwd", {view(1, DType::f32, {4, 3, 5})}, {view(2, DType::bf16, {4, 3, 6})}); }),
            {"output 'dx'"});
  EXPECT_EQ(message_of([] {
              validate("difflogic.packed.group_sum", {view(1, DType::i32, {100, 4})}, {view(2, DType::i32, {100, 10})});
            }),
            "");
  expect_in(message_of([] {
              validate("difflogic.packed.group_sum", {view(1, DType::i64, {100, 4})}, {view(2, DType::i32, {100, 10})});
            }),
            {"batch = 100 samples need 2 words of 64 bits per row, but 'x' has 4"});
  expect_in(message_of([] {
              validate("difflogic.packed.group_sum", {view(1, DType::i32, {100, 4})}, {view(2, DType::i32, {100, 3})});
            }),
            {"k = 3 groups must divide n = 100", "rows"});
  expect_in(message_of([] { validate("difflogic.pack", {view(1, DType::f32, {33, 5})}, {view(2, DType::i32, {5, 1})}); }),
            {"batch = 33 samples need 2 words of 32 bits per row, but 'words' has 1"});
  expect_in(message_of([] { validate("difflogic.pack", {view(1, DType::f32, {33, 5})}, {view(2, DType::f32, {5, 2})}); }),
            {"output 'words'", "int32"});
  expect_in(message_of([] { validate("difflogic.pack", {view(1, DType::i32, {33, 5})}, {view(2, DType::i32, {5, 2})}); }),
            {"input 'x'"});
  expect_in(message_of([] { validate("difflogic.unpack", {view(1, DType::i64, {5, 2})}, {view(2, DType::bf16, {200, 5})}); }),
            {"batch = 200 samples need 4 words of 64 bits per row, but 'words' has 2"});
  expect_in(message_of([] { validate("difflogic.unpack", {view(1, DType::i64, {5, 2})}, {view(2, DType::bf16, {100, 6})}); }),
            {"output 'x'"});
}

TEST(DiffLogicBits, BinarizeThresholdsAtOneHalf) {
  const std::vector<double> x = {0.0, 1.0, 0.5, std::nextafter(0.5, 1.0), 0.49, -3.0, 7.0, std::nan("")};
  EXPECT_EQ(ref::difflogic_binarize(x), (std::vector<double>{0, 1, 0, 1, 0, 0, 1, 0}));
}

// What `kspec precompile --all` builds for these ops (every dtype, every config of the representative
// cases) compiles for sm_90 without spills or a stack frame.
TEST(DiffLogicBits, PrecompilePlanCompilesWithoutSpills) {
  const std::vector<std::string> ops = {"difflogic.group_sum.fwd", "difflogic.group_sum.bwd",
                                        "difflogic.packed.group_sum", "difflogic.pack", "difflogic.unpack"};
  std::map<std::string, int> requests;
  for (const auto& r : precompile_plan({"sm_90"}, ops)) {
    ++requests[r.op];
    EXPECT_EQ(kspec::testing::expect_compiles_without_spills(r).size(), 1u) << r.op;
  }
  // 3 dtypes x 2 configs (+ the float32 y / dy rows: 2 more dtypes x 2 configs); 2 word widths x 2
  // configs; 3 dtypes x 2 widths x 2 configs.
  EXPECT_EQ(requests["difflogic.group_sum.fwd"], 10);
  EXPECT_EQ(requests["difflogic.group_sum.bwd"], 10);
  EXPECT_EQ(requests["difflogic.packed.group_sum"], 4);
  EXPECT_EQ(requests["difflogic.pack"], 12);
  EXPECT_EQ(requests["difflogic.unpack"], 12);
}

namespace {

using DevBuf = kspec::testing::DeviceBuffer<>;

std::unique_ptr<DevBuf> device_copy(const std::vector<unsigned char>& bytes) {
  auto d = std::make_unique<DevBuf>(bytes.size());
  d->upload(bytes.data(), bytes.size());
  return d;
}

// Words as the device holds them: w / 8 little-endian bytes each.
std::vector<unsigned char> word_bytes(const std::vector<uint64_t>& words, int w) {
  std::vector<unsigned char> bytes(words.size() * (w / 8));
  for (size_t j = 0; j < words.size(); ++j) std::memcpy(&bytes[j * (w / 8)], &words[j], w / 8);
  return bytes;
}

DType word_dtype(int w) { return w == 32 ? DType::i32 : DType::i64; }

// Activations with every kind of value packing must decide: 0, 1, 0.5, just above and below it, far out,
// NaN; rounded to the dtype.
std::vector<double> activations(int64_t B, int64_t n, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double specials[] = {0.0, 1.0, 0.5, 0.5078125, 0.4921875, -2.0, 3.0, std::nan("")};
  std::uniform_int_distribution<int> pick(0, 15);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<double> x(B * n);
  for (double& v : x) {
    const int k = pick(rng);
    v = k < 8 ? specials[k] : unit(rng);
  }
  quantize(dt, x);
  return x;
}

}  // namespace

// pack and unpack (every activation dtype, w = 32, 64; B not a multiple of w) equal the reference bit for
// bit, padding bits zero; unpack(pack(x)) is binarize(x).
TEST(DiffLogicBitsGpu, PackAndUnpackEqualTheReferenceBitForBit) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int w : {32, 64})
      for (int64_t B : {1, 33, 64, 100, 1024})
        for (int64_t n : {1, 7, 33, 4097}) {
          if (B * n > 200000) continue;
          const int64_t W = (B + w - 1) / w;
          const auto x = activations(B, n, dt, static_cast<uint64_t>(B * 7 + n + w));
          std::vector<unsigned char> bytes;
          encode(dt, x, bytes);
          auto xd = device_copy(bytes);
          DevBuf words(W * n * (w / 8)), back(B * n * dtype_size(dt));
          words.poison();
          back.poison();
          call("difflogic.pack", {TensorView(xd->ptr(), dt, {B, n}, 0)},
               {TensorView(words.ptr(), word_dtype(w), {n, W}, 0)});
          call("difflogic.unpack", {TensorView(words.ptr(), word_dtype(w), {n, W}, 0)},
               {TensorView(back.ptr(), dt, {B, n}, 0)});
          CU_CHECK(cuCtxSynchronize());
          const auto bits = ref::difflogic_binarize(x);
          const auto want = ref::difflogic_pack_ref(B, n, bits, w);
          const std::string what = std::string(dtype_short(dt)) + " w " + std::to_string(w) + " B " + std::to_string(B) +
                                   " n " + std::to_string(n);
          EXPECT_TRUE(words.download(W * n * (w / 8)) == word_bytes(want, w)) << "pack " << what;
          EXPECT_EQ(decode(dt, back.download(B * n * dtype_size(dt))), bits) << "unpack " << what;
        }
}

// packed.group_sum equals the reference's counts; with pack and three packed.fwd layers before it, it
// equals GroupSum of the hard layers on activations.
TEST(DiffLogicBitsGpu, PackedGroupSumCountsEqualTheReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (int w : {32, 64})
    for (int64_t B : {1, 33, 100, 1024}) {
      const int64_t W = (B + w - 1) / w, n = 40, k = 5;
      std::mt19937_64 rng(static_cast<uint64_t>(B + w));
      std::bernoulli_distribution bit(0.5);
      std::vector<double> x(B * n);
      for (double& v : x) v = bit(rng);
      auto cur = device_copy(word_bytes(ref::difflogic_pack_ref(B, n, x, w), w));
      int64_t width = n;
      std::normal_distribution<double> normal(0.0, 1.0);
      for (int64_t n_out : {300, 35}) {
        std::vector<double> logits(n_out * 16);
        for (double& v : logits) v = normal(rng);
        quantize(DType::f32, logits);
        std::vector<int32_t> a, b;
        std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(width - 1));
        for (int64_t g = 0; g < n_out; ++g) {
          a.push_back(wire(rng));
          b.push_back(wire(rng));
        }
        std::vector<unsigned char> lbytes;
        encode(DType::f32, logits, lbytes);
        auto l = device_copy(lbytes);
        DevBuf ad(a.size() * 4), bd(b.size() * 4);
        ad.upload(a.data(), a.size() * 4);
        bd.upload(b.data(), b.size() * 4);
        auto next = std::make_unique<DevBuf>(n_out * W * (w / 8));
        call("difflogic.packed.fwd",
             {TensorView(cur->ptr(), word_dtype(w), {width, W}, 0), TensorView(l->ptr(), DType::f32, {n_out, 16}, 0),
              TensorView(ad.ptr(), DType::i32, {n_out}, 0), TensorView(bd.ptr(), DType::i32, {n_out}, 0)},
             {TensorView(next->ptr(), word_dtype(w), {n_out, W}, 0)}, {{"batch", B}});
        x = ref::difflogic_layer_fwd_ref(B, width, x, logits, a, b, ref::DiffLogicMode::Hard);
        cur = std::move(next);
        width = n_out;
      }
      DevBuf counts(B * k * 4);
      counts.poison();
      call("difflogic.packed.group_sum", {TensorView(cur->ptr(), word_dtype(w), {width, W}, 0)},
           {TensorView(counts.ptr(), DType::i32, {B, k}, 0)});
      CU_CHECK(cuCtxSynchronize());
      const auto got = counts.download(B * k * 4);
      std::vector<int32_t> c(B * k);
      std::memcpy(c.data(), got.data(), got.size());
      const auto want = ref::difflogic_group_sum_ref(B, width, x, k, 1.0);
      EXPECT_EQ(std::vector<double>(c.begin(), c.end()), want) << "w " << w << " B " << B;
    }
}

// GroupSum of {0, 1} activations is exact in float32 (integer sums below 2^24, tau a power of two), and a
// rerun gives the same bits.
TEST(DiffLogicBitsGpu, GroupSumOnBitsIsExactAndReproducible) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t B = 33, n = 64000, k = 10;
    std::mt19937_64 rng(11);
    std::bernoulli_distribution bit(0.5);
    std::vector<double> x(B * n);
    for (double& v : x) v = bit(rng);
    std::vector<unsigned char> bytes;
    encode(dt, x, bytes);
    auto xd = device_copy(bytes);
    DevBuf y(B * k * 4);
    std::vector<unsigned char> first;
    for (int run = 0; run < 2; ++run) {
      y.poison();
      call("difflogic.group_sum.fwd", {TensorView(xd->ptr(), dt, {B, k, n / k}, 0)},
           {TensorView(y.ptr(), DType::f32, {B, k}, 0)}, {{"tau", 4.0}});
      CU_CHECK(cuCtxSynchronize());
      const auto got = y.download(B * k * 4);
      if (run == 0) {
        EXPECT_EQ(decode(DType::f32, got), ref::difflogic_group_sum_ref(B, n, x, k, 4.0)) << dtype_short(dt);
        first = got;
      } else {
        EXPECT_TRUE(got == first) << "two runs differ " << dtype_short(dt);
      }
    }
  }
}

// The backward on the gradient of y [B, k] expanded over each group (stride 0, no copy) equals GroupSum's
// backward dx[s, j] = dy[s, j / m] / tau, in any dx dtype.
TEST(DiffLogicBitsGpu, GroupSumBackwardOfAnExpandedGradient) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 33, k = 17, m = 241;
  std::mt19937_64 rng(12);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (DType dt : {DType::f32, DType::bf16}) {
    std::vector<double> dy(B * k);
    for (double& v : dy) v = normal(rng);
    quantize(dt, dy);
    std::vector<unsigned char> bytes;
    encode(dt, dy, bytes);
    auto dyd = device_copy(bytes);
    DevBuf dx(B * k * m * 4);
    dx.poison();
    call("difflogic.group_sum.bwd", {TensorView::strided(dyd->ptr(), dt, {B, k, m}, {k, 1, 0}, 0)},
         {TensorView(dx.ptr(), DType::f32, {B, k, m}, 0)}, {{"tau", 3.0}});
    CU_CHECK(cuCtxSynchronize());
    const auto want = ref::difflogic_group_sum_bwd_ref(B, k * m, dy, k, 3.0);
    EXPECT_LE(rel_error(decode(DType::f32, dx.download(B * k * m * 4)), want), 1e-6) << dtype_short(dt);
  }
}
