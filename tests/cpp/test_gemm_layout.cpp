// gemm/layout.h on the CPU: the row-major → cuBLASLt mapping is executed by a tiny column-major GEMM
// with cuBLASLt's semantics (op(A)·op(B) through ld and batch strides, bounds-checked) and compared with
// the row-major product computed straight from the views, for every transposition of x and W, padded
// leading dims, odd sizes, batches with shared and per-batch weights, and the backward's three GEMMs.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "gemm/layout.h"
#include "kspec/error.h"

using namespace kspec;
using gemm::LtGemm;
using gemm::LtOperand;
using gemm::MatrixView;

namespace {

// op(X)(i, j) of a cuBLASLt operand, checking that the element lies inside its stored matrix.
double lt_elem(const std::vector<double>& mem, const LtOperand& o, int64_t b, int64_t i, int64_t j) {
  int64_t r = o.transpose ? j : i, c = o.transpose ? i : j;
  EXPECT_LT(r, o.stored_rows);
  EXPECT_LT(c, o.stored_cols);
  EXPECT_GE(o.ld, std::max<int64_t>(o.stored_rows, 1));
  int64_t at = b * o.batch_stride + r + c * o.ld;
  EXPECT_GE(at, 0);
  EXPECT_LT(at, static_cast<int64_t>(mem.size()));
  return at >= 0 && at < static_cast<int64_t>(mem.size()) ? mem[at] : NAN;
}

// What cuBLASLt computes: D = op(A)·op(B) (+ beta·D), batch times.
void lt_emulate(const LtGemm& g, const std::vector<double>& a, const std::vector<double>& b, std::vector<double>& d,
                double beta = 0) {
  EXPECT_FALSE(g.d.transpose);
  for (int64_t bi = 0; bi < g.batch; ++bi)
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < g.k; ++l) s += lt_elem(a, g.a, bi, i, l) * lt_elem(b, g.b, bi, l, j);
        int64_t at = bi * g.d.batch_stride + i + j * g.d.ld;
        ASSERT_LT(at, static_cast<int64_t>(d.size()));
        d[at] = s + beta * d[at];
      }
}

double at(const std::vector<double>& mem, const MatrixView& v, int64_t b, int64_t i, int64_t j) {
  return mem[b * v.batch_stride + i * v.row_stride + j * v.col_stride];
}

int64_t span(const MatrixView& v, int64_t batch) {
  return (batch - 1) * v.batch_stride + (v.rows - 1) * v.row_stride + (v.cols - 1) * v.col_stride + 1;
}

// A rows x cols view: row-major or column-major, with `pad` extra elements per leading dimension.
MatrixView view(int64_t rows, int64_t cols, bool col_major, int64_t pad, int64_t batch, bool shared = false) {
  MatrixView v;
  v.rows = rows;
  v.cols = cols;
  if (col_major) {
    v.row_stride = 1;
    v.col_stride = rows + pad;
    v.batch_stride = shared ? 0 : (rows + pad) * cols;
  } else {
    v.row_stride = cols + pad;
    v.col_stride = 1;
    v.batch_stride = shared ? 0 : rows * (cols + pad);
  }
  if (batch == 1) v.batch_stride = shared ? 0 : v.batch_stride;
  return v;
}

std::vector<double> fill(const MatrixView& v, int64_t batch, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(-4, 4);  // small integers: the products are exact
  std::vector<double> mem(span(v, batch) + 3);
  for (auto& x : mem) x = d(rng);
  return mem;
}

// y = x·Wᵀ through the mapping (A = W memory, B = x memory, D = y memory) against the direct product.
void check_linear(int64_t batch, bool shared, int64_t m, int64_t n, int64_t k, bool x_cm, bool w_cm, int64_t pad) {
  SCOPED_TRACE(::testing::Message() << "batch " << batch << (shared ? " shared" : "") << " m " << m << " n " << n
                                    << " k " << k << " x " << (x_cm ? "col" : "row") << "-major, W "
                                    << (w_cm ? "col" : "row") << "-major, pad " << pad);
  MatrixView xv = view(m, k, x_cm, pad, batch), wv = view(n, k, w_cm, pad, batch, shared);
  MatrixView yv = view(m, n, false, pad, batch);
  auto x = fill(xv, batch, 1), w = fill(wv, shared ? 1 : batch, 2);
  std::vector<double> y(span(yv, batch) + 3, 12345.0);
  LtGemm g = gemm::map_row_major(yv, xv, gemm::transposed(wv), batch, "y", "x", "weight");
  EXPECT_EQ(g.m, n);
  EXPECT_EQ(g.k, k);
  lt_emulate(g, w, x, y);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l) s += at(x, xv, b, i, l) * at(w, wv, b, j, l);
        ASSERT_EQ(at(y, yv, b, i, j), s) << "(" << b << ", " << i << ", " << j << ") " << gemm::describe(g);
      }
}

}  // namespace

TEST(GemmLayout, LinearEveryTranspositionOddSizes) {
  for (int64_t m : {1, 7, 33})
    for (int64_t n : {1, 7, 33})
      for (int64_t k : {1, 7, 33})
        for (bool x_cm : {false, true})
          for (bool w_cm : {false, true})
            for (int64_t pad : {0, 3}) check_linear(1, false, m, n, k, x_cm, w_cm, pad);
}

TEST(GemmLayout, BatchedPerBatchAndSharedWeights) {
  for (bool shared : {false, true})
    for (bool x_cm : {false, true})
      for (bool w_cm : {false, true})
        for (int64_t pad : {0, 2}) {
          check_linear(3, shared, 7, 5, 9, x_cm, w_cm, pad);
          check_linear(4, shared, 1, 6, 3, x_cm, w_cm, pad);
        }
}

TEST(GemmLayout, NnLinearLayoutIsOneTnGemm) {
  // x [m, k] and W [n, k] contiguous: A = W is op T with ld k, B = xᵀ is op N with ld k, D ld n.
  LtGemm g = gemm::map_row_major({5, 3, 3, 1}, {5, 4, 4, 1}, gemm::transposed({3, 4, 4, 1}), 1, "y", "x", "w");
  EXPECT_TRUE(g.a.transpose);
  EXPECT_FALSE(g.b.transpose);
  EXPECT_EQ(g.a.ld, 4);
  EXPECT_EQ(g.b.ld, 4);
  EXPECT_EQ(g.d.ld, 3);
  EXPECT_EQ(g.m, 3);
  EXPECT_EQ(g.n, 5);
  EXPECT_EQ(g.k, 4);
}

TEST(GemmLayout, SharedWeightBatchesFoldIntoOneGemm) {
  // x [2, 3, 4] contiguous, W [5, 4]: one GEMM with n = 6 rows.
  LtGemm g = gemm::map_row_major({3, 5, 5, 1, 15}, {3, 4, 4, 1, 12}, gemm::transposed({5, 4, 4, 1, 0}), 2, "y", "x",
                                 "w");
  EXPECT_EQ(g.batch, 1);
  EXPECT_EQ(g.n, 6);
  // A gap between x's batches: a strided-batched GEMM instead.
  g = gemm::map_row_major({3, 5, 5, 1, 15}, {3, 4, 4, 1, 20}, gemm::transposed({5, 4, 4, 1, 0}), 2, "y", "x", "w");
  EXPECT_EQ(g.batch, 2);
  EXPECT_EQ(g.b.batch_stride, 20);
  EXPECT_EQ(g.a.batch_stride, 0);
}

TEST(GemmLayout, RejectsViewsWithoutAUnitStrideOrWithOverlap) {
  auto expect_msg = [](const std::function<void()>& f, const std::string& frag) {
    try {
      f();
      ADD_FAILURE() << "expected InvalidArgument mentioning " << frag;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << e.what();
    }
  };
  MatrixView y{4, 3, 3, 1}, x{4, 5, 5, 1}, w{3, 5, 5, 1};
  expect_msg([&] { gemm::map_row_major({4, 3, 1, 4}, x, gemm::transposed(w), 1, "y", "x", "weight"); }, "output 'y'");
  expect_msg([&] { gemm::map_row_major(y, {4, 5, 10, 2}, gemm::transposed(w), 1, "y", "x", "weight"); }, "'x'");
  expect_msg([&] { gemm::map_row_major(y, x, gemm::transposed({3, 5, 2, 1}), 1, "y", "x", "weight"); }, "'weight'");
  expect_msg([&] { gemm::map_row_major(y, x, gemm::transposed(w), 2, "y", "x", "weight"); }, "batch stride 0");
  expect_msg([&] { gemm::map_row_major(y, {4, 6, 6, 1}, gemm::transposed(w), 1, "y", "x", "weight"); }, "do not chain");
}

TEST(GemmLayout, BackwardGemmsMatchTheirRowMajorProducts) {
  // dx = dy·W and dW = dyᵀ·x (summed over the batches sharing W), for row- and column-major x and W.
  const int64_t batch = 3, m = 7, n = 5, k = 9;
  for (bool x_cm : {false, true})
    for (bool w_cm : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x " << x_cm << " W " << w_cm);
      MatrixView dyv = view(m, n, false, 0, batch), xv = view(m, k, x_cm, 0, batch), wv = view(n, k, w_cm, 0, 1, true);
      MatrixView dxv = view(m, k, false, 0, batch), dwv = view(n, k, false, 0, 1, true);
      auto dy = fill(dyv, batch, 3), x = fill(xv, batch, 4), w = fill(wv, 1, 5);
      std::vector<double> dx(span(dxv, batch) + 1), dw(span(dwv, 1) + 1);
      lt_emulate(gemm::map_row_major(dxv, dyv, wv, batch, "dx", "dy", "weight"), w, dy, dx);
      MatrixView pt = gemm::transposed(dyv), xq = xv;
      bool folded = gemm::fold_batch_into_k(pt, xq, batch);
      EXPECT_EQ(folded, !x_cm);  // column-major x: its batches are not end to end along m
      if (folded) {
        lt_emulate(gemm::map_row_major(dwv, pt, xq, 1, "dweight", "dy", "x"), x, dy, dw);
      } else {
        for (int64_t b = 0; b < batch; ++b) {
          MatrixView pb = gemm::transposed(dyv), xb = xv;
          pb.batch_stride = xb.batch_stride = 0;
          std::vector<double> xs(x.begin() + b * xv.batch_stride, x.end()), dys(dy.begin() + b * dyv.batch_stride, dy.end());
          lt_emulate(gemm::map_row_major(dwv, pb, xb, 1, "dweight", "dy", "x"), xs, dys, dw, b ? 1.0 : 0.0);
        }
      }
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t l = 0; l < k; ++l) {
            double s = 0;
            for (int64_t j = 0; j < n; ++j) s += at(dy, dyv, b, i, j) * at(w, wv, 0, j, l);
            ASSERT_EQ(at(dx, dxv, b, i, l), s);
          }
      for (int64_t j = 0; j < n; ++j)
        for (int64_t l = 0; l < k; ++l) {
          double s = 0;
          for (int64_t b = 0; b < batch; ++b)
            for (int64_t i = 0; i < m; ++i) s += at(dy, dyv, b, i, j) * at(x, xv, b, i, l);
          ASSERT_EQ(at(dw, dwv, 0, j, l), s);
        }
    }
}
