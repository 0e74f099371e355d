// SHA-256 (FIPS 180-4): the content keys of kernels and the checksums of cache files. Self-contained, so
// that the Python wheel links no libcrypto (a shared one ties it to the build machine's OpenSSL; a static
// one brings megabytes and OpenSSL's config lookups into every process). Part of the bottom layer
// (jit/base), used by jit and cache; the namespace stays jit::.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace kspec::jit {

// Lower-case hex SHA-256 of the bytes.
std::string sha256_hex(std::string_view bytes);

// Incremental hashing for keys built from many parts (each part is length-prefixed, so
// ("ab","c") and ("a","bc") hash differently). raw() feeds bytes without the prefix.
class Sha256 {
 public:
  Sha256& part(std::string_view bytes);
  Sha256& raw(std::string_view bytes);
  std::string hex();  // finishes the hash; the object is spent afterwards

 private:
  void compress(const unsigned char* block);
  std::array<uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char block_[64] = {};
  size_t used_ = 0;      // bytes waiting in block_
  uint64_t length_ = 0;  // bytes hashed in all
};

}  // namespace kspec::jit
