/* libflexkv C ABI: connect, attach, status, close, for languages that cannot use the C++ API.
 * Every function returns a flexkv status code (0 = OK, otherwise the gRPC code number); the message of
 * the last failure on a client is flexkv_last_error(). A client is not thread-safe through this ABI. */
#ifndef FLEXKV_C_H_
#define FLEXKV_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct flexkv_client flexkv_client;

typedef struct flexkv_geometry {
  uint32_t tokens_per_block;
  uint32_t num_layers;
  uint32_t kv_planes;
  uint32_t kv_heads_per_rank;
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t tp_size;
} flexkv_geometry;

typedef struct flexkv_daemon_status {
  char state[16];        /* "serving" | "draining" | "drained" */
  char version[32];
  uint32_t pid;
  uint64_t uptime_s;
  uint64_t block_bytes;
  uint64_t capacity_blocks;
  uint64_t used_blocks;
  uint64_t pinned_blocks;
  uint64_t index_blocks;
  uint32_t sessions;
} flexkv_daemon_status;

/* socket_path may be NULL ($FLEXKV_SOCKET or the default). On success *out owns a client. On failure
 * *out is NULL and, when error_buf is non-NULL, the reason is copied there (NUL-terminated). */
int flexkv_connect(const char* socket_path, int timeout_ms, flexkv_client** out, char* error_buf, size_t error_len);
int flexkv_attach(flexkv_client* client, const char* client_name, const char* model_namespace, uint32_t dp_rank,
                  uint32_t tp_rank, const flexkv_geometry* geometry, uint64_t* session_id);
int flexkv_detach(flexkv_client* client);
int flexkv_get_status(flexkv_client* client, flexkv_daemon_status* out);
/* Valid until the next call on this client. Empty after a success. */
const char* flexkv_last_error(const flexkv_client* client);
/* Detaches and frees. NULL is ignored. */
void flexkv_close(flexkv_client* client);

#ifdef __cplusplus
}
#endif

#endif /* FLEXKV_C_H_ */
