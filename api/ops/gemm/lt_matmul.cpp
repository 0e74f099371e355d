// cuBLASLt matmul: the descriptors and the heuristic's (or a tuned and checked) algorithm built once per
// problem and thread, so that a repeated call only sets its pointers and launches; the heuristic's top
// candidates for the tuner.
#include "gemm/lt_matmul.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "jit/base/log.h"
#include "jit/cublaslt.h"
#include "jit/handles.h"

namespace kspec::gemm {
namespace {

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: throw Unsupported(detail::concat("gemm: dtype ", dtype_name(t), " is not supported"));
  }
}

// An operand's layout, batched when batch > 1.
jit::LtMatrixLayout layout(cudaDataType_t t, const LtOperand& o, int64_t batch) {
  jit::LtMatrixLayout l = jit::create_matrix_layout(t, static_cast<uint64_t>(o.stored_rows),
                                                    static_cast<uint64_t>(o.stored_cols), o.ld);
  if (batch > 1) {
    jit::set_attribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(batch));
    jit::set_attribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, o.batch_stride);
  }
  return l;
}

int align_of(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && a % al) al /= 2;
  return p ? al : 0;
}

std::string algo_key(const LtCall& c, int device, size_t ws) {
  return detail::concat(describe(c.g), "|", dtype_short(c.ab_dtype), dtype_short(c.d_dtype), c.tf32 ? "t" : "",
                        "|e", static_cast<int>(c.epilogue), "|b", c.beta != 0.f, "|al", align_of(c.a), ",",
                        align_of(c.b), ",", align_of(c.d), ",", align_of(c.bias), ",", align_of(c.aux), "|ld",
                        c.aux_ld, ",", c.aux_batch_stride, "|d", device, "|w", ws);
}

// The descriptors of one problem (a few µs of host time to build: 4 creations and 6-10 attributes).
struct Descriptors {
  cublasComputeType_t compute;
  cudaDataType_t tab, td;
  jit::LtMatmulDesc desc;
  jit::LtMatrixLayout la, lb, ld;
  explicit Descriptors(const LtCall& c)
      : compute(c.ab_dtype == DType::f32 && c.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F),
        tab(lt_type(c.ab_dtype)),
        td(lt_type(c.d_dtype)),
        desc(jit::create_matmul_desc(compute, CUDA_R_32F)),
        la(layout(tab, c.g.a, c.g.batch)),
        lb(layout(tab, c.g.b, c.g.batch)),
        ld(layout(td, c.g.d, c.g.batch)) {
    const LtGemm& g = c.g;
    cublasOperation_t ta = g.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
    jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
    jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
    if (c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, c.epilogue);
    if (c.bias) jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
    if (c.aux) {
      jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, c.aux);
      jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, c.aux_ld);
      if (g.batch > 1) jit::set_attribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, c.aux_batch_stride);
    }
  }
};

// The heuristic's first `count` results. NOT_SUPPORTED (seen on the H100 for the BGRADB epilogue with one
// row, m = 1 or n = 1) means the same as finding nothing.
std::vector<cublasLtMatmulHeuristicResult_t> heuristic(Descriptors& d, cublasLtHandle_t handle, size_t ws,
                                                       int count) {
  jit::LtMatmulPreference pref = jit::create_matmul_preference();
  jit::set_attribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(ws));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int found = 0;
  cublasStatus_t st = jit::cublaslt().cublasLtMatmulAlgoGetHeuristic(
      handle, d.desc.get(), d.la.get(), d.lb.get(), d.ld.get(), d.ld.get(), pref.get(), count,
      results.data(), &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) found = 0;
  else if (st != CUBLAS_STATUS_SUCCESS)
    jit::throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  results.resize(static_cast<size_t>(std::max(found, 0)));
  results.erase(std::remove_if(results.begin(), results.end(),
                               [](const auto& r) { return r.state != CUBLAS_STATUS_SUCCESS; }),
                results.end());
  return results;
}

template <typename T>
bool get_attr(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr, int64_t* out) {
  T v{};
  size_t written = 0;
  if (jit::cublaslt().cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS)
    return false;
  *out = static_cast<int64_t>(v);
  return true;
}

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr, int64_t value) {
  T v = static_cast<T>(value);
  return jit::cublaslt().cublasLtMatmulAlgoConfigSetAttribute(&a, attr, &v, sizeof(v));
}

LtAlgoConfig config_of(const cublasLtMatmulAlgo_t& a) {
  LtAlgoConfig c;
  get_attr<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID, &c.algo);
  get_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile);
  get_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages);
  get_attr<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk);
  get_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction);
  get_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swizzle);
  get_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c.custom);
  get_attr<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c.inner);
  get_attr<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c.cluster);
  return c;
}

std::string config_text(const LtAlgoConfig& a) {
  Config c;
  add_to_config(a, "", c);
  return c.str();
}

// cublasLtMatmulAlgoInit for the call's types, then each attribute; then cublasLtMatmulAlgoCheck on the
// call's descriptors. False with `why` when any step refuses.
bool build_algo(Descriptors& d, cublasLtHandle_t handle, const LtAlgoConfig& c, size_t ws, cublasLtMatmulAlgo_t* out,
                std::string* why) {
  const auto& lt = jit::cublaslt();
  cublasLtMatmulAlgo_t a{};
  auto failed = [&](const char* what, cublasStatus_t st) {
    *why = detail::concat(what, ": ", lt.cublasLtGetStatusName(st));
    return false;
  };
  cublasStatus_t st = lt.cublasLtMatmulAlgoInit(handle, d.compute, CUDA_R_32F, d.tab, d.tab, d.td, d.td,
                                                static_cast<int>(c.algo), &a);
  if (st != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulAlgoInit", st);
  struct {
    cublasStatus_t st;
    const char* name;
  } sets[] = {
      {set_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID, c.tile), "tile"},
      {set_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, c.stages), "stages"},
      {set_attr<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, c.splitk), "splitk"},
      {set_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, c.reduction), "reduction"},
      {set_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, c.swizzle), "swizzle"},
      {set_attr<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, c.custom), "custom"},
      {set_attr<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, c.inner), "inner"},
      {set_attr<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, c.cluster), "cluster"},
  };
  for (const auto& s : sets)
    if (s.st != CUBLAS_STATUS_SUCCESS) return failed(detail::concat("setting ", s.name).c_str(), s.st);
  cublasLtMatmulHeuristicResult_t res{};
  st = lt.cublasLtMatmulAlgoCheck(handle, d.desc.get(), d.la.get(), d.lb.get(), d.ld.get(), d.ld.get(), &a,
                                  &res);
  if (st != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulAlgoCheck", st);
  if (res.workspaceSize > ws) {
    *why = detail::concat("needs ", res.workspaceSize, " bytes of workspace, kspec has ", ws);
    return false;
  }
  *out = a;
  return true;
}

struct Range {
  const char* name;
  int64_t LtAlgoConfig::*field;
  int64_t lo, hi;
};

const std::vector<Range>& ranges() {
  static const std::vector<Range> r = {
      {"algo", &LtAlgoConfig::algo, 0, INT32_MAX},          {"tile", &LtAlgoConfig::tile, 0, UINT32_MAX},
      {"stages", &LtAlgoConfig::stages, 0, UINT32_MAX},     {"splitk", &LtAlgoConfig::splitk, 1, INT32_MAX},
      {"reduction", &LtAlgoConfig::reduction, 0, UINT32_MAX}, {"swizzle", &LtAlgoConfig::swizzle, 0, 1},
      {"custom", &LtAlgoConfig::custom, 0, UINT32_MAX},     {"inner", &LtAlgoConfig::inner, 0, UINT16_MAX},
      {"cluster", &LtAlgoConfig::cluster, 0, UINT16_MAX},
  };
  return r;
}

}  // namespace

const std::vector<std::string>& lt_algo_fields() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& r : ranges()) n.push_back(r.name);
    return n;
  }();
  return names;
}

void add_to_config(const LtAlgoConfig& a, const std::string& prefix, Config& out) {
  for (const auto& r : ranges()) out.values.emplace_back(prefix + r.name, a.*r.field);
}

bool algo_from_config(const Config& c, const std::string& prefix, LtAlgoConfig* out, bool* found, std::string* why) {
  LtAlgoConfig a;
  int have = 0;
  std::string missing;
  for (const auto& r : ranges()) {
    std::string name = prefix + r.name;
    if (!c.has(name)) {
      missing += (missing.empty() ? "" : ", ") + name;
      continue;
    }
    ++have;
    int64_t v = c.get(name);
    if (v < r.lo || v > r.hi) {
      *why = detail::concat(name, "=", v, " is outside [", r.lo, ", ", r.hi, "]");
      return false;
    }
    a.*r.field = v;
  }
  *found = have > 0;
  if (have > 0 && !missing.empty()) {
    *why = detail::concat("a cuBLASLt algorithm needs every field; missing ", missing);
    return false;
  }
  if (have > 0) *out = a;
  return true;
}

namespace {

// The heuristic's first algorithm whose split-K leaves each split at least 64 of K (else its first): for
// a tiny K its top choice split K = 7 twelve ways and more (H100 bf16 33x4097x7: 0.0069 ms, the same
// kernel unsplit 0.0041; kspec tune gemm, 2026-11-27).
constexpr int kHeuristicLookahead = 8;
constexpr int64_t kMinSplitDepth = 64;

// The algorithm for a problem's descriptors: a tuned one where cuBLASLt accepts it, else the heuristic's.
// Chosen once per problem for the process (not per thread), so that every thread runs the same algorithm
// and gets the same bits.
cublasLtMatmulAlgo_t choose_algo(Descriptors& d, cublasLtHandle_t handle, const LtCall& c, int device,
                                 size_t workspace_bytes) {
  const LtGemm& g = c.g;
  static std::mutex mu;
  static std::map<std::string, cublasLtMatmulAlgo_t> algos;
  std::string key = algo_key(c, device, workspace_bytes);
  if (c.algo) key += "|cfg:" + config_text(*c.algo);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = algos.find(key);
    if (it != algos.end()) return it->second;
  }
  cublasLtMatmulAlgo_t algo;
  std::string why;
  if (c.algo && build_algo(d, handle, *c.algo, workspace_bytes, &algo, &why)) {
    std::lock_guard<std::mutex> lock(mu);
    return algos.emplace(key, algo).first->second;
  }
  if (c.algo) {
    jit::warn_once("gemm-algo:" + key, "gemm: the tuned cuBLASLt algorithm {" + config_text(*c.algo) +
                                           "} does not apply to " + describe(g) + " (" + why +
                                           "); using cuBLASLt's heuristic (retune with kspec tune gemm)");
  }
  auto found = heuristic(d, handle, workspace_bytes, kHeuristicLookahead);
  KSPEC_CHECK_AS(!found.empty(), Unsupported, "gemm: cuBLASLt has no algorithm for ", describe(g), " (",
                 dtype_name(c.ab_dtype), " -> ", dtype_name(c.d_dtype), ", epilogue ", static_cast<int>(c.epilogue),
                 ")");
  algo = found[0].algo;
  for (const auto& r : found) {
    if (config_of(r.algo).splitk <= std::max<int64_t>(1, g.k / kMinSplitDepth)) {
      algo = r.algo;
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  return algos.emplace(key, algo).first->second;
}

// What a call's descriptors and algorithm depend on: everything of an LtCall but its data pointers, which
// enter as their alignment (0: absent), with the device, the workspace size and the tuned algorithm.
using PlanKey = std::array<int64_t, 43>;

PlanKey plan_key(const LtCall& c, int device, size_t ws) {
  const LtGemm& g = c.g;
  uint32_t beta_bits;
  std::memcpy(&beta_bits, &c.beta, sizeof(beta_bits));
  const LtAlgoConfig none, &t = c.algo ? *c.algo : none;
  return {g.m, g.n, g.k, g.batch,
          g.a.stored_rows, g.a.stored_cols, g.a.ld, g.a.batch_stride, g.a.transpose,
          g.b.stored_rows, g.b.stored_cols, g.b.ld, g.b.batch_stride, g.b.transpose,
          g.d.stored_rows, g.d.stored_cols, g.d.ld, g.d.batch_stride, g.d.transpose,
          static_cast<int64_t>(c.ab_dtype), static_cast<int64_t>(c.d_dtype), c.tf32, c.epilogue, beta_bits,
          align_of(c.a), align_of(c.b), align_of(c.d), align_of(c.bias), align_of(c.aux),
          c.aux_ld, c.aux_batch_stride, device, static_cast<int64_t>(ws),
          c.algo != nullptr, t.algo, t.tile, t.stages, t.splitk, t.reduction, t.swizzle, t.custom, t.inner, t.cluster};
}

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 0x100000001b3ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

// A problem's descriptors and algorithm, with the bias and aux pointers its descriptor holds now.
struct Plan {
  Descriptors d;
  cublasLtHandle_t handle;
  cublasLtMatmulAlgo_t algo;
  const void* bias;
  void* aux;
  Plan(const LtCall& c, int device, size_t ws)
      : d(c), handle(jit::cublaslt_handle(device)), algo(choose_algo(d, handle, c, device, ws)), bias(c.bias),
        aux(c.aux) {}
};

// Per thread: a call rewrites its plan's pointer attributes, so a descriptor is never shared between
// threads. A training step's few dozen GEMMs stay far below the cap, which only bounds a loop over ever
// new shapes (then the thread starts over).
constexpr size_t kMaxPlansPerThread = 1024;

Plan& plan_for(const LtCall& c, int device, size_t ws) {
  thread_local std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans;
  const PlanKey key = plan_key(c, device, ws);
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>(c, device, ws);
  if (plans.size() >= kMaxPlansPerThread) plans.clear();
  return *plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

void lt_matmul(const LtCall& c, int device, Stream stream, void* workspace, size_t workspace_bytes) {
  const LtGemm& g = c.g;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  KSPEC_CHECK_AS(g.k > 0, Unsupported, "gemm: the reduction dim k is 0");
  Plan& p = plan_for(c, device, workspace_bytes);
  // The pointers live in the descriptor: a repeated problem with new ones (a fresh output) sets them.
  if (p.bias != c.bias) {
    jit::set_attribute(p.d.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
    p.bias = c.bias;
  }
  if (p.aux != c.aux) {
    jit::set_attribute(p.d.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, c.aux);
    p.aux = c.aux;
  }
  float alpha = 1.f, beta = c.beta;
  CUBLAS_CHECK(cublasLtMatmul(p.handle, p.d.desc.get(), &alpha, c.a, p.d.la.get(), c.b, p.d.lb.get(), &beta, c.d,
                              p.d.ld.get(), c.d, p.d.ld.get(), &p.algo, workspace, workspace_bytes,
                              reinterpret_cast<cudaStream_t>(stream)));
}

std::vector<LtCandidate> lt_candidates(const LtCall& c, int device, size_t workspace_bytes, int max_count) {
  std::vector<LtCandidate> out;
  if (c.g.m == 0 || c.g.n == 0 || c.g.batch == 0 || c.g.k == 0 || max_count <= 0) return out;
  Descriptors d(c);
  for (const auto& r : heuristic(d, jit::cublaslt_handle(device), workspace_bytes, max_count))
    out.push_back({config_of(r.algo), r.workspaceSize, r.wavesCount});
  return out;
}

bool lt_algo_applies(const LtCall& c, const LtAlgoConfig& a, int device, size_t workspace_bytes, std::string* why) {
  Descriptors d(c);
  cublasLtMatmulAlgo_t algo;
  return build_algo(d, jit::cublaslt_handle(device), a, workspace_bytes, &algo, why);
}

}  // namespace kspec::gemm
