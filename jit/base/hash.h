// SHA-256 through OpenSSL's EVP interface: the content keys of kernels and the checksums of cache files.
// Part of the bottom layer (jit/base), used by jit and cache; the namespace stays jit::.
#pragma once

#include <string>
#include <string_view>

namespace kspec::jit {

// Lower-case hex SHA-256 of the bytes.
std::string sha256_hex(std::string_view bytes);

// Incremental hashing for keys built from many parts (each part is length-prefixed, so
// ("ab","c") and ("a","bc") hash differently).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  Sha256& part(std::string_view bytes);
  std::string hex();

 private:
  void* ctx_;
};

}  // namespace kspec::jit
