#include "plan/host_memory.h"

#include <algorithm>
#include <sstream>

#include "mltuner/update_step.h"
#include "plan/device_budget.h"

namespace mltuner {

namespace {

// Rows of a table that shard `rank` of `num_workers` owns: ShardRange's even
// contiguous split (server/shard.h), the first shards taking one extra row.
// (Kept here so that the plan does not depend on the server;
// tests/cpp/plan/host_memory_test.cc checks that both agree.)
int64_t ShardRows(int64_t num_rows, int rank, int num_workers) {
  if (num_workers <= 0) return 0;
  return num_rows / num_workers + (rank < num_rows % num_workers ? 1 : 0);
}

std::string Mib(int64_t bytes) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(1);
  out << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

}  // namespace

std::string HostMemoryNeed::Describe() const {
  std::ostringstream out;
  out << total() << " B (" << Mib(total()) << ": parameter stores and update logs " << parameter_stores
      << " B, local data " << local_data << " B, device memory (pool and device stores) " << device_memory
      << " B, staging " << staging << " B, update payloads in flight " << payloads << " B, the server shard's state "
      << (shard_in_host_memory ? shard_per_branch : 0) << " B; the server shard holds " << shard_per_branch
      << " B per branch " << (shard_in_host_memory ? "in host memory" : "on the device") << ")";
  return out.str();
}

HostMemoryNeed CountHostMemory(const Config& config, const std::vector<TableInfo>& tables,
                               const Recording& recording, const Placement& placement, const PlanSite& site) {
  HostMemoryNeed need;
  int64_t shard_values = 0;
  for (const TableInfo& table : tables) {
    const TablePlacement& where = placement.tables[table.id];
    if (table.local) {
      need.local_data += where.host_rows * table.row_bytes();
    } else {
      // The cache row, and its update-log row where the table keeps a log.
      need.parameter_stores += (KeepsUpdateLog(table, recording) ? 2 : 1) * where.host_rows * table.row_bytes();
      const UpdateRuleConfig& rule = table.update_rule ? *table.update_rule : config.update_rule;
      const int64_t values = ShardRows(table.num_rows, site.rank, site.num_workers) * table.row_bytes();
      shard_values += values;
      need.shard_per_branch += values * (1 + StateArraysPerValue(rule));
    }
  }
  need.staging = placement.staging_bytes;
  if (site.device_is_host) need.device_memory = placement.pool_bytes + placement.device_store_bytes;
  // The shard's state goes where the device has room for it after this
  // plan's allocations (the rule the shard applies, plan/device_budget.h).
  const int64_t free_after_plan =
      site.device_free < 0 ? -1 : site.device_free - placement.pool_bytes - placement.device_store_bytes;
  need.shard_in_host_memory =
      site.device_is_host || ShardStateInHostMemory(need.shard_per_branch, std::max<int64_t>(free_after_plan, 0),
                                                    DeviceReserve(config, site.device_total), site.maps_host_memory);
  if (need.shard_in_host_memory && !site.device_is_host) {
    need.shard_link_to_device = need.shard_per_branch + shard_values;
    need.shard_link_to_host = need.shard_per_branch;
  }

  // Payloads: a clock's updates, sent as one payload per table and shard,
  // are kept by the shards until every worker finished that clock; with the
  // largest recorded slack s a worker runs up to s clocks ahead, so up to
  // s + 2 clocks of this worker's updates are alive (the clocks not yet
  // applied, and the one being sent). Those for a shard sharing the device
  // live in device memory, those for other processes' shards in host memory.
  int64_t update_bytes = 0;
  int max_slack = 0;
  for (const AccessRecord& access : recording.accesses) {
    if (access.kind == OpKind::kPreUpdate) {
      update_bytes += static_cast<int64_t>(access.rows.size()) * tables[access.table].row_bytes();
    } else if (access.kind == OpKind::kRead) {
      max_slack = std::max(max_slack, access.slack);
    }
  }
  const int64_t in_flight = (max_slack + 2) * update_bytes;
  if (site.device_is_host) {
    need.payloads = in_flight;
  } else if (site.num_workers > 1) {
    need.payloads = in_flight / site.num_workers * (site.num_workers - 1);
  }
  return need;
}

Status CheckHostMemoryAgainst(const HostMemoryNeed& need, int64_t limit_bytes, const std::string& limit_source) {
  if (need.total() <= limit_bytes) return Status::Ok();
  std::ostringstream msg;
  msg << "the plan needs " << need.Describe() << " of host memory, more than the " << limit_bytes << " B ("
      << Mib(limit_bytes) << ") of " << limit_source << "; ";
  if (need.device_memory > 0) {
    msg << "on this backend the device's memory is host memory too: use smaller tables, fewer clocks in "
           "flight (prefetch_clocks) or a machine with more memory";
  } else {
    msg << "a larger device_memory_budget keeps more rows on the device";
  }
  return Status::ResourceExhausted(msg.str());
}

Status CheckHostMemory(const HostMemoryNeed& need, int64_t host_memory_limit, int64_t freed_during_init) {
  if (host_memory_limit > 0) return CheckHostMemoryAgainst(need, host_memory_limit, "Config.host_memory_limit");
  const HostHeadroom headroom = HostMemoryHeadroom();
  if (!headroom.known()) return Status::Ok();  // nothing to check against
  return CheckHostMemoryAvailable(need, headroom, freed_during_init);
}

Status CheckHostMemoryAvailable(const HostMemoryNeed& need, const HostHeadroom& headroom,
                                int64_t freed_during_init) {
  // The shard's state in host memory is allocated table by table as the
  // application writes initial values and frees its copies of them.
  const int64_t later = need.shard_in_host_memory ? std::min(need.shard_per_branch, freed_during_init) : 0;
  if (later <= 0) return CheckHostMemoryAgainst(need, headroom.bytes, headroom.source);
  return CheckHostMemoryAgainst(need, headroom.bytes + later,
                                headroom.source + " and the " + std::to_string(later) +
                                    " B the application frees while it writes initial values");
}

}  // namespace mltuner
