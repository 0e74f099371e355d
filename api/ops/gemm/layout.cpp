// Row-major views → cuBLASLt column-major operands (see layout.h for the rule and why).
#include "gemm/layout.h"

#include <algorithm>

#include "kspec/error.h"

namespace kspec::gemm {

MatrixView transposed(const MatrixView& v) {
  return {v.cols, v.rows, v.col_stride, v.row_stride, v.batch_stride};
}

namespace {

std::string view_text(const MatrixView& v) {
  return detail::concat("[", v.rows, ", ", v.cols, "] with strides [", v.row_stride, ", ", v.col_stride, "]");
}

// Vᵀ (cols x rows) as a column-major operand. Vᵀ(i, j) = V(j, i) sits at i*col_stride + j*row_stride:
// if V's columns are unit-stride, Vᵀ is column-major with ld = row_stride (op N); if V's rows are, Vᵀ
// is the transpose of V stored column-major with ld = col_stride (op T). Prefers op N when both hold.
bool operand_of_transpose(const MatrixView& v, bool allow_transpose, LtOperand* out) {
  bool cols_unit = v.col_stride == 1 || v.cols <= 1;
  bool rows_unit = v.row_stride == 1 || v.rows <= 1;
  if (cols_unit) {
    int64_t ld = v.rows <= 1 ? std::max<int64_t>(v.cols, 1) : v.row_stride;
    if (ld >= std::max<int64_t>(v.cols, 1)) {
      *out = {v.cols, v.rows, ld, v.batch_stride, false};
      return true;
    }
  }
  if (allow_transpose && rows_unit) {
    int64_t ld = v.cols <= 1 ? std::max<int64_t>(v.rows, 1) : v.col_stride;
    if (ld >= std::max<int64_t>(v.rows, 1)) {
      *out = {v.rows, v.cols, ld, v.batch_stride, true};
      return true;
    }
  }
  return false;
}

// Batches end to end in rows: batch b's row i is row b*rows + i of one matrix with the same strides.
bool rows_fold(const MatrixView& v) {
  if (v.rows <= 1) return true;  // the batch stride becomes the row stride
  return v.batch_stride == v.rows * v.row_stride;
}

MatrixView fold_rows(const MatrixView& v, int64_t batch) {
  MatrixView f = v;
  if (v.rows <= 1) f.row_stride = v.batch_stride;
  f.rows = v.rows * batch;
  f.batch_stride = 0;
  return f;
}

}  // namespace

LtGemm map_row_major(const MatrixView& c_in, const MatrixView& p_in, const MatrixView& q_in, int64_t batch,
                     const char* c_name, const char* p_name, const char* q_name) {
  KSPEC_CHECK(p_in.rows == c_in.rows && q_in.cols == c_in.cols && p_in.cols == q_in.rows, "gemm: sizes do not chain: ",
              c_name, " ", c_in.rows, "x", c_in.cols, " = ", p_name, " ", p_in.rows, "x", p_in.cols, " · ", q_name, " ",
              q_in.rows, "x", q_in.cols);
  KSPEC_CHECK(batch >= 1, "gemm: batch must be at least 1, got ", batch);
  if (batch > 1 && q_in.batch_stride == 0 && rows_fold(c_in) && rows_fold(p_in)) {
    // One GEMM over batch*r rows, where the folded views are still operands (a one-row column-major
    // P, say, folds into a view with no unit stride: then the batched form below).
    LtGemm g;
    MatrixView c = fold_rows(c_in, batch), p = fold_rows(p_in, batch);
    if (operand_of_transpose(c, false, &g.d) && operand_of_transpose(q_in, true, &g.a) &&
        operand_of_transpose(p, true, &g.b)) {
      g.m = c.cols;
      g.n = c.rows;
      g.k = p.cols;
      return g;
    }
  }
  const MatrixView &c = c_in, &p = p_in, &q = q_in;
  KSPEC_CHECK(batch == 1 || c.batch_stride != 0, "gemm: output '", c_name, "' has batch stride 0: its ", batch,
              " matrices would overwrite each other");
  LtGemm g;
  g.m = c.cols;
  g.n = c.rows;
  g.k = p.cols;
  g.batch = batch;
  KSPEC_CHECK(operand_of_transpose(c, false, &g.d), "gemm: output '", c_name, "' ", view_text(c),
              ": needs unit stride along its last dim and a row stride of at least ", c.cols,
              " (make it contiguous)");
  KSPEC_CHECK(operand_of_transpose(q, true, &g.a), "gemm: '", q_name, "' ", view_text(q),
              ": needs one unit-stride dim and the other stride at least the unit-stride dim's size "
              "(a row-major or column-major view; call .contiguous() on other views)");
  KSPEC_CHECK(operand_of_transpose(p, true, &g.b), "gemm: '", p_name, "' ", view_text(p),
              ": needs one unit-stride dim and the other stride at least the unit-stride dim's size "
              "(a row-major or column-major view; call .contiguous() on other views)");
  return g;
}

bool fold_batch_into_k(MatrixView& p, MatrixView& q, int64_t batch) {
  if (batch <= 1) return true;
  MatrixView pt = transposed(p);  // P's columns end to end ⟺ Pᵀ's rows end to end
  if (!rows_fold(pt) || !rows_fold(q)) return false;
  MatrixView pf = transposed(fold_rows(pt, batch)), qf = fold_rows(q, batch);
  LtOperand unused;
  if (!operand_of_transpose(pf, true, &unused) || !operand_of_transpose(qf, true, &unused)) return false;
  p = pf;
  q = qf;
  return true;
}

std::string describe(const LtGemm& g) {
  auto op = [](const LtOperand& o) {
    return detail::concat(o.transpose ? "T" : "N", "(", o.stored_rows, "x", o.stored_cols, ", ld ", o.ld,
                          ", bs ", o.batch_stride, ")");
  };
  return detail::concat("m=", g.m, " n=", g.n, " k=", g.k, " batch=", g.batch, " A=", op(g.a), " B=", op(g.b),
                        " D=", op(g.d));
}

}  // namespace kspec::gemm
