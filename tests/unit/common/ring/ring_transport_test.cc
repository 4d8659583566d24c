// The ring transport's two ends (common/ring/) paired in one process over one ring memfd, each end with its own
// mapping as two processes would have: every completion arrives exactly once from several submitting threads, a
// submission made while the consumer parks always wakes it, completions wait in the overflow queue while the
// completion ring is full, a full submit ring refuses, and indices the client scribbles are caught.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ring/ring_consumer.h"
#include "common/ring/ring_submitter.h"
#include "common/ring_layout.h"

using flexkv::CompletionDescriptor;
using flexkv::RingGeometry;
using flexkv::SubmitDescriptor;
using flexkv::ring::RingConsumer;
using flexkv::ring::RingSubmitter;
using flexkv::ring::WaitPolicy;

namespace {

constexpr int64_t kWaitNs = 30'000'000'000;  // never reached when healthy: a lost wake-up shows as a deadline

struct Pair {
  std::unique_ptr<RingConsumer> consumer;
  std::unique_ptr<RingSubmitter> submitter;
};

Pair MakePair(RingGeometry geometry, WaitPolicy policy = {}) {
  auto created = RingConsumer::Create(geometry);
  REQUIRE(created.ok());
  auto submitter = RingSubmitter::Map(std::move(created->memfd), std::move(created->doorbell), policy);
  REQUIRE(submitter.ok());
  return {std::move(created->consumer), std::move(*submitter)};
}

SubmitDescriptor Request(uint64_t user_data) {
  SubmitDescriptor d{};
  d.user_data = user_data;
  d.opcode = static_cast<uint16_t>(flexkv::RingOp::kMatch);
  return d;
}

CompletionDescriptor AnswerTo(const SubmitDescriptor& d, uint16_t flags = 0) {
  CompletionDescriptor c{};
  c.user_data = d.user_data;
  c.opcode = d.opcode;
  c.flags = flags;
  return c;
}

bool DoorbellRung(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 1;
}

// A poller that answers every request and parks (sleeps on the doorbell) whenever the ring is empty, with no
// timeout: a lost wake-up leaves a submitter waiting until its deadline.
class EchoConsumer {
 public:
  explicit EchoConsumer(RingConsumer* consumer) : consumer_(consumer), thread_([this] { Run(); }) {}
  ~EchoConsumer() {
    stop_.store(true);
    const uint64_t one = 1;
    ssize_t ignored = write(stop_fd_.get(), &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }

 private:
  void Run() {
    consumer_->Unpark();
    while (!stop_.load()) {
      bool work = consumer_->Flush();
      for (;;) {
        RingConsumer::Taken t = consumer_->Take();
        if (t.kind == RingConsumer::Taken::kNone) break;
        if (t.kind != RingConsumer::Taken::kDescriptor) unexpected_.fetch_add(1);  // checked by the owner
        consumer_->Post(AnswerTo(t.descriptor));
        work = true;
      }
      if (work) continue;
      if (consumer_->Park()) {
        pollfd p[2] = {{consumer_->doorbell_fd(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
        poll(p, 2, consumer_->HasBacklog() ? 1 : -1);
        consumer_->DrainDoorbell();
      }
      consumer_->Unpark();
    }
  }

  RingConsumer* consumer_;
  std::atomic<bool> stop_{false};

 public:
  std::atomic<int> unexpected_{0};  // takes that were not a descriptor (Catch's REQUIRE is not thread-safe)

 private:
  flexkv::UniqueFd stop_fd_{eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
  std::thread thread_;
};

// Submits `per_thread` requests from each of `threads` threads through one submitter (a lock around Push and
// Reap, as its contract asks) and waits for each; returns how often each request's completion was seen.
std::vector<int> SubmitFromThreads(RingSubmitter& submitter, int threads, int per_thread) {
  std::mutex mu;
  std::vector<int> seen(static_cast<size_t>(threads * per_thread) + 1, 0);
  auto reap_locked = [&] {
    submitter.Reap([&](const CompletionDescriptor& c) {
      if (c.user_data < seen.size()) {
        ++seen[c.user_data];
      } else {
        ++seen[0];  // an id never submitted
      }
    });
  };
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        const uint64_t id = static_cast<uint64_t>(t * per_thread + i) + 1;
        {
          std::lock_guard lock(mu);
          while (!submitter.Push(Request(id))) reap_locked();
        }
        const auto end = submitter.Wait(
            [&] {
              std::lock_guard lock(mu);
              reap_locked();
              return seen[id] > 0;
            },
            [] { return false; }, flexkv::NowNs() + kWaitNs);
        if (end != RingSubmitter::WaitEnd::kReady) failures.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  REQUIRE(failures.load() == 0);
  REQUIRE(seen[0] == 0);
  return seen;
}

}  // namespace

TEST_CASE("ring transport: every completion arrives exactly once, spinning or sleeping", "[unit][ring]") {
  WaitPolicy policy;
  SECTION("default policy") {}
  SECTION("sleep at once") { policy = {.pure_spin_ns = 0, .spin_ns = 0}; }
  SECTION("spin only") { policy = {.pure_spin_ns = kWaitNs, .spin_ns = kWaitNs}; }
  SECTION("yield only") { policy = {.pure_spin_ns = 0, .spin_ns = kWaitNs}; }
  // Small rings so that the submit ring fills and the in-flight limit holds submissions back.
  Pair p = MakePair(RingGeometry{8, 8, 4096}, policy);
  std::vector<int> seen;
  {
    EchoConsumer consumer(p.consumer.get());
    seen = SubmitFromThreads(*p.submitter, 4, 2000);
    REQUIRE(consumer.unexpected_.load() == 0);
  }
  for (size_t id = 1; id < seen.size(); ++id) REQUIRE(seen[id] == 1);
  REQUIRE(p.consumer->inflight() == 0);
}

TEST_CASE("ring transport: a submission made while the consumer parks is never lost", "[unit][ring]") {
  Pair p = MakePair(RingGeometry{16, 16, 4096});
  RingConsumer& c = *p.consumer;
  RingSubmitter& s = *p.submitter;
  SECTION("a new session starts parked: its first submission rings the doorbell") {
    REQUIRE(s.Push(Request(1)));
    REQUIRE(DoorbellRung(c.doorbell_fd()));
  }
  SECTION("pushed after Park: the doorbell rings") {
    c.Unpark();
    REQUIRE(c.Park());
    REQUIRE(s.Push(Request(1)));
    REQUIRE(DoorbellRung(c.doorbell_fd()));
  }
  SECTION("pushed before Park (the client saw no flag, rang nothing): Park's re-check sees it") {
    c.Unpark();
    REQUIRE(s.Push(Request(1)));
    REQUIRE_FALSE(DoorbellRung(c.doorbell_fd()));
    REQUIRE_FALSE(c.Park());
  }
  SECTION("unparked: no doorbell, no system call") {
    c.Unpark();
    REQUIRE(s.Push(Request(1)));
    REQUIRE_FALSE(DoorbellRung(c.doorbell_fd()));
  }
  SECTION("one request at a time against a consumer that parks after each: every wake-up arrives") {
    std::vector<int> seen;
    {
      EchoConsumer consumer(&c);
      seen = SubmitFromThreads(s, 1, 3000);
      REQUIRE(consumer.unexpected_.load() == 0);
    }
    for (size_t id = 1; id < seen.size(); ++id) REQUIRE(seen[id] == 1);
  }
}

TEST_CASE("ring transport: completions wait in order while the completion ring is full", "[unit][ring]") {
  Pair p = MakePair(RingGeometry{8, 4, 4096});
  RingConsumer& c = *p.consumer;
  RingSubmitter& s = *p.submitter;
  REQUIRE(s.Push(Request(1)));
  RingConsumer::Taken t = c.Take();
  REQUIRE(t.kind == RingConsumer::Taken::kDescriptor);
  REQUIRE(t.descriptor.user_data == 1);
  // Ten layer-progress completions and the final one: eleven for a ring of four.
  for (uint32_t layer = 0; layer < 10; ++layer) {
    CompletionDescriptor progress = AnswerTo(t.descriptor, flexkv::kCompletionFlagLayerDone);
    progress.matched_blocks = layer;
    c.Post(progress);
  }
  c.Post(AnswerTo(t.descriptor));
  REQUIRE(c.HasBacklog());
  REQUIRE(c.inflight() == 1);  // the final completion is still queued
  std::vector<CompletionDescriptor> got;
  while (got.size() < 11) {
    const size_t before = got.size();
    s.Reap([&](const CompletionDescriptor& done) { got.push_back(done); });
    REQUIRE(got.size() > before);
    c.Flush();
  }
  REQUIRE_FALSE(c.HasBacklog());
  for (uint32_t layer = 0; layer < 10; ++layer) {
    REQUIRE(got[layer].flags == flexkv::kCompletionFlagLayerDone);
    REQUIRE(got[layer].matched_blocks == layer);
  }
  REQUIRE(got[10].flags == 0);
  REQUIRE(c.inflight() == 0);
  c.Close();  // after the session ends nothing more is posted
  c.Post(AnswerTo(t.descriptor));
  REQUIRE(s.Reap([](const CompletionDescriptor&) {}) == 0);
}

// Regression: layer-progress completions did not count against the in-flight limit, so a session that stopped
// reaping grew the daemon's overflow queue by (layers + 1) entries per request (with a 1024-layer geometry, four
// such sessions took the daemon from 18 MB to 572 MB). Progress is now bounded per completion slot.
TEST_CASE("ring transport: a client that stops reaping cannot grow the overflow queue past its bound", "[unit][ring]") {
  Pair p = MakePair(RingGeometry{8, 4, 4096});
  RingConsumer& c = *p.consumer;
  RingSubmitter& s = *p.submitter;
  std::vector<SubmitDescriptor> taken;
  for (uint64_t i = 1; i <= 4; ++i) {
    REQUIRE(s.Push(Request(i)));
    RingConsumer::Taken t = c.Take();
    REQUIRE(t.kind == RingConsumer::Taken::kDescriptor);
    taken.push_back(t.descriptor);
  }
  constexpr uint32_t kLayers = 1024;
  for (const SubmitDescriptor& d : taken) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      CompletionDescriptor progress = AnswerTo(d, flexkv::kCompletionFlagLayerDone);
      progress.matched_blocks = layer;
      c.Post(progress);
    }
    c.Post(AnswerTo(d));
  }
  const size_t bound = RingConsumer::kMaxQueuedProgressPerSlot * 4 + 4;  // progress + one final per request
  CHECK(c.backlog() <= bound);
  CHECK(c.dropped_progress() == 4 * (kLayers + 1) - c.backlog() - 4);
  // Every final completion still arrives, in order after the progress that was kept.
  std::vector<CompletionDescriptor> got;
  for (int round = 0; round < 1000 && (c.HasBacklog() || got.empty()); ++round) {
    s.Reap([&](const CompletionDescriptor& done) { got.push_back(done); });
    c.Flush();
  }
  s.Reap([&](const CompletionDescriptor& done) { got.push_back(done); });
  size_t finals = 0;
  for (const CompletionDescriptor& done : got) finals += (done.flags & flexkv::kCompletionFlagLayerDone) == 0 ? 1 : 0;
  CHECK(finals == 4);
  CHECK(c.inflight() == 0);
}

TEST_CASE("ring transport: a full submit ring refuses, and requests in flight never outnumber completion slots",
          "[unit][ring]") {
  Pair p = MakePair(RingGeometry{8, 4, 4096});
  RingConsumer& c = *p.consumer;
  RingSubmitter& s = *p.submitter;
  for (uint64_t id = 1; id <= 8; ++id) REQUIRE(s.Push(Request(id)));
  REQUIRE_FALSE(s.Push(Request(9)));
  for (uint64_t id = 1; id <= 4; ++id) {
    RingConsumer::Taken t = c.Take();
    REQUIRE(t.kind == RingConsumer::Taken::kDescriptor);
    REQUIRE(t.descriptor.user_data == id);
  }
  // Four in flight and four completion slots: the rest stays queued until one is answered.
  REQUIRE(c.Take().kind == RingConsumer::Taken::kNone);
  REQUIRE_FALSE(c.PendingSubmissions());
  REQUIRE(s.Push(Request(9)));
  c.Post(AnswerTo(Request(1)));
  REQUIRE(c.PendingSubmissions());
  RingConsumer::Taken t = c.Take();
  REQUIRE(t.kind == RingConsumer::Taken::kDescriptor);
  REQUIRE(t.descriptor.user_data == 5);
}

TEST_CASE("ring transport: indices a client scribbles are caught", "[unit][ring]") {
  auto created = RingConsumer::Create(RingGeometry{8, 4, 4096});
  REQUIRE(created.ok());
  RingConsumer& c = *created->consumer;
  // The client's view, written directly as a misbehaving client would.
  const uint64_t bytes = RingGeometry{8, 4, 4096}.total_bytes();
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, created->memfd.get(), 0);
  REQUIRE(m != MAP_FAILED);
  flexkv::ring::RingMapping mapping(static_cast<uint8_t*>(m), bytes);
  flexkv::RingHeader& h = *mapping.header();
  SECTION("a submit tail past the ring's size: one failure, everything skipped") {
    h.submit_tail.value.store(1000);
    RingConsumer::Taken t = c.Take();
    REQUIRE(t.kind == RingConsumer::Taken::kCorrupt);
    REQUIRE(t.counted);
    REQUIRE(t.error.message().find("submit_tail 1000 is 1000 entries past head 0; the ring holds 8") != std::string::npos);
    REQUIRE(h.submit_head.value.load() == 1000);
    REQUIRE(c.Take().kind == RingConsumer::Taken::kNone);
  }
  SECTION("a completion head ahead of the tail reads as a full ring: nothing unread is overwritten") {
    h.submit_tail.value.store(1);
    REQUIRE(c.Take().kind == RingConsumer::Taken::kDescriptor);
    h.completion_head.value.store(3);
    c.Post(AnswerTo(Request(0)));
    REQUIRE(c.HasBacklog());
    REQUIRE(h.completion_tail.value.load() == 0);
  }
  SECTION("a wrong layout version is refused by the client end") {
    h.layout_version = flexkv::kRingLayoutVersion + 1;
    auto s = RingSubmitter::Map(std::move(created->memfd), std::move(created->doorbell));
    REQUIRE(s.status().code() == flexkv::StatusCode::kFailedPrecondition);
    REQUIRE(s.status().message().find("versions 4..6") != std::string::npos);
  }
  SECTION("a layout older than the oldest the client speaks is refused") {
    h.layout_version = flexkv::kMinRingLayoutVersion - 1;
    auto s = RingSubmitter::Map(std::move(created->memfd), std::move(created->doorbell));
    REQUIRE(s.status().code() == flexkv::StatusCode::kFailedPrecondition);
  }
  SECTION("a layout-4 daemon's rings are mapped, and say so: its requests carry no first_block or window_keys") {
    h.layout_version = 4;
    auto s = RingSubmitter::Map(std::move(created->memfd), std::move(created->doorbell));
    REQUIRE(s.ok());
    REQUIRE((*s)->layout_version() == 4);
  }
  SECTION("a layout-5 daemon's rings are mapped, and say so: its Loads carry no launch deadline") {
    h.layout_version = 5;
    auto s = RingSubmitter::Map(std::move(created->memfd), std::move(created->doorbell));
    REQUIRE(s.ok());
    REQUIRE((*s)->layout_version() == 5);
  }
}
