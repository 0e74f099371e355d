// gemm: y = act(x·Wᵀ + b) through cuBLASLt (a library op: no NVRTC kernel in the forward), batched,
// fp32/fp16/bf16 with fp32 accumulation, and its backward gemm.bwd (dx, dW, dbias; one NVRTC
// elementwise kernel for act'(pre) when there is an activation). Views of any transposition reach
// cuBLASLt without copies through gemm/layout.h.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "jit/driver.h"
#include "gemm/layout.h"
#include "gemm/lt_matmul.h"
#include "gemm/reference.h"
#include "templates/gemm/params.h"

namespace kspec {
namespace {

const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
const std::vector<std::string> kActs = {"none", "relu", "gelu"};
constexpr unsigned kActGradThreads = 256;

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

// gemm's unfused epilogue (relu/gelu): unfused=1: cuBLASLt's plain GEMM with its BIAS epilogue (relu in
// fp16/bf16: the bias as C, see bias_through_c), then templates/gemm/gemm_bias_act.cuh applies the
// activation (and saves aux); unfused=2 (gelu only): the bias too in that kernel, added to the rounded
// product, which would decide relu's sign at the output's precision. The plain GEMM runs cuBLASLt's
// heuristic algorithm.
constexpr unsigned kBiasActThreads = 256;

int64_t unfused_of(const Config& c) { return c.has("unfused") ? c.get("unfused") : 0; }

// ReLU + bias in fp16/bf16: the bias goes in as cuBLASLt's C operand (y filled with it by
// templates/gemm/gemm_fill_bias.cuh, beta = 1) under the plain RELU epilogue, so x·Wᵀ + b is summed in fp32
// and ReLU takes the sign of that sum. With the fused RELU_BIAS epilogue kspec's bf16 backward, which masks
// with y > 0, was 4e-2 off (x [33, 7], W [4097, 7]; torch's F.relu(F.linear) 1.7e-3; issue 33), and the
// tests' mask check (test_gpu_gemm.py, _pre_seen) had allowed sign flips up to two roundings of x·Wᵀ; with
// the bias through C the strict check and every gradient pass on the H100 (2026-11-26). The mechanism is
// not confirmed: the working guess was the bias added after x·Wᵀ is rounded, but torch._addmm_activation
// (also RELU_BIAS) gave no sign flips against float64 at that shape in the same run. In fp32 the output
// type is the sum's: the fused epilogue stays.
bool bias_through_c(const Problem& p) {
  return act_code(p) == 1 && p.present("bias") && p.dtype("x") != DType::f32;
}

// Where K is small beside the output, the bias goes in as one more column of the product instead
// (templates/gemm/gemm_augment.cuh: x' = [x, 1, 0…], W' = [W, b, 0…], K' = K + 1 rounded up to 8): the
// copies cost about 2·(batch·m + wbatch·n)·K' elements of traffic, the bias through C 2·batch·m·n (fill y,
// read it back). Same fp32 sum, so the same sign for ReLU. H100 bf16 relu+bias, KSPEC_TUNE=off linear_sweep
// (2026-11-27), torch's F.linear then F.relu / kspec ms: 16384x4096x33 0.234 / 0.065 (was 0.283 through C),
// 16384x4096x64 0.149 / 0.069, 4097x4095x7 0.058 / 0.034, 4096x4095x1024 0.373 / 0.397. Up to K = 1024
// only: the copy kernel (a 64-bit division per element) made 16384x11008x4096 2.59 ms against 1.97 for the
// GEMM alone, where the bias through C costs less than its copies of x and W.
constexpr int64_t kAugmentAlign = 8, kAugmentMostK = 1024;

int64_t augmented_k(int64_t k) { return (k + 1 + kAugmentAlign - 1) / kAugmentAlign * kAugmentAlign; }

bool bias_as_column(const Problem& p) {
  if (!bias_through_c(p) || !p.has_dim("m") || !p.has_dim("n") || !p.has_dim("k")) return false;
  if (p.dim("k") > kAugmentMostK) return false;
  const int64_t batch = std::max<int64_t>(p.has_dim("batch") ? p.dim("batch") : 1, 1);
  const int64_t wbatch = std::max<int64_t>(p.has_dim("wbatch") ? p.dim("wbatch") : 1, 1);
  const int64_t copied = (batch * p.dim("m") + wbatch * p.dim("n")) * augmented_k(p.dim("k"));
  return copied < batch * p.dim("m") * p.dim("n");
}

// ---- the untuned default: cuBLASLt's fused epilogue, or unfused (plain GEMM, then kspec's kernel) ----
// cuBLASLt's fused GELU epilogue runs slow kernels where n or k is not a multiple of 8 (rows not 16-byte
// aligned). H100 bf16, KSPEC_TUNE=off bench.py --family linear_sweep (2026-11-26), ms, fused / unfused=1
// (cuBLASLt's BIAS epilogue, then kspec's GELU pass) / torch's F.linear then F.gelu:
//   4097x4095x33 0.199 / 0.092 / 0.063, 4097x4095x7 0.171 / 0.087 / 0.058, 4096x4095x1024 1.232 / 0.444 /
//   0.376, 4096x4097x4096 4.393 / 1.483 / 1.441, 16384x4096x33 0.378 / 0.406 / 0.234;
// with n and k multiples of 8 the fused epilogue wins: 16384x4096x64 0.069 / 0.320 / 0.148, 4096^3 0.186 /
// 0.246 / 0.204, 16384x11008x4096 2.180 / 2.663 / 2.267; and on a tiny output (33x4097x7: 0.009 / 0.012)
// one launch does. The unfused GELU pass then took 0.05-0.27 ms for y of 33-134 MB (a 64-bit division per
// element; now a flat 16-byte walk): re-measure with the sweep before moving these bounds.
constexpr int64_t kUnfusedAlign = 8, kUnfusedMinOutputs = int64_t(1) << 20;

// The default's unfused level for a problem: 0 (fused) or 1 (BIAS epilogue, then kspec's act kernel).
// ReLU keeps the fused path (16-bit with a bias: the bias through C, see bias_through_c).
int64_t default_unfused(const Problem& p) {
  if (act_code(p) != 2 || !p.has_dim("k") || !p.has_dim("m") || !p.has_dim("n")) return 0;
  int64_t batch = p.has_dim("batch") ? std::max<int64_t>(p.dim("batch"), 1) : 1;
  int64_t outputs = batch * p.dim("m") * p.dim("n");
  const bool aligned = p.dim("n") % kUnfusedAlign == 0 && p.dim("k") % kUnfusedAlign == 0;
  return !aligned && outputs >= kUnfusedMinOutputs ? 1 : 0;
}

bool valid_fwd_config(const Problem& p, const Config& c, std::string* why) {
  if (!c.has("unfused")) return valid_algo_config(c, {""}, why);
  auto fail = [&](std::string w) {
    if (why) *why = std::move(w);
    return false;
  };
  int64_t u = c.get("unfused");
  if (c.values.size() != 1) return fail("unfused runs cuBLASLt's heuristic for the plain GEMM: no algorithm fields with it");
  if (u != 1 && u != 2) return fail("unfused is 1 (bias in cuBLASLt's epilogue) or 2 (bias in kspec's kernel)");
  if (act_code(p) == 0) return fail("unfused is for act=relu or act=gelu");
  if (u == 2 && act_code(p) != 2)
    return fail("unfused=2 is for gelu (relu's sign must be taken before the product is rounded)");
  if (u == 2 && !p.present("bias")) return fail("unfused=2 adds the bias in kspec's kernel, and there is no bias");
  return true;
}

// Where augmented operands are planned without a workspace (check_call, tuning candidates, explain): a
// stand-in address (256-byte aligned, as the workspace is); nothing is read or written through it.
void* const kAugmentStandIn = reinterpret_cast<void*>(uintptr_t(1) << 20);

struct FwdPlan {
  gemm::LtCall lt;
  bool fill_bias = false;  // y is filled with the bias first and read back as C (bias_through_c)
  bool bias_column = false;  // x' and W' carry the bias as one more column (bias_as_column)
  int64_t kp = 0;            // their K'
  int64_t x_rows = 0, w_rows = 0;  // rows of x' (batch·m) and of W' (wbatch·n)
  gemm::MatrixView xv, wv;   // the original operands' views
  size_t x_bytes = 0, w_bytes = 0;  // the copies' sizes (each rounded up to 256 bytes)
};

// The augmented copies at `ws` (x' then W'), or the stand-in address.
void point_at_copies(FwdPlan& f, char* ws) {
  f.lt.b = ws;
  f.lt.a = ws + f.x_bytes;
}

FwdPlan plan_fwd(const Call& call) {
  const std::string& op = call.problem.op->info.name;
  const TensorView &x = call.in("x"), &w = call.in("weight"), &b = call.in("bias");
  const TensorView &y = call.out("y"), &aux = call.out("aux");
  int act = act_code(call.problem);
  gemm::MatrixView xv = matrix_of(x, op, "x"), wv = matrix_of(w, op, "weight"), yv = matrix_of(y, op, "y");
  if (weight_broadcast(x, w, op)) wv.batch_stride = 0;
  int64_t batch = call.problem.dim("batch");
  FwdPlan f;
  gemm::LtCall& lt = f.lt;
  lt.g = gemm::map_row_major(yv, xv, gemm::transposed(wv), std::max<int64_t>(batch, 1), "y", "x", "weight");
  lt.ab_dtype = lt.d_dtype = x.dtype;
  lt.tf32 = call.problem.param_bool("tf32");
  lt.a = w.data;
  lt.b = x.data;
  lt.d = y.data;
  bool has_bias = b.defined(), has_aux = aux.defined();
  KSPEC_CHECK(!has_aux || act == 2, op, ": output 'aux' (the saved pre-activation) is only for act='gelu'; relu's "
              "backward needs only y, none needs nothing");
  if (has_aux) {
    int64_t n = call.problem.dim("n");
    KSPEC_CHECK_AS(n % 8 == 0, Unsupported, op, ": saving the GELU pre-activation ('aux') needs n a multiple of 8 "
                   "(cuBLASLt's GELU_AUX leading dimension), got n = ", n);
    lt.aux = aux.data;
    lt.aux_ld = n;  // aux is contiguous [..., m, n]: in the column-major frame n x m with ld n
    lt.aux_batch_stride = lt.g.batch > 1 ? call.problem.dim("m") * n : 0;
  }
  lt.bias = has_bias ? b.data : nullptr;
  f.xv = xv;
  f.wv = wv;
  if (bias_as_column(call.problem)) {
    const bool shared = wv.batch_stride == 0;
    const int64_t bt = std::max<int64_t>(batch, 1), m = call.problem.dim("m"), n = call.problem.dim("n");
    const size_t es = dtype_size(x.dtype);
    auto round256 = [](size_t v) { return (v + 255) / 256 * 256; };
    f.bias_column = true;
    f.kp = augmented_k(call.problem.dim("k"));
    f.x_rows = bt * m;
    f.w_rows = (shared ? 1 : bt) * n;
    f.x_bytes = round256(size_t(f.x_rows * f.kp) * es);
    f.w_bytes = round256(size_t(f.w_rows * f.kp) * es);
    gemm::MatrixView xa{m, f.kp, f.kp, 1, m * f.kp}, wa{n, f.kp, f.kp, 1, shared ? 0 : n * f.kp};
    lt.g = gemm::map_row_major(yv, xa, gemm::transposed(wa), bt, "y", "x", "weight");
    point_at_copies(f, static_cast<char*>(kAugmentStandIn));
    lt.bias = nullptr;
    lt.epilogue = CUBLASLT_EPILOGUE_RELU;
    return f;
  }
  if (bias_through_c(call.problem)) {
    f.fill_bias = true;
    lt.bias = nullptr;
    lt.beta = 1.f;  // C = D = y, holding the bias
    lt.epilogue = CUBLASLT_EPILOGUE_RELU;
    return f;
  }
  switch (act) {
    case 0: lt.epilogue = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT; break;
    case 1: lt.epilogue = has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU; break;
    default:
      lt.epilogue = has_aux ? (has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                            : (has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU);
  }
  return f;
}

std::vector<ParamDef> gemm_params() {
  return {{"act", ParamType::Choice, std::string("none"), kActs,
           "activation after the bias: none, relu, or gelu (tanh approximation, as cuBLASLt's epilogue)"},
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
// one dim at a time), each activation with and without bias, batched with per-batch and shared weights.
std::vector<Case> fwd_cases() {
  std::vector<Case> c = {
      gemm_case("base", 1, 1, 33, 33, 33, "none", {"aux"}),
      gemm_case("m_1", 1, 1, 1, 7, 33, "none", {"aux"}),
      gemm_case("n_1", 1, 1, 7, 1, 33, "none", {"aux"}),
      gemm_case("k_1", 1, 1, 33, 7, 1, "none", {"aux"}),
      gemm_case("k_4097", 1, 1, 7, 33, 4097, "none", {"aux"}),
      gemm_case("m_4097", 1, 1, 4097, 7, 33, "none", {"aux"}),
      gemm_case("n_4097", 1, 1, 33, 4097, 7, "none", {"aux"}),
      gemm_case("no_bias", 1, 1, 33, 7, 33, "none", {"bias", "aux"}),
      gemm_case("relu_bias", 1, 1, 33, 64, 33, "relu", {"aux"}),
      gemm_case("relu_no_bias", 1, 1, 7, 33, 33, "relu", {"bias", "aux"}),
      gemm_case("relu_bias_small_k", 1, 1, 65, 130, 7, "relu", {"aux"}),
      gemm_case("relu_bias_small_k_batched", 3, 3, 33, 65, 7, "relu", {"aux"}),
      gemm_case("relu_bias_small_k_shared_weight", 4, 1, 33, 65, 9, "relu", {"aux"}),
      gemm_case("gelu_bias", 1, 1, 33, 33, 7, "gelu", {"aux"}),
      gemm_case("gelu_bias_aux", 1, 1, 33, 64, 33, "gelu", {}),
      gemm_case("gelu_aux_no_bias", 1, 1, 7, 16, 33, "gelu", {"bias"}),
      gemm_case("batched", 3, 3, 7, 33, 33, "none", {"aux"}),
      gemm_case("batched_shared_weight", 4, 1, 7, 33, 33, "gelu", {}),
      gemm_case("large_1024", 1, 1, 256, 1024, 1024, "gelu", {}),
  };
  for (Case& e : c) {
    if (e.name == "batched_shared_weight") e.dims[3].second = 40;  // n = 40 (a multiple of 8 for aux)
  }
  c.back().large = true;
  return c;
}

std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  int64_t batch = p.dim("batch"), wbatch = p.dim("wbatch"), m = p.dim("m"), n = p.dim("n"), k = p.dim("k");
  const std::vector<double>* bias = in[2].defined ? &in[2].data : nullptr;
  auto r = ref::gemm_fwd_ref(in[0].data, in[1].data, bias, batch, wbatch, m, n, k, act_code(p));
  std::vector<int64_t> shape = in[0].shape;
  shape.back() = n;
  std::vector<HostTensor> out(2);
  out[0] = {true, shape, std::move(r.y)};
  if (p.present("aux")) out[1] = {true, shape, std::move(r.pre)};
  return out;
}

// Blocks of a grid-stride elementwise kernel over `total` elements (a few waves at most; 0 for none).
unsigned grid_for(Launcher& l, int64_t total) {
  return static_cast<unsigned>(std::min<int64_t>((total + kBiasActThreads - 1) / kBiasActThreads,
                                                 int64_t(l.multiprocessors()) * 16));
}

// The forward's elementwise kernels' parameters for one block of y's rows (templates/gemm/params.h).
GemmEpilogueParams y_block_params(void* y, const void* bias, void* aux, long long rows, long long cols,
                                  long long stride) {
  GemmEpilogueParams prm{};
  prm.y = y;
  prm.bias = bias;
  prm.aux = aux;
  prm.rows = rows;
  prm.cols = cols;
  prm.y_row_stride = stride;
  return prm;
}

// y (and aux, contiguous like it) as blocks of rows at one row stride for an elementwise kernel: one block
// when its batches lie end to end (or there is one row per batch), else one per batch.
template <typename F>
void for_each_y_block(const Call& call, F&& f) {
  const TensorView &y = call.out("y"), &aux = call.out("aux");
  gemm::MatrixView yv = matrix_of(y, call.problem.op->info.name, "y");
  int64_t batch = std::max<int64_t>(call.problem.dim("batch"), 1), m = yv.rows, n = yv.cols;
  bool uniform = batch == 1 || m == 1 || yv.batch_stride == m * yv.row_stride;
  int64_t blocks = uniform ? 1 : batch;
  long long rows = uniform ? batch * m : m, cols = n;
  long long stride = m == 1 && batch > 1 ? yv.batch_stride : yv.row_stride;
  size_t esize = dtype_size(y.dtype);
  if (rows * cols == 0) return;
  for (int64_t k = 0; k < blocks; ++k) {
    void* yp = static_cast<char*>(y.data) + k * yv.batch_stride * esize;
    void* ap = aux.defined() ? static_cast<void*>(static_cast<char*>(aux.data) + k * m * n * esize) : nullptr;
    f(yp, ap, rows, cols, stride);
  }
}

OpDef make_fwd() {
  OpDef op;
  OpInfo& i = op.info;
  i.name = "gemm";
  i.family = "gemm";
  i.doc = "y = act(x·Wᵀ + b) through cuBLASLt (nn.Linear layout), batched, any transposed or strided views";
  i.inputs = {
      {"x", {"...batch", "m", "k"}, kFloatTypes, "", false, false, "", Layout::Strided,
       "input; any view with one unit-stride dim of the last two"},
      {"weight", {"...wbatch", "n", "k"}, {}, "x", false, false, "", Layout::Strided,
       "nn.Linear layout; batch dims absent (shared) or x's"},
      {"bias", {"n"}, {}, "x", false, true, "", Layout::Contiguous, "added before the activation"},
  };
  i.outputs = {
      {"y", {"...batch", "m", "n"}, {}, "x", false, false, "", Layout::Strided, "output; unit stride along n"},
      {"aux", {"...batch", "m", "n"}, {}, "x", false, true, "", Layout::Contiguous,
       "optional: the pre-activation x·Wᵀ + b, saved for the backward (act=gelu, n a multiple of 8)"},
  };
  i.params = gemm_params();
  i.dims = gemm_dims();
  i.reference = "api/ops/gemm/reference.cpp (python/kspec/reference/gemm.py)";
  op.check_call = [](const Call& call) { plan_fwd(call); };
  op.tuning.heuristic = [](const Problem& p) {
    return default_unfused(p) ? Config{{{"unfused", default_unfused(p)}}} : Config{};
  };
  // The heuristic and the bias's way in read runtime dims: the plan cache keeps their choices apart.
  op.derived_key = [](const Problem& p) {
    return std::string(default_unfused(p) ? "unfused" : "") + (bias_as_column(p) ? "+bias_column" : "");
  };
  op.tuning.valid = valid_fwd_config;
  op.tuning.candidates = [](const Call& call, int n) {
    std::vector<Config> out = candidate_configs(plan_fwd(call).lt, call.device, n, "");
    if (act_code(call.problem) != 0) out.push_back(Config{{{"unfused", 1}}});
    if (act_code(call.problem) == 2 && call.problem.present("bias")) {
      out.push_back(Config{{{"unfused", 2}}});
    }
    return out;
  };
  op.tuning.applies = [](const Call& call, const Config& c) {
    return unfused_of(c) ? std::string() : algo_applies(plan_fwd(call).lt, c, "", call.device);
  };
  i.tuning_note = kTuningNote + "; or unfused=1 with act relu/gelu, unfused=2 with gelu (the plain GEMM, then kspec's "
                                "bias/act kernel)";
  op.kernels = [](const Problem& p, const Config& c) {
    std::vector<jit::KernelSpec> out;
    int64_t u = unfused_of(c);
    if (bias_as_column(p)) {
      out.push_back(kernel_spec(p, "gemm/gemm_augment.cuh", "kspec::gemm_augment_kernel",
                                {dtype_cuda_type(p.dtype("x")), std::to_string(kBiasActThreads)}));
    } else if (bias_through_c(p)) {
      out.push_back(kernel_spec(p, "gemm/gemm_fill_bias.cuh", "kspec::gemm_fill_bias_kernel",
                                {dtype_cuda_type(p.dtype("x")), std::to_string(kBiasActThreads)}));
    }
    if (u == 0) return out;  // cuBLASLt alone (after the bias fill)
    out.push_back(kernel_spec(p, "gemm/gemm_bias_act.cuh", "kspec::gemm_bias_act_kernel",
                              {dtype_cuda_type(p.dtype("x")), std::to_string(act_code(p)),
                               u == 2 ? "true" : "false", p.present("aux") ? "true" : "false",
                               std::to_string(kBiasActThreads)}));
    return out;
  };
  op.launch = [](const Call& call, const Config& config, Launcher& l) {
    FwdPlan f = plan_fwd(call);
    int64_t u = unfused_of(config);
    gemm::LtAlgoConfig algo;
    f.lt.algo = u ? nullptr : algo_of(config, "", &algo);
    if (u) {
      f.lt.epilogue = u == 1 && f.lt.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      if (u == 2) f.lt.bias = nullptr;
      f.lt.aux = nullptr;
    }
    const TensorView& b = call.in("bias");
    const size_t copies = f.x_bytes + f.w_bytes;
    char* ws = static_cast<char*>(l.workspace(gemm::kLtWorkspaceBytes + copies));
    if (f.bias_column) {
      point_at_copies(f, ws + gemm::kLtWorkspaceBytes);
      const int64_t m = call.problem.dim("m"), n = call.problem.dim("n");
      AugmentParams a;
      a.x = {const_cast<void*>(f.lt.b), call.in("x").data, nullptr, f.x_rows, m, f.xv.batch_stride, f.xv.row_stride,
             f.xv.col_stride};
      a.w = {const_cast<void*>(f.lt.a), call.in("weight").data, b.data, f.w_rows, n, f.wv.batch_stride,
             f.wv.row_stride, f.wv.col_stride};
      a.k = call.problem.dim("k");
      a.kp = f.kp;
      void* args[] = {&a};
      l.launch(0, {grid_for(l, (f.x_rows + f.w_rows) * f.kp)}, {kBiasActThreads}, 0, args);
    }
    if (f.fill_bias) {
      for_each_y_block(call, [&](void* yp, void*, long long rows, long long cols, long long stride) {
        GemmEpilogueParams prm = y_block_params(yp, b.data, nullptr, rows, cols, stride);
        void* args[] = {&prm};
        l.launch(0, {grid_for(l, rows * cols)}, {kBiasActThreads}, 0, args);
      });
    }
    gemm::lt_matmul(f.lt, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
    if (!u) return;
    for_each_y_block(call, [&](void* yp, void* ap, long long rows, long long cols, long long stride) {
      GemmEpilogueParams prm = y_block_params(yp, b.data, ap, rows, cols, stride);
      void* args[] = {&prm};
      l.launch(f.fill_bias || f.bias_column ? 1 : 0, {grid_for(l, rows * cols)}, {kBiasActThreads}, 0, args);
    });
  };
  op.reference = fwd_reference;
  op.cases = fwd_cases();
  op.dtypes = kFloatTypes;
  return op;
}

// ---- backward ----

struct BwdPlan {
  gemm::LtCall dx, dw;
  std::vector<gemm::LtCall> dw_per_batch;  // batches that cannot fold into one reduction: accumulated
  bool needs_act_grad = false;
  int64_t rows = 0, cols = 0, dy_row_stride = 0;
  gemm::MatrixView dpre_rows;        // dpre as one [batch*m, n] matrix (when dbias is asked for)
  const void* dpre_data = nullptr;
  bool dbias_by_ones = false;        // dbias = ones·dpre (the dW GEMM cannot carry the BGRADB epilogue)
};

// Where plans are built only to read their layouts (tuning candidates, explain): dpre's address stands in
// for the workspace's (256-byte aligned, as the real one is); nothing is read or written through it.
void* const kDpreStandIn = reinterpret_cast<void*>(uintptr_t(1) << 20);

// dpre is dy itself without an activation, else the act-grad kernel's contiguous output (workspace).
BwdPlan plan_bwd(const Call& call, void* dpre) {
  const std::string& op = call.problem.op->info.name;
  const TensorView &dy = call.in("dy"), &x = call.in("x"), &w = call.in("weight"), &saved = call.in("saved");
  const TensorView &dx = call.out("dx"), &dw = call.out("dweight"), &db = call.out("dbias");
  int act = act_code(call.problem);
  int64_t batch = std::max<int64_t>(call.problem.dim("batch"), 1), m = call.problem.dim("m"),
          n = call.problem.dim("n");
  BwdPlan f;
  gemm::MatrixView dyv = matrix_of(dy, op, "dy"), xv = matrix_of(x, op, "x"), wv = matrix_of(w, op, "weight");
  gemm::MatrixView dxv = matrix_of(dx, op, "dx"), dwv = matrix_of(dw, op, "dweight");
  bool shared = weight_broadcast(x, w, op);
  if (shared) wv.batch_stride = dwv.batch_stride = 0;
  KSPEC_CHECK(act == 0 || saved.defined(), op, ": act='", kActs[act], "' needs input 'saved' (gelu: the forward's "
              "aux; relu: the forward's aux or y)");
  gemm::MatrixView pv = dyv;
  const void* pdata = dy.data;
  if (act != 0) {
    f.needs_act_grad = true;
    f.rows = batch * m;
    f.cols = n;
    KSPEC_CHECK(dyv.col_stride == 1 || n == 1, op, ": 'dy' ", dy.describe(), ": needs unit stride along n with an "
                "activation");
    KSPEC_CHECK(batch == 1 || m == 1 || dyv.batch_stride == m * dyv.row_stride, op, ": 'dy' ", dy.describe(),
                ": its rows must lie at one row stride with an activation (make it contiguous)");
    f.dy_row_stride = m == 1 && batch > 1 ? dyv.batch_stride : dyv.row_stride;
    pv = {m, n, n, 1, m * n};
    pdata = dpre;
  }
  DType dt = dy.dtype;
  bool tf32 = call.problem.param_bool("tf32");
  // dx = dpre·W
  f.dx.g = gemm::map_row_major(dxv, pv, wv, batch, "dx", "dy", "weight");
  f.dx.ab_dtype = f.dx.d_dtype = dt;
  f.dx.tf32 = tf32;
  f.dx.a = w.data;
  f.dx.b = pdata;
  f.dx.d = dx.data;
  // dW = dpreᵀ·x, summed over the batches that share the weight
  gemm::MatrixView pt = gemm::transposed(pv), xq = xv;
  gemm::LtCall base;
  base.ab_dtype = base.d_dtype = dt;
  base.tf32 = tf32;
  base.a = x.data;
  base.b = pdata;
  base.d = dw.data;
  if (!shared) {
    f.dw = base;
    f.dw.g = gemm::map_row_major(dwv, pt, xq, batch, "dweight", "dy", "x");
  } else if (gemm::fold_batch_into_k(pt, xq, batch)) {
    f.dw = base;
    f.dw.g = gemm::map_row_major(dwv, pt, xq, 1, "dweight", "dy", "x");
  } else {
    size_t esize = dtype_size(dt);
    for (int64_t b = 0; b < batch; ++b) {
      gemm::LtCall c = base;
      gemm::MatrixView pb = pt, xb = xv;
      pb.batch_stride = xb.batch_stride = 0;
      c.g = gemm::map_row_major(dwv, pb, xb, 1, "dweight", "dy", "x");
      c.a = static_cast<const char*>(x.data) + b * xv.batch_stride * esize;
      c.b = static_cast<const char*>(pdata) + b * pv.batch_stride * esize;
      c.beta = b == 0 ? 0.f : 1.f;
      f.dw_per_batch.push_back(c);
    }
  }
  if (db.defined()) {
    f.dpre_data = pdata;
    if (f.dw_per_batch.empty() && f.dw.g.batch == 1) {
      f.dw.epilogue = CUBLASLT_EPILOGUE_BGRADB;  // Σ over the dW GEMM's k (= the rows of dpre) of B = dpre
      f.dw.bias = db.data;
      f.dpre_rows = shared ? gemm::transposed(pt) : pv;  // folded (shared) or a single batch
    } else {
      // The dW GEMM is batched or split: dbias = ones·dpre over all rows, which must lie end to end.
      KSPEC_CHECK_AS(batch == 1 || m == 1 || pv.batch_stride == m * pv.row_stride, Unsupported, op,
                     ": dbias needs dy's batches end to end (make dy contiguous)");
      f.dpre_rows = {batch * m, n, m == 1 && batch > 1 ? pv.batch_stride : pv.row_stride, pv.col_stride, 0};
      f.dbias_by_ones = true;
    }
  }
  return f;
}

// dbias = ones[1, rows] · dpre[rows, n] (`ones`: workspace room for rows elements).
void lt_bias_grad(const Call& call, const BwdPlan& f, void* ones, void* ws) {
  DType dt = call.problem.dtype("dy");
  int64_t rows = f.dpre_rows.rows, n = f.dpre_rows.cols;
  unsigned pattern = dt == DType::f32 ? 0x3f800000u : dt == DType::bf16 ? 0x3f803f80u : 0x3c003c00u;
  size_t words = dt == DType::f32 ? rows : (rows + 1) / 2;
  CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(ones), pattern, words, reinterpret_cast<CUstream>(call.stream)));
  gemm::LtCall c;
  gemm::MatrixView dbv{1, n, n, 1, 0}, onesv{1, rows, rows, 1, 0};
  c.g = gemm::map_row_major(dbv, onesv, f.dpre_rows, 1, "dbias", "ones", "dy");
  c.ab_dtype = c.d_dtype = dt;
  c.a = f.dpre_data;
  c.b = ones;
  c.d = call.out("dbias").data;
  gemm::lt_matmul(c, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
}

std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  int64_t batch = p.dim("batch"), wbatch = p.dim("wbatch"), m = p.dim("m"), n = p.dim("n"), k = p.dim("k");
  std::vector<double> none;
  auto r = ref::gemm_bwd_ref(in[0].data, in[1].data, in[2].data, in[3].defined ? in[3].data : none, batch, wbatch, m,
                             n, k, act_code(p));
  std::vector<HostTensor> out(3);
  out[0] = {true, in[1].shape, std::move(r.dx)};
  out[1] = {true, in[2].shape, std::move(r.dw)};
  if (p.present("dbias")) out[2] = {true, {n}, std::move(r.db)};
  return out;
}

std::vector<Case> bwd_cases() {
  std::vector<Case> c = {
      gemm_case("base", 1, 1, 33, 33, 33, "none", {"saved"}),
      gemm_case("m_1", 1, 1, 1, 7, 33, "none", {"saved"}),
      gemm_case("n_1", 1, 1, 7, 1, 33, "relu", {}),
      gemm_case("k_1", 1, 1, 33, 7, 1, "gelu", {}),
      gemm_case("k_4097", 1, 1, 7, 33, 4097, "gelu", {}),
      gemm_case("m_4097", 1, 1, 4097, 7, 33, "relu", {}),
      gemm_case("n_4097", 1, 1, 33, 4097, 7, "none", {"saved"}),
      gemm_case("batched", 3, 3, 7, 33, 33, "gelu", {}),
      gemm_case("batched_shared_weight", 4, 1, 7, 33, 33, "gelu", {}),
      gemm_case("large_1024", 1, 1, 256, 1024, 1024, "gelu", {}),
  };
  c.back().large = true;
  return c;
}

// The saved pre-activation must be the forward's for x and W (the reference recomputes it). The checker
// then rounds it to the dtype and the reference takes act' at those rounded values, the very ones the
// kernel reads: ReLU's mask agrees even where pre is within rounding of 0 (where a mask taken from the
// exact pre-activation could flip one element and so a whole row of dx).
void bwd_prepare(const Problem& p, std::vector<HostTensor>& in) {
  if (!in[3].defined) return;
  int64_t batch = p.dim("batch"), wbatch = p.dim("wbatch"), m = p.dim("m"), n = p.dim("n"), k = p.dim("k");
  in[3].data = ref::gemm_fwd_ref(in[1].data, in[2].data, nullptr, batch, wbatch, m, n, k, act_code(p)).pre;
}

OpDef make_bwd() {
  OpDef op;
  OpInfo& i = op.info;
  i.name = "gemm.bwd";
  i.family = "gemm";
  i.doc = "gradients of gemm: dx = dpre·W, dW = dpreᵀ·x, dbias = Σ dpre with dpre = dy * act'(pre)";
  i.inputs = {
      {"dy", {"...batch", "m", "n"}, kFloatTypes, "", false, false, "", Layout::Strided, "gradient of y"},
      {"x", {"...batch", "m", "k"}, {}, "dy", false, false, "", Layout::Strided, "the forward's input"},
      {"weight", {"...wbatch", "n", "k"}, {}, "dy", false, false, "", Layout::Strided, "the forward's weight"},
      {"saved", {"...batch", "m", "n"}, {}, "dy", false, true, "", Layout::Contiguous,
       "act=gelu: the forward's aux; act=relu: its aux or y; act=none: absent"},
  };
  i.outputs = {
      {"dx", {"...batch", "m", "k"}, {}, "dy", false, false, "", Layout::Strided, "gradient of x"},
      {"dweight", {"...wbatch", "n", "k"}, {}, "dy", false, false, "", Layout::Strided, "gradient of weight"},
      {"dbias", {"n"}, {}, "dy", false, true, "", Layout::Contiguous, "optional: gradient of bias"},
  };
  i.params = gemm_params();
  i.dims = gemm_dims();
  i.reference = "api/ops/gemm/reference.cpp (python/kspec/reference/gemm.py)";
  op.kernels = [](const Problem& p, const Config&) {
    std::vector<jit::KernelSpec> out;
    if (act_code(p) == 0) return out;
    out.push_back(kernel_spec(p, "gemm/gemm_act_grad.cuh", "kspec::gemm_act_grad_kernel",
                              {dtype_cuda_type(p.dtype("dy")), std::to_string(act_code(p)),
                               std::to_string(kActGradThreads)}));
    return out;
  };
  op.check_call = [](const Call& call) { plan_bwd(call, nullptr); };
  op.tuning.heuristic = [](const Problem&) { return Config{}; };
  op.tuning.valid = [](const Problem&, const Config& c, std::string* why) {
    return valid_algo_config(c, {"dx.", "dw."}, why);
  };
  // dx's candidates with dW on the heuristic's algorithm, dW's with dx's; refine puts the two winners together.
  op.tuning.candidates = [](const Call& call, int n) {
    BwdPlan f = plan_bwd(call, kDpreStandIn);
    std::vector<Config> out = candidate_configs(f.dx, call.device, n, "dx.");
    if (f.dw_per_batch.empty() && !f.dbias_by_ones) {
      for (auto& c : candidate_configs(f.dw, call.device, n, "dw.")) out.push_back(std::move(c));
    }
    return out;
  };
  op.tuning.refine = [](const Problem&, const std::vector<TuneCandidate>& timed) {
    const TuneCandidate *dx = nullptr, *dw = nullptr, *def = nullptr;
    for (const auto& c : timed) {
      if (c.status != "ok") continue;
      if (c.is_default) def = &c;
      bool is_dx = !c.config.values.empty() && c.config.values[0].first.rfind("dx.", 0) == 0;
      bool is_dw = !c.config.values.empty() && c.config.values[0].first.rfind("dw.", 0) == 0;
      if (is_dx && (!dx || c.median_ms < dx->median_ms)) dx = &c;
      if (is_dw && (!dw || c.median_ms < dw->median_ms)) dw = &c;
    }
    std::vector<Config> out;
    if (!def || !dx || !dw || dx->median_ms >= def->median_ms || dw->median_ms >= def->median_ms) return out;
    Config both = dx->config;
    for (const auto& v : dw->config.values) both.values.push_back(v);
    out.push_back(std::move(both));
    return out;
  };
  op.tuning.applies = [](const Call& call, const Config& c) {
    BwdPlan f = plan_bwd(call, kDpreStandIn);
    std::string why = algo_applies(f.dx, c, "dx.", call.device);
    if (why.empty() && f.dw_per_batch.empty() && !f.dbias_by_ones) why = algo_applies(f.dw, c, "dw.", call.device);
    return why;
  };
  i.tuning_note = kTuningNote + " (dx and dW each)";
  op.launch = [](const Call& call, const Config& config, Launcher& l) {
    const Problem& p = call.problem;
    int64_t rows = std::max<int64_t>(p.dim("batch"), 1) * p.dim("m"), n = p.dim("n");
    // One workspace request (a larger one would move it): cuBLASLt's, then dpre, then ones for dbias.
    size_t esize = dtype_size(p.dtype("dy"));
    auto round_up = [](size_t b) { return (b + 255) / 256 * 256; };
    size_t dpre_bytes = act_code(p) == 0 ? 0 : static_cast<size_t>(rows * n) * esize;
    size_t dpre_offset = round_up(gemm::kLtWorkspaceBytes), ones_offset = dpre_offset + round_up(dpre_bytes);
    size_t ones_bytes = p.present("dbias") ? static_cast<size_t>(rows + 2) * esize : 0;
    char* ws = static_cast<char*>(l.workspace(ones_offset + ones_bytes));
    void* dpre = dpre_bytes ? ws + dpre_offset : nullptr;
    BwdPlan f = plan_bwd(call, dpre);
    gemm::LtAlgoConfig dx_algo, dw_algo;
    f.dx.algo = algo_of(config, "dx.", &dx_algo);
    f.dw.algo = algo_of(config, "dw.", &dw_algo);
    for (auto& c : f.dw_per_batch) c.algo = f.dw.algo;
    if (f.needs_act_grad && rows * n > 0) {
      GemmEpilogueParams prm{};
      prm.dy = call.in("dy").data;
      prm.saved = call.in("saved").data;
      prm.dpre = dpre;
      prm.rows = f.rows;
      prm.cols = f.cols;
      prm.dy_row_stride = f.dy_row_stride;
      void* args[] = {&prm};
      int64_t blocks = std::min<int64_t>((rows * n + kActGradThreads - 1) / kActGradThreads,
                                         int64_t(l.multiprocessors()) * 16);
      l.launch(0, {static_cast<unsigned>(blocks)}, {kActGradThreads}, 0, args);
    }
    gemm::lt_matmul(f.dx, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
    if (f.dw_per_batch.empty() && !f.dbias_by_ones) {
      try {
        gemm::lt_matmul(f.dw, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
      } catch (const Unsupported&) {
        // No BGRADB algorithm for this layout: dW plainly, then dbias = ones[1, rows] · dpre[rows, n].
        if (!f.dw.bias) throw;
        gemm::LtCall plain = f.dw;
        plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
        plain.algo = nullptr;  // a tuned algorithm was for the BGRADB epilogue
        plain.bias = nullptr;
        gemm::lt_matmul(plain, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
        lt_bias_grad(call, f, ws + ones_offset, ws);
      }
    } else if (f.dw_per_batch.empty()) {
      gemm::lt_matmul(f.dw, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
    } else {
      for (const auto& c : f.dw_per_batch) gemm::lt_matmul(c, call.device, call.stream, ws, gemm::kLtWorkspaceBytes);
    }
    if (f.dbias_by_ones) lt_bias_grad(call, f, ws + ones_offset, ws);
  };
  op.reference = bwd_reference;
  op.prepare_inputs = bwd_prepare;
  // The tuner's saved pre-activation stays random: recomputing the forward in float64 on the host takes
  // minutes at 16384x4096x4096, and every candidate is compared with the default on the same inputs.
  op.prepare_for_timing = false;
  op.cases = bwd_cases();
  op.dtypes = kFloatTypes;
  return op;
}

}  // namespace

void register_gemm(Registry& r) {
  r.add(make_fwd());
  r.add(make_bwd());
}

}  // namespace kspec
