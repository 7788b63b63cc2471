#include "plan/device_budget.h"

#include <algorithm>
#include <sstream>

namespace mltuner {

std::string BudgetChoice::Describe() const {
  std::ostringstream out;
  const std::string beside = std::to_string(application_bytes) + " B the application keeps beside it";
  if (budget > 0 && !automatic && application_bytes > 0) {
    out << "device_memory_budget " << budget << " B for the engine (" << budget + application_bytes
        << " B set by hand, less the " << beside << ")";
  } else if (budget > 0 && !automatic) {
    out << "device_memory_budget " << budget << " B (set by hand)";
  } else if (budget > 0) {
    out << "automatic device_memory_budget " << budget << " B (none set; the plan needs more than the device's "
        << device_free << " B free of " << device_total << " B less the reserve of " << reserve << " B"
        << (application_bytes > 0 ? " and the " + beside : "") << ")";
  } else if (device_free >= 0) {
    out << "no device_memory_budget (none set; the plan fits the device's " << device_free << " B free of "
        << device_total << " B less the reserve of " << reserve << " B)";
  } else {
    out << "no device_memory_budget (none set; the device reports no capacity)";
  }
  return out.str();
}

int64_t DeviceReserve(const Config& config, int64_t device_total) {
  if (config.device_memory_reserve >= 0) return config.device_memory_reserve;
  return device_total > 0 ? device_total / 10 : 0;
}

BudgetChoice ChooseBudget(const Config& config, int64_t device_free, int64_t device_total, int64_t device_need) {
  BudgetChoice choice;
  choice.device_free = device_free;
  choice.device_total = device_total;
  choice.reserve = DeviceReserve(config, device_total);
  if (config.device_memory_budget > 0) {
    choice.budget = config.device_memory_budget;
    return choice;
  }
  if (device_free < 0) return choice;
  const int64_t room = device_free - choice.reserve;
  if (device_need <= room) return choice;
  choice.budget = std::max<int64_t>(room, 1);
  choice.automatic = true;
  return choice;
}

bool ShardStateInHostMemory(int64_t state_bytes, int64_t device_free, int64_t reserve, bool maps_host_memory) {
  if (!maps_host_memory || device_free < 0 || state_bytes <= 0) return false;
  return state_bytes > device_free - reserve;
}

}  // namespace mltuner
