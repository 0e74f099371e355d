// selective_scan's schema, case table and float64 references, and the facts of a problem that every
// algorithm reads (scan.h).
#include <algorithm>
#include <cmath>

#include "api/src/device_data.h"
#include "api/src/tuning.h"
#include "selective_scan/reference.h"
#include "selective_scan/scan.h"

namespace kspec::scan {

const std::vector<std::string> kAlgoNames = {"warp", "sequential", "tile", "wide"};
const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
const std::vector<std::string> kBDT = {"batch", "dim", "seqlen"};
const std::vector<std::string> kVarBC = {"batch", "groups", "dstate", "seqlen"};
const std::vector<std::string> kFixedBC = {"dim", "dstate"};
const std::vector<std::string> kState = {"batch", "dim", "dstate"};
const std::vector<std::string> kStates = {"batch", "dim", "nstates", "dstate"};

int64_t groups_of(const Problem& p) {
  return var_bc(p) && p.has_dim("groups") ? p.dim("groups") : 1;
}
bool time_major(const Problem& p) { return p.has_dim("seqlen") && p.param_str("layout") == "bld"; }
bool is_even(const Problem& p) {
  return !time_major(p) && p.dim("seqlen") % kEvenMultiple == 0 && p.align_bytes >= 16;
}
constexpr int64_t kTileVector = 8;
bool tile_vectors(const Problem& p) {
  return !time_major(p) && p.dim("seqlen") % kTileVector == 0 && p.align_bytes >= 16;
}

int64_t group_fit(const Problem& p) {
  if (!var_bc(p) || groups_of(p) == 1) return 256;
  int64_t cpg = p.dim("dim") / std::max<int64_t>(groups_of(p), 1), fit = 256;
  while (fit > 1 && cpg % fit != 0) fit /= 2;
  return fit;
}

std::string flags_type(const Problem& p, bool vectors) {
  std::string s = "kspec::ScanFlags<" + std::string(dtype_cuda_type(p.dtype("u")));
  s += ", " + std::string(dtype_cuda_type(p.dtype("B")));
  s += ", " + std::string(dtype_cuda_type(p.dtype("C")));
  s += ", " + std::to_string(p.dim("dstate"));
  for (bool f : {var_b(p), var_c(p), p.present("D"), p.present("z"), p.present("delta_bias"),
                 p.param_bool("delta_softplus"), p.present("h0"), vectors})
    s += std::string(", ") + b2s(f);
  // kTimeMajor is written only when set: the bdl kernels keep the spec text (and code) they had.
  return s + (time_major(p) ? ", true>" : ">");
}

jit::KernelSpec kernel(const Problem& p, const char* header, const char* name, std::string traits) {
  return kernel_spec(p, header, name, {std::move(traits)});
}

namespace {
template <typename X>
X* ptr(const TensorView& t) {
  return static_cast<X*>(t.data);
}
}  // namespace

ScanParams scan_params_of(const Call& call) {
  const Problem& p = call.problem;
  ScanParams s;
  s.u = call.in("u").data;
  s.delta = call.in("delta").data;
  s.A = ptr<const float>(call.in("A"));
  s.B = call.in("B").data;
  s.C = call.in("C").data;
  s.D = ptr<const float>(call.in("D"));
  s.z = call.in("z").data;
  s.delta_bias = ptr<const float>(call.in("delta_bias"));
  s.h0 = ptr<const float>(call.in("h0"));
  s.dim = static_cast<int>(p.dim("dim"));
  s.seqlen = static_cast<int>(p.dim("seqlen"));
  s.groups = static_cast<int>(groups_of(p));
  s.channels_per_group = s.dim / s.groups;
  return s;
}


namespace {

// Cross-argument rules, for every op of the family (step has no seqlen but the same B/C rules).
void check_scan(const Problem& p) {
  const std::string& op = p.op->info.name;
  int64_t dstate = p.dim("dstate");
  KSPEC_CHECK_AS(dstate >= 1 && dstate <= kMaxDstate, Unsupported, op, ": input 'A': dstate = ", dstate,
                 " is not supported (1..", kMaxDstate, ")");
  int64_t groups = groups_of(p), dim = p.dim("dim");
  KSPEC_CHECK(groups >= 1 && dim % groups == 0, op, ": input '", var_b(p) ? "B" : "C", "': groups = ", groups,
              " must divide dim = ", dim);
}

std::vector<ParamDef> param_defs(bool with_seqlen) {
  std::vector<ParamDef> d = {
      {"delta_softplus", ParamType::Bool, false, {}, "dt = softplus(delta + delta_bias) (else delta + delta_bias)"}};
  if (with_seqlen)
    d.push_back({"layout", ParamType::Choice, std::string("bdl"), {"bdl", "bld"},
                 "memory order of u, delta, z, out (and gradients): bdl contiguous [batch, dim, seqlen]; bld "
                 "[batch, seqlen, dim] memory given as [batch, dim, seqlen] views (seqlen stride dim, e.g. "
                 "u.transpose(1, 2)), a variable B/C likewise [batch, seqlen, groups, dstate]; bld runs the "
                 "sequential algorithm without segments"});
  return d;
}

// Whether t is dense in the memory order `order` (dims major to minor); sizes of 1 take any stride.
bool dense_in(const TensorView& t, std::initializer_list<int> order) {
  if (t.rank != static_cast<int>(order.size())) return false;
  int64_t want = 1;
  for (auto it = std::rbegin(order); it != std::rend(order); ++it) {
    if (t.shape[*it] != 1 && t.strides[*it] != want) return false;
    want *= t.shape[*it];
  }
  return true;
}

// The tensors the `layout` param governs lie as it says: every [batch, dim, seqlen] one and a variable
// B/C (dB/dC); the rest (A, D, h0, states, a fixed B/C...) contiguous.
void check_layout(const Call& call) {
  const Problem& p = call.problem;
  const bool bld = time_major(p);
  auto check = [&](const TensorDef& def, const TensorView& t, const char* kind) {
    if (!t.defined() || t.numel() == 0) return;
    const bool seq = def.shape == kBDT, var = def.shape == kVarBC && t.rank == 4;
    if (bld && seq)
      KSPEC_CHECK(dense_in(t, {0, 2, 1}), p.op->info.name, ": ", kind, " '", def.name,
                  "': layout \"bld\" expects a [batch, seqlen, dim] buffer viewed as [batch, dim, seqlen] (strides "
                  "[seqlen*dim, 1, dim], e.g. x.transpose(1, 2)), got ", t.describe());
    else if (bld && var)
      KSPEC_CHECK(dense_in(t, {0, 3, 1, 2}), p.op->info.name, ": ", kind, " '", def.name,
                  "': layout \"bld\" expects a [batch, seqlen, groups, dstate] buffer viewed as [batch, groups, "
                  "dstate, seqlen] (strides [seqlen*groups*dstate, dstate, 1, groups*dstate]), got ", t.describe());
    else
      KSPEC_CHECK(t.is_contiguous(), p.op->info.name, ": ", kind, " '", def.name, "': expected a contiguous tensor",
                  seq || var ? " (layout \"bdl\"; \"bld\" takes [batch, seqlen, ...] memory)" : "", ", got ",
                  t.describe());
  };
  for (size_t i = 0; i < call.inputs.size(); ++i) check(p.op->info.inputs[i], call.inputs[i], "input");
  for (size_t i = 0; i < call.outputs.size(); ++i) check(p.op->info.outputs[i], call.outputs[i], "output");
}

std::vector<DimDef> scan_dims(bool with_seqlen) {
  std::vector<DimDef> d = {{"batch", DimKind::Var, {}, "batch"},
                           {"dim", DimKind::Var, {}, "channels (d_inner)"},
                           {"dstate", DimKind::Const, {}, "state size per channel, a template argument (1..256)"},
                           {"groups", DimKind::Var, {}, "B/C groups (variable B/C only); channel d uses group d / (dim / groups)"}};
  if (with_seqlen) {
    d.insert(d.begin() + 2, DimDef{"seqlen", DimKind::Var, {}, "sequence length"});
    d.push_back({"nstates", DimKind::Var, {}, "the forward's states for the backward: ceil(seqlen / 16)"});
  }
  return d;
}

// The forward's `states` output and the backward's `states` input agree on ceil(seqlen / 16) entries.
void check_scan_call(const Call& call) {
  const Problem& p = call.problem;
  check_layout(call);
  if (!p.has_dim("nstates")) return;
  const int64_t want = nstates_for(p.dim("seqlen"));
  KSPEC_CHECK(p.dim("nstates") == want, p.op->info.name, ": 'states': expected ", want,
              " states (ceil(seqlen / 16) = ceil(", p.dim("seqlen"), " / 16)), got ", p.dim("nstates"));
}

ref::ScanShape shape_of_problem(const Problem& p) {
  ref::ScanShape s;
  s.batch = p.dim("batch");
  s.dim = p.dim("dim");
  s.seqlen = p.dim("seqlen");
  s.dstate = p.dim("dstate");
  s.groups = groups_of(p);
  s.variable_b = var_b(p);
  s.variable_c = var_c(p);
  return s;
}

std::vector<double> or_empty(const HostTensor& h) { return h.defined ? h.data : std::vector<double>{}; }

// in: u, delta, A, B, C, D, z, delta_bias, h0 starting at `first`.
ref::ScanInputs scan_inputs_of(const Problem& p, const std::vector<HostTensor>& in, size_t first) {
  ref::ScanInputs r;
  r.u = in[first].data;
  r.delta = in[first + 1].data;
  r.A = in[first + 2].data;
  r.B = in[first + 3].data;
  r.C = in[first + 4].data;
  r.D = or_empty(in[first + 5]);
  r.z = or_empty(in[first + 6]);
  r.delta_bias = or_empty(in[first + 7]);
  r.h0 = or_empty(in[first + 8]);
  r.delta_softplus = p.param_bool("delta_softplus");
  return r;
}

// ---- cases ----

struct CaseSpec {
  const char* name;
  int64_t batch, dim, seqlen, dstate, groups;
  bool softplus;
  std::vector<std::string> without;
  std::vector<std::string> alt;
};

std::vector<Case> scan_cases(bool with_seqlen) {
  std::vector<CaseSpec> specs = {
      {"base", 2, 64, 300, 16, 1, true, {}, {}},
      {"batch_1", 1, 64, 300, 16, 1, true, {"h0"}, {}},
      {"dim_37", 3, 37, 129, 16, 1, true, {}, {}},
      {"seqlen_1", 2, 40, 1, 16, 1, true, {}, {}},
      {"seqlen_2", 2, 40, 2, 16, 1, false, {}, {}},
      {"seqlen_1023", 2, 24, 1023, 16, 1, true, {}, {}},
      {"seqlen_even_1024", 2, 24, 1024, 16, 1, true, {}, {}},
      {"dstate_1", 2, 24, 200, 1, 1, true, {}, {}},
      {"dstate_4", 2, 24, 200, 4, 1, true, {}, {}},
      {"dstate_64", 2, 24, 200, 64, 1, true, {}, {}},
      {"dstate_256", 2, 16, 200, 256, 1, true, {}, {}},
      {"groups_4", 2, 64, 257, 16, 4, true, {}, {}},
      {"fixed_bc", 2, 48, 300, 16, 1, true, {}, {"B", "C"}},
      {"fixed_b", 2, 48, 300, 16, 2, true, {}, {"B"}},
      {"no_D", 2, 48, 300, 16, 1, true, {"D"}, {}},
      {"no_z", 2, 48, 300, 16, 1, true, {"z"}, {}},
      {"no_delta_bias", 2, 48, 300, 16, 1, true, {"delta_bias"}, {}},
      {"no_softplus", 2, 48, 300, 16, 1, false, {}, {}},
      {"none_optional", 2, 48, 300, 16, 1, false, {"D", "z", "delta_bias", "h0"}, {}},
      {"mamba_2x512x2048", 2, 512, 2048, 16, 1, true, {"h0"}, {}},
      {"long_65536", 1, 8, 65536, 16, 1, true, {}, {}},
      // batch * dim >= 8192: the heuristic's sequential-state kernel (the cases above take the warp scan)
      {"wide_8x1024", 8, 1024, 130, 16, 1, true, {}, {}},
      {"wide_even_8x1024", 8, 1024, 512, 16, 1, true, {"h0"}, {}},
      // 8192..16384 channels, under 512 steps of whole 8-step vectors: the forward's wide kernel (a partial
      // last block of 32 channels, a partial last chunk of 32 steps and state stride of 16)
      {"wide_short_9x1000x40", 9, 1000, 40, 16, 1, true, {}, {}},
      // few channels, long: the heuristic's sequential kernel over 4 segments in parallel
      {"segments_2x32x9000", 2, 32, 9000, 16, 1, true, {}, {}},
      // the same at a length of whole 512-step tiles: the segments' vector-load (kEven) paths
      {"segments_even_2x32x8192", 2, 32, 8192, 16, 1, true, {}, {}},
  };
  std::vector<Case> cases;
  for (const auto& s : specs) {
    Case c;
    c.name = s.name;
    c.dims = {{"batch", s.batch}, {"dim", s.dim}, {"dstate", s.dstate}, {"groups", s.groups}};
    if (with_seqlen) {
      c.dims.emplace_back("seqlen", s.seqlen);
      c.dims.emplace_back("nstates", nstates_for(s.seqlen));
    }
    c.params = {{"delta_softplus", s.softplus}};
    c.without = s.without;
    c.alt_shapes = s.alt;
    if (s.alt.size() == 2) c.dims.erase(c.dims.begin() + 3);  // no groups without a variable B or C
    cases.push_back(std::move(c));
  }
  auto named = [&](const char* n) -> Case& {
    for (auto& c : cases)
      if (c.name == n) return c;
    throw InternalError(n);
  };
  named("mamba_2x512x2048").large = true;
  named("long_65536").large = true;
  // precompile --all: every config for the Mamba flags at dstate 16, and the largest state.
  named("base").representative = true;
  named("dstate_256").representative = true;
  // whole 512-step tiles at dstate 16: precompile --all compiles the one-pass tile kernel (algo 2), which
  // only these runtime dims admit, from this case
  named("seqlen_even_1024").representative = true;
  // B and C in fp32 beside 16-bit activations.
  Case f32bc = named("base");
  f32bc.name = "bc_fp32";
  f32bc.representative = false;
  f32bc.tensor_dtypes = {{"B", DType::f32}, {"C", DType::f32}};
  cases.push_back(f32bc);
  if (with_seqlen) {
    // Every case above runs as in training: the forward writes `states`, the backward reads them. These
    // run without: the forward for inference, the backward with its own forward pass (each algorithm,
    // and segments).
    named("none_optional").without.push_back("states");
    for (const char* n : {"base", "seqlen_1023", "dstate_64", "wide_8x1024", "wide_even_8x1024", "segments_2x32x9000",
                          "segments_even_2x32x8192"}) {
      Case c = named(n);
      c.name = std::string("no_states_") + n;
      c.representative = false;
      c.without.push_back("states");
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

}  // namespace

std::string even_key(const Problem& p) { return p.has_dim("seqlen") && is_even(p) ? "even" : ""; }

TensorDef tensor(std::string name, std::vector<std::string> shape, std::vector<DType> dtypes, std::string dtype_of,
                 bool or_f32, bool optional, std::string present_with, std::string doc, std::vector<std::string> alt) {
  // Strided: check_scan_call holds each to its layout (contiguous, or time-major under layout "bld").
  return tensor_def(std::move(name), std::move(shape), std::move(dtypes), std::move(dtype_of), or_f32, optional,
                    std::move(present_with), Layout::Strided, std::move(doc), std::move(alt));
}

// The scan's inputs, shared by fwd (as is) and bwd (after dout).
std::vector<TensorDef> scan_inputs() {
  return {
      tensor("u", kBDT, kFloatTypes, "", false, false, "", "input"),
      tensor("delta", kBDT, {}, "u", false, false, "", "time step before bias and softplus"),
      tensor("A", {"dim", "dstate"}, {DType::f32}, "", false, false, "", "state matrix (diagonal per channel); negative"),
      tensor("B", kVarBC, {}, "u", true, false, "", "input matrix: variable, or fixed [dim, dstate]", kFixedBC),
      tensor("C", kVarBC, {}, "u", true, false, "", "output matrix: variable, or fixed [dim, dstate]", kFixedBC),
      tensor("D", {"dim"}, {DType::f32}, "", false, true, "", "skip connection"),
      tensor("z", kBDT, {}, "u", false, true, "", "gate: out *= silu(z)"),
      tensor("delta_bias", {"dim"}, {DType::f32}, "", false, true, "", "added to delta"),
      tensor("h0", kState, {DType::f32}, "", false, true, "", "initial state (else zeros)"),
  };
}

// Random N(0, 1) inputs make a growing recurrence; as in Mamba, A < 0 and dt >= 0 keep it a decay.
void make_stable(const Problem& p, std::vector<HostTensor>& in, size_t first) {
  for (auto& a : in[first + 2].data) a = -(0.25 + std::fabs(a));
  if (!p.param_bool("delta_softplus")) {
    for (auto& v : in[first + 1].data) v = 0.05 + 0.5 * std::fabs(v);
    if (in[first + 7].defined)
      for (auto& v : in[first + 7].data) v = 0.1 * std::fabs(v);
  }
}

std::vector<HostTensor> fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const bool states = p.present("states");
  auto r = ref::selective_scan_fwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 0), states ? kStateStride : 0);
  std::vector<HostTensor> out(3);
  out[0] = {true, in[0].shape, std::move(r.out)};
  out[1] = {true, {p.dim("batch"), p.dim("dim"), p.dim("dstate")}, std::move(r.last_state)};
  if (states) out[2] = {true, {p.dim("batch"), p.dim("dim"), p.dim("nstates"), p.dim("dstate")}, std::move(r.states)};
  return out;
}

std::vector<HostTensor> bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const std::vector<double>* dlast = in[10].defined ? &in[10].data : nullptr;
  auto g = ref::selective_scan_bwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 1), in[0].data, dlast);
  std::vector<HostTensor> out(9);
  auto put = [&](size_t i, const HostTensor& like, std::vector<double>& v) {
    if (!v.empty()) out[i] = {true, like.shape, std::move(v)};
  };
  put(0, in[1], g.du);
  put(1, in[2], g.ddelta);
  put(2, in[3], g.dA);
  put(3, in[4], g.dB);
  put(4, in[5], g.dC);
  put(5, in[6], g.dD);
  put(6, in[7], g.dz);
  put(7, in[8], g.ddelta_bias);
  put(8, in[9], g.dh0);
  return out;
}

// One step of the scan from h0 = state (seqlen 1), B/C [batch, groups, dstate, 1].
std::vector<HostTensor> step_reference(const Problem& p, const std::vector<HostTensor>& in) {
  ref::ScanShape s;
  s.batch = p.dim("batch");
  s.dim = p.dim("dim");
  s.seqlen = 1;
  s.dstate = p.dim("dstate");
  s.groups = groups_of(p);
  s.variable_b = var_b(p);
  s.variable_c = var_c(p);
  ref::ScanInputs r;
  r.h0 = in[0].data;
  r.u = in[1].data;
  r.delta = in[2].data;
  r.A = in[3].data;
  r.B = in[4].data;
  r.C = in[5].data;
  r.D = or_empty(in[6]);
  r.z = or_empty(in[7]);
  r.delta_bias = or_empty(in[8]);
  r.delta_softplus = p.param_bool("delta_softplus");
  auto o = ref::selective_scan_fwd_ref(s, r);
  return std::vector<HostTensor>{{true, in[1].shape, std::move(o.out)}, {true, in[0].shape, std::move(o.last_state)}};
}

void prepare_bwd_inputs(const Problem& p, std::vector<HostTensor>& in) {
  make_stable(p, in, 1);
  if (!in[11].defined) return;
  // The states a forward of these very inputs would have written (as the GPU will see them).
  for (size_t i = 1; i <= 9; ++i)
    if (in[i].defined) quantize(p.inputs[i].dtype, in[i].data);
  in[11].data = ref::selective_scan_fwd_ref(shape_of_problem(p), scan_inputs_of(p, in, 1), kStateStride).states;
}

OpDef scan_base(const char* name, const char* doc, bool with_seqlen) {
  OpDef op;
  op.info.name = name;
  op.info.family = "selective_scan";
  op.info.doc = doc;
  op.info.params = param_defs(with_seqlen);
  op.info.dims = scan_dims(with_seqlen);
  op.info.reference = "api/ops/selective_scan/reference.cpp (python/kspec/reference/selective_scan.py)";
  op.info.constants = {{"state_stride", kStateStride}};  // kspec._torch allocates `states` with it
  op.check = check_scan;
  op.check_call = check_scan_call;
  // The tuning bucket: the default's, but nstates (seqlen's, derived).
  op.tune_bucket = [](const Problem& p) { return pow2_bucket(p, "nstates"); };
  op.cases = scan_cases(with_seqlen);
  op.compile_dims = {{"batch", 1}, {"dim", 1}, {"groups", 1}};
  if (with_seqlen) {
    op.compile_dims.emplace_back("seqlen", 1);
    op.derived_dims.emplace_back("nstates", [](const Problem& p) { return nstates_for(p.dim("seqlen")); });
  }
  op.dtypes = kFloatTypes;
  // fp32 over recurrences of hundreds to 65536 steps, with ex2.approx decays: 4e-5.
  op.tolerance_scale = 4.0;
  return op;
}

void check_launch_sizes(const Call& call) {
  const Problem& p = call.problem;
  KSPEC_CHECK(p.dim("batch") <= 65535, p.op->info.name, ": input 'u': batch = ", p.dim("batch"), " exceeds 65535");
  KSPEC_CHECK(p.dim("dim") <= INT32_MAX / 32 && (!p.has_dim("seqlen") || p.dim("seqlen") <= INT32_MAX / 2),
              p.op->info.name, ": input 'u': dim or seqlen too large");
}

}  // namespace kspec::scan
