// Regression test for issue 13 item 4, "Attach flood": raw Attach calls that never open their session channel are
// bounded per uid (RESOURCE_EXHAUSTED past the bound), GetStatus and flexkvctl status keep answering during the
// flood, and the daemon's log grows by a bounded number of lines rather than one or two per call.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <string>

#include "common/version.h"
#include "flexkv/geometry.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/process.h"
#include "tests/support/raw_protocol.h"

using namespace std::chrono_literals;
using flexkv::testing::DaemonUnderTest;

namespace {

// An Attach as a client that never opens its channel would send it; returns the call's status.
grpc::Status FloodAttach(flexkv::v1::Control::Stub& stub, int i) {
  return flexkv::testing::TryRawAttach(stub, "flood-" + std::to_string(i), "flood", flexkv::Llama3_8B());
}

grpc::Status GetStatus(flexkv::v1::Control::Stub& stub, flexkv::v1::GetStatusResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  return stub.GetStatus(&ctx, flexkv::v1::GetStatusRequest{}, resp);
}

size_t LineCount(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')); }

}  // namespace

TEST_CASE("Attach flood: pending sessions are bounded per uid, GetStatus answers, the log stays short",
          "[integration][attach_flood]") {
  // The attach timeout outlasts the test, so every granted session stays pending throughout the flood.
  DaemonUnderTest daemon({"--attach-timeout", "300"});
  REQUIRE(daemon.WaitReady());
  auto stub = flexkv::testing::ControlStub(daemon.socket());
  flexkv::v1::GetStatusResponse status;
  REQUIRE(GetStatus(*stub, &status).ok());
  const size_t lines_before = LineCount(daemon.process().Stderr());

  constexpr int kPerUid = 64;  // the default --max-pending-sessions-per-uid
  constexpr int kAttaches = 1000;
  int granted = 0;
  int exhausted = 0;
  std::string refusal;
  for (int i = 0; i < kAttaches; ++i) {
    const grpc::Status s = FloodAttach(*stub, i);
    if (s.ok()) {
      ++granted;
    } else {
      INFO("Attach " << i << ": code " << s.error_code() << ": " << s.error_message());
      REQUIRE(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
      ++exhausted;
      refusal = s.error_message();
    }
    if (i % 100 == 99) {
      INFO("GetStatus during the flood, after " << i + 1 << " Attach calls");
      REQUIRE(GetStatus(*stub, &status).ok());
    }
  }
  CHECK(granted == kPerUid);
  CHECK(exhausted == kAttaches - kPerUid);
  INFO("refusal: " << refusal);
  CHECK(refusal.find("limit 64 per uid") != std::string::npos);
  CHECK(refusal.find("already has 64 sessions") != std::string::npos);
  CHECK(refusal.find("--max-pending-sessions-per-uid") != std::string::npos);

  REQUIRE(GetStatus(*stub, &status).ok());
  CHECK(status.sessions() == static_cast<uint64_t>(kPerUid));
  const auto ctl = flexkv::testing::RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", daemon.socket(), "status"});
  INFO("flexkvctl status: " << ctl.output);
  CHECK(ctl.exit_code == 0);

  // One "opened" line per granted session, and the refusals at most one line a second: far fewer lines than
  // calls. The bound leaves room for a flood that takes up to a minute on a loaded machine.
  const std::string log = daemon.process().Stderr();
  const size_t flood_lines = LineCount(log) - lines_before;
  INFO("daemon log lines during the flood: " << flood_lines);
  CHECK(flood_lines <= static_cast<size_t>(kPerUid) + 60);
}
