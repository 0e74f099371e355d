// kspec's error hierarchy: every failure surfaces as one of these, never as exit() or a crash.
// Each class maps to one Python exception (see python/src/bindings.cpp). This header is a leaf:
// every layer (jit, cache, api) may include it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kspec {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A caller passed something the op's schema does not accept (dtype, shape, stride, pointer, name...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The request is well-formed but this build, device or op cannot serve it.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// NVRTC rejected a specialization. Carries the log, the options and the specialization's text.
class CompileError : public Error {
 public:
  CompileError(const std::string& msg, std::string log, std::string options, std::string spec,
               std::string source_path)
      : Error(msg),
        log_(std::move(log)),
        options_(std::move(options)),
        spec_(std::move(spec)),
        source_path_(std::move(source_path)) {}
  const std::string& log() const { return log_; }
  const std::string& options() const { return options_; }
  const std::string& spec() const { return spec_; }
  const std::string& source_path() const { return source_path_; }

 private:
  std::string log_, options_, spec_, source_path_;
};

// A CUDA driver, runtime or library call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};

// kspec broke one of its own invariants (a plan's kernel index out of range, a config launched for a
// problem it was not chosen for) or a library it relies on failed where it cannot (OpenSSL's SHA-256):
// a bug to report, never a consequence of the caller's input.
class InternalError : public Error {
 public:
  using Error::Error;
};

// The disk cache could not be used as asked (only raised by explicit cache commands; lookups degrade).
class CacheError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
}  // namespace detail

}  // namespace kspec

// Validation: KSPEC_CHECK(cond, "input 'x': expected ", a, " got ", b) throws InvalidArgument.
#define KSPEC_CHECK(cond, ...)                                                  \
  do {                                                                          \
    if (!(cond)) throw ::kspec::InvalidArgument(::kspec::detail::concat(__VA_ARGS__)); \
  } while (0)

#define KSPEC_CHECK_AS(cond, ErrorType, ...)                                    \
  do {                                                                          \
    if (!(cond)) throw ErrorType(::kspec::detail::concat(__VA_ARGS__));         \
  } while (0)
