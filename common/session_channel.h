// The session channel: a second connection on the control socket that ties a session to the client
// process (the kernel closes it when the process dies) and carries file descriptors (SCM_RIGHTS), which
// gRPC cannot. The daemon tells it from gRPC by its first four bytes ("FKVS" vs HTTP/2's "PRI ").
// Format written down in docs/protocol.md; every change bumps kProtocolVersion.
#pragma once

#include <cstdint>
#include <cstring>

namespace flexkv {

inline constexpr char kSessionChannelMagic[4] = {'F', 'K', 'V', 'S'};
inline constexpr size_t kSessionTokenBytes = 16;

// Client → daemon, first message on the channel. Little-endian, no padding.
struct SessionHello {
  char magic[4];              // "FKVS"
  uint32_t protocol_version;  // kProtocolVersion
  uint64_t session_id;        // from AttachResponse
  uint8_t token[kSessionTokenBytes];
};
static_assert(sizeof(SessionHello) == 32);

// Daemon → client, the answer to the hello. status_code is a StatusCode; message is NUL-terminated.
// On success two fds ride on it (SCM_RIGHTS): the sealed memfd of the session's rings and the doorbell
// eventfd the client writes when the daemon is parked.
struct SessionHelloReply {
  char magic[4];  // "FKVS"
  uint32_t status_code;
  char message[248];
};
static_assert(sizeof(SessionHelloReply) == 256);

// After the hello, either side may send 16-byte channel messages; fds ride on them with SCM_RIGHTS.
inline constexpr char kChannelMessageMagic[4] = {'F', 'K', 'V', 'M'};
enum class ChannelMessageType : uint32_t {
  kOfferFd = 1,     // client → daemon: one fd attached, to be named by `tag` in a later RegisterKv
  kOfferFdAck = 2,  // daemon → client: status_code for the offer of `tag`
};
struct ChannelMessage {
  char magic[4];  // "FKVM"
  uint32_t type;  // ChannelMessageType
  uint32_t tag;
  uint32_t status_code;
};
static_assert(sizeof(ChannelMessage) == 16);

}  // namespace flexkv
