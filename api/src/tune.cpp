// The autotuner: enumerate an op's tuning space for one problem, prune, compile in parallel, then on
// the GPU verify each candidate against the default config and time it; record the winner in the
// tuning database. Timing: CUDA events around batches of calls queued behind a spin kernel (GPU time,
// not the host's launch rate), median over batches, inputs rotated over sets larger than 3x L2.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <mutex>
#include <random>

#include "api/src/device_data.h"
#include "api/src/kernels.h"
#include "api/src/tuning.h"
#include "cache/tuning_db.h"
#include "jit/base/log.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "jit/key.h"
#include "kspec/knobs.h"

namespace kspec {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Limits {
  int max_threads = 1024;
  int max_static_smem = 48 * 1024;
  int regs_per_block = 65536;
  int64_t l2_bytes = 50 << 20;  // the H100's, when there is no device to ask
};

Limits device_limits(int device) {
  Limits l;
  CUdevice dev;
  CU_CHECK(cuDeviceGet(&dev, device));
  int v = 0;
  CU_CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, dev));
  l.max_threads = v;
  CU_CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, dev));
  l.regs_per_block = v;
  CU_CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev));
  l.l2_bytes = v;
  return l;
}

bool has_gpu(int device) { return jit::driver_available() && device >= 0 && device < jit::device_count(); }

std::string shape_text(const Problem& p) {
  std::string s;
  for (const auto& [name, v] : p.dims) s += (s.empty() ? "" : ",") + name + "=" + std::to_string(v);
  return s;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string first_line(const std::string& s) {
  auto nl = s.find('\n');
  std::string out = nl == std::string::npos ? s : s.substr(0, nl);
  return out.size() > 200 ? out.substr(0, 200) + "…" : out;
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// Before compiling: the op's own rules and the device's threads per block.
void prune(const OpDef& op, const Problem& p, const Limits& lim, TuneCandidate& c) {
  std::string why;
  if (op.tuning.valid && !op.tuning.valid(p, c.config, &why)) {
    c.status = "pruned";
    c.why = why;
    return;
  }
  if (op.tuning.block_threads) {
    int64_t threads = op.tuning.block_threads(p, c.config);
    if (threads > lim.max_threads) {
      c.status = "pruned";
      c.why = std::to_string(threads) + " threads per block (the device allows " + std::to_string(lim.max_threads) + ")";
    }
  }
}

// Compiles (or finds in the cache) every kernel of one candidate; after: spills, shared memory and the
// register file rule it out.
void compile_candidate(const OpDef& op, const Problem& p, const Limits& lim, TuneCandidate& c) {
  if (!op.kernels) return;  // a library op: nothing to compile
  try {
    int regs = 0, spill = 0, smem = 0;
    double ms = 0;
    for (const auto& spec : op.kernels(p, c.config)) {
      Obtained ob = obtain_binary(spec);
      const jit::Resources& r = ob.entry->resources;
      regs = std::max(regs, r.registers);
      spill += std::max(0, r.spill_bytes);
      smem = std::max(smem, r.static_shared_bytes);
      ms += ob.source == "compiled" ? ob.entry->compile_ms : 0;
    }
    c.registers = regs;
    c.spill_bytes = spill;
    c.shared_bytes = smem;
    c.compile_ms = ms;
    if (spill > 0) {
      c.status = "spills";
      c.why = std::to_string(spill) + " bytes of spill stores and loads";
    } else if (smem > lim.max_static_smem) {
      c.status = "pruned";
      c.why = std::to_string(smem) + " bytes of static shared memory (limit " + std::to_string(lim.max_static_smem) + ")";
    } else if (op.tuning.block_threads && regs > 0) {
      int64_t threads = op.tuning.block_threads(p, c.config);
      int64_t need = (int64_t(regs) + 7) / 8 * 8 * threads;  // registers are allocated 8 per thread at a time
      if (need > lim.regs_per_block) {
        c.status = "too many registers";
        c.why = std::to_string(regs) + " registers x " + std::to_string(threads) + " threads > " +
                std::to_string(lim.regs_per_block);
      }
    }
  } catch (const CompileError& e) {
    c.status = "compile error";
    c.why = first_line(e.what());
  } catch (const std::exception& e) {
    c.status = "compile error";
    c.why = first_line(e.what());
  }
}

// Device data for timing: `sets` copies of the problem's inputs and outputs, rotated call by call.
class Bench {
 public:
  Bench(const OpDef& op, const Problem& p, int device, uint64_t seed, const Limits& lim)
      : op_(op), p_(p), device_(device) {
    host_ = random_inputs(op, p, seed ? seed : 0x6b73706563ull, /*for_timing=*/true);
    in_bytes_.resize(host_.size());
    size_t set_bytes = 0;
    for (size_t i = 0; i < host_.size(); ++i) {
      if (!host_[i].defined) continue;
      encode(p.inputs[i].dtype, host_[i].data, in_bytes_[i]);
      set_bytes += in_bytes_[i].size();
      host_[i].data = {};  // the bytes are all we need now
    }
    out_shapes_.resize(op.info.outputs.size());
    for (size_t i = 0; i < op.info.outputs.size(); ++i) {
      if (!p.outputs[i].present) continue;
      out_shapes_[i] = shape_of(op.info.outputs[i], p);
      set_bytes += numel(out_shapes_[i]) * dtype_size(p.outputs[i].dtype);
    }
    size_t free_b = 0, total_b = 0;
    CU_CHECK(cuMemGetInfo(&free_b, &total_b));
    int64_t want = (3 * lim.l2_bytes + static_cast<int64_t>(set_bytes) - 1) / std::max<int64_t>(set_bytes, 1);
    sets_ = static_cast<int>(std::clamp<int64_t>(want, 1, 64));
    while (sets_ > 1 && set_bytes * sets_ > free_b / 3) --sets_;
    for (int s = 0; s < sets_; ++s) {
      Set st;
      st.in.resize(host_.size());
      st.out.resize(out_shapes_.size());
      for (size_t i = 0; i < host_.size(); ++i) {
        if (!host_[i].defined) continue;
        st.bufs.emplace_back(in_bytes_[i].size());
        upload(st.bufs.back().ptr, in_bytes_[i]);
        st.in[i] = view_of(st.bufs.back().ptr, p.inputs[i].dtype, host_[i].shape, device);
      }
      for (size_t i = 0; i < out_shapes_.size(); ++i) {
        if (!p.outputs[i].present) continue;
        st.bufs.emplace_back(numel(out_shapes_[i]) * dtype_size(p.outputs[i].dtype));
        st.out[i] = view_of(st.bufs.back().ptr, p.outputs[i].dtype, out_shapes_[i], device);
      }
      sets_data_.push_back(std::move(st));
    }
    jit::KernelSpec spin;
    spin.header = "tune/spin.cuh";
    spin.kernel = "kspec::tune_spin_kernel";
    spin.targs = {"1000"};
    spin.arch = p.arch;
    spin_ = load_kernel(spin, device).fn;
  }

  int sets() const { return sets_; }

  // The call the tuner's own tensors make (its signature should be the key problem's).
  Call own_call() { return validate_call(op_, sets_data_[0].in, sets_data_[0].out, p_.params, stream()); }
  Stream stream() const { return reinterpret_cast<Stream>(stream_.get()); }

  // One call on set 0 with fresh inputs and NaN-poisoned outputs; returns the outputs' bytes.
  std::vector<std::vector<unsigned char>> outputs_of(const Config& c) {
    Set& st = sets_data_[0];
    size_t k = 0;
    for (size_t i = 0; i < host_.size(); ++i)
      if (host_[i].defined) upload(st.bufs[k++].ptr, in_bytes_[i]);
    for (size_t i = 0; i < st.out.size(); ++i)
      if (p_.outputs[i].present && nbytes_out(i) > 0)
        CU_CHECK(cuMemsetD8(reinterpret_cast<CUdeviceptr>(st.out[i].data), 0xFF, nbytes_out(i)));
    run(c, 0);
    CU_CHECK(cuStreamSynchronize(stream_.get()));
    std::vector<std::vector<unsigned char>> out(st.out.size());
    for (size_t i = 0; i < st.out.size(); ++i) {
      if (!p_.outputs[i].present) continue;
      out[i].resize(nbytes_out(i));
      if (!out[i].empty())
        CU_CHECK(cuMemcpyDtoH(out[i].data(), reinterpret_cast<CUdeviceptr>(st.out[i].data), out[i].size()));
    }
    return out;
  }

  struct Timing {
    double median_ms = -1, min_ms = -1;
    int batch_calls = 0;
  };

  // Median per-call GPU time over `batches` batches; stops early when clearly slower than `best_ms`.
  Timing measure(const Config& c, int batches, double best_ms) {
    for (int i = 0; i < 3; ++i) run(c, next());
    CU_CHECK(cuStreamSynchronize(stream_.get()));
    auto t0 = Clock::now();
    for (int i = 0; i < 5; ++i) run(c, next());
    double host_ms = seconds_since(t0) * 1e3 / 5;
    CU_CHECK(cuStreamSynchronize(stream_.get()));
    jit::OwnedEvent a = jit::create_event(CU_EVENT_DEFAULT), b = jit::create_event(CU_EVENT_DEFAULT);
    CU_CHECK(cuEventRecord(a.get(), stream_.get()));
    for (int i = 0; i < 5; ++i) run(c, next());
    CU_CHECK(cuEventRecord(b.get(), stream_.get()));
    CU_CHECK(cuEventSynchronize(b.get()));
    float est = 0;
    CU_CHECK(cuEventElapsedTime(&est, a.get(), b.get()));
    double est_ms = std::max(1e-4, est / 5.0);
    // About half a millisecond of GPU work per batch: many calls of a small kernel, few of a big one.
    int k = static_cast<int>(std::clamp(std::ceil(0.5 / est_ms), 1.0, 100.0));
    Timing t;
    t.batch_calls = k;
    std::vector<double> samples;
    int done = 0;
    while (done < batches) {
      int chunk = std::min(done == 0 ? 3 : batches - done, batches - done);
      std::vector<jit::OwnedEvent> ev;
      for (int i = 0; i < 2 * chunk; ++i) ev.push_back(jit::create_event(CU_EVENT_DEFAULT));
      for (int b2 = 0; b2 < chunk; ++b2) {
        // The spin outlasts the host's enqueueing of the batch (2x its measured host time).
        unsigned long long ns = static_cast<unsigned long long>(std::clamp(2e6 * k * host_ms, 5e4, 2e7));
        void* args[] = {&ns};
        CU_CHECK(cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 1, 0, stream_.get(), args, nullptr));
        CU_CHECK(cuEventRecord(ev[2 * b2].get(), stream_.get()));
        for (int i = 0; i < k; ++i) run(c, next());
        CU_CHECK(cuEventRecord(ev[2 * b2 + 1].get(), stream_.get()));
      }
      CU_CHECK(cuEventSynchronize(ev.back().get()));
      for (int b2 = 0; b2 < chunk; ++b2) {
        float ms = 0;
        CU_CHECK(cuEventElapsedTime(&ms, ev[2 * b2].get(), ev[2 * b2 + 1].get()));
        samples.push_back(ms / k);
      }
      done += chunk;
      if (best_ms > 0 && median_of(samples) > 3 * best_ms) break;  // not a contender: save the budget
    }
    t.median_ms = median_of(samples);
    t.min_ms = *std::min_element(samples.begin(), samples.end());
    return t;
  }

 private:
  struct Set {
    std::vector<DeviceBuffer> bufs;
    std::vector<TensorView> in, out;
  };
  static size_t numel(const std::vector<int64_t>& shape) {
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    return n;
  }
  size_t nbytes_out(size_t i) const { return numel(out_shapes_[i]) * dtype_size(p_.outputs[i].dtype); }
  static void upload(CUdeviceptr dst, const std::vector<unsigned char>& bytes) {
    if (!bytes.empty()) CU_CHECK(cuMemcpyHtoD(dst, bytes.data(), bytes.size()));
  }
  int next() { return cursor_ = (cursor_ + 1) % sets_; }
  void run(const Config& c, int set) {
    CallOptions o;
    o.config = &c;
    call(op_.info.name, sets_data_[set].in, sets_data_[set].out, p_.params, stream(), o);
  }

  const OpDef& op_;
  const Problem& p_;
  int device_;
  jit::OwnedStream stream_ = jit::create_stream(CU_STREAM_NON_BLOCKING);
  std::vector<HostTensor> host_;
  std::vector<std::vector<unsigned char>> in_bytes_;
  std::vector<std::vector<int64_t>> out_shapes_;
  std::vector<Set> sets_data_;
  int sets_ = 1;
  int cursor_ = 0;
  CUfunction spin_ = nullptr;
};

}  // namespace

TuneResult tune_problem(const OpDef& op, const Problem& p, const TuneRequest& opts, const TuneCallback& progress) {
  auto t0 = Clock::now();
  KSPEC_CHECK_AS(!op.tuning.empty(), Unsupported, op.info.name, " has no tuning space (nothing to tune)");
  KSPEC_CHECK_AS(op.generic_check && (op.kernels || op.tuning.candidates), Unsupported, op.info.name,
                 " cannot be tuned generically (TensorList inputs, or a library op without candidates)");
  TuneResult r;
  r.op = op.info.name;
  bool gpu = !opts.compile_only && has_gpu(opts.device);
  r.gpu = gpu_name(gpu ? opts.device : -1);
  r.arch = p.arch;
  r.signature = p.signature();
  r.bucket = tune_bucket(p);
  r.key = tuning_key(p);
  r.shape = shape_text(p);
  r.db_path = tuning_db_path(gpu ? opts.device : -1);
  KSPEC_CHECK_AS(op.tuning.heuristic, Unsupported, op.info.name, " has no default config");
  r.default_config = op.tuning.heuristic(p);
  std::mutex progress_mu;
  auto report = [&](const std::string& phase, int done, int total, const TuneCandidate* c) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(progress_mu);
    progress({phase, done, total, c});
  };

  Limits lim;
  std::unique_ptr<jit::ContextGuard> guard;
  if (gpu) {
    guard = std::make_unique<jit::ContextGuard>(opts.device);
    lim = device_limits(opts.device);
  }
  // The default first, then every combination in the axes' order (a library's candidates come from the
  // GPU, once the tuner's tensors exist).
  TuneCandidate def;
  def.config = r.default_config;
  def.is_default = true;
  r.candidates.push_back(def);
  for (auto& c : op.tuning.candidates ? std::vector<Config>{} : op.tuning.all_combinations()) {
    if (c.str() == r.default_config.str()) continue;
    TuneCandidate t;
    t.config = std::move(c);
    r.candidates.push_back(std::move(t));
  }
  for (auto& c : r.candidates) prune(op, p, lim, c);
  KSPEC_CHECK(r.candidates[0].status == "not timed", op.info.name, ": the default config {", r.default_config.str(op.info),
              "} is ruled out: ", r.candidates[0].why);

  // Compile every survivor in parallel on the host (NVRTC is thread-safe; the cache locks per key).
  std::vector<TuneCandidate*> todo;
  for (auto& c : r.candidates)
    if (c.status == "not timed") todo.push_back(&c);
  std::atomic<int> compiled{0};
  for_each_compile_thread(todo.size(), [&](size_t i) {
    compile_candidate(op, p, lim, *todo[i]);
    report("compile", ++compiled, static_cast<int>(todo.size()), todo[i]);
  });
  KSPEC_CHECK(r.candidates[0].status == "not timed", op.info.name, ": the default config {", r.default_config.str(op.info),
              "} cannot be used: ", r.candidates[0].status, ": ", r.candidates[0].why);
  if (!gpu) {
    if (op.tuning.candidates) r.note = op.info.name + "'s candidates come from its library on the GPU: nothing to list without one";
    r.seconds = seconds_since(t0);
    return r;
  }

  // Time the default (its outputs are the reference for the others), then the rest in a seeded random
  // order, so that a budget that runs out has sampled the whole space.
  r.timed = true;
  Bench bench(op, p, opts.device, opts.seed, lim);
  r.input_sets = bench.sets();
  Call own = bench.own_call();
  own.problem.arch = p.arch;
  std::string own_sig = own.problem.signature();
  if (own_sig != r.signature)
    jit::info("tune: the tuner's tensors make " + own_sig + " (recorded under " + r.signature + ")");
  auto add_candidates = [&](std::vector<Config> configs) {
    size_t first = r.candidates.size();
    for (auto& c : configs) {
      bool seen = false;
      for (const auto& have : r.candidates) seen = seen || have.config.str() == c.str();
      if (seen) continue;
      TuneCandidate t;
      t.config = std::move(c);
      prune(op, p, lim, t);
      if (t.status == "not timed") compile_candidate(op, p, lim, t);
      r.candidates.push_back(std::move(t));
    }
    return first;
  };
  if (op.tuning.candidates) add_candidates(op.tuning.candidates(own, std::max(1, opts.max_candidates)));
  std::vector<std::vector<unsigned char>> reference;
  std::vector<size_t> order;
  for (size_t i = 0; i < r.candidates.size(); ++i)
    if (r.candidates[i].status == "not timed") order.push_back(i);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937_64(opts.seed + 17));
  int timed = 0;
  auto time_one = [&](TuneCandidate* c, bool always) {
    bool is_def = c->is_default;
    if (!is_def && !always && !opts.all_configs && seconds_since(t0) > opts.budget_s) {
      c->why = "budget spent";
      return;
    }
    try {
      auto out = bench.outputs_of(c->config);
      if (is_def) {
        reference = std::move(out);
        c->error = 0;
      } else {
        double worst = 0, worst_tol = 0;
        std::string which;
        for (size_t i = 0; i < out.size(); ++i) {
          if (!p.outputs[i].present) continue;
          double tol = tolerance_for(p.outputs[i].dtype) * op.tolerance_scale;
          double e = rel_error_bytes(p.outputs[i].dtype, out[i], reference[i]);
          if (!(e <= tol) && (which.empty() || e / tol > worst / worst_tol)) which = op.info.outputs[i].name;
          if (e > worst || !std::isfinite(e)) {
            worst = e;
            worst_tol = tol;
          }
        }
        c->error = worst;
        if (!which.empty()) {
          c->status = "mismatch";
          c->why = "output '" + which + "' differs from the default config's";
          report("time", ++timed, static_cast<int>(order.size()), c);
          return;
        }
      }
      auto t = bench.measure(c->config, std::max(3, opts.batches), r.best_ms);
      c->median_ms = t.median_ms;
      c->min_ms = t.min_ms;
      c->status = "ok";
      if (is_def) {
        r.default_ms = t.median_ms;
        r.batch_calls = t.batch_calls;
      }
      if (r.best_ms < 0 || t.median_ms < r.best_ms) {
        r.best_ms = t.median_ms;
        r.best_config = c->config;
      }
    } catch (const std::exception& e) {
      if (is_def) throw;
      c->status = "launch failed";
      c->why = first_line(e.what());
    }
    report("time", ++timed, static_cast<int>(order.size()), c);
  };
  for (size_t i : order) time_one(&r.candidates[i], false);
  if (op.tuning.refine) {
    size_t first = add_candidates(op.tuning.refine(p, r.candidates));
    for (size_t i = first; i < r.candidates.size(); ++i) {
      order.push_back(i);
      if (r.candidates[i].status == "not timed") time_one(&r.candidates[i], true);  // a few, built to win
    }
  }
  r.seconds = seconds_since(t0);

  if (opts.write_db && r.best_ms > 0) {
    int n_ok = 0;
    for (const auto& c : r.candidates) n_ok += c.status == "ok";
    nlohmann::json rec = {
        {"op", r.op},
        {"config", r.best_config.str(op.info)},
        {"time_ms", r.best_ms},
        {"default_config", r.default_config.str(op.info)},
        {"default_ms", r.default_ms},
        {"speedup", r.default_ms / r.best_ms},
        {"shape", r.shape},
        {"bucket", r.bucket},
        {"signature", r.signature},
        {"arch", r.arch},
        {"gpu", r.gpu},
        {"toolkit", jit::nvrtc_version()},
        {"kspec", jit::kspec_version()},
        {"configs_timed", n_ok},
        {"configs_total", static_cast<int>(r.candidates.size())},
        {"updated", utc_now()},
    };
    std::string err;
    r.written = cache::TuningDb(r.db_path).merge({{r.key, rec}}, {{"gpu", r.gpu}, {"toolkit", jit::nvrtc_version()}},
                                                 cache::TuningDb::prefer_incoming, &err);
    if (r.written) tuning_changed();
  }
  return r;
}

TuneResult tune(const TuneRequest& req, const TuneCallback& progress) {
  const OpDef& op = Registry::global().get(req.problem.op);
  Problem p = problem_from_request(op, req.problem);
  if (!req.compile_only && has_gpu(req.device)) p.arch = device_arch(req.device);
  if (op.check) op.check(p);
  return tune_problem(op, p, req, progress);
}

}  // namespace kspec
