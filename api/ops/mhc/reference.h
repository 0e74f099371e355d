// Float64 CPU reference for mHC (manifold-constrained hyper-connections): the pre op (stream weights
// from an RMS-normalized projection, Sinkhorn-Knopp residual mixing, the sublayer input y), the post op
// (the next layer's streams) and their exact backward. The spec the GPU kernels and the Python twin
// (python/kspec/reference/mhc.py) are tested against; the formulas are issue 34's.
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

// x is [T, n, D] row-major (n streams of D per token); v = vec(x[t]) has nD elements, v[i*D + d].
// M = n^2 + 2n rows of the projection (pre_only: M = n, only H_pre and y).
struct MhcShape {
  int64_t T = 1, n = 1, D = 1;
  bool pre_only = false;
};

// eps_rms inside the RMS, eps_pre added to H_pre, eps_sk inside every Sinkhorn-Knopp normalization;
// t_max >= 1 normalization rounds (the first is a column normalization alone).
struct MhcEps {
  double rms = 1e-6, pre = 1e-6, sk = 1e-6;
  int t_max = 20;
};

int64_t mhc_proj_rows(int64_t n, bool pre_only);  // M
int64_t mhc_alpha_size(bool pre_only);            // 3, or 1 when pre_only

// Sinkhorn-Knopp over T matrices of n x n logits Z[t, j, k] (j: source stream, k: destination):
//   A = softmax_k(Z) + eps;  A /= (sum_j A + eps);
//   t_max - 1 times:  A /= (sum_k A + eps);  A /= (sum_j A + eps)
// With eps = 0 every column of R sums to 1 (to rounding) and rows to about 1.
std::vector<double> mhc_sinkhorn_fwd_ref(const std::vector<double>& logits, int64_t T, int64_t n, int t_max,
                                         double eps);
// d/dZ of sum(dR * R), by recomputing the iterates and running each step's derivative backwards:
// Y = X / (sum X + eps): dX = (dY - sum(dY * Y)) / (sum X + eps);  softmax: dZ = P * (dP - sum(dP * P)).
std::vector<double> mhc_sinkhorn_bwd_ref(const std::vector<double>& logits, const std::vector<double>& dR,
                                         int64_t T, int64_t n, int t_max, double eps);

// Pre op inputs. phi: [M, nD]; alpha: [3] ([1] when pre_only); bias: [M]; gamma: [nD] or empty (= 1).
struct MhcPreInputs {
  std::vector<double> x, phi, alpha, bias, gamma;
};

// Per token, with sigma the logistic sigmoid and alpha_s = alpha[0], alpha[1], alpha[2] on rows
// [0, n), [n, 2n), [2n, M):
//   inv = 1/sqrt(mean(v^2) + eps_rms);  m = (v * gamma) phi^T;  h = inv * alpha_s * m + bias
//   H_pre = sigma(h[0:n]) + eps_pre;  H_post = 2 sigma(h[n:2n]);  R = SK(h[2n:] as n x n)
//   y = sum_i H_pre[i] x[i, :]
// y: [T, D]; h_pre, h_post: [T, n]; r: [T, n, n]; inv: [T]; h: [T, M]. pre_only: h_post, r empty.
struct MhcPreOutputs {
  std::vector<double> y, h_pre, h_post, r, inv, h;
};
MhcPreOutputs mhc_pre_fwd_ref(const MhcShape& shape, const MhcEps& eps, const MhcPreInputs& in);

// Upstream gradients of the pre op's outputs; each optional one absent when empty (no gradient).
// dy: [T, D]; dh_pre, dh_post: [T, n]; dr: [T, n, n]; dx_post: [T, n, D], added into dx (the post op's
// dx for the same x).
struct MhcPreUpstream {
  std::vector<double> dy, dh_pre, dh_post, dr, dx_post;
};
// Gradients of sum(dy*y) + sum(dh_pre*H_pre) + sum(dh_post*H_post) + sum(dr*R) (+ dx_post into dx):
// dx [T, n, D], dphi [M, nD], dalpha [3 or 1], dbias [M], dgamma [nD] (empty when gamma is absent).
struct MhcPreGrads {
  std::vector<double> dx, dphi, dalpha, dbias, dgamma;
};
MhcPreGrads mhc_pre_bwd_ref(const MhcShape& shape, const MhcEps& eps, const MhcPreInputs& in,
                            const MhcPreUpstream& up);

// Post op: out[t, k, :] = h_post[t, k] f[t, :] + sum_j r[t, j, k] x[t, j, :].
// x: [T, n, D]; f: [T, D]; h_post: [T, n]; r: [T, n, n]; out: [T, n, D].
std::vector<double> mhc_post_fwd_ref(const MhcShape& shape, const std::vector<double>& x,
                                     const std::vector<double>& f, const std::vector<double>& h_post,
                                     const std::vector<double>& r);
// Gradients of sum(dout * out): df = sum_k H_post[k] dO[k]; dH_post[k] = <dO[k], f>;
// dR[j, k] = <dO[k], x[j]>; dx[j] = sum_k R[j, k] dO[k].
struct MhcPostGrads {
  std::vector<double> dx, df, dh_post, dr;
};
MhcPostGrads mhc_post_bwd_ref(const MhcShape& shape, const std::vector<double>& x, const std::vector<double>& f,
                              const std::vector<double>& h_post, const std::vector<double>& r,
                              const std::vector<double>& dout);

// All of the above throw std::invalid_argument naming the argument when a size disagrees with the
// shape, or when n < 1, D < 1, T < 0, t_max < 1 or an eps is negative.

}  // namespace kspec::ref
