// The warp-scan kernels (algo 0) of the Mamba S6 selective scan (mamba_ssm's selective_scan_fn, plus
// an initial state h0): forward and backward as templates over compile-time constants for NVRTC.
// Host-side contract (grid, block, workspace, alignment) is spelled out above each kernel; the
// backward's pass 2 (selective_scan_bwd_reduce_kernel) is in reduce.cuh.
//
// Design, shared by the forward and the backward:
// - One warp owns one channel (b, d) for the whole sequence; the state of all kDstate states is fp32.
//   The sequence is cut into tiles of kTile = 32 * kItems steps; lane l of the warp takes the kItems
//   consecutive steps [tile*kTile + l*kItems, ... + kItems) of a tile. The time axis is contiguous in
//   memory, so each lane's kItems values of u, delta, z, out (and of a variable B or C row) are one or
//   two 16-byte accesses and a warp covers 32 neighbouring ones: coalesced without shared memory.
// - The recurrence x_t = a_t x_{t-1} + b_t (a_t = exp(dt_t A), b_t = dt_t B_t u_t) is an affine map per
//   step; maps compose associatively. Per state n, each lane composes its kItems maps from a zero
//   state (the pair (P, X): P = product of a, X = local end state), a 5-step shuffle scan over the 32
//   lanes gives every lane the true state entering its steps, and the lane replays its kItems steps
//   from there (keeping a_t and b_t in registers, so exp is evaluated once per step and state).
// - Tiles follow each other serially inside the warp, the state carried between them in shared memory
//   (kDstate floats per warp: up to 256 states would not fit in registers). Parallelism comes from
//   batch * dim warps, 16384 for the (8, 2048) Mamba shapes and 2048 (15 per SM on an H100) for
//   (1, 2048, 65536). We chose this serial carry over a chunked scan with a fix-up pass because the
//   fix-up needs a second pass of exponentials over every step (the forward is bound by the SFU's
//   ex2 rate: 16 per SM and clock), while the serial carry costs only a shuffle broadcast per tile.
//   (The sequential-state kernels, sequential.cuh, do take that second pass, as "segments", where few channels
//   leave the GPU idle: at 1x2048x65536 it wins 1.4x.)
// - Decays are exp2(dt * A * log2(e)), log2(e) folded into A once per state: one MUFU.EX2 each.
// - Padding steps past seqlen get dt = 0 and u = 0: a = 1, b = 0, so the state passes through them.
#pragma once

#include "selective_scan/common.cuh"

namespace kspec {

// Everything compile-time about one scan specialization: the problem's ScanFlags (common.cuh) and the
// block shape. kEven (the flags' kVectors): seqlen is a multiple of 512, hence of kTile, and every
// pointer is 16-byte aligned (vector loads, no masks).
template <typename Flags, int kWarps_, int kItems_>
struct ScanTraits : Flags {
  static_assert(!Flags::kTimeMajor, "time-major tensors: the sequential kernels only");
  static constexpr bool kEven = Flags::kVectors;
  static constexpr int kWarps = kWarps_;
  static constexpr int kItems = kItems_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kTile = kWarpSize * kItems;
  static_assert(Flags::kDstate >= 1 && Flags::kDstate <= 256, "dstate must be in 1..256");
  static_assert(kWarps >= 1 && kWarps <= 32, "1..32 warps per block");
  static_assert(kItems == 1 || kItems == 2 || kItems == 4 || kItems == 8 || kItems == 16,
                "kItems must be a power of two up to 16");
};

namespace scan_detail {

// kItems values of one row starting at step t0 (zeros past seqlen).
template <typename Tr, typename X>
__device__ __forceinline__ void load_items(const X* row, int t0, int seqlen, float (&v)[Tr::kItems]) {
  if constexpr (Tr::kEven) {
    load_floats<Tr::kItems>(row + t0, v);
  } else {
#pragma unroll
    for (int k = 0; k < Tr::kItems; ++k) v[k] = t0 + k < seqlen ? to_float(row[t0 + k]) : 0.0f;
  }
}

template <typename Tr, typename X>
__device__ __forceinline__ void store_items(X* row, int t0, int seqlen, const float (&v)[Tr::kItems]) {
  if constexpr (Tr::kEven) {
    store_floats<Tr::kItems>(row + t0, v);
  } else {
#pragma unroll
    for (int k = 0; k < Tr::kItems; ++k)
      if (t0 + k < seqlen) row[t0 + k] = from_float<X>(v[k]);
  }
}

// B or C of state n at the lane's steps: a row of the variable layout, or the one fixed value.
//   var_row: offset of [b, g, n, 0] in the variable layout; fixed_index: d * kDstate + n.
template <typename Tr, bool kVar, typename X>
__device__ __forceinline__ void load_bc(const X* p, long long var_row, int fixed_index, int t0, int seqlen,
                                        float (&v)[Tr::kItems]) {
  if constexpr (kVar) {
    load_items<Tr>(p + var_row, t0, seqlen, v);
  } else {
    const float f = to_float(p[fixed_index]);
#pragma unroll
    for (int k = 0; k < Tr::kItems; ++k) v[k] = f;
  }
}

// dt after bias and softplus (pre keeps the value before softplus); 0 past seqlen.
template <typename Tr>
__device__ __forceinline__ void make_dt(float (&dt)[Tr::kItems], float (&pre)[Tr::kItems], float bias, int t0,
                                        int seqlen) {
#pragma unroll
  for (int k = 0; k < Tr::kItems; ++k) {
    pre[k] = dt[k] + bias;
    float v = pre[k];
    if constexpr (Tr::kSoftplus) v = softplus(v);
    if constexpr (!Tr::kEven) v = t0 + k < seqlen ? v : 0.0f;
    dt[k] = v;
  }
}

// Inclusive scan of affine maps over the warp in time order: lane l ends with the composition of the
// maps of lanes 0..l, (P, X) meaning h -> P h + X.
__device__ __forceinline__ void warp_scan_forward(float& P, float& X, int lane) {
#pragma unroll
  for (int off = 1; off < kWarpSize; off *= 2) {
    const float Pp = __shfl_up_sync(kFull, P, off);
    const float Xp = __shfl_up_sync(kFull, X, off);
    if (lane >= off) {  // earlier maps (Pp, Xp) first, then ours: P (Pp h + Xp) + X
      X = fmaf(P, Xp, X);
      P *= Pp;
    }
  }
}

// The same in reverse time order (the adjoint runs backwards): lane l ends with the composition of
// the maps of lanes l..31, its own applied last.
__device__ __forceinline__ void warp_scan_reverse(float& P, float& G, int lane) {
#pragma unroll
  for (int off = 1; off < kWarpSize; off *= 2) {
    const float Pn = __shfl_down_sync(kFull, P, off);
    const float Gn = __shfl_down_sync(kFull, G, off);
    if (lane + off < kWarpSize) {
      G = fmaf(P, Gn, G);
      P *= Pn;
    }
  }
}

// The forward recurrence of state n over one tile for this lane: a[k], b[k] of the lane's steps, the
// state entering the lane's first step (h_in), and the tile's end state (carry_out, every lane).
// carry_in: the state before the tile (every lane passes the same value).
template <int kItems>
__device__ __forceinline__ float lane_entry_state(const float (&a)[kItems], const float (&bu)[kItems],
                                                  float carry_in, int lane, float* carry_out,
                                                  float* lane_product) {
  float X = 0.0f, P = 1.0f;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    X = fmaf(a[k], X, bu[k]);
    P *= a[k];
  }
  if (lane_product) *lane_product = P;
  if (lane == 0) X = fmaf(P, carry_in, X);  // fold the carry into the first map
  warp_scan_forward(P, X, lane);
  float h = __shfl_up_sync(kFull, X, 1);
  if (lane == 0) h = carry_in;
  *carry_out = __shfl_sync(kFull, X, kWarpSize - 1);
  return h;
}

}  // namespace scan_detail

// ---------------------------------------------------------------------------------------------
// Forward: out = (C . x_t + D u_t) * silu(z_t), last_state = x_{seqlen-1}.
//
// Launch: blockDim = (kThreads, 1, 1); gridDim = (ceil(dim / kWarps), batch). Warp w of block (i, b)
// owns channel d = i * kWarps + w of batch b (warps past dim return at once: no block barriers here).
// Neighbouring warps share b and usually the group, so a variable B/C row is read from L1/L2 once
// per block rather than once per channel. Shared memory: static, kWarps * kDstate floats (the carry).
// Per step and state: one ex2, ~6 FMA/FMUL and, per kItems steps, 10 shuffles for the scan.
// All tensors contiguous; with kEven the pointers are 16-byte aligned (the host checks).
// ---------------------------------------------------------------------------------------------
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    selective_scan_fwd_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                              const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                              const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                              const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                              const float* __restrict__ h0, typename Tr::T* __restrict__ out,
                              float* __restrict__ last_state, int dim, int seqlen, int channels_per_group,
                              int groups, float* __restrict__ states) {
  using namespace scan_detail;
  constexpr int N = Tr::kDstate;
  constexpr int K = Tr::kItems;
  __shared__ float carry_s[Tr::kWarps][N];

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int d = static_cast<int>(blockIdx.x) * Tr::kWarps + warp;
  const int b = static_cast<int>(blockIdx.y);
  if (d >= dim) return;
  const long long chan = static_cast<long long>(b) * dim + d;  // (b, d) flattened
  const long long row = chan * seqlen;                          // u[b, d, 0]
  const long long bc_base = (static_cast<long long>(b) * groups + d / channels_per_group) * N * seqlen;
  float* carry = carry_s[warp];
  for (int n = lane; n < N; n += kWarpSize) carry[n] = Tr::kHasH0 ? h0[chan * N + n] : 0.0f;
  const float bias = Tr::kHasDeltaBias ? delta_bias[d] : 0.0f;
  const float Dd = Tr::kHasD ? D[d] : 0.0f;
  const int ntiles = (seqlen + Tr::kTile - 1) / Tr::kTile;

  for (int tile = 0; tile < ntiles; ++tile) {
    __syncwarp();  // the carry written by lane 0 in the last tile (or set above) is visible
    const int t0 = tile * Tr::kTile + lane * K;
    // The lanes entering a multiple of 16 steps write the states for the backward.
    const bool st_lane = states && t0 % kStateStride == 0 && t0 < seqlen;
    float uv[K], dt[K], pre[K], dtu[K], y[K];
    load_items<Tr>(u + row, t0, seqlen, uv);
    load_items<Tr>(delta + row, t0, seqlen, dt);
    make_dt<Tr>(dt, pre, bias, t0, seqlen);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      dtu[k] = dt[k] * uv[k];
      y[k] = 0.0f;
    }
#pragma unroll 2
    for (int n = 0; n < N; ++n) {
      const float a2 = A[d * N + n] * kLog2e;
      float Bv[K], Cv[K], a[K], bu[K];
      load_bc<Tr, Tr::kVarB>(B, bc_base + static_cast<long long>(n) * seqlen, d * N + n, t0, seqlen, Bv);
      load_bc<Tr, Tr::kVarC>(C, bc_base + static_cast<long long>(n) * seqlen, d * N + n, t0, seqlen, Cv);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        a[k] = fast_exp2(dt[k] * a2);
        bu[k] = dtu[k] * Bv[k];
      }
      const float c_in = carry[n];
      float c_out;
      float h = lane_entry_state<K>(a, bu, c_in, lane, &c_out, nullptr);
      if (st_lane) states[(chan * nstates_of(seqlen) + t0 / kStateStride) * N + n] = h;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        h = fmaf(a[k], h, bu[k]);
        y[k] = fmaf(Cv[k], h, y[k]);
      }
      __syncwarp();  // every lane has read carry[n]
      if (lane == 0) carry[n] = c_out;
    }
    float o[K];
    if constexpr (Tr::kHasZ) {
      float zv[K];
      load_items<Tr>(z + row, t0, seqlen, zv);
#pragma unroll
      for (int k = 0; k < K; ++k) o[k] = fmaf(Dd, uv[k], y[k]) * silu(zv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) o[k] = fmaf(Dd, uv[k], y[k]);
    }
    store_items<Tr>(out + row, t0, seqlen, o);
  }
  __syncwarp();
  for (int n = lane; n < N; n += kWarpSize) last_state[chan * N + n] = carry[n];
}

// ---------------------------------------------------------------------------------------------
// Backward, pass 1 of 2 (the main kernel; selective_scan_bwd_zero_kernel runs before it when B or C
// is variable, selective_scan_bwd_reduce_kernel after it).
//
// Per warp (one channel, as in the forward):
//  1. Forward over all tiles, writing the state entering each tile to `states` ([batch*dim, ntiles,
//     dstate] fp32): ntiles * dstate floats per channel instead of every state (2 MB at seqlen 2048,
//     dim 2048, batch 8... x4 bytes: 8 MB), no outputs.
//  2. Tiles in reverse order. Per state n: recompute a, b and the states of the lane's steps from the
//     saved tile state (one forward shuffle scan), then run the adjoint H_{t-1} = a_t (H_t + gy_t C_t)
//     backwards with a reverse shuffle scan, the carry H between tiles in shared memory (seeded with
//     dlast_state), and form every gradient term at each step from hx = H_t + gy_t C_t and x_t:
//       dC_t = gy_t x_t,  a_t x_{t-1} = x_t - dt_t B_t u_t,  ddt_t += hx (A a_t x_{t-1} + B_t u_t),
//       dA += hx dt_t a_t x_{t-1},  dB_t = hx dt_t u_t,  du_t += hx dt_t B_t.
//     y_t = C . x_t is summed over n on the way, for dz. Exponentials: 2 per step and state (pass 1
//     and here) against 1 in the forward op.
// Sums over batch and time, deterministically: dA, a fixed dB/dC (per (d, n)), dD and ddelta_bias
// (per d) are summed per channel in a fixed order (lanes by a xor butterfly, tiles in order) into
// `partials` ([batch*dim, 3*dstate + 2]); the reduce kernel adds the batch entries in order.
// A variable dB/dC is a sum over the channels of a group: the block's warps (kWarps channels of one
// group) add theirs in shared memory in warp order, then one fp32 atomicAdd per element and block
// goes to dB_acc/dC_acc (zeroed before): those sums over blocks are in a run-dependent order (not
// bitwise reproducible; everything else is).
//
// Launch: blockDim = (kThreads, 1, 1); gridDim = (dim / kWarps, batch) when B or C is variable
// (kWarps must divide dim / groups: the block barriers need every warp, and its channels one group),
// else (ceil(dim / kWarps), batch). Shared memory: static, (kHasVarBC ? 2 * kThreads * kItems : 0) +
// 2 * kWarps * kDstate + 3 * kWarps * kDstate floats. Workspace: states, partials; dB_acc and dC_acc
// when variable ([batch, groups, dstate, seqlen] fp32, zero on entry: op.cpp's VarAccumulators).
// ---------------------------------------------------------------------------------------------
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    selective_scan_bwd_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                              const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                              const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                              const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                              const float* __restrict__ h0, const typename Tr::T* __restrict__ dout,
                              const float* __restrict__ dlast_state, typename Tr::T* __restrict__ du,
                              typename Tr::T* __restrict__ ddelta, typename Tr::T* __restrict__ dz,
                              float* __restrict__ dh0, float* __restrict__ dB_acc, float* __restrict__ dC_acc,
                              float* states, float* __restrict__ partials, int dim, int seqlen,
                              int channels_per_group, int groups, const float* __restrict__ given) {
  using namespace scan_detail;
  constexpr int N = Tr::kDstate;
  constexpr int K = Tr::kItems;
  constexpr bool kVarBC = Tr::kVarB || Tr::kVarC;
  constexpr int kRed = kVarBC ? Tr::kWarps * Tr::kTile : 1;
  __shared__ float carry_s[Tr::kWarps][N];  // pass 1: the state; pass 2: the adjoint H
  __shared__ float acc_s[3][Tr::kWarps][N];  // dA, fixed dB, fixed dC of this channel
  __shared__ float red_s[2][kRed];           // variable dB, dC of one tile and state, per warp

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int d = static_cast<int>(blockIdx.x) * Tr::kWarps + warp;
  const int b = static_cast<int>(blockIdx.y);
  if (!kVarBC && d >= dim) return;  // with variable B/C the host launches whole blocks only
  const long long chan = static_cast<long long>(b) * dim + d;
  const long long row = chan * seqlen;
  const long long bc_base = (static_cast<long long>(b) * groups + d / channels_per_group) * N * seqlen;
  const int ntiles = (seqlen + Tr::kTile - 1) / Tr::kTile;
  float* carry = carry_s[warp];
  float* tile_states = states + chan * ntiles * N;
  const float bias = Tr::kHasDeltaBias ? delta_bias[d] : 0.0f;
  const float Dd = Tr::kHasD ? D[d] : 0.0f;
  // The state entering tile i: tile_in[i * tile_step * N + n] (the forward's states, or pass 1's).
  static_assert(Tr::kTile % kStateStride == 0, "a tile is a whole number of state strides");
  const float* tile_in = given ? given + chan * nstates_of(seqlen) * N : tile_states;
  const int tile_step = given ? Tr::kTile / kStateStride : 1;

  // ---- 1: forward, saving the state entering each tile (unless the forward gave them) ----
  for (int n = lane; n < N; n += kWarpSize) carry[n] = Tr::kHasH0 ? h0[chan * N + n] : 0.0f;
  for (int tile = 0; tile < (given ? 0 : ntiles); ++tile) {
    __syncwarp();
    for (int n = lane; n < N; n += kWarpSize) tile_states[tile * N + n] = carry[n];
    const int t0 = tile * Tr::kTile + lane * K;
    float uv[K], dt[K], pre[K];
    load_items<Tr>(u + row, t0, seqlen, uv);
    load_items<Tr>(delta + row, t0, seqlen, dt);
    make_dt<Tr>(dt, pre, bias, t0, seqlen);
#pragma unroll 2
    for (int n = 0; n < N; ++n) {
      const float a2 = A[d * N + n] * kLog2e;
      float Bv[K], a[K], bu[K];
      load_bc<Tr, Tr::kVarB>(B, bc_base + static_cast<long long>(n) * seqlen, d * N + n, t0, seqlen, Bv);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        a[k] = fast_exp2(dt[k] * a2);
        bu[k] = dt[k] * uv[k] * Bv[k];
      }
      const float c_in = carry[n];
      float c_out;
      lane_entry_state<K>(a, bu, c_in, lane, &c_out, nullptr);
      __syncwarp();
      if (lane == 0) carry[n] = c_out;
    }
  }

  // ---- 2: backward over tiles in reverse ----
  __syncwarp();  // tile_states written by other lanes are visible
  for (int n = lane; n < N; n += kWarpSize) {
    carry[n] = dlast_state ? dlast_state[chan * N + n] : 0.0f;
    acc_s[0][warp][n] = 0.0f;
    acc_s[1][warp][n] = 0.0f;
    acc_s[2][warp][n] = 0.0f;
  }
  float dD_lane = 0.0f, dbias_lane = 0.0f;
  for (int tile = ntiles - 1; tile >= 0; --tile) {
    __syncwarp();
    const int t0 = tile * Tr::kTile + lane * K;
    float uv[K], dt[K], pre[K], gy[K], zv[K], y[K], ddt[K], duv[K];
    load_items<Tr>(u + row, t0, seqlen, uv);
    load_items<Tr>(delta + row, t0, seqlen, dt);
    load_items<Tr>(dout + row, t0, seqlen, gy);
    make_dt<Tr>(dt, pre, bias, t0, seqlen);
    if constexpr (Tr::kHasZ) {
      load_items<Tr>(z + row, t0, seqlen, zv);
#pragma unroll
      for (int k = 0; k < K; ++k) gy[k] *= silu(zv[k]);  // the gradient reaching y + D u
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      y[k] = 0.0f;
      ddt[k] = 0.0f;
      duv[k] = gy[k] * Dd;
      dD_lane = fmaf(gy[k], uv[k], dD_lane);
    }
#pragma unroll 1
    for (int n = 0; n < N; ++n) {
      const float An = A[d * N + n];
      const float a2 = An * kLog2e;
      float Bv[K], Cv[K], a[K], bu[K], xs[K];
      load_bc<Tr, Tr::kVarB>(B, bc_base + static_cast<long long>(n) * seqlen, d * N + n, t0, seqlen, Bv);
      load_bc<Tr, Tr::kVarC>(C, bc_base + static_cast<long long>(n) * seqlen, d * N + n, t0, seqlen, Cv);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        a[k] = fast_exp2(dt[k] * a2);
        bu[k] = dt[k] * uv[k] * Bv[k];
      }
      // the states x_t of the lane's steps, from the state saved for this tile
      float P, tile_end;
      float h = lane_entry_state<K>(a, bu, tile_in[tile * tile_step * N + n], lane, &tile_end, &P);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        h = fmaf(a[k], h, bu[k]);
        xs[k] = h;
        y[k] = fmaf(Cv[k], h, y[k]);
      }
      // the adjoint: lane-local from zero over its steps backwards, then the reverse scan
      float G = 0.0f;
#pragma unroll
      for (int k = K - 1; k >= 0; --k) G = a[k] * fmaf(gy[k], Cv[k], G);
      const float H_after = carry[n];  // the adjoint entering this tile from the steps after it
      if (lane == kWarpSize - 1) G = fmaf(P, H_after, G);
      warp_scan_reverse(P, G, lane);
      float H = __shfl_down_sync(kFull, G, 1);
      if (lane == kWarpSize - 1) H = H_after;
      const float H_before = __shfl_sync(kFull, G, 0);
      float dA_l = 0.0f, dBf = 0.0f, dCf = 0.0f;
#pragma unroll
      for (int k = K - 1; k >= 0; --k) {
        const float hx = fmaf(gy[k], Cv[k], H);  // adjoint of x_t
        const float ax_prev = xs[k] - bu[k];     // a_t x_{t-1}
        const float dBk = hx * dt[k] * uv[k];
        const float dCk = gy[k] * xs[k];
        ddt[k] = fmaf(hx, fmaf(An, ax_prev, Bv[k] * uv[k]), ddt[k]);
        dA_l = fmaf(hx * dt[k], ax_prev, dA_l);
        duv[k] = fmaf(hx * dt[k], Bv[k], duv[k]);
        H = a[k] * hx;
        if constexpr (Tr::kVarB) red_s[0][warp * Tr::kTile + lane * K + k] = dBk;
        else dBf += dBk;
        if constexpr (Tr::kVarC) red_s[1][warp * Tr::kTile + lane * K + k] = dCk;
        else dCf += dCk;
      }
      dA_l = warp_reduce_sum(dA_l);
      if constexpr (!Tr::kVarB) dBf = warp_reduce_sum(dBf);
      if constexpr (!Tr::kVarC) dCf = warp_reduce_sum(dCf);
      __syncwarp();  // every lane has read carry[n]
      if (lane == 0) {
        carry[n] = H_before;
        acc_s[0][warp][n] += dA_l;
        acc_s[1][warp][n] += dBf;
        acc_s[2][warp][n] += dCf;
      }
      if constexpr (kVarBC) {
        // Sum the block's channels (warp order), one atomic per element of this tile and state.
        __syncthreads();
        for (int e = static_cast<int>(threadIdx.x); e < Tr::kTile; e += Tr::kThreads) {
          const int t = tile * Tr::kTile + e;
          if (t < seqlen) {
            const long long idx = bc_base + static_cast<long long>(n) * seqlen + t;
            if constexpr (Tr::kVarB) {
              float s = 0.0f;
              for (int w = 0; w < Tr::kWarps; ++w) s += red_s[0][w * Tr::kTile + e];
              atomicAdd(dB_acc + idx, s);
            }
            if constexpr (Tr::kVarC) {
              float s = 0.0f;
              for (int w = 0; w < Tr::kWarps; ++w) s += red_s[1][w * Tr::kTile + e];
              atomicAdd(dC_acc + idx, s);
            }
          }
        }
        __syncthreads();
      }
    }
    float dd[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      dd[k] = Tr::kSoftplus ? ddt[k] * sigmoid(pre[k]) : ddt[k];
      if constexpr (!Tr::kEven) dd[k] = t0 + k < seqlen ? dd[k] : 0.0f;
      dbias_lane += dd[k];
    }
    store_items<Tr>(ddelta + row, t0, seqlen, dd);
    store_items<Tr>(du + row, t0, seqlen, duv);
    if constexpr (Tr::kHasZ) {
      float dzv[K], g[K];
      load_items<Tr>(dout + row, t0, seqlen, g);
#pragma unroll
      for (int k = 0; k < K; ++k) dzv[k] = g[k] * fmaf(Dd, uv[k], y[k]) * d_silu(zv[k]);
      store_items<Tr>(dz + row, t0, seqlen, dzv);
    }
  }
  __syncwarp();
  if (!kVarBC || d < dim) {
    float* part = partials + chan * (3 * N + 2);
    for (int n = lane; n < N; n += kWarpSize) {
      if constexpr (Tr::kHasH0) dh0[chan * N + n] = carry[n];
      part[n] = acc_s[0][warp][n];
      part[N + n] = acc_s[1][warp][n];
      part[2 * N + n] = acc_s[2][warp][n];
    }
    dD_lane = warp_reduce_sum(dD_lane);
    dbias_lane = warp_reduce_sum(dbias_lane);
    if (lane == 0) {
      part[3 * N] = dD_lane;
      part[3 * N + 1] = dbias_lane;
    }
  }
}

}  // namespace kspec
