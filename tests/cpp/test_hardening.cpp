// Adversarial input (issue 26): environment knobs with values they do not take, dims, params, configs
// and archs outside the schema, hostile tuning imports. Each must be a clear InvalidArgument naming
// what was wrong, raised before anything compiles, never a crash of the process.
#include <sys/wait.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "api/src/kernels.h"
#include "api/src/op.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Runs f and expects an InvalidArgument whose message contains every fragment.
template <typename F>
void expect_invalid(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    for (const auto& s : fragments) EXPECT_NE(msg.find(s), std::string::npos) << "missing '" << s << "' in: " << msg;
  }
}

CompileRequest norm_request(int64_t hidden) {
  CompileRequest req;
  req.op = "norm_act.fwd";
  req.dtype = DType::bf16;
  req.params = {{"hidden", hidden}};
  return req;
}

}  // namespace

// ---- knobs ----

TEST(Knobs, EveryBooleanSpellingInAnyCase) {
  for (const char* on : {"on", "ON", "On", "1", "true", "TRUE", "yes", "Yes", " on "}) {
    ScopedEnv e("KSPEC_CACHE", on);
    EXPECT_TRUE(knobs::cache_enabled()) << on;
    ScopedEnv t("KSPEC_TUNE", on);
    EXPECT_EQ(knobs::tune_mode(), knobs::TuneMode::On) << on;
  }
  for (const char* off : {"off", "OFF", "0", "false", "False", "no", "NO"}) {
    ScopedEnv e("KSPEC_CACHE", off);
    EXPECT_FALSE(knobs::cache_enabled()) << off;
    ScopedEnv t("KSPEC_TUNE", off);
    EXPECT_EQ(knobs::tune_mode(), knobs::TuneMode::Off) << off;
    ScopedEnv v("KSPEC_VERBOSE", off);
    EXPECT_EQ(knobs::verbose(), 0) << off;
  }
  ScopedEnv t("KSPEC_TUNE", "AUTO");
  EXPECT_EQ(knobs::tune_mode(), knobs::TuneMode::Auto);
  ScopedEnv v("KSPEC_VERBOSE", "On");
  EXPECT_EQ(knobs::verbose(), 1);
}

TEST(Knobs, BadValuesNameTheVariableAndWhatItTakes) {
  struct Row {
    const char* name;
    const char* value;
    std::function<void()> read;
    const char* takes;
  };
  const std::vector<Row> rows = {
      {"KSPEC_CACHE", "maybe", [] { knobs::cache_enabled(); }, "on/off"},
      {"KSPEC_CACHE", "2", [] { knobs::cache_enabled(); }, "yes/no"},
      {"KSPEC_TUNE", "sometimes", [] { knobs::tune_mode(); }, "auto"},
      {"KSPEC_VERBOSE", "loud", [] { knobs::verbose(); }, "an integer"},
      {"KSPEC_VERBOSE", "99999999999999999999999", [] { knobs::verbose(); }, "an integer"},
      {"KSPEC_CACHE_MAX_BYTES", "-5", [] { knobs::cache_max_bytes(); }, "an integer in 0.."},
      {"KSPEC_CACHE_MAX_BYTES", "1e9", [] { knobs::cache_max_bytes(); }, "an integer"},
      {"KSPEC_COMPILE_THREADS", "0", [] { knobs::compile_threads(); }, "1..1024"},
      {"KSPEC_COMPILE_THREADS", "100000000", [] { knobs::compile_threads(); }, "1..1024"},
      {"KSPEC_TUNE_BUDGET", "nan", [] { knobs::tune_budget(); }, "positive number"},
      {"KSPEC_TUNE_BUDGET", "-1", [] { knobs::tune_budget(); }, "positive number"},
  };
  for (const auto& r : rows) {
    ScopedEnv e(r.name, r.value);
    expect_invalid(r.read, {r.name, r.takes, std::string("'") + r.value + "'"});
  }
}

// The knobs read on the compile path (the tuning mode, the compile threads) fail the call, every time.
TEST(Knobs, BadValueFailsTheCallNotTheProcess) {
  {
    ScopedEnv t("KSPEC_TUNE", "sometimes");
    for (int i = 0; i < 2; ++i) expect_invalid([] { compile(norm_request(64)); }, {"KSPEC_TUNE"});
  }
  ScopedEnv t("KSPEC_COMPILE_THREADS", "none");
  expect_invalid([] { for_each_compile_thread(3, [](size_t) {}); }, {"KSPEC_COMPILE_THREADS"});
}

// An exception in one of the compile threads reaches the caller (it terminated the process).
TEST(Knobs, CompileThreadExceptionsReachTheCaller) {
  ScopedEnv t("KSPEC_COMPILE_THREADS", "4");
  std::atomic<int> ran{0};
  expect_invalid(
      [&] {
        for_each_compile_thread(64, [&](size_t i) {
          ++ran;
          if (i == 5) throw InvalidArgument("item 5 is bad");
        });
      },
      {"item 5 is bad"});
  EXPECT_LT(ran.load(), 64 + 4);
}

// KSPEC_CACHE is read once per process, when the cache is first used: a fresh process per value. The
// first use used to run inside std::call_once, whose exception aborted the process (exit 134).
TEST(Knobs, BadCacheValueIsAnErrorInAFreshProcessEveryTime) {
  for (const char* v : {"OFF"}) {  // the reproducer: valid, memory only
    auto r = kspec::testing::run(std::string("KSPEC_CACHE=") + v + " " + KSPEC_PROBE + " 64");
    EXPECT_EQ(r.status, 0) << v << ": " << r.out;
  }
  for (const char* v : {"maybe", "disabled"}) {
    auto r = kspec::testing::run(std::string("KSPEC_CACHE=") + v + " " + KSPEC_PROBE + " 64");
    ASSERT_TRUE(WIFEXITED(r.status)) << r.out;
    EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.out;  // the probe's "caught an exception"
    EXPECT_NE(r.out.find("KSPEC_CACHE: expected on/off"), std::string::npos) << r.out;
  }
}
