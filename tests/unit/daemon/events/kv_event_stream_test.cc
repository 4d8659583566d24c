// KvEventStream (daemon/events/kv_event_stream.h): appends only while someone subscribes, sequence numbers, a reader
// that falls behind the ring is cut off saying how far, and a snapshot's per-source marks skip exactly the events it
// already holds.
#include "daemon/events/kv_event_stream.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>
#include <vector>

namespace flexkv {
namespace {

KvEvent Stored(uint64_t lo, uint16_t source = 0) {
  KvEvent e;
  e.key = BlockKey{lo, 1};
  e.source = source;
  e.kind = KvEventKind::kStored;
  return e;
}

}  // namespace

TEST_CASE("kv event stream: nothing is appended while no one subscribes, then events are numbered from 1", "[unit]") {
  KvEventStream stream(64, 7);
  CHECK_FALSE(stream.active());
  stream.Append(Stored(1));
  CHECK(stream.last_seq() == 0);
  KvEventStream::Reader reader(&stream);
  reader.StartAtHead();
  CHECK(stream.active());
  stream.Append(Stored(2));
  stream.Append(Stored(3));
  std::vector<KvEvent> out;
  uint64_t behind = 0;
  REQUIRE(reader.Read(10, &out, &behind) == KvEventStream::Reader::Result::kOk);
  REQUIRE(out.size() == 2);
  CHECK(out[0].seq == 1);
  CHECK(out[0].key.lo == 2);
  CHECK(out[1].seq == 2);
  CHECK(reader.position() == 2);
  out.clear();
  REQUIRE(reader.Read(10, &out, &behind) == KvEventStream::Reader::Result::kOk);
  CHECK(out.empty());
}

TEST_CASE("kv event stream: a reader further behind than the ring is cut off with how far behind it was", "[unit]") {
  KvEventStream stream(64, 7);  // 64 events
  KvEventStream::Reader slow(&stream);
  slow.StartAtHead();
  KvEventStream::Reader fast(&stream);
  fast.StartAtHead();
  std::vector<KvEvent> out;
  uint64_t behind = 0;
  for (uint64_t i = 0; i < 100; ++i) {
    stream.Append(Stored(i));
    if (i % 10 == 9) REQUIRE(fast.Read(1000, &out, &behind) == KvEventStream::Reader::Result::kOk);
  }
  CHECK(out.size() == 100);  // a reader that keeps up gets every event
  std::vector<KvEvent> lost;
  REQUIRE(slow.Read(1000, &lost, &behind) == KvEventStream::Reader::Result::kOverrun);
  CHECK(behind == 100);
  CHECK(stream.cut_off() == 1);
  stream.Close();
  CHECK(fast.Read(1000, &out, &behind) == KvEventStream::Reader::Result::kClosed);
}

TEST_CASE("kv event stream: a snapshot holds each source's events up to its mark and the reader skips exactly those",
          "[unit]") {
  KvEventStream stream(1024, 7);
  KvEventStream::Reader other(&stream);  // keeps the stream active
  other.StartAtHead();
  // Source 0 marks early, source 1 late: the events of source 1 between the two marks are in the snapshot, those of
  // source 0 are not.
  KvEventStream* s = &stream;
  const uint16_t a = stream.AddSource([s](KvEventStream::SnapshotSink& sink) {
    sink.Mark();
    sink.Add(KvTier::kDram, 0, BlockKey{100, 0}, BlockKey{});
    s->Append(Stored(1, 1));  // appended "by source 1" after source 0 marked
    s->Append(Stored(2, 0));  // source 0's own event after its mark (a concurrent store would do this)
  });
  const uint16_t b = stream.AddSource([](KvEventStream::SnapshotSink& sink) {
    sink.Mark();
    sink.Add(KvTier::kSsd, 0, BlockKey{200, 0}, BlockKey{});
  });
  CHECK(a == 0);
  CHECK(b == 1);
  stream.Append(Stored(0, 0));  // before the snapshot: in it (seq 1)
  KvEventStream::Reader reader(&stream);
  const KvEventStream::Snapshot snap = reader.TakeSnapshot();
  REQUIRE(snap.blocks.size() == 2);
  CHECK(snap.marks[0] == 1);
  CHECK(snap.marks[1] == 3);
  CHECK(snap.seq == 1);
  stream.Append(Stored(3, 1));  // after both marks
  std::vector<KvEvent> out;
  uint64_t behind = 0;
  REQUIRE(reader.Read(100, &out, &behind) == KvEventStream::Reader::Result::kOk);
  // seq 2 (source 1, before its mark) is skipped; seq 3 (source 0, after its mark) and seq 4 follow.
  REQUIRE(out.size() == 2);
  CHECK(out[0].seq == 3);
  CHECK(out[0].key.lo == 2);
  CHECK(out[1].seq == 4);
  CHECK(reader.position() == 4);
}

TEST_CASE("kv event stream: domains are interned once and an unknown namespace hash gets a stable name", "[unit]") {
  KvEventStream stream(64, 7);
  const uint16_t d = stream.InternDomain("llama", 16);
  CHECK(stream.InternDomain("llama", 16) == d);
  CHECK(stream.Domain(d).model_namespace == "llama");
  CHECK(stream.Domain(d).tokens_per_block == 16);
  const uint16_t unknown = stream.DomainByHash(0x1234);
  CHECK(stream.Domain(unknown).model_namespace == "#0000000000001234");
  CHECK(stream.DomainByHash(0x1234) == unknown);
}

}  // namespace flexkv

namespace flexkv {

// The gRPC subscriptions' feeder sleeps in WaitForEvents (issue 29 item 4: no thread per stream, no 5 ms polling).
TEST_CASE("kv event stream: WaitForEvents returns at an append, a Wake, a Close or its timeout", "[unit]") {
  KvEventStream stream(64, 7);
  KvEventStream::Reader reader(&stream);
  reader.StartAtHead();
  using namespace std::chrono_literals;
  // Its timeout, with nothing new.
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(stream.WaitForEvents(0, 20ms));
  CHECK(std::chrono::steady_clock::now() - t0 >= 20ms);
  // An event already there: at once.
  stream.Append(Stored(1));
  CHECK(stream.WaitForEvents(0, 10s));
  // An append from another thread ends the wait (the test would take 10 s otherwise).
  std::thread appender([&] {
    std::this_thread::sleep_for(20ms);
    stream.Append(Stored(2));
  });
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(stream.WaitForEvents(1, 10s));
  CHECK(std::chrono::steady_clock::now() - t1 < 5s);
  appender.join();
  // A Wake ends it without an event; one that came before the wait is not lost.
  stream.Wake();
  CHECK_FALSE(stream.WaitForEvents(2, 10s));
  // Waiting for a Wake only: an append does not end it.
  std::thread late_appender([&] {
    std::this_thread::sleep_for(5ms);
    stream.Append(Stored(3));
  });
  const auto t3 = std::chrono::steady_clock::now();
  CHECK_FALSE(stream.WaitForEvents(std::nullopt, 100ms));
  CHECK(std::chrono::steady_clock::now() - t3 >= 100ms);
  late_appender.join();
  std::thread waker([&] {
    std::this_thread::sleep_for(20ms);
    stream.Close();
  });
  const auto t2 = std::chrono::steady_clock::now();
  CHECK_FALSE(stream.WaitForEvents(3, 10s));
  CHECK(std::chrono::steady_clock::now() - t2 < 5s);
  waker.join();
  CHECK_FALSE(stream.WaitForEvents(3, 10s));  // closed: at once
}

TEST_CASE("kv event stream: a reader reads into a vector whose large blocks are mappings of their own", "[unit]") {
  KvEventStream stream(4096, 7);
  KvEventStream::Reader reader(&stream);
  reader.StartAtHead();
  for (uint64_t i = 0; i < 3000; ++i) stream.Append(Stored(i));
  KvEventVector out;  // 3000 events of 48 B: past the 64 KiB at which the allocator maps
  uint64_t behind = 0;
  REQUIRE(reader.Read(4096, &out, &behind) == KvEventStream::Reader::Result::kOk);
  REQUIRE(out.size() == 3000);
  CHECK(out.front().key.lo == 0);
  CHECK(out.back().key.lo == 2999);
  CHECK(out.back().seq == 3000);
  KvEventVector().swap(out);  // unmapped here
  CHECK(out.empty());
}

}  // namespace flexkv
