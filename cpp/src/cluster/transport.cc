#include "mltuner/transport.h"

#include <utility>

#include "wire/message.h"

namespace mltuner {

Status Transport::SendAll(std::vector<Message>&& messages) {
  for (Message& message : messages) MLT_RETURN_IF_ERROR(Send(std::move(message)));
  return Status::Ok();
}

}  // namespace mltuner
