// difflogic GroupSum and bit packing (issue 30): difflogic.group_sum.fwd / .bwd (GroupSum(k, tau) on
// activations), difflogic.packed.group_sum (its counts on packed words), difflogic.pack and
// difflogic.unpack (activations <-> words). Kernels in templates/difflogic/{group_sum,pack}.cuh; the float64
// references in api/ops/difflogic/reference.h.
// GroupSum takes x [batch, n] viewed as [batch, k, n / k], so every output dim is an input's. Packing
// cannot: the word count ceil(batch / w) of pack's words and the batch of unpack's x and of packed
// GroupSum's counts are given by the output's shape (as e79's checkpoints are: the torch surface
// allocates it, kspec.call needs out=); w = 32 for int32 words, 64 for int64.
// The generic checker cannot encode int32/int64 tensors: pack, unpack and packed.group_sum are compared
// with the reference by tests/cpp/test_difflogic_bits.cpp instead (generic_check = false); GroupSum on
// activations is all floats and goes through the generic checker.
#include <cstdint>
#include <string>

#include "api/src/op.h"
#include "difflogic/common.h"
#include "difflogic/reference.h"
#include "jit/spec.h"
#include "templates/difflogic/params.h"

namespace kspec::difflogic {
namespace {

const std::vector<DType> kWordTypes = {DType::i32, DType::i64};

// Packed GroupSum: k (the counts' width) divides the n rows.
void check_groups(const Problem& p) {
  if (!p.has_dim("k")) return;  // a call: bound by the output later (check_call)
  const int64_t n = p.dim("n"), k = p.dim("k");
  KSPEC_CHECK(n % k == 0, p.op->info.name, ": k = ", k, " groups must divide n = ", n,
              " (GroupSum counts groups of n / k consecutive rows)");
}

void check_tau(const Problem& p) {
  KSPEC_CHECK(p.param_float("tau") > 0, p.op->info.name, ": parameter 'tau' must be > 0, got ", p.param_float("tau"));
}

void check_words(const Problem& p, const char* words_tensor) {
  const int64_t w = word_bits(p.dtype(words_tensor)), want = (p.dim("batch") + w - 1) / w;
  KSPEC_CHECK(p.dim("words") == want, p.op->info.name, ": batch = ", p.dim("batch"), " samples need ", want,
              " words of ", w, " bits per row, but '", words_tensor, "' has ", p.dim("words"));
}

ParamDef tau_param() {
  ParamDef tau{"tau", ParamType::Float, 1.0, {}, "the sums are divided by tau (> 0)", true};
  return tau;
}

DimDef dim(const char* name, const char* doc, int64_t min = 0) { return {name, DimKind::Var, {}, doc, min}; }

OpDef base(const char* name, const char* doc) {
  OpDef op;
  op.info.name = name;
  op.info.family = "difflogic";
  op.info.doc = doc;
  op.tuning = difflogic_tuning();
  op.info.tuning_axes = op.tuning.axes;
  return op;
}

Case make_case(std::string name, std::vector<std::pair<std::string, int64_t>> dims, bool representative = false,
               bool large = false) {
  Case c;
  c.name = std::move(name);
  c.dims = std::move(dims);
  c.representative = representative;
  c.large = large;
  return c;
}

// (batch, k, m): widths n = k m of 1, 7, 33, 4097 and B = 1, 33, 1024, groups of one column, one group, and
// the 64k-wide last layer into 10 classes.
struct GroupShape {
  const char* name;
  int64_t B, k, m;
  bool large;
};
const std::vector<GroupShape> kGroupShapes = {
    {"base", 64, 10, 100, false},  {"B_1_n_1", 1, 1, 1, false},        {"B_33_n_7", 33, 7, 1, false},
    {"B_1_n_33", 1, 3, 11, false}, {"B_33_n_4097", 33, 17, 241, false}, {"B_1024_k_1", 1024, 1, 4097, false},
    {"B_1024_n_1000", 1024, 10, 100, false}, {"large_64k_10", 4096, 10, 6400, true},
};

std::vector<DimDef> group_dims() {
  return {dim("batch", "B, samples"), dim("k", "groups", 1), dim("m", "columns per group: n / k", 1)};
}

std::vector<Case> group_cases(const char* f32_tensor) {
  std::vector<Case> cases;
  for (const auto& s : kGroupShapes)
    cases.push_back(make_case(s.name, {{"batch", s.B}, {"k", s.k}, {"m", s.m}}, std::string(s.name) == "base",
                              s.large));
  Case f32 = make_case(std::string(f32_tensor) + "_float32", {{"batch", 33}, {"k", 17}, {"m", 241}}, true);
  f32.tensor_dtypes = {{f32_tensor, DType::f32}};
  f32.params = {{"tau", 3.0}};
  cases.push_back(std::move(f32));
  return cases;
}

// ---- difflogic.group_sum.fwd ----

OpDef make_group_sum_fwd() {
  OpDef op = base("difflogic.group_sum.fwd",
                  "GroupSum(k, tau): y[s, c] = sum_j x[s, c, j] / tau, x the activations [batch, n] viewed as "
                  "[batch, k, n / k] (the view fails where k does not divide n); fp32 sums in a fixed order");
  op.info.reference = "api/ops/difflogic/reference.cpp: difflogic_group_sum_ref (python/kspec/reference/difflogic.py)";
  op.info.dims = group_dims();
  op.info.params = {tau_param()};
  op.info.inputs = {tensor_def("x", {"batch", "k", "m"}, kFloatTypes, "", false, false, "", Layout::Contiguous,
                               "activations [batch, n] as [batch, k, n / k]")};
  op.info.outputs = {tensor_def("y", {"batch", "k"}, {}, "x", true, false, "", Layout::Contiguous,
                                "group sums / tau, in x's dtype or float32 (a bf16 sum of thousands of bits "
                                "is not exact)")};
  op.check = check_tau;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"batch", 1}, {"k", 1}, {"m", 1}};
  op.cases = group_cases("y");
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "difflogic/group_sum.cuh", "kspec::difflogic_group_sum_fwd_kernel",
        {dtype_cuda_type(p.dtype("x")), dtype_cuda_type(p.dtype("y")), std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    DiffLogicParams a{};
    a.x = call.in("x").data;
    a.y = call.out("y").data;
    a.batch = p.dim("batch");
    a.groups = p.dim("k");
    a.n_in = a.groups * p.dim("m");
    a.tau = static_cast<float>(p.param_float("tau"));
    const int64_t threads = c.get("threads");
    void* args[] = {&a};
    if (a.batch > 0) l.launch(0, {blocks_for(a.batch * a.groups, threads / 32)}, {u32(threads)}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    auto y = ref::difflogic_group_sum_ref(p.dim("batch"), p.dim("k") * p.dim("m"), in[0].data, p.dim("k"),
                                          p.param_float("tau"));
    return std::vector<HostTensor>{{true, {p.dim("batch"), p.dim("k")}, std::move(y)}};
  };
  return op;
}

// ---- difflogic.group_sum.bwd ----

OpDef make_group_sum_bwd() {
  OpDef op = base("difflogic.group_sum.bwd",
                  "GroupSum's backward: dx[s, c, j] = dy[s, c, j] / tau, dy the gradient of y [batch, k] expanded "
                  "over the group (dy[:, :, None].expand(batch, k, m): stride 0, no copy); any strides");
  op.info.reference = "api/ops/difflogic/reference.cpp: difflogic_group_sum_bwd_ref on an expanded dy, else "
                      "dy / tau (python/kspec/reference/difflogic.py)";
  op.info.dims = group_dims();
  op.info.params = {tau_param()};
  op.info.inputs = {tensor_def("dy", {"batch", "k", "m"}, kFloatTypes, "", false, false, "", Layout::Strided,
                               "upstream gradient of y, expanded over each group (any strides)")};
  op.info.outputs = {tensor_def("dx", {"batch", "k", "m"}, kFloatTypes, "", false, false, "", Layout::Contiguous,
                                "gradient of x (any float dtype: x's, not necessarily dy's)")};
  op.check = check_tau;
  op.dtypes = kFloatTypes;
  op.compile_dims = {{"batch", 1}, {"k", 1}, {"m", 1}};
  op.cases = group_cases("dy");
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "difflogic/group_sum.cuh", "kspec::difflogic_group_sum_bwd_kernel",
        {dtype_cuda_type(p.dtype("dy")), dtype_cuda_type(p.dtype("dx")), std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    const TensorView& dy = call.in("dy");
    DiffLogicParams a{};
    a.dout = dy.data;
    a.dx = call.out("dx").data;
    a.batch = p.dim("batch");
    a.groups = p.dim("k");
    a.n_in = a.groups * p.dim("m");
    for (int d = 0; d < 3; ++d) a.strides[d] = dy.strides[d];
    a.tau = static_cast<float>(p.param_float("tau"));
    const int64_t threads = c.get("threads");
    void* args[] = {&a};
    if (a.batch > 0) l.launch(0, {blocks_for(a.batch * a.n_in, threads)}, {u32(threads)}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    std::vector<double> dx = in[0].data;
    for (double& v : dx) v /= p.param_float("tau");
    return std::vector<HostTensor>{{true, {p.dim("batch"), p.dim("k"), p.dim("m")}, std::move(dx)}};
  };
  return op;
}

// Packed shapes (batch, n): B = 1, 33 (not a multiple of w), 1024, 1000 and the 2^14; widths 1, 7,
// 33, 4097.
struct PackShape {
  const char* name;
  int64_t B, n, k;
};
const std::vector<PackShape> kPackShapes = {{"base", 1000, 100, 10}, {"B_1_n_1", 1, 1, 1},    {"B_33_n_7", 33, 7, 7},
                                            {"B_1024_n_33", 1024, 33, 3}, {"B_33_n_4097", 33, 4097, 17},
                                            {"B_16384", 16384, 640, 10}};

// ---- difflogic.packed.group_sum ----

OpDef make_packed_group_sum() {
  OpDef op = base("difflogic.packed.group_sum",
                  "GroupSum on packed words: counts[s, c] = set bits of sample s over rows [c n/k, (c+1) n/k), "
                  "batch and k given by counts' shape; words [n, ceil(batch / w)], w = 32 (int32) or 64 (int64)");
  op.info.reference =
      "api/ops/difflogic/reference.cpp: difflogic_packed_group_sum_ref (python/kspec/reference/difflogic.py)";
  op.info.dims = {dim("n", "rows (bits per sample)", 1), dim("words", "words per row: ceil(batch / w)", 1),
                  dim("batch", "B, samples", 1), dim("k", "groups (k divides n)", 1)};
  op.info.inputs = {tensor_def("x", {"n", "words"}, kWordTypes, "", false, false, "", Layout::Contiguous,
                               "packed bits; int32: w = 32, int64: w = 64")};
  op.info.outputs = {tensor_def("counts", {"batch", "k"}, {DType::i32}, "", false, false, "", Layout::Contiguous,
                                "set bits per sample and group")};
  op.check = [](const Problem& p) { check_groups(p); };
  op.check_call = [](const Call& call) {
    check_groups(call.problem);
    check_words(call.problem, "x");
  };
  // No float tensor: the main dtype is nominal (as packed.fwd's fp32 logits are); the words' dtype, which the
  // _w64 rows set, is the width.
  op.dtypes = {DType::f32};
  op.generic_check = false;
  op.compile_dims = {{"n", 1}, {"words", 1}, {"batch", 1}, {"k", 1}};
  for (const auto& s : kPackShapes)
    for (int64_t w : {32, 64}) {
      Case c = make_case(std::string(s.name) + (w == 64 ? "_w64" : ""),
                         {{"n", s.n}, {"words", (s.B + w - 1) / w}, {"batch", s.B}, {"k", s.k}},
                         std::string(s.name) == "base");
      if (w == 64) c.tensor_dtypes = {{"x", DType::i64}};
      op.cases.push_back(std::move(c));
    }
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(p, "difflogic/group_sum.cuh",
                                                    "kspec::difflogic_packed_group_sum_kernel",
                                                    {std::to_string(word_bits(p.dtype("x"))),
                                                     std::to_string(c.get("threads"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    DiffLogicParams a{};
    a.x = call.in("x").data;
    a.y = call.out("counts").data;
    a.batch = p.dim("batch");
    a.n_in = p.dim("n");
    a.words = p.dim("words");
    a.groups = p.dim("k");
    const int64_t threads = c.get("threads");
    void* args[] = {&a};
    l.launch(0, {blocks_for(a.batch * a.groups, threads)}, {u32(threads)}, 0, args);
  };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    KSPEC_CHECK_AS(p.dtype("x") == DType::i32, Unsupported, p.op->info.name,
                   ": the float64 reference takes int32 words only (a 64-bit word does not fit a double)");
    const auto counts = ref::difflogic_packed_group_sum_ref(p.dim("batch"), p.dim("n"), words_of(in[0]), 32, p.dim("k"));
    return std::vector<HostTensor>{
        {true, {p.dim("batch"), p.dim("k")}, std::vector<double>(counts.begin(), counts.end())}};
  };
  return op;
}

// ---- difflogic.pack / difflogic.unpack ----

std::vector<Case> pack_cases(const char* words_tensor) {
  std::vector<Case> cases;
  for (const auto& s : kPackShapes)
    for (int64_t w : {32, 64}) {
      Case c = make_case(std::string(s.name) + (w == 64 ? "_w64" : ""),
                         {{"batch", s.B}, {"n", s.n}, {"words", (s.B + w - 1) / w}}, std::string(s.name) == "base");
      if (w == 64) c.tensor_dtypes = {{words_tensor, DType::i64}};
      cases.push_back(std::move(c));
    }
  return cases;
}

std::vector<DimDef> pack_dims() {
  return {dim("batch", "B, samples", 1), dim("n", "columns (bits per sample)", 1),
          dim("words", "words per row: ceil(batch / w)", 1)};
}

// What pack and unpack share (they are mirrors): the dims, the word-width check, the cases, the kernel
// of pack.cuh by name (from the activations' dtype, the word width and the block size) and its launch,
// one thread per `per_thread` element ("words": a word of a column, "x": a sample of a column).
OpDef pack_base(const char* name, const char* doc, const char* reference, TensorDef in, TensorDef out,
                const char* kernel_name) {
  OpDef op = base(name, doc);
  op.info.reference = reference;
  op.info.dims = pack_dims();
  op.info.inputs = {std::move(in)};
  op.info.outputs = {std::move(out)};
  op.check_call = [](const Call& call) { check_words(call.problem, "words"); };
  op.dtypes = kFloatTypes;
  op.generic_check = false;
  op.compile_dims = {{"batch", 1}, {"n", 1}, {"words", 1}};
  op.cases = pack_cases("words");
  const std::string kernel = kernel_name;
  op.kernels = [kernel](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(p, "difflogic/pack.cuh", kernel,
                                                    {dtype_cuda_type(p.dtype("x")),
                                                     std::to_string(word_bits(p.dtype("words"))),
                                                     std::to_string(c.get("threads"))})};
  };
  const std::string in_name = op.info.inputs[0].name, out_name = op.info.outputs[0].name;
  op.launch = [in_name, out_name](const Call& call, const Config& c, Launcher& l) {
    const Problem& p = call.problem;
    DiffLogicParams a{};
    a.x = call.in(in_name).data;
    a.y = call.out(out_name).data;
    a.batch = p.dim("batch");
    a.n_in = p.dim("n");
    a.words = p.dim("words");
    const int64_t threads = c.get("threads");
    // pack: a thread per word of a column; unpack: a thread per sample of a column
    const int64_t elements = (out_name == "words" ? a.words : a.batch) * a.n_in;
    void* args[] = {&a};
    l.launch(0, {blocks_for(elements, threads)}, {u32(threads)}, 0, args);
  };
  return op;
}

OpDef make_pack() {
  OpDef op = pack_base(
      "difflogic.pack",
      "activations [batch, n] -> words [n, ceil(batch / w)]: sample s is bit s mod w of word s / w, set "
      "where x > 0.5 (exact for {0, 1}; NaN gives 0); padding bits zero; w = 32 (int32 words) or 64 "
      "(int64), the words' dtype",
      "api/ops/difflogic/reference.cpp: difflogic_binarize, difflogic_pack_ref "
      "(python/kspec/reference/difflogic.py)",
      tensor_def("x", {"batch", "n"}, kFloatTypes, "", false, false, "", Layout::Contiguous,
                 "activations ({0, 1}, or thresholded at 0.5)"),
      tensor_def("words", {"n", "words"}, kWordTypes, "", false, false, "", Layout::Contiguous,
                 "packed bits; int32: w = 32, int64: w = 64"),
      "kspec::difflogic_pack_kernel");
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    KSPEC_CHECK_AS(p.dtype("words") == DType::i32, Unsupported, p.op->info.name,
                   ": the float64 reference gives int32 words only (a 64-bit word does not fit a double)");
    const auto words = ref::difflogic_pack_ref(p.dim("batch"), p.dim("n"), ref::difflogic_binarize(in[0].data), 32);
    return std::vector<HostTensor>{{true, {p.dim("n"), p.dim("words")}, doubles_of_words(words)}};
  };
  return op;
}

OpDef make_unpack() {
  OpDef op = pack_base(
      "difflogic.unpack",
      "words [n, ceil(batch / w)] -> {0, 1} activations [batch, n], batch given by x's shape; w = 32 "
      "(int32 words) or 64 (int64)",
      "api/ops/difflogic/reference.cpp: difflogic_unpack_ref (python/kspec/reference/difflogic.py)",
      tensor_def("words", {"n", "words"}, kWordTypes, "", false, false, "", Layout::Contiguous,
                 "packed bits; int32: w = 32, int64: w = 64"),
      tensor_def("x", {"batch", "n"}, kFloatTypes, "", false, false, "", Layout::Contiguous,
                 "activations, 0 or 1, in any float dtype"),
      "kspec::difflogic_unpack_kernel");
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    KSPEC_CHECK_AS(p.dtype("words") == DType::i32, Unsupported, p.op->info.name,
                   ": the float64 reference takes int32 words only (a 64-bit word does not fit a double)");
    auto x = ref::difflogic_unpack_ref(p.dim("batch"), p.dim("n"), words_of(in[0]), 32);
    return std::vector<HostTensor>{{true, {p.dim("batch"), p.dim("n")}, std::move(x)}};
  };
  return op;
}

}  // namespace

void register_difflogic_bits(Registry& r) {
  r.add(make_group_sum_fwd());
  r.add(make_group_sum_bwd());
  r.add(make_packed_group_sum());
  r.add(make_pack());
  r.add(make_unpack());
}

}  // namespace kspec::difflogic
