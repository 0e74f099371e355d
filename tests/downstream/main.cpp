// Downstream use of an installed kspec: list the registry and compile one op without a GPU.
#include <kspec/error.h>
#include <kspec/knobs.h>
#include <kspec/kspec.h>

#include <cstdio>

int main() {
  std::printf("kspec %s: %zu ops, %zu knobs (%s=%s)\n", kspec::version(), kspec::list_ops().size(),
              kspec::knobs::all().size(), kspec::knobs::cache_enabled.name,
              kspec::knobs::cache_enabled() ? "on" : "off");
  kspec::CompileRequest req;
  req.op = "norm_act.fwd";
  req.dtype = kspec::DType::f16;
  req.arch = "sm_80";
  req.params = {{"hidden", int64_t(768)}};
  for (const auto& r : kspec::compile(req))
    std::printf("%s: %s, %d registers, %d bytes spilled\n", r.kernel.c_str(), r.source.c_str(), r.registers,
                r.spill_bytes);
  try {
    kspec::call("no.such_op", {}, {});
    return 1;
  } catch (const kspec::InvalidArgument& e) {
    std::printf("unknown op rejected: %s\n", e.what());
  }
  return 0;
}
