// What the difflogic op definitions share (op.cpp: the layer ops; bits.cpp: GroupSum, pack, unpack and
// packed GroupSum; ca.cpp: the CA step): dtypes, grid sizes, the tuning space, and reading host tensors as wires or words.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "api/src/op.h"

namespace kspec::difflogic {

inline const std::vector<DType> kFloatTypes = {DType::f32, DType::f16, DType::bf16};
// One thread per output element up to this many blocks, then grid-stride loops.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

inline unsigned u32(int64_t v) { return static_cast<unsigned>(v); }

inline unsigned blocks_for(int64_t elements, int64_t threads) {
  return u32(std::max<int64_t>(1, std::min(kMaxBlocks, (elements + threads - 1) / threads)));
}

inline TuningSpace difflogic_tuning() {
  TuningSpace t;
  t.axes = {{"threads", {128, 256}}};
  t.valid = [](const Problem&, const Config&, std::string*) { return true; };
  t.heuristic = [](const Problem&) { return Config{{{"threads", 256}}}; };
  t.block_threads = [](const Problem&, const Config& c) { return c.get("threads"); };
  return t;
}

inline std::vector<int32_t> wires(const HostTensor& t) {
  std::vector<int32_t> w(t.data.size());
  for (size_t g = 0; g < w.size(); ++g) w[g] = static_cast<int32_t>(t.data[g]);
  return w;
}

// Host tensors are float64: an int32 word is exact there (as a signed value), a 64-bit word is not, so
// the ops' float64 references take w = 32 only (their tests call the reference on 64-bit words directly).
inline std::vector<uint64_t> words_of(const HostTensor& t) {
  std::vector<uint64_t> w(t.data.size());
  for (size_t j = 0; j < w.size(); ++j) w[j] = static_cast<uint32_t>(static_cast<int32_t>(t.data[j]));
  return w;
}

inline std::vector<double> doubles_of_words(const std::vector<uint64_t>& words) {
  std::vector<double> d(words.size());
  for (size_t j = 0; j < d.size(); ++j) d[j] = static_cast<int32_t>(static_cast<uint32_t>(words[j]));
  return d;
}

// difflogic.transpose's kernel (templates/difflogic/transpose.cuh): 64 x 64 elements a tile (16 loads in flight a
// thread at 256 threads), one block per tile up to kMaxBlocks. layer.fwd's save_xt runs it at 256 threads too.
constexpr int kTransposeTile = 64;
constexpr int64_t kTransposeThreads = 256;
inline unsigned transpose_blocks(int64_t rows, int64_t cols) {
  return blocks_for((rows + kTransposeTile - 1) / kTransposeTile * ((cols + kTransposeTile - 1) / kTransposeTile), 1);
}

// The word width of a packed tensor: its dtype, int32 or int64.
inline int word_bits(DType dt) { return dt == DType::i64 ? 64 : 32; }

// GroupSum, pack, unpack, packed GroupSum (bits.cpp); the CA step (ca.cpp); the packed network (packed_net.cpp);
// the activations' transpose (transpose.cpp).
void register_difflogic_bits(Registry& r);
void register_difflogic_ca(Registry& r);
void register_difflogic_packed_net(Registry& r);
void register_difflogic_transpose(Registry& r);

}  // namespace kspec::difflogic
