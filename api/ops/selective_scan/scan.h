// What the selective_scan family's files share: the problem's facts (variable B/C, groups, even
// lengths), its template arguments, and one object per algorithm. schema.cpp: tensors, cases,
// references; warp.cpp, sequential.cpp, tile.cpp: an algorithm each (legal configs, kernels, launch,
// shared memory); op.cpp: the OpDefs (tuning spaces and heuristics over the algorithms).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "selective_scan/params.h"

namespace kspec::scan {

// The `algo` tuning axis: a named choice (OpInfo::tuning_names); the numbers are those older tuning
// databases and scripts hold.
enum Algo : int64_t { kWarp = 0, kSequential = 1, kTile = 2, kWide = 3 };
extern const std::vector<std::string> kAlgoNames;  // {"warp", "sequential", "tile", "wide"}

constexpr const char* kReduceHeader = "selective_scan/reduce.cuh";  // the backward's zero and pass 2
constexpr const char* kStepHeader = "selective_scan/step.cuh";
constexpr int64_t kMaxDstate = 256;
// The largest tile (32 lanes x 16 items): a seqlen that is a multiple of it is a multiple of every
// config's tile, so "even" can be decided before the config is.
constexpr int64_t kEvenMultiple = 512;
constexpr int64_t kStaticSmemBytes = 48 * 1024;
constexpr int64_t kSeqSmemLimit = 96 * 1024;
// The forward's states for the backward: every 16 steps (kStateStride in selective_scan/common.cuh).
constexpr int64_t kStateStride = 16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t nstates_for(int64_t seqlen) { return ceil_div(seqlen, kStateStride); }
inline const char* b2s(bool b) { return b ? "true" : "false"; }
inline unsigned u32(int64_t v) { return static_cast<unsigned>(v); }

inline bool var_b(const Problem& p) { return !p.alt("B"); }
inline bool var_c(const Problem& p) { return !p.alt("C"); }
inline bool var_bc(const Problem& p) { return var_b(p) || var_c(p); }
// The `layout` param "bld" (fwd and bwd): u, delta, z, out and their gradients lie as [batch, seqlen, dim],
// a variable B/C as [batch, seqlen, groups, dstate] (views [batch, dim, seqlen] with seqlen stride dim):
// read and written where they lie by the sequential kernels' element-wise staging (kTimeMajor), without
// segments; the warp and tile kernels read bdl only.
bool time_major(const Problem& p);
int64_t groups_of(const Problem& p);
bool is_even(const Problem& p);
// The tile kernel's (algo 2) vectors: a variable B/C row's 16-byte vectors of 8 steps and a lane's 4 steps
// of u, delta, z, out start at aligned addresses when seqlen is a multiple of 8 and the tensors are
// 16-byte aligned; a run of 16 steps may then be cut by the sequence's end at 8.
bool tile_vectors(const Problem& p);
// The largest power of two (up to 256) dividing dim / groups when a variable B/C has several groups:
// a block's channels must share one group, so this decides which block widths are legal.
int64_t group_fit(const Problem& p);
// Enough channels for the sequential kernel to fill the GPU: batch * dim * lanes threads (an H100
// needs ~16k resident threads at the least). Below that the warp-scan kernel's one warp per channel
// keeps more of it busy.
inline bool many_channels(const Problem& p) { return p.dim("batch") * p.dim("dim") >= 8192; }

// The template's ScanFlags<T, TB, TC, dstate, var B, var C, D, z, delta_bias, softplus, h0, vectors>
// (selective_scan/common.cuh); `vectors` is the algorithm's own (is_even or tile_vectors).
std::string flags_type(const Problem& p, bool vectors);
jit::KernelSpec kernel(const Problem& p, const char* header, const char* name, std::string traits);

// The kernels' arguments from the call's tensors and sizes (the workspace's pointers and
// the segments' are filled by the algorithm's launch).
ScanParams scan_params_of(const Call& call);

// A config's rule-out reason, written once: `return no(why, "...")`.
inline bool no(std::string* why, const char* reason) {
  if (why) *why = reason;
  return false;
}

// The backward's workspace, laid out once for both algorithms (op.cpp) and read by their launches.
struct BwdWork {
  int seg_len = 0, nsegs = 1;  // segments along time (the sequential algorithm's; else one)
  int64_t ntiles = 0;          // state checkpoints per channel (tiles or chunks)
};

// One algorithm of a direction: which configs it takes (op.cpp adds the limit on shared_bytes), its
// kernels (index = Launcher kernel number), its launch and its main kernel's dynamic shared memory.
// The plan's config picks one (its `algo`).
struct FwdAlgorithm {
  Algo id;
  bool (*valid)(const Problem&, const Config&, std::string* why);
  std::vector<jit::KernelSpec> (*kernels)(const Problem&, const Config&);
  void (*launch)(const Call&, const Config&, Launcher&, ScanParams&);
  int64_t (*shared_bytes)(const Problem&, const Config&);
};
// The backward's kernels 1 and 2 are the reduce and zero kernels (reduce.cuh), launched by op.cpp; an
// algorithm's kernels are its main kernel (0), then its own from 3 on.
struct BwdAlgorithm {
  Algo id;
  bool (*valid)(const Problem&, const Config&, std::string* why);
  std::vector<jit::KernelSpec> (*kernels)(const Problem&, const Config&);
  BwdWork (*work)(const Problem&, const Config&);
  void (*launch)(const Call&, const Config&, Launcher&, const BwdWork&, ScanParams&);
  int64_t (*shared_bytes)(const Problem&, const Config&);
};

extern const FwdAlgorithm kWarpFwd, kSequentialFwd, kTileFwd, kWideFwd;
extern const BwdAlgorithm kWarpBwd, kSequentialBwd;

// ---- the warp scan (warp.cpp) ----
// Every warp of a block must be a channel of one group when the backward sums a variable dB/dC over
// the block (and the block barriers need all of its warps).
bool bwd_warps_fit(const Problem& p, int64_t warps);
int64_t bwd_smem_bytes(const Problem& p, int64_t warps, int64_t items);
Config warp_config(int64_t warps, int64_t items, int64_t chunk);

// ---- the sequential states (sequential.cpp) ----
int64_t seq_channels(const Config& c);
int64_t lanes_for_states(const Problem& p, int64_t most);
int64_t seq_default_lanes(const Problem& p, int64_t segs);
int64_t default_segs(const Problem& p, int64_t most);
constexpr int64_t kFwdSegsMost = 32, kBwdSegsMost = 16;
struct FewChannels {
  int64_t segs = 0;  // 0: the rule does not apply
  int64_t lanes = 0;
};
FewChannels few_channels_plan(const Problem& p, int64_t most, int64_t chunk, bool fwd);
std::string few_key(const FewChannels& f);
Config seq_config(int64_t warps, int64_t lanes, int64_t chunk, int64_t segs);

// ---- the tile kernel (tile.cuh) ----
constexpr int64_t kTileChannels = 8;
int64_t tile_warps(const Problem& p);
bool tile_preferred(const Problem& p);
Config tile_heuristic_config(const Problem& p);

// ---- the wide kernel (wide.cuh) ----
bool wide_preferred(const Problem& p);
Config wide_heuristic_config(const Problem& p);

// ---- schema.cpp ----
extern const std::vector<DType> kFloatTypes;
extern const std::vector<std::string> kBDT, kVarBC, kFixedBC, kState, kStates;
// Every scan tensor is contiguous, but those a layout "bld" call gives time-major (check_scan_call).
TensorDef tensor(std::string name, std::vector<std::string> shape, std::vector<DType> dtypes, std::string dtype_of,
                 bool or_f32, bool optional, std::string present_with, std::string doc,
                 std::vector<std::string> alt = {});
std::vector<TensorDef> scan_inputs();  // u, delta, A, B, C, D, z, delta_bias, h0
OpDef scan_base(const char* name, const char* doc, bool with_seqlen);
void check_launch_sizes(const Call& call);
std::string even_key(const Problem& p);
std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in);
std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in);
std::vector<HostTensor> step_reference(const Problem& p, const std::vector<HostTensor>& in);
void make_stable(const Problem& p, std::vector<HostTensor>& in, size_t first);
void prepare_bwd_inputs(const Problem& p, std::vector<HostTensor>& in);

}  // namespace kspec::scan
