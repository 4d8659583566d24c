// ZmqKvEventPublisher: the KV event stream on a ZMQ PUB socket in vLLM's KV-event wire format (docs/kv_events.md,
// "ZMQ"), for the routers that already consume vLLM's events (llm-d, Dynamo). Off unless --kv-events-zmq is set.
// One thread reads the stream as a subscriber: it publishes AllBlocksCleared and a snapshot (as BlockStored) at
// start, whenever a ZMQ subscriber joins (an XPUB socket sees the subscription) and whenever it fell behind the
// stream's buffer, then every event, batched. Publishing never blocks: ZMQ's
// PUB socket drops messages for a subscriber past its high-water mark (the multipart's sequence number shows the gap).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "daemon/events/kv_event_stream.h"
#include "flexkv/status.h"

namespace flexkv {

class ZmqKvEventPublisher {
 public:
  // Binds `endpoint` (tcp://HOST:PORT, ipc://PATH). INVALID_ARGUMENT / UNAVAILABLE naming the endpoint and ZMQ's reason
  // when it cannot; FAILED_PRECONDITION when this build has no libzmq. Starts the thread.
  static Result<std::unique_ptr<ZmqKvEventPublisher>> Start(KvEventStream* stream, const std::string& endpoint,
                                                           const std::string& topic);
  ~ZmqKvEventPublisher();  // Stop()
  ZmqKvEventPublisher(const ZmqKvEventPublisher&) = delete;
  ZmqKvEventPublisher& operator=(const ZmqKvEventPublisher&) = delete;
  void Stop();

  const std::string& endpoint() const { return endpoint_; }
  uint64_t batches() const { return batches_.load(std::memory_order_relaxed); }
  uint64_t events() const { return events_.load(std::memory_order_relaxed); }
  uint64_t resyncs() const { return resyncs_.load(std::memory_order_relaxed); }


 private:
  ZmqKvEventPublisher(KvEventStream* stream, std::string endpoint, std::string topic);
  void Run();

  KvEventStream* const stream_;
  const std::string endpoint_;
  const std::string topic_;
  void* context_ = nullptr;
  void* socket_ = nullptr;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> batches_{0}, events_{0}, resyncs_{0};
  std::thread thread_;
  bool thread_started_ = false;  // bound and running (the destructor then removes an ipc:// socket file)
};

}  // namespace flexkv
