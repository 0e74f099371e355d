// mlstm.chunkwise.fwd, algo=tc: the chunkwise forward on tensor cores (fp16/bf16 q, k, v), three kernels
// in a row (chunkwise_fwd.cuh states the math; tools/bench/NOTES.md "mlstm: the tensor-core forward"
// the design):
//   1. gates: one warp per sequence forms each chunk's cumulative gates once: b (in-chunk cumsum of
//      logsigmoid(f)) and every row's final max m_t = b_t + max(m, max_s<=t (i_s - b_s)), so no later
//      kernel keeps a partial max or rescales (every exponent is <= 0), and writes per row
//      (b_t - m_t, i_t - b_t, g_t, w_t), per chunk e^(b_L + m - m_L), and m_t.
//   2. state: the only sequential part, over the chunks: a CTA owns a 64x64 tile of C in mma
//      accumulators (fp32, never leaving registers) and per chunk adds (w o K)^T V with mma.sync, its
//      K and V slices double-buffered through cp.async; it writes the C (input dtype) and n (fp32)
//      entering every chunk to the workspace, and the last ones to C_last, n_last.
//   3. output: one CTA per (query tile of 64 rows, 128 columns of h): FlashAttention-2-like, the inter
//      term (g_t s q_t)^T C_c by mma from the chunk's entering state, then for each key tile of the
//      chunk up to the diagonal S = Q K^T by mma, scaled by s e^(b_t - m_t + i_s - b_s) and masked
//      (s <= t) in registers, row sums in fp32, P (input dtype) V by mma; h = O / (max(|z|, e^-m_t) + eps)
//      once at the end, with z = g_t s q_t.n_c + sum_s S_ts.
// Any S: tiles past the end are zero-filled (cp.async with a zero source size) and masked. DHQK <= 256
// (the output kernel's Q and C tiles sit in shared memory); DHQK, DHHV multiples of 16; 16-byte rows.
#pragma once

#include "common/mma.cuh"
#include "mlstm/common.cuh"
#include "mlstm/params.h"

namespace kspec {

__device__ __forceinline__ float mlstm_neg_inf() { return __int_as_float(0xff800000); }

// ---- 1. gates ----

// A warp's raw gates of the chunk from t0: lane l's steps t0 + l * E + j (raw 0 past S).
template <typename TG, int E>
__device__ __forceinline__ void mlstm_tc_load_gates(const TG* fp, const TG* ip, long long S, long long t0, int lane,
                                                    unsigned (&f_raw)[E], unsigned (&i_raw)[E]) {
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const long long t = t0 + lane * E + j;
    f_raw[j] = t < S ? load_raw(fp + t) : 0u;
    i_raw[j] = t < S ? load_raw(ip + t) : 0u;
  }
}

// One warp's scan of a chunk (its first len steps valid; lane l holds steps l * E + j), from its raw gates in
// f_raw, i_raw: b[j] the in-chunk cumsum of logsigmoid(f) to the step, ig[j] its i (-inf past len), pm[j] the
// max of i_s - b_s over the lane's steps <= j, `before` that max over the lanes below (-inf on lane 0). Once the
// raw gates are read, those of the warp's next chunk (from step t_next, where `more`: the caller's chunk stride,
// 1 or one a warp of a round) are loaded into f_raw, i_raw, so its loads do not wait on this chunk's scan. (The
// caller forms `more` and t_next: with c, NC and the stride passed in instead, ptxas hoisted the address
// arithmetic differently and reordered a few floating-point instructions at chunks 16 and 32.)
template <typename TG, int E>
__device__ __forceinline__ void mlstm_tc_scan_chunk_gates(const TG* fp, const TG* ip, long long S, bool more,
                                                          long long t_next, int len, int lane,
                                                          unsigned (&f_raw)[E], unsigned (&i_raw)[E], float (&b)[E],
                                                          float (&ig)[E], float (&pm)[E], float& before) {
  const float kNegInf = mlstm_neg_inf();
  float fv[E];
#pragma unroll
  for (int j = 0; j < E; ++j) fv[j] = raw_to_float<TG>(f_raw[j]), ig[j] = raw_to_float<TG>(i_raw[j]);
  if (more) mlstm_tc_load_gates<TG>(fp, ip, S, t_next, lane, f_raw, i_raw);
  float run = 0.0f;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const bool ok = lane * E + j < len;
    ig[j] = ok ? ig[j] : kNegInf;
    run += ok ? mlstm_log_sigmoid(fv[j]) : 0.0f;
    b[j] = run;
  }
  float incl = run;  // inclusive scan of the lanes' sums
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  float run_max = kNegInf;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    b[j] += incl - run;
    run_max = fmaxf(run_max, ig[j] - b[j]);
    pm[j] = run_max;  // max over this lane's steps <= j of i_s - b_s
  }
  float pin = run_max;  // inclusive max scan over lanes
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float y = __shfl_up_sync(0xffffffffu, pin, off);
    if (lane >= off) pin = fmaxf(pin, y);
  }
  before = __shfl_up_sync(0xffffffffu, pin, 1);
  if (lane == 0) before = kNegInf;
}

template <typename TG, int kChunk>
__global__ void __launch_bounds__(32) mlstm_tc_gates_kernel(const MlstmParams p) {
  constexpr int L = kChunk, E = (L + 31) / 32;  // steps per lane, consecutive
  const long long seq = blockIdx.x, S = p.seqlen, NC = (S + L - 1) / L;
  const int lane = threadIdx.x;
  const TG* ip = static_cast<const TG*>(p.i) + seq * S;
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  float4* rows = reinterpret_cast<float4*>(p.gate_rows) + seq * S;
  float* mrow = p.m_rows + seq * S;
  float m = p.m0 ? p.m0[seq] : p.m_init;
  // The next chunk's gates are loaded (raw) while this one's are scanned: the chunks' loads do not
  // wait on each other's latency.
  unsigned f_raw[E], i_raw[E];
  mlstm_tc_load_gates<TG>(fp, ip, S, 0, lane, f_raw, i_raw);
  for (long long c = 0; c < NC; ++c) {
    const long long t0 = c * L;
    const int len = static_cast<int>(S - t0 < L ? S - t0 : L);
    float b[E], ig[E], pm[E], before;
    mlstm_tc_scan_chunk_gates<TG>(fp, ip, S, c + 1 < NC, t0 + L, len, lane, f_raw, i_raw, b, ig, pm, before);
    const int last = len - 1, owner = last / E, j_last = last % E;
    float mt[E], b_sel = 0.0f, m_sel = 0.0f;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      mt[j] = b[j] + fmaxf(m, fmaxf(pm[j], before));
      if (j == j_last) b_sel = b[j], m_sel = mt[j];
    }
    const float bL = __shfl_sync(0xffffffffu, b_sel, owner), mL = __shfl_sync(0xffffffffu, m_sel, owner);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int t = lane * E + j;
      if (t < len) {
        rows[t0 + t] = make_float4(b[j] - mt[j], ig[j] - b[j], expf(b[j] + m - mt[j]), expf(bL - b[j] + ig[j] - mL));
        mrow[t0 + t] = mt[j];
      }
    }
    if (lane == 0) p.chunk_g[seq * NC + c] = expf(bL + m - mL);
    m = mL;
  }
  if (lane == 0 && p.m) p.m[seq] = m;
}

// The same rows by kWarps warps a sequence (algo=tc_pg forward, tc_overlap backward; params.h
// kMlstmTcGatesWarps): the one-warp kernel above walks the chunks in turn, two 5-step shuffle scans and a
// broadcast a chunk (~0.5 us at chunk 128: ~16 us for 32 chunks, ahead of every other kernel); here warp w
// takes chunk c0 + w of each round of kWarps chunks and scans it as that kernel does (the same
// mlstm_tc_scan_chunk_gates, at a stride of kWarps chunks), the only link between chunks, m_L = b_L + max(m, X)
// (X: the chunk's max of i_s - b_s), is walked over the round's chunks from shared memory by every thread,
// and each warp writes its rows with the m entering its chunk. Every value the same expression of the same
// operands as there: bitwise equal rows.
template <typename TG, int kChunk, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) mlstm_tc_gates_warps_kernel(const MlstmParams p) {
  constexpr int L = kChunk, E = (L + 31) / 32;  // steps per lane, consecutive
  __shared__ float2 links[kWarps];  // (b_L, X) of each chunk of the round
  const long long seq = blockIdx.x, S = p.seqlen, NC = (S + L - 1) / L;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const TG* ip = static_cast<const TG*>(p.i) + seq * S;
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  float4* rows = reinterpret_cast<float4*>(p.gate_rows) + seq * S;
  float* mrow = p.m_rows + seq * S;
  float m = p.m0 ? p.m0[seq] : p.m_init;  // entering the round
  // This warp's chunk of the next round is loaded (raw) while this round's is scanned.
  unsigned f_raw[E], i_raw[E];
  mlstm_tc_load_gates<TG>(fp, ip, S, static_cast<long long>(warp) * L, lane, f_raw, i_raw);
  for (long long c0 = 0; c0 < NC; c0 += kWarps) {
    const long long c = c0 + warp, t0 = c * L;
    const int chunks = static_cast<int>(NC - c0 < kWarps ? NC - c0 : kWarps);  // in this round
    const bool active = c < NC;
    const int len = active ? static_cast<int>(S - t0 < L ? S - t0 : L) : 1;
    float b[E], ig[E], pm[E], before;
    mlstm_tc_scan_chunk_gates<TG>(fp, ip, S, c + kWarps < NC, t0 + kWarps * L, len, lane, f_raw, i_raw, b, ig, pm,
                                  before);
    const int last = len - 1, owner = last / E, j_last = last % E;
    float b_sel = 0.0f, x_sel = 0.0f;
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (j == j_last) b_sel = b[j], x_sel = fmaxf(pm[j], before);
    const float bL = __shfl_sync(0xffffffffu, b_sel, owner), X = __shfl_sync(0xffffffffu, x_sel, owner);
    if (lane == 0 && active) links[warp] = make_float2(bL, X);
    __syncthreads();
    float m_in = m, mc = m;  // m entering this warp's chunk; m entering chunk w, after the loop the round's last
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < chunks) {
        if (w == warp) m_in = mc;
        const float2 link = links[w];
        mc = link.x + fmaxf(mc, link.y);
      }
    }
    const float mL = bL + fmaxf(m_in, X);
    if (active) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int t = lane * E + j;
        if (t < len) {
          const float mt = b[j] + fmaxf(m_in, fmaxf(pm[j], before));
          rows[t0 + t] = make_float4(b[j] - mt, ig[j] - b[j], expf(b[j] + m_in - mt), expf(bL - b[j] + ig[j] - mL));
          mrow[t0 + t] = mt;
        }
      }
      if (lane == 0) p.chunk_g[seq * NC + c] = expf(bL + m_in - mL);
    }
    m = mc;
    __syncthreads();  // every thread has read links before the next round writes them
  }
  if (threadIdx.x == 0 && p.m) p.m[seq] = m;
}

// ---- 2. state (and, reversed, the backward's state gradient) ----

// kReverse false (the forward): C entering chunk c, C <- e^(b_L + m - m_L) C + sum_s w_s k_s v_s^T from
// C0, n alike; writes C (and n) entering every chunk, C_last and n_last when p.C is set.
// kReverse true (mlstm.chunkwise.bwd algo=tc): dC after chunk c, from the last chunk down,
// dC <- e^(b_L + m - m_L) dC + sum_t u_t q_t dh_t^T with u_t = s g_t / (nrm_t + eps), from dC_last;
// writes dC after every chunk (to Cs), and dC0 (the gradient entering the first chunk) when p.C is set.
// The same product either way: a [64 x L] . [L x 64] mma per chunk with a per-step weight on A.
// A CTA's work (its tile from blockIdx.x, .y); mlstm_tc_state_kernel launches one direction,
// chunkwise_tc_bwd.cuh's mlstm_tc_states_kernel both in one grid. kTile: the C tile's edge (64; 128 for
// algo=tc_wide, params.h), 16 rows a warp.
template <typename T, int kDk, int kDv, int kChunk, bool kReverse, int kTile = 64>
__device__ __forceinline__ void mlstm_tc_state(const MlstmParams& p, unsigned char* smem_raw) {
  constexpr int L = kChunk, BK = mlstm_tc_state_tile(kDk, kTile), BV = mlstm_tc_state_tile(kDv, kTile);
  constexpr int P = kMlstmTcPad, kThreads = mlstm_tc_state_threads(kDk, kTile), NT = BV / 8, KS = BK + P,
                VS = BV + P;
  constexpr int kDkTiles = kDk / BK;
  static_assert(BK % 16 == 0 && BV % 16 == 0 && L % 16 == 0, "tiles of 16");
  T* Ks = reinterpret_cast<T*>(smem_raw);                  // [2][L][KS]: k (q reversed)
  T* Vs = Ks + 2 * L * KS;                                 // [2][L][VS]: v (dh reversed)
  float* ws = reinterpret_cast<float*>(Vs + 2 * L * VS);  // [2][L]: w_t (u_t reversed)
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw), mlstm_tc_state_smem_bytes(kDk, kDv, L, kTile) / 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, cq = lane % 4;
  const long long seq = blockIdx.x / kDkTiles, S = p.seqlen, NC = (S + L - 1) / L;
  const int d0 = static_cast<int>(blockIdx.x % kDkTiles) * BK, e0 = blockIdx.y * BV;
  const T* k = static_cast<const T*>(kReverse ? p.q : p.k) + seq * S * kDk;
  const T* v = static_cast<const T*>(kReverse ? p.dh : p.v) + seq * S * kDv;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));
  const bool writes_n = !kReverse && blockIdx.y == 0 && cq == 0;  // n once per row: the quad leaders

  auto load = [&](long long c, int st) {
    const long long t0 = c * L;
    T* ks = Ks + st * L * KS;
    T* vs = Vs + st * L * VS;
    for (int j = tid; j < L * (BK / 8); j += kThreads) {
      const int s = j / (BK / 8), x = j % (BK / 8);
      const bool ok = t0 + s < S;
      cp_async_16(ks + s * KS + x * 8, k + (ok ? t0 + s : 0) * kDk + d0 + x * 8, ok);
    }
    for (int j = tid; j < L * (BV / 8); j += kThreads) {
      const int s = j / (BV / 8), x = j % (BV / 8);
      const bool ok = t0 + s < S;
      cp_async_16(vs + s * VS + x * 8, v + (ok ? t0 + s : 0) * kDv + e0 + x * 8, ok);
    }
    for (int s = tid; s < L; s += kThreads) {
      const long long t = t0 + s;
      ws[st * L + s] = t >= S ? 0.0f : kReverse ? scale * gr[t].z / (p.nrm[seq * S + t] + p.eps) : gr[t].w;
    }
  };

  // This thread's accumulators: rows r0 and r0 + 8 of C, columns e0 + 8 nt + 2 cq (+1).
  const int r0 = d0 + warp * 16 + g;
  float acc[NT][4];
  const float* C0 = kReverse ? p.dC_last : p.C0;
  if (C0) C0 += seq * kDk * kDv;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = e0 + nt * 8 + 2 * cq;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = C0 ? C0[(r0 + (e / 2) * 8) * kDv + col + e % 2] : 0.0f;
  }
  // n of rows r0, r0 + 8, kept (identical) by the four lanes of a quad.
  float n_a = !kReverse && p.n0 ? p.n0[seq * kDk + r0] : 0.0f, n_b = !kReverse && p.n0 ? p.n0[seq * kDk + r0 + 8] : 0.0f;

  load(kReverse ? NC - 1 : 0, 0);
  cp_async_commit();
  for (long long j = 0; j < NC; ++j) {
    const long long c = kReverse ? NC - 1 - j : j;
    const int st = static_cast<int>(j & 1);
    T* Cc = static_cast<T*>(p.Cs) + (seq * NC + c) * kDk * kDv;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = e0 + nt * 8 + 2 * cq;
      *reinterpret_cast<unsigned*>(Cc + r0 * kDv + col) = pack2<T>(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<unsigned*>(Cc + (r0 + 8) * kDv + col) = pack2<T>(acc[nt][2], acc[nt][3]);
    }
    if (writes_n) p.ns[(seq * NC + c) * kDk + r0] = n_a, p.ns[(seq * NC + c) * kDk + r0 + 8] = n_b;
    const bool last = j + 1 == NC;
    if (last && !p.C) {  // the state after the last chunk (C_last, dC0) only when asked for
      cp_async_wait<0>();
      break;
    }
    if (!last) {
      load(kReverse ? c - 1 : c + 1, st ^ 1);  // that stage's last readers passed the barrier closing j - 1
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float ge = p.chunk_g[seq * NC + c];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] *= ge;
    const T* ks = Ks + st * L * KS;
    const T* vs = Vs + st * L * VS;
    const float* w = ws + st * L;
    float sum_a = 0.0f, sum_b = 0.0f;  // this lane's part of sum_s w_s k_s for rows r0, r0 + 8 (fp32)
#pragma unroll 2
    for (int kk = 0; kk < L / 16; ++kk) {
      // A[dk][s] = w_s K[s][dk]: the stored tile's rows are A's columns, hence the transposed load.
      unsigned a[4];
      ldmatrix_x4_trans(a, ks + (kk * 16 + lane % 8 + 8 * (lane / 16)) * KS + warp * 16 + 8 * ((lane / 8) % 2));
      const int s = kk * 16 + 2 * cq;
      a[0] = scale2<T>(a[0], w[s], w[s + 1], sum_a);
      a[1] = scale2<T>(a[1], w[s], w[s + 1], sum_b);
      a[2] = scale2<T>(a[2], w[s + 8], w[s + 9], sum_a);
      a[3] = scale2<T>(a[3], w[s + 8], w[s + 9], sum_b);
      mma_row<T, NT, true>(acc, a, vs, VS, kk * 16, lane);
    }
    if (!kReverse) {
      // The quad's lanes hold the columns 2cq, 2cq + 1, 2cq + 8, 2cq + 9 of every 16 steps: together all.
      sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
      sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
      sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
      sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
      n_a = fmaf(ge, n_a, sum_a);
      n_b = fmaf(ge, n_b, sum_b);
    }
    __syncthreads();
  }
  if (p.C) {
    float* C = p.C + seq * kDk * kDv;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = e0 + nt * 8 + 2 * cq;
      *reinterpret_cast<float2*>(C + r0 * kDv + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(C + (r0 + 8) * kDv + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
    if (writes_n) p.n[seq * kDk + r0] = n_a, p.n[seq * kDk + r0 + 8] = n_b;
  }
}

template <typename T, int kDk, int kDv, int kChunk, bool kReverse, int kTile = 64>
__global__ void __launch_bounds__(mlstm_tc_state_threads(kDk, kTile)) mlstm_tc_state_kernel(const MlstmParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  mlstm_tc_state<T, kDk, kDv, kChunk, kReverse, kTile>(p, smem_raw);
}

// ---- 3. output ----

// K and V rows k0 .. k0 + R - 1 (zeros past S), V's columns e0 .. e0 + BV - 1, into Ks [R][QS], Vs [R][VS].
template <typename T, int kDk, int kDv, int R, int BV, int kThreads>
__device__ __forceinline__ void mlstm_tc_load_kv(T* Ks, T* Vs, const T* k, const T* v, long long k0, long long S,
                                                 int e0, int tid) {
  constexpr int QS = kDk + kMlstmTcPad, VS = BV + kMlstmTcPad;
  for (int j = tid; j < R * (kDk / 8); j += kThreads) {
    const int r = j / (kDk / 8), x = j % (kDk / 8);
    const bool ok = k0 + r < S;
    cp_async_16(Ks + r * QS + x * 8, k + (ok ? k0 + r : 0) * kDk + x * 8, ok);
  }
  for (int j = tid; j < R * (BV / 8); j += kThreads) {
    const int r = j / (BV / 8), x = j % (BV / 8);
    const bool ok = k0 + r < S;
    cp_async_16(Vs + r * VS + x * 8, v + (ok ? k0 + r : 0) * kDv + e0 + x * 8, ok);
  }
}

// kQRows: query rows a CTA, 16 a warp (mlstm_tc_rows(kChunk), or kMlstmTcWideRows for algo=tc_q128); key
// tiles are mlstm_tc_rows(kChunk) rows either way.
template <typename T, int kDk, int kDv, int kChunk, int kQRows = mlstm_tc_rows(kChunk)>
__global__ void __launch_bounds__(2 * kQRows, kQRows == mlstm_tc_rows(kChunk) ? 2 : 1)
    mlstm_tc_out_kernel(const MlstmParams p) {
  constexpr int L = kChunk, R = mlstm_tc_rows(L), RQ = kQRows, BV = mlstm_tc_bv(kDv), P = kMlstmTcPad;
  constexpr int kThreads = 2 * RQ, QS = kDk + P, VS = BV + P, NV = BV / 8, NK = R / 8;
  static_assert(kDk % 16 == 0 && BV % 16 == 0 && R % 16 == 0 && L % R == 0 && RQ % R == 0 && L % RQ == 0,
                "tiles of 16");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Q [RQ][QS]; two K/V buffers: 0 first holds the C tile [kDk][VS], 1 the first K/V tile, then they
  // alternate (tile kt in buffer (kt + 1) % 2); then i_s - b_s of the chunk and n entering it.
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* const buf0 = Qs + RQ * QS;
  T* const buf1 = buf0 + mlstm_tc_out_region_elems(kDk, kDv, L);
  float* ibs = reinterpret_cast<float*>(buf1 + R * QS + R * VS);  // [L]
  float* nsm = ibs + L;                                             // [kDk]
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw), mlstm_tc_out_smem_bytes(kDk, kDv, L, RQ) / 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, cq = lane % 4;
  const long long S = p.seqlen, QT = (S + RQ - 1) / RQ, NC = (S + L - 1) / L;
  const long long seq = blockIdx.x / QT, t0 = (blockIdx.x % QT) * RQ, c = t0 / L, cs = c * L;
  // Key tiles from the chunk's start to the CTA's last row's (each warp skips those past its own rows).
  const int e0 = blockIdx.y * BV, ktiles = static_cast<int>((t0 - cs) / R) + RQ / R;
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * S * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * S * kDv;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));

  for (int j = tid; j < RQ * (kDk / 8); j += kThreads) {
    const int r = j / (kDk / 8), x = j % (kDk / 8);
    const bool ok = t0 + r < S;
    cp_async_16(Qs + r * QS + x * 8, q + (ok ? t0 + r : 0) * kDk + x * 8, ok);
  }
  const T* Cc = static_cast<const T*>(p.Cs) + (seq * NC + c) * kDk * kDv;
  for (int j = tid; j < kDk * (BV / 8); j += kThreads) {
    const int r = j / (BV / 8), x = j % (BV / 8);
    cp_async_16(buf0 + r * VS + x * 8, Cc + r * kDv + e0 + x * 8, true);
  }
  cp_async_commit();
  mlstm_tc_load_kv<T, kDk, kDv, R, BV, kThreads>(buf1, buf1 + R * QS, k, v, cs, S, e0, tid);
  cp_async_commit();
  for (int s = tid; s < ktiles * R; s += kThreads) ibs[s] = cs + s < S ? gr[cs + s].y : mlstm_neg_inf();
  for (int d = tid; d < kDk; d += kThreads) nsm[d] = p.ns[(seq * NC + c) * kDk + d];
  // This thread's rows: ra and ra + 8 of the tile.
  const int ra = warp * 16 + g;
  const long long ta = t0 + ra, tb = ta + 8;
  const float4 ga = ta < S ? gr[ta] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4 gb = tb < S ? gr[tb] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float ma = ta < S ? p.m_rows[seq * S + ta] : 0.0f, mb = tb < S ? p.m_rows[seq * S + tb] : 0.0f;
  cp_async_wait<1>();  // Q and C
  __syncthreads();

  // Inter-chunk term O = (g_t s Q) C_c by mma, and q_t . n_c from the same A fragments (fp32).
  float o[NV][4];
  mma_zero(o);
  float qn_a = 0.0f, qn_b = 0.0f;
  const T* qa = Qs + (warp * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * QS + 8 * (lane / 16);  // A rows, row-major
#pragma unroll 2
  for (int kk = 0; kk < kDk / 16; ++kk) {
    unsigned a[4];
    ldmatrix_x4(a, qa + kk * 16);
    const int d = kk * 16 + 2 * cq;
    qn_a += dot2<T>(a[0], nsm[d], nsm[d + 1]) + dot2<T>(a[2], nsm[d + 8], nsm[d + 9]);
    qn_b += dot2<T>(a[1], nsm[d], nsm[d + 1]) + dot2<T>(a[3], nsm[d + 8], nsm[d + 9]);
    mma_row<T, NV, true>(o, a, buf0, VS, kk * 16, lane);
  }
  const float fa = ga.z * scale, fb = gb.z * scale;
  mma_scale_rows(o, fa, fb);

  // Intra-chunk term, key tiles from the chunk's start to the diagonal; tile kt + 1's loads fly during
  // tile kt's math.
  float sum_a = 0.0f, sum_b = 0.0f;
  const int row_a = static_cast<int>(t0 - cs) + ra, row_b = row_a + 8;  // rows' positions in the chunk
  for (int kt = 0; kt < ktiles; ++kt) {
    __syncthreads();  // every warp is done with buffer kt % 2 (the C tile, or tile kt - 1)
    if (kt + 1 < ktiles) {
      T* nb = kt % 2 ? buf1 : buf0;
      mlstm_tc_load_kv<T, kDk, kDv, R, BV, kThreads>(nb, nb + R * QS, k, v, cs + (kt + 1) * R, S, e0, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // This warp's rows all precede the tile's keys (a 128-row CTA's first 4 warps, its last tile): masked
    // out entirely, nothing to add. Warp-uniform; the barriers above stay outside.
    if (row_a + 15 - g < kt * R) continue;
    const T* Ks = kt % 2 ? buf0 : buf1;
    const T* Vs = Ks + R * QS;
    float sc[NK][4];
    mma_zero(sc);
#pragma unroll 2
    for (int kk = 0; kk < kDk / 16; ++kk) {
      unsigned a[4];
      ldmatrix_x4(a, qa + kk * 16);
      mma_row<T, NK, false>(sc, a, Ks, QS, kk * 16, lane);  // B[dk][key] = K[key][dk], stored as [n][k]
    }
#pragma unroll
    for (int nt = 0; nt < NK; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kt * R + nt * 8 + 2 * cq + e % 2;  // position in the chunk
        const bool upper = e < 2;
        const float x = (upper ? row_a : row_b) >= key ? sc[nt][e] * scale * __expf((upper ? ga.x : gb.x) + ibs[key])
                                                       : 0.0f;
        sc[nt][e] = x;
        if (upper) sum_a += x;
        else sum_b += x;
      }
    }
#pragma unroll
    for (int kk = 0; kk < R / 16; ++kk) {  // O += P V: the score accumulators are the A fragments
      unsigned a[4];
      scores_as_a<T, NK>(a, sc, kk);
      mma_row<T, NV, true>(o, a, Vs, VS, kk * 16, lane);
    }
  }
  // Row sums over the quad (its lanes hold every column between them).
  for (int x = 1; x <= 2; x *= 2) {
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, x);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, x);
    qn_a += __shfl_xor_sync(0xffffffffu, qn_a, x);
    qn_b += __shfl_xor_sync(0xffffffffu, qn_b, x);
  }
  const float nrm_a = fmaxf(fabsf(fa * qn_a + sum_a), expf(-ma));
  const float nrm_b = fmaxf(fabsf(fb * qn_b + sum_b), expf(-mb));
  const float inv_a = 1.0f / (nrm_a + p.eps), inv_b = 1.0f / (nrm_b + p.eps);
  T* h = static_cast<T*>(p.h) + seq * S * kDv;
#pragma unroll
  for (int nt = 0; nt < NV; ++nt) {
    const int col = e0 + nt * 8 + 2 * cq;
    if (ta < S) *reinterpret_cast<unsigned*>(h + ta * kDv + col) = pack2<T>(o[nt][0] * inv_a, o[nt][1] * inv_a);
    if (tb < S) *reinterpret_cast<unsigned*>(h + tb * kDv + col) = pack2<T>(o[nt][2] * inv_b, o[nt][3] * inv_b);
  }
  if (p.nrm && blockIdx.y == 0 && cq == 0) {
    if (ta < S) p.nrm[seq * S + ta] = nrm_a;
    if (tb < S) p.nrm[seq * S + tb] = nrm_b;
  }
}

}  // namespace kspec
