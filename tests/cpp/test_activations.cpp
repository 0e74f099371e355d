// The one activation vocabulary (api/ops/common/activations.h): an alias names the same problem as its
// canonical choice in every op with an `act` (same signature, the canonical name stored), and a name an
// op does not take is refused with the choices and the aliases that apply.
#include <string>

#include "api/src/op.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

Problem problem(const char* op, const std::string& act) {
  CompileRequest req;
  req.op = op;
  req.dtype = DType::bf16;
  req.params = {{"act", act}};
  if (std::string(op).rfind("norm_act", 0) == 0) req.params.set("hidden", int64_t(256));  // a compile-time dim
  return problem_from_request(Registry::global().get(op), req);
}

}  // namespace

TEST(Activations, AliasesNameTheCanonicalProblem) {
  for (const char* op : {"gemm", "gemm.bwd", "norm_act.fwd", "norm_act.bwd"}) {
    Problem none = problem(op, "none"), identity = problem(op, "identity");
    EXPECT_EQ(identity.param_str("act"), "none") << op;
    EXPECT_EQ(identity.signature(), none.signature()) << op;
    Problem gelu = problem(op, "gelu"), tanh = problem(op, "gelu_tanh");
    EXPECT_EQ(gelu.param_str("act"), "gelu_tanh") << op;
    EXPECT_EQ(gelu.signature(), tanh.signature()) << op;
  }
}

TEST(Activations, UnknownNamesListChoicesAndAliases) {
  try {
    problem("norm_act.fwd", "relu");
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    for (const char* f : {"parameter 'act'", "none, silu, gelu_tanh, gelu_erf", "identity (= none)",
                          "gelu (= gelu_tanh)", "got 'relu'"})
      EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
  EXPECT_THROW(problem("gemm", "gelu_erf"), InvalidArgument);
}
