// difflogic: differentiable logic gate layers (issue 30). difflogic.layer.fwd (soft or hard; the
// straight-through estimator's forward is hard), difflogic.layer.bwd (the soft backward, also the
// estimator's), both optionally on logits + Gumbel noise from a seed, and difflogic.packed.fwd (a hard
// layer on bit-packed samples); GroupSum and packing are in bits.cpp. Schema, specializations, tuning
// space, launchers, float64 references (api/ops/difflogic/reference.h) and the case tables; kernels in
// templates/difflogic/{layer,packed}.cuh, their one argument templates/difflogic/params.h.
// Wires are int32 data on the device: their range is checked where the wiring is built on the host
// (kspec::ref::difflogic_consumers, which also builds the consumers CSR the backward reads, once per
// wiring); checking them per call would cost a copy and a sync. The kernels never follow a wire outside
// [0, n_in) (NaN, or zero words, instead). The generic checker (kspec check, the sanitizers) takes the
// layers' wires and CSR from prepare_inputs (valid ones); packed.fwd's words are int64 at w = 64, which
// float64 host tensors cannot hold: tests/cpp/test_difflogic.cpp compares it instead (generic_check =
// false), and the layers as well (layouts, reruns).
#include <algorithm>
#include <cstdint>
#include <random>

#include "api/src/op.h"
#include "difflogic/common.h"
#include "difflogic/reference.h"
#include "jit/spec.h"
#include "templates/difflogic/params.h"

namespace kspec {
namespace {

using namespace difflogic;

const std::vector<std::string> kModes = {"soft", "hard"};

// The straight-through estimator's Gumbel option: runtime params (the noise is data, made in the tables
// kernel from the seed), the same two in the forward and the backward.
std::vector<ParamDef> gumbel_params() {
  ParamDef gumbel{"gumbel", ParamType::Bool, false, {},
                  "add Gumbel noise G (from seed, counter-based: templates/difflogic/philox.cuh) to the logits: "
                  "hard gives argmax(logits + G), soft softmax(logits + G); pass the forward's seed to the backward",
                  true};
  ParamDef seed{"seed", ParamType::Int, int64_t(0), {}, "the noise's key (a new one per training step)", true};
  seed.min = 0.0;
  return {gumbel, seed};
}

void set_gumbel(const Problem& p, DiffLogicParams& a) {
  a.gumbel = p.param_bool("gumbel") ? 1 : 0;
  a.seed = static_cast<unsigned long long>(p.param_int("seed"));
}

// The logits the layer runs on: logits + G with Gumbel noise, else the logits.
std::vector<double> effective_logits(const Problem& p, const HostTensor& logits) {
  if (!p.param_bool("gumbel")) return logits.data;
  std::vector<double> l = ref::difflogic_gumbel_noise(p.dim("n_out"), static_cast<uint64_t>(p.param_int("seed")));
  for (size_t j = 0; j < l.size(); ++j) l[j] += logits.data[j];
  return l;
}

// The activations' layout (compile-time: each has its own kernels). row_major: x, y, dout, dx contiguous
// [batch, width]. feature_major: each the transpose of a contiguous [width, batch] (strides (1, batch), as
// x.t() of a [width, batch] tensor gives), the layout difflogic itself keeps: a gate reads two contiguous
// rows and every kernel runs its threads along the batch.
ParamDef layout_param() {
  return {"layout", ParamType::Choice, std::string("row_major"), {"row_major", "feature_major"},
          "x, y, dout, dx: row_major (contiguous [batch, width]) or feature_major (strides (1, batch): the "
          "transpose of a contiguous [width, batch])"};
}

bool feature_major(const Problem& p) { return p.param_str("layout") == "feature_major"; }

// layer.bwd's dx_layout (compile-time): as_x, or row_major, a contiguous [batch, n_in] dx whatever x's
// layout: a row-major caller's x transposed to feature-major gets its dx back in its own layout without a
// second transpose (the batch-tiled kernel writes it through shared memory). The forward has no such param.
ParamDef dx_layout_param() {
  return {"dx_layout", ParamType::Choice, std::string("as_x"), {"as_x", "row_major"},
          "dx: as_x (the layout param's) or row_major (contiguous [batch, n_in]; with layout feature_major it "
          "needs the batch-tiled kernels, lanes > 0)"};
}

bool dx_row_major(const Problem& p) {
  const ParamValue* v = p.params.find("dx_layout");
  return v && std::get<std::string>(*v) == "row_major";
}

// The layer ops' tuning: the family's threads, and lanes for the feature-major kernels: 0 the flat ones (a
// thread per element, whole rows in turn), else the batch-tiled ones (templates/difflogic/layer.cuh: lanes
// threads of 16 bytes per row and tile, every gate of a tile before the next tile, so L2 holds the tile's
// x for an input's second reader; the backward's dx kernel also makes the dlogits sums). Row-major has
// the flat kernels only. Lanes 32: a warp per input, so no lane group waits on another input's longer
// reader list (at 8, a warp's 4 inputs run max(readers) steps, ~3.5 against a mean of 2). Defaults, each op
// its own (H100, run 25, fp32, gpu ms, 16384 x 16000 -> 16000 / 1024 x 64000 -> 64000): the forward lanes 16
// (0.755 / 0.217 against lanes 8's 0.807 / 0.217, lanes 32's 0.764 / 0.239); the backward lanes 32 with its
// readers' loads a step ahead (fwd+bwd less fwd: 1.81 / 0.58 against lanes 16's 1.93 / 0.57 and lanes 8's
// 2.12 / 0.59; at 64k its tiles, 512 B a row, hold 96 MB of x, dout and dx, past L2, and it still holds even).
// At lanes 8 the loads a step ahead measured 1% slower (2.961 against 2.928 fwd+bwd at 16k).
constexpr int64_t kDefaultFwdLanes = 16;
constexpr int64_t kDefaultBwdLanes = 32;
constexpr int64_t kDefaultAhead = 1;

// A config written before the lanes axis (a tuning database's, a script's "threads=256") means the flat kernels.
int64_t lanes_of(const Config& c) { return c.has("lanes") ? c.get("lanes") : 0; }

TuningSpace layer_tuning() {
  TuningSpace t = difflogic_tuning();
  t.axes.push_back({"lanes", {0, 4, 8, 16, 32}});
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (lanes_of(c) == 0 && feature_major(p) && dx_row_major(p)) {
      if (why) *why = "dx_layout row_major with layout feature_major needs the batch-tiled kernels (lanes > 0)";
      return false;
    }
    if (lanes_of(c) == 0 || feature_major(p)) return true;
    if (why) *why = "lanes > 0 (the batch-tiled kernels) needs layout feature_major";
    return false;
  };
  t.heuristic = [](const Problem& p) {
    return Config{{{"threads", 256}, {"lanes", feature_major(p) ? kDefaultFwdLanes : 0}}};
  };
  return t;
}

// The forward's stage axis (row-major only; templates/difflogic/layer_staged.cuh, layer_staged_cluster.cuh):
// 1 stages whole rows of x in one block's shared memory and reads x once (0: the flat kernel, gathering
// x[s, a_g] from global memory); 2 and 4 stage each row across a thread-block cluster of that many CTAs (sm_90
// and newer), each holding a slice of the columns and reading the others' through distributed shared memory:
// rows too wide for one block (64k fp32: 256 KB) read once as well. A config written before the axis means 0.
// The plan cannot depend on n_in (a runtime width: the plan is cached per signature), so stage 1, 2 and 4 also
// carry the flat kernel, launched where one row does not fit the block's (or the cluster's) shared memory.
// 8 ("hybrid", templates/difflogic/layer_hybrid.cuh) stages one row a pass, as many of its first columns as
// fit one block's shared memory, and reads the rest from global memory (L1, L2): any width, one block an SM,
// every gate's record (T and its wires packed into 20 bytes by its own tables kernel) from L2 once an output.
int64_t stage_of(const Config& c) { return c.has("stage") ? c.get("stage") : 0; }
constexpr int64_t kHybridStage = 8;

// The staged kernel's block: the rows fill a multiprocessor's shared memory at large widths, one block an
// SM, so the block brings every thread slot it may (1024); rows a pass at most kStagedMaxRows (small
// widths: a gate's 24 bytes of wires and T, read from L2 once a pass, serve 8 rows).
constexpr int64_t kStagedThreads = 1024;
constexpr int64_t kStagedMaxRows = 8;

// Opt-in shared memory a block and a multiprocessor: 227 / 228 KB on sm_90 to sm_110 (H100, B200), 163 / 164
// KB on sm_80 and sm_87, 99 / 100 KB on the others (sm_86, sm_89, sm_120).
bool big_smem(int cc) { return cc >= 90 && cc < 120; }
int64_t smem_per_block(const std::string& arch) {
  const int cc = jit::compute_capability(arch);
  return big_smem(cc) ? 232448 : cc == 80 || cc == 87 ? 166912 : 101376;
}
int64_t smem_per_sm(const std::string& arch) {
  const int cc = jit::compute_capability(arch);
  return big_smem(cc) ? 233472 : cc == 80 || cc == 87 ? 167936 : 102400;
}

// Blocks of kStagedThreads threads and smem bytes of shared memory resident at once (1 or 2 an SM), at most
// `work` (the passes: the staged kernels loop over the rest).
int64_t resident_blocks(Launcher& l, const std::string& arch, int64_t work, int64_t smem) {
  const int64_t per_sm =
      std::max<int64_t>(1, std::min<int64_t>(2048 / kStagedThreads, smem_per_sm(arch) / (smem + 1024)));
  return std::min(work, per_sm * l.multiprocessors());
}

// CTAs of the cluster that stages a row (stage 2, 4), else 1.
int64_t cluster_of(const Config& c) {
  const int64_t stage = stage_of(c);
  return stage == 2 || stage == 4 ? stage : 1;
}

// The hybrid kernel's prefix, in elements: the block's shared memory in whole 16-byte units (so a 16-byte
// aligned row's prefix copies in 16-byte pieces), at most the row.
int64_t hybrid_prefix(const std::string& arch, int64_t n_in, int64_t elem) {
  return std::min(n_in, smem_per_block(arch) / 16 * 16 / elem);
}

TuningSpace layer_fwd_tuning() {
  TuningSpace t = layer_tuning();
  t.axes.push_back({"stage", {0, 1, 2, 4, kHybridStage}});
  t.valid = [inner = t.valid](const Problem& p, const Config& c, std::string* why) {
    if (!inner(p, c, why)) return false;
    if (stage_of(c) > 0 && feature_major(p)) {
      if (why)
        *why = "stage " + std::to_string(stage_of(c)) + " (whole rows of x in shared memory) needs layout row_major";
      return false;
    }
    if (cluster_of(c) > 1 && jit::compute_capability(p.arch) < 90) {
      if (why)
        *why = "stage " + std::to_string(stage_of(c)) + " (a row staged across a thread-block cluster) needs sm_90 or "
               "newer, got " + p.arch;
      return false;
    }
    return true;
  };
  // Row-major: staged, x read once where a row fits (the flat kernel's gather moves a 32-byte sector per
  // element read, twice an output: 3.81 ms at 16384 x 16000 -> 16000 fp32 on the H100).
  t.heuristic = [](const Problem& p) {
    const bool fm = feature_major(p);
    return Config{{{"threads", 256}, {"lanes", fm ? kDefaultFwdLanes : 0}, {"stage", fm ? 0 : 1}}};
  };
  t.block_threads = [](const Problem&, const Config& c) { return stage_of(c) ? kStagedThreads : c.get("threads"); };
  return t;
}

// The backward's ahead axis (the batch-tiled kernel only; templates/difflogic/layer.cuh kAhead): 1 loads
// each reader's wires and T a step ahead, one round trip a reader instead of two; the same bits as 0. A
// config written before the axis means 0.
int64_t ahead_of(const Config& c) { return c.has("ahead") ? c.get("ahead") : 0; }

// The backward's pool axis (the batch-tiled kernel only; templates/difflogic/layer_bwd_pool.cuh): 0 gives each
// lane group one input of its block (a block lasts as long as its input with the most readers: run 28, H100,
// 16384 x 16000 -> 16000 fp32, 1.97 ms at 49% of DRAM peak); 32 or 64 let a block's lane groups take that many
// consecutive inputs one at a time from a shared counter, so they finish together. The same bits as 0. A
// config written before the axis means 0; the default stays 0 until the GPU has timed it.
int64_t pool_of(const Config& c) { return c.has("pool") ? c.get("pool") : 0; }
constexpr int64_t kDefaultPool = 0;

TuningSpace layer_bwd_tuning() {
  TuningSpace t = layer_tuning();
  t.axes.push_back({"ahead", {0, 1}});
  t.axes.push_back({"pool", {0, 32, 64}});
  t.valid = [inner = t.valid](const Problem& p, const Config& c, std::string* why) {
    if (!inner(p, c, why)) return false;
    if (lanes_of(c) > 0) {
      const int64_t pool = pool_of(c), samples = lanes_of(c) * 16 / static_cast<int64_t>(dtype_size(p.dtype("x")));
      if (pool > 0 && pool < c.get("threads") / lanes_of(c)) {
        if (why) *why = "pool " + std::to_string(pool) + " is fewer inputs than the block's lane groups";
        return false;
      }
      // The row-major dx's staging, pool x (tile + 1) floats, in static shared memory (48 KB at most).
      if (pool > 0 && dx_row_major(p) && pool * (samples + 1) * 4 > 48 * 1024) {
        if (why) *why = "pool " + std::to_string(pool) + " stages " + std::to_string(pool * (samples + 1) * 4) +
                        " bytes of dx a tile, over 48 KB (fewer lanes or a smaller pool)";
        return false;
      }
      return true;
    }
    if (ahead_of(c) == 0 && pool_of(c) == 0) return true;
    if (why)
      *why = ahead_of(c) ? "ahead 1 (readers' loads a step ahead) needs the batch-tiled backward (lanes > 0)"
                         : "pool > 0 (inputs handed out on demand) needs the batch-tiled backward (lanes > 0)";
    return false;
  };
  t.heuristic = [](const Problem& p) {
    const bool fm = feature_major(p);
    return Config{{{"threads", 256},
                   {"lanes", fm ? kDefaultBwdLanes : 0},
                   {"ahead", fm ? kDefaultAhead : 0},
                   {"pool", fm ? kDefaultPool : 0}}};
  };
  return t;
}

// Samples per tile of the tiled kernels: lanes x 16 bytes.
int64_t tile_samples(const Problem& p, int64_t lanes) {
  return lanes * 16 / static_cast<int64_t>(dtype_size(p.dtype("x")));
}

// Grid of a tiled kernel: lane groups of `lanes` threads, one per row (gate or input), along x; tiles along y.
Dim3 tiled_grid(const Problem& p, int64_t rows, int64_t threads, int64_t lanes) {
  const int64_t per_block = threads / lanes, tile = tile_samples(p, lanes), tiles = (p.dim("batch") + tile - 1) / tile;
  return {u32((rows + per_block - 1) / per_block), u32(std::min<int64_t>(tiles, 65535))};
}

// An activation's strides against the layout (a size-1 dim's stride is free); row_major: dx under
// dx_layout row_major, whatever the layout param.
void check_layout(const Call& call, const TensorView& t, const char* what, bool row_major = false) {
  if (t.numel() == 0) return;
  const bool fm = feature_major(call.problem) && !row_major;
  const int64_t want[2] = {fm ? 1 : t.shape[1], fm ? t.shape[0] : 1};
  for (int d = 0; d < 2; ++d)
    KSPEC_CHECK(t.shape[d] == 1 || t.strides[d] == want[d], call.problem.op->info.name, ": ", what, ": ",
                row_major ? "dx_layout 'row_major" : "layout '", row_major ? "" : call.problem.param_str("layout"),
                "' expects strides (", want[0], ", ", want[1], ") ",
                fm ? "(the transpose of a contiguous [width, batch])" : "(contiguous [batch, width])", ", got ",
                t.describe(), fm || row_major ? "" : "; pass layout='feature_major' for a batch-contiguous view");
}

std::vector<DimDef> layer_dims(bool csr) {
  std::vector<DimDef> d = {{"batch", DimKind::Var, {}, "B, samples", 1},
                           {"n_in", DimKind::Var, {}, "inputs of the layer", 1, INT32_MAX},
                           {"n_out", DimKind::Var, {}, "gates of the layer", 1, INT32_MAX / 2}};
  if (csr) d.push_back({"csr", DimKind::Var, {}, "length of the consumers CSR: n_in + 1 + 2 n_out", 3});
  return d;
}

std::vector<TensorDef> layer_inputs() {
  return {
      tensor_def("x", {"batch", "n_in"}, kFloatTypes, "", false, false, "", Layout::Strided,
                 "activations (strides per the layout param)"),
      tensor_def("logits", {"n_out", "16"}, {DType::f32}, "", false, false, "", Layout::Contiguous,
                 "gate logits (softmax over the 16 ops)"),
      tensor_def("a", {"n_out"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                 "first wire of each gate, in [0, n_in)"),
      tensor_def("b", {"n_out"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                 "second wire of each gate, in [0, n_in) (may equal a)"),
  };
}

OpDef layer_base(const char* name, const char* doc, bool csr) {
  OpDef op;
  op.info.name = name;
  op.info.family = "difflogic";
  op.info.doc = doc;
  op.info.dims = layer_dims(csr);
  op.info.reference = "api/ops/difflogic/reference.cpp (python/kspec/reference/difflogic.py)";
  op.info.inputs = layer_inputs();
  op.tuning = layer_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"batch", 1}, {"n_in", 1}, {"n_out", 1}};
  if (csr) op.compile_dims.push_back({"csr", 4});
  return op;
}

// Base, one axis varied per row, the edges (B = 1, B = 2, a single gate, widths no tile divides) and a
// large layer.
std::vector<Case> layer_cases() {
  struct Spec {
    const char* name;
    int64_t B, n_in, n_out;
    bool large;
  };
  const std::vector<Spec> specs = {
      {"base", 64, 100, 200, false},      {"B_1", 1, 33, 7, false},          {"B_2", 2, 7, 33, false},
      {"B_33_n_4097", 33, 4097, 4097, false}, {"one_gate", 5, 1, 1, false}, {"fan_out_4_to_2048", 8, 4, 2048, false},
      {"B_1024_n_1000", 1024, 1000, 1000, false}, {"large_16k", 1024, 16384, 16384, true},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.B}, {"n_in", s.n_in}, {"n_out", s.n_out}};
    c.large = s.large;
    c.representative = c.name == "base";
    cases.push_back(std::move(c));
  }
  return cases;
}

// Random wiring in range, every third gate self-paired (the generic input generator draws normals).
void prepare_wires(const Problem& p, std::vector<HostTensor>& in) {
  std::mt19937_64 rng(static_cast<uint64_t>(p.dim("n_in") * 131 + p.dim("n_out")));
  std::uniform_int_distribution<int64_t> wire(0, p.dim("n_in") - 1);
  for (size_t g = 0; g < in[2].data.size(); ++g) {
    in[2].data[g] = static_cast<double>(wire(rng));
    in[3].data[g] = g % 3 == 0 ? in[2].data[g] : static_cast<double>(wire(rng));
  }
}

DiffLogicParams params_of(const Call& call) {
  const Problem& p = call.problem;
  DiffLogicParams a{};
  a.x = call.in("x").data;
  a.logits = static_cast<const float*>(call.in("logits").data);
  a.a = static_cast<const int*>(call.in("a").data);
  a.b = static_cast<const int*>(call.in("b").data);
  a.batch = p.dim("batch");
  a.n_in = p.dim("n_in");
  a.n_out = p.dim("n_out");
  return a;
}

jit::KernelSpec tables_kernel(const Problem& p, bool hard, int64_t threads) {
  return kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_tables_kernel",
                     {hard ? "true" : "false", std::to_string(threads)});
}

// ---- difflogic.layer.fwd ----

OpDef make_layer_fwd() {
  OpDef op = layer_base("difflogic.layer.fwd",
                        "y[:, g] = sum_i p_i op_i(x[:, a_g], x[:, b_g]), p = softmax(logits[g]) (soft) or one-hot "
                        "argmax, ties to the lower index (hard; the straight-through estimator's forward)",
                        false);
  op.info.params = {{"mode", ParamType::Choice, std::string("soft"), kModes,
                     "soft (training) or hard (inference; the straight-through estimator's forward)"},
                    layout_param(),
                    {"save_xt", ParamType::Bool, false, {},
                     "also write xt = x transposed, [n_in, batch] contiguous (layout row_major): the feature-major x "
                     "layer.bwd reads, written by the staged kernel from its shared memory (else by a transpose)"}};
  for (auto& g : gumbel_params()) op.info.params.push_back(std::move(g));
  op.info.outputs = {
      tensor_def("y", {"batch", "n_out"}, {}, "x", false, false, "", Layout::Strided, "gate outputs (layout as x)"),
      tensor_def("xt", {"n_in", "batch"}, {}, "x", false, true, "save_xt", Layout::Contiguous,
                 "x transposed (save_xt): x.t() of it is x in layout feature_major"),
  };
  op.check = [](const Problem& p) {
    KSPEC_CHECK(!p.param_bool("save_xt") || !feature_major(p), p.op->info.name,
                ": save_xt needs layout 'row_major' (a feature-major x is already its own xt.t())");
  };
  op.cases = layer_cases();
  Case hard = op.cases.front();
  hard.name = "hard";
  hard.representative = true;
  hard.params = {{"mode", std::string("hard")}};
  op.cases.push_back(std::move(hard));
  Case ste = op.cases[2];
  ste.name = "hard_gumbel";
  ste.params = {{"mode", std::string("hard")}, {"gumbel", true}, {"seed", int64_t{12345}}};
  op.cases.push_back(std::move(ste));
  for (size_t i : {size_t{0}, size_t{3}}) {  // base and B 33 x 4097: x transposed beside y
    Case xt = op.cases[i];
    xt.name += "_save_xt";
    xt.representative = false;
    xt.params = {{"save_xt", true}};
    op.cases.push_back(std::move(xt));
  }
  op.prepare_inputs = prepare_wires;
  op.tuning = layer_fwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.check_call = [](const Call& call) {
    check_layout(call, call.in("x"), "input 'x'");
    check_layout(call, call.out("y"), "output 'y'");
  };
  // tables, then the tiled, staged or flat kernel; stage 1, 2 and 4 add the flat kernel (kernel 2) for rows that
  // do not fit in shared memory; stage 8 is its own tables kernel (the packed wires too) and the hybrid kernel
  // (any width); save_xt adds the transpose (last) for the kernels that do not write xt.
  op.kernels = [](const Problem& p, const Config& c) {
    const int64_t threads = c.get("threads"), lanes = lanes_of(c), stage = stage_of(c);
    const std::string t = dtype_cuda_type(p.dtype("x")), staged_threads = std::to_string(kStagedThreads);
    const bool xt = p.param_bool("save_xt");
    const jit::KernelSpec flat = kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_fwd_kernel",
                                             {t, std::to_string(threads), feature_major(p) ? "true" : "false"});
    const bool hard = p.param_str("mode") == "hard";
    std::vector<jit::KernelSpec> k = {tables_kernel(p, hard, threads)};
    if (stage == kHybridStage) {
      k[0] = kernel_spec(p, "difflogic/layer_hybrid.cuh", "kspec::difflogic_tables_wires_kernel",
                         {hard ? "true" : "false", std::to_string(threads)});
      k.push_back(
          kernel_spec(p, "difflogic/layer_hybrid.cuh", "kspec::difflogic_fwd_hybrid_kernel", {t, staged_threads}));
    } else if (lanes > 0) {
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_fwd_tiled_kernel",
                              {t, std::to_string(threads), std::to_string(lanes)}));
    } else if (stage == 1) {
      std::vector<std::string> targs = {t, staged_threads};
      if (xt) targs.insert(targs.end(), {"4", "true"});  // kGates (its default), kXT
      k.push_back(kernel_spec(p, "difflogic/layer_staged.cuh", "kspec::difflogic_fwd_staged_kernel", std::move(targs)));
      k.push_back(flat);
    } else if (stage == 2 || stage == 4) {
      k.push_back(kernel_spec(p, "difflogic/layer_staged_cluster.cuh", "kspec::difflogic_fwd_staged_cluster_kernel",
                              {t, staged_threads, std::to_string(stage)}));
      k.push_back(flat);
    } else {
      k.push_back(flat);
    }
    if (xt)
      k.push_back(kernel_spec(p, "difflogic/transpose.cuh", "kspec::difflogic_transpose_kernel",
                              {t, std::to_string(kTransposeThreads), std::to_string(kTransposeTile)}));
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    DiffLogicParams a = params_of(call);
    a.y = call.out("y").data;
    const bool save_xt = p.param_bool("save_xt");
    if (save_xt) a.dx = call.out("xt").data;  // the staged kernel's xt (its params have no field of that name)
    set_gumbel(p, a);
    const int64_t threads = c.get("threads"), lanes = lanes_of(c), stage = stage_of(c), cluster = cluster_of(c);
    const bool hybrid = stage == kHybridStage;
    // T (4 floats a gate), and for the hybrid kernel the packed wires after them (1 word a gate).
    a.tables = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>((hybrid ? 5 : 4) * a.n_out)));
    const size_t transpose = lanes > 0 || stage == 0 || hybrid ? 2 : 3;  // the plan's last kernel, with save_xt
    void* args[] = {&a};
    l.launch(0, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
    if (a.batch == 0) return;
    if (lanes > 0) return l.launch(1, tiled_grid(p, a.n_out, threads, lanes), {u32(threads)}, 0, args);
    const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype("x")));
    // Staged: as many rows a pass as fit (at most kStagedMaxRows and the batch) in a block's shared memory, or
    // a cluster's (each CTA a slice of ceil(n_in / cluster) columns rounded up to 8, as the kernel slices); one
    // block: as many as are resident at once (the kernel loops over the passes), no more than there are passes.
    const int64_t slice = cluster > 1 ? ((a.n_in + cluster - 1) / cluster + 7) / 8 * 8 : a.n_in;
    const int64_t rows = std::min<int64_t>({kStagedMaxRows, a.batch, smem_per_block(p.arch) / (slice * elem)});
    if (hybrid) {  // the row's prefix in shared memory, rounded up to 16 bytes (the kernel stops at the row's end)
      const int64_t smem = (hybrid_prefix(p.arch, a.n_in, elem) * elem + 15) / 16 * 16;
      l.launch(1, {u32(resident_blocks(l, p.arch, a.batch, smem))}, {u32(kStagedThreads)}, u32(smem), args);
    } else if (stage > 0 && rows >= 1) {
      const int64_t smem = rows * slice * elem, passes = (a.batch + rows - 1) / rows;
      if (cluster == 1) return l.launch(1, {u32(resident_blocks(l, p.arch, passes, smem))}, {u32(kStagedThreads)},
                                        u32(smem), args);
      // A cluster a pass (layer_staged_cluster.cuh: how many clusters are resident at once depends on the GPCs),
      // up to the grid's limit (the kernel loops over the rest).
      const int64_t clusters = std::min<int64_t>(passes, INT32_MAX / cluster);
      l.launch_clusters(1, {u32(clusters * cluster)}, {u32(kStagedThreads)}, {u32(cluster)}, u32(smem), args);
    } else {
      l.launch(stage > 0 ? 2 : 1, {blocks_for(a.batch * a.n_out, threads)}, {u32(threads)}, 0, args);
    }
    if (save_xt && !(stage == 1 && rows >= 1)) {  // the kernels that ran do not write xt
      DiffLogicParams tr{};
      tr.x = a.x;
      tr.y = a.dx;
      tr.batch = a.batch;
      tr.n_in = a.n_in;
      void* targs[] = {&tr};
      l.launch(transpose, {transpose_blocks(a.batch, a.n_in)}, {u32(kTransposeThreads)}, 0, targs);
    }
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    const auto mode = p.param_str("mode") == "hard" ? ref::DiffLogicMode::Hard : ref::DiffLogicMode::Soft;
    const int64_t B = p.dim("batch"), n_in = p.dim("n_in");
    auto y = ref::difflogic_layer_fwd_ref(B, n_in, in[0].data, effective_logits(p, in[1]), wires(in[2]),
                                          wires(in[3]), mode);
    std::vector<HostTensor> out = {{true, {B, p.dim("n_out")}, std::move(y)}};
    if (p.param_bool("save_xt")) {
      std::vector<double> xt(in[0].data.size());
      for (int64_t s = 0; s < B; ++s)
        for (int64_t j = 0; j < n_in; ++j)
          xt[static_cast<size_t>(j * B + s)] = in[0].data[static_cast<size_t>(s * n_in + j)];
      out.push_back({true, {n_in, B}, std::move(xt)});
    } else {
      out.emplace_back();  // absent
    }
    return out;
  };
  return op;
}

// ---- difflogic.layer.bwd ----

OpDef make_layer_bwd() {
  OpDef op = layer_base("difflogic.layer.bwd",
                        "gradients of sum(dout * y) of the soft layer (also the straight-through estimator's; with "
                        "gumbel, of softmax(logits + G) for the forward's G): "
                        "dlogits[g, i] = sum_s dout p_i (op_i - y), dx = grad_factor * the sum over each input's "
                        "readers in the consumers CSR's order (no atomics: the same bits every run)",
                        true);
  ParamDef gf{"grad_factor", ParamType::Float, 1.0, {}, "scales dx only", true};
  op.info.params = {gf, layout_param(), dx_layout_param()};
  for (auto& g : gumbel_params()) op.info.params.push_back(std::move(g));
  op.info.inputs.push_back(tensor_def("dout", {"batch", "n_out"}, {}, "x", false, false, "", Layout::Strided,
                                      "upstream gradient of y (layout as x)"));
  op.info.inputs.push_back(tensor_def("consumers", {"csr"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                                      "offsets [n_in + 1] then entries [2 n_out] (2 g + side, ascending per input), "
                                      "built once per wiring"));
  op.info.outputs = {
      tensor_def("dx", {"batch", "n_in"}, {}, "x", false, false, "", Layout::Strided, "gradient of x (layout as x)"),
      tensor_def("dlogits", {"n_out", "16"}, {DType::f32}, "", false, false, "", Layout::Contiguous,
                 "gradient of the logits"),
  };
  op.check = [](const Problem& p) {
    const int64_t want = p.dim("n_in") + 1 + 2 * p.dim("n_out");
    KSPEC_CHECK(p.dim("csr") == want, p.op->info.name, ": input 'consumers' has ", p.dim("csr"),
                " elements, expected n_in + 1 + 2 n_out = ", want, " (offsets, then entries)");
  };
  op.check_call = [](const Call& call) {
    check_layout(call, call.in("x"), "input 'x'");
    check_layout(call, call.in("dout"), "input 'dout'");
    check_layout(call, call.out("dx"), "output 'dx'", dx_row_major(call.problem));
  };
  op.tuning = layer_bwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.cases = layer_cases();
  for (auto& c : op.cases) {
    int64_t n_in = 0, n_out = 0;
    for (const auto& [k, v] : c.dims) {
      if (k == "n_in") n_in = v;
      if (k == "n_out") n_out = v;
    }
    c.dims.push_back({"csr", n_in + 1 + 2 * n_out});
  }
  op.cases.front().params = {{"grad_factor", 2.0}};
  Case ste = op.cases[2];
  ste.name = "gumbel";
  ste.params = {{"gumbel", true}, {"seed", int64_t{12345}}};
  op.cases.push_back(std::move(ste));
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) {
    prepare_wires(p, in);
    const auto c = ref::difflogic_consumers(p.dim("n_in"), wires(in[2]), wires(in[3]));
    auto& csr = in[5].data;
    csr.assign(c.offsets.begin(), c.offsets.end());
    csr.insert(csr.end(), c.entries.begin(), c.entries.end());
  };
  // Flat feature-major: tables, dx, dlogits; row-major: tables, dx, dlogits partials, finish; tiled: tables,
  // dx with the dlogits partials, finish.
  op.kernels = [](const Problem& p, const Config& c) {
    const std::string t = dtype_cuda_type(p.dtype("x")), threads = std::to_string(c.get("threads"));
    const int64_t lanes = lanes_of(c);
    const bool fm = feature_major(p);
    std::vector<jit::KernelSpec> k = {tables_kernel(p, false, c.get("threads"))};
    if (lanes > 0 && pool_of(c) > 0) {
      k.push_back(kernel_spec(p, "difflogic/layer_bwd_pool.cuh", "kspec::difflogic_bwd_pool_kernel",
                              {t, threads, std::to_string(lanes), std::to_string(pool_of(c)),
                               dx_row_major(p) ? "true" : "false", ahead_of(c) ? "true" : "false"}));
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dlogits_finish_kernel",
                              {threads, std::to_string(tile_samples(p, lanes))}));
      return k;
    }
    if (lanes > 0) {
      std::vector<std::string> targs = {t, threads, std::to_string(lanes)};
      // The defaults (false) left out keep the names the kernels had before these flags.
      if (dx_row_major(p) || ahead_of(c)) targs.push_back(dx_row_major(p) ? "true" : "false");
      if (ahead_of(c)) targs.push_back("true");
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_bwd_tiled_kernel", std::move(targs)));
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dlogits_finish_kernel",
                              {threads, std::to_string(tile_samples(p, lanes))}));
      return k;
    }
    k.push_back(
        kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dx_kernel", {t, threads, fm ? "true" : "false"}));
    if (fm) {
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dlogits_fm_kernel", {t, threads}));
    } else {
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dlogits_partial_kernel", {t, threads}));
      k.push_back(kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_dlogits_finish_kernel",
                              {threads, std::to_string(kDiffLogicChunk)}));
    }
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    DiffLogicParams a = params_of(call);
    a.dout = call.in("dout").data;
    a.offsets = static_cast<const int*>(call.in("consumers").data);
    a.entries = a.offsets + a.n_in + 1;
    a.dx = call.out("dx").data;
    a.dlogits = static_cast<float*>(call.out("dlogits").data);
    a.grad_factor = static_cast<float>(call.problem.param_float("grad_factor"));
    set_gumbel(call.problem, a);
    const bool fm = feature_major(call.problem);
    const int64_t threads = c.get("threads"), lanes = lanes_of(c);
    // Row-major and tiled: the tables, then the dlogits partials [chunks, n_out, 4] (chunks of
    // kDiffLogicChunk samples, or tiles; at least one, which the finish kernel reads only when batch > 0),
    // in one workspace.
    const int64_t chunk = lanes > 0 ? tile_samples(call.problem, lanes) : kDiffLogicChunk;
    const int64_t chunks = fm && lanes == 0 ? 0 : std::max<int64_t>(1, (a.batch + chunk - 1) / chunk);
    a.tables = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(4 * a.n_out * (1 + chunks))));
    void* args[] = {&a};
    l.launch(0, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
    if (lanes > 0) {
      Dim3 grid = tiled_grid(call.problem, a.n_in, threads, lanes);
      if (pool_of(c) > 0) grid.x = u32((a.n_in + pool_of(c) - 1) / pool_of(c));  // a block per pool of inputs
      if (a.batch > 0) l.launch(1, grid, {u32(threads)}, 0, args);
      l.launch(2, {blocks_for(16 * a.n_out, threads)}, {u32(threads)}, 0, args);
      return;
    }
    if (a.batch > 0) l.launch(1, {blocks_for(a.batch * a.n_in, threads)}, {u32(threads)}, 0, args);
    if (fm) {
      l.launch(2, {u32(std::min<int64_t>(kMaxBlocks, a.n_out))}, {u32(threads)}, 0, args);
    } else {
      l.launch(2, {blocks_for(a.n_out, threads), u32(std::min<int64_t>(chunks, 65535))}, {u32(threads)}, 0, args);
      l.launch(3, {blocks_for(16 * a.n_out, threads)}, {u32(threads)}, 0, args);
    }
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    auto g = ref::difflogic_layer_bwd_ref(p.dim("batch"), p.dim("n_in"), in[0].data, effective_logits(p, in[1]),
                                          wires(in[2]), wires(in[3]), in[4].data, p.param_float("grad_factor"));
    return std::vector<HostTensor>{{true, {p.dim("batch"), p.dim("n_in")}, std::move(g.dx)},
                                   {true, {p.dim("n_out"), 16}, std::move(g.dlogits)}};
  };
  return op;
}

// ---- difflogic.packed.fwd ----

int64_t packed_vec_of(const Config& c) { return c.has("vec") ? c.get("vec") : 0; }

OpDef make_packed_fwd() {
  OpDef op;
  op.info.name = "difflogic.packed.fwd";
  op.info.family = "difflogic";
  op.info.doc = "one hard layer on bit-packed samples: words [n, ceil(batch / w)], w = 32 (int32) or 64 (int64), "
                "sample s in bit s mod w of word s / w; each gate runs the argmax op of its logits (ties to the "
                "lower index) bitwise; padding bits are cleared";
  op.info.reference = "api/ops/difflogic/reference.cpp: difflogic_packed_fwd_ref (python/kspec/reference/difflogic.py)";
  op.info.dims = {{"n_in", DimKind::Var, {}, "rows (inputs) of the layer", 1, INT32_MAX},
                  {"n_out", DimKind::Var, {}, "gates of the layer", 1, INT32_MAX},
                  {"words", DimKind::Var, {}, "words per row: ceil(batch / w)", 1}};
  ParamDef batch{"batch", ParamType::Int, int64_t(1), {}, "samples packed (B); the last word's higher bits are padding",
                 true};
  batch.min = 1.0;
  op.info.params = {batch};
  op.info.inputs = {
      tensor_def("x", {"n_in", "words"}, {DType::i32, DType::i64}, "", false, false, "", Layout::Contiguous,
                 "packed inputs; int32: w = 32, int64: w = 64 (bits, not numbers)"),
      tensor_def("logits", {"n_out", "16"}, {DType::f32}, "", false, false, "", Layout::Contiguous, "gate logits"),
      tensor_def("a", {"n_out"}, {DType::i32}, "", false, false, "", Layout::Contiguous, "first wires, in [0, n_in)"),
      tensor_def("b", {"n_out"}, {DType::i32}, "", false, false, "", Layout::Contiguous, "second wires, in [0, n_in)"),
  };
  op.info.outputs = {
      tensor_def("y", {"n_out", "words"}, {}, "x", false, false, "", Layout::Contiguous, "packed gate outputs"),
  };
  // On calls only (a compile request binds no words: batch is runtime and changes nothing compiled).
  op.check_call = [](const Call& call) {
    const Problem& p = call.problem;
    const int64_t w = p.dtype("x") == DType::i64 ? 64 : 32, want = (p.param_int("batch") + w - 1) / w;
    KSPEC_CHECK(p.dim("words") == want, p.op->info.name, ": parameter 'batch' = ", p.param_int("batch"), " needs ",
                want, " words of ", w, " bits per row, but input 'x' has ", p.dim("words"));
  };
  // vec: 0 the flat kernel (a thread per word), 1 the rows kernel (a thread per 128 bits of a gate's row:
  // the same cost per bit at w = 32 and 64). A config written before the axis ("threads=256") means 0. The
  // default: rows at 128 threads (H100, run 20, 6 x 64k layers + GroupSum, gpu ms, B 2^14 w32 / w64: 2.015 /
  // 2.030 against the flat kernel's 3.184 / 2.382; B 2^18: 27.80 / 28.10 against 42.68 / 32.70).
  op.tuning = difflogic_tuning();
  op.tuning.axes.push_back({"vec", {0, 1}});
  op.tuning.heuristic = [](const Problem&) { return Config{{{"threads", 128}, {"vec", 1}}}; };
  op.info.tuning_axes = op.tuning.axes;
  // The main dtype is the logits' (fp32); the word width is x's dtype, which the _w64 rows set.
  op.dtypes = {DType::f32};
  op.compile_dims = {{"n_in", 1}, {"n_out", 1}, {"words", 1}};
  op.generic_check = false;
  struct Spec {
    const char* name;
    int64_t B, n_in, n_out;
  };
  for (const Spec& s : std::vector<Spec>{{"base", 1000, 100, 200}, {"B_1", 1, 33, 7}, {"B_2", 2, 7, 33},
                                         {"B_65_n_4097", 65, 4097, 4097}, {"B_16384", 16384, 784, 4096}})
    for (int64_t w : {32, 64}) {
      Case c;
      c.name = std::string(s.name) + (w == 64 ? "_w64" : "");
      c.dims = {{"n_in", s.n_in}, {"n_out", s.n_out}, {"words", (s.B + w - 1) / w}};
      c.params = {{"batch", s.B}};
      if (w == 64) c.tensor_dtypes = {{"x", DType::i64}};
      c.representative = std::string(s.name) == "base";
      op.cases.push_back(std::move(c));
    }
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "difflogic/packed.cuh",
        packed_vec_of(c) ? "kspec::difflogic_packed_fwd_rows_kernel" : "kspec::difflogic_packed_fwd_kernel",
        {p.dtype("x") == DType::i64 ? "64" : "32", std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    DiffLogicParams a{};
    a.x = call.in("x").data;
    a.logits = static_cast<const float*>(call.in("logits").data);
    a.a = static_cast<const int*>(call.in("a").data);
    a.b = static_cast<const int*>(call.in("b").data);
    a.y = call.out("y").data;
    a.batch = p.param_int("batch");
    a.n_in = p.dim("n_in");
    a.n_out = p.dim("n_out");
    a.words = p.dim("words");
    const int64_t threads = c.get("threads");
    void* args[] = {&a};
    if (!packed_vec_of(c)) return l.launch(0, {blocks_for(a.n_out * a.words, threads)}, {u32(threads)}, 0, args);
    // Rows kernel: x covers a row's words (threads x 128 bits a block), y the gates (grid-stride past 65535).
    const int64_t per_block = threads * (128 / (p.dtype("x") == DType::i64 ? 64 : 32));
    l.launch(0, {u32((a.words + per_block - 1) / per_block), u32(std::min<int64_t>(a.n_out, 65535))}, {u32(threads)},
             0, args);
  };
  // Host tensors are float64: an int32 word is exact there, a 64-bit word is not (the w = 64 kernel is
  // compared with difflogic_packed_fwd_ref directly in tests/cpp/test_difflogic.cpp).
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    KSPEC_CHECK_AS(p.dtype("x") == DType::i32, Unsupported, p.op->info.name,
                   ": the float64 reference takes int32 words only (a 64-bit word does not fit a double)");
    const std::vector<uint64_t> words = words_of(in[0]);
    const auto ops = ref::difflogic_hard_ops(in[1].data, p.dim("n_out"));
    const auto out = ref::difflogic_packed_fwd_ref(p.param_int("batch"), p.dim("n_in"), words, 32, ops, wires(in[2]),
                                                   wires(in[3]));
    return std::vector<HostTensor>{{true, {p.dim("n_out"), p.dim("words")}, doubles_of_words(out)}};
  };
  return op;
}

}  // namespace

void register_difflogic(Registry& r) {
  r.add(make_layer_fwd());
  r.add(make_layer_bwd());
  r.add(make_packed_fwd());
  register_difflogic_bits(r);
  register_difflogic_ca(r);
  register_difflogic_packed_net(r);
  register_difflogic_transpose(r);
}

}  // namespace kspec
