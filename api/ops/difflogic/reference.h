// Float64 CPU reference for differentiable logic gate networks (difflogic, NeurIPS 2022; issue 30): the
// soft, hard and straight-through layer, its backward through a consumers-per-input CSR, GroupSum, and
// bit-packed inference. The spec the GPU kernels and the Python twin (python/kspec/reference/difflogic.py)
// are tested against.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace kspec::ref {

// Gate op i is the truth table i = 8 f(0,0) + 4 f(0,1) + 2 f(1,0) + f(1,1) (0 FALSE, 1 AND, ..., 6 XOR,
// 14 NAND, 15 TRUE). difflogic_op(i, a, b) is its multilinear extension written out as the issue lists it
// (1 ab, 2 a - ab, ...): the form the layer's T-form below is tested against.
constexpr int kDiffLogicOps = 16;
double difflogic_op(int i, double a, double b);
// f_i(u, v) for u, v in {0, 1}: bit 3 - (2u + v) of i.
int difflogic_truth(int i, int u, int v);

// Per gate T = p . truth table: {T00, T01, T10, T11}, so y = sum_uv T_uv P(a = u) P(b = v) with
// P(a = 1) = a, P(a = 0) = 1 - a. Soft: p = softmax(logits). Hard: p one-hot at the argmax, ties to the
// lower index. logits: [n_out, 16]; returns [n_out, 4].
enum class DiffLogicMode { Soft, Hard };
std::vector<double> difflogic_tables(const std::vector<double>& logits, int64_t n_out, DiffLogicMode mode);
// The argmax per gate (ties to the lower index): the op hard mode and packed inference run.
std::vector<int> difflogic_hard_ops(const std::vector<double>& logits, int64_t n_out);

// Gumbel noise for the straight-through estimator (hard forward, soft backward; "Mind the Gap", NeurIPS
// 2025): the layer then runs on logits + G, both directions with one G. Counter-based: Philox4x32-10
// (Salmon et al., SC 2011) with key (seed low 32 bits, seed high) and counter (g low, g high, i / 4, 0);
// word i mod 4 of its output r gives U = ((r >> 8) + 0.5) 2^-24 in (0, 1) (exact in fp32, so the kernel's U
// is this one) and G[g, i] = -log(-log U). Returns G [n_out, 16].
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
std::vector<double> difflogic_gumbel_noise(int64_t n_out, uint64_t seed);

// Who reads input j: entries[offsets[j] .. offsets[j+1]) are 2 g + side (side 0: wire a, 1: wire b),
// ascending. dx[:, j] sums its readers in exactly this order (a gate with a[g] = b[g] appears twice:
// da + db). Built once per wiring.
struct DiffLogicConsumers {
  std::vector<int64_t> offsets;  // [n_in + 1]
  std::vector<int64_t> entries;  // [2 n_out]
};

// Every function below throws std::invalid_argument naming the argument when a size disagrees, a wire
// is outside [0, n_in), or a parameter is out of range.
DiffLogicConsumers difflogic_consumers(int64_t n_in, const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// y[s, g] = sum_uv T_uv(g) P(x[s, a_g] = u) P(x[s, b_g] = v). x: [B, n_in]; logits: [n_out, 16] with
// n_out = a.size() = b.size(); y: [B, n_out]. The straight-through estimator's forward is Hard.
std::vector<double> difflogic_layer_fwd_ref(int64_t B, int64_t n_in, const std::vector<double>& x,
                                            const std::vector<double>& logits, const std::vector<int32_t>& a,
                                            const std::vector<int32_t>& b, DiffLogicMode mode);

// The soft layer's gradients of sum(dout * y): dlogits[g, i] = sum_s dout[s, g] p_i (op_i - y[s, g]), and
// dx = grad_factor * sum over the readers of each input (da = dout dy/da, db = dout dy/db). It is also
// the straight-through estimator's backward (hard forward, soft backward). Hard mode has no backward
// (its logits gradient is zero almost everywhere).
struct DiffLogicGrads {
  std::vector<double> dx;       // [B, n_in]
  std::vector<double> dlogits;  // [n_out, 16]
};
DiffLogicGrads difflogic_layer_bwd_ref(int64_t B, int64_t n_in, const std::vector<double>& x,
                                       const std::vector<double>& logits, const std::vector<int32_t>& a,
                                       const std::vector<int32_t>& b, const std::vector<double>& dout,
                                       double grad_factor = 1.0);

// GroupSum(k, tau): x [B, n] with k dividing n, y[s, c] = sum_{j in [c n/k, (c+1) n/k)} x[s, j] / tau.
std::vector<double> difflogic_group_sum_ref(int64_t B, int64_t n, const std::vector<double>& x, int64_t k,
                                            double tau);
// Its backward: dx[s, j] = dy[s, j / (n/k)] / tau.
std::vector<double> difflogic_group_sum_bwd_ref(int64_t B, int64_t n, const std::vector<double>& dy, int64_t k,
                                                double tau);

// Bit-packing, w = 32 or 64: {0, 1} x [B, n] -> words [n, ceil(B / w)], sample s in bit s mod w of word
// s / w (a 32-bit word in the low half of each uint64_t). Padding bits (s >= B) are zero. x values other
// than exactly 0 and 1 are refused.
// What difflogic.pack packs: 1 where x > 0.5, else 0 (NaN: 0). {0, 1} inputs pass unchanged; the
// output of a hard layer is {0, 1}, a soft one's rounds to its nearer corner.
std::vector<double> difflogic_binarize(const std::vector<double>& x);
std::vector<uint64_t> difflogic_pack_ref(int64_t B, int64_t n, const std::vector<double>& x, int w);
std::vector<double> difflogic_unpack_ref(int64_t B, int64_t n, const std::vector<uint64_t>& words, int w);

// One layer on packed words: out[g] = (f00 & ~A & ~B) | (f01 & ~A & B) | (f10 & A & ~B) | (f11 & A & B),
// A = words[a_g], B = words[b_g], f_uv all ones where op g's truth table is 1; padding bits cleared, so
// every output is again a canonical packing. ops: [n_out] in [0, 16).
std::vector<uint64_t> difflogic_packed_fwd_ref(int64_t B, int64_t n_in, const std::vector<uint64_t>& words, int w,
                                               const std::vector<int>& ops, const std::vector<int32_t>& a,
                                               const std::vector<int32_t>& b);

// Packed GroupSum: counts[s, c] = number of set bits of sample s over group c's n/k rows.
std::vector<int64_t> difflogic_packed_group_sum_ref(int64_t B, int64_t n, const std::vector<uint64_t>& words, int w,
                                                    int64_t k);

// ---- DiffLogic cellular automaton (issue 30, as the published notebook) ----
// state [B, H, W, C]. Perception of a cell: for every channel c, the 3x3 patch of channel c around the
// cell (row-major, index 3 (dy + 1) + (dx + 1), centre 4; outside the grid 0 (zero-padded) or wrapped
// (periodic)) runs through K perception kernels. Kernel k is a logic network whose first layer has 8
// gates, gate g reading (patch[perm[g]], patch[4]) (perm: the neighbours in some order), and whose
// further layers have the wiring `perception` shared by all kernels; every kernel has logits of its own.
// Its last layer's P outputs are placed at c P K + bit K + k. The update network runs on
// [state (C) | perception (C P K)] with the layers `update` (last width C); its outputs replace the cell's
// state where fire[b, h, w] is 1 (no mask: everywhere). One step; a rollout repeats it.
struct DiffLogicLayerWires {
  std::vector<int32_t> a, b;  // [width] each; the layer's n_in is the previous layer's width
};
struct DiffLogicCa {
  int64_t C = 0, K = 0;
  bool periodic = false;
  std::vector<int32_t> perm;                     // [8], patch indices in [0, 9)
  std::vector<DiffLogicLayerWires> perception;   // the layers after the first (n_in of the first: 8)
  std::vector<DiffLogicLayerWires> update;       // n_in of the first: C + C P K; last width C
};
// perception[l]: [K, width_l, 16] (l = 0: the 8-gate first layer); update[l]: [width_l, 16].
struct DiffLogicCaLogits {
  std::vector<std::vector<double>> perception, update;
};
// fire: [B, H, W] of 0 / 1, or nullptr. Returns the new state [B, H, W, C].
std::vector<double> difflogic_ca_step_ref(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W,
                                          const std::vector<double>& state, const DiffLogicCaLogits& logits,
                                          const std::vector<double>* fire, DiffLogicMode mode);
// Gradients of sum(dnew * new_state) of the soft step: the state's (through the kept cells, the update
// network's input and every neighbour's perception) and every layer's logits.
struct DiffLogicCaGrads {
  std::vector<double> dstate;
  DiffLogicCaLogits dlogits;
};
DiffLogicCaGrads difflogic_ca_step_bwd_ref(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W,
                                           const std::vector<double>& state, const DiffLogicCaLogits& logits,
                                           const std::vector<double>* fire, const std::vector<double>& dnew);

}  // namespace kspec::ref
