#include "common/rate_ratios.h"

#include <algorithm>

namespace mltuner {

std::map<TableId, TableRate> ForkRates(const std::map<TableId, TableRate>& parent, float learning_rate,
                                       bool keep_ratios) {
  if (learning_rate < 0) return parent;
  std::map<TableId, TableRate> child;
  const bool inherited = std::all_of(parent.begin(), parent.end(), [](const auto& entry) {
    return entry.second.ratio >= 0 && entry.second.rate == entry.second.ratio_rate;
  });
  float fastest = 0;
  for (const auto& [table, rate] : parent) fastest = std::max(fastest, rate.rate);
  for (const auto& [table, rate] : parent) {
    TableRate forked;
    if (keep_ratios && (inherited || fastest > 0)) {
      forked.ratio = inherited ? rate.ratio : static_cast<double>(rate.rate) / fastest;
      forked.rate = static_cast<float>(forked.ratio * learning_rate);
      forked.ratio_rate = forked.rate;
    } else {
      forked.rate = learning_rate;
    }
    child[table] = forked;
  }
  return child;
}

}  // namespace mltuner
