// See grpc_convert.h.
#include "common/grpc_convert.h"

namespace flexkv {

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  return Status(static_cast<StatusCode>(status.error_code()), status.error_message());
}

Geometry FromProto(const v1::Geometry& g) {
  Geometry out;
  out.tokens_per_block = g.tokens_per_block();
  out.num_layers = g.num_layers();
  out.kv_planes = g.kv_planes();
  out.kv_heads_per_rank = g.kv_heads_per_rank();
  out.head_dim = g.head_dim();
  out.dtype_bytes = g.dtype_bytes();
  out.tp_size = g.tp_size();
  return out;
}

void ToProto(const Geometry& g, v1::Geometry* out) {
  out->set_tokens_per_block(g.tokens_per_block);
  out->set_num_layers(g.num_layers);
  out->set_kv_planes(g.kv_planes);
  out->set_kv_heads_per_rank(g.kv_heads_per_rank);
  out->set_head_dim(g.head_dim);
  out->set_dtype_bytes(g.dtype_bytes);
  out->set_tp_size(g.tp_size);
}

}  // namespace flexkv
