// templates/<family>/params.h: the kernels' parameter structs, compiled by the host (which fills them)
// and by NVRTC (whose kernels read them). A probe kernel, compiled with NVRTC, asserts every field's
// offset and every struct's size as this host compiler computed them, so a member type that differs
// between the two compilers (a size, an alignment) fails here, on a machine without a GPU.
#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "jit/nvrtc.h"
#include "jit/sources.h"
#include "jit/spec.h"
#include "kspec/error.h"
#include "templates/adamw/params.h"
#include "templates/e79/params.h"
#include "templates/gemm/params.h"
#include "templates/norm_act/params.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
using namespace kspec;

namespace {

// static_asserts of the host's layout, as NVRTC source.
class LayoutProbe {
 public:
  template <typename S>
  void size(const char* type) {
    os_ << "static_assert(sizeof(kspec::" << type << ") == " << sizeof(S) << ", \"sizeof " << type << "\");\n";
  }
  void field(const char* type, const char* member, size_t offset) {
    os_ << "static_assert(KSPEC_OFFSETOF(kspec::" << type << ", " << member << ") == " << offset << ", \"" << type
        << "::" << member << "\");\n";
  }
  std::string text() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

#define PROBE_FIELD(probe, type, member) (probe).field(#type, #member, offsetof(type, member))

std::string host_layout() {
  LayoutProbe p;
  p.size<AdamwTensor>("AdamwTensor");
  PROBE_FIELD(p, AdamwTensor, param);
  PROBE_FIELD(p, AdamwTensor, grad);
  PROBE_FIELD(p, AdamwTensor, exp_avg);
  PROBE_FIELD(p, AdamwTensor, exp_avg_sq);
  PROBE_FIELD(p, AdamwTensor, master);
  PROBE_FIELD(p, AdamwTensor, max_exp_avg_sq);
  PROBE_FIELD(p, AdamwTensor, numel);
  p.size<AdamwChunk>("AdamwChunk");
  PROBE_FIELD(p, AdamwChunk, tensor);
  PROBE_FIELD(p, AdamwChunk, start);
  p.size<AdamwScalars>("AdamwScalars");
  PROBE_FIELD(p, AdamwScalars, lr);
  PROBE_FIELD(p, AdamwScalars, step_size);
  PROBE_FIELD(p, AdamwScalars, bias_correction2_sqrt);
  PROBE_FIELD(p, AdamwScalars, max_norm);

  p.size<E79SeqArg>("E79SeqArg");
  PROBE_FIELD(p, E79SeqArg, st);
  PROBE_FIELD(p, E79SeqArg, sb);
  p.size<E79Params>("E79Params");
  PROBE_FIELD(p, E79Params, k);
  PROBE_FIELD(p, E79Params, b_m);
  PROBE_FIELD(p, E79Params, S0);
  PROBE_FIELD(p, E79Params, M0);
  PROBE_FIELD(p, E79Params, out);
  PROBE_FIELD(p, E79Params, S);
  PROBE_FIELD(p, E79Params, checkpoints);
  PROBE_FIELD(p, E79Params, dout);
  PROBE_FIELD(p, E79Params, db_m);
  PROBE_FIELD(p, E79Params, dS);
  PROBE_FIELD(p, E79Params, dM0);
  PROBE_FIELD(p, E79Params, bias_partial);
  PROBE_FIELD(p, E79Params, ws);
  PROBE_FIELD(p, E79Params, db_m_sum);
  PROBE_FIELD(p, E79Params, T);
  PROBE_FIELD(p, E79Params, nchk);
  PROBE_FIELD(p, E79Params, batch);

  p.size<NormActParams>("NormActParams");
  PROBE_FIELD(p, NormActParams, x);
  PROBE_FIELD(p, NormActParams, y);
  PROBE_FIELD(p, NormActParams, rstd);
  PROBE_FIELD(p, NormActParams, dy);
  PROBE_FIELD(p, NormActParams, db_partial);
  PROBE_FIELD(p, NormActParams, dbias);
  PROBE_FIELD(p, NormActParams, x_row_stride);
  PROBE_FIELD(p, NormActParams, dx_row_stride);
  PROBE_FIELD(p, NormActParams, rows);
  PROBE_FIELD(p, NormActParams, rows_per_part);
  PROBE_FIELD(p, NormActParams, num_partials);
  PROBE_FIELD(p, NormActParams, eps);

  p.size<GemmEpilogueParams>("GemmEpilogueParams");
  PROBE_FIELD(p, GemmEpilogueParams, aux);
  PROBE_FIELD(p, GemmEpilogueParams, dpre);
  PROBE_FIELD(p, GemmEpilogueParams, rows);
  PROBE_FIELD(p, GemmEpilogueParams, dy_row_stride);
  p.size<AugmentOperand>("AugmentOperand");
  PROBE_FIELD(p, AugmentOperand, last);
  PROBE_FIELD(p, AugmentOperand, col_stride);
  p.size<AugmentParams>("AugmentParams");
  PROBE_FIELD(p, AugmentParams, w);
  PROBE_FIELD(p, AugmentParams, kp);
  return p.text();
}

// The probe header beside the real templates; compiling its kernel runs the assertions in NVRTC.
jit::CompiledKernel compile_probe(const std::string& assertions) {
  kspec::testing::TempDir tmp;
  const fs::path root = fs::path(tmp.path()) / "templates";
  fs::copy(fs::path(KSPEC_SOURCE_DIR) / "templates", root, fs::copy_options::recursive);
  fs::create_directories(root / "probe");
  std::ofstream(root / "probe" / "layout.cuh")
      << "#pragma once\n#include \"adamw/params.h\"\n#include \"e79/params.h\"\n#include \"gemm/params.h\"\n"
         "#include \"norm_act/params.h\"\n"
      << assertions << "namespace kspec {\ntemplate <int N>\n__global__ void layout_probe_kernel(int* out) {\n"
      << "  if (out) *out = N;\n}\n}  // namespace kspec\n";
  jit::KernelSpec spec;
  spec.header = "probe/layout.cuh";
  spec.kernel = "kspec::layout_probe_kernel";
  spec.targs = {"1"};
  spec.arch = "sm_80";
  auto src = jit::TemplateSource::from_directory(root.string());
  return jit::compile(spec, &src);
}

}  // namespace

TEST(KernelParams, NvrtcSeesTheHostLayout) {
  const std::string assertions = host_layout();
  EXPECT_GT(std::count(assertions.begin(), assertions.end(), '\n'), 60);
  EXPECT_NO_THROW(compile_probe(assertions));
}

// The probe's assertions bite: one wrong offset fails the NVRTC compile, naming the field.
TEST(KernelParams, AWrongOffsetFailsInNvrtc) {
  try {
    compile_probe(host_layout() + "static_assert(KSPEC_OFFSETOF(kspec::E79Params, T) == 1, \"E79Params::T moved\");\n");
    FAIL() << "expected CompileError";
  } catch (const CompileError& e) {
    EXPECT_NE(e.log().find("E79Params::T moved"), std::string::npos) << e.log();
  }
}
