// difflogic.packed.net (issue 30, "several layers per launch where they fit"): a network of hard logic
// layers on bit-packed samples, then GroupSum's counts, in one op. Two algorithms (tuning axis algo):
//   layers   one difflogic_packed_fwd_kernel launch per layer, every layer's words in a workspace (in DRAM
//            at large batches), then difflogic_packed_group_sum_kernel: what calling difflogic.packed.fwd
//            per layer and difflogic.packed.group_sum does (templates/difflogic/{packed,group_sum}.cuh).
//   chunked  one persistent launch over chunks of `chunk` bytes of every row (chunk * 8 samples), each
//            chunk's layers back to back in L2-resident scratch, `inflight` chunks interleaved
//            (templates/difflogic/packed_net.cuh), after a small kernel that takes every gate's argmax op.
//   chains   the same kernel with a ticket per scratch slot, a block taking items from whichever chain of
//            chunks is ready (packed_net.cuh: kChains). H100, run 22: no gain (13.19 ms against 12.91 at 2^18).
//   early    chunked, but a layer item loads its gates' ops and wires before it waits for the previous stage
//            (packed_net.cuh: kEarly), leaving one L2 round trip a wave at a stage's opening instead of two,
//            and layer 1 reads x's rows itself, through L1 (no stage 0); acquire/release waits and signals
//            without chunked's fence.sc; GroupSum items with their rows' loads in batches of 16 (4 round
//            trips, not 16: that GroupSum is on the path, stage 2 of the slot's next chunk waits for it) and
//            their shared-memory counts swizzled (no 32-way bank conflict); gate tables kept in L2 (evict_last).
//            H100, run 25, 2^18 w32, before the batches: 13.59 ms against chunked's 12.82.
//   early_late  early, and with even layers a round's layer 1 before the previous round's GroupSum in the
//            ticket order (run 25, with the slow GroupSum: slower, the GroupSum started later). Neither measured
//            since.
//   fold     early, with the GroupSum folded into the last layer: its items count their rows in shared memory
//            (packed_net.cuh: difflogic_packed_net_fold_kernel), so the last layer writes no scratch and there is
//            no GroupSum stage (one stage a round fewer on the path, ~11% fewer L2 bytes at issue 30's network);
//            a last-layer item of 4 waves (a GroupSum item's atomics). fold2: of 2 waves (a layer item's length,
//            twice the atomics). Not yet measured.
// Every algo gives the counts of difflogic_packed_fwd_ref chained over the layers and difflogic_packed_group_sum_ref
// bit for bit (tests/cpp/test_difflogic_packed_net.cpp). The heuristic takes early (H100 figures below).
#include <algorithm>
#include <cstdint>
#include <string>

#include "api/src/op.h"
#include "difflogic/common.h"
#include "jit/driver.h"
#include "jit/spec.h"
#include "templates/difflogic/params.h"

namespace kspec::difflogic {
namespace {

constexpr int64_t kThreads = 256;
constexpr int64_t kLayers = 0, kChunked = 1, kChains = 2, kEarly = 3, kEarlyLate = 4, kFold = 5, kFold2 = 6;  // algo

// Waves of a last-layer item where the GroupSum is folded into it (fold, fold2), else 0.
int64_t fold_waves(const Config& c) { return c.get("algo") == kFold ? 4 : c.get("algo") == kFold2 ? 2 : 0; }
// The algos of the early kernel's loads (the gate tables before the waits, layer 1 reading x).
bool early(const Config& c) { return c.get("algo") == kEarly || c.get("algo") == kEarlyLate || fold_waves(c) > 0; }
// The heuristic: early (chunked's schedule with each item's gate tables loaded before its waits), 128-byte rows
// (1024 samples a chunk), 2 chunks in flight (at 64k-wide layers 2 x (2 x 64k rows x 128 B) = 33 MB of scratch,
// in the H100's 50 MB L2). H100, run 26, 784 -> 6 x 64k -> GroupSum(10), gpu ms, w32 / w64: B 2^14 early 0.664 /
// 0.667 against chunked 0.839 / 0.844; B 2^18 10.13 / 10.19 against 12.80 / 12.79 (early 64/4 10.34, 256/1 10.47).
// Run 20: algo=layers 3.185 / 2.381 at 2^14, 42.67 / 32.79 at 2^18.
constexpr int64_t kDefaultAlgo = kEarly, kDefaultChunk = 128, kDefaultInflight = 2;
constexpr int64_t kCanonicalChunk = 128, kCanonicalInflight = 2;  // what algo=layers carries (it reads neither)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Layer widths: width[0] the input rows, width[l] layer l's gates (its logits' rows).
std::vector<int64_t> widths(const Call& call) {
  std::vector<int64_t> w = {call.problem.dim("n_in")};
  const TensorView& logits = call.in("logits");
  for (int64_t l = 0; l < logits.list_size(); ++l) w.push_back(logits.item(l).shape[0]);
  return w;
}

int64_t row_bytes(const Problem& p) { return p.dim("words") * word_bits(p.dtype("x")) / 8; }

void check_call(const Call& call) {
  const Problem& p = call.problem;
  const std::string& op = p.op->info.name;
  const int64_t w = word_bits(p.dtype("x")), want = ceil_div(p.dim("batch"), w);
  KSPEC_CHECK(p.dim("words") == want, op, ": batch = ", p.dim("batch"), " samples (counts' rows) need ", want,
              " words of ", w, " bits per row, but input 'x' has ", p.dim("words"));
  const TensorView &logits = call.in("logits"), &a = call.in("a"), &b = call.in("b");
  int64_t n_in = p.dim("n_in");
  for (int64_t l = 0; l < logits.list_size(); ++l) {
    const TensorView& lg = logits.item(l);
    KSPEC_CHECK(lg.rank == 2 && lg.shape[1] == 16 && lg.shape[0] >= 1 && lg.shape[0] <= INT32_MAX, op,
                ": input 'logits'[", l, "] must be [n_out, 16] with 1 <= n_out < 2^31, got ", lg.describe());
    const int64_t n_out = lg.shape[0];
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"a", &a.item(l)}, {"b", &b.item(l)}})
      KSPEC_CHECK(t->rank == 1 && t->shape[0] == n_out, op, ": input '", name, "'[", l, "] must be [", n_out,
                  "] (one wire per gate of layer ", l, ": logits[", l, "] has ", n_out, " rows), got ", t->describe());
    n_in = n_out;
  }
  KSPEC_CHECK(n_in % p.dim("k") == 0, op, ": k = ", p.dim("k"), " groups (counts' columns) must divide the last "
              "layer's ", n_in, " gates (GroupSum counts groups of n / k consecutive gates)");
}

bool valid(const Problem&, const Config& c, std::string* why) {
  if (c.get("algo") == kLayers && (c.get("chunk") != kCanonicalChunk || c.get("inflight") != kCanonicalInflight)) {
    if (why) *why = "algo=layers does not use chunk or inflight (canonical values 128, 2)";
    return false;
  }
  return true;
}

Config heuristic(const Problem&) {
  return Config{{{"algo", kDefaultAlgo}, {"chunk", kDefaultChunk}, {"inflight", kDefaultInflight}}};
}

std::vector<jit::KernelSpec> kernels(const Problem& p, const Config& c) {
  const std::string threads = std::to_string(kThreads);
  if (c.get("algo") == kLayers) {
    const std::string w = std::to_string(word_bits(p.dtype("x")));
    return {kernel_spec(p, "difflogic/packed.cuh", "kspec::difflogic_packed_fwd_kernel", {w, threads}),
            kernel_spec(p, "difflogic/group_sum.cuh", "kspec::difflogic_packed_group_sum_kernel", {w, threads})};
  }
  // The word width is not a template argument: a w = 64 row is the w = 32 row of the same bits.
  const std::string chunk = std::to_string(c.get("chunk"));
  jit::KernelSpec ops = kernel_spec(p, "difflogic/packed_net.cuh", "kspec::difflogic_packed_ops_kernel", {threads});
  if (fold_waves(c) > 0)
    return {ops, kernel_spec(p, "difflogic/packed_net.cuh", "kspec::difflogic_packed_net_fold_kernel",
                             {chunk, threads, std::to_string(fold_waves(c))})};
  if (early(c))  // early and early_late: one kernel (the ticket order is a parameter)
    return {ops, kernel_spec(p, "difflogic/packed_net.cuh", "kspec::difflogic_packed_net_early_kernel", {chunk, threads})};
  return {ops, kernel_spec(p, "difflogic/packed_net.cuh", "kspec::difflogic_packed_net_kernel",
                           {chunk, threads, c.get("algo") == kChains ? "true" : "false"})};
}

void launch_layers(const Call& call, Launcher& l) {
  const Problem& p = call.problem;
  const std::vector<int64_t> width = widths(call);
  const int64_t words = p.dim("words"), bytes = row_bytes(p);
  const int64_t max_width = *std::max_element(width.begin() + 1, width.end());
  unsigned char* ws = static_cast<unsigned char*>(l.workspace(static_cast<size_t>(2 * round_up(max_width * bytes, 256))));
  unsigned char* buf[2] = {ws, ws + round_up(max_width * bytes, 256)};
  const TensorView &logits = call.in("logits"), &a = call.in("a"), &b = call.in("b");
  const void* cur = call.in("x").data;
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(width.size()); ++i) {
    DiffLogicParams q{};
    q.x = cur;
    q.logits = static_cast<const float*>(logits.item(i).data);
    q.a = static_cast<const int*>(a.item(i).data);
    q.b = static_cast<const int*>(b.item(i).data);
    q.y = buf[i & 1];
    q.batch = p.dim("batch");
    q.n_in = width[i];
    q.n_out = width[i + 1];
    q.words = words;
    void* args[] = {&q};
    l.launch(0, {blocks_for(q.n_out * words, kThreads)}, {u32(kThreads)}, 0, args);
    cur = q.y;
  }
  DiffLogicParams g{};
  g.x = cur;
  g.y = call.out("counts").data;
  g.batch = p.dim("batch");
  g.n_in = width.back();
  g.words = words;
  g.groups = p.dim("k");
  void* args[] = {&g};
  l.launch(1, {blocks_for(g.batch * g.groups, kThreads)}, {u32(kThreads)}, 0, args);
}

void launch_chunked(const Call& call, const Config& c, Launcher& l) {
  const Problem& p = call.problem;
  const std::vector<int64_t> width = widths(call);
  const int64_t layers = static_cast<int64_t>(width.size()) - 1, chunk = c.get("chunk");
  constexpr int64_t kUnits = DiffLogicNetTraits::kUnits * DiffLogicNetTraits::kWaves, kGsRows = DiffLogicNetTraits::kGsRows;
  DiffLogicNetParams q{};
  q.x = call.in("x").data;
  q.counts = static_cast<int*>(call.out("counts").data);
  q.layers = static_cast<int>(layers);
  q.batch = p.dim("batch");
  q.row_bytes = row_bytes(p);
  q.groups = p.dim("k");
  q.chunks = ceil_div(q.row_bytes, chunk);
  q.inflight = std::min<int64_t>(c.get("inflight"), q.chunks);
  q.max_width = *std::max_element(width.begin() + 1, width.end());
  q.slot_bytes = round_up((width[0] + 2 * q.max_width) * chunk, 256);
  const int64_t units_per_item = kThreads * kUnits, pieces = chunk / 16;
  const int64_t rows_per_gs_item = (kThreads / (chunk / 4)) * kGsRows;
  q.gate0[0] = 0;
  for (int64_t i = 0; i <= layers; ++i) {
    q.width[i] = width[i];
    q.tiles[i] = ceil_div(width[i] * pieces, units_per_item);
    if (i < layers) {
      q.logits[i] = static_cast<const float*>(call.in("logits").item(i).data);
      q.a[i] = static_cast<const int*>(call.in("a").item(i).data);
      q.b[i] = static_cast<const int*>(call.in("b").item(i).data);
      q.gate0[i + 1] = q.gate0[i] + width[i + 1];
    }
  }
  q.tiles[layers + 1] = q.groups * ceil_div(width[layers] / q.groups, rows_per_gs_item);
  // algo=fold, fold2: the last layer's items each count fold_waves waves of one group's units; no GroupSum stage.
  if (fold_waves(c) > 0) {
    q.fold = 1;
    q.tiles[layers] =
        q.groups * ceil_div(width[layers] / q.groups * pieces, kThreads * DiffLogicNetTraits::kUnits * fold_waves(c));
    q.tiles[layers + 1] = 0;
  }
  // algo=early, x and its rows 16-byte aligned (row_bytes: w32 words a multiple of 4, w64 of 2): layer 1 reads x
  // itself, no copy stage (an item waiting for stage 0 waits for nothing); else stage 0 copies as chunked's does.
  if (early(c) && reinterpret_cast<uintptr_t>(q.x) % 16 == 0 && q.row_bytes % 16 == 0) {
    q.x_vec = 1;
    q.tiles[0] = 0;
  }
  // algo=early_late, even layers: a round's layer 1 before the previous round's GroupSum (packed_net_schedule.cuh).
  q.gs_late = c.get("algo") == kEarlyLate && layers % 2 == 0 ? 1 : 0;
  q.chunk_items = 0;
  for (int64_t s = 0; s <= layers + 1; ++s) q.chunk_items += q.tiles[s];
  q.round_items = q.inflight * q.chunk_items;
  // Workspace: the tickets (one; algo=chains one per slot) and done counters (zeroed here), the ops, the scratch.
  const int64_t tickets = c.get("algo") == kChains ? q.inflight : 1;
  const int64_t counters = round_up(8 * tickets + 4 * q.chunks * (layers + 2), 256), ops = round_up(q.gate0[layers], 256);
  unsigned char* ws = static_cast<unsigned char*>(l.workspace(static_cast<size_t>(counters + ops + q.inflight * q.slot_bytes)));
  q.ticket = reinterpret_cast<unsigned long long*>(ws);
  q.done = reinterpret_cast<unsigned*>(ws + 8 * tickets);
  q.ops = ws + counters;
  q.scratch = ws + counters + ops;
  const CUstream stream = reinterpret_cast<CUstream>(call.stream);
  CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(ws), 0, static_cast<size_t>(counters / 4), stream));
  CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(q.counts), 0, static_cast<size_t>(q.batch * q.groups), stream));
  void* args[] = {&q};
  l.launch(0, {blocks_for(q.gate0[layers], kThreads)}, {u32(kThreads)}, 0, args);
  const int64_t resident = int64_t(l.multiprocessors()) * std::max(1, l.occupancy(1, u32(kThreads), 0));
  l.launch(1, {u32(std::min<int64_t>(resident, q.chunks * q.chunk_items))}, {u32(kThreads)}, 0, args);
}

OpDef make_packed_net() {
  OpDef op;
  op.info.name = "difflogic.packed.net";
  op.info.family = "difflogic";
  op.info.doc = "hard logic layers on bit-packed samples, then GroupSum counts: words x [n_in, ceil(batch / w)], w = 32 "
                "(int32) or 64 (int64); layer l: logits[l] [n_l, 16], wires a[l], b[l] [n_l] into the previous "
                "layer's rows (argmax op, ties to the lower index; a wire out of range gives zero bits); counts[s, c] "
                "= set bits of sample s over the last layer's gates [c n/k, (c+1) n/k), batch and k given by "
                "counts' shape";
  op.info.reference = "difflogic_packed_fwd_ref per layer, then difflogic_packed_group_sum_ref "
                      "(api/ops/difflogic/reference.cpp; tests/cpp/test_difflogic_packed_net.cpp)";
  op.info.dims = {{"n_in", DimKind::Var, {}, "rows of x (bits per sample)", 1, INT32_MAX},
                  {"words", DimKind::Var, {}, "words per row: ceil(batch / w)", 1},
                  {"layers", DimKind::Var, {}, "layers (list entries)", 1, kDiffLogicNetMaxLayers},
                  {"batch", DimKind::Var, {}, "B, samples", 1},
                  {"k", DimKind::Var, {}, "groups (k divides the last layer's width)", 1, INT32_MAX}};
  auto list = [](const char* name, DType dt, const char* doc) {
    TensorDef t = tensor_def(name, {"layers"}, {dt}, "", false, false, "", Layout::Contiguous, doc);
    t.list = true;
    return t;
  };
  op.info.inputs = {
      tensor_def("x", {"n_in", "words"}, {DType::i32, DType::i64}, "", false, false, "", Layout::Contiguous,
                 "packed inputs; int32: w = 32, int64: w = 64 (bits, not numbers)"),
      list("logits", DType::f32, "per layer: gate logits [n_l, 16]"),
      list("a", DType::i32, "per layer: first wires [n_l], in [0, n_(l-1))"),
      list("b", DType::i32, "per layer: second wires [n_l], in [0, n_(l-1))"),
  };
  op.info.outputs = {tensor_def("counts", {"batch", "k"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                                "set bits per sample and group of the last layer")};
  op.check_call = check_call;
  op.tuning.axes = {{"algo", {kLayers, kChunked, kChains, kEarly, kEarlyLate, kFold, kFold2}}, {"chunk", {32, 64, 128, 256}}, {"inflight", {1, 2, 4, 8}}};
  op.tuning.valid = valid;
  op.tuning.heuristic = heuristic;
  op.tuning.block_threads = [](const Problem&, const Config&) { return kThreads; };
  op.info.tuning_axes = op.tuning.axes;
  op.info.tuning_names = {{"algo", {"layers", "chunked", "chains", "early", "early_late", "fold", "fold2"}}};
  // The main dtype is nominal (the logits' fp32); the word width is x's dtype, which the _w64 rows set.
  op.dtypes = {DType::f32};
  op.generic_check = false;  // TensorList inputs and integer words (the test compares with the reference)
  op.compile_dims = {{"n_in", 1}, {"words", 1}, {"layers", 1}, {"batch", 1}, {"k", 1}};
  struct Shape {
    const char* name;
    int64_t B, n_in, layers, k;
  };
  for (const Shape& s : std::vector<Shape>{{"base", 1000, 100, 3, 10}, {"B_1", 1, 7, 1, 1},
                                           {"B_16384_784_6", 16384, 784, 6, 10}})
    for (int64_t w : {32, 64}) {
      Case k;
      k.name = std::string(s.name) + (w == 64 ? "_w64" : "");
      k.dims = {{"n_in", s.n_in}, {"words", ceil_div(s.B, w)}, {"layers", s.layers}, {"batch", s.B}, {"k", s.k}};
      if (w == 64) k.tensor_dtypes = {{"x", DType::i64}};
      k.representative = std::string(s.name) == "base";
      op.cases.push_back(std::move(k));
    }
  op.kernels = kernels;
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    if (c.get("algo") == kLayers) return launch_layers(call, l);
    launch_chunked(call, c, l);  // chunked, chains, early, early_late, fold, fold2
  };
  op.reference = [](const Problem&, const std::vector<HostTensor>&) -> std::vector<HostTensor> {
    throw Unsupported("difflogic.packed.net: list inputs: the generic checker does not build lists; see "
                      "tests/cpp/test_difflogic_packed_net.cpp (the chained integer references)");
  };
  return op;
}

}  // namespace

void register_difflogic_packed_net(Registry& r) { r.add(make_packed_net()); }

}  // namespace kspec::difflogic
