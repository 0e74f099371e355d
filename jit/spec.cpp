// Canonical text of a specialization and the architecture rules for NVRTC targets.
#include "spec.h"

#include "nvrtc.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "kspec/error.h"

namespace kspec::jit {

std::string KernelSpec::name_expression() const {
  std::string s = kernel;
  if (!targs.empty()) {
    s += '<';
    for (size_t i = 0; i < targs.size(); ++i) {
      if (i) s += ", ";
      s += targs[i];
    }
    s += '>';
  }
  return s;
}

std::string KernelSpec::canonical() const {
  std::ostringstream os;
  os << header << '|' << name_expression() << '|';
  for (size_t i = 0; i < defines.size(); ++i) os << (i ? "," : "") << defines[i].first << '=' << defines[i].second;
  os << '|';
  for (size_t i = 0; i < options.size(); ++i) os << (i ? " " : "") << options[i];
  os << '|' << arch;
  return os.str();
}

std::string KernelSpec::source() const {
  std::ostringstream os;
  os << "// kspec specialization: " << canonical() << "\n";
  for (const auto& [name, value] : defines) os << "#define " << name << ' ' << value << "\n";
  os << "#include \"" << header << "\"\n";
  return os.str();
}

namespace {
std::vector<int> supported_sass_archs() {
  int n = 0;
  std::vector<int> archs;
  const Nvrtc& api = nvrtc();
  if (api.nvrtcGetNumSupportedArchs(&n) == NVRTC_SUCCESS && n > 0) {
    archs.resize(n);
    api.nvrtcGetSupportedArchs(archs.data());
  }
  std::sort(archs.begin(), archs.end());
  return archs;
}
}  // namespace

std::string arch_for_compute_capability(int major, int minor) {
  return resolve_arch("sm_" + std::to_string(major * 10 + minor));
}

int compute_capability(const std::string& arch) {
  std::string s = arch;
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.rfind("sm_", 0) == 0) s = s.substr(3);
  else if (s.rfind("compute_", 0) == 0) s = s.substr(8);
  if (!s.empty() && (s.back() == 'a' || s.back() == 'f')) s.pop_back();
  if (s.empty() || s.size() > 4 || !std::all_of(s.begin(), s.end(), ::isdigit)) return 0;
  return std::stoi(s);
}

std::string resolve_arch(const std::string& requested) {
  std::string s = requested;
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  bool want_ptx = false;
  if (s.rfind("sm_", 0) == 0) {
    s = s.substr(3);
  } else if (s.rfind("compute_", 0) == 0) {
    s = s.substr(8);
    want_ptx = true;
  }
  bool arch_specific = !s.empty() && (s.back() == 'a' || s.back() == 'f');
  std::string digits = arch_specific ? s.substr(0, s.size() - 1) : s;
  KSPEC_CHECK(!digits.empty() && std::all_of(digits.begin(), digits.end(), ::isdigit),
              "arch: expected sm_NN, sm_NNa, compute_NN or NN (e.g. sm_90), got '", requested, "'");
  // Five digits or more cannot be in range (and may not fit an int): no stoi on them.
  KSPEC_CHECK(digits.size() <= 4, "arch: compute capability ", digits, " from '", requested, "' is out of range (50..199)");
  int cc = std::stoi(digits);
  KSPEC_CHECK(cc >= 50 && cc < 200, "arch: compute capability ", cc, " from '", requested,
              "' is out of range (50..199)");
  std::vector<int> archs = supported_sass_archs();
  bool known = std::find(archs.begin(), archs.end(), cc) != archs.end();
  if (want_ptx) return "compute_" + digits;
  if (!known) {
    // NVRTC cannot emit SASS for this one: PTX of the newest architecture below it, JIT-ed by the driver.
    int best = 0;
    for (int a : archs)
      if (a <= cc) best = a;
    KSPEC_CHECK_AS(best > 0, Unsupported, "arch: NVRTC supports no architecture at or below sm_", cc);
    return "compute_" + std::to_string(best);
  }
  // Hopper's wgmma/setmaxnreg need the arch-specific target; sm_90a runs on exactly sm_90 devices.
  if (cc == 90 || arch_specific) return "sm_" + digits + (arch_specific ? std::string(1, s.back()) : "a");
  return "sm_" + digits;
}

}  // namespace kspec::jit
