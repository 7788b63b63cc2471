// FinishVirtualIteration after a failed FinishVirtualIteration.
//
// A refused budget (kResourceExhausted) or a kReady timeout returns from
// FinishVirtualIteration after the recorder already handed its recording
// over. Recorder::Finish resets the recording but not `clocked_`, so a retry
// gets an EMPTY recording with OK, plans it (peak 0), and succeeds; then
// StartIterations starts an allocator that computes seq / num_ops with
// num_ops == 0 and the process dies with SIGFPE. This test checks the retry
// without starting iterations, so it fails instead of crashing.
#include <memory>
#include <string>

#include "mltuner/cluster.h"
#include "mltuner/engine.h"
#include "test_util.h"

using namespace mltuner;

TEST(RetryAfterRefusedBudgetDoesNotPlanAnEmptyIteration) {
  Config config;
  config.wait_timeout_ms = 2000;
  config.device_memory_budget = 256;  // the pool needs 2 regions of 512 B
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 1, &cluster));
  Engine* e = cluster->worker(0);
  TableId t = -1;
  Handle r = -1;
  ASSERT_OK(e->CreateTable("w", 64, 16, false, &t));
  ASSERT_OK(e->VirtualRead(t, {0, 1, 2, 3, 4, 5, 6, 7}, 0, &r));
  ASSERT_OK(e->VirtualPostRead(r));
  ASSERT_OK(e->VirtualClock());
  const Status first = e->FinishVirtualIteration();
  EXPECT_CODE(first, StatusCode::kResourceExhausted);
  EXPECT_TRUE(first.message().find("1024") != std::string::npos);

  const Status retry = e->FinishVirtualIteration();
  EXPECT_TRUE(!retry.ok());
  if (retry.ok()) {
    // What the retry planned: not the recorded iteration.
    ::mltuner::testing::ReportFailure(__FILE__, __LINE__,
                                      "retry planned an empty iteration: " + e->DescribePlan() +
                                          " (StartIterations now crashes with SIGFPE)");
  }
  EXPECT_OK(cluster->Shutdown());
}

MLT_TEST_MAIN
