// The op registry: one way to call every op, from C++ and from Python. An op is defined once (schema,
// plan, tuning space, launcher, float64 reference: see api/src/op.h); callers use kspec::call() or the
// typed wrappers in kspec/ops/*.h.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kspec/tensor.h"

struct CUstream_st;

namespace kspec {

// Same type as cudaStream_t and CUstream; nullptr is the legacy default stream.
using Stream = CUstream_st*;

using ParamValue = std::variant<int64_t, double, bool, std::string>;
std::string param_to_string(const ParamValue& v);

// A small ordered map of named scalar parameters: {{"norm", "rmsnorm"}, {"eps", 1e-6}}.
class Params {
 public:
  Params() = default;
  Params(std::initializer_list<std::pair<std::string, ParamValue>> items);
  Params& set(const std::string& name, ParamValue value);
  // Inline (as Config::get): a launcher's literal name is compared in place, not through a libc memcmp.
  const ParamValue* find(std::string_view name) const {
    for (const auto& kv : items_)
      if (kv.first == name) return &kv.second;
    return nullptr;
  }
  const std::vector<std::pair<std::string, ParamValue>>& items() const { return items_; }
  void reserve(size_t n) { items_.reserve(n); }
  void clear() { items_.clear(); }  // keeps the storage, for a Params refilled per call

 private:
  std::vector<std::pair<std::string, ParamValue>> items_;
};

// ---- Schema (what `kspec ops` prints and what validation messages are generated from) ----

enum class ParamType { Int, Float, Bool, Choice };

struct ParamDef {
  std::string name;
  ParamType type = ParamType::Int;
  ParamValue default_value = int64_t(0);
  std::vector<std::string> choices;  // for Choice
  std::string doc;
  // A value the launcher passes to the kernels (a learning rate, a step count): it changes nothing
  // compiled, so it stays out of the problem signature and the plan cache.
  bool runtime = false;
  // Int and Float: the smallest and largest value allowed (inclusive; none: unbounded). Validation and
  // compile requests check them before anything compiles; a Float must also be finite.
  std::optional<double> min = std::nullopt, max = std::nullopt;
  // Choice: other accepted spellings, (alias, choice); validation replaces an alias by its choice, so
  // the two spell the same problem.
  std::vector<std::pair<std::string, std::string>> aliases = {};
};

// Runtime (Var) axes change nothing compiled; Const axes are template arguments; Bucket axes are
// compile-time but rounded up to one of the listed sizes.
enum class DimKind { Var, Const, Bucket };

struct DimDef {
  std::string name;
  DimKind kind = DimKind::Var;
  std::vector<int64_t> buckets;
  std::string doc;
  // The values allowed (inclusive), checked before anything compiles. Unset: a Var dim 0..2^63-1; a Const
  // or Bucket dim, a template argument, 1..2^31-1 (dim_range in api/src/problem.cpp).
  std::optional<int64_t> min = std::nullopt, max = std::nullopt;
};

// How a tensor may be laid out in memory.
enum class Layout {
  Contiguous,  // row-major, no gaps
  RowStrided,  // last dim contiguous; leading dims collapse into one row index with any row stride
  Strided,     // any strides; the op's check_call states what it accepts (e.g. a matmul operand)
};

struct TensorDef {
  std::string name;
  // Dim names. A first entry "...name" stands for any number of leading dims (also none) whose
  // product binds `name`; outputs repeat the leading dims of the first input that has it.
  std::vector<std::string> shape;
  std::vector<DType> dtypes;     // allowed dtypes; ignored when dtype_of is set
  std::string dtype_of;          // must have the dtype of this other tensor...
  bool or_float32 = false;       // ...or float32 (e.g. weights of a bf16 model kept in fp32)
  bool optional = false;
  std::string present_with;      // outputs: present iff this input is present, or this bool param is true
  Layout layout = Layout::RowStrided;
  std::string doc;
  // Optional: a second accepted shape of another rank (e.g. a weight that is either per-channel [dim, dstate] or
  // input-dependent [batch, groups, dstate, seqlen]); a tensor's rank picks one. Which one a call used is
  // part of the specialization (Problem: TensorMeta::alt; compile requests: CompileRequest::alt_shapes).
  std::vector<std::string> alt_shape = {};
  // A TensorList input: one argument slot holding any number of tensors (TensorView::list), each of
  // any shape (`shape` is not used), all on one device with one dtype, laid out as `layout` says.
  bool list = false;
  std::string same_shapes_as = {};  // lists: element i has the shape of element i of this other list
  // Outputs: may be this input itself, updated in place (the same pointer, dtype, shape and strides).
  // Any other sharing of memory between an output and an input or another output is refused.
  std::string in_place_of = {};
};

struct OpInfo {
  std::string name;
  std::string family;
  std::string doc;
  std::vector<TensorDef> inputs, outputs;
  std::vector<ParamDef> params;
  std::vector<DimDef> dims;
  std::vector<std::pair<std::string, std::vector<int64_t>>> tuning_axes;
  // Named choices: an axis whose values are alternatives rather than sizes lists a name per value (in
  // tuning_axes' order), e.g. {"algo", {"warp", "sequential", "tile"}}. Configs are then written with the
  // name ("algo=tile": explain, the tuning database) and read with the name or the number.
  std::vector<std::pair<std::string, std::vector<std::string>>> tuning_names;
  std::string tuning_note;  // a space that is not a product of axes (gemm: cuBLASLt's candidates)
  std::string reference;  // where the float64 reference lives
  // Named constants of the op that its callers must agree with (the scan's state_stride: the forward keeps
  // the state entering every state_stride-th step); Python and the tests read them from here.
  std::vector<std::pair<std::string, int64_t>> constants = {};
};

// Relative error ‖out−ref‖/‖ref‖ allowed against the float64 reference by dtype: the one table (checks,
// tuner, tests and benchmarks read it; an op's OpInfo::tolerance_scale multiplies it).
double tolerance_for(DType dtype);
// The same for one op's outputs: tolerance_for(dtype) times the op's scale (long recurrences allow more).
double op_tolerance(std::string_view op, DType dtype);

// One row of an op's case table, as tests and benchmarks outside C++ read it (kspec.op_info(op)["cases"]).
struct CaseInfo {
  std::string name;
  std::vector<std::pair<std::string, int64_t>> dims;
  Params params;
  std::vector<std::string> without;                           // optional inputs left out
  std::vector<std::pair<std::string, DType>> tensor_dtypes;   // per-tensor dtypes (else the op's dtype)
  std::vector<std::string> alt_shapes;                        // inputs given in their alternative shape
  bool large = false;
};
std::vector<CaseInfo> op_cases(std::string_view op);

std::vector<std::string> list_ops();
const OpInfo& op_info(std::string_view name);  // throws InvalidArgument for an unknown op
std::string describe_op(std::string_view name);  // human-readable schema

// ---- Calling ----

// A tuning configuration: {{"threads_per_row", 128}, {"vec", 8}}.
struct Config {
  std::vector<std::pair<std::string, int64_t>> values;
  // Inline: every launch reads its config by name, and a literal compared in place costs a few
  // instructions where an out-of-line std::string == string_view called memcmp per entry.
  int64_t get(std::string_view name) const {
    for (const auto& kv : values)
      if (kv.first == name) return kv.second;
    missing(name);
  }
  bool has(std::string_view name) const;
  std::string str() const;  // "threads_per_row=128,vec=8": every value a number (plan keys, comparisons)
  // The text a user reads and the tuning database stores: a named choice by its name ("algo=tile,warps=4").
  std::string str(const OpInfo& op) const;
  static Config parse(std::string_view text);
  // The same, also reading the op's named choices ("algo=tile"); a number is still read (older tuning
  // entries and scripts). An unknown name throws InvalidArgument listing the axis' names.
  static Config parse(std::string_view text, const OpInfo& op);

 private:
  [[noreturn]] void missing(std::string_view name) const;  // InvalidArgument naming it and the config
};

struct CallOptions {
  const Config* config = nullptr;  // force a tuning configuration (tests, tuner); else tuned/heuristic
};

// Validates every argument, picks the specialization, compiles or loads it (once), and launches on
// `stream`. Inputs/outputs are positional as in the op's schema; a left-out optional is TensorView().
void call(std::string_view op, const std::vector<TensorView>& inputs,
          const std::vector<TensorView>& outputs, const Params& params = {}, Stream stream = nullptr,
          const CallOptions& options = {});
// The same with the lists written at the call (kspec::call("op", {x, w, b}, {y}, ...)): read in place, where
// the overload above would build two vectors (two heap allocations and copies of each view) per call.
void call(std::string_view op, std::initializer_list<TensorView> inputs, std::initializer_list<TensorView> outputs,
          const Params& params = {}, Stream stream = nullptr, const CallOptions& options = {});

// A call validated once and launched again and again on the same tensors (an optimizer's step over the
// same parameter lists): the constructor does everything call() does before a launch — every tensor of
// every list validated, the plan (tuned or heuristic config) and the op's own tables (adamw uploads its
// table of tensors and chunks to device memory once) — and run() then takes only the params declared
// runtime (lr, step, ...) and outputs laid out like the bound ones. Its view of the inputs is fixed:
// when a pointer, shape or dtype changes, build a new one (Python's kspec.optim.AdamW does so by
// comparing every pointer before each step). Destroying one with tables of its own in device memory
// (adamw's) waits for its last run's kernels; one without has nothing to wait for.
class BoundCall {
 public:
  BoundCall(std::string_view op, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
            const Params& params = {});
  ~BoundCall();
  BoundCall(const BoundCall&) = delete;
  BoundCall& operator=(const BoundCall&) = delete;
  // Throws InvalidArgument for a param that is not runtime, or an output unlike the bound one.
  void run(const Params& runtime_params, const std::vector<TensorView>& outputs, Stream stream = nullptr);
  const std::string& config() const;  // the plan's config (as text)
  int64_t runs() const;
  // Whether destroying it would not wait: its last run's kernels have finished, or it holds no tables they
  // read (always true then). Never blocks.
  bool idle() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Output shapes and dtypes for given inputs (callers that allocate outputs: Python, tests).
struct OutputSpec {
  bool present = true;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
};
std::vector<OutputSpec> infer_outputs(std::string_view op, const std::vector<TensorView>& inputs,
                                      const Params& params = {});
// The same into *out, whose storage is reused: a signature seen before allocates nothing (a caller that
// allocates outputs per call keeps one vector).
void infer_outputs(std::string_view op, const std::vector<TensorView>& inputs, const Params& params,
                   std::vector<OutputSpec>* out);

// ---- Compiling without a GPU ----

struct CompileRequest {
  std::string op;
  DType dtype = DType::f32;             // the op's main dtype (applied to every tensor that admits it)
  std::string arch = "sm_90";
  Params params;                        // scalar params and Const/Bucket dims ("hidden": 4096)
  std::vector<std::string> without;     // optional inputs left out
  std::vector<std::pair<std::string, DType>> tensor_dtypes;  // per-tensor overrides
  std::vector<std::string> alt_shapes;  // tensors given in their TensorDef::alt_shape
  std::optional<Config> config;         // else the heuristic's choice
};

struct CompileReport {
  std::string op;
  std::string kernel;        // name expression
  std::string spec;          // canonical text
  std::string key;
  std::string source;        // "compiled", "disk" or "memory"
  double compile_ms = 0;     // this process's compile (0 unless source == "compiled")
  double load_ms = 0;        // time to obtain the binary (compile or disk read)
  int registers = -1, spill_bytes = -1, stack_bytes = -1, shared_bytes = -1;
  std::string arch;
  std::string path;          // cache entry, "" if memory only
  std::string config;
  std::string log;
};

// Compiles every kernel a call would launch; one report per kernel.
std::vector<CompileReport> compile(const CompileRequest& request);

// Every specialization `kspec precompile --all` builds: for each op, its cases x dtypes x every legal
// configuration of its tuning space.
std::vector<CompileRequest> precompile_plan(const std::vector<std::string>& archs,
                                            const std::vector<std::string>& ops = {});

// Every case (as precompile_plan takes them: not the large, only the representative ones where an op marks
// them) x dtype of each op with kernels, with the config dispatch chooses for that case's call (its full dims):
// the plans calls run by default. `kspec precompile --defaults ARCH`; CI sweeps sm_90's tuning spaces whole
// (precompile_plan) and sm_80's defaults.
std::vector<CompileRequest> defaults_plan(const std::vector<std::string>& archs,
                                          const std::vector<std::string>& ops = {});

// What `kspec precompile` (and the main job without a GPU) builds in about a minute: for each op that has
// kernels and each of its dtypes, the one call its case table marks typical (else its first case), with
// the config dispatch would choose: the requests `kspec compile` makes for that call, so it is a cache hit.
std::vector<CompileRequest> quick_plan(const std::vector<std::string>& archs,
                                       const std::vector<std::string>& ops = {});

// Counters of this process (the "hook" tests use to count compilations).
struct Counters {
  int64_t compiled = 0, disk_hits = 0, memory_hits = 0, launches = 0;
};
Counters counters();

// What a call would use: op, problem signature, config, kernels and their cache entries.
std::string explain(std::string_view op, const std::vector<TensorView>& inputs,
                    const std::vector<TensorView>& outputs, const Params& params = {});

}  // namespace kspec
