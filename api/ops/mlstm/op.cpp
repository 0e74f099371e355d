// mlstm: xLSTM's matrix-memory cell (issue 29). mlstm.step (one decoding step, states in place),
// mlstm.chunkwise.fwd (a sequence chunk by chunk, optional initial and last states, the per-step
// normalizer and max for the backward) and .bwd (n, m constants; dC_last reaches df), mlstm.parallel.fwd
// and .bwd (no states). The OpDefs: kernels, launchers and float64 references (api/ops/mlstm/reference.h);
// the schema, tuning spaces and case tables they share in schema.cpp. Kernels in templates/mlstm/
// (step.cuh, chunkwise_fwd.cuh, chunkwise_bwd.cuh), their one argument templates/mlstm/params.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/spec.h"
#include "mlstm/reference.h"
#include "mlstm/schema.h"
#include "templates/mlstm/params.h"

namespace kspec {
namespace mlstm {
namespace {

// The kernel argument with q, k, v, i, f set: every op's first five inputs.
MlstmParams qkvif_args(const Call& call) {
  MlstmParams a{};
  a.q = call.in("q").data;
  a.k = call.in("k").data;
  a.v = call.in("v").data;
  a.i = call.in("i").data;
  a.f = call.in("f").data;
  return a;
}

// The norm df's error is measured against (OpDef::error_scale): df_t = sigmoid(-f_t) (<dC_last, C_last> +
// sum_{r >= t} (q_r . dq_r - k_r . dk_r)) is a difference of nearly equal sums (at S = 1 without states
// q.dq = k.dk exactly, so df is 0 however large the terms), and bf16 inputs put an error of their rounding
// times the terms' size into it. The terms' size: sigmoid(-f_t) sum_{r >= t} (|q_r . dq_r| + |k_r . dk_r|),
// from the rounded inputs and the float64 reference's dq, dk. Only df gets one.
std::vector<double> df_error_scale(const Problem& p, const std::vector<HostTensor>& in,
                                   const std::vector<HostTensor>& ref) {
  const int64_t rows = p.dim("batch") * p.dim("heads"), S = p.dim("seqlen"), DK = p.dim("dhqk");
  const auto &q = in[0].data, &k = in[1].data, &f = in[4].data, &dq = ref[0].data, &dk = ref[1].data;
  double sum_sq = 0;
  for (int64_t row = 0; row < rows; ++row) {
    double tail = 0;  // sum over r >= t
    for (int64_t t = S - 1; t >= 0; --t) {
      const size_t base = static_cast<size_t>((row * S + t) * DK);
      double qdq = 0, kdk = 0;
      for (int64_t d = 0; d < DK; ++d) qdq += q[base + d] * dq[base + d], kdk += k[base + d] * dk[base + d];
      tail += std::abs(qdq) + std::abs(kdk);
      const double term = tail / (1.0 + std::exp(f[static_cast<size_t>(row * S + t)]));
      sum_sq += term * term;
    }
  }
  std::vector<double> scale(ref.size(), 0.0);
  scale[4] = std::sqrt(sum_sq);
  return scale;
}

// ---- mlstm.step ----

OpDef make_step() {
  OpDef op = mlstm_base("mlstm.step",
                        "one decoding step: m' = max(logsigmoid(f) + m, i), C' = e^(a+m-m') C + e^(i-m') k v^T, "
                        "n' alike, h = (s q)^T C' / (max(|s q.n'|, e^-m') + eps); C', n', m' may be C, n, m (in place)",
                        false);
  op.info.params = {eps_param()};
  op.info.inputs = qkvif({"batch", "heads"}, kM);
  op.info.inputs.push_back(tensor_def("C", kC, {DType::f32}, "", false, false, "", Layout::Contiguous, "memory"));
  op.info.inputs.push_back(tensor_def("n", kN, {DType::f32}, "", false, false, "", Layout::Contiguous, "normalizer"));
  op.info.inputs.push_back(tensor_def("m", kM, {DType::f32}, "", false, false, "", Layout::Contiguous, "stabilizer"));
  op.info.outputs = {
      tensor_def("h", {"batch", "heads", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous, "output"),
      tensor_def("C_new", kC, {DType::f32}, "", false, false, "", Layout::Contiguous, "memory after the step (may be C)"),
      tensor_def("n_new", kN, {DType::f32}, "", false, false, "", Layout::Contiguous, "normalizer after (may be n)"),
      tensor_def("m_new", kM, {DType::f32}, "", false, false, "", Layout::Contiguous, "stabilizer after (may be m)"),
  };
  op.info.outputs[1].in_place_of = "C";
  op.info.outputs[2].in_place_of = "n";
  op.info.outputs[3].in_place_of = "m";
  op.cases = step_cases();
  op.tuning = step_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.info.tuning_names = {{"algo", {"block", "split", "head", "cluster"}}};
  op.derived_key = [](const Problem& p) { return "cols" + std::to_string(step_cols(p)); };
  // algo=block: mlstm_step_kernel; algo=head: mlstm_step_head_kernel; algo=split: kernel 0 the gates (n', m',
  // the scalars), kernel 1 the slabs; algo=cluster: mlstm_step_cluster_kernel.
  op.kernels = [](const Problem& p, const Config& c) {
    const std::string t = dtype_cuda_type(p.dtype("q")), dk = std::to_string(p.dim("dhqk")),
                      dv = std::to_string(p.dim("dhhv")), threads = std::to_string(c.get("threads"));
    if (c.get("algo") == kStepCluster)
      return std::vector<jit::KernelSpec>{
          kernel_spec(p, "mlstm/step_cluster.cuh", "kspec::mlstm_step_cluster_kernel",
                      {t, gate_type(p), dk, dv, std::to_string(c.get("cols")), threads})};
    if (c.get("algo") != kStepSplit)
      return std::vector<jit::KernelSpec>{
          kernel_spec(p, "mlstm/step.cuh", c.get("algo") == kStepBlock ? "kspec::mlstm_step_kernel"
                                                                       : "kspec::mlstm_step_head_kernel",
                      {t, gate_type(p), dk, dv, threads})};
    return std::vector<jit::KernelSpec>{
        kernel_spec(p, "mlstm/step.cuh", "kspec::mlstm_step_gates_kernel", {t, gate_type(p), dk}),
        kernel_spec(p, "mlstm/step.cuh", "kspec::mlstm_step_cols_kernel",
                    {t, dk, dv, std::to_string(c.get("cols")), threads})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    MlstmParams a = qkvif_args(call);
    a.C0 = static_cast<const float*>(call.in("C").data);
    a.n0 = static_cast<const float*>(call.in("n").data);
    a.m0 = static_cast<const float*>(call.in("m").data);
    a.h = call.out("h").data;
    a.C = static_cast<float*>(call.out("C_new").data);
    a.n = static_cast<float*>(call.out("n_new").data);
    a.m = static_cast<float*>(call.out("m_new").data);
    a.seqlen = 1;
    a.eps = static_cast<float>(p.param_float("eps"));
    const int64_t seqs = p.dim("batch") * p.dim("heads");
    if (seqs == 0) return;
    void* args[] = {&a};
    const unsigned slabs = u32(p.dim("dhhv") / c.get("cols"));
    if (c.get("algo") == kStepCluster)
      return l.launch_clusters(0, {u32(seqs), slabs}, {u32(c.get("threads"))}, {1, slabs, 1}, 0, args);
    if (c.get("algo") != kStepSplit) return l.launch(0, {u32(seqs)}, {u32(c.get("threads"))}, 0, args);
    a.gate_rows = static_cast<float*>(l.workspace(sizeof(float) * kMlstmStepScalars * static_cast<size_t>(seqs)));
    l.launch(0, {u32(seqs)}, {32}, 0, args);
    l.launch_dependent(1, {u32(seqs), slabs}, {u32(c.get("threads"))}, 0, args);
  };
  // The recurrence with S = 1 ([B, NH, 1, D] is [B, NH, D]).
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data, in[5].data, in[6].data, in[7].data};
    auto o = ref::mlstm_recurrent_fwd_ref(shape_of_problem(p, 1), r, p.param_float("eps"));
    return std::vector<HostTensor>{{true, in[2].shape, std::move(o.h)},
                                   {true, in[5].shape, std::move(o.C)},
                                   {true, in[6].shape, std::move(o.n)},
                                   {true, in[7].shape, std::move(o.m_last)}};
  };
  return op;
}

// ---- the forward kernel (mlstm.chunkwise.fwd, mlstm.parallel.fwd) ----

std::vector<jit::KernelSpec> fwd_kernels(const Problem& p, const Config& c, int64_t chunk) {
  return {kernel_spec(p, "mlstm/chunkwise_fwd.cuh", "kspec::mlstm_chunkwise_fwd_kernel",
                      {dtype_cuda_type(p.dtype("q")), gate_type(p), std::to_string(p.dim("dhqk")),
                       std::to_string(p.dim("dhhv")), std::to_string(chunk), std::to_string(c.get("threads"))})};
}

// The chunkwise form from its optional states; the parallel one from (0, 0, -inf). The running state
// needs memory even when the last states are not returned: workspace then.
void launch_fwd(const Call& call, const Config& c, Launcher& l, int64_t chunk, bool chunkwise) {
  const Problem& p = call.problem;
  const int64_t seqs = p.dim("batch") * p.dim("heads"), dk = p.dim("dhqk"), dv = p.dim("dhhv");
  if (seqs == 0) return;
  MlstmParams a = qkvif_args(call);
  a.h = call.out("h").data;
  a.nrm = static_cast<float*>(call.out("nrm").data);
  a.m_rows = static_cast<float*>(call.out("m_rows").data);
  if (chunkwise) {
    a.C0 = static_cast<const float*>(call.in("C0").data);
    a.n0 = static_cast<const float*>(call.in("n0").data);
    a.m0 = static_cast<const float*>(call.in("m0").data);
    a.C = static_cast<float*>(call.out("C_last").data);
    a.n = static_cast<float*>(call.out("n_last").data);
    a.m = static_cast<float*>(call.out("m_last").data);
  } else {
    a.m_init = -std::numeric_limits<float>::infinity();
  }
  if (!a.C) {
    a.C = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(seqs * (dk * dv + dk))));
    a.n = a.C + seqs * dk * dv;
  }
  a.seqlen = p.dim("seqlen");
  a.eps = static_cast<float>(p.param_float("eps"));
  void* args[] = {&a};
  const auto smem = sizeof(float) * static_cast<size_t>(mlstm_chunkwise_fwd_smem_floats(static_cast<int>(chunk)));
  l.launch(0, {u32(seqs)}, {u32(c.get("threads"))}, u32(smem), args);
}

// ---- the tensor-core forward (mlstm.chunkwise.fwd, algo=tc; templates/mlstm/chunkwise_tc.cuh) ----

// The state scans' C tile edge of a tensor-core config: 128 for algo=tc_wide (and tc_wide_q128), else 64
// (params.h).
int tc_state_tile(int64_t algo) {
  return algo == kTcWide || algo == kTcWideQ128 || algo == kTcWideOverlap || algo == kTcWidePg ? kMlstmTcWideTile
                                                                                                : 64;
}

// The forward's output kernel's query rows a CTA: 128 for algo=tc_q128 (and tc_wide_q128), else
// mlstm_tc_rows(chunk).
int tc_out_rows(int64_t algo, int64_t chunk) {
  return algo == kTcQ128 || algo == kTcWideQ128 ? kMlstmTcWideRows : mlstm_tc_rows(static_cast<int>(chunk));
}

// The tensor-core gates kernel (kernel 0 of both ops): one warp a sequence, or by warps (`warps`: algo=tc_pg
// forward, tc_overlap backward; launched with 32 * gates_warps(..) threads).
int gates_warps(bool warps) { return warps ? kMlstmTcGatesWarps : 1; }
jit::KernelSpec tc_gates_kernel(const Problem& p, bool warps) {
  const std::string L = std::to_string(p.param_int("chunk"));
  if (!warps) return kernel_spec(p, "mlstm/chunkwise_tc.cuh", "kspec::mlstm_tc_gates_kernel", {gate_type(p), L});
  return kernel_spec(p, "mlstm/chunkwise_tc.cuh", "kspec::mlstm_tc_gates_warps_kernel",
                     {gate_type(p), L, std::to_string(kMlstmTcGatesWarps)});
}

// Kernels 0, 1, 2: gates, state, output.
std::vector<jit::KernelSpec> tc_kernels(const Problem& p, int64_t algo) {
  const std::string t = dtype_cuda_type(p.dtype("q")), dk = std::to_string(p.dim("dhqk")),
                    dv = std::to_string(p.dim("dhhv")), L = std::to_string(p.param_int("chunk"));
  const int tile = tc_state_tile(algo), rows = tc_out_rows(algo, p.param_int("chunk"));
  std::vector<std::string> state = {t, dk, dv, L, "false"}, out = {t, dk, dv, L};
  if (tile != 64) state.push_back(std::to_string(tile));
  if (rows != mlstm_tc_rows(static_cast<int>(p.param_int("chunk")))) out.push_back(std::to_string(rows));
  return {tc_gates_kernel(p, algo == kTcPg),
          kernel_spec(p, "mlstm/chunkwise_tc.cuh", "kspec::mlstm_tc_state_kernel", state),
          kernel_spec(p, "mlstm/chunkwise_tc.cuh", "kspec::mlstm_tc_out_kernel", out)};
}

// Workspace, each piece 256-byte aligned: the per-step gate rows (4 floats), m per step when m_rows is
// not an output, the per-chunk decay, n and C entering every chunk (C in the input dtype).
void launch_tc(const Call& call, Launcher& l, int64_t algo) {
  const Problem& p = call.problem;
  const int64_t seqs = p.dim("batch") * p.dim("heads"), S = p.dim("seqlen"), dk = p.dim("dhqk"),
                dv = p.dim("dhhv"), L = p.param_int("chunk"), NC = (S + L - 1) / L;
  if (seqs == 0) return;
  const int rows = tc_out_rows(algo, L), tile = tc_state_tile(algo);
  const int64_t qtiles = (S + rows - 1) / rows;
  KSPEC_CHECK_AS(seqs * qtiles <= INT32_MAX &&
                     seqs * (dk / mlstm_tc_state_tile(static_cast<int>(dk), tile)) <= INT32_MAX,
                 Unsupported, "mlstm.chunkwise.fwd: batch * heads * ceil(seqlen / ", rows, ") = ", seqs * qtiles,
                 " thread blocks exceed the grid (at most ", INT32_MAX, "); use algo=simt");
  MlstmParams a = qkvif_args(call);
  a.C0 = static_cast<const float*>(call.in("C0").data);
  a.n0 = static_cast<const float*>(call.in("n0").data);
  a.m0 = static_cast<const float*>(call.in("m0").data);
  a.h = call.out("h").data;
  a.nrm = static_cast<float*>(call.out("nrm").data);
  a.m_rows = static_cast<float*>(call.out("m_rows").data);
  a.C = static_cast<float*>(call.out("C_last").data);
  a.n = static_cast<float*>(call.out("n_last").data);
  a.m = static_cast<float*>(call.out("m_last").data);
  a.seqlen = S;
  a.eps = static_cast<float>(p.param_float("eps"));
  auto round = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t gate_b = round(sizeof(float) * 4 * seqs * S), m_b = a.m_rows ? 0 : round(sizeof(float) * seqs * S),
               g_b = round(sizeof(float) * seqs * NC), n_b = round(sizeof(float) * seqs * NC * dk),
               C_b = round(dtype_size(p.dtype("q")) * static_cast<size_t>(seqs * NC * dk * dv));
  char* ws = static_cast<char*>(l.workspace(gate_b + m_b + g_b + n_b + C_b));
  a.gate_rows = reinterpret_cast<float*>(ws);
  if (!a.m_rows) a.m_rows = reinterpret_cast<float*>(ws + gate_b);
  a.chunk_g = reinterpret_cast<float*>(ws + gate_b + m_b);
  a.ns = reinterpret_cast<float*>(ws + gate_b + m_b + g_b);
  a.Cs = ws + gate_b + m_b + g_b + n_b;
  void* args[] = {&a};
  const int dki = static_cast<int>(dk), dvi = static_cast<int>(dv), Li = static_cast<int>(L);
  l.launch(0, {u32(seqs)}, {u32(32 * gates_warps(algo == kTcPg))}, 0, args);
  l.launch(1, {u32(seqs * (dk / mlstm_tc_state_tile(dki, tile))), u32(dv / mlstm_tc_state_tile(dvi, tile))},
           {u32(mlstm_tc_state_threads(dki, tile))}, u32(mlstm_tc_state_smem_bytes(dki, dvi, Li, tile)), args);
  l.launch(2, {u32(seqs * qtiles), u32(dv / mlstm_tc_bv(dvi))}, {u32(2 * rows)},
           u32(mlstm_tc_out_smem_bytes(dki, dvi, Li, rows)), args);
}

// ---- mlstm.chunkwise.fwd ----

OpDef make_chunkwise_fwd() {
  OpDef op = mlstm_base("mlstm.chunkwise.fwd",
                        "the mLSTM over q, k [batch, heads, seqlen, dhqk], v [.., dhhv], gates i, f [.., seqlen] "
                        "chunk by chunk (the recurrence of mlstm.step exactly, for any seqlen): h, and optionally the "
                        "per-step normalizer and max (for the backward) and the last states",
                        true);
  op.info.params = {eps_param(), chunk_param()};
  op.info.inputs = qkvif(kRows, kRows);
  op.info.inputs.push_back(tensor_def("C0", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial memory (with n0, m0; absent: zeros)"));
  op.info.inputs.push_back(tensor_def("n0", kN, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial normalizer"));
  op.info.inputs.push_back(tensor_def("m0", kM, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial stabilizer"));
  op.info.outputs = {
      tensor_def("h", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous, "output"),
      tensor_def("nrm", kRows, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "max(|s q.n|, e^-m) per step, for the backward (with m_rows; leave out for inference)"),
      tensor_def("m_rows", kRows, {DType::f32}, "", false, true, "", Layout::Contiguous, "m per step, for the backward"),
      tensor_def("C_last", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "memory after the last step (with n_last, m_last: return_last_states)"),
      tensor_def("n_last", kN, {DType::f32}, "", false, true, "", Layout::Contiguous, "normalizer after the last step"),
      tensor_def("m_last", kM, {DType::f32}, "", false, true, "", Layout::Contiguous, "stabilizer after the last step"),
  };
  op.tuning = chunkwise_fwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.info.tuning_names = {{"algo", {"simt", "tc", "tc_wide", "tc_q128", "tc_wide_q128", "tc_pg"}}};
  op.cases = chunkwise_fwd_cases();
  // fp32 over recurrences of up to 4096 steps: 4e-5 relative.
  op.tolerance_scale = 4.0;
  op.kernels = [](const Problem& p, const Config& c) {
    return c.get("algo") == kSimt ? fwd_kernels(p, c, p.param_int("chunk")) : tc_kernels(p, c.get("algo"));
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    if (c.get("algo") != kSimt) return launch_tc(call, l, c.get("algo"));
    launch_fwd(call, c, l, call.problem.param_int("chunk"), true);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    auto data = [](const HostTensor& h) { return h.defined ? h.data : std::vector<double>{}; };
    ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data,
                       data(in[5]), data(in[6]), data(in[7])};
    const ref::MlstmShape s = shape_of_problem(p, p.dim("seqlen"));
    auto o = ref::mlstm_chunkwise_fwd_ref(s, r, p.param_int("chunk"), p.param_float("eps"));
    const std::vector<int64_t> per_step = {s.B, s.NH, s.S};
    return std::vector<HostTensor>{{true, in[2].shape, std::move(o.h)},
                                   {true, per_step, std::move(o.nrm)},
                                   {true, per_step, std::move(o.m)},
                                   {true, {s.B, s.NH, s.DK, s.DV}, std::move(o.C)},
                                   {true, {s.B, s.NH, s.DK}, std::move(o.n)},
                                   {true, {s.B, s.NH, 1}, std::move(o.m_last)}};
  };
  return op;
}

// ---- the backward kernel (mlstm.chunkwise.bwd, mlstm.parallel.bwd) ----

// The inputs rounded to their dtypes, then nrm and m_rows as the forward of these very inputs gives
// them (what the backward is always called with; n0 taken as zero, as the backward has no n0: nrm is
// the backward's constant whatever it is).
void bwd_prepare(const Problem& p, std::vector<HostTensor>& in, bool chunkwise) {
  for (size_t j = 0; j < 5; ++j) quantize(p.inputs[j].dtype, in[j].data);
  const ref::MlstmShape s = shape_of_problem(p, p.dim("seqlen"));
  ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data, {}, {}, {}};
  const size_t nrm_at = chunkwise ? 7 : 5;
  ref::MlstmOutputs o;
  if (chunkwise) {
    if (in[5].defined) r.C0 = in[5].data, r.n0.assign(s.B * s.NH * s.DK, 0.0), r.m0 = in[6].data;
    o = ref::mlstm_chunkwise_fwd_ref(s, r, p.param_int("chunk"), p.param_float("eps"));
  } else {
    o = ref::mlstm_parallel_fwd_ref(s, r, p.param_float("eps"));
  }
  in[nrm_at].data = std::move(o.nrm);
  in[nrm_at + 1].data = std::move(o.m);
}

// Workspace: q . dq per step, and the running C / dC when dC0 is not an output.
void launch_bwd(const Call& call, const Config& c, Launcher& l, int64_t chunk, bool chunkwise) {
  const Problem& p = call.problem;
  const int64_t seqs = p.dim("batch") * p.dim("heads"), S = p.dim("seqlen"), kv = p.dim("dhqk") * p.dim("dhhv");
  if (seqs == 0) return;
  MlstmParams a = qkvif_args(call);
  a.nrm = static_cast<float*>(call.in("nrm").data);
  a.m_rows = static_cast<float*>(call.in("m_rows").data);
  a.dh = call.in("dh").data;
  a.dq = call.out("dq").data;
  a.dk = call.out("dk").data;
  a.dv = call.out("dv").data;
  a.di = call.out("di").data;
  a.df = call.out("df").data;
  a.seqlen = S;
  a.eps = static_cast<float>(p.param_float("eps"));
  if (chunkwise) {
    a.C0 = static_cast<const float*>(call.in("C0").data);
    a.m0 = static_cast<const float*>(call.in("m0").data);
    a.dC_last = static_cast<const float*>(call.in("dC_last").data);
    a.C = static_cast<float*>(call.out("dC0").data);
  } else {
    a.m_init = -std::numeric_limits<float>::infinity();
  }
  const size_t state_floats = a.C ? 0 : static_cast<size_t>(seqs * kv);
  float* ws = static_cast<float*>(l.workspace(sizeof(float) * (state_floats + static_cast<size_t>(seqs * S))));
  a.qdq = ws;
  if (!a.C) a.C = ws + seqs * S;
  void* args[] = {&a};
  const auto smem = sizeof(float) * static_cast<size_t>(mlstm_chunkwise_bwd_smem_floats(static_cast<int>(chunk)));
  l.launch(0, {u32(seqs)}, {u32(c.get("threads"))}, u32(smem), args);
}

std::vector<jit::KernelSpec> bwd_kernels(const Problem& p, const Config& c, int64_t chunk) {
  return {kernel_spec(p, "mlstm/chunkwise_bwd.cuh", "kspec::mlstm_chunkwise_bwd_kernel",
                      {dtype_cuda_type(p.dtype("q")), gate_type(p), std::to_string(p.dim("dhqk")),
                       std::to_string(p.dim("dhhv")), std::to_string(chunk), std::to_string(c.get("threads"))})};
}

// ---- the tensor-core backward (mlstm.chunkwise.bwd, algo=tc; templates/mlstm/chunkwise_tc_bwd.cuh) ----

// The tensor-core backward's variant: algo=tc (loop: dq's and dk's CTAs loop over DHHV's blocks where
// mlstm_tc_dq_loops), tc_fused (dv and dk in one kernel; dq loops), tc_parts (tc with a CTA per block
// and partials everywhere, the code before the loops, kept to compare), tc_merged (the two state scans in
// one launch; at DHQK <= 128 tc's dq, dv and dk CTAs in another, nothing reduced; above, dv looping over
// DHQK's blocks: dv_loop), tc_stream (DHQK > 128 only: tc_merged with dq and dk streaming DHHV's blocks,
// so nothing is reduced there either and dq, dv, dk share one launch).
// tc_wide: the default's kernels (tc_merged, tc_stream at DHQK > 128) with the state scans on 128 x 128 tiles.
// tc_overlap (tc_wide_overlap): tc_merged's (tc_wide's) with the grads kernel's next loads prefetched and the
// gates kernel by warps (`gates_warps`); tc_wide_pg: tc_wide's with the gates kernel by warps.
struct TcBwd {
  bool fused, loop, merged, dv_loop, stream, prefetch, gates_warps;
  int state_tile;
};
TcBwd tc_bwd_variant(const Problem& p, int64_t algo) {
  const int dk = static_cast<int>(p.dim("dhqk")), dv = static_cast<int>(p.dim("dhhv"));
  const bool prefetch = algo == kTcOverlap || algo == kTcWideOverlap, wide = algo == kTcWide || algo == kTcWidePg,
             merged = algo == kTcMerged || algo == kTcStream || wide || prefetch,
             stream = algo == kTcStream || (wide && mlstm_tc_streams(dk));
  return {algo == kTcFused, (algo != kTcParts && mlstm_tc_dq_loops(dk, dv)) || stream, merged,
          merged && mlstm_tc_dv_loops(dk), stream, prefetch, prefetch || algo == kTcWidePg, tc_state_tile(algo)};
}

// Which of dq, dv, dk (MlstmGrad order) go through the partials and a reduce kernel (head dims > 128).
std::vector<MlstmGrad> tc_bwd_reduced(const Problem& p, TcBwd v) {
  const int dk = static_cast<int>(p.dim("dhqk")), dv = static_cast<int>(p.dim("dhhv"));
  std::vector<MlstmGrad> r;
  for (MlstmGrad g : {kMlstmGradDq, kMlstmGradDv, kMlstmGradDk})
    if (mlstm_tc_bwd_reduced(dk, dv, g, v.fused, v.loop, v.dv_loop, v.stream)) r.push_back(g);
  return r;
}

// Kernels 0..6: gates, state forward, state reversed, dq, dv, dk, df (fused: 0..5, dv and dk as kernel 4);
// then one reduce kernel for each of tc_bwd_reduced. Merged: gates, both states, dq/dv/dk, df (DHQK > 128:
// gates, both states, dq, dv, dk, df, the reduce kernels).
std::vector<jit::KernelSpec> tc_bwd_kernels(const Problem& p, TcBwd v) {
  const bool fused = v.fused;
  const char* loop = v.loop ? "true" : "false";
  const std::string t = dtype_cuda_type(p.dtype("q")), dk = std::to_string(p.dim("dhqk")),
                    dv = std::to_string(p.dim("dhhv")), L = std::to_string(p.param_int("chunk"));
  const char* fwd = "mlstm/chunkwise_tc.cuh";
  const char* bwd = "mlstm/chunkwise_tc_bwd.cuh";
  const int parts = mlstm_tc_dot_parts(static_cast<int>(p.dim("dhqk")), v.stream);
  std::vector<std::string> df_targs = {gate_type(p), dk, dv};
  if (parts > 1) df_targs.push_back(std::to_string(parts));
  const jit::KernelSpec gates = tc_gates_kernel(p, v.gates_warps),
                        df = kernel_spec(p, bwd, "kspec::mlstm_tc_df_kernel", df_targs);
  std::vector<std::string> states = {t, dk, dv, L};
  if (v.state_tile != 64) states.push_back(std::to_string(v.state_tile));
  std::vector<std::string> grads = {t, dk, dv, L};
  if (v.prefetch) grads.push_back("true");
  if (v.merged && mlstm_tc_merged_runs(static_cast<int>(p.dim("dhqk")), v.stream))
    return {gates, kernel_spec(p, bwd, "kspec::mlstm_tc_states_kernel", states),
            kernel_spec(p, bwd, "kspec::mlstm_tc_grads_kernel", grads), df};
  std::vector<jit::KernelSpec> k = {gates};
  if (v.merged) {
    k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_states_kernel", states));
  } else {
    k.push_back(kernel_spec(p, fwd, "kspec::mlstm_tc_state_kernel", {t, dk, dv, L, "false"}));
    k.push_back(kernel_spec(p, fwd, "kspec::mlstm_tc_state_kernel", {t, dk, dv, L, "true"}));
  }
  k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_dq_kernel", {t, dk, dv, L, loop}));
  if (fused) {
    k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_dkv_fused_kernel", {t, dk, dv, L}));
  } else {
    const char* dv_loop = v.dv_loop ? "true" : "false";
    k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_dkv_kernel", {t, dk, dv, L, "false", dv_loop}));
    k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_dkv_kernel", {t, dk, dv, L, "true", loop}));
  }
  k.push_back(df);
  for (MlstmGrad g : tc_bwd_reduced(p, v))
    k.push_back(kernel_spec(p, bwd, "kspec::mlstm_tc_reduce_kernel", {t, dk, dv, std::to_string(g)}));
  return k;
}

// Workspace (256-byte pieces): gate rows, m per step (recomputed: the forward's of the same inputs),
// per-chunk decay, n entering each chunk (written, unused), C entering and dC after each chunk (input
// dtype), q.dq and k.dk per step (tc_stream at DHQK > 128: one per DHQK block), C_last, n_last when
// dC_last is given (for df), and at head dims over 128 the fp32 partials of one gradient at a time (each
// reduced before the next kernel writes them; fused: dv's and dk's side by side).
void launch_tc_bwd(const Call& call, Launcher& l, TcBwd v) {
  const bool fused = v.fused;
  const Problem& p = call.problem;
  const int64_t seqs = p.dim("batch") * p.dim("heads"), S = p.dim("seqlen"), dk = p.dim("dhqk"),
                dv = p.dim("dhhv"), L = p.param_int("chunk"), NC = (S + L - 1) / L;
  if (seqs == 0) return;
  const int rows = mlstm_tc_rows(static_cast<int>(L));
  const int64_t qtiles = (S + rows - 1) / rows;
  KSPEC_CHECK_AS(seqs * qtiles <= INT32_MAX, Unsupported, "mlstm.chunkwise.bwd: batch * heads * ceil(seqlen / ", rows,
                 ") = ", seqs * qtiles, " thread blocks exceed the grid (at most ", INT32_MAX, "); use algo=simt");
  KSPEC_CHECK_AS(tc_bwd_reduced(p, v).empty() || seqs * ((S + 3) / 4) <= INT32_MAX, Unsupported,
                 "mlstm.chunkwise.bwd: batch * heads * ceil(seqlen / 4) = ", seqs * ((S + 3) / 4),
                 " thread blocks of the partial sums' reduction exceed the grid (at most ", INT32_MAX,
                 "); use algo=simt");
  MlstmParams a = qkvif_args(call);
  a.C0 = static_cast<const float*>(call.in("C0").data);
  a.m0 = static_cast<const float*>(call.in("m0").data);
  a.nrm = static_cast<float*>(call.in("nrm").data);
  a.dh = call.in("dh").data;
  a.dC_last = static_cast<const float*>(call.in("dC_last").data);
  a.dq = call.out("dq").data;
  a.dk = call.out("dk").data;
  a.dv = call.out("dv").data;
  a.di = call.out("di").data;
  a.df = call.out("df").data;
  a.seqlen = S;
  a.eps = static_cast<float>(p.param_float("eps"));
  auto round = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t rows_b = round(sizeof(float) * seqs * S), state_b = round(dtype_size(p.dtype("q")) * static_cast<size_t>(seqs * NC * dk * dv));
  const std::vector<MlstmGrad> reduced = tc_bwd_reduced(p, v);
  const int dki = static_cast<int>(dk), dvi = static_cast<int>(dv), Li = static_cast<int>(L);
  auto part_floats = [&](MlstmGrad g) {
    return std::find(reduced.begin(), reduced.end(), g) == reduced.end()
               ? size_t{0}
               : static_cast<size_t>(mlstm_tc_bwd_parts(dki, dvi, g) * seqs * S * (g == kMlstmGradDv ? dv : dk));
  };
  const size_t dv_floats = part_floats(kMlstmGradDv);
  const size_t part_b = round(sizeof(float) * std::max({part_floats(kMlstmGradDq), fused ? 0 : dv_floats,
                                                        (fused ? dv_floats : 0) + part_floats(kMlstmGradDk)}));
  const size_t dots_b = rows_b * static_cast<size_t>(mlstm_tc_dot_parts(static_cast<int>(dk), v.stream));
  const size_t sizes[] = {4 * rows_b, rows_b, round(sizeof(float) * seqs * NC), round(sizeof(float) * seqs * NC * dk),
                          state_b, state_b, dots_b, dots_b,
                          a.dC_last ? round(sizeof(float) * seqs * dk * dv) : 0, a.dC_last ? round(sizeof(float) * seqs * dk) : 0,
                          part_b};
  size_t total = 0;
  for (size_t b : sizes) total += b;
  char* ws = static_cast<char*>(l.workspace(total));
  char* at[11];
  for (int j = 0; j < 11; ++j) at[j] = ws, ws += sizes[j];
  a.gate_rows = reinterpret_cast<float*>(at[0]);
  a.m_rows = reinterpret_cast<float*>(at[1]);
  a.chunk_g = reinterpret_cast<float*>(at[2]);
  a.ns = reinterpret_cast<float*>(at[3]);
  a.qdq = reinterpret_cast<float*>(at[6]);
  a.kdk = reinterpret_cast<float*>(at[7]);
  a.part = part_b ? reinterpret_cast<float*>(at[10]) : nullptr;
  MlstmParams fwd = a, rev = a, dkv = a, last = a;
  fwd.Cs = at[4];
  fwd.C = a.dC_last ? reinterpret_cast<float*>(at[8]) : nullptr;  // C_last, for <dC_last, C_last> in df
  fwd.n = reinterpret_cast<float*>(at[9]);
  rev.Cs = dkv.Cs = at[5];
  rev.C = static_cast<float*>(call.out("dC0").data);
  last.C = fwd.C;
  const int tile = v.state_tile;
  const Dim3 state_grid{u32(seqs * (dk / mlstm_tc_state_tile(dki, tile))), u32(dv / mlstm_tc_state_tile(dvi, tile))};
  const Dim3 tiles{u32(seqs * qtiles), u32(mlstm_tc_bwd_blocks(dki, dvi))}, block{u32(mlstm_tc_out_threads(Li))};
  const auto state_smem = u32(mlstm_tc_state_smem_bytes(dki, dvi, Li, tile)),
             smem = u32(mlstm_tc_bwd_smem_bytes(dki, dvi, Li));
  const Dim3 state_block{u32(mlstm_tc_state_threads(dki, tile))};
  void* args[] = {&a};
  void* fwd_args[] = {&fwd};
  void* rev_args[] = {&rev};
  void* dkv_args[] = {&dkv};
  void* last_args[] = {&last};
  l.launch(0, {u32(seqs)}, {u32(32 * gates_warps(v.gates_warps))}, 0, args);
  if (v.merged) {
    void* both_states[] = {&fwd, &rev};
    l.launch(1, {state_grid.x, state_grid.y, 2}, state_block, state_smem, both_states);
    if (mlstm_tc_merged_runs(dki, v.stream)) {  // tc_bwd_reduced is empty here: no partials
      const int roles = mlstm_tc_grads_roles(dki, dvi);
      KSPEC_CHECK_AS(seqs * qtiles * roles <= INT32_MAX, Unsupported,
                     "mlstm.chunkwise.bwd: batch * heads * ceil(seqlen / ", rows, ") * ", roles, " = ",
                     seqs * qtiles * roles, " thread blocks of algo=tc_merged exceed the grid (at most ", INT32_MAX,
                     "); use algo=tc");
      void* grads_args[] = {&fwd, &dkv};
      l.launch(2, {u32(seqs * qtiles * roles)}, block, u32(mlstm_tc_grads_smem_bytes(dki, dvi, Li)), grads_args);
      l.launch(3, {u32(seqs)}, {32}, 0, last_args);
      return;
    }
  } else {
    l.launch(1, state_grid, state_block, state_smem, fwd_args);
    l.launch(2, state_grid, state_block, state_smem, rev_args);
  }
  // A gradient's partials are summed (the reduce kernels follow df) before the next kernel reuses them.
  // Merged (DHQK > 128): one state launch, so every later kernel one index lower.
  const size_t dq_at = v.merged ? 2 : 3, df_at = fused || v.merged ? 5 : 6;
  MlstmParams dk_sum = a;  // fused: dk's partials after dv's (mlstm_tc_dkv_fused_kernel's kDkAt)
  if (fused && a.part) dk_sum.part = a.part + dv_floats;
  void* dk_sum_args[] = {&dk_sum};
  auto reduce = [&](MlstmGrad g) {
    const auto at_g = std::find(reduced.begin(), reduced.end(), g);
    if (at_g != reduced.end())
      l.launch(df_at + 1 + static_cast<size_t>(at_g - reduced.begin()), {u32(seqs * ((S + 3) / 4))}, {128}, 0,
               g == kMlstmGradDk ? dk_sum_args : args);
  };
  l.launch(dq_at, {tiles.x, u32(mlstm_tc_dq_blocks(dki, dvi, v.loop))}, block,
           u32(mlstm_tc_dq_smem_bytes(dki, dvi, Li, v.loop)), fwd_args);
  reduce(kMlstmGradDq);
  if (fused) {
    l.launch(dq_at + 1, tiles, {2 * block.x}, smem, dkv_args);
    reduce(kMlstmGradDv);
  } else {
    l.launch(dq_at + 1, {tiles.x, u32(mlstm_tc_dv_blocks(dki, dvi, v.dv_loop))}, block,
             u32(mlstm_tc_dv_smem_bytes(dki, dvi, Li, v.dv_loop)), dkv_args);
    reduce(kMlstmGradDv);
    l.launch(dq_at + 2, {tiles.x, u32(mlstm_tc_dk_blocks(dki, dvi, v.loop))}, block,
             u32(mlstm_tc_dk_smem_bytes(dki, dvi, Li, v.loop)), dkv_args);
  }
  reduce(kMlstmGradDk);
  l.launch(df_at, {u32(seqs)}, {32}, 0, last_args);
}

// ---- mlstm.chunkwise.bwd ----

OpDef make_chunkwise_bwd() {
  OpDef op = mlstm_base("mlstm.chunkwise.bwd",
                        "gradients of mlstm.chunkwise.fwd (dq, dk, dv, di, df, and dC0 with C0) with its nrm and "
                        "m_rows as constants (as mlstm_kernels: dn0 = dm0 = 0); an upstream dC_last reaches df",
                        true);
  op.info.params = {eps_param(), chunk_param()};
  op.info.inputs = bwd_inputs(true);
  op.info.outputs = bwd_outputs(true);
  op.tuning = chunkwise_bwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.info.tuning_names = {{"algo", {"simt", "tc", "tc_fused", "tc_parts", "tc_merged", "tc_stream", "tc_wide",
                                    "tc_overlap", "tc_wide_overlap", "tc_wide_pg"}}};
  op.cases = chunkwise_bwd_cases();
  op.tolerance_scale = 4.0;
  op.error_scale = df_error_scale;
  op.kernels = [](const Problem& p, const Config& c) {
    return c.get("algo") == kSimt ? bwd_kernels(p, c, p.param_int("chunk"))
                                  : tc_bwd_kernels(p, tc_bwd_variant(p, c.get("algo")));
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    if (c.get("algo") != kSimt) return launch_tc_bwd(call, l, tc_bwd_variant(call.problem, c.get("algo")));
    launch_bwd(call, c, l, call.problem.param_int("chunk"), true);
  };
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) { bwd_prepare(p, in, true); };
  op.prepare_for_timing = false;  // random nrm and m_rows time the same (no data-dependent branch)
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    const ref::MlstmShape s = shape_of_problem(p, p.dim("seqlen"));
    ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data, {}, {}, {}};
    if (in[5].defined) r.C0 = in[5].data, r.n0.assign(s.B * s.NH * s.DK, 0.0), r.m0 = in[6].data;
    auto g = ref::mlstm_chunkwise_bwd_ref(s, r, in[9].data, in[10].defined ? &in[10].data : nullptr,
                                          p.param_int("chunk"), p.param_float("eps"));
    std::vector<HostTensor> out = {host(in[0].shape, std::move(g.dq)), host(in[1].shape, std::move(g.dk)),
                                   host(in[2].shape, std::move(g.dv)), host(in[3].shape, std::move(g.di)),
                                   host(in[4].shape, std::move(g.df)), HostTensor{}};
    if (in[5].defined) out[5] = host(in[5].shape, std::move(g.dC0));
    return out;
  };
  return op;
}

// ---- mlstm.parallel.fwd / .bwd ----

OpDef make_parallel_fwd() {
  OpDef op = mlstm_base("mlstm.parallel.fwd",
                        "the mLSTM's parallel form (no states): F = cumsum(logsigmoid(f)), D_ts = F_t - F_s + i_s "
                        "(s <= t), m_t = max_s D_ts, C_ts = s q_t.k_s e^(D_ts - m_t), nrm_t = max(|sum_s C_ts|, "
                        "e^-m_t), h = C V / (nrm + eps); optionally nrm and m per step for the backward",
                        true);
  op.info.params = {eps_param()};
  op.info.inputs = qkvif(kRows, kRows);
  op.info.outputs = {
      tensor_def("h", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous, "output"),
      tensor_def("nrm", kRows, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "max(|sum_s C_ts|, e^-m_t) per step, for the backward (with m_rows; leave out for inference)"),
      tensor_def("m_rows", kRows, {DType::f32}, "", false, true, "", Layout::Contiguous, "m per step, for the backward"),
  };
  op.tuning = parallel_tuning(false);
  op.info.tuning_axes = op.tuning.axes;
  op.cases = parallel_cases(false);
  op.tolerance_scale = 4.0;
  op.kernels = [](const Problem& p, const Config& c) { return fwd_kernels(p, c, c.get("chunk")); };
  op.launch = [](const Call& call, const Config& c, Launcher& l) { launch_fwd(call, c, l, c.get("chunk"), false); };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data, {}, {}, {}};
    auto o = ref::mlstm_parallel_fwd_ref(shape_of_problem(p, p.dim("seqlen")), r, p.param_float("eps"));
    return std::vector<HostTensor>{host(in[2].shape, std::move(o.h)), host(in[3].shape, std::move(o.nrm)),
                                   host(in[3].shape, std::move(o.m))};
  };
  return op;
}

OpDef make_parallel_bwd() {
  OpDef op = mlstm_base("mlstm.parallel.bwd",
                        "gradients of mlstm.parallel.fwd (dq, dk, dv, di, df) with its nrm and m_rows as constants "
                        "(as mlstm_kernels)",
                        true);
  op.info.params = {eps_param()};
  op.info.inputs = bwd_inputs(false);
  op.info.outputs = bwd_outputs(false);
  op.tuning = parallel_tuning(true);
  op.info.tuning_axes = op.tuning.axes;
  op.cases = parallel_cases(true);
  op.tolerance_scale = 4.0;
  op.error_scale = df_error_scale;
  op.kernels = [](const Problem& p, const Config& c) { return bwd_kernels(p, c, c.get("chunk")); };
  op.launch = [](const Call& call, const Config& c, Launcher& l) { launch_bwd(call, c, l, c.get("chunk"), false); };
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) { bwd_prepare(p, in, false); };
  op.prepare_for_timing = false;
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    ref::MlstmInputs r{in[0].data, in[1].data, in[2].data, in[3].data, in[4].data, {}, {}, {}};
    auto g = ref::mlstm_parallel_bwd_ref(shape_of_problem(p, p.dim("seqlen")), r, in[7].data, p.param_float("eps"));
    return std::vector<HostTensor>{host(in[0].shape, std::move(g.dq)), host(in[1].shape, std::move(g.dk)),
                                   host(in[2].shape, std::move(g.dv)), host(in[3].shape, std::move(g.di)),
                                   host(in[4].shape, std::move(g.df))};
  };
  return op;
}

}  // namespace
}  // namespace mlstm

void register_mlstm(Registry& r) {
  r.add(mlstm::make_step());
  r.add(mlstm::make_chunkwise_fwd());
  r.add(mlstm::make_chunkwise_bwd());
  r.add(mlstm::make_parallel_fwd());
  r.add(mlstm::make_parallel_bwd());
}

}  // namespace kspec
