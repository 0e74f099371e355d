// The error hierarchy's contract: a broken invariant of kspec's own is an InternalError (a kspec::Error,
// but never the caller's InvalidArgument), and it names what broke.
#include <gtest/gtest.h>

#include <string>
#include <type_traits>

#include "api/src/plan.h"
#include "kspec/error.h"

using namespace kspec;

namespace {

template <typename F>
std::string internal_error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    ADD_FAILURE() << "an InvalidArgument, expected an InternalError: " << e.what();
  } catch (const InternalError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an InternalError";
  return "";
}

}  // namespace

// An op asking its launcher for a kernel its plan does not hold is kspec's bug (it threw the bare Error).
// Checked before the driver is touched, so no GPU is needed.
TEST(Errors, LauncherKernelOutsideThePlanIsInternalError) {
  PlanEntry plan;
  DeviceLauncher launcher(plan, 0, nullptr);
  EXPECT_EQ(internal_error_of([&] { launcher.occupancy(1, 32, 0); }), "launcher: kernel 1 not in plan");
  EXPECT_EQ(internal_error_of([&] { launcher.launch(0, {1}, {32}, 0, nullptr); }), "launcher: kernel 0 not in plan");
}

TEST(Errors, InternalErrorIsAKspecError) {
  EXPECT_THROW(throw InternalError("x"), Error);
  static_assert(!std::is_base_of_v<InvalidArgument, InternalError>);
}
