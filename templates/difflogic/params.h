// The argument of every difflogic kernel (layer.cuh), one plain struct compiled by both the host compiler
// (api/ops/difflogic/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout. Passed by
// value. x, y, dout, dx: [batch, width] row-major in the activation dtype (packed.cuh: x, y are words
// [width, words], 32 or 64 samples a word; bits.cuh: the tensors its comments name); logits, dlogits:
// [n_out, 16] fp32; wires and the consumers CSR int32.
#pragma once

namespace kspec {

struct DiffLogicParams {
  const void* x;           // [batch, n_in]
  const float* logits;     // [n_out, 16]
  const int *a, *b;        // [n_out] wires in [0, n_in)
  const int* offsets;      // [n_in + 1]: input j's readers are entries[offsets[j] .. offsets[j + 1])
  const int* entries;      // [2 n_out]: 2 g + side, ascending per input
  const void* dout;        // [batch, n_out] (backward)
  float* tables;           // [n_out, 4] workspace: T00, T01, T10, T11 per gate, made once per call
  void* y;                 // [batch, n_out] (forward)
  void* dx;                // [batch, n_in] (backward); the forward's xt [n_in, batch] (save_xt: x transposed)
  float* dlogits;          // [n_out, 16] (backward)
  long long batch, n_in, n_out;
  long long words;         // packed: ceil(batch / w) words per row
  long long groups;        // GroupSum: k groups of n_in / k consecutive columns (rows when packed)
  float grad_factor;
  float tau;               // GroupSum: sums / tau
  long long strides[3];    // GroupSum's backward: dy's strides (elements; 0 along an expanded group)
  unsigned long long seed; // Gumbel noise: the Philox key (philox.cuh)
  int gumbel;              // layer: 1 adds Gumbel noise of `seed` to the logits (forward and backward)
  // CA step (ca.cuh): x, y the state [batch, height, width, C]; a the perception's first-layer neighbours
  // [8]; b the other layers' wires [2, wired] (a row, then b row); tables [K perception_gates +
  // update_gates, 4]; fire [batch, height, width] or null.
  const void* fire;
  long long height, width, wired;
  int periodic;
  // CA step backward (ca_bwd.cuh): dout dnext, dx dstate [batch, height, width, C]; partials [blocks,
  // K perception_gates + update_gates, 4] (each block's S_uv sums); dcells [batch height width, C, 10]
  // (per cell and channel: the gradient of its 9 patch values, then of its own state); dlogits and
  // logits offset to the gates from gate0 on.
  float* partials;
  float* dcells;
  long long blocks, gate0;
};

// Blocks of the CA step backward: each sums its cells' dlogits partials in order, the blocks' partials
// then summed in block order. A fixed count, not the device's, so the bits do not depend on the GPU.
constexpr int kDiffLogicCaBwdBlocks = 512;

// Samples per chunk of the row-major layer backward's dlogits partials (layer.cuh; the host sizes the
// workspace by it).
constexpr int kDiffLogicChunk = 64;

// difflogic.packed.net (packed_net.cuh): a network of up to kDiffLogicNetMaxLayers hard layers on packed
// words, then GroupSum counts, in one persistent launch over chunks of the samples. Layer l (1-based) has
// width[l] gates reading width[l - 1] rows; its wires a[l - 1], b[l - 1], its logits logits[l - 1] and its
// ops ops[gate0[l - 1] ..]. Stage 0 copies a chunk of the input rows, stage l runs layer l, stage layers + 1
// counts; tiles[s] items of stage s per chunk. Scratch: `inflight` slots of slot_bytes, each the input rows
// then two buffers of max_width rows, kChunkBytes bytes a row.
constexpr int kDiffLogicNetMaxLayers = 16;
struct DiffLogicNetTraits {
  static constexpr int kUnits = 4;    // 16-byte units per thread in flight at once in a layer item
  static constexpr int kWaves = 2;    // ... and such waves per item: 32 KB of output an item, half the tickets of one
  static constexpr int kGsRows = 64;  // rows per thread in a GroupSum item (its counters hold up to 127)
};
struct DiffLogicNetParams {
  const void* x;  // words [width[0], words]: row_bytes bytes a row
  int* counts;    // [batch, groups], zeroed before the launch (the items add into it)
  const float* logits[kDiffLogicNetMaxLayers];
  const int* a[kDiffLogicNetMaxLayers];
  const int* b[kDiffLogicNetMaxLayers];
  unsigned char* ops;            // [gate0[layers]] workspace (difflogic_packed_ops_kernel)
  unsigned char* scratch;        // [inflight, slot_bytes] workspace
  unsigned long long* ticket;    // [1], zeroed before the launch
  unsigned* done;                // [chunks, layers + 2] items finished per (chunk, stage), zeroed before the launch
  long long width[kDiffLogicNetMaxLayers + 1];
  long long gate0[kDiffLogicNetMaxLayers + 1];
  long long tiles[kDiffLogicNetMaxLayers + 2];
  long long batch, row_bytes, groups;
  long long chunks, inflight, max_width, slot_bytes;
  long long chunk_items, round_items;  // items of one chunk (all stages), of a full round of inflight chunks
  int layers;
  int x_vec;    // algo=early, x and row_bytes 16-byte aligned: layer 1 reads x's rows (no stage 0 items)
  int gs_late;  // algo=early, layers even: the ticket order dl_decode_late (packed_net_schedule.cuh)
  int fold;     // algo=fold: stage `layers` counts its gates' bits (tiles[layers] = groups x items a group) and
                // writes no scratch; the GroupSum stage has no items
};

// The CA architectures (compile-time: a kernel is specialized for one): C channels, K perception kernels,
// the perception's widths (the first 8: gate g reads (patch[perm[g]], centre)) and the update network's
// (first n_in C + C P K, P the perception's last width; last width C). Read by the host (op.cpp) and by
// the kernels alike.
struct DiffLogicCaArch {
  int C, K;
  int n_perception, n_update;
  int perception[4];
  int update[20];
};
// 0 checkerboard: the published notebook's (C = 8, K = 16, 9 -> 8 -> 4 -> 2, 264 -> 256 x 10 -> 128 -> 64
// -> 32 -> 16 -> 8 -> 8: 2816 update gates, 3040 with the perception's 16 x 14). 1 tiny: C = 2, K = 2,
// 9 -> 8 -> 4 -> 2, 10 -> 6 -> 2 (tests).
constexpr DiffLogicCaArch kDiffLogicCaArchs[] = {
    {8, 16, 3, 16, {8, 4, 2}, {256, 256, 256, 256, 256, 256, 256, 256, 256, 256, 128, 64, 32, 16, 8, 8}},
    {2, 2, 3, 2, {8, 4, 2}, {6, 2}},
};

}  // namespace kspec
