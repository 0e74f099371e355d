// Requests that read a plan without running it: explain (the config, its source, the kernels and their
// cache entries), compile without a GPU, and the precompile plan over the ops' cases.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "api/src/plan.h"
#include "api/src/tuning.h"
#include "api/src/kernels.h"
#include "cache/disk_cache.h"
#include "jit/driver.h"
#include "jit/key.h"
#include "kspec/knobs.h"

namespace kspec {

namespace {

PlanInfo plan_info(const OpDef& op, const Problem& p, int device, const Call* call = nullptr) {
  knobs::validate();
  ConfigChoice ch = choose_config(op, p, nullptr, device);
  if (call && ch.source == "tuned" && op.tuning.applies) {
    // A library's tuned config may still be refused for this call (cuBLASLt checks the algorithm against
    // the call's layouts): say what the launch will really do.
    std::string why = op.tuning.applies(*call, ch.config);
    if (!why.empty()) {
      ch.note = "tuned entry {" + ch.config.str(op.info) + "} does not apply to this call: " + why;
      ch.config = op.tuning.heuristic ? op.tuning.heuristic(p) : Config{};
      ch.source = "heuristic";
    }
  }
  PlanInfo info;
  info.op = op.info.name;
  info.signature = p.signature();
  info.bucket = tune_bucket(p);
  info.config = ch.config.str(op.info);
  info.config_source = ch.source;
  info.note = ch.note;
  info.tuning_db = ch.db_path.empty() ? tuning_db_path(device) : ch.db_path;
  info.tuning_key = ch.key.empty() ? tuning_key(p) : ch.key;
  TuneMode mode = tune_mode();
  info.tune_mode = mode == TuneMode::Off ? "off" : mode == TuneMode::Auto ? "auto" : "on";
  for (const auto& spec : kernel_specs(op, p, ch.config)) {
    std::string key = jit::content_key(spec);
    info.kernels.push_back({spec.name_expression(), spec.arch, key, disk_cache().entry_path(key)});
  }
  return info;
}

// A device to read the tuning database for when there are no tensors: the first GPU, if any.
int default_device() { return jit::driver_available() && jit::device_count() > 0 ? 0 : -1; }

}  // namespace

std::string PlanInfo::str() const {
  std::ostringstream os;
  os << "op: " << op << "\nspecialization: " << signature << "\nshape bucket: " << bucket << "\nconfig: " << config
     << " (" << config_source << ")\n";
  if (!note.empty()) os << "  note: " << note << "\n";
  os << "tuning database: " << tuning_db << " (KSPEC_TUNE=" << tune_mode << ")\n  key: " << tuning_key << "\n";
  if (kernels.empty()) os << "kernels: none (a library op, or nothing to launch)\n";
  for (const auto& k : kernels)
    os << "kernel: " << k.name << "\n  arch: " << k.arch << "\n  key: " << k.key << "\n  cache entry: " << k.cache_path
       << "\n";
  return os.str();
}

PlanInfo explain_plan(std::string_view op_name, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs, const Params& params) {
  const OpDef& op = Registry::global().get(op_name);
  Call c = validate_call(op, inputs, outputs, params, nullptr);
  c.problem.arch = device_arch(c.device);
  return plan_info(op, c.problem, c.device, &c);
}

PlanInfo explain_request(const CompileRequest& req) {
  const OpDef& op = Registry::global().get(req.op);
  Problem p = problem_from_request(op, req);
  return plan_info(op, p, default_device());
}

std::string explain(std::string_view op_name, const std::vector<TensorView>& inputs,
                    const std::vector<TensorView>& outputs, const Params& params) {
  return explain_plan(op_name, inputs, outputs, params).str();
}

// ---- compile without a GPU ----

std::vector<CompileReport> compile(const CompileRequest& req) {
  knobs::validate();  // also for an op with no kernel to obtain
  const OpDef& op = Registry::global().get(req.op);
  Problem p = problem_from_request(op, req);
  Config cfg = choose_config(op, p, req.config ? &*req.config : nullptr, default_device()).config;
  std::vector<CompileReport> out;  // empty for a library op or a problem that needs no kernel
  for (const auto& spec : kernel_specs(op, p, cfg)) {
    Obtained ob = obtain_binary(spec);
    CompileReport r;
    r.op = op.info.name;
    r.kernel = spec.name_expression();
    r.spec = spec.canonical();
    r.key = ob.entry->key;
    r.source = ob.source;
    r.compile_ms = ob.source == "compiled" ? ob.entry->compile_ms : 0;
    r.load_ms = ob.ms;
    r.registers = ob.entry->resources.registers;
    r.spill_bytes = ob.entry->resources.spill_bytes;
    r.stack_bytes = ob.entry->resources.stack_bytes;
    r.shared_bytes = ob.entry->resources.static_shared_bytes;
    r.arch = spec.arch;
    r.path = ob.entry->path;
    r.config = cfg.str(op.info);
    r.log = ob.entry->log;
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// A case as the request `kspec compile` makes for it: its params, Const dims and inputs, no runtime dims.
CompileRequest case_request(const OpDef& op, const Case& cs, DType dt, const std::string& arch) {
  CompileRequest req;
  req.op = op.info.name;
  req.dtype = dt;
  req.arch = arch;
  req.without = cs.without;
  req.tensor_dtypes = cs.tensor_dtypes;
  req.alt_shapes = cs.alt_shapes;
  for (const auto& [k, v] : cs.params.items()) req.params.set(k, v);
  for (const auto& [k, v] : cs.dims) {
    bool is_dim = false;
    for (const auto& d : op.info.dims) is_dim = is_dim || (d.name == k && d.kind != DimKind::Var);
    if (is_dim) req.params.set(k, v);
  }
  return req;
}

// The cases the precompile plans take: not the large ones, and only the representative ones where an op marks them.
std::vector<const Case*> plan_cases(const OpDef& op) {
  const bool any_rep = std::any_of(op.cases.begin(), op.cases.end(), [](const Case& c) { return c.representative; });
  std::vector<const Case*> out;
  for (const Case& cs : op.cases)
    if (!cs.large && (!any_rep || cs.representative)) out.push_back(&cs);
  return out;
}

// The kernels a problem and config launch, as one string ("" for none): the plans keep one request per kernel set.
std::string kernel_set(const OpDef& op, const Problem& p, const Config& cfg) {
  std::string sig;
  for (const auto& spec : op.kernels(p, cfg)) sig += spec.canonical() + "\n";
  return sig;
}

}  // namespace

std::vector<CompileRequest> quick_plan(const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
  std::vector<CompileRequest> out;
  const Registry& reg = Registry::global();
  for (const auto& name : ops.empty() ? reg.names() : ops) {
    const OpDef& op = reg.get(name);
    if (!op.kernels || op.cases.empty()) continue;  // a library op: nothing to compile
    auto it = std::find_if(op.cases.begin(), op.cases.end(), [](const Case& c) { return c.typical; });
    const Case& cs = it != op.cases.end() ? *it : op.cases.front();
    for (const auto& arch : archs)
      for (DType dt : op.dtypes) out.push_back(case_request(op, cs, dt, arch));
  }
  return out;
}

std::vector<CompileRequest> defaults_plan(const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
  std::vector<CompileRequest> out;
  const Registry& reg = Registry::global();
  for (const auto& name : ops.empty() ? reg.names() : ops) {
    const OpDef& op = reg.get(name);
    if (!op.kernels) continue;  // a library op: nothing to compile
    for (const auto& arch : archs) {
      std::set<std::string> seen;  // one request per distinct kernel set
      for (const Case* cs : plan_cases(op)) {
        for (DType dt : op.dtypes) {
          CompileRequest req = case_request(op, *cs, dt, arch);
          for (const auto& [k, v] : cs->dims) req.params.set(k, v);
          const Problem p = problem_from_request(op, req);
          const std::string sig = kernel_set(op, p, choose_config(op, p, nullptr, default_device()).config);
          if (!sig.empty() && seen.insert(sig).second) out.push_back(std::move(req));
        }
      }
    }
  }
  return out;
}

std::vector<CompileRequest> precompile_plan(const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
  std::vector<CompileRequest> out;
  const Registry& reg = Registry::global();
  for (const auto& name : ops.empty() ? reg.names() : ops) {
    const OpDef& op = reg.get(name);
    if (!op.kernels) continue;  // a library op: nothing to compile
    // the algorithm axis (a tuning space's first axis), if any
    const std::string first = op.tuning.axes.empty() ? std::string() : op.tuning.axes.front().first;
    for (const auto& arch : archs) {
      std::set<std::string> seen;  // one request per distinct kernel set
      for (const Case* cs : plan_cases(op)) {
        for (DType dt : op.dtypes) {
          const CompileRequest req = case_request(op, *cs, dt, arch);
          auto add = [&](const CompileRequest& base, const Problem& p, const Config& cfg) {
            const std::string sig = kernel_set(op, p, cfg);
            if (sig.empty() || !seen.insert(sig).second) return;
            CompileRequest r = base;
            r.config = cfg;
            out.push_back(std::move(r));
          };
          const Problem p = problem_from_request(op, req);
          std::set<int64_t> algos;  // values of the first axis (the algorithm) these dims admit
          for (const auto& cfg : op.tuning.enumerate(p)) {
            if (!first.empty()) algos.insert(cfg.get(first));
            add(req, p, cfg);
          }
          // Then with the case's runtime dims too: for an op without an algorithm axis, every kernel set they
          // lead to (gemm's bias as a column of a small K); else for the algorithms that only they admit
          // (selective_scan's one-pass tile kernel needs a seqlen of whole 8-step vectors). The other
          // algorithms' kernels for those dims (e.g. the scans' kEven variants) are left to the JIT: they
          // would double the scans' share of this plan.
          CompileRequest full = req;
          for (const auto& [k, v] : cs->dims) full.params.set(k, v);
          const Problem pf = problem_from_request(op, full);
          for (const auto& cfg : op.tuning.enumerate(pf))
            if (first.empty() || !algos.count(cfg.get(first))) add(full, pf, cfg);
        }
      }
    }
  }
  return out;
}

}  // namespace kspec
