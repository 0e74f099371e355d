// The table of XLA targets and its JSON form (kspec_xla_targets_json): names, operands, results and typed
// attributes, all read from the op registry, so a new op needs one row here and nothing else.
#include "api/xla/targets.h"

#include <nlohmann/json.hpp>

#include "api/src/c_abi.h"
#include "kspec/kspec_xla.h"
#include "kspec/registry.h"

namespace kspec::xla {

const char* const kInputsAttr = "inputs";
const char* const kOutputsAttr = "outputs";
const char* const kLayoutAttr = "layout";
const char* const kTensorsAttr = "tensors";

const std::vector<Target>& targets() {
  static const std::vector<Target> table = {
      {"kspec_selective_scan_fwd", "selective_scan.fwd", true},
      {"kspec_selective_scan_bwd", "selective_scan.bwd", true},
      {"kspec_selective_scan_step", "selective_scan.step", false},
      {"kspec_norm_act_fwd", "norm_act.fwd", false},
      {"kspec_norm_act_bwd", "norm_act.bwd", false},
      {"kspec_e79_fwd", "e79.fwd", false},
      {"kspec_e79_bwd", "e79.bwd", false},
      {"kspec_adamw", "adamw", false},
  };
  return table;
}

const Target* find_target(const std::string& name) {
  for (const auto& t : targets())
    if (name == t.name) return &t;
  return nullptr;
}

namespace {

const char* xla_type(ParamType t) {
  switch (t) {
    case ParamType::Int: return "i64 (or i32)";
    case ParamType::Float: return "f64 (or f32)";
    case ParamType::Bool: return "i1 (pred)";
    case ParamType::Choice: return "string";
  }
  return "?";
}

nlohmann::json tensor_names(const std::vector<TensorDef>& defs) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& d : defs) {
    std::string note = d.optional ? "optional" : d.present_with.empty() ? "" : "with " + d.present_with;
    if (d.list) note += std::string(note.empty() ? "" : ", ") + "list";
    a.push_back({{"name", d.name}, {"shape", d.shape}, {"note", note}});
  }
  return a;
}

}  // namespace

std::string targets_json() {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& t : targets()) {
    const OpInfo& op = op_info(t.op);
    bool has_list = false;
    for (const auto& d : op.inputs) has_list = has_list || d.list;
    nlohmann::json attrs = nlohmann::json::array();
    attrs.push_back({{"name", kInputsAttr}, {"type", "string"},
                     {"doc", "the op's inputs given as operands, comma-separated, in order (default: the required ones); "
                             "params are attributes (a runtime param named here is refused: reading it would wait "
                             "on the stream; adamw reads lr and step from its operands device_lr, device_step)"}});
    attrs.push_back({{"name", kOutputsAttr}, {"type", "string"},
                     {"doc", "the results, comma-separated, in order (default: the required outputs and those present "
                             "with a given input); an input's name is that input updated in place (an aliased result)"}});
    if (t.scan_layout)
      attrs.push_back({{"name", kLayoutAttr}, {"type", "string"},
                       {"doc", "bdl (default): u/delta/z [batch, dim, seqlen], B/C [batch, (groups,) dstate, seqlen]; "
                               "bld: [batch, seqlen, dim] and [batch, seqlen, (groups,) dstate], read and written "
                               "in place (the op's layout param)"}});
    if (has_list)
      attrs.push_back({{"name", kTensorsAttr}, {"type", "i64"}, {"doc", "operands per list input"}});
    for (const auto& p : op.params)
      if (!(t.scan_layout && p.name == kLayoutAttr))  // the op's layout param is the attribute above
        attrs.push_back({{"name", p.name}, {"type", xla_type(p.type)}, {"doc", p.doc}, {"runtime", p.runtime},
                         {"choices", p.choices}});
    all.push_back({{"target", t.name},
                   {"op", t.op},
                   {"operands", tensor_names(op.inputs)},
                   {"results", tensor_names(op.outputs)},
                   {"attributes", attrs}});
  }
  return all.dump(1);
}

}  // namespace kspec::xla

extern "C" const char* kspec_xla_targets_json(void) {
  static const std::string json = [] {
    try {
      return kspec::xla::targets_json();
    } catch (...) {
      kspec::c_abi::capture_error();
      return std::string();
    }
  }();
  return json.empty() ? nullptr : json.c_str();
}
