// pybind11 bindings: kspec._C. Tensors arrive as (ptr, dtype, shape, strides, device) tuples built by
// python/kspec/_tensors.py from torch, CuPy, DLPack or __cuda_array_interface__ objects; the C++ side
// does all validation. Each kspec::Error maps to one Python exception class.
// The conversions, the result dicts and the torch fast path live beside this file (python/src/).
#include <cstdio>
#include <memory>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "jit/cuda_libs.h"
#include "kspec/kspec.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace {

using kspec_py::call_torch;
using kspec_py::candidate_dict;
using kspec_py::dlpack_describe;
using kspec_py::op_info_dict;
using kspec_py::param_to_py;
using kspec_py::plan_dict;
using kspec_py::report_dict;
using kspec_py::to_inputs;
using kspec_py::to_outputs;
using kspec_py::to_params;
using kspec_py::to_request;

// kspec::BoundCall with its op's name, for the messages about its outputs.
struct BoundCall {
  std::string op;
  std::unique_ptr<kspec::BoundCall> call;
};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kspec native core (validation, NVRTC specialization, cache, launch)";

  // Every class is a kspec.Error and keeps the builtin base a caller may catch instead (ValueError, ...).
  auto base = py::register_exception<kspec::Error>(m, "Error", PyExc_RuntimeError);
  auto error_and = [&base](PyObject* builtin) { return py::make_tuple(base, py::handle(builtin)); };
  py::register_exception<kspec::InvalidArgument>(m, "InvalidArgument", error_and(PyExc_ValueError));
  py::register_exception<kspec::Unsupported>(m, "Unsupported", error_and(PyExc_NotImplementedError));
  // CompileError carries the NVRTC log, options, spec and the path of the specialized source.
  static PyObject* compile_error_type = [&] {
    py::exception<kspec::CompileError> t(m, "CompileError", base.ptr());
    Py_INCREF(t.ptr());  // lives as long as the interpreter
    return t.ptr();
  }();
  py::register_exception<kspec::CudaError>(m, "CudaError", base.ptr());
  py::register_exception<kspec::CacheError>(m, "CacheError", error_and(PyExc_OSError));
  py::register_exception<kspec::InternalError>(m, "InternalError", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kspec::CompileError& e) {
      py::object type = py::reinterpret_borrow<py::object>(compile_error_type);
      py::object exc = type(py::str(e.what()));
      exc.attr("log") = e.log();
      exc.attr("options") = e.options();
      exc.attr("spec") = e.spec();
      exc.attr("source_path") = e.source_path();
      PyErr_SetObject(compile_error_type, exc.ptr());
    }
  });

  m.def("version", &kspec::version);
  m.def("dlpack_describe", &dlpack_describe);
  m.def("pointer_device", [](uintptr_t p) { return kspec::pointer_device(reinterpret_cast<const void*>(p)); });
  m.def("list_ops", &kspec::list_ops);
  m.def("tolerances", [] {  // the one table, by dtype name (ops scale it: op_info(op)["tolerances"])
    py::dict d;
    for (auto dt : {kspec::DType::f32, kspec::DType::f16, kspec::DType::bf16, kspec::DType::f64})
      d[kspec::dtype_name(dt)] = kspec::tolerance_for(dt);
    return d;
  });
  m.def("op_info", &op_info_dict);
  m.def("describe_op", [](const std::string& n) { return kspec::describe_op(n); });

  m.attr("_ext_api") = kspec_py::ext_api_capsule();
  m.def("call_torch", &call_torch, py::arg("op"), py::arg("inputs"), py::arg("out"), py::arg("params"));
  m.def("call",
        [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs, const py::dict& params,
           uintptr_t stream, const py::object& config) {
          std::vector<std::vector<kspec::TensorView>> lists;
          lists.reserve(inputs.size());
          auto in = to_inputs(op, inputs, &lists);
          auto out = to_outputs(op, outputs);
          auto p = to_params(params);
          kspec::Config cfg;
          kspec::CallOptions opts;
          if (!config.is_none()) {
            cfg = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
            opts.config = &cfg;
          }
          py::gil_scoped_release release;
          kspec::call(op, in, out, p, reinterpret_cast<kspec::Stream>(stream), opts);
        },
        py::arg("op"), py::arg("inputs"), py::arg("outputs"), py::arg("params"), py::arg("stream") = 0,
        py::arg("config") = py::none());

  // A call validated once and run many times on the same tensors (kspec.optim.AdamW's steps).
  py::class_<BoundCall>(m, "BoundCall")
      .def(py::init([](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                       const py::dict& params) {
             std::vector<std::vector<kspec::TensorView>> lists;
             lists.reserve(inputs.size());
             auto in = to_inputs(op, inputs, &lists);
             auto out = to_outputs(op, outputs);
             auto p = to_params(params);
             py::gil_scoped_release release;
             return std::make_unique<BoundCall>(BoundCall{op, std::make_unique<kspec::BoundCall>(op, in, out, p)});
           }),
           py::arg("op"), py::arg("inputs"), py::arg("outputs"), py::arg("params"))
      .def("run",
           [](BoundCall& b, const py::dict& params, const py::sequence& outputs, uintptr_t stream) {
             auto out = to_outputs(b.op, outputs);
             auto p = to_params(params);
             py::gil_scoped_release release;
             b.call->run(p, out, reinterpret_cast<kspec::Stream>(stream));
           },
           py::arg("params"), py::arg("outputs"), py::arg("stream") = 0)
      .def_property_readonly("config", [](const BoundCall& b) { return b.call->config(); })
      .def_property_readonly("runs", [](const BoundCall& b) { return b.call->runs(); })
      .def("idle", [](const BoundCall& b) { return b.call->idle(); });

  m.def("infer_outputs", [](const std::string& op, const py::sequence& inputs, const py::dict& params) {
    py::list out;
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    for (const auto& s : kspec::infer_outputs(op, to_inputs(op, inputs, &lists), to_params(params))) {
      if (!s.present) out.append(py::none());
      else out.append(py::make_tuple(kspec::dtype_name(s.dtype), py::tuple(py::cast(s.shape))));
    }
    return out;
  });

  m.def("explain", [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                      const py::dict& params) {
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    return kspec::explain(op, to_inputs(op, inputs, &lists), to_outputs(op, outputs), to_params(params));
  });

  m.def("explain_plan", [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                           const py::dict& params) {
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    return plan_dict(kspec::explain_plan(op, to_inputs(op, inputs, &lists), to_outputs(op, outputs), to_params(params)));
  });
  m.def("explain_request",
        [](const std::string& op, const std::string& dtype, const std::string& arch, const py::dict& params,
           const std::vector<std::string>& without, const std::map<std::string, std::string>& tensor_dtypes,
           const std::vector<std::string>& alt_shapes) {
          return plan_dict(kspec::explain_request(to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes)));
        },
        py::arg("op"), py::arg("dtype"), py::arg("arch") = "sm_90", py::arg("params") = py::dict(),
        py::arg("without") = std::vector<std::string>{}, py::arg("tensor_dtypes") = std::map<std::string, std::string>{},
        py::arg("alt_shapes") = std::vector<std::string>{});

  m.def("tune",
        [](const std::string& op, const std::string& dtype, const py::dict& params, const std::vector<std::string>& without,
           const std::map<std::string, std::string>& tensor_dtypes, const std::vector<std::string>& alt_shapes,
           int device, const std::string& arch, double budget, bool all_configs, bool compile_only, bool write_db,
           int batches, uint64_t seed, const py::object& progress, int max_candidates) {
          kspec::TuneRequest req;
          req.problem = to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes);
          req.device = device;
          req.budget_s = budget;
          req.all_configs = all_configs;
          req.compile_only = compile_only;
          req.write_db = write_db;
          req.batches = batches;
          req.seed = seed;
          req.max_candidates = max_candidates;
          kspec::TuneCallback cb;
          if (!progress.is_none())
            cb = [&progress, &op](const kspec::TuneProgress& ev) {
              py::gil_scoped_acquire gil;
              try {  // runs on the tuner's compile threads: a Python error must not escape them
                progress(ev.phase, ev.done, ev.total,
                         ev.candidate ? py::object(candidate_dict(*ev.candidate, kspec::op_info(op))) : py::object(py::none()));
              } catch (py::error_already_set& e) {
                e.discard_as_unraisable("kspec.tune progress callback");
              }
            };
          kspec::TuneResult r;
          {
            py::gil_scoped_release release;
            r = kspec::tune(req, cb);
          }
          py::dict d;
          d["op"] = r.op;
          d["gpu"] = r.gpu;
          d["arch"] = r.arch;
          d["signature"] = r.signature;
          d["bucket"] = r.bucket;
          d["key"] = r.key;
          d["shape"] = r.shape;
          d["db_path"] = r.db_path;
          d["default_config"] = r.default_config.str(kspec::op_info(r.op));
          d["best_config"] = r.best_config.str(kspec::op_info(r.op));
          d["default_ms"] = r.default_ms;
          d["best_ms"] = r.best_ms;
          d["timed"] = r.timed;
          d["written"] = r.written;
          d["seconds"] = r.seconds;
          d["batch_calls"] = r.batch_calls;
          d["input_sets"] = r.input_sets;
          d["note"] = r.note;
          py::list cands;
          for (const auto& c : r.candidates) cands.append(candidate_dict(c, kspec::op_info(r.op)));
          d["candidates"] = cands;
          return d;
        },
        py::arg("op"), py::arg("dtype"), py::arg("params"), py::arg("without"), py::arg("tensor_dtypes"),
        py::arg("alt_shapes"), py::arg("device") = 0, py::arg("arch") = "sm_90", py::arg("budget") = 60.0,
        py::arg("all_configs") = false, py::arg("compile_only") = false, py::arg("write_db") = true,
        py::arg("batches") = 15, py::arg("seed") = 0, py::arg("progress") = py::none(),
        py::arg("max_candidates") = 16);
  m.def("tuning_db_path", &kspec::tuning_db_path, py::arg("device") = 0);
  m.def("tuning_db_entries", &kspec::tuning_db_entries, py::arg("path") = "");
  m.def("tuning_export", &kspec::tuning_export, py::arg("file"), py::arg("path") = "");
  m.def("tuning_import",
        [](const std::string& file) {
          // The file is anyone's: a JSON value of the wrong type is the file's error, not a crash.
          try {
            return kspec::tuning_import(file);
          } catch (const kspec::Error&) {
            throw;
          } catch (const std::exception& e) {
            throw kspec::InvalidArgument("kspec tune --import: " + file + ": " + e.what());
          }
        },
        py::arg("file"));

  m.def("compile",
        [](const std::string& op, const std::string& dtype, const std::string& arch, const py::dict& params,
           const std::vector<std::string>& without, const std::map<std::string, std::string>& tensor_dtypes,
           const py::object& config, const std::vector<std::string>& alt_shapes) {
          auto req = to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes);
          if (!config.is_none()) req.config = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
          std::vector<kspec::CompileReport> reports;
          {
            py::gil_scoped_release release;
            reports = kspec::compile(req);
          }
          py::list out;
          for (const auto& r : reports) out.append(report_dict(r));
          return out;
        },
        py::arg("op"), py::arg("dtype"), py::arg("arch") = "sm_90", py::arg("params") = py::dict(),
        py::arg("without") = std::vector<std::string>{}, py::arg("tensor_dtypes") = std::map<std::string, std::string>{},
        py::arg("config") = py::none(), py::arg("alt_shapes") = std::vector<std::string>{});

  // The full sweep (`kspec precompile --all`) and the quick one (`kspec precompile`), as request dicts.
  auto plan_list = [](const std::vector<kspec::CompileRequest>& plan) {
    py::list out;
    for (const auto& r : plan) {
      py::dict d;
      d["op"] = r.op;
      d["dtype"] = kspec::dtype_short(r.dtype);
      d["arch"] = r.arch;
      py::dict params;
      for (const auto& [k, v] : r.params.items()) params[py::str(k)] = param_to_py(v);
      d["params"] = params;
      d["without"] = r.without;
      std::map<std::string, std::string> td;
      for (const auto& [k, v] : r.tensor_dtypes) td[k] = kspec::dtype_short(v);
      d["tensor_dtypes"] = td;
      d["alt_shapes"] = r.alt_shapes;
      d["config"] = r.config ? py::object(py::str(r.config->str())) : py::object(py::none());
      out.append(d);
    }
    return out;
  };
  m.def("precompile_plan", [plan_list](const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
    return plan_list(kspec::precompile_plan(archs, ops));
  });
  m.def("defaults_plan", [plan_list](const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
    return plan_list(kspec::defaults_plan(archs, ops));
  });
  m.def("quick_plan", [plan_list](const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
    return plan_list(kspec::quick_plan(archs, ops));
  });

  // Routes kspec's diagnostics to fn(level: "info" | "warning", message: str), or back to stderr (None).
  // The C++ side calls it from any thread, holding none of its locks, with or without the GIL: the sink
  // takes the GIL itself (a thread that released it inside a kspec call simply takes it back). Once the
  // interpreter is finalizing, messages go to stderr (kspec/_log.py also removes the sink at exit).
  m.def("set_log_sink", [](py::object fn) {
    if (fn.is_none()) {
      kspec::set_log_sink({});
      return;
    }
    if (!PyCallable_Check(fn.ptr())) 
      throw kspec::InvalidArgument("set_log_sink: expected a callable or None, got " +
                                   std::string(py::str(py::type::handle_of(fn).attr("__name__"))));
    // The callable is released under the GIL, on whichever thread drops the last copy of the sink.
    std::shared_ptr<py::object> held(new py::object(std::move(fn)), [](py::object* o) {
      if (!Py_IsInitialized()) return;  // the interpreter is gone: leak rather than touch it
      py::gil_scoped_acquire gil;
      delete o;
    });
    kspec::set_log_sink([held](kspec::LogLevel level, const std::string& msg) {
      const char* lv = level == kspec::LogLevel::Warning ? "warning" : "info";
      if (!Py_IsInitialized() || interpreter_finalizing()) {
        std::fprintf(stderr, "[kspec] %s: %s\n", lv, msg.c_str());
        return;
      }
      py::gil_scoped_acquire gil;
      try {
        (*held)(lv, msg);
      } catch (py::error_already_set& e) {  // a failing sink is reported, never raised into kspec
        e.discard_as_unraisable("kspec log sink");
      }
    });
  }, py::arg("fn"));

  m.def("counters", [] {
    auto c = kspec::counters();
    py::dict d;
    d["compiled"] = c.compiled;
    d["disk_hits"] = c.disk_hits;
    d["memory_hits"] = c.memory_hits;
    d["launches"] = c.launches;
    return d;
  });

  m.def("check_op",
        [](const std::string& op, const std::string& case_name, const std::vector<std::string>& dtypes, int device,
           bool include_large, const py::object& config, uint64_t seed) {
          kspec::CheckOptions o;
          o.case_name = case_name;
          for (const auto& d : dtypes) o.dtypes.push_back(kspec::parse_dtype(d));
          o.device = device;
          o.include_large = include_large;
          o.seed = seed;
          if (py::isinstance<py::str>(config)) {
            o.config = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
          } else if (!config.is_none()) {  // several configs on one draw of inputs, a row each
            for (const auto& c : config.cast<std::vector<std::string>>()) o.configs.push_back(kspec::Config::parse(c, kspec::op_info(op)));
          }
          std::vector<kspec::CheckRow> rows;
          {
            py::gil_scoped_release release;
            rows = kspec::check_op(op, o);
          }
          py::list out;
          for (const auto& r : rows) {
            py::dict d;
            d["op"] = r.op;
            d["case"] = r.case_name;
            d["dtype"] = r.dtype;
            d["shape"] = r.shape;
            d["config"] = r.config;
            d["errors"] = r.errors;
            d["tolerance"] = r.tolerance;
            d["passed"] = r.passed;
            d["message"] = r.message;
            d["seed"] = r.seed;
            out.append(d);
          }
          return out;
        },
        py::arg("op"), py::arg("case") = "", py::arg("dtypes") = std::vector<std::string>{}, py::arg("device") = 0,
        py::arg("include_large") = false, py::arg("config") = py::none(), py::arg("seed") = 0);
  m.def("case_names", &kspec::case_names);
  m.def("configs_for_case", [](const std::string& op, const std::string& case_name, const std::string& dtype) {
    std::vector<std::string> out;
    for (const auto& c : kspec::configs_for_case(op, case_name, kspec::parse_dtype(dtype))) out.push_back(c.str(kspec::op_info(op)));
    return out;
  });

  m.def("cache_stats", [] {
    auto s = kspec::cache_stats();
    py::dict d;
    d["dir"] = s.dir;
    d["enabled"] = s.enabled;
    d["writable"] = s.writable;
    d["entries"] = s.entries;
    d["bytes"] = s.bytes;
    d["max_bytes"] = s.max_bytes;
    return d;
  });
  m.def("cache_entries", [] {
    py::list out;
    for (const auto& e : kspec::cache_entries()) {
      py::dict d;
      d["key"] = e.key;
      d["path"] = e.path;
      d["spec"] = e.spec;
      d["kernel"] = e.kernel;
      d["arch"] = e.arch;
      d["bytes"] = e.bytes;
      d["last_used"] = e.last_used;
      d["registers"] = e.registers;
      d["spill_bytes"] = e.spill_bytes;
      d["shared_bytes"] = e.shared_bytes;
      d["compile_ms"] = e.compile_ms;
      out.append(d);
    }
    return out;
  });
  m.def("cache_verify", &kspec::cache_verify);
  m.def("cache_prune", &kspec::cache_prune, py::arg("max_bytes") = -1);
  m.def("cache_clear", &kspec::cache_clear);
  m.def("doctor", &kspec::doctor);
  // pip's nvidia wheel directories, where NVRTC and CUDA's headers are looked for (kspec/__init__.py).
  m.def("_set_nvidia_dirs", &kspec::jit::set_nvidia_package_dirs);
  m.def("compile_threads", [] { return kspec::knobs::compile_threads(); });
  m.def("torch_ext_enabled", [] { return kspec::knobs::torch_ext(); });
  m.def("knobs", [] {
    py::list out;
    for (const auto& k : kspec::knobs::all()) out.append(py::make_tuple(k.name, k.type, k.default_value, k.doc));
    return out;
  });
  kspec_py::bind_xla(m);
}
