// selective_scan: the Mamba S6 scan (mamba_ssm's selective_scan_fn, plus an initial state h0), its
// backward, and a single decode step: the OpDefs, their tuning spaces over the algorithms (warp.cpp,
// sequential.cpp, tile.cpp; named choices of the `algo` axis) and their heuristics. Schema, cases and
// references: schema.cpp; kernels: templates/selective_scan/, one header per kernel family (each
// binary's cache key hashes only its own header's include tree).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>

#include "jit/driver.h"
#include "selective_scan/scan.h"

namespace kspec {
namespace scan {
namespace {

// The backward's variable dB/dC accumulators (fp32, summed over channels with atomics), outside a CUDA graph
// capture: one buffer per (device, stream), all zeros between calls, since the reduce kernel (pass 2) writes
// zeros back where it reads them. A backward then needs no zeroing launch of its own: one launch fewer in
// every training step with a variable B or C (the host's launch and the GPU's kernel: issue 33's small shapes
// are host-bound). Zeroed once when allocated or grown, and again after a call that stopped between its
// main kernel and its reduce (an exception: `zero` stays false). Calls on one stream run in order, so they
// may share it, as they share the workspace; inside a capture the accumulators are the graph's own
// workspace, zeroed by the zero kernel (a graph may replay beside eager work on its stream).
struct VarAccumulators {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  std::atomic<bool> zero{true};
};

VarAccumulators& var_accumulators(int device, Stream stream, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, Stream>, VarAccumulators> buffers;  // nodes stay put: references are kept
  std::lock_guard<std::mutex> lock(mu);
  VarAccumulators& a = buffers[{device, stream}];
  auto cu_stream = reinterpret_cast<CUstream>(stream);
  if (a.bytes < bytes) {
    if (a.ptr) {
      CU_CHECK(cuStreamSynchronize(cu_stream));  // pending kernels may still use it
      CU_CHECK(cuMemFree(a.ptr));
      a.ptr = 0;
      a.bytes = 0;
    }
    const size_t grow = std::max(bytes, size_t(1) << 16);
    CU_CHECK(cuMemAlloc(&a.ptr, grow));
    a.bytes = grow;
    a.zero = false;
  }
  if (!a.zero) {
    CU_CHECK(cuMemsetD32Async(a.ptr, 0, a.bytes / sizeof(float), cu_stream));
    a.zero = true;
  }
  return a;
}

bool capturing(Stream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  CU_CHECK(cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &status));
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// An algorithm's rules, then the dynamic shared memory a block may have (checked last, as each
// algorithm did before: the first rule that fails is the reason the tuner reports).
template <typename Algorithm>
bool algorithm_valid(const Algorithm& a, const Problem& p, const Config& c, std::string* why) {
  if (time_major(p) && a.id != kSequential)
    return no(why, "layout bld: time-major tensors are read by the sequential algorithm only");
  if (time_major(p) && c.get("segs") > 1) return no(why, "layout bld: no segments (their local passes read bdl)");
  if (!a.valid(p, c, why)) return false;
  if (a.shared_bytes(p, c) > kSeqSmemLimit) return no(why, "more than 96 KiB of shared memory per block");
  return true;
}

const FwdAlgorithm& fwd_algorithm(const Config& c) {
  for (const FwdAlgorithm* a : {&kWarpFwd, &kSequentialFwd, &kTileFwd, &kWideFwd})
    if (a->id == c.get("algo")) return *a;
  throw InvalidArgument("selective_scan.fwd: config " + c.str() + ": no such algo");
}

const BwdAlgorithm& bwd_algorithm(const Config& c) {
  for (const BwdAlgorithm* a : {&kWarpBwd, &kSequentialBwd})
    if (a->id == c.get("algo")) return *a;
  throw InvalidArgument("selective_scan.bwd: config " + c.str() + ": no such algo");
}

// The sequential algorithm at (lanes, chunk, segs) with the first of 4, 8, 2 warps it takes, if any.
template <typename Algorithm>
std::optional<Config> seq_at_warps(const Algorithm& a, const Problem& p, int64_t lanes, int64_t chunk, int64_t segs) {
  for (int64_t warps : {4, 8, 2}) {
    Config c = seq_config(warps, lanes, chunk, segs);
    if (algorithm_valid(a, p, c, nullptr)) return c;
  }
  return std::nullopt;
}

// Layout bld: the sequential algorithm in one segment, at the lanes the heuristic would take, else the
// first that fits; none (e.g. the backward at dstate 1 or 256): Unsupported, with the heuristic lanes' reason.
template <typename Algorithm>
Config time_major_config(const Algorithm& a, const Problem& p, int64_t lanes, int64_t chunk) {
  if (auto c = seq_at_warps(a, p, lanes, chunk, 1)) return *c;
  for (int64_t l : {1, 2, 4, 8, 16, 32})
    if (auto c = seq_at_warps(a, p, l, chunk, 1)) return *c;
  std::string why;
  algorithm_valid(a, p, seq_config(4, lanes, chunk, 1), &why);
  throw Unsupported(p.op->info.name + ": layout \"bld\" runs the sequential algorithm, which takes no config for " +
                    "this problem (dstate " + std::to_string(p.dim("dstate")) + ", " + std::to_string(lanes) +
                    " lanes: " + why + "); pass layout \"bdl\"");
}

// The names of the `algo` axis' values (the forward has all four, the backward the first two).
std::pair<std::string, std::vector<std::string>> algo_names(size_t n) {
  return {"algo", std::vector<std::string>(kAlgoNames.begin(), kAlgoNames.begin() + n)};
}

// The backward's legal configs depend on a runtime dim (warps must divide dim / groups with a variable
// B or C), so the plan cache must tell apart problems that admit different warp counts: the largest
// power of two up to 8 dividing dim / groups is part of the key.
std::string bwd_key(const Problem& p) {
  std::string k = even_key(p);
  if (var_bc(p)) {
    int64_t fit = 8;
    while (fit > 1 && !bwd_warps_fit(p, fit)) fit /= 2;
    k += ",warps|" + std::to_string(fit);
  }
  return k;
}

// The forward's heuristic also takes 8 states per thread from 16k channels on (seq_default_lanes).
std::string fwd_key(const Problem& p) {
  const int64_t segs = default_segs(p, kFwdSegsMost);
  return even_key(p) + ",gfit|" + std::to_string(group_fit(p)) + (many_channels(p) ? ",wide" : ",narrow") +
         ",segs|" + std::to_string(segs) + ",lanes|" + std::to_string(seq_default_lanes(p, segs)) +
         (tile_vectors(p) ? ",v8" : "") +
         (tile_preferred(p) ? ",tile" + std::to_string(tile_warps(p)) : "") + (wide_preferred(p) ? ",wide" : "") +
         few_key(few_channels_plan(p, kFwdSegsMost, 32, true));
}

// The backward's warp-scan warp fit, and the forward's distinctions for the sequential algorithm.
std::string bwd_all_key(const Problem& p) {
  return bwd_key(p) + ",gfit|" + std::to_string(group_fit(p)) + (many_channels(p) ? ",wide" : ",narrow") +
         ",segs|" + std::to_string(default_segs(p, kBwdSegsMost)) +
         few_key(few_channels_plan(p, kBwdSegsMost, 16, false));
}

TuningSpace fwd_tuning() {
  TuningSpace t;
  // warp: (warps, items); sequential: (warps, lanes, chunk, segs); tile, wide: (warps). Axes an algorithm
  // does not use must hold their first value, so each kernel appears once in the enumeration.
  t.axes = {{"algo", {kWarp, kSequential, kTile, kWide}}, {"warps", {2, 4, 6, 8}}, {"items", {4, 8, 16}},
            {"lanes", {1, 2, 4, 8, 16, 32}}, {"chunk", {32, 64, 128}}, {"segs", {1, 2, 4, 8, 16, 32}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    return algorithm_valid(fwd_algorithm(c), p, c, why);
  };
  t.heuristic = [](const Problem& p) {
    if (time_major(p)) return time_major_config(kSequentialFwd, p, seq_default_lanes(p, 1), 32);
    if (wide_preferred(p)) return wide_heuristic_config(p);
    if (tile_preferred(p)) return tile_heuristic_config(p);
    const FewChannels few = few_channels_plan(p, kFwdSegsMost, 32, true);
    if (few.segs)
      if (auto c = seq_at_warps(kSequentialFwd, p, few.lanes, 32, few.segs)) return *c;
    const int64_t segs = default_segs(p, kFwdSegsMost);
    // H100, 8x2048x2048 bf16: (4 warps, 4 lanes, chunk 32) 0.314 ms; chunk 64 0.394 ms (its shared
    // memory halves the resident blocks); 2 or 8 warps and 2 lanes within 5%.
    if (many_channels(p) || segs > 1)
      if (auto c = seq_at_warps(kSequentialFwd, p, seq_default_lanes(p, segs), 32, segs)) return *c;
    return warp_config(4, 8, 32);
  };
  return t;
}

TuningSpace bwd_tuning() {
  TuningSpace t;
  // warp: (warps, items; 16 items would hold ~13 arrays of 16 floats per lane: too many registers);
  // sequential: (warps, lanes, chunk, segs). Unused axes hold their first value.
  t.axes = {{"algo", {kWarp, kSequential}}, {"warps", {1, 2, 4, 8}}, {"items", {4, 8}}, {"lanes", {1, 2, 4, 8, 16, 32}},
            {"chunk", {16, 32}}, {"segs", {1, 2, 4, 8, 16, 32}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    return algorithm_valid(bwd_algorithm(c), p, c, why);
  };
  t.heuristic = [](const Problem& p) {
    if (time_major(p)) return time_major_config(kSequentialBwd, p, lanes_for_states(p, 4), 16);
    const FewChannels few = few_channels_plan(p, kBwdSegsMost, 16, false);
    if (few.segs)
      if (auto c = seq_at_warps(kSequentialBwd, p, few.lanes, 16, few.segs)) return *c;
    const int64_t segs = default_segs(p, kBwdSegsMost);
    if (many_channels(p) || segs > 1) {
      // H100, 8x2048x2048 bf16 (kspec tune, every config): (4 warps, 8 lanes, chunk 16) 2.35 ms, 4 lanes
      // 2.42, 16 lanes 2.67, chunk 32 3.26; the warp scan's best 2.63. Two states per thread and
      // registers capped at 128 (the kernel's launch bounds): 1.99 ms at 4 warps, 1.92 at 8. With
      // segments (1x2048x65536, 16 segments): 10.35 ms at 4 warps. With the forward's states and a_t kept
      // in shared memory: 1.39 ms at 4 warps, 6.84 with segments. With x_{t-1} only (a_t recomputed,
      // half the shared memory): 4 states per thread (4 lanes) now lead at every batch-8 shape (8x2048x2048
      // 1.209 ms, 8 lanes 1.239, 8 warps and 8 lanes 1.250; 8x5120x2048 2.996 / 3.042 / 3.082;
      // 8x2048x8192 4.774 / 4.921 / 4.963), and with segments (1x2048x65536, 16 segments: 4 lanes
      // 5.29 ms, 8 lanes 5.91; but with one segment 4 lanes 13.2, 8 lanes 9.3).
      if (auto c = seq_at_warps(kSequentialBwd, p, lanes_for_states(p, 4), 16, segs)) return *c;
    }
    for (int64_t w : {4, 2, 1})
      if (bwd_warps_fit(p, w) && bwd_smem_bytes(p, w, 8) <= kStaticSmemBytes) return warp_config(w, 8, 16);
    return warp_config(1, 4, 16);
  };
  return t;
}

// The op's tuning space, its axes and their names in the op's description.
void set_tuning(OpDef& op, TuningSpace t, size_t algos) {
  op.tuning = std::move(t);
  op.info.tuning_axes = op.tuning.axes;
  op.info.tuning_names = {algo_names(algos)};
}

// ---- forward ----

OpDef make_fwd() {
  OpDef op = scan_base("selective_scan.fwd",
                       "out = (C . x_t + D u) * silu(z) with x_t = exp(dt A) x_{t-1} + dt B u (mamba_ssm's "
                       "selective_scan_fn), and the last state",
                       true);
  op.info.inputs = scan_inputs();
  op.info.outputs = {
      tensor("out", kBDT, {}, "u", false, false, "", "output"),
      tensor("last_state", kState, {DType::f32}, "", false, false, "", "x at the last step"),
      tensor("states", kStates, {DType::f32}, "", false, true, "",
             "for training: the state entering steps 0, 16, 32, ... (selective_scan.bwd's `states`, which then "
             "skips its own forward pass); leave out for inference"),
  };
  set_tuning(op, fwd_tuning(), 4);
  op.derived_key = fwd_key;
  op.kernels = [](const Problem& p, const Config& c) { return fwd_algorithm(c).kernels(p, c); };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    check_launch_sizes(call);
    ScanParams s = scan_params_of(call);
    s.out = call.out("out").data;
    s.last_state = static_cast<float*>(call.out("last_state").data);
    s.states = static_cast<float*>(call.out("states").data);
    if (s.seqlen == 0 || s.dim == 0) return;
    fwd_algorithm(c).launch(call, c, l, s);
  };
  op.reference = fwd_reference;
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) { make_stable(p, in, 0); };
  return op;
}

// ---- backward ----

OpDef make_bwd() {
  OpDef op = scan_base("selective_scan.bwd",
                       "gradients of selective_scan.fwd (and of its last state, given dlast_state); dA, dD, "
                       "ddelta_bias and a fixed dB/dC summed deterministically, a variable dB/dC with fp32 atomics",
                       true);
  auto inputs = scan_inputs();
  inputs.insert(inputs.begin(), tensor("dout", kBDT, kFloatTypes, "", false, false, "", "gradient of out"));
  inputs[1].dtype_of = "dout";
  inputs[1].dtypes = {};
  inputs.push_back(tensor("dlast_state", kState, {DType::f32}, "", false, true, "", "gradient of last_state (else zero)"));
  inputs.push_back(tensor("states", kStates, {DType::f32}, "", false, true, "",
                          "selective_scan.fwd's states of these inputs: the backward then skips its own forward "
                          "pass (else it makes them in a workspace)"));
  op.info.inputs = inputs;
  op.info.outputs = {
      tensor("du", kBDT, {}, "u", false, false, "", "gradient of u"),
      tensor("ddelta", kBDT, {}, "delta", false, false, "", "gradient of delta"),
      tensor("dA", {"dim", "dstate"}, {DType::f32}, "", false, false, "", "gradient of A"),
      tensor("dB", kVarBC, {}, "B", false, false, "", "gradient of B (B's shape)", kFixedBC),
      tensor("dC", kVarBC, {}, "C", false, false, "", "gradient of C (C's shape)", kFixedBC),
      tensor("dD", {"dim"}, {DType::f32}, "", false, false, "D", "gradient of D"),
      tensor("dz", kBDT, {}, "z", false, false, "z", "gradient of z"),
      tensor("ddelta_bias", {"dim"}, {DType::f32}, "", false, false, "delta_bias", "gradient of delta_bias"),
      tensor("dh0", kState, {DType::f32}, "", false, false, "h0", "gradient of h0"),
  };
  set_tuning(op, bwd_tuning(), 2);
  op.derived_key = bwd_all_key;
  // Kernel 0 and 3..: the algorithm's; 1 and 2: the reduce (pass 2) and the zeroing of a variable dB/dC
  // (inside a graph capture only: elsewhere the accumulators are kept zero, VarAccumulators).
  op.kernels = [](const Problem& p, const Config& c) {
    std::vector<jit::KernelSpec> k = bwd_algorithm(c).kernels(p, c);
    k.insert(k.begin() + 1, {kernel_spec(p, kReduceHeader, "kspec::selective_scan_bwd_reduce_kernel",
                                         {dtype_cuda_type(p.dtype("B")), dtype_cuda_type(p.dtype("C")),
                                          std::to_string(p.dim("dstate")), b2s(var_b(p)), b2s(var_c(p)),
                                          b2s(p.present("D")), b2s(p.present("delta_bias"))}),
                             kernel_spec(p, kReduceHeader, "kspec::selective_scan_bwd_zero_kernel", {})});
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    check_launch_sizes(call);
    const Problem& p = call.problem;
    const BwdAlgorithm& algo = bwd_algorithm(c);
    const int64_t batch = p.dim("batch"), dim = p.dim("dim"), seqlen = p.dim("seqlen"), N = p.dim("dstate");
    if (dim == 0 || batch == 0) return;
    KSPEC_CHECK(seqlen > 0, "selective_scan.bwd: input 'u': seqlen must be at least 1");
    const BwdWork w = algo.work(p, c);
    ScanParams s = scan_params_of(call);
    s.given = static_cast<const float*>(call.in("states").data);  // the forward's: no forward pass, no workspace
    const int64_t n_states = s.given ? 0 : batch * dim * w.ntiles * N, n_part = batch * w.nsegs * dim * (3 * N + 2);
    const int64_t n_var = batch * s.groups * N * seqlen;
    const int64_t n_db = var_b(p) ? n_var : 0, n_dc = var_c(p) ? n_var : 0;
    const int64_t n_seg = w.nsegs > 1 ? batch * dim * w.nsegs * (2 * N + 1) : 0;
    // Workspace: tile or chunk states | per-channel (and segment) partials | with segments, their local end
    // states, adjoints and sums of dt | inside a capture, the variable dB/dC accumulators (else their own
    // buffer, kept zero: VarAccumulators).
    const bool in_capture = var_bc(p) && capturing(call.stream);
    const int64_t n_acc = in_capture ? n_db + n_dc : 0;
    auto* ws = static_cast<float*>(l.workspace(sizeof(float) * (n_states + n_part + n_seg + n_acc)));
    s.states = ws;
    s.partials = ws + n_states;
    if (w.nsegs > 1) {
      s.seg_h = s.partials + n_part;
      s.seg_g = s.seg_h + batch * dim * w.nsegs * N;
      s.seg_dt = s.seg_g + batch * dim * w.nsegs * N;
    }
    s.seg_len = w.seg_len;
    s.nsegs = w.nsegs;
    const int sms = l.multiprocessors();
    VarAccumulators* kept = nullptr;
    if (in_capture) {
      s.dB_acc = s.partials + n_part + n_seg;
      s.dC_acc = s.dB_acc + n_db;
      long long n_zero_b = n_db, n_zero_c = n_dc;
      void* zargs[] = {&s.dB_acc, &n_zero_b, &s.dC_acc, &n_zero_c};
      l.launch(2, {u32(std::min<int64_t>(ceil_div(std::max(n_db, n_dc), 256), 8 * sms))}, {256}, 0, zargs);
    } else if (var_bc(p)) {
      kept = &var_accumulators(call.device, call.stream, sizeof(float) * static_cast<size_t>(n_db + n_dc));
      kept->zero = false;  // until the reduce that zeroes them again is enqueued
      s.dB_acc = reinterpret_cast<float*>(kept->ptr);
      s.dC_acc = s.dB_acc + n_db;
    }
    s.dout = call.in("dout").data;
    s.dlast_state = static_cast<const float*>(call.in("dlast_state").data);
    s.du = call.out("du").data;
    s.ddelta = call.out("ddelta").data;
    s.dz = call.out("dz").data;
    s.dh0 = static_cast<float*>(call.out("dh0").data);
    algo.launch(call, c, l, w, s);
    void *dA = call.out("dA").data, *dB = call.out("dB").data, *dC = call.out("dC").data,
         *dD = call.out("dD").data, *ddb = call.out("ddelta_bias").data;
    int batch_i = static_cast<int>(batch * w.nsegs);  // partials per (batch, segment)
    long long var_elems = var_bc(p) ? n_var : 0;
    void* rargs[] = {&s.partials, &s.dB_acc, &s.dC_acc, &dA, &dB, &dC, &dD, &ddb, &batch_i, &s.dim, &var_elems};
    const int64_t work = std::max<int64_t>({dim * N, dim, var_elems});
    l.launch(1, {u32(std::min<int64_t>(ceil_div(work, 256), 8 * sms))}, {256}, 0, rargs);
    if (kept) kept->zero = true;
  };
  for (auto& c : op.cases)
    if (c.name == std::string("none_optional")) c.without.push_back("dlast_state");
  op.reference = bwd_reference;
  op.prepare_inputs = prepare_bwd_inputs;
  return op;
}

// ---- single decode step ----

constexpr int kStepThreads = 128;

// Lanes per channel: each takes dstate / split states; their C . x partials are summed by shuffles.
TuningSpace step_tuning() {
  TuningSpace t;
  t.axes = {{"split", {1, 4, 16, 32}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (c.get("split") > 1 && c.get("split") > p.dim("dstate")) {
      if (why) *why = "more lanes per channel than states";
      return false;
    }
    return true;
  };
  // Decode is memory-bound on the state (dstate floats per channel, read and written): 16 lanes per
  // channel at dstate 16 make each warp read 2 channels' states in 128-byte rows. Untuned.
  t.heuristic = [](const Problem& p) {
    int64_t n = p.dim("dstate");
    return Config{{{"split", n >= 16 ? 16 : n >= 4 ? 4 : 1}}};
  };
  return t;
}

OpDef make_step() {
  OpDef op = scan_base("selective_scan.step",
                       "one decode step: new_state = exp(dt A) state + dt B u, out = (C . new_state + D u) * "
                       "silu(z); new_state may be state itself (in place)",
                       false);
  const std::vector<std::string> bd = {"batch", "dim"};
  op.info.inputs = {
      tensor("state", kState, {DType::f32}, "", false, false, "", "the state before the step"),
      tensor("u", bd, kFloatTypes, "", false, false, "", "input at this step"),
      tensor("delta", bd, {}, "u", false, false, "", "time step before bias and softplus"),
      tensor("A", {"dim", "dstate"}, {DType::f32}, "", false, false, "", "state matrix"),
      tensor("B", {"batch", "groups", "dstate"}, {}, "u", true, false, "", "input matrix at this step, or fixed", kFixedBC),
      tensor("C", {"batch", "groups", "dstate"}, {}, "u", true, false, "", "output matrix at this step, or fixed", kFixedBC),
      tensor("D", {"dim"}, {DType::f32}, "", false, true, "", "skip connection"),
      tensor("z", bd, {}, "u", false, true, "", "gate"),
      tensor("delta_bias", {"dim"}, {DType::f32}, "", false, true, "", "added to delta"),
  };
  op.info.outputs = {
      tensor("out", bd, {}, "u", false, false, "", "output at this step"),
      tensor("new_state", kState, {DType::f32}, "", false, false, "", "the state after the step (may be `state`)"),
  };
  op.info.outputs[1].in_place_of = "state";
  for (auto& c : op.cases) {
    c.without.erase(std::remove(c.without.begin(), c.without.end(), "h0"), c.without.end());
    c.representative = c.name == std::string("base") || c.name == std::string("dstate_256");
  }
  op.tuning = step_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, kStepHeader, "kspec::selective_scan_step_kernel",
        {dtype_cuda_type(p.dtype("u")), dtype_cuda_type(p.dtype("B")), dtype_cuda_type(p.dtype("C")),
         std::to_string(p.dim("dstate")), b2s(var_b(p)), b2s(var_c(p)), b2s(p.present("D")), b2s(p.present("z")),
         b2s(p.present("delta_bias")), b2s(p.param_bool("delta_softplus")), std::to_string(c.get("split")),
         std::to_string(kStepThreads)})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    check_launch_sizes(call);
    const Problem& p = call.problem;
    int batch = static_cast<int>(p.dim("batch")), dim = static_cast<int>(p.dim("dim"));
    int groups = static_cast<int>(groups_of(p)), cpg = dim / groups;
    void *state = call.in("state").data, *ns = call.out("new_state").data, *u = call.in("u").data,
         *delta = call.in("delta").data, *A = call.in("A").data, *B = call.in("B").data, *C = call.in("C").data,
         *D = call.in("D").data, *z = call.in("z").data, *bias = call.in("delta_bias").data,
         *out = call.out("out").data;
    void* args[] = {&state, &ns, &u, &delta, &A, &B, &C, &D, &z, &bias, &out, &batch, &dim, &cpg, &groups};
    int64_t threads = int64_t(batch) * dim * c.get("split");
    l.launch(0, {u32(ceil_div(threads, kStepThreads))}, {kStepThreads}, 0, args);
  };
  op.reference = step_reference;
  // The step's u, delta, A, ..., delta_bias follow `state`: the scan's inputs from index 1.
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) { make_stable(p, in, 1); };
  return op;
}

}  // namespace
}  // namespace scan

void register_selective_scan(Registry& r) {
  r.add(scan::make_fwd());
  r.add(scan::make_bwd());
  r.add(scan::make_step());
}

}  // namespace kspec
