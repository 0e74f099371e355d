// Float64 difflogic reference (see reference.h): plain loops. The layer works in the T-form (4 numbers per
// gate); the 16 explicit multilinear extensions are kept beside it as the independent statement the
// T-form is tested against.
#include "difflogic/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kspec::ref {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("difflogic reference: " + what); }

template <typename V>
void check_size(const V& v, int64_t want, const char* name) {
  if (static_cast<int64_t>(v.size()) != want)
    fail(std::string(name) + " has " + std::to_string(v.size()) + " elements, expected " + std::to_string(want));
}

// The wires: equal lengths and every entry in [0, n_in).
int64_t check_wires(int64_t n_in, const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  if (n_in < 1) fail("n_in = " + std::to_string(n_in) + ", expected >= 1");
  check_size(b, static_cast<int64_t>(a.size()), "b (one wire per gate, as a)");
  for (const auto* wires : {&a, &b})
    for (size_t g = 0; g < wires->size(); ++g)
      if ((*wires)[g] < 0 || (*wires)[g] >= n_in)
        fail(std::string(wires == &a ? "a" : "b") + "[" + std::to_string(g) + "] = " + std::to_string((*wires)[g]) +
             " is outside [0, " + std::to_string(n_in) + ")");
  return static_cast<int64_t>(a.size());
}

void check_width(int w) {
  if (w != 32 && w != 64) fail("w = " + std::to_string(w) + ", expected 32 or 64");
}

void check_groups(int64_t n, int64_t k) {
  if (k < 1 || n % k != 0) fail("k = " + std::to_string(k) + " must be >= 1 and divide n = " + std::to_string(n));
}

// softmax of one gate's 16 logits.
std::array<double, kDiffLogicOps> softmax16(const double* l) {
  const double mx = *std::max_element(l, l + kDiffLogicOps);
  std::array<double, kDiffLogicOps> p{};
  double sum = 0.0;
  for (int i = 0; i < kDiffLogicOps; ++i) sum += p[i] = std::exp(l[i] - mx);
  for (double& v : p) v /= sum;
  return p;
}

int argmax16(const double* l) {
  int best = 0;
  for (int i = 1; i < kDiffLogicOps; ++i)
    if (l[i] > l[best]) best = i;  // strict: ties stay with the lower index
  return best;
}

// y and its partials in the T-form: y = T00 (1-a)(1-b) + T01 (1-a) b + T10 a (1-b) + T11 a b.
double gate_y(const double* t, double xa, double xb) {
  return t[0] * (1 - xa) * (1 - xb) + t[1] * (1 - xa) * xb + t[2] * xa * (1 - xb) + t[3] * xa * xb;
}

}  // namespace

double difflogic_op(int i, double a, double b) {
  switch (i) {
    case 0: return 0.0;
    case 1: return a * b;
    case 2: return a - a * b;
    case 3: return a;
    case 4: return b - a * b;
    case 5: return b;
    case 6: return a + b - 2 * a * b;
    case 7: return a + b - a * b;
    case 8: return 1 - (a + b - a * b);
    case 9: return 1 - (a + b - 2 * a * b);
    case 10: return 1 - b;
    case 11: return 1 - b + a * b;
    case 12: return 1 - a;
    case 13: return 1 - a + a * b;
    case 14: return 1 - a * b;
    case 15: return 1.0;
  }
  fail("op " + std::to_string(i) + " is outside [0, 16)");
}

int difflogic_truth(int i, int u, int v) { return (i >> (3 - (2 * u + v))) & 1; }

std::vector<double> difflogic_tables(const std::vector<double>& logits, int64_t n_out, DiffLogicMode mode) {
  check_size(logits, n_out * kDiffLogicOps, "logits ([n_out, 16])");
  std::vector<double> t(static_cast<size_t>(n_out * 4), 0.0);
  for (int64_t g = 0; g < n_out; ++g) {
    const double* l = &logits[g * kDiffLogicOps];
    std::array<double, kDiffLogicOps> p{};
    if (mode == DiffLogicMode::Soft)
      p = softmax16(l);
    else
      p[argmax16(l)] = 1.0;
    for (int uv = 0; uv < 4; ++uv)
      for (int i = 0; i < kDiffLogicOps; ++i) t[g * 4 + uv] += p[i] * difflogic_truth(i, uv >> 1, uv & 1);
  }
  return t;
}

std::vector<int> difflogic_hard_ops(const std::vector<double>& logits, int64_t n_out) {
  check_size(logits, n_out * kDiffLogicOps, "logits ([n_out, 16])");
  std::vector<int> ops(static_cast<size_t>(n_out));
  for (int64_t g = 0; g < n_out; ++g) ops[g] = argmax16(&logits[g * kDiffLogicOps]);
  return ops;
}

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c[0], p1 = uint64_t{0xCD9E8D57u} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    k[0] += 0x9E3779B9u;
    k[1] += 0xBB67AE85u;
  }
  return c;
}

std::vector<double> difflogic_gumbel_noise(int64_t n_out, uint64_t seed) {
  if (n_out < 0) fail("n_out = " + std::to_string(n_out) + ", expected >= 0");
  const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  std::vector<double> noise(static_cast<size_t>(n_out * kDiffLogicOps));
  for (int64_t g = 0; g < n_out; ++g) {
    const auto ug = static_cast<uint64_t>(g);
    for (uint32_t block = 0; block < 4; ++block) {
      const auto r = philox4x32_10({static_cast<uint32_t>(ug), static_cast<uint32_t>(ug >> 32), block, 0}, key);
      for (int j = 0; j < 4; ++j) {
        const double u = (static_cast<double>(r[j] >> 8) + 0.5) * 0x1p-24;
        noise[g * kDiffLogicOps + 4 * block + j] = -std::log(-std::log(u));
      }
    }
  }
  return noise;
}

DiffLogicConsumers difflogic_consumers(int64_t n_in, const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const int64_t n_out = check_wires(n_in, a, b);
  DiffLogicConsumers c;
  c.offsets.assign(static_cast<size_t>(n_in + 1), 0);
  for (int64_t g = 0; g < n_out; ++g) {
    ++c.offsets[a[g] + 1];
    ++c.offsets[b[g] + 1];
  }
  for (int64_t j = 0; j < n_in; ++j) c.offsets[j + 1] += c.offsets[j];
  c.entries.resize(static_cast<size_t>(2 * n_out));
  std::vector<int64_t> fill(c.offsets.begin(), c.offsets.end() - 1);
  // Visiting (g, side) in ascending 2 g + side order leaves each input's list sorted.
  for (int64_t g = 0; g < n_out; ++g) {
    c.entries[fill[a[g]]++] = 2 * g;
    c.entries[fill[b[g]]++] = 2 * g + 1;
  }
  return c;
}

std::vector<double> difflogic_layer_fwd_ref(int64_t B, int64_t n_in, const std::vector<double>& x,
                                            const std::vector<double>& logits, const std::vector<int32_t>& a,
                                            const std::vector<int32_t>& b, DiffLogicMode mode) {
  const int64_t n_out = check_wires(n_in, a, b);
  if (B < 0) fail("B = " + std::to_string(B) + ", expected >= 0");
  check_size(x, B * n_in, "x ([B, n_in])");
  const std::vector<double> t = difflogic_tables(logits, n_out, mode);
  std::vector<double> y(static_cast<size_t>(B * n_out));
  for (int64_t s = 0; s < B; ++s)
    for (int64_t g = 0; g < n_out; ++g) y[s * n_out + g] = gate_y(&t[g * 4], x[s * n_in + a[g]], x[s * n_in + b[g]]);
  return y;
}

DiffLogicGrads difflogic_layer_bwd_ref(int64_t B, int64_t n_in, const std::vector<double>& x,
                                       const std::vector<double>& logits, const std::vector<int32_t>& a,
                                       const std::vector<int32_t>& b, const std::vector<double>& dout,
                                       double grad_factor) {
  const int64_t n_out = check_wires(n_in, a, b);
  if (B < 0) fail("B = " + std::to_string(B) + ", expected >= 0");
  check_size(x, B * n_in, "x ([B, n_in])");
  check_size(dout, B * n_out, "dout ([B, n_out])");
  if (!std::isfinite(grad_factor)) fail("grad_factor must be finite");
  const std::vector<double> t = difflogic_tables(logits, n_out, DiffLogicMode::Soft);
  DiffLogicGrads gr;
  gr.dlogits.assign(static_cast<size_t>(n_out * kDiffLogicOps), 0.0);
  // dy/da, dy/db times dout per (sample, gate, side): what the consumers CSR gathers into dx.
  std::vector<double> dside(static_cast<size_t>(B * n_out * 2));
  for (int64_t g = 0; g < n_out; ++g) {
    const std::array<double, kDiffLogicOps> p = softmax16(&logits[g * kDiffLogicOps]);
    const double* tg = &t[g * 4];
    for (int64_t s = 0; s < B; ++s) {
      const double xa = x[s * n_in + a[g]], xb = x[s * n_in + b[g]], d = dout[s * n_out + g];
      const double y = gate_y(tg, xa, xb);
      for (int i = 0; i < kDiffLogicOps; ++i) gr.dlogits[g * kDiffLogicOps + i] += d * p[i] * (difflogic_op(i, xa, xb) - y);
      dside[(s * n_out + g) * 2] = d * ((tg[2] - tg[0]) * (1 - xb) + (tg[3] - tg[1]) * xb);
      dside[(s * n_out + g) * 2 + 1] = d * ((tg[1] - tg[0]) * (1 - xa) + (tg[3] - tg[2]) * xa);
    }
  }
  const DiffLogicConsumers c = difflogic_consumers(n_in, a, b);
  gr.dx.assign(static_cast<size_t>(B * n_in), 0.0);
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n_in; ++j) {
      double sum = 0.0;
      for (int64_t e = c.offsets[j]; e < c.offsets[j + 1]; ++e) sum += dside[s * n_out * 2 + c.entries[e]];
      gr.dx[s * n_in + j] = grad_factor * sum;
    }
  return gr;
}

std::vector<double> difflogic_group_sum_ref(int64_t B, int64_t n, const std::vector<double>& x, int64_t k,
                                            double tau) {
  check_groups(n, k);
  check_size(x, B * n, "x ([B, n])");
  if (!(tau > 0) || !std::isfinite(tau)) fail("tau must be finite and > 0");
  const int64_t m = n / k;
  std::vector<double> y(static_cast<size_t>(B * k), 0.0);
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n; ++j) y[s * k + j / m] += x[s * n + j];
  for (double& v : y) v /= tau;
  return y;
}

std::vector<double> difflogic_group_sum_bwd_ref(int64_t B, int64_t n, const std::vector<double>& dy, int64_t k,
                                                double tau) {
  check_groups(n, k);
  check_size(dy, B * k, "dy ([B, k])");
  if (!(tau > 0) || !std::isfinite(tau)) fail("tau must be finite and > 0");
  const int64_t m = n / k;
  std::vector<double> dx(static_cast<size_t>(B * n));
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n; ++j) dx[s * n + j] = dy[s * k + j / m] / tau;
  return dx;
}

std::vector<double> difflogic_binarize(const std::vector<double>& x) {
  std::vector<double> bits(x.size());
  for (size_t j = 0; j < x.size(); ++j) bits[j] = x[j] > 0.5 ? 1.0 : 0.0;
  return bits;
}

std::vector<uint64_t> difflogic_pack_ref(int64_t B, int64_t n, const std::vector<double>& x, int w) {
  check_width(w);
  check_size(x, B * n, "x ([B, n])");
  const int64_t W = (B + w - 1) / w;
  std::vector<uint64_t> words(static_cast<size_t>(n * W), 0);
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n; ++j) {
      const double v = x[s * n + j];
      if (v != 0.0 && v != 1.0)
        fail("x[" + std::to_string(s) + ", " + std::to_string(j) + "] = " + std::to_string(v) + ", expected 0 or 1");
      if (v == 1.0) words[j * W + s / w] |= uint64_t{1} << (s % w);
    }
  return words;
}

std::vector<double> difflogic_unpack_ref(int64_t B, int64_t n, const std::vector<uint64_t>& words, int w) {
  check_width(w);
  const int64_t W = (B + w - 1) / w;
  check_size(words, n * W, "words ([n, ceil(B / w)])");
  std::vector<double> x(static_cast<size_t>(B * n));
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n; ++j) x[s * n + j] = static_cast<double>((words[j * W + s / w] >> (s % w)) & 1);
  return x;
}

std::vector<uint64_t> difflogic_packed_fwd_ref(int64_t B, int64_t n_in, const std::vector<uint64_t>& words, int w,
                                               const std::vector<int>& ops, const std::vector<int32_t>& a,
                                               const std::vector<int32_t>& b) {
  check_width(w);
  const int64_t n_out = check_wires(n_in, a, b);
  check_size(ops, n_out, "ops ([n_out])");
  const int64_t W = (B + w - 1) / w;
  check_size(words, n_in * W, "words ([n_in, ceil(B / w)])");
  const uint64_t ones = w == 64 ? ~uint64_t{0} : 0xffffffffull;
  std::vector<uint64_t> out(static_cast<size_t>(n_out * W));
  for (int64_t g = 0; g < n_out; ++g) {
    if (ops[g] < 0 || ops[g] >= kDiffLogicOps)
      fail("ops[" + std::to_string(g) + "] = " + std::to_string(ops[g]) + " is outside [0, 16)");
    auto mask = [&](int u, int v) { return difflogic_truth(ops[g], u, v) ? ones : uint64_t{0}; };
    for (int64_t q = 0; q < W; ++q) {
      const uint64_t A = words[a[g] * W + q], Bw = words[b[g] * W + q];
      uint64_t r = (mask(0, 0) & ~A & ~Bw) | (mask(0, 1) & ~A & Bw) | (mask(1, 0) & A & ~Bw) | (mask(1, 1) & A & Bw);
      const int64_t valid = std::min<int64_t>(w, B - q * w);  // samples in this word
      r &= valid == 64 ? ~uint64_t{0} : (uint64_t{1} << valid) - 1;
      out[g * W + q] = r & ones;
    }
  }
  return out;
}

std::vector<int64_t> difflogic_packed_group_sum_ref(int64_t B, int64_t n, const std::vector<uint64_t>& words, int w,
                                                    int64_t k) {
  check_width(w);
  check_groups(n, k);
  const int64_t W = (B + w - 1) / w;
  check_size(words, n * W, "words ([n, ceil(B / w)])");
  const int64_t m = n / k;
  std::vector<int64_t> counts(static_cast<size_t>(B * k), 0);
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < n; ++j) counts[s * k + j / m] += static_cast<int64_t>((words[j * W + s / w] >> (s % w)) & 1);
  return counts;
}

}  // namespace kspec::ref

// ---- DiffLogic CA: the step as layers of the reference above, perception kernels run as batches of
// (cell, channel) patches ----
namespace kspec::ref {
namespace {

// The wires of perception layer l (l = 0: the 8-gate first layer reading (perm[g], centre)).
DiffLogicLayerWires perception_wires(const DiffLogicCa& ca, size_t l) {
  if (l > 0) return ca.perception[l - 1];
  return {ca.perm, std::vector<int32_t>(8, 4)};
}

std::vector<double> slice(const std::vector<double>& v, int64_t begin, int64_t n) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + n);
}

// Checks sizes and ranges; returns P, the width of the perception's last layer.
int64_t check_ca(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W, const std::vector<double>& state,
                 const DiffLogicCaLogits& logits, const std::vector<double>* fire) {
  if (ca.C < 1 || ca.K < 1) fail("C = " + std::to_string(ca.C) + ", K = " + std::to_string(ca.K) + ", expected >= 1");
  if (B < 0 || H < 1 || W < 1) fail("B, H, W = " + std::to_string(B) + ", " + std::to_string(H) + ", " +
                                    std::to_string(W) + ": expected B >= 0, H, W >= 1");
  check_size(state, B * H * W * ca.C, "state ([B, H, W, C])");
  if (fire) check_size(*fire, B * H * W, "fire ([B, H, W])");
  check_size(ca.perm, 8, "perm (the first perception layer's 8 neighbours)");
  check_size(logits.perception, static_cast<int64_t>(ca.perception.size()) + 1,
             "perception logits (one tensor per perception layer)");
  int64_t width = 8;
  for (size_t l = 0; l < logits.perception.size(); ++l) {
    const int64_t n_in = width;
    width = static_cast<int64_t>(perception_wires(ca, l).a.size());
    check_wires(l == 0 ? 9 : n_in, perception_wires(ca, l).a, perception_wires(ca, l).b);
    check_size(logits.perception[l], ca.K * width * kDiffLogicOps,
               ("perception logits [" + std::to_string(l) + "] ([K, width, 16])").c_str());
  }
  const int64_t P = width;
  if (ca.update.empty()) fail("the update network has no layers");
  check_size(logits.update, static_cast<int64_t>(ca.update.size()), "update logits (one tensor per update layer)");
  width = ca.C + ca.C * P * ca.K;
  for (size_t l = 0; l < ca.update.size(); ++l) {
    check_wires(width, ca.update[l].a, ca.update[l].b);
    width = static_cast<int64_t>(ca.update[l].a.size());
    check_size(logits.update[l], width * kDiffLogicOps, ("update logits [" + std::to_string(l) + "]").c_str());
  }
  if (width != ca.C) fail("the update network's last width is " + std::to_string(width) + ", expected C = " +
                          std::to_string(ca.C));
  return P;
}

// The cell read at patch index q (3 (dy + 1) + (dx + 1)) of cell (b, h, w), or -1 outside a zero-padded grid.
int64_t neighbour(const DiffLogicCa& ca, int64_t b, int64_t h, int64_t w, int q, int64_t H, int64_t W) {
  int64_t y = h + q / 3 - 1, x = w + q % 3 - 1;
  if (ca.periodic) {
    y = (y + H) % H;
    x = (x + W) % W;
  } else if (y < 0 || y >= H || x < 0 || x >= W) {
    return -1;
  }
  return (b * H + y) * W + x;
}

// Every layer's input of one soft or hard step (the backward's saved activations) and its output.
struct CaForward {
  std::vector<std::vector<std::vector<double>>> perception_in;  // [k][l]: [N C, n_in of layer l]
  std::vector<std::vector<double>> update_in;                   // [l]: [N, n_in of layer l]
  std::vector<double> out;                                      // [N, C]
};

CaForward ca_forward(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W, const std::vector<double>& state,
                     const DiffLogicCaLogits& logits, int64_t P, DiffLogicMode mode) {
  const int64_t N = B * H * W, C = ca.C, K = ca.K, NC = N * C, n_up = C + C * P * K;
  std::vector<double> patches(static_cast<size_t>(NC * 9));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t w = 0; w < W; ++w)
        for (int q = 0; q < 9; ++q) {
          const int64_t cell = (b * H + h) * W + w, nb = neighbour(ca, b, h, w, q, H, W);
          for (int64_t c = 0; c < C; ++c) patches[(cell * C + c) * 9 + q] = nb < 0 ? 0.0 : state[nb * C + c];
        }
  CaForward f;
  std::vector<double> u(static_cast<size_t>(N * n_up));
  for (int64_t cell = 0; cell < N; ++cell)
    for (int64_t c = 0; c < C; ++c) u[cell * n_up + c] = state[cell * C + c];
  f.perception_in.resize(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) {
    std::vector<double> x = patches;
    int64_t n_in = 9;
    for (size_t l = 0; l < logits.perception.size(); ++l) {
      const DiffLogicLayerWires wl = perception_wires(ca, l);
      const auto width = static_cast<int64_t>(wl.a.size());
      f.perception_in[k].push_back(x);
      x = difflogic_layer_fwd_ref(NC, n_in, x, slice(logits.perception[l], k * width * 16, width * 16), wl.a, wl.b,
                                  mode);
      n_in = width;
    }
    for (int64_t s = 0; s < NC; ++s)
      for (int64_t bit = 0; bit < P; ++bit)
        u[(s / C) * n_up + C + (s % C) * P * K + bit * K + k] = x[s * P + bit];
  }
  int64_t n_in = n_up;
  for (size_t l = 0; l < ca.update.size(); ++l) {
    f.update_in.push_back(u);
    u = difflogic_layer_fwd_ref(N, n_in, u, logits.update[l], ca.update[l].a, ca.update[l].b, mode);
    n_in = static_cast<int64_t>(ca.update[l].a.size());
  }
  f.out = std::move(u);
  return f;
}

}  // namespace

std::vector<double> difflogic_ca_step_ref(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W,
                                          const std::vector<double>& state, const DiffLogicCaLogits& logits,
                                          const std::vector<double>* fire, DiffLogicMode mode) {
  const int64_t P = check_ca(ca, B, H, W, state, logits, fire);
  std::vector<double> next = ca_forward(ca, B, H, W, state, logits, P, mode).out;
  if (fire)
    for (size_t j = 0; j < next.size(); ++j)
      if ((*fire)[j / static_cast<size_t>(ca.C)] == 0.0) next[j] = state[j];
  return next;
}

DiffLogicCaGrads difflogic_ca_step_bwd_ref(const DiffLogicCa& ca, int64_t B, int64_t H, int64_t W,
                                           const std::vector<double>& state, const DiffLogicCaLogits& logits,
                                           const std::vector<double>* fire, const std::vector<double>& dnew) {
  const int64_t P = check_ca(ca, B, H, W, state, logits, fire);
  const int64_t N = B * H * W, C = ca.C, K = ca.K, NC = N * C, n_up = C + C * P * K;
  check_size(dnew, N * C, "dnew ([B, H, W, C])");
  const CaForward f = ca_forward(ca, B, H, W, state, logits, P, DiffLogicMode::Soft);
  DiffLogicCaGrads g;
  g.dstate.assign(static_cast<size_t>(N * C), 0.0);
  std::vector<double> d = dnew;  // the gradient of the update network's output
  if (fire)
    for (size_t j = 0; j < d.size(); ++j)
      if ((*fire)[j / static_cast<size_t>(C)] == 0.0) {
        g.dstate[j] = dnew[j];  // a kept cell passes its gradient to its own state
        d[j] = 0.0;
      }
  g.dlogits.update.resize(ca.update.size());
  for (size_t l = ca.update.size(); l-- > 0;) {
    const int64_t n_in = l == 0 ? n_up : static_cast<int64_t>(ca.update[l - 1].a.size());
    auto gl = difflogic_layer_bwd_ref(N, n_in, f.update_in[l], logits.update[l], ca.update[l].a, ca.update[l].b, d);
    g.dlogits.update[l] = std::move(gl.dlogits);
    d = std::move(gl.dx);
  }
  for (int64_t cell = 0; cell < N; ++cell)
    for (int64_t c = 0; c < C; ++c) g.dstate[cell * C + c] += d[cell * n_up + c];
  std::vector<double> dpatches(static_cast<size_t>(NC * 9), 0.0);
  g.dlogits.perception.resize(logits.perception.size());
  for (size_t l = 0; l < logits.perception.size(); ++l) g.dlogits.perception[l].assign(logits.perception[l].size(), 0.0);
  for (int64_t k = 0; k < K; ++k) {
    std::vector<double> dk(static_cast<size_t>(NC * P));
    for (int64_t s = 0; s < NC; ++s)
      for (int64_t bit = 0; bit < P; ++bit) dk[s * P + bit] = d[(s / C) * n_up + C + (s % C) * P * K + bit * K + k];
    for (size_t l = logits.perception.size(); l-- > 0;) {
      const DiffLogicLayerWires wl = perception_wires(ca, l);
      const auto width = static_cast<int64_t>(wl.a.size());
      const int64_t n_in = l == 0 ? 9 : static_cast<int64_t>(perception_wires(ca, l - 1).a.size());
      auto gl = difflogic_layer_bwd_ref(NC, n_in, f.perception_in[k][l],
                                        slice(logits.perception[l], k * width * 16, width * 16), wl.a, wl.b, dk);
      std::copy(gl.dlogits.begin(), gl.dlogits.end(), g.dlogits.perception[l].begin() + k * width * 16);
      dk = std::move(gl.dx);
    }
    for (size_t j = 0; j < dpatches.size(); ++j) dpatches[j] += dk[j];
  }
  // Each patch value is a neighbour's state: its gradient goes back there (nowhere for the zero padding).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t w = 0; w < W; ++w)
        for (int q = 0; q < 9; ++q) {
          const int64_t cell = (b * H + h) * W + w, nb = neighbour(ca, b, h, w, q, H, W);
          if (nb < 0) continue;
          for (int64_t c = 0; c < C; ++c) g.dstate[nb * C + c] += dpatches[(cell * C + c) * 9 + q];
        }
  return g;
}

}  // namespace kspec::ref
