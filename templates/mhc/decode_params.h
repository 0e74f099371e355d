// The arguments of mhc.pre.fwd's one-launch plan for few tokens (algo=decode, mhc_pre_decode.cuh), compiled by
// the host compiler (api/ops/mhc/op.cpp fills it) and NVRTC; its own header, so that editing it leaves the other
// mhc kernels' cache keys alone.
#pragma once

#include "mhc/params.h"

namespace kspec {

// The forward's arguments; the projection items' totals [items, T, M + 1]; the Sinkhorn logits [T, n * n] (used
// only where T is above kMhcDecodeHeadTokens, the tokens whose heads the last block holds at once); four
// counters (tickets taken, projection items done, heads done, blocks out), zero at launch and put back to zero by
// the last block out.
struct MhcPreDecodeParams {
  MhcPreParams pre;
  float* part;
  float* z;
  unsigned* sync;
  int items, y_items;
};

}  // namespace kspec
