// The log sink (kspec/log.h): an application's callback receives kspec's warnings, from any thread, with
// no kspec lock held (a sink that logs again, as Python's may through the GIL, does not deadlock), and
// what it throws never reaches the caller; an empty sink restores stderr.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "jit/base/log.h"
#include "kspec/log.h"

namespace {

// Installs a sink for one test and restores the previous one after it.
struct SinkGuard {
  explicit SinkGuard(kspec::LogSink s) : prev(kspec::set_log_sink(std::move(s))) {}
  ~SinkGuard() { kspec::set_log_sink(prev); }
  kspec::LogSink prev;
};

TEST(LogSink, ReceivesWarningsAndIsReplaced) {
  std::vector<std::pair<kspec::LogLevel, std::string>> got;
  {
    SinkGuard g([&](kspec::LogLevel l, const std::string& m) { got.emplace_back(l, m); });
    kspec::jit::warn("first");
    kspec::jit::warn_once("log-test-once", "once");
    kspec::jit::warn_once("log-test-once", "once");
    kspec::LogSink mine = kspec::set_log_sink([](kspec::LogLevel, const std::string&) {});
    ASSERT_TRUE(static_cast<bool>(mine));  // the sink it replaced is handed back
    kspec::jit::warn("to the other sink");
    kspec::set_log_sink(mine);
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].first, kspec::LogLevel::Warning);
  EXPECT_EQ(got[0].second, "first");
  EXPECT_EQ(got[1].second, "once");
}

TEST(LogSink, ThrowingSinkNeverReachesTheCaller) {
  SinkGuard g([](kspec::LogLevel, const std::string&) { throw std::runtime_error("sink failed"); });
  EXPECT_NO_THROW(kspec::jit::warn("a warning"));
}

TEST(LogSink, ManyThreadsAndASinkThatLogsAgain) {
  std::atomic<int> count{0}, nested{0};
  thread_local int depth = 0;
  SinkGuard g([&](kspec::LogLevel, const std::string& m) {
    ++count;
    if (depth == 0 && m == "outer") {  // logging from inside the sink: kspec's lock is not held here
      ++depth;
      kspec::jit::warn("inner");
      --depth;
      ++nested;
    }
  });
  constexpr int kThreads = 8, kEach = 200;
  auto work = std::async(std::launch::async, [&] {
    std::vector<std::thread> ts;
    for (int t = 0; t < kThreads; ++t)
      ts.emplace_back([&] {
        for (int i = 0; i < kEach; ++i) kspec::jit::warn(i % 2 ? "plain" : "outer");
      });
    for (auto& t : ts) t.join();
  });
  if (work.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "logging deadlocked";
    std::_Exit(1);  // the stuck threads cannot be joined
  }
  EXPECT_EQ(nested.load(), kThreads * kEach / 2);
  EXPECT_EQ(count.load(), kThreads * kEach + nested.load());
}

}  // namespace
