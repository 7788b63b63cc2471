#include "plan/iteration_plan.h"

#include <utility>

namespace mltuner {
namespace {

// The local accesses whose rows all live on the device under `plan`.
std::vector<Handle> DeviceResidentLocalAccesses(const std::vector<TableInfo>& tables, const Recording& recording,
                                                const IterationPlan& plan) {
  std::vector<Handle> out;
  for (const AccessRecord& access : recording.accesses) {
    if (access.kind != OpKind::kLocalAccess || !tables[access.table].local) continue;
    const RowLayout& layout = plan.layouts[access.table];
    const TablePlacement& where = plan.placement.tables[access.table];
    bool on_device = true;
    for (RowId row : access.rows) {
      const int64_t position = layout.PositionOf(row);
      if (position >= where.placed() || where.ResidenceOf(position) != Residence::kDevice) {
        on_device = false;
        break;
      }
    }
    if (on_device) out.push_back(access.handle);
  }
  return out;
}

}  // namespace

Status PlanIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                     const PlanSite& site, IterationPlan* out) {
  IterationPlan plan;
  plan.layouts = BuildRowLayouts(tables, recording);
  BudgetChoice budget = ChooseBudget(config, site.device_free, site.device_total, 0);
  budget.application_bytes = site.application_bytes;
  MLT_RETURN_IF_ERROR(PlanPlacement(config, tables, plan.layouts, recording, &plan.placement, site));
  Config planned = config;
  if (config.device_memory_budget == 0) {
    // No budget set: the plan with everything on the device, unless the
    // device cannot hold it; then again under what the device has free.
    budget = ChooseBudget(config, site.device_free, site.device_total,
                          plan.placement.pool_bytes + plan.placement.device_store_bytes);
    budget.application_bytes = site.application_bytes;
    if (budget.automatic) {
      planned.device_memory_budget = budget.budget;
      out->placement.budget = budget;  // for the caller's message, also when the plan is refused
      const Status status = PlanPlacement(planned, tables, plan.layouts, recording, &plan.placement, site);
      if (!status.ok()) {
        if (status.code() != StatusCode::kResourceExhausted) return status;
        return Status::ResourceExhausted("no device_memory_budget was set and the device cannot hold the plan: the " +
                                         budget.Describe() + " is too small: " + status.message());
      }
    }
  }
  plan.placement.budget = budget;
  plan.placement.host = CountHostMemory(planned, tables, recording, plan.placement, site);
  *out = std::move(plan);
  return Status::Ok();
}

Status PreviewIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                        const PlanSite& site, std::unique_ptr<IterationPlan>* kept, PlanPreview* preview) {
  PlanPreview result;
  if (*kept && !(*kept)->Covers(tables)) kept->reset();
  if (*kept) {  // this recording's plan, made by an earlier preview
    result.fits = true;
  } else {
    result.pool_min_bytes = LeastPoolBytes(config, tables, recording);
    result.prefetch_clocks = LeastPoolPrefetchClocks(config);
    result.fits = config.device_memory_budget <= 0 || result.pool_min_bytes <= config.device_memory_budget;
    result.budget_bytes = config.device_memory_budget;
    if (result.fits) {
      auto plan = std::make_unique<IterationPlan>();
      const Status status = PlanIteration(config, tables, recording, site, plan.get());
      if (!status.ok() && !(status.code() == StatusCode::kResourceExhausted && plan->placement.budget.automatic)) {
        return status;
      }
      if (status.ok()) {
        *kept = std::move(plan);
      } else {  // the automatic budget cannot hold the least pool
        result.fits = false;
        result.budget_bytes = plan->placement.budget.budget;
        result.automatic_budget = true;
        Config planned = config;  // the least pool under that budget (one region when the plan chooses)
        planned.device_memory_budget = result.budget_bytes;
        result.pool_min_bytes = LeastPoolBytes(planned, tables, recording);
        result.prefetch_clocks = LeastPoolPrefetchClocks(planned);
      }
    }
  }
  if (result.fits) {
    const Placement& placement = (*kept)->placement;
    Config planned = config;  // the least budget accepted: under the budget planned with, set or automatic
    planned.device_memory_budget = placement.budget.budget;
    // The plan already has the least pool of its own regions; another count
    // of regions (two chosen where the least is one's) is scheduled here.
    result.pool_min_bytes = LeastPoolPrefetchClocks(planned) == placement.prefetch_clocks
                                ? placement.pool_min_bytes
                                : LeastPoolBytes(planned, tables, recording);
    result.prefetch_clocks = placement.prefetch_clocks;
    result.budget_bytes = placement.budget.budget;
    result.automatic_budget = placement.budget.automatic;
    result.pool_bytes = placement.pool_bytes;
    result.device_store_bytes = placement.device_store_bytes;
    result.host_store_bytes = placement.host_store_bytes;
    result.host_to_device_bytes = placement.traffic.host_to_device();
    result.device_to_host_bytes = placement.traffic.device_to_host();
    result.device_local_accesses = DeviceResidentLocalAccesses(tables, recording, **kept);
    result.host = placement.host;
    result.description = placement.Describe();
  }
  *preview = std::move(result);
  return Status::Ok();
}

}  // namespace mltuner
