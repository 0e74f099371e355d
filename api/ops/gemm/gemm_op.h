// gemm's internal declarations shared by its forward (fwd.cpp) and backward (bwd.cpp): the dtypes and
// activations, the views of a call's tensors, a cuBLASLt algorithm as a tuning config, and the schema
// pieces both ops use (shared.cpp).
#pragma once

#include <string>
#include <vector>

#include "api/src/op.h"
#include "gemm/layout.h"
#include "gemm/lt_matmul.h"

namespace kspec::gemm_op {

extern const std::vector<DType> kFloatTypes;
extern const std::vector<std::string> kActs;
extern const std::string kTuningNote;

int act_code(const Problem& p);
// A tensor [..., rows, cols] as a batched matrix view; its leading dims must collapse into one batch
// stride (size-1 dims may have any stride).
gemm::MatrixView matrix_of(const TensorView& t, const std::string& op, const char* name);
bool weight_broadcast(const TensorView& x, const TensorView& w, const std::string& op);

bool valid_algo_config(const Config& c, const std::vector<std::string>& prefixes, std::string* why);
const gemm::LtAlgoConfig* algo_of(const Config& c, const std::string& prefix, gemm::LtAlgoConfig* storage);
std::vector<Config> candidate_configs(const gemm::LtCall& lt, int device, int max_count, const std::string& prefix);
std::string algo_applies(const gemm::LtCall& lt, const Config& c, const std::string& prefix, int device);

std::vector<ParamDef> gemm_params();
std::vector<DimDef> gemm_dims();
Case gemm_case(std::string name, int64_t batch, int64_t wbatch, int64_t m, int64_t n, int64_t k, std::string act,
               std::vector<std::string> without);

OpDef make_fwd();
OpDef make_bwd();

}  // namespace kspec::gemm_op
