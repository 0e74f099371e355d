// kspec::call's signature cache (api/src/plan.cpp): the compact key tells apart everything validation
// reads, and a call whose signature was validated before still gets the pointer checks (null data,
// overlap) with validation's own messages.
#include <gtest/gtest.h>

#include <cuda.h>

#include <string>
#include <vector>

#include "api/src/plan.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

namespace kspec {
namespace {

std::string key_of(const std::vector<TensorView>& in, const std::vector<TensorView>& out, const Params& p) {
  CallKey k;
  EXPECT_TRUE(append_call_key(k, Registry::global().get("norm_act.fwd"), in, out, p));
  return std::string(k.view());
}

TEST(CallCache, KeyTellsApartWhatValidationReads) {
  auto* base = reinterpret_cast<char*>(uintptr_t(1) << 32);
  TensorView x(base, DType::bf16, {4, 256}, 0), w(base + 4096, DType::bf16, {256}, 0);
  const Params p{{"norm", std::string("rmsnorm")}};
  const std::string k = key_of({x, w, TensorView()}, {}, p);
  // Another pointer of the same alignment: the same signature.
  TensorView x_moved(base + (1 << 20), DType::bf16, {4, 256}, 0);
  EXPECT_EQ(key_of({x_moved, w, TensorView()}, {}, p), k);
  // Each of these changes what validation or the plan would decide.
  TensorView x_odd(base + 2, DType::bf16, {4, 256}, 0);  // 2-byte aligned
  TensorView x_shape(base, DType::bf16, {8, 256}, 0);
  TensorView x_f16(base, DType::f16, {4, 256}, 0);
  TensorView x_dev(base, DType::bf16, {4, 256}, 1);
  TensorView x_strided = TensorView::strided(base, DType::bf16, {4, 256}, {512, 1}, 0);
  for (const auto& v : {x_odd, x_shape, x_f16, x_dev, x_strided})
    EXPECT_NE(key_of({v, w, TensorView()}, {}, p), k) << v.describe();
  EXPECT_NE(key_of({x, w, w}, {}, p), k);                                           // bias present
  EXPECT_NE(key_of({x, w}, {}, p), k);                                              // fewer arguments
  EXPECT_NE(key_of({x, w, TensorView()}, {}, {{"norm", std::string("layernorm")}}), k);
  EXPECT_NE(key_of({x, w, TensorView()}, {}, {{"norm", std::string("rmsnorm")}, {"eps", 1e-6}}), k);
  EXPECT_NE(key_of({x, w, TensorView()}, {x}, p), k);
  // An int and a float param of the same bits are two signatures (validation types them).
  EXPECT_NE(key_of({x, w, TensorView()}, {}, {{"eps", int64_t(0)}}), key_of({x, w, TensorView()}, {}, {{"eps", 0.0}}));
}

// A key longer than the buffer's first allocation keeps what was written before it grew.
// same_string compares 8 bytes at a time and then the tail: every length around a word, a difference at
// every position (a repeat with another choice of the same length, "relu" for "silu", is another signature).
TEST(CallCache, SameStringComparesEveryByte) {
  for (size_t n : {0, 1, 3, 7, 8, 9, 15, 16, 17, 24, 31}) {
    const std::string a(n, 'a');
    EXPECT_TRUE(same_string(a, std::string(n, 'a'))) << n;
    EXPECT_FALSE(same_string(a, std::string(n + 1, 'a'))) << n;
    for (size_t i = 0; i < n; ++i) {
      std::string b = a;
      b[i] = 'b';
      EXPECT_FALSE(same_string(a, b)) << n << " at " << i;
    }
  }
  EXPECT_TRUE(same_params(Params{{"act", std::string("silu")}, {"eps", 0.5}},
                          Params{{"act", std::string("silu")}, {"eps", 0.5}}));
  EXPECT_FALSE(same_params(Params{{"act", std::string("silu")}}, Params{{"act", std::string("relu")}}));
  EXPECT_FALSE(same_params(Params{{"eps", 0.0}}, Params{{"eps", -0.0}}));  // bit for bit, as the key
  EXPECT_FALSE(same_params(Params{{"n", int64_t(1)}}, Params{{"n", int64_t(2)}}));
  EXPECT_FALSE(same_params(Params{{"b", true}}, Params{{"b", false}}));
  EXPECT_FALSE(same_params(Params{{"n", int64_t(1)}}, Params{{"n", 1.0}}));
  EXPECT_FALSE(same_params(Params{{"eps", 0.5}}, Params{{"tol", 0.5}}));
}

// Params built from a list: a name given twice keeps its last value, once, where it was first given.
TEST(CallCache, ParamsListKeepsTheLastOfARepeatedName) {
  const Params p{{"eps", 0.1}, {"act", std::string("silu")}, {"eps", 0.2}};
  ASSERT_EQ(p.items().size(), 2u);
  EXPECT_EQ(p.items()[0].first, "eps");
  EXPECT_EQ(std::get<double>(p.items()[0].second), 0.2);
  EXPECT_EQ(std::get<std::string>(*p.find("act")), "silu");
}

TEST(CallCache, KeyBufferGrowsKeepingItsBytes) {
  CallKey k;
  std::string want;
  for (int i = 0; i < 300; ++i) {
    char* at = k.extend(3);
    for (int j = 0; j < 3; ++j) {
      at[j] = static_cast<char>('a' + (i + j) % 26);
      want += at[j];
    }
  }
  EXPECT_EQ(std::string(k.view()), want);
  k.clear();
  EXPECT_TRUE(k.view().empty());
}

TEST(CallCache, ListsAreNotCached) {
  TensorView items[1] = {TensorView(reinterpret_cast<void*>(uintptr_t(1) << 32), DType::f32, {4}, 0)};
  CallKey k;
  const std::vector<TensorView> list{TensorView::list(items, 1)};
  EXPECT_FALSE(append_call_key(k, Registry::global().get("adamw"), list, {}, {}));
  EXPECT_TRUE(k.view().empty());
}

// Owns one cuMemAlloc'd buffer.
struct Buffer {
  CUdeviceptr p = 0;
  explicit Buffer(size_t bytes) { CU_CHECK(cuMemAlloc(&p, bytes)); }
  ~Buffer() { jit::driver().cuMemFree(p); }
  char* get() const { return reinterpret_cast<char*>(p); }
};

TEST(CallCache, CachedSignatureStillChecksPointers) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  Buffer xs(4 * 256 * 4 * 2), ws(256 * 4), stats(4 * 4 * 2);
  TensorView x(xs.get(), DType::f32, {4, 256}, 0), y(xs.get() + 4 * 256 * 4, DType::f32, {4, 256}, 0);
  TensorView w(ws.get(), DType::f32, {256}, 0);
  TensorView mean(stats.get(), DType::f32, {4}, 0), rstd(stats.get() + 16, DType::f32, {4}, 0);
  const Params p{{"norm", std::string("rmsnorm")}};
  call("norm_act.fwd", {x, w, TensorView()}, {y, mean, rstd}, p);
  call("norm_act.fwd", {x, w, TensorView()}, {y, mean, rstd}, p);  // the cached signature
  // y and x swapped: the same layout and alignment, so the same signature; still refused.
  TensorView y_on_x(xs.get(), DType::f32, {4, 256}, 0);
  try {
    call("norm_act.fwd", {x, w, TensorView()}, {y_on_x, mean, rstd}, p);
    FAIL() << "an output on an input was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("shares memory with input 'x'"), std::string::npos) << e.what();
  }
  TensorView null_x(nullptr, DType::f32, {4, 256}, 0);
  try {
    call("norm_act.fwd", {null_x, w, TensorView()}, {y, mean, rstd}, p);
    FAIL() << "a null input was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("null data pointer"), std::string::npos) << e.what();
  }
  CU_CHECK(cuCtxSynchronize());
}

}  // namespace
}  // namespace kspec
