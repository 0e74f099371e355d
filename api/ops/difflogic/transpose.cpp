// difflogic.transpose (issue 30): y [cols, rows] = x [rows, cols] transposed, both contiguous, in any
// activation dtype. The logic layer's torch surface (python/kspec/_difflogic.py) runs a row-major x through
// it once to the feature-major layout its batch-tiled kernels read (and a row-major dy; dx back to x's
// layout): the row-major kernels gather x[s, a_g] at random within a row, which costs a 32-byte sector
// per element. Kernel: templates/difflogic/transpose.cuh; the reference is exact (a copy).
#include <string>

#include "api/src/op.h"
#include "difflogic/common.h"
#include "jit/spec.h"
#include "templates/difflogic/params.h"

namespace kspec::difflogic {
namespace {

OpDef make_transpose() {
  OpDef op;
  op.info.name = "difflogic.transpose";
  op.info.family = "difflogic";
  op.info.doc = "y[c, r] = x[r, c], both contiguous: a row-major [batch, n] activation to the feature-major layout "
                "(y.t() is x's values with strides (1, batch)) and back; bit-exact";
  op.info.reference = "api/ops/difflogic/transpose.cpp (an exact copy: numpy's x.T)";
  op.info.dims = {{"rows", DimKind::Var, {}, "rows of x (the batch of a row-major activation)", 0},
                  {"cols", DimKind::Var, {}, "columns of x (its width)", 0}};
  op.info.inputs = {tensor_def("x", {"rows", "cols"}, kFloatTypes, "", false, false, "", Layout::Contiguous,
                               "the matrix to transpose")};
  op.info.outputs = {tensor_def("y", {"cols", "rows"}, {}, "x", false, false, "", Layout::Contiguous,
                                "x transposed, in x's dtype")};
  op.tuning = difflogic_tuning();
  op.info.tuning_axes = op.tuning.axes;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"rows", 1}, {"cols", 1}};
  struct Shape {
    const char* name;
    int64_t rows, cols;
    bool large;
  };
  // A base, single rows and columns, sizes no tile divides, and a layer's activations.
  for (const Shape& s : std::vector<Shape>{{"base", 100, 200, false},
                                           {"one_by_one", 1, 1, false},
                                           {"one_row", 1, 33, false},
                                           {"one_col", 33, 1, false},
                                           {"rows_65_cols_130", 65, 130, false},
                                           {"B_1024_n_4097", 1024, 4097, false},
                                           {"B_4096_n_4097", 4096, 4097, true}}) {
    Case c;
    c.name = s.name;
    c.dims = {{"rows", s.rows}, {"cols", s.cols}};
    c.large = s.large;
    c.representative = c.name == "base";
    op.cases.push_back(std::move(c));
  }
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "difflogic/transpose.cuh", "kspec::difflogic_transpose_kernel",
        {dtype_cuda_type(p.dtype("x")), std::to_string(c.get("threads")), std::to_string(kTransposeTile)})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    DiffLogicParams a{};
    a.x = call.in("x").data;
    a.y = call.out("y").data;
    a.batch = call.problem.dim("rows");
    a.n_in = call.problem.dim("cols");
    void* args[] = {&a};
    if (a.batch > 0 && a.n_in > 0) l.launch(0, {transpose_blocks(a.batch, a.n_in)}, {u32(c.get("threads"))}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    const int64_t rows = p.dim("rows"), cols = p.dim("cols");
    std::vector<double> y(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[static_cast<size_t>(c * rows + r)] = in[0].data[static_cast<size_t>(r * cols + c)];
    return std::vector<HostTensor>{{true, {cols, rows}, std::move(y)}};
  };
  return op;
}

}  // namespace

void register_difflogic_transpose(Registry& r) { r.add(make_transpose()); }

}  // namespace kspec::difflogic
