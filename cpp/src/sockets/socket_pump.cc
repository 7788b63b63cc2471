#include "mltuner/socket_pump.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "cluster/hop_log.h"
#include "common/mutex.h"
#include "common/thread_name.h"
#include "sockets/zmq_api.h"

namespace mltuner {
namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr int kPollMs = 50;
// While the node reads received payloads in place, the receive thread
// looks for handed-back tokens this often even when nothing arrives.
constexpr int kLentPollMs = 2;
// One wake-up of the send thread takes at most this many messages, and past
// the first at most this many payload bytes (the node batches small ones).
constexpr size_t kTakeMessages = 256;
constexpr size_t kTakeBytes = size_t{1} << 20;
// Smaller payloads are copied into ZeroMQ's message (cheaper than the free
// callback for a few KiB, as pyzmq decides too); larger ones are sent from
// where they lie and count against the peer's queue bound.
constexpr size_t kZeroCopyMinBytes = size_t{64} << 10;
// Received payloads below this share ZeroMQ's receive buffer at any byte
// offset, which a float array may not have: the node copies those anyway.
constexpr size_t kLendMinBytes = size_t{8} << 10;
constexpr int kDrainPerWake = 256;
constexpr size_t kKeptRefusals = 16;
// How long a stopping pump still tries to hand queued messages to ZeroMQ.
constexpr auto kStopGrace = std::chrono::seconds(1);

// The bytes handed to ZeroMQ per peer and not yet out. Shared with the free
// callbacks, which ZeroMQ's I/O thread may run after the pump is gone.
struct QueueCounts {
  Mutex mu;
  CondVar room{&mu};
  std::map<int, int64_t> queued GUARDED_BY(mu);
  std::map<int, int64_t> peak GUARDED_BY(mu);
};

// A zero-copy payload in ZeroMQ's hands: the message that owns the bytes.
struct SentPayload {
  OutgoingMessage message;
  std::shared_ptr<QueueCounts> counts;
  int64_t bytes = 0;
};

void FreeSentPayload(void* /*data*/, void* hint) {
  auto* sent = static_cast<SentPayload*>(hint);
  {
    MutexLock lock(&sent->counts->mu);
    sent->counts->queued[sent->message.receiver] -= sent->bytes;
  }
  sent->counts->room.NotifyAll();
  delete sent;  // a host frame goes back to its pool here
}

}  // namespace

class SocketPump::Impl {
 public:
  Impl(ProcessNode* node, const ZmqApi* zmq, SocketPumpOptions options)
      : node_(node), zmq_(*zmq), options_(std::move(options)), queue_limit_(options_.queue_limit_bytes),
        lends_(node->lends_payloads()) {
    MutexLock lock(&counts_->mu);
    for (const auto& peer : options_.peers) {
      counts_->queued[peer.first] = 0;
      counts_->peak[peer.first] = 0;
    }
  }

  ~Impl() {
    Stop();
    for (auto& lent : lent_) zmq_.msg_close(lent.second.get());
  }

  void Start() {
    send_thread_ = std::thread([this] { SendLoop(); });
    receive_thread_ = std::thread([this] { ReceiveLoop(); });
  }

  void Stop() {
    {
      MutexLock lock(&mu_);
      if (!stopping_.load()) stop_deadline_ = SteadyClock::now() + kStopGrace;
      stopping_ = true;
    }
    counts_->room.NotifyAll();
    if (send_thread_.joinable()) send_thread_.join();
    if (receive_thread_.joinable()) receive_thread_.join();
  }

  void SetQueueLimit(int64_t bytes) {
    queue_limit_ = bytes;
    counts_->room.NotifyAll();
  }

  SocketPumpStats stats() const {
    SocketPumpStats out;
    {
      MutexLock lock(&counts_->mu);
      out.queued_bytes = counts_->queued;
      out.peak_queued_bytes = counts_->peak;
    }
    out.lent_payloads = lent_count_.load();
    out.refused_messages = refused_.load();
    out.sent_messages = sent_.load();
    out.received_messages = received_.load();
    out.stalls = stalls_.load();
    return out;
  }

  std::vector<std::string> TakeRefusals() {
    MutexLock lock(&mu_);
    std::vector<std::string> out(refusals_.begin(), refusals_.end());
    refusals_.clear();
    return out;
  }

  std::string stuck() const {
    MutexLock lock(&mu_);
    return stuck_;
  }

  void StallNextDelivery(int64_t min_payload_bytes, int64_t milliseconds) {
    stall_ms_ = milliseconds;
    stall_min_bytes_ = min_payload_bytes;
  }

 private:
  // True once the node is aborted, or a stop's grace has run out.
  bool GiveUp() {
    if (node_->aborted()) return true;
    if (!stopping_.load()) return false;
    MutexLock lock(&mu_);
    return SteadyClock::now() >= stop_deadline_;
  }

  // -- sending ------------------------------------------------------------------
  void SendLoop() {
    NameThisThread("mlt-send");
    while (true) {
      const auto started = SteadyClock::now();
      std::vector<OutgoingMessage> taken = node_->NextOutgoingBatch(kPollMs, kTakeMessages, kTakeBytes);
      if (taken.empty()) {
        if (stopping_.load()) return;
        // A closed, drained outbox answers at once: do not spin on it.
        if (SteadyClock::now() - started < std::chrono::milliseconds(1)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        continue;
      }
      for (OutgoingMessage& message : taken) Send(std::move(message));
    }
  }

  void Send(OutgoingMessage&& message) {
    const int receiver = message.receiver;
    HopLog::Record(node_->rank(), "socket", receiver, message.header.size() + message.payload_bytes());
    const auto peer = options_.peers.find(receiver);
    if (peer == options_.peers.end()) {
      node_->Abort(Status::Internal("the send thread has no socket for rank " + std::to_string(receiver)));
      return;
    }
    const size_t bytes = message.payload_bytes();
    if (!WaitForRoom(receiver, static_cast<int64_t>(bytes))) return;
    ZmqMessage header;
    ZmqMessage payload;
    zmq_.msg_init_size(&header, message.header.size());
    std::memcpy(zmq_.msg_data(&header), message.header.data(), message.header.size());
    if (bytes >= kZeroCopyMinBytes) {
      auto* sent = new SentPayload{std::move(message), counts_, static_cast<int64_t>(bytes)};
      {
        MutexLock lock(&counts_->mu);
        int64_t& queued = counts_->queued[receiver];
        queued += sent->bytes;
        counts_->peak[receiver] = std::max(counts_->peak[receiver], queued);
      }
      // ZeroMQ calls FreeSentPayload once the bytes are out (or the send fails).
      if (zmq_.msg_init_data(&payload, const_cast<float*>(sent->message.payload_values()), bytes, &FreeSentPayload,
                             sent) != 0) {
        const std::string why = zmq_.Describe(zmq_.errno_());
        FreeSentPayload(nullptr, sent);
        zmq_.msg_close(&header);
        node_->Abort(Status::ResourceExhausted("the send thread could not make a message: " + why));
        return;
      }
    } else {
      zmq_.msg_init_size(&payload, bytes);
      if (bytes > 0) std::memcpy(zmq_.msg_data(&payload), message.payload_values(), bytes);
    }
    if (SendFrames(receiver, peer->second, &header, &payload)) sent_.fetch_add(1);
  }

  // Waits until peer `receiver`'s queue can take `bytes` more (or is empty).
  bool WaitForRoom(int receiver, int64_t bytes) {
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(options_.wait_timeout_ms);
    int64_t waiting = 0;
    {
      MutexLock lock(&counts_->mu);
      while (true) {
        const int64_t limit = queue_limit_.load();
        waiting = counts_->queued[receiver];
        if (waiting == 0 || limit <= 0 || waiting + bytes <= limit) return true;
        if (node_->aborted() || SteadyClock::now() >= deadline) break;
        if (stopping_.load()) return false;  // a stop does not wait for a full queue
        counts_->room.WaitFor(std::chrono::milliseconds(kPollMs));
      }
    }
    if (!node_->aborted()) DeclareStuck(receiver, waiting);
    return false;
  }

  // Sends both frames (each taken over by ZeroMQ, or closed here).
  bool SendFrames(int receiver, void* socket, ZmqMessage* header, ZmqMessage* payload) {
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(options_.wait_timeout_ms);
    ZmqMessage* parts[2] = {header, payload};
    for (int i = 0; i < 2; ++i) {
      const int flags = (i == 0 ? ZmqApi::kSendMore : 0) | ZmqApi::kDontWait;
      while (zmq_.msg_send(parts[i], socket, flags) < 0) {
        const int error = zmq_.errno_();
        std::string failure;
        if (error != EAGAIN) {
          failure = "sending to worker rank " + std::to_string(receiver) + " failed: " + zmq_.Describe(error);
        } else if (!GiveUp() && SteadyClock::now() < deadline) {
          // Full: wait for room without holding anything but this thread.
          ZmqPollItem item{socket, 0, ZmqApi::kPollOut, 0};
          zmq_.poll(&item, 1, kPollMs);
          continue;
        }
        for (int j = i; j < 2; ++j) zmq_.msg_close(parts[j]);
        if (GiveUp()) return false;
        if (!failure.empty()) {
          node_->Abort(Status::PeerLost(failure));
        } else {
          int64_t waiting = 0;
          {
            MutexLock lock(&counts_->mu);
            waiting = counts_->queued[receiver];
          }
          DeclareStuck(receiver, waiting);
        }
        return false;
      }
    }
    return true;
  }

  void DeclareStuck(int receiver, int64_t waiting) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", options_.wait_timeout_ms / 1000.0);
    const std::string why =
        "worker rank " + std::to_string(receiver) + " stopped taking data: " + std::to_string(waiting) +
        " bytes have waited for it for " + seconds + " s (Config.wait_timeout_s) although its heartbeats still arrive: it is stuck, or far slower than this "
        "process";
    {
      MutexLock lock(&mu_);
      if (stuck_.empty()) stuck_ = why;
    }
    node_->Abort(Status::PeerLost(why));
  }

  // -- receiving ----------------------------------------------------------------
  void ReceiveLoop() {
    NameThisThread("mlt-receive");
    std::vector<ZmqPollItem> items;
    for (void* inbox : options_.inboxes) items.push_back({inbox, 0, ZmqApi::kPollIn, 0});
    while (!stopping_.load()) {
      const int ready = zmq_.poll(items.data(), static_cast<int>(items.size()), lent_.empty() ? kPollMs : kLentPollMs);
      if (ready < 0) {
        const int error = zmq_.errno_();
        if (error == EINTR) continue;
        if (!stopping_.load() && !node_->aborted()) {
          node_->Abort(Status::Internal("the receive thread's poll failed: " + zmq_.Describe(error)));
        }
        return;
      }
      for (const ZmqPollItem& item : items) {
        if (item.revents & ZmqApi::kPollIn) Drain(item.socket);
      }
      if (!lent_.empty()) FreeReleased();
    }
  }

  void Drain(void* inbox) {
    for (int n = 0; n < kDrainPerWake; ++n) {
      ZmqMessage header;
      zmq_.msg_init(&header);
      if (zmq_.msg_recv(&header, inbox, ZmqApi::kDontWait) < 0) {
        zmq_.msg_close(&header);
        return;  // EAGAIN: drained (anything else: the poll reports it)
      }
      auto payload = std::make_unique<ZmqMessage>();
      zmq_.msg_init(payload.get());
      int frames = 1;
      if (zmq_.msg_more(&header)) {
        // The rest of a message arrives with its first frame.
        zmq_.msg_recv(payload.get(), inbox, 0);
        frames = 2;
        bool more = zmq_.msg_more(payload.get());
        while (more) {
          ZmqMessage extra;
          zmq_.msg_init(&extra);
          zmq_.msg_recv(&extra, inbox, 0);
          more = zmq_.msg_more(&extra);
          zmq_.msg_close(&extra);
          ++frames;
        }
      }
      if (frames != 2) {
        zmq_.msg_close(&header);
        zmq_.msg_close(payload.get());
        refused_.fetch_add(1);
        Refuse("a message of " + std::to_string(frames) + " frames");
        continue;
      }
      received_.fetch_add(1);
      Deliver(&header, std::move(payload));
      zmq_.msg_close(&header);
    }
  }

  void Deliver(ZmqMessage* header, std::unique_ptr<ZmqMessage> payload) {
    const size_t bytes = zmq_.msg_size(payload.get());
    const void* values = zmq_.msg_data(payload.get());
    const int64_t stall_from = stall_min_bytes_.load();
    if (stall_from >= 0 && static_cast<int64_t>(bytes) >= stall_from) Stall();
    int64_t token = -1;  // copied by the node before Deliver returns
    if (lends_ && bytes >= kLendMinBytes) {
      // Kept before the node sees it: the token may come back at once.
      token = next_token_++;
      lent_.emplace(token, std::move(payload));
      lent_count_ = static_cast<int64_t>(lent_.size());
    }
    const Status delivered = node_->Deliver(zmq_.msg_data(header), zmq_.msg_size(header), values, bytes, token);
    if (payload) zmq_.msg_close(payload.get());
    if (delivered.ok()) return;
    if (delivered.code() == StatusCode::kCorruptMessage) {
      Refuse(delivered.message());  // the node counted it
    } else if (delivered.code() == StatusCode::kTimeout) {
      MutexLock lock(&mu_);  // an inbox stayed full: the node is aborted with why
      if (stuck_.empty()) stuck_ = delivered.message();
    }
  }

  void Stall() {
    stall_min_bytes_ = -1;
    const auto until = SteadyClock::now() + std::chrono::milliseconds(stall_ms_.load());
    while (!stopping_.load() && SteadyClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stalls_.fetch_add(1);
  }

  void FreeReleased() {
    std::vector<int64_t> tokens;
    if (!node_->TakeReleasedPayloads(&tokens).ok()) return;  // the device failed: the node reports it
    for (int64_t token : tokens) {
      const auto lent = lent_.find(token);
      if (lent == lent_.end()) continue;
      zmq_.msg_close(lent->second.get());
      lent_.erase(lent);
    }
    lent_count_ = static_cast<int64_t>(lent_.size());
  }

  void Refuse(std::string what) {
    MutexLock lock(&mu_);
    refusals_.push_back(std::move(what));
    if (refusals_.size() > kKeptRefusals) refusals_.pop_front();
  }

  ProcessNode* const node_;
  const ZmqApi& zmq_;
  const SocketPumpOptions options_;
  const std::shared_ptr<QueueCounts> counts_ = std::make_shared<QueueCounts>();
  std::atomic<int64_t> queue_limit_;
  const bool lends_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> sent_{0};
  std::atomic<int64_t> received_{0};
  std::atomic<int64_t> lent_count_{0};
  std::atomic<int64_t> stall_min_bytes_{-1};  // StallNextDelivery's; -1: none
  std::atomic<int64_t> stall_ms_{0};
  std::atomic<int64_t> stalls_{0};
  mutable Mutex mu_;
  SteadyClock::time_point stop_deadline_ GUARDED_BY(mu_);
  std::deque<std::string> refusals_ GUARDED_BY(mu_);
  std::string stuck_ GUARDED_BY(mu_);
  // Received payloads the node reads in place, by token (the receive
  // thread's; heap-allocated, so the bytes of a small one stay put).
  std::map<int64_t, std::unique_ptr<ZmqMessage>> lent_;
  int64_t next_token_ = 0;
  std::thread send_thread_;
  std::thread receive_thread_;
};

Status SocketPump::Start(ProcessNode* node, SocketPumpOptions options, std::unique_ptr<SocketPump>* out) {
  if (node == nullptr) return Status::InvalidArgument("the socket pump needs a node");
  for (const auto& peer : options.peers) {
    if (peer.second == nullptr) {
      return Status::InvalidArgument("the socket to worker rank " + std::to_string(peer.first) + " is null");
    }
  }
  for (void* inbox : options.inboxes) {
    if (inbox == nullptr) return Status::InvalidArgument("a bound data socket is null");
  }
  if (options.wait_timeout_ms <= 0) return Status::InvalidArgument("the socket pump needs a wait timeout above 0");
  const ZmqApi* zmq = nullptr;
  MLT_RETURN_IF_ERROR(ZmqApi::Load(options.zmq_library, &zmq));
  auto impl = std::make_unique<Impl>(node, zmq, std::move(options));
  impl->Start();
  out->reset(new SocketPump(std::move(impl)));
  return Status::Ok();
}

SocketPump::SocketPump(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SocketPump::~SocketPump() = default;
void SocketPump::Stop() { impl_->Stop(); }
void SocketPump::SetQueueLimit(int64_t bytes) { impl_->SetQueueLimit(bytes); }
SocketPumpStats SocketPump::stats() const { return impl_->stats(); }
std::vector<std::string> SocketPump::TakeRefusals() { return impl_->TakeRefusals(); }
std::string SocketPump::stuck() const { return impl_->stuck(); }
void SocketPump::StallNextDelivery(int64_t min_payload_bytes, int64_t milliseconds) {
  impl_->StallNextDelivery(min_payload_bytes, milliseconds);
}

}  // namespace mltuner
