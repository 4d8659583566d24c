// Conversions between the project's types and the generated control-plane messages / grpc::Status.
// Both sides link this, so the mapping is written once.
#pragma once

#include <grpcpp/support/status.h>

#include "flexkv/geometry.h"
#include "flexkv/status.h"
#include "flexkv/v1/control.pb.h"

namespace flexkv {

grpc::Status ToGrpc(const Status& status);
Status FromGrpc(const grpc::Status& status);

Geometry FromProto(const v1::Geometry& g);
void ToProto(const Geometry& g, v1::Geometry* out);

}  // namespace flexkv
