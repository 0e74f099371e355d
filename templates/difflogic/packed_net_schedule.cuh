// difflogic.packed.net's schedule (packed_net.cuh): what each ticket names and what each item waits for,
// compiled by NVRTC into the network kernels and by the host compiler into the test that checks the orders
// (tests/cpp/test_difflogic_packed_net.cpp: every item named once, every wait on smaller tickets only).
#pragma once

#include "difflogic/params.h"

#ifdef __CUDACC_RTC__
#define KSPEC_DL_HD __device__ __forceinline__
#else
#define KSPEC_DL_HD inline
#endif

namespace kspec {

// What a ticket names.
struct DiffLogicNetItem {
  long long chunk, tile;
  int stage;  // -1: no work left
};

// Whether ticket remainder `rem` falls in stage s of the n chunks from c0 (n * tiles[s] items: chunk by chunk,
// in a chunk tile by tile): then `it` names that item; else those items are taken off rem. Every ticket order
// below walks its segments with it.
KSPEC_DL_HD bool dl_take(const DiffLogicNetParams& p, int s, long long c0, long long n, long long& rem,
                         DiffLogicNetItem& it) {
  const long long items = n * p.tiles[s];
  if (rem >= items) {
    rem -= items;
    return false;
  }
  it.chunk = c0 + rem / p.tiles[s];
  it.tile = rem - (it.chunk - c0) * p.tiles[s];
  it.stage = s;
  return true;
}

// The ticket order: rounds of `inflight` chunks; in a round, stage by stage; in a stage, chunk by chunk;
// in a chunk, tile by tile. p.tiles[s]: items of stage s for one chunk; p.round_items: items of a full round.
KSPEC_DL_HD DiffLogicNetItem dl_decode(const DiffLogicNetParams& p, long long t) {
  DiffLogicNetItem it{0, 0, -1};
  if (t >= p.chunks * p.chunk_items) return it;
  const long long r = t / p.round_items, first = r * p.inflight;
  const long long nr = p.chunks - first < p.inflight ? p.chunks - first : p.inflight;
  long long rem = t - r * p.round_items;
  for (int s = 0; s <= p.layers + 1; ++s)
    if (dl_take(p, s, first, nr, rem, it)) return it;
  return it;  // unreachable: the stages' items add up to the round's
}

// kChains (algo=chains): a ticket per slot instead (chain j: chunks j, j + inflight, ..., each stage by stage), and
// a block takes an item only from a chain whose next item looks ready (its waits met), else it tries the other
// chains, else it sleeps holding nothing: a chain draining a stage no longer holds up the blocks the others
// could use (with one ticket order the chunks of a round go through their stages in step, and the blocks that
// took the next stage's items wait: run 20 measured ~5.8 us a stage of a round beyond the bandwidth). The same
// waits (a chain's items wait only for smaller tickets of their chain): nothing hangs.
KSPEC_DL_HD DiffLogicNetItem dl_decode_chain(const DiffLogicNetParams& p, long long j, long long t) {
  DiffLogicNetItem it{0, 0, -1};
  const long long i = t / p.chunk_items, c = j + i * p.inflight;
  if (c >= p.chunks) return it;
  long long rem = t - i * p.chunk_items;
  for (int s = 0; s <= p.layers + 1; ++s)
    if (dl_take(p, s, c, 1, rem, it)) return it;
  return it;  // unreachable: a chunk's stages add up to its items
}

// The stage of the slot's previous chunk that last reads the buffer stage s writes (stage 0's input rows: stage
// 1; stage s's buffer, one per parity of s: read by the stages of the other parity up to the GroupSum, layers + 1,
// so the last of them is layers + 1 where s and layers have one parity, else layers). With p.fold the last layer
// counts its bits itself and the GroupSum stage has no items: the readers end at stage layers (layers - 1 where s
// and layers have one parity).
KSPEC_DL_HD int dl_last_reader(const DiffLogicNetParams& p, int s) {
  const int last = p.fold ? p.layers : p.layers + 1;
  return s == 0 ? 1 : ((s ^ last) & 1) == 1 ? last : last - 1;
}

// algo=early with an even number of layers (p.gs_late): round r's tickets are stages 0 and 1 of its chunks, then
// the GroupSum of round r - 1's chunks, then stages 2 .. layers of its chunks; the last round ends with its own
// GroupSum. In dl_decode's order the previous round's GroupSum items (260 at 128/2: 130 a chunk) lie between its
// last layer and the next round's layer 1, whose 500 items then find only the 268 of the 528 resident blocks
// those leave, and run in two turns; here layer 1 comes first, and the GroupSum runs beside it. Legal where the
// layers are even: layer 1 writes the buffer the last layer reads (its last reader there), the GroupSum reads the
// one stage 2 writes next (so stage 2 waits for it, a smaller ticket); with odd layers layer 1 would wait for the
// GroupSum (dl_last_reader), a larger ticket.
KSPEC_DL_HD DiffLogicNetItem dl_decode_late(const DiffLogicNetParams& p, long long t) {
  DiffLogicNetItem it{0, 0, -1};
  if (t >= p.chunks * p.chunk_items) return it;
  const int gs = p.layers + 1;
  const long long full = p.round_items, gs_items = p.inflight * p.tiles[gs];
  const long long rounds = (p.chunks + p.inflight - 1) / p.inflight;
  // Round 0 lacks a previous GroupSum (full - gs_items tickets), every later round but the last has full ones.
  long long r = t < full - gs_items ? 0 : (t + gs_items) / full;
  if (r > rounds - 1) r = rounds - 1;
  long long rem = r == 0 ? t : t + gs_items - r * full;
  const long long first = r * p.inflight;
  const long long nr = p.chunks - first < p.inflight ? p.chunks - first : p.inflight;
  // Segments: k 0, 1: stages 0, 1; k 2: round r - 1's GroupSum; k 3 .. layers + 1: stages 2 .. layers; k layers
  // + 2: round r's GroupSum, in the last round only.
  for (int k = 0; k <= p.layers + 2; ++k) {
    int s = k <= 1 ? k : k == 2 ? gs : k <= p.layers + 1 ? k - 1 : gs;
    long long c0 = first, n = nr;
    if (k == 2) {
      c0 = first - p.inflight;
      n = r > 0 ? p.inflight : 0;
    } else if (k == p.layers + 2) {
      n = r == rounds - 1 ? nr : 0;
    }
    if (dl_take(p, s, c0, n, rem, it)) return it;
  }
  return it;  // unreachable: the segments' items add up to the round's
}

// What an item waits for: every tile of its chunk's previous stage (prev), and every tile of the stage of the
// slot's previous chunk that last reads the buffer the item writes (slot_chunk, slot_stage).
struct DiffLogicNetDeps {
  bool prev;
  bool slot;
  long long slot_chunk;
  int slot_stage;
};
// With p.fold the last layer writes no scratch (its rows go to shared memory): it waits for no earlier reader.
KSPEC_DL_HD DiffLogicNetDeps dl_deps(const DiffLogicNetParams& p, const DiffLogicNetItem& it) {
  const int writers = p.fold ? p.layers - 1 : p.layers;  // the last stage that writes scratch
  DiffLogicNetDeps d{it.stage > 0, it.stage >= 0 && it.stage <= writers && it.chunk >= p.inflight, 0, 0};
  if (d.slot) {
    d.slot_chunk = it.chunk - p.inflight;
    d.slot_stage = dl_last_reader(p, it.stage);
  }
  return d;
}

}  // namespace kspec
