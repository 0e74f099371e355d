// mlstm.chunkwise.bwd, algo=tc: the backward on tensor cores (fp16/bf16, DHQK and DHHV <= 128), the
// formulas of chunkwise_bwd.cuh (dhn_t = dh_t / (nrm_t + eps), D_ts = e^(b_t - m_t + i_s - b_s), s <= t
// in one chunk, C the state entering the chunk, dC the gradient of the state after it):
//   dq_t = s g_t C dhn_t + s sum_s D_ts (dhn_t . v_s) k_s        dk_s = s sum_t D_ts (dhn_t . v_s) q_t + w_s dC v_s
//   dv_s = s sum_t D_ts (q_t . k_s) dhn_t + w_s dC^T k_s         di_s = k_s . dk_s
//   df_t = sigmoid(-f_t) (<dC_last, C_last> + sum_r>=t (q_r . dq_r - k_r . dk_r))
// Launches after chunkwise_tc.cuh's gates kernel (m recomputed: the forward's m of the same inputs) and
// its state kernel forward (C entering every chunk, C_last for df when dC_last is given) and reversed
// (dC after every chunk, dC0): dq per query tile (like the forward's output kernel, dH Vᵀ in place of
// Q Kᵀ), dv and dk per key tile (two kernels, each with its own accumulators: 64 floats a thread at
// head dims 128), looping over the chunk's query tiles from the diagonal on; then df per sequence.
// No atomics: every output element is one thread's, every sum a fixed order (bitwise repeatable).
#pragma once

#include "mlstm/chunkwise_tc.cuh"

namespace kspec {

// Rows r0 .. r0 + R - 1 of a [S][kD] tensor into a [R][kD + pad] shared tile (zeros past S).
template <typename T, int kD, int R, int kThreads>
__device__ __forceinline__ void mlstm_tc_load_rows(T* dst, const T* src, long long r0, long long S, int tid) {
  for (int j = tid; j < R * (kD / 8); j += kThreads) {
    const int r = j / (kD / 8), x = j % (kD / 8);
    const bool ok = r0 + r < S;
    cp_async_16(dst + r * (kD + kMlstmTcPad) + x * 8, src + (ok ? r0 + r : 0) * kD + x * 8, ok);
  }
}

// ---- dq (and q . dq) ----

template <typename T, int kDk, int kDv, int kChunk>
__global__ void __launch_bounds__(mlstm_tc_out_threads(kChunk), 1) mlstm_tc_dq_kernel(const MlstmParams p) {
  constexpr int L = kChunk, R = mlstm_tc_rows(L), P = kMlstmTcPad, kThreads = mlstm_tc_out_threads(L);
  constexpr int KS = kDk + P, VS = kDv + P, NQ = kDk / 8, NK = R / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [R][KS]
  T* Ks = Qs + R * KS;                     // [R][KS]
  T* Hs = Ks + R * KS;                     // [R][VS] dh
  T* Vs = Hs + R * VS;                     // [R][VS]
  T* Cs = Vs + R * VS;                     // [kDk][VS] C entering the chunk
  float* ibs = reinterpret_cast<float*>(Cs + kDk * VS);  // [L]
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw), mlstm_tc_bwd_smem_bytes(kDk, kDv, L) / 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, cq = lane % 4;
  const long long S = p.seqlen, QT = (S + R - 1) / R, NC = (S + L - 1) / L;
  const long long seq = blockIdx.x / QT, t0 = (blockIdx.x % QT) * R, c = t0 / L, cs = c * L;
  const int ktiles = static_cast<int>((t0 - cs) / R) + 1;
  const T* k = static_cast<const T*>(p.k) + seq * S * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * S * kDv;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));

  mlstm_tc_load_rows<T, kDk, R, kThreads>(Qs, static_cast<const T*>(p.q) + seq * S * kDk, t0, S, tid);
  mlstm_tc_load_rows<T, kDv, R, kThreads>(Hs, static_cast<const T*>(p.dh) + seq * S * kDv, t0, S, tid);
  mlstm_tc_load_rows<T, kDv, kDk, kThreads>(Cs, static_cast<const T*>(p.Cs) + (seq * NC + c) * kDk * kDv, 0, kDk, tid);
  cp_async_commit();
  for (int s = tid; s < ktiles * R; s += kThreads) ibs[s] = cs + s < S ? gr[cs + s].y : mlstm_neg_inf();
  const int ra = warp * 16 + g;
  const long long ta = t0 + ra, tb = ta + 8;
  const float bma = ta < S ? gr[ta].x : 0.0f, bmb = tb < S ? gr[tb].x : 0.0f;
  const float rda = ta < S ? 1.0f / (p.nrm[seq * S + ta] + p.eps) : 0.0f;
  const float rdb = tb < S ? 1.0f / (p.nrm[seq * S + tb] + p.eps) : 0.0f;
  const float ua = ta < S ? scale * gr[ta].z * rda : 0.0f, ub = tb < S ? scale * gr[tb].z * rdb : 0.0f;
  cp_async_wait<0>();
  __syncthreads();

  // dq = u_t (dH C^T): B[dv][dk] = C[dk][dv], stored as [n][k].
  float dq[NQ][4];
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[nt][e] = 0.0f;
#pragma unroll 2
  for (int kk = 0; kk < kDv / 16; ++kk) {
    unsigned a[4];
    ldmatrix_x4(a, frag_a(Hs, VS, warp * 16, kk * 16, lane));
    mma_row<T, NQ, false>(dq, a, Cs, VS, kk * 16, lane);
  }
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) dq[nt][0] *= ua, dq[nt][1] *= ua, dq[nt][2] *= ub, dq[nt][3] *= ub;

  const int row_a = static_cast<int>(t0 - cs) + ra, row_b = row_a + 8;
  for (int kt = 0; kt < ktiles; ++kt) {
    __syncthreads();  // every warp is done with the last K and V tiles
    mlstm_tc_load_rows<T, kDk, R, kThreads>(Ks, k, cs + kt * R, S, tid);
    mlstm_tc_load_rows<T, kDv, R, kThreads>(Vs, v, cs + kt * R, S, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float sc[NK][4];  // dH V^T: B[dv][key] = V[key][dv], stored as [n][k]
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
#pragma unroll 2
    for (int kk = 0; kk < kDv / 16; ++kk) {
      unsigned a[4];
      ldmatrix_x4(a, frag_a(Hs, VS, warp * 16, kk * 16, lane));
      mma_row<T, NK, false>(sc, a, Vs, VS, kk * 16, lane);
    }
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kt * R + nt * 8 + 2 * cq + e % 2;
        const bool upper = e < 2;
        sc[nt][e] = (upper ? row_a : row_b) >= key
                        ? sc[nt][e] * scale * __expf((upper ? bma : bmb) + ibs[key]) * (upper ? rda : rdb)
                        : 0.0f;
      }
#pragma unroll
    for (int kk = 0; kk < R / 16; ++kk) {  // dq += dS K: B[key][dk], stored as [k][n]
      unsigned a[4];
      scores_as_a<T, NK>(a, sc, kk);
      mma_row<T, NQ, true>(dq, a, Ks, KS, kk * 16, lane);
    }
  }
  float qa = 0.0f, qb = 0.0f;  // q . dq in fp32, before dq is rounded
  T* dqo = static_cast<T*>(p.dq) + seq * S * kDk;
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) {
    const int col = nt * 8 + 2 * cq;
    qa += dot2<T>(*reinterpret_cast<const unsigned*>(Qs + ra * KS + col), dq[nt][0], dq[nt][1]);
    qb += dot2<T>(*reinterpret_cast<const unsigned*>(Qs + (ra + 8) * KS + col), dq[nt][2], dq[nt][3]);
    if (ta < S) *reinterpret_cast<unsigned*>(dqo + ta * kDk + col) = pack2<T>(dq[nt][0], dq[nt][1]);
    if (tb < S) *reinterpret_cast<unsigned*>(dqo + tb * kDk + col) = pack2<T>(dq[nt][2], dq[nt][3]);
  }
  for (int x = 1; x <= 2; x *= 2) {
    qa += __shfl_xor_sync(0xffffffffu, qa, x);
    qb += __shfl_xor_sync(0xffffffffu, qb, x);
  }
  if (cq == 0) {
    if (ta < S) p.qdq[seq * S + ta] = qa;
    if (tb < S) p.qdq[seq * S + tb] = qb;
  }
}

// ---- dv (kDkPart false) or dk, di and k . dk (kDkPart true), per key tile ----

template <typename T, int kDk, int kDv, int kChunk, bool kDkPart>
__global__ void __launch_bounds__(mlstm_tc_out_threads(kChunk), 1) mlstm_tc_dkv_kernel(const MlstmParams p) {
  constexpr int L = kChunk, R = mlstm_tc_rows(L), P = kMlstmTcPad, kThreads = mlstm_tc_out_threads(L);
  constexpr int KS = kDk + P, VS = kDv + P, NA = (kDkPart ? kDk : kDv) / 8, NK = R / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);  // [R][KS] this tile's keys
  T* Qs = Ks + R * KS;                     // [R][KS] a query tile
  T* Vs = Qs + R * KS;                     // [R][VS] this tile's values
  T* Hs = Vs + R * VS;                     // [R][VS] a query tile's dh
  T* Ds = Hs + R * VS;                     // [kDk][VS] dC after the chunk
  float* bms = reinterpret_cast<float*>(Ds + kDk * VS);  // [R] b_t - m_t of the query tile (-inf past S)
  float* rds = bms + R;                                  // [R] 1 / (nrm_t + eps) (0 past S)
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw), mlstm_tc_bwd_smem_bytes(kDk, kDv, L) / 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, cq = lane % 4;
  const long long S = p.seqlen, QT = (S + R - 1) / R, NC = (S + L - 1) / L;
  const long long seq = blockIdx.x / QT, s0 = (blockIdx.x % QT) * R, c = s0 / L, cs = c * L;
  const long long ce = cs + L < S ? cs + L : S;  // the chunk's end
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk;
  const T* dh = static_cast<const T*>(p.dh) + seq * S * kDv;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));

  mlstm_tc_load_rows<T, kDk, R, kThreads>(Ks, static_cast<const T*>(p.k) + seq * S * kDk, s0, S, tid);
  mlstm_tc_load_rows<T, kDv, R, kThreads>(Vs, static_cast<const T*>(p.v) + seq * S * kDv, s0, S, tid);
  mlstm_tc_load_rows<T, kDv, kDk, kThreads>(Ds, static_cast<const T*>(p.Cs) + (seq * NC + c) * kDk * kDv, 0, kDk, tid);
  cp_async_commit();
  const int ra = warp * 16 + g;
  const long long sa = s0 + ra, sb = sa + 8;
  const float iba = sa < S ? gr[sa].y : mlstm_neg_inf(), ibb = sb < S ? gr[sb].y : mlstm_neg_inf();
  const float wa = sa < S ? gr[sa].w : 0.0f, wb = sb < S ? gr[sb].w : 0.0f;
  cp_async_wait<0>();
  __syncthreads();

  // Inter-chunk term: dv_s = w_s (k_s^T dC) (B[dk][dv] = dC, [k][n]); dk_s = w_s (dC v_s) (B[dv][dk], [n][k]).
  float acc[NA][4];
#pragma unroll
  for (int nt = 0; nt < NA; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
#pragma unroll 2
  for (int kk = 0; kk < (kDkPart ? kDv : kDk) / 16; ++kk) {
    unsigned a[4];
    ldmatrix_x4(a, kDkPart ? frag_a(Vs, VS, warp * 16, kk * 16, lane) : frag_a(Ks, KS, warp * 16, kk * 16, lane));
    mma_row<T, NA, !kDkPart>(acc, a, Ds, VS, kk * 16, lane);
  }
#pragma unroll
  for (int nt = 0; nt < NA; ++nt) acc[nt][0] *= wa, acc[nt][1] *= wa, acc[nt][2] *= wb, acc[nt][3] *= wb;

  const int pos_a = static_cast<int>(s0 - cs) + ra, pos_b = pos_a + 8;  // the keys' positions in the chunk
  for (long long t0 = s0; t0 < ce; t0 += R) {
    __syncthreads();  // every warp is done with the last query tile
    mlstm_tc_load_rows<T, kDk, R, kThreads>(Qs, q, t0, S, tid);
    mlstm_tc_load_rows<T, kDv, R, kThreads>(Hs, dh, t0, S, tid);
    cp_async_commit();
    for (int r = tid; r < R; r += kThreads) {
      const bool ok = t0 + r < S;
      bms[r] = ok ? gr[t0 + r].x : mlstm_neg_inf();
      rds[r] = ok ? 1.0f / (p.nrm[seq * S + t0 + r] + p.eps) : 0.0f;
    }
    cp_async_wait<0>();
    __syncthreads();
    // Scores with the keys as rows: K Q^T (for dv) or V dH^T (for dk); B = the query tile, [n][k].
    float sc[NK][4];
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
#pragma unroll 2
    for (int kk = 0; kk < (kDkPart ? kDv : kDk) / 16; ++kk) {
      unsigned a[4];
      ldmatrix_x4(a, kDkPart ? frag_a(Vs, VS, warp * 16, kk * 16, lane) : frag_a(Ks, KS, warp * 16, kk * 16, lane));
      if (kDkPart) mma_row<T, NK, false>(sc, a, Hs, VS, kk * 16, lane);
      else mma_row<T, NK, false>(sc, a, Qs, KS, kk * 16, lane);
    }
    const int tpos = static_cast<int>(t0 - cs);
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * cq + e % 2;  // the query row in the tile
        const bool upper = e < 2;
        sc[nt][e] = tpos + col >= (upper ? pos_a : pos_b)
                        ? sc[nt][e] * scale * __expf(bms[col] + (upper ? iba : ibb)) * rds[col]
                        : 0.0f;
      }
#pragma unroll
    for (int kk = 0; kk < R / 16; ++kk) {  // dv += S^T dH, dk += dS^T Q: B = the query tile, [k][n]
      unsigned a[4];
      scores_as_a<T, NK>(a, sc, kk);
      if (kDkPart) mma_row<T, NA, true>(acc, a, Qs, KS, kk * 16, lane);
      else mma_row<T, NA, true>(acc, a, Hs, VS, kk * 16, lane);
    }
  }
  constexpr int kW = kDkPart ? kDk : kDv;
  T* out = static_cast<T*>(kDkPart ? p.dk : p.dv) + seq * S * kW;
  float da = 0.0f, db = 0.0f;  // k . dk in fp32
#pragma unroll
  for (int nt = 0; nt < NA; ++nt) {
    const int col = nt * 8 + 2 * cq;
    if (kDkPart) {
      da += dot2<T>(*reinterpret_cast<const unsigned*>(Ks + ra * KS + col), acc[nt][0], acc[nt][1]);
      db += dot2<T>(*reinterpret_cast<const unsigned*>(Ks + (ra + 8) * KS + col), acc[nt][2], acc[nt][3]);
    }
    if (sa < S) *reinterpret_cast<unsigned*>(out + sa * kW + col) = pack2<T>(acc[nt][0], acc[nt][1]);
    if (sb < S) *reinterpret_cast<unsigned*>(out + sb * kW + col) = pack2<T>(acc[nt][2], acc[nt][3]);
  }
  if (kDkPart) {
    for (int x = 1; x <= 2; x *= 2) {
      da += __shfl_xor_sync(0xffffffffu, da, x);
      db += __shfl_xor_sync(0xffffffffu, db, x);
    }
    if (cq == 0) {
      if (sa < S) p.kdk[seq * S + sa] = da;
      if (sb < S) p.kdk[seq * S + sb] = db;
    }
  }
}

// ---- di, df: one warp per sequence, from the end ----

template <typename TG, int kDk, int kDv>
__global__ void __launch_bounds__(32) mlstm_tc_df_kernel(const MlstmParams p) {
  const long long seq = blockIdx.x, S = p.seqlen;
  const int lane = threadIdx.x;
  float run = 0.0f;  // <dC_last, C_last> (p.C: the forward's C_last), then the running sum from the end
  if (p.dC_last) {
    const float* up = p.dC_last + seq * kDk * kDv;
    const float* C = p.C + seq * kDk * kDv;
    for (int j = lane; j < kDk * kDv; j += 32) run = fmaf(up[j], C[j], run);
    run = warp_reduce_sum(run);
  }
  const float* qdq = p.qdq + seq * S;
  const float* kdk = p.kdk + seq * S;
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  TG* di = static_cast<TG*>(p.di) + seq * S;
  TG* df = static_cast<TG*>(p.df) + seq * S;
  // A lane owns one of 32 consecutive segments: its sum, the sums of the later segments (a reverse
  // scan over lanes), then its steps from its end down, each lane's loads independent of the others.
  const long long seg = (S + 31) / 32, lo = lane * seg < S ? lane * seg : S, hi = lo + seg < S ? lo + seg : S;
  float own = 0.0f;
#pragma unroll 4
  for (long long t = lo; t < hi; ++t) own += qdq[t] - kdk[t];
  float later = own;  // sum over lanes >= this one
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float y = __shfl_down_sync(0xffffffffu, later, off);
    if (lane + off < 32) later += y;
  }
  float da = run + later - own;
#pragma unroll 4
  for (long long t = hi - 1; t >= lo; --t) {
    da += qdq[t] - kdk[t];
    const float d = (t == 0 && !p.C0) ? 0.0f : da;  // step 0 without a state: a_0 scales nothing
    df[t] = from_float<TG>(d / (1.0f + expf(to_float(fp[t]))));
    di[t] = from_float<TG>(kdk[t]);
  }
}

}  // namespace kspec
