// difflogic layer kernels (api/ops/difflogic/reference.h is the spec). First versions, correct before
// fast; every sum in a fixed order, no atomics, so a rerun gives the same bits:
//   difflogic_tables_kernel   one thread per gate: p = softmax(logits) or one-hot argmax (ties to the
//                             lower index), T = p . truth table, 4 floats per gate, once per call.
//                             With p.gumbel the logits are logits + G, G the gate's Gumbel noise of
//                             p.seed (philox.cuh), here and in the dlogits kernels alike: the
//                             straight-through estimator's hard forward and soft backward see one G.
//   Activations are row-major [batch, width] or, kFM / layout feature_major, feature-major (the transpose
//   of a contiguous [width, batch], difflogic's own layout): flat indices run in memory order either way.
//   difflogic_fwd_kernel      one thread per (sample, gate), y written in memory order:
//                             y = T00 (1-a)(1-b) + T01 (1-a) b + T10 a (1-b) + T11 a b. Feature-major,
//                             a warp reads rows a_g and b_g contiguously.
//   difflogic_dx_kernel       one thread per (sample, input): dx = grad_factor * the sum of da or db over
//                             the input's readers in the consumers CSR's order (recomputed from x, dout, T:
//                             no [batch, n_out, 2] buffer); a self-paired gate gives da + db.
//   dlogits                   S_uv = sum_s dout P(a = u) P(b = v), then dlogits_i = p_i (sum_uv f_i(u, v)
//                             S_uv - sum_uv T_uv S_uv), which is sum_s dout p_i (op_i - y) with 4 sums
//                             instead of 16. Feature-major (difflogic_dlogits_fm_kernel): one block per
//                             gate, threads along the batch, a fixed block tree. Row-major
//                             (difflogic_dlogits_partial_kernel, _finish_kernel): threads along the gates
//                             (a block per gate would read a different row per thread), each summing a
//                             chunk of kDiffLogicChunk samples in order; the chunks then summed in order.
//   Feature-major, batch-tiled (tuning axis lanes > 0; lanes = 0 keeps the flat kernels above):
//   difflogic_fwd_tiled_kernel  kLanes threads per gate, each moving 16 bytes (float4, 8 halves) of a tile
//                             of kLanes * 16 / sizeof(T) samples; blockIdx.x runs over the gates, fastest,
//                             so every gate of one tile runs before the next tile: the tile's slice of x
//                             (n_in x tile bytes) stays in L2 and the second reader of an input hits it
//                             (the flat kernel walks whole rows: its second reader refetched from DRAM).
//   difflogic_bwd_tiled_kernel  kLanes threads per (input j, tile), walking j's readers in CSR order: dx
//                             as the flat dx kernel; at the reader entry of side 0 (exactly one per gate)
//                             it also has x[a], x[b], dout[g] in registers, so it sums the gate's S_uv over
//                             the tile (a fixed shuffle tree in the lane group) into partials[tile][g]:
//                             no separate dlogits pass re-reading x and dout. difflogic_dlogits_finish_kernel
//                             then sums the tiles in order.
// A wire outside [0, n_in) is never followed: its outputs become NaN (the wiring is validated on the host
// when it is built; this keeps a bad one from reading out of bounds).
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "difflogic/params.h"
#include "difflogic/philox.cuh"

namespace kspec {

// f_i(u, v) of op i, uv = 2u + v: bit 3 - uv of i.
__device__ __forceinline__ float difflogic_truth(int i, int uv) { return static_cast<float>((i >> (3 - uv)) & 1); }

__device__ __forceinline__ bool difflogic_wire_ok(int w, long long n_in) {
  return static_cast<unsigned long long>(static_cast<long long>(w)) < static_cast<unsigned long long>(n_in);
}

// softmax of gate g's logits into p[16] (max subtracted; fp32).
__device__ __forceinline__ void difflogic_softmax(const float* l, float* p) {
  float mx = l[0];
#pragma unroll
  for (int i = 1; i < 16; ++i) mx = fmaxf(mx, l[i]);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) sum += p[i] = expf(l[i] - mx);
  const float inv = 1.0f / sum;
#pragma unroll
  for (int i = 0; i < 16; ++i) p[i] *= inv;
}

// Gate g's 16 logits, plus its Gumbel noise when p.gumbel.
__device__ __forceinline__ void difflogic_load_logits(const DiffLogicParams& p, long long g, float* l) {
#pragma unroll
  for (int i = 0; i < 16; ++i) l[i] = p.logits[g * 16 + i];
  if (p.gumbel) difflogic_add_gumbel(l, p.seed, g);
}

// Gate g's table: T_uv = sum_i p_i f_i(u, v), p the softmax (or, kHard, the one-hot argmax) of its logits.
template <bool kHard>
__device__ __forceinline__ void difflogic_table(const DiffLogicParams& p, long long g, float* t) {
  float l[16];
  difflogic_load_logits(p, g, l);
  float w[16];
  if (kHard) {
    int best = 0;
#pragma unroll
    for (int i = 1; i < 16; ++i)
      if (l[i] > l[best]) best = i;  // strict: ties stay with the lower index
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = i == best ? 1.0f : 0.0f;
  } else {
    difflogic_softmax(l, w);
  }
#pragma unroll
  for (int uv = 0; uv < 4; ++uv) {
    t[uv] = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) t[uv] += w[i] * difflogic_truth(i, uv);
  }
}

template <bool kHard, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_tables_kernel(const DiffLogicParams p) {
  for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < p.n_out;
       g += static_cast<long long>(gridDim.x) * kThreads) {
    float t[4];
    difflogic_table<kHard>(p, g, t);
#pragma unroll
    for (int uv = 0; uv < 4; ++uv) p.tables[g * 4 + uv] = t[uv];
  }
}

__device__ __forceinline__ float difflogic_gate(const float* t, float xa, float xb) {
  return t[0] * (1.0f - xa) * (1.0f - xb) + t[1] * (1.0f - xa) * xb + t[2] * xa * (1.0f - xb) + t[3] * xa * xb;
}

// Element (s, j) of a [batch, width] activation: row-major (s * width + j) or, kFM, feature-major
// (j * batch + s: the transpose of a contiguous [width, batch], so a feature is one contiguous row).
template <bool kFM>
__device__ __forceinline__ long long difflogic_at(const DiffLogicParams& p, long long s, long long j,
                                                  long long width) {
  return kFM ? j * p.batch + s : s * width + j;
}

// Flat index e over [batch, width] in memory order: (s, j) with j fastest (row-major) or s fastest (kFM),
// so consecutive threads touch consecutive addresses of y / dx either way.
template <bool kFM>
__device__ __forceinline__ void difflogic_split(const DiffLogicParams& p, long long e, long long width, long long& s,
                                                long long& j) {
  if (kFM) {
    j = e / p.batch;
    s = e - j * p.batch;
  } else {
    s = e / width;
    j = e - s * width;
  }
}

template <typename T, int kThreads, bool kFM>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_kernel(const DiffLogicParams p) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const long long total = p.batch * p.n_out;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    long long s, g;
    difflogic_split<kFM>(p, e, p.n_out, s, g);
    const int wa = p.a[g], wb = p.b[g];
    float out = __int_as_float(0x7fc00000);  // NaN for a wire out of range
    if (difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in)) {
      const float t[4] = {p.tables[g * 4], p.tables[g * 4 + 1], p.tables[g * 4 + 2], p.tables[g * 4 + 3]};
      out = difflogic_gate(t, to_float(x[difflogic_at<kFM>(p, s, wa, p.n_in)]),
                           to_float(x[difflogic_at<kFM>(p, s, wb, p.n_in)]));
    }
    y[e] = from_float<T>(out);
  }
}

template <typename T, int kThreads, bool kFM>
__global__ void __launch_bounds__(kThreads) difflogic_dx_kernel(const DiffLogicParams p) {
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  T* dx = static_cast<T*>(p.dx);
  const long long total = p.batch * p.n_in;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    long long s, j;
    difflogic_split<kFM>(p, e, p.n_in, s, j);
    float sum = 0.0f;
    for (int k = p.offsets[j]; k < p.offsets[j + 1]; ++k) {
      const int entry = p.entries[k], g = entry >> 1, wa = p.a[g], wb = p.b[g];
      if (!difflogic_wire_ok(wa, p.n_in) || !difflogic_wire_ok(wb, p.n_in)) {
        sum = __int_as_float(0x7fc00000);
        break;
      }
      const float* t = p.tables + 4 * g;
      const float xa = to_float(x[difflogic_at<kFM>(p, s, wa, p.n_in)]),
                  xb = to_float(x[difflogic_at<kFM>(p, s, wb, p.n_in)]),
                  d = to_float(dout[difflogic_at<kFM>(p, s, g, p.n_out)]);
      sum += (entry & 1) ? d * ((t[1] - t[0]) * (1.0f - xa) + (t[3] - t[2]) * xa)
                         : d * ((t[2] - t[0]) * (1.0f - xb) + (t[3] - t[1]) * xb);
    }
    dx[e] = from_float<T>(p.grad_factor * sum);
  }
}

// Gate g's dlogits from its four sums S_uv: dlogits_i = p_i (sum_uv f_i(u, v) S_uv - sum_uv T_uv S_uv).
__device__ __forceinline__ void difflogic_dlogits_of(const DiffLogicParams& p, long long g, const float* S, bool ok,
                                                     int i) {
  float l[16], pr[16];
  difflogic_load_logits(p, g, l);
  difflogic_softmax(l, pr);
  const float* t = p.tables + 4 * g;
  float own = 0.0f, mix = 0.0f;
#pragma unroll
  for (int uv = 0; uv < 4; ++uv) {
    own += difflogic_truth(i, uv) * S[uv];
    mix += t[uv] * S[uv];
  }
  p.dlogits[g * 16 + i] = ok ? pr[i] * (own - mix) : __int_as_float(0x7fc00000);
}

__device__ __forceinline__ void difflogic_accumulate(float* acc, float d, float xa, float xb) {
  acc[0] += d * (1.0f - xa) * (1.0f - xb);
  acc[1] += d * (1.0f - xa) * xb;
  acc[2] += d * xa * (1.0f - xb);
  acc[3] += d * xa * xb;
}

// Feature-major: one block per gate, threads along the batch (rows a_g, b_g and g of dout read
// contiguously), then a fixed block tree.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_dlogits_fm_kernel(const DiffLogicParams p) {
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  __shared__ float partial[4][kThreads / kWarpSize];
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  for (long long g = blockIdx.x; g < p.n_out; g += gridDim.x) {
    const int wa = p.a[g], wb = p.b[g];
    const bool ok = difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok) {
      const T *xa = x + wa * p.batch, *xb = x + wb * p.batch, *d = dout + g * p.batch;
      for (long long s = threadIdx.x; s < p.batch; s += kThreads)
        difflogic_accumulate(acc, to_float(d[s]), to_float(xa[s]), to_float(xb[s]));
    }
    // The block tree: shuffles within each warp, then the warps' partials in order.
    warp_reduce_sum<kWarpSize, 4>(acc);
    if (threadIdx.x % kWarpSize == 0)
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) partial[uv][threadIdx.x / kWarpSize] = acc[uv];
    __syncthreads();
    if (threadIdx.x < 16) {
      float S[4];
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) {
        S[uv] = 0.0f;
        for (int w = 0; w < kThreads / kWarpSize; ++w) S[uv] += partial[uv][w];
      }
      difflogic_dlogits_of(p, g, S, ok, threadIdx.x);
    }
    __syncthreads();  // partial is reused by the next gate
  }
}

// Row-major, first pass: thread (chunk c = blockIdx.y, gate g) sums samples [c kDiffLogicChunk, (c + 1)
// kDiffLogicChunk) in order into partials[c][g][4] (tables' workspace, after the tables). Gates run along
// the threads, so dout's row is read coalesced and x's two reads of a warp hit one row.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_dlogits_partial_kernel(const DiffLogicParams p) {
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  float* partials = p.tables + 4 * p.n_out;
  const long long chunks = p.batch > 0 ? (p.batch + kDiffLogicChunk - 1) / kDiffLogicChunk : 1;
  for (long long c = blockIdx.y; c < chunks; c += gridDim.y) {
    const long long s0 = c * kDiffLogicChunk, s1 = s0 + kDiffLogicChunk < p.batch ? s0 + kDiffLogicChunk : p.batch;
    for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < p.n_out;
         g += static_cast<long long>(gridDim.x) * kThreads) {
      const int wa = p.a[g], wb = p.b[g];
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in))
        for (long long s = s0; s < s1; ++s)
          difflogic_accumulate(acc, to_float(dout[s * p.n_out + g]), to_float(x[s * p.n_in + wa]),
                               to_float(x[s * p.n_in + wb]));
      reinterpret_cast<float4*>(partials)[c * p.n_out + g] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
  }
}

// Second pass (row-major, and the feature-major tiled backward with kChunk its tile): one thread per
// (gate, op i); S = the chunks' partials summed in chunk order.
template <int kThreads, int kChunk>
__global__ void __launch_bounds__(kThreads) difflogic_dlogits_finish_kernel(const DiffLogicParams p) {
  const float4* partials = reinterpret_cast<const float4*>(p.tables + 4 * p.n_out);
  const long long chunks = (p.batch + kChunk - 1) / kChunk;  // none at batch 0: S = 0
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < p.n_out * 16;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long g = e / 16;
    const int wa = p.a[g], wb = p.b[g];
    float S[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long long c = 0; c < chunks; ++c) {
      const float4 v = partials[c * p.n_out + g];
      S[0] += v.x;
      S[1] += v.y;
      S[2] += v.z;
      S[3] += v.w;
    }
    difflogic_dlogits_of(p, g, S, difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in),
                         static_cast<int>(e % 16));
  }
}

// ---- Feature-major, batch-tiled ----

// Samples a lane holds: kVec consecutive ones when the rows are 16-byte aligned (vector accesses), else
// kVec strided by kLanes (scalar accesses, still coalesced across the lane group). Sample s of lane `lane`,
// element k, tile base s0.
template <typename T, int kLanes>
struct DiffLogicTile {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kSamples = kLanes * kVec;
  __device__ static long long sample(bool vec, long long s0, int lane, int k) {
    return vec ? s0 + lane * kVec + k : s0 + k * kLanes + lane;
  }
  // Row values of this lane's samples as floats; 0 past the batch.
  __device__ static void load(const T* row, bool vec, long long s0, int lane, long long batch, float (&v)[kVec]) {
    if (vec) {
      const long long s = s0 + lane * kVec;  // batch % kVec == 0: a vector is all in or all out
      if (s < batch) {
        const Vec<T, kVec> w = load_vec<kVec>(row + s);
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = to_float(w.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = 0.0f;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const long long s = s0 + k * kLanes + lane;
        v[k] = s < batch ? to_float(row[s]) : 0.0f;
      }
    }
  }
  __device__ static void store(T* row, bool vec, long long s0, int lane, long long batch, const float (&v)[kVec]) {
    if (vec) {
      const long long s = s0 + lane * kVec;
      if (s < batch) {
        Vec<T, kVec> w;
#pragma unroll
        for (int k = 0; k < kVec; ++k) w.v[k] = from_float<T>(v[k]);
        store_vec<kVec>(row + s, w);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const long long s = s0 + k * kLanes + lane;
        if (s < batch) row[s] = from_float<T>(v[k]);
      }
    }
  }
};

// Whether every row of these feature-major tensors starts 16-byte aligned (vector accesses).
template <typename T>
__device__ __forceinline__ bool difflogic_rows_aligned(long long batch, const void* a, const void* b,
                                                       const void* c = nullptr) {
  const unsigned long long bits = reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
                                  reinterpret_cast<unsigned long long>(c);
  return bits % 16 == 0 && batch % (16 / static_cast<long long>(sizeof(T))) == 0;
}

// Grid (ceil(n_out / (kThreads / kLanes)), tiles): lane group = one gate, one tile per blockIdx.y.
template <typename T, int kThreads, int kLanes>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_tiled_kernel(const DiffLogicParams p) {
  static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two <= 32");
  using Tile = DiffLogicTile<T, kLanes>;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const long long g = blockIdx.x * static_cast<long long>(kThreads / kLanes) + threadIdx.x / kLanes;
  if (g >= p.n_out) return;
  const int lane = threadIdx.x % kLanes, wa = p.a[g], wb = p.b[g];
  const bool ok = difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in);
  const bool vec = difflogic_rows_aligned<T>(p.batch, x, y);
  const float4 t4 = reinterpret_cast<const float4*>(p.tables)[g];
  const float t[4] = {t4.x, t4.y, t4.z, t4.w};
  for (long long tile = blockIdx.y; tile * Tile::kSamples < p.batch; tile += gridDim.y) {
    const long long s0 = tile * Tile::kSamples;
    float out[Tile::kVec];
    if (ok) {
      float xa[Tile::kVec], xb[Tile::kVec];
      Tile::load(x + wa * p.batch, vec, s0, lane, p.batch, xa);
      Tile::load(x + wb * p.batch, vec, s0, lane, p.batch, xb);
#pragma unroll
      for (int k = 0; k < Tile::kVec; ++k) out[k] = difflogic_gate(t, xa[k], xb[k]);
    } else {
#pragma unroll
      for (int k = 0; k < Tile::kVec; ++k) out[k] = __int_as_float(0x7fc00000);  // NaN for a wire out of range
    }
    Tile::store(y + g * p.batch, vec, s0, lane, p.batch, out);
  }
}

// Input j's dx over the tile at s0 (this lane's kVec samples of it) into sum, grad_factor applied (NaN where a
// reader's wire is out of range): j's readers in the CSR's order [k0, k1), each gate's side-0 entry writing its
// S_uv over the tile into partials[tile][g]. `active` false (a lane group past n_in): sum 0, nothing read. Every
// lane of the group calls it with the same j (shared trip count and branches: the shuffles see the group).
template <typename T, int kLanes, bool kAhead>
__device__ __forceinline__ void difflogic_bwd_input_tile(const DiffLogicParams& p, bool active, long long j, int k0,
                                                         int k1, long long s0, long long tile, int lane,
                                                         unsigned group, bool vec,
                                                         float (&sum)[DiffLogicTile<T, kLanes>::kVec]) {
  using Tile = DiffLogicTile<T, kLanes>;
  constexpr int kV = Tile::kVec;
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  float4* partials = reinterpret_cast<float4*>(p.tables + 4 * p.n_out);
  float own[kV];
  if (active) {
    Tile::load(x + j * p.batch, vec, s0, lane, p.batch, own);
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) own[k] = 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kV; ++k) sum[k] = 0.0f;
  bool bad = false;
  // The next reader's entry is loaded a step ahead: each step's loads otherwise wait on a chain of three
  // (entry, then its wires, then the rows).
  int entry = k0 < k1 ? p.entries[k0] : 0;
  // kAhead: the next reader's gate, wires and T (loaded a step ahead), and the entry after it in `entry`.
  int next_g = 0, next_wa = 0, next_wb = 0, next_entry = entry;
  float4 next_t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (kAhead && k0 < k1) {
    next_g = entry >> 1;
    next_wa = p.a[next_g];
    next_wb = p.b[next_g];
    next_t = reinterpret_cast<const float4*>(p.tables)[next_g];
    entry = k0 + 1 < k1 ? p.entries[k0 + 1] : 0;
  }
  for (int e = k0; e < k1; ++e) {
    int g, wa, wb;
    bool side_b;
    float4 t;
    if (kAhead) {
      g = next_g;
      wa = next_wa;
      wb = next_wb;
      t = next_t;
      side_b = next_entry & 1;
      if (e + 1 < k1) {
        next_entry = entry;
        next_g = entry >> 1;
        next_wa = p.a[next_g];
        next_wb = p.b[next_g];
        next_t = reinterpret_cast<const float4*>(p.tables)[next_g];
        entry = e + 2 < k1 ? p.entries[e + 2] : 0;
      }
    } else {
      g = entry >> 1;
      wa = p.a[g];
      wb = p.b[g];
      side_b = entry & 1;
      entry = e + 1 < k1 ? p.entries[e + 1] : 0;
    }
    if (!difflogic_wire_ok(wa, p.n_in) || !difflogic_wire_ok(wb, p.n_in)) {
      bad = true;  // dx NaN; the finish kernel gives the gate NaN dlogits
      continue;
    }
    if (!kAhead) t = reinterpret_cast<const float4*>(p.tables)[g];
    float other[kV], d[kV];
    Tile::load(x + (side_b ? wa : wb) * p.batch, vec, s0, lane, p.batch, other);
    Tile::load(dout + g * p.batch, vec, s0, lane, p.batch, d);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      // As the flat kernel: side b gets d dy/db at (xa, xb) = (other, own), side a d dy/da at (own, other).
      if (side_b) {
        sum[k] += d[k] * ((t.y - t.x) * (1.0f - other[k]) + (t.w - t.z) * other[k]);
      } else {
        sum[k] += d[k] * ((t.z - t.x) * (1.0f - other[k]) + (t.w - t.y) * other[k]);
        difflogic_accumulate(acc, d[k], own[k], other[k]);
      }
    }
    if (!side_b) {
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2)
#pragma unroll
        for (int uv = 0; uv < 4; ++uv) acc[uv] += __shfl_xor_sync(group, acc[uv], offset, kLanes);
      if (lane == 0) partials[tile * p.n_out + g] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
  }
#pragma unroll
  for (int k = 0; k < kV; ++k) sum[k] = bad ? __int_as_float(0x7fc00000) : p.grad_factor * sum[k];
}

// The shuffle mask of this thread's lane group of kLanes threads.
template <int kLanes>
__device__ __forceinline__ unsigned difflogic_group_mask() {
  return kLanes == kWarpSize ? 0xffffffffu : ((1u << kLanes) - 1u) << (threadIdx.x % kWarpSize / kLanes * kLanes);
}

// Grid (ceil(n_in / (kThreads / kLanes)), tiles): lane group = one input j. dx[j] over the tile as the flat
// dx kernel sums it (CSR order); each gate's side-0 entry adds its S_uv over the tile into
// partials[tile][g] (workspace after the tables; every gate has exactly one side-0 entry, so each slot has
// one writer). The group's lanes share j, hence the loop's trip count and every branch: the shuffles see
// the whole group.
// kDxRowMajor: dx is written row-major ([batch, n_in] contiguous; x and dout stay feature-major), the
// transpose a row-major caller would otherwise run on dx afterwards (dx written, read and written again):
// the block's kThreads / kLanes consecutive inputs x kSamples samples of dx go through shared memory and
// out along dx's rows (32 consecutive inputs, 128 bytes of fp32, at lanes 8 and 256 threads).
// kAhead: the readers' loads run a step further ahead: the entry two readers ahead, the next reader's wires
// and T one ahead, so each reader waits on one round trip (its two rows) instead of two (its wires, then
// its rows): the lane group keeps more bytes in flight (the plain order ran at ~1.5 TB/s on the H100, 3X
// bytes in 2.12 ms at 16384 x 16000 -> 16000 fp32). Loads only move: the same sums, the same bits.
template <typename T, int kThreads, int kLanes, bool kDxRowMajor = false, bool kAhead = false>
__global__ void __launch_bounds__(kThreads) difflogic_bwd_tiled_kernel(const DiffLogicParams p) {
  static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two <= 32");
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  using Tile = DiffLogicTile<T, kLanes>;
  constexpr int kV = Tile::kVec, kGroups = kThreads / kLanes;
  // kDxRowMajor's staging: [input of the block][sample of the tile], one padding column (conflict-free reads
  // down a column); a one-float dummy otherwise.
  __shared__ float staged[kDxRowMajor ? kGroups : 1][kDxRowMajor ? Tile::kSamples + 1 : 1];
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  T* dx = static_cast<T*>(p.dx);
  const long long j0 = blockIdx.x * static_cast<long long>(kGroups), j = j0 + threadIdx.x / kLanes;
  // Past n_in the whole lane group idles; with kDxRowMajor it stays for the block's barriers.
  if (!kDxRowMajor && j >= p.n_in) return;
  const bool active = j < p.n_in;
  const int lane = threadIdx.x % kLanes;
  const unsigned group = difflogic_group_mask<kLanes>();
  // Feature-major dx shares x's alignment rule; row-major dx is written element by element.
  const bool vec = difflogic_rows_aligned<T>(p.batch, x, dout, kDxRowMajor ? nullptr : dx);
  const int k0 = active ? p.offsets[j] : 0, k1 = active ? p.offsets[j + 1] : 0;
  for (long long tile = blockIdx.y; tile * Tile::kSamples < p.batch; tile += gridDim.y) {
    const long long s0 = tile * Tile::kSamples;
    float sum[kV];
    difflogic_bwd_input_tile<T, kLanes, kAhead>(p, active, j, k0, k1, s0, tile, lane, group, vec, sum);
    if (!kDxRowMajor) {
      Tile::store(dx + j * p.batch, vec, s0, lane, p.batch, sum);
      continue;
    }
    const int row = threadIdx.x / kLanes;
#pragma unroll
    for (int k = 0; k < kV; ++k) staged[row][Tile::sample(vec, 0, lane, k)] = sum[k];
    __syncthreads();
    // Element e of the block's tile: sample e / kGroups, input e % kGroups (consecutive threads, consecutive
    // inputs of one dx row).
#pragma unroll
    for (int i = 0; i < kV; ++i) {  // kGroups kSamples = kThreads kV elements
      const int e = static_cast<int>(threadIdx.x) + i * kThreads;
      const long long s = s0 + e / kGroups, jj = j0 + e % kGroups;
      if (s < p.batch && jj < p.n_in) dx[s * p.n_in + jj] = from_float<T>(staged[e % kGroups][e / kGroups]);
    }
    __syncthreads();  // staged is refilled by the next tile
  }
}

}  // namespace kspec
