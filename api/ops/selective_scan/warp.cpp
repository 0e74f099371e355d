// The warp-scan algorithm (algo=warp; templates/selective_scan/warp_scan.cuh): one warp per channel, a
// shuffle scan over each tile of 32 x items steps, the state carried between tiles in shared memory.
// Forward and backward.
#include <algorithm>

#include "selective_scan/scan.h"

namespace kspec::scan {
namespace {

constexpr const char* kHeader = "selective_scan/warp_scan.cuh";

std::string traits(const Problem& p, const Config& c) {
  return "kspec::ScanTraits<" + flags_type(p, is_even(p)) + ", " + std::to_string(c.get("warps")) + ", " +
         std::to_string(c.get("items")) + ">";
}

bool fwd_valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("warps") == 6) return no(why, "6 warps only for algo=tile");
  if (c.get("lanes") != 1 || c.get("chunk") != 32 || c.get("segs") != 1)
    return no(why, "algo=warp does not use lanes, chunk or segs (canonical values 1, 32, 1)");
  if (4 * c.get("warps") * p.dim("dstate") > kStaticSmemBytes)
    return no(why, "the carried states do not fit in static shared memory");
  // 16 fp32 items per lane spilled 32 bytes on sm_80 (NVRTC 13.0) and load nothing wider than 8 do.
  if (c.get("items") * dtype_size(p.dtype("u")) > 32)
    return no(why, "more than 32 bytes of u per lane and tile (registers would spill)");
  return true;
}

std::vector<jit::KernelSpec> fwd_kernels(const Problem& p, const Config& c) {
  return {kernel(p, kHeader, "kspec::selective_scan_fwd_kernel", traits(p, c))};
}

// Each warp reads its own channel's B/C group: any block width is legal.
void fwd_launch(const Call& call, const Config& c, Launcher& l, ScanParams& s) {
  const int64_t warps = c.get("warps");
  l.launch(0, {u32(ceil_div(s.dim, warps)), u32(call.problem.dim("batch"))}, {u32(warps * 32)}, 0,
           fwd_args(s).data());
}

int64_t no_dynamic_smem(const Problem&, const Config&) { return 0; }

bool bwd_valid(const Problem& p, const Config& c, std::string* why) {
  if (c.get("lanes") != 1 || c.get("chunk") != 16 || c.get("segs") != 1)
    return no(why, "algo=warp does not use lanes, chunk or segs (canonical values 1, 16, 1)");
  if (!bwd_warps_fit(p, c.get("warps"))) return no(why, "warps must divide dim / groups with a variable B or C");
  if (bwd_smem_bytes(p, c.get("warps"), c.get("items")) > kStaticSmemBytes)
    return no(why, "more static shared memory than 48 KiB");
  return true;
}

std::vector<jit::KernelSpec> bwd_kernels(const Problem& p, const Config& c) {
  return {kernel(p, kHeader, "kspec::selective_scan_bwd_kernel", traits(p, c))};
}

BwdWork bwd_work(const Problem& p, const Config& c) {
  BwdWork w;
  w.seg_len = static_cast<int>(p.dim("seqlen"));
  w.ntiles = ceil_div(p.dim("seqlen"), 32 * c.get("items"));
  return w;
}

void bwd_launch(const Call& call, const Config& c, Launcher& l, const BwdWork&, ScanParams& s) {
  const int64_t warps = c.get("warps");
  // With a variable B/C, warps divides dim / groups (the tuning space's rule, kept apart in the plan
  // cache by bwd_key), so blocks are whole: a partial block's extra warps would write other rows.
  KSPEC_CHECK_AS(bwd_warps_fit(call.problem, warps), InternalError, "selective_scan.bwd: config warps = ", warps,
                 " does not divide dim / groups = ", s.channels_per_group, " (a plan chosen for another dim?)");
  l.launch(0, {u32(ceil_div(s.dim, warps)), u32(call.problem.dim("batch"))}, {u32(warps * 32)}, 0,
           bwd_args(s).data());
}

}  // namespace

bool bwd_warps_fit(const Problem& p, int64_t warps) {
  if (!var_bc(p)) return true;
  int64_t cpg = p.dim("dim") / std::max<int64_t>(groups_of(p), 1);
  return cpg % warps == 0;
}

// Static shared memory of the backward kernel (see its launch contract).
int64_t bwd_smem_bytes(const Problem& p, int64_t warps, int64_t items) {
  return 4 * (4 * warps * p.dim("dstate") + (var_bc(p) ? 2 * warps * 32 * items : 0));
}

Config warp_config(int64_t warps, int64_t items, int64_t chunk) {
  return Config{{{"algo", kWarp}, {"warps", warps}, {"items", items}, {"lanes", 1}, {"chunk", chunk}, {"segs", 1}}};
}

const FwdAlgorithm kWarpFwd = {kWarp, fwd_valid, fwd_kernels, fwd_launch, no_dynamic_smem};
const BwdAlgorithm kWarpBwd = {kWarp, bwd_valid, bwd_kernels, bwd_work, bwd_launch, no_dynamic_smem};

}  // namespace kspec::scan
