// fp32 activation functions and their derivatives for NVRTC kernels, selected at compile time by an
// integer kind so a kernel template gets exactly one activation with no run-time branch.
// The kind numbers are part of the specialization key: keep them stable.
#pragma once

namespace kspec {

enum ActKind : int { kActIdentity = 0, kActSilu = 1, kActGeluTanh = 2, kActGeluErf = 3 };
enum NormKind : int { kNormLayer = 0, kNormRms = 1 };

namespace detail {
constexpr float kSqrt2OverPi = 0.7978845608028654f;    // sqrt(2/pi), the tanh-GELU scale
constexpr float kGeluTanhCubic = 0.044715f;            // the tanh-GELU cubic coefficient
constexpr float kInvSqrt2 = 0.7071067811865476f;       // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;     // 1/sqrt(2*pi), the normal density's scale
}  // namespace detail

// Accurate expf/tanhf/erff rather than the __expf-style intrinsics: these kernels are memory-bound,
// so the extra instructions are hidden, and the results stay within a few ulp of the float64 reference.
// The sigmoid divides with __fdividef (2 ulp), not '/': IEEE division has a slow-path subroutine call,
// and in the register-heavy norm_act kernels the call made ptxas spill live registers around it.
// For x < -87 the denominator passes 2^126 and __fdividef returns 0, which is sigmoid's value in fp32
// up to a denormal.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + expf(-x)); }

__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ float d_silu(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = detail::kSqrt2OverPi * (x + detail::kGeluTanhCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float d_gelu_tanh(float x) {
  const float x2 = x * x;
  const float t = tanhf(detail::kSqrt2OverPi * (x + detail::kGeluTanhCubic * x2 * x));
  const float du = detail::kSqrt2OverPi * (1.0f + 3.0f * detail::kGeluTanhCubic * x2);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

__device__ __forceinline__ float gelu_erf(float x) {
  return 0.5f * x * (1.0f + erff(x * detail::kInvSqrt2));
}
__device__ __forceinline__ float d_gelu_erf(float x) {
  return 0.5f * (1.0f + erff(x * detail::kInvSqrt2)) +
         x * detail::kInvSqrt2Pi * expf(-0.5f * x * x);
}

// log1p(exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|)), the float64 reference's form.
__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// The SFU's approximations (MUFU: ex2 2 ulp, rcp 1 ulp, lg2 ~2^-22 absolute), flushing denormal inputs and results to
// zero: without .ftz each one is wrapped in a few instructions that scale denormals, which the scans run
// once per channel and step (the decays exp(dt*A) once per step and state, as exp2(dt * A*log2(e)) with
// log2(e) folded into A once per state).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 2^x on the FMA pipe, for kernels whose SFU is their limit while the issue has room. x = j + f, j an
// integer (by adding 1.5 * 2^23, which leaves it in the low mantissa bits), f in [-0.5, 0.5]; 2^f by a
// degree-6 polynomial (relative error < 1e-7, as ex2.approx's 2 ulp), j added to its exponent field (the
// low 9 bits of the shifted sum are j's). x is clamped to [-126, 127]: where ex2.approx.ftz flushes
// results under 2^-126 to 0, this returns 2^-126.
__device__ __forceinline__ float fma_exp2(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = fminf(fmaxf(x, -126.0f), 127.0f);
  const float t = x + kRound;
  const float f = x - (t - kRound);
  float p = 1.5337577e-4f;
  p = fmaf(p, f, 1.3399860e-3f);
  p = fmaf(p, f, 9.6185198e-3f);
  p = fmaf(p, f, 5.5503290e-2f);
  p = fmaf(p, f, 2.4022646e-1f);
  p = fmaf(p, f, 6.9314718e-1f);
  p = fmaf(p, f, 1.0f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// softplus from the SFU (ex2, lg2) and no local memory (log1pf's slow path keeps a stack frame):
// log1p(e) for e = exp(-|x|) in (0, 1] is e (1 - e/2) below 1e-3 (error < e^3/3 < 4e-10) and
// lg2(1 + e) ln 2 above (absolute error ~1e-7); e under 2^-126 (|x| > 87) flushes to 0. For scans that
// compute dt once per channel and step. With sig: also its derivative sigmoid(x) = (x >= 0 ? 1 : e) /
// (1 + e) from the same exponential and one more SFU reciprocal.
__device__ __forceinline__ float softplus_sfu(float x, float* sig) {
  const float e = fast_exp2(-fabsf(x) * kLog2e);
  const float l = e < 1e-3f ? e * fmaf(-0.5f, e, 1.0f) : fast_log2(1.0f + e) * kLn2;
  *sig = (x >= 0.0f ? 1.0f : e) * fast_rcp(1.0f + e);
  return fmaxf(x, 0.0f) + l;
}
__device__ __forceinline__ float softplus_sfu(float x) {
  float unused;  // the reciprocal is dead code
  return softplus_sfu(x, &unused);
}

// sigmoid and silu from the SFU, for the scans, where they run once per channel and step inside
// compute-bound kernels; the accurate forms above cost ~15 instructions more each. For x < -88,
// exp(-x) is inf and its reciprocal 0.
__device__ __forceinline__ float sigmoid_sfu(float x) { return fast_rcp(1.0f + fast_exp2(-x * kLog2e)); }
__device__ __forceinline__ float silu_sfu(float x) { return x * sigmoid_sfu(x); }
// silu of two values with one SFU reciprocal: 1 / (1 + e0) = r (1 + e1) and 1 / (1 + e1) = r (1 + e0) with
// r = 1 / ((1 + e0) (1 + e1)). The exponents are clamped to 62 so that the product stays below 2^125 and r
// a normal number (ftz): a value x under -43 gives x 2^-62 in place of x e^x, both below 2.2e-19 |x|. A NaN
// stays in its own output: fminf(NaN, 62) is 62, so its partner's factor is still 1 / (1 + e).
// H100, selective_scan forward (the configs bench, bf16): 8x2048x2048 0.2564 / 0.2538 -> 0.2532 / 0.2509 ms
// in two runs, 1x2048x65536 at 32 segments 1.563 / 1.550 -> 1.560 / 1.546.
__device__ __forceinline__ void silu2_sfu(float& x0, float& x1) {
  const float p0 = 1.0f + fast_exp2(fminf(-x0 * kLog2e, 62.0f));
  const float p1 = 1.0f + fast_exp2(fminf(-x1 * kLog2e, 62.0f));
  const float r = fast_rcp(p0 * p1);
  x0 *= r * p1;
  x1 *= r * p0;
}

template <int kAct>
__device__ __forceinline__ float apply_act(float h) {
  static_assert(kAct >= kActIdentity && kAct <= kActGeluErf, "unknown activation kind");
  if constexpr (kAct == kActSilu) {
    return silu(h);
  } else if constexpr (kAct == kActGeluTanh) {
    return gelu_tanh(h);
  } else if constexpr (kAct == kActGeluErf) {
    return gelu_erf(h);
  } else {
    return h;
  }
}

// dy/dh of y = apply_act<kAct>(h).
template <int kAct>
__device__ __forceinline__ float act_grad(float h) {
  static_assert(kAct >= kActIdentity && kAct <= kActGeluErf, "unknown activation kind");
  if constexpr (kAct == kActSilu) {
    return d_silu(h);
  } else if constexpr (kAct == kActGeluTanh) {
    return d_gelu_tanh(h);
  } else if constexpr (kAct == kActGeluErf) {
    return d_gelu_erf(h);
  } else {
    return 1.0f;
  }
}

}  // namespace kspec
