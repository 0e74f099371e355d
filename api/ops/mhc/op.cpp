// mhc: manifold-constrained hyper-connections (issue 34). mhc.pre.fwd/bwd (stream weights H_pre, H_post,
// the Sinkhorn-Knopp mixing R and the sublayer input y from an RMS-normalized projection of the n
// streams), mhc.post.fwd/bwd (the next layer's streams) and mhc.sinkhorn.fwd/bwd (the projection alone).
// Schema, specializations, tuning space, launchers, float64 references and case tables; kernels in
// templates/mhc/, their arguments in templates/mhc/params.h, the maths in api/ops/mhc/reference.h.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/spec.h"
#include "mhc/reference.h"
#include "templates/mhc/decode_params.h"
#include "templates/mhc/params.h"

namespace kspec {
namespace {

const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
constexpr int64_t kMaxN = 8;
// The Sinkhorn backward keeps 2 t_max + 1 iterates of n x n floats in shared memory
// (templates/mhc/sinkhorn.cuh: kMhcMaxTMax).
constexpr int64_t kMaxTMax = 64;
// Tokens per part of pre.bwd's sums over tokens, and at most this many parts: the partial sums take
// parts x (M + 1) x nD floats of workspace (32 x 25 x 16384 x 4 B = 52 MB at n 4, D 4096).
constexpr int64_t kTokensPerPart = 128;
constexpr int64_t kMaxParts = 32;
constexpr unsigned kReduceThreads = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned u32(int64_t v) { return static_cast<unsigned>(v); }
const char* b(bool v) { return v ? "true" : "false"; }

// mhc.pre_only.fwd/bwd: the pre op with M = n rows (only H_pre and y), for the final collapse of the
// streams; its own ops because its outputs differ (no h_post, r).
bool pre_only(const Problem& p) { return p.op->info.name.rfind("mhc.pre_only.", 0) == 0; }
int64_t proj_rows(const Problem& p) { return ref::mhc_proj_rows(p.dim("n"), pre_only(p)); }

// ---- schema pieces ----

ParamDef eps_param(const char* name, const char* doc) {
  return {name, ParamType::Float, 1e-6, {}, doc, true, 0.0};
}
ParamDef t_max_param() {
  return {"t_max", ParamType::Int, int64_t(20), {},
          "Sinkhorn-Knopp rounds (the first a column normalization alone); a template argument, at most 64",
          false, 1.0, static_cast<double>(kMaxTMax)};
}

DimDef dim_T() { return {"T", DimKind::Var, {}, "tokens (B*S: the leading dims collapse with one row stride)"}; }
DimDef dim_n() { return {"n", DimKind::Const, {}, "residual streams, a template argument: 1..8", 1, kMaxN}; }
DimDef dim_D() { return {"D", DimKind::Const, {}, "hidden size per stream, a template argument (any size)"}; }

std::vector<DimDef> pre_dims() {
  return {dim_T(), dim_n(), dim_D(),
          {"M", DimKind::Var, {}, "projection rows: n*n + 2n (pre_only: n)"},
          {"nD", DimKind::Var, {}, "n * D, the flattened streams of a token"},
          {"A", DimKind::Var, {}, "alphas: 3 (pre_only: 1)"}};
}

TensorDef streams(const char* name, const std::string& dtype_of, const char* doc) {
  return tensor_def(name, {"...T", "n", "D"}, dtype_of.empty() ? kFloatTypes : std::vector<DType>{}, dtype_of, false,
                    false, "", Layout::RowStrided, doc);
}
TensorDef per_token(const char* name, const std::string& dtype_of, const char* doc) {
  return tensor_def(name, {"...T", "D"}, {}, dtype_of, false, false, "", Layout::RowStrided, doc);
}
TensorDef f32(const char* name, std::vector<std::string> shape, bool optional, const char* doc,
              std::string present_with = "") {
  return tensor_def(name, std::move(shape), {DType::f32}, "", false, optional, std::move(present_with),
                    Layout::Contiguous, doc);
}

// The rules the schema cannot state: M, nD and A follow from n, D and pre_only.
void check_pre(const Problem& p) {
  const std::string& op = p.op->info.name;
  const int64_t n = p.dim("n"), D = p.dim("D"), m = proj_rows(p), a = ref::mhc_alpha_size(pre_only(p));
  KSPEC_CHECK(p.dim("nD") == n * D, op, ": input 'phi': expected [M, nD] with nD = n * D = ", n * D, ", got nD = ",
              p.dim("nD"));
  KSPEC_CHECK(p.dim("M") == m, op, ": input 'phi': expected [M, nD] with M = ", pre_only(p) ? "n = " : "n*n + 2n = ",
              m, " for n = ", n, pre_only(p) ? " (pre_only)" : "", ", got M = ", p.dim("M"));
  KSPEC_CHECK(p.dim("A") == a, op, ": input 'alpha': expected [", a, "]", pre_only(p) ? " (pre_only)" : "",
              ", got [", p.dim("A"), "]");
}

std::vector<std::pair<std::string, std::function<int64_t(const Problem&)>>> pre_derived_dims() {
  return {{"M", [](const Problem& p) { return proj_rows(p); }},
          {"nD", [](const Problem& p) { return p.dim("n") * p.dim("D"); }},
          {"A", [](const Problem& p) { return ref::mhc_alpha_size(pre_only(p)); }}};
}

// ---- tuning: threads per block ----

// The pre kernels keep M + n (up to 88) running sums per thread, post.bwd n + n^2 (up to 72): at most
// 256 threads, so each may use up to 255 registers.
// Nothing is measured yet (first correct kernels): a small space, so `kspec precompile --all` stays short.
TuningSpace threads_tuning(std::vector<int64_t> threads, std::function<int64_t(const Problem&)> min_threads,
                           int64_t max_threads) {
  TuningSpace t;
  t.axes = {{"threads", std::move(threads)}};
  t.valid = [min_threads, max_threads](const Problem& p, const Config& c, std::string* why) {
    const int64_t th = c.get("threads");
    if (th < min_threads(p)) {
      if (why) *why = "fewer threads than the n*n Sinkhorn elements or the M projection rows of a token";
      return false;
    }
    if (th > max_threads) {
      if (why) *why = "more threads than the per-thread running sums leave registers for";
      return false;
    }
    return true;
  };
  // 128 threads, or the fewest that hold a token's rows.
  t.heuristic = [min_threads](const Problem& p) {
    int64_t th = 128;
    while (th < min_threads(p)) th *= 2;
    return Config{{{"threads", th}}};
  };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  return t;
}

int64_t pre_min_threads(const Problem& p) {
  return pre_only(p) ? proj_rows(p) : std::max<int64_t>(proj_rows(p), p.dim("n") * p.dim("n"));
}

// The pre kernels also take several tokens per block ("tokens"): they share each load of phi, which one
// block per token read from L2 once per token (T = 16384, n = 4, D = 4096, bf16 on the H100: pre.fwd
// 2.6 ms, 9% of 3 TB/s). A token keeps n + M running sums in every thread (the backward's; the forward
// keeps M + 1), a row of h per thread, n*n Sinkhorn elements per thread and its own Sinkhorn iterates in
// shared memory.
constexpr int64_t kMaxPreTokenSums = 112, kMaxPreSkSmem = 40 * 1024;
TuningSpace with_tokens_axis(TuningSpace t) {
  // No 2: mhc.pre_only.bwd at n = 8 spills 8 bytes with 2 tokens on sm_80 (ptxas, NVRTC 13), not with 4.
  t.axes.push_back({"tokens", {1, 4}});
  auto threads_valid = t.valid;
  t.valid = [threads_valid](const Problem& p, const Config& c, std::string* why) {
    if (!threads_valid(p, c, why)) return false;
    const int64_t tok = c.get("tokens"), th = c.get("threads"), n = p.dim("n"), m = proj_rows(p);
    const int64_t nn = pre_only(p) ? 0 : n * n;
    const int64_t sk_smem = pre_only(p) ? 0 : tok * nn * (2 * p.param_int("t_max") + 1) * 4;
    const char* no = nullptr;
    if (tok * m > th || tok * nn > th) no = "fewer threads than tokens x (M rows, n*n Sinkhorn elements)";
    else if (tok * (n + m) > kMaxPreTokenSums) no = "more running sums per thread than registers hold";
    else if (sk_smem > kMaxPreSkSmem) no = "the tokens' Sinkhorn iterates exceed 40 KiB of shared memory";
    if (no && why) *why = no;
    return no == nullptr;
  };
  auto threads_heuristic = t.heuristic;
  t.heuristic = [threads_heuristic, valid = t.valid](const Problem& p) {
    const Config threads = threads_heuristic(p);
    Config c4 = threads;
    c4.values.push_back({"tokens", 4});
    if (valid(p, c4, nullptr)) return c4;
    Config c = threads;
    c.values.push_back({"tokens", 1});
    return c;
  };
  return t;
}

// pre.fwd's `algo` axis: kSimt, the kernel above (mhc_pre.cuh: `threads`, `tokens` 1 or 4); kMma, the
// projection on tensor cores (mhc_pre_mma.cuh: 128 threads, `tokens` 16, 32 or 64, whole m16 tiles).
// pre.bwd's (with_bwd_algo_axis) has three more, kMmaTokens, kMmaFused and kMmaFusedWarpHeads.
enum PreAlgo : int64_t { kSimt = 0, kMma = 1, kMmaTokens = 2, kMmaFused = 3, kMmaFusedWarpHeads = 4, kMmaFusedRing = 5 };
// pre.fwd's third value: kMma with each warp running its own tokens' heads and then their y
// (mhc_pre_mma.cuh, kWarpHeads): n*n and M at most 32. The fourth, kMmaRing: that with the projection's rows
// of x through a ring of 4 chunks in shared memory, 3 ahead (cp.async) instead of 1 in registers: the same
// bits, more bytes in flight (mhc_pre_mma.cuh, kRing; tools/bench/NOTES.md, session 9); the heuristic's where it runs.
constexpr int64_t kMmaWarpHeads = 2, kMmaRing = 3;
bool fwd_warp_heads(const Config& c) { return c.get("algo") == kMmaWarpHeads || c.get("algo") == kMmaRing; }
// Under kMmaWarpHeads and kMmaRing, up to this many tokens (decode, small batches) take the split plan instead:
// at T 8 the one 64-token block took 166 us of GPU on the H100 (run 21; F.rms_norm over the same bytes 16). The
// switch is in the launcher, not the heuristic, because the plan cache keys leave T out.
constexpr int64_t kSplitMaxT = 256, kSplitTokens = 16;
// The split plan's blocks a 16-token tile: projection blocks (each every splits-th group of 4 chunks of 32
// columns; at least 2, the kernel's kSplits > 1 being what makes it leave partials), and y blocks (each a
// range of D).
int64_t fwd_splits(const Problem& p) {
  return std::clamp<int64_t>(p.dim("n") * ceil_div(p.dim("D"), 32) / 4, 2, 64);
}
int64_t fwd_y_blocks(const Problem& p) { return std::clamp<int64_t>(ceil_div(p.dim("D"), 8) / 64, 1, 16); }
std::string warp_heads_unsupported(const Problem& p) {
  if (proj_rows(p) > 32) return "algo=mma_warp_heads takes at most 32 projection rows (n <= 4; pre_only any n)";
  return "";
}
constexpr int64_t kMmaThreads = 128;  // templates/mhc/mhc_pre_mma.cuh: kMhcMmaThreads
// 16-byte loads of x, phi, gamma and stores of y: whole 8-element groups, every pointer and row aligned.
bool mma_vec(const Problem& p) { return p.dim("D") % 8 == 0 && p.align_bytes >= 16; }
// A lane keeps (tokens / 16) x ceil(M / 8) accumulator tiles of 4 floats, 8 columns of phi per tile and
// its rows of x twice (this chunk's and the next's). Without spills on sm_80 (ptxas, NVRTC 13): 64 tokens
// only with x in 16-byte groups (n = 4: 224-230 registers; bf16 at D = 33 and n = 3 spilled 8 bytes), else
// 32; at most 12 tiles.
int64_t max_mma_tokens(const Problem& p) { return mma_vec(p) ? 64 : 32; }
constexpr int64_t kMaxMmaTiles = 12;
std::string mma_unsupported(const Problem& p) {
  if (jit::compute_capability(p.arch) < 80) return "algo=mma needs sm_80 or newer (mma.sync with TF32 operands)";
  // Split into three TF32 products, fp32 x came to 1.1e-5..2.2e-5 in h at D = 2560..7168 on the H100 (the
  // fp32 tolerance is 1e-5; algo=simt passes): fp32 x keeps the exact-fp32 SIMT kernel.
  if (p.dtype("x") == DType::f32) return "algo=mma takes bfloat16 or float16 x (float32 x: algo=simt)";
  return "";
}
int64_t mma_tiles(const Problem& p, int64_t tokens) { return tokens / 16 * ceil_div(proj_rows(p), 8); }

// The `algo` axis of pre.fwd and post_pre.fwd: kSimt (the SIMT kernel: `threads`, `tokens` 1 or 4) or the
// tensor-core kernels `algos` (128 threads, the heads per warp under kMmaWarpHeads and kMmaRing), whose token
// tiles each op rules on in `mma_rules` ("" where legal, else why not).
using MmaRules = std::function<std::string(const Problem&, const Config&)>;
TuningSpace with_fwd_algo_axis(TuningSpace t, std::vector<int64_t> algos, MmaRules mma_rules) {
  t.axes.insert(t.axes.begin(), {"algo", std::move(algos)});
  for (auto& [name, values] : t.axes)
    if (name == "tokens") values = {1, 4, 16, 32, 64};
  auto simt_valid = t.valid;
  t.valid = [simt_valid, mma_rules = std::move(mma_rules)](const Problem& p, const Config& c, std::string* why) {
    std::string no;
    if (c.get("algo") == kSimt) {
      if (c.get("tokens") <= 4) return simt_valid(p, c, why);
      no = "algo=simt takes 1 or 4 tokens a block";
    } else {
      no = mma_unsupported(p);
      if (no.empty() && fwd_warp_heads(c)) no = warp_heads_unsupported(p);
      if (no.empty() && c.get("threads") != kMmaThreads) no = "algo=mma runs 128 threads a block (named threads=128)";
      if (no.empty()) no = mma_rules(p, c);
    }
    if (why) *why = no;
    return no.empty();
  };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("algo") != kSimt ? kMmaThreads : c.get("threads"); };
  return t;
}

// kMmaRing's ring: 4 chunks of a lane's tokens / 16 x 2 rows of 16 bytes, 16 KB per m16 tile of tokens, beside
// the tokens' totals in the 48 KB of static shared memory (mhc_pre_mma.cuh, kMhcFwdRingStages).
std::string ring_unsupported(const Problem& p, int64_t tokens) {
  if (!mma_vec(p)) return "algo=mma_ring takes x in 16-byte groups (D % 8 == 0, aligned): cp.async copies";
  if (tokens > 32) return "algo=mma_ring takes 16 or 32 tokens: its ring of x in shared memory (16 KB a 16-token tile)";
  return "";
}

// pre.fwd: the tensor-core projection wherever it runs: mma_ring at 32 tokens where x is in 16-byte groups and
// M <= 32, else the most tokens a block whose accumulators fit, the heads per warp where M <= 32
// (tools/bench/NOTES.md).
TuningSpace with_algo_axis(TuningSpace t) {
  t = with_fwd_algo_axis(std::move(t), {kSimt, kMma, kMmaWarpHeads, kMmaRing}, [](const Problem& p, const Config& c) {
    const int64_t tok = c.get("tokens");
    if (tok < 16) return std::string("algo=mma takes whole m16 tiles of tokens: 16, 32 or 64");
    if (tok > max_mma_tokens(p))
      return std::string("algo=mma takes 64 tokens only with x in 16-byte groups (D % 8 == 0, aligned): registers");
    if (mma_tiles(p, tok) > kMaxMmaTiles)
      return std::string("algo=mma: more accumulator tiles (tokens / 16 x ceil(M / 8)) than registers hold (12)");
    return c.get("algo") == kMmaRing ? ring_unsupported(p, tok) : std::string();
  });
  auto simt_heuristic = t.heuristic;
  // H100 (T 16384, n 4, D 4096, bf16): run 25 mma_ring 32 497 us, mma_warp_heads 64 521, mma_ring 16 585; run 20
  // mma_warp_heads 64 520, 32 522, mma 64 573, 32 530. mma_ring at 32 tokens where it runs, else the largest tile.
  t.heuristic = [simt_heuristic](const Problem& p) {
    if (mma_unsupported(p).empty()) {
      if (warp_heads_unsupported(p).empty() && ring_unsupported(p, 32).empty())
        return Config{{{"algo", kMmaRing}, {"threads", kMmaThreads}, {"tokens", 32}}};
      const int64_t algo = warp_heads_unsupported(p).empty() ? kMmaWarpHeads : kMma;
      for (int64_t tok : {64, 32, 16})
        if (tok <= max_mma_tokens(p) && mma_tiles(p, tok) <= kMaxMmaTiles)
          return Config{{{"algo", algo}, {"threads", kMmaThreads}, {"tokens", tok}}};
    }
    Config c = simt_heuristic(p);
    c.values.insert(c.values.begin(), {"algo", kSimt});
    return c;
  };
  return t;
}

// ---- pre.fwd's algo=decode: one launch for few tokens (templates/mhc/mhc_pre_decode.cuh) ----
// Its items: the projection's columns in items of 256 (a warp's 8 columns a lane), y in items of 256 groups of
// 8 elements; blocks of 256 threads, named threads=256, tokens=1 (the kernel takes any T, a warp a token at a
// time). Exact fp32 FMAs, so any dtype of x and any arch. Not yet the heuristic's: the H100 decides (run 29).
// algo=decode_rows (5): the same with the projection items' warps splitting phi's rows instead of the tokens (each
// row of the item read once a block, not once a warp): the same sums in the same order, the same bits.
constexpr int64_t kDecode = 4, kDecodeRows = 5, kDecodeThreads = 256, kDecodeItemCols = 256, kDecodeHeadTokens = 8;
bool decode_algo(const Config& c) { return c.get("algo") == kDecode || c.get("algo") == kDecodeRows; }
// kMhcDecodeThreads, kMhcDecodeItemCols, kMhcDecodeHeadTokens in the kernel
constexpr int64_t kDecodeSyncBytes = 256;  // the four counters, padded
// Up to this many tokens the mma_ring and mma_warp_heads plans run the decode kernel (their kernel 3) instead of
// the split plan (H100, run 30, gpu us, split / decode / decode_rows: T 1 15.2 / 13.2 / 14.2, T 8 18.8 / 15.8 /
// 15.2, T 16 26.2 / 23.0 / 22.4, T 32 26.4 / 36.3 / 35.9: tools/bench/dispatch.py --mhc-decode).
constexpr int64_t kDecodeUpToT = 16;
constexpr bool kDecodeUpToTRows = true;  // which of the two: decode (false) or decode_rows
int64_t decode_items(const Problem& p) { return ceil_div(p.dim("nD"), kDecodeItemCols); }
int64_t decode_y_items(const Problem& p) { return ceil_div(p.dim("T") * ceil_div(p.dim("D"), 8), kDecodeThreads); }
std::string decode_unsupported(const Config& c) {
  if (c.get("threads") != kDecodeThreads || c.get("tokens") != 1)
    return "algo=decode and decode_rows run 256 threads a block over every token (named threads=256, tokens=1)";
  return "";
}
TuningSpace with_decode_algo(TuningSpace t) {
  for (auto& [name, values] : t.axes)
    if (name == "algo") values.insert(values.end(), {kDecode, kDecodeRows});
  auto valid = t.valid;
  t.valid = [valid](const Problem& p, const Config& c, std::string* why) {
    if (!decode_algo(c)) return valid(p, c, why);
    const std::string no = decode_unsupported(c);
    if (why) *why = no;
    return no.empty();
  };
  auto block_threads = t.block_threads;
  t.block_threads = [block_threads](const Problem& p, const Config& c) {
    return decode_algo(c) ? kDecodeThreads : block_threads(p, c);
  };
  return t;
}

// The counters and partial totals of a decode launch (MhcPreDecodeParams): the counters must be zero when the
// kernel starts, and it leaves them so. Outside graph capture, one buffer per device and stream, its counters
// zeroed once when it is allocated (launches on one stream run one after another; two streams never share one);
// inside a capture, the graph's own workspace with a memset node before the kernel (a replay may run on any
// stream, beside eager work on the capturing one). The buffers live as long as the process (as the workspaces).
unsigned char* decode_scratch(const Call& call, Launcher& l, size_t bytes) {
  const CUstream stream = reinterpret_cast<CUstream>(call.stream);
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  CU_CHECK(cuStreamIsCapturing(stream, &status));
  if (status != CU_STREAM_CAPTURE_STATUS_NONE) {
    auto* ws = static_cast<unsigned char*>(l.workspace(bytes));
    CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(ws), 0, kDecodeSyncBytes / 4, stream));
    return ws;
  }
  struct Buffer {
    CUdeviceptr ptr = 0;
    size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, Stream>, Buffer> buffers;
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = buffers[{call.device, call.stream}];
  if (b.bytes < bytes) {
    if (b.ptr) {
      CU_CHECK(cuStreamSynchronize(stream));  // pending launches may still use it
      CU_CHECK(cuMemFree(b.ptr));
      b = Buffer{};
    }
    const size_t grow = std::max(bytes, size_t(1) << 20);
    CU_CHECK(cuMemAlloc(&b.ptr, grow));
    b.bytes = grow;
    CU_CHECK(cuMemsetD32Async(b.ptr, 0, kDecodeSyncBytes / 4, stream));
  }
  return reinterpret_cast<unsigned char*>(b.ptr);
}

std::string t_max_arg(const Problem& p);

jit::KernelSpec decode_kernel(const Problem& p, bool rows) {
  std::vector<std::string> targs = {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")),
                                    std::to_string(p.dim("D")), t_max_arg(p), b(p.present("gamma")), b(pre_only(p)),
                                    b(mma_vec(p))};
  if (rows) targs.push_back("true");  // kRowSplit, false by default
  return kernel_spec(p, "mhc/mhc_pre_decode.cuh", "kspec::mhc_pre_fwd_decode_kernel", std::move(targs));
}

// The decode kernel, the plan's kernel `kernel`.
void launch_decode(const Call& call, Launcher& l, const MhcPreParams& pre, size_t kernel) {
  const Problem& pr = call.problem;
  MhcPreDecodeParams a{};
  a.pre = pre;
  a.items = static_cast<int>(decode_items(pr));
  a.y_items = static_cast<int>(decode_y_items(pr));
  const int64_t T = pr.dim("T"), k = proj_rows(pr) + 1, nn = pre_only(pr) ? 0 : pr.dim("n") * pr.dim("n");
  const int64_t part = a.items * ceil_div(T * k, 4) * 4, z = T > kDecodeHeadTokens ? T * nn : 0;  // rows of float4s
  unsigned char* s = decode_scratch(call, l, kDecodeSyncBytes + sizeof(float) * static_cast<size_t>(part + z));
  a.sync = reinterpret_cast<unsigned*>(s);
  a.part = reinterpret_cast<float*>(s + kDecodeSyncBytes);
  a.z = z ? a.part + part : nullptr;
  // At most the blocks resident at once (each then takes several items), and no more than the items.
  const int64_t resident = int64_t(l.multiprocessors()) * std::max(1, l.occupancy(kernel, u32(kDecodeThreads), 0));
  void* args[] = {&a};
  l.launch(kernel, {u32(std::min<int64_t>(a.items + a.y_items, resident))}, {u32(kDecodeThreads)}, 0, args);
}

std::string thr(const Config& c) { return std::to_string(c.get("threads")); }
// pre_only has no Sinkhorn-Knopp: one specialization whatever t_max.
std::string t_max_arg(const Problem& p) { return pre_only(p) ? "1" : std::to_string(p.param_int("t_max")); }

// ---- references ----

ref::MhcShape shape_of_problem(const Problem& p) {
  return {p.dim("T"), p.dim("n"), p.dim("D"), pre_only(p)};
}
ref::MhcEps eps_of(const Problem& p) {
  ref::MhcEps e;
  e.rms = p.param_float("eps_rms");
  e.pre = p.param_float("eps_pre");
  if (!pre_only(p)) {
    e.sk = p.param_float("eps_sk");
    e.t_max = static_cast<int>(p.param_int("t_max"));
  }
  return e;
}
std::vector<double> or_empty(const HostTensor& h) { return h.defined ? h.data : std::vector<double>{}; }

// Leading dims as the first input had them, then `rest`.
std::vector<int64_t> token_shape(const HostTensor& x, size_t trailing, std::vector<int64_t> rest) {
  std::vector<int64_t> s(x.shape.begin(), x.shape.end() - static_cast<std::ptrdiff_t>(trailing));
  s.insert(s.end(), rest.begin(), rest.end());
  return s;
}

// N(0, 1) inputs would give |m| ~ sqrt(nD): every sigmoid saturated and R a permutation. A projection
// of unit scale keeps h near the unit range, where the gradients are not vanishingly small.
void scale_projection(const Problem& p, std::vector<HostTensor>& in, size_t phi) {
  const double s = 1.0 / std::sqrt(static_cast<double>(p.dim("nD")));
  for (double& v : in[phi].data) v *= s;
}

// pre.fwd inputs: x, phi, alpha, bias, gamma.
ref::MhcPreInputs pre_inputs_of(const std::vector<HostTensor>& in, size_t first) {
  return {in[first].data, in[first + 1].data, in[first + 2].data, in[first + 3].data, or_empty(in[first + 4])};
}

std::vector<HostTensor> pre_fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  auto r = ref::mhc_pre_fwd_ref(s, eps_of(p), pre_inputs_of(in, 0));
  const HostTensor& x = in[0];
  std::vector<HostTensor> out;
  out.push_back({true, token_shape(x, 2, {s.D}), std::move(r.y)});
  out.push_back({true, token_shape(x, 2, {s.n}), std::move(r.h_pre)});
  if (!s.pre_only) {
    out.push_back({true, token_shape(x, 2, {s.n}), std::move(r.h_post)});
    out.push_back({true, token_shape(x, 2, {s.n, s.n}), std::move(r.r)});
  }
  out.push_back({true, token_shape(x, 2, {}), std::move(r.inv)});
  out.push_back({true, token_shape(x, 2, {proj_rows(p)}), std::move(r.h)});
  return out;
}

// An input by name, or an absent one when the op has no such input (pre_only: dh_post, dr).
HostTensor named(const Problem& p, const std::vector<HostTensor>& in, const char* name) {
  const auto& defs = p.op->info.inputs;
  for (size_t i = 0; i < defs.size(); ++i)
    if (defs[i].name == name) return in[i];
  return {};
}

// pre.bwd inputs: dy, x, phi, alpha, bias, gamma, inv, h, dh_pre, dh_post, dr, dx_post (pre_only: no
// dh_post, dr).
std::vector<HostTensor> pre_bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  ref::MhcPreUpstream up{in[0].data, or_empty(named(p, in, "dh_pre")), or_empty(named(p, in, "dh_post")),
                         or_empty(named(p, in, "dr")), or_empty(named(p, in, "dx_post"))};
  auto g = ref::mhc_pre_bwd_ref(s, eps_of(p), pre_inputs_of(in, 1), up);
  std::vector<HostTensor> out(5);
  out[0] = {true, in[1].shape, std::move(g.dx)};
  out[1] = {true, in[2].shape, std::move(g.dphi)};
  out[2] = {true, in[3].shape, std::move(g.dalpha)};
  out[3] = {true, in[4].shape, std::move(g.dbias)};
  if (in[5].defined) out[4] = {true, in[5].shape, std::move(g.dgamma)};
  return out;
}

void pre_fwd_prepare(const Problem& p, std::vector<HostTensor>& in) { scale_projection(p, in, 1); }

// The saved inv and h must be the forward's on these inputs.
void pre_bwd_prepare(const Problem& p, std::vector<HostTensor>& in) {
  scale_projection(p, in, 2);
  auto r = ref::mhc_pre_fwd_ref(shape_of_problem(p), eps_of(p), pre_inputs_of(in, 1));
  in[6].data = std::move(r.inv);
  in[7].data = std::move(r.h);
}

// ---- cases ----

struct PreCase {
  const char* name;
  int64_t T, n, D;
  int64_t t_max = 20;
  bool gamma = true, pre_only = false, eps0 = false, large = false;
};

const std::vector<PreCase>& pre_case_specs() {
  static const std::vector<PreCase> specs = {
      {"base", 37, 4, 256},
      {"n_1", 5, 1, 64},
      {"n_2", 9, 2, 100},
      {"n_3", 7, 3, 33},
      {"n_8", 5, 8, 128},
      {"T_1", 1, 4, 128},
      {"T_2", 2, 4, 128},
      {"D_37", 6, 4, 37},
      {"D_128", 5, 4, 128},  // the hand-written backward that read 32 of 128 elements
      {"D_1000", 3, 4, 1000},
      {"D_2560", 3, 4, 2560},
      {"D_4000", 3, 4, 4000},  // nD above every block size
      {"D_7168", 2, 4, 7168},
      {"t_max_1", 11, 4, 64, 1},
      {"t_max_3_n_8", 4, 8, 40, 3},
      {"eps_0", 9, 4, 96, 20, true, false, true},
      {"no_gamma", 13, 4, 200, 20, false},
      // mhc.pre_only.*
      {"base", 10, 4, 300, 20, true, true},
      {"n_8", 5, 8, 128, 20, true, true},
      {"no_gamma_n_1", 3, 1, 50, 20, false, true},
      {"D_4000", 3, 4, 4000, 20, true, true},
      {"T_1", 1, 4, 37, 20, false, true},
      {"dx_dgamma_multiblock", 1031, 4, 4000},  // several parts of the sums over tokens
      {"deepseek_v4_16384x4x4096", 16384, 4, 4096, 20, true, false, false, true},
  };
  return specs;
}

std::vector<Case> pre_cases(bool bwd, bool po) {
  std::vector<Case> cases;
  for (const PreCase& s : pre_case_specs()) {
    if (s.pre_only != po) continue;
    Case c;
    c.name = s.name;
    c.dims = {{"T", s.T}, {"n", s.n}, {"D", s.D}};
    if (!po) c.params = {{"t_max", s.t_max}};
    if (s.eps0) c.params = {{"t_max", s.t_max}, {"eps_rms", 0.0}, {"eps_pre", 0.0}, {"eps_sk", 0.0}};
    if (!s.gamma) c.without.push_back("gamma");
    c.large = s.large;
    c.representative = c.name == "base" || c.name == "n_8";
    cases.push_back(std::move(c));
  }
  if (bwd && po) {
    Case c;
    c.name = "only_dy";
    c.dims = {{"T", 19}, {"n", 4}, {"D", 160}};
    c.without = {"dh_pre", "dx_post"};
    cases.push_back(std::move(c));
  }
  if (bwd && !po) {
    // Each upstream gradient alone beside dy, and dx_post (the post op's dx) added in.
    const std::vector<std::pair<const char*, std::vector<std::string>>> alone = {
        {"only_dy", {"dh_pre", "dh_post", "dr", "dx_post"}},
        {"dy_dh_pre", {"dh_post", "dr", "dx_post"}},
        {"dy_dh_post", {"dh_pre", "dr", "dx_post"}},
        {"dy_dr", {"dh_pre", "dh_post", "dx_post"}},
        {"no_dx_post", {"dx_post"}},
    };
    for (const auto& [name, without] : alone) {
      Case c;
      c.name = name;
      c.dims = {{"T", 19}, {"n", 4}, {"D", 160}};
      c.without = without;
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

// ---- pre.fwd ----

OpDef pre_base(const char* name, const char* doc, bool bwd, bool po) {
  OpDef op;
  op.info.name = name;
  op.info.family = "mhc";
  op.info.doc = doc;
  op.info.params = {eps_param("eps_rms", "added to mean(v^2) under the square root"),
                    eps_param("eps_pre", "added to H_pre = sigma(h[0:n])"),
                    eps_param("eps_sk", "added after the softmax and to every Sinkhorn-Knopp divisor"), t_max_param()};
  if (po) op.info.params.resize(2);  // no Sinkhorn-Knopp
  op.info.dims = pre_dims();
  op.info.reference = "api/ops/mhc/reference.cpp (python/kspec/reference/mhc.py)";
  op.info.constants = {{"max_n", kMaxN}, {"max_t_max", kMaxTMax}};
  op.check = check_pre;
  op.derived_dims = pre_derived_dims();
  op.compile_dims = {{"T", 1}};
  op.tuning = with_tokens_axis(threads_tuning({128, 256}, pre_min_threads, 256));
  op.info.tuning_axes = op.tuning.axes;
  op.cases = pre_cases(bwd, po);
  op.dtypes = kFloatTypes;
  return op;
}

std::vector<TensorDef> pre_param_inputs() {
  return {f32("phi", {"M", "nD"}, false, "projection [n*n + 2n, n*D] (pre_only: [n, n*D])"),
          f32("alpha", {"A"}, false, "scales of the pre, post and residual rows (pre_only: [1], the pre rows')"),
          f32("bias", {"M"}, false, "added to h"),
          f32("gamma", {"nD"}, true, "RMSNorm weight over the n*D flattened streams (absent: 1)")};
}

void check_tokens(const Problem& p) {
  KSPEC_CHECK(p.dim("T") <= INT32_MAX, p.op->info.name, ": input 'x': at most 2^31-1 tokens, got ", p.dim("T"));
}

OpDef make_pre_fwd(bool po) {
  OpDef op = pre_base(po ? "mhc.pre_only.fwd" : "mhc.pre.fwd",
                      po ? "mHC pre with H_pre alone (M = n): y = sum_i H_pre[i] x[i], the final collapse of the "
                           "streams; saves inv and h for the backward"
                         : "mHC pre: from x [..., n, D], H_pre, H_post, R (Sinkhorn-Knopp) and y = sum_i H_pre[i] "
                           "x[i] (the sublayer input); saves inv and h for the backward",
                      false, po);
  op.info.inputs = {streams("x", "", "the n residual streams; last dim contiguous, leading dims with one row stride")};
  for (auto& t : pre_param_inputs()) op.info.inputs.push_back(t);
  op.info.outputs = {per_token("y", "x", "sublayer input sum_i H_pre[i] x[i]"),
                     f32("h_pre", {"...T", "n"}, false, "sigma(h[0:n]) + eps_pre")};
  if (!po) {
    op.info.outputs.push_back(f32("h_post", {"...T", "n"}, false, "2 sigma(h[n:2n])"));
    op.info.outputs.push_back(
        f32("r", {"...T", "n", "n"}, false, "Sinkhorn-Knopp of h[2n:] as n x n: R[j, k] mixes stream j into k"));
  }
  op.info.outputs.push_back(f32("inv", {"...T"}, true, "1/sqrt(mean(v^2) + eps_rms), saved for the backward",
                                 "save_stats"));
  op.info.outputs.push_back(f32("h", {"...T", "M"}, true, "the pre-activation rows, saved for the backward",
                                 "save_stats"));
  // Without a backward to follow (inference, a decode step) inv and h are not outputs at all: two allocations
  // fewer a call, and algo=decode stores neither (the other algos write them to the workspace).
  op.info.params.push_back({"save_stats", ParamType::Bool, true, {},
                            "write inv and h (what the backward reads); false: leave both out"});
  op.check_call = [](const Call& call) { check_tokens(call.problem); };
  op.tuning = with_decode_algo(with_algo_axis(op.tuning));
  op.info.tuning_axes = op.tuning.axes;
  op.kernels = [](const Problem& p, const Config& c) {
    if (decode_algo(c)) return std::vector<jit::KernelSpec>{decode_kernel(p, c.get("algo") == kDecodeRows)};
    if (c.get("algo") != kSimt) {
      const std::string T = dtype_cuda_type(p.dtype("x")), n = std::to_string(p.dim("n")),
                        D = std::to_string(p.dim("D")), g = b(p.present("gamma")), head = b(pre_only(p));
      std::vector<jit::KernelSpec> k{kernel_spec(p, "mhc/mhc_pre_mma.cuh", "kspec::mhc_pre_fwd_mma_kernel",
                                                 {T, n, D, t_max_arg(p), g, head, std::to_string(c.get("tokens")),
                                                  b(mma_vec(p)), "1", b(c.get("algo") == kMmaRing),
                                                  b(fwd_warp_heads(c))})};
      if (fwd_warp_heads(c)) {  // the split plan for few tokens (kernels 1, 2)
        const std::string tok = std::to_string(kSplitTokens), splits = std::to_string(fwd_splits(p));
        k.push_back(kernel_spec(p, "mhc/mhc_pre_mma.cuh", "kspec::mhc_pre_fwd_mma_kernel",
                                {T, n, D, t_max_arg(p), g, head, tok, b(mma_vec(p)), splits, "false", "true"}));
        k.push_back(kernel_spec(p, "mhc/mhc_pre_mma.cuh", "kspec::mhc_pre_fwd_split_heads_kernel",
                                {T, n, D, t_max_arg(p), head, tok, b(mma_vec(p)), splits}));
        if (kDecodeUpToT > 0) k.push_back(decode_kernel(p, kDecodeUpToTRows));  // kernel 3: up to kDecodeUpToT tokens
      }
      return k;
    }
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mhc/mhc_pre.cuh", "kspec::mhc_pre_fwd_kernel",
        {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")), std::to_string(p.dim("D")),
         t_max_arg(p), b(p.present("gamma")), b(pre_only(p)), thr(c), std::to_string(c.get("tokens"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& pr = call.problem;
    if (pr.dim("T") == 0) return;
    MhcPreParams a{};
    a.x = call.in("x").data;
    a.phi = static_cast<const float*>(call.in("phi").data);
    a.alpha = static_cast<const float*>(call.in("alpha").data);
    a.bias = static_cast<const float*>(call.in("bias").data);
    a.gamma = static_cast<const float*>(call.in("gamma").data);
    a.y = call.out("y").data;
    a.h_pre = static_cast<float*>(call.out("h_pre").data);
    if (!pre_only(pr)) {
      a.h_post = static_cast<float*>(call.out("h_post").data);
      a.r = static_cast<float*>(call.out("r").data);
    }
    a.inv = static_cast<float*>(call.out("inv").data);
    a.h = static_cast<float*>(call.out("h").data);
    a.T = pr.dim("T");
    a.x_row = call.row_stride(call.in("x"));
    a.y_row = call.row_stride(call.out("y"));
    a.eps_rms = static_cast<float>(pr.param_float("eps_rms"));
    a.eps_pre = static_cast<float>(pr.param_float("eps_pre"));
    a.eps_sk = pre_only(pr) ? 0.f : static_cast<float>(pr.param_float("eps_sk"));
    if (decode_algo(c)) return launch_decode(call, l, a, 0);
    if (fwd_warp_heads(c) && a.T <= kDecodeUpToT) return launch_decode(call, l, a, 3);
    // Without save_stats the other kernels still store inv and h: into the workspace, after what the split
    // plan takes (one request for both).
    const bool split = fwd_warp_heads(c) && a.T <= kSplitMaxT;
    const int64_t split_floats =
        split ? ceil_div(a.T, kSplitTokens) * fwd_splits(pr) * kSplitTokens * (proj_rows(pr) + 1) : 0;
    const int64_t dropped = pr.param_bool("save_stats") ? 0 : a.T * (1 + proj_rows(pr));
    float* ws = split_floats + dropped
                    ? static_cast<float*>(l.workspace(sizeof(float) * static_cast<size_t>(split_floats + dropped)))
                    : nullptr;
    if (dropped) {
      a.inv = ws + split_floats;
      a.h = a.inv + a.T;
    }
    void* args[] = {&a};
    if (split) {
      const int64_t tiles = ceil_div(a.T, kSplitTokens), splits = fwd_splits(pr);
      MhcPreSplitParams sp{a, ws};
      void* split_args[] = {&sp};
      l.launch(1, {u32(tiles), u32(splits)}, {u32(kMmaThreads)}, 0, split_args);
      l.launch(2, {u32(tiles), u32(fwd_y_blocks(pr))}, {u32(kMmaThreads)}, 0, split_args);
      return;
    }
    l.launch(0, {u32(ceil_div(a.T, c.get("tokens")))}, {u32(c.get("algo") != kSimt ? kMmaThreads : c.get("threads"))},
             0, args);
  };
  op.reference = pre_fwd_reference;
  op.prepare_inputs = pre_fwd_prepare;
  return op;
}

// ---- pre.bwd ----

int64_t bwd_parts(int64_t T) { return std::clamp<int64_t>(ceil_div(T, kTokensPerPart), 1, kMaxParts); }

// pre.bwd's `algo` axis (mhc.pre.bwd, mhc.pre_only.bwd; post_pre.bwd has none and runs kSimt): kSimt, the
// token and columns kernels of mhc_pre.cuh; kMma, the sums over tokens as one GEMM a part and dx's
// du = dm phi on tensor cores (mhc_pre_bwd_mma.cuh, 128 threads), the SIMT token kernel's first pass and
// heads as kSimt's (`threads`, `tokens` 1 or 4); kMmaTokens, kMma with that first pass on tensor cores too
// (mhc_pre_bwd_token_mma.cuh: 128 threads, `tokens` 16, 32 or 64); kMmaFused, kMmaTokens' token pass, then
// dx and the sums over tokens in one pass over x (mhc_pre_bwd_fused_mma.cuh) instead of two;
// kMmaFusedWarpHeads, kMmaFused with each warp of the token pass running its own tokens' heads.
bool bwd_mma(const Config& c) { return c.has("algo") && c.get("algo") >= kMma; }
bool bwd_mma_tokens(const Config& c) { return c.has("algo") && c.get("algo") >= kMmaTokens; }
bool bwd_mma_fused(const Config& c) { return c.has("algo") && c.get("algo") >= kMmaFused; }
// kMmaFusedWarpHeads: kMmaFused with the token pass's heads run per warp (mhc_pre_bwd_token_mma.cuh, kWarpHeads);
// kMmaFusedRing: that with the token pass's rows through a cp.async ring in dynamic shared memory (kRing).
// kMmaFusedAhead: kMmaFusedWarpHeads with the fused kernel's per-token c_v and H_pre loaded a step ahead with dm,
// dx stored 8 bytes at a time, the parts from the last (mhc_pre_bwd_fused_mma.cuh, kAhead): the same bits.
// kMmaFusedPhiRing: that with the token pass's phi and gamma through a per-warp cp.async ring in dynamic shared
// memory, 3 (chunk, stream) steps ahead (mhc_pre_bwd_token_mma.cuh, kPhiRing): the same bits.
// The most dynamic shared memory a block may opt in to (sm_80 and sm_87 163 KB, sm_90+ 227 KB, the others 99 KB).
int64_t block_smem_limit(const Problem& p) {
  const int cc = jit::compute_capability(p.arch);
  return cc >= 90 ? 232448 : cc == 80 || cc == 87 ? 166912 : 101376;
}
// kMmaSlice: mma_fused_ahead's token pass, then one block per 128 columns walking every token, its groups of 4
// warps over ranges of the tokens sharing each step's dm, c_v and H_pre through a 6-step cp.async ring, the groups'
// sums added in shared memory and written as dphi and dgamma (mhc_pre_bwd_slice_mma.cuh): no partial sums over
// parts but db's and dalpha's, dx the same bits as mma_fused_ahead.
// kMmaSliceDu1: kMmaSlice with du = dm phi in one TF32 mma of the hi parts instead of three (its dx, a 16-bit output,
// within ~2^-11 of du; dphi, dgamma, db, dalpha as kMmaSlice's bits).
// kMmaSliceDu1Nb, kMmaSliceDu1Mb: kMmaSliceDu1 with each group of 4 warps under its own named barrier / mbarrier a
// step (the slice kernel's kGroupSync 1 / 2) instead of one block barrier: the same bits.
constexpr int64_t kMmaFusedAhead = 6, kMmaFusedPhiRing = 7, kMmaSlice = 8, kMmaSliceDu1 = 9, kMmaSliceDu1Nb = 10,
                  kMmaSliceDu1Mb = 11;
bool bwd_warp_heads(const Config& c) { return c.has("algo") && c.get("algo") >= kMmaFusedWarpHeads; }
bool bwd_ring(const Config& c) { return c.has("algo") && c.get("algo") == kMmaFusedRing; }
bool bwd_ahead(const Config& c) {
  return c.has("algo") && (c.get("algo") == kMmaFusedAhead || c.get("algo") == kMmaFusedPhiRing);
}
bool bwd_slice(const Config& c) { return c.has("algo") && c.get("algo") >= kMmaSlice; }
bool bwd_slice_du1(const Config& c) { return c.has("algo") && c.get("algo") >= kMmaSliceDu1; }
// The slice kernel's kGroupSync: 0 one block barrier a step, 1 a named barrier a group, 2 an mbarrier a group.
int64_t bwd_slice_group_sync(const Config& c) {
  const int64_t algo = c.has("algo") ? c.get("algo") : 0;
  return algo == kMmaSliceDu1Nb ? 1 : algo == kMmaSliceDu1Mb ? 2 : 0;
}
// The slice kernel's groups of 4 warps (its kGroups): 4, 512 threads, one block an SM (__launch_bounds__(512, 1):
// at most 128 registers).
constexpr int64_t kSliceGroups = 4;
// Its dynamic shared memory (MhcSliceSmem): phi's fragments of 4 warps (ceil(M / 8) x 2 KB each), 6 steps (4 with
// dx_post) of each group's dm, c_v, H_pre (8 (M + 1 + n) floats, rounded to 4) and of its rows (2 or, with dx_post,
// 3 x 2 KB), the last also holding the groups' sums at the end: 142 KB at n 4, 138 KB with dx_post.
int64_t bwd_slice_smem_bytes(const Problem& p, bool dx_post) {
  const int64_t kt = ceil_div(proj_rows(p), 8), stages = dx_post ? 4 : 6, groups = kSliceGroups;
  const int64_t coef = (8 * (proj_rows(p) + 1 + p.dim("n")) + 3) / 4 * 4;
  const int64_t rows = stages * groups * (dx_post ? 3 : 2) * 2 * 128 * 8, red = (groups - 1) * 4 * 2 * kt * 4 * 32 * 4;
  return 4 * 2 * kt * 2 * 32 * 16 + stages * groups * coef * 4 + std::max(rows, red);
}
bool bwd_phi_ring(const Config& c) { return c.has("algo") && c.get("algo") == kMmaFusedPhiRing; }
// The token pass's ring (templates/mhc/mhc_pre_bwd_token_mma.cuh, mhc_pre_bwd_ring_bytes): 2 chunks of a lane's
// n + 1 rows of 16 bytes per m16 tile of tokens; mma_tokens' n x tokens / 16 <= 8 keeps it at most 96 KB
// (n 4, 32 tokens: 80 KB), beside 14 KB of static shared memory: 2 blocks an SM, as the registers allow.
int64_t bwd_ring_bytes(const Problem& p, int64_t tokens) { return 2 * (p.dim("n") + 1) * (tokens / 16) * 2 * kMmaThreads * 16; }
// The phi ring (mhc_pre_bwd_phi_ring_bytes): 4 warps x 4 slots of ceil(M / 8) x 8 rows of 36 floats and 32 of
// gamma: 56 KB at n 4, beside the 14 KB of static shared memory.
int64_t bwd_phi_ring_bytes(const Problem& p) { return 4 * 4 * (ceil_div(proj_rows(p), 8) * 8 * 36 + 32) * 4; }
// The fused kernel's columns a block (4 warps of 32).
constexpr int64_t kFusedBlockCols = 128;
// The mma columns kernel's consecutive columns per lane (its kNt): 8 while ceil(M / 16) <= 3 m16 tiles of
// accumulators fit (n <= 6), else 4; a block takes 4 warps x 8 kNt columns.
int64_t bwd_mma_lane_cols(const Problem& p) { return ceil_div(proj_rows(p), 16) <= 3 ? 8 : 4; }
int64_t bwd_mma_block_cols(const Problem& p) { return 4 * 8 * bwd_mma_lane_cols(p); }
bool bwd_mma_vec(const Problem& p) { return p.dim("D") % bwd_mma_lane_cols(p) == 0 && p.align_bytes >= 16; }
// The mma dx kernel's tokens a block: its lanes keep dm split hi + lo for (tokens / 16) x ceil(M / 8) mma
// steps; 32 tokens while that is at most 6 (n <= 4), else 16.
int64_t bwd_mma_dx_tokens(const Problem& p) { return 2 * ceil_div(proj_rows(p), 8) <= 6 ? 32 : 16; }

// pre.bwd's three kernels (token, columns, reduce), also the first three of post_pre.bwd; algo=mma and
// algo=mma_tokens add a fourth, dx; algo=mma_fused has three (token, fused dx and columns, reduce); algo=mma_slice
// three (token, dx and the columns by slices of every token, the reduce of db and dalpha alone).
std::vector<jit::KernelSpec> pre_bwd_kernels(const Problem& p, const Config& c, bool dx_post) {
  const std::string T = dtype_cuda_type(p.dtype("x")), n = std::to_string(p.dim("n")),
                    D = std::to_string(p.dim("D")), g = b(p.present("gamma")), head = b(pre_only(p));
  const std::string tokens = std::to_string(c.get("tokens"));
  const auto reduce = kernel_spec(p, "mhc/mhc_pre.cuh", "kspec::mhc_pre_bwd_reduce_kernel",
                                  {n, D, g, head, std::to_string(kReduceThreads), b(bwd_slice(c))});
  if (!bwd_mma(c)) {
    return {kernel_spec(p, "mhc/mhc_pre.cuh", "kspec::mhc_pre_bwd_token_kernel",
                        {T, n, D, t_max_arg(p), g, head, b(dx_post), thr(c), tokens}),
            kernel_spec(p, "mhc/mhc_pre.cuh", "kspec::mhc_pre_bwd_columns_kernel", {T, n, D, g, head, thr(c)}), reduce};
  }
  // algo=mma: the token kernel without its dx pass (so no dx_post there), then dx on tensor cores (plan
  // kernel 3, after the reduce: it needs only the token kernel's workspace); algo=mma_tokens: the token
  // pass on tensor cores, which never writes dx; algo=mma_fused: that token pass, then dx with the columns.
  if (bwd_slice(c)) {
    const auto slice = kernel_spec(p, "mhc/mhc_pre_bwd_slice_mma.cuh", "kspec::mhc_pre_bwd_slice_mma_kernel",
                                   {T, n, D, g, head, b(dx_post), std::to_string(kSliceGroups), b(bwd_slice_du1(c)),
                                    std::to_string(bwd_slice_group_sync(c))});
    return {kernel_spec(p, "mhc/mhc_pre_bwd_token_mma.cuh", "kspec::mhc_pre_bwd_token_mma_kernel",
                        {T, n, D, t_max_arg(p), g, head, tokens, b(mma_vec(p)), "false", "false", "true"}),
            slice, reduce};
  }
  if (bwd_mma_fused(c)) {
    return {kernel_spec(p, "mhc/mhc_pre_bwd_token_mma.cuh", "kspec::mhc_pre_bwd_token_mma_kernel",
                        {T, n, D, t_max_arg(p), g, head, tokens, b(mma_vec(p)), b(bwd_phi_ring(c)), b(bwd_ring(c)),
                         b(bwd_warp_heads(c))}),
            kernel_spec(p, "mhc/mhc_pre_bwd_fused_mma.cuh", "kspec::mhc_pre_bwd_fused_mma_kernel",
                        {T, n, D, g, head, b(dx_post), b(bwd_ahead(c))}),
            reduce};
  }
  return {bwd_mma_tokens(c) ? kernel_spec(p, "mhc/mhc_pre_bwd_token_mma.cuh", "kspec::mhc_pre_bwd_token_mma_kernel",
                                          {T, n, D, t_max_arg(p), g, head, tokens, b(mma_vec(p)), "false", "false",
                                           "false"})
                            : kernel_spec(p, "mhc/mhc_pre.cuh", "kspec::mhc_pre_bwd_token_kernel",
                                          {T, n, D, t_max_arg(p), g, head, "false", thr(c), tokens, "false"}),
          kernel_spec(p, "mhc/mhc_pre_bwd_mma.cuh", "kspec::mhc_pre_bwd_columns_mma_kernel",
                      {T, n, D, g, head, b(bwd_mma_vec(p))}),
          reduce,
          kernel_spec(p, "mhc/mhc_pre_bwd_mma.cuh", "kspec::mhc_pre_bwd_dx_mma_kernel",
                      {T, n, D, g, head, b(dx_post), std::to_string(bwd_mma_dx_tokens(p)), b(mma_vec(p))})};
}

// The pre backward's arguments both ops name alike; the caller sets x (the pre op's input `x_name`), the
// upstream dh_post, dr, dx_post and where dx goes.
MhcPreBwdParams pre_bwd_params(const Call& call, const char* x_name) {
  const Problem& pr = call.problem;
  MhcPreBwdParams a{};
  a.dy = call.in("dy").data;
  a.x = call.in(x_name).data;
  a.x_row = call.row_stride(call.in(x_name));
  a.phi = static_cast<const float*>(call.in("phi").data);
  a.alpha = static_cast<const float*>(call.in("alpha").data);
  a.bias = static_cast<const float*>(call.in("bias").data);
  a.gamma = static_cast<const float*>(call.in("gamma").data);
  a.inv = static_cast<const float*>(call.in("inv").data);
  a.h = static_cast<const float*>(call.in("h").data);
  a.dh_pre = static_cast<const float*>(call.in("dh_pre").data);
  a.dphi = static_cast<float*>(call.out("dphi").data);
  a.dalpha = static_cast<float*>(call.out("dalpha").data);
  a.dbias = static_cast<float*>(call.out("dbias").data);
  a.dgamma = static_cast<float*>(call.out("dgamma").data);
  a.T = pr.dim("T");
  a.dy_row = call.row_stride(call.in("dy"));
  a.eps_pre = static_cast<float>(pr.param_float("eps_pre"));
  a.eps_sk = pre_only(pr) ? 0.f : static_cast<float>(pr.param_float("eps_sk"));
  return a;
}

// Launches pre_bwd_kernels (the plan's kernels 0, 1, 2). With dx_bytes, dx goes to the start of the
// workspace (one request: a larger one would move it), returned; else to a.dx.
void* launch_pre_bwd(const Call& call, const Config& c, Launcher& l, MhcPreBwdParams a, size_t dx_bytes) {
  const Problem& pr = call.problem;
  const int64_t T = pr.dim("T"), m = proj_rows(pr), nd = pr.dim("nD"), parts = bwd_parts(T);
  const size_t lead = (dx_bytes + 255) / 256 * 256;
  const int64_t ws_floats = T * (2 * m + 3) + parts * ((m + 1) * nd + m + 3) + T * (1 + pr.dim("n"));
  auto* base = static_cast<char*>(l.workspace(lead + sizeof(float) * static_cast<size_t>(ws_floats)));
  if (dx_bytes) a.dx = base;
  auto* ws = reinterpret_cast<float*>(base + lead);
  a.ws_g = ws;
  a.ws_dm = ws + T * m;
  a.ws_ga = ws + 2 * T * m;
  a.ws_part = ws + T * (2 * m + 3);
  a.parts = static_cast<int>(parts);
  a.tokens_per_part = static_cast<int>(ceil_div(T, parts));
  a.ws_cv = a.ws_part + parts * ((m + 1) * nd + m + 3);
  a.ws_hpre = a.ws_cv + T;
  void* args[] = {&a};
  const unsigned th = u32(c.get("threads"));
  if (T > 0)
    l.launch(0, {u32(ceil_div(T, c.get("tokens")))}, {th},
             bwd_ring(c)       ? u32(bwd_ring_bytes(pr, c.get("tokens")))
             : bwd_phi_ring(c) ? u32(bwd_phi_ring_bytes(pr))
                               : 0,
             args);
  if (bwd_slice(c)) {
    l.launch(1, {u32(ceil_div(nd, kFusedBlockCols))}, {u32(kSliceGroups * kMmaThreads)},
             u32(bwd_slice_smem_bytes(pr, pr.present("dx_post"))), args);
    l.launch(2, {1}, {kReduceThreads}, 0, args);
    return a.dx;
  }
  if (bwd_mma_fused(c)) l.launch(1, {u32(ceil_div(nd, kFusedBlockCols)), u32(parts)}, {u32(kMmaThreads)}, 0, args);
  else if (bwd_mma(c)) l.launch(1, {u32(ceil_div(nd, bwd_mma_block_cols(pr))), u32(parts)}, {u32(kMmaThreads)}, 0, args);
  else l.launch(1, {u32(ceil_div(nd, th)), u32(parts)}, {th}, 0, args);
  l.launch(2, {u32(ceil_div((m + 1) * nd + m + 3, kReduceThreads))}, {kReduceThreads}, 0, args);
  if (bwd_mma(c) && !bwd_mma_fused(c) && T > 0) l.launch(3, {u32(ceil_div(T, bwd_mma_dx_tokens(pr)))}, {u32(kMmaThreads)}, 0, args);
  return a.dx;
}

// The tokens whose heads run side by side in the mma kernels (their kSub): a row of h and a Sinkhorn
// element per thread of 128 for each.
int64_t mma_head_tokens(const Problem& p) {
  const int64_t m = proj_rows(p), nn = pre_only(p) ? 0 : p.dim("n") * p.dim("n");
  for (int64_t k : {4, 2})
    if (k * m <= kMmaThreads && k * nn <= kMmaThreads) return k;
  return 1;
}

// algo=mma_tokens' token tiles: x in 16-byte groups (D % 8 == 0, aligned) and whole m16 tiles (16, 32,
// 64). A lane loads its n x tokens / 16 x 2 rows of 8 elements of x (4 registers each) before the chunk's
// mmas: at most 8 such n x tokens / 16, and with the accumulator tiles (tokens / 16 x ceil(M / 8)) at most
// 16 together. Without spills on sm_80 and sm_90 (ptxas, NVRTC 13): 192-202 registers at n 4 with 32
// tokens, 202-206 at n 2 with 64, 204-206 at n 6 with 16, 255 at n 7; n 8 (8 + 10) spilled 20 bytes, f16 at
// n 3 with 32 tokens 36 bytes on sm_90 (168 registers; bf16 did not), and element loads of x (D % 8 != 0)
// 8-84 bytes at 2-4 rows, down to 16 tokens at n 2. "" when `tokens` is one.
std::string bwd_mma_tokens_unsupported(const Problem& p, int64_t tokens) {
  const int64_t rows = tokens / 16 * p.dim("n");
  if (!mma_vec(p)) return "algo=mma_tokens takes x in 16-byte groups (D % 8 == 0, aligned): registers";
  if (tokens < 16) return "algo=mma_tokens takes whole m16 tiles of tokens: 16, 32 or 64";
  if (rows > 8) return "algo=mma_tokens: n x tokens / 16 above 8 (the rows of x a lane holds)";
  if (p.dim("n") == 3 && tokens > 16) return "algo=mma_tokens at n = 3 takes 16 tokens (f16 spilled at 32 on sm_90)";
  if (rows + mma_tiles(p, tokens) > 16)
    return "algo=mma_tokens: n x tokens / 16 rows of x and tokens / 16 x ceil(M / 8) accumulator tiles above 16 "
           "(registers; n = 8 has no such tile)";
  if (!pre_only(p) &&
      mma_head_tokens(p) * p.dim("n") * p.dim("n") * (2 * p.param_int("t_max") + 1) * 4 > kMaxPreSkSmem)
    return "algo=mma_tokens: the Sinkhorn iterates of the tokens whose heads run together exceed 40 KiB";
  return "";
}

// algo=mma and algo=mma_tokens wherever mma_unsupported allows; algo=mma with the SIMT token kernel's
// threads and tokens (1 or 4), algo=mma_tokens with 128 threads and 16-64 tokens; algo=mma_fused and
// mma_fused_warp_heads at mma_tokens' tiles with M <= 24. The heuristic takes algo=mma_fused (M <= 24) or
// else mma_tokens at 32 tokens (16 where 32 is not valid) wherever it is valid, else algo=mma with the SIMT
// heuristic's threads and tokens (1 token on pre_only, its rule), else the SIMT kernels. H100, T 16384, n 4,
// D 4096, bf16, pre fwd+bwd: mma_fused 32 2056 us (run 20), mma_tokens 32 2540, mma 3716, simt 6280 (H200:
// mma 3567 against simt 6280; tools/bench/NOTES.md). mma_fused_ring (the token pass through a cp.async ring) is
// selectable (run 26: 1767 us against mma_fused_warp_heads' 1773); mma_fused_ahead and mma_fused_phi_ring
// selectable (run 30: 1754 and 1774 against 1789); mma_slice (the columns kernel walking every token) and its
// variants refused where their shared memory exceeds the arch's; mma_slice_du1_nb the heuristic's where nD >= 12288.
TuningSpace with_bwd_algo_axis(TuningSpace t) {
  t.axes.insert(t.axes.begin(),
                {"algo", {kSimt, kMma, kMmaTokens, kMmaFused, kMmaFusedWarpHeads, kMmaFusedRing, kMmaFusedAhead,
                          kMmaFusedPhiRing, kMmaSlice, kMmaSliceDu1, kMmaSliceDu1Nb, kMmaSliceDu1Mb}});
  for (auto& [name, values] : t.axes)
    if (name == "tokens") values = {1, 4, 16, 32, 64};
  auto simt_valid = t.valid;
  t.valid = [simt_valid](const Problem& p, const Config& c, std::string* why) {
    const int64_t algo = c.get("algo"), tok = c.get("tokens");
    std::string no = algo == kSimt ? "" : mma_unsupported(p);
    if (no.empty() && algo >= kMmaTokens) {
      if (c.get("threads") != kMmaThreads) no = "algo=mma_tokens runs 128 threads a block (named threads=128)";
      else no = bwd_mma_tokens_unsupported(p, tok);
      // The fused kernel keeps phi's fragments of every row in shared memory, 8 KB per 8 rows, beside its
      // 18 KB ring of rows (mhc_pre_bwd_fused_mma.cuh): 46 KB of the 48 static at M = 24.
      if (no.empty() && algo >= kMmaFused && proj_rows(p) > 24)
        no = "algo=mma_fused takes at most 24 projection rows (n <= 4; pre_only n <= 8): shared memory";
      if (no.empty() && algo >= kMmaSlice && bwd_slice_smem_bytes(p, p.present("dx_post")) > block_smem_limit(p))
        no = "algo=mma_slice needs " + std::to_string(bwd_slice_smem_bytes(p, p.present("dx_post"))) +
             " bytes of shared memory a block, above this arch's " + std::to_string(block_smem_limit(p));

      if (no.empty()) return true;
    } else if (no.empty() && tok > 4) {
      no = "algo=simt and algo=mma take 1 or 4 tokens a block (the SIMT token kernel's)";
    } else if (no.empty() && algo == kMma && pre_only(p) && tok > 1) {
      // Without its dx pass, ptxas (NVRTC 13) still spilled 8 bytes in the pre_only token kernel at 4
      // tokens (n 4, D 300, sm_80); 1 token does not.
      no = "algo=mma on mhc.pre_only.bwd takes 1 token a block";
    }
    if (!no.empty()) {
      if (why) *why = no;
      return false;
    }
    return simt_valid(p, c, why);
  };
  auto simt_heuristic = t.heuristic;
  t.heuristic = [simt_heuristic, valid = t.valid](const Problem& p) {
    const Config simt = simt_heuristic(p);
    // mma_fused_warp_heads where M <= 24 (H100, T 16384, n 4, D 4096, bf16, pre fwd+bwd: 1794 us against 2004
    // with mma_fused, 2478 with mma_tokens; the same bits as mma_fused), else mma_tokens.
    // mma_slice_du1 first where nD gives at least ~96 column blocks (H100, T 16384, n 4, D 4096, bf16, run 33: pre
    // fwd+bwd 1494 us against mma_fused_ahead's 1756 and mma_fused_warp_heads' 1766); its grid is nD / 128 blocks.
    // With a named barrier a group (mma_slice_du1_nb; run 35, H200: 1420 us against mma_slice_du1's 1512, the
    // mbarrier's 1422; racecheck 0 hazards).
    const std::vector<int64_t> algos =
        proj_rows(p) > 24         ? std::vector<int64_t>{kMmaTokens}
        : p.dim("nD") >= 12288    ? std::vector<int64_t>{kMmaSliceDu1Nb, kMmaFusedWarpHeads, kMmaFused}
                                  : std::vector<int64_t>{kMmaFusedWarpHeads, kMmaFused};
    for (int64_t algo : algos)
      for (int64_t tok : {32, 16}) {
        Config c = simt;
        c.values.insert(c.values.begin(), {"algo", algo});
        for (auto& [axis, v] : c.values) {
          if (axis == "tokens") v = tok;
          if (axis == "threads") v = kMmaThreads;
        }
        if (valid(p, c, nullptr)) return c;
      }
    Config mma = simt;
    mma.values.insert(mma.values.begin(), {"algo", kMma});
    if (pre_only(p))
      for (auto& [axis, v] : mma.values)
        if (axis == "tokens") v = 1;
    if (valid(p, mma, nullptr)) return mma;
    Config c = simt;
    c.values.insert(c.values.begin(), {"algo", kSimt});
    return c;
  };
  return t;
}

OpDef make_pre_bwd(bool po) {
  OpDef op = pre_base(po ? "mhc.pre_only.bwd" : "mhc.pre.bwd",
                      po ? "gradients of mhc.pre_only.fwd: dx (plus dx_post when given), dphi, dalpha, dbias, dgamma; "
                           "sums over tokens in a fixed order (deterministic, no atomics)"
                         : "gradients of mhc.pre.fwd: dx (plus the post op's dx_post when given), dphi, dalpha, "
                           "dbias, dgamma; sums over tokens in a fixed order (deterministic, no atomics)",
                      true, po);
  // fp32: 1e-4, the backward bound (dalpha sums inv g m over every token and row; with few tokens the
  // terms can cancel to ~1/300 of their size: 3.1e-5 at pre_only n 1, T 3 on the H100, run 32).
  op.f32_tolerance = 1e-4;
  if (po) {
    // ptxas (sm_90a, NVRTC 13) spills 8-32 bytes in mhc_pre_bwd_token_kernel<pre_only> at 256 threads
    // (48 registers), none at 128: the first correct kernel keeps to 128.
    auto valid = op.tuning.valid;
    op.tuning.valid = [valid](const Problem& p, const Config& c, std::string* why) {
      if (c.get("threads") > 128) {
        if (why) *why = "the pre_only backward spills registers at 256 threads";
        return false;
      }
      return valid(p, c, why);
    };
  }
  op.tuning = with_bwd_algo_axis(op.tuning);
  op.info.tuning_axes = op.tuning.axes;
  op.info.inputs = {per_token("dy", "", "gradient of y"),
                    streams("x", "dy", "the forward's x")};
  op.info.inputs[0].dtypes = kFloatTypes;
  op.info.inputs[0].dtype_of.clear();
  for (auto& t : pre_param_inputs()) op.info.inputs.push_back(t);
  op.info.inputs.push_back(f32("inv", {"...T"}, false, "saved by the forward"));
  op.info.inputs.push_back(f32("h", {"...T", "M"}, false, "saved by the forward"));
  op.info.inputs.push_back(f32("dh_pre", {"...T", "n"}, true, "gradient of h_pre (absent: 0)"));
  if (!po) {
    op.info.inputs.push_back(f32("dh_post", {"...T", "n"}, true, "gradient of h_post (absent: 0)"));
    op.info.inputs.push_back(f32("dr", {"...T", "n", "n"}, true, "gradient of r (absent: 0)"));
  }
  op.info.inputs.push_back(tensor_def("dx_post", {"...T", "n", "D"}, {}, "dy", false, true, "", Layout::RowStrided,
                                      "the post op's dx for the same x, added into dx"));
  op.info.outputs = {
      streams("dx", "dy", "gradient of x"),
      f32("dphi", {"M", "nD"}, false, "gradient of phi"),
      f32("dalpha", {"A"}, false, "gradient of alpha"),
      f32("dbias", {"M"}, false, "gradient of bias"),
      f32("dgamma", {"nD"}, false, "gradient of gamma", "gamma"),
  };
  op.check_call = [](const Call& call) { check_tokens(call.problem); };
  op.kernels = [](const Problem& p, const Config& c) { return pre_bwd_kernels(p, c, p.present("dx_post")); };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& pr = call.problem;
    MhcPreBwdParams a = pre_bwd_params(call, "x");
    if (!pre_only(pr)) {
      a.dh_post = static_cast<const float*>(call.in("dh_post").data);
      a.dr = static_cast<const float*>(call.in("dr").data);
    }
    a.dx_post = call.in("dx_post").data;
    a.dx_post_row = call.in("dx_post").defined() ? call.row_stride(call.in("dx_post")) : 0;
    a.dx = call.out("dx").data;
    a.dx_row = call.row_stride(call.out("dx"));
    launch_pre_bwd(call, c, l, a, 0);
  };
  op.reference = pre_bwd_reference;
  op.prepare_inputs = pre_bwd_prepare;
  return op;
}

// ---- post ----

std::vector<Case> post_cases() {
  std::vector<Case> cases;
  for (const PreCase& s : pre_case_specs()) {
    if (s.pre_only || s.eps0 || !s.gamma || s.t_max != 20) continue;  // no such inputs or params here
    Case c;
    c.name = s.name;
    c.dims = {{"T", s.T}, {"n", s.n}, {"D", s.D}};
    c.large = s.large;
    c.representative = c.name == "base" || c.name == "n_8";
    cases.push_back(std::move(c));
  }
  return cases;
}

// post's `vec` axis: 1, a thread one d with 2-byte loads and stores (mhc_post.cuh), or 8, a thread 8
// consecutive d with 16-byte ones (D % 8 == 0, every pointer and row 16-byte aligned). On the H100 (T 16384,
// n 4, D 4096, bf16) post.fwd ran at 72% of 3 TB/s and post fwd+bwd at 76% with vec 1, at 94% (428 us) and
// 97% (1060 us) with vec 8: the heuristic takes 8 wherever it is valid (tools/bench/NOTES.md). Without spills
// (ptxas, NVRTC 13, sm_80 and sm_90, bf16, f16, fp32, D 128 to 4096) from n 3 on, and in the backward up
// to n 7: at n 8 its 72 running sums and 17 rows of 8 spilled 24-128 bytes; at n 1 and 2 ptxas spilled 8-16
// bytes at 32-48 registers (post.fwd f16 n 2 on sm_90, post.bwd bf16 n 1 on sm_80).
int64_t post_vec(const Config& c) { return c.has("vec") ? c.get("vec") : 1; }
TuningSpace with_vec_axis(TuningSpace t, bool bwd) {
  t.axes.push_back({"vec", {1, 8}});
  auto threads_valid = t.valid;
  t.valid = [threads_valid, bwd](const Problem& p, const Config& c, std::string* why) {
    const char* no = nullptr;
    if (c.get("vec") == 8) {
      if (!mma_vec(p)) no = "vec=8 takes D % 8 == 0 and 16-byte aligned pointers and rows (x, f, out / dout, dx, df)";
      else if (p.dim("n") < 3) no = "vec=8 takes n >= 3 (ptxas spilled at n 1 and 2)";
      else if (bwd && p.dim("n") > 7) no = "vec=8 in the backward takes n <= 7 (its n + n^2 sums and 2n + 1 rows spill at 8)";
    }
    if (no) {
      if (why) *why = no;
      return false;
    }
    return threads_valid(p, c, why);
  };
  auto threads_heuristic = t.heuristic;
  t.heuristic = [threads_heuristic, valid = t.valid](const Problem& p) {
    Config c = threads_heuristic(p);
    c.values.push_back({"vec", 8});
    if (!valid(p, c, nullptr)) c.values.back().second = 1;
    return c;
  };
  return t;
}

OpDef post_base(const char* name, const char* doc, bool bwd) {
  OpDef op;
  op.info.name = name;
  op.info.family = "mhc";
  op.info.doc = doc;
  op.info.dims = {dim_T(), dim_n(), dim_D()};
  op.info.reference = "api/ops/mhc/reference.cpp (python/kspec/reference/mhc.py)";
  op.info.constants = {{"max_n", kMaxN}};
  op.check = check_tokens;
  op.compile_dims = {{"T", 1}};
  op.tuning = with_vec_axis(threads_tuning({64, 128, 256}, [](const Problem&) { return int64_t(32); }, 256), bwd);
  op.info.tuning_axes = op.tuning.axes;
  op.cases = post_cases();
  op.dtypes = kFloatTypes;
  return op;
}

std::vector<TensorDef> post_inputs(const std::string& like) {
  return {streams("x", like, "the n residual streams the pre op read"),
          per_token("f", like.empty() ? "x" : like, "the sublayer's output F(y)"),
          f32("h_post", {"...T", "n"}, false, "mhc.pre.fwd's h_post"),
          f32("h_res", {"...T", "n", "n"}, false, "mhc.pre.fwd's r: R[j, k] mixes stream j into k")};
}

std::vector<HostTensor> post_fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  return {{true, in[0].shape, ref::mhc_post_fwd_ref(s, in[0].data, in[1].data, in[2].data, in[3].data)}};
}

// post.bwd inputs: dout, x, f, h_post, h_res.
std::vector<HostTensor> post_bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  auto g = ref::mhc_post_bwd_ref(s, in[1].data, in[2].data, in[3].data, in[4].data, in[0].data);
  return {{true, in[1].shape, std::move(g.dx)},
          {true, in[2].shape, std::move(g.df)},
          {true, in[3].shape, std::move(g.dh_post)},
          {true, in[4].shape, std::move(g.dr)}};
}

// post_pre.bwd's config has no `vec`: 1.
std::vector<jit::KernelSpec> post_bwd_kernels(const Problem& p, const Config& c) {
  return {kernel_spec(p, "mhc/mhc_post.cuh", "kspec::mhc_post_bwd_kernel",
                      {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")), std::to_string(p.dim("D")), thr(c),
                       std::to_string(post_vec(c))})};
}

// post.bwd's kernel (plan kernel `kernel`) with the gradient of out at dout (row stride dout_row); x, f,
// h_post, h_res and the outputs dx, df, dh_post, dh_res by name (post.bwd's and post_pre.bwd's).
void launch_post_bwd(const Call& call, const Config& c, Launcher& l, size_t kernel, const void* dout,
                     int64_t dout_row) {
  const Problem& pr = call.problem;
  if (pr.dim("T") == 0) return;
  MhcPostBwdParams a{};
  a.dout = dout;
  a.x = call.in("x").data;
  a.f = call.in("f").data;
  a.h_post = static_cast<const float*>(call.in("h_post").data);
  a.r = static_cast<const float*>(call.in("h_res").data);
  a.dx = call.out("dx").data;
  a.df = call.out("df").data;
  a.dh_post = static_cast<float*>(call.out("dh_post").data);
  a.dr = static_cast<float*>(call.out("dh_res").data);
  a.T = pr.dim("T");
  a.dout_row = dout_row;
  a.x_row = call.row_stride(call.in("x"));
  a.f_row = call.row_stride(call.in("f"));
  a.dx_row = call.row_stride(call.out("dx"));
  a.df_row = call.row_stride(call.out("df"));
  void* args[] = {&a};
  l.launch(kernel, {u32(a.T)}, {u32(c.get("threads"))}, 0, args);
}

OpDef make_post_fwd() {
  OpDef op =
      post_base("mhc.post.fwd", "mHC post: out[k] = h_post[k] f + sum_j h_res[j, k] x[j] (the next layer's x)", false);
  op.info.inputs = post_inputs("");
  op.info.outputs = {streams("out", "x", "the next layer's n streams")};
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mhc/mhc_post.cuh", "kspec::mhc_post_fwd_kernel",
        {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")), std::to_string(p.dim("D")), thr(c),
         std::to_string(post_vec(c))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& pr = call.problem;
    if (pr.dim("T") == 0) return;
    MhcPostParams a{};
    a.x = call.in("x").data;
    a.f = call.in("f").data;
    a.h_post = static_cast<const float*>(call.in("h_post").data);
    a.r = static_cast<const float*>(call.in("h_res").data);
    a.out = call.out("out").data;
    a.T = pr.dim("T");
    a.x_row = call.row_stride(call.in("x"));
    a.f_row = call.row_stride(call.in("f"));
    a.out_row = call.row_stride(call.out("out"));
    void* args[] = {&a};
    const int64_t th = c.get("threads");
    l.launch(0, {u32(a.T), u32(ceil_div(pr.dim("D"), th * post_vec(c)))}, {u32(th)}, 0, args);
  };
  op.reference = post_fwd_reference;
  return op;
}

OpDef make_post_bwd() {
  OpDef op =
      post_base("mhc.post.bwd", "gradients of mhc.post.fwd: dx, df, dh_post, dh_res (per token, no atomics)", true);
  op.info.inputs = post_inputs("dout");
  op.info.inputs.insert(op.info.inputs.begin(), streams("dout", "", "gradient of out"));
  op.info.outputs = {streams("dx", "dout", "gradient of x (pass it to mhc.pre.bwd as dx_post)"),
                     per_token("df", "dout", "gradient of f"),
                     f32("dh_post", {"...T", "n"}, false, "gradient of h_post"),
                     f32("dh_res", {"...T", "n", "n"}, false, "gradient of h_res")};
  op.kernels = post_bwd_kernels;
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    launch_post_bwd(call, c, l, 0, call.in("dout").data, call.row_stride(call.in("dout")));
  };
  op.reference = post_bwd_reference;
  return op;
}

// ---- post_pre: post(l) fused with pre(l + 1) ----

// post_pre.fwd inputs: x, f, h_post, h_res (layer l's post), phi, alpha, bias, gamma (layer l + 1's pre).
std::vector<HostTensor> post_pre_fwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  std::vector<HostTensor> pre_in(in.begin() + 3, in.end());
  pre_in[0] = {true, in[0].shape, ref::mhc_post_fwd_ref(s, in[0].data, in[1].data, in[2].data, in[3].data)};
  std::vector<HostTensor> out = pre_fwd_reference(p, pre_in);
  out.insert(out.begin(), pre_in[0]);
  return out;
}

void post_pre_fwd_prepare(const Problem& p, std::vector<HostTensor>& in) { scale_projection(p, in, 4); }

// post_pre.bwd inputs: dx_next, dy, dh_pre, dh_post_next, dr_next, x, f, h_post, h_res, x_next, phi,
// alpha, bias, gamma, inv, h.
constexpr size_t kPpX = 5, kPpXNext = 9, kPpPhi = 10;

ref::MhcPreInputs post_pre_pre_inputs(const std::vector<HostTensor>& in) {
  return {in[kPpXNext].data, in[kPpPhi].data, in[kPpPhi + 1].data, in[kPpPhi + 2].data, or_empty(in[kPpPhi + 3])};
}

// The two references in turn: pre(l + 1)'s backward with dx_next added into its dx, which is then post(l)'s
// dout.
std::vector<HostTensor> post_pre_bwd_reference(const Problem& p, const std::vector<HostTensor>& in) {
  const ref::MhcShape s = shape_of_problem(p);
  ref::MhcPreUpstream up{in[1].data, or_empty(in[2]), or_empty(in[3]), or_empty(in[4]), or_empty(in[0])};
  auto g = ref::mhc_pre_bwd_ref(s, eps_of(p), post_pre_pre_inputs(in), up);
  auto pg = ref::mhc_post_bwd_ref(s, in[kPpX].data, in[kPpX + 1].data, in[kPpX + 2].data, in[kPpX + 3].data, g.dx);
  std::vector<HostTensor> out(8);
  out[0] = {true, in[kPpX].shape, std::move(pg.dx)};
  out[1] = {true, in[kPpX + 1].shape, std::move(pg.df)};
  out[2] = {true, in[kPpX + 2].shape, std::move(pg.dh_post)};
  out[3] = {true, in[kPpX + 3].shape, std::move(pg.dr)};
  out[4] = {true, in[kPpPhi].shape, std::move(g.dphi)};
  out[5] = {true, in[kPpPhi + 1].shape, std::move(g.dalpha)};
  out[6] = {true, in[kPpPhi + 2].shape, std::move(g.dbias)};
  if (in[kPpPhi + 3].defined) out[7] = {true, in[kPpPhi + 3].shape, std::move(g.dgamma)};
  return out;
}

// x_next, inv and h must be the forward's on these inputs.
void post_pre_bwd_prepare(const Problem& p, std::vector<HostTensor>& in) {
  scale_projection(p, in, kPpPhi);
  const ref::MhcShape s = shape_of_problem(p);
  in[kPpXNext].data =
      ref::mhc_post_fwd_ref(s, in[kPpX].data, in[kPpX + 1].data, in[kPpX + 2].data, in[kPpX + 3].data);
  // x_next as stored (the forward projects the rounded value, and the backward kernels read it back), so
  // inv and h are those of the x_next the GPU sees: with the unrounded one, bf16 cases missed dalpha (a sum
  // over tokens of inv g m with cancellation) by 0.045 against 0.01 on the H100.
  quantize(p.inputs[kPpXNext].dtype, in[kPpXNext].data);
  auto r = ref::mhc_pre_fwd_ref(s, eps_of(p), post_pre_pre_inputs(in));
  in[kPpPhi + 4].data = std::move(r.inv);
  in[kPpPhi + 5].data = std::move(r.h);
}

// pre.fwd's cases (the post side has no axis of its own), and in the backward each upstream gradient
// alone beside dy.
std::vector<Case> post_pre_cases(bool bwd) {
  std::vector<Case> cases = pre_cases(false, false);
  if (!bwd) return cases;
  const std::vector<std::pair<const char*, std::vector<std::string>>> alone = {
      {"only_dy", {"dx_next", "dh_pre", "dh_post_next", "dr_next"}},
      {"dy_dx_next", {"dh_pre", "dh_post_next", "dr_next"}},
      {"dy_dr_next", {"dx_next", "dh_pre", "dh_post_next"}},
  };
  for (const auto& [name, without] : alone) {
    Case c;
    c.name = name;
    c.dims = {{"T", 19}, {"n", 3}, {"D", 160}};
    c.without = without;
    cases.push_back(std::move(c));
  }
  return cases;
}

OpDef post_pre_base(const char* name, const char* doc, bool bwd) {
  OpDef op = pre_base(name, doc, bwd, false);
  op.cases = post_pre_cases(bwd);
  return op;
}

// post_pre.fwd's `algo` axis: kSimt (mhc_post_pre.cuh: `threads`, `tokens` 1 or 4), kMma (the projection on
// tensor cores, mhc_post_pre_mma.cuh: 128 threads, whole m16 tiles of tokens, x in 16-byte groups) and
// kMmaWarpHeads (that, with the heads per warp as pre.fwd's, M <= 32). A lane holds n x tokens / 16 x 2 rows
// of x: without spills on sm_80 and sm_90 (nvcc 13) at most 4 such n x tokens / 16 (n 4 at 16 tokens: 164-168
// registers; at 32, 223-255 with the stream loop unrolled 480 bytes of spill), and 16 tokens up to n 7 (168-238;
// n 8 246). The heuristic keeps kSimt until the H100 has timed both.
std::string post_pre_mma_unsupported(const Problem& p, int64_t tokens) {
  if (!mma_vec(p)) return "algo=mma on mhc.post_pre.fwd takes x in 16-byte groups (D % 8 == 0, aligned)";
  if (tokens < 16) return "algo=mma on mhc.post_pre.fwd takes whole m16 tiles of tokens: 16, 32 or 64";
  const int64_t n = p.dim("n");
  if (n * tokens / 16 > 4 && !(tokens == 16 && n <= 7))
    return "algo=mma on mhc.post_pre.fwd: n x tokens / 16 above 4 (16 tokens up to n = 7): registers";
  return "";
}
TuningSpace with_post_pre_algo_axis(TuningSpace t) {
  t = with_fwd_algo_axis(std::move(t), {kSimt, kMma, kMmaWarpHeads}, [](const Problem& p, const Config& c) {
    return post_pre_mma_unsupported(p, c.get("tokens"));
  });
  auto simt_heuristic = t.heuristic;
  t.heuristic = [simt_heuristic](const Problem& p) {
    Config c = simt_heuristic(p);
    c.values.insert(c.values.begin(), {"algo", kSimt});
    return c;
  };
  return t;
}

OpDef make_post_pre_fwd() {
  OpDef op = post_pre_base(
      "mhc.post_pre.fwd",
      "mHC post of layer l fused with pre of layer l + 1: x_next = h_post[k] f + sum_j h_res[j, k] x[j] written "
      "once and projected from registers (one read of the streams less than mhc.post.fwd then mhc.pre.fwd); "
      "then y, h_pre, h_post_next, r_next as mhc.pre.fwd's, and inv, h saved for the backward",
      false);
  op.info.inputs = post_inputs("");
  for (auto& t : pre_param_inputs()) op.info.inputs.push_back(t);
  op.info.outputs = {streams("x_next", "x", "the next layer's n streams (mhc.post.fwd's out)"),
                     per_token("y", "x", "layer l + 1's sublayer input sum_i h_pre[i] x_next[i]"),
                     f32("h_pre", {"...T", "n"}, false, "layer l + 1's sigma(h[0:n]) + eps_pre"),
                     f32("h_post_next", {"...T", "n"}, false, "layer l + 1's 2 sigma(h[n:2n])"),
                     f32("r_next", {"...T", "n", "n"}, false, "layer l + 1's Sinkhorn-Knopp R[j, k]"),
                     f32("inv", {"...T"}, false, "1/sqrt(mean(x_next^2) + eps_rms), saved for the backward"),
                     f32("h", {"...T", "M"}, false, "layer l + 1's pre-activation rows, saved for the backward")};
  op.check_call = [](const Call& call) { check_tokens(call.problem); };
  op.tuning = with_post_pre_algo_axis(op.tuning);
  op.info.tuning_axes = op.tuning.axes;
  op.kernels = [](const Problem& p, const Config& c) {
    if (c.get("algo") != kSimt) {
      return std::vector<jit::KernelSpec>{kernel_spec(
          p, "mhc/mhc_post_pre_mma.cuh", "kspec::mhc_post_pre_fwd_mma_kernel",
          {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")), std::to_string(p.dim("D")), t_max_arg(p),
           b(p.present("gamma")), std::to_string(c.get("tokens")), b(c.get("algo") == kMmaWarpHeads)})};
    }
    return std::vector<jit::KernelSpec>{kernel_spec(
        p, "mhc/mhc_post_pre.cuh", "kspec::mhc_post_pre_fwd_kernel",
        {dtype_cuda_type(p.dtype("x")), std::to_string(p.dim("n")), std::to_string(p.dim("D")), t_max_arg(p),
         b(p.present("gamma")), thr(c), std::to_string(c.get("tokens"))})};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& pr = call.problem;
    if (pr.dim("T") == 0) return;
    MhcPostPreParams a{};
    MhcPreParams& q = a.pre;
    q.x = a.x_next = call.out("x_next").data;
    q.phi = static_cast<const float*>(call.in("phi").data);
    q.alpha = static_cast<const float*>(call.in("alpha").data);
    q.bias = static_cast<const float*>(call.in("bias").data);
    q.gamma = static_cast<const float*>(call.in("gamma").data);
    q.y = call.out("y").data;
    q.h_pre = static_cast<float*>(call.out("h_pre").data);
    q.h_post = static_cast<float*>(call.out("h_post_next").data);
    q.r = static_cast<float*>(call.out("r_next").data);
    q.inv = static_cast<float*>(call.out("inv").data);
    q.h = static_cast<float*>(call.out("h").data);
    q.T = pr.dim("T");
    q.x_row = call.row_stride(call.out("x_next"));
    q.y_row = call.row_stride(call.out("y"));
    q.eps_rms = static_cast<float>(pr.param_float("eps_rms"));
    q.eps_pre = static_cast<float>(pr.param_float("eps_pre"));
    q.eps_sk = static_cast<float>(pr.param_float("eps_sk"));
    a.x = call.in("x").data;
    a.f = call.in("f").data;
    a.h_post = static_cast<const float*>(call.in("h_post").data);
    a.r = static_cast<const float*>(call.in("h_res").data);
    a.x_row = call.row_stride(call.in("x"));
    a.f_row = call.row_stride(call.in("f"));
    void* args[] = {&a};
    l.launch(0, {u32(ceil_div(q.T, c.get("tokens")))}, {u32(c.get("algo") != kSimt ? kMmaThreads : c.get("threads"))},
             0, args);
  };
  op.reference = post_pre_fwd_reference;
  op.prepare_inputs = post_pre_fwd_prepare;
  return op;
}

// Composed of the existing kernels: pre.bwd's three (dx_next added into the pre op's dx, which goes to a
// workspace) then post.bwd's on it. The forward is where the fusion pays; the backward reads the
// streams as the two unfused backward ops would.
OpDef make_post_pre_bwd() {
  OpDef op = post_pre_base("mhc.post_pre.bwd",
                           "gradients of mhc.post_pre.fwd: mhc.pre.bwd's kernels (dx_next added in), then "
                           "mhc.post.bwd's on that: dx, df, dh_post, dh_res, dphi, dalpha, dbias, dgamma",
                           true);
  op.f32_tolerance = 1e-4;  // pre.bwd's sums over tokens (its f32_tolerance)
  op.info.inputs = {
      tensor_def("dx_next", {"...T", "n", "D"}, {}, "dy", false, true, "", Layout::RowStrided,
                 "gradient of x_next from its other uses (absent: 0)"),
      per_token("dy", "", "gradient of y"),
      f32("dh_pre", {"...T", "n"}, true, "gradient of h_pre (absent: 0)"),
      f32("dh_post_next", {"...T", "n"}, true, "gradient of h_post_next (absent: 0)"),
      f32("dr_next", {"...T", "n", "n"}, true, "gradient of r_next (absent: 0)")};
  op.info.inputs[1].dtypes = kFloatTypes;
  op.info.inputs[1].dtype_of.clear();
  for (auto& t : post_inputs("dy")) op.info.inputs.push_back(t);
  op.info.inputs.push_back(streams("x_next", "dy", "the forward's x_next"));
  for (auto& t : pre_param_inputs()) op.info.inputs.push_back(t);
  op.info.inputs.push_back(f32("inv", {"...T"}, false, "saved by the forward"));
  op.info.inputs.push_back(f32("h", {"...T", "M"}, false, "saved by the forward"));
  op.info.outputs = {streams("dx", "dy", "gradient of x"),
                     per_token("df", "dy", "gradient of f"),
                     f32("dh_post", {"...T", "n"}, false, "gradient of h_post"),
                     f32("dh_res", {"...T", "n", "n"}, false, "gradient of h_res"),
                     f32("dphi", {"M", "nD"}, false, "gradient of phi"),
                     f32("dalpha", {"A"}, false, "gradient of alpha"),
                     f32("dbias", {"M"}, false, "gradient of bias"),
                     f32("dgamma", {"nD"}, false, "gradient of gamma", "gamma")};
  op.check_call = [](const Call& call) { check_tokens(call.problem); };
  op.kernels = [](const Problem& p, const Config& c) {
    auto k = pre_bwd_kernels(p, c, p.present("dx_next"));
    k.push_back(post_bwd_kernels(p, c).front());
    return k;
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) {
    const Problem& pr = call.problem;
    const int64_t T = pr.dim("T"), D = pr.dim("D"), nd = pr.dim("nD");
    MhcPreBwdParams a = pre_bwd_params(call, "x_next");
    a.dh_post = static_cast<const float*>(call.in("dh_post_next").data);
    a.dr = static_cast<const float*>(call.in("dr_next").data);
    a.dx_post = call.in("dx_next").data;
    a.dx_post_row = call.in("dx_next").defined() ? call.row_stride(call.in("dx_next")) : 0;
    a.dx_row = D;  // the whole gradient of x_next, contiguous, in the workspace's lead
    const size_t dxn_bytes = static_cast<size_t>(T * nd) * static_cast<size_t>(dtype_size(pr.dtype("x")));
    void* dxn = launch_pre_bwd(call, c, l, a, dxn_bytes);
    launch_post_bwd(call, c, l, 3, dxn, D);
  };
  op.reference = post_pre_bwd_reference;
  op.prepare_inputs = post_pre_bwd_prepare;
  return op;
}

// ---- sinkhorn ----

std::vector<Case> sinkhorn_cases() {
  const std::vector<std::tuple<const char*, int64_t, int64_t, int64_t, double>> specs = {
      {"base", 37, 4, 20, 1e-6}, {"n_1", 5, 1, 20, 1e-6}, {"n_3", 9, 3, 20, 1e-6}, {"n_8", 17, 8, 20, 1e-6},
      {"T_1", 1, 4, 20, 1e-6},   {"T_2", 2, 4, 20, 1e-6}, {"t_max_1", 13, 4, 1, 1e-6}, {"eps_0", 13, 4, 20, 0.0},
      {"large_16384", 16384, 4, 20, 1e-6},
  };
  std::vector<Case> cases;
  for (const auto& [name, T, n, t_max, eps] : specs) {
    Case c;
    c.name = name;
    c.dims = {{"T", T}, {"n", n}};
    c.params = {{"t_max", t_max}, {"eps_sk", eps}};
    c.large = T > 1000;
    c.representative = c.name == "base" || c.name == "n_8";
    cases.push_back(std::move(c));
  }
  return cases;
}

OpDef sinkhorn_base(const char* name, const char* doc) {
  OpDef op;
  op.info.name = name;
  op.info.family = "mhc";
  op.info.doc = doc;
  op.info.params = {eps_param("eps_sk", "added after the softmax and to every divisor"), t_max_param()};
  op.info.dims = {dim_T(), dim_n()};
  op.info.reference = "api/ops/mhc/reference.cpp (python/kspec/reference/mhc.py)";
  op.info.constants = {{"max_n", kMaxN}, {"max_t_max", kMaxTMax}};
  op.check = check_tokens;
  op.compile_dims = {{"T", 1}};
  TuningSpace t;
  t.axes = {{"threads", {32, 64}}};
  t.valid = [](const Problem& p, const Config& c, std::string* why) {
    if (c.get("threads") >= p.dim("n") * p.dim("n")) return true;
    if (why) *why = "fewer threads than the n*n elements";
    return false;
  };
  t.heuristic = [](const Problem& p) { return Config{{{"threads", p.dim("n") * p.dim("n") <= 32 ? 32 : 64}}}; };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  op.tuning = t;
  op.info.tuning_axes = op.tuning.axes;
  op.cases = sinkhorn_cases();
  op.dtypes = {DType::f32};
  return op;
}

jit::KernelSpec sinkhorn_spec(const Problem& p, const Config& c, const char* kernel) {
  return kernel_spec(p, "mhc/sinkhorn.cuh", kernel,
                     {std::to_string(p.dim("n")), std::to_string(p.param_int("t_max")), thr(c)});
}

void launch_sinkhorn(const Call& call, const Config& c, Launcher& l, bool bwd) {
  const Problem& pr = call.problem;
  if (pr.dim("T") == 0) return;
  MhcSinkhornParams a{};
  a.logits = static_cast<const float*>(call.in("logits").data);
  a.dr = bwd ? static_cast<const float*>(call.in("dr").data) : nullptr;
  a.out = static_cast<float*>(call.outputs[0].data);
  a.T = pr.dim("T");
  a.eps = static_cast<float>(pr.param_float("eps_sk"));
  void* args[] = {&a};
  l.launch(0, {u32(a.T)}, {u32(c.get("threads"))}, 0, args);
}

OpDef make_sinkhorn_fwd() {
  OpDef op = sinkhorn_base("mhc.sinkhorn.fwd",
                           "Sinkhorn-Knopp of n x n logits per token: A = softmax_k + eps, then column and row "
                           "normalizations (t_max rounds, ending on columns: each column sums to 1 at eps 0)");
  op.info.inputs = {f32("logits", {"...T", "n", "n"}, false, "Z[j, k]")};
  op.info.outputs = {f32("r", {"...T", "n", "n"}, false, "R[j, k]")};
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{sinkhorn_spec(p, c, "kspec::mhc_sinkhorn_fwd_kernel")};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) { launch_sinkhorn(call, c, l, false); };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    return std::vector<HostTensor>{
        {true, in[0].shape,
         ref::mhc_sinkhorn_fwd_ref(in[0].data, p.dim("T"), p.dim("n"), static_cast<int>(p.param_int("t_max")),
                                   p.param_float("eps_sk"))}};
  };
  return op;
}

OpDef make_sinkhorn_bwd() {
  OpDef op = sinkhorn_base("mhc.sinkhorn.bwd",
                           "gradient of mhc.sinkhorn.fwd: the iterates recomputed on chip, each step differentiated");
  op.info.inputs = {f32("logits", {"...T", "n", "n"}, false, "the forward's Z"),
                    f32("dr", {"...T", "n", "n"}, false, "gradient of r")};
  op.info.outputs = {f32("dlogits", {"...T", "n", "n"}, false, "gradient of logits")};
  op.kernels = [](const Problem& p, const Config& c) {
    return std::vector<jit::KernelSpec>{sinkhorn_spec(p, c, "kspec::mhc_sinkhorn_bwd_kernel")};
  };
  op.launch = [](const Call& call, const Config& c, Launcher& l) { launch_sinkhorn(call, c, l, true); };
  op.reference = [](const Problem& p, const std::vector<HostTensor>& in) {
    return std::vector<HostTensor>{
        {true, in[0].shape,
         ref::mhc_sinkhorn_bwd_ref(in[0].data, in[1].data, p.dim("T"), p.dim("n"),
                                   static_cast<int>(p.param_int("t_max")), p.param_float("eps_sk"))}};
  };
  return op;
}

}  // namespace

void register_mhc(Registry& r) {
  for (bool po : {false, true}) {
    r.add(make_pre_fwd(po));
    r.add(make_pre_bwd(po));
  }
  r.add(make_post_fwd());
  r.add(make_post_bwd());
  r.add(make_post_pre_fwd());
  r.add(make_post_pre_bwd());
  r.add(make_sinkhorn_fwd());
  r.add(make_sinkhorn_bwd());
}

}  // namespace kspec
