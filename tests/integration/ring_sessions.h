// Shared by the ring validation tests (ring_validation_test.cc: malformed descriptors; ring_abuse_test.cc: garbage,
// wrapped rings, requests before RegisterKv): a raw-protocol session that writes descriptors straight into its
// rings, and a well-behaved session on libflexkv beside it. Test-only; included by those two files.
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>  // memfd_create
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/ring_layout.h"
#include "common/session_channel.h"
#include "common/uds.h"
#include "common/unique_fd.h"
#include "flexkv/block_key.h"
#include "flexkv/client.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "common/mapped_region.h"
#include "tests/support/process.h"
#include "tests/support/raw_protocol.h"

namespace flexkv::testing::ring {

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::CompletionDescriptor;
using flexkv::RingOp;
using flexkv::StatusCode;
using flexkv::SubmitDescriptor;
using flexkv::UniqueFd;
using flexkv::testing::DaemonUnderTest;


constexpr char kNamespace[] = "ring-validation";
constexpr uint32_t kKvBlocks = 8;
constexpr auto kDeadline = 5s;

// Llama-3-8B heads at 2 layers: 128 KiB blocks, 512 of them in a 64 MiB pool.
inline flexkv::Geometry TestGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

inline uint64_t BlockBytes() {
  const flexkv::Geometry g = TestGeometry();
  return uint64_t{g.num_layers} * g.kv_planes * g.chunk_bytes_per_rank();
}

inline std::vector<BlockKey> KeysFor(int32_t seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * TestGeometry().tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys(kNamespace, tokens, TestGeometry().tokens_per_block);
}

inline uint16_t Op(RingOp op) { return static_cast<uint16_t>(op); }
inline int32_t Code(StatusCode c) { return static_cast<int32_t>(c); }

inline SubmitDescriptor Desc(uint64_t user_data, uint16_t opcode, uint32_t count) {
  SubmitDescriptor d{};
  d.user_data = user_data;
  d.opcode = opcode;
  d.count = count;
  return d;
}

inline std::string MessageOf(const CompletionDescriptor& c) {
  return std::string(c.message, strnlen(c.message, sizeof(c.message)));
}

inline bool MessageTerminated(const CompletionDescriptor& c) { return strnlen(c.message, sizeof(c.message)) < sizeof(c.message); }

inline uint64_t ErrorsCounter(flexkv::Client& c) {
  auto st = c.GetStatus();
  REQUIRE(st.ok());
  auto it = st->counters.find("errors");
  REQUIRE(it != st->counters.end());
  return it->second;
}

inline std::unique_ptr<flexkv::Client> ConnectTo(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

// A client that speaks the wire protocol by hand: gRPC Attach, the session channel hello, the rings
// mapped directly, host KV registered with its own memfd. Everything it writes into the rings is raw.
// Its methods use REQUIRE/CHECK and so must run on the test's thread.
class RawSession {
 public:
  RawSession(const std::string& socket, bool register_kv) {
    channel_ = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
    stub_ = flexkv::v1::Control::NewStub(channel_);
    Attach();
    OpenChannel(socket);
    if (register_kv) RegisterKv();
  }
  RawSession(const RawSession&) = delete;
  RawSession& operator=(const RawSession&) = delete;

  uint64_t session_id() const { return session_id_; }
  flexkv::RingHeader& hdr() const { return *reinterpret_cast<flexkv::RingHeader*>(ring_); }
  uint32_t submit_entries() const { return hdr().submit_entries; }
  uint64_t arena_bytes() const { return hdr().arena_bytes; }
  uint8_t* arena() const { return ring_ + hdr().arena_offset; }
  uint8_t* submit_ring() const { return ring_ + hdr().submit_offset; }
  uint64_t submit_ring_bytes() const { return uint64_t{submit_entries()} * sizeof(SubmitDescriptor); }
  uint8_t* kv_block(uint32_t b) const { return kv_ + uint64_t{b} * BlockBytes(); }
  uint32_t tail() const { return submit_tail_; }

  void PutArena(uint64_t offset, const void* data, size_t bytes) {
    REQUIRE(offset + bytes <= arena_bytes());
    std::memcpy(arena() + offset, data, bytes);
  }

  // Writes descriptors at the tail, publishes the new tail once and rings the doorbell once.
  void Submit(std::span<const SubmitDescriptor> ds) {
    REQUIRE(ds.size() <= submit_entries());
    auto* entries = reinterpret_cast<SubmitDescriptor*>(submit_ring());
    for (const SubmitDescriptor& d : ds) entries[submit_tail_++ & (submit_entries() - 1)] = d;
    SetTail(submit_tail_);
  }
  // Publishes any tail, sane or not, and rings the doorbell (the daemon may be parked).
  void SetTail(uint32_t tail) {
    submit_tail_ = tail;
    hdr().submit_tail.value.store(tail, std::memory_order_seq_cst);
    RingDoorbell();
  }
  void RingDoorbell() {
    const uint64_t one = 1;
    REQUIRE(write(doorbell_.get(), &one, sizeof(one)) == static_cast<ssize_t>(sizeof(one)));
  }

  // Reaps completions until `n` arrived or `timeout` passed (never waits forever). `between` runs on
  // every idle poll (used to keep scribbling over the rings while the daemon works).
  std::vector<CompletionDescriptor> Collect(size_t n, std::chrono::milliseconds timeout = kDeadline,
                                            const std::function<void()>& between = {}) {
    std::vector<CompletionDescriptor> out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const auto* entries = reinterpret_cast<const CompletionDescriptor*>(ring_ + hdr().completion_offset);
    const uint32_t mask = hdr().completion_entries - 1;
    while (out.size() < n) {
      const uint32_t tail = hdr().completion_tail.value.load(std::memory_order_acquire);
      while (completion_head_ != tail && out.size() < n) out.push_back(entries[completion_head_++ & mask]);
      hdr().completion_head.value.store(completion_head_, std::memory_order_release);
      if (out.size() >= n || std::chrono::steady_clock::now() >= deadline) break;
      if (between) between();
      std::this_thread::sleep_for(100us);
    }
    return out;
  }
  // Completions keyed by user_data; each user_data must come back exactly once.
  std::map<uint64_t, CompletionDescriptor> CollectByUserData(size_t n) {
    std::map<uint64_t, CompletionDescriptor> by_id;
    for (const CompletionDescriptor& c : Collect(n)) {
      INFO("user_data " << c.user_data);
      CHECK(by_id.emplace(c.user_data, c).second);
    }
    REQUIRE(by_id.size() == n);
    return by_id;
  }
  // Nothing more arrives within `quiet`.
  void ExpectNoMoreCompletions(std::chrono::milliseconds quiet = 50ms) {
    auto extra = Collect(1, quiet);
    if (!extra.empty()) {
      INFO("unexpected completion: user_data " << extra[0].user_data << " status " << extra[0].status_code << " "
                                               << MessageOf(extra[0]));
      CHECK(extra.empty());
    }
  }

  CompletionDescriptor SubmitOne(const SubmitDescriptor& d) {
    Submit(std::span<const SubmitDescriptor>(&d, 1));
    auto got = Collect(1);
    REQUIRE(got.size() == 1);
    CHECK(got[0].user_data == d.user_data);
    return got[0];
  }

  // A valid Store of `keys` from KV blocks 0.. through the arena at `at`; asserts success.
  CompletionDescriptor StoreOk(uint64_t user_data, const std::vector<BlockKey>& keys, uint64_t at) {
    std::vector<uint32_t> ids(keys.size());
    for (uint32_t i = 0; i < ids.size(); ++i) ids[i] = i;
    PutArena(at, keys.data(), keys.size() * sizeof(BlockKey));
    const uint64_t ids_at = at + keys.size() * sizeof(BlockKey);
    PutArena(ids_at, ids.data(), ids.size() * sizeof(uint32_t));
    SubmitDescriptor d = Desc(user_data, Op(RingOp::kStore), static_cast<uint32_t>(keys.size()));
    d.keys_offset = at;
    d.block_ids_offset = ids_at;
    CompletionDescriptor c = SubmitOne(d);
    INFO(MessageOf(c));
    REQUIRE(c.status_code == 0);
    CHECK(c.matched_blocks + c.done_blocks == keys.size());
    return c;
  }
  // A valid Match of `keys` through the arena at `at`; asserts success.
  CompletionDescriptor MatchOk(uint64_t user_data, const std::vector<BlockKey>& keys, uint64_t at, bool pin) {
    PutArena(at, keys.data(), keys.size() * sizeof(BlockKey));
    SubmitDescriptor d = Desc(user_data, Op(RingOp::kMatch), static_cast<uint32_t>(keys.size()));
    d.flags = pin ? flexkv::kMatchFlagPin : 0;
    d.keys_offset = at;
    CompletionDescriptor c = SubmitOne(d);
    INFO(MessageOf(c));
    REQUIRE(c.status_code == 0);
    return c;
  }

 private:
  void Attach() {
    const flexkv::testing::RawGrant grant = flexkv::testing::RawAttach(*stub_, "raw-ring-client", kNamespace, TestGeometry());
    session_id_ = grant.session_id;
    token_ = grant.token;
  }

  void OpenChannel(const std::string& socket) {
    std::vector<UniqueFd> fds;
    const flexkv::SessionHelloReply reply = flexkv::testing::RawHello(socket, session_id_, token_, &channel_fd_, &fds);
    REQUIRE(std::memcmp(reply.magic, flexkv::kSessionChannelMagic, 4) == 0);
    INFO(reply.message);
    REQUIRE(reply.status_code == 0);
    REQUIRE(fds.size() == 2);
    struct stat st {};
    REQUIRE(fstat(fds[0].get(), &st) == 0);
    auto ring = flexkv::MappedRegion::Shared("the session's rings", fds[0].get(), static_cast<size_t>(st.st_size));
    REQUIRE(ring.ok());
    ring_map_ = std::move(*ring);
    ring_ = ring_map_.bytes();
    doorbell_ = std::move(fds[1]);
    REQUIRE(hdr().magic == flexkv::kRingMagic);
    REQUIRE(hdr().layout_version == flexkv::kRingLayoutVersion);
    const flexkv::RingGeometry rg{hdr().submit_entries, hdr().completion_entries, hdr().arena_bytes};
    REQUIRE(hdr().submit_offset == rg.submit_offset());
    REQUIRE(hdr().completion_offset == rg.completion_offset());
    REQUIRE(hdr().arena_offset == rg.arena_offset());
    REQUIRE(rg.total_bytes() <= ring_map_.size());
    REQUIRE(hdr().submit_entries >= 64);
    REQUIRE(hdr().arena_bytes >= (4u << 20));
    submit_tail_ = hdr().submit_tail.value.load();
    completion_head_ = hdr().completion_head.value.load();
  }

  void RegisterKv() {
    kv_bytes_ = kKvBlocks * BlockBytes();
    UniqueFd memfd(static_cast<int>(syscall(SYS_memfd_create, "raw-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
    REQUIRE(memfd.valid());
    REQUIRE(ftruncate(memfd.get(), static_cast<off_t>(kv_bytes_)) == 0);
    REQUIRE(fallocate(memfd.get(), 0, 0, static_cast<off_t>(kv_bytes_)) == 0);  // the daemon refuses sparse KV
    REQUIRE(fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    auto kv = flexkv::MappedRegion::Shared("the raw session's KV memfd", memfd.get(), kv_bytes_);
    REQUIRE(kv.ok());
    kv_map_ = std::move(*kv);
    kv_ = kv_map_.bytes();
    for (uint32_t b = 0; b < kKvBlocks; ++b) std::memset(kv_block(b), 0xA0 + static_cast<int>(b), BlockBytes());

    constexpr uint32_t kTag = 7;
    flexkv::ChannelMessage offer{};
    std::memcpy(offer.magic, flexkv::kChannelMessageMagic, 4);
    offer.type = static_cast<uint32_t>(flexkv::ChannelMessageType::kOfferFd);
    offer.tag = kTag;
    const int raw = memfd.get();
    REQUIRE(flexkv::SendWithFds(channel_fd_.get(), &offer, sizeof(offer), std::span<const int>(&raw, 1)).ok());
    flexkv::ChannelMessage ack{};
    REQUIRE(flexkv::RecvWithFds(channel_fd_.get(), &ack, sizeof(ack), nullptr).ok());
    REQUIRE(ack.type == static_cast<uint32_t>(flexkv::ChannelMessageType::kOfferFdAck));
    REQUIRE(ack.tag == kTag);
    REQUIRE(ack.status_code == 0);

    flexkv::v1::RegisterKvRequest req;
    req.set_session_id(session_id_);
    req.set_session_token(token_);
    req.set_layout(flexkv::v1::KV_LAYOUT_BLOCK_FIRST);
    req.set_num_blocks(kKvBlocks);
    req.mutable_host()->set_fd_tag(kTag);
    req.mutable_host()->set_bytes(kv_bytes_);
    flexkv::v1::RegisterKvResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    grpc::Status st = stub_->RegisterKv(&ctx, req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
    CHECK(resp.bytes_required() == kv_bytes_);
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<flexkv::v1::Control::Stub> stub_;
  uint64_t session_id_ = 0;
  std::string token_;
  UniqueFd channel_fd_;
  UniqueFd doorbell_;
  flexkv::MappedRegion ring_map_;
  uint8_t* ring_ = nullptr;  // ring_map_'s bytes
  flexkv::MappedRegion kv_map_;
  uint8_t* kv_ = nullptr;  // kv_map_'s bytes
  uint64_t kv_bytes_ = 0;
  uint32_t submit_tail_ = 0;
  uint32_t completion_head_ = 0;
};

// A well-behaved session on the real client library. On its own thread it keeps storing, matching with
// pin, loading and releasing four chains, checking every result and the loaded bytes; it records
// failures instead of asserting (Catch2 assertions are not thread-safe).
class GoodSession {
 public:
  explicit GoodSession(const DaemonUnderTest& d) : client_(ConnectTo(d)) {
    flexkv::AttachOptions o;
    o.client_name = "well-behaved";
    o.model_namespace = kNamespace;
    o.geometry = TestGeometry();
    REQUIRE(client_->Attach(o).ok());
    auto kv = client_->CreateHostKv(flexkv::KvLayout::kBlockFirst, kKvBlocks);
    REQUIRE(kv.ok());
    kv_ = *kv;
    REQUIRE(kv_.bytes == kKvBlocks * BlockBytes());
    for (int32_t c = 0; c < 4; ++c) chains_.push_back(KeysFor(7000 + c, 4));
  }
  ~GoodSession() { Stop(); }

  flexkv::Client& client() { return *client_; }

  void Start() {
    thread_ = std::thread([this] {
      for (uint64_t round = 0; !stop_.load(); ++round) {
        if (!RunRound(round)) std::this_thread::sleep_for(1ms);
        rounds_.fetch_add(1);
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t rounds() const { return rounds_.load(); }
  // Waits (bounded) until `more` further rounds completed, so that the session demonstrably worked
  // during and after whatever the test did in between.
  bool AwaitRounds(uint64_t more) {
    const uint64_t target = rounds() + more;
    const auto deadline = std::chrono::steady_clock::now() + kDeadline;
    while (rounds() < target && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    return rounds() >= target;
  }
  std::vector<std::string> failures() {
    std::lock_guard lock(mu_);
    return failures_;
  }

 private:
  void Fail(std::string what) {
    std::lock_guard lock(mu_);
    if (failures_.size() < 20) failures_.push_back(std::move(what));
  }
  std::optional<flexkv::OpResult> Finish(const char* what, flexkv::Result<flexkv::Ticket> t) {
    if (!t.ok()) {
      Fail(std::string(what) + " submit: " + t.status().ToString());
      return std::nullopt;
    }
    auto r = client_->Wait(*t, kDeadline);
    if (!r.ok()) {
      Fail(std::string(what) + " wait: " + r.status().ToString());
      return std::nullopt;
    }
    if (!r->status.ok()) {
      Fail(std::string(what) + ": " + r->status.ToString());
      return std::nullopt;
    }
    return *r;
  }
  bool RunRound(uint64_t round) {
    const auto& keys = chains_[round % chains_.size()];
    const uint64_t bb = BlockBytes();
    for (uint32_t b = 0; b < 4; ++b) {
      std::memset(kv_.data + b * bb, static_cast<int>((round % chains_.size()) * 16 + b + 1), bb);
      std::memset(kv_.data + (4 + b) * bb, 0, bb);
    }
    const std::vector<uint32_t> src{0, 1, 2, 3}, dst{4, 5, 6, 7};
    auto stored = Finish("Store", client_->Store(flexkv::BlockKeyChain(keys), src));
    if (!stored) return false;
    if (stored->matched_blocks + stored->done_blocks != 4) {
      Fail("Store covered " + std::to_string(stored->matched_blocks + stored->done_blocks) + " of 4 blocks");
      return false;
    }
    auto matched = Finish("Match", client_->Match(keys, /*pin=*/true));
    if (!matched) return false;
    if (matched->matched_blocks != 4 || matched->match_handle == 0) {
      Fail("Match found " + std::to_string(matched->matched_blocks) + " of 4 blocks");
      return false;
    }
    auto loaded = Finish("Load", client_->Load(matched->match_handle, dst));
    bool ok = loaded.has_value();
    if (ok && loaded->done_blocks != 4) {
      Fail("Load copied " + std::to_string(loaded->done_blocks) + " of 4 blocks");
      ok = false;
    }
    if (ok && std::memcmp(kv_.data, kv_.data + 4 * bb, 4 * bb) != 0) {
      Fail("loaded bytes differ from the stored ones in round " + std::to_string(round));
      ok = false;
    }
    if (!Finish("Release", client_->Release(matched->match_handle))) ok = false;
    return ok;
  }

  std::unique_ptr<flexkv::Client> client_;
  flexkv::HostKvBuffers kv_;
  std::vector<std::vector<BlockKey>> chains_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rounds_{0};
  std::mutex mu_;
  std::vector<std::string> failures_;
};

inline void ExpectHealthyAfterAbuse(DaemonUnderTest& d, GoodSession& good, uint64_t errors_before, uint64_t min_new_errors) {
  CHECK(good.AwaitRounds(3));
  good.Stop();
  for (const std::string& f : good.failures()) FAIL_CHECK("well-behaved session: " << f);
  CHECK(good.rounds() > 3);
  auto st = good.client().GetStatus();
  REQUIRE(st.ok());
  CHECK(st->state == "serving");
  CHECK(st->counters.at("errors") >= errors_before + min_new_errors);
  CHECK_FALSE(d.process().Wait(0ms).has_value());
}


// Arena layout of the raw session in the validation and abuse cases.
constexpr uint64_t kKeysAt = 0;           // the valid chain's keys
constexpr uint64_t kIdsAt = 4096;         // valid block ids 0..7
constexpr uint64_t kBadIdsAt = 8192;      // {0, kKvBlocks}: the second is one past the registered blocks
constexpr uint64_t kHugeIdAt = 8192 + 64; // {UINT32_MAX}

}  // namespace flexkv::testing::ring
