// difflogic.ca.step.bwd: the gradients of sum(dnext * next) of one soft CA step (api/ops/difflogic/
// reference.h: difflogic_ca_step_bwd_ref is the spec), the architecture kDiffLogicCaArchs[kArch] compiled
// in, the soft gate tables made once per call (difflogic_tables_kernel). First version, three kernels, no
// atomics, every sum in a fixed order, so a rerun gives the same bits:
//   difflogic_ca_step_bwd_kernel     kDiffLogicCaBwdBlocks blocks (or fewer, one per cell), each taking
//       cells blockIdx.x, + gridDim.x, ... in turn. Per cell the forward is recomputed into shared memory
//       (every layer's output kept), then the layers run backward: per gate da, db (and its S_uv = d P(a = u)
//       P(b = v) added to the block's partials[block][gate], always by the same thread), then per input the
//       sum of its readers' da / db in gate order (a self-paired gate gives da + db), as the layer's CSR
//       orders them. The perception's gradients of the 9 patch values (summed over the kernels in order)
//       and the cell's own-state gradient (kept cells' dnext plus the update network's input) go to dcells.
//   difflogic_ca_step_bwd_gather_kernel  one thread per (cell, channel): its own-state gradient plus the
//       patch gradients of the (up to 9) cells that read it, in patch order: no scatter.
//   difflogic_ca_step_bwd_finish_kernel  one thread per gate: S = the blocks' partials in block order, then
//       dlogits_i = p_i (sum_uv f_i(u, v) S_uv - sum_uv T_uv S_uv), as the layer's backward.
//   kReaders (tuning axis readers = 1): an update layer's input gradient walks each input's readers from a
//       CSR (difflogic_ca_update_readers_kernel, once per call, from the wires) instead of testing every
//       gate of the layer for each input: 2 x 2816 entries a cell for the checkerboard's update network
//       instead of ~700k (input, gate) tests, the main kernel's cost at batch 64 and 256 (run 20: 2.6 ms
//       a batch element a rollout, linear in B, 512 blocks each walking its cells in turn). The readers are
//       in gate order, a before b, as the test loop adds them: the same sums in the same order, same bits.
// Cells are int: the op refuses batch height width >= 2^31 (a 64-bit division is a call with a stack frame).
#pragma once

#include "difflogic/ca.cuh"
#include "difflogic/layer.cuh"

namespace kspec {

// Offset of layer l among a list's widths (the sum of those before it).
constexpr int difflogic_offset(const int* w, int l) {
  int s = 0;
  for (int i = 0; i < l; ++i) s += w[i];
  return s;
}

constexpr int difflogic_max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// d / da and d / db of a gate with tables t at (xa, xb), times d.
__device__ __forceinline__ void difflogic_ca_gate_grad(const float* t, float xa, float xb, float d, float& da,
                                                       float& db) {
  da = d * ((t[2] - t[0]) * (1.0f - xb) + (t[3] - t[1]) * xb);
  db = d * ((t[1] - t[0]) * (1.0f - xa) + (t[3] - t[2]) * xa);
}

// The update network's readers CSR (int32, in the workspace; api/ops/difflogic/ca.cpp sizes it): every
// layer's offsets [n_in_l + 1] (relative to the layer's entries; n_in_0 = C + C P K), layer l's from
// kInputs + offset(l - 1) + l on (0 for l = 0), then every layer's entries [2 width_l] (2 g + side, in gate
// order per input), layer l's from 2 offset(l) on.

// Update layer L's readers, by one block: one thread per input j (and j = n_in for the end): the offset is
// the number of the layer's wires below j, then j's readers in gate order, a before b. A wire outside the
// layer's inputs is no reader (the main kernel gives its gate NaN gradients as before). L is a template
// argument: the first version (an unrolled loop over the layers testing blockIdx.x, helpers taking the
// architecture by reference) had a 112-byte stack frame (the architecture's size) for the tiny one.
template <int kArch, int L, int kThreads>
__device__ __forceinline__ void difflogic_ca_readers_of_layer(const DiffLogicParams& p) {
  constexpr DiffLogicCaArch A = kDiffLogicCaArchs[kArch];
  constexpr int kInputs = A.C + A.C * A.perception[A.n_perception - 1] * A.K;
  constexpr int kWidth = A.update[L], kIn = L == 0 ? kInputs : A.update[L == 0 ? 0 : L - 1];
  constexpr int kWire0 = difflogic_sum_width(A.perception, A.n_perception) - A.perception[0] +
                         difflogic_offset(A.update, L);
  constexpr int kOffsets = kInputs + difflogic_offset(A.update, A.n_update - 1) + A.n_update;
  constexpr int kOff0 = L == 0 ? 0 : kInputs + difflogic_offset(A.update, L == 0 ? 0 : L - 1) + L;
  const int* wa = p.b + kWire0;
  const int* wb = wa + p.wired;
  int* off = static_cast<int*>(p.y) + kOff0;
  int* ent = static_cast<int*>(p.y) + kOffsets + 2 * difflogic_offset(A.update, L);
  for (int j = threadIdx.x; j <= kIn; j += kThreads) {
    int below = 0;
    for (int g = 0; g < kWidth; ++g) {
      const int ia = wa[g], ib = wb[g];
      below += (difflogic_ca_wire_ok(ia, kIn) && ia < j) + (difflogic_ca_wire_ok(ib, kIn) && ib < j);
    }
    off[j] = below;
    if (j == kIn) continue;
    for (int g = 0; g < kWidth; ++g) {
      if (wa[g] == j) ent[below++] = 2 * g;
      if (wb[g] == j) ent[below++] = 2 * g + 1;
    }
  }
}

template <int kArch, int L, int kThreads>
__device__ __forceinline__ void difflogic_ca_readers_dispatch(const DiffLogicParams& p) {
  if constexpr (L < kDiffLogicCaArchs[kArch].n_update) {
    if (static_cast<int>(blockIdx.x) == L)
      difflogic_ca_readers_of_layer<kArch, L, kThreads>(p);
    else
      difflogic_ca_readers_dispatch<kArch, L + 1, kThreads>(p);
  }
}

// One block per update layer (blockIdx.x = l). Writes p.y: the offsets of every layer, then the entries.
template <int kArch, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_ca_update_readers_kernel(const DiffLogicParams p) {
  difflogic_ca_readers_dispatch<kArch, 0, kThreads>(p);
}

template <typename T, int kArch, int kThreads, bool kReaders = false>
__global__ void __launch_bounds__(kThreads) difflogic_ca_step_bwd_kernel(const DiffLogicParams p) {
  constexpr DiffLogicCaArch A = kDiffLogicCaArchs[kArch];
  constexpr int C = A.C, K = A.K, P = A.perception[A.n_perception - 1], kInputs = C + C * P * K;
  constexpr int kPercMax = difflogic_max_width(A.perception, A.n_perception);
  constexpr int kUpdMax = difflogic_max_width(A.update, A.n_update);
  constexpr int kPercGates = difflogic_sum_width(A.perception, A.n_perception);
  constexpr int kUpdGates = difflogic_sum_width(A.update, A.n_update);
  constexpr int kGates = K * kPercGates + kUpdGates;
  // dside: a layer's da, db per gate (per instance in the perception); dbuf: a layer's output gradient
  // and its input gradient (the perception's first layer's input: C K patches of 9).
  constexpr int kSide = 2 * (C * K * kPercMax > kUpdMax ? C * K * kPercMax : kUpdMax);
  constexpr int kD = difflogic_max3(kInputs > kUpdMax ? kInputs : kUpdMax, C * K * 9, C * K * kPercMax);
  __shared__ float patch[C * 9];
  __shared__ float pact[C * K * kPercGates];  // perception layer l: [C K, width_l] from C K offset_l
  __shared__ float uact[kInputs + kUpdGates];  // the update network's input, then each layer's output
  __shared__ float dside[kSide];
  __shared__ float dbuf[2][kD];
  const T* state = static_cast<const T*>(p.x);
  const T* fire = static_cast<const T*>(p.fire);
  const T* dnext = static_cast<const T*>(p.dout);
  const int* wa = p.b;
  const int* wb = p.b + p.wired;
  const float* tables_update = p.tables + 4LL * K * kPercGates;
  constexpr int kPercWires = kPercGates - A.perception[0];  // the update's wires start here
  float* part = p.partials + static_cast<long long>(blockIdx.x) * kGates * 4;
  for (int i = threadIdx.x; i < kGates * 4; i += kThreads) part[i] = 0.0f;
  __syncthreads();
  const int H = static_cast<int>(p.height), W = static_cast<int>(p.width);
  const int cells = static_cast<int>(p.batch * p.height * p.width);
  for (int cell = blockIdx.x; cell < cells; cell += gridDim.x) {
    const int x0 = cell % W, rest = cell / W, y0 = rest % H, bz = rest / H;
    // ---- the forward, every layer kept ----
    for (int t = threadIdx.x; t < C * 9; t += kThreads) {
      const int c = t / 9, q = t % 9;
      int y = y0 + q / 3 - 1, x = x0 + q % 3 - 1;
      if (p.periodic) {
        y = y < 0 ? y + H : y >= H ? y - H : y;
        x = x < 0 ? x + W : x >= W ? x - W : x;
      }
      float v = 0.0f;
      if (y >= 0 && y < H && x >= 0 && x < W) v = to_float(state[((static_cast<long long>(bz) * H + y) * W + x) * C + c]);
      patch[t] = v;
    }
    __syncthreads();
#pragma unroll
    for (int l = 0; l < A.n_perception; ++l) {
      const int width = A.perception[l], n_in = l == 0 ? 9 : A.perception[l - 1];
      const int gate0 = difflogic_offset(A.perception, l), wire0 = gate0 - (l == 0 ? 0 : A.perception[0]);
      float* out = pact + C * K * gate0;
      const float* in = l == 0 ? patch : pact + C * K * difflogic_offset(A.perception, l - 1);
      for (int e = threadIdx.x; e < C * K * width; e += kThreads) {
        const int inst = e / width, g = e - inst * width, c = inst / K, k = inst - c * K;
        const float* t = p.tables + 4LL * (k * kPercGates + gate0 + g);
        const int ia = l == 0 ? p.a[g] : wa[wire0 + g], ib = l == 0 ? 4 : wb[wire0 + g];
        const float* src = l == 0 ? in + c * 9 : in + inst * n_in;
        out[e] = difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in) ? difflogic_ca_gate(t, src[ia], src[ib])
                                                                                  : __int_as_float(0x7fc00000);
      }
      __syncthreads();
    }
    const float* last = pact + C * K * difflogic_offset(A.perception, A.n_perception - 1);
    for (int e = threadIdx.x; e < kInputs; e += kThreads) {
      if (e < C) {
        uact[e] = patch[e * 9 + 4];
      } else {
        const int j = e - C, c = j / (P * K), bit = (j / K) % P, k = j % K;
        uact[e] = last[(c * K + k) * P + bit];
      }
    }
    __syncthreads();
#pragma unroll
    for (int l = 0; l < A.n_update; ++l) {
      const int width = A.update[l], n_in = l == 0 ? kInputs : A.update[l - 1];
      const int ugate0 = difflogic_offset(A.update, l);
      const float* in = l == 0 ? uact : uact + kInputs + difflogic_offset(A.update, l - 1);
      float* out = uact + kInputs + ugate0;
      for (int g = threadIdx.x; g < width; g += kThreads) {
        const int w = kPercWires + ugate0 + g, ia = wa[w], ib = wb[w];
        out[g] = difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in)
                     ? difflogic_ca_gate(tables_update + 4LL * (ugate0 + g), in[ia], in[ib])
                     : __int_as_float(0x7fc00000);
      }
      __syncthreads();
    }
    // ---- the backward: the update network's output gradient, zero where the cell keeps its state ----
    const bool keep = fire != nullptr && to_float(fire[cell]) == 0.0f;
    for (int c = threadIdx.x; c < C; c += kThreads)
      dbuf[0][c] = keep ? 0.0f : to_float(dnext[static_cast<long long>(cell) * C + c]);
    __syncthreads();
    int cur = 0;
#pragma unroll
    for (int l = A.n_update - 1; l >= 0; --l) {
      const int width = A.update[l], n_in = l == 0 ? kInputs : A.update[l - 1];
      const int ugate0 = difflogic_offset(A.update, l);
      const float* in = l == 0 ? uact : uact + kInputs + difflogic_offset(A.update, l - 1);
      const float* dy = dbuf[cur];
      float* din = dbuf[cur ^ 1];
      for (int g = threadIdx.x; g < width; g += kThreads) {
        const int w = kPercWires + ugate0 + g, ia = wa[w], ib = wb[w];
        float da = __int_as_float(0x7fc00000), db = da, xa = da, xb = da;
        if (difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in)) {
          xa = in[ia];
          xb = in[ib];
          difflogic_ca_gate_grad(tables_update + 4LL * (ugate0 + g), xa, xb, dy[g], da, db);
        }
        dside[2 * g] = da;
        dside[2 * g + 1] = db;
        float* s = part + 4LL * (K * kPercGates + ugate0 + g);
        float acc[4] = {s[0], s[1], s[2], s[3]};
        difflogic_accumulate(acc, dy[g], xa, xb);
#pragma unroll
        for (int uv = 0; uv < 4; ++uv) s[uv] = acc[uv];
      }
      __syncthreads();
      for (int j = threadIdx.x; j < n_in; j += kThreads) {
        float sum = 0.0f;
        if (kReaders) {
          const int* off = p.offsets + (l == 0 ? 0 : kInputs + difflogic_offset(A.update, l - 1) + l);
          const int* ent = p.entries + 2 * ugate0;
          const int k1 = off[j + 1];
          for (int k = off[j]; k < k1; ++k) sum += dside[__ldg(ent + k)];
        } else {
          for (int g = 0; g < width; ++g) {
            const int w = kPercWires + ugate0 + g;
            if (wa[w] == j) sum += dside[2 * g];
            if (wb[w] == j) sum += dside[2 * g + 1];
          }
        }
        din[j] = sum;
      }
      __syncthreads();
      cur ^= 1;
    }
    // The update network's input gradient: the state's part to dcells (with a kept cell's dnext), the
    // perception's back to its (channel, kernel, bit) order.
    float* dcell = p.dcells + static_cast<long long>(cell) * C * 10;
    for (int c = threadIdx.x; c < C; c += kThreads)
      dcell[c * 10 + 9] = (keep ? to_float(dnext[static_cast<long long>(cell) * C + c]) : 0.0f) + dbuf[cur][c];
    for (int e = threadIdx.x; e < C * P * K; e += kThreads) {
      const int c = e / (P * K), bit = (e / K) % P, k = e % K;
      dbuf[cur ^ 1][(c * K + k) * P + bit] = dbuf[cur][C + e];
    }
    __syncthreads();
    cur ^= 1;
#pragma unroll
    for (int l = A.n_perception - 1; l >= 0; --l) {
      const int width = A.perception[l], n_in = l == 0 ? 9 : A.perception[l - 1];
      const int gate0 = difflogic_offset(A.perception, l), wire0 = gate0 - (l == 0 ? 0 : A.perception[0]);
      const float* in = l == 0 ? patch : pact + C * K * difflogic_offset(A.perception, l - 1);
      const float* dy = dbuf[cur];
      float* din = dbuf[cur ^ 1];
      // One thread per (kernel, gate), the channels in order: its S_uv summed over them.
      for (int e = threadIdx.x; e < K * width; e += kThreads) {
        const int k = e / width, g = e - k * width;
        const int ia = l == 0 ? p.a[g] : wa[wire0 + g], ib = l == 0 ? 4 : wb[wire0 + g];
        const bool ok = difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in);
        const float* t = p.tables + 4LL * (k * kPercGates + gate0 + g);
        float* s = part + 4LL * (k * kPercGates + gate0 + g);
        float acc[4] = {s[0], s[1], s[2], s[3]};
        for (int c = 0; c < C; ++c) {
          const int inst = c * K + k;
          const float* src = l == 0 ? in + c * 9 : in + inst * n_in;
          float da = __int_as_float(0x7fc00000), db = da, xa = da, xb = da;
          const float d = dy[inst * width + g];
          if (ok) {
            xa = src[ia];
            xb = src[ib];
            difflogic_ca_gate_grad(t, xa, xb, d, da, db);
          }
          dside[inst * 2 * width + 2 * g] = da;
          dside[inst * 2 * width + 2 * g + 1] = db;
          difflogic_accumulate(acc, d, xa, xb);
        }
#pragma unroll
        for (int uv = 0; uv < 4; ++uv) s[uv] = acc[uv];
      }
      __syncthreads();
      for (int e = threadIdx.x; e < C * K * n_in; e += kThreads) {
        const int inst = e / n_in, j = e - inst * n_in;
        const float* side = dside + inst * 2 * width;
        float sum = 0.0f;
        for (int g = 0; g < width; ++g) {
          const int ia = l == 0 ? p.a[g] : wa[wire0 + g], ib = l == 0 ? 4 : wb[wire0 + g];
          if (ia == j) sum += side[2 * g];
          if (ib == j) sum += side[2 * g + 1];
        }
        din[e] = sum;
      }
      __syncthreads();
      cur ^= 1;
    }
    // The patch gradients, the kernels summed in order.
    for (int e = threadIdx.x; e < C * 9; e += kThreads) {
      const int c = e / 9, q = e - c * 9;
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) sum += dbuf[cur][(c * K + k) * 9 + q];
      dcell[c * 10 + q] = sum;
    }
    __syncthreads();  // the shared buffers are the next cell's
  }
}

template <typename T, int kArch, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_ca_step_bwd_gather_kernel(const DiffLogicParams p) {
  constexpr int C = kDiffLogicCaArchs[kArch].C;
  T* dstate = static_cast<T*>(p.dx);
  const int H = static_cast<int>(p.height), W = static_cast<int>(p.width);
  const int total = static_cast<int>(p.batch * p.height * p.width) * C;
  for (int e = blockIdx.x * kThreads + threadIdx.x; e < total; e += gridDim.x * kThreads) {
    const int cell = e / C, c = e - cell * C, x0 = cell % W, rest = cell / W, y0 = rest % H, bz = rest / H;
    float sum = p.dcells[static_cast<long long>(e) * 10 + 9];
    // The cell that reads this one at patch index q sits at minus q's offset.
    for (int q = 0; q < 9; ++q) {
      int y = y0 - (q / 3 - 1), x = x0 - (q % 3 - 1);
      if (p.periodic) {
        y = y < 0 ? y + H : y >= H ? y - H : y;
        x = x < 0 ? x + W : x >= W ? x - W : x;
      }
      if (y >= 0 && y < H && x >= 0 && x < W)
        sum += p.dcells[((static_cast<long long>(bz) * H + y) * W + x) * C * 10 + c * 10 + q];
    }
    dstate[e] = from_float<T>(sum);
  }
}

// Gates gate0 .. gate0 + n_out of the partials' rows; p.logits, p.tables and p.dlogits point at gate0's.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_ca_step_bwd_finish_kernel(const DiffLogicParams p) {
  const long long gates = p.n_in;  // the partials' row: every gate of the architecture
  for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < p.n_out;
       g += static_cast<long long>(gridDim.x) * kThreads) {
    float S[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long long b = 0; b < p.blocks; ++b) {
      const float* s = p.partials + 4 * (b * gates + p.gate0 + g);
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) S[uv] += s[uv];
    }
    for (int i = 0; i < 16; ++i) difflogic_dlogits_of(p, g, S, true, i);
  }
}

}  // namespace kspec
