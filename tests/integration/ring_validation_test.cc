// Malformed ring descriptors (issue acceptance): a raw-protocol client writes descriptors straight into
// its submit ring (every field out of range, bad offsets, lengths, opcodes, a wrapped ring, garbage) and
// gets error completions; the daemon stays up and a well-behaved session next to it is unaffected.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
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
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::CompletionDescriptor;
using flexkv::RingOp;
using flexkv::StatusCode;
using flexkv::SubmitDescriptor;
using flexkv::UniqueFd;
using flexkv::testing::DaemonUnderTest;

namespace {

constexpr char kNamespace[] = "ring-validation";
constexpr uint32_t kKvBlocks = 8;
constexpr auto kDeadline = 5s;

// Llama-3-8B heads at 2 layers: 128 KiB blocks, 512 of them in a 64 MiB pool.
flexkv::Geometry TestGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

uint64_t BlockBytes() {
  const flexkv::Geometry g = TestGeometry();
  return uint64_t{g.num_layers} * g.kv_planes * g.chunk_bytes_per_rank();
}

std::vector<BlockKey> KeysFor(int32_t seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * TestGeometry().tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys(kNamespace, tokens, TestGeometry().tokens_per_block);
}

uint16_t Op(RingOp op) { return static_cast<uint16_t>(op); }
int32_t Code(StatusCode c) { return static_cast<int32_t>(c); }

SubmitDescriptor Desc(uint64_t user_data, uint16_t opcode, uint32_t count) {
  SubmitDescriptor d{};
  d.user_data = user_data;
  d.opcode = opcode;
  d.count = count;
  return d;
}

std::string MessageOf(const CompletionDescriptor& c) {
  return std::string(c.message, strnlen(c.message, sizeof(c.message)));
}

bool MessageTerminated(const CompletionDescriptor& c) { return strnlen(c.message, sizeof(c.message)) < sizeof(c.message); }

uint64_t ErrorsCounter(flexkv::Client& c) {
  auto st = c.GetStatus();
  REQUIRE(st.ok());
  auto it = st->counters.find("errors");
  REQUIRE(it != st->counters.end());
  return it->second;
}

std::unique_ptr<flexkv::Client> ConnectTo(const DaemonUnderTest& d) {
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
  ~RawSession() {
    if (ring_ != nullptr) munmap(ring_, ring_bytes_);
    if (kv_ != nullptr) munmap(kv_, kv_bytes_);
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
    const flexkv::Geometry g = TestGeometry();
    flexkv::v1::AttachRequest req;
    req.set_client_name("raw-ring-client");
    req.set_pid(static_cast<uint32_t>(getpid()));
    req.set_model_namespace(kNamespace);
    req.set_protocol_version(1);
    flexkv::v1::Geometry* pg = req.mutable_geometry();
    pg->set_tokens_per_block(g.tokens_per_block);
    pg->set_num_layers(g.num_layers);
    pg->set_kv_planes(g.kv_planes);
    pg->set_kv_heads_per_rank(g.kv_heads_per_rank);
    pg->set_head_dim(g.head_dim);
    pg->set_dtype_bytes(g.dtype_bytes);
    pg->set_tp_size(g.tp_size);
    flexkv::v1::AttachResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    grpc::Status st = stub_->Attach(&ctx, req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
    REQUIRE(resp.session_token().size() == flexkv::kSessionTokenBytes);
    session_id_ = resp.session_id();
    token_ = resp.session_token();
  }

  void OpenChannel(const std::string& socket) {
    auto fd = flexkv::ConnectUnix(socket);
    REQUIRE(fd.ok());
    channel_fd_ = std::move(*fd);
    timeval tv{5, 0};
    REQUIRE(setsockopt(channel_fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0);
    flexkv::SessionHello hello{};
    std::memcpy(hello.magic, flexkv::kSessionChannelMagic, 4);
    hello.protocol_version = 1;
    hello.session_id = session_id_;
    std::memcpy(hello.token, token_.data(), flexkv::kSessionTokenBytes);
    REQUIRE(flexkv::SendWithFds(channel_fd_.get(), &hello, sizeof(hello)).ok());
    flexkv::SessionHelloReply reply{};
    std::vector<UniqueFd> fds;
    flexkv::Status got = flexkv::RecvWithFds(channel_fd_.get(), &reply, sizeof(reply), &fds);
    INFO(got.ToString());
    REQUIRE(got.ok());
    REQUIRE(std::memcmp(reply.magic, flexkv::kSessionChannelMagic, 4) == 0);
    reply.message[sizeof(reply.message) - 1] = '\0';
    INFO(reply.message);
    REQUIRE(reply.status_code == 0);
    REQUIRE(fds.size() == 2);
    struct stat st {};
    REQUIRE(fstat(fds[0].get(), &st) == 0);
    ring_bytes_ = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
    REQUIRE(p != MAP_FAILED);
    ring_ = static_cast<uint8_t*>(p);
    doorbell_ = std::move(fds[1]);
    REQUIRE(hdr().magic == flexkv::kRingMagic);
    REQUIRE(hdr().layout_version == flexkv::kRingLayoutVersion);
    const flexkv::RingGeometry rg{hdr().submit_entries, hdr().completion_entries, hdr().arena_bytes};
    REQUIRE(hdr().submit_offset == rg.submit_offset());
    REQUIRE(hdr().completion_offset == rg.completion_offset());
    REQUIRE(hdr().arena_offset == rg.arena_offset());
    REQUIRE(rg.total_bytes() <= ring_bytes_);
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
    REQUIRE(fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    void* p = mmap(nullptr, kv_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
    REQUIRE(p != MAP_FAILED);
    kv_ = static_cast<uint8_t*>(p);
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
  uint8_t* ring_ = nullptr;
  size_t ring_bytes_ = 0;
  uint8_t* kv_ = nullptr;
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
    auto stored = Finish("Store", client_->Store(keys, src));
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

void ExpectHealthyAfterAbuse(DaemonUnderTest& d, GoodSession& good, uint64_t errors_before, uint64_t min_new_errors) {
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

// Arena layout of the raw session in the validation cases.
constexpr uint64_t kKeysAt = 0;           // the valid chain's keys
constexpr uint64_t kIdsAt = 4096;         // valid block ids 0..7
constexpr uint64_t kBadIdsAt = 8192;      // {0, kKvBlocks}: the second is one past the registered blocks
constexpr uint64_t kHugeIdAt = 8192 + 64; // {UINT32_MAX}

}  // namespace

TEST_CASE("malformed ring descriptors get error completions, the daemon and other sessions are unaffected",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));

  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint64_t arena = raw.arena_bytes();

  // A cached chain of two blocks and two pinned match handles on it.
  const std::vector<BlockKey> chain = KeysFor(1, 2);
  CHECK(raw.StoreOk(1, chain, kKeysAt).done_blocks == 2);
  const CompletionDescriptor h1 = raw.MatchOk(2, chain, kKeysAt, /*pin=*/true);
  const CompletionDescriptor h2 = raw.MatchOk(3, chain, kKeysAt, /*pin=*/true);
  REQUIRE(h1.matched_blocks == 2);
  REQUIRE(h2.matched_blocks == 2);
  REQUIRE(h1.match_handle != 0);
  REQUIRE(h2.match_handle != 0);
  REQUIRE(h1.match_handle != h2.match_handle);
  const std::vector<uint32_t> ids{0, 1, 2, 3, 4, 5, 6, 7};
  raw.PutArena(kIdsAt, ids.data(), ids.size() * sizeof(uint32_t));
  const uint32_t bad_ids[2] = {0, kKvBlocks};
  raw.PutArena(kBadIdsAt, bad_ids, sizeof(bad_ids));
  const uint32_t huge_id = std::numeric_limits<uint32_t>::max();
  raw.PutArena(kHugeIdAt, &huge_id, sizeof(huge_id));

  struct Case {
    const char* what;
    SubmitDescriptor d;
    StatusCode expect;
    const char* mentions;  // in the message; may be empty
  };
  std::vector<Case> cases;
  uint64_t next_id = 1000;
  auto add = [&](const char* what, RingOp op, uint32_t count, StatusCode expect, const char* mentions,
                 const std::function<void(SubmitDescriptor&)>& tweak) {
    SubmitDescriptor s = Desc(next_id++, Op(op), count);
    s.keys_offset = kKeysAt;
    s.block_ids_offset = kIdsAt;
    if (tweak) tweak(s);
    cases.push_back({what, s, expect, mentions});
  };
  using SC = StatusCode;
  // Opcodes, flags, reserved fields, counts.
  add("opcode 0", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 0", [](auto& s) { s.opcode = 0; });
  add("opcode 5", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 5", [](auto& s) { s.opcode = 5; });
  add("opcode 99", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 99", [](auto& s) { s.opcode = 99; });
  add("opcode 0xffff", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 65535", [](auto& s) { s.opcode = 0xffff; });
  add("flags on Store", RingOp::kStore, 1, SC::kInvalidArgument, "flags", [](auto& s) { s.flags = 1; });
  add("flags 0x80 on Match", RingOp::kMatch, 1, SC::kInvalidArgument, "flags 0x80", [](auto& s) { s.flags = 0x80; });
  add("flag 0x4 on Load", RingOp::kLoad, 1, SC::kInvalidArgument, "flags 0x4", [&](auto& s) {
    s.flags = 0x4;
    s.match_handle = h1.match_handle;
  });
  add("flags on Release", RingOp::kRelease, 0, SC::kInvalidArgument, "flags", [&](auto& s) {
    s.flags = 0x8000;
    s.match_handle = h1.match_handle;
  });
  add("reserved[0] != 0", RingOp::kMatch, 1, SC::kInvalidArgument, "reserved", [](auto& s) { s.reserved[0] = 1; });
  add("reserved[1] != 0", RingOp::kMatch, 1, SC::kInvalidArgument, "reserved", [](auto& s) { s.reserved[1] = 42; });
  add("reserved[2] != 0 on Release", RingOp::kRelease, 0, SC::kInvalidArgument, "reserved", [&](auto& s) {
    s.reserved[2] = ~0ULL;
    s.match_handle = h1.match_handle;
  });
  add("Match count 0", RingOp::kMatch, 0, SC::kInvalidArgument, "count 0", nullptr);
  add("Store count 0", RingOp::kStore, 0, SC::kInvalidArgument, "count 0", nullptr);
  add("Load count 0", RingOp::kLoad, 0, SC::kInvalidArgument, "count 0", [&](auto& s) { s.match_handle = h1.match_handle; });
  add("Match count 2^31", RingOp::kMatch, 1u << 31, SC::kInvalidArgument, "count 2147483648", nullptr);
  add("Store count UINT32_MAX", RingOp::kStore, std::numeric_limits<uint32_t>::max(), SC::kInvalidArgument, "count",
      nullptr);
  // Arena offsets and lengths.
  add("keys_offset past the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena + 16;
  });
  add("keys_offset at the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena;
  });
  add("keys straddling the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena - 8;
  });
  add("keys_offset + count*16 overflowing", RingOp::kMatch, 2, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = std::numeric_limits<uint64_t>::max() - 15;
  });
  add("keys_offset UINT64_MAX - 7 on Store", RingOp::kStore, 1, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = std::numeric_limits<uint64_t>::max() - 7;
  });
  if (arena < (16u << 20)) {
    add("keys longer than the arena", RingOp::kMatch, 1u << 20, SC::kOutOfRange, "keys", nullptr);
  }
  add("misaligned keys_offset 3", RingOp::kMatch, 1, SC::kOutOfRange, "unaligned", [](auto& s) { s.keys_offset = 3; });
  add("misaligned keys_offset 4 on Store", RingOp::kStore, 1, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = 4;
  });
  add("block_ids_offset past the arena on Store", RingOp::kStore, 1, SC::kOutOfRange, "block ids", [&](auto& s) {
    s.block_ids_offset = arena;
  });
  add("block_ids_offset overflowing on Store", RingOp::kStore, 4, SC::kOutOfRange, "block ids", [](auto& s) {
    s.block_ids_offset = std::numeric_limits<uint64_t>::max() - 3;
  });
  add("misaligned block_ids_offset on Store", RingOp::kStore, 1, SC::kOutOfRange, "block ids", [](auto& s) {
    s.block_ids_offset = kIdsAt + 2;
  });
  add("block ids straddling the arena end on Load", RingOp::kLoad, 2, SC::kOutOfRange, "block ids", [&](auto& s) {
    s.block_ids_offset = arena - 4;
    s.match_handle = h1.match_handle;
  });
  // Block ids and match handles.
  add("Store block id == num_blocks", RingOp::kStore, 2, SC::kOutOfRange, "block id 8", [&](auto& s) {
    s.block_ids_offset = kBadIdsAt;
  });
  add("Store block id UINT32_MAX", RingOp::kStore, 1, SC::kOutOfRange, "block id 4294967295", [&](auto& s) {
    s.block_ids_offset = kHugeIdAt;
  });
  add("Load block id == num_blocks", RingOp::kLoad, 2, SC::kOutOfRange, "block id 8", [&](auto& s) {
    s.block_ids_offset = kBadIdsAt;
    s.match_handle = h1.match_handle;
  });
  add("Load block id UINT32_MAX", RingOp::kLoad, 1, SC::kOutOfRange, "block id 4294967295", [&](auto& s) {
    s.block_ids_offset = kHugeIdAt;
    s.match_handle = h1.match_handle;
  });
  add("Load count larger than the handle's blocks", RingOp::kLoad, 3, SC::kOutOfRange, "exceeds", [&](auto& s) {
    s.match_handle = h1.match_handle;
  });
  add("Load with handle 0", RingOp::kLoad, 1, SC::kNotFound, "match handle 0", nullptr);
  add("Load with an unknown handle", RingOp::kLoad, 1, SC::kNotFound, "match handle", [](auto& s) {
    s.match_handle = 0xdeadbeefcafeULL;
  });
  add("Release of handle 0", RingOp::kRelease, 0, SC::kNotFound, "match handle 0", nullptr);
  add("Release of an unknown handle", RingOp::kRelease, 0, SC::kNotFound, "match handle", [](auto& s) {
    s.match_handle = std::numeric_limits<uint64_t>::max();
  });
  add("Release of h2", RingOp::kRelease, 0, SC::kOk, "", [&](auto& s) { s.match_handle = h2.match_handle; });
  add("Release of h2 again", RingOp::kRelease, 0, SC::kNotFound, "match handle", [&](auto& s) {
    s.match_handle = h2.match_handle;
  });
  add("Load from the released h2", RingOp::kLoad, 1, SC::kNotFound, "match handle", [&](auto& s) {
    s.match_handle = h2.match_handle;
  });
  REQUIRE(cases.size() < raw.submit_entries());

  std::vector<SubmitDescriptor> batch;
  for (const Case& c : cases) batch.push_back(c.d);
  raw.Submit(batch);  // all at once, one doorbell
  auto got = raw.CollectByUserData(cases.size());
  size_t failures = 0;
  for (const Case& c : cases) {
    INFO("case: " << c.what);
    auto it = got.find(c.d.user_data);
    REQUIRE(it != got.end());
    const CompletionDescriptor& r = it->second;
    INFO("status " << r.status_code << ", message: " << MessageOf(r));
    CHECK(r.status_code == Code(c.expect));
    CHECK(r.opcode == c.d.opcode);
    CHECK(MessageTerminated(r));
    if (c.expect != SC::kOk) {
      ++failures;
      CHECK_FALSE(MessageOf(r).empty());
      CHECK_THAT(MessageOf(r), Catch::Contains(c.mentions));
      CHECK(r.matched_blocks == 0);
      CHECK(r.done_blocks == 0);
      CHECK(r.match_handle == 0);
    }
  }
  raw.ExpectNoMoreCompletions();
  CHECK(raw.hdr().submit_head.value.load() == raw.tail());

  // The abused session still works: h1 survived the abuse, loads its two blocks and releases.
  std::memset(raw.kv_block(4), 0, BlockBytes() * 2);
  SubmitDescriptor load = Desc(5000, Op(RingOp::kLoad), 2);
  load.block_ids_offset = kIdsAt + 4 * sizeof(uint32_t);  // ids {4, 5}
  load.match_handle = h1.match_handle;
  CompletionDescriptor loaded = raw.SubmitOne(load);
  INFO(MessageOf(loaded));
  CHECK(loaded.status_code == 0);
  CHECK(loaded.done_blocks == 2);
  CHECK(std::memcmp(raw.kv_block(0), raw.kv_block(4), BlockBytes() * 2) == 0);
  SubmitDescriptor release = Desc(5001, Op(RingOp::kRelease), 0);
  release.match_handle = h1.match_handle;
  CHECK(raw.SubmitOne(release).status_code == 0);
  CHECK(raw.SubmitOne(release).status_code == Code(SC::kNotFound));
  ++failures;
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  for (const auto& s : *sessions) {
    INFO("session " << s.session_id << " " << s.client_name);
    if (s.session_id == raw.session_id()) {
      CHECK(s.pinned_blocks == 0);
      CHECK(s.inflight_requests == 0);
    }
  }

  ExpectHealthyAfterAbuse(d, good, errors_before, failures);
}

TEST_CASE("a wrapped submit ring gets one INVALID_ARGUMENT completion naming the tail, the session keeps working",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t entries = raw.submit_entries();

  // Some valid traffic first so that head and tail are not at zero.
  CHECK(raw.MatchOk(1, KeysFor(2, 1), kKeysAt, false).matched_blocks == 0);

  struct Wrap {
    const char* what;
    uint32_t delta;  // tail - head
  };
  const Wrap wraps[] = {
      {"tail = head + entries + 5", entries + 5},
      {"tail = head + entries + 1", entries + 1},
      {"tail one behind head", std::numeric_limits<uint32_t>::max()},
      {"tail half the index space away", 1u << 31},
  };
  int32_t seed = 100;
  for (const Wrap& w : wraps) {
    INFO(w.what);
    // Fill the ring with valid-looking descriptors: none of them may run.
    std::vector<SubmitDescriptor> junk(entries, Desc(777, Op(RingOp::kMatch), 1));
    std::memcpy(raw.submit_ring(), junk.data(), raw.submit_ring_bytes());
    const uint32_t head = raw.hdr().submit_head.value.load();
    REQUIRE(head == raw.tail());
    raw.SetTail(head + w.delta);
    auto got = raw.Collect(1);
    REQUIRE(got.size() == 1);
    INFO(MessageOf(got[0]));
    CHECK(got[0].status_code == Code(StatusCode::kInvalidArgument));
    CHECK(got[0].user_data == 0);
    CHECK(MessageTerminated(got[0]));
    CHECK_THAT(MessageOf(got[0]), Catch::Contains("submit_tail " + std::to_string(head + w.delta)));
    raw.ExpectNoMoreCompletions();
    // The daemon resynchronised its head to the bogus tail; the session goes on from there.
    CHECK(raw.hdr().submit_head.value.load() == head + w.delta);

    const std::vector<BlockKey> chain = KeysFor(seed++, 2);
    const CompletionDescriptor stored = raw.StoreOk(10, chain, kKeysAt);
    CHECK(stored.done_blocks == 2);
    CHECK(raw.MatchOk(11, chain, kKeysAt, false).matched_blocks == 2);
  }

  // The boundary: exactly `entries` descriptors in flight is a full ring, not a wrapped one.
  {
    const std::vector<BlockKey> chain = KeysFor(seed - 1, 2);
    raw.PutArena(kKeysAt, chain.data(), chain.size() * sizeof(BlockKey));
    std::vector<SubmitDescriptor> full;
    for (uint32_t i = 0; i < entries; ++i) {
      SubmitDescriptor m = Desc(100000 + i, Op(RingOp::kMatch), 2);
      m.keys_offset = kKeysAt;
      full.push_back(m);
    }
    raw.Submit(full);
    auto got = raw.CollectByUserData(entries);
    size_t ok = 0;
    for (const auto& [id, c] : got) ok += c.status_code == 0 && c.matched_blocks == 2 ? 1 : 0;
    CHECK(ok == entries);
    raw.ExpectNoMoreCompletions();
  }

  ExpectHealthyAfterAbuse(d, good, errors_before, std::size(wraps));
}

TEST_CASE("garbage over the submit ring and arena: the daemon survives and other sessions are unaffected",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t entries = raw.submit_entries();
  const uint64_t arena = raw.arena_bytes();

  // A cached chain the structured garbage can hit, so Match with pin hands out real handles that
  // garbage Loads and Releases then use.
  const std::vector<BlockKey> chain = KeysFor(3, 4);
  raw.StoreOk(1, chain, kKeysAt);
  constexpr uint64_t kSmallIdsAt = 1u << 20;  // u32 ids mostly below kKvBlocks
  constexpr uint64_t kChainAt = 2u << 20;     // the cached chain's keys

  std::mt19937_64 rng(0x5eed1e55);
  std::mt19937_64 scribble_rng(0xbadc0ffee);  // consumed a timing-dependent number of times
  auto fill_random = [](std::mt19937_64& r, uint8_t* p, uint64_t bytes) {
    for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
      const uint64_t v = r();
      std::memcpy(p + i, &v, 8);
    }
  };
  auto pick = [&](std::initializer_list<uint64_t> choices) {
    return *(choices.begin() + static_cast<std::ptrdiff_t>(rng() % choices.size()));
  };
  // Store blocks the garbage may commit, bounded so the pool (512 blocks) never evicts anything.
  uint32_t store_budget = 320;

  uint64_t expected_errors = 0;
  uint64_t ok_completions = 0;
  uint64_t total_completions = 0;
  for (int round = 0; round < 32; ++round) {
    const int mode = round % 4;  // 0: random tail; 1: random in-range tail, scribbling on; 2, 3: structured
    INFO("round " << round << " mode " << mode);
    fill_random(rng, raw.submit_ring(), raw.submit_ring_bytes());
    fill_random(rng, raw.arena(), arena);
    std::map<uint64_t, SubmitDescriptor> sent;  // structured rounds: user_data → descriptor
    const uint32_t head = raw.hdr().submit_head.value.load();
    REQUIRE(head == raw.tail());
    uint32_t tail = 0;
    if (mode == 0) {
      tail = static_cast<uint32_t>(rng());
    } else if (mode == 1) {
      tail = head + static_cast<uint32_t>(rng() % (entries + 1));
    } else {
      // Plausible descriptors: reserved fields zero, every other field from a menu of edge values.
      for (uint64_t i = 0; i < 8192; ++i) {
        const uint32_t id = static_cast<uint32_t>(rng() % (kKvBlocks + 1));
        std::memcpy(raw.arena() + kSmallIdsAt + 4 * i, &id, 4);
      }
      raw.PutArena(kChainAt, chain.data(), chain.size() * sizeof(BlockKey));
      const uint32_t n = 1 + static_cast<uint32_t>(rng() % 64);
      auto* ring = reinterpret_cast<SubmitDescriptor*>(raw.submit_ring());
      for (uint32_t i = 0; i < n; ++i) {
        SubmitDescriptor s{};
        s.user_data = (uint64_t{static_cast<uint32_t>(round)} << 32) | i;
        s.opcode = static_cast<uint16_t>(pick({0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 0xffff}));
        s.flags = static_cast<uint16_t>(pick({0, 0, 0, 0, 0, 0, 1, 1, 2, 0x8000}));
        s.count = static_cast<uint32_t>(pick({0, 1, 1, 2, 2, 3, 4, 5, 8, 16, 1u << 20, (1u << 20) + 1, rng()}));
        s.keys_offset = pick({kChainAt, kChainAt, kChainAt, kChainAt + 16, 8 * (rng() % (arena / 8)), arena - 16, arena - 8,
                              arena, 3, rng(), std::numeric_limits<uint64_t>::max() - 7});
        s.block_ids_offset = pick({kSmallIdsAt, kSmallIdsAt, kSmallIdsAt + 4 * (rng() % 4096), kSmallIdsAt + 4 * (rng() % 4096), 4 * (rng() % (arena / 4)),
                                   arena - 4, arena, 2, rng(), std::numeric_limits<uint64_t>::max() - 3});
        s.match_handle = pick({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, rng()});
        // Bit 0 of a Load's flags may ask for per-layer progress completions (a layout where it is
        // defined); those would break the one-completion-per-descriptor count, so leave it clear.
        if (s.opcode == Op(RingOp::kLoad)) s.flags = static_cast<uint16_t>(s.flags & ~1u);
        if (rng() % 20 == 0) s.reserved[rng() % 3] = rng() | 1;
        if (s.opcode == Op(RingOp::kStore)) {
          // A Store that may pass validation takes up to `count` pool slots: charge it to the budget, and
          // turn it into a count-0 one once the budget is spent.
          auto in_arena = [&](uint64_t offset, uint64_t bytes, uint64_t align) {
            return offset % align == 0 && offset <= arena && bytes <= arena - offset;
          };
          const bool may_pass = s.flags == 0 && s.reserved[0] == 0 && s.reserved[1] == 0 && s.reserved[2] == 0 &&
                                in_arena(s.keys_offset, uint64_t{s.count} * 16, 8) &&
                                in_arena(s.block_ids_offset, uint64_t{s.count} * 4, 4);
          if (may_pass) {
            if (s.count > 16 || s.count > store_budget) {
              s.count = 0;
            } else {
              store_budget -= s.count;
            }
          }
        }
        ring[(head + i) & (entries - 1)] = s;
        sent[s.user_data] = s;
      }
      tail = head + n;
    }
    const uint32_t delta = tail - head;
    const size_t expect = delta > entries ? 1 : delta;
    raw.SetTail(tail);
    std::function<void()> scribble;
    if (mode == 1) {
      // Keep rewriting the descriptors and the arena under the daemon while it works: it must copy
      // each descriptor once and then trust only the copy.
      scribble = [&] {
        fill_random(scribble_rng, raw.submit_ring(), raw.submit_ring_bytes());
        fill_random(scribble_rng, raw.arena(), 64 << 10);
      };
    }
    auto got = raw.Collect(expect, kDeadline, scribble);
    REQUIRE(got.size() == expect);
    raw.ExpectNoMoreCompletions(20ms);
    CHECK(raw.hdr().submit_head.value.load() == tail);
    total_completions += got.size();
    for (const CompletionDescriptor& c : got) {
      INFO("user_data " << c.user_data << " opcode " << c.opcode << " status " << c.status_code << " "
                        << MessageOf(c));
      CHECK(c.status_code >= 0);
      CHECK(c.status_code <= Code(StatusCode::kUnauthenticated));
      CHECK(MessageTerminated(c));
      if (c.status_code != 0) {
        ++expected_errors;
        CHECK_FALSE(MessageOf(c).empty());
      } else {
        ++ok_completions;
        CHECK(c.opcode >= 1);
        CHECK(c.opcode <= 4);
      }
      if (mode <= 1) {
        // Random bytes never have three zero reserved words; a wrapped tail is refused outright.
        CHECK(c.status_code != 0);
        continue;
      }
      auto it = sent.find(c.user_data);
      REQUIRE(it != sent.end());
      const SubmitDescriptor& s = it->second;
      CHECK(c.opcode == s.opcode);
      const bool reserved = s.reserved[0] != 0 || s.reserved[1] != 0 || s.reserved[2] != 0;
      if (reserved || s.opcode < 1 || s.opcode > 4) CHECK(c.status_code == Code(StatusCode::kInvalidArgument));
      if (c.status_code != 0) continue;
      switch (static_cast<RingOp>(s.opcode)) {
        case RingOp::kMatch:
          CHECK(c.matched_blocks <= s.count);
          if ((s.flags & flexkv::kMatchFlagPin) == 0 || c.matched_blocks == 0) CHECK(c.match_handle == 0);
          if ((s.flags & flexkv::kMatchFlagPin) != 0 && c.matched_blocks > 0) CHECK(c.match_handle != 0);
          break;
        case RingOp::kStore:
          CHECK(uint64_t{c.matched_blocks} + c.done_blocks <= s.count);
          break;
        case RingOp::kLoad:
          CHECK(c.done_blocks == s.count);
          break;
        case RingOp::kRelease:
          break;
      }
    }
  }
  INFO(total_completions << " completions, " << ok_completions << " OK");
  CHECK(ok_completions > 0);  // the structured garbage reached past validation sometimes

  // The abused session recovers with clean descriptors, and holds nothing in flight.
  std::memset(raw.arena(), 0, arena);
  const std::vector<BlockKey> after = KeysFor(4, 2);
  CHECK(raw.StoreOk(9000, after, kKeysAt).done_blocks == 2);
  CHECK(raw.MatchOk(9001, after, kKeysAt, false).matched_blocks == 2);
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  CHECK(sessions->size() == 2);
  for (const auto& s : *sessions) {
    if (s.session_id == raw.session_id()) CHECK(s.inflight_requests == 0);
  }
  auto st = good.client().GetStatus();
  REQUIRE(st.ok());
  CHECK(st->counters.at("evicted_blocks") == 0);

  ExpectHealthyAfterAbuse(d, good, errors_before, expected_errors);
}

TEST_CASE("Store and Load before RegisterKv get FAILED_PRECONDITION, the poller keeps serving others",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession with_kv(d.socket(), /*register_kv=*/true);
  RawSession no_kv(d.socket(), /*register_kv=*/false);
  const std::vector<BlockKey> chain = KeysFor(1, 2);
  CHECK(with_kv.StoreOk(1, chain, kKeysAt).done_blocks == 2);
  const std::vector<uint32_t> ids{0, 1};

  // Each on its own, so that one that never completes is named.
  no_kv.PutArena(kKeysAt, chain.data(), chain.size() * sizeof(BlockKey));
  no_kv.PutArena(kIdsAt, ids.data(), ids.size() * sizeof(uint32_t));
  SubmitDescriptor store = Desc(1, Op(RingOp::kStore), 2);
  store.keys_offset = kKeysAt;
  store.block_ids_offset = kIdsAt;
  const CompletionDescriptor stored = no_kv.SubmitOne(store);
  INFO(MessageOf(stored));
  CHECK(stored.status_code == Code(StatusCode::kFailedPrecondition));
  CHECK_THAT(MessageOf(stored), Catch::Contains("RegisterKv"));

  SubmitDescriptor load = Desc(2, Op(RingOp::kLoad), 1);
  load.block_ids_offset = kIdsAt;
  load.match_handle = 1;
  const CompletionDescriptor loaded = no_kv.SubmitOne(load);
  INFO(MessageOf(loaded));
  CHECK(loaded.status_code == Code(StatusCode::kFailedPrecondition));
  CHECK_THAT(MessageOf(loaded), Catch::Contains("RegisterKv"));

  // Match needs no KV buffers; the cache is shared within the namespace.
  CHECK(no_kv.MatchOk(3, chain, kKeysAt, false).matched_blocks == 2);
  CHECK(with_kv.MatchOk(4, chain, kKeysAt, false).matched_blocks == 2);

  ExpectHealthyAfterAbuse(d, good, errors_before, 2);
}

// Regression: PollSession used to post one error completion per wrapped tail without the back-pressure
// check, so a client that kept publishing wrapped tails and never reaped grew the daemon's overflow queue
// (and the session's inflight count) without bound.
TEST_CASE("wrapped tails from a client that never reaps do not grow the daemon backlog without bound",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t completion_entries = raw.hdr().completion_entries;

  // Four times what the completion ring holds is enough to show the backlog stays bounded; the deadline is
  // generous because each wrapped tail is a round trip with the poller (2-core CI under load: ~3k per second).
  const int target = static_cast<int>(4 * completion_entries);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  int published = 0;
  for (; published < target && std::chrono::steady_clock::now() < deadline; ++published) {
    const uint32_t head = raw.hdr().submit_head.value.load();
    const uint32_t tail = head + (1u << 31);
    raw.hdr().submit_tail.value.store(tail, std::memory_order_seq_cst);
    if (raw.hdr().daemon_parked.value.load(std::memory_order_seq_cst) != 0) raw.RingDoorbell();
    while (raw.hdr().submit_head.value.load() != tail && std::chrono::steady_clock::now() < deadline) {
    }
  }
  CHECK(published == target);
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  bool seen = false;
  for (const auto& s : *sessions) {
    if (s.session_id != raw.session_id()) continue;
    seen = true;
    INFO("the abusive session has " << s.inflight_requests << " requests in flight after " << published
                                    << " wrapped tails");
    CHECK(s.inflight_requests <= completion_entries);
  }
  CHECK(seen);
  ExpectHealthyAfterAbuse(d, good, errors_before, 1);
}
