// jit/: specialization values, architecture rules, content keys (an edited template changes the key,
// an unrelated one does not), NVRTC compilation, resource reports and compile errors.
#include <filesystem>
#include <fstream>

#include "jit/key.h"
#include "jit/nvrtc.h"
#include "jit/sources.h"
#include "jit/spec.h"
#include "kspec/error.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
using namespace kspec;

namespace {

jit::KernelSpec fwd_spec(const std::string& arch = "sm_90a") {
  jit::KernelSpec s;
  s.header = "norm_act/norm_act.cuh";
  s.kernel = "kspec::norm_act_fwd_kernel";
  s.targs = {"__nv_bfloat16", "__nv_bfloat16", "4096", "1", "1", "true", "256", "1", "8"};
  s.arch = arch;
  return s;
}

void copy_templates(const std::string& dst) {
  fs::copy(fs::path(KSPEC_SOURCE_DIR) / "templates", dst, fs::copy_options::recursive);
}

void append(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::app);
  out << text;
}

}  // namespace

TEST(Spec, CanonicalAndNameExpression) {
  auto s = fwd_spec();
  EXPECT_EQ(s.name_expression(),
            "kspec::norm_act_fwd_kernel<__nv_bfloat16, __nv_bfloat16, 4096, 1, 1, true, 256, 1, 8>");
  EXPECT_NE(s.canonical().find("sm_90a"), std::string::npos);
  auto t = s;
  t.targs[2] = "4095";
  EXPECT_NE(s.canonical(), t.canonical());
  t = s;
  t.defines.push_back({"KSPEC_X", "1"});
  EXPECT_NE(s.canonical(), t.canonical());
  EXPECT_NE(s.source().find("#include \"norm_act/norm_act.cuh\""), std::string::npos);
}

TEST(Spec, ResolveArch) {
  EXPECT_EQ(jit::resolve_arch("sm_90"), "sm_90a");
  EXPECT_EQ(jit::resolve_arch("90"), "sm_90a");
  EXPECT_EQ(jit::resolve_arch("sm_80"), "sm_80");
  EXPECT_EQ(jit::resolve_arch("compute_80"), "compute_80");
  EXPECT_EQ(jit::arch_for_compute_capability(9, 0), "sm_90a");
  EXPECT_THROW(jit::resolve_arch("hopper"), InvalidArgument);
  EXPECT_THROW(jit::resolve_arch("sm_9"), InvalidArgument);
  // An architecture NVRTC cannot emit SASS for (here: a future one) falls back to PTX.
  EXPECT_EQ(jit::resolve_arch("sm_199").rfind("compute_", 0), 0u);
  // What ops' rules read from a resolved arch ("cluster kernels need sm_90 or newer").
  EXPECT_EQ(jit::compute_capability("sm_90a"), 90);
  EXPECT_EQ(jit::compute_capability(jit::resolve_arch("sm_80")), 80);
  EXPECT_EQ(jit::compute_capability("compute_86"), 86);
  EXPECT_EQ(jit::compute_capability("sm_100f"), 100);
  EXPECT_EQ(jit::compute_capability(""), 0);
  EXPECT_EQ(jit::compute_capability("hopper"), 0);
}

TEST(Sources, EmbeddedTemplatesMatchTheTree) {
  auto emb = jit::TemplateSource::embedded();
  auto dir = jit::TemplateSource::from_directory(std::string(KSPEC_SOURCE_DIR) + "/templates");
  ASSERT_FALSE(emb.names().empty());
  EXPECT_EQ(emb.names(), dir.names());
  for (const auto& n : emb.names()) EXPECT_EQ(emb.read(n), dir.read(n)) << n;
}

TEST(Sources, IncludeClosure) {
  auto src = jit::TemplateSource::embedded();
  auto closure = src.kspec_closure("norm_act/norm_act.cuh");
  std::vector<std::string> names;
  for (const auto& f : closure) names.push_back(f.name);
  EXPECT_NE(std::find(names.begin(), names.end(), "norm_act/norm_act.cuh"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "common/dtype.cuh"), names.end());
  EXPECT_FALSE(jit::cuda_include_dir().empty()) << "no CUDA include dir found";
  auto sys = src.system_closure("norm_act/norm_act.cuh");
  bool has_bf16 = false;
  for (const auto& f : sys) has_bf16 = has_bf16 || f.name == "cuda_bf16.h";
  EXPECT_TRUE(has_bf16);
  EXPECT_THROW(src.read("no/such.cuh"), InvalidArgument);
}

TEST(Key, EditedIncludeChangesKeyUnrelatedEditDoesNot) {
  kspec::testing::TempDir tmp;
  std::string root = tmp.path() + "/templates";
  copy_templates(root);
  auto spec = fwd_spec();
  std::string k0 = jit::compute_content_key(spec, jit::TemplateSource::from_directory(root));
  EXPECT_EQ(k0.size(), 64u);
  EXPECT_EQ(k0, jit::compute_content_key(spec, jit::TemplateSource::from_directory(root)));
  // The embedded copy and the tree are the same bytes: same key.
  EXPECT_EQ(k0, jit::compute_content_key(spec, jit::TemplateSource::embedded()));
  // A new file nobody includes: same key.
  std::ofstream(root + "/common/unrelated.cuh") << "#pragma once\n// not included by norm_act\n";
  EXPECT_EQ(k0, jit::compute_content_key(spec, jit::TemplateSource::from_directory(root)));
  // An edit to a header norm_act includes (indirectly): new key.
  append(root + "/common/dtype.cuh", "\n// edited\n");
  std::string k1 = jit::compute_content_key(spec, jit::TemplateSource::from_directory(root));
  EXPECT_NE(k0, k1);
  // Different arch, different key.
  EXPECT_NE(jit::compute_content_key(fwd_spec("sm_80"), jit::TemplateSource::from_directory(root)), k1);
}

TEST(Nvrtc, CompilesCubinAndReportsResources) {
  for (std::string arch : {"sm_90a", "sm_80"}) {
    auto ck = jit::compile(fwd_spec(arch));
    EXPECT_TRUE(ck.is_cubin);
    ASSERT_GT(ck.binary.size(), 4u);
    EXPECT_EQ(ck.binary.substr(0, 4), std::string("\x7f" "ELF"));
    EXPECT_FALSE(ck.lowered_name.empty());
    EXPECT_GT(ck.resources.registers, 0) << ck.log;
    EXPECT_EQ(ck.resources.spill_bytes, 0) << ck.log;
    EXPECT_GE(ck.resources.static_shared_bytes, 0);
    EXPECT_GT(ck.compile_ms, 0);
  }
}

TEST(Nvrtc, PtxFallback) {
  auto ck = jit::compile(fwd_spec("compute_80"));
  EXPECT_FALSE(ck.is_cubin);
  EXPECT_NE(ck.binary.find(".entry"), std::string::npos);
}

TEST(Nvrtc, BrokenTemplateRaisesCompileErrorWithSourceFile) {
  kspec::testing::TempDir tmp;
  std::string root = tmp.path() + "/templates";
  copy_templates(root);
  append(root + "/norm_act/norm_act.cuh", "\nthis is not C++;\n");
  auto src = jit::TemplateSource::from_directory(root);
  try {
    jit::compile(fwd_spec(), &src);
    FAIL() << "expected CompileError";
  } catch (const CompileError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("norm_act_fwd_kernel"), std::string::npos) << msg;
    EXPECT_NE(msg.find("NVRTC log"), std::string::npos);
    // Which NVRTC rejected it: the version and the library, found at run time (jit/cuda_libs.h).
    EXPECT_NE(msg.find("\nNVRTC " + jit::nvrtc_version() + " from " + jit::nvrtc().path), std::string::npos) << msg;
    EXPECT_FALSE(e.log().empty());
    EXPECT_NE(e.options().find("-arch=sm_90a"), std::string::npos);
    ASSERT_TRUE(fs::exists(e.source_path())) << e.source_path();
    std::ifstream in(e.source_path());
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("this is not C++"), std::string::npos);
    EXPECT_NE(msg.find(e.source_path()), std::string::npos);
    fs::remove(e.source_path());
  }
}

TEST(Nvrtc, UnknownTemplateIsInvalidArgument) {
  auto s = fwd_spec();
  s.header = "nope/missing.cuh";
  EXPECT_THROW(jit::compile(s), InvalidArgument);
}

// An NVRTC API call that fails for a reason other than the code (here one NVRTC refuses: no program
// handle to create) is a CudaError naming the call, NVRTC's reason and where it was checked.
TEST(Nvrtc, FailedApiCallIsCudaErrorWithFileAndLine) {
  const int line = __LINE__ + 2;
  auto failing = [] {
    NVRTC_CHECK(nvrtcCreateProgram(nullptr, "", "empty.cu", 0, nullptr, nullptr));
  };
  try {
    failing();
    FAIL() << "expected a CudaError";
  } catch (const CudaError& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.rfind("nvrtcCreateProgram(nullptr, ", 0), 0u) << msg;
    EXPECT_NE(msg.find(" failed: NVRTC_ERROR_"), std::string::npos) << msg;
    EXPECT_NE(msg.find(detail::concat(" at ", __FILE__, ":", line, " (NVRTC ", jit::nvrtc_version())),
              std::string::npos) << msg;
  }
}

TEST(Nvrtc, ParsePtxasLog) {
  auto r = jit::parse_ptxas_log(
      "ptxas info    : Function properties for k\n"
      "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 40 registers, used 1 barriers, 16 bytes cumulative stack size, 256 bytes smem\n");
  EXPECT_EQ(r.registers, 40);
  EXPECT_EQ(r.spill_bytes, 12);
  EXPECT_EQ(r.stack_bytes, 16);
  EXPECT_EQ(r.static_shared_bytes, 256);
}

TEST(Key, CudaHeaderHashMemoIsReusedAndRechecked) {
  kspec::testing::TempDir tmp;
  auto src = jit::TemplateSource::embedded();
  std::string direct = jit::system_headers_hash(src, "norm_act/norm_act.cuh", "");
  std::string first = jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path());
  EXPECT_EQ(first, direct);
  std::vector<fs::path> memos;
  for (const auto& e : fs::directory_iterator(tmp.path())) memos.push_back(e.path());
  ASSERT_EQ(memos.size(), 1u);
  std::ifstream in(memos[0]);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, direct);
  // A memo whose recorded sizes no longer match the headers is ignored and rewritten.
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(memos[0]) << std::string(64, '0') << "\n1 1 cuda_bf16.h\n";
  EXPECT_EQ(jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path()), direct);
  std::ifstream again(memos[0]);
  std::getline(again, line);
  EXPECT_EQ(line, direct);
  // A trusted, fresh memo is what a later process reads (its hash is returned as written).
  EXPECT_EQ(jit::system_headers_hash(src, "norm_act/norm_act.cuh", tmp.path()), direct);
}
