// What lets one build run on other machines: the self-contained SHA-256 (FIPS 180-4's vectors, every
// padding boundary, digests equal to OpenSSL's so old cache keys stay valid) and NVRTC found at run time
// (the search order, an explicit KSPEC_NVRTC, and an error naming every place searched).
#include <cmath>
#include <filesystem>
#include <optional>

#include "env_test_util.h"
#include "jit/base/hash.h"
#include "jit/cuda_libs.h"
#include "jit/nvrtc.h"
#include "kspec/error.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
using namespace kspec;

namespace {

using kspec::testing::ScopedEnv;

// Restores pip's nvidia directories after a test replaces them.
struct ScopedNvidiaDirs {
  explicit ScopedNvidiaDirs(std::vector<std::string> dirs) : old(jit::nvidia_package_dirs()) {
    jit::set_nvidia_package_dirs(std::move(dirs));
  }
  ~ScopedNvidiaDirs() { jit::set_nvidia_package_dirs(old); }
  std::vector<std::string> old;
};

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + 3) & 255);
  return s;
}

}  // namespace

// FIPS 180-4 / NIST CSHA examples: empty, one block, two blocks, a million 'a'.
TEST(Sha256, StandardVectors) {
  EXPECT_EQ(jit::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(jit::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(jit::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(jit::sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Lengths around the 56- and 64-byte padding limits, fed whole and in uneven pieces (expected values:
// Python's hashlib, i.e. OpenSSL).
TEST(Sha256, PaddingBoundariesAndPieces) {
  const std::pair<size_t, const char*> cases[] = {
      {55, "e7313d333c272e639f790978283f9eb392e843d0f29b7016828bb1daa4aac70b"},
      {56, "4324d65f3c103567f5589c710bc08f8523f929a9272e3af36fc968e52abc6c27"},
      {63, "81c80242132f230c3bd41b3e63bbcff16107339549214a99614ff26664625055"},
      {64, "39e3d7b6b5d075d37d053ad89b24b41bef4f3c29760c84447cab3f3be1882241"},
      {65, "aacca6ff74fdbb296d165a45cecfa04e5127bc008770fbbdd48006f2d2fae95e"},
      {119, "9ce7368e4daf32341631b492e80359dc9f594b48453cd0dd5bf0b19279cc177e"},
      {120, "7836b787757e95e58b3ca5aec90b1b004e8deba1e50e9675af9cabf1a13a04b5"},
      {1000, "1e9bc38cbf860b9ec31918b065f9b52476c549a782e0e7990bed8ce3868d2371"}};
  for (const auto& [n, want] : cases) {
    std::string data = pattern(n);
    EXPECT_EQ(jit::sha256_hex(data), want) << n << " bytes";
    jit::Sha256 pieces;
    for (size_t at = 0, step = 1; at < n; at += step, step = step * 3 % 71 + 1)
      pieces.raw(std::string_view(data).substr(at, step));
    EXPECT_EQ(pieces.hex(), want) << n << " bytes in pieces";
  }
}

// part() is the 8-byte little-endian length, then the bytes: keys written by the OpenSSL build match.
TEST(Sha256, PartsAreLengthPrefixed) {
  EXPECT_NE(jit::Sha256().part("ab").part("c").hex(), jit::Sha256().part("a").part("bc").hex());
  std::string framed = std::string("\x03\0\0\0\0\0\0\0", 8) + "abc";
  EXPECT_EQ(jit::Sha256().part("abc").hex(), jit::sha256_hex(framed));
}

// An explicit KSPEC_NVRTC is the only place looked at, and a wrong one says so.
TEST(NvrtcSearch, KspecNvrtcIsTheOnlyCandidateWhenSet) {
  ScopedEnv env("KSPEC_NVRTC", std::string("/nowhere/libnvrtc.so.13"));
  auto c = jit::nvrtc_candidates();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].source, "KSPEC_NVRTC");
  auto load = jit::load_nvrtc(c);
  EXPECT_NE(load.error.find("KSPEC_NVRTC /nowhere/libnvrtc.so.13: no such file"), std::string::npos)
      << load.error;
  EXPECT_NE(load.error.find("pip install nvidia-cuda-nvrtc"), std::string::npos) << load.error;
}

// Without it: pip's wheels, CUDA_HOME, CUDA_PATH, the loader path, /usr/local/cuda — and when none
// works, the error lists each place with why it was passed over (here also a library that is not NVRTC).
TEST(NvrtcSearch, OrderAndAnErrorNamingEveryPlace) {
  kspec::testing::TempDir tmp;
  ScopedEnv no_override("KSPEC_NVRTC", std::nullopt);
  ScopedEnv home("CUDA_HOME", tmp.path() + "/cuda");
  ScopedEnv path("CUDA_PATH", std::nullopt);
  ScopedNvidiaDirs nv({tmp.path() + "/nvidia"});
  auto c = jit::nvrtc_candidates();
  std::vector<std::string> files;
  for (const auto& x : c) files.push_back(x.source + " " + x.file);
  const std::string t = tmp.path();
  std::vector<std::string> want = {
      "pip nvidia wheel " + t + "/nvidia/cu13/lib/libnvrtc.so.13",
      "pip nvidia wheel " + t + "/nvidia/cu13/lib/libnvrtc.so.12",
      "pip nvidia wheel " + t + "/nvidia/cuda_nvrtc/lib/libnvrtc.so.13",
      "pip nvidia wheel " + t + "/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
      "CUDA_HOME " + t + "/cuda/lib64/libnvrtc.so.13",
      "CUDA_HOME " + t + "/cuda/lib64/libnvrtc.so.12",
      "CUDA_HOME " + t + "/cuda/lib/libnvrtc.so.13",
      "CUDA_HOME " + t + "/cuda/lib/libnvrtc.so.12",
      "loader path libnvrtc.so.13",
      "loader path libnvrtc.so.12",
      "/usr/local/cuda /usr/local/cuda/lib64/libnvrtc.so.13",
      "/usr/local/cuda /usr/local/cuda/lib64/libnvrtc.so.12"};
  EXPECT_EQ(files, want);

  // The places that exist on this machine (the loader path, /usr/local/cuda) are left out, and one
  // library that loads but is not NVRTC (libm) put in.
  std::vector<jit::LibraryCandidate> missing(c.begin(), c.begin() + 8);
  std::string libm = jit::library_of(reinterpret_cast<const void*>(static_cast<double (*)(double)>(&::cos)));
  ASSERT_FALSE(libm.empty());
  missing.push_back({"test", libm});
  missing.push_back({"loader path", "libkspec-no-such-nvrtc.so.13"});
  auto load = jit::load_nvrtc(missing);
  ASSERT_FALSE(load.error.empty());
  for (size_t i = 0; i < 8; ++i)
    EXPECT_NE(load.error.find(want[i] + ": no such file"), std::string::npos) << want[i] << "\n" << load.error;
  EXPECT_NE(load.error.find(libm + ": not NVRTC, or too old: it lacks nvrtcVersion"), std::string::npos)
      << load.error;
  EXPECT_NE(load.error.find("loader path libkspec-no-such-nvrtc.so.13: "), std::string::npos) << load.error;
}

// A wheel's directory comes before the loader path, and the library is reported by the path found
// (here a symlink to this machine's NVRTC laid out as nvidia-cuda-nvrtc's CUDA 13 wheel).
TEST(NvrtcSearch, PipWheelDirectoryIsUsedFirst) {
  const jit::Nvrtc& system = jit::nvrtc();
  EXPECT_GE(system.major, jit::kMinNvrtcMajor);
  kspec::testing::TempDir tmp;
  fs::path lib = fs::path(tmp.path()) / "nvidia/cu13/lib";
  fs::create_directories(lib);
  std::string soname = "libnvrtc.so." + std::to_string(system.major);
  fs::create_symlink(system.path, lib / soname);
  ScopedEnv no_override("KSPEC_NVRTC", std::nullopt);
  ScopedNvidiaDirs nv({tmp.path() + "/nvidia"});
  auto load = jit::load_nvrtc(jit::nvrtc_candidates());
  ASSERT_TRUE(load.error.empty()) << load.error;
  EXPECT_EQ(load.api.path, (lib / soname).string());
  EXPECT_EQ(load.api.major, system.major);
  int major = 0, minor = 0;
  ASSERT_EQ(load.api.nvrtcVersion(&major, &minor), NVRTC_SUCCESS);
  EXPECT_EQ(major, system.major);
}
