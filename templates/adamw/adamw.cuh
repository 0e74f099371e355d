// Fused multi-tensor AdamW: one launch updates every parameter tensor of a list, reading a device table
// of tensors and fixed-size chunks that the host builds once per call. Optional first pass: the global
// L2 norm of the (unscaled) gradients and a non-finite check, reduced deterministically (per-chunk
// partials in double, summed in a fixed order by one block), which gives the clipping factor
// min(1, max_norm / (norm + 1e-6)) and found_inf (the step is then skipped, as torch's fused AdamW does).
// Arithmetic in fp32 (the optimizer state is fp32), bf16/fp16 parameters updated from an fp32 master copy.
#pragma once

#include "adamw/params.h"
#include "common/dtype.cuh"

namespace kspec {

namespace adamw_detail {

template <int kThreads>
__device__ __forceinline__ double block_sum(double v, double* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;  // valid in thread 0
}

}  // namespace adamw_detail

// Pass 1: partial[c] = Σ g² over chunk c (double), NaN when the chunk holds a non-finite gradient.
// Launch: grid = chunks, block = kThreads.
template <typename TG, int kThreads, int kChunk>
__global__ void __launch_bounds__(kThreads)
    adamw_grad_norm_kernel(const AdamwTensor* __restrict__ tensors, const AdamwChunk* __restrict__ chunks,
                           double* __restrict__ partial) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  __shared__ double scratch[kThreads / 32];
  const AdamwChunk ch = chunks[blockIdx.x];
  const AdamwTensor t = tensors[ch.tensor];
  const TG* g = static_cast<const TG*>(t.grad);
  const long long end = t.numel - ch.start < kChunk ? t.numel : ch.start + kChunk;
  double s = 0.0;
  bool finite = true;
  for (long long i = ch.start + threadIdx.x; i < end; i += kThreads) {
    const float v = to_float(g[i]);
    finite = finite && isfinite(v);
    s += static_cast<double>(v) * v;
  }
  const int bad = __syncthreads_or(!finite);
  s = adamw_detail::block_sum<kThreads>(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = bad ? __longlong_as_double(0x7ff8000000000000ll) : s;
}

// Pass 2 (one block): the norm in a fixed order. result[0] = the gradient multiplier (clip / scale),
// result[1] = 1 when a gradient is not finite (the update then skips). Also fills the optional outputs.
// For a capturable step (a CUDA graph replays the launch's scalars, so the step count and lr come from
// device memory where given) also result[2..4] = lr, lr / (1 - beta1^step), sqrt(1 - beta2^step), in
// fp32 as torch's capturable AdamW computes them; `chunks` is then 0 when nothing asked for pass 1.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    adamw_finalize_kernel(const double* __restrict__ partial, int chunks, const float* __restrict__ grad_scale,
                          float max_norm, float* __restrict__ result, float* __restrict__ found_inf,
                          float* __restrict__ grad_norm, AdamwScalars hp, const float* __restrict__ device_step,
                          const float* __restrict__ device_lr) {
  __shared__ double scratch[kThreads / 32];
  double s = 0.0;
  for (int i = threadIdx.x; i < chunks; i += kThreads) s += partial[i];
  s = adamw_detail::block_sum<kThreads>(s, scratch);
  if (threadIdx.x == 0) {
    const double scale = grad_scale ? static_cast<double>(*grad_scale) : 1.0;
    const double norm = sqrt(s) / scale;  // of the unscaled gradients
    const bool bad = !isfinite(s);
    double coef = 1.0;
    if (max_norm > 0.f && !bad) coef = fmin(1.0, static_cast<double>(max_norm) / (norm + 1e-6));
    result[0] = static_cast<float>(coef / scale);
    result[1] = bad ? 1.f : 0.f;
    if (found_inf) *found_inf = bad ? 1.f : 0.f;
    if (grad_norm) *grad_norm = static_cast<float>(norm);
    const float lr = device_lr ? *device_lr : hp.lr;
    const float bc1 = device_step ? 1.f - powf(hp.beta1, *device_step) : 1.f;
    const float bc2 = device_step ? 1.f - powf(hp.beta2, *device_step) : 1.f;
    result[2] = lr;
    result[3] = lr / bc1;
    result[4] = sqrtf(bc2);
  }
}

// The update of one element (all fp32), in the order of torch's fused AdamW. Values in and out, and
// 32-bit chunk offsets in the loops: with references and 64-bit indices ptxas (NVRTC 13.0) kept a stack
// frame and spilled 24 B at 40-48 registers in some specializations (sm_80 and sm_90a).
struct AdamwElem {
  float p, m, v, vmax;
};

template <bool kAmsgrad, bool kMaximize>
__device__ __forceinline__ AdamwElem adamw_step(AdamwElem e, float g, const AdamwScalars s) {
  if (kMaximize) g = -g;
  e.p -= s.lr * s.weight_decay * e.p;
  e.m = s.beta1 * e.m + (1.f - s.beta1) * g;
  e.v = s.beta2 * e.v + (1.f - s.beta2) * g * g;
  float denom;
  if (kAmsgrad) {
    e.vmax = fmaxf(e.vmax, e.v);
    denom = sqrtf(e.vmax) / s.bias_correction2_sqrt + s.eps;
  } else {
    denom = sqrtf(e.v) / s.bias_correction2_sqrt + s.eps;
  }
  e.p -= s.step_size * e.m / denom;
  return e;
}

// Pass 3: the update. `result` (null without pass 1) holds the gradient multiplier and the skip flag;
// without it the multiplier is 1 / *grad_scale (or 1). kDeviceScalars (a capturable step): lr and the
// bias corrections come from result[2..4] instead of `s`. A template flag (if constexpr), not a run-time
// branch: with the branch, or with the device pointers as kernel arguments, the fp32 update at 256
// threads spilled 24 B on sm_90a (NVRTC 13.0; 52 registers and no spill without). Launch: grid = chunks,
// block = kThreads.
// kVec elements per access: every pointer 16-byte aligned for the fp32 lists (the host checks).
template <typename TP, typename TG, bool kMaster, bool kAmsgrad, bool kMaximize, bool kDeviceScalars, int kThreads,
          int kVec, int kChunk>
__global__ void __launch_bounds__(kThreads)
    adamw_update_kernel(const AdamwTensor* __restrict__ tensors, const AdamwChunk* __restrict__ chunks,
                        AdamwScalars s, const float* __restrict__ result, const float* __restrict__ grad_scale) {
  static_assert(kMaster || IsSame<TP, float>::value, "bf16/fp16 parameters need an fp32 master copy");
  static_assert(kChunk % kVec == 0, "chunks hold whole vectors, so every chunk start stays aligned");
  float mult = 1.f;
  if (result) {
    if (result[1] != 0.f) return;  // found_inf: skip the step
    mult = result[0];
  } else if (grad_scale) {
    mult = 1.f / *grad_scale;
  }
  if constexpr (kDeviceScalars) {
    s.lr = result[2];
    s.step_size = result[3];
    s.bias_correction2_sqrt = result[4];
  }
  const AdamwChunk ch = chunks[blockIdx.x];
  const AdamwTensor t = tensors[ch.tensor];
  // Pointers advanced to the chunk, so the loops index with 32-bit chunk offsets (chunks are small).
  TP* __restrict__ param = static_cast<TP*>(t.param) + ch.start;
  const TG* __restrict__ grad = static_cast<const TG*>(t.grad) + ch.start;
  float* __restrict__ exp_avg = t.exp_avg + ch.start;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq + ch.start;
  float* __restrict__ master = kMaster ? t.master + ch.start : nullptr;
  float* __restrict__ vmax_p = kAmsgrad ? t.max_exp_avg_sq + ch.start : nullptr;
  const int n = static_cast<int>(t.numel - ch.start < kChunk ? t.numel - ch.start : kChunk);
  const int nvec = n / kVec;
  for (int j = threadIdx.x; j < nvec; j += kThreads) {
    const int i = j * kVec;
    float g[kVec], m[kVec], v[kVec], vm[kVec] = {}, p[kVec];
    load_floats<kVec>(grad + i, g);
    load_floats<kVec>(exp_avg + i, m);
    load_floats<kVec>(exp_avg_sq + i, v);
    if (kAmsgrad) load_floats<kVec>(vmax_p + i, vm);
    if (kMaster) {
      load_floats<kVec>(master + i, p);
    } else {
      load_floats<kVec>(param + i, p);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const AdamwElem r = adamw_step<kAmsgrad, kMaximize>({p[e], m[e], v[e], vm[e]}, g[e] * mult, s);
      p[e] = r.p;
      m[e] = r.m;
      v[e] = r.v;
      vm[e] = r.vmax;
    }
    store_floats<kVec>(exp_avg + i, m);
    store_floats<kVec>(exp_avg_sq + i, v);
    if (kAmsgrad) store_floats<kVec>(vmax_p + i, vm);
    if (kMaster) store_floats<kVec>(master + i, p);
    store_floats<kVec>(param + i, p);
  }
  if constexpr (kVec == 1) return;  // no tail
  for (int i = nvec * kVec + threadIdx.x; i < n; i += kThreads) {  // the tail: fewer than kVec elements
    AdamwElem e{kMaster ? master[i] : to_float(param[i]), exp_avg[i], exp_avg_sq[i], kAmsgrad ? vmax_p[i] : 0.f};
    e = adamw_step<kAmsgrad, kMaximize>(e, to_float(grad[i]) * mult, s);
    exp_avg[i] = e.m;
    exp_avg_sq[i] = e.v;
    if (kAmsgrad) vmax_p[i] = e.vmax;
    if (kMaster) master[i] = e.p;
    param[i] = store_as<TP>(e.p);
  }
}

}  // namespace kspec
