// E79 with one sequence split across a thread-block cluster (sm_90 and newer): the forward and
// backward of e79.cuh (same recurrence, arguments, outputs and checkpoints) for small batches, where
// one CTA per sequence leaves most SMs idle (B = 1 runs on one SM of 132).
//
// Design:
// - A cluster of kCluster CTAs runs one sequence. CTA c owns rows [c R, c R + R), R = n / kCluster, of
//   S and M (of dS and dM in the backward) in its shared memory, so each CTA does 1 / kCluster of the
//   one-CTA kernel's multiply-adds per step; the price is one exchange per column product.
// - Row products (M kh, S kh, M mh, S mh, S q; the backward's row sums) read owned rows only: thread
//   (r, p) = (t / kSplit, t % kSplit) owns row r's columns p, p + kSplit, ..., as in e79.cuh, and the
//   kSplit lanes of a row add by a xor butterfly.
// - Column products (M^T kh, S^T mh; the backward's column sums) need every row: each CTA sums over
//   its own rows, and the partials are exchanged. For them thread t is (i, q) = (t % n, t / n): column
//   i over owned rows q, q + Q, ... (Q = kSplit / kCluster parts per CTA, so the same n / kSplit
//   multiply-adds per thread as the row products). A warp reads 32 consecutive columns of one row: no
//   bank conflicts whatever the padding, and no butterfly.
// - An exchange is a push: the Q parts of a column are added in the CTA (in part order, through shared
//   memory: one __syncthreads() when Q > 1), then n threads store the CTA's n column sums into slot
//   `rank` of the exchange buffer of every CTA of the cluster (st.shared::cluster, coalesced); one
//   cluster barrier; then each CTA adds an entry's kCluster slots in slot order into its own copy of the
//   vector (s_col, m_col, ...) and one __syncthreads() publishes it. Every CTA adds the same numbers in
//   the same order, so all CTAs hold bit-identical vectors and every output is the same bits on every
//   run (no atomics). Remote stores do not stall the thread, so the barrier is the only wait (a pull
//   would add a remote load latency after it); summing the parts first keeps the SM-to-SM traffic at
//   n floats per vector and peer, whatever kSplit (Q times less than pushing every part).
// - Vectors that mix column and row sums (the backward's dmh and dkh) carry the row sum in one more
//   slot, stored by the row's owner only; column sums needed later only by such a vector (dmh's and
//   dkh's first terms) stay in registers until that exchange instead of being exchanged twice.
// - One cluster barrier per exchange: 2 per forward step (s_col, m_col) and 4 per backward step (A: dq
//   and d_col_m, B: dmh, C: d_col_s, D: dkh; plus the recompute's 2 per step), each followed by one
//   __syncthreads() (and preceded by one when Q > 1). The exchange buffers are double-buffered,
//   alternating per exchange (every step has an even number, so each starts with buffer 0): a CTA
//   stores into buffer b for exchange e + 2 only after passing the barrier of exchange e + 1, which no
//   CTA reaches before it has summed buffer b for exchange e. A cluster barrier costs far more than
//   __syncthreads(), so this is the count to keep low.
// - Shared-memory rows are padded to kLd = n + pad with kLd = kSplit (mod 32), so that the 32 / kSplit
//   rows a warp's row lanes read at once fall in distinct banks. (e79.cuh pads to n + 1 for its column
//   reads down a column; here a warp's column lanes read along one row.)
// - Backward workspace: every n x n matrix keeps e79.cuh's global [n, n] layout, and each CTA writes and
//   reads only its own rows of it (its row sums and its column partials touch nothing else). The step
//   records (vectors) are private per CTA (kCluster copies), so no CTA reads global memory that another
//   one wrote.
// - A cluster barrier before the first exchange, so that no CTA stores into a peer that has not started.
//   The last remote store precedes the last exchange's barrier, so none can exit while a peer still
//   stores into it; the final barrier keeps that so if code is added after the last exchange.
// - The cluster shape is a launch attribute (Launcher::launch_clusters: cuLaunchKernelEx with a cluster
//   dimension of kCluster, grid B * kCluster), as CUTLASS and DeepGEMM launch theirs; the kernel traps
//   on any other cluster shape.
#pragma once

#include "common/cluster.cuh"
#include "e79/e79.cuh"

namespace kspec {

// Everything compile-time about one cluster specialization (e79.cuh's E79Traits, plus kCluster).
//   kSplit: lanes per owned row (a power of two, kCluster <= kSplit <= 32); kCluster: CTAs per sequence.
template <typename T_, typename TB_, int kN_, int kSplit_, int kBias_, int kChunk_, int kCluster_>
struct E79ClusterTraits : E79Slots {
  using T = T_;
  using TB = TB_;
  static constexpr int kN = kN_;
  static constexpr int kSplit = kSplit_;
  static constexpr int kBias = kBias_;
  static constexpr int kChunk = kChunk_;
  static constexpr int kCluster = kCluster_;
  static constexpr int kRows = kN / kCluster;       // rows a CTA owns
  static constexpr int kThreads = kRows * kSplit;   // = kN * kParts
  static constexpr int kParts = kSplit / kCluster;  // column parts per CTA (threads per column)
  static constexpr int kLd = kN + ((kSplit % 32 - kN % 32) + 32) % 32;  // = kSplit (mod 32)
  static constexpr int kMat = kRows * kLd;          // floats per shared-memory matrix (owned rows)
  static constexpr int kNN = kN * kN;
  static_assert(kN >= 1 && kN <= 128, "n must be in 1..128");
  static_assert(kCluster >= 2 && kCluster <= 8 && (kCluster & (kCluster - 1)) == 0, "kCluster: 2, 4 or 8");
  static_assert(kN % kCluster == 0, "n must be a multiple of kCluster");
  static_assert(kSplit >= kCluster && kSplit <= 32 && (kSplit & (kSplit - 1)) == 0,
                "kSplit: a power of two in kCluster..32");
  static_assert(kThreads % kWarpSize == 0 && kThreads <= 1024, "n * kSplit / kCluster: whole warps, at most 1024");
  static_assert(kBias >= kE79BiasNone && kBias <= kE79BiasInput, "unknown bias mode");
  static_assert(kChunk >= 1, "kChunk >= 1");

  // Exchange buffers: per exchanged vector one column slot per CTA and one row slot, kN floats each;
  // the forward exchanges one vector at a time, the backward up to two. Before them, the staging area
  // where a CTA adds the kParts parts of its column sums (kParts x kN floats per vector).
  static constexpr int kXSlots = kCluster + 1;
  static constexpr int kXVec = kXSlots * kN;
  static constexpr int kFwdXVecs = 1, kBwdXVecs = 2;
  static constexpr int kFwdSmemFloats = 2 * kMat + kFwdSlots * kN + kFwdXVecs * (kParts + 2 * kXSlots) * kN;
  static constexpr int kSmemFloats = 2 * kMat + kSlots * kN + kBwdXVecs * (kParts + 2 * kXSlots) * kN;

  // Backward workspace per sequence (floats): (kChunk + 1) states (S, M) of a segment (each CTA its
  // rows), kCluster private copies of kChunk records, and the stashed adjoints dS, dM.
  static constexpr long long kWsStates = (kChunk + 1LL) * 2 * kNN;
  static constexpr long long kWsRecordsPerCta = static_cast<long long>(kChunk) * kRecSlots * kN;
  static constexpr long long kWsRecords = kCluster * kWsRecordsPerCta;
  static constexpr long long kWsPerSeq = kWsStates + kWsRecords + 2LL * kNN;
};

namespace e79_detail {

// A cluster launch of the right shape (blockDim, dynamic shared memory, kCluster CTAs), or a trap.
template <typename Tr>
__device__ __forceinline__ void check_cluster_launch(unsigned smem_floats) {
  check_launch<Tr>(smem_floats);
  if (cluster_nctarank() != Tr::kCluster || gridDim.y != 1 || gridDim.z != 1) __trap();
}

// Where a thread works: its CTA's rows, its row lanes and its column lanes.
template <typename Tr>
struct Owner {
  int rank, row0;  // the CTA's rank in the cluster; its first row (global index)
  int r, p;        // row lanes: owned row r (global row0 + r), columns p, p + kSplit, ...
  int i, q;        // column lanes: column i over owned rows q, q + kParts, ...
  __device__ Owner() {
    const int t = static_cast<int>(threadIdx.x);
    rank = static_cast<int>(cluster_ctarank());
    row0 = rank * Tr::kRows;
    r = t / Tr::kSplit;
    p = t % Tr::kSplit;
    i = t % Tr::kN;
    q = t / Tr::kN;
  }
};

// Stores `val` as slot `slot` of entry e of vector v of exchange buffer xb, in every CTA of the cluster.
template <typename Tr>
__device__ __forceinline__ void push(float* xb, int v, int slot, int e, float val) {
  float* at = xb + v * Tr::kXVec + slot * Tr::kN + e;
  #pragma unroll
  for (int d = 0; d < Tr::kCluster; ++d) cluster_store(cluster_map(at, static_cast<unsigned>(d)), val);
}

// This CTA's column sums of kV vectors (val[v]: column lane (i, q)'s part) into slot `rank` of vector v
// of exchange buffer xb in every CTA. The kParts parts of a column are added first, in part order,
// through `stage` (kV x kParts x kN floats). Every thread of the CTA must call it.
template <typename Tr, int kV>
__device__ __forceinline__ void push_columns(const Owner<Tr>& o, float* xb, float* stage, const float (&val)[kV]) {
  constexpr int N = Tr::kN, Q = Tr::kParts;
  if constexpr (Q == 1) {
    #pragma unroll
    for (int v = 0; v < kV; ++v) push<Tr>(xb, v, o.rank, o.i, val[v]);
  } else {
    #pragma unroll
    for (int v = 0; v < kV; ++v) stage[(v * Q + o.q) * N + o.i] = val[v];
    __syncthreads();
    for (int e = threadIdx.x; e < kV * N; e += Tr::kThreads) {
      const int v = e / N, i = e % N;
      float s = 0.0f;
      #pragma unroll
      for (int q = 0; q < Q; ++q) s += stage[(v * Q + q) * N + i];
      push<Tr>(xb, v, o.rank, i, s);
    }
  }
}

// Row r's sum for entry gr of vector v (the row slot), sent by one lane of the row.
template <typename Tr>
__device__ __forceinline__ void push_row(float* xb, int v, int gr, float val) {
  push<Tr>(xb, v, Tr::kCluster, gr, val);
}

// Entry e of vector v of exchange buffer xb: its column slots in CTA order (then the row slot).
template <typename Tr, bool kRowSlot>
__device__ __forceinline__ float gather(const float* xb, int v, int e) {
  const float* x = xb + v * Tr::kXVec + e;
  float s = 0.0f;
  #pragma unroll
  for (int slot = 0; slot < Tr::kCluster; ++slot) s += x[slot * Tr::kN];
  if constexpr (kRowSlot) s += x[Tr::kCluster * Tr::kN];
  return s;
}

// One forward step, e79.cuh's step_forward with the column products exchanged. On entry `in` (k, v,
// q, m, b_s, b_m, all n entries) and the owned rows of S, M are visible to the CTA; on exit S is
// updated and visible, M's update is written by each thread but the caller must __syncthreads()
// before anyone reads M or reuses this step's `in`. xb0, xb1: the two exchange buffers; stage: the
// staging area of push_columns.
// rec (kRecord): this CTA's rows of S_prev, M_prev; its private record of the vectors (k, m, q, s_col,
// m_col and the norms in full, the row quantities at its rows).
template <typename Tr, bool kRecord>
__device__ __forceinline__ void step_forward_cluster(const Owner<Tr>& o, float* S, float* M, const float* in,
                                                     float* vec, float* xb0, float* xb1, float* stage,
                                                     typename Tr::T* out_row, StepRecord rec) {
  constexpr int N = Tr::kN, LD = Tr::kLd, R = Tr::kRows, Q = Tr::kParts;
  const int r = o.r, p = o.p, gr = o.row0 + r, i = o.i;
  const float *k = in, *m = in + 3 * N, *bs = in + 4 * N, *bm = in + 5 * N;
  float* s_col = vec + Tr::kSCol * N;
  float* m_col = vec + Tr::kMCol * N;
  const auto no_columns = [](int, float) {};  // column sums: over the owned rows, exchanged

  if constexpr (kRecord) record_step<Tr>(rec, o.row0, S, M, in);

  // 1. Row r's products with the old states. Column i: M^T k over the owned rows, to exchange.
  float a[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  old_state_products<Tr>(S, M, in, r, p, a[0], a[1], a[2], a[3], a[4], no_columns);
  float xk[1] = {0.0f};
  #pragma unroll 4
  for (int jl = o.q; jl < R; jl += Q) xk[0] = fmaf(M[jl * LD + i], k[o.row0 + jl], xk[0]);
  push_columns<Tr>(o, xb0, stage, xk);
  group_sum<Tr>(a);
  RowStep st = s_gates<Tr, false>(a[0], a[1], a[2], a[3], a[4], 0.0f, in, gr);
  if constexpr (kRecord) {
    if (p == 0) record_s_row<Tr, false>(rec, gr, st, threadIdx.x == 0);
  }
  cluster_sync();
  for (int e = threadIdx.x; e < N; e += Tr::kThreads) {
    const float b = Tr::kBias == kE79BiasNone ? 0.0f : bs[e];
    s_col[e] = gate(gather<Tr, false>(xb0, 0, e), st.inv_k, b);
    if constexpr (kRecord) rec.vecs[Tr::kRsCol * N + e] = s_col[e];
  }
  __syncthreads();

  // 2. S <- s_row S s_col + s_delta kh^T.
  update_row<Tr>(S, r, st.s_row, s_col, st.s_delta, k, st.inv_k, p);
  __syncthreads();

  // 3. Row r's products with the new S. Column i: S^T m over the owned rows, to exchange.
  float c[2] = {0.0f, 0.0f};
  new_state_products<Tr>(S, in, r, p, c[0], c[1], no_columns);
  float xm[1] = {0.0f};
  #pragma unroll 4
  for (int jl = o.q; jl < R; jl += Q) xm[0] = fmaf(S[jl * LD + i], m[o.row0 + jl], xm[0]);
  push_columns<Tr>(o, xb1, stage, xm);
  group_sum<Tr>(c);
  m_gates<false>(st, c[0], 0.0f, c[1]);
  if (p == 0) finish_row<Tr, kRecord, false>(rec, out_row, gr, st);
  cluster_sync();
  for (int e = threadIdx.x; e < N; e += Tr::kThreads) {
    const float b = Tr::kBias == kE79BiasNone ? 0.0f : bm[e];
    m_col[e] = gate(gather<Tr, false>(xb1, 0, e), st.inv_m, b);
    if constexpr (kRecord) rec.vecs[Tr::kRmCol * N + e] = m_col[e];
  }
  __syncthreads();

  // 4. M <- m_row M m_col + m_delta mh^T.
  update_row<Tr>(M, r, st.m_row, m_col, st.m_delta, m, st.inv_m, p);
}

}  // namespace e79_detail

// ---------------------------------------------------------------------------------------------
// Forward, e79_fwd_kernel's arguments and outputs. Launch: clusters of (kCluster) CTAs, one per
// sequence, gridDim = (B * kCluster), blockDim = (kThreads), dynamic shared memory kFwdSmemFloats * 4
// bytes.
// ---------------------------------------------------------------------------------------------
template <typename Tr, bool kCheckpoint>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    e79_fwd_cluster_kernel(const E79Params prm) {
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
  check_cluster_launch<Tr>(Tr::kFwdSmemFloats);
  extern __shared__ float smem[];
  float* S = smem;
  float* M = smem + Tr::kMat;
  float* vec = smem + 2 * Tr::kMat;
  float* stage = vec + Tr::kFwdSlots * N;
  float* xb0 = stage + Tr::kFwdXVecs * Tr::kParts * N;
  float* xb1 = xb0 + Tr::kFwdXVecs * Tr::kXVec;
  const Owner<Tr> o;
  const int b = static_cast<int>(blockIdx.x) / Tr::kCluster;
  const long long rows = static_cast<long long>(b) * Tr::kNN + o.row0 * N;  // this CTA's rows of b's states
  const E79Inputs<Tr> kvqm{k, v, q, m, bs, bm};

  load_rows<Tr>(S, S0 ? S0 + rows : nullptr);
  load_rows<Tr>(M, M0 ? M0 + rows : nullptr);
  load_inputs<Tr>(kvqm, 0, b, vec + Tr::kIn * N);
  cluster_sync();  // every CTA of the cluster runs before anyone stores into its shared memory
  for (int t = 0; t < T; ++t) {
    float* in = vec + (Tr::kIn + (t & 1) * Tr::kInSlots) * N;
    if constexpr (kCheckpoint) {
      if (t % Tr::kChunk == 0) {
        float* c = chk + (static_cast<long long>(b) * nchk + t / Tr::kChunk) * 2 * Tr::kNN + o.row0 * N;
        store_rows<Tr>(c, S);
        store_rows<Tr>(c + Tr::kNN, M);
      }
    }
    step_forward_cluster<Tr, false>(o, S, M, in, vec, xb0, xb1, stage, out.row(t, b), StepRecord{nullptr, nullptr});
    if (t + 1 < T) load_inputs<Tr>(kvqm, t + 1, b, vec + (Tr::kIn + ((t + 1) & 1) * Tr::kInSlots) * N);
    __syncthreads();
  }
  store_rows<Tr>(S_out + rows, S);
  store_rows<Tr>(M_out + rows, M);
  cluster_sync();
}

// ---------------------------------------------------------------------------------------------
// Backward, e79_bwd_kernel's arguments and outputs. Launch: clusters of (kCluster) CTAs, gridDim =
// (B * kCluster), blockDim = (kThreads), dynamic shared memory kSmemFloats * 4 bytes; ws: B * kWsPerSeq
// floats (this traits').
// Each adjoint step is e79.cuh's passes A..E; in each, the row terms of row r are summed by its lanes,
// the column terms over the owned rows by the column lanes, and the column totals arrive by exchange.
// ---------------------------------------------------------------------------------------------
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    e79_bwd_cluster_kernel(const E79Params prm) {
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
  constexpr int N = Tr::kN, LD = Tr::kLd, R = Tr::kRows, Q = Tr::kParts, NN = Tr::kNN;
  check_cluster_launch<Tr>(Tr::kSmemFloats);
  extern __shared__ float smem[];
  float* A = smem;              // S during a recompute, dS during the adjoint (owned rows)
  float* Bm = smem + Tr::kMat;  // M during a recompute, dM during the adjoint (owned rows)
  float* vec = smem + 2 * Tr::kMat;
  float* stage = vec + Tr::kSlots * N;
  float* xb0 = stage + Tr::kBwdXVecs * Tr::kParts * N;
  float* xb1 = xb0 + Tr::kBwdXVecs * Tr::kXVec;
  const Owner<Tr> o;
  const int r = o.r, p = o.p, i = o.i, gr = o.row0 + r, row0 = o.row0;
  const int b = static_cast<int>(blockIdx.x) / Tr::kCluster;
  const long long rows = static_cast<long long>(b) * NN + row0 * N;  // this CTA's rows of b's states
  const int own = row0 * N;                                           // ... of any n x n matrix
  const E79Inputs<Tr> kvqm{k, v, q, m, bs, bm};
  float* ws_states = ws + static_cast<long long>(b) * Tr::kWsPerSeq;
  float* ws_records = ws_states + Tr::kWsStates + o.rank * Tr::kWsRecordsPerCta;
  float* ws_adj = ws_states + Tr::kWsStates + Tr::kWsRecords;
  float* g = vec + Tr::kG * N;
  float *d_row_m = vec + Tr::kDRowM * N, *d_col_m = vec + Tr::kDColM * N, *d_delta_m = vec + Tr::kDDelta * N;
  float* dmh = vec + Tr::kDmh * N;
  float *d_row_s = vec + Tr::kDRowS * N, *d_col_s = vec + Tr::kDColS * N, *d_delta_s = vec + Tr::kDDeltaS * N;
  float* dkh = vec + Tr::kDkh * N;
  float db_s_acc = 0.0f, db_m_acc = 0.0f;  // fixed biases: this row's sum over the sequence
  const auto no_columns = [](int) {};       // the column terms are summed over the owned rows instead

  load_rows<Tr>(A, dS_final ? dS_final + rows : nullptr);
  load_rows<Tr>(Bm, dM_final ? dM_final + rows : nullptr);
  cluster_sync();  // every CTA of the cluster runs before anyone stores into its shared memory
  for (int seg = nchk - 1; seg >= 0; --seg) {
    const int t0 = seg * Tr::kChunk;
    const int len = min(Tr::kChunk, T - t0);
    // Stash the adjoints, recompute the segment from its checkpoint, recording every step.
    __syncthreads();
    store_rows<Tr>(ws_adj + own, A);
    store_rows<Tr>(ws_adj + NN + own, Bm);
    const float* c = chk + (static_cast<long long>(b) * nchk + seg) * 2 * NN + own;
    load_rows<Tr>(A, c);
    load_rows<Tr>(Bm, c + NN);
    load_inputs<Tr>(kvqm, t0, b, vec + Tr::kIn * N);  // buffer (s & 1) holds step t0 + s
    __syncthreads();
    for (int s = 0; s < len; ++s) {
      const int t = t0 + s;
      float* in = vec + (Tr::kIn + (s & 1) * Tr::kInSlots) * N;
      StepRecord rec{ws_states + 2LL * s * NN, ws_records + static_cast<long long>(s) * Tr::kRecSlots * N};
      step_forward_cluster<Tr, true>(o, A, Bm, in, vec, xb0, xb1, stage, nullptr, rec);
      if (s + 1 < len) load_inputs<Tr>(kvqm, t + 1, b, vec + (Tr::kIn + ((s + 1) & 1) * Tr::kInSlots) * N);
      __syncthreads();
    }
    store_rows<Tr>(ws_states + 2LL * len * NN + own, A);  // the state after the segment's last step
    store_rows<Tr>(ws_states + 2LL * len * NN + NN + own, Bm);
    __syncthreads();
    load_rows<Tr>(A, ws_adj + own);
    load_rows<Tr>(Bm, ws_adj + NN + own);

    // The adjoint, last step of the segment first.
    for (int s = len - 1; s >= 0; --s) {
      const int t = t0 + s;
      const float* Sp = ws_states + 2LL * s * NN;  // S before the step (rows row0.. are this CTA's)
      const float* Mp = Sp + NN;                   // M before the step
      const float* Sn = Sp + 2 * NN;               // S after the step
      float* rv_buf = vec + (Tr::kRec + (s & 1) * Tr::kRecSlots) * N;
      // The whole private record (the row quantities hold values at the owned rows only).
      load_step<Tr>(rv_buf, g, ws_records + static_cast<long long>(s) * Tr::kRecSlots * N, dout, t, b, row0);
      __syncthreads();
      const StepVecs<Tr> rv(rv_buf);

      // A. Row r: d_row, d_delta (row sums of dM); dS += g q^T. Columns (owned rows, exchanged): dq
      //    and d_col; dmh's first term (M's column sums of dM * m_delta) waits in a register for B.
      float a[2] = {0.0f, 0.0f};
      adjoint_a_row<Tr>(A, Bm, Mp, rv, r, gr, p, g[gr], a[0], a[1], no_columns, no_columns);
      float xa[3] = {0.0f, 0.0f, 0.0f};
      #pragma unroll 4
      for (int jl = o.q; jl < R; jl += Q) {
        const int gj = row0 + jl;
        const float dMji = Bm[jl * LD + i];
        xa[0] = fmaf(Sn[gj * N + i], g[gj], xa[0]);
        xa[1] = fmaf(dMji * rv.m_row[gj], Mp[gj * N + i], xa[1]);
        xa[2] = fmaf(dMji, rv.m_delta[gj], xa[2]);
      }
      const float dmhA = xa[2];
      {
        const float cols[2] = {xa[0], xa[1]};
        push_columns<Tr>(o, xb0, stage, cols);
      }
      group_sum<Tr>(a);
      const float dr_m = gate_grad(a[0], rv.m_row[gr]);
      const float dd_m = a[1] * rv.inv_m;
      if (p == 0) {
        d_row_m[gr] = dr_m;
        d_delta_m[gr] = dd_m;
      }
      cluster_sync();
      for (int e = threadIdx.x; e < N + R; e += Tr::kThreads) {
        if (e < N) {
          d_col_m[e] = gate_grad(gather<Tr, false>(xb0, 1, e), rv.m_col[e]);
        } else {
          const int gi = row0 + e - N;
          dq.row(t, b)[gi] = from_float<TT>(gather<Tr, false>(xb0, 0, gi));
        }
      }
      __syncthreads();

      // B. Row r: dmh's row term S_new d_col (the row slot); dS += d_row mh^T + mh d_col^T;
      //    dM <- dM * m_row m_col^T - d_delta mh^T. Columns: dmh = dmhA + S_new^T d_row - M_prev^T d_delta.
      float b2[1] = {0.0f};
      {
        const float mhr = rv.m[gr] * rv.inv_m, mrow = rv.m_row[gr];
        adjoint_update_row<Tr>(A, Bm, Sn, r, gr, p, d_col_m, rv.m_col, mrow, dr_m, dd_m, rv.m, rv.inv_m, mhr, b2[0],
                               no_columns);
      }
      float xb[2] = {0.0f, 0.0f};
      #pragma unroll 4
      for (int jl = o.q; jl < R; jl += Q) {
        const int gj = row0 + jl;
        xb[0] = fmaf(Sn[gj * N + i], d_row_m[gj], xb[0]);
        xb[1] = fmaf(Mp[gj * N + i], d_delta_m[gj], xb[1]);
      }
      {
        const float cols[1] = {dmhA + xb[0] - xb[1]};
        push_columns<Tr>(o, xb1, stage, cols);
      }
      group_sum<Tr>(b2);
      if (p == 0) {
        push_row<Tr>(xb1, 0, gr, b2[0]);
        bias_grad<Tr>(dbm, t, b, gr, dr_m + d_col_m[gr], db_m_acc);
      }
      cluster_sync();
      for (int e = threadIdx.x; e < N; e += Tr::kThreads) dmh[e] = gather<Tr, true>(xb1, 0, e);
      __syncthreads();

      // C. Row r: d_row, d_delta (row sums of dS); dv; dm from dmh through the normalization. Columns:
      //    d_col (exchanged); dkh's first term (column sums of dS * s_delta) waits in a register for D.
      float cs[3] = {0.0f, 0.0f, 0.0f};
      adjoint_c_row<Tr>(A, Sp, rv, dmh, r, gr, p, cs[0], cs[1], cs[2], no_columns);
      float xc[2] = {0.0f, 0.0f};
      #pragma unroll 4
      for (int jl = o.q; jl < R; jl += Q) {
        const int gj = row0 + jl;
        const float dSji = A[jl * LD + i];
        xc[0] = fmaf(dSji * rv.s_row[gj], Sp[gj * N + i], xc[0]);
        xc[1] = fmaf(dSji, rv.s_delta[gj], xc[1]);
      }
      const float dkhA = xc[1];
      {
        const float cols[1] = {xc[0]};
        push_columns<Tr>(o, xb0, stage, cols);
      }
      group_sum<Tr>(cs);
      const float dr_s = gate_grad(cs[0], rv.s_row[gr]);
      const float dd_s = dd_m + cs[1] * rv.inv_k;
      if (p == 0) {
        dv.row(t, b)[gr] = from_float<TT>(dd_s);
        d_row_s[gr] = dr_s;
        d_delta_s[gr] = dd_s;
        dm.row(t, b)[gr] = from_float<TT>(grad_through_norm(dmh[gr], rv.m[gr], cs[2], rv.m_norm, rv.inv_m));
      }
      cluster_sync();
      for (int e = threadIdx.x; e < N; e += Tr::kThreads)
        d_col_s[e] = gate_grad(gather<Tr, false>(xb0, 0, e), rv.s_col[e]);
      __syncthreads();

      // D. Row r: dkh's row term M_prev d_col (the row slot); dM += d_row kh^T + kh d_col^T;
      //    dS <- dS * s_row s_col^T - d_delta kh^T. Columns: dkh = dkhA - S_prev^T d_delta + M_prev^T d_row.
      float d2[1] = {0.0f};
      {
        const float khr = rv.k[gr] * rv.inv_k, srow = rv.s_row[gr];
        adjoint_update_row<Tr>(Bm, A, Mp, r, gr, p, d_col_s, rv.s_col, srow, dr_s, dd_s, rv.k, rv.inv_k, khr, d2[0],
                               no_columns);
      }
      float xd[2] = {0.0f, 0.0f};
      #pragma unroll 4
      for (int jl = o.q; jl < R; jl += Q) {
        const int gj = row0 + jl;
        xd[0] = fmaf(Sp[gj * N + i], d_delta_s[gj], xd[0]);
        xd[1] = fmaf(Mp[gj * N + i], d_row_s[gj], xd[1]);
      }
      {
        const float cols[1] = {dkhA - xd[0] + xd[1]};
        push_columns<Tr>(o, xb1, stage, cols);
      }
      group_sum<Tr>(d2);
      if (p == 0) {
        push_row<Tr>(xb1, 0, gr, d2[0]);
        bias_grad<Tr>(dbs, t, b, gr, dr_s + d_col_s[gr], db_s_acc);
      }
      cluster_sync();
      for (int e = threadIdx.x; e < N; e += Tr::kThreads) dkh[e] = gather<Tr, true>(xb1, 0, e);
      __syncthreads();

      // E. dk from dkh through the normalization (rows of this CTA). Reads only this step's record
      //    buffer and dkh, so the next step's loads (the other buffer, g at owned rows) may overlap it.
      const float e1 = adjoint_e_dot<Tr>(rv, dkh, p);
      if (p == 0) dk.row(t, b)[gr] = from_float<TT>(grad_through_norm(dkh[gr], rv.k[gr], e1, rv.k_norm, rv.inv_k));
    }
  }
  __syncthreads();
  if (dS0) store_rows<Tr>(dS0 + rows, A);
  if (dM0) store_rows<Tr>(dM0 + rows, Bm);
  if constexpr (Tr::kBias == kE79BiasFixed) {
    if (p == 0) {
      bias_partial[(2LL * b) * N + gr] = db_s_acc;
      bias_partial[(2LL * b + 1) * N + gr] = db_m_acc;
    }
  }
  cluster_sync();
}

}  // namespace kspec
