// Fuzz target: the control plane's request validation. Any AttachRequest bytes either parse and are
// validated (geometry, namespace, cache domain) into OK or an error naming a field, or fail to parse.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/grpc_convert.h"
#include "daemon/cache/cache_domain.h"
#include "flexkv/v1/control.pb.h"
#include "google/protobuf/stubs/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is expected input, not news
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  flexkv::v1::AttachRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const flexkv::Geometry g = flexkv::FromProto(req.geometry());
  const flexkv::Status valid = g.Validate();
  if (!valid.ok() && (valid.code() != flexkv::StatusCode::kInvalidArgument || valid.message().empty())) std::abort();
  flexkv::CacheDomain domain(64ULL << 20);
  const flexkv::Status first = domain.Admit(req.model_namespace(), g);
  if (first.ok()) {
    // A valid first geometry fixes the domain; the same one is admitted again, another is refused by name.
    if (!domain.Admit(req.model_namespace(), g).ok()) std::abort();
    flexkv::Geometry other = g;
    other.num_layers = g.num_layers == 1 ? 2 : 1;
    const flexkv::Status second = domain.Admit(req.model_namespace(), other);
    if (second.ok() && other.host_block_bytes() != g.host_block_bytes()) std::abort();
    if (domain.Snapshot().capacity_blocks == 0) std::abort();
  } else if (first.message().empty()) {
    std::abort();
  }
  flexkv::v1::RegisterKvRequest reg;
  (void)reg.ParseFromArray(data, static_cast<int>(size));
  return 0;
}
