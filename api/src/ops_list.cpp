// The one list of op families: adding a family adds one line here.
#include "api/src/op.h"

namespace kspec {

void register_norm_act(Registry& r);
void register_selective_scan(Registry& r);
void register_gemm(Registry& r);
void register_adamw(Registry& r);
void register_e79(Registry& r);
void register_mlstm(Registry& r);
void register_difflogic(Registry& r);
void register_mhc(Registry& r);

void register_all_ops(Registry& r) {
  register_norm_act(r);
  register_selective_scan(r);
  register_gemm(r);
  register_adamw(r);
  register_e79(r);
  register_mlstm(r);
  register_difflogic(r);
  register_mhc(r);
}

}  // namespace kspec
