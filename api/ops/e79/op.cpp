// e79: the coupled memory-modulation matrix RNN cell (E79) on projected inputs: e79.fwd (outputs, final
// states, checkpoints every `chunk` steps) and e79.bwd (every gradient, recomputing each segment once
// from its checkpoint). Schema, specializations, tuning space, launchers, float64 references and the
// case table; kernels in templates/e79/e79.cuh (one CTA per sequence) and e79_cluster.cuh (one
// thread-block cluster per sequence, sm_90+), the recurrence in api/ops/e79/reference.h. The
// projections (x @ W_kvqm^T, fused with W_bs, W_bm in input-bias mode) are the gemm op's, called by
// the Python layer (kspec.ops.e79) and by the C++ GPU tests.
#include <algorithm>

#include "api/src/op.h"
#include "e79/reference.h"
#include "jit/spec.h"
#include "templates/e79/params.h"

namespace kspec {
namespace {

constexpr const char* kHeader = "e79/e79.cuh";
constexpr const char* kClusterHeader = "e79/e79_cluster.cuh";
const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
constexpr int64_t kMinN = 8, kMaxN = 128;
constexpr int kDefaultChunk = 16;

// Bias modes, as the kernels number them (kE79Bias*): given by the tensors b_s, b_m — absent (none),
// [n] (fixed, the alternative shape) or [seqlen, batch, n] (input).
int bias_mode(const Problem& p) {
  if (!p.present("b_s")) return ref::kE79BiasNone;
  return p.alt("b_s") ? ref::kE79BiasFixed : ref::kE79BiasInput;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned u32(int64_t v) { return static_cast<unsigned>(v); }

// The launch of a config: CTAs per sequence, threads per CTA, shared memory per CTA. One CTA
// (E79Traits): S and M padded to n + 1 floats a row, then 15 (forward) or 48 (backward) vectors of n
// floats. A cluster (E79ClusterTraits): each CTA's n / cluster rows of S and M padded to
// n + ((split - n) mod 32) floats, the same vectors, and per exchanged vector (1 in the forward, 2 in
// the backward) a staging area of split / cluster x n floats and two exchange buffers of
// (cluster + 1) x n floats.
struct Shape {
  int64_t cluster, threads, fwd_smem_bytes, bwd_smem_bytes;
};

Shape launch_shape(int64_t n, const Config& c) {
  const int64_t split = c.get("split"), cluster = c.get("cluster");
  if (cluster == 1) return {1, n * split, 4 * (2 * n * (n + 1) + 15 * n), 4 * (2 * n * (n + 1) + 48 * n)};
  const int64_t ld = n + ((split % 32 - n % 32) + 32) % 32, mat = (n / cluster) * ld;
  const int64_t xvec = (split / cluster + 2 * (cluster + 1)) * n;  // staging + two buffers, per vector
  return {cluster, n * split / cluster, 4 * (2 * mat + 15 * n + xvec), 4 * (2 * mat + 48 * n + 2 * xvec)};
}

// Backward workspace per sequence (floats; E79Traits::kWsPerSeq, E79ClusterTraits::kWsPerSeq: one
// copy of the step records per CTA).
int64_t bwd_ws_floats(int64_t n, int64_t chunk, int64_t cluster) {
  return (chunk + 1) * 2 * n * n + cluster * chunk * 11 * n + 2 * n * n;
}

void check_e79(const Problem& p) {
  const std::string& op = p.op->info.name;
  int64_t n = p.dim("n");
  KSPEC_CHECK_AS(n >= kMinN && n <= kMaxN && n % 8 == 0, Unsupported, op, ": input 'k': n = ", n,
                 " is not supported (a multiple of 8 in ", kMinN, "..", kMaxN, ")");
  KSPEC_CHECK(p.present("b_s") == p.present("b_m"), op, ": inputs 'b_s' and 'b_m' must be given together (",
              p.present("b_s") ? "b_m" : "b_s", " is missing)");
  if (p.present("b_s")) {
    KSPEC_CHECK(p.alt("b_s") == p.alt("b_m"), op, ": inputs 'b_s' and 'b_m' must both be [n] (fixed biases) or both "
                "[seqlen, batch, n] (per-step biases)");
    KSPEC_CHECK(p.dtype("b_s") == p.dtype("b_m"), op, ": input 'b_m': expected the dtype of 'b_s' (",
                dtype_name(p.dtype("b_s")), "), got ", dtype_name(p.dtype("b_m")));
  }
}

const std::vector<std::string> kTBN = {"seqlen", "batch", "n"};
const std::vector<std::string> kState = {"batch", "n", "n"};
const std::vector<std::string> kChk = {"batch", "nchk", "2", "n", "n"};

// k, v, q, m, b_s, b_m, S0, M0. `like`: the tensor whose dtype they take ("" for k itself: any float).
std::vector<TensorDef> cell_inputs(const std::string& like) {
  auto seq = [&](const char* name, const std::string& of, const char* doc) {
    return tensor_def(name, kTBN, of.empty() ? kFloatTypes : std::vector<DType>{}, of, false, false, "", Layout::Strided,
                  doc);
  };
  return {
      seq("k", like, "key (unnormalized); any strides with unit stride along n (e.g. a column block of x @ W_kvqm^T)"),
      seq("v", like.empty() ? "k" : like, "value"),
      seq("q", like.empty() ? "k" : like, "query"),
      seq("m", like.empty() ? "k" : like, "modulation key (unnormalized)"),
      tensor_def("b_s", kTBN, {}, "k", true, true, "", Layout::Strided,
             "gate bias of S: [n] fixed, or [seqlen, batch, n] per step (input bias); absent: none", {"n"}),
      tensor_def("b_m", kTBN, {}, "k", true, true, "", Layout::Strided, "gate bias of M, like b_s", {"n"}),
      tensor_def("S0", kState, {DType::f32}, "", false, true, "", Layout::Contiguous, "initial content memory (zeros)"),
      tensor_def("M0", kState, {DType::f32}, "", false, true, "", Layout::Contiguous, "initial modulation memory (zeros)"),
  };
}

std::vector<ParamDef> e79_params() {
  return {{"chunk", ParamType::Int, int64_t(kDefaultChunk), {},
           "K: the forward saves (S, M) every K steps; the backward recomputes each K-step segment once (memory: "
           "8 n^2 / K bytes per token and sequence)",
           false, 1.0, 1024.0}};
}

std::vector<DimDef> e79_dims() {
  return {{"seqlen", DimKind::Var, {}, "T, time steps"},
          {"batch", DimKind::Var, {}, "B, sequences (one thread block, or one cluster of them, each)"},
          {"n", DimKind::Const, {}, "state size (S, M are n x n), a template argument: 8..128, a multiple of 8"},
          {"nchk", DimKind::Var, {}, "checkpoints: ceil(seqlen / chunk)"}};
}

// ---- strided [seqlen, batch, n] tensors ----

// The kernels' E79Seq<X> (templates/e79/params.h): element (t, b, i) at p[t * st + b * sb + i].
E79SeqArg seq_arg(const TensorView& t) {
  if (!t.defined()) return {nullptr, 0, 0};
  if (t.rank == 1) return {t.data, 0, 0};  // a fixed bias [n], the same row for every (t, b)
  return {t.data, t.strides[0], t.strides[1]};
}

// A [seqlen, batch, n] view (or a fixed bias [n]) the kernels can index: unit stride along n, and for
// outputs no two (t, b) rows overlapping.
void check_seq(const std::string& op, const char* kind, const std::string& name, const TensorView& t, bool output) {
  if (!t.defined() || t.numel() == 0) return;
  int last = t.rank - 1;
  KSPEC_CHECK(t.strides[last] == 1, op, ": ", kind, " '", name, "': expected unit stride along n, got ", t.describe());
  if (t.rank == 1) return;
  for (int d = 0; d < 2; ++d)
    KSPEC_CHECK(t.strides[d] >= 0 || t.shape[d] == 1, op, ": ", kind, " '", name, "': negative strides are not "
                "supported (", t.describe(), ")");
  if (!output) return;
  // Rows (t, b) must not overlap: sorted by stride, each stride spans the dims inside it.
  int64_t n = t.shape[2];
  std::pair<int64_t, int64_t> dims[2] = {{t.shape[0] > 1 ? t.strides[0] : 0, t.shape[0]},
                                         {t.shape[1] > 1 ? t.strides[1] : 0, t.shape[1]}};
  if (dims[0].first > dims[1].first) std::swap(dims[0], dims[1]);
  int64_t span = n;
  for (const auto& [stride, size] : dims) {
    if (size <= 1) continue;
    KSPEC_CHECK(stride >= span, op, ": ", kind, " '", name, "': its rows overlap (", t.describe(),
                "); outputs need distinct memory for every (t, b)");
    span = stride * size;
  }
}

void check_e79_call(const Call& call) {
  const Problem& p = call.problem;
  const std::string& op = p.op->info.name;
  KSPEC_CHECK(p.dim("seqlen") >= 1 && p.dim("seqlen") <= INT32_MAX, op, ": input 'k': seqlen = ", p.dim("seqlen"),
              " must be in 1..", INT32_MAX);
  KSPEC_CHECK(p.dim("batch") <= INT32_MAX, op, ": input 'k': batch = ", p.dim("batch"), " is too large");
  const auto& info = p.op->info;
  for (size_t i = 0; i < info.inputs.size(); ++i)
    if (info.inputs[i].layout == Layout::Strided) check_seq(op, "input", info.inputs[i].name, call.inputs[i], false);
  for (size_t i = 0; i < info.outputs.size(); ++i)
    if (info.outputs[i].layout == Layout::Strided) check_seq(op, "output", info.outputs[i].name, call.outputs[i], true);
  if (p.has_dim("nchk")) {
    int64_t want = ceil_div(p.dim("seqlen"), p.param_int("chunk"));
    KSPEC_CHECK(p.dim("nchk") == want, op, ": 'checkpoints': expected ", want, " checkpoints (ceil(seqlen / chunk) = "
                "ceil(", p.dim("seqlen"), " / ", p.param_int("chunk"), ")), got ", p.dim("nchk"));
  }
}

// ---- specializations ----

bool clustered(const Config& c) { return c.get("cluster") > 1; }

std::string traits(const Problem& p, const Config& c) {
  std::string s = clustered(c) ? "kspec::E79ClusterTraits<" : "kspec::E79Traits<";
  s += dtype_cuda_type(p.dtype("k"));
  s += ", ";
  s += p.present("b_s") ? dtype_cuda_type(p.dtype("b_s")) : "float";
  s += ", " + std::to_string(p.dim("n")) + ", " + std::to_string(c.get("split")) + ", " +
       std::to_string(bias_mode(p)) + ", " + std::to_string(p.param_int("chunk"));
  if (clustered(c)) s += ", " + std::to_string(c.get("cluster"));
  return s + ">";
}

// split: lanes per row (n * split threads, or n * split / cluster per CTA of a cluster). The products
// are n multiply-adds per row and vector, so n * split near 512 threads keeps every SM sub-partition
// busy with one block. cluster: CTAs per sequence (e79_cluster.cuh), for batches below the SM count.
// Measured on the H100 (tools/bench/bench_e79.py, bf16, T 4096, fwd+bwd against one CTA per sequence):
//   n 128: cluster 4 (split 16) 3.46x at B 1, 3.20x at B 16; cluster 8 (split 32) 4.27x at B 1, 2.10x at B 16
//   n 64:  cluster 4 (split 32) 1.44x at B 1, 1.40x at B 16; cluster 8 1.51x at B 1, 0.86x at B 16
//   n 32:  every cluster loses (0.67-0.71x): the cluster barriers outweigh the work split.
// So the heuristic takes cluster 4 for n in {64, 96, 128} and batch <= 16 on sm_90+, else one CTA per
// sequence.
bool small_batch_cluster(const Problem& p) {
  return jit::compute_capability(p.arch) >= 90 && p.dim("n") >= 64 && p.dim("n") % 32 == 0 && p.dim("batch") <= 16;
}

// The heuristic depends on the (runtime) batch: plans for small and large batches are kept apart.
std::string e79_key(const Problem& p) { return small_batch_cluster(p) ? "cluster4" : ""; }

TuningSpace e79_tuning() {
  TuningSpace t;
  t.axes = {{"split", {1, 2, 4, 8, 16, 32}}, {"cluster", {1, 2, 4, 8}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    const int64_t n = p.dim("n"), s = c.get("split"), cl = c.get("cluster");
    auto no = [&](const char* reason) {
      if (why) *why = reason;
      return false;
    };
    if (cl > 1) {
      if (jit::compute_capability(p.arch) < 90) return no("thread-block clusters need sm_90 or newer");
      if (n % cl != 0) return no("n must be a multiple of cluster (each CTA owns n / cluster rows)");
      if (s < cl) return no("split must be at least cluster (each CTA sums a column in split / cluster parts)");
    }
    const int64_t threads = n * s / cl;
    if (threads % 32 != 0 || threads > 512)
      return no("n * split / cluster must be a multiple of 32 and at most 512 threads (the backward needs ~128 "
                "registers)");
    if (s > n) return no("more lanes per row than columns");
    return true;
  };
  t.heuristic = [](const Problem& p) {
    const int64_t n = p.dim("n"), cl = small_batch_cluster(p) ? 4 : 1;
    int64_t s = 32;
    while (s > cl && (n * s / cl > 512 || s > n)) s /= 2;
    while ((n * s / cl) % 32 != 0) s *= 2;
    return Config{{{"split", s}, {"cluster", cl}}};
  };
  t.block_threads = [](const Problem& p, const Config& c) { return launch_shape(p.dim("n"), c).threads; };
  return t;
}

// ---- references (float64) ----

ref::E79Shape shape_of_problem(const Problem& p) {
  ref::E79Shape s;
  s.T = p.dim("seqlen");
  s.B = p.dim("batch");
  s.n = p.dim("n");
  s.bias_mode = bias_mode(p);
  return s;
}

std::vector<double> or_empty(const HostTensor& h) { return h.defined ? h.data : std::vector<double>{}; }

// in: k, v, q, m, b_s, b_m, S0, M0 starting at `first`.
ref::E79Inputs inputs_of(const std::vector<HostTensor>& in, size_t first) {
  ref::E79Inputs r;
  r.k = in[first].data;
  r.v = in[first + 1].data;
  r.q = in[first + 2].data;
  r.m = in[first + 3].data;
  r.b_s = or_empty(in[first + 4]);
  r.b_m = or_empty(in[first + 5]);
  r.S0 = or_empty(in[first + 6]);
  r.M0 = or_empty(in[first + 7]);
  return r;
}

// The states before steps 0, chunk, 2 chunk, ...: [B, nchk, 2, n, n], by running the reference
// segment by segment.
std::vector<double> checkpoints_ref(const ref::E79Shape& s, const ref::E79Inputs& in, int64_t chunk) {
  const int64_t n = s.n, nn = n * n, bn = s.B * n, nchk = ceil_div(s.T, chunk);
  std::vector<double> chk(static_cast<size_t>(s.B * nchk * 2 * nn));
  std::vector<double> S = in.S0.empty() ? std::vector<double>(s.B * nn, 0.0) : in.S0;
  std::vector<double> M = in.M0.empty() ? std::vector<double>(s.B * nn, 0.0) : in.M0;
  for (int64_t c = 0; c < nchk; ++c) {
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t i = 0; i < nn; ++i) {
        chk[((b * nchk + c) * 2) * nn + i] = S[b * nn + i];
        chk[((b * nchk + c) * 2 + 1) * nn + i] = M[b * nn + i];
      }
    if (c + 1 == nchk) break;
    const int64_t t0 = c * chunk, t1 = t0 + chunk;
    auto slice = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + t0 * bn, v.begin() + t1 * bn);
    };
    ref::E79Shape seg = s;
    seg.T = chunk;
    ref::E79Inputs part;
    part.k = slice(in.k);
    part.v = slice(in.v);
    part.q = slice(in.q);
    part.m = slice(in.m);
    part.b_s = s.bias_mode == ref::kE79BiasInput ? slice(in.b_s) : in.b_s;
    part.b_m = s.bias_mode == ref::kE79BiasInput ? slice(in.b_m) : in.b_m;
    part.S0 = S;
    part.M0 = M;
    auto r = ref::e79_fwd_ref(seg, part);
    S = std::move(r.S);
    M = std::move(r.M);
  }
  return chk;
}

std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  ref::E79Shape s = shape_of_problem(p);
  ref::E79Inputs ri = inputs_of(in, 0);
  auto r = ref::e79_fwd_ref(s, ri);
  std::vector<HostTensor> out(4);
  out[0] = {true, in[0].shape, std::move(r.out)};
  out[1] = {true, {s.B, s.n, s.n}, std::move(r.S)};
  out[2] = {true, {s.B, s.n, s.n}, std::move(r.M)};
  if (p.present("checkpoints")) {
    int64_t chunk = p.param_int("chunk");
    out[3] = {true, {s.B, ceil_div(s.T, chunk), 2, s.n, s.n}, checkpoints_ref(s, ri, chunk)};
  }
  return out;
}

// bwd inputs: dout, k, v, q, m, b_s, b_m, S0, M0, checkpoints, dS, dM.
std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  ref::E79Shape s = shape_of_problem(p);
  const std::vector<double>* dS = in[10].defined ? &in[10].data : nullptr;
  const std::vector<double>* dM = in[11].defined ? &in[11].data : nullptr;
  auto g = ref::e79_bwd_ref(s, inputs_of(in, 1), in[0].data, dS, dM);
  std::vector<HostTensor> out(8);
  out[0] = {true, in[1].shape, std::move(g.dk)};
  out[1] = {true, in[1].shape, std::move(g.dv)};
  out[2] = {true, in[1].shape, std::move(g.dq)};
  out[3] = {true, in[1].shape, std::move(g.dm)};
  if (in[5].defined) {
    out[4] = {true, in[5].shape, std::move(g.db_s)};
    out[5] = {true, in[6].shape, std::move(g.db_m)};
  }
  if (in[7].defined) out[6] = {true, in[7].shape, std::move(g.dS0)};
  if (in[8].defined) out[7] = {true, in[8].shape, std::move(g.dM0)};
  return out;
}

// The checkpoints a forward would have written, so the backward's inputs are consistent.
void bwd_prepare(const Problem& p, std::vector<HostTensor>& in) {
  in[9].data = checkpoints_ref(shape_of_problem(p), inputs_of(in, 1), p.param_int("chunk"));
}

// ---- cases ----

struct CaseSpec {
  const char* name;
  int64_t T, B, n, chunk;
  const char* bias;  // none, fixed, input
  bool init, dfinal;
  bool large = false;
};

std::vector<Case> e79_cases(bool bwd) {
  const std::vector<CaseSpec> specs = {
      {"base", 37, 3, 32, 16, "fixed", true, true},
      {"T_1_B_1", 1, 1, 32, 16, "fixed", true, true},
      {"T_2_B_1", 2, 1, 32, 16, "fixed", true, true},
      {"T_eq_K", 16, 2, 32, 16, "fixed", true, true},
      {"T_K_plus_1", 17, 2, 32, 16, "fixed", true, true},
      {"T_not_multiple_of_K", 45, 2, 32, 8, "input", true, true},
      {"B_33", 9, 33, 16, 4, "fixed", true, true},
      {"n_8", 23, 2, 8, 8, "fixed", true, true},
      {"n_16", 23, 2, 16, 8, "input", true, true},
      {"n_48", 21, 2, 48, 8, "fixed", true, true},
      {"n_64", 21, 2, 64, 8, "input", true, true},
      {"n_96", 13, 2, 96, 8, "fixed", true, true},
      {"n_128", 13, 2, 128, 8, "none", true, true},
      {"n_128_input", 9, 1, 128, 4, "input", true, true},
      {"bias_none", 37, 3, 32, 16, "none", true, true},
      {"bias_input", 37, 3, 32, 16, "input", true, true},
      {"no_init", 37, 3, 32, 16, "fixed", false, true},
      {"no_dfinal", 37, 3, 32, 16, "input", true, false},
      {"nothing_optional", 20, 2, 32, 16, "none", false, false},
      {"chunk_1", 7, 2, 32, 1, "fixed", true, true},
      {"chunk_5", 23, 2, 32, 5, "input", true, true},
      // B = 1, where the cluster configs matter: Gpu.EveryTuningConfigMatchesReference and
      // tools/gpu/check_configs.py run every config on these.
      {"B_1_n_8", 23, 1, 8, 8, "fixed", true, true},
      {"B_1_n_128", 13, 1, 128, 8, "input", true, true},
      {"B_1_n_64_T_not_multiple_of_K", 45, 1, 64, 8, "fixed", true, true},
      {"long_1024", 1024, 2, 64, 32, "fixed", true, true, true},
      {"model_16x512_n64", 512, 16, 64, 32, "fixed", false, false, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"seqlen", s.T}, {"batch", s.B}, {"n", s.n}, {"nchk", ceil_div(s.T, s.chunk)}};
    c.params = {{"chunk", s.chunk}};
    std::string bias = s.bias;
    if (bias == "none") c.without = {"b_s", "b_m"};
    if (bias == "fixed") c.alt_shapes = {"b_s", "b_m"};
    if (!s.init) c.without.insert(c.without.end(), {"S0", "M0"});
    if (bwd && !s.dfinal) c.without.insert(c.without.end(), {"dS", "dM"});
    c.large = s.large;
    // precompile --all: every config of the three bias modes at n 32, and the extreme state sizes.
    c.representative = c.name == "base" || c.name == "bias_none" || c.name == "bias_input" || c.name == "n_8" ||
                       c.name == "n_128";
    cases.push_back(std::move(c));
  }
  if (!bwd) {  // inference: no checkpoints
    Case c = cases.front();
    c.name = "no_checkpoints";
    c.without.push_back("checkpoints");
    c.representative = false;
    cases.push_back(std::move(c));
  }
  // fp32 biases beside 16-bit activations (model parameters kept in fp32).
  Case f32b = cases.front();
  f32b.name = "bias_fp32";
  f32b.representative = false;
  f32b.tensor_dtypes = {{"b_s", DType::f32}, {"b_m", DType::f32}};
  cases.push_back(std::move(f32b));
  return cases;
}

OpDef e79_base(const char* name, const char* doc, bool bwd) {
  OpDef op;
  op.info.name = name;
  op.info.family = "e79";
  op.info.doc = doc;
  op.info.params = e79_params();
  op.info.dims = e79_dims();
  op.info.reference = "api/ops/e79/reference.cpp (python/kspec/reference/e79.py)";
  op.check = check_e79;
  op.check_call = check_e79_call;
  op.tuning = e79_tuning();
  op.derived_key = e79_key;
  op.info.tuning_axes = op.tuning.axes;
  op.cases = e79_cases(bwd);
  op.compile_dims = {{"seqlen", 1}, {"batch", 1}};
  op.derived_dims = {{"nchk", [](const Problem& p) { return ceil_div(p.dim("seqlen"), std::max<int64_t>(p.param_int("chunk"), 1)); }}};
  op.dtypes = kFloatTypes;
  // fp32 over recurrences of up to 1024 steps through two coupled n x n states (sigmoid gates,
  // normalizations): errors grow with T; 4e-5 relative.
  op.tolerance_scale = 4.0;
  return op;
}

// The parameters both directions read: k, v, q, m, the biases, the initial states, T and the checkpoint
// count; the rest null until the launch fills it.
E79Params cell_params(const Call& call, int T, int nchk) {
  E79Params prm{};
  prm.k = seq_arg(call.in("k"));
  prm.v = seq_arg(call.in("v"));
  prm.q = seq_arg(call.in("q"));
  prm.m = seq_arg(call.in("m"));
  prm.b_s = seq_arg(call.in("b_s"));
  prm.b_m = seq_arg(call.in("b_m"));
  prm.S0 = static_cast<const float*>(call.in("S0").data);
  prm.M0 = static_cast<const float*>(call.in("M0").data);
  prm.T = T;
  prm.nchk = nchk;
  return prm;
}

// The kernel `name` of e79.cuh, or its cluster twin name + "_cluster" of e79_cluster.cuh.
jit::KernelSpec spec(const Problem& p, const Config& c, const std::string& name, std::vector<std::string> targs) {
  if (clustered(c)) return kernel_spec(p, kClusterHeader, name + "_cluster_kernel", std::move(targs));
  return kernel_spec(p, kHeader, name + "_kernel", std::move(targs));
}

// ---- forward ----

OpDef make_fwd() {
  OpDef op = e79_base("e79.fwd",
                      "E79 cell on projected k, v, q, m [seqlen, batch, n]: out = Sq * silu(Sq) per step, the final "
                      "S and M, and (for the backward) (S, M) every `chunk` steps",
                      false);
  op.info.inputs = cell_inputs("");
  op.info.outputs = {
      tensor_def("out", kTBN, {}, "k", false, false, "", Layout::Strided, "output; any strides with unit stride along n"),
      tensor_def("S", kState, {DType::f32}, "", false, false, "", Layout::Contiguous, "content memory after the last step"),
      tensor_def("M", kState, {DType::f32}, "", false, false, "", Layout::Contiguous, "modulation memory after the last step"),
      tensor_def("checkpoints", kChk, {DType::f32}, "", false, true, "", Layout::Contiguous,
             "(S, M) before steps 0, chunk, 2 chunk, ... (for e79.bwd); leave out for inference"),
  };
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{
        spec(p, c, "kspec::e79_fwd", {traits(p, c), p.present("checkpoints") ? "true" : "false"})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    int64_t n = p.dim("n");
    int T = static_cast<int>(p.dim("seqlen"));
    int nchk = static_cast<int>(ceil_div(T, p.param_int("chunk")));
    E79Params prm = cell_params(call, T, nchk);
    prm.out = seq_arg(call.out("out"));
    prm.S = static_cast<float*>(call.out("S").data);
    prm.M = static_cast<float*>(call.out("M").data);
    prm.checkpoints = static_cast<float*>(call.out("checkpoints").data);
    void* args[] = {&prm};
    const Shape sh = launch_shape(n, c);
    if (sh.cluster == 1)
      l.launch(0, {u32(p.dim("batch"))}, {u32(sh.threads)}, u32(sh.fwd_smem_bytes), args);
    else
      l.launch_clusters(0, {u32(p.dim("batch") * sh.cluster)}, {u32(sh.threads)}, {u32(sh.cluster)},
                        u32(sh.fwd_smem_bytes), args);
  };
  op.reference = fwd_reference;
  return op;
}

// ---- backward ----

OpDef make_bwd() {
  OpDef op = e79_base("e79.bwd",
                      "gradients of e79.fwd (and of its final S, M given dS, dM) from its checkpoints: dk, dv, dq, dm, "
                      "db_s/db_m (fixed: summed over time and batch, deterministically; input: per step), dS0, dM0",
                      true);
  auto inputs = cell_inputs("dout");
  inputs.insert(inputs.begin(), tensor_def("dout", kTBN, kFloatTypes, "", false, false, "", Layout::Strided,
                                       "gradient of out; any strides with unit stride along n"));
  inputs.push_back(tensor_def("checkpoints", kChk, {DType::f32}, "", false, false, "", Layout::Contiguous,
                          "e79.fwd's checkpoints (same chunk)"));
  inputs.push_back(tensor_def("dS", kState, {DType::f32}, "", false, true, "", Layout::Contiguous,
                          "gradient of the final S (else zero)"));
  inputs.push_back(tensor_def("dM", kState, {DType::f32}, "", false, true, "", Layout::Contiguous,
                          "gradient of the final M (else zero)"));
  op.info.inputs = inputs;
  auto grad = [](const char* name, const char* of) {
    return tensor_def(name, kTBN, {}, of, false, false, "", Layout::Strided,
                  std::string("gradient of ") + of + "; any strides with unit stride along n (e.g. a column block of "
                  "one [seqlen, batch, 4n] gradient)");
  };
  op.info.outputs = {
      grad("dk", "k"),
      grad("dv", "v"),
      grad("dq", "q"),
      grad("dm", "m"),
      tensor_def("db_s", kTBN, {}, "b_s", false, false, "b_s", Layout::Strided, "gradient of b_s (its shape)", {"n"}),
      tensor_def("db_m", kTBN, {}, "b_m", false, false, "b_m", Layout::Strided, "gradient of b_m (its shape)", {"n"}),
      tensor_def("dS0", kState, {DType::f32}, "", false, false, "S0", Layout::Contiguous, "gradient of S0"),
      tensor_def("dM0", kState, {DType::f32}, "", false, false, "M0", Layout::Contiguous, "gradient of M0"),
  };
  op.kernels = [](const Problem& p, const Config& c) {
    std::vector<jit::KernelSpec> ks = {spec(p, c, "kspec::e79_bwd", {traits(p, c)})};
    if (bias_mode(p) == ref::kE79BiasFixed)
      ks.push_back(kernel_spec(p, kHeader, "kspec::e79_bias_reduce_kernel",
                               {dtype_cuda_type(p.dtype("b_s")), std::to_string(p.dim("n"))}));
    return ks;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    int64_t n = p.dim("n"), B = p.dim("batch"), chunk = p.param_int("chunk");
    int T = static_cast<int>(p.dim("seqlen"));
    int nchk = static_cast<int>(ceil_div(T, chunk));
    bool fixed = bias_mode(p) == ref::kE79BiasFixed;
    if (B == 0) return;
    const Shape sh = launch_shape(n, c);
    int64_t per_seq = bwd_ws_floats(n, chunk, sh.cluster);
    auto* ws = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(B * per_seq + 2 * B * n)));
    float* partial = ws + B * per_seq;
    E79Params prm = cell_params(call, T, nchk);
    prm.checkpoints = static_cast<float*>(call.in("checkpoints").data);
    prm.dout = seq_arg(call.in("dout"));
    prm.dk = seq_arg(call.out("dk"));
    prm.dv = seq_arg(call.out("dv"));
    prm.dq = seq_arg(call.out("dq"));
    prm.dm = seq_arg(call.out("dm"));
    if (bias_mode(p) == ref::kE79BiasInput) {
      prm.db_s = seq_arg(call.out("db_s"));
      prm.db_m = seq_arg(call.out("db_m"));
    }
    prm.dS = static_cast<const float*>(call.in("dS").data);
    prm.dM = static_cast<const float*>(call.in("dM").data);
    prm.dS0 = static_cast<float*>(call.out("dS0").data);
    prm.dM0 = static_cast<float*>(call.out("dM0").data);
    prm.bias_partial = partial;
    prm.ws = ws;
    prm.batch = static_cast<int>(B);
    void* args[] = {&prm};
    if (sh.cluster == 1)
      l.launch(0, {u32(B)}, {u32(sh.threads)}, u32(sh.bwd_smem_bytes), args);
    else
      l.launch_clusters(0, {u32(B * sh.cluster)}, {u32(sh.threads)}, {u32(sh.cluster)}, u32(sh.bwd_smem_bytes),
                        args);
    if (fixed) {
      prm.db_s_sum = call.out("db_s").data;
      prm.db_m_sum = call.out("db_m").data;
      l.launch(1, {1}, {256}, 0, args);
    }
  };
  op.reference = bwd_reference;
  op.prepare_inputs = bwd_prepare;
  return op;
}

}  // namespace

void register_e79(Registry& r) {
  r.add(make_fwd());
  r.add(make_bwd());
}

}  // namespace kspec
