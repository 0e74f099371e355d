// mlstm: xLSTM's matrix-memory cell (issue 29). mlstm.step (one decoding step, states in place),
// mlstm.chunkwise.fwd (a sequence chunk by chunk, optional initial and last states, the per-step
// normalizer and max for the backward) and .bwd (n, m constants; dC_last reaches df), mlstm.parallel.fwd
// and .bwd (no states). Schema, specializations, tuning spaces, launchers, float64 references
// (api/ops/mlstm/reference.h) and the case tables; kernels in templates/mlstm/ (step.cuh,
// chunkwise_fwd.cuh, chunkwise_bwd.cuh), their one argument templates/mlstm/params.h.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/spec.h"
#include "mlstm/reference.h"
#include "templates/mlstm/params.h"

namespace kspec {
namespace {

const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
// Head dims the kernels are built for: xLSTM's 64..512 and 16, 32 for tests.
const std::vector<int64_t> kHeadDims = {16, 32, 64, 128, 256, 512};
const std::vector<int64_t> kChunks = {16, 32, 64, 128};
constexpr int64_t kDefaultChunk = 64;

unsigned u32(int64_t v) { return static_cast<unsigned>(v); }

bool one_of(int64_t v, const std::vector<int64_t>& set) { return std::find(set.begin(), set.end(), v) != set.end(); }

std::string list(const std::vector<int64_t>& set) {
  std::string s;
  for (int64_t v : set) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return s;
}

// Head dims, the grid size, and the tensors that come only as a group.
void check_mlstm(const Problem& p) {
  const std::string& op = p.op->info.name;
  for (const char* dim : {"dhqk", "dhhv"})
    KSPEC_CHECK_AS(one_of(p.dim(dim), kHeadDims), Unsupported, op, ": ", dim, " = ", p.dim(dim),
                   " is not supported (one of ", list(kHeadDims), ")");
  // Tensors that come only as a group (the three states, the two per-step rows).
  auto together = [&](const char* kind, const std::vector<const char*>& names) {
    std::string group;
    for (const char* name : names) group += (group.empty() ? "'" : ", '") + std::string(name) + "'";
    for (const char* name : names)
      KSPEC_CHECK(p.present(name) == p.present(names[0]), op, ": ", kind, " ", group,
                  " must be given together or not at all ('", name, "' is ", p.present(name) ? "given" : "missing",
                  ", '", names[0], "' ", p.present(names[0]) ? "given" : "missing", ")");
  };
  KSPEC_CHECK(p.dim("batch") * p.dim("heads") <= INT32_MAX, op, ": input 'q': batch * heads = ",
              p.dim("batch") * p.dim("heads"), " is too large (one thread block per sequence, at most ", INT32_MAX, ")");
  if (op == "mlstm.chunkwise.fwd") {
    together("inputs", {"C0", "n0", "m0"});
    together("outputs", {"C_last", "n_last", "m_last"});
  }
  if (op == "mlstm.chunkwise.fwd" || op == "mlstm.parallel.fwd") together("outputs", {"nrm", "m_rows"});
  if (op == "mlstm.chunkwise.bwd") together("inputs", {"C0", "m0"});
  if (op == "mlstm.chunkwise.fwd" || op == "mlstm.chunkwise.bwd") {
    KSPEC_CHECK_AS(one_of(p.param_int("chunk"), kChunks), Unsupported, op, ": parameter 'chunk' = ",
                   p.param_int("chunk"), " is not supported (one of ", list(kChunks), ")");
  }
}

std::vector<DimDef> mlstm_dims(bool seq) {
  std::vector<DimDef> d = {{"batch", DimKind::Var, {}, "B"}, {"heads", DimKind::Var, {}, "NH"}};
  if (seq) d.push_back({"seqlen", DimKind::Var, {}, "S, any length >= 1", 1});
  d.push_back({"dhqk", DimKind::Const, {}, "DHQK, head dim of q and k: " + list(kHeadDims), 16, 512});
  d.push_back({"dhhv", DimKind::Const, {}, "DHHV, head dim of v and h: " + list(kHeadDims), 16, 512});
  return d;
}

ParamDef eps_param() {
  ParamDef d{"eps", ParamType::Float, 1e-6, {}, "added to the normalizer", true};
  d.min = 0.0;
  return d;
}

// Threads per CTA (one CTA per sequence). Untuned: 256 as the default. The backward kernel spills at
// 512 threads (128 registers a thread; fp16, sm_90: 96 bytes), so its space stops at 256.
TuningSpace mlstm_tuning(bool bwd = false) {
  TuningSpace t;
  t.axes = {{"threads", bwd ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{128, 256, 512}}};
  t.valid = [](const Problem&, const Config&, std::string*) { return true; };
  t.heuristic = [](const Problem&) { return Config{{{"threads", 256}}}; };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  return t;
}

std::string gate_type(const Problem& p) { return dtype_cuda_type(p.dtype("f")); }

ref::MlstmShape shape_of_problem(const Problem& p, int64_t seqlen) {
  return {p.dim("batch"), p.dim("heads"), seqlen, p.dim("dhqk"), p.dim("dhhv")};
}

OpDef mlstm_base(const char* name, const char* doc, bool seq) {
  OpDef op;
  op.info.name = name;
  op.info.family = "mlstm";
  op.info.doc = doc;
  op.info.dims = mlstm_dims(seq);
  op.info.reference = "api/ops/mlstm/reference.cpp (python/kspec/reference/mlstm.py)";
  op.check = check_mlstm;
  op.tuning = mlstm_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"batch", 1}, {"heads", 1}};
  if (seq) op.compile_dims.push_back({"seqlen", 1});
  return op;
}

// Inputs q, k, v, i, f with these leading dims; i and f in the input dtype or fp32.
std::vector<TensorDef> qkvif(const std::vector<std::string>& lead, const std::vector<std::string>& gate) {
  auto with = [&](const char* last) {
    std::vector<std::string> s = lead;
    s.push_back(last);
    return s;
  };
  return {
      tensor_def("q", with("dhqk"), kFloatTypes, "", false, false, "", Layout::Contiguous, "queries"),
      tensor_def("k", with("dhqk"), {}, "q", false, false, "", Layout::Contiguous, "keys"),
      tensor_def("v", with("dhhv"), {}, "q", false, false, "", Layout::Contiguous, "values"),
      tensor_def("i", gate, {}, "q", true, false, "", Layout::Contiguous, "input gate pre-activation (q's dtype or fp32)"),
      tensor_def("f", gate, {}, "i", false, false, "", Layout::Contiguous, "forget gate pre-activation (i's dtype)"),
  };
}

const std::vector<std::string> kC = {"batch", "heads", "dhqk", "dhhv"}, kN = {"batch", "heads", "dhqk"},
                               kM = {"batch", "heads", "1"};

// ---- mlstm.step ----

std::vector<Case> step_cases() {
  struct Spec {
    const char* name;
    int64_t B, NH, dk, dv;
    bool large;
  };
  const std::vector<Spec> specs = {
      {"base", 2, 3, 32, 32, false},    {"dh_16", 3, 2, 16, 16, false},  {"dk_16_dv_32", 2, 2, 16, 32, false},
      {"dh_64", 2, 4, 64, 64, false},   {"dk_128_dv_256", 2, 2, 128, 256, false},
      {"dh_512", 1, 2, 512, 512, false}, {"B_1_NH_1", 1, 1, 32, 64, false},
      {"model_B64_NH8_dh128", 64, 8, 128, 128, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"heads", s.NH}, {"dhqk", s.dk}, {"dhhv", s.dv}};
    c.large = s.large;
    c.representative = c.name == "base" || c.name == "dk_128_dv_256";
    cases.push_back(std::move(c));
  }
  Case f32g = cases.front();
  f32g.name = "gates_fp32";
  f32g.representative = false;
  f32g.tensor_dtypes = {{"i", DType::f32}, {"f", DType::f32}};
  cases.push_back(std::move(f32g));
  return cases;
}

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
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mlstm/step.cuh", "kspec::mlstm_step_kernel",
        {dtype_cuda_type(p.dtype("q")), gate_type(p), std::to_string(p.dim("dhqk")), std::to_string(p.dim("dhhv")),
         std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    MlstmParams a{};
    a.q = call.in("q").data;
    a.k = call.in("k").data;
    a.v = call.in("v").data;
    a.i = call.in("i").data;
    a.f = call.in("f").data;
    a.C0 = static_cast<const float*>(call.in("C").data);
    a.n0 = static_cast<const float*>(call.in("n").data);
    a.m0 = static_cast<const float*>(call.in("m").data);
    a.h = call.out("h").data;
    a.C = static_cast<float*>(call.out("C_new").data);
    a.n = static_cast<float*>(call.out("n_new").data);
    a.m = static_cast<float*>(call.out("m_new").data);
    a.seqlen = 1;
    a.eps = static_cast<float>(p.param_float("eps"));
    void* args[] = {&a};
    l.launch(0, {u32(p.dim("batch") * p.dim("heads"))}, {u32(c.get("threads"))}, 0, args);
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

// ---- mlstm.chunkwise.fwd ----

std::vector<Case> chunkwise_cases() {
  struct Spec {
    const char* name;
    int64_t B, NH, S, dk, dv, chunk;
    bool init, last, rows;
    bool large = false;
  };
  const std::vector<Spec> specs = {
      {"base", 2, 2, 100, 32, 32, 64, true, true, true},
      {"S_1", 2, 2, 1, 32, 32, 64, true, true, true},
      {"S_2", 2, 2, 2, 32, 32, 64, true, true, true},
      {"S_63", 1, 2, 63, 32, 32, 64, true, true, true},
      {"S_64", 1, 2, 64, 32, 32, 64, true, true, true},
      {"S_65", 1, 2, 65, 32, 32, 64, true, true, true},
      {"no_init", 2, 2, 100, 32, 32, 64, false, true, true},
      {"no_last", 2, 2, 100, 32, 32, 64, true, false, true},
      {"inference", 2, 2, 100, 32, 32, 64, false, false, false},
      {"dh_16", 2, 2, 37, 16, 16, 16, true, true, true},
      {"dk_16_dv_32", 2, 2, 37, 16, 32, 16, true, true, true},
      {"chunk_32", 1, 2, 100, 32, 32, 32, true, true, true},
      {"chunk_128", 1, 2, 300, 32, 32, 128, true, true, true},
      {"dh_64", 1, 2, 130, 64, 64, 64, true, true, true},
      {"dk_128_dv_256", 1, 1, 70, 128, 256, 64, true, true, true},
      {"S_1000", 1, 2, 1000, 64, 64, 64, false, true, true, true},
      {"dk_256_dv_512", 1, 1, 200, 256, 512, 64, true, true, true, true},
      {"S_4096", 1, 1, 4096, 64, 64, 128, false, false, false, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"heads", s.NH}, {"seqlen", s.S}, {"dhqk", s.dk}, {"dhhv", s.dv}};
    c.params = {{"chunk", s.chunk}};
    if (!s.init) c.without.insert(c.without.end(), {"C0", "n0", "m0"});
    if (!s.last) c.without.insert(c.without.end(), {"C_last", "n_last", "m_last"});
    if (!s.rows) c.without.insert(c.without.end(), {"nrm", "m_rows"});
    c.large = s.large;
    c.representative = c.name == "base" || c.name == "dk_128_dv_256" || c.name == "inference";
    cases.push_back(std::move(c));
  }
  Case f32g = cases.front();
  f32g.name = "gates_fp32";
  f32g.representative = false;
  f32g.tensor_dtypes = {{"i", DType::f32}, {"f", DType::f32}};
  cases.push_back(std::move(f32g));
  return cases;
}

OpDef make_chunkwise_fwd() {
  OpDef op = mlstm_base("mlstm.chunkwise.fwd",
                        "the mLSTM over q, k [batch, heads, seqlen, dhqk], v [.., dhhv], gates i, f [.., seqlen] "
                        "chunk by chunk (the recurrence of mlstm.step exactly, for any seqlen): h, and optionally the "
                        "per-step normalizer and max (for the backward) and the last states",
                        true);
  ParamDef chunk{"chunk", ParamType::Int, kDefaultChunk, {}, "L, steps per chunk: " + list(kChunks)};
  chunk.min = 1.0;
  chunk.max = 4096.0;
  op.info.params = {eps_param(), chunk};
  const std::vector<std::string> rows = {"batch", "heads", "seqlen"};
  op.info.inputs = qkvif({"batch", "heads", "seqlen"}, rows);
  op.info.inputs.push_back(tensor_def("C0", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial memory (with n0, m0; absent: zeros)"));
  op.info.inputs.push_back(tensor_def("n0", kN, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial normalizer"));
  op.info.inputs.push_back(tensor_def("m0", kM, {DType::f32}, "", false, true, "", Layout::Contiguous,
                                      "initial stabilizer"));
  op.info.outputs = {
      tensor_def("h", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous, "output"),
      tensor_def("nrm", rows, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "max(|s q.n|, e^-m) per step, for the backward (with m_rows; leave out for inference)"),
      tensor_def("m_rows", rows, {DType::f32}, "", false, true, "", Layout::Contiguous, "m per step, for the backward"),
      tensor_def("C_last", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "memory after the last step (with n_last, m_last: return_last_states)"),
      tensor_def("n_last", kN, {DType::f32}, "", false, true, "", Layout::Contiguous, "normalizer after the last step"),
      tensor_def("m_last", kM, {DType::f32}, "", false, true, "", Layout::Contiguous, "stabilizer after the last step"),
  };
  op.cases = chunkwise_cases();
  // fp32 over recurrences of up to 4096 steps: 4e-5 relative.
  op.tolerance_scale = 4.0;
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mlstm/chunkwise_fwd.cuh", "kspec::mlstm_chunkwise_fwd_kernel",
        {dtype_cuda_type(p.dtype("q")), gate_type(p), std::to_string(p.dim("dhqk")), std::to_string(p.dim("dhhv")),
         std::to_string(p.param_int("chunk")), std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    const int64_t seqs = p.dim("batch") * p.dim("heads"), dk = p.dim("dhqk"), dv = p.dim("dhhv");
    if (seqs == 0) return;
    MlstmParams a{};
    a.q = call.in("q").data;
    a.k = call.in("k").data;
    a.v = call.in("v").data;
    a.i = call.in("i").data;
    a.f = call.in("f").data;
    a.C0 = static_cast<const float*>(call.in("C0").data);
    a.n0 = static_cast<const float*>(call.in("n0").data);
    a.m0 = static_cast<const float*>(call.in("m0").data);
    a.h = call.out("h").data;
    a.nrm = static_cast<float*>(call.out("nrm").data);
    a.m_rows = static_cast<float*>(call.out("m_rows").data);
    a.C = static_cast<float*>(call.out("C_last").data);
    a.n = static_cast<float*>(call.out("n_last").data);
    a.m = static_cast<float*>(call.out("m_last").data);
    if (!a.C) {  // the running state needs memory even when the last states are not returned
      a.C = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(seqs * (dk * dv + dk))));
      a.n = a.C + seqs * dk * dv;
    }
    a.seqlen = p.dim("seqlen");
    a.eps = static_cast<float>(p.param_float("eps"));
    void* args[] = {&a};
    const auto smem = sizeof(float) * static_cast<size_t>(mlstm_chunkwise_fwd_smem_floats(
                                          static_cast<int>(p.param_int("chunk"))));
    l.launch(0, {u32(seqs)}, {u32(c.get("threads"))}, u32(smem), args);
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

// ---- mlstm.chunkwise.bwd ----

// The backward's inputs after q, k, v, i, f: the forward's per-step constants, dh, and for the chunkwise
// form the entering C0, m0 (n0 is not needed: nrm is given) and dC_last.
std::vector<TensorDef> bwd_inputs(bool chunkwise) {
  const std::vector<std::string> rows = {"batch", "heads", "seqlen"};
  std::vector<TensorDef> in = qkvif({"batch", "heads", "seqlen"}, rows);
  if (chunkwise) {
    in.push_back(tensor_def("C0", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "the forward's initial memory (with m0; absent: zeros)"));
    in.push_back(tensor_def("m0", kM, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "the forward's initial stabilizer"));
  }
  in.push_back(tensor_def("nrm", rows, {DType::f32}, "", false, false, "", Layout::Contiguous,
                          "the forward's nrm (a constant of the backward)"));
  in.push_back(tensor_def("m_rows", rows, {DType::f32}, "", false, false, "", Layout::Contiguous,
                          "the forward's m per step (a constant of the backward)"));
  in.push_back(tensor_def("dh", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous,
                          "gradient of h"));
  if (chunkwise)
    in.push_back(tensor_def("dC_last", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "gradient of C_last (absent: zero); reaches df, unlike mlstm_kernels"));
  return in;
}

std::vector<TensorDef> bwd_outputs(bool chunkwise) {
  const std::vector<std::string> rows = {"batch", "heads", "seqlen"};
  std::vector<TensorDef> out = {
      tensor_def("dq", {"batch", "heads", "seqlen", "dhqk"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of q"),
      tensor_def("dk", {"batch", "heads", "seqlen", "dhqk"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of k"),
      tensor_def("dv", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of v"),
      tensor_def("di", rows, {}, "i", false, false, "", Layout::Contiguous, "gradient of i (i's dtype)"),
      tensor_def("df", rows, {}, "i", false, false, "", Layout::Contiguous, "gradient of f (i's dtype)"),
  };
  if (chunkwise)
    out.push_back(tensor_def("dC0", kC, {DType::f32}, "", false, true, "C0", Layout::Contiguous,
                             "gradient of C0 (with C0; dn0 = dm0 = 0 with n, m constants)"));
  return out;
}

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
  MlstmParams a{};
  a.q = call.in("q").data;
  a.k = call.in("k").data;
  a.v = call.in("v").data;
  a.i = call.in("i").data;
  a.f = call.in("f").data;
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

HostTensor host(const std::vector<int64_t>& shape, std::vector<double> data) { return {true, shape, std::move(data)}; }

std::vector<Case> chunkwise_bwd_cases() {
  struct Spec {
    const char* name;
    int64_t B, NH, S, dk, dv, chunk;
    bool init, dlast;
    bool large = false;
  };
  const std::vector<Spec> specs = {
      {"base", 2, 2, 100, 32, 32, 64, true, true},
      {"S_1", 2, 2, 1, 32, 32, 64, true, true},
      {"S_2", 2, 2, 2, 32, 32, 64, true, true},
      {"S_63", 1, 2, 63, 32, 32, 64, true, true},
      {"S_64", 1, 2, 64, 32, 32, 64, true, true},
      {"S_65", 1, 2, 65, 32, 32, 64, true, true},
      {"no_init", 2, 2, 100, 32, 32, 64, false, true},
      {"no_dC_last", 2, 2, 100, 32, 32, 64, true, false},
      {"no_states", 2, 2, 100, 32, 32, 64, false, false},
      {"dh_16", 2, 2, 37, 16, 16, 16, true, true},
      {"dk_16_dv_32", 2, 2, 37, 16, 32, 16, true, true},
      {"chunk_32", 1, 2, 100, 32, 32, 32, true, true},
      {"chunk_128", 1, 2, 300, 32, 32, 128, true, true},
      {"dh_64", 1, 2, 130, 64, 64, 64, true, true},
      {"dk_128_dv_256", 1, 1, 70, 128, 256, 64, true, true},
      {"S_1000", 1, 2, 1000, 64, 64, 64, false, true, true},
      {"dk_256_dv_512", 1, 1, 200, 256, 512, 64, true, true, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"heads", s.NH}, {"seqlen", s.S}, {"dhqk", s.dk}, {"dhhv", s.dv}};
    c.params = {{"chunk", s.chunk}};
    if (!s.init) c.without.insert(c.without.end(), {"C0", "m0"});
    if (!s.dlast) c.without.push_back("dC_last");
    c.large = s.large;
    c.representative = c.name == "base" || c.name == "dk_128_dv_256" || c.name == "no_states";
    cases.push_back(std::move(c));
  }
  Case f32g = cases.front();
  f32g.name = "gates_fp32";
  f32g.representative = false;
  f32g.tensor_dtypes = {{"i", DType::f32}, {"f", DType::f32}};
  cases.push_back(std::move(f32g));
  return cases;
}

OpDef make_chunkwise_bwd() {
  OpDef op = mlstm_base("mlstm.chunkwise.bwd",
                        "gradients of mlstm.chunkwise.fwd (dq, dk, dv, di, df, and dC0 with C0) with its nrm and "
                        "m_rows as constants (as mlstm_kernels: dn0 = dm0 = 0); an upstream dC_last reaches df",
                        true);
  ParamDef chunk{"chunk", ParamType::Int, kDefaultChunk, {}, "L, steps per chunk: " + list(kChunks)};
  chunk.min = 1.0;
  chunk.max = 4096.0;
  op.info.params = {eps_param(), chunk};
  op.info.inputs = bwd_inputs(true);
  op.info.outputs = bwd_outputs(true);
  op.tuning = mlstm_tuning(true);
  op.info.tuning_axes = op.tuning.axes;
  op.cases = chunkwise_bwd_cases();
  op.tolerance_scale = 4.0;
  op.kernels = [](const Problem& p, const Config& c) { return bwd_kernels(p, c, p.param_int("chunk")); };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
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

// The parallel form is the chunkwise kernels from the states (0, 0, -inf) (see chunkwise_fwd.cuh): the
// chunk is then a tile size, free to tune, not a parameter. Untuned: 64 steps, 256 threads.
TuningSpace parallel_tuning(bool bwd) {
  TuningSpace t = mlstm_tuning(bwd);
  t.axes.push_back({"chunk", kChunks});
  t.heuristic = [](const Problem&) { return Config{{{"threads", 256}, {"chunk", kDefaultChunk}}}; };
  return t;
}

std::vector<Case> parallel_cases(bool bwd) {
  struct Spec {
    const char* name;
    int64_t B, NH, S, dk, dv;
    bool large = false;
  };
  const std::vector<Spec> specs = {
      {"base", 2, 2, 100, 32, 32},  {"S_1", 2, 2, 1, 32, 32},    {"S_2", 2, 2, 2, 32, 32},
      {"S_63", 1, 2, 63, 32, 32},   {"S_64", 1, 2, 64, 32, 32},  {"S_65", 1, 2, 65, 32, 32},
      {"dh_16", 2, 2, 37, 16, 16},  {"dk_16_dv_32", 2, 2, 37, 16, 32},
      {"dh_64", 1, 2, 130, 64, 64}, {"dk_128_dv_256", 1, 1, 70, 128, 256},
      {"S_1000", 1, 2, 1000, 64, 64, true}, {"dk_256_dv_512", 1, 1, 200, 256, 512, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"heads", s.NH}, {"seqlen", s.S}, {"dhqk", s.dk}, {"dhhv", s.dv}};
    if (!bwd && c.name == "dh_64") c.without = {"nrm", "m_rows"};
    c.large = s.large;
    c.representative = c.name == "base";  // 8 or 12 configs: precompile builds them for one shape
    cases.push_back(std::move(c));
  }
  Case f32g = cases.front();
  f32g.name = "gates_fp32";
  f32g.representative = false;
  f32g.tensor_dtypes = {{"i", DType::f32}, {"f", DType::f32}};
  cases.push_back(std::move(f32g));
  return cases;
}

OpDef make_parallel_fwd() {
  OpDef op = mlstm_base("mlstm.parallel.fwd",
                        "the mLSTM's parallel form (no states): F = cumsum(logsigmoid(f)), D_ts = F_t - F_s + i_s "
                        "(s <= t), m_t = max_s D_ts, C_ts = s q_t.k_s e^(D_ts - m_t), nrm_t = max(|sum_s C_ts|, "
                        "e^-m_t), h = C V / (nrm + eps); optionally nrm and m per step for the backward",
                        true);
  op.info.params = {eps_param()};
  const std::vector<std::string> rows = {"batch", "heads", "seqlen"};
  op.info.inputs = qkvif({"batch", "heads", "seqlen"}, rows);
  op.info.outputs = {
      tensor_def("h", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous, "output"),
      tensor_def("nrm", rows, {DType::f32}, "", false, true, "", Layout::Contiguous,
                 "max(|sum_s C_ts|, e^-m_t) per step, for the backward (with m_rows; leave out for inference)"),
      tensor_def("m_rows", rows, {DType::f32}, "", false, true, "", Layout::Contiguous, "m per step, for the backward"),
  };
  op.tuning = parallel_tuning(false);
  op.info.tuning_axes = op.tuning.axes;
  op.cases = parallel_cases(false);
  op.tolerance_scale = 4.0;
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mlstm/chunkwise_fwd.cuh", "kspec::mlstm_chunkwise_fwd_kernel",
        {dtype_cuda_type(p.dtype("q")), gate_type(p), std::to_string(p.dim("dhqk")), std::to_string(p.dim("dhhv")),
         std::to_string(c.get("chunk")), std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    const int64_t seqs = p.dim("batch") * p.dim("heads"), dk = p.dim("dhqk"), dv = p.dim("dhhv");
    if (seqs == 0) return;
    MlstmParams a{};
    a.q = call.in("q").data;
    a.k = call.in("k").data;
    a.v = call.in("v").data;
    a.i = call.in("i").data;
    a.f = call.in("f").data;
    a.h = call.out("h").data;
    a.nrm = static_cast<float*>(call.out("nrm").data);
    a.m_rows = static_cast<float*>(call.out("m_rows").data);
    a.C = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(seqs * (dk * dv + dk))));
    a.n = a.C + seqs * dk * dv;
    a.seqlen = p.dim("seqlen");
    a.eps = static_cast<float>(p.param_float("eps"));
    a.m_init = -std::numeric_limits<float>::infinity();
    void* args[] = {&a};
    const auto smem =
        sizeof(float) * static_cast<size_t>(mlstm_chunkwise_fwd_smem_floats(static_cast<int>(c.get("chunk"))));
    l.launch(0, {u32(seqs)}, {u32(c.get("threads"))}, u32(smem), args);
  };
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

void register_mlstm(Registry& r) {
  r.add(make_step());
  r.add(make_chunkwise_fwd());
  r.add(make_chunkwise_bwd());
  r.add(make_parallel_fwd());
  r.add(make_parallel_bwd());
}

}  // namespace kspec
