// gemm's pieces shared by its forward and backward (gemm_op.h): activations, matrix views of a call's
// tensors, a cuBLASLt algorithm as a tuning config, params, dims and the case builder.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "common/activations.h"
#include "jit/driver.h"
#include "gemm/layout.h"
#include "gemm/lt_matmul.h"
#include "gemm/reference.h"
#include "templates/gemm/params.h"
#include "gemm/gemm_op.h"

namespace kspec::gemm_op {

const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
const std::vector<std::string> kActs = {"none", "relu", "gelu_tanh"};

int act_code(const Problem& p) {
  return static_cast<int>(std::find(kActs.begin(), kActs.end(), p.param_str("act")) - kActs.begin());
}

// A tensor [..., rows, cols] as a batched matrix view; its leading dims must collapse into one batch
// stride (size-1 dims may have any stride).
gemm::MatrixView matrix_of(const TensorView& t, const std::string& op, const char* name) {
  gemm::MatrixView v;
  v.rows = t.shape[t.rank - 2];
  v.cols = t.shape[t.rank - 1];
  v.row_stride = t.strides[t.rank - 2];
  v.col_stride = t.strides[t.rank - 1];
  int64_t expected = -1;
  for (int j = t.rank - 3; j >= 0; --j) {
    if (t.shape[j] == 1) continue;
    if (expected < 0) {
      v.batch_stride = t.strides[j];
    } else {
      KSPEC_CHECK(t.strides[j] == expected, op, ": '", name, "': its batch dims cannot be flattened into one batch "
                  "stride (", t.describe(), "); pass a view whose dims before the last two have a single stride");
    }
    expected = t.strides[j] * t.shape[j];
  }
  return v;
}

// The weight's batch dims: none (or all 1: one weight for every batch) or exactly x's.
bool weight_broadcast(const TensorView& x, const TensorView& w, const std::string& op) {
  bool all_one = true;
  for (int j = 0; j + 2 < w.rank; ++j) all_one = all_one && w.shape[j] == 1;
  if (all_one) return true;
  bool same = w.rank == x.rank;
  for (int j = 0; same && j + 2 < w.rank; ++j) same = w.shape[j] == x.shape[j];
  KSPEC_CHECK(same, op, ": 'weight' ", w.describe(), ": its batch dims must be absent (one weight for all) or equal "
              "to x's ", x.describe());
  return false;
}

// ---- tuning: a cuBLASLt algorithm as a config ----
// The space is the heuristic's top candidates for the problem (found on the GPU by the tuner); the default
// config is empty: cuBLASLt's first choice, as without tuning. gemm's config names an algorithm's fields
// ("algo=..,tile=..,stages=.."); gemm.bwd's name the dx and dW GEMMs' ("dx.algo=..", "dw.algo=..").

// Every name in the config is one of the algorithm fields behind one of `prefixes`, and each prefix's
// fields are complete and in range.
bool valid_algo_config(const Config& c, const std::vector<std::string>& prefixes, std::string* why) {
  for (const auto& [name, v] : c.values) {
    bool known = false;
    for (const auto& pre : prefixes)
      for (const auto& f : gemm::lt_algo_fields()) known = known || name == pre + f;
    if (!known) {
      if (why) *why = "'" + name + "' is not a cuBLASLt algorithm field (" + (prefixes[0].empty() ? "" : "dx./dw. + ") +
                      "algo, tile, stages, splitk, reduction, swizzle, custom, inner, cluster)";
      return false;
    }
  }
  for (const auto& pre : prefixes) {
    gemm::LtAlgoConfig a;
    bool found = false;
    std::string w;
    if (!gemm::algo_from_config(c, pre, &a, &found, &w)) {
      if (why) *why = w;
      return false;
    }
  }
  return true;
}

// The algorithm a config names for one GEMM (`prefix`), or nullptr for the heuristic's. `storage` holds it.
const gemm::LtAlgoConfig* algo_of(const Config& c, const std::string& prefix, gemm::LtAlgoConfig* storage) {
  if (c.values.empty()) return nullptr;
  bool found = false;
  std::string why;
  if (!gemm::algo_from_config(c, prefix, storage, &found, &why)) throw InvalidArgument("gemm: config {" + c.str() + "}: " + why);
  return found ? storage : nullptr;
}

std::vector<Config> candidate_configs(const gemm::LtCall& lt, int device, int max_count, const std::string& prefix) {
  std::vector<Config> out;
  for (const auto& cand : gemm::lt_candidates(lt, device, gemm::kLtWorkspaceBytes, max_count)) {
    Config c;
    gemm::add_to_config(cand.config, prefix, c);
    out.push_back(std::move(c));
  }
  return out;
}

// "" when the config's algorithm(s) apply to the call's GEMM(s), else why not.
std::string algo_applies(const gemm::LtCall& lt, const Config& c, const std::string& prefix, int device) {
  gemm::LtAlgoConfig a;
  const gemm::LtAlgoConfig* algo = algo_of(c, prefix, &a);
  std::string why;
  if (!algo || gemm::lt_algo_applies(lt, *algo, device, gemm::kLtWorkspaceBytes, &why)) return "";
  return (prefix.empty() ? "" : prefix) + "cuBLASLt refuses it: " + why;
}

const std::string kTuningNote = "cuBLASLt algorithm: the heuristic's top candidates, timed by kspec tune";

std::vector<ParamDef> gemm_params() {
  return {{"act", ParamType::Choice, std::string("none"), kActs,
           "activation after the bias: none, relu, or gelu_tanh (cuBLASLt's GELU epilogue)", false, std::nullopt,
           std::nullopt, kActivationAliases},
          {"tf32", ParamType::Bool, false, {}, "fp32 inputs: allow TF32 tensor cores (about 1e-3 relative error)"}};
}

std::vector<DimDef> gemm_dims() {
  return {{"batch", DimKind::Var, {}, "product of x's leading dims"},
          {"wbatch", DimKind::Var, {}, "product of weight's leading dims: 1 (shared) or batch"},
          {"m", DimKind::Var, {}, "rows of x"},
          {"n", DimKind::Var, {}, "output features (rows of weight)"},
          {"k", DimKind::Var, {}, "input features"}};
}

Case gemm_case(std::string name, int64_t batch, int64_t wbatch, int64_t m, int64_t n, int64_t k, std::string act,
               std::vector<std::string> without) {
  Case c;
  c.name = std::move(name);
  c.dims = {{"batch", batch}, {"wbatch", wbatch}, {"m", m}, {"n", n}, {"k", k}};
  c.params = {{"act", act}};
  c.without = std::move(without);
  return c;
}

// Sizes from {1, 7, 33, 4097} in every position (the float64 reference runs on the CPU, so 4097 appears in

}  // namespace kspec::gemm_op
