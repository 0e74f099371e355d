// The internal definition of an op: everything about it in one place (schema, specialization, tuning
// space, launcher, float64 reference, cases). api/ops/<family>/op.cpp fills these; the registry,
// validation, compile, precompile, tests and benchmarks all read them.
#pragma once

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "jit/spec.h"
#include "kspec/registry.h"
#include "kspec/tune.h"

namespace kspec {

struct TensorMeta {
  bool present = false;
  DType dtype = DType::f32;
  bool alt = false;  // laid out as its TensorDef::alt_shape
};

// A call reduced to what decides the specialization: dtypes, presence, dims, params, arch, alignment.
// Built from real tensors by validation, or from a CompileRequest without any tensors.
struct Problem {
  const struct OpDef* op = nullptr;
  std::vector<TensorMeta> inputs, outputs;
  std::vector<std::pair<std::string, int64_t>> dims;
  Params params;      // complete: defaults filled in
  std::string arch;   // NVRTC target: "sm_90a"
  int align_bytes = 16;  // the largest power of two (≤16) dividing every pointer and row stride in bytes
  // Leading dims collapsed into a "...name" dim, as the first input with it had them (for outputs).
  std::vector<std::pair<std::string, std::vector<int64_t>>> leading;

  int64_t dim(std::string_view name) const;  // inline below, as are in/out and the params
  DType dtype(std::string_view tensor) const;
  bool present(std::string_view tensor) const;
  bool alt(std::string_view tensor) const;  // given in its TensorDef::alt_shape
  bool has_dim(std::string_view name) const;
  int64_t param_int(std::string_view name) const;
  double param_float(std::string_view name) const;
  bool param_bool(std::string_view name) const;
  const std::string& param_str(std::string_view name) const;
  // Everything that can change the compiled code (Var dims excluded), as one canonical line.
  std::string signature() const;
};

// What an op builds once for a bound call (kspec::BoundCall) and reads on every run, e.g. adamw's table
// of tensors and chunks already in device memory.
struct BoundData {
  virtual ~BoundData() = default;
};

// A validated call with its tensors.
struct Call {
  Problem problem;
  std::vector<TensorView> inputs, outputs;
  int device = 0;
  Stream stream = nullptr;
  const BoundData* bound = nullptr;  // set when a BoundCall runs an op that has a bind function
  const TensorView& in(std::string_view name) const;
  const TensorView& out(std::string_view name) const;
  // Row stride (elements) of a RowStrided tensor whose leading dims were collapsed.
  int64_t row_stride(const TensorView& t) const;
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// What an op's launcher sees: the loaded kernels of its plan, a workspace, and the stream.
class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual void launch(size_t kernel, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) = 0;
  // The same with the grid's CTAs in thread-block clusters of `cluster` (sm_90+; each grid dim a
  // multiple of the cluster's), through cuLaunchKernelEx's cluster-dimension attribute.
  virtual void launch_clusters(size_t kernel, Dim3 grid, Dim3 block, Dim3 cluster, unsigned shared_bytes,
                               void** args) = 0;
  // The same as launch, for a kernel that may start while the one launched before it on the stream still
  // runs (programmatic dependent launch, sm_90+): its blocks begin once every block of that kernel has
  // executed griddepcontrol.launch_dependents (or ended), so the kernel must wait for the data it needs
  // itself. Before sm_90 a plain launch.
  virtual void launch_dependent(size_t kernel, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) = 0;
  // Device scratch memory: outside graph capture, kspec's buffer for this device and stream (grown on
  // demand); inside a capture, an allocation of the graph itself, freed in the graph after the op. A
  // larger request moves it: an op asks once for all it needs.
  virtual void* workspace(size_t bytes) = 0;
  virtual int multiprocessors() const = 0;
  // Blocks of a plan's kernel that fit on one multiprocessor at once (cuOccupancy…), cached per kernel.
  virtual int occupancy(size_t kernel, unsigned block_threads, unsigned shared_bytes) = 0;
};

struct TuningSpace {
  std::vector<std::pair<std::string, std::vector<int64_t>>> axes;
  // Whether a config is legal for a problem; `why` says what rules it out.
  std::function<bool(const Problem&, const Config&, std::string* why)> valid;
  // The default when nothing is tuned.
  std::function<Config(const Problem&)> heuristic;
  // Optional: threads per block of the plan's widest kernel, so the tuner drops a config that the
  // device cannot launch before compiling it, and one whose registers x threads exceed the block's
  // register file after.
  std::function<int64_t(const Problem&, const Config&)> block_threads;
  // Optional, for a space that is not a product of axes but comes from a library on the GPU (cuBLASLt's
  // heuristic candidates): the configs to time for a call (the tuner adds the heuristic's default, and
  // dispatch judges a recorded config by `valid` alone; the launcher may still refuse it and fall back).
  std::function<std::vector<Config>(const Call&, int max_candidates)> candidates;
  // Optional: more configs to time once the first ones are timed (e.g. gemm.bwd's best dx and best dW
  // algorithms together, each found with the other GEMM on its default).
  std::function<std::vector<Config>(const Problem&, const std::vector<TuneCandidate>& timed)> refine;
  // Optional: what a call will really use of a config (explain): "" when it applies as is, else why not
  // (e.g. cuBLASLt refuses a tuned algorithm for this call's layout, and the heuristic runs instead).
  std::function<std::string(const Call&, const Config&)> applies;
  bool empty() const { return axes.empty() && !candidates; }
  std::vector<Config> enumerate(const Problem& p) const;
  // Every combination of the axes, legal or not (the tuner reports why each one is ruled out).
  std::vector<Config> all_combinations() const;
};

struct HostTensor {
  bool defined = false;
  std::vector<int64_t> shape;
  std::vector<double> data;
  int64_t numel() const;
};

// One row of an op's case table (tests, benchmarks, precompile and the checker read it).
struct Case {
  std::string name;
  std::vector<std::pair<std::string, int64_t>> dims;
  Params params;
  std::vector<std::string> without;  // optional inputs left out
  std::vector<std::pair<std::string, DType>> tensor_dtypes;
  std::vector<std::string> alt_shapes;  // inputs given in their TensorDef::alt_shape
  bool large = false;                // skipped by quick runs and by precompile
  bool representative = false;       // compiled by `kspec precompile --all` for every config
  bool typical = false;              // the op's everyday call: what `kspec precompile` compiles (else the first case)
};

struct OpDef {
  OpInfo info;
  // The NVRTC kernels a problem needs with a given config (index = kernel number in Launcher::launch).
  // Left empty by a library op (one whose launch calls a CUDA library such as cuBLASLt on call.stream,
  // with the Launcher's workspace): nothing to compile or precompile. May also return no kernels.
  std::function<std::vector<jit::KernelSpec>(const Problem&, const Config&)> kernels;
  std::function<void(const Call&, const Config&, Launcher&)> launch;
  // Optional: data a BoundCall builds once from its validated call and plan config (launch then finds it
  // in Call::bound). It may allocate device memory; it must not depend on runtime params or outputs.
  std::function<std::unique_ptr<BoundData>(const Call&, const Config&)> bind;
  // Optional: checks the schema cannot state (e.g. the strides a matmul operand may have), run at the
  // end of validation; throws InvalidArgument naming the argument.
  std::function<void(const Call&)> check_call;
  TuningSpace tuning;
  // float64 reference: outputs from inputs (HostTensors indexed like the schema).
  std::function<std::vector<HostTensor>(const Problem&, const std::vector<HostTensor>&)> reference;
  // Optional: overwrite inputs that must be consistent with others (saved statistics...).
  std::function<void(const Problem&, std::vector<HostTensor>&)> prepare_inputs;
  // False when prepare_inputs only makes inputs agree with the float64 reference and random ones time
  // the same (the tuner then skips it: gemm.bwd's saved pre-activation, a float64 GEMM on the host).
  bool prepare_for_timing = true;
  // Optional: rules across arguments that the schema cannot state (a dim dividing another, a size
  // limit); throws InvalidArgument/Unsupported naming the argument. Run by validation and compile.
  std::function<void(const Problem&)> check;
  // Optional: compile-time facts derived from runtime (Var) dims, e.g. "seqlen is a multiple of the
  // tile"; part of the problem signature, so the plan cache tells such problems apart.
  std::function<std::string(const Problem&)> derived_key;
  // Relative-error tolerance multiplier for long recurrences (1 = the dtype table).
  double tolerance_scale = 1.0;
  // Optional (0 = the dtype table's 1e-5): an fp32 run's tolerance where the op's spec states its own, e.g.
  // a backward whose sums over tokens cancel (mhc's: 1e-4, as issue 34 states). Other dtypes keep theirs.
  double f32_tolerance = 0.0;
  // Optional: per output (the outputs' order; 0 = none), the 2-norm of the magnitudes of the terms the
  // output sums, from the inputs and the float64 reference's outputs. An output that is a difference of
  // nearly equal terms (mlstm's df: a sum of q.dq - k.dk) is measured against this norm where it is larger
  // than the output's own: the error the inputs' and intermediates' rounding cause scales with the terms,
  // not with their small difference, so ||out - ref|| / ||ref|| says nothing of the kernel there.
  std::function<std::vector<double>(const Problem&, const std::vector<HostTensor>& in,
                                    const std::vector<HostTensor>& ref)>
      error_scale;
  std::vector<Case> cases;
  // Optional: the tuning database's shape bucket of a problem (nearby shapes share a tuned config):
  // a short text over its runtime dims. Default (tune_bucket in api/src/tuning.h): every Var dim
  // rounded up to a power of two, "rows=16384".
  std::function<std::string(const Problem&)> tune_bucket;
  // Dims with a value when compiling without tensors (e.g. rows=1 for Var dims).
  std::vector<std::pair<std::string, int64_t>> compile_dims;
  // Optional: a runtime dim that follows from others (a checkpoint count from seqlen), as value(p) of a
  // request's problem when the request does not give it (after compile_dims; before any other default).
  std::vector<std::pair<std::string, std::function<int64_t(const Problem&)>>> derived_dims;
  std::vector<DType> dtypes;  // the op's main dtypes (for precompile and checks)
  // False for ops the generic GPU checker (api/src/check.cpp) cannot drive (TensorList inputs): their
  // own tests compare them with the reference.
  bool generic_check = true;
};

class Registry {
 public:
  static Registry& global();
  void add(OpDef def);
  const OpDef& get(std::string_view name) const;  // throws InvalidArgument listing known ops
  const OpDef* find(std::string_view name) const;
  std::vector<std::string> names() const;

 private:
  std::vector<std::unique_ptr<OpDef>> ops_;
};

// The one registration list (api/src/ops_list.cpp): one line per op family.
void register_all_ops(Registry& r);

// Validation (api/src/validate.cpp): checks every tensor and param against the schema.
// inputs_only: check the inputs alone (outputs not given yet: infer_outputs).
Call validate_call(const OpDef& op, const std::vector<TensorView>& inputs,
                   const std::vector<TensorView>& outputs, const Params& params, Stream stream,
                   bool inputs_only = false);
// Every param checked against its ParamDef (type, choices, range, finite) and defaults filled in.
Params complete_params(const OpDef& op, const Params& given);
// The values a dim may take (DimDef::min/max, else the defaults for its kind).
std::pair<int64_t, int64_t> dim_range(const DimDef& d);
// Every bound dim of a problem within its range; throws InvalidArgument naming the dim.
void check_dims(const Problem& p);
// Whether a config names each axis of the op's tuning space once, with one of the axis' values, and
// nothing else (not whether it suits a problem: TuningSpace::valid). A space from a library
// (TuningSpace::candidates) has no fixed axes: always true there.
bool config_in_space(const OpDef& op, const Config& c, std::string* why);
// A problem from a compile request (no tensors).
Problem problem_from_request(const OpDef& op, const CompileRequest& req);
// Shapes from dims for each tensor of a problem (used by checks and benchmarks to allocate).
std::vector<int64_t> shape_of(const TensorDef& t, const Problem& p);
// Refuses an output that shares memory with an input (but its TensorDef::in_place_of itself) or with
// another output, naming both (api/src/tensor.cpp; run by validate_call and BoundCall::run).
void check_no_overlap(const OpInfo& info, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs);

// ---- the lookups every launch makes by name, inline ----
// A launcher reads its tensors, dims, params and config by name (call.in("x"), c.get("vec")) on every call:
// inline, the compiler compares each literal in place (a length test, a few bytes), where the out-of-line
// lookups called libc's memcmp per entry (70-100 instructions a lookup, nine in norm_act's launch: most of
// a cached call's host path after its key; tools/bench/NOTES.md). The errors stay out of line.

// The index of the tensor named `name` in defs, -1 if none.
inline int schema_index(const std::vector<TensorDef>& defs, std::string_view name) {
  for (size_t i = 0; i < defs.size(); ++i)
    if (defs[i].name == name) return static_cast<int>(i);
  return -1;
}

// The position of input / output `name` in an op's schema, for a launcher that resolves its tensors' names
// once, when its op is made, and reads call.inputs[i] on every call. InternalError for a name the schema
// lacks (a bug in the op's definition, raised at registration).
size_t input_index(const OpInfo& info, std::string_view name);
size_t output_index(const OpInfo& info, std::string_view name);

[[noreturn]] void throw_unbound_dim(const Problem& p, std::string_view name);
[[noreturn]] void throw_no_param(const Problem& p, std::string_view name);
[[noreturn]] void throw_no_tensor(const Problem& p, const char* kind, std::string_view name);

inline int64_t Problem::dim(std::string_view name) const {
  for (const auto& d : dims)
    if (d.first == name) return d.second;
  throw_unbound_dim(*this, name);
}

inline const ParamValue& problem_param(const Problem& p, std::string_view name) {
  const ParamValue* v = p.params.find(name);
  if (!v) throw_no_param(p, name);
  return *v;
}
inline int64_t Problem::param_int(std::string_view name) const { return std::get<int64_t>(problem_param(*this, name)); }
inline double Problem::param_float(std::string_view name) const { return std::get<double>(problem_param(*this, name)); }
inline bool Problem::param_bool(std::string_view name) const { return std::get<bool>(problem_param(*this, name)); }
inline const std::string& Problem::param_str(std::string_view name) const {
  return std::get<std::string>(problem_param(*this, name));
}

inline const TensorView& Call::in(std::string_view name) const {
  const int i = schema_index(problem.op->info.inputs, name);
  if (i < 0) throw_no_tensor(problem, "input", name);
  return inputs[static_cast<size_t>(i)];
}
inline const TensorView& Call::out(std::string_view name) const {
  const int i = schema_index(problem.op->info.outputs, name);
  if (i < 0) throw_no_tensor(problem, "output", name);
  return outputs[static_cast<size_t>(i)];
}

// One kernel of an op's plan: template header, kernel template name and arguments, for the problem's arch.
inline jit::KernelSpec kernel_spec(const Problem& p, std::string header, std::string kernel,
                                   std::vector<std::string> targs) {
  jit::KernelSpec s;
  s.header = std::move(header);
  s.kernel = std::move(kernel);
  s.targs = std::move(targs);
  s.arch = p.arch;
  return s;
}

// One TensorDef from its fields in schema order (the op definitions' tables read as one line per tensor).
inline TensorDef tensor_def(std::string name, std::vector<std::string> shape, std::vector<DType> dtypes,
                            std::string dtype_of, bool or_f32, bool optional, std::string present_with, Layout layout,
                            std::string doc, std::vector<std::string> alt = {}) {
  TensorDef d;
  d.name = std::move(name);
  d.shape = std::move(shape);
  d.dtypes = std::move(dtypes);
  d.dtype_of = std::move(dtype_of);
  d.or_float32 = or_f32;
  d.optional = optional;
  d.present_with = std::move(present_with);
  d.layout = layout;
  d.doc = std::move(doc);
  d.alt_shape = std::move(alt);
  return d;
}


}  // namespace kspec
