// mlstm's schema (tensors, params, dims, checks, tuning spaces) and case tables, shared by the five ops
// of op.cpp (schema.h).
#include "mlstm/schema.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "jit/spec.h"
#include "templates/mlstm/params.h"

namespace kspec::mlstm {

const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
// Head dims the kernels are built for: xLSTM's 64..512 and 16, 32 for tests.
const std::vector<int64_t> kHeadDims = {16, 32, 64, 128, 256, 512};
const std::vector<int64_t> kChunks = {16, 32, 64, 128, 256};
// The SIMT kernels keep chunk x chunk fp32 scores in shared memory (the backward two such tiles): the
// forward's 68.6 KB at 128 would be 262 KB at 256, past sm_90's 227 KB per block. algo=tc holds 64-row
// tiles whatever the chunk, so it alone runs chunk 256 (its state kernel's two K/V stages: 150 KB).
constexpr int64_t kSimtMaxChunk = 128;
const std::vector<int64_t> kSimtChunks = {16, 32, 64, 128};
const std::vector<std::string> kC = {"batch", "heads", "dhqk", "dhhv"}, kN = {"batch", "heads", "dhqk"},
                               kM = {"batch", "heads", "1"}, kRows = {"batch", "heads", "seqlen"};

namespace {

bool one_of(int64_t v, const std::vector<int64_t>& set) { return std::find(set.begin(), set.end(), v) != set.end(); }

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
    if (p.param_int("chunk") > kSimtMaxChunk) {
      const std::string no_tc = tc_unsupported(p);
      KSPEC_CHECK_AS(no_tc.empty(), Unsupported, op, ": parameter 'chunk' = ", p.param_int("chunk"),
                     " runs only on algo=tc (the SIMT kernels keep chunk x chunk fp32 scores in shared memory: chunk <= ",
                     kSimtMaxChunk, " within sm_90's 227 KB per block), and ", no_tc);
    }
  }
}

std::vector<DimDef> mlstm_dims(bool seq) {
  std::vector<DimDef> d = {{"batch", DimKind::Var, {}, "B"}, {"heads", DimKind::Var, {}, "NH"}};
  if (seq) d.push_back({"seqlen", DimKind::Var, {}, "S, any length >= 1", 1});
  d.push_back({"dhqk", DimKind::Const, {}, "DHQK, head dim of q and k: " + list(kHeadDims), 16, 512});
  d.push_back({"dhhv", DimKind::Const, {}, "DHHV, head dim of v and h: " + list(kHeadDims), 16, 512});
  return d;
}

// A sequence op's case (no params, states and outputs all given).
Case seq_case(const char* name, int64_t B, int64_t NH, int64_t S, int64_t dk, int64_t dv, bool large) {
  Case c;
  c.name = name;
  c.dims = {{"batch", B}, {"heads", NH}, {"seqlen", S}, {"dhqk", dk}, {"dhhv", dv}};
  c.large = large;
  return c;
}

// Every op's last case: the first one again with fp32 gates.
void add_fp32_gates(std::vector<Case>& cases) {
  Case f32g = cases.front();
  f32g.name = "gates_fp32";
  f32g.representative = false;
  f32g.tensor_dtypes = {{"i", DType::f32}, {"f", DType::f32}};
  cases.push_back(std::move(f32g));
}

bool named(const Case& c, const std::vector<std::string>& names) {
  return std::find(names.begin(), names.end(), c.name) != names.end();
}

// The chunkwise ops' shapes, both directions: `init` (the initial states) left out where a row says so,
// and after S_65 the op's `variants` (a name and the tensors it leaves out) on base's shape.
using Variants = std::vector<std::pair<const char*, std::vector<std::string>>>;
std::vector<Case> chunkwise_cases(const std::vector<std::string>& init, const Variants& variants,
                                  const std::vector<std::string>& representative) {
  struct Spec {
    const char* name;
    int64_t B, NH, S, dk, dv, chunk;
    bool init;
    bool large = false;
  };
  const std::vector<Spec> specs = {
      {"base", 2, 2, 100, 32, 32, 64, true},
      {"S_1", 2, 2, 1, 32, 32, 64, true},
      {"S_2", 2, 2, 2, 32, 32, 64, true},
      {"S_63", 1, 2, 63, 32, 32, 64, true},
      {"S_64", 1, 2, 64, 32, 32, 64, true},
      {"S_65", 1, 2, 65, 32, 32, 64, true},
      {"dh_16", 2, 2, 37, 16, 16, 16, true},
      {"dk_16_dv_32", 2, 2, 37, 16, 32, 16, true},
      {"chunk_32", 1, 2, 100, 32, 32, 32, true},
      {"chunk_128", 1, 2, 300, 32, 32, 128, true},
      {"dh_64", 1, 2, 130, 64, 64, 64, true},
      {"dk_128_dv_256", 1, 1, 70, 128, 256, 64, true},
      {"chunk_256", 1, 2, 300, 32, 32, 256, true},
      {"dk_128_dv_256_chunk_256", 1, 1, 300, 128, 256, 256, true},
      {"S_1000", 1, 2, 1000, 64, 64, 64, false, true},
      {"dk_256_dv_512", 1, 1, 200, 256, 512, 64, true, true},
  };
  constexpr size_t kVariantsAt = 6;  // after S_65
  std::vector<Case> cases;
  for (size_t j = 0; j < specs.size(); ++j) {
    if (j == kVariantsAt) {
      for (const auto& [name, without] : variants) {
        Case c = cases.front();
        c.name = name;
        c.without = without;
        cases.push_back(std::move(c));
      }
    }
    const Spec& s = specs[j];
    Case c = seq_case(s.name, s.B, s.NH, s.S, s.dk, s.dv, s.large);
    c.params = {{"chunk", s.chunk}};
    if (!s.init) c.without = init;
    // q, k, v (and with them the gates) in bf16 whatever the run's dtype: chunks over kSimtMaxChunk are
    // algo=tc's alone, which takes 16-bit inputs.
    if (s.chunk > kSimtMaxChunk) c.tensor_dtypes = {{"q", DType::bf16}};
    cases.push_back(std::move(c));
  }
  for (Case& c : cases) c.representative = named(c, representative);
  return cases;
}

}  // namespace

std::string list(const std::vector<int64_t>& set) {
  std::string s;
  for (int64_t v : set) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return s;
}

ParamDef eps_param() {
  ParamDef d{"eps", ParamType::Float, 1e-6, {}, "added to the normalizer", true};
  d.min = 0.0;
  return d;
}

ParamDef chunk_param() {
  ParamDef chunk{"chunk", ParamType::Int, kDefaultChunk, {}, "L, steps per chunk: " + list(kChunks) +
                                                          " (above " + std::to_string(kSimtMaxChunk) + ": algo=tc only)"};
  chunk.min = 1.0;
  chunk.max = 4096.0;
  return chunk;
}

// Threads per CTA (one CTA per sequence). Untuned: 256 as the default. The backward kernel spills at
// 512 threads (128 registers a thread; fp16, sm_90: 96 bytes), so its space stops at 256.
TuningSpace mlstm_tuning(bool bwd) {
  TuningSpace t;
  t.axes = {{"threads", bwd ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{128, 256, 512}}};
  t.valid = [](const Problem&, const Config&, std::string*) { return true; };
  t.heuristic = [](const Problem&) { return Config{{{"threads", 256}}}; };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  return t;
}

std::string tc_unsupported(const Problem& p) {
  const DType dt = p.dtype("q");
  if (dt != DType::f16 && dt != DType::bf16) return "algo=tc needs float16 or bfloat16 q, k, v";
  if (p.dim("dhqk") > 256) return "algo=tc keeps dhqk <= 256 (its Q and C tiles in shared memory)";
  if (p.align_bytes < 16) return "algo=tc copies 16-byte pieces: every pointer must be 16-byte aligned";
  return "";
}

std::string tc_wide_unsupported(const Problem& p) {
  if (mlstm_tc_wide_runs(static_cast<int>(p.dim("dhqk")), static_cast<int>(p.dim("dhhv")),
                         static_cast<int>(p.param_int("chunk"))))
    return "";
  return "algo=tc_wide scans 128 x 128 tiles of C: dhqk and dhhv >= 128 and chunk <= 128";
}

std::string tc_q128_unsupported(const Problem& p) {
  const int dk = static_cast<int>(p.dim("dhqk")), dv = static_cast<int>(p.dim("dhhv")),
            L = static_cast<int>(p.param_int("chunk"));
  if (!mlstm_tc_q128_runs(L)) return "algo=tc_q128 takes 128 query rows of a chunk: chunk 128 or 256";
  // Opt-in shared memory a block: 227 KB from sm_90 on, 163 KB on sm_80 (A100), 99 KB on sm_86/89.
  const int cc = jit::compute_capability(p.arch);
  const int limit = cc >= 90 ? 232448 : cc == 80 || cc == 87 ? 166912 : 101376;
  const int smem = mlstm_tc_out_smem_bytes(dk, dv, L, kMlstmTcWideRows);
  if (smem > limit)
    return "algo=tc_q128's output kernel needs " + std::to_string(smem) + " bytes of shared memory at dhqk = " +
           std::to_string(dk) + ", more than " + p.arch + "'s " + std::to_string(limit);
  return "";
}

namespace {

// algo=simt's limit: chunk <= kSimtMaxChunk.
bool simt_runs(const Problem& p, std::string* why) {
  if (p.param_int("chunk") <= kSimtMaxChunk) return true;
  if (why) *why = "algo=simt keeps chunk <= " + std::to_string(kSimtMaxChunk) + " (chunk x chunk fp32 scores in shared memory)";
  return false;
}

}  // namespace

// algo=tc wherever it runs (tools/bench/NOTES.md, "mlstm: the tensor-core forward"), else the SIMT kernel
// at 256 threads.
TuningSpace chunkwise_fwd_tuning() {
  TuningSpace t = mlstm_tuning();
  t.axes.insert(t.axes.begin(), {"algo", {kSimt, kTc, kTcWide, kTcQ128, kTcWideQ128, kTcPg}});
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (c.get("algo") == kSimt) return simt_runs(p, why);
    std::string no = tc_unsupported(p);
    if (no.empty() && c.get("threads") != 128) no = "algo=tc sets its own block sizes (named with threads=128)";
    const int64_t algo = c.get("algo");
    if (no.empty() && (algo == kTcWide || algo == kTcWideQ128)) no = tc_wide_unsupported(p);
    if (no.empty() && (algo == kTcQ128 || algo == kTcWideQ128)) no = tc_q128_unsupported(p);
    if (why) *why = no;
    return no.empty();
  };
  // algo=tc_wide_q128 at dhqk > 128 where it runs (H100, B=8, NH=8, S=4096, (256, 512), bf16, chunk 128: forward
  // 2.104 ms against tc's 2.467, mlstm_kernels' best 3.140; tools/bench/NOTES.md, session 8's last run); tc_pg
  // elsewhere: tc with the gates kernel on 16 warps a sequence, the same bits (run 25, 128x128: 0.353 ms against
  // tc's 0.373; tc_q128 0.412).
  t.heuristic = [](const Problem& p) {
    if (!tc_unsupported(p).empty()) return Config{{{"algo", kSimt}, {"threads", 256}}};
    const bool wide = p.dim("dhqk") > 128 && tc_wide_unsupported(p).empty() && tc_q128_unsupported(p).empty();
    return Config{{{"algo", wide ? kTcWideQ128 : kTcPg}, {"threads", 128}}};
  };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("algo") == kSimt ? c.get("threads") : 128; };
  return t;
}

TuningSpace chunkwise_bwd_tuning() {
  TuningSpace t = mlstm_tuning(true);
  t.axes.insert(t.axes.begin(), {"algo", {kSimt, kTc, kTcFused, kTcParts, kTcMerged, kTcStream, kTcWide, kTcOverlap,
                                          kTcWideOverlap, kTcWidePg}});
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (c.get("algo") == kSimt) return simt_runs(p, why);
    std::string no = tc_unsupported(p);
    if (no.empty() && c.get("threads") != 128) no = "algo=tc sets its own block sizes (named with threads=128)";
    if (no.empty() && c.get("algo") == kTcParts &&
        !mlstm_tc_dq_loops(static_cast<int>(p.dim("dhqk")), static_cast<int>(p.dim("dhhv"))))
      no = "algo=tc_parts differs from algo=tc only at dhqk <= 128 < dhhv (its dq and dk without the loops over "
           "dhhv's blocks)";
    if (no.empty() && c.get("algo") == kTcStream && !mlstm_tc_streams(static_cast<int>(p.dim("dhqk"))))
      no = "algo=tc_stream differs from algo=tc_merged only at dhqk > 128 (its dq and dk streaming dhhv's blocks)";
    if (no.empty() && (c.get("algo") == kTcWide || c.get("algo") == kTcWideOverlap || c.get("algo") == kTcWidePg))
      no = tc_wide_unsupported(p);
    if (no.empty() && (c.get("algo") == kTcOverlap || c.get("algo") == kTcWideOverlap) &&
        !mlstm_tc_overlap_runs(static_cast<int>(p.dim("dhqk")), static_cast<int>(p.dim("dhhv"))))
      no = "algo=tc_overlap prefetches into tiles of their own: dhqk and dhhv <= 128 (one column block)";
    if (why) *why = no;
    return no.empty();
  };
  // The tensor cores wherever they run (the SIMT pair took 263 ms for tc's 1.488 at B=8, NH=8, S=4096, DH=128):
  // algo=tc_merged, and tc_stream at dhqk > 128. H100, B=8, NH=8, S=4096, bf16, chunk 128, bwd ms (fwd+bwd,
  // against mlstm_kernels' xl_chunk): 128x128 tc 1.007, tc_merged 0.942 (1.41x); 128x256 tc 1.673, tc_merged
  // 1.465 (1.40x); 256x512 tc 8.141, tc_merged 7.066, tc_stream 4.963 (1.31x) (tools/bench/NOTES.md).
  // At dhqk > 128, tc_wide (tc_stream's kernels with the state scans on 128 x 128 tiles) where it runs: 256x512
  // fwd+bwd 6.913 ms with the forward's tc_wide_q128, against 7.380 with tc_stream (session 8's last run).
  // At 128x128, tc_wide too (run 25, S 4096: fwd+bwd 1.247 ms against tc_merged's 1.306, xl_chunk's best 1.636);
  // 128x256 keeps tc_merged (tc_wide not timed there).
  t.heuristic = [](const Problem& p) {
    if (!tc_unsupported(p).empty()) return Config{{{"algo", kSimt}, {"threads", 256}}};
    const bool stream = mlstm_tc_streams(static_cast<int>(p.dim("dhqk")));
    const bool square_128 = p.dim("dhqk") == 128 && p.dim("dhhv") == 128;
    if ((stream || square_128) && tc_wide_unsupported(p).empty()) return Config{{{"algo", kTcWide}, {"threads", 128}}};
    return Config{{{"algo", stream ? kTcStream : kTcMerged}, {"threads", 128}}};
  };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("algo") == kSimt ? c.get("threads") : 128; };
  return t;
}

// algo=split wherever its float4s may be used (tools/bench/NOTES.md, "mlstm.step as a bandwidth op"):
// slabs of 32 columns from 256 CTAs on, else of 16 from 128 CTAs on, else of 8 (B * NH = 8 at DH 128:
// 128 CTAs of 4 KB rather than 64 of 8 KB, so one step spreads over most of an H100's 132 SMs; a slab of
// 8 is a row's 32-byte sector), 256 threads or fewer where the head has fewer rows than a pass would
// cover. Slabs of 8 only from DHQK 32 on: below, a CTA would have fewer than 64 threads.
int64_t step_cols(const Problem& p) {
  const int64_t dv = p.dim("dhhv"), seqs = p.dim("batch") * p.dim("heads");
  if (dv >= 32 && seqs * (dv / 32) >= 256) return 32;
  return seqs * (dv / 16) >= 128 || p.dim("dhqk") < 32 ? 16 : 8;
}

TuningSpace step_tuning() {
  TuningSpace t;
  t.axes = {{"algo", {kStepBlock, kStepSplit, kStepHead, kStepCluster}},
            {"threads", {64, 128, 256, 512}},
            {"cols", {8, 16, 32, 64}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    std::string no;
    const int64_t threads = c.get("threads"), cols = c.get("cols"), dk = p.dim("dhqk"), dv = p.dim("dhhv");
    if (c.get("algo") == kStepBlock) {
      if (threads < 128) no = "algo=block runs 128 to 512 threads";
      else if (cols != 16) no = "algo=block has no column slabs (named with cols=16)";
    } else if (c.get("algo") == kStepHead) {
      // Head dims and threads are powers of two: a row's dhhv / 4 float4s on consecutive threads, threads * 4
      // / dhhv rows a pass.
      if (p.align_bytes < 16) no = "algo=head reads C in float4s: every pointer must be 16-byte aligned";
      else if (cols != 16) no = "algo=head has no column slabs (named with cols=16)";
      else if (threads < dk) no = "algo=head gives each element of n a thread: threads >= dhqk";
      else if (threads * 4 < dv) no = "algo=head puts a row of C on consecutive threads: threads * 4 >= dhhv";
      else if (threads * 4 / dv > dk) no = "algo=head covers threads * 4 / dhhv rows a pass, more than dhqk";
      else if (dk * dv / threads > 64) no = "algo=head holds dhqk * dhhv / threads > 64 floats of C a thread";
    } else {  // split, or cluster: the same slabs
      const std::string name = c.get("algo") == kStepCluster ? "algo=cluster" : "algo=split";
      if (c.get("algo") == kStepCluster && jit::compute_capability(p.arch) < 90)
        no = "algo=cluster needs thread-block clusters: sm_90 or newer, not " + p.arch;
      else if (p.align_bytes < 16)
        no = name + " reads C in float4s: every pointer must be 16-byte aligned";
      else if (cols > dv)
        no = name + "'s slab of cols=" + std::to_string(cols) + " is wider than dhhv=" + std::to_string(dv);
      else if (threads * 4 / cols > dk)
        no = name + " covers threads * 4 / cols rows a pass, more than dhqk=" + std::to_string(dk);
      else if (dk * cols / threads > 64)
        no = name + " holds dhqk * cols / threads > 64 floats of C a thread";
      else if (c.get("algo") == kStepCluster && dv / cols > kStepMaxCluster)
        no = "algo=cluster puts a sequence's dhhv / cols slabs in one cluster: at most " +
             std::to_string(kStepMaxCluster) + " (dhhv=" + std::to_string(dv) + ", cols=" + std::to_string(cols) + ")";
    }
    if (why) *why = no;
    return no.empty();
  };
  t.heuristic = [](const Problem& p) {
    if (p.align_bytes < 16) return Config{{{"algo", kStepBlock}, {"threads", 256}, {"cols", 16}}};
    const int64_t cols = step_cols(p);
    const int64_t threads = std::min<int64_t>(256, p.dim("dhqk") * cols / 4);
    return Config{{{"algo", kStepSplit}, {"threads", threads}, {"cols", cols}}};
  };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  return t;
}

// The parallel form is the chunkwise kernels from the states (0, 0, -inf) (see chunkwise_fwd.cuh): the
// chunk is then a tile size, free to tune, not a parameter. Untuned: 64 steps, 256 threads.
TuningSpace parallel_tuning(bool bwd) {
  TuningSpace t = mlstm_tuning(bwd);
  t.axes.push_back({"chunk", kSimtChunks});
  t.heuristic = [](const Problem&) { return Config{{{"threads", 256}, {"chunk", kDefaultChunk}}}; };
  return t;
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

// The backward's inputs after q, k, v, i, f: the forward's per-step constants, dh, and for the chunkwise
// form the entering C0, m0 (n0 is not needed: nrm is given) and dC_last.
std::vector<TensorDef> bwd_inputs(bool chunkwise) {
  std::vector<TensorDef> in = qkvif(kRows, kRows);
  if (chunkwise) {
    in.push_back(tensor_def("C0", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "the forward's initial memory (with m0; absent: zeros)"));
    in.push_back(tensor_def("m0", kM, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "the forward's initial stabilizer"));
  }
  in.push_back(tensor_def("nrm", kRows, {DType::f32}, "", false, false, "", Layout::Contiguous,
                          "the forward's nrm (a constant of the backward)"));
  in.push_back(tensor_def("m_rows", kRows, {DType::f32}, "", false, false, "", Layout::Contiguous,
                          "the forward's m per step (a constant of the backward)"));
  in.push_back(tensor_def("dh", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous,
                          "gradient of h"));
  if (chunkwise)
    in.push_back(tensor_def("dC_last", kC, {DType::f32}, "", false, true, "", Layout::Contiguous,
                            "gradient of C_last (absent: zero); reaches df, unlike mlstm_kernels"));
  return in;
}

std::vector<TensorDef> bwd_outputs(bool chunkwise) {
  std::vector<TensorDef> out = {
      tensor_def("dq", {"batch", "heads", "seqlen", "dhqk"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of q"),
      tensor_def("dk", {"batch", "heads", "seqlen", "dhqk"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of k"),
      tensor_def("dv", {"batch", "heads", "seqlen", "dhhv"}, {}, "q", false, false, "", Layout::Contiguous,
                 "gradient of v"),
      tensor_def("di", kRows, {}, "i", false, false, "", Layout::Contiguous, "gradient of i (i's dtype)"),
      tensor_def("df", kRows, {}, "i", false, false, "", Layout::Contiguous, "gradient of f (i's dtype)"),
  };
  if (chunkwise)
    out.push_back(tensor_def("dC0", kC, {DType::f32}, "", false, true, "C0", Layout::Contiguous,
                             "gradient of C0 (with C0; dn0 = dm0 = 0 with n, m constants)"));
  return out;
}

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
      // B = 1 at the model's head dims: algo=split's slabs of 16 columns, one to four passes
      {"B_1_dh_128", 1, 8, 128, 128, false}, {"B_1_dk_256_dv_64", 1, 3, 256, 64, false},
      {"model_B64_NH8_dh128", 64, 8, 128, 128, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"heads", s.NH}, {"dhqk", s.dk}, {"dhhv", s.dv}};
    c.large = s.large;
    c.representative = named(c, {"base", "dk_128_dv_256"});
    cases.push_back(std::move(c));
  }
  add_fp32_gates(cases);
  return cases;
}

std::vector<Case> chunkwise_fwd_cases() {
  const std::vector<std::string> init = {"C0", "n0", "m0"}, last = {"C_last", "n_last", "m_last"},
                                 rows = {"nrm", "m_rows"};
  std::vector<std::string> none = init;  // inference: no states in or out, no rows
  none.insert(none.end(), last.begin(), last.end());
  none.insert(none.end(), rows.begin(), rows.end());
  std::vector<Case> cases =
      chunkwise_cases(init, {{"no_init", init}, {"no_last", last}, {"inference", none}},
                      {"base", "dk_128_dv_256", "inference"});
  Case s4096 = seq_case("S_4096", 1, 1, 4096, 64, 64, true);
  s4096.params = {{"chunk", 128}};
  s4096.without = none;
  cases.push_back(std::move(s4096));
  add_fp32_gates(cases);
  return cases;
}

std::vector<Case> chunkwise_bwd_cases() {
  const std::vector<std::string> init = {"C0", "m0"};
  std::vector<Case> cases =
      chunkwise_cases(init, {{"no_init", init}, {"no_dC_last", {"dC_last"}}, {"no_states", {"C0", "m0", "dC_last"}}},
                      {"base", "dk_128_dv_256", "no_states"});
  add_fp32_gates(cases);
  return cases;
}

std::vector<Case> parallel_cases(bool bwd) {
  std::vector<Case> cases = {
      seq_case("base", 2, 2, 100, 32, 32, false),          seq_case("S_1", 2, 2, 1, 32, 32, false),
      seq_case("S_2", 2, 2, 2, 32, 32, false),             seq_case("S_63", 1, 2, 63, 32, 32, false),
      seq_case("S_64", 1, 2, 64, 32, 32, false),           seq_case("S_65", 1, 2, 65, 32, 32, false),
      seq_case("dh_16", 2, 2, 37, 16, 16, false),          seq_case("dk_16_dv_32", 2, 2, 37, 16, 32, false),
      seq_case("dh_64", 1, 2, 130, 64, 64, false),         seq_case("dk_128_dv_256", 1, 1, 70, 128, 256, false),
      seq_case("S_1000", 1, 2, 1000, 64, 64, true),        seq_case("dk_256_dv_512", 1, 1, 200, 256, 512, true),
  };
  for (Case& c : cases) {
    if (!bwd && c.name == "dh_64") c.without = {"nrm", "m_rows"};
    c.representative = c.name == "base";  // 8 or 12 configs: precompile builds them for one shape
  }
  add_fp32_gates(cases);
  return cases;
}

}  // namespace kspec::mlstm
