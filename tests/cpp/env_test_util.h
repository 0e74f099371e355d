// An environment variable set (or unset) for one scope, for the tests of KSPEC_* knobs and of finding the toolkit.
#pragma once

#include <stdlib.h>

#include <optional>
#include <string>

namespace kspec::testing {

// Sets name to value (unsets it with nullopt) until the end of the scope, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    if (value) ::setenv(name, value->c_str(), 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace kspec::testing
