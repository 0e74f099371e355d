// Gumbel noise for the straight-through estimator of the difflogic layer (issue 30; api/ops/difflogic/
// reference.h: difflogic_gumbel_noise is the spec). Counter-based, so the noise of (gate g, op i) is a
// function of (seed, g, i) alone: the same whatever the launch configuration, in the forward and in the
// backward. Philox4x32-10 (Salmon et al., SC 2011) with key (seed low, seed high) and counter
// (g low, g high, i / 4, 0) gives 4 words, word i mod 4 is op i's; U = ((word >> 8) + 0.5) 2^-24 lies in
// (0, 1) and is exact in fp32; G = -log(-log U).
#pragma once

namespace kspec {

__device__ __forceinline__ uint4 difflogic_philox(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Adds gate g's Gumbel noise to its 16 logits l (in place).
__device__ __forceinline__ void difflogic_add_gumbel(float* l, unsigned long long seed, long long g) {
  const unsigned k0 = static_cast<unsigned>(seed), k1 = static_cast<unsigned>(seed >> 32);
  const unsigned g0 = static_cast<unsigned>(static_cast<unsigned long long>(g)),
                 g1 = static_cast<unsigned>(static_cast<unsigned long long>(g) >> 32);
#pragma unroll
  for (int block = 0; block < 4; ++block) {
    const uint4 r = difflogic_philox(make_uint4(g0, g1, static_cast<unsigned>(block), 0u), k0, k1);
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float u = (static_cast<float>(words[j] >> 8) + 0.5f) * 5.9604644775390625e-8f;  // 2^-24
      l[4 * block + j] += -logf(-logf(u));
    }
  }
}

}  // namespace kspec
