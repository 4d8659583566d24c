// A gRPC server interceptor that gives requests whose bytes are not a valid protobuf message a precise error:
// gRPC's own answer is INTERNAL with an empty message.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>

namespace flexkv {

// Rewrites the status of a call that gRPC answered INTERNAL with an empty message (what the generated code sends
// when a request fails to parse; flexkvd's handlers always give a message) into INVALID_ARGUMENT "request could
// not be parsed as <message type>; expected ...". Thread-safe: one interceptor per call, no shared state.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseErrorInterceptorFactory();

// The message of that INVALID_ARGUMENT for a call of `method` ("/flexkv.v1.Control/Attach"): names the request
// type from the generated descriptors, or the method when it is not one of them.
std::string ParseErrorMessage(const std::string& method);

}  // namespace flexkv
