// The argument of every mLSTM kernel (templates/mlstm/*.cuh), one plain struct compiled by both the host
// compiler (api/ops/mlstm/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout.
// Passed by value. Tensors are contiguous, [B, NH, ...] flattened to sequences seq = b * NH + h.
#pragma once

namespace kspec {

struct MlstmParams {
  const void *q, *k, *v;  // [seqs, S, DHQK], [seqs, S, DHQK], [seqs, S, DHHV]: the input dtype
  const void *i, *f;      // [seqs, S] gate pre-activations: the input dtype or float
  const float *C0, *n0, *m0;  // the states entering: [seqs, DHQK, DHHV], [seqs, DHQK], [seqs] (null: zeros)
  void* h;                    // [seqs, S, DHHV], the input dtype
  float *nrm, *m_rows;        // [seqs, S]: max(|s q.n|, e^-m) and m per step, for the backward (null: not kept)
  float *C, *n, *m;           // the states after the last step (for the chunkwise kernels their running state)
  long long seqlen;           // S (1 for the step)
  float eps;
  // m entering the first step when m0 is null: 0 for the recurrence (chunkwise, step), -inf for the
  // parallel form (no state: the first step's max is i_0 alone), which is otherwise the same function.
  float m_init;
  // Backward (mlstm_chunkwise_bwd_kernel): nrm, m_rows above are its inputs (the forward's constants).
  const void* dh;          // [seqs, S, DHHV], the input dtype
  const float* dC_last;    // [seqs, DHQK, DHHV] (null: zero)
  void *dq, *dk, *dv;      // like q, k, v
  void *di, *df;           // like i
  float* qdq;              // [seqs, S] workspace: q_t . dq_t in fp32, from the forward pass to df's
                           // (algo=tc_stream at DHQK > 128: [DHQK / 128][seqs, S], one part per DHQK block)
  // algo=tc (chunkwise_tc.cuh): what its gates and state kernels leave in the workspace for the output
  // kernel (NC = ceil(S / L) chunks; m_rows above is then always set, to the output or the workspace).
  float* gate_rows;  // [seqs, S, 4]: b_t - m_t, i_t - b_t, g_t = e^(b_t + m - m_t), w_t = e^(b_L - b_t + i_t - m_L)
                     // (mlstm.step algo=split: [seqs, kMlstmStepScalars], decay, gain, normalizer; step.cuh)
  float* chunk_g;    // [seqs, NC]: e^(b_L + m - m_L), the decay of the state carried over each chunk
  void* Cs;          // [seqs, NC, DHQK, DHHV] in the input dtype: C entering each chunk
  float* ns;         // [seqs, NC, DHQK]: n entering each chunk
  float* kdk;        // backward: [seqs, S] k_t . dk_t in fp32 (qdq above: q_t . dq_t, and parted alike), for df
  // backward at head dims > 128: [parts, seqs, S, D] fp32 partial sums of dq, dv or dk over the column
  // blocks of the dim they contract (mlstm_tc_bwd_parts), summed in a fixed order by the reduce kernel.
  float* part;
};

// mlstm.step algo=split: floats a sequence of the gates kernel's scalars for the slab kernel (3 used,
// padded to 16 bytes).
constexpr int kMlstmStepScalars = 4;

// Dynamic shared memory of mlstm_chunkwise_fwd_kernel in floats: S (chunk x chunk), six vectors of
// chunk floats and two scalars.
constexpr int mlstm_chunkwise_fwd_smem_floats(int chunk) { return chunk * chunk + 6 * chunk + 2; }

// Dynamic shared memory of mlstm_chunkwise_bwd_kernel in floats: two chunk x chunk matrices, seven
// vectors of chunk floats, two scalars and a block sum's scratch (up to 32 warps).
constexpr int mlstm_chunkwise_bwd_smem_floats(int chunk) { return 2 * chunk * chunk + 7 * chunk + 2 + 32; }

// algo=tc's tiles (chunkwise_tc.cuh), shared with the host's launcher. Output kernel: query rows and keys
// per tile (16 per warp), h columns per CTA. State kernel: a C tile of (state_tile(DHQK) x
// state_tile(DHHV)), 16 rows per warp. Shared rows are padded by 8 elements (16 bytes), so the 8 row
// addresses of an ldmatrix fall in distinct banks.
constexpr int mlstm_tc_rows(int chunk) { return chunk < 64 ? chunk : 64; }
constexpr int mlstm_tc_bv(int dv) { return dv < 128 ? dv : 128; }
// `tile`: the state kernel's C tile edge, 64 (algo=tc), or kMlstmTcWideTile (algo=tc_wide).
constexpr int mlstm_tc_state_tile(int dh, int tile = 64) { return dh < tile ? dh : tile; }
constexpr int kMlstmTcPad = 8;
constexpr int mlstm_tc_out_threads(int chunk) { return mlstm_tc_rows(chunk) * 2; }
constexpr int mlstm_tc_state_threads(int dk, int tile = 64) { return mlstm_tc_state_tile(dk, tile) * 2; }
// algo=tc_wide (forward and backward): the state scans on C tiles of 128 x 128 (8 warps, 64 fp32
// accumulators a thread) instead of 64 x 64. Each CTA requests its K (Q) slice once per 128 columns of
// DHHV instead of per 64 and its V (dH) slice once per 128 rows of DHQK: at (256, 512) the scans' 2.1 GB
// of requests at 8x8x4096, chunk 128, become 1.1 GB, in 512 CTAs instead of 2048 (tools/bench/NOTES.md).
// Only where both head dims are >= 128 (fewer, not wider, CTAs below) and chunk <= 128 (two stages of
// 128-wide K and V slices: 137 KB at 128, 274 KB at 256).
constexpr int kMlstmTcWideTile = 128;
constexpr bool mlstm_tc_wide_runs(int dk, int dv, int chunk) { return dk >= 128 && dv >= 128 && chunk <= 128; }
// The output kernel's C tile, then K and V tiles, share one region.
constexpr int mlstm_tc_out_region_elems(int dk, int dv, int chunk) {
  return dk * (mlstm_tc_bv(dv) + kMlstmTcPad) >
                 mlstm_tc_rows(chunk) * (dk + kMlstmTcPad) + mlstm_tc_rows(chunk) * (mlstm_tc_bv(dv) + kMlstmTcPad)
             ? dk * (mlstm_tc_bv(dv) + kMlstmTcPad)
             : mlstm_tc_rows(chunk) * (dk + kMlstmTcPad) + mlstm_tc_rows(chunk) * (mlstm_tc_bv(dv) + kMlstmTcPad);
}
// Dynamic shared memory in bytes (16-bit elements): Q tile (`qrows` rows; 0: mlstm_tc_rows(chunk)), the
// region, a second K and V buffer, then in fp32 i_s - b_s of a chunk and its entering n.
constexpr int mlstm_tc_out_smem_bytes(int dk, int dv, int chunk, int qrows = 0) {
  return 2 * ((qrows ? qrows : mlstm_tc_rows(chunk)) * (dk + kMlstmTcPad) + mlstm_tc_out_region_elems(dk, dv, chunk) +
              mlstm_tc_rows(chunk) * (dk + kMlstmTcPad) + mlstm_tc_rows(chunk) * (mlstm_tc_bv(dv) + kMlstmTcPad)) +
         4 * (chunk + dk);
}
// algo=tc_q128 and tc_wide_q128 (forward): the output kernel's CTA takes 128 query rows (8 warps) instead of
// 64, its key tiles still 64 rows: the chunk's C tile and each key tile come once for twice the queries
// (at chunk 128 a CTA is a whole chunk), and a CTA of 8 warps fills an SM where the 64-row CTA's 156 KB of
// shared memory at DHQK 256 let only 4 warps run (tools/bench/NOTES.md). Chunks that are multiples of 128.
constexpr int kMlstmTcWideRows = 128;
constexpr bool mlstm_tc_q128_runs(int chunk) { return chunk % kMlstmTcWideRows == 0; }
// Two stages of a chunk's K and V slices, and of its w_t.
constexpr int mlstm_tc_state_smem_bytes(int dk, int dv, int chunk, int tile = 64) {
  return 2 * 2 * chunk * (mlstm_tc_state_tile(dk, tile) + mlstm_tc_state_tile(dv, tile) + 2 * kMlstmTcPad) +
         2 * 4 * chunk;
}

// The backward (chunkwise_tc_bwd.cuh), 4 warps for 64 rows like the output kernel. Head dims over 128
// are cut into column blocks of 128 (one CTA each, blockIdx.y = DHQK block * DHHV blocks + DHHV block),
// so a CTA's tiles and accumulators are those of a 128 x 128 problem: the dq kernel holds Q, dH, the
// chunk's C, a K and a V tile; the dk/dv kernels their own K and V tiles, the chunk's dC, a Q and a dH
// tile; both take the chunk's i_s - b_s.
constexpr int mlstm_tc_bwd_block(int dh) { return dh < 128 ? dh : 128; }
constexpr int mlstm_tc_bwd_blocks(int dk, int dv) { return (dk / mlstm_tc_bwd_block(dk)) * (dv / mlstm_tc_bwd_block(dv)); }
constexpr int mlstm_tc_bwd_smem_bytes(int dk, int dv, int chunk) {
  return 2 * (2 * mlstm_tc_rows(chunk) * (mlstm_tc_bwd_block(dk) + kMlstmTcPad) +
              2 * mlstm_tc_rows(chunk) * (mlstm_tc_bwd_block(dv) + kMlstmTcPad) +
              mlstm_tc_bwd_block(dk) * (mlstm_tc_bwd_block(dv) + kMlstmTcPad)) +
         4 * (chunk + 2 * mlstm_tc_rows(chunk));
}
// The backward's three gradients of q, k, v (kMlstmGradDq: contracts DHHV; kMlstmGradDv: DHQK;
// kMlstmGradDk: DHHV): a CTA's result is a partial sum over its block of the contracted dim, and
// dq, dk also need the whole row for q . dq, k . dk. Where there is more than one block, fp32 partials go
// to MlstmParams::part and mlstm_tc_reduce_kernel sums them in the order of the parts (no atomics),
// except dv over a single DHQK block (no sum, no dot: written directly).
enum MlstmGrad { kMlstmGradDq = 0, kMlstmGradDv = 1, kMlstmGradDk = 2 };
constexpr int mlstm_tc_bwd_parts(int dk, int dv, int grad) {
  return grad == kMlstmGradDv ? dk / mlstm_tc_bwd_block(dk) : dv / mlstm_tc_bwd_block(dv);
}
// dq where DHQK is one block (<= 128) and DHHV several: one CTA per query tile loops over DHHV's
// blocks itself (its dH tile at full width, C and V a block at a time), so dq needs no fp32 partials and
// no reduce kernel (tools/bench/NOTES.md, "the backward at (128, 256)"). dk alike in algo=tc's own dk
// kernel (not algo=tc_fused, whose CTA shares its tiles with dv's DHHV block): its V and dH tiles DHHV
// wide, dC a block at a time. `loop` false: algo=tc_parts, the CTA per block with partials (as before,
// kept to compare). The functions below take the shape's loop (mlstm_tc_dq_loops(dk, dv) && loop).
constexpr bool mlstm_tc_dq_loops(int dk, int dv) { return dk <= 128 && dv > 128; }
// dv where DHQK has several blocks (algo=tc_merged; `dv_loop` below): its CTA per (key tile, DHHV block)
// loops over DHQK's blocks itself, its K and query tiles' Q DHQK wide (the scores K Qᵀ formed once over
// the whole DHQK, not as a partial per block), dC a block at a time: no fp32 partials, no reduce kernel.
constexpr bool mlstm_tc_dv_loops(int dk) { return dk > 128; }
// dq and dk where DHQK has several blocks (algo=tc_stream; `stream` below): their CTA per (tile, DHQK
// block) loops over DHHV's blocks too, but takes dH (and dk its V) a block at a time with C, dC and V
// (the DHHV-wide tiles of the loops above would be 512 wide at (256, 512), one CTA an SM); q . dq and
// k . dk then come as one partial dot per DHQK block (fp32, MlstmParams::qdq and kdk [DHQK blocks][seqs,
// S]), which the df kernel adds in block order. No fp32 partials of dq or dk, no reduce kernels.
constexpr bool mlstm_tc_streams(int dk) { return dk > 128; }
// Whether a dq or dk CTA contracts all of DHHV: algo=tc's loop (DHQK <= 128 < DHHV) or streaming.
constexpr bool mlstm_tc_qk_loops(int dk, int dv, bool loop, bool stream) {
  return (loop && mlstm_tc_dq_loops(dk, dv)) || (stream && mlstm_tc_streams(dk));
}
constexpr bool mlstm_tc_bwd_reduced(int dk, int dv, int grad, bool fused = false, bool loop = true,
                                    bool dv_loop = false, bool stream = false) {
  return mlstm_tc_bwd_blocks(dk, dv) > 1 && (grad != kMlstmGradDv || mlstm_tc_bwd_parts(dk, dv, grad) > 1) &&
         !(loop && grad == kMlstmGradDq && mlstm_tc_dq_loops(dk, dv)) &&
         !(loop && grad == kMlstmGradDk && !fused && mlstm_tc_dq_loops(dk, dv)) &&
         !(dv_loop && grad == kMlstmGradDv && mlstm_tc_dv_loops(dk)) &&
         !(stream && grad != kMlstmGradDv && mlstm_tc_streams(dk));
}
// The partial dots q . dq and k . dk a row has (one per DHQK block where dq and dk stream).
constexpr int mlstm_tc_dot_parts(int dk, bool stream) { return stream && mlstm_tc_streams(dk) ? dk / 128 : 1; }
constexpr int mlstm_tc_max(int a, int b) { return a > b ? a : b; }
// The dq kernel's grid.y (its column blocks) and dynamic shared memory: mlstm_tc_bwd_smem_bytes's tiles
// where it does not loop; looping, K, dH (DHHV wide, or streaming a block), V, and C's block, which Q
// reuses at the end.
constexpr int mlstm_tc_dq_blocks(int dk, int dv, bool loop = true, bool stream = false) {
  return mlstm_tc_qk_loops(dk, dv, loop, stream) ? dk / mlstm_tc_bwd_block(dk) : mlstm_tc_bwd_blocks(dk, dv);
}
constexpr int mlstm_tc_dq_smem_bytes(int dk, int dv, int chunk, bool loop = true, bool stream = false) {
  const int R = mlstm_tc_rows(chunk), KS = mlstm_tc_bwd_block(dk) + kMlstmTcPad,
            VS = mlstm_tc_bwd_block(dv) + kMlstmTcPad,
            HS = (stream && mlstm_tc_streams(dk) ? mlstm_tc_bwd_block(dv) : dv) + kMlstmTcPad;
  return !mlstm_tc_qk_loops(dk, dv, loop, stream)
             ? mlstm_tc_bwd_smem_bytes(dk, dv, chunk)
             : 2 * (R * KS + R * HS + R * VS + mlstm_tc_bwd_block(dk) * VS) + 4 * (chunk + 2 * R);
}
// The dk kernel's (algo=tc): grid.y and shared memory; looping, K, V (DHHV wide), then one region for
// dC's block or else a Q and a dH (DHHV wide) tile.
constexpr int mlstm_tc_dk_blocks(int dk, int dv, bool loop = true, bool stream = false) {
  return mlstm_tc_dq_blocks(dk, dv, loop, stream);
}
constexpr int mlstm_tc_dk_smem_bytes(int dk, int dv, int chunk, bool loop = true) {
  const int R = mlstm_tc_rows(chunk), KS = mlstm_tc_bwd_block(dk) + kMlstmTcPad, HS = dv + kMlstmTcPad,
            D = mlstm_tc_bwd_block(dk) * (mlstm_tc_bwd_block(dv) + kMlstmTcPad);
  return !(loop && mlstm_tc_dq_loops(dk, dv)) ? mlstm_tc_bwd_smem_bytes(dk, dv, chunk)
                                    : 2 * (R * KS + R * HS + (D > R * KS + R * HS ? D : R * KS + R * HS)) +
                                          4 * (chunk + 2 * R);
}

// The dv kernel's grid.y and shared memory; looping (DHQK > 128), its DHHV blocks, and K (DHQK wide), then
// one region for dC's block or else a Q (DHQK wide) and a dH tile.
constexpr int mlstm_tc_dv_blocks(int dk, int dv, bool loop = true) {
  return loop && mlstm_tc_dv_loops(dk) ? dv / mlstm_tc_bwd_block(dv) : mlstm_tc_bwd_blocks(dk, dv);
}
constexpr int mlstm_tc_dv_smem_bytes(int dk, int dv, int chunk, bool loop = true) {
  const int R = mlstm_tc_rows(chunk), KS = dk + kMlstmTcPad, VS = mlstm_tc_bwd_block(dv) + kMlstmTcPad,
            D = mlstm_tc_bwd_block(dk) * VS;
  return !(loop && mlstm_tc_dv_loops(dk)) ? mlstm_tc_bwd_smem_bytes(dk, dv, chunk)
                                          : 2 * (R * KS + mlstm_tc_max(D, R * KS + R * VS)) + 4 * (chunk + 2 * R);
}


// algo=tc_merged and tc_stream (chunkwise_tc_bwd.cuh, mlstm_tc_grads_kernel): dq, dv and dk in one launch,
// where no gradient needs partial sums: DHQK <= 128 (dq and dk loop over DHHV's blocks, dv's DHQK is one
// block), or streaming (tc_stream at DHQK > 128: dq and dk stream DHHV's blocks, dv loops over DHQK's).
// A tile's CTAs (its roles): dq's DHQK blocks, dv's DHHV blocks, dk's DHQK blocks; each the shared memory
// of its separate kernel, so the launch takes the largest. At DHQK > 128 algo=tc_merged launches dq, dv and
// dk apart (dq's and dk's partials each summed before the next kernel reuses the buffer), dv looping.
constexpr bool mlstm_tc_merged_runs(int dk, bool stream = false) { return dk <= 128 || stream; }
// algo=tc_overlap and tc_wide_overlap (mlstm_tc_grads_kernel's kPrefetch): tc_merged's (tc_wide's) kernels with
// each role's second load group requested with its first, so it arrives while the inter-chunk term is
// computed (a CTA otherwise waits for two loads in turn: 64 KB, then 32 KB at 128 x 128). Where each tile
// has its own shared buffer: one column block (DHQK and DHHV <= 128).
constexpr bool mlstm_tc_overlap_runs(int dk, int dv) { return mlstm_tc_bwd_blocks(dk, dv) == 1; }
// The gates kernel by warps (chunkwise_tc.cuh, mlstm_tc_gates_warps_kernel: algo=tc_pg forward, tc_overlap and
// tc_wide_overlap backward): a round of this many chunks scanned side by side, one warp each (2 rounds at
// S 4096, chunk 128).
constexpr int kMlstmTcGatesWarps = 16;
constexpr int mlstm_tc_grads_roles(int dk, int dv) {
  return mlstm_tc_dq_blocks(dk, dv, true, true) + mlstm_tc_dv_blocks(dk, dv) + mlstm_tc_dk_blocks(dk, dv, true, true);
}
constexpr int mlstm_tc_grads_smem_bytes(int dk, int dv, int chunk) {
  return mlstm_tc_max(mlstm_tc_dq_smem_bytes(dk, dv, chunk, true, true),
                      mlstm_tc_max(mlstm_tc_dv_smem_bytes(dk, dv, chunk), mlstm_tc_dk_smem_bytes(dk, dv, chunk)));
}

}  // namespace kspec
