#include "mltuner/process_node.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

#include "cluster/shard_host.h"
#include "memory/buffer_pool.h"
#include "memory/device_block.h"
#include "wire/message.h"

namespace mltuner {

// The shard host and the outbox of messages for other processes.
class ProcessNode::Queues {
 public:
  Queues(int rank, int num_workers, const Config& config, BufferPool* pool, std::shared_ptr<Device> device)
      : host(rank, num_workers, config, pool, device, [rank](int worker) { return worker == rank; }),
        device(std::move(device)) {}

  void PushOutgoing(OutgoingMessage&& message) {
    {
      std::lock_guard<std::mutex> lock(mu);
      outbox.push_back(std::move(message));
    }
    ready.notify_one();
  }

  bool PopOutgoing(int timeout_ms, OutgoingMessage* out) {
    std::unique_lock<std::mutex> lock(mu);
    ready.wait_for(lock, std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms),
                   [&] { return closed || !outbox.empty(); });
    if (outbox.empty()) return false;
    *out = std::move(outbox.front());
    outbox.pop_front();
    return true;
  }

  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu);
      closed = true;
    }
    ready.notify_all();
  }

  ShardHost host;
  std::shared_ptr<Device> device;  // shared with the engine and the shard
  mutable std::mutex mu;
  std::condition_variable ready;
  std::deque<OutgoingMessage> outbox;  // guarded by mu
  bool closed = false;                 // guarded by mu
  bool aborted = false;                // guarded by mu
};

ProcessNode::ProcessNode(int rank, int num_workers) : rank_(rank), num_workers_(num_workers) {}

Status ProcessNode::Create(const Config& config, int rank, int num_workers, std::unique_ptr<Device> device,
                           std::unique_ptr<ProcessNode>* out) {
  if (num_workers < 1) return Status::InvalidArgument("a job needs at least one worker");
  if (rank < 0 || rank >= num_workers) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is outside 0.." +
                                   std::to_string(num_workers - 1));
  }
  std::shared_ptr<Device> shared_device = device ? std::move(device) : NewCpuDevice();
  std::unique_ptr<ProcessNode> node(new ProcessNode(rank, num_workers));
  // Payloads in flight through ZeroMQ hold their buffers; idle ones are kept
  // up to 1 GiB for reuse.
  node->pool_ = std::make_shared<BufferPool>(size_t{1} << 30);
  node->queues_ = std::make_unique<Queues>(rank, num_workers, config, node->pool_.get(), shared_device);
  MLT_RETURN_IF_ERROR(Engine::Create(config, rank, num_workers, shared_device, node.get(), &node->engine_));
  node->queues_->host.Start(node->engine_.get(), node.get());
  *out = std::move(node);
  return Status::Ok();
}

ProcessNode::~ProcessNode() { Shutdown(); }

Status ProcessNode::Send(Message&& message) {
  const int receiver = message.header.receiver;
  if (receiver < 0 || receiver >= num_workers_) {
    return Status::InvalidArgument("message to unknown process " + std::to_string(receiver) + ": " +
                                   message.DebugString());
  }
  if (receiver == rank_) {
    queues_->host.Push(std::move(message));
    return Status::Ok();
  }
  if (message.device_values) {
    // Another process: the values leave the device here, after the work that
    // produced them.
    const DeviceBuffer& buffer = *message.device_values;
    Device& device = *queues_->device;
    message.values = pool_->Acquire(buffer.count);
    MLT_RETURN_IF_ERROR(device.WaitEvent(Stream::kReceive, buffer.ready));
    device.CopyDeviceToHost(message.values.data(), buffer.data, buffer.count * sizeof(float), Stream::kReceive);
    MLT_RETURN_IF_ERROR(device.Synchronize(Stream::kReceive));
    message.device_values.reset();
  }
  OutgoingMessage outgoing;
  outgoing.receiver = receiver;
  outgoing.header = EncodeHeaderFrame(message);
  outgoing.payload = std::move(message.values);
  queues_->PushOutgoing(std::move(outgoing));
  return Status::Ok();
}

Status ProcessNode::AddTableToShard(int rank, const TableInfo& info) {
  if (rank != rank_) {
    return Status::Internal("process " + std::to_string(rank_) + " asked to register a table with shard " +
                            std::to_string(rank) + ", which lives in another process");
  }
  return queues_->host.AddTable(info);
}

std::vector<float> ProcessNode::NewPayload(size_t count) { return pool_->Acquire(count); }

bool ProcessNode::NextOutgoing(int timeout_ms, OutgoingMessage* out) {
  return queues_->PopOutgoing(timeout_ms, out);
}

int64_t ProcessNode::outbox_messages() const {
  std::lock_guard<std::mutex> lock(queues_->mu);
  return static_cast<int64_t>(queues_->outbox.size());
}

Status ProcessNode::Deliver(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes) {
  Message message;
  Status status = DecodeMessage(frame0, frame0_bytes, payload, payload_bytes, &message,
                                pool_->Acquire(payload_bytes / sizeof(float)));
  if (status.ok() && message.header.receiver != rank_) {
    status = Status::CorruptMessage("message for process " + std::to_string(message.header.receiver) +
                                    " reached process " + std::to_string(rank_));
  }
  const int sender = message.header.sender;
  if (status.ok() && (sender < 0 || sender >= num_workers_ || sender == rank_)) {
    status = Status::CorruptMessage("message from process " + std::to_string(sender) +
                                    ", not another rank of 0.." + std::to_string(num_workers_ - 1));
  }
  if (!status.ok()) {
    queues_->host.Reject(status, Message());
    return status;
  }
  queues_->host.Push(std::move(message));
  return Status::Ok();
}

void ProcessNode::Abort(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    if (queues_->aborted) return;
    queues_->aborted = true;
  }
  engine_->Abort(why);
}

bool ProcessNode::aborted() const {
  std::lock_guard<std::mutex> lock(queues_->mu);
  return queues_->aborted;
}

Status ProcessNode::ExportShardTable(TableId table, ShardSlice* out) {
  return queues_->host.ExportTable(table, out);
}

Status ProcessNode::ImportShardTable(TableId table, const float* values, size_t num_values, const float* state,
                                     size_t num_state) {
  return queues_->host.ImportTable(table, values, num_values, state, num_state);
}

int64_t ProcessNode::rejected_messages() const { return queues_->host.rejected(); }

Status ProcessNode::Shutdown() {
  if (!engine_) return Status::Ok();
  const Status status = engine_->Shutdown();
  queues_->host.Stop();
  queues_->Close();
  return status;
}

}  // namespace mltuner
