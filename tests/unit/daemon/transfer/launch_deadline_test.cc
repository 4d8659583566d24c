// LaunchDeadline (daemon/transfer/launch_deadline.h): a copy starts only up to the deadline; a refusal says whether
// another copy of the load started before it.
#include <catch2/catch.hpp>

#include "common/clock.h"
#include "daemon/transfer/launch_deadline.h"

using flexkv::LaunchDeadline;
using flexkv::StatusCode;

TEST_CASE("launch deadline: copies launch before it, none after, and the refusal says nothing was copied",
          "[unit]") {
  LaunchDeadline far(flexkv::NowNs() + 3'600'000'000'000);  // an hour ahead
  CHECK(far.Launch().ok());
  CHECK(far.Launch().ok());
  CHECK(far.launched() == 2);

  LaunchDeadline passed(flexkv::NowNs() - 1);
  const flexkv::Status refused = passed.Launch();
  CHECK(refused.code() == StatusCode::kDeadlineExceeded);
  CHECK(refused.message() == "not launched by its launch deadline; nothing was copied");
  CHECK(passed.launched() == 0);
  CHECK(passed.Launch().code() == StatusCode::kDeadlineExceeded);  // never launches later
  CHECK(passed.launched() == 0);
}

TEST_CASE("launch deadline: a copy refused after another of the load started says the blocks are partly written",
          "[unit]") {
  // The deadline is a moment away: the first copy starts before it, the second (after the wait) is refused.
  const int64_t deadline = flexkv::NowNs() + 20'000'000;
  LaunchDeadline d(deadline);
  REQUIRE(d.Launch().ok());
  while (flexkv::NowNs() <= deadline) {
  }
  const flexkv::Status refused = d.Launch();
  CHECK(refused.code() == StatusCode::kDeadlineExceeded);
  CHECK(refused.message() == "launch deadline passed with part of the copies started: blocks partly written");
  CHECK(d.launched() == 1);
}
