// The plan's host memory (plan/host_memory.h) and the dry run of the plan
// (plan/iteration_plan.h), on placement_test.cc's example:
//   t0 param 8 rows x 16 floats (64 B/row), t1 param 8 x 10 (40 B/row),
//   t2 local 4 x 16 (64 B/row); reads of t0 {0,1,2} and t1 {0..4}, an update
//   of t0 {0..4} (320 B), a local access of t2 {0,1}.
// Least pool 2048 B (2 regions of 1024), unlimited pool 2560 B; the largest
// buffer (the staging buffer) 512 B. The counts below pin prefetch_clocks 1
// (two regions); the preview test also checks the plan's own choice. Stores: t0 512 B, t1 320 B (no update
// log: t0 is updated once a clock, from its buffer; t1 never), t2 128 B
// (its touched rows; untouched local rows are placed nowhere): 960 B.
#include "plan/host_memory.h"

#include <memory>
#include <string>
#include <vector>

#include "plan/iteration_plan.h"
#include "record/recorder.h"
#include "server/shard.h"
#include "test_util.h"

using namespace mltuner;

namespace {

HostHeadroom Room(int64_t bytes) { return {bytes, "a test's headroom"}; }

TableInfo Table(TableId id, int64_t rows, int64_t width, bool local = false) {
  TableInfo info;
  info.id = id;
  info.name = "t" + std::to_string(id);
  info.num_rows = rows;
  info.row_width = width;
  info.local = local;
  return info;
}

struct Example {
  std::vector<TableInfo> tables;
  Recording recording;
};

Status BuildExample(Example* ex, int slack = 0) {
  ex->tables = {Table(0, 8, 16), Table(1, 8, 10), Table(2, 4, 16, true)};
  Recorder rec;
  Handle r0, r1, u, l;
  MLT_RETURN_IF_ERROR(rec.Read(ex->tables[0], {0, 1, 2}, slack, &r0));
  MLT_RETURN_IF_ERROR(rec.Read(ex->tables[1], {0, 1, 2, 3, 4}, 0, &r1));
  MLT_RETURN_IF_ERROR(rec.PreUpdate(ex->tables[0], {0, 1, 2, 3, 4}, &u));
  MLT_RETURN_IF_ERROR(rec.Update(u));
  MLT_RETURN_IF_ERROR(rec.LocalAccess(ex->tables[2], {0, 1}, true, &l));
  MLT_RETURN_IF_ERROR(rec.PostLocalAccess(l, true));
  MLT_RETURN_IF_ERROR(rec.PostRead(r1));
  MLT_RETURN_IF_ERROR(rec.PostRead(r0));
  MLT_RETURN_IF_ERROR(rec.Clock());
  return rec.Finish(&ex->recording);
}

Config WithBudget(int64_t budget, int prefetch = 1) {
  Config config;
  config.device_memory_budget = budget;
  config.prefetch_clocks = prefetch;
  return config;
}

Status Need(const Config& config, const Example& ex, const PlanSite& site, HostMemoryNeed* out) {
  IterationPlan plan;
  MLT_RETURN_IF_ERROR(PlanIteration(config, ex.tables, ex.recording, site, &plan));
  *out = plan.placement.host;
  return Status::Ok();
}

// PreviewIteration of the example under `config`, on one local device
// unless `site` says otherwise.
Status Preview(const Example& ex, const Config& config, std::unique_ptr<IterationPlan>* kept, PlanPreview* out,
               const PlanSite& site = {0, 1, true}) {
  return PreviewIteration(config, ex.tables, ex.recording, site, kept, out);
}

}  // namespace

TEST(UnlimitedOnTheCpuCountsThePoolStoresStagingAndPayloads) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  HostMemoryNeed need;
  ASSERT_OK(Need(WithBudget(0), ex, {0, 1, true}, &need));
  EXPECT_EQ(need.parameter_stores, 0);
  EXPECT_EQ(need.local_data, 0);
  EXPECT_EQ(need.device_memory, 2560 + 960);  // the device's memory is host memory
  EXPECT_EQ(need.staging, 512);
  EXPECT_EQ(need.payloads, 2 * 320);  // slack 0: the clock being sent and the one not yet applied
  EXPECT_EQ(need.shard_per_branch, 8 * 64 + 8 * 40);  // the add rule keeps no state
  EXPECT_TRUE(need.shard_in_host_memory);
  EXPECT_EQ(need.total(), 3520 + 512 + 640 + 832);  // with the shard's state: the CPU's memory is host memory
}

TEST(TheLeastBudgetPutsTheStoresInHostMemory) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  HostMemoryNeed need;
  ASSERT_OK(Need(WithBudget(2048), ex, {0, 1, false}, &need));
  EXPECT_EQ(need.parameter_stores, 8 * 64 + 8 * 40);  // no update logs
  EXPECT_EQ(need.local_data, 2 * 64);  // the local table's touched rows
  EXPECT_EQ(need.device_memory, 0);  // an accelerator: the pool is on the device
  EXPECT_EQ(need.staging, 512);
  EXPECT_EQ(need.payloads, 0);  // one worker: its shard shares the device
  EXPECT_EQ(need.total(), 832 + 128 + 512);
  EXPECT_TRUE(!need.shard_in_host_memory);
  // On the CPU backend the same plan also holds the pool in host memory.
  ASSERT_OK(Need(WithBudget(2048), ex, {0, 1, true}, &need));
  EXPECT_EQ(need.device_memory, 2048);
}

TEST(AShardStateInHostMemoryCrossesAnAcceleratorsLinkEachClock) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  Config config = WithBudget(1 << 20);
  config.update_rule.kind = UpdateRuleKind::kDampedMomentum;  // values and one state array
  config.device_memory_reserve = 0;
  PlanSite site{0, 1, false};
  site.maps_host_memory = true;
  site.device_total = int64_t{1} << 30;
  site.device_free = 1;  // no room for the shard's state after the plan
  HostMemoryNeed need;
  ASSERT_OK(Need(config, ex, site, &need));
  constexpr int64_t kValues = 8 * 64 + 8 * 40;
  EXPECT_TRUE(need.shard_in_host_memory);
  EXPECT_EQ(need.shard_per_branch, 2 * kValues);
  EXPECT_EQ(need.shard_link_to_device, 2 * kValues + kValues);  // the rule reads it, the install reads the values
  EXPECT_EQ(need.shard_link_to_host, 2 * kValues);              // the rule writes it
  // With room on the device the state stays there; on the CPU backend there is no link.
  site.device_free = int64_t{1} << 30;
  ASSERT_OK(Need(config, ex, site, &need));
  EXPECT_TRUE(!need.shard_in_host_memory);
  EXPECT_EQ(need.shard_link_to_device + need.shard_link_to_host, int64_t{0});
  ASSERT_OK(Need(config, ex, {0, 1, true}, &need));
  EXPECT_TRUE(need.shard_in_host_memory);
  EXPECT_EQ(need.shard_link_to_device + need.shard_link_to_host, int64_t{0});
  // The plan says so beside its own prediction.
  Placement placement;
  placement.host.shard_link_to_device = 3;
  placement.host.shard_link_to_host = 2;
  EXPECT_TRUE(placement.Describe().find("the server shard's state in host memory about 3 B host->device and 2 B "
                                        "device->host more") != std::string::npos);
}

TEST(SlackAndRemoteShardsScaleThePayloads) {
  Example ex;
  ASSERT_OK(BuildExample(&ex, 3));
  HostMemoryNeed need;
  ASSERT_OK(Need(WithBudget(0), ex, {0, 1, true}, &need));
  EXPECT_EQ(need.payloads, 5 * 320);  // slack 3: up to 5 clocks of updates alive
  ASSERT_OK(Need(WithBudget(0), ex, {1, 4, false}, &need));
  EXPECT_EQ(need.payloads, 5 * 320 / 4 * 3);  // on a GPU, the 3 other processes' shares go through host memory
}

TEST(TheShardSliceFollowsShardRangeAndTheRulesState) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  Config config;
  config.update_rule.kind = UpdateRuleKind::kAdam;  // m and v
  for (int64_t rows : {1, 7, 8, 13}) {
    ex.tables[0].num_rows = std::max<int64_t>(rows, 5);  // the recorded rows stay in range
    for (int workers : {1, 2, 3, 5}) {
      for (int rank = 0; rank < workers; ++rank) {
        HostMemoryNeed need;
        ASSERT_OK(Need(config, ex, {rank, workers, true}, &need));
        const int64_t expected = 3 * (ShardRange(ex.tables[0].num_rows, rank, workers).count * 64 +
                                      ShardRange(ex.tables[1].num_rows, rank, workers).count * 40);
        EXPECT_EQ(need.shard_per_branch, expected);
      }
    }
  }
}

TEST(APlanAboveTheLimitIsRefusedWithTheSizes) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  HostMemoryNeed need;
  ASSERT_OK(Need(WithBudget(0), ex, {0, 1, true}, &need));
  EXPECT_OK(CheckHostMemoryAgainst(need, need.total(), "a test limit"));
  const Status refused = CheckHostMemoryAgainst(need, need.total() - 1, "a test limit");
  EXPECT_CODE(refused, StatusCode::kResourceExhausted);
  const std::string text = refused.ToString();
  EXPECT_TRUE(text.find("needs 5504 B") != std::string::npos);
  EXPECT_TRUE(text.find("staging 512 B") != std::string::npos);
  EXPECT_TRUE(text.find("5503 B") != std::string::npos);
  EXPECT_TRUE(text.find("a test limit") != std::string::npos);
  // Config.host_memory_limit takes the place of MemAvailable.
  EXPECT_CODE(CheckHostMemory(need, need.total() - 1), StatusCode::kResourceExhausted);
  EXPECT_TRUE(CheckHostMemory(need, need.total() - 1).ToString().find("Config.host_memory_limit") !=
              std::string::npos);
  EXPECT_OK(CheckHostMemory(need, need.total()));
}

// Memory the application frees while it writes initial values is room for
// a shard's state in host memory (allocated table by table as they arrive),
// and for nothing else: the rest of the plan must fit what is available now.
// Config.host_memory_limit counts the engine alone and takes none of it.
TEST(MemoryFreedDuringInitIsRoomForAHostShardStateOnly) {
  HostMemoryNeed need;
  need.parameter_stores = 1000;
  need.staging = 100;
  need.shard_per_branch = 4000;
  need.shard_in_host_memory = true;
  ASSERT_EQ(need.total(), int64_t{5100});
  EXPECT_CODE(CheckHostMemoryAvailable(need, Room(3000), 0), StatusCode::kResourceExhausted);
  EXPECT_OK(CheckHostMemoryAvailable(need, Room(3000), 2100));
  const Status short_by_one = CheckHostMemoryAvailable(need, Room(3000), 2099);
  EXPECT_CODE(short_by_one, StatusCode::kResourceExhausted);
  EXPECT_TRUE(short_by_one.ToString().find("the 2099 B the application frees while it writes initial values") !=
              std::string::npos);
  // No more than the state itself: the plan's own 1100 B must fit now.
  EXPECT_CODE(CheckHostMemoryAvailable(need, Room(1099), 1 << 20), StatusCode::kResourceExhausted);
  EXPECT_OK(CheckHostMemoryAvailable(need, Room(1100), 1 << 20));
  // A state on the device takes no host memory, and the freed bytes count for nothing.
  need.shard_in_host_memory = false;
  EXPECT_OK(CheckHostMemoryAvailable(need, Room(1100), 0));
  EXPECT_CODE(CheckHostMemoryAvailable(need, Room(1099), 1 << 20), StatusCode::kResourceExhausted);
  need.shard_in_host_memory = true;
  EXPECT_CODE(CheckHostMemory(need, 5099, 1 << 20), StatusCode::kResourceExhausted);
}

TEST(ThePreviewGivesTheLeastPoolAndKeepsAFittingPlan) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  std::unique_ptr<IterationPlan> kept;
  PlanPreview preview;
  ASSERT_OK(Preview(ex, WithBudget(2047), &kept, &preview));
  EXPECT_EQ(preview.pool_min_bytes, 2048);
  EXPECT_TRUE(!preview.fits);
  EXPECT_TRUE(kept == nullptr);
  ASSERT_OK(Preview(ex, WithBudget(2048), &kept, &preview));
  EXPECT_TRUE(preview.fits);
  ASSERT_TRUE(kept != nullptr);
  EXPECT_EQ(preview.pool_bytes, 2048);
  EXPECT_EQ(preview.host_store_bytes, 832 + 128);
  // Everything in host memory: the traffic the plan predicts (placement_test's
  // example at the least pool).
  EXPECT_EQ(preview.host_to_device_bytes, kept->placement.traffic.host_to_device());
  EXPECT_EQ(preview.device_to_host_bytes, kept->placement.traffic.device_to_host());
  EXPECT_TRUE(preview.host_to_device_bytes > 0 && preview.device_to_host_bytes > 0);
  EXPECT_EQ(preview.host.total(), kept->placement.host.total());
  EXPECT_TRUE(preview.description.find("host memory") != std::string::npos);
  // Asked again, the kept plan is described, not made again.
  const IterationPlan* first = kept.get();
  PlanPreview again;
  ASSERT_OK(Preview(ex, WithBudget(2048), &kept, &again));
  EXPECT_TRUE(kept.get() == first);
  EXPECT_EQ(again.description, preview.description);
  EXPECT_EQ(again.pool_min_bytes, 2048);
  kept.reset();  // another budget: another plan
  ASSERT_OK(Preview(ex, WithBudget(0), &kept, &preview));
  EXPECT_TRUE(preview.fits);
  EXPECT_EQ(preview.pool_min_bytes, 2048);
  EXPECT_EQ(preview.pool_bytes, 2560);
}

// With prefetch_clocks left to the plan, the least budget is one region's
// pool (1024 B), and the preview says so whether it fits or not; its
// prefetch_clocks is the plan's when it fits.
TEST(ThePreviewOfAChosenPrefetchNamesOneRegionsLeastPool) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  std::unique_ptr<IterationPlan> kept;
  PlanPreview preview;
  ASSERT_OK(Preview(ex, WithBudget(1023, kAutoPrefetchClocks), &kept, &preview));
  EXPECT_TRUE(!preview.fits);
  EXPECT_EQ(preview.pool_min_bytes, 1024);
  EXPECT_EQ(preview.prefetch_clocks, 0);
  // 2047: two regions (2048 B) do not fit, one does, at the full lookahead (1280 B).
  ASSERT_OK(Preview(ex, WithBudget(2047, kAutoPrefetchClocks), &kept, &preview));
  EXPECT_TRUE(preview.fits);
  EXPECT_EQ(preview.prefetch_clocks, 0);
  EXPECT_EQ(preview.pool_min_bytes, 1024);
  EXPECT_EQ(preview.pool_bytes, 1280);
  EXPECT_TRUE(preview.description.find("prefetch_clocks 0 (chosen: the budget of 2047 bytes is below the least "
                                       "pool of two regions (2048 bytes)") != std::string::npos);
  PlanPreview again;  // the kept plan, described the same
  ASSERT_OK(Preview(ex, WithBudget(2047, kAutoPrefetchClocks), &kept, &again));
  EXPECT_EQ(again.pool_min_bytes, 1024);
  EXPECT_EQ(again.prefetch_clocks, 0);
  kept.reset();
  // 2560: two regions take the full lookahead; the least budget is still one region's.
  ASSERT_OK(Preview(ex, WithBudget(2560, kAutoPrefetchClocks), &kept, &preview));
  EXPECT_TRUE(preview.fits);
  EXPECT_EQ(preview.prefetch_clocks, 1);
  EXPECT_EQ(preview.pool_min_bytes, 1024);
  EXPECT_EQ(preview.pool_bytes, 2560);
  EXPECT_EQ(kept->placement.pool_min_bytes, 2048);  // the plan's own regions' least pool
  kept.reset();
  // No budget: two regions, as with prefetch_clocks 1.
  ASSERT_OK(Preview(ex, WithBudget(0, kAutoPrefetchClocks), &kept, &preview));
  EXPECT_EQ(preview.prefetch_clocks, 1);
  EXPECT_EQ(preview.pool_min_bytes, 2048);
  EXPECT_EQ(preview.pool_bytes, 2560);
  kept.reset();
  // The automatic budget (none set, a device of 1000 B, a tenth reserved:
  // 900 B) is below one region's least pool: refused, naming it.
  PlanSite small{0, 1, false, 1000, 1000, false};
  ASSERT_OK(Preview(ex, WithBudget(0, kAutoPrefetchClocks), &kept, &preview, small));
  EXPECT_TRUE(!preview.fits && preview.automatic_budget);
  EXPECT_EQ(preview.budget_bytes, 900);
  EXPECT_EQ(preview.pool_min_bytes, 1024);
  EXPECT_EQ(preview.prefetch_clocks, 0);
  // A device of 1500 B (1350 B after the reserve) holds one region, not two.
  PlanSite larger{0, 1, false, 1500, 1500, false};
  ASSERT_OK(Preview(ex, WithBudget(0, kAutoPrefetchClocks), &kept, &preview, larger));
  EXPECT_TRUE(preview.fits && preview.automatic_budget);
  EXPECT_EQ(preview.prefetch_clocks, 0);
  EXPECT_TRUE(preview.pool_bytes <= 1350);
}

MLT_TEST_MAIN
