// difflogic.ca.step.fwd / .bwd: one step of a DiffLogic cellular automaton (issue 30) and its backward,
// the architecture a compile-time choice among kDiffLogicCaArchs (templates/difflogic/params.h; `arch`),
// wiring and logits as data, the gate tables made once per call by difflogic_tables_kernel, then one
// launch for the step (templates/difflogic/ca.cuh) or three for its backward (ca_bwd.cuh). The float64
// references are difflogic_ca_step_ref / _bwd_ref (api/ops/difflogic/reference.h; NumPy twins in
// python/kspec/reference/difflogic.py). Wires are int32 data: checked where the wiring is built (the
// reference's check_ca), never followed out of range by the kernels (NaN). The generic checker (kspec
// check, the sanitizers) draws them from prepare_ca, a valid wiring; tests/cpp/test_difflogic_ca.cpp
// compares the ops with the references too (reruns and configs bitwise).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>

#include "api/src/op.h"
#include "difflogic/common.h"
#include "difflogic/reference.h"
#include "jit/spec.h"
#include "templates/difflogic/params.h"

namespace kspec::difflogic {
namespace {

const std::vector<std::string> kArchNames = {"checkerboard", "tiny"};

int arch_index(const Problem& p) {
  const auto& name = p.param_str("arch");
  return static_cast<int>(std::find(kArchNames.begin(), kArchNames.end(), name) - kArchNames.begin());
}

const DiffLogicCaArch& arch_of(const Problem& p) { return kDiffLogicCaArchs[arch_index(p)]; }

int64_t perception_gates(const DiffLogicCaArch& A) {
  return std::accumulate(A.perception, A.perception + A.n_perception, int64_t{0});
}
int64_t update_gates(const DiffLogicCaArch& A) { return std::accumulate(A.update, A.update + A.n_update, int64_t{0}); }

// The sizes the architecture fixes, by dim name.
int64_t arch_dim(const Problem& p, const std::string& name) {
  const DiffLogicCaArch& A = arch_of(p);
  if (name == "channels") return A.C;
  if (name == "kernels") return A.K;
  if (name == "perception_gates") return perception_gates(A);
  if (name == "update_gates") return update_gates(A);
  return perception_gates(A) - 8 + update_gates(A);  // wired
}

const std::vector<std::pair<std::string, std::string>> kArchDims = {
    {"channels", "input 'state''s last dim (C)"},
    {"kernels", "input 'perception_logits''s first dim (K)"},
    {"perception_gates", "input 'perception_logits''s second dim (the perception's gates)"},
    {"update_gates", "input 'update_logits''s first dim (the update network's gates)"},
    {"wired", "input 'wires''s second dim (every gate but the perception's first 8)"}};

// The host-side architecture and logits of a call's host tensors (the reference's form).
ref::DiffLogicCa ca_of(const Problem& p, const std::vector<HostTensor>& in) {
  const DiffLogicCaArch& A = arch_of(p);
  ref::DiffLogicCa ca;
  ca.C = A.C;
  ca.K = A.K;
  ca.periodic = p.param_bool("periodic");
  ca.perm = wires(in[1]);
  const std::vector<int32_t> w = wires(in[2]);
  const int64_t wired = arch_dim(p, "wired");
  int64_t col = 0;
  auto take = [&](int width) {
    ref::DiffLogicLayerWires l;
    l.a.assign(w.begin() + col, w.begin() + col + width);
    l.b.assign(w.begin() + wired + col, w.begin() + wired + col + width);
    col += width;
    return l;
  };
  for (int l = 1; l < A.n_perception; ++l) ca.perception.push_back(take(A.perception[l]));
  for (int l = 0; l < A.n_update; ++l) ca.update.push_back(take(A.update[l]));
  return ca;
}

ref::DiffLogicCaLogits logits_of(const Problem& p, const std::vector<HostTensor>& in) {
  const DiffLogicCaArch& A = arch_of(p);
  const int64_t Gp = perception_gates(A);
  ref::DiffLogicCaLogits lg;
  int64_t g0 = 0;
  for (int l = 0; l < A.n_perception; ++l) {
    std::vector<double> layer;
    for (int64_t k = 0; k < A.K; ++k) {
      const auto* first = in[3].data.data() + (k * Gp + g0) * 16;
      layer.insert(layer.end(), first, first + A.perception[l] * 16);
    }
    lg.perception.push_back(std::move(layer));
    g0 += A.perception[l];
  }
  g0 = 0;
  for (int l = 0; l < A.n_update; ++l) {
    const auto* first = in[4].data.data() + g0 * 16;
    lg.update.emplace_back(first, first + A.update[l] * 16);
    g0 += A.update[l];
  }
  return lg;
}

// A valid random wiring (perm a permutation of the 8 neighbours, every wire inside its layer's inputs),
// a fire mask of 0 / 1 and states in (0, 1) (the generic input generator draws normals).
void prepare_ca(const Problem& p, std::vector<HostTensor>& in) {
  const DiffLogicCaArch& A = arch_of(p);
  std::mt19937_64 rng(static_cast<uint64_t>(p.dim("batch") * 7919 + p.dim("height") * 31 + p.dim("width")));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (double& v : in[0].data) v = unit(rng);
  std::vector<int32_t> perm = {0, 1, 2, 3, 5, 6, 7, 8};
  std::shuffle(perm.begin(), perm.end(), rng);
  in[1].data.assign(perm.begin(), perm.end());
  const int64_t wired = arch_dim(p, "wired");
  int64_t col = 0;
  auto fill = [&](int n_in, int width) {
    std::uniform_int_distribution<int> wire(0, n_in - 1);
    for (int g = 0; g < width; ++g, ++col) {
      in[2].data[col] = wire(rng);
      in[2].data[wired + col] = g % 4 == 0 ? in[2].data[col] : wire(rng);
    }
  };
  for (int l = 1; l < A.n_perception; ++l) fill(A.perception[l - 1], A.perception[l]);
  int n_in = A.C + A.C * A.perception[A.n_perception - 1] * A.K;
  for (int l = 0; l < A.n_update; ++l) {
    fill(n_in, A.update[l]);
    n_in = A.update[l];
  }
  if (in[5].defined)
    for (double& v : in[5].data) v = unit(rng) < 0.75 ? 1.0 : 0.0;
}

// What the step's forward and backward share: dims, the architecture's sizes (checked and derived), the
// params but mode, the forward's inputs, the tuning space.
void ca_schema(OpDef& op) {
  op.info.family = "difflogic";
  // Forward: one block per cell on a grid (width, height, batch), batch and height within a grid's y and z.
  // Backward: cells as an int (ca_bwd.cuh), so fewer than 2^31 of them (checked below).
  op.info.dims = {{"batch", DimKind::Var, {}, "B", 0, 65535},
                  {"height", DimKind::Var, {}, "H", 1, 65535},
                  {"width", DimKind::Var, {}, "W", 1, INT32_MAX},
                  {"channels", DimKind::Var, {}, "C (the arch's)", 1},
                  {"kernels", DimKind::Var, {}, "K (the arch's)", 1},
                  {"perception_gates", DimKind::Var, {}, "gates of one perception kernel (the arch's)", 1},
                  {"update_gates", DimKind::Var, {}, "gates of the update network (the arch's)", 1},
                  {"wired", DimKind::Var, {}, "perception_gates - 8 + update_gates", 1}};
  op.info.params = {
      {"arch", ParamType::Choice, std::string("checkerboard"), kArchNames,
       "the architecture (templates/difflogic/params.h): checkerboard (C 8, K 16, 9-8-4-2, 264-256x10-128-64-32-"
       "16-8-8) or tiny (C 2, K 2, 9-8-4-2, 10-6-2)"},
      {"periodic", ParamType::Bool, false, {}, "wrap the 3x3 patches around the grid (else zero padding)", true},
  };
  op.info.inputs = {
      tensor_def("state", {"batch", "height", "width", "channels"}, kFloatTypes, "", false, false, "",
                 Layout::Contiguous, "the cells' state"),
      tensor_def("perm", {"8"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                 "the patch index (0..8, not 4) the perception's first-layer gate g reads beside the centre"),
      tensor_def("wires", {"2", "wired"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                 "wires a (row 0) and b (row 1) of every other gate: the perception's later layers (shared by the "
                 "kernels), then the update network's, layer after layer"),
      tensor_def("perception_logits", {"kernels", "perception_gates", "16"}, {DType::f32}, "", false, false, "",
                 Layout::Contiguous, "each perception kernel's logits, its layers one after the other"),
      tensor_def("update_logits", {"update_gates", "16"}, {DType::f32}, "", false, false, "", Layout::Contiguous,
                 "the update network's logits"),
      tensor_def("fire", {"batch", "height", "width"}, {}, "state", false, true, "", Layout::Contiguous,
                 "1: the cell updates, 0: it keeps its state (None: every cell updates)"),
  };
  op.check = [](const Problem& p) {
    for (const auto& [name, what] : kArchDims)
      if (p.has_dim(name))
        KSPEC_CHECK(p.dim(name) == arch_dim(p, name), p.op->info.name, ": ", what, " is ", p.dim(name),
                    ", but arch '", p.param_str("arch"), "' has ", arch_dim(p, name));
    if (p.has_dim("batch") && p.has_dim("height") && p.has_dim("width"))
      KSPEC_CHECK(p.dim("batch") * p.dim("height") * p.dim("width") <= INT32_MAX, p.op->info.name,
                  ": input 'state' has batch * height * width = ", p.dim("batch") * p.dim("height") * p.dim("width"),
                  " cells, expected at most 2^31 - 1");
  };
  for (const auto& [name, what] : kArchDims) {
    const std::string n = name;
    op.derived_dims.emplace_back(n, [n](const Problem& p) { return arch_dim(p, n); });
  }
  op.tuning = difflogic_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"batch", 1}, {"height", 1}, {"width", 1}};
}

// The gate tables of both logits (kernel 0: difflogic_tables_kernel) into the workspace's first
// 4 (K perception_gates + update_gates) floats.
void launch_tables(const Call& call, int64_t threads, float* tables, Launcher& l) {
  const Problem& p = call.problem;
  const int64_t K = p.dim("kernels"), Gp = p.dim("perception_gates"), Gu = p.dim("update_gates");
  DiffLogicParams a{};
  void* args[] = {&a};
  a.logits = static_cast<const float*>(call.in("perception_logits").data);
  a.n_out = K * Gp;
  a.tables = tables;
  l.launch(0, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
  a.logits = static_cast<const float*>(call.in("update_logits").data);
  a.n_out = Gu;
  a.tables = tables + 4 * K * Gp;
  l.launch(0, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
}

// The step kernels' common arguments.
DiffLogicParams step_params(const Call& call, float* tables) {
  const Problem& p = call.problem;
  DiffLogicParams a{};
  a.x = call.in("state").data;
  a.a = static_cast<const int*>(call.in("perm").data);
  a.b = static_cast<const int*>(call.in("wires").data);
  a.fire = p.present("fire") ? call.in("fire").data : nullptr;
  a.tables = tables;
  a.batch = p.dim("batch");
  a.height = p.dim("height");
  a.width = p.dim("width");
  a.wired = p.dim("wired");
  a.periodic = p.param_bool("periodic") ? 1 : 0;
  return a;
}

OpDef make_ca_step_fwd() {
  OpDef op;
  ca_schema(op);
  op.info.name = "difflogic.ca.step.fwd";
  op.info.doc = "one step of a DiffLogic CA: per cell, K perception kernels on each channel's 3x3 patch (first "
                "layer gate g reads (patch[perm[g]], centre)), the update network on [state | perception], its "
                "output the new state where fire is 1; the architecture (arch) compiled in, wiring and logits data";
  op.info.reference = "api/ops/difflogic/reference.cpp: difflogic_ca_step_ref (python/kspec/reference/difflogic.py: "
                      "ca_step)";
  op.info.params.insert(op.info.params.begin() + 1,
                        {"mode", ParamType::Choice, std::string("soft"), {"soft", "hard"},
                         "soft (training) or hard (inference)"});
  op.info.outputs = {tensor_def("next", {"batch", "height", "width", "channels"}, {}, "state", false, false, "",
                                Layout::Contiguous, "the new state")};
  struct Row {
    const char* name;
    const char* arch;
    int64_t B, H, W;
    bool periodic, fire, hard, representative;
  };
  for (const Row& r : std::vector<Row>{{"checkerboard", "checkerboard", 2, 16, 16, false, false, false, true},
                                       {"checkerboard_B64_periodic", "checkerboard", 64, 16, 16, true, false, false, false},
                                       {"checkerboard_hard_fire", "checkerboard", 1, 16, 16, true, true, true, false},
                                       {"tiny", "tiny", 33, 3, 4, false, false, false, true},
                                       {"tiny_periodic_fire", "tiny", 2, 5, 1, true, true, false, false},
                                       {"tiny_hard_B1", "tiny", 1, 1, 1, false, false, true, false}}) {
    Case c;
    c.name = r.name;
    c.dims = {{"batch", r.B}, {"height", r.H}, {"width", r.W}};
    c.params = {{"arch", std::string(r.arch)}, {"periodic", r.periodic},
                {"mode", std::string(r.hard ? "hard" : "soft")}};
    if (!r.fire) c.without = {"fire"};
    c.representative = r.representative;
    op.cases.push_back(std::move(c));
  }
  op.prepare_inputs = prepare_ca;
  op.kernels = [](const Problem& p, const Config& c) {
    const std::string threads = std::to_string(c.get("threads"));
    return std::vector<jit::KernelSpec>{
        kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_tables_kernel",
                    {p.param_str("mode") == "hard" ? "true" : "false", threads}),
        kernel_spec(p, "difflogic/ca.cuh", "kspec::difflogic_ca_step_fwd_kernel",
                    {dtype_cuda_type(p.dtype("state")), std::to_string(arch_index(p)), threads})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    const int64_t threads = c.get("threads");
    const int64_t gates = p.dim("kernels") * p.dim("perception_gates") + p.dim("update_gates");
    float* tables = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(4 * gates)));
    launch_tables(call, threads, tables, l);
    DiffLogicParams a = step_params(call, tables);
    void* args[] = {&a};
    a.y = call.out("next").data;
    if (a.batch > 0) l.launch(1, {u32(a.width), u32(a.height), u32(a.batch)}, {u32(threads)}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    const auto mode = p.param_str("mode") == "hard" ? ref::DiffLogicMode::Hard : ref::DiffLogicMode::Soft;
    auto next = ref::difflogic_ca_step_ref(ca_of(p, in), p.dim("batch"), p.dim("height"), p.dim("width"), in[0].data,
                                           logits_of(p, in), in[5].defined ? &in[5].data : nullptr, mode);
    return std::vector<HostTensor>{
        {true, {p.dim("batch"), p.dim("height"), p.dim("width"), p.dim("channels")}, std::move(next)}};
  };
  return op;
}


// The backward's readers axis (0 for a config written before it).
bool readers_of(const Config& c) { return c.has("readers") && c.get("readers") != 0; }

// Sizes of the update network's readers CSR (templates/difflogic/ca_bwd.cuh, the readers CSR): every
// layer's offsets (its inputs + 1), then every layer's entries (2 per gate).
int64_t readers_offsets(const DiffLogicCaArch& A) {
  int64_t n = A.C + int64_t{A.C} * A.perception[A.n_perception - 1] * A.K + A.n_update;
  for (int l = 0; l + 1 < A.n_update; ++l) n += A.update[l];
  return n;
}

int64_t readers_entries(const DiffLogicCaArch& A) {
  int64_t n = 0;
  for (int l = 0; l < A.n_update; ++l) n += 2 * A.update[l];
  return n;
}

OpDef make_ca_step_bwd() {
  OpDef op;
  ca_schema(op);
  op.info.name = "difflogic.ca.step.bwd";
  op.info.doc = "the soft CA step's backward: the gradients of sum(dnext * next) for the state (kept cells, the "
                "update network's input, every neighbour's perception) and every perception kernel's and update "
                "layer's logits; no atomics, sums in a fixed order (same bits run to run)";
  op.info.reference = "api/ops/difflogic/reference.cpp: difflogic_ca_step_bwd_ref (python/kspec/reference/"
                      "difflogic.py: ca_step_bwd)";
  op.info.inputs.push_back(tensor_def("dnext", {"batch", "height", "width", "channels"}, {}, "state", false, false, "",
                                      Layout::Contiguous, "the gradient of the step's output"));
  // No float16: the state's gradient shrinks through the update network's layers below float16's range.
  // On the H100 the checkerboard case's dstate (12 gate layers from the update output back to the state)
  // flushed to zero in float16 (error 0.63-1.0 against the float64 reference) where bfloat16 and float32
  // matched; a gradient that silently vanishes is worse than a refusal.
  op.dtypes = {DType::f32, DType::bf16};
  // The logits' gradients are sums whose terms cancel (dlogits_i = p_i sum_uv (table_i[uv] - T[uv]) G[uv],
  // sum_uv G[uv] = the sum of dout), over the gate layers' chain back from the output: on the H100,
  // tiny_periodic_fire's dperception_logits came to 2.5e-5 in float32 (dstate and dupdate_logits 0.0).
  op.tolerance_scale = 4.0;
  // 256 threads only: at 128, ptxas (NVRTC 13) spills 40 bytes of the tiny architecture's main kernel for
  // sm_80 (none for sm_90, none at 256 for either). readers: 1 walks an update layer's input gradient from a
  // readers CSR built once per call (templates/difflogic/ca_bwd.cuh kReaders: 2 x 2816 entries a cell of
  // the checkerboard against ~700k (input, gate) tests), 0 tests every gate per input (the first version;
  // a config without the axis means it). The same sums in the same order either way: the same bits.
  op.tuning.axes = {{"threads", {256}}, {"readers", {0, 1}}};
  op.tuning.heuristic = [](const Problem&) { return Config{{{"threads", 256}, {"readers", 1}}}; };
  op.info.tuning_axes = op.tuning.axes;
  op.check = [schema_check = op.check](const Problem& p) {
    KSPEC_CHECK_AS(p.dtype("state") != DType::f16, Unsupported, p.op->info.name,
                   ": input 'state' is float16, whose range cannot hold the state's gradient (it flushes to zero "
                   "through the update network's layers): use bfloat16 or float32");
    schema_check(p);
  };
  op.info.outputs = {
      tensor_def("dstate", {"batch", "height", "width", "channels"}, {}, "state", false, false, "",
                 Layout::Contiguous, "the gradient of the state"),
      tensor_def("dperception_logits", {"kernels", "perception_gates", "16"}, {DType::f32}, "", false, false, "",
                 Layout::Contiguous, "the gradient of the perception logits"),
      tensor_def("dupdate_logits", {"update_gates", "16"}, {DType::f32}, "", false, false, "", Layout::Contiguous,
                 "the gradient of the update logits")};
  struct Row {
    const char* name;
    const char* arch;
    int64_t B, H, W;
    bool periodic, fire, representative;
  };
  // 1 x 2 periodic: a cell reads its one neighbour at six patch places (the gather's repeats).
  for (const Row& r : std::vector<Row>{{"checkerboard", "checkerboard", 2, 16, 16, false, false, true},
                                       {"checkerboard_periodic_fire", "checkerboard", 1, 16, 16, true, true, false},
                                       {"tiny", "tiny", 33, 3, 4, false, false, true},
                                       {"tiny_periodic_fire", "tiny", 2, 5, 1, true, true, false},
                                       {"tiny_periodic_1x2", "tiny", 3, 1, 2, true, false, false},
                                       {"tiny_B1", "tiny", 1, 1, 1, false, false, false},
                                       {"tiny_B0", "tiny", 0, 2, 2, false, false, false}}) {
    Case c;
    c.name = r.name;
    c.dims = {{"batch", r.B}, {"height", r.H}, {"width", r.W}};
    c.params = {{"arch", std::string(r.arch)}, {"periodic", r.periodic}};
    if (!r.fire) c.without = {"fire"};
    c.representative = r.representative;
    op.cases.push_back(std::move(c));
  }
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) {
    prepare_ca(p, in);
    std::mt19937_64 rng(static_cast<uint64_t>(p.dim("batch") * 104729 + p.dim("height") * 17 + p.dim("width")));
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    for (double& v : in[6].data) v = unit(rng);
  };
  op.kernels = [](const Problem& p, const Config& c) {
    const std::string threads = std::to_string(c.get("threads"));
    const std::vector<std::string> args = {dtype_cuda_type(p.dtype("state")), std::to_string(arch_index(p)), threads};
    std::vector<std::string> main_args = args;
    if (readers_of(c)) main_args.push_back("true");  // the default false keeps the first version's name
    std::vector<jit::KernelSpec> k = {
        kernel_spec(p, "difflogic/layer.cuh", "kspec::difflogic_tables_kernel", {"false", threads}),
        kernel_spec(p, "difflogic/ca_bwd.cuh", "kspec::difflogic_ca_step_bwd_kernel", main_args),
        kernel_spec(p, "difflogic/ca_bwd.cuh", "kspec::difflogic_ca_step_bwd_gather_kernel", args),
        kernel_spec(p, "difflogic/ca_bwd.cuh", "kspec::difflogic_ca_step_bwd_finish_kernel", {threads})};
    if (readers_of(c))
      k.push_back(kernel_spec(p, "difflogic/ca_bwd.cuh", "kspec::difflogic_ca_update_readers_kernel",
                              {std::to_string(arch_index(p)), threads}));
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    const int64_t threads = c.get("threads");
    const int64_t K = p.dim("kernels"), Gp = p.dim("perception_gates"), Gu = p.dim("update_gates");
    const int64_t gates = K * Gp + Gu, C = p.dim("channels");
    const int64_t cells = p.dim("batch") * p.dim("height") * p.dim("width");
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(cells, kDiffLogicCaBwdBlocks));
    const DiffLogicCaArch& A = arch_of(p);
    const int64_t csr = readers_of(c) ? readers_offsets(A) + readers_entries(A) : 0;
    // tables [gates, 4] | partials [blocks, gates, 4] | dcells [cells, C, 10] | readers CSR (int32)
    const int64_t floats = 4 * gates + blocks * gates * 4 + cells * C * 10;
    float* tables = static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(floats + csr)));
    launch_tables(call, threads, tables, l);
    DiffLogicParams a = step_params(call, tables);
    void* args[] = {&a};
    if (csr > 0) {
      int* readers = reinterpret_cast<int*>(tables + floats);
      a.y = readers;
      l.launch(4, {u32(A.n_update)}, {u32(threads)}, 0, args);
      a.offsets = readers;
      a.entries = readers + readers_offsets(A);
    }
    a.dout = call.in("dnext").data;
    a.dx = call.out("dstate").data;
    a.partials = tables + 4 * gates;
    a.dcells = a.partials + blocks * gates * 4;
    a.blocks = blocks;
    // With no cell the partials stay zero (the one block zeroes its row), so dlogits are 0.
    l.launch(1, {u32(blocks)}, {u32(threads)}, 0, args);
    if (cells > 0) l.launch(2, {blocks_for(cells * C, threads)}, {u32(threads)}, 0, args);
    a.n_in = gates;
    a.logits = static_cast<const float*>(call.in("perception_logits").data);
    a.dlogits = static_cast<float*>(call.out("dperception_logits").data);
    a.gate0 = 0;
    a.n_out = K * Gp;
    l.launch(3, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
    a.logits = static_cast<const float*>(call.in("update_logits").data);
    a.dlogits = static_cast<float*>(call.out("dupdate_logits").data);
    a.tables = tables + 4 * K * Gp;
    a.gate0 = K * Gp;
    a.n_out = Gu;
    l.launch(3, {blocks_for(a.n_out, threads)}, {u32(threads)}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    const DiffLogicCaArch& A = arch_of(p);
    const auto g = ref::difflogic_ca_step_bwd_ref(ca_of(p, in), p.dim("batch"), p.dim("height"), p.dim("width"),
                                                  in[0].data, logits_of(p, in), in[5].defined ? &in[5].data : nullptr,
                                                  in[6].data);
    const int64_t K = A.K, Gp = perception_gates(A);
    std::vector<double> dperc(static_cast<size_t>(K * Gp * 16));
    int64_t g0 = 0;
    for (int l = 0; l < A.n_perception; ++l) {
      const int64_t width = A.perception[l];
      for (int64_t k = 0; k < K; ++k)
        std::copy_n(g.dlogits.perception[l].begin() + k * width * 16, width * 16, dperc.begin() + (k * Gp + g0) * 16);
      g0 += width;
    }
    std::vector<double> dupd;
    for (const auto& layer : g.dlogits.update) dupd.insert(dupd.end(), layer.begin(), layer.end());
    return std::vector<HostTensor>{
        {true, {p.dim("batch"), p.dim("height"), p.dim("width"), p.dim("channels")}, g.dstate},
        {true, {K, Gp, 16}, std::move(dperc)},
        {true, {update_gates(A), 16}, std::move(dupd)}};
  };
  return op;
}

}  // namespace

void register_difflogic_ca(Registry& r) {
  r.add(make_ca_step_fwd());
  r.add(make_ca_step_bwd());
}

}  // namespace kspec::difflogic
