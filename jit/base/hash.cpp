// SHA-256 via OpenSSL EVP (libcrypto): no hand-written hashing in kspec.
#include "hash.h"

#include <openssl/evp.h>

#include <cstdint>

#include "kspec/error.h"

namespace kspec::jit {
namespace {
std::string to_hex(const unsigned char* d, unsigned n) {
  static const char* digits = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (unsigned i = 0; i < n; ++i) {
    s[2 * i] = digits[d[i] >> 4];
    s[2 * i + 1] = digits[d[i] & 15];
  }
  return s;
}
}  // namespace

std::string sha256_hex(std::string_view bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr) != 1)
    throw InternalError("EVP_Digest(sha256) failed");
  return to_hex(md, n);
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (!ctx_ || EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1)
    throw InternalError("EVP_DigestInit_ex(sha256) failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

Sha256& Sha256::part(std::string_view bytes) {
  auto* c = static_cast<EVP_MD_CTX*>(ctx_);
  uint64_t len = bytes.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(len >> (8 * i));
  EVP_DigestUpdate(c, prefix, 8);
  EVP_DigestUpdate(c, bytes.data(), bytes.size());
  return *this;
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &n);
  return to_hex(md, n);
}

}  // namespace kspec::jit
