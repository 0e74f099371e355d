// The one place where row-major matrix views become cuBLASLt's column-major operands. A row-major
// product C = P·Q is computed as the column-major product Cᵀ = Qᵀ·Pᵀ: the same memory, read with rows
// and columns exchanged, so no operand is copied. For a linear layer y = x·Wᵀ this is yᵀ = W·xᵀ.
// Pure arithmetic on sizes and strides (no CUDA): unit-tested on the CPU for every transposition.
#pragma once

#include <cstdint>
#include <string>

namespace kspec::gemm {

// A (batched) matrix as the caller sees it: element (b, i, j) at b*batch_stride + i*row_stride +
// j*col_stride, in elements. A transposed tensor is just a view with the two strides exchanged.
struct MatrixView {
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;
  int64_t batch_stride = 0;  // 0: the same matrix for every batch (broadcast)
};

// The view of the transpose (no data moves).
MatrixView transposed(const MatrixView& v);

// One cuBLASLt operand: a column-major matrix of stored_rows x stored_cols with leading dimension ld,
// used as is (transpose false, CUBLAS_OP_N) or transposed (CUBLAS_OP_T).
struct LtOperand {
  int64_t stored_rows = 0, stored_cols = 0, ld = 1;
  int64_t batch_stride = 0;
  bool transpose = false;
};

// D (m x n) = op(A) (m x k) · op(B) (k x n), `batch` times; D is never transposed.
struct LtGemm {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  LtOperand a, b, d;
};

// Maps the row-major C (r x c) = P (r x k) · Q (k x c), each over `batch` matrices, to cuBLASLt: A is
// Qᵀ, B is Pᵀ, D is Cᵀ, so m = c, n = r. Each view needs one unit-stride dim and a leading dimension at
// least the other dim's size (a size-1 dim may have any stride); C's columns must be the unit-stride
// dim. When Q is the same for every batch and the batches of P and C lie end to end in rows, the
// batches fold into one larger matrix (one GEMM instead of a batched one). Throws InvalidArgument
// naming `names` ("y", "x", "weight") and what their strides would need to be.
LtGemm map_row_major(const MatrixView& c, const MatrixView& p, const MatrixView& q, int64_t batch,
                     const char* c_name, const char* p_name, const char* q_name);

// The batches of a sum over batches Σ_b P_b·Q_b fold into the reduction dim (one GEMM over k·batch)
// when P's batches lie end to end in columns and Q's in rows. Returns false (views unchanged) otherwise.
bool fold_batch_into_k(MatrixView& p, MatrixView& q, int64_t batch);

std::string describe(const LtGemm& g);  // for messages and tests

}  // namespace kspec::gemm
