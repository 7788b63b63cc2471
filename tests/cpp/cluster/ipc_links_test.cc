// CUDA IPC between processes of one host, on the CPU: the protocol of
// cluster/ipc_links.h run over a fake DeviceIpc whose landing regions are
// host memory and whose handles are addresses (both nodes live in this
// process). Covers: ByteRanges, the envelopes' encoding and refusals,
// training through the IPC path bit-identical to one process (and with a
// slice too small for some payloads, which fall back to host frames), and
// the refusal of malformed notices and releases, none of which reads or
// writes out of bounds. The real CUDA path is tests/python/.../test_cuda_ipc.py.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cluster/byte_ranges.h"
#include "cluster/ipc_links.h"
#include "cluster/two_process_model.h"
#include "forwarding_device.h"
#include "gpu_like_device.h"
#include "mltuner/device_ipc.h"
#include "mltuner/process_node.h"
#include "test_util.h"
#include "wire/ipc_envelope.h"
#include "wire/message.h"

using namespace mltuner;

namespace {

// A landing region in host memory; the handle is its address and size.
// With `not_done_answers` n > 0, WaitDone answers "not done yet" n times
// in every n + 1 queries, as a GPU's reads still running would; with
// `same_device`, every peer's region is on this process's device.
std::atomic<int64_t> not_done_answers_given{0};
class HostIpc final : public DeviceIpc {
 public:
  explicit HostIpc(size_t bytes, int not_done_answers = 0, bool same_device = false)
      : region_(bytes / sizeof(float) + 1, 0.0f), bytes_(bytes), not_done_answers_(not_done_answers),
        same_device_(same_device) {
    handle_.resize(2 * sizeof(uint64_t));
    const auto address = reinterpret_cast<uint64_t>(region_.data());
    const uint64_t size = bytes;
    std::memcpy(&handle_[0], &address, sizeof(address));
    std::memcpy(&handle_[sizeof(address)], &size, sizeof(size));
  }
  float* region() const override { return const_cast<float*>(region_.data()); }
  size_t region_bytes() const override { return bytes_; }
  const std::string& handle() const override { return handle_; }
  Status OpenPeer(int peer, const std::string& handle, size_t region_bytes) override {
    if (handle.size() != 2 * sizeof(uint64_t)) return Status::InvalidArgument("bad fake handle");
    uint64_t address = 0, size = 0;
    std::memcpy(&address, handle.data(), sizeof(address));
    std::memcpy(&size, handle.data() + sizeof(address), sizeof(size));
    if (size != region_bytes) return Status::InvalidArgument("fake handle of another size");
    std::lock_guard<std::mutex> lock(mu_);
    peers_[peer] = {reinterpret_cast<char*>(address), size};
    return Status::Ok();
  }
  Status CopyToPeer(int peer, size_t offset, const void* src, size_t bytes, const DeviceEvent&, int event,
                    DeviceEvent* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (event < 0 || event >= kCopyEvents) return Status::InvalidArgument("no such copy event");
    auto found = peers_.find(peer);
    if (found == peers_.end()) return Status::InvalidArgument("peer not open");
    if (offset > found->second.second || bytes > found->second.second - offset) {
      return Status::InvalidArgument("copy outside the peer's region");
    }
    std::memcpy(found->second.first + offset, src, bytes);
    done->reset();
    return Status::Ok();
  }
  Status PeerWrites(int, int event, DeviceEvent* ready) override {
    if (event < 0 || event >= kCopyEvents) return Status::InvalidArgument("no such copy event");
    ready->reset();
    return Status::Ok();
  }
  Status WaitDone(const DeviceEvent&, int64_t timeout_ms) override {
    if (timeout_ms == 0 && not_done_answers_ > 0 && ++queries_ % (not_done_answers_ + 1) != 0) {
      not_done_answers_given.fetch_add(1);
      return Status::Timeout("not done yet");
    }
    return Status::Ok();
  }
  bool SameDevice(int) const override { return same_device_; }

 private:
  std::vector<float> region_;
  size_t bytes_;
  const int not_done_answers_;
  const bool same_device_;
  std::atomic<int64_t> queries_{0};
  std::string handle_;
  std::mutex mu_;
  std::map<int, std::pair<char*, size_t>> peers_;
};

// The CPU backend, or another device, with HostIpc exports.
class HostIpcDevice final : public ForwardingDevice {
 public:
  explicit HostIpcDevice(std::unique_ptr<Device> inner = NewCpuDevice(), int not_done_answers = 0,
                         bool same_device = false)
      : ForwardingDevice(std::move(inner)), not_done_answers_(not_done_answers), same_device_(same_device) {}
  Status ExportIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) override {
    *out = std::make_unique<HostIpc>(region_bytes, not_done_answers_, same_device_);
    return Status::Ok();
  }

 private:
  const int not_done_answers_;
  const bool same_device_;
};

Config TestConfig() {
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = UpdateRuleKind::kSgd;
  config.update_rule.learning_rate = 0.5f;
  return config;
}

Status MakeHostIpcDevice(int, std::unique_ptr<Device>* out) {
  *out = std::make_unique<HostIpcDevice>();
  return Status::Ok();
}

// The same over a GPU-like device (gpu_like_device.h): the paths a GPU takes.
Status MakeGpuLikeIpcDevice(int, std::unique_ptr<Device>* out) {
  *out = std::make_unique<HostIpcDevice>(std::make_unique<GpuLikeDevice>());
  return Status::Ok();
}

// GPU-like, with releases whose reads are "not done" the first 3 times the
// send thread asks: it holds them and sends what queued behind them.
Status MakeSlowReleaseIpcDevice(int, std::unique_ptr<Device>* out) {
  *out = std::make_unique<HostIpcDevice>(std::make_unique<GpuLikeDevice>(), 3);
  return Status::Ok();
}

// The same, both processes on one device: releases leave in order.
Status MakeSlowReleaseOneDeviceIpcDevice(int, std::unique_ptr<Device>* out) {
  *out = std::make_unique<HostIpcDevice>(std::make_unique<GpuLikeDevice>(), 3, /*same_device=*/true);
  return Status::Ok();
}

// Both nodes export slices of `slice` bytes, open each other's, enable.
testing::NodesSetup LinkBoth(size_t slice) {
  return [slice](std::unique_ptr<ProcessNode>* nodes) {
    std::string handle[2];
    for (int rank = 0; rank < 2; ++rank) ASSERT_OK(nodes[rank]->ExportCudaIpc(slice, &handle[rank]));
    for (int rank = 0; rank < 2; ++rank) ASSERT_OK(nodes[rank]->OpenCudaIpcPeer(1 - rank, handle[1 - rank], slice));
    for (int rank = 0; rank < 2; ++rank) ASSERT_OK(nodes[rank]->EnableCudaIpcPeer(1 - rank));
  };
}

// `clocks` clocks of the test model on two nodes linked by slices of
// `slice` bytes, devices from `make_device`: nothing refused or rejected, and
// both ranks' values the bits of one process's.
testing::TwoNodeRun TrainThroughIpc(const Config& config, const DeviceFactory& make_device, int clocks, size_t slice,
                                    bool batches) {
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, clocks, local);
  testing::TwoNodeRun remote;
  testing::TrainInTwoProcesses(config, make_device, clocks, &remote, {}, false, batches, LinkBoth(slice));
  EXPECT_EQ(remote.refused, 0);
  EXPECT_EQ(remote.rejected, 0);
  for (int rank = 0; rank < 2; ++rank) testing::ExpectSameBits(remote.values[rank], local[rank]);
  return remote;
}

}  // namespace

TEST(ByteRangesPlaceClaimAndFree) {
  ByteRanges ranges(1024);
  uint64_t at = 1;
  ASSERT_TRUE(ranges.FindFree(100, 256, &at));
  EXPECT_EQ(at, 0u);
  ASSERT_OK(ranges.Claim(0, 100));
  ASSERT_TRUE(ranges.FindFree(300, 256, &at));
  EXPECT_EQ(at, 256u);
  ASSERT_OK(ranges.Claim(256, 300));
  ASSERT_TRUE(ranges.FindFree(256, 256, &at));
  EXPECT_EQ(at, 768u);
  EXPECT_TRUE(!ranges.FindFree(257, 256, &at));  // 768 + 257 > 1024; the gap 100..256 is too small
  ASSERT_OK(ranges.Free(0, 100));
  ASSERT_TRUE(ranges.FindFree(256, 256, &at));
  EXPECT_EQ(at, 0u);  // first fit, out of order release
  EXPECT_EQ(ranges.used_bytes(), 300u);
  EXPECT_TRUE(!ranges.FindFree(2048, 256, &at));
  EXPECT_TRUE(!ranges.FindFree(0, 256, &at));
}

TEST(ByteRangesRefuseWhatNoSenderMayClaim) {
  ByteRanges ranges(1024);
  ASSERT_OK(ranges.Claim(256, 256));
  EXPECT_CODE(ranges.Claim(0, 0), StatusCode::kCorruptMessage);                   // empty
  EXPECT_CODE(ranges.Claim(1000, 100), StatusCode::kCorruptMessage);              // past the end
  EXPECT_CODE(ranges.Claim(2048, 4), StatusCode::kCorruptMessage);                // starts past the end
  EXPECT_CODE(ranges.Claim(UINT64_MAX - 3, 8), StatusCode::kCorruptMessage);      // wraps around
  EXPECT_CODE(ranges.Claim(8, UINT64_MAX - 4), StatusCode::kCorruptMessage);      // wraps around
  EXPECT_CODE(ranges.Claim(200, 100), StatusCode::kCorruptMessage);               // overlaps from below
  EXPECT_CODE(ranges.Claim(300, 4), StatusCode::kCorruptMessage);                 // inside
  EXPECT_CODE(ranges.Claim(500, 100), StatusCode::kCorruptMessage);               // overlaps from above
  EXPECT_CODE(ranges.Free(256, 255), StatusCode::kCorruptMessage);                // not the claimed range
  EXPECT_CODE(ranges.Free(0, 4), StatusCode::kCorruptMessage);                    // never claimed
  ASSERT_OK(ranges.Claim(0, 256));                                                // adjacent is fine
  ASSERT_OK(ranges.Claim(512, 512));
  EXPECT_EQ(ranges.used_bytes(), 1024u);
}

TEST(IpcEnvelopesRoundTripAndRefuseMalformedFrames) {
  Message inner = NewMessage(MessageType::kRows, 1, 0, 3);
  inner.header.row_width = 2;
  inner.spans = {{0, 4}};
  inner.header.num_spans = 1;
  const std::string inner0 = EncodeHeaderFrame(inner);
  const std::string notice = EncodeIpcNotice(1, 0, IpcSpan{512, 32, 5}, inner0);
  ASSERT_TRUE(IsIpcEnvelope(notice.data(), notice.size()));
  IpcEnvelope envelope;
  ASSERT_OK(DecodeIpcEnvelope(notice.data(), notice.size(), 0, &envelope));
  EXPECT_TRUE(envelope.type == MessageType::kIpcNotice);
  EXPECT_EQ(envelope.sender, 1);
  EXPECT_EQ(envelope.receiver, 0);
  EXPECT_EQ(envelope.span.offset, 512u);
  EXPECT_EQ(envelope.span.bytes, 32u);
  EXPECT_EQ(envelope.span.event, 5u);
  ASSERT_TRUE(envelope.inner_bytes == inner0.size());
  EXPECT_TRUE(std::memcmp(envelope.inner, inner0.data(), inner0.size()) == 0);
  const std::string release = EncodeIpcRelease(0, 1, IpcSpan{512, 32});
  ASSERT_OK(DecodeIpcEnvelope(release.data(), release.size(), 0, &envelope));
  EXPECT_TRUE(envelope.type == MessageType::kIpcRelease);
  EXPECT_TRUE(envelope.inner == nullptr);

  // A payload frame beside an envelope, a truncated or lengthened frame 0,
  // a release with more than its span, a notice without its message.
  EXPECT_CODE(DecodeIpcEnvelope(notice.data(), notice.size(), 4, &envelope), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeIpcEnvelope(notice.data(), notice.size() - 1, 0, &envelope), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeIpcEnvelope((notice + "x").data(), notice.size() + 1, 0, &envelope), StatusCode::kCorruptMessage);
  std::string long_release = EncodeIpcNotice(0, 1, IpcSpan{0, 4}, "abcd");
  long_release[6] = static_cast<char>(MessageType::kIpcRelease);  // the type field (little-endian uint16)
  EXPECT_CODE(DecodeIpcEnvelope(long_release.data(), long_release.size(), 0, &envelope), StatusCode::kCorruptMessage);
  const std::string empty_notice = EncodeIpcNotice(1, 0, IpcSpan{0, 4}, "");
  EXPECT_CODE(DecodeIpcEnvelope(empty_notice.data(), empty_notice.size(), 0, &envelope), StatusCode::kCorruptMessage);
  // An envelope is never one message: DecodeMessage refuses it.
  Message decoded;
  EXPECT_CODE(DecodeMessage(notice.data(), notice.size(), nullptr, 0, &decoded), StatusCode::kCorruptMessage);
}

// Each payload out records a copy event no other payload out uses, so a
// receiver's wait covers its own copy and none queued after it; with every
// event of its lane in use, one is shared (a longer wait, never a wrong one:
// the lane's copies share a stream), never one of another lane's, and an
// event comes free when its payload's release does. A release naming an
// event its payload did not use is refused.
TEST(EachPayloadOutWaitsOnItsOwnCopyEvent) {
  std::shared_ptr<Device> devices[2] = {std::make_shared<HostIpcDevice>(), std::make_shared<HostIpcDevice>()};
  std::unique_ptr<IpcLinks> links[2];
  std::string handle[2];
  constexpr size_t kSlice = 64 << 10;
  for (int rank = 0; rank < 2; ++rank) {
    links[rank] = std::make_unique<IpcLinks>(rank, 2, devices[rank]);
    ASSERT_OK(links[rank]->Export(kSlice, &handle[rank]));
  }
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_OK(links[rank]->OpenPeer(1 - rank, handle[1 - rank], kSlice));
    ASSERT_OK(links[rank]->Enable(1 - rank));
  }
  std::vector<float> values(64, 1.0f);
  DeviceBuffer buffer;
  buffer.data = values.data();
  buffer.count = values.size();
  const auto send = [&](OutgoingMessage::Lane lane, IpcSpan* span) {
    std::string notice;
    bool sent = false;
    ASSERT_OK(links[0]->TrySend(1, lane, &buffer, EncodeHeaderFrame(NewMessage(MessageType::kRows, 0, 1, 0)),
                                &notice, &sent));
    ASSERT_TRUE(sent);
    IpcEnvelope envelope;
    ASSERT_OK(DecodeIpcEnvelope(notice.data(), notice.size(), 0, &envelope));
    *span = envelope.span;
  };
  const auto release = [&](const IpcSpan& span) {
    const std::string frame0 = EncodeIpcRelease(1, 0, span);
    IpcEnvelope envelope;
    EXPECT_OK(DecodeIpcEnvelope(frame0.data(), frame0.size(), 0, &envelope));
    return links[0]->OnRelease(envelope);
  };
  const auto in_lane = [](const IpcSpan& span, OutgoingMessage::Lane lane) {
    return span.event < static_cast<uint64_t>(DeviceIpc::kCopyEvents) &&
           DeviceIpc::LaneOf(static_cast<int>(span.event)) == IpcLinks::EventLane(lane);
  };
  const OutgoingMessage::Lane lane = OutgoingMessage::Lane::kToEngine;
  std::vector<IpcSpan> out(DeviceIpc::kEventsPerLane);
  std::vector<bool> seen(DeviceIpc::kCopyEvents, false);
  for (IpcSpan& span : out) {
    send(lane, &span);
    ASSERT_TRUE(in_lane(span, lane));
    EXPECT_TRUE(!seen[span.event]);  // none shared while one is free
    seen[span.event] = true;
  }
  // The other lane's events are its own: free although this lane's are not.
  IpcSpan other;
  send(OutgoingMessage::Lane::kToShard, &other);
  EXPECT_TRUE(in_lane(other, OutgoingMessage::Lane::kToShard));
  ASSERT_OK(release(other));
  IpcSpan shared;
  send(lane, &shared);  // every event of the lane in use: one of them is shared
  ASSERT_TRUE(in_lane(shared, lane));
  const size_t freed = out[0].event == shared.event ? 1 : 0;  // a payload whose event nothing else uses
  const size_t kept = freed + 1;
  ASSERT_OK(release(out[freed]));
  // A release naming the event that just came free (not its payload's).
  EXPECT_CODE(release(IpcSpan{out[kept].offset, out[kept].bytes, out[freed].event}), StatusCode::kCorruptMessage);
  IpcSpan again;
  send(lane, &again);
  EXPECT_EQ(again.event, out[freed].event);  // the one event free again
  ASSERT_OK(release(out[kept]));  // the refused release left its range out
}

TEST(TrainingThroughIpcIsBitIdenticalToOneProcess) {
  constexpr int kClocks = 16;
  // On the CPU backend, and on a GPU-like device: a GPU's paths.
  for (const DeviceFactory& make_device : {DeviceFactory(MakeHostIpcDevice), DeviceFactory(MakeGpuLikeIpcDevice)}) {
    const testing::TwoNodeRun remote =
        TrainThroughIpc(TestConfig(), make_device, kClocks, size_t{1} << 20, /*batches=*/true);
    for (int rank = 0; rank < 2; ++rank) {
      const IpcStats& ipc = remote.ipc[rank];
      const IpcStats& peer = remote.ipc[1 - rank];
      // Every device payload went device -> device: updates and rows of two
      // tables each clock, none by a host frame.
      EXPECT_TRUE(ipc.sent_messages >= 4 * kClocks);
      // The shard's rows leave from its state, with no copy first.
      EXPECT_TRUE(ipc.sent_from_views >= 2 * kClocks);
      EXPECT_TRUE(ipc.sent_from_views < ipc.sent_messages);  // the updates come from buffers of their own
      EXPECT_EQ(ipc.fallbacks, 0);
      EXPECT_EQ(remote.by_host[rank], 0);
      EXPECT_EQ(ipc.sent_bytes, peer.received_bytes);
      EXPECT_EQ(ipc.sent_messages, peer.received_messages);
      // Landed payloads go back to their senders once read (the last few
      // may still be on the wire when it stops).
      EXPECT_TRUE(ipc.releases_received > 0 && ipc.releases_received <= ipc.sent_messages);
      EXPECT_TRUE(peer.releases_sent >= ipc.releases_received);
    }
  }
}

// Releases whose reads are still running: held aside (the messages behind
// them leave first) for a peer on another device, waited for in order for
// one on this device. Both train bit-identically to one process.
TEST(ReleasesWaitingForTheirReadsAreHeldAsideOnlyForAnotherDevice) {
  const Config config = TestConfig();
  constexpr int kClocks = 16;
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local);
  for (const bool same_device : {false, true}) {
    not_done_answers_given = 0;
    testing::TwoNodeRun remote;
    testing::TrainInTwoProcesses(config, same_device ? MakeSlowReleaseOneDeviceIpcDevice : MakeSlowReleaseIpcDevice,
                                 kClocks, &remote, {}, false, /*batches=*/true, LinkBoth(size_t{1} << 20));
    // Held releases are asked "done yet?"; in-order ones are waited for.
    EXPECT_EQ(not_done_answers_given.load() > 0, !same_device);
    EXPECT_EQ(remote.rejected, 0);
    for (int rank = 0; rank < 2; ++rank) {
      testing::ExpectSameBits(remote.values[rank], local[rank]);
      const IpcStats& ipc = remote.ipc[rank];
      EXPECT_EQ(ipc.fallbacks, 0);  // every range came back in time for the next clock's payloads
      EXPECT_TRUE(ipc.releases_received > 0 && remote.ipc[1 - rank].releases_sent >= ipc.releases_received);
    }
  }
}

TEST(PayloadsThatDoNotFitTheSliceFallBackToHostFrames) {
  // 256 bytes: the update of table b's slice (7 rows x 5 floats = 140 bytes)
  // fits one at a time; table a's (20 rows x 7 floats = 560) never does.
  const testing::TwoNodeRun remote = TrainThroughIpc(TestConfig(), MakeHostIpcDevice, 8, 256, false);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(remote.ipc[rank].sent_messages > 0);
    EXPECT_TRUE(remote.ipc[rank].fallbacks > 0);
    EXPECT_TRUE(remote.by_host[rank] > 0);
  }
}

// A slice more than half held copies each payload landing in it out to
// pooled device memory and gives the range back at once; payloads that find
// room stay in place. 1,024 bytes: table a's update slice (560 bytes) is
// more than half of it on its own.
TEST(PayloadsLandingInACrowdedSliceAreCopiedOut) {
  for (const DeviceFactory& make_device : {DeviceFactory(MakeHostIpcDevice), DeviceFactory(MakeGpuLikeIpcDevice)}) {
    const testing::TwoNodeRun remote = TrainThroughIpc(TestConfig(), make_device, 8, 1024, false);
    for (int rank = 0; rank < 2; ++rank) {
      const IpcStats& ipc = remote.ipc[rank];
      EXPECT_TRUE(ipc.copied_out_messages > 0);
      EXPECT_TRUE(ipc.copied_out_messages < ipc.received_messages);  // table b's alone fit in place
      EXPECT_TRUE(ipc.copied_out_bytes > 0 && ipc.copied_out_bytes < ipc.received_bytes);
      EXPECT_EQ(ipc.sent_bytes, remote.ipc[1 - rank].received_bytes);
    }
  }
}

TEST(MalformedNoticesAndReleasesAreRefusedNeverRead) {
  std::unique_ptr<ProcessNode> nodes[2];
  for (int rank = 0; rank < 2; ++rank) {
    std::unique_ptr<Device> device;
    ASSERT_OK(MakeHostIpcDevice(rank, &device));
    ASSERT_OK(ProcessNode::Create(TestConfig(), rank, 2, std::move(device), &nodes[rank]));
  }
  LinkBoth(1024)(nodes);
  ProcessNode& node = *nodes[0];
  // A rows message of 4 rows x 2 floats = 32 bytes, "from" rank 1.
  Message rows = NewMessage(MessageType::kRows, 1, 0, 0);
  rows.header.row_width = 2;
  rows.spans = {{0, 4}};
  rows.header.num_spans = 1;
  const std::string inner = EncodeHeaderFrame(rows);
  const auto deliver = [&](const std::string& frame0) { return node.Deliver(frame0.data(), frame0.size(), nullptr, 0); };
  int refused = 0;
  const auto refuses = [&](const std::string& frame0) {
    const Status status = deliver(frame0);
    ++refused;
    return status.code() == StatusCode::kCorruptMessage;
  };
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{1024, 32}, inner)));                // starts at the slice's end
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{1000, 32}, inner)));                // runs past it
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{UINT64_MAX - 15, 32}, inner)));     // wraps around
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{2, 32}, inner)));                   // not float-aligned
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{0, 36}, inner)));                   // size != the spans' rows
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{0, UINT64_MAX - 3}, inner)));       // absurd size
  EXPECT_TRUE(refuses(EncodeIpcNotice(0, 0, IpcSpan{0, 32}, inner)));                   // from itself
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 1, IpcSpan{0, 32}, inner)));                   // for another rank
  EXPECT_TRUE(refuses(EncodeIpcNotice(7, 0, IpcSpan{0, 32}, inner)));                   // from no rank
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{0, 32, DeviceIpc::kCopyEvents}, inner)));  // no such event
  Message spoofed = rows;
  spoofed.header.sender = 0;
  EXPECT_TRUE(refuses(EncodeIpcNotice(1, 0, IpcSpan{0, 32}, EncodeHeaderFrame(spoofed))));  // inner sender differs
  EXPECT_TRUE(refuses(EncodeIpcRelease(1, 0, IpcSpan{0, 32})));                         // releases nothing sent
  EXPECT_EQ(node.rejected_messages(), refused);
  // A node whose peer has no IPC enabled refuses every notice.
  std::unique_ptr<ProcessNode> plain;
  ASSERT_OK(ProcessNode::Create(TestConfig(), 0, 2, nullptr, &plain));
  const std::string valid = EncodeIpcNotice(1, 0, IpcSpan{0, 32}, inner);
  EXPECT_CODE(plain->Deliver(valid.data(), valid.size(), nullptr, 0), StatusCode::kCorruptMessage);
  EXPECT_EQ(plain->rejected_messages(), 1);
  std::string handle;
  ASSERT_OK(plain->ExportCudaIpc(1024, &handle));  // a CPU device exports shared memory (memfd)
  EXPECT_CODE(plain->EnableCudaIpcPeer(1), StatusCode::kInvalidArgument);  // but the peer's is not open
  EXPECT_TRUE(plain->cuda_ipc_peers().empty());
}

MLT_TEST_MAIN
