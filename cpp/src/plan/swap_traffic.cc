#include "plan/swap_traffic.h"

#include <sstream>

#include "plan/placement.h"
#include "sharding/shard_range.h"

namespace mltuner {

bool IsHostToDevice(SwapCause cause) {
  return cause == SwapCause::kParamIn || cause == SwapCause::kSendIn || cause == SwapCause::kLocalIn;
}

void SwapTraffic::Add(SwapCause cause, int64_t bytes) {
  switch (cause) {
    case SwapCause::kParamIn: params_in += bytes; break;
    case SwapCause::kUpdateOut: updates_out += bytes; break;
    case SwapCause::kSendIn: sends_in += bytes; break;
    case SwapCause::kInstallOut: installs_out += bytes; break;
    case SwapCause::kLocalIn: local_in += bytes; break;
    case SwapCause::kLocalOut: local_out += bytes; break;
  }
}

std::string SwapTraffic::Describe() const {
  std::ostringstream out;
  out << "host->device " << host_to_device() << " B (parameters in " << params_in << " B, update log to own shard "
      << sends_in << " B, local data in " << local_in << " B), device->host " << device_to_host()
      << " B (updates to host rows " << updates_out << " B, pushed rows installed " << installs_out
      << " B, local data out " << local_out << " B)";
  return out.str();
}

void ForEachHostTransfer(const TableInfo& table, const RowLayout& layout, const Recording& recording,
                         const PlanSite& site, const std::function<void(SwapCause, int64_t)>& visit) {
  const bool logged = KeepsUpdateLog(table, recording);  // else the update goes straight from its buffer
  std::vector<bool> updated;         // rows whose log the table's clock sends
  if (logged) updated.assign(static_cast<size_t>(table.num_rows), false);
  for (const AccessRecord& access : recording.accesses) {
    if (access.table != table.id) continue;
    for (RowId row : access.rows) {
      const int64_t position = layout.PositionOf(row);
      switch (access.kind) {
        case OpKind::kRead:
          visit(SwapCause::kParamIn, position);
          break;
        case OpKind::kPreUpdate:
          if (logged) {
            visit(SwapCause::kUpdateOut, position);
            updated[static_cast<size_t>(row)] = true;
          }
          break;
        case OpKind::kLocalAccess:
          if (access.fetch) visit(SwapCause::kLocalIn, position);
          if (access.keep) visit(SwapCause::kLocalOut, position);
          break;
        default:
          break;
      }
    }
  }
  if (table.local) return;
  const RowSpan own = ShardRange(table.num_rows, site.rank, site.num_workers);
  for (RowId row = own.begin; row < own.begin + own.count; ++row) {
    const int64_t position = layout.PositionOf(row);
    visit(SwapCause::kInstallOut, position);
    if (logged && updated[static_cast<size_t>(row)]) visit(SwapCause::kSendIn, position);
  }
}

SwapTraffic PredictSwapTraffic(const std::vector<TableInfo>& tables, const std::vector<RowLayout>& layouts,
                               const Recording& recording, const std::vector<TablePlacement>& placement,
                               const PlanSite& site) {
  SwapTraffic traffic;
  for (const TableInfo& table : tables) {
    const TablePlacement& where = placement[table.id];
    if (where.host_rows == 0) continue;
    const int64_t row_bytes = table.row_bytes();
    ForEachHostTransfer(table, layouts[table.id], recording, site, [&](SwapCause cause, int64_t position) {
      if (where.ResidenceOf(position) == Residence::kHost) traffic.Add(cause, row_bytes);
    });
  }
  return traffic;
}

}  // namespace mltuner
