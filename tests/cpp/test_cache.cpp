// cache/: atomic checksummed entries, corrupt/truncated/foreign/unsafe entries, read-only directories,
// LRU pruning, and processes: N concurrent processes compile once; a second process hits the disk;
// an edited template recompiles; KSPEC_CACHE=off.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "cache/disk_cache.h"
#include "jit/hash.h"
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
