// norm_act: y = act(norm(x) * weight + bias) over the last dim, norm ∈ {layernorm, rmsnorm},
// act ∈ {none, silu, gelu_tanh, gelu_erf} (ops/common/activations.h); statistics in fp32. Forward and backward ops, their
// schema, specializations, tuning space, launchers, float64 references and case table.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "api/src/op.h"
#include "common/activations.h"
#include "norm_act/reference.h"
#include "templates/norm_act/params.h"

namespace kspec {
namespace {

constexpr const char* kHeader = "norm_act/norm_act.cuh";
const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
const std::vector<std::string> kNorms = {"layernorm", "rmsnorm"};
const std::vector<std::string> kActs = {"none", "silu", "gelu_tanh", "gelu_erf"};  // the kernels' act codes
// Elements per thread (vector width x vectors) bound the registers: the backward holds x, dy and the
// dweight/dbias partials for each. Under __launch_bounds__ ptxas (sm_90a, NVRTC 13.0) fit the backward
// in 64 registers at 8 elements, 95-128 at 16 and 167-220 at 32 without spilling; a block of n threads
// may use at most min(255, 65536/n) each. `kspec precompile --all` checks every config for spills.
constexpr int64_t kMaxElemsPerThread = 32;
// Rows at least this long may be streamed (one block per row, walked in chunks: no size limit) instead
// of held in registers; longer than the register limit (8192), they must be.
constexpr int64_t kMinStreamHidden = 8192;

int64_t registers_needed(int64_t elems) {
  if (elems <= 1) return 32;
  if (elems <= 2) return 48;
  if (elems <= 8) return 64;
  if (elems <= 16) return 128;
  return 224;
}

int index_of(const std::vector<std::string>& v, const std::string& s) {
  return static_cast<int>(std::find(v.begin(), v.end(), s) - v.begin());
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool valid_config(const Problem& p, const Config& c, std::string* why) {
  int64_t hidden = p.dim("hidden");
  int64_t tpr = c.get("threads_per_row"), rpb = c.get("rows_per_block"), vec = c.get("vec");
  int esize = dtype_size(p.dtype("x"));
  auto no = [&](const std::string& w) {
    if (why) *why = w;
    return false;
  };
  if (tpr * rpb > 1024) return no("more than 1024 threads per block");
  if (hidden % vec != 0) return no("hidden is not a multiple of vec");
  if (vec * esize > 16) return no("vector wider than 16 bytes");
  if (vec * esize > p.align_bytes) return no("pointers or row strides not aligned for this vector width");
  if (c.get("stream") != 0) {
    if (hidden < kMinStreamHidden) return no("rows shorter than 8192 are held in registers, not streamed");
    if (rpb != 1) return no("a streamed row takes a whole block");
    if (tpr < 128) return no("a streamed row needs at least 128 threads");
    return true;
  }
  int64_t items = ceil_div(hidden, tpr * vec);
  if (items * vec > kMaxElemsPerThread) return no("too many elements per thread (registers would spill)");
  if (registers_needed(items * vec) > std::min<int64_t>(255, 65536 / (tpr * rpb)))
    return no("a block this wide leaves too few registers per thread for this many elements");
  if (tpr > 32 && tpr * vec >= 2 * hidden) return no("more than half of each row's threads would idle");
  if (rpb > 1 && tpr * rpb > 256 && tpr >= 256) return no("several rows per block only for narrow rows");
  return true;
}

// The default when nothing is tuned: the widest vector the data allows, about 16 elements per thread
// (two 16-byte vectors of bf16 in flight; on the H100 (256,1,8) ran 16384x4096 bf16 forward in 0.095 ms
// against 0.109 ms for (512,1,8)), at least 128 threads per block, as few rows per block as reach that.
Config heuristic(const Problem& p) {
  TuningSpace space = p.op->tuning;
  space.heuristic = nullptr;
  auto all = space.enumerate(p);
  KSPEC_CHECK_AS(!all.empty(), Unsupported, p.op->info.name, ": no kernel configuration fits hidden = ",
                 p.dim("hidden"), " with these pointers' alignment");
  int64_t hidden = p.dim("hidden");
  auto score = [&](const Config& c) {
    int64_t tpr = c.get("threads_per_row"), rpb = c.get("rows_per_block"), vec = c.get("vec");
    int64_t elems = ceil_div(hidden, tpr * vec) * vec;
    double dist = std::fabs(std::log2(static_cast<double>(elems) / 16.0));
    // Registers when the row fits: one read of x and no re-walks.
    return std::make_tuple(c.get("stream"), -vec, dist, tpr * rpb < 128 ? 1 : 0, rpb, tpr);
  };
  return *std::min_element(all.begin(), all.end(),
                           [&](const Config& a, const Config& b) { return score(a) < score(b); });
}

// Template arguments up to kHasBias, shared by every norm_act kernel but the final reduction.
std::vector<std::string> problem_targs(const Problem& p, const char* x_name, const char* w_name) {
  return {dtype_cuda_type(p.dtype(x_name)),
          dtype_cuda_type(p.dtype(w_name)),
          std::to_string(p.dim("hidden")),
          std::to_string(index_of(kNorms, p.param_str("norm"))),
          std::to_string(index_of(kActs, p.param_str("act"))),
          p.present("bias") ? "true" : "false"};
}

// ... then the block shape: (threads_per_row, rows_per_block, vec) for a register kernel,
// (threads, vec) for a streamed one.
std::vector<std::string> common_targs(const Problem& p, const Config& c, const char* x_name, const char* w_name) {
  auto t = problem_targs(p, x_name, w_name);
  t.push_back(std::to_string(c.get("threads_per_row")));
  if (c.get("stream") == 0) t.push_back(std::to_string(c.get("rows_per_block")));
  t.push_back(std::to_string(c.get("vec")));
  return t;
}

// Where the launchers find their tensors in a call: resolved from the schema once, when the op is made, so
// that a launch reads call.inputs[i] instead of looking each name up on every call (most of a cached call's
// launch on the mock driver: tools/bench/NOTES.md). The backward's outputs in y, mean, rstd's places.
struct Slots {
  size_t x, weight, bias, mean, rstd, dy = 0, y, dweight = 0, dbias = 0;
};

Slots fwd_slots(const OpInfo& i) {
  Slots s;
  s.x = input_index(i, "x");
  s.weight = input_index(i, "weight");
  s.bias = input_index(i, "bias");
  s.y = output_index(i, "y");
  s.mean = output_index(i, "mean");
  s.rstd = output_index(i, "rstd");
  return s;
}

Slots bwd_slots(const OpInfo& i) {
  Slots s;
  s.dy = input_index(i, "dy");
  s.x = input_index(i, "x");
  s.weight = input_index(i, "weight");
  s.bias = input_index(i, "bias");
  s.mean = input_index(i, "mean");
  s.rstd = input_index(i, "rstd");
  s.y = output_index(i, "dx");
  s.dweight = output_index(i, "dweight");
  s.dbias = output_index(i, "dbias");
  return s;
}

// The kernels' parameters a call's tensors give (templates/norm_act/params.h), `rows` as the launcher read
// it (the problem's dims looked up once a call); the work split's fields (partials) are the launch's to fill.
NormActParams kernel_params(const Call& call, const Slots& s, bool backward, int64_t rows) {
  const TensorView& x = call.inputs[s.x];
  NormActParams prm{};
  prm.x = x.data;
  prm.weight = call.inputs[s.weight].data;
  prm.bias = call.inputs[s.bias].data;
  prm.x_row_stride = call.row_stride(x);
  prm.rows = static_cast<int>(rows);
  if (backward) {
    const TensorView &dy = call.inputs[s.dy], &dx = call.outputs[s.y];
    prm.mean = static_cast<float*>(call.inputs[s.mean].data);
    prm.rstd = static_cast<float*>(call.inputs[s.rstd].data);
    prm.dy = dy.data;
    prm.dx = dx.data;
    prm.dweight = call.outputs[s.dweight].data;
    prm.dbias = call.outputs[s.dbias].data;
    prm.dy_row_stride = call.row_stride(dy);
    prm.dx_row_stride = call.row_stride(dx);
  } else {
    const TensorView& y = call.outputs[s.y];
    prm.y = y.data;
    prm.mean = static_cast<float*>(call.outputs[s.mean].data);
    prm.rstd = static_cast<float*>(call.outputs[s.rstd].data);
    prm.y_row_stride = call.row_stride(y);
    prm.eps = static_cast<float>(call.problem.param_float("eps"));
  }
  return prm;
}

jit::KernelSpec spec(const Problem& p, const char* kernel, std::vector<std::string> targs) {
  return kernel_spec(p, kHeader, kernel, std::move(targs));
}

// ---- references (float64) ----

std::vector<double> or_empty(const HostTensor& t) { return t.defined ? t.data : std::vector<double>{}; }

std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  int64_t hidden = p.dim("hidden"), rows = p.dim("rows");
  std::vector<double> bias = or_empty(in[2]);
  auto r = ref::norm_act_fwd_ref(in[0].data, in[1].data, in[2].defined ? &bias : nullptr, rows, hidden,
                                 index_of(kNorms, p.param_str("norm")), index_of(kActs, p.param_str("act")),
                                 p.param_float("eps"));
  std::vector<HostTensor> out(3);
  out[0] = {true, in[0].shape, std::move(r.y)};
  std::vector<int64_t> rows_shape(in[0].shape.begin(), in[0].shape.end() - 1);
  out[1] = {true, rows_shape, std::move(r.mean)};
  out[2] = {true, rows_shape, std::move(r.rstd)};
  return out;
}

std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  int64_t hidden = p.dim("hidden"), rows = p.dim("rows");
  std::vector<double> bias = or_empty(in[3]);
  auto r = ref::norm_act_bwd_ref(in[0].data, in[1].data, in[2].data, in[3].defined ? &bias : nullptr, rows, hidden,
                                 index_of(kNorms, p.param_str("norm")), index_of(kActs, p.param_str("act")),
                                 p.param_float("eps"));
  std::vector<HostTensor> out(3);
  out[0] = {true, in[1].shape, std::move(r.dx)};
  out[1] = {true, {hidden}, std::move(r.dw)};
  if (in[3].defined) out[2] = {true, {hidden}, std::move(r.db)};
  return out;
}

// The backward's saved statistics must be those of x: compute them with the forward reference.
void bwd_prepare(const Problem& p, std::vector<HostTensor>& in) {
  int64_t hidden = p.dim("hidden"), rows = p.dim("rows");
  std::vector<double> bias = or_empty(in[3]);
  auto r = ref::norm_act_fwd_ref(in[1].data, in[2].data, in[3].defined ? &bias : nullptr, rows, hidden,
                                 index_of(kNorms, p.param_str("norm")), index_of(kActs, p.param_str("act")),
                                 p.param_float("eps"));
  in[4].data = r.mean;
  in[5].data = r.rstd;
}

// ---- shared schema pieces ----

std::vector<ParamDef> norm_act_params() {
  return {
      {"norm", ParamType::Choice, std::string("layernorm"), kNorms, "normalization over the last dim"},
      {"act", ParamType::Choice, std::string("none"), kActs, "activation applied after the affine", false,
       std::nullopt, std::nullopt, kActivationAliases},
      {"eps", ParamType::Float, 1e-5, {}, "added to the variance (mean square for rmsnorm)", false, 0.0},
  };
}

TuningSpace norm_act_tuning() {
  TuningSpace t;
  t.axes = {{"threads_per_row", {32, 64, 128, 256, 512, 1024}},
            {"rows_per_block", {1, 2, 4, 8}},
            {"vec", {1, 2, 4, 8}},
            {"stream", {0, 1}}};
  t.valid = valid_config;
  t.heuristic = heuristic;
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads_per_row") * c.get("rows_per_block"); };
  return t;
}

std::vector<Case> norm_act_cases() {
  auto c = [](std::string name, int64_t rows, int64_t hidden, std::string norm, std::string act) {
    Case k;
    k.name = std::move(name);
    k.dims = {{"rows", rows}, {"hidden", hidden}};
    k.params = {{"norm", norm}, {"act", act}};
    return k;
  };
  std::vector<Case> cases = {
      c("base", 37, 1024, "layernorm", "silu"),
      c("hidden_1", 5, 1, "layernorm", "identity"),
      c("hidden_33", 33, 33, "rmsnorm", "gelu_tanh"),
      c("hidden_4095", 17, 4095, "layernorm", "gelu_erf"),
      c("hidden_8192", 9, 8192, "rmsnorm", "silu"),
      c("rows_1", 1, 768, "rmsnorm", "identity"),
      c("rows_2", 2, 768, "layernorm", "gelu_tanh"),
      c("rmsnorm_gelu_erf", 65, 2048, "rmsnorm", "gelu_erf"),
      c("layernorm_identity", 129, 640, "layernorm", "identity"),
      c("no_bias", 31, 1536, "layernorm", "silu"),
      c("weight_fp32", 40, 2560, "rmsnorm", "silu"),
      c("llama_4096", 4096, 4096, "rmsnorm", "silu"),
      c("large_16384x4096", 16384, 4096, "layernorm", "gelu_tanh"),
      c("hidden_12289", 6, 12289, "layernorm", "gelu_tanh"),
      c("hidden_65536", 3, 65536, "rmsnorm", "silu"),
      c("streamed_rows_300", 300, 16384, "layernorm", "gelu_erf"),
  };
  cases[9].without = {"bias"};
  cases[10].tensor_dtypes = {{"weight", DType::f32}, {"bias", DType::f32}};
  cases[12].large = true;
  // precompile --all: every config at these sizes, the flags rotating over them.
  for (int i : {1, 2, 3, 4, 13, 14}) cases[i].representative = true;
  auto rep = c("rep_4096", 8, 4096, "layernorm", "silu");
  rep.representative = true;
  rep.without = {"bias"};
  cases.push_back(rep);
  // What a model calls (`kspec compile norm_act.fwd --dtype bf16 --param hidden=4096 --param act=silu`,
  // bias on): the quick precompile of the main job compiles exactly this, so that call is a cache hit.
  auto typical = c("typical_4096", 64, 4096, "layernorm", "silu");
  typical.typical = true;
  cases.push_back(typical);
  return cases;
}

// What the forward and backward ops share: family, params, dims, tuning space, reference, cases.
OpDef norm_act_base(const char* name, const char* doc) {
  OpDef op;
  op.info.name = name;
  op.info.family = "norm_act";
  op.info.doc = doc;
  op.info.params = norm_act_params();
  op.info.dims = {{"rows", DimKind::Var, {}, "rows (product of leading dims)"},
                  {"hidden", DimKind::Const, {}, "normalized size, a template argument"}};
  op.tuning = norm_act_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.info.reference = "api/ops/norm_act/reference.cpp (python/kspec/reference/norm_act.py)";
  op.cases = norm_act_cases();
  op.compile_dims = {{"rows", 1}};
  op.dtypes = kFloatTypes;
  return op;
}

// ---- forward ----

OpDef make_fwd() {
  OpDef op = norm_act_base("norm_act.fwd",
                           "y = act(norm(x) * weight + bias) over the last dim; saves mean and rstd for the backward");
  OpInfo& i = op.info;
  i.inputs = {
      {"x", {"...rows", "hidden"}, kFloatTypes, "", false, false, "", Layout::RowStrided, "input"},
      {"weight", {"hidden"}, {}, "x", true, false, "", Layout::Contiguous, "scale"},
      {"bias", {"hidden"}, {}, "weight", false, true, "", Layout::Contiguous, "shift"},
  };
  i.outputs = {
      {"y", {"...rows", "hidden"}, {}, "x", false, false, "", Layout::RowStrided, "output"},
      {"mean", {"...rows"}, {DType::f32}, "", false, true, "save_stats", Layout::Contiguous,
       "row means (0 for rmsnorm), for the backward"},
      {"rstd", {"...rows"}, {DType::f32}, "", false, true, "save_stats", Layout::Contiguous,
       "1/sqrt(var + eps) per row, for the backward"},
  };
  // Without a backward to follow (inference, torch's no-grad path) the statistics are not outputs at all:
  // one allocation per call instead of three, and the kernel (kSaveStats = false) stores nothing else.
  i.params.push_back({"save_stats", ParamType::Bool, true, {},
                      "write mean and rstd (what norm_act.bwd reads); false: leave both out"});
  op.kernels = [](const Problem& p, const Config& c) {
    const char* kernel = c.get("stream") ? "kspec::norm_act_fwd_stream_kernel" : "kspec::norm_act_fwd_kernel";
    auto targs = common_targs(p, c, "x", "weight");
    if (!p.param_bool("save_stats")) targs.push_back("false");  // kSaveStats, true by default
    return std::vector<jit::KernelSpec>{spec(p, kernel, std::move(targs))};
  };
  op.launch = [s = fwd_slots(i)](const Call& call, const Config& c, Launcher& l) {
    int64_t rows = call.problem.dim("rows");
    KSPEC_CHECK(rows <= INT32_MAX, "norm_act.fwd: input 'x': at most 2^31-1 rows, got ", rows);
    NormActParams prm = kernel_params(call, s, false, rows);
    void* args[] = {&prm};
    unsigned rpb = static_cast<unsigned>(c.get("rows_per_block"));  // 1 when streamed
    unsigned threads = static_cast<unsigned>(c.get("threads_per_row")) * rpb;
    l.launch(0, {static_cast<unsigned>(ceil_div(rows, rpb))}, {threads}, 0, args);
  };
  op.reference = fwd_reference;
  return op;
}

// ---- backward ----

// One thread per column, summing the partials in order: 32 threads per block was fastest on the H100
// (15.3 µs against 18.2 µs with 256 at hidden 4096 and 132 partials).
constexpr unsigned kReduceThreads = 32;
// Columns per block of the streamed rows' dweight/dbias kernel, and its blocks per multiprocessor.
constexpr unsigned kColumnThreads = 256;
constexpr int64_t kColumnBlocksPerSm = 4;

jit::KernelSpec reduce_spec(const Problem& p) {
  return spec(p, "kspec::norm_act_bwd_reduce_kernel",
              {dtype_cuda_type(p.dtype("weight")), std::to_string(p.dim("hidden")), p.present("bias") ? "true" : "false",
               std::to_string(kReduceThreads)});
}

// Streamed rows: dx one block per row, dweight/dbias column-parallel over `parts` slices of the rows,
// then the ordered reduction of the parts. `parts` depends only on rows, hidden and the GPU, so
// results are bitwise reproducible there.
void launch_bwd_stream(const Call& call, const Slots& s, const Config& c, Launcher& l) {
  int64_t rows = call.problem.dim("rows"), hidden = call.problem.dim("hidden");
  int64_t col_blocks = ceil_div(hidden, kColumnThreads);
  int64_t parts = std::clamp<int64_t>(ceil_div(l.multiprocessors() * kColumnBlocksPerSm, col_blocks), 1,
                                      std::max<int64_t>(rows, 1));
  parts = std::min<int64_t>(parts, 65535);  // gridDim.y
  auto* ws = static_cast<float*>(l.workspace(sizeof(float) * 2 * parts * hidden));
  NormActParams prm = kernel_params(call, s, true, rows);
  prm.dw_partial = ws;
  prm.db_partial = ws + parts * hidden;
  prm.rows_per_part = static_cast<int>(ceil_div(rows, parts));
  prm.num_partials = static_cast<int>(parts);
  void* args[] = {&prm};
  if (rows > 0) l.launch(0, {static_cast<unsigned>(rows)}, {static_cast<unsigned>(c.get("threads_per_row"))}, 0, args);
  l.launch(1, {static_cast<unsigned>(col_blocks), static_cast<unsigned>(parts)}, {kColumnThreads}, 0, args);
  l.launch(2, {static_cast<unsigned>(ceil_div(hidden, kReduceThreads))}, {kReduceThreads}, 0, args);
}

OpDef make_bwd() {
  OpDef op = norm_act_base(
      "norm_act.bwd", "gradients of norm_act.fwd: dx, dweight, dbias (deterministic: partial sums reduced in a fixed order)");
  OpInfo& i = op.info;
  i.inputs = {
      {"dy", {"...rows", "hidden"}, kFloatTypes, "", false, false, "", Layout::RowStrided, "gradient of y"},
      {"x", {"...rows", "hidden"}, {}, "dy", false, false, "", Layout::RowStrided, "the forward's input"},
      {"weight", {"hidden"}, {}, "x", true, false, "", Layout::Contiguous, "scale"},
      {"bias", {"hidden"}, {}, "weight", false, true, "", Layout::Contiguous, "shift"},
      {"mean", {"...rows"}, {DType::f32}, "", false, false, "", Layout::Contiguous, "saved by the forward"},
      {"rstd", {"...rows"}, {DType::f32}, "", false, false, "", Layout::Contiguous, "saved by the forward"},
  };
  i.outputs = {
      {"dx", {"...rows", "hidden"}, {}, "x", false, false, "", Layout::RowStrided, "gradient of x"},
      {"dweight", {"hidden"}, {}, "weight", false, false, "", Layout::Contiguous, "gradient of weight"},
      {"dbias", {"hidden"}, {}, "weight", false, true, "bias", Layout::Contiguous, "gradient of bias"},
  };
  i.params[2].doc = "the forward's eps (the reference recomputes the statistics with it)";
  op.kernels = [](const Problem& p, const Config& c) {
    if (c.get("stream")) {
      auto dwdb = problem_targs(p, "x", "weight");
      dwdb.push_back(std::to_string(kColumnThreads));
      return std::vector<jit::KernelSpec>{
          spec(p, "kspec::norm_act_bwd_stream_dx_kernel", common_targs(p, c, "x", "weight")),
          spec(p, "kspec::norm_act_bwd_stream_dwdb_kernel", std::move(dwdb)), reduce_spec(p)};
    }
    return std::vector<jit::KernelSpec>{spec(p, "kspec::norm_act_bwd_kernel", common_targs(p, c, "x", "weight")),
                                        reduce_spec(p)};
  };
  op.launch = [s = bwd_slots(i)](const Call& call, const Config& c, Launcher& l) {
    if (c.get("stream")) return launch_bwd_stream(call, s, c, l);
    int64_t rows = call.problem.dim("rows"), hidden = call.problem.dim("hidden");
    KSPEC_CHECK(rows <= INT32_MAX, "norm_act.bwd: input 'x': at most 2^31-1 rows, got ", rows);
    int64_t rpb = c.get("rows_per_block");
    int64_t threads = c.get("threads_per_row") * rpb;
    // A persistent grid: enough blocks to fill the GPU, each summing its rows' dweight/dbias partials.
    // The grid depends only on rows, the config and the GPU, so results are bitwise reproducible.
    // Resident blocks only (the kernel's real occupancy): every extra block adds a partial row that
    // the reduction must read (528 partials cost 44-56 µs of reduction against 15-18 µs for 132).
    int64_t per_sm = std::max(1, l.occupancy(0, static_cast<unsigned>(threads), 0));
    int64_t grid = std::min<int64_t>(ceil_div(rows, rpb), l.multiprocessors() * per_sm);
    auto* ws = static_cast<float*>(l.workspace(sizeof(float) * 2 * std::max<int64_t>(grid, 1) * hidden));
    NormActParams prm = kernel_params(call, s, true, rows);
    prm.dw_partial = ws;
    prm.db_partial = ws + std::max<int64_t>(grid, 1) * hidden;
    prm.num_partials = static_cast<int>(grid);
    void* args[] = {&prm};
    if (grid > 0) l.launch(0, {static_cast<unsigned>(grid)}, {static_cast<unsigned>(threads)}, 0, args);
    l.launch(1, {static_cast<unsigned>(ceil_div(hidden, kReduceThreads))}, {kReduceThreads}, 0, args);
  };
  op.reference = bwd_reference;
  op.prepare_inputs = bwd_prepare;
  return op;
}

}  // namespace

void register_norm_act(Registry& r) {
  r.add(make_fwd());
  r.add(make_bwd());
}

}  // namespace kspec
