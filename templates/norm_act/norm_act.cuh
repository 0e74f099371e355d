// Fused y = act(norm(x) * weight + bias) over the last dimension (LayerNorm or RMSNorm, then an
// activation), forward and backward, as templates over compile-time constants for NVRTC.
// Host-side contract (blockDim, grid, alignment, workspace) is spelled out above each kernel.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"
#include "norm_act/params.h"

namespace kspec {

// Derived constants shared by the forward and backward kernels.
//
// Work split: a block of kThreads = kThreadsPerRow * kRowsPerBlock threads is cut into kRowsPerBlock
// row groups of kThreadsPerRow consecutive threads; each group owns one row at a time. A row is
// kNumVecs chunks of kVec elements, and lane l of a group takes chunks l, l + kThreadsPerRow, ...
// so that neighbouring lanes touch neighbouring 16-byte chunks (coalesced) and each thread holds
// kIters chunks of the row in registers. Chunks at or past kNumVecs exist only when kNumVecs is not
// a multiple of kThreadsPerRow (kEvenCols false); those threads skip them.
template <typename T, typename TW, int kHidden, int kThreadsPerRow, int kRowsPerBlock, int kVec>
struct NormActTraits {
  static constexpr int kThreads = kThreadsPerRow * kRowsPerBlock;
  static constexpr int kNumVecs = kHidden / kVec;
  static constexpr int kIters = (kNumVecs + kThreadsPerRow - 1) / kThreadsPerRow;
  static constexpr bool kEvenCols = kNumVecs % kThreadsPerRow == 0;
  // The row lives in registers. At 128 elements per thread the forward pass already takes ~170
  // registers and the backward pass spills kilobytes; past that ptxas also takes minutes (over ten
  // for 1024), so such configs fail here, at once, instead.
  static constexpr int kMaxElemsPerThread = 128;

  static_assert(kHidden >= 1, "hidden size must be positive");
  static_assert(kThreadsPerRow >= 1 && kThreadsPerRow <= 1024 &&
                    (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                "kThreadsPerRow must be a power of two in 1..1024");
  static_assert(kRowsPerBlock >= 1 && kThreads <= 1024, "a block holds at most 1024 threads");
  static_assert(kVec == 1 || kVec == 2 || kVec == 4 || kVec == 8, "kVec must be 1, 2, 4 or 8");
  static_assert(kVec * sizeof(T) <= 16, "one vector access moves at most 16 bytes");
  static_assert(kHidden % kVec == 0, "the host picks kVec dividing the hidden size");
  static_assert(IsSame<TW, float>::value || IsSame<TW, T>::value,
                "weight dtype must be float or the activation dtype");
  static_assert(kIters * kVec <= kMaxElemsPerThread,
                "row too long for this kThreadsPerRow: more than 128 elements per thread");
};

// Column chunk k of this lane is inside the row (always true when kEvenCols).
template <int kNumVecs, bool kEvenCols>
__device__ __forceinline__ bool chunk_in_row(int chunk) {
  return kEvenCols || chunk < kNumVecs;
}

// The normalization and affine steps use explicitly rounded operations (__fmul_rn, fmaf) rather than
// a*b + c, which ptxas may or may not contract into an FMA, and may decide differently in two copies
// of the same code: on an H100, y differed by 1 ulp between two launches of one kernel whose row loop
// the compiler had cloned over a null test. Fixed roundings also make the backward pass recompute
// the forward's h bit for bit from the saved mean and rstd.
__device__ __forceinline__ float normalize(float x, float mu, float rs) {
  return __fmul_rn(x - mu, rs);
}
template <bool kHasBias>
__device__ __forceinline__ float affine(float xhat, float w, float b) {
  if constexpr (kHasBias) {
    return fmaf(xhat, w, b);
  } else {
    return __fmul_rn(xhat, w);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.
//
// One pass over memory: each row group reads its row once into fp32 registers, reduces the
// statistics with shuffles (plus one shared-memory step when a group spans several warps), and
// writes y once, so the kernel moves the minimum bytes (x in, y out, weight/bias from L1/L2).
// LayerNorm takes the mean first and then the centred variance from the registers — the same
// data, so this costs a second reduction, not a second read — which avoids the cancellation of
// E[x^2] - mean^2 when |mean| >> std. mean/rstd are saved for the backward pass.
//
// Launch: blockDim = (kThreadsPerRow * kRowsPerBlock, 1, 1); gridDim.x = ceil(rows / kRowsPerBlock):
// block b, row group g takes row b * kRowsPerBlock + g (rows past the end are masked).
// Shared memory: static only (kThreadsPerRow > 32: kThreads/32 floats), no dynamic shared memory.
// Alignment: x, y to kVec*sizeof(T) bytes, row strides multiples of kVec; weight and bias to
// min(kVec*sizeof(TW), 16) bytes. With kSaveStats (a backward follows) mean and rstd are written
// ([rows] each; RMSNorm stores mean = 0): 8 bytes a row. Without, they are not outputs at all (null):
// a compile-time flag rather than a run-time null test, over which the compiler may clone code, and
// the caller allocates one output instead of three.
//
// __launch_bounds__ names no minimum of blocks per SM on purpose: ptxas then trades a few bytes of
// spill (at most 20, in 5 of 192 bf16 hidden-4096/8192 instantiations, all hidden 8192 with bias
// and SiLU/GELU-erf) for an occupancy step, and that is faster: bf16 16384x4096 RMSNorm+SiLU
// (256,1,8) 0.095 ms vs 0.104 ms with (threads, 1); 4096x8192 (512,1,8) 0.053 vs 0.064 ms (H100).
// ---------------------------------------------------------------------------------------------
template <typename T, typename TW, int kHidden, int kNorm, int kAct, bool kHasBias,
          int kThreadsPerRow, int kRowsPerBlock, int kVec, bool kSaveStats = true>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock)
    norm_act_fwd_kernel(const NormActParams prm) {
  const T* __restrict__ x = static_cast<const T*>(prm.x);
  const TW* __restrict__ weight = static_cast<const TW*>(prm.weight);
  const TW* __restrict__ bias = static_cast<const TW*>(prm.bias);
  T* __restrict__ y = static_cast<T*>(prm.y);
  float* __restrict__ mean = prm.mean;
  float* __restrict__ rstd = prm.rstd;
  const int rows = prm.rows;
  const long long x_row_stride = prm.x_row_stride;
  const long long y_row_stride = prm.y_row_stride;
  const float eps = prm.eps;
  using Tr = NormActTraits<T, TW, kHidden, kThreadsPerRow, kRowsPerBlock, kVec>;
  constexpr int kThreads = Tr::kThreads;
  constexpr int kIters = Tr::kIters;
  constexpr int kScratch = RowReduceScratch<kThreads, kThreadsPerRow, 1>::value;
  __shared__ float reduce_scratch[kScratch > 0 ? kScratch : 1];

  const int group = static_cast<int>(threadIdx.x) / kThreadsPerRow;
  const int lane = static_cast<int>(threadIdx.x) % kThreadsPerRow;
  const float inv_hidden = 1.0f / static_cast<float>(kHidden);

  // One step per block, no grid-stride loop: with a loop, ptxas hoisted the shared-memory addresses
  // out of it and spilled them (4-20 bytes) to reach its occupancy target. Every thread of a block
  // that has rows runs the reductions, valid row or not, because they contain barriers.
  const long long row_base = static_cast<long long>(blockIdx.x) * kRowsPerBlock;
  if (row_base >= rows) return;
  const long long row = row_base + group;
  const bool row_ok = row < rows;

  float xv[kIters][kVec];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) xv[k][v] = 0.0f;
  }
  if (row_ok) {
    const T* x_row = x + row * x_row_stride;
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int chunk = lane + k * kThreadsPerRow;
      if (chunk_in_row<Tr::kNumVecs, Tr::kEvenCols>(chunk)) {
        load_floats<kVec>(x_row + chunk * kVec, xv[k]);
      }
    }
  }

  float mu = 0.0f;
  if constexpr (kNorm == kNormLayer) {
    float sum[1] = {0.0f};  // chunks past the row end hold 0 and add nothing
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) sum[0] += xv[k][v];
    }
    row_group_reduce_sum<kThreads, kThreadsPerRow, 1>(sum, reduce_scratch);
    mu = __fmul_rn(sum[0], inv_hidden);
  }
  float sq[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int chunk = lane + k * kThreadsPerRow;
    if (chunk_in_row<Tr::kNumVecs, Tr::kEvenCols>(chunk)) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float d = xv[k][v] - mu;
        sq[0] = fmaf(d, d, sq[0]);
      }
    }
  }
  row_group_reduce_sum<kThreads, kThreadsPerRow, 1>(sq, reduce_scratch);
  const float rs = rsqrtf(fmaf(sq[0], inv_hidden, eps));

  if (row_ok) {
    if (kSaveStats && lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
    T* y_row = y + row * y_row_stride;
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int chunk = lane + k * kThreadsPerRow;
      if (chunk_in_row<Tr::kNumVecs, Tr::kEvenCols>(chunk)) {
        const int col = chunk * kVec;
        float w[kVec];
        load_floats<kVec>(weight + col, w);
        float b[kVec] = {};
        if constexpr (kHasBias) load_floats<kVec>(bias + col, b);
        float out[kVec];
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          const float h = affine<kHasBias>(normalize(xv[k][v], mu, rs), w[v], b[v]);
          out[v] = apply_act<kAct>(h);
        }
        store_floats<kVec>(y_row + col, out);
      }
    }
  }
}

// Writes this block's per-column partial sums acc (one row group's share in each thread) to
// out[0..kHidden). With several row groups the groups are added in shared memory in group order
// 0, 1, ..., so the result does not depend on timing. Called by every thread of the block.
template <int kHidden, int kThreadsPerRow, int kRowsPerBlock, int kVec, int kIters, bool kEvenCols>
__device__ __forceinline__ void store_block_partial(const float (&acc)[kIters][kVec],
                                                    float* __restrict__ out, float* combine,
                                                    int group, int lane) {
  constexpr int kNumVecs = kHidden / kVec;
  if constexpr (kRowsPerBlock == 1) {
    // Written once per block, a small fraction of the traffic: plain stores keep the workspace free
    // of alignment demands.
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int chunk = lane + k * kThreadsPerRow;
      if (chunk_in_row<kNumVecs, kEvenCols>(chunk)) {
#pragma unroll
        for (int v = 0; v < kVec; ++v) out[chunk * kVec + v] = acc[k][v];
      }
    }
  } else {
    // One column chunk (kThreadsPerRow*kVec columns) at a time: every group stages its values, then
    // all kThreads threads sum a column each over the groups, bounding shared memory at kThreads*kVec
    // floats whatever the hidden size.
    constexpr int kThreads = kThreadsPerRow * kRowsPerBlock;
    constexpr int kChunkCols = kThreadsPerRow * kVec;
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      store_floats<kVec>(combine + group * kChunkCols + lane * kVec, acc[k]);
      __syncthreads();
      for (int c = static_cast<int>(threadIdx.x); c < kChunkCols; c += kThreads) {
        const int col = k * kChunkCols + c;
        if (col < kHidden) {
          float s = combine[c];
#pragma unroll
          for (int r = 1; r < kRowsPerBlock; ++r) s += combine[r * kChunkCols + c];
          out[col] = s;
        }
      }
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, pass 1 of 2.
//
// Recomputes xhat = (x - mean) * rstd and h = xhat*w + b from x and the saved statistics instead
// of saving xhat or h in the forward pass: reading x again costs the same bytes as reading a saved
// xhat, and the forward pass writes half as much. Per row:
//   g = dy * act'(h);  dxhat = g * w;
//   LayerNorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//   RMSNorm:   dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
// dweight = sum over rows of g*xhat and dbias = sum of g need a reduction over all rows. Instead of
// atomics (non-deterministic order) the grid is persistent: block b owns a fixed set of rows, keeps
// its column partials in registers across all of them, and writes one fp32 partial row
// dw_partial[b][:] (db_partial[b][:]); norm_act_bwd_reduce_kernel then adds the gridDim.x partial
// rows in a fixed order. Same inputs and same grid give the same bits.
//
// Launch: blockDim = (kThreadsPerRow * kRowsPerBlock, 1, 1); gridDim.x = the number of partial rows
// (a few blocks per SM; any value >= 1 is correct, each block writes its whole partial row even if it
// owned no rows). Block b handles rows (b + i*gridDim.x)*kRowsPerBlock + group.
// Workspace: dw_partial and (kHasBias) db_partial, gridDim.x * kHidden floats each, no alignment
// needed. Shared memory: static only — kThreads/32 * (LayerNorm ? 2 : 1) floats when
// kThreadsPerRow > 32, plus kThreads*kVec floats when kRowsPerBlock > 1.
// Alignment as in the forward pass (dy, x, dx like x). mean is not read for RMSNorm (may be null).
//
// __launch_bounds__(threads, 1): with the threads alone, ptxas squeezed some instantiations to an
// occupancy step and spilled (8-12 bytes, e.g. bf16 hidden 8192 (256,1,8) GELU-tanh at 128
// registers); with a minimum of one block per SM none of the 192 bf16 hidden-4096/8192
// instantiations checked spills, and the persistent grid is sized from the occupancy anyway.
// ---------------------------------------------------------------------------------------------
template <typename T, typename TW, int kHidden, int kNorm, int kAct, bool kHasBias,
          int kThreadsPerRow, int kRowsPerBlock, int kVec>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock, 1)
    norm_act_bwd_kernel(const NormActParams prm) {
  const T* __restrict__ dy = static_cast<const T*>(prm.dy);
  const T* __restrict__ x = static_cast<const T*>(prm.x);
  const TW* __restrict__ weight = static_cast<const TW*>(prm.weight);
  const TW* __restrict__ bias = static_cast<const TW*>(prm.bias);
  const float* __restrict__ mean = prm.mean;
  const float* __restrict__ rstd = prm.rstd;
  T* __restrict__ dx = static_cast<T*>(prm.dx);
  float* __restrict__ dw_partial = prm.dw_partial;
  float* __restrict__ db_partial = prm.db_partial;
  const int rows = prm.rows;
  const long long dy_row_stride = prm.dy_row_stride;
  const long long x_row_stride = prm.x_row_stride;
  const long long dx_row_stride = prm.dx_row_stride;
  using Tr = NormActTraits<T, TW, kHidden, kThreadsPerRow, kRowsPerBlock, kVec>;
  constexpr int kThreads = Tr::kThreads;
  constexpr int kIters = Tr::kIters;
  // LayerNorm needs sum(dxhat * xhat) and sum(dxhat); RMSNorm only the first.
  constexpr int kNumSums = kNorm == kNormLayer ? 2 : 1;
  constexpr int kScratch = RowReduceScratch<kThreads, kThreadsPerRow, kNumSums>::value;
  constexpr int kCombine = kRowsPerBlock > 1 ? kThreads * kVec : 1;
  // h is needed only to evaluate act'(h); with the identity the bias never enters the backward pass.
  constexpr bool kNeedH = kAct != kActIdentity;
  __shared__ float reduce_scratch[kScratch > 0 ? kScratch : 1];
  __shared__ __align__(16) float combine[kCombine];

  const int group = static_cast<int>(threadIdx.x) / kThreadsPerRow;
  const int lane = static_cast<int>(threadIdx.x) % kThreadsPerRow;
  const float inv_hidden = 1.0f / static_cast<float>(kHidden);

  float dw_acc[kIters][kVec];
  float db_acc[kIters][kVec];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      dw_acc[k][v] = 0.0f;
      db_acc[k][v] = 0.0f;
    }
  }

  for (long long row_base = static_cast<long long>(blockIdx.x) * kRowsPerBlock; row_base < rows;
       row_base += static_cast<long long>(gridDim.x) * kRowsPerBlock) {
    const long long row = row_base + group;
    const bool row_ok = row < rows;

    float xhat[kIters][kVec];
    float dxhat[kIters][kVec];
    float sums[kNumSums];
#pragma unroll
    for (int n = 0; n < kNumSums; ++n) sums[n] = 0.0f;
    float rs = 0.0f;

    if (row_ok) {
      const float mu = kNorm == kNormLayer ? mean[row] : 0.0f;
      rs = rstd[row];
      const T* x_row = x + row * x_row_stride;
      const T* dy_row = dy + row * dy_row_stride;
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int chunk = lane + k * kThreadsPerRow;
        if (chunk_in_row<Tr::kNumVecs, Tr::kEvenCols>(chunk)) {
          const int col = chunk * kVec;
          float xf[kVec];
          float gf[kVec];
          float w[kVec];
          load_floats<kVec>(x_row + col, xf);
          load_floats<kVec>(dy_row + col, gf);
          load_floats<kVec>(weight + col, w);
          float b[kVec] = {};
          if constexpr (kNeedH && kHasBias) load_floats<kVec>(bias + col, b);
#pragma unroll
          for (int v = 0; v < kVec; ++v) {
            const float xh = normalize(xf[v], mu, rs);
            float g = gf[v];
            if constexpr (kNeedH) g = __fmul_rn(g, act_grad<kAct>(affine<kHasBias>(xh, w[v], b[v])));
            dw_acc[k][v] = fmaf(g, xh, dw_acc[k][v]);
            if constexpr (kHasBias) db_acc[k][v] += g;
            const float d = __fmul_rn(g, w[v]);
            xhat[k][v] = xh;
            dxhat[k][v] = d;
            sums[0] = fmaf(d, xh, sums[0]);
            if constexpr (kNumSums == 2) sums[1] += d;
          }
        }
      }
    }

    row_group_reduce_sum<kThreads, kThreadsPerRow, kNumSums>(sums, reduce_scratch);

    if (row_ok) {
      const float mean_dxhat_xhat = __fmul_rn(sums[0], inv_hidden);
      float mean_dxhat = 0.0f;
      if constexpr (kNumSums == 2) mean_dxhat = __fmul_rn(sums[1], inv_hidden);
      T* dx_row = dx + row * dx_row_stride;
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int chunk = lane + k * kThreadsPerRow;
        if (chunk_in_row<Tr::kNumVecs, Tr::kEvenCols>(chunk)) {
          float out[kVec];
#pragma unroll
          for (int v = 0; v < kVec; ++v) {
            out[v] = __fmul_rn(rs, fmaf(-xhat[k][v], mean_dxhat_xhat, dxhat[k][v] - mean_dxhat));
          }
          store_floats<kVec>(dx_row + chunk * kVec, out);
        }
      }
    }
  }

  const long long partial_offset = static_cast<long long>(blockIdx.x) * kHidden;
  store_block_partial<kHidden, kThreadsPerRow, kRowsPerBlock, kVec, kIters, Tr::kEvenCols>(
      dw_acc, dw_partial + partial_offset, combine, group, lane);
  if constexpr (kHasBias) {
    store_block_partial<kHidden, kThreadsPerRow, kRowsPerBlock, kVec, kIters, Tr::kEvenCols>(
        db_acc, db_partial + partial_offset, combine, group, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, pass 2 of 2: dweight[j] = sum_p dw_partial[p][j] for p = 0, 1, ..., num_partials-1 in
// that order (and dbias alike), rounded once to TW. One thread per column, so each step of the loop
// is one coalesced row read; the sequential order is what makes the result bit-reproducible.
//
// Launch: blockDim = (kThreads, 1, 1), gridDim.x = ceil(kHidden / kThreads); num_partials = the
// gridDim.x that norm_act_bwd_kernel ran with. No shared memory.
// ---------------------------------------------------------------------------------------------
template <typename TW, int kHidden, bool kHasBias, int kThreads>
__global__ void __launch_bounds__(kThreads)
    norm_act_bwd_reduce_kernel(const NormActParams prm) {
  const float* __restrict__ dw_partial = prm.dw_partial;
  const float* __restrict__ db_partial = prm.db_partial;
  TW* __restrict__ dweight = static_cast<TW*>(prm.dweight);
  TW* __restrict__ dbias = static_cast<TW*>(prm.dbias);
  const int num_partials = prm.num_partials;
  static_assert(kThreads >= 1 && kThreads <= 1024, "a block holds at most 1024 threads");
  const int j = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (j >= kHidden) return;
  float dw = 0.0f;
  float db = 0.0f;
  // Unrolling lets several rows' loads be in flight at once; the additions keep their order.
#pragma unroll 8
  for (int p = 0; p < num_partials; ++p) {
    const long long idx = static_cast<long long>(p) * kHidden + j;
    dw += dw_partial[idx];
    if constexpr (kHasBias) db += db_partial[idx];
  }
  dweight[j] = from_float<TW>(dw);
  if constexpr (kHasBias) dbias[j] = from_float<TW>(db);
}

// ---------------------------------------------------------------------------------------------
// Streamed rows: the kernels above hold a row in registers, which caps hidden at 8192 (1024 threads
// x 8 elements, or 256 x 32). Past that the row is streamed instead: one block per row walks it in
// chunks of kThreads*kVec elements, once per statistic and once for the output. The first walk
// reads HBM; the later ones re-read a row of at most a few hundred KB that the block touched
// moments before, mostly from L1 and otherwise L2 (50 MB), so the HBM traffic stays near one read.
// The arithmetic is the register kernels' own (normalize, affine, the same act), so both variants
// agree to the summation order of the statistics.
//
// Launch (both stream kernels): blockDim = (kThreads, 1, 1), gridDim.x = rows (one block per row).
// Shared memory: static only (kThreads/32 * 2 floats). Alignment as for the register kernels.
// ---------------------------------------------------------------------------------------------
template <typename T, typename TW, int kHidden, int kNorm, int kAct, bool kHasBias, int kThreads,
          int kVec, bool kSaveStats = true>
__global__ void __launch_bounds__(kThreads)
    norm_act_fwd_stream_kernel(const NormActParams prm) {
  const T* __restrict__ x = static_cast<const T*>(prm.x);
  const TW* __restrict__ weight = static_cast<const TW*>(prm.weight);
  const TW* __restrict__ bias = static_cast<const TW*>(prm.bias);
  T* __restrict__ y = static_cast<T*>(prm.y);
  float* __restrict__ mean = prm.mean;
  float* __restrict__ rstd = prm.rstd;
  const int rows = prm.rows;
  const long long x_row_stride = prm.x_row_stride;
  const long long y_row_stride = prm.y_row_stride;
  const float eps = prm.eps;
  static_assert(kThreads >= 32 && kThreads <= 1024 && (kThreads & (kThreads - 1)) == 0,
                "kThreads must be a power of two in 32..1024");
  static_assert(kHidden % kVec == 0, "the host picks kVec dividing the hidden size");
  constexpr int kNumVecs = kHidden / kVec;
  constexpr int kScratch = RowReduceScratch<kThreads, kThreads, 1>::value;
  __shared__ float reduce_scratch[kScratch > 0 ? kScratch : 1];
  const long long row = blockIdx.x;
  if (row >= rows) return;
  const int tid = static_cast<int>(threadIdx.x);
  const float inv_hidden = 1.0f / static_cast<float>(kHidden);
  const T* x_row = x + row * x_row_stride;

  float mu = 0.0f;
  if constexpr (kNorm == kNormLayer) {
    float sum[1] = {0.0f};
    for (int c = tid; c < kNumVecs; c += kThreads) {
      float xv[kVec];
      load_floats<kVec>(x_row + c * kVec, xv);
#pragma unroll
      for (int v = 0; v < kVec; ++v) sum[0] += xv[v];
    }
    row_group_reduce_sum<kThreads, kThreads, 1>(sum, reduce_scratch);
    mu = __fmul_rn(sum[0], inv_hidden);
  }
  float sq[1] = {0.0f};
  for (int c = tid; c < kNumVecs; c += kThreads) {
    float xv[kVec];
    load_floats<kVec>(x_row + c * kVec, xv);
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const float d = xv[v] - mu;
      sq[0] = fmaf(d, d, sq[0]);
    }
  }
  row_group_reduce_sum<kThreads, kThreads, 1>(sq, reduce_scratch);
  const float rs = rsqrtf(fmaf(sq[0], inv_hidden, eps));
  if (kSaveStats && tid == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
  T* y_row = y + row * y_row_stride;
  for (int c = tid; c < kNumVecs; c += kThreads) {
    const int col = c * kVec;
    float xv[kVec], w[kVec], b[kVec] = {}, out[kVec];
    load_floats<kVec>(x_row + col, xv);
    load_floats<kVec>(weight + col, w);
    if constexpr (kHasBias) load_floats<kVec>(bias + col, b);
#pragma unroll
    for (int v = 0; v < kVec; ++v) out[v] = apply_act<kAct>(affine<kHasBias>(normalize(xv[v], mu, rs), w[v], b[v]));
    store_floats<kVec>(y_row + col, out);
  }
}

// g = dy * act'(h) and xhat for kVec elements of one row (the backward's recomputation).
template <typename T, typename TW, int kAct, bool kHasBias, int kVec>
__device__ __forceinline__ void stream_bwd_load(const T* x, const T* dy, const TW* weight, const TW* bias,
                                                float mu, float rs, float (&xh)[kVec], float (&g)[kVec],
                                                float (&w)[kVec]) {
  constexpr bool kNeedH = kAct != kActIdentity;
  float xf[kVec], b[kVec] = {};
  load_floats<kVec>(x, xf);
  load_floats<kVec>(dy, g);
  load_floats<kVec>(weight, w);
  if constexpr (kNeedH && kHasBias) load_floats<kVec>(bias, b);
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    xh[v] = normalize(xf[v], mu, rs);
    if constexpr (kNeedH) g[v] = __fmul_rn(g[v], act_grad<kAct>(affine<kHasBias>(xh[v], w[v], b[v])));
  }
}

// Backward of a streamed row, dx only: one walk for sum(dxhat*xhat) (and sum(dxhat) for LayerNorm),
// one to write dx. dweight/dbias come from norm_act_bwd_stream_dwdb_kernel. Launch as the forward.
template <typename T, typename TW, int kHidden, int kNorm, int kAct, bool kHasBias, int kThreads,
          int kVec>
__global__ void __launch_bounds__(kThreads)
    norm_act_bwd_stream_dx_kernel(const NormActParams prm) {
  const T* __restrict__ dy = static_cast<const T*>(prm.dy);
  const T* __restrict__ x = static_cast<const T*>(prm.x);
  const TW* __restrict__ weight = static_cast<const TW*>(prm.weight);
  const TW* __restrict__ bias = static_cast<const TW*>(prm.bias);
  const float* __restrict__ mean = prm.mean;
  const float* __restrict__ rstd = prm.rstd;
  T* __restrict__ dx = static_cast<T*>(prm.dx);
  const int rows = prm.rows;
  const long long dy_row_stride = prm.dy_row_stride;
  const long long x_row_stride = prm.x_row_stride;
  const long long dx_row_stride = prm.dx_row_stride;
  static_assert(kThreads >= 32 && kThreads <= 1024 && (kThreads & (kThreads - 1)) == 0,
                "kThreads must be a power of two in 32..1024");
  constexpr int kNumVecs = kHidden / kVec;
  constexpr int kNumSums = kNorm == kNormLayer ? 2 : 1;
  constexpr int kScratch = RowReduceScratch<kThreads, kThreads, kNumSums>::value;
  __shared__ float reduce_scratch[kScratch > 0 ? kScratch : 1];
  const long long row = blockIdx.x;
  if (row >= rows) return;
  const int tid = static_cast<int>(threadIdx.x);
  const float inv_hidden = 1.0f / static_cast<float>(kHidden);
  const float mu = kNorm == kNormLayer ? mean[row] : 0.0f;
  const float rs = rstd[row];
  const T* x_row = x + row * x_row_stride;
  const T* dy_row = dy + row * dy_row_stride;

  float sums[kNumSums];
#pragma unroll
  for (int n = 0; n < kNumSums; ++n) sums[n] = 0.0f;
  for (int c = tid; c < kNumVecs; c += kThreads) {
    const int col = c * kVec;
    float xh[kVec], g[kVec], w[kVec];
    stream_bwd_load<T, TW, kAct, kHasBias, kVec>(x_row + col, dy_row + col, weight + col, bias + col, mu, rs,
                                                  xh, g, w);
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const float d = __fmul_rn(g[v], w[v]);
      sums[0] = fmaf(d, xh[v], sums[0]);
      if constexpr (kNumSums == 2) sums[1] += d;
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kNumSums>(sums, reduce_scratch);
  const float mean_dxhat_xhat = __fmul_rn(sums[0], inv_hidden);
  float mean_dxhat = 0.0f;
  if constexpr (kNumSums == 2) mean_dxhat = __fmul_rn(sums[1], inv_hidden);
  T* dx_row = dx + row * dx_row_stride;
  for (int c = tid; c < kNumVecs; c += kThreads) {
    const int col = c * kVec;
    float xh[kVec], g[kVec], w[kVec], out[kVec];
    stream_bwd_load<T, TW, kAct, kHasBias, kVec>(x_row + col, dy_row + col, weight + col, bias + col, mu, rs,
                                                  xh, g, w);
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      out[v] = __fmul_rn(rs, fmaf(-xh[v], mean_dxhat_xhat, __fmul_rn(g[v], w[v]) - mean_dxhat));
    }
    store_floats<kVec>(dx_row + col, out);
  }
}

// dweight/dbias partials for streamed rows, column-parallel: thread j of block (bx, p) owns column
// bx*kThreads + j and sums g*xhat (and g) over the rows [p*rows_per_part, (p+1)*rows_per_part) in
// order, writing dw_partial[p][col] (db_partial[p][col]); norm_act_bwd_reduce_kernel then adds the
// gridDim.y partial rows in order, so the result is bitwise reproducible. A warp reads 32 adjacent
// elements of a row per step (coalesced).
//
// Launch: blockDim = (kThreads, 1, 1), gridDim = (ceil(kHidden / kThreads), parts); rows_per_part *
// parts >= rows. Workspace: parts * kHidden floats for each of dw_partial and (kHasBias) db_partial.
template <typename T, typename TW, int kHidden, int kNorm, int kAct, bool kHasBias, int kThreads>
__global__ void __launch_bounds__(kThreads)
    norm_act_bwd_stream_dwdb_kernel(const NormActParams prm) {
  const T* __restrict__ dy = static_cast<const T*>(prm.dy);
  const T* __restrict__ x = static_cast<const T*>(prm.x);
  const TW* __restrict__ weight = static_cast<const TW*>(prm.weight);
  const TW* __restrict__ bias = static_cast<const TW*>(prm.bias);
  const float* __restrict__ mean = prm.mean;
  const float* __restrict__ rstd = prm.rstd;
  float* __restrict__ dw_partial = prm.dw_partial;
  float* __restrict__ db_partial = prm.db_partial;
  const int rows = prm.rows;
  const int rows_per_part = prm.rows_per_part;
  const long long dy_row_stride = prm.dy_row_stride;
  const long long x_row_stride = prm.x_row_stride;
  const int col = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (col >= kHidden) return;
  const long long part = blockIdx.y;
  const long long r0 = part * rows_per_part;
  const long long r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  float dw = 0.0f, db = 0.0f;
  for (long long r = r0; r < r1; ++r) {
    const float mu = kNorm == kNormLayer ? mean[r] : 0.0f;
    float xh[1], g[1], w[1];
    stream_bwd_load<T, TW, kAct, kHasBias, 1>(x + r * x_row_stride + col, dy + r * dy_row_stride + col,
                                              weight + col, bias + col, mu, rstd[r], xh, g, w);
    dw = fmaf(g[0], xh[0], dw);
    if constexpr (kHasBias) db += g[0];
  }
  dw_partial[part * kHidden + col] = dw;
  if constexpr (kHasBias) db_partial[part * kHidden + col] = db;
}

}  // namespace kspec
