// selective_scan: the Mamba S6 scan (mamba_ssm's selective_scan_fn, plus an initial state h0), its
// backward, and a single decode step. Schema, specializations, tuning spaces, launchers, float64
// references and the case table; kernels in templates/selective_scan/, one header per algorithm (each
// binary's cache key hashes only its own header's include tree).
#include <algorithm>
#include <cmath>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "api/src/tuning.h"
#include "jit/driver.h"
#include "selective_scan/reference.h"

namespace kspec {
namespace {

constexpr const char* kWarpScanHeader = "selective_scan/warp_scan.cuh";    // algo 0
constexpr const char* kSequentialHeader = "selective_scan/sequential.cuh";  // algo 1
constexpr const char* kTileHeader = "selective_scan/tile.cuh";              // algo 2
constexpr const char* kReduceHeader = "selective_scan/reduce.cuh";          // the backward's zero and pass 2
constexpr const char* kStepHeader = "selective_scan/step.cuh";
const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
constexpr int64_t kMaxDstate = 256;
// The largest tile (32 lanes x 16 items): a seqlen that is a multiple of it is a multiple of every
// config's tile, so "even" can be decided before the config is.
constexpr int64_t kEvenMultiple = 512;
constexpr int64_t kStaticSmemBytes = 48 * 1024;
// The forward's states for the backward: every 16 steps (kStateStride in selective_scan/common.cuh).
constexpr int64_t kStateStride = 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t nstates_for(int64_t seqlen) { return ceil_div(seqlen, kStateStride); }
const char* b2s(bool b) { return b ? "true" : "false"; }

bool var_b(const Problem& p) { return !p.alt("B"); }
bool var_c(const Problem& p) { return !p.alt("C"); }
int64_t groups_of(const Problem& p) {
  return (var_b(p) || var_c(p)) && p.has_dim("groups") ? p.dim("groups") : 1;
}
bool is_even(const Problem& p) { return p.dim("seqlen") % kEvenMultiple == 0 && p.align_bytes >= 16; }
// The tile kernel's (algo 2) vectors: a variable B/C row's 16-byte vectors of 8 steps and a lane's 4 steps
// of u, delta, z, out start at aligned addresses when seqlen is a multiple of 8 and the tensors are
// 16-byte aligned; a run of 16 steps may then be cut by the sequence's end at 8.
constexpr int64_t kTileVector = 8;
bool tile_vectors(const Problem& p) { return p.dim("seqlen") % kTileVector == 0 && p.align_bytes >= 16; }

// Cross-argument rules, for every op of the family (step has no seqlen but the same B/C rules).
void check_scan(const Problem& p) {
  const std::string& op = p.op->info.name;
  int64_t dstate = p.dim("dstate");
  KSPEC_CHECK_AS(dstate >= 1 && dstate <= kMaxDstate, Unsupported, op, ": input 'A': dstate = ", dstate,
                 " is not supported (1..", kMaxDstate, ")");
  int64_t groups = groups_of(p), dim = p.dim("dim");
  KSPEC_CHECK(groups >= 1 && dim % groups == 0, op, ": input '", var_b(p) ? "B" : "C", "': groups = ", groups,
              " must divide dim = ", dim);
}

std::string even_key(const Problem& p) { return p.has_dim("seqlen") && is_even(p) ? "even" : ""; }

std::vector<ParamDef> scan_params() {
  return {{"delta_softplus", ParamType::Bool, false, {}, "dt = softplus(delta + delta_bias) (else delta + delta_bias)"}};
}

std::vector<DimDef> scan_dims(bool with_seqlen) {
  std::vector<DimDef> d = {{"batch", DimKind::Var, {}, "batch"},
                           {"dim", DimKind::Var, {}, "channels (d_inner)"},
                           {"dstate", DimKind::Const, {}, "state size per channel, a template argument (1..256)"},
                           {"groups", DimKind::Var, {}, "B/C groups (variable B/C only); channel d uses group d / (dim / groups)"}};
  if (with_seqlen) {
    d.insert(d.begin() + 2, DimDef{"seqlen", DimKind::Var, {}, "sequence length"});
    d.push_back({"nstates", DimKind::Var, {}, "the forward's states for the backward: ceil(seqlen / 16)"});
  }
  return d;
}

// Every scan tensor is contiguous.
TensorDef tensor(std::string name, std::vector<std::string> shape, std::vector<DType> dtypes, std::string dtype_of,
                 bool or_f32, bool optional, std::string present_with, std::string doc,
                 std::vector<std::string> alt = {}) {
  return tensor_def(std::move(name), std::move(shape), std::move(dtypes), std::move(dtype_of), or_f32, optional,
                    std::move(present_with), Layout::Contiguous, std::move(doc), std::move(alt));
}

const std::vector<std::string> kBDT = {"batch", "dim", "seqlen"};
const std::vector<std::string> kVarBC = {"batch", "groups", "dstate", "seqlen"};
const std::vector<std::string> kFixedBC = {"dim", "dstate"};
const std::vector<std::string> kState = {"batch", "dim", "dstate"};
const std::vector<std::string> kStates = {"batch", "dim", "nstates", "dstate"};

// The forward's `states` output and the backward's `states` input agree on ceil(seqlen / 16) entries.
void check_scan_call(const Call& call) {
  const Problem& p = call.problem;
  if (!p.has_dim("nstates")) return;
  const int64_t want = nstates_for(p.dim("seqlen"));
  KSPEC_CHECK(p.dim("nstates") == want, p.op->info.name, ": 'states': expected ", want,
              " states (ceil(seqlen / 16) = ceil(", p.dim("seqlen"), " / 16)), got ", p.dim("nstates"));
}

// The scan's inputs, shared by fwd (as is) and bwd (after dout).
std::vector<TensorDef> scan_inputs() {
  return {
      tensor("u", kBDT, kFloatTypes, "", false, false, "", "input"),
      tensor("delta", kBDT, {}, "u", false, false, "", "time step before bias and softplus"),
      tensor("A", {"dim", "dstate"}, {DType::f32}, "", false, false, "", "state matrix (diagonal per channel); negative"),
      tensor("B", kVarBC, {}, "u", true, false, "", "input matrix: variable, or fixed [dim, dstate]", kFixedBC),
      tensor("C", kVarBC, {}, "u", true, false, "", "output matrix: variable, or fixed [dim, dstate]", kFixedBC),
      tensor("D", {"dim"}, {DType::f32}, "", false, true, "", "skip connection"),
      tensor("z", kBDT, {}, "u", false, true, "", "gate: out *= silu(z)"),
      tensor("delta_bias", {"dim"}, {DType::f32}, "", false, true, "", "added to delta"),
      tensor("h0", kState, {DType::f32}, "", false, true, "", "initial state (else zeros)"),
  };
}

// `vectors`: the last flag, kEven (algo 0 and 1: is_even) or the tile kernel's kVec (tile_vectors).
std::string flags_targs(const Problem& p, bool vectors) {
  std::string s = dtype_cuda_type(p.dtype("u"));
  s += ", " + std::string(dtype_cuda_type(p.dtype("B")));
  s += ", " + std::string(dtype_cuda_type(p.dtype("C")));
  s += ", " + std::to_string(p.dim("dstate"));
  for (bool f : {var_b(p), var_c(p), p.present("D"), p.present("z"), p.present("delta_bias"),
                 p.param_bool("delta_softplus"), p.present("h0"), vectors})
    s += std::string(", ") + b2s(f);
  return s;
}

// The warp-scan kernels (algo 0).
std::string traits(const Problem& p, const Config& c) {
  return "kspec::ScanTraits<" + flags_targs(p, is_even(p)) + ", " + std::to_string(c.get("warps")) + ", " +
         std::to_string(c.get("items")) + ">";
}

// The sequential-state kernels (algo 1).
std::string seq_traits(const Problem& p, const Config& c) {
  return "kspec::SeqScanTraits<" + flags_targs(p, is_even(p)) + ", " + std::to_string(c.get("warps")) + ", " +
         std::to_string(c.get("lanes")) + ", " + std::to_string(c.get("chunk")) + ">";
}

// The one-pass tile kernel (algo 2).
std::string tile_traits(const Problem& p, const Config& c) {
  return "kspec::TileScanTraits<" + flags_targs(p, tile_vectors(p)) + ", " + std::to_string(c.get("warps")) + ">";
}

jit::KernelSpec spec(const Problem& p, const char* header, const char* kernel, std::vector<std::string> targs) {
  return kernel_spec(p, header, kernel, std::move(targs));
}

// ---- references (float64) ----

ref::ScanShape shape_of_problem(const Problem& p) {
  ref::ScanShape s;
  s.batch = p.dim("batch");
  s.dim = p.dim("dim");
  s.seqlen = p.dim("seqlen");
  s.dstate = p.dim("dstate");
  s.groups = groups_of(p);
  s.variable_b = var_b(p);
  s.variable_c = var_c(p);
  return s;
}

std::vector<double> or_empty(const HostTensor& h) { return h.defined ? h.data : std::vector<double>{}; }

// in: u, delta, A, B, C, D, z, delta_bias, h0 starting at `first`.
ref::ScanInputs scan_inputs_of(const Problem& p, const std::vector<HostTensor>& in, size_t first) {
  ref::ScanInputs r;
  r.u = in[first].data;
  r.delta = in[first + 1].data;
  r.A = in[first + 2].data;
  r.B = in[first + 3].data;
  r.C = in[first + 4].data;
  r.D = or_empty(in[first + 5]);
  r.z = or_empty(in[first + 6]);
  r.delta_bias = or_empty(in[first + 7]);
  r.h0 = or_empty(in[first + 8]);
  r.delta_softplus = p.param_bool("delta_softplus");
  return r;
}

// Random N(0, 1) inputs make a growing recurrence; as in Mamba, A < 0 and dt >= 0 keep it a decay.
void make_stable(const Problem& p, std::vector<HostTensor>& in, size_t first) {
  for (auto& a : in[first + 2].data) a = -(0.25 + std::fabs(a));
  if (!p.param_bool("delta_softplus")) {
    for (auto& v : in[first + 1].data) v = 0.05 + 0.5 * std::fabs(v);
    if (in[first + 7].defined)
      for (auto& v : in[first + 7].data) v = 0.1 * std::fabs(v);
  }
}

std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const bool states = p.present("states");
  auto r = ref::selective_scan_fwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 0), states ? kStateStride : 0);
  std::vector<HostTensor> out(3);
  out[0] = {true, in[0].shape, std::move(r.out)};
  out[1] = {true, {p.dim("batch"), p.dim("dim"), p.dim("dstate")}, std::move(r.last_state)};
  if (states) out[2] = {true, {p.dim("batch"), p.dim("dim"), p.dim("nstates"), p.dim("dstate")}, std::move(r.states)};
  return out;
}

std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const std::vector<double>* dlast = in[10].defined ? &in[10].data : nullptr;
  auto g = ref::selective_scan_bwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 1), in[0].data, dlast);
  std::vector<HostTensor> out(9);
  auto put = [&](size_t i, const HostTensor& like, std::vector<double>& v) {
    if (!v.empty()) out[i] = {true, like.shape, std::move(v)};
  };
  put(0, in[1], g.du);
  put(1, in[2], g.ddelta);
  put(2, in[3], g.dA);
  put(3, in[4], g.dB);
  put(4, in[5], g.dC);
  put(5, in[6], g.dD);
  put(6, in[7], g.dz);
  put(7, in[8], g.ddelta_bias);
  put(8, in[9], g.dh0);
  return out;
}

// ---- tuning ----

// Static shared memory of the backward kernel (see its launch contract).
int64_t bwd_smem_bytes(const Problem& p, int64_t warps, int64_t items) {
  bool var = var_b(p) || var_c(p);
  return 4 * (4 * warps * p.dim("dstate") + (var ? 2 * warps * 32 * items : 0));
}

// Every warp of a block must be a channel of one group when the backward sums a variable dB/dC
// over the block (and the block barriers need all of its warps).
bool bwd_warps_fit(const Problem& p, int64_t warps) {
  if (!(var_b(p) || var_c(p))) return true;
  int64_t cpg = p.dim("dim") / std::max<int64_t>(groups_of(p), 1);
  return cpg % warps == 0;
}

// The backward's legal configs depend on a runtime dim (warps must divide dim / groups with a variable
// B or C), so the plan cache must tell apart problems that admit different warp counts: the largest
// power of two up to 8 dividing dim / groups is part of the key.
std::string bwd_key(const Problem& p) {
  std::string k = even_key(p);
  if (var_b(p) || var_c(p)) {
    int64_t fit = 8;
    while (fit > 1 && !bwd_warps_fit(p, fit)) fit /= 2;
    k += ",warps|" + std::to_string(fit);
  }
  return k;
}

// ---- the sequential-state algorithm (algo 1) ----

int64_t seq_channels(const Config& c) { return c.get("warps") * 32 / c.get("lanes"); }
int64_t seq_spt(const Problem& p, const Config& c) { return ceil_div(p.dim("dstate"), c.get("lanes")); }

// Dynamic shared memory of the sequential forward (seq_fwd_smem_floats in sequential.cuh).
int64_t seq_fwd_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), cs = seq_channels(c) + 1, np = seq_spt(p, c) * c.get("lanes");
  int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  return 4 * (4 * chunk * cs + nvar * chunk * np);
}
constexpr int64_t kSeqSmemLimit = 96 * 1024;

// Dynamic shared memory of the segments' local passes (seq_seg_smem_floats in sequential.cuh).
int64_t seq_seg_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), cs = seq_channels(c) + 1, np = seq_spt(p, c) * c.get("lanes");
  return 4 * (2 * chunk * cs + (var_b(p) || var_c(p) ? chunk * np : 0));
}

// Dynamic shared memory of the sequential backward (seq_bwd_smem_floats in sequential.cuh).
int64_t seq_bwd_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), nc = seq_channels(c), cs = nc + 1, np = seq_spt(p, c) * c.get("lanes");
  int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  int64_t scalars = 2 + (p.param_bool("delta_softplus") ? 1 : 0) + (p.present("z") ? 2 : 0);
  return 4 * (4 * chunk * (nc + 1) + (nvar ? chunk * (2 * np + 4) : 0) +
              chunk * seq_spt(p, c) * c.get("warps") * 32 + scalars * chunk * cs +
              nvar * c.get("warps") * np * (chunk + 1));
}

// The largest power of two (up to 256) dividing dim / groups when a variable B/C has several groups:
// a block's channels must share one group, so this decides which block widths are legal.
int64_t group_fit(const Problem& p) {
  if (!(var_b(p) || var_c(p)) || groups_of(p) == 1) return 256;
  int64_t cpg = p.dim("dim") / std::max<int64_t>(groups_of(p), 1), fit = 256;
  while (fit > 1 && cpg % fit != 0) fit /= 2;
  return fit;
}

// Enough channels for the sequential kernel to fill the GPU: batch * dim * lanes threads (an H100
// needs ~16k resident threads at the least). Below that the warp-scan kernel's one warp per channel
// keeps more of it busy.
bool many_channels(const Problem& p) { return p.dim("batch") * p.dim("dim") >= 8192; }

// The fewest lanes per channel (a power of two up to 32) that leave each thread at most `most` states.
int64_t lanes_for_states(const Problem& p, int64_t most) {
  int64_t lanes = 1;
  while (lanes < 32 && ceil_div(p.dim("dstate"), lanes) > most) lanes *= 2;
  return lanes;
}

// 4 states per thread: measured on the H100 (8x2048x2048 bf16) more threads beat more independent
// recurrences per thread (lanes 4 > 2 > 1 at dstate 16: 0.318, 0.325 ms); with 32k channels or more, 8
// states per thread (8x5120x2048: lanes 2 0.686 ms, lanes 4 0.781). Since the prefetch waits as raw
// words (no stall on its loads at the top of each chunk), 8 states from 16k channels: 8x2048x2048 lanes
// 2 0.262 ms, lanes 4 0.296. With segments (segs > 1) and whole vector chunks (kEven) 8 too, since the
// local pass takes the vector prefetch (139 registers at 8 states): 1x2048x65536, 4 warps, chunk 32, 32
// segments 1.622 ms, at 4 states 1.836 (16 segments 1.678 / 1.856). Elsewhere segments keep 4: the
// scalar walk of the local pass takes 246 registers at 8 states.
// Sequences shorter than kShortSeqlen without segments take the fewest lanes that give 48k threads
// (a chunk's fixed cost is not amortized over many steps there, so more threads win): H100 bf16
// forward, 2x4096x333: 8 lanes 0.081 ms, 4 lanes 0.113; 16x768x256: 4 lanes 0.094, 8 lanes over 0.10.
constexpr int64_t kShortSeqlen = 512, kShortThreads = 49152;
int64_t seq_default_lanes(const Problem& p, int64_t segs) {
  const int64_t chans = p.dim("batch") * p.dim("dim");
  if (segs == 1 && p.dim("seqlen") < kShortSeqlen) {
    int64_t lanes = lanes_for_states(p, 8);
    while (lanes < 32 && lanes < p.dim("dstate") && chans * lanes < kShortThreads) lanes *= 2;
    return lanes;
  }
  const bool eight = chans >= 16384 || (segs > 1 && is_even(p));
  return lanes_for_states(p, eight ? 8 : 4);
}

// Segments along time (algo 1, see "segments" in sequential.cuh): the steps are cut into `segs` pieces
// run in parallel, each a whole number of chunks. A segment of fewer than 4 chunks costs more in its
// local pass than it gains.
constexpr int64_t kSegChunksMin = 4;
bool segs_fit(const Problem& p, const Config& c) {
  return c.get("segs") == 1 || p.dim("seqlen") >= kSegChunksMin * c.get("segs") * c.get("chunk");
}
struct SegPlan {
  int seg_len, nsegs;  // steps per segment (a multiple of the chunk) and the segments that hold steps
};
SegPlan seg_plan(const Problem& p, const Config& c) {
  int64_t seqlen = std::max<int64_t>(p.dim("seqlen"), 1), chunk = c.get("chunk");
  int64_t len = ceil_div(ceil_div(seqlen, c.get("segs")), chunk) * chunk;
  return {static_cast<int>(len), static_cast<int>(ceil_div(seqlen, len))};
}

// The heuristic's segment count: with few channels (batch * dim < 8192) and a long sequence, enough
// segments for `most` * 2048 channel-segments, each of 2048 steps or more. H100, 1x2048x65536 bf16 (ms,
// segments 4 / 8 / 16): forward (4 lanes) 3.70 / 2.41 / 2.40, one segment 5.70 and the warp scan 3.36;
// backward (8 lanes) 14.25 / 12.13 / 11.73. Since the vector local pass, forward at 8 states per thread
// (ms, segments 8 / 16 / 32): 1.745 / 1.678 / 1.622, so it takes up to 32; the backward (4 lanes) 5.27 at
// 16 segments and 5.23 at 32, measured beside other GPU work: it keeps 16. With the two forward passes
// overlapped (launch_dependent), 1x2048x65536 bf16 forward at 32 / 33 / 34 segments 1.556 / 1.532 /
// 1.532 ms, and in another run 32 / 33 / 40 / 48 / 64: 1.557 / 1.542 / 1.537 / 1.584 / 1.627. 33 gives 8
// blocks per multiprocessor of the H100's 132; the heuristic does not know the device, and keeps 32.
int64_t default_segs(const Problem& p, int64_t most) {
  if (many_channels(p) || !p.has_dim("seqlen")) return 1;
  int64_t segs = 1;
  while (segs < most && p.dim("batch") * p.dim("dim") * segs < 2048 * most && p.dim("seqlen") >= 2048 * 2 * segs)
    segs *= 2;
  return segs;
}
constexpr int64_t kFwdSegsMost = 32, kBwdSegsMost = 16;

// Few channels and a sequence too short for default_segs: algo 1 at 2 states per thread, with segments
// up to 8192 channel-segments (each of 4 chunks or more), where the warp scan (algo 0) ran before. H100
// bf16, kspec tune --all-configs (2026-11-26), ms, this config against algo 0's heuristic config:
//  - backward (4 warps, chunk 16): 1x1024x2000 0.111 / 0.252 (8 segments), 1x2048x512 0.063 / 0.113 (4),
//    2x2048x700 0.145 / 0.368 (2), 4x1536x1000 0.250 / 0.741 (1); the best configs were within 3%.
//  - forward (4 warps, chunk 32), only up to 2048 channels and from 1024 steps: 1x1024x2000 0.074 / 0.102
//    (8 segments); with 4096 channels (2x2048x700: 0.098 / 0.094) and 6144 (4x1536x1000: 0.214 / 0.193)
//    the warp scan stays ahead.
//  Not measured below 1024 channels or 128 steps (tiny, latency-bound problems): algo 0 stays there.
constexpr int64_t kFewChannelSegs = 8192, kFewChannelsMin = 1024, kFewSeqlenMin = 128;
struct FewChannels {
  int64_t segs = 0;  // 0: the rule does not apply
  int64_t lanes = 0;
};
FewChannels few_channels_plan(const Problem& p, int64_t most, int64_t chunk, bool fwd) {
  if (!p.has_dim("seqlen") || many_channels(p) || default_segs(p, most) > 1) return {};
  const int64_t chans = p.dim("batch") * p.dim("dim"), seqlen = p.dim("seqlen");
  if (chans < kFewChannelsMin || seqlen < kFewSeqlenMin || (fwd && (chans > 2048 || seqlen < 1024))) return {};
  int64_t segs = 1;
  while (segs < most && chans * segs * 2 <= kFewChannelSegs && seqlen >= kSegChunksMin * chunk * segs * 2) segs *= 2;
  return {segs, lanes_for_states(p, 2)};
}
std::string few_key(const FewChannels& f) {
  return f.segs ? ",few|" + std::to_string(f.segs) + "x" + std::to_string(f.lanes) : "";
}

// ---- the one-pass tile kernel (algo 2, forward only; see tile.cuh) ----
// A block holds 8 channels (lanes = 8 channels x 4 groups of 4 states) and `warps` runs of 16 steps.
constexpr int64_t kTileChannels = 8, kTileRun = 16;

// Dynamic shared memory of the tile kernel (tile_fwd_smem_floats in tile.cuh).
int64_t tile_smem_bytes(const Problem& p, const Config& c) {
  int64_t w = c.get("warps"), tile = w * kTileRun, n = p.dim("dstate");
  int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  return 4 * (2 * nvar * tile * n + 2 * tile * kTileChannels + 2 * w * 2 * kTileChannels * n + 2 * kTileChannels * n +
              w * (n / 4) * (kTileChannels * kTileRun + 4));
}

// The kernel addresses a block's rows with 32-bit offsets: dstate * seqlen must fit in an int.
bool tile_offsets_fit(const Problem& p) { return p.dim("seqlen") * p.dim("dstate") <= INT32_MAX; }

bool tile_valid(const Problem& p, const Config& c, std::string* why) {
  auto no = [&](const char* w) {
    if (why) *why = w;
    return false;
  };
  if (c.get("items") != 4 || c.get("lanes") != 1 || c.get("chunk") != 32 || c.get("segs") != 1)
    return no("algo 2 does not use items, lanes, chunk or segs (canonical values 4, 1, 32, 1)");
  if (c.get("warps") != 4 && c.get("warps") != 6) return no("algo 2 runs 4 or 6 warps (2 blocks per SM)");
  if (p.dim("dstate") != 16) return no("algo 2's lane map is for dstate 16");
  // With fp32 u, delta, z (or a variable fp32 B/C) the raw prefetch of the next tile spilled 56-64 bytes.
  if (dtype_size(p.dtype("u")) != 2 || (var_b(p) && dtype_size(p.dtype("B")) != 2) ||
      (var_c(p) && dtype_size(p.dtype("C")) != 2))
    return no("algo 2 takes 16-bit u, delta, z and variable B/C (the fp32 prefetch spills)");
  if (!tile_vectors(p)) return no("algo 2 needs seqlen a multiple of 8 and 16-byte aligned tensors");
  if (!tile_offsets_fit(p))
    return no("algo 2 addresses a block's rows with 32-bit offsets (dstate * seqlen at most 2^31 - 1)");
  if (kTileChannels > group_fit(p)) return no("a block's 8 channels must lie in one B/C group");
  if (tile_smem_bytes(p, c) > kSeqSmemLimit) return no("more than 96 KiB of shared memory per block");
  return true;
}

// The heuristic takes the tile kernel (6 warps; 4 up to 512 steps) from 2048 channels, where its grid of one block per 8
// channels fills an H100 at 2 blocks per SM (264 slots), to 8192 (batch * dim). H100 bf16 forward, ms,
// tile kernel against the heuristic's choice before it (tools/bench/NOTES.md, 2026-11-24):
//  - where algo 1 took segments: 1x2048x65536 1.440 / 1.559, 1x2048x16384 0.367 / 0.449, 1x2048x8192
//    0.189 / 0.290, 1x4096x16384 0.719 / 0.814, 1x6144x8192 0.547 / 0.599;
//  - where algo 0 ran (too short for segments): 1x2048x512 0.019 / 0.023, 1x2048x2048 0.052 / 0.086,
//    2x2048x1024 0.054 / 0.079, 1x4096x2048 0.100 / 0.153, 1x6144x2048 0.148 / 0.216;
//  - at 8192, against algo 1 at 4 lanes: 1x8192x16384 1.424 / 1.530, 1x8192x8192 0.721 / 0.769,
//    4x2048x4096 0.367 / 0.389, 4x2048x1024 0.101 / 0.105, 2x4096x512 0.059 / 0.056.
// Past 8192 algo 1 gains (12288 channels: 6x2048x4096 0.544 / 0.481, 1x12288x1024 0.149 / 0.127;
// 16384 at 8 states per thread: 8x2048x2048 0.376 / 0.254); below 2048 the grid leaves SMs idle
// (1x1024x65536 1.007 / 0.831 at 32 segments).
// Up to 512 steps, 4 warps: a tile is 16 warps steps, and 6 warps' 96-step tiles leave a partial last one
// (1x2048x512: 4 warps 0.0169 ms, 6 warps 0.0178; kspec tune --all-configs, H100, 2026-11-26, two runs).
constexpr int64_t kTileShortSeqlen = 512;
int64_t tile_warps(const Problem& p) { return p.has_dim("seqlen") && p.dim("seqlen") <= kTileShortSeqlen ? 4 : 6; }
Config tile_heuristic_config(const Problem& p) {
  return Config{{{"algo", 2}, {"warps", tile_warps(p)}, {"items", 4}, {"lanes", 1}, {"chunk", 32}, {"segs", 1}}};
}
constexpr int64_t kTileChannelsMin = 2048, kTileChannelsMost = 8192;
bool tile_preferred(const Problem& p) {
  if (!p.has_dim("seqlen")) return false;
  const int64_t chans = p.dim("batch") * p.dim("dim");
  if (chans < kTileChannelsMin || chans > kTileChannelsMost) return false;
  return tile_valid(p, tile_heuristic_config(p), nullptr);
}

// The forward's heuristic also takes 8 states per thread from 16k channels on (seq_default_lanes).
std::string fwd_key(const Problem& p) {
  const int64_t segs = default_segs(p, kFwdSegsMost);
  return even_key(p) + ",gfit|" + std::to_string(group_fit(p)) + (many_channels(p) ? ",wide" : ",narrow") +
         ",segs|" + std::to_string(segs) + ",lanes|" + std::to_string(seq_default_lanes(p, segs)) +
         (tile_vectors(p) ? ",v8" : "") +
         (tile_preferred(p) ? ",tile" + std::to_string(tile_warps(p)) : "") +
         few_key(few_channels_plan(p, kFwdSegsMost, 32, true));
}

// The backward's algo-0 warp fit, and the forward's distinctions for algo 1.
std::string bwd_all_key(const Problem& p) {
  return bwd_key(p) + ",gfit|" + std::to_string(group_fit(p)) + (many_channels(p) ? ",wide" : ",narrow") +
         ",segs|" + std::to_string(default_segs(p, kBwdSegsMost)) +
         few_key(few_channels_plan(p, kBwdSegsMost, 16, false));
}

// The rules of both sequential kernels; `prefetch_regs`: the forward's rule for the registers of its
// vectorized prefetch (the backward prefetches scalars).
bool seq_valid(const Problem& p, const Config& c, int64_t smem_bytes, bool prefetch_regs, std::string* why) {
  auto no = [&](const char* w) {
    if (why) *why = w;
    return false;
  };
  int64_t lanes = c.get("lanes"), n = p.dim("dstate");
  if (lanes > 1 && lanes > n) return no("more lanes per channel than states");
  if (seq_spt(p, c) > 8) return no("more than 8 states per thread (a group of 4 steps holds 8 B/C values per state)");
  if (prefetch_regs && is_even(p)) {
    // The next chunk's u, delta, z, B, C wait in registers during the scan, beside this chunk's z:
    // at most 40 of them (more spilled under NVRTC beside the scan's ~70).
    auto vecs = [&](DType dt, int64_t rows) { return ceil_div(rows * c.get("chunk") / (16 / dtype_size(dt)), c.get("warps") * 32); };
    int64_t regs = 4 * (vecs(p.dtype("u"), seq_channels(c)) * (p.present("z") ? 4 : 2) +
                        (var_b(p) ? vecs(p.dtype("B"), seq_spt(p, c) * lanes) : 0) +
                        (var_c(p) ? vecs(p.dtype("C"), seq_spt(p, c) * lanes) : 0));
    if (regs > 40) return no("the prefetched chunk would need more than 40 registers per thread");
  }
  if (seq_channels(c) > group_fit(p)) return no("a block's channels must lie in one B/C group");
  if (smem_bytes > kSeqSmemLimit) return no("more than 96 KiB of shared memory per block");
  return true;
}

TuningSpace fwd_tuning() {
  TuningSpace t;
  // algo 0: warp-scan (warps, items); algo 1: sequential states (warps, lanes, chunk, segs); algo 2: the
  // one-pass tile kernel (warps). Axes an algo does not use must hold their first value, so each kernel
  // appears once in the enumeration.
  t.axes = {{"algo", {0, 1, 2}}, {"warps", {2, 4, 6, 8}}, {"items", {4, 8, 16}}, {"lanes", {1, 2, 4, 8, 16, 32}},
            {"chunk", {32, 64, 128}}, {"segs", {1, 2, 4, 8, 16, 32}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (c.get("algo") == 2) return tile_valid(p, c, why);
    if (c.get("warps") == 6) {
      if (why) *why = "6 warps only for algo 2";
      return false;
    }
    if (c.get("algo") == 1) {
      if (c.get("items") != 4) {
        if (why) *why = "algo 1 does not use items (canonical value 4)";
        return false;
      }
      if (!segs_fit(p, c)) {
        if (why) *why = "segments of fewer than 4 chunks";
        return false;
      }
      return seq_valid(p, c, seq_fwd_smem_bytes(p, c), true, why);
    }
    if (c.get("lanes") != 1 || c.get("chunk") != 32 || c.get("segs") != 1) {
      if (why) *why = "algo 0 does not use lanes, chunk or segs (canonical values 1, 32, 1)";
      return false;
    }
    if (4 * c.get("warps") * p.dim("dstate") > kStaticSmemBytes) {
      if (why) *why = "the carried states do not fit in static shared memory";
      return false;
    }
    // 16 fp32 items per lane spilled 32 bytes on sm_80 (NVRTC 13.0) and load nothing wider than 8 do.
    if (c.get("items") * dtype_size(p.dtype("u")) > 32) {
      if (why) *why = "more than 32 bytes of u per lane and tile (registers would spill)";
      return false;
    }
    return true;
  };
  t.heuristic = [](const Problem& p) {
    if (tile_preferred(p)) return tile_heuristic_config(p);
    const FewChannels few = few_channels_plan(p, kFwdSegsMost, 32, true);
    for (int64_t warps : {4, 8, 2}) {
      if (!few.segs) break;
      Config c{{{"algo", 1}, {"warps", warps}, {"items", 4}, {"lanes", few.lanes}, {"chunk", 32}, {"segs", few.segs}}};
      if (segs_fit(p, c) && seq_valid(p, c, seq_fwd_smem_bytes(p, c), true, nullptr)) return c;
    }
    const int64_t segs = default_segs(p, kFwdSegsMost);
    if (many_channels(p) || segs > 1) {
      // H100, 8x2048x2048 bf16: (4 warps, 4 lanes, chunk 32) 0.314 ms; chunk 64 0.394 ms (its shared
      // memory halves the resident blocks); 2 or 8 warps and 2 lanes within 5%.
      for (int64_t warps : {4, 8, 2}) {
        Config c{{{"algo", 1}, {"warps", warps}, {"items", 4}, {"lanes", seq_default_lanes(p, segs)}, {"chunk", 32},
                  {"segs", segs}}};
        if (segs_fit(p, c) && seq_valid(p, c, seq_fwd_smem_bytes(p, c), true, nullptr)) return c;
      }
    }
    return Config{{{"algo", 0}, {"warps", 4}, {"items", 8}, {"lanes", 1}, {"chunk", 32}, {"segs", 1}}};
  };
  return t;
}

// The sequential backward holds the next chunk in registers (SeqBwdChunk): u, delta, dout, z per
// element of [channel][step], a variable B and C per element of [state][step]. Beyond 24 of them the
// kernel spilled under NVRTC 13.0 (it needs ~200 registers besides at 4 states per thread).
bool seq_bwd_prefetch_fits(const Problem& p, const Config& c) {
  int64_t threads = c.get("warps") * 32, chunk = c.get("chunk");
  int64_t pe = ceil_div(seq_channels(c) * chunk, threads);
  int64_t pn = ceil_div(seq_spt(p, c) * c.get("lanes") * chunk, threads);
  return pe * (2 + (p.present("z") ? 2 : 1)) + pn * ((var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0)) <= 24;
}

TuningSpace bwd_tuning() {
  TuningSpace t;
  // algo 0: warp-scan (warps, items; 16 items would hold ~13 arrays of 16 floats per lane: too many
  // registers); algo 1: sequential states (warps, lanes, chunk). Unused axes hold their first value.
  t.axes = {{"algo", {0, 1}}, {"warps", {1, 2, 4, 8}}, {"items", {4, 8}}, {"lanes", {1, 2, 4, 8, 16, 32}},
            {"chunk", {16, 32}}, {"segs", {1, 2, 4, 8, 16, 32}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    auto no = [&](const char* w) {
      if (why) *why = w;
      return false;
    };
    if (c.get("algo") == 1) {
      if (c.get("items") != 4) return no("algo 1 does not use items (canonical value 4)");
      if (!seq_bwd_prefetch_fits(p, c)) return no("the prefetched chunk would need more than 24 registers per thread");
      if (!segs_fit(p, c)) return no("segments of fewer than 4 chunks");
      return seq_valid(p, c, seq_bwd_smem_bytes(p, c), false, why);
    }
    if (c.get("lanes") != 1 || c.get("chunk") != 16 || c.get("segs") != 1)
      return no("algo 0 does not use lanes, chunk or segs (canonical values 1, 16, 1)");
    if (!bwd_warps_fit(p, c.get("warps"))) return no("warps must divide dim / groups with a variable B or C");
    if (bwd_smem_bytes(p, c.get("warps"), c.get("items")) > kStaticSmemBytes)
      return no("more static shared memory than 48 KiB");
    return true;
  };
  t.heuristic = [](const Problem& p) {
    const FewChannels few = few_channels_plan(p, kBwdSegsMost, 16, false);
    for (int64_t warps : {4, 8, 2}) {
      if (!few.segs) break;
      Config c{{{"algo", 1}, {"warps", warps}, {"items", 4}, {"lanes", few.lanes}, {"chunk", 16}, {"segs", few.segs}}};
      if (seq_bwd_prefetch_fits(p, c) && segs_fit(p, c) && seq_valid(p, c, seq_bwd_smem_bytes(p, c), false, nullptr))
        return c;
    }
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
      const int64_t lanes = lanes_for_states(p, 4);
      for (int64_t warps : {4, 8, 2}) {
        Config c{{{"algo", 1}, {"warps", warps}, {"items", 4}, {"lanes", lanes}, {"chunk", 16}, {"segs", segs}}};
        if (seq_bwd_prefetch_fits(p, c) && segs_fit(p, c) && seq_valid(p, c, seq_bwd_smem_bytes(p, c), false, nullptr))
          return c;
      }
    }
    for (int64_t w : {4, 2, 1})
      if (bwd_warps_fit(p, w) && bwd_smem_bytes(p, w, 8) <= kStaticSmemBytes)
        return Config{{{"algo", 0}, {"warps", w}, {"items", 8}, {"lanes", 1}, {"chunk", 16}, {"segs", 1}}};
    return Config{{{"algo", 0}, {"warps", 1}, {"items", 4}, {"lanes", 1}, {"chunk", 16}, {"segs", 1}}};
  };
  return t;
}

// ---- cases ----

struct CaseSpec {
  const char* name;
  int64_t batch, dim, seqlen, dstate, groups;
  bool softplus;
  std::vector<std::string> without;
  std::vector<std::string> alt;
};

std::vector<Case> scan_cases(bool with_seqlen) {
  std::vector<CaseSpec> specs = {
      {"base", 2, 64, 300, 16, 1, true, {}, {}},
      {"batch_1", 1, 64, 300, 16, 1, true, {"h0"}, {}},
      {"dim_37", 3, 37, 129, 16, 1, true, {}, {}},
      {"seqlen_1", 2, 40, 1, 16, 1, true, {}, {}},
      {"seqlen_2", 2, 40, 2, 16, 1, false, {}, {}},
      {"seqlen_1023", 2, 24, 1023, 16, 1, true, {}, {}},
      {"seqlen_even_1024", 2, 24, 1024, 16, 1, true, {}, {}},
      {"dstate_1", 2, 24, 200, 1, 1, true, {}, {}},
      {"dstate_4", 2, 24, 200, 4, 1, true, {}, {}},
      {"dstate_64", 2, 24, 200, 64, 1, true, {}, {}},
      {"dstate_256", 2, 16, 200, 256, 1, true, {}, {}},
      {"groups_4", 2, 64, 257, 16, 4, true, {}, {}},
      {"fixed_bc", 2, 48, 300, 16, 1, true, {}, {"B", "C"}},
      {"fixed_b", 2, 48, 300, 16, 2, true, {}, {"B"}},
      {"no_D", 2, 48, 300, 16, 1, true, {"D"}, {}},
      {"no_z", 2, 48, 300, 16, 1, true, {"z"}, {}},
      {"no_delta_bias", 2, 48, 300, 16, 1, true, {"delta_bias"}, {}},
      {"no_softplus", 2, 48, 300, 16, 1, false, {}, {}},
      {"none_optional", 2, 48, 300, 16, 1, false, {"D", "z", "delta_bias", "h0"}, {}},
      {"mamba_2x512x2048", 2, 512, 2048, 16, 1, true, {"h0"}, {}},
      {"long_65536", 1, 8, 65536, 16, 1, true, {}, {}},
      // batch * dim >= 8192: the heuristic's sequential-state kernel (the cases above take the warp scan)
      {"wide_8x1024", 8, 1024, 130, 16, 1, true, {}, {}},
      {"wide_even_8x1024", 8, 1024, 512, 16, 1, true, {"h0"}, {}},
      // few channels, long: the heuristic's sequential kernel over 4 segments in parallel
      {"segments_2x32x9000", 2, 32, 9000, 16, 1, true, {}, {}},
      // the same at a length of whole 512-step tiles: the segments' vector-load (kEven) paths
      {"segments_even_2x32x8192", 2, 32, 8192, 16, 1, true, {}, {}},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.batch}, {"dim", s.dim}, {"dstate", s.dstate}, {"groups", s.groups}};
    if (with_seqlen) {
      c.dims.emplace_back("seqlen", s.seqlen);
      c.dims.emplace_back("nstates", nstates_for(s.seqlen));
    }
    c.params = {{"delta_softplus", s.softplus}};
    c.without = s.without;
    c.alt_shapes = s.alt;
    if (s.alt.size() == 2) c.dims.erase(c.dims.begin() + 3);  // no groups without a variable B or C
    cases.push_back(std::move(c));
  }
  auto named = [&](const char* n) -> Case& {
    for (auto& c : cases)
      if (c.name == n) return c;
    throw InternalError(n);
  };
  named("mamba_2x512x2048").large = true;
  named("long_65536").large = true;
  // precompile --all: every config for the Mamba flags at dstate 16, and the largest state.
  named("base").representative = true;
  named("dstate_256").representative = true;
  // whole 512-step tiles at dstate 16: precompile --all compiles the one-pass tile kernel (algo 2), which
  // only these runtime dims admit, from this case
  named("seqlen_even_1024").representative = true;
  // B and C in fp32 beside 16-bit activations.
  Case f32bc = named("base");
  f32bc.name = "bc_fp32";
  f32bc.representative = false;
  f32bc.tensor_dtypes = {{"B", DType::f32}, {"C", DType::f32}};
  cases.push_back(f32bc);
  if (with_seqlen) {
    // Every case above runs as in training: the forward writes `states`, the backward reads them. These
    // run without: the forward for inference, the backward with its own forward pass (each algorithm,
    // and segments).
    named("none_optional").without.push_back("states");
    for (const char* n : {"base", "seqlen_1023", "dstate_64", "wide_8x1024", "wide_even_8x1024", "segments_2x32x9000",
                          "segments_even_2x32x8192"}) {
      Case c = named(n);
      c.name = std::string("no_states_") + n;
      c.representative = false;
      c.without.push_back("states");
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

OpDef scan_base(const char* name, const char* doc, bool with_seqlen) {
  OpDef op;
  op.info.name = name;
  op.info.family = "selective_scan";
  op.info.doc = doc;
  op.info.params = scan_params();
  op.info.dims = scan_dims(with_seqlen);
  op.info.reference = "api/ops/selective_scan/reference.cpp (python/kspec/reference/selective_scan.py)";
  op.info.constants = {{"state_stride", kStateStride}};  // kspec._torch allocates `states` with it
  op.check = check_scan;
  op.check_call = check_scan_call;
  // The tuning bucket: the default's, but nstates (seqlen's, derived).
  op.tune_bucket = [](const Problem& p) { return pow2_bucket(p, "nstates"); };
  op.cases = scan_cases(with_seqlen);
  op.compile_dims = {{"batch", 1}, {"dim", 1}, {"groups", 1}};
  if (with_seqlen) {
    op.compile_dims.emplace_back("seqlen", 1);
    op.derived_dims.emplace_back("nstates", [](const Problem& p) { return nstates_for(p.dim("seqlen")); });
  }
  op.dtypes = kFloatTypes;
  // fp32 over recurrences of hundreds to 65536 steps, with ex2.approx decays: 4e-5.
  op.tolerance_scale = 4.0;
  return op;
}

unsigned u32(int64_t v) { return static_cast<unsigned>(v); }

void check_launch_sizes(const Call& call) {
  const Problem& p = call.problem;
  KSPEC_CHECK(p.dim("batch") <= 65535, p.op->info.name, ": input 'u': batch = ", p.dim("batch"), " exceeds 65535");
  KSPEC_CHECK(p.dim("dim") <= INT32_MAX / 32 && (!p.has_dim("seqlen") || p.dim("seqlen") <= INT32_MAX / 2),
              p.op->info.name, ": input 'u': dim or seqlen too large");
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
  op.tuning = fwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.derived_key = fwd_key;
  op.kernels = [](const Problem& p, const Config& c) {
    if (c.get("algo") == 2)
      return std::vector<jit::KernelSpec>{
          spec(p, kTileHeader, "kspec::selective_scan_fwd_tile_kernel", {tile_traits(p, c)})};
    if (c.get("algo") == 1) {
      std::vector<jit::KernelSpec> k = {
          spec(p, kSequentialHeader, "kspec::selective_scan_fwd_seq_kernel", {seq_traits(p, c)})};
      if (c.get("segs") > 1)
        k.push_back(spec(p, kSequentialHeader, "kspec::selective_scan_seg_fwd_kernel", {seq_traits(p, c)}));
      return k;
    }
    return std::vector<jit::KernelSpec>{spec(p, kWarpScanHeader, "kspec::selective_scan_fwd_kernel", {traits(p, c)})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    check_launch_sizes(call);
    const Problem& p = call.problem;
    int dim = static_cast<int>(p.dim("dim")), seqlen = static_cast<int>(p.dim("seqlen"));
    int groups = static_cast<int>(groups_of(p)), cpg = dim / groups;
    void *u = call.in("u").data, *delta = call.in("delta").data, *A = call.in("A").data, *B = call.in("B").data,
         *C = call.in("C").data, *D = call.in("D").data, *z = call.in("z").data,
         *bias = call.in("delta_bias").data, *h0 = call.in("h0").data, *out = call.out("out").data,
         *last = call.out("last_state").data, *states = call.out("states").data;
    void* args[] = {&u, &delta, &A, &B, &C, &D, &z, &bias, &h0, &out, &last, &dim, &seqlen, &cpg, &groups, &states};
    int64_t warps = c.get("warps");
    if (seqlen == 0 || dim == 0) return;
    // A block's channels share one B/C group for algos 1 and 2 (the tuning space's rule, kept apart in the
    // plan cache by fwd_key); algo 0's warps each read their own channel's group.
    const int64_t block_channels = c.get("algo") == 2 ? kTileChannels : c.get("algo") == 1 ? seq_channels(c) : 1;
    KSPEC_CHECK_AS(block_channels <= group_fit(p), InternalError, "selective_scan.fwd: config ", c.str(),
                   " puts channels of two B/C groups in one block (a plan chosen for another dim?)");
    if (c.get("algo") == 2) {
      KSPEC_CHECK_AS(tile_offsets_fit(p), InternalError, "selective_scan.fwd: config ", c.str(),
                     " addresses rows with 32-bit offsets: seqlen = ", p.dim("seqlen"),
                     " is too long (a plan chosen for another seqlen?)");
      return l.launch(0, {u32(ceil_div(dim, kTileChannels)), u32(p.dim("batch"))}, {u32(warps * 32)},
                      static_cast<unsigned>(tile_smem_bytes(p, c)), args);
    }
    if (c.get("algo") == 1) {
      SegPlan sp = seg_plan(p, c);
      int64_t chans = p.dim("batch") * p.dim("dim");
      float *seg_h = nullptr, *seg_dt = nullptr;
      unsigned* seg_ready = nullptr;
      const unsigned gx = u32(ceil_div(dim, seq_channels(c))), gy = u32(p.dim("batch"));
      const unsigned smem = static_cast<unsigned>(seq_fwd_smem_bytes(p, c));
      void* margs[] = {&u,    &delta, &A,      &B,   &C,      &D,     &z,      &bias,      &h0,       &out,
                       &last, &dim,   &seqlen, &cpg, &groups, &seg_h, &seg_dt, &sp.seg_len, &sp.nsegs, &states,
                       &seg_ready};
      if (sp.nsegs == 1) return l.launch(0, {gx, gy, 1}, {u32(warps * 32)}, smem, margs);
      // Every segment but the last from a zero state: its end state and sum of dt, and a flag per
      // (batch, channel block, segment) set once they are written (workspace; the flags zeroed here). The
      // main kernel starts beside the local pass and waits on the flags (see "segments" in sequential.cuh).
      const int64_t nflags = int64_t(gx) * gy * sp.nsegs;
      seg_h = static_cast<float*>(
          l.workspace(sizeof(float) * chans * sp.nsegs * (p.dim("dstate") + 1) + sizeof(unsigned) * nflags));
      seg_dt = seg_h + chans * sp.nsegs * p.dim("dstate");
      seg_ready = reinterpret_cast<unsigned*>(seg_dt + chans * sp.nsegs);
      CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(seg_ready), 0, static_cast<size_t>(nflags),
                                reinterpret_cast<CUstream>(call.stream)));
      void* sargs[] = {&u,      &delta, &A,   &B,      &bias,      &seg_h,    &seg_dt,
                       &dim,    &seqlen, &cpg, &groups, &sp.seg_len, &sp.nsegs, &seg_ready};
      l.launch(1, {gx, gy, u32(sp.nsegs - 1)}, {u32(warps * 32)}, static_cast<unsigned>(seq_seg_smem_bytes(p, c)),
               sargs);
      l.launch_dependent(0, {gx, gy, u32(sp.nsegs)}, {u32(warps * 32)}, smem, margs);
      return;
    }
    l.launch(0, {u32(ceil_div(dim, warps)), u32(p.dim("batch"))}, {u32(warps * 32)}, 0, args);
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
  op.tuning = bwd_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.derived_key = bwd_all_key;
  op.kernels = [](const Problem& p, const Config& c) {
    std::vector<std::string> red = {dtype_cuda_type(p.dtype("B")), dtype_cuda_type(p.dtype("C")),
                                    std::to_string(p.dim("dstate")), b2s(var_b(p)), b2s(var_c(p)),
                                    b2s(p.present("D")), b2s(p.present("delta_bias"))};
    const bool seq = c.get("algo") == 1;
    std::vector<jit::KernelSpec> k = {
        seq ? spec(p, kSequentialHeader, "kspec::selective_scan_bwd_seq_kernel", {seq_traits(p, c)})
            : spec(p, kWarpScanHeader, "kspec::selective_scan_bwd_kernel", {traits(p, c)}),
        spec(p, kReduceHeader, "kspec::selective_scan_bwd_reduce_kernel", red),
        spec(p, kReduceHeader, "kspec::selective_scan_bwd_zero_kernel", {})};
    if (seq && c.get("segs") > 1) {
      k.push_back(spec(p, kSequentialHeader, "kspec::selective_scan_seg_fwd_kernel", {seq_traits(p, c)}));
      k.push_back(spec(p, kSequentialHeader, "kspec::selective_scan_seg_bwd_kernel", {seq_traits(p, c)}));
    }
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    check_launch_sizes(call);
    const Problem& p = call.problem;
    int64_t batch = p.dim("batch"), dim64 = p.dim("dim"), seq64 = p.dim("seqlen"), N = p.dim("dstate");
    int64_t warps = c.get("warps"), items = c.get("items");
    const bool seq = c.get("algo") == 1;
    int dim = static_cast<int>(dim64), seqlen = static_cast<int>(seq64);
    int groups = static_cast<int>(groups_of(p)), cpg = dim / groups;
    bool vb = var_b(p), vc = var_c(p);
    if (dim == 0 || batch == 0) return;
    KSPEC_CHECK(seqlen > 0, "selective_scan.bwd: input 'u': seqlen must be at least 1");
    // Workspace: tile (algo 0) or chunk (algo 1) states | per-channel (and segment) partials | variable
    // dB, dC accumulators | with segments, their local end states, adjoints and sums of dt (fp32).
    SegPlan sp = seq ? seg_plan(p, c) : SegPlan{seqlen, 1};
    void* given = call.in("states").data;  // the forward's states: no forward pass, no workspace for them
    int64_t ntiles = ceil_div(seq64, seq ? c.get("chunk") : 32 * items);
    int64_t n_states = given ? 0 : batch * dim64 * ntiles * N, n_part = batch * sp.nsegs * dim64 * (3 * N + 2);
    int64_t n_var = batch * groups * N * seq64;
    int64_t n_db = vb ? n_var : 0, n_dc = vc ? n_var : 0;
    int64_t n_seg = sp.nsegs > 1 ? batch * dim64 * sp.nsegs * (2 * N + 1) : 0;
    auto* ws = static_cast<float*>(l.workspace(sizeof(float) * (n_states + n_part + n_db + n_dc + n_seg)));
    float *states = ws, *part = ws + n_states, *db_acc = part + n_part, *dc_acc = db_acc + n_db;
    float *seg_h = sp.nsegs > 1 ? dc_acc + n_dc : nullptr;
    float *seg_g = seg_h ? seg_h + batch * dim64 * sp.nsegs * N : nullptr;
    float *seg_dt = seg_g ? seg_g + batch * dim64 * sp.nsegs * N : nullptr;
    int sms = l.multiprocessors();
    if (vb || vc) {
      long long na = n_db, nb = n_dc;
      void* zargs[] = {&db_acc, &na, &dc_acc, &nb};
      l.launch(2, {u32(std::min<int64_t>(ceil_div(std::max(na, nb), 256), 8 * sms))}, {256}, 0, zargs);
    }
    void *u = call.in("u").data, *delta = call.in("delta").data, *A = call.in("A").data, *B = call.in("B").data,
         *C = call.in("C").data, *D = call.in("D").data, *z = call.in("z").data,
         *bias = call.in("delta_bias").data, *h0 = call.in("h0").data, *dout = call.in("dout").data,
         *dlast = call.in("dlast_state").data;
    void *du = call.out("du").data, *ddelta = call.out("ddelta").data, *dz = call.out("dz").data,
         *dh0 = call.out("dh0").data;
    void* args[] = {&u,      &delta, &A,   &B,      &C,      &D,      &z,    &bias, &h0,     &dout, &dlast,  &du,
                    &ddelta, &dz,    &dh0, &db_acc, &dc_acc, &states, &part, &dim,  &seqlen, &cpg,  &groups, &given};
    if (seq) {
      // A block's channels share one group (the tuning space's rule, kept apart in the plan cache by the key).
      KSPEC_CHECK_AS(seq_channels(c) <= group_fit(p), InternalError, "selective_scan.bwd: config ", c.str(),
                     " puts channels of two B/C groups in one block (a plan chosen for another dim?)");
      const unsigned gx = u32(ceil_div(dim, seq_channels(c))), gy = u32(batch), threads = u32(warps * 32);
      if (sp.nsegs > 1) {
        // The segments' local forward (all but the last; not needed with the forward's states) and adjoint
        // (all but the first) passes.
        const unsigned smem = static_cast<unsigned>(seq_seg_smem_bytes(p, c));
        unsigned* no_flags = nullptr;  // the backward's kernels run one after the other
        void* fargs[] = {&u,      &delta, &A,   &B,      &bias,      &seg_h,    &seg_dt,
                         &dim,    &seqlen, &cpg, &groups, &sp.seg_len, &sp.nsegs, &no_flags};
        if (!given) l.launch(3, {gx, gy, u32(sp.nsegs - 1)}, {threads}, smem, fargs);
        void* gargs[] = {&delta, &A,   &C,      &z,   &bias,   &dout,      &seg_g,   &seg_dt,
                         &dim,   &seqlen, &cpg, &groups, &sp.seg_len, &sp.nsegs};
        l.launch(4, {gx, gy, u32(sp.nsegs - 1)}, {threads}, smem, gargs);
      }
      void* sargs[] = {&u,      &delta,  &A,     &B,     &C,      &D,    &z,      &bias,   &h0,     &dout,
                       &dlast,  &du,     &ddelta, &dz,   &dh0,    &db_acc, &dc_acc, &states, &part,   &dim,
                       &seqlen, &cpg,    &groups, &seg_h, &seg_g, &seg_dt, &sp.seg_len, &sp.nsegs, &given};
      l.launch(0, {gx, gy, u32(sp.nsegs)}, {threads}, static_cast<unsigned>(seq_bwd_smem_bytes(p, c)), sargs);
    } else {
      // With a variable B/C, warps divides dim / groups (the tuning space's rule, kept apart in the plan
      // cache by bwd_key), so blocks are whole: a partial block's extra warps would write other rows.
      KSPEC_CHECK_AS(bwd_warps_fit(p, warps), InternalError, "selective_scan.bwd: config warps = ", warps,
                     " does not divide dim / groups = ", cpg, " (a plan chosen for another dim?)");
      l.launch(0, {u32(ceil_div(dim, warps)), u32(batch)}, {u32(warps * 32)}, 0, args);
    }
    void *dA = call.out("dA").data, *dB = call.out("dB").data, *dC = call.out("dC").data,
         *dD = call.out("dD").data, *ddb = call.out("ddelta_bias").data;
    int batch_i = static_cast<int>(batch * sp.nsegs);  // partials per (batch, segment)
    long long var_elems = (vb || vc) ? n_var : 0;
    void* rargs[] = {&part, &db_acc, &dc_acc, &dA, &dB, &dC, &dD, &ddb, &batch_i, &dim, &var_elems};
    int64_t work = std::max<int64_t>({dim64 * N, dim64, var_elems});
    l.launch(1, {u32(std::min<int64_t>(ceil_div(work, 256), 8 * sms))}, {256}, 0, rargs);
  };
  for (auto& c : op.cases)
    if (c.name == std::string("none_optional")) c.without.push_back("dlast_state");
  op.reference = bwd_reference;
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) {
    make_stable(p, in, 1);
    if (!in[11].defined) return;
    // The states a forward of these very inputs would have written (as the GPU will see them).
    for (size_t i = 1; i <= 9; ++i)
      if (in[i].defined) quantize(p.inputs[i].dtype, in[i].data);
    in[11].data = ref::selective_scan_fwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 1), kStateStride).states;
  };
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
    return std::vector<jit::KernelSpec>{spec(
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
  // The reference: one step of the scan from h0 = state (seqlen 1), B/C [batch, groups, dstate, 1].
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    ref::ScanShape s;
    s.batch = p.dim("batch");
    s.dim = p.dim("dim");
    s.seqlen = 1;
    s.dstate = p.dim("dstate");
    s.groups = groups_of(p);
    s.variable_b = var_b(p);
    s.variable_c = var_c(p);
    ref::ScanInputs r;
    r.h0 = in[0].data;
    r.u = in[1].data;
    r.delta = in[2].data;
    r.A = in[3].data;
    r.B = in[4].data;
    r.C = in[5].data;
    r.D = or_empty(in[6]);
    r.z = or_empty(in[7]);
    r.delta_bias = or_empty(in[8]);
    r.delta_softplus = p.param_bool("delta_softplus");
    auto o = ref::selective_scan_fwd_ref(s, r);
    return std::vector<HostTensor>{{true, in[1].shape, std::move(o.out)}, {true, in[0].shape, std::move(o.last_state)}};
  };
  op.prepare_inputs = [](const Problem& p, std::vector<HostTensor>& in) {
    for (auto& a : in[3].data) a = -(0.25 + std::fabs(a));
    if (!p.param_bool("delta_softplus")) {
      for (auto& v : in[2].data) v = 0.05 + 0.5 * std::fabs(v);
      if (in[8].defined)
        for (auto& v : in[8].data) v = 0.1 * std::fabs(v);
    }
  };
  return op;
}

}  // namespace

void register_selective_scan(Registry& r) {
  r.add(make_fwd());
  r.add(make_bwd());
  r.add(make_step());
}

}  // namespace kspec
