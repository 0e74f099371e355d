// cache/: atomic checksummed entries, corrupt/truncated/foreign/unsafe entries, read-only directories,
// LRU pruning, and processes: N concurrent processes compile once; a second process hits the disk;
// an edited template recompiles; KSPEC_CACHE=off. Hardening: bounded JSON, whole-entry and memo
// checksums, orphans, locked verify/prune/clear under a multi-process storm, a cache cleared by another
// process, the tuning database's files and directories, private directories, failed sources.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "cache/bounded_json.h"
#include "cache/disk_cache.h"
#include "cache/tuning_db.h"
#include "jit/base/hash.h"
#include "jit/files.h"
#include "jit/key.h"
#include "jit/nvrtc.h"
#include "jit/sources.h"
#include "kspec/error.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
using kspec::cache::DiskCache;

namespace {

std::string key_of(const std::string& s) { return kspec::jit::sha256_hex(s); }

int mode_of(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 ? static_cast<int>(st.st_mode & 0777) : -1;
}

std::string meta_path(const DiskCache& c, const std::string& key) {
  std::string b = c.entry_path(key);
  return b.substr(0, b.size() - 4) + ".json";
}

// The key in a probe line "<source> <key>".
std::string key_in(const std::string& line) { return line.substr(line.find(' ') + 1, 64); }

std::string probe(const std::string& env, const std::string& arg = "") {
  auto r = kspec::testing::run(env + " " + KSPEC_PROBE + " " + arg);
  EXPECT_EQ(r.status, 0) << r.out;
  return r.out;
}

}  // namespace

TEST(DiskCache, RoundTripPrivateAndAtomic) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string key = key_of("a");
  EXPECT_FALSE(c.load(key));
  std::string path = c.store(key, std::string("\x7f" "ELF binary bytes", 16), {{"spec", "s"}});
  ASSERT_FALSE(path.empty());
  auto e = c.load(key);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->binary, std::string("\x7f" "ELF binary bytes", 16));
  EXPECT_EQ(e->meta["spec"], "s");
  EXPECT_EQ(e->meta["binary_sha256"], kspec::jit::sha256_hex(e->binary));
  EXPECT_EQ(mode_of(tmp.path() + "/c"), 0700);
  EXPECT_EQ(mode_of(path), 0600);
  // No temporary files left behind.
  for (const auto& f : fs::recursive_directory_iterator(tmp.path()))
    EXPECT_EQ(f.path().string().find(".tmp."), std::string::npos) << f.path();
  EXPECT_EQ(c.stats().entries, 1);
  EXPECT_FALSE(c.load("../../etc/passwd"));  // keys are hex digests, never paths
}

TEST(DiskCache, CorruptTruncatedForeignEntriesAreRemovedNotLoaded) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string bin(1000, 'x');
  // corrupt: one byte flipped
  std::string k1 = key_of("1");
  std::string p1 = c.store(k1, bin, {});
  {
    std::fstream f(p1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(500);
    f.put('y');
  }
  EXPECT_FALSE(c.load(k1));
  EXPECT_FALSE(fs::exists(p1));
  // truncated
  std::string k2 = key_of("2");
  std::string p2 = c.store(k2, bin, {});
  fs::resize_file(p2, 10);
  EXPECT_FALSE(c.load(k2));
  EXPECT_FALSE(fs::exists(p2));
  // foreign: another entry's files under this key
  std::string k3 = key_of("3"), k4 = key_of("4");
  c.store(k3, bin, {});
  std::string p4 = c.store(k4, bin, {});
  fs::copy_file(meta_path(c, k3), meta_path(c, k4), fs::copy_options::overwrite_existing);
  EXPECT_FALSE(c.load(k4));
  // garbage metadata
  std::string k5 = key_of("5");
  c.store(k5, bin, {});
  std::ofstream(meta_path(c, k5)) << "{ not json";
  EXPECT_FALSE(c.load(k5));
  EXPECT_TRUE(c.load(k3));  // the healthy one still loads
  auto v = c.verify();
  EXPECT_EQ(v.ok, 1);
  EXPECT_TRUE(v.bad.empty());
}

TEST(DiskCache, EntriesOthersCanWriteAreRefused) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string k = key_of("w");
  std::string p = c.store(k, "bytes", {});
  ::chmod(p.c_str(), 0666);
  EXPECT_FALSE(c.load(k));
}

TEST(DiskCache, SharedDirectoryIsRefused) {
  kspec::testing::TempDir tmp;
  std::string dir = tmp.path() + "/shared";
  fs::create_directory(dir);
  ::chmod(dir.c_str(), 0777);
  DiskCache c(dir, true, 1 << 30);
  EXPECT_TRUE(c.store(key_of("s"), "bytes", {}).empty());
  EXPECT_FALSE(c.load(key_of("s")));
}

TEST(DiskCache, UnwritableDirectoryDegradesToMemory) {
  // /proc cannot hold directories, even for root: the store fails and the cache turns memory-only.
  DiskCache c("/proc/kspec-no-such-dir/cache", true, 1 << 30);
  EXPECT_TRUE(c.store(key_of("r"), "bytes", {}).empty());
  EXPECT_FALSE(c.load(key_of("r")));
  EXPECT_FALSE(c.writable());
  if (::geteuid() != 0) {  // permission bits bind everyone but root
    kspec::testing::TempDir tmp;
    DiskCache d(tmp.path() + "/ro", true, 1 << 30);
    ASSERT_FALSE(d.store(key_of("1"), "one", {}).empty());
    ::chmod((tmp.path() + "/ro/v1").c_str(), 0500);
    EXPECT_TRUE(d.store(key_of("2"), "two", {}).empty());
    EXPECT_TRUE(d.load(key_of("1")));  // still readable
  }
}

TEST(DiskCache, PrunesLeastRecentlyUsed) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 0);
  std::string bin(10000, 'b');
  std::vector<std::string> keys = {key_of("old"), key_of("mid"), key_of("new")};
  for (size_t i = 0; i < keys.size(); ++i) {
    c.store(keys[i], bin, {});
    struct timespec ts[2] = {{static_cast<time_t>(1000000 + i * 100), 0}, {static_cast<time_t>(1000000 + i * 100), 0}};
    ::utimensat(AT_FDCWD, meta_path(c, keys[i]).c_str(), ts, 0);
  }
  // Using "old" makes it the most recent.
  ASSERT_TRUE(c.load(keys[0]));
  int64_t one = c.list().front().bytes;
  EXPECT_EQ(c.prune(2 * one), 1);
  EXPECT_TRUE(c.load(keys[0]));
  EXPECT_FALSE(c.load(keys[1]));  // the least recently used went
  EXPECT_TRUE(c.load(keys[2]));
  EXPECT_EQ(c.clear(), 2);
  EXPECT_EQ(c.stats().entries, 0);
}

TEST(DiskCache, ThreadsStoringTheSameKey) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string k = key_of("t");
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&] {
      for (int j = 0; j < 20; ++j) {
        c.store(k, std::string(4096, 'z'), {});
        auto e = c.load(k);
        if (e) {
          EXPECT_EQ(e->binary, std::string(4096, 'z'));
        }
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(c.verify().ok, 1);
}

// ---- processes ----

TEST(CacheProcesses, EightProcessesCompileOnce) {
  kspec::testing::TempDir tmp;
  std::string env = "KSPEC_CACHE_DIR=" + tmp.path() + "/c";
  std::string cmd;
  for (int i = 0; i < 8; ++i) cmd += env + " " + KSPEC_PROBE + " 4096 & ";
  cmd += "wait";
  auto r = kspec::testing::run(cmd);
  std::map<std::string, int> sources;
  std::set<std::string> keys;
  std::istringstream in(r.out);
  std::string source, key;
  while (in >> source >> key) {
    sources[source]++;
    keys.insert(key);
  }
  EXPECT_EQ(sources["compiled"], 1) << r.out;
  EXPECT_EQ(sources["disk"], 7) << r.out;
  EXPECT_EQ(keys.size(), 1u) << r.out;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  EXPECT_EQ(c.verify().ok, 1);
}

TEST(CacheProcesses, SecondProcessHitsDiskAndCorruptEntryIsRebuilt) {
  kspec::testing::TempDir tmp;
  std::string env = "KSPEC_CACHE_DIR=" + tmp.path() + "/c";
  std::string first = probe(env, "2048");
  EXPECT_EQ(first.rfind("compiled ", 0), 0u) << first;
  std::string second = probe(env, "2048");
  EXPECT_EQ(second.rfind("disk ", 0), 0u) << second;
  std::string key = key_in(first);
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string bin = c.entry_path(key);
  ASSERT_TRUE(fs::exists(bin));
  fs::resize_file(bin, fs::file_size(bin) / 2);
  std::string third = probe(env, "2048");
  EXPECT_NE(third.find("invalid"), std::string::npos) << third;  // reported
  EXPECT_NE(third.find("compiled " + key), std::string::npos) << third;
  EXPECT_EQ(probe(env, "2048").rfind("disk ", 0), 0u);  // replaced by a good one
}

TEST(CacheProcesses, CacheOffNeverTouchesDisk) {
  kspec::testing::TempDir tmp;
  std::string env = "KSPEC_CACHE=off KSPEC_CACHE_DIR=" + tmp.path() + "/c";
  EXPECT_EQ(probe(env, "1024").rfind("compiled ", 0), 0u);
  EXPECT_EQ(probe(env, "1024").rfind("compiled ", 0), 0u);
  EXPECT_FALSE(fs::exists(tmp.path() + "/c/v1"));
}

TEST(CacheProcesses, EditedTemplateRecompilesWithoutRebuild) {
  kspec::testing::TempDir tmp;
  std::string root = tmp.path() + "/templates";
  fs::copy(fs::path(KSPEC_SOURCE_DIR) / "templates", root, fs::copy_options::recursive);
  std::string env = "KSPEC_CACHE_DIR=" + tmp.path() + "/c KSPEC_TEMPLATE_DIR=" + root;
  std::string a = probe(env, "512");
  std::string b = probe(env, "512");
  EXPECT_EQ(key_in(a), key_in(b));
  EXPECT_EQ(b.rfind("disk ", 0), 0u) << b;
  std::ofstream(root + "/common/math.cuh", std::ios::app) << "\n// a stale binary must not survive this\n";
  std::string c = probe(env, "512");
  EXPECT_EQ(c.rfind("compiled ", 0), 0u) << c;
  EXPECT_NE(key_in(c), key_in(a));
}

// ---- hardening ----

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// Restores the umask when a test that sets one ends.
struct Umask {
  explicit Umask(mode_t m) : old(::umask(m)) {}
  ~Umask() { ::umask(old); }
  mode_t old;
};

}  // namespace

TEST(BoundedJson, TooDeepOrTooLargeIsRefusedBeforeParsing) {
  std::string why;
  // 140k levels (280 KB) overflowed the stack in nlohmann's recursive copy.
  EXPECT_FALSE(kspec::cache::parse_json_bounded("{\"entries\": {\"k\": {\"x\": " + nested(140000) + "}}}",
                                                int64_t(1) << 30, &why));
  EXPECT_NE(why.find("nested deeper than 64"), std::string::npos) << why;
  EXPECT_TRUE(kspec::cache::parse_json_bounded(nested(64), 1 << 20, &why));
  EXPECT_FALSE(kspec::cache::parse_json_bounded(nested(65), 1 << 20, &why));
  // Brackets inside strings (escaped quotes too) do not nest.
  auto j = kspec::cache::parse_json_bounded("{\"a\": \"" + std::string(1000, '[') + "\\\"[[\"}", 1 << 20, &why);
  ASSERT_TRUE(j) << why;
  EXPECT_EQ((*j)["a"].get<std::string>().size(), 1003u);
  EXPECT_FALSE(kspec::cache::parse_json_bounded(std::string(100, ' ') + "{}", 50, &why));
  EXPECT_NE(why.find("too large"), std::string::npos) << why;
  EXPECT_FALSE(kspec::cache::parse_json_bounded("{ not json", 1 << 20, &why));
  EXPECT_NE(why.find("not valid JSON"), std::string::npos) << why;
}

TEST(BoundedJson, DeepTuningDatabaseAndCacheMetadataAreIgnoredNotACrash) {
  kspec::testing::TempDir tmp;
  std::string db = tmp.path() + "/db.json";
  std::ofstream(db) << "{\"version\": 1, \"entries\": {\"k\": {\"x\": " << nested(140000) << "}}}";
  std::string problem;
  EXPECT_TRUE(kspec::cache::TuningDb(db).entries(&problem).empty());
  EXPECT_NE(problem.find("nested deeper"), std::string::npos) << problem;
  EXPECT_TRUE(kspec::cache::TuningDb(db, /*user_file=*/true).entries(&problem).empty());
  // A writer moves it aside and starts a new file.
  ASSERT_TRUE(kspec::cache::TuningDb(db).merge({{"k#a=1", {{"config", "a=1"}}}}, {}));
  EXPECT_TRUE(kspec::cache::TuningDb(db).get("k#a=1"));
  EXPECT_GT(fs::file_size(db + ".corrupt"), 280000u);
  // Cache metadata nested deeply: a bad entry, removed.
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string k = key_of("deep");
  c.store(k, "bytes", {});
  std::ofstream(meta_path(c, k)) << "{\"x\": " << nested(100000) << "}";
  EXPECT_FALSE(c.load(k));
  EXPECT_FALSE(fs::exists(meta_path(c, k)));
}

TEST(DiskCache, AnyMetadataBitFlipIsCaughtAndEvicted) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  nlohmann::json meta = {{"spec", "norm_act|bf16|4096"},
                         {"lowered_name", "_Z6kernelv"},
                         {"arch", "sm_90a"},
                         {"resources", {{"registers", 40}, {"spill_bytes", 0}}}};
  // Each edit keeps the metadata valid JSON: only the whole-record checksum can tell.
  std::vector<std::pair<std::string, std::string>> flips = {{"_Z6kernelv", "_Z6kernelw"},
                                                            {"norm_act|bf16|4096", "norm_act|bf16|4097"},
                                                            {"\"registers\": 40", "\"registers\": 41"},
                                                            {"\"spill_bytes\": 0", "\"spill_bytes\": 1"},
                                                            {"sm_90a", "sm_90b"}};
  for (size_t i = 0; i < flips.size(); ++i) {
    std::string k = key_of("flip" + std::to_string(i));
    c.store(k, "binary", meta);
    ASSERT_TRUE(c.load(k));
    std::string text = slurp(meta_path(c, k));
    auto at = text.find(flips[i].first);
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, flips[i].first.size(), flips[i].second);
    std::ofstream(meta_path(c, k)) << text;
    if (i % 2 == 0) {
      EXPECT_FALSE(c.load(k)) << flips[i].first;
      EXPECT_FALSE(fs::exists(meta_path(c, k)));
    } else {
      auto v = c.verify();
      ASSERT_EQ(v.bad.size(), 1u) << flips[i].first;
      EXPECT_NE(v.bad[0].find("metadata checksum mismatch"), std::string::npos) << v.bad[0];
      EXPECT_NE(v.bad[0].find("(removed)"), std::string::npos) << v.bad[0];
    }
  }
  EXPECT_EQ(c.verify().ok, 0);
}

TEST(DiskCache, OrphanBinaryIsShownThenRemovedOnceOld) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string good = key_of("good"), lost = key_of("lost");
  c.store(good, "good", {});
  c.store(lost, "lost binary", {});
  fs::remove(meta_path(c, lost));  // as a full disk leaves it between the binary and the metadata
  auto listed = c.list();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(c.stats().entries, 2);
  EXPECT_FALSE(c.load(lost));  // no metadata: a miss, not a warning
  // A young one may be a write in progress: left alone.
  auto v = c.verify();
  EXPECT_EQ(v.ok, 1);
  EXPECT_TRUE(v.bad.empty());
  EXPECT_TRUE(fs::exists(c.entry_path(lost)));
  struct timespec old[2] = {{1000000, 0}, {1000000, 0}};
  ::utimensat(AT_FDCWD, c.entry_path(lost).c_str(), old, 0);
  v = c.verify();
  ASSERT_EQ(v.bad.size(), 1u);
  EXPECT_NE(v.bad[0].find("without metadata"), std::string::npos) << v.bad[0];
  EXPECT_EQ(v.removed, 1);
  EXPECT_FALSE(fs::exists(c.entry_path(lost)));
  EXPECT_TRUE(c.load(good));
}

TEST(DiskCache, ClearedByAnotherProcessIsRecreatedOnTheNextStore) {
  kspec::testing::TempDir tmp;
  Umask open_umask(0);
  DiskCache running(tmp.path() + "/c", true, 1 << 30), other(tmp.path() + "/c", true, 1 << 30);
  ASSERT_FALSE(running.store(key_of("1"), "one", {}).empty());
  EXPECT_EQ(other.clear(), 1);
  EXPECT_FALSE(fs::exists(tmp.path() + "/c/v1"));
  std::string p = running.store(key_of("2"), "two", {});
  ASSERT_FALSE(p.empty());  // not memory-only for the rest of its life
  EXPECT_TRUE(running.load(key_of("2")));
  EXPECT_TRUE(running.writable());
  EXPECT_EQ(mode_of(tmp.path() + "/c/v1"), 0700);
  EXPECT_EQ(mode_of(fs::path(p).parent_path().string()), 0700);
}

TEST(DiskCache, PruneAndClearLeaveAnEntryLockedElsewhere) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 0);
  std::vector<std::string> keys = {key_of("a"), key_of("b"), key_of("c")};
  for (const auto& k : keys) c.store(k, std::string(1000, 'x'), {});
  {
    auto held = c.lock(keys[1]);  // as a process writing or loading it would
    ASSERT_TRUE(held.held());
    std::string failure;
    EXPECT_EQ(c.prune(0, &failure), 2);
    EXPECT_TRUE(failure.empty()) << failure;
    EXPECT_TRUE(c.load(keys[1]));
  }
  EXPECT_EQ(c.prune(0), 1);
  EXPECT_EQ(c.stats().entries, 0);
}

TEST(DiskCache, LockFilesAreNeverFollowed) {
  kspec::testing::TempDir tmp;
  DiskCache c(tmp.path() + "/c", true, 1 << 30);
  std::string k = key_of("l");
  c.store(k, "bytes", {});
  std::string lock = c.entry_path(k).substr(0, c.entry_path(k).size() - 4) + ".lock";
  fs::remove(lock);
  fs::create_symlink(tmp.path() + "/created-through-link", lock);
  EXPECT_FALSE(c.lock(k).held());
  EXPECT_FALSE(fs::exists(tmp.path() + "/created-through-link"));
  // A lock removed by its holder (pruning) is never held twice: the waiter relocks the new file.
  fs::remove(lock);
  auto a = c.lock(k);
  ASSERT_TRUE(a.held());
  fs::remove(lock);
  auto b = c.lock(k, /*wait=*/false);
  EXPECT_TRUE(b.held());  // a new file: the removed one's holder excludes nobody any more
}

// Processes that store (each store prunes to a cap of a few entries) and processes that verify, for a
// bounded time: verify must never report, or remove, an entry that was merely pruned or being written.
TEST(CacheProcesses, VerifyDuringPruneStormRemovesNothingHealthy) {
  kspec::testing::TempDir tmp;
  std::string dir = tmp.path() + "/c";
  constexpr int kWriters = 3, kVerifiers = 2;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  std::vector<pid_t> writers, verifiers;
  for (int w = 0; w < kWriters + kVerifiers; ++w) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::alarm(30);  // a hang ends the child, never the suite
      DiskCache c(dir, true, 30000);
      int bad = 0;
      for (int n = 0; std::chrono::steady_clock::now() < until; ++n) {
        if (w < kWriters) {
          std::string k = key_of("w" + std::to_string(w) + "-" + std::to_string(n));
          auto held = c.lock(k);
          c.store(k, std::string(4000 + n % 7, 'x'), {{"n", n}});
        } else {
          auto r = c.verify();
          for (const auto& b : r.bad) std::fprintf(stderr, "verify: %s\n", b.c_str());
          bad += static_cast<int>(r.bad.size());
        }
      }
      ::_exit(std::min(bad, 100));
    }
    (w < kWriters ? writers : verifiers).push_back(pid);
  }
  for (pid_t pid : writers) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  for (pid_t pid : verifiers) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    EXPECT_TRUE(WIFEXITED(st)) << "verifier killed";
    EXPECT_EQ(WEXITSTATUS(st), 0) << "verify reported healthy entries as bad";
  }
  DiskCache c(dir, true, 30000);
  auto v = c.verify();
  EXPECT_TRUE(v.bad.empty());
  EXPECT_GT(v.ok, 0);
}

TEST(TuningDbFiles, LinksAndForeignFilesAreNeverFollowedOrTrusted) {
  kspec::testing::TempDir tmp;
  std::string dir = tmp.path() + "/tuning", victim = tmp.path() + "/victim";
  std::string why;
  ASSERT_TRUE(kspec::jit::make_private_dir(dir, &why)) << why;
  std::ofstream(victim) << "precious";
  std::string db = dir + "/tuning-x.json";
  // A .lock symlink: not followed, its target not created, the write refused.
  fs::create_symlink(tmp.path() + "/lock-target", db + ".lock");
  std::string err;
  EXPECT_FALSE(kspec::cache::TuningDb(db).merge({{"k", {{"config", "a=1"}}}}, {}, kspec::cache::TuningDb::prefer_incoming, &err));
  EXPECT_FALSE(fs::exists(tmp.path() + "/lock-target"));
  fs::remove(db + ".lock");
  // The database a symlink to the victim, .corrupt another: neither target is read or written.
  fs::create_symlink(victim, db);
  fs::create_symlink(victim, db + ".corrupt");
  std::string problem;
  EXPECT_TRUE(kspec::cache::TuningDb(db).entries(&problem).empty());
  EXPECT_NE(problem.find("symbolic link"), std::string::npos) << problem;
  ASSERT_TRUE(kspec::cache::TuningDb(db).merge({{"k", {{"config", "a=1"}}}}, {}, kspec::cache::TuningDb::prefer_incoming, &err)) << err;
  EXPECT_EQ(slurp(victim), "precious");
  EXPECT_TRUE(fs::is_symlink(db + ".corrupt"));  // the link itself moved aside
  EXPECT_FALSE(fs::is_symlink(db));
  EXPECT_EQ(mode_of(db), 0600);
  EXPECT_TRUE(kspec::cache::TuningDb(db).get("k"));
  // Writable by others: not trusted.
  ::chmod(db.c_str(), 0666);
  EXPECT_FALSE(kspec::cache::TuningDb(db).get("k"));
  // A directory others can write is refused for writing.
  std::string shared = tmp.path() + "/shared";
  fs::create_directory(shared);
  ::chmod(shared.c_str(), 0777);
  EXPECT_FALSE(kspec::cache::TuningDb(shared + "/db.json").merge({{"k", {{"config", "a=1"}}}}, {}, kspec::cache::TuningDb::prefer_incoming, &err));
  EXPECT_NE(err.find("writable by group or others"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(shared + "/db.json"));
}

TEST(TuningDbFiles, DataDerivedNamesAreFileNamePartsOnly) {
  using kspec::cache::sanitize_file_part;
  std::vector<std::string> hostiles = {"/../../../../../tmp/victim", "..", "...", "../..", "a/b",
                                      std::string(300, 'x'), std::string("a\0b", 3), "\n/etc/passwd"};
  for (const auto& hostile : hostiles) {
    std::string part = sanitize_file_part(hostile);
    EXPECT_EQ(part.find('/'), std::string::npos) << hostile;
    EXPECT_NE(part.find_first_not_of('.'), std::string::npos) << hostile;  // never "." or ".."
    EXPECT_LE(part.size(), 64u);
    EXPECT_FALSE(part.empty());
  }
  EXPECT_EQ(sanitize_file_part("12.8"), "12.8");
}

TEST(PrivateDirs, CreatedOwnerOnlyWhateverTheUmaskAndCheckedWhenPresent) {
  kspec::testing::TempDir tmp;
  {
    Umask open_umask(0);
    std::string why;
    ASSERT_TRUE(kspec::jit::make_private_dir(tmp.path() + "/a/b/c", &why)) << why;
    for (const char* d : {"/a", "/a/b", "/a/b/c"}) EXPECT_EQ(mode_of(tmp.path() + d), 0700) << d;
    // The first command being a tuning import: its cache and tuning directories are private too.
    ASSERT_TRUE(kspec::cache::TuningDb(tmp.path() + "/cache/tuning/db.json").merge({{"k", {{"config", "a=1"}}}}, {}));
    EXPECT_EQ(mode_of(tmp.path() + "/cache"), 0700);
    EXPECT_EQ(mode_of(tmp.path() + "/cache/tuning"), 0700);
    DiskCache c(tmp.path() + "/cache", true, 1 << 30);
    EXPECT_FALSE(c.store(key_of("u"), "bytes", {}).empty());  // the kernel cache accepts it as its own
  }
  {
    Umask closed_umask(0777);
    std::string why;
    ASSERT_TRUE(kspec::jit::make_private_dir(tmp.path() + "/m", &why)) << why;
    EXPECT_EQ(mode_of(tmp.path() + "/m"), 0700);
  }
  std::string why;
  ::chmod((tmp.path() + "/a").c_str(), 0770);
  EXPECT_FALSE(kspec::jit::make_private_dir(tmp.path() + "/a", &why));
  EXPECT_NE(why.find("writable by group or others"), std::string::npos) << why;
  std::ofstream(tmp.path() + "/file") << "x";
  EXPECT_FALSE(kspec::jit::make_private_dir(tmp.path() + "/file", &why));
  EXPECT_NE(why.find("not a directory"), std::string::npos) << why;
}

TEST(DebugSources, FailedSourceGoesToAPrivateDirectoryNeverThroughALink) {
  kspec::testing::TempDir tmp;
  kspec::jit::KernelSpec spec;
  spec.header = "norm_act/norm_act.cuh";
  spec.kernel = "kspec::norm_act_fwd_kernel";
  spec.targs = {"not_a_type_at_all"};
  spec.arch = "sm_90a";
  std::string name = "kspec-failed-" + kspec::jit::sha256_hex(spec.canonical()).substr(0, 16) + ".cu";
  // A shared directory (as /tmp) with the predictable name planted as a link to a victim.
  std::string shared = tmp.path() + "/shared", victim = tmp.path() + "/victim";
  fs::create_directory(shared);
  ::chmod(shared.c_str(), 01777);
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, shared + "/" + name);
  ::setenv("KSPEC_DEBUG_DIR", shared.c_str(), 1);
  std::string path;
  try {
    kspec::jit::compile(spec);
    ADD_FAILURE() << "expected CompileError";
  } catch (const kspec::CompileError& e) {
    path = e.source_path();
  }
  EXPECT_EQ(slurp(victim), "precious");
  ASSERT_TRUE(fs::exists(path)) << path;
  EXPECT_NE(slurp(path).find("not_a_type_at_all"), std::string::npos);
  EXPECT_EQ(fs::path(path).parent_path().parent_path(), fs::path(shared));  // shared/kspec-debug-XXXXXX/
  EXPECT_EQ(mode_of(fs::path(path).parent_path().string()), 0700);
  EXPECT_EQ(mode_of(path), 0600);
  // A debug directory of the user's own that does not exist yet is created private and used as is.
  std::string own = tmp.path() + "/mine/debug";
  ::setenv("KSPEC_DEBUG_DIR", own.c_str(), 1);
  try {
    kspec::jit::compile(spec);
  } catch (const kspec::CompileError& e) {
    path = e.source_path();
  }
  ::unsetenv("KSPEC_DEBUG_DIR");
  EXPECT_EQ(path, own + "/" + name);
  EXPECT_EQ(mode_of(own), 0700);
}

TEST(Key, HeaderMemoBitFlipIsDetectedAndRehashed) {
  kspec::testing::TempDir tmp;
  auto src = kspec::jit::TemplateSource::embedded();
  std::string direct = kspec::jit::system_headers_hash(src, "norm_act/norm_act.cuh", "");
  ASSERT_EQ(kspec::jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path()), direct);
  std::string memo;
  for (const auto& e : fs::directory_iterator(tmp.path())) memo = e.path().string();
  ASSERT_FALSE(memo.empty());
  std::string text = slurp(memo);
  text[3] = text[3] == '0' ? '1' : '0';  // one hex digit of the recorded hash
  std::ofstream(memo) << text;
  EXPECT_EQ(kspec::jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path()), direct);
  EXPECT_EQ(slurp(memo).substr(0, 64), direct);  // rewritten
  EXPECT_EQ(kspec::jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path()), direct);
}
