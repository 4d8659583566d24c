// Test support: the wire protocol spoken by hand (gRPC Attach without libflexkv, the session-channel hello), for
// tests that must send what the client library never would. Uses Catch2 assertions: call on the test's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/session_channel.h"
#include "common/unique_fd.h"
#include "flexkv/geometry.h"
#include "flexkv/v1/control.grpc.pb.h"

namespace flexkv::testing {

// A stub for the daemon's Control service on `socket`.
std::unique_ptr<flexkv::v1::Control::Stub> ControlStub(const std::string& socket);

struct RawGrant {
  uint64_t session_id = 0;
  std::string token;  // kSessionTokenBytes bytes
};

// Attach over gRPC as this process, with any bytes in the names; returns the call's status (and the response
// when `response` is not null). No assertion: for tests of refusals.
grpc::Status TryRawAttach(flexkv::v1::Control::Stub& stub, const std::string& client_name,
                          const std::string& model_namespace, const Geometry& geometry,
                          flexkv::v1::AttachResponse* response = nullptr);
// Attach over gRPC as this process; REQUIREs success and a token of the right size.
RawGrant RawAttach(flexkv::v1::Control::Stub& stub, const std::string& client_name, const std::string& model_namespace,
                   const Geometry& geometry);

// Connects to `socket` as a session channel (5 s receive timeout) and sends the hello for (session_id, token);
// returns the reply (message NUL-terminated) and stores the channel and the fds that rode on the reply. When no
// reply arrived it is all zeros, so check its magic before its status_code.
SessionHelloReply RawHello(const std::string& socket, uint64_t session_id, const std::string& token, UniqueFd* channel,
                           std::vector<UniqueFd>* fds);

}  // namespace flexkv::testing
