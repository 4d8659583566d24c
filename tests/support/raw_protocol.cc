// See raw_protocol.h.
#include "tests/support/raw_protocol.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>

#include "common/uds.h"
#include "common/version.h"

namespace flexkv::testing {

std::unique_ptr<flexkv::v1::Control::Stub> ControlStub(const std::string& socket) {
  return flexkv::v1::Control::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

grpc::Status TryRawAttach(flexkv::v1::Control::Stub& stub, const std::string& client_name,
                          const std::string& model_namespace, const Geometry& g, flexkv::v1::AttachResponse* response) {
  flexkv::v1::AttachRequest req;
  req.set_client_name(client_name);
  req.set_pid(static_cast<uint32_t>(getpid()));
  req.set_model_namespace(model_namespace);
  req.set_protocol_version(kProtocolVersion);
  flexkv::v1::Geometry* pg = req.mutable_geometry();
  pg->set_tokens_per_block(g.tokens_per_block);
  pg->set_num_layers(g.num_layers);
  pg->set_kv_planes(g.kv_planes);
  pg->set_kv_heads_per_rank(g.kv_heads_per_rank);
  pg->set_head_dim(g.head_dim);
  pg->set_dtype_bytes(g.dtype_bytes);
  pg->set_tp_size(g.tp_size);
  flexkv::v1::AttachResponse ignored;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub.Attach(&ctx, req, response != nullptr ? response : &ignored);
}

RawGrant RawAttach(flexkv::v1::Control::Stub& stub, const std::string& client_name, const std::string& model_namespace,
                   const Geometry& g) {
  flexkv::v1::AttachResponse resp;
  grpc::Status st = TryRawAttach(stub, client_name, model_namespace, g, &resp);
  INFO(st.error_message());
  REQUIRE(st.ok());
  REQUIRE(resp.session_token().size() == kSessionTokenBytes);
  return {resp.session_id(), resp.session_token()};
}

SessionHelloReply RawHello(const std::string& socket, uint64_t session_id, const std::string& token, UniqueFd* channel,
                           std::vector<UniqueFd>* fds) {
  auto fd = ConnectUnix(socket);
  REQUIRE(fd.ok());
  *channel = std::move(*fd);
  timeval tv{5, 0};
  REQUIRE(setsockopt(channel->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0);
  SessionHello hello{};
  std::memcpy(hello.magic, kSessionChannelMagic, 4);
  hello.protocol_version = kProtocolVersion;
  hello.session_id = session_id;
  std::memcpy(hello.token, token.data(), std::min(token.size(), sizeof(hello.token)));
  REQUIRE(SendWithFds(channel->get(), &hello, sizeof(hello)).ok());
  SessionHelloReply reply{};
  (void)RecvWithFds(channel->get(), &reply, sizeof(reply), fds);
  reply.message[sizeof(reply.message) - 1] = '\0';
  return reply;
}

}  // namespace flexkv::testing
