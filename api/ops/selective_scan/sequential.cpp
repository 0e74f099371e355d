// The sequential-state algorithm (algo=sequential; templates/selective_scan/sequential*.cuh): a thread
// holds a few states of one channel in registers and walks time in order; few channels and long
// sequences cut time into segments run in parallel. Forward and backward, their heuristics' rules.
#include <algorithm>

#include "jit/driver.h"
#include "selective_scan/scan.h"

namespace kspec::scan {
namespace {

constexpr const char* kFwdHeader = "selective_scan/sequential_fwd.cuh";
constexpr const char* kBwdHeader = "selective_scan/sequential_bwd.cuh";
constexpr const char* kSegmentsHeader = "selective_scan/sequential_segments.cuh";

std::string traits(const Problem& p, const Config& c) {
  return "kspec::SeqScanTraits<" + flags_type(p, is_even(p)) + ", " + std::to_string(c.get("warps")) + ", " +
         std::to_string(c.get("lanes")) + ", " + std::to_string(c.get("chunk")) + ">";
}

int64_t seq_spt(const Problem& p, const Config& c) { return ceil_div(p.dim("dstate"), c.get("lanes")); }

// Dynamic shared memory of the sequential forward (seq_fwd_smem_floats in sequential_fwd.cuh).
int64_t seq_fwd_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), cs = seq_channels(c) + 1, np = seq_spt(p, c) * c.get("lanes");
  const int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  return 4 * (4 * chunk * cs + nvar * chunk * np);
}

// Dynamic shared memory of the segments' local passes (seq_seg_smem_floats in sequential_segments.cuh).
int64_t seq_seg_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), cs = seq_channels(c) + 1, np = seq_spt(p, c) * c.get("lanes");
  return 4 * (2 * chunk * cs + (var_bc(p) ? chunk * np : 0));
}

// Dynamic shared memory of the sequential backward (seq_bwd_smem_floats in sequential_chunks.cuh).
int64_t seq_bwd_smem_bytes(const Problem& p, const Config& c) {
  int64_t chunk = c.get("chunk"), nc = seq_channels(c), cs = nc + 1, np = seq_spt(p, c) * c.get("lanes");
  const int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  int64_t scalars = 2 + (p.param_bool("delta_softplus") ? 1 : 0) + (p.present("z") ? 2 : 0);
  return 4 * (4 * chunk * (nc + 1) + (nvar ? chunk * (2 * np + 4) : 0) +
              chunk * seq_spt(p, c) * c.get("warps") * 32 + scalars * chunk * cs +
              nvar * c.get("warps") * np * (chunk + 1));
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

// The rules of both sequential kernels; `prefetch_regs`: the forward's rule for the registers of its
// vectorized prefetch (the backward prefetches scalars).
bool seq_valid(const Problem& p, const Config& c, bool prefetch_regs, std::string* why) {
  int64_t lanes = c.get("lanes"), n = p.dim("dstate");
  if (lanes > 1 && lanes > n) return no(why, "more lanes per channel than states");
  if (seq_spt(p, c) > 8) return no(why, "more than 8 states per thread (a group of 4 steps holds 8 B/C values per state)");
  if (prefetch_regs && is_even(p)) {
    // The next chunk's u, delta, z, B, C wait in registers during the scan, beside this chunk's z:
    // at most 40 of them (more spilled under NVRTC beside the scan's ~70).
    auto vecs = [&](DType dt, int64_t rows) { return ceil_div(rows * c.get("chunk") / (16 / dtype_size(dt)), c.get("warps") * 32); };
    int64_t regs = 4 * (vecs(p.dtype("u"), seq_channels(c)) * (p.present("z") ? 4 : 2) +
                        (var_b(p) ? vecs(p.dtype("B"), seq_spt(p, c) * lanes) : 0) +
                        (var_c(p) ? vecs(p.dtype("C"), seq_spt(p, c) * lanes) : 0));
    if (regs > 40) return no(why, "the prefetched chunk would need more than 40 registers per thread");
  }
  if (seq_channels(c) > group_fit(p)) return no(why, "a block's channels must lie in one B/C group");
  return true;
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

bool fwd_valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("warps") == 6) return no(why, "6 warps only for algo=tile");
  if (c.get("items") != 4) return no(why, "algo=sequential does not use items (canonical value 4)");
  if (!segs_fit(p, c)) return no(why, "segments of fewer than 4 chunks");
  return seq_valid(p, c, true, why);
}

std::vector<jit::KernelSpec> fwd_kernels(const Problem& p, const Config& c) {
  std::vector<jit::KernelSpec> k = {kernel(p, kFwdHeader, "kspec::selective_scan_fwd_seq_kernel", traits(p, c))};
  if (c.get("segs") > 1) k.push_back(kernel(p, kSegmentsHeader, "kspec::selective_scan_seg_fwd_kernel", traits(p, c)));
  return k;
}

// A block's channels share one B/C group (the tuning space's rule, kept apart in the plan cache by the
// op's derived key).
void check_block_group(const Call& call, const Config& c, const char* op) {
  KSPEC_CHECK_AS(seq_channels(c) <= group_fit(call.problem), InternalError, op, ": config ", c.str(call.problem.op->info),
                 " puts channels of two B/C groups in one block (a plan chosen for another dim?)");
}

void fwd_launch(const Call& call, const Config& c, Launcher& l, ScanParams& s) {
  check_block_group(call, c, "selective_scan.fwd");
  const Problem& p = call.problem;
  const SegPlan sp = seg_plan(p, c);
  s.seg_len = sp.seg_len;
  s.nsegs = sp.nsegs;
  const unsigned gx = u32(ceil_div(s.dim, seq_channels(c))), gy = u32(p.dim("batch")), threads = u32(c.get("warps") * 32);
  const unsigned smem = static_cast<unsigned>(seq_fwd_smem_bytes(p, c));
  auto args = fwd_seq_args(s);  // the fields' addresses: the segments' pointers set below are read at launch
  if (sp.nsegs == 1) return l.launch(0, {gx, gy, 1}, {threads}, smem, args.data());
  // Every segment but the last from a zero state: its end state and sum of dt, and a flag per
  // (batch, channel block, segment) set once they are written (workspace; the flags zeroed here). The
  // main kernel starts beside the local pass and waits on the flags (see "segments" in sequential.cuh).
  const int64_t chans = p.dim("batch") * p.dim("dim"), nflags = int64_t(gx) * gy * sp.nsegs;
  s.seg_h = static_cast<float*>(
      l.workspace(sizeof(float) * chans * sp.nsegs * (p.dim("dstate") + 1) + sizeof(unsigned) * nflags));
  s.seg_dt = s.seg_h + chans * sp.nsegs * p.dim("dstate");
  s.seg_ready = reinterpret_cast<unsigned*>(s.seg_dt + chans * sp.nsegs);
  CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(s.seg_ready), 0, static_cast<size_t>(nflags),
                            reinterpret_cast<CUstream>(call.stream)));
  l.launch(1, {gx, gy, u32(sp.nsegs - 1)}, {threads}, static_cast<unsigned>(seq_seg_smem_bytes(p, c)),
           seg_fwd_args(s).data());
  l.launch_dependent(0, {gx, gy, u32(sp.nsegs)}, {threads}, smem, args.data());
}

bool bwd_valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("items") != 4) return no(why, "algo=sequential does not use items (canonical value 4)");
  if (!seq_bwd_prefetch_fits(p, c)) return no(why, "the prefetched chunk would need more than 24 registers per thread");
  if (!segs_fit(p, c)) return no(why, "segments of fewer than 4 chunks");
  return seq_valid(p, c, false, why);
}

std::vector<jit::KernelSpec> bwd_kernels(const Problem& p, const Config& c) {
  std::vector<jit::KernelSpec> k = {kernel(p, kBwdHeader, "kspec::selective_scan_bwd_seq_kernel", traits(p, c))};
  if (c.get("segs") > 1) {
    k.push_back(kernel(p, kSegmentsHeader, "kspec::selective_scan_seg_fwd_kernel", traits(p, c)));
    k.push_back(kernel(p, kSegmentsHeader, "kspec::selective_scan_seg_bwd_kernel", traits(p, c)));
  }
  return k;
}

BwdWork bwd_work(const Problem& p, const Config& c) {
  const SegPlan sp = seg_plan(p, c);
  BwdWork w;
  w.seg_len = sp.seg_len;
  w.nsegs = sp.nsegs;
  w.ntiles = ceil_div(p.dim("seqlen"), c.get("chunk"));
  return w;
}

// The segments' buffers (seg_h, seg_g, seg_dt) follow the backward's other workspace (op.cpp).
void bwd_launch(const Call& call, const Config& c, Launcher& l, const BwdWork& w, ScanParams& s) {
  check_block_group(call, c, "selective_scan.bwd");
  const Problem& p = call.problem;
  const unsigned gx = u32(ceil_div(s.dim, seq_channels(c))), gy = u32(p.dim("batch")), threads = u32(c.get("warps") * 32);
  if (w.nsegs > 1) {
    // The segments' local forward (all but the last; not needed with the forward's states) and adjoint
    // (all but the first) passes. The backward's kernels run one after the other: no ready flags.
    const unsigned smem = static_cast<unsigned>(seq_seg_smem_bytes(p, c));
    s.seg_ready = nullptr;
    if (!s.given) l.launch(3, {gx, gy, u32(w.nsegs - 1)}, {threads}, smem, seg_fwd_args(s).data());
    l.launch(4, {gx, gy, u32(w.nsegs - 1)}, {threads}, smem, seg_bwd_args(s).data());
  }
  l.launch(0, {gx, gy, u32(w.nsegs)}, {threads}, static_cast<unsigned>(seq_bwd_smem_bytes(p, c)),
           bwd_seq_args(s).data());
}

}  // namespace

int64_t seq_channels(const Config& c) { return c.get("warps") * 32 / c.get("lanes"); }

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

Config seq_config(int64_t warps, int64_t lanes, int64_t chunk, int64_t segs) {
  return Config{{{"algo", kSequential}, {"warps", warps}, {"items", 4}, {"lanes", lanes}, {"chunk", chunk}, {"segs", segs}}};
}

const FwdAlgorithm kSequentialFwd = {kSequential, fwd_valid, fwd_kernels, fwd_launch, seq_fwd_smem_bytes};
const BwdAlgorithm kSequentialBwd = {kSequential, bwd_valid, bwd_kernels, bwd_work, bwd_launch, seq_bwd_smem_bytes};

}  // namespace kspec::scan
