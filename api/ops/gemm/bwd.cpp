// gemm.bwd: dx, dW, dbias through cuBLASLt, with one NVRTC elementwise kernel for act'(pre) when there is
// an activation; dW summed over batches that share the weight; cases and reference.
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
#include "gemm/gemm_op.h"

namespace kspec::gemm_op {
namespace {

constexpr unsigned kActGradThreads = 256;

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

}  // namespace

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
       "act=gelu_tanh: the forward's aux; act=relu: its aux or y; act=none: absent"},
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


}  // namespace kspec::gemm_op
