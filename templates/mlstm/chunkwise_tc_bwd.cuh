// mlstm.chunkwise.bwd, algo=tc: the backward on tensor cores (fp16/bf16, DHQK <= 256), the
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
// Head dims over 128: a CTA per column block of 128 (params.h, mlstm_tc_bwd_blocks), the tiles and
// accumulators of a 128 x 128 problem; a gradient that contracts a split dim is a sum of the blocks'
// fp32 partials, which mlstm_tc_reduce_kernel adds in a fixed order (with q . dq and k . dk), except dq
// at DHQK <= 128, whose CTA loops over DHHV's blocks itself (mlstm_tc_dq_loops).
// No atomics: every output element is one thread's, every sum a fixed order (bitwise repeatable).
#pragma once

#include "mlstm/chunkwise_tc.cuh"

namespace kspec {

// Rows r0 .. r0 + R - 1, kD columns from src (rows kStride apart: a column block of a wider tensor),
// into a [R][kD + pad] shared tile (zeros past S).
template <typename T, int kD, int R, int kThreads, int kStride = kD>
__device__ __forceinline__ void mlstm_tc_load_rows(T* dst, const T* src, long long r0, long long S, int tid) {
  for (int j = tid; j < R * (kD / 8); j += kThreads) {
    const int r = j / (kD / 8), x = j % (kD / 8);
    const bool ok = r0 + r < S;
    cp_async_16(dst + r * (kD + kMlstmTcPad) + x * 8, src + (ok ? r0 + r : 0) * kStride + x * 8, ok);
  }
}

// This CTA's column blocks: DHQK columns d0 .. d0 + BK - 1, DHHV columns e0 .. e0 + BV - 1, from its
// block index `by` (blockIdx.y of the separate kernels: DHQK block * DHHV blocks + DHHV block).
template <int kDk, int kDv>
struct MlstmTcBwdBlock {
  static constexpr int BK = mlstm_tc_bwd_block(kDk), BV = mlstm_tc_bwd_block(kDv);
  static constexpr bool kOne = mlstm_tc_bwd_blocks(kDk, kDv) == 1;  // both 0, known to the compiler
  int d0, e0;
  __device__ __forceinline__ explicit MlstmTcBwdBlock(int by)
      : d0(kOne ? 0 : by / (kDv / BV) * BK), e0(kOne ? 0 : by % (kDv / BV) * BV) {}
};

// Where a CTA of the dq, dv or dk code sits: `tile` is its 64-row tile among all sequences' (seq * QT +
// tile in the sequence; blockIdx.x of the separate kernels), `tiles` their number (gridDim.x there), `by`
// its column block. mlstm_tc_grads_kernel derives them from its role instead.
struct MlstmTcTile {
  long long tile, tiles;
  int by;
};

// A 16-row slice of a partial gradient in fp32 (rows sa and sb of the sequence whose rows start at
// `rows`, kW apart; this CTA's columns from c0), for mlstm_tc_reduce_kernel.
template <int kNt, int kW>
__device__ __forceinline__ void mlstm_tc_store_part(const float (&acc)[kNt][4], float* rows, long long sa, long long sb,
                                                    long long S, int c0, int cq) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    const int col = c0 + nt * 8 + 2 * cq;
    if (sa < S) *reinterpret_cast<float2*>(rows + sa * kW + col) = make_float2(acc[nt][0], acc[nt][1]);
    if (sb < S) *reinterpret_cast<float2*>(rows + sb * kW + col) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// ---- dq (and q . dq) ----

// kLoop (algo=tc where mlstm_tc_dq_loops; false: algo=tc_parts, or a shape with one DHHV block).
// kPrefetch (algo=tc_overlap, one column block: params.h mlstm_tc_overlap_runs): the first key tile's K
// and V are requested with Q, dH and C, and arrive while the inter-chunk term is computed; each later key
// tile is requested while the one before is computed, into C's buffer (free after the inter term) and
// K's and V's in turn (kDouble, where both tiles fit C's buffer: 128 x 128 exactly).
template <typename T, int kDk, int kDv, int kChunk, bool kLoop, bool kPrefetch = false>
__device__ __forceinline__ void mlstm_tc_dq_tile(const MlstmParams& p, unsigned char* smem_raw, MlstmTcTile at) {
  using Block = MlstmTcBwdBlock<kDk, kDv>;
  static_assert(!kLoop || mlstm_tc_dq_loops(kDk, kDv) || mlstm_tc_streams(kDk),
                "loops over DHHV's blocks at DHQK <= 128 < DHHV, or streams them at DHQK > 128");
  constexpr int L = kChunk, R = mlstm_tc_rows(L), P = kMlstmTcPad, kThreads = mlstm_tc_out_threads(L);
  constexpr int BK = Block::BK, BV = Block::BV, KS = BK + P, VS = BV + P, NQ = BK / 8, NK = R / 8;
  // kLoop: this CTA's DHHV blocks are all of them (grid.y is DHQK's blocks, Block's e0 = 0), contracted
  // one after the other into the same accumulators; dH is loaded once, DHHV wide (HW), or at DHQK > 128
  // (kStream, algo=tc_stream) a block at a time beside C's and V's blocks.
  constexpr bool kStream = kLoop && mlstm_tc_streams(kDk);
  constexpr bool kReduced = mlstm_tc_bwd_reduced(kDk, kDv, kMlstmGradDq, false, kLoop, false, kStream);
  constexpr int kEB = kLoop ? kDv / BV : 1, HW = kStream ? BV : kEB * BV, HS = HW + P;
  // Looping, Q is loaded at the end into C's buffer (free by then), so the wide dH tile costs no more
  // shared memory than the separate Q tile did: 2 CTAs an SM still fit (params.h, mlstm_tc_dq_smem_bytes).
  constexpr bool kQAtEnd = kEB > 1;
  static_assert(!kQAtEnd || BK * VS >= R * KS, "Q fits C's buffer");
  static_assert(!kPrefetch || (kEB == 1 && !kQAtEnd), "prefetching: every tile its own buffer, one DHHV block");
  constexpr bool kDouble = kPrefetch && R * KS + R * VS <= BK * VS;
  T* Ks = reinterpret_cast<T*>(smem_raw) + (kQAtEnd ? 0 : R * KS);  // [R][KS]
  T* Hs = Ks + R * KS;                     // [R][HS] dh
  T* Vs = Hs + R * HS;                     // [R][VS]
  T* Cs = Vs + R * VS;                     // [BK][VS] C entering the chunk (a DHHV block of it)
  T* Qs = kQAtEnd ? Cs : reinterpret_cast<T*>(smem_raw);  // [R][KS]
  float* ibs = reinterpret_cast<float*>(Cs + BK * VS);  // [L]
  // kDouble: key tile kt's K and V in Ks, Vs (kt even) or C's buffer (kt odd).
  auto k_buf = [&](int kt) { return kDouble && (kt & 1) ? Cs : Ks; };
  auto v_buf = [&](int kt) { return kDouble && (kt & 1) ? Cs + R * KS : Vs; };
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw),
                              mlstm_tc_dq_smem_bytes(kDk, kDv, L, kLoop, kStream) / 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, cq = lane % 4;
  const long long S = p.seqlen, QT = (S + R - 1) / R, NC = (S + L - 1) / L;
  const long long seq = at.tile / QT, t0 = (at.tile % QT) * R, c = t0 / L, cs = c * L;
  const int ktiles = static_cast<int>((t0 - cs) / R) + 1;
  const Block blk(at.by);
  const T* k = static_cast<const T*>(p.k) + seq * S * kDk + blk.d0;
  const T* v = static_cast<const T*>(p.v) + seq * S * kDv + blk.e0;
  const T* Cg = static_cast<const T*>(p.Cs) + (seq * NC + c) * kDk * kDv + blk.d0 * kDv + blk.e0;
  const T* dh = static_cast<const T*>(p.dh) + seq * S * kDv + blk.e0;
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk + blk.d0;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));

  if (!kReduced && !kQAtEnd)  // for q . dq (the reduce kernel's otherwise)
    mlstm_tc_load_rows<T, BK, R, kThreads, kDk>(Qs, q, t0, S, tid);
  mlstm_tc_load_rows<T, HW, R, kThreads, kDv>(Hs, dh, t0, S, tid);
  mlstm_tc_load_rows<T, BV, BK, kThreads, kDv>(Cs, Cg, 0, BK, tid);
  cp_async_commit();
  if (kPrefetch) {  // the first key tile's, a second group
    mlstm_tc_load_rows<T, BK, R, kThreads, kDk>(Ks, k, cs, S, tid);
    mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Vs, v, cs, S, tid);
    cp_async_commit();
  }
  for (int s = tid; s < ktiles * R; s += kThreads) ibs[s] = cs + s < S ? gr[cs + s].y : mlstm_neg_inf();
  const int ra = warp * 16 + g;
  const long long ta = t0 + ra, tb = ta + 8;
  const float bma = ta < S ? gr[ta].x : 0.0f, bmb = tb < S ? gr[tb].x : 0.0f;
  const float rda = ta < S ? 1.0f / (p.nrm[seq * S + ta] + p.eps) : 0.0f;
  const float rdb = tb < S ? 1.0f / (p.nrm[seq * S + tb] + p.eps) : 0.0f;
  const float ua = ta < S ? scale * gr[ta].z * rda : 0.0f, ub = tb < S ? scale * gr[tb].z * rdb : 0.0f;
  cp_async_wait<kPrefetch ? 1 : 0>();
  __syncthreads();

  // dq = u_t (dH C^T): B[dv][dk] = C[dk][dv], stored as [n][k].
  float dq[NQ][4];
  mma_zero(dq);
#pragma unroll
  for (int eb = 0; eb < kEB; ++eb) {
    if (eb > 0) {
      __syncthreads();  // every warp is done with the last block of C (streaming: and of dH)
      mlstm_tc_load_rows<T, BV, BK, kThreads, kDv>(Cs, Cg + eb * BV, 0, BK, tid);
      if (kStream) mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Hs, dh + eb * BV, t0, S, tid);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
#pragma unroll 2
    for (int kk = 0; kk < BV / 16; ++kk) {
      unsigned a[4];
      ldmatrix_x4(a, frag_a(Hs, HS, warp * 16, (kStream ? 0 : eb * BV) + kk * 16, lane));
      mma_row<T, NQ, false>(dq, a, Cs, VS, kk * 16, lane);
    }
  }
  mma_scale_rows(dq, ua, ub);

  const int row_a = static_cast<int>(t0 - cs) + ra, row_b = row_a + 8;
  for (int kt = 0; kt < ktiles; ++kt) {
    float sc[NK][4];  // dH V^T, summed over the DHHV blocks: B[dv][key] = V[key][dv], stored as [n][k]
    mma_zero(sc);
#pragma unroll
    for (int eb = 0; eb < kEB; ++eb) {
      if (!kPrefetch || (!kDouble && kt > 0)) {
        __syncthreads();  // every warp is done with the last K and V tiles
        if (eb == 0) mlstm_tc_load_rows<T, BK, R, kThreads, kDk>(Ks, k, cs + kt * R, S, tid);
        mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Vs, v + eb * BV, cs + kt * R, S, tid);
        if (kStream) mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Hs, dh + eb * BV, t0, S, tid);
        cp_async_commit();
        cp_async_wait<0>();
      } else if (kDouble && kt + 1 < ktiles) {
        // Every warp is done with the buffer tile kt + 1 goes to (C's after the inter term, else tile kt - 1's).
        __syncthreads();
        mlstm_tc_load_rows<T, BK, R, kThreads, kDk>(k_buf(kt + 1), k, cs + (kt + 1) * R, S, tid);
        mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(v_buf(kt + 1), v, cs + (kt + 1) * R, S, tid);
        cp_async_commit();
        cp_async_wait<1>();  // tile kt's group, every group but the newest
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
#pragma unroll 2
      for (int kk = 0; kk < BV / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, frag_a(Hs, HS, warp * 16, (kStream ? 0 : eb * BV) + kk * 16, lane));
        mma_row<T, NK, false>(sc, a, v_buf(kt), VS, kk * 16, lane);
      }
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
      mma_row<T, NQ, true>(dq, a, k_buf(kt), KS, kk * 16, lane);
    }
  }
  if (kQAtEnd) {  // C's buffer was last read before the key loop's barriers
    mlstm_tc_load_rows<T, BK, R, kThreads, kDk>(Qs, q, t0, S, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  if (kReduced) {  // part: this CTA's DHHV block
    const long long seqs = at.tiles / QT;
    mlstm_tc_store_part<NQ, kDk>(dq, p.part + ((blk.e0 / BV) * seqs + seq) * S * kDk, ta, tb, S, blk.d0, cq);
    return;
  }
  float qa = 0.0f, qb = 0.0f;  // q . dq in fp32, before dq is rounded (streaming: this DHQK block's part)
  T* dqo = static_cast<T*>(p.dq) + seq * S * kDk + blk.d0;
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
    float* qdq = p.qdq + ((blk.d0 / BK) * (at.tiles / QT) + seq) * S;  // blk.d0 = 0 unless streaming
    if (ta < S) qdq[ta] = qa;
    if (tb < S) qdq[tb] = qb;
  }
}

template <typename T, int kDk, int kDv, int kChunk, bool kLoop>
__global__ void __launch_bounds__(mlstm_tc_out_threads(kChunk), 1) mlstm_tc_dq_kernel(const MlstmParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  mlstm_tc_dq_tile<T, kDk, kDv, kChunk, kLoop>(p, smem_raw, {blockIdx.x, gridDim.x, static_cast<int>(blockIdx.y)});
}

// ---- dv (kDkPart false) or dk, di and k . dk (kDkPart true), per key tile ----

// One key tile's dv or dk by 4 warps (`warp` 0..3 of them); the tiles are loaded by kThreads threads
// (`tid` 0 .. kThreads - 1): the 4 warps alone (mlstm_tc_dkv_kernel), or with the 4 warps of the other
// gradient, which load the same tiles (mlstm_tc_dkv_fused_kernel). Partials (head dims over 128) go to
// p.part + kPartAt * seqs * S. kLoop (dk alone, at mlstm_tc_dq_loops' shapes): the CTA contracts all of DHHV's
// blocks itself, its V and dH tiles DHHV wide, dC a block at a time (no partials). kPrefetch (algo=tc_overlap,
// one column block): the first query tile's Q and dH are requested with K, V and dC, and arrive while the
// inter-chunk term is computed; each later query tile is requested while the one before is computed, into
// dC's buffer (free after the inter term) and Q's and dH's in turn (kDouble, where both tiles fit dC's buffer
// and a chunk has more than one query tile).
template <typename T, int kDk, int kDv, int kChunk, bool kDkPart, int kThreads, int kPartAt, bool kLoop = false,
          bool kPrefetch = false>
__device__ __forceinline__ void mlstm_tc_dkv_tile(const MlstmParams& p, unsigned char* smem_raw, int tid, int warp,
                                                  MlstmTcTile at) {
  using Block = MlstmTcBwdBlock<kDk, kDv>;
  static_assert(!kLoop || (kDkPart ? mlstm_tc_dq_loops(kDk, kDv) || mlstm_tc_streams(kDk) : mlstm_tc_dv_loops(kDk)),
                "dk loops over DHHV's blocks at DHQK <= 128 < DHHV (streams them above), dv over DHQK's at DHQK > 128");
  constexpr int L = kChunk, R = mlstm_tc_rows(L), P = kMlstmTcPad;
  constexpr int BK = Block::BK, BV = Block::BV, VS = BV + P, NA = (kDkPart ? BK : BV) / 8, NK = R / 8;
  // Looping, dk contracts all of DHHV's blocks (its V and dH tiles HW wide, or at DHQK > 128, kStream,
  // a block at a time), dv all of DHQK's (its K and Q tiles KW wide); the inter term takes dC a block at
  // a time, kIB blocks.
  constexpr bool kStream = kLoop && kDkPart && mlstm_tc_streams(kDk);
  constexpr int kEB = kLoop && kDkPart ? kDv / BV : 1, HW = kStream ? BV : kEB * BV, HS = HW + P;
  constexpr int kDB = kLoop && !kDkPart ? kDk / BK : 1, KW = kDB * BK, KS = KW + P, kIB = kEB * kDB;
  constexpr int kGrad = kDkPart ? kMlstmGradDk : kMlstmGradDv;
  constexpr bool kReduced = !kLoop && mlstm_tc_bwd_reduced(kDk, kDv, kGrad, false, false);
  // Looping with a wide tile (kAlias), dC shares its buffer with the query tiles (the inter term is done
  // before the first query tile is loaded), so the wide tiles still leave 2 CTAs an SM
  // (mlstm_tc_dk_smem_bytes, mlstm_tc_dv_smem_bytes); dv looping has no V tile. Streaming, every tile
  // has its own buffer, as without a loop.
  constexpr bool kAlias = kLoop && !kStream;
  static_assert(!kPrefetch || (!kAlias && !kStream && kIB == 1), "prefetching: every tile its own buffer");
  // The second query tile's rows (b_t - m_t, 1 / (nrm_t + eps)) take 2 R more floats after the first's, which
  // mlstm_tc_bwd_smem_bytes' chunk + 2 R floats hold where L >= 2 R.
  constexpr bool kDouble = kPrefetch && R * KS + R * HS <= BK * VS && L >= 2 * R;
  constexpr int kVElems = kLoop && !kDkPart ? 0 : R * HS;
  constexpr int kRegion = BK * VS > R * KS + R * HS ? BK * VS : R * KS + R * HS;
  T* Ks = reinterpret_cast<T*>(smem_raw);  // [R][KS] this tile's keys
  T* Qs = kAlias ? Ks + R * KS + kVElems : Ks + R * KS;  // [R][KS] a query tile
  T* Vs = kAlias ? Ks + R * KS : Qs + R * KS;            // [R][HS] this tile's values
  T* Hs = kAlias ? Qs + R * KS : Vs + R * HS;            // [R][HS] a query tile's dh
  T* Ds = kAlias ? Qs : Hs + R * HS;                     // [BK][VS] dC after the chunk (a block of it)
  // [R] b_t - m_t of the query tile (-inf past S)
  float* bms = reinterpret_cast<float*>(kAlias ? Qs + kRegion : Ds + BK * VS);
  float* rds = bms + R;                                  // [R] 1 / (nrm_t + eps) (0 past S)
  // kDouble: query tile j (from s0) in Qs, Hs, bms, rds (j even) or dC's buffer and the next 2 R floats (j odd).
  auto q_buf = [&](int j) { return kDouble && (j & 1) ? Ds : Qs; };
  auto h_buf = [&](int j) { return kDouble && (j & 1) ? Ds + R * KS : Hs; };
  auto bm_buf = [&](int j) { return kDouble && (j & 1) ? bms + 2 * R : bms; };
  auto rd_buf = [&](int j) { return kDouble && (j & 1) ? bms + 3 * R : rds; };
  mlstm_poison_smem<kThreads>(reinterpret_cast<float*>(smem_raw),
                              (!kLoop    ? mlstm_tc_bwd_smem_bytes(kDk, kDv, L)
                               : kDkPart ? mlstm_tc_dk_smem_bytes(kDk, kDv, L)
                                         : mlstm_tc_dv_smem_bytes(kDk, kDv, L)) / 4);
  const int lane = threadIdx.x % 32, g = lane / 4, cq = lane % 4;
  const long long S = p.seqlen, QT = (S + R - 1) / R, NC = (S + L - 1) / L;
  const long long seq = at.tile / QT, s0 = (at.tile % QT) * R, c = s0 / L, cs = c * L;
  const long long ce = cs + L < S ? cs + L : S;  // the chunk's end
  const Block blk(at.by);
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk + blk.d0;
  const T* dh = static_cast<const T*>(p.dh) + seq * S * kDv + blk.e0;
  const float4* gr = reinterpret_cast<const float4*>(p.gate_rows) + seq * S;
  const float scale = rsqrtf(static_cast<float>(kDk));

  const T* v = static_cast<const T*>(p.v) + seq * S * kDv + blk.e0;
  mlstm_tc_load_rows<T, KW, R, kThreads, kDk>(Ks, static_cast<const T*>(p.k) + seq * S * kDk + blk.d0, s0, S, tid);
  // dv never reads V; its warps load a share of it only in the fused CTA, for dk's.
  if (kDkPart || kThreads > mlstm_tc_out_threads(kChunk))
    mlstm_tc_load_rows<T, HW, R, kThreads, kDv>(Vs, v, s0, S, tid);
  const T* Dg = static_cast<const T*>(p.Cs) + (seq * NC + c) * kDk * kDv + blk.d0 * kDv + blk.e0;
  mlstm_tc_load_rows<T, BV, BK, kThreads, kDv>(Ds, Dg, 0, BK, tid);
  cp_async_commit();
  // Query tile j (rows t0 ..): its Q and dH as one group, its b_t - m_t and 1 / (nrm_t + eps) by plain
  // stores (read after the barrier that follows).
  auto load_query_tile = [&](long long t0, int j) {
    mlstm_tc_load_rows<T, KW, R, kThreads, kDk>(q_buf(j), q, t0, S, tid);
    mlstm_tc_load_rows<T, HW, R, kThreads, kDv>(h_buf(j), dh, t0, S, tid);
    if (kStream) mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Vs, v, s0, S, tid);  // V's first block again
    cp_async_commit();
    float* bm = bm_buf(j);
    float* rd = rd_buf(j);
    for (int r = tid; r < R; r += kThreads) {
      const bool ok = t0 + r < S;
      bm[r] = ok ? gr[t0 + r].x : mlstm_neg_inf();
      rd[r] = ok ? 1.0f / (p.nrm[seq * S + t0 + r] + p.eps) : 0.0f;
    }
  };
  if (kPrefetch) load_query_tile(s0, 0);  // the first query tile, a second group
  const int ra = warp * 16 + g;
  const long long sa = s0 + ra, sb = sa + 8;
  const float iba = sa < S ? gr[sa].y : mlstm_neg_inf(), ibb = sb < S ? gr[sb].y : mlstm_neg_inf();
  const float wa = sa < S ? gr[sa].w : 0.0f, wb = sb < S ? gr[sb].w : 0.0f;
  cp_async_wait<kPrefetch ? 1 : 0>();
  __syncthreads();

  // Inter-chunk term: dv_s = w_s (k_s^T dC) (B[dk][dv] = dC, [k][n]); dk_s = w_s (dC v_s) (B[dv][dk], [n][k]).
  // Looping, block ib of dC is DHHV's (dk) or DHQK's (dv) ib-th.
  float acc[NA][4];
  mma_zero(acc);
#pragma unroll
  for (int ib = 0; ib < kIB; ++ib) {
    if (ib > 0) {
      __syncthreads();  // every warp is done with the last block of dC (streaming: and of V)
      mlstm_tc_load_rows<T, BV, BK, kThreads, kDv>(Ds, Dg + (kDkPart ? ib * BV : ib * BK * kDv), 0, BK, tid);
      if (kStream) mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Vs, v + ib * BV, s0, S, tid);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
#pragma unroll 2
    for (int kk = 0; kk < (kDkPart ? BV : BK) / 16; ++kk) {
      unsigned a[4];
      ldmatrix_x4(a, kDkPart ? frag_a(Vs, HS, warp * 16, (kStream ? 0 : ib * BV) + kk * 16, lane)
                             : frag_a(Ks, KS, warp * 16, ib * BK + kk * 16, lane));
      mma_row<T, NA, !kDkPart>(acc, a, Ds, VS, kk * 16, lane);
    }
  }
  mma_scale_rows(acc, wa, wb);

  const int pos_a = static_cast<int>(s0 - cs) + ra, pos_b = pos_a + 8;  // the keys' positions in the chunk
  for (long long t0 = s0; t0 < ce; t0 += R) {
    const int j = static_cast<int>((t0 - s0) / R);
    T* Qt = q_buf(j);
    T* Ht = h_buf(j);
    const float* bmt = bm_buf(j);
    const float* rdt = rd_buf(j);
    if (!kPrefetch || (!kDouble && t0 > s0)) {
      __syncthreads();  // every warp is done with the last query tile (looping: with dC)
      load_query_tile(t0, j);
      cp_async_wait<0>();
    } else if (kDouble && t0 + R < ce) {
      // Every warp is done with the buffers tile j + 1 goes to (dC's after the inter term, else tile j - 1's).
      __syncthreads();
      load_query_tile(t0 + R, j + 1);
      cp_async_wait<1>();  // tile j's group, every group but the newest
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // Scores with the keys as rows: K Q^T (for dv) or V dH^T (for dk); B = the query tile, [n][k].
    // Streaming, V dH^T is summed over DHHV's blocks, V's and dH's loaded a block at a time.
    float sc[NK][4];
    mma_zero(sc);
#pragma unroll 1
    for (int eb = 0; eb < (kStream ? kEB : 1); ++eb) {
      if (eb > 0) {
        __syncthreads();  // every warp is done with the last blocks of V and dH
        mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Vs, v + eb * BV, s0, S, tid);
        mlstm_tc_load_rows<T, BV, R, kThreads, kDv>(Ht, dh + eb * BV, t0, S, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      }
#pragma unroll 2
      for (int kk = 0; kk < (kDkPart ? HW : KW) / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, kDkPart ? frag_a(Vs, HS, warp * 16, kk * 16, lane) : frag_a(Ks, KS, warp * 16, kk * 16, lane));
        if (kDkPart) mma_row<T, NK, false>(sc, a, Ht, HS, kk * 16, lane);
        else mma_row<T, NK, false>(sc, a, Qt, KS, kk * 16, lane);
      }
    }
    const int tpos = static_cast<int>(t0 - cs);
#pragma unroll
    for (int nt = 0; nt < NK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * cq + e % 2;  // the query row in the tile
        const bool upper = e < 2;
        sc[nt][e] = tpos + col >= (upper ? pos_a : pos_b)
                        ? sc[nt][e] * scale * __expf(bmt[col] + (upper ? iba : ibb)) * rdt[col]
                        : 0.0f;
      }
#pragma unroll
    for (int kk = 0; kk < R / 16; ++kk) {  // dv += S^T dH, dk += dS^T Q: B = the query tile, [k][n]
      unsigned a[4];
      scores_as_a<T, NK>(a, sc, kk);
      if (kDkPart) mma_row<T, NA, true>(acc, a, Qt, KS, kk * 16, lane);
      else mma_row<T, NA, true>(acc, a, Ht, HS, kk * 16, lane);
    }
  }
  constexpr int kW = kDkPart ? kDk : kDv;
  if (kReduced) {  // part: this CTA's block of the dim the gradient contracts
    const long long seqs = at.tiles / QT, part = kDkPart ? blk.e0 / BV : blk.d0 / BK;
    mlstm_tc_store_part<NA, kW>(acc, p.part + kPartAt * seqs * S + (part * seqs + seq) * S * kW, sa, sb, S,
                                kDkPart ? blk.d0 : blk.e0, cq);
    return;
  }
  T* out = static_cast<T*>(kDkPart ? p.dk : p.dv) + seq * S * kW + (kDkPart ? blk.d0 : blk.e0);
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
    if (cq == 0) {  // streaming: this DHQK block's part of k . dk
      float* kdk = p.kdk + ((kStream ? blk.d0 / BK : 0) * (at.tiles / QT) + seq) * S;
      if (sa < S) kdk[sa] = da;
      if (sb < S) kdk[sb] = db;
    }
  }
}

// kLoop (dk only, as the dq kernel's): loops over DHHV's blocks (grid.y: DHQK's single block).
template <typename T, int kDk, int kDv, int kChunk, bool kDkPart, bool kLoop>
__global__ void __launch_bounds__(mlstm_tc_out_threads(kChunk), 1) mlstm_tc_dkv_kernel(const MlstmParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  mlstm_tc_dkv_tile<T, kDk, kDv, kChunk, kDkPart, mlstm_tc_out_threads(kChunk), 0, kLoop>(
      p, smem_raw, threadIdx.x, threadIdx.x / 32, {blockIdx.x, gridDim.x, static_cast<int>(blockIdx.y)});
}

// algo=tc_fused: dv (warps 0-3) and dk (warps 4-7) of a key tile in one CTA of 8 warps, so its K, V, dC,
// Q and dH tiles are read once instead of twice (tools/bench/NOTES.md, "the tensor-core backward's
// bytes": 478 MB of the 1.9 GB the backward reads at 8x8x4096, 128 x 128) and one launch goes. The
// groups run the same loop (the same barriers, reached from their own code: sm_70+ counts arrivals per
// thread). The dk partials sit after the dv ones where both are summed.
template <typename T, int kDk, int kDv, int kChunk>
__global__ void __launch_bounds__(2 * mlstm_tc_out_threads(kChunk), 1) mlstm_tc_dkv_fused_kernel(const MlstmParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kThreads = 2 * mlstm_tc_out_threads(kChunk), kWarps = kThreads / 64;
  constexpr int kDkAt = mlstm_tc_bwd_reduced(kDk, kDv, kMlstmGradDv) ? mlstm_tc_bwd_parts(kDk, kDv, kMlstmGradDv) * kDv : 0;
  const int warp = threadIdx.x / 32;
  const MlstmTcTile at{blockIdx.x, gridDim.x, static_cast<int>(blockIdx.y)};
  if (warp < kWarps)
    mlstm_tc_dkv_tile<T, kDk, kDv, kChunk, false, kThreads, 0>(p, smem_raw, threadIdx.x, warp, at);
  else
    mlstm_tc_dkv_tile<T, kDk, kDv, kChunk, true, kThreads, kDkAt>(p, smem_raw, threadIdx.x, warp - kWarps, at);
}

// ---- algo=tc_merged: both state scans in one launch, dq, dv and dk in one launch ----

// The forward's state scan (C entering each chunk: blockIdx.z 0, `fwd`) and the reversed one (dC after
// each chunk: blockIdx.z 1, `rev`) in one grid. They are independent (K, V against Q, dH) and each CTA walks
// every chunk of its sequence in turn, so in two launches the reversed scan waited for the forward's last,
// partly filled wave; in one, its CTAs take the SMs the forward's leave idle.
template <typename T, int kDk, int kDv, int kChunk, int kTile = 64>
__global__ void __launch_bounds__(mlstm_tc_state_threads(kDk, kTile))
    mlstm_tc_states_kernel(const MlstmParams fwd, const MlstmParams rev) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (blockIdx.z == 0) mlstm_tc_state<T, kDk, kDv, kChunk, false, kTile>(fwd, smem_raw);
  else mlstm_tc_state<T, kDk, kDv, kChunk, true, kTile>(rev, smem_raw);
}

// dq (from C entering the chunks: `pq`), dv and dk (from dC after them: `pkv`) of every 64-row tile in one
// launch, the CTAs of a tile consecutive (blockIdx.x = tile * roles + role; roles: dq's DHQK blocks, dv's
// DHHV blocks, dk's DHQK blocks), each running the separate kernels' code. The three read the same Q, K, V
// and dH tiles: run one after the other, each kernel read them from DRAM again (4 x 67 MB at 8x8x4096,
// 128 x 128, three times); side by side, the first CTA of a tile brings them to L2 for the others
// (tools/bench/NOTES.md, "algo=tc_merged"). Where no gradient has partial sums (mlstm_tc_merged_runs):
// DHQK <= 128 (algo=tc_merged), or DHQK > 128 with dq and dk streaming DHHV's blocks (algo=tc_stream).
// kPrefetch (algo=tc_overlap, params.h mlstm_tc_overlap_runs): each role's second load group (dq's first key
// tile, dv's and dk's first query tile) in flight during its inter-chunk term.
template <typename T, int kDk, int kDv, int kChunk, bool kPrefetch = false>
__global__ void __launch_bounds__(mlstm_tc_out_threads(kChunk), 1)
    mlstm_tc_grads_kernel(const MlstmParams pq, const MlstmParams pkv) {
  // dq and dk contract all of DHHV (looping at DHQK <= 128 < DHHV, streaming at DHQK > 128), dv all of
  // DHQK (looping at DHQK > 128).
  constexpr bool kLoopQK = mlstm_tc_dq_loops(kDk, kDv) || mlstm_tc_streams(kDk), kLoopV = mlstm_tc_dv_loops(kDk);
  constexpr int kThreads = mlstm_tc_out_threads(kChunk), kEBlocks = kDv / mlstm_tc_bwd_block(kDv);
  constexpr int kQ = mlstm_tc_dq_blocks(kDk, kDv, true, true), kV = mlstm_tc_dv_blocks(kDk, kDv);
  constexpr int kRoles = mlstm_tc_grads_roles(kDk, kDv);
  static_assert(kV == kEBlocks && kRoles == 2 * kQ + kV, "dq and dk a CTA per DHQK block, dv per DHHV block");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int role = static_cast<int>(blockIdx.x % kRoles), warp = threadIdx.x / 32;
  const long long tile = blockIdx.x / kRoles, tiles = gridDim.x / kRoles;
  // Block indices as MlstmTcBwdBlock reads them: DHQK block * DHHV blocks + DHHV block.
  static_assert(!kPrefetch || mlstm_tc_overlap_runs(kDk, kDv), "prefetching: one column block");
  if (role < kQ)
    mlstm_tc_dq_tile<T, kDk, kDv, kChunk, kLoopQK, kPrefetch>(pq, smem_raw, {tile, tiles, role * kEBlocks});
  else if (role < kQ + kV)
    mlstm_tc_dkv_tile<T, kDk, kDv, kChunk, false, kThreads, 0, kLoopV, kPrefetch>(pkv, smem_raw, threadIdx.x, warp,
                                                                                 {tile, tiles, role - kQ});
  else
    mlstm_tc_dkv_tile<T, kDk, kDv, kChunk, true, kThreads, 0, kLoopQK, kPrefetch>(
        pkv, smem_raw, threadIdx.x, warp, {tile, tiles, (role - kQ - kV) * kEBlocks});
}

// ---- the sum of the partials (head dims over 128) ----

// One warp per row of dq (kGrad kMlstmGradDq), dv or dk: the parts added in their order in fp32, rounded
// once to T, and for dq, dk the row's dot with q, k (q . dq, k . dk for df and di) from the fp32 sum.
// Grid: seqs * ceil(S / 4) CTAs of 4 warps.
template <typename T, int kDk, int kDv, int kGrad>
__global__ void __launch_bounds__(128) mlstm_tc_reduce_kernel(const MlstmParams p) {
  constexpr int kW = kGrad == kMlstmGradDv ? kDv : kDk, kParts = mlstm_tc_bwd_parts(kDk, kDv, kGrad);
  const long long S = p.seqlen, tiles = (S + 3) / 4, seq = blockIdx.x / tiles, seqs = gridDim.x / tiles;
  const long long t = (blockIdx.x % tiles) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= S) return;  // a whole warp: the shuffles below stay full
  const long long row = seq * S + t;
  T* out = static_cast<T*>(kGrad == kMlstmGradDq ? p.dq : kGrad == kMlstmGradDk ? p.dk : p.dv) + row * kW;
  const T* src = static_cast<const T*>(kGrad == kMlstmGradDq ? p.q : p.k) + row * kW;
  float dot = 0.0f;
  for (int c = 2 * lane; c < kW; c += 64) {
    float x = 0.0f, y = 0.0f;
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      const float2 v = *reinterpret_cast<const float2*>(p.part + (j * seqs * S + row) * kW + c);
      x += v.x, y += v.y;
    }
    *reinterpret_cast<unsigned*>(out + c) = pack2<T>(x, y);
    if (kGrad != kMlstmGradDv) dot += dot2<T>(*reinterpret_cast<const unsigned*>(src + c), x, y);
  }
  if (kGrad == kMlstmGradDv) return;
  dot = warp_reduce_sum(dot);
  if (lane == 0) (kGrad == kMlstmGradDq ? p.qdq : p.kdk)[row] = dot;
}

// ---- di, df: one warp per sequence, from the end ----

// kDotParts: q . dq and k . dk as that many partial dots per row (one per DHQK block, algo=tc_stream:
// params.h mlstm_tc_dot_parts), added in block order.
template <typename TG, int kDk, int kDv, int kDotParts = 1>
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
  const long long part = gridDim.x * S;  // one partial dot of every row
  const float* qdq = p.qdq + seq * S;
  const float* kdk = p.kdk + seq * S;
  auto qk = [&](long long t) {  // q_t . dq_t - k_t . dk_t, and k_t . dk_t for di
    float x = 0.0f, y = 0.0f;
#pragma unroll
    for (int j = 0; j < kDotParts; ++j) x += qdq[j * part + t], y += kdk[j * part + t];
    return make_float2(x - y, y);
  };
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  TG* di = static_cast<TG*>(p.di) + seq * S;
  TG* df = static_cast<TG*>(p.df) + seq * S;
  // A lane owns one of 32 consecutive segments: its sum, the sums of the later segments (a reverse
  // scan over lanes), then its steps from its end down, each lane's loads independent of the others.
  const long long seg = (S + 31) / 32, lo = lane * seg < S ? lane * seg : S, hi = lo + seg < S ? lo + seg : S;
  float own = 0.0f;
#pragma unroll 4
  for (long long t = lo; t < hi; ++t) own += qk(t).x;
  float later = own;  // sum over lanes >= this one
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float y = __shfl_down_sync(0xffffffffu, later, off);
    if (lane + off < 32) later += y;
  }
  float da = run + later - own;
#pragma unroll 4
  for (long long t = hi - 1; t >= lo; --t) {
    const float2 x = qk(t);
    da += x.x;
    const float d = (t == 0 && !p.C0) ? 0.0f : da;  // step 0 without a state: a_0 scales nothing
    df[t] = from_float<TG>(d / (1.0f + expf(to_float(fp[t]))));
    di[t] = from_float<TG>(x.y);
  }
}

}  // namespace kspec
