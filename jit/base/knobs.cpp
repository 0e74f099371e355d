// The knobs' parsers, their environment-dependent defaults and the table: the only getenv() in kspec.
#include "kspec/knobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "kspec/error.h"

namespace kspec::knobs {
namespace {

std::string lower_trimmed(const std::string& v) {
  size_t b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t");
  std::string s = b == std::string::npos ? std::string() : v.substr(b, e - b + 1);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

template <const auto& K>
KnobInfo info() {
  return {K.name, K.parse.type, K.fallback.text, K.doc, [] { K.value_set(); }};
}

}  // namespace

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

void bad_value(const char* name, const std::string& expected, const std::string& got) {
  throw InvalidArgument(std::string(name) + ": expected " + expected + ", got '" + got + "'");
}

std::string bool_spellings() { return "on/off, 1/0, true/false, yes/no (any case)"; }

std::optional<bool> read_bool(const std::string& text) {
  std::string s = lower_trimmed(text);
  if (s == "on" || s == "1" || s == "true" || s == "yes") return true;
  if (s == "off" || s == "0" || s == "false" || s == "no") return false;
  return std::nullopt;
}

std::optional<int64_t> read_int(const std::string& text, int64_t lo, int64_t hi, bool also_bool) {
  if (also_bool)
    if (auto b = read_bool(text)) return *b ? 1 : 0;
  std::string s = lower_trimmed(text);
  try {
    size_t pos = 0;
    long long x = std::stoll(s, &pos);
    if (pos == s.size() && x >= lo && x <= hi) return x;
  } catch (const std::exception&) {  // not a number, or out of range: the caller reports it
  }
  return std::nullopt;
}

std::string int_expected(int64_t lo, int64_t hi, bool also_bool) {
  return "an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
         (also_bool ? " or " + bool_spellings() : std::string());
}

std::optional<double> read_positive(const std::string& text) {
  std::string s = lower_trimmed(text);
  try {
    size_t pos = 0;
    double x = std::stod(s, &pos);
    if (pos == s.size() && std::isfinite(x) && x > 0) return x;
  } catch (const std::exception&) {  // the caller reports it
  }
  return std::nullopt;
}

std::optional<Switch> read_switch(const std::string& text) {
  if (lower_trimmed(text) == "auto") return Switch::Auto;
  if (auto b = read_bool(text)) return *b ? Switch::On : Switch::Off;
  return std::nullopt;
}

std::string default_cache_dir() {
  if (auto v = env("XDG_CACHE_HOME")) return *v + "/kspec";
  if (auto v = env("HOME")) return *v + "/.cache/kspec";
  return (std::filesystem::temp_directory_path() / "kspec-cache").string();
}

std::string temp_dir() { return std::filesystem::temp_directory_path().string(); }

int64_t hardware_threads() {
  return std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, kMaxCompileThreads);
}

const std::vector<KnobInfo>& all() {
  static const std::vector<KnobInfo> table = {
      info<cache_dir>(),       info<cache_enabled>(), info<cache_max_bytes>(), info<template_dir>(),
      info<cuda_include>(),    info<verbose>(),       info<debug_dir>(),       info<compile_threads>(),
      info<tuning_db>(),       info<tune>(),          info<tune_budget>(),
      info<nvrtc>(),           info<libcuda>(),       info<libcublaslt>(),     info<torch_ext>()};
  return table;
}

void validate() {
  for (const auto& k : all()) k.check();
}

}  // namespace kspec::knobs
