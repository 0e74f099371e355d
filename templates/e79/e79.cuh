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
//   for batches below the SM count. The per-row math of a step (gates, state updates, the adjoint's
//   passes) is written once, in e79_detail (detail.cuh), and called by both: the kernels differ only in where
//   column sums come from (here, the same loops as the row sums; there, exchanges between CTAs).
#pragma once

#include "e79/detail.cuh"

namespace kspec {

// ---------------------------------------------------------------------------------------------
// Forward: out [T, B, n], the final S, M [B, n, n], and with kCheckpoint the states before steps
// 0, kChunk, 2 kChunk, ... in chk [B, nchk, 2, n, n] (nchk = ceil(T / kChunk); S then M).
// Launch: gridDim = (B), blockDim = (kThreads), dynamic shared memory kSmemFloats * 4 bytes.
// S0, M0: [B, n, n] or null (zeros).
// ---------------------------------------------------------------------------------------------
template <typename Tr, bool kCheckpoint>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    e79_fwd_kernel(const E79Params prm) {
  using namespace e79_detail;
  // The parameters, typed and named as the kernel reads them (restrict where they were kernel arguments).
  using TT = typename Tr::T;
  using TBias = typename Tr::TB;
  const E79Seq<const TT>& k = as_seq<const TT>(prm.k);
  const E79Seq<const TT>& v = as_seq<const TT>(prm.v);
  const E79Seq<const TT>& q = as_seq<const TT>(prm.q);
  const E79Seq<const TT>& m = as_seq<const TT>(prm.m);
  const E79Seq<const TBias>& bs = as_seq<const TBias>(prm.b_s);
  const E79Seq<const TBias>& bm = as_seq<const TBias>(prm.b_m);
  const E79Seq<TT>& out = as_seq<TT>(prm.out);
  const float* __restrict__ S0 = prm.S0;
  const float* __restrict__ M0 = prm.M0;
  float* __restrict__ S_out = prm.S;
  float* __restrict__ M_out = prm.M;
  float* __restrict__ chk = prm.checkpoints;
  const int T = prm.T, nchk = prm.nchk;
  constexpr int N = Tr::kN;
  check_launch<Tr>(2 * Tr::kMat + Tr::kFwdSlots * N);
  extern __shared__ float smem[];
  float* S = smem;
  float* M = smem + Tr::kMat;
  float* vec = smem + 2 * Tr::kMat;
  const int b = static_cast<int>(blockIdx.x);
  const long long state = static_cast<long long>(b) * Tr::kNN;
  const E79Inputs<Tr> kvqm{k, v, q, m, bs, bm};

  load_rows<Tr>(S, S0 ? S0 + state : nullptr);
  load_rows<Tr>(M, M0 ? M0 + state : nullptr);
  load_inputs<Tr>(kvqm, 0, b, vec + Tr::kIn * N);
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    float* in = vec + (Tr::kIn + (t & 1) * Tr::kInSlots) * N;
    if constexpr (kCheckpoint) {
      if (t % Tr::kChunk == 0) {
        float* c = chk + (static_cast<long long>(b) * nchk + t / Tr::kChunk) * 2 * Tr::kNN;
        store_rows<Tr>(c, S);
        store_rows<Tr>(c + Tr::kNN, M);
      }
    }
    step_forward<Tr, false>(S, M, in, vec, out.row(t, b), StepRecord{nullptr, nullptr});
    if (t + 1 < T) load_inputs<Tr>(kvqm, t + 1, b, vec + (Tr::kIn + ((t + 1) & 1) * Tr::kInSlots) * N);
    __syncthreads();
  }
  store_rows<Tr>(S_out + state, S);
  store_rows<Tr>(M_out + state, M);
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
    e79_bwd_kernel(const E79Params prm) {
  using namespace e79_detail;
  // The parameters, typed and named as the kernel reads them (restrict where they were kernel arguments).
  using TT = typename Tr::T;
  using TBias = typename Tr::TB;
  const E79Seq<const TT>& dout = as_seq<const TT>(prm.dout);
  const E79Seq<const TT>& k = as_seq<const TT>(prm.k);
  const E79Seq<const TT>& v = as_seq<const TT>(prm.v);
  const E79Seq<const TT>& q = as_seq<const TT>(prm.q);
  const E79Seq<const TT>& m = as_seq<const TT>(prm.m);
  const E79Seq<const TBias>& bs = as_seq<const TBias>(prm.b_s);
  const E79Seq<const TBias>& bm = as_seq<const TBias>(prm.b_m);
  const E79Seq<TT>& dk = as_seq<TT>(prm.dk);
  const E79Seq<TT>& dv = as_seq<TT>(prm.dv);
  const E79Seq<TT>& dq = as_seq<TT>(prm.dq);
  const E79Seq<TT>& dm = as_seq<TT>(prm.dm);
  const E79Seq<TBias>& dbs = as_seq<TBias>(prm.db_s);
  const E79Seq<TBias>& dbm = as_seq<TBias>(prm.db_m);
  const float* __restrict__ chk = prm.checkpoints;
  const float* __restrict__ dS_final = prm.dS;
  const float* __restrict__ dM_final = prm.dM;
  float* __restrict__ bias_partial = prm.bias_partial;
  float* __restrict__ dS0 = prm.dS0;
  float* __restrict__ dM0 = prm.dM0;
  float* __restrict__ ws = prm.ws;
  const int T = prm.T, nchk = prm.nchk;
  constexpr int N = Tr::kN, LD = Tr::kLd, NN = Tr::kNN;
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

  load_rows<Tr>(A, dS_final ? dS_final + state : nullptr);
  load_rows<Tr>(Bm, dM_final ? dM_final + state : nullptr);
  for (int seg = nchk - 1; seg >= 0; --seg) {
    const int t0 = seg * Tr::kChunk;
    const int len = min(Tr::kChunk, T - t0);
    // Stash the adjoints, recompute the segment from its checkpoint, recording every step.
    __syncthreads();
    store_rows<Tr>(ws_adj, A);
    store_rows<Tr>(ws_adj + NN, Bm);
    const float* c = chk + (static_cast<long long>(b) * nchk + seg) * 2 * NN;
    load_rows<Tr>(A, c);
    load_rows<Tr>(Bm, c + NN);
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
    load_rows<Tr>(A, ws_adj);
    load_rows<Tr>(Bm, ws_adj + NN);

    // The adjoint, last step of the segment first.
    for (int s = len - 1; s >= 0; --s) {
      const int t = t0 + s;
      const float* Sp = ws_states + 2LL * s * NN;  // S before the step
      const float* Mp = Sp + NN;                   // M before the step
      const float* Sn = Sp + 2 * NN;               // S after the step
      float* rv_buf = vec + (Tr::kRec + (s & 1) * Tr::kRecSlots) * N;
      load_step<Tr>(rv_buf, g, ws_records + static_cast<long long>(s) * Tr::kRecSlots * N, dout, t, b, 0);
      __syncthreads();
      const StepVecs<Tr> rv(rv_buf);

      // A. dq = S_new^T g;  dS += g q^T;  through the M update: d_row, d_delta (row sums of dM),
      //    d_col and dmh's first term (column sums of dM).
      float a[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      float dMjr;  // dM[j, r], loaded by the first hook, used by the second
      adjoint_a_row<Tr>(A, Bm, Mp, rv, r, r, p, g[r], a[1], a[2], [&](int j) {
        dMjr = Bm[j * LD + r];
        a[0] = fmaf(Sn[j * N + r], g[j], a[0]);
      }, [&](int j) {
        a[3] = fmaf(dMjr * rv.m_row[j], Mp[j * N + r], a[3]);
        a[4] = fmaf(dMjr, rv.m_delta[j], a[4]);
      });
      group_sum<Tr>(a);
      const float dr_m = gate_grad(a[1], rv.m_row[r]);
      const float dc_m = gate_grad(a[3], rv.m_col[r]);
      const float dd_m = a[2] * rv.inv_m;
      if (p == 0) {
        dq.row(t, b)[r] = from_float<TT>(a[0]);
        d_row_m[r] = dr_m;
        d_col_m[r] = dc_m;
        d_delta_m[r] = dd_m;
        dmhA[r] = a[4];
        bias_grad<Tr>(dbm, t, b, r, dr_m + dc_m, db_m_acc);
      }
      __syncthreads();

      // B. dmh = dmhA + S_new^T d_row - M_prev^T d_delta + S_new d_col;
      //    dS += d_row mh^T + mh d_col^T;  dM <- dM * m_row m_col^T - d_delta mh^T  (own rows only).
      float bsum[3] = {0.0f, 0.0f, 0.0f};
      {
        const float mhr = rv.m[r] * rv.inv_m;
        adjoint_update_row<Tr>(A, Bm, Sn, r, r, p, d_col_m, rv.m_col, rv.m_row[r], dr_m, dd_m, rv.m, rv.inv_m, mhr, bsum[2],
                               [&](int j) {
                                 bsum[0] = fmaf(Sn[j * N + r], d_row_m[j], bsum[0]);
                                 bsum[1] = fmaf(Mp[j * N + r], d_delta_m[j], bsum[1]);
                               });
      }
      group_sum<Tr>(bsum);
      if (p == 0) dmh[r] = dmhA[r] + bsum[0] - bsum[1] + bsum[2];
      __syncthreads();

      // C. Through the S update: d_row, d_delta (row sums of dS), d_col and dkh's first term (column
      //    sums of dS); dv; dm from dmh through the normalization (|m|^2-weighted dot summed here).
      float cs[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      adjoint_c_row<Tr>(A, Sp, rv, dmh, r, r, p, cs[0], cs[1], cs[4], [&](int j) {
        const float dSjr = A[j * LD + r];
        cs[2] = fmaf(dSjr * rv.s_row[j], Sp[j * N + r], cs[2]);
        cs[3] = fmaf(dSjr, rv.s_delta[j], cs[3]);
      });
      group_sum<Tr>(cs);
      const float dr_s = gate_grad(cs[0], rv.s_row[r]);
      const float dc_s = gate_grad(cs[2], rv.s_col[r]);
      const float dd_s = dd_m + cs[1] * rv.inv_k;
      if (p == 0) {
        dv.row(t, b)[r] = from_float<TT>(dd_s);
        d_row_s[r] = dr_s;
        d_col_s[r] = dc_s;
        d_delta_s[r] = dd_s;
        dkhA[r] = cs[3];
        dm.row(t, b)[r] = from_float<TT>(grad_through_norm(dmh[r], rv.m[r], cs[4], rv.m_norm, rv.inv_m));
        bias_grad<Tr>(dbs, t, b, r, dr_s + dc_s, db_s_acc);
      }
      __syncthreads();

      // D. dkh = dkhA - S_prev^T d_delta + M_prev^T d_row + M_prev d_col;
      //    dM += d_row kh^T + kh d_col^T;  dS <- dS * s_row s_col^T - d_delta kh^T  (own rows only).
      float dsum[3] = {0.0f, 0.0f, 0.0f};
      {
        const float khr = rv.k[r] * rv.inv_k;
        adjoint_update_row<Tr>(Bm, A, Mp, r, r, p, d_col_s, rv.s_col, rv.s_row[r], dr_s, dd_s, rv.k, rv.inv_k, khr, dsum[2],
                               [&](int j) {
                                 dsum[0] = fmaf(Sp[j * N + r], d_delta_s[j], dsum[0]);
                                 dsum[1] = fmaf(Mp[j * N + r], d_row_s[j], dsum[1]);
                               });
      }
      group_sum<Tr>(dsum);
      if (p == 0) dkh[r] = dkhA[r] - dsum[0] + dsum[1] + dsum[2];
      __syncthreads();

      // E. dk from dkh through the normalization. Reads only this step's record buffer and dkh, so
      //    the next step's loads (the other buffer) may overlap it.
      const float e = adjoint_e_dot<Tr>(rv, dkh, p);
      if (p == 0) dk.row(t, b)[r] = from_float<TT>(grad_through_norm(dkh[r], rv.k[r], e, rv.k_norm, rv.inv_k));
    }
  }
  __syncthreads();
  if (dS0) store_rows<Tr>(dS0 + state, A);
  if (dM0) store_rows<Tr>(dM0 + state, Bm);
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
    e79_bias_reduce_kernel(const E79Params prm) {
  const float* __restrict__ bias_partial = prm.bias_partial;
  const int batch = prm.batch;
  TB* __restrict__ db_s = static_cast<TB*>(prm.db_s_sum);
  TB* __restrict__ db_m = static_cast<TB*>(prm.db_m_sum);
  for (int i = threadIdx.x; i < 2 * kN; i += blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < batch; ++b) acc += bias_partial[2LL * b * kN + i];
    if (i < kN) db_s[i] = from_float<TB>(acc);
    else db_m[i - kN] = from_float<TB>(acc);
  }
}

}  // namespace kspec
