#include "mltuner/transport.h"

#include <utility>

#include "wire/message.h"

namespace mltuner {

Status Transport::SendAll(std::vector<Message>&& messages) {
  for (Message& message : messages) MLT_RETURN_IF_ERROR(Send(std::move(message)));
  return Status::Ok();
}

HeldMessages::HeldMessages(size_t flush_bytes) : flush_bytes_(flush_bytes) {}
HeldMessages::~HeldMessages() = default;

bool HeldMessages::Hold(Message&& message) {
  bytes_ += message.num_values() * sizeof(float);
  messages_.push_back(std::move(message));
  return bytes_ >= flush_bytes_;
}

Status HeldMessages::Flush(Transport* transport, int64_t* sent) {
  if (sent != nullptr) *sent = static_cast<int64_t>(messages_.size());
  if (messages_.empty()) return Status::Ok();
  std::vector<Message> burst = std::move(messages_);
  messages_.clear();
  bytes_ = 0;
  return transport->SendAll(std::move(burst));
}

}  // namespace mltuner
