// Compiles one norm_act specialization through the public API and prints where its binary came from
// ("compiled", "disk" or "memory") and its key: the cache tests start several of these at once.
#include <cstdio>

#include "kspec/kspec.h"

int main(int argc, char** argv) {
  kspec::CompileRequest req;
  req.op = "norm_act.fwd";
  req.dtype = kspec::DType::bf16;
  req.arch = "sm_90";
  req.params = {{"hidden", static_cast<int64_t>(argc > 1 ? std::atoi(argv[1]) : 4096)}, {"act", std::string("silu")}};
  try {
    for (const auto& r : kspec::compile(req)) std::printf("%s %s\n", r.source.c_str(), r.key.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
