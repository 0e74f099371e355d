// difflogic.packed.net, algo=chunked (and chains, early): a whole packed network (hard layers, then GroupSum
// counts) in one persistent launch, so that only the input words and the counts touch DRAM
// (api/ops/difflogic/packed_net.cpp says what runs when; api/ops/difflogic/reference.h: difflogic_packed_fwd_ref
// and difflogic_packed_group_sum_ref chained are the spec).
//
// Why: one launch per layer streams every layer's words through DRAM (at B = 2^18 a 64k-wide layer is 2 GB
// of bits: 6 layers read and write ~25 GB). Here the samples are cut into chunks of kChunkBytes bytes of
// every row (kChunkBytes * 8 samples), and all stages of a chunk run back to back on scratch rows of
// kChunkBytes bytes: stage 0 copies the chunk of the input rows, stage l (1..L) runs layer l, stage L + 1
// adds the last layer's bits into the counts. A layer's scratch (64k rows x 128 B = 8 MB) stays in L2
// between the stage that writes it and the one that reads it.
//
// Scheduling: work items (chunk, stage, tile) are handed out in one global order by an atomic ticket, and
// an item waits (spinning on a per-(chunk, stage) done counter) only for items with smaller tickets: the
// previous stage of its chunk, and the stage of the previous chunk of its scratch slot that last reads the
// buffer the item writes. Every block that waits has a ticket, so the item it waits for was taken by a running block,
// which itself waits only for smaller tickets: nothing hangs, whatever the grid size or residency, and no
// cooperative launch is needed. The order interleaves `inflight` chunks (one scratch slot each) stage by
// stage, so the first items of a stage rarely find the last items of the previous stage of their chunk
// still running (the other chunks' items lie between them).
//
// The word width does not matter here: a w = 64 row is the w = 32 row of the same bits (little-endian:
// sample s is bit s mod 32 of 32-bit word s / 32 either way), only the row length in bytes differs, so one
// kernel serves both at the same cost per bit, and each thread moves 16 bytes per row and unit. Bits of
// samples >= batch are never cleared on the way (the counts skip those samples).
//
// Memory: scratch is read with ld.global.cg (past L1, which is not coherent: a slot is rewritten by other
// blocks for every chunk); the input words with ld.global.cs (read once). Integer atomics make the counts
// exact and the same run to run.
#pragma once

#include "difflogic/packed_net_schedule.cuh"

namespace kspec {

// 16-byte unit helpers.
__device__ __forceinline__ uint4 dl_ldcg16(const unsigned char* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void dl_st16(unsigned char* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ unsigned dl_gate(unsigned op, unsigned A, unsigned B) {
  const unsigned f00 = 0u - ((op >> 3) & 1u), f01 = 0u - ((op >> 2) & 1u), f10 = 0u - ((op >> 1) & 1u),
                 f11 = 0u - (op & 1u);
  return (f00 & ~A & ~B) | (f01 & ~A & B) | (f10 & A & ~B) | (f11 & A & B);
}

// The argmax op of every gate of every layer, in [0, 16), or 16 where a wire is outside [0, width of the
// layer's input): such a gate is never followed and gives zero bits, as difflogic.packed.fwd's do. Made once
// per call, before the network kernel (the logits are read once, not once per chunk).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_packed_ops_kernel(const DiffLogicNetParams p) {
  const long long total = p.gate0[p.layers];
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    int l = 0;
    while (e >= p.gate0[l + 1]) ++l;
    const long long g = e - p.gate0[l];
    const int wa = p.a[l][g], wb = p.b[l][g];
    const float* lg = p.logits[l] + g * 16;
    int op = 0;
#pragma unroll
    for (int i = 1; i < 16; ++i)
      if (lg[i] > lg[op]) op = i;  // strict: ties stay with the lower index
    const unsigned long long n_in = static_cast<unsigned long long>(p.width[l]);
    const bool ok = static_cast<unsigned long long>(static_cast<long long>(wa)) < n_in &&
                    static_cast<unsigned long long>(static_cast<long long>(wb)) < n_in;
    p.ops[e] = static_cast<unsigned char>(ok ? op : 16);
  }
}

// Whether an item's waits are met now (a relaxed look: the taker still waits with acquire loads).
__device__ __forceinline__ bool dl_ready(const DiffLogicNetParams& p, const DiffLogicNetItem& it) {
  const int stages = p.layers + 2;
  const DiffLogicNetDeps d = dl_deps(p, it);
  if (d.prev && *static_cast<const volatile unsigned*>(p.done + it.chunk * stages + it.stage - 1) <
                    static_cast<unsigned>(p.tiles[it.stage - 1]))
    return false;
  return !d.slot || *static_cast<const volatile unsigned*>(p.done + d.slot_chunk * stages + d.slot_stage) >=
                        static_cast<unsigned>(p.tiles[d.slot_stage]);
}

// Spins until *counter >= target (acquire). kFence: then a __threadfence (fence.sc.gpu) too, as chunked and
// chains do; algo=early leaves it out: the acquire load, then the block's barrier, already order every thread's
// later loads after the writes the counter's release published (PTX memory model: the acquire pattern and
// bar.sync's causality order; the pattern of CUTLASS's generic barrier), and a fence.sc on the stage's path
// costs a round trip.
template <bool kFence>
__device__ __forceinline__ void dl_wait(const unsigned* counter, unsigned target) {
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) break;
    __nanosleep(64);
  }
  if (kFence) __threadfence();
}

// Thread 0's waits for an item: the previous stage of its chunk done, and the buffer it writes free of the
// slot's previous chunk (its last reader there done: a chunk's first stages thus wait for the last layer of the
// slot's chunk before, only its third for that chunk's GroupSum).
template <bool kFence>
__device__ __forceinline__ void dl_wait_item(const DiffLogicNetParams& p, const DiffLogicNetItem& it) {
  const int stages = p.layers + 2;
  const DiffLogicNetDeps d = dl_deps(p, it);
  if (d.prev) dl_wait<kFence>(p.done + it.chunk * stages + it.stage - 1, static_cast<unsigned>(p.tiles[it.stage - 1]));
  if (d.slot) dl_wait<kFence>(p.done + d.slot_chunk * stages + d.slot_stage, static_cast<unsigned>(p.tiles[d.slot_stage]));
}

// The gate tables (ops, wires: 3.5 MB at 6 x 64k gates, read once a chunk) loaded with L2 priority evict_last:
// run 25 measured ~1 GB of DRAM reads at 2^18, about the tables once per chunk (the scratch's traffic evicts them).
__device__ __forceinline__ unsigned long long dl_keep_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ unsigned dl_ld_keep(const unsigned char* p, unsigned long long policy) {
  unsigned short v;
  asm("ld.global.L2::cache_hint.u8 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(policy));
  return v;
}
__device__ __forceinline__ int dl_ld_keep(const int* p, unsigned long long policy) {
  int v;
  asm("ld.global.L2::cache_hint.s32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(policy));
  return v;
}

// The units of wave `wave` of layer item `it` (this thread's: first + i * kThreads + tid for i < kUnits, gate
// unit / kPieces, real below end). A layer item: kWaves waves of its layer's units. With kFoldWaves (algo=fold)
// the last layer's item: kFoldWaves waves of one group's units (tiles[layers] / groups items a group; tile = group
// x those + the item's place in it), so that an item's counts all go to one group.
struct DiffLogicNetWave {
  long long first, end;
};
template <int kPieces, int kThreads, int kFoldWaves>
__device__ __forceinline__ DiffLogicNetWave dl_wave(const DiffLogicNetParams& p, const DiffLogicNetItem& it, int wave) {
  constexpr long long kWaveUnits = static_cast<long long>(DiffLogicNetTraits::kUnits) * kThreads;
  const int l = it.stage;
  if (kFoldWaves > 0 && l == p.layers) {
    const long long per_group = p.tiles[l] / p.groups, group = it.tile / per_group;
    const long long units = p.width[l] / p.groups * kPieces;  // a group's
    return {group * units + ((it.tile - group * per_group) * kFoldWaves + wave) * kWaveUnits,
            (group + 1) * units};
  }
  return {(it.tile * DiffLogicNetTraits::kWaves + wave) * kWaveUnits, p.width[l] * kPieces};
}

// algo=early: this thread's gates of wave `wave` of layer item `it` (dl_wave): the wires and the ops, 4 bits each
// in ops. A unit past the wave's end, or a gate with a wire out of range (op 16), reads row 0 and runs op 0
// (FALSE): zero bits (a layer item stores none past the end; fold's last-layer items count every unit of a wave,
// so a unit past its group's end must give zero bits, not gate 0's, which its table entry is read from).
template <int kPieces, int kThreads, int kFoldWaves>
__device__ __forceinline__ void dl_early_tables(const DiffLogicNetParams& p, const DiffLogicNetItem& it, int tid,
                                                int wave, unsigned& ops, int (&a)[DiffLogicNetTraits::kUnits],
                                                int (&b)[DiffLogicNetTraits::kUnits]) {
  constexpr int kUnits = DiffLogicNetTraits::kUnits;
  static_assert(kUnits <= 8, "ops holds 8 ops of 4 bits");
  const int l = it.stage;
  const DiffLogicNetWave w = dl_wave<kPieces, kThreads, kFoldWaves>(p, it, wave);
  const unsigned long long policy = dl_keep_policy();
  ops = 0;
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const long long u = w.first + static_cast<long long>(i) * kThreads + tid;
    const long long g = u < w.end ? u / kPieces : 0;
    const unsigned o = dl_ld_keep(p.ops + p.gate0[l - 1] + g, policy);
    const bool run = (kFoldWaves == 0 || u < w.end) && o < 16;  // early stores no unit past the end: no check
    ops |= (run ? o : 0u) << (4 * i);
    a[i] = run ? dl_ld_keep(p.a[l - 1] + g, policy) : 0;
    b[i] = run ? dl_ld_keep(p.b[l - 1] + g, policy) : 0;
  }
}

// algo=early: one wave of layer item `it` reading rows `src` (layer 1 with x_vec: x's, through L1, a piece past a
// row's end, the last chunk's, read as zero as stage 0 copies it; else scratch, past L1: it is rewritten): the bits
// of this thread's kUnits units of the wave (dl_wave) in y. The wave's tables (eops, ea, eb) are loaded; the next
// wave's are loaded into them while this wave's rows are in flight (when `next`).
template <int kChunkBytes, int kThreads, int kFoldWaves>
__device__ __forceinline__ void dl_early_wave(const DiffLogicNetParams& p, const DiffLogicNetItem& it, int tid,
                                              int wave, bool next, const unsigned char* src, unsigned& eops,
                                              int (&ea)[DiffLogicNetTraits::kUnits],
                                              int (&eb)[DiffLogicNetTraits::kUnits],
                                              uint4 (&y)[DiffLogicNetTraits::kUnits]) {
  constexpr int kPieces = kChunkBytes / 16, kUnits = DiffLogicNetTraits::kUnits;
  const int piece = tid % kPieces;  // kThreads % kPieces == 0: every unit of this thread
  const bool direct = it.stage == 1 && p.x_vec;
  const unsigned char* rows = direct ? static_cast<const unsigned char*>(p.x) + it.chunk * kChunkBytes : src;
  const long long stride = direct ? p.row_bytes : kChunkBytes;
  const bool past = direct && it.chunk * kChunkBytes + piece * 16 >= p.row_bytes;
  uint4 A[kUnits], B[kUnits];
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const uint4* ra = reinterpret_cast<const uint4*>(rows + ea[i] * stride + piece * 16);
    const uint4* rb = reinterpret_cast<const uint4*>(rows + eb[i] * stride + piece * 16);
    A[i] = past ? make_uint4(0u, 0u, 0u, 0u) : direct ? __ldg(ra) : __ldcg(ra);
    B[i] = past ? make_uint4(0u, 0u, 0u, 0u) : direct ? __ldg(rb) : __ldcg(rb);
  }
  const unsigned ops = eops;
  if (next) dl_early_tables<kPieces, kThreads, kFoldWaves>(p, it, tid, wave + 1, eops, ea, eb);
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const unsigned o = (ops >> (4 * i)) & 15u;
    y[i] = make_uint4(dl_gate(o, A[i].x, B[i].x), dl_gate(o, A[i].y, B[i].y), dl_gate(o, A[i].z, B[i].z),
                      dl_gate(o, A[i].w, B[i].w));
  }
}

// GroupSum's counters: adds a word's 32 bits (one per sample) into 7 bit-sliced counters (plane q: bit q of 32
// counts, up to 127).
__device__ __forceinline__ void dl_count(unsigned (&plane)[7], unsigned carry) {
#pragma unroll
  for (int q = 0; q < 7; ++q) {
    const unsigned next = plane[q] & carry;
    plane[q] ^= carry;
    carry = next;
  }
}

// GroupSum's end: every thread's counters (samples pos * 32 .. + 31 of the chunk) summed per sample in `partial`
// (zeroed by the item before), then added into counts[sample, group] for every sample below the batch. kSwizzle
// (algo=early, fold): sample pos * 32 + bit kept at pos * 32 + (bit ^ pos % 32), so a warp's lanes (consecutive
// pos) hit distinct banks; at pos * 32 + bit all of them hit bank `bit`: a 32-way conflict per atomic at chunk 128.
template <int kChunkBytes, int kThreads, bool kSwizzle>
__device__ __forceinline__ void dl_gs_flush(const DiffLogicNetParams& p, long long chunk, long long group, int pos,
                                            const unsigned (&plane)[7], int* partial) {
  __syncthreads();  // partial zeroed
#pragma unroll 4
  for (int bit = 0; bit < 32; ++bit) {
    int count = 0;
#pragma unroll
    for (int q = 0; q < 7; ++q) count |= static_cast<int>((plane[q] >> bit) & 1u) << q;
    if (count) atomicAdd(&partial[pos * 32 + (kSwizzle ? bit ^ (pos & 31) : bit)], count);
  }
  __syncthreads();
  const long long s0 = chunk * kChunkBytes * 8;
  for (int j = threadIdx.x; j < kChunkBytes * 8; j += kThreads) {
    const long long sample = s0 + (kSwizzle ? j ^ ((j >> 5) & 31) : j);  // the swizzle undone
    if (partial[j] && sample < p.batch) atomicAdd(p.counts + sample * p.groups + group, partial[j]);
  }
}

// The network, run by every block until the tickets run out. kChunkBytes: bytes of every row per chunk (16 to
// 256; kChunkBytes * 8 samples); kThreads per block; kUnits x kWaves: 16-byte units per thread in a load or
// layer item (a layer item's loads in kWaves waves of kUnits, to bound the registers); kGsRows: rows per thread
// in a GroupSum item (its bit-sliced counters have 7 planes: up to 127 rows); kChains: a ticket per slot
// (dl_decode_chain); kEarly (algo=early): a layer item loads its first wave's gates (ops and wires) before
// its waits (they do not depend on the previous stage), the second wave's while the first wave's rows are in
// flight, so at a stage's opening only the rows' loads are left: one L2 round trip a wave instead of two. And
// with x_vec layer 1 reads its rows straight from x through L1 (ld.global.nc: x is never written here), so there
// is no stage 0 (the host gives it no items): a chunk of x's rows (784 x 128 B at the issue's network) is read
// ~160 times by layer 1's 64k gates, mostly from L1 instead of L2 (layer 1 was ~11% of the L2 bytes).
// kFoldWaves > 0 (algo=fold, fold2, with kEarly): the last layer's items, of kFoldWaves waves, count their own bits
// (difflogic_packed_net_fold_kernel).
template <int kChunkBytes, int kThreads, bool kChains, bool kEarly, int kFoldWaves>
__device__ __forceinline__ void dl_net_run(const DiffLogicNetParams& p) {
  constexpr int kPieces = kChunkBytes / 16, kUnits = DiffLogicNetTraits::kUnits, kWaves = DiffLogicNetTraits::kWaves;
  constexpr int kGsRows = DiffLogicNetTraits::kGsRows;
  constexpr bool kFold = kFoldWaves > 0;
  constexpr int kPos = kChunkBytes / 4, kRowLanes = kThreads / kPos;  // GroupSum: 32-bit words x row lanes
  // kFold: a wave's rows in shared memory, kUnits * kThreads / kPieces of them, kFoldRows a thread and wave.
  constexpr int kFoldRows = kUnits * kThreads / kPieces / kRowLanes;
  static_assert(kChunkBytes % 16 == 0 && kThreads % kPos == 0 && kGsRows < 128, "chunk, threads, GroupSum rows");
  static_assert(kThreads % kPieces == 0, "a thread's units are one piece (16 bytes) of their rows");
  static_assert(!kFold || (kEarly && !kChains && kFoldRows * kFoldWaves < 128), "fold: early's loads, 7-bit counts");
  __shared__ DiffLogicNetItem item;
  __shared__ int partial[kChunkBytes * 8];  // GroupSum: one count per sample of the chunk
  // kFold: a wave's rows, and each thread's counters between waves (plane q of thread t at q kThreads + t: in
  // registers across the wave's loads they spilled at 64).
  __shared__ uint4 fold_rows[kFold ? kUnits * kThreads : 1];
  __shared__ unsigned fold_planes[kFold ? 7 * kThreads : 1];
  const int tid = threadIdx.x;
  const int stages = p.layers + 2;
  for (;;) {
    if (tid == 0) {
      DiffLogicNetItem it{0, 0, -1};
      if (kChains) {
        // Nothing ready: sleep 64 ns doubling to 1 us between scans (a thousand blocks' thread 0 scanning
        // every chain's ticket and counters would take L2 bandwidth from the items running).
        unsigned nap = 64;
        for (bool open = true; open && it.stage < 0;) {
          open = false;
          for (long long k = 0; k < p.inflight && it.stage < 0; ++k) {
            const long long j = (blockIdx.x + k) % p.inflight;
            const long long t = static_cast<long long>(*static_cast<volatile unsigned long long*>(p.ticket + j));
            const DiffLogicNetItem next = dl_decode_chain(p, j, t);
            if (next.stage < 0) continue;  // chain j has no items left
            open = true;
            if (dl_ready(p, next)) it = dl_decode_chain(p, j, static_cast<long long>(atomicAdd(p.ticket + j, 1ull)));
          }
          if (open && it.stage < 0) {
            __nanosleep(nap);
            nap = nap < 1024 ? 2 * nap : nap;
          }
        }
      } else {
        const long long t = static_cast<long long>(atomicAdd(p.ticket, 1ull));
        it = kEarly && p.gs_late ? dl_decode_late(p, t) : dl_decode(p, t);
      }
      if (!kEarly) dl_wait_item<true>(p, it);
      item = it;
    }
    __syncthreads();
    const DiffLogicNetItem it = item;
    if (it.stage < 0) return;
    // kEarly: this thread's gates of the first wave of a layer item (wires ea, eb, the ops 4 bits each in eops),
    // loaded before the waits; the next wave's are loaded while a wave's rows are in flight (all 8 units' before
    // the waits spilled at the 64 registers that keep 4 blocks of 256 on an SM).
    unsigned eops = 0;
    int ea[kUnits], eb[kUnits];
    if (kEarly) {
      if (it.stage >= 1 && it.stage <= p.layers) dl_early_tables<kPieces, kThreads, kFoldWaves>(p, it, tid, 0, eops, ea, eb);
      if (tid == 0) dl_wait_item<false>(p, it);
      __syncthreads();
    }
    unsigned char* slot = p.scratch + (it.chunk % p.inflight) * p.slot_bytes;
    unsigned char* in_rows = slot;  // stage 0's output: the input rows
    // The two layer buffers, picked by select (an indexed pair would live in local memory).
    unsigned char* const buf0 = slot + p.width[0] * kChunkBytes;
    unsigned char* const buf1 = buf0 + p.max_width * kChunkBytes;
    if (it.stage == 0) {
      // Copy the chunk of the input rows; bytes past a row's end are zero.
      const unsigned char* x = static_cast<const unsigned char*>(p.x);
      const long long units = p.width[0] * kPieces, off0 = it.chunk * kChunkBytes;
#pragma unroll
      for (int i = 0; i < kUnits * kWaves; ++i) {
        const long long u = (it.tile * kUnits * kWaves + i) * kThreads + tid;
        if (u >= units) break;
        const long long row = u / kPieces, off = off0 + (u - row * kPieces) * 16;
        const unsigned* src = reinterpret_cast<const unsigned*>(x + row * p.row_bytes + off);
        unsigned v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = off + 4 * j < p.row_bytes ? __ldcs(src + j) : 0u;
        dl_st16(in_rows + u * 16, make_uint4(v[0], v[1], v[2], v[3]));
      }
    } else if (kFold && it.stage == p.layers) {
      // algo=fold, the last layer: each wave's rows go to shared memory instead of scratch, and the item counts
      // them there as a GroupSum item counts scratch rows (thread: word position pos, rows lane + j kRowLanes),
      // kFoldWaves waves into its counters, then adds them to its group's counts. Rows past the group's end are
      // zero (op 0).
      const unsigned char* src = p.layers == 1 ? in_rows : (p.layers & 1) ? buf1 : buf0;
      const int pos = tid % kPos, lane = tid / kPos;
      for (int j = tid; j < kChunkBytes * 8; j += kThreads) partial[j] = 0;
#pragma unroll
      for (int q = 0; q < 7; ++q) fold_planes[q * kThreads + tid] = 0u;
      const unsigned* rows = reinterpret_cast<const unsigned*>(fold_rows);
      for (int wave = 0; wave < kFoldWaves; ++wave) {
        const DiffLogicNetWave w = dl_wave<kPieces, kThreads, kFoldWaves>(p, it, wave);
        if (w.first >= w.end) break;  // the group's last item
        uint4 y[kUnits];  // zero past the group's end (op 0)
        dl_early_wave<kChunkBytes, kThreads, kFoldWaves>(p, it, tid, wave, wave + 1 < kFoldWaves, src, eops, ea, eb, y);
#pragma unroll
        for (int i = 0; i < kUnits; ++i) fold_rows[i * kThreads + tid] = y[i];
        __syncthreads();  // the wave's rows stored
        unsigned plane[7];
#pragma unroll
        for (int q = 0; q < 7; ++q) plane[q] = fold_planes[q * kThreads + tid];
#pragma unroll
        for (int j = 0; j < kFoldRows; ++j) dl_count(plane, rows[(lane + j * kRowLanes) * kPos + pos]);
#pragma unroll
        for (int q = 0; q < 7; ++q) fold_planes[q * kThreads + tid] = plane[q];
        __syncthreads();  // and counted, before the next wave stores its own
      }
      unsigned plane[7];
#pragma unroll
      for (int q = 0; q < 7; ++q) plane[q] = fold_planes[q * kThreads + tid];
      const long long group = it.tile / (p.tiles[p.layers] / p.groups);
      dl_gs_flush<kChunkBytes, kThreads, true>(p, it.chunk, group, pos, plane, partial);
    } else if (it.stage <= p.layers) {
      const int l = it.stage;  // layer l reads width[l - 1] rows, writes width[l]
      const unsigned char* src = l == 1 ? in_rows : (l & 1) ? buf1 : buf0;
      unsigned char* dst = (l & 1) ? buf0 : buf1;
      const long long units = p.width[l] * kPieces;
      if constexpr (kEarly) {
#pragma unroll
        for (int wave = 0; wave < kWaves; ++wave) {
          const long long base = (it.tile * kWaves + wave) * kUnits;
          if (base * kThreads >= units) break;
          uint4 y[kUnits];
          dl_early_wave<kChunkBytes, kThreads, kFoldWaves>(p, it, tid, wave, wave + 1 < kWaves, src, eops, ea, eb, y);
#pragma unroll
          for (int i = 0; i < kUnits; ++i) {
            const long long u = (base + i) * kThreads + tid;
            if (u >= units) break;
            dl_st16(dst + u * 16, y[i]);
          }
        }
      } else {
        const int* wa = p.a[l - 1];
        const int* wb = p.b[l - 1];
        const unsigned char* ops = p.ops + p.gate0[l - 1];
        for (int wave = 0; wave < kWaves; ++wave) {
          const long long base = (it.tile * kWaves + wave) * kUnits;
          if (base * kThreads >= units) break;
          unsigned op[kUnits];
          long long ra[kUnits], rb[kUnits];
#pragma unroll
          for (int i = 0; i < kUnits; ++i) {  // the gates' ops and wires first, then their rows: loads in flight together
            const long long u = (base + i) * kThreads + tid;
            const long long g = u < units ? u / kPieces : 0, piece = u < units ? u - g * kPieces : 0;
            op[i] = ops[g];
            ra[i] = (op[i] < 16 ? wa[g] : 0) * static_cast<long long>(kChunkBytes) + piece * 16;
            rb[i] = (op[i] < 16 ? wb[g] : 0) * static_cast<long long>(kChunkBytes) + piece * 16;
          }
          uint4 A[kUnits], B[kUnits];
#pragma unroll
          for (int i = 0; i < kUnits; ++i) {
            A[i] = dl_ldcg16(src + ra[i]);
            B[i] = dl_ldcg16(src + rb[i]);
          }
#pragma unroll
          for (int i = 0; i < kUnits; ++i) {
            const long long u = (base + i) * kThreads + tid;
            if (u >= units) break;
            const unsigned o = op[i] < 16 ? op[i] : 0u;  // 16: a wire out of range, zero bits
            dl_st16(dst + u * 16, make_uint4(dl_gate(o, A[i].x, B[i].x), dl_gate(o, A[i].y, B[i].y),
                                             dl_gate(o, A[i].z, B[i].z), dl_gate(o, A[i].w, B[i].w)));
          }
        }
      }
    } else if constexpr (!kFold) {
      // GroupSum of the last layer: item = (group, block of kRowLanes * kGsRows rows of it). Each thread adds
      // kGsRows rows of one 32-bit word position into 7 bit-sliced counters (plane i: bit i of 32 counts),
      // then the block sums its threads' counts per sample in shared memory and adds them to the counts.
      const unsigned char* src = (p.layers & 1) ? buf0 : buf1;
      const long long m = p.width[p.layers] / p.groups, per_group = (m + kRowLanes * kGsRows - 1) / (kRowLanes * kGsRows);
      const long long group = it.tile / per_group, first = group * m + (it.tile - group * per_group) * kRowLanes * kGsRows;
      const long long end = (group + 1) * m;
      const int pos = tid % kPos, lane = tid / kPos;
      for (int j = tid; j < kChunkBytes * 8; j += kThreads) partial[j] = 0;
      unsigned plane[7] = {0u, 0u, 0u, 0u, 0u, 0u, 0u};
      if constexpr (kEarly) {
        // Batches of kGsBatch rows, every load of a batch in flight at once (a row past the group's end reads as
        // zero): 4 L2 round trips an item instead of 16. Run 25 (H100): the GroupSum of a round is on the path
        // (stage 2 of the slot's next chunk waits for it) and its items were ~3 layer items long.
        constexpr int kGsBatch = 16;
        static_assert(kGsRows % kGsBatch == 0, "GroupSum rows in whole batches");
        for (int i0 = 0; i0 < kGsRows; i0 += kGsBatch) {
          if (first + lane + static_cast<long long>(i0) * kRowLanes >= end) break;
          unsigned words[kGsBatch];
#pragma unroll
          for (int i = 0; i < kGsBatch; ++i) {
            const long long row = first + lane + static_cast<long long>(i0 + i) * kRowLanes;
            words[i] = row < end ? __ldcg(reinterpret_cast<const unsigned*>(src + row * kChunkBytes) + pos) : 0u;
          }
#pragma unroll
          for (int i = 0; i < kGsBatch; ++i) dl_count(plane, words[i]);
        }
      } else {
#pragma unroll 4
        for (int i = 0; i < kGsRows; ++i) {
          const long long row = first + lane + static_cast<long long>(i) * kRowLanes;
          if (row >= end) break;
          dl_count(plane, __ldcg(reinterpret_cast<const unsigned*>(src + row * kChunkBytes) + pos));
        }
      }
      dl_gs_flush<kChunkBytes, kThreads, kEarly>(p, it.chunk, group, pos, plane, partial);
    }
    __syncthreads();  // every thread's stores of the item issued (and `item`, `partial` free again)
    if (tid == 0) {
      unsigned* done = p.done + it.chunk * stages + it.stage;
      if (kEarly) {  // a release reduction: the block's stores (ordered before it by the barrier) published
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" : : "l"(done) : "memory");
      } else {
        __threadfence();
        atomicAdd(done, 1u);
      }
    }
  }
}

// algo=chunked (kChains false) and algo=chains (true): 2 waves of 4 units a layer item.
template <int kChunkBytes, int kThreads, bool kChains>
__global__ void __launch_bounds__(kThreads) difflogic_packed_net_kernel(const DiffLogicNetParams p) {
  dl_net_run<kChunkBytes, kThreads, kChains, false, 0>(p);
}

// algo=early: the chunked schedule with the gate tables loaded before the waits and layer 1 reading x
// (dl_net_run: kEarly). At most 64 registers (4 blocks of 256 threads an SM, as the chunked kernel's 64 give):
// a stage of 2 chunks of 128 bytes is 500 items, all of them resident at once (unbounded, ptxas took 80: 3
// blocks an SM, 396 resident).
template <int kChunkBytes, int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) difflogic_packed_net_early_kernel(const DiffLogicNetParams p) {
  dl_net_run<kChunkBytes, kThreads, false, true, 0>(p);
}

// algo=fold (kFoldWaves 4) and fold2 (2): early, with the GroupSum folded into the last layer: its items keep their
// rows in shared memory (16 KB a block: a wave's) and count them there, so the last layer's rows never go to
// scratch and no GroupSum stage reads them back. At issue 30's network that takes 1/7 of the stages a round off the
// path (the GroupSum was on it: stage 2 of the slot's next chunk waits for its reader) and 16 MB a round of L2
// traffic (the last layer's 8 MB a chunk, written then read: ~11% of the bytes). An item's counts cost one atomic per
// sample of the chunk whatever its gates: 4 waves (512 gates at chunk 128, 13 items a 6400-gate group) keep the
// GroupSum items' atomics and make 260 items a round of 2 chunks; 2 waves make them as long as a layer item's and
// as many (500 a round, all resident) for twice the atomics. Which wins is for the GPU to say. The same 64
// registers as early; the counters (64 rows a thread at 4 waves) within their 7 bits.
template <int kChunkBytes, int kThreads, int kFoldWaves>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) difflogic_packed_net_fold_kernel(const DiffLogicNetParams p) {
  dl_net_run<kChunkBytes, kThreads, false, true, kFoldWaves>(p);
}

}  // namespace kspec
