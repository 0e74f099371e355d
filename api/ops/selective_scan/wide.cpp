// The wide kernel (algo=wide, forward only; templates/selective_scan/wide.cuh): each lane walks 4 states of
// a channel through the whole sequence, a block's warps side by side over 8 channels each; and when the
// heuristic takes it.
#include <algorithm>

#include "selective_scan/scan.h"

namespace kspec::scan {
namespace {

constexpr const char* kHeader = "selective_scan/wide.cuh";
constexpr int64_t kWideChunk = 32;  // steps per chunk (WideScanTraits::kChunk)

int64_t wide_channels(const Config& c) { return kTileChannels * c.get("warps"); }

// Dynamic shared memory of the wide kernel (wide_fwd_smem_floats in wide.cuh).
int64_t wide_smem_bytes(const Problem& p, const Config& c) {
  const int64_t w = c.get("warps"), n = p.dim("dstate"), groups = n / 4;
  const int64_t nvar = (var_b(p) ? 1 : 0) + (var_c(p) ? 1 : 0);
  return 4 * (2 * nvar * kWideChunk * n + 2 * w * kWideChunk * kTileChannels +
              w * groups * (kTileChannels * (kWideChunk + 4) + 8));
}

// The kernel addresses a block's rows with 32-bit offsets from the block's first: its channels' rows and a
// B/C group's dstate rows must fit in an int.
bool wide_offsets_fit(const Problem& p, const Config& c) {
  return p.dim("seqlen") * std::max(p.dim("dstate"), wide_channels(c)) <= INT32_MAX;
}

bool valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("items") != 4 || c.get("lanes") != 1 || c.get("chunk") != 32 || c.get("segs") != 1)
    return no(why, "algo=wide does not use items, lanes, chunk or segs (canonical values 4, 1, 32, 1)");
  if (c.get("warps") != 4 && c.get("warps") != 8) return no(why, "algo=wide runs 4 or 8 warps");
  if (p.dim("dstate") != 16) return no(why, "algo=wide's lane map is for dstate 16");
  if (dtype_size(p.dtype("u")) != 2 || (var_b(p) && dtype_size(p.dtype("B")) != 2) ||
      (var_c(p) && dtype_size(p.dtype("C")) != 2))
    return no(why, "algo=wide takes 16-bit u, delta, z and variable B/C (one 16-byte vector of 8 steps per lane)");
  if (!tile_vectors(p)) return no(why, "algo=wide needs seqlen a multiple of 8 and 16-byte aligned tensors");
  if (!wide_offsets_fit(p, c))
    return no(why, "algo=wide addresses a block's rows with 32-bit offsets (8 warps seqlen and dstate seqlen at "
                   "most 2^31 - 1)");
  if (wide_channels(c) > group_fit(p)) return no(why, "a block's 8 x warps channels must lie in one B/C group");
  return true;
}

std::vector<jit::KernelSpec> kernels(const Problem& p, const Config& c) {
  const std::string traits =
      "kspec::WideScanTraits<" + flags_type(p, tile_vectors(p)) + ", " + std::to_string(c.get("warps")) + ">";
  return {kernel(p, kHeader, "kspec::selective_scan_fwd_wide_kernel", traits)};
}

void launch(const Call& call, const Config& c, Launcher& l, ScanParams& s) {
  const Problem& p = call.problem;
  // The tuning space's rules, kept apart in the plan cache by the op's derived key (gfit, the seqlen
  // bound of the heuristic's rule).
  KSPEC_CHECK_AS(wide_channels(c) <= group_fit(p), InternalError, "selective_scan.fwd: config ", c.str(p.op->info),
                 " puts channels of two B/C groups in one block (a plan chosen for another dim?)");
  KSPEC_CHECK_AS(wide_offsets_fit(p, c), InternalError, "selective_scan.fwd: config ", c.str(p.op->info),
                 " addresses rows with 32-bit offsets: seqlen = ", p.dim("seqlen"),
                 " is too long (a plan chosen for another seqlen?)");
  l.launch(0, {u32(ceil_div(s.dim, wide_channels(c))), u32(p.dim("batch"))}, {u32(c.get("warps") * 32)},
           static_cast<unsigned>(wide_smem_bytes(p, c)), fwd_args(s).data());
}

}  // namespace

// The heuristic takes the wide kernel (4 warps) past the tile kernel's 8192 channels, up to 16384, for
// sequences under 512 steps: there algo 1 has no vector path (seqlen not a multiple of 512) and the tile
// kernel's time-parallel scan costs ~7 warp instructions per channel-step and 2 blocks per SM, where the
// channels alone fill the GPU (16x768x256 before: the tile kernel at 4 warps 0.0493 ms, algo 0 0.0892,
// algo 1 0.0937; mamba_ssm 0.065). Not yet measured on a GPU (tools/bench/NOTES.md, "the wide kernel").
constexpr int64_t kWideChannelsMin = 8192, kWideChannelsMost = 16384, kWideSeqlenBelow = 512;
bool wide_preferred(const Problem& p) {
  if (!p.has_dim("seqlen")) return false;
  const int64_t chans = p.dim("batch") * p.dim("dim");
  if (chans <= kWideChannelsMin || chans > kWideChannelsMost || p.dim("seqlen") >= kWideSeqlenBelow) return false;
  const Config c = wide_heuristic_config(p);
  return valid(p, c, nullptr) && wide_smem_bytes(p, c) <= kSeqSmemLimit;
}
Config wide_heuristic_config(const Problem&) {
  return Config{{{"algo", kWide}, {"warps", 4}, {"items", 4}, {"lanes", 1}, {"chunk", 32}, {"segs", 1}}};
}

const FwdAlgorithm kWideFwd = {kWide, valid, kernels, launch, wide_smem_bytes};

}  // namespace kspec::scan
