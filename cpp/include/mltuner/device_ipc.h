// DeviceIpc: device memory and an event shared with other processes of one
// host (CUDA IPC), so payloads between their engines and shards go device ->
// device instead of through pinned host frames and a socket.
//
// Each process exports one landing region (device memory peers copy into)
// and kCopyEvents interprocess events (the caller names one to record after
// each copy it makes into a peer's region). A peer opens them all from
// handle(): it writes into this region and this process waits on the event
// that peer named before reading what it wrote. Several events, not one: a
// wait takes an event's latest record, so with one event a receiver would
// also wait for every copy the sender queued after the one it reads (a
// clock's pushed rows behind its update, or the next parts of a table).
// Which bytes are whose, which event a copy records, and when either may be
// used again, is the caller's business (cluster/ipc_links.h).
//
// Thread safety: every method may be called from any thread.
// Ownership: made by Device::ExportIpc; destroy it before its Device. The
// tickets it hands out may outlive it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner {

class DeviceIpc {
 public:
  // Interprocess events each process exports (their handles are in
  // handle(), so this bounds the rendezvous card: 64 bytes each).
  static constexpr int kCopyEvents = 32;
  // The copies travel in lanes, each on a stream of its own at both ends, so
  // a payload whose producer is late (an update, behind the application's
  // backward pass) never holds back another lane's (a shard's rows, which a
  // worker needs before that pass ends at slack >= 1). Each copy event
  // belongs to one lane, so it is only ever recorded on that lane's stream.
  static constexpr int kLanes = 2;
  static constexpr int kEventsPerLane = kCopyEvents / kLanes;
  static constexpr int LaneOf(int event) { return event / kEventsPerLane; }

  virtual ~DeviceIpc() = default;
  DeviceIpc(const DeviceIpc&) = delete;
  DeviceIpc& operator=(const DeviceIpc&) = delete;

  // This process's landing region, and the bytes peers pass to OpenPeer.
  virtual float* region() const = 0;
  virtual size_t region_bytes() const = 0;
  virtual const std::string& handle() const = 0;

  // Opens peer `peer`'s export (its region of `region_bytes`, its event).
  // Fails with the driver's reason where IPC is unavailable (another
  // container, no peer access between the GPUs, a malformed handle).
  virtual Status OpenPeer(int peer, const std::string& handle, size_t region_bytes) = 0;
  // Queues, after the work of ticket `after`, the copy of `bytes` from `src`
  // (this device's memory) to byte `offset` of peer's region, then records
  // this process's event `event` (in [0, kCopyEvents)), all on the stream
  // of the event's lane; *done: a ticket
  // complete after the copy. InvalidArgument when the peer is not open, the
  // range is outside its region or there is no such event.
  virtual Status CopyToPeer(int peer, size_t offset, const void* src, size_t bytes, const DeviceEvent& after,
                            int event, DeviceEvent* done) = 0;
  // *ready: a ticket of this device complete once everything `peer`
  // recorded on its event `event` so far is (what a notice received from it
  // announces was queued before its notice was sent). InvalidArgument when
  // the peer is not open or there is no such event.
  virtual Status PeerWrites(int peer, int event, DeviceEvent* ready) = 0;
  // Blocks until ticket `event` (of this device) completes, for at most
  // timeout_ms, then kTimeout (0: a query, never a wait).
  virtual Status WaitDone(const DeviceEvent& event, int64_t timeout_ms) = 0;
  // Whether open peer `peer`'s region lives on this process's device (two
  // processes time-sharing one GPU). Default: no.
  virtual bool SameDevice(int /*peer*/) const { return false; }

 protected:
  DeviceIpc() = default;
};

}  // namespace mltuner
