// OwnUpdates (read-my-writes) by hand on the CPU backend, against the
// shard's damped-momentum arithmetic in double: this worker's own steps go
// into the cache at once and back over an install of older rows, and the
// other workers' momentum is carried over the clocks the rows lag. When the
// others stop sending updates, their momentum only decays, so the carried
// rows must equal the shard's exactly.
#include "cache/own_updates.h"

#include <cmath>
#include <memory>
#include <vector>

#include "cache/table_store.h"
#include "test_util.h"

namespace mltuner {
namespace {

constexpr int64_t kRows = 2, kWidth = 2, kValues = kRows * kWidth;
constexpr double kLr = 0.5, kMomentum = 0.75;
constexpr int kWorkers = 2;

// The shard: damped momentum over the mean of the workers' updates, and
// each worker's own share of the step (the rule is linear in the updates).
struct Shard {
  std::vector<double> params = {1.0, -2.0, 0.5, 3.0};
  std::vector<double> history = std::vector<double>(kValues, 0.0);
  std::vector<double> own_history = std::vector<double>(kValues, 0.0);
  std::vector<double> own_step = std::vector<double>(kValues, 0.0);

  void Clock(const std::vector<double>& own, const std::vector<double>& other) {
    for (int64_t i = 0; i < kValues; ++i) {
      history[i] = (1 - kMomentum) * (own[i] + other[i]) / kWorkers + kMomentum * history[i];
      params[i] -= kLr * history[i];
      own_history[i] = (1 - kMomentum) * own[i] / kWorkers + kMomentum * own_history[i];
      own_step[i] = -kLr * own_history[i];
    }
  }
};

// A table of kRows x kWidth, all of it on the (CPU) device.
Status MakeStore(const std::shared_ptr<Device>& device, std::unique_ptr<TableStore>* store) {
  TableInfo info;
  info.id = 0;
  info.name = "w";
  info.num_rows = kRows;
  info.row_width = kWidth;
  TablePlacement placement;
  placement.runs.push_back({0, kRows, Residence::kDevice, 0});
  placement.device_rows = kRows;
  return MakeTableStore(device, info, placement, 1, false, store);
}

struct Fixture {
  std::shared_ptr<Device> device{NewCpuDevice()};
  std::unique_ptr<TableStore> store;
  std::unique_ptr<OwnUpdates> own;
  std::vector<WireSegment> segments;

  Fixture() {
    EXPECT_OK(MakeStore(device, &store));
    UpdateRuleConfig rule;
    rule.kind = UpdateRuleKind::kDampedMomentum;
    rule.learning_rate = static_cast<float>(kLr);
    rule.momentum = static_cast<float>(kMomentum);
    own = OwnUpdates::ForTable(device, *store, rule, /*read_slack=*/2, kWorkers, 1);
    WireSegment all;
    all.count = kRows;
    all.residence = Residence::kDevice;
    all.last_position = kRows - 1;
    segments.push_back(all);
  }
  float* cache() const { return store->values(Residence::kDevice); }
  // The shard's rows of clock `age` land in the cache, as RowInstaller does.
  void Install(const std::vector<double>& rows, Clock age) {
    for (int64_t i = 0; i < kValues; ++i) cache()[i] = static_cast<float>(rows[i]);
    EXPECT_OK(own->Reinstall(0, 0, age, segments));
  }
  void Apply(Clock clock, const std::vector<double>& update) {
    std::vector<float> values(update.begin(), update.end());
    OwnUpdates::Rule rule;
    rule.config = own->base_rule();
    EXPECT_OK(own->Apply(0, clock, rule, /*stale=*/true, /*cache_branch=*/0, values.data()));
  }
  void ExpectCache(const std::vector<double>& want, const char* when) const {
    for (int64_t i = 0; i < kValues; ++i) {
      if (std::fabs(cache()[i] - want[i]) > 1e-5) {
        ::mltuner::testing::ReportFailure(__FILE__, __LINE__, std::string(when) + ": value " + std::to_string(i) +
                                                                  " is " + std::to_string(cache()[i]) + ", want " +
                                                                  std::to_string(want[i]));
      }
    }
  }
};

std::vector<double> Gradient(int worker, int clock) {
  std::vector<double> g(kValues);
  for (int64_t i = 0; i < kValues; ++i) g[i] = std::sin(1.3 * worker + 0.7 * clock + 0.4 * static_cast<double>(i));
  return g;
}

TEST(OwnStepsAreSeenAtOnceAndKeptOverOlderRows) {
  Fixture f;
  Shard shard;
  const std::vector<double> none(kValues, 0.0);
  f.Install(shard.params, kInitClock);
  std::vector<std::vector<double>> rows = {shard.params};  // the shard's rows after each clock
  std::vector<double> mine = shard.params;                 // what this worker should see
  for (int clock = 0; clock < 3; ++clock) {
    const std::vector<double> own = Gradient(0, clock);
    f.Apply(clock, own);
    shard.Clock(own, none);  // a lone worker: its own steps are all the steps
    rows.push_back(shard.params);
    f.ExpectCache(shard.params, "after an own step");
  }
  // Rows of clock 0 arrive late: the own steps of clocks 1 and 2 go back on.
  f.Install(rows[1], 0);
  f.ExpectCache(shard.params, "over the rows of clock 0");
  EXPECT_EQ(f.own->steps_applied(), int64_t{3});
}

TEST(OthersMomentumIsCarriedOverTheClocksTheRowsLag) {
  Fixture f;
  Shard shard;
  f.Install(shard.params, kInitClock);
  std::vector<std::vector<double>> rows;  // the shard's rows after each clock
  for (int clock = 0; clock < 6; ++clock) {
    const std::vector<double> own = Gradient(0, clock);
    // The other worker sends for clocks 0 and 1, then nothing: its share
    // of the momentum then only decays, which is what the cache carries.
    const std::vector<double> other = clock < 2 ? Gradient(1, clock) : std::vector<double>(kValues, 0.0);
    f.Apply(clock, own);
    shard.Clock(own, other);
    rows.push_back(shard.params);
    // The shard's rows arrive two clocks late (clock c's after this
    // worker's step of clock c + 2), and then not at all: the cache carries
    // the momentum on by itself.
    if (clock == 2 || clock == 3) f.Install(rows[clock - 2], clock - 2);
    // From the second install on (two consecutive ones give the others'
    // step at clock 1, their last update), the cache is the shard's state.
    if (clock >= 3) f.ExpectCache(shard.params, ("clock " + std::to_string(clock)).c_str());
  }
}

TEST(AdamIsNotMirrored) {
  std::shared_ptr<Device> device(NewCpuDevice());
  std::unique_ptr<TableStore> store;
  ASSERT_OK(MakeStore(device, &store));
  UpdateRuleConfig adam;
  adam.kind = UpdateRuleKind::kAdam;
  EXPECT_TRUE(OwnUpdates::ForTable(device, *store, adam, 2, kWorkers, 1) == nullptr);
  UpdateRuleConfig decay;
  decay.kind = UpdateRuleKind::kSgd;
  decay.weight_decay = 1e-4f;
  EXPECT_TRUE(OwnUpdates::ForTable(device, *store, decay, 2, kWorkers, 1) == nullptr);
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
