#include "plan/iteration_plan.h"

#include <utility>

namespace mltuner {

Status PlanIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                     const PlanSite& site, IterationPlan* out) {
  IterationPlan plan;
  plan.layouts = BuildRowLayouts(tables, recording);
  MLT_RETURN_IF_ERROR(PlanPlacement(config, tables, plan.layouts, recording, &plan.placement, site));
  plan.placement.host = CountHostMemory(config, tables, recording, plan.placement, site);
  *out = std::move(plan);
  return Status::Ok();
}

Status PreviewIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                        const PlanSite& site, std::unique_ptr<IterationPlan>* kept, PlanPreview* preview) {
  PlanPreview result;
  if (*kept && !(*kept)->Covers(tables)) kept->reset();
  if (*kept) {  // this recording's plan, made by an earlier preview
    result.pool_min_bytes = (*kept)->placement.pool_min_bytes;
    result.fits = true;
  } else {
    result.pool_min_bytes = LeastPoolBytes(config, tables, recording);
    result.fits = config.device_memory_budget <= 0 || result.pool_min_bytes <= config.device_memory_budget;
    if (result.fits) {
      auto plan = std::make_unique<IterationPlan>();
      MLT_RETURN_IF_ERROR(PlanIteration(config, tables, recording, site, plan.get()));
      *kept = std::move(plan);
    }
  }
  if (result.fits) {
    const Placement& placement = (*kept)->placement;
    result.pool_bytes = placement.pool_bytes;
    result.device_store_bytes = placement.device_store_bytes;
    result.host_store_bytes = placement.host_store_bytes;
    result.host = placement.host;
    result.description = placement.Describe();
  }
  *preview = std::move(result);
  return Status::Ok();
}

}  // namespace mltuner
