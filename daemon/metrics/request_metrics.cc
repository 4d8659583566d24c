// Names of request kinds; see request_metrics.h.
#include "daemon/metrics/request_metrics.h"

#include "common/ring_layout.h"

namespace flexkv {

const char* OpKindName(OpKind op) {
  switch (op) {
    case OpKind::kMatch: return "match";
    case OpKind::kLoad: return "load";
    case OpKind::kStore: return "store";
    case OpKind::kRelease: return "release";
    case OpKind::kPrefetch: return "prefetch";
    case OpKind::kInvalid: return "invalid";
  }
  return "invalid";
}

OpKind OpKindOf(uint16_t ring_opcode) {
  switch (static_cast<RingOp>(ring_opcode)) {
    case RingOp::kMatch: return OpKind::kMatch;
    case RingOp::kLoad: return OpKind::kLoad;
    case RingOp::kStore: return OpKind::kStore;
    case RingOp::kRelease: return OpKind::kRelease;
    case RingOp::kPrefetch: return OpKind::kPrefetch;
  }
  return OpKind::kInvalid;
}

}  // namespace flexkv
