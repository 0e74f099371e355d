// difflogic.packed.net (api/ops/difflogic/packed_net.cpp). Without a GPU: the messages for bad input (a
// layer's logits or wires of the wrong shape, k not dividing the last width, the word count), the tuning
// space (algo=layers carries canonical chunk/inflight; the heuristics' measured picks), every specialization of
// the precompile plan compiling for sm_80 and sm_90 without spills, and the schedules' waits (every wait
// backwards, every reuse of the scratch ordered). On a GPU (skipped without one): every algorithm, every legal
// config, w = 32 and 64, B from 1 to several chunks (not a multiple of w), a wire out of range, equal to
// difflogic_packed_fwd_ref chained over the layers and then difflogic_packed_group_sum_ref, bit for bit, and a
// rerun equal to the first run.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "api/src/op.h"
#include "difflogic/packed_net_schedule.cuh"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::message_of;

namespace {

constexpr const char* kOp = "difflogic.packed.net";

void* fake(uintptr_t slot) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000) + (slot << 28)); }

void expect_in(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

// A network's views on fake pointers: x [n_in, words], logits[l] [widths[l], 16], a[l], b[l] [wires[l]].
struct FakeNet {
  std::vector<TensorView> logits, a, b;
  FakeNet(const std::vector<int64_t>& widths, const std::vector<int64_t>& wires, int64_t logit_cols = 16) {
    for (size_t l = 0; l < widths.size(); ++l) {
      logits.emplace_back(fake(10 + 3 * l), DType::f32, std::initializer_list<int64_t>{widths[l], logit_cols}, 0);
      a.emplace_back(fake(11 + 3 * l), DType::i32, std::initializer_list<int64_t>{wires[l]}, 0);
      b.emplace_back(fake(12 + 3 * l), DType::i32, std::initializer_list<int64_t>{wires[l]}, 0);
    }
  }
  std::vector<TensorView> inputs(DType words_dt, int64_t n_in, int64_t words) const {
    return {TensorView(fake(1), words_dt, {n_in, words}, 0), TensorView::list(logits.data(), int64_t(logits.size())),
            TensorView::list(a.data(), int64_t(a.size())), TensorView::list(b.data(), int64_t(b.size()))};
  }
};

std::string validate_net(const FakeNet& net, DType dt, int64_t n_in, int64_t words, int64_t B, int64_t k) {
  return message_of([&] {
    validate_call(Registry::global().get(kOp), net.inputs(dt, n_in, words), {TensorView(fake(2), DType::i32, {B, k}, 0)},
                  {}, nullptr);
  });
}

}  // namespace

TEST(DiffLogicPackedNet, ValidationNamesTheArgument) {
  EXPECT_EQ(validate_net(FakeNet({300, 40}, {300, 40}), DType::i32, 100, 4, 100, 10), "");
  EXPECT_EQ(validate_net(FakeNet({300, 40}, {300, 40}), DType::i64, 100, 2, 100, 10), "");
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}), DType::i64, 100, 4, 100, 10),
            {"batch = 100 samples (counts' rows) need 2 words of 64 bits per row, but input 'x' has 4"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}), DType::i32, 100, 4, 100, 3),
            {"k = 3 groups (counts' columns) must divide the last layer's 40 gates"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 41}), DType::i32, 100, 4, 100, 10),
            {"input 'a'[1] must be [40]", "logits[1] has 40 rows"});
  expect_in(validate_net(FakeNet({300, 40}, {300, 40}, 15), DType::i32, 100, 4, 100, 10),
            {"input 'logits'[0] must be [n_out, 16]"});
}

// algo=layers reads neither chunk nor inflight: only their canonical values are legal with it; the
// heuristic's config is legal.
TEST(DiffLogicPackedNet, TuningSpace) {
  const OpDef& op = Registry::global().get(kOp);
  CompileRequest req;
  req.op = kOp;
  req.arch = "sm_90";
  const Problem p = problem_from_request(op, req);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 0}, {"chunk", 128}, {"inflight", 2}}}, &why)) << why;
  EXPECT_FALSE(op.tuning.valid(p, Config{{{"algo", 0}, {"chunk", 64}, {"inflight", 2}}}, &why));
  EXPECT_NE(why.find("canonical values 128, 2"), std::string::npos) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 1}, {"chunk", 32}, {"inflight", 4}}}, &why)) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 2}, {"chunk", 64}, {"inflight", 8}}}, &why)) << why;
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 3}, {"chunk", 128}, {"inflight", 2}}}, &why)) << why;
  EXPECT_EQ(Config::parse("algo=early,chunk=64,inflight=2", op.info).get("algo"), 3);
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 4}, {"chunk", 64}, {"inflight", 4}}}, &why)) << why;
  EXPECT_EQ(Config::parse("algo=early_late,chunk=64,inflight=2", op.info).get("algo"), 4);
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 5}, {"chunk", 32}, {"inflight", 4}}}, &why)) << why;
  EXPECT_EQ(Config::parse("algo=fold,chunk=128,inflight=2", op.info).get("algo"), 5);
  EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 6}, {"chunk", 256}, {"inflight", 1}}}, &why)) << why;
  EXPECT_EQ(Config::parse("algo=fold2,chunk=128,inflight=2", op.info).get("algo"), 6);
  const Config h = op.tuning.heuristic(p);
  EXPECT_TRUE(op.tuning.valid(p, h, &why)) << why;
  // The measured defaults (H100, run 26): early at 128-byte rows, 2 chunks in flight; packed.fwd's rows kernel.
  EXPECT_EQ(h.get("algo"), 3);
  EXPECT_EQ(h.get("chunk"), 128);
  EXPECT_EQ(h.get("inflight"), 2);
  const OpDef& fwd = Registry::global().get("difflogic.packed.fwd");
  const Config f = fwd.tuning.heuristic(problem_from_request(fwd, [] {
    CompileRequest r;
    r.op = "difflogic.packed.fwd";
    r.arch = "sm_90";
    return r;
  }()));
  EXPECT_EQ(f.get("vec"), 1);
  EXPECT_EQ(f.get("threads"), 128);
}

// Every specialization `kspec precompile --all` builds for the op compiles for sm_80 and sm_90 without
// spills or a stack frame.
TEST(DiffLogicPackedNet, PrecompilePlanCompilesWithoutSpills) {
  std::map<std::string, int> kernels;
  for (const auto& r : precompile_plan({"sm_80", "sm_90"}, {kOp}))
    for (const auto& rep : kspec::testing::expect_compiles_without_spills(r)) ++kernels[rep.kernel];
  // algo=layers: the per-layer kernels at w = 32 and 64; chunked and chains: the ops kernel and a network kernel
  // per chunk (kChains false / true); early: the early kernel per chunk; fold and fold2: the fold kernel per chunk
  // (4 and 2 waves a last-layer item).
  for (const char* k : {"kspec::difflogic_packed_fwd_kernel<32, 256>", "kspec::difflogic_packed_fwd_kernel<64, 256>",
                        "kspec::difflogic_packed_ops_kernel<256>", "kspec::difflogic_packed_net_kernel<32, 256, false>",
                        "kspec::difflogic_packed_net_kernel<256, 256, false>",
                        "kspec::difflogic_packed_net_kernel<32, 256, true>",
                        "kspec::difflogic_packed_net_kernel<256, 256, true>",
                        "kspec::difflogic_packed_net_early_kernel<32, 256>",
                        "kspec::difflogic_packed_net_early_kernel<256, 256>",
                        "kspec::difflogic_packed_net_fold_kernel<32, 256, 4>",
                        "kspec::difflogic_packed_net_fold_kernel<256, 256, 4>",
                        "kspec::difflogic_packed_net_fold_kernel<32, 256, 2>",
                        "kspec::difflogic_packed_net_fold_kernel<256, 256, 2>"})
    EXPECT_GT(kernels[k], 0) << k;
}

namespace {

// A schedule as launch_chunked sets it: `layers` layers, `chunks` chunks, `inflight` slots, tiles[s] items of
// stage s a chunk (stage 0's 0 where algo=early's layer 1 reads x itself; with `fold` the GroupSum's 0).
DiffLogicNetParams schedule(int layers, long long chunks, long long inflight, std::vector<long long> tiles,
                            bool gs_late, bool fold = false) {
  DiffLogicNetParams p{};
  p.layers = layers;
  p.chunks = chunks;
  p.inflight = std::min(inflight, chunks);
  if (fold) tiles[layers + 1] = 0;
  for (int s = 0; s <= layers + 1; ++s) p.chunk_items += p.tiles[s] = tiles[s];
  p.round_items = p.inflight * p.chunk_items;
  p.gs_late = gs_late;
  p.fold = fold;
  return p;
}

// Whether the waits (dl_deps, followed transitively; a wait on a stage without items orders nothing: its counter
// starts met) order every use of the scratch as packed_net.cuh makes them: stage 0 writes the input rows, stage
// s >= 1 writes the buffer of its parity (with fold, not the last layer), stage s + 1 reads what stage s wrote.
// Each version's reader must come after its writer, and the next write of that buffer (the chunk's stage s + 2,
// else the slot's next chunk's) after the reader. Returns the first unordered pair, "" if none. `waits_of`: the
// params dl_deps is asked with (p's, unless a test swaps them).
std::string hazard_fault(const DiffLogicNetParams& p, const DiffLogicNetParams& waits_of) {
  const int stages = p.layers + 2, writers = p.fold ? p.layers - 1 : p.layers;
  auto has = [&](long long c, int s) { return c < p.chunks && s < stages && p.tiles[s] > 0; };
  std::map<std::pair<long long, int>, std::set<std::pair<long long, int>>> before;  // what an item waits for
  std::function<const std::set<std::pair<long long, int>>&(long long, int)> waits = [&](long long c, int s)
      -> const std::set<std::pair<long long, int>>& {
    const auto key = std::make_pair(c, s);
    if (auto f = before.find(key); f != before.end()) return f->second;
    std::set<std::pair<long long, int>> w;
    const DiffLogicNetDeps d = dl_deps(waits_of, DiffLogicNetItem{c, 0, s});
    std::vector<std::pair<long long, int>> direct;
    if (d.prev) direct.emplace_back(c, s - 1);
    if (d.slot) direct.emplace_back(d.slot_chunk, d.slot_stage);
    for (const auto& [dc, ds] : direct)
      if (has(dc, ds)) {
        w.insert({dc, ds});
        const auto& more = waits(dc, ds);
        w.insert(more.begin(), more.end());
      }
    return before[key] = w;
  };
  auto buffer = [](int s) { return s == 0 ? 0 : 1 + (s & 1); };
  auto name = [](long long c, int s) { return "chunk " + std::to_string(c) + " stage " + std::to_string(s); };
  for (long long c = 0; c < p.chunks; ++c)
    for (int s = 0; s <= writers; ++s) {
      if (!has(c, s) || !has(c, s + 1)) continue;  // no version, or none read
      if (!waits(c, s + 1).count({c, s})) return name(c, s + 1) + " may read before " + name(c, s) + " writes";
      // The next write of the buffer: this chunk's later stages, then the slot's next chunk's.
      for (long long nc = c, first = s + 1; nc < p.chunks; nc += p.inflight, first = 0) {
        int ns = first;
        while (ns <= writers && !(has(nc, ns) && buffer(ns) == buffer(s))) ++ns;
        if (ns > writers) continue;
        if (!waits(nc, ns).count({c, s + 1}))
          return name(nc, ns) + " may overwrite what " + name(c, s + 1) + " reads";
        break;
      }
    }
  return "";
}
std::string hazard_fault(const DiffLogicNetParams& p) { return hazard_fault(p, p); }

// Decodes every ticket (one order, or each chain's where `chains`) and returns the first fault: an item named
// twice or never, a ticket past the end naming an item, or an item waiting (dl_deps) for an item of a larger
// ticket or another chain, which could hang (a block holding a ticket waits only for smaller ones); "" if none.
std::string schedule_fault(const DiffLogicNetParams& p, bool chains) {
  std::map<std::tuple<long long, int, long long>, std::pair<long long, long long>> at;  // item -> (chain, ticket)
  const long long total = p.chunks * p.chunk_items, orders = chains ? p.inflight : 1;
  for (long long j = 0; j < orders; ++j)
    for (long long t = 0;; ++t) {
      const DiffLogicNetItem it =
          chains ? dl_decode_chain(p, j, t) : p.gs_late ? dl_decode_late(p, t) : dl_decode(p, t);
      if (it.stage < 0) {
        if (!chains && t < total)
          return "ticket " + std::to_string(t) + " < " + std::to_string(total) + " names nothing";
        break;
      }
      if (t > total) return "ticket " + std::to_string(t) + " past the end names an item";
      if (it.chunk < 0 || it.chunk >= p.chunks || it.tile < 0 || it.tile >= p.tiles[it.stage])
        return "ticket " + std::to_string(t) + " names an item out of range";
      if (!at.emplace(std::make_tuple(it.chunk, it.stage, it.tile), std::make_pair(j, t)).second)
        return "ticket " + std::to_string(t) + " names an item twice";
    }
  if (static_cast<long long>(at.size()) != total)
    return std::to_string(at.size()) + " items named of " + std::to_string(total);
  for (const auto& [item, where] : at) {
    const auto [chunk, stage, tile] = item;
    const DiffLogicNetDeps d = dl_deps(p, DiffLogicNetItem{chunk, tile, stage});
    std::vector<std::pair<long long, int>> waits;
    if (d.prev) waits.emplace_back(chunk, stage - 1);
    if (d.slot) waits.emplace_back(d.slot_chunk, d.slot_stage);
    for (const auto& [c, s] : waits)
      for (long long k = 0; k < p.tiles[s]; ++k) {
        const auto& w = at.at(std::make_tuple(c, s, k));
        if (w.first != where.first || w.second >= where.second)
          return "chunk " + std::to_string(chunk) + " stage " + std::to_string(stage) + " (ticket " +
                 std::to_string(where.second) + ") waits for chunk " + std::to_string(c) + " stage " +
                 std::to_string(s) + " (ticket " + std::to_string(w.second) + ")";
      }
  }
  return "";
}

}  // namespace

// The ticket orders on the CPU (packed_net_schedule.cuh, compiled here by the host compiler): dl_decode
// (chunked, early with odd layers), dl_decode_late (early with even layers: a round's layer 1 before the previous
// round's GroupSum) and dl_decode_chain (chains), over 1-6 layers, chunks not a multiple of inflight, stage 0 with
// and without items: each names every item once, and every wait is on a smaller ticket (of the same chain).
// dl_decode_late with odd layers would not be: layer 1 would wait for the previous round's GroupSum, a larger
// ticket (why the host sets gs_late for even layers only).
TEST(DiffLogicPackedNet, ScheduleNamesEveryItemOnceAndWaitsOnlyBackwards) {
  int checked = 0;
  for (int layers = 1; layers <= 6; ++layers)
    for (long long chunks : {1, 2, 3, 5, 8})
      for (long long inflight : {1, 2, 4})
        for (long long stage0 : {0, 2}) {
          std::vector<long long> tiles = {stage0};
          for (int l = 1; l <= layers; ++l) tiles.push_back(1 + (l % 3));
          tiles.push_back(2);  // GroupSum
          const std::string what = std::to_string(layers) + " layers, " + std::to_string(chunks) +
                                   " chunks, inflight " + std::to_string(inflight) + ", stage 0 tiles " +
                                   std::to_string(stage0);
          EXPECT_EQ(schedule_fault(schedule(layers, chunks, inflight, tiles, false), false), "") << what;
          EXPECT_EQ(schedule_fault(schedule(layers, chunks, inflight, tiles, false), true), "") << "chains, " << what;
          EXPECT_EQ(hazard_fault(schedule(layers, chunks, inflight, tiles, false)), "") << what;
          EXPECT_EQ(schedule_fault(schedule(layers, chunks, inflight, tiles, false, true), false), "") << "fold, " << what;
          EXPECT_EQ(hazard_fault(schedule(layers, chunks, inflight, tiles, false, true)), "") << "fold, " << what;
          // fold's waits are its own: the unfolded ones have layer 1 of the slot's next chunk wait for the GroupSum,
          // which has no items and orders nothing, where layer 2 still reads (odd layers; with even ones layer 1's
          // last reader is the last layer either way).
          const DiffLogicNetParams folded = schedule(layers, chunks, inflight, tiles, false, true);
          DiffLogicNetParams unfolded = folded;
          unfolded.fold = 0;
          if (chunks > std::min(inflight, chunks) && layers % 2 == 1 && layers >= 3) {
            EXPECT_NE(hazard_fault(folded, unfolded).find("may overwrite"), std::string::npos)
                << "fold with the unfolded waits, " << what;
          }
          const std::string late = schedule_fault(schedule(layers, chunks, inflight, tiles, true), false);
          if (layers % 2 == 0) {
            EXPECT_EQ(late, "") << "gs_late, " << what;
          } else if (chunks > std::min(inflight, chunks)) {  // a second round: its layer 1 waits for a GroupSum
            EXPECT_NE(late.find("waits for"), std::string::npos) << what;
          }
          ++checked;
        }
  EXPECT_EQ(checked, 6 * 5 * 3 * 2);
}

namespace {

using DevBuf = kspec::testing::DeviceBuffer<>;

template <typename T>
std::unique_ptr<DevBuf> device_copy(const std::vector<T>& v) {
  auto d = std::make_unique<DevBuf>(v.size() * sizeof(T));
  d->upload(v.data(), v.size() * sizeof(T));
  return d;
}

std::vector<unsigned char> word_bytes(const std::vector<uint64_t>& words, int w) {
  std::vector<unsigned char> bytes(words.size() * (w / 8));
  for (size_t j = 0; j < words.size(); ++j) std::memcpy(&bytes[j * (w / 8)], &words[j], w / 8);
  return bytes;
}

}  // namespace

// Widths 40 -> 300 -> 35 -> 50, 40 -> 300 -> 35 -> 64 -> 50 (k = 5; algo=early's two ticket orders) and 40 -> 300
// -> 4100 (groups of 820 gates, several algo=fold items each), one gate of the second layer with a wire out of
// range (zero bits:
// the reference runs it as op 0, FALSE, on wires 0, 0). B = 1, 33, 1000, 4224 and 5000 (20 chunks of 32 bytes:
// several rounds of every inflight, the last chunk partial; 1000 and 4224 with 16-byte rows, which
// algo=early's layer 1 reads straight from x, 4224's last chunk partial at every chunk size), x aligned and not.
TEST(DiffLogicPackedNetGpu, CountsEqualTheChainedReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const OpDef& op = Registry::global().get(kOp);
  // 3 layers (algo=early in dl_decode's order) and 4 (even: dl_decode_late's); 2 with 820-gate groups, which
  // algo=fold's last-layer items (256 to 2048 gates by chunk) split at every chunk but 32 and 64.
  for (const std::vector<int64_t>& widths :
       {std::vector<int64_t>{40, 300, 35, 50}, {40, 300, 35, 64, 50}, {40, 300, 4100}}) {
    const int64_t k = 5;
    std::mt19937_64 rng(30);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::vector<float>> logits;
    std::vector<std::vector<int32_t>> wa, wb;
    for (size_t l = 1; l < widths.size(); ++l) {
      std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(widths[l - 1] - 1));
      logits.emplace_back(widths[l] * 16);
      for (float& v : logits.back()) v = normal(rng);
      wa.emplace_back();
      wb.emplace_back();
      for (int64_t g = 0; g < widths[l]; ++g) {
        wa.back().push_back(wire(rng));
        wb.back().push_back(wire(rng));
      }
    }
    wb[1][7] = static_cast<int32_t>(widths[1]);  // out of range
    std::vector<std::unique_ptr<DevBuf>> dev;
    std::vector<TensorView> lv, av, bv;
    for (size_t l = 0; l < logits.size(); ++l) {
      dev.push_back(device_copy(logits[l]));
      lv.emplace_back(dev.back()->ptr(), DType::f32, std::initializer_list<int64_t>{widths[l + 1], 16}, 0);
      dev.push_back(device_copy(wa[l]));
      av.emplace_back(dev.back()->ptr(), DType::i32, std::initializer_list<int64_t>{widths[l + 1]}, 0);
      dev.push_back(device_copy(wb[l]));
      bv.emplace_back(dev.back()->ptr(), DType::i32, std::initializer_list<int64_t>{widths[l + 1]}, 0);
    }
    for (int w : {32, 64})
      for (int64_t B : {1, 33, 1000, 4224, 5000}) {
        const int64_t W = (B + w - 1) / w;
        std::bernoulli_distribution bit(0.5);
        std::vector<double> x(B * widths[0]);
        for (double& v : x) v = bit(rng);
        std::vector<uint64_t> words = ref::difflogic_pack_ref(B, widths[0], x, w);
        const std::vector<unsigned char> xbytes = word_bytes(words, w);
        auto xd = device_copy(xbytes);
        // The same words one word past a 16-byte boundary: algo=early's layer 1 then leaves x to stage 0's copy
        // (its direct 16-byte loads need x and its rows aligned; B 1000 and 4224 have 16-byte rows).
        DevBuf xoff(xbytes.size() + 16);
        CU_CHECK(cuMemcpyHtoD(xoff.p + w / 8, xbytes.data(), xbytes.size()));
        for (size_t l = 0; l < logits.size(); ++l) {
          std::vector<int> ops = ref::difflogic_hard_ops(std::vector<double>(logits[l].begin(), logits[l].end()),
                                                         widths[l + 1]);
          std::vector<int32_t> a = wa[l], b = wb[l];
          for (int64_t g = 0; g < widths[l + 1]; ++g)
            if (a[g] >= widths[l] || b[g] >= widths[l]) ops[g] = a[g] = b[g] = 0;
          words = ref::difflogic_packed_fwd_ref(B, widths[l], words, w, ops, a, b);
        }
        const std::vector<int64_t> want = ref::difflogic_packed_group_sum_ref(B, widths.back(), words, w, k);
        CompileRequest req;
        req.op = kOp;
        const Problem p = problem_from_request(op, req);
        DevBuf counts(B * k * 4);
        for (const Config& c : op.tuning.enumerate(p))
          for (void* xp : {xd->ptr(), reinterpret_cast<void*>(xoff.p + w / 8)}) {
            std::vector<int32_t> first;
            for (int run = 0; run < 2; ++run) {
              counts.poison();
              CallOptions o;
              o.config = &c;
              call(kOp,
                   {TensorView(xp, w == 32 ? DType::i32 : DType::i64, {widths[0], W}, 0),
                    TensorView::list(lv.data(), int64_t(lv.size())), TensorView::list(av.data(), int64_t(av.size())),
                    TensorView::list(bv.data(), int64_t(bv.size()))},
                   {TensorView(counts.ptr(), DType::i32, {B, k}, 0)}, {}, nullptr, o);
              CU_CHECK(cuCtxSynchronize());
              std::vector<int32_t> got(B * k);
              const auto bytes = counts.download(B * k * 4);
              std::memcpy(got.data(), bytes.data(), bytes.size());
              const std::string what = std::to_string(widths.size() - 1) + " layers, w " + std::to_string(w) +
                                       " B " + std::to_string(B) + " " + c.str(op.info) +
                                       (xp == xd->ptr() ? "" : " (x not 16-byte aligned)");
              EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), want) << what;
              if (run == 0) first = got;
              else EXPECT_EQ(got, first) << "rerun " << what;
            }
          }
      }
  }
}
