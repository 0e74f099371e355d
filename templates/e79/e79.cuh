// E79, the coupled memory-modulation matrix RNN: forward and backward kernels over the projected
// k, v, q, m (the projections are GEMMs outside), as templates over compile-time constants for NVRTC.
// The recurrence, per sequence, for t = 0..T-1 (api/ops/e79/reference.h is the spec):
//   kh = k / (|k| + 1e-6)             mh = m / (|m| + 1e-6)
//   s_row = sigma(M kh + b_s)         s_col = sigma(M^T kh + b_s)       s_delta = v - S kh
//   S <- s_row[:,None] * S * s_col[None,:] + s_delta kh^T
//   m_row = sigma(S mh + b_m)         m_col = sigma(S^T mh + b_m)       m_delta = s_delta - M mh
//   M <- m_row[:,None] * M * m_col[None,:] + m_delta mh^T
//   Sq = S q;   out = Sq * silu(Sq)
//
// Design (first version: one CTA per sequence, correct before fast):
// - __launch_bounds__(kThreads, 1): without the minimum of one block per SM, ptxas (CUDA 13.0) capped
//   the backward at 80 registers and spilled (n = 16 and 48) although 168..255 were allowed.
// - S and M (fp32) live in shared memory for the whole sequence, rows padded to kN + 1 floats so that
//   reading a row (lanes along j) and reading a column (lanes along i) are both free of bank conflicts
//   for kSplit = 1.
// - Thread tid is the pair (r, p) = (tid / kSplit, tid % kSplit): it owns row r's elements
//   j = p, p + kSplit, ... for row sums and elementwise updates, and column r's elements i = p, p +
//   kSplit, ... for column sums. The kSplit partial sums of a row are added by a xor butterfly over
//   kSplit neighbouring lanes, so every lane of the group ends with the same totals.
// - Normalization is folded into the products: M kh = (M k) / (|k| + eps), and |k|^2 is summed in the
//   same loop (every group sees all of k), so no separate reduction or barrier is spent on the norms.
// - Four barriers per step: gates of S | S update | gates of M and the output | M update (+ loading the
//   next step's inputs into the other half of a double buffer).
// - The backward keeps a checkpoint of (S, M) every kChunk steps (written by the forward). Per segment,
//   last to first, it reloads the checkpoint, recomputes the segment's forward once, writing each step's
//   (S_prev, M_prev) and its gate vectors to a workspace, then runs the adjoint backwards through the
//   segment with dS, dM in shared memory (stashed in the workspace while the next segment recomputes).
//   Each adjoint step is four passes over the n x n elements (api/ops/e79/reference.cpp step_backward,
//   regrouped so that each pass's row and column sums read only what no thread writes in that pass).
// - e79_cluster.cuh has the same kernels with one sequence split across a thread-block cluster (sm_90+),
//   for batches below the SM count.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"

namespace kspec {

enum E79Bias : int { kE79BiasNone = 0, kE79BiasFixed = 1, kE79BiasInput = 2 };

// A [T, B, n] tensor with unit stride along n: element (t, b, i) is p[t * st + b * sb + i]. A fixed
// bias [n] is the same with st = sb = 0. The host passes a struct of the same layout.
template <typename X>
struct E79Seq {
  X* p;
  long long st, sb;
  __device__ __forceinline__ X* row(int t, int b) const { return p + t * st + b * sb; }
};

// Shared-memory vector slots (kN floats each) after the two matrices; the cluster kernels
// (e79_cluster.cuh) use the same ones.
struct E79Slots {
  // Forward: inputs k, v, q, m, b_s, b_m double-buffered (12), then s_col, m_col, s_delta (3).
  static constexpr int kIn = 0, kInSlots = 6, kSCol = 12, kMCol = 13, kSDelta = 14, kFwdSlots = 15;
  // Backward: one step's record double-buffered (2 * kRecSlots), then the adjoint's vectors.
  static constexpr int kRecSlots = 11;  // k, m, q, s_row, s_col, s_delta, m_row, m_col, m_delta, sq, norms
  static constexpr int kRk = 0, kRm = 1, kRq = 2, kRsRow = 3, kRsCol = 4, kRsDelta = 5, kRmRow = 6, kRmCol = 7,
                       kRmDelta = 8, kRsq = 9, kRnorm = 10;
  static constexpr int kRec = kFwdSlots;                 // 2 * kRecSlots slots
  static constexpr int kG = kRec + 2 * kRecSlots;        // dout * d out / d Sq
  static constexpr int kDRowM = kG + 1, kDColM = kG + 2, kDDelta = kG + 3, kDmhA = kG + 4, kDmh = kG + 5;
  static constexpr int kDRowS = kG + 6, kDColS = kG + 7, kDDeltaS = kG + 8, kDkhA = kG + 9, kDkh = kG + 10;
  static constexpr int kSlots = kG + 11;
};

// Everything compile-time about one specialization.
//   T: k, v, q, m, out and their gradients; TB: b_s, b_m (T or float).
//   kN: state size; kSplit: lanes per row (a power of two <= 32); kChunk: steps per checkpoint.
template <typename T_, typename TB_, int kN_, int kSplit_, int kBias_, int kChunk_>
struct E79Traits : E79Slots {
  using T = T_;
  using TB = TB_;
  static constexpr int kN = kN_;
  static constexpr int kSplit = kSplit_;
  static constexpr int kBias = kBias_;
  static constexpr int kChunk = kChunk_;
  static constexpr int kThreads = kN * kSplit;
  static constexpr int kLd = kN + 1;           // padded row of a shared-memory matrix
  static constexpr int kMat = kN * kLd;        // floats per shared-memory matrix
  static constexpr int kNN = kN * kN;          // floats per matrix in global memory
  static_assert(kN >= 1 && kN <= 128, "n must be in 1..128");
  static_assert(kSplit >= 1 && kSplit <= 32 && (kSplit & (kSplit - 1)) == 0, "kSplit: a power of two <= 32");
  static_assert(kThreads % kWarpSize == 0 && kThreads <= 1024, "n * kSplit: whole warps, at most 1024");
  static_assert(kBias >= kE79BiasNone && kBias <= kE79BiasInput, "unknown bias mode");
  static_assert(kChunk >= 1, "kChunk >= 1");

  static constexpr int kSmemFloats = 2 * kMat + kSlots * kN;

  // Backward workspace per sequence (floats): (kChunk + 1) states (S, M) of a segment, kChunk records,
  // and the stashed adjoints dS, dM.
  static constexpr long long kWsStates = (kChunk + 1LL) * 2 * kNN;
  static constexpr long long kWsRecords = static_cast<long long>(kChunk) * kRecSlots * kN;
  static constexpr long long kWsPerSeq = kWsStates + kWsRecords + 2LL * kNN;
};

namespace e79_detail {

constexpr float kNormEps = 1e-6f;

// IEEE sqrtf and '/' carry slow-path subroutine calls, around which ptxas spilled live registers (20
// bytes at n = 128); the SFU versions are within 2 ulp, far below the recurrence's own rounding.
__device__ __forceinline__ float fast_sqrt(float x) { return x > 0.0f ? x * rsqrtf(x) : 0.0f; }
__device__ __forceinline__ float inv_norm(float norm) { return __fdividef(1.0f, norm + kNormEps); }
// The radial term of the gradient through x / (|x| + eps): (x . dxh) / (|x| (|x| + eps)^2), 0 at x = 0.
__device__ __forceinline__ float radial(float dot, float norm, float inv) {
  return norm > 0.0f ? __fdividef(dot * inv * inv, norm) : 0.0f;
}

// The launch the kernels were written for (blockDim.x = kThreads, enough dynamic shared memory), or
// a trap: a host-side mismatch must fail loudly, not corrupt memory.
template <typename Tr>
__device__ __forceinline__ void check_launch(unsigned smem_floats) {
  unsigned smem_bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (blockDim.x != Tr::kThreads || blockDim.y != 1 || smem_bytes < smem_floats * 4u) __trap();
}

template <typename Tr>
struct Lane {
  int r, p;
  __device__ Lane() : r(static_cast<int>(threadIdx.x) / Tr::kSplit), p(static_cast<int>(threadIdx.x) % Tr::kSplit) {}
};

template <typename Tr, int kV>
__device__ __forceinline__ void group_sum(float (&v)[kV]) {
  warp_reduce_sum<Tr::kSplit, kV>(v);
}

// Copies step t's k, v, q, m (and b_s, b_m with biases) as fp32 into the six slots at dst.
template <typename Tr>
struct E79Inputs {
  E79Seq<const typename Tr::T> k, v, q, m;
  E79Seq<const typename Tr::TB> bs, bm;
};

template <typename Tr>
__device__ __forceinline__ void load_inputs(const E79Inputs<Tr>& in, int t, int b, float* dst) {
  constexpr int N = Tr::kN;
  for (int j = threadIdx.x; j < N; j += Tr::kThreads) {
    dst[j] = to_float(in.k.row(t, b)[j]);
    dst[N + j] = to_float(in.v.row(t, b)[j]);
    dst[2 * N + j] = to_float(in.q.row(t, b)[j]);
    dst[3 * N + j] = to_float(in.m.row(t, b)[j]);
    if constexpr (Tr::kBias != kE79BiasNone) {
      dst[4 * N + j] = to_float(in.bs.row(t, b)[j]);
      dst[5 * N + j] = to_float(in.bm.row(t, b)[j]);
    }
  }
}

// Row-major n x n (global) <-> padded shared memory, all threads; `src` may be null (zeros).
template <typename Tr>
__device__ __forceinline__ void load_matrix(float* dst, const float* src) {
  for (int i = threadIdx.x; i < Tr::kNN; i += Tr::kThreads)
    dst[(i / Tr::kN) * Tr::kLd + i % Tr::kN] = src ? src[i] : 0.0f;
}
template <typename Tr>
__device__ __forceinline__ void store_matrix(float* dst, const float* src) {
  for (int i = threadIdx.x; i < Tr::kNN; i += Tr::kThreads) dst[i] = src[(i / Tr::kN) * Tr::kLd + i % Tr::kN];
}

// Where the backward's recompute records a step: its states before the update and its vectors.
struct StepRecord {
  float* states;  // S_prev then M_prev, 2 * n * n
  float* vecs;    // kRecSlots * n
};

// One forward step on the shared-memory states. On entry `in` (k, v, q, m, b_s, b_m) and S, M are
// visible to all threads; on exit S is updated and visible, M's update is written by each thread but
// the caller must __syncthreads() before anyone reads M or reuses this step's `in`.
// out_row: where this step's output row goes (null: none). rec: the backward's record (kRecord).
template <typename Tr, bool kRecord>
__device__ __forceinline__ void step_forward(float* S, float* M, const float* in, float* vec,
                                             typename Tr::T* out_row, StepRecord rec) {
  constexpr int N = Tr::kN, LD = Tr::kLd, P = Tr::kSplit;
  const Lane<Tr> l;
  const int r = l.r, p = l.p;
  const float *k = in, *v = in + N, *q = in + 2 * N, *m = in + 3 * N, *bs = in + 4 * N, *bm = in + 5 * N;
  float* s_col = vec + Tr::kSCol * N;
  float* m_col = vec + Tr::kMCol * N;

  if constexpr (kRecord) {
    for (int i = threadIdx.x; i < Tr::kNN; i += Tr::kThreads) {
      const int off = (i / N) * LD + i % N;
      rec.states[i] = S[off];
      rec.states[Tr::kNN + i] = M[off];
    }
    for (int i = threadIdx.x; i < 3 * N; i += Tr::kThreads) {
      const int which = i / N, j = i % N;  // k, m, q
      rec.vecs[i] = (which == 0 ? k : which == 1 ? m : q)[j];
    }
  }

  // 1. Products with the old states: M k (row), M^T k (column), S k, M m, and |k|^2, |m|^2.
  float a[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  #pragma unroll 4
  for (int j = p; j < N; j += P) {
    const float kj = k[j], mj = m[j], Mrj = M[r * LD + j];
    a[0] = fmaf(Mrj, kj, a[0]);
    a[1] = fmaf(M[j * LD + r], kj, a[1]);
    a[2] = fmaf(S[r * LD + j], kj, a[2]);
    a[3] = fmaf(Mrj, mj, a[3]);
    a[4] = fmaf(kj, kj, a[4]);
    a[5] = fmaf(mj, mj, a[5]);
  }
  group_sum<Tr>(a);
  const float k_norm = fast_sqrt(a[4]), m_norm = fast_sqrt(a[5]);
  const float inv_k = inv_norm(k_norm), inv_m = inv_norm(m_norm);
  const float b_s = Tr::kBias == kE79BiasNone ? 0.0f : bs[r];
  const float b_m = Tr::kBias == kE79BiasNone ? 0.0f : bm[r];
  const float s_row = sigmoid(fmaf(a[0], inv_k, b_s));
  const float s_colr = sigmoid(fmaf(a[1], inv_k, b_s));
  const float s_delta = v[r] - a[2] * inv_k;
  const float m_ret = a[3] * inv_m;
  if (p == 0) {
    s_col[r] = s_colr;
    if constexpr (kRecord) {
      rec.vecs[Tr::kRsRow * N + r] = s_row;
      rec.vecs[Tr::kRsCol * N + r] = s_colr;
      rec.vecs[Tr::kRsDelta * N + r] = s_delta;
      if (r == 0) {
        rec.vecs[Tr::kRnorm * N] = k_norm;
        rec.vecs[Tr::kRnorm * N + 1] = m_norm;
      }
    }
  }
  __syncthreads();

  // 2. S <- s_row S s_col + s_delta kh^T (row r, this thread's columns: read and written by it alone).
  #pragma unroll 4
  for (int j = p; j < N; j += P) {
    float& s = S[r * LD + j];
    s = fmaf(s_row * s, s_col[j], s_delta * (k[j] * inv_k));
  }
  __syncthreads();

  // 3. Products with the new S: S m (row), S^T m (column), S q.
  float c[3] = {0.0f, 0.0f, 0.0f};
  #pragma unroll 4
  for (int j = p; j < N; j += P) {
    const float Srj = S[r * LD + j], mj = m[j];
    c[0] = fmaf(Srj, mj, c[0]);
    c[1] = fmaf(S[j * LD + r], mj, c[1]);
    c[2] = fmaf(Srj, q[j], c[2]);
  }
  group_sum<Tr>(c);
  const float m_row = sigmoid(fmaf(c[0], inv_m, b_m));
  const float m_colr = sigmoid(fmaf(c[1], inv_m, b_m));
  const float m_delta = s_delta - m_ret;
  const float sq = c[2];
  if (p == 0) {
    m_col[r] = m_colr;
    if (out_row) out_row[r] = from_float<typename Tr::T>(sq * silu(sq));
    if constexpr (kRecord) {
      rec.vecs[Tr::kRmRow * N + r] = m_row;
      rec.vecs[Tr::kRmCol * N + r] = m_colr;
      rec.vecs[Tr::kRmDelta * N + r] = m_delta;
      rec.vecs[Tr::kRsq * N + r] = sq;
    }
  }
  __syncthreads();

  // 4. M <- m_row M m_col + m_delta mh^T.
  #pragma unroll 4
  for (int j = p; j < N; j += P) {
    float& mm = M[r * LD + j];
    mm = fmaf(m_row * mm, m_col[j], m_delta * (m[j] * inv_m));
  }
}

}  // namespace e79_detail

// ---------------------------------------------------------------------------------------------
// Forward: out [T, B, n], the final S, M [B, n, n], and with kCheckpoint the states before steps
// 0, kChunk, 2 kChunk, ... in chk [B, nchk, 2, n, n] (nchk = ceil(T / kChunk); S then M).
// Launch: gridDim = (B), blockDim = (kThreads), dynamic shared memory kSmemFloats * 4 bytes.
// S0, M0: [B, n, n] or null (zeros).
// ---------------------------------------------------------------------------------------------
template <typename Tr, bool kCheckpoint>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    e79_fwd_kernel(E79Seq<const typename Tr::T> k, E79Seq<const typename Tr::T> v, E79Seq<const typename Tr::T> q,
                   E79Seq<const typename Tr::T> m, E79Seq<const typename Tr::TB> bs, E79Seq<const typename Tr::TB> bm,
                   const float* __restrict__ S0, const float* __restrict__ M0, E79Seq<typename Tr::T> out,
                   float* __restrict__ S_out, float* __restrict__ M_out, float* __restrict__ chk, int T, int nchk) {
  using namespace e79_detail;
  constexpr int N = Tr::kN;
  check_launch<Tr>(2 * Tr::kMat + Tr::kFwdSlots * N);
  extern __shared__ float smem[];
  float* S = smem;
  float* M = smem + Tr::kMat;
  float* vec = smem + 2 * Tr::kMat;
  const int b = static_cast<int>(blockIdx.x);
  const long long state = static_cast<long long>(b) * Tr::kNN;
  const E79Inputs<Tr> kvqm{k, v, q, m, bs, bm};

  load_matrix<Tr>(S, S0 ? S0 + state : nullptr);
  load_matrix<Tr>(M, M0 ? M0 + state : nullptr);
  load_inputs<Tr>(kvqm, 0, b, vec + Tr::kIn * N);
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    float* in = vec + (Tr::kIn + (t & 1) * Tr::kInSlots) * N;
    if constexpr (kCheckpoint) {
      if (t % Tr::kChunk == 0) {
        float* c = chk + (static_cast<long long>(b) * nchk + t / Tr::kChunk) * 2 * Tr::kNN;
        store_matrix<Tr>(c, S);
        store_matrix<Tr>(c + Tr::kNN, M);
      }
    }
    step_forward<Tr, false>(S, M, in, vec, out.row(t, b), StepRecord{nullptr, nullptr});
    if (t + 1 < T) load_inputs<Tr>(kvqm, t + 1, b, vec + (Tr::kIn + ((t + 1) & 1) * Tr::kInSlots) * N);
    __syncthreads();
  }
  store_matrix<Tr>(S_out + state, S);
  store_matrix<Tr>(M_out + state, M);
}

// ---------------------------------------------------------------------------------------------
// Backward: gradients of sum(dout * out) + sum(dS_final * S_T) + sum(dM_final * M_T).
// Outputs dk, dv, dq, dm [T, B, n] (any strides with unit stride along n, e.g. column blocks of one
// [T, B, 4n] gradient), db_s/db_m [T, B, n] (kBias input) or per-sequence partial sums in
// bias_partial [B, 2, n] (kBias fixed; e79_bias_reduce_kernel adds them), dS0/dM0 (null: not wanted).
// Launch: gridDim = (B), blockDim = (kThreads), dynamic shared memory kSmemFloats * 4 bytes;
// ws: B * kWsPerSeq floats of workspace. chk: the forward's checkpoints.
// ---------------------------------------------------------------------------------------------
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    e79_bwd_kernel(E79Seq<const typename Tr::T> dout, E79Seq<const typename Tr::T> k, E79Seq<const typename Tr::T> v,
                   E79Seq<const typename Tr::T> q, E79Seq<const typename Tr::T> m, E79Seq<const typename Tr::TB> bs,
                   E79Seq<const typename Tr::TB> bm, const float* __restrict__ chk,
                   const float* __restrict__ dS_final, const float* __restrict__ dM_final, E79Seq<typename Tr::T> dk,
                   E79Seq<typename Tr::T> dv, E79Seq<typename Tr::T> dq, E79Seq<typename Tr::T> dm,
                   E79Seq<typename Tr::TB> dbs, E79Seq<typename Tr::TB> dbm, float* __restrict__ bias_partial,
                   float* __restrict__ dS0, float* __restrict__ dM0, float* __restrict__ ws, int T, int nchk) {
  using namespace e79_detail;
  using TT = typename Tr::T;
  constexpr int N = Tr::kN, LD = Tr::kLd, P = Tr::kSplit, NN = Tr::kNN;
  check_launch<Tr>(Tr::kSmemFloats);
  extern __shared__ float smem[];
  float* A = smem;              // S during a recompute, dS during the adjoint
  float* Bm = smem + Tr::kMat;  // M during a recompute, dM during the adjoint
  float* vec = smem + 2 * Tr::kMat;
  const int b = static_cast<int>(blockIdx.x);
  const Lane<Tr> l;
  const int r = l.r, p = l.p;
  const long long state = static_cast<long long>(b) * NN;
  const E79Inputs<Tr> kvqm{k, v, q, m, bs, bm};
  float* ws_states = ws + static_cast<long long>(b) * Tr::kWsPerSeq;
  float* ws_records = ws_states + Tr::kWsStates;
  float* ws_adj = ws_records + Tr::kWsRecords;
  float* g = vec + Tr::kG * N;
  float *d_row_m = vec + Tr::kDRowM * N, *d_col_m = vec + Tr::kDColM * N, *d_delta_m = vec + Tr::kDDelta * N;
  float *dmhA = vec + Tr::kDmhA * N, *dmh = vec + Tr::kDmh * N;
  float *d_row_s = vec + Tr::kDRowS * N, *d_col_s = vec + Tr::kDColS * N, *d_delta_s = vec + Tr::kDDeltaS * N;
  float *dkhA = vec + Tr::kDkhA * N, *dkh = vec + Tr::kDkh * N;
  float db_s_acc = 0.0f, db_m_acc = 0.0f;  // fixed biases: this row's sum over the sequence

  load_matrix<Tr>(A, dS_final ? dS_final + state : nullptr);
  load_matrix<Tr>(Bm, dM_final ? dM_final + state : nullptr);
  for (int seg = nchk - 1; seg >= 0; --seg) {
    const int t0 = seg * Tr::kChunk;
    const int len = min(Tr::kChunk, T - t0);
    // Stash the adjoints, recompute the segment from its checkpoint, recording every step.
    __syncthreads();
    store_matrix<Tr>(ws_adj, A);
    store_matrix<Tr>(ws_adj + NN, Bm);
    const float* c = chk + (static_cast<long long>(b) * nchk + seg) * 2 * NN;
    load_matrix<Tr>(A, c);
    load_matrix<Tr>(Bm, c + NN);
    load_inputs<Tr>(kvqm, t0, b, vec + Tr::kIn * N);  // buffer (s & 1) holds step t0 + s
    __syncthreads();
    for (int s = 0; s < len; ++s) {
      const int t = t0 + s;
      float* in = vec + (Tr::kIn + (s & 1) * Tr::kInSlots) * N;
      StepRecord rec{ws_states + 2LL * s * NN, ws_records + static_cast<long long>(s) * Tr::kRecSlots * N};
      step_forward<Tr, true>(A, Bm, in, vec, nullptr, rec);
      if (s + 1 < len) load_inputs<Tr>(kvqm, t + 1, b, vec + (Tr::kIn + ((s + 1) & 1) * Tr::kInSlots) * N);
      __syncthreads();
    }
    for (int i = threadIdx.x; i < NN; i += Tr::kThreads) {  // the state after the segment's last step
      const int off = (i / N) * LD + i % N;
      ws_states[2LL * len * NN + i] = A[off];
      ws_states[2LL * len * NN + NN + i] = Bm[off];
    }
    __syncthreads();
    load_matrix<Tr>(A, ws_adj);
    load_matrix<Tr>(Bm, ws_adj + NN);

    // The adjoint, last step of the segment first.
    for (int s = len - 1; s >= 0; --s) {
      const int t = t0 + s;
      const float* Sp = ws_states + 2LL * s * NN;  // S before the step
      const float* Mp = Sp + NN;                   // M before the step
      const float* Sn = Sp + 2 * NN;               // S after the step
      const float* rec_g = ws_records + static_cast<long long>(s) * Tr::kRecSlots * N;
      float* rv = vec + (Tr::kRec + (s & 1) * Tr::kRecSlots) * N;
      for (int i = threadIdx.x; i < Tr::kRecSlots * N; i += Tr::kThreads) rv[i] = rec_g[i];
      for (int i = threadIdx.x; i < N; i += Tr::kThreads) {
        // out = sq^2 sigma(sq): d out / d sq = sq sigma (2 + sq (1 - sigma)).
        const float sq = rec_g[Tr::kRsq * N + i];
        const float sg = sigmoid(sq);
        g[i] = to_float(dout.row(t, b)[i]) * sq * sg * (2.0f + sq * (1.0f - sg));
      }
      __syncthreads();
      const float *kr = rv + Tr::kRk * N, *mr = rv + Tr::kRm * N, *qr = rv + Tr::kRq * N;
      const float *s_row = rv + Tr::kRsRow * N, *s_col = rv + Tr::kRsCol * N, *s_delta = rv + Tr::kRsDelta * N;
      const float *m_row = rv + Tr::kRmRow * N, *m_col = rv + Tr::kRmCol * N, *m_delta = rv + Tr::kRmDelta * N;
      const float k_norm = rv[Tr::kRnorm * N], m_norm = rv[Tr::kRnorm * N + 1];
      const float inv_k = inv_norm(k_norm), inv_m = inv_norm(m_norm);

      // A. dq = S_new^T g;  dS += g q^T;  through the M update: d_row, d_delta (row sums of dM),
      //    d_col and dmh's first term (column sums of dM).
      float a[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      {
        const float gr = g[r];
        #pragma unroll 4
  for (int j = p; j < N; j += P) {
          const float dMrj = Bm[r * LD + j], dMjr = Bm[j * LD + r];
          a[0] = fmaf(Sn[j * N + r], g[j], a[0]);
          a[1] = fmaf(dMrj * Mp[r * N + j], m_col[j], a[1]);
          a[2] = fmaf(dMrj, mr[j], a[2]);
          a[3] = fmaf(dMjr * m_row[j], Mp[j * N + r], a[3]);
          a[4] = fmaf(dMjr, m_delta[j], a[4]);
          A[r * LD + j] = fmaf(gr, qr[j], A[r * LD + j]);
        }
      }
      group_sum<Tr>(a);
      const float dr_m = a[1] * m_row[r] * (1.0f - m_row[r]);
      const float dc_m = a[3] * m_col[r] * (1.0f - m_col[r]);
      const float dd_m = a[2] * inv_m;
      if (p == 0) {
        dq.row(t, b)[r] = from_float<TT>(a[0]);
        d_row_m[r] = dr_m;
        d_col_m[r] = dc_m;
        d_delta_m[r] = dd_m;
        dmhA[r] = a[4];
        if constexpr (Tr::kBias == kE79BiasInput) dbm.row(t, b)[r] = from_float<typename Tr::TB>(dr_m + dc_m);
        if constexpr (Tr::kBias == kE79BiasFixed) db_m_acc += dr_m + dc_m;
      }
      __syncthreads();

      // B. dmh = dmhA + S_new^T d_row - M_prev^T d_delta + S_new d_col;
      //    dS += d_row mh^T + mh d_col^T;  dM <- dM * m_row m_col^T - d_delta mh^T  (own rows only).
      float bsum[3] = {0.0f, 0.0f, 0.0f};
      {
        const float mhr = mr[r] * inv_m;
        #pragma unroll 4
  for (int j = p; j < N; j += P) {
          const float mhj = mr[j] * inv_m;
          bsum[0] = fmaf(Sn[j * N + r], d_row_m[j], bsum[0]);
          bsum[1] = fmaf(Mp[j * N + r], d_delta_m[j], bsum[1]);
          bsum[2] = fmaf(Sn[r * N + j], d_col_m[j], bsum[2]);
          float& ds = A[r * LD + j];
          ds = fmaf(dr_m, mhj, fmaf(mhr, d_col_m[j], ds));
          float& dmm = Bm[r * LD + j];
          dmm = fmaf(dmm * m_row[r], m_col[j], -dd_m * mhj);
        }
      }
      group_sum<Tr>(bsum);
      if (p == 0) dmh[r] = dmhA[r] + bsum[0] - bsum[1] + bsum[2];
      __syncthreads();

      // C. Through the S update: d_row, d_delta (row sums of dS), d_col and dkh's first term (column
      //    sums of dS); dv; dm from dmh through the normalization (|m|^2-weighted dot summed here).
      float cs[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      #pragma unroll 4
  for (int j = p; j < N; j += P) {
        const float dSrj = A[r * LD + j], dSjr = A[j * LD + r];
        cs[0] = fmaf(dSrj * Sp[r * N + j], s_col[j], cs[0]);
        cs[1] = fmaf(dSrj, kr[j], cs[1]);
        cs[2] = fmaf(dSjr * s_row[j], Sp[j * N + r], cs[2]);
        cs[3] = fmaf(dSjr, s_delta[j], cs[3]);
        cs[4] = fmaf(mr[j], dmh[j], cs[4]);
      }
      group_sum<Tr>(cs);
      const float dr_s = cs[0] * s_row[r] * (1.0f - s_row[r]);
      const float dc_s = cs[2] * s_col[r] * (1.0f - s_col[r]);
      const float dd_s = dd_m + cs[1] * inv_k;
      if (p == 0) {
        dv.row(t, b)[r] = from_float<TT>(dd_s);
        d_row_s[r] = dr_s;
        d_col_s[r] = dc_s;
        d_delta_s[r] = dd_s;
        dkhA[r] = cs[3];
        // Gradient through mh = m / (|m| + eps): dmh / (|m| + eps) - m (m . dmh) / (|m| (|m| + eps)^2).
        dm.row(t, b)[r] = from_float<TT>(dmh[r] * inv_m - mr[r] * radial(cs[4], m_norm, inv_m));
        if constexpr (Tr::kBias == kE79BiasInput) dbs.row(t, b)[r] = from_float<typename Tr::TB>(dr_s + dc_s);
        if constexpr (Tr::kBias == kE79BiasFixed) db_s_acc += dr_s + dc_s;
      }
      __syncthreads();

      // D. dkh = dkhA - S_prev^T d_delta + M_prev^T d_row + M_prev d_col;
      //    dM += d_row kh^T + kh d_col^T;  dS <- dS * s_row s_col^T - d_delta kh^T  (own rows only).
      float dsum[3] = {0.0f, 0.0f, 0.0f};
      {
        const float khr = kr[r] * inv_k;
        #pragma unroll 4
  for (int j = p; j < N; j += P) {
          const float khj = kr[j] * inv_k;
          dsum[0] = fmaf(Sp[j * N + r], d_delta_s[j], dsum[0]);
          dsum[1] = fmaf(Mp[j * N + r], d_row_s[j], dsum[1]);
          dsum[2] = fmaf(Mp[r * N + j], d_col_s[j], dsum[2]);
          float& dmm = Bm[r * LD + j];
          dmm = fmaf(dr_s, khj, fmaf(khr, d_col_s[j], dmm));
          float& ds = A[r * LD + j];
          ds = fmaf(ds * s_row[r], s_col[j], -dd_s * khj);
        }
      }
      group_sum<Tr>(dsum);
      if (p == 0) dkh[r] = dkhA[r] - dsum[0] + dsum[1] + dsum[2];
      __syncthreads();

      // E. dk from dkh through the normalization. Reads only this step's record buffer and dkh, so
      //    the next step's loads (the other buffer) may overlap it.
      float e[1] = {0.0f};
      for (int j = p; j < N; j += P) e[0] = fmaf(kr[j], dkh[j], e[0]);
      group_sum<Tr>(e);
      if (p == 0) {
        dk.row(t, b)[r] = from_float<TT>(dkh[r] * inv_k - kr[r] * radial(e[0], k_norm, inv_k));
      }
    }
  }
  __syncthreads();
  if (dS0) store_matrix<Tr>(dS0 + state, A);
  if (dM0) store_matrix<Tr>(dM0 + state, Bm);
  if constexpr (Tr::kBias == kE79BiasFixed) {
    if (p == 0) {
      bias_partial[(2LL * b) * N + r] = db_s_acc;
      bias_partial[(2LL * b + 1) * N + r] = db_m_acc;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fixed biases: db_s, db_m [n] = the sum over sequences of bias_partial [B, 2, n], in sequence order
// (bitwise reproducible). Launch: gridDim = (1), blockDim = (256).
// ---------------------------------------------------------------------------------------------
template <typename TB, int kN>
__global__ void __launch_bounds__(256)
    e79_bias_reduce_kernel(const float* __restrict__ bias_partial, int batch, TB* __restrict__ db_s,
                           TB* __restrict__ db_m) {
  for (int i = threadIdx.x; i < 2 * kN; i += blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < batch; ++b) acc += bias_partial[2LL * b * kN + i];
    if (i < kN) db_s[i] = from_float<TB>(acc);
    else db_m[i - kN] = from_float<TB>(acc);
  }
}

}  // namespace kspec
