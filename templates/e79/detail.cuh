// E79's device code shared by its kernels (e79.cuh describes the recurrence and the design): the tensor
// view and traits types and, in e79_detail, the per-row math of a step, forward and adjoint, that the
// kernels of e79.cuh and e79_cluster.cuh call.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"
#include "e79/params.h"

namespace kspec {

enum E79Bias : int { kE79BiasNone = 0, kE79BiasFixed = 1, kE79BiasInput = 2 };

// A [T, B, n] tensor with unit stride along n: element (t, b, i) is p[t * st + b * sb + i]. A fixed
// bias [n] is the same with st = sb = 0. The host passes an E79SeqArg (params.h), typed here.
template <typename X>
struct E79Seq {
  X* p;
  long long st, sb;
  __device__ __forceinline__ X* row(int t, int b) const { return p + t * st + b * sb; }
};
// The typed view of a parameter, read in place: E79Seq<X> has E79SeqArg's layout, and a reference into the
// kernel's parameter keeps its reads in the parameter bank, as when E79Seq was itself a kernel argument.
// Copied into locals instead, the backward cluster kernel (n = 64, bf16, chunk 8, cluster 4, sm_90a) spilled
// 68 bytes at its 128-register cap.
template <typename X>
__device__ __forceinline__ const E79Seq<X>& as_seq(const E79SeqArg& a) {
  static_assert(sizeof(E79Seq<X>) == sizeof(E79SeqArg), "E79Seq is E79SeqArg, typed");
  return reinterpret_cast<const E79Seq<X>&>(a);
}

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
  static constexpr int kRows = kN;             // rows a CTA owns: all (e79_cluster.cuh splits them)
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

// The CTA's rows (kRows x kN at src, row-major) <-> padded shared memory, all threads; `src` may be
// null (zeros). With E79Traits a CTA owns all rows: the whole n x n matrix.
template <typename Tr>
__device__ __forceinline__ void load_rows(float* dst, const float* src) {
  for (int e = threadIdx.x; e < Tr::kRows * Tr::kN; e += Tr::kThreads)
    dst[(e / Tr::kN) * Tr::kLd + e % Tr::kN] = src ? src[e] : 0.0f;
}
template <typename Tr>
__device__ __forceinline__ void store_rows(float* dst, const float* src) {
  for (int e = threadIdx.x; e < Tr::kRows * Tr::kN; e += Tr::kThreads)
    dst[e] = src[(e / Tr::kN) * Tr::kLd + e % Tr::kN];
}

// Where the backward's recompute records a step: its states before the update and its vectors.
struct StepRecord {
  float* states;  // S_prev then M_prev, 2 * n * n
  float* vecs;    // kRecSlots * n
};

// ---------------------------------------------------------------------------------------------
// The per-row math of a step, shared by e79_fwd/bwd_kernel and their cluster twins (e79_cluster.cuh).
// Thread (r, p) works on row r at columns p, p + kSplit, ... (gr: the row's global index, r plus the
// CTA's first row; `in`: a step's six input slots, k, v, q, m, b_s, b_m). The kernels differ in where
// column sums come from: the one-CTA kernels add column r's terms in the same loops as row r's,
// through the hook `col(j, ...)` that each row loop calls; the cluster kernels pass one that does
// nothing (they sum columns over their own rows and exchange them). Accumulators are the caller's,
// passed by reference, so each kernel keeps its layout.
// The helpers repeat the kernels' former code statement for statement (each fmaf, add and multiply in
// its order, the hooks where the column terms were), so results are bit for bit as before. ptxas's
// register counts here react to statement order and address arithmetic (CUDA 13.0: a struct holding
// the six input pointers cost up to 32 registers at n = 32): keep new code in the same form.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float gate(float sum, float inv, float bias) { return sigmoid(fmaf(sum, inv, bias)); }
template <typename Tr>
__device__ __forceinline__ float bias_at(const float* b, int i) {
  return Tr::kBias == kE79BiasNone ? 0.0f : b[i];
}

// The recompute's record of a step: the CTA's rows of S_prev, M_prev (row0: its first row) and the
// inputs k, m, q in full.
template <typename Tr>
__device__ __forceinline__ void record_step(StepRecord rec, int row0, const float* S, const float* M,
                                            const float* in) {
  constexpr int N = Tr::kN;
  const float *k = in, *q = in + 2 * N, *m = in + 3 * N;
  for (int e = threadIdx.x; e < Tr::kRows * N; e += Tr::kThreads) {
    const int off = (e / N) * Tr::kLd + e % N;
    rec.states[row0 * N + e] = S[off];
    rec.states[Tr::kNN + row0 * N + e] = M[off];
  }
  for (int e = threadIdx.x; e < 3 * N; e += Tr::kThreads) {
    const int which = e / N, j = e % N;  // k, m, q
    rec.vecs[e] = (which == 0 ? k : which == 1 ? m : q)[j];
  }
}

// 1. Row r's products with the old states, M k, S k, M m, and |k|^2, |m|^2 (every row group sees all
//    of k and m, so the norms cost no separate reduction). col(j, k_j): the caller's column terms.
template <typename Tr, typename Col>
__device__ __forceinline__ void old_state_products(const float* S, const float* M, const float* in, int r, int p,
                                                   float& Mk, float& Sk, float& Mm, float& kk, float& mm, Col&& col) {
  constexpr int N = Tr::kN, LD = Tr::kLd;
  const float *k = in, *m = in + 3 * N;
  #pragma unroll 4
  for (int j = p; j < N; j += Tr::kSplit) {
    const float kj = k[j], mj = m[j], Mrj = M[r * LD + j];
    Mk = fmaf(Mrj, kj, Mk);
    col(j, kj);
    Sk = fmaf(S[r * LD + j], kj, Sk);
    Mm = fmaf(Mrj, mj, Mm);
    kk = fmaf(kj, kj, kk);
    mm = fmaf(mj, mj, mm);
  }
}

// Row gr's quantities of a forward step, in the order they become known.
struct RowStep {
  float k_norm, m_norm, inv_k, inv_m, b_s, b_m;
  float s_row, s_col, s_delta, m_ret;  // s_gates (s_col: column gr's, one-CTA kernels only)
  float m_row, m_col, m_delta, sq;     // m_gates (m_col: likewise)
};

// The norms and S's row gate and delta from old_state_products' sums (normalization folded in:
// M kh = (M k) / (|k| + eps)); with kColumn also the gate of column gr's sum Mtk = M^T k.
template <typename Tr, bool kColumn>
__device__ __forceinline__ RowStep s_gates(float Mk, float Sk, float Mm, float kk, float mm, float Mtk,
                                           const float* in, int gr) {
  constexpr int N = Tr::kN;
  const float *v = in + N, *bs = in + 4 * N, *bm = in + 5 * N;
  RowStep st;
  st.k_norm = fast_sqrt(kk);
  st.m_norm = fast_sqrt(mm);
  st.inv_k = inv_norm(st.k_norm);
  st.inv_m = inv_norm(st.m_norm);
  st.b_s = bias_at<Tr>(bs, gr);
  st.b_m = bias_at<Tr>(bm, gr);
  st.s_row = gate(Mk, st.inv_k, st.b_s);
  if constexpr (kColumn) st.s_col = gate(Mtk, st.inv_k, st.b_s);
  st.s_delta = v[gr] - Sk * st.inv_k;
  st.m_ret = Mm * st.inv_m;
  return st;
}

// The record of s_gates' row quantities (one lane per row; the norms where `norms`).
template <typename Tr, bool kColumn>
__device__ __forceinline__ void record_s_row(StepRecord rec, int gr, const RowStep& st, bool norms) {
  constexpr int N = Tr::kN;
  rec.vecs[Tr::kRsRow * N + gr] = st.s_row;
  if constexpr (kColumn) rec.vecs[Tr::kRsCol * N + gr] = st.s_col;
  rec.vecs[Tr::kRsDelta * N + gr] = st.s_delta;
  if (norms) {
    rec.vecs[Tr::kRnorm * N] = st.k_norm;
    rec.vecs[Tr::kRnorm * N + 1] = st.m_norm;
  }
}

// 2. and 4. X <- x_row X x_col + delta xh^T on row r (this thread's columns: read and written by it
//    alone), xh = x * inv.
template <typename Tr>
__device__ __forceinline__ void update_row(float* X, int r, float x_row, const float* x_col, float delta,
                                           const float* x, float inv, int p) {
  #pragma unroll 4
  for (int j = p; j < Tr::kN; j += Tr::kSplit) {
    float& e = X[r * Tr::kLd + j];
    e = fmaf(x_row * e, x_col[j], delta * (x[j] * inv));
  }
}

// 3. Row r's products with the new S: S m, S q. col(j, m_j): the caller's column terms.
template <typename Tr, typename Col>
__device__ __forceinline__ void new_state_products(const float* S, const float* in, int r, int p, float& Sm, float& Sq,
                                                   Col&& col) {
  constexpr int N = Tr::kN;
  const float *q = in + 2 * N, *m = in + 3 * N;
  #pragma unroll 4
  for (int j = p; j < N; j += Tr::kSplit) {
    const float Srj = S[r * Tr::kLd + j], mj = m[j];
    Sm = fmaf(Srj, mj, Sm);
    col(j, mj);
    Sq = fmaf(Srj, q[j], Sq);
  }
}

// M's row gate and delta and the output's pre-activation from new_state_products' sums; with
// kColumn also the gate of column gr's sum Stm = S^T m.
template <bool kColumn>
__device__ __forceinline__ void m_gates(RowStep& st, float Sm, float Stm, float Sq) {
  st.m_row = gate(Sm, st.inv_m, st.b_m);
  if constexpr (kColumn) st.m_col = gate(Stm, st.inv_m, st.b_m);
  st.m_delta = st.s_delta - st.m_ret;
  st.sq = Sq;
}

// Row gr's output, out = Sq * silu(Sq) (out_row null: none), and the record of m_gates' row
// quantities (one lane per row).
template <typename Tr, bool kRecord, bool kColumn>
__device__ __forceinline__ void finish_row(StepRecord rec, typename Tr::T* out_row, int gr, const RowStep& st) {
  constexpr int N = Tr::kN;
  if (out_row) out_row[gr] = from_float<typename Tr::T>(st.sq * silu(st.sq));
  if constexpr (kRecord) {
    rec.vecs[Tr::kRmRow * N + gr] = st.m_row;
    if constexpr (kColumn) rec.vecs[Tr::kRmCol * N + gr] = st.m_col;
    rec.vecs[Tr::kRmDelta * N + gr] = st.m_delta;
    rec.vecs[Tr::kRsq * N + gr] = st.sq;
  }
}

// One forward step on the shared-memory states. On entry `in` (k, v, q, m, b_s, b_m) and S, M are
// visible to all threads; on exit S is updated and visible, M's update is written by each thread but
// the caller must __syncthreads() before anyone reads M or reuses this step's `in`.
// out_row: where this step's output row goes (null: none). rec: the backward's record (kRecord).
template <typename Tr, bool kRecord>
__device__ __forceinline__ void step_forward(float* S, float* M, const float* in, float* vec,
                                             typename Tr::T* out_row, StepRecord rec) {
  constexpr int N = Tr::kN, LD = Tr::kLd;
  const Lane<Tr> l;
  const int r = l.r, p = l.p;
  const float *k = in, *m = in + 3 * N;
  float* s_col = vec + Tr::kSCol * N;
  float* m_col = vec + Tr::kMCol * N;

  if constexpr (kRecord) record_step<Tr>(rec, 0, S, M, in);

  // 1. Products with the old states: row r's, and column r's M^T k (a[1]).
  float a[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  old_state_products<Tr>(S, M, in, r, p, a[0], a[2], a[3], a[4], a[5],
                         [&](int j, float kj) { a[1] = fmaf(M[j * LD + r], kj, a[1]); });
  group_sum<Tr>(a);
  RowStep st = s_gates<Tr, true>(a[0], a[2], a[3], a[4], a[5], a[1], in, r);
  if (p == 0) {
    s_col[r] = st.s_col;
    if constexpr (kRecord) record_s_row<Tr, true>(rec, r, st, r == 0);
  }
  __syncthreads();

  // 2. S <- s_row S s_col + s_delta kh^T.
  update_row<Tr>(S, r, st.s_row, s_col, st.s_delta, k, st.inv_k, p);
  __syncthreads();

  // 3. Products with the new S: row r's, and column r's S^T m (c[1]).
  float c[3] = {0.0f, 0.0f, 0.0f};
  new_state_products<Tr>(S, in, r, p, c[0], c[2], [&](int j, float mj) { c[1] = fmaf(S[j * LD + r], mj, c[1]); });
  group_sum<Tr>(c);
  m_gates<true>(st, c[0], c[1], c[2]);
  if (p == 0) {
    m_col[r] = st.m_col;
    finish_row<Tr, kRecord, true>(rec, out_row, r, st);
  }
  __syncthreads();

  // 4. M <- m_row M m_col + m_delta mh^T.
  update_row<Tr>(M, r, st.m_row, m_col, st.m_delta, m, st.inv_m, p);
}

// ---------------------------------------------------------------------------------------------
// The adjoint's per-row math (passes A..E of e79_bwd_kernel and of its cluster twin).
// ---------------------------------------------------------------------------------------------

// d gate / d pre-activation times the incoming sum.
__device__ __forceinline__ float gate_grad(float sum, float y) { return sum * y * (1.0f - y); }
// The gradient through xh = x / (|x| + eps): dxh / (|x| + eps) - x (x . dxh) / (|x| (|x| + eps)^2).
__device__ __forceinline__ float grad_through_norm(float dxh, float x, float dot, float norm, float inv) {
  return dxh * inv - x * radial(dot, norm, inv);
}

// One step's record as the adjoint reads it (its copy in shared memory).
template <typename Tr>
struct StepVecs {
  const float *k, *m, *q, *s_row, *s_col, *s_delta, *m_row, *m_col, *m_delta;
  float k_norm, m_norm, inv_k, inv_m;
  __device__ __forceinline__ explicit StepVecs(const float* rv)
      : k(rv + Tr::kRk * Tr::kN), m(rv + Tr::kRm * Tr::kN), q(rv + Tr::kRq * Tr::kN),
        s_row(rv + Tr::kRsRow * Tr::kN), s_col(rv + Tr::kRsCol * Tr::kN), s_delta(rv + Tr::kRsDelta * Tr::kN),
        m_row(rv + Tr::kRmRow * Tr::kN), m_col(rv + Tr::kRmCol * Tr::kN), m_delta(rv + Tr::kRmDelta * Tr::kN),
        k_norm(rv[Tr::kRnorm * Tr::kN]), m_norm(rv[Tr::kRnorm * Tr::kN + 1]),
        inv_k(inv_norm(k_norm)), inv_m(inv_norm(m_norm)) {}
};

// Copies step t's record (rec_g, global) into rv, and sets g = dout * d out / d Sq at the CTA's rows
// (row0 ...): out = sq^2 sigma(sq), so d out / d sq = sq sigma (2 + sq (1 - sigma)). Only what the
// recompute wrote is read (compute-sanitizer initcheck): the vectors k, m, q, s_col, m_col in full, the
// row quantities at the CTA's rows (all rows without a cluster) and the two norms.
template <typename Tr>
__device__ __forceinline__ void load_step(float* rv, float* g, const float* rec_g, E79Seq<const typename Tr::T> dout,
                                          int t, int b, int row0) {
  constexpr int N = Tr::kN;
  constexpr int kFull[5] = {Tr::kRk, Tr::kRm, Tr::kRq, Tr::kRsCol, Tr::kRmCol};
  constexpr int kRow[5] = {Tr::kRsRow, Tr::kRsDelta, Tr::kRmRow, Tr::kRmDelta, Tr::kRsq};
  for (int e = threadIdx.x; e < N; e += Tr::kThreads) {
#pragma unroll
    for (int i = 0; i < 5; ++i) rv[kFull[i] * N + e] = rec_g[kFull[i] * N + e];
  }
  if (threadIdx.x < 2) rv[Tr::kRnorm * N + threadIdx.x] = rec_g[Tr::kRnorm * N + threadIdx.x];
  for (int e = threadIdx.x; e < Tr::kRows; e += Tr::kThreads) {
    const int gi = row0 + e;
#pragma unroll
    for (int i = 0; i < 5; ++i) rv[kRow[i] * N + gi] = rec_g[kRow[i] * N + gi];
    const float sq = rec_g[Tr::kRsq * N + gi];
    const float sg = sigmoid(sq);
    g[gi] = to_float(dout.row(t, b)[gi]) * sq * sg * (2.0f + sq * (1.0f - sg));
  }
}

// A. Row r's sums through the M update, d_row's (dM * M_prev) . m_col and d_delta's dM . m, and
//    dS += g q^T. The caller's column terms in two hooks, before and after the row terms (as the
//    one-CTA kernel had them: with all of them before, ptxas took 5 more registers at n = 32).
template <typename Tr, typename Col, typename ColAfter>
__device__ __forceinline__ void adjoint_a_row(float* dS, const float* dM, const float* Mp, const StepVecs<Tr>& rv,
                                              int r, int gr, int p, float g_r, float& d_row, float& d_delta,
                                              Col&& col, ColAfter&& col_after) {
  constexpr int N = Tr::kN, LD = Tr::kLd;
  #pragma unroll 4
  for (int j = p; j < N; j += Tr::kSplit) {
    const float dMrj = dM[r * LD + j];
    col(j);
    d_row = fmaf(dMrj * Mp[gr * N + j], rv.m_col[j], d_row);
    d_delta = fmaf(dMrj, rv.m[j], d_delta);
    col_after(j);
    dS[r * LD + j] = fmaf(g_r, rv.q[j], dS[r * LD + j]);
  }
}

// B and D on row r, undoing X <- x_row X x_col + delta xh^T for the adjoints dP (the other state's)
// and dX: dP += d_row xh^T + xh d_col^T; dX <- dX * x_row x_col^T - d_delta xh^T; and the row term
// Z d_col of dxh into acc. B: X = M (x = m), P = S, Z = S_new; D: X = S (x = k), P = M, Z = M_prev.
// xh_r: row r's xh. x_row by reference: the one-CTA kernel passes its shared-memory copy (read in
// the loop, as before), the cluster kernel a register. col(j): the caller's column terms.
template <typename Tr, typename Col>
__device__ __forceinline__ void adjoint_update_row(float* dP, float* dX, const float* Z, int r, int gr, int p,
                                                   const float* d_col, const float* x_col, const float& x_row, float d_row,
                                                   float d_delta, const float* x, float inv, float xh_r, float& acc,
                                                   Col&& col) {
  constexpr int N = Tr::kN, LD = Tr::kLd;
  #pragma unroll 4
  for (int j = p; j < N; j += Tr::kSplit) {
    const float xhj = x[j] * inv;
    col(j);
    acc = fmaf(Z[gr * N + j], d_col[j], acc);
    float& dp = dP[r * LD + j];
    dp = fmaf(d_row, xhj, fmaf(xh_r, d_col[j], dp));
    float& dx = dX[r * LD + j];
    dx = fmaf(dx * x_row, x_col[j], -d_delta * xhj);
  }
}

// C. Row r's sums through the S update, d_row's (dS * S_prev) . s_col and d_delta's dS . k, and
//    m . dmh for dm's radial term. col(j): the caller's column terms.
template <typename Tr, typename Col>
__device__ __forceinline__ void adjoint_c_row(const float* dS, const float* Sp, const StepVecs<Tr>& rv,
                                              const float* dmh, int r, int gr, int p, float& d_row, float& d_delta,
                                              float& m_dot, Col&& col) {
  constexpr int N = Tr::kN, LD = Tr::kLd;
  #pragma unroll 4
  for (int j = p; j < N; j += Tr::kSplit) {
    const float dSrj = dS[r * LD + j];
    col(j);
    d_row = fmaf(dSrj * Sp[gr * N + j], rv.s_col[j], d_row);
    d_delta = fmaf(dSrj, rv.k[j], d_delta);
    m_dot = fmaf(rv.m[j], dmh[j], m_dot);
  }
}

// E. k . dkh for dk's radial term, summed over the row's lanes.
template <typename Tr>
__device__ __forceinline__ float adjoint_e_dot(const StepVecs<Tr>& rv, const float* dkh, int p) {
  float e[1] = {0.0f};
  for (int j = p; j < Tr::kN; j += Tr::kSplit) e[0] = fmaf(rv.k[j], dkh[j], e[0]);
  group_sum<Tr>(e);
  return e[0];
}

// A bias gradient at (t, b, gr): stored (input biases) or added to this row's sum (fixed biases).
template <typename Tr>
__device__ __forceinline__ void bias_grad(E79Seq<typename Tr::TB> db, int t, int b, int gr, float grad, float& acc) {
  if constexpr (Tr::kBias == kE79BiasInput) db.row(t, b)[gr] = from_float<typename Tr::TB>(grad);
  if constexpr (Tr::kBias == kE79BiasFixed) acc += grad;
}

}  // namespace e79_detail

}  // namespace kspec
