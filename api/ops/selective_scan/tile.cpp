// The one-pass tile kernel (algo=tile, forward only; templates/selective_scan/tile.cuh): a block's
// warps run along time, 8 channels of dstate 16 per block (4 at lanes=8); and when the heuristic takes it.
#include "selective_scan/scan.h"

namespace kspec::scan {
namespace {

constexpr const char* kHeader = "selective_scan/tile.cuh";
// A warp's 32 lanes are (channel, group of states): lanes=1 (the canonical value) is 4 lanes of 4 states a
// channel, 8 channels a block; lanes=8 is 8 lanes of 2 states, 4 channels a block (TileScanTraits' kStates),
// at 2 or 4 warps. A block holds `warps` runs of 16 steps (8 at 8 warps: TileScanTraits::kRun).
constexpr int64_t kTileDstate = 16;  // the lane map's (valid() refuses any other)
int64_t tile_states(const Config& c) { return c.get("lanes") == 8 ? 2 : 4; }
int64_t tile_channels(const Config& c) { return 32 / (kTileDstate / tile_states(c)); }
int64_t tile_run(const Config& c) { return c.get("warps") == 8 ? 8 : 16; }

// Dynamic shared memory of the tile kernel (tile_fwd_smem_floats in tile.cuh).
int64_t tile_smem_bytes(const Problem& p, const Config& c) {
  const int64_t w = c.get("warps"), run = tile_run(c), tile = w * run, n = p.dim("dstate"), cw = tile_channels(c);
  const int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  return 4 * (2 * nvar * tile * n + 2 * tile * cw + 2 * w * 2 * cw * n + 2 * cw * n +
              w * (n / tile_states(c)) * (cw * run + 4));
}

// The kernel addresses a block's rows with 32-bit offsets: dstate * seqlen must fit in an int.
bool tile_offsets_fit(const Problem& p) { return p.dim("seqlen") * p.dim("dstate") <= INT32_MAX; }

// items: 4 the kernel as measured; 8 and 16 the lean kernels (TileScanTraits' kLean 1: y's sum in one FMA chain
// a step; 2: and the fold's maps read ahead), at 4 warps of 4 states a lane only.
int64_t tile_lean(const Config& c) { return c.get("items") == 8 ? 1 : c.get("items") == 16 ? 2 : 0; }

bool valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("chunk") != 32 || c.get("segs") != 1)
    return no(why, "algo=tile does not use chunk or segs (canonical values 32, 1)");
  if (tile_lean(c) && (c.get("lanes") != 1 || c.get("warps") != 4))
    return no(why, "algo=tile's lean kernels (items=8, 16) run 4 warps of 4 states a lane (lanes=1)");
  if (c.get("lanes") != 1 && c.get("lanes") != 8)
    return no(why, "algo=tile takes lanes 1 (4 lanes of 4 states a channel) or 8 (8 lanes of 2 states)");
  if (c.get("lanes") == 1 && c.get("warps") != 4 && c.get("warps") != 6 && c.get("warps") != 8)
    return no(why, "algo=tile runs 4, 6 or 8 warps (2 blocks per SM)");
  if (c.get("lanes") == 8 && c.get("warps") != 2 && c.get("warps") != 4)
    return no(why, "algo=tile with lanes=8 runs 2 or 4 warps (16 warps per SM at 128 registers)");
  if (p.dim("dstate") != kTileDstate) return no(why, "algo=tile's lane map is for dstate 16");
  // With fp32 u, delta, z (or a variable fp32 B/C) the raw prefetch of the next tile spilled 56-64 bytes.
  if (dtype_size(p.dtype("u")) != 2 || (var_b(p) && dtype_size(p.dtype("B")) != 2) ||
      (var_c(p) && dtype_size(p.dtype("C")) != 2))
    return no(why, "algo=tile takes 16-bit u, delta, z and variable B/C (the fp32 prefetch spills)");
  if (!tile_vectors(p)) return no(why, "algo=tile needs seqlen a multiple of 8 and 16-byte aligned tensors");
  if (!tile_offsets_fit(p))
    return no(why, "algo=tile addresses a block's rows with 32-bit offsets (dstate * seqlen at most 2^31 - 1)");
  if (tile_channels(c) > group_fit(p)) return no(why, "a block's 8 (lanes=8: 4) channels must lie in one B/C group");
  return true;
}

std::vector<jit::KernelSpec> kernels(const Problem& p, const Config& c) {
  // the traits' optional arguments written only where they differ: the kernels measured before keep their spec text
  const std::string states = tile_lean(c) ? ", 4, " + std::to_string(tile_lean(c))
                             : tile_states(c) == 4 ? "" : ", " + std::to_string(tile_states(c));
  return {kernel(p, kHeader, "kspec::selective_scan_fwd_tile_kernel",
                 "kspec::TileScanTraits<" + flags_type(p, tile_vectors(p)) + ", " + std::to_string(c.get("warps")) +
                     states + ">")};
}

void launch(const Call& call, const Config& c, Launcher& l, ScanParams& s) {
  const Problem& p = call.problem;
  // A block's channels share one B/C group, and its rows fit 32-bit offsets (the tuning space's rules,
  // kept apart in the plan cache by the op's derived key).
  KSPEC_CHECK_AS(tile_channels(c) <= group_fit(p), InternalError, "selective_scan.fwd: config ", c.str(p.op->info),
                 " puts channels of two B/C groups in one block (a plan chosen for another dim?)");
  KSPEC_CHECK_AS(tile_offsets_fit(p), InternalError, "selective_scan.fwd: config ", c.str(p.op->info),
                 " addresses rows with 32-bit offsets: seqlen = ", p.dim("seqlen"),
                 " is too long (a plan chosen for another seqlen?)");
  l.launch(0, {u32(ceil_div(s.dim, tile_channels(c))), u32(p.dim("batch"))}, {u32(c.get("warps") * 32)},
           static_cast<unsigned>(tile_smem_bytes(p, c)), fwd_args(s).data());
}

}  // namespace

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
  return Config{{{"algo", kTile}, {"warps", tile_warps(p)}, {"items", 4}, {"lanes", 1}, {"chunk", 32}, {"segs", 1}}};
}
// Past 8192 channels, short sequences still take it: there algo 1 pays its per-channel start for few
// steps (16x768x256, 12288 channels: tile 4 warps 0.0493 ms, 6 warps 0.0501, algo 0 0.0892, algo 1 0.0937;
// kspec tune --all-configs, H100, 2026-11-27). Up to 16384 channels of at most 256 steps: the one point
// measured, where longer ones went to algo 1 (1x12288x1024 above). The heuristic now takes the wide kernel
// there first (wide.cpp); this rule is left for B/C groups of 8 or 16 channels, which its blocks of 32 span.
constexpr int64_t kTileChannelsMin = 2048, kTileChannelsMost = 8192;
constexpr int64_t kTileWideChannelsMost = 16384, kTileWideSeqlenMost = 256;
bool tile_preferred(const Problem& p) {
  if (!p.has_dim("seqlen")) return false;
  const int64_t chans = p.dim("batch") * p.dim("dim");
  const bool wide_short = chans <= kTileWideChannelsMost && p.dim("seqlen") <= kTileWideSeqlenMost;
  if (chans < kTileChannelsMin || (chans > kTileChannelsMost && !wide_short)) return false;
  return valid(p, tile_heuristic_config(p), nullptr) && tile_smem_bytes(p, tile_heuristic_config(p)) <= kSeqSmemLimit;
}

const FwdAlgorithm kTileFwd = {kTile, valid, kernels, launch, tile_smem_bytes};

}  // namespace kspec::scan
